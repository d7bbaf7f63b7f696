//! The CUDA driver API and NVRTC, loaded at run time. Each wrapper makes one call and turns its
//! status into a `Result`; the `# Safety` sections state what the call dereferences.
//!
//! # Loading
//!
//! cudarc finds and opens the libraries (`libcuda.so.1`, `libnvrtc.so.12`, ... on the loader's
//! search path, so `LD_LIBRARY_PATH` may point at a pip-installed NVRTC; CUDA 13's
//! `libnvrtc.so.13`, which cudarc does not name, is opened here when it finds no NVRTC): first
//! its presence probe, so a machine without them gets [`DeviceError::LibraryMissing`] instead
//! of cudarc's panic, then the shared handle, so the process loads each library once whoever
//! else uses cudarc. The calls themselves are looked up here, each declared returning its
//! status as a plain `c_int`: cudarc's bindings return `CUresult` and `nvrtcResult` as Rust
//! enums, and a status a newer driver added would be undefined behaviour the moment it is
//! returned (the same reason the HIP backend declares its own calls).
#![allow(non_snake_case)] // The driver's own names.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

use umbp_plan::DeviceOrdinal;

use crate::DeviceError;

/// A device handle of the driver API.
pub(super) type CuDevice = c_int;
/// An opaque driver object (context, stream, module, function, event).
pub(super) type Handle = *mut c_void;
/// A device address.
pub(super) type CuDevicePtr = u64;
type NvrtcProgram = *mut c_void;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` and `..._MINOR`.
const ATTRIBUTE_CC_MAJOR: c_int = 75;
const ATTRIBUTE_CC_MINOR: c_int = 76;
/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`.
const HOST_REGISTER_FLAGS: c_uint = 0x01 | 0x02;
/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest event, for ordering only.
const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `CUDA_ERROR_NOT_READY`: what `cuEventQuery` says of an event not yet reached.
const NOT_READY: c_int = 600;

/// Where one launch's uploaded table lives and how big it is.
#[derive(Copy, Clone, Debug)]
pub(super) struct GatherArgs {
    /// Device buffer of `count` descriptors.
    pub(super) descs: u64,
    /// Device buffer of `count + 1` block starts.
    pub(super) starts: u64,
    /// Descriptors.
    pub(super) count: u32,
    /// Blocks to launch.
    pub(super) blocks: u32,
}

/// Declares a table of entry points and how to look them up in a library.
macro_rules! entry_points {
    ($table:ident { $($name:ident: fn($($arg:ty),*);)* }) => {
        pub(super) struct $table {
            $(pub(super) $name: unsafe extern "C" fn($($arg),*) -> c_int,)*
        }

        impl $table {
            /// # Safety
            ///
            /// `lib` exports every entry point with the signature declared for it, and stays
            /// loaded for the life of the process.
            unsafe fn load(lib: &'static libloading::Library) -> Result<Self, String> {
                Ok(Self {
                    $($name: {
                        let symbol = concat!(stringify!($name), "\0").as_bytes();
                        // SAFETY: the caller's contract: the signature matches the export.
                        let f = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> c_int>(symbol)
                        };
                        *f.map_err(|e| format!("{}: {e}", stringify!($name)))?
                    },)*
                })
            }
        }
    };
}

entry_points!(Driver {
    cuInit: fn(c_uint);
    cuGetErrorString: fn(c_int, *mut *const c_char);
    cuDeviceGetCount: fn(*mut c_int);
    cuDeviceGet: fn(*mut CuDevice, c_int);
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CuDevice);
    cuDevicePrimaryCtxRetain: fn(*mut Handle, CuDevice);
    cuDevicePrimaryCtxRelease_v2: fn(CuDevice);
    cuCtxSetCurrent: fn(Handle);
    cuCtxGetCurrent: fn(*mut Handle);
    cuCtxGetDevice: fn(*mut CuDevice);
    cuMemAlloc_v2: fn(*mut CuDevicePtr, usize);
    cuMemFree_v2: fn(CuDevicePtr);
    cuMemAllocHost_v2: fn(*mut *mut c_void, usize);
    cuMemFreeHost: fn(*mut c_void);
    cuMemHostRegister_v2: fn(*mut c_void, usize, c_uint);
    cuMemHostUnregister: fn(*mut c_void);
    cuMemHostGetDevicePointer_v2: fn(*mut CuDevicePtr, *mut c_void, c_uint);
    cuMemcpyAsync: fn(CuDevicePtr, CuDevicePtr, usize, Handle);
    cuStreamCreate: fn(*mut Handle, c_uint);
    cuStreamSynchronize: fn(Handle);
    cuStreamDestroy_v2: fn(Handle);
    cuEventCreate: fn(*mut Handle, c_uint);
    cuEventRecord: fn(Handle, Handle);
    cuEventQuery: fn(Handle);
    cuEventSynchronize: fn(Handle);
    cuEventDestroy_v2: fn(Handle);
    cuModuleLoadData: fn(*mut Handle, *const c_void);
    cuModuleGetFunction: fn(*mut Handle, Handle, *const c_char);
    cuModuleUnload: fn(Handle);
    cuLaunchKernel: fn(
        Handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Handle,
        *mut *mut c_void, *mut *mut c_void
    );
});

entry_points!(Nvrtc {
    nvrtcVersion: fn(*mut c_int, *mut c_int);
    nvrtcCreateProgram: fn(
        *mut NvrtcProgram, *const c_char, *const c_char, c_int,
        *const *const c_char, *const *const c_char
    );
    nvrtcCompileProgram: fn(NvrtcProgram, c_int, *const *const c_char);
    nvrtcGetPTXSize: fn(NvrtcProgram, *mut usize);
    nvrtcGetPTX: fn(NvrtcProgram, *mut c_char);
    nvrtcGetProgramLogSize: fn(NvrtcProgram, *mut usize);
    nvrtcGetProgramLog: fn(NvrtcProgram, *mut c_char);
    nvrtcDestroyProgram: fn(*mut NvrtcProgram);
});

// SAFETY: the tables hold plain function pointers into libraries loaded for the life of the
// process; the driver and NVRTC are thread-safe.
unsafe impl Send for Driver {}
// SAFETY: as above.
unsafe impl Sync for Driver {}
// SAFETY: as above.
unsafe impl Send for Nvrtc {}
// SAFETY: as above.
unsafe impl Sync for Nvrtc {}

/// The driver API, loaded and initialised once per process.
pub(super) fn driver() -> Result<&'static Driver, DeviceError> {
    static DRIVER: OnceLock<Result<Driver, DeviceError>> = OnceLock::new();
    let loaded = DRIVER.get_or_init(|| {
        let missing = |reason: String| DeviceError::LibraryMissing { library: "libcuda", reason };
        // SAFETY: probing opens the library (running its initialisers, as any load does) and
        // reports whether one of cudarc's candidate names loads; it never panics.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(missing("no CUDA driver library on the loader's search path".into()));
        }
        // SAFETY: present (just probed), so cudarc's loader finds it rather than panicking;
        // the library stays loaded for the process.
        let lib = unsafe { cudarc::driver::sys::culib() };
        // SAFETY: every entry point is declared with the driver API's C signature, statuses as
        // `int` (the C `CUresult` is an int-sized enum).
        let driver = unsafe { Driver::load(lib) }.map_err(missing)?;
        // SAFETY: plain value argument.
        let status = unsafe { (driver.cuInit)(0) };
        if status != 0 {
            return Err(runtime_error(&driver, DeviceOrdinal::new(0), status));
        }
        Ok(driver)
    });
    loaded.as_ref().map_err(Clone::clone)
}

/// Sonames of NVRTC releases newer than those cudarc's loader names (it stops at CUDA 12's
/// `libnvrtc.so.12`), tried when its probe finds none. CUDA 13's is the one vLLM 0.33's torch
/// loads (from the `nvidia-cuda-nvrtc` wheel, through its RPATH), so inside such a process the
/// name resolves to the library already mapped, with no `LD_LIBRARY_PATH`. The entry points
/// used here are unchanged in CUDA 13.
const NEWER_NVRTC: &[&str] = &["libnvrtc.so.13"];

/// NVRTC, loaded once per process. Needs no GPU and no driver.
pub(super) fn nvrtc() -> Result<&'static Nvrtc, DeviceError> {
    static NVRTC: OnceLock<Result<Nvrtc, DeviceError>> = OnceLock::new();
    static NEWER: OnceLock<libloading::Library> = OnceLock::new();
    let loaded = NVRTC.get_or_init(|| {
        let missing = |reason: String| DeviceError::LibraryMissing { library: "libnvrtc", reason };
        // SAFETY: as for the driver's probe.
        let lib = if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            // SAFETY: present (just probed); loaded for the process.
            unsafe { cudarc::nvrtc::sys::culib() }
        } else {
            // SAFETY: opening a library runs its initialisers, as any load does; NVRTC's have
            // no preconditions.
            let newer =
                NEWER_NVRTC.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok());
            let Some(newer) = newer else {
                return Err(missing("no NVRTC library on the loader's search path".into()));
            };
            // Kept for the process, as cudarc keeps the one it opens.
            NEWER.get_or_init(|| newer)
        };
        // SAFETY: every entry point is declared with NVRTC's C signature, statuses as `int`.
        unsafe { Nvrtc::load(lib) }.map_err(missing)
    });
    loaded.as_ref().map_err(Clone::clone)
}

/// A failed status as a typed error, with the driver's message.
fn runtime_error(driver: &Driver, device: DeviceOrdinal, status: c_int) -> DeviceError {
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: `text` is a valid out-pointer; for an unknown status the driver leaves it null
    // (and returns an error, which is ignored: the code is reported either way).
    unsafe { (driver.cuGetErrorString)(status, &mut text) };
    let message = if text.is_null() {
        format!("CUDA status {status}")
    } else {
        // SAFETY: the driver returns a static NUL-terminated string.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    match status {
        // CUDA_ERROR_OUT_OF_MEMORY.
        2 => DeviceError::OutOfMemory { device, len: 0 },
        // CUDA_ERROR_NO_DEVICE and CUDA_ERROR_INVALID_DEVICE.
        100 | 101 => DeviceError::NoDevice(device),
        code => DeviceError::Runtime { device, code, message },
    }
}

impl Driver {
    fn check(&self, device: DeviceOrdinal, status: c_int) -> Result<(), DeviceError> {
        if status == 0 {
            Ok(())
        } else {
            Err(runtime_error(self, device, status))
        }
    }

    /// Devices the driver sees.
    pub(super) fn device_count(&self) -> Result<u32, DeviceError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        self.check(DeviceOrdinal::new(0), unsafe { (self.cuDeviceGetCount)(&mut n) })?;
        Ok(n.max(0) as u32)
    }

    /// The driver's handle of device `ordinal` and its compute capability.
    pub(super) fn device(
        &self,
        device: DeviceOrdinal,
    ) -> Result<(CuDevice, (i32, i32)), DeviceError> {
        let mut handle: CuDevice = 0;
        // SAFETY: `handle` is a valid out-pointer.
        self.check(device, unsafe { (self.cuDeviceGet)(&mut handle, device.get() as c_int) })?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out-pointers and a device handle from the driver.
        unsafe {
            self.check(
                device,
                (self.cuDeviceGetAttribute)(&mut major, ATTRIBUTE_CC_MAJOR, handle),
            )?;
            self.check(
                device,
                (self.cuDeviceGetAttribute)(&mut minor, ATTRIBUTE_CC_MINOR, handle),
            )?;
        }
        Ok((handle, (major, minor)))
    }

    /// Retains the device's primary context (the one the CUDA runtime, and so PyTorch, uses).
    pub(super) fn retain_primary(
        &self,
        device: DeviceOrdinal,
        handle: CuDevice,
    ) -> Result<Handle, DeviceError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device handle.
        self.check(device, unsafe { (self.cuDevicePrimaryCtxRetain)(&mut ctx, handle) })?;
        Ok(ctx)
    }

    /// Releases a primary context retained by [`retain_primary`](Self::retain_primary).
    ///
    /// # Safety
    ///
    /// Retained once per release; nothing of this runtime uses the context afterwards.
    pub(super) unsafe fn release_primary(&self, handle: CuDevice) {
        // SAFETY: the caller's contract.
        unsafe { (self.cuDevicePrimaryCtxRelease_v2)(handle) };
    }

    /// Makes `ctx` current for the calling thread.
    ///
    /// # Safety
    ///
    /// `ctx` is a live context (a retained primary context).
    pub(super) unsafe fn set_current(
        &self,
        device: DeviceOrdinal,
        ctx: Handle,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuCtxSetCurrent)(ctx) })
    }

    /// The device of the calling thread's current context, if one is current.
    pub(super) fn current_device(&self) -> Result<Option<CuDevice>, DeviceError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check(DeviceOrdinal::new(0), unsafe { (self.cuCtxGetCurrent)(&mut ctx) })?;
        if ctx.is_null() {
            return Ok(None);
        }
        let mut device: CuDevice = 0;
        // SAFETY: valid out-pointer; a context is current.
        self.check(DeviceOrdinal::new(0), unsafe { (self.cuCtxGetDevice)(&mut device) })?;
        Ok(Some(device))
    }

    /// Allocates device memory in the current context.
    pub(super) fn malloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        let mut p: CuDevicePtr = 0;
        // SAFETY: valid out-pointer.
        self.check(device, unsafe { (self.cuMemAlloc_v2)(&mut p, len as usize) }).map_err(|e| {
            match e {
                DeviceError::OutOfMemory { device, .. } => DeviceError::OutOfMemory { device, len },
                e => e,
            }
        })?;
        Ok(p)
    }

    /// Frees device memory.
    ///
    /// # Safety
    ///
    /// `addr` came from `malloc` and no queued work touches it.
    pub(super) unsafe fn free(&self, device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuMemFree_v2)(addr) })
    }

    /// Allocates pinned host memory.
    pub(super) fn host_malloc(&self, device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check(device, unsafe { (self.cuMemAllocHost_v2)(&mut p, len as usize) })?;
        Ok(p as u64)
    }

    /// Frees pinned host memory.
    ///
    /// # Safety
    ///
    /// `addr` came from `host_malloc` and no queued work touches it.
    pub(super) unsafe fn host_free(
        &self,
        device: DeviceOrdinal,
        addr: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuMemFreeHost)(addr as *mut c_void) })
    }

    /// Pins host memory for every context and maps it; returns its device alias.
    ///
    /// # Safety
    ///
    /// `addr .. + len` is host memory valid until `host_unregister`.
    pub(super) unsafe fn host_register(
        &self,
        device: DeviceOrdinal,
        addr: u64,
        len: u64,
    ) -> Result<u64, DeviceError> {
        let p = addr as *mut c_void;
        // SAFETY: the caller's contract.
        self.check(device, unsafe {
            (self.cuMemHostRegister_v2)(p, len as usize, HOST_REGISTER_FLAGS)
        })?;
        let mut alias: CuDevicePtr = 0;
        // SAFETY: `p` was just registered; `alias` is a valid out-pointer.
        let mapped =
            self.check(device, unsafe { (self.cuMemHostGetDevicePointer_v2)(&mut alias, p, 0) });
        if let Err(e) = mapped {
            // SAFETY: registered just above.
            unsafe { (self.cuMemHostUnregister)(p) };
            return Err(e);
        }
        Ok(alias)
    }

    /// Unpins host memory.
    ///
    /// # Safety
    ///
    /// `addr` was registered and no queued work touches it.
    pub(super) unsafe fn host_unregister(
        &self,
        device: DeviceOrdinal,
        addr: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuMemHostUnregister)(addr as *mut c_void) })
    }

    /// Queues a copy on `stream`; the direction follows from unified addressing.
    ///
    /// # Safety
    ///
    /// As [`DeviceRuntime::copy`](crate::DeviceRuntime::copy); `stream` is live.
    pub(super) unsafe fn memcpy_async(
        &self,
        device: DeviceOrdinal,
        dst: u64,
        src: u64,
        len: u64,
        stream: Handle,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuMemcpyAsync)(dst, src, len as usize, stream) })
    }

    /// Creates a non-blocking stream in the current context.
    pub(super) fn stream_create(&self, device: DeviceOrdinal) -> Result<Handle, DeviceError> {
        let mut s: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check(device, unsafe { (self.cuStreamCreate)(&mut s, STREAM_NON_BLOCKING) })?;
        Ok(s)
    }

    /// Waits for everything queued on `stream`.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream (or null, the legacy default stream).
    pub(super) unsafe fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: Handle,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuStreamSynchronize)(stream) })
    }

    /// Creates an event (timing off) in the current context.
    pub(super) fn event_create(&self, device: DeviceOrdinal) -> Result<Handle, DeviceError> {
        let mut e: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        self.check(device, unsafe { (self.cuEventCreate)(&mut e, EVENT_DISABLE_TIMING) })?;
        Ok(e)
    }

    /// Records `event` on `stream`, after everything queued there so far.
    ///
    /// # Safety
    ///
    /// `event` is a live event and `stream` a live stream (or null) of the current context.
    pub(super) unsafe fn event_record(
        &self,
        device: DeviceOrdinal,
        event: Handle,
        stream: Handle,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuEventRecord)(event, stream) })
    }

    /// Whether the stream reached `event` (an event never recorded counts as reached).
    ///
    /// # Safety
    ///
    /// `event` is a live event.
    pub(super) unsafe fn event_query(
        &self,
        device: DeviceOrdinal,
        event: Handle,
    ) -> Result<bool, DeviceError> {
        // SAFETY: the caller's contract.
        match unsafe { (self.cuEventQuery)(event) } {
            NOT_READY => Ok(false),
            status => self.check(device, status).map(|()| true),
        }
    }

    /// Waits for `event`.
    ///
    /// # Safety
    ///
    /// `event` is a live event.
    pub(super) unsafe fn event_synchronize(
        &self,
        device: DeviceOrdinal,
        event: Handle,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's contract.
        self.check(device, unsafe { (self.cuEventSynchronize)(event) })
    }

    /// Destroys `event`; the driver frees it once streams waiting on it have passed it.
    ///
    /// # Safety
    ///
    /// `event` is a live event, destroyed once and not used again.
    pub(super) unsafe fn event_destroy(&self, event: Handle) {
        // SAFETY: the caller's contract.
        unsafe { (self.cuEventDestroy_v2)(event) };
    }

    /// Loads PTX in the current context and finds `kernel` in it.
    pub(super) fn load_kernel(
        &self,
        device: DeviceOrdinal,
        ptx: &CStr,
        kernel: &str,
    ) -> Result<(Handle, Handle), DeviceError> {
        let name = CString::new(kernel).map_err(|_| DeviceError::NoDevice(device))?;
        let mut module: Handle = std::ptr::null_mut();
        // SAFETY: `ptx` is NUL-terminated PTX text, alive for the call (the driver JIT-compiles
        // and keeps its own copy); `module` is a valid out-pointer.
        self.check(device, unsafe { (self.cuModuleLoadData)(&mut module, ptx.as_ptr().cast()) })?;
        let mut function: Handle = std::ptr::null_mut();
        // SAFETY: `module` was loaded above; `name` is NUL-terminated.
        let found = self.check(device, unsafe {
            (self.cuModuleGetFunction)(&mut function, module, name.as_ptr())
        });
        if let Err(e) = found {
            // SAFETY: loaded above, unloaded once.
            unsafe { (self.cuModuleUnload)(module) };
            return Err(e);
        }
        Ok((module, function))
    }

    /// Launches the gather kernel with `threads` threads per block.
    ///
    /// # Safety
    ///
    /// `function` is the gather kernel loaded in the current context; `stream` is a live
    /// stream (or null) of that context; `args` names device buffers holding its table until
    /// the launch has run; every descriptor names memory the device may access.
    pub(super) unsafe fn launch_gather(
        &self,
        device: DeviceOrdinal,
        function: Handle,
        stream: Handle,
        threads: u32,
        args: GatherArgs,
    ) -> Result<(), DeviceError> {
        let (mut d, mut s, mut n) = (args.descs, args.starts, args.count as c_uint);
        let mut params: [*mut c_void; 3] = [
            (&mut d as *mut u64).cast(),
            (&mut s as *mut u64).cast(),
            (&mut n as *mut c_uint).cast(),
        ];
        let (blocks, null) = (args.blocks, std::ptr::null_mut());
        // SAFETY: the caller's contract for the kernel's arguments; `params` points at three
        // live locals whose types match the kernel's parameters (two pointers, one unsigned).
        self.check(device, unsafe {
            (self.cuLaunchKernel)(
                function,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                null,
            )
        })
    }

    /// Destroys a stream and unloads a module, best effort (when the runtime is dropped).
    ///
    /// # Safety
    ///
    /// Both are live, idle (the stream was synchronized) and released once.
    pub(super) unsafe fn release(&self, stream: Option<Handle>, module: Option<Handle>) {
        if let Some(s) = stream {
            // SAFETY: the caller's contract.
            unsafe { (self.cuStreamDestroy_v2)(s) };
        }
        if let Some(m) = module {
            // SAFETY: the caller's contract.
            unsafe { (self.cuModuleUnload)(m) };
        }
    }
}

impl Nvrtc {
    /// NVRTC's version, `(major, minor)`.
    pub(super) fn version(&self) -> (i32, i32) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: valid out-pointers.
        unsafe { (self.nvrtcVersion)(&mut major, &mut minor) };
        (major, minor)
    }

    /// Compiles CUDA C++ `source` to PTX for virtual architecture `arch` (`compute_90`).
    pub(super) fn compile_ptx(
        &self,
        source: &str,
        name: &str,
        arch: &str,
    ) -> Result<CString, DeviceError> {
        let fail = |log: String| DeviceError::KernelCompile { arch: arch.into(), log };
        let src = CString::new(source).map_err(|_| fail("source holds a NUL byte".into()))?;
        let name = CString::new(name).map_err(|_| fail("name holds a NUL byte".into()))?;
        let option = CString::new(format!("--gpu-architecture={arch}"))
            .map_err(|_| fail("architecture holds a NUL byte".into()))?;
        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: `src` and `name` are NUL-terminated and outlive the call; no headers (count
        // 0, null arrays); `prog` is a valid out-pointer.
        let created = unsafe {
            (self.nvrtcCreateProgram)(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if created != 0 {
            return Err(fail(format!("nvrtcCreateProgram status {created}")));
        }
        let options = [option.as_ptr()];
        // SAFETY: `prog` was created above; `options` holds one NUL-terminated string alive for
        // the call.
        let compiled = unsafe { (self.nvrtcCompileProgram)(prog, 1, options.as_ptr()) };
        let result = if compiled != 0 {
            // SAFETY: `prog` is live.
            let log = unsafe {
                self.program_text(prog, self.nvrtcGetProgramLogSize, self.nvrtcGetProgramLog)
            };
            Err(fail(format!(
                "nvrtcCompileProgram status {compiled}: {}",
                log.unwrap_or_default().to_string_lossy()
            )))
        } else {
            // SAFETY: `prog` compiled.
            unsafe { self.program_text(prog, self.nvrtcGetPTXSize, self.nvrtcGetPTX) }
                .ok_or_else(|| fail("NVRTC returned no PTX".into()))
        };
        // SAFETY: `prog` was created above and is destroyed once.
        unsafe { (self.nvrtcDestroyProgram)(&mut prog) };
        result
    }

    /// A NUL-terminated text NVRTC hands out by size, then contents (the PTX, the log).
    ///
    /// # Safety
    ///
    /// `prog` is live; `size` and `get` are the matching pair of entry points.
    unsafe fn program_text(
        &self,
        prog: NvrtcProgram,
        size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
        get: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ) -> Option<CString> {
        let mut n = 0usize;
        // SAFETY: `prog` is live (caller); `n` is a valid out-pointer.
        if unsafe { size(prog, &mut n) } != 0 || n == 0 {
            return None;
        }
        let mut text = vec![0u8; n];
        // SAFETY: `text` holds `n` bytes, as NVRTC asked for (its size counts the NUL).
        if unsafe { get(prog, text.as_mut_ptr().cast()) } != 0 {
            return None;
        }
        CStr::from_bytes_until_nul(&text).ok().map(CStr::to_owned)
    }
}
