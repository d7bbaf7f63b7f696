//! The objects of a restore or offload: where each is stored, and which of its ranges move to
//! or from which of the caller's endpoints.

use umbp_plan::EndpointId;

/// Where an object lives: its pages in a tier (a DRAM arena or an SSD file). Made with
/// [`new`](Self::new): fields may be added, so it is not built as a struct literal outside
/// this crate.
#[derive(Copy, Clone, Debug)]
#[non_exhaustive]
pub struct PagedObject<'a> {
    /// The tier endpoint holding the pages.
    pub tier: EndpointId,
    /// Byte offsets of the object's pages inside the tier, in object order.
    pub page_offsets: &'a [u64],
    /// Page size.
    pub page_size: u64,
    /// Stored object size (the last page may be short).
    pub size: u64,
}

impl<'a> PagedObject<'a> {
    /// An object of `size` bytes stored in `tier`, in pages of `page_size` bytes at
    /// `page_offsets` (in object order). Checked when a batch walks it, not here.
    pub const fn new(tier: EndpointId, page_offsets: &'a [u64], page_size: u64, size: u64) -> Self {
        Self { tier, page_offsets, page_size, size }
    }
}

/// One range of an object and the caller's memory on the other side of the transfer. Made
/// with [`new`](Self::new) and [`in_group`](Self::in_group): fields may be added, so it is not
/// built as a struct literal outside this crate.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectRange {
    /// Offset inside the object.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The caller's endpoint: the destination of a restore, the source of an offload.
    pub endpoint: EndpointId,
    /// Offset inside the caller's endpoint.
    pub endpoint_offset: u64,
    /// The layer group the range belongs to (see
    /// [`CompositeBuilder::set_group`](crate::CompositeBuilder::set_group)). Default: 0.
    pub group: u32,
}

impl ObjectRange {
    /// Bytes `offset .. offset + len` of the object, to or from `endpoint` at
    /// `endpoint_offset`, in layer group 0.
    pub const fn new(offset: u64, len: u64, endpoint: EndpointId, endpoint_offset: u64) -> Self {
        Self { offset, len, endpoint, endpoint_offset, group: 0 }
    }

    /// The same range in layer group `group`.
    pub const fn in_group(mut self, group: u32) -> Self {
        self.group = group;
        self
    }
}

/// One object of a restore or offload batch. Made with [`new`](Self::new) and
/// [`with_checksum`](Self::with_checksum): fields may be added (as `checksum` was), so it is
/// not built as a struct literal outside this crate.
#[derive(Copy, Clone, Debug)]
#[non_exhaustive]
pub struct ObjectTransfer<'a> {
    /// The caller's own tag for the object, given back in its result; once per batch.
    pub tag: u64,
    /// Where the object's pages are.
    pub object: PagedObject<'a>,
    /// The ranges to move, sorted by offset and disjoint. An offload writes exactly these
    /// bytes of the stored object: the rest of its pages keep what they held.
    pub ranges: &'a [ObjectRange],
    /// For a restore: the CRC32C the object's bytes must have (the CRC32C of its ranges'
    /// bytes, concatenated in range order: what the offload that saved them reported in
    /// [`ObjectResult::checksum`](crate::ObjectResult::checksum)). Where the composite's
    /// [`ChecksumPolicy`](crate::ChecksumPolicy) covers the object's tier, bytes that do not
    /// match fail the object with
    /// [`FailureCause::ChecksumMismatch`](umbp_plan::FailureCause::ChecksumMismatch);
    /// elsewhere it is not checked. Offloads ignore it. Default (in [`new`](Self::new)):
    /// `None`, nothing to verify.
    pub checksum: Option<u32>,
}

impl<'a> ObjectTransfer<'a> {
    /// Object `tag`, stored as `object`, moving `ranges`, with no checksum to verify.
    pub const fn new(tag: u64, object: PagedObject<'a>, ranges: &'a [ObjectRange]) -> Self {
        Self { tag, object, ranges, checksum: None }
    }

    /// The same object, whose restore must find the bytes to have CRC32C `checksum`.
    pub const fn with_checksum(mut self, checksum: u32) -> Self {
        self.checksum = Some(checksum);
        self
    }
}
