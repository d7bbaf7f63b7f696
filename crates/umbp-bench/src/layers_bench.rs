//! `umbp-bench layers`: a layer-wise restore, as a server runs one while the model already
//! computes.
//!
//! The Kimi-K3 shape (scaled down) is restored into the simulated device from DRAM, from SSD and
//! mixed. Its 61 layers form layer groups of 8; each object's 24 ranges belong to the group of
//! the layer they hold (range `r` holds layer `r × 61 / 24`). A forward thread goes through the
//! 61 layers: before the first layer of a group it waits for that group, then it computes
//! (spins) for `compute_us` per layer.
//!
//! - `blocking`: the restore runs to the end, then the forward pass starts.
//! - `layered`: the restore starts (non-blocking) and the forward pass waits for each group.
//!
//! Reported per run: the restore's wall time, the time to the first group (`ttfg`), and the
//! stall (the forward pass's wall time beyond its compute). By default each source's compute
//! per layer makes the forward pass as long as that source's blocking restore measured in the
//! same run, so overlap matters. Bytes are verified after every run.

use std::time::{Duration, Instant};

use serde::Serialize;
use umbp_composite::{restore, start_restore, CompositeEngine};
use umbp_plan::BatchState;

use crate::chart::{BarChart, Series};
use crate::measure::{spread_interval, verdict_text, Verdict};
use crate::progress::Progress;
use crate::restore_bench::{setup, RestoreBenchConfig, Setup};

/// Settings of `umbp-bench layers`.
#[derive(Clone, Debug)]
pub struct LayersBenchConfig {
    /// The restore: objects, page size, SSD fraction of the mixed run, where the file lives.
    pub restore: RestoreBenchConfig,
    /// Layers of the model.
    pub layers: usize,
    /// Layers per group.
    pub group_layers: usize,
    /// Compute per layer in microseconds; `None`: each source's blocking restore time / layers.
    pub compute_us: Option<f64>,
}

impl Default for LayersBenchConfig {
    fn default() -> Self {
        Self {
            restore: RestoreBenchConfig { objects: 16, ..RestoreBenchConfig::default() },
            layers: 61,
            group_layers: 8,
            compute_us: None,
        }
    }
}

/// One run of one source in one mode (medians over the iterations).
#[derive(Clone, Debug, Serialize)]
pub struct LayersRow {
    /// `dram`, `ssd` or `mixed`.
    pub source: &'static str,
    /// `blocking` or `layered`.
    pub mode: &'static str,
    /// Wall time of the whole restore, from its start.
    pub restore_ms: f64,
    /// Time from the restore's start until the forward pass may start its first layer.
    pub ttfg_ms: f64,
    /// The forward pass's wall time beyond its compute: time spent waiting for groups.
    pub stall_ms: f64,
    /// Compute per layer.
    pub compute_us: f64,
    /// Spread of the restore time over the iterations: (slowest - fastest) / median.
    pub spread: f64,
    /// Every object completed and every destination byte matched.
    pub verified: bool,
}

/// Spins for `d`: the forward pass's compute.
fn compute(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

/// The median of `values` (not empty).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// What one iteration measured, in seconds.
struct Sample {
    restore: f64,
    ttfg: f64,
    stall: f64,
    completed: bool,
}

struct Run<'a> {
    setup: &'a Setup,
    composite: &'a CompositeEngine,
    config: &'a LayersBenchConfig,
    objects: Vec<usize>,
}

impl Run<'_> {
    /// Layer group of range `r`.
    fn group(&self, r: usize) -> u32 {
        let layer = r * self.config.layers / self.setup.shape.ranges;
        (layer / self.config.group_layers) as u32
    }

    fn forward(&self, per_layer: Duration, mut wait: impl FnMut(u32)) {
        for layer in 0..self.config.layers {
            if layer % self.config.group_layers == 0 {
                wait((layer / self.config.group_layers) as u32);
            }
            compute(per_layer);
        }
    }

    /// The restore to the end, then the forward pass.
    fn blocking(&self, from_ssd: &dyn Fn(usize) -> bool, per_layer: Duration) -> Sample {
        let ranges = self.setup.ranges(&self.objects, |r| self.group(r));
        let batch = self.setup.transfers(&self.objects, &ranges, from_ssd);
        let mut builder = self.composite.builder();
        self.setup.poison();
        let t0 = Instant::now();
        let completed =
            restore(&mut builder, &batch).is_ok_and(|r| r.aggregate == BatchState::Completed);
        let restore = t0.elapsed().as_secs_f64();
        self.forward(per_layer, |_| {});
        let stall = t0.elapsed().as_secs_f64() - self.compute_total(per_layer);
        Sample { restore, ttfg: restore, stall, completed }
    }

    /// The restore started, the forward pass waiting for each group as it goes.
    fn layered(&self, from_ssd: &dyn Fn(usize) -> bool, per_layer: Duration) -> Sample {
        let ranges = self.setup.ranges(&self.objects, |r| self.group(r));
        let objects = self.setup.transfers(&self.objects, &ranges, from_ssd);
        let mut builder = self.composite.builder();
        self.setup.poison();
        let t0 = Instant::now();
        let Ok(batch) = start_restore(&mut builder, &objects) else {
            return Sample { restore: 0.0, ttfg: 0.0, stall: 0.0, completed: false };
        };
        let (restore, ttfg, forward_end, completed) = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let report = batch.wait();
                (t0.elapsed().as_secs_f64(), report.aggregate == BatchState::Completed)
            });
            let mut ttfg = None;
            self.forward(per_layer, |group| {
                batch.wait_group(group);
                ttfg.get_or_insert_with(|| t0.elapsed().as_secs_f64());
            });
            let forward_end = t0.elapsed().as_secs_f64();
            let (restore, completed) = waiter.join().unwrap_or((0.0, false));
            (restore, ttfg.unwrap_or(0.0), forward_end, completed)
        });
        let stall = forward_end - self.compute_total(per_layer);
        Sample { restore, ttfg, stall: stall.max(0.0), completed }
    }

    fn compute_total(&self, per_layer: Duration) -> f64 {
        per_layer.as_secs_f64() * self.config.layers as f64
    }
}

/// Runs both modes for every source.
pub fn run(config: &LayersBenchConfig, progress: &Progress) -> anyhow::Result<Vec<LayersRow>> {
    progress.section("layers", 7);
    progress.step("writing the tiers");
    let (setup, composite) = setup(&config.restore)?;
    let n = config.restore.objects;
    let f = config.restore.ssd_fraction;
    let on_ssd = move |b: usize| ((b + 1) as f64 * f).floor() > (b as f64 * f).floor();
    let run = Run { setup: &setup, composite: &composite, config, objects: (0..n).collect() };
    let iterations = config.restore.iterations.max(1);
    let mut rows = Vec::new();
    let sources: [(&'static str, &dyn Fn(usize) -> bool); 3] =
        [("dram", &|_| false), ("ssd", &|_| true), ("mixed", &on_ssd)];
    for (source, from_ssd) in sources {
        progress.step(format!("{source}: blocking, then layered"));
        // Untimed: the first warms the builders, the pools and the file's pages; the second
        // measures the blocking restore that sets the default compute.
        run.blocking(from_ssd, Duration::ZERO);
        let calibration = run.blocking(from_ssd, Duration::ZERO);
        let per_layer = match config.compute_us {
            Some(us) => Duration::from_secs_f64(us / 1e6),
            None => Duration::from_secs_f64(calibration.restore / config.layers as f64),
        };
        let mut samples: [Vec<Sample>; 2] = [Vec::new(), Vec::new()];
        for _ in 0..iterations {
            // Alternate the modes so that drift on a shared machine hits both alike.
            samples[0].push(run.blocking(from_ssd, per_layer));
            samples[1].push(run.layered(from_ssd, per_layer));
        }
        for (mode, samples) in ["blocking", "layered"].into_iter().zip(samples) {
            let verified = samples.iter().all(|s| s.completed) && setup.verify(&run.objects);
            let restores: Vec<f64> = samples.iter().map(|s| s.restore).collect();
            let restore_ms = median(restores.clone()) * 1e3;
            let (lo, hi) =
                restores.iter().fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            rows.push(LayersRow {
                source,
                mode,
                restore_ms,
                ttfg_ms: median(samples.iter().map(|s| s.ttfg).collect()) * 1e3,
                stall_ms: median(samples.iter().map(|s| s.stall).collect()) * 1e3,
                compute_us: per_layer.as_secs_f64() * 1e6,
                spread: (hi - lo) * 1e3 / restore_ms,
                verified,
            });
        }
    }
    Ok(rows)
}

/// The blocking and layered rows of `source`.
fn pair<'a>(rows: &'a [LayersRow], source: &str) -> Option<(&'a LayersRow, &'a LayersRow)> {
    let find = |mode: &str| rows.iter().find(|r| r.source == source && r.mode == mode);
    Some((find("blocking")?, find("layered")?))
}

/// The layered figures against their targets for one source: time to the first group over the
/// blocking restore (target at most 0.25), and layered stall over blocking stall (at most 0.5).
pub fn ratios(rows: &[LayersRow], source: &str) -> Option<(f64, f64)> {
    let (blocking, layered) = pair(rows, source)?;
    Some((layered.ttfg_ms / blocking.restore_ms, layered.stall_ms / blocking.stall_ms.max(1e-9)))
}

/// The human table.
pub fn table(rows: &[LayersRow]) -> String {
    let mut out = String::from(
        "layer-wise restore into the simulated device (61 layers, groups of 8, compute per layer)\n\n",
    );
    out += &format!(
        "{:<6} {:<9} {:>11} {:>7} {:>9} {:>9} {:>11} {:>8}\n",
        "source", "mode", "restore ms", "spread", "ttfg ms", "stall ms", "compute us", "verified"
    );
    for r in rows {
        out += &format!(
            "{:<6} {:<9} {:>11.1} {:>6.0}% {:>9.1} {:>9.1} {:>11.0} {:>8}\n",
            r.source,
            r.mode,
            r.restore_ms,
            r.spread * 100.0,
            r.ttfg_ms,
            r.stall_ms,
            r.compute_us,
            if r.verified { "yes" } else { "NO" }
        );
    }
    out += "\n";
    for source in ["dram", "ssd", "mixed"] {
        let (Some((ttfg, stall)), Some((blocking, layered))) =
            (ratios(rows, source), pair(rows, source))
        else {
            continue;
        };
        // The rows measure only the restore's spread; the ratios are judged by the two
        // restores' spreads together, as the best the rows know of their noise.
        let spread = blocking.spread + layered.spread;
        let judged = |ratio: f64, target: f64| {
            let verdict = Verdict::at_most(Some(ratio), target, spread);
            verdict_text(verdict, spread_interval(ratio, spread))
        };
        out += &format!(
            "{source}: first group at {ttfg:.2}x the blocking restore: {} (target: at most \
             0.25), stall {stall:.2}x the blocking stall: {} (target: at most 0.5)\n",
            judged(ttfg, 0.25),
            judged(stall, 0.5)
        );
    }
    out
}

/// The chart: per source, the blocking restore against the layered run's time to the first
/// group and stall.
pub fn chart(rows: &[LayersRow]) -> BarChart {
    let mut chart = BarChart::new("Layer-wise restore: first group and stall", "milliseconds");
    chart.subtitle = "61 layers in groups of 8; targets: first group at most 0.25x, stall at \
                      most 0.5x the blocking restore's"
        .into();
    let sources = ["dram", "ssd", "mixed"];
    chart.groups = sources.iter().map(|s| (*s).to_owned()).collect();
    let series = |name: &str, value: fn(&LayersRow, &LayersRow) -> f64| {
        let values = sources.iter().map(|s| pair(rows, s).map(|(b, l)| value(b, l))).collect();
        Series::new(name.to_owned(), values)
    };
    chart.series = vec![
        series("blocking restore", |b, _| b.restore_ms),
        series("layered: first group", |_, l| l.ttfg_ms),
        series("blocking stall", |b, _| b.stall_ms),
        series("layered stall", |_, l| l.stall_ms),
    ];
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_layered_restore_is_verified_and_its_first_group_comes_first() {
        let config = LayersBenchConfig {
            restore: RestoreBenchConfig {
                objects: 2,
                iterations: 1,
                ..RestoreBenchConfig::default()
            },
            compute_us: Some(200.0),
            ..LayersBenchConfig::default()
        };
        let rows = run(&config, &Progress::quiet()).unwrap();
        let shape: Vec<(&str, &str)> = rows.iter().map(|r| (r.source, r.mode)).collect();
        assert_eq!(
            shape,
            [
                ("dram", "blocking"),
                ("dram", "layered"),
                ("ssd", "blocking"),
                ("ssd", "layered"),
                ("mixed", "blocking"),
                ("mixed", "layered")
            ]
        );
        for r in &rows {
            assert!(r.verified, "{r:?}");
            assert!(r.ttfg_ms <= r.restore_ms + 1e-6, "{r:?}");
            assert_eq!(r.compute_us, 200.0);
        }
        for source in ["dram", "ssd", "mixed"] {
            let (blocking, _) = pair(&rows, source).unwrap();
            assert_eq!(
                blocking.ttfg_ms, blocking.restore_ms,
                "blocking: the first group is the whole restore"
            );
        }
    }
}
