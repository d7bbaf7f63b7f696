//! `umbp-bench churn`: register, restore, deregister, a million times over: state that grows
//! with the number of registrations made so far (ids never reused, tables copied whole,
//! snapshots and caches never pruned) shows as cycles that slow down and memory that climbs.
//!
//! One composite holds the host copy engine and the device engine on the simulated device,
//! and a DRAM tier: an arena of `objects × pages` pages of `page_size` bytes in shuffled order,
//! registered once. A *cycle* is what a server does per request: register a destination
//! through the composite (a host buffer, `--to host`; or device memory the device engine
//! allocates, `--to device`), restore `objects` whole objects from the tier into it with one
//! reused builder, wait, and end the registration. The same destination buffer is registered
//! every cycle (a registration hands it back), so the cycles allocate nothing that grows.
//!
//! After `warmup` untimed cycles, `cycles` cycles are timed in blocks of `window / 10`
//! cycles. The figures compare the first `window` cycles with the last `window`:
//!
//! - time per cycle of each window, the median of its ten blocks with their spread
//!   ([`Timed`]); `ratio` is last over first, with the range the ratio spans over both
//!   windows' blocks ([`ratio_range`]). Target: at most 1.2, judged on the range (met only when
//!   all of it is at most 1.2, unmet when none is, within noise otherwise);
//! - the same in CPU time of the whole process per cycle (`cpu_*`: every thread, the
//!   composite's executors included), which a shared machine's other work does not stretch as
//!   it stretches wall time: where the wall figures wander with the machine's load, the CPU
//!   figures say whether the work per cycle grew;
//! - resident memory (`VmRSS`) at the start, after the warmup and at the end; `rss_growth` is
//!   end over after-warmup. Target: at most 1.1.
//!
//! The registry's slot count at the end says how many endpoint slots the million
//! registrations left behind (the arena, the destination's, any staging). The bytes of the
//! first and the last timed cycle are checked against the tier (`verified`).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{BatchState, DeviceOrdinal, EndpointId, EndpointRegistry, Register};

use crate::measure::{ratio_range, verdict_text, Timed, Verdict};
use crate::progress::Progress;
use crate::shape::SplitMix;
use crate::size::ByteSize;

/// The simulated device the `device` destinations live on.
const GPU: DeviceOrdinal = DeviceOrdinal::new(0);
/// Pages of each object.
const PAGES_PER_OBJECT: usize = 4;
/// The byte every destination holds before a verified cycle.
const POISON: u8 = 0xA5;

/// Where each cycle's destination lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum ChurnTarget {
    /// A host buffer registered through the composite (the host copy engine restores into it).
    #[value(name = "host")]
    Host,
    /// Device memory the device engine allocates and registers (the simulated device).
    #[value(name = "device")]
    Device,
}

impl ChurnTarget {
    /// The name in rows: `host` or `device`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Device => "device",
        }
    }
}

/// Settings of `umbp-bench churn`.
#[derive(Clone, Debug)]
pub struct ChurnBenchConfig {
    /// Timed cycles. Default 1,000,000.
    pub cycles: usize,
    /// Cycles of each compared window (the first and the last), timed in ten blocks. At least
    /// 10 and at most half of `cycles`. Default 10,000.
    pub window: usize,
    /// Untimed cycles before timing. Default 1,000.
    pub warmup: usize,
    /// Objects restored per cycle. Default 4.
    pub objects: usize,
    /// Page size of the tier. Default 4 KiB.
    pub page_size: u64,
    /// Where the destinations live. Default host.
    pub target: ChurnTarget,
    /// Seed of the page placement and the data.
    pub seed: u64,
}

impl Default for ChurnBenchConfig {
    fn default() -> Self {
        Self {
            cycles: 1_000_000,
            window: 10_000,
            warmup: 1_000,
            objects: 4,
            page_size: 4 << 10,
            target: ChurnTarget::Host,
            seed: 42,
        }
    }
}

impl ChurnBenchConfig {
    /// The target of `ratio` (last window over first): at most 1.2.
    pub const TARGET_RATIO: f64 = 1.2;
    /// The target of `rss_growth` (end over after warmup): at most 1.1.
    pub const TARGET_RSS_GROWTH: f64 = 1.1;
}

/// The result of one churn run.
#[derive(Clone, Debug, Serialize)]
pub struct ChurnRow {
    /// `host` or `device`.
    pub target: &'static str,
    /// Timed cycles.
    pub cycles: usize,
    /// Cycles per compared window.
    pub window: usize,
    /// Objects restored per cycle.
    pub objects: usize,
    /// Bytes restored per cycle.
    pub bytes_per_cycle: u64,
    /// Microseconds per cycle over the first window: median of its ten blocks, and spread.
    pub first_us_per_cycle: Timed,
    /// Microseconds per cycle over the last window.
    pub last_us_per_cycle: Timed,
    /// Last over first (medians).
    pub ratio: f64,
    /// The range the ratio spans over both windows' blocks.
    pub ratio_range: Option<[f64; 2]>,
    /// The target: at most this.
    pub target_ratio: f64,
    /// `ratio` against its target, judged on its range.
    pub time_verdict: Verdict,
    /// CPU microseconds (all threads) per cycle over the first window.
    pub first_cpu_us_per_cycle: Timed,
    /// CPU microseconds per cycle over the last window.
    pub last_cpu_us_per_cycle: Timed,
    /// Last over first, in CPU time (medians).
    pub cpu_ratio: f64,
    /// The range the CPU ratio spans over both windows' blocks.
    pub cpu_ratio_range: Option<[f64; 2]>,
    /// `cpu_ratio` against the same target, judged on its range.
    pub cpu_verdict: Verdict,
    /// Resident memory before the warmup, in MiB.
    pub rss_start_mib: f64,
    /// Resident memory after the warmup, in MiB.
    pub rss_warm_mib: f64,
    /// Resident memory after the last cycle, in MiB.
    pub rss_end_mib: f64,
    /// End over after warmup.
    pub rss_growth: f64,
    /// The target: at most this.
    pub target_rss_growth: f64,
    /// `rss_growth` against its target.
    pub rss_verdict: Verdict,
    /// The registry's endpoint slots after the last cycle.
    pub registry_slots: usize,
    /// Every byte of the first and the last timed cycle's restore matched the tier.
    pub verified: bool,
    /// Wall time of the timed cycles, in seconds.
    pub seconds: f64,
}

/// The device engine, the tier's layout and the per-cycle buffers (the composite and the
/// tier's registration live beside it, borrowed by the builder).
struct Rig {
    hbm: Arc<HbmEngine<SimDevice>>,
    arena_id: EndpointId,
    /// Each object's page offsets in the arena.
    pages: Vec<[u64; PAGES_PER_OBJECT]>,
    /// What object `k` holds, in object order, concatenated: what a destination must hold.
    expected: Vec<u8>,
    /// The host destination, registered and handed back every cycle.
    host: Option<Vec<u8>>,
    object_size: u64,
}

/// Runs the churn: `warmup` cycles, then `cycles` timed ones.
pub fn run(config: &ChurnBenchConfig, progress: &Progress) -> anyhow::Result<ChurnRow> {
    check(config)?;
    progress.section("churn", 3);
    progress.step("building the tier");
    let rss_start = rss_bytes()?;
    let (composite, arena, mut rig) = rig(config)?;
    let mut builder = composite.builder();

    progress.step(format!("{} warmup cycles", config.warmup));
    for _ in 0..config.warmup {
        cycle(&composite, &mut rig, &mut builder, config, false)?;
    }
    let rss_warm = rss_bytes()?;

    progress.step(format!("{} timed cycles", config.cycles));
    let block = config.window / 10;
    let mut blocks_us: Vec<f64> = Vec::with_capacity(config.cycles.div_ceil(block));
    let mut blocks_cpu_us: Vec<f64> = Vec::with_capacity(config.cycles.div_ceil(block));
    let mut verified = true;
    let started = Instant::now();
    let mut block_started = Instant::now();
    let mut block_cpu = process_cpu_seconds()?;
    for i in 0..config.cycles {
        let check = i == 0 || i + 1 == config.cycles;
        verified &= cycle(&composite, &mut rig, &mut builder, config, check)?;
        if (i + 1) % block == 0 {
            let (now, cpu) = (Instant::now(), process_cpu_seconds()?);
            blocks_us.push((now - block_started).as_secs_f64() * 1e6 / block as f64);
            blocks_cpu_us.push((cpu - block_cpu) * 1e6 / block as f64);
            (block_started, block_cpu) = (now, cpu);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let rss_end = rss_bytes()?;
    drop(builder);
    // The arena's slot, the destination's (reused), nothing more.
    let registry_slots = composite.registry().snapshot().slot_count();
    drop(arena);

    let per_window = config.window / block;
    let first = &blocks_us[..per_window];
    let whole = config.cycles / block;
    let last = &blocks_us[whole - per_window..whole];
    let (first_t, last_t) = (Timed::of(first), Timed::of(last));
    let ratio = last_t.median / first_t.median;
    let range = ratio_range(last, first);
    let (first_cpu, last_cpu) =
        (&blocks_cpu_us[..per_window], &blocks_cpu_us[whole - per_window..whole]);
    let (first_cpu_t, last_cpu_t) = (Timed::of(first_cpu), Timed::of(last_cpu));
    let cpu_range = ratio_range(last_cpu, first_cpu);
    let rss_growth = rss_end as f64 / rss_warm as f64;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    Ok(ChurnRow {
        target: config.target.name(),
        cycles: config.cycles,
        window: config.window,
        objects: config.objects,
        bytes_per_cycle: config.objects as u64 * rig.object_size,
        first_us_per_cycle: first_t,
        last_us_per_cycle: last_t,
        ratio,
        ratio_range: range,
        target_ratio: ChurnBenchConfig::TARGET_RATIO,
        time_verdict: Verdict::range_at_most(range, ChurnBenchConfig::TARGET_RATIO),
        first_cpu_us_per_cycle: first_cpu_t,
        last_cpu_us_per_cycle: last_cpu_t,
        cpu_ratio: last_cpu_t.median / first_cpu_t.median,
        cpu_ratio_range: cpu_range,
        cpu_verdict: Verdict::range_at_most(cpu_range, ChurnBenchConfig::TARGET_RATIO),
        rss_start_mib: mib(rss_start),
        rss_warm_mib: mib(rss_warm),
        rss_end_mib: mib(rss_end),
        rss_growth,
        target_rss_growth: ChurnBenchConfig::TARGET_RSS_GROWTH,
        rss_verdict: Verdict::at_most(Some(rss_growth), ChurnBenchConfig::TARGET_RSS_GROWTH, 0.0),
        registry_slots,
        verified,
        seconds,
    })
}

fn check(config: &ChurnBenchConfig) -> anyhow::Result<()> {
    if config.window < 10 || config.window % 10 != 0 {
        bail!("--window must be a multiple of 10 (got {})", config.window);
    }
    if config.window.saturating_mul(2) > config.cycles {
        bail!("--cycles ({}) must be at least twice --window ({})", config.cycles, config.window);
    }
    if config.objects == 0 || config.page_size == 0 {
        bail!("--objects and --page-size must be positive");
    }
    Ok(())
}

/// The composite, the tier's registration and the rest of the rig.
type Built = (CompositeEngine, umbp_plan::Registration<Vec<u8>>, Rig);

fn rig(config: &ChurnBenchConfig) -> anyhow::Result<Built> {
    let registry = EndpointRegistry::new();
    let localcopy = Arc::new(LocalCopyEngine::new(Arc::clone(&registry)));
    let device = Arc::new(SimDevice::new(1));
    let hbm = Arc::new(HbmEngine::new(device, Arc::clone(&registry), HbmConfig::default()));
    let composite = CompositeEngine::new(registry, vec![localcopy, hbm.clone()]);

    let page = usize::try_from(config.page_size).context("--page-size")?;
    let pages_total = config.objects * PAGES_PER_OBJECT;
    let mut rng = SplitMix(config.seed);
    let mut slots: Vec<usize> = (0..pages_total).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut arena = vec![0u8; pages_total * page];
    let mut expected = vec![0u8; pages_total * page];
    for (b, byte) in expected.iter_mut().enumerate() {
        *byte = (rng.next_u64() >> 24) as u8 ^ (b as u8);
    }
    let mut pages = Vec::with_capacity(config.objects);
    for k in 0..config.objects {
        let mut offsets = [0u64; PAGES_PER_OBJECT];
        for (p, offset) in offsets.iter_mut().enumerate() {
            let logical = k * PAGES_PER_OBJECT + p;
            let slot = slots[logical];
            arena[slot * page..(slot + 1) * page]
                .copy_from_slice(&expected[logical * page..(logical + 1) * page]);
            *offset = (slot * page) as u64;
        }
        pages.push(offsets);
    }
    let arena = composite.register_memory(arena).context("registering the tier")?;
    let arena_id = arena.id();
    let object_size = config.page_size * PAGES_PER_OBJECT as u64;
    let host = (config.target == ChurnTarget::Host).then(|| vec![POISON; expected.len()]);
    Ok((composite, arena, Rig { hbm, arena_id, pages, expected, host, object_size }))
}

/// One cycle: register the destination, restore every object into it, end the registration.
/// With `check`, poisons the destination first and returns whether it then held every byte.
fn cycle(
    composite: &CompositeEngine,
    rig: &mut Rig,
    builder: &mut umbp_composite::CompositeBuilder,
    config: &ChurnBenchConfig,
    check: bool,
) -> anyhow::Result<bool> {
    let len = rig.expected.len() as u64;
    match config.target {
        ChurnTarget::Host => {
            let mut buffer = rig.host.take().context("the host destination")?;
            if check {
                buffer.fill(POISON);
            }
            let registration =
                composite.register_memory(buffer).context("registering the destination")?;
            restore_into(rig, builder, registration.id())?;
            let buffer = registration.deregister();
            let ok = !check || buffer == rig.expected;
            rig.host = Some(buffer);
            Ok(ok)
        }
        ChurnTarget::Device => {
            let registration = rig.hbm.alloc_device(GPU, len).context("allocating the device")?;
            let addr = registration.endpoint().addr();
            if check {
                rig.hbm.runtime().fill(addr, len, POISON)?;
            }
            restore_into(rig, builder, registration.id())?;
            let ok = !check || rig.hbm.runtime().read(addr, len)? == rig.expected;
            drop(registration);
            Ok(ok)
        }
    }
}

/// Restores every object of the tier into `dst` (object `k` at `k × object size`).
fn restore_into(
    rig: &Rig,
    builder: &mut umbp_composite::CompositeBuilder,
    dst: EndpointId,
) -> anyhow::Result<()> {
    let size = rig.object_size;
    let ranges: Vec<[ObjectRange; 1]> =
        (0..rig.pages.len()).map(|k| [ObjectRange::new(0, size, dst, k as u64 * size)]).collect();
    let objects: Vec<ObjectTransfer<'_>> = rig
        .pages
        .iter()
        .zip(&ranges)
        .enumerate()
        .map(|(k, (pages, ranges))| {
            ObjectTransfer::new(
                k as u64,
                PagedObject::new(rig.arena_id, pages, size / PAGES_PER_OBJECT as u64, size),
                ranges,
            )
        })
        .collect();
    let report = restore(builder, &objects).context("restoring")?;
    if report.aggregate != BatchState::Completed {
        let failed = report.unsuccessful().next();
        bail!("a restore did not complete: {failed:?}");
    }
    Ok(())
}

/// CPU time this process (all its threads) has used so far, in seconds.
fn process_cpu_seconds() -> anyhow::Result<f64> {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid, writable timespec; the call writes nothing else.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("clock_gettime");
    }
    Ok(now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9)
}

/// This process's resident memory (`VmRSS` of `/proc/self/status`), in bytes.
fn rss_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status").context("/proc/self/status")?;
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .context("VmRSS in /proc/self/status")?;
    Ok(kib * 1024)
}

/// The human-readable table.
pub fn table(row: &ChurnRow) -> String {
    let mut out = format!(
        "register + restore + deregister, {} cycles ({} objects, {} per cycle, into {}), first \
         {} vs last {} cycles\n\n",
        row.cycles,
        row.objects,
        ByteSize(row.bytes_per_cycle),
        row.target,
        row.window,
        row.window
    );
    out += &format!(
        "{:<22} {:>14} {:>14} {:>9} {:>7} {:>26}\n",
        "figure", "first", "last", "ratio", "target", "verdict"
    );
    let us = |t: &Timed| format!("{:.2} ±{:.0}%", t.median, t.spread * 100.0);
    out += &format!(
        "{:<22} {:>14} {:>14} {:>9.2} {:>6.1}x {:>26}\n",
        "µs per cycle",
        us(&row.first_us_per_cycle),
        us(&row.last_us_per_cycle),
        row.ratio,
        row.target_ratio,
        verdict_text(row.time_verdict, row.ratio_range)
    );
    out += &format!(
        "{:<22} {:>14} {:>14} {:>9.2} {:>6.1}x {:>26}\n",
        "CPU µs per cycle",
        us(&row.first_cpu_us_per_cycle),
        us(&row.last_cpu_us_per_cycle),
        row.cpu_ratio,
        row.target_ratio,
        verdict_text(row.cpu_verdict, row.cpu_ratio_range)
    );
    out += &format!(
        "{:<22} {:>14} {:>14} {:>9} {:>6.1}x {:>26}\n",
        "RSS MiB (warm, end)",
        format!("{:.1}", row.rss_warm_mib),
        format!("{:.1}", row.rss_end_mib),
        format!("{:.3}", row.rss_growth),
        row.target_rss_growth,
        verdict_text(row.rss_verdict, None)
    );
    out += &format!(
        "\nRSS at start {:.1} MiB; registry slots at the end: {}; {:.1} s timed; verified: {}\n",
        row.rss_start_mib,
        row.registry_slots,
        row.seconds,
        if row.verified { "yes" } else { "NO" }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_churn_restores_every_byte_and_reuses_its_slots() {
        for target in [ChurnTarget::Host, ChurnTarget::Device] {
            let config = ChurnBenchConfig {
                cycles: 200,
                window: 50,
                warmup: 10,
                target,
                ..Default::default()
            };
            let row = run(&config, &Progress::quiet()).unwrap();
            assert!(row.verified, "{target:?}");
            assert!(row.first_us_per_cycle.median > 0.0 && row.last_us_per_cycle.median > 0.0);
            // The arena and one destination at a time.
            assert!(row.registry_slots <= 3, "{target:?}: {} slots", row.registry_slots);
        }
        let bad = ChurnBenchConfig { cycles: 100, window: 60, ..Default::default() };
        assert!(run(&bad, &Progress::quiet()).is_err(), "a window past half the cycles");
    }
}
