//! Batches on a caller's stream: a part an engine queued on the stream is *enqueued* at once
//! and the lane goes on to the next group; groups are told enqueued in order, never after they
//! settled; bytes and failures still arrive through the report; parts of engines that finish
//! on the host are enqueued only when settled. Then the device engine's real stream path on
//! the simulated device, with one event per layer group.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use support::*;
use umbp_composite::{start_restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    BatchState, Completion, DeviceStream, Endpoint, EndpointId, EndpointRegistry, EngineError,
    FailureCause, Fragment, GroupListener, ObjectState, PlanBuilder, PlanSet, Settled, Tag,
    TransferEngine, TransferHandle,
};

/// A gate tests open to let queued work "reach the end of the stream".
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn is_open(&self) -> bool {
        *self.open.lock().unwrap()
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
    }
}

/// The host copy engine, behaving like a device engine with a stream: with a stream on the
/// plan set, it moves the bytes at submit but its handle stays pending, queued on the stream,
/// until the gate opens (or panics while waited for, or when asked whether it is done, when
/// told to). Without a stream it is the host copy engine.
struct StreamLike {
    inner: Arc<LocalCopyEngine>,
    gate: Arc<Gate>,
    panic_in_wait: AtomicBool,
    panic_in_is_done: AtomicBool,
    streams_seen: Mutex<Vec<Option<DeviceStream>>>,
}

struct Gated {
    gate: Arc<Gate>,
    settled: Option<Settled>,
    panic: bool,
    panic_in_is_done: bool,
}

impl Completion for Gated {
    fn is_done(&self) -> bool {
        assert!(!self.panic_in_is_done, "the stream-like engine was told to panic when asked");
        self.gate.is_open()
    }

    fn wait(&mut self) -> Settled {
        self.gate.wait();
        assert!(!self.panic, "the stream-like engine was told to panic while waited for");
        self.settled.take().expect("waited once")
    }
}

impl TransferEngine for StreamLike {
    fn name(&self) -> &str {
        "stream-like"
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

    fn submit(&self, plans: PlanSet) -> TransferHandle {
        let stream = plans.stream();
        self.streams_seen.lock().unwrap().push(stream);
        let settled = self.inner.submit(plans).into_settled();
        match stream {
            None => TransferHandle::settled(settled.failures, settled.plans),
            Some(_) => TransferHandle::queued_on_stream(Box::new(Gated {
                gate: Arc::clone(&self.gate),
                settled: Some(settled),
                panic: self.panic_in_wait.load(Ordering::Relaxed),
                panic_in_is_done: self.panic_in_is_done.load(Ordering::Relaxed),
            })),
        }
    }
}

/// What the listener heard, in order: `(true, k)` for "group k enqueued", `(false, k)` for
/// "settled".
#[derive(Default)]
struct Heard(Mutex<Vec<(bool, u32)>>);

impl GroupListener for Heard {
    fn group_enqueued(&self, group: u32) {
        self.0.lock().unwrap().push((true, group));
    }

    fn group_settled(&self, group: u32) {
        self.0.lock().unwrap().push((false, group));
    }
}

impl Heard {
    fn events(&self) -> Vec<(bool, u32)> {
        self.0.lock().unwrap().clone()
    }
}

const OBJECT: u64 = 4096;

/// Waits up to ten seconds for groups through `group` to be enqueued; fails the test instead
/// of hanging when they never are.
fn enqueued_soon(batch: &umbp_composite::Batch, group: u32) {
    let enqueued = batch.wait_group_enqueued_timeout(group, Duration::from_secs(10));
    assert!(enqueued && batch.is_group_enqueued(group), "group {group} never enqueued");
}

struct StreamRig {
    composite: CompositeEngine,
    engine: Arc<StreamLike>,
    src: Vec<u8>,
    dst: Vec<u8>,
    ids: (EndpointId, EndpointId),
}

fn stream_rig(objects: usize) -> StreamRig {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(StreamLike {
        inner: Arc::new(LocalCopyEngine::new(registry.clone())),
        gate: Arc::default(),
        panic_in_wait: AtomicBool::new(false),
        panic_in_is_done: AtomicBool::new(false),
        streams_seen: Mutex::new(Vec::new()),
    });
    let composite = CompositeEngine::new(registry, vec![engine.clone()]);
    let len = objects * OBJECT as usize;
    let mut src = pattern(len, 9);
    let mut dst = vec![POISON; len];
    // SAFETY: both buffers live in the rig, which outlives every batch of each test.
    let ids = unsafe {
        (
            register(&composite, Endpoint::host(src.as_mut_ptr() as u64, len as u64)).unwrap(),
            register(&composite, Endpoint::host(dst.as_mut_ptr() as u64, len as u64)).unwrap(),
        )
    };
    StreamRig { composite, engine, src, dst, ids }
}

fn stream() -> DeviceStream {
    // SAFETY: no device engine runs here; the stream-like engine only looks at it.
    unsafe { DeviceStream::new(GPU, 0x5eed) }
}

impl StreamRig {
    /// Object `o` copies its 4 KiB in group `o`; the batch is on `stream` if given.
    fn submit(
        &self,
        objects: usize,
        stream: Option<DeviceStream>,
        listener: Arc<Heard>,
    ) -> umbp_composite::Batch {
        let mut b = self.composite.builder();
        b.set_stream(stream);
        b.set_group_listener(listener);
        for o in 0..objects {
            let tag = Tag::new(o as u32);
            let at = o as u64 * OBJECT;
            b.set_group(o as u32);
            b.begin_object(tag).unwrap();
            b.push(Fragment::new(self.ids.0, at, self.ids.1, at, OBJECT, tag)).unwrap();
            b.commit_object().unwrap();
        }
        self.composite.submit(b.finish().unwrap()).unwrap()
    }
}

#[test]
fn parts_queued_on_the_stream_enqueue_every_group_before_any_settles() {
    let rig = stream_rig(3);
    let heard = Arc::new(Heard::default());
    let batch = rig.submit(3, Some(stream()), heard.clone());

    // All three groups went onto the stream while the first has not reached its end: the lane
    // did not wait between groups.
    enqueued_soon(&batch, 2);
    assert!(!batch.is_group_done(0), "nothing settles before the stream reaches it");
    assert_eq!(batch.state(0), Some(ObjectState::InFlight));
    assert_eq!(heard.events(), vec![(true, 0), (true, 1), (true, 2)]);
    assert!(rig.engine.streams_seen.lock().unwrap().iter().all(|s| *s == Some(stream())));

    rig.engine.gate.open();
    let report = batch.wait();
    assert_eq!(report.aggregate, BatchState::Completed);
    assert_eq!(rig.dst, rig.src);
    let events = heard.events();
    assert_eq!(events[3..], [(false, 0), (false, 1), (false, 2)]);
}

#[test]
fn without_a_stream_a_group_is_enqueued_only_as_it_settles() {
    let rig = stream_rig(2);
    let heard = Arc::new(Heard::default());
    let batch = rig.submit(2, None, heard.clone());
    batch.wait_group_enqueued(1);
    // Enqueued means settled here: the engine finished on the host.
    assert!(batch.is_group_done(1));
    assert_eq!(batch.wait().aggregate, BatchState::Completed);
    assert_eq!(heard.events(), vec![(true, 0), (false, 0), (true, 1), (false, 1)]);
    assert!(rig.engine.streams_seen.lock().unwrap().iter().all(Option::is_none));
}

#[test]
fn a_panic_while_waiting_for_the_stream_fails_exactly_those_objects() {
    let rig = stream_rig(2);
    rig.engine.panic_in_wait.store(true, Ordering::Relaxed);
    let heard = Arc::new(Heard::default());
    let batch = rig.submit(2, Some(stream()), heard.clone());
    enqueued_soon(&batch, 1);
    rig.engine.gate.open();
    let report = batch.wait();
    for object in &report.objects {
        assert_eq!(object.state, ObjectState::Failed);
        let Some(umbp_composite::ObjectError::Failed { cause, engine, .. }) = &object.error else {
            panic!("{object:?}")
        };
        assert!(matches!(cause, FailureCause::Panicked { .. }), "{cause:?}");
        assert_eq!(engine, "stream-like");
    }
    // Every group was still told, in order, each enqueued before it settled.
    assert_eq!(heard.events(), vec![(true, 0), (true, 1), (false, 0), (false, 1)]);
}

/// The executor asks a handle whether it is done; an engine that panics there fails the
/// objects of that part (even though its wait then reports success: an engine that panicked
/// is not trusted with one), and the batch still ends, every group told.
#[test]
fn a_panic_when_asked_whether_done_fails_exactly_those_objects_and_the_batch_ends() {
    let rig = stream_rig(2);
    rig.engine.panic_in_is_done.store(true, Ordering::Relaxed);
    rig.engine.gate.open();
    let heard = Arc::new(Heard::default());
    let batch = rig.submit(2, Some(stream()), heard.clone());
    let Some(report) = batch.wait_timeout(Duration::from_secs(10)) else {
        // Dropping the batch or the composite would wait for ever.
        std::mem::forget((batch, rig));
        panic!("the batch never ended");
    };
    for object in &report.objects {
        let Some(umbp_composite::ObjectError::Failed { cause, .. }) = &object.error else {
            panic!("{object:?}")
        };
        assert!(matches!(cause, FailureCause::Panicked { .. }), "{cause:?}");
    }
    assert_eq!(heard.events(), vec![(true, 0), (false, 0), (true, 1), (false, 1)]);
    // The engine had moved the bytes: failing them was the executor's choice, not a loss.
    assert_eq!(rig.dst, rig.src);
}

#[test]
fn cancel_waits_for_work_already_on_the_stream() {
    let rig = stream_rig(4);
    let heard = Arc::new(Heard::default());
    let batch = rig.submit(4, Some(stream()), heard.clone());
    enqueued_soon(&batch, 3);
    let gate = Arc::clone(&rig.engine.gate);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        gate.open();
    });
    // Everything was queued already: cancelling skips nothing and returns only once the
    // stream reached the end of it.
    let report = batch.cancel();
    opener.join().unwrap();
    assert!(rig.engine.gate.is_open());
    assert_eq!(report.aggregate, BatchState::Completed);
    assert_eq!(rig.dst, rig.src);
}

/// The device engine's own stream path, on the simulated device, through a layer-wise restore
/// of 4 objects in 4 groups from a DRAM arena: every group's event is recorded, and the bytes
/// match.
#[test]
fn a_layer_wise_restore_on_a_stream_records_one_event_per_group() {
    let rig = Rig::new();
    let pages = 16usize;
    let mut arena = pattern(pages * 4096, 5);
    let tier = rig.host(&mut arena);
    let out = rig.device(4 * 8192);
    // SAFETY: the simulated device takes any handle as a stream.
    let stream = unsafe { DeviceStream::new(GPU, 7) };
    let events = rig.hbm.layer_events(stream);
    let tables: Vec<[u64; 2]> = (0..4u64).map(|o| [(15 - 2 * o) * 4096, (2 * o) * 4096]).collect();
    let ranges: Vec<[ObjectRange; 1]> = (0..4u64)
        .map(|o| [ObjectRange::new(0, 8192, out.id, o * 8192).in_group(o as u32)])
        .collect();
    let objects: Vec<ObjectTransfer<'_>> = (0..4)
        .map(|o| {
            ObjectTransfer::new(
                100 + o as u64,
                PagedObject::new(tier, &tables[o], 4096, 8192),
                &ranges[o],
            )
        })
        .collect();
    let mut builder = rig.composite.builder();
    builder.set_stream(Some(stream));
    builder.set_group_listener(events.clone());
    let batch = start_restore(&mut builder, &objects).unwrap();
    for group in 0..4 {
        batch.wait_group_enqueued(group);
        let raw = events.event(group, None).unwrap().expect("recorded once enqueued");
        assert_ne!(raw, 0);
        events.synchronize(group).unwrap();
    }
    let report = batch.wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    let bytes = rig.read_device(&out);
    for (o, table) in tables.iter().enumerate() {
        for (k, &page) in table.iter().enumerate() {
            let at = o * 8192 + k * 4096;
            assert_eq!(bytes[at..at + 4096], arena[page as usize..page as usize + 4096], "{o}/{k}");
        }
    }
    assert_eq!(events.event(9, Some(Duration::ZERO)).unwrap(), None, "no such group");
}
