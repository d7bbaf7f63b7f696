//! Settings of the engine and the server.

use std::time::Duration;

/// Settings shared by [`UcxEngine`](crate::UcxEngine) and [`ServerBuilder`](crate::ServerBuilder).
///
/// UCX reads its own `UCX_*` environment as usual (`UCX_TLS`, `UCX_NET_DEVICES`...); the
/// settings here override what they name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxConfig {
    /// UCX transports to use (`UCX_TLS`'s syntax: `tcp`, `sm`, `rc,sm`, `^ib`...). `None`:
    /// the environment's `UCX_TLS`, else UCX's own choice (RDMA where the hardware has it).
    pub transports: Option<String>,
    /// A shared secret the client sends and the server compares before handing out keys.
    /// It travels in clear over the control connection: it keeps strangers and
    /// misconfigured clients out of a trusted network, nothing more. Default: none.
    pub token: Option<Vec<u8>>,
    /// How long connecting and the handshake may take. Default: 10 s.
    pub connect_timeout: Duration,
    /// How long a peer may leave requests unanswered before it is declared dead and every
    /// object in flight to it fails. Default: 5 s.
    pub peer_timeout: Duration,
    /// Requests one engine keeps in flight at most (over all peers). Default: 256.
    pub max_in_flight: usize,
    /// Whether the engine registers (`ucp_mem_map`) the host memory registered through it,
    /// so RDMA transports read and write it without registering per request. A mapping UCX
    /// refuses is logged and skipped (UCX then registers per request). Default: on.
    pub map_host_memory: bool,
}

impl Default for UcxConfig {
    fn default() -> Self {
        Self {
            transports: None,
            token: None,
            connect_timeout: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(5),
            max_in_flight: 256,
            map_host_memory: true,
        }
    }
}

impl UcxConfig {
    /// The defaults with `transports`.
    pub fn with_transports(transports: &str) -> Self {
        Self { transports: Some(transports.to_owned()), ..Self::default() }
    }
}
