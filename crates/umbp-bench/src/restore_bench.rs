//! `umbp-bench restore`: the Kimi-K3 restore shape, scaled to this machine, from a DRAM arena,
//! from an SSD file, and mixed, into the simulated device through the composite engine.
//!
//! Every object is stored twice with the same page layout, once in a DRAM arena and once in a
//! file, so a run picks each object's tier freely. SSD pages reach device memory by the staged
//! route (SSD engine into a pinned bounce region, device engine from it). The mixed run is
//! compared with its two halves run alone: when the engines overlap, it takes about as long as
//! the slower half. Bytes are verified after timing.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject, Staging};
use umbp_hbm::{DeviceRegion, HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    BatchState, DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, TransferEngine,
};
use umbp_ssd::{FileOptions, SsdConfig, SsdEngine};

use crate::chart::{BarChart, Reference, Series};
use crate::progress::Progress;
use crate::shape::{PageTable, RestoreShape};

/// Settings of `umbp-bench restore`.
#[derive(Clone, Debug)]
pub struct RestoreBenchConfig {
    /// Objects restored (43 objects of 24 MiB is about 1 GiB; the full prefix is 651).
    pub objects: usize,
    /// Page size of both tiers.
    pub page_size: u64,
    /// Fraction of objects the mixed run reads from SSD.
    pub ssd_fraction: f64,
    /// Fraction of an object's consecutive pages stored adjacently.
    pub contiguity: f64,
    /// Timed iterations per run; the median is reported.
    pub iterations: usize,
    /// Where the SSD file is created (a directory on the filesystem to measure).
    pub dir: std::path::PathBuf,
}

impl Default for RestoreBenchConfig {
    fn default() -> Self {
        Self {
            objects: 43,
            page_size: 64 << 10,
            ssd_fraction: 0.5,
            contiguity: 0.1,
            iterations: 3,
            dir: std::env::temp_dir(),
        }
    }
}

/// One restore run.
#[derive(Clone, Debug, Serialize)]
pub struct RestoreRow {
    /// `dram`, `ssd`, `mixed`, or `dram-half` / `ssd-half` (the mixed run's halves alone).
    pub source: &'static str,
    /// `incremental` (each engine's own builder) or `buffered` (the buffered baseline).
    pub builder: &'static str,
    /// Objects restored.
    pub objects: usize,
    /// Bytes restored.
    pub bytes: u64,
    /// Median wall time of plan + submit + wait.
    pub seconds: f64,
    /// Bytes per second in GiB/s.
    pub gib_s: f64,
    /// Every object completed and every destination byte matched after timing.
    pub verified: bool,
    /// Mixed runs: time over the slower of the two halves run alone; `null` on other rows.
    pub ratio_to_slower_half: Option<f64>,
}

/// The tiers, engines and destinations of a restore.
struct Setup {
    shape: RestoreShape,
    table: PageTable,
    arena: Vec<u8>,
    arena_id: EndpointId,
    file_id: EndpointId,
    hbm: Arc<HbmEngine<SimDevice>>,
    destinations: Vec<DeviceRegion>,
    _bounce: Vec<u8>,
    _dir: tempfile::TempDir,
}

fn setup(config: &RestoreBenchConfig, buffered: bool) -> anyhow::Result<(Setup, CompositeEngine)> {
    let shape = RestoreShape { objects: config.objects, ..RestoreShape::kimi_k3(config.page_size) };
    let table = PageTable::scatter(&shape, config.contiguity, 7);
    let tier_len = table.tier_pages * shape.page_size;
    let arena: Vec<u8> = (0..tier_len).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    let dir = tempfile::tempdir_in(&config.dir)?;
    let path = dir.path().join("kv-tier.bin");
    std::fs::File::create(&path)?.write_all(&arena)?;

    let registry = EndpointRegistry::new();
    let gpu = DeviceOrdinal::new(0);
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let hbm_config = HbmConfig { pin_registered_host: Some(gpu), ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), hbm_config));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::new())?);
    let file_id = ssd.open_file(&path, 0, tier_len, FileOptions::new().writable(false))?;
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd];
    let mut composite = CompositeEngine::new(registry, engines);
    if buffered {
        composite = composite.with_buffered_builders();
    }
    let mut arena = arena;
    let mut bounce = vec![0u8; 64 << 20];
    // SAFETY: both buffers live in the returned Setup, alive for every restore of the bench.
    let (arena_id, bounce_id) = unsafe {
        (
            composite.register(Endpoint::host(arena.as_mut_ptr() as u64, tier_len))?,
            composite.register(Endpoint::host(bounce.as_mut_ptr() as u64, bounce.len() as u64))?,
        )
    };
    composite = composite.with_staging(Staging::new(bounce_id))?;
    let destination_len = shape.objects as u64 * shape.range_len;
    let destinations = (0..shape.ranges)
        .map(|_| hbm.alloc_device(gpu, destination_len))
        .collect::<Result<Vec<_>, _>>()?;
    let setup = Setup {
        shape,
        table,
        arena,
        arena_id,
        file_id,
        hbm,
        destinations,
        _bounce: bounce,
        _dir: dir,
    };
    Ok((setup, composite))
}

impl Setup {
    /// Restores `objects` (each from SSD when `from_ssd(object)`), timed, then verified.
    fn run(
        &self,
        composite: &CompositeEngine,
        objects: &[usize],
        from_ssd: impl Fn(usize) -> bool,
        iterations: usize,
    ) -> (f64, bool) {
        let s = &self.shape;
        let ranges: Vec<Vec<ObjectRange>> = objects
            .iter()
            .map(|&b| {
                (0..s.ranges)
                    .map(|r| {
                        ObjectRange::new(
                            r as u64 * s.range_len,
                            s.range_len,
                            self.destinations[r].id,
                            b as u64 * s.range_len,
                        )
                    })
                    .collect()
            })
            .collect();
        let batch: Vec<ObjectTransfer> = objects
            .iter()
            .zip(&ranges)
            .map(|(&b, ranges)| ObjectTransfer {
                tag: b as u64,
                object: PagedObject {
                    tier: if from_ssd(b) { self.file_id } else { self.arena_id },
                    pages: self.table.object(b),
                    page_size: s.page_size,
                    size: s.object_size(),
                },
                ranges,
            })
            .collect();
        let mut builder = composite.builder();
        let mut times = Vec::new();
        let mut completed = true;
        // One untimed restore first: it warms the builders, the pool and the file's path.
        let warm = restore(&mut builder, &batch);
        completed &= warm.is_ok_and(|r| r.aggregate == BatchState::Completed);
        for _ in 0..iterations.max(1) {
            for d in &self.destinations {
                let _ = self.hbm.runtime().fill(d.addr, d.len, 0xA5);
            }
            let t = Instant::now();
            let report = restore(&mut builder, &batch);
            times.push(t.elapsed().as_secs_f64());
            completed &= report.is_ok_and(|r| r.aggregate == BatchState::Completed);
        }
        times.sort_by(f64::total_cmp);
        (times[times.len() / 2], completed && self.verify(objects))
    }

    /// Whether every restored range holds its object's bytes.
    fn verify(&self, objects: &[usize]) -> bool {
        let s = &self.shape;
        let page = s.page_size as usize;
        self.destinations.iter().enumerate().all(|(r, d)| {
            let Ok(bytes) = self.hbm.runtime().read(d.addr, d.len) else { return false };
            objects.iter().all(|&b| {
                let pages = self.table.object(b);
                let first = (r as u64 * s.range_len / s.page_size) as usize;
                let per_range = (s.range_len / s.page_size) as usize;
                (0..per_range).all(|k| {
                    let at = b * s.range_len as usize + k * page;
                    let src = pages[first + k] as usize;
                    bytes[at..at + page] == self.arena[src..src + page]
                })
            })
        })
    }
}

/// Runs every restore: DRAM only, SSD only, the mixed run and its halves (each engine's own
/// builders), and the mixed run with buffered builders.
pub fn run(config: &RestoreBenchConfig, progress: &Progress) -> anyhow::Result<Vec<RestoreRow>> {
    progress.section("restore", 8);
    let mut rows = Vec::new();
    let n = config.objects;
    let all: Vec<usize> = (0..n).collect();
    // Spread the SSD objects evenly: object b is on SSD when its share crosses a whole step.
    let on_ssd = |b: usize| {
        let f = config.ssd_fraction;
        ((b + 1) as f64 * f).floor() > (b as f64 * f).floor()
    };
    let ssd_half: Vec<usize> = all.iter().copied().filter(|&b| on_ssd(b)).collect();
    let dram_half: Vec<usize> = all.iter().copied().filter(|&b| !on_ssd(b)).collect();
    let bytes_of = |objects: &[usize], s: &RestoreShape| objects.len() as u64 * s.object_size();

    progress.step("writing the tiers");
    let (setup_inc, composite) = setup(config, false)?;
    let shape = setup_inc.shape;
    let row = |source, builder, objects: &[usize], (seconds, verified): (f64, bool)| {
        let bytes = bytes_of(objects, &shape);
        RestoreRow {
            source,
            builder,
            objects: objects.len(),
            bytes,
            seconds,
            gib_s: bytes as f64 / seconds / (1u64 << 30) as f64,
            verified,
            ratio_to_slower_half: None,
        }
    };
    let it = config.iterations;
    progress.step("dram");
    rows.push(row("dram", "incremental", &all, setup_inc.run(&composite, &all, |_| false, it)));
    progress.step("ssd");
    rows.push(row("ssd", "incremental", &all, setup_inc.run(&composite, &all, |_| true, it)));
    progress.step("dram half alone");
    let dram_alone = setup_inc.run(&composite, &dram_half, |_| false, it);
    progress.step("ssd half alone");
    let ssd_alone = setup_inc.run(&composite, &ssd_half, |_| true, it);
    progress.step("mixed");
    let mixed = setup_inc.run(&composite, &all, on_ssd, it);
    let slower = dram_alone.0.max(ssd_alone.0);
    rows.push(row("dram-half", "incremental", &dram_half, dram_alone));
    rows.push(row("ssd-half", "incremental", &ssd_half, ssd_alone));
    let mut mixed_row = row("mixed", "incremental", &all, mixed);
    mixed_row.ratio_to_slower_half = Some(mixed.0 / slower);
    rows.push(mixed_row);
    drop(composite);
    drop(setup_inc);

    progress.step("writing the tiers again");
    let (setup_buf, composite) = setup(config, true)?;
    progress.step("mixed, buffered builders");
    let mixed_buffered = setup_buf.run(&composite, &all, on_ssd, it);
    let mut buffered_row = row("mixed", "buffered", &all, mixed_buffered);
    buffered_row.ratio_to_slower_half = Some(mixed_buffered.0 / slower);
    rows.push(buffered_row);
    Ok(rows)
}

/// The human table.
pub fn table(rows: &[RestoreRow]) -> String {
    let objects = rows.iter().map(|r| r.objects).max().unwrap_or(0);
    let mut out = format!(
        "restore of the Kimi-K3 shape into the simulated device, {objects} objects of 24 MiB\n\n"
    );
    out += &format!(
        "{:<10} {:<12} {:>7} {:>9} {:>8} {:>8} {:>13}\n",
        "source", "builder", "objects", "seconds", "GiB/s", "verified", "x slower half"
    );
    for r in rows {
        let ratio = r.ratio_to_slower_half.map_or(String::new(), |x| format!("{x:.2}"));
        out += &format!(
            "{:<10} {:<12} {:>7} {:>9.3} {:>8.2} {:>8} {:>13}\n",
            r.source,
            r.builder,
            r.objects,
            r.seconds,
            r.gib_s,
            if r.verified { "yes" } else { "NO" },
            ratio
        );
    }
    if let Some(mixed) = rows.iter().find(|r| r.source == "mixed" && r.builder == "incremental") {
        if let Some(ratio) = mixed.ratio_to_slower_half {
            out += &format!(
                "\nmixed DRAM + SSD restore: {ratio:.2}x the slower half run alone (target: at most 1.1x)\n"
            );
        }
    }
    out
}

/// The chart: seconds per restore for each source and builder, with the mixed run's target.
pub fn chart(rows: &[RestoreRow]) -> BarChart {
    let mut chart = BarChart::new("Restore into the simulated device, by source", "seconds");
    let objects = rows.iter().map(|r| r.objects).max().unwrap_or(0);
    chart.subtitle = format!(
        "Kimi-K3 shape, {objects} objects of 24 MiB; halves: the mixed run's DRAM and SSD objects alone"
    );
    let mut sources: Vec<&'static str> = Vec::new();
    for r in rows {
        if !sources.contains(&r.source) {
            sources.push(r.source);
        }
    }
    chart.groups = sources.iter().map(|s| (*s).to_owned()).collect();
    chart.series = ["incremental", "buffered"]
        .into_iter()
        .filter(|b| rows.iter().any(|r| r.builder == *b))
        .map(|b| {
            let values = sources
                .iter()
                .map(|s| rows.iter().find(|r| r.source == *s && r.builder == b).map(|r| r.seconds))
                .collect();
            Series::new(format!("{b} builders"), values)
        })
        .collect();
    let half = |name: &str| rows.iter().find(|r| r.source == name).map(|r| r.seconds);
    if let (Some(dram), Some(ssd)) = (half("dram-half"), half("ssd-half")) {
        chart.references = vec![Reference {
            value: 1.1 * dram.max(ssd),
            label: "mixed target: 1.1x the slower half".into(),
        }];
    }
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_restore_of_a_small_scale_is_verified() {
        let config =
            RestoreBenchConfig { objects: 2, iterations: 1, ..RestoreBenchConfig::default() };
        let rows = run(&config, &Progress::quiet()).unwrap();
        let sources: Vec<&str> = rows.iter().map(|r| r.source).collect();
        assert_eq!(sources, ["dram", "ssd", "dram-half", "ssd-half", "mixed", "mixed"]);
        for r in &rows {
            assert!(r.verified, "{r:?}");
        }
        assert!(rows[4].ratio_to_slower_half.is_some());
        assert_eq!(rows[5].builder, "buffered");
    }
}
