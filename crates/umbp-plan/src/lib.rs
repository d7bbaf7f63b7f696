//! The vocabulary and traits of the umbp transfer engines.
//!
//! An LLM inference server keeps its KV cache in tiers (GPU memory, host memory, SSD files) and
//! moves *objects* (cached KV blocks) between them. A transfer of one object is many *fragments*:
//! the caller asks for byte ranges of the object, and the pool stores it as scattered pages, so
//! every range splits at page boundaries. This crate names those pieces and turns fragments into
//! *plans* that an engine executes. It knows no engine and does no I/O.
//!
//! - [`EndpointRegistry`] names the regions bytes live in ([`Endpoint`]: host memory, device
//!   memory, a file range, a region another node exported) with small [`EndpointId`]s.
//! - A [`Fragment`] copies bytes from one endpoint to another on behalf of an object ([`Tag`]).
//! - A [`PlanBuilder`] turns the fragments of a batch into a [`PlanSet`]: one [`Plan`] per
//!   endpoint pair, with adjacent fragments merged, plus the tags of rejected objects. The
//!   [`IncrementalBuilder`] does so as fragments arrive, with per-object rollback; the
//!   [`BufferedPlanBuilder`] collects them and plans at the end.
//! - [`PageWalk`] splits a range of a paged object into [`PageFragment`]s.
//! - A [`TransferEngine`] executes plan sets and reports [`Failure`]s through a
//!   [`TransferHandle`]; [`BatchStatus`] turns them into one result per object.
//!
//! # Rules every builder keeps
//!
//! - A zero-length fragment is skipped. Every other fragment is checked, overflow-safe, against
//!   both endpoints and the engine's [`PlanRules`]. A refused fragment *poisons* its object:
//!   none of the object's fragments reach a plan, and its tag is rejected once.
//! - A fragment extends the last segment of its pair's plan only when source and destination
//!   are both exactly adjacent to it and the merged length stays within the engine's maximum.
//! - `rollback_object` restores the builder exactly to its state at `begin_object`.
//! - `finish` equals [`plan_batch`] over the fragments of the committed objects.
//!
//! # Example
//!
//! ```
//! use umbp_plan::{
//!     Endpoint, EndpointRegistry, Fragment, IncrementalBuilder, PageWalk, PlanBuilder,
//!     PlanRules, Tag,
//! };
//!
//! /// An engine that carries host-to-host copies.
//! struct HostOnly;
//! impl PlanRules for HostOnly {
//!     fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
//!         src.is_host() && dst.is_host()
//!     }
//! }
//!
//! let registry = EndpointRegistry::new();
//! // SAFETY: these plans are inspected, never submitted, so the addresses are never used.
//! let (arena, out) = unsafe {
//!     (registry.register(Endpoint::host(0x1000_0000, 1 << 20)),
//!      registry.register(Endpoint::host(0x2000_0000, 1 << 20)))
//! };
//!
//! // Object 0 lives in three 4 KiB pages of the arena, the first two adjacent.
//! let pages = [0x8000, 0x9000, 0x2000];
//! let walk = PageWalk::new(&pages, 4096, 3 * 4096)?;
//!
//! let mut builder = IncrementalBuilder::new(HostOnly, registry.clone());
//! let tag = Tag::new(0);
//! builder.begin_object(tag)?;
//! walk.walk(0, 3 * 4096, 0, |page| {
//!     builder.push(Fragment::new(arena, page.tier_offset, out, page.dst_offset, page.len, tag))
//! })?;
//! builder.commit_object()?;
//!
//! let plans = builder.finish()?;
//! assert_eq!(plans.plans().len(), 1);
//! let lens: Vec<u64> = plans.plans()[0].segments().iter().map(|s| s.len).collect();
//! assert_eq!(lens, [8192, 4096]); // the two adjacent pages merged
//! assert!(plans.rejected().is_empty());
//! # Ok::<(), umbp_plan::Error>(())
//! ```
//!
//! # Unsafe code
//!
//! Little runs here: the allocation of [`AlignedBuffer`] and one `fcntl` in registration. The
//! other `unsafe` items state obligations: [`EndpointRegistry::register`] and
//! [`Register::register_raw_memory`] let engines dereference registered addresses after bounds
//! checks alone, and [`DeviceStream::new`] lets the device engine hand a raw stream handle to
//! its driver.

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod aligned;
mod append;
mod batch;
mod builder;
mod cancel;
pub mod checksum;
mod endpoint;
mod engine;
mod error;
mod fragment;
pub mod host_copy;
mod incremental;
mod overlap;
mod page_walk;
mod plan;
mod register;
mod rules;
mod status;
mod stream;

#[cfg(feature = "testing")]
pub mod testing;

pub use aligned::AlignedBuffer;
pub use batch::plan_batch;
pub use builder::{BatchPlanner, BufferedPlanBuilder, PlanBuilder, RulePlanner};
pub use cancel::CancelToken;
pub use endpoint::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointKind, EndpointPins, EndpointRegistry,
    EndpointTable, FileRange, RemoteRegion, Tag,
};
pub use engine::{
    yield_until, Completion, EngineError, Failure, FailureCause, SettleSlot, Settled,
    TransferEngine, TransferHandle, SPIN_BEFORE_SLEEP,
};
pub use error::{Error, RejectReason, WalkError};
pub use fragment::Fragment;
pub use incremental::{IncrementalBuilder, Run};
pub use overlap::{sweep_overlaps, OverlapCheck, RangeAccess, Space, SweepScratch};
pub use page_walk::{check_ranges, PageFragment, PageWalk};
pub use plan::{FailedAt, Plan, PlanSet, Segment};
pub use register::{
    EndpointRelease, FileOptions, FileSource, HostMemory, Register, RegisterError, Registration,
};
pub use rules::{validate, PlanRules};
pub use status::{BatchState, BatchStatus, ObjectState};
pub use stream::{DeviceStream, GroupListener};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
