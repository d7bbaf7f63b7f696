//! The remote memory engine of umbp: a KV cache that outgrows one node restores objects from,
//! and offloads them to, other nodes' memory: one-sided RDMA over [UCX](https://openucx.org)
//! where the transports are RDMA, requests the server checks over TCP otherwise.
//!
//! - The node that owns the memory runs a [`UcxServer`] ([`ServerBuilder::export`] its pool's
//!   regions, then [`serve`](ServerBuilder::serve)).
//! - A node that wants the bytes runs a [`UcxEngine`], [`connect`](UcxEngine::connect)s to
//!   each server (a TCP handshake in which both prove they hold the shared secret, then the
//!   list of exported regions) and registers the regions as remote endpoints
//!   ([`Register::register_remote`](umbp_plan::Register::register_remote)). Fragments between
//!   its host memory and those endpoints become gets (restore) and puts (offload).
//!
//! Who is trusted and what a peer can reach: the crate README's threat model.
//! - In a composite beside the local engines, a restore whose objects live partly in local
//!   DRAM, partly on SSD and partly on other nodes is one batch, with the same per-object
//!   rollback and failure isolation as the rest of umbp.
//!
//! # Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine};
//! use umbp_ucx::{UcxConfig, UcxEngine};
//!
//! let registry = Arc::new(EndpointRegistry::new());
//! // The shared secret: UMBP_UCX_SECRET here, or `UcxConfig::token`.
//! let engine = UcxEngine::new(Arc::clone(&registry), UcxConfig::default())?;
//! let peer = engine.connect("10.0.0.2:7400")?;
//! let arena = peer.region("kv-arena").expect("the peer exports its arena");
//! let remote = engine.register_remote(arena.region, 0, arena.len)?;
//! let local = engine.register_memory(vec![0u8; 1 << 20])?;
//!
//! // Object 0: two 64 KiB pages of the peer's arena, into the first 128 KiB here.
//! let mut builder = engine.incremental_builder();
//! let tag = Tag::new(0);
//! builder.begin_object(tag)?;
//! builder.push(Fragment::new(remote.id(), 0x30000, local.id(), 0, 64 << 10, tag))?;
//! builder.push(Fragment::new(remote.id(), 0x90000, local.id(), 64 << 10, 64 << 10, tag))?;
//! builder.commit_object()?;
//! let mut handle = engine.submit(builder.finish()?);
//! assert!(handle.wait().is_empty());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Unsafe code
//!
//! The UCX calls live in the `ucp` module (declarations checked against the installed headers
//! by a test, and thin owning wrappers). The `checked` module moves request bytes between
//! sockets and memory (within a checked region on the server, within the batch's pinned
//! memory on the client). One other `unsafe` block posts a request on the progress thread, where the batch's pins keep the local memory registered until the request
//! completes, and one on the server maps the exported memory, which the server owns (or the
//! caller of [`ServerBuilder::export_raw`], an `unsafe` function, vouches for) until UCX has
//! let go of it.

#![deny(unsafe_code)]

#[allow(unsafe_code)] // Moves request bytes between sockets and memory; SAFETY at each block.
mod checked;
mod config;
mod engine;
mod error;
mod handshake;
#[allow(unsafe_code)] // Posts requests; see the SAFETY comment at the one block.
mod progress;
mod server;
#[allow(unsafe_code)] // The FFI.
mod ucp;

pub use config::{ServerLimits, UcxConfig, SECRET_ENV};
pub use engine::{ExportedRegion, PeerInfo, UcxBuilder, UcxEngine, UcxRules};
pub use error::{Error, HandshakeError};
pub use handshake::{MAX_SECRET, MIN_SECRET};
pub use server::{Exports, ServerBuilder, UcxServer};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Whether UCX's libraries load on this machine: `Err` says why not. Tests and tools use it to
/// skip (or refuse) before building an engine.
pub fn ucx_available() -> Result<(), Error> {
    ucp::available()
}
