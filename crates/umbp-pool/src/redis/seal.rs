//! Seals on the Redis index's entries: the index is not trusted with the bytes.
//!
//! A block's entry holds its placement and the CRC32C of its bytes; loads verify the bytes
//! against that checksum. On its own, the checksum binds the bytes to the entry, not the
//! entry to its key: with the Redis password alone, copying K2's entry under K1 (and K1 into
//! the slot's owner) made a get of K1 load K2's bytes as a verified hit. So every entry also
//! carries a seal, a 64-bit SipHash-2-4 of the key and the whole placement value (node, tier,
//! slot, length, checksum, generation), and an entry whose seal does not match its key is
//! absent: a miss, counted ([`RedisIndex::forged_entries`](super::RedisIndex::forged_entries)).
//!
//! - With a cluster secret ([`RedisConfig::secret`](super::RedisConfig::secret)) the SipHash
//!   key is derived from it (BLAKE3's key derivation), so a Redis writer without the secret
//!   cannot make an entry that verifies: a copied or edited entry, or one made up, is a miss.
//!   What it can still do is what any writer of the store can: delete entries (misses),
//!   replay an entry of the same key that was valid earlier (its slot's generation or its
//!   checksum then fails the lease or the load: a miss or a load error), and fill the store.
//! - Without one the key is public: the seal catches entries copied or moved between keys by
//!   hand or by a buggy client, not a writer who computes seals on purpose.
//!
//! SipHash rather than keyed BLAKE3: the values are 38 bytes and a batched lookup opens
//! every one it finds. Measured on the development machine (one core, 62,500 values of 46
//! bytes): SipHash-2-4 2.8 ms, keyed BLAKE3 6.3 ms. 64-bit tags suffice here: a forger gets
//! one guess per load it can make the server's clients attempt.

use std::hash::Hasher;

use siphasher::sip::SipHasher24;

use crate::placement::PLACEMENT_BYTES;
use crate::{BlockKey, Placement};

/// Bytes of a seal.
const SEAL_BYTES: usize = 8;

/// Bytes of a sealed value in Redis: the placement, then its seal.
pub(super) const SEALED_BYTES: usize = PLACEMENT_BYTES + SEAL_BYTES;

/// BLAKE3 key-derivation context of the seal key: names this use of the secret, so the key
/// is unrelated to anything else derived from the same secret (the remote channel's keys).
const CONTEXT: &str = "umbp-pool 2026-12 redis entry seal";

/// The context of the group summaries' seal key (see [`summary`](super::summary)): a key of
/// its own, so no entry's seal is ever a summary's, whatever bytes the two cover.
const SUMMARY_CONTEXT: &str = "umbp-pool 2026-12 redis group summary seal";

/// Seals and opens entries and group summaries, each under its own key.
#[derive(Clone)]
pub(super) struct Sealer {
    key: [u8; 16],
    summary_key: [u8; 16],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A sealer whose key is derived from `secret`, or the public one without a secret.
    pub(super) fn new(secret: Option<&[u8]>) -> Self {
        let derive = |context: &str| {
            let derived = blake3::derive_key(context, secret.unwrap_or_default());
            let mut key = [0u8; 16];
            key.copy_from_slice(&derived[..16]);
            key
        };
        Self { key: derive(CONTEXT), summary_key: derive(SUMMARY_CONTEXT) }
    }

    fn seal(&self, key: &BlockKey, value: &[u8]) -> [u8; SEAL_BYTES] {
        let mut h = SipHasher24::new_with_key(&self.key);
        h.write(&key.0);
        h.write(value);
        h.finish().to_le_bytes()
    }

    /// The value stored for `p`: its placement, then the seal.
    pub(super) fn encode(&self, p: &Placement) -> [u8; SEALED_BYTES] {
        let mut out = [0u8; SEALED_BYTES];
        out[..PLACEMENT_BYTES].copy_from_slice(&p.encode());
        let seal = self.seal(&p.key, &out[..PLACEMENT_BYTES]);
        out[PLACEMENT_BYTES..].copy_from_slice(&seal);
        out
    }

    /// The placement of `key` stored as `value`, or `None` when the value is not one sealed
    /// for this key under this sealer's key (wrong length, another key's, edited, forged).
    pub(super) fn open(&self, key: BlockKey, value: &[u8]) -> Option<Placement> {
        if value.len() != SEALED_BYTES {
            return None;
        }
        let (placement, seal) = value.split_at(PLACEMENT_BYTES);
        // Not a secret compared with a secret: the tag is of data the reader holds, and a
        // forger learns nothing from the timing of one comparison per guess it cannot see.
        if self.seal(&key, placement)[..] != *seal {
            return None;
        }
        Placement::decode(key, placement).ok()
    }

    fn summary_seal(&self, group: &[u8; 16], shard: usize, nodes: &[u8]) -> [u8; SEAL_BYTES] {
        let mut h = SipHasher24::new_with_key(&self.summary_key);
        h.write(group);
        h.write(&(shard as u64).to_le_bytes());
        h.write(nodes);
        h.finish().to_le_bytes()
    }

    /// The summary value of `group` in shard `shard`: the nodes its blocks there were on
    /// (4 bytes each, big-endian, as the scripts read them), then the seal.
    pub(super) fn encode_summary(&self, group: &[u8; 16], shard: usize, nodes: &[u32]) -> Vec<u8> {
        let mut out: Vec<u8> = nodes.iter().flat_map(|n| n.to_be_bytes()).collect();
        let seal = self.summary_seal(group, shard, &out);
        out.extend_from_slice(&seal);
        out
    }

    /// The nodes a summary value of `group` in shard `shard` names, or `None` when it was not
    /// sealed for that group and shard under this sealer's key (copied from another group or
    /// shard, edited, forged).
    pub(super) fn open_summary<'v>(
        &self,
        group: &[u8; 16],
        shard: usize,
        value: &'v [u8],
    ) -> Option<impl Iterator<Item = u32> + 'v> {
        let nodes_len = value.len().checked_sub(SEAL_BYTES)?;
        if nodes_len % 4 != 0 {
            return None;
        }
        let (nodes, seal) = value.split_at(nodes_len);
        if self.summary_seal(group, shard, nodes)[..] != *seal {
            return None;
        }
        Some(nodes.chunks_exact(4).map(|n| u32::from_be_bytes([n[0], n[1], n[2], n[3]])))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{NodeId, TierId};

    fn placement(k: u128) -> Placement {
        Placement {
            key: BlockKey::from_u128(k),
            node: NodeId(3),
            tier: TierId(1),
            slot: 17,
            len: 4096,
            checksum: 0xdead_beef,
            generation: 1_700_000_000_000_000,
        }
    }

    #[test]
    fn a_value_opens_for_its_own_key_and_sealer_only() {
        let a = Sealer::new(Some(b"cluster secret"));
        let p = placement(1);
        let v = a.encode(&p);
        assert_eq!(a.open(p.key, &v), Some(p));
        // Another key (a copy), another secret, no secret, a wrong length: absent.
        assert_eq!(a.open(BlockKey::from_u128(2), &v), None);
        assert_eq!(Sealer::new(Some(b"other")).open(p.key, &v), None);
        assert_eq!(Sealer::new(None).open(p.key, &v), None);
        assert_eq!(a.open(p.key, &v[..PLACEMENT_BYTES]), None);
        // Every single bit flipped anywhere in the value: absent.
        for bit in 0..SEALED_BYTES * 8 {
            let mut edited = v;
            edited[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(a.open(p.key, &edited), None, "bit {bit}");
        }
        // Without a secret the seal still binds the value to its key.
        let public = Sealer::new(None);
        let v = public.encode(&p);
        assert_eq!(public.open(p.key, &v), Some(p));
        assert_eq!(public.open(BlockKey::from_u128(2), &v), None);
    }

    #[test]
    fn a_summary_opens_for_its_own_group_and_shard_only() {
        let a = Sealer::new(Some(b"cluster secret"));
        let group = [7u8; 16];
        let v = a.encode_summary(&group, 3, &[1, 9, 70_000]);
        let nodes = |v: &[u8], g: &[u8; 16], s| a.open_summary(g, s, v).map(Iterator::collect);
        assert_eq!(nodes(&v, &group, 3), Some(vec![1, 9, 70_000]));
        assert_eq!(nodes(&v, &[8u8; 16], 3), None::<Vec<u32>>);
        assert_eq!(nodes(&v, &group, 4), None);
        assert_eq!(Sealer::new(None).open_summary(&group, 3, &v).map(|_| ()), None);
        for bit in 0..v.len() * 8 {
            let mut edited = v.clone();
            edited[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(nodes(&edited, &group, 3), None, "bit {bit}");
        }
        for cut in 0..v.len() {
            assert_eq!(nodes(&v[..cut], &group, 3), None, "{cut} bytes");
        }
        // An entry's seal is no summary's: the same bytes under the two keys differ.
        let p = placement(1);
        let entry = a.encode(&p);
        let mut as_group = [0u8; 16];
        as_group.copy_from_slice(&p.key.0);
        assert_eq!(a.open_summary(&as_group, 0, &entry).map(|_| ()), None);
    }
}
