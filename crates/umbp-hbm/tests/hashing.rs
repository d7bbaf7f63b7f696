//! Hashing while copying on the simulated device: a plan set with a checksum sink gets the
//! CRC32C of every object's bytes exactly once, whether they move by launches (split or not,
//! streamed or not) or copies, merged with other objects or not, and after faults that make
//! the engine copy them again.

mod support;

use std::sync::Arc;

use support::{host, Host, GPU};
use umbp_hbm::{
    DeviceFault, DeviceRuntime, GatherDescriptor, HbmConfig, HbmEngine, LaunchTable, Queue,
    SimDevice,
};
use umbp_plan::testing::{assert_hashed_once, submit_hashed, CopyReports};
use umbp_plan::{EndpointId, EndpointRegistry, Fragment, Tag};

fn engine(config: HbmConfig) -> HbmEngine<SimDevice> {
    HbmEngine::new(Arc::new(SimDevice::new(1)), EndpointRegistry::new(), config)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed).rotate_left(11) as u8).collect()
}

/// Every object of `fragments` not in `failed` was reported exactly once per byte with the
/// CRC32C of its source bytes in `src` ([`assert_hashed_once`]), and its bytes arrived at
/// `dst_addr`.
fn assert_hashed(
    e: &HbmEngine<SimDevice>,
    (src, dst_addr): (&Host, u64),
    fragments: &[Fragment],
    failed: &[Tag],
    reports: &CopyReports,
) {
    let source = |at: u64, len: u64| src.bytes[at as usize..][..len as usize].to_vec();
    assert_hashed_once(fragments, failed, reports, source);
    for f in fragments.iter().filter(|f| !failed.contains(&f.tag)) {
        let got = e.runtime().read(dst_addr + f.dst_offset, f.len).unwrap();
        assert_eq!(got, src.bytes[f.src_offset as usize..][..f.len as usize]);
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
        let (failed, reports) = submit_hashed(&e, &fragments);
        assert!(failed.is_empty(), "{failed:?}");
        let addr = dev.endpoint().addr();
        assert_hashed(&e, (&src, addr), &fragments, &failed, &reports);
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
        let (failed, reports) = submit_hashed(&e, &fragments);
        assert!(failed.is_empty(), "{failed:?}");
        assert_hashed(&e, (&src, dev.endpoint().addr()), &fragments, &failed, &reports);
        let tags: Vec<Tag> = reports.iter().map(|r| r.0).collect();
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
        let (failed, reports) = submit_hashed(&e, &fragments);
        assert!(failed.is_empty(), "{fault:?}: {failed:?}");
        assert_hashed(&e, (&src, dev.endpoint().addr()), &fragments, &failed, &reports);
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
    let (failed, reports) = submit_hashed(&e, &fragments);
    assert_eq!(failed, [Tag::new(0)]);
    assert_hashed(&e, (&src, dev.endpoint().addr()), &fragments, &failed, &reports);
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
