//! `umbp-bench serve` and `umbp-bench remote`: the remote memory engine (`umbp-ucx`) restoring
//! the Kimi-K3 shape from another process's memory, against `ucx_perftest` moving the same
//! bytes in the same run.
//!
//! # `serve`: the memory node
//!
//! A [`UcxServer`] exporting one writable region, [`ARENA`], of `bytes` bytes filled with
//! [`pattern_word`]: byte `i` of the arena is byte `i % 8` of the little-endian word
//! `pattern_word(i / 8)`, so a client checks any range it read without a copy of the arena.
//! With a perftest port it also keeps a `ucx_perftest -p PORT` server running (restarted after
//! every client run), so that a client node measures the reference against the same node.
//!
//! # `remote`: the client
//!
//! Starts `serve` as a child process on loopback (or connects to a memory node's, `server`),
//! connects a [`UcxEngine`] and, for each fragment size, restores `objects` objects of the
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
//! - `-O` = the engine's [`UcxConfig::max_in_flight`] (256): perftest's default keeps one get
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
    EndpointRegistry, PageWalk, PlanBuilder, PlanSet, Register, Registration, Tag, TransferEngine,
};
use umbp_ucx::{ServerBuilder, UcxBuilder, UcxConfig, UcxEngine, UcxServer};

use crate::chart::{BarChart, Series};
use crate::host_buffer::HostBuffer;
use crate::measure::{self, range_text, Timed, Verdict};
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

/// What a destination holds before the verification restore.
const POISON: u8 = 0xA5;

/// The shared secret of the memory node and the client (umbp-ucx serves only peers that prove
/// it): `UMBP_UCX_SECRET` when set (a node started elsewhere needs the same), else one drawn
/// for this run from the process's random hash keys and handed to the child server.
fn secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        std::env::var(umbp_ucx::SECRET_ENV).unwrap_or_else(|_| {
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
    server: UcxServer,
}

impl Serving {
    /// Fills the arena and starts serving it.
    pub fn start(config: &ServeConfig) -> anyhow::Result<Self> {
        umbp_ucx::ucx_available().context("UCX is not usable here")?;
        let len = usize::try_from(config.bytes).context("--bytes does not fit in memory")?;
        ensure!(len > 0, "the arena must not be empty");
        let ucx = UcxConfig { transports: config.transports.clone(), ..UcxConfig::default() };
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
        }
    }
}

/// One fragment size: the engine's restore against perftest's gets.
#[derive(Clone, Debug, Serialize)]
pub struct RemoteRow {
    /// UCX transports (`UCX_TLS`) of both.
    pub transport: String,
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
    /// `ratio` against 0.8 for fragments of 64 KiB and larger: `met`, `unmet` or `within
    /// noise`; `null` below 64 KiB and without perftest.
    pub verdict: Option<Verdict>,
    /// Every object completed and every destination byte matched the arena after timing.
    pub verified: bool,
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
struct ChildServer {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: SocketAddr,
    /// What the child wrote on stderr, for errors.
    stderr: Option<JoinHandle<String>>,
}

impl ChildServer {
    fn start(
        program: &Path,
        config: &RemoteBenchConfig,
        bytes: u64,
        perftest_port: Option<u16>,
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(program);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--bytes", &bytes.to_string()])
            .args(["--transports", &config.transports])
            .env(umbp_ucx::SECRET_ENV, secret());
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
    engine: UcxEngine,
}

impl Client {
    fn connect(
        addr: SocketAddr,
        config: &RemoteBenchConfig,
        shape: &RestoreShape,
    ) -> anyhow::Result<Self> {
        let engine = UcxEngine::new(
            EndpointRegistry::new(),
            UcxConfig::with_transports(&config.transports).with_secret(secret()),
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
        Ok(Self { destinations, buffers, remote, engine })
    }

    /// Plans the restore of every object of `shape` from `pages`.
    fn build(
        &self,
        builder: &mut UcxBuilder,
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
        builder: &mut UcxBuilder,
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
}

/// Runs the comparison: starts or reaches the server, then one row per fragment size.
pub fn run(config: &RemoteBenchConfig, progress: &Progress) -> anyhow::Result<Vec<RemoteRow>> {
    ensure!(config.objects > 0 && config.objects <= u32::MAX as usize, "at least one object");
    ensure!(!config.fragment_sizes.is_empty(), "no fragment size to measure");
    for &size in &config.fragment_sizes {
        ensure!(
            size.is_power_of_two() && (4 << 10..=1 << 20).contains(&size),
            "fragment size {} is not a power of two from 4KiB to 1MiB",
            ByteSize(size)
        );
    }
    umbp_ucx::ucx_available().context("UCX is not usable here")?;
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
    progress.section("remote", 1 + config.fragment_sizes.len() * (1 + repeats));
    progress.step(format!("starting the server ({})", ByteSize(base.bytes())));
    let (server, addr, perftest_port, server_kind) = match &config.server {
        ServerChoice::Child { program } => {
            let port = if with_perftest { Some(free_port()?) } else { None };
            let child = ChildServer::start(program, config, base.bytes(), port)?;
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
    let mut client = Client::connect(addr, config, &base)?;
    let in_flight = client.engine.config().max_in_flight;
    let perftest_host = addr.ip().to_string();
    let mut builder = client.engine.incremental_builder();
    let mut rows = Vec::new();
    for &fragment_size in &config.fragment_sizes {
        let shape = RestoreShape { page_size: fragment_size, ..base };
        let pages = scattered_pages(&shape)?;
        let fragments = shape.fragments();
        let label = ByteSize(fragment_size);
        progress.step(format!("{label}: warm-up restore"));
        let (_, plans) = client.restore(&mut builder, &shape, &pages)?;
        let segments = plans.segment_count();
        ensure!(
            segments as u64 == fragments,
            "{label}: {fragments} fragments planned as {segments} requests: the layout merged some"
        );
        builder.recycle(plans);
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
        let (mut engine_gib_s, mut perftest_gib_s) = (Vec::new(), Vec::new());
        for repeat in 0..repeats {
            progress.step(format!("{label}: engine and perftest, round {}/{repeats}", repeat + 1));
            for side in [repeat % 2, (repeat + 1) % 2] {
                if side == 0 {
                    let (seconds, plans) = client.restore(&mut builder, &shape, &pages)?;
                    builder.recycle(plans);
                    engine_gib_s.push(shape.bytes() as f64 / seconds / GIB);
                } else if with_perftest {
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
                }
            }
        }
        client.poison();
        let (_, plans) = client.restore(&mut builder, &shape, &pages)?;
        builder.recycle(plans);
        let verified = client.verify(&shape, &pages);
        rows.push(row(
            config,
            server_kind,
            &shape,
            segments,
            in_flight,
            &engine_gib_s,
            &perftest_gib_s,
            verified,
        ));
    }
    drop(builder);
    drop(client);
    drop(server);
    Ok(rows)
}

const GIB: f64 = (1u64 << 30) as f64;

#[allow(clippy::too_many_arguments)] // One row's figures.
fn row(
    config: &RemoteBenchConfig,
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
    let verdict = (shape.page_size >= TARGET_FROM && ratio.is_some())
        .then(|| Verdict::range_at_least(ratio_range, TARGET_RATIO));
    RemoteRow {
        transport: config.transports.clone(),
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
    }
}

/// The human table.
pub fn table(rows: &[RemoteRow]) -> String {
    let mut out = String::new();
    if let Some(first) = rows.first() {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        let reference = if rows.iter().any(|r| r.perftest_gib_s.is_some()) {
            format!(
                "against `ucx_perftest -t ucp_get -O {}` moving the same bytes",
                first.in_flight
            )
        } else {
            "no reference (ucx_perftest not run)".to_owned()
        };
        out += &format!(
            "remote restore over UCX ({}, {} server): {} x 24 ranges of 1MiB ({}), one get per \
             scattered page,\n{reference}; {} each, taking turns\n\n",
            first.transport,
            first.server,
            plural(first.objects, "object"),
            ByteSize(first.bytes),
            plural(first.repeats, "run"),
        );
    }
    out += &format!(
        "{:>9} {:>7} {:>8} {:>7} {:>14} {:>7} {:>20} {:>12} {:>8}\n",
        "fragment",
        "gets",
        "GiB/s",
        "spread",
        "perftest GiB/s",
        "spread",
        "ratio [range]",
        "verdict",
        "verified"
    );
    let or_dash = |x: Option<String>| x.unwrap_or_else(|| "-".to_owned());
    for r in rows {
        out += &format!(
            "{:>9} {:>7} {:>8.3} {:>6.0}% {:>14} {:>7} {:>20} {:>12} {:>8}\n",
            ByteSize(r.fragment_size).to_string(),
            r.fragments,
            r.gib_s,
            r.gib_s_spread * 100.0,
            or_dash(r.perftest_gib_s.map(|g| format!("{g:.3}"))),
            or_dash(r.perftest_spread.map(|s| format!("{:.0}%", s * 100.0))),
            if r.ratio.is_some() { range_text_2(r.ratio, r.ratio_range) } else { "-".into() },
            r.verdict.map_or("-", Verdict::as_str),
            if r.verified { "yes" } else { "NO" }
        );
    }
    out += &format!(
        "\nGiB/s: median of the runs (build + submit + wait for the engine; perftest's overall \
         bandwidth); spread: (fastest - slowest) / median. Target: ratio >= {TARGET_RATIO} at \
         {} and larger, met only when the whole range reaches it.\n",
        ByteSize(TARGET_FROM)
    );
    out
}

/// A ratio with its range, two decimals: `0.91 [0.78, 1.05]`.
fn range_text_2(ratio: Option<f64>, range: Option<[f64; 2]>) -> String {
    match (ratio, range) {
        (Some(r), Some([low, high])) => format!("{r:.2} [{low:.2}, {high:.2}]"),
        _ => range_text(ratio, range),
    }
}

/// The chart: the engine's and perftest's GiB/s by fragment size.
pub fn chart(rows: &[RemoteRow]) -> BarChart {
    let mut chart = BarChart::new("Remote restore over UCX against ucx_perftest", "GiB/s");
    if let Some(first) = rows.first() {
        chart.subtitle = format!(
            "{}, {} scattered one-sided gets; perftest ucp_get -O {}; medians of {} runs",
            first.transport,
            ByteSize(first.bytes),
            first.in_flight,
            first.repeats
        );
    }
    chart.groups = rows
        .iter()
        .map(|r| match r.ratio {
            Some(ratio) => format!("{} ({ratio:.2}x)", ByteSize(r.fragment_size)),
            None => ByteSize(r.fragment_size).to_string(),
        })
        .collect();
    chart.series = vec![
        Series::new("umbp-ucx restore", rows.iter().map(|r| Some(r.gib_s)).collect()),
        Series::new("ucx_perftest ucp_get", rows.iter().map(|r| r.perftest_gib_s).collect()),
    ];
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let r = row(&config, "child", &shape, 384, 256, &[1.0, 1.2, 0.9], &[], true);
        assert_eq!((r.ratio, r.ratio_range, r.verdict), (None, None, None));
        assert_eq!((r.gib_s, r.repeats, r.fragments), (1.0, 3, 384));
        let r = row(&config, "child", &shape, 384, 256, &[0.9, 1.0, 1.1], &[1.0, 1.2], true);
        assert_eq!(r.verdict, Some(Verdict::WithinNoise), "0.8 lies in [0.75, 1.1]");
        let small = RestoreShape { page_size: 4 << 10, ..shape };
        let r = row(&config, "child", &small, 6144, 256, &[1.0], &[1.0], true);
        assert_eq!((r.ratio, r.verdict), (Some(1.0), None), "no target below 64 KiB");
        assert!(table(&[r]).contains("4KiB"));
    }
}
