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
//! - One non-blocking stream per device, created at its first use; every copy and launch of
//!   the engine goes on it, and `synchronize` waits for it.
//! - The gather kernel ([`GATHER_KERNEL_SOURCE`], the same source the HIP backend compiles) is
//!   compiled by NVRTC to PTX for the device's own compute capability at the first launch on
//!   that device; the driver JIT-compiles the PTX when loading it, and the module is cached per
//!   device for the runtime's lifetime.
//! - Each launch uploads its descriptors and block table through a pinned staging buffer into
//!   two device buffers, all reused across launches and grown only when too small; the staging
//!   buffer is rewritten only after the stream is synchronized, since the upload reads it
//!   asynchronously.
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
    DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, BLOCK_THREADS, GATHER_KERNEL_NAME,
    GATHER_KERNEL_SOURCE,
};

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
    /// Pinned host staging buffer and device buffers for launch tables: (address, capacity).
    staging: Option<(u64, u64)>,
    descriptors: Option<(u64, u64)>,
    starts: Option<(u64, u64)>,
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
                    staging: None,
                    descriptors: None,
                    starts: None,
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

    /// Makes sure a buffer of at least `len` bytes exists, replacing a smaller one.
    fn ensure(
        &self,
        device: DeviceOrdinal,
        buffer: &mut Option<(u64, u64)>,
        len: u64,
        pinned_host: bool,
    ) -> Result<u64, DeviceError> {
        if let Some((addr, cap)) = *buffer {
            if cap >= len {
                return Ok(addr);
            }
            // SAFETY: the buffer came from the matching allocator below; callers synchronize
            // the stream before growing, so no queued work reads it.
            unsafe {
                if pinned_host {
                    self.driver.host_free(device, addr)?;
                } else {
                    self.driver.free(device, addr)?;
                }
            }
            *buffer = None;
        }
        let cap = len.next_power_of_two().max(4096);
        let addr = if pinned_host {
            self.driver.host_malloc(device, cap)?
        } else {
            self.driver.malloc(device, cap)?
        };
        *buffer = Some((addr, cap));
        Ok(addr)
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
    ) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
        // SAFETY: the caller's contract is `Driver::memcpy_async`'s; the stream is live.
        unsafe { self.driver.memcpy_async(device, dst, src, len, stream) }
    }

    unsafe fn gather(&self, device: DeviceOrdinal, table: &LaunchTable) -> Result<(), DeviceError> {
        if table.descriptors.is_empty() {
            return Ok(());
        }
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
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
        let desc_bytes = size_of_val(table.descriptors.as_slice()) as u64;
        let start_bytes = size_of_val(table.block_starts.as_slice()) as u64;
        // The staging buffer may still be read by the previous launch's upload.
        // SAFETY: the stream is live.
        unsafe { self.driver.stream_synchronize(device, stream)? };
        let staging = self.ensure(device, &mut slot.staging, desc_bytes + start_bytes, true)?;
        let descs = self.ensure(device, &mut slot.descriptors, desc_bytes, false)?;
        let starts = self.ensure(device, &mut slot.starts, start_bytes, false)?;
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
            self.driver.memcpy_async(device, descs, staging, desc_bytes, stream)?;
            self.driver.memcpy_async(device, starts, staging + desc_bytes, start_bytes, stream)?;
        }
        debug_assert_eq!(size_of::<GatherDescriptor>(), 24);
        let count = table.descriptors.len() as u32;
        // SAFETY: the kernel was loaded in this device's context, current now; the uploads
        // precede the launch on the same stream; descriptor validity is the caller's contract.
        unsafe {
            let args = ffi::GatherArgs { descs, starts, count, blocks: table.blocks() };
            self.driver.launch_gather(device, function, stream, BLOCK_THREADS, args)
        }
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DeviceError> {
        let mut slot = self.slot(device)?;
        let stream = self.stream(device, &mut slot)?;
        // SAFETY: the stream is live.
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
            // SAFETY: each buffer came from its allocator in `ensure` and is idle (synchronized
            // above); the runtime is being dropped, so nothing queues more work. The stream and
            // module are idle and released once; then the context is released, once.
            unsafe {
                if let Some((addr, _)) = slot.staging {
                    let _ = self.driver.host_free(device, addr);
                }
                for (addr, _) in [slot.descriptors, slot.starts].into_iter().flatten() {
                    let _ = self.driver.free(device, addr);
                }
                self.driver.release(slot.stream.take(), slot.kernel.take().map(|(m, _)| m));
                self.driver.release_primary(slot.handle);
            }
        }
    }
}
