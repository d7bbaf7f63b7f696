//! State stays bounded under churn: 100,000 registrations through a composite, each ended
//! before the next, with three endpoints registered throughout and one builder kept across
//! them, leave the registry with one slot per endpoint registered at once, not one per
//! registration ever made; a stale id never names the endpoint that reuses its slot.

use std::sync::Arc;

use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{BatchState, EndpointRegistry, Register};

const CYCLES: usize = 100_000;
const PAGE: u64 = 4096;

#[test]
fn a_hundred_thousand_registrations_leave_as_many_slots_as_endpoints_registered_at_once() {
    let registry = EndpointRegistry::new();
    let localcopy = Arc::new(LocalCopyEngine::new(Arc::clone(&registry)));
    let hbm =
        HbmEngine::new(Arc::new(SimDevice::new(1)), Arc::clone(&registry), HbmConfig::default());
    let composite = CompositeEngine::new(Arc::clone(&registry), vec![localcopy, Arc::new(hbm)]);

    // Three endpoints live throughout: a tier of two pages and two other buffers.
    let tier =
        composite.register_memory((0..2 * PAGE).map(|i| (i / PAGE + 1) as u8).collect::<Vec<u8>>());
    let tier = tier.unwrap();
    let live = [vec![0u8; 64], vec![0u8; 64]].map(|b| composite.register_memory(b).unwrap());
    let mut builder = composite.builder();

    let mut buffer = vec![0u8; PAGE as usize];
    let mut first = None;
    let mut most_slots = 0;
    for cycle in 0..CYCLES {
        let registration = composite.register_memory(buffer).unwrap();
        let id = registration.id();
        first.get_or_insert(id);
        if cycle % 10_000 == 0 {
            // The kept builder plans against the registry as it is now: page 1 of the tier
            // into this cycle's buffer.
            let pages = [PAGE];
            let ranges = [ObjectRange::new(0, PAGE, id, 0)];
            let object = PagedObject::new(tier.id(), &pages, PAGE, PAGE);
            let report = restore(&mut builder, &[ObjectTransfer::new(0, object, &ranges)]).unwrap();
            assert_eq!(report.aggregate, BatchState::Completed, "cycle {cycle}");
        }
        most_slots = most_slots.max(registry.snapshot().slot_count());
        buffer = registration.deregister();
        if cycle % 10_000 == 0 {
            assert!(buffer.iter().all(|&b| b == 2), "cycle {cycle}: the restore's bytes");
            buffer.fill(0);
        }
    }

    // The three live endpoints and the one the churn reuses.
    assert_eq!(most_slots, 4, "slots grew with the registrations made");
    let table = registry.snapshot();
    assert_eq!(table.slot_count(), 4);
    assert_eq!(table.iter().count(), 3, "only the live endpoints remain");
    let stale = first.unwrap();
    let reused = composite.register_memory(buffer).unwrap();
    assert_eq!(reused.id().index(), stale.index(), "the freed slot is reused");
    assert_ne!(reused.id(), stale);
    assert!(registry.get(stale).is_none(), "a stale id never names the endpoint in its slot");
    drop((reused, live, tier));
}
