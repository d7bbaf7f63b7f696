//! Thin wrappers over the HIP runtime and hiprtc. Each wrapper makes one call and turns its
//! status into a `Result`; the `# Safety` sections state what the call dereferences.
//!
//! The calls are declared here, every one returning its status as a plain `c_int`.
//! hip-runtime-sys declares them returning `hipError_t`, a Rust enum: a status outside that
//! enum (one a newer ROCm added) would be undefined behaviour the moment it is returned. The
//! crate is still used, for linking libamdhip64 and for the `hipDeviceProp_t` layout. hiprtc
//! comes from libamdhip64 in ROCm 5.2 and from libhiprtc later (`build.rs` links it when
//! present).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use hip_runtime_sys as sys;
use umbp_plan::DeviceOrdinal;

use super::conv::{check, check_rtc};
use crate::DeviceError;

/// An opaque HIP stream handle.
#[allow(non_camel_case_types)] // HIP's own name.
pub(super) type hipStream_t = *mut c_void;
/// An opaque HIP event handle.
#[allow(non_camel_case_types)] // HIP's own name.
pub(super) type hipEvent_t = *mut c_void;
/// An opaque HIP module handle.
#[allow(non_camel_case_types)] // HIP's own name.
pub(super) type hipModule_t = *mut c_void;
/// An opaque HIP kernel handle.
#[allow(non_camel_case_types)] // HIP's own name.
pub(super) type hipFunction_t = *mut c_void;
/// An opaque hiprtc program handle.
type HiprtcProgram = *mut c_void;

/// `hipHostMallocDefault`.
const HOST_MALLOC_DEFAULT: c_uint = 0;
/// `hipHostRegisterMapped`.
const HOST_REGISTER_MAPPED: c_uint = 2;
/// `hipMemcpyDefault`: the direction follows from the unified address space.
const MEMCPY_DEFAULT: c_int = 4;
/// `hipEventDisableTiming`: the cheapest event, for ordering only.
const EVENT_DISABLE_TIMING: c_uint = 0x2;
/// `hipErrorNotReady`: what `hipEventQuery` says of an event not yet reached.
const NOT_READY: c_int = 600;

// The HIP runtime, as libamdhip64 exports it; statuses as integers (see the module docs).
extern "C" {
    pub(super) fn hipGetErrorString(status: c_int) -> *const c_char;
    fn hipGetDeviceCount(count: *mut c_int) -> c_int;
    fn hipGetDevice(device: *mut c_int) -> c_int;
    fn hipSetDevice(device: c_int) -> c_int;
    fn hipGetDeviceProperties(props: *mut sys::hipDeviceProp_t, device: c_int) -> c_int;
    fn hipStreamCreate(stream: *mut hipStream_t) -> c_int;
    fn hipStreamSynchronize(stream: hipStream_t) -> c_int;
    fn hipStreamDestroy(stream: hipStream_t) -> c_int;
    fn hipEventCreateWithFlags(event: *mut hipEvent_t, flags: c_uint) -> c_int;
    fn hipEventRecord(event: hipEvent_t, stream: hipStream_t) -> c_int;
    fn hipEventQuery(event: hipEvent_t) -> c_int;
    fn hipEventSynchronize(event: hipEvent_t) -> c_int;
    fn hipEventDestroy(event: hipEvent_t) -> c_int;
    fn hipMalloc(ptr: *mut *mut c_void, len: usize) -> c_int;
    fn hipFree(ptr: *mut c_void) -> c_int;
    fn hipHostMalloc(ptr: *mut *mut c_void, len: usize, flags: c_uint) -> c_int;
    fn hipHostFree(ptr: *mut c_void) -> c_int;
    fn hipHostRegister(ptr: *mut c_void, len: usize, flags: c_uint) -> c_int;
    fn hipHostGetDevicePointer(alias: *mut *mut c_void, ptr: *mut c_void, flags: c_uint) -> c_int;
    fn hipHostUnregister(ptr: *mut c_void) -> c_int;
    fn hipMemcpyAsync(
        dst: *mut c_void,
        src: *const c_void,
        len: usize,
        kind: c_int,
        stream: hipStream_t,
    ) -> c_int;
    fn hipModuleLoadData(module: *mut hipModule_t, image: *const c_void) -> c_int;
    fn hipModuleGetFunction(
        function: *mut hipFunction_t,
        module: hipModule_t,
        name: *const c_char,
    ) -> c_int;
    fn hipModuleUnload(module: hipModule_t) -> c_int;
    #[allow(clippy::too_many_arguments)] // The runtime's signature.
    fn hipModuleLaunchKernel(
        function: hipFunction_t,
        grid_x: c_uint,
        grid_y: c_uint,
        grid_z: c_uint,
        block_x: c_uint,
        block_y: c_uint,
        block_z: c_uint,
        shared_bytes: c_uint,
        stream: hipStream_t,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> c_int;
}

// hiprtc.
extern "C" {
    fn hiprtcCreateProgram(
        prog: *mut HiprtcProgram,
        src: *const c_char,
        name: *const c_char,
        num_headers: c_int,
        headers: *const *const c_char,
        include_names: *const *const c_char,
    ) -> c_int;
    fn hiprtcCompileProgram(prog: HiprtcProgram, n: c_int, options: *const *const c_char) -> c_int;
    fn hiprtcGetProgramLogSize(prog: HiprtcProgram, size: *mut usize) -> c_int;
    fn hiprtcGetProgramLog(prog: HiprtcProgram, log: *mut c_char) -> c_int;
    fn hiprtcGetCodeSize(prog: HiprtcProgram, size: *mut usize) -> c_int;
    fn hiprtcGetCode(prog: HiprtcProgram, code: *mut c_char) -> c_int;
    fn hiprtcDestroyProgram(prog: *mut HiprtcProgram) -> c_int;
    pub(super) fn hiprtcGetErrorString(result: c_int) -> *const c_char;
}

/// Compiles HIP C++ `source` for `arch` (for example `gfx90a`) and returns the code object.
pub(super) fn hiprtc_compile(source: &str, name: &str, arch: &str) -> Result<Vec<u8>, DeviceError> {
    let fail = |log: String| DeviceError::KernelCompile { arch: arch.into(), log };
    let src = CString::new(source).map_err(|_| fail("source holds a NUL byte".into()))?;
    let name = CString::new(name).map_err(|_| fail("name holds a NUL byte".into()))?;
    let option = CString::new(format!("--gpu-architecture={arch}"))
        .map_err(|_| fail("architecture holds a NUL byte".into()))?;
    let mut prog: HiprtcProgram = std::ptr::null_mut();
    // SAFETY: `src` and `name` are NUL-terminated and outlive the call; no headers are passed
    // (count 0, null arrays); `prog` is a valid out-pointer.
    check_rtc(arch, unsafe {
        hiprtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    })?;
    let options = [option.as_ptr()];
    // SAFETY: `prog` was created above; `options` holds one NUL-terminated string alive for the
    // call.
    let compiled = unsafe { hiprtcCompileProgram(prog, 1, options.as_ptr()) };
    let result = if compiled != 0 {
        // SAFETY: `prog` is valid; the log helper sizes its buffer from hiprtc's answer.
        let log = unsafe { program_log(prog) };
        Err(fail(format!("{}: {log}", rtc_message(compiled))))
    } else {
        // SAFETY: `prog` compiled successfully.
        unsafe { program_code(prog, arch) }
    };
    // SAFETY: `prog` was created above and is destroyed once.
    unsafe { hiprtcDestroyProgram(&mut prog) };
    result
}

/// # Safety
///
/// `prog` is a live hiprtc program.
unsafe fn program_log(prog: HiprtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is live (caller); `size` is a valid out-pointer.
    if unsafe { hiprtcGetProgramLogSize(prog, &mut size) } != 0 || size == 0 {
        return String::new();
    }
    let mut log = vec![0u8; size];
    // SAFETY: `log` holds `size` bytes, as hiprtc asked for.
    unsafe { hiprtcGetProgramLog(prog, log.as_mut_ptr().cast()) };
    String::from_utf8_lossy(&log).trim_end_matches('\0').to_string()
}

/// # Safety
///
/// `prog` is a live, successfully compiled hiprtc program.
unsafe fn program_code(prog: HiprtcProgram, arch: &str) -> Result<Vec<u8>, DeviceError> {
    let mut size = 0usize;
    // SAFETY: `prog` is live (caller); `size` is a valid out-pointer.
    check_rtc(arch, unsafe { hiprtcGetCodeSize(prog, &mut size) })?;
    let mut code = vec![0u8; size];
    // SAFETY: `code` holds `size` bytes, as hiprtc asked for.
    check_rtc(arch, unsafe { hiprtcGetCode(prog, code.as_mut_ptr().cast()) })?;
    Ok(code)
}

/// hiprtc's message for a status.
pub(super) fn rtc_message(status: c_int) -> String {
    // SAFETY: hiprtcGetErrorString returns a static NUL-terminated string (or null).
    let p = unsafe { hiprtcGetErrorString(status) };
    if p.is_null() {
        return format!("hiprtc status {status}");
    }
    // SAFETY: non-null and NUL-terminated, static.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Number of visible devices.
pub(super) fn device_count() -> Result<u32, DeviceError> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    check(DeviceOrdinal::new(0), unsafe { hipGetDeviceCount(&mut n) })?;
    Ok(n.max(0) as u32)
}

/// The calling thread's current device.
pub(super) fn get_device() -> Result<DeviceOrdinal, DeviceError> {
    let mut d: c_int = 0;
    // SAFETY: `d` is a valid out-pointer.
    check(DeviceOrdinal::new(0), unsafe { hipGetDevice(&mut d) })?;
    Ok(DeviceOrdinal::new(d.max(0) as u32))
}

/// Makes `device` current for the calling thread.
pub(super) fn set_device(device: DeviceOrdinal) -> Result<(), DeviceError> {
    // SAFETY: plain value argument.
    check(device, unsafe { hipSetDevice(device.get() as c_int) })
}

/// The device's architecture name, for example `gfx90a:sramecc+:xnack-`.
pub(super) fn arch_name(device: DeviceOrdinal) -> Result<String, DeviceError> {
    // The properties struct grew across ROCm releases; give the runtime room beyond the layout
    // these bindings know, and read the name at its known offset.
    #[repr(C)]
    union Props {
        props: std::mem::ManuallyDrop<sys::hipDeviceProp_t>,
        room: [u8; 8192],
    }
    let mut p = Props { room: [0; 8192] };
    // SAFETY: `p` is writable and larger than any hipDeviceProp_t of ROCm 5.x (792 bytes).
    check(device, unsafe { hipGetDeviceProperties(&mut *p.props, device.get() as c_int) })?;
    // SAFETY: the runtime filled the struct; gcnArchName is a NUL-terminated char array (the
    // union's zero fill guarantees a terminator).
    let name = unsafe { CStr::from_ptr(p.props.gcnArchName.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

/// Creates a stream on the current device.
pub(super) fn stream_create(device: DeviceOrdinal) -> Result<hipStream_t, DeviceError> {
    let mut s: hipStream_t = std::ptr::null_mut();
    // SAFETY: `s` is a valid out-pointer.
    check(device, unsafe { hipStreamCreate(&mut s) })?;
    Ok(s)
}

/// Waits for everything queued on `stream`.
///
/// # Safety
///
/// `stream` is a live stream.
pub(super) unsafe fn stream_synchronize(
    device: DeviceOrdinal,
    stream: hipStream_t,
) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipStreamSynchronize(stream) })
}

/// Creates an event (timing off) on the current device.
pub(super) fn event_create(device: DeviceOrdinal) -> Result<hipEvent_t, DeviceError> {
    let mut e: hipEvent_t = std::ptr::null_mut();
    // SAFETY: `e` is a valid out-pointer.
    check(device, unsafe { hipEventCreateWithFlags(&mut e, EVENT_DISABLE_TIMING) })?;
    Ok(e)
}

/// Records `event` on `stream`, after everything queued there so far.
///
/// # Safety
///
/// `event` is a live event and `stream` a live stream (or null) of the current device.
pub(super) unsafe fn event_record(
    device: DeviceOrdinal,
    event: hipEvent_t,
    stream: hipStream_t,
) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipEventRecord(event, stream) })
}

/// Whether the stream reached `event` (an event never recorded counts as reached).
///
/// # Safety
///
/// `event` is a live event.
pub(super) unsafe fn event_query(
    device: DeviceOrdinal,
    event: hipEvent_t,
) -> Result<bool, DeviceError> {
    // SAFETY: the caller's contract.
    match unsafe { hipEventQuery(event) } {
        NOT_READY => Ok(false),
        status => check(device, status).map(|()| true),
    }
}

/// Waits for `event`.
///
/// # Safety
///
/// `event` is a live event.
pub(super) unsafe fn event_synchronize(
    device: DeviceOrdinal,
    event: hipEvent_t,
) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipEventSynchronize(event) })
}

/// Destroys `event`.
///
/// # Safety
///
/// `event` is a live event, destroyed once and not used again.
pub(super) unsafe fn event_destroy(event: hipEvent_t) {
    // SAFETY: the caller's contract.
    unsafe { hipEventDestroy(event) };
}

/// Allocates device memory on the current device.
pub(super) fn malloc(device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    check(device, unsafe { hipMalloc(&mut p, len as usize) })?;
    Ok(p as u64)
}

/// Frees device memory.
///
/// # Safety
///
/// `addr` came from `malloc` and no queued work touches it.
pub(super) unsafe fn free(device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipFree(addr as *mut c_void) })
}

/// Allocates pinned host memory.
pub(super) fn host_malloc(device: DeviceOrdinal, len: u64) -> Result<u64, DeviceError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    check(device, unsafe { hipHostMalloc(&mut p, len as usize, HOST_MALLOC_DEFAULT) })?;
    Ok(p as u64)
}

/// Frees pinned host memory.
///
/// # Safety
///
/// `addr` came from `host_malloc` and no queued work touches it.
pub(super) unsafe fn host_free(device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipHostFree(addr as *mut c_void) })
}

/// Pins and maps host memory for the current device; returns its device alias.
///
/// # Safety
///
/// `addr .. + len` is host memory valid until `host_unregister`.
pub(super) unsafe fn host_register(
    device: DeviceOrdinal,
    addr: u64,
    len: u64,
) -> Result<u64, DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe {
        hipHostRegister(addr as *mut c_void, len as usize, HOST_REGISTER_MAPPED)
    })?;
    let mut alias: *mut c_void = std::ptr::null_mut();
    // SAFETY: `addr` was just registered; `alias` is a valid out-pointer.
    let mapped =
        check(device, unsafe { hipHostGetDevicePointer(&mut alias, addr as *mut c_void, 0) });
    if let Err(e) = mapped {
        // SAFETY: registered just above.
        unsafe { hipHostUnregister(addr as *mut c_void) };
        return Err(e);
    }
    Ok(alias as u64)
}

/// Unpins host memory.
///
/// # Safety
///
/// `addr` was registered and no queued work touches it.
pub(super) unsafe fn host_unregister(device: DeviceOrdinal, addr: u64) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe { hipHostUnregister(addr as *mut c_void) })
}

/// Queues a copy on `stream` (direction inferred from the unified address space).
///
/// # Safety
///
/// As [`DeviceRuntime::copy`](crate::DeviceRuntime::copy); `stream` is live.
pub(super) unsafe fn memcpy_async(
    device: DeviceOrdinal,
    dst: u64,
    src: u64,
    len: u64,
    stream: hipStream_t,
) -> Result<(), DeviceError> {
    // SAFETY: the caller's contract.
    check(device, unsafe {
        hipMemcpyAsync(
            dst as *mut c_void,
            src as *const c_void,
            len as usize,
            MEMCPY_DEFAULT,
            stream,
        )
    })
}

/// Loads a code object on the current device and finds `kernel` in it.
pub(super) fn load_kernel(
    device: DeviceOrdinal,
    code: &[u8],
    kernel: &str,
) -> Result<(hipModule_t, hipFunction_t), DeviceError> {
    let name = CString::new(kernel).map_err(|_| DeviceError::NoDevice(device))?;
    let mut module: hipModule_t = std::ptr::null_mut();
    // SAFETY: `code` is a complete code object from hiprtc, alive for the call (the runtime
    // copies it); `module` is a valid out-pointer.
    check(device, unsafe { hipModuleLoadData(&mut module, code.as_ptr().cast()) })?;
    let mut function: hipFunction_t = std::ptr::null_mut();
    // SAFETY: `module` was loaded above; `name` is NUL-terminated.
    let found =
        check(device, unsafe { hipModuleGetFunction(&mut function, module, name.as_ptr()) });
    if let Err(e) = found {
        // SAFETY: loaded above, unloaded once.
        unsafe { hipModuleUnload(module) };
        return Err(e);
    }
    Ok((module, function))
}

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

/// Launches the gather kernel with `threads` threads per block.
///
/// # Safety
///
/// `function` is the gather kernel loaded on this device; `args` names device buffers holding
/// its table that stay valid until the stream is synchronized; every descriptor names memory
/// the device may access.
pub(super) unsafe fn launch_gather(
    device: DeviceOrdinal,
    function: hipFunction_t,
    stream: hipStream_t,
    threads: u32,
    args: GatherArgs,
) -> Result<(), DeviceError> {
    let (mut d, mut s, mut n) = (args.descs, args.starts, args.count as c_uint);
    let mut params: [*mut c_void; 3] =
        [(&mut d as *mut u64).cast(), (&mut s as *mut u64).cast(), (&mut n as *mut c_uint).cast()];
    // SAFETY: the caller's contract for the kernel's arguments; `params` points at three live
    // locals whose types match the kernel's parameters (two pointers, one unsigned int).
    check(device, unsafe {
        hipModuleLaunchKernel(
            function,
            args.blocks,
            1,
            1,
            threads,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// Destroys a stream and unloads a module, best effort (used when the runtime is dropped).
pub(super) fn release(
    device: DeviceOrdinal,
    stream: Option<hipStream_t>,
    kernel: Option<(hipModule_t, hipFunction_t)>,
) {
    let _ = device;
    if let Some(s) = stream {
        // SAFETY: a live stream from `stream_create`, synchronized by the caller, destroyed once.
        unsafe { hipStreamDestroy(s) };
    }
    if let Some((m, _)) = kernel {
        // SAFETY: a module from `load_kernel`, unloaded once, with no launch in flight.
        unsafe { hipModuleUnload(m) };
    }
}
