//! Objects rejected at `finish` by an engine with a buffered builder are in no engine's plans
//! and no byte of them is written, whatever the other engines' builders merged.

mod support;

use std::collections::HashSet;
use std::sync::Arc;

use proptest::prelude::*;
use support::wrapped::Wrapped;
use support::*;
use umbp_composite::{CompositeEngine, ObjectError};
use umbp_plan::{BatchState, Endpoint, Fragment, ObjectState, RejectReason, Tag, TransferEngine};

/// Lengths the buffered engine refuses: multiples of this.
const REFUSED: u64 = 7;

/// One object: `host` bytes copied host -> host, then device fragments of these lengths.
#[derive(Clone, Debug)]
struct Object {
    host: u64,
    device: Vec<u64>,
}

fn objects() -> impl Strategy<Value = Vec<Object>> {
    let object = (1u64..600, prop::collection::vec(1u64..300, 0..4))
        .prop_map(|(host, device)| Object { host, device });
    prop::collection::vec(object, 1..12)
}

fn check(objects: &[Object], buffered_first: bool) {
    let rig = Rig::new();
    let registry = rig.registry.clone();
    let hbm: Arc<dyn TransferEngine> = rig.hbm.clone();
    let refusing =
        Arc::new(Wrapped::new(hbm, registry.clone(), "buffered").buffered_refusing(REFUSED));
    // The host copy engine plans incrementally (and merges neighbouring objects into one
    // segment); the device side plans at finish and refuses some lengths only then.
    let engines: Vec<Arc<dyn TransferEngine>> = if buffered_first {
        vec![refusing.clone(), rig.host.clone()]
    } else {
        vec![rig.host.clone(), refusing.clone()]
    };
    let composite = CompositeEngine::new(registry, engines);
    let host_len: u64 = objects.iter().map(|o| o.host).sum();
    let device_len: u64 = objects.iter().flat_map(|o| &o.device).sum();
    let mut src = pattern((host_len + device_len) as usize, 9);
    let mut out = vec![POISON; host_len as usize];
    let dev = rig.device(device_len.max(1));
    // SAFETY: the buffers outlive the batch, which is waited on below.
    let (s, d) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, src.len() as u64))
                .unwrap(),
            register(&composite, Endpoint::host(out.as_mut_ptr() as u64, host_len)).unwrap(),
        )
    };

    let mut b = composite.builder();
    let (mut h, mut v) = (0u64, 0u64);
    let mut spans = Vec::new();
    for (o, object) in objects.iter().enumerate() {
        let tag = Tag::new(o as u32);
        b.begin_object(tag).unwrap();
        // Two host fragments, adjacent to each other and to the previous object's.
        let half = object.host / 2;
        b.push(Fragment::new(s, h, d, h, half, tag)).unwrap();
        b.push(Fragment::new(s, h + half, d, h + half, object.host - half, tag)).unwrap();
        let mut device = Vec::new();
        for &len in &object.device {
            b.push(Fragment::new(s, host_len + v, dev.id, v, len, tag)).unwrap();
            device.push((v, len));
            v += len;
        }
        b.commit_object().unwrap();
        spans.push((h, object.host, device));
        h += object.host;
    }
    let plans = b.finish().unwrap();

    let refused: HashSet<Tag> = objects
        .iter()
        .enumerate()
        .filter(|(_, o)| o.device.iter().any(|l| l % REFUSED == 0))
        .map(|(i, _)| Tag::new(i as u32))
        .collect();
    let rejected: HashSet<Tag> = plans.rejected().iter().map(|&(t, _)| t).collect();
    assert_eq!(rejected, refused, "exactly the refused objects are rejected");
    for part in plans.parts() {
        for plan in part.plans.plans() {
            assert!(
                plan.tags().iter().all(|t| !refused.contains(t)),
                "engine {} kept a rejected object",
                part.engine
            );
        }
    }

    let report = composite.submit(plans).unwrap().wait();
    let device = rig.read_device(&dev);
    for (o, (h, len, device_spans)) in spans.iter().enumerate() {
        let r = &report.objects[o];
        let host_range = *h as usize..(*h + *len) as usize;
        if refused.contains(&Tag::new(o as u32)) {
            assert_eq!(r.state, ObjectState::Rejected);
            assert!(matches!(
                r.error,
                Some(ObjectError::Rejected(
                    umbp_plan::Error::Rejected {
                        reason: RejectReason::Misaligned { align: REFUSED, .. },
                        ..
                    },
                    _
                ))
            ));
            assert!(out[host_range].iter().all(|&x| x == POISON), "object {o} written to host");
            for &(at, l) in device_spans {
                let range = at as usize..(at + l) as usize;
                assert!(device[range].iter().all(|&x| x == POISON), "object {o} on the device");
            }
        } else {
            assert_eq!(r.state, ObjectState::Completed, "object {o}: {r:?}");
            assert_eq!(out[host_range.clone()], src[host_range], "object {o} host bytes");
            for &(at, l) in device_spans {
                let from = (host_len + at) as usize;
                assert_eq!(
                    device[at as usize..(at + l) as usize],
                    src[from..from + l as usize],
                    "object {o} device bytes"
                );
            }
        }
    }
    let expected = if refused.is_empty() { BatchState::Completed } else { BatchState::Failed };
    assert_eq!(report.aggregate, expected);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn objects_rejected_at_finish_are_nowhere_and_unwritten(
        objects in objects(),
        buffered_first in any::<bool>(),
    ) {
        check(&objects, buffered_first);
    }
}
