//! What the caller reads speaks the caller's terms: the log names objects by the caller's tags
//! (not the batch's positions), a rejection counts under the engine that refused it (never
//! `unrouted` for a routed pair), and errors name endpoints by their labels or file paths.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use tracing_subscriber::fmt::MakeWriter;
use umbp_composite::{
    restore, ChecksumPolicy, CompositeConfig, CompositeEngine, ObjectRange, ObjectTransfer,
    PagedObject, Staging, TransferReport,
};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    DeviceOrdinal, EndpointId, EndpointRegistry, ObjectState, Register, Registration,
    TransferEngine,
};
use umbp_ssd::{SsdConfig, SsdEngine};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);
const PAGE: u64 = 64 << 10;

/// Everything the process logs at debug and above, from every thread (the composite settles
/// parts on its executor's threads). Tests look only for their own tags in it.
fn log() -> &'static Mutex<Vec<u8>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::fmt()
            .with_writer(Sink(Arc::clone(&log)))
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        log
    })
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Sink {
    type Writer = Sink;

    fn make_writer(&'a self) -> Sink {
        self.clone()
    }
}

fn logged() -> String {
    String::from_utf8_lossy(&log().lock().unwrap()).into_owned()
}

/// A composite of [host copies, simulated device, SSD] with a staged route (file -> device
/// goes through host memory), a 1 MiB DRAM tier, a 1 MiB file tier registered by path, and
/// 256 KiB of device memory labelled `kv-cache`.
struct Rig {
    composite: CompositeEngine,
    path: PathBuf,
    dram: Registration<Vec<u8>>,
    file: Registration<std::fs::File>,
    kv: Registration,
    _bounce: Registration<Vec<u8>>,
    _dir: tempfile::TempDir,
}

fn rig(checksums: ChecksumPolicy) -> Rig {
    let _ = log();
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default()).unwrap());
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd];
    let config = CompositeConfig { checksums, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, engines, config);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("tier.bin");
    std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
    let file = composite.register_file(path.as_path(), 0, 1 << 20).unwrap();
    let dram = composite.register_memory(vec![9u8; 1 << 20]).unwrap();
    let bounce = composite.register_memory(vec![0u8; 4 << 20]).unwrap();
    bounce.set_label("bounce");
    composite.set_staging(Staging::new(bounce.id())).unwrap();
    let kv = hbm.alloc_device(GPU, 256 << 10).unwrap();
    kv.set_label("kv-cache");
    Rig { composite, path, dram, file, kv, _bounce: bounce, _dir: dir }
}

impl Rig {
    /// Restores `objects`: (caller's tag, tier, two page offsets, offset in the KV cache).
    fn restore(&self, objects: &[(u64, EndpointId, [u64; 2], u64)]) -> TransferReport {
        let ranges: Vec<[ObjectRange; 1]> =
            objects.iter().map(|o| [ObjectRange::new(0, 2 * PAGE, self.kv.id(), o.3)]).collect();
        let transfers: Vec<ObjectTransfer<'_>> = objects
            .iter()
            .zip(&ranges)
            .map(|(o, r)| {
                let object = PagedObject::new(o.1, &o.2, PAGE, 2 * PAGE);
                ObjectTransfer::new(o.0, object, r)
            })
            .collect();
        restore(&mut self.composite.builder(), &transfers).unwrap()
    }

    fn rejected_under(&self, engine: &str, direction: &str) -> u64 {
        let snapshot = self.composite.metrics_snapshot();
        snapshot.get(&(engine.to_string(), direction.to_string())).map_or(0, |c| c.rejected_objects)
    }
}

#[test]
fn the_log_names_a_rejected_object_by_the_callers_tag() {
    let rig = rig(ChecksumPolicy::default());
    // The second object (position 1) reads a page past the end of the DRAM tier.
    let tag = 0x5EED_0000_0000_0001;
    let report = rig.restore(&[
        (41, rig.dram.id(), [0, PAGE], 0),
        (tag, rig.dram.id(), [0, 1 << 20], 2 * PAGE),
    ]);
    assert_eq!(report.object(41).unwrap().state, ObjectState::Completed);
    assert_eq!(report.object(tag).unwrap().state, ObjectState::Rejected);
    let log = logged();
    let line = log
        .lines()
        .find(|l| l.contains("object rejected") && l.contains(&format!("tag={tag}")))
        .unwrap_or_else(|| panic!("no rejection logged with the caller's tag {tag}:\n{log}"));
    assert!(line.contains("out"), "{line}");
    assert!(!log.lines().any(|l| l.contains("object rejected") && l.contains("tag=1 ")), "{log}");
}

#[test]
fn the_log_names_an_object_that_failed_its_checksum_by_the_callers_tag() {
    let rig = rig(ChecksumPolicy::AllTiers);
    let tag = 0x5EED_0000_0000_0002;
    let ranges = [ObjectRange::new(0, 2 * PAGE, rig.kv.id(), 0)];
    let pages = [0, PAGE];
    let object = PagedObject::new(rig.dram.id(), &pages, PAGE, 2 * PAGE);
    let transfers = [ObjectTransfer::new(tag, object, &ranges).with_checksum(0xDEAD_BEEF)];
    let report = restore(&mut rig.composite.builder(), &transfers).unwrap();
    assert_eq!(report.objects[0].state, ObjectState::Failed, "{report:?}");
    let log = logged();
    assert!(
        log.lines()
            .any(|l| l.contains("failed their checksum") && l.contains(&format!("tag={tag}"))),
        "no checksum failure logged with the caller's tag {tag}:\n{log}"
    );
}

#[test]
fn an_out_of_range_rejection_counts_under_the_engine_that_refused_it() {
    let rig = rig(ChecksumPolicy::Off);
    // Staged (file -> bounce -> device): the file's side is out of range, so the first hop's
    // engine (ssd) refuses it. Direct (DRAM -> device): the device engine refuses a range
    // past the KV cache.
    let report = rig.restore(&[
        (21, rig.file.id(), [0, 1 << 20], 0),
        (22, rig.dram.id(), [0, PAGE], 255 << 10),
    ]);
    assert!(report.objects.iter().all(|o| o.state == ObjectState::Rejected), "{report:?}");
    assert_eq!(rig.rejected_under("ssd", "file->device"), 1);
    assert_eq!(rig.rejected_under("hbm", "host->device"), 1);
    assert_eq!(rig.rejected_under("unrouted", "file->device"), 0);
    let text = rig.composite.metrics_text();
    assert!(!text.contains("engine=\"unrouted\""), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("umbp_rejected_objects_total{")
            && l.contains("engine=\"ssd\"")
            && l.contains("reason=\"out_of_bounds\"")
            && l.ends_with(" 1")),
        "{text}"
    );
}

#[test]
fn errors_name_endpoints_by_label_or_path() {
    let rig = rig(ChecksumPolicy::Off);
    let path = rig.path.to_string_lossy().into_owned();
    assert_eq!(rig.file.label().as_deref(), Some(path.as_str()));
    assert_eq!(rig.kv.label().as_deref(), Some("kv-cache"));
    let report = rig.restore(&[
        // A page past the end of the file tier.
        (31, rig.file.id(), [0, 1 << 20], 0),
        // A range past the end of the KV cache.
        (32, rig.dram.id(), [0, PAGE], 255 << 10),
    ]);
    let message = |tag| report.object(tag).unwrap().error.as_ref().unwrap().to_string();
    assert!(message(31).contains(&format!("\"{path}\"")), "{}", message(31));
    assert!(message(32).contains("\"kv-cache\""), "{}", message(32));
    for tag in [31, 32] {
        assert!(!message(tag).contains("endpoint "), "{}", message(tag));
    }
    let rejection = report.object(32).unwrap().error.as_ref().unwrap().rejection().unwrap();
    assert!(rejection.starts_with("bytes ") && rejection.contains("\"kv-cache\""), "{rejection}");

    // A failure in flight: the file shrinks under its registration, so the read comes up short.
    std::fs::OpenOptions::new().write(true).open(&rig.path).unwrap().set_len(PAGE).unwrap();
    let report = rig.restore(&[(33, rig.file.id(), [PAGE, 2 * PAGE], 0)]);
    let error = report.objects[0].error.as_ref().expect("the short read fails the object");
    let text = error.to_string();
    // Its first hop failed: the file into the bounce region, which the rig labelled.
    assert!(text.contains(&format!("\"{path}\"")) && text.contains("\"bounce\""), "{text}");
    assert!(!text.contains("endpoint "), "{text}");

    // An unlabelled endpoint keeps its id.
    let report = rig.restore(&[(34, rig.dram.id(), [0, 1 << 20], 0)]);
    let text = report.objects[0].error.as_ref().unwrap().to_string();
    assert!(text.contains("endpoint "), "{text}");
}
