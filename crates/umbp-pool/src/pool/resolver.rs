//! How a [`Pool`](crate::Pool) reaches tiers of other nodes.

use crate::{NodeAnnouncement, NodeId, TierRegion, TierSpec};

/// Reaches tiers of *other* nodes of the pool: a memory node's exported region through the
/// remote engine, another instance's SSD file opened read-only. The pool calls it the first
/// time a get meets a placement on a tier it cannot reach by itself, and caches the answer
/// until a transfer through the region fails or [`is_current`](Self::is_current) says it is
/// stale (then it calls [`forget`](Self::forget) and resolves again).
///
/// `resolve` registers whatever the region needs with the pool's composite (connect to the
/// peer, `register_remote`, open the file) and keeps the registration alive until `forget`
/// (or its own drop). The region's [`TierRegion::slot_size`] must be `spec.slot_size`.
///
/// Implementations live above this crate, beside their engine (the memory nodes' resolver in
/// `umbp-memory-node`), so this crate never depends on a transport.
pub trait TierResolver: Send + Sync {
    /// The region through which this process reaches tier `spec.tier` of `node`, registered
    /// with the pool's composite; `None` when it cannot be reached now (the pool counts those
    /// blocks as failed reads, not hits).
    fn resolve(&self, node: &NodeAnnouncement, spec: &TierSpec) -> Option<TierRegion>;

    /// Whether a region `resolve` returned for a tier of `node` still reaches it, asked each
    /// time the pool is about to use its cached answer; `false` makes the pool
    /// [`forget`](Self::forget) it and resolve again. For a remote engine: whether its peer is
    /// still connected. Default: `true` (the pool finds out when a transfer fails).
    fn is_current(&self, node: NodeId, region: &TierRegion) -> bool {
        let _ = (node, region);
        true
    }

    /// The pool stopped using what `resolve` returned for `spec`'s tier (a transfer through it
    /// failed, or the node left the pool): drop its registration. Default: nothing.
    fn forget(&self, spec: &TierSpec) {
        let _ = spec;
    }
}
