//! The crate's error type.

use crate::{EndpointId, Tag};

/// Why a fragment cannot be planned. Every reason is a caller mistake or a limit of the engine;
/// none comes from the environment.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RejectReason {
    /// The fragment names an endpoint that is not registered.
    #[error("endpoint {} is not registered", .0.raw())]
    UnknownEndpoint(EndpointId),
    /// The engine does not carry this (source, destination) pair.
    #[error("the engine does not carry endpoint {} -> endpoint {}", .src.raw(), .dst.raw())]
    PairNotHandled {
        /// Source endpoint.
        src: EndpointId,
        /// Destination endpoint.
        dst: EndpointId,
    },
    /// `offset + len` passes the end of the endpoint.
    #[error("bytes {offset}..+{len} lie outside endpoint {} of {endpoint_len} bytes", .endpoint.raw())]
    OutOfBounds {
        /// The endpoint.
        endpoint: EndpointId,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// Length of the endpoint.
        endpoint_len: u64,
    },
    /// `offset + len` does not fit in 64 bits.
    #[error("offset {offset} + length {len} overflows on endpoint {}", .endpoint.raw())]
    Overflow {
        /// The endpoint.
        endpoint: EndpointId,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
    },
    /// The fragment is longer than the largest segment the engine issues. umbp-plan's builders
    /// and planner never give this reason (they split such a fragment at the maximum; see
    /// [`PlanRules::max_segment_len`](crate::PlanRules::max_segment_len)); an engine's own
    /// check may.
    #[error("fragment of {len} bytes exceeds the engine's maximum segment of {max} bytes")]
    SegmentTooLong {
        /// Fragment length.
        len: u64,
        /// The engine's maximum segment length.
        max: u64,
    },
    /// The engine's plan builder panicked while planning the object (or an object planned with
    /// it in the same batch); what it held for the batch is lost, so the object was taken out
    /// everywhere.
    #[error("the engine's plan builder panicked")]
    BuilderPanicked,
    /// The destination accepts no writes (a remote region its peer exported read-only).
    #[error("endpoint {} is read-only", .0.raw())]
    ReadOnly(EndpointId),
    /// The engine needs `offset` and `len` aligned to `align` on this endpoint.
    #[error("bytes {offset}..+{len} of endpoint {} are not aligned to {align}", .endpoint.raw())]
    Misaligned {
        /// The endpoint.
        endpoint: EndpointId,
        /// First byte asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// Required alignment.
        align: u64,
    },
}

impl RejectReason {
    /// A short, stable name of the reason's kind (`"unknown_endpoint"`, `"pair_not_handled"`,
    /// `"out_of_bounds"`, `"overflow"`, `"segment_too_long"`, `"builder_panicked"`,
    /// `"read_only"`, `"misaligned"`): what metrics label rejections with and what bindings name
    /// them by.
    pub const fn kind_name(&self) -> &'static str {
        match self {
            Self::UnknownEndpoint(_) => "unknown_endpoint",
            Self::PairNotHandled { .. } => "pair_not_handled",
            Self::OutOfBounds { .. } => "out_of_bounds",
            Self::Overflow { .. } => "overflow",
            Self::SegmentTooLong { .. } => "segment_too_long",
            Self::BuilderPanicked => "builder_panicked",
            Self::ReadOnly(_) => "read_only",
            Self::Misaligned { .. } => "misaligned",
        }
    }
}

/// Why a page walk or a range list was refused. Nothing is emitted when a walk is refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WalkError {
    /// A range of zero bytes.
    #[error("zero-length range")]
    ZeroLength,
    /// The page size is zero.
    #[error("page size is zero")]
    ZeroPageSize,
    /// The object has no pages.
    #[error("the object has no pages")]
    EmptyPageList,
    /// The page list does not hold the stored size.
    #[error("{pages} pages stored for an object that needs {expected}")]
    PageCountMismatch {
        /// Pages in the list.
        pages: usize,
        /// Pages the stored size needs.
        expected: u64,
    },
    /// The range starts at or past the end of the object.
    #[error("offset {offset} is past the end of a {size}-byte object")]
    OffsetPastEnd {
        /// Range offset.
        offset: u64,
        /// Stored object size.
        size: u64,
    },
    /// The range ends past the end of the object.
    #[error("range {offset}..+{len} passes the end of a {size}-byte object")]
    RangePastEnd {
        /// Range offset.
        offset: u64,
        /// Range length.
        len: u64,
        /// Stored object size.
        size: u64,
    },
    /// An offset computation does not fit in 64 bits.
    #[error("offset arithmetic overflows")]
    Overflow,
    /// Range `index` starts before the end of range `index - 1`.
    #[error("range {index} is out of order or overlaps the one before it")]
    RangesOverlap {
        /// Position of the offending range.
        index: usize,
    },
}

/// The error type of umbp-plan.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A fragment of object `tag` was refused; the object is poisoned and its tag rejected.
    #[error("object {}: {reason}", .tag.get())]
    Rejected {
        /// The object.
        tag: Tag,
        /// Why.
        reason: RejectReason,
    },
    /// A push into an object that an earlier fragment already poisoned; nothing was planned.
    #[error("object {} was already rejected", .tag.get())]
    ObjectRejected {
        /// The object.
        tag: Tag,
    },
    /// `push`, `commit_object` or `rollback_object` without `begin_object`.
    #[error("no object is open")]
    NoOpenObject,
    /// `begin_object` or `finish` while an object is open.
    #[error("object {} is still open", .open.get())]
    ObjectOpen {
        /// The open object.
        open: Tag,
    },
    /// A fragment's tag differs from the open object's.
    #[error("fragment of object {} pushed into object {}", .fragment.get(), .object.get())]
    TagMismatch {
        /// The open object.
        object: Tag,
        /// The fragment's tag.
        fragment: Tag,
    },
    /// A page walk or range list was refused.
    #[error(transparent)]
    Walk(#[from] WalkError),
    /// An endpoint id that the registry does not hold.
    #[error("endpoint {} is not registered", .id.raw())]
    UnknownEndpoint {
        /// The id.
        id: EndpointId,
    },
    /// An object with this tag is already part of the batch; tags name objects, once each.
    #[error("object {} is already part of this batch", .tag.get())]
    DuplicateTag {
        /// The tag.
        tag: Tag,
    },
    /// A tag outside the batch's objects.
    #[error("tag {} is outside a batch of {objects} objects", .tag.get())]
    UnknownTag {
        /// The tag.
        tag: Tag,
        /// Objects in the batch.
        objects: usize,
    },
}
