//! The composite engine of the umbp transfer engines: one builder, one non-blocking submit,
//! one result per object, for batches that span host memory, device memory and SSD files.
//!
//! - [`CompositeEngine`] holds engines (any [`TransferEngine`](umbp_plan::TransferEngine), from
//!   any crate) in preference order. It registers memory and files like every umbp engine
//!   ([`Register`](umbp_plan::Register)), once for all of its engines; the guard it returns
//!   deregisters when dropped, after the batches that use the endpoint.
//! - [`CompositeEngine`] is a cheap handle (clones share everything), and a
//!   [`CompositeBuilder`] owns one: a builder can live in a struct or a `thread_local!`.
//! - [`CompositeBuilder`] routes each fragment to the first engine that claims its pair
//!   ([`route`]) and pushes it into that engine's own builder, created on first use: engines
//!   with an incremental builder plan incrementally, others get the buffered default. One
//!   object scope spans every engine: a rejection or a rollback undoes the object everywhere,
//!   including a rejection a buffered builder only finds at `finish`.
//! - A pair no engine claims but two engines can carry through a registered host bounce region
//!   ([`Staging`]) takes the staged route: two hops per stage, each stage holding its own slot
//!   of the bounce region, so concurrent batches never share bounce bytes.
//! - [`CompositeEngine::submit`] returns a [`Batch`] at once. The composite's executor (threads
//!   started once, [`CompositeConfig::workers`]) runs each engine's share side by side, layer
//!   group after layer group; the batch shows each object's state while in flight, and can be
//!   waited for whole, by layer group ([`Batch::wait_group`]), with a deadline, or cancelled;
//!   or awaited ([`Batch`] is a `Future`, and [`Batch::group_settled`] returns one) with no
//!   thread per wait.
//! - Block checksums ([`ChecksumPolicy`]): offloads report each object's CRC32C
//!   ([`ObjectResult::checksum`]), restores given one ([`ObjectTransfer::checksum`]) verify
//!   it where the bytes sit in host memory on their way, and an object whose bytes changed in
//!   its tier fails alone with
//!   [`FailureCause::ChecksumMismatch`](umbp_plan::FailureCause::ChecksumMismatch).
//! - Metrics in the Prometheus text format: [`CompositeEngine::metrics_text`].
//! - [`start_restore`] / [`start_offload`] take paged objects and the caller's ranges (each
//!   range in a layer group) and return the batch; [`restore`] and [`offload`] wait for it.
//!   Results and errors name the caller's own 64-bit tags.
//!
//! # Promises
//!
//! - No object is ever partially planned: an object rejected anywhere has no byte in any plan.
//! - One batch never writes a byte twice: the overlap rule holds across the whole batch (every
//!   engine, layer group, route and stage), checked at [`CompositeBuilder::finish`]; objects
//!   that break it fail with [`FailureCause::Overlap`](umbp_plan::FailureCause::Overlap)
//!   before anything runs, and nothing of them is written.
//! - A failure lands on exactly its objects: a failed transfer, an engine that panics (in a
//!   direct part or either hop of a stage) fail the objects of that work with a typed cause
//!   naming the engine; nothing reports completed for bytes that did not arrive, and nothing
//!   panics out of the composite.
//! - The composite is `Sync`: any number of threads may plan and submit at once.
//! - Nothing returns while an engine still writes caller memory for a batch that the call
//!   settles: [`Batch::wait`], [`Batch::cancel`], dropping a batch and dropping the composite's
//!   last handle (a clone, or a builder) all wait for the work they end.
//! - Cancel and deadlines settle work that has not started at once, wherever it waits (behind
//!   other batches for an executor thread, for a bounce slot): [`Batch::cancel`] settles it
//!   itself and cancels running work through the batch's
//!   [`CancelToken`](umbp_plan::CancelToken) (the SSD engine cancels its I/O in the kernel);
//!   a deadline watcher thread times it out the moment the deadline passes.
//!
//! # Example: a layer-wise restore
//!
//! ```
//! use std::sync::Arc;
//! use umbp_composite::{start_restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
//! use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
//! use umbp_plan::{BatchState, DeviceOrdinal, EndpointRegistry, Register};
//!
//! let registry = EndpointRegistry::new();
//! let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), HbmConfig::default()));
//! let composite = CompositeEngine::new(registry, vec![hbm.clone()]);
//!
//! // A DRAM arena of 4 pages of 4 KiB; one object stored in pages 3 and 1.
//! let arena = composite.register_memory((0..4 * 4096).map(|i| (i / 4096) as u8).collect::<Vec<u8>>())?;
//! let gpu = hbm.alloc_device(DeviceOrdinal::new(0), 8192)?;
//!
//! // The object's first page belongs to layer group 0, its second to group 1.
//! let pages = [3 * 4096, 4096];
//! let ranges = [
//!     ObjectRange::new(0, 4096, gpu.id(), 0),
//!     ObjectRange::new(4096, 4096, gpu.id(), 4096).in_group(1),
//! ];
//! let object = PagedObject::new(arena.id(), &pages, 4096, 8192);
//! let objects = [ObjectTransfer::new(42, object, &ranges)];
//!
//! let mut builder = composite.builder();
//! let batch = start_restore(&mut builder, &objects)?; // returns at once
//! batch.wait_group(0); // layer group 0 is in place; group 1 may still be moving
//! let report = batch.wait();
//! assert_eq!(report.aggregate, BatchState::Completed);
//! assert_eq!(report.objects[0].tag, 42);
//! let bytes = hbm.runtime().read(gpu.endpoint().addr(), 8192)?;
//! assert_eq!((bytes[0], bytes[4096]), (3, 1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod batch;
mod builder;
mod engine;
mod error;
mod executor;
mod integrity;
mod metrics;
mod object;
mod overlap;
mod restore;
mod route;
mod routed;
mod shared;
mod staging;

pub use batch::{
    Batch, EndpointNames, GroupReady, ObjectError, ObjectResult, Settled, TransferReport,
};
pub use builder::CompositeBuilder;
pub use engine::{CompositeConfig, CompositeEngine};
pub use error::Error;
pub use integrity::ChecksumPolicy;
pub use metrics::{direction, Counters, InFlightSnapshot, Metrics, MetricsSnapshot};
pub use object::{ObjectRange, ObjectTransfer, PagedObject};
pub use restore::{offload, restore, start_offload, start_restore};
pub use route::{route, Route};
pub use routed::{RoutedPart, RoutedPlans, StagedFragment};
pub use staging::Staging;
/// Re-exported from `umbp-plan`, where device engines implement it too.
pub use umbp_plan::{DeviceStream, GroupListener};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
