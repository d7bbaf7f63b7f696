//! The non-blocking batch: submit returns at once, layer groups settle in order, deadlines,
//! cancel and drop; engine panics fail exactly their objects; misuse gets typed errors.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::tiered::*;
use support::wrapped::{Gate, Wrapped};
use support::*;
use umbp_composite::{
    restore, CompositeConfig, CompositeEngine, Error, ObjectError, ObjectRange, ObjectTransfer,
    PagedObject,
};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    BatchState, Endpoint, EndpointId, EndpointRegistry, FailureCause, Fragment, ObjectState,
    Register, Tag, TransferEngine,
};

const OBJECT: u64 = 4096;

/// One composite over a wrapped host copy engine, a source pattern and a poisoned destination
/// of `objects` objects.
struct HostRig {
    composite: CompositeEngine,
    engine: Arc<Wrapped>,
    src: Vec<u8>,
    dst: Vec<u8>,
    ids: (EndpointId, EndpointId),
}

fn host_rig(objects: usize, wrap: impl FnOnce(Wrapped) -> Wrapped) -> HostRig {
    host_rig_with(objects, CompositeConfig::default(), wrap)
}

/// [`host_rig`] with the composite's executor configured as `config` says.
fn host_rig_with(
    objects: usize,
    config: CompositeConfig,
    wrap: impl FnOnce(Wrapped) -> Wrapped,
) -> HostRig {
    let registry = EndpointRegistry::new();
    let host: Arc<dyn TransferEngine> = Arc::new(LocalCopyEngine::new(registry.clone()));
    let engine = Arc::new(wrap(Wrapped::new(host, registry.clone(), "wrapped")));
    let composite = CompositeEngine::with_config(registry, vec![engine.clone()], config);
    let len = objects * OBJECT as usize;
    let mut src = pattern(len, 3);
    let mut dst = vec![POISON; len];
    // SAFETY: both buffers live in the rig, which outlives every batch of each test (batches
    // are waited on or dropped, which waits, before the rig goes).
    let ids = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, len as u64)).unwrap(),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, len as u64)).unwrap(),
        )
    };
    HostRig { composite, engine, src, dst, ids }
}

impl HostRig {
    /// Objects `objects` (each its 4 KiB, group 0), with `deadline`.
    fn plans_of(
        &self,
        objects: std::ops::Range<usize>,
        deadline: Option<Instant>,
    ) -> umbp_composite::RoutedPlans {
        let mut b = self.composite.builder();
        b.set_deadline(deadline);
        for o in objects {
            let tag = Tag::new(o as u32);
            b.begin_object(tag).unwrap();
            let at = o as u64 * OBJECT;
            b.push(Fragment::new(self.ids.0, at, self.ids.1, at, OBJECT, tag)).unwrap();
            b.commit_object().unwrap();
        }
        b.finish().unwrap()
    }

    /// Object `o` copies its 4 KiB in layer group `group(o)`.
    fn plans(&self, objects: usize, group: impl Fn(usize) -> u32) -> umbp_composite::RoutedPlans {
        let mut b = self.composite.builder();
        for o in 0..objects {
            let tag = Tag::new(o as u32);
            b.set_group(group(o));
            b.begin_object(tag).unwrap();
            let at = o as u64 * OBJECT;
            b.push(Fragment::new(self.ids.0, at, self.ids.1, at, OBJECT, tag)).unwrap();
            b.commit_object().unwrap();
        }
        b.finish().unwrap()
    }

    fn object_arrived(&self, o: usize) -> bool {
        let r = o * OBJECT as usize..(o + 1) * OBJECT as usize;
        self.dst[r.clone()] == self.src[r]
    }

    fn object_untouched(&self, o: usize) -> bool {
        self.dst[o * OBJECT as usize..(o + 1) * OBJECT as usize].iter().all(|&x| x == POISON)
    }
}

#[test]
fn submit_returns_before_a_slow_engine_finishes_and_a_deadline_can_pass() {
    let rig = host_rig(2, |w| w.slow(Duration::from_millis(300)));
    let plans = rig.plans(2, |_| 0);
    let t = Instant::now();
    let batch = rig.composite.submit(plans).unwrap();
    let returned = t.elapsed();
    assert!(returned < Duration::from_millis(150), "submit took {returned:?}");
    assert!(!batch.is_done());
    assert_eq!(batch.state(0), Some(ObjectState::InFlight));
    assert_eq!(batch.aggregate(), BatchState::InFlight);
    assert_eq!(rig.composite.in_flight().batches, 1);
    assert_eq!(rig.composite.in_flight().bytes, 2 * OBJECT);

    assert!(batch.wait_timeout(Duration::from_millis(20)).is_none(), "the engine is still busy");
    let report = batch.wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(batch.wait(), report, "wait is idempotent");
    assert!(batch.wait_timeout(Duration::ZERO).is_some());
    assert_eq!(rig.composite.in_flight().batches, 0);
    assert!(rig.object_arrived(0) && rig.object_arrived(1));
}

#[test]
fn layer_groups_run_in_order_and_group_zero_is_ready_while_the_last_is_in_flight() {
    let rig = host_rig(4, |w| w.slow(Duration::from_millis(120)));
    let batch = rig.composite.submit(rig.plans(4, |o| o as u32 * 10)).unwrap();
    assert_eq!(batch.groups(), &[0, 10, 20, 30]);
    batch.wait_group(0);
    assert!(batch.is_group_done(0) && batch.is_group_done(5), "no group between 0 and 10");
    assert!(!batch.is_group_done(30), "the last group is still in flight");
    assert_eq!(batch.state(0), Some(ObjectState::Completed));
    assert_eq!(batch.state(3), Some(ObjectState::InFlight));
    assert!(rig.object_arrived(0));
    assert!(!batch.wait_group_timeout(30, Duration::from_millis(10)));
    assert!(batch.wait_group_timeout(20, Duration::from_secs(10)));
    assert_eq!(batch.wait().aggregate, BatchState::Completed);

    let records = rig.engine.records();
    let order: Vec<Vec<Tag>> = records.iter().map(|r| r.tags.clone()).collect();
    let expected: Vec<Vec<Tag>> = (0..4).map(|o| vec![Tag::new(o)]).collect();
    assert_eq!(order, expected, "one submit per group, in group order");
    for pair in records.windows(2) {
        assert!(pair[1].started >= pair[0].ended, "group k+1 started before group k ended");
    }
    assert!((0..4).all(|o| rig.object_arrived(o)));
}

/// Records each group it is told of.
struct Recorder {
    told: std::sync::Mutex<Vec<u32>>,
}

impl umbp_composite::GroupListener for Recorder {
    fn group_settled(&self, group: u32) {
        self.told.lock().unwrap().push(group);
    }
}

#[test]
fn a_group_listener_hears_each_group_once_in_order() {
    let rig = host_rig(4, |w| w.slow(Duration::from_millis(30)));
    let recorder = Arc::new(Recorder { told: std::sync::Mutex::new(Vec::new()) });
    let mut b = rig.composite.builder();
    b.set_group_listener(recorder.clone());
    for o in 0..4u32 {
        // Groups 7, 5, 3, 1: the listener hears them sorted, whatever the push order.
        b.set_group(7 - 2 * o);
        b.begin_object(Tag::new(o)).unwrap();
        let at = u64::from(o) * OBJECT;
        b.push(Fragment::new(rig.ids.0, at, rig.ids.1, at, OBJECT, Tag::new(o))).unwrap();
        b.commit_object().unwrap();
    }
    let batch = rig.composite.submit(b.finish().unwrap()).unwrap();
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    assert_eq!(*recorder.told.lock().unwrap(), [1, 3, 5, 7]);
    let tags: Vec<Vec<Tag>> = rig.engine.records().iter().map(|r| r.tags.clone()).collect();
    assert_eq!(tags, [[Tag::new(3)], [Tag::new(2)], [Tag::new(1)], [Tag::new(0)]]);
}

/// Records what it is told, `(true, k)` for "group k enqueued" and `(false, k)` for "settled",
/// each after a short sleep, so that lanes settling side by side would overtake each other's
/// calls if nothing kept them in order.
#[derive(Default)]
struct SlowHeard(std::sync::Mutex<Vec<(bool, u32)>>);

impl umbp_composite::GroupListener for SlowHeard {
    fn group_enqueued(&self, group: u32) {
        std::thread::sleep(Duration::from_micros(50));
        self.0.lock().unwrap().push((true, group));
    }

    fn group_settled(&self, group: u32) {
        std::thread::sleep(Duration::from_micros(50));
        self.0.lock().unwrap().push((false, group));
    }
}

/// Each group has an object on the host copy engine's lane and one on the device engine's, so
/// two executor threads settle parts of every group side by side: the listener still hears
/// every group enqueued and settled in order, each enqueued before it settled, and all of it
/// before `wait` returns, when the batch has also left the in-flight count.
#[test]
fn two_lanes_settling_side_by_side_tell_the_listener_in_order_before_wait_returns() {
    const GROUPS: u32 = 24;
    let rig = Rig::new();
    let len = GROUPS as usize * OBJECT as usize;
    let mut src = pattern(len, 4);
    let mut host_dst = vec![POISON; len];
    let (src_id, host_id) = (rig.host(&mut src), rig.host(&mut host_dst));
    let device = rig.device(len as u64);
    for round in 0..50 {
        let heard = Arc::new(SlowHeard::default());
        let mut b = rig.composite.builder();
        b.set_group_listener(heard.clone());
        for g in 0..GROUPS {
            b.set_group(g);
            let at = u64::from(g) * OBJECT;
            for (tag, dst) in [(Tag::new(2 * g), host_id), (Tag::new(2 * g + 1), device.id)] {
                b.begin_object(tag).unwrap();
                b.push(Fragment::new(src_id, at, dst, at, OBJECT, tag)).unwrap();
                b.commit_object().unwrap();
            }
        }
        let batch = rig.composite.submit(b.finish().unwrap()).unwrap();
        let report = batch.wait();
        assert_eq!(report.aggregate, BatchState::Completed, "round {round}: {report:?}");
        assert_eq!(rig.composite.in_flight().batches, 0, "round {round}: still in flight");
        let events = std::mem::take(&mut *heard.0.lock().unwrap());
        let told = |enqueued: bool| -> Vec<u32> {
            events.iter().filter(|e| e.0 == enqueued).map(|e| e.1).collect()
        };
        let all: Vec<u32> = (0..GROUPS).collect();
        assert_eq!(told(true), all, "round {round}: enqueued out of order or missing");
        assert_eq!(told(false), all, "round {round}: settled out of order or missing");
        for g in 0..GROUPS {
            let at = |e| events.iter().position(|&x| x == e);
            assert!(at((true, g)) < at((false, g)), "round {round}: group {g} settled first");
        }
    }
    assert_eq!(host_dst, src);
    assert_eq!(rig.read_device(&device), src);
}

#[test]
fn cancel_skips_groups_not_started_and_returns_once_the_engine_is_idle() {
    let rig = host_rig(8, |w| w.slow(Duration::from_millis(80)));
    let batch = rig.composite.submit(rig.plans(8, |o| o as u32)).unwrap();
    batch.wait_group(0);
    let t = Instant::now();
    let report = batch.cancel();
    assert!(t.elapsed() < Duration::from_millis(500), "cancel waited for the whole batch");
    assert!(batch.is_done());
    let submits = rig.engine.records().len();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(rig.engine.records().len(), submits, "nothing ran after cancel returned");

    let cancelled: Vec<usize> =
        (0..8).filter(|&o| report.objects[o].state == ObjectState::Cancelled).collect();
    assert!(cancelled.len() >= 5, "{report:?}");
    assert_eq!(report.aggregate, BatchState::Failed);
    for o in 0..8 {
        match report.objects[o].state {
            ObjectState::Completed => assert!(rig.object_arrived(o), "object {o}"),
            ObjectState::Cancelled => {
                assert_eq!(report.objects[o].error, Some(ObjectError::Cancelled));
                assert!(rig.object_untouched(o), "cancelled object {o} was written");
            }
            other => panic!("object {o}: {other:?}"),
        }
    }
    assert_eq!(report.objects[0].state, ObjectState::Completed);
}

#[test]
fn dropping_a_pending_batch_or_the_composite_waits_for_the_engine() {
    let rig = host_rig(2, |w| w.slow(Duration::from_millis(200)));
    let batch = rig.composite.submit(rig.plans(1, |_| 0)).unwrap();
    let t = Instant::now();
    drop(batch);
    assert!(t.elapsed() >= Duration::from_millis(150), "drop returned before the engine ran");
    assert!(rig.object_arrived(0));

    let HostRig { composite, engine, src, dst, ids } = rig;
    let mut b = composite.builder();
    b.begin_object(Tag::new(1)).unwrap();
    b.push(Fragment::new(ids.0, OBJECT, ids.1, OBJECT, OBJECT, Tag::new(1))).unwrap();
    b.commit_object().unwrap();
    let plans = b.finish().unwrap();
    drop(b);
    let batch = composite.submit(plans).unwrap();
    let t = Instant::now();
    drop(composite);
    assert!(t.elapsed() >= Duration::from_millis(150), "the composite went with work in flight");
    assert!(batch.is_done());
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    assert_eq!(dst[OBJECT as usize..], src[OBJECT as usize..]);
    drop(engine);
}

#[test]
fn a_panicking_engine_in_a_direct_part_fails_exactly_that_part() {
    let rig = Rig::new();
    let registry = rig.registry.clone();
    let host: Arc<dyn TransferEngine> = rig.host.clone();
    let wrapped = Arc::new(Wrapped::new(host, registry.clone(), "panicky").panicking_on(&[0]));
    let composite = CompositeEngine::new(registry, vec![wrapped, rig.hbm.clone()]);
    let mut src = pattern(3 * OBJECT as usize, 5);
    let mut out = vec![POISON; 3 * OBJECT as usize];
    // SAFETY: the buffers outlive the batch, which is waited on below.
    let (s, d) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, 3 * OBJECT)).unwrap(),
            register(&composite, Endpoint::host(out.as_mut_ptr() as u64, 3 * OBJECT)).unwrap(),
        )
    };
    let dev = rig.device(3 * OBJECT);
    let mut b = composite.builder();
    // Object 0: host -> host (the panicking engine), object 1: host -> device, object 2: host
    // -> host in layer group 1 (another part of the same engine).
    for (o, to, group) in [(0u32, d, 0), (1, dev.id, 0), (2, d, 1)] {
        let at = u64::from(o) * OBJECT;
        b.set_group(group);
        b.begin_object(Tag::new(o)).unwrap();
        b.push(Fragment::new(s, at, to, at, OBJECT, Tag::new(o))).unwrap();
        b.commit_object().unwrap();
    }
    let report = composite.submit(b.finish().unwrap()).unwrap().wait();
    let states: Vec<ObjectState> = report.objects.iter().map(|o| o.state).collect();
    assert_eq!(states, [ObjectState::Failed, ObjectState::Completed, ObjectState::Completed]);
    match &report.objects[0].error {
        Some(ObjectError::Failed { engine, cause: FailureCause::Panicked { message }, .. }) => {
            assert_eq!(engine, "panicky");
            assert!(message.contains("told to panic on object 0"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(out[..OBJECT as usize].iter().all(|&x| x == POISON));
    assert_eq!(&out[2 * OBJECT as usize..], &src[2 * OBJECT as usize..]);
    // The panic counts as one failed plan of that engine.
    let failures: u64 = composite
        .metrics_snapshot()
        .iter()
        .filter(|((engine, _), _)| engine == "panicky")
        .map(|(_, c)| c.failures)
        .sum();
    assert_eq!(failures, 1);
    let device = rig.read_device(&dev);
    assert_eq!(
        &device[OBJECT as usize..2 * OBJECT as usize],
        &src[OBJECT as usize..2 * OBJECT as usize]
    );
    // The composite still works after the panic.
    let mut b = composite.builder();
    b.begin_object(Tag::new(7)).unwrap();
    b.push(Fragment::new(s, 0, d, 0, OBJECT, Tag::new(7))).unwrap();
    b.commit_object().unwrap();
    assert_eq!(
        composite.submit(b.finish().unwrap()).unwrap().wait().aggregate,
        BatchState::Completed
    );
}

/// Restores four 64 KiB objects from the file into the device through the staged route (one
/// object per 64 KiB stage) with engine `which` (1: device, the second hop; 2: SSD, the first)
/// panicking on object `victim`.
fn staged_restore_with_a_panic(which: usize, victim: u32) -> (Vec<ObjectState>, String) {
    let t = tiered_with(16, true, |i, engine, registry| {
        if i == which {
            Arc::new(Wrapped::new(engine, registry.clone(), "panicky").panicking_on(&[victim]))
        } else {
            engine
        }
    });
    let dev = device(&t.hbm, 16 * PAGE);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 4, 16)).collect();
    let size = 4 * PAGE;
    let ranges: Vec<[ObjectRange; 1]> =
        (0..4).map(|o| [ObjectRange::new(0, size, dev.id, o as u64 * size)]).collect();
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            ObjectTransfer::new(
                100 + o as u64,
                PagedObject::new(t.file_id, &tables[o], PAGE, size),
                &ranges[o],
            )
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &objects).unwrap();
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, r) in report.objects.iter().enumerate() {
        assert_eq!(r.tag, 100 + o as u64);
        let got = &device[o * size as usize..(o + 1) * size as usize];
        match r.state {
            ObjectState::Completed => {
                assert_eq!(got, object_bytes(&t.file, &tables[o], 0, size), "object {o}")
            }
            _ => assert!(got.iter().all(|&x| x == POISON), "failed object {o} reached the device"),
        }
    }
    let cause =
        report.unsuccessful().map(|o| format!("{:?}", o.error)).collect::<Vec<_>>().join("; ");
    (report.objects.iter().map(|o| o.state).collect(), cause)
}

#[test]
fn a_panic_in_either_hop_of_a_stage_fails_exactly_that_stage_s_object() {
    use ObjectState::{Completed as C, Failed as F};
    let (states, cause) = staged_restore_with_a_panic(2, 1);
    assert_eq!(states, [C, F, C, C], "first hop: {cause}");
    assert!(cause.contains("Panicked") && cause.contains("panicky"), "{cause}");
    let (states, cause) = staged_restore_with_a_panic(1, 2);
    assert_eq!(states, [C, C, F, C], "second hop: {cause}");
    assert!(cause.contains("Panicked"), "{cause}");
}

#[test]
fn plans_from_another_composite_and_duplicate_tags_are_typed_errors() {
    let a = host_rig(2, |w| w);
    let b = host_rig(2, |w| w);
    let plans = a.plans(1, |_| 0);
    assert!(matches!(b.composite.submit(plans), Err(Error::ForeignPlans)));

    let mut builder = a.composite.builder();
    builder.begin_object(Tag::new(3)).unwrap();
    builder.commit_object().unwrap();
    assert_eq!(
        builder.begin_object(Tag::new(3)),
        Err(umbp_plan::Error::DuplicateTag { tag: Tag::new(3) })
    );
    // A rolled-back object leaves the batch, and its tag may be used again.
    builder.begin_object(Tag::new(4)).unwrap();
    builder.rollback_object().unwrap();
    builder.begin_object(Tag::new(4)).unwrap();
    builder.commit_object().unwrap();
    let plans = builder.finish().unwrap();
    assert_eq!(plans.objects(), &[Tag::new(3), Tag::new(4)]);

    let pages = [0u64];
    let ranges = [ObjectRange::new(0, OBJECT, a.ids.1, 0)];
    let object = PagedObject::new(a.ids.0, &pages, OBJECT, OBJECT);
    let twice = [ObjectTransfer::new(9, object, &ranges), ObjectTransfer::new(9, object, &ranges)];
    let mut builder = a.composite.builder();
    assert!(matches!(restore(&mut builder, &twice), Err(Error::DuplicateTag(9))));
    assert!(a.object_untouched(0), "nothing was planned or written");
    builder.begin_object(Tag::new(0)).unwrap();
    assert!(matches!(restore(&mut builder, &twice[..1]), Err(Error::BuilderInUse)));
}

#[test]
fn a_rejected_object_carries_its_reason() {
    let rig = host_rig(2, |w| w);
    let pages = [0u64, OBJECT];
    let good = [ObjectRange::new(0, OBJECT, rig.ids.1, 0)];
    let past_end = [ObjectRange::new(0, OBJECT, rig.ids.1, 2 * OBJECT - 10)];
    let bad_range = [ObjectRange::new(OBJECT, 2 * OBJECT, rig.ids.1, 0)];
    let object = PagedObject::new(rig.ids.0, &pages, OBJECT, 2 * OBJECT);
    let objects = [
        ObjectTransfer::new(1 << 40, object, &good),
        ObjectTransfer::new(7, object, &past_end),
        ObjectTransfer::new(u64::MAX, object, &bad_range),
    ];
    let report = restore(&mut rig.composite.builder(), &objects).unwrap();
    assert_eq!(report.objects[0].tag, 1 << 40);
    assert_eq!(report.objects[0].state, ObjectState::Completed);
    assert!(matches!(
        report.object(7).and_then(|o| o.error.clone()),
        Some(ObjectError::Rejected(
            umbp_plan::Error::Rejected { reason: umbp_plan::RejectReason::OutOfBounds { .. }, .. },
            _
        ))
    ));
    assert!(matches!(
        report.object(u64::MAX).and_then(|o| o.error.clone()),
        Some(ObjectError::Rejected(
            umbp_plan::Error::Walk(umbp_plan::WalkError::RangePastEnd { .. }),
            _
        ))
    ));
    // The message gives the reason, not the batch's internal position of the object (1 here),
    // which the caller never chose: the result's own tag names the object.
    let message = report.object(7).and_then(|o| o.error.clone()).unwrap().to_string();
    assert!(message.starts_with("rejected: bytes ") && !message.contains("object"), "{message}");
    // So does its Debug: the reason, no internal tag; the result around it names the caller's.
    let result = format!("{:?}", report.object(7).unwrap());
    assert!(result.contains("tag: 7, ") && result.matches("tag").count() == 1, "{result}");
    assert!(result.contains("Rejected(OutOfBounds {"), "{result}");
}

#[test]
fn deregistering_an_endpoint_of_a_batch_in_flight_waits_for_the_batch() {
    let rig = host_rig(2, |w| w.slow(Duration::from_millis(200)));
    let batch = rig.composite.submit(rig.plans(2, |o| o as u32)).unwrap();
    let t = Instant::now();
    // The destination goes (through the registry beneath the registrations; the chaos test
    // ends guards mid-flight) while the engine is still sleeping before its copy.
    rig.composite.registry().deregister(rig.ids.1).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(150), "deregister did not wait for the batch");
    assert!(batch.is_done());
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    assert!(rig.object_arrived(0) && rig.object_arrived(1));
    // It is gone for good: a second deregistration is a typed error.
    assert!(matches!(
        rig.composite.registry().deregister(rig.ids.1),
        Err(umbp_plan::Error::UnknownEndpoint { .. })
    ));
}

/// An engine that panics when told a registration ended costs nothing else: the drop of the
/// guard returns, and the engines after it are still told (so each releases what it holds).
#[test]
fn an_engine_panicking_as_an_endpoint_is_released_does_not_stop_the_others_being_told() {
    let registry = EndpointRegistry::new();
    let host: Arc<dyn TransferEngine> = Arc::new(LocalCopyEngine::new(registry.clone()));
    let wrap = |name| Wrapped::new(host.clone(), registry.clone(), name);
    let (first, second) =
        (Arc::new(wrap("first").panicking_on_release()), Arc::new(wrap("second")));
    let composite = CompositeEngine::new(registry, vec![first.clone(), second.clone()]);
    let mut bytes = vec![0u8; 4096];
    // SAFETY: `bytes` outlives the registration, and no transfer uses it.
    let registration =
        unsafe { composite.register_raw_memory(Endpoint::host(bytes.as_mut_ptr() as u64, 4096)) }
            .unwrap();
    let id = registration.id();
    drop(registration);
    assert_eq!(*first.released.lock().unwrap(), [id]);
    assert_eq!(*second.released.lock().unwrap(), [id], "the second engine was never told");
    assert!(composite.registry().get(id).is_none());
}

/// An engine builder whose `finish` fails with an error it may not give: the batch is refused
/// with that error and nothing moves, and the composite's builder is left clean: the same
/// objects (the same tags) plan and run in the next batch.
#[test]
fn an_engine_builder_failing_finish_refuses_the_batch_and_leaves_the_builder_clean() {
    let rig = host_rig(2, Wrapped::finish_failing_once);
    let mut b = rig.composite.builder();
    let plan = |b: &mut umbp_composite::CompositeBuilder| {
        for o in 0..2u32 {
            let (tag, at) = (Tag::new(o), u64::from(o) * OBJECT);
            b.begin_object(tag).unwrap();
            b.push(Fragment::new(rig.ids.0, at, rig.ids.1, at, OBJECT, tag)).unwrap();
            b.commit_object().unwrap();
        }
        b.finish()
    };
    assert!(matches!(plan(&mut b), Err(umbp_plan::Error::ObjectOpen { .. })));
    assert!(rig.object_untouched(0) && rig.object_untouched(1));
    let plans = plan(&mut b).expect("the builder is clean again");
    let report = rig.composite.submit(plans).unwrap().wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    assert!(rig.object_arrived(0) && rig.object_arrived(1));
}

#[test]
fn a_deadline_times_out_the_work_not_done_by_then() {
    let rig = host_rig(4, |w| w.slow(Duration::from_millis(100)));
    let mut b = rig.composite.builder();
    for o in 0..4u32 {
        b.set_group(o);
        b.begin_object(Tag::new(o)).unwrap();
        let at = u64::from(o) * OBJECT;
        b.push(Fragment::new(rig.ids.0, at, rig.ids.1, at, OBJECT, Tag::new(o))).unwrap();
        b.commit_object().unwrap();
    }
    let start = Instant::now();
    b.set_deadline(Some(start + Duration::from_millis(150)));
    let plans = b.finish().unwrap();
    assert!(plans.deadline().is_some());
    let report = rig.composite.submit(plans).unwrap().wait();
    assert!(start.elapsed() < Duration::from_millis(400), "took {:?}", start.elapsed());
    assert_eq!(report.objects[0].state, ObjectState::Completed);
    for o in 2..4 {
        assert!(
            matches!(
                report.objects[o].error,
                Some(ObjectError::Failed { cause: FailureCause::TimedOut, .. })
            ),
            "{report:?}"
        );
        assert!(rig.object_untouched(o));
    }
    assert!(rig.object_arrived(0));
    // Group 1 started before the deadline: the copy engine found it passed when it got there.
    assert_ne!(report.objects[1].state, ObjectState::InFlight);
}

#[test]
fn a_panicking_engine_builder_loses_its_objects_of_the_batch_and_nothing_panics_out() {
    let rig = Rig::new();
    let registry = rig.registry.clone();
    let host: Arc<dyn TransferEngine> = rig.host.clone();
    let panicky = Wrapped::new(host, registry.clone(), "panicky-builder").builder_panicking_on(2);
    let composite = CompositeEngine::new(registry, vec![Arc::new(panicky), rig.hbm.clone()]);
    let len = 4 * OBJECT as usize;
    let mut src = pattern(len, 8);
    let mut out = vec![POISON; len];
    // SAFETY: the buffers outlive the batch, which is waited on below.
    let (s, d) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, len as u64)).unwrap(),
            register(&composite, Endpoint::host(out.as_mut_ptr() as u64, len as u64)).unwrap(),
        )
    };
    let dev = rig.device(len as u64);
    let mut b = composite.builder();
    // Each object: half to host memory (the panicking engine), half to the device.
    for o in 0..4u32 {
        let (tag, at) = (Tag::new(o), u64::from(o) * OBJECT);
        b.begin_object(tag).unwrap();
        match b.push(Fragment::new(s, at, d, at, OBJECT / 2, tag)) {
            Ok(()) => {
                b.push(Fragment::new(s, at + OBJECT / 2, dev.id, at, OBJECT / 2, tag)).unwrap();
                b.commit_object().unwrap();
            }
            Err(e) => {
                assert_eq!(o, 2, "only object 2's push panics");
                let panicked = umbp_plan::RejectReason::BuilderPanicked;
                assert!(
                    matches!(e, umbp_plan::Error::Rejected { reason, .. } if reason == panicked)
                );
                b.reject_object(e).unwrap();
            }
        }
    }
    let plans = b.finish().unwrap();
    let mut rejected: Vec<u32> = plans.rejected().iter().map(|(t, _)| t.get()).collect();
    rejected.sort_unstable();
    // Objects 0 and 1 lived in the builder that panicked on object 2: all three are lost.
    assert_eq!(rejected, [0, 1, 2]);
    for part in plans.parts() {
        for plan in part.plans.plans() {
            assert!(
                plan.tags().iter().all(|t| t.get() == 3),
                "engine {} kept a lost object",
                part.engine
            );
        }
    }
    let report = composite.submit(plans).unwrap().wait();
    let states: Vec<ObjectState> = report.objects.iter().map(|o| o.state).collect();
    use ObjectState::{Completed as C, Rejected as R};
    assert_eq!(states, [R, R, R, C]);
    let device = rig.read_device(&dev);
    let half = OBJECT as usize / 2;
    for o in 0..3usize {
        let at = o * OBJECT as usize;
        assert!(out[at..at + half].iter().all(|&x| x == POISON), "object {o} on the host");
        assert!(device[at..at + half].iter().all(|&x| x == POISON), "object {o} on the device");
    }
    let at = 3 * OBJECT as usize;
    assert_eq!(out[at..at + half], src[at..at + half]);
    assert_eq!(device[at..at + half], src[at + half..at + 2 * half]);
}

/// Opens the gate when dropped, so that a failing test does not hold the executor's thread
/// (and the rig's drop) for the gate's whole hold.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[test]
fn cancel_and_a_deadline_settle_a_batch_queued_behind_a_running_job_at_once() {
    // One executor thread, held inside the engine by a job that would run for 15 s.
    let gate = Gate::new();
    let rig = host_rig_with(4, CompositeConfig { workers: 1, ..CompositeConfig::default() }, |w| {
        w.gated(&gate)
    });
    let _open = OpenOnDrop(Arc::clone(&gate));
    let running = rig.composite.submit(rig.plans_of(0..1, None)).unwrap();
    gate.wait_arrivals(1);

    // A batch queued behind it: cancel settles it at once, without the executor's thread.
    let queued = rig.composite.submit(rig.plans_of(1..3, None)).unwrap();
    let t = Instant::now();
    let report = queued.cancel();
    let took = t.elapsed();
    println!("cancel of a batch queued behind a 15 s job returned in {took:?}");
    // The issue asks for under 100 ms (here it takes microseconds: no thread, no engine is
    // waited for). The bound is generous so that a loaded machine cannot fail it; waiting for
    // the running job, as before, takes the gate's 15 s.
    assert!(took < Duration::from_secs(2), "cancel waited for the running job: {took:?}");
    assert_eq!(report.aggregate, BatchState::Failed, "{report:?}");
    for o in &report.objects {
        assert_eq!((o.state, &o.error), (ObjectState::Cancelled, &Some(ObjectError::Cancelled)));
    }

    // A 100 ms deadline behind the same job: the watcher times it out when it passes.
    let start = Instant::now();
    let timed =
        rig.composite.submit(rig.plans_of(3..4, Some(start + Duration::from_millis(100)))).unwrap();
    let settled = loop {
        if timed.state(3) != Some(ObjectState::InFlight) || start.elapsed() > Duration::from_secs(5)
        {
            break start.elapsed();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    println!("a 100 ms deadline behind a 15 s job settled after {settled:?}");
    // The issue asks for 200 ms; polled up to 5 s so that a loaded machine cannot fail it,
    // where before the object stayed in flight for the gate's 15 s.
    let report = timed.wait_timeout(Duration::from_secs(1)).expect("done once its part settled");
    assert!(settled >= Duration::from_millis(100), "settled before its deadline: {settled:?}");
    assert!(settled < Duration::from_secs(5), "the deadline waited for the running job");
    let error = report.objects[0].error.clone();
    assert!(
        matches!(&error, Some(ObjectError::Failed { engine, cause: FailureCause::TimedOut, .. }) if engine == "wrapped"),
        "{report:?}"
    );

    gate.open();
    assert_eq!(running.wait().aggregate, BatchState::Completed);
    drop((running, queued, timed));
    // The job behind them ran once the gate opened; the settled batches never reached it.
    let carried: Vec<Tag> = rig.engine.records().iter().flat_map(|r| r.tags.clone()).collect();
    assert_eq!(carried, [Tag::new(0)]);
    assert!(rig.object_arrived(0));
    for o in 1..4 {
        assert!(rig.object_untouched(o), "object {o} was written");
    }
}

#[test]
fn cancel_of_a_running_part_reaches_its_engine_through_the_token() {
    // The gated engine cancels on the plan set's token, as the SSD engine cancels its I/O.
    let gate = Gate::new();
    let rig = host_rig_with(2, CompositeConfig { workers: 1, ..CompositeConfig::default() }, |w| {
        w.gated(&gate)
    });
    let _open = OpenOnDrop(Arc::clone(&gate));
    let running = rig.composite.submit(rig.plans_of(0..2, None)).unwrap();
    gate.wait_arrivals(1);
    let t = Instant::now();
    let report = running.cancel();
    let took = t.elapsed();
    println!("cancel of a running part whose engine cancels returned in {took:?}");
    // Generous, as above: without the token the engine holds the part for 15 s.
    assert!(took < Duration::from_secs(2), "the engine never heard of the cancel: {took:?}");
    for o in &report.objects {
        assert_eq!((o.state, &o.error), (ObjectState::Cancelled, &Some(ObjectError::Cancelled)));
    }
    assert!(rig.object_untouched(0) && rig.object_untouched(1));
}

#[test]
fn cancel_settles_stages_waiting_for_a_bounce_slot_and_cancels_the_running_hops() {
    // Eight objects from the SSD file to the device through the staged route, one 64 KiB stage
    // each, four bounce slots: four stages hold the slots, held in their first hop by the
    // gated SSD engine; the other four wait for a slot.
    let gate = Gate::new();
    let t = tiered_with(16, true, |i, engine, registry| match i {
        2 => Arc::new(Wrapped::new(engine, registry.clone(), "gated ssd").gated(&gate)),
        _ => engine,
    });
    let _open = OpenOnDrop(Arc::clone(&gate));
    let dev = device(&t.hbm, 32 * PAGE);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..8).map(|o| page_table(o, 4, 16)).collect();
    let size = 4 * PAGE;
    let ranges: Vec<[ObjectRange; 1]> =
        (0..8).map(|o| [ObjectRange::new(0, size, dev.id, o as u64 * size)]).collect();
    let objects: Vec<ObjectTransfer> = (0..8)
        .map(|o| {
            ObjectTransfer::new(
                o as u64,
                PagedObject::new(t.file_id, &tables[o], PAGE, size),
                &ranges[o],
            )
        })
        .collect();
    let mut builder = t.composite.builder();
    let batch = umbp_composite::start_restore(&mut builder, &objects).unwrap();
    gate.wait_arrivals(4);
    let started = Instant::now();
    let report = batch.cancel();
    let took = started.elapsed();
    println!("cancel of a staged restore (4 stages running, 4 waiting for a slot) took {took:?}");
    // Generous, as above: without the token the running hops hold the slots for 15 s.
    assert!(took < Duration::from_secs(2), "cancel waited for the running hops: {took:?}");
    for o in &report.objects {
        assert_eq!((o.state, &o.error), (ObjectState::Cancelled, &Some(ObjectError::Cancelled)));
    }
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    assert!(device.iter().all(|&b| b == POISON), "a cancelled stage wrote the device");
    // The slots came back: the same restore runs once the gate is open.
    gate.open();
    let report = restore(&mut builder, &objects).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
}

/// The host copy engine, except that asking its name panics.
struct Nameless(LocalCopyEngine);

impl TransferEngine for Nameless {
    fn name(&self) -> &str {
        panic!("this engine was told to panic when asked its name")
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.0.can_handle(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> umbp_plan::PlanSet {
        self.0.plan(fragments)
    }

    fn builder(&self) -> Box<dyn umbp_plan::PlanBuilder + Send + '_> {
        self.0.builder()
    }

    fn submit(&self, plans: umbp_plan::PlanSet) -> umbp_plan::TransferHandle {
        self.0.submit(plans)
    }
}

#[test]
fn an_engine_whose_name_panics_rejects_its_objects_and_leaves_the_builder_usable() {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(Nameless(LocalCopyEngine::new(registry.clone())));
    let composite = CompositeEngine::new(registry, vec![engine]);
    let mut src = pattern(2 * OBJECT as usize, 5);
    let mut dst = vec![POISON; 2 * OBJECT as usize];
    // SAFETY: both buffers outlive the composite's batches (each restore waits).
    let (src_id, dst_id) = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, src.len() as u64)),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, dst.len() as u64)),
        )
    };
    let (src_id, dst_id) = (src_id.unwrap(), dst_id.unwrap());
    let pages = [[0], [OBJECT]];
    // Object 2's range passes the end of the destination: the engine's builder rejects it, and
    // the composite, recording the rejection, names the engine.
    let ranges =
        [[ObjectRange::new(0, OBJECT, dst_id, 0)], [ObjectRange::new(0, OBJECT, dst_id, 6000)]];
    let objects: Vec<ObjectTransfer> = (0..2)
        .map(|o| {
            ObjectTransfer::new(
                1 + o as u64,
                PagedObject::new(src_id, &pages[o], OBJECT, OBJECT),
                &ranges[o],
            )
        })
        .collect();
    let mut builder = composite.builder();
    let restored =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| restore(&mut builder, &objects)));
    let report = restored.expect("no panic leaves restore").unwrap();
    assert_eq!(report.object(1).unwrap().state, ObjectState::Completed, "{report:?}");
    let rejected = report.object(2).unwrap();
    assert!(
        matches!(
            &rejected.error,
            Some(ObjectError::Rejected(
                umbp_plan::Error::Rejected {
                    reason: umbp_plan::RejectReason::OutOfBounds { .. },
                    ..
                },
                _
            ))
        ),
        "{rejected:?}"
    );
    assert_eq!(dst[..OBJECT as usize], src[..OBJECT as usize]);
    assert!(dst[OBJECT as usize..].iter().all(|&b| b == POISON), "nothing of object 2");
    // The builder is idle and plans the next batch.
    assert!(builder.is_idle());
    let report = restore(&mut builder, &objects[..1]).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
}
