//! An aligned, zero-initialised heap buffer: host memory for `O_DIRECT` files, for pinning by
//! a device runtime, and for registration without `unsafe` (it is [`HostMemory`]).
//!
//! `Vec<u8>` cannot promise an alignment above 1, and `O_DIRECT` reads and writes need their
//! memory aligned to the file's logical block size (4096 on most devices). The standard
//! library has no aligned byte buffer, and the crates that offer one add more than the twenty
//! lines of `unsafe` this needs, so it is written here, once, for every crate of the workspace.
#![allow(unsafe_code)] // The allocation and the mapping; every block says why it holds.

use std::alloc::{self, Layout, LayoutError};
use std::ptr::NonNull;

use crate::register::HostMemory;

/// A buffer of `len` bytes whose address is a multiple of `align`, zeroed when made: a heap
/// allocation, or from 2 MiB up a mapping of its own (see [huge pages](#huge-pages)).
///
/// It dereferences to `[u8]`; moving the buffer never moves its bytes, so it can be
/// [registered](crate::Register::register_memory) and handed back unchanged.
///
/// # Huge pages
///
/// From [`HUGE_PAGE`](Self::HUGE_PAGE) (2 MiB) up, on Linux,
/// [`for_direct_io`](Self::for_direct_io) maps the buffer on its own at a 2 MiB boundary and
/// asks for transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`) before touching it. The kernel then backs it with physically
/// contiguous 2 MiB pages where it can, and a disk read into it is one memory segment per
/// 2 MiB instead of one per 4 KiB page. On this project's 2-vCPU virtual machine that lifted
/// the staged SSD restore (`umbp-bench restore`, 64 KiB pages merged into reads of up to 1 MiB
/// at depth 64) from 0.95–1.43 to 1.50–2.20 GiB/s, in alternating runs, and fio gains there
/// too (64 KiB reads at depth 64: 1.22–1.82 GiB/s into its default buffers, 1.77–2.11 into
/// huge pages). Whether the virtual disk gains from the fewer segments per request or from
/// fewer page walks on its host was not measured. Fewer TLB misses and a cheaper pinning by a
/// GPU runtime come with huge pages anywhere.
///
/// Where transparent huge pages are off (`never` in
/// `/sys/kernel/mm/transparent_hugepage/enabled`) or memory is too fragmented, the buffer keeps
/// 4 KiB pages and works the same. Whole 2 MiB pages are mapped, so a buffer of 2 MiB and one
/// byte takes 4 MiB.
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
    backing: Backing,
}

/// Where an [`AlignedBuffer`]'s bytes live.
#[derive(Copy, Clone, Debug)]
enum Backing {
    /// A heap allocation of this layout.
    Heap(Layout),
    /// A private anonymous mapping of this many bytes (a multiple of
    /// [`AlignedBuffer::HUGE_PAGE`]) at `ptr`.
    #[cfg(target_os = "linux")]
    Mapped(usize),
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
        Ok(Self { ptr, len, backing: Backing::Heap(layout) })
    }

    /// `len` zero bytes aligned for `O_DIRECT` ([`DIRECT_IO_ALIGN`](Self::DIRECT_IO_ALIGN)),
    /// every page already touched. From [`HUGE_PAGE`](Self::HUGE_PAGE) bytes up, on Linux, a
    /// mapping of its own on a 2 MiB boundary with transparent huge pages asked for (see
    /// [huge pages](AlignedBuffer#huge-pages)).
    pub fn for_direct_io(len: usize) -> Self {
        #[cfg(target_os = "linux")]
        if len >= Self::HUGE_PAGE {
            return Self::huge_pages(len);
        }
        Self::zeroed(len, Self::DIRECT_IO_ALIGN).expect("4096 is a power of two")
    }

    /// The size of a huge page on x86_64 and on aarch64 with 4 KiB base pages: the alignment
    /// and the granule of buffers from [`for_direct_io`](Self::for_direct_io) this long or
    /// longer.
    pub const HUGE_PAGE: usize = 2 << 20;

    /// A mapping of `len` bytes (`len >= HUGE_PAGE`) rounded up to whole huge pages, on a huge
    /// page boundary, marked for transparent huge pages, then written with zeros so that the
    /// pages are there (as huge ones where the kernel could) before anyone times a copy.
    #[cfg(target_os = "linux")]
    fn huge_pages(len: usize) -> Self {
        let Ok(layout) = Layout::from_size_align(len, Self::HUGE_PAGE) else {
            panic!("AlignedBuffer: capacity overflow ({len} bytes)");
        };
        // At most `isize::MAX` (a layout's padded size), so the reserve cannot overflow.
        let mapped = layout.pad_to_align().size();
        let reserve = mapped + Self::HUGE_PAGE;
        let (read_write, private) =
            (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
        // SAFETY: an anonymous private mapping at an address the kernel picks: it replaces no
        // existing mapping and touches no memory of ours.
        let raw = unsafe { libc::mmap(std::ptr::null_mut(), reserve, read_write, private, -1, 0) };
        if raw == libc::MAP_FAILED {
            alloc::handle_alloc_error(layout);
        }
        let base = raw.cast::<u8>();
        let head = base.addr().wrapping_neg() % Self::HUGE_PAGE;
        let start = base.wrapping_add(head);
        let tail = reserve - head - mapped;
        // SAFETY: `base .. base + head` and `start + mapped .. start + mapped + tail` are the
        // parts of the fresh mapping outside `start .. start + mapped` (`head + mapped + tail
        // == reserve`); nothing points into them. Unmapping page-aligned parts of a mapping
        // cannot fail but for an invalid range, and a failure would only leave them mapped.
        unsafe {
            if head > 0 {
                libc::munmap(base.cast(), head);
            }
            if tail > 0 {
                libc::munmap(start.add(mapped).cast(), tail);
            }
        }
        // SAFETY: `start .. start + mapped` is our own mapping, not yet touched. The advice
        // changes how the kernel backs it, never its contents; where the kernel has no
        // transparent huge pages it fails with EINVAL and the pages stay 4 KiB, which is fine.
        unsafe { libc::madvise(start.cast(), mapped, libc::MADV_HUGEPAGE) };
        // SAFETY: the mapping is readable and writable for `mapped >= len` bytes and ours alone.
        unsafe { std::ptr::write_bytes(start, 0, mapped) };
        let ptr = NonNull::new(start).expect("a successful mapping is not at address 0");
        Self { ptr, len, backing: Backing::Mapped(mapped) }
    }

    /// The alignment the buffer was made with ([`HUGE_PAGE`](Self::HUGE_PAGE) for a buffer
    /// mapped on its own).
    pub fn align(&self) -> usize {
        match self.backing {
            Backing::Heap(layout) => layout.align(),
            #[cfg(target_os = "linux")]
            Backing::Mapped(_) => Self::HUGE_PAGE,
        }
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
        match self.backing {
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` and is freed only here.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            #[cfg(target_os = "linux")]
            Backing::Mapped(mapped) => {
                // SAFETY: `ptr .. ptr + mapped` is the mapping `huge_pages` made, unmapped only
                // here; no reference into it outlives `self`.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), mapped) };
            }
        }
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

// SAFETY: the bytes live in a heap allocation or a mapping owned by the buffer, which moving the
// buffer does not move and nothing but `Drop` frees; `as_mut_ptr` and `len` describe exactly that allocation.
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

    /// Around the huge-page threshold: below it a 4 KiB-aligned heap buffer, from it on Linux
    /// a 2 MiB-aligned mapping; zeroed, writable to its last byte, freed on drop (many times
    /// over, so a leak or a double unmap would show under valgrind and in the address space).
    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot unmap part of a mapping, which a huge-page buffer does")]
    fn direct_io_buffers_around_the_huge_page_threshold() {
        let huge = AlignedBuffer::HUGE_PAGE;
        for round in 0..20 {
            for len in [huge - 1, huge, huge + 1, 5 * huge + 123] {
                let mut buf = AlignedBuffer::for_direct_io(len);
                let want_align = if cfg!(target_os = "linux") && len >= huge {
                    huge
                } else {
                    AlignedBuffer::DIRECT_IO_ALIGN
                };
                assert_eq!(buf.align(), want_align, "len {len}");
                assert_eq!(buf.as_ptr() as usize % want_align, 0, "len {len}");
                assert_eq!(buf.len(), len);
                if round == 0 {
                    assert!(buf.iter().all(|&b| b == 0), "len {len}");
                }
                buf[0] = 1;
                buf[len - 1] = 2;
                assert_eq!((buf[0], buf[len - 1]), (1, 2));
            }
        }
    }

    /// The mapping carries the kernel's huge-page advice (`hg` in its `VmFlags`), wherever the
    /// kernel has transparent huge pages at all. Whether it got huge pages depends on the
    /// machine's memory, so that is printed, not asserted.
    #[test]
    #[cfg(target_os = "linux")]
    #[cfg_attr(miri, ignore = "Miri cannot unmap part of a mapping, which a huge-page buffer does")]
    fn large_direct_io_buffers_ask_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("skipped: this kernel has no transparent huge pages");
            return;
        }
        let buf = AlignedBuffer::for_direct_io(8 << 20);
        let start = buf.as_ptr() as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut lines = smaps.lines().skip_while(|line| {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((from, to)) = range.split_once('-') else { return true };
            let parse = |x| usize::from_str_radix(x, 16).unwrap_or(0);
            !(parse(from) <= start && start < parse(to))
        });
        let header = lines.next().expect("a mapping holds the buffer");
        let fields: Vec<&str> = lines.take_while(|l| l.contains(':')).collect();
        let flags = fields.iter().find(|l| l.starts_with("VmFlags:")).expect("VmFlags line");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "{header}: {flags}");
        let huge = fields.iter().find(|l| l.starts_with("AnonHugePages:"));
        eprintln!("{header}: {}", huge.copied().unwrap_or("AnonHugePages: not reported"));
    }
}
