//! Settings of the engine and the server.

use std::time::Duration;

use crate::channel::Protection;
use crate::handshake::{MAX_SECRET, MIN_SECRET};
use crate::Error;

/// The environment variable [`RemoteConfig::default`] takes the shared secret from.
pub const SECRET_ENV: &str = "UMBP_UCX_SECRET";

/// Settings shared by [`RemoteEngine`](crate::RemoteEngine) and [`ServerBuilder`](crate::ServerBuilder).
///
/// UCX reads its own `UCX_*` environment as usual (`UCX_TLS`, `UCX_NET_DEVICES`...); the
/// settings here override what they name.
///
/// Peers authenticate each other with a shared secret ([`secret`](Self::secret)); a server or
/// client without one refuses to start or connect unless
/// [`insecure_no_auth`](Self::insecure_no_auth) says to run without authentication.
///
/// Every field has a documented default; set the ones you need in a struct literal over
/// [`RemoteConfig::default`]:
///
/// ```
/// use umbp_remote::RemoteConfig;
///
/// let config = RemoteConfig {
///     transports: Some("tcp".into()),
///     secret: Some(b"a shared secret of at least 16 bytes".to_vec()),
///     ..RemoteConfig::default()
/// };
/// // Debug output names whether a secret is set, never the secret.
/// assert!(!format!("{config:?}").contains("shared secret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// UCX transports to use (`UCX_TLS`'s syntax: `tcp`, `sm`, `rc,sm`...). `None`: the
    /// environment's `UCX_TLS`, else UCX's own choice. Only a list of RDMA transports alone
    /// (`rc`, `dc` and their variants) lets a server hand out remote keys for one-sided
    /// access; anything else is served through the checked request path (see the README).
    pub transports: Option<String>,
    /// The shared secret both sides prove they hold (HMAC-SHA256 challenge-response over
    /// fresh nonces from both sides; the secret itself never travels). 16 to 4096 bytes.
    /// Default: the bytes of the environment variable [`SECRET_ENV`] when set, else none.
    /// (Python: `umbp.Engine(remote_secret=...)`, `umbp.Server(secret=...)`.)
    pub secret: Option<Vec<u8>>,
    /// Run without authentication: a server serves whoever connects, a client connects to a
    /// server that runs so. Anyone who can reach the port can then read every exported
    /// region and write the writable ones. Default: off.
    pub insecure_no_auth: bool,
    /// How long all of `connect` may take (resolving aside: the TCP connection, the whole
    /// handshake and setting up the peer), and how long a server waits for a connection's
    /// whole handshake. Default: 10 s.
    pub connect_timeout: Duration,
    /// How long a peer may leave requests unanswered before it is declared dead and every
    /// object in flight to it fails; on a server, the deadline for sending one whole answer:
    /// a client that leaves its answers unread is reset within about twice this long (it also
    /// bounds, as `TCP_USER_TIMEOUT`, how long sent bytes may stay unacknowledged: this long
    /// on a client, twice it on a server, whose own deadline must pass first).
    /// Default: 5 s.
    pub peer_timeout: Duration,
    /// What protects the checked connection after the handshake (see
    /// [`Protection`]). A session is encrypted when either side asks for it; a client refuses
    /// a server that offers less than it asks for. Default: [`Protection::Encrypted`].
    pub protection: Protection,
    /// A client sends a heartbeat on a checked connection it has sent nothing on for this
    /// long, so the server keeps its slot; it is also when TCP keepalive starts probing a
    /// silent connection. Default: 2 s.
    pub heartbeat: Duration,
    /// A server closes a checked client's connection when nothing (not even a heartbeat)
    /// arrived on it for this long, freeing its slot: a client whose process or network
    /// vanished without a word. Keep it well above the clients' `heartbeat`. Default: 10 s.
    pub idle_timeout: Duration,
    /// Requests one engine keeps in flight at most (over all peers). Default: 256.
    pub max_in_flight: usize,
    /// Connections (lanes) a client opens to each server it reaches through the checked
    /// request path, each authenticated on its own; requests go to the lane with the fewest
    /// bytes unanswered. A server seals a client's answers on one thread per connection and
    /// the client opens them on one thread per connection, so one lane caps a peer's
    /// throughput at what one core seals: more lanes put more cores on one peer's transfers.
    /// Each lane counts as a client against the server's [`ServerLimits`]; a lane the server
    /// refuses (full) leaves the link with fewer ([`PeerInfo::lanes`] says how many).
    /// One-sided peers use one connection. At least 1. Default: 2.
    ///
    /// [`PeerInfo::lanes`]: crate::PeerInfo::lanes
    pub lanes: usize,
    /// Whether the engine registers (`ucp_mem_map`) the host memory registered through it,
    /// so RDMA transports read and write it without registering per request. A mapping UCX
    /// refuses is logged and skipped (UCX then registers per request). Default: on.
    pub map_host_memory: bool,
    /// What a server spends on connections at most.
    pub limits: ServerLimits,
    /// The TCP congestion control of the checked connections, on both sides (the sender's
    /// paces the bytes: a server's for gets, a client's for puts). Default:
    /// [`Congestion::Auto`].
    pub congestion: Congestion,
}

/// Which TCP congestion control a checked connection's socket runs
/// ([`RemoteConfig::congestion`]).
///
/// Why it matters: BBR, the default of some kernels and clouds, paces every connection at the
/// bandwidth it measured. Between a client and a memory node on one host the bytes meet no
/// congestion, and the measurement is of the receiving thread's bursts: on loopback on the
/// project's 2-core machine, BBR held `umbp-bench remote`'s restores at 1.95 / 2.25 / 2.33
/// GiB/s (64 KiB / 256 KiB / 1 MiB) where `cubic` moved 2.54 / 2.98 / 3.20, and stalled one
/// pool get in three for 130 to 150 ms until a retransmission (the README has the runs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Congestion {
    /// The system's default (`net.ipv4.tcp_congestion_control`), except on a connection whose
    /// two ends are one host (a loopback address, or the host's own): there a pacing default
    /// (BBR) gives way to `cubic`, or to `reno` where the kernel does not let the process pick
    /// `cubic` (`reno` is always allowed). A connection between hosts keeps the system's
    /// choice.
    #[default]
    Auto,
    /// The system's default on every connection.
    System,
    /// This algorithm (`cubic`, `dctcp`...) on every connection. The kernel must have it and
    /// let the process pick it (`net.ipv4.tcp_allowed_congestion_control`, or any with
    /// `CAP_NET_ADMIN`): an engine or server asked for one it refuses does not start
    /// ([`Error::Config`]).
    Named(String),
}

/// The longest algorithm name the kernel takes (`TCP_CA_NAME_MAX`, 16, less its NUL).
const MAX_CONGESTION_NAME: usize = 15;

/// `auto`, `system`, or an algorithm's name (`cubic`, `reno`, `dctcp`...): how the memory
/// node's `--congestion` and Python's `congestion=` spell a [`Congestion`]. A name is letters,
/// digits, `_` and `-`, at most 15 bytes (what the kernel takes); anything else is an
/// [`Error::Config`]. Whether the kernel has the algorithm and lets the process pick it is
/// checked when an engine or a server starts.
///
/// ```
/// use umbp_remote::Congestion;
///
/// assert_eq!("system".parse::<Congestion>().unwrap(), Congestion::System);
/// assert_eq!("cubic".parse::<Congestion>().unwrap(), Congestion::Named("cubic".into()));
/// assert!("cubic; reboot".parse::<Congestion>().is_err());
/// ```
impl std::str::FromStr for Congestion {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "auto" => Ok(Self::Auto),
            "system" => Ok(Self::System),
            name if !name.is_empty()
                && name.len() <= MAX_CONGESTION_NAME
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                Ok(Self::Named(name.to_owned()))
            }
            other => Err(Error::Config {
                setting: "congestion",
                reason: format!(
                    "`{other}`: expected `auto`, `system` or an algorithm's name (`cubic`, \
                     `reno`...: letters, digits, `_` and `-`, at most {MAX_CONGESTION_NAME} bytes)"
                ),
            }),
        }
    }
}

/// The spelling [`FromStr`](std::str::FromStr) reads: `auto`, `system`, or the algorithm's
/// name.
impl std::fmt::Display for Congestion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::System => f.write_str("system"),
            Self::Named(name) => f.write_str(name),
        }
    }
}

/// What a [`RemoteServer`](crate::RemoteServer) spends on connections at most. One thread answers
/// every handshake (an event loop), so connections that have not authenticated cost a socket
/// each and no thread; each authenticated client costs one thread.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Authenticated clients served at once; one more is told the server is full. Each lane
    /// of a client's link ([`RemoteConfig::lanes`]) is one. Default: 128.
    pub max_clients: usize,
    /// Authenticated clients from one IP address at once. Default: 32 (16 engines of two
    /// lanes).
    pub max_clients_per_ip: usize,
    /// Connections in their handshake at once; a new one past this closes one polled at least
    /// once, of the address with the most (see the README's threat model). The listening
    /// socket's backlog is at least this. Default: 1024.
    pub max_handshakes: usize,
    /// Connections in their handshake at once from one IP address; a new one past this
    /// closes one of that address's (the least far, then the longest waiting). Default: 64.
    pub max_handshakes_per_ip: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            max_clients: 128,
            max_clients_per_ip: 32,
            max_handshakes: 1024,
            max_handshakes_per_ip: 64,
        }
    }
}

impl std::fmt::Debug for RemoteConfig {
    /// Says whether a secret is set, never the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("transports", &self.transports)
            .field("secret", &self.secret.as_ref().map(|_| "<secret>"))
            .field("insecure_no_auth", &self.insecure_no_auth)
            .field("connect_timeout", &self.connect_timeout)
            .field("peer_timeout", &self.peer_timeout)
            .field("protection", &self.protection)
            .field("heartbeat", &self.heartbeat)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("lanes", &self.lanes)
            .field("map_host_memory", &self.map_host_memory)
            .field("limits", &self.limits)
            .field("congestion", &self.congestion)
            .finish()
    }
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            transports: None,
            secret: std::env::var_os(SECRET_ENV).map(|s| s.into_encoded_bytes()),
            insecure_no_auth: false,
            connect_timeout: Duration::from_secs(10),
            peer_timeout: Duration::from_secs(5),
            protection: Protection::Encrypted,
            heartbeat: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(10),
            max_in_flight: 256,
            lanes: 2,
            map_host_memory: true,
            limits: ServerLimits::default(),
            congestion: Congestion::Auto,
        }
    }
}

impl RemoteConfig {
    /// Refuses ([`Error::Config`]) a [`Congestion::Named`] algorithm the kernel does not
    /// let this process pick, tried on a socket of its own.
    pub(crate) fn check_congestion(&self) -> Result<(), Error> {
        let Congestion::Named(name) = &self.congestion else { return Ok(()) };
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None);
        socket.and_then(|s| s.set_tcp_congestion(name.as_bytes())).map_err(|e| Error::Config {
            setting: "congestion",
            reason: format!("the kernel does not let this process pick `{name}`: {e}"),
        })
    }

    /// How this side authenticates: the secret, or the explicit choice to run without one.
    pub(crate) fn auth(&self) -> Result<crate::handshake::Auth<'_>, Error> {
        use crate::handshake::Auth;
        match (&self.secret, self.insecure_no_auth) {
            (Some(_), true) => Err(Error::Config {
                setting: "insecure_no_auth",
                reason: "set together with a secret: choose one".into(),
            }),
            (Some(secret), false) if !(MIN_SECRET..=MAX_SECRET).contains(&secret.len()) => {
                Err(Error::Config {
                    setting: "secret",
                    reason: format!(
                        "a secret of {} bytes; it must have {MIN_SECRET} to {MAX_SECRET}",
                        secret.len()
                    ),
                })
            }
            (Some(secret), false) => Ok(Auth::Keyed(secret)),
            (None, true) => Ok(Auth::Insecure),
            (None, false) => Err(Error::Config {
                setting: "secret",
                reason: format!(
                    "no shared secret: give one (`secret`; in Python `remote_secret=` or \
                     `Server(secret=)`; or the environment's {SECRET_ENV}), or choose to run \
                     without authentication (`insecure_no_auth`; in Python \
                     `remote_insecure_no_auth=` or `Server(insecure_no_auth=)`)"
                ),
            }),
        }
    }
}

/// The engine's name, in its failures and registrations' errors.
pub(crate) const NAME: &str = "ucx";

/// RDMA transports, on which the NIC enforces a remote key's bounds and rights.
const HARDWARE_RMA: &[&str] =
    &["rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5"];

/// Whether `transports` name RDMA transports only: then, and only then, the server hands
/// out remote keys for one-sided access. Anything else (TCP, shared memory, UCX's own
/// choice, which may fall back to either) is served through the checked request path.
pub(crate) fn hardware_enforced(transports: Option<&str>) -> bool {
    transports.is_some_and(|t| {
        let mut names = t.split(',').map(str::trim).filter(|n| !n.is_empty()).peekable();
        names.peek().is_some() && names.all(|n| HARDWARE_RMA.contains(&n))
    })
}

#[cfg(test)]
mod tests {
    use super::{hardware_enforced, Congestion, RemoteConfig};
    use crate::Error;

    /// An algorithm the kernel lacks is refused before anything starts, naming the setting;
    /// `reno`, which every Linux kernel has and lets any process pick, and the defaults pass.
    #[test]
    fn a_congestion_control_the_kernel_refuses_is_a_config_error() {
        let named = |name: &str| RemoteConfig {
            congestion: Congestion::Named(name.into()),
            ..RemoteConfig::default()
        };
        match named("no-such-algorithm").check_congestion() {
            Err(Error::Config { setting: "congestion", reason }) => {
                assert!(reason.contains("no-such-algorithm"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        named("reno").check_congestion().unwrap();
        RemoteConfig::default().check_congestion().unwrap();
        let system = RemoteConfig { congestion: Congestion::System, ..RemoteConfig::default() };
        system.check_congestion().unwrap();
    }

    /// Every spelling reads back as it prints; a name the kernel could not take (empty,
    /// too long, with other characters) is refused naming the setting.
    #[test]
    fn congestion_reads_and_prints_its_spellings() {
        for spelled in
            ["auto", "system", "cubic", "reno", "dctcp", "bbr", "a_b-2", "x".repeat(15).as_str()]
        {
            let c: Congestion = spelled.parse().unwrap();
            assert_eq!(c.to_string(), spelled);
        }
        assert_eq!("auto".parse::<Congestion>().unwrap(), Congestion::Auto);
        assert_eq!("system".parse::<Congestion>().unwrap(), Congestion::System);
        assert_eq!("bbr".parse::<Congestion>().unwrap(), Congestion::Named("bbr".into()));
        for bad in ["", " cubic", "cubic\n", "x".repeat(16).as_str(), "cu/bic", "cubic;ls", "é"] {
            match bad.parse::<Congestion>() {
                Err(Error::Config { setting: "congestion", .. }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn only_rdma_transports_alone_are_taken_as_hardware_enforced() {
        assert!(hardware_enforced(Some("rc")));
        assert!(hardware_enforced(Some("rc_x, dc_x")));
        for doubtful in [None, Some(""), Some("tcp"), Some("sm"), Some("rc,tcp"), Some("^tcp")] {
            assert!(!hardware_enforced(doubtful), "{doubtful:?}");
        }
        assert!(!hardware_enforced(Some("rc,sm")));
        assert!(!hardware_enforced(Some("all")));
    }
}
