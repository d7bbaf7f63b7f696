//! The HIP backend: AMD GPUs through the HIP runtime (feature `hip`, Linux).
//!
//! # Strategy
//!
//! - One stream per device, created at the device's first use; every copy and launch of the
//!   engine goes on it, and `synchronize` waits for it.
//! - The gather kernel ([`GATHER_KERNEL_SOURCE`], shipped in the crate) is compiled by hiprtc for the
//!   device's own architecture (its `gcnArchName`) at the first launch on that device, and the
//!   loaded module is cached per device for the runtime's lifetime.
//! - Each launch uploads its descriptors and block table through a pinned staging buffer into
//!   two device buffers; all three are reused across launches and grow only when too small.
//!   The staging buffer is reused only after the stream is synchronized, since the upload reads
//!   it asynchronously.
//! - Unlike the simulated device, nothing here re-checks addresses: the engine checked every
//!   segment against its endpoint.

mod conv;
mod ffi;

use std::sync::{Mutex, MutexGuard, PoisonError};

use umbp_plan::DeviceOrdinal;

use crate::{
    DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, BLOCK_THREADS, GATHER_KERNEL_NAME,
    GATHER_KERNEL_SOURCE,
};

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
    /// Pinned host staging buffer and device buffers for launch tables: (address, capacity).
    staging: Option<(u64, u64)>,
    descriptors: Option<(u64, u64)>,
    starts: Option<(u64, u64)>,
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

/// Makes sure a buffer of at least `len` bytes exists, replacing a smaller one.
fn ensure(
    device: DeviceOrdinal,
    buffer: &mut Option<(u64, u64)>,
    len: u64,
    pinned_host: bool,
) -> Result<u64, DeviceError> {
    if let Some((addr, cap)) = *buffer {
        if cap >= len {
            return Ok(addr);
        }
        // SAFETY: the buffer came from the matching allocator below; callers synchronize the
        // stream before growing, so no queued work reads it.
        unsafe {
            if pinned_host {
                ffi::host_free(device, addr)?;
            } else {
                ffi::free(device, addr)?;
            }
        }
        *buffer = None;
    }
    let cap = len.next_power_of_two().max(4096);
    let addr = if pinned_host { ffi::host_malloc(device, cap)? } else { ffi::malloc(device, cap)? };
    *buffer = Some((addr, cap));
    Ok(addr)
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
    ) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
        // SAFETY: the caller's contract is `ffi::memcpy_async`'s; the stream is live.
        unsafe { ffi::memcpy_async(device, dst, src, len, stream) }
    }

    unsafe fn gather(&self, device: DeviceOrdinal, table: &LaunchTable) -> Result<(), DeviceError> {
        if table.descriptors.is_empty() {
            return Ok(());
        }
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
        if slot.kernel.is_none() {
            let arch = ffi::arch_name(device)?;
            let code = compile_gather_kernel(&arch)?;
            slot.kernel = Some(ffi::load_kernel(device, &code, GATHER_KERNEL_NAME)?);
            tracing::info!(device = device.get(), %arch, "gather kernel compiled and loaded");
        }
        let (_, function) = slot.kernel.expect("loaded above");
        let desc_bytes = size_of_val(table.descriptors.as_slice()) as u64;
        let start_bytes = size_of_val(table.block_starts.as_slice()) as u64;
        // The staging buffer may still be read by the previous launch's upload.
        // SAFETY: the stream is live.
        unsafe { ffi::stream_synchronize(device, stream)? };
        let staging = ensure(device, &mut slot.staging, desc_bytes + start_bytes, true)?;
        let descs = ensure(device, &mut slot.descriptors, desc_bytes, false)?;
        let starts = ensure(device, &mut slot.starts, start_bytes, false)?;
        // SAFETY: 1. `staging` is pinned host memory of at least `desc_bytes + start_bytes`
        // bytes, and nothing reads it (synchronized above); 2. the source slices are live;
        // 3. `GatherDescriptor` is `repr(C)` plain data, `u32` likewise.
        unsafe {
            std::ptr::copy_nonoverlapping(
                table.descriptors.as_ptr().cast::<u8>(),
                staging as *mut u8,
                desc_bytes as usize,
            );
            std::ptr::copy_nonoverlapping(
                table.block_starts.as_ptr().cast::<u8>(),
                (staging + desc_bytes) as *mut u8,
                start_bytes as usize,
            );
        }
        // SAFETY: staging and device buffers are live and large enough (ensured above) until
        // they are next grown, which synchronizes the stream first.
        unsafe {
            ffi::memcpy_async(device, descs, staging, desc_bytes, stream)?;
            ffi::memcpy_async(device, starts, staging + desc_bytes, start_bytes, stream)?;
        }
        debug_assert_eq!(size_of::<GatherDescriptor>(), 24);
        // SAFETY: the kernel was loaded on this device; the uploads precede the launch on the
        // same stream; descriptor validity is the caller's contract.
        unsafe {
            ffi::launch_gather(
                device,
                function,
                stream,
                BLOCK_THREADS,
                ffi::GatherArgs {
                    descs,
                    starts,
                    count: table.descriptors.len() as u32,
                    blocks: table.blocks(),
                },
            )
        }
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
        // SAFETY: the stream is live.
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
            // SAFETY: each buffer came from its allocator in `ensure` and is idle (synchronized
            // above); the runtime is being dropped, so nothing queues more work.
            unsafe {
                if let Some((addr, _)) = slot.staging {
                    let _ = ffi::host_free(device, addr);
                }
                for (addr, _) in [slot.descriptors, slot.starts].into_iter().flatten() {
                    let _ = ffi::free(device, addr);
                }
            }
            ffi::release(device, slot.stream.take(), slot.kernel.take());
        }
    }
}
