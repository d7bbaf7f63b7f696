//! Device events: a point on a stream that other streams wait for on the device, and the
//! per-layer-group events a restore on a caller's stream records.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use umbp_plan::{DeviceOrdinal, DeviceStream, GroupListener};

use crate::{DeviceError, DeviceRuntime, Queue};

/// An event recorded on a stream: complete once the stream has run everything queued on it
/// before the event. Destroyed when dropped (a stream already waiting on it still sees it
/// complete).
pub struct DeviceEvent<D: DeviceRuntime> {
    runtime: Arc<D>,
    device: DeviceOrdinal,
    raw: u64,
}

impl<D: DeviceRuntime> DeviceEvent<D> {
    /// Records an event on `stream`, after everything queued on it so far.
    pub fn record(runtime: Arc<D>, stream: DeviceStream) -> Result<Self, DeviceError> {
        let device = stream.device();
        // SAFETY: `DeviceStream::new`'s contract: a live stream of `device`.
        let raw = unsafe { runtime.record_event(device, Queue::Stream(stream.raw()))? };
        Ok(Self { runtime, device, raw })
    }

    /// The raw handle (a `CUevent` or `hipEvent_t`), for `cudaStreamWaitEvent` on another
    /// stream, or `torch.cuda.Event`'s equivalent. Valid while `self` lives.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// The device.
    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    /// Whether the stream reached the event, without blocking; a failure of the work before
    /// it is the error.
    pub fn is_done(&self) -> Result<bool, DeviceError> {
        // SAFETY: recorded on `device` by `record` and destroyed only by `drop`.
        unsafe { self.runtime.event_done(self.device, self.raw) }
    }

    /// Blocks the calling thread until the stream reached the event.
    pub fn wait(&self) -> Result<(), DeviceError> {
        // SAFETY: as in `is_done`.
        unsafe { self.runtime.event_wait(self.device, self.raw) }
    }
}

impl<D: DeviceRuntime> Drop for DeviceEvent<D> {
    fn drop(&mut self) {
        // SAFETY: recorded by `record`, destroyed once, here.
        unsafe { self.runtime.destroy_event(self.device, self.raw) };
    }
}

impl<D: DeviceRuntime> std::fmt::Debug for DeviceEvent<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceEvent")
            .field("device", &self.device.get())
            .field("raw", &format_args!("{:#x}", self.raw))
            .finish()
    }
}

/// One event per layer group of a batch, recorded on the caller's stream as each group is
/// queued ([`GroupListener::group_enqueued`]): the signal a compute stream waits for before
/// layer `k`'s kernels, on the device, with no host thread in between.
///
/// Give it to the composite builder as the batch's group listener together with the same
/// stream (`CompositeBuilder::set_stream`), start the restore, then for each layer take
/// [`event`](Self::event) (the raw handle, for the compute stream to wait on) or block the
/// host with [`synchronize`](Self::synchronize). An event that could not be recorded is
/// reported as the error of both; the batch's report says what happened to the objects.
pub struct LayerEvents<D: DeviceRuntime> {
    runtime: Arc<D>,
    stream: DeviceStream,
    recorded: Mutex<Recorded<D>>,
    changed: Condvar,
}

/// Each group's event, or why it could not be recorded. Events are shared, so a host wait
/// holds its event without holding the map's lock.
type Recorded<D> = BTreeMap<u32, Result<Arc<DeviceEvent<D>>, DeviceError>>;

impl<D: DeviceRuntime> LayerEvents<D> {
    /// Layer events on `stream`, recorded through `runtime` (the device engine's runtime).
    pub fn new(runtime: Arc<D>, stream: DeviceStream) -> Arc<Self> {
        Arc::new(Self {
            runtime,
            stream,
            recorded: Mutex::new(BTreeMap::new()),
            changed: Condvar::new(),
        })
    }

    /// The stream the events are recorded on.
    pub fn stream(&self) -> DeviceStream {
        self.stream
    }

    fn lock(&self) -> MutexGuard<'_, Recorded<D>> {
        // Single inserts under the lock: a panic cannot leave the map torn.
        self.recorded.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until group `group`'s event is recorded (or `timeout` passes: `Ok(None)`), then
    /// returns its raw handle. The handle stays valid while `self` lives.
    pub fn event(&self, group: u32, timeout: Option<Duration>) -> Result<Option<u64>, DeviceError> {
        // A timeout past what the clock can add waits as long as none.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut recorded = self.lock();
        loop {
            if let Some(event) = recorded.get(&group) {
                return event.as_ref().map(|e| Some(e.raw())).map_err(Clone::clone);
            }
            recorded = match deadline {
                None => self.changed.wait(recorded).unwrap_or_else(PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    self.changed
                        .wait_timeout(recorded, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
            };
        }
    }

    /// Whether group `group`'s event is recorded and the stream has reached it.
    pub fn is_done(&self, group: u32) -> Result<bool, DeviceError> {
        match self.lock().get(&group) {
            None => Ok(false),
            Some(Ok(event)) => event.is_done(),
            Some(Err(e)) => Err(e.clone()),
        }
    }

    /// Blocks the host until group `group`'s event is recorded and the stream has reached it.
    /// The wait holds no lock: later groups' events are recorded (and other threads served)
    /// meanwhile.
    pub fn synchronize(&self, group: u32) -> Result<(), DeviceError> {
        self.event(group, None)?;
        let event = match self.lock().get(&group) {
            Some(Ok(event)) => Arc::clone(event),
            Some(Err(e)) => return Err(e.clone()),
            None => unreachable!("recorded events are never removed"),
        };
        event.wait()
    }
}

impl<D: DeviceRuntime> GroupListener for LayerEvents<D> {
    fn group_enqueued(&self, group: u32) {
        let event = DeviceEvent::record(Arc::clone(&self.runtime), self.stream).map(Arc::new);
        if let Err(error) = &event {
            tracing::warn!(group, %error, "could not record a layer group's event");
        }
        self.lock().insert(group, event);
        self.changed.notify_all();
    }

    fn group_settled(&self, _group: u32) {}
}
