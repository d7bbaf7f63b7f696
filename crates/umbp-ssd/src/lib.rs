//! The io_uring SSD engine of the umbp transfer engines: moves bytes between file endpoints
//! and host memory, for restoring KV-cache objects from SSD files (file → host) and offloading
//! them (host → file).
//!
//! - **Endpoints.** Files and host memory register through [`umbp_plan::Register`], as with
//!   every umbp engine: `register_file` takes a path (opened with `O_DIRECT` by default,
//!   buffered where the filesystem refuses it) or a descriptor, and the engine inspects it at
//!   once; `register_memory` takes a buffer such as [`AlignedBuffer`](umbp_plan::AlignedBuffer),
//!   aligned for `O_DIRECT`.
//! - **Planning.** The engine's builder is umbp-plan's [`IncrementalBuilder`](umbp_plan::IncrementalBuilder)
//!   with [`SsdRules`]: one plan per (file, host buffer) pair, adjacent fragments merged up to
//!   the maximum segment (1 MiB by default), per-object rollback.
//! - **Execution.** Each worker thread owns an io_uring ring and keeps up to the queue depth
//!   (64 by default) reads and writes in flight, submitting every queued request with one
//!   `io_uring_enter` and reaping completions in batches. A ring runs up to four submitted
//!   batches at once: once those in it have issued everything, the next queued one fills the
//!   ring while their last requests complete, so a caller that keeps two submits in flight
//!   keeps the ring full. Batches are unordered with respect to each other. Short transfers are resubmitted for
//!   the remainder; the end of the file before the requested bytes fails the segment with
//!   `ShortFile`, an I/O error with its errno. Where io_uring is unavailable the workers use
//!   `pread`/`pwrite` with the same semantics ([`Backend`]).
//! - **Alignment.** With `O_DIRECT`, a piece whose file offset, length or memory address is not
//!   aligned to the file's logical block size goes through an aligned bounce buffer (a
//!   read-modify-write of the whole blocks for writes); aligned pieces move straight between the
//!   file and the caller's memory.
//! - **Writes across batches.** Every read-modify-write of a block is ordered against every
//!   other write of that block through a bounce buffer or a buffered registration,
//!   process-wide (across batches, workers, ring lanes, engines and registrations of one file,
//!   `O_DIRECT` or not, known by device and inode): two batches that write different bytes of
//!   one block both land. Unaligned reads of a block being rewritten wait for it. Aligned
//!   `O_DIRECT` reads and writes and buffered reads are not ordered (they cost nothing more);
//!   two batches writing the same bytes at once remain the caller's race. The private
//!   `sectors` module says exactly what is ordered.
//! - **Failures.** One [`Failure`](umbp_plan::Failure) per failed plan, segment or object's
//!   share of a segment, with exactly the tags of the objects whose bytes did not arrive: a
//!   failed read or write of a segment that merged several objects is re-issued once per
//!   object's share, and only the shares that fail again cost their objects (a read past the
//!   end of the file is narrowed the same way before any byte moves). A failure before the I/O
//!   is issued (a deregistered endpoint, the end of the file, an injected fault) leaves the
//!   destination untouched; a device error in the middle of a transfer may leave part of the
//!   failed object's own destination written, never anything outside it.
//! - **Overlap.** Objects whose bytes meet a write of the same submit (two reads into the same
//!   memory, a write and a read of the same file bytes) fail with
//!   [`FailureCause::Overlap`](umbp_plan::FailureCause::Overlap) at submit and move nothing
//!   ([`OverlapCheck`](umbp_plan::OverlapCheck)).
//! - **Deadlines and cancel.** A plan set with a [deadline](umbp_plan::PlanSet::deadline) ends
//!   by it, and one with a [cancel token](umbp_plan::PlanSet::cancel_token) ends when the
//!   token is cancelled: the ring cancels the requests in flight in the kernel, nothing more is
//!   issued, and the objects whose bytes did not arrive fail with
//!   [`FailureCause::TimedOut`](umbp_plan::FailureCause::TimedOut) or
//!   [`FailureCause::Cancelled`](umbp_plan::FailureCause::Cancelled). A cancel wakes the
//!   worker that holds the batch at once, even while it waits for completions. A batch still
//!   queued (every worker busy, even with reads that never complete) settles at its deadline
//!   or cancel without waiting for a worker, every object failed and nothing issued; one
//!   cancelled before submit settles at once. The blocking fallback sees a deadline or cancel
//!   between calls (a `pread` cannot be cancelled).
//! - **Lifetimes.** Files and memory register through [`umbp_plan::Register`]; the
//!   registration owns the descriptor. A batch pins its endpoints from submit until it settles,
//!   and ending a registration waits for those batches before the descriptor closes.
//!
//! # Example
//!
//! ```
//! use umbp_plan::{
//!     AlignedBuffer, EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine,
//! };
//! use umbp_ssd::{SsdConfig, SsdEngine};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("pool.bin");
//! std::fs::write(&path, vec![7u8; 1 << 20])?;
//!
//! let registry = EndpointRegistry::new();
//! let engine = SsdEngine::new(registry.clone(), SsdConfig::default())?;
//! // O_DIRECT by default (buffered where the filesystem refuses it); aligned memory for it.
//! let file = engine.register_file(path.as_path(), 0, 1 << 20)?;
//! let out = engine.register_memory(AlignedBuffer::for_direct_io(8192))?;
//! let (file_id, host) = (file.id(), out.id());
//!
//! let mut builder = engine.builder();
//! let tag = Tag::new(0);
//! builder.begin_object(tag)?;
//! builder.push(Fragment::new(file_id, 4096, host, 0, 8192, tag))?;
//! builder.commit_object()?;
//! let mut handle = engine.submit(builder.finish()?);
//! assert!(handle.wait().is_empty());
//! assert!(out.deregister().iter().all(|&b| b == 7));
//! # Ok(())
//! # }
//! ```
//!
//! # Unsafe code
//!
//! Three private modules hold all of it: `sys` (system calls, raw host memory, bounce
//! buffers), `ring` (pushing submission entries) and `fallback` (performing a request with
//! `pread`/`pwrite`). Every segment is bounds-checked against its
//! endpoints at submit; beyond that, the engine relies on the contract of registration
//! ([`umbp_plan::Register`]): registered memory stays valid until the registration has ended,
//! which waits for every batch that used it.
//!
//! # Cargo features
//!
//! - `fault-injection`: `SsdEngine::inject_fault` fails chosen operations with a chosen
//!   errno, for failure tests.

mod batch;
mod config;
mod engine;
mod error;
mod fallback;
mod fault;
mod file;
mod op;
mod ring;
mod rules;
mod sectors;
mod sys;
mod wake;
mod worker;

pub use config::{Backend, SsdConfig};
pub use engine::SsdEngine;
pub use error::Error;
#[cfg(feature = "fault-injection")]
pub use fault::{FaultOp, FaultTrigger, IoFault};
pub use file::FileInfo;
pub use rules::SsdRules;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
