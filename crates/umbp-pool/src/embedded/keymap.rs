//! The embedded index's map of published keys: an open-addressing table built for batched
//! lookups.
//!
//! A 62,500-key lookup (a 999,936-token prefix) probes a table far larger than the CPU's
//! caches at random places; with a general-purpose map every probe waits for its own cache
//! miss. This table lets a batch's misses overlap: for each group of [`GROUP`] keys it first
//! hashes them all and loads a word of each home slot (loads whose addresses are all known,
//! so the CPU has them in flight together), then probes them, now from cache. In safe Rust:
//! the "prefetch" is an ordinary load.
//!
//! Layout: one `Vec` of 48-byte entries (the key, the slot, length, checksum, generation and
//! the tier's index: a placement without the node and tier ids, which the tier table holds),
//! linear probing from the key's home slot, at most 3/4 full (so a probe is short), removals
//! by backward shift (no tombstones: the table never degrades). An entry with generation 0 is
//! empty: every reservation's generation is at least 1.

use std::hash::BuildHasher;

use crate::BlockKey;

/// Keys whose home slots are loaded together before any of them is probed.
pub(super) const GROUP: usize = 16;

/// What the map holds for a published key.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) key: BlockKey,
    /// The slot's generation; 0 marks an empty entry.
    pub(super) generation: u64,
    pub(super) len: u64,
    pub(super) slot: u32,
    pub(super) checksum: u32,
    /// The tier's index in the state's tier table.
    pub(super) tier: u32,
}

/// Published keys → [`Entry`]. `S` hashes the keys (a per-process seeded hasher: keys are
/// usually hashes already, but any 16 bytes are allowed, so the placement must not be theirs
/// to choose).
pub(super) struct KeyMap<S = foldhash::fast::RandomState> {
    entries: Vec<Entry>,
    /// `entries.len() - 1` (a power of two minus one).
    mask: usize,
    len: usize,
    hasher: S,
}

const MIN_CAPACITY: usize = 16;

impl KeyMap {
    /// An empty map with room for `n` keys before it grows.
    pub(super) fn with_capacity(n: usize) -> Self {
        Self::with_capacity_and_hasher(n, foldhash::fast::RandomState::default())
    }
}

impl<S: BuildHasher> KeyMap<S> {
    pub(super) fn with_capacity_and_hasher(n: usize, hasher: S) -> Self {
        let capacity = capacity_for(n);
        Self { entries: vec![Entry::default(); capacity], mask: capacity - 1, len: 0, hasher }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn home(&self, key: &BlockKey) -> usize {
        (self.hasher.hash_one(u128::from_ne_bytes(key.0)) as usize) & self.mask
    }

    /// The entry index holding `key`, probing from `i`.
    fn find_from(&self, mut i: usize, key: &BlockKey) -> Option<usize> {
        loop {
            let e = &self.entries[i];
            if e.generation == 0 {
                return None;
            }
            if e.key == *key {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    pub(super) fn get(&self, key: &BlockKey) -> Option<&Entry> {
        self.find_from(self.home(key), key).map(|i| &self.entries[i])
    }

    /// Calls `f` with each key's entry (or `None`), in order, until it returns `false`. The
    /// keys' home slots are loaded [`GROUP`] at a time before they are probed, so their cache
    /// misses overlap.
    pub(super) fn for_each_batched(
        &self,
        keys: &[BlockKey],
        mut f: impl FnMut(Option<&Entry>) -> bool,
    ) {
        let mut homes = [0usize; GROUP];
        for group in keys.chunks(GROUP) {
            let mut touched = 0u64;
            for (home, key) in homes.iter_mut().zip(group) {
                *home = self.home(key);
                // The first and last word of the entry: an entry may straddle two lines.
                let e = &self.entries[*home];
                touched ^= u64::from(e.key.0[0]) ^ u64::from(e.tier);
            }
            // Keeps the loads above from being dropped as unused.
            std::hint::black_box(touched);
            for (&home, key) in homes.iter().zip(group) {
                if !f(self.find_from(home, key).map(|i| &self.entries[i])) {
                    return;
                }
            }
        }
    }

    /// Loads the home slots of `keys` (a group of keys about to be inserted or looked up one
    /// by one), so that their cache misses overlap.
    pub(super) fn prefetch<'a>(&self, keys: impl Iterator<Item = &'a BlockKey>) {
        let mut touched = 0u64;
        for key in keys {
            let e = &self.entries[self.home(key)];
            touched ^= u64::from(e.key.0[0]) ^ u64::from(e.tier);
        }
        std::hint::black_box(touched);
    }

    /// Inserts `entry` (its generation must not be 0) under its key; the entry it replaced.
    pub(super) fn insert(&mut self, entry: Entry) -> Option<Entry> {
        debug_assert!(entry.generation != 0, "generation 0 marks an empty entry");
        let mut i = self.home(&entry.key);
        loop {
            let e = &mut self.entries[i];
            if e.generation == 0 {
                break;
            }
            if e.key == entry.key {
                return Some(std::mem::replace(e, entry));
            }
            i = (i + 1) & self.mask;
        }
        if (self.len + 1) * 4 > self.entries.len() * 3 {
            self.grow();
            // The home slot moved: probe again in the larger table.
            i = self.home(&entry.key);
            while self.entries[i].generation != 0 {
                i = (i + 1) & self.mask;
            }
        }
        self.entries[i] = entry;
        self.len += 1;
        None
    }

    fn grow(&mut self) {
        let capacity = self.entries.len() * 2;
        let old = std::mem::replace(&mut self.entries, vec![Entry::default(); capacity]);
        self.mask = capacity - 1;
        for e in old.into_iter().filter(|e| e.generation != 0) {
            let mut i = self.home(&e.key);
            while self.entries[i].generation != 0 {
                i = (i + 1) & self.mask;
            }
            self.entries[i] = e;
        }
    }

    /// Removes `key`; its entry. The entries after it in its run shift back so that every
    /// key stays reachable from its home slot without a gap (backward-shift deletion).
    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let mut hole = self.find_from(self.home(key), key)?;
        let removed = self.entries[hole];
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let e = self.entries[j];
            if e.generation == 0 {
                break;
            }
            // `e` may fill the hole only if the hole lies on its probe path: between its home
            // and `j`, cyclically.
            let home = self.home(&e.key);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.entries[hole] = e;
                hole = j;
            }
        }
        self.entries[hole] = Entry::default();
        self.len -= 1;
        Some(removed)
    }

    /// Every entry, in no particular order.
    pub(super) fn values(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().filter(|e| e.generation != 0)
    }
}

/// The table size for `n` keys: a power of two at most 3/4 full.
fn capacity_for(n: usize) -> usize {
    n.saturating_mul(4).div_ceil(3).next_power_of_two().max(MIN_CAPACITY)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::hash::{BuildHasherDefault, Hasher};

    use super::*;

    /// A hasher that puts every key in one of 8 home slots: long runs, wrap-around at the
    /// table's end, and shifts across it, on every operation.
    #[derive(Default)]
    struct Clustering(u64);
    impl Hasher for Clustering {
        fn finish(&self) -> u64 {
            u64::MAX - 7 + self.0 % 8
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = self.0.wrapping_mul(31).wrapping_add(u64::from(b));
            }
        }
    }

    /// A small deterministic generator (xorshift64*), so a failure repeats from its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    fn entry(key: BlockKey, v: u64) -> Entry {
        Entry {
            key,
            generation: v + 1,
            len: v * 3,
            slot: v as u32,
            checksum: (v >> 3) as u32,
            tier: (v % 5) as u32,
        }
    }

    /// Random inserts, replacements, removals and lookups against `std`'s map, checking every
    /// key of the universe (present or not) through `get`, `for_each_batched` and `values`
    /// every `check_every` steps and after the last.
    fn against_model<S: BuildHasher>(
        mut map: KeyMap<S>,
        seed: u64,
        steps: usize,
        universe: u64,
        check_every: usize,
    ) {
        let mut rng = Rng(seed | 1);
        let mut model: HashMap<BlockKey, Entry> = HashMap::new();
        let keys: Vec<BlockKey> =
            (0..universe).map(|i| BlockKey::from_u128(u128::from(i) << 64 | 0xab)).collect();
        for step in 0..steps {
            let key = keys[(rng.next() % universe) as usize];
            match rng.next() % 10 {
                0..=5 => {
                    let e = entry(key, rng.next() % 1_000_000);
                    assert_eq!(map.insert(e), model.insert(key, e), "seed {seed} step {step}");
                }
                _ => assert_eq!(map.remove(&key), model.remove(&key), "seed {seed} step {step}"),
            }
            assert_eq!(map.len(), model.len());
            if step % check_every == 0 || step + 1 == steps {
                for k in &keys {
                    assert_eq!(map.get(k), model.get(k), "seed {seed} step {step} key {k}");
                }
                let mut batched = Vec::new();
                map.for_each_batched(&keys, |e| {
                    batched.push(e.copied());
                    true
                });
                let expected: Vec<Option<Entry>> =
                    keys.iter().map(|k| model.get(k).copied()).collect();
                assert_eq!(batched, expected, "seed {seed} step {step}");
                let mut values: Vec<Entry> = map.values().copied().collect();
                let mut want: Vec<Entry> = model.values().copied().collect();
                values.sort_by_key(|e| e.key);
                want.sort_by_key(|e| e.key);
                assert_eq!(values, want);
            }
        }
    }

    #[test]
    fn agrees_with_a_std_map_under_random_operations() {
        for seed in 1..=20u64 {
            against_model(KeyMap::with_capacity(0), seed * 0x9e37_79b9, 3_000, 300, 7);
        }
        // Many keys: the table grows through several sizes.
        against_model(KeyMap::with_capacity(0), 77, 20_000, 5_000, 997);
    }

    #[test]
    fn agrees_with_a_std_map_when_every_key_collides() {
        for seed in 1..=20u64 {
            let map =
                KeyMap::with_capacity_and_hasher(0, BuildHasherDefault::<Clustering>::default());
            against_model(map, seed * 0x51_7cc1_b727, 2_000, 100, 3);
        }
    }

    #[test]
    fn batched_lookup_stops_when_told() {
        let mut map = KeyMap::with_capacity(4);
        let keys: Vec<BlockKey> = (0..100).map(BlockKey::from_u128).collect();
        for (i, k) in keys.iter().enumerate() {
            map.insert(entry(*k, i as u64));
        }
        let mut seen = 0;
        map.for_each_batched(&keys, |e| {
            assert!(e.is_some());
            seen += 1;
            seen < 37
        });
        assert_eq!(seen, 37);
    }

    #[test]
    fn capacity_keeps_a_quarter_free() {
        assert_eq!(capacity_for(0), MIN_CAPACITY);
        assert_eq!(capacity_for(12), 16);
        assert_eq!(capacity_for(13), 32);
        assert_eq!(capacity_for(62_500), 131_072);
        let mut map = KeyMap::with_capacity(0);
        for i in 0..1_000u64 {
            map.insert(entry(BlockKey::from_u128(i.into()), i));
            assert!(map.len() * 4 <= map.entries.len() * 3);
        }
    }
}
