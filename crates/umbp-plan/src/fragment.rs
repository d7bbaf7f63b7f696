//! The transfer item: one contiguous run of bytes from one endpoint to another.

use crate::{EndpointId, Tag};

/// Copy `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`, on behalf of the object
/// `tag`. Offsets are relative to the start of each endpoint. A fragment is plain data; pushing it
/// into a [`PlanBuilder`](crate::PlanBuilder) is where it is checked.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Fragment {
    /// Source endpoint.
    pub src: EndpointId,
    /// Offset of the first byte inside the source endpoint.
    pub src_offset: u64,
    /// Destination endpoint.
    pub dst: EndpointId,
    /// Offset of the first byte inside the destination endpoint.
    pub dst_offset: u64,
    /// Number of bytes. A zero-length fragment is skipped: neither planned nor rejected.
    pub len: u64,
    /// The object this fragment belongs to.
    pub tag: Tag,
}

impl Fragment {
    /// A fragment of object `tag` copying `len` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`.
    pub const fn new(
        src: EndpointId,
        src_offset: u64,
        dst: EndpointId,
        dst_offset: u64,
        len: u64,
        tag: Tag,
    ) -> Self {
        Self { src, src_offset, dst, dst_offset, len, tag }
    }
}
