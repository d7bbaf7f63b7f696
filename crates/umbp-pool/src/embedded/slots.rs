//! The embedded index's in-memory state: per tier a slot table, a free list and use stamps;
//! the published keys; the live leases and reservations. Rebuilt from the store at open.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::Instant;

use super::keymap::{Entry, KeyMap};
use crate::{BlockKey, NodeAnnouncement, NodeId, Placement, TierId, TierSpec, TierStats};

/// What one slot holds.
#[derive(Copy, Clone, Debug)]
pub(super) enum SlotState {
    Free,
    Reserved {
        key: BlockKey,
        len: u64,
        deadline: Instant,
    },
    /// Reserved, and its publish is being committed: invisible, not expiring, not abortable.
    Publishing {
        key: BlockKey,
        len: u64,
        deadline: Instant,
    },
    Published {
        key: BlockKey,
        len: u64,
        checksum: u32,
        last_use: u64,
    },
    /// Picked for eviction or removal; its deletion is being committed.
    Leaving {
        key: BlockKey,
        len: u64,
        checksum: u32,
    },
}

#[derive(Copy, Clone, Debug)]
pub(super) struct Slot {
    pub(super) generation: u64,
    /// Live leases on the slot (expired ones are subtracted at the next sweep).
    pub(super) leases: u32,
    /// The store's log entry of the block published here (durable tiers).
    pub(super) seq: u64,
    pub(super) state: SlotState,
}

pub(super) struct TierState {
    pub(super) spec: TierSpec,
    /// Slots ever used: `slots.len()` is the never-used cursor.
    pub(super) slots: Vec<Slot>,
    /// Used slots that are free again.
    pub(super) free: Vec<u32>,
    /// The use counter: publishes and granted leases stamp a slot with the next value.
    uses: u64,
    pub(super) reserved: u32,
    pub(super) published: u32,
    /// Reservation deadlines, earliest first: (deadline, slot, generation).
    deadlines: BinaryHeap<Reverse<(Instant, u32, u64)>>,
}

impl TierState {
    pub(super) fn new(spec: TierSpec) -> Self {
        Self {
            spec,
            slots: Vec::new(),
            free: Vec::new(),
            uses: 0,
            reserved: 0,
            published: 0,
            deadlines: BinaryHeap::new(),
        }
    }

    pub(super) fn free_count(&self) -> u32 {
        self.free.len() as u32 + (self.spec.slot_count - self.slots.len() as u32)
    }

    pub(super) fn stats(&self) -> TierStats {
        TierStats { free: self.free_count(), reserved: self.reserved, published: self.published }
    }

    /// Frees reservations whose deadline passed.
    pub(super) fn reclaim_expired(&mut self, now: Instant) {
        while let Some(&Reverse((deadline, slot, generation))) = self.deadlines.peek() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            let s = &mut self.slots[slot as usize];
            if s.generation == generation && matches!(s.state, SlotState::Reserved { .. }) {
                s.state = SlotState::Free;
                self.reserved -= 1;
                self.free.push(slot);
            }
        }
    }

    /// Takes a free slot for `key` under generation `generation`.
    pub(super) fn take(
        &mut self,
        key: BlockKey,
        len: u64,
        generation: u64,
        deadline: Instant,
    ) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if (self.slots.len() as u32) < self.spec.slot_count => {
                self.slots.push(Slot { generation: 0, leases: 0, seq: 0, state: SlotState::Free });
                self.slots.len() as u32 - 1
            }
            None => return None,
        };
        let s = &mut self.slots[slot as usize];
        debug_assert!(matches!(s.state, SlotState::Free) && s.leases == 0);
        s.generation = generation;
        s.state = SlotState::Reserved { key, len, deadline };
        self.reserved += 1;
        self.deadlines.push(Reverse((deadline, slot, generation)));
        Some(slot)
    }

    /// Frees a reserved slot (abort, lost race, expiry found at publish).
    pub(super) fn unreserve(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if matches!(s.state, SlotState::Reserved { .. }) {
            s.state = SlotState::Free;
            self.reserved -= 1;
            self.free.push(slot);
        }
    }

    /// Frees a reserved slot if it still has `generation` (a lost publish race).
    pub(super) fn unreserve_generation(&mut self, slot: u32, generation: u64) {
        if self.slots[slot as usize].generation == generation {
            self.unreserve(slot);
        }
    }

    /// Marks a reserved slot as being published.
    pub(super) fn begin_publish(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if let SlotState::Reserved { key, len, deadline } = s.state {
            s.state = SlotState::Publishing { key, len, deadline };
        }
    }

    /// The publish's commit failed: the slot is reserved again, under its old deadline.
    pub(super) fn cancel_publish(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if let SlotState::Publishing { key, len, deadline } = s.state {
            s.state = SlotState::Reserved { key, len, deadline };
            self.deadlines.push(Reverse((deadline, slot, s.generation)));
        }
    }

    /// Turns a slot being published into a published one.
    pub(super) fn publish(&mut self, slot: u32, key: BlockKey, len: u64, checksum: u32, seq: u64) {
        let s = &mut self.slots[slot as usize];
        s.seq = seq;
        debug_assert!(matches!(s.state, SlotState::Publishing { .. }));
        self.uses += 1;
        s.state = SlotState::Published { key, len, checksum, last_use: self.uses };
        self.reserved -= 1;
        self.published += 1;
    }

    /// Places a block found in the store at open.
    pub(super) fn restore(&mut self, p: &Placement, seq: u64) -> bool {
        let slot = p.slot as usize;
        if p.slot >= self.spec.slot_count || p.len > self.spec.slot_size {
            return false;
        }
        while self.slots.len() <= slot {
            self.slots.push(Slot { generation: 0, leases: 0, seq: 0, state: SlotState::Free });
        }
        let s = &mut self.slots[slot];
        if !matches!(s.state, SlotState::Free) {
            return false;
        }
        *s = Slot {
            generation: p.generation,
            leases: 0,
            seq,
            state: SlotState::Published {
                key: p.key,
                len: p.len,
                checksum: p.checksum,
                last_use: 0,
            },
        };
        self.published += 1;
        true
    }

    /// After the blocks of the store are placed: every used slot still free goes to the free list.
    pub(super) fn rebuild_free_list(&mut self) {
        self.free = (0..self.slots.len() as u32)
            .rev()
            .filter(|&i| matches!(self.slots[i as usize].state, SlotState::Free))
            .collect();
    }

    /// Stamps a published slot as used now (a granted lease).
    pub(super) fn touch(&mut self, slot: u32) {
        self.uses += 1;
        if let SlotState::Published { last_use, .. } = &mut self.slots[slot as usize].state {
            *last_use = self.uses;
        }
    }

    /// Picks up to `want` published, unleased slots that `keep` (sorted) does not list, least
    /// recently used first, and marks them [`SlotState::Leaving`]. One pass over the used
    /// slots per eviction run (a run frees the gap between the watermarks, so the pass is
    /// shared by that many evictions).
    pub(super) fn pick_victims(&mut self, want: u32, keep: &[u32], out: &mut Vec<(u32, BlockKey)>) {
        let mut candidates: Vec<(u64, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s.state {
                SlotState::Published { last_use, .. }
                    if s.leases == 0 && keep.binary_search(&(i as u32)).is_err() =>
                {
                    Some((last_use, i as u32))
                }
                _ => None,
            })
            .collect();
        let want = (want as usize).min(candidates.len());
        if want == 0 {
            return;
        }
        if want < candidates.len() {
            candidates.select_nth_unstable(want - 1);
        }
        for &(_, slot) in &candidates[..want] {
            let s = &mut self.slots[slot as usize];
            if let SlotState::Published { key, len, checksum, .. } = s.state {
                s.state = SlotState::Leaving { key, len, checksum };
                out.push((slot, key));
            }
        }
    }

    /// Marks a published, unleased slot [`SlotState::Leaving`] (a removal); its key, or `None`.
    pub(super) fn pick(&mut self, slot: u32) -> Option<BlockKey> {
        let s = &mut self.slots[slot as usize];
        match s.state {
            SlotState::Published { key, len, checksum, .. } if s.leases == 0 => {
                s.state = SlotState::Leaving { key, len, checksum };
                Some(key)
            }
            _ => None,
        }
    }

    /// The deletion of a leaving slot was committed: it is free.
    pub(super) fn left(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(matches!(s.state, SlotState::Leaving { .. }));
        s.state = SlotState::Free;
        self.published -= 1;
        self.free.push(slot);
    }

    /// The deletion of a leaving slot failed to commit: it is published again.
    pub(super) fn stay(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if let SlotState::Leaving { key, len, checksum } = s.state {
            s.state = SlotState::Published { key, len, checksum, last_use: 0 };
        }
    }
}

/// One reader's lease: the slots it protects (tier index, slot) and when it ends.
pub(super) struct LeaseRecord {
    pub(super) slots: Vec<(usize, u32)>,
    pub(super) deadline: Instant,
}

/// Everything the embedded index keeps in memory.
pub(super) struct State {
    pub(super) tiers: Vec<TierState>,
    pub(super) tier_index: HashMap<(NodeId, TierId), usize>,
    /// Published keys: tier index and what the slot holds (a copy, so a lookup is one probe
    /// of one table; see [`KeyMap`]).
    pub(super) keys: KeyMap,
    /// The next generation handed out (global, so every reservation's is larger than every
    /// earlier one in this store, across restarts).
    pub(super) next_generation: u64,
    pub(super) leases: HashMap<u64, LeaseRecord>,
    pub(super) next_lease: u64,
    /// The next log sequence number of the store.
    pub(super) next_seq: u64,
    /// Lease count at the last sweep: the next sweep runs when it has doubled.
    pub(super) swept_at: usize,
    pub(super) nodes: HashMap<NodeId, (NodeAnnouncement, Instant)>,
}

impl State {
    pub(super) fn new() -> Self {
        Self {
            tiers: Vec::new(),
            tier_index: HashMap::new(),
            keys: KeyMap::with_capacity(0),
            next_generation: 1,
            leases: HashMap::new(),
            next_lease: 1,
            next_seq: 0,
            swept_at: 0,
            nodes: HashMap::new(),
        }
    }

    /// Ends the leases whose deadline passed.
    pub(super) fn sweep_leases(&mut self, now: Instant) {
        let tiers = &mut self.tiers;
        self.leases.retain(|_, lease| {
            if lease.deadline > now {
                return true;
            }
            for &(t, s) in &lease.slots {
                tiers[t].slots[s as usize].leases -= 1;
            }
            false
        });
        self.swept_at = self.leases.len();
    }

    pub(super) fn end_lease(&mut self, id: u64) -> Option<LeaseRecord> {
        let lease = self.leases.remove(&id)?;
        for &(t, s) in &lease.slots {
            self.tiers[t].slots[s as usize].leases -= 1;
        }
        Some(lease)
    }

    pub(super) fn placement(&self, key: &BlockKey) -> Option<Placement> {
        self.keys.get(key).map(|e| self.placement_of(e))
    }

    /// The placement a map entry stands for.
    pub(super) fn placement_of(&self, e: &Entry) -> Placement {
        let spec = &self.tiers[e.tier as usize].spec;
        Placement {
            key: e.key,
            node: spec.node,
            tier: spec.tier,
            slot: e.slot,
            len: e.len,
            checksum: e.checksum,
            generation: e.generation,
        }
    }

    /// Records a published block of tier `t`; the entry it replaced.
    pub(super) fn insert_key(&mut self, t: usize, p: &Placement) -> Option<Entry> {
        self.keys.insert(Entry {
            key: p.key,
            generation: p.generation,
            len: p.len,
            slot: p.slot,
            checksum: p.checksum,
            tier: t as u32,
        })
    }

    /// The placements of `keys`, in order, into `out` (cleared first): one batched pass over
    /// the key map.
    pub(super) fn lookup_into(&self, keys: &[BlockKey], out: &mut Vec<Option<Placement>>) {
        out.clear();
        out.reserve(keys.len());
        self.keys.for_each_batched(keys, |e| {
            out.push(e.map(|e| self.placement_of(e)));
            true
        });
    }

    /// How many of `keys`, from the first, are published.
    pub(super) fn prefix_hits(&self, keys: &[BlockKey]) -> usize {
        let mut hits = 0;
        self.keys.for_each_batched(keys, |e| {
            hits += usize::from(e.is_some());
            e.is_some()
        });
        hits
    }
}
