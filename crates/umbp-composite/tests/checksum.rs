//! Block checksums: offloads report the CRC32C of the bytes they wrote, restores given one
//! verify it, and a block whose bytes changed in its tier fails exactly that block, on every
//! route (staged SSD -> device, direct SSD -> host, DRAM -> host and device), from any number
//! of threads, with layer groups. Where the engine hashes while copying (the simulated
//! device), the composite takes its checksums and hashes nothing itself; an engine that
//! reports wrong or no checksums fails its objects closed.

mod support;

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use proptest::prelude::*;
use support::{device, pattern, Dev, GPU, POISON};
use umbp_composite::{
    offload, restore, start_restore, ChecksumPolicy, CompositeConfig, CompositeEngine, ObjectError,
    ObjectRange, ObjectTransfer, PagedObject, Staging,
};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::checksum::CopyHashes;
use umbp_plan::{
    BatchState, Endpoint, EndpointId, EndpointRegistry, EngineError, FailureCause, Fragment,
    ObjectState, PlanBuilder, PlanSet, Register, Registration, Tag, TransferEngine, TransferHandle,
};
use umbp_ssd::{SsdConfig, SsdEngine};

const PAGE: u64 = 16 << 10;

/// A DRAM arena and an SSD file of `pages` pages each behind one composite of [host copies,
/// device, SSD] with `policy`, and a bounce region cut in stages of `stage` bytes.
struct Fx {
    composite: CompositeEngine,
    hbm: Arc<HbmEngine<SimDevice>>,
    _file: Registration<std::fs::File>,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
    dram: Vec<u8>,
    dram_id: EndpointId,
    file_id: EndpointId,
    _bounce: Vec<u8>,
}

fn fixture(pages: usize, policy: ChecksumPolicy, stage: u64) -> Fx {
    fixture_with(pages, policy, stage, |hbm| hbm)
}

/// [`fixture`], with the device engine the composite uses made by `device` from the
/// simulated one.
fn fixture_with(
    pages: usize,
    policy: ChecksumPolicy,
    stage: u64,
    device: impl FnOnce(Arc<HbmEngine<SimDevice>>) -> Arc<dyn TransferEngine>,
) -> Fx {
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default()).unwrap());
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, device(hbm.clone()), ssd];
    let config = CompositeConfig { checksums: policy, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, engines, config);
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let len = pages * PAGE as usize;
    let path = dir.path().join("tier.bin");
    std::fs::File::create(&path).unwrap().write_all(&pattern(len, 77)).unwrap();
    let file = composite.register_file(path.as_path(), 0, len as u64).unwrap();
    let file_id = file.id();
    let mut dram = pattern(len, 11);
    let mut bounce = vec![0u8; (4 * stage) as usize];
    // SAFETY: both buffers live in the returned fixture, alive for every transfer of the test,
    // and are written only between transfers.
    let (dram_id, bounce_id) = unsafe {
        (
            support::register(&composite, Endpoint::host(dram.as_mut_ptr() as u64, len as u64))
                .unwrap(),
            support::register(
                &composite,
                Endpoint::host(bounce.as_mut_ptr() as u64, bounce.len() as u64),
            )
            .unwrap(),
        )
    };
    composite.set_staging(Staging::new(bounce_id).with_stage_bytes(stage)).unwrap();
    Fx { composite, hbm, _file: file, path, _dir: dir, dram, dram_id, file_id, _bounce: bounce }
}

impl Fx {
    /// Registers `bytes`, which the caller keeps alive and untouched while transfers use
    /// them, until the guard drops.
    fn host(&self, bytes: &mut [u8]) -> Registration {
        let endpoint = Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
        // SAFETY: every test drops the guard before the buffer, and touches the buffer only
        // between transfers.
        unsafe { self.composite.register_raw_memory(endpoint) }.unwrap()
    }

    /// A device buffer holding `bytes`, copied there through the composite.
    fn device_with(&self, bytes: &mut [u8]) -> Dev {
        let dev = device(&self.hbm, bytes.len() as u64);
        let registration = self.host(bytes);
        let src = registration.id();
        let mut builder = self.composite.builder();
        builder.begin_object(Tag::new(0)).unwrap();
        builder.push(Fragment::new(src, 0, dev.id, 0, bytes.len() as u64, Tag::new(0))).unwrap();
        builder.commit_object().unwrap();
        let report = self.composite.submit(builder.finish().unwrap()).unwrap().wait();
        assert_eq!(report.aggregate, BatchState::Completed);
        dev
    }

    /// Changes one byte of the SSD tier at `offset`, behind the engines' back.
    fn corrupt_file(&self, offset: u64) {
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&self.path).unwrap();
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, offset).unwrap();
        file.write_all_at(&[byte[0] ^ 0x10], offset).unwrap();
        file.sync_all().unwrap();
    }
}

/// Page table of object `o`: `per` pages scattered over a tier of `tier_pages`.
fn table(o: usize, per: usize, tier_pages: usize) -> Vec<u64> {
    (0..per).map(|k| (((o * per + k) * 7 + 3) % tier_pages) as u64 * PAGE).collect()
}

/// Byte `b` of an object stored in `tier` with `table`.
fn stored(tier: &[u8], table: &[u64], page: u64, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(|b| tier[(table[(b / page) as usize] + b % page) as usize]).collect()
}

fn object<'a>(tier: EndpointId, table: &'a [u64], size: u64) -> PagedObject<'a> {
    PagedObject::new(tier, table, PAGE, size)
}

/// Whole objects of `per` pages: offload `objects` objects from `src` (a host buffer holding
/// them back to back) into `tier`; returns the checksums the offload reported, checked against
/// the CRC32C of the source bytes.
fn save(fx: &Fx, tier: EndpointId, tables: &[Vec<u64>], src: &mut [u8]) -> Vec<u32> {
    let size = src.len() as u64 / tables.len() as u64;
    let registration = fx.host(src);
    let src_id = registration.id();
    let ranges: Vec<[ObjectRange; 1]> =
        (0..tables.len()).map(|o| [ObjectRange::new(0, size, src_id, o as u64 * size)]).collect();
    let objects: Vec<ObjectTransfer> = (0..tables.len())
        .map(|o| ObjectTransfer::new(o as u64, object(tier, &tables[o], size), &ranges[o]))
        .collect();
    let report = offload(&mut fx.composite.builder(), &objects).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    report
        .objects
        .iter()
        .enumerate()
        .map(|(o, r)| {
            let bytes = &src[o * size as usize..(o + 1) * size as usize];
            assert_eq!(r.checksum, Some(crc32c::crc32c(bytes)), "object {o}");
            r.checksum.unwrap()
        })
        .collect()
}

/// The failed object's checksum failure, or `None`.
fn mismatch(error: &Option<ObjectError>) -> Option<(u32, u32)> {
    match error {
        Some(ObjectError::Failed {
            cause: FailureCause::ChecksumMismatch { expected, actual },
            ..
        }) => Some((*expected, *actual)),
        _ => None,
    }
}

/// Saves three objects into `tier` from host memory, corrupts one byte of object 1 with
/// `corrupt`, restores all three with their checksums into `dst` (host or device, `len`
/// bytes): object 1 fails with the mismatch, its siblings complete with the right bytes.
fn corrupted_restore(
    fx: &mut Fx,
    tier: EndpointId,
    dst: EndpointId,
    read_dst: &dyn Fn() -> Vec<u8>,
    corrupt: &dyn Fn(&mut Fx, u64),
) {
    let (per, tier_pages) = (3usize, 32usize);
    let size = per as u64 * PAGE;
    let tables: Vec<Vec<u64>> = (0..3).map(|o| table(o, per, tier_pages)).collect();
    let mut src = pattern(3 * size as usize, 5);
    let sums = save(fx, tier, &tables, &mut src);
    // Byte 100 of object 1's second page.
    corrupt(fx, tables[1][1] + 100);
    let ranges: Vec<[ObjectRange; 2]> = (0..3u64)
        .map(|o| {
            [
                ObjectRange::new(0, PAGE + 50, dst, o * size),
                ObjectRange::new(PAGE + 50, size - PAGE - 50, dst, o * size + PAGE + 50),
            ]
        })
        .collect();
    let objects: Vec<ObjectTransfer> = (0..3)
        .map(|o| {
            ObjectTransfer::new(o as u64, object(tier, &tables[o], size), &ranges[o])
                .with_checksum(sums[o])
        })
        .collect();
    let before = fx.composite.metrics().checksum_mismatches();
    let report = restore(&mut fx.composite.builder(), &objects).unwrap();
    let states: Vec<ObjectState> = report.objects.iter().map(|r| r.state).collect();
    assert_eq!(
        states,
        [ObjectState::Completed, ObjectState::Failed, ObjectState::Completed],
        "{report:?}"
    );
    let (expected, actual) = mismatch(&report.objects[1].error).expect("a checksum mismatch");
    assert_eq!(expected, sums[1]);
    assert_ne!(actual, sums[1]);
    assert_eq!(report.objects[1].checksum, Some(actual));
    assert_eq!(report.objects[0].checksum, Some(sums[0]));
    assert_eq!(fx.composite.metrics().checksum_mismatches(), before + 1);
    assert!(fx.composite.metrics_text().contains("umbp_checksum_mismatches_total"));
    let bytes = read_dst();
    for o in [0usize, 2] {
        let at = o * size as usize;
        assert_eq!(bytes[at..at + size as usize], src[at..at + size as usize], "object {o}");
    }
}

#[test]
fn a_corrupted_ssd_block_fails_alone_on_the_staged_route_to_the_device() {
    let mut fx = fixture(32, ChecksumPolicy::FilesAndRemote, 20 << 10);
    let dev = device(&fx.hbm, 3 * 3 * PAGE);
    fx.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let (hbm, addr, len) = (fx.hbm.clone(), dev.addr, dev.len);
    let read = move || hbm.runtime().read(addr, len).unwrap();
    let tier = fx.file_id;
    corrupted_restore(&mut fx, tier, dev.id, &read, &|fx, at| fx.corrupt_file(at));
}

#[test]
fn a_corrupted_ssd_block_fails_alone_on_the_direct_route_to_host_memory() {
    let mut fx = fixture(32, ChecksumPolicy::FilesAndRemote, 64 << 10);
    let mut out = vec![POISON; 3 * 3 * PAGE as usize];
    let out_registration = fx.host(&mut out);
    let out_id = out_registration.id();
    let (addr, len) = (out.as_ptr() as usize, out.len());
    // SAFETY: `out` outlives the restore and is read only after it settled.
    let read = move || unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    let tier = fx.file_id;
    corrupted_restore(&mut fx, tier, out_id, &read, &|fx, at| fx.corrupt_file(at));
}

#[test]
fn a_corrupted_dram_block_fails_alone_into_host_and_device_memory() {
    let mut fx = fixture(32, ChecksumPolicy::AllTiers, 64 << 10);
    let corrupt = |fx: &mut Fx, at: u64| fx.dram[at as usize] ^= 0x10;
    let mut out = vec![POISON; 3 * 3 * PAGE as usize];
    let out_registration = fx.host(&mut out);
    let out_id = out_registration.id();
    let (addr, len) = (out.as_ptr() as usize, out.len());
    // SAFETY: `out` outlives the restore and is read only after it settled.
    let read = move || unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    let tier = fx.dram_id;
    corrupted_restore(&mut fx, tier, out_id, &read, &corrupt);

    let dev = device(&fx.hbm, 3 * 3 * PAGE);
    let (hbm, addr, len) = (fx.hbm.clone(), dev.addr, dev.len);
    let read = move || hbm.runtime().read(addr, len).unwrap();
    corrupted_restore(&mut fx, tier, dev.id, &read, &corrupt);
}

#[test]
fn policies_decide_which_tiers_are_checked() {
    for (policy, checks_dram, checks_file) in [
        (ChecksumPolicy::Off, false, false),
        (ChecksumPolicy::FilesAndRemote, false, true),
        (ChecksumPolicy::AllTiers, true, true),
    ] {
        let fx = fixture(8, policy, 64 << 10);
        let mut out = vec![0u8; 2 * PAGE as usize];
        let out_registration = fx.host(&mut out);
        let out_id = out_registration.id();
        let tables = [vec![0], vec![PAGE]];
        for (tier, checked) in [(fx.dram_id, checks_dram), (fx.file_id, checks_file)] {
            let ranges: Vec<[ObjectRange; 1]> =
                (0..2u64).map(|o| [ObjectRange::new(0, PAGE, out_id, o * PAGE)]).collect();
            // A wrong checksum: refused where the tier is checked, not looked at elsewhere.
            let objects: Vec<ObjectTransfer> = (0..2)
                .map(|o| {
                    ObjectTransfer::new(o as u64, object(tier, &tables[o], PAGE), &ranges[o])
                        .with_checksum(0xDEAD_BEEF)
                })
                .collect();
            let report = restore(&mut fx.composite.builder(), &objects).unwrap();
            for r in &report.objects {
                assert_eq!(mismatch(&r.error).is_some(), checked, "{policy:?}: {r:?}");
                assert_eq!(r.checksum.is_some(), checked, "{policy:?}: {r:?}");
            }
            // Offloads report a checksum where the tier is covered.
            let mut src = pattern(PAGE as usize, 3);
            let src_registration = fx.host(&mut src);
            let src_id = src_registration.id();
            let range = [ObjectRange::new(0, PAGE, src_id, 0)];
            let one = [ObjectTransfer::new(7, object(tier, &tables[0], PAGE), &range)];
            let report = offload(&mut fx.composite.builder(), &one).unwrap();
            assert_eq!(report.aggregate, BatchState::Completed);
            let want = checked.then(|| crc32c::crc32c(&src));
            assert_eq!(report.objects[0].checksum, want, "{policy:?}");
        }
    }
}

/// The simulated device engine with what it says about hashing changed: whether it claims to
/// hash while copying, and what it reports for each piece (the CRC it computed, changed by
/// `report`, or nothing).
struct Reporting {
    inner: Arc<HbmEngine<SimDevice>>,
    claims: bool,
    report: fn(u32) -> Option<u32>,
}

impl Reporting {
    fn wrap(
        claims: bool,
        report: fn(u32) -> Option<u32>,
    ) -> impl FnOnce(Arc<HbmEngine<SimDevice>>) -> Arc<dyn TransferEngine> {
        move |inner| Arc::new(Self { inner, claims, report })
    }
}

impl TransferEngine for Reporting {
    fn name(&self) -> &str {
        "reporting"
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.inner.can_handle(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        self.inner.plan(fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        self.inner.builder()
    }

    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        self.inner.endpoint_registered(id, endpoint)
    }

    fn endpoint_deregistering(&self, id: EndpointId) {
        self.inner.endpoint_deregistering(id);
    }

    fn hashes_while_copying(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.claims && self.inner.hashes_while_copying(src, dst)
    }

    fn submit(&self, mut plans: PlanSet) -> TransferHandle {
        if let Some(sink) = plans.copy_hashes().cloned() {
            let report = self.report;
            plans.set_copy_hashes(Some(CopyHashes::new(move |plan, tag, piece, crc| {
                if let Some(crc) = report(crc) {
                    sink.copied(plan, tag, piece, crc);
                }
            })));
        }
        self.inner.submit(plans)
    }
}

/// Three DRAM objects saved with the true checksums, then restored into device memory through
/// an engine that reports `report` of each piece's CRC: what each object's error is.
fn restore_reported(report: fn(u32) -> Option<u32>) -> Vec<Option<ObjectError>> {
    let truthful = fixture(32, ChecksumPolicy::AllTiers, 64 << 10);
    let (per, size) = (3usize, 3 * PAGE);
    let tables: Vec<Vec<u64>> = (0..3).map(|o| table(o, per, 32)).collect();
    let mut src = pattern(3 * size as usize, 21);
    let sums = save(&truthful, truthful.dram_id, &tables, &mut src);
    let fx = fixture_with(32, ChecksumPolicy::AllTiers, 64 << 10, Reporting::wrap(true, report));
    // The same bytes in this fixture's DRAM tier.
    let mut fx = fx;
    fx.dram.copy_from_slice(&truthful.dram);
    let dev = device(&fx.hbm, 3 * size);
    let ranges: Vec<[ObjectRange; 1]> =
        (0..3u64).map(|o| [ObjectRange::new(0, size, dev.id, o * size)]).collect();
    let objects: Vec<ObjectTransfer> = (0..3)
        .map(|o| {
            ObjectTransfer::new(o as u64, object(fx.dram_id, &tables[o], size), &ranges[o])
                .with_checksum(sums[o])
        })
        .collect();
    let report = restore(&mut fx.composite.builder(), &objects).unwrap();
    report.objects.into_iter().map(|r| r.error).collect()
}

#[test]
fn the_composite_takes_the_checksums_an_engine_reports_and_fails_closed_on_bad_ones() {
    // Truthful reports: every object verifies, though the composite hashed nothing itself.
    assert!(restore_reported(Some).iter().all(Option::is_none));
    // Wrong ones: the bytes are right, but the composite went by the engine's word.
    for error in restore_reported(|crc| Some(crc ^ 1)) {
        assert!(mismatch(&error).is_some(), "{error:?}");
    }
    // None at all: unverifiable, never a silent success.
    for error in restore_reported(|_| None) {
        assert!(
            matches!(
                error,
                Some(ObjectError::Failed { cause: FailureCause::ChecksumUnverifiable { .. }, .. })
            ),
            "{error:?}"
        );
    }
}

#[test]
fn bytes_that_never_pass_host_memory_cannot_be_verified_and_fail_closed() {
    // A device engine that cannot hash (a GPU's: the simulated one hashes what it copies).
    let fx = fixture_with(8, ChecksumPolicy::AllTiers, 64 << 10, Reporting::wrap(false, Some));
    // A device "tier": device to device moves on the device engine alone.
    let mut bytes = pattern(2 * PAGE as usize, 9);
    let tier = fx.device_with(&mut bytes);
    let dst = device(&fx.hbm, 2 * PAGE);
    let tables = [vec![0u64], vec![PAGE]];
    let ranges: Vec<[ObjectRange; 1]> =
        (0..2u64).map(|o| [ObjectRange::new(0, PAGE, dst.id, o * PAGE)]).collect();
    let crc = crc32c::crc32c(&bytes[..PAGE as usize]);
    let objects = [
        ObjectTransfer::new(0, object(tier.id, &tables[0], PAGE), &ranges[0]).with_checksum(crc),
        ObjectTransfer::new(1, object(tier.id, &tables[1], PAGE), &ranges[1]),
    ];
    let report = restore(&mut fx.composite.builder(), &objects).unwrap();
    assert!(
        matches!(
            report.objects[0].error,
            Some(ObjectError::Failed { cause: FailureCause::ChecksumUnverifiable { expected }, .. })
                if expected == crc
        ),
        "{report:?}"
    );
    assert_eq!(report.objects[1].state, ObjectState::Completed, "nothing to verify");
    assert_eq!(fx.composite.metrics().checksum_mismatches(), 0, "not a mismatch");
    // An offload there reports no checksum rather than a wrong one.
    let range = [ObjectRange::new(0, PAGE, dst.id, 0)];
    let one = [ObjectTransfer::new(3, object(tier.id, &tables[1], PAGE), &range)];
    let report = offload(&mut fx.composite.builder(), &one).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed);
    assert_eq!(report.objects[0].checksum, None);
}

#[test]
fn sixteen_threads_restore_with_checksums_through_one_composite() {
    let (threads, per_thread, per, tier_pages) = (16usize, 4usize, 2usize, 256usize);
    let objects = threads * per_thread;
    let fx = fixture(tier_pages, ChecksumPolicy::AllTiers, 24 << 10);
    let size = per as u64 * PAGE;
    let tables: Vec<Vec<u64>> = (0..objects).map(|o| table(o, per, tier_pages)).collect();
    // Even objects from the SSD file (staged to the device), odd from DRAM (to host memory).
    let file = pattern(tier_pages * PAGE as usize, 77);
    let sums: Vec<u32> = (0..objects)
        .map(|o| {
            let tier: &[u8] = if o % 2 == 0 { &file } else { &fx.dram };
            crc32c::crc32c(&stored(tier, &tables[o], PAGE, 0, size))
        })
        .collect();
    let dev = device(&fx.hbm, objects as u64 * size);
    let mut out = vec![0u8; objects * size as usize];
    let out_registration = fx.host(&mut out);
    let out_id = out_registration.id();
    let (dram_id, file_id) = (fx.dram_id, fx.file_id);
    let composite = fx.composite.clone();
    let rounds = 6;
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (composite, tables, sums, dev_id) = (&composite, &tables, &sums, dev.id);
            scope.spawn(move || {
                let mut builder = composite.builder();
                for round in 0..rounds {
                    let mine: Vec<usize> = (t * per_thread..(t + 1) * per_thread).collect();
                    let ranges: Vec<[ObjectRange; 2]> = mine
                        .iter()
                        .map(|&o| {
                            let dst = if o % 2 == 0 { dev_id } else { out_id };
                            let at = o as u64 * size;
                            [
                                ObjectRange::new(0, 5000, dst, at),
                                ObjectRange::new(5000, size - 5000, dst, at + 5000).in_group(1),
                            ]
                        })
                        .collect();
                    // On odd rounds, this thread's first object is given a wrong checksum.
                    let batch: Vec<ObjectTransfer> = mine
                        .iter()
                        .zip(&ranges)
                        .map(|(&o, r)| {
                            let tier = if o % 2 == 0 { file_id } else { dram_id };
                            let wrong = round % 2 == 1 && o == mine[0];
                            ObjectTransfer::new(o as u64, object(tier, &tables[o], size), r)
                                .with_checksum(sums[o] ^ u32::from(wrong))
                        })
                        .collect();
                    let report = restore(&mut builder, &batch).unwrap();
                    for (k, r) in report.objects.iter().enumerate() {
                        let wrong = round % 2 == 1 && k == 0;
                        let want = if wrong { ObjectState::Failed } else { ObjectState::Completed };
                        assert_eq!(r.state, want, "thread {t} round {round}: {r:?}");
                        assert_eq!(mismatch(&r.error).is_some(), wrong);
                        assert_eq!(r.checksum, Some(sums[mine[k]]));
                    }
                }
            });
        }
    });
    let wrong = (threads * (rounds / 2)) as u64;
    assert_eq!(fx.composite.metrics().checksum_mismatches(), wrong);
    let device_bytes = fx.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let at = o * size as usize;
        let (got, tier) = if o % 2 == 0 { (&device_bytes, &file) } else { (&out, &fx.dram) };
        assert_eq!(got[at..at + size as usize], stored(tier, table, PAGE, 0, size), "{o}");
    }
}

#[test]
fn layer_groups_settle_in_order_with_checksums_and_a_corrupt_block_fails_alone() {
    let fx = fixture(64, ChecksumPolicy::FilesAndRemote, 20 << 10);
    let (per, groups) = (4usize, 4u32);
    let size = per as u64 * PAGE;
    let tables: Vec<Vec<u64>> = (0..4).map(|o| table(o, per, 64)).collect();
    let mut src = pattern(4 * size as usize, 21);
    let sums = save(&fx, fx.file_id, &tables, &mut src);
    fx.corrupt_file(tables[2][3] + 7); // Object 2's last group.
    let dev = device(&fx.hbm, 4 * size);
    // Range g of every object (one page) in layer group g.
    let ranges: Vec<Vec<ObjectRange>> = (0..4u64)
        .map(|o| {
            (0..u64::from(groups))
                .map(|g| {
                    ObjectRange::new(g * PAGE, PAGE, dev.id, o * size + g * PAGE).in_group(g as u32)
                })
                .collect()
        })
        .collect();
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            ObjectTransfer::new(o as u64, object(fx.file_id, &tables[o], size), &ranges[o])
                .with_checksum(sums[o])
        })
        .collect();
    let mut builder = fx.composite.builder();
    let batch = start_restore(&mut builder, &objects).unwrap();
    assert_eq!(batch.groups(), [0, 1, 2, 3]);
    for g in 0..groups {
        batch.wait_group(g);
        assert!(batch.is_group_done(g));
    }
    let report = batch.wait();
    let states: Vec<ObjectState> = report.objects.iter().map(|r| r.state).collect();
    use ObjectState::{Completed, Failed};
    assert_eq!(states, [Completed, Completed, Failed, Completed], "{report:?}");
    assert!(mismatch(&report.objects[2].error).is_some());
    let bytes = fx.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for o in [0usize, 1, 3] {
        let at = o * size as usize;
        assert_eq!(bytes[at..at + size as usize], src[at..at + size as usize]);
    }
}

/// Sorted, disjoint, non-empty ranges of an object of `size` bytes, from cut points.
fn ranges_from(size: u64, cuts: &[u64], keep: &[bool]) -> Vec<(u64, u64)> {
    let mut points: Vec<u64> = cuts.iter().map(|c| c % size).chain([0, size]).collect();
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .zip(keep.iter().cycle())
        .filter(|(_, &k)| k)
        .map(|(w, _)| (w[0], w[1] - w[0]))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Offload checksums are the CRC32C of the source ranges' bytes, whatever the range
    /// layout, the stage size and the route (host or device memory into DRAM or SSD), and a
    /// restore given them completes.
    #[test]
    fn offload_checksums_are_the_crc32c_of_the_bytes_written(
        cuts in proptest::collection::vec(0u64..3 * PAGE, 0..6),
        keep in proptest::collection::vec(any::<bool>(), 1..8),
        stage in prop_oneof![Just(4096u64), Just(5000), Just(PAGE), Just(3 * PAGE)],
        from_device in any::<bool>(),
        to_file in any::<bool>(),
        seed in any::<u8>(),
    ) {
        let (per, objects) = (3usize, 3usize);
        let size = per as u64 * PAGE;
        let ranges_of = ranges_from(size, &cuts, &keep);
        prop_assume!(!ranges_of.is_empty());
        let fx = fixture(16, ChecksumPolicy::AllTiers, stage);
        let tier = if to_file { fx.file_id } else { fx.dram_id };
        let tables: Vec<Vec<u64>> = (0..objects).map(|o| table(o, per, 16)).collect();
        let mut src = pattern(objects * size as usize, seed);
        let on_device = from_device.then(|| fx.device_with(&mut src));
        let on_host = (!from_device).then(|| fx.host(&mut src));
        let caller = match (&on_device, &on_host) {
            (Some(dev), _) => dev.id,
            (_, Some(host)) => host.id(),
            _ => unreachable!("one of them"),
        };
        let ranges: Vec<Vec<ObjectRange>> = (0..objects as u64)
            .map(|o| {
                ranges_of
                    .iter()
                    .map(|&(at, len)| ObjectRange::new(at, len, caller, o * size + at))
                    .collect()
            })
            .collect();
        let batch: Vec<ObjectTransfer> = (0..objects)
            .map(|o| ObjectTransfer::new(o as u64, object(tier, &tables[o], size), &ranges[o]))
            .collect();
        let report = offload(&mut fx.composite.builder(), &batch).unwrap();
        prop_assert_eq!(report.aggregate, BatchState::Completed);
        let mut sums = Vec::new();
        for (o, r) in report.objects.iter().enumerate() {
            let message: Vec<u8> = ranges_of
                .iter()
                .flat_map(|&(at, len)| {
                    let start = o * size as usize + at as usize;
                    src[start..start + len as usize].to_vec()
                })
                .collect();
            prop_assert_eq!(r.checksum, Some(crc32c::crc32c(&message)), "object {}", o);
            sums.push(r.checksum.unwrap());
        }
        // Back into host memory, verified.
        let mut out = vec![0u8; objects * size as usize];
        let out_registration = fx.host(&mut out);
    let out_id = out_registration.id();
        let back: Vec<Vec<ObjectRange>> = ranges
            .iter()
            .map(|rs| {
                // The same ranges, into `out`.
                let into_out = |r: &ObjectRange| {
                    let mut r = *r;
                    r.endpoint = out_id;
                    r
                };
                rs.iter().map(into_out).collect()
            })
            .collect();
        let batch: Vec<ObjectTransfer> = (0..objects)
            .map(|o| {
                ObjectTransfer::new(o as u64, object(tier, &tables[o], size), &back[o])
                    .with_checksum(sums[o])
            })
            .collect();
        let report = restore(&mut fx.composite.builder(), &batch).unwrap();
        prop_assert_eq!(report.aggregate, BatchState::Completed, "{:?}", report);
    }
}
