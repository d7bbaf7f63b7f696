//! The device engine on the simulated device: placement, kernel choice, bytes, faults.

mod support;

use std::sync::Arc;

use proptest::prelude::*;
use support::{host, Host, GPU};
use umbp_hbm::{DeviceError, DeviceFault, HbmConfig, HbmEngine, HbmRules, SimDevice};
use umbp_plan::testing::{drive, scenarios, ScenarioConfig};
use umbp_plan::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointKind, EndpointRegistry, Error, FailureCause,
    Fragment, PlanRules, Register, Registration, RejectReason, Tag, TransferEngine,
};

const POISON: u8 = 0xA5;

fn engine(config: HbmConfig) -> HbmEngine<SimDevice> {
    HbmEngine::new(Arc::new(SimDevice::new(2)), EndpointRegistry::new(), config)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Plans `fragments` as one object each (by their tags), submits, waits; returns the failures'
/// tags and the rejected tags.
fn transfer(e: &HbmEngine<SimDevice>, fragments: &[Fragment]) -> (Vec<Tag>, Vec<Tag>) {
    let mut b = e.builder();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        b.begin_object(group[0].tag).unwrap();
        for f in group {
            let _ = b.push(*f);
        }
        b.commit_object().unwrap();
    }
    let plans = b.finish().unwrap();
    let rejected = plans.rejected().to_vec();
    let mut handle = e.submit(plans);
    let failed = handle.wait().iter().flat_map(|f| f.tags.clone()).collect();
    (failed, rejected)
}

/// Device memory from the engine, with its address at hand; freed when dropped.
struct Dev {
    _registration: Registration,
    id: EndpointId,
    addr: u64,
    len: u64,
}

fn device(e: &HbmEngine<SimDevice>, gpu: DeviceOrdinal, len: u64) -> Dev {
    let registration = e.alloc_device(gpu, len).unwrap();
    let (id, addr) = (registration.id(), registration.endpoint().addr());
    Dev { _registration: registration, id, addr, len }
}

#[test]
fn claims_exactly_the_memory_pairs_with_a_device_side() {
    // A remote region's address is an offset on another node: claiming it as host memory
    // would dereference it here.
    let remote = umbp_plan::RemoteRegion { peer: 0, region: 0 };
    let kinds = [
        ("host", Endpoint::host(0x1000, 10)),
        ("device", Endpoint::device(GPU, 0x2000, 10)),
        ("file", Endpoint::file(3, 0, 10, false)),
        ("remote", Endpoint::remote(remote, 0x3000, 10)),
    ];
    for (sn, s) in kinds {
        for (dn, d) in kinds {
            let memory = |n: &str| n == "host" || n == "device";
            let expected = (sn == "device" || dn == "device") && memory(sn) && memory(dn);
            assert_eq!(HbmRules.carries(&s, &d), expected, "{sn} -> {dn}");
        }
    }
    // The host copy engine's pair is never this engine's.
    assert!(!HbmRules.carries(&kinds[0].1, &kinds[0].1));
}

#[test]
fn pairs_it_cannot_carry_are_refused_with_a_typed_error() {
    let e = engine(HbmConfig::default());
    let a = host(&e, vec![0; 64], false);
    let b = host(&e, vec![0; 64], false);
    let mut builder = e.builder();
    builder.begin_object(Tag::new(0)).unwrap();
    let err = builder.push(Fragment::new(a.id, 0, b.id, 0, 8, Tag::new(0))).unwrap_err();
    assert_eq!(
        err,
        Error::Rejected {
            tag: Tag::new(0),
            reason: RejectReason::PairNotHandled { src: a.id, dst: b.id }
        }
    );
}

#[test]
fn round_trip_host_device_host() {
    let e = engine(HbmConfig::default());
    let len = 256 << 10;
    let src = host(&e, pattern(len, 1), true);
    let back = host(&e, vec![POISON; len], false);
    let dev = device(&e, GPU, len as u64);
    // In as 64 fragments of 4 KiB (a gather), out as one segment (a copy).
    let mut inbound = Vec::new();
    for i in 0..64u64 {
        inbound.push(Fragment::new(src.id, i * 4096, dev.id, i * 4096, 4096, Tag::new(0)));
    }
    // Adjacent fragments merge into one segment: make them scattered on the host side.
    inbound.reverse();
    assert_eq!(transfer(&e, &inbound), (vec![], vec![]));
    assert_eq!(
        transfer(&e, &[Fragment::new(dev.id, 0, back.id, 0, len as u64, Tag::new(0))]),
        (vec![], vec![])
    );
    assert_eq!(back.bytes, src.bytes);
    assert_eq!(e.launches(), 1, "the scattered inbound pages were one gather");
}

#[test]
fn scattered_pages_in_shuffled_order_land_in_place_with_one_launch() {
    let e = engine(HbmConfig::default());
    let page = 16 << 10;
    let pages = 48usize;
    let arena = host(&e, pattern(page * pages, 9), true);
    let dev = device(&e, GPU, (page * pages) as u64);
    e.runtime().fill(dev.addr, (page * pages) as u64, POISON).unwrap();
    // Object page k lives at arena page perm[k]; push in a shuffled order.
    let perm: Vec<usize> = (0..pages).map(|k| (k * 7 + 3) % pages).collect();
    let order: Vec<usize> = (0..pages).map(|k| (k * 5 + 11) % pages).collect();
    let fragments: Vec<Fragment> = order
        .iter()
        .map(|&k| {
            Fragment::new(
                arena.id,
                (perm[k] * page) as u64,
                dev.id,
                (k * page) as u64,
                page as u64,
                Tag::new(0),
            )
        })
        .collect();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    let got = e.runtime().read(dev.addr, (page * pages) as u64).unwrap();
    for k in 0..pages {
        assert_eq!(&got[k * page..][..page], &arena.bytes[perm[k] * page..][..page], "page {k}");
    }
    assert_eq!(e.launches(), 1);
}

#[test]
fn device_to_device_and_unaligned_sizes_are_byte_exact() {
    let e = engine(HbmConfig::default());
    let a = device(&e, GPU, 1 << 20);
    let b = device(&e, GPU, 1 << 20);
    let src = host(&e, pattern(1 << 20, 5), true);
    assert_eq!(
        transfer(&e, &[Fragment::new(src.id, 0, a.id, 0, 1 << 20, Tag::new(0))]),
        (vec![], vec![])
    );
    e.runtime().fill(b.addr, 1 << 20, POISON).unwrap();
    // 3,001-byte fragments: 20 misaligned on both sides (the byte path), 20 starting 16-byte
    // aligned (the vector path with a 9-byte tail), 20 starting 4-byte aligned (the word path).
    let mut fragments = Vec::new();
    let mut expected = Vec::new(); // (dst offset, src offset)
    for i in 0..20u64 {
        expected.push((13 + i * 3001, 7 + i * 9001));
        expected.push((65536 + i * 4096, 200_000 + i * 4096));
        expected.push((200_004 + i * 4000, 400_004 + i * 4000));
    }
    for &(d, s) in &expected {
        fragments.push(Fragment::new(a.id, s, b.id, d, 3001, Tag::new(0)));
    }
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1);
    let got = e.runtime().read(b.addr, 1 << 20).unwrap();
    let mut written = vec![false; 1 << 20];
    for &(d, s) in &expected {
        let (d, s) = (d as usize, s as usize);
        assert_eq!(&got[d..][..3001], &src.bytes[s..][..3001], "fragment to {d}");
        written[d..d + 3001].iter_mut().for_each(|w| *w = true);
    }
    let stray = (0..1 << 20).filter(|&i| !written[i] && got[i] != POISON).count();
    assert_eq!(stray, 0, "bytes outside every fragment were written");
}

#[test]
fn strided_layer_reads_and_strided_offload_writes() {
    // A device KV buffer of 8 blocks x 4 layers x 2 KiB; restore reads layer-major from a host
    // layout, offload writes each layer of each block back to a strided host layout.
    let e = engine(HbmConfig::default());
    let (blocks, layers, chunk) = (8usize, 4usize, 2048usize);
    let total = blocks * layers * chunk;
    let host_in = host(&e, pattern(total, 3), true);
    let host_out = host(&e, vec![POISON; total], true);
    let dev = device(&e, GPU, total as u64);
    let mut restore = Vec::new();
    let mut offload = Vec::new();
    for b in 0..blocks {
        for l in 0..layers {
            let host_off = (l * blocks + b) * chunk; // layer-major on the host
            let dev_off = (b * layers + l) * chunk; // block-major on the device
            restore.push(Fragment::new(
                host_in.id,
                host_off as u64,
                dev.id,
                dev_off as u64,
                chunk as u64,
                Tag::new(b as u32),
            ));
            offload.push(Fragment::new(
                dev.id,
                dev_off as u64,
                host_out.id,
                host_off as u64,
                chunk as u64,
                Tag::new(b as u32),
            ));
        }
    }
    assert_eq!(transfer(&e, &restore), (vec![], vec![]));
    assert_eq!(transfer(&e, &offload), (vec![], vec![]));
    assert_eq!(host_out.bytes, host_in.bytes);
    assert_eq!(e.launches(), 2);
}

#[test]
fn one_large_contiguous_run_is_a_copy_not_a_launch() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(4 << 20, 1), true);
    let dev = device(&e, GPU, 4 << 20);
    // 64 adjacent fragments merge into one 4 MiB segment: mean far above 128 KiB.
    let fragments: Vec<Fragment> = (0..64u64)
        .map(|i| Fragment::new(src.id, i << 16, dev.id, i << 16, 1 << 16, Tag::new(0)))
        .collect();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 0);
    assert_eq!(e.runtime().read(dev.addr, 4 << 20).unwrap(), src.bytes);
}

/// The 16 pages of 4 KiB of `src`, last first, into `dev`'s first 64 KiB, as one object.
fn reversed_pages(src: &Host, dev: &Dev) -> Vec<Fragment> {
    (0..16u64)
        .map(|i| Fragment::new(src.id, (15 - i) << 12, dev.id, i << 12, 4096, Tag::new(0)))
        .collect()
}

/// Checks that `dev` holds what [`reversed_pages`] moves.
fn assert_reversed(e: &HbmEngine<SimDevice>, src: &Host, dev: &Dev) {
    let got = e.runtime().read(dev.addr, 64 << 10).unwrap();
    for i in 0..16usize {
        assert_eq!(&got[i << 12..][..4096], &src.bytes[(15 - i) << 12..][..4096], "page {i}");
    }
}

#[test]
fn unpinned_host_memory_takes_the_copy_path() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(64 << 10, 4), false);
    let dev = device(&e, GPU, 64 << 10);
    let fragments = reversed_pages(&src, &dev);
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 0, "the device cannot see unpinned memory");
    // Pinning is explicit and reversible: pinned, the same transfer is a gather.
    e.pin(src.id, GPU).unwrap();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1);
    e.unpin(src.id).unwrap();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1);
    assert_reversed(&e, &src, &dev);
}

/// Host memory pinned for the device cannot be pinned again, in whole or in part, while it is,
/// as CUDA's and HIP's host registration refuse it: the simulator refuses it too, in its own
/// words (`DeviceError::AlreadyPinned`, not CUDA's runtime error 712), so a program that would
/// fail on a GPU fails here. The refusal is a typed error that leaves the first pin working;
/// once that pin ends, the slice pins.
#[test]
fn memory_pinned_once_refuses_an_overlapping_pin() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(64 << 10, 6), true);
    let base = src.bytes.as_ptr() as u64;
    // SAFETY: a slice of `src`'s buffer, which outlives this registration (dropped first).
    let slice = unsafe { e.register_raw_memory(Endpoint::host(base + 8192, 4096)) }.unwrap();
    let refused = e.pin(slice.id(), GPU).expect_err("a slice of pinned memory pinned again");
    // The simulator's own words, not a CUDA runtime code it does not have.
    assert!(
        matches!(
            &refused,
            umbp_hbm::Error::Device(DeviceError::AlreadyPinned { device, len: 4096, .. })
                if *device == GPU
        ),
        "{refused:?}"
    );
    let text = refused.to_string();
    assert!(text.contains("simulated") && text.contains("already pinned"), "{text}");
    assert!(!text.contains("runtime error") && !text.contains("712"), "{text}");
    let dev = device(&e, GPU, 64 << 10);
    let fragments = reversed_pages(&src, &dev);
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1, "the first pin still serves the gather kernel");
    e.unpin(src.id).unwrap();
    e.pin(slice.id(), GPU).expect("nothing else pins the slice now");
    assert_reversed(&e, &src, &dev);
}

#[test]
fn launches_are_split_into_bounded_chunks() {
    let config = HbmConfig { launch_max_bytes: 40 << 10, ..HbmConfig::default() };
    let e = engine(config);
    let src = host(&e, pattern(256 << 10, 8), true);
    let dev = device(&e, GPU, 256 << 10);
    // 32 scattered 8 KiB fragments = 256 KiB in launches of at most 40 KiB: 7 launches.
    let fragments: Vec<Fragment> = (0..32u64)
        .map(|i| Fragment::new(src.id, ((i * 13) % 32) << 13, dev.id, i << 13, 8192, Tag::new(0)))
        .collect();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), (256u64 << 10).div_ceil(40 << 10));
    let got = e.runtime().read(dev.addr, 256 << 10).unwrap();
    for i in 0..32usize {
        assert_eq!(&got[i << 13..][..8192], &src.bytes[((i * 13) % 32) << 13..][..8192]);
    }
}

/// Sixteen scattered 4 KiB pages of object 0 and of object 1 into a poisoned device buffer.
fn two_objects(e: &HbmEngine<SimDevice>, src: &Host, dev: &Dev) -> Vec<Fragment> {
    e.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    (0..32u64)
        .map(|i| {
            Fragment::new(
                src.id,
                ((i * 7) % 32) << 12,
                dev.id,
                i << 12,
                4096,
                Tag::new((i / 16) as u32),
            )
        })
        .collect()
}

fn assert_two_objects(e: &HbmEngine<SimDevice>, src: &Host, dev: &Dev, ok: [bool; 2]) {
    let got = e.runtime().read(dev.addr, dev.len).unwrap();
    for i in 0..32usize {
        let page = &got[i << 12..][..4096];
        if ok[i / 16] {
            assert_eq!(page, &src.bytes[((i * 7) % 32) << 12..][..4096], "page {i}");
        } else {
            assert!(page.iter().all(|&x| x == POISON), "page {i} of a failed object was written");
        }
    }
}

#[test]
fn a_failed_launch_falls_back_to_copies() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(128 << 10, 2), true);
    let dev = device(&e, GPU, 128 << 10);
    let fragments = two_objects(&e, &src, &dev);
    e.runtime().inject(DeviceFault::Launch);
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_two_objects(&e, &src, &dev, [true, true]);
    assert_eq!(e.launches(), 0);
    assert!(e.kernel_enabled(), "a failed launch does not disable the kernel");
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1);
}

#[test]
fn a_failed_synchronization_disables_the_kernel_for_good() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(128 << 10, 6), true);
    let dev = device(&e, GPU, 128 << 10);
    let fragments = two_objects(&e, &src, &dev);
    e.runtime().inject(DeviceFault::Synchronize);
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]), "the bucket was copied again");
    assert_two_objects(&e, &src, &dev, [true, true]);
    assert!(!e.kernel_enabled());
    assert_eq!(e.launches(), 1);
    let fragments = two_objects(&e, &src, &dev);
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(e.launches(), 1, "later submits use copies");
    assert_two_objects(&e, &src, &dev, [true, true]);
}

#[test]
fn a_failed_copy_fails_only_its_objects_with_the_device_error() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(128 << 10, 7), false); // unpinned: every segment is a copy
    let dev = device(&e, GPU, 128 << 10);
    let fragments = two_objects(&e, &src, &dev);
    e.runtime().inject(DeviceFault::Copy);
    let mut b = e.builder();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        b.begin_object(group[0].tag).unwrap();
        group.iter().for_each(|f| b.push(*f).unwrap());
        b.commit_object().unwrap();
    }
    let mut handle = e.submit(b.finish().unwrap());
    let failures = handle.wait().to_vec();
    assert_eq!(failures.len(), 1);
    assert_eq!(failures[0].tags, vec![Tag::new(0)], "the first copy carries object 0 only");
    assert!(matches!(failures[0].cause, FailureCause::Device { device, .. } if device == GPU));
    let got = e.runtime().read(dev.addr, dev.len).unwrap();
    // Object 1 arrived whole.
    for i in 16..32usize {
        assert_eq!(&got[i << 12..][..4096], &src.bytes[((i * 7) % 32) << 12..][..4096]);
    }
}

#[test]
fn out_of_bounds_fragments_reject_their_object_and_write_nothing_of_it() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(128 << 10, 1), true);
    let dev = device(&e, GPU, 128 << 10);
    let mut fragments = two_objects(&e, &src, &dev);
    // The last fragment of object 0 runs one byte past the device buffer.
    fragments[15].dst_offset = (128 << 10) - 4095;
    assert_eq!(transfer(&e, &fragments), (vec![], vec![Tag::new(0)]));
    assert_two_objects(&e, &src, &dev, [false, true]);
}

#[test]
fn the_callers_device_is_restored_after_a_submit() {
    let e = engine(HbmConfig::default());
    let src = host(&e, pattern(64 << 10, 1), true);
    let dev1 = device(&e, DeviceOrdinal::new(1), 64 << 10);
    umbp_hbm::DeviceRuntime::set_device(&**e.runtime(), GPU).unwrap();
    let fragments: Vec<Fragment> = (0..4u64)
        .map(|i| Fragment::new(src.id, i << 12, dev1.id, (3 - i) << 12, 4096, Tag::new(0)))
        .collect();
    assert_eq!(transfer(&e, &fragments), (vec![], vec![]));
    assert_eq!(umbp_hbm::DeviceRuntime::current_device(&**e.runtime()).unwrap(), GPU);
    assert_eq!(e.launches(), 0, "memory pinned for device 0 is not visible to device 1");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn the_builder_equals_the_batch_planner(scenario in scenarios(ScenarioConfig {
        sources: vec![EndpointKind::Host, EndpointKind::Device(GPU)],
        destinations: vec![EndpointKind::Device(GPU), EndpointKind::Host, EndpointKind::Device(GPU)],
        ..ScenarioConfig::default()
    })) {
        let registry = EndpointRegistry::new();
        // SAFETY: the plans are compared, never submitted.
        unsafe { scenario.register_invented(&registry) };
        let e = HbmEngine::new(Arc::new(SimDevice::new(1)), registry, HbmConfig::default());
        let mut b = e.builder();
        let outcome = drive(&mut *b, &scenario).unwrap();
        prop_assert_eq!(outcome.plans, e.plan(&outcome.committed));
    }
}

#[test]
fn a_failed_copy_of_a_merged_segment_is_copied_again_object_by_object() {
    let e = engine(HbmConfig::default());
    let len = 3 * 4096;
    let src = host(&e, pattern(len, 4), false);
    let dev = device(&e, GPU, len as u64);
    // Objects 0, 1, 2: adjacent on both sides, so one merged segment, moved by one copy.
    let fragments: Vec<Fragment> = (0..3u32)
        .map(|o| {
            let at = u64::from(o) * 4096;
            Fragment::new(src.id, at, dev.id, at, 4096, Tag::new(o))
        })
        .collect();

    // The segment's copy fails once: each object's share is copied again, and all arrive.
    e.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    e.runtime().inject(DeviceFault::Copy);
    let (failed, rejected) = transfer(&e, &fragments);
    assert!(failed.is_empty() && rejected.is_empty(), "{failed:?}");
    assert_eq!(e.runtime().read(dev.addr, dev.len).unwrap(), src.bytes);

    // The segment's copy fails, then object 0's own copy fails too: only object 0 fails.
    e.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    e.runtime().inject(DeviceFault::Copy);
    e.runtime().inject(DeviceFault::Copy);
    let (failed, _) = transfer(&e, &fragments);
    assert_eq!(failed, [Tag::new(0)]);
    let got = e.runtime().read(dev.addr, dev.len).unwrap();
    assert!(got[..4096].iter().all(|&b| b == POISON), "the failed object was written");
    assert_eq!(got[4096..], src.bytes[4096..]);
}

#[test]
fn the_kernel_source_and_the_simulator_share_their_geometry() {
    use umbp_hbm::{BLOCK_THREADS, GATHER_KERNEL_NAME, GATHER_KERNEL_SOURCE, SLICE_BYTES};
    let define = format!("#define UMBP_SLICE_BYTES {}ull", SLICE_BYTES);
    assert!(GATHER_KERNEL_SOURCE.contains(&define), "gather.cu must say `{define}`");
    let entry = format!("extern \"C\" __global__ void {GATHER_KERNEL_NAME}(");
    assert!(GATHER_KERNEL_SOURCE.contains(&entry), "gather.cu must define `{entry}`");
    // 16-byte vectors: a block's threads cover its slice in whole rounds.
    assert_eq!(SLICE_BYTES % (u64::from(BLOCK_THREADS) * 16), 0);
}

#[test]
fn calibration_measures_every_size_and_its_threshold_decides_the_kernel() {
    use umbp_hbm::CALIBRATION_SIZES;
    let e = engine(HbmConfig::default());
    assert!(e.calibrations().is_empty(), "off by default");
    assert_eq!(e.kernel_max_mean_bytes(GPU), HbmConfig::default().kernel_max_mean_bytes);
    let c = e.calibrate(GPU).unwrap();
    assert_eq!(c.points.iter().map(|p| p.fragment_size).collect::<Vec<_>>(), CALIBRATION_SIZES);
    for p in &c.points {
        assert!(p.kernel_seconds > 0.0 && p.copies_seconds > 0.0, "{p:?}");
        assert!(p.kernel_seconds.is_finite() && p.copies_seconds.is_finite(), "{p:?}");
    }
    // The threshold is twice the largest size the kernel won, or 0.
    let won = c.points.iter().rev().find(|p| p.kernel_seconds < p.copies_seconds);
    assert_eq!(c.kernel_max_mean_bytes, won.map_or(0, |p| 2 * p.fragment_size));
    assert_eq!(e.calibrations(), std::slice::from_ref(&c));
    assert_eq!(e.kernel_max_mean_bytes(GPU), c.kernel_max_mean_bytes);
    // And the engine follows it: eight fragments of each size use the kernel exactly when their
    // size is under the threshold.
    for size in CALIBRATION_SIZES {
        let src = host(&e, pattern(16 * size as usize, 3), true);
        let dev = device(&e, GPU, 8 * size);
        let fragments: Vec<Fragment> = (0..8u64)
            .map(|i| {
                Fragment::new(src.id, (15 - 2 * i) * size, dev.id, i * size, size, Tag::new(0))
            })
            .collect();
        let before = e.launches();
        let (failed, rejected) = transfer(&e, &fragments);
        assert!(failed.is_empty() && rejected.is_empty());
        let launched = e.launches() > before;
        assert_eq!(launched, size < c.kernel_max_mean_bytes, "size {size}, {c:?}");
    }
    // A calibration at start does the same for every device.
    let config = HbmConfig { calibrate: true, ..HbmConfig::default() };
    let started = HbmEngine::new(Arc::new(SimDevice::new(2)), EndpointRegistry::new(), config);
    assert_eq!(started.calibrations().len(), 2);
}
