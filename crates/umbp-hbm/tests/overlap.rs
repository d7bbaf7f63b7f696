//! The overlap rule on the device engine: overlapping fragments never reach the gather kernel
//! (whose blocks run in no order), the objects involved fail, and everything else runs.

use std::sync::Arc;

use proptest::prelude::*;
use umbp_hbm::{
    DeviceRuntime, GatherDescriptor, HbmConfig, HbmEngine, LaunchTable, Queue, SimDevice,
};
use umbp_plan::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, FailureCause, Fragment, Register,
    Registration, Tag, TransferEngine,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed).wrapping_add((i >> 8) as u8))
        .collect()
}

struct Rig {
    /// Declared (so dropped) before the buffer it registers.
    _host_registration: Registration,
    host: Vec<u8>,
    host_id: EndpointId,
    engine: HbmEngine<SimDevice>,
}

/// An engine whose kernel takes every bucket of two or more fragments, and a pinned host buffer.
fn rig(host_len: usize) -> Rig {
    let config = HbmConfig {
        kernel_min_fragments: 2,
        pin_registered_host: Some(GPU),
        ..HbmConfig::default()
    };
    let engine = HbmEngine::new(Arc::new(SimDevice::new(1)), EndpointRegistry::new(), config);
    let mut host = pattern(host_len, 7);
    let endpoint = Endpoint::host(host.as_mut_ptr() as u64, host_len as u64);
    // SAFETY: the rig keeps `host` alive until after the registration ends, and the tests read
    // it (a source only) between transfers, each waited on. Raw, so the tests can read it.
    let registration = unsafe { engine.register_raw_memory(endpoint) }.unwrap();
    Rig { host_id: registration.id(), _host_registration: registration, host, engine }
}

impl Rig {
    /// Device memory of `len` bytes holding `bytes` (copied from the host buffer's start).
    fn device_with(&self, len: u64) -> Registration {
        let dev = self.engine.alloc_device(GPU, len).unwrap();
        let (failed, _) =
            self.run(&[Fragment::new(self.host_id, 0, dev.id(), 0, len, Tag::new(0))]);
        assert!(failed.is_empty());
        dev
    }

    /// Plans `fragments` as one object per tag run and submits; returns (failed, the causes).
    fn run(&self, fragments: &[Fragment]) -> (Vec<Tag>, Vec<FailureCause>) {
        let mut b = self.engine.builder();
        for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
            b.begin_object(group[0].tag).unwrap();
            for f in group {
                b.push(*f).unwrap();
            }
            b.commit_object().unwrap();
        }
        let mut handle = self.engine.submit(b.finish().unwrap());
        let failures = handle.wait();
        let mut tags: Vec<Tag> = failures.iter().flat_map(|f| f.tags.clone()).collect();
        tags.sort_unstable();
        tags.dedup();
        (tags, failures.iter().map(|f| f.cause.clone()).collect())
    }

    fn read(&self, dev: &Registration) -> Vec<u8> {
        self.engine.runtime().read(dev.endpoint().addr(), dev.endpoint().len()).unwrap()
    }
}

#[test]
fn a_device_to_device_object_that_overlaps_itself_fails_and_never_reaches_the_kernel() {
    let rig = rig(64 << 10);
    let dev = rig.device_with(16 << 10);
    let out = rig.device_with(16 << 10);
    let before = (rig.read(&dev), rig.read(&out));
    let launches = rig.engine.launches();
    // Object 0: src 0 -> dst 16 and src 8192 -> dst 8208, 4 KiB each, in one buffer: each
    // fragment's destination overlaps its own source. Object 1: two pages of host memory into
    // another buffer, through the kernel.
    let (failed, causes) = rig.run(&[
        Fragment::new(dev.id(), 0, dev.id(), 16, 4096, Tag::new(0)),
        Fragment::new(dev.id(), 8192, dev.id(), 8208, 4096, Tag::new(0)),
        Fragment::new(rig.host_id, 40 << 10, out.id(), 0, 2048, Tag::new(1)),
        Fragment::new(rig.host_id, 20 << 10, out.id(), 8192, 2048, Tag::new(1)),
    ]);
    assert_eq!(failed, [Tag::new(0)]);
    assert_eq!(causes, [FailureCause::Overlap]);
    assert_eq!(rig.read(&dev), before.0, "the overlapping object wrote nothing");
    let got = rig.read(&out);
    assert_eq!(got[..2048], rig.host[40 << 10..(40 << 10) + 2048]);
    assert_eq!(got[8192..8192 + 2048], rig.host[20 << 10..(20 << 10) + 2048]);
    assert_eq!(got[2048..8192], before.1[2048..8192]);
    assert_eq!(rig.engine.launches(), launches + 1, "object 1 went through one gather launch");
}

#[test]
fn the_simulated_kernel_refuses_descriptors_that_overlap_instead_of_racing() {
    let device = SimDevice::new(1);
    let addr = device.alloc(GPU, 8192).unwrap();
    let table = |descriptors: Vec<GatherDescriptor>| {
        let mut t = LaunchTable::default();
        descriptors.into_iter().for_each(|d| t.push(d));
        t
    };
    let overlapping = table(vec![
        GatherDescriptor { src: addr, dst: addr + 4096, len: 1024 },
        GatherDescriptor { src: addr + 4096 + 512, dst: addr + 100, len: 1024 },
    ]);
    // SAFETY: every descriptor lies inside the live allocation; the overlap is what is tested.
    let refused = unsafe { device.gather(GPU, &overlapping, Queue::Own) };
    assert!(refused.is_err(), "a destination read by another descriptor");
    let disjoint = table(vec![
        GatherDescriptor { src: addr, dst: addr + 4096, len: 1024 },
        GatherDescriptor { src: addr, dst: addr + 6000, len: 1024 },
    ]);
    // SAFETY: inside the allocation; sources may be shared, destinations are disjoint.
    assert!(unsafe { device.gather(GPU, &disjoint, Queue::Own) }.is_ok());
    // SAFETY: allocated above, no transfer in flight.
    unsafe { device.free(GPU, addr) }.unwrap();
}

/// One random fragment: device -> device inside one buffer, or pinned host -> device.
fn fragments() -> impl Strategy<Value = Vec<(bool, u64, u64, u64)>> {
    prop::collection::vec((any::<bool>(), 0u64..8000, 0u64..8000, 1u64..192), 1..24)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn overlapping_objects_fail_and_the_rest_match_copying_one_by_one(
        spec in fragments(),
        per_object in 1usize..4,
    ) {
        let rig = rig(16 << 10);
        let dev = rig.device_with(8192);
        let initial = rig.read(&dev);
        let fragments: Vec<Fragment> = spec
            .iter()
            .enumerate()
            .map(|(i, &(from_host, src, dst, len))| {
                let tag = Tag::new((i / per_object) as u32);
                let dst = dst.min(8192 - len);
                if from_host {
                    Fragment::new(rig.host_id, src, dev.id(), dst, len, tag)
                } else {
                    Fragment::new(dev.id(), src.min(8192 - len), dev.id(), dst, len, tag)
                }
            })
            .collect();
        // Every pair of fragments (a fragment with itself included) that shares a byte one of
        // them writes: device ranges only, host memory is only read.
        let ranges = |f: &Fragment| {
            let read = (f.src == dev.id()).then_some((f.src_offset, f.src_offset + f.len));
            (read, (f.dst_offset, f.dst_offset + f.len))
        };
        let meets = |a: (u64, u64), b: (u64, u64)| a.0.max(b.0) < a.1.min(b.1);
        let mut want = Vec::new();
        for (i, a) in fragments.iter().enumerate() {
            for b in &fragments[i..] {
                let ((ar, aw), (br, bw)) = (ranges(a), ranges(b));
                let same = std::ptr::eq(a, b);
                let hit = (!same && meets(aw, bw))
                    || ar.is_some_and(|r| meets(r, bw))
                    || (!same && br.is_some_and(|r| meets(r, aw)));
                if hit {
                    want.extend([a.tag, b.tag]);
                }
            }
        }
        want.sort_unstable();
        want.dedup();

        let (failed, causes) = rig.run(&fragments);
        prop_assert_eq!(&failed, &want);
        prop_assert!(causes.iter().all(|c| *c == FailureCause::Overlap));
        // The reference: the other objects' fragments one by one on the initial bytes.
        let mut reference = initial.clone();
        for f in fragments.iter().filter(|f| !want.contains(&f.tag)) {
            let bytes: Vec<u8> = if f.src == dev.id() {
                initial[f.src_offset as usize..(f.src_offset + f.len) as usize].to_vec()
            } else {
                rig.host[f.src_offset as usize..(f.src_offset + f.len) as usize].to_vec()
            };
            reference[f.dst_offset as usize..(f.dst_offset + f.len) as usize].copy_from_slice(&bytes);
        }
        prop_assert!(rig.read(&dev) == reference);
    }
}
