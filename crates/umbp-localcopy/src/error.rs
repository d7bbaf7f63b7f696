//! The crate's error type.

use umbp_plan::{EndpointId, Tag};

/// What the local copy engine refuses, or cannot set up.
///
/// Fragments that the engine cannot carry are refused earlier, by its plan builder, with
/// [`umbp_plan::Error::Rejected`]. The variants here cover what is left: plans that fail the
/// engine's own checks at submit (reported as [`FailureCause::NotAccepted`] with this error's
/// text), misuse of the batch API, and configuration.
///
/// [`FailureCause::NotAccepted`]: umbp_plan::FailureCause::NotAccepted
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A submitted plan names an endpoint that is not host memory of this process (a device or
    /// file endpoint, or a host range that does not fit the address space). Happens when a
    /// plan set built for another engine is submitted here.
    #[error("endpoint {} is not host memory this engine can address", .endpoint.raw())]
    NotHostMemory {
        /// The endpoint.
        endpoint: EndpointId,
    },
    /// A submitted segment lies outside one of its plan's endpoints as registered at submit.
    /// Happens when a plan set was built against another registry. Nothing of its plan is
    /// written.
    #[error(
        "segment {src_offset}..+{len} -> {dst_offset}..+{len} lies outside endpoint {} -> \
         endpoint {}",
        .src.raw(),
        .dst.raw()
    )]
    SegmentOutOfBounds {
        /// The plan's source endpoint.
        src: EndpointId,
        /// The plan's destination endpoint.
        dst: EndpointId,
        /// Segment offset in the source.
        src_offset: u64,
        /// Segment offset in the destination.
        dst_offset: u64,
        /// Segment length.
        len: u64,
    },
    /// A transfer of a batch carries a tag outside the batch's objects `0 .. objects`. Nothing
    /// of the batch was planned or copied.
    #[error("tag {} is outside a batch of {objects} objects", .tag.get())]
    UnknownTag {
        /// The tag.
        tag: Tag,
        /// Objects in the batch.
        objects: usize,
    },
    /// A batch of more objects than there are tags (2^32). Nothing was planned or copied.
    #[error("a batch of {objects} objects has more objects than tags")]
    TooManyObjects {
        /// Objects asked for.
        objects: usize,
    },
    /// Memory for a batch's bookkeeping, sized by a count the caller gave, could not be
    /// allocated (the report's state per object, the order of the transfers). Nothing was
    /// planned or copied.
    #[error("cannot allocate the {what} of a batch of {count}")]
    OutOfMemory {
        /// What was to be allocated.
        what: &'static str,
        /// The count it was sized by (objects, transfers).
        count: usize,
    },
    /// An environment variable is set to a value its configuration field cannot take.
    #[error("environment variable {var}={value:?} is not valid")]
    InvalidEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// An error from the plan builder other than a refused fragment. The batch API drives the
    /// builder in order, so this reports a bug rather than bad input.
    #[error(transparent)]
    Plan(#[from] umbp_plan::Error),
}
