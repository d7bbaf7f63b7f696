//! The crate's error types.

use std::io;
use std::net::SocketAddr;

/// What went wrong while setting up UCX, connecting to a peer or serving memory.
///
/// `Display` gives this error's own words; a cause (the system's error, an engine's) is its
/// [`source`](std::error::Error::source), to print after it (anyhow's `{:#}` does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// UCX's libraries (`libucp.so.0`, `libucs.so.0`) could not be loaded, or lack a function.
    #[error("UCX is not available: {0} (install libucx0 / libucx-dev)")]
    LibraryMissing(String),
    /// A UCX call failed.
    #[error("{op} failed: {message} (status {status})")]
    Ucx {
        /// The UCP function.
        op: &'static str,
        /// UCX's status code.
        status: i32,
        /// UCX's words for it.
        message: String,
    },
    /// A setting is not usable.
    #[error("setting `{setting}`: {reason}")]
    Config {
        /// The setting.
        setting: &'static str,
        /// Why.
        reason: String,
    },
    /// The control connection to a peer (or the server's listening socket) failed.
    #[error("control connection {addr}")]
    Connect {
        /// The peer's (or the listener's) address.
        addr: String,
        /// What the system said.
        source: io::Error,
    },
    /// The peer's handshake was refused or malformed.
    #[error("handshake with {addr}")]
    Handshake {
        /// The peer's address.
        addr: SocketAddr,
        /// What was wrong.
        source: HandshakeError,
    },
    /// The engine's progress thread is gone (it panicked); the engine can do nothing more.
    #[error("the engine's progress thread is gone")]
    ProgressThreadGone,
    /// A remote endpoint names a peer this engine is not connected to.
    #[error("peer {peer} is not connected to this engine")]
    UnknownPeer {
        /// The peer.
        peer: u32,
    },
    /// A remote endpoint names a region the peer did not export.
    #[error("peer {peer} exported no region {region}")]
    UnknownRegion {
        /// The peer.
        peer: u32,
        /// The region.
        region: u32,
    },
    /// A remote endpoint reaches past the region the peer exported.
    #[error(
        "bytes {offset}..{offset}+{len} of region {region} of peer {peer} lie outside its \
         {region_len} exported bytes"
    )]
    OutsideExport {
        /// The peer.
        peer: u32,
        /// The region.
        region: u32,
        /// Offset into the region.
        offset: u64,
        /// Length.
        len: u64,
        /// What the peer exported.
        region_len: u64,
    },
    /// A plan writes to a region the peer exported read-only.
    #[error("region {region} of peer {peer} is read-only")]
    ReadOnly {
        /// The peer.
        peer: u32,
        /// The region.
        region: u32,
    },
    /// A plan's pair is not host memory and a remote region.
    #[error("endpoint {src} -> endpoint {dst} is not a pair of host memory and a remote region")]
    PairNotCarried {
        /// Source endpoint id.
        src: u64,
        /// Destination endpoint id.
        dst: u64,
    },
    /// A segment lies outside its local endpoint.
    #[error("a segment of {len} bytes at {offset} lies outside local endpoint {endpoint}")]
    OutsideLocal {
        /// The local endpoint id.
        endpoint: u64,
        /// Offset into it.
        offset: u64,
        /// Length.
        len: u64,
    },
}

/// Why a handshake failed. Every field of the wire format is bounded, so a malformed or
/// hostile peer costs at most a few hundred kilobytes and the connect timeout, and nothing it
/// sends reaches UCX before it proved that it holds the shared secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// Reading or writing the socket failed (or timed out).
    #[error("I/O on the control connection")]
    Io(#[from] io::Error),
    /// The other side does not speak this protocol.
    #[error("not an umbp-remote peer (bad magic)")]
    BadMagic,
    /// The other side speaks another version of it.
    #[error("protocol version {got}, this side speaks {expected}")]
    Version {
        /// What the peer sent.
        got: u32,
        /// What this side speaks.
        expected: u32,
    },
    /// A length field is past its limit.
    #[error("{field} of {len} bytes is longer than the limit of {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its claimed length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A field's value makes no sense (a region that wraps the address space, say).
    #[error("malformed: {0}")]
    Malformed(&'static str),
    /// The server refused this client (or the client refused what the server offered).
    #[error("refused: {0}")]
    Refused(&'static str),
    /// The server could not prove that it holds the shared secret: nothing it sends is used.
    #[error(
        "authentication failed (wrong or missing secret on this side or the server's): the \
         server's proof does not verify with this side's secret"
    )]
    ServerNotAuthenticated,
    /// A sealed message of the handshake (the welcome) did not open with the session's keys:
    /// something between the two sides changed the handshake or the message.
    #[error("the server's welcome did not authenticate (changed on the way, or a relay)")]
    Forged,
    /// The server runs without authentication, and this side was not told to accept that
    /// ([`RemoteConfig::insecure_no_auth`](crate::RemoteConfig::insecure_no_auth)).
    #[error("the server runs without authentication (insecure) and this side requires it")]
    ServerInsecure,
    /// The server is not the node this side meant to reach
    /// ([`RemoteEngine::connect_node`](crate::RemoteEngine::connect_node)): its welcome names another
    /// node, or none. Its address points at another memory node (an index entry changed by
    /// whoever can write the index, or a node that moved); nothing of it is used.
    #[error("the server is {}, not node {expected}", match named {
        Some(n) => format!("node {n}"),
        None => "no named node".to_owned(),
    })]
    WrongNode {
        /// The node this side meant to reach.
        expected: u32,
        /// The node the server named, if any.
        named: Option<u32>,
    },
    /// The whole handshake (connecting included) took longer than
    /// [`RemoteConfig::connect_timeout`](crate::RemoteConfig::connect_timeout).
    #[error("the handshake did not finish within the connect timeout")]
    DeadlinePassed,
}
