//! An aligned, zero-initialised heap buffer: host memory for `O_DIRECT` files, for pinning by
//! a device runtime, and for registration without `unsafe` (it is [`HostMemory`]).
//!
//! `Vec<u8>` cannot promise an alignment above 1, and `O_DIRECT` reads and writes need their
//! memory aligned to the file's logical block size (4096 on most devices). The standard
//! library has no aligned byte buffer, and the crates that offer one add more than the twenty
//! lines of `unsafe` this needs, so it is written here, once, for every crate of the workspace.
#![allow(unsafe_code)] // The allocation itself; every block says why it holds.

use std::alloc::{self, Layout, LayoutError};
use std::ptr::NonNull;

use crate::register::HostMemory;

/// A heap buffer of `len` bytes whose address is a multiple of `align`, zeroed when made.
///
/// It dereferences to `[u8]`; moving the buffer never moves its bytes, so it can be
/// [registered](crate::Register::register_memory) and handed back unchanged.
///
/// ```
/// use umbp_plan::AlignedBuffer;
///
/// let mut buf = AlignedBuffer::for_direct_io(3 * 4096);
/// buf[..5].copy_from_slice(b"hello");
/// assert_eq!(buf.as_ptr() as usize % 4096, 0);
/// assert_eq!((buf.len(), &buf[..5]), (3 * 4096, &b"hello"[..]));
/// ```
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation exclusively (like `Vec<u8>`), so moving it to another
// thread or sharing `&AlignedBuffer` (which only reads) is as safe as for `Vec<u8>`.
unsafe impl Send for AlignedBuffer {}
// SAFETY: as above; `&AlignedBuffer` gives only `&[u8]`.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// The alignment [`for_direct_io`](Self::for_direct_io) uses: 4096, the logical block size
    /// of almost every disk, and a multiple of the smaller ones.
    pub const DIRECT_IO_ALIGN: usize = 4096;

    /// `len` zero bytes at an address that is a multiple of `align`. Errors when `align` is
    /// not a power of two or the size overflows; aborts like `Vec` when memory runs out.
    pub fn zeroed(len: usize, align: usize) -> Result<Self, LayoutError> {
        // A zero-length buffer still allocates one byte, so its pointer is a real, aligned one.
        let layout = Layout::from_size_align(len.max(1), align)?;
        // SAFETY: `layout` has a non-zero size (above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Ok(Self { ptr, len, layout })
    }

    /// `len` zero bytes aligned for `O_DIRECT` ([`DIRECT_IO_ALIGN`](Self::DIRECT_IO_ALIGN)).
    pub fn for_direct_io(len: usize) -> Self {
        Self::zeroed(len, Self::DIRECT_IO_ALIGN).expect("4096 is a power of two")
    }

    /// The alignment the buffer was made with.
    pub fn align(&self) -> usize {
        self.layout.align()
    }

    /// The first byte as a raw pointer, for registering the buffer as raw memory while keeping
    /// it (to read results between transfers). Every `&[u8]` and `&mut [u8]` the buffer hands
    /// out is made from this same pointer, so borrowing the bytes between transfers does not
    /// invalidate it.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at an allocation of at least `len` bytes owned by `self`, all
        // initialised (zeroed, then written only as bytes), and `&self` rules out a `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl std::fmt::Debug for AlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("align", &self.align())
            .finish()
    }
}

// SAFETY: the bytes live in a heap allocation owned by the buffer, which moving the buffer does
// not move and nothing but `Drop` frees; `as_mut_ptr` and `len` describe exactly that allocation.
unsafe impl HostMemory for AlignedBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        AlignedBuffer::as_mut_ptr(self)
    }

    fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable_at_every_alignment() {
        for align in [1, 8, 512, 4096, 1 << 16] {
            for len in [0, 1, 4095, 4096, 10_000] {
                let mut buf = AlignedBuffer::zeroed(len, align).unwrap();
                assert_eq!(buf.as_ptr() as usize % align, 0, "align {align}");
                assert_eq!(buf.len(), len);
                assert!(buf.iter().all(|&b| b == 0));
                buf.fill(0xa5);
                assert!(buf.iter().all(|&b| b == 0xa5));
            }
        }
        assert!(AlignedBuffer::zeroed(16, 3).is_err(), "3 is not a power of two");
    }
}
