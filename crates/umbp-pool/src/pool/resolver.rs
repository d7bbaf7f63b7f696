//! How a [`Pool`](crate::Pool) reaches tiers of other nodes.

use crate::{NodeAnnouncement, TierRegion, TierSpec};

/// Reaches tiers of *other* nodes of the pool: a memory node's exported region through the
/// remote engine, another instance's SSD file opened read-only. The pool calls it the first
/// time a get meets a placement on a tier it cannot reach by itself, and caches the answer
/// until a transfer through the region fails (then it calls [`forget`](Self::forget) and
/// resolves again on a later get).
///
/// `resolve` registers whatever the region needs with the pool's composite (connect to the
/// peer, `register_remote`, open the file) and keeps the registration alive until `forget`
/// (or its own drop). The region's [`TierRegion::slot_size`] must be `spec.slot_size`.
///
/// Implementations live beside their engine (the memory nodes' resolver in `umbp-ucx`, feature
/// `pool`), so this crate never depends on a transport.
pub trait TierResolver: Send + Sync {
    /// The region through which this process reaches tier `spec.tier` of `node`, registered
    /// with the pool's composite; `None` when it cannot be reached now (the pool counts those
    /// blocks as failed reads, not hits).
    fn resolve(&self, node: &NodeAnnouncement, spec: &TierSpec) -> Option<TierRegion>;

    /// The pool stopped using what `resolve` returned for `spec`'s tier (a transfer through it
    /// failed, or the node left the pool): drop its registration. Default: nothing.
    fn forget(&self, spec: &TierSpec) {
        let _ = spec;
    }
}
