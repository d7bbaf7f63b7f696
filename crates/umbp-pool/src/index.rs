//! The index trait both backends implement.

use std::time::Duration;

use crate::{
    BlockKey, Error, Lease, NodeAnnouncement, NodeId, Placement, Published, Removed, Reservation,
    Reserved, TierId, TierSpec, TierStats,
};

/// One index of KV blocks: 128-bit keys to [`Placement`]s in fixed-size tier slots, with the
/// rules that keep "a hit means every byte is there". The rules are the index's, not the
/// callers' discipline:
///
/// - **Two-phase writes.** [`reserve`](Index::reserve) hands out a free slot (evicting below the
///   tier's low watermark); the caller writes the block's bytes there, then
///   [`publish`](Index::publish)es with their checksum. A key is visible to
///   [`lookup`](Index::lookup) only after its publish. [`abort`](Index::abort), or a
///   reservation that outlives its TTL, frees the slot and publishes nothing. Of two writers of
///   one key, exactly one publish wins; the other's slot is freed ([`Published::Lost`]).
/// - **Leases.** A reader [`lease`](Index::lease)s the placements it loads; eviction, removal
///   and reuse skip leased slots. A lease lasts its TTL unless [`renew`](Index::renew)ed, so a
///   dead reader's leases free themselves.
/// - **Generations.** Every reservation gives its slot a new, larger generation. A lease names
///   the generation of the placement it protects and is granted only if the slot still holds
///   that key at that generation: a stale placement is a miss, never another block's bytes.
///
/// Every method that takes a slice does its work in one round trip (Redis) or one transaction
/// (embedded), and answers per item in the slice's order. `Err` means the call as a whole
/// failed (the backend is unreachable, the store failed, a caller mistake): for a Redis index
/// nothing or all of each script's effect happened, never half of it.
pub trait Index: Send + Sync {
    /// Registers a tier of `spec.slot_count` slots of `spec.slot_size` bytes. Registering the
    /// same shape again is a no-op (a restart). Another shape is [`Error::TierConflict`] while
    /// the node is alive; in Redis, a node that is not alive (it left, or its announcement
    /// expired) gets the new shape, its old blocks on that tier dropped.
    fn register_tier(&self, spec: &TierSpec) -> Result<(), Error>;

    /// The shape a tier was registered with (by any client of the index); `None` for a tier
    /// never registered. A reader of another node's tier learns its slot size here.
    fn tier_spec(&self, node: NodeId, tier: TierId) -> Result<Option<TierSpec>, Error>;

    /// Reserves a slot of tier `tier` of node `node` for a block of `len` bytes under `key`,
    /// valid for `ttl`. Returns [`Reserved::Present`] if `key` is already published.
    ///
    /// Errors: [`Error::UnknownTier`], [`Error::TooLarge`], [`Error::TierFull`] (every slot
    /// reserved or leased), [`Error::NodeNotAlive`] (Redis: the node has not announced itself).
    fn reserve(
        &self,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        ttl: Duration,
    ) -> Result<Reserved, Error>;

    /// Reserves slots of one tier for many blocks (`(key, len)` each) in one round trip or one
    /// lock, as [`reserve`](Index::reserve) would one by one: one answer per item, in order,
    /// `Err` holding what that item alone met ([`Error::TooLarge`], [`Error::TierFull`],
    /// [`Error::UnknownTier`], [`Error::NodeNotAlive`]). The outer `Err` is the call's own
    /// failure (the backend unreachable). A key given twice gets two slots; one publish wins.
    fn reserve_many(
        &self,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<Result<Reserved, Error>>, Error>;

    /// Publishes each reservation with the CRC32C of the bytes written into its slot, in one
    /// round trip or transaction. For the embedded index a `Published::Won` is durable when this
    /// returns.
    fn publish(&self, items: &[(Reservation, u32)]) -> Result<Vec<Published>, Error>;

    /// Frees the slots of reservations that will not be published (a failed or torn write).
    /// Reservations already published, expired or aborted are left alone.
    fn abort(&self, reservations: &[Reservation]) -> Result<(), Error>;

    /// The placement of each key, `None` for a key not published (or whose node is not alive),
    /// in one round trip.
    fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error>;

    /// How many of `keys`, from the first, are published: the prefix a request can load.
    fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        Ok(self.lookup(keys)?.iter().take_while(|p| p.is_some()).count())
    }

    /// Takes one lease over `placements` for `ttl`: each is granted only if its slot still
    /// holds that key at that generation. Granted slots are not evicted, removed or reused
    /// until the lease is released or expires. Granting also counts as a use for eviction.
    fn lease(&self, placements: &[Placement], ttl: Duration) -> Result<Lease, Error>;

    /// Extends lease `id` to `ttl` from now. [`Error::LeaseExpired`] if it already ended.
    fn renew(&self, id: u64, ttl: Duration) -> Result<(), Error>;

    /// Ends lease `id` (a no-op if it already ended).
    fn release(&self, id: u64) -> Result<(), Error>;

    /// Removes published keys and frees their slots (leased ones stay: [`Removed::Leased`]).
    fn remove(&self, keys: &[BlockKey]) -> Result<Vec<Removed>, Error>;

    /// Evicts up to `count` published, unleased blocks of a tier, least recently used first;
    /// returns how many were evicted. [`reserve`](Index::reserve) does this by itself between
    /// the watermarks.
    fn evict(&self, node: NodeId, tier: TierId, count: u32) -> Result<u32, Error>;

    /// How the tier's slots are used right now.
    fn tier_stats(&self, node: NodeId, tier: TierId) -> Result<TierStats, Error>;

    /// Announces (or renews) a node for `ttl`. A node whose announcement expires is dead: its
    /// placements drop out of lookups and leases, and when it announces itself again it rejoins
    /// empty (its old placements are deleted, its slots free). The embedded index serves one
    /// node and keeps announcements only to list them.
    fn announce(&self, node: &NodeAnnouncement, ttl: Duration) -> Result<(), Error>;

    /// The nodes alive now.
    fn nodes(&self) -> Result<Vec<NodeAnnouncement>, Error>;

    /// Withdraws `node` from the pool now, as if its announcement had just expired: it leaves
    /// [`nodes`](Index::nodes), and where placements depend on their node being alive (Redis)
    /// they drop out of lookups and leases at once, its reservations can no longer be
    /// published, and its slots are freed (it rejoins empty when it announces itself again).
    /// A memory node calls this when it stops, so readers miss its blocks at once instead of
    /// failing their loads until its announcement expires. Returns whether it was alive.
    ///
    /// The embedded index only forgets the announcement: its placements never depended on it.
    fn leave(&self, node: NodeId) -> Result<bool, Error>;
}
