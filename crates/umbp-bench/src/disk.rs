//! The disk under a benchmark's file: `fio` on the same file, the CPU that takes the disk's
//! completions, and dropping the file from the page cache.
//!
//! # Why the benches pin the SSD engine and fio to one CPU
//!
//! On a disk whose completion interrupts all arrive on one CPU (a virtual disk with one
//! queue, or a drive with fewer queues than CPUs), a thread waiting for completions on
//! another CPU is woken by an inter-processor interrupt for every completion round. On the
//! 2-CPU virtual machine this project is developed on that halves depth-1 reads per second,
//! for fio and the engine alike (7.2 k against 14.7 k IOPS at 4 KiB). Left to the scheduler,
//! a thread stays on whichever CPU it woke on last, so unpinned runs of either land on one
//! rate or the other by chance, and a comparison of the two measures that lottery. So both
//! run pinned to the same CPU, by default the one that took most of the disk's interrupts
//! while a probe read from the file ([`completion_cpu`]): the best placement the machine
//! offers, given to both.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};

use crate::measure::Timed;

/// Where the SSD engine's workers and fio run.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Both pinned to the CPU that takes the disk's completions, found by [`completion_cpu`];
    /// unpinned where it cannot be found. The default.
    #[default]
    Completions,
    /// Both pinned to this CPU.
    Cpu(usize),
    /// Neither pinned: the scheduler places them.
    Unpinned,
}

impl Placement {
    /// The CPU to pin to for reads from `path` (`None`: unpinned). For [`Placement::Completions`]
    /// this runs the probe; where it finds no CPU, both run unpinned, which the rows say
    /// (their `cpu` is `null`).
    pub fn cpu(self, path: &Path) -> Option<usize> {
        match self {
            Placement::Cpu(cpu) => Some(cpu),
            Placement::Unpinned => None,
            Placement::Completions => completion_cpu(path).ok(),
        }
    }
}

/// Per-CPU counts of every numbered interrupt line in `/proc/interrupts` (the named rows,
/// such as timer and rescheduling interrupts, are left out).
fn interrupts() -> anyhow::Result<Vec<Vec<u64>>> {
    let text = std::fs::read_to_string("/proc/interrupts").context("reading /proc/interrupts")?;
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |header| header.split_whitespace().count());
    Ok(lines
        .filter_map(|line| {
            let (irq, counts) = line.split_once(':')?;
            irq.trim().parse::<u32>().ok()?;
            let counts: Vec<u64> =
                counts.split_whitespace().take(cpus).map_while(|c| c.parse().ok()).collect();
            (counts.len() == cpus).then_some(counts)
        })
        .collect())
}

/// The CPU that takes the completions of reads from `path`: 256 random 4 KiB `O_DIRECT`
/// reads by one thread at depth 1, and the CPU with the most of them on the interrupt line
/// that fired most meanwhile. Fails where `/proc/interrupts` is unreadable or no numbered
/// line fired at least once per 4 reads.
pub fn completion_cpu(path: &Path) -> anyhow::Result<usize> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const READS: u64 = 256;
    const BLOCK: usize = 4096;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT for the probe", path.display()))?;
    let blocks = file.metadata()?.len() / BLOCK as u64;
    if blocks == 0 {
        bail!("{} is too short for the probe", path.display());
    }
    let mut buf = crate::host_buffer::HostBuffer::zeroed(BLOCK);
    let before = interrupts()?;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..READS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        file.read_exact_at(buf.bytes_mut(), (x % blocks) * BLOCK as u64).context("a probe read")?;
    }
    let after = interrupts()?;
    let delta = |line: usize| -> Vec<u64> {
        after[line].iter().zip(&before[line]).map(|(a, b)| a.saturating_sub(*b)).collect()
    };
    let busiest = (0..after.len().min(before.len()))
        .map(delta)
        .max_by_key(|counts| counts.iter().sum::<u64>())
        .filter(|counts| counts.iter().sum::<u64>() >= READS / 4)
        .context("no interrupt line fired with the probe's reads")?;
    let (cpu, _) = busiest
        .iter()
        .enumerate()
        .max_by_key(|&(_, count)| *count)
        .context("/proc/interrupts lists no CPU")?;
    Ok(cpu)
}

/// Drops the file's pages from the page cache: `posix_fadvise(DONTNEED)`, and, where
/// permitted, `/proc/sys/vm/drop_caches`. Returns whether the global drop worked.
pub fn drop_cache(path: &Path) -> bool {
    if let Ok(file) = File::open(path) {
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok()
}

/// Whether `fio` runs; prints why the fio figures are skipped when it does not.
pub fn fio_available() -> bool {
    match Command::new("fio").arg("--version").output() {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            eprintln!("umbp-bench: skipping fio: `fio --version` failed ({})", out.status);
            false
        }
        Err(e) => {
            eprintln!("umbp-bench: skipping fio: fio is not installed ({e})");
            false
        }
    }
}

/// How much one fio run reads.
#[derive(Copy, Clone, Debug)]
pub enum FioAmount {
    /// For this many seconds (rounded up to whole seconds, at least one).
    Seconds(f64),
    /// This many bytes.
    Bytes(u64),
}

/// Random `O_DIRECT` reads of one file by fio's io_uring engine, one job.
#[derive(Clone, Debug)]
pub struct FioReads<'a> {
    /// The file.
    pub path: &'a Path,
    /// Bytes of the file the offsets fall in, from its start.
    pub size: u64,
    /// Bytes per read.
    pub block_size: u64,
    /// Reads in flight.
    pub depth: u32,
    /// How long the run reads.
    pub amount: FioAmount,
    /// The CPU fio's job is pinned to (`None`: unpinned).
    pub cpu: Option<usize>,
}

/// One fio run's figures.
#[derive(Copy, Clone, Debug)]
pub struct FioRun {
    /// Throughput, GiB/s.
    pub gib_s: f64,
    /// Reads per second.
    pub iops: f64,
    /// Bytes read.
    pub bytes: u64,
    /// Seconds fio read for.
    pub seconds: f64,
    /// Whether the global page-cache drop before the run worked ([`drop_cache`]).
    pub cache_dropped: bool,
}

/// The memory fio reads into. The benches run fio with each kind the machine allows and
/// compare the engine with the fastest, because the engine's own buffers
/// ([`umbp_plan::AlignedBuffer::for_direct_io`]) ask for huge pages: where reads into huge
/// pages run faster (on this project's virtual machine they do, for fio too), fio's default
/// buffers alone would be a ceiling the engine could beat for the wrong reason.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FioBuffers {
    /// fio's own buffers and file descriptors (`--iomem=malloc`, its default).
    Default,
    /// Buffers and the file registered with the ring (`--fixedbufs --registerfiles`).
    Registered,
    /// Buffers in huge pages (`--iomem=shmhuge`), which needs free huge pages reserved
    /// (`vm.nr_hugepages`).
    HugePages,
}

impl FioBuffers {
    /// The row name of a fio run with these buffers.
    pub fn mode(self) -> &'static str {
        match self {
            FioBuffers::Default => "fio",
            FioBuffers::Registered => "fio-registered",
            FioBuffers::HugePages => "fio-huge",
        }
    }

    /// The kinds fio can use for `depth` reads of `block_size` bytes in flight: all three
    /// where enough reserved huge pages are free for its buffers, else the first two, and
    /// `bench` (the subcommand) says on stderr that fio's best may fall short.
    pub fn available(depth: u32, block_size: u64, bench: &str) -> Vec<FioBuffers> {
        let mut kinds = vec![FioBuffers::Default, FioBuffers::Registered];
        let needed = u64::from(depth) * block_size + HUGE_PAGE;
        if free_huge_page_bytes().is_some_and(|free| free >= needed) {
            kinds.push(FioBuffers::HugePages);
        } else {
            eprintln!(
                "umbp-bench {bench}: fio runs without huge pages at {block_size} B, depth \
                 {depth}: too few are reserved and free (vm.nr_hugepages), while the engine's \
                 buffers ask for them"
            );
        }
        kinds
    }
}

/// fio's kinds of buffers ranked by the median of their runs' GiB/s, fastest first: the index
/// of each kind in `runs` with its median and spread; a kind without runs is left out. The
/// first is fio's ceiling in both benches: ranking by median keeps fio's noise out of the
/// ceiling, where each round's fastest run of any kind would not (the largest of three runs
/// that swing by ±10 % each lies above what any kind does typically).
pub fn rank_by_median(runs: &[Vec<f64>]) -> Vec<(usize, Timed)> {
    let mut ranked: Vec<(usize, Timed)> = runs
        .iter()
        .enumerate()
        .filter(|(_, gib_s)| !gib_s.is_empty())
        .map(|(kind, gib_s)| (kind, Timed::of(gib_s)))
        .collect();
    ranked.sort_by(|a, b| b.1.median.total_cmp(&a.1.median));
    ranked
}

/// fio's huge pages, and the engine's: 2 MiB.
const HUGE_PAGE: u64 = umbp_plan::AlignedBuffer::HUGE_PAGE as u64;

/// Bytes of reserved huge pages free now (`HugePages_Free` of `/proc/meminfo`, in pages of
/// 2 MiB); `None` where it cannot be read or the pages are of another size.
fn free_huge_page_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        meminfo.lines().find_map(|line| {
            let value = line.strip_prefix(name)?.strip_prefix(':')?;
            value.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    (field("Hugepagesize")? * 1024 == HUGE_PAGE).then_some(field("HugePages_Free")? * HUGE_PAGE)
}

impl FioReads<'_> {
    /// Runs fio once into `buffers`, after dropping the file's cache.
    pub fn run(&self, buffers: FioBuffers) -> anyhow::Result<FioRun> {
        let cache_dropped = drop_cache(self.path);
        let mut fio = Command::new("fio");
        fio.arg("--name=umbp-bench")
            .arg(format!("--filename={}", self.path.display()))
            .arg("--rw=randread")
            .arg(format!("--bs={}", self.block_size))
            .arg(format!("--iodepth={}", self.depth))
            .arg("--ioengine=io_uring")
            .arg("--direct=1")
            .arg(format!("--size={}", self.size))
            .arg("--numjobs=1")
            .arg("--norandommap=1")
            .arg("--randrepeat=0")
            .arg("--output-format=json");
        match self.amount {
            FioAmount::Seconds(s) => {
                fio.arg(format!("--runtime={}", s.ceil().max(1.0) as u64)).arg("--time_based=1")
            }
            FioAmount::Bytes(bytes) => fio.arg(format!("--io_size={bytes}")),
        };
        match buffers {
            FioBuffers::Default => {}
            FioBuffers::Registered => {
                fio.arg("--fixedbufs=1").arg("--registerfiles=1");
            }
            FioBuffers::HugePages => {
                fio.arg("--iomem=shmhuge");
            }
        }
        if let Some(cpu) = self.cpu {
            fio.arg(format!("--cpus_allowed={cpu}"));
        }
        let out = fio.output().context("running fio")?;
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
        let gib_s = bw / f64::from(1u32 << 30);
        Ok(FioRun { gib_s, iops, bytes, seconds: runtime_ms / 1e3, cache_dropped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ceiling is the kind with the fastest median, not the one with the fastest single
    /// run; a kind without runs is left out.
    #[test]
    fn kinds_rank_by_their_median_not_their_best_run() {
        let runs = vec![vec![1.0, 3.0, 2.0], vec![], vec![9.0, 0.5, 1.5]];
        let ranked: Vec<(usize, f64)> =
            rank_by_median(&runs).iter().map(|&(kind, t)| (kind, t.median)).collect();
        assert_eq!(ranked, [(0, 2.0), (2, 1.5)]);
    }

    #[test]
    fn interrupt_counts_have_one_column_per_cpu() {
        let Ok(lines) = interrupts() else {
            eprintln!("skipping: /proc/interrupts is unreadable here");
            return;
        };
        let cpus = std::fs::read_to_string("/proc/interrupts")
            .unwrap()
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .count();
        assert!(cpus >= 1);
        assert!(lines.iter().all(|counts| counts.len() == cpus));
    }

    #[test]
    fn the_completion_cpu_is_one_of_the_machines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("probe.bin");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        match completion_cpu(&path) {
            Ok(cpu) => {
                let cpus = interrupts().unwrap().first().map_or(0, Vec::len);
                assert!(cpu < cpus, "CPU {cpu} of {cpus}");
            }
            // tmpfs refuses O_DIRECT, and a machine may hide /proc/interrupts.
            Err(e) => eprintln!("skipping: no completion CPU here: {e:#}"),
        }
    }
}
