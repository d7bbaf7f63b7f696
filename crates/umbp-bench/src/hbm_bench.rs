//! `umbp-bench hbm`: the gather kernel against one copy per fragment.
//!
//! For each fragment size, a batch of scattered fragments moves from pinned host memory into
//! one device buffer twice: once with the engine's default rule (many small fragments: one
//! gather launch per chunk) and once with the kernel switched off (one copy per fragment). The
//! time covers plan building, submit and wait. Bytes are verified after timing.
//!
//! On the simulated device both modes run on the CPU: the figures measure descriptor building
//! and CPU execution, not a GPU. With the `hip` feature and an AMD GPU the HIP backend is used.

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use umbp_hbm::{DeviceRuntime, HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    DeviceOrdinal, EndpointRegistry, Fragment, PlanBuilder, Register, Registration, Tag,
    TransferEngine,
};

use crate::chart::{BarChart, Series};
use crate::progress::Progress;
use crate::shape::SplitMix;
use crate::size::ByteSize;

/// Settings of `umbp-bench hbm`.
#[derive(Clone, Debug)]
pub struct HbmBenchConfig {
    /// Fragment sizes to measure.
    pub fragment_sizes: Vec<u64>,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// Timed iterations per mode; the median is reported.
    pub iterations: usize,
}

impl Default for HbmBenchConfig {
    fn default() -> Self {
        Self {
            fragment_sizes: vec![4 << 10, 16 << 10, 64 << 10, 256 << 10],
            batch_bytes: 64 << 20,
            iterations: 5,
        }
    }
}

/// One mode at one fragment size.
#[derive(Clone, Debug, Serialize)]
pub struct HbmRow {
    /// `sim` or `hip`.
    pub backend: &'static str,
    /// `gather` (the engine's default rule) or `copies` (kernel off).
    pub mode: &'static str,
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Fragments per batch.
    pub fragments: u64,
    /// Gather launches per batch.
    pub launches_per_batch: u64,
    /// Median seconds per batch.
    pub seconds: f64,
    /// Bytes per second, in GiB/s.
    pub gib_s: f64,
    /// Median time of `copies` over this mode's (1 for `copies`).
    pub speedup_vs_copies: f64,
    /// Every destination byte matched its source after timing.
    pub verified: bool,
}

/// Runs the comparison on the HIP backend when built with `hip` and a GPU is present,
/// otherwise on the simulated device.
pub fn run(config: &HbmBenchConfig, progress: &Progress) -> Vec<HbmRow> {
    progress.section("hbm", 2 * config.fragment_sizes.len());
    #[cfg(feature = "hip")]
    if let Ok(rt) = umbp_hbm::HipRuntime::new() {
        return run_on(Arc::new(rt), config, progress);
    }
    run_on(Arc::new(SimDevice::new(1)), config, progress)
}

/// The bytes of device memory `dev`, copied back to the host through the engine.
fn read_back<D: DeviceRuntime>(engine: &HbmEngine<D>, dev: &Registration) -> Option<Vec<u8>> {
    let len = dev.endpoint().len();
    let out = engine.register_memory(vec![0u8; len as usize]).ok()?;
    let mut builder = engine.incremental_builder();
    let planned = builder.begin_object(Tag::new(0)).is_ok()
        && builder.push(Fragment::new(dev.id(), 0, out.id(), 0, len, Tag::new(0))).is_ok()
        && builder.commit_object().is_ok();
    let ok = planned && builder.finish().is_ok_and(|plans| engine.submit(plans).wait().is_empty());
    ok.then(|| out.deregister())
}

fn run_on<D: DeviceRuntime>(
    runtime: Arc<D>,
    config: &HbmBenchConfig,
    progress: &Progress,
) -> Vec<HbmRow> {
    let backend = runtime.name();
    let device = DeviceOrdinal::new(0);
    let mut rows = Vec::new();
    for &size in &config.fragment_sizes {
        let fragments = (config.batch_bytes / size).max(1);
        let bytes = fragments * size;
        // Source pages scattered over a pinned host arena twice the batch.
        let host: Vec<u8> = (0..2 * bytes).map(|i| (i % 251) as u8).collect();
        let mut order: Vec<u64> = (0..2 * fragments).collect();
        let mut rng = SplitMix(size);
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let mut measured = Vec::new();
        for (mode, min_fragments) in [("gather", 2usize), ("copies", usize::MAX)] {
            progress.step(format!("{} fragments, {mode}", ByteSize(size)));
            // Host memory registered with the engine is pinned for the device.
            let engine_config = HbmConfig {
                kernel_min_fragments: min_fragments,
                pin_registered_host: Some(device),
                ..HbmConfig::default()
            };
            let engine = HbmEngine::new(runtime.clone(), EndpointRegistry::new(), engine_config);
            let Ok(dev) = engine.alloc_device(device, bytes) else { continue };
            let Ok(source) = engine.register_memory(host.clone()) else { continue };
            let (src, dst) = (source.id(), dev.id());
            let batch = |engine: &HbmEngine<D>| {
                let mut builder = engine.incremental_builder();
                let _ = builder.begin_object(Tag::new(0));
                for (i, &page) in order.iter().take(fragments as usize).enumerate() {
                    let f =
                        Fragment::new(src, page * size, dst, i as u64 * size, size, Tag::new(0));
                    let _ = builder.push(f);
                }
                let _ = builder.commit_object();
                match builder.finish() {
                    Ok(plans) => engine.submit(plans).wait().is_empty(),
                    Err(_) => false,
                }
            };
            batch(&engine); // warm-up (and, on HIP, the kernel's compilation)
            let launches0 = engine.launches();
            let mut times = Vec::new();
            let mut ok = true;
            for _ in 0..config.iterations.max(1) {
                let t = Instant::now();
                ok &= batch(&engine);
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let seconds = times[times.len() / 2];
            let launches = (engine.launches() - launches0) / config.iterations.max(1) as u64;
            let verified = ok
                && read_back(&engine, &dev).is_some_and(|got| {
                    order.iter().take(fragments as usize).enumerate().all(|(i, &page)| {
                        got[(i as u64 * size) as usize..][..size as usize]
                            == host[(page * size) as usize..][..size as usize]
                    })
                });
            measured.push((mode, seconds, launches, verified));
        }
        let copies = measured.iter().find(|m| m.0 == "copies").map_or(f64::NAN, |m| m.1);
        for (mode, seconds, launches, verified) in measured {
            rows.push(HbmRow {
                backend,
                mode,
                fragment_size: size,
                fragments,
                launches_per_batch: launches,
                seconds,
                gib_s: bytes as f64 / seconds / (1u64 << 30) as f64,
                speedup_vs_copies: copies / seconds,
                verified,
            });
        }
    }
    rows
}

/// The human table.
pub fn table(rows: &[HbmRow]) -> String {
    let backend = rows.first().map_or("none", |r| r.backend);
    let mut out =
        format!("device engine: gather kernel vs one copy per fragment, backend `{backend}`\n");
    if backend == "sim" {
        out +=
            "(simulated device: this measures descriptor building and CPU execution, not a GPU)\n";
    }
    out.push('\n');
    out += &format!(
        "{:>9} {:<7} {:>9} {:>8} {:>10} {:>8} {:>10} {:>8}\n",
        "fragment", "mode", "fragments", "launches", "ms/batch", "GiB/s", "x copies", "verified"
    );
    for r in rows {
        out += &format!(
            "{:>9} {:<7} {:>9} {:>8} {:>10.3} {:>8.2} {:>10.2} {:>8}\n",
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
    out
}

/// The chart: GiB/s of the gather kernel and of one copy per fragment, by fragment size.
pub fn chart(rows: &[HbmRow]) -> BarChart {
    let mut chart = BarChart::new("Device engine: gather kernel vs one copy per fragment", "GiB/s");
    let backend = rows.first().map_or("none", |r| r.backend);
    chart.subtitle = if backend == "sim" {
        "simulated device: descriptor building and CPU execution, not a GPU".to_owned()
    } else {
        format!("backend {backend}")
    };
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.fragment_size).collect();
    sizes.dedup();
    chart.groups = sizes.iter().map(|&s| format!("{} fragments", ByteSize(s))).collect();
    let value = |mode: &str, size: u64| {
        rows.iter().find(|r| r.mode == mode && r.fragment_size == size).map(|r| r.gib_s)
    };
    chart.series = ["gather", "copies"]
        .into_iter()
        .map(|mode| {
            let name = if mode == "gather" { "gather kernel" } else { "one copy per fragment" };
            Series::new(name, sizes.iter().map(|&s| value(mode, s)).collect())
        })
        .collect();
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_modes_run_verified_and_only_gather_launches() {
        let config = HbmBenchConfig {
            fragment_sizes: vec![4 << 10, 256 << 10],
            batch_bytes: 1 << 20,
            iterations: 1,
        };
        let rows = run(&config, &Progress::quiet());
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert!(r.verified, "{r:?}");
            let expected = if r.mode == "gather" && r.fragment_size < 128 << 10 { 1 } else { 0 };
            assert_eq!(r.launches_per_batch, expected, "{r:?}");
        }
    }
}
