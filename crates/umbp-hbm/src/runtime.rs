//! The device runtime trait: what the engine needs from a GPU runtime.
//!
//! Two backends implement it: [`SimDevice`](crate::SimDevice), always built, which keeps device
//! memory in host memory and runs the gather kernel on the CPU; and `HipRuntime` (feature
//! `hip`), which drives AMD GPUs. Addresses are plain `u64`s in the process's unified address
//! space: device pointers for device memory, and for pinned host memory the device-visible
//! alias the runtime returned at registration.

use umbp_plan::DeviceOrdinal;

use crate::{DeviceError, LaunchTable};

/// A GPU runtime, as the device engine uses it. Every operation names its device; the runtime
/// switches to it as needed, and the engine restores the caller's current device afterwards.
///
/// Work is queued on one stream per device and is complete once
/// [`synchronize`](Self::synchronize) for that device returned `Ok`.
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

    /// Queues a copy of `len` bytes from `src` to `dst` on `device`'s stream. Either side may
    /// be host memory (pinned or not) or device memory.
    ///
    /// # Safety
    ///
    /// - `src .. + len` is readable and `dst .. + len` writable memory of the kinds named, and
    ///   both stay valid until `device` is synchronized;
    /// - nothing else accesses `dst .. + len` until then.
    unsafe fn copy(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<(), DeviceError>;

    /// Queues one gather-kernel launch over `table` on `device`'s stream. The runtime uploads
    /// the table into buffers it reuses (growing them only when too small).
    ///
    /// # Safety
    ///
    /// Every descriptor's source and destination are device-visible on `device` (device memory
    /// of `device`, or host memory registered with it, through its alias) and stay valid until
    /// `device` is synchronized; destinations do not overlap sources or each other.
    unsafe fn gather(&self, device: DeviceOrdinal, table: &LaunchTable) -> Result<(), DeviceError>;

    /// Blocks until everything queued on `device` has finished.
    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError>;
}
