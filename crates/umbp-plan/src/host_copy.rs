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
//!
//! # Four 4 KiB runs at once
//!
//! Copying one run of bytes front to back, even with streaming stores, leaves a thread well
//! below what the memory gives it: the hardware prefetcher does not cross a 4 KiB page, so it
//! starts cold at every page, and one run keeps too few lines in flight to hide the memory's
//! latency. glibc's large `memcpy` (above its non-temporal threshold) therefore copies four
//! 4 KiB runs interleaved, a few lines from each in turn. Where the CPU has AVX2, [`copy_non_temporal`] does the same for every whole 16 KiB
//! of a copy. Measured on a 2-vCPU Xeon VM, one thread, 1 GiB copied as 64 KiB pieces taken
//! from random places of a 2 GiB pool, against one contiguous 1 GiB `memcpy` (11.0–11.5 GiB/s):
//!
//! | copy of each piece | GiB/s | of the contiguous `memcpy` |
//! |---|---|---|
//! | `memcpy` | 6.3–6.5 | 0.57 |
//! | SSE2 streaming stores, front to back (this kernel's first version) | 7.8–7.9 | 0.70 |
//! | AVX2 streaming stores, four runs interleaved, prefetching 512 bytes ahead | 9.3–10.4 | 0.83–0.91 |
//!
//! `umbp-bench restore`'s DRAM restore into the simulated device, which streams its slices
//! through this kernel, went from 7.5–7.7 to 9.7–10.0 GiB/s. Eight runs, two or four vectors
//! per run and step, AVX-512, prefetching 256 or 768 bytes ahead, and prefetching the next
//! piece's start all stayed inside those figures' spread. AVX2 rather than AVX-512 also keeps
//! the kernel inside what valgrind's memcheck emulates.
//!
//! # Hashing while copying
//!
//! [`copy_non_temporal_crc`] copies the same way and returns the CRC32C of the bytes it
//! copied. Hashing after the copy reads every byte from memory a second time: on a restore far
//! larger than the cache that doubles the memory traffic. Here each run keeps its own `crc32`
//! chain, fed from the bytes just loaded, and a block's four chains are joined by shifting over
//! 4 KiB (a table lookup per byte of the register). Measured on the same VM, one thread,
//! 512 MiB copied as 64 KiB pieces from random places of a 1 GiB pool, taking turns over six
//! rounds, twice: the copy alone 7.8–8.1 GiB/s, the copy hashing as it goes 7.5–7.6 (+4.7 %
//! and +6.8 % of the copy's time), the copy then the `crc32c` crate over the source 5.1–5.2
//! (+51 % and +61 %). Each call starts its chains afresh and joins them per block: in calls of
//! 64 KiB the hashing cost +3 to +5 % of the copy, in calls of 32 KiB +10 %, so callers hash
//! whole pieces rather than slices of them.

#![allow(unsafe_code)] // The SSE2 and AVX2 kernels and the fence; every block says why it holds.

use std::ptr;

use crate::checksum::crc32c_append;
#[cfg(target_arch = "x86_64")]
use crate::checksum::ShiftTables;

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
/// (a plain copy elsewhere). The stores are not fenced; see [`store_fence`]. From 16 KiB up,
/// on CPUs with AVX2, four 4 KiB runs at a time (see the [module docs](self)).
///
/// # Safety
///
/// - `src .. src + len` must be valid for reads and `dst .. dst + len` valid for writes, the two
///   ranges must not overlap, and nothing else may access `dst .. dst + len` during the call
///   (the conditions of [`ptr::copy_nonoverlapping`]);
/// - [`non_temporal_supported`] must have returned `true`.
pub unsafe fn copy_non_temporal(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= INTERLEAVED_BLOCK && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the caller's conditions, and AVX2 is present (checked just now).
        unsafe { copy_non_temporal_avx2(src, dst, len) }
    } else {
        // SAFETY: the caller's conditions are exactly `copy_non_temporal_sse2`'s.
        unsafe { copy_non_temporal_sse2(src, dst, len) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's first condition is `copy_nonoverlapping`'s.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, len)
    }
}

/// Copies `src` onto `dst` as [`copy_streaming`] does, and returns `crc` extended with the
/// copied bytes (`crc32c_append(crc, src)`): the CRC32C is computed from the bytes as they
/// pass through the registers, one read of the source for both (see the
/// [module docs](self#hashing-while-copying)).
///
/// # Panics
///
/// If the two slices differ in length.
pub fn copy_streaming_crc(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_streaming_crc: slices of different lengths");
    if !non_temporal_supported() {
        dst.copy_from_slice(src);
        return crc32c_append(crc, src);
    }
    // SAFETY: as in `copy_streaming`: two distinct slices of equal length, SSE2 present.
    let crc = unsafe { copy_non_temporal_crc(src.as_ptr(), dst.as_mut_ptr(), src.len(), crc) };
    store_fence();
    crc
}

/// [`copy_non_temporal`], returning `crc` extended with the copied bytes: from 16 KiB up, on
/// CPUs with AVX2 and SSE 4.2, hashed in the copy loop; otherwise copied, then hashed.
///
/// # Safety
///
/// As [`copy_non_temporal`].
pub unsafe fn copy_non_temporal_crc(src: *const u8, dst: *mut u8, len: usize, crc: u32) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if len >= INTERLEAVED_BLOCK
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("sse4.2")
    {
        // SAFETY: the caller's conditions, and AVX2 and SSE 4.2 are present (checked just now).
        return unsafe { copy_non_temporal_avx2_crc(src, dst, len, crc) };
    }
    // SAFETY: the caller's conditions are `copy_non_temporal`'s.
    unsafe { copy_non_temporal(src, dst, len) };
    // SAFETY: `src .. src + len` is valid for reads and nothing writes it during the call (the
    // caller's conditions; `dst` does not overlap it).
    crc32c_append(crc, unsafe { slice_or_empty(src, len) })
}

/// `len` bytes at `src` as a slice; an empty one when `len` is 0 (whatever `src` is).
///
/// # Safety
///
/// When `len > 0`, `src .. src + len` is valid for reads and not written while the slice lives.
unsafe fn slice_or_empty<'a>(src: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's condition; `len > 0`, so `src` is non-null.
    unsafe { std::slice::from_raw_parts(src, len) }
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

/// Bytes of one run of the interleaved kernel: the hardware prefetcher's range, a 4 KiB page.
const RUN: usize = 4096;

/// Runs the interleaved kernel copies at once.
const RUNS: usize = 4;

/// The interleaved kernel's unit: [`RUNS`] runs side by side. Shorter copies take the SSE2
/// kernel.
const INTERLEAVED_BLOCK: usize = RUN * RUNS;

/// Bytes each run moves per step: four 32-byte vectors, two cache lines. With [`RUNS`] runs a
/// step holds 16 vectors, every AVX2 register.
const STEP: usize = 128;

/// How far ahead of its loads each run prefetches (256 and 768 bytes were no faster, 1,024
/// slower).
const PREFETCH_AHEAD: usize = 512;

/// The AVX2 kernel: a plain head copy up to the destination's next 32-byte boundary, then
/// blocks of [`RUNS`] × [`RUN`] bytes, each block's runs copied side by side [`STEP`] bytes at a
/// time with unaligned loads and `vmovntdq` streaming stores, then the rest through the SSE2
/// kernel. See the [module docs](self) for why.
///
/// # Safety
///
/// As [`copy_non_temporal`]: valid, non-overlapping, unshared ranges; and AVX2 present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_non_temporal_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_setzero_si256, _mm256_stream_si256, _mm_prefetch,
        _MM_HINT_T0,
    };

    let head = (dst.addr().wrapping_neg() & 31).min(len);
    // SAFETY: `head <= len`, so both ranges are inside the caller's valid, disjoint ranges.
    unsafe { ptr::copy_nonoverlapping(src, dst, head) };
    let mut done = head;
    while len - done >= INTERLEAVED_BLOCK {
        for at in (0..RUN).step_by(STEP) {
            let mut v = [[_mm256_setzero_si256(); 4]; RUNS];
            for (run, vectors) in v.iter_mut().enumerate() {
                let from = done + run * RUN + at;
                // Prefetching is a hint that never faults and has no effect the program can
                // observe, so its address (which may lie past the source at the last block) is
                // computed with wrapping arithmetic and needs no validity.
                let ahead = src.wrapping_add(from + PREFETCH_AHEAD).cast::<i8>();
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
                let s = src.wrapping_add(from).cast::<__m256i>();
                for (i, vector) in vectors.iter_mut().enumerate() {
                    // SAFETY: bytes `from .. from + STEP` lie inside the source: the block
                    // `done .. done + INTERLEAVED_BLOCK` does (loop condition), `run < RUNS`
                    // and `at + STEP <= RUN`; `_mm256_loadu_si256` needs no alignment.
                    *vector = unsafe { _mm256_loadu_si256(s.add(i)) };
                }
            }
            for (run, vectors) in v.iter().enumerate() {
                let d = dst.wrapping_add(done + run * RUN + at).cast::<__m256i>();
                for (i, vector) in vectors.iter().enumerate() {
                    // SAFETY:
                    // 1. the same bytes of the destination, inside it for the same reasons;
                    // 2. `dst + done` is 32-byte aligned (the head brought it there, and every
                    //    offset added since is a multiple of 32), as `_mm256_stream_si256`
                    //    requires.
                    unsafe { _mm256_stream_si256(d.add(i), *vector) };
                }
            }
        }
        done += INTERLEAVED_BLOCK;
    }
    // SAFETY: `done <= len`: the rest lies inside both ranges; SSE2 is part of AVX2.
    unsafe { copy_non_temporal_sse2(src.add(done), dst.add(done), len - done) };
}

/// The AVX2 kernel with four CRC32C chains beside it: the same head, blocks and rest as
/// [`copy_non_temporal_avx2`], and while each run's bytes are loaded the `crc32` instruction
/// hashes them into that run's chain (eight bytes an instruction; the bytes were just loaded,
/// so its reads hit the first-level cache). A block's four chains are joined in order by
/// shifting over 4 KiB ([`ShiftTables`]); the head and the rest are hashed after their copy.
///
/// # Safety
///
/// As [`copy_non_temporal`]: valid, non-overlapping, unshared ranges; and AVX2 and SSE 4.2
/// present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,sse4.2")]
unsafe fn copy_non_temporal_avx2_crc(src: *const u8, dst: *mut u8, len: usize, crc: u32) -> u32 {
    use std::arch::x86_64::{
        __m256i, _mm256_loadu_si256, _mm256_setzero_si256, _mm256_stream_si256, _mm_crc32_u64,
        _mm_prefetch, _MM_HINT_T0,
    };

    let page = ShiftTables::page();
    let head = (dst.addr().wrapping_neg() & 31).min(len);
    // SAFETY: `head <= len`, so both ranges are inside the caller's valid, disjoint ranges.
    unsafe { ptr::copy_nonoverlapping(src, dst, head) };
    // SAFETY: the head lies inside the source, which nothing writes during the call.
    let crc = crc32c_append(crc, unsafe { slice_or_empty(src, head) });
    // The raw register: CRC32C's pre- and post-inversion are undone around the chains.
    let mut register = !crc;
    let mut done = head;
    while len - done >= INTERLEAVED_BLOCK {
        let mut chains = [u64::from(register), 0, 0, 0];
        for at in (0..RUN).step_by(STEP) {
            let mut v = [[_mm256_setzero_si256(); 4]; RUNS];
            for (run, vectors) in v.iter_mut().enumerate() {
                let from = done + run * RUN + at;
                // Prefetch hints never fault: see `copy_non_temporal_avx2`.
                let ahead = src.wrapping_add(from + PREFETCH_AHEAD).cast::<i8>();
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64));
                let s = src.wrapping_add(from);
                for (i, vector) in vectors.iter_mut().enumerate() {
                    // SAFETY: bytes `from .. from + STEP` lie inside the source (as in
                    // `copy_non_temporal_avx2`); no alignment needed.
                    *vector = unsafe { _mm256_loadu_si256(s.cast::<__m256i>().add(i)) };
                }
                let words = s.cast::<u64>();
                let mut chain = chains[run];
                for i in 0..STEP / 8 {
                    // SAFETY: the same bytes, read as unaligned words.
                    chain = _mm_crc32_u64(chain, unsafe { words.add(i).read_unaligned() });
                }
                chains[run] = chain;
            }
            for (run, vectors) in v.iter().enumerate() {
                let d = dst.wrapping_add(done + run * RUN + at).cast::<__m256i>();
                for (i, vector) in vectors.iter().enumerate() {
                    // SAFETY: as in `copy_non_temporal_avx2`: inside the destination, and
                    // `dst + done` is 32-byte aligned.
                    unsafe { _mm256_stream_si256(d.add(i), *vector) };
                }
            }
        }
        // The block's register: each chain's shifted over the 4 KiB that follow it, joined.
        // The instruction keeps the register in the low 32 bits.
        register = chains[0] as u32;
        for &chain in &chains[1..] {
            register = page.shift(register) ^ chain as u32;
        }
        done += INTERLEAVED_BLOCK;
    }
    let rest = len - done;
    // SAFETY: `done <= len`: the rest lies inside both ranges; SSE2 is part of AVX2.
    unsafe { copy_non_temporal_sse2(src.add(done), dst.add(done), rest) };
    // SAFETY: the rest lies inside the source, which nothing writes during the call.
    crc32c_append(!register, unsafe { slice_or_empty(src.add(done), rest) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "Miri does not implement non-temporal stores (movntdq, vmovntdq)")]
    fn streaming_copy_matches_copy_nonoverlapping_at_every_size_and_offset() {
        let src: Vec<u8> = (0..6000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut scratch = Scratch::new(6000);
        for src_offset in 0..17 {
            for dst_offset in 0..17 {
                for len in (1..5000).step_by(if src_offset + dst_offset == 0 { 1 } else { 37 }) {
                    scratch.check(&src, (src_offset, len), dst_offset);
                }
            }
        }
    }

    /// A destination buffer, copied into at an offset by `copy_streaming` and by
    /// `copy_from_slice` side by side; the two must agree on every byte, the untouched ones
    /// around the copy included.
    struct Scratch {
        got: Vec<u8>,
        want: Vec<u8>,
    }

    impl Scratch {
        fn new(len: usize) -> Self {
            Self { got: vec![0; len], want: vec![0; len] }
        }

        /// Copies `src[src_offset..][..len]` to offset `dst_offset` both ways and compares.
        fn check(&mut self, src: &[u8], (src_offset, len): (usize, usize), dst_offset: usize) {
            let (got, want) = (&mut self.got, &mut self.want);
            got.fill(0xEE);
            want.fill(0xEE);
            let from = &src[src_offset..src_offset + len];
            copy_streaming(&mut got[dst_offset..dst_offset + len], from);
            want[dst_offset..dst_offset + len].copy_from_slice(from);
            assert!(got == want, "len {len}, offsets {src_offset} -> {dst_offset}");
        }
    }

    /// Lengths around the interleaved kernel's block, at every destination alignment modulo 32
    /// and a few source ones: whole blocks, a block and a byte short or over, blocks plus an
    /// odd tail, and pseudo-random lengths up to 96 KiB. The bytes around the destination must
    /// stay untouched.
    #[test]
    #[cfg_attr(miri, ignore = "Miri does not implement non-temporal stores (movntdq, vmovntdq)")]
    fn interleaved_copy_matches_copy_nonoverlapping_around_whole_blocks() {
        const MAX: usize = 96 << 10;
        let src: Vec<u8> = (0..MAX as u32 + 64).map(|i| (i * 13 + i / 4099) as u8).collect();
        let mut scratch = Scratch::new(MAX + 64);
        let block = INTERLEAVED_BLOCK;
        let mut lengths = vec![block - 1, block, block + 1, 2 * block + 31, 3 * block + 4097];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        lengths.extend((0..8).map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            block + (seed % (MAX - block) as u64) as usize
        }));
        for &len in &lengths {
            for dst_offset in 0..33 {
                for src_offset in [0, 1, 16, 33] {
                    scratch.check(&src, (src_offset, len), dst_offset);
                }
            }
        }
    }

    /// The SSE2 kernel, which CPUs without AVX2 use for long copies too.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(miri, ignore = "Miri does not implement non-temporal stores (movntdq, vmovntdq)")]
    fn sse2_kernel_copies_long_runs_exactly() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 31 + i / 257) as u8).collect();
        for (len, offset) in [(INTERLEAVED_BLOCK, 0), (65_536 + 17, 5), (69_000, 31)] {
            let mut got = vec![0xEEu8; len + offset + 1];
            // SAFETY: `src[offset..]` holds `len` bytes and `got[offset..]` `len + 1`; two
            // distinct vectors; SSE2 is part of every x86_64 CPU.
            unsafe {
                copy_non_temporal_sse2(src[offset..].as_ptr(), got[offset..].as_mut_ptr(), len)
            };
            store_fence();
            assert_eq!(&got[offset..offset + len], &src[offset..offset + len], "len {len}");
            assert!(got[..offset].iter().chain(&got[offset + len..]).all(|&b| b == 0xEE));
        }
    }

    /// The hashing copy copies exactly what the plain one does and returns the `crc32c`
    /// crate's CRC of the bytes, appended to the CRC given: around whole blocks, at every
    /// destination alignment modulo 32, from a few source offsets.
    #[test]
    #[cfg_attr(miri, ignore = "Miri does not implement non-temporal stores (movntdq, vmovntdq)")]
    fn hashing_copy_returns_the_crc_of_what_it_copied() {
        const MAX: usize = 80 << 10;
        let src: Vec<u8> = (0..MAX as u32 + 64).map(|i| (i * 29 + i / 4093) as u8).collect();
        let block = INTERLEAVED_BLOCK;
        let lengths = [0, 1, 4095, block - 1, block, block + 1, 2 * block + 31, 4 * block + 4097];
        let mut got = vec![0u8; MAX + 64];
        for &len in &lengths {
            for dst_offset in [0, 1, 7, 31, 32] {
                for (src_offset, prior) in [(0, 0), (1, 0xdead_beef), (33, 7)] {
                    got.fill(0xEE);
                    let from = &src[src_offset..src_offset + len];
                    let crc =
                        copy_streaming_crc(&mut got[dst_offset..dst_offset + len], from, prior);
                    assert_eq!(crc, crc32c::crc32c_append(prior, from), "len {len}");
                    assert_eq!(&got[dst_offset..dst_offset + len], from, "len {len}");
                    let around = got[..dst_offset].iter().chain(&got[dst_offset + len..]);
                    assert!(around.into_iter().all(|&b| b == 0xEE), "len {len}");
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
