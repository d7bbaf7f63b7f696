//! The gather kernel, executed on the CPU block by block as a GPU executes `gather.cu`.

use crate::LaunchTable;

/// Runs every block of `table`.
///
/// # Safety
///
/// Every descriptor's source is readable and destination writable for its length, and no
/// destination overlaps a source or another destination.
pub(super) unsafe fn run(table: &LaunchTable) {
    for block in 0..table.blocks() {
        // The kernel's own mapping: find the descriptor, then the slice of it.
        let Some((d, offset, len)) = table.slice_of(block) else { continue };
        // SAFETY: the slice lies inside the descriptor, which the caller vouches for.
        unsafe { copy_slice(d.src + offset, d.dst + offset, len) };
    }
}

/// One block's copy, split as the kernel splits it: a body of 16-byte vectors when both
/// addresses are 16-byte aligned, of 4-byte words when both are 4-byte aligned, of bytes
/// otherwise, then the tail bytewise. The body moves with one `memcpy` here (the bytes are the
/// same whatever the width, and the simulator should not be slower than the copies it is
/// compared with); the tail goes byte by byte, as on the GPU.
///
/// # Safety
///
/// `src .. + len` readable, `dst .. + len` writable, not overlapping.
unsafe fn copy_slice(src: u64, dst: u64, len: u64) {
    let (s, d, n) = (src as *const u8, dst as *mut u8, len as usize);
    let width = match src | dst {
        a if a % 16 == 0 => 16,
        a if a % 4 == 0 => 4,
        _ => 1,
    };
    let body = n - n % width;
    // SAFETY: `body <= n`: inside both ranges, which do not overlap (caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(s, d, body) };
    for i in body..n {
        // SAFETY: `i < n`: inside both ranges.
        unsafe { d.add(i).write(s.add(i).read()) };
    }
}
