//! The device (HBM) engine of the umbp transfer engines.
//!
//! A restore into GPU memory is hundreds of thousands of small fragments. Copying each with its
//! own runtime call pays the call's start-up cost per fragment; this engine instead writes a
//! list of [`GatherDescriptor`]s and copies many fragments with one launch of a gather kernel.
//!
//! - [`HbmEngine`] claims every pair with a device side and no file side ([`HbmRules`]). Its
//!   builder is the incremental builder of `umbp-plan`, whose segments already have the
//!   descriptor layout (source, destination, length relative to the endpoints).
//! - At submit, segments are bucketed per device, across plans and directions. A bucket of at
//!   least [`HbmConfig::kernel_min_fragments`] fragments whose mean size is under
//!   [`HbmConfig::kernel_max_mean_bytes`] (or the size the device chose when
//!   [calibrated](HbmEngine::calibrate)) goes through the kernel, in launches of at most
//!   [`HbmConfig::launch_max_bytes`]; other buckets use one copy per segment. Only host memory
//!   pinned for the device ([`HbmEngine::pin`]) can take part in a gather; the rest is copied.
//! - A failed launch falls back to copies for its bucket; a failed synchronization after a
//!   launch disables the kernel for the engine's lifetime (logged once) and copies the bucket
//!   again; a failed copy fails its segment's objects with the device, the runtime's code and
//!   message. The caller's current device is restored after every submit.
//! - [`DeviceRuntime`] is the backend trait: [`SimDevice`] (always built; device memory in
//!   host memory, the kernel run on the CPU from the same descriptors, every address checked,
//!   faults injectable), `CudaRuntime` (feature `cuda`: NVIDIA GPUs through the driver API,
//!   loaded at run time, the kernel compiled by NVRTC to PTX for the device's compute
//!   capability) and `HipRuntime` (feature `hip`: AMD GPUs, the kernel compiled by hiprtc for
//!   the device's own architecture). Both GPU backends compile the same kernel source,
//!   [`GATHER_KERNEL_SOURCE`], at its first launch on a device.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
//! use umbp_plan::{
//!     DeviceOrdinal, EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine,
//! };
//!
//! let gpu = DeviceOrdinal::new(0);
//! // Host memory registered through this engine is pinned for `gpu`, so gathers can read it.
//! let config = HbmConfig { pin_registered_host: Some(gpu), ..HbmConfig::default() };
//! let engine = HbmEngine::new(Arc::new(SimDevice::new(1)), EndpointRegistry::new(), config);
//! let device = engine.alloc_device(gpu, 1 << 20)?; // freed when `device` is dropped
//! let host = engine.register_memory(vec![7u8; 1 << 20])?;
//! let src = host.id();
//!
//! // Eight scattered 4 KiB pages into one device buffer: one gather launch.
//! let mut builder = engine.builder();
//! builder.begin_object(Tag::new(0))?;
//! for (i, page) in [5u64, 2, 7, 0, 3, 6, 1, 4].iter().enumerate() {
//!     builder.push(Fragment::new(src, page * 8192, device.id(), i as u64 * 4096, 4096, Tag::new(0)))?;
//! }
//! builder.commit_object()?;
//! let mut handle = engine.submit(builder.finish()?);
//! assert!(handle.wait().is_empty());
//! assert_eq!(engine.launches(), 1);
//! assert_eq!(engine.runtime().read(device.endpoint().addr(), 4)?, vec![7; 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Unsafe code
//!
//! Registering raw memory is `unsafe` (its validity is the caller's promise); buffers Rust owns
//! and [`HbmEngine::alloc_device`] register safely. Raw memory access
//! lives in `sim/memory.rs` and `sim/kernel.rs`; runtime calls in `hip/ffi.rs` and
//! `cuda/ffi.rs`, each declared with an integer status (a Rust enum would make a status a
//! newer runtime added undefined behaviour); and calibration's pinned buffer in
//! `calibrate.rs`.

#![warn(missing_docs)]

mod calibrate;
mod descriptor;
mod engine;
mod error;
mod events;
mod runtime;
pub mod sim;

#[cfg(hip_backend)]
pub mod hip;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use calibrate::{Calibration, CalibrationPoint, CALIBRATION_BYTES, CALIBRATION_SIZES};
pub use descriptor::{
    chunk_launches, GatherDescriptor, LaunchTable, BLOCK_THREADS, GATHER_KERNEL_NAME,
    GATHER_KERNEL_SOURCE, SLICE_BYTES,
};
pub use engine::{HbmConfig, HbmEngine, HbmRules};
pub use error::{DeviceError, Error};
pub use events::{DeviceEvent, LayerEvents};
pub use runtime::{DeviceRuntime, Queue};
pub use sim::{DeviceFault, SimDevice};

#[cfg(hip_backend)]
pub use hip::HipRuntime;

#[cfg(feature = "cuda")]
pub use cuda::CudaRuntime;

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
