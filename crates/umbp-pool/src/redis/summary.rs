//! Group summaries: a long prefix answered without reading one entry per block.
//!
//! A prefix lookup of 62,500 keys used to read 62,500 entries, and the server's time per entry
//! (about 0.37 µs in `HMGET`) set its floor: 23 ms on one server, whatever the client did.
//! Now [`prefix_hits`](crate::Index::prefix_hits) cuts the keys into *groups*, and a group
//! whose blocks were all found live is *summarized*: each shard holding some of its blocks
//! stores one sealed value under the group's id saying "all of this group's blocks here are
//! published, on these nodes". The next prefix lookup reads one summary per group and shard
//! instead of an entry per block, and reads entries only for the groups without a summary and
//! for the tail.
//!
//! Where groups end is decided by the keys, not by their positions: a group ends after a key
//! whose hash has its top byte zero ([`ends_group`]), so about every 256th key. A server asks
//! for the blocks after those it already holds in HBM, so the same prefix is asked from
//! different starting blocks; cut by position, every starting block would make other groups.
//! Cut by content, the lists share every group but the first, partial one. The keys after the
//! last group end (the tail, about 256 blocks) are always looked up: a prefix that grows
//! would make a new tail group at every ask.
//!
//! What keeps a summary true:
//!
//! - **It never outlives a block.** The summarize script records the group's id in each of
//!   its keys' `member` field, and every script that deletes or replaces an entry (a removal,
//!   an eviction, a dead node's wipe, a publish over a dead entry) first deletes the
//!   summaries that field names, in the same atomic script (see [`scripts`](super::scripts)).
//!   The summarize script itself checks, atomically, that every key still has an entry on one
//!   of the summary's nodes, so a block removed between the lookup and the summary is caught.
//! - **A dead node's blocks are not counted.** A summary names the nodes its blocks were on,
//!   and counts only while they are all alive (the same alive-nodes answer a lookup uses).
//! - **A Redis writer cannot make one up.** The value is sealed like an entry, under a key of
//!   its own derived from the cluster secret, over the group's id, the shard and the nodes: a
//!   summary copied to another group or shard, edited or forged is ignored (the group is
//!   looked up entry by entry) and counted in
//!   [`forged_entries`](super::RedisIndex::forged_entries). What such a writer can do is what
//!   it can do to entries: delete summaries (the slower path), or store again a summary that
//!   was valid earlier after its blocks went, which makes `prefix_hits` count blocks that are
//!   gone. Their loads then miss, as a replayed entry's do: a load error, never another
//!   block's bytes.
//!
//! Costs. A summary is one value of 12 bytes or more per group and shard, and each
//! summarized key's `member` field holds up to [`GROUPS_PER_KEY`](super::scripts::GROUPS_PER_KEY)
//! ids of 16 bytes: 104 bytes of Redis memory per summarized block in all, where the index
//! itself takes 389 (the `pool_figures` example). Summarizing checks and records each key in a script (three commands a
//! key, about three times the server's work of reading its entry), so one prefix lookup
//! summarizes groups of at most [`SUMMARIZE_BUDGET`] blocks in all: a long prefix seen for
//! the first time is summarized over several lookups, none much slower than one without
//! summaries.

use std::ops::Range;

use redis::Value;

use super::{array, bytes, corrupt, RedisIndex};
use crate::{BlockKey, Error, Index, Placement};

/// Blocks one prefix lookup summarizes at most (about 16 groups), unless its first group
/// alone is longer.
pub(super) const SUMMARIZE_BUDGET: usize = 4096;

/// Whether a group ends after `key`: one key in 256 on average, decided by the key alone.
fn ends_group(key: &BlockKey) -> bool {
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&key.0[..8]);
    hi.copy_from_slice(&key.0[8..]);
    // Another mix than the shards' (`shard::Shards::of`), so the two are unrelated.
    let h = (u64::from_le_bytes(hi) ^ u64::from_le_bytes(lo).rotate_left(23))
        .wrapping_mul(0xd6e8_feb8_6659_fd93);
    h >> 56 == 0
}

/// The groups of `keys`: each range ends after a key that [`ends_group`]; the keys after the
/// last such key are the tail, in no group.
fn groups(keys: &[BlockKey]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(keys.len() / 200 + 1);
    let mut start = 0;
    for (i, k) in keys.iter().enumerate() {
        if ends_group(k) {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    out
}

/// A group's id: the first 16 bytes of the BLAKE3 hash of its keys, in order. The same keys
/// in the same order are the same group wherever they stand in a prefix.
fn group_id(keys: &[BlockKey]) -> [u8; 16] {
    let mut h = blake3::Hasher::new();
    for k in keys {
        h.update(&k.0);
    }
    let mut id = [0u8; 16];
    id.copy_from_slice(&h.finalize().as_bytes()[..16]);
    id
}

impl RedisIndex {
    /// [`prefix_hits`](crate::Index::prefix_hits) through group summaries (see the module's
    /// documentation): the summaries of every group, then the entries of the groups without
    /// one (from the first such group on) and of the tail, then summaries for the first
    /// groups just found whole, up to [`SUMMARIZE_BUDGET`] blocks.
    pub(super) fn summarized_prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        let groups = groups(keys);
        let tail = groups.last().map_or(0, |g| g.end);
        let ids: Vec<[u8; 16]> = groups.iter().map(|g| group_id(&keys[g.clone()])).collect();
        let shards = self.shards.count();
        let shard_of: Vec<usize> =
            keys[..tail].iter().map(|k| if shards == 1 { 0 } else { self.shards.of(k) }).collect();

        // The groups each shard holds blocks of, and their summaries there.
        let mut asks: Vec<Vec<usize>> = vec![Vec::new(); shards];
        let mut holds = vec![false; shards];
        for (j, g) in groups.iter().enumerate() {
            holds.fill(false);
            for &s in &shard_of[g.clone()] {
                holds[s] = true;
            }
            for s in (0..shards).filter(|&s| holds[s]) {
                asks[s].push(j);
            }
        }
        let answers = self.scatter(&asks, |s, js| {
            self.alive_and_fields(s, "groups", js.len(), |i| &ids[js[i]][..])
        })?;
        let mut covered = vec![true; groups.len()];
        for (s, (alive, values)) in &answers {
            for (&j, v) in asks[*s].iter().zip(values) {
                let holds = match v {
                    Value::Nil => false,
                    v => match self.sealer.open_summary(&ids[j], *s, bytes("summary", v)?) {
                        Some(mut nodes) => nodes.all(|n| alive.contains(&n)),
                        None => {
                            self.count_forged(1);
                            false
                        }
                    },
                };
                covered[j] &= holds;
            }
        }

        // The entries of the groups without a summary, from the first on, and of the tail.
        let first = covered.iter().position(|c| !c).unwrap_or(groups.len());
        let looked: Vec<usize> = (first..groups.len()).filter(|&j| !covered[j]).collect();
        let mut wanted: Vec<BlockKey> = Vec::new();
        for &j in &looked {
            wanted.extend_from_slice(&keys[groups[j].clone()]);
        }
        wanted.extend_from_slice(&keys[tail..]);
        let found = if wanted.is_empty() { Vec::new() } else { self.lookup(&wanted)? };

        // The prefix: summarized groups whole, the others block by block, to the first miss.
        let mut hits = 0;
        let mut whole = Vec::new();
        let mut next = found.iter();
        let mut at = 0;
        let mut missed = false;
        for (j, (g, &covered)) in groups.iter().zip(&covered).enumerate() {
            if covered {
                hits += g.len();
                continue;
            }
            let seen = next.by_ref().take(g.len()).take_while(|p| p.is_some()).count();
            hits += seen;
            if seen < g.len() {
                missed = true;
                break;
            }
            whole.push((j, &found[at..at + g.len()]));
            at += g.len();
        }
        if !missed {
            // What is left of the entries is the tail's.
            hits += next.take_while(|p| p.is_some()).count();
        }

        // Summaries for the first groups found whole. A failure here changes no answer.
        let mut budget = SUMMARIZE_BUDGET;
        let within = whole
            .iter()
            .take_while(|(j, _)| {
                let fits = groups[*j].len() <= budget || budget == SUMMARIZE_BUDGET;
                budget = budget.saturating_sub(groups[*j].len());
                fits
            })
            .count();
        whole.truncate(within);
        if !whole.is_empty() {
            match self.summarize(keys, &groups, &ids, &shard_of, &whole) {
                Ok(stored) => tracing::trace!(stored, "pool: group summaries stored"),
                Err(e) => tracing::debug!(error = %e, "pool: storing group summaries failed"),
            }
        }
        Ok(hits)
    }

    /// Stores the summaries of `whole` (each a group's index and its blocks' placements, all
    /// found live) in every shard holding blocks of them: one script call per shard. Returns
    /// how many summaries (of a group in a shard) the scripts stored; the others' blocks
    /// changed since they were found.
    fn summarize(
        &self,
        keys: &[BlockKey],
        groups: &[Range<usize>],
        ids: &[[u8; 16]],
        shard_of: &[usize],
        whole: &[(usize, &[Option<Placement>])],
    ) -> Result<usize, Error> {
        let mut stored = 0;
        let mut nodes = Vec::new();
        let mut members = Vec::new();
        for s in 0..self.shards.count() {
            let mut calls = 0;
            let mut args: Vec<Vec<u8>> = Vec::new();
            'groups: for &(j, placements) in whole {
                nodes.clear();
                members.clear();
                for (at, p) in groups[j].clone().zip(placements) {
                    if shard_of[at] == s {
                        let Some(p) = p else { continue 'groups };
                        nodes.push(p.node.0);
                        members.push(keys[at]);
                    }
                }
                if members.is_empty() {
                    continue;
                }
                nodes.sort_unstable();
                nodes.dedup();
                args.push(ids[j].to_vec());
                args.push(self.sealer.encode_summary(&ids[j], s, &nodes));
                args.push(members.len().to_string().into_bytes());
                args.extend(members.iter().map(|k| k.0.to_vec()));
                calls += 1;
            }
            if calls == 0 {
                continue;
            }
            let v: Value = self.run(&self.scripts.summarize, s, |inv| {
                for a in &args {
                    inv.arg(&a[..]);
                }
            })?;
            let answers = array("summarize", &v)?;
            if answers.len() != calls {
                return Err(corrupt("summarize", &v));
            }
            for a in answers {
                stored += usize::from(super::int("summarize", a)? == 1);
            }
        }
        Ok(stored)
    }
}

/// The summarize script against a real server: what changed between a lookup and the
/// summary it would make is caught there, atomically.
#[cfg(all(test, feature = "redis-server"))]
mod script_tests {
    use super::*;
    use crate::redis_server::RedisServer;
    use crate::{NodeAnnouncement, NodeId, Published, Reserved, TierId, TierSpec};
    use std::time::Duration;

    const TTL: Duration = Duration::from_secs(60);

    fn store(index: &RedisIndex, node: u32, keys: &[BlockKey]) {
        let spec = TierSpec::new(NodeId(node), TierId(0), 16, 1000).watermarks(0, 0);
        let a = NodeAnnouncement { node: spec.node, address: "n".into(), tiers: vec![] };
        index.announce(&a, TTL).unwrap();
        index.register_tier(&spec).unwrap();
        let items: Vec<(BlockKey, u64)> = keys.iter().map(|&k| (k, 16)).collect();
        let batch: Vec<_> = index
            .reserve_many(spec.node, spec.tier, &items, TTL)
            .unwrap()
            .into_iter()
            .map(|r| match r.unwrap() {
                Reserved::Slot(r) => (r, 0),
                other => panic!("{other:?}"),
            })
            .collect();
        let out = index.publish(&batch).unwrap();
        assert!(out.iter().all(|p| matches!(p, Published::Won(_))));
    }

    /// Summarizes the first group of `keys` from placements found before `change` ran.
    fn summarize_after(index: &RedisIndex, keys: &[BlockKey], change: impl FnOnce()) -> usize {
        let groups = groups(keys);
        let ids: Vec<_> = groups.iter().map(|g| group_id(&keys[g.clone()])).collect();
        let found = index.lookup(&keys[groups[0].clone()]).unwrap();
        assert!(found.iter().all(Option::is_some));
        change();
        let shard_of = vec![0; groups[0].end];
        index.summarize(keys, &groups[..1], &ids, &shard_of, &[(0, &found)]).unwrap()
    }

    #[test]
    fn a_block_removed_or_moved_since_the_lookup_is_never_summarized() {
        let Some(server) = RedisServer::start() else { return };
        let index = RedisIndex::connect(&server.config("script")).unwrap();
        let keys = tests::keys(600, 3);
        let first = groups(&keys)[0].clone();
        store(&index, 1, &keys[first.clone()]);
        // Unchanged: stored, and the prefix is answered from it.
        assert_eq!(summarize_after(&index, &keys, || {}), 1);
        // Removed after the lookup: refused.
        let last = keys[first.end - 1];
        assert_eq!(
            summarize_after(&index, &keys, || {
                index.remove(&[last]).unwrap();
            }),
            0
        );
        assert_eq!(index.prefix_hits(&keys[first.clone()]).unwrap(), first.len() - 1);
        store(&index, 1, &[last]);
        // Removed and stored again on another node after the lookup: refused too (the
        // summary would name node 1 only, and node 2's death would go unseen).
        assert_eq!(
            summarize_after(&index, &keys, || {
                index.remove(&[last]).unwrap();
                store(&index, 2, &[last]);
            }),
            0
        );
        index.leave(NodeId(2)).unwrap();
        assert_eq!(index.prefix_hits(&keys[first.clone()]).unwrap(), first.len() - 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn keys(n: u128, salt: u128) -> Vec<BlockKey> {
        (0..n)
            .map(|i| BlockKey::from_u128((i ^ salt).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c)))
            .collect()
    }

    #[test]
    fn a_group_is_named_by_its_keys_in_order() {
        let keys = keys(4, 0);
        let id = group_id(&keys);
        assert_eq!(group_id(&keys), id);
        let mut swapped = keys.clone();
        swapped.swap(1, 2);
        assert_ne!(group_id(&swapped), id);
        assert_ne!(group_id(&keys[..3]), id);
        let mut other = keys.clone();
        other[3] = BlockKey::from_u128(99);
        assert_ne!(group_id(&other), id);
    }

    #[test]
    fn groups_are_cut_by_the_keys_so_any_start_shares_them() {
        let keys = keys(62_500, 7);
        let all = groups(&keys);
        // About one key in 256 ends a group; the groups tile the keys up to the tail.
        assert!((180..320).contains(&all.len()), "{} groups", all.len());
        assert_eq!(all[0].start, 0);
        assert!(all.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
        // Asked from another starting block, the list makes the same groups after its first.
        for start in [1, 100, 255, 10_000] {
            let shifted: Vec<_> =
                groups(&keys[start..]).iter().map(|g| g.start + start..g.end + start).collect();
            let same: Vec<_> = all.iter().filter(|g| g.start >= shifted[0].end).cloned().collect();
            assert_eq!(&shifted[1..], &same[..], "from block {start}");
            assert_eq!(shifted[0].end, all.iter().find(|g| g.end > start).unwrap().end);
        }
    }
}
