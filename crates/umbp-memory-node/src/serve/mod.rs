//! The `umbp-ucx-serve` command, a memory node as a service ([`main`]). Exports regions of this process's memory to other nodes'
//! umbp engines over UCX until SIGTERM or SIGINT, then drains and exits 0.
//!
//! `umbp-ucx-serve --help` lists every flag; docs/MEMORY-NODE.md shows a configuration file,
//! a systemd unit and a walkthrough with the Python side. The shared secret comes from
//! `--secret-file` (refused when other users may read it) or else from the environment
//! variable `UMBP_UCX_SECRET`; never from the command line, which other users of the machine
//! can read. Without one it refuses to start unless `--insecure-no-auth` says to serve
//! whoever connects; with one and `--insecure-no-auth` it refuses to start too, as the
//! library does: the two contradict each other.
//!
//! With `--pool redis://...` the node joins a umbp pool before it prints `listening`: each
//! writable region becomes a tier of `--pool-slot-size` slots (tier `i` is region `i`), the
//! node is announced under `--node-id` at `--advertise` and renewed from a thread, and a
//! signal makes it leave the pool (its blocks leave lookups at once) before it drains.
//!
//! Exit status: 0 after a drain, 1 when serving failed to start (or a second signal cut the
//! drain short; or the pool could not be joined), 2 for bad flags or configuration.
//!
//! For tests and benchmarks, `--bytes N` exports a writable region `arena` whose byte `i` is
//! `fill_byte(SEED, i)` (see [`fill_byte`]), and `--read-only-bytes` a read-only `ro` filled
//! the same way with `SEED + 1`.
//!
//! The binary `umbp-ucx-serve` of this crate and the Python package's console script of the
//! same name both run [`main`].

mod metrics;
mod settings;

use std::ffi::OsString;
use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM};
use umbp_pool::RedisIndex;
use umbp_remote::ServerBuilder;

use crate::Membership;

use settings::{Args, PoolSettings, RegionSpec, Settings};

/// Byte `i` of a region filled with `seed` (`--fill`): varies within and across pages.
pub fn fill_byte(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 12).wrapping_mul(31)).wrapping_add(usize::from(seed)) as u8
}

/// The memory behind one region: zeroed (pages come from the system as clients touch them)
/// or the test pattern. A size the system cannot reserve is an error, not an abort.
fn memory(r: &RegionSpec) -> Result<Vec<u8>, String> {
    let len = r.size as usize; // checked against usize by the settings
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(len).map_err(|e| format!("region `{}`: {e}", r.name))?;
    drop(probe);
    Ok(match r.fill {
        Some(seed) => (0..len).map(|i| fill_byte(seed, i)).collect(),
        None => vec![0u8; len],
    })
}

/// Connects to the pool's index and joins it with the writable `regions` of the server
/// bound to `bound`.
fn join(
    pool: &PoolSettings,
    bound: std::net::SocketAddr,
    regions: &[(String, u64, bool)],
) -> Result<Membership, String> {
    let config = pool.membership(bound)?;
    tracing::info!(pool = %pool.shown, name = %pool.redis.prefix, node = pool.node.0, address = %config.address, "joining the pool");
    let index = RedisIndex::connect(&pool.redis)
        .map_err(|e| format!("pool {}: {}", pool.shown, chain(&e)))?;
    Membership::join(Arc::new(index), config, regions)
        .map_err(|e| format!("joining the pool {}: {}", pool.shown, chain(&e)))
}

/// The error's words, then its causes'.
fn chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        message += &format!(": {c}");
        cause = c.source();
    }
    message
}

/// Runs the command with `args` (the program's name first, as [`std::env::args_os`] gives
/// them) until it stops, and returns its exit status (see the module: 0, 1 or 2). `--help`, `--version`
/// and flags clap cannot parse print and exit the process, as a command does. Installs the
/// log subscriber (RUST_LOG, default `info`, to standard error) unless the process has one,
/// and handlers for SIGTERM and SIGINT: call it from a process that is to become the
/// memory node, not from a program that goes on afterwards.
pub fn main<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args = Args::parse_from(args);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // A process that already has a subscriber keeps it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    let settings = match Settings::from_args(args) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("umbp-ucx-serve: {}", chain(&e));
            return 2;
        }
    };
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    match run(settings) {
        Ok(()) => 0,
        Err(message) => {
            eprintln!("umbp-ucx-serve: {message}");
            1
        }
    }
}

fn run(settings: Settings) -> Result<(), String> {
    // Signals first: one that arrives while the regions are allocated still drains. A second
    // one while draining exits at once.
    let term = Arc::new(AtomicBool::new(false));
    for signal in [SIGTERM, SIGINT] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, Arc::clone(&term))
            .and_then(|_| signal_hook::flag::register(signal, Arc::clone(&term)))
            .map_err(|e| format!("installing the signal handlers: {e}"))?;
    }
    if settings.ucx.insecure_no_auth && settings.ucx.secret.is_none() {
        tracing::warn!(
            listen = %settings.listen,
            "serving WITHOUT authentication: whoever reaches the port reads and writes the \
             exported regions"
        );
    }
    let mut builder = ServerBuilder::new(settings.ucx.clone());
    // A pool's clients reach this node as its node id: its welcome must name it.
    if let Some(pool) = &settings.pool {
        builder = builder.node(pool.node.0);
    }
    for r in &settings.regions {
        builder = builder.export(&r.name, memory(r)?, !r.read_only);
    }
    let server = builder.serve(settings.listen.as_str()).map_err(|e| chain(&e))?;
    let regions: Vec<_> = server.regions().to_vec();
    for (name, len, writable) in &regions {
        tracing::info!(region = %name, bytes = len, writable, "exported");
    }
    // Joined before `listening` is printed: a supervisor that waits for that line finds the
    // node in the pool.
    let membership = match &settings.pool {
        Some(pool) => Some(join(pool, server.local_addr(), &regions)?),
        None => None,
    };
    let stop_metrics = Arc::new(AtomicBool::new(false));
    let metrics = match &settings.metrics {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr.as_str())
                .map_err(|e| format!("metrics address {addr}: {e}"))?;
            let at = listener.local_addr().map_err(|e| format!("metrics address {addr}: {e}"))?;
            tracing::info!(%at, "metrics at http://{at}/metrics");
            println!("metrics {at}");
            let (stats, stop) = (server.stats(), Arc::clone(&stop_metrics));
            let pool = membership.as_ref().map(Membership::stats);
            Some(
                std::thread::Builder::new()
                    .name("umbp-ucx-metrics".into())
                    .spawn(move || metrics::serve(listener, stats, pool, regions, stop))
                    .map_err(|e| format!("metrics thread: {e}"))?,
            )
        }
        None => None,
    };
    println!("listening {}", server.local_addr());
    std::io::stdout().flush().ok();

    let stdin_closed = Arc::new(AtomicBool::new(false));
    if settings.exit_on_stdin_close {
        let closed = Arc::clone(&stdin_closed);
        std::thread::spawn(move || {
            for _ in std::io::stdin().lock().lines() {}
            closed.store(true, Ordering::Release);
        });
    }
    while !term.load(Ordering::Acquire) && !stdin_closed.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let why = if term.load(Ordering::Acquire) { "a signal" } else { "standard input closed" };
    let (clients, started) = (server.clients(), Instant::now());
    // Leave first: readers stop finding this node's blocks now, and the loads that leased one
    // before finish during the drain.
    if let Some(membership) = membership {
        let _ = membership.leave();
    }
    tracing::info!(clients, deadline = ?settings.drain_timeout, "draining on {why}");
    let stats = server.stats();
    drop(server.drain(settings.drain_timeout));
    stop_metrics.store(true, Ordering::Release);
    if let Some(metrics) = metrics {
        let _ = metrics.join();
    }
    let s = stats.read();
    tracing::info!(
        took = ?started.elapsed(),
        requests = s.requests,
        bytes_read = s.bytes_sent,
        bytes_written = s.bytes_received,
        "stopped"
    );
    Ok(())
}
