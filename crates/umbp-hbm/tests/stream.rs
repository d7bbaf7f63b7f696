//! The device engine on a caller's stream (simulated device): the handle is queued on the
//! stream and holds the memory until the event after the work completes; a fault reported at
//! that event fails exactly the objects that went to the stream; other devices' work still
//! runs on the engine's own queues; events are real handles, destroyed when dropped; and many
//! threads share one engine, each on its own stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use umbp_hbm::{DeviceEvent, DeviceFault, DeviceRuntime, HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    DeviceOrdinal, DeviceStream, EndpointRegistry, FailureCause, Fragment, PlanSet, Register,
    Registration, Tag, TransferEngine, TransferHandle,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);
const OTHER_GPU: DeviceOrdinal = DeviceOrdinal::new(1);

fn engine() -> HbmEngine<SimDevice> {
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    HbmEngine::new(Arc::new(SimDevice::new(2)), EndpointRegistry::new(), config)
}

fn stream(device: DeviceOrdinal, raw: u64) -> DeviceStream {
    // SAFETY: the simulated device takes any handle as a stream.
    unsafe { DeviceStream::new(device, raw) }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Object `k` moves 4 KiB page `pages - 1 - k` of `src` to offset `k * 4096` of `dst`: many
/// small fragments, so the bucket goes through one gather launch.
fn scattered<K>(
    e: &HbmEngine<SimDevice>,
    src: &Registration<K>,
    dst: &Registration,
    n: u64,
) -> PlanSet {
    let mut b = e.builder();
    for k in 0..n {
        let tag = Tag::new(k as u32);
        b.begin_object(tag).unwrap();
        b.push(Fragment::new(src.id(), (n - 1 - k) * 4096, dst.id(), k * 4096, 4096, tag)).unwrap();
        b.commit_object().unwrap();
    }
    b.finish().unwrap()
}

fn expected(src: &[u8], n: usize) -> Vec<u8> {
    (0..n).flat_map(|k| src[(n - 1 - k) * 4096..(n - k) * 4096].to_vec()).collect()
}

#[test]
fn work_on_a_stream_is_queued_and_lands_before_the_handle_settles() {
    let e = engine();
    let src_bytes = pattern(16 * 4096, 3);
    let src = e.register_memory(src_bytes.clone()).unwrap();
    let dst = e.alloc_device(GPU, 16 * 4096).unwrap();
    let mut plans = scattered(&e, &src, &dst, 16);
    plans.set_stream(Some(stream(GPU, 11)));
    let mut handle = e.submit(plans);
    assert!(handle.is_queued(), "work for the stream's device goes on the stream");
    assert!(handle.wait().is_empty());
    assert_eq!(e.launches(), 1);
    let bytes = e.runtime().read(dst.endpoint().addr(), 16 * 4096).unwrap();
    assert_eq!(bytes, expected(&src_bytes, 16));
}

#[test]
fn without_work_on_the_streams_device_the_handle_settles_at_submit() {
    let e = engine();
    let src = e.register_memory(pattern(4 * 4096, 1)).unwrap();
    let dst = e.alloc_device(OTHER_GPU, 4 * 4096).unwrap();
    let mut plans = scattered(&e, &src, &dst, 4);
    plans.set_stream(Some(stream(GPU, 11)));
    let mut handle = e.submit(plans);
    assert!(handle.is_done(), "device 1's bucket ran on the engine's own queue");
    assert!(handle.wait().is_empty());
    let bytes = e.runtime().read(dst.endpoint().addr(), 4 * 4096).unwrap();
    assert_eq!(bytes, expected(&pattern(4 * 4096, 1), 4));
}

#[test]
fn a_pending_stream_handle_keeps_its_memory_until_it_settles() {
    let e = Arc::new(engine());
    let src = e.register_memory(pattern(8 * 4096, 2)).unwrap();
    let dst = e.alloc_device(GPU, 8 * 4096).unwrap();
    let mut plans = scattered(&e, &src, &dst, 8);
    plans.set_stream(Some(stream(GPU, 3)));
    let handle = e.submit(plans);
    let released = Arc::new(AtomicBool::new(false));
    let dropper = {
        let released = Arc::clone(&released);
        std::thread::spawn(move || {
            // Ends the registration of the device buffer the queued work writes: the device
            // memory must not be freed while the handle is pending.
            drop(dst);
            released.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!released.load(Ordering::SeqCst), "memory released under a pending transfer");
    let settled = handle.into_settled();
    assert!(settled.failures.is_empty());
    dropper.join().unwrap();
    assert!(released.load(Ordering::SeqCst));
}

#[test]
fn unpinning_waits_only_for_the_submits_that_use_the_pinning() {
    let e = Arc::new(engine());
    let used = e.register_memory(pattern(8 * 4096, 6)).unwrap();
    let unrelated = e.register_memory(pattern(4096, 7)).unwrap();
    let dst = e.alloc_device(GPU, 8 * 4096).unwrap();
    let mut plans = scattered(&e, &used, &dst, 8);
    plans.set_stream(Some(stream(GPU, 3)));
    let handle = e.submit(plans);

    // Ending a registration the pending work does not use (its pinning goes too) does not wait
    // for that work: a lane holding queued handles never blocks another request's cleanup.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(unrelated);
        done.send(()).unwrap();
    });
    finished.recv_timeout(Duration::from_secs(10)).expect("an unrelated unpin waited");

    // Unpinning what the pending work reads waits for it.
    let unpinned = Arc::new(AtomicBool::new(false));
    let unpinner = {
        let (e, unpinned, id) = (Arc::clone(&e), Arc::clone(&unpinned), used.id());
        std::thread::spawn(move || {
            e.unpin(id).unwrap();
            unpinned.store(true, Ordering::SeqCst);
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!unpinned.load(Ordering::SeqCst), "unpinned under a pending transfer");
    assert!(handle.into_settled().failures.is_empty());
    unpinner.join().unwrap();
    assert!(unpinned.load(Ordering::SeqCst));
    let bytes = e.runtime().read(dst.endpoint().addr(), 8 * 4096).unwrap();
    assert_eq!(bytes, expected(&pattern(8 * 4096, 6), 8));
}

#[test]
fn a_fault_at_the_streams_event_fails_the_objects_on_the_stream_and_stops_the_kernel() {
    let e = engine();
    let src = e.register_memory(pattern(8 * 4096, 4)).unwrap();
    let on_stream = e.alloc_device(GPU, 8 * 4096).unwrap();
    let elsewhere = e.alloc_device(OTHER_GPU, 4096).unwrap();
    let mut plans = {
        let mut b = e.builder();
        for k in 0..8u64 {
            let tag = Tag::new(k as u32);
            b.begin_object(tag).unwrap();
            let page = 7 - k; // reversed, so the fragments stay apart and go to the kernel
            b.push(Fragment::new(src.id(), page * 4096, on_stream.id(), k * 4096, 4096, tag))
                .unwrap();
            b.commit_object().unwrap();
        }
        let tag = Tag::new(8);
        b.begin_object(tag).unwrap();
        b.push(Fragment::new(src.id(), 0, elsewhere.id(), 0, 4096, tag)).unwrap();
        b.commit_object().unwrap();
        b.finish().unwrap()
    };
    plans.set_stream(Some(stream(GPU, 5)));
    let handle = e.submit(plans);
    // The simulated device reports an injected synchronization fault at the next event wait,
    // as a GPU reports a faulting kernel at the event after it.
    e.runtime().inject(DeviceFault::Synchronize);
    let settled = handle.into_settled();
    let mut failed: Vec<u32> =
        settled.failures.iter().flat_map(|f| f.tags.iter().map(|t| t.get())).collect();
    failed.sort_unstable();
    assert_eq!(failed, (0..8).collect::<Vec<_>>(), "exactly the objects on the stream");
    assert!(settled
        .failures
        .iter()
        .all(|f| matches!(f.cause, FailureCause::Device { device, .. } if device == GPU)));
    assert!(!e.kernel_enabled(), "a gather ran before the fault: its results are not trusted");
}

#[test]
fn events_are_recorded_on_the_stream_and_destroyed_when_dropped() {
    let device = Arc::new(SimDevice::new(1));
    let event = DeviceEvent::record(Arc::clone(&device), stream(GPU, 9)).unwrap();
    assert_eq!(event.is_done(), Ok(true), "the simulator finishes work when queued");
    event.wait().unwrap();
    let raw = event.raw();
    drop(event);
    // SAFETY: the simulator checks handles; a destroyed one is an error, not undefined
    // behaviour (this is what is tested).
    assert!(unsafe { device.event_done(GPU, raw) }.is_err());
}

#[test]
fn sixteen_threads_share_one_engine_each_on_its_own_stream() {
    let e = Arc::new(engine());
    let threads: Vec<_> = (0..16u64)
        .map(|t| {
            let e = Arc::clone(&e);
            std::thread::spawn(move || {
                for round in 0..20u8 {
                    let src_bytes = pattern(8 * 4096, round.wrapping_add(t as u8));
                    let src = e.register_memory(src_bytes.clone()).unwrap();
                    let dst = e.alloc_device(GPU, 8 * 4096).unwrap();
                    let mut plans = scattered(&e, &src, &dst, 8);
                    plans.set_stream(Some(stream(GPU, 100 + t)));
                    let handle: TransferHandle = e.submit(plans);
                    let settled = handle.into_settled();
                    assert!(settled.failures.is_empty(), "{:?}", settled.failures);
                    let bytes = e.runtime().read(dst.endpoint().addr(), 8 * 4096).unwrap();
                    assert_eq!(bytes, expected(&src_bytes, 8), "thread {t} round {round}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
