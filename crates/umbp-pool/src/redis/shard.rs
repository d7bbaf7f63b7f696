//! How the pool is cut into shards: each shard is a complete pool of its own keys and of its
//! own share of every tier's slots, under one hash tag (one Redis Cluster slot), so every
//! script touches one shard only and a Cluster spreads the shards over its masters.
//!
//! - A block key belongs to shard `mix(key) % shards` (keys are usually hashes already; the
//!   mix spreads small integers too). The mapping is fixed forever for a pool: the shard
//!   count is recorded in shard 0 and a client with another one is refused at connect.
//! - Slot `g` of every tier belongs to shard `g % shards`: shard `s` hands out slots `s`,
//!   `s + shards`, `s + 2 * shards`, ... and evicts among them, with the tier's watermarks
//!   scaled to its share. A shard whose share is full answers "full" although others may have
//!   room: keys spread evenly, so this matters only for tiers of few slots per shard.
//! - One shard (the default on a standalone server) keeps the unsharded layout: tag `{prefix}`.

use crate::{BlockKey, TierSpec};

/// The shards of one pool.
#[derive(Debug)]
pub(super) struct Shards {
    /// Each shard's hash tag with braces: `{prefix}` alone, or `{prefix.s}`.
    tags: Vec<String>,
    /// `KEYS[1]` of each shard's scripts (`tag:nodes`): what a Cluster routes them by.
    routes: Vec<String>,
}

/// One shard's share of a tier.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) struct Share {
    /// Slots of the tier in this shard.
    pub(super) count: u32,
    /// Its low and high watermarks (the tier's, scaled to the share, rounded up).
    pub(super) low: u32,
    pub(super) high: u32,
    /// Global slot of the share's slot `i`: `i * stride + first`.
    pub(super) stride: u32,
    pub(super) first: u32,
}

impl Shards {
    /// `count` shards (at least 1) of the pool named `prefix`.
    pub(super) fn new(prefix: &str, count: u16) -> Self {
        let tags: Vec<String> = match count {
            0 | 1 => vec![format!("{{{prefix}}}")],
            n => (0..n).map(|s| format!("{{{prefix}.{s}}}")).collect(),
        };
        let routes = tags.iter().map(|t| format!("{t}:nodes")).collect();
        Self { tags, routes }
    }

    /// How many shards.
    pub(super) fn count(&self) -> usize {
        self.tags.len()
    }

    /// Shard `s`'s tag (every script's `ARGV[1]`).
    pub(super) fn tag(&self, s: usize) -> &str {
        &self.tags[s]
    }

    /// Shard `s`'s routing key (every script's `KEYS[1]`).
    pub(super) fn route(&self, s: usize) -> &str {
        &self.routes[s]
    }

    /// The shard of `key`.
    pub(super) fn of(&self, key: &BlockKey) -> usize {
        let n = self.tags.len() as u64;
        if n == 1 {
            return 0;
        }
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&key.0[..8]);
        hi.copy_from_slice(&key.0[8..]);
        let h = (u64::from_le_bytes(lo) ^ u64::from_le_bytes(hi).rotate_left(29))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (((h >> 32) * n) >> 32) as usize
    }

    /// The positions of `keys`, grouped by shard (one list per shard, in order).
    pub(super) fn group<'k>(&self, keys: impl Iterator<Item = &'k BlockKey>) -> Vec<Vec<usize>> {
        let mut groups = vec![Vec::new(); self.tags.len()];
        for (i, k) in keys.enumerate() {
            groups[self.of(k)].push(i);
        }
        groups
    }

    /// Shard `s`'s share of `spec`'s tier.
    pub(super) fn share(&self, spec: &TierSpec, s: usize) -> Share {
        let n = self.tags.len() as u64;
        let total = u64::from(spec.slot_count);
        let count = (total + n - 1 - s as u64) / n;
        let scale = |w: u32| -> u32 {
            if total == 0 {
                return 0;
            }
            (u64::from(w) * count).div_ceil(total).min(count) as u32
        };
        Share {
            count: count as u32,
            low: scale(spec.low_watermark),
            high: scale(spec.high_watermark),
            stride: n as u32,
            first: s as u32,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NodeId, TierId};

    #[test]
    fn one_shard_keeps_the_unsharded_layout() {
        let one = Shards::new("umbp", 1);
        assert_eq!((one.count(), one.tag(0), one.route(0)), (1, "{umbp}", "{umbp}:nodes"));
        assert_eq!(one.of(&BlockKey::from_u128(12345)), 0);
        let spec = TierSpec::new(NodeId(1), TierId(0), 64, 10).watermarks(3, 7);
        assert_eq!(one.share(&spec, 0), Share { count: 10, low: 3, high: 7, stride: 1, first: 0 });
    }

    #[test]
    fn shares_partition_every_slot_once_and_keys_spread() {
        for n in [2u16, 3, 16] {
            let shards = Shards::new("p", n);
            assert_eq!(shards.tag(1), "{p.1}");
            for slots in [0u32, 1, 5, 16, 17, 1000] {
                let spec =
                    TierSpec::new(NodeId(1), TierId(0), 64, slots).watermarks(slots / 4, slots / 2);
                let mut seen = vec![0u32; slots as usize];
                for s in 0..shards.count() {
                    let sh = shards.share(&spec, s);
                    assert!(sh.low <= sh.high && sh.high <= sh.count);
                    for i in 0..sh.count {
                        seen[(i * sh.stride + sh.first) as usize] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{n} shards, {slots} slots: {seen:?}");
            }
            // Small integer keys (as tests use) spread over every shard.
            let mut per = vec![0u32; n as usize];
            for k in 0..(1000 * u128::from(n)) {
                per[shards.of(&BlockKey::from_u128(k))] += 1;
            }
            assert!(per.iter().all(|&c| c > 700 && c < 1300), "{per:?}");
        }
    }
}
