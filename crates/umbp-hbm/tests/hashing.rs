//! Hashing while copying on the simulated device: a plan set with a checksum sink gets the
//! CRC32C of every object's bytes exactly once, whether they move by launches (split or not,
//! streamed or not) or copies, merged with other objects or not, and after faults that make
//! the engine copy them again.

use std::sync::{Arc, Mutex};

use umbp_hbm::{
    DeviceFault, DeviceRuntime, GatherDescriptor, HbmConfig, HbmEngine, LaunchTable, Queue,
    SimDevice,
};
use umbp_plan::checksum::CopyHashes;
use umbp_plan::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, Fragment, Register, Registration,
    Segment, Tag, TransferEngine,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

fn engine(config: HbmConfig) -> HbmEngine<SimDevice> {
    HbmEngine::new(Arc::new(SimDevice::new(1)), EndpointRegistry::new(), config)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).rotate_left(11) as u8).collect()
}

/// A host buffer registered with the engine, pinned for the device when `pin`.
struct Host {
    _registration: Registration,
    bytes: Vec<u8>,
    id: EndpointId,
}

fn host(e: &HbmEngine<SimDevice>, mut bytes: Vec<u8>, pin: bool) -> Host {
    let endpoint = Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
    // SAFETY: `Host` keeps `bytes` alive past the registration, and the tests only read them
    // (they are transfer sources).
    let registration = unsafe { e.register_raw_memory(endpoint) }.unwrap();
    let id = registration.id();
    if pin {
        e.pin(id, GPU).unwrap();
    }
    Host { _registration: registration, bytes, id }
}

/// What a sink received: (object, piece, CRC).
type Reports = Arc<Mutex<Vec<(Tag, Segment, u32)>>>;

/// Plans `fragments` (an object per run of equal tags) with a checksum sink, submits, waits:
/// the failed objects and the sink's reports.
fn hashed_transfer(e: &HbmEngine<SimDevice>, fragments: &[Fragment]) -> (Vec<Tag>, Reports) {
    let mut b = e.builder();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        b.begin_object(group[0].tag).unwrap();
        for f in group {
            b.push(*f).unwrap();
        }
        b.commit_object().unwrap();
    }
    let mut plans = b.finish().unwrap();
    let reports: Reports = Arc::default();
    let log = Arc::clone(&reports);
    plans.set_copy_hashes(Some(CopyHashes::new(move |_, tag, piece, crc| {
        log.lock().unwrap().push((tag, piece, crc));
    })));
    let mut handle = e.submit(plans);
    let mut failed: Vec<Tag> = handle.wait().iter().flat_map(|f| f.tags.clone()).collect();
    failed.sort_unstable();
    (failed, reports)
}

/// Every object of `fragments` not in `failed` was reported exactly once per byte, each piece
/// with the CRC32C of its source bytes in `src`, and its bytes arrived at `dst_addr`.
fn assert_hashed_once(
    e: &HbmEngine<SimDevice>,
    src: &Host,
    dst_addr: u64,
    fragments: &[Fragment],
    failed: &[Tag],
    reports: &Reports,
) {
    let reports = reports.lock().unwrap();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        let tag = group[0].tag;
        if failed.contains(&tag) {
            continue;
        }
        let mut pieces: Vec<Segment> = reports.iter().filter(|r| r.0 == tag).map(|r| r.1).collect();
        pieces.sort_unstable_by_key(|p| p.src_offset);
        let mut want: Vec<(u64, u64)> = group.iter().map(|f| (f.src_offset, f.len)).collect();
        want.sort_unstable();
        // Pieces tile the object's source bytes exactly: same bytes, no overlap.
        let mut covered: Vec<(u64, u64)> = Vec::new();
        for p in &pieces {
            match covered.last_mut() {
                Some(last) if last.0 + last.1 == p.src_offset => last.1 += p.len,
                _ => covered.push((p.src_offset, p.len)),
            }
        }
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for &(at, len) in &want {
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == at => last.1 += len,
                _ => merged.push((at, len)),
            }
        }
        assert_eq!(covered, merged, "object {tag:?}: pieces {pieces:?}");
        for &(t, p, crc) in reports.iter().filter(|r| r.0 == tag) {
            let bytes = &src.bytes[p.src_offset as usize..][..p.len as usize];
            assert_eq!(crc, crc32c::crc32c(bytes), "object {t:?}, piece {p:?}");
        }
        for f in group {
            let got = e.runtime().read(dst_addr + f.dst_offset, f.len).unwrap();
            assert_eq!(got, src.bytes[f.src_offset as usize..][..f.len as usize]);
        }
    }
}

/// `n` scattered pieces of `len` bytes, `per` objects in turn, adjacent on the device side so
/// that neighbours of one object merge where their sources follow each other too.
fn scattered(src: EndpointId, dst: EndpointId, n: u64, len: u64, objects: u32) -> Vec<Fragment> {
    let mut fragments: Vec<Fragment> = (0..n)
        .map(|i| {
            let from = ((i * 7) % n) * len;
            let tag = Tag::new((i * u64::from(objects) / n) as u32);
            Fragment::new(src, from, dst, i * len, len, tag)
        })
        .collect();
    fragments.sort_by_key(|f| f.tag);
    fragments
}

#[test]
fn launches_and_copies_report_every_objects_bytes_once_with_their_crc() {
    for (pin, launch_max, n, len) in [
        // Scattered 4 KiB pages by launches, whole and split into 10 KiB launches.
        (true, 64 << 20, 32, 4096),
        (true, 10 << 10, 32, 4096),
        // The same by copies (unpinned host memory).
        (false, 64 << 20, 32, 4096),
        // A launch of 40 MiB, which streams: 640 pieces of 64 KiB.
        (true, 64 << 20, 640, 64 << 10),
    ] {
        let e = engine(HbmConfig { launch_max_bytes: launch_max, ..HbmConfig::default() });
        let src = host(&e, pattern((n * len) as usize, 5), pin);
        let dev = e.alloc_device(GPU, n * len).unwrap();
        let fragments = scattered(src.id, dev.id(), n, len, 4);
        let (failed, reports) = hashed_transfer(&e, &fragments);
        assert!(failed.is_empty(), "{failed:?}");
        let addr = dev.endpoint().addr();
        assert_hashed_once(&e, &src, addr, &fragments, &failed, &reports);
        assert_eq!(pin, e.launches() > 0, "pinned {pin}: launched {}", e.launches());
    }
}

#[test]
fn objects_merged_into_one_segment_are_reported_apart() {
    for pin in [true, false] {
        let e = engine(HbmConfig::default());
        let src = host(&e, pattern(6 * 4096, 9), pin);
        let dev = e.alloc_device(GPU, 6 * 4096).unwrap();
        // Objects 0, 1, 2 of two pages each, adjacent on both sides: one merged segment.
        let fragments: Vec<Fragment> = (0..6u64)
            .map(|i| {
                Fragment::new(src.id, i * 4096, dev.id(), i * 4096, 4096, Tag::new(i as u32 / 2))
            })
            .collect();
        let (failed, reports) = hashed_transfer(&e, &fragments);
        assert!(failed.is_empty(), "{failed:?}");
        assert_hashed_once(&e, &src, dev.endpoint().addr(), &fragments, &failed, &reports);
        let tags: Vec<Tag> = reports.lock().unwrap().iter().map(|r| r.0).collect();
        assert_eq!(tags.len(), 3, "one piece per object: {tags:?}");
    }
}

#[test]
fn work_copied_again_after_a_fault_is_reported_once() {
    for fault in [DeviceFault::Launch, DeviceFault::Synchronize] {
        let e = engine(HbmConfig::default());
        let src = host(&e, pattern(64 * 4096, 3), true);
        let dev = e.alloc_device(GPU, 64 * 4096).unwrap();
        let fragments = scattered(src.id, dev.id(), 64, 4096, 3);
        e.runtime().inject(fault);
        let (failed, reports) = hashed_transfer(&e, &fragments);
        assert!(failed.is_empty(), "{fault:?}: {failed:?}");
        assert_hashed_once(&e, &src, dev.endpoint().addr(), &fragments, &failed, &reports);
    }
}

#[test]
fn a_failed_copy_fails_only_its_object_and_the_others_are_reported() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(3 * 4096, 4), false);
    let dev = e.alloc_device(GPU, 3 * 4096).unwrap();
    let fragments: Vec<Fragment> = (0..3u64)
        .map(|i| Fragment::new(src.id, i * 4096, dev.id(), i * 4096, 4096, Tag::new(i as u32)))
        .collect();
    e.runtime().inject(DeviceFault::Copy);
    let (failed, reports) = hashed_transfer(&e, &fragments);
    assert_eq!(failed, [Tag::new(0)]);
    assert_hashed_once(&e, &src, dev.endpoint().addr(), &fragments, &failed, &reports);
}

#[test]
fn the_runtime_hashes_each_descriptor_and_refuses_a_crc_list_of_another_length() {
    let rt = SimDevice::new(1);
    assert!(rt.hashes_while_copying());
    let len = 3usize << 20;
    let src = pattern(len, 1);
    // Device memory: the source bytes in its first half, gathered into its second.
    let dev = rt.alloc(GPU, 2 * len as u64).unwrap();
    // SAFETY: `src` is readable for `len` bytes, the allocation writable; distinct memory.
    let crc = unsafe { rt.copy_hashed(GPU, dev, src.as_ptr() as u64, len as u64, Queue::Own) };
    assert_eq!(crc.unwrap(), crc32c::crc32c(&src), "a copy reports its source's CRC");
    let pieces = [(0u64, 100u64), (4096, 70_000), (1 << 20, 1 << 20), (77, 0), (5, 33)];
    let mut table = LaunchTable::default();
    let mut out = len as u64;
    for (at, n) in pieces {
        table.push(GatherDescriptor { src: dev + at, dst: dev + out, len: n });
        out += n;
    }
    let mut crcs = vec![0u32; pieces.len() - 1];
    // SAFETY: every side lies in the allocation; destinations follow each other in its second
    // half, sources lie in its first.
    let refused = unsafe { rt.gather_hashed(GPU, &table, Queue::Own, &mut crcs) };
    assert!(refused.is_err(), "a CRC short");
    crcs.push(0);
    // SAFETY: as above.
    unsafe { rt.gather_hashed(GPU, &table, Queue::Own, &mut crcs) }.unwrap();
    let mut out = len as u64;
    for ((at, n), crc) in pieces.into_iter().zip(crcs) {
        let want = &src[at as usize..][..n as usize];
        assert_eq!(crc, crc32c::crc32c(want), "descriptor at {at}, {n} bytes");
        assert_eq!(rt.read(dev + out, n).unwrap(), want);
        out += n;
    }
    // SAFETY: allocated above, no work in flight.
    unsafe { rt.free(GPU, dev) }.unwrap();
}
