//! `umbp-bench`: measure the umbp transfer engines. Run with `--help` for the subcommands.
//!
//! Exit status: 0 on success, 2 for a bad argument (one line on stderr, before anything runs),
//! 1 when a run fails (one line on stderr).

#[cfg(feature = "engines")]
use std::path::Path;
use std::path::PathBuf;
use std::process::ExitCode;

#[cfg(feature = "engines")]
use anyhow::Context;
use clap::error::ErrorKind;
use clap::{Parser, Subcommand};
use umbp_bench::alloc_count::CountingAllocator;
#[cfg(feature = "engines")]
use umbp_bench::batch_bench::{self, BatchBenchConfig, BatchEngine};
#[cfg(feature = "engines")]
use umbp_bench::churn_bench::{self, ChurnBenchConfig, ChurnTarget};
#[cfg(feature = "engines")]
use umbp_bench::copy_bench::{self, CopyBenchConfig};
#[cfg(feature = "engines")]
use umbp_bench::disk::Placement;
#[cfg(feature = "engines")]
use umbp_bench::hbm_bench::{self, HbmBackend, HbmBenchConfig};
#[cfg(feature = "engines")]
use umbp_bench::layers_bench::{self, LayersBenchConfig};
use umbp_bench::plan_bench::{self, PlanBenchConfig};
#[cfg(feature = "engines")]
use umbp_bench::pool_bench::{self, PoolBenchConfig};
use umbp_bench::progress::Progress;
#[cfg(feature = "engines")]
use umbp_bench::remote_bench::{self, RemoteBenchConfig, ServeConfig, ServerChoice};
use umbp_bench::report::Report;
#[cfg(feature = "engines")]
use umbp_bench::restore_bench::{self, RestoreBenchConfig};
use umbp_bench::size::ByteSize;
#[cfg(feature = "engines")]
use umbp_bench::ssd_bench::{self, SsdBenchConfig};
#[cfg(feature = "engines")]
use umbp_bench::ssd_report;
#[cfg(feature = "engines")]
use umbp_bench::tour::{self, TourConfig};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Measure the umbp transfer engines.
///
/// Without a subcommand, runs the tour: four parts (plan building for the Kimi-K3 shape, a
/// verified DRAM, SSD and mixed restore into the simulated device, batch against single
/// submits, and the remote engine where UCX loads), then one summary line per headline figure
/// and its target (15 to 40 seconds on a 2-core machine in a release build).
#[derive(Parser, Debug)]
#[command(name = "umbp-bench", version, about, long_about)]
#[command(after_help = "Every subcommand has its own --help. JSON field names are documented \
                        in crates/umbp-bench/README.md.")]
struct Cli {
    /// Print one JSON object per line (fields in the crate README) instead of tables, and no
    /// progress line. Default: tables.
    #[arg(long, global = true)]
    json: bool,
    /// Also write the JSON lines to DIR/<subcommand>.jsonl and a chart to DIR/<subcommand>.svg
    /// (DIR is created if missing; the tour writes one pair per part and tour.*). Default: no
    /// files.
    #[arg(long, global = true, value_name = "DIR")]
    out: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The default: four parts (plan building, a verified DRAM, SSD and mixed restore, batch
    /// vs single submits, the remote engine where UCX loads) at a small scale, then one
    /// summary line per headline figure and its target.
    #[cfg(feature = "engines")]
    Tour(TourArgs),
    /// Plan building for the Kimi-K3 restore shape: buffered vs incremental vs a floor.
    ///
    /// Page walk + push + finish for 651 objects x 24 ranges of 1 MiB (about 250k fragments at
    /// 64 KiB pages, 500k at 32 KiB), no bytes move. Targets: incremental at most 5 ns per
    /// fragment, within 3x of the floor, 3x faster than buffered, 0 allocations once warm.
    Plan(PlanArgs),
    /// The host copy engine against one memcpy of the same bytes, and batch against single
    /// submits.
    ///
    /// Targets: at 64 KiB fragments at least 90% of the memcpy ceiling with the same threads;
    /// batch submit at least 10x less overhead per fragment than single submits.
    #[cfg(feature = "engines")]
    Copy(CopyArgs),
    /// The device engine: one gather launch against one copy per fragment.
    ///
    /// Checks bytes, calibrates, measures the link ceiling, gather against copies, and a
    /// restore. `--backend auto` takes CUDA (`--features cuda`) or HIP (`--features hip`) when
    /// built in and a GPU answers, else the simulated device (which measures descriptor
    /// building and CPU execution only).
    #[cfg(feature = "engines")]
    Hbm(HbmArgs),
    /// Random O_DIRECT reads through the SSD engine against fio on the same file.
    ///
    /// For each block size: the engine at queue depth 1, the engine at its depth, and fio
    /// (io_uring engine, same file, block size and depths; skipped with a message when fio is
    /// not installed), taking turns, median of the repeats. The file lives in a temporary
    /// directory that is removed afterwards. Targets: at least 95% of fio at the same depth for
    /// 256 KiB reads; the engine at its depth at least 1.3x depth 1.
    #[cfg(feature = "engines")]
    Ssd(SsdArgs),
    /// The Kimi-K3 restore shape, scaled down, from DRAM, SSD and both into the simulated
    /// device through the composite engine.
    ///
    /// Every restore is verified byte for byte after timing. Target: the mixed restore takes at
    /// most 1.1x the slower of its two halves run alone (the engines overlap).
    #[cfg(feature = "engines")]
    Restore(RestoreArgs),
    /// A layer-wise restore: 61 layers in groups of 8, a forward pass that waits for each
    /// group and computes (spins) per layer, from DRAM, SSD and mixed into the simulated device.
    ///
    /// Blocking (restore, then forward) against layered (forward waits per group while the
    /// restore runs). Targets: layered time to the first group at most 0.25x the blocking
    /// restore; layered stall at most half the blocking stall.
    #[cfg(feature = "engines")]
    Layers(LayersArgs),
    /// One batch submit against one submit per transfer, for the host, simulated-device and
    /// SSD engines.
    ///
    /// 4,096 transfers of 4 KiB, one object each, planned with each engine's own builder: one
    /// plan set, one submit and one wait, against plan + submit + wait per transfer. Overhead
    /// per transfer: wall time minus a floor that copies the same bytes without an engine
    /// (localcopy, hbm-sim), plain wall time (ssd). Targets: at least 10x for localcopy and
    /// hbm-sim, 1.3x for ssd.
    #[cfg(feature = "engines")]
    Batch(BatchArgs),
    /// Register, restore, deregister, a million times over: whether a cycle costs the same
    /// after a million registrations as after ten, and memory stays flat.
    ///
    /// Each cycle registers a destination through a composite (host copy engine and simulated
    /// device), restores a few objects from a DRAM tier into it, waits and ends the
    /// registration. Time per cycle of the first --window timed cycles against the last, and
    /// resident memory after the warmup against the end. Targets: the last window at most
    /// 1.2x the first; resident memory grows at most 10%.
    #[cfg(feature = "engines")]
    Churn(ChurnArgs),
    /// A memory node: exports one writable region, `arena`, over UCX until stdin closes.
    ///
    /// The arena is filled with a pattern `remote` checks (byte i is byte i % 8 of the
    /// little-endian word (w x 0x9E3779B97F4A7C15) xor (w >> 7), w = i / 8). Prints
    /// `listening ADDR` on stdout once serving. With --perftest-port it also keeps a
    /// `ucx_perftest` server running for `remote --server`'s reference.
    #[cfg(feature = "engines")]
    Serve(ServeArgs),
    /// The remote memory engine (umbp-remote) restoring the Kimi-K3 shape from another process's
    /// memory, against Mooncake Transfer Engine and ucx_perftest moving the same bytes, and its
    /// single 4 KiB transfer latency, quiet and beside a spinning process.
    ///
    /// Starts `serve` as a child process on loopback (or uses a memory node, --server), and per
    /// fragment size restores --bytes of 24 MiB objects whose pages lie scattered over the
    /// server's arena (one request per page, none merged), timed end to end and verified byte
    /// for byte after timing, taking turns with Mooncake Transfer Engine's TCP transport
    /// reading the same fragments (installed by scripts/mooncake-venv into a cached venv;
    /// skipped with a message where it does not install) and `ucx_perftest -t ucp_get -O 256`
    /// (the raw one-sided path's ceiling; skipped with a message when not installed). Then
    /// --latency-transfers single 4 KiB transfers one at a time, quiet and beside one process
    /// spinning a CPU. Targets: at least 1.0x Mooncake at 64 KiB and larger; at least 0.8x
    /// perftest where the path is one-sided (RDMA); p99 at most 1 ms under load.
    #[cfg(feature = "engines")]
    Remote(RemoteArgs),
    /// The pool's index (umbp-pool) beside Mooncake Store on the same work, in alternating
    /// rounds.
    ///
    /// A batched lookup of --keys keys (62,500: the 999,936-token prefix) through umbp's Redis
    /// index on loopback (a redis-server the bench starts), umbp's embedded index and Mooncake
    /// Store's batch_is_exist (its master and a memory-holding client on loopback, TCP
    /// transport; skipped with a message where scripts/mooncake-venv does not install); the
    /// embedded index's durable publish rate; the time from reopening an embedded index of
    /// --restart-blocks durable blocks to its first SSD hit, read and verified. Targets:
    /// lookup through Redis at most 5 ms and at least 1.0x Mooncake's; embedded lookup at most
    /// 2 ms; publish at least 100k blocks/s.
    #[cfg(feature = "engines")]
    Pool(PoolArgs),
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug, Default)]
struct TourArgs {
    /// Run every part at a tiny scale (a few seconds; for tests and smoke checks, the figures
    /// mean little). Default: the embedded defaults.
    #[arg(long)]
    tiny: bool,
    /// Directory for the temporary SSD files (a temporary directory is created in it and
    /// removed afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// Page sizes to measure, comma-separated (units allowed; a power of two from 4KiB to
    /// 1MiB).
    #[arg(long = "page-size", value_delimiter = ',', default_values = ["64KiB", "32KiB"], value_parser = page_size)]
    page_sizes: Vec<ByteSize>,
    /// Fraction of an object's consecutive pages placed adjacently in the arena (0 to 1).
    #[arg(long, default_value_t = 0.1, value_parser = unit_fraction)]
    contiguity: f64,
    /// Objects restored (651 is the Kimi-K3 999,936-token prefix).
    #[arg(long, default_value_t = 651, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    objects: u32,
    /// Timed iterations per builder; the median is reported.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
    /// Untimed iterations before timing.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1000))]
    warmup: u32,
    /// Seed of the page layout.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the buffered builder (for profiling the incremental one). Default: measured.
    #[arg(long)]
    skip_buffered: bool,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct CopyArgs {
    /// Fragment sizes of the throughput comparison, comma-separated (units allowed).
    #[arg(long = "fragment-size", value_delimiter = ',', default_values = ["4KiB", "64KiB", "1MiB"], value_parser = positive_size)]
    fragment_sizes: Vec<ByteSize>,
    /// Bytes per throughput batch (units allowed).
    #[arg(long, default_value = "256MiB", value_parser = positive_size)]
    batch: ByteSize,
    /// Thread counts to measure, comma-separated (the engine's, caller included, and the
    /// memcpy ceiling's; clamped to the machine).
    #[arg(long, value_delimiter = ',', default_values = ["1", "2"], value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: Vec<u32>,
    /// Timed iterations per throughput measurement; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
    /// Fragments of the submit-overhead comparison (each its own object).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    submit_fragments: u32,
    /// Fragment size of the submit-overhead comparison (units allowed).
    #[arg(long, default_value = "4KiB", value_parser = positive_size)]
    submit_size: ByteSize,
    /// Timed iterations of each submit-overhead path; medians are reported.
    #[arg(long, default_value_t = 51, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    submit_iterations: u32,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct HbmArgs {
    /// The device runtime: `cuda` and `hip` need the matching feature (and a GPU).
    #[arg(long, value_enum, default_value = "auto")]
    backend: HbmBackend,
    /// Fragment sizes to measure, comma-separated (units allowed).
    #[arg(long = "fragment-size", value_delimiter = ',', default_values = ["4KiB", "16KiB", "32KiB", "64KiB", "128KiB", "256KiB"], value_parser = positive_size)]
    fragment_sizes: Vec<ByteSize>,
    /// Bytes per batch (units allowed).
    #[arg(long, default_value = "64MiB", value_parser = positive_size)]
    batch: ByteSize,
    /// Timed iterations per mode; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
    /// Objects of the Kimi-K3-shaped restore (24 MiB each); 0 skips it.
    #[arg(long, default_value_t = 8)]
    restore_objects: usize,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct SsdArgs {
    /// Size of the test file (units allowed).
    #[arg(long, default_value = "1GiB", value_parser = positive_size)]
    file_size: ByteSize,
    /// Read sizes, comma-separated (units allowed; multiples of 8 bytes, at most the file
    /// size).
    #[arg(long = "block-size", value_delimiter = ',', default_values = ["256KiB", "4KiB"], value_parser = positive_size)]
    block_sizes: Vec<ByteSize>,
    /// The engine's (and fio's) batched queue depth.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    queue_depth: u32,
    /// Seconds each measurement runs.
    #[arg(long, default_value_t = 3.0, value_parser = seconds)]
    seconds: f64,
    /// Measurements per row, taken in turns with the other rows; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
    /// Skip the fio rows. Default: run fio when it is installed.
    #[arg(long)]
    no_fio: bool,
    /// Where the engine's worker and fio run, both alike: `completions` (pinned to the CPU
    /// that takes the disk's completion interrupts, found by a probe read), a CPU number, or
    /// `none` (unpinned).
    #[arg(long, default_value = "completions", value_parser = placement)]
    cpu: Placement,
    /// Directory for the test file, on the SSD to measure (a temporary directory is created
    /// in it and removed afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Seed of the random offsets.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also measure block-aligned writes through the engine (`engine-write`), into a second
    /// file of --file-size. Default: off.
    #[arg(long)]
    writes: bool,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct RestoreArgs {
    /// Objects of 24 MiB to restore (43 is about 1 GiB; the whole 999,936-token prefix is 651).
    #[arg(long, default_value_t = 43, value_parser = clap::value_parser!(u32).range(1..=651))]
    scale: u32,
    /// Fraction of objects the mixed run reads from SSD (0 to 1).
    #[arg(long, default_value_t = 0.5, value_parser = unit_fraction)]
    ssd_fraction: f64,
    /// Page size of both tiers (units allowed; a power of two from 4KiB to 1MiB).
    #[arg(long, default_value = "64KiB", value_parser = page_size)]
    page_size: ByteSize,
    /// Timed iterations per run; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    iterations: u32,
    /// Caller counts of the many-callers sweep, comma-separated: N threads share one
    /// composite, each restoring its own share of the objects (counts above 1 add DRAM and
    /// mixed rows). Target: 16 callers reach at least 0.9x one caller's GiB/s.
    #[arg(long, value_delimiter = ',', default_values = ["1", "4", "16"], value_parser = clap::value_parser!(u32).range(1..=64))]
    callers: Vec<u32>,
    /// Where the SSD engine's workers and fio run, both alike: `completions` (pinned to the
    /// CPU that takes the disk's completion interrupts, found by a probe read), a CPU number,
    /// or `none` (unpinned).
    #[arg(long, default_value = "completions", value_parser = placement)]
    cpu: Placement,
    /// Skip the fio runs the SSD restore alternates with. Default: run fio when it is
    /// installed.
    #[arg(long)]
    no_fio: bool,
    /// Directory for the SSD tier's file (a temporary directory is created in it and removed
    /// afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Rounds of the checksum rows (`dram-crc`, `ssd-crc`): each round restores the objects
    /// once verifying every object's CRC32C and once not, in turns; 0 skips the rows.
    /// Targets: verification costs at most 5% of the DRAM restore's time, 2% of the SSD's.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=1000))]
    checksum_rounds: u32,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct LayersArgs {
    /// Objects of 24 MiB to restore.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=651))]
    scale: u32,
    /// Fraction of objects the mixed run reads from SSD (0 to 1).
    #[arg(long, default_value_t = 0.5, value_parser = unit_fraction)]
    ssd_fraction: f64,
    /// Page size of both tiers (units allowed; a power of two from 4KiB to 1MiB).
    #[arg(long, default_value = "64KiB", value_parser = page_size)]
    page_size: ByteSize,
    /// Compute per layer in microseconds. Default: each source's blocking restore time over
    /// 61, measured in the same run, so the forward pass is as long as the blocking restore.
    #[arg(long)]
    compute_us: Option<f64>,
    /// Timed iterations of each mode (alternating); medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    iterations: u32,
    /// Directory for the SSD tier's file (a temporary directory is created in it and removed
    /// afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct ChurnArgs {
    /// Timed register/restore/deregister cycles.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(20..=100_000_000))]
    cycles: u64,
    /// Cycles of each compared window (the first and the last; a multiple of 10, at most half
    /// of --cycles).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(10..=50_000_000))]
    window: u64,
    /// Untimed cycles before timing.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    warmup: u64,
    /// Objects restored per cycle (4 pages each).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1024))]
    objects: u32,
    /// Page size of the tier (units allowed).
    #[arg(long, default_value = "4KiB", value_parser = positive_size)]
    page_size: ByteSize,
    /// Where each cycle's destination lives: a host buffer, or simulated device memory.
    #[arg(long, value_enum, default_value = "host")]
    to: ChurnTarget,
    /// Seed of the page placement and the data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct BatchArgs {
    /// Engines to compare, comma-separated.
    #[arg(long = "engine", value_delimiter = ',', default_values = ["localcopy", "hbm-sim", "ssd"])]
    engines: Vec<BatchEngine>,
    /// Transfers per run (each its own object).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    transfers: u32,
    /// Bytes per transfer (units allowed).
    #[arg(long, default_value = "4KiB", value_parser = positive_size)]
    transfer_size: ByteSize,
    /// Timed iterations of each path for localcopy and hbm-sim; medians are reported.
    #[arg(long, default_value_t = 51, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    iterations: u32,
    /// Timed iterations of each path for ssd; medians are reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    ssd_iterations: u32,
    /// Directory for the SSD engine's file (a temporary directory is created in it and removed
    /// afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Seed of the scattered source slots and the data.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Address of the control connection, host:port (port 0 picks a free one; to serve other
    /// nodes, the address of the interface they reach, e.g. 10.0.0.2:7400). Only clients
    /// holding the shared secret in UMBP_UCX_SECRET (16 bytes or more; serve refuses to start
    /// without one) are served, but what travels after the handshake is not encrypted.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Bytes of the exported arena (units allowed; `remote` needs its --bytes rounded down to
    /// whole 24 MiB objects).
    #[arg(long, default_value = "256MiB", value_parser = positive_size)]
    bytes: ByteSize,
    /// UCX transports, in UCX_TLS's syntax (tcp, sm, rc,sm, ^ib...). Default: the
    /// environment's UCX_TLS, else UCX's own choice.
    #[arg(long, value_name = "TLS")]
    transports: Option<String>,
    /// Also keep a `ucx_perftest -p PORT` server running (restarted after each client run)
    /// with the same transports, for `remote --server`'s reference. Default: none.
    #[arg(long, value_name = "PORT")]
    perftest_port: Option<u16>,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct RemoteArgs {
    /// UCX transports of the engine, the server and ucx_perftest, in UCX_TLS's syntax.
    #[arg(long, value_name = "TLS", default_value = "tcp")]
    transports: String,
    /// Fragment (page) sizes, comma-separated (units allowed; a power of two from 4KiB to
    /// 1MiB): one one-sided get each.
    #[arg(long = "fragment-sizes", visible_alias = "fragment-size", value_delimiter = ',', default_values = ["64KiB", "256KiB", "1MiB"], value_parser = page_size)]
    fragment_sizes: Vec<ByteSize>,
    /// Bytes restored per run (units allowed), rounded down to whole objects of 24 MiB (at
    /// least one); perftest moves the same.
    #[arg(long, default_value = "240MiB", value_parser = positive_size)]
    bytes: ByteSize,
    /// Timed runs of the engine and of ucx_perftest per fragment size, taking turns; medians
    /// and spreads are reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeats: u32,
    /// One object (24 MiB) and one run each, whatever --bytes and --repeats say (for tests and
    /// smoke checks; the figures mean little). Default: off.
    #[arg(long)]
    tiny: bool,
    /// A memory node running `umbp-bench serve` (its `listening` address) instead of a child
    /// process on loopback; its --bytes must hold the restore, and the reference needs its
    /// --perftest-port. Default: a child process.
    #[arg(long, value_name = "ADDR")]
    server: Option<String>,
    /// With --server: the port of the node's ucx_perftest server (`serve --perftest-port`).
    /// Without --server a free port is picked.
    #[arg(long, value_name = "PORT", default_value_t = 13337)]
    perftest_port: u16,
    /// Skip the ucx_perftest reference (no ratio, no verdict). Default: run it when
    /// ucx_perftest is installed.
    #[arg(long)]
    no_perftest: bool,
    /// Skip Mooncake Transfer Engine (its fields say why). Default: run it, from the venv
    /// scripts/mooncake-venv installs (or the python UMBP_MOONCAKE_PYTHON names).
    #[arg(long)]
    no_mooncake: bool,
    /// Single 4 KiB transfers timed one at a time, quiet and again under load (0: no latency
    /// rows; --tiny takes at most 100).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    latency_transfers: u32,
    /// Connections the engine opens to the server (umbp-remote's `RemoteConfig::lanes`): each
    /// puts one more core on each side to sealing and opening the bytes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    lanes: u16,
}

#[cfg(feature = "engines")]
#[derive(clap::Args, Debug)]
struct PoolArgs {
    /// Keys of the batched lookup (62,500: the 999,936-token prefix in 16-token blocks).
    #[arg(long, default_value_t = 62_500, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    keys: u32,
    /// Lookup rounds (one lookup per system per round, the order rotating), after one
    /// untimed warm-up round.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    rounds: u32,
    /// Blocks per publish call of the publish rate.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    publish_batch: u32,
    /// Rounds of the publish rate (each publishes --keys blocks into a fresh file).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    publish_rounds: u32,
    /// Durable blocks in the restarted embedded index.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    restart_blocks: u32,
    /// Restarts timed.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    restarts: u32,
    /// Blocks per put and per get between this process and the memory node (0: no put/get
    /// rows).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    transfer_blocks: u32,
    /// Block sizes of the put/get rows, comma-separated (units allowed; a power of two from
    /// 4KiB to 1MiB).
    #[arg(long = "block-size", value_delimiter = ',', default_values = ["64KiB", "1MiB"], value_parser = page_size)]
    block_sizes: Vec<ByteSize>,
    /// Rounds of the put/get rows (after one untimed warm-up round).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    transfer_rounds: u32,
    /// A tiny run (2,000 keys, 3 rounds, 5,000 blocks restarted: seconds; for tests and smoke
    /// checks, the figures mean little). Default: off.
    #[arg(long)]
    tiny: bool,
    /// Skip Mooncake Store (no comparison). Default: run it, from the venv
    /// scripts/mooncake-venv installs (or the python UMBP_MOONCAKE_PYTHON names).
    #[arg(long)]
    no_mooncake: bool,
    /// Directory for the index files and the restart's sparse SSD tier file (a temporary
    /// directory is created in it and removed afterwards).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: PathBuf,
    /// Connections each pool's engine opens to the memory node (umbp-remote's
    /// `RemoteConfig::lanes`), as `remote --lanes`.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    lanes: u16,
}

fn unit_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1"))
    }
}

#[cfg(feature = "engines")]
fn positive_size(s: &str) -> Result<ByteSize, String> {
    let size: ByteSize = s.parse()?;
    if size.0 == 0 {
        return Err("the size must be positive".into());
    }
    Ok(size)
}

#[cfg(feature = "engines")]
fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if v > 0.0 && v <= 3600.0 {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 (excluded) and 3600"))
    }
}

#[cfg(feature = "engines")]
fn placement(s: &str) -> Result<Placement, String> {
    match s {
        "completions" => Ok(Placement::Completions),
        "none" => Ok(Placement::Unpinned),
        cpu => match cpu.parse::<usize>() {
            Ok(cpu) if cpu < 1024 => Ok(Placement::Cpu(cpu)),
            _ => Err(format!("`{s}` is not `completions`, `none` or a CPU number below 1024")),
        },
    }
}

fn page_size(s: &str) -> Result<ByteSize, String> {
    let size: ByteSize = s.parse()?;
    if !size.0.is_power_of_two() || !(4 << 10..=1 << 20).contains(&size.0) {
        return Err(format!("{size} is not a power of two from 4KiB to 1MiB"));
    }
    Ok(size)
}

/// Prints a bad-argument error as one line and exits with status 2.
fn usage_error(message: &str) -> ! {
    eprintln!("umbp-bench: {message} (see --help)");
    std::process::exit(2)
}

/// Parses the command line; help and version print and exit 0, errors print one line and exit
/// 2.
fn parse() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => match e.kind() {
            ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => e.exit(),
            _ => usage_error(&one_line(&e.render().to_string())),
        },
    }
}

/// The first paragraph of clap's error, on one line, without its `error: ` prefix.
fn one_line(rendered: &str) -> String {
    let first: Vec<&str> =
        rendered.lines().map(str::trim).take_while(|line| !line.is_empty()).collect();
    let joined = first.join(" ");
    joined.strip_prefix("error: ").unwrap_or(&joined).to_owned()
}

/// Physical memory in bytes, from `/proc/meminfo` (`None` where unreadable).
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Rejects (exit 2) settings whose run would need more memory than the machine has.
fn check_memory(needed: u64, what: &str) {
    if let Some(total) = physical_memory() {
        if needed > total / 10 * 9 {
            usage_error(&format!(
                "{what} needs about {} of memory; this machine has {}",
                human_bytes(needed),
                human_bytes(total)
            ));
        }
    }
}

fn human_bytes(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Prints the crates' `tracing` events on stderr, filtered by `RUST_LOG` (`warn` when unset);
/// `docs/OBSERVABILITY.md` lists the targets and levels.
fn install_log_subscriber() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn main() -> ExitCode {
    let cli = parse();
    install_log_subscriber();
    if let Some(dir) = &cli.out {
        // Before any run, so a bad --out costs no measuring time.
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("umbp-bench: --out {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    // `serve` runs until stdin closes and has no steps to show.
    #[cfg(feature = "engines")]
    let serving = matches!(cli.command, Some(Command::Serve(_)));
    #[cfg(not(feature = "engines"))]
    let serving = false;
    let progress = Progress::on_stderr(!cli.json && !serving);
    let out = Output { json: cli.json, dir: cli.out.clone(), progress: &progress };
    let result = match cli.command {
        #[cfg(feature = "engines")]
        None => tour(&TourArgs { tiny: false, dir: std::env::temp_dir() }, &out),
        #[cfg(feature = "engines")]
        Some(Command::Tour(args)) => tour(&args, &out),
        Some(Command::Plan(args)) => plan(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Copy(args)) => copy(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Hbm(args)) => hbm(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Ssd(args)) => ssd(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Restore(args)) => restore(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Layers(args)) => layers(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Batch(args)) => batch(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Churn(args)) => churn(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Serve(args)) => serve(&args),
        #[cfg(feature = "engines")]
        Some(Command::Remote(args)) => remote(&args, &out),
        #[cfg(feature = "engines")]
        Some(Command::Pool(args)) => pool(&args, &out),
        #[cfg(not(feature = "engines"))]
        None => Err(anyhow::anyhow!(
            "built without the `engines` feature, so only `plan` is here; the tour and the \
             other subcommands need the default features"
        )),
    };
    drop(progress);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            let message = format!("{e:#}").replace('\n', " ");
            eprintln!("umbp-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Where results go: stdout (table or JSON lines) and, with `--out`, files.
struct Output<'a> {
    json: bool,
    dir: Option<PathBuf>,
    progress: &'a Progress,
}

impl Output<'_> {
    /// Prints `report`, then saves it under `--out` if given.
    fn emit(&self, report: &Report) -> anyhow::Result<()> {
        self.progress.suspend(|| report.print(self.json, &mut std::io::stdout().lock()))?;
        self.save(report)
    }

    fn save(&self, report: &Report) -> anyhow::Result<()> {
        if let Some(dir) = &self.dir {
            let written = report.save(dir)?;
            if !self.json {
                let names: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
                let message = format!("umbp-bench: wrote {}", names.join(" and "));
                // Above the progress line, not over it.
                self.progress.suspend(|| eprintln!("{message}"));
            }
        }
        Ok(())
    }
}

#[cfg(feature = "engines")]
fn tour(args: &TourArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    let remote_server = std::env::current_exe().ok();
    let config = TourConfig { tiny: args.tiny, dir: args.dir.clone(), remote_server };
    let mut part_done = |report: Report| -> anyhow::Result<()> {
        if out.json {
            // JSON mode prints the summary lines only; the parts' lines go to --out.
            out.save(&report)
        } else {
            out.emit(&report)?;
            out.progress.suspend(|| println!());
            Ok(())
        }
    };
    let result = tour::run(&config, out.progress, &mut part_done)?;
    out.emit(&tour::report(&result)?)
}

fn plan(args: &PlanArgs, out: &Output<'_>) -> anyhow::Result<()> {
    let config = PlanBenchConfig {
        page_sizes: args.page_sizes.iter().map(|p| p.0).collect(),
        contiguity: args.contiguity,
        objects: args.objects as usize,
        iterations: args.iterations as usize,
        warmup: args.warmup as usize,
        seed: args.seed,
        skip_buffered: args.skip_buffered,
    };
    let smallest = config.page_sizes.iter().copied().min().unwrap_or(64 << 10);
    let fragments = u64::from(args.objects) * (24 << 20) / smallest;
    // Page table, buffered items and plans: well under 100 bytes per fragment.
    check_memory(fragments * 100, "--objects with this --page-size");
    let rows = plan_bench::run(&config, out.progress)?;
    out.emit(&Report::new("plan", &rows, plan_bench::table(&rows), Some(plan_bench::chart(&rows)))?)
}

#[cfg(feature = "engines")]
fn copy(args: &CopyArgs, out: &Output<'_>) -> anyhow::Result<()> {
    let config = CopyBenchConfig {
        fragment_sizes: args.fragment_sizes.iter().map(|s| s.0).collect(),
        batch_bytes: args.batch.0,
        threads: args.threads.iter().map(|&t| t as usize).collect(),
        iterations: args.iterations as usize,
        submit_fragments: args.submit_fragments as usize,
        submit_fragment_size: args.submit_size.0,
        submit_iterations: args.submit_iterations as usize,
        ..CopyBenchConfig::default()
    };
    check_memory(2 * args.batch.0, "--batch");
    let submit_bytes = u64::from(args.submit_fragments).saturating_mul(args.submit_size.0);
    check_memory(2 * submit_bytes, "--submit-fragments x --submit-size");
    let rows = copy_bench::run(&config, out.progress);
    let submit = copy_bench::run_submit_overhead(&config, out.progress);
    let mut report = Report::new(
        "copy",
        &rows,
        copy_bench::table(&rows, &submit),
        Some(copy_bench::chart(&rows)),
    )?;
    report.json_lines.push(serde_json::to_string(&submit)?);
    out.emit(&report)
}

#[cfg(feature = "engines")]
fn hbm(args: &HbmArgs, out: &Output<'_>) -> anyhow::Result<()> {
    let config = HbmBenchConfig {
        backend: args.backend,
        fragment_sizes: args.fragment_sizes.iter().map(|s| s.0).collect(),
        batch_bytes: args.batch.0,
        iterations: args.iterations as usize,
        restore_objects: args.restore_objects,
        ..HbmBenchConfig::default()
    };
    // Arenas of twice the batch on host and device (the simulated device's is host memory),
    // plus destinations, plus the restore's tier and its copies.
    check_memory(8 * args.batch.0 + 3 * args.restore_objects as u64 * (24 << 20), "--batch");
    let report = hbm_bench::run(&config, out.progress)?;
    let table = hbm_bench::table(&report);
    let chart = hbm_bench::chart(&report);
    let mut emitted = Report::new("hbm", &report.rows, table, Some(chart))?;
    let mut first = Vec::new();
    for c in &report.calibration {
        first.push(serde_json::to_string(c)?);
    }
    for c in &report.checks {
        first.push(serde_json::to_string(c)?);
    }
    emitted.json_lines.splice(0..0, first);
    out.emit(&emitted)
}

#[cfg(feature = "engines")]
fn ssd(args: &SsdArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    for block in &args.block_sizes {
        if block.0 % 8 != 0 || block.0 > args.file_size.0 {
            usage_error(&format!(
                "--block-size {block} must be a multiple of 8 bytes and at most --file-size {}",
                args.file_size
            ));
        }
    }
    let largest = args.block_sizes.iter().map(|b| b.0).max().unwrap_or(0);
    // The engine reads into a ring of max(2 x depth, 64) block-sized slots.
    let slots = u64::from(args.queue_depth * 2).max(64);
    check_memory(slots.saturating_mul(largest), "--queue-depth x --block-size");
    let config = SsdBenchConfig {
        file_size: args.file_size.0,
        dir: Some(args.dir.clone()),
        block_sizes: args.block_sizes.iter().map(|b| b.0).collect(),
        queue_depth: args.queue_depth,
        seconds: args.seconds,
        repeats: args.repeats as usize,
        fio: !args.no_fio,
        placement: args.cpu,
        seed: args.seed,
        writes: args.writes,
    };
    let rows_per_size = (if args.no_fio { 2 } else { 6 }) + usize::from(args.writes);
    let estimate = args.block_sizes.len() as f64
        * rows_per_size as f64
        * f64::from(args.repeats)
        * args.seconds;
    out.progress.section("ssd", 1);
    out.progress.step(format!("{} file, about {estimate:.0}s of reads", args.file_size));
    let rows = ssd_bench::try_run(&config)?;
    out.emit(&Report::new("ssd", &rows, ssd_report::table(&rows), Some(ssd_report::chart(&rows)))?)
}

#[cfg(feature = "engines")]
fn restore(args: &RestoreArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    let config = RestoreBenchConfig {
        objects: args.scale as usize,
        page_size: args.page_size.0,
        ssd_fraction: args.ssd_fraction,
        iterations: args.iterations as usize,
        dir: args.dir.clone(),
        callers: args.callers.iter().map(|&c| c as usize).collect(),
        placement: args.cpu,
        fio: !args.no_fio,
        checksum_rounds: args.checksum_rounds as usize,
        ..RestoreBenchConfig::default()
    };
    // The DRAM tier, the destinations in simulated device memory, and a read-back for
    // verification, plus the 16 MiB bounce region.
    check_memory(u64::from(args.scale) * (24 << 20) * 5 / 2 + (16 << 20), "--scale");
    let rows = restore_bench::run(&config, out.progress)?;
    out.emit(&Report::new(
        "restore",
        &rows,
        restore_bench::table(&rows),
        Some(restore_bench::chart(&rows)),
    )?)
}

#[cfg(feature = "engines")]
fn layers(args: &LayersArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    if args.compute_us.is_some_and(|us| !(0.0..=1e7).contains(&us)) {
        usage_error("--compute-us must be between 0 and 10,000,000");
    }
    let config = LayersBenchConfig {
        restore: RestoreBenchConfig {
            objects: args.scale as usize,
            page_size: args.page_size.0,
            ssd_fraction: args.ssd_fraction,
            iterations: args.iterations as usize,
            dir: args.dir.clone(),
            ..RestoreBenchConfig::default()
        },
        compute_us: args.compute_us,
        ..LayersBenchConfig::default()
    };
    check_memory(u64::from(args.scale) * (24 << 20) * 5 / 2 + (16 << 20), "--scale");
    let rows = layers_bench::run(&config, out.progress)?;
    out.emit(&Report::new(
        "layers",
        &rows,
        layers_bench::table(&rows),
        Some(layers_bench::chart(&rows)),
    )?)
}

#[cfg(feature = "engines")]
fn churn(args: &ChurnArgs, out: &Output<'_>) -> anyhow::Result<()> {
    if args.window % 10 != 0 || args.window.saturating_mul(2) > args.cycles {
        usage_error(&format!(
            "--window {} must be a multiple of 10 and at most half of --cycles {}",
            args.window, args.cycles
        ));
    }
    let config = ChurnBenchConfig {
        cycles: args.cycles as usize,
        window: args.window as usize,
        warmup: args.warmup as usize,
        objects: args.objects as usize,
        page_size: args.page_size.0,
        target: args.to,
        seed: args.seed,
    };
    // The tier and one destination, plus the expected bytes.
    let bytes = args.page_size.0.saturating_mul(12 * u64::from(args.objects));
    check_memory(bytes, "--objects x --page-size");
    let row = churn_bench::run(&config, out.progress)?;
    out.emit(&Report::new("churn", std::slice::from_ref(&row), churn_bench::table(&row), None)?)
}

#[cfg(feature = "engines")]
fn batch(args: &BatchArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    let mut engines = args.engines.clone();
    engines.dedup();
    let config = BatchBenchConfig {
        engines,
        transfers: args.transfers as usize,
        transfer_size: args.transfer_size.0,
        iterations: args.iterations as usize,
        ssd_iterations: args.ssd_iterations as usize,
        dir: args.dir.clone(),
        seed: args.seed,
    };
    check_memory(
        4 * u64::from(args.transfers).saturating_mul(args.transfer_size.0),
        "--transfers x --transfer-size",
    );
    let rows = batch_bench::run(&config, out.progress)?;
    out.emit(&Report::new(
        "batch",
        &rows,
        batch_bench::table(&rows),
        Some(batch_bench::chart(&rows)),
    )?)
}

#[cfg(feature = "engines")]
fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    let config = ServeConfig {
        listen: args.listen.clone(),
        bytes: args.bytes.0,
        transports: args.transports.clone(),
        perftest_port: args.perftest_port,
    };
    let serving = remote_bench::Serving::start(&config)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening {}", serving.addr())?;
    stdout.flush()?;
    drop(stdout);
    // Serve until whoever started us closes our standard input (or exits).
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
    }
    drop(serving);
    Ok(())
}

#[cfg(feature = "engines")]
fn remote(args: &RemoteArgs, out: &Output<'_>) -> anyhow::Result<()> {
    let server = match &args.server {
        Some(addr) => ServerChoice::Node { addr: addr.clone(), perftest_port: args.perftest_port },
        #[cfg(feature = "engines")]
        None => ServerChoice::Child {
            program: std::env::current_exe().context("finding the umbp-bench binary")?,
        },
    };
    let (bytes, repeats) = if args.tiny { (OBJECT_BYTES, 1) } else { (args.bytes.0, args.repeats) };
    let latency = if args.tiny { args.latency_transfers.min(100) } else { args.latency_transfers };
    let objects = (bytes / OBJECT_BYTES).max(1);
    // The destinations here, the child's arena on the same machine, and Mooncake's two.
    let copies = if args.server.is_some() { 1 } else { 2 } + if args.no_mooncake { 0 } else { 2 };
    check_memory(copies * objects * OBJECT_BYTES, "--bytes");
    let config = RemoteBenchConfig {
        server,
        transports: args.transports.clone(),
        fragment_sizes: args.fragment_sizes.iter().map(|s| s.0).collect(),
        objects: objects as usize,
        repeats: repeats as usize,
        perftest: !args.no_perftest,
        mooncake: !args.no_mooncake,
        latency_transfers: latency as usize,
        lanes: usize::from(args.lanes),
    };
    let run = remote_bench::run(&config, out.progress)?;
    out.emit(&Report::new(
        "remote",
        &run.lines(),
        remote_bench::table(&run),
        Some(remote_bench::chart(&run.restores)),
    )?)
}

#[cfg(feature = "engines")]
fn pool(args: &PoolArgs, out: &Output<'_>) -> anyhow::Result<()> {
    check_dir(&args.dir)?;
    let mut config = PoolBenchConfig {
        keys: args.keys as usize,
        rounds: args.rounds as usize,
        publish_batch: args.publish_batch as usize,
        publish_blocks: args.keys as usize,
        publish_rounds: args.publish_rounds as usize,
        restart_blocks: args.restart_blocks as usize,
        restarts: args.restarts as usize,
        dir: args.dir.clone(),
        mooncake: !args.no_mooncake,
        transfer_blocks: args.transfer_blocks as usize,
        transfer_sizes: args.block_sizes.iter().map(|s| s.0).collect(),
        transfer_rounds: args.transfer_rounds as usize,
        lanes: usize::from(args.lanes),
        ..PoolBenchConfig::default()
    };
    if args.tiny {
        config.transfer_blocks = config.transfer_blocks.min(64);
        config.transfer_sizes.truncate(1);
        config.transfer_rounds = 1;
        config.keys = config.keys.min(2_000);
        config.publish_blocks = config.keys;
        config.rounds = config.rounds.min(3);
        config.publish_rounds = config.publish_rounds.min(2);
        config.restart_blocks = config.restart_blocks.min(5_000);
        config.restarts = config.restarts.min(2);
    }
    // The put/get rows hold the largest size's blocks four times over: the memory node's
    // arena and Mooncake's segment (each with a quarter to spare), this process's buffer and
    // Mooncake's client's buffer.
    let largest = config.transfer_sizes.iter().copied().max().unwrap_or(0);
    check_memory(
        (config.transfer_blocks as u64).saturating_mul(largest).saturating_mul(18) / 4,
        "--transfer-blocks x --block-size",
    );
    let (rows, skipped) = pool_bench::run(&config, out.progress)?;
    if out.json {
        for s in &skipped {
            eprintln!("umbp-bench pool: skipped {s}");
        }
    }
    out.emit(&Report::new("pool", &rows, pool_bench::table(&rows, &skipped), None)?)
}

#[cfg(feature = "engines")]
/// Bytes of one Kimi-K3 object: 24 ranges of 1 MiB.
const OBJECT_BYTES: u64 = 24 << 20;

#[cfg(feature = "engines")]
/// A `--dir` that does not exist is a runtime error (exit 1) with its path.
fn check_dir(dir: &Path) -> anyhow::Result<()> {
    let meta = std::fs::metadata(dir).with_context(|| format!("--dir {}", dir.display()))?;
    anyhow::ensure!(meta.is_dir(), "--dir {} is not a directory", dir.display());
    Ok(())
}

// The tests parse every subcommand: they need the default features.
#[cfg(all(test, feature = "engines"))]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("umbp-bench").chain(args.iter().copied()))
    }

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_arguments_run_the_tour_with_tables() {
        let cli = parse(&[]).unwrap();
        assert!(cli.command.is_none() && !cli.json && cli.out.is_none());
        let Some(Command::Tour(t)) = parse(&["tour", "--tiny", "--json"]).unwrap().command else {
            panic!("tour expected")
        };
        assert!(t.tiny);
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let Some(Command::Plan(p)) = parse(&["plan"]).unwrap().command else { panic!() };
        assert_eq!(p.page_sizes, [ByteSize(64 << 10), ByteSize(32 << 10)]);
        assert_eq!((p.contiguity, p.objects, p.iterations, p.warmup), (0.1, 651, 9, 3));
        let Some(Command::Copy(c)) = parse(&["copy"]).unwrap().command else { panic!() };
        assert_eq!(c.fragment_sizes, [ByteSize(4 << 10), ByteSize(64 << 10), ByteSize(1 << 20)]);
        assert_eq!((c.batch, c.threads.as_slice()), (ByteSize(256 << 20), &[1, 2][..]));
        assert_eq!((c.submit_fragments, c.submit_size), (4096, ByteSize(4096)));
        let Some(Command::Hbm(h)) = parse(&["hbm"]).unwrap().command else { panic!() };
        assert_eq!(h.fragment_sizes.len(), 6);
        assert_eq!((h.backend, h.restore_objects), (HbmBackend::Auto, 8));
        assert_eq!(h.batch, ByteSize(64 << 20));
        let Some(Command::Ssd(s)) = parse(&["ssd"]).unwrap().command else { panic!() };
        assert_eq!(s.block_sizes, [ByteSize(256 << 10), ByteSize(4 << 10)]);
        assert_eq!((s.file_size, s.queue_depth, s.seconds), (ByteSize(1 << 30), 64, 3.0));
        assert_eq!((s.repeats, s.no_fio, s.cpu), (3, false, Placement::Completions));
        let Some(Command::Restore(r)) = parse(&["restore"]).unwrap().command else { panic!() };
        assert_eq!((r.scale, r.ssd_fraction, r.page_size), (43, 0.5, ByteSize(64 << 10)));
        assert_eq!(
            (r.callers.as_slice(), r.cpu, r.no_fio),
            (&[1, 4, 16][..], Placement::Completions, false)
        );
        let Some(Command::Layers(l)) = parse(&["layers"]).unwrap().command else { panic!() };
        assert_eq!((l.scale, l.ssd_fraction, l.compute_us, l.iterations), (16, 0.5, None, 3));
        let Some(Command::Batch(b)) = parse(&["batch"]).unwrap().command else { panic!() };
        assert_eq!(b.engines, BatchEngine::ALL);
        assert_eq!((b.transfers, b.transfer_size), (4096, ByteSize(4096)));
        let Some(Command::Serve(v)) = parse(&["serve"]).unwrap().command else { panic!() };
        assert_eq!((v.listen.as_str(), v.bytes), ("127.0.0.1:0", ByteSize(256 << 20)));
        assert_eq!((v.transports, v.perftest_port), (None, None));
        let Some(Command::Remote(r)) = parse(&["remote"]).unwrap().command else { panic!() };
        assert_eq!(r.fragment_sizes, [ByteSize(64 << 10), ByteSize(256 << 10), ByteSize(1 << 20)]);
        assert_eq!((r.transports.as_str(), r.bytes, r.repeats), ("tcp", ByteSize(240 << 20), 5));
        assert_eq!((r.tiny, r.server, r.perftest_port, r.no_perftest), (false, None, 13337, false));
        assert_eq!((r.no_mooncake, r.latency_transfers), (false, 2000));
    }

    #[test]
    fn sizes_take_units_and_globals_go_anywhere() {
        let cli =
            parse(&["batch", "--transfer-size", "16KiB", "--engine", "ssd,localcopy", "--json"]);
        let cli = cli.unwrap();
        assert!(cli.json);
        let Some(Command::Batch(b)) = cli.command else { panic!() };
        assert_eq!(b.transfer_size, ByteSize(16 << 10));
        assert_eq!(b.engines, [BatchEngine::Ssd, BatchEngine::LocalCopy]);
        let cli = parse(&["--out", "charts", "hbm", "--batch", "1.5MiB"]).unwrap();
        assert_eq!(cli.out, Some(PathBuf::from("charts")));
        let Some(Command::Hbm(h)) = cli.command else { panic!() };
        assert_eq!(h.batch, ByteSize(3 << 19));
        for (value, placement) in [("none", Placement::Unpinned), ("3", Placement::Cpu(3))] {
            let Some(Command::Ssd(s)) = parse(&["ssd", "--cpu", value]).unwrap().command else {
                panic!()
            };
            assert_eq!(s.cpu, placement);
        }
    }

    #[test]
    fn bad_values_are_rejected_by_the_parser() {
        for args in [
            &["plan", "--page-size", "48KiB"][..],
            &["plan", "--page-size", "12XB"],
            &["plan", "--contiguity", "1.5"],
            &["copy", "--threads", "0"],
            &["copy", "--batch", "0"],
            &["restore", "--scale", "652"],
            &["batch", "--engine", "gpu"],
            &["batch", "--transfer-size", "-4KiB"],
            &["ssd", "--seconds", "0"],
            &["ssd", "--queue-depth", "5000"],
            &["ssd", "--cpu", "1024"],
            &["ssd", "--cpu", "irq"],
            &["remote", "--fragment-sizes", "48KiB"],
            &["remote", "--repeats", "0"],
            &["serve", "--bytes", "0"],
            &["nonsense"],
        ] {
            assert!(parse(args).is_err(), "{args:?}");
        }
    }

    #[test]
    fn errors_become_one_line() {
        let e = parse(&["plan", "--bogus"]).unwrap_err();
        let line = one_line(&e.render().to_string());
        assert!(!line.contains('\n') && line.contains("--bogus"), "{line}");
        let e = parse(&["copy", "--batch", "12XB"]).unwrap_err();
        let line = one_line(&e.render().to_string());
        assert!(!line.contains('\n') && line.contains("`12XB` is not a size"), "{line}");
    }
}
