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

/// How an [`SsdEngine`](crate::SsdEngine) runs. Built with [`SsdConfig::new`] and chained
/// setters, each stating its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SsdConfig {
    pub(crate) queue_depth: u32,
    pub(crate) max_segment: u64,
    pub(crate) workers: usize,
    pub(crate) backend: Backend,
    pub(crate) bounce_budget: u64,
    pub(crate) name: String,
    pub(crate) worker_cpus: Vec<usize>,
}

impl Default for SsdConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl SsdConfig {
    /// The default queue depth.
    pub const DEFAULT_QUEUE_DEPTH: u32 = 64;
    /// The default maximum segment: 1 MiB.
    pub const DEFAULT_MAX_SEGMENT: u64 = 1 << 20;

    /// The defaults: queue depth 64, 1 MiB segments, 2 workers, [`Backend::Auto`], 16 MiB of
    /// bounce buffers in use per worker, name `ssd`, workers not pinned.
    pub fn new() -> Self {
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

    /// Requests each worker keeps in flight (default 64; at least 1, at most 4096).
    pub fn queue_depth(mut self, depth: u32) -> Self {
        self.queue_depth = depth;
        self
    }

    /// The largest single read or write the engine issues (default 1 MiB). Builders stop
    /// merging fragments at this length and reject longer fragments.
    pub fn max_segment(mut self, bytes: u64) -> Self {
        self.max_segment = bytes;
        self
    }

    /// Worker threads, each with its own ring (default 2). Each submitted plan set runs on one
    /// worker; concurrent submits spread over the workers.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// The executor (default [`Backend::Auto`]).
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// Bytes of bounce buffers a worker uses at once for unaligned `O_DIRECT` pieces (default
    /// 16 MiB). One piece may always run alone, whatever its size.
    pub fn bounce_budget(mut self, bytes: u64) -> Self {
        self.bounce_budget = bytes;
        self
    }

    /// The engine's name in failures, logs and metrics (default `ssd`, beside `localcopy` and
    /// `hbm`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Pins worker `i` to CPU `cpus[i % cpus.len()]` (default: empty, no worker is pinned and
    /// the scheduler places them).
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
    pub fn worker_cpus(mut self, cpus: impl IntoIterator<Item = usize>) -> Self {
        self.worker_cpus = cpus.into_iter().collect();
        self
    }
}
