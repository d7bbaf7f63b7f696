//! The builder owns a handle of its composite: it lives in a struct, a thread-local or another
//! thread, and outlives the handle it came from.

use std::cell::RefCell;
use std::sync::Arc;

use umbp_composite::{
    restore, CompositeBuilder, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject,
};
use umbp_plan::{BatchState, EndpointId, EndpointRegistry, Register, Registration};

const PAGE: u64 = 4096;

/// A server's worker: its composite and the builder it reuses, side by side.
struct Worker {
    builder: CompositeBuilder,
    tier: Registration<Vec<u8>>,
    out: Registration<Vec<u8>>,
}

impl Worker {
    /// Restores the tier's pages `pages` (one object) into `out` at `at`.
    fn restore(&mut self, tag: u64, pages: &[u64], at: u64) -> BatchState {
        restore_into(&mut self.builder, self.tier.id(), self.out.id(), tag, pages, at)
    }
}

fn restore_into(
    builder: &mut CompositeBuilder,
    tier: EndpointId,
    out: EndpointId,
    tag: u64,
    pages: &[u64],
    at: u64,
) -> BatchState {
    let size = pages.len() as u64 * PAGE;
    let ranges = [ObjectRange::new(0, size, out, at)];
    let object = PagedObject::new(tier, pages, PAGE, size);
    let objects = [ObjectTransfer::new(tag, object, &ranges)];
    restore(builder, &objects).unwrap().aggregate
}

fn composite() -> CompositeEngine {
    let registry = EndpointRegistry::new();
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    CompositeEngine::new(registry, vec![host])
}

fn tier_bytes() -> Vec<u8> {
    (0..4 * PAGE as usize).map(|i| (i / PAGE as usize * 10 + i % 7) as u8).collect()
}

#[test]
fn a_builder_lives_beside_its_composite_and_outlives_the_handle_it_came_from() {
    let composite = composite();
    let tier = composite.register_memory(tier_bytes()).unwrap();
    let out = composite.register_memory(vec![0u8; 4 * PAGE as usize]).unwrap();
    let mut worker = Worker { builder: composite.builder(), tier, out };
    // The handle goes; the builder's own keeps the composite (and its executor) alive.
    drop(composite);
    assert_eq!(worker.restore(1, &[3 * PAGE, 2 * PAGE], 0), BatchState::Completed);
    assert_eq!(worker.restore(2, &[PAGE, 0], 2 * PAGE), BatchState::Completed);
    let Worker { builder, tier, out } = worker;
    drop(builder);
    let bytes = out.deregister();
    let tier = tier.deregister();
    for (k, page) in [3usize, 2, 1, 0].into_iter().enumerate() {
        let p = PAGE as usize;
        assert_eq!(bytes[k * p..(k + 1) * p], tier[page * p..(page + 1) * p], "page {k}");
    }
}

thread_local! {
    static BUILDER: RefCell<Option<CompositeBuilder>> = const { RefCell::new(None) };
}

#[test]
fn one_builder_per_thread_in_a_thread_local_is_reused_across_batches() {
    let composite = composite();
    let tier = composite.register_memory(tier_bytes()).unwrap();
    let out = composite.register_memory(vec![0u8; 16 * 4 * PAGE as usize]).unwrap();
    let (tier_id, out_id) = (tier.id(), out.id());
    std::thread::scope(|s| {
        for t in 0..16u64 {
            let composite = composite.clone();
            s.spawn(move || {
                for round in 0..4u64 {
                    let state = BUILDER.with_borrow_mut(|b| {
                        let builder = b.get_or_insert_with(|| composite.builder());
                        let at = (t * 4 + round) * PAGE;
                        restore_into(builder, tier_id, out_id, round, &[round * PAGE], at)
                    });
                    assert_eq!(state, BatchState::Completed, "thread {t} round {round}");
                }
            });
        }
    });
    let bytes = out.deregister();
    let tier = tier.deregister();
    let p = PAGE as usize;
    for (slot, got) in bytes.chunks(p).enumerate() {
        let round = slot % 4;
        assert_eq!(got, &tier[round * p..(round + 1) * p], "slot {slot}");
    }
}

#[test]
fn a_builder_moves_to_another_thread() {
    fn send<T: Send + 'static>(_: &T) {}
    let composite = composite();
    let builder = composite.builder();
    send(&builder);
    let tier = composite.register_memory(tier_bytes()).unwrap();
    let out = composite.register_memory(vec![0u8; PAGE as usize]).unwrap();
    let (tier_id, out_id) = (tier.id(), out.id());
    let state = std::thread::spawn(move || {
        let mut builder = builder;
        restore_into(&mut builder, tier_id, out_id, 9, &[2 * PAGE], 0)
    })
    .join()
    .unwrap();
    assert_eq!(state, BatchState::Completed);
    assert_eq!(out.deregister(), tier.deregister()[2 * PAGE as usize..3 * PAGE as usize]);
}
