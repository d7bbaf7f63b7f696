//! The crate's error type.

use umbp_plan::EndpointId;

/// The error type of umbp-composite.
///
/// `Display` gives this error's own words; a cause (the system's error, an engine's) is its
/// [`source`](std::error::Error::source), to print after it (anyhow's `{:#}` does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A planning error (scope misuse, a refused walk or range list).
    #[error(transparent)]
    Plan(#[from] umbp_plan::Error),
    /// The staged route's bounce region is not host memory known to the registry (or the
    /// stage size is zero, or a staged route is already configured).
    #[error("bounce region {} must be a registered host endpoint", .0.raw())]
    BadBounce(EndpointId),
    /// The plans were made by another composite's builder; engine positions would not match.
    #[error("these plans were built for another composite")]
    ForeignPlans,
    /// Two objects of one restore or offload carry the same caller tag.
    #[error("tag {0} names two objects of the batch")]
    DuplicateTag(u64),
    /// A restore or offload was given a builder that holds an unfinished batch.
    #[error("the builder holds an unfinished batch; finish or roll it back first")]
    BuilderInUse,
    /// A restore or offload of more objects than 32-bit tags can number.
    #[error("{0} objects do not fit one batch")]
    TooManyObjects(usize),
    /// The executor's threads could not be started.
    #[error("could not start the composite's executor")]
    Executor(#[source] std::io::Error),
}
