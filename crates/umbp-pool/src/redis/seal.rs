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

/// Bytes of a group summary's tag (keyed BLAKE3, truncated).
pub(super) const SUMMARY_TAG: usize = 16;

/// Seals and opens entries and group summaries, each under its own key.
#[derive(Clone)]
pub(super) struct Sealer {
    key: [u8; 16],
    summary_key: [u8; 32],
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(..)")
    }
}

impl Sealer {
    /// A sealer whose key is derived from `secret`, or the public one without a secret.
    pub(super) fn new(secret: Option<&[u8]>) -> Self {
        let derived = blake3::derive_key(CONTEXT, secret.unwrap_or_default());
        let mut key = [0u8; 16];
        key.copy_from_slice(&derived[..16]);
        Self { key, summary_key: blake3::derive_key(SUMMARY_CONTEXT, secret.unwrap_or_default()) }
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

    /// The tag of one part of a summary (`part` 0: its head, 1: the whole value) of `group` in
    /// shard `shard`.
    fn summary_seal(
        &self,
        part: u8,
        group: &[u8; 16],
        shard: usize,
        bytes: &[u8],
    ) -> [u8; SUMMARY_TAG] {
        let mut h = blake3::Hasher::new_keyed(&self.summary_key);
        h.update(&[part]);
        h.update(group);
        h.update(&(shard as u64).to_le_bytes());
        h.update(bytes);
        let mut tag = [0u8; SUMMARY_TAG];
        tag.copy_from_slice(&h.finalize().as_bytes()[..SUMMARY_TAG]);
        tag
    }

    /// The summary value of `group` in shard `shard`; `None` if a placement is missing.
    ///
    /// Layout: the *head* (the number n of distinct nodes, 2 bytes; the nodes, 4 bytes each,
    /// ascending; a tag over them), then the placements of the group's keys in this shard, in
    /// order ([`PLACEMENT_BYTES`] each, as entries hold them), then a tag over everything
    /// before it. All integers big-endian, as the scripts read them. A prefix lookup reads
    /// the head alone ([`summary_head_len`]).
    pub(super) fn encode_summary(
        &self,
        group: &[u8; 16],
        shard: usize,
        placements: &[Option<Placement>],
    ) -> Option<Vec<u8>> {
        let mut nodes =
            placements.iter().map(|p| p.map(|p| p.node.0)).collect::<Option<Vec<u32>>>()?;
        nodes.sort_unstable();
        nodes.dedup();
        let n = u16::try_from(nodes.len()).ok()?;
        let mut out = Vec::with_capacity(
            summary_head_len(nodes.len()) + placements.len() * PLACEMENT_BYTES + SUMMARY_TAG,
        );
        out.extend_from_slice(&n.to_be_bytes());
        out.extend(nodes.iter().flat_map(|n| n.to_be_bytes()));
        let tag = self.summary_seal(0, group, shard, &out);
        out.extend_from_slice(&tag);
        for p in placements.iter().flatten() {
            out.extend_from_slice(&p.encode());
        }
        let tag = self.summary_seal(1, group, shard, &out);
        out.extend_from_slice(&tag);
        Some(out)
    }

    /// The placements (encoded, [`PLACEMENT_BYTES`] each) a summary value of `group` in shard
    /// `shard` holds, or `None` when it was not sealed for that group and shard under this
    /// sealer's key (copied from another group or shard, edited, forged).
    pub(super) fn open_summary<'v>(
        &self,
        group: &[u8; 16],
        shard: usize,
        value: &'v [u8],
    ) -> Option<&'v [u8]> {
        let head =
            summary_head_len(usize::from(u16::from_be_bytes(value.get(..2)?.try_into().ok()?)));
        let len = value.len().checked_sub(SUMMARY_TAG)?;
        if len < head || (len - head) % PLACEMENT_BYTES != 0 {
            return None;
        }
        let (sealed, tag) = value.split_at(len);
        (self.summary_seal(1, group, shard, sealed)[..] == *tag).then_some(&sealed[head..])
    }

    /// The nodes the head of a summary value of `group` in shard `shard` names, or `None` when
    /// it was not sealed for them under this sealer's key.
    pub(super) fn open_summary_head<'v>(
        &self,
        group: &[u8; 16],
        shard: usize,
        head: &'v [u8],
    ) -> Option<impl Iterator<Item = u32> + 'v> {
        let n = usize::from(u16::from_be_bytes(head.get(..2)?.try_into().ok()?));
        if head.len() != summary_head_len(n) {
            return None;
        }
        let (nodes, tag) = head.split_at(head.len() - SUMMARY_TAG);
        (self.summary_seal(0, group, shard, nodes)[..] == *tag).then(|| {
            nodes[2..].chunks_exact(4).map(|n| u32::from_be_bytes([n[0], n[1], n[2], n[3]]))
        })
    }
}

/// Bytes of a summary's head naming `nodes` nodes (see [`Sealer::encode_summary`]).
pub(super) const fn summary_head_len(nodes: usize) -> usize {
    2 + 4 * nodes + SUMMARY_TAG
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
        let mut other = placement(2);
        other.node = NodeId(9);
        let placements = [Some(placement(1)), Some(other), Some(placement(3))];
        let v = a.encode_summary(&group, 3, &placements).unwrap();
        let encoded: Vec<u8> = placements.iter().flat_map(|p| p.unwrap().encode()).collect();
        assert_eq!(a.open_summary(&group, 3, &v), Some(&encoded[..]));
        let head = &v[..summary_head_len(2)];
        let nodes = |head: &[u8]| -> Option<Vec<u32>> {
            a.open_summary_head(&group, 3, head).map(Iterator::collect)
        };
        assert_eq!(nodes(head), Some(vec![3, 9]));
        assert_eq!(a.open_summary(&[8u8; 16], 3, &v), None);
        assert_eq!(a.open_summary(&group, 4, &v), None);
        assert!(a.open_summary_head(&group, 4, head).is_none());
        assert_eq!(Sealer::new(None).open_summary(&group, 3, &v), None);
        for bit in 0..v.len() * 8 {
            let mut edited = v.clone();
            edited[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(a.open_summary(&group, 3, &edited), None, "bit {bit}");
            if bit / 8 < head.len() {
                assert_eq!(nodes(&edited[..head.len()]), None, "bit {bit}");
            }
        }
        for cut in 0..v.len() {
            assert_eq!(a.open_summary(&group, 3, &v[..cut]), None, "{cut} bytes");
            if cut != head.len() {
                assert_eq!(nodes(&v[..cut.min(v.len())]), None, "{cut} bytes");
            }
        }
        // A missing placement makes no summary.
        assert_eq!(a.encode_summary(&group, 3, &[Some(placement(1)), None]), None);
    }
}
