//! The ceiling of host copies: the best the machine does with the same bytes and threads.
//!
//! One contiguous buffer copied onto another in equal parts by threads started once (the
//! caller copies the first part), both with `memcpy` and with streaming stores; the faster of
//! the two is the ceiling. Scattered fragments (what an engine copies) can only be slower, so
//! an engine above this ceiling means the ceiling is wrong, not the engine fast.
//!
//! [`GatherCeiling`] is the same for a gather: the very pieces an engine copies (a restore's
//! scattered pages), copied in a plain loop by one thread, both ways. It is the best the
//! machine does with exactly the engine's work, where the contiguous ceiling also counts what
//! the layout costs (each page a cold start for the prefetchers).

use std::hint::black_box;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Barrier;
use std::time::Instant;

use crate::host_buffer::HostBuffer;
use crate::measure::Timed;

/// One of the ceiling's two copies.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum CeilingCopy {
    /// `copy_from_slice` (the platform's `memcpy`).
    Memcpy = 1,
    /// Streaming stores ([`umbp_plan::host_copy::copy_streaming`]).
    Streaming = 2,
}

/// Runs `body` with a ceiling: a function that copies a contiguous buffer of `bytes` onto
/// another in `threads` equal parts, with the copy named, and returns its seconds. The
/// helper threads (`threads - 1`; the caller copies the first part) start here, once, and
/// wait on a barrier between copies, as the engine's pool waits for work: the timing holds
/// the copies and two barrier crossings, no thread start-up.
pub fn with_copy_ceiling(
    bytes: usize,
    threads: usize,
    body: impl FnOnce(&mut dyn FnMut(CeilingCopy) -> f64),
) {
    const EXIT: u8 = 0;
    let (bytes, threads) = (bytes.max(1), threads.max(1));
    let src = HostBuffer::new(bytes, 7);
    let mut dst = HostBuffer::new(bytes, 8);
    let part = bytes.div_ceil(threads).max(1);
    let (start, end) = (Barrier::new(threads), Barrier::new(threads));
    let mode = AtomicU8::new(EXIT);
    let copy = |to: &mut [u8], from: &[u8], mode: u8| {
        if mode == CeilingCopy::Streaming as u8 {
            umbp_plan::host_copy::copy_streaming(to, from);
        } else {
            to.copy_from_slice(from);
        }
    };
    std::thread::scope(|scope| {
        let mut parts = dst.bytes_mut().chunks_mut(part).zip(src.bytes().chunks(part));
        let first = parts.next();
        for (to, from) in parts {
            let (start, end, mode) = (&start, &end, &mode);
            scope.spawn(move || loop {
                start.wait();
                // Relaxed: the barrier orders the caller's store before this load.
                let m = mode.load(Ordering::Relaxed);
                if m == EXIT {
                    return;
                }
                copy(to, from, m);
                end.wait();
            });
        }
        let (to, from) = first.expect("at least one part");
        let mut run = |which: CeilingCopy| {
            let t = Instant::now();
            mode.store(which as u8, Ordering::Relaxed);
            start.wait();
            copy(to, from, which as u8);
            end.wait();
            t.elapsed().as_secs_f64()
        };
        body(&mut run);
        mode.store(EXIT, Ordering::Relaxed);
        start.wait();
    });
    black_box(dst.bytes());
}

/// Both copies' times over the iterations of a comparison.
#[derive(Default, Debug)]
pub struct CeilingSamples {
    memcpy: Vec<f64>,
    streaming: Vec<f64>,
}

impl CeilingSamples {
    /// Runs both copies once through `copy` (from [`with_copy_ceiling`]), keeping their times
    /// when `timed`.
    pub fn run(&mut self, copy: &mut dyn FnMut(CeilingCopy) -> f64, timed: bool) {
        let memcpy = copy(CeilingCopy::Memcpy);
        let streaming = copy(CeilingCopy::Streaming);
        if timed {
            self.memcpy.push(memcpy);
            self.streaming.push(streaming);
        }
    }

    /// The ceiling (the faster copy's figure), which copy it is, and the other's figure.
    pub fn best(&self) -> (Timed, &'static str, Timed) {
        let (memcpy, streaming) = (Timed::of(&self.memcpy), Timed::of(&self.streaming));
        if streaming.median < memcpy.median {
            (streaming, "streaming", memcpy)
        } else {
            (memcpy, "memcpy", streaming)
        }
    }
}

/// A gather's ceiling: `pieces` of `src` (offset, length) copied in order, back to back, into
/// one buffer by the calling thread, with `memcpy` or with streaming stores per piece.
pub struct GatherCeiling<'a> {
    src: &'a [u8],
    pieces: Vec<(usize, usize)>,
    dst: HostBuffer,
}

impl<'a> GatherCeiling<'a> {
    /// A gather of `pieces` of `src`. Panics if a piece lies outside `src`.
    pub fn new(src: &'a [u8], pieces: Vec<(usize, usize)>) -> Self {
        assert!(pieces
            .iter()
            .all(|&(at, len)| at.checked_add(len).is_some_and(|e| e <= src.len())));
        let bytes = pieces.iter().map(|&(_, len)| len).sum::<usize>().max(1);
        Self { src, pieces, dst: HostBuffer::new(bytes, 9) }
    }

    /// Bytes the gather copies.
    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|&(_, len)| len).sum()
    }

    /// Runs the gather once with `which` copy; returns its seconds.
    pub fn copy(&mut self, which: CeilingCopy) -> f64 {
        use umbp_plan::host_copy::{copy_non_temporal, non_temporal_supported, store_fence};
        let stream = which == CeilingCopy::Streaming && non_temporal_supported();
        let dst = self.dst.bytes_mut();
        let t = Instant::now();
        let mut at = 0;
        for &(from, len) in &self.pieces {
            let (to, from) = (&mut dst[at..at + len], &self.src[from..from + len]);
            if stream {
                // SAFETY: two slices of `len` bytes, one borrowed mutably (so valid, disjoint
                // and unshared for the call); the CPU has the instructions (checked above).
                unsafe { copy_non_temporal(from.as_ptr(), to.as_mut_ptr(), len) };
            } else {
                to.copy_from_slice(from);
            }
            at += len;
        }
        if stream {
            // One fence for the whole gather, as an engine fences once per launch.
            store_fence();
        }
        let seconds = t.elapsed().as_secs_f64();
        black_box(self.dst.bytes());
        seconds
    }
}
