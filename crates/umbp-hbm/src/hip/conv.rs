//! Translation of HIP and hiprtc statuses into [`DeviceError`].

use std::ffi::{c_int, CStr};

use hip_runtime_sys as sys;
use umbp_plan::DeviceOrdinal;

use super::ffi::rtc_message;
use crate::DeviceError;

/// `Ok` for `hipSuccess`, otherwise the runtime's code and message.
pub(super) fn check(device: DeviceOrdinal, status: sys::hipError_t) -> Result<(), DeviceError> {
    if status == sys::hipError_t::hipSuccess {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any status.
    let message = unsafe { CStr::from_ptr(sys::hipGetErrorString(status)) };
    let code = status as i32;
    let message = message.to_string_lossy().into_owned();
    Err(match code {
        // hipErrorOutOfMemory and hipErrorMemoryAllocation.
        2 | 1002 => DeviceError::OutOfMemory { device, len: 0 },
        // hipErrorInvalidDevice and hipErrorNoDevice.
        101 | 100 => DeviceError::NoDevice(device),
        _ => DeviceError::Runtime { device, code, message },
    })
}

/// `Ok` for `HIPRTC_SUCCESS`, otherwise hiprtc's message.
pub(super) fn check_rtc(arch: &str, status: c_int) -> Result<(), DeviceError> {
    if status == 0 {
        Ok(())
    } else {
        Err(DeviceError::KernelCompile { arch: arch.into(), log: rtc_message(status) })
    }
}
