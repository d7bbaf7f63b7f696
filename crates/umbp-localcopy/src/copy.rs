//! The copy kernels, and the one place this crate turns registered host addresses into memory
//! accesses.
//!
//! Every `unsafe` operation of the crate lives in this module. The argument is the same for all
//! of them:
//!
//! 1. every way to register a host endpoint ([`Register`](umbp_plan::Register), and beneath it
//!    [`EndpointRegistry::register`](umbp_plan::EndpointRegistry::register)) obliges whoever
//!    registers it to keep `addr .. addr + len` valid for reads and writes until the endpoint
//!    is deregistered and every handle that used it was waited on, and to let nothing outside
//!    the transfer touch the bytes it writes (or write the bytes it reads) while it runs; a
//!    [`Registration`](umbp_plan::Registration) that owns its buffer keeps that promise itself;
//! 2. a [`Task`] is only made by [`Task::resolve`], from a [`HostRegion`] looked up in the
//!    registry at submit, after checking that both of its ranges lie inside their regions;
//! 3. the engine runs every task before `submit` returns, while the caller still holds the plan
//!    set's endpoints registered (a handle exists only after `submit` returns);
//! 4. the engine runs the tasks of one submit on several threads only after checking that no
//!    byte one task writes is read or written by another (step 3 of a submit, documented on
//!    [`LocalCopyEngine`]); otherwise it runs them in order on one thread.
//!
//! So a task's two ranges are valid memory for as long as the task can run, and no other access
//! races with it.

use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};

use umbp_plan::checksum::crc32c_append;
use umbp_plan::host_copy::{
    copy_non_temporal, copy_non_temporal_crc, non_temporal_supported, store_fence,
};
use umbp_plan::{Endpoint, Segment, Tag};

/// A registered host endpoint as a range of addresses of this process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct HostRegion {
    base: usize,
    len: usize,
}

impl HostRegion {
    /// The addresses of `endpoint`, if it is host memory whose whole range fits the address
    /// space (and is not at address 0 unless empty).
    pub(crate) fn of(endpoint: &Endpoint) -> Option<Self> {
        if !endpoint.is_host() {
            return None;
        }
        let base = usize::try_from(endpoint.addr()).ok()?;
        let len = usize::try_from(endpoint.len()).ok()?;
        base.checked_add(len)?;
        (base != 0 || len == 0).then_some(Self { base, len })
    }

    /// The address of byte `offset` if `offset .. offset + len` lies inside the region.
    fn address_of(&self, offset: u64, len: u64) -> Option<usize> {
        let offset = usize::try_from(offset).ok()?;
        let len = usize::try_from(len).ok()?;
        (offset.checked_add(len)? <= self.len).then(|| self.base + offset)
    }
}

/// One contiguous copy between two ranges of registered host memory.
#[derive(Debug)]
pub(crate) struct Task {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    /// Set for a submit that hashes while copying: whose bytes these are, and their CRC32C
    /// once the task ran.
    hash: Option<Hashed>,
}

/// The object piece a hashing task copies, and the CRC32C of its bytes once copied.
#[derive(Debug)]
pub(crate) struct Hashed {
    /// The plan's index in its plan set.
    pub(crate) plan: usize,
    pub(crate) tag: Tag,
    /// The piece, in the plan's coordinates.
    pub(crate) piece: Segment,
    /// Written by the thread that runs the task; read after the submit's threads joined
    /// (the pool's completion orders it).
    crc: AtomicU32,
}

impl Hashed {
    /// The CRC32C of the piece's bytes, once its task ran.
    pub(crate) fn crc(&self) -> u32 {
        self.crc.load(Ordering::Relaxed)
    }
}

// SAFETY: a task only names two ranges of registered host memory (module doc, items 1 and 2).
// The registry's contract makes that memory valid from any thread of the process, and the
// engine waits for every task it hands to a worker before `submit` returns (item 3), so moving
// a task to a worker, or sharing a list of them, cannot outlive the memory.
unsafe impl Send for Task {}
// SAFETY: `run` takes `&self` and writes only through `dst`, which the registry's contract
// reserves to this transfer (module doc, item 1), and into its hash's CRC, an atomic. Each task
// of a list is claimed by exactly one thread (the pool's cursor), so no two threads run the
// same task, and tasks that run at the same time touch no common written byte (item 4).
unsafe impl Sync for Task {}

impl Task {
    /// The task that executes `segment` from `src` to `dst`, if both of its ranges lie inside
    /// their regions. This is the bounds check every copy relies on.
    #[inline]
    pub(crate) fn resolve(src: &HostRegion, dst: &HostRegion, segment: &Segment) -> Option<Self> {
        let len = usize::try_from(segment.len).ok()?;
        let src_addr = src.address_of(segment.src_offset, segment.len)?;
        let dst_addr = dst.address_of(segment.dst_offset, segment.len)?;
        Some(Self {
            src: ptr::with_exposed_provenance(src_addr),
            dst: ptr::with_exposed_provenance_mut(dst_addr),
            len,
            hash: None,
        })
    }

    /// The task, made to hash what it copies: `segment` is object `tag`'s piece of plan
    /// `plan` (the bytes [`resolve`](Self::resolve) checked).
    pub(crate) fn hashing(mut self, plan: usize, tag: Tag, segment: Segment) -> Self {
        self.hash = Some(Hashed { plan, tag, piece: segment, crc: AtomicU32::new(0) });
        self
    }

    /// The piece the task hashes, if it hashes.
    pub(crate) fn hashed(&self) -> Option<&Hashed> {
        self.hash.as_ref()
    }

    /// Bytes the task copies.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Splits the task into consecutive pieces of at most `piece` bytes, in order.
    pub(crate) fn split(self, piece: usize, mut each: impl FnMut(Task)) {
        let piece = piece.max(1);
        let mut done = 0;
        while done < self.len {
            let len = piece.min(self.len - done);
            // Sub-ranges of a resolved task are inside the same regions.
            let hash = self.hash.as_ref().map(|h| Hashed {
                plan: h.plan,
                tag: h.tag,
                piece: Segment {
                    src_offset: h.piece.src_offset + done as u64,
                    dst_offset: h.piece.dst_offset + done as u64,
                    len: len as u64,
                },
                crc: AtomicU32::new(0),
            });
            let (src, dst) = (self.src.wrapping_add(done), self.dst.wrapping_add(done));
            each(Task { src, dst, len, hash });
            done += len;
        }
    }

    /// Copies the task's bytes with `kernel`'s choice of stores, hashing them on the way when
    /// the task hashes. Returns whether it used non-temporal stores, which the caller must
    /// fence with [`store_fence`] before it publishes completion.
    ///
    /// A task whose two ranges overlap is copied as by `memmove`. The engine never runs one
    /// (the overlap rule fails such objects first); the check keeps this function sound on
    /// its own.
    #[inline]
    pub(crate) fn run(&self, kernel: Kernel) -> bool {
        if self.len == 0 {
            return false;
        }
        let (src, dst) = (self.src.addr(), self.dst.addr());
        // Both ends were checked against regions that fit the address space: no overflow.
        let overlap = src < dst + self.len && dst < src + self.len;
        if let Some(hash) = &self.hash {
            if overlap || self.len < kernel.non_temporal_from {
                // Hashed before the copy, which may overwrite the source where they overlap.
                // SAFETY: the source is registered host memory, valid and not written by
                // anything else during the transfer (module doc); `len > 0`, so non-null.
                let bytes = unsafe { std::slice::from_raw_parts(self.src, self.len) };
                hash.crc.store(crc32c_append(0, bytes), Ordering::Relaxed);
            } else {
                // SAFETY:
                // 1. both ranges are valid registered host memory, reserved to this transfer
                //    (module doc), and they do not overlap (checked above);
                // 2. `non_temporal_from` is below `usize::MAX` only when `Kernel::new` detected
                //    the store instructions on this CPU.
                let crc = unsafe { copy_non_temporal_crc(self.src, self.dst, self.len, 0) };
                hash.crc.store(crc, Ordering::Relaxed);
                return true;
            }
        }
        if overlap {
            // SAFETY: both ranges lie inside registered host memory that the registry's contract
            // keeps valid and reserved to this transfer (module doc); `ptr::copy` allows overlap.
            unsafe { ptr::copy(self.src, self.dst, self.len) };
            return false;
        }
        if self.len >= kernel.non_temporal_from {
            // SAFETY:
            // 1. both ranges are valid registered host memory, reserved to this transfer (module
            //    doc), and they do not overlap (checked above);
            // 2. `non_temporal_from` is below `usize::MAX` only when `Kernel::new` detected the
            //    store instructions on this CPU.
            unsafe { copy_non_temporal(self.src, self.dst, self.len) };
            return true;
        }
        // SAFETY: both ranges are valid registered host memory, reserved to this transfer
        // (module doc), and they do not overlap (checked above).
        unsafe { ptr::copy_nonoverlapping(self.src, self.dst, self.len) };
        false
    }
}

/// Runs `tasks` in order and fences any non-temporal stores they made, so that whatever this
/// thread publishes next (a completion count, a return) orders after every byte.
pub(crate) fn run_tasks(tasks: &[Task], kernel: Kernel) {
    let mut streamed = false;
    for task in tasks {
        streamed |= task.run(kernel);
    }
    if streamed {
        store_fence();
    }
}

/// Which stores a copy uses: non-temporal ones for segments of at least
/// `non_temporal_from` bytes, plain `copy_nonoverlapping` below.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Kernel {
    /// `usize::MAX` when non-temporal stores are off or missing.
    non_temporal_from: usize,
}

impl Kernel {
    /// Plain stores only.
    pub(crate) const PLAIN: Kernel = Kernel { non_temporal_from: usize::MAX };

    /// Non-temporal stores from `threshold` bytes up when `enabled` and the CPU has them
    /// (detected at run time); plain stores otherwise.
    pub(crate) fn new(enabled: bool, threshold: usize) -> Self {
        if enabled && non_temporal_supported() {
            Self { non_temporal_from: threshold }
        } else {
            Self::PLAIN
        }
    }

    /// Whether any segment gets non-temporal stores.
    pub(crate) fn non_temporal(&self) -> bool {
        self.non_temporal_from != usize::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_outside_its_region_is_never_made() {
        let region = HostRegion::of(&Endpoint::host(0x1000, 100)).unwrap();
        let seg = |src_offset, dst_offset, len| Segment { src_offset, dst_offset, len };
        assert!(Task::resolve(&region, &region, &seg(0, 0, 100)).is_some());
        assert!(Task::resolve(&region, &region, &seg(1, 0, 100)).is_none());
        assert!(Task::resolve(&region, &region, &seg(0, 99, 2)).is_none());
        assert!(Task::resolve(&region, &region, &seg(u64::MAX, 0, 2)).is_none());
        assert!(HostRegion::of(&Endpoint::host(u64::MAX - 10, 100)).is_none());
        assert!(HostRegion::of(&Endpoint::host(0, 100)).is_none());
        assert!(HostRegion::of(&Endpoint::file(3, 0, 100, false)).is_none());
    }

    #[test]
    fn split_pieces_cover_the_task_in_order() {
        let region = HostRegion::of(&Endpoint::host(0x1000, 1000)).unwrap();
        let task =
            Task::resolve(&region, &region, &Segment { src_offset: 0, dst_offset: 500, len: 250 })
                .unwrap();
        let mut pieces = Vec::new();
        task.split(100, |t| pieces.push((t.src.addr(), t.dst.addr(), t.len)));
        assert_eq!(
            pieces,
            [(0x1000, 0x11f4, 100), (0x1064, 0x1258, 100), (0x10c8, 0x12bc, 50)],
            "pieces of 100, 100 and 50 bytes"
        );
    }

    #[test]
    fn overlapping_ranges_copy_as_memmove() {
        let mut buf: Vec<u8> = (0..64).collect();
        let region = HostRegion { base: buf.as_mut_ptr().expose_provenance(), len: buf.len() };
        let task =
            Task::resolve(&region, &region, &Segment { src_offset: 0, dst_offset: 8, len: 32 })
                .unwrap();
        assert!(!task.run(Kernel::new(true, 1)), "overlap never streams");
        let want: Vec<u8> = (0..8).chain(0..32).chain(40..64).collect();
        assert_eq!(buf, want);
    }
}
