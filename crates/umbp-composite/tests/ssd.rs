//! Batches that span DRAM and SSD: the SSD engine for file <-> host, the staged route for
//! file -> device, and failures attributed to the right objects.

mod support;

use support::tiered::*;
use support::*;
use umbp_composite::{restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_hbm::DeviceFault;
use umbp_plan::{BatchState, Endpoint, EndpointId, ObjectState};
use umbp_ssd::IoFault;

#[test]
fn a_mixed_dram_and_ssd_batch_into_device_and_host_memory_is_exact() {
    let (objects, per) = (64usize, 4usize);
    let tier_pages = objects / 2 * per;
    let mut t = tiered(tier_pages, true);
    let size = per as u64 * PAGE;
    let dev = device(&t.hbm, objects as u64 * size);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let mut out = vec![POISON; objects * size as usize];
    // SAFETY: `out` outlives the restore.
    let out_id = unsafe {
        register(&t.composite, Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64)).unwrap()
    };
    let tables: Vec<Vec<u64>> = (0..objects).map(|o| page_table(o / 2, per, tier_pages)).collect();
    // Object o: from DRAM (even) or SSD (odd); to the device (o % 4 < 2) or host memory; one
    // range leaving the first 1,000 bytes of the object out.
    let ranges: Vec<[ObjectRange; 1]> = (0..objects)
        .map(|o| {
            let dst = if o % 4 < 2 { dev.id } else { out_id };
            [ObjectRange::new(1000, size - 1000, dst, o as u64 * size + 1000)]
        })
        .collect();
    let batch: Vec<ObjectTransfer> = (0..objects)
        .map(|o| {
            ObjectTransfer::new(
                o as u64,
                PagedObject::new(
                    if o % 2 == 0 { t.dram_id } else { t.file_id },
                    &tables[o],
                    PAGE,
                    size,
                ),
                &ranges[o],
            )
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &batch).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{:?}", report);
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let target: &[u8] = if o % 4 < 2 { &device } else { &out };
        let tier: &[u8] = if o % 2 == 0 { &t.dram } else { &t.file };
        let base = o * size as usize;
        assert_eq!(
            &target[base + 1000..base + size as usize],
            object_bytes(tier, table, 1000, size - 1000),
            "object {o}"
        );
        assert!(
            target[base..base + 1000].iter().all(|&x| x == POISON),
            "object {o}: bytes outside its range"
        );
    }
    let metrics = t.composite.metrics_snapshot();
    for key in [("localcopy", "host->host"), ("hbm", "host->device"), ("ssd", "file->host")] {
        let found =
            metrics.iter().any(|((e, d), c)| e.contains(key.0) && d == key.1 && c.bytes > 0);
        assert!(found, "metrics for {key:?}: {metrics:?}");
    }
    t.dram.clear();
}

#[test]
fn an_injected_ssd_read_error_fails_only_its_object() {
    let per = 4usize;
    let t = tiered(16, false);
    let size = per as u64 * PAGE;
    let mut out = vec![POISON; 4 * size as usize];
    // SAFETY: `out` outlives the restore.
    let out_id = unsafe {
        register(&t.composite, Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64)).unwrap()
    };
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, per, 16)).collect();
    // Fail the read of object 2's third page.
    t.ssd.inject_fault(IoFault::read_covering(t.file_id, tables[2][2], EIO));
    let states = restore_file_objects(&t, out_id, &tables);
    assert_eq!(
        states,
        [
            ObjectState::Completed,
            ObjectState::Completed,
            ObjectState::Failed,
            ObjectState::Completed
        ]
    );
    for o in [0usize, 1, 3] {
        let base = o * size as usize;
        assert_eq!(&out[base..base + size as usize], object_bytes(&t.file, &tables[o], 0, size));
    }
    // The failed page's destination was never written.
    let failed_page = 2 * size as usize + 2 * PAGE as usize;
    assert!(out[failed_page..failed_page + PAGE as usize].iter().all(|&x| x == POISON));
}

/// `EIO`.
const EIO: i32 = 5;

/// Restores objects 0..4 (pages `tables`) from the SSD file, whole, into `endpoint` at
/// `o × size`; returns each object's state.
fn restore_file_objects(t: &Tiered, endpoint: EndpointId, tables: &[Vec<u64>]) -> Vec<ObjectState> {
    let size = 4 * PAGE;
    let ranges: Vec<[ObjectRange; 1]> =
        (0..4).map(|o| [ObjectRange::new(0, size, endpoint, o as u64 * size)]).collect();
    let batch: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            ObjectTransfer::new(
                o as u64,
                PagedObject::new(t.file_id, &tables[o], PAGE, size),
                &ranges[o],
            )
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &batch).unwrap();
    report.objects.iter().map(|r| r.state).collect()
}

#[test]
fn ssd_to_device_goes_through_the_bounce_region_in_stages() {
    let t = tiered(16, true);
    let dev = device(&t.hbm, 16 * PAGE);
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 4, 16)).collect();
    let states = restore_file_objects(&t, dev.id, &tables);
    assert!(states.iter().all(|&s| s == ObjectState::Completed), "{states:?}");
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let base = o * 4 * PAGE as usize;
        assert_eq!(
            &device[base..base + 4 * PAGE as usize],
            object_bytes(&t.file, table, 0, 4 * PAGE)
        );
    }
    // 256 KiB in stages of at most 64 KiB: several first and second hops.
    let m = t.composite.metrics_snapshot();
    let hop1 =
        m.iter().find(|((e, d), _)| e.contains("ssd") && d == "file->host").map(|(_, c)| c.bytes);
    let hop2 = m.iter().find(|((e, d), _)| e == "hbm" && d == "host->device").map(|(_, c)| c.bytes);
    assert_eq!((hop1, hop2), (Some(16 * PAGE), Some(16 * PAGE)));
}

#[test]
fn a_failure_in_either_hop_fails_only_its_object() {
    // First hop: an SSD read of object 1 fails; its bytes never reach the device.
    let t = tiered(16, false);
    let dev = device(&t.hbm, 16 * PAGE);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 4, 16)).collect();
    t.ssd.inject_fault(IoFault::read_covering(t.file_id, tables[1][0], EIO));
    let states = restore_file_objects(&t, dev.id, &tables);
    assert_eq!(
        states,
        [
            ObjectState::Completed,
            ObjectState::Failed,
            ObjectState::Completed,
            ObjectState::Completed
        ]
    );
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    assert!(device[4 * PAGE as usize..8 * PAGE as usize].iter().all(|&x| x == POISON));
    t.ssd.clear_faults();

    // Second hop: the first device copy fails (the bounce is not pinned, so the hop copies);
    // exactly the objects of that copy fail, the others arrive.
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    t.hbm.runtime().inject(DeviceFault::Copy);
    let states = restore_file_objects(&t, dev.id, &tables);
    let failed: Vec<usize> = (0..4).filter(|&o| states[o] == ObjectState::Failed).collect();
    assert_eq!(failed.len(), 1, "{states:?}");
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let base = o * 4 * PAGE as usize;
        if states[o] == ObjectState::Completed {
            assert_eq!(
                &device[base..base + 4 * PAGE as usize],
                object_bytes(&t.file, table, 0, 4 * PAGE)
            );
        }
    }
}

/// Writes into a FIFO once dropped, or after `Unstick::AFTER` from a watchdog thread, so that
/// reads stuck on it complete whatever the test asserted (the engines can then be dropped).
struct Unstick(std::path::PathBuf);

impl Unstick {
    const AFTER: std::time::Duration = std::time::Duration::from_secs(10);
    const BYTES: usize = 16 << 10;

    fn write(path: &std::path::Path) {
        // The composite's descriptor reads the FIFO, so opening it to write does not wait; a
        // FIFO gone with its directory is simply not found.
        if let Ok(mut fifo) = std::fs::OpenOptions::new().write(true).open(path) {
            let _ = std::io::Write::write_all(&mut fifo, &[0x5A; Self::BYTES]);
        }
    }

    fn arm(path: &std::path::Path) -> Self {
        let watched = path.to_path_buf();
        std::thread::spawn(move || {
            std::thread::sleep(Self::AFTER);
            Self::write(&watched);
        });
        Self(path.to_path_buf())
    }
}

impl Drop for Unstick {
    fn drop(&mut self) {
        Self::write(&self.0);
    }
}

#[test]
fn cancel_of_a_batch_stuck_in_ssd_reads_cancels_them_in_the_kernel() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use umbp_composite::{CompositeEngine, ObjectError, Staging};
    use umbp_plan::{EndpointRegistry, FileOptions, FileSource, Fragment, Register, Tag};
    use umbp_ssd::{Backend, SsdConfig, SsdEngine};

    let test = "cancel_of_a_batch_stuck_in_ssd_reads_cancels_them_in_the_kernel";
    let registry = EndpointRegistry::new();
    let ssd = match SsdEngine::new(
        registry.clone(),
        SsdConfig { backend: Backend::IoUring, ..SsdConfig::default() },
    ) {
        Ok(ssd) => Arc::new(ssd),
        Err(e) => return eprintln!("skipped {test}: no io_uring ({e})"),
    };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("stuck.fifo");
    let made = std::process::Command::new("mkfifo").arg(&path).status();
    if !made.as_ref().is_ok_and(|s| s.success()) {
        return eprintln!("skipped {test}: mkfifo failed: {made:?}");
    }
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let config = umbp_hbm::HbmConfig { pin_registered_host: Some(GPU), ..Default::default() };
    let hbm = Arc::new(umbp_hbm::HbmEngine::new(
        Arc::new(umbp_hbm::SimDevice::new(1)),
        registry.clone(),
        config,
    ));
    let composite = CompositeEngine::new(registry, vec![host, hbm.clone(), ssd]);
    let bounce = composite.register_memory(vec![0u8; 64 << 10]).unwrap();
    composite.set_staging(Staging::new(bounce.id()).with_stage_bytes(16 << 10)).unwrap();
    // A FIFO nobody writes: every read of it waits in the kernel.
    let source = FileSource::open(&path, FileOptions::new().direct(false));
    let fifo = composite.register_file(source, 0, 1 << 20).unwrap();
    let _unstick = Unstick::arm(&path);
    let mut out = vec![POISON; 4096];
    // SAFETY: `out` outlives the batch, which is waited for below.
    let out_id = unsafe {
        register(&composite, Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64)).unwrap()
    };
    let dev = device(&hbm, 4096);
    hbm.runtime().fill(dev.addr, 4096, POISON).unwrap();
    // Object 0 reads the FIFO into host memory (the SSD engine, direct); object 1 into the
    // device (staged: its first hop, the SSD engine's read into the bounce region, waits).
    let mut b = composite.builder();
    for (tag, dst) in [(0, out_id), (1, dev.id)] {
        let tag = Tag::new(tag);
        b.begin_object(tag).unwrap();
        b.push(Fragment::new(fifo.id(), 0, dst, 0, 4096, tag)).unwrap();
        b.commit_object().unwrap();
    }
    let batch = composite.submit(b.finish().unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!batch.is_done(), "a read of the empty FIFO completed");
    let started = Instant::now();
    let report = batch.cancel();
    let took = started.elapsed();
    println!("cancel of a batch stuck in two SSD reads (one direct, one staged) took {took:?}");
    // Generous: a loaded machine cannot fail it, while a cancel that waited for the reads
    // would wait for the watchdog's bytes (10 s).
    assert!(took < Duration::from_secs(5), "cancel waited for the stuck reads: {took:?}");
    for o in &report.objects {
        assert_eq!((o.state, &o.error), (ObjectState::Cancelled, &Some(ObjectError::Cancelled)));
    }
    assert!(out.iter().all(|&b| b == POISON), "the FIFO gave nothing");
    let device = hbm.runtime().read(dev.addr, dev.len).unwrap();
    assert!(device.iter().all(|&b| b == POISON), "the FIFO gave nothing");
}
