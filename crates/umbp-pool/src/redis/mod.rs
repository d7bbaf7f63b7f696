//! The Redis index: one pool shared by every instance and node of a cluster.
//!
//! Strategy: every operation that changes state is one Lua script (sent as `EVALSHA`; the
//! client loads it once and again after `NOSCRIPT`, for example after a Redis restart), so the
//! rules hold atomically whatever number of clients race. A batched lookup is one pipeline:
//! the alive-nodes script, then one `HMGET` per 4,096 keys: one round trip for any number of
//! keys. Leases and node announcements are keys with Redis's own TTL: a holder that stops
//! renewing simply lets them expire. Connections are pooled (one per concurrent caller), with
//! read, write and connect timeouts, and a connection that failed is dropped, so a restarted
//! server is reconnected to on the next call. See [`scripts`] for the key layout.

mod lookup;
mod scripts;
mod seal;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use redis::{Connection, IntoConnectionInfo, Script, Value};

use crate::{
    BlockKey, Error, Index, Lease, NodeAnnouncement, NodeId, Placement, Published, Removed,
    Reservation, Reserved, TierId, TierSpec, TierStats,
};

/// How to reach the Redis server and where in it the pool lives.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`, or `rediss://host:port/db` for TLS (needs the `tls` feature). A
    /// password or user in the URL is used unless [`username`](Self::username) /
    /// [`password`](Self::password) are set.
    pub url: String,
    /// The ACL user (Redis 6+), if not `default`.
    pub username: Option<String>,
    /// The password (`requirepass`, or the ACL user's).
    pub password: Option<String>,
    /// The pool's name: every key is under the hash tag `{prefix}`, so several pools share one
    /// server apart. Letters, digits, `-`, `_`, `.`; default `umbp`.
    pub prefix: String,
    /// Connect, read and write timeout of each call; a server that does not answer in time is
    /// [`Error::Redis`]. Default 5 s.
    pub timeout: Duration,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` with a private
    /// CA (the system's roots otherwise). Needs the `tls` feature.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Batched lookups write their pipeline and decode its reply directly over their own TCP
    /// connections (default `true`), instead of through redis-rs's parser, which allocates a
    /// value per key. `false`, and any TLS server, takes the redis-rs path. Both send the same
    /// commands and give the same answers.
    pub direct_lookup: bool,
    /// The cluster's secret (the memory nodes' shared secret, say): every entry is sealed
    /// under a key derived from it, so a Redis writer without it cannot make, copy or edit
    /// an entry that any client takes for a hit (see the crate README's threat model).
    /// Every client of one pool must use the same secret: an entry sealed under another (or
    /// none) is a miss. Default `None`: entries are sealed under a public key, which binds
    /// each entry to its key but does not stop a writer who computes seals on purpose.
    pub secret: Option<Vec<u8>>,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password or the secret: configurations end up in logs.
        f.debug_struct("RedisConfig")
            .field("url", &self.url)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("direct_lookup", &self.direct_lookup)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl RedisConfig {
    /// The settings for `url` with the defaults otherwise.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            username: None,
            password: None,
            prefix: "umbp".into(),
            timeout: Duration::from_secs(5),
            tls_ca_file: None,
            direct_lookup: true,
            secret: None,
        }
    }
}

struct Scripts {
    register_tier: Script,
    reserve: Script,
    reserve_many: Script,
    publish: Script,
    abort: Script,
    alive: Script,
    alive_source: String,
    lease: Script,
    release: Script,
    remove: Script,
    evict: Script,
    stats: Script,
    announce: Script,
    reap: Script,
    leave: Script,
}

impl Scripts {
    fn new() -> Self {
        let s = |body: &str| Script::new(&scripts::source(body));
        Self {
            register_tier: s(scripts::REGISTER_TIER),
            reserve: s(scripts::RESERVE),
            reserve_many: s(scripts::RESERVE_MANY),
            publish: s(scripts::PUBLISH),
            abort: s(scripts::ABORT),
            alive: s(scripts::ALIVE),
            alive_source: scripts::source(scripts::ALIVE),
            lease: s(scripts::LEASE),
            release: s(scripts::RELEASE),
            remove: s(scripts::REMOVE),
            evict: s(scripts::EVICT),
            stats: s(scripts::STATS),
            announce: s(scripts::ANNOUNCE),
            reap: s(scripts::REAP),
            leave: s(scripts::LEAVE),
        }
    }
}

/// The Redis [`Index`]: every instance and node of a cluster shares one, through a Redis 7
/// server (standalone). Nodes [announce](Index::announce) themselves with a TTL and renew it; a
/// node that stops is dead: its entries are absent at once to lookups, leases, reservations
/// and publishes (its keys can be stored again on live nodes), and its state is deleted in
/// bounded steps by live nodes' renewals, by itself when it joins again (empty, possibly with
/// other tier shapes), or all at once by [`reap_dead_nodes`](Self::reap_dead_nodes).
///
/// Tiers registered through this client are remembered, and registered again when a node this
/// client announces rejoins (after it expired, or after the server restarted without its data),
/// so a client resumes by itself once the server is back.
pub struct RedisIndex {
    client: redis::Client,
    idle: Mutex<Vec<Connection>>,
    timeout: Duration,
    prefix: String,
    scripts: Scripts,
    registered: Mutex<HashMap<(NodeId, TierId), TierSpec>>,
    /// The batched lookup's direct path (plain TCP servers; `None`: the redis-rs path).
    direct: Option<lookup::Direct>,
    /// Seals and opens entries (see [`seal`]).
    sealer: seal::Sealer,
    /// Entries found whose seal did not match: misses, counted.
    forged: AtomicU64,
}

impl std::fmt::Debug for RedisIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIndex").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn corrupt(what: &str, v: &Value) -> Error {
    Error::Corrupt(format!("unexpected answer from redis for {what}: {v:?}"))
}

fn bytes<'v>(what: &str, v: &'v Value) -> Result<&'v [u8], Error> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.as_bytes()),
        _ => Err(corrupt(what, v)),
    }
}

/// Whether `e` is, or was caused by, an interrupted system call (`EINTR`).
fn interrupted(e: &redis::RedisError) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

fn int(what: &str, v: &Value) -> Result<i64, Error> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::BulkString(b) => {
            std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).ok_or_else(|| corrupt(what, v))
        }
        _ => Err(corrupt(what, v)),
    }
}

fn array<'v>(what: &str, v: &'v Value) -> Result<&'v [Value], Error> {
    match v {
        Value::Array(a) => Ok(a),
        _ => Err(corrupt(what, v)),
    }
}

impl RedisIndex {
    /// Connects to the server of `config` (one connection now, to fail early; more as callers
    /// need them) and checks that it answers.
    ///
    /// Errors: [`Error::InvalidConfig`] (a bad URL or prefix), [`Error::TlsUnavailable`]
    /// (`rediss://` without the `tls` feature), [`Error::Redis`] (unreachable, wrong password).
    pub fn connect(config: &RedisConfig) -> Result<Self, Error> {
        if config.prefix.is_empty()
            || !config.prefix.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(Error::InvalidConfig(format!(
                "redis prefix {:?}: use letters, digits, '-', '_' or '.'",
                config.prefix
            )));
        }
        if config.timeout.is_zero() {
            return Err(Error::InvalidConfig("redis timeout must be positive".into()));
        }
        let tls = config.url.starts_with("rediss://");
        if tls && !cfg!(feature = "tls") {
            return Err(Error::TlsUnavailable);
        }
        let mut info = config
            .url
            .as_str()
            .into_connection_info()
            .map_err(|e| Error::InvalidConfig(format!("redis url: {e}")))?;
        if config.username.is_some() {
            info.redis.username = config.username.clone();
        }
        if config.password.is_some() {
            info.redis.password = config.password.clone();
        }
        let direct = config
            .direct_lookup
            .then(|| lookup::Direct::for_connection(&info, config.timeout))
            .flatten();
        let client = Self::client(info, config)?;
        let index = Self {
            client,
            idle: Mutex::new(Vec::new()),
            timeout: config.timeout,
            prefix: format!("{{{}}}", config.prefix),
            scripts: Scripts::new(),
            registered: Mutex::new(HashMap::new()),
            direct,
            sealer: seal::Sealer::new(config.secret.as_deref()),
            forged: AtomicU64::new(0),
        };
        index.with(|c| redis::cmd("PING").query::<()>(c))?;
        Ok(index)
    }

    #[cfg(feature = "tls")]
    fn client(info: redis::ConnectionInfo, config: &RedisConfig) -> Result<redis::Client, Error> {
        // rustls needs a process-wide crypto provider; ring's, unless the program chose one.
        let _ = rustls::crypto::ring::default_provider().install_default();
        match &config.tls_ca_file {
            Some(path) => {
                let root_cert = std::fs::read(path).map_err(|e| {
                    Error::InvalidConfig(format!("redis CA file {}: {e}", path.display()))
                })?;
                Ok(redis::Client::build_with_tls(
                    info,
                    redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) },
                )?)
            }
            None => Ok(redis::Client::open(info)?),
        }
    }

    #[cfg(not(feature = "tls"))]
    fn client(info: redis::ConnectionInfo, config: &RedisConfig) -> Result<redis::Client, Error> {
        if config.tls_ca_file.is_some() {
            return Err(Error::TlsUnavailable);
        }
        Ok(redis::Client::open(info)?)
    }

    /// Runs `f` on a pooled connection; a connection whose call failed is dropped rather than
    /// pooled (it may hold half a reply, or the server may be gone).
    ///
    /// A pooled connection to a server that went away since it was pooled (the server was
    /// restarted) fails at once, closed; the call is then made once more on a fresh
    /// connection, so the first calls after a restart succeed. Making it again is safe: the
    /// server that closed the connection is gone, and with it whatever the call did there
    /// (unless it persisted it: then a reservation or lease is taken twice and ends by its TTL,
    /// or a publish that won answers `Expired`, which the caller treats as a failed save).
    fn with<T>(
        &self,
        mut f: impl FnMut(&mut Connection) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        let pooled = lock(&self.idle).pop();
        let was_pooled = pooled.is_some();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.open_connection()?,
        };
        let mut result = f(&mut conn);
        if was_pooled && result.as_ref().is_err_and(|e| e.is_connection_dropped()) {
            conn = self.open_connection()?;
            result = f(&mut conn);
        }
        // A signal handled by this process interrupts a socket read that has a timeout (the
        // kernel never restarts those, SA_RESTART or not: signal(7)), and redis-rs hands the
        // EINTR up. The connection's state is unknown then: the call is made again on a
        // fresh one. (Seen in Python processes.) Every script is safe to run twice: a
        // repeated reservation or lease holds its slot until its TTL; a repeated publish
        // answers `Expired` for a block that is published (its caller reports a failed put of
        // a block that is in the pool, with right bytes); a repeated removal or leave answers
        // as for one that already happened.
        for _ in 0..3 {
            if !result.as_ref().is_err_and(interrupted) {
                break;
            }
            conn = self.open_connection()?;
            result = f(&mut conn);
        }
        if result.is_ok() {
            lock(&self.idle).push(conn);
        }
        Ok(result?)
    }

    fn open_connection(&self) -> Result<Connection, Error> {
        let c = self.client.get_connection_with_timeout(self.timeout)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }

    /// Entries this client found whose seal did not match their key (copied, edited or made
    /// up in Redis, or sealed under another secret): each was taken for a miss.
    pub fn forged_entries(&self) -> u64 {
        self.forged.load(Ordering::Relaxed)
    }

    /// The placement stored for `key` as `value` if its seal holds; a forged one is counted
    /// and is `None`.
    fn open(&self, key: BlockKey, value: &[u8]) -> Option<Placement> {
        let p = self.sealer.open(key, value);
        if p.is_none() {
            self.forged.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%key, "pool: an entry in redis fails its seal; taken for a miss");
        }
        p
    }

    /// Deletes the state of every node whose announcement expired (their entries are already
    /// absent to lookups and writers; this frees them without waiting for the nodes to rejoin
    /// or for live nodes' renewals to reap them, a few at a time). Returns how many nodes were
    /// reaped. Runs as many bounded script calls as the dead nodes need.
    pub fn reap_dead_nodes(&self) -> Result<u32, Error> {
        let mut reaped = 0;
        for _ in 0..MAX_STEPS {
            let v: Value = self.with(|c| self.scripts.reap.arg(&self.prefix).invoke(c))?;
            let [done, left] = array("reap", &v)? else { return Err(corrupt("reap", &v)) };
            reaped += int("reap", done)? as u32;
            if int("reap", left)? == 0 {
                break;
            }
        }
        Ok(reaped)
    }

    fn register_remote(&self, spec: &TierSpec) -> Result<(), Error> {
        for _ in 0..MAX_STEPS {
            let v: Value = self.with(|c| {
                self.scripts
                    .register_tier
                    .arg(&self.prefix)
                    .arg(spec.node.0)
                    .arg(spec.tier.0)
                    .arg(spec.slot_size)
                    .arg(spec.slot_count)
                    .arg(u8::from(spec.durable))
                    .arg(spec.low_watermark)
                    .arg(spec.high_watermark)
                    .invoke(c)
            })?;
            let a = array("register_tier", &v)?;
            match a.first().map(|s| bytes("register_tier", s)).transpose()? {
                Some(b"ok") => return Ok(()),
                // A dead node's tier with another shape, being emptied step by step.
                Some(b"more") => continue,
                Some(b"conflict") if a.len() == 4 => {
                    return Err(Error::TierConflict {
                        node: spec.node,
                        tier: spec.tier,
                        reason: format!(
                            "registered in redis: slot size {}, slot count {}, durable {}, and \
                             the node is alive",
                            String::from_utf8_lossy(bytes("register_tier", &a[1])?),
                            String::from_utf8_lossy(bytes("register_tier", &a[2])?),
                            String::from_utf8_lossy(bytes("register_tier", &a[3])?),
                        ),
                    })
                }
                _ => return Err(corrupt("register_tier", &v)),
            }
        }
        Err(steps_exhausted("register_tier"))
    }

    fn reserve_once(
        &self,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        ttl: Duration,
    ) -> Result<Value, Error> {
        self.with(|c| {
            self.scripts
                .reserve
                .arg(&self.prefix)
                .arg(&key.0[..])
                .arg(node.0)
                .arg(tier.0)
                .arg(len)
                .arg(ttl_ms(ttl))
                .invoke(c)
        })
    }

    /// The batched lookup through redis-rs (TLS and Unix-socket servers): the same pipeline as
    /// the direct path, each reply parsed into `Value`s.
    fn lookup_values(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        // The alive-nodes script first, then the keys in chunks: one pipeline, one round trip,
        // and the server answers the first chunks while the client still parses.
        let blocks = format!("{}:blocks", self.prefix);
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA").arg(self.scripts.alive.get_hash()).arg(0).arg(&self.prefix);
        for chunk in keys.chunks(LOOKUP_CHUNK) {
            let hmget = pipe.cmd("HMGET").arg(&blocks);
            for k in chunk {
                hmget.arg(&k.0[..]);
            }
        }
        let replies: Vec<Value> = self.with(|c| match pipe.query(c) {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                redis::cmd("SCRIPT").arg("LOAD").arg(&self.scripts.alive_source).query::<()>(c)?;
                pipe.query(c)
            }
            other => other,
        })?;
        let (alive, found) =
            replies.split_first().ok_or_else(|| corrupt("lookup", &Value::Int(0)))?;
        let alive: HashSet<u32> = array("alive nodes", alive)?
            .iter()
            .map(|v| int("alive nodes", v).map(|n| n as u32))
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(keys.len());
        for (reply, chunk) in found.iter().zip(keys.chunks(LOOKUP_CHUNK)) {
            let reply = array("lookup", reply)?;
            if reply.len() != chunk.len() {
                return Err(corrupt("lookup", &Value::Int(reply.len() as i64)));
            }
            for (v, &key) in reply.iter().zip(chunk) {
                out.push(match v {
                    Value::Nil => None,
                    v => self
                        .open(key, bytes("lookup", v)?)
                        .and_then(|p| alive.contains(&p.node.0).then_some(p)),
                });
            }
        }
        if out.len() != keys.len() {
            return Err(corrupt("lookup", &Value::Int(out.len() as i64)));
        }
        Ok(out)
    }

    /// The batched lookup through [`lookup::Direct`]: the same pipeline, its reply decoded in
    /// place. A server that lost the alive-nodes script (a restart) gets it loaded once.
    fn lookup_direct(
        &self,
        direct: &lookup::Direct,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<Placement>>, Error> {
        let hash = self.scripts.alive.get_hash();
        for _ in 0..2 {
            match direct.lookup(hash, &self.prefix, keys, LOOKUP_CHUNK, &self.sealer)? {
                lookup::Found::Placements { found, forged } => {
                    if forged > 0 {
                        self.forged.fetch_add(forged, Ordering::Relaxed);
                        tracing::warn!(
                            entries = forged,
                            "pool: entries in redis fail their seal; taken for misses"
                        );
                    }
                    return Ok(found);
                }
                lookup::Found::NoScript => self.with(|c| {
                    redis::cmd("SCRIPT").arg("LOAD").arg(&self.scripts.alive_source).query::<()>(c)
                })?,
            }
        }
        Err(Error::Corrupt("the server forgot the alive-nodes script twice in a row".into()))
    }
}

/// One answer of the reserve script; `Err(None)`: the key's entry fails its seal (remove it
/// and reserve again).
fn reserved(
    index: &RedisIndex,
    v: &Value,
    key: BlockKey,
    node: NodeId,
    tier: TierId,
    len: u64,
) -> Result<Reserved, Option<Error>> {
    let a = array("reserve", v)?;
    let code = a.first().ok_or_else(|| corrupt("reserve", v))?;
    match bytes("reserve", code)? {
        b"ok" if a.len() == 3 => Ok(Reserved::Slot(Reservation {
            key,
            node,
            tier,
            slot: int("reserve", &a[1])? as u32,
            len,
            generation: int("reserve", &a[2])? as u64,
        })),
        b"present" if a.len() == 2 => {
            index.open(key, bytes("reserve", &a[1])?).map(Reserved::Present).ok_or(None)
        }
        b"dead" => Err(Some(Error::NodeNotAlive(node))),
        b"unknown" => Err(Some(Error::UnknownTier { node, tier })),
        b"toolarge" if a.len() == 2 => {
            Err(Some(Error::TooLarge { node, tier, len, slot_size: int("reserve", &a[1])? as u64 }))
        }
        b"full" => Err(Some(Error::TierFull { node, tier })),
        _ => Err(Some(corrupt("reserve", v))),
    }
}

/// A key whose entry failed its seal again right after the forged one was removed (its slot
/// is leased, or a writer keeps forging it).
fn forged(key: BlockKey) -> Error {
    Error::Corrupt(format!("the entry of {key} in redis fails its seal and could not be removed"))
}

/// Keys per `HMGET` of a batched lookup.
const LOOKUP_CHUNK: usize = 4096;

/// Bounded script calls one operation makes at most while a dead node's state is deleted
/// ([`scripts::WIPE_BUDGET`] entries each): room for 64 million entries.
const MAX_STEPS: u32 = 65_536;

fn steps_exhausted(what: &str) -> Error {
    Error::Corrupt(format!(
        "{what}: still deleting a dead node's entries after {MAX_STEPS} steps of {}",
        scripts::WIPE_BUDGET
    ))
}

fn ttl_ms(ttl: Duration) -> u64 {
    (ttl.as_millis() as u64).max(1)
}

impl Index for RedisIndex {
    fn register_tier(&self, spec: &TierSpec) -> Result<(), Error> {
        spec.validate()?;
        self.register_remote(spec)?;
        lock(&self.registered).insert((spec.node, spec.tier), *spec);
        Ok(())
    }

    fn reserve(
        &self,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        ttl: Duration,
    ) -> Result<Reserved, Error> {
        let mut v = self.reserve_once(key, node, tier, len, ttl)?;
        // A tier this client registered but the server forgot (it restarted without its data
        // while the node stayed announced): register it again, once.
        if matches!(array("reserve", &v)?.first(), Some(Value::BulkString(b)) if b == b"unknown") {
            let spec = lock(&self.registered).get(&(node, tier)).copied();
            if let Some(spec) = spec {
                self.register_remote(&spec)?;
                v = self.reserve_once(key, node, tier, len, ttl)?;
            }
        }
        match reserved(self, &v, key, node, tier, len) {
            Ok(r) => Ok(r),
            Err(Some(e)) => Err(e),
            // A forged entry stands where the key would be published: it goes, and the key
            // is reserved again (once).
            Err(None) => {
                self.remove(&[key])?;
                let v = self.reserve_once(key, node, tier, len, ttl)?;
                reserved(self, &v, key, node, tier, len).map_err(|e| e.unwrap_or(forged(key)))
            }
        }
    }

    fn reserve_many(
        &self,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<Result<Reserved, Error>>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let call = || -> Result<Value, Error> {
            let mut inv = self.scripts.reserve_many.prepare_invoke();
            inv.arg(&self.prefix).arg(node.0).arg(tier.0).arg(ttl_ms(ttl));
            for (key, len) in items {
                inv.arg(&key.0[..]).arg(*len);
            }
            self.with(|c| inv.invoke(c))
        };
        let mut v = call()?;
        let forgotten = |v: &Value| {
            array("reserve_many", v).is_ok_and(|a| {
                a.iter().any(|o| {
                    matches!(array("reserve_many", o).ok().and_then(|o| o.first()),
                        Some(Value::BulkString(b)) if b == b"unknown")
                })
            })
        };
        if forgotten(&v) {
            let spec = lock(&self.registered).get(&(node, tier)).copied();
            if let Some(spec) = spec {
                self.register_remote(&spec)?;
                v = call()?;
            }
        }
        let a = array("reserve_many", &v)?;
        if a.len() != items.len() {
            return Err(corrupt("reserve_many", &v));
        }
        let mut out: Vec<Result<Reserved, Option<Error>>> = a
            .iter()
            .zip(items)
            .map(|(o, &(key, len))| reserved(self, o, key, node, tier, len))
            .collect();
        // Forged entries stand where some keys would be published: they go, and those keys
        // are reserved again (once).
        let again: Vec<usize> = (0..out.len()).filter(|&i| matches!(out[i], Err(None))).collect();
        if !again.is_empty() {
            let keys: Vec<BlockKey> = again.iter().map(|&i| items[i].0).collect();
            self.remove(&keys)?;
            let retry: Vec<(BlockKey, u64)> = again.iter().map(|&i| items[i]).collect();
            let mut inv = self.scripts.reserve_many.prepare_invoke();
            inv.arg(&self.prefix).arg(node.0).arg(tier.0).arg(ttl_ms(ttl));
            for (key, len) in &retry {
                inv.arg(&key.0[..]).arg(*len);
            }
            let v: Value = self.with(|c| inv.invoke(c))?;
            let a = array("reserve_many", &v)?;
            if a.len() != retry.len() {
                return Err(corrupt("reserve_many", &v));
            }
            for ((&i, o), &(key, len)) in again.iter().zip(a).zip(&retry) {
                out[i] = reserved(self, o, key, node, tier, len);
            }
        }
        Ok(out
            .into_iter()
            .zip(items)
            .map(|(r, &(key, _))| r.map_err(|e| e.unwrap_or(forged(key))))
            .collect())
    }

    fn publish(&self, items: &[(Reservation, u32)]) -> Result<Vec<Published>, Error> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.publish.prepare_invoke();
        inv.arg(&self.prefix);
        for (r, checksum) in items {
            inv.arg(&r.key.0[..])
                .arg(r.node.0)
                .arg(r.tier.0)
                .arg(r.slot)
                .arg(r.generation)
                .arg(r.len)
                .arg(&self.sealer.encode(&r.placement(*checksum))[..]);
        }
        let v: Value = self.with(|c| inv.invoke(c))?;
        let a = array("publish", &v)?;
        if a.len() != items.len() {
            return Err(corrupt("publish", &v));
        }
        a.iter()
            .zip(items)
            .map(|(o, (r, checksum))| match bytes("publish", o)? {
                b"W" => Ok(Published::Won(r.placement(*checksum))),
                b"E" => Ok(Published::Expired),
                // A winner whose entry fails its seal is no placement to load from: nothing of
                // this publish is visible.
                [b'L', winner @ ..] => Ok(self
                    .open(r.key, winner)
                    .map_or(Published::Expired, |winner| Published::Lost { winner })),
                _ => Err(corrupt("publish", o)),
            })
            .collect()
    }

    fn abort(&self, reservations: &[Reservation]) -> Result<(), Error> {
        if reservations.is_empty() {
            return Ok(());
        }
        let mut inv = self.scripts.abort.prepare_invoke();
        inv.arg(&self.prefix);
        for r in reservations {
            inv.arg(&r.key.0[..])
                .arg(r.node.0)
                .arg(r.tier.0)
                .arg(r.slot)
                .arg(r.generation)
                .arg(r.len);
        }
        self.with(|c| inv.invoke::<i64>(c))?;
        Ok(())
    }

    fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        match &self.direct {
            Some(direct) => self.lookup_direct(direct, keys),
            None => self.lookup_values(keys),
        }
    }

    fn lease(&self, placements: &[Placement], ttl: Duration) -> Result<Lease, Error> {
        let mut inv = self.scripts.lease.prepare_invoke();
        inv.arg(&self.prefix).arg(ttl_ms(ttl));
        for p in placements {
            inv.arg(&p.key.0[..]).arg(p.node.0).arg(p.tier.0).arg(p.slot).arg(p.generation);
        }
        let v: Value = self.with(|c| inv.invoke(c))?;
        let a = array("lease", &v)?;
        if a.len() != placements.len() + 1 {
            return Err(corrupt("lease", &v));
        }
        let id = int("lease", &a[0])? as u64;
        let granted =
            a[1..].iter().map(|g| int("lease", g).map(|g| g == 1)).collect::<Result<_, _>>()?;
        Ok(Lease { id, granted, ttl })
    }

    fn renew(&self, id: u64, ttl: Duration) -> Result<(), Error> {
        let key = format!("{}:lease:{id}", self.prefix);
        let renewed: i64 =
            self.with(|c| redis::cmd("PEXPIRE").arg(&key).arg(ttl_ms(ttl)).query(c))?;
        if renewed == 1 {
            Ok(())
        } else {
            Err(Error::LeaseExpired(id))
        }
    }

    fn release(&self, id: u64) -> Result<(), Error> {
        self.with(|c| self.scripts.release.arg(&self.prefix).arg(id).invoke::<i64>(c))?;
        Ok(())
    }

    fn remove(&self, keys: &[BlockKey]) -> Result<Vec<Removed>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.remove.prepare_invoke();
        inv.arg(&self.prefix);
        for k in keys {
            inv.arg(&k.0[..]);
        }
        let v: Value = self.with(|c| inv.invoke(c))?;
        let a = array("remove", &v)?;
        if a.len() != keys.len() {
            return Err(corrupt("remove", &v));
        }
        a.iter()
            .map(|o| match bytes("remove", o)? {
                b"R" => Ok(Removed::Removed),
                b"A" => Ok(Removed::Absent),
                b"L" => Ok(Removed::Leased),
                _ => Err(corrupt("remove", o)),
            })
            .collect()
    }

    fn evict(&self, node: NodeId, tier: TierId, count: u32) -> Result<u32, Error> {
        let n: i64 = self.with(|c| {
            self.scripts.evict.arg(&self.prefix).arg(node.0).arg(tier.0).arg(count).invoke(c)
        })?;
        if n < 0 {
            return Err(Error::UnknownTier { node, tier });
        }
        Ok(n as u32)
    }

    fn tier_spec(&self, node: NodeId, tier: TierId) -> Result<Option<TierSpec>, Error> {
        let key = format!("{}:tier:{}:{}", self.prefix, node.0, tier.0);
        let v: Vec<Option<u64>> = self.with(|c| {
            redis::cmd("HMGET")
                .arg(&key)
                .arg(&["slot_size", "slot_count", "durable", "low", "high"])
                .query(c)
        })?;
        match v[..] {
            [Some(slot_size), Some(count), Some(durable), Some(low), Some(high)] => {
                let narrow = |x: u64| {
                    u32::try_from(x).map_err(|_| Error::Corrupt(format!("tier {key}: {x}")))
                };
                Ok(Some(TierSpec {
                    node,
                    tier,
                    slot_size,
                    slot_count: narrow(count)?,
                    durable: durable != 0,
                    low_watermark: narrow(low)?,
                    high_watermark: narrow(high)?,
                }))
            }
            [None, ..] => Ok(None),
            _ => Err(Error::Corrupt(format!("tier {key} has missing fields"))),
        }
    }

    fn tier_stats(&self, node: NodeId, tier: TierId) -> Result<TierStats, Error> {
        let v: Value =
            self.with(|c| self.scripts.stats.arg(&self.prefix).arg(node.0).arg(tier.0).invoke(c))?;
        let a = array("tier_stats", &v)?;
        match a {
            [free, reserved, published] => Ok(TierStats {
                free: int("tier_stats", free)? as u32,
                reserved: int("tier_stats", reserved)? as u32,
                published: int("tier_stats", published)? as u32,
            }),
            _ => Err(Error::UnknownTier { node, tier }),
        }
    }

    fn announce(&self, node: &NodeAnnouncement, ttl: Duration) -> Result<(), Error> {
        let blob = node.encode();
        for _ in 0..MAX_STEPS {
            let answer: i64 = self.with(|c| {
                self.scripts
                    .announce
                    .arg(&self.prefix)
                    .arg(node.node.0)
                    .arg(ttl_ms(ttl))
                    .arg(&blob)
                    .invoke(c)
            })?;
            match answer {
                0 => return Ok(()),
                1 => {
                    tracing::info!(node = node.node.0, "pool: node joined (empty)");
                    let specs: Vec<TierSpec> = lock(&self.registered)
                        .values()
                        .filter(|s| s.node == node.node)
                        .copied()
                        .collect();
                    for spec in specs {
                        self.register_remote(&spec)?;
                    }
                    return Ok(());
                }
                // Its earlier life's entries are being deleted, a bounded step a call.
                2 => continue,
                other => return Err(corrupt("announce", &Value::Int(other))),
            }
        }
        Err(steps_exhausted("announce"))
    }

    fn nodes(&self) -> Result<Vec<NodeAnnouncement>, Error> {
        let alive: Value = self.with(|c| self.scripts.alive.arg(&self.prefix).invoke(c))?;
        let ids: Vec<i64> =
            array("nodes", &alive)?.iter().map(|v| int("nodes", v)).collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = ids.iter().map(|n| format!("{}:node:{n}", self.prefix)).collect();
        let blobs: Vec<Option<Vec<u8>>> = self.with(|c| redis::cmd("MGET").arg(&keys).query(c))?;
        let mut nodes: Vec<NodeAnnouncement> = blobs
            .iter()
            .flatten()
            .map(|b| NodeAnnouncement::decode(b))
            .collect::<Result<_, _>>()?;
        nodes.sort_by_key(|a| a.node);
        Ok(nodes)
    }

    fn leave(&self, node: NodeId) -> Result<bool, Error> {
        let mut was = None;
        for _ in 0..MAX_STEPS {
            let v: Value =
                self.with(|c| self.scripts.leave.arg(&self.prefix).arg(node.0).invoke(c))?;
            let [alive, emptied] = array("leave", &v)? else { return Err(corrupt("leave", &v)) };
            // Only the first call can find it alive: it is dead from then on.
            let was = *was.get_or_insert(int("leave", alive)? == 1);
            if int("leave", emptied)? == 1 {
                tracing::debug!(node = node.0, was_alive = was, "pool: node left");
                return Ok(was);
            }
        }
        Err(steps_exhausted("leave"))
    }
}
