//! `umbp-bench serve` and `umbp-bench remote`: the remote memory engine (`umbp-remote`) restoring
//! the Kimi-K3 shape from another process's memory, against Mooncake Transfer Engine and
//! `ucx_perftest` moving the same bytes in the same run, and its latency of single 4 KiB
//! transfers, quiet and beside a spinning process.
//!
//! # `serve`: the memory node
//!
//! A [`RemoteServer`] exporting one writable region, [`ARENA`], of `bytes` bytes filled with
//! [`pattern_word`]: byte `i` of the arena is byte `i % 8` of the little-endian word
//! `pattern_word(i / 8)`, so a client checks any range it read without a copy of the arena.
//! With a perftest port it also keeps a `ucx_perftest -p PORT` server running (restarted after
//! every client run), so that a client node measures the reference against the same node.
//!
//! # `remote`: the client
//!
//! Starts `serve` as a child process on loopback (or connects to a memory node's, `server`),
//! connects a [`RemoteEngine`] and, for each fragment size, restores `objects` objects of the
//! Kimi-K3 shape ([`RestoreShape::kimi_k3`]: 24 ranges of 1 MiB, range `r` of object `b` into
//! destination `r` at `b` MiB; 24 host destinations registered with the engine) whose pages,
//! one fragment each, lie scattered over the server's arena ([`scattered_pages`]): no two pages
//! that follow each other in a destination are adjacent in the arena, so no fragments merge
//! and the restore is one one-sided get of `fragment_size` bytes per page (the row's
//! `segments` counts the requests, and the run refuses a plan set where any merged). Timed end
//! to end: build (the engine's incremental builder, reused), submit, wait. One untimed restore
//! warms up each fragment size; after timing, the destinations are poisoned, restored once
//! more and checked byte for byte against the pattern (`verified`).
//!
//! # The reference: `ucx_perftest`
//!
//! `ucx_perftest HOST -p PORT -t ucp_get -s <fragment_size> -n <gets> -w <gets / 10> -O
//! <in flight>` with `UCX_TLS` set to the same transports: UCP one-sided gets of the same size,
//! as many as the restore has pages (the same bytes), through UCX's own benchmark loop. Its
//! figure is the `Final:` row's overall bandwidth (MB/s there are 2^20 bytes per second,
//! checked on every run; see [`crate::peers::perftest`]). Why these options:
//!
//! - `ucp_get`, not `ucp_put_bw`: a restore reads the peer's memory; `get` is the same
//!   operation through the same UCP layer the engine uses.
//! - `-O` = the engine's [`RemoteConfig::max_in_flight`] (256): perftest's default keeps one get
//!   in flight (about 50 MB/s over TCP here against 600 to 800 with 256), which is no ceiling
//!   at all; deeper than the engine's own limit (tried up to 1,024 on this machine) measured
//!   no better than 256 within the run-to-run spread, so the same depth is the best the tool
//!   gives for the engine's work, and keeps the comparison about the engine's overhead.
//! - One thread (`-T 1`, the default) and polling progress (`-E poll`, the default): the
//!   engine progresses UCX on one thread too, and polling is perftest's fastest mode.
//! - It reads one `fragment_size` buffer again and again, with nothing to plan, route or
//!   check: it is a ceiling of what UCX does on this transport, not the same program.
//!
//! The engine's repeats and perftest's alternate (engine first in even rounds, perftest first
//! in odd ones), so drift of a shared machine falls on both. Each figure is the median of its
//! repeats with its spread ([`Timed`]); `ratio` is the engine's median over perftest's, and
//! `ratio_range` spans both spreads ([`measure::ratio_range`]). Target: `ratio` at least 0.8
//! for fragments of 64 KiB and larger, `met` only when the whole range reaches it, `within
//! noise` when the range straddles it. When `ucx_perftest` is missing the run says why on
//! stderr and the rows have no reference, no ratio and no verdict.
//!
//! # The path, and the raw one-sided path it replaced
//!
//! umbp-remote reaches a server's memory one-sided (UCX gets with the server's remote keys) only
//! where the transports are RDMA alone; over TCP (and shared memory) every read is a request
//! the server checks on the authenticated connection (the row's `path`: `one-sided` or
//! `checked`, by the same rule as umbp-remote's). Over TCP the raw one-sided path is not offered
//! any more (UCX emulates it in software there and checks neither bounds nor rights), so the
//! engine cannot run it; `ucx_perftest`'s one-sided gets stand beside the checked path in the
//! same run as that path's ceiling. The 0.8 target applies only where the path is one-sided:
//! over TCP the ratio is reported without a verdict.
//!
//! # The channel: encrypted and authenticated
//!
//! On the checked path every request and answer is sealed (umbp-remote's channel: AES-256-GCM
//! with session keys from the handshake). `serve` takes sessions of either protection (the
//! client chooses), and `remote` connects two engines to it, one asking for encryption
//! (umbp-remote's default) and one for authentication only; each fragment size and load has a
//! row per engine (`protection`), both against the same Mooncake and perftest runs, and the
//! engines take their turns with the peers like any side.
//!
//! # The transfer engine users would pick instead: Mooncake
//!
//! [`crate::peers::mooncake`]: Mooncake Transfer Engine's TCP transport with the P2P
//! handshake on loopback, one `batch_transfer_sync_read` of the same fragments (the same
//! sizes, the same scattered source pages, the same destination offsets) per run, taking turns
//! with the engines and perftest (all of them rotate their order every round). Target: `ratio`
//! over Mooncake at least 1.0 at 64 KiB and larger, judged over its whole range. Where the
//! wheel does not install the run says why on stderr and the rows carry the reason
//! (`mooncake_skipped`).
//!
//! # Single-transfer latency
//!
//! After the restores, `latency_transfers` transfers of one 4 KiB page each, one at a time
//! (build, submit, wait), from pages spread over the arena, each checked against the pattern;
//! once on a quiet machine and once with one process spinning a CPU beside it (started and
//! stopped by the bench), and Mooncake's `transfer_sync_read` of the same pages right after
//! under the same load, as a reference. Percentiles over all of them; the p99 range is over
//! five blocks of them in order. Target: p99 at most 1 ms under load.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::Serialize;
use umbp_plan::{
    EndpointRegistry, Fragment, PageWalk, PlanBuilder, PlanSet, Register, Registration, Tag,
    TransferEngine,
};
use umbp_remote::{
    Protection, RemoteBuilder, RemoteConfig, RemoteEngine, RemoteServer, ServerBuilder,
};

use crate::chart::{BarChart, Series};
use crate::host_buffer::HostBuffer;
use crate::measure::{self, range_text, Timed, Verdict};
use crate::peers::mooncake::{self, Mooncake};
use crate::peers::perftest::{self, GetRun, PerftestServer};
use crate::progress::Progress;
use crate::shape::RestoreShape;
use crate::size::ByteSize;

/// The name of the region `serve` exports.
pub const ARENA: &str = "arena";

/// The least `ratio` targeted, for fragments of [`TARGET_FROM`] bytes and larger.
pub const TARGET_RATIO: f64 = 0.8;

/// The smallest fragment size the target applies to: 64 KiB.
pub const TARGET_FROM: u64 = 64 << 10;

/// The least ratio over Mooncake targeted, for fragments of [`TARGET_FROM`] bytes and larger
/// (issue 43, with the channel sealed; it was 1.0 before).
pub const MOONCAKE_TARGET: f64 = 1.2;

/// Bytes of one single transfer in the latency rows.
pub const LATENCY_SIZE: u64 = 4096;

/// The most p99 latency targeted under load, µs.
pub const TARGET_P99_US: f64 = 1000.0;

/// Blocks the latency samples are cut into, in order, for the p99's range.
const LATENCY_BLOCKS: usize = 5;

/// The channel protections measured, each by an engine of its own against the same server:
/// encrypted (umbp-remote's default) and authenticated only.
pub(crate) const PROTECTIONS: [Protection; 2] = [Protection::Encrypted, Protection::Authenticated];

/// A protection's name in the rows: `encrypted` or `authenticated`.
pub fn protection_name(protection: Protection) -> &'static str {
    match protection {
        Protection::Authenticated => "authenticated",
        _ => "encrypted",
    }
}

/// The RDMA transports umbp-remote reaches one-sided (its `hardware_enforced` rule).
const ONE_SIDED_TRANSPORTS: [&str; 8] =
    ["rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5"];

/// The engine's path to the server's memory for `transports`: `one-sided` where they are RDMA
/// transports alone, else `checked` (requests the server checks), as umbp-remote decides.
pub fn path_of(transports: &str) -> &'static str {
    let mut names = transports.split(',').map(str::trim).filter(|n| !n.is_empty()).peekable();
    if names.peek().is_some() && names.all(|n| ONE_SIDED_TRANSPORTS.contains(&n)) {
        "one-sided"
    } else {
        "checked"
    }
}

/// What a destination holds before the verification restore.
const POISON: u8 = 0xA5;

/// The shared secret of the memory node and the client (umbp-remote serves only peers that prove
/// it): `UMBP_UCX_SECRET` when set (a node started elsewhere needs the same), else one drawn
/// for this run from the process's random hash keys and handed to the child server.
pub(crate) fn secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        std::env::var(umbp_remote::SECRET_ENV).unwrap_or_else(|_| {
            use std::hash::{BuildHasher, Hasher};
            let state = std::collections::hash_map::RandomState::new();
            (0..4u64)
                .map(|i| {
                    let mut h = state.build_hasher();
                    h.write_u64(i);
                    format!("{:016x}", h.finish())
                })
                .collect()
        })
    })
}

/// How long a child server may take to say where it listens.
const SERVER_START: Duration = Duration::from_secs(60);

/// Word `word` (bytes `8 × word ..`) of the arena's pattern, little-endian.
pub fn pattern_word(word: u64) -> u64 {
    word.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (word >> 7)
}

/// `len` bytes of the arena's pattern (see [`pattern_word`]).
pub fn patterned(len: usize) -> Vec<u8> {
    let mut arena = vec![0u8; len];
    for (w, word) in arena.chunks_mut(8).enumerate() {
        word.copy_from_slice(&pattern_word(w as u64).to_le_bytes()[..word.len()]);
    }
    arena
}

/// Whether `bytes` equal the pattern at arena offset `at` (a multiple of 8).
fn matches_pattern(bytes: &[u8], at: u64) -> bool {
    debug_assert_eq!(at % 8, 0);
    bytes
        .chunks(8)
        .enumerate()
        .all(|(i, got)| got == &pattern_word(at / 8 + i as u64).to_le_bytes()[..got.len()])
}

/// Settings of `umbp-bench serve`.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where the control connection listens (`host:port`; port 0 picks one).
    pub listen: String,
    /// Bytes of the exported arena.
    pub bytes: u64,
    /// UCX transports (`UCX_TLS`'s syntax); `None`: the environment's, else UCX's choice.
    pub transports: Option<String>,
    /// Keep a `ucx_perftest -p PORT` server running on this port; `None`: no perftest server.
    pub perftest_port: Option<u16>,
}

/// A running memory node: the UCX server and, if asked, the perftest server beside it.
/// Dropping it stops both.
#[derive(Debug)]
pub struct Serving {
    _perftest: Option<PerftestServer>,
    server: RemoteServer,
}

impl Serving {
    /// Fills the arena and starts serving it.
    pub fn start(config: &ServeConfig) -> anyhow::Result<Self> {
        umbp_remote::ucx_available().context("UCX is not usable here")?;
        let len = usize::try_from(config.bytes).context("--bytes does not fit in memory")?;
        ensure!(len > 0, "the arena must not be empty");
        // The least protection it serves: authenticated; a client that asks for encryption
        // (umbp-remote's default) gets it, so `remote` measures both on one server.
        let ucx = RemoteConfig {
            transports: config.transports.clone(),
            protection: Protection::Authenticated,
            // A client reading a 4 GiB batch slowly on a loaded machine (`pool`'s 4,096 blocks
            // of 1 MiB) was cut after the default 5 s per answer; a bench node waits longer.
            peer_timeout: Duration::from_secs(60),
            ..RemoteConfig::default()
        };
        let server = ServerBuilder::new(ucx)
            .export(ARENA, patterned(len), true)
            .serve(config.listen.as_str())
            .with_context(|| format!("serving on {}", config.listen))?;
        let perftest = match config.perftest_port {
            Some(port) => Some(
                PerftestServer::start(port, config.transports.as_deref())
                    .context("--perftest-port")?,
            ),
            None => None,
        };
        Ok(Self { _perftest: perftest, server })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
}

/// Where `remote` finds its memory node.
#[derive(Clone, Debug)]
pub enum ServerChoice {
    /// Start `program serve ...` as a child process on loopback, stopped at the end (the
    /// command passes itself).
    Child {
        /// The `umbp-bench` binary.
        program: PathBuf,
    },
    /// A memory node already running `umbp-bench serve` (with `--perftest-port` for the
    /// reference).
    Node {
        /// Its control address (`serve`'s `listening` line).
        addr: String,
        /// The port of its perftest server.
        perftest_port: u16,
    },
}

/// Settings of `umbp-bench remote`.
#[derive(Clone, Debug)]
pub struct RemoteBenchConfig {
    /// The memory node.
    pub server: ServerChoice,
    /// UCX transports of the engine, the child server and perftest. Default `tcp`.
    pub transports: String,
    /// Fragment (page) sizes: powers of two from 4 KiB to 1 MiB. Default 64 KiB, 256 KiB,
    /// 1 MiB.
    pub fragment_sizes: Vec<u64>,
    /// Objects of 24 MiB restored per run. Default 10 (240 MiB).
    pub objects: usize,
    /// Timed runs of the engine and of perftest per fragment size, taking turns. Default 5.
    pub repeats: usize,
    /// Whether to run the reference. Default true (skipped with a message when
    /// `ucx_perftest` is missing).
    pub perftest: bool,
    /// Whether to run Mooncake Transfer Engine beside the engine (skipped with a message
    /// where it does not install). Default false (the command turns it on).
    pub mooncake: bool,
    /// Single 4 KiB transfers timed one at a time, quiet and under load; 0: no latency rows.
    /// Default 0 (the command asks for 2,000).
    pub latency_transfers: usize,
    /// Connections the engine opens to the server ([`RemoteConfig::lanes`]). Default: the
    /// engine's (2).
    pub lanes: usize,
}

impl Default for RemoteBenchConfig {
    fn default() -> Self {
        Self {
            server: ServerChoice::Child { program: PathBuf::from("umbp-bench") },
            transports: "tcp".into(),
            fragment_sizes: vec![64 << 10, 256 << 10, 1 << 20],
            objects: 10,
            repeats: 5,
            perftest: true,
            mooncake: false,
            latency_transfers: 0,
            lanes: RemoteConfig::default().lanes,
        }
    }
}

/// One fragment size: the engine's restore against Mooncake's and perftest's.
#[derive(Clone, Debug, Serialize)]
pub struct RemoteRow {
    /// `restore`: a row of this kind.
    pub row: &'static str,
    /// UCX transports (`UCX_TLS`) of both.
    pub transport: String,
    /// The engine's path: `checked` (requests the server checks) or `one-sided`.
    pub path: &'static str,
    /// The channel's protection on the checked path: `encrypted` or `authenticated`.
    pub protection: &'static str,
    /// Connections the engine restored over (umbp-remote's lanes; 1 one-sided).
    pub lanes: usize,
    /// `child` (a `serve` process on loopback) or `node` (`--server`).
    pub server: &'static str,
    /// Bytes per fragment: one page, one get.
    pub fragment_size: u64,
    /// Objects restored per run.
    pub objects: usize,
    /// Bytes restored per run (perftest moves the same).
    pub bytes: u64,
    /// Page fragments per run.
    pub fragments: u64,
    /// Requests per run after planning (equal to `fragments`: nothing merges).
    pub segments: usize,
    /// Gets in flight at most: the engine's limit and perftest's `-O`.
    pub in_flight: usize,
    /// Timed runs of each side.
    pub repeats: usize,
    /// The engine's median throughput, GiB/s (build + submit + wait).
    pub gib_s: f64,
    /// Its spread: (fastest − slowest) / median.
    pub gib_s_spread: f64,
    /// perftest's median overall bandwidth, GiB/s; `null` without perftest.
    pub perftest_gib_s: Option<f64>,
    /// Its spread; `null` without perftest.
    pub perftest_spread: Option<f64>,
    /// `gib_s / perftest_gib_s`; `null` without perftest.
    pub ratio: Option<f64>,
    /// `[low, high]`: the ratio over both spreads (slowest engine run over fastest perftest
    /// run, and the reverse); `null` without perftest.
    pub ratio_range: Option<[f64; 2]>,
    /// `ratio` against 0.8 for fragments of 64 KiB and larger where the path is one-sided:
    /// `met`, `unmet` or `within noise`; `null` below 64 KiB, on the checked path and without
    /// perftest.
    pub verdict: Option<Verdict>,
    /// Every object completed and every destination byte matched the arena after timing.
    pub verified: bool,
    /// Mooncake's median throughput, GiB/s; `null` when it did not run.
    pub mooncake_gib_s: Option<f64>,
    /// Its spread; `null` when it did not run.
    pub mooncake_spread: Option<f64>,
    /// `gib_s / mooncake_gib_s`; `null` when it did not run.
    pub mooncake_ratio: Option<f64>,
    /// `[low, high]` over both spreads; `null` when it did not run.
    pub mooncake_ratio_range: Option<[f64; 2]>,
    /// `mooncake_ratio_range` against 1.0 at 64 KiB and larger; `null` below or without it.
    pub mooncake_verdict: Option<Verdict>,
    /// Mooncake read every byte right after timing; `null` when it did not run.
    pub mooncake_verified: Option<bool>,
    /// Why Mooncake has no figure in this row; `null` when it ran.
    pub mooncake_skipped: Option<String>,
}

/// Single transfers one at a time, quiet or beside a spinning process.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyRow {
    /// `latency`: a row of this kind.
    pub row: &'static str,
    /// UCX transports of the engine.
    pub transport: String,
    /// The engine's path: `checked` or `one-sided`.
    pub path: &'static str,
    /// The channel's protection on the checked path: `encrypted` or `authenticated`.
    pub protection: &'static str,
    /// `quiet`, or `spinning`: one process spinning a CPU beside the bench.
    pub load: &'static str,
    /// Bytes per transfer.
    pub transfer_size: u64,
    /// Timed transfers.
    pub transfers: usize,
    /// Percentiles of the transfers' times (build + submit + wait), µs.
    pub p50_us: f64,
    /// The 90th percentile, µs.
    pub p90_us: f64,
    /// The 99th percentile, µs.
    pub p99_us: f64,
    /// The slowest, µs.
    pub max_us: f64,
    /// `[low, high]`: the p99 of each of five blocks of the transfers in order.
    pub p99_range: [f64; 2],
    /// 1,000 µs under load; `null` quiet.
    pub target_p99_us: Option<f64>,
    /// `p99_range` against the target: `met`, `unmet` or `within noise`; `null` quiet.
    pub verdict: Option<Verdict>,
    /// Every transfer delivered the right bytes.
    pub verified: bool,
    /// Mooncake's single 4 KiB `transfer_sync_read`s, the same offsets right after the
    /// engine's under the same load: percentiles in µs; `null` when it did not run.
    pub mooncake_p50_us: Option<f64>,
    /// Its 90th percentile, µs.
    pub mooncake_p90_us: Option<f64>,
    /// Its 99th percentile, µs.
    pub mooncake_p99_us: Option<f64>,
    /// Its slowest, µs.
    pub mooncake_max_us: Option<f64>,
    /// Every one of Mooncake's transfers delivered the right bytes; `null` when it did not run.
    pub mooncake_verified: Option<bool>,
}

/// What `remote` measured: a row per fragment size, and the latency rows.
#[derive(Clone, Debug, Default)]
pub struct RemoteRun {
    /// One per fragment size.
    pub restores: Vec<RemoteRow>,
    /// Quiet and spinning (none when not asked for).
    pub latency: Vec<LatencyRow>,
}

/// One JSON line of `remote`: the `row` field says which.
#[derive(Clone, Debug, Serialize)]
#[serde(untagged)]
pub enum RemoteLine<'a> {
    /// A fragment size's restore.
    Restore(&'a RemoteRow),
    /// A latency row.
    Latency(&'a LatencyRow),
}

impl RemoteRun {
    /// Every row, restores first.
    pub fn lines(&self) -> Vec<RemoteLine<'_>> {
        let restores = self.restores.iter().map(RemoteLine::Restore);
        restores.chain(self.latency.iter().map(RemoteLine::Latency)).collect()
    }
}

/// Page `k` of object `b` lies at `pages[b × pages_per_object + k]`: every page of the tier
/// (exactly the pages the objects need), in the order of a stride through them. The stride is
/// coprime with the page count (so every page is used once) and chosen so that no two pages
/// that follow each other in a destination (consecutive pages of a range, and the last page of
/// a range of one object then the first of the same range of the next) are adjacent in the
/// tier: no fragments merge. Fails only for a shape whose range is not whole pages.
pub fn scattered_pages(shape: &RestoreShape) -> anyhow::Result<Vec<u64>> {
    ensure!(
        shape.page_size > 0 && shape.range_len % shape.page_size == 0,
        "a range ({} B) must be whole pages of {} B",
        shape.range_len,
        shape.page_size
    );
    let per_object = shape.pages_per_object() as u64;
    let per_range = shape.range_len / shape.page_size;
    let n = shape.objects as u64 * per_object;
    ensure!(n >= 3, "too few pages to scatter");
    let times = |a: u64, b: u64| ((u128::from(a) * u128::from(b)) % u128::from(n)) as u64;
    // The distance in the flat order between the pairs that would merge.
    let across = per_object - per_range + 1;
    let fits = |s: u64| gcd(s, n) == 1 && times(s, 1) != 1 && times(s, across) != 1;
    let start = ((n as f64 * 0.618) as u64).max(2);
    let Some(stride) = (start..start + n).map(|s| s % n).find(|&s| s > 1 && fits(s)) else {
        bail!("no stride scatters {n} pages without adjacent pairs");
    };
    Ok((0..n).map(|p| times(p, stride) * shape.page_size).collect())
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A `serve` child process, stopped (its stdin closed, then killed if need be) when dropped.
/// `umbp-bench pool` runs its memory node the same way.
pub(crate) struct ChildServer {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
    /// What the child wrote on stderr, for errors.
    stderr: Option<JoinHandle<String>>,
}

impl ChildServer {
    /// Starts `program serve` exporting `bytes` over `transports`, and waits for its address.
    pub(crate) fn start(
        program: &Path,
        transports: &str,
        bytes: u64,
        perftest_port: Option<u16>,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(program);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--bytes", &bytes.to_string()])
            .args(["--transports", transports])
            .env(umbp_remote::SECRET_ENV, secret());
        if let Some(port) = perftest_port {
            command.args(["--perftest-port", &port.to_string()]);
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} serve", program.display()))?;
        let stdin = child.stdin.take();
        let stderr = child.stderr.take().map(|mut e| {
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = e.read_to_string(&mut text);
                text
            })
        });
        let (said, heard) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            // Reads the `listening` line, then drains the rest so the child never blocks.
            std::thread::spawn(move || {
                let mut lines = BufReader::new(stdout).lines();
                let _ = said.send(lines.next());
                for _ in lines {}
            });
        }
        let mut server = Self { child, stdin, addr: SocketAddr::from(([127, 0, 0, 1], 0)), stderr };
        let line = match heard.recv_timeout(SERVER_START) {
            Ok(Some(Ok(line))) => line,
            Ok(_) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let said = server.stop();
                bail!("the serve child exited before listening: {}", said.trim());
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                server.stop();
                bail!("the serve child did not listen within {SERVER_START:?}");
            }
        };
        let addr = line.strip_prefix("listening ").and_then(|a| a.trim().parse().ok());
        let Some(addr) = addr else {
            server.stop();
            bail!("the serve child said {line:?}, not `listening ADDR`");
        };
        server.addr = addr;
        Ok(server)
    }

    /// The child's control address (its `listening` line).
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes the child's stdin (it stops serving), waits a while, kills it if it lingers;
    /// returns what it wrote on stderr.
    fn stop(&mut self) -> String {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A free TCP port on this machine (for the child's perftest server).
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("0.0.0.0:0").context("finding a free port")?;
    Ok(listener.local_addr().context("finding a free port")?.port())
}

/// The engine, its connection and the destinations: what every fragment size restores with.
struct Client {
    /// Declared (so dropped) before the buffers they register, and before the engine.
    destinations: Vec<Registration>,
    buffers: Vec<HostBuffer>,
    remote: Registration,
    engine: RemoteEngine,
    /// What the engine asked its channel for.
    protection: Protection,
    /// The connections the engine got to the server (`PeerInfo::lanes`).
    lanes: usize,
}

impl Client {
    fn connect(
        addr: SocketAddr,
        config: &RemoteBenchConfig,
        shape: &RestoreShape,
        protection: Protection,
    ) -> anyhow::Result<Self> {
        let engine = RemoteEngine::new(
            EndpointRegistry::new(),
            RemoteConfig {
                transports: Some(config.transports.clone()),
                secret: Some(secret().into()),
                protection,
                lanes: config.lanes,
                ..RemoteConfig::default()
            },
        )
        .context("starting the UCX engine")?;
        let peer = engine.connect(addr).with_context(|| format!("connecting to {addr}"))?;
        let arena = peer.region(ARENA).with_context(|| format!("{addr} exports no `{ARENA}`"))?;
        ensure!(
            arena.len >= shape.bytes(),
            "the server's arena holds {} bytes; the restore needs {}",
            arena.len,
            shape.bytes()
        );
        let remote = engine.register_remote(arena.region, 0, arena.len)?;
        let len = shape.objects * shape.range_len as usize;
        let buffers: Vec<HostBuffer> = (0..shape.ranges).map(|_| HostBuffer::new(len, 1)).collect();
        let destinations = buffers
            .iter()
            // SAFETY: the buffers outlive their registrations (the field order), and the bench
            // reads or writes them only between restores, once every handle was waited on.
            .map(|b| unsafe { b.lend(&engine) })
            .collect::<Result<Vec<_>, _>>()
            .context("registering the destinations")?;
        let lanes = peer.lanes;
        Ok(Self { destinations, buffers, remote, engine, protection, lanes })
    }

    /// Plans the restore of every object of `shape` from `pages`.
    fn build(
        &self,
        builder: &mut RemoteBuilder,
        shape: &RestoreShape,
        pages: &[u64],
    ) -> anyhow::Result<PlanSet> {
        let per_object = shape.pages_per_object();
        let remote = self.remote.id();
        for b in 0..shape.objects {
            let tag = Tag::new(b as u32);
            let walk = PageWalk::new(
                &pages[b * per_object..][..per_object],
                shape.page_size,
                shape.object_size(),
            )?;
            builder.begin_object(tag)?;
            for (r, dst) in self.destinations.iter().enumerate() {
                let at = r as u64 * shape.range_len;
                let dst_offset = b as u64 * shape.range_len;
                builder.push_walk(remote, dst.id(), &walk, at, shape.range_len, dst_offset, tag)?;
            }
            builder.commit_object()?;
        }
        Ok(builder.finish()?)
    }

    /// One restore: build, submit, wait. Returns its seconds and the executed plan set.
    fn restore(
        &self,
        builder: &mut RemoteBuilder,
        shape: &RestoreShape,
        pages: &[u64],
    ) -> anyhow::Result<(f64, PlanSet)> {
        let start = Instant::now();
        let plans = self.build(builder, shape, pages)?;
        if let Some(tag) = plans.rejected().first() {
            bail!("the builder rejected object {tag:?}");
        }
        let settled = self.engine.submit(plans).into_settled();
        let seconds = start.elapsed().as_secs_f64();
        if let Some(failure) = settled.failures.first() {
            bail!("a restore failed: {failure}");
        }
        Ok((seconds, settled.plans))
    }

    /// Whether every destination byte holds the arena's bytes its object's page says.
    fn verify(&self, shape: &RestoreShape, pages: &[u64]) -> bool {
        let per_object = shape.pages_per_object();
        let per_range = (shape.range_len / shape.page_size) as usize;
        let page = shape.page_size as usize;
        self.buffers.iter().enumerate().all(|(r, buffer)| {
            (0..shape.objects).all(|b| {
                (0..per_range).all(|k| {
                    let at = b * shape.range_len as usize + k * page;
                    let src = pages[b * per_object + r * per_range + k];
                    matches_pattern(&buffer.bytes()[at..at + page], src)
                })
            })
        })
    }

    fn poison(&mut self) {
        for buffer in &mut self.buffers {
            buffer.bytes_mut().fill(POISON);
        }
    }

    /// One transfer of [`LATENCY_SIZE`] bytes from arena offset `src` into the first
    /// destination at `dst`, alone: build, submit, wait. Returns its seconds and whether the
    /// bytes arrived (the slot is poisoned first, outside the timing).
    fn single(
        &mut self,
        builder: &mut RemoteBuilder,
        src: u64,
        dst: u64,
    ) -> anyhow::Result<(f64, bool)> {
        let slot = dst as usize..(dst + LATENCY_SIZE) as usize;
        self.buffers[0].bytes_mut()[slot.clone()].fill(POISON);
        let (remote, local) = (self.remote.id(), self.destinations[0].id());
        let start = Instant::now();
        let tag = Tag::new(0);
        builder.begin_object(tag)?;
        builder.push(Fragment::new(remote, src, local, dst, LATENCY_SIZE, tag))?;
        builder.commit_object()?;
        let settled = self.engine.submit(builder.finish()?).into_settled();
        let seconds = start.elapsed().as_secs_f64();
        if let Some(failure) = settled.failures.first() {
            bail!("a single transfer failed: {failure}");
        }
        builder.recycle(settled.plans);
        Ok((seconds, matches_pattern(&self.buffers[0].bytes()[slot], src)))
    }

    /// Single transfers from `src[i]` to `dst[i]` (see [`latency_offsets`]), the first
    /// [`LATENCY_WARMUP`] untimed: the others' times in µs, and whether every one delivered
    /// its bytes.
    fn latencies(
        &mut self,
        builder: &mut RemoteBuilder,
        src: &[u64],
        dst: &[u64],
    ) -> anyhow::Result<(Vec<f64>, bool)> {
        let mut verified = true;
        let mut times = Vec::with_capacity(src.len());
        for (i, (&src, &dst)) in src.iter().zip(dst).enumerate() {
            let (seconds, ok) = self.single(builder, src, dst)?;
            verified &= ok;
            if i >= LATENCY_WARMUP {
                times.push(seconds * 1e6);
            }
        }
        Ok((times, verified))
    }
}

/// Untimed single transfers before the timed ones.
const LATENCY_WARMUP: usize = 20;

/// The offsets of [`LATENCY_WARMUP`] + `transfers` single transfers: sources spread over the
/// arena's first `arena` bytes by a prime stride, destinations cycling through 64 slots of
/// the first destination (of `dst_len` bytes).
fn latency_offsets(arena: u64, dst_len: u64, transfers: usize) -> (Vec<u64>, Vec<u64>) {
    let pages = (arena / LATENCY_SIZE).max(1);
    let slots = (dst_len / LATENCY_SIZE).clamp(1, 64);
    (0..(transfers + LATENCY_WARMUP) as u64)
        .map(|i| ((i * 7919 % pages) * LATENCY_SIZE, (i % slots) * LATENCY_SIZE))
        .unzip()
}

/// A process spinning one CPU (`sh -c 'while :; do :; done'`), killed when dropped.
struct Spinner(Child);

impl Spinner {
    fn start() -> anyhow::Result<Self> {
        let child = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a spinning process")?;
        // Let it reach the scheduler's steady state before timing.
        std::thread::sleep(Duration::from_millis(200));
        Ok(Self(child))
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `q` quantile of sorted `samples` (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * q).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// The latency row of `times` (µs, in the order measured).
fn latency_row(
    config: &RemoteBenchConfig,
    protection: Protection,
    load: &'static str,
    times: &[f64],
    verified: bool,
) -> LatencyRow {
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let per_block = times.len().div_ceil(LATENCY_BLOCKS).max(1);
    let block_p99: Vec<f64> = times
        .chunks(per_block)
        .map(|block| {
            let mut b = block.to_vec();
            b.sort_by(f64::total_cmp);
            quantile(&b, 0.99)
        })
        .collect();
    let low = block_p99.iter().copied().fold(f64::INFINITY, f64::min);
    let high = block_p99.iter().copied().fold(0.0, f64::max);
    let p99_range = if block_p99.is_empty() { [0.0, 0.0] } else { [low, high] };
    let loaded = load == "spinning";
    LatencyRow {
        row: "latency",
        transport: config.transports.clone(),
        path: path_of(&config.transports),
        protection: protection_name(protection),
        load,
        transfer_size: LATENCY_SIZE,
        transfers: times.len(),
        p50_us: quantile(&sorted, 0.50),
        p90_us: quantile(&sorted, 0.90),
        p99_us: quantile(&sorted, 0.99),
        max_us: sorted.last().copied().unwrap_or(0.0),
        p99_range,
        target_p99_us: loaded.then_some(TARGET_P99_US),
        verdict: loaded.then(|| Verdict::range_at_most(Some(p99_range), TARGET_P99_US)),
        verified,
        mooncake_p50_us: None,
        mooncake_p90_us: None,
        mooncake_p99_us: None,
        mooncake_max_us: None,
        mooncake_verified: None,
    }
}

/// Mooncake's fragments for `shape` and `pages`, in the engine's layout: (target offsets,
/// destination offsets), destination `r` of the engine at `r × objects × range_len`.
fn mooncake_fragments(shape: &RestoreShape, pages: &[u64]) -> (Vec<u64>, Vec<u64>) {
    let per_object = shape.pages_per_object();
    let per_range = (shape.range_len / shape.page_size) as usize;
    let mut src = Vec::with_capacity(pages.len());
    let mut dst = Vec::with_capacity(pages.len());
    for b in 0..shape.objects {
        for r in 0..shape.ranges {
            for k in 0..per_range {
                src.push(pages[b * per_object + r * per_range + k]);
                let at = (r * shape.objects + b) as u64 * shape.range_len;
                dst.push(at + (k as u64) * shape.page_size);
            }
        }
    }
    (src, dst)
}

/// Mooncake while it works, else why not: a step that fails says so once on stderr and
/// leaves the reason for the rows after it.
struct MooncakePeer(Result<Mooncake, String>);

impl MooncakePeer {
    fn step<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut Mooncake) -> anyhow::Result<T>,
    ) -> Option<T> {
        let Ok(peer) = &mut self.0 else { return None };
        match f(peer) {
            Ok(value) => Some(value),
            Err(e) => {
                let why = format!("Mooncake failed {what}: {e:#}");
                eprintln!("umbp-bench remote: no Mooncake row from here on: {why}");
                self.0 = Err(why);
                None
            }
        }
    }

    fn skipped(&self) -> Option<String> {
        self.0.as_ref().err().cloned()
    }
}

/// Runs the comparison: starts or reaches the server, then one row per fragment size, then
/// the latency rows.
pub fn run(config: &RemoteBenchConfig, progress: &Progress) -> anyhow::Result<RemoteRun> {
    ensure!(config.objects > 0 && config.objects <= u32::MAX as usize, "at least one object");
    ensure!(!config.fragment_sizes.is_empty(), "no fragment size to measure");
    for &size in &config.fragment_sizes {
        ensure!(
            size.is_power_of_two() && (4 << 10..=1 << 20).contains(&size),
            "fragment size {} is not a power of two from 4KiB to 1MiB",
            ByteSize(size)
        );
    }
    umbp_remote::ucx_available().context("UCX is not usable here")?;
    let repeats = config.repeats.max(1);
    let mut with_perftest = config.perftest
        && match perftest::available() {
            Ok(()) => true,
            Err(why) => {
                eprintln!("umbp-bench remote: no reference: {why}");
                false
            }
        };
    let base = RestoreShape { objects: config.objects, ..RestoreShape::kimi_k3(1 << 20) };
    let latency_steps = if config.latency_transfers > 0 { 2 } else { 0 };
    progress.section("remote", 2 + config.fragment_sizes.len() * (1 + repeats) + latency_steps);
    progress.step(format!("starting the server ({})", ByteSize(base.bytes())));
    let (server, addr, perftest_port, server_kind) = match &config.server {
        ServerChoice::Child { program } => {
            let port = if with_perftest { Some(free_port()?) } else { None };
            let child = ChildServer::start(program, &config.transports, base.bytes(), port)?;
            let addr = child.addr;
            (Some(child), addr, port.unwrap_or(0), "child")
        }
        ServerChoice::Node { addr, perftest_port } => {
            let resolved = addr
                .to_socket_addrs()
                .with_context(|| format!("--server {addr}"))?
                .next()
                .with_context(|| format!("--server {addr} resolves to no address"))?;
            (None, resolved, *perftest_port, "node")
        }
    };
    progress.step("starting Mooncake Transfer Engine");
    let mut mooncake = MooncakePeer(if config.mooncake {
        let started = mooncake::python().and_then(|python| {
            Mooncake::start(&python, base.bytes()).map_err(|e| format!("{e:#}"))
        });
        if let Err(why) = &started {
            eprintln!("umbp-bench remote: no Mooncake row: {why}");
        }
        started
    } else {
        Err("not run (--no-mooncake)".to_owned())
    });
    let mut clients = PROTECTIONS
        .iter()
        .map(|&p| Client::connect(addr, config, &base, p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let in_flight = clients[0].engine.config().max_in_flight;
    let perftest_host = addr.ip().to_string();
    let mut builders: Vec<RemoteBuilder> =
        clients.iter().map(|c| c.engine.incremental_builder()).collect();
    let mut rows = Vec::new();
    for &fragment_size in &config.fragment_sizes {
        let shape = RestoreShape { page_size: fragment_size, ..base };
        let pages = scattered_pages(&shape)?;
        let fragments = shape.fragments();
        let label = ByteSize(fragment_size);
        progress.step(format!("{label}: warm-up restores"));
        let mut segments = 0;
        for (client, builder) in clients.iter().zip(&mut builders) {
            let (_, plans) = client.restore(builder, &shape, &pages)?;
            segments = plans.segment_count();
            ensure!(
                segments as u64 == fragments,
                "{label}: {fragments} fragments planned as {segments} requests: the layout \
                 merged some"
            );
            builder.recycle(plans);
        }
        let (src, dst) = mooncake_fragments(&shape, &pages);
        mooncake.step("its setup", |m| {
            m.setup(fragment_size, &src, &dst)?;
            m.run() // Warm-up: its first batch also opens its connections.
        });
        let reference = GetRun {
            host: &perftest_host,
            port: perftest_port,
            transports: &config.transports,
            size: fragment_size,
            iterations: fragments,
            warmup: (fragments / 10).max(1),
            outstanding: in_flight,
            timeout: Duration::from_secs(120),
        };
        let (mut perftest_gib_s, mut mooncake_gib_s) = (Vec::new(), Vec::new());
        let mut engine_gib_s: Vec<Vec<f64>> = vec![Vec::new(); clients.len()];
        // The engines (one per protection), perftest and Mooncake take turns, each first in
        // every few rounds.
        let (engines, sides) = (clients.len(), clients.len() + 2);
        for repeat in 0..repeats {
            progress.step(format!("{label}: engine and peers, round {}/{repeats}", repeat + 1));
            for side in (0..sides).map(|i| (repeat + i) % sides) {
                if side < engines {
                    let builder = &mut builders[side];
                    let (seconds, plans) = clients[side].restore(builder, &shape, &pages)?;
                    builder.recycle(plans);
                    engine_gib_s[side].push(shape.bytes() as f64 / seconds / GIB);
                } else if side == engines && with_perftest {
                    match reference.run() {
                        Ok(bytes_per_s) => perftest_gib_s.push(bytes_per_s / GIB),
                        Err(e) => {
                            // A reference that fails once (no server on the node, transports
                            // refused) would fail again: say why once and go on without it.
                            eprintln!(
                                "umbp-bench remote: no reference from {label} on: ucx_perftest \
                                 failed: {e:#}"
                            );
                            with_perftest = false;
                        }
                    }
                } else if side == engines + 1 {
                    if let Some(bytes_per_s) = mooncake.step("a run", Mooncake::run) {
                        mooncake_gib_s.push(bytes_per_s / GIB);
                    }
                }
            }
        }
        let mut verified = Vec::new();
        for (client, builder) in clients.iter_mut().zip(&mut builders) {
            client.poison();
            let (_, plans) = client.restore(builder, &shape, &pages)?;
            builder.recycle(plans);
            verified.push(client.verify(&shape, &pages));
        }
        let mooncake_verified = mooncake.step("its verification", Mooncake::verify);
        if mooncake_gib_s.len() < repeats {
            mooncake_gib_s.clear(); // A peer that failed mid-size has no figure for it.
        }
        for (i, client) in clients.iter().enumerate() {
            let mut r = row(
                config,
                (client.protection, client.lanes),
                server_kind,
                &shape,
                segments,
                in_flight,
                &engine_gib_s[i],
                &perftest_gib_s,
                verified[i],
            );
            let skipped = mooncake.skipped();
            add_mooncake(&mut r, &engine_gib_s[i], &mooncake_gib_s, mooncake_verified, skipped);
            rows.push(r);
        }
    }
    let mut latency = Vec::new();
    if config.latency_transfers > 0 {
        let dst_len = clients[0].buffers[0].len() as u64;
        let (src, dst) = latency_offsets(base.bytes(), dst_len, config.latency_transfers);
        for load in ["quiet", "spinning"] {
            progress.step(format!(
                "{} single {} transfers per protection, {load}",
                config.latency_transfers,
                ByteSize(LATENCY_SIZE)
            ));
            let spinner = if load == "spinning" { Some(Spinner::start()?) } else { None };
            let mut measured = Vec::new();
            for (client, builder) in clients.iter_mut().zip(&mut builders) {
                let (times, verified) = client.latencies(builder, &src, &dst)?;
                measured.push(latency_row(config, client.protection, load, &times, verified));
            }
            let peer = mooncake.step("single transfers", |m| m.singles(&src, &dst));
            drop(spinner);
            for mut row in measured {
                if let Some((peer_times, peer_verified)) = &peer {
                    let timed = &peer_times[LATENCY_WARMUP.min(peer_times.len())..];
                    let mut sorted = timed.to_vec();
                    sorted.sort_by(f64::total_cmp);
                    row.mooncake_p50_us = Some(quantile(&sorted, 0.50));
                    row.mooncake_p90_us = Some(quantile(&sorted, 0.90));
                    row.mooncake_p99_us = Some(quantile(&sorted, 0.99));
                    row.mooncake_max_us = sorted.last().copied();
                    row.mooncake_verified = Some(*peer_verified);
                }
                latency.push(row);
            }
        }
    }
    let stopped = mooncake.0.map(Mooncake::stop);
    ensure!(stopped != Ok(false), "the Mooncake target died during the run");
    drop(builders);
    drop(clients);
    drop(server);
    Ok(RemoteRun { restores: rows, latency })
}

/// Adds Mooncake's figures (its GiB/s per run; none: `skipped` says why) to `row`.
fn add_mooncake(
    row: &mut RemoteRow,
    engine: &[f64],
    peer: &[f64],
    verified: Option<bool>,
    skipped: Option<String>,
) {
    if peer.is_empty() {
        row.mooncake_skipped = Some(skipped.unwrap_or_else(|| "no run completed".to_owned()));
        return;
    }
    let m = Timed::of(peer);
    let ratio = (m.median > 0.0).then(|| row.gib_s / m.median);
    let range = measure::ratio_range(engine, peer);
    row.mooncake_gib_s = Some(m.median);
    row.mooncake_spread = Some(m.spread);
    row.mooncake_ratio = ratio;
    row.mooncake_ratio_range = range;
    row.mooncake_verdict = (row.fragment_size >= TARGET_FROM && ratio.is_some())
        .then(|| Verdict::range_at_least(range, MOONCAKE_TARGET));
    row.mooncake_verified = verified;
}

const GIB: f64 = (1u64 << 30) as f64;

#[allow(clippy::too_many_arguments)] // One row's figures.
fn row(
    config: &RemoteBenchConfig,
    (protection, lanes): (Protection, usize),
    server: &'static str,
    shape: &RestoreShape,
    segments: usize,
    in_flight: usize,
    engine: &[f64],
    reference: &[f64],
    verified: bool,
) -> RemoteRow {
    let e = Timed::of(engine);
    let p = (!reference.is_empty()).then(|| Timed::of(reference));
    let ratio = p.filter(|p| p.median > 0.0).map(|p| e.median / p.median);
    let ratio_range = p.and(measure::ratio_range(engine, reference));
    let path = path_of(&config.transports);
    let verdict = (shape.page_size >= TARGET_FROM && ratio.is_some() && path == "one-sided")
        .then(|| Verdict::range_at_least(ratio_range, TARGET_RATIO));
    RemoteRow {
        row: "restore",
        transport: config.transports.clone(),
        path,
        protection: protection_name(protection),
        lanes,
        server,
        fragment_size: shape.page_size,
        objects: shape.objects,
        bytes: shape.bytes(),
        fragments: shape.fragments(),
        segments,
        in_flight,
        repeats: engine.len(),
        gib_s: e.median,
        gib_s_spread: e.spread,
        perftest_gib_s: p.map(|p| p.median),
        perftest_spread: p.map(|p| p.spread),
        ratio,
        ratio_range,
        verdict,
        verified,
        mooncake_gib_s: None,
        mooncake_spread: None,
        mooncake_ratio: None,
        mooncake_ratio_range: None,
        mooncake_verdict: None,
        mooncake_verified: None,
        mooncake_skipped: None,
    }
}

/// The human table: the restores, then the latency rows.
pub fn table(run: &RemoteRun) -> String {
    let rows = &run.restores;
    let mut out = String::new();
    let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".to_owned());
    if let Some(first) = rows.first() {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        let raw = if rows.iter().any(|r| r.perftest_gib_s.is_some()) {
            format!("`ucx_perftest -t ucp_get -O {}` moving the same bytes", first.in_flight)
        } else {
            "no raw one-sided reference (ucx_perftest not run)".to_owned()
        };
        let mooncake = match rows.iter().find_map(|r| r.mooncake_skipped.as_ref()) {
            None => format!(
                "Mooncake Transfer Engine {} (TCP, P2P handshake, batch_transfer_sync_read of \
                 the same fragments)",
                mooncake::VERSION
            ),
            Some(why) => format!("no Mooncake row ({why})"),
        };
        out += &format!(
            "remote restore over UCX ({}, {} server, {} path, {}): {} x 24 ranges of 1MiB \
             ({}), one request per scattered page; {} each, taking turns\n\
             peer: {mooncake}\n\
             raw one-sided path: {raw}\n\
             {}\n",
            first.transport,
            first.server,
            first.path,
            plural(first.lanes, "lane"),
            plural(first.objects, "object"),
            ByteSize(first.bytes),
            plural(first.repeats, "run"),
            measure::congestion_line(),
        );
        if first.path == "checked" {
            out += "  (umbp no longer offers the raw one-sided path over these transports: \
                    every read is a request the server checks; perftest's gets are that path's \
                    ceiling, shown beside it, no target)\n";
        }
        out += "\n";
    }
    out += &format!(
        "{:>9} {:>13} {:>6} {:>7} {:>6} {:>9} {:>6} {:>18} {:>12} {:>9} {:>6} {:>18} {:>12} {:>8}\n",
        "fragment",
        "channel",
        "gets",
        "GiB/s",
        "spread",
        "Mooncake",
        "spread",
        "vs Mooncake",
        "verdict",
        "raw 1-sd",
        "spread",
        "vs raw 1-sided",
        "verdict",
        "verified"
    );
    for r in rows {
        let verified = match (r.verified, r.mooncake_verified) {
            (false, _) => "NO",
            (true, Some(false)) => "peer NO",
            (true, _) => "yes",
        };
        out += &format!(
            "{:>9} {:>13} {:>6} {:>7.3} {:>5.0}% {:>9} {:>6} {:>18} {:>12} {:>9} {:>6} {:>18} {:>12} {:>8}\n",
            ByteSize(r.fragment_size).to_string(),
            r.protection,
            r.fragments,
            r.gib_s,
            r.gib_s_spread * 100.0,
            or_dash(r.mooncake_gib_s.map(|g| format!("{g:.3}"))),
            or_dash(r.mooncake_spread.map(|s| format!("{:.0}%", s * 100.0))),
            if r.mooncake_ratio.is_some() {
                range_text_2(r.mooncake_ratio, r.mooncake_ratio_range)
            } else {
                "-".into()
            },
            r.mooncake_verdict.map_or("-", Verdict::as_str),
            or_dash(r.perftest_gib_s.map(|g| format!("{g:.3}"))),
            or_dash(r.perftest_spread.map(|s| format!("{:.0}%", s * 100.0))),
            if r.ratio.is_some() { range_text_2(r.ratio, r.ratio_range) } else { "-".into() },
            r.verdict.map_or("-", Verdict::as_str),
            verified
        );
    }
    out += &format!(
        "\nGiB/s: median of the runs (build + submit + wait for the engine; one timed \
         batch_transfer_sync_read for Mooncake; perftest's overall bandwidth); spread: (fastest \
         - slowest) / median. Targets at {} and larger, met only when the whole range reaches \
         them: >= {MOONCAKE_TARGET} x Mooncake; >= {TARGET_RATIO} x ucx_perftest where the path \
         is one-sided.\n",
        ByteSize(TARGET_FROM)
    );
    if !run.latency.is_empty() {
        out += &format!(
            "\nsingle {} transfers one at a time (build + submit + wait), quiet and beside one \
             process spinning a CPU; Mooncake's transfer_sync_read of the same pages right \
             after, under the same load\n\n{:>9} {:>13} {:>9} {:>9} {:>9} {:>22} {:>9} {:>11} \
             {:>12} {:>8} {:>16} {:>16}\n",
            ByteSize(LATENCY_SIZE),
            "load",
            "channel",
            "transfers",
            "p50 µs",
            "p90 µs",
            "p99 µs [block range]",
            "max µs",
            "target p99",
            "verdict",
            "verified",
            "Mooncake p50 µs",
            "Mooncake p99 µs"
        );
        for l in &run.latency {
            let peer_verified = if l.mooncake_verified == Some(false) { " (NO)" } else { "" };
            out += &format!(
                "{:>9} {:>13} {:>9} {:>9.1} {:>9.1} {:>22} {:>9.1} {:>11} {:>12} {:>8} {:>16} {:>16}\n",
                l.load,
                l.protection,
                l.transfers,
                l.p50_us,
                l.p90_us,
                format!("{:.1} [{:.1}, {:.1}]", l.p99_us, l.p99_range[0], l.p99_range[1]),
                l.max_us,
                or_dash(l.target_p99_us.map(|t| format!("<= {t:.0}"))),
                l.verdict.map_or("-", Verdict::as_str),
                if l.verified { "yes" } else { "NO" },
                or_dash(l.mooncake_p50_us.map(|p| format!("{p:.1}{peer_verified}"))),
                or_dash(l.mooncake_p99_us.map(|p| format!("{p:.1}"))),
            );
        }
    }
    out
}

/// A ratio with its range, two decimals: `0.91 [0.78, 1.05]`.
fn range_text_2(ratio: Option<f64>, range: Option<[f64; 2]>) -> String {
    match (ratio, range) {
        (Some(r), Some([low, high])) => format!("{r:.2} [{low:.2}, {high:.2}]"),
        _ => range_text(ratio, range),
    }
}

/// The chart: the engine's GiB/s (one series per channel protection), Mooncake's and
/// perftest's, by fragment size.
pub fn chart(rows: &[RemoteRow]) -> BarChart {
    let mut chart = BarChart::new("Remote restore against Mooncake TE and ucx_perftest", "GiB/s");
    if let Some(first) = rows.first() {
        chart.subtitle = format!(
            "{} ({} path), {} scattered pages; perftest ucp_get -O {}; medians of {} runs",
            first.transport,
            first.path,
            ByteSize(first.bytes),
            first.in_flight,
            first.repeats
        );
    }
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.fragment_size).collect();
    sizes.dedup();
    let first_of = |size: u64| rows.iter().find(|r| r.fragment_size == size);
    chart.groups = sizes
        .iter()
        .map(|&size| match first_of(size).map(|r| (r.mooncake_ratio, r.ratio, r.protection)) {
            Some((Some(m), _, p)) => format!("{} ({m:.2}x Mooncake, {p})", ByteSize(size)),
            Some((None, Some(r), p)) => format!("{} ({r:.2}x perftest, {p})", ByteSize(size)),
            _ => ByteSize(size).to_string(),
        })
        .collect();
    let engine = |p: Protection| {
        let name = protection_name(p);
        let of = |size: u64| {
            rows.iter().find(|r| r.fragment_size == size && r.protection == name).map(|r| r.gib_s)
        };
        Series::new(format!("umbp-remote restore, {name}"), sizes.iter().map(|&s| of(s)).collect())
    };
    let peer = |f: fn(&RemoteRow) -> Option<f64>| -> Vec<Option<f64>> {
        sizes.iter().map(|&s| first_of(s).and_then(f)).collect()
    };
    chart.series = PROTECTIONS.iter().map(|&p| engine(p)).collect();
    chart.series.push(Series::new("Mooncake TE batch read", peer(|r| r.mooncake_gib_s)));
    chart.series.push(Series::new("ucx_perftest ucp_get", peer(|r| r.perftest_gib_s)));
    chart
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn scattered_pages_use_every_page_once_and_never_merge() {
        for (objects, page) in [(1, 1 << 20), (1, 64 << 10), (3, 4 << 10), (10, 256 << 10)] {
            let shape = RestoreShape { objects, ..RestoreShape::kimi_k3(page) };
            let pages = scattered_pages(&shape).unwrap();
            let n = shape.bytes() / page;
            assert_eq!(pages.len() as u64, n);
            let mut sorted = pages.clone();
            sorted.sort_unstable();
            assert!(sorted.iter().enumerate().all(|(i, &p)| p == i as u64 * page));
            // Pairs that follow each other in a destination are never adjacent in the arena.
            let per_object = shape.pages_per_object();
            let per_range = (shape.range_len / page) as usize;
            for r in 0..shape.ranges {
                let in_dst: Vec<u64> = (0..objects)
                    .flat_map(|b| (0..per_range).map(move |k| (b, k)))
                    .map(|(b, k)| pages[b * per_object + r * per_range + k])
                    .collect();
                assert!(in_dst.windows(2).all(|w| w[1] != w[0] + page), "{objects} x {page}");
            }
        }
    }

    #[test]
    fn the_pattern_checks_what_it_wrote() {
        let arena = patterned(4096 + 24);
        assert!(matches_pattern(&arena[64..1088], 64));
        assert!(!matches_pattern(&arena[64..1088], 72));
        assert!(matches_pattern(&arena[4096..], 4096));
    }

    #[test]
    fn rows_without_perftest_have_no_ratio_and_no_verdict() {
        let shape = RestoreShape { objects: 1, ..RestoreShape::kimi_k3(64 << 10) };
        let config = RemoteBenchConfig::default();
        let r = row(
            &config,
            (Protection::Encrypted, 2),
            "child",
            &shape,
            384,
            256,
            &[1.0, 1.2, 0.9],
            &[],
            true,
        );
        assert_eq!((r.ratio, r.ratio_range, r.verdict), (None, None, None));
        assert_eq!((r.gib_s, r.repeats, r.fragments), (1.0, 3, 384));
        let r = row(
            &config,
            (Protection::Encrypted, 2),
            "child",
            &shape,
            384,
            256,
            &[0.9, 1.0, 1.1],
            &[1.0, 1.2],
            true,
        );
        assert_eq!((r.path, r.verdict), ("checked", None), "no perftest target off one-sided");
        assert_eq!(r.ratio_range, Some([0.75, 1.1]), "the ratio is still reported beside it");
        let rdma = RemoteBenchConfig { transports: "rc_x,dc_x".into(), ..config.clone() };
        let r = row(
            &rdma,
            (Protection::Encrypted, 2),
            "child",
            &shape,
            384,
            256,
            &[0.9, 1.0, 1.1],
            &[1.0, 1.2],
            true,
        );
        assert_eq!(r.path, "one-sided");
        assert_eq!(r.verdict, Some(Verdict::WithinNoise), "0.8 lies in [0.75, 1.1]");
        let small = RestoreShape { page_size: 4 << 10, ..shape };
        let r = row(
            &rdma,
            (Protection::Encrypted, 2),
            "child",
            &small,
            6144,
            256,
            &[1.0],
            &[1.0],
            true,
        );
        assert_eq!((r.ratio, r.verdict), (Some(1.0), None), "no target below 64 KiB");
        let run = RemoteRun { restores: vec![r], latency: Vec::new() };
        assert!(table(&run).contains("4KiB"));
    }

    #[test]
    fn the_path_follows_umbp_remote_rule() {
        for (tls, path) in [
            ("tcp", "checked"),
            ("sm", "checked"),
            ("rc,sm", "checked"),
            ("", "checked"),
            ("rc", "one-sided"),
            ("rc_x, dc_mlx5", "one-sided"),
        ] {
            assert_eq!(path_of(tls), path, "{tls}");
        }
    }

    #[test]
    fn mooncake_figures_are_judged_over_their_range_and_skips_keep_why() {
        let shape = RestoreShape { objects: 1, ..RestoreShape::kimi_k3(64 << 10) };
        let config = RemoteBenchConfig::default();
        let engine = [0.9, 1.0, 1.1];
        let mut r =
            row(&config, (Protection::Encrypted, 2), "child", &shape, 384, 256, &engine, &[], true);
        add_mooncake(&mut r, &engine, &[0.5, 0.6, 0.7], Some(true), None);
        assert_eq!(r.mooncake_gib_s, Some(0.6));
        assert_eq!(r.mooncake_verdict, Some(Verdict::Met), "0.9 / 0.7 > 1.2");
        assert_eq!((r.mooncake_verified, r.mooncake_skipped.as_deref()), (Some(true), None));
        let mut r =
            row(&config, (Protection::Encrypted, 2), "child", &shape, 384, 256, &engine, &[], true);
        add_mooncake(&mut r, &engine, &[0.8, 0.85], Some(true), None);
        assert_eq!(r.mooncake_verdict, Some(Verdict::WithinNoise), "0.9 / 0.85 < 1.2 < 1.1 / 0.8");
        let mut r =
            row(&config, (Protection::Encrypted, 2), "child", &shape, 384, 256, &engine, &[], true);
        add_mooncake(&mut r, &engine, &[1.0, 1.05], Some(true), None);
        assert_eq!(r.mooncake_verdict, Some(Verdict::Unmet), "1.1 / 1.0 < 1.2");
        let mut r =
            row(&config, (Protection::Encrypted, 2), "child", &shape, 384, 256, &engine, &[], true);
        add_mooncake(&mut r, &engine, &[], None, Some("not installed".into()));
        assert_eq!((r.mooncake_gib_s, r.mooncake_verdict), (None, None));
        assert_eq!(r.mooncake_skipped.as_deref(), Some("not installed"));
        let json = serde_json::to_value(RemoteLine::Restore(&r)).unwrap();
        assert_eq!((&json["row"], &json["mooncake_ratio"]), (&"restore".into(), &json!(null)));
    }

    #[test]
    fn mooncake_reads_the_engine_s_pages_into_the_engine_s_offsets() {
        let shape = RestoreShape { objects: 2, ..RestoreShape::kimi_k3(256 << 10) };
        let pages = scattered_pages(&shape).unwrap();
        let (src, dst) = mooncake_fragments(&shape, &pages);
        assert_eq!((src.len(), dst.len()), (pages.len(), pages.len()));
        let mut sorted = src.clone();
        sorted.sort_unstable();
        let mut all = pages.clone();
        all.sort_unstable();
        assert_eq!(sorted, all, "every page read once");
        // Page 1 of range 3 of object 1 lands in destination 3 at 1 MiB + 256 KiB.
        let per_range = 4;
        let i = shape.ranges * per_range + 3 * per_range + 1;
        assert_eq!(src[i], pages[shape.pages_per_object() + 3 * per_range + 1]);
        assert_eq!(dst[i], (3 * 2 + 1) * (1 << 20) + (256 << 10));
    }

    #[test]
    fn single_transfers_stay_inside_the_arena_and_their_slots() {
        let (src, dst) = latency_offsets(24 << 20, 1 << 20, 2000);
        assert_eq!((src.len(), dst.len()), (2000 + LATENCY_WARMUP, 2000 + LATENCY_WARMUP));
        assert!(src.iter().all(|&s| s % LATENCY_SIZE == 0 && s + LATENCY_SIZE <= 24 << 20));
        assert!(dst.iter().all(|&d| d % LATENCY_SIZE == 0 && d < 64 * LATENCY_SIZE));
        let mut distinct = src.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), src.len(), "2,020 different pages of 6,144");
    }

    #[test]
    fn latency_rows_take_percentiles_and_judge_only_under_load() {
        let config = RemoteBenchConfig::default();
        // 100 samples: 1..=100 µs, one slow outlier of 5 ms in the last block.
        let mut times: Vec<f64> = (1..=100).map(f64::from).collect();
        times[99] = 5000.0;
        let quiet = latency_row(&config, Protection::Encrypted, "quiet", &times, true);
        assert_eq!((quiet.p50_us, quiet.p90_us, quiet.max_us), (51.0, 90.0, 5000.0));
        assert_eq!((quiet.target_p99_us, quiet.verdict), (None, None));
        let loaded = latency_row(&config, Protection::Encrypted, "spinning", &times, true);
        assert_eq!(loaded.p99_range, [20.0, 5000.0], "the blocks' p99s");
        assert_eq!(loaded.verdict, Some(Verdict::WithinNoise));
        let fast = latency_row(&config, Protection::Encrypted, "spinning", &[20.0; 50], true);
        assert_eq!(fast.verdict, Some(Verdict::Met));
        let json = serde_json::to_value(RemoteLine::Latency(&fast)).unwrap();
        assert_eq!((&json["row"], &json["load"]), (&"latency".into(), &"spinning".into()));
    }
}
