//! The crate's error type.

use std::io;
use std::path::PathBuf;

use umbp_plan::EndpointId;

/// Why an engine could not be created or an endpoint could not be registered. Failures of
/// transfers are [`umbp_plan::Failure`]s instead, one per failed plan or segment.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is unusable (a caller mistake).
    #[error("invalid configuration: {0}")]
    InvalidConfig(&'static str),
    /// [`Backend::IoUring`](crate::Backend::IoUring) was asked for and the kernel (or a
    /// seccomp filter) refuses io_uring.
    #[error("io_uring is unavailable: {source}")]
    RingUnavailable {
        /// What setting up the ring returned.
        source: io::Error,
    },
    /// A worker thread could not be started.
    #[error("cannot start a worker thread: {source}")]
    Spawn {
        /// What the spawn returned.
        source: io::Error,
    },
    /// Opening a file failed (missing, permission denied, ...).
    #[error("cannot open {}: {source}", .path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// What `open` returned.
        source: io::Error,
    },
    /// A descriptor handed to [`register_fd`](crate::SsdEngine::register_fd) cannot be
    /// inspected.
    #[error("cannot inspect file descriptor {fd}: {source}")]
    Inspect {
        /// The descriptor.
        fd: i32,
        /// What `fcntl` returned.
        source: io::Error,
    },
    /// `file_offset + len` of a file endpoint does not fit in 64 bits (a caller mistake).
    #[error("file range {file_offset}..+{len} overflows")]
    RangeOverflow {
        /// Start of the range in the file.
        file_offset: u64,
        /// Length of the range.
        len: u64,
    },
    /// An endpoint id that the registry does not hold (a caller mistake).
    #[error("endpoint {} is not registered", .0.raw())]
    UnknownEndpoint(EndpointId),
}
