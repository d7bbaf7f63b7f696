#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

/// The vocabulary and traits: endpoints, registration, fragments, plans, builders, page walks
/// (the `umbp-plan` crate).
pub use umbp_plan as plan;

/// Routes each fragment of a mixed batch to the engine that claims it; restore and offload,
/// batches, metrics (the `umbp-composite` crate).
pub use umbp_composite as composite;

/// The device engine: simulated device by default, CUDA and HIP behind the `cuda` and `hip`
/// features (the `umbp-hbm` crate).
pub use umbp_hbm as hbm;

/// The io_uring engine between files and host memory (the `umbp-ssd` crate).
pub use umbp_ssd as ssd;

/// The host <-> host copy engine (the `umbp-localcopy` crate).
pub use umbp_localcopy as localcopy;

/// The remote memory engine and the serving side (the `umbp-remote` crate; feature `remote`).
#[cfg(feature = "remote")]
pub use umbp_remote as remote;

/// The pool: a shared index of KV blocks above the composite (the `umbp-pool` crate; feature
/// `pool`).
#[cfg(feature = "pool")]
pub use umbp_pool as pool;

/// Memory nodes in the pool: the resolver a pool reaches their tiers through, and the node's
/// own side (the `umbp-memory-node` crate; feature `memory-node`).
#[cfg(feature = "memory-node")]
pub use umbp_memory_node as memory_node;

/// What a server's restore and offload code names: `use umbp::prelude::*;`.
///
/// The engines and their settings, the composite and its restore and offload calls, and the
/// registration and result types. Each crate's own `Error` stays in its module
/// ([`composite::Error`], [`plan::Error`], ...): they would clash here.
pub mod prelude {
    pub use umbp_composite::{
        offload, restore, start_offload, start_restore, Batch, ChecksumPolicy, CompositeConfig,
        CompositeEngine, ObjectError, ObjectRange, ObjectResult, ObjectTransfer, PagedObject,
        Staging, TransferReport,
    };
    pub use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
    pub use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
    pub use umbp_plan::{
        AlignedBuffer, BatchState, CancelToken, DeviceOrdinal, Endpoint, EndpointId,
        EndpointRegistry, FailureCause, FileOptions, FileSource, ObjectState, Register,
        Registration, RejectReason, TransferEngine,
    };
    pub use umbp_ssd::{SsdConfig, SsdEngine};

    #[cfg(feature = "cuda")]
    pub use umbp_hbm::CudaRuntime;
    #[cfg(feature = "hip")]
    pub use umbp_hbm::HipRuntime;
}
