//! The engine's configuration.

/// Which executor runs the engine's I/O.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backend {
    /// io_uring where the kernel allows it, else `pread`/`pwrite` (logged once). The default.
    #[default]
    Auto,
    /// io_uring only: [`SsdEngine::new`](crate::SsdEngine::new) fails where it is unavailable.
    IoUring,
    /// `pread`/`pwrite` on the worker threads, one request at a time.
    Blocking,
}

/// How an [`SsdEngine`](crate::SsdEngine) runs. Every field has a documented default; set the
/// ones you need in a struct literal over [`SsdConfig::default`]:
///
/// ```
/// use umbp_ssd::{Backend, SsdConfig};
///
/// let config = SsdConfig { queue_depth: 32, backend: Backend::Blocking, ..SsdConfig::default() };
/// assert_eq!(config.workers, 2); // a default
/// ```
///
/// [`SsdEngine::new`](crate::SsdEngine::new) checks the values (and probes io_uring); building
/// a configuration does neither.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdConfig {
    /// Requests each worker keeps in flight (default 64; at least 1, at most 4096).
    pub queue_depth: u32,
    /// The largest single read or write the engine issues (default 1 MiB). Builders stop
    /// merging fragments at this length and reject longer fragments.
    pub max_segment: u64,
    /// Worker threads, each with its own ring (default 2). Each submitted plan set runs on one
    /// worker; concurrent submits spread over the workers.
    pub workers: usize,
    /// The executor (default [`Backend::Auto`]).
    pub backend: Backend,
    /// Bytes of bounce buffers a worker uses at once for unaligned `O_DIRECT` pieces (default
    /// 16 MiB). One piece may always run alone, whatever its size.
    pub bounce_budget: u64,
    /// The engine's name in failures, logs and metrics (default `ssd`, beside `localcopy` and
    /// `hbm`).
    pub name: String,
    /// Pins worker `i` to CPU `worker_cpus[i % worker_cpus.len()]` (default: empty, no worker
    /// is pinned and the scheduler places them).
    ///
    /// Where a worker waits matters on a disk whose completion interrupts all arrive on one CPU
    /// (a virtual disk with one queue, or an NVMe drive with fewer queues than CPUs): a worker
    /// on another CPU is woken by an inter-processor interrupt for every completion round, and
    /// on one 2-CPU virtual machine that halved the reads per second at depth 1. Pin workers
    /// where the completions arrive (`/proc/interrupts` shows where), on the drive's NUMA
    /// node, and away from the threads that feed the GPU. [`SsdEngine::new`](crate::SsdEngine::new)
    /// fails with [`Error::InvalidConfig`](crate::Error::InvalidConfig) for a CPU number of
    /// 1024 or more, and with [`Error::Affinity`](crate::Error::Affinity) for a CPU this process
    /// may not run on.
    pub worker_cpus: Vec<usize>,
}

impl SsdConfig {
    /// The default queue depth.
    pub const DEFAULT_QUEUE_DEPTH: u32 = 64;
    /// The default maximum segment: 1 MiB.
    pub const DEFAULT_MAX_SEGMENT: u64 = 1 << 20;
}

impl Default for SsdConfig {
    /// Queue depth 64, 1 MiB segments, 2 workers, [`Backend::Auto`], 16 MiB of bounce buffers
    /// in use per worker, name `ssd`, workers not pinned.
    fn default() -> Self {
        Self {
            queue_depth: Self::DEFAULT_QUEUE_DEPTH,
            max_segment: Self::DEFAULT_MAX_SEGMENT,
            workers: 2,
            backend: Backend::Auto,
            bounce_budget: 16 << 20,
            name: "ssd".to_owned(),
            worker_cpus: Vec::new(),
        }
    }
}
