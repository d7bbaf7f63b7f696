//! Translation of HIP and hiprtc statuses into [`DeviceError`].

use std::ffi::{c_int, CStr};

use umbp_plan::DeviceOrdinal;

use super::ffi::{hipGetErrorString, rtc_message};
use crate::DeviceError;

/// `Ok` for `hipSuccess` (0), otherwise the runtime's code and message. Any integer is a valid
/// status here, including ones newer than this code.
pub(super) fn check(device: DeviceOrdinal, status: c_int) -> Result<(), DeviceError> {
    if status == 0 {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any status (an
    // unknown one reads "unknown error"), or null, handled below.
    let message = unsafe { hipGetErrorString(status) };
    let message = if message.is_null() {
        format!("HIP status {status}")
    } else {
        // SAFETY: non-null, NUL-terminated and static.
        unsafe { CStr::from_ptr(message) }.to_string_lossy().into_owned()
    };
    let code = status;
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
