//! The gather kernel, executed on the CPU block by block as the GPU executes `gather.hip`.

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

/// One block's copy, by the kernel's path choice: 16-byte vectors when both addresses are
/// 16-byte aligned, 4-byte words when both are 4-byte aligned, bytes otherwise; the vector and
/// word paths finish the tail bytewise.
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
    let mut i = 0;
    while i < body {
        // SAFETY: `i + width <= body <= n`: inside both ranges (caller's contract). Unaligned
        // reads and writes are used only to keep the code path-agnostic; the addresses are
        // aligned to `width` here.
        unsafe {
            match width {
                16 => (d.add(i) as *mut u128)
                    .write_unaligned((s.add(i) as *const u128).read_unaligned()),
                4 => (d.add(i) as *mut u32)
                    .write_unaligned((s.add(i) as *const u32).read_unaligned()),
                _ => d.add(i).write(s.add(i).read()),
            }
        }
        i += width;
    }
    while i < n {
        // SAFETY: `i < n`: inside both ranges.
        unsafe { d.add(i).write(s.add(i).read()) };
        i += 1;
    }
}
