//! Routing, registration fan-out, one object scope across engines, and failure attribution.

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use support::*;
use umbp_composite::{route, CompositeEngine, ObjectError, Route};
use umbp_example_engine::DownstreamEngine;
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    BatchState, DeviceOrdinal, Endpoint, EndpointRegistry, Error, Fragment, ObjectState, Register,
    RejectReason, Tag, TransferEngine,
};

#[test]
fn registration_and_its_end_reach_every_engine_once() {
    let registry = EndpointRegistry::new();
    let a = Arc::new(CountingEngine::new(registry.clone(), false));
    let b = Arc::new(CountingEngine::new(registry.clone(), false));
    let composite = CompositeEngine::new(registry.clone(), vec![a.clone(), b.clone()]);
    let memory = composite.register_memory(vec![0u8; 64]).unwrap();
    let file = composite.register_file(tempfile::tempfile().unwrap(), 0, 4096).unwrap();
    let counts = |e: &CountingEngine| {
        (e.registered.load(Ordering::Relaxed), e.released.load(Ordering::Relaxed))
    };
    assert_eq!((counts(&a), counts(&b)), ((2, 0), (2, 0)));
    let (memory_id, file_id) = (memory.id(), file.id());
    assert!(registry.get(memory_id).is_some() && registry.get(file_id).is_some());
    assert_eq!(memory.deregister().len(), 64, "the buffer comes back");
    drop(file);
    assert_eq!((counts(&a), counts(&b)), ((2, 2), (2, 2)));
    assert!(registry.get(memory_id).is_none() && registry.get(file_id).is_none());
}

#[test]
fn a_registration_an_engine_refuses_leaves_nothing_behind() {
    let registry = EndpointRegistry::new();
    let a = Arc::new(CountingEngine::new(registry.clone(), false));
    // The device engine pins registered host memory for device 3, which the simulator lacks.
    let gpu3 = Some(DeviceOrdinal::new(3));
    let config = HbmConfig { pin_registered_host: gpu3, ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
    let composite = CompositeEngine::new(registry.clone(), vec![a.clone(), hbm]);
    let err = composite.register_memory(vec![0u8; 64]).unwrap_err();
    assert!(
        matches!(&err, umbp_plan::RegisterError::Engine { engine, .. } if engine == "hbm"),
        "{err:?}"
    );
    assert_eq!(registry.snapshot().iter().count(), 0, "the registration was undone");
    assert_eq!(
        (a.registered.load(Ordering::Relaxed), a.released.load(Ordering::Relaxed)),
        (1, 1),
        "the engine told first was told to release it"
    );
}

#[test]
fn routing_picks_the_first_engine_that_claims_a_pair() {
    let rig = Rig::new();
    let engines = rig.composite.engines();
    let host = Endpoint::host(0x1000, 10);
    let dev = Endpoint::device(GPU, 0x2000, 10);
    let file = Endpoint::file(3, 0, 10, false);
    let table = [
        (host, host, Route::Direct(0)),
        (host, dev, Route::Direct(1)),
        (dev, host, Route::Direct(1)),
        (dev, dev, Route::Direct(1)),
        (file, host, Route::Unrouted),
        (host, file, Route::Unrouted),
        (file, dev, Route::Unrouted),
    ];
    for (s, d, expected) in table {
        assert_eq!(route(engines, None, &s, &d), expected, "{:?} -> {:?}", s.kind(), d.kind());
    }
    // With a bounce region, device -> file has no direct engine here and no file engine
    // either: still unrouted.
    assert_eq!(route(engines, Some(&host), &dev, &file), Route::Unrouted);
}

#[test]
fn each_engine_gets_one_builder_and_one_submit_per_batch() {
    let registry = EndpointRegistry::new();
    let counting = Arc::new(CountingEngine::new(registry.clone(), false));
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry.clone(), vec![host, counting.clone()]);
    let mut src = pattern(8192, 1);
    let mut dst = vec![POISON; 8192];
    // SAFETY: buffers outlive the transfers below.
    let (s, d) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, 8192)).unwrap(),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, 8192)).unwrap(),
        )
    };
    // SAFETY: an invented device address: the counting engine never touches memory.
    let dev = unsafe {
        register(&composite, Endpoint::device(DeviceOrdinal::new(0), 0x7000_0000, 8192)).unwrap()
    };
    let mut b = composite.builder();
    for t in 0..8u32 {
        let off = u64::from(t) * 1024;
        b.begin_object(Tag::new(t)).unwrap();
        b.push(Fragment::new(s, off, d, off, 1024, Tag::new(t))).unwrap();
        b.push(Fragment::new(s, off, dev, off, 1024, Tag::new(t))).unwrap();
        b.commit_object().unwrap();
    }
    let plans = b.finish().unwrap();
    assert_eq!(plans.parts().len(), 2, "one part per engine that got fragments");
    assert_eq!(counting.builders.load(Ordering::Relaxed), 1);
    let report = composite.submit(plans).unwrap().wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    assert_eq!(counting.submits.load(Ordering::Relaxed), 1);
    assert_eq!(dst, src);
}

#[test]
fn a_pair_no_engine_claims_rejects_its_object_everywhere() {
    let rig = Rig::new();
    let mut a = pattern(4096, 1);
    let mut out = vec![POISON; 4096];
    let (src, dst) = (rig.host(&mut a), rig.host(&mut out));
    let file = umbp_plan::testing::invent_file(&rig.registry, 5, 0, 4096, false);
    let mut b = rig.composite.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(Fragment::new(src, 0, dst, 0, 1024, Tag::new(0))).unwrap();
    let err = b.push(Fragment::new(file, 0, dst, 1024, 1024, Tag::new(0))).unwrap_err();
    assert_eq!(
        err,
        Error::Rejected {
            tag: Tag::new(0),
            reason: RejectReason::PairNotHandled { src: file, dst }
        }
    );
    b.commit_object().unwrap();
    b.begin_object(Tag::new(1)).unwrap();
    b.push(Fragment::new(src, 2048, dst, 2048, 1024, Tag::new(1))).unwrap();
    b.commit_object().unwrap();
    let plans = b.finish().unwrap();
    assert_eq!(rejected_tags(&plans), vec![Tag::new(0)]);
    let tags: Vec<Tag> = plans
        .parts()
        .iter()
        .flat_map(|p| p.plans.plans())
        .flat_map(|p| p.tags())
        .copied()
        .collect();
    assert_eq!(tags, vec![Tag::new(1)], "nothing of object 0 reached any engine");
    let report = rig.composite.submit(plans).unwrap().wait();
    assert!(report.objects.iter().all(|o| o.state != ObjectState::Failed), "{report:?}");
    // The message says what would carry the pair.
    let message = report.objects[0].error.as_ref().unwrap().to_string();
    assert!(message.contains("no engine carries") && message.contains("set_staging"), "{message}");
    assert!(out[..2048].iter().all(|&x| x == POISON));
    assert_eq!(&out[2048..3072], &a[2048..3072]);
    let snapshot = rig.composite.metrics_snapshot();
    let unrouted = snapshot.get(&("unrouted".to_string(), "file->host".to_string()));
    assert_eq!(unrouted.map(|c| c.rejected_objects), Some(1));
}

#[test]
fn an_object_spanning_two_engines_whose_last_range_is_invalid_leaves_nothing_in_either() {
    let rig = Rig::new();
    let mut arena = pattern(64 << 10, 3);
    let mut host_out = vec![POISON; 64 << 10];
    let src = rig.host(&mut arena);
    let dst = rig.host(&mut host_out);
    let dev = rig.device(64 << 10);
    let mut b = rig.composite.builder();
    for t in 0..3u32 {
        let off = u64::from(t) * 8192;
        b.begin_object(Tag::new(t)).unwrap();
        b.push(Fragment::new(src, off, dst, off, 4096, Tag::new(t))).unwrap(); // host copy engine
        b.push(Fragment::new(src, off + 4096, dev.id, off, 4096, Tag::new(t))).unwrap(); // device engine
                                                                                         // Object 1's third range runs past the device buffer.
        let third = if t == 1 { (64 << 10) - 100 } else { off + 4096 };
        let pushed = b.push(Fragment::new(src, off, dev.id, third, 4096, Tag::new(t)));
        assert_eq!(pushed.is_err(), t == 1);
        b.commit_object().unwrap();
    }
    let plans = b.finish().unwrap();
    assert_eq!(rejected_tags(&plans), vec![Tag::new(1)]);
    for part in plans.parts() {
        for plan in part.plans.plans() {
            assert!(!plan.tags().contains(&Tag::new(1)), "engine {} kept object 1", part.engine);
        }
    }
    let report = rig.composite.submit(plans).unwrap().wait();
    assert!(report.objects.iter().all(|o| o.state != ObjectState::Failed), "{report:?}");
    let device = rig.read_device(&dev);
    for t in 0..3usize {
        let off = t * 8192;
        let ok = t != 1;
        assert_eq!(host_out[off..off + 4096] == arena[off..off + 4096], ok, "host range of {t}");
        assert_eq!(
            device[off..off + 4096] == arena[off + 4096..off + 8192],
            ok,
            "device range of {t}"
        );
        if !ok {
            assert!(host_out[off..off + 4096].iter().all(|&x| x == POISON));
            assert!(device[off..off + 8192].iter().all(|&x| x == POISON));
        }
    }
}

#[test]
fn an_engine_that_accepts_nothing_fails_exactly_its_tags() {
    let registry = EndpointRegistry::new();
    let refusing = Arc::new(CountingEngine::new(registry.clone(), true));
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry.clone(), vec![host, refusing]);
    let mut src = pattern(4096, 2);
    let mut dst = vec![POISON; 4096];
    // SAFETY: buffers outlive the transfers; the device address is never touched.
    let (s, d, dev) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, 4096)).unwrap(),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, 4096)).unwrap(),
            register(&composite, Endpoint::device(DeviceOrdinal::new(0), 0x9000_0000, 4096))
                .unwrap(),
        )
    };
    let mut b = composite.builder();
    for t in 0..4u32 {
        let off = u64::from(t) * 1024;
        b.begin_object(Tag::new(t)).unwrap();
        let to = if t % 2 == 0 { d } else { dev };
        b.push(Fragment::new(s, off, to, off, 1024, Tag::new(t))).unwrap();
        b.commit_object().unwrap();
    }
    let report = composite.submit(b.finish().unwrap()).unwrap().wait();
    let failed: Vec<u64> = report.unsuccessful().map(|o| o.tag).collect();
    assert_eq!(failed, vec![1, 3]);
    assert!(report.unsuccessful().all(
        |o| matches!(&o.error, Some(ObjectError::Failed { engine, .. }) if engine == "refusing")
    ));
    assert_eq!(&dst[..1024], &src[..1024]);
    assert_eq!(&dst[2048..3072], &src[2048..3072]);
}

#[test]
fn an_engine_from_another_crate_is_routed_to() {
    let registry = EndpointRegistry::new();
    let downstream = Arc::new(DownstreamEngine::new(registry.clone()));
    let composite =
        CompositeEngine::new(registry.clone(), vec![downstream.clone() as Arc<dyn TransferEngine>]);
    let mut src = pattern(16 << 10, 4);
    let mut dst = vec![POISON; 16 << 10];
    // SAFETY: buffers outlive the transfer.
    let (s, d) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, 16 << 10)).unwrap(),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, 16 << 10)).unwrap(),
        )
    };
    let mut b = composite.builder();
    b.begin_object(Tag::new(0)).unwrap();
    for i in 0..4u64 {
        b.push(Fragment::new(s, (3 - i) * 4096, d, i * 4096, 4096, Tag::new(0))).unwrap();
    }
    b.commit_object().unwrap();
    let report = composite.submit(b.finish().unwrap()).unwrap().wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    assert_eq!(downstream.segments(), 4);
    for i in 0..4usize {
        assert_eq!(&dst[i * 4096..][..4096], &src[(3 - i) * 4096..][..4096]);
    }
}

fn rejected_tags(plans: &umbp_composite::RoutedPlans) -> Vec<Tag> {
    plans.rejected().iter().map(|&(t, _)| t).collect()
}
