//! Group summaries: a long list of keys looked up without reading one entry per key.
//!
//! A lookup of 62,500 keys (a 999,936-token prefix) read 62,500 entries, and the server's time
//! per entry (about 0.4 µs in `HMGET`) set its floor: 23 to 28 ms on one server, whatever the
//! client did. Now [`lookup`](crate::Index::lookup) and
//! [`prefix_hits`](crate::Index::prefix_hits) cut the keys into *groups*, and a group whose
//! entries were all found live is *summarized*: each shard holding some of its keys stores
//! one sealed value under the group's id (`P:groups`) holding those keys' placements, in
//! order, after a *head* naming the nodes they are on, which is also stored apart
//! (`P:heads`). A later lookup reads one summary per group and shard (about 256 placements in
//! one value) instead of an entry per key; a prefix reads only the heads, and counts a group
//! whole where its nodes are all alive. Entries are read only for the groups without a
//! summary, the head and the tail of the list.
//!
//! Where groups end is decided by the keys, not by their positions: a group ends after a key
//! whose hash has its top byte zero ([`ends_group`]), so about every 256th key. A server asks
//! for the blocks after those it holds in HBM, so the same prefix is asked from different
//! starting blocks; cut by content, the lists share every group. The keys before the first
//! group end (the list's head) and after the last (its tail) are never summarized: they
//! depend on where the list starts and ends, and their summaries would crowd out the shared
//! ones.
//!
//! A group is summarized the second time this client finds it whole, not the first: the
//! keys of a single get (a pool's put then get, say) are looked up once, and summarizing them
//! would only add work to their removal.
//!
//! What keeps a summary true:
//!
//! - **It never outlives a change of an entry.** The summarize script records the group's id
//!   in each of its keys' `member` field, and every script that deletes or replaces an entry
//!   (a removal, an eviction, a dead node's wipe, a publish over a dead entry) first deletes
//!   the summaries (and heads) that field names, in the same atomic script (see
//!   [`scripts`](super::scripts)). The summarize script itself checks, atomically, that every
//!   key's entry still holds the placement the summary gives it, so an entry changed between
//!   the lookup and the summary is caught.
//! - **A dead node's placements are misses**, as from entries: each placement of a summary
//!   counts only while its node is alive (the alive-nodes answer a lookup uses), and a prefix
//!   counts a group only while every node its head names is.
//! - **A Redis writer cannot make one up.** The value is sealed under a key of its own derived
//!   from the cluster secret (keyed BLAKE3: a summary is kilobytes, where SipHash suits the
//!   entries' 38 bytes), over the group's id, the shard and its bytes, the head under a tag of
//!   its own: a summary or head copied to another group or shard, edited or forged is ignored
//!   (the group's entries are read) and counted in
//!   [`forged_entries`](super::RedisIndex::forged_entries). What such a writer can do is what
//!   it can do to entries: delete summaries (the slower path), or store again one that was
//!   valid earlier, whose placements then fail their lease (the slot's generation moved on)
//!   or their load's checksum: a miss or a load error, never another block's bytes.
//!   `prefix_hits` may count such blocks.
//!
//! Costs. Summaries hold each summarized key's placement a second time (30 bytes), and each
//! key's `member` field holds up to [`GROUPS_PER_KEY`](super::scripts::GROUPS_PER_KEY) ids of
//! 16 bytes: 138 bytes of Redis memory per summarized key in all, where the index itself
//! takes 389 (the `pool_figures` example). Summarizing checks and records each key in a
//! script (three commands a key, about three times the server's work of reading its entry),
//! so one lookup summarizes groups of at most [`SUMMARIZE_BUDGET`] keys in all: a long list
//! seen for the first time is summarized over its next lookups, each taking about as long as
//! a lookup of every entry. [`RedisConfig::group_summaries`](super::RedisConfig::group_summaries)
//! turns them off.

use std::ops::Range;

use redis::Value;

use super::{array, corrupt, int, lock, value, FieldRead, RedisIndex};
use crate::placement::PLACEMENT_BYTES;
use crate::{BlockKey, Error, Placement};

/// Keys one lookup summarizes at most (about 16 groups), unless its first group to summarize
/// alone is longer.
pub(super) const SUMMARIZE_BUDGET: usize = 4096;

/// Group ids a client remembers having found whole once (the next time, it summarizes them);
/// forgotten all at once beyond this.
const SEEN_AT_MOST: usize = 1 << 16;

/// Whether a group ends after `key`: one key in 256 on average, decided by the key alone.
fn ends_group(key: &BlockKey) -> bool {
    let v = key.as_u128();
    // Another mix than the shards' (`shard::Shards::of`), so the two are unrelated.
    let h = ((v >> 64) as u64 ^ (v as u64).rotate_left(23)).wrapping_mul(0xd6e8_feb8_6659_fd93);
    h >> 56 == 0
}

/// The groups of `keys`: each range starts after a key that [`ends_group`] and ends after
/// the next one. The keys before the first group (the head) and after the last (the tail)
/// are in none.
fn groups(keys: &[BlockKey]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(keys.len() / 200 + 1);
    let mut start = None;
    for (i, k) in keys.iter().enumerate() {
        if ends_group(k) {
            if let Some(start) = start {
                out.push(start..i + 1);
            }
            start = Some(i + 1);
        }
    }
    out
}

/// The ids of `groups` of `keys`: each the first 16 bytes of the BLAKE3 hash of its keys, in
/// order. The same keys in the same order are the same group wherever they stand in a list.
/// (Hashed as one buffer per group: fed 16 bytes at a time BLAKE3 runs several times slower.)
fn group_ids(keys: &[BlockKey], groups: &[Range<usize>]) -> Vec<[u8; 16]> {
    let mut bytes = Vec::new();
    groups
        .iter()
        .map(|g| {
            bytes.clear();
            bytes.extend(keys[g.clone()].iter().flat_map(|k| k.0));
            let mut id = [0u8; 16];
            id.copy_from_slice(&blake3::hash(&bytes).as_bytes()[..16]);
            id
        })
        .collect()
}

/// Where one value of [`RedisIndex::read_summaries`] goes: its shard, then as
/// [`lookup::Visit`](super::lookup::Visit).
type ShardVisit<'v> =
    dyn FnMut(usize, &[u32], usize, usize, Option<&[u8]>) -> Result<(), Error> + 'v;

/// Where a list's keys stand: its groups, their ids, and what each shard is asked for.
struct Layout {
    groups: Vec<Range<usize>>,
    ids: Vec<[u8; 16]>,
    /// From the first group's start to the last one's end.
    span: Range<usize>,
    /// The shard of each key of `span`.
    shard_of: Vec<usize>,
    /// Per shard, the groups it holds keys of.
    asks: Vec<Vec<usize>>,
    /// Per shard, the positions of its keys in the head and the tail.
    edges: Vec<Vec<usize>>,
}

impl Layout {
    /// `None` for a list without a group.
    fn of(index: &RedisIndex, keys: &[BlockKey]) -> Option<Self> {
        let groups = groups(keys);
        let span = groups.first()?.start..groups.last()?.end;
        let ids = group_ids(keys, &groups);
        let shards = index.shards.count();
        let shard = |k: &BlockKey| if shards == 1 { 0 } else { index.shards.of(k) };
        let shard_of: Vec<usize> = keys[span.clone()].iter().map(shard).collect();
        let mut asks: Vec<Vec<usize>> = vec![Vec::new(); shards];
        let mut holds = vec![false; shards];
        for (j, g) in groups.iter().enumerate() {
            holds.fill(false);
            for i in g.clone() {
                holds[shard_of[i - span.start]] = true;
            }
            for s in (0..shards).filter(|&s| holds[s]) {
                asks[s].push(j);
            }
        }
        let mut edges: Vec<Vec<usize>> = vec![Vec::new(); shards];
        for i in (0..span.start).chain(span.end..keys.len()) {
            edges[shard(&keys[i])].push(i);
        }
        Some(Self { groups, ids, span, shard_of, asks, edges })
    }

    fn shard_at(&self, i: usize) -> usize {
        self.shard_of[i - self.span.start]
    }

    /// The positions of group `j`'s keys in shard `s`, in order.
    fn members(&self, j: usize, s: usize) -> impl Iterator<Item = usize> + Clone + '_ {
        self.groups[j].clone().filter(move |&i| self.shard_at(i) == s)
    }

    /// Runs `run` with shard `s`'s two reads: its groups' values in `hash`, and its entries
    /// in the list's head and tail.
    fn reads<T>(
        &self,
        keys: &[BlockKey],
        hash: &str,
        s: usize,
        run: impl FnOnce(&[FieldRead<'_, '_>]) -> T,
    ) -> T {
        let (asks, edges) = (&self.asks[s], &self.edges[s]);
        let id = |i: usize| &self.ids[asks[i]][..];
        let key = |i: usize| &keys[edges[i]].0[..];
        run(&[(hash, asks.len(), &id), ("blocks", edges.len(), &key)])
    }

    /// Per shard, `[s]` where the shard has something to be asked, else nothing (for
    /// [`RedisIndex::scatter`]).
    fn busy(&self) -> Vec<Vec<usize>> {
        (0..self.asks.len())
            .map(|s| {
                if self.asks[s].is_empty() && self.edges[s].is_empty() {
                    Vec::new()
                } else {
                    vec![s]
                }
            })
            .collect()
    }
}

impl RedisIndex {
    /// [`lookup`](crate::Index::lookup) through group summaries (see the module's
    /// documentation): the summaries of every group and the entries of the head and the tail
    /// in one round trip per shard, then the entries of the groups without a summary, then
    /// summaries for the groups found whole a second time, up to [`SUMMARIZE_BUDGET`] keys.
    pub(super) fn summarized_lookup(
        &self,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<Placement>>, Error> {
        let Some(layout) = Layout::of(self, keys) else { return self.lookup_entries(keys) };
        let Layout { groups, ids, asks, edges, .. } = &layout;
        let mut out: Vec<Option<Placement>> = vec![None; keys.len()];
        let mut covered = vec![true; groups.len()];
        self.read_summaries(keys, &layout, "groups", &mut |s, alive, read, i, v| {
            if read == 1 {
                let at = edges[s][i];
                out[at] = self.entry(keys[at], v, alive);
                return Ok(());
            }
            let j = asks[s][i];
            let placements = v.and_then(|v| {
                let opened = self.sealer.open_summary(&ids[j], s, v);
                if opened.is_none() {
                    self.count_forged(1);
                }
                opened
            });
            let members = layout.members(j, s);
            // A summary holds one placement per key of the group in its shard, in order.
            let count = members.clone().count();
            let Some(given) = placements
                .map(|p| p.chunks_exact(PLACEMENT_BYTES))
                .filter(|given| given.len() == count)
            else {
                covered[j] = false;
                return Ok(());
            };
            for (at, p) in members.zip(given) {
                out[at] = Placement::decode(keys[at], p)
                    .ok()
                    .filter(|p| alive.binary_search(&p.node.0).is_ok());
            }
            Ok(())
        })?;
        // The entries of the groups without a summary.
        let wanted: Vec<usize> = groups
            .iter()
            .zip(&covered)
            .filter(|(_, &covered)| !covered)
            .flat_map(|(g, _)| g.clone())
            .collect();
        if !wanted.is_empty() {
            let wanted_keys: Vec<BlockKey> = wanted.iter().map(|&i| keys[i]).collect();
            for (&i, p) in wanted.iter().zip(self.lookup_entries(&wanted_keys)?) {
                out[i] = p;
            }
        }
        let found = |j: usize| Some(&out[groups[j].clone()]);
        self.summarize_found(keys, &layout, (0..groups.len()).filter(|&j| !covered[j]), found);
        Ok(out)
    }

    /// [`prefix_hits`](crate::Index::prefix_hits) through the heads of group summaries (the
    /// nodes each names): the heads and the entries of the head and the tail in one round trip
    /// per shard, then the entries of the groups without a summary from the first on; a
    /// group counts whole where its summaries' nodes are all alive.
    pub(super) fn summarized_prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        let Some(layout) = Layout::of(self, keys) else {
            return Ok(self.lookup_entries(keys)?.iter().take_while(|p| p.is_some()).count());
        };
        let Layout { groups, ids, span, asks, edges, .. } = &layout;
        let mut edge_found: Vec<Option<Placement>> = vec![None; keys.len() - span.len()];
        let edge_at = |i: usize| if i < span.start { i } else { i - span.len() };
        let mut covered = vec![true; groups.len()];
        self.read_summaries(keys, &layout, "heads", &mut |s, alive, read, i, v| {
            if read == 1 {
                let at = edges[s][i];
                edge_found[edge_at(at)] = self.entry(keys[at], v, alive);
                return Ok(());
            }
            let j = asks[s][i];
            let holds = v.is_some_and(|v| match self.sealer.open_summary_head(&ids[j], s, v) {
                Some(mut nodes) => nodes.all(|n| alive.binary_search(&n).is_ok()),
                None => {
                    self.count_forged(1);
                    false
                }
            });
            covered[j] &= holds;
            Ok(())
        })?;
        // The head must be there whole before any group counts.
        let head = edge_found[..span.start].iter().take_while(|p| p.is_some()).count();
        if head < span.start {
            return Ok(head);
        }
        // The entries of the groups without a summary, from the first such group on.
        let first = covered.iter().position(|c| !c).unwrap_or(groups.len());
        let looked: Vec<usize> = (first..groups.len()).filter(|&j| !covered[j]).collect();
        let mut offsets = Vec::with_capacity(looked.len());
        let mut wanted: Vec<BlockKey> = Vec::new();
        for &j in &looked {
            offsets.push(wanted.len());
            wanted.extend_from_slice(&keys[groups[j].clone()]);
        }
        let found = self.lookup_entries(&wanted)?;
        let mut hits = span.start;
        let mut next = found.iter();
        let mut missed = false;
        for (g, &covered) in groups.iter().zip(&covered) {
            let seen = if covered {
                g.len()
            } else {
                next.by_ref().take(g.len()).take_while(|p| p.is_some()).count()
            };
            hits += seen;
            if seen < g.len() {
                missed = true;
                break;
            }
        }
        if !missed {
            hits += edge_found[span.start..].iter().take_while(|p| p.is_some()).count();
        }
        let found_group = |j: usize| {
            let o = offsets[looked.binary_search(&j).ok()?];
            Some(&found[o..o + groups[j].len()])
        };
        self.summarize_found(keys, &layout, looked.iter().copied(), found_group);
        Ok(hits)
    }

    /// Reads, from every shard with something to ask, the values of its groups in `hash`
    /// (`groups`: summaries, `heads`: their heads; read 0) and the entries of its keys in the
    /// list's head and tail (read 1): one round trip per shard, the shards in parallel (or
    /// through the direct path where there is one). Each value goes to `visit(shard, alive,
    /// read, i, value)`, with `i` its position in the shard's `asks` or `edges`.
    fn read_summaries(
        &self,
        keys: &[BlockKey],
        layout: &Layout,
        hash: &str,
        visit: &mut ShardVisit<'_>,
    ) -> Result<(), Error> {
        if let Some(direct) = &self.direct {
            // One shard: its values decoded where they lie.
            return layout.reads(keys, hash, 0, |r| {
                self.read_direct(direct, r, &mut |alive, read, i, v| visit(0, alive, read, i, v))
            });
        }
        let answers = self.scatter(&layout.busy(), |s, _| {
            layout.reads(keys, hash, s, |r| self.alive_and_fields(s, r))
        })?;
        for (s, (alive, read)) in &answers {
            for (r, values) in read.iter().enumerate() {
                for (i, v) in values.iter().enumerate() {
                    visit(*s, alive, r, i, value(v)?)?;
                }
            }
        }
        Ok(())
    }

    /// Summarizes, up to [`SUMMARIZE_BUDGET`] keys, the groups among `candidates` whose keys
    /// `found` all (a group's placements, in order) the second time this client finds them
    /// whole (the first time, it remembers them). A failure changes no answer: it is logged.
    fn summarize_found<'f>(
        &self,
        keys: &[BlockKey],
        layout: &Layout,
        candidates: impl Iterator<Item = usize>,
        found: impl Fn(usize) -> Option<&'f [Option<Placement>]>,
    ) {
        let mut whole: Vec<(usize, &[Option<Placement>])> = Vec::new();
        {
            let mut seen = lock(&self.seen_groups);
            let mut budget = SUMMARIZE_BUDGET;
            for j in candidates {
                let Some(placements) = found(j).filter(|f| f.iter().all(Option::is_some)) else {
                    continue;
                };
                if seen.insert(layout.ids[j]) {
                    continue; // The first time: remembered.
                }
                let len = layout.groups[j].len();
                if len > budget && budget < SUMMARIZE_BUDGET {
                    break;
                }
                budget = budget.saturating_sub(len);
                whole.push((j, placements));
            }
            if seen.len() > SEEN_AT_MOST {
                seen.clear();
            }
        }
        if !whole.is_empty() {
            match self.summarize(keys, layout, &whole) {
                Ok(stored) => tracing::trace!(stored, "pool: group summaries stored"),
                Err(e) => tracing::debug!(error = %e, "pool: storing group summaries failed"),
            }
        }
    }

    /// Stores the summaries of the groups `whole` (each with its keys' placements, in order)
    /// in every shard holding keys of them: one script call per shard. Returns how many
    /// summaries (of a group in a shard) the scripts stored; the others' entries changed
    /// since they were read.
    fn summarize(
        &self,
        keys: &[BlockKey],
        layout: &Layout,
        whole: &[(usize, &[Option<Placement>])],
    ) -> Result<usize, Error> {
        let mut stored = 0;
        let mut placements = Vec::new();
        for s in 0..self.shards.count() {
            let mut calls = 0;
            let mut args: Vec<Vec<u8>> = Vec::new();
            for &(j, found) in whole {
                let start = layout.groups[j].start;
                placements.clear();
                placements.extend(layout.members(j, s).map(|i| found[i - start]));
                if placements.is_empty() {
                    continue;
                }
                let Some(value) = self.sealer.encode_summary(&layout.ids[j], s, &placements) else {
                    continue;
                };
                args.push(layout.ids[j].to_vec());
                args.push(value);
                args.push(placements.len().to_string().into_bytes());
                args.extend(layout.members(j, s).map(|i| keys[i].0.to_vec()));
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
                stored += usize::from(int("summarize", a)? == 1);
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
    use crate::{Index, NodeAnnouncement, NodeId, Published, Reserved, TierId, TierSpec};
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

    /// Summarizes the first group of `keys` from the placements found before `change` ran.
    fn summarize_after(index: &RedisIndex, keys: &[BlockKey], change: impl FnOnce()) -> usize {
        let layout = Layout::of(index, keys).unwrap();
        let found = index.lookup_entries(keys).unwrap();
        let first = &found[layout.groups[0].clone()];
        assert!(first.iter().all(Option::is_some));
        change();
        index.summarize(keys, &layout, &[(0, first)]).unwrap()
    }

    #[test]
    fn an_entry_changed_since_the_lookup_is_never_summarized() {
        let Some(server) = RedisServer::start() else { return };
        let index = RedisIndex::connect(&server.config("script")).unwrap();
        let keys = tests::keys(900, 3);
        let first = groups(&keys)[0].clone();
        let span = &keys[..first.end];
        store(&index, 1, span);
        // Unchanged: stored.
        assert_eq!(summarize_after(&index, span, || {}), 1);
        // Removed after the lookup: refused.
        let last = keys[first.end - 1];
        assert_eq!(
            summarize_after(&index, span, || {
                index.remove(&[last]).unwrap();
            }),
            0
        );
        store(&index, 1, &[last]);
        // Removed and stored again after the lookup (another slot, on another node): refused
        // too: the summary would hold the old placement.
        assert_eq!(
            summarize_after(&index, span, || {
                index.remove(&[last]).unwrap();
                store(&index, 2, &[last]);
            }),
            0
        );
        index.leave(NodeId(2)).unwrap();
        let found = index.lookup(span).unwrap();
        assert!(found[..first.end - 1].iter().all(Option::is_some));
        assert_eq!(found[first.end - 1], None);
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
        let keys = keys(8, 0);
        let whole = |keys: &[BlockKey]| std::iter::once(0..keys.len()).collect::<Vec<_>>();
        let id = |keys: &[BlockKey]| group_ids(keys, &whole(keys))[0];
        let first = id(&keys[..4]);
        assert_eq!(id(&keys[..4]), first);
        // Wherever the group stands.
        assert_eq!(group_ids(&keys, &[4..8, 0..4])[1], first);
        let mut swapped = keys[..4].to_vec();
        swapped.swap(1, 2);
        assert_ne!(id(&swapped), first);
        assert_ne!(id(&keys[..3]), first);
        let mut other = keys[..4].to_vec();
        other[3] = BlockKey::from_u128(99);
        assert_ne!(id(&other), first);
    }

    #[test]
    fn groups_are_cut_by_the_keys_so_any_start_shares_them() {
        let keys = keys(62_500, 7);
        let all = groups(&keys);
        // About one key in 256 ends a group; the groups follow each other from the first
        // group end to the last, each ending where a key says so.
        assert!((180..320).contains(&all.len()), "{} groups", all.len());
        assert!(all[0].start > 0 && ends_group(&keys[all[0].start - 1]));
        assert!(all.windows(2).all(|w| w[0].end == w[1].start && !w[1].is_empty()));
        assert!(all.iter().all(|g| ends_group(&keys[g.end - 1])));
        // Asked from another starting block, the list makes the same groups, but for those
        // that started before it.
        for start in [1, 100, 255, 10_000] {
            let shifted: Vec<_> =
                groups(&keys[start..]).iter().map(|g| g.start + start..g.end + start).collect();
            let same: Vec<_> = all.iter().filter(|g| g.start >= start).cloned().collect();
            assert_eq!(shifted, same, "from block {start}");
        }
    }
}
