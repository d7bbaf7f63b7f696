//! The staged route's bounce memory: a registered host region cut into slots, leased one per
//! stage, so that concurrent batches never share bounce bytes.
//!
//! A stage that finds no free slot is parked, not run: it holds no executor thread while it
//! waits. Whoever returns a slot hands it straight to the oldest parked stage and runs that
//! stage on its own thread, so back-pressure never overwrites a slot and never deadlocks the
//! executor (a stage that holds a slot waits for nothing but its own engines).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use umbp_plan::{AlignedBuffer, EndpointId};

use crate::routed::StagedFragment;

/// The staged route's configuration: a registered host region that carries bytes between two
/// engines when no single engine claims a pair (SSD to device memory, say). Made with
/// [`new`](Self::new) and [`with_stage_bytes`](Self::with_stage_bytes): fields may be added, so
/// it is not built as a struct literal outside this crate.
///
/// # Sizing the region
///
/// At most [`CompositeConfig::workers`](crate::CompositeConfig) stages run at once (each holds
/// an executor thread), and a returned slot is the next one leased, so the staged route keeps
/// reusing about `workers × stage_bytes` of the region: 16 MiB with the defaults (8 workers,
/// 2 MiB stages). A larger region costs memory and buys nothing.
///
/// Keep that working set small: the SSD engine reads into it with `O_DIRECT`, and on this
/// project's virtual machine the reads' speed fell with the memory they land in. The SSD
/// engine alone, reading one restore's 1 GiB (reads of 64–320 KiB at depth 64) in stages,
/// ran at 0.65–0.89 (mostly 0.75–0.80) of its speed into 16 MiB or less (which matched
/// fio's) when its stages spread over 64 MiB. Through the composite, in 24 rounds alternating in one process, 2 MiB
/// stages in a 16 MiB region restored from SSD 1.11–1.27× as fast as 8 MiB stages in a 64 MiB
/// one (0.90–1.03 of fio replaying the same reads, against 0.77–0.87), except in minutes when
/// the disk slowed every staged restore alike (0.97–1.04×). Smaller stages than 2 MiB cost
/// more plans and waits per byte (two hops each), for no gain measured here.
///
/// What a larger working set buys is slack for a second hop that lags: a slot is free again
/// only once its stage's second hop is done, so when that hop waits behind other work on its
/// engine, the SSD runs out of slots sooner with small stages. While the simulated device ran
/// one launch at a time, a DRAM restore's launches held the second hops of a mixed DRAM + SSD
/// restore, which then took 1.03–1.38× its slower half alone with 2 MiB stages in 16 MiB and
/// 1.00–1.19× with 8 MiB stages in 64 MiB (in rounds alternating in one process). With
/// launches side by side, as a GPU runs its streams, it took 1.01–1.05× with 2 MiB stages.
/// Raise `stage_bytes` (and the region) where your second hop waits.
///
/// # Where stages are cut
///
/// Stages hold one layer group and one pair of engines each, and are cut by bytes, except
/// into a file opened `O_DIRECT` (an offload to SSD): there a full stage ends on the last
/// 4 KiB block boundary of the file it reaches and the next stage starts there, so stages
/// running side by side rarely write parts of one block (which the SSD engine must then read,
/// modify and write back one after another). The bytes are right either way: the SSD engine
/// orders read-modify-writes of one block across batches.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Staging {
    /// The bounce region: a registered host endpoint, pinned for the device engine if the
    /// second hop should use its gather kernel. Only the composite may use it. Make it with
    /// [`AlignedBuffer::for_direct_io`](umbp_plan::AlignedBuffer::for_direct_io) (registered
    /// with `register_memory`): the SSD engine reads into it with `O_DIRECT`, and from 2 MiB
    /// up that buffer asks for huge pages, which on one virtual machine lifted the staged SSD
    /// restore from 0.95–1.43 to 1.50–2.20 GiB/s.
    pub bounce: EndpointId,
    /// Bytes one stage moves at most, and the size of one slot: the region holds
    /// `len / stage_bytes` slots (at least one). Default in [`Staging::new`]: 2 MiB.
    pub stage_bytes: u64,
}

impl Staging {
    /// Staging through `bounce` in stages of at most 2 MiB (see "Sizing the region").
    pub const fn new(bounce: EndpointId) -> Self {
        Self { bounce, stage_bytes: 2 << 20 }
    }

    /// The same staging in stages of at most `stage_bytes` (non-zero; see "Sizing the
    /// region").
    pub const fn with_stage_bytes(mut self, stage_bytes: u64) -> Self {
        self.stage_bytes = stage_bytes;
        self
    }
}

/// One slot of the bounce region, held by one stage.
#[derive(Debug)]
pub(crate) struct Lease {
    /// Where the slot starts inside the bounce endpoint.
    pub(crate) base: u64,
    slot: usize,
}

/// The bounce region's slots and the stages waiting for one.
pub(crate) struct BouncePool<T> {
    pub(crate) staging: Staging,
    pub(crate) slot_bytes: u64,
    state: Mutex<PoolState<T>>,
}

struct PoolState<T> {
    free: Vec<usize>,
    parked: VecDeque<T>,
}

impl<T> BouncePool<T> {
    /// Cuts a bounce region of `len` bytes into slots of `staging.stage_bytes`.
    pub(crate) fn new(staging: Staging, len: u64) -> Self {
        let slot_bytes = staging.stage_bytes.clamp(1, len.max(1));
        let slots = (len / slot_bytes).max(1) as usize;
        Self {
            staging,
            slot_bytes,
            state: Mutex::new(PoolState {
                free: (0..slots).rev().collect(),
                parked: VecDeque::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState<T>> {
        // Each critical section is one push or pop: a poisoned lock still guards a valid list.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A free slot for `waiter`, or `None` after parking it until one is returned.
    pub(crate) fn lease_or_park(&self, waiter: T) -> Option<(T, Lease)> {
        let mut state = self.lock();
        match state.free.pop() {
            Some(slot) => Some((waiter, self.lease(slot))),
            None => {
                state.parked.push_back(waiter);
                None
            }
        }
    }

    /// Returns `lease`'s slot: to the oldest parked stage, which the caller then runs with it,
    /// or to the free list.
    pub(crate) fn give_back(&self, lease: Lease) -> Option<(T, Lease)> {
        let mut state = self.lock();
        match state.parked.pop_front() {
            Some(waiter) => Some((waiter, lease)),
            None => {
                state.free.push(lease.slot);
                None
            }
        }
    }

    fn lease(&self, slot: usize) -> Lease {
        Lease { base: slot as u64 * self.slot_bytes, slot }
    }
}

/// A piece of a staged fragment and where it sits inside its stage's slot.
#[derive(Copy, Clone, Debug)]
pub(crate) struct StagePiece {
    pub(crate) fragment: StagedFragment,
    pub(crate) at: u64,
}

/// The block the staged route cuts `O_DIRECT` files at: the direct-I/O alignment, a multiple of
/// every logical block size up to it.
pub(crate) const FILE_BLOCK: u64 = AlignedBuffer::DIRECT_IO_ALIGN as u64;

/// Cuts staged fragments into stages of at most `slot` bytes. A stage holds one layer group and
/// one route (the same two engines), groups in ascending order; a fragment longer than the room
/// left is cut into pieces of the same object.
///
/// Where a fragment's destination is a file opened `O_DIRECT` (`direct_file` gives the file
/// offset of the endpoint's offset 0), a full stage ends at the last [`FILE_BLOCK`] boundary
/// of its destination bytes it holds, and what follows starts the next stage: stages run side
/// by side as separate batches of the file's engine, and cut so they rarely write parts of
/// one block, which the engine would have to read, modify and write back in turn. (Correctness
/// does not depend on it: the engine orders such writes of one block.) A stage holding no such
/// boundary is cut by bytes.
pub(crate) fn cut_stages(
    mut staged: Vec<StagedFragment>,
    slot: u64,
    mut direct_file: impl FnMut(EndpointId) -> Option<u64>,
) -> Vec<Vec<StagedFragment>> {
    staged.sort_by_key(|s| (s.group, s.read, s.write));
    let mut stages: Vec<Vec<StagedFragment>> = Vec::new();
    let mut stage: Vec<StagedFragment> = Vec::new();
    let mut used = 0;
    let mut key = None;
    // The last cut in `stage` that lands on a block boundary of a direct file: the piece and
    // how many of its bytes stay before the cut.
    let mut clean: Option<(usize, u64)> = None;
    let mut last: Option<(EndpointId, Option<u64>)> = None;
    for sf in staged {
        let this = Some((sf.group, sf.read, sf.write));
        if key != this {
            if !stage.is_empty() {
                stages.push(std::mem::take(&mut stage));
            }
            (used, clean, key) = (0, None, this);
        }
        let base = match last {
            Some((id, base)) if id == sf.fragment.dst => base,
            _ => {
                let base = direct_file(sf.fragment.dst);
                last = Some((sf.fragment.dst, base));
                base
            }
        };
        let mut done = 0;
        while done < sf.fragment.len {
            let n = (sf.fragment.len - done).min(slot - used);
            let piece = narrow(sf, done, n);
            if let Some(base) = base {
                let start = base.saturating_add(piece.fragment.dst_offset);
                let end = start.saturating_add(n);
                let boundary = end - end % FILE_BLOCK;
                // A cut before the piece's first byte needs something before it in the stage.
                if boundary > start || (boundary == start && !stage.is_empty()) {
                    clean = Some((stage.len(), boundary - start));
                }
            }
            stage.push(piece);
            used += n;
            done += n;
            if used == slot {
                let end = (stage.len() - 1, stage[stage.len() - 1].fragment.len);
                let carry = match clean {
                    Some(cut) if cut != end => split(&mut stage, cut),
                    _ => Vec::new(),
                };
                stages.push(std::mem::replace(&mut stage, carry));
                used = stage.iter().map(|s| s.fragment.len).sum();
                // What was carried lies past the last boundary: it holds none.
                clean = None;
            }
        }
    }
    if !stage.is_empty() {
        stages.push(stage);
    }
    stages
}

/// Bytes `from .. from + len` of a staged fragment, as a fragment of the same object.
fn narrow(sf: StagedFragment, from: u64, len: u64) -> StagedFragment {
    let mut piece = sf;
    piece.fragment.src_offset += from;
    piece.fragment.dst_offset += from;
    piece.fragment.len = len;
    piece
}

/// Cuts `stage` before byte `keep` of piece `at`, and returns what follows the cut.
fn split(stage: &mut Vec<StagedFragment>, (at, keep): (usize, u64)) -> Vec<StagedFragment> {
    let mut rest = stage.split_off(at);
    if keep > 0 {
        let piece = rest[0];
        if keep >= piece.fragment.len {
            stage.push(rest.remove(0));
        } else {
            stage.push(narrow(piece, 0, keep));
            rest[0] = narrow(piece, keep, piece.fragment.len - keep);
        }
    }
    rest
}

/// Where each fragment of a stage sits in its slot: one after the other.
pub(crate) fn place(stage: &[StagedFragment]) -> Vec<StagePiece> {
    let mut at = 0;
    stage
        .iter()
        .map(|&fragment| {
            let piece = StagePiece { fragment, at };
            at += fragment.fragment.len;
            piece
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use umbp_plan::{Fragment, Tag};

    use super::*;

    fn staged(tag: u32, len: u64, group: u32, read: usize) -> StagedFragment {
        let id = EndpointId::from_raw(0);
        StagedFragment {
            fragment: Fragment::new(id, 0, id, 0, len, Tag::new(tag)),
            read,
            write: 1,
            group,
        }
    }

    #[test]
    fn stages_hold_one_group_and_route_and_fit_a_slot() {
        let stages = cut_stages(
            vec![staged(0, 100, 1, 0), staged(1, 250, 0, 0), staged(2, 30, 0, 2)],
            100,
            |_| None,
        );
        let shape: Vec<Vec<(u32, u64, u32)>> = stages
            .iter()
            .map(|s| s.iter().map(|p| (p.fragment.tag.get(), p.fragment.len, p.group)).collect())
            .collect();
        // Group 0 first: object 1 cut into 100 + 100 + 50, then the other route's object 2,
        // then group 1.
        assert_eq!(
            shape,
            vec![
                vec![(1, 100, 0)],
                vec![(1, 100, 0)],
                vec![(1, 50, 0)],
                vec![(2, 30, 0)],
                vec![(0, 100, 1)]
            ]
        );
        let offsets: Vec<u64> = stages[1].iter().map(|p| p.fragment.src_offset).collect();
        assert_eq!(offsets, [100]);
    }

    /// 32 objects of 1,000 bytes to file offsets `100 + 1000 k` of an endpoint at file offset
    /// `base`, cut into stages of 4 KiB.
    fn offload_stages(base: Option<u64>) -> Vec<Vec<StagedFragment>> {
        let (host, file) = (EndpointId::from_raw(1), EndpointId::from_raw(5));
        let staged = (0..32u32)
            .map(|k| {
                let at = u64::from(k) * 1000;
                let fragment = Fragment::new(host, at, file, 100 + at, 1000, Tag::new(k));
                StagedFragment { fragment, read: 0, write: 1, group: 0 }
            })
            .collect();
        cut_stages(staged, 4096, |id| base.filter(|_| id == file))
    }

    /// Each stage's first and last destination byte, checking that the stages carry every
    /// object's bytes once, in order, each stage in one slot.
    fn extents(stages: &[Vec<StagedFragment>]) -> Vec<(u64, u64)> {
        let mut next = 100;
        let mut extents = Vec::new();
        for stage in stages {
            assert!(stage.iter().map(|p| p.fragment.len).sum::<u64>() <= 4096);
            for p in stage {
                let f = p.fragment;
                assert_eq!((f.dst_offset, f.src_offset + 100), (next, next), "{stage:?}");
                assert_eq!(u64::from(f.tag.get()), (f.dst_offset - 100) / 1000);
                assert!(f.len > 0 && (f.dst_offset - 100) % 1000 + f.len <= 1000);
                next += f.len;
            }
            extents.push((stage[0].fragment.dst_offset, next));
        }
        assert_eq!(next, 32_100, "every byte once");
        extents
    }

    #[test]
    fn stages_into_a_direct_file_end_on_its_blocks() {
        for base in [0u64, 96, 5000] {
            let stages = offload_stages(Some(base));
            let extents = extents(&stages);
            let last = extents.len() - 1;
            for (i, &(start, end)) in extents.iter().enumerate() {
                if i > 0 {
                    assert_eq!((base + start) % FILE_BLOCK, 0, "stage {i} of {extents:?}");
                }
                if i < last {
                    assert_eq!((base + end) % FILE_BLOCK, 0, "stage {i} of {extents:?}");
                }
            }
            // No more stages than blocks touched.
            let blocks = (base + 32_100).div_ceil(FILE_BLOCK) - (base + 100) / FILE_BLOCK;
            assert_eq!(stages.len() as u64, blocks, "{extents:?}");
        }
        // Into memory, or a buffered file: stages by bytes alone.
        let extents = extents(&offload_stages(None));
        assert_eq!(extents[..2], [(100, 4196), (4196, 8292)]);
    }

    #[test]
    fn slots_are_leased_once_and_parked_waiters_get_them_in_order() {
        let pool: BouncePool<u32> =
            BouncePool::new(Staging { bounce: EndpointId::from_raw(0), stage_bytes: 40 }, 100);
        assert_eq!(pool.slot_bytes, 40);
        let (_, a) = pool.lease_or_park(1).unwrap();
        let (_, b) = pool.lease_or_park(2).unwrap();
        assert_ne!(a.base, b.base);
        assert!(a.base + 40 <= 100 && b.base + 40 <= 100, "slots lie inside the region");
        assert!(pool.lease_or_park(3).is_none(), "two slots of 40 in 100 bytes");
        assert!(pool.lease_or_park(4).is_none());
        let base = a.base;
        let (waiter, handed) = pool.give_back(a).unwrap();
        assert_eq!((waiter, handed.base), (3, base), "the oldest waiter gets the slot");
        let (waiter, _) = pool.give_back(handed).unwrap();
        assert_eq!(waiter, 4);
        assert!(pool.give_back(b).is_none());
    }

    #[test]
    fn a_returned_slot_is_the_next_one_leased() {
        // Eight slots, two stages at a time: the two stay on the same two slots, so the bytes
        // the engines touch stay few however large the region.
        let pool: BouncePool<u32> =
            BouncePool::new(Staging { bounce: EndpointId::from_raw(0), stage_bytes: 10 }, 80);
        let mut used = std::collections::HashSet::new();
        let (_, mut a) = pool.lease_or_park(0).unwrap();
        let (_, mut b) = pool.lease_or_park(1).unwrap();
        for i in 0..100 {
            used.extend([a.base, b.base]);
            if i % 3 == 0 {
                assert!(pool.give_back(a).is_none());
                a = pool.lease_or_park(0).unwrap().1;
            } else {
                assert!(pool.give_back(b).is_none());
                b = pool.lease_or_park(1).unwrap().1;
            }
        }
        assert_eq!(used.len(), 2, "slots used: {used:?}");
    }
}
