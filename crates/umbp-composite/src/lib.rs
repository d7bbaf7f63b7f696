//! The composite engine of the umbp transfer engines: one builder, one submit, one result per
//! object for batches that span host memory, device memory and SSD files.
//!
//! - [`CompositeEngine`] holds engines (any [`TransferEngine`](umbp_plan::TransferEngine), from
//!   any crate) in preference order. Registration through it reaches every engine once
//!   ([`endpoint_registered`](umbp_plan::TransferEngine::endpoint_registered)).
//! - [`CompositeBuilder`] routes each fragment to the first engine that claims its pair
//!   ([`route`]) and pushes it into that engine's own builder, created on first use: engines
//!   with an incremental builder plan incrementally, others get the buffered default. One
//!   object scope spans every engine: a rejection or a rollback undoes the object everywhere.
//! - A pair no engine claims but two engines can carry through a registered host bounce region
//!   ([`Staging`]) takes the staged route: two hops, pipelined in bounded stages.
//! - [`CompositeEngine::submit`] runs every engine's part on its own thread so their work
//!   overlaps, and gathers every failure.
//! - [`restore`] and [`offload`] take paged objects and the caller's ranges and return one
//!   result per object.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
//! use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
//! use umbp_plan::{BatchState, DeviceOrdinal, Endpoint, EndpointRegistry, Tag};
//!
//! let registry = EndpointRegistry::new();
//! let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), HbmConfig::default()));
//! let composite = CompositeEngine::new(registry, vec![hbm.clone()]);
//!
//! // A DRAM arena of 4 pages of 4 KiB; one object stored in pages 3 and 1.
//! let mut arena: Vec<u8> = (0..4 * 4096).map(|i| (i / 4096) as u8).collect();
//! // SAFETY: `arena` outlives every transfer below.
//! let tier = unsafe { composite.register(Endpoint::host(arena.as_mut_ptr() as u64, arena.len() as u64))? };
//! let gpu = hbm.alloc_device(DeviceOrdinal::new(0), 8192)?;
//!
//! let pages = [3 * 4096, 4096];
//! let ranges = [ObjectRange { offset: 0, len: 8192, endpoint: gpu.id, endpoint_offset: 0 }];
//! let object = PagedObject { tier, pages: &pages, page_size: 4096, size: 8192 };
//! let batch = [ObjectTransfer { tag: Tag::new(42), object, ranges: &ranges }];
//!
//! let report = restore(&composite, &mut composite.builder(), &batch);
//! assert_eq!(report.aggregate, BatchState::Completed);
//! let bytes = hbm.runtime().read(gpu.addr, 8192)?;
//! assert_eq!((bytes[0], bytes[4096]), (3, 1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod builder;
mod engine;
mod error;
mod metrics;
mod restore;
mod route;

pub use builder::{CompositeBuilder, RoutedPart, RoutedPlans, StagedFragment};
pub use engine::{CompositeEngine, Outcome, Staging};
pub use error::Error;
pub use metrics::{direction, Counters, Metrics, MetricsSnapshot};
pub use restore::{
    offload, restore, ObjectRange, ObjectResult, ObjectTransfer, PagedObject, TransferReport,
};
pub use route::{route, Route};

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
