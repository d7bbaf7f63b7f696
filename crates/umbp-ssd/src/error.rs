//! The crate's error type.

use std::io;

/// Why an engine could not be created. Registration refusals are
/// [`umbp_plan::RegisterError`]s; failures of transfers are [`umbp_plan::Failure`]s instead,
/// one per failed plan or segment.
///
/// `Display` gives this error's own words; a cause (the system's error, an engine's) is its
/// [`source`](std::error::Error::source), to print after it (anyhow's `{:#}` does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable (a caller mistake).
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
    /// [`Backend::IoUring`](crate::Backend::IoUring) was asked for and the kernel (or a
    /// seccomp filter) refuses io_uring.
    #[error("io_uring is unavailable")]
    RingUnavailable {
        /// What setting up the ring returned.
        source: io::Error,
    },
    /// A worker thread could not be started.
    #[error("cannot start a worker thread")]
    Spawn {
        /// What the spawn returned.
        source: io::Error,
    },
    /// A worker could not be pinned to its CPU
    /// ([`SsdConfig::worker_cpus`](crate::SsdConfig::worker_cpus)): the CPU is offline, or
    /// outside the CPUs this process may run on.
    #[error("cannot pin a worker to CPU {cpu}")]
    Affinity {
        /// The CPU asked for.
        cpu: usize,
        /// What `sched_setaffinity` returned.
        source: io::Error,
    },
}
