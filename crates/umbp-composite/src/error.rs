//! The crate's error type.

use umbp_plan::{EndpointId, EngineError};

/// The error type of umbp-composite.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A planning error (scope misuse, a refused walk or range list).
    #[error(transparent)]
    Plan(#[from] umbp_plan::Error),
    /// An engine refused to take part in a registration; the registration was undone.
    #[error("engine {engine} refused endpoint {}: {source}", .id.raw())]
    Engine {
        /// The engine's name.
        engine: String,
        /// The endpoint.
        id: EndpointId,
        /// The engine's own error.
        source: EngineError,
    },
    /// The endpoint is not registered.
    #[error("endpoint {} is not registered", .0.raw())]
    UnknownEndpoint(EndpointId),
    /// The staged route's bounce region is not host memory known to the registry.
    #[error("bounce region {} must be a registered host endpoint", .0.raw())]
    BadBounce(EndpointId),
}
