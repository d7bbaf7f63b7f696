//! Where a block is: nodes, tiers, placements, reservations and the outcomes of the index's
//! operations.

use std::fmt;
use std::time::Duration;

use crate::{BlockKey, Error};

/// A node of the pool (an instance's host, a memory node): a number chosen by the deployment,
/// unique in one pool.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct NodeId(pub u32);

/// A tier of one node (its DRAM arena, an SSD file, an exported region): a number chosen by
/// the node, unique on that node.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct TierId(pub u16);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for TierId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where a published block is: which node, which tier, which fixed-size slot of it, how many
/// bytes, their CRC32C and the slot's generation when the block was written.
///
/// A placement is a snapshot: the slot may since have been evicted and reused. Before loading,
/// take a [lease](crate::Index::lease) on it: the index grants it only if the slot still holds
/// this key at this generation, and keeps it from being reused until the lease ends.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Placement {
    /// The block.
    pub key: BlockKey,
    /// The node holding it.
    pub node: NodeId,
    /// The tier of that node.
    pub tier: TierId,
    /// The slot inside the tier: bytes `slot * slot_size .. + len` of the tier's region.
    pub slot: u32,
    /// The block's length in bytes (at most the tier's slot size).
    pub len: u64,
    /// CRC32C (Castagnoli) of the block's bytes, recorded at publish.
    pub checksum: u32,
    /// The slot's generation when this block was reserved: a new one each time the slot is
    /// reserved, so a placement from before a reuse never matches again.
    pub generation: u64,
}

/// The encoded size of a placement's value (everything but the key).
pub(crate) const PLACEMENT_BYTES: usize = 30;

impl Placement {
    /// Checks `bytes` (the block as loaded) against the length and checksum recorded at publish.
    /// A mismatch is [`Error::ChecksumMismatch`]: a load error, never a hit.
    pub fn verify(&self, bytes: &[u8]) -> Result<(), Error> {
        let actual = checksum(bytes);
        if bytes.len() as u64 != self.len || actual != self.checksum {
            return Err(Error::ChecksumMismatch { key: self.key, expected: self.checksum, actual });
        }
        Ok(())
    }

    /// The value stored for the key: node, tier, slot, len, checksum, generation, big-endian.
    pub(crate) fn encode(&self) -> [u8; PLACEMENT_BYTES] {
        let mut b = [0u8; PLACEMENT_BYTES];
        b[0..4].copy_from_slice(&self.node.0.to_be_bytes());
        b[4..6].copy_from_slice(&self.tier.0.to_be_bytes());
        b[6..10].copy_from_slice(&self.slot.to_be_bytes());
        b[10..18].copy_from_slice(&self.len.to_be_bytes());
        b[18..22].copy_from_slice(&self.checksum.to_be_bytes());
        b[22..30].copy_from_slice(&self.generation.to_be_bytes());
        b
    }

    /// The placement of `key` from its stored value.
    pub(crate) fn decode(key: BlockKey, b: &[u8]) -> Result<Self, Error> {
        if b.len() != PLACEMENT_BYTES {
            return Err(Error::Corrupt(format!(
                "placement of {key} has {} bytes, expected {PLACEMENT_BYTES}",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(a)
        };
        Ok(Self {
            key,
            node: NodeId(u32_at(0)),
            tier: TierId(u16::from_be_bytes([b[4], b[5]])),
            slot: u32_at(6),
            len: u64_at(10),
            checksum: u32_at(18),
            generation: u64_at(22),
        })
    }
}

/// CRC32C (Castagnoli) of `bytes`, hardware-accelerated where the CPU has it: the checksum a
/// [`Placement`] records.
pub fn checksum(bytes: &[u8]) -> u32 {
    umbp_plan::checksum::crc32c_append(0, bytes)
}

/// A slot reserved for one key: the caller writes the block's bytes into it, then
/// [publishes](crate::Index::publish) it (or [aborts](crate::Index::abort)). Until then the key
/// is invisible to lookups. A reservation not published before its TTL runs out is freed by
/// the index, and a publish after that returns [`Published::Expired`].
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Reservation {
    /// The key being written.
    pub key: BlockKey,
    /// The node of the slot.
    pub node: NodeId,
    /// The tier of the slot.
    pub tier: TierId,
    /// The slot: write the block at byte `slot * slot_size` of the tier's region.
    pub slot: u32,
    /// The block's length, as reserved.
    pub len: u64,
    /// The slot's new generation (the published placement carries it).
    pub generation: u64,
}

impl Reservation {
    /// The placement this reservation becomes when published with `checksum`.
    pub fn placement(&self, checksum: u32) -> Placement {
        Placement {
            key: self.key,
            node: self.node,
            tier: self.tier,
            slot: self.slot,
            len: self.len,
            checksum,
            generation: self.generation,
        }
    }
}

/// The answer to [`Index::reserve`](crate::Index::reserve).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Reserved {
    /// A slot for the caller to write into.
    Slot(Reservation),
    /// The key is already published: nothing to write.
    Present(Placement),
}

/// The outcome of publishing one reservation ([`Index::publish`](crate::Index::publish)).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Published {
    /// This publish made the key visible at this placement.
    Won(Placement),
    /// Another writer published the key first; this reservation's slot was freed, and the key
    /// is visible at the winner's placement.
    Lost {
        /// The placement that lookups return.
        winner: Placement,
    },
    /// The reservation had expired (or was aborted, or its node left the pool): nothing was
    /// published and its slot is free or already reused.
    Expired,
}

/// The outcome of removing one key ([`Index::remove`](crate::Index::remove)).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum Removed {
    /// The key was published and is gone; its slot is free.
    Removed,
    /// The key was not published.
    Absent,
    /// A reader holds a lease on the key's slot: it stays until the lease ends.
    Leased,
}

/// Leases taken by one reader ([`Index::lease`](crate::Index::lease)).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Lease {
    /// The lease's id, for [`renew`](crate::Index::renew) and
    /// [`release`](crate::Index::release).
    pub id: u64,
    /// One flag per placement asked for: `true` when the slot still holds that key at that
    /// generation (and its node is alive), so the lease protects it; `false` is a miss.
    pub granted: Vec<bool>,
    /// How long the lease lasts unless renewed.
    pub ttl: Duration,
}

impl Lease {
    /// Whether every placement asked for was granted.
    pub fn all_granted(&self) -> bool {
        self.granted.iter().all(|&g| g)
    }
}

/// A tier of a node as the index knows it: fixed-size slots, and when eviction runs.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct TierSpec {
    /// The node.
    pub node: NodeId,
    /// The tier.
    pub tier: TierId,
    /// Bytes per slot (the largest block the tier stores).
    pub slot_size: u64,
    /// Slots in the tier (its region is `slot_size * slot_count` bytes).
    pub slot_count: u32,
    /// Whether the tier's bytes survive a restart of their process (an SSD file: yes; a DRAM
    /// arena: no). The embedded index drops a volatile tier's blocks when it reopens.
    pub durable: bool,
    /// A reserve that finds fewer free slots than this evicts ...
    pub low_watermark: u32,
    /// ... until this many slots are free (or nothing more can be evicted).
    pub high_watermark: u32,
}

impl TierSpec {
    /// A tier of `slot_count` slots of `slot_size` bytes, volatile, evicting below 5 % free up
    /// to 10 % free (at least one slot each).
    pub fn new(node: NodeId, tier: TierId, slot_size: u64, slot_count: u32) -> Self {
        let low = (slot_count / 20).max(1).min(slot_count);
        let high = (slot_count / 10).max(low).min(slot_count);
        Self {
            node,
            tier,
            slot_size,
            slot_count,
            durable: false,
            low_watermark: low,
            high_watermark: high,
        }
    }

    /// The same tier, durable (its bytes survive a restart).
    pub fn durable(mut self) -> Self {
        self.durable = true;
        self
    }

    /// The same tier with other watermarks.
    pub fn watermarks(mut self, low: u32, high: u32) -> Self {
        self.low_watermark = low;
        self.high_watermark = high;
        self
    }

    /// The byte offset of `slot` in the tier's region.
    pub fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot) * self.slot_size
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.slot_size == 0 || self.slot_count == 0 {
            return Err(Error::InvalidConfig(format!(
                "tier {} of node {}: slot size and slot count must be positive",
                self.tier, self.node
            )));
        }
        if self.slot_size.checked_mul(u64::from(self.slot_count)).is_none() {
            return Err(Error::InvalidConfig("tier size overflows u64".into()));
        }
        if self.low_watermark > self.high_watermark || self.high_watermark > self.slot_count {
            return Err(Error::InvalidConfig(format!(
                "tier {} of node {}: watermarks must satisfy low {} <= high {} <= slots {}",
                self.tier, self.node, self.low_watermark, self.high_watermark, self.slot_count
            )));
        }
        Ok(())
    }

    /// Whether `other` describes the same tier shape; `Err` says what differs.
    pub(crate) fn same_shape(&self, other: &TierSpec) -> Result<(), Error> {
        if self.slot_size != other.slot_size
            || self.slot_count != other.slot_count
            || self.durable != other.durable
        {
            return Err(Error::TierConflict {
                node: self.node,
                tier: self.tier,
                reason: format!(
                    "registered: {} slots of {} bytes, durable {}; now: {} slots of {} bytes, durable {}",
                    other.slot_count,
                    other.slot_size,
                    other.durable,
                    self.slot_count,
                    self.slot_size,
                    self.durable
                ),
            });
        }
        Ok(())
    }
}

/// How a tier's slots are used right now ([`Index::tier_stats`](crate::Index::tier_stats)).
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub struct TierStats {
    /// Slots free to reserve (including never-used ones).
    pub free: u32,
    /// Slots reserved and not yet published (expired reservations may still count until the
    /// next reserve on the tier reclaims them).
    pub reserved: u32,
    /// Slots holding a published block.
    pub published: u32,
}

/// What a node tells the pool about itself ([`Index::announce`](crate::Index::announce)).
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct NodeAnnouncement {
    /// The node.
    pub node: NodeId,
    /// Where peers reach it (for a memory node: its UCX server's address), free-form.
    pub address: String,
    /// Its tiers and their free bytes, as the node counts them.
    pub tiers: Vec<(TierId, u64)>,
}

impl NodeAnnouncement {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(8 + self.address.len() + self.tiers.len() * 10);
        b.extend_from_slice(&self.node.0.to_be_bytes());
        b.extend_from_slice(&(self.address.len() as u32).to_be_bytes());
        b.extend_from_slice(self.address.as_bytes());
        for (tier, free) in &self.tiers {
            b.extend_from_slice(&tier.0.to_be_bytes());
            b.extend_from_slice(&free.to_be_bytes());
        }
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Self, Error> {
        let bad = || Error::Corrupt("node announcement of the wrong shape".into());
        let node = NodeId(u32::from_be_bytes(b.get(0..4).ok_or_else(bad)?.try_into().unwrap()));
        let alen = u32::from_be_bytes(b.get(4..8).ok_or_else(bad)?.try_into().unwrap()) as usize;
        let end = 8usize.checked_add(alen).ok_or_else(bad)?;
        let address =
            String::from_utf8(b.get(8..end).ok_or_else(bad)?.to_vec()).map_err(|_| bad())?;
        let rest = &b[end..];
        if rest.len() % 10 != 0 {
            return Err(bad());
        }
        let tiers = rest
            .chunks_exact(10)
            .map(|c| {
                (
                    TierId(u16::from_be_bytes([c[0], c[1]])),
                    u64::from_be_bytes(c[2..10].try_into().unwrap()),
                )
            })
            .collect();
        Ok(Self { node, address, tiers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_round_trips() {
        let p = Placement {
            key: BlockKey::from_u128(7),
            node: NodeId(0xdead_beef),
            tier: TierId(0xabcd),
            slot: 123_456,
            len: u64::MAX - 3,
            checksum: 0x1234_5678,
            generation: 1 << 60,
        };
        assert_eq!(Placement::decode(p.key, &p.encode()).unwrap(), p);
        assert!(matches!(Placement::decode(p.key, &[0; 29]), Err(Error::Corrupt(_))));
    }

    #[test]
    fn verify_checks_length_and_crc() {
        let bytes = b"hello pool".to_vec();
        let r = Reservation {
            key: BlockKey::from_u128(1),
            node: NodeId(1),
            tier: TierId(0),
            slot: 0,
            len: bytes.len() as u64,
            generation: 1,
        };
        let p = r.placement(checksum(&bytes));
        p.verify(&bytes).unwrap();
        let mut torn = bytes.clone();
        torn[3] ^= 1;
        assert!(matches!(p.verify(&torn), Err(Error::ChecksumMismatch { .. })));
        assert!(p.verify(&bytes[..4]).is_err());
        // CRC32C's check value.
        assert_eq!(checksum(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn announcement_round_trips_and_rejects_garbage() {
        let a = NodeAnnouncement {
            node: NodeId(9),
            address: "127.0.0.1:7000".into(),
            tiers: vec![(TierId(0), 1 << 40), (TierId(3), 5)],
        };
        assert_eq!(NodeAnnouncement::decode(&a.encode()).unwrap(), a);
        assert!(NodeAnnouncement::decode(&[0, 0, 0, 1, 255, 255, 255, 255]).is_err());
        assert!(NodeAnnouncement::decode(&[1]).is_err());
    }

    #[test]
    fn spec_validation() {
        let s = TierSpec::new(NodeId(1), TierId(0), 4096, 100);
        assert_eq!((s.low_watermark, s.high_watermark), (5, 10));
        s.validate().unwrap();
        assert!(s.watermarks(20, 10).validate().is_err());
        assert!(TierSpec::new(NodeId(1), TierId(0), 0, 1).validate().is_err());
        assert!(s.same_shape(&s.durable()).is_err());
        let tiny = TierSpec::new(NodeId(1), TierId(0), 1, 1);
        assert_eq!((tiny.low_watermark, tiny.high_watermark), (1, 1));
    }
}
