//! `umbp-bench batch`: one batch submit against one submit per transfer, for each engine.
//!
//! For each engine, [`transfers`](BatchBenchConfig::transfers) transfers of
//! [`transfer_size`](BatchBenchConfig::transfer_size) bytes (4,096 of 4 KiB by default), each
//! its own object, from source slots in shuffled order into consecutive destination slots (as
//! scattered pages of a pool restore into one buffer), run two ways
//! with the engine's own incremental builder (reused, recycled after every submit):
//!
//! - **batch**: every transfer planned into one plan set, one submit, one wait;
//! - **single**: per transfer, plan (begin, push, commit, finish), submit, wait.
//!
//! The engines and their transfers:
//!
//! - `localcopy`: host to host; the engine runs on the calling thread with plain stores, the
//!   same copy as its floor;
//! - `hbm-sim`: pinned host memory to the simulated device's memory (the batch is one gather
//!   launch; a single transfer is one copy);
//! - `ssd`: random 4 KiB-aligned reads of a file (`O_DIRECT` where the filesystem takes it) in
//!   a temporary directory, removed afterwards, into aligned host memory.
//!
//! **Overhead.** For `localcopy` and `hbm-sim` the bytes move on the CPU, so the run also times
//! a *floor*: the same transfers copied with `copy_nonoverlapping` between host buffers, no
//! engine. Their overhead per transfer is a path's wall time minus the floor's, per transfer,
//! taking the median over the iterations of the difference within each iteration (floor, batch
//! and single run back to back in every iteration, so drift of a shared machine cancels).
//! For `ssd` the device's own service time cannot be told apart from the engine's, so its
//! figures are plain wall time per transfer. Rows say which in `overhead`. `ratio` is single
//! over batch. A batch overhead that does not stand above its own noise (half the
//! interquartile range of the per-iteration differences; see [`crate::measure`]) has no
//! value: the row prints `below noise` with the noise as a bound, no ratio, and no met target.
//!
//! Targets: `ratio` at least 10 for `localcopy` and `hbm-sim`, at least 1.3 for `ssd`. Every
//! path is verified after timing: destinations are poisoned, the path runs once more, and every
//! byte is compared with its source.

use std::hint::black_box;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{
    DeviceOrdinal, EndpointRegistry, FileOptions, FileSource, Fragment, PlanBuilder, PlanSet,
    Register, Tag, TransferEngine,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

use crate::chart::{BarChart, Series};
use crate::host_buffer::HostBuffer;
use crate::measure::{ratio_text, verdict_text, Difference, Timed, Verdict};
use crate::progress::Progress;
use crate::shape::SplitMix;
use crate::size::ByteSize;

/// An engine the comparison runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum BatchEngine {
    /// The host copy engine (`umbp-localcopy`).
    #[value(name = "localcopy")]
    LocalCopy,
    /// The device engine on the simulated device (`umbp-hbm`).
    #[value(name = "hbm-sim")]
    HbmSim,
    /// The io_uring file engine (`umbp-ssd`).
    #[value(name = "ssd")]
    Ssd,
}

impl BatchEngine {
    /// Every engine, in the order the command runs them.
    pub const ALL: [Self; 3] = [Self::LocalCopy, Self::HbmSim, Self::Ssd];

    /// The engine's name in rows: `localcopy`, `hbm-sim` or `ssd`.
    pub fn name(self) -> &'static str {
        match self {
            Self::LocalCopy => "localcopy",
            Self::HbmSim => "hbm-sim",
            Self::Ssd => "ssd",
        }
    }

    /// The least `ratio` the engine should reach: 10 for host and device engines, 1.3 for SSD.
    pub fn target_ratio(self) -> f64 {
        match self {
            Self::LocalCopy | Self::HbmSim => 10.0,
            Self::Ssd => 1.3,
        }
    }
}

/// Settings of `umbp-bench batch`.
#[derive(Clone, Debug)]
pub struct BatchBenchConfig {
    /// Engines to compare. Default all three.
    pub engines: Vec<BatchEngine>,
    /// Transfers per run. Default 4096.
    pub transfers: usize,
    /// Bytes per transfer. Default 4 KiB.
    pub transfer_size: u64,
    /// Timed iterations of each path for `localcopy` and `hbm-sim`; medians are reported.
    /// Default 51.
    pub iterations: usize,
    /// Timed iterations of each path for `ssd` (a single-submit run waits on 4,096 reads one
    /// after another). Default 5.
    pub ssd_iterations: usize,
    /// Directory in which the SSD run's temporary directory and file are created.
    pub dir: PathBuf,
    /// Seed of the scattered source slots and the data.
    pub seed: u64,
}

impl Default for BatchBenchConfig {
    fn default() -> Self {
        Self {
            engines: BatchEngine::ALL.to_vec(),
            transfers: 4096,
            transfer_size: 4 << 10,
            iterations: 51,
            ssd_iterations: 5,
            dir: std::env::temp_dir(),
            seed: 42,
        }
    }
}

/// One engine's comparison.
#[derive(Clone, Debug, Serialize)]
pub struct BatchRow {
    /// `localcopy`, `hbm-sim` or `ssd`.
    pub engine: &'static str,
    /// What executed the bytes: `host`, `sim`, `io_uring` or `pread`.
    pub backend: &'static str,
    /// Transfers (and objects) per run.
    pub transfers: usize,
    /// Bytes per transfer.
    pub transfer_size: u64,
    /// How `*_ns_per_transfer` is defined: `wall-minus-floor` or `wall`.
    pub overhead: &'static str,
    /// Median ns per transfer of the floor (copying the bytes, no engine); `null` for `ssd`.
    pub floor_ns_per_transfer: Option<f64>,
    /// The floor's spread over the iterations; `null` for `ssd`.
    pub floor_spread: Option<f64>,
    /// Median wall ns per transfer of the batch path, and its spread.
    pub batch_wall_ns_per_transfer: f64,
    /// The spread of the batch path's wall time.
    pub batch_wall_spread: f64,
    /// Median wall ns per transfer of the single-submit path.
    pub single_wall_ns_per_transfer: f64,
    /// The spread of the single path's wall time.
    pub single_wall_spread: f64,
    /// Overhead ns per transfer of the batch path (as `overhead` says); `null` when it does
    /// not stand above `batch_noise_ns` (below noise).
    pub batch_ns_per_transfer: Option<f64>,
    /// The noise of the batch overhead: half the interquartile range of its per-iteration
    /// differences (the bound when it is below noise).
    pub batch_noise_ns: f64,
    /// Overhead ns per transfer of the single-submit path; `null` when below noise.
    pub single_ns_per_transfer: Option<f64>,
    /// The noise of the single overhead.
    pub single_noise_ns: f64,
    /// `single_ns_per_transfer / batch_ns_per_transfer`; `null` when either is below noise.
    pub ratio: Option<f64>,
    /// `[low, high]`: the range the ratio spans within both overheads' noise; `null` with it.
    pub ratio_range: Option<[f64; 2]>,
    /// The least `ratio` targeted: 10 (`localcopy`, `hbm-sim`) or 1.3 (`ssd`).
    pub target_ratio: f64,
    /// `met`, `unmet`, `within noise` or `below noise` (only `met` counts as met).
    pub verdict: Verdict,
    /// Both paths delivered every byte correctly after timing.
    pub verified: bool,
}

/// Runs the comparison for every configured engine.
pub fn run(config: &BatchBenchConfig, progress: &Progress) -> anyhow::Result<Vec<BatchRow>> {
    if config.transfers == 0 || config.transfers > u32::MAX as usize || config.transfer_size == 0 {
        bail!("the transfer count and size must be positive");
    }
    progress.section("batch", config.engines.len());
    let mut rows = Vec::new();
    for &engine in &config.engines {
        progress.step(engine.name());
        let row = match engine {
            BatchEngine::LocalCopy => localcopy(config),
            BatchEngine::HbmSim => hbm_sim(config),
            BatchEngine::Ssd => ssd(config),
        };
        rows.push(row.with_context(|| format!("batch, engine {}", engine.name()))?);
    }
    Ok(rows)
}

/// Source slot of every transfer: a shuffle of `0 .. transfers`, a pure function of `seed`.
fn scatter(transfers: usize, seed: u64) -> Vec<u64> {
    let mut slots: Vec<u64> = (0..transfers as u64).collect();
    let mut rng = SplitMix(seed);
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    slots
}

/// Transfer `i`: source slot `slots[i]` to destination slot `i`, object `i`.
fn fragments(
    src: umbp_plan::EndpointId,
    dst: umbp_plan::EndpointId,
    slots: &[u64],
    size: u64,
) -> Vec<Fragment> {
    slots
        .iter()
        .enumerate()
        .map(|(i, &slot)| {
            Fragment::new(src, slot * size, dst, i as u64 * size, size, Tag::new(i as u32))
        })
        .collect()
}

/// Plans every fragment as its own object and finishes the plan set.
fn plan_objects<B: PlanBuilder>(
    builder: &mut B,
    fragments: &[Fragment],
) -> anyhow::Result<PlanSet> {
    for &f in fragments {
        builder.begin_object(f.tag)?;
        builder.push(f)?;
        builder.commit_object()?;
    }
    let plans = builder.finish()?;
    if let Some(tag) = plans.rejected().first() {
        bail!("the builder rejected object {tag:?}");
    }
    Ok(plans)
}

/// Plans `fragments`, submits them, waits, and recycles the plan set.
fn execute<E: TransferEngine, B: PlanBuilder>(
    engine: &E,
    builder: &mut B,
    fragments: &[Fragment],
) -> anyhow::Result<()> {
    let plans = plan_objects(builder, fragments)?;
    let settled = engine.submit(plans).into_settled();
    if let Some(failure) = settled.failures.first() {
        bail!("a transfer failed: {failure}");
    }
    builder.recycle(settled.plans);
    Ok(())
}

/// The batch path: one plan set, one submit, one wait.
fn batch<E: TransferEngine, B: PlanBuilder>(
    e: &E,
    b: &mut B,
    f: &[Fragment],
) -> anyhow::Result<()> {
    execute(e, b, f)
}

/// The single path: plan, submit and wait once per transfer.
fn single<E: TransferEngine, B: PlanBuilder>(
    e: &E,
    b: &mut B,
    f: &[Fragment],
) -> anyhow::Result<()> {
    f.iter().try_for_each(|f| execute(e, b, std::slice::from_ref(f)))
}

/// Every iteration's ns per transfer of each path (the floor's all zero when there is none).
struct Timing {
    has_floor: bool,
    floor: Vec<f64>,
    batch: Vec<f64>,
    single: Vec<f64>,
}

/// Times `floor` (if any), `batch` and `single` back to back, `iterations` times after one
/// untimed round.
fn time_paths(
    iterations: usize,
    transfers: usize,
    mut floor: Option<&mut dyn FnMut()>,
    batch: &mut dyn FnMut() -> anyhow::Result<()>,
    single: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<Timing> {
    let mut samples: [Vec<f64>; 3] = Default::default();
    for round in 0..=iterations.max(1) {
        let f = match floor.as_mut() {
            Some(floor) => seconds(|| {
                floor();
                Ok(())
            })?,
            None => 0.0,
        };
        let b = seconds(&mut *batch)?;
        let s = seconds(&mut *single)?;
        if round > 0 {
            for (all, t) in samples.iter_mut().zip([f, b, s]) {
                all.push(t * 1e9 / transfers as f64);
            }
        }
    }
    let [floor_ns, batch, single] = samples;
    Ok(Timing { has_floor: floor.is_some(), floor: floor_ns, batch, single })
}

fn seconds(mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64())
}

/// The floor: each transfer's bytes copied from `src` into `dst` with `copy_nonoverlapping`.
fn floor_copy(src: &HostBuffer, dst: &mut HostBuffer, slots: &[u64], size: usize) {
    let (from, to) = (src.bytes(), dst.bytes_mut());
    for (i, &slot) in slots.iter().enumerate() {
        let s = slot as usize * size;
        to[i * size..][..size].copy_from_slice(&from[s..s + size]);
    }
    black_box(to);
}

/// Whether destination slot `i` of `dst` holds source slot `slots[i]` of `src`.
fn delivered(src: &[u8], dst: &[u8], slots: &[u64], size: usize) -> bool {
    slots.iter().enumerate().all(|(i, &slot)| {
        let s = slot as usize * size;
        dst.get(i * size..(i + 1) * size) == src.get(s..s + size)
    })
}

fn row(
    engine: BatchEngine,
    backend: &'static str,
    config: &BatchBenchConfig,
    t: Timing,
    verified: bool,
) -> BatchRow {
    let (batch, single) = (Difference::of(&t.batch, &t.floor), Difference::of(&t.single, &t.floor));
    let (ratio, ratio_range) = (single.ratio_to(&batch), single.ratio_range(&batch));
    let target_ratio = engine.target_ratio();
    let (floor, batch_wall, single_wall) =
        (Timed::of(&t.floor), Timed::of(&t.batch), Timed::of(&t.single));
    BatchRow {
        engine: engine.name(),
        backend,
        transfers: config.transfers,
        transfer_size: config.transfer_size,
        overhead: if t.has_floor { "wall-minus-floor" } else { "wall" },
        floor_ns_per_transfer: t.has_floor.then_some(floor.median),
        floor_spread: t.has_floor.then_some(floor.spread),
        batch_wall_ns_per_transfer: batch_wall.median,
        batch_wall_spread: batch_wall.spread,
        single_wall_ns_per_transfer: single_wall.median,
        single_wall_spread: single_wall.spread,
        batch_ns_per_transfer: batch.value(),
        batch_noise_ns: batch.noise,
        single_ns_per_transfer: single.value(),
        single_noise_ns: single.noise,
        ratio,
        ratio_range,
        target_ratio,
        verdict: Verdict::range_at_least(ratio_range, target_ratio),
        verified,
    }
}

fn localcopy(config: &BatchBenchConfig) -> anyhow::Result<BatchRow> {
    let (n, size) = (config.transfers, config.transfer_size as usize);
    let engine_config =
        LocalCopyConfig { threads: 1, non_temporal: false, ..LocalCopyConfig::default() };
    let engine = LocalCopyEngine::with_config(EndpointRegistry::new(), engine_config);
    let src = HostBuffer::new(n * size, config.seed);
    let mut dst = HostBuffer::zeroed(n * size);
    // SAFETY: both buffers outlive their registrations (declared after them; this engine
    // finishes every transfer inside `submit`), and the bench reads or writes them only
    // between transfers.
    let (src_reg, dst_reg) = unsafe { (src.lend(&engine)?, dst.lend(&engine)?) };
    let (s, d) = (src_reg.id(), dst_reg.id());
    let slots = scatter(n, config.seed);
    let work = fragments(s, d, &slots, size as u64);
    let mut builder = engine.incremental_builder();
    let mut builder2 = engine.incremental_builder();
    let timing = time_paths(
        config.iterations,
        n,
        Some(&mut || floor_copy(&src, &mut dst, &slots, size)),
        &mut || batch(&engine, &mut builder, &work),
        &mut || single(&engine, &mut builder2, &work),
    )?;
    let mut verified = true;
    for path in [batch::<LocalCopyEngine, _>, single::<LocalCopyEngine, _>] {
        dst.bytes_mut().fill(0xA5);
        path(&engine, &mut builder, &work)?;
        verified &= delivered(src.bytes(), dst.bytes(), &slots, size);
    }
    Ok(row(BatchEngine::LocalCopy, "host", config, timing, verified))
}

fn hbm_sim(config: &BatchBenchConfig) -> anyhow::Result<BatchRow> {
    let (n, size) = (config.transfers, config.transfer_size as usize);
    let device = DeviceOrdinal::new(0);
    let runtime = Arc::new(SimDevice::new(1));
    // Host memory registered with the engine is pinned for the device, so gathers can read it.
    let engine_config = HbmConfig { pin_registered_host: Some(device), ..HbmConfig::default() };
    let engine = HbmEngine::new(runtime.clone(), EndpointRegistry::new(), engine_config);
    let src = HostBuffer::new(n * size, config.seed);
    let mut scratch = HostBuffer::zeroed(n * size);
    // SAFETY: `src` outlives its registration (declared after it; the engine synchronizes
    // before `submit` returns), and the bench only reads it.
    let src_reg = unsafe { src.lend(&engine)? };
    let dev = engine.alloc_device(device, (n * size) as u64)?;
    let (dev_addr, dev_len) = (dev.endpoint().addr(), dev.endpoint().len());
    let slots = scatter(n, config.seed);
    let work = fragments(src_reg.id(), dev.id(), &slots, size as u64);
    let mut builder = engine.incremental_builder();
    let mut builder2 = engine.incremental_builder();
    let timing = time_paths(
        config.iterations,
        n,
        Some(&mut || floor_copy(&src, &mut scratch, &slots, size)),
        &mut || batch(&engine, &mut builder, &work),
        &mut || single(&engine, &mut builder2, &work),
    )?;
    let mut verified = true;
    for path in [batch::<HbmEngine<SimDevice>, _>, single::<HbmEngine<SimDevice>, _>] {
        runtime.fill(dev_addr, dev_len, 0xA5)?;
        path(&engine, &mut builder, &work)?;
        verified &= delivered(src.bytes(), &runtime.read(dev_addr, dev_len)?, &slots, size);
    }
    Ok(row(BatchEngine::HbmSim, runtime_name(&runtime), config, timing, verified))
}

fn runtime_name(runtime: &SimDevice) -> &'static str {
    umbp_hbm::DeviceRuntime::name(runtime)
}

fn ssd(config: &BatchBenchConfig) -> anyhow::Result<BatchRow> {
    let (n, size) = (config.transfers, config.transfer_size as usize);
    let dir = tempfile::Builder::new()
        .prefix("umbp-batch-bench")
        .tempdir_in(&config.dir)
        .with_context(|| format!("creating a temporary directory in {}", config.dir.display()))?;
    let path = dir.path().join("batch.bin");
    let content = HostBuffer::new(n * size, config.seed);
    let mut file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    file.write_all(content.bytes()).context("writing the test file")?;
    file.sync_all().context("syncing the test file")?;
    drop(file);

    let registry = EndpointRegistry::new();
    let engine = SsdEngine::new(registry.clone(), SsdConfig::default())
        .context("starting the SSD engine")?;
    let source = FileSource::open(&path, FileOptions::new().writable(false));
    let file = engine
        .register_file(source, 0, content.len() as u64)
        .with_context(|| format!("opening {}", path.display()))?;
    let mut dst = HostBuffer::zeroed(n * size);
    // SAFETY: `dst` outlives its registration (declared after it; each transfer is waited on
    // before the next step), and the bench touches `dst` only between transfers.
    let dst_reg = unsafe { dst.lend(&engine)? };
    let slots = scatter(n, config.seed);
    let work = fragments(file.id(), dst_reg.id(), &slots, size as u64);
    let mut builder = engine.incremental_builder();
    let mut builder2 = engine.incremental_builder();
    let timing = time_paths(
        config.ssd_iterations,
        n,
        None,
        &mut || batch(&engine, &mut builder, &work),
        &mut || single(&engine, &mut builder2, &work),
    )?;
    let mut verified = true;
    for path in [batch::<SsdEngine, _>, single::<SsdEngine, _>] {
        dst.bytes_mut().fill(0xA5);
        path(&engine, &mut builder, &work)?;
        verified &= delivered(content.bytes(), dst.bytes(), &slots, size);
    }
    let backend = match engine.backend() {
        Backend::Blocking => "pread",
        _ => "io_uring",
    };
    Ok(row(BatchEngine::Ssd, backend, config, timing, verified))
}

/// The human table.
pub fn table(rows: &[BatchRow]) -> String {
    let mut out = String::new();
    if let Some(first) = rows.first() {
        out += &format!(
            "batch submit vs one submit per transfer: {} transfers of {}, one object each\n\n",
            first.transfers,
            ByteSize(first.transfer_size)
        );
    }
    out += &format!(
        "{:<10} {:<9} {:>10} {:>18} {:>18} {:>11} {:>7} {:>26} {:>8} {:>16}\n",
        "engine",
        "backend",
        "floor ns",
        "batch ns",
        "single ns",
        "ratio",
        "target",
        "verdict",
        "verified",
        "overhead"
    );
    let overhead = |value: Option<f64>, noise: f64| match value {
        Some(v) => format!("{v:.1} ±{noise:.1}"),
        None => format!("< {noise:.1} (noise)"),
    };
    for r in rows {
        let floor = r.floor_ns_per_transfer.map_or("-".to_owned(), |f| format!("{f:.1}"));
        out += &format!(
            "{:<10} {:<9} {:>10} {:>18} {:>18} {:>11} {:>6.1}x {:>26} {:>8} {:>16}\n",
            r.engine,
            r.backend,
            floor,
            overhead(r.batch_ns_per_transfer, r.batch_noise_ns),
            overhead(r.single_ns_per_transfer, r.single_noise_ns),
            ratio_text(r.ratio),
            r.target_ratio,
            verdict_text(r.verdict, r.ratio_range),
            if r.verified { "yes" } else { "NO" },
            r.overhead
        );
    }
    out += "\nns are per transfer: wall time minus the floor (the same bytes copied, no engine) \
            for host and simulated device; plain wall time for ssd. ± is the noise (half the \
            interquartile range of the per-iteration differences); an overhead that does not \
            stand above it is below noise, with no ratio and no met target.\n";
    out
}

/// The chart: batch and single ns per transfer for each engine, on a log scale (an overhead
/// below noise has no bar; the chart names it).
pub fn chart(rows: &[BatchRow]) -> BarChart {
    let mut chart = BarChart::new("Batch submit vs one submit per transfer", "ns per transfer");
    if let Some(first) = rows.first() {
        chart.subtitle = format!(
            "{} transfers of {}; host and sim: wall minus a memcpy floor, ssd: wall time",
            first.transfers,
            ByteSize(first.transfer_size)
        );
    }
    chart.groups = rows
        .iter()
        .map(|r| match r.ratio {
            Some(ratio) => format!("{} ({ratio:.1}x)", r.engine),
            None => format!("{} (below noise)", r.engine),
        })
        .collect();
    chart.series = vec![
        Series::new("one batch submit", rows.iter().map(|r| r.batch_ns_per_transfer).collect()),
        Series::new("single submits", rows.iter().map(|r| r.single_ns_per_transfer).collect()),
    ];
    chart.log_y = true;
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_engine_runs_verified_at_a_small_scale() {
        let config = BatchBenchConfig {
            transfers: 32,
            iterations: 1,
            ssd_iterations: 1,
            ..BatchBenchConfig::default()
        };
        let rows = run(&config, &Progress::quiet()).unwrap();
        let engines: Vec<&str> = rows.iter().map(|r| r.engine).collect();
        assert_eq!(engines, ["localcopy", "hbm-sim", "ssd"]);
        for r in &rows {
            assert!(r.verified, "{r:?}");
            assert_eq!((r.transfers, r.transfer_size), (32, 4096));
            assert_eq!(r.floor_ns_per_transfer.is_some(), r.engine != "ssd");
        }
    }

    #[test]
    fn scattered_slots_are_distinct() {
        let mut slots = scatter(100, 1);
        assert!(slots.iter().all(|&s| s < 100));
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), 100);
    }
}
