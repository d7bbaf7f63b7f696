//! What a server counts as it serves, and how its owner reads it: the counters its handshake
//! thread, its clients' threads and the checked path bump, and [`ServerStats`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a server counts as it serves: atomics, bumped once per request or connection (no
/// lock on the request path), read by [`ServerStats::read`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Authenticated clients whose session is open now.
    pub(crate) connected: AtomicU64,
    /// Clients admitted, in all.
    pub(crate) admitted: AtomicU64,
    /// Handshakes refused: the client's proof did not verify with the server's secret.
    pub(crate) refused_secret: AtomicU64,
    /// Handshakes refused: the server served as many clients as allowed.
    pub(crate) refused_full: AtomicU64,
    /// Handshakes closed: not an umbp-remote hello.
    pub(crate) refused_malformed: AtomicU64,
    /// Handshakes closed: the connect timeout passed.
    pub(crate) refused_deadline: AtomicU64,
    /// Handshakes closed to make room for newer connections.
    pub(crate) refused_displaced: AtomicU64,
    /// Handshakes whose connection failed (the client went away mid-handshake).
    pub(crate) refused_failed: AtomicU64,
    /// Bytes received from clients into the regions (puts).
    pub(crate) received: AtomicU64,
    /// Bytes sent to clients out of the regions (gets).
    pub(crate) sent: AtomicU64,
    /// Gets and puts served whole.
    pub(crate) requests: AtomicU64,
    /// Sessions ended, by reason (see [`ServerStats`]).
    pub(crate) closed_left: AtomicU64,
    pub(crate) closed_idle: AtomicU64,
    pub(crate) closed_tampered: AtomicU64,
    pub(crate) closed_stalled: AtomicU64,
    pub(crate) closed_refused: AtomicU64,
    pub(crate) closed_failed: AtomicU64,
    pub(crate) closed_shutdown: AtomicU64,
    /// The last connection whose handshake was refused, for the refusals' summary line. The
    /// handshake thread only ever `try_lock`s it: it never waits on the log.
    pub(crate) last_refused: Mutex<Option<SocketAddr>>,
}

impl Counters {
    /// The handshake refusals so far, by reason, in [`StatsSnapshot::handshakes_refused`]'s
    /// order.
    pub(crate) fn refusals(&self) -> [(&'static str, u64); 6] {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("wrong_secret", get(&self.refused_secret)),
            ("full", get(&self.refused_full)),
            ("malformed", get(&self.refused_malformed)),
            ("deadline", get(&self.refused_deadline)),
            ("displaced", get(&self.refused_displaced)),
            ("failed", get(&self.refused_failed)),
        ]
    }
}

/// Reads a server's counters, from any thread, while it serves and after
/// ([`RemoteServer::stats`](crate::RemoteServer::stats)).
#[derive(Clone, Debug)]
pub struct ServerStats(Arc<Counters>);

/// What a server did since it started, as [`ServerStats::read`] saw it (each counter read on
/// its own: a snapshot of counters, not of one instant).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Authenticated clients whose session is open now.
    pub clients_connected: u64,
    /// Clients admitted (authenticated and served) in all.
    pub clients_admitted: u64,
    /// Handshakes refused or closed, by reason: `wrong_secret` (the client's proof did not
    /// verify), `full` (serving as many clients as allowed), `malformed` (not an umbp-remote
    /// hello), `deadline` (not done within the connect timeout), `displaced` (closed to make
    /// room past a bound), `failed` (the connection failed mid-handshake).
    pub handshakes_refused: Vec<(&'static str, u64)>,
    /// Bytes the clients' puts wrote into the regions.
    pub bytes_received: u64,
    /// Bytes the clients' gets read out of the regions.
    pub bytes_sent: u64,
    /// Gets and puts served whole (checked path; heartbeats not counted).
    pub requests: u64,
    /// Sessions ended, by reason: `left` (the client closed), `idle` (silent past the idle
    /// timeout), `tamper` (a record did not authenticate), `timeout` (an answer left unread
    /// past the peer timeout), `refused_request` (a request outside the exports), `failed`
    /// (the connection failed), `shutdown` (the server drained or stopped).
    pub sessions_closed: Vec<(&'static str, u64)>,
}

impl ServerStats {
    /// The reader of `counters`.
    pub(crate) fn of(counters: Arc<Counters>) -> Self {
        Self(counters)
    }

    /// The counters now.
    pub fn read(&self) -> StatsSnapshot {
        let c = &*self.0;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            clients_connected: get(&c.connected),
            clients_admitted: get(&c.admitted),
            handshakes_refused: c.refusals().to_vec(),
            bytes_received: get(&c.received),
            bytes_sent: get(&c.sent),
            requests: get(&c.requests),
            sessions_closed: vec![
                ("left", get(&c.closed_left)),
                ("idle", get(&c.closed_idle)),
                ("tamper", get(&c.closed_tampered)),
                ("timeout", get(&c.closed_stalled)),
                ("refused_request", get(&c.closed_refused)),
                ("failed", get(&c.closed_failed)),
                ("shutdown", get(&c.closed_shutdown)),
            ],
        }
    }
}
