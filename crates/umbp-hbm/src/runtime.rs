//! The device runtime trait: what the engine needs from a GPU runtime.
//!
//! Two backends implement it: [`SimDevice`](crate::SimDevice), always built, which keeps device
//! memory in host memory and runs the gather kernel on the CPU; and `HipRuntime` (feature
//! `hip`), which drives AMD GPUs. Addresses are plain `u64`s in the process's unified address
//! space: device pointers for device memory, and for pinned host memory the device-visible
//! alias the runtime returned at registration.

use umbp_plan::DeviceOrdinal;

use crate::{DeviceError, LaunchTable};

/// Where a runtime queues work on a device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Queue {
    /// The runtime's own stream for the device, which [`DeviceRuntime::synchronize`] waits for.
    Own,
    /// A caller's stream, by its raw handle ([`umbp_plan::DeviceStream::raw`]).
    Stream(u64),
}

/// A GPU runtime, as the device engine uses it. Every operation names its device; the runtime
/// switches to it as needed, and the engine restores the caller's current device afterwards.
///
/// Work is queued on one stream per device ([`Queue::Own`]) and is complete once
/// [`synchronize`](Self::synchronize) for that device returned `Ok`; or on a caller's stream
/// ([`Queue::Stream`]), where it is complete once an event recorded after it
/// ([`record_event`](Self::record_event)) has completed.
pub trait DeviceRuntime: Send + Sync + 'static {
    /// A short name for logs and reports (`"sim"`, `"hip"`).
    fn name(&self) -> &'static str;

    /// Number of devices.
    fn device_count(&self) -> Result<u32, DeviceError>;

    /// The calling thread's current device.
    fn current_device(&self) -> Result<DeviceOrdinal, DeviceError>;

    /// Makes `device` the calling thread's current device.
    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError>;

    /// Allocates `len` bytes of device memory and returns its address.
    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError>;

    /// Frees memory from [`alloc`](Self::alloc).
    ///
    /// # Safety
    ///
    /// - `addr` came from `alloc` on `device` and was not freed since;
    /// - no queued work still touches it (the device was synchronized after its last use).
    unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError>;

    /// Pins host memory `addr .. + len` and maps it for `device`; returns the address the
    /// device reads and writes it through.
    ///
    /// # Safety
    ///
    /// `addr .. + len` is host memory valid for reads and writes until
    /// [`unregister_host`](Self::unregister_host).
    unsafe fn register_host(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError>;

    /// Undoes [`register_host`](Self::register_host).
    ///
    /// # Safety
    ///
    /// `addr` was registered and no queued work still touches it.
    unsafe fn unregister_host(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError>;

    /// Queues a copy of `len` bytes from `src` to `dst` on `queue` of `device`. Either side
    /// may be host memory (pinned or not) or device memory.
    ///
    /// # Safety
    ///
    /// - `src .. + len` is readable and `dst .. + len` writable memory of the kinds named, and
    ///   both stay valid until the work is complete (see the trait docs);
    /// - nothing else accesses `dst .. + len` until then;
    /// - a [`Queue::Stream`] is a live stream of `device`.
    unsafe fn copy(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        queue: Queue,
    ) -> Result<(), DeviceError>;

    /// Queues one gather-kernel launch over `table` on `queue` of `device`. The runtime
    /// uploads the table into device buffers of its own, which it reuses only once the launch
    /// that read them completed, so launches on any stream never wait for one another.
    ///
    /// # Safety
    ///
    /// - Every descriptor's source and destination are device-visible on `device` (device
    ///   memory of `device`, or host memory registered with it, through its alias) and stay
    ///   valid until the work is complete; destinations do not overlap sources or each other;
    /// - a [`Queue::Stream`] is a live stream of `device`.
    unsafe fn gather(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        queue: Queue,
    ) -> Result<(), DeviceError>;

    /// Whether this runtime's copies and launches run on the host's CPU, synchronously, so that
    /// they can hash what they copy ([`copy_hashed`](Self::copy_hashed),
    /// [`gather_hashed`](Self::gather_hashed)): the simulated device. A GPU's copy engines and
    /// kernels never pass the bytes through the CPU. Default: `false`.
    fn hashes_while_copying(&self) -> bool {
        false
    }

    /// [`copy`](Self::copy), returning the CRC32C of the bytes copied; the copy is complete
    /// when it returns. Only where [`hashes_while_copying`](Self::hashes_while_copying);
    /// others fail every call.
    ///
    /// # Safety
    ///
    /// As [`copy`](Self::copy).
    unsafe fn copy_hashed(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        queue: Queue,
    ) -> Result<u32, DeviceError> {
        let _ = (dst, src, len, queue);
        Err(not_hashing(device))
    }

    /// [`gather`](Self::gather), setting `crcs[i]` to the CRC32C of descriptor `i`'s bytes
    /// (`crcs` holds one per descriptor); the launch is complete when it returns. Only where
    /// [`hashes_while_copying`](Self::hashes_while_copying); others fail every call.
    ///
    /// # Safety
    ///
    /// As [`gather`](Self::gather).
    unsafe fn gather_hashed(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        queue: Queue,
        crcs: &mut [u32],
    ) -> Result<(), DeviceError> {
        let _ = (table, queue, crcs);
        Err(not_hashing(device))
    }

    /// Records an event on `queue` of `device`, after everything queued there so far, and
    /// returns its handle (a `CUevent` or `hipEvent_t`): the event completes when the queue
    /// reaches it. Other streams can wait on it on the device; the host can ask
    /// ([`event_done`](Self::event_done)) or wait ([`event_wait`](Self::event_wait)).
    ///
    /// # Safety
    ///
    /// A [`Queue::Stream`] is a live stream of `device`.
    unsafe fn record_event(&self, device: DeviceOrdinal, queue: Queue) -> Result<u64, DeviceError>;

    /// Whether the event has completed, without blocking. A failure of the work before it
    /// (a faulting kernel) is returned as the error.
    ///
    /// # Safety
    ///
    /// `event` came from [`record_event`](Self::record_event) on `device` and was not destroyed.
    unsafe fn event_done(&self, device: DeviceOrdinal, event: u64) -> Result<bool, DeviceError>;

    /// Blocks until the event has completed; a failure of the work before it is the error.
    ///
    /// # Safety
    ///
    /// As for [`event_done`](Self::event_done).
    unsafe fn event_wait(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError>;

    /// Destroys the event. Streams already waiting on it still see it complete (the runtime
    /// frees it once it has).
    ///
    /// # Safety
    ///
    /// As for [`event_done`](Self::event_done), and the handle is not used again.
    unsafe fn destroy_event(&self, device: DeviceOrdinal, event: u64);

    /// Blocks until everything queued on the caller's stream `stream` of `device` has
    /// finished. The engine uses it only where it could not record an event.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of `device`.
    unsafe fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: u64,
    ) -> Result<(), DeviceError>;

    /// Blocks until everything queued on `device`'s own stream has finished.
    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError>;
}

/// The error of a hashing call to a runtime that does not hash while copying.
fn not_hashing(device: DeviceOrdinal) -> DeviceError {
    DeviceError::Runtime {
        device,
        code: -1,
        message: "this runtime does not hash while copying".into(),
    }
}
