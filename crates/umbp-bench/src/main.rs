//! `umbp-bench`: measure the umbp transfer engines. Run with `--help` for the subcommands.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use umbp_bench::alloc_count::CountingAllocator;
use umbp_bench::copy_bench::{self, CopyBenchConfig};
use umbp_bench::hbm_bench::{self, HbmBenchConfig};
use umbp_bench::plan_bench::{self, PlanBenchConfig, PlanRow};
use umbp_bench::restore_bench::{self, RestoreBenchConfig};
use umbp_bench::size::ByteSize;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Measure the umbp transfer engines. Without a subcommand, runs the plan-building comparison
/// on its defaults.
#[derive(Parser, Debug)]
#[command(name = "umbp-bench", version)]
struct Cli {
    /// Print one JSON object per line instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plan building for the Kimi-K3 restore shape: buffered vs incremental vs a floor.
    Plan(PlanArgs),
    /// The host copy engine against one memcpy of the same bytes, and batch against single
    /// submits.
    Copy(CopyArgs),
    /// The device engine: one gather launch against one copy per fragment.
    Hbm(HbmArgs),
    /// The Kimi-K3 restore shape, scaled down, from DRAM, SSD and both into the simulated
    /// device through the composite engine.
    Restore(RestoreArgs),
}

#[derive(clap::Args, Debug)]
struct RestoreArgs {
    /// Objects of 24 MiB to restore (43 is about 1 GiB; the whole 999,936-token prefix is 651).
    #[arg(long, default_value_t = 43, value_parser = clap::value_parser!(u32).range(1..=651))]
    scale: u32,
    /// Fraction of objects the mixed run reads from SSD (0 to 1).
    #[arg(long, default_value_t = 0.5, value_parser = unit_fraction)]
    ssd_fraction: f64,
    /// Page size of both tiers (units allowed).
    #[arg(long, default_value = "64KiB")]
    page_size: ByteSize,
    /// Timed iterations per run; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    iterations: u32,
    /// Directory for the SSD tier's file (it is created and removed there).
    #[arg(long, default_value_os_t = std::env::temp_dir())]
    dir: std::path::PathBuf,
}

#[derive(clap::Args, Debug)]
struct CopyArgs {
    /// Fragment sizes to measure (units allowed).
    #[arg(long = "fragment-size", value_delimiter = ',', default_values = ["4KiB", "64KiB", "1MiB"])]
    fragment_sizes: Vec<ByteSize>,
    /// Bytes per batch.
    #[arg(long, default_value = "256MiB")]
    batch: ByteSize,
    /// Thread counts to measure (the engine's and the memcpy ceiling's).
    #[arg(long, value_delimiter = ',', default_values = ["1", "2"], value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: Vec<u32>,
    /// Timed iterations per measurement; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
}

#[derive(clap::Args, Debug)]
struct HbmArgs {
    /// Fragment sizes to measure (units allowed).
    #[arg(long = "fragment-size", value_delimiter = ',', default_values = ["4KiB", "16KiB", "64KiB", "256KiB"])]
    fragment_sizes: Vec<ByteSize>,
    /// Bytes per batch.
    #[arg(long, default_value = "64MiB")]
    batch: ByteSize,
    /// Timed iterations per mode; the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// Page sizes to measure (units allowed).
    #[arg(long = "page-size", value_delimiter = ',', default_values = ["64KiB", "32KiB"])]
    page_sizes: Vec<ByteSize>,
    /// Fraction of an object's consecutive pages placed adjacently in the arena (0 to 1).
    #[arg(long, default_value_t = 0.1, value_parser = unit_fraction)]
    contiguity: f64,
    /// Objects restored (651 is the Kimi-K3 999,936-token prefix).
    #[arg(long, default_value_t = 651, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    objects: u32,
    /// Timed iterations per builder; the median is reported.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..=1000))]
    iterations: u32,
    /// Untimed iterations before timing.
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Seed of the page layout.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the buffered builder (for profiling the incremental one).
    #[arg(long)]
    skip_buffered: bool,
}

impl Default for PlanArgs {
    fn default() -> Self {
        let d = PlanBenchConfig::default();
        Self {
            page_sizes: d.page_sizes.iter().map(|&b| ByteSize(b)).collect(),
            contiguity: d.contiguity,
            objects: d.objects as u32,
            iterations: d.iterations as u32,
            warmup: d.warmup as u32,
            seed: d.seed,
            skip_buffered: d.skip_buffered,
        }
    }
}

fn unit_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1"))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Plan(args)) => plan(&args, cli.json),
        Some(Command::Copy(args)) => copy(&args, cli.json),
        Some(Command::Hbm(args)) => hbm(&args, cli.json),
        Some(Command::Restore(args)) => restore(&args, cli.json),
        None => plan(&PlanArgs::default(), cli.json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("umbp-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn plan(args: &PlanArgs, json: bool) -> anyhow::Result<()> {
    if args.page_sizes.iter().any(|p| p.0 == 0) {
        eprintln!("umbp-bench: --page-size must be positive");
        std::process::exit(2);
    }
    let config = PlanBenchConfig {
        page_sizes: args.page_sizes.iter().map(|p| p.0).collect(),
        contiguity: args.contiguity,
        objects: args.objects as usize,
        iterations: args.iterations as usize,
        warmup: args.warmup as usize,
        seed: args.seed,
        skip_buffered: args.skip_buffered,
    };
    let rows = plan_bench::run(&config)?;
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
    } else {
        print_plan_table(&rows);
    }
    Ok(())
}

fn copy(args: &CopyArgs, json: bool) -> anyhow::Result<()> {
    if args.fragment_sizes.iter().any(|s| s.0 == 0) || args.batch.0 == 0 {
        eprintln!("umbp-bench: sizes must be positive");
        std::process::exit(2);
    }
    let config = CopyBenchConfig {
        fragment_sizes: args.fragment_sizes.iter().map(|s| s.0).collect(),
        batch_bytes: args.batch.0,
        threads: args.threads.iter().map(|&t| t as usize).collect(),
        iterations: args.iterations as usize,
        ..CopyBenchConfig::default()
    };
    let rows = copy_bench::run(&config);
    let submit = copy_bench::run_submit_overhead(&config);
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
        println!("{}", serde_json::to_string(&submit)?);
        return Ok(());
    }
    println!("host copy engine: scattered fragments against one memcpy of the same bytes\n");
    println!(
        "{:>9} {:>7} {:>10} {:>11} {:>7} {:>8}",
        "fragment", "threads", "engine GiB/s", "memcpy GiB/s", "ratio", "verified"
    );
    for r in &rows {
        println!(
            "{:>9} {:>7} {:>12.2} {:>12.2} {:>7.2} {:>8}",
            ByteSize(r.fragment_size).to_string(),
            r.threads,
            r.engine_gib_s,
            r.ceiling_gib_s,
            r.ratio,
            if r.verified { "yes" } else { "NO" }
        );
    }
    println!(
        "\n{} fragments of {}: one batch submit {:.1} ns of overhead per fragment, single \
         submits {:.1} ns: {:.1}x (submit and wait alone: {:.1} vs {:.1} ns, {:.1}x)",
        submit.fragments,
        ByteSize(submit.fragment_size),
        submit.batch_overhead_ns,
        submit.single_overhead_ns,
        submit.ratio,
        submit.batch_submit_overhead_ns,
        submit.single_submit_overhead_ns,
        submit.submit_ratio
    );
    Ok(())
}

fn restore(args: &RestoreArgs, json: bool) -> anyhow::Result<()> {
    let page = args.page_size.0;
    if page == 0 || !page.is_power_of_two() || (1 << 20) % page != 0 {
        eprintln!("umbp-bench: --page-size must be a power of two that divides 1 MiB");
        std::process::exit(2);
    }
    let config = RestoreBenchConfig {
        objects: args.scale as usize,
        page_size: page,
        ssd_fraction: args.ssd_fraction,
        iterations: args.iterations as usize,
        dir: args.dir.clone(),
        ..RestoreBenchConfig::default()
    };
    let rows = restore_bench::run(&config)?;
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
        return Ok(());
    }
    println!(
        "restore of the Kimi-K3 shape into the simulated device, {} objects of 24 MiB\n",
        config.objects
    );
    println!(
        "{:<10} {:<12} {:>7} {:>9} {:>8} {:>8} {:>8}",
        "source", "builder", "objects", "seconds", "GiB/s", "verified", "x slower half"
    );
    for r in &rows {
        let ratio = r.ratio_to_slower_half.map_or(String::new(), |x| format!("{x:.2}"));
        println!(
            "{:<10} {:<12} {:>7} {:>9.3} {:>8.2} {:>8} {:>8}",
            r.source,
            r.builder,
            r.objects,
            r.seconds,
            r.gib_s,
            if r.verified { "yes" } else { "NO" },
            ratio
        );
    }
    Ok(())
}

fn hbm(args: &HbmArgs, json: bool) -> anyhow::Result<()> {
    if args.fragment_sizes.iter().any(|s| s.0 == 0) || args.batch.0 == 0 {
        eprintln!("umbp-bench: sizes must be positive");
        std::process::exit(2);
    }
    let config = HbmBenchConfig {
        fragment_sizes: args.fragment_sizes.iter().map(|s| s.0).collect(),
        batch_bytes: args.batch.0,
        iterations: args.iterations as usize,
    };
    let rows = hbm_bench::run(&config);
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
        return Ok(());
    }
    let backend = rows.first().map_or("none", |r| r.backend);
    println!("device engine: gather kernel vs one copy per fragment, backend `{backend}`");
    if backend == "sim" {
        println!(
            "(simulated device: this measures descriptor building and CPU execution, not a GPU)"
        );
    }
    println!();
    println!(
        "{:>9} {:<7} {:>9} {:>8} {:>10} {:>8} {:>10} {:>8}",
        "fragment", "mode", "fragments", "launches", "ms/batch", "GiB/s", "x copies", "verified"
    );
    for r in &rows {
        println!(
            "{:>9} {:<7} {:>9} {:>8} {:>10.3} {:>8.2} {:>10.2} {:>8}",
            ByteSize(r.fragment_size).to_string(),
            r.mode,
            r.fragments,
            r.launches_per_batch,
            r.seconds * 1e3,
            r.gib_s,
            r.speedup_vs_copies,
            if r.verified { "yes" } else { "NO" }
        );
    }
    Ok(())
}

fn print_plan_table(rows: &[PlanRow]) {
    println!("plan building, Kimi-K3 restore shape (page walk + push + finish, no bytes move)\n");
    println!(
        "{:>9} {:<16} {:>9} {:>6} {:>9} {:>8} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "page",
        "builder",
        "fragments",
        "plans",
        "segments",
        "ns/frag",
        "median ms",
        "allocs",
        "faults",
        "x floor",
        "verified"
    );
    for r in rows {
        println!(
            "{:>9} {:<16} {:>9} {:>6} {:>9} {:>8.2} {:>9.3} {:>8.1} {:>8.1} {:>8.2} {:>8}",
            ByteSize(r.page_size).to_string(),
            r.builder,
            r.fragments,
            r.plans,
            r.segments,
            r.ns_per_fragment,
            r.median_ms,
            r.allocs_per_iter,
            r.minor_faults_per_iter,
            r.vs_floor,
            if r.verified { "yes" } else { "NO" }
        );
    }
    println!();
    for page_size in rows.iter().map(|r| r.page_size).collect::<std::collections::BTreeSet<_>>() {
        let get = |b: &str| rows.iter().find(|r| r.page_size == page_size && r.builder == b);
        if let (Some(inc), Some(buf)) = (get("incremental"), get("buffered")) {
            println!(
                "{:>9}: incremental {:.2} ns/fragment (budget 5), {:.2}x the floor (budget 3x), \
                 {:.1}x faster than buffered (target 3x), {:.0} allocs and {:.0} faults per plan; \
                 {:.0}% of pages adjacent",
                ByteSize(page_size).to_string(),
                inc.ns_per_fragment,
                inc.vs_floor,
                buf.median_ms / inc.median_ms,
                inc.allocs_per_iter,
                inc.minor_faults_per_iter,
                inc.adjacent_fraction * 100.0
            );
        }
    }
}
