//! Host memory that the benchmarks lend to engines: 4 KiB aligned (so `O_DIRECT` reads land in
//! it directly), filled with a seeded pattern, and read or written by the bench only through
//! short-lived slices made from the same pointer that the engines use.

use std::ptr;

use crate::shape::SplitMix;

/// Alignment of every buffer: a page, which also satisfies `O_DIRECT` on 4 KiB block devices.
pub const ALIGN: usize = 4096;

/// A heap buffer of `len` bytes at a 4 KiB-aligned address. See the [module docs](self).
///
/// Lending it to an engine (registering [`as_mut_ptr`](Self::as_mut_ptr)) is the caller's
/// `unsafe` promise that the buffer outlives the endpoint and that [`bytes`](Self::bytes) and
/// [`bytes_mut`](Self::bytes_mut) are not used while a transfer touching it is in flight.
#[derive(Debug)]
pub struct HostBuffer {
    /// The allocation, from `Box::into_raw` of a boxed slice of `alloc_len` bytes.
    base: *mut u8,
    alloc_len: usize,
    /// `base` advanced to the next multiple of [`ALIGN`].
    start: *mut u8,
    len: usize,
}

impl HostBuffer {
    /// `len` bytes of pseudo-random content, a pure function of `seed`. Every page is
    /// written, so no page fault is left for a timed copy to take.
    pub fn new(len: usize, seed: u64) -> Self {
        let mut buffer = Self::zeroed(len);
        let mut rng = SplitMix(seed);
        for word in buffer.bytes_mut().chunks_mut(8) {
            let value = rng.next_u64().to_le_bytes();
            word.copy_from_slice(&value[..word.len()]);
        }
        buffer
    }

    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        let alloc_len = len + ALIGN;
        let base = Box::into_raw(vec![0u8; alloc_len].into_boxed_slice()).cast::<u8>();
        let start = base.wrapping_add(base.align_offset(ALIGN));
        Self { base, alloc_len, start, len }
    }

    /// The buffer's first byte, to register with an engine.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.start
    }

    /// The buffer's address as an endpoint takes it.
    pub fn addr(&self) -> u64 {
        self.start as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for checking a transfer's result once it is done.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `start .. + len` lies inside the live allocation (`align_offset` of a byte
        // pointer is below ALIGN, and the allocation has ALIGN spare bytes); engines only touch
        // it during transfers, which the lending contract keeps apart from this borrow.
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }

    /// The bytes, for writing a pattern or poison between transfers.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only borrow the bench holds.
        unsafe { std::slice::from_raw_parts_mut(self.start, self.len) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        let slice = ptr::slice_from_raw_parts_mut(self.base, self.alloc_len);
        // SAFETY: `base` and `alloc_len` came from `Box::into_raw` of a boxed slice in `zeroed`,
        // and the buffer is freed only here.
        drop(unsafe { Box::from_raw(slice) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_seeded_and_writable() {
        let mut a = HostBuffer::new(10_000, 3);
        let b = HostBuffer::new(10_000, 3);
        assert_eq!(a.addr() % ALIGN as u64, 0);
        assert_eq!(a.bytes(), b.bytes());
        assert_eq!(a.len(), 10_000);
        a.bytes_mut().fill(7);
        assert!(a.bytes().iter().all(|&x| x == 7));
        assert!(HostBuffer::zeroed(0).is_empty());
    }
}
