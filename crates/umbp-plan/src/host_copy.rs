//! Host memory copies with streaming (non-temporal) stores: the kernel the host-copy engine
//! uses for large segments and the simulated device for large launches, kept here so that
//! each engine crate can use it without depending on another engine.
//!
//! A plain `memcpy` of a few KiB reads each destination cache line before writing it and
//! leaves the copied bytes in the cache; for copies larger than the cache that is wasted
//! traffic, and it evicts what the caller was working on. Non-temporal stores write whole lines
//! straight to memory. glibc's `memcpy` switches to them by itself only above a few MiB per
//! call, so a restore made of many 32 KiB to 1 MiB pieces never gets them from `memcpy`.
//!
//! Non-temporal stores are weakly ordered: whoever publishes the copied bytes (a completion
//! count, a `Release` store, a return to the caller) must call [`store_fence`] first.
//! [`copy_streaming`] does so itself.

#![allow(unsafe_code)] // The SSE2 kernel and the fence; every block says why it holds.

use std::ptr;

/// Whether this CPU has the streaming-store instructions the kernel uses (SSE2 on x86_64,
/// detected at run time; elsewhere none, and the copies are plain).
pub fn non_temporal_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("sse2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Copies `src` onto `dst` with streaming stores, fenced before returning, or with a plain
/// copy where the CPU has none. For one large copy outside an engine, such as a benchmark's
/// ceiling.
///
/// # Panics
///
/// If the two slices differ in length, as [`slice::copy_from_slice`] does.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: slices of different lengths");
    if !non_temporal_supported() {
        dst.copy_from_slice(src);
        return;
    }
    // SAFETY: two distinct slices of equal length: valid for reads and writes, disjoint (one
    // is borrowed mutably) and unshared for the call; SSE2 is present (checked above).
    unsafe { copy_non_temporal(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
    store_fence();
}

/// Orders every non-temporal store this thread made before its later stores. Call it before
/// publishing bytes copied by [`copy_non_temporal`].
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` belongs to SSE, part of every x86_64 CPU; it touches no memory.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Copies `len` bytes from `src` to `dst` with non-temporal stores where the CPU has them
/// (a plain copy elsewhere). The stores are not fenced; see [`store_fence`].
///
/// # Safety
///
/// - `src .. src + len` must be valid for reads and `dst .. dst + len` valid for writes, the two
///   ranges must not overlap, and nothing else may access `dst .. dst + len` during the call
///   (the conditions of [`ptr::copy_nonoverlapping`]);
/// - [`non_temporal_supported`] must have returned `true`.
pub unsafe fn copy_non_temporal(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's conditions are exactly `copy_non_temporal_sse2`'s.
    unsafe {
        copy_non_temporal_sse2(src, dst, len)
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's first condition is `copy_nonoverlapping`'s.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// The SSE2 non-temporal copy: a plain head copy up to the destination's next 16-byte
/// boundary, 64 bytes per iteration of unaligned loads and `movntdq` streaming stores, then 16
/// bytes at a time, then a plain tail copy.
///
/// # Safety
///
/// As [`copy_non_temporal`]: valid, non-overlapping, unshared ranges, and SSE2 present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
unsafe fn copy_non_temporal_sse2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};

    let head = (dst.addr().wrapping_neg() & 15).min(len);
    // SAFETY: `head <= len`, so both ranges are inside the caller's valid, disjoint ranges.
    unsafe { ptr::copy_nonoverlapping(src, dst, head) };
    let mut done = head;
    while len - done >= 64 {
        // SAFETY:
        // 1. bytes `done .. done + 64` lie inside both ranges (loop condition);
        // 2. `dst + done` is 16-byte aligned (the head brought it there and every step adds a
        //    multiple of 16), as `_mm_stream_si128` requires; `_mm_loadu_si128` needs none;
        // 3. SSE2 is present (the caller's condition).
        unsafe {
            let s = src.add(done).cast::<__m128i>();
            let d = dst.add(done).cast::<__m128i>();
            let (a, b) = (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)));
            let (c, e) = (_mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        done += 64;
    }
    while len - done >= 16 {
        // SAFETY: as in the loop above, for bytes `done .. done + 16`.
        unsafe {
            let v = _mm_loadu_si128(src.add(done).cast::<__m128i>());
            _mm_stream_si128(dst.add(done).cast::<__m128i>(), v);
        }
        done += 16;
    }
    // SAFETY: `done <= len`, so the tail lies inside both ranges.
    unsafe { ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copy_matches_copy_nonoverlapping_at_every_size_and_offset() {
        let src: Vec<u8> = (0..6000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut got = vec![0u8; 6000];
        let mut want = vec![0u8; 6000];
        for src_offset in 0..17 {
            for dst_offset in 0..17 {
                for len in (1..5000).step_by(if src_offset + dst_offset == 0 { 1 } else { 37 }) {
                    got.fill(0xEE);
                    want.fill(0xEE);
                    let from = &src[src_offset..src_offset + len];
                    copy_streaming(&mut got[dst_offset..dst_offset + len], from);
                    want[dst_offset..dst_offset + len].copy_from_slice(from);
                    assert!(got == want, "len {len}, offsets {src_offset} -> {dst_offset}");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn slices_of_different_lengths_panic() {
        copy_streaming(&mut [0u8; 3], &[1u8; 4]);
    }
}
