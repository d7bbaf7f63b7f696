//! `umbp-bench plan`: what it costs to turn a restore's page fragments into plans.
//!
//! Three ways to plan the same restore, each timed over page walk + push + finish (no bytes
//! move):
//! - `buffered`: [`BufferedPlanBuilder`] collects every fragment, then plans the batch;
//! - `incremental`: [`IncrementalBuilder`], reused across iterations with `recycle`, one
//!   [`Run`](umbp_plan::Run) per range (its fast path);
//! - `incremental-push`: the same builder fed one [`PlanBuilder::push`] per fragment, the path
//!   a builder behind a trait object takes;
//! - `floor`: a loop that writes one unmerged (src, dst, len) descriptor per page into a reused
//!   array, the least work any planner can do.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use umbp_plan::{
    BufferedPlanBuilder, Endpoint, EndpointId, EndpointRegistry, Error, Fragment,
    IncrementalBuilder, OverlapCheck, PageWalk, PlanBuilder, PlanRules, PlanSet, RulePlanner,
    Space, Tag,
};

use crate::alloc_count::{allocations, minor_faults};
use crate::chart::{BarChart, Reference, Series};
use crate::counters::{Instructions, CALLGRIND};
use crate::progress::Progress;
use crate::shape::{PageTable, RestoreShape};
use crate::size::ByteSize;

/// Carries any pair of memory endpoints: the planning rules of a restore into device memory.
#[derive(Copy, Clone, Debug, Default)]
pub struct MemoryRules;

impl PlanRules for MemoryRules {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.file_range().is_none() && dst.file_range().is_none()
    }
}

/// A restore laid out over a DRAM arena, with endpoints registered for planning only.
pub struct RestoreWorkload {
    /// The shape.
    pub shape: RestoreShape,
    /// Where every page lives in the arena.
    pub table: PageTable,
    /// The registry holding the arena and the destinations.
    pub registry: Arc<EndpointRegistry>,
    /// The DRAM arena.
    pub arena: EndpointId,
    /// One destination per range index.
    pub destinations: Vec<EndpointId>,
}

impl RestoreWorkload {
    /// Lays `shape` out with the given contiguity and registers invented endpoints for it.
    pub fn new(shape: RestoreShape, contiguity: f64, seed: u64) -> Self {
        let table = PageTable::scatter(&shape, contiguity, seed);
        let registry = EndpointRegistry::new();
        let arena_len = table.tier_pages * shape.page_size;
        let destination_len = shape.objects as u64 * shape.range_len;
        // SAFETY: the addresses are invented; plans built over them are measured and dropped,
        // never submitted to an engine.
        let (arena, destinations) = unsafe {
            let arena = registry.register(Endpoint::host(1 << 40, arena_len));
            let destinations = (0..shape.ranges)
                .map(|r| {
                    let addr = (2 << 40) + r as u64 * destination_len;
                    let ordinal = umbp_plan::DeviceOrdinal::new(0);
                    registry.register(Endpoint::device(ordinal, addr, destination_len))
                })
                .collect();
            (arena, destinations)
        };
        Self { shape, table, registry, arena, destinations }
    }

    /// Walks every range of every object into `builder`, one object scope per object, and
    /// finishes the batch.
    #[inline]
    pub fn plan_with<B: PlanBuilder>(&self, builder: &mut B) -> Result<PlanSet, Error> {
        self.plan_ranges(builder, |builder, walk, range| {
            walk.walk(range.offset, range.len, range.dst_offset, |page| {
                builder.push(Fragment::new(
                    self.arena,
                    page.tier_offset,
                    range.dst,
                    page.dst_offset,
                    page.len,
                    range.tag,
                ))
            })
        })
    }

    /// Like [`plan_with`](Self::plan_with), with one [`Run`](umbp_plan::Run) per range: the
    /// incremental builder's fast path. Never inlined, so that callgrind can collect exactly
    /// this function ([`crate::counters::CALLGRIND`]); one call costs far more than a call.
    #[inline(never)]
    pub fn plan_with_runs<R: PlanRules>(
        &self,
        builder: &mut IncrementalBuilder<R>,
    ) -> Result<PlanSet, Error> {
        self.plan_ranges(builder, |builder, walk, range| {
            builder.begin_run(self.arena, range.dst)?.push_walk(
                walk,
                range.offset,
                range.len,
                range.dst_offset,
            )
        })
    }

    /// The loop both ways share: one object scope per object, `range` called for each of its
    /// ranges with the object's page walk, then finish.
    #[inline(always)]
    fn plan_ranges<B: PlanBuilder>(
        &self,
        builder: &mut B,
        mut range: impl FnMut(&mut B, &PageWalk<'_>, RangeJob) -> Result<(), Error>,
    ) -> Result<PlanSet, Error> {
        let s = &self.shape;
        for object in 0..s.objects {
            let tag = Tag::new(object as u32);
            let walk = PageWalk::new(self.table.object(object), s.page_size, s.object_size())?;
            builder.begin_object(tag)?;
            for (r, &dst) in self.destinations.iter().enumerate() {
                let job = RangeJob {
                    tag,
                    offset: r as u64 * s.range_len,
                    len: s.range_len,
                    dst,
                    dst_offset: object as u64 * s.range_len,
                };
                range(builder, &walk, job)?;
            }
            builder.commit_object()?;
        }
        builder.finish()
    }

    /// The floor: one unmerged descriptor per page into `out`, which is cleared first.
    #[inline]
    pub fn floor(&self, out: &mut Vec<[u64; 3]>) {
        let s = &self.shape;
        out.clear();
        let per_range = s.range_len.div_ceil(s.page_size) as usize;
        for object in 0..s.objects {
            let pages = self.table.object(object);
            for range in 0..s.ranges {
                let dst_base = object as u64 * s.range_len;
                let first = range * per_range;
                for (k, &page) in pages[first..first + per_range].iter().enumerate() {
                    out.push([page, dst_base + k as u64 * s.page_size, s.page_size]);
                }
            }
        }
    }
}

/// One range of one object: its bytes and where they go.
#[derive(Copy, Clone, Debug)]
struct RangeJob {
    tag: Tag,
    offset: u64,
    len: u64,
    dst: EndpointId,
    dst_offset: u64,
}

/// Settings of `umbp-bench plan`.
#[derive(Clone, Debug)]
pub struct PlanBenchConfig {
    /// Page sizes to run.
    pub page_sizes: Vec<u64>,
    /// Fraction of an object's consecutive pages placed adjacently.
    pub contiguity: f64,
    /// Objects restored (651 for Kimi-K3).
    pub objects: usize,
    /// Timed iterations per builder.
    pub iterations: usize,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Layout seed.
    pub seed: u64,
    /// Run only the incremental builder and the floor (for profiling the hot path).
    pub skip_buffered: bool,
}

impl Default for PlanBenchConfig {
    fn default() -> Self {
        Self {
            page_sizes: vec![64 << 10, 32 << 10],
            contiguity: 0.1,
            objects: 651,
            iterations: 9,
            warmup: 3,
            seed: 42,
            skip_buffered: false,
        }
    }
}

/// One measured builder at one page size.
#[derive(Clone, Debug, Serialize)]
pub struct PlanRow {
    /// `buffered`, `incremental`, `incremental-push`, `floor`, or `overlap-check` (not a
    /// builder: the overlap rule every engine checks at submit, timed over the incremental
    /// builder's finished plan set).
    pub builder: &'static str,
    /// Page size in bytes.
    pub page_size: u64,
    /// Page fragments per restore.
    pub fragments: u64,
    /// Plans in the result (the floor writes one array).
    pub plans: usize,
    /// Segments after merging (the floor does not merge).
    pub segments: usize,
    /// Median nanoseconds per fragment.
    pub ns_per_fragment: f64,
    /// Median milliseconds per restore plan.
    pub median_ms: f64,
    /// (slowest − fastest) / median over the timed iterations.
    pub spread: f64,
    /// User-space instructions retired per fragment, averaged over the timed iterations
    /// (CPU counters); `null` where they cannot be read (the table says why, and how to count
    /// them with callgrind instead).
    pub instructions_per_fragment: Option<f64>,
    /// Heap allocations per iteration, averaged over the timed iterations.
    pub allocs_per_iter: f64,
    /// Minor page faults per iteration, averaged over the timed iterations.
    pub minor_faults_per_iter: f64,
    /// Median time relative to the floor's.
    pub vs_floor: f64,
    /// Fraction of consecutive pages adjacent in the arena.
    pub adjacent_fraction: f64,
    /// Whether this builder's plan set equalled the batch planner's over the same fragments
    /// (checked once before timing; the floor builds no plan set and reports `true`).
    pub verified: bool,
    /// The 1-minute load average when the row's timing ended (the table warns when it
    /// reaches `cpus`).
    pub load: f64,
    /// The CPUs the run may use.
    pub cpus: usize,
}

struct Sample {
    nanos: u128,
    plans: usize,
    segments: usize,
}

/// What [`measure`] found: the median sample, its spread, and per timed iteration the
/// allocations, minor faults and (where counted) instructions.
struct Measured {
    median: Sample,
    spread: f64,
    allocs: f64,
    faults: f64,
    instructions: Option<f64>,
}

/// Runs `iteration` `warmup` times untimed, then `iterations` times (counting the
/// instructions they retire where `counter` can).
fn measure(
    warmup: usize,
    iterations: usize,
    counter: &mut Instructions,
    mut iteration: impl FnMut() -> Sample,
) -> Measured {
    for _ in 0..warmup {
        black_box(iteration());
    }
    let mut samples: Vec<Sample> = Vec::with_capacity(iterations);
    let (allocs0, faults0) = (allocations(), minor_faults());
    let ((), instructions) = counter.count(|| {
        for _ in 0..iterations {
            samples.push(iteration());
        }
    });
    let n = iterations.max(1) as f64;
    let allocs = (allocations() - allocs0) as f64 / n;
    let faults = (minor_faults() - faults0) as f64 / n;
    samples.sort_by_key(|s| s.nanos);
    let (fastest, slowest) = (samples[0].nanos, samples[samples.len() - 1].nanos);
    let median = samples.swap_remove(samples.len() / 2);
    let spread = (slowest - fastest) as f64 / median.nanos.max(1) as f64;
    Measured { median, spread, allocs, faults, instructions: instructions.map(|i| i as f64 / n) }
}

/// Measures every builder at every configured page size.
pub fn run(config: &PlanBenchConfig, progress: &Progress) -> Result<Vec<PlanRow>, Error> {
    let builders = if config.skip_buffered { 5 } else { 6 };
    progress.section("plan", config.page_sizes.len() * builders);
    let mut rows = Vec::new();
    let mut counter = Instructions::new();
    for &page_size in &config.page_sizes {
        let page = ByteSize(page_size);
        progress.step(format!("{page} layout and check"));
        let shape = RestoreShape { objects: config.objects, ..RestoreShape::kimi_k3(page_size) };
        let work = RestoreWorkload::new(shape, config.contiguity, config.seed);
        let fragments = shape.fragments();
        let verified = verify(&work)?;

        progress.step(format!("{page} floor"));
        let mut floor_out = Vec::new();
        let floor = measure(config.warmup, config.iterations, &mut counter, || {
            let t = Instant::now();
            work.floor(&mut floor_out);
            black_box(&floor_out);
            Sample { nanos: t.elapsed().as_nanos(), plans: 1, segments: floor_out.len() }
        });

        let mut buffered_builder =
            BufferedPlanBuilder::new(RulePlanner::new(MemoryRules, work.registry.clone()));
        let mut failed = None;
        let buffered = (!config.skip_buffered).then(|| {
            progress.step(format!("{page} buffered"));
            measure(config.warmup, config.iterations, &mut counter, || {
                let t = Instant::now();
                let plans = work.plan_with(&mut buffered_builder);
                let nanos = t.elapsed().as_nanos();
                sample(nanos, plans, &mut failed, drop)
            })
        });

        progress.step(format!("{page} incremental"));
        let mut incremental_builder = IncrementalBuilder::new(MemoryRules, work.registry.clone());
        let incremental = measure(config.warmup, config.iterations, &mut counter, || {
            let t = Instant::now();
            let plans = work.plan_with_runs(&mut incremental_builder);
            let nanos = t.elapsed().as_nanos();
            sample(nanos, plans, &mut failed, |p| incremental_builder.recycle(p))
        });

        progress.step(format!("{page} incremental-push"));
        let mut push_builder = IncrementalBuilder::new(MemoryRules, work.registry.clone());
        let incremental_push = measure(config.warmup, config.iterations, &mut counter, || {
            let t = Instant::now();
            let plans = work.plan_with(&mut push_builder);
            let nanos = t.elapsed().as_nanos();
            sample(nanos, plans, &mut failed, |p| push_builder.recycle(p))
        });
        if let Some(e) = failed {
            return Err(e);
        }

        // What every engine adds at submit: the overlap rule over the finished plan set.
        progress.step(format!("{page} overlap check"));
        let plans = work.plan_with_runs(&mut incremental_builder)?;
        let table = work.registry.snapshot();
        let locate = |id| table.get(id).map(|e: &Endpoint| (Space::Host, e.addr()));
        let mut check = OverlapCheck::new();
        let no_overlap = check.conflicts(&plans, locate).is_empty();
        let overlap = measure(config.warmup, config.iterations, &mut counter, || {
            let t = Instant::now();
            let conflicts = check.conflicts(&plans, locate);
            let nanos = t.elapsed().as_nanos();
            black_box(&conflicts);
            Sample { nanos, plans: plans.plans().len(), segments: plans.segment_count() }
        });

        let floor_nanos = floor.median.nanos.max(1) as f64;
        let measured = [
            ("floor", Some(floor)),
            ("buffered", buffered),
            ("incremental", Some(incremental)),
            ("incremental-push", Some(incremental_push)),
            ("overlap-check", Some(overlap)),
        ];
        for (name, m) in measured.into_iter().filter_map(|(name, m)| Some((name, m?))) {
            let s = m.median;
            rows.push(PlanRow {
                builder: name,
                page_size,
                fragments,
                plans: s.plans,
                segments: s.segments,
                ns_per_fragment: s.nanos as f64 / fragments as f64,
                median_ms: s.nanos as f64 / 1e6,
                spread: m.spread,
                instructions_per_fragment: m.instructions.map(|i| i / fragments as f64),
                allocs_per_iter: m.allocs,
                minor_faults_per_iter: m.faults,
                vs_floor: s.nanos as f64 / floor_nanos,
                adjacent_fraction: work.table.adjacent_fraction,
                load: crate::measure::load_average(),
                cpus: crate::measure::cpus(),
                verified: match name {
                    "floor" => true,
                    // The restore's plans overlap nowhere, so the check must find nothing.
                    "overlap-check" => no_overlap,
                    _ => verified,
                },
            });
        }
    }
    Ok(rows)
}

/// Builds the restore's plan set once with each builder and checks they all equal the batch
/// planner's result: the timed runs then measure builders known to agree.
fn verify(work: &RestoreWorkload) -> Result<bool, Error> {
    let planner = RulePlanner::new(MemoryRules, work.registry.clone());
    let expected = work.plan_with(&mut BufferedPlanBuilder::new(planner))?;
    let mut incremental = IncrementalBuilder::new(MemoryRules, work.registry.clone());
    let by_runs = work.plan_with_runs(&mut incremental)?;
    let by_push = work.plan_with(&mut incremental)?;
    let no_rejections = expected.rejected().is_empty();
    Ok(no_rejections && by_runs == expected && by_push == expected)
}

/// Counts what a timed iteration built, then hands the plan set to `done` (drop or recycle).
fn sample(
    nanos: u128,
    plans: Result<PlanSet, Error>,
    failed: &mut Option<Error>,
    done: impl FnOnce(PlanSet),
) -> Sample {
    match plans {
        Ok(p) => {
            let s = Sample { nanos, plans: p.plans().len(), segments: p.segment_count() };
            done(p);
            s
        }
        Err(e) => {
            failed.get_or_insert(e);
            Sample { nanos, plans: 0, segments: 0 }
        }
    }
}

/// The human table, with one line per page size on the targets.
pub fn table(rows: &[PlanRow]) -> String {
    let mut out = String::from(
        "plan building, Kimi-K3 restore shape (page walk + push + finish, no bytes move)\n\n",
    );
    out += &format!(
        "{:>9} {:<16} {:>9} {:>6} {:>9} {:>8} {:>9} {:>7} {:>10} {:>8} {:>8} {:>8} {:>8}\n",
        "page",
        "builder",
        "fragments",
        "plans",
        "segments",
        "ns/frag",
        "median ms",
        "spread",
        "instr/frag",
        "allocs",
        "faults",
        "x floor",
        "verified"
    );
    for r in rows {
        out += &format!(
            "{:>9} {:<16} {:>9} {:>6} {:>9} {:>8.2} {:>9.3} {:>6.0}% {:>10} {:>8.1} {:>8.1} {:>8.2} {:>8}\n",
            ByteSize(r.page_size).to_string(),
            r.builder,
            r.fragments,
            r.plans,
            r.segments,
            r.ns_per_fragment,
            r.median_ms,
            r.spread * 100.0,
            r.instructions_per_fragment.map_or("-".to_owned(), |i| format!("{i:.1}")),
            r.allocs_per_iter,
            r.minor_faults_per_iter,
            r.vs_floor,
            if r.verified { "yes" } else { "NO" }
        );
    }
    out.push('\n');
    for page_size in page_sizes(rows) {
        let get = |b: &str| rows.iter().find(|r| r.page_size == page_size && r.builder == b);
        if let (Some(inc), Some(buf)) = (get("incremental"), get("buffered")) {
            out += &format!(
                "{:>9}: incremental {:.2} ns/fragment (budget 5), {:.2}x the floor (budget 3x), \
                 {:.1}x faster than buffered (target 3x), {:.0} allocs and {:.0} faults per plan; \
                 {:.0}% of pages adjacent\n",
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
    let max_spread = rows.iter().map(|r| r.spread).fold(0.0, f64::max);
    let load = rows.iter().map(|r| r.load).fold(0.0, f64::max);
    let cpus = rows.iter().map(|r| r.cpus).max().unwrap_or(1);
    if let Some(warning) = crate::measure::busy_warning(max_spread, load, cpus) {
        out += &format!("\n{warning}\n");
    }
    if rows.iter().all(|r| r.instructions_per_fragment.is_none()) {
        let why = Instructions::new().unavailable().map(str::to_owned);
        out += &format!(
            "\ninstructions per fragment: no CPU counters here ({}); count them with \
             callgrind: {CALLGRIND}\n",
            why.as_deref().unwrap_or("the kernel multiplexed them")
        );
    }
    out
}

/// Page sizes of `rows`, largest first, each once.
fn page_sizes(rows: &[PlanRow]) -> Vec<u64> {
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.page_size).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    sizes
}

/// The chart: ns per fragment of every builder, grouped by page size, with the 5 ns budget.
pub fn chart(rows: &[PlanRow]) -> BarChart {
    let mut chart = BarChart::new("Plan building, Kimi-K3 restore shape", "ns per fragment");
    let sizes = page_sizes(rows);
    if let Some(first) = rows.first() {
        chart.subtitle = format!(
            "page walk + push + finish, {} objects x 24 ranges of 1 MiB, no bytes move",
            first.fragments * first.page_size / (24 << 20)
        );
    }
    chart.groups = sizes.iter().map(|&p| format!("{} pages", ByteSize(p))).collect();
    let mut builders: Vec<&'static str> = Vec::new();
    for r in rows {
        if !builders.contains(&r.builder) {
            builders.push(r.builder);
        }
    }
    chart.series = builders
        .iter()
        .map(|&b| {
            let values = sizes
                .iter()
                .map(|&p| {
                    rows.iter()
                        .find(|r| r.builder == b && r.page_size == p)
                        .map(|r| r.ns_per_fragment)
                })
                .collect();
            Series::new(b, values)
        })
        .collect();
    chart.references = vec![Reference { value: 5.0, label: "budget: 5 ns per fragment".into() }];
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builder_agrees_and_rows_are_complete() {
        let config = PlanBenchConfig {
            page_sizes: vec![64 << 10, 32 << 10],
            objects: 6,
            iterations: 1,
            warmup: 0,
            ..PlanBenchConfig::default()
        };
        let rows = run(&config, &Progress::quiet()).unwrap();
        assert_eq!(rows.len(), 10, "four builders and the overlap check at two page sizes");
        for r in &rows {
            assert!(
                r.verified,
                "{} at {} disagrees with the batch planner",
                r.builder, r.page_size
            );
            let expected = 6 * 24 * ((1u64 << 20) / r.page_size);
            assert_eq!(r.fragments, expected);
            if r.builder != "floor" {
                assert_eq!(r.plans, 24, "one plan per destination");
                assert!(r.segments as u64 <= r.fragments && r.segments > 0);
            }
        }
    }

    #[test]
    fn contiguity_sets_how_many_pages_are_adjacent() {
        for contiguity in [0.0, 0.5, 1.0] {
            let shape = RestoreShape { objects: 40, ..RestoreShape::kimi_k3(64 << 10) };
            let table = PageTable::scatter(&shape, contiguity, 7);
            assert!(
                (table.adjacent_fraction - contiguity).abs() < 0.05,
                "{contiguity}: {}",
                table.adjacent_fraction
            );
            // Every tier page is used exactly once.
            let mut seen: Vec<u64> =
                (0..shape.objects).flat_map(|o| table.object(o).to_vec()).collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), shape.objects * shape.pages_per_object());
        }
    }
}
