//! The CUDA backend: NVIDIA GPUs through the CUDA driver API (feature `cuda`).
//!
//! # Strategy
//!
//! - Nothing is linked: the driver (`libcuda`) and NVRTC are loaded at run time (see
//!   `ffi.rs`), so the crate builds and its tests run on machines without CUDA, where
//!   [`CudaRuntime::new`] and [`compile_gather_kernel`] return
//!   [`DeviceError::LibraryMissing`] instead.
//! - Each device's *primary* context is used, the one the CUDA runtime (and so PyTorch) uses,
//!   so device pointers from either side are valid here. It is retained at the device's first
//!   use and released when the runtime is dropped.
//! - One non-blocking stream per device, created at its first use; the engine's own copies and
//!   launches go on it ([`Queue::Own`]), and `synchronize` waits for it. Work for a caller's
//!   stream ([`Queue::Stream`], a `CUstream` such as `torch.cuda.Stream.cuda_stream`) goes
//!   there instead, ordered with the caller's own kernels; events (timing off) mark points on
//!   either.
//! - The gather kernel ([`GATHER_KERNEL_SOURCE`], the same source the HIP backend compiles) is
//!   compiled by NVRTC to PTX for the device's own compute capability at the first launch on
//!   that device; the driver JIT-compiles the PTX when loading it, and the module is cached per
//!   device for the runtime's lifetime.
//! - Each launch uploads its descriptors and block table from a pinned staging buffer into one
//!   device buffer, and records an event after the launch. A device keeps a ring of
//!   [`TABLE_BUFFERS`] such buffer pairs: a launch takes the next pair once the launch that
//!   last used it has passed its event, so up to that many launches are in flight on any
//!   streams without the host waiting, and no upload overwrites a table a queued launch still
//!   reads. A pair grows (to the next power of two) only when idle. Only a launch that finds
//!   all of them in flight waits (for the oldest), holding the device's lock meanwhile.
//! - Host memory registered with [`DeviceRuntime::register_host`] is pinned with
//!   `cuMemHostRegister` (portable, device-mapped) and read by the kernel through its device
//!   alias.
//! - Like the HIP backend and unlike the simulated device, nothing here re-checks addresses:
//!   the engine checked every segment against its endpoint.

mod ffi;

use std::ffi::CString;
use std::sync::{Mutex, MutexGuard, PoisonError};

use umbp_plan::DeviceOrdinal;

use crate::{
    DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, Queue, BLOCK_THREADS,
    GATHER_KERNEL_NAME, GATHER_KERNEL_SOURCE,
};

/// Launch tables per device that may be in flight at once (see the module docs).
pub const TABLE_BUFFERS: usize = 4;

use self::ffi::{CuDevice, Driver, Handle};

/// Compiles the gather kernel to PTX for virtual architecture `arch` (for example
/// `compute_90`) with NVRTC and returns the PTX. Needs no GPU and no driver, only NVRTC
/// (`libnvrtc.so.12`, from the CUDA toolkit or the `nvidia-cuda-nvrtc-cu12` wheel).
pub fn compile_gather_kernel(arch: &str) -> Result<String, DeviceError> {
    let ptx = ffi::nvrtc()?.compile_ptx(GATHER_KERNEL_SOURCE, "gather.cu", arch)?;
    Ok(ptx.to_string_lossy().into_owned())
}

/// NVRTC's version, `(major, minor)`, or why it cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32), DeviceError> {
    Ok(ffi::nvrtc()?.version())
}

/// The CUDA device runtime; see the [module docs](self).
pub struct CudaRuntime {
    driver: &'static Driver,
    devices: Vec<Mutex<Slot>>,
}

/// Per-device state; the context, stream and kernel are created lazily.
struct Slot {
    handle: CuDevice,
    /// Compute capability, `(major, minor)`.
    capability: (i32, i32),
    context: Option<Handle>,
    stream: Option<Handle>,
    kernel: Option<(Handle, Handle)>,
    /// The ring of launch-table buffers, and the one the next launch takes.
    tables: Vec<TableBuffer>,
    next_table: usize,
}

/// One launch table's home: pinned staging memory, the device buffer the kernel reads, their
/// capacity, and the event recorded after the last launch that used them.
struct TableBuffer {
    host: u64,
    device: u64,
    capacity: u64,
    used: Handle,
}

// SAFETY: the raw handles are driver objects usable from any thread (with their context
// current, which every use makes so); each slot is only touched under its mutex.
unsafe impl Send for Slot {}

impl CudaRuntime {
    /// The runtime over every device the driver sees. Fails with
    /// [`DeviceError::LibraryMissing`] where there is no CUDA driver, and with
    /// [`DeviceError::NoDevice`] where it sees no GPU: callers use the simulated device then.
    pub fn new() -> Result<Self, DeviceError> {
        let driver = ffi::driver()?;
        let count = driver.device_count()?;
        if count == 0 {
            return Err(DeviceError::NoDevice(DeviceOrdinal::new(0)));
        }
        let devices = (0..count)
            .map(|i| {
                let (handle, capability) = driver.device(DeviceOrdinal::new(i))?;
                Ok(Mutex::new(Slot {
                    handle,
                    capability,
                    context: None,
                    stream: None,
                    kernel: None,
                    tables: Vec::new(),
                    next_table: 0,
                }))
            })
            .collect::<Result<Vec<_>, DeviceError>>()?;
        Ok(Self { driver, devices })
    }

    /// The device's compute capability, `(major, minor)` (`(9, 0)` on an H100 or H200).
    pub fn compute_capability(&self, device: DeviceOrdinal) -> Result<(i32, i32), DeviceError> {
        Ok(self.slot(device)?.capability)
    }

    fn slot(&self, device: DeviceOrdinal) -> Result<MutexGuard<'_, Slot>, DeviceError> {
        let slot = self.devices.get(device.get() as usize).ok_or(DeviceError::NoDevice(device))?;
        Ok(slot.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Makes the device's primary context current (retaining it on first use).
    fn enter(&self, device: DeviceOrdinal, slot: &mut Slot) -> Result<(), DeviceError> {
        let context = match slot.context {
            Some(c) => c,
            None => {
                let c = self.driver.retain_primary(device, slot.handle)?;
                slot.context = Some(c);
                c
            }
        };
        // SAFETY: a retained primary context, released only when the runtime is dropped.
        unsafe { self.driver.set_current(device, context) }
    }

    /// The device's stream, with its context current; created on first use.
    fn stream(&self, device: DeviceOrdinal, slot: &mut Slot) -> Result<Handle, DeviceError> {
        self.enter(device, slot)?;
        match slot.stream {
            Some(s) => Ok(s),
            None => {
                let s = self.driver.stream_create(device)?;
                slot.stream = Some(s);
                Ok(s)
            }
        }
    }

    /// Makes the device's context current on this thread, without keeping its lock (for calls
    /// that block, which must not stop other threads from queueing work).
    fn make_current(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)
    }

    /// The stream work for `queue` goes on, with the device's context current.
    fn queue(
        &self,
        device: DeviceOrdinal,
        slot: &mut Slot,
        queue: Queue,
    ) -> Result<Handle, DeviceError> {
        match queue {
            Queue::Own => self.stream(device, slot),
            Queue::Stream(raw) => {
                self.enter(device, slot)?;
                Ok(raw as Handle)
            }
        }
    }

    /// The next table buffer of the ring, idle (the launch that last used it has run) and of
    /// at least `len` bytes; returns its index.
    fn take_table(
        &self,
        device: DeviceOrdinal,
        slot: &mut Slot,
        len: u64,
    ) -> Result<usize, DeviceError> {
        let index = slot.next_table;
        if index == slot.tables.len() {
            let used = self.driver.event_create(device)?;
            slot.tables.push(TableBuffer { host: 0, device: 0, capacity: 0, used });
        }
        let table = &mut slot.tables[index];
        // SAFETY: `used` is live (created above or earlier, destroyed only on drop); waiting
        // for it makes the buffers idle. Never recorded counts as reached.
        unsafe { self.driver.event_synchronize(device, table.used)? };
        if table.capacity < len {
            // SAFETY: the buffers came from these allocators and are idle (waited above).
            unsafe {
                if table.capacity > 0 {
                    self.driver.host_free(device, table.host)?;
                    self.driver.free(device, table.device)?;
                }
            }
            table.capacity = 0;
            let capacity = len.next_power_of_two().max(4096);
            table.host = self.driver.host_malloc(device, capacity)?;
            table.device = match self.driver.malloc(device, capacity) {
                Ok(d) => d,
                Err(e) => {
                    // SAFETY: allocated just above, never used.
                    let _ = unsafe { self.driver.host_free(device, table.host) };
                    return Err(e);
                }
            };
            table.capacity = capacity;
        }
        slot.next_table = (index + 1) % TABLE_BUFFERS;
        Ok(index)
    }
}

impl DeviceRuntime for CudaRuntime {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<u32, DeviceError> {
        Ok(self.devices.len() as u32)
    }

    /// The device of the calling thread's current context; device 0 when none is current.
    fn current_device(&self) -> Result<DeviceOrdinal, DeviceError> {
        let Some(handle) = self.driver.current_device()? else {
            return Ok(DeviceOrdinal::new(0));
        };
        let position = self
            .devices
            .iter()
            .position(|slot| slot.lock().unwrap_or_else(PoisonError::into_inner).handle == handle);
        Ok(DeviceOrdinal::new(position.unwrap_or(0) as u32))
    }

    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)
    }

    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)?;
        self.driver.malloc(device, len)
    }

    unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)?;
        // SAFETY: the caller's contract is `Driver::free`'s.
        unsafe { self.driver.free(device, addr) }
    }

    unsafe fn register_host(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)?;
        // SAFETY: the caller's contract is `Driver::host_register`'s.
        unsafe { self.driver.host_register(device, addr, len) }
    }

    unsafe fn unregister_host(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        self.enter(device, &mut slot)?;
        // SAFETY: the caller's contract is `Driver::host_unregister`'s.
        unsafe { self.driver.host_unregister(device, addr) }
    }

    unsafe fn copy(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        queue: Queue,
    ) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.queue(device, &mut slot, queue)?;
        // SAFETY: the caller's contract is `Driver::memcpy_async`'s; the stream is live (ours,
        // or the caller's by this function's contract).
        unsafe { self.driver.memcpy_async(device, dst, src, len, stream) }
    }

    unsafe fn gather(
        &self,
        device: DeviceOrdinal,
        table: &LaunchTable,
        queue: Queue,
    ) -> Result<(), DeviceError> {
        if table.descriptors.is_empty() {
            return Ok(());
        }
        let mut slot = self.slot(device)?;
        let stream = self.queue(device, &mut slot, queue)?;
        if slot.kernel.is_none() {
            let (major, minor) = slot.capability;
            let arch = format!("compute_{major}{minor}");
            let ptx = CString::new(compile_gather_kernel(&arch)?).map_err(|_| {
                DeviceError::KernelCompile { arch: arch.clone(), log: "NUL in PTX".into() }
            })?;
            slot.kernel = Some(self.driver.load_kernel(device, &ptx, GATHER_KERNEL_NAME)?);
            tracing::info!(device = device.get(), %arch, "gather kernel compiled and loaded");
        }
        let (_, function) = slot.kernel.expect("loaded above");
        // Descriptors are 24 bytes each, so the block starts that follow them stay 8-aligned.
        let desc_bytes = size_of_val(table.descriptors.as_slice()) as u64;
        let start_bytes = size_of_val(table.block_starts.as_slice()) as u64;
        let index = self.take_table(device, &mut slot, desc_bytes + start_bytes)?;
        let buffer = &slot.tables[index];
        // SAFETY: 1. `buffer.host` is pinned host memory of at least `desc_bytes +
        // start_bytes` bytes that nothing reads (`take_table` waited for its last launch);
        // 2. the source slices are live; 3. `GatherDescriptor` is `repr(C)` plain data, `u32`
        // likewise.
        unsafe {
            std::ptr::copy_nonoverlapping(
                table.descriptors.as_ptr().cast::<u8>(),
                buffer.host as *mut u8,
                desc_bytes as usize,
            );
            std::ptr::copy_nonoverlapping(
                table.block_starts.as_ptr().cast::<u8>(),
                (buffer.host + desc_bytes) as *mut u8,
                start_bytes as usize,
            );
        }
        let (descs, starts) = (buffer.device, buffer.device + desc_bytes);
        debug_assert_eq!(size_of::<GatherDescriptor>(), 24);
        let count = table.descriptors.len() as u32;
        // SAFETY: the buffers are live, large enough and idle (`take_table`), and stay so until
        // the event recorded below is reached, which the next use of this buffer waits for;
        // the kernel was loaded in this device's context, current now; the upload precedes
        // the launch on the same live stream; descriptor validity is the caller's contract.
        unsafe {
            self.driver.memcpy_async(
                device,
                descs,
                buffer.host,
                desc_bytes + start_bytes,
                stream,
            )?;
            let args = ffi::GatherArgs { descs, starts, count, blocks: table.blocks() };
            let launched = self.driver.launch_gather(device, function, stream, BLOCK_THREADS, args);
            // Recorded even if the launch failed: the upload is queued either way. Without the
            // event the buffer's next use could overwrite a table still being read: wait for
            // the stream instead.
            if let Err(e) = self.driver.event_record(device, buffer.used, stream) {
                let _ = self.driver.stream_synchronize(device, stream);
                return Err(e);
            }
            launched
        }
    }

    unsafe fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: u64,
    ) -> Result<(), DeviceError> {
        self.make_current(device)?;
        // SAFETY: the caller's contract: a live stream of `device`.
        unsafe { self.driver.stream_synchronize(device, stream as Handle) }
    }

    unsafe fn record_event(&self, device: DeviceOrdinal, queue: Queue) -> Result<u64, DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.queue(device, &mut slot, queue)?;
        let event = self.driver.event_create(device)?;
        // SAFETY: created above in the current context; the stream is live (ours, or the
        // caller's by this function's contract).
        if let Err(e) = unsafe { self.driver.event_record(device, event, stream) } {
            // SAFETY: created above, never handed out.
            unsafe { self.driver.event_destroy(event) };
            return Err(e);
        }
        Ok(event as u64)
    }

    unsafe fn event_done(&self, device: DeviceOrdinal, event: u64) -> Result<bool, DeviceError> {
        self.make_current(device)?;
        // SAFETY: the caller's contract: a live event from `record_event`.
        unsafe { self.driver.event_query(device, event as Handle) }
    }

    unsafe fn event_wait(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError> {
        self.make_current(device)?;
        // SAFETY: as above.
        unsafe { self.driver.event_synchronize(device, event as Handle) }
    }

    unsafe fn destroy_event(&self, device: DeviceOrdinal, event: u64) {
        // Best effort: without the context the driver may refuse, and the event leaks.
        let _ = self.make_current(device);
        // SAFETY: the caller's contract: live, destroyed once.
        unsafe { self.driver.event_destroy(event as Handle) }
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let stream = {
            let mut slot = self.slot(device)?;
            self.stream(device, &mut slot)?
        };
        // Waited for without the device's lock, so other threads keep queueing meanwhile.
        // SAFETY: the stream is live (destroyed only when the runtime is dropped) and the
        // context stays current on this thread.
        unsafe { self.driver.stream_synchronize(device, stream) }
    }
}

impl Drop for CudaRuntime {
    fn drop(&mut self) {
        for (i, slot) in self.devices.iter_mut().enumerate() {
            let device = DeviceOrdinal::new(i as u32);
            let slot = slot.get_mut().unwrap_or_else(PoisonError::into_inner);
            let Some(context) = slot.context else { continue };
            // SAFETY: retained by `enter` and not yet released.
            if unsafe { self.driver.set_current(device, context) }.is_err() {
                continue;
            }
            if let Some(stream) = slot.stream {
                // SAFETY: the stream is live; waiting makes the buffers below idle.
                let _ = unsafe { self.driver.stream_synchronize(device, stream) };
            }
            // SAFETY: each table buffer came from its allocator in `take_table` and is idle once
            // its event is reached (waited for here; caller streams included); the runtime is
            // being dropped, so nothing queues more work. Events, stream and module are idle
            // and released once; then the context is released, once.
            unsafe {
                for table in slot.tables.drain(..) {
                    let _ = self.driver.event_synchronize(device, table.used);
                    if table.capacity > 0 {
                        let _ = self.driver.host_free(device, table.host);
                        let _ = self.driver.free(device, table.device);
                    }
                    self.driver.event_destroy(table.used);
                }
                self.driver.release(slot.stream.take(), slot.kernel.take().map(|(m, _)| m));
                self.driver.release_primary(slot.handle);
            }
        }
    }
}
