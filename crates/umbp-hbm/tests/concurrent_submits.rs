//! Submits from different threads never wait for each other's device work: a launch that has
//! not finished holds nothing another submit needs. (A mixed restore's DRAM part and its staged
//! SSD part reach the same device engine from two executor threads at once.) Likewise a host
//! thread waiting for a layer group's event holds nothing the next group's event needs.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umbp_hbm::{
    DeviceError, DeviceRuntime, HbmConfig, HbmEngine, LaunchTable, LayerEvents, Queue, SimDevice,
};
use umbp_plan::{
    DeviceOrdinal, DeviceStream, EndpointRegistry, Fragment, GroupListener, Register, Tag,
    TransferEngine,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

/// The simulator, except that its first call of one kind (`Hold`) waits: it says so on
/// `entered`, then runs only once `release` fires.
struct Held {
    inner: SimDevice,
    hold: Hold,
    gate: Mutex<Option<(Sender<()>, Receiver<()>)>>,
}

#[derive(PartialEq)]
enum Hold {
    Launch,
    EventWait,
}

impl Held {
    fn new(hold: Hold) -> (Arc<Self>, Receiver<()>, Sender<()>) {
        let (entered, entered_rx) = channel();
        let (release, release_rx) = channel();
        let gate = Mutex::new(Some((entered, release_rx)));
        (Arc::new(Self { inner: SimDevice::new(1), hold, gate }), entered_rx, release)
    }

    /// Waits for `release` if this is the first call of the held kind.
    fn maybe_hold(&self, this: Hold) {
        if this != self.hold {
            return;
        }
        let held = self.gate.lock().unwrap().take();
        if let Some((entered, release)) = held {
            entered.send(()).unwrap();
            release.recv().unwrap();
        }
    }
}

impl DeviceRuntime for Held {
    fn name(&self) -> &'static str {
        "held"
    }
    fn device_count(&self) -> Result<u32, DeviceError> {
        self.inner.device_count()
    }
    fn current_device(&self) -> Result<DeviceOrdinal, DeviceError> {
        self.inner.current_device()
    }
    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        self.inner.set_device(device)
    }
    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        self.inner.alloc(device, len)
    }
    unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.free(device, addr) }
    }
    unsafe fn register_host(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.register_host(device, addr, len) }
    }
    unsafe fn unregister_host(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.unregister_host(device, addr) }
    }
    unsafe fn copy(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        queue: Queue,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.copy(device, dst, src, len, queue) }
    }
    unsafe fn gather(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        queue: Queue,
    ) -> Result<(), DeviceError> {
        self.maybe_hold(Hold::Launch);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.gather(device, table, queue) }
    }
    unsafe fn record_event(&self, device: DeviceOrdinal, queue: Queue) -> Result<u64, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.record_event(device, queue) }
    }
    unsafe fn event_done(&self, device: DeviceOrdinal, event: u64) -> Result<bool, DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.event_done(device, event) }
    }
    unsafe fn event_wait(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError> {
        self.maybe_hold(Hold::EventWait);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.event_wait(device, event) }
    }
    unsafe fn destroy_event(&self, device: DeviceOrdinal, event: u64) {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.destroy_event(device, event) }
    }
    unsafe fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.stream_synchronize(device, stream) }
    }
    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        self.inner.synchronize(device)
    }
}

#[test]
fn a_submit_does_not_wait_for_another_submits_launch() {
    let (runtime, entered_rx, release) = Held::new(Hold::Launch);
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let engine = HbmEngine::new(Arc::clone(&runtime), EndpointRegistry::new(), config);
    let len = 256usize << 10;
    let pattern = |seed: usize| (0..len).map(|i| ((i * 7 + seed) % 251) as u8).collect::<Vec<_>>();
    let sources = [pattern(1), pattern(2)];
    let hosts: Vec<_> =
        sources.iter().map(|s| engine.register_memory(s.clone()).unwrap()).collect();
    let devices: Vec<_> = (0..2).map(|_| engine.alloc_device(GPU, len as u64).unwrap()).collect();
    // Sixteen 4 KiB pieces 16 KiB apart: small and many, so the engine launches its gather
    // kernel (not one copy per piece).
    let transfer = |i: usize| {
        let mut b = engine.builder();
        let tag = Tag::new(i as u32);
        b.begin_object(tag).unwrap();
        for k in 0..16u64 {
            let at = k * (16 << 10);
            b.push(Fragment::new(hosts[i].id(), at, devices[i].id(), at, 4 << 10, tag)).unwrap();
        }
        b.commit_object().unwrap();
        engine.submit(b.finish().unwrap()).wait().to_vec()
    };
    std::thread::scope(|scope| {
        let first = scope.spawn(|| transfer(0));
        entered_rx.recv_timeout(Duration::from_secs(30)).expect("the first submit launched");
        // The first submit's launch is held; the second one must finish meanwhile.
        let (done, done_rx) = channel();
        let transfer = &transfer;
        scope.spawn(move || done.send(transfer(1)).unwrap());
        let second = done_rx.recv_timeout(Duration::from_secs(20));
        release.send(()).unwrap();
        let second = second.expect("the second submit waited for the first one's launch");
        assert!(second.is_empty(), "{second:?}");
        let first = first.join().unwrap();
        assert!(first.is_empty(), "{first:?}");
    });
    for i in 0..2 {
        let bytes = runtime.inner.read(devices[i].endpoint().addr(), len as u64).unwrap();
        for k in 0..16usize {
            let at = k * (16 << 10);
            assert_eq!(bytes[at..at + (4 << 10)], sources[i][at..at + (4 << 10)], "{i}, {k}");
        }
    }
}

#[test]
fn a_host_wait_for_a_layer_event_does_not_hold_up_the_next_group_s_event() {
    let (runtime, entered_rx, release) = Held::new(Hold::EventWait);
    // SAFETY: the simulator takes any handle as a stream.
    let stream = unsafe { DeviceStream::new(GPU, 3) };
    let events = LayerEvents::new(Arc::clone(&runtime), stream);
    events.group_enqueued(0);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| events.synchronize(0));
        entered_rx.recv_timeout(Duration::from_secs(30)).expect("the host wait started");
        // Group 0's wait is held on the device; the executor records group 1 meanwhile.
        let (recorded, recorded_rx) = channel();
        let events = &events;
        scope.spawn(move || {
            events.group_enqueued(1);
            recorded.send(()).unwrap();
        });
        let next = recorded_rx.recv_timeout(Duration::from_secs(20));
        release.send(()).unwrap();
        next.expect("recording group 1 waited for the host wait on group 0");
        assert!(events.event(1, Some(Duration::ZERO)).unwrap().is_some());
        waiter.join().unwrap().unwrap();
    });
}
