//! Simulated device memory: aligned host allocations, and the raw byte moves on them.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use umbp_plan::checksum::crc32c_append;
use umbp_plan::DeviceOrdinal;

use crate::DeviceError;

/// Alignment of simulated device allocations, as a GPU allocator gives at least.
const ALIGN: usize = 256;

/// One simulated device allocation; freed when dropped.
#[derive(Debug)]
pub(super) struct Allocation {
    pub(super) device: DeviceOrdinal,
    pub(super) len: u64,
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the allocation is plain heap memory owned by this value; the pointer is only
// dereferenced under the simulator's lock, or by running work whose footprint keeps `free`
// from dropping the allocation until it ends (see `footprint`).
unsafe impl Send for Allocation {}

impl Allocation {
    /// Allocates `len` zeroed bytes for `device`.
    pub(super) fn new(device: DeviceOrdinal, len: u64) -> Result<Self, DeviceError> {
        let oom = DeviceError::OutOfMemory { device, len };
        let size = usize::try_from(len).map_err(|_| oom.clone())?;
        let layout = Layout::from_size_align(size.max(1), ALIGN).map_err(|_| oom.clone())?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() || len == 0 {
            if !ptr.is_null() {
                // SAFETY: allocated just above with this layout.
                unsafe { dealloc(ptr, layout) };
            }
            return Err(oom);
        }
        Ok(Self { device, len, ptr, layout })
    }

    /// The allocation's address, its simulated device address.
    pub(super) fn addr(&self) -> u64 {
        self.ptr as u64
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated with `layout` in `new` and is freed only here.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// Copies `len` bytes from `src` to `dst` (overlap allowed); with `crc`, first extends it
/// with the source bytes (before the copy, which may overwrite them where they overlap).
///
/// # Safety
///
/// `src .. + len` is readable and `dst .. + len` writable for the duration of the call, and
/// nothing else writes either meanwhile.
pub(super) unsafe fn copy(dst: u64, src: u64, len: u64, crc: Option<&mut u32>) {
    if let (Some(crc), true) = (crc, len > 0) {
        // SAFETY: the caller's contract; not empty, so `src` is non-null.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len as usize) };
        *crc = crc32c_append(*crc, bytes);
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) }
}

/// A copy of `len` bytes at `addr`.
///
/// # Safety
///
/// `addr .. + len` is readable for the duration of the call.
pub(super) unsafe fn read(addr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: the caller's contract; `out` is a fresh buffer of `len` bytes.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len as usize) };
    out
}

/// Sets `len` bytes at `addr` to `byte`.
///
/// # Safety
///
/// `addr .. + len` is writable for the duration of the call.
pub(super) unsafe fn fill(addr: u64, len: u64, byte: u8) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::write_bytes(addr as *mut u8, byte, len as usize) }
}
