//! The pool's one error type.

use crate::{NodeId, TierId};

/// What went wrong in a call to an [`Index`](crate::Index).
///
/// Caller mistakes ([`Error::UnknownTier`], [`Error::TooLarge`], [`Error::TierConflict`],
/// [`Error::InvalidConfig`]) are apart from the backend's failures ([`Error::Redis`],
/// [`Error::Store`], [`Error::Corrupt`]). Outcomes that are part of normal operation (a key
/// already published, a lost publish race, a stale placement) are not errors: they are values
/// of [`Reserved`](crate::Reserved), [`Published`](crate::Published) and
/// [`Lease::granted`](crate::Lease::granted).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No tier `tier` of node `node` was registered with this index.
    #[error("node {node} has no registered tier {tier}")]
    UnknownTier {
        /// The node named.
        node: NodeId,
        /// The tier named.
        tier: TierId,
    },
    /// A tier was registered again with a different slot size, slot count or durability.
    #[error("tier {tier} of node {node} is registered with another shape: {reason}")]
    TierConflict {
        /// The node.
        node: NodeId,
        /// The tier.
        tier: TierId,
        /// What differs.
        reason: String,
    },
    /// A block of `len` bytes does not fit a slot of `slot_size` bytes.
    #[error("a block of {len} bytes does not fit the {slot_size}-byte slots of tier {tier} of node {node}")]
    TooLarge {
        /// The node.
        node: NodeId,
        /// The tier.
        tier: TierId,
        /// The block's length.
        len: u64,
        /// The tier's slot size.
        slot_size: u64,
    },
    /// Every slot of the tier is reserved or leased (or published and could not be evicted):
    /// nothing to reserve now.
    #[error("tier {tier} of node {node} has no free slot: every slot is reserved or leased")]
    TierFull {
        /// The node.
        node: NodeId,
        /// The tier.
        tier: TierId,
    },
    /// The node is not alive in the index (it never announced itself, or stopped renewing):
    /// nothing can be reserved or published on it.
    #[error("node {0} is not alive in the pool (it has not announced itself, or its announcement expired)")]
    NodeNotAlive(NodeId),
    /// The lease expired (its holder stopped renewing for longer than its TTL) or was released.
    #[error("lease {0} expired or was released")]
    LeaseExpired(u64),
    /// A setting is invalid (an empty prefix, a zero TTL, a watermark above the slot count).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// TLS was configured, but this build has no TLS support (build with the `tls` feature).
    #[error("TLS to Redis was configured, but umbp-pool was built without its `tls` feature")]
    TlsUnavailable,
    /// The Redis server failed, closed the connection or timed out; the call had no effect or
    /// an all-or-nothing effect (every script runs atomically).
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The embedded store (redb) failed: I/O, a full disk, a database another process holds.
    #[error("embedded index store: {0}")]
    Store(String),
    /// The index holds something this version cannot read (a record of the wrong size, a
    /// script answer of the wrong shape).
    #[error("index data is corrupt or from another version: {0}")]
    Corrupt(String),
    /// The bytes loaded for a block do not match the checksum recorded at publish: a load error,
    /// never a hit.
    #[error("checksum mismatch for block {key}: recorded {expected:#010x}, loaded {actual:#010x}")]
    ChecksumMismatch {
        /// The block.
        key: crate::BlockKey,
        /// CRC32C recorded at publish.
        expected: u32,
        /// CRC32C of the loaded bytes.
        actual: u32,
    },
    /// The composite refused or failed a transfer.
    #[error("transfer: {0}")]
    Transfer(#[from] umbp_composite::Error),
}

macro_rules! store_error {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Store(e.to_string())
            }
        }
    )*};
}
store_error!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);
