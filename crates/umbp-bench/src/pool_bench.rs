//! `umbp-bench pool`: the pool's index (umbp-pool) beside Mooncake Store on the same work, in
//! alternating rounds.
//!
//! - **lookup**: one batched lookup of `keys` published keys (62,500: the Kimi-K3
//!   999,936-token prefix in 16-token blocks) through umbp's Redis index on loopback (its
//!   direct path, and the redis-rs path for comparison), umbp's embedded index, and Mooncake
//!   Store's `batch_is_exist` of as many keys, one of each per round, the order rotating. The
//!   Redis rows also give the server's main-thread CPU per lookup (its `INFO cpu`).
//! - **prefix**: how many of the same keys, from the first, are stored (`prefix_hits`: what
//!   a server asks before it schedules a request, and what `batch_is_exist` answers) through
//!   Redis and the Cluster, in the same rounds. Redis answers lookups and prefixes from group
//!   summaries ([`umbp_pool`]'s README), built by the first lookups of a list: those are timed
//!   before the rounds as the `lookup, first asks` rows, and the same lookup from a client
//!   reading every entry (`group_summaries: false`) is the `umbp redis, entries only` row.
//! - **publish**: the embedded index's durable publish rate (one fsynced transaction per call
//!   of `publish_batch` blocks), into a fresh file per round; and Redis's (one reserve and one
//!   publish script per call), with the server's CPU per block.
//! - **restart**: an embedded index with `restart_blocks` durable blocks over an SSD tier file;
//!   time from reopening it to the first hit read from the SSD and verified (reopen, lookup,
//!   lease, read of the slot after dropping the file's cached pages, checksum).
//! - **put / get**: blocks between two processes through a memory node; see
//!   [`transfer`].
//!
//! Every figure is the median of its rounds with the 10th..90th percentile interval; targets
//! are judged on that interval ([`Verdict::range_at_most`] / [`Verdict::range_at_least`]), so a
//! target inside it is *within noise*. Each row carries the load average when it finished.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::Serialize;
use umbp_pool::redis_server::{RedisCluster, RedisServer};
use umbp_pool::{
    checksum, BlockKey, EmbeddedIndex, Index, NodeAnnouncement, NodeId, Published, RedisIndex,
    Reserved, TierId, TierSpec,
};

use crate::measure::{self, ratio_range, Verdict};
use crate::peers::mooncake_store::MooncakeStore;
use crate::progress::Progress;

/// What `umbp-bench pool` runs.
#[derive(Clone, Debug)]
pub struct PoolBenchConfig {
    /// Keys of the batched lookup (62,500: the 999,936-token prefix).
    pub keys: usize,
    /// Alternating rounds of the lookup (one lookup per system per round).
    pub rounds: usize,
    /// Blocks per publish call of the publish rate.
    pub publish_batch: usize,
    /// Blocks published per publish round.
    pub publish_blocks: usize,
    /// Rounds of the publish rate.
    pub publish_rounds: usize,
    /// Durable blocks in the restarted index.
    pub restart_blocks: usize,
    /// Bytes per slot of the restart's SSD tier (the first hit reads one).
    pub restart_block_size: u64,
    /// Restarts timed.
    pub restarts: usize,
    /// Directory for the index files and the SSD tier (a temporary directory inside it).
    pub dir: PathBuf,
    /// Run Mooncake Store beside umbp (skipped with a reason where its venv is missing).
    pub mooncake: bool,
    /// Blocks per put and per get of the transfer rows (0: no transfer rows).
    pub transfer_blocks: usize,
    /// Block sizes of the transfer rows.
    pub transfer_sizes: Vec<u64>,
    /// Rounds of the transfer rows.
    pub transfer_rounds: usize,
    /// Connections each pool's remote engine opens to the memory node (umbp-remote's
    /// `RemoteConfig::lanes`).
    pub lanes: usize,
}

impl Default for PoolBenchConfig {
    fn default() -> Self {
        Self {
            keys: 62_500,
            rounds: 15,
            publish_batch: 1024,
            publish_blocks: 62_500,
            publish_rounds: 5,
            restart_blocks: 1_000_000,
            restart_block_size: 64 << 10,
            restarts: 3,
            dir: std::env::temp_dir(),
            mooncake: true,
            transfer_blocks: 4096,
            transfer_sizes: vec![64 << 10, 1 << 20],
            transfer_rounds: 3,
            lanes: 2,
        }
    }
}

/// The target a row is judged against.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct Target {
    /// `<=` or `>=`.
    pub comparison: &'static str,
    /// The bound, in the row's unit (or `x Mooncake` for a ratio target).
    pub value: f64,
}

/// One line of `umbp-bench pool`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PoolRow {
    /// `lookup`, `publish`, `reserve+publish`, `restart`, `reopen`, `put` or `get`.
    pub figure: &'static str,
    /// `umbp redis`, `umbp redis (redis-rs)`, `umbp embedded`, `mooncake store`, ...
    pub system: String,
    /// Keys looked up, or blocks moved per round.
    pub items: u64,
    /// Bytes per block (put, get, restart); `null` otherwise.
    pub block_size: Option<u64>,
    /// umbp's put and get rows: the protection of the channel to the memory node
    /// (`encrypted` or `authenticated`); `null` otherwise.
    pub protection: Option<&'static str>,
    /// umbp's put and get rows: the connections its engine holds to the memory node (the
    /// lanes it asked for, fewer where the node took no more); `null` otherwise.
    pub lanes: Option<usize>,
    /// The median of the rounds, in `unit`.
    pub median: f64,
    /// The 10th..90th percentile of the rounds, in `unit`.
    pub interval: [f64; 2],
    /// `ms`, `blocks/s` or `GiB/s`.
    pub unit: &'static str,
    /// Rounds measured.
    pub rounds: usize,
    /// The row's own target, if it has one.
    pub target: Option<Target>,
    /// How many times faster (or more throughput) than Mooncake Store on the same figure, from
    /// the medians; `null` without a Mooncake row.
    pub vs_mooncake: Option<f64>,
    /// The range of that ratio over the rounds, `[min, max]` (`measure::ratio_range`).
    pub vs_mooncake_range: Option<[f64; 2]>,
    /// The verdict of the row's target (and, where it has one, of >= 1.0x Mooncake: the worse
    /// of the two); `unmet` whenever the row is not verified; `null` without a target.
    pub verdict: Option<Verdict>,
    /// Redis rows, and umbp's put and get rows with the index on the standalone Redis: the
    /// server's main-thread CPU per lookup or per block, ms (reading, parsing, executing,
    /// writing); `null` otherwise.
    pub server_cpu_ms: Option<f64>,
    /// Every round found or moved every block, byte for byte where bytes moved.
    pub verified: bool,
    /// The 1-minute load average when the row's rounds ended.
    pub load: f64,
}

/// How many times Mooncake Store's throughput the pool's put and get must reach (issue 43;
/// issue 36 asked for 1.0).
const PUT_GET_VS_MOONCAKE: f64 = 1.2;

/// The `q` quantile of `samples` (nearest rank).
fn quantile(samples: &[f64], q: f64) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len().saturating_sub(1)) as f64 * q).round() as usize).copied().unwrap_or(0.0)
}

impl PoolRow {
    /// A row of `samples` (already in `unit`), without target or comparison.
    pub fn of(
        figure: &'static str,
        system: impl Into<String>,
        items: u64,
        samples: &[f64],
        unit: &'static str,
    ) -> Self {
        Self {
            figure,
            system: system.into(),
            items,
            block_size: None,
            protection: None,
            lanes: None,
            median: quantile(samples, 0.5),
            interval: [quantile(samples, 0.1), quantile(samples, 0.9)],
            unit,
            rounds: samples.len(),
            target: None,
            vs_mooncake: None,
            vs_mooncake_range: None,
            verdict: None,
            server_cpu_ms: None,
            verified: true,
            load: measure::load_average(),
        }
    }

    /// Judges the row against `target` on its interval.
    pub fn with_target(mut self, comparison: &'static str, value: f64) -> Self {
        self.target = Some(Target { comparison, value });
        let verdict = match comparison {
            "<=" => Verdict::range_at_most(Some(self.interval), value),
            _ => Verdict::range_at_least(Some(self.interval), value),
        };
        self.verdict = Some(worse(self.verdict, verdict));
        self
    }

    /// Compares the row with Mooncake's rounds of the same figure: `ours` and `theirs` are
    /// the rounds as "more is better" values (1 / time, or throughput). Target: at least
    /// `times` Mooncake's.
    pub fn against_mooncake(mut self, ours: &[f64], theirs: &[f64], times: f64) -> Self {
        let (a, b) = (quantile(ours, 0.5), quantile(theirs, 0.5));
        self.vs_mooncake = (b > 0.0).then(|| a / b);
        self.vs_mooncake_range = ratio_range(ours, theirs);
        let verdict = Verdict::range_at_least(self.vs_mooncake_range, times);
        self.verdict = Some(worse(self.verdict, verdict));
        self
    }
}

/// The worse of two verdicts (unmet < below noise < within noise < met).
fn worse(a: Option<Verdict>, b: Verdict) -> Verdict {
    let rank = |v: Verdict| match v {
        Verdict::Unmet => 0,
        Verdict::BelowNoise => 1,
        Verdict::WithinNoise => 2,
        Verdict::Met => 3,
    };
    match a {
        Some(a) if rank(a) < rank(b) => a,
        _ => b,
    }
}

/// The `i`th key of a run: spread over all 128 bits, as block hashes are.
pub fn key(i: u64) -> BlockKey {
    BlockKey::from_u128(u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

/// The server's main-thread CPU seconds so far (user + system, from `INFO cpu`).
fn cpu_seconds(server: &RedisServer) -> anyhow::Result<f64> {
    let info = redis_command(server, "INFO cpu")?;
    Ok(info
        .lines()
        .filter(|l| {
            l.starts_with("used_cpu_user_main_thread:")
                || l.starts_with("used_cpu_sys_main_thread:")
        })
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .sum())
}

/// One inline command's bulk-string reply from `server`, on a fresh connection.
fn redis_command(server: &RedisServer, command: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", server.port()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "AUTH {}\r\n{command}\r\n", server.password())?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    ensure!(line.starts_with("+OK"), "redis AUTH answered {line:?}");
    line.clear();
    r.read_line(&mut line)?;
    let len: usize = line
        .trim()
        .strip_prefix('$')
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("redis {command} answered {line:?}"))?;
    let mut body = vec![0; len + 2];
    std::io::Read::read_exact(&mut r, &mut body)?;
    body.truncate(len);
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The tier every lookup key is published into (16-byte blocks: only the index is measured).
fn lookup_tier(keys: usize) -> TierSpec {
    TierSpec::new(NodeId(1), TierId(0), 16, keys as u32).durable().watermarks(0, 0)
}

/// Reserves and publishes keys `0..n` into `spec` in calls of `batch`.
fn publish_keys(index: &dyn Index, spec: &TierSpec, n: usize, batch: usize) -> anyhow::Result<()> {
    let all: Vec<u64> = (0..n as u64).collect();
    for chunk in all.chunks(batch) {
        let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&i| (key(i), 16)).collect();
        let reserved =
            index.reserve_many(spec.node, spec.tier, &items, Duration::from_secs(600))?;
        let mut publish = Vec::with_capacity(items.len());
        for r in reserved {
            match r? {
                Reserved::Slot(r) => publish.push((r, checksum(&r.key.0))),
                other => bail!("a fresh index answered {other:?}"),
            }
        }
        let out = index.publish(&publish)?;
        ensure!(out.iter().all(|o| matches!(o, Published::Won(_))), "a publish did not win");
    }
    Ok(())
}

fn announce(index: &dyn Index, node: NodeId) -> anyhow::Result<()> {
    let a = NodeAnnouncement { node, address: "loopback".into(), tiers: vec![] };
    Ok(index.announce(&a, Duration::from_secs(3600))?)
}

/// The lookup row of the Redis Cluster.
const CLUSTER_LOOKUP: &str = "umbp redis cluster (3 shards, 3 masters)";

/// A client of the bench's pool on `cluster`: 3 shards, each on a master of its own (a
/// prefix chosen so that their hash tags land on three masters).
fn cluster_config(cluster: &RedisCluster) -> umbp_pool::RedisConfig {
    let mut config =
        cluster.config(&cluster.spread_prefix("bench", 3), cluster.servers()[0].port());
    config.shards = Some(3);
    config
}

/// One system of the lookup comparison.
enum Looker<'a> {
    Index(&'a dyn Index, Option<&'a RedisServer>),
    /// `prefix_hits` instead of `lookup`.
    Prefix(&'a dyn Index, Option<&'a RedisServer>),
    Mooncake(&'a mut MooncakeStore),
}

/// Keys a lookup summarizes at most (umbp-pool's budget); a group is summarized the second
/// time a client finds it whole: the warm-up asks a list needs before every group is.
const SUMMARIZED_PER_ASK: usize = 4096;

/// The prefix row of the Redis Cluster.
const CLUSTER_PREFIX: &str = "umbp redis cluster prefix (3 shards)";

/// The lookup rows: every system once per round, the order rotating.
pub fn lookup(
    config: &PoolBenchConfig,
    dir: &Path,
    progress: &Progress,
    mooncake: Option<&mut MooncakeStore>,
    skipped: &mut Vec<String>,
) -> anyhow::Result<Vec<PoolRow>> {
    let n = config.keys;
    let spec = lookup_tier(n);
    let keys: Vec<BlockKey> = (0..n as u64).map(key).collect();
    progress.step(format!("publishing {n} keys into each index"));
    let embedded = EmbeddedIndex::open(dir.join("lookup.redb"))?;
    embedded.register_tier(&spec)?;
    publish_keys(&embedded, &spec, n, 4096)?;
    let server = match RedisServer::try_start() {
        Ok(s) => Some(s),
        Err(e) => {
            skipped.push(format!("the Redis rows: {e:#}"));
            None
        }
    };
    let (direct, values, entries) = match &server {
        Some(server) => {
            let direct = RedisIndex::connect(&server.config("bench"))?;
            announce(&direct, spec.node)?;
            direct.register_tier(&spec)?;
            publish_keys(&direct, &spec, n, 4096)?;
            let mut c = server.config("bench");
            c.direct_lookup = false;
            let values = RedisIndex::connect(&c)?;
            let mut c = server.config("bench");
            c.group_summaries = false;
            (Some(direct), Some(values), Some(RedisIndex::connect(&c)?))
        }
        None => (None, None, None),
    };
    // A Redis Cluster of 3 masters (each with a replica), the pool in 16 shards over them.
    let cluster = if server.is_some() { RedisCluster::start(3) } else { None };
    if server.is_some() && cluster.is_none() {
        skipped.push("the Redis Cluster rows: redis-cli is missing".into());
    }
    let sharded = match &cluster {
        Some(cluster) => {
            progress.step(format!("publishing {n} keys into the Redis Cluster"));
            let index = RedisIndex::connect(&cluster_config(cluster))?;
            // Twice the slots: each shard holds its share of them, and the keys do not split
            // exactly evenly over the shards.
            let spec = lookup_tier(2 * n);
            announce(&index, spec.node)?;
            index.register_tier(&spec)?;
            publish_keys(&index, &spec, n, 4096)?;
            Some(index)
        }
        None => None,
    };
    let mut names = vec!["umbp embedded"];
    let mut lookers = vec![Looker::Index(&embedded, None)];
    if let (Some(d), Some(v), Some(e)) = (&direct, &values, &entries) {
        names.extend([
            "umbp redis",
            "umbp redis (redis-rs)",
            "umbp redis, entries only",
            "umbp redis prefix",
        ]);
        lookers.push(Looker::Index(d, server.as_ref()));
        lookers.push(Looker::Index(v, server.as_ref()));
        lookers.push(Looker::Index(e, server.as_ref()));
        lookers.push(Looker::Prefix(d, server.as_ref()));
    }
    if let Some(c) = &sharded {
        names.extend([CLUSTER_LOOKUP, CLUSTER_PREFIX]);
        lookers.push(Looker::Index(c, None));
        lookers.push(Looker::Prefix(c, None));
    }
    if let Some(m) = mooncake {
        progress.step(format!("storing {n} keys in Mooncake Store"));
        m.fill(n)?;
        names.push("mooncake store");
        lookers.push(Looker::Mooncake(m));
    }
    // The first lookups through each server summarize the keys' groups, a budget of keys per
    // lookup; every client of the pool then reads the summaries.
    let mut rows = Vec::new();
    for (s, looker) in lookers.iter().enumerate() {
        let (Looker::Index(index, _), "umbp redis" | CLUSTER_LOOKUP) = (looker, names[s]) else {
            continue;
        };
        progress.step(format!("first lookups of {}", names[s]));
        let mut ms = Vec::new();
        let mut verified = true;
        for _ in 0..n.div_ceil(SUMMARIZED_PER_ASK) + 2 {
            let t = Instant::now();
            verified &= index.lookup(&keys)?.iter().all(Option::is_some);
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let mut row = PoolRow::of("lookup, first asks", names[s], n as u64, &ms, "ms");
        row.verified = verified;
        rows.push(row);
    }
    let mut times = vec![Vec::new(); lookers.len()];
    let mut cpu = vec![0.0f64; lookers.len()];
    let mut verified = vec![true; lookers.len()];
    for round in 0..=config.rounds {
        progress.step(format!("lookup round {round} of {}", config.rounds));
        for j in 0..lookers.len() {
            let s = (j + round) % lookers.len();
            let prefix = matches!(lookers[s], Looker::Prefix(..));
            let (seconds, found, server_cpu) = match &mut lookers[s] {
                Looker::Index(index, server) | Looker::Prefix(index, server) => {
                    let before = server.map(cpu_seconds).transpose()?;
                    let t = Instant::now();
                    let found = if prefix {
                        index.prefix_hits(&keys)?
                    } else {
                        index.lookup(&keys)?.iter().filter(|p| p.is_some()).count()
                    };
                    let seconds = t.elapsed().as_secs_f64();
                    let after = server.map(cpu_seconds).transpose()?;
                    let cpu = before.zip(after).map_or(0.0, |(b, a)| a - b);
                    (seconds, found, cpu)
                }
                Looker::Mooncake(m) => {
                    let (seconds, found) = m.exist(n)?;
                    (seconds, found as usize, 0.0)
                }
            };
            verified[s] &= found == n;
            // Round 0 warms every path up (connections, caches) and is not counted.
            if round > 0 {
                times[s].push(seconds);
                cpu[s] += server_cpu;
            }
        }
    }
    let speed = |t: &[f64]| t.iter().map(|s| 1.0 / s).collect::<Vec<f64>>();
    let mc = names.iter().position(|&n| n == "mooncake store");
    for (s, name) in names.iter().enumerate() {
        let ms: Vec<f64> = times[s].iter().map(|t| t * 1e3).collect();
        let figure = if matches!(lookers[s], Looker::Prefix(..)) { "prefix" } else { "lookup" };
        let mut row = PoolRow::of(figure, *name, n as u64, &ms, "ms");
        row.verified = verified[s];
        row = match *name {
            "umbp embedded" => row.with_target("<=", 2.0),
            "umbp redis" | CLUSTER_LOOKUP | "umbp redis prefix" | CLUSTER_PREFIX => {
                row.with_target("<=", 5.0)
            }
            _ => row,
        };
        if name.starts_with("umbp redis") && !name.starts_with("umbp redis cluster") {
            row.server_cpu_ms = Some(cpu[s] / times[s].len().max(1) as f64 * 1e3);
        }
        if let (Some(m), true) = (mc, *name == "umbp redis") {
            row = row.against_mooncake(&speed(&times[s]), &speed(&times[m]), 1.0);
        } else if let (Some(m), false) = (mc, *name == "mooncake store") {
            let r = row.verdict;
            row = row.against_mooncake(&speed(&times[s]), &speed(&times[m]), 1.0);
            row.verdict = r; // shown for comparison, judged only where the issue sets a target
        }
        rows.push(row);
    }
    Ok(rows)
}

/// The publish rate of the embedded index (durable: one fsynced transaction per call) and of
/// Redis (one script per call of reserves, one of publishes; the pool's data path makes the
/// same two calls per chunk of a put): `publish` (the publish calls alone, the embedded
/// index's target) and `reserve+publish`, each round into a fresh file or a fresh prefix. The
/// Redis rows give the server's main-thread CPU per block.
pub fn publish(
    config: &PoolBenchConfig,
    dir: &Path,
    progress: &Progress,
    skipped: &mut Vec<String>,
) -> anyhow::Result<Vec<PoolRow>> {
    let n = config.publish_blocks;
    let spec = lookup_tier(n);
    let per_call = format!("{} per call", config.publish_batch);
    let mut rows = Vec::new();
    let embedded = publish_rounds(config, &spec, progress, "embedded", |round| {
        let path = dir.join(format!("publish-{round}.redb"));
        let index = EmbeddedIndex::open(&path)?;
        index.register_tier(&spec)?;
        Ok((Box::new(index) as Box<dyn Index>, Some(path)))
    })?;
    let system = format!("umbp embedded, {per_call}");
    rows.push(
        PoolRow::of("publish", system.clone(), n as u64, &embedded.publish, "blocks/s")
            .with_target(">=", 100_000.0),
    );
    rows.push(PoolRow::of("reserve+publish", system, n as u64, &embedded.total, "blocks/s"));
    let server = match RedisServer::try_start() {
        Ok(s) => s,
        Err(e) => {
            skipped.push(format!("the Redis publish rows: {e:#}"));
            return Ok(rows);
        }
    };
    let before = cpu_seconds(&server)?;
    let redis = publish_rounds(config, &spec, progress, "redis", |round| {
        let index = RedisIndex::connect(&server.config(&format!("publish{round}")))?;
        announce(&index, spec.node)?;
        index.register_tier(&spec)?;
        Ok((Box::new(index) as Box<dyn Index>, None))
    })?;
    // Per block reserved and published: the rounds' whole CPU over their blocks (announcing
    // and registering the tier included, a few calls a round).
    let cpu_ms = (cpu_seconds(&server)? - before) * 1e3 / (n * config.publish_rounds) as f64;
    let system = format!("umbp redis, {per_call}");
    for (figure, rates) in [("publish", &redis.publish), ("reserve+publish", &redis.total)] {
        let mut row = PoolRow::of(figure, system.clone(), n as u64, rates, "blocks/s");
        row.server_cpu_ms = Some(cpu_ms);
        rows.push(row);
    }
    Ok(rows)
}

/// The rates, blocks/s, of each round of [`publish`] through one index.
struct PublishRates {
    /// The publish calls alone.
    publish: Vec<f64>,
    /// Reserving and publishing.
    total: Vec<f64>,
}

/// Runs [`publish`]'s rounds into tier `spec` through the fresh index `open(round)` gives
/// (with `spec` registered, and the file to delete after the round, if any).
fn publish_rounds(
    config: &PoolBenchConfig,
    spec: &TierSpec,
    progress: &Progress,
    name: &str,
    mut open: impl FnMut(usize) -> anyhow::Result<(Box<dyn Index>, Option<PathBuf>)>,
) -> anyhow::Result<PublishRates> {
    let n = config.publish_blocks;
    let mut rates = PublishRates { publish: Vec::new(), total: Vec::new() };
    for round in 0..config.publish_rounds {
        progress.step(format!("publish round {} of {} ({name})", round + 1, config.publish_rounds));
        let (index, file) = open(round)?;
        let all: Vec<u64> = (0..n as u64).collect();
        let start = Instant::now();
        let mut publishing = Duration::ZERO;
        for chunk in all.chunks(config.publish_batch) {
            let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&i| (key(i), 16)).collect();
            let reserved =
                index.reserve_many(spec.node, spec.tier, &items, Duration::from_secs(600))?;
            let mut batch = Vec::with_capacity(items.len());
            for r in reserved {
                match r? {
                    Reserved::Slot(r) => batch.push((r, checksum(&r.key.0))),
                    other => bail!("a fresh index answered {other:?}"),
                }
            }
            let t = Instant::now();
            let out = index.publish(&batch)?;
            publishing += t.elapsed();
            ensure!(out.iter().all(|o| matches!(o, Published::Won(_))), "a publish did not win");
        }
        rates.total.push(n as f64 / start.elapsed().as_secs_f64());
        rates.publish.push(n as f64 / publishing.as_secs_f64());
        drop(index);
        if let Some(file) = file {
            std::fs::remove_file(file)?;
        }
    }
    Ok(rates)
}

/// The restart: `reopen` (opening the index) and `restart` (reopen to the first SSD hit read
/// and verified).
pub fn restart(
    config: &PoolBenchConfig,
    dir: &Path,
    progress: &Progress,
) -> anyhow::Result<Vec<PoolRow>> {
    use std::os::unix::fs::FileExt;
    let n = config.restart_blocks;
    let size = config.restart_block_size;
    let spec = TierSpec::new(NodeId(1), TierId(1), size, n as u32).durable().watermarks(0, 0);
    let path = dir.join("restart.redb");
    let tier_path = dir.join("restart.tier");
    // A sparse tier file: only the probed block's bytes are written.
    let tier = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tier_path)?;
    tier.set_len(size * n as u64)?;
    let probe = key(n as u64 / 2 + 7);
    let block: Vec<u8> = (0..size).map(|i| (i as u8) ^ 0x5a).collect();
    {
        progress.step(format!("publishing {n} durable blocks"));
        let index = EmbeddedIndex::open(&path)?;
        index.register_tier(&spec)?;
        let all: Vec<u64> = (0..n as u64).collect();
        for chunk in all.chunks(4096) {
            let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&i| (key(i), size)).collect();
            let reserved =
                index.reserve_many(spec.node, spec.tier, &items, Duration::from_secs(600))?;
            let mut batch = Vec::with_capacity(items.len());
            for r in reserved {
                match r? {
                    Reserved::Slot(r) if r.key == probe => {
                        tier.write_all_at(&block, spec.slot_offset(r.slot))?;
                        tier.sync_data()?;
                        batch.push((r, checksum(&block)));
                    }
                    Reserved::Slot(r) => batch.push((r, 0)),
                    other => bail!("a fresh index answered {other:?}"),
                }
            }
            index.publish(&batch)?;
        }
    }
    let (mut reopen, mut first_hit) = (Vec::new(), Vec::new());
    let mut verified = true;
    let mut buf = vec![0u8; size as usize];
    for round in 0..config.restarts {
        progress.step(format!("restart {} of {}", round + 1, config.restarts));
        crate::disk::drop_cache(&tier_path);
        let t = Instant::now();
        let index = EmbeddedIndex::open(&path)?;
        reopen.push(t.elapsed().as_secs_f64() * 1e3);
        let found = index.lookup(&[probe])?;
        let Some(p) = found[0] else { bail!("the restarted index lost block {probe}") };
        let lease = index.lease(&[p], Duration::from_secs(10))?;
        ensure!(lease.all_granted(), "no lease on the restarted index's block");
        tier.read_exact_at(&mut buf[..p.len as usize], spec.slot_offset(p.slot))?;
        verified &= p.verify(&buf[..p.len as usize]).is_ok();
        index.release(lease.id)?;
        first_hit.push(t.elapsed().as_secs_f64() * 1e3);
        verified &= index.durable_blocks()? == n as u64;
    }
    drop(tier);
    let _ = std::fs::remove_file(&tier_path);
    let system = "umbp embedded";
    let mut rows = vec![
        PoolRow::of("reopen", system, n as u64, &reopen, "ms"),
        PoolRow::of("restart", system, n as u64, &first_hit, "ms"),
    ];
    for row in &mut rows {
        row.block_size = Some(size);
        row.verified = verified;
    }
    Ok(rows)
}

/// The pattern of block `i` of round `round` (`size` bytes), into `out`: 8-byte words of
/// `(round << 40) ^ (i << 20) ^ word`.
fn fill_pattern(out: &mut [u8], round: u64, i: u64) {
    for (w, chunk) in out.chunks_mut(8).enumerate() {
        let v = (round << 40) ^ (i << 20) ^ w as u64;
        chunk.copy_from_slice(&v.to_le_bytes()[..chunk.len()]);
    }
}

/// Whether `got` holds block `i` of round `round`.
fn is_pattern(got: &[u8], round: u64, i: u64) -> bool {
    got.chunks(8).enumerate().all(|(w, chunk)| {
        let v = (round << 40) ^ (i << 20) ^ w as u64;
        chunk == &v.to_le_bytes()[..chunk.len()]
    })
}

/// The umbp side of put/get: one memory node (an `umbp-bench serve` child) and one Redis
/// index, reached by a [`Pool`](umbp_pool::Pool) per channel protection, each over a
/// composite with a remote engine of its own (as two instances configured differently would
/// reach one node).
struct UmbpTransfer {
    // Dropped first: the channels (registrations, pools, engines), then the buffer they lent,
    // Redis and the child.
    channels: Vec<Channel>,
    buffer: crate::host_buffer::HostBuffer,
    server: RedisServer,
    _cluster: Option<RedisCluster>,
    _node: crate::remote_bench::ChildServer,
    arena_len: u64,
}

/// One client of the memory node: its pool over a composite whose remote engine asked for
/// `protection`, its index on the standalone Redis or on the Redis Cluster.
struct Channel {
    /// The rows' system: `umbp pool, PROTECTION` or `umbp pool on redis cluster, ...`.
    system: String,
    protection: umbp_remote::Protection,
    /// The connections its engine got to the memory node.
    lanes: usize,
    /// Its index is on the standalone Redis (whose CPU the rows give), not on the Cluster.
    standalone: bool,
    // Dropped first: the registrations, then the pool and engine.
    buffer_reg: umbp_plan::Registration,
    remote: umbp_plan::Registration,
    pool: umbp_pool::Pool,
    _ucx: std::sync::Arc<umbp_remote::RemoteEngine>,
}

/// The memory node's id in the pool.
const MEMORY_NODE: NodeId = NodeId(2);

impl UmbpTransfer {
    fn start(
        program: &Path,
        arena: u64,
        buffer: u64,
        lanes: usize,
        skipped: &mut Vec<String>,
    ) -> anyhow::Result<Self> {
        let node = crate::remote_bench::ChildServer::start(program, "tcp", arena, None)?;
        let server = RedisServer::try_start()?;
        let buffer = crate::host_buffer::HostBuffer::zeroed(buffer as usize);
        let mut channels = Vec::new();
        // Client node ids 1, 3, ...: every one but the memory node's.
        for (k, &protection) in crate::remote_bench::PROTECTIONS.iter().enumerate() {
            let id = NodeId(1 + 2 * k as u32);
            let name = crate::remote_bench::protection_name(protection);
            let system = format!("umbp pool, {name}");
            let config = server.config("bench");
            let mut channel =
                Channel::connect(&node, &config, &buffer, (protection, lanes), id, system)?;
            channel.standalone = true;
            channels.push(channel);
        }
        // The default protection once more, with the index on a Redis Cluster of 3 masters.
        let cluster = RedisCluster::start(3);
        match &cluster {
            Some(cluster) => {
                let protection = crate::remote_bench::PROTECTIONS[0];
                let name = crate::remote_bench::protection_name(protection);
                let system = format!("umbp pool on redis cluster, {name}");
                let config = cluster_config(cluster);
                let id = NodeId(1 + 2 * channels.len() as u32);
                let channel =
                    Channel::connect(&node, &config, &buffer, (protection, lanes), id, system)?;
                channels.push(channel);
            }
            None => skipped.push("the put/get rows on Redis Cluster: redis-cli is missing".into()),
        }
        let arena_len = channels.first().map_or(0, |c| c.remote.endpoint().len());
        Ok(Self { channels, buffer, server, _cluster: cluster, _node: node, arena_len })
    }

    /// Adds the memory node's tier of slots of `size` bytes (its id: `tier`) to every
    /// channel's pool, for `n` blocks: as many slots as the arena holds, up to `2 n` (a
    /// sharded pool's shards each hand out their share of the slots, and `n` keys never split
    /// exactly evenly over them).
    fn add_tier(&self, tier: TierId, size: u64, n: usize) -> anyhow::Result<TierSpec> {
        ensure!(size * n as u64 <= self.arena_len, "the memory node's arena is too small");
        let slots = (self.arena_len / size).min(2 * n as u64) as u32;
        let spec = TierSpec::new(MEMORY_NODE, tier, size, slots).watermarks(0, 0);
        for c in &self.channels {
            let region = umbp_pool::TierRegion::new(c.remote.id(), 0, &spec);
            c.pool.add_tier(spec, region)?;
        }
        Ok(spec)
    }

    /// The standalone Redis's CPU seconds so far if channel `c`'s index is on it, else 0.
    fn redis_cpu(&self, c: usize) -> anyhow::Result<f64> {
        if self.channels[c].standalone {
            cpu_seconds(&self.server)
        } else {
            Ok(0.0)
        }
    }

    /// Puts `n` blocks of `size` bytes of round `round` into the tier through channel `c`:
    /// seconds, blocks stored, and the standalone Redis's CPU seconds meanwhile (0 for a
    /// channel on the Cluster).
    fn put(
        &mut self,
        c: usize,
        spec: &TierSpec,
        round: u64,
        n: usize,
    ) -> anyhow::Result<(f64, usize, f64)> {
        let size = spec.slot_size;
        let bytes = self.buffer.bytes_mut();
        for i in 0..n {
            fill_pattern(&mut bytes[i * size as usize..][..size as usize], round, i as u64);
        }
        let channel = &self.channels[c];
        let blocks: Vec<umbp_pool::PutBlock> = (0..n)
            .map(|i| umbp_pool::PutBlock {
                key: key((round << 32) + i as u64),
                src: channel.buffer_reg.id(),
                offset: i as u64 * size,
                len: size,
            })
            .collect();
        let cpu = self.redis_cpu(c)?;
        let t = Instant::now();
        let out = channel.pool.put_on(spec.node, spec.tier, &blocks)?;
        let seconds = t.elapsed().as_secs_f64();
        let cpu = self.redis_cpu(c)? - cpu;
        let stored = out.iter().filter(|o| matches!(o, umbp_pool::PutOutcome::Stored(_))).count();
        Ok((seconds, stored, cpu))
    }

    /// Gets round `round`'s blocks through channel `c` into the poisoned buffer: seconds,
    /// blocks loaded and verified by the pool, whether every byte matched, and the standalone
    /// Redis's CPU seconds during the get (as for [`put`](Self::put)); then removes them
    /// (untimed).
    fn get(
        &mut self,
        c: usize,
        spec: &TierSpec,
        round: u64,
        n: usize,
    ) -> anyhow::Result<(f64, usize, bool, f64)> {
        let size = spec.slot_size;
        self.buffer.bytes_mut()[..n * size as usize].fill(0xa5);
        let channel = &self.channels[c];
        let keys: Vec<BlockKey> = (0..n).map(|i| key((round << 32) + i as u64)).collect();
        let blocks: Vec<umbp_pool::GetBlock> = keys
            .iter()
            .enumerate()
            .map(|(i, &key)| umbp_pool::GetBlock {
                key,
                dst: channel.buffer_reg.id(),
                offset: i as u64 * size,
                capacity: size,
            })
            .collect();
        let cpu = self.redis_cpu(c)?;
        let t = Instant::now();
        let out = channel.pool.get(&blocks)?;
        let seconds = t.elapsed().as_secs_f64();
        let cpu = self.redis_cpu(c)? - cpu;
        let loaded = out.iter().filter(|o| o.is_loaded()).count();
        let bytes = self.buffer.bytes();
        let verified = (0..n)
            .all(|i| is_pattern(&bytes[i * size as usize..][..size as usize], round, i as u64));
        channel.pool.remove(&keys)?;
        Ok((seconds, loaded, verified, cpu))
    }
}

impl Channel {
    /// Connects a remote engine asking for `protection` and `lanes` to the memory node,
    /// registers its arena and `buffer` with a composite, and opens a pool of node `id` over
    /// it.
    fn connect(
        node: &crate::remote_bench::ChildServer,
        index: &umbp_pool::RedisConfig,
        buffer: &crate::host_buffer::HostBuffer,
        (protection, lanes): (umbp_remote::Protection, usize),
        id: NodeId,
        system: String,
    ) -> anyhow::Result<Self> {
        use std::sync::Arc;
        use umbp_composite::{CompositeConfig, CompositeEngine};
        use umbp_plan::{EndpointRegistry, Register};
        let registry = EndpointRegistry::new();
        let ucx = Arc::new(umbp_remote::RemoteEngine::new(
            registry.clone(),
            umbp_remote::RemoteConfig {
                transports: Some("tcp".into()),
                secret: Some(crate::remote_bench::secret().into()),
                protection,
                // A batch of 4,096 blocks of 1 MiB into a memory node that first touches its
                // arena's pages, on a loaded 2-core machine, left the default 5 s without an
                // answer (the peer was declared dead and the rows failed): room for that.
                peer_timeout: Duration::from_secs(60),
                lanes,
                ..umbp_remote::RemoteConfig::default()
            },
        )?);
        let copy = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
        // The default checksum policy covers remote tiers: puts report each block's CRC32C,
        // gets verify it.
        let composite = CompositeEngine::with_config(
            registry,
            vec![copy, ucx.clone()],
            CompositeConfig::default(),
        );
        let peer = ucx.connect(node.addr())?;
        let exported = peer.region(crate::remote_bench::ARENA).with_context(|| {
            format!("the memory node exports no `{}`", crate::remote_bench::ARENA)
        })?;
        let remote = ucx.register_remote(exported.region, 0, exported.len)?;
        let index = Arc::new(RedisIndex::connect(index)?);
        // The memory node announces itself as umbp-ucx-serve would.
        announce(index.as_ref(), MEMORY_NODE)?;
        let pool = umbp_pool::Pool::new(index, composite.clone(), umbp_pool::PoolConfig::new(id))?;
        // SAFETY: the buffer outlives its registration (`UmbpTransfer`'s field order), and the
        // bench reads or writes it only between puts and gets, each of which returns once its
        // transfers ended; the channels take turns, so no two transfers touch it at once.
        let buffer_reg = unsafe { buffer.lend(&composite) }?;
        let lanes = peer.lanes;
        // `UmbpTransfer::start` marks the channels on the standalone Redis.
        Ok(Self {
            system,
            protection,
            lanes,
            standalone: false,
            buffer_reg,
            remote,
            pool,
            _ucx: ucx,
        })
    }
}

/// Put and get of `transfer_blocks` blocks per size between this process and a memory node:
/// umbp's Pool into an `umbp-bench serve` region once per channel protection (encrypted and
/// authenticated, as `remote` measures), Mooncake's batch put/get through its store into a
/// holder process's memory, taking turns round by round (each side first in turn).
pub fn transfer(
    config: &PoolBenchConfig,
    progress: &Progress,
    python: Option<&Path>,
    skipped: &mut Vec<String>,
) -> anyhow::Result<Vec<PoolRow>> {
    let largest = config.transfer_sizes.iter().copied().max().unwrap_or(0);
    let smallest = config.transfer_sizes.iter().copied().min().unwrap_or(0);
    let n = config.transfer_blocks;
    let bytes = largest * n as u64;
    // The memory node's arena: a quarter to spare for the largest blocks, twice the blocks
    // for the smallest (see `UmbpTransfer::add_tier`).
    let arena = (bytes + bytes / 4).max(2 * smallest * n as u64);
    let program = std::env::current_exe().context("finding the umbp-bench binary")?;
    progress.step("starting the memory node, Redis and the pools");
    let mut umbp = UmbpTransfer::start(&program, arena, bytes, config.lanes, skipped)?;
    let channels = umbp.channels.len();
    let mut mooncake = match python {
        // The holder's segment with room to spare: Mooncake evicts above 95 % full.
        Some(python) => match MooncakeStore::start(python, bytes + bytes / 4 + (64 << 20), bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                skipped.push(format!("Mooncake Store put/get: {e:#}"));
                None
            }
        },
        None => None,
    };
    let mut rows = Vec::new();
    for (t, &size) in config.transfer_sizes.iter().enumerate() {
        let spec = umbp.add_tier(TierId(10 + t as u16), size, n)?;
        let gib = |s: f64| (size * n as u64) as f64 / s / f64::from(1u32 << 30);
        // Per channel: put and get rounds in GiB/s, and whether every round was right.
        let mut ours = vec![(Vec::new(), Vec::new(), true); channels];
        // Per channel: the standalone Redis's CPU seconds over the counted puts and gets.
        let mut redis_cpu = vec![(0.0f64, 0.0f64); channels];
        let (mut mp, mut mg, mut m_ok) = (Vec::new(), Vec::new(), true);
        for round in 0..=config.transfer_rounds {
            progress.step(format!(
                "put/get of {n} blocks of {size} bytes, round {round} of {}",
                config.transfer_rounds
            ));
            let tag = (t as u64) * 1000 + round as u64 + 1;
            // Sides 0..channels are umbp's channels, the last Mooncake; the first side
            // rotates round by round. Round 0 warms up and is not counted. A Mooncake
            // failure ends its rows (said in `skipped`), not umbp's.
            for side in (0..=channels).map(|k| (k + round) % (channels + 1)) {
                if side < channels {
                    // Each channel its own keys, so no get meets another channel's blocks.
                    let utag = tag * channels as u64 + side as u64;
                    let (ps, stored, put_cpu) = umbp.put(side, &spec, utag, n)?;
                    let (gs, loaded, verified, get_cpu) = umbp.get(side, &spec, utag, n)?;
                    let (up, ug, ok) = &mut ours[side];
                    *ok &= stored == n && loaded == n && verified;
                    if round > 0 {
                        up.push(gib(ps));
                        ug.push(gib(gs));
                        redis_cpu[side].0 += put_cpu;
                        redis_cpu[side].1 += get_cpu;
                    }
                    continue;
                }
                let Some(m) = mooncake.as_mut() else { continue };
                let run = |m: &mut MooncakeStore| -> anyhow::Result<(f64, f64, bool)> {
                    let (ps, stored) = m.put(tag, size, n)?;
                    let (gs, loaded, verified) = m.get(tag, size, n)?;
                    m.remove(tag, n)?;
                    Ok((ps, gs, stored == n as u64 && loaded == n as u64 && verified))
                };
                match run(m) {
                    Ok((ps, gs, ok)) => {
                        m_ok &= ok;
                        if round > 0 {
                            mp.push(gib(ps));
                            mg.push(gib(gs));
                        }
                    }
                    Err(e) => {
                        skipped
                            .push(format!("Mooncake Store put/get of {size}-byte blocks: {e:#}"));
                        mooncake = None;
                    }
                }
            }
        }
        for (figure, theirs) in [("put", &mp), ("get", &mg)] {
            for (c, (up, ug, ok)) in ours.iter().enumerate() {
                let samples = if figure == "put" { up } else { ug };
                let name = crate::remote_bench::protection_name(umbp.channels[c].protection);
                let system = umbp.channels[c].system.clone();
                let mut row = PoolRow::of(figure, system, n as u64, samples, "GiB/s");
                row.block_size = Some(size);
                row.protection = Some(name);
                row.lanes = Some(umbp.channels[c].lanes);
                row.verified = *ok;
                if umbp.channels[c].standalone {
                    let (put, get) = redis_cpu[c];
                    let cpu = if figure == "put" { put } else { get };
                    row.server_cpu_ms = Some(cpu * 1e3 / (samples.len() * n).max(1) as f64);
                }
                if !theirs.is_empty() {
                    row = row.against_mooncake(samples, theirs, PUT_GET_VS_MOONCAKE);
                }
                rows.push(row);
            }
            if !theirs.is_empty() {
                let mut row = PoolRow::of(figure, "mooncake store", n as u64, theirs, "GiB/s");
                row.block_size = Some(size);
                row.verified = m_ok;
                rows.push(row);
            }
        }
    }
    if let Some(m) = mooncake {
        m.stop();
    }
    Ok(rows)
}

/// Runs every part; `skipped` collects one line per part or peer that could not run.
pub fn run(
    config: &PoolBenchConfig,
    progress: &Progress,
) -> anyhow::Result<(Vec<PoolRow>, Vec<String>)> {
    let dir = tempfile::tempdir_in(&config.dir)
        .with_context(|| format!("a temporary directory in {}", config.dir.display()))?;
    let mut skipped = Vec::new();
    progress.section("pool", 5 + config.rounds + config.publish_rounds + config.restarts);
    let python = if config.mooncake {
        match crate::peers::mooncake::python() {
            Ok(p) => Some(p),
            Err(e) => {
                skipped.push(format!("Mooncake Store: {e}"));
                None
            }
        }
    } else {
        None
    };
    let mut mooncake = match &python {
        Some(python) => match MooncakeStore::start(python, 512 << 20, 64 << 20) {
            Ok(m) => Some(m),
            Err(e) => {
                skipped.push(format!("Mooncake Store lookups: {e:#}"));
                None
            }
        },
        None => None,
    };
    let mut rows = lookup(config, dir.path(), progress, mooncake.as_mut(), &mut skipped)?;
    if let Some(m) = mooncake.take() {
        m.stop();
    }
    rows.extend(publish(config, dir.path(), progress, &mut skipped)?);
    rows.extend(restart(config, dir.path(), progress)?);
    if config.transfer_blocks > 0 && !config.transfer_sizes.is_empty() {
        match transfer(config, progress, python.as_deref(), &mut skipped) {
            Ok(r) => rows.extend(r),
            Err(e) => skipped.push(format!("the put/get rows: {e:#}")),
        }
    }
    // A round that missed keys or failed blocks is fast, not good: no target is met by it.
    for row in rows.iter_mut().filter(|r| !r.verified) {
        row.verdict = row.verdict.map(|_| Verdict::Unmet);
    }
    Ok((rows, skipped))
}

/// The table of the rows, then one line per skipped part.
pub fn table(rows: &[PoolRow], skipped: &[String]) -> String {
    use std::fmt::Write as _;
    let mut t = String::new();
    let _ =
        writeln!(t, "the pool's index beside Mooncake Store (median of the rounds, p10..p90)\n");
    let _ = writeln!(
        t,
        "{:<16} {:<42} {:>9} {:>12} {:>25} {:<8} {:>10} {:>22} {:>13} {:>9} {:>5}",
        "figure",
        "system",
        "items",
        "median",
        "p10..p90",
        "unit",
        "target",
        "vs mooncake",
        "verdict",
        "srv cpu",
        "load"
    );
    for r in rows {
        let fmt = |v: f64| if v >= 1000.0 { format!("{v:.0}") } else { format!("{v:.2}") };
        let target = r.target.map_or("-".into(), |t| format!("{} {}", t.comparison, fmt(t.value)));
        let vs = match (r.vs_mooncake, r.vs_mooncake_range) {
            (Some(v), Some([lo, hi])) => format!("{v:.2}x [{lo:.2}, {hi:.2}]"),
            _ => "-".into(),
        };
        let _ = writeln!(
            t,
            "{:<16} {:<42} {:>9} {:>12} {:>25} {:<8} {:>10} {:>22} {:>13} {:>9} {:>5.1}{}",
            r.figure,
            r.system,
            r.items,
            fmt(r.median),
            format!("{}..{}", fmt(r.interval[0]), fmt(r.interval[1])),
            r.unit,
            target,
            vs,
            r.verdict.map_or("-", Verdict::as_str),
            r.server_cpu_ms.map_or("-".into(), |c| {
                if c >= 0.1 {
                    format!("{c:.1} ms")
                } else {
                    format!("{:.1} µs", c * 1e3)
                }
            }),
            r.load,
            if r.verified { "" } else { "  NOT VERIFIED" },
        );
    }
    if rows.iter().any(|r| r.block_size.is_some()) {
        let _ = writeln!(t, "{}", measure::congestion_line());
    }
    for s in skipped {
        let _ = writeln!(t, "skipped: {s}");
    }
    t
}
