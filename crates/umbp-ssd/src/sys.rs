//! Every system call and every raw-memory access of the crate, except the ring's queue pushes
//! (in `ring.rs`) and the fallback's calls of [`perform`] (in `fallback.rs`). A leaf: it knows
//! nothing of batches or executors.
//!
//! # The request invariant
//!
//! A [`Request`] names `len` bytes at `buf` that the kernel reads (a write request) or fills (a
//! read request). Requests are made only by [`HostSlice::request`] and [`BounceBuf::request`],
//! and their bytes stay valid while both of these hold:
//!
//! 1. the batch that made the request has not settled. A [`HostSlice`] lies inside a host
//!    endpoint of an [`EndpointTable`], and such an endpoint exists only through the `unsafe`
//!    [`EndpointRegistry::register`](umbp_plan::EndpointRegistry::register), whose contract
//!    keeps the memory valid, and untouched by anything else, until every transfer handle that
//!    used it has been waited on. A handle's wait returns only after its batch settled;
//! 2. the [`BounceBuf`] a request points into is neither dropped, reused, nor read or written
//!    by Rust code until the request completes. The op owning the buffer leaves it alone
//!    between issuing a request and receiving its completion, and keeps it until it is done.
//!
//! The executors keep every batch with a request in flight: `fallback::run` holds it
//! mutably borrowed, and `Ring::serve` holds it in one of its lanes, which it drops only after
//! every request it pushed has completed (also when unwinding). So neither the op nor its
//! buffer can go away under the kernel.

use std::alloc::{self, Layout};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use umbp_plan::{EndpointId, EndpointTable};

/// Whether the kernel reads from the file into memory or writes memory to the file.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Dir {
    /// File to memory (a restore).
    Read,
    /// Memory to file (an offload).
    Write,
}

/// One read or write the kernel performs: `len` bytes at file `offset` of `fd`, from or into
/// `buf`. See the module docs for how long `buf` stays valid.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Request {
    fd: RawFd,
    dir: Dir,
    offset: u64,
    buf: *mut u8,
    len: u32,
}

impl Request {
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
    }

    pub(crate) fn dir(&self) -> Dir {
        self.dir
    }

    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    pub(crate) fn buf(&self) -> *mut u8 {
        self.buf
    }

    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// The first `len` bytes of this request (at most all of them), for tests that make every
    /// transfer come back short.
    #[cfg(test)]
    pub(crate) fn prefix(mut self, len: u32) -> Self {
        self.len = self.len.min(len);
        self
    }
}

/// A bounds-checked piece of registered host memory, addressed without ever forming a Rust
/// reference to it (the kernel may be writing other pieces of the same endpoint).
#[derive(Debug)]
pub(crate) struct HostSlice {
    ptr: *mut u8,
    len: usize,
}

impl HostSlice {
    /// Bytes `offset .. offset + len` of endpoint `id` of `table`, if it is host memory and
    /// holds them. Host endpoints of a table were registered through `EndpointRegistry::register`,
    /// whose contract makes the bytes valid (see the module docs).
    pub(crate) fn lookup(
        table: &EndpointTable,
        id: EndpointId,
        offset: u64,
        len: u64,
    ) -> Option<Self> {
        let endpoint = table.get(id)?;
        if !endpoint.is_host() || !endpoint.contains(offset, len) {
            return None;
        }
        let addr = usize::try_from(endpoint.addr().checked_add(offset)?).ok()?;
        let len = usize::try_from(len).ok()?;
        addr.checked_add(len)?;
        Some(Self { ptr: std::ptr::with_exposed_provenance_mut(addr), len })
    }

    /// Bytes `at .. at + len` of this slice.
    pub(crate) fn sub(&self, at: usize, len: usize) -> Self {
        assert!(
            at.checked_add(len).is_some_and(|end| end <= self.len),
            "host sub-slice out of range"
        );
        Self { ptr: self.ptr.wrapping_add(at), len }
    }

    /// The address of the first byte, for alignment checks.
    pub(crate) fn addr(&self) -> usize {
        self.ptr.addr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// A request moving bytes `at .. at + len` of this slice to or from `offset` of `fd`.
    pub(crate) fn request(&self, fd: RawFd, dir: Dir, offset: u64, at: usize, len: u32) -> Request {
        assert!(
            at.checked_add(len as usize).is_some_and(|end| end <= self.len),
            "host request out of range"
        );
        Request { fd, dir, offset, buf: self.ptr.wrapping_add(at), len }
    }

    /// Copies `bytes` into the slice at `at`.
    pub(crate) fn write_at(&self, at: usize, bytes: &[u8]) {
        assert!(
            at.checked_add(bytes.len()).is_some_and(|end| end <= self.len),
            "host write out of range"
        );
        // SAFETY:
        // 1. `at + bytes.len() <= self.len`, so the destination lies inside the slice, which lies
        //    inside registered host memory valid for writes (module invariant, point 1);
        // 2. `bytes` is Rust memory we borrow, so it cannot overlap caller memory the kernel or
        //    the caller own for this transfer.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(at), bytes.len()) };
    }

    /// Copies bytes of the slice starting at `at` into `out`.
    pub(crate) fn read_at(&self, at: usize, out: &mut [u8]) {
        assert!(
            at.checked_add(out.len()).is_some_and(|end| end <= self.len),
            "host read out of range"
        );
        // SAFETY:
        // 1. `at + out.len() <= self.len`, so the source lies inside the slice, which lies inside
        //    registered host memory valid for reads (module invariant, point 1);
        // 2. `out` is Rust memory we borrow mutably, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), out.as_mut_ptr(), out.len()) };
    }
}

/// An aligned, zero-initialised heap buffer the engine reads into or writes from when a piece
/// of an `O_DIRECT` transfer is not aligned to the file's block size.
#[derive(Debug)]
pub(crate) struct BounceBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl BounceBuf {
    /// A zeroed buffer of `capacity` bytes aligned to `align` (a power of two).
    pub(crate) fn new(capacity: usize, align: usize) -> Self {
        let layout = Layout::from_size_align(capacity.max(1), align)
            .expect("bounce buffer sizes are bounded by the engine's maximum segment");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else { alloc::handle_alloc_error(layout) };
        Self { ptr, layout }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.layout.size()
    }

    pub(crate) fn align(&self) -> usize {
        self.layout.align()
    }

    /// The buffer's bytes. Only while no request into it is in flight (module invariant).
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `capacity` initialised (zeroed, then only ever written
        // as bytes) bytes, owned by `self`; no request is in flight (the caller's obligation
        // under the module invariant), so nothing writes them meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.capacity()) }
    }

    /// The buffer's bytes, mutably. Only while no request into it is in flight.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity()) }
    }

    /// A request moving bytes `range` of this buffer to or from `offset` of `fd`.
    pub(crate) fn request(
        &mut self,
        fd: RawFd,
        dir: Dir,
        offset: u64,
        range: std::ops::Range<usize>,
    ) -> Request {
        assert!(range.start <= range.end && range.end <= self.capacity(), "bounce range");
        let len = u32::try_from(range.len()).expect("bounce requests fit in u32");
        Request { fd, dir, offset, buf: self.ptr.as_ptr().wrapping_add(range.start), len }
    }
}

impl Drop for BounceBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed only here.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Performs `request` synchronously; returns the byte count or a negated errno, like an
/// io_uring completion.
///
/// # Safety
///
/// `request.buf .. + request.len` must be valid for the access (writable for a read, readable
/// for a write) for the duration of the call.
pub(crate) unsafe fn perform(request: &Request) -> i32 {
    let Ok(offset) = libc::off_t::try_from(request.offset) else {
        return -libc::EINVAL;
    };
    let len = request.len as usize;
    let done = match request.dir {
        // SAFETY: the buffer is valid for `len` writable bytes (the caller's obligation).
        Dir::Read => unsafe { libc::pread(request.fd, request.buf.cast(), len, offset) },
        // SAFETY: the buffer is valid for `len` readable bytes (the caller's obligation).
        Dir::Write => unsafe { libc::pwrite(request.fd, request.buf.cast(), len, offset) },
    };
    if done < 0 {
        -last_errno()
    } else {
        // Requests are at most 1 GiB, so the count fits.
        i32::try_from(done).unwrap_or(i32::MAX)
    }
}

/// CPUs a `cpu_set_t` can name ([`pin_current_thread`]).
pub(crate) const MAX_CPUS: usize = libc::CPU_SETSIZE as usize;

/// Restricts the calling thread to run on `cpu` only. Fails with `EINVAL` for a CPU of
/// [`MAX_CPUS`] or more, or one that is offline or outside the process's allowed CPUs.
pub(crate) fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= MAX_CPUS {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: `cpu_set_t` is a plain bit array, valid all zeros; `CPU_SET` writes bit `cpu`,
    // inside the set because `cpu < CPU_SETSIZE` (checked above); `sched_setaffinity` reads
    // `size_of::<cpu_set_t>()` bytes of the set, which is exactly its size, and pid 0 names the
    // calling thread.
    let result = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set)
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn last_errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    let mut stat = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `stat` is a valid out-pointer for one `struct stat`; a bad `fd` fails with EBADF.
    if unsafe { libc::fstat(fd, stat.as_mut_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstat succeeded, so it filled the whole structure.
    Ok(unsafe { stat.assume_init() })
}

/// The identity of the file `fd` names, whatever the descriptor: `(st_dev, st_ino)`, or for a
/// block device `(st_rdev, u64::MAX)` (the device itself, whichever node opened it).
pub(crate) fn file_identity(fd: RawFd) -> io::Result<(u64, u64)> {
    let stat = fstat(fd)?;
    Ok(if stat.st_mode & libc::S_IFMT == libc::S_IFBLK {
        (stat.st_rdev, u64::MAX)
    } else {
        (stat.st_dev, stat.st_ino)
    })
}

/// An eventfd: a counter that other threads bump to wake a thread (or a ring) reading it.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new counter at zero. Blocking (a ring's read of it waits for a bump).
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointer; it returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor just opened and owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Adds one to the counter, waking its reader. Never blocks: the counter's reader resets
    /// it, and it would have to reach 2^64 - 2 first.
    pub(crate) fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: the buffer is 8 valid bytes, which is what an eventfd write takes.
        let _ = unsafe { libc::write(self.fd(), one.as_ptr().cast(), one.len()) };
    }
}

/// The file status flags of `fd` (`O_DIRECT`, the access mode, ...).
pub(crate) fn status_flags(fd: RawFd) -> io::Result<i32> {
    // SAFETY: F_GETFL takes no argument and touches no memory of ours.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(flags)
    }
}

/// The size of the regular file or block device `fd`; `None` for other kinds.
pub(crate) fn file_size(fd: RawFd) -> io::Result<Option<u64>> {
    let stat = fstat(fd)?;
    match stat.st_mode & libc::S_IFMT {
        libc::S_IFREG => Ok(u64::try_from(stat.st_size).ok()),
        libc::S_IFBLK => {
            let mut size: u64 = 0;
            // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
            let rc = unsafe { libc::ioctl(fd, libc::_IOR::<u64>(0x12, 114), &mut size) };
            if rc < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(Some(size))
            }
        }
        _ => Ok(None),
    }
}

/// The alignment `O_DIRECT` transfers on `fd` need, for file offsets, lengths and memory:
/// `BLKSSZGET` on a block device; `statx`'s direct-I/O alignments where the kernel reports them;
/// otherwise 4096.
pub(crate) fn logical_block_size(fd: RawFd) -> u64 {
    const UNKNOWN: u64 = 4096;
    let Ok(stat) = fstat(fd) else { return UNKNOWN };
    if stat.st_mode & libc::S_IFMT == libc::S_IFBLK {
        let mut size: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
        let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut size) };
        return match u64::try_from(size) {
            Ok(size) if rc == 0 && size.is_power_of_two() => size,
            _ => UNKNOWN,
        };
    }
    let mut stx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: the path is a valid empty C string (AT_EMPTY_PATH: the call inspects `fd`
    // itself) and `stx` is a valid out-pointer for one `struct statx`.
    let rc = unsafe {
        libc::statx(fd, c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, stx.as_mut_ptr())
    };
    if rc != 0 {
        return UNKNOWN;
    }
    // SAFETY: statx succeeded; the structure started zeroed, so fields the kernel left alone
    // read as zero.
    let stx = unsafe { stx.assume_init() };
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return UNKNOWN;
    }
    let align = u64::from(stx.stx_dio_offset_align.max(stx.stx_dio_mem_align));
    if align.is_power_of_two() {
        align
    } else {
        UNKNOWN
    }
}
