//! `umbp-bench ssd`: random `O_DIRECT` reads through the SSD engine against `fio`.
//!
//! One file of [`file_size`](SsdBenchConfig::file_size) bytes (1 GiB by default) is created in
//! a temporary directory and filled with a known pattern. For each block size (256 KiB and
//! 4 KiB by default) the run measures, on that one file, with the page cache dropped before
//! each row where permitted:
//!
//! - `engine-qd1`: the engine with queue depth 1;
//! - `engine`: the engine with its queue depth (64 by default);
//! - `fio`: `fio --ioengine=io_uring --direct=1 --rw=randread` with the same file, block size
//!   and depth (1 and the engine's depth), one job. Skipped, with a message, when `fio` is not
//!   on `PATH`.
//!
//! Each row is measured [`repeats`](SsdBenchConfig::repeats) times, the rows of a block size
//! taking turns, and reports its median measurement with the spread.
//!
//! The engine runs with one worker (one ring, like one fio job) and a maximum segment of one
//! block, so every read is one block at a random block-aligned offset. Each submit is a plan
//! set of many reads (one object per read, built with the engine's reused incremental builder;
//! building is inside the timing), and two submits are in flight at once: the next is queued
//! before the one before it is waited for, so the ring fills with the next batch's reads while
//! the last ones of the batch before complete. Each read of a submit lands in its own
//! block-sized slot of one host buffer (reads into the same memory would break the engine's
//! overlap rule), so a submit carries at most 64 MiB of slots' worth of reads (256 reads of
//! 256 KiB, 4,096 of 4 KiB at depth 64); the bytes are not looked at while timing. Before timing, a batch of distinct blocks is read into distinct slots and
//! checked against the pattern (`verified`).
//!
//! Targets: `engine` at least 95 % of `fio` at the same depth for 256 KiB reads
//! (`vs_fio`), and batched submission at least 1.3 × `engine-qd1` (`vs_qd1`).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Serialize;
use umbp_plan::{
    EndpointId, EndpointRegistry, FileOptions, FileSource, Fragment, PlanBuilder, Register,
    Registration, Tag, TransferEngine,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

use crate::host_buffer::HostBuffer;

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
    /// round starting at the next row (engine-qd1, engine, fio-qd1, fio; then engine, fio-qd1,
    /// ...); the row reports the median. A shared disk drifts, and taking turns spreads the
    /// drift over all rows. Default 3.
    pub repeats: usize,
    /// Whether to run the `fio` rows. Default true.
    pub fio: bool,
    /// Seed of the random offsets. Default 42.
    pub seed: u64,
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
            seed: 42,
        }
    }
}

/// One measurement: a block size, a mode and a queue depth.
#[derive(Clone, Debug, Serialize)]
pub struct SsdRow {
    /// Bytes per read.
    pub block_size: u64,
    /// `engine-qd1`, `engine` or `fio`.
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
    /// Whether the file was read with `O_DIRECT`.
    pub direct: bool,
    /// Whether the page cache was dropped before the row (`posix_fadvise` always; also
    /// `/proc/sys/vm/drop_caches` when permitted).
    pub cache_dropped: bool,
    /// Engine rows: the verification read before timing matched the file's pattern.
    pub verified: Option<bool>,
    /// Engine rows: `gib_s` over fio's at the same block size and depth (target for 256 KiB
    /// at the batched depth: at least 0.95).
    pub vs_fio: Option<f64>,
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
    let fio = config.fio && fio_available();

    let repeats = config.repeats.max(1);
    let mut rows = Vec::new();
    for &block_size in &config.block_sizes {
        // Samples of engine-qd1, engine, fio-qd1, fio.
        let mut samples: [Vec<SsdRow>; 4] = Default::default();
        for repeat in 0..repeats {
            // Each repeat starts at the next row, so no row always runs first or last.
            for k in (0..4).map(|k| (k + repeat) % 4) {
                let depth = if k % 2 == 0 { 1 } else { config.queue_depth };
                let sample = match k {
                    0 => measure_engine(&path, config, block_size, depth, "engine-qd1")?,
                    1 => measure_engine(&path, config, block_size, depth, "engine")?,
                    _ if !fio => continue,
                    _ => match measure_fio(&path, config, block_size, depth) {
                        Ok(row) => row,
                        Err(e) => {
                            eprintln!(
                                "umbp-bench ssd: fio at {block_size} B, depth {depth}: {e:#}"
                            );
                            continue;
                        }
                    },
                };
                samples[k].push(sample);
            }
        }
        let [qd1, batched, fio_qd1, fio_batched] = samples.map(median);
        let (Some(qd1), Some(mut batched)) = (qd1, batched) else {
            unreachable!("every repeat measures both engine rows")
        };
        batched.vs_qd1 = Some(batched.gib_s / qd1.gib_s);
        let mut engine_rows = [qd1, batched];
        let fio_rows: Vec<SsdRow> = [fio_qd1, fio_batched].into_iter().flatten().collect();
        for row in &mut engine_rows {
            let fio = fio_rows.iter().find(|f| f.queue_depth == row.queue_depth);
            row.vs_fio = fio.map(|f| row.gib_s / f.gib_s);
        }
        rows.extend(engine_rows);
        rows.extend(fio_rows);
    }
    Ok(rows)
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

/// Drops the file's pages from the page cache: `posix_fadvise(DONTNEED)`, and, where
/// permitted, `/proc/sys/vm/drop_caches`. Returns whether the global drop worked.
fn drop_cache(path: &Path) -> bool {
    if let Ok(file) = File::open(path) {
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok()
}

/// A host buffer registered as an endpoint, aligned to 4 KiB.
struct Slots {
    /// Declared (so dropped) before the buffer it registers.
    registration: Registration,
    buffer: HostBuffer,
}

impl Slots {
    fn new(engine: &SsdEngine, len: usize) -> anyhow::Result<Self> {
        let buffer = HostBuffer::zeroed(len);
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

fn measure_engine(
    path: &Path,
    config: &SsdBenchConfig,
    block_size: u64,
    depth: u32,
    mode: &'static str,
) -> anyhow::Result<SsdRow> {
    let registry = EndpointRegistry::new();
    let engine_config = SsdConfig::new().queue_depth(depth).max_segment(block_size).workers(1);
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
    // the engine's overlap rule and fail): as many slots as reads per submit, within 64 MiB,
    // for each of the submits in flight at once.
    let slot_cap = ((64u64 << 20) / block_size).max(2 * depth as u64);
    let reads_per_submit = (depth as u64 * 64).clamp(64, 8192).min(slot_cap);
    let slots = reads_per_submit.max(2 * depth as u64).max(64) * IN_FLIGHT as u64;
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

    let cache_dropped = drop_cache(path);
    let timed = Duration::from_secs_f64(config.seconds);
    let mut reads = 0u64;
    let mut batches = 0u64;
    let mut in_flight = std::collections::VecDeque::new();
    let settle =
        |handle: umbp_plan::TransferHandle, builder: &mut dyn PlanBuilder| -> anyhow::Result<()> {
            let settled = handle.into_settled();
            if let Some(failure) = settled.failures.first() {
                bail!("a timed read failed: {failure}");
            }
            builder.recycle(settled.plans);
            Ok(())
        };
    let start = Instant::now();
    while start.elapsed() < timed || batches == 0 {
        // Each submit in flight reads into its own share of the slots.
        let first_slot = (batches % IN_FLIGHT as u64) * (slots / IN_FLIGHT as u64);
        for i in 0..reads_per_submit {
            let tag = Tag::new(i as u32);
            let src = rng.below(blocks) * block_size;
            let dst = (first_slot + i) * block_size;
            builder.begin_object(tag)?;
            builder.push(Fragment::new(file, src, host.id(), dst, block_size, tag))?;
            builder.commit_object()?;
        }
        in_flight.push_back(engine.submit(builder.finish()?));
        if in_flight.len() == IN_FLIGHT {
            settle(in_flight.pop_front().expect("one in flight"), &mut builder)?;
        }
        reads += reads_per_submit;
        batches += 1;
    }
    while let Some(handle) = in_flight.pop_front() {
        settle(handle, &mut builder)?;
    }
    let seconds = start.elapsed().as_secs_f64();
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
        direct,
        cache_dropped,
        verified: Some(verified),
        vs_fio: None,
        vs_qd1: None,
    })
}

/// Whether `fio` runs; prints why the fio rows are skipped when it does not.
fn fio_available() -> bool {
    match Command::new("fio").arg("--version").output() {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            eprintln!(
                "umbp-bench ssd: skipping the fio rows: `fio --version` failed ({})",
                out.status
            );
            false
        }
        Err(e) => {
            eprintln!("umbp-bench ssd: skipping the fio rows: fio is not installed ({e})");
            false
        }
    }
}

fn measure_fio(
    path: &Path,
    config: &SsdBenchConfig,
    block_size: u64,
    depth: u32,
) -> anyhow::Result<SsdRow> {
    let cache_dropped = drop_cache(path);
    let runtime = config.seconds.ceil().max(1.0) as u64;
    let out = Command::new("fio")
        .arg("--name=umbp-ssd-bench")
        .arg(format!("--filename={}", path.display()))
        .arg("--rw=randread")
        .arg(format!("--bs={block_size}"))
        .arg(format!("--iodepth={depth}"))
        .arg("--ioengine=io_uring")
        .arg("--direct=1")
        .arg(format!("--size={}", config.file_size))
        .arg(format!("--runtime={runtime}"))
        .arg("--time_based=1")
        .arg("--numjobs=1")
        .arg("--norandommap=1")
        .arg("--randrepeat=0")
        .arg("--output-format=json")
        .output()
        .context("running fio")?;
    if !out.status.success() {
        bail!("fio failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parsing fio's JSON output")?;
    let read = &json["jobs"][0]["read"];
    let (Some(bw), Some(iops), Some(bytes), Some(runtime_ms)) = (
        read["bw_bytes"].as_f64(),
        read["iops"].as_f64(),
        read["io_bytes"].as_u64(),
        read["runtime"].as_f64(),
    ) else {
        bail!("fio's JSON lacks jobs[0].read.{{bw_bytes, iops, io_bytes, runtime}}");
    };
    Ok(SsdRow {
        block_size,
        mode: "fio",
        queue_depth: depth,
        gib_s: bw / f64::from(1u32 << 30),
        iops,
        bytes,
        seconds: runtime_ms / 1000.0,
        samples: 1,
        min_gib_s: 0.0,
        max_gib_s: 0.0,
        backend: "fio-io_uring",
        direct: true,
        cache_dropped,
        verified: None,
        vs_fio: None,
        vs_qd1: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny run: the engine rows verify and the ratios are filled in.
    #[test]
    fn a_small_run_verifies_and_relates_rows() {
        let config = SsdBenchConfig {
            file_size: 8 << 20,
            dir: None,
            block_sizes: vec![64 << 10],
            queue_depth: 8,
            seconds: 0.05,
            repeats: 2,
            fio: false,
            seed: 1,
        };
        let rows = try_run(&config).expect("run");
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.verified == Some(true) && r.bytes > 0 && r.samples == 2));
        assert_eq!((rows[0].mode, rows[1].mode), ("engine-qd1", "engine"));
        assert!(rows[1].vs_qd1.is_some());
    }
}
