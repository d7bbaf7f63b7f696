//! The remote memory engine of umbp: a KV cache that outgrows one node restores objects from,
//! and offloads them to, other nodes' memory: one-sided RDMA over [UCX](https://openucx.org)
//! where the transports are RDMA, requests the server checks over TCP otherwise.
//!
//! - The node that owns the memory runs a [`RemoteServer`] ([`ServerBuilder::export`] its pool's
//!   regions, then [`serve`](ServerBuilder::serve)).
//! - A node that wants the bytes runs a [`RemoteEngine`], [`connect`](RemoteEngine::connect)s to
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
//! use umbp_remote::{RemoteConfig, RemoteEngine};
//!
//! let registry = Arc::new(EndpointRegistry::new());
//! // The shared secret: UMBP_UCX_SECRET here, or `RemoteConfig::secret`.
//! let engine = RemoteEngine::new(Arc::clone(&registry), RemoteConfig::default())?;
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
//! # Layout
//!
//! The modules depend one way, each only on those listed before it: `error`; `ucp` (the UCX
//! FFI); `channel` (the session's sealing); `handshake`; `config`; `stats` (the server's
//! counters); `checked` (requests and answers over a socket, both sides, telling its owner
//! through a `LinkEvent` it does not know the type of); `server`; `progress` (the client's
//! progress thread); `engine`.
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

mod channel;
#[allow(unsafe_code)] // Moves request bytes between sockets and memory; SAFETY at each block.
mod checked;
mod config;
mod engine;
mod error;
mod handshake;
#[allow(unsafe_code)] // One `readv`; see its SAFETY comment.
mod inbox;
#[allow(unsafe_code)] // Posts requests; see the SAFETY comment at the one block.
mod progress;
mod server;
mod stats;
#[allow(unsafe_code)] // The FFI.
mod ucp;

pub use channel::Protection;
pub use config::{Congestion, RemoteConfig, ServerLimits, SECRET_ENV};
pub use engine::{ExportedRegion, PeerInfo, RemoteBuilder, RemoteEngine, RemoteRules};
pub use error::{Error, HandshakeError};
pub use handshake::{MAX_SECRET, MIN_SECRET};
pub use server::{Exports, RemoteServer, ServerBuilder};
pub use stats::{ServerStats, StatsSnapshot};

#[doc(hidden)]
pub mod internal {
    //! Not a stable interface: what the crate's own tests need to speak the wire protocol as
    //! a peer that holds the secret but ignores every other rule would.

    use std::net::TcpStream;

    use crate::channel::{Keys, Protection};
    use crate::handshake::{self, Auth};
    use crate::HandshakeError;

    /// The keys of a session this side opened.
    pub struct Session(Keys);

    impl Session {
        /// Seals the next record this side sends, in place; returns its tag.
        pub fn seal(&mut self, record: &mut [u8]) -> [u8; 16] {
            self.0.send.seal(record)
        }

        /// Opens the next record the other side sent, in place: whether it opened.
        pub fn open(&mut self, record: &mut [u8], tag: &[u8; 16]) -> bool {
            self.0.recv.open(record, tag).is_ok()
        }
    }

    /// An exported region as a client's handshake lists it: name, writable, length.
    pub type Region = (String, bool, u64);

    /// Runs a client's handshake on `stream` with `secret`: the regions the server exported
    /// and the session.
    pub fn handshake(
        stream: &mut TcpStream,
        secret: &[u8],
        protection: Protection,
    ) -> Result<(Vec<Region>, Session), HandshakeError> {
        let (welcome, keys) = handshake::client(stream, Auth::Keyed(secret), protection)?;
        let regions = welcome.regions.into_iter().map(|r| (r.name, r.writable, r.len)).collect();
        Ok((regions, Session(keys)))
    }

    /// Runs a server's handshake on `stream` with `secret` (its verdict: accepted), and sends
    /// `welcome`, whatever its bytes, sealed as the welcome: what a server that holds the
    /// secret but breaks every other rule would send.
    pub fn accept(
        stream: &mut TcpStream,
        secret: &[u8],
        welcome: &[u8],
    ) -> Result<Session, HandshakeError> {
        use std::io::{Read, Write};
        let mut hello = [0u8; handshake::HELLO_LEN];
        stream.read_exact(&mut hello)?;
        let (client, asked) = handshake::parse_hello(&hello)?;
        let server = handshake::nonce()?;
        let challenge = handshake::challenge(Auth::Keyed(secret), &client, &server, asked);
        stream.write_all(&challenge)?;
        let mut proof = [0u8; handshake::PROOF];
        stream.read_exact(&mut proof)?;
        let mut keys = handshake::session_keys(
            crate::channel::Side::Server,
            Auth::Keyed(secret),
            &hello,
            &challenge,
            &proof,
        );
        stream.write_all(&handshake::sealed_welcome(&mut keys, welcome))?;
        Ok(Session(keys))
    }
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

/// Whether UCX's libraries load on this machine: `Err` says why not. Tests and tools use it to
/// skip (or refuse) before building an engine.
pub fn ucx_available() -> Result<(), Error> {
    ucp::available()
}
