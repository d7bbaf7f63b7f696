//! Where a tier's slots are in memory or on disk, for the composite: the pool decides *where*
//! a block goes, the composite moves its bytes.

use umbp_composite::PagedObject;
use umbp_plan::EndpointId;

use crate::TierSpec;

/// A tier's slots laid out in one registered endpoint (a DRAM arena, an SSD file, a memory
/// node's exported region): slot `s` is bytes `base + s * slot_size ..` of `endpoint`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TierRegion {
    /// The endpoint holding the tier, registered with the composite.
    pub endpoint: EndpointId,
    /// Offset of slot 0 inside the endpoint.
    pub base: u64,
    /// Bytes per slot, as in the tier's [`TierSpec`].
    pub slot_size: u64,
}

impl TierRegion {
    /// The region of `spec`'s tier at `base` inside `endpoint`.
    pub fn new(endpoint: EndpointId, base: u64, spec: &TierSpec) -> Self {
        Self { endpoint, base, slot_size: spec.slot_size }
    }

    /// The offset of `slot` inside the endpoint (saturating: an out-of-range slot gives an
    /// offset the composite rejects, never a wrap-around into another slot).
    pub fn slot_offset(&self, slot: u32) -> u64 {
        u64::from(slot).saturating_mul(self.slot_size).saturating_add(self.base)
    }

    /// The block of `len` bytes in `slot` as one page for the composite's restore or offload
    /// (a [`Reservation`](crate::Reservation)'s slot to write, a [`Placement`](crate::Placement)'s
    /// to read). `page` holds the page offset the returned object borrows.
    pub fn object<'a>(&self, slot: u32, len: u64, page: &'a mut [u64; 1]) -> PagedObject<'a> {
        page[0] = self.slot_offset(slot);
        PagedObject::new(self.endpoint, &page[..], self.slot_size, len)
    }
}
