//! The Redis index: one pool shared by every instance and node of a cluster, on a standalone
//! Redis server or on a Redis Cluster.
//!
//! Strategy: every operation that changes state is one Lua script per shard (sent as
//! `EVALSHA`; the client loads it once and again after `NOSCRIPT`, for example after a Redis
//! restart), so the rules hold atomically whatever number of clients race. The pool is cut
//! into shards (see [`shard`]), each a complete pool of its keys and its share of every
//! tier's slots under one hash tag, so a script never spans shards and a Cluster spreads the
//! shards over its masters. A batched lookup is one pipeline per shard: the alive-nodes
//! script, then one `HMGET` per 4,096 keys, after the group summaries of a long list (see
//! [`summary`]). Leases and node announcements are keys with
//! Redis's own TTL: a holder that stops renewing simply lets them expire. See [`scripts`] for
//! the key layout and [`conn`] for the connections.

mod conn;
mod lookup;
mod scripts;
mod seal;
mod shard;
mod summary;

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use redis::{ConnectionLike, IntoConnectionInfo, Script, Value};

use crate::{
    BlockKey, Error, Index, Lease, NodeAnnouncement, NodeId, Placement, Published, Removed,
    Reservation, Reserved, TierId, TierSpec, TierStats,
};

/// How to reach the Redis server (or Cluster) and where in it the pool lives.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://host:port/db`, or `rediss://host:port/db` for TLS (needs the `tls` feature). A
    /// password or user in the URL is used unless [`username`](Self::username) /
    /// [`password`](Self::password) are set. With [`cluster`](Self::cluster), any one node of
    /// the Cluster (a seed: the client learns the others from it).
    pub url: String,
    /// The ACL user (Redis 6+), if not `default`.
    pub username: Option<String>,
    /// The password (`requirepass`, or the ACL user's).
    pub password: Option<String>,
    /// The pool's name: every key is under the hash tag `{prefix}` (or `{prefix.s}` for shard
    /// `s`), so several pools share one server apart. Letters, digits, `-`, `_`, `.`; default
    /// `umbp`.
    pub prefix: String,
    /// Connect, read and write timeout of each call; a server that does not answer in time is
    /// [`Error::Redis`]. Default 5 s.
    pub timeout: Duration,
    /// PEM file of the CA that signed the server's certificate, for `rediss://` with a private
    /// CA (the system's roots otherwise). Needs the `tls` feature.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Batched lookups write their pipeline and decode its reply directly over their own TCP
    /// connections (default `true`), instead of through redis-rs's parser, which allocates a
    /// value per key. `false`, any TLS server and any Cluster take the redis-rs path. Both send
    /// the same commands and give the same answers.
    pub direct_lookup: bool,
    /// The cluster's secret (the memory nodes' shared secret, say): every entry is sealed
    /// under a key derived from it, so a Redis writer without it cannot make, copy or edit
    /// an entry that any client takes for a hit (see the crate README's threat model).
    /// Every client of one pool must use the same secret: an entry sealed under another (or
    /// none) is a miss. Default `None`: entries are sealed under a public key, which binds
    /// each entry to its key but does not stop a writer who computes seals on purpose.
    pub secret: Option<Vec<u8>>,
    /// `url` is a node of a Redis Cluster (`cluster-enabled yes`): the client learns the
    /// Cluster's other nodes and slot map from it, follows redirections, and survives
    /// failovers and reshardings. Default `false` (a standalone server).
    pub cluster: bool,
    /// How many shards the pool is cut into; `None`: 1 on a standalone server, 16 on a
    /// Cluster (spread over its masters by the hash tags' slots). Fixed for the life of the
    /// pool: a client with another count is refused at connect ([`Error::InvalidConfig`]).
    pub shards: Option<u16>,
    /// Long lookups read group summaries (about 256 placements in one value) instead of an
    /// entry per key, and store them for groups they find whole (default `true`; see the
    /// crate README's "Long lookups on Redis"). `false` reads and stores none; clients of
    /// one pool may differ (every client's writes keep the summaries true).
    pub group_summaries: bool,
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
            .field("cluster", &self.cluster)
            .field("shards", &self.shards)
            .field("group_summaries", &self.group_summaries)
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
            cluster: false,
            shards: None,
            group_summaries: true,
        }
    }

    /// The settings for a Redis Cluster reached through `seed` (any one of its nodes), with
    /// the defaults otherwise.
    pub fn cluster(seed: impl Into<String>) -> Self {
        Self { cluster: true, ..Self::new(seed) }
    }
}

struct Scripts {
    register_tier: Script,
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
    summarize: Script,
}

impl Scripts {
    fn new() -> Self {
        let s = |body: &str| Script::new(&scripts::source(body));
        Self {
            register_tier: s(scripts::REGISTER_TIER),
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
            summarize: s(scripts::SUMMARIZE),
        }
    }
}

/// The Redis [`Index`]: every instance and node of a cluster shares one, through a Redis 7
/// server (standalone) or a Redis Cluster. Nodes [announce](Index::announce) themselves with a
/// TTL and renew it; a node that stops is dead: its entries are absent at once to lookups,
/// leases, reservations and publishes (its keys can be stored again on live nodes), and its
/// state is deleted in bounded steps by live nodes' renewals, by itself when it joins again
/// (empty, possibly with other tier shapes), or all at once by
/// [`reap_dead_nodes`](Self::reap_dead_nodes).
///
/// Tiers registered through this client are remembered, and registered again when a node this
/// client announces rejoins (after it expired, or after the server restarted without its data),
/// so a client resumes by itself once the server is back.
pub struct RedisIndex {
    conns: conn::Conns,
    timeout: Duration,
    shards: shard::Shards,
    scripts: Scripts,
    registered: Mutex<HashMap<(NodeId, TierId), TierSpec>>,
    /// The batched lookup's direct path (plain TCP standalone servers with one shard; `None`:
    /// the redis-rs path).
    direct: Option<lookup::Direct>,
    /// Seals and opens entries (see [`seal`]).
    sealer: seal::Sealer,
    /// Entries found whose seal did not match: misses, counted.
    forged: AtomicU64,
    /// Lookups go through group summaries ([`RedisConfig::group_summaries`]).
    group_summaries: bool,
    /// Group ids this client found whole once: found whole again, they are summarized.
    seen_groups: Mutex<HashSet<[u8; 16]>>,
    /// The shards each lease of this client holds slots in (a lease spans shards under one
    /// id), for renew and release.
    leases: Mutex<HashMap<u64, Vec<u16>>>,
    /// Makes lease and call ids: random per client, so ids of different clients never meet.
    ids: std::hash::RandomState,
    id_seq: AtomicU64,
}

impl std::fmt::Debug for RedisIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisIndex")
            .field("pool", &self.shards.tag(0))
            .field("shards", &self.shards.count())
            .field("cluster", &self.conns.is_cluster())
            .finish_non_exhaustive()
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

fn int(what: &str, v: &Value) -> Result<i64, Error> {
    match v {
        Value::Int(i) => Ok(*i),
        Value::BulkString(b) => {
            std::str::from_utf8(b).ok().and_then(|s| s.parse().ok()).ok_or_else(|| corrupt(what, v))
        }
        _ => Err(corrupt(what, v)),
    }
}

/// A looked-up value: `None` for `Nil` (the field is not there), its bytes otherwise.
fn value(v: &Value) -> Result<Option<&[u8]>, Error> {
    match v {
        Value::Nil => Ok(None),
        v => bytes("lookup", v).map(Some),
    }
}

fn array<'v>(what: &str, v: &'v Value) -> Result<&'v [Value], Error> {
    match v {
        Value::Array(a) => Ok(a),
        _ => Err(corrupt(what, v)),
    }
}

impl RedisIndex {
    /// Connects to the server (or the Cluster) of `config` (one connection now, to fail
    /// early; more as callers need them), checks that it answers, and that the pool's shard
    /// count is this client's.
    ///
    /// Errors: [`Error::InvalidConfig`] (a bad URL or prefix, another shard count than the
    /// pool's), [`Error::TlsUnavailable`] (`rediss://` without the `tls` feature),
    /// [`Error::Redis`] (unreachable, wrong password).
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
        let shard_count = config.shards.unwrap_or(if config.cluster { 16 } else { 1 });
        if shard_count == 0 {
            return Err(Error::InvalidConfig("a pool has at least one shard".into()));
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
        let direct = (config.direct_lookup && !config.cluster && shard_count == 1)
            .then(|| lookup::Direct::for_connection(&info, config.timeout))
            .flatten();
        let conns = if config.cluster {
            conn::Conns::Cluster {
                client: Self::cluster_client(info, config)?,
                idle: Mutex::new(Vec::new()),
            }
        } else {
            conn::Conns::Single {
                client: Self::client(info, config)?,
                idle: Mutex::new(Vec::new()),
            }
        };
        let index = Self {
            conns,
            timeout: config.timeout,
            shards: shard::Shards::new(&config.prefix, shard_count),
            scripts: Scripts::new(),
            registered: Mutex::new(HashMap::new()),
            direct,
            sealer: seal::Sealer::new(config.secret.as_deref()),
            forged: AtomicU64::new(0),
            group_summaries: config.group_summaries,
            seen_groups: Mutex::new(HashSet::new()),
            leases: Mutex::new(HashMap::new()),
            ids: std::hash::RandomState::new(),
            id_seq: AtomicU64::new(0),
        };
        // The pool's shard count, recorded by its first client: every client must agree, or
        // keys and slots would be looked for in the wrong shards.
        let key = format!("{}:shards", index.shards.tag(0));
        let recorded: Option<u16> = index
            .with(|c| redis::cmd("SET").arg(&key).arg(shard_count).arg("NX").arg("GET").query(c))?;
        if let Some(recorded) = recorded.filter(|&r| r != shard_count) {
            return Err(Error::InvalidConfig(format!(
                "pool {:?} has {recorded} shards, this client was configured with {shard_count}",
                config.prefix
            )));
        }
        Ok(index)
    }

    #[cfg(feature = "tls")]
    fn client(info: redis::ConnectionInfo, config: &RedisConfig) -> Result<redis::Client, Error> {
        match Self::root_cert(config)? {
            Some(root_cert) => Ok(redis::Client::build_with_tls(
                info,
                redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) },
            )?),
            None => Ok(redis::Client::open(info)?),
        }
    }

    #[cfg(not(feature = "tls"))]
    fn client(info: redis::ConnectionInfo, config: &RedisConfig) -> Result<redis::Client, Error> {
        Self::root_cert(config)?;
        Ok(redis::Client::open(info)?)
    }

    /// The Cluster's client: learns every node from the seed (`CLUSTER SLOTS`) and takes
    /// them all as its initial nodes, so a connection made after the seed died (a failover
    /// of the seed's master) still finds the Cluster.
    fn cluster_client(
        info: redis::ConnectionInfo,
        config: &RedisConfig,
    ) -> Result<redis::cluster::ClusterClient, Error> {
        let seeded = Self::cluster_client_from(vec![info.clone()], config)?;
        let mut conn = seeded.get_connection()?;
        let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn)?;
        let mut nodes = vec![info];
        for range in array("cluster slots", &slots)? {
            for node in array("cluster slots", range)?.iter().skip(2) {
                let [host, port, ..] = array("cluster slots", node)? else { continue };
                let (host, port) = (bytes("cluster slots", host)?, int("cluster slots", port)?);
                let mut n = nodes[0].clone();
                n.addr =
                    redis::ConnectionAddr::Tcp(String::from_utf8_lossy(host).into(), port as u16);
                if let (redis::ConnectionAddr::TcpTls { insecure, tls_params, .. }, true) =
                    (&nodes[0].addr, config.url.starts_with("rediss://"))
                {
                    n.addr = redis::ConnectionAddr::TcpTls {
                        host: String::from_utf8_lossy(host).into(),
                        port: port as u16,
                        insecure: *insecure,
                        tls_params: tls_params.clone(),
                    };
                }
                if !nodes.iter().any(|m| m.addr == n.addr) {
                    nodes.push(n);
                }
            }
        }
        Self::cluster_client_from(nodes, config)
    }

    fn cluster_client_from(
        nodes: Vec<redis::ConnectionInfo>,
        config: &RedisConfig,
    ) -> Result<redis::cluster::ClusterClient, Error> {
        let mut builder = redis::cluster::ClusterClientBuilder::new(nodes)
            .connection_timeout(config.timeout)
            .response_timeout(config.timeout)
            // A master that died answers nothing until its replica is promoted (the
            // Cluster's node timeout and an election): a few quick retries, then the call
            // fails and its caller's blocks with it, rather than hang.
            .retries(4)
            .min_retry_wait(50)
            .max_retry_wait(500);
        if let Some(user) = &config.username {
            builder = builder.username(user.clone());
        }
        if let Some(password) = &config.password {
            builder = builder.password(password.clone());
        }
        #[cfg(feature = "tls")]
        if let Some(root_cert) = Self::root_cert(config)? {
            builder = builder
                .certs(redis::TlsCertificates { client_tls: None, root_cert: Some(root_cert) });
        }
        #[cfg(not(feature = "tls"))]
        Self::root_cert(config)?;
        Ok(builder.build()?)
    }

    /// The private CA's certificate, if one is configured.
    fn root_cert(config: &RedisConfig) -> Result<Option<Vec<u8>>, Error> {
        let Some(path) = &config.tls_ca_file else { return Ok(None) };
        if !cfg!(feature = "tls") {
            return Err(Error::TlsUnavailable);
        }
        #[cfg(feature = "tls")]
        {
            // rustls needs a process-wide crypto provider; aws-lc-rs's, unless the program
            // chose one.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
        std::fs::read(path)
            .map(Some)
            .map_err(|e| Error::InvalidConfig(format!("redis CA file {}: {e}", path.display())))
    }

    /// Runs `f` on a pooled connection (see [`conn::Conns::with`]).
    fn with<T>(
        &self,
        mut f: impl FnMut(&mut dyn ConnectionLike) -> redis::RedisResult<T>,
    ) -> Result<T, Error> {
        self.conns.with(self.timeout, |c| f(c.like()))
    }

    /// Runs `script` on shard `s` with `args` after its tag.
    fn run<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        s: usize,
        args: impl Fn(&mut redis::ScriptInvocation<'_>),
    ) -> Result<T, Error> {
        let mut inv = script.key(self.shards.route(s));
        inv.arg(self.shards.tag(s));
        args(&mut inv);
        self.with(|c| inv.invoke(c))
    }

    /// Runs `script` on shard `s` as [`run`](Self::run) does, under a new call id and its
    /// [repeat window](scripts::repeat_window) (`ARGV[2]` and `ARGV[3]`, before `args`): a
    /// script that keeps its answers under the id (reserve, publish, removal, eviction,
    /// leave) answers a repeat of the call, made when its first answer was lost, as it
    /// answered the call, and does nothing more.
    fn run_once<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        s: usize,
        args: impl Fn(&mut redis::ScriptInvocation<'_>),
    ) -> Result<T, Error> {
        let id = self.new_id();
        let window = scripts::repeat_window(self.timeout).as_millis() as u64;
        self.run(script, s, |inv| {
            inv.arg(id).arg(window);
            args(inv);
        })
    }

    /// Runs `script` on every shard, with the same `args`; the answers in shard order.
    fn run_all<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        args: impl Fn(&mut redis::ScriptInvocation<'_>),
    ) -> Result<Vec<T>, Error> {
        (0..self.shards.count()).map(|s| self.run(script, s, &args)).collect()
    }

    /// Entries (and group summaries) this client found whose seal did not match their key
    /// (copied, edited or made up in Redis, or sealed under another secret): each was taken
    /// for a miss.
    pub fn forged_entries(&self) -> u64 {
        self.forged.load(Ordering::Relaxed)
    }

    /// How many shards the pool is cut into.
    pub fn shard_count(&self) -> usize {
        self.shards.count()
    }

    /// The placement stored for `key` as `value` if its seal holds; a forged one is counted
    /// and is `None`.
    fn open(&self, key: BlockKey, value: &[u8]) -> Option<Placement> {
        let p = self.sealer.open(key, value);
        if p.is_none() {
            self.count_forged(1);
        }
        p
    }

    /// Counts `n` entries that failed their seal, and logs it at the first one and then at
    /// every doubling of the count: a client with another secret than the pool's meets
    /// every entry forged, and must not log a line per key.
    fn count_forged(&self, n: u64) {
        let before = self.forged.fetch_add(n, Ordering::Relaxed);
        let after = before + n;
        if before == 0 || after.ilog2() > before.ilog2() {
            tracing::warn!(
                entries = after,
                "pool: entries in redis fail their seal (copied, edited or forged, or sealed \
                 under another secret): taken for misses"
            );
        }
    }

    /// Deletes the state of every node whose announcement expired (their entries are already
    /// absent to lookups and writers; this frees them without waiting for the nodes to rejoin
    /// or for live nodes' renewals to reap them, a few at a time). Returns how many nodes were
    /// reaped (in shard 0: every shard reaps the same nodes). Runs as many bounded script
    /// calls as the dead nodes need.
    pub fn reap_dead_nodes(&self) -> Result<u32, Error> {
        let mut reaped = 0;
        for s in 0..self.shards.count() {
            let mut here = 0;
            let mut done = false;
            for _ in 0..MAX_STEPS {
                let v: Value = self.run(&self.scripts.reap, s, |_| {})?;
                let [n, left] = array("reap", &v)? else { return Err(corrupt("reap", &v)) };
                here += int("reap", n)? as u32;
                if int("reap", left)? == 0 {
                    done = true;
                    break;
                }
            }
            if !done {
                return Err(steps_exhausted("reap"));
            }
            if s == 0 {
                reaped = here;
            }
        }
        Ok(reaped)
    }

    fn register_remote(&self, spec: &TierSpec) -> Result<(), Error> {
        for s in 0..self.shards.count() {
            let share = self.shards.share(spec, s);
            let mut done = false;
            for _ in 0..MAX_STEPS {
                let v: Value = self.run(&self.scripts.register_tier, s, |inv| {
                    inv.arg(spec.node.0)
                        .arg(spec.tier.0)
                        .arg(spec.slot_size)
                        .arg(spec.slot_count)
                        .arg(u8::from(spec.durable))
                        .arg(spec.low_watermark)
                        .arg(spec.high_watermark)
                        .arg(share.count)
                        .arg(share.low)
                        .arg(share.high)
                        .arg(share.stride)
                        .arg(share.first);
                })?;
                let a = array("register_tier", &v)?;
                match a.first().map(|s| bytes("register_tier", s)).transpose()? {
                    Some(b"ok") => {
                        done = true;
                        break;
                    }
                    // A dead node's tier with another shape, being emptied step by step.
                    Some(b"more") => continue,
                    Some(b"conflict") if a.len() == 4 => {
                        return Err(Error::TierConflict {
                            node: spec.node,
                            tier: spec.tier,
                            reason: format!(
                                "registered in redis: slot size {}, slot count {}, durable {}, \
                                 and the node is alive",
                                String::from_utf8_lossy(bytes("register_tier", &a[1])?),
                                String::from_utf8_lossy(bytes("register_tier", &a[2])?),
                                String::from_utf8_lossy(bytes("register_tier", &a[3])?),
                            ),
                        })
                    }
                    _ => return Err(corrupt("register_tier", &v)),
                }
            }
            if !done {
                return Err(steps_exhausted("register_tier"));
            }
        }
        Ok(())
    }

    /// One call of the reserve-many script on shard `s` for `items`: its answer, one string
    /// (read by [`reserve_answers`]).
    fn reserve_call(
        &self,
        s: usize,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<u8>, Error> {
        let v: Value = self.run_once(&self.scripts.reserve_many, s, |inv| {
            inv.arg(node.0).arg(tier.0).arg(ttl_ms(ttl));
            for (key, len) in items {
                inv.arg(&key.0[..]).arg(*len);
            }
        })?;
        match v {
            Value::BulkString(b) => Ok(b),
            v => Err(corrupt("reserve_many", &v)),
        }
    }

    /// [`reserve_call`](Self::reserve_call), registering the tier again once if the shard
    /// forgot it (it restarted without its data while the node stayed announced), and
    /// replacing forged entries that stand where keys would be published.
    fn reserve_shard(
        &self,
        s: usize,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<Result<Reserved, Error>>, Error> {
        let mut raw = self.reserve_call(s, node, tier, items, ttl)?;
        let mut answers = reserve_answers(&raw, items.len())?;
        if answers.contains(&ReserveAnswer::Unknown) {
            let spec = lock(&self.registered).get(&(node, tier)).copied();
            if let Some(spec) = spec {
                self.register_remote(&spec)?;
                raw = self.reserve_call(s, node, tier, items, ttl)?;
                answers = reserve_answers(&raw, items.len())?;
            }
        }
        let mut out: Vec<Result<Reserved, Option<Error>>> = answers
            .into_iter()
            .zip(items)
            .map(|(a, &(key, len))| reserved(self, a, key, node, tier, len))
            .collect();
        // Forged entries stand where some keys would be published: they go, and those keys
        // are reserved again (once).
        let again: Vec<usize> = (0..out.len()).filter(|&i| matches!(out[i], Err(None))).collect();
        if !again.is_empty() {
            let retry: Vec<(BlockKey, u64)> = again.iter().map(|&i| items[i]).collect();
            self.remove(&retry.iter().map(|r| r.0).collect::<Vec<_>>())?;
            let raw = self.reserve_call(s, node, tier, &retry, ttl)?;
            let answers = reserve_answers(&raw, retry.len())?;
            for ((&i, a), &(key, len)) in again.iter().zip(answers).zip(&retry) {
                out[i] = reserved(self, a, key, node, tier, len);
            }
        }
        Ok(out
            .into_iter()
            .zip(items)
            .map(|(r, &(key, _))| r.map_err(|e| e.unwrap_or(forged(key))))
            .collect())
    }

    /// Shard `s`'s part of a batched lookup through redis-rs (a Cluster, TLS and Unix-socket
    /// servers, more than one shard). Answers for the keys at positions `at`, in that order.
    fn lookup_values(
        &self,
        s: usize,
        keys: &[BlockKey],
        at: &[usize],
    ) -> Result<Vec<Option<Placement>>, Error> {
        let field = |i: usize| &keys[at[i]].0[..];
        let (alive, mut read) = self.alive_and_fields(s, &[("blocks", at.len(), &field)])?;
        let values = read.pop().unwrap_or_default();
        values.iter().zip(at).map(|(v, &i)| Ok(self.entry(keys[i], value(v)?, &alive))).collect()
    }

    /// The placement an entry's value (`None`: no entry) holds for `key`, if its seal holds
    /// and its node is among the `alive` (sorted).
    fn entry(&self, key: BlockKey, v: Option<&[u8]>, alive: &[u32]) -> Option<Placement> {
        v.and_then(|v| self.open(key, v)).filter(|p| alive.binary_search(&p.node.0).is_ok())
    }

    /// Shard `s`'s alive nodes (sorted) and, per read `(hash, n, field)`, the values of `n`
    /// fields (`field(i)`) of its hash `hash` (`blocks`, `groups`), `Nil` for a field not
    /// there: the alive-nodes script, then `HMGET` in chunks of [`LOOKUP_CHUNK`], in one
    /// pipeline (one round trip; the server answers the first chunks while the client still
    /// parses).
    fn alive_and_fields<'f>(
        &self,
        s: usize,
        reads: &[FieldRead<'_, 'f>],
    ) -> Result<(Vec<u32>, Vec<Vec<Value>>), Error> {
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(self.scripts.alive.get_hash())
            .arg(1)
            .arg(self.shards.route(s))
            .arg(self.shards.tag(s));
        for &(hash, n, field) in reads {
            let hash = format!("{}:{hash}", self.shards.tag(s));
            for start in (0..n).step_by(LOOKUP_CHUNK) {
                let hmget = pipe.cmd("HMGET").arg(&hash);
                for i in start..n.min(start + LOOKUP_CHUNK) {
                    hmget.arg(field(i));
                }
            }
        }
        let replies: Vec<Value> = self.conns.with(self.timeout, |c| match c.pipeline(&pipe) {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                // On a Cluster, redis-rs loads it on every master.
                redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(&self.scripts.alive_source)
                    .query::<Value>(c.like())?;
                c.pipeline(&pipe)
            }
            other => other,
        })?;
        let mut replies = replies.into_iter();
        let alive = replies.next().ok_or_else(|| corrupt("lookup", &Value::Int(0)))?;
        let mut alive: Vec<u32> = array("alive nodes", &alive)?
            .iter()
            .map(|v| int("alive nodes", v).map(|n| n as u32))
            .collect::<Result<_, _>>()?;
        alive.sort_unstable();
        let mut out = Vec::with_capacity(reads.len());
        for &(_, n, _) in reads {
            let mut values = Vec::with_capacity(n);
            for start in (0..n).step_by(LOOKUP_CHUNK) {
                let reply = replies.next().ok_or_else(|| corrupt("lookup", &Value::Nil))?;
                let Value::Array(chunk) = reply else { return Err(corrupt("lookup", &reply)) };
                if chunk.len() != LOOKUP_CHUNK.min(n - start) {
                    return Err(corrupt("lookup", &Value::Int(chunk.len() as i64)));
                }
                values.extend(chunk);
            }
            out.push(values);
        }
        if replies.next().is_some() {
            return Err(corrupt("lookup", &Value::Nil));
        }
        Ok((alive, out))
    }

    /// Runs `f(shard, positions)` for every shard with positions in `groups`: scatter-gather,
    /// from up to [`SCATTER_THREADS`] threads (each on its own pooled connection) when more
    /// than one shard has work, so the shards' servers work at once and a call over several
    /// shards takes about its slowest shard's time, not the sum. The answers in shard order;
    /// the first error is the call's.
    fn scatter<T: Send>(
        &self,
        groups: &[Vec<usize>],
        f: impl Fn(usize, &[usize]) -> Result<T, Error> + Sync,
    ) -> Result<Vec<(usize, T)>, Error> {
        let busy: Vec<usize> = (0..groups.len()).filter(|&s| !groups[s].is_empty()).collect();
        let threads = busy.len().clamp(1, SCATTER_THREADS);
        let run = |t: usize| -> Result<Vec<(usize, T)>, Error> {
            busy.iter().skip(t).step_by(threads).map(|&s| Ok((s, f(s, &groups[s])?))).collect()
        };
        if threads == 1 {
            return run(0);
        }
        let parts: Vec<Result<Vec<(usize, T)>, Error>> = std::thread::scope(|scope| {
            let run = &run;
            let handles: Vec<_> = (0..threads).map(|t| scope.spawn(move || run(t))).collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Corrupt("a shard's call panicked".into())))
                })
                .collect()
        });
        let mut out = Vec::with_capacity(busy.len());
        for part in parts {
            out.extend(part?);
        }
        out.sort_by_key(|(s, _)| *s);
        Ok(out)
    }

    /// The batched lookup of every key's entry: through [`lookup::Direct`] where there is
    /// one, else one pipeline per shard through redis-rs, the shards in parallel.
    fn lookup_entries(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(direct) = &self.direct {
            return self.lookup_direct(direct, keys);
        }
        let groups = self.shards.group(keys.iter());
        let mut out = vec![None; keys.len()];
        for (s, found) in self.scatter(&groups, |s, at| self.lookup_values(s, keys, at))? {
            for (&i, p) in groups[s].iter().zip(found) {
                out[i] = p;
            }
        }
        Ok(out)
    }

    /// The batched lookup through [`lookup::Direct`]: the same pipeline, its values decoded
    /// in place.
    fn lookup_direct(
        &self,
        direct: &lookup::Direct,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<Placement>>, Error> {
        let field = |i: usize| &keys[i].0[..];
        let mut found = Vec::with_capacity(keys.len());
        self.read_direct(direct, &[("blocks", keys.len(), &field)], &mut |alive, _, i, v| {
            found.push(self.entry(keys[i], v, alive));
            Ok(())
        })?;
        Ok(found)
    }

    /// One pipeline through [`lookup::Direct`] (see [`lookup::Direct::read`]); a server that
    /// lost the alive-nodes script (a restart) gets it loaded once.
    fn read_direct(
        &self,
        direct: &lookup::Direct,
        reads: &[FieldRead<'_, '_>],
        visit: &mut lookup::Visit<'_>,
    ) -> Result<(), Error> {
        let hash = self.scripts.alive.get_hash();
        for _ in 0..2 {
            if direct.read(hash, self.shards.tag(0), reads, LOOKUP_CHUNK, visit)? {
                return Ok(());
            }
            self.with(|c| {
                redis::cmd("SCRIPT").arg("LOAD").arg(&self.scripts.alive_source).query::<()>(c)
            })?;
        }
        Err(Error::Corrupt("the server forgot the alive-nodes script twice in a row".into()))
    }

    /// A new id of a lease or a call: unique to this client (a random key hashes a counter),
    /// so ids of different clients never meet.
    fn new_id(&self) -> u64 {
        let mut h = self.ids.build_hasher();
        h.write_u64(self.id_seq.fetch_add(1, Ordering::Relaxed));
        // Positive in Lua's doubles and Redis's integers alike.
        h.finish() >> 11
    }

    /// The shards lease `id` holds slots in: the ones this client leased in, or every shard
    /// for a lease of another client.
    fn lease_shards(&self, id: u64) -> Vec<u16> {
        lock(&self.leases)
            .get(&id)
            .cloned()
            .unwrap_or_else(|| (0..self.shards.count() as u16).collect())
    }
}

/// One item's answer in the reserve script's string ([`scripts::RESERVE_MANY`] lists them).
#[derive(Debug, PartialEq)]
enum ReserveAnswer<'a> {
    Slot { slot: u32, generation: u64 },
    Present(&'a [u8]),
    Dead,
    Unknown,
    TooLarge { slot_size: u64 },
    Full,
}

/// The next `k` bytes of a script's string answer `rest`, taken off it.
fn take<'a>(rest: &mut &'a [u8], k: usize) -> Option<&'a [u8]> {
    let (head, tail) = rest.split_at_checked(k)?;
    *rest = tail;
    Some(head)
}

/// The next `k` bytes of a script's string answer `rest`, taken off it, as a big-endian
/// integer.
fn be_int(rest: &mut &[u8], k: usize) -> Option<u64> {
    Some(take(rest, k)?.iter().fold(0u64, |v, &byte| (v << 8) | u64::from(byte)))
}

/// The next value of a script's string answer `rest` (its length in 2 bytes, big-endian,
/// then its bytes), taken off it.
fn take_value<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = be_int(rest, 2)? as usize;
    take(rest, len)
}

/// The reserve script's answers to `n` items, read from its string; `Error::Corrupt` unless
/// it holds exactly `n` whole answers.
fn reserve_answers(raw: &[u8], n: usize) -> Result<Vec<ReserveAnswer<'_>>, Error> {
    let bad = || {
        Error::Corrupt(format!(
            "unexpected answer from redis for reserve_many: {} bytes for {n} items",
            raw.len()
        ))
    };
    let mut out = Vec::with_capacity(n);
    let mut rest = raw;
    while let Some((&code, tail)) = rest.split_first() {
        rest = tail;
        out.push(match code {
            b'o' => {
                let slot = be_int(&mut rest, 4).ok_or_else(bad)? as u32;
                ReserveAnswer::Slot { slot, generation: be_int(&mut rest, 8).ok_or_else(bad)? }
            }
            b'p' => ReserveAnswer::Present(take_value(&mut rest).ok_or_else(bad)?),
            b'd' => ReserveAnswer::Dead,
            b'u' => ReserveAnswer::Unknown,
            b't' => ReserveAnswer::TooLarge { slot_size: be_int(&mut rest, 8).ok_or_else(bad)? },
            b'f' => ReserveAnswer::Full,
            _ => return Err(bad()),
        });
    }
    if out.len() != n {
        return Err(bad());
    }
    Ok(out)
}

/// One answer of the reserve script, for `key` of `len` bytes on `node`'s `tier`;
/// `Err(None)`: the key's entry fails its seal (remove it and reserve again).
fn reserved(
    index: &RedisIndex,
    answer: ReserveAnswer<'_>,
    key: BlockKey,
    node: NodeId,
    tier: TierId,
    len: u64,
) -> Result<Reserved, Option<Error>> {
    match answer {
        ReserveAnswer::Slot { slot, generation } => {
            Ok(Reserved::Slot(Reservation { key, node, tier, slot, len, generation }))
        }
        ReserveAnswer::Present(value) => index.open(key, value).map(Reserved::Present).ok_or(None),
        ReserveAnswer::Dead => Err(Some(Error::NodeNotAlive(node))),
        ReserveAnswer::Unknown => Err(Some(Error::UnknownTier { node, tier })),
        ReserveAnswer::TooLarge { slot_size } => {
            Err(Some(Error::TooLarge { node, tier, len, slot_size }))
        }
        ReserveAnswer::Full => Err(Some(Error::TierFull { node, tier })),
    }
}

/// A key whose entry failed its seal again right after the forged one was removed (its slot
/// is leased, or a writer keeps forging it).
fn forged(key: BlockKey) -> Error {
    Error::Corrupt(format!("the entry of {key} in redis fails its seal and could not be removed"))
}

/// One hash's fields a pipeline reads ([`RedisIndex::alive_and_fields`]): the hash's name
/// after the shard's tag, how many fields, and field `i`.
type FieldRead<'r, 'f> = (&'r str, usize, &'r dyn Fn(usize) -> &'f [u8]);

/// Keys per `HMGET` of a batched lookup.
const LOOKUP_CHUNK: usize = 4096;

/// Threads a call over several shards (a lookup, a reservation, a publish) uses at most.
const SCATTER_THREADS: usize = 8;

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
        let s = self.shards.of(&key);
        let mut out = self.reserve_shard(s, node, tier, &[(key, len)], ttl)?;
        out.pop().unwrap_or_else(|| Err(corrupt("reserve", &Value::Nil)))
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
        if self.shards.count() == 1 {
            return self.reserve_shard(0, node, tier, items, ttl);
        }
        let groups = self.shards.group(items.iter().map(|i| &i.0));
        let mut out: Vec<Option<Result<Reserved, Error>>> =
            (0..items.len()).map(|_| None).collect();
        let parts = self.scatter(&groups, |s, at| {
            let part: Vec<(BlockKey, u64)> = at.iter().map(|&i| items[i]).collect();
            self.reserve_shard(s, node, tier, &part, ttl)
        })?;
        for (s, answers) in parts {
            for (&i, r) in groups[s].iter().zip(answers) {
                out[i] = Some(r);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(corrupt("reserve_many", &Value::Nil))))
            .collect())
    }

    fn publish(&self, items: &[(Reservation, u32)]) -> Result<Vec<Published>, Error> {
        let groups = self.shards.group(items.iter().map(|i| &i.0.key));
        let parts = self.scatter(&groups, |s, at| {
            let v: Value = self.run_once(&self.scripts.publish, s, |inv| {
                for &i in at {
                    let (r, checksum) = &items[i];
                    inv.arg(&r.key.0[..])
                        .arg(r.node.0)
                        .arg(r.tier.0)
                        .arg(r.slot)
                        .arg(r.generation)
                        .arg(r.len)
                        .arg(&self.sealer.encode(&r.placement(*checksum))[..]);
                }
            })?;
            let raw = bytes("publish", &v)?;
            let bad = || {
                Error::Corrupt(format!(
                    "unexpected answer from redis for publish: {} bytes for {} items",
                    raw.len(),
                    at.len()
                ))
            };
            let mut rest = raw;
            let mut out = Vec::with_capacity(at.len());
            for &i in at {
                let (r, checksum) = &items[i];
                let (&code, tail) = rest.split_first().ok_or_else(bad)?;
                rest = tail;
                out.push(match code {
                    b'W' => Published::Won(r.placement(*checksum)),
                    b'E' => Published::Expired,
                    b'L' => {
                        let winner = take_value(&mut rest).ok_or_else(bad)?;
                        // A winner whose entry fails its seal is no placement to load from:
                        // nothing of this publish is visible.
                        self.open(r.key, winner)
                            .map_or(Published::Expired, |winner| Published::Lost { winner })
                    }
                    _ => return Err(bad()),
                });
            }
            if !rest.is_empty() {
                return Err(bad());
            }
            Ok(out)
        })?;
        let mut out = vec![Published::Expired; items.len()];
        for (s, answers) in parts {
            for (&i, p) in groups[s].iter().zip(answers) {
                out[i] = p;
            }
        }
        Ok(out)
    }

    fn abort(&self, reservations: &[Reservation]) -> Result<(), Error> {
        for (s, at) in self.shards.group(reservations.iter().map(|r| &r.key)).iter().enumerate() {
            if at.is_empty() {
                continue;
            }
            self.run::<i64>(&self.scripts.abort, s, |inv| {
                for &i in at {
                    let r = &reservations[i];
                    inv.arg(&r.key.0[..])
                        .arg(r.node.0)
                        .arg(r.tier.0)
                        .arg(r.slot)
                        .arg(r.generation)
                        .arg(r.len);
                }
            })?;
        }
        Ok(())
    }

    /// Through group summaries where they hold (the crate README's "Long lookups on Redis"):
    /// a summary per group of about 256 keys and shard instead of an entry per key. Each
    /// lookup also summarizes up to 4,096 of the keys it found, for the next ones.
    fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        if self.group_summaries {
            self.summarized_lookup(keys)
        } else {
            self.lookup_entries(keys)
        }
    }

    /// Through the heads of group summaries where they hold (the nodes a group's keys are
    /// on): a few bytes per group of about 256 keys, where a lookup reads its placements.
    fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        if self.group_summaries {
            self.summarized_prefix_hits(keys)
        } else {
            Ok(self.lookup_entries(keys)?.iter().take_while(|p| p.is_some()).count())
        }
    }

    fn lease(&self, placements: &[Placement], ttl: Duration) -> Result<Lease, Error> {
        let id = self.new_id();
        let groups = self.shards.group(placements.iter().map(|p| &p.key));
        let mut granted = vec![false; placements.len()];
        let mut held = Vec::new();
        for (s, at) in groups.iter().enumerate() {
            // An empty lease still exists (in shard 0), as a renewable id.
            if at.is_empty() && !(placements.is_empty() && s == 0) {
                continue;
            }
            // Recorded before the call: a lease whose answer is lost is still released. The
            // record only saves calls (without it renew and release go to every shard), so
            // it is bounded: leases never released do not pile up.
            held.push(s as u16);
            let mut leases = lock(&self.leases);
            if leases.len() >= 4096 {
                leases.clear();
            }
            leases.insert(id, held.clone());
            drop(leases);
            let v: Value = self.run(&self.scripts.lease, s, |inv| {
                inv.arg(ttl_ms(ttl)).arg(id);
                for &i in at {
                    let p = &placements[i];
                    inv.arg(&p.key.0[..]).arg(p.node.0).arg(p.tier.0).arg(p.slot).arg(p.generation);
                }
            })?;
            let a = array("lease", &v)?;
            if a.len() != at.len() {
                return Err(corrupt("lease", &v));
            }
            for (g, &i) in a.iter().zip(at) {
                granted[i] = int("lease", g)? == 1;
            }
        }
        Ok(Lease { id, granted, ttl })
    }

    fn renew(&self, id: u64, ttl: Duration) -> Result<(), Error> {
        let mut renewed = false;
        for s in self.lease_shards(id) {
            let key = format!("{}:lease:{id}", self.shards.tag(usize::from(s)));
            let here: i64 =
                self.with(|c| redis::cmd("PEXPIRE").arg(&key).arg(ttl_ms(ttl)).query(c))?;
            renewed |= here == 1;
        }
        if renewed {
            Ok(())
        } else {
            Err(Error::LeaseExpired(id))
        }
    }

    fn release(&self, id: u64) -> Result<(), Error> {
        for s in self.lease_shards(id) {
            self.run::<i64>(&self.scripts.release, usize::from(s), |inv| {
                inv.arg(id);
            })?;
        }
        lock(&self.leases).remove(&id);
        Ok(())
    }

    fn remove(&self, keys: &[BlockKey]) -> Result<Vec<Removed>, Error> {
        let mut out = vec![Removed::Absent; keys.len()];
        for (s, at) in self.shards.group(keys.iter()).iter().enumerate() {
            if at.is_empty() {
                continue;
            }
            let v: Value = self.run_once(&self.scripts.remove, s, |inv| {
                for &i in at {
                    inv.arg(&keys[i].0[..]);
                }
            })?;
            let a = array("remove", &v)?;
            if a.len() != at.len() {
                return Err(corrupt("remove", &v));
            }
            for (o, &i) in a.iter().zip(at) {
                out[i] = match bytes("remove", o)? {
                    b"R" => Removed::Removed,
                    b"A" => Removed::Absent,
                    b"L" => Removed::Leased,
                    _ => return Err(corrupt("remove", o)),
                };
            }
        }
        Ok(out)
    }

    fn evict(&self, node: NodeId, tier: TierId, count: u32) -> Result<u32, Error> {
        let n = self.shards.count() as u32;
        let mut evicted = 0;
        for s in 0..self.shards.count() {
            // The count spread over the shards, the first ones taking the remainder.
            let want = count / n + u32::from((s as u32) < count % n);
            let done: i64 = self.run_once(&self.scripts.evict, s, |inv| {
                inv.arg(node.0).arg(tier.0).arg(want);
            })?;
            if done < 0 {
                return Err(Error::UnknownTier { node, tier });
            }
            evicted += done as u32;
        }
        Ok(evicted)
    }

    fn tier_spec(&self, node: NodeId, tier: TierId) -> Result<Option<TierSpec>, Error> {
        let key = format!("{}:tier:{}:{}", self.shards.tag(0), node.0, tier.0);
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
        let mut total = TierStats { free: 0, reserved: 0, published: 0 };
        let answers: Vec<Value> = self.run_all(&self.scripts.stats, |inv| {
            inv.arg(node.0).arg(tier.0);
        })?;
        for v in answers {
            match array("tier_stats", &v)? {
                [free, reserved, published] => {
                    total.free += int("tier_stats", free)? as u32;
                    total.reserved += int("tier_stats", reserved)? as u32;
                    total.published += int("tier_stats", published)? as u32;
                }
                _ => return Err(Error::UnknownTier { node, tier }),
            }
        }
        Ok(total)
    }

    fn announce(&self, node: &NodeAnnouncement, ttl: Duration) -> Result<(), Error> {
        let blob = node.encode();
        let mut joined = false;
        for s in 0..self.shards.count() {
            let mut done = false;
            for _ in 0..MAX_STEPS {
                let answer: i64 = self.run(&self.scripts.announce, s, |inv| {
                    inv.arg(node.node.0).arg(ttl_ms(ttl)).arg(&blob);
                })?;
                match answer {
                    0 => {}
                    1 => joined = true,
                    // Its earlier life's entries are being deleted, a bounded step a call.
                    2 => continue,
                    other => return Err(corrupt("announce", &Value::Int(other))),
                }
                done = true;
                break;
            }
            if !done {
                return Err(steps_exhausted("announce"));
            }
        }
        if joined {
            tracing::info!(node = node.node.0, "pool: node joined (empty)");
            let specs: Vec<TierSpec> =
                lock(&self.registered).values().filter(|s| s.node == node.node).copied().collect();
            for spec in specs {
                self.register_remote(&spec)?;
            }
        }
        Ok(())
    }

    fn nodes(&self) -> Result<Vec<NodeAnnouncement>, Error> {
        let alive: Value = self.run(&self.scripts.alive, 0, |_| {})?;
        let ids: Vec<i64> =
            array("nodes", &alive)?.iter().map(|v| int("nodes", v)).collect::<Result<_, _>>()?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> =
            ids.iter().map(|n| format!("{}:node:{n}", self.shards.tag(0))).collect();
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
        for s in 0..self.shards.count() {
            let mut done = false;
            for _ in 0..MAX_STEPS {
                let v: Value = self.run_once(&self.scripts.leave, s, |inv| {
                    inv.arg(node.0);
                })?;
                let [alive, emptied] = array("leave", &v)? else {
                    return Err(corrupt("leave", &v));
                };
                // Only shard 0's first call tells: the node is dead from then on.
                if s == 0 {
                    was.get_or_insert(int("leave", alive)? == 1);
                }
                if int("leave", emptied)? == 1 {
                    done = true;
                    break;
                }
            }
            if !done {
                return Err(steps_exhausted("leave"));
            }
        }
        let was = was.unwrap_or(false);
        tracing::debug!(node = node.0, was_alive = was, "pool: node left");
        Ok(was)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_answers_read_every_kind_and_refuse_anything_else() {
        let mut raw = vec![b'o', 0, 0, 1, 2, 0, 6, 0x62, 0x12, 0x2b, 0x42, 0xdf, 0x3b];
        raw.extend_from_slice(&[b'p', 0, 3, b'a', b'b', b'c', b'd', b'u', b'f']);
        raw.extend_from_slice(&[b't', 0, 0, 0, 0, 0, 1, 0, 0]);
        let answers = reserve_answers(&raw, 6).unwrap();
        assert_eq!(
            answers,
            [
                ReserveAnswer::Slot { slot: 258, generation: 1_796_680_035_000_123 },
                ReserveAnswer::Present(b"abc"),
                ReserveAnswer::Dead,
                ReserveAnswer::Unknown,
                ReserveAnswer::Full,
                ReserveAnswer::TooLarge { slot_size: 65_536 },
            ]
        );
        assert!(reserve_answers(b"", 0).unwrap().is_empty());
        // Another count, any answer cut short, a value longer than the string, an unknown
        // code: each a typed error, never a panic or a guess.
        let corrupt = |raw: &[u8], n| matches!(reserve_answers(raw, n), Err(Error::Corrupt(_)));
        assert!(corrupt(&raw, 5) && corrupt(&raw, 7));
        // Where each of the first five answers ends.
        let ends = [13, 19, 20, 21, 22];
        for cut in 1..raw.len() {
            assert!(corrupt(&raw[..cut], 6), "cut at {cut}");
            if let Some(n) = ends.iter().position(|&end| end == cut) {
                assert_eq!(reserve_answers(&raw[..cut], n + 1).unwrap()[..], answers[..=n]);
            }
        }
        assert!(corrupt(&[b'p', 0, 9, b'a'], 1));
        assert!(corrupt(b"x", 1));
    }
}
