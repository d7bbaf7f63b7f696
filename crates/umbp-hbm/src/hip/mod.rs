//! The HIP backend: AMD GPUs through the HIP runtime (feature `hip`, Linux).
//!
//! # Strategy
//!
//! - One stream per device, created at the device's first use; the engine's own copies and
//!   launches go on it ([`Queue::Own`]), and `synchronize` waits for it. Work for a caller's
//!   stream ([`Queue::Stream`], a `hipStream_t`) goes there instead; events (timing off) mark
//!   points on either.
//! - The gather kernel ([`GATHER_KERNEL_SOURCE`], shipped in the crate) is compiled by hiprtc for the
//!   device's own architecture (its `gcnArchName`) at the first launch on that device, and the
//!   loaded module is cached per device for the runtime's lifetime.
//! - Each launch uploads its descriptors and block table from a pinned staging buffer into one
//!   device buffer and records an event after the launch; a device keeps a ring of
//!   [`TABLE_BUFFERS`] such pairs, each reused only once its last launch passed its event, as
//!   the CUDA backend does (see there).
//! - Unlike the simulated device, nothing here re-checks addresses: the engine checked every
//!   segment against its endpoint.

mod conv;
mod ffi;

use std::sync::{Mutex, MutexGuard, PoisonError};

use umbp_plan::DeviceOrdinal;

use crate::{
    DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, Queue, BLOCK_THREADS,
    GATHER_KERNEL_NAME, GATHER_KERNEL_SOURCE,
};

/// Launch tables per device that may be in flight at once.
pub const TABLE_BUFFERS: usize = 4;

/// Compiles the gather kernel for `arch` (for example `gfx90a`) with hiprtc and returns the
/// code object. Needs no GPU, only the ROCm compiler libraries.
pub fn compile_gather_kernel(arch: &str) -> Result<Vec<u8>, DeviceError> {
    ffi::hiprtc_compile(GATHER_KERNEL_SOURCE, "gather.cu", arch)
}

/// The HIP device runtime; see the [module docs](self).
pub struct HipRuntime {
    devices: Vec<Mutex<Slot>>,
}

/// Per-device state, created lazily.
#[derive(Default)]
struct Slot {
    stream: Option<ffi::hipStream_t>,
    kernel: Option<(ffi::hipModule_t, ffi::hipFunction_t)>,
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
    used: ffi::hipEvent_t,
}

// SAFETY: the raw handles are HIP objects usable from any thread; each slot is only touched
// under its mutex.
unsafe impl Send for Slot {}

impl HipRuntime {
    /// The runtime over every visible device. Fails when HIP reports no device (no GPU, or no
    /// driver): callers use the simulated device then.
    pub fn new() -> Result<Self, DeviceError> {
        let count = ffi::device_count()?;
        if count == 0 {
            return Err(DeviceError::NoDevice(DeviceOrdinal::new(0)));
        }
        Ok(Self { devices: (0..count).map(|_| Mutex::new(Slot::default())).collect() })
    }

    /// The device's architecture name as HIP reports it (for example `gfx90a:sramecc+:xnack-`).
    pub fn arch(&self, device: DeviceOrdinal) -> Result<String, DeviceError> {
        self.check(device)?;
        ffi::arch_name(device)
    }

    fn check(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        if (device.get() as usize) < self.devices.len() {
            Ok(())
        } else {
            Err(DeviceError::NoDevice(device))
        }
    }

    fn slot(&self, device: DeviceOrdinal) -> Result<MutexGuard<'_, Slot>, DeviceError> {
        let slot = self.devices.get(device.get() as usize).ok_or(DeviceError::NoDevice(device))?;
        Ok(slot.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The device's stream, made current and created on first use.
    fn stream(
        &self,
        device: DeviceOrdinal,
        slot: &mut Slot,
    ) -> Result<ffi::hipStream_t, DeviceError> {
        ffi::set_device(device)?;
        match slot.stream {
            Some(s) => Ok(s),
            None => {
                let s = ffi::stream_create(device)?;
                slot.stream = Some(s);
                Ok(s)
            }
        }
    }
}

impl HipRuntime {
    /// The stream work for `queue` goes on, with the device current.
    fn queue(
        &self,
        device: DeviceOrdinal,
        slot: &mut Slot,
        queue: Queue,
    ) -> Result<ffi::hipStream_t, DeviceError> {
        match queue {
            Queue::Own => self.stream(device, slot),
            Queue::Stream(raw) => {
                ffi::set_device(device)?;
                Ok(raw as ffi::hipStream_t)
            }
        }
    }
}

/// The next table buffer of `slot`'s ring, idle (the launch that last used it has run) and of
/// at least `len` bytes; returns its index.
fn take_table(device: DeviceOrdinal, slot: &mut Slot, len: u64) -> Result<usize, DeviceError> {
    let index = slot.next_table;
    if index == slot.tables.len() {
        let used = ffi::event_create(device)?;
        slot.tables.push(TableBuffer { host: 0, device: 0, capacity: 0, used });
    }
    let table = &mut slot.tables[index];
    // SAFETY: `used` is live (destroyed only on drop); waiting for it makes the buffers idle.
    unsafe { ffi::event_synchronize(device, table.used)? };
    if table.capacity < len {
        // SAFETY: the buffers came from these allocators and are idle (waited above).
        unsafe {
            if table.capacity > 0 {
                ffi::host_free(device, table.host)?;
                ffi::free(device, table.device)?;
            }
        }
        table.capacity = 0;
        let capacity = len.next_power_of_two().max(4096);
        table.host = ffi::host_malloc(device, capacity)?;
        table.device = match ffi::malloc(device, capacity) {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: allocated just above, never used.
                let _ = unsafe { ffi::host_free(device, table.host) };
                return Err(e);
            }
        };
        table.capacity = capacity;
    }
    slot.next_table = (index + 1) % TABLE_BUFFERS;
    Ok(index)
}

impl DeviceRuntime for HipRuntime {
    fn name(&self) -> &'static str {
        "hip"
    }

    fn device_count(&self) -> Result<u32, DeviceError> {
        Ok(self.devices.len() as u32)
    }

    fn current_device(&self) -> Result<DeviceOrdinal, DeviceError> {
        ffi::get_device()
    }

    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        self.check(device)?;
        ffi::set_device(device)
    }

    fn alloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        self.check(device)?;
        ffi::set_device(device)?;
        ffi::malloc(device, len)
    }

    unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        ffi::set_device(device)?;
        // SAFETY: the caller's contract is `ffi::free`'s.
        unsafe { ffi::free(device, addr) }
    }

    unsafe fn register_host(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        self.check(device)?;
        ffi::set_device(device)?;
        // SAFETY: the caller's contract is `ffi::host_register`'s.
        unsafe { ffi::host_register(device, addr, len) }
    }

    unsafe fn unregister_host(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract is `ffi::host_unregister`'s.
        unsafe { ffi::host_unregister(device, addr) }
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
        // SAFETY: the caller's contract is `ffi::memcpy_async`'s; the stream is live (ours, or
        // the caller's by this function's contract).
        unsafe { ffi::memcpy_async(device, dst, src, len, stream) }
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
            let arch = ffi::arch_name(device)?;
            let code = compile_gather_kernel(&arch)?;
            slot.kernel = Some(ffi::load_kernel(device, &code, GATHER_KERNEL_NAME)?);
            tracing::info!(device = device.get(), %arch, "gather kernel compiled and loaded");
        }
        let (_, function) = slot.kernel.expect("loaded above");
        // Descriptors are 24 bytes each, so the block starts that follow them stay 8-aligned.
        let desc_bytes = size_of_val(table.descriptors.as_slice()) as u64;
        let start_bytes = size_of_val(table.block_starts.as_slice()) as u64;
        let index = take_table(device, &mut slot, desc_bytes + start_bytes)?;
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
        let args = ffi::GatherArgs {
            descs,
            starts,
            count: table.descriptors.len() as u32,
            blocks: table.blocks(),
        };
        // SAFETY: the buffers are live, large enough and idle (`take_table`) until the event
        // recorded below is reached, which their next use waits for; the kernel was loaded on
        // this device; the upload precedes the launch on the same live stream; descriptor
        // validity is the caller's contract.
        unsafe {
            ffi::memcpy_async(device, descs, buffer.host, desc_bytes + start_bytes, stream)?;
            let launched = ffi::launch_gather(device, function, stream, BLOCK_THREADS, args);
            // Recorded even if the launch failed: the upload is queued either way. Without the
            // event the buffer's next use could overwrite a table still being read: wait for
            // the stream instead.
            if let Err(e) = ffi::event_record(device, buffer.used, stream) {
                let _ = ffi::stream_synchronize(device, stream);
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
        self.check(device)?;
        ffi::set_device(device)?;
        // SAFETY: the caller's contract: a live stream of `device`.
        unsafe { ffi::stream_synchronize(device, stream as ffi::hipStream_t) }
    }

    unsafe fn record_event(&self, device: DeviceOrdinal, queue: Queue) -> Result<u64, DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.queue(device, &mut slot, queue)?;
        let event = ffi::event_create(device)?;
        // SAFETY: created above on the current device; the stream is live (ours, or the
        // caller's by this function's contract).
        if let Err(e) = unsafe { ffi::event_record(device, event, stream) } {
            // SAFETY: created above, never handed out.
            unsafe { ffi::event_destroy(event) };
            return Err(e);
        }
        Ok(event as u64)
    }

    unsafe fn event_done(&self, device: DeviceOrdinal, event: u64) -> Result<bool, DeviceError> {
        self.check(device)?;
        ffi::set_device(device)?;
        // SAFETY: the caller's contract: a live event from `record_event`.
        unsafe { ffi::event_query(device, event as ffi::hipEvent_t) }
    }

    unsafe fn event_wait(&self, device: DeviceOrdinal, event: u64) -> Result<(), DeviceError> {
        self.check(device)?;
        ffi::set_device(device)?;
        // SAFETY: as above.
        unsafe { ffi::event_synchronize(device, event as ffi::hipEvent_t) }
    }

    unsafe fn destroy_event(&self, device: DeviceOrdinal, event: u64) {
        let _ = ffi::set_device(device);
        // SAFETY: the caller's contract: live, destroyed once.
        unsafe { ffi::event_destroy(event as ffi::hipEvent_t) }
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let stream = {
            let mut slot = self.slot(device)?;
            self.stream(device, &mut slot)?
        };
        // Waited for without the device's lock, so other threads keep queueing meanwhile.
        // SAFETY: the stream is live (destroyed only when the runtime is dropped).
        unsafe { ffi::stream_synchronize(device, stream) }
    }
}

impl Drop for HipRuntime {
    fn drop(&mut self) {
        for (i, slot) in self.devices.iter_mut().enumerate() {
            let device = DeviceOrdinal::new(i as u32);
            let slot = slot.get_mut().unwrap_or_else(PoisonError::into_inner);
            if ffi::set_device(device).is_err() {
                continue;
            }
            if let Some(stream) = slot.stream {
                // SAFETY: the stream is live; waiting makes the buffers below idle.
                let _ = unsafe { ffi::stream_synchronize(device, stream) };
            }
            // SAFETY: each table buffer came from its allocator in `take_table` and is idle
            // once its event is reached (waited for here, caller streams included); the runtime
            // is being dropped, so nothing queues more work; each event is destroyed once.
            unsafe {
                for table in slot.tables.drain(..) {
                    let _ = ffi::event_synchronize(device, table.used);
                    if table.capacity > 0 {
                        let _ = ffi::host_free(device, table.host);
                        let _ = ffi::free(device, table.device);
                    }
                    ffi::event_destroy(table.used);
                }
            }
            ffi::release(device, slot.stream.take(), slot.kernel.take());
        }
    }
}
