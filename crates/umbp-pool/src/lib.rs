//! The umbp pool: one index of KV-cache blocks shared by the instances and nodes that hold
//! them, kept across restarts.
//!
//! A block's key (16 bytes: vLLM's block hash, or any 128-bit key) maps to a [`Placement`]:
//! the node, the tier, the fixed-size slot, the length, the CRC32C of its bytes and the slot's
//! generation. The pool decides *where* a block goes; the composite
//! ([`umbp_composite`]) moves the bytes ([`TierRegion`] turns a slot into the composite's
//! paged object).
//!
//! # The rules, kept by the index
//!
//! A hit means every byte is there:
//!
//! - **Two-phase writes**: [`Index::reserve`] a slot, write the bytes, [`Index::publish`] with
//!   their [`checksum`]. A key is visible only after its publish; an abort or an expired
//!   reservation publishes nothing and frees the slot; of two writers of one key, exactly one
//!   wins.
//! - **Leases**: a reader [`Index::lease`]s what it loads; eviction and reuse skip leased
//!   slots; a lease ends when its holder stops renewing.
//! - **Generations**: a reused slot has a new generation, and a lease on a stale placement is
//!   not granted: a miss, never another block's bytes. [`Placement::verify`] checks loaded
//!   bytes against the recorded checksum.
//!
//! # Backends
//!
//! Both implement [`Index`] (`Send + Sync`, batch-first: lookups of any number of keys are
//! one round trip):
//!
//! - [`EmbeddedIndex`]: one node, persistent and crash-safe in a redb file; a restart keeps
//!   exactly the blocks whose publish committed.
//! - [`RedisIndex`]: a cluster's shared index in Redis 7, with Lua scripts for every change,
//!   TTL leases, node announcements, password/ACL authentication and TLS (feature `tls`).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use umbp_pool::{checksum, BlockKey, EmbeddedIndex, Index, NodeId, Published, Reserved, TierId, TierSpec};
//!
//! let dir = tempfile::tempdir()?;
//! let index = EmbeddedIndex::open(dir.path().join("pool.redb"))?;
//! let ssd = TierSpec::new(NodeId(0), TierId(1), 64 << 10, 1024).durable();
//! index.register_tier(&ssd)?;
//!
//! // Write: reserve, write the bytes into the slot, publish with their checksum.
//! let key = BlockKey::from_u128(0xfeed);
//! let block = vec![7u8; 64 << 10];
//! let Reserved::Slot(r) = index.reserve(key, ssd.node, ssd.tier, block.len() as u64, Duration::from_secs(30))? else {
//!     unreachable!("a fresh index has no block under this key")
//! };
//! assert_eq!(index.lookup(&[key])?, vec![None]); // invisible until published
//! // ... write `block` at byte ssd.slot_offset(r.slot) of the tier ...
//! let [Published::Won(placement)] = index.publish(&[(r, checksum(&block))])?[..] else { panic!() };
//!
//! // Read: look up, lease, load, verify, release.
//! let found = index.lookup(&[key, BlockKey::from_u128(1)])?;
//! assert_eq!(found, vec![Some(placement), None]);
//! let lease = index.lease(&[placement], Duration::from_secs(10))?;
//! assert!(lease.all_granted());
//! // ... read placement.len bytes at ssd.slot_offset(placement.slot) ...
//! placement.verify(&block)?;
//! index.release(lease.id)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod embedded;
mod error;
mod index;
mod key;
mod placement;
mod pool;
#[allow(clippy::module_inception)]
mod redis;
#[cfg(feature = "redis-server")]
pub mod redis_server;
mod region;

pub use embedded::{DropReason, Dropped, EmbeddedIndex, ReconcileReport, TierFile, Verify};
pub use error::Error;
pub use index::Index;
pub use key::BlockKey;
pub use placement::{
    checksum, Lease, NodeAnnouncement, NodeId, Placement, Published, Removed, Reservation,
    Reserved, TierId, TierSpec, TierStats,
};
pub use pool::{
    BlockError, GetBlock, GetOutcome, Pool, PoolConfig, PoolMetrics, PutBlock, PutOutcome,
    TierResolver,
};
pub use redis::{RedisConfig, RedisIndex};
pub use region::TierRegion;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
