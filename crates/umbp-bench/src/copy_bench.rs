//! `umbp-bench copy`: the local copy engine against a `memcpy` ceiling, and one batch submit
//! against one submit per fragment.
//!
//! **Throughput** ([`run`]). For each fragment size and thread count, one batch of
//! [`batch_bytes`](CopyBenchConfig::batch_bytes) moves from scattered places of a source arena
//! (the arena's fragment-sized slots in shuffled order) into one contiguous destination. The
//! engine's time covers plan building (a reused builder, one object per MiB of destination),
//! submit and wait. The ceiling is the best the machine does with the same bytes and threads:
//! one contiguous buffer of the same size copied onto another in equal parts by the same
//! number of threads, started once outside the timing as the engine's pool is, both with
//! `memcpy` and with streaming stores ([`umbp_plan::host_copy::copy_streaming`]); the faster median
//! is the ceiling. The three alternate, iteration by iteration; each reports its median and
//! spread, and the ratio's verdict takes both spreads into account. The destination is
//! verified after timing.
//!
//! **Submit overhead** ([`run_submit_overhead`]). The same
//! [`submit_fragments`](CopyBenchConfig::submit_fragments) scattered fragments, each its own
//! object, are copied on one thread with plain stores: by a floor loop of
//! `copy_nonoverlapping` (no engine); as one batch (every object planned into a reused builder,
//! one submit); and with one submit per fragment (the same builder, finished and recycled after
//! each object). Subtracting the floor, iteration by iteration, leaves each path's overhead per
//! fragment; an overhead that does not stand above its own noise is below noise and gives no
//! ratio ([`crate::measure`]). The two engine paths are measured twice: with planning, and
//! submitting plan sets built beforehand.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;
use umbp_localcopy::{LocalCopyBuilder, LocalCopyConfig, LocalCopyEngine};

use crate::host_buffer::HostBuffer;
use umbp_plan::{
    EndpointId, EndpointRegistry, Fragment, PlanBuilder, PlanSet, Tag, TransferEngine,
};

use crate::ceiling::{with_copy_ceiling, CeilingSamples};
use crate::chart::{BarChart, Series};
use crate::measure::{ratio_text, spread_interval, verdict_text, Difference, Timed, Verdict};
use crate::progress::Progress;
use crate::size::ByteSize;

/// Settings of `umbp-bench copy`.
#[derive(Clone, Debug)]
pub struct CopyBenchConfig {
    /// Fragment sizes of the throughput comparison. Default 4 KiB, 64 KiB and 1 MiB.
    pub fragment_sizes: Vec<u64>,
    /// Bytes per throughput batch (rounded down to whole fragments). Default 256 MiB.
    pub batch_bytes: u64,
    /// Thread counts of the throughput comparison (the engine's, caller included; clamped to
    /// the machine, and the ceiling uses the clamped count). Default 1 and 2.
    pub threads: Vec<usize>,
    /// Timed iterations per throughput measurement; the median is reported. Default 5.
    pub iterations: usize,
    /// Untimed iterations before timing. Default 1.
    pub warmup: usize,
    /// Seed of the scattered layouts. Default 42.
    pub seed: u64,
    /// Fragments of the submit-overhead comparison. Default 4096.
    pub submit_fragments: usize,
    /// Fragment size of the submit-overhead comparison. Default 4 KiB.
    pub submit_fragment_size: u64,
    /// Timed iterations of each submit-overhead path; medians are reported. Default 51.
    pub submit_iterations: usize,
}

impl Default for CopyBenchConfig {
    fn default() -> Self {
        Self {
            fragment_sizes: vec![4 << 10, 64 << 10, 1 << 20],
            batch_bytes: 256 << 20,
            threads: vec![1, 2],
            iterations: 5,
            warmup: 1,
            seed: 42,
            submit_fragments: 4096,
            submit_fragment_size: 4 << 10,
            submit_iterations: 51,
        }
    }
}

/// One fragment size at one thread count.
#[derive(Clone, Debug, Serialize)]
pub struct CopyRow {
    /// `throughput`: tells these rows from the [`SubmitRow`] in a JSON stream.
    pub kind: &'static str,
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Threads copying, the caller included (as the engine runs them).
    pub threads: usize,
    /// Fragments per batch.
    pub fragments: u64,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Whether the engine used non-temporal stores for these fragments.
    pub non_temporal: bool,
    /// Median seconds per batch: engine (build, submit, wait).
    pub engine_seconds: f64,
    /// The engine's spread over the iterations.
    pub engine_spread: f64,
    /// Median seconds of the ceiling: the faster of its two copies of the same bytes.
    pub ceiling_seconds: f64,
    /// The ceiling's spread.
    pub ceiling_spread: f64,
    /// Which copy the ceiling is: `memcpy` or `streaming`.
    pub ceiling_copy: &'static str,
    /// Median seconds of the other copy (the slower one).
    pub other_copy_seconds: f64,
    /// Engine throughput, GiB/s.
    pub engine_gib_s: f64,
    /// Ceiling throughput, GiB/s.
    pub ceiling_gib_s: f64,
    /// `engine_gib_s / ceiling_gib_s` (target at 64 KiB: at least 0.9).
    pub ratio: f64,
    /// The ratio against its target at 64 KiB (`met`, `unmet`, `within noise`); `null` at
    /// other sizes, which have no target.
    pub verdict: Option<Verdict>,
    /// Every destination byte matched its source after timing.
    pub verified: bool,
}

/// One batch submit against one submit per fragment.
///
/// Each `*_overhead_ns` is the median, over the iterations, of the path's time minus the floor
/// loop's time in the same iteration, per fragment: pairing the two cancels most drift of a
/// shared machine.
#[derive(Clone, Debug, Serialize)]
pub struct SubmitRow {
    /// `submit`: tells this row from the [`CopyRow`]s in a JSON stream.
    pub kind: &'static str,
    /// Fragments (and objects) per run.
    pub fragments: usize,
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Threads of the engine (1: overhead is measured on one thread).
    pub threads: usize,
    /// Median ns per fragment of the floor loop (`copy_nonoverlapping` per fragment, no
    /// engine).
    pub floor_ns_per_fragment: f64,
    /// The floor's spread.
    pub floor_spread: f64,
    /// Median ns per fragment of one batch: plan every object, one submit, wait.
    pub batch_ns_per_fragment: f64,
    /// The batch path's spread.
    pub batch_spread: f64,
    /// Median ns per fragment of one plan, submit and wait per fragment.
    pub single_ns_per_fragment: f64,
    /// The single path's spread.
    pub single_spread: f64,
    /// Overhead per fragment of the batch path, planning included, with its noise; the value
    /// is `null` when it does not stand above the noise.
    pub batch_overhead_ns: Option<f64>,
    /// The noise of `batch_overhead_ns` (its bound when below noise).
    pub batch_noise_ns: f64,
    /// Overhead per fragment of the single path, planning included; `null` below noise.
    pub single_overhead_ns: Option<f64>,
    /// The noise of `single_overhead_ns`.
    pub single_noise_ns: f64,
    /// `single_overhead_ns / batch_overhead_ns`; `null` when either is below noise.
    pub ratio: Option<f64>,
    /// `[low, high]`: the range the ratio spans within both overheads' noise.
    pub ratio_range: Option<[f64; 2]>,
    /// `ratio` against its target of 10.
    pub verdict: Verdict,
    /// Overhead per fragment of submitting and waiting for the batch's prebuilt plan set;
    /// `null` below noise.
    pub batch_submit_overhead_ns: Option<f64>,
    /// Overhead per fragment of submitting and waiting for prebuilt single-fragment plan sets;
    /// `null` below noise.
    pub single_submit_overhead_ns: Option<f64>,
    /// `single_submit_overhead_ns / batch_submit_overhead_ns`; `null` when either is below
    /// noise.
    pub submit_ratio: Option<f64>,
    /// Every destination byte matched its source after timing.
    pub verified: bool,
}

/// Runs the throughput comparison: one row per fragment size and thread count.
pub fn run(config: &CopyBenchConfig, progress: &Progress) -> Vec<CopyRow> {
    progress.section("copy", config.fragment_sizes.len() * config.threads.len());
    let registry = EndpointRegistry::new();
    let engines: Vec<LocalCopyEngine> = config
        .threads
        .iter()
        .map(|&t| {
            let engine_config = LocalCopyConfig { threads: t, ..LocalCopyConfig::default() };
            LocalCopyEngine::with_config(registry.clone(), engine_config)
        })
        .collect();
    let mut rows = Vec::new();
    for &fragment_size in &config.fragment_sizes {
        let fragment_size = fragment_size.max(1);
        let fragments = (config.batch_bytes / fragment_size).max(1);
        let bytes = fragments * fragment_size;
        let src = HostBuffer::new(bytes as usize, config.seed);
        let dst = HostBuffer::new(bytes as usize, !config.seed);
        let Some(first) = engines.first() else { break };
        // SAFETY: both buffers outlive their registrations (declared after them), and the
        // bench touches them only between transfers (this engine finishes each inside
        // `submit`).
        let (src_reg, dst_reg) = unsafe { (src.lend(first), dst.lend(first)) };
        // The host copy engine prepares nothing, and real buffers cannot wrap the address
        // space: these registrations cannot be refused.
        let (src_reg, dst_reg) = (src_reg.expect(LENT), dst_reg.expect(LENT));
        let (s, d) = (src_reg.id(), dst_reg.id());
        let slots = permutation(fragments as usize, config.seed ^ fragment_size);
        let batch = scattered(s, d, &slots, fragment_size, (1 << 20) / fragment_size);
        for engine in &engines {
            let threads = engine.config().threads;
            progress.step(format!("{} fragments, {threads} threads", ByteSize(fragment_size)));
            let mut builder = engine.incremental_builder();
            let mut engine_times = Vec::new();
            let mut ceiling = CeilingSamples::default();
            with_copy_ceiling(bytes as usize, threads, |copy| {
                for i in 0..config.warmup + config.iterations {
                    let timed = i >= config.warmup;
                    ceiling.run(copy, timed);
                    let copied = time(|| submit_batch(engine, &mut builder, &batch));
                    if timed {
                        engine_times.push(copied);
                    }
                }
            });
            let engine_t = Timed::of(&engine_times);
            let (ceiling, ceiling_copy, other) = ceiling.best();
            let gib_s = |secs: f64| bytes as f64 / secs / f64::from(1u32 << 30);
            let ratio = ceiling.median / engine_t.median;
            let spread = engine_t.spread + ceiling.spread;
            rows.push(CopyRow {
                kind: "throughput",
                fragment_size,
                threads,
                fragments,
                batch_bytes: bytes,
                non_temporal: engine.uses_non_temporal_stores()
                    && fragment_size as usize >= engine.config().non_temporal_threshold,
                engine_seconds: engine_t.median,
                engine_spread: engine_t.spread,
                ceiling_seconds: ceiling.median,
                ceiling_spread: ceiling.spread,
                ceiling_copy,
                other_copy_seconds: other.median,
                engine_gib_s: gib_s(engine_t.median),
                ceiling_gib_s: gib_s(ceiling.median),
                ratio,
                verdict: (fragment_size == 64 << 10)
                    .then(|| Verdict::at_least(Some(ratio), 0.9, spread)),
                verified: verify(&src, &dst, &batch),
            });
        }
    }
    rows
}

/// Runs the submit-overhead comparison.
pub fn run_submit_overhead(config: &CopyBenchConfig, progress: &Progress) -> SubmitRow {
    progress.section("copy submit overhead", 1);
    progress.step(format!("{} single submits", config.submit_fragments));
    let fragment_size = config.submit_fragment_size.max(1);
    let n = config.submit_fragments.max(1);
    let engine_config =
        LocalCopyConfig { threads: 1, non_temporal: false, ..LocalCopyConfig::default() };
    let engine = LocalCopyEngine::with_config(EndpointRegistry::new(), engine_config);
    let bytes = n * fragment_size as usize;
    let src = HostBuffer::new(bytes, config.seed);
    let mut dst = HostBuffer::new(bytes, !config.seed);
    // SAFETY: as in `run`.
    let (src_reg, dst_reg) = unsafe { (src.lend(&engine), dst.lend(&engine)) };
    let (src_reg, dst_reg) = (src_reg.expect(LENT), dst_reg.expect(LENT));
    let (s, d) = (src_reg.id(), dst_reg.id());
    // One object per fragment, so both paths plan and report the same objects.
    let fragments = scattered(s, d, &permutation(n, config.seed), fragment_size, 1);

    let mut builder = engine.incremental_builder();
    let mut batch_plans = Some(plan(&mut builder, &fragments));
    let mut single_plans: Vec<_> =
        fragments.iter().map(|f| Some(plan(&mut builder, std::slice::from_ref(f)))).collect();
    let mut times = [(); 5].map(|()| Vec::new());
    // One extra round first, untimed in effect: it is dropped below.
    for _ in 0..config.submit_iterations.max(1) + 1 {
        let floor = time(|| floor_copy(&src, &mut dst, &fragments));
        let batch = time(|| submit_batch(&engine, &mut builder, &fragments));
        let single = time(|| {
            for f in &fragments {
                submit_batch(&engine, &mut builder, std::slice::from_ref(f));
            }
        });
        let batch_submit = time(|| submit_plans(&engine, &mut batch_plans));
        let single_submit = time(|| single_plans.iter_mut().for_each(|p| submit_plans(&engine, p)));
        for (all, t) in times.iter_mut().zip([floor, batch, single, batch_submit, single_submit]) {
            all.push(t);
        }
    }
    // Every figure in ns per fragment, the untimed first round dropped.
    let [floor, batch, single, batch_submit, single_submit] = times
        .map(|t| t.into_iter().skip(1).map(|secs| secs * 1e9 / n as f64).collect::<Vec<f64>>());
    let [batch_o, single_o, batch_submit_o, single_submit_o] =
        [&batch, &single, &batch_submit, &single_submit].map(|path| Difference::of(path, &floor));
    let (floor_t, batch_t, single_t) = (Timed::of(&floor), Timed::of(&batch), Timed::of(&single));
    let (ratio, ratio_range) = (single_o.ratio_to(&batch_o), single_o.ratio_range(&batch_o));
    SubmitRow {
        kind: "submit",
        fragments: n,
        fragment_size,
        threads: engine.config().threads,
        floor_ns_per_fragment: floor_t.median,
        floor_spread: floor_t.spread,
        batch_ns_per_fragment: batch_t.median,
        batch_spread: batch_t.spread,
        single_ns_per_fragment: single_t.median,
        single_spread: single_t.spread,
        batch_overhead_ns: batch_o.value(),
        batch_noise_ns: batch_o.noise,
        single_overhead_ns: single_o.value(),
        single_noise_ns: single_o.noise,
        ratio,
        ratio_range,
        verdict: Verdict::range_at_least(ratio_range, 10.0),
        batch_submit_overhead_ns: batch_submit_o.value(),
        single_submit_overhead_ns: single_submit_o.value(),
        submit_ratio: single_submit_o.ratio_to(&batch_submit_o),
        verified: verify(&src, &dst, &fragments),
    }
}

/// Plans `fragments` (grouped by tag) into `builder` and finishes the plan set.
const LENT: &str = "the host copy engine refuses no host buffer";

fn plan(builder: &mut LocalCopyBuilder, fragments: &[Fragment]) -> PlanSet {
    let mut open = None;
    for &f in fragments {
        if open != Some(f.tag) {
            if open.is_some() {
                builder.commit_object().expect("an object is open");
            }
            builder.begin_object(f.tag).expect("no object is open");
            open = Some(f.tag);
        }
        builder.push(f).expect("the workload's fragments are valid");
    }
    if open.is_some() {
        builder.commit_object().expect("an object is open");
    }
    builder.finish().expect("no object is open")
}

/// Submits the plan set in `plans`, waits, and puts it back for the next round.
fn submit_plans(engine: &LocalCopyEngine, plans: &mut Option<PlanSet>) {
    if let Some(set) = plans.take() {
        let settled = engine.submit(set).into_settled();
        assert!(settled.failures.is_empty(), "copy failed: {:?}", settled.failures);
        *plans = Some(settled.plans);
    }
}

/// Plans `fragments` (grouped by tag) with `builder`, submits them and waits, then recycles
/// the plan set. Panics on a failure: every fragment of the workload is valid.
fn submit_batch(engine: &LocalCopyEngine, builder: &mut LocalCopyBuilder, fragments: &[Fragment]) {
    let plans = plan(builder, fragments);
    let settled = engine.submit(plans).into_settled();
    assert!(settled.failures.is_empty(), "copy failed: {:?}", settled.failures);
    builder.recycle(settled.plans);
}

/// Fragment `i` copies source slot `slots[i]` to destination slot `i`; every
/// `per_object` consecutive fragments form one object.
fn scattered(
    src: EndpointId,
    dst: EndpointId,
    slots: &[usize],
    fragment_size: u64,
    per_object: u64,
) -> Vec<Fragment> {
    let per_object = per_object.max(1);
    (0..slots.len() as u64)
        .map(|i| {
            let tag = Tag::new((i / per_object) as u32);
            let from = slots[i as usize] as u64 * fragment_size;
            Fragment::new(src, from, dst, i * fragment_size, fragment_size, tag)
        })
        .collect()
}

/// The floor of the submit comparison: each fragment's bytes copied with
/// `copy_nonoverlapping`, nothing else.
fn floor_copy(src: &HostBuffer, dst: &mut HostBuffer, fragments: &[Fragment]) {
    let (src, dst) = (src.bytes(), dst.bytes_mut());
    for f in fragments {
        let (from, to, len) = (f.src_offset as usize, f.dst_offset as usize, f.len as usize);
        dst[to..to + len].copy_from_slice(&src[from..from + len]);
    }
    black_box(dst);
}

/// Whether every fragment's destination bytes equal its source bytes.
fn verify(src: &HostBuffer, dst: &HostBuffer, fragments: &[Fragment]) -> bool {
    let (src, dst) = (src.bytes(), dst.bytes());
    fragments.iter().all(|f| {
        let (from, to, len) = (f.src_offset as usize, f.dst_offset as usize, f.len as usize);
        src.get(from..from + len) == dst.get(to..to + len)
    })
}

fn time(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64()
}

/// A random permutation of `0 .. n` (splitmix64 Fisher-Yates), a pure function of `seed`.
fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut state = seed;
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (mix(&mut state) % (i as u64 + 1)) as usize);
    }
    order
}

fn mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The human table: throughput rows, then the submit comparison.
pub fn table(rows: &[CopyRow], submit: &SubmitRow) -> String {
    let mut out = String::from(
        "host copy engine: scattered fragments against the best copy of the same bytes\n\n",
    );
    out += &format!(
        "{:>9} {:>7} {:>12} {:>7} {:>13} {:>7} {:>10} {:>7} {:>24} {:>8}\n",
        "fragment",
        "threads",
        "engine GiB/s",
        "spread",
        "ceiling GiB/s",
        "spread",
        "ceiling",
        "ratio",
        "verdict",
        "verified"
    );
    for r in rows {
        out += &format!(
            "{:>9} {:>7} {:>12.2} {:>6.0}% {:>13.2} {:>6.0}% {:>10} {:>7.2} {:>24} {:>8}\n",
            ByteSize(r.fragment_size).to_string(),
            r.threads,
            r.engine_gib_s,
            r.engine_spread * 100.0,
            r.ceiling_gib_s,
            r.ceiling_spread * 100.0,
            r.ceiling_copy,
            r.ratio,
            r.verdict.map_or("-".into(), |v| {
                verdict_text(v, spread_interval(r.ratio, r.engine_spread + r.ceiling_spread))
            }),
            if r.verified { "yes" } else { "NO" }
        );
    }
    out += "ceiling: one contiguous copy of the same bytes by the same threads (started once), \
            the faster of memcpy and streaming stores; target at 64KiB: ratio >= 0.9\n";
    let ns = |value: Option<f64>, noise: f64| match value {
        Some(v) => format!("{v:.1} ns (±{noise:.1})"),
        None => format!("below noise (< {noise:.1} ns)"),
    };
    out += &format!(
        "\n{} fragments of {}: one batch submit {} of overhead per fragment, single submits {}: \
         ratio {} ({}; target 10); submit and wait alone: ratio {}; verified: {}\n",
        submit.fragments,
        ByteSize(submit.fragment_size),
        ns(submit.batch_overhead_ns, submit.batch_noise_ns),
        ns(submit.single_overhead_ns, submit.single_noise_ns),
        ratio_text(submit.ratio),
        verdict_text(submit.verdict, submit.ratio_range),
        ratio_text(submit.submit_ratio),
        if submit.verified { "yes" } else { "NO" }
    );
    out
}

/// The chart: engine and ceiling GiB/s for each fragment size and thread count.
pub fn chart(rows: &[CopyRow]) -> BarChart {
    let mut chart = BarChart::new("Host copy engine against its ceiling", "GiB/s");
    if let Some(first) = rows.first() {
        chart.subtitle = format!(
            "{} per batch from scattered source slots; ceiling: the faster of memcpy and streaming stores of the same bytes, same threads",
            ByteSize(first.batch_bytes)
        );
    }
    chart.groups = rows
        .iter()
        .map(|r| {
            let plural = if r.threads == 1 { "" } else { "s" };
            format!("{}, {} thread{plural}", ByteSize(r.fragment_size), r.threads)
        })
        .collect();
    chart.series = vec![
        Series::new("engine", rows.iter().map(|r| Some(r.engine_gib_s)).collect()),
        Series::new("ceiling", rows.iter().map(|r| Some(r.ceiling_gib_s)).collect()),
    ];
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_verifies_every_row() {
        let config = CopyBenchConfig {
            fragment_sizes: vec![4 << 10, 64 << 10],
            batch_bytes: 2 << 20,
            iterations: 1,
            warmup: 0,
            submit_fragments: 64,
            submit_iterations: 1,
            ..CopyBenchConfig::default()
        };
        let rows = run(&config, &Progress::quiet());
        assert_eq!(rows.len(), 4);
        assert!(rows.iter().all(|r| r.verified && r.ratio > 0.0), "{rows:?}");
        assert!(run_submit_overhead(&config, &Progress::quiet()).verified);
    }
}
