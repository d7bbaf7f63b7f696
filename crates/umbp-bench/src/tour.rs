//! The tour: what `umbp-bench` runs without arguments.
//!
//! Four parts on embedded defaults sized for a 2-core, 24 GiB machine (15 to 40 seconds in a
//! release build), then one summary line per headline figure with its target:
//!
//! 1. `plan`: plan building for the Kimi-K3 restore shape, as `umbp-bench plan` runs it;
//! 2. `restore`: the Kimi-K3 shape scaled to 8 objects (192 MiB), from DRAM, from an SSD file
//!    in a temporary directory (removed afterwards) and mixed, into the simulated device, every
//!    restore verified byte for byte;
//! 3. `batch`: 4,096 transfers of 4 KiB as one batch submit against 4,096 single submits, for
//!    the host, simulated-device and SSD engines (fewer iterations than `umbp-bench batch`);
//! 4. `remote`: the remote engine restoring 4 objects at 64 KiB pages from a `serve` child
//!    process over loopback TCP, against `ucx_perftest`, as `umbp-bench remote` does with fewer
//!    objects and sizes. Skipped, with the reason, where UCX does not load (or no `umbp-bench`
//!    binary is given to start the server with: [`TourConfig::remote_server`]).
//!
//! [`TourConfig::tiny`] shrinks every part so the whole tour runs in seconds (for tests and
//! smoke checks; its figures mean little).

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use crate::batch_bench::{self, BatchBenchConfig, BatchRow};
use crate::measure::{spread_interval, Verdict};
use crate::plan_bench::{self, PlanBenchConfig, PlanRow};
use crate::progress::Progress;
use crate::remote_bench::{self, RemoteBenchConfig, RemoteRow, ServerChoice};
use crate::report::Report;
use crate::restore_bench::{self, RestoreBenchConfig, RestoreRow};
use crate::size::ByteSize;

/// Settings of the tour.
#[derive(Clone, Debug)]
pub struct TourConfig {
    /// Run every part at a tiny scale. Default false.
    pub tiny: bool,
    /// Directory for the temporary SSD files. Default the system's temporary directory.
    pub dir: PathBuf,
    /// The `umbp-bench` binary the remote part starts its memory node with (the command
    /// passes itself); `None` skips the remote part. Default `None`.
    pub remote_server: Option<PathBuf>,
}

impl Default for TourConfig {
    fn default() -> Self {
        Self { tiny: false, dir: std::env::temp_dir(), remote_server: None }
    }
}

impl TourConfig {
    /// The plan part's settings.
    pub fn plan(&self) -> PlanBenchConfig {
        if self.tiny {
            PlanBenchConfig { objects: 4, iterations: 1, warmup: 0, ..PlanBenchConfig::default() }
        } else {
            PlanBenchConfig::default()
        }
    }

    /// The restore part's settings.
    pub fn restore(&self) -> RestoreBenchConfig {
        let (objects, iterations) = if self.tiny { (1, 1) } else { (8, 3) };
        RestoreBenchConfig {
            objects,
            iterations,
            dir: self.dir.clone(),
            // The many-callers sweep is `umbp-bench restore`'s; the tour keeps to one caller.
            callers: vec![1],
            // A tiny tour (the tests') measures nothing worth a fio run.
            fio: !self.tiny,
            ..RestoreBenchConfig::default()
        }
    }

    /// The remote part's settings, when it runs.
    pub fn remote(&self) -> Option<RemoteBenchConfig> {
        let program = self.remote_server.clone()?;
        let (objects, repeats) = if self.tiny { (1, 1) } else { (4, 3) };
        Some(RemoteBenchConfig {
            server: ServerChoice::Child { program },
            fragment_sizes: vec![64 << 10],
            objects,
            repeats,
            ..RemoteBenchConfig::default()
        })
    }

    /// The batch part's settings.
    pub fn batch(&self) -> BatchBenchConfig {
        let base = BatchBenchConfig { dir: self.dir.clone(), ..BatchBenchConfig::default() };
        if self.tiny {
            BatchBenchConfig { transfers: 64, iterations: 1, ssd_iterations: 1, ..base }
        } else {
            BatchBenchConfig { iterations: 31, ssd_iterations: 3, ..base }
        }
    }
}

/// One headline figure of the summary.
#[derive(Clone, Debug, Serialize)]
pub struct Headline {
    /// The part it comes from: `plan`, `restore`, `batch` or `remote`.
    pub part: &'static str,
    /// What it is, in words.
    pub figure: String,
    /// The measured value; `null` when it has none (a difference below its noise).
    pub value: Option<f64>,
    /// Unit of `value` and `target`.
    pub unit: &'static str,
    /// How `value` must compare with `target`: `<=`, `>=` or `==`.
    pub comparison: &'static str,
    /// The target.
    pub target: f64,
    /// `met`, `unmet`, `within noise` or `below noise`; only `met` counts.
    pub verdict: Verdict,
    /// The interval the measured value lies in, given its spread, where the part reports one
    /// (`[low, high]`); the verdict is `within noise` when the target lies inside it.
    pub interval: Option<[f64; 2]>,
}

impl Headline {
    fn new(
        part: &'static str,
        figure: impl Into<String>,
        value: f64,
        unit: &'static str,
        comparison: &'static str,
        target: f64,
    ) -> Self {
        let verdict = match comparison {
            "<=" => Verdict::at_most(Some(value), target, 0.0),
            ">=" => Verdict::at_least(Some(value), target, 0.0),
            _ if value == target => Verdict::Met,
            _ => Verdict::Unmet,
        };
        Self::judged(part, figure, Some(value), unit, comparison, target, verdict)
    }

    /// A headline whose verdict its part already reached (with the figure's spread and noise).
    fn judged(
        part: &'static str,
        figure: impl Into<String>,
        value: Option<f64>,
        unit: &'static str,
        comparison: &'static str,
        target: f64,
        verdict: Verdict,
    ) -> Self {
        Self {
            part,
            figure: figure.into(),
            value,
            unit,
            comparison,
            target,
            verdict,
            interval: None,
        }
    }

    /// The same headline, its value known to lie in `interval`.
    fn within(mut self, interval: Option<[f64; 2]>) -> Self {
        self.interval = interval.filter(|[low, high]| low.is_finite() && high.is_finite());
        self
    }

    /// The verdict in words, with the interval behind it when it has one:
    /// `within noise [0.85, 0.97]`.
    pub fn verdict_text(&self) -> String {
        crate::measure::verdict_text(self.verdict, self.interval)
    }

    /// Where the score (measured / target, or target / measured for `<=`) lies, from the
    /// interval.
    fn score_interval(&self) -> Option<[f64; 2]> {
        let [low, high] = self.interval?;
        let t = self.target;
        let [a, b] =
            if self.comparison == ">=" { [low / t, high / t] } else { [t / high, t / low] };
        (a.is_finite() && b.is_finite() && a > 0.0).then_some([a, b])
    }

    /// Whether the target was met.
    pub fn met(&self) -> bool {
        self.verdict.is_met()
    }
}

/// Everything the tour measured.
#[derive(Clone, Debug)]
pub struct Tour {
    /// The plan part's rows.
    pub plan: Vec<PlanRow>,
    /// The restore part's rows.
    pub restore: Vec<RestoreRow>,
    /// The batch part's rows.
    pub batch: Vec<BatchRow>,
    /// The remote part's rows (none when it was skipped).
    pub remote: Vec<RemoteRow>,
    /// One line per headline figure.
    pub summary: Vec<Headline>,
    /// Wall time of the whole tour.
    pub seconds: f64,
}

/// Runs the three parts, handing each part's [`Report`] to `part_done` as soon as it is
/// measured, and returns everything with the summary.
pub fn run(
    config: &TourConfig,
    progress: &Progress,
    part_done: &mut dyn FnMut(Report) -> anyhow::Result<()>,
) -> anyhow::Result<Tour> {
    let start = Instant::now();
    progress.set_prefix("tour 1/4 · ");
    let plan = plan_bench::run(&config.plan(), progress)?;
    part_done(Report::new(
        "plan",
        &plan,
        plan_bench::table(&plan),
        Some(plan_bench::chart(&plan)),
    )?)?;

    progress.set_prefix("tour 2/4 · ");
    let restore = restore_bench::run(&config.restore(), progress)?;
    let chart = restore_bench::chart(&restore);
    part_done(Report::new("restore", &restore, restore_bench::table(&restore), Some(chart))?)?;

    progress.set_prefix("tour 3/4 · ");
    let batch = batch_bench::run(&config.batch(), progress)?;
    part_done(Report::new(
        "batch",
        &batch,
        batch_bench::table(&batch),
        Some(batch_bench::chart(&batch)),
    )?)?;

    let remote = match (config.remote(), umbp_remote::ucx_available()) {
        (Some(remote_config), Ok(())) => {
            progress.set_prefix("tour 4/4 · ");
            let run = remote_bench::run(&remote_config, progress)?;
            let (text, chart) = (remote_bench::table(&run), remote_bench::chart(&run.restores));
            part_done(Report::new("remote", &run.lines(), text, Some(chart))?)?;
            run.restores
        }
        (Some(_), Err(e)) => {
            eprintln!("umbp-bench tour: skipping the remote part: {e}");
            Vec::new()
        }
        (None, _) => Vec::new(),
    };

    let summary = summarize(&plan, &restore, &batch, &remote);
    Ok(Tour { plan, restore, batch, remote, summary, seconds: start.elapsed().as_secs_f64() })
}

/// The headline figures and their targets (each subcommand's, as its `--help` and the crate
/// README state them).
pub fn summarize(
    plan: &[PlanRow],
    restore: &[RestoreRow],
    batch: &[BatchRow],
    remote: &[RemoteRow],
) -> Vec<Headline> {
    let mut lines = Vec::new();
    let mut page_sizes: Vec<u64> = plan.iter().map(|r| r.page_size).collect();
    page_sizes.sort_unstable();
    page_sizes.dedup();
    for &page in &page_sizes {
        let get = |b: &str| plan.iter().find(|r| r.page_size == page && r.builder == b);
        if let Some(inc) = get("incremental") {
            let figure = format!("incremental build, {} pages", ByteSize(page));
            let ns = inc.ns_per_fragment;
            let verdict = Verdict::at_most(Some(ns), 5.0, inc.spread);
            lines.push(
                Headline::judged("plan", figure, Some(ns), "ns/fragment", "<=", 5.0, verdict)
                    .within(spread_interval(ns, inc.spread)),
            );
            if let Some(buf) = get("buffered") {
                let figure = format!("incremental vs buffered, {} pages", ByteSize(page));
                let speedup = buf.median_ms / inc.median_ms;
                let verdict = Verdict::at_least(Some(speedup), 3.0, inc.spread + buf.spread);
                let unit = "x faster";
                lines.push(
                    Headline::judged("plan", figure, Some(speedup), unit, ">=", 3.0, verdict)
                        .within(spread_interval(speedup, inc.spread + buf.spread)),
                );
            }
        }
    }
    if let Some(allocs) = plan
        .iter()
        .filter(|r| r.builder == "incremental")
        .map(|r| r.allocs_per_iter)
        .reduce(f64::max)
    {
        let figure = "allocations per warm incremental build";
        lines.push(Headline::new("plan", figure, allocs, "allocations", "==", 0.0));
    }
    // The overlap-check rows are not builders: their `verified` says the check found nothing.
    let built: Vec<&PlanRow> = plan.iter().filter(|r| r.builder != "overlap-check").collect();
    let verified = built.iter().filter(|r| r.verified).count();
    let figure = format!("plan sets equal to the batch planner's (of {})", built.len());
    lines.push(Headline::new("plan", figure, verified as f64, "rows", "==", built.len() as f64));
    let checks = plan.len() - built.len();
    let clean = plan.iter().filter(|r| r.builder == "overlap-check" && r.verified).count();
    let figure = format!("overlap checks finding no overlap in the restore (of {checks})");
    lines.push(Headline::new("plan", figure, clean as f64, "rows", "==", checks as f64));

    if let Some(dram) = restore.iter().find(|r| r.source == "dram" && r.callers == 1) {
        if let (Some(vs), Some(verdict)) = (dram.vs_ceiling, dram.verdict) {
            let figure = "DRAM restore / one-thread host-copy ceiling";
            let line = Headline::judged("restore", figure, Some(vs), "of it", ">=", 0.9, verdict);
            lines.push(line.within(dram.verdict_interval));
        }
        if let (Some(vs), Some(verdict)) = (dram.vs_gather_ceiling, dram.gather_verdict) {
            let figure = "DRAM restore / the same pages gathered by one thread";
            let line = Headline::judged("restore", figure, Some(vs), "of it", ">=", 0.9, verdict);
            lines.push(line.within(dram.gather_interval));
        }
    }
    if let Some(ssd) = restore.iter().find(|r| r.source == "ssd" && r.callers == 1) {
        if let (Some(vs), Some(verdict)) = (ssd.vs_ceiling, ssd.verdict) {
            let figure = "SSD restore (staged) / fio reading the same bytes";
            let line = Headline::judged("restore", figure, Some(vs), "of it", ">=", 0.9, verdict);
            lines.push(line.within(ssd.verdict_interval));
        }
    }
    if let Some(mixed) = restore.iter().find(|r| r.source == "mixed" && r.builder == "incremental")
    {
        let figure = "mixed DRAM + SSD restore / its slower half alone";
        let verdict = mixed.verdict.unwrap_or(Verdict::WithinNoise);
        let ratio = mixed.ratio_to_slower_half;
        let line = Headline::judged("restore", figure, ratio, "x the time", "<=", 1.1, verdict);
        lines.push(line.within(mixed.verdict_interval));
    }
    let verified = restore.iter().filter(|r| r.verified).count();
    let figure = format!("restores byte-correct (of {})", restore.len());
    lines.push(Headline::new(
        "restore",
        figure,
        verified as f64,
        "restores",
        "==",
        restore.len() as f64,
    ));

    for r in batch {
        let figure = format!("single / batch submit ns per transfer, {}", r.engine);
        let (ratio, target) = (r.ratio, r.target_ratio);
        let line = Headline::judged("batch", figure, ratio, "x", ">=", target, r.verdict);
        lines.push(line.within(r.ratio_range));
    }
    let verified = batch.iter().filter(|r| r.verified).count();
    let figure = format!("engines byte-correct on both paths (of {})", batch.len());
    lines.push(Headline::new(
        "batch",
        figure,
        verified as f64,
        "engines",
        "==",
        batch.len() as f64,
    ));

    for r in remote.iter().filter(|r| r.verdict.is_some()) {
        let figure = format!("remote restore / ucx_perftest, {} pages", ByteSize(r.fragment_size));
        let verdict = r.verdict.unwrap_or(Verdict::WithinNoise);
        lines.push(Headline::judged("remote", figure, r.ratio, "of it", ">=", 0.8, verdict));
    }
    if !remote.is_empty() {
        let verified = remote.iter().filter(|r| r.verified).count();
        let figure = format!("remote restores byte-correct (of {})", remote.len());
        let (value, target) = (verified as f64, remote.len() as f64);
        lines.push(Headline::new("remote", figure, value, "restores", "==", target));
    }
    lines
}

/// The summary table.
pub fn table(tour: &Tour) -> String {
    let mut out = String::from("summary: headline figures against their targets\n\n");
    out += &format!(
        "{:<8} {:<62} {:>11} {:<17} {:>9}  {}\n",
        "part", "figure", "measured", "unit", "target", "verdict"
    );
    for h in &tour.summary {
        out += &format!(
            "{:<8} {:<62} {:>11} {:<17} {:>2} {:>6}  {}\n",
            h.part,
            h.figure,
            h.value.map_or("below noise".to_owned(), crate::chart::format_value),
            h.unit,
            h.comparison,
            crate::chart::format_value(h.target),
            h.verdict_text()
        );
    }
    let met = tour.summary.iter().filter(|h| h.met()).count();
    out += &format!(
        "\n{met} of {} targets met; the tour took {:.1} s\n",
        tour.summary.len(),
        tour.seconds
    );
    out
}

/// The tour's own report: the summary lines (the parts have their own reports).
pub fn report(tour: &Tour) -> anyhow::Result<Report> {
    Report::new("tour", &tour.summary, table(tour), Some(chart(tour)))
}

/// The chart: every headline with a numeric target as a score, so 1 is the target for all of
/// them: measured / target for `>=` targets, target / measured for `<=` ones. The `==` lines
/// (correctness, allocations) are left to the table.
pub fn chart(tour: &Tour) -> crate::chart::BarChart {
    use crate::chart::{BarChart, Reference, Series};
    let mut chart =
        BarChart::new("umbp-bench tour: headline figures against their targets", "score");
    chart.subtitle =
        "score: measured / target for \u{2265} targets, target / measured for \u{2264} \
                      targets; 1 or more: met"
            .into();
    let scored: Vec<&Headline> = tour.summary.iter().filter(|h| h.comparison != "==").collect();
    chart.groups = scored.iter().map(|h| short_name(h)).collect();
    let score = |h: &Headline| {
        let v = h.value?;
        let score = if h.comparison == ">=" { v / h.target } else { h.target / v };
        (score.is_finite() && score > 0.0).then_some(score)
    };
    // Within noise is neither met nor missed: a colour of its own, never the one of "not met".
    let series = |name: &str, color: &'static str, keep: fn(Verdict) -> bool| {
        let values = scored.iter().map(|h| score(h).filter(|_| keep(h.verdict))).collect();
        let errors = scored.iter().map(|h| h.score_interval().filter(|_| keep(h.verdict)));
        Series::new(name, values).with_color(color).with_errors(errors.collect())
    };
    chart.series = vec![
        series("met", "#59a14f", |v| v == Verdict::Met),
        series("within noise", "#bab0ac", |v| v == Verdict::WithinNoise),
        series("not met", "#e15759", |v| v == Verdict::Unmet),
    ];
    chart.log_y = true;
    chart.references = vec![Reference { value: 1.0, label: "target (score 1)".into() }];
    chart
}

/// A short x-axis label for a headline.
fn short_name(h: &Headline) -> String {
    let f = &h.figure;
    if let Some(engine) = f.strip_prefix("single / batch submit ns per transfer, ") {
        format!("batch {engine}")
    } else if let Some(page) = f.strip_prefix("incremental build, ") {
        format!("build {}", page.trim_end_matches(" pages"))
    } else if let Some(page) = f.strip_prefix("incremental vs buffered, ") {
        format!("vs buffered {}", page.trim_end_matches(" pages"))
    } else if f.starts_with("DRAM restore") {
        "dram vs ceiling".to_owned()
    } else if h.part == "restore" {
        "mixed restore".to_owned()
    } else {
        f.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headlines_compare_with_their_targets() {
        assert!(Headline::new("plan", "x", 4.0, "ns", "<=", 5.0).met());
        assert!(!Headline::new("plan", "x", 6.0, "ns", "<=", 5.0).met());
        assert!(Headline::new("batch", "x", 10.0, "x", ">=", 10.0).met());
        assert!(!Headline::new("plan", "x", 1.0, "allocs", "==", 0.0).met());
    }

    #[test]
    fn a_ratio_below_noise_is_never_met_and_never_drawn() {
        let h = Headline::judged("batch", "x", None, "x", ">=", 10.0, Verdict::BelowNoise);
        assert!(!h.met());
        let tour = Tour {
            plan: Vec::new(),
            restore: Vec::new(),
            batch: Vec::new(),
            remote: Vec::new(),
            summary: vec![h],
            seconds: 1.0,
        };
        let text = table(&tour);
        assert!(text.contains("below noise") && text.contains("0 of 1 targets met"), "{text}");
        let chart = chart(&tour);
        assert!(chart.series.iter().all(|s| s.values.iter().all(Option::is_none)));
    }

    #[test]
    fn a_tiny_tour_verifies_everything_and_summarizes_every_part() {
        let dir = tempfile::tempdir().unwrap();
        // No remote part: this test binary is not `umbp-bench` (the cli tests run it).
        let config = TourConfig { tiny: true, dir: dir.path().to_owned(), remote_server: None };
        let mut parts = Vec::new();
        let tour = run(&config, &Progress::quiet(), &mut |r| {
            parts.push(r.name);
            Ok(())
        })
        .unwrap();
        assert_eq!(parts, ["plan", "restore", "batch"]);
        assert!(tour.restore.iter().all(|r| r.verified));
        for part in ["plan", "restore", "batch"] {
            assert!(tour.summary.iter().any(|h| h.part == part), "{part}");
        }
        let correct =
            tour.summary.iter().filter(|h| h.comparison == "==" && h.unit != "allocations");
        // Plan sets, overlap checks, restores, batch engines.
        assert!(correct.clone().count() == 4 && correct.clone().all(|h| h.met()));
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "temporary files removed");
        let svg = chart(&tour).to_svg();
        assert!(svg.contains("batch ssd"));
    }
}
