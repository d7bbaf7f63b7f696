//! The command line, the configuration file, and the settings the two make (flags override
//! the file).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use std::net::SocketAddr;

use crate::MembershipConfig;
use clap::{Parser, ValueEnum};
use serde::Deserialize;
use umbp_pool::{NodeId, RedisConfig};
use umbp_remote::{Congestion, Protection, RemoteConfig};

/// Serve this node's memory to other nodes' umbp engines over UCX: a memory node.
///
/// Each region is host memory of this process, named, zeroed at start, readable by every
/// authenticated client and writable unless marked read-only. Clients prove they hold the
/// shared secret (`--secret-file`, or the environment variable UMBP_UCX_SECRET); the
/// connection after that is sealed (`--protection`).
///
/// Settings come from `--config FILE` (TOML; see docs/MEMORY-NODE.md) and the flags, a flag
/// overriding the file's key of the same name (`--region` flags replace the file's regions).
/// Prints `listening ADDR` on standard output once serving; logs go to standard error
/// (filtered by RUST_LOG, default `info`). SIGTERM or SIGINT drains: the listener closes,
/// requests in progress finish (up to `--drain-timeout-ms`), then it exits 0; a second
/// signal exits at once (status 1).
#[derive(Debug, Parser)]
#[command(name = "umbp-ucx-serve", version)]
pub(crate) struct Args {
    /// A TOML configuration file (its keys are the flags' long names with `_` for `-`, and
    /// `[[region]]` tables with `name`, `size` and `read_only`). Unknown keys are refused.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,

    /// The address to listen on: the interface the compute nodes reach (default
    /// 127.0.0.1:7400; port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<String>,

    /// A region to export: NAME=SIZE, `:ro` appended for read-only (`kv=64GiB`,
    /// `prefix=1GiB:ro`). Sizes as everywhere in umbp: `64K` is 64,000 bytes, `64KiB`
    /// 65,536. Repeat for several; regions are numbered in order.
    #[arg(long = "region", value_name = "NAME=SIZE[:ro]", value_parser = parse_region)]
    pub(crate) regions: Vec<RegionSpec>,

    /// The file holding the shared secret (16 to 4096 bytes; one trailing newline dropped).
    /// Refused when other users may read it (chmod 600). Without it: UMBP_UCX_SECRET. A
    /// relative PATH (here or as the config file's `secret_file`) is taken from the working
    /// directory, not the config file's folder.
    #[arg(long, value_name = "PATH")]
    pub(crate) secret_file: Option<PathBuf>,

    /// Serve whoever connects, without authentication: anyone who reaches the port reads
    /// every region and writes the writable ones. Refused together with a secret.
    #[arg(long)]
    pub(crate) insecure_no_auth: bool,

    /// What protects each session after the handshake: `encrypted` (AES-256-GCM) or
    /// `authenticated` (keyed BLAKE3 tags, bytes in the clear). A session is encrypted when
    /// either side asks. Default: encrypted.
    #[arg(long, value_name = "MODE")]
    pub(crate) protection: Option<ProtectionArg>,

    /// UCX transports (UCX_TLS's syntax: `tcp`, `rc`...). Only RDMA transports alone give
    /// clients one-sided access; anything else is served on the checked path.
    #[arg(long, value_name = "TLS")]
    pub(crate) transports: Option<String>,

    /// The TCP congestion control of the checked connections: `auto` (the default: the
    /// system's, except that connections staying on this host leave a pacing one such as BBR
    /// for `cubic`), `system` (the system's on every connection) or an algorithm's name
    /// (`cubic`, `dctcp`...) on every connection, which the kernel must allow this process.
    #[arg(long, value_name = "ALGORITHM")]
    pub(crate) congestion: Option<Congestion>,

    /// Close a client's session when nothing (not even a heartbeat) arrived for this long,
    /// in milliseconds (default 10000).
    #[arg(long, value_name = "MS")]
    pub(crate) idle_timeout_ms: Option<u64>,

    /// Close a client's session when it leaves one answer unread this long, in milliseconds
    /// (default 5000).
    #[arg(long, value_name = "MS")]
    pub(crate) peer_timeout_ms: Option<u64>,

    /// Close a connection whose handshake is not done within this long, in milliseconds
    /// (default 10000).
    #[arg(long, value_name = "MS")]
    pub(crate) handshake_timeout_ms: Option<u64>,

    /// Clients served at once (default 64).
    #[arg(long, value_name = "N")]
    pub(crate) max_clients: Option<usize>,

    /// Clients from one IP address served at once (default 16).
    #[arg(long, value_name = "N")]
    pub(crate) max_clients_per_ip: Option<usize>,

    /// Serve Prometheus metrics at http://ADDR/metrics (default: none). Keep it on an
    /// address only the monitoring reaches.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<String>,

    /// On SIGTERM or SIGINT, how long requests in progress may take to finish before the
    /// remaining sessions are cut, in milliseconds (default 5000).
    #[arg(long, value_name = "MS")]
    pub(crate) drain_timeout_ms: Option<u64>,

    /// Also drain and exit when standard input closes (for a parent process that holds a
    /// pipe to it: its death stops the server).
    #[arg(long)]
    pub(crate) exit_on_stdin_close: bool,

    /// Join the umbp pool whose index is this Redis server (`redis://host:port/db`; a password
    /// may be in the URL, `redis://:PASSWORD@host:port/`, but `--pool-password-file` keeps it
    /// out of the process list): each writable region is offered as a tier of
    /// `--pool-slot-size` slots, the node is announced and renewed, and SIGTERM leaves the pool
    /// before draining. Needs `--node-id` and `--pool-slot-size`.
    #[arg(long, value_name = "URL")]
    pub(crate) pool: Option<String>,

    /// The file holding the pool's Redis password (`requirepass`, or the ACL user's); one
    /// trailing newline dropped. Refused when other users may read it (chmod 600).
    #[arg(long, value_name = "PATH")]
    pub(crate) pool_password_file: Option<PathBuf>,

    /// The pool's name in Redis (its keys' prefix; several pools share one server apart).
    /// Clients must use the same. Default: umbp.
    #[arg(long, value_name = "NAME")]
    pub(crate) pool_name: Option<String>,

    /// This node's id in the pool (0 to 4294967295): unique among the pool's nodes and the
    /// same across restarts of this node.
    #[arg(long, value_name = "N")]
    pub(crate) node_id: Option<u32>,

    /// The address clients reach this node at, announced in the pool: HOST:PORT, or HOST
    /// alone for the port listened on. Default: the address listened on, which must then be
    /// a specific one (not 0.0.0.0, or :: for IPv6).
    #[arg(long, value_name = "ADDR")]
    pub(crate) advertise: Option<String>,

    /// Bytes per slot of the pool's tiers: the largest block clients store here (e.g. 2MiB).
    /// A region of N bytes is a tier of N / SIZE slots.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub(crate) pool_slot_size: Option<u64>,

    /// How long the node's announcement lasts, in milliseconds (default 10000); it is renewed
    /// every third of it. A node killed without leaving drops out of the pool this long after
    /// its last renewal.
    #[arg(long, value_name = "MS")]
    pub(crate) pool_ttl_ms: Option<u64>,

    /// Test pattern (tests and benchmarks): a writable region `arena` of this size whose byte
    /// i is a function of i and `--fill`, exported before the `--region` ones.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub(crate) bytes: Option<u64>,

    /// Test pattern: a read-only region `ro` of this size, filled with the seed `--fill` + 1,
    /// exported after `arena`.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub(crate) read_only_bytes: Option<u64>,

    /// Test pattern: the seed of `arena`'s bytes (0 to 255, default 0).
    #[arg(long, value_name = "SEED")]
    pub(crate) fill: Option<u8>,
}

/// `--protection`'s values.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ProtectionArg {
    /// AES-256-GCM: an observer sees no byte of the regions.
    Encrypted,
    /// Keyed BLAKE3 tags: the bytes travel in the clear, changed ones are refused.
    Authenticated,
}

/// One region to export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RegionSpec {
    pub(crate) name: String,
    pub(crate) size: u64,
    pub(crate) read_only: bool,
    /// The test pattern's seed; `None`: zeroed.
    pub(crate) fill: Option<u8>,
}

/// What stops the server from starting; printed with its causes, exit status 2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettingsError {
    /// The configuration file could not be read.
    #[error("config file {path}: {source}")]
    ReadConfig { path: PathBuf, source: std::io::Error },
    /// The configuration file is not valid TOML or has a key this version does not know.
    #[error("config file {path}: {message}")]
    ParseConfig { path: PathBuf, message: String },
    /// A size that parse-size does not read.
    #[error("{what}: `{value}` is not a size ({reason}; e.g. 64GiB, 512MiB, 4096)")]
    BadSize { what: String, value: String, reason: String },
    /// A region that cannot be served as given.
    #[error("region `{name}`: {reason}")]
    BadRegion { name: String, reason: String },
    /// No region at all.
    #[error("no region to serve: give one with --region NAME=SIZE (or [[region]] in --config)")]
    NoRegion,
    /// The secret file could not be read.
    #[error("secret file {path}: {source}")]
    ReadSecret { path: PathBuf, source: std::io::Error },
    /// The pool settings are incomplete or contradict the regions.
    #[error("pool: {0}")]
    Pool(String),
    /// A congestion control that is no algorithm's name.
    #[error("{0}")]
    Congestion(umbp_remote::Error),
    /// The secret file may be read by other users.
    #[error(
        "secret file {path} is readable by other users (mode {mode:04o}): make it private \
         (chmod 600, owned by the user the server runs as) or pass it as a systemd credential"
    )]
    SecretExposed { path: PathBuf, mode: u32 },
}

/// A size as everywhere in umbp: a number with an optional unit (`parse-size`).
pub(crate) fn parse_size_text(what: &str, value: &str) -> Result<u64, SettingsError> {
    parse_size::parse_size(value.trim()).map_err(|e| SettingsError::BadSize {
        what: what.to_owned(),
        value: value.to_owned(),
        reason: e.to_string(),
    })
}

fn parse_bytes(value: &str) -> Result<u64, String> {
    parse_size::parse_size(value.trim())
        .map_err(|e| format!("not a size ({e}; e.g. 64GiB, 512MiB, 4096)"))
}

/// `NAME=SIZE[:ro]`.
pub(crate) fn parse_region(value: &str) -> Result<RegionSpec, String> {
    let (name, rest) = value
        .split_once('=')
        .ok_or_else(|| "expected NAME=SIZE or NAME=SIZE:ro (e.g. kv=64GiB)".to_owned())?;
    let (size, read_only) = match rest.rsplit_once(':') {
        Some((size, "ro")) => (size, true),
        Some((size, "rw")) => (size, false),
        Some((_, other)) => {
            return Err(format!("`:{other}`: only `:ro` or `:rw` may follow the size"))
        }
        None => (rest, false),
    };
    let size = parse_size::parse_size(size.trim())
        .map_err(|e| format!("`{size}` is not a size ({e}; e.g. 64GiB, 512MiB, 4096)"))?;
    Ok(RegionSpec { name: name.trim().to_owned(), size, read_only, fill: None })
}

/// The configuration file: the flags' keys, and `[[region]]` tables.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    listen: Option<String>,
    #[serde(default, rename = "region")]
    regions: Vec<FileRegion>,
    secret_file: Option<PathBuf>,
    insecure_no_auth: Option<bool>,
    protection: Option<ProtectionArg>,
    transports: Option<String>,
    congestion: Option<String>,
    idle_timeout_ms: Option<u64>,
    peer_timeout_ms: Option<u64>,
    handshake_timeout_ms: Option<u64>,
    max_clients: Option<usize>,
    max_clients_per_ip: Option<usize>,
    metrics: Option<String>,
    drain_timeout_ms: Option<u64>,
    pool: Option<String>,
    pool_password_file: Option<PathBuf>,
    pool_name: Option<String>,
    node_id: Option<u32>,
    advertise: Option<String>,
    pool_slot_size: Option<SizeValue>,
    pool_ttl_ms: Option<u64>,
}

/// A `[[region]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRegion {
    name: String,
    size: SizeValue,
    #[serde(default)]
    read_only: bool,
}

/// A size in the file: a number of bytes or a string with a unit.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl FileConfig {
    /// Reads and parses `path`.
    pub(crate) fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::ReadConfig { path: path.to_owned(), source })?;
        Self::parse(path, &text)
    }

    /// Parses `text` (read from `path`).
    pub(crate) fn parse(path: &Path, text: &str) -> Result<Self, SettingsError> {
        toml::from_str(text).map_err(|e| SettingsError::ParseConfig {
            path: path.to_owned(),
            // toml's message names the key and shows the line; one line of it is enough.
            message: e.message().to_owned() + &line_of(text, e.span()),
        })
    }
}

/// " (line N)" for a span of `text`.
fn line_of(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    span.map(|s| format!(" (line {})", text[..s.start.min(text.len())].matches('\n').count() + 1))
        .unwrap_or_default()
}

/// What the server runs with.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) listen: String,
    pub(crate) regions: Vec<RegionSpec>,
    pub(crate) ucx: RemoteConfig,
    pub(crate) metrics: Option<String>,
    pub(crate) drain_timeout: Duration,
    pub(crate) exit_on_stdin_close: bool,
    /// The pool to join, if any.
    pub(crate) pool: Option<PoolSettings>,
    /// Warnings to log once logging is up (a group-readable secret file).
    pub(crate) warnings: Vec<String>,
}

/// How the node joins a pool.
#[derive(Debug)]
pub(crate) struct PoolSettings {
    /// The Redis index (its password, when from a file, set).
    pub(crate) redis: RedisConfig,
    /// The URL without its password, for logs.
    pub(crate) shown: String,
    pub(crate) node: NodeId,
    /// `--advertise`, if given.
    pub(crate) advertise: Option<String>,
    pub(crate) slot_size: u64,
    pub(crate) ttl: Duration,
}

impl PoolSettings {
    /// The membership for a server bound to `bound` with `regions`.
    pub(crate) fn membership(&self, bound: SocketAddr) -> Result<MembershipConfig, String> {
        let address = advertised(self.advertise.as_deref(), bound)?;
        let mut c = MembershipConfig::new(self.node, address, self.slot_size);
        c.ttl = self.ttl;
        Ok(c)
    }
}

/// The address to announce: `advertise` (HOST:PORT, or HOST alone for `bound`'s port), or
/// `bound` itself when it is a specific address.
pub(crate) fn advertised(advertise: Option<&str>, bound: SocketAddr) -> Result<String, String> {
    match advertise.map(str::trim) {
        None if bound.ip().is_unspecified() => Err(format!(
            "listening on {bound}, which is no address a client can reach: give the address              to announce with --advertise HOST[:PORT]"
        )),
        None => Ok(bound.to_string()),
        Some("") => Err("--advertise is empty".into()),
        Some(a) => {
            if let Ok(ip) = a.parse::<std::net::IpAddr>() {
                return Ok(SocketAddr::new(ip, bound.port()).to_string());
            }
            if a.parse::<SocketAddr>().is_ok() {
                return Ok(a.to_owned());
            }
            match a.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                    Ok(a.to_owned())
                }
                Some(_) => Err(format!("--advertise {a}: expected HOST, HOST:PORT or [IPv6]:PORT")),
                None => Ok(format!("{a}:{}", bound.port())),
            }
        }
    }
}

/// `url` with its password replaced by `***`, for logs.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let (auth, host) = match rest.split_once('@') {
        Some(parts) => parts,
        None => return url.to_owned(),
    };
    let user = auth.split_once(':').map_or("", |(user, _)| user);
    format!("{scheme}://{user}:***@{host}")
}

impl Settings {
    /// The flags over the file (when `--config` names one).
    pub(crate) fn from_args(args: Args) -> Result<Self, SettingsError> {
        let file = match &args.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        Self::merge(args, file)
    }

    /// `args` over `file`.
    pub(crate) fn merge(args: Args, file: FileConfig) -> Result<Self, SettingsError> {
        let mut warnings = Vec::new();
        let mut regions = Vec::new();
        let seed = args.fill.unwrap_or(0);
        if let Some(bytes) = args.bytes {
            regions.push(RegionSpec {
                name: "arena".into(),
                size: bytes,
                read_only: false,
                fill: Some(seed),
            });
        }
        if let Some(bytes) = args.read_only_bytes.filter(|&b| b > 0) {
            regions.push(RegionSpec {
                name: "ro".into(),
                size: bytes,
                read_only: true,
                fill: Some(seed.wrapping_add(1)),
            });
        }
        if args.regions.is_empty() {
            for r in file.regions {
                let size = match r.size {
                    SizeValue::Bytes(n) => n,
                    SizeValue::Text(text) => {
                        parse_size_text(&format!("region `{}`'s size", r.name), &text)?
                    }
                };
                regions.push(RegionSpec { name: r.name, size, read_only: r.read_only, fill: None });
            }
        } else {
            regions.extend(args.regions);
        }
        check_regions(&regions)?;

        let mut ucx = RemoteConfig {
            transports: args.transports.or(file.transports),
            insecure_no_auth: args.insecure_no_auth || file.insecure_no_auth.unwrap_or(false),
            ..RemoteConfig::default()
        };
        if let Some(path) = args.secret_file.or(file.secret_file) {
            let (secret, warning) = read_secret(&path)?;
            ucx.secret = Some(secret);
            warnings.extend(warning);
        }
        if let Some(p) = args.protection.or(file.protection) {
            ucx.protection = match p {
                ProtectionArg::Encrypted => Protection::Encrypted,
                ProtectionArg::Authenticated => Protection::Authenticated,
            };
        }
        if let Some(c) = args.congestion {
            ucx.congestion = c;
        } else if let Some(text) = file.congestion {
            ucx.congestion = text.parse().map_err(SettingsError::Congestion)?;
        }
        let ms = Duration::from_millis;
        if let Some(t) = args.idle_timeout_ms.or(file.idle_timeout_ms) {
            ucx.idle_timeout = ms(t);
        }
        if let Some(t) = args.peer_timeout_ms.or(file.peer_timeout_ms) {
            ucx.peer_timeout = ms(t);
        }
        if let Some(t) = args.handshake_timeout_ms.or(file.handshake_timeout_ms) {
            ucx.connect_timeout = ms(t);
        }
        if let Some(n) = args.max_clients.or(file.max_clients) {
            ucx.limits.max_clients = n;
        }
        if let Some(n) = args.max_clients_per_ip.or(file.max_clients_per_ip) {
            ucx.limits.max_clients_per_ip = n;
        }
        if args.pool.as_deref().is_some_and(|url| redact(url) != url) {
            warnings.push(
                "the --pool URL carries a password, which other users of this machine can read in \
                 the process list: use --pool-password-file (or the config file) instead"
                    .into(),
            );
        }
        let pool = pool_settings(
            PoolArgs {
                url: args.pool.or(file.pool),
                password_file: args.pool_password_file.or(file.pool_password_file),
                name: args.pool_name.or(file.pool_name),
                node: args.node_id.or(file.node_id),
                advertise: args.advertise.or(file.advertise),
                slot_size: match (args.pool_slot_size, file.pool_slot_size) {
                    (Some(n), _) => Some(n),
                    (None, Some(SizeValue::Bytes(n))) => Some(n),
                    (None, Some(SizeValue::Text(text))) => {
                        Some(parse_size_text("pool_slot_size", &text)?)
                    }
                    (None, None) => None,
                },
                ttl_ms: args.pool_ttl_ms.or(file.pool_ttl_ms),
            },
            &mut warnings,
        )?;
        if let Some(p) = &pool {
            // The same tiers the join will register: a region too small for a slot is a
            // configuration error now, not a failed start later.
            let shapes: Vec<_> =
                regions.iter().map(|r| (r.name.clone(), r.size, !r.read_only)).collect();
            MembershipConfig::new(p.node, "", p.slot_size)
                .tiers(&shapes)
                .map_err(|e| SettingsError::Pool(e.to_string()))?;
        }
        Ok(Self {
            listen: args.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:7400".into()),
            regions,
            ucx,
            metrics: args.metrics.or(file.metrics),
            drain_timeout: ms(args.drain_timeout_ms.or(file.drain_timeout_ms).unwrap_or(5000)),
            exit_on_stdin_close: args.exit_on_stdin_close,
            pool,
            warnings,
        })
    }
}

/// The pool's settings as given, before they are checked.
struct PoolArgs {
    url: Option<String>,
    password_file: Option<PathBuf>,
    name: Option<String>,
    node: Option<u32>,
    advertise: Option<String>,
    slot_size: Option<u64>,
    ttl_ms: Option<u64>,
}

/// `None` without `--pool` (refusing the other pool settings alone); else the checked settings.
fn pool_settings(
    a: PoolArgs,
    warnings: &mut Vec<String>,
) -> Result<Option<PoolSettings>, SettingsError> {
    let bad = |m: String| SettingsError::Pool(m);
    let Some(url) = a.url else {
        let given = [
            ("--pool-password-file", a.password_file.is_some()),
            ("--pool-name", a.name.is_some()),
            ("--node-id", a.node.is_some()),
            ("--advertise", a.advertise.is_some()),
            ("--pool-slot-size", a.slot_size.is_some()),
            ("--pool-ttl-ms", a.ttl_ms.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
            return Err(bad(format!("{flag} is a pool setting, but no --pool URL was given")));
        }
        return Ok(None);
    };
    let node = a.node.ok_or_else(|| {
        bad("--pool needs --node-id N (unique in the pool, the same across restarts)".into())
    })?;
    let slot_size = a.slot_size.ok_or_else(|| {
        bad("--pool needs --pool-slot-size SIZE (the largest block stored here, e.g. 2MiB)".into())
    })?;
    if slot_size == 0 {
        return Err(bad("--pool-slot-size must be positive".into()));
    }
    let ttl = Duration::from_millis(a.ttl_ms.unwrap_or(10_000));
    if ttl < Duration::from_millis(30) {
        return Err(bad("--pool-ttl-ms must be at least 30".into()));
    }
    let mut redis = RedisConfig::new(url.clone());
    if let Some(name) = a.name {
        redis.prefix = name;
    }
    // A call that takes longer than a third of the TTL would let the announcement lapse; but
    // under half a second, a loaded machine's slow answer would fail renewals for nothing.
    redis.timeout = (ttl / 3).clamp(Duration::from_millis(500), Duration::from_secs(5));
    if let Some(path) = &a.password_file {
        let (password, warning) = read_secret(path)?;
        let password = String::from_utf8(password)
            .map_err(|_| bad(format!("the password in {} is not UTF-8 text", path.display())))?;
        redis.password = Some(password);
        warnings.extend(warning);
    }
    Ok(Some(PoolSettings {
        shown: redact(&url),
        redis,
        node: NodeId(node),
        advertise: a.advertise,
        slot_size,
        ttl,
    }))
}

/// Names unique and not empty, sizes above zero.
fn check_regions(regions: &[RegionSpec]) -> Result<(), SettingsError> {
    if regions.is_empty() {
        return Err(SettingsError::NoRegion);
    }
    for (i, r) in regions.iter().enumerate() {
        let bad =
            |reason: &str| SettingsError::BadRegion { name: r.name.clone(), reason: reason.into() };
        if r.name.is_empty() {
            return Err(bad("a region needs a name"));
        }
        if r.size == 0 {
            return Err(bad("a size of 0 bytes"));
        }
        if usize::try_from(r.size).is_err() {
            return Err(bad("larger than this machine's address space"));
        }
        if regions[..i].iter().any(|o| o.name == r.name) {
            return Err(bad("named twice"));
        }
    }
    Ok(())
}

/// The secret in `path` (one trailing newline dropped), refused when other users may read
/// it; a warning when the file's group may.
fn read_secret(path: &Path) -> Result<(Vec<u8>, Option<String>), SettingsError> {
    let read = |source| SettingsError::ReadSecret { path: path.to_owned(), source };
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o7777;
    if mode & 0o007 != 0 {
        return Err(SettingsError::SecretExposed { path: path.to_owned(), mode });
    }
    let warning = (mode & 0o070 != 0).then(|| {
        format!(
            "secret file {} is readable by its group (mode {mode:04o}); chmod 600 it",
            path.display()
        )
    });
    let mut secret = std::fs::read(path).map_err(read)?;
    if secret.last() == Some(&b'\n') {
        secret.pop();
        if secret.last() == Some(&b'\r') {
            secret.pop();
        }
    }
    Ok((secret, warning))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("umbp-ucx-serve").chain(flags.iter().copied()))
    }

    #[test]
    fn regions_read_sizes_as_parse_size_does() {
        let r = parse_region("kv=64GiB").unwrap();
        assert_eq!((r.name.as_str(), r.size, r.read_only), ("kv", 64 << 30, false));
        let r = parse_region("prefix=1.5MB:ro").unwrap();
        assert_eq!((r.size, r.read_only), (1_500_000, true));
        assert_eq!(parse_region("x=4096:rw").unwrap().size, 4096);
        for bad in ["kv", "kv=64XB", "kv=", "kv=1GiB:wo", "kv=-1"] {
            assert!(parse_region(bad).is_err(), "{bad}");
        }
        let e = args(&["--region", "kv=64XB"]).unwrap_err().to_string();
        assert!(e.contains("--region") && e.contains("64XB") && e.contains("not a size"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let file = FileConfig::parse(
            Path::new("t.toml"),
            r#"
            listen = "127.0.0.1:9000"
            idle_timeout_ms = 2000
            metrics = "127.0.0.1:9100"
            insecure_no_auth = true
            [[region]]
            name = "kv"
            size = "2MiB"
            [[region]]
            name = "ro"
            size = 4096
            read_only = true
            "#,
        )
        .unwrap();
        let s = Settings::merge(args(&["--listen", "127.0.0.1:9001"]).unwrap(), file).unwrap();
        assert_eq!(s.listen, "127.0.0.1:9001");
        assert_eq!(s.ucx.idle_timeout, Duration::from_secs(2));
        assert_eq!(s.metrics.as_deref(), Some("127.0.0.1:9100"));
        assert!(s.ucx.insecure_no_auth);
        let names: Vec<_> =
            s.regions.iter().map(|r| (r.name.as_str(), r.size, r.read_only)).collect();
        assert_eq!(names, [("kv", 2 << 20, false), ("ro", 4096, true)]);
        // --region flags replace the file's regions.
        let file = FileConfig::parse(Path::new("t.toml"), "[[region]]\nname = \"kv\"\nsize = 1\n")
            .unwrap();
        let s = Settings::merge(args(&["--region", "other=1KiB"]).unwrap(), file).unwrap();
        assert_eq!(
            s.regions,
            [RegionSpec { name: "other".into(), size: 1024, read_only: false, fill: None }]
        );
    }

    #[test]
    fn congestion_comes_from_the_flag_over_the_file() {
        let region = ["--region", "kv=4KiB"];
        let file = |text: &str| FileConfig::parse(Path::new("t.toml"), text).unwrap();
        let s = Settings::merge(args(&region).unwrap(), FileConfig::default()).unwrap();
        assert_eq!(s.ucx.congestion, Congestion::Auto);
        let s = Settings::merge(args(&region).unwrap(), file("congestion = \"system\"")).unwrap();
        assert_eq!(s.ucx.congestion, Congestion::System);
        let flagged = args(&[&region[..], &["--congestion", "reno"]].concat()).unwrap();
        let s = Settings::merge(flagged, file("congestion = \"system\"")).unwrap();
        assert_eq!(s.ucx.congestion, Congestion::Named("reno".into()));
        // A bad name is refused by name, from the flag and from the file.
        let e = args(&["--congestion", "cubic;ls"]).unwrap_err().to_string();
        assert!(e.contains("--congestion") && e.contains("cubic;ls"), "{e}");
        let e = Settings::merge(args(&region).unwrap(), file("congestion = \"\"")).unwrap_err();
        assert!(
            matches!(e, SettingsError::Congestion(_)) && e.to_string().contains("congestion"),
            "{e}"
        );
    }

    #[test]
    fn the_file_refuses_unknown_keys_and_bad_sizes_by_name() {
        let e = FileConfig::parse(Path::new("t.toml"), "listen = \"x\"\nidle_timeout = 5\n")
            .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, SettingsError::ParseConfig { .. }), "{text}");
        assert!(
            text.contains("idle_timeout") && text.contains("t.toml") && text.contains("line 2"),
            "{text}"
        );
        let e = FileConfig::parse(
            Path::new("t.toml"),
            "[[region]]\nname = \"kv\"\nsize = \"1GiB\"\nwritable = true\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
        let file = FileConfig::parse(
            Path::new("t.toml"),
            "[[region]]\nname = \"kv\"\nsize = \"64 gigs\"\n",
        )
        .unwrap();
        let e = Settings::merge(args(&[]).unwrap(), file).unwrap_err();
        assert!(matches!(&e, SettingsError::BadSize { value, .. } if value == "64 gigs"), "{e}");
        assert!(e.to_string().contains("region `kv`"), "{e}");
    }

    #[test]
    fn regions_are_checked() {
        let e = Settings::merge(args(&[]).unwrap(), FileConfig::default()).unwrap_err();
        assert!(matches!(e, SettingsError::NoRegion), "{e}");
        let e = Settings::merge(
            args(&["--region", "a=1", "--region", "a=2"]).unwrap(),
            FileConfig::default(),
        )
        .unwrap_err();
        assert!(matches!(&e, SettingsError::BadRegion { name, .. } if name == "a"), "{e}");
        let e = Settings::merge(args(&["--region", "a=0"]).unwrap(), FileConfig::default())
            .unwrap_err();
        assert!(e.to_string().contains("0 bytes"), "{e}");
    }

    #[test]
    fn the_advertised_address_and_the_redacted_url() {
        let bound: SocketAddr = "127.0.0.1:7400".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:7401".parse().unwrap();
        assert_eq!(advertised(None, bound).unwrap(), "127.0.0.1:7400");
        assert!(advertised(None, any).unwrap_err().contains("--advertise"));
        assert_eq!(advertised(Some("10.0.0.2"), any).unwrap(), "10.0.0.2:7401");
        assert_eq!(advertised(Some("node-a"), any).unwrap(), "node-a:7401");
        assert_eq!(advertised(Some("node-a:9000"), any).unwrap(), "node-a:9000");
        assert_eq!(advertised(Some("fe80::1"), any).unwrap(), "[fe80::1]:7401");
        assert_eq!(advertised(Some("[fe80::1]:9"), any).unwrap(), "[fe80::1]:9");
        assert!(advertised(Some("node-a:port"), any).is_err());
        assert!(advertised(Some(" "), any).is_err());
        assert_eq!(redact("redis://:pw@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(redact("redis://user:pw@h:6379/"), "redis://user:***@h:6379/");
        assert_eq!(redact("redis://h:6379/"), "redis://h:6379/");
    }

    #[test]
    fn pool_settings_come_from_flags_or_the_file() {
        let file = FileConfig::parse(
            Path::new("t.toml"),
            r#"
            pool = "redis://127.0.0.1:6379/"
            pool_name = "cluster-a"
            node_id = 12
            advertise = "10.0.0.12"
            pool_slot_size = "256KiB"
            pool_ttl_ms = 6000
            [[region]]
            name = "kv"
            size = "1MiB"
            "#,
        )
        .unwrap();
        let s = Settings::merge(args(&["--node-id", "13"]).unwrap(), file).unwrap();
        let p = s.pool.unwrap();
        assert_eq!((p.node, p.slot_size, p.ttl), (NodeId(13), 256 << 10, Duration::from_secs(6)));
        assert_eq!(
            (p.redis.prefix.as_str(), p.advertise.as_deref()),
            ("cluster-a", Some("10.0.0.12"))
        );
        assert_eq!(p.redis.timeout, Duration::from_secs(2));
        let m = p.membership("0.0.0.0:7400".parse().unwrap()).unwrap();
        assert_eq!(m.address, "10.0.0.12:7400");
        // A password in the command line's URL is taken, with a warning.
        let s = Settings::merge(
            args(&[
                "--region",
                "kv=1MiB",
                "--pool",
                "redis://:pw@h/",
                "--node-id",
                "1",
                "--pool-slot-size",
                "4KiB",
            ])
            .unwrap(),
            FileConfig::default(),
        )
        .unwrap();
        assert_eq!(s.pool.unwrap().shown, "redis://:***@h/");
        assert!(s.warnings.iter().any(|w| w.contains("--pool-password-file")), "{:?}", s.warnings);
        let e = FileConfig::parse(Path::new("t.toml"), "pool_slot = 1\n").unwrap_err();
        assert!(e.to_string().contains("pool_slot"), "{e}");
    }

    #[test]
    fn a_secret_file_other_users_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a secret of at least sixteen bytes\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_secret(&path).unwrap_err();
        assert!(matches!(e, SettingsError::SecretExposed { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let (secret, warning) = read_secret(&path).unwrap();
        assert_eq!(secret, b"a secret of at least sixteen bytes");
        assert!(warning.is_some_and(|w| w.contains("group")));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_secret(&path).unwrap().1.is_none());
    }
}
