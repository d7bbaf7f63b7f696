//! Host memory that the benchmarks lend to engines: 4 KiB aligned (so `O_DIRECT` reads land in
//! it directly), filled with a seeded pattern, and read or written by the bench only through
//! short-lived slices made from the same pointer that the engines use.

use umbp_plan::{AlignedBuffer, Endpoint, Register, RegisterError, Registration};

use crate::shape::SplitMix;

/// Alignment of every buffer: a page, which also satisfies `O_DIRECT` on 4 KiB block devices.
pub const ALIGN: usize = AlignedBuffer::DIRECT_IO_ALIGN;

/// A heap buffer of `len` bytes at a 4 KiB-aligned address. See the [module docs](self).
///
/// Lending it to an engine (registering [`as_mut_ptr`](Self::as_mut_ptr) as raw memory) is the
/// caller's `unsafe` promise that the buffer outlives the registration and that
/// [`bytes`](Self::bytes) and [`bytes_mut`](Self::bytes_mut) are not used while a transfer
/// touching it is in flight. (A registration that owns its buffer needs no promise, but the
/// bench reuses one registration across timed runs and checks the bytes between them.)
#[derive(Debug)]
pub struct HostBuffer(AlignedBuffer);

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
        Self(AlignedBuffer::for_direct_io(len))
    }

    /// The buffer's first byte, to register with an engine.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.0.as_mut_ptr()
    }

    /// The buffer's address as an endpoint takes it.
    pub fn addr(&self) -> u64 {
        self.as_mut_ptr() as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes, for checking a transfer's result once it is done.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }

    /// The bytes, for writing a pattern or poison between transfers.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }

    /// Registers the buffer as raw host memory with `registrar` (an engine, a composite).
    ///
    /// # Safety
    ///
    /// The lending contract above: the buffer outlives the registration (declare the
    /// registration after the buffer), and [`bytes`](Self::bytes) and
    /// [`bytes_mut`](Self::bytes_mut) are not used while a transfer touching it runs.
    pub unsafe fn lend(&self, registrar: &impl Register) -> Result<Registration, RegisterError> {
        let endpoint = Endpoint::host(self.addr(), self.len() as u64);
        // SAFETY: the caller keeps the lending contract, which is `register_raw_memory`'s.
        unsafe { registrar.register_raw_memory(endpoint) }
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
