//! The host-to-host copy engine of the umbp transfer engines.
//!
//! [`LocalCopyEngine`] implements [`umbp_plan::TransferEngine`] for the pairs where both
//! endpoints are host memory: restoring KV blocks from a DRAM arena into staging buffers, or
//! moving them between arenas.
//!
//! - **Planning** is the `umbp-plan` incremental builder under [`LocalCopyRules`]
//!   ([`LocalCopyBuilder`]): each fragment is validated and merged into the plan as it is
//!   pushed, with per-object rollback. Device and file endpoints are refused at push with
//!   [`RejectReason::PairNotHandled`](umbp_plan::RejectReason::PairNotHandled).
//! - **Executing** happens inside `submit`: every segment is bounds-checked against the
//!   registry as it is at submit, then copied by the calling thread and a persistent worker
//!   pool that claims chunks of segments from a shared cursor. Small submits stay on the
//!   calling thread; segments of 2 KiB and more use non-temporal stores where the CPU has
//!   them. The returned handle is already settled. [`LocalCopyConfig`] holds the knobs and
//!   their environment overrides.
//! - **Batches**: [`LocalCopyEngine::transfer_batch`] plans and copies a list of transfers in
//!   one call and reports one result per object ([`BatchReport`]).
//!
//! # Rules the engine keeps
//!
//! - No object is partially planned: a refused fragment rejects its whole object.
//! - Nothing is written outside the segments of accepted plans, and every segment is
//!   re-checked against its endpoints at submit: a plan whose endpoint was deregistered fails
//!   with [`FailureCause::EndpointGone`](umbp_plan::FailureCause::EndpointGone), one that does
//!   not fit fails whole with `NotAccepted`.
//! - No thread is started per call: the pool's threads start with the engine and stop when it
//!   is dropped.
//!
//! # Example
//!
//! ```
//! use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
//! use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine};
//!
//! let engine = LocalCopyEngine::with_config(EndpointRegistry::new(), LocalCopyConfig::default());
//! // Registrations own their buffers until they end; dropping one deregisters it.
//! let arena = engine.register_memory((0..16 * 1024).map(|i| (i / 1024) as u8).collect::<Vec<u8>>())?;
//! let out = engine.register_memory(vec![0u8; 3 * 1024])?;
//! let (a, o) = (arena.id(), out.id());
//!
//! // Object 0 is stored in 1 KiB pages 9, 10 and 2 of the arena.
//! let mut builder = engine.incremental_builder();
//! builder.begin_object(Tag::new(0))?;
//! for (i, page) in [9u64, 10, 2].into_iter().enumerate() {
//!     builder.push(Fragment::new(a, page * 1024, o, i as u64 * 1024, 1024, Tag::new(0)))?;
//! }
//! builder.commit_object()?;
//! let plans = builder.finish()?;
//! assert_eq!(plans.segment_count(), 2); // pages 9 and 10 merged
//!
//! let mut handle = engine.submit(plans);
//! assert!(handle.wait().is_empty());
//! let out = out.deregister(); // the buffer back, once no transfer uses it
//! assert_eq!((out[0], out[1024], out[2048]), (9, 10, 2));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Unsafe code
//!
//! All of it is in one private module (`copy.rs`): the copy kernels (plain, `memmove` for a
//! task whose ranges overlap, which the overlap rule never lets run but which keeps the kernel
//! sound on its own, and the streaming-store kernel of [`umbp_plan::host_copy`]) and the
//! `Send`/`Sync` of a copy task.
//! The API needs no `unsafe` for memory Rust owns ([`Register::register_memory`]); raw memory
//! goes through [`Register::register_raw_memory`], where the caller promises that it stays
//! valid. Every access after registration is bounds-checked.
//!
//! [`Register::register_memory`]: umbp_plan::Register::register_memory
//! [`Register::register_raw_memory`]: umbp_plan::Register::register_raw_memory

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod batch;
mod config;
#[allow(unsafe_code)]
mod copy;
mod engine;
mod error;
mod pool;
mod rules;

pub use batch::BatchReport;
pub use config::LocalCopyConfig;
pub use engine::LocalCopyEngine;
pub use error::Error;
pub use rules::{LocalCopyBuilder, LocalCopyRules};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
