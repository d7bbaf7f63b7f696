//! The umbp memory node: a host whose DRAM other nodes use as a tier of their KV cache, through
//! a umbp pool.
//!
//! - **Serving.** A memory node is a [`RemoteServer`](umbp_remote::RemoteServer) (crate `umbp-remote`, the
//!   remote engine) that exports regions of its memory. [`Membership`] joins it to a pool:
//!   each writable exported region becomes a tier of fixed-size slots in the pool's
//!   [`Index`](umbp_pool::Index) (tier `i` is the `i`-th exported region, so a client maps a
//!   tier to a region by the handshake's list alone), its announcement (address, free bytes
//!   per tier) is renewed from a thread, and [`Membership::leave`] takes it out of the pool at
//!   once when it stops.
//! - **The command.** `umbp-ucx-serve` ([`serve::main`]) does all of that as a service: flags
//!   and a TOML file, logs, `/metrics`, signals and a drain. The Python package runs the same
//!   function as its `umbp-ucx-serve` console script, so a memory node needs no Rust toolchain.
//! - **Reaching one.** A client's [`Pool`](umbp_pool::Pool) reaches those tiers through a
//!   [`MemoryNodeResolver`]: it connects to the node's announced address (with the shared secret,
//!   refusing a server that names another node) and registers the region with the pool's
//!   composite, one connection per node.
//!
//! This crate sits above the pool and the remote engine; the remote engine itself
//! (`umbp-remote`) knows nothing of pools.
//!
//! # Example
//!
//! A client's pool that reaches memory nodes (`umbp-ucx-serve --pool redis://...`):
//!
//! ```no_run
//! use std::sync::Arc;
//! use umbp_composite::CompositeEngine;
//! use umbp_memory_node::MemoryNodeResolver;
//! use umbp_plan::{EndpointRegistry, TransferEngine};
//! use umbp_pool::{NodeId, Pool, PoolConfig, RedisConfig, RedisIndex};
//! use umbp_remote::{RemoteConfig, RemoteEngine};
//!
//! let registry = EndpointRegistry::new();
//! // The shared secret of the memory nodes: UMBP_UCX_SECRET here, or `RemoteConfig::secret`.
//! let ucx = Arc::new(RemoteEngine::new(registry.clone(), RemoteConfig::default())?);
//! let engines: Vec<Arc<dyn TransferEngine>> = vec![ucx.clone()];
//! let composite = CompositeEngine::new(registry, engines);
//! let resolver = Arc::new(MemoryNodeResolver::new(ucx, composite.clone())?);
//! let index = Arc::new(RedisIndex::connect(&RedisConfig::new("redis://127.0.0.1:6379/0"))?);
//! let pool = Pool::with_resolver(index, composite, PoolConfig::new(NodeId(7)), Some(resolver))?;
//! // `pool.get` now loads blocks that memory nodes hold, as `pool.put` stores them there.
//! # drop(pool);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod member;
mod resolver;
pub mod serve;

pub use member::{
    Membership, MembershipConfig, MembershipSnapshot, MembershipState, MembershipStats,
};
pub use resolver::MemoryNodeResolver;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
