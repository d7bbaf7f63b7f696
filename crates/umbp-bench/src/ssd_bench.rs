//! `umbp-bench ssd`: random `O_DIRECT` reads through the SSD engine against `fio`.
//!
//! One file of [`file_size`](SsdBenchConfig::file_size) bytes (1 GiB by default) is created in
//! a temporary directory and filled with a known pattern. For each block size (256 KiB and
//! 4 KiB by default) the run measures, on that one file, with the page cache dropped before
//! each measurement where permitted:
//!
//! - `engine-qd1`: the engine with queue depth 1;
//! - `engine`: the engine with its queue depth (64 by default);
//! - `fio`, `fio-registered` and `fio-huge`: `fio --ioengine=io_uring --direct=1
//!   --rw=randread` with the same file, block size and depth (1 and the engine's depth), one
//!   job; the second run adds fio's registered buffers and files (`--fixedbufs
//!   --registerfiles`), the third reads into huge pages (`--iomem=shmhuge`), as the engine's
//!   slots do ([`umbp_plan::AlignedBuffer::for_direct_io`]). `fio-huge` runs only where enough
//!   reserved huge pages are free (`vm.nr_hugepages`), and says so on stderr otherwise. All of
//!   fio is skipped, with a message, when `fio` is not on `PATH`.
//!
//! Each row is measured [`repeats`](SsdBenchConfig::repeats) times, the rows of a block size
//! taking turns (each round starting at the next row), and reports its median measurement with
//! the spread. fio's ceiling at a depth is the kind of buffers with the fastest median there,
//! so fio keeps whichever of its options serves it best ([`disk::rank_by_median`], as in the
//! restore bench, says why by median). An engine row's `vs_fio` is the median over the rounds
//! of its throughput over that kind's run of the same round, so drift between rounds cancels.
//!
//! The engine's worker and fio run pinned to the same CPU ([`Placement`]; by default the one
//! that takes the disk's completions, see [`disk`] for why).
//!
//! The engine runs with one worker (one ring, like one fio job) and a maximum segment of one
//! block, so every read is one block at a random block-aligned offset. Each submit is a plan
//! set of many reads (one object per read, built with the engine's reused incremental builder;
//! building is inside the timing), and two submits are in flight at once: the next is queued
//! before the one before it is waited for, so the ring fills with the next batch's reads while
//! the last ones of the batch before complete. Each read of a submit lands in its own
//! block-sized slot of one host buffer (reads into the same memory would break the engine's
//! overlap rule); the bytes are not looked at while timing. Before timing, a batch of distinct
//! blocks is read into distinct slots and checked against the pattern (`verified`).
//!
//! The engine reads into as much memory as fio does, and into huge pages as `fio-huge` does:
//!
//! - a submit carries half the queue depth in reads (the two submits in flight together fill
//!   the ring, as fio's `depth` buffers of one block each do), or for small blocks enough to
//!   fill 1 MiB of slots in all, so that a submit still carries enough reads to pay for itself;
//! - the slots' buffer is at least one huge page ([`AlignedBuffer::HUGE_PAGE`]), so
//!   [`AlignedBuffer::for_direct_io`] maps it with huge pages even where the slots alone are
//!   smaller (1 MiB at depth 1).
//!
//! Both matter on this project's virtual machine, where the host's cost per read grows with the
//! memory the reads land in and falls with huge pages. Measured in alternating runs at 256 KiB
//! (engine over each round's fastest fio run): with two submits of `depth` reads each (32 MiB
//! of slots at depth 64, twice fio's) and 1 MiB of slots on 4 KiB pages at depth 1, the engine
//! reached 0.86 and 0.83 at depth 64 and 0.65 and 0.55 at depth 1; with the slots above, 1.02
//! and 0.99 and 0.91 and 0.92. Older versions of the bench, with up to 128 MiB of slots,
//! measured 64 KiB reads at depth 64 at 0.70 of fio where 8 MiB gave 0.94–1.10. fio slows the
//! same way: one buffer against 128 at depth 1 was 6.0 against 4.9 k reads per second at 256
//! KiB, and at depth 64 `fio-huge` ran 1.0–1.8 × `fio` in the same runs.
//!
//! Targets (`verdict`): `engine` at least 0.95 of fio at the batched depth and at least 0.9 at
//! depth 1, for every block size; batched submission at least 1.3 × `engine-qd1` (`vs_qd1`).
//!
//! With [`writes`](SsdBenchConfig::writes), an `engine-write` row per block size writes
//! block-aligned blocks from the slots to random blocks of a second file of the same size (so
//! the read rows' pattern stays intact), at the batched depth, two submits in flight, each
//! submit one block in each of as many equal regions of the file as it carries writes (no two
//! writes of a submit meet, as the engine's overlap rule wants). It takes its turn with the
//! other rows; it has no fio row to compare with. Its `verified`: a batch of such writes read
//! back from the file around the engine.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use umbp_plan::{
    AlignedBuffer, EndpointId, EndpointRegistry, FileOptions, FileSource, Fragment, PlanBuilder,
    Register, Registration, Tag, TransferEngine,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

use crate::disk::{self, FioAmount, FioBuffers, FioReads, Placement};
use crate::host_buffer::HostBuffer;
use crate::measure::{Timed, Verdict};

/// Settings of `umbp-bench ssd`.
#[derive(Clone, Debug)]
pub struct SsdBenchConfig {
    /// Size of the test file. Default 1 GiB.
    pub file_size: u64,
    /// Directory in which the temporary file is created; `None`: the system's temporary
    /// directory. It should lie on the SSD to measure, on a filesystem that takes `O_DIRECT`.
    pub dir: Option<PathBuf>,
    /// Read sizes. Default 256 KiB and 4 KiB.
    pub block_sizes: Vec<u64>,
    /// The engine's (and fio's) batched queue depth. Default the engine's, 64.
    pub queue_depth: u32,
    /// Seconds each measurement runs. Default 3.
    pub seconds: f64,
    /// Measurements per row, taken in turns with the other rows of the same block size, each
    /// round starting at the next row (engine-qd1, engine, fio-qd1, fio, ...; then engine,
    /// fio-qd1, ...); the row reports the median. A shared disk drifts, and taking turns
    /// spreads the drift over all rows. Default 3.
    pub repeats: usize,
    /// Whether to run the `fio` rows. Default true.
    pub fio: bool,
    /// Where the engine's worker and fio run. Default [`Placement::Completions`].
    pub placement: Placement,
    /// Seed of the random offsets. Default 42.
    pub seed: u64,
    /// Whether to measure `engine-write` rows too (see the module docs). Default false.
    pub writes: bool,
}

impl Default for SsdBenchConfig {
    fn default() -> Self {
        Self {
            file_size: 1 << 30,
            dir: None,
            block_sizes: vec![256 << 10, 4 << 10],
            queue_depth: SsdConfig::DEFAULT_QUEUE_DEPTH,
            seconds: 3.0,
            repeats: 3,
            fio: true,
            placement: Placement::Completions,
            seed: 42,
            writes: false,
        }
    }
}

/// One measurement: a block size, a mode and a queue depth.
#[derive(Clone, Debug, Serialize)]
pub struct SsdRow {
    /// Bytes per read.
    pub block_size: u64,
    /// `engine-qd1`, `engine`, `engine-write`, `fio`, `fio-registered` or `fio-huge`.
    pub mode: &'static str,
    /// Reads in flight at most.
    pub queue_depth: u32,
    /// Throughput, GiB/s.
    pub gib_s: f64,
    /// Reads per second.
    pub iops: f64,
    /// Bytes read while timing (of the median measurement).
    pub bytes: u64,
    /// Seconds timed (of the median measurement).
    pub seconds: f64,
    /// Measurements taken; `gib_s` and `iops` are the median one's.
    pub samples: usize,
    /// The slowest and fastest measurement, GiB/s.
    pub min_gib_s: f64,
    /// See `min_gib_s`.
    pub max_gib_s: f64,
    /// The executor: `io_uring`, `pread` (the engine's fallback) or `fio-io_uring`.
    pub backend: &'static str,
    /// The CPU the engine's worker (or fio's job) was pinned to; `null`: unpinned.
    pub cpu: Option<usize>,
    /// Whether the file was read with `O_DIRECT`.
    pub direct: bool,
    /// Whether the page cache was dropped before the row (`posix_fadvise` always; also
    /// `/proc/sys/vm/drop_caches` when permitted).
    pub cache_dropped: bool,
    /// Engine rows: the verification read before timing matched the file's pattern.
    pub verified: Option<bool>,
    /// Engine rows: the median over the rounds of `gib_s` over the run of the same round,
    /// block size and depth of fio's fastest kind of buffers ([`fio_ceiling`](Self::fio_ceiling));
    /// `null` without fio.
    pub vs_fio: Option<f64>,
    /// Engine rows: the spread of those per-round ratios, `(max - min) / median`.
    pub vs_fio_spread: Option<f64>,
    /// Engine rows: `vs_fio` against its target (at least 0.95 at the batched depth, 0.9 at
    /// depth 1), `within noise` when the target lies inside the ratios' spread.
    pub verdict: Option<Verdict>,
    /// Engine rows: whether fio also ran into huge pages (`fio-huge`), as the engine's
    /// buffers do where the kernel grants them; `false` when too few huge pages were reserved
    /// and free, so that fio's best may fall short of the disk's; `null` without fio.
    pub fio_huge_pages: Option<bool>,
    /// Engine rows: the fio kind `vs_fio` is against (`fio`, `fio-registered` or `fio-huge`):
    /// the one with the fastest median at the row's block size and depth; `null` without fio.
    pub fio_ceiling: Option<&'static str>,
    /// `engine` rows: `gib_s` over `engine-qd1`'s at the same block size (target: at least
    /// 1.3).
    pub vs_qd1: Option<f64>,
}

/// Runs the comparison; panics with the reason if the test file cannot be set up. See
/// [`try_run`].
pub fn run(config: &SsdBenchConfig) -> Vec<SsdRow> {
    match try_run(config) {
        Ok(rows) => rows,
        Err(e) => panic!("umbp-bench ssd: {e:#}"),
    }
}

/// Runs the comparison: creates the file, measures every row, removes the file.
pub fn try_run(config: &SsdBenchConfig) -> anyhow::Result<Vec<SsdRow>> {
    if config.block_sizes.iter().any(|&bs| bs == 0 || bs % 8 != 0 || bs > config.file_size) {
        bail!("every block size must be a multiple of 8 bytes no larger than the file");
    }
    let base = config.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::Builder::new()
        .prefix("umbp-ssd-bench")
        .tempdir_in(&base)
        .with_context(|| format!("creating a temporary directory in {}", base.display()))?;
    let path = dir.path().join("ssd-bench.bin");
    create_file(&path, config.file_size)?;
    let write_path = dir.path().join("ssd-bench-writes.bin");
    if config.writes {
        create_file(&write_path, config.file_size)?;
    }
    let writes = usize::from(config.writes);
    let fio = config.fio && disk::fio_available();
    let cpu = config.placement.cpu(&path);

    let repeats = config.repeats.max(1);
    let mut rows = Vec::new();
    for &block_size in &config.block_sizes {
        let kinds = if fio {
            FioBuffers::available(config.queue_depth, block_size, "ssd")
        } else {
            Vec::new()
        };
        // Per depth (1, then batched): the engine's samples, and per kind of fio buffers fio's,
        // in round order (`None` where a fio run failed).
        let mut engine: [Vec<SsdRow>; 2] = Default::default();
        let mut written: Vec<SsdRow> = Vec::new();
        let mut fio_runs: [Vec<Vec<Option<SsdRow>>>; 2] =
            [vec![Vec::new(); kinds.len()], vec![Vec::new(); kinds.len()]];
        let turns = 2 + writes + 2 * kinds.len();
        for repeat in 0..repeats {
            // Each repeat starts at the next row, so no row always runs first or last: k is
            // engine-qd1, engine, engine-write (with `writes`), then each kind of fio buffers
            // at depth 1 and batched.
            for turn in 0..turns {
                let k = (turn + repeat) % turns;
                if k < 2 {
                    let depth = if k == 1 { config.queue_depth } else { 1 };
                    let mode = ["engine-qd1", "engine"][k];
                    engine[k].push(measure_engine(&path, config, block_size, depth, mode, cpu)?);
                    continue;
                }
                if k < 2 + writes {
                    written.push(measure_writes(&write_path, config, block_size, cpu)?);
                    continue;
                }
                let k = k - writes;
                let batched = k % 2 == 1;
                let depth = if batched { config.queue_depth } else { 1 };
                let kind = (k - 2) / 2;
                let reads = FioReads {
                    path: &path,
                    size: config.file_size,
                    block_size,
                    depth,
                    amount: FioAmount::Seconds(config.seconds),
                    cpu,
                };
                let sample = match reads.run(kinds[kind]) {
                    Ok(run) => Some(fio_row(block_size, depth, kinds[kind], cpu, run)),
                    Err(e) => {
                        let mode = kinds[kind].mode();
                        eprintln!("umbp-bench ssd: {mode} at {block_size} B, depth {depth}: {e:#}");
                        None
                    }
                };
                fio_runs[usize::from(batched)][kind].push(sample);
            }
        }
        let mut engine_rows: Vec<SsdRow> = Vec::new();
        for (d, samples) in engine.into_iter().enumerate() {
            // fio's ceiling is the kind of buffers with the fastest median at this depth (see
            // the module docs), and each round's engine run is set against that kind's run of
            // the same round; a round where it failed has no ratio.
            let gib_s: Vec<Vec<f64>> = fio_runs[d]
                .iter()
                .map(|runs| runs.iter().flatten().map(|f| f.gib_s).collect())
                .collect();
            let fastest = disk::rank_by_median(&gib_s).first().map(|&(kind, _)| kind);
            let ratios: Vec<f64> = fastest.map_or_else(Vec::new, |kind| {
                (0..samples.len())
                    .filter_map(|round| {
                        let fio = fio_runs[d][kind][round].as_ref()?;
                        Some(samples[round].gib_s / fio.gib_s)
                    })
                    .collect()
            });
            let mut row = median(samples).expect("every repeat measures both engine rows");
            if !ratios.is_empty() {
                let Timed { median: ratio, spread } = Timed::of(&ratios);
                let target = if d == 1 { 0.95 } else { 0.9 };
                row.vs_fio = Some(ratio);
                row.vs_fio_spread = Some(spread);
                row.verdict = Some(Verdict::at_least(Some(ratio), target, spread));
                row.fio_huge_pages = Some(kinds.contains(&FioBuffers::HugePages));
                row.fio_ceiling = fastest.map(|kind| kinds[kind].mode());
            }
            engine_rows.push(row);
        }
        engine_rows[1].vs_qd1 = Some(engine_rows[1].gib_s / engine_rows[0].gib_s);
        rows.extend(engine_rows);
        rows.extend(median(written));
        for runs in fio_runs.into_iter().flatten() {
            rows.extend(median(runs.into_iter().flatten().collect()));
        }
    }
    Ok(rows)
}

/// A fio run as a row.
fn fio_row(
    block_size: u64,
    depth: u32,
    buffers: FioBuffers,
    cpu: Option<usize>,
    run: disk::FioRun,
) -> SsdRow {
    SsdRow {
        block_size,
        mode: buffers.mode(),
        queue_depth: depth,
        gib_s: run.gib_s,
        iops: run.iops,
        bytes: run.bytes,
        seconds: run.seconds,
        samples: 1,
        min_gib_s: 0.0,
        max_gib_s: 0.0,
        backend: "fio-io_uring",
        cpu,
        direct: true,
        cache_dropped: run.cache_dropped,
        verified: None,
        vs_fio: None,
        vs_fio_spread: None,
        verdict: None,
        fio_huge_pages: None,
        fio_ceiling: None,
        vs_qd1: None,
    }
}

/// The median measurement by throughput, with the spread of all of them; `None` if none.
fn median(mut samples: Vec<SsdRow>) -> Option<SsdRow> {
    samples.sort_by(|a, b| a.gib_s.total_cmp(&b.gib_s));
    let (min, max) = (samples.first()?.gib_s, samples.last()?.gib_s);
    let count = samples.len();
    let mut row = samples.swap_remove(count / 2);
    (row.samples, row.min_gib_s, row.max_gib_s) = (count, min, max);
    Some(row)
}

/// Word `word` (bytes `8 * word ..`) of the test file's pattern.
fn pattern_word(word: u64) -> [u8; 8] {
    (word.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (word >> 7)).to_le_bytes()
}

fn create_file(path: &Path, size: u64) -> anyhow::Result<()> {
    let mut file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let chunk_len = 4 << 20;
    let mut chunk = vec![0u8; chunk_len];
    let mut at = 0u64;
    while at < size {
        let len = (size - at).min(chunk_len as u64) as usize;
        for (i, word) in chunk[..len].chunks_mut(8).enumerate() {
            let bytes = pattern_word(at / 8 + i as u64);
            word.copy_from_slice(&bytes[..word.len()]);
        }
        file.write_all(&chunk[..len]).context("writing the test file")?;
        at += len as u64;
    }
    file.sync_all().context("syncing the test file")?;
    Ok(())
}

/// A host buffer registered as an endpoint, on huge pages where the kernel grants them.
struct Slots {
    /// Declared (so dropped) before the buffer it registers.
    registration: Registration,
    buffer: HostBuffer,
}

impl Slots {
    /// At least `len` bytes: never less than a huge page, so that `for_direct_io` maps the
    /// buffer with huge pages as `fio-huge`'s are (see the module docs).
    fn new(engine: &SsdEngine, len: usize) -> anyhow::Result<Self> {
        let buffer = HostBuffer::zeroed(len.max(AlignedBuffer::HUGE_PAGE));
        // SAFETY: the buffer outlives its registration (the field order), and the bench reads
        // it only after every handle that writes it was waited on.
        let registration = unsafe { buffer.lend(engine) }.context("registering the slots")?;
        Ok(Self { registration, buffer })
    }

    fn id(&self) -> EndpointId {
        self.registration.id()
    }

    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        &self.buffer.bytes()[at..at + len]
    }
}

/// A small deterministic generator for offsets.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

/// Submits the engine row keeps in flight: the next one is queued before the last one is waited
/// for, as a server streaming a restore does, so the worker's ring fills with the next batch's
/// reads while the last ones of the batch before complete.
const IN_FLIGHT: usize = 2;

/// The engine rows' slots take at least this many bytes, when the depth alone would give fewer.
const SLOT_FLOOR: u64 = 1 << 20;

/// Keeps [`IN_FLIGHT`] submits of `submit(batch, builder)` in flight for at least `timed` (and
/// at least one), recycling each settled plan set into `builder`; the first failure ends the
/// run (`what` names the transfer, "read" or "write"). Returns the submits made and the seconds
/// they took.
fn timed_submits<B: PlanBuilder>(
    builder: &mut B,
    timed: Duration,
    what: &str,
    mut submit: impl FnMut(u64, &mut B) -> anyhow::Result<umbp_plan::TransferHandle>,
) -> anyhow::Result<(u64, f64)> {
    let settle = |handle: umbp_plan::TransferHandle, builder: &mut B| -> anyhow::Result<()> {
        let settled = handle.into_settled();
        if let Some(failure) = settled.failures.first() {
            bail!("a timed {what} failed: {failure}");
        }
        builder.recycle(settled.plans);
        Ok(())
    };
    let mut in_flight = std::collections::VecDeque::new();
    let mut batches = 0u64;
    let start = Instant::now();
    while start.elapsed() < timed || batches == 0 {
        in_flight.push_back(submit(batches, builder)?);
        if in_flight.len() == IN_FLIGHT {
            settle(in_flight.pop_front().expect("one in flight"), builder)?;
        }
        batches += 1;
    }
    while let Some(handle) = in_flight.pop_front() {
        settle(handle, builder)?;
    }
    Ok((batches, start.elapsed().as_secs_f64()))
}

fn measure_engine(
    path: &Path,
    config: &SsdBenchConfig,
    block_size: u64,
    depth: u32,
    mode: &'static str,
    cpu: Option<usize>,
) -> anyhow::Result<SsdRow> {
    let registry = EndpointRegistry::new();
    let engine_config = SsdConfig {
        queue_depth: depth,
        max_segment: block_size,
        workers: 1,
        worker_cpus: cpu.into_iter().collect(),
        ..SsdConfig::default()
    };
    let engine = SsdEngine::new(registry.clone(), engine_config).context("starting the engine")?;
    let registration = engine
        .register_file(
            FileSource::open(path, FileOptions::new().writable(false)),
            0,
            config.file_size,
        )
        .with_context(|| format!("opening {}", path.display()))?;
    let file = registration.id();
    let direct = engine.file_info(file).is_some_and(|i| i.direct);
    let blocks = config.file_size / block_size;
    // Every read of one submit lands in its own slot (reads into the same memory would break
    // the engine's overlap rule and fail), and each submit in flight has slots of its own. As
    // much memory as fio reads into (see the module docs): the submits in flight carry `depth`
    // reads together, or for small blocks enough to fill 1 MiB of slots in all, so that a
    // submit still carries enough reads to pay for itself.
    let submits_in_flight = IN_FLIGHT as u64;
    let reads_per_submit = (u64::from(depth) / submits_in_flight)
        .max(SLOT_FLOOR / submits_in_flight / block_size)
        .max(1);
    let slots = reads_per_submit * submits_in_flight;
    let host = Slots::new(&engine, (slots * block_size) as usize)?;
    let mut rng = Rng(config.seed ^ block_size ^ u64::from(depth));
    let mut builder = engine.incremental_builder();

    // Verification: distinct blocks into distinct slots, checked against the pattern.
    let checks: Vec<u64> = (0..slots).map(|_| rng.below(blocks)).collect();
    for (slot, &block) in checks.iter().enumerate() {
        let tag = Tag::new(slot as u32);
        let (src, dst) = (block * block_size, slot as u64 * block_size);
        builder.begin_object(tag)?;
        builder.push(Fragment::new(file, src, host.id(), dst, block_size, tag))?;
        builder.commit_object()?;
    }
    let settled = engine.submit(builder.finish()?).into_settled();
    let mut verified = settled.failures.is_empty();
    for (slot, &block) in checks.iter().enumerate() {
        let got = host.bytes(slot * block_size as usize, block_size as usize);
        let start = block * block_size;
        verified &= got
            .chunks(8)
            .enumerate()
            .all(|(i, word)| word == &pattern_word(start / 8 + i as u64)[..word.len()]);
    }
    builder.recycle(settled.plans);

    let cache_dropped = disk::drop_cache(path);
    let timed = Duration::from_secs_f64(config.seconds);
    let (batches, seconds) = timed_submits(&mut builder, timed, "read", |batch, builder| {
        // Each submit in flight reads into its own share of the slots.
        let first_slot = (batch % submits_in_flight) * reads_per_submit;
        for i in 0..reads_per_submit {
            let tag = Tag::new(i as u32);
            let src = rng.below(blocks) * block_size;
            let dst = (first_slot + i) * block_size;
            builder.begin_object(tag)?;
            builder.push(Fragment::new(file, src, host.id(), dst, block_size, tag))?;
            builder.commit_object()?;
        }
        Ok(engine.submit(builder.finish()?))
    })?;
    let reads = batches * reads_per_submit;
    let bytes = reads * block_size;
    let backend = match engine.backend() {
        Backend::Blocking => "pread",
        _ => "io_uring",
    };
    Ok(SsdRow {
        block_size,
        mode,
        queue_depth: depth,
        gib_s: bytes as f64 / seconds / f64::from(1u32 << 30),
        iops: reads as f64 / seconds,
        bytes,
        seconds,
        samples: 1,
        min_gib_s: 0.0,
        max_gib_s: 0.0,
        backend,
        cpu,
        direct,
        cache_dropped,
        verified: Some(verified),
        vs_fio: None,
        vs_fio_spread: None,
        verdict: None,
        fio_huge_pages: None,
        fio_ceiling: None,
        vs_qd1: None,
    })
}

/// An `engine-write` row: block-aligned writes from the slots to random blocks of `path`, at
/// the batched depth (see the module docs).
fn measure_writes(
    path: &Path,
    config: &SsdBenchConfig,
    block_size: u64,
    cpu: Option<usize>,
) -> anyhow::Result<SsdRow> {
    let depth = config.queue_depth;
    let registry = EndpointRegistry::new();
    let engine_config = SsdConfig {
        queue_depth: depth,
        max_segment: block_size,
        workers: 1,
        worker_cpus: cpu.into_iter().collect(),
        ..SsdConfig::default()
    };
    let engine = SsdEngine::new(registry.clone(), engine_config).context("starting the engine")?;
    let registration = engine
        .register_file(FileSource::open(path, FileOptions::new()), 0, config.file_size)
        .with_context(|| format!("opening {}", path.display()))?;
    let file = registration.id();
    let direct = engine.file_info(file).is_some_and(|i| i.direct);
    let blocks = config.file_size / block_size;
    // The slots as the read rows size them; each write's bytes are its slot's.
    let submits_in_flight = IN_FLIGHT as u64;
    let per_submit = (u64::from(depth) / submits_in_flight)
        .max(SLOT_FLOOR / submits_in_flight / block_size)
        .clamp(1, blocks);
    let slots = per_submit * submits_in_flight;
    let mut host = Slots::new(&engine, (slots * block_size) as usize)?;
    for (i, byte) in host.buffer.bytes_mut().iter_mut().enumerate() {
        *byte = (i as u64).wrapping_mul(0x9e37_79b9) as u8 ^ (i >> 12) as u8;
    }
    let region = blocks / per_submit;
    let mut rng = Rng(config.seed ^ block_size ^ 0x5752_4954);
    let mut builder = engine.incremental_builder();
    // Submit `batch`: write `i` of it goes from its slot to a random block of region `i`.
    let mut submit = |batch: u64,
                      builder: &mut umbp_plan::IncrementalBuilder<umbp_ssd::SsdRules>,
                      targets: Option<&mut Vec<(u64, u64)>>|
     -> anyhow::Result<umbp_plan::TransferHandle> {
        let first_slot = (batch % submits_in_flight) * per_submit;
        let mut targets = targets;
        for i in 0..per_submit {
            let tag = Tag::new(i as u32);
            let dst = (i * region + rng.below(region)) * block_size;
            let src = (first_slot + i) * block_size;
            builder.begin_object(tag)?;
            builder.push(Fragment::new(host.id(), src, file, dst, block_size, tag))?;
            builder.commit_object()?;
            if let Some(targets) = targets.as_mut() {
                targets.push((src, dst));
            }
        }
        Ok(engine.submit(builder.finish()?))
    };

    // Verification: one submit, read back around the engine.
    let mut targets = Vec::new();
    let settled = submit(0, &mut builder, Some(&mut targets))?.into_settled();
    let mut verified = settled.failures.is_empty();
    builder.recycle(settled.plans);
    let back = std::fs::read(path).context("reading the written file back")?;
    for &(src, dst) in &targets {
        let (src, dst, len) = (src as usize, dst as usize, block_size as usize);
        verified &= host.bytes(src, len) == &back[dst..dst + len];
    }

    let timed = Duration::from_secs_f64(config.seconds);
    let (batches, seconds) =
        timed_submits(&mut builder, timed, "write", |batch, builder| submit(batch, builder, None))?;
    let writes = batches * per_submit;
    let bytes = writes * block_size;
    let backend = match engine.backend() {
        Backend::Blocking => "pread",
        _ => "io_uring",
    };
    Ok(SsdRow {
        block_size,
        mode: "engine-write",
        queue_depth: depth,
        gib_s: bytes as f64 / seconds / f64::from(1u32 << 30),
        iops: writes as f64 / seconds,
        bytes,
        seconds,
        samples: 1,
        min_gib_s: 0.0,
        max_gib_s: 0.0,
        backend,
        cpu,
        direct,
        cache_dropped: false,
        verified: Some(verified),
        vs_fio: None,
        vs_fio_spread: None,
        verdict: None,
        fio_huge_pages: None,
        fio_ceiling: None,
        vs_qd1: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An 8 MiB file, 64 KiB reads, 50 ms per measurement, unpinned.
    fn tiny() -> SsdBenchConfig {
        SsdBenchConfig {
            file_size: 8 << 20,
            dir: None,
            block_sizes: vec![64 << 10],
            seconds: 0.05,
            placement: Placement::Unpinned,
            seed: 1,
            ..SsdBenchConfig::default()
        }
    }

    /// A tiny run: the engine rows verify and the ratios are filled in.
    #[test]
    fn a_small_run_verifies_and_relates_rows() {
        let config = SsdBenchConfig { queue_depth: 8, repeats: 2, fio: false, ..tiny() };
        let rows = try_run(&config).expect("run");
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.verified == Some(true) && r.bytes > 0 && r.samples == 2));
        assert_eq!((rows[0].mode, rows[1].mode), ("engine-qd1", "engine"));
        assert!(rows[1].vs_qd1.is_some());
    }

    /// With `writes`, an `engine-write` row follows the read rows and verifies.
    #[test]
    fn a_small_run_with_writes_verifies_them() {
        let config =
            SsdBenchConfig { queue_depth: 8, repeats: 2, fio: false, writes: true, ..tiny() };
        let rows = try_run(&config).expect("run");
        let modes: Vec<&str> = rows.iter().map(|r| r.mode).collect();
        assert_eq!(modes, ["engine-qd1", "engine", "engine-write"]);
        assert!(rows.iter().all(|r| r.verified == Some(true) && r.bytes > 0 && r.samples == 2));
    }

    /// With fio: each kind of fio buffers the machine allows appears at both depths (huge
    /// pages only where enough are reserved), and every engine row carries a ratio to the
    /// fastest of them, named, a verdict, and whether fio had huge pages.
    #[test]
    fn with_fio_every_engine_row_is_judged_against_it() {
        if !disk::fio_available() {
            eprintln!("skipping: fio is not installed");
            return;
        }
        let config = SsdBenchConfig { queue_depth: 4, repeats: 1, fio: true, ..tiny() };
        let kinds = FioBuffers::available(config.queue_depth, config.block_sizes[0], "ssd");
        let huge = kinds.contains(&FioBuffers::HugePages);
        let rows = try_run(&config).expect("run");
        let modes: Vec<(&str, u32)> = rows.iter().map(|r| (r.mode, r.queue_depth)).collect();
        let mut want = vec![("engine-qd1", 1), ("engine", 4)];
        want.extend(kinds.iter().map(|k| (k.mode(), 1)));
        want.extend(kinds.iter().map(|k| (k.mode(), 4)));
        assert_eq!(modes, want);
        for engine in &rows[..2] {
            let fio = rows[2..].iter().filter(|f| f.queue_depth == engine.queue_depth);
            let best = fio.max_by(|a, b| a.gib_s.total_cmp(&b.gib_s)).expect("fio rows");
            let ratio = engine.vs_fio.expect("a ratio to fio");
            assert!((ratio - engine.gib_s / best.gib_s).abs() < 1e-9 * ratio, "{engine:?}");
            assert_eq!(engine.fio_ceiling, Some(best.mode));
            // The table names the kind too: `engine-qd1` and `engine` at depth 4 (`engine-qd4`).
            let label = format!("engine-qd{}", engine.queue_depth);
            let named = format!("{label} against {}-qd{}", best.mode, engine.queue_depth);
            assert!(crate::ssd_report::table(&rows).contains(&named), "{named}");
            assert!(engine.verdict.is_some() && engine.vs_fio_spread == Some(0.0));
            assert_eq!(engine.fio_huge_pages, Some(huge));
        }
    }
}
