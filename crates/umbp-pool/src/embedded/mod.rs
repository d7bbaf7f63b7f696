//! The embedded index: one node's pool, persistent and crash-safe, in a redb file beside the
//! SSD tier.
//!
//! Strategy: the redb file holds what must survive a crash, and only that: the registered
//! tiers, the published blocks of durable tiers (a log keyed by publish order, so a batch
//! appends rather than dirtying a page per block) and the counters. Everything else
//! (reservations, leases, the use stamps, the free lists, volatile tiers' blocks) lives in
//! memory and is rebuilt or dropped at [`EmbeddedIndex::open`]. Each [`Index::publish`] batch is
//! one redb write transaction committed with fsync before any of it becomes visible, so a
//! crash keeps exactly the blocks whose publish returned. Eviction and removal of durable
//! blocks commit their deletion before the slot can be reserved again, so a slot is never
//! recorded under a key whose bytes a later writer has started to overwrite.

mod keymap;
mod reconcile;
mod slots;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle};

use crate::{
    BlockKey, Error, Index, Lease, NodeAnnouncement, NodeId, Placement, Published, Removed,
    Reservation, Reserved, TierId, TierSpec, TierStats,
};
use keymap::{Entry, KeyMap};
pub use reconcile::{DropReason, Dropped, ReconcileReport, TierFile, Verify};
use slots::{LeaseRecord, SlotState, State, TierState};

/// Published blocks of durable tiers, as a log: publish sequence number -> key (16 bytes) and
/// placement value. Keyed by sequence rather than by block key so a publish batch appends
/// to the B-tree's last pages instead of dirtying a random page per block; eviction (least
/// recently used, so mostly old entries) deletes from its front.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("published");
const LOG_VALUE: usize = 16 + crate::placement::PLACEMENT_BYTES;
/// Registered tiers: (node, tier) -> slot size, slot count, durable, watermarks.
const TIERS: TableDefinition<(u32, u16), &[u8]> = TableDefinition::new("tiers");
/// Counters: "next_generation", "next_seq".
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// The embedded [`Index`]: one process's pool over its own tiers, kept in a redb file.
///
/// A restart ([`open`](Self::open) of the same file after a clean exit or a crash) keeps every
/// block of a durable tier whose [`publish`](Index::publish) returned, and nothing else:
/// reservations and leases do not survive, so slots reserved but unpublished are free again,
/// and blocks of volatile tiers (a DRAM arena, gone with the process) are dropped.
///
/// Lookups are answered from memory (a hash map rebuilt at open); eviction takes published,
/// unleased slots, least recently used first (a publish and a granted lease count as uses).
/// One redb file belongs to one process at a time (redb locks it).
pub struct EmbeddedIndex {
    db: Database,
    /// Held by the one publish committing at a time.
    publishing: Mutex<()>,
    state: RwLock<State>,
}

impl std::fmt::Debug for EmbeddedIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedIndex").finish_non_exhaustive()
    }
}

fn encode_spec(s: &TierSpec) -> [u8; 21] {
    let mut b = [0u8; 21];
    b[0..8].copy_from_slice(&s.slot_size.to_be_bytes());
    b[8..12].copy_from_slice(&s.slot_count.to_be_bytes());
    b[12] = u8::from(s.durable);
    b[13..17].copy_from_slice(&s.low_watermark.to_be_bytes());
    b[17..21].copy_from_slice(&s.high_watermark.to_be_bytes());
    b
}

fn decode_spec(node: u32, tier: u16, b: &[u8]) -> Result<TierSpec, Error> {
    if b.len() != 21 {
        return Err(Error::Corrupt(format!("tier record of {} bytes", b.len())));
    }
    let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap());
    Ok(TierSpec {
        node: NodeId(node),
        tier: TierId(tier),
        slot_size: u64::from_be_bytes(b[0..8].try_into().unwrap()),
        slot_count: u32_at(8),
        durable: b[12] != 0,
        low_watermark: u32_at(13),
        high_watermark: u32_at(17),
    })
}

/// Blocks read from the log at open, put back into the state a group at a time: their
/// places in the key map are loaded together first (see [`KeyMap`]), so a million blocks'
/// cache misses overlap instead of coming one after another.
#[derive(Default)]
struct Restoring {
    pending: Vec<(u64, Placement)>,
    /// The last tier looked up: the log's blocks come in publish order, mostly of one tier
    /// after another.
    last_tier: Option<((NodeId, TierId), Option<usize>)>,
}

impl Restoring {
    /// Restores the pending blocks; the sequence numbers of those that cannot be into
    /// `dropped`.
    fn flush(&mut self, state: &mut State, dropped: &mut Vec<u64>) {
        state.keys.prefetch(self.pending.iter().map(|(_, p)| &p.key));
        for (seq, p) in self.pending.drain(..) {
            let t = match self.last_tier {
                Some((id, t)) if id == (p.node, p.tier) => t,
                _ => {
                    let t = state.tier_index.get(&(p.node, p.tier)).copied();
                    self.last_tier = Some(((p.node, p.tier), t));
                    t
                }
            };
            let kept = match t {
                Some(t) if state.tiers[t].spec.durable && p.generation != 0 => {
                    // A key logged twice (it cannot be: a key is published once until it
                    // leaves, and leaving deletes its entry) keeps its first entry only.
                    if let Some(first) = state.insert_key(t, &p) {
                        state.keys.insert(first);
                        false
                    } else if state.tiers[t].restore(&p, seq) {
                        true
                    } else {
                        state.keys.remove(&p.key);
                        false
                    }
                }
                _ => false,
            };
            if !kept {
                dropped.push(seq);
            }
        }
    }
}

impl EmbeddedIndex {
    /// Opens the index at `path`, creating it if absent, and reconciles it: every durable
    /// block committed before is back, every slot that was reserved but not published is free,
    /// volatile tiers are empty. Tiers registered before are known again (register them again
    /// with the same shape, or not at all).
    ///
    /// Errors: [`Error::Store`] (I/O, the file is held by another process),
    /// [`Error::Corrupt`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        if !path.exists() {
            Self::create(path)?;
        }
        let db = Database::create(path)?;
        // A file whose tables are not all there yet (made before `create` made them all):
        // create them, so the pass below can read them in a read transaction.
        let names: Vec<String> =
            db.begin_read()?.list_tables()?.map(|t| t.name().to_string()).collect();
        if [TIERS.name(), META.name(), LOG.name()].iter().any(|n| !names.iter().any(|m| m == n)) {
            let txn = db.begin_write()?;
            txn.open_table(TIERS)?;
            txn.open_table(META)?;
            txn.open_table(LOG)?;
            txn.commit()?;
        }
        let mut state = State::new();
        // Everything is read in a read transaction; only what must change (blocks dropped,
        // counters behind) is written after it, so a clean reopen commits nothing.
        let (dropped, stored) = {
            let txn = db.begin_read()?;
            let tiers = txn.open_table(TIERS)?;
            for entry in tiers.iter()? {
                let (k, v) = entry?;
                let (node, tier) = k.value();
                let spec = decode_spec(node, tier, v.value())?;
                state.tier_index.insert((spec.node, spec.tier), state.tiers.len());
                state.tiers.push(TierState::new(spec));
            }
            let meta = txn.open_table(META)?;
            let stored_generation = meta.get("next_generation")?.map(|v| v.value());
            let stored_seq = meta.get("next_seq")?.map(|v| v.value());
            let mut max_generation = stored_generation.unwrap_or(1).saturating_sub(1);
            let mut next_seq = stored_seq.unwrap_or(0);
            let log = txn.open_table(LOG)?;
            // Sized once: no rehashing while a million blocks come back.
            state.keys = KeyMap::with_capacity(usize::try_from(log.len()?).unwrap_or(0));
            let mut dropped: Vec<u64> = Vec::new();
            let mut restoring = Restoring::default();
            for entry in log.iter()? {
                let (seq, v) = entry?;
                let seq = seq.value();
                next_seq = next_seq.max(seq + 1);
                let v = v.value();
                let decoded = (v.len() == LOG_VALUE)
                    .then(|| BlockKey::from_slice(&v[..16]))
                    .flatten()
                    .and_then(|key| Placement::decode(key, &v[16..]).ok());
                let Some(p) = decoded else {
                    dropped.push(seq);
                    continue;
                };
                max_generation = max_generation.max(p.generation);
                restoring.pending.push((seq, p));
                if restoring.pending.len() == keymap::GROUP * 4 {
                    restoring.flush(&mut state, &mut dropped);
                }
            }
            restoring.flush(&mut state, &mut dropped);
            state.next_generation = max_generation + 1;
            state.next_seq = next_seq;
            (dropped, (stored_generation, stored_seq))
        };
        if !dropped.is_empty() || stored != (Some(state.next_generation), Some(state.next_seq)) {
            let txn = db.begin_write()?;
            {
                let mut log = txn.open_table(LOG)?;
                for seq in &dropped {
                    log.remove(*seq)?;
                }
                let mut meta = txn.open_table(META)?;
                meta.insert("next_generation", state.next_generation)?;
                meta.insert("next_seq", state.next_seq)?;
            }
            txn.commit()?;
            if !dropped.is_empty() {
                tracing::info!(dropped = dropped.len(), "embedded index: dropped blocks at open");
            }
        }
        for t in &mut state.tiers {
            t.rebuild_free_list();
        }
        tracing::info!(blocks = state.keys.len(), tiers = state.tiers.len(), "embedded index open");
        Ok(Self { db, publishing: Mutex::new(()), state: RwLock::new(state) })
    }

    /// Creates an empty index file at `path` so that a crash at any moment leaves either no
    /// file there or a whole one. redb writes a new file in several steps, and one cut short
    /// by a crash failed every later open ("invalid data"): the instance could not start until
    /// someone deleted it. So the file is made under a temporary name beside it, committed
    /// (redb fsyncs), linked into place (a link fails rather than replaces: if another process
    /// created the index meanwhile, its file is the one used), and the directory synced.
    fn create(path: &Path) -> Result<(), Error> {
        let io = |what: &Path, e: std::io::Error| Error::Store(format!("{}: {e}", what.display()));
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = path.file_name().ok_or_else(|| {
            Error::InvalidConfig(format!("index path {} names no file", path.display()))
        })?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(".creating");
        let tmp = dir.join(tmp_name);
        // What a creation killed earlier left (a later open never reads it).
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&tmp, e)),
            _ => {}
        }
        let made = (|| -> Result<(), Error> {
            let db = Database::create(&tmp)?;
            let txn = db.begin_write()?;
            txn.open_table(TIERS)?;
            txn.open_table(META)?;
            txn.open_table(LOG)?;
            txn.commit()?;
            drop(db);
            match std::fs::hard_link(&tmp, path) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(io(path, e)),
                _ => {}
            }
            std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(dir, e))
        })();
        let _ = std::fs::remove_file(&tmp);
        made
    }

    // A panic while the lock was held can only come from a bug in this module; the state is
    // still the last consistent one because every change is applied after its commit.
    fn state(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Lookups share the state: any number run at once.
    fn read_state(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn tier(state: &State, node: NodeId, tier: TierId) -> Result<usize, Error> {
        state.tier_index.get(&(node, tier)).copied().ok_or(Error::UnknownTier { node, tier })
    }

    /// Commits the deletion of leaving slots' keys (durable tiers only), then frees the slots;
    /// on failure they are published again.
    fn commit_departures(
        &self,
        state: &mut State,
        t: usize,
        leaving: &[(u32, BlockKey)],
    ) -> Result<(), Error> {
        if leaving.is_empty() {
            return Ok(());
        }
        let result = if state.tiers[t].spec.durable {
            (|| -> Result<(), Error> {
                let txn = self.db.begin_write()?;
                {
                    let mut log = txn.open_table(LOG)?;
                    for &(slot, _) in leaving {
                        log.remove(state.tiers[t].slots[slot as usize].seq)?;
                    }
                }
                txn.commit()?;
                Ok(())
            })()
        } else {
            Ok(())
        };
        for &(slot, key) in leaving {
            if result.is_ok() {
                state.tiers[t].left(slot);
                state.keys.remove(&key);
            } else {
                state.tiers[t].stay(slot);
            }
        }
        result
    }

    /// Reserves a slot for `key`, evicting below the low watermark; `present` lists the
    /// blocks its batch answered present so far (this one is added if it is), which the
    /// eviction keeps.
    #[allow(clippy::too_many_arguments)]
    fn reserve_locked(
        &self,
        state: &mut State,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        deadline: Instant,
        present: &mut Vec<Placement>,
    ) -> Result<Reserved, Error> {
        if let Some(p) = state.placement(&key) {
            present.push(p);
            return Ok(Reserved::Present(p));
        }
        let t = Self::tier(state, node, tier)?;
        let spec = state.tiers[t].spec;
        if len > spec.slot_size {
            return Err(Error::TooLarge { node, tier, len, slot_size: spec.slot_size });
        }
        state.tiers[t].reclaim_expired(Instant::now());
        let free = state.tiers[t].free_count();
        if free < spec.low_watermark.max(1) {
            let want = spec.high_watermark.max(1) - free.min(spec.high_watermark.max(1));
            let mut keep: Vec<u32> = present
                .iter()
                .filter(|p| p.node == node && p.tier == tier)
                .map(|p| p.slot)
                .collect();
            keep.sort_unstable();
            self.evict_locked(state, t, want, &keep)?;
        }
        let generation = state.next_generation;
        let slot = state.tiers[t]
            .take(key, len, generation, deadline)
            .ok_or(Error::TierFull { node, tier })?;
        state.next_generation += 1;
        Ok(Reserved::Slot(Reservation { key, node, tier, slot, len, generation }))
    }

    /// Evicts up to `want` of tier `t`'s blocks, never those in the slots `keep` lists
    /// (sorted).
    fn evict_locked(
        &self,
        state: &mut State,
        t: usize,
        want: u32,
        keep: &[u32],
    ) -> Result<u32, Error> {
        state.sweep_leases(Instant::now());
        let mut leaving = Vec::new();
        state.tiers[t].pick_victims(want, keep, &mut leaving);
        self.commit_departures(state, t, &leaving)?;
        if !leaving.is_empty() {
            tracing::debug!(evicted = leaving.len(), tier = t, "embedded index: evicted");
        }
        Ok(leaving.len() as u32)
    }
}

impl Index for EmbeddedIndex {
    fn register_tier(&self, spec: &TierSpec) -> Result<(), Error> {
        spec.validate()?;
        let mut state = self.state();
        if let Some(&t) = state.tier_index.get(&(spec.node, spec.tier)) {
            spec.same_shape(&state.tiers[t].spec)?;
            if state.tiers[t].spec == *spec {
                return Ok(());
            }
        }
        let txn = self.db.begin_write()?;
        txn.open_table(TIERS)?.insert((spec.node.0, spec.tier.0), &encode_spec(spec)[..])?;
        txn.commit()?;
        match state.tier_index.get(&(spec.node, spec.tier)) {
            Some(&t) => state.tiers[t].spec = *spec,
            None => {
                let t = state.tiers.len();
                state.tier_index.insert((spec.node, spec.tier), t);
                state.tiers.push(TierState::new(*spec));
            }
        }
        Ok(())
    }

    fn reserve(
        &self,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        ttl: Duration,
    ) -> Result<Reserved, Error> {
        let mut state = self.state();
        self.reserve_locked(&mut state, key, node, tier, len, Instant::now() + ttl, &mut Vec::new())
    }

    fn reserve_many(
        &self,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<Result<Reserved, Error>>, Error> {
        let mut state = self.state();
        let deadline = Instant::now() + ttl;
        let mut out = Vec::with_capacity(items.len());
        let mut present = Vec::new();
        for &(key, len) in items {
            match self.reserve_locked(&mut state, key, node, tier, len, deadline, &mut present) {
                Err(e @ (Error::Store(_) | Error::Corrupt(_))) => return Err(e),
                answer => out.push(answer),
            }
        }
        Ok(out)
    }

    fn publish(&self, items: &[(Reservation, u32)]) -> Result<Vec<Published>, Error> {
        enum Step {
            Win(usize, u64),
            Lose(usize, Placement),
            Expire,
        }
        // One publish at a time: the state's lock is held only to decide and to apply, not
        // across the fsync, so lookups (and reserves) go on while a batch commits.
        let _one_at_a_time = self.publishing.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let mut steps = Vec::with_capacity(items.len());
        let mut durable: Vec<(u64, [u8; LOG_VALUE])> = Vec::new();
        let (next_generation, next_seq) = {
            let mut state = self.state();
            let mut won_here: HashMap<BlockKey, Placement> = HashMap::new();
            // Reservations this batch lost: one named again is over, as after a publish.
            let mut lost_here: HashSet<(usize, u32)> = HashSet::new();
            for (r, checksum) in items {
                let Some(&t) = state.tier_index.get(&(r.node, r.tier)) else {
                    steps.push(Step::Expire);
                    continue;
                };
                let live = state.tiers[t].slots.get(r.slot as usize).is_some_and(|s| {
                    s.generation == r.generation
                        && matches!(s.state, SlotState::Reserved { key, len, deadline }
                            if key == r.key && len == r.len && deadline > now)
                });
                if !live || lost_here.contains(&(t, r.slot)) {
                    steps.push(Step::Expire);
                    continue;
                }
                if let Some(winner) = state.placement(&r.key).or(won_here.get(&r.key).copied()) {
                    lost_here.insert((t, r.slot));
                    steps.push(Step::Lose(t, winner));
                    continue;
                }
                won_here.insert(r.key, r.placement(*checksum));
                let mut seq = 0;
                if state.tiers[t].spec.durable {
                    seq = state.next_seq;
                    state.next_seq += 1;
                    let mut value = [0u8; LOG_VALUE];
                    value[..16].copy_from_slice(&r.key.0);
                    value[16..].copy_from_slice(&r.placement(*checksum).encode());
                    durable.push((seq, value));
                }
                // Neither expiry nor abort touches a slot being published.
                state.tiers[t].begin_publish(r.slot);
                steps.push(Step::Win(t, seq));
            }
            (state.next_generation, state.next_seq)
        };
        let committed = if durable.is_empty() {
            Ok(())
        } else {
            (|| -> Result<(), Error> {
                let txn = self.db.begin_write()?;
                {
                    let mut log = txn.open_table(LOG)?;
                    for (seq, value) in &durable {
                        log.insert(*seq, &value[..])?;
                    }
                    let mut meta = txn.open_table(META)?;
                    meta.insert("next_generation", next_generation)?;
                    meta.insert("next_seq", next_seq)?;
                }
                txn.commit()?;
                Ok(())
            })()
        };
        let mut state = self.state();
        if let Err(e) = committed {
            // Nothing was published: the winners' reservations stand again (to retry or abort).
            for (step, (r, _)) in steps.iter().zip(items) {
                if let Step::Win(t, _) = *step {
                    state.tiers[t].cancel_publish(r.slot);
                }
            }
            return Err(e);
        }
        let mut out = Vec::with_capacity(items.len());
        for (step, (r, checksum)) in steps.iter().zip(items) {
            match *step {
                Step::Win(t, seq) => {
                    state.tiers[t].publish(r.slot, r.key, r.len, *checksum, seq);
                    state.insert_key(t, &r.placement(*checksum));
                    out.push(Published::Won(r.placement(*checksum)));
                }
                Step::Lose(t, winner) => {
                    // Unless it expired meanwhile (and is someone else's now): free it.
                    state.tiers[t].unreserve_generation(r.slot, r.generation);
                    out.push(Published::Lost { winner });
                }
                Step::Expire => {
                    // An expired reservation's slot is reclaimed by the next reserve's sweep.
                    out.push(Published::Expired);
                }
            }
        }
        Ok(out)
    }

    fn abort(&self, reservations: &[Reservation]) -> Result<(), Error> {
        let mut state = self.state();
        for r in reservations {
            let Some(&t) = state.tier_index.get(&(r.node, r.tier)) else { continue };
            let tier = &mut state.tiers[t];
            let ours = tier.slots.get(r.slot as usize).is_some_and(|s| {
                s.generation == r.generation
                    && matches!(s.state, SlotState::Reserved { key, .. } if key == r.key)
            });
            if ours {
                tier.unreserve(r.slot);
            }
        }
        Ok(())
    }

    fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        let mut out = Vec::new();
        self.read_state().lookup_into(keys, &mut out);
        Ok(out)
    }

    fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        Ok(self.read_state().prefix_hits(keys))
    }

    fn lease(&self, placements: &[Placement], ttl: Duration) -> Result<Lease, Error> {
        let mut state = self.state();
        let now = Instant::now();
        if state.leases.len() >= 2 * state.swept_at + 64 {
            state.sweep_leases(now);
        }
        let mut granted = Vec::with_capacity(placements.len());
        let mut held = Vec::new();
        for p in placements {
            let Some(&t) = state.tier_index.get(&(p.node, p.tier)) else {
                granted.push(false);
                continue;
            };
            let tier = &mut state.tiers[t];
            let ok = tier.slots.get_mut(p.slot as usize).is_some_and(|s| {
                let live = s.generation == p.generation
                    && matches!(s.state, SlotState::Published { key, .. } if key == p.key);
                if live {
                    s.leases += 1;
                }
                live
            });
            if ok {
                tier.touch(p.slot);
                held.push((t, p.slot));
            }
            granted.push(ok);
        }
        let id = state.next_lease;
        state.next_lease += 1;
        state.leases.insert(id, LeaseRecord { slots: held, deadline: now + ttl });
        Ok(Lease { id, granted, ttl })
    }

    fn renew(&self, id: u64, ttl: Duration) -> Result<(), Error> {
        let mut state = self.state();
        let now = Instant::now();
        match state.leases.get_mut(&id) {
            Some(lease) if lease.deadline > now => {
                lease.deadline = now + ttl;
                Ok(())
            }
            Some(_) => {
                state.end_lease(id);
                Err(Error::LeaseExpired(id))
            }
            None => Err(Error::LeaseExpired(id)),
        }
    }

    fn release(&self, id: u64) -> Result<(), Error> {
        self.state().end_lease(id);
        Ok(())
    }

    fn remove(&self, keys: &[BlockKey]) -> Result<Vec<Removed>, Error> {
        let mut state = self.state();
        state.sweep_leases(Instant::now());
        let mut out = Vec::with_capacity(keys.len());
        let mut by_tier: HashMap<usize, Vec<(u32, BlockKey)>> = HashMap::new();
        for key in keys {
            let Some(&Entry { tier, slot, .. }) = state.keys.get(key) else {
                out.push(Removed::Absent);
                continue;
            };
            let t = tier as usize;
            match state.tiers[t].pick(slot) {
                Some(k) => {
                    by_tier.entry(t).or_default().push((slot, k));
                    out.push(Removed::Removed);
                }
                // Picked already by an earlier duplicate of this key in `keys`, or leased.
                None if by_tier.get(&t).is_some_and(|v| v.iter().any(|&(s, _)| s == slot)) => {
                    out.push(Removed::Absent)
                }
                None => out.push(Removed::Leased),
            }
        }
        let mut result = Ok(());
        for (t, leaving) in by_tier {
            if let Err(e) = self.commit_departures(&mut state, t, &leaving) {
                result = Err(e);
            }
        }
        result.map(|()| out)
    }

    fn evict(&self, node: NodeId, tier: TierId, count: u32) -> Result<u32, Error> {
        let mut state = self.state();
        let t = Self::tier(&state, node, tier)?;
        self.evict_locked(&mut state, t, count, &[])
    }

    fn tier_spec(&self, node: NodeId, tier: TierId) -> Result<Option<TierSpec>, Error> {
        let state = self.read_state();
        Ok(state.tier_index.get(&(node, tier)).map(|&t| state.tiers[t].spec))
    }

    fn tier_stats(&self, node: NodeId, tier: TierId) -> Result<TierStats, Error> {
        let mut state = self.state();
        let t = Self::tier(&state, node, tier)?;
        state.tiers[t].reclaim_expired(Instant::now());
        Ok(state.tiers[t].stats())
    }

    fn announce(&self, node: &NodeAnnouncement, ttl: Duration) -> Result<(), Error> {
        self.state().nodes.insert(node.node, (node.clone(), Instant::now() + ttl));
        Ok(())
    }

    fn nodes(&self) -> Result<Vec<NodeAnnouncement>, Error> {
        let now = Instant::now();
        let mut state = self.state();
        state.nodes.retain(|_, (_, deadline)| *deadline > now);
        let mut nodes: Vec<_> = state.nodes.values().map(|(a, _)| a.clone()).collect();
        nodes.sort_by_key(|a| a.node);
        Ok(nodes)
    }

    fn leave(&self, node: NodeId) -> Result<bool, Error> {
        let now = Instant::now();
        Ok(self.state().nodes.remove(&node).is_some_and(|(_, deadline)| deadline > now))
    }
}

impl EmbeddedIndex {
    /// Published blocks stored durably in the file (a reopen would keep these).
    pub fn durable_blocks(&self) -> Result<u64, Error> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(LOG)?.len()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_value(p: &Placement) -> [u8; LOG_VALUE] {
        let mut v = [0u8; LOG_VALUE];
        v[..16].copy_from_slice(&p.key.0);
        v[16..].copy_from_slice(&p.encode());
        v
    }

    /// A file without the index's tables (a bare redb file) opens, gets them, and keeps
    /// what is published into it.
    #[test]
    fn opens_a_file_without_its_tables() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bare.redb");
        drop(Database::create(&path).unwrap());
        let spec = TierSpec::new(NodeId(0), TierId(1), 64, 8).durable();
        let key = BlockKey::from_u128(5);
        {
            let index = EmbeddedIndex::open(&path).unwrap();
            index.register_tier(&spec).unwrap();
            let Reserved::Slot(r) =
                index.reserve(key, spec.node, spec.tier, 10, Duration::from_secs(60)).unwrap()
            else {
                panic!("a fresh index holds no key")
            };
            index.publish(&[(r, 7)]).unwrap();
        }
        let index = EmbeddedIndex::open(&path).unwrap();
        assert_eq!(index.lookup(&[key]).unwrap()[0].map(|p| p.checksum), Some(7));
    }

    /// What open drops from the log: a key logged twice keeps its first entry, a block of a
    /// slot already taken or past its tier's end, a generation 0 and a value of another
    /// length are dropped (and deleted from the file); every other block is back.
    #[test]
    fn open_keeps_the_first_of_a_key_logged_twice_and_drops_what_cannot_be() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.redb");
        let spec = TierSpec::new(NodeId(0), TierId(1), 64, 8).durable();
        EmbeddedIndex::open(&path).unwrap().register_tier(&spec).unwrap();
        let p = |key: u128, slot: u32, generation: u64| Placement {
            key: BlockKey::from_u128(key),
            node: spec.node,
            tier: spec.tier,
            slot,
            len: 10,
            checksum: key as u32,
            generation,
        };
        let logged = [
            log_value(&p(1, 0, 3)),
            log_value(&p(2, 1, 4)),
            log_value(&p(1, 2, 5)), // key 1 again: dropped
            log_value(&p(3, 1, 6)), // slot 1 taken: dropped
            log_value(&p(4, 8, 7)), // past the tier's 8 slots: dropped
            log_value(&p(5, 3, 0)), // generation 0: dropped
        ];
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut log = txn.open_table(LOG).unwrap();
                for (seq, v) in logged.iter().enumerate() {
                    log.insert(seq as u64, &v[..]).unwrap();
                }
                log.insert(99, &[1u8, 2, 3][..]).unwrap(); // not a block
            }
            txn.commit().unwrap();
        }
        for _ in 0..2 {
            let index = EmbeddedIndex::open(&path).unwrap();
            let keys: Vec<BlockKey> = (1..=5).map(BlockKey::from_u128).collect();
            let found = index.lookup(&keys).unwrap();
            assert_eq!(found, vec![Some(p(1, 0, 3)), Some(p(2, 1, 4)), None, None, None]);
            assert_eq!(index.durable_blocks().unwrap(), 2);
            // Generations go on above every one logged, and slots 0 and 1 stay taken.
            let Reserved::Slot(r) = index
                .reserve(BlockKey::from_u128(9), spec.node, spec.tier, 10, Duration::from_secs(60))
                .unwrap()
            else {
                panic!("key 9 is not published")
            };
            assert!(r.generation > 7 && r.slot > 1, "{r:?}");
            index.abort(&[r]).unwrap();
        }
    }
}
