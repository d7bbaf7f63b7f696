//! `umbp-bench hbm`: the device engine on one backend (the simulated device, HIP or CUDA).
//!
//! 1. **Checks**, each verified byte for byte: a 256 KiB host → device → host round trip,
//!    scattered misaligned pieces through exactly one gather launch, device → device, and six
//!    layer groups queued on the device's default stream with an event after each.
//!    Then the engine **calibrates** the device ([`HbmEngine::calibrate`]) and reports where
//!    it found the kernel faster; the measurements below use that threshold.
//! 2. **The link ceiling**: one large copy of the batch from pinned host memory to the device,
//!    and one back: the best the link does with the same bytes.
//! 3. **Gather against copies**: for each fragment size, a batch of scattered fragments moves
//!    host → device (into one buffer) and device → host, once with the engine's calibrated
//!    rule (`gather`: fragments under the threshold go through one launch per chunk) and once
//!    with the kernel switched off (`copies`: one runtime copy per fragment). The two modes
//!    alternate iteration by iteration.
//! 4. **A restore** of the Kimi-K3 shape (as `umbp-bench restore` lays it out, scaled to
//!    `restore_objects` objects) from pinned DRAM into one device buffer per layer group.
//!
//! Every timed figure covers plan building, submit and wait, and is reported as the median of
//! its iterations with their spread. Targets (for a GPU; on the simulated device both modes
//! run on the CPU and measure descriptor building, not a link): the gather kernel at least
//! 1.5× the copies below 128 KiB, and gather and restore at least 0.8 of the ceiling at 16 KiB
//! and larger fragments.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Serialize;
use umbp_hbm::{DeviceEvent, DeviceRuntime, HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    DeviceOrdinal, DeviceStream, EndpointId, EndpointRegistry, Fragment, PageWalk, PlanBuilder,
    Register, Registration, Tag, TransferEngine,
};

use crate::chart::{BarChart, Series};
use crate::host_buffer::HostBuffer;
use crate::measure::{spread_interval, verdict_text, Timed, Verdict};
use crate::progress::Progress;
use crate::shape::{PageTable, RestoreShape, SplitMix};
use crate::size::ByteSize;

/// Which device runtime the bench drives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum HbmBackend {
    /// CUDA if built in and a GPU answers, else HIP likewise, else the simulated device.
    Auto,
    /// The simulated device (always built).
    Sim,
    /// AMD GPUs (feature `hip`).
    Hip,
    /// NVIDIA GPUs (feature `cuda`).
    Cuda,
}

/// Settings of `umbp-bench hbm`.
#[derive(Clone, Debug)]
pub struct HbmBenchConfig {
    /// The runtime.
    pub backend: HbmBackend,
    /// Fragment sizes to measure.
    pub fragment_sizes: Vec<u64>,
    /// Bytes per batch (and of the ceiling's one copy).
    pub batch_bytes: u64,
    /// Timed iterations per mode; the median is reported.
    pub iterations: usize,
    /// Objects of the Kimi-K3-shaped restore (24 MiB each); 0 skips it.
    pub restore_objects: usize,
    /// Page size of the restore's DRAM tier.
    pub restore_page_size: u64,
}

impl Default for HbmBenchConfig {
    fn default() -> Self {
        Self {
            backend: HbmBackend::Auto,
            fragment_sizes: vec![4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10],
            batch_bytes: 64 << 20,
            iterations: 5,
            restore_objects: 8,
            restore_page_size: 64 << 10,
        }
    }
}

/// One check: what ran and whether every byte arrived.
#[derive(Clone, Debug, Serialize)]
pub struct HbmCheck {
    /// Always `check`, to tell these JSON lines from the measurements.
    pub kind: &'static str,
    /// `sim`, `hip` or `cuda`.
    pub backend: &'static str,
    /// What was checked.
    pub check: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// Whether every byte matched and the engine reported no failure.
    pub passed: bool,
}

/// One timed measurement.
#[derive(Clone, Debug, Serialize)]
pub struct HbmRow {
    /// `ceiling`, `gather`, `copies` or `restore`.
    pub kind: &'static str,
    /// `sim`, `hip` or `cuda`.
    pub backend: &'static str,
    /// `h2d` (pinned host to device) or `d2h`.
    pub direction: &'static str,
    /// Bytes per fragment (the whole batch for the ceiling; the page size for the restore).
    pub fragment_size: u64,
    /// Fragments per batch.
    pub fragments: u64,
    /// Gather launches per batch.
    pub launches_per_batch: u64,
    /// Median seconds per batch.
    pub seconds: f64,
    /// (slowest − fastest) / median over the iterations.
    pub spread: f64,
    /// Bytes per second at the median, in GiB/s.
    pub gib_s: f64,
    /// `copies` median time over this row's, for `gather` rows; `None` elsewhere.
    pub vs_copies: Option<f64>,
    /// This row's GiB/s over the ceiling's in the same direction; `None` for the ceiling.
    pub vs_ceiling: Option<f64>,
    /// Every destination byte matched its source after timing.
    pub verified: bool,
}

/// One size of the engine's calibration ([`HbmEngine::calibrate`]).
#[derive(Clone, Debug, Serialize)]
pub struct HbmCalibration {
    /// Always `calibration`.
    pub kind: &'static str,
    /// `sim`, `hip` or `cuda`.
    pub backend: &'static str,
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Best seconds with the gather kernel.
    pub kernel_seconds: f64,
    /// Best seconds with one copy per fragment.
    pub copies_seconds: f64,
    /// The threshold the device chose: buckets whose mean fragment is under it use the kernel.
    pub kernel_max_mean_bytes: u64,
}

/// What one run produced.
#[derive(Clone, Debug)]
pub struct HbmReport {
    /// The engine's calibration of the device.
    pub calibration: Vec<HbmCalibration>,
    /// The checks.
    pub checks: Vec<HbmCheck>,
    /// The measurements.
    pub rows: Vec<HbmRow>,
}

/// Runs the bench on the backend `config` names.
pub fn run(config: &HbmBenchConfig, progress: &Progress) -> anyhow::Result<HbmReport> {
    let steps =
        1 + 4 + 2 + 4 * config.fragment_sizes.len() + usize::from(config.restore_objects > 0);
    progress.section("hbm", steps);
    match config.backend {
        HbmBackend::Sim => run_on(Arc::new(SimDevice::new(1)), config, progress),
        HbmBackend::Cuda => run_cuda(config, progress),
        HbmBackend::Hip => run_hip(config, progress),
        HbmBackend::Auto => {
            #[cfg(feature = "cuda")]
            if let Ok(rt) = umbp_hbm::CudaRuntime::new() {
                return run_on(Arc::new(rt), config, progress);
            }
            #[cfg(feature = "hip")]
            if let Ok(rt) = umbp_hbm::HipRuntime::new() {
                return run_on(Arc::new(rt), config, progress);
            }
            run_on(Arc::new(SimDevice::new(1)), config, progress)
        }
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(config: &HbmBenchConfig, progress: &Progress) -> anyhow::Result<HbmReport> {
    let rt = umbp_hbm::CudaRuntime::new().context("starting the CUDA backend")?;
    run_on(Arc::new(rt), config, progress)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &HbmBenchConfig, _: &Progress) -> anyhow::Result<HbmReport> {
    bail!("this umbp-bench was built without the `cuda` feature")
}

#[cfg(feature = "hip")]
fn run_hip(config: &HbmBenchConfig, progress: &Progress) -> anyhow::Result<HbmReport> {
    let rt = umbp_hbm::HipRuntime::new().context("starting the HIP backend")?;
    run_on(Arc::new(rt), config, progress)
}

#[cfg(not(feature = "hip"))]
fn run_hip(_: &HbmBenchConfig, _: &Progress) -> anyhow::Result<HbmReport> {
    bail!("this umbp-bench was built without the `hip` feature")
}

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

/// Two engines over one registry and one runtime: `gather` (the calibrated rule; host memory
/// registered through it is pinned for the device) and `copies` (kernel off). Memory pinned
/// through `gather` is pinned for the driver, so `copies` moves it by DMA as well.
struct Rig<D: DeviceRuntime> {
    gather: HbmEngine<D>,
    copies: HbmEngine<D>,
}

impl<D: DeviceRuntime> Rig<D> {
    fn new(runtime: Arc<D>) -> Self {
        let registry = EndpointRegistry::new();
        let pinned = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
        let off = HbmConfig { kernel_min_fragments: usize::MAX, ..HbmConfig::default() };
        Self {
            gather: HbmEngine::new(Arc::clone(&runtime), registry.clone(), pinned),
            copies: HbmEngine::new(runtime, registry, off),
        }
    }

    /// Host memory the bench keeps reading: registered (and pinned) through `gather`.
    fn lend(&self, buffer: &HostBuffer) -> anyhow::Result<Registration> {
        // SAFETY: every caller declares the registration after the buffer (so it ends first)
        // and reads the buffer only between transfers, each waited on.
        unsafe { buffer.lend(&self.gather) }.context("registering host memory")
    }

    fn device(&self, len: u64) -> anyhow::Result<Registration> {
        self.gather.alloc_device(GPU, len).with_context(|| format!("allocating {len} device bytes"))
    }

    /// Plans `fragments` as one object and runs them on `engine`; true when nothing failed.
    fn transfer(engine: &HbmEngine<D>, fragments: &[Fragment]) -> bool {
        let mut b = engine.incremental_builder();
        let planned = b.begin_object(Tag::new(0)).is_ok()
            && fragments.iter().all(|f| b.push(*f).is_ok())
            && b.commit_object().is_ok();
        planned && b.finish().is_ok_and(|plans| engine.submit(plans).wait().is_empty())
    }

    /// Device memory `dev` read back to the host.
    fn read(&self, dev: &Registration) -> Option<Vec<u8>> {
        let len = dev.endpoint().len();
        let out = self.gather.register_memory(vec![0u8; len as usize]).ok()?;
        Self::transfer(&self.gather, &[Fragment::new(dev.id(), 0, out.id(), 0, len, Tag::new(0))])
            .then(|| out.deregister())
    }
}

/// `len` bytes of a pattern that differs per `seed`.
fn pattern(len: u64, seed: u64) -> HostBuffer {
    HostBuffer::new(len as usize, seed)
}

fn run_on<D: DeviceRuntime>(
    runtime: Arc<D>,
    config: &HbmBenchConfig,
    progress: &Progress,
) -> anyhow::Result<HbmReport> {
    let backend = runtime.name();
    let rig = Rig::new(runtime);
    // The checks run on the default rule (small pieces through the kernel), before the
    // calibration replaces it with the device's own.
    let checks = checks(&rig, backend, progress)?;
    progress.step("calibration");
    let measured = rig.gather.calibrate(GPU).context("calibrating the device")?;
    let calibration = measured
        .points
        .iter()
        .map(|p| HbmCalibration {
            kind: "calibration",
            backend,
            fragment_size: p.fragment_size,
            kernel_seconds: p.kernel_seconds,
            copies_seconds: p.copies_seconds,
            kernel_max_mean_bytes: measured.kernel_max_mean_bytes,
        })
        .collect();
    let mut rows = ceilings(&rig, backend, config, progress)?;
    for &size in &config.fragment_sizes {
        rows.extend(gather_vs_copies(&rig, backend, config, size, progress)?);
    }
    if config.restore_objects > 0 {
        rows.push(restore(&rig, backend, config, progress)?);
    }
    // Each row against the ceiling of its direction.
    let ceiling = |direction: &str| {
        rows.iter().find(|r| r.kind == "ceiling" && r.direction == direction).map(|r| r.gib_s)
    };
    let ceilings = (ceiling("h2d"), ceiling("d2h"));
    for r in rows.iter_mut().filter(|r| r.kind != "ceiling") {
        let c = if r.direction == "h2d" { ceilings.0 } else { ceilings.1 };
        r.vs_ceiling = c.map(|c| r.gib_s / c);
    }
    Ok(HbmReport { calibration, checks, rows })
}

fn checks<D: DeviceRuntime>(
    rig: &Rig<D>,
    backend: &'static str,
    progress: &Progress,
) -> anyhow::Result<Vec<HbmCheck>> {
    let check = |check, bytes, passed| HbmCheck { kind: "check", backend, check, bytes, passed };
    let len = 256u64 << 10;
    let src = pattern(len, 1);
    let src_reg = rig.lend(&src)?;
    let dev = rig.device(len)?;
    let mut out = Vec::new();

    progress.step("check: host -> device -> host");
    let whole = |from: EndpointId, to: EndpointId| Fragment::new(from, 0, to, 0, len, Tag::new(0));
    let landed = Rig::transfer(&rig.gather, &[whole(src_reg.id(), dev.id())]);
    let back = landed.then(|| rig.read(&dev)).flatten();
    out.push(check("round trip 256KiB", len, back.as_deref() == Some(src.bytes())));

    progress.step("check: scattered pieces, one launch");
    let scattered = rig.device(len)?;
    let pieces: Vec<(u64, u64)> =
        (0..64u64).map(|i| (((i * 37) % 64) * 4001 + i % 3, i * 4001 + 1)).collect();
    let fragments: Vec<Fragment> = pieces
        .iter()
        .map(|&(s, d)| Fragment::new(src_reg.id(), s, scattered.id(), d, 3001, Tag::new(0)))
        .collect();
    let launches = rig.gather.launches();
    let moved = Rig::transfer(&rig.gather, &fragments) && rig.gather.launches() == launches + 1;
    let got = rig.read(&scattered);
    let exact = got.is_some_and(|got| {
        pieces.iter().all(|&(s, d)| got[d as usize..][..3001] == src.bytes()[s as usize..][..3001])
    });
    out.push(check("64 scattered 3001-byte pieces in one launch", 64 * 3001, moved && exact));

    progress.step("check: device -> device");
    let copy = rig.device(len)?;
    let moved = Rig::transfer(&rig.gather, &[whole(dev.id(), copy.id())]);
    out.push(check(
        "device to device 256KiB",
        len,
        moved && rig.read(&copy).as_deref() == Some(src.bytes()),
    ));

    progress.step("check: layer groups on a caller's stream");
    out.push(check(
        "6 layer groups on a stream, an event each",
        STREAM_CHECK_BYTES,
        stream_check(rig, &src, &src_reg)?,
    ));
    Ok(out)
}

/// Bytes the stream check moves.
const STREAM_CHECK_BYTES: u64 = 6 * 16 * 4096;

/// Six layer groups of 16 scattered 4 KiB pages each (a gather launch per group, so the
/// runtime's ring of launch tables wraps), queued on the device's default stream (handle 0)
/// one after the other, an event recorded after each; then the events waited for in order and
/// every byte compared.
fn stream_check<D: DeviceRuntime>(
    rig: &Rig<D>,
    src: &HostBuffer,
    src_reg: &Registration,
) -> anyhow::Result<bool> {
    const GROUPS: u64 = 6;
    const PAGES: u64 = 16;
    let page = STREAM_CHECK_BYTES / GROUPS / PAGES;
    let dev = rig.device(GROUPS * PAGES * page)?;
    // SAFETY: handle 0 is the runtime's default stream of the device, which always exists (and
    // any value is a stream on the simulated device).
    let stream = unsafe { DeviceStream::new(GPU, 0) };
    let source_page = |g: u64, k: u64| (g * 7 + k * 5) % (src.bytes().len() as u64 / page);
    let mut pending = Vec::new();
    for g in 0..GROUPS {
        let mut b = rig.gather.incremental_builder();
        b.begin_object(Tag::new(0))?;
        for k in 0..PAGES {
            let at = (g * PAGES + k) * page;
            b.push(Fragment::new(
                src_reg.id(),
                source_page(g, k) * page,
                dev.id(),
                at,
                page,
                Tag::new(0),
            ))?;
        }
        b.commit_object()?;
        let mut plans = b.finish()?;
        plans.set_stream(Some(stream));
        let handle = rig.gather.submit(plans);
        let event = DeviceEvent::record(Arc::clone(rig.gather.runtime()), stream)?;
        pending.push((handle.is_queued(), event, handle));
    }
    let mut ok = true;
    for (queued, event, handle) in pending {
        ok &= queued && event.wait().is_ok() && handle.into_settled().failures.is_empty();
    }
    let Some(got) = rig.read(&dev) else { return Ok(false) };
    for g in 0..GROUPS {
        for k in 0..PAGES {
            let at = ((g * PAGES + k) * page) as usize;
            let from = (source_page(g, k) * page) as usize;
            ok &= got[at..at + page as usize] == src.bytes()[from..from + page as usize];
        }
    }
    Ok(ok)
}

fn gib_s(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / (1u64 << 30) as f64
}

fn ceilings<D: DeviceRuntime>(
    rig: &Rig<D>,
    backend: &'static str,
    config: &HbmBenchConfig,
    progress: &Progress,
) -> anyhow::Result<Vec<HbmRow>> {
    let len = config.batch_bytes;
    let host = pattern(len, 2);
    let host_reg = rig.lend(&host)?;
    let dev = rig.device(len)?;
    let mut rows = Vec::new();
    for (direction, src, dst) in
        [("h2d", host_reg.id(), dev.id()), ("d2h", dev.id(), host_reg.id())]
    {
        progress.step(format!("ceiling {direction}: one {} copy", ByteSize(len)));
        let one = [Fragment::new(src, 0, dst, 0, len, Tag::new(0))];
        let mut ok = Rig::transfer(&rig.copies, &one); // warm-up
        let mut times = Vec::new();
        for _ in 0..config.iterations.max(1) {
            let t = Instant::now();
            ok &= Rig::transfer(&rig.copies, &one);
            times.push(t.elapsed().as_secs_f64());
        }
        let Timed { median: seconds, spread } = Timed::of(&times);
        let verified = ok && rig.read(&dev).as_deref() == Some(host.bytes());
        rows.push(HbmRow {
            kind: "ceiling",
            backend,
            direction,
            fragment_size: len,
            fragments: 1,
            launches_per_batch: 0,
            seconds,
            spread,
            gib_s: gib_s(len, seconds),
            vs_copies: None,
            vs_ceiling: None,
            verified,
        });
    }
    Ok(rows)
}

fn gather_vs_copies<D: DeviceRuntime>(
    rig: &Rig<D>,
    backend: &'static str,
    config: &HbmBenchConfig,
    size: u64,
    progress: &Progress,
) -> anyhow::Result<Vec<HbmRow>> {
    let fragments = (config.batch_bytes / size).max(1);
    let bytes = fragments * size;
    // Pages scattered over arenas twice the batch: a pinned host one and a device one holding
    // the same bytes; destinations of one batch each.
    let arena = pattern(2 * bytes, size);
    let arena_reg = rig.lend(&arena)?;
    let dev_arena = rig.device(2 * bytes)?;
    let fill = Fragment::new(arena_reg.id(), 0, dev_arena.id(), 0, 2 * bytes, Tag::new(0));
    if !Rig::transfer(&rig.copies, &[fill]) {
        bail!("filling the device arena failed");
    }
    let dev_out = rig.device(bytes)?;
    let mut host_out = HostBuffer::zeroed(bytes as usize);
    let host_out_reg = rig.lend(&host_out)?;
    let mut order: Vec<u64> = (0..2 * fragments).collect();
    let mut rng = SplitMix(size);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let order = &order[..fragments as usize];
    let mut rows = Vec::new();
    for (direction, src, dst) in
        [("h2d", arena_reg.id(), dev_out.id()), ("d2h", dev_arena.id(), host_out_reg.id())]
    {
        let work: Vec<Fragment> = order
            .iter()
            .enumerate()
            .map(|(i, &page)| {
                Fragment::new(src, page * size, dst, i as u64 * size, size, Tag::new(0))
            })
            .collect();
        let mut times = [Vec::new(), Vec::new()];
        let mut ok = [true, true];
        let mut launches = 0;
        for (m, engine) in [&rig.gather, &rig.copies].into_iter().enumerate() {
            ok[m] &= Rig::transfer(engine, &work); // warm-up (and the kernel's compilation)
        }
        // The two modes alternate, so drift on a shared machine hits both alike.
        for _ in 0..config.iterations.max(1) {
            for (m, engine) in [&rig.gather, &rig.copies].into_iter().enumerate() {
                let before = rig.gather.launches();
                let t = Instant::now();
                ok[m] &= Rig::transfer(engine, &work);
                times[m].push(t.elapsed().as_secs_f64());
                if m == 0 {
                    launches = rig.gather.launches() - before;
                }
            }
        }
        let mut verified = [false, false];
        for (m, engine) in [&rig.gather, &rig.copies].into_iter().enumerate() {
            progress.step(format!(
                "{} fragments {direction}, {}",
                ByteSize(size),
                ["gather", "copies"][m]
            ));
            // Poison the destination, run once more, compare.
            if direction == "d2h" {
                host_out.bytes_mut().fill(0xA5);
            } else {
                let poison = pattern(bytes, 99);
                let poison_reg = rig.lend(&poison)?;
                let whole = Fragment::new(poison_reg.id(), 0, dev_out.id(), 0, bytes, Tag::new(0));
                Rig::transfer(&rig.copies, &[whole]);
            }
            let moved = Rig::transfer(engine, &work);
            let got = if direction == "d2h" {
                Some(host_out.bytes().to_vec())
            } else {
                rig.read(&dev_out)
            };
            verified[m] = moved
                && ok[m]
                && got.is_some_and(|got| {
                    order.iter().enumerate().all(|(i, &page)| {
                        got[(i as u64 * size) as usize..][..size as usize]
                            == arena.bytes()[(page * size) as usize..][..size as usize]
                    })
                });
        }
        let [gather, copies] = times.map(|t| Timed::of(&t));
        for (m, (kind, Timed { median: seconds, spread })) in
            [("gather", gather), ("copies", copies)].into_iter().enumerate()
        {
            rows.push(HbmRow {
                kind,
                backend,
                direction,
                fragment_size: size,
                fragments,
                launches_per_batch: if m == 0 { launches } else { 0 },
                seconds,
                spread,
                gib_s: gib_s(bytes, seconds),
                vs_copies: (m == 0).then(|| copies.median / seconds),
                vs_ceiling: None,
                verified: verified[m],
            });
        }
    }
    drop(host_out_reg);
    Ok(rows)
}

fn restore<D: DeviceRuntime>(
    rig: &Rig<D>,
    backend: &'static str,
    config: &HbmBenchConfig,
    progress: &Progress,
) -> anyhow::Result<HbmRow> {
    let shape = RestoreShape {
        objects: config.restore_objects,
        ..RestoreShape::kimi_k3(config.restore_page_size)
    };
    progress.step(format!("restore: {} objects of the Kimi-K3 shape", shape.objects));
    let table = PageTable::scatter(&shape, 0.0, 7);
    let tier_len = table.tier_pages * shape.page_size;
    let arena = pattern(tier_len, 3);
    let arena_reg = rig.lend(&arena)?;
    let per_range = shape.objects as u64 * shape.range_len;
    let destinations =
        (0..shape.ranges).map(|_| rig.device(per_range)).collect::<anyhow::Result<Vec<_>>>()?;
    let plan = |builder: &mut umbp_plan::IncrementalBuilder<umbp_hbm::HbmRules>| -> anyhow::Result<umbp_plan::PlanSet> {
        for object in 0..shape.objects {
            let tag = Tag::new(object as u32);
            let walk = PageWalk::new(table.object(object), shape.page_size, shape.object_size())?;
            builder.begin_object(tag)?;
            for (r, dst) in destinations.iter().enumerate() {
                let offset = r as u64 * shape.range_len;
                let at = object as u64 * shape.range_len;
                builder.push_walk(arena_reg.id(), dst.id(), &walk, offset, shape.range_len, at, tag)?;
            }
            builder.commit_object()?;
        }
        Ok(builder.finish()?)
    };
    let mut builder = rig.gather.incremental_builder();
    let mut ok = true;
    let mut times = Vec::new();
    let mut launches = 0;
    for i in 0..=config.iterations.max(1) {
        let before = rig.gather.launches();
        let t = Instant::now();
        let plans = plan(&mut builder)?;
        let settled = rig.gather.submit(plans).into_settled();
        let elapsed = t.elapsed().as_secs_f64();
        ok &= settled.failures.is_empty();
        builder.recycle(settled.plans);
        if i > 0 {
            // The first is a warm-up.
            times.push(elapsed);
            launches = rig.gather.launches() - before;
        }
    }
    let verified = ok
        && destinations.iter().enumerate().all(|(r, dst)| {
            rig.read(dst).is_some_and(|got| {
                (0..shape.objects).all(|object| {
                    let pages = table.object(object);
                    let at = object as u64 * shape.range_len;
                    (0..shape.range_len).step_by(4093).all(|b| {
                        let o = r as u64 * shape.range_len + b;
                        let page = pages[(o / shape.page_size) as usize];
                        got[(at + b) as usize]
                            == arena.bytes()[(page + o % shape.page_size) as usize]
                    })
                })
            })
        });
    let Timed { median: seconds, spread } = Timed::of(&times);
    Ok(HbmRow {
        kind: "restore",
        backend,
        direction: "h2d",
        fragment_size: shape.page_size,
        fragments: shape.fragments(),
        launches_per_batch: launches,
        seconds,
        spread,
        gib_s: gib_s(shape.bytes(), seconds),
        vs_copies: None,
        vs_ceiling: None,
        verified,
    })
}

fn ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

/// The human table, with each target's verdict. A ratio whose two figures' spreads overlap
/// it is called "within noise", never met.
pub fn table(report: &HbmReport) -> String {
    let backend = report.rows.first().map_or("none", |r| r.backend);
    let mut out = format!("device engine on backend `{backend}`\n");
    if backend == "sim" {
        out += "(simulated device: descriptor building and CPU execution, not a GPU link)\n";
    }
    if let Some(first) = report.calibration.first() {
        out += &format!(
            "\ncalibration: the kernel for mean fragments under {}\n",
            ByteSize(first.kernel_max_mean_bytes)
        );
        for c in &report.calibration {
            out += &format!(
                "  {:>7}  kernel {:>8.3} ms  copies {:>8.3} ms\n",
                ByteSize(c.fragment_size).to_string(),
                c.kernel_seconds * 1e3,
                c.copies_seconds * 1e3
            );
        }
    }
    out += "\nchecks\n";
    for c in &report.checks {
        out += &format!(
            "  {:<46} {:>9}  {}\n",
            c.check,
            ByteSize(c.bytes).to_string(),
            if c.passed { "passed" } else { "FAILED" }
        );
    }
    out += &format!(
        "\n{:<8} {:<4} {:>9} {:>9} {:>8} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8}\n",
        "kind",
        "dir",
        "fragment",
        "fragments",
        "launches",
        "ms/batch",
        "spread",
        "GiB/s",
        "x copies",
        "of ceil",
        "verified"
    );
    for r in &report.rows {
        out += &format!(
            "{:<8} {:<4} {:>9} {:>9} {:>8} {:>9.3} {:>6.0}% {:>8.2} {:>8} {:>8} {:>8}\n",
            r.kind,
            r.direction,
            ByteSize(r.fragment_size).to_string(),
            r.fragments,
            r.launches_per_batch,
            r.seconds * 1e3,
            r.spread * 100.0,
            r.gib_s,
            ratio(r.vs_copies),
            ratio(r.vs_ceiling),
            if r.verified { "yes" } else { "NO" }
        );
    }
    out +=
        "\ntargets (on a GPU): gather >= 1.5x copies below 128KiB; gather and restore >= 0.8 of \
            the ceiling at 16KiB and up\n";
    if backend == "sim" {
        out += "  no verdicts: the simulated device has no link to measure\n";
        return out;
    }
    for r in report.rows.iter().filter(|r| r.kind == "gather" || r.kind == "restore") {
        let mut verdicts = Vec::new();
        if r.kind == "gather" && r.fragment_size < 128 << 10 {
            verdicts.push(verdict("x copies", r.vs_copies, 1.5, r.spread));
        }
        if r.fragment_size >= 16 << 10 {
            verdicts.push(verdict("of ceiling", r.vs_ceiling, 0.8, r.spread));
        }
        if !verdicts.is_empty() {
            out += &format!(
                "  {} {} {}: {}\n",
                r.kind,
                r.direction,
                ByteSize(r.fragment_size),
                verdicts.join(", ")
            );
        }
    }
    out
}

/// `met`, `unmet`, or `within noise` when the target lies inside the figure's own spread, with
/// the interval the figure lies in given its spread, then the target.
fn verdict(what: &str, value: Option<f64>, target: f64, spread: f64) -> String {
    let Some(v) = value else { return format!("{what} n/a") };
    let judged = verdict_text(Verdict::at_least(value, target, spread), spread_interval(v, spread));
    format!("{what} {v:.2} {judged} ({target})")
}

/// The chart: GiB/s of the gather kernel and of one copy per fragment by fragment size, host
/// to device, with the link ceiling as a reference line.
pub fn chart(report: &HbmReport) -> BarChart {
    let rows = &report.rows;
    let mut chart = BarChart::new("Device engine: gather kernel vs one copy per fragment", "GiB/s");
    let backend = rows.first().map_or("none", |r| r.backend);
    chart.subtitle = if backend == "sim" {
        "host to device; simulated device: descriptor building and CPU execution, not a GPU"
            .to_owned()
    } else {
        format!("host to device, backend {backend}")
    };
    let mut sizes: Vec<u64> =
        rows.iter().filter(|r| r.kind == "gather").map(|r| r.fragment_size).collect();
    sizes.dedup();
    chart.groups = sizes.iter().map(|&s| format!("{} fragments", ByteSize(s))).collect();
    let value = |kind: &str, size: u64| {
        rows.iter()
            .find(|r| r.kind == kind && r.direction == "h2d" && r.fragment_size == size)
            .map(|r| r.gib_s)
    };
    chart.series = [("gather", "gather kernel"), ("copies", "one copy per fragment")]
        .into_iter()
        .map(|(kind, name)| Series::new(name, sizes.iter().map(|&s| value(kind, s)).collect()))
        .collect();
    if let Some(c) = rows.iter().find(|r| r.kind == "ceiling" && r.direction == "h2d") {
        chart.references = vec![crate::chart::Reference {
            value: c.gib_s,
            label: "one large copy (ceiling)".into(),
        }];
    }
    chart
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_pass_every_row_is_verified_and_only_small_gathers_launch() {
        let config = HbmBenchConfig {
            backend: HbmBackend::Sim,
            fragment_sizes: vec![4 << 10, 256 << 10],
            batch_bytes: 1 << 20,
            iterations: 1,
            restore_objects: 1,
            restore_page_size: 64 << 10,
        };
        let report = run(&config, &Progress::quiet()).unwrap();
        assert_eq!(report.calibration.len(), umbp_hbm::CALIBRATION_SIZES.len());
        assert_eq!(report.checks.len(), 4);
        assert!(report.checks.iter().all(|c| c.passed), "{:?}", report.checks);
        // 2 ceilings, 2 sizes x 2 directions x 2 modes, 1 restore.
        assert_eq!(report.rows.len(), 2 + 8 + 1);
        for r in &report.rows {
            assert!(r.verified, "{r:?}");
            assert_eq!(r.backend, "sim");
            // Gathers launch the kernel exactly under the calibrated threshold.
            let threshold = report.calibration[0].kernel_max_mean_bytes;
            let kernel = matches!(r.kind, "gather" | "restore") && r.fragment_size < threshold;
            assert_eq!(r.launches_per_batch > 0, kernel, "{r:?}");
            assert_eq!(r.vs_ceiling.is_some(), r.kind != "ceiling", "{r:?}");
        }
        let text = table(&report);
        assert!(text.contains("passed") && !text.contains("FAILED") && text.contains("targets"));
        assert!(text.contains("no verdicts") && !text.contains(" met "), "{text}");
        assert_eq!(chart(&report).references.len(), 1);
    }

    #[test]
    fn a_target_inside_the_spread_is_never_called_met() {
        assert_eq!(verdict("x", Some(1.6), 1.5, 0.125), "x 1.60 within noise [1.40, 1.80] (1.5)");
        assert_eq!(verdict("x", Some(2.0), 1.5, 0.01), "x 2.00 met [1.98, 2.02] (1.5)");
        assert_eq!(verdict("x", Some(1.0), 1.5, 0.01), "x 1.00 unmet [0.99, 1.01] (1.5)");
        assert_eq!(verdict("x", Some(1.0), 1.5, 0.0), "x 1.00 unmet (1.5)");
    }

    #[test]
    fn a_backend_not_built_in_is_an_error() {
        let config = HbmBenchConfig { backend: HbmBackend::Cuda, ..HbmBenchConfig::default() };
        if cfg!(not(feature = "cuda")) {
            let e = run(&config, &Progress::quiet()).unwrap_err();
            assert!(e.to_string().contains("without the `cuda` feature"), "{e}");
        }
    }
}
