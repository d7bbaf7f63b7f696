//! Eight threads submit to one engine at once, for a bounded number of rounds: large batches
//! (on the pool), small ones (inline) and batch-API calls with a rejected object, interleaved.
//! After every round each thread checks every byte of its destination.

mod support;

use std::sync::{Arc, Barrier};
use std::thread;

use support::{pattern, HostBuf, Rng, POISON};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{
    BatchState, EndpointId, EndpointRegistry, Fragment, ObjectState, PlanBuilder, Tag,
    TransferEngine,
};

const THREADS: usize = 8;
const ROUNDS: usize = 12;
const PAGE: usize = 4096;
/// Arena pages per thread, and destination pages per thread (1.5 MiB: above the default
/// parallel threshold).
const ARENA_PAGES: usize = 512;
const OUT_PAGES: usize = 384;
/// Pages per object.
const OBJECT_PAGES: usize = 16;

#[test]
fn eight_threads_submit_concurrently_and_every_byte_is_right() {
    let config = LocalCopyConfig { threads: 2, ..LocalCopyConfig::default() };
    let engine = Arc::new(LocalCopyEngine::with_config(EndpointRegistry::new(), config));
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (engine, start) = (Arc::clone(&engine), Arc::clone(&start));
            thread::spawn(move || {
                let arena = HostBuf::new(ARENA_PAGES * PAGE, |i| pattern(t as u64, i));
                let out = HostBuf::poisoned(OUT_PAGES * PAGE);
                let (a, o) = (arena.register(&engine), out.register(&engine));
                let source = arena.bytes();
                start.wait();
                for round in 0..ROUNDS {
                    let mut rng = Rng((t * ROUNDS + round) as u64);
                    out.fill(POISON);
                    // Rounds cycle through a large builder batch, a small one and a batch-API
                    // call whose last object asks for a page past the arena.
                    let objects = if round % 3 == 1 { 2 } else { OUT_PAGES / OBJECT_PAGES };
                    let pages = rng.permutation(ARENA_PAGES);
                    let fragments = fragments(a, o, &pages, objects);
                    let rejected = if round % 3 == 2 {
                        run_batch_api(&engine, a, o, fragments, objects)
                    } else {
                        run_builder(&engine, &fragments, objects);
                        None
                    };
                    check(&out.bytes(), &source, &pages, objects, rejected, (t, round));
                }
            })
        })
        .collect();
    for handle in threads {
        handle.join().expect("a submitting thread panicked");
    }
}

/// Object `k` copies arena pages `pages[k * OBJECT_PAGES ..]` to out pages `k * OBJECT_PAGES ..`.
fn fragments(a: EndpointId, o: EndpointId, pages: &[usize], objects: usize) -> Vec<Fragment> {
    (0..objects * OBJECT_PAGES)
        .map(|slot| {
            let tag = Tag::new((slot / OBJECT_PAGES) as u32);
            let (src, dst) = ((pages[slot] * PAGE) as u64, (slot * PAGE) as u64);
            Fragment::new(a, src, o, dst, PAGE as u64, tag)
        })
        .collect()
}

fn run_builder(engine: &LocalCopyEngine, fragments: &[Fragment], objects: usize) {
    let mut builder = engine.incremental_builder();
    for object in fragments.chunks(OBJECT_PAGES) {
        builder.begin_object(object[0].tag).unwrap();
        for &f in object {
            builder.push(f).unwrap();
        }
        builder.commit_object().unwrap();
    }
    let plans = builder.finish().unwrap();
    assert_eq!(plans.plans()[0].tags().len(), objects);
    assert!(engine.submit(plans).wait().is_empty());
}

/// Submits through the batch API in reverse order, with the last object's last page moved past
/// the end of the arena. Returns that object.
fn run_batch_api(
    engine: &LocalCopyEngine,
    a: EndpointId,
    o: EndpointId,
    mut fragments: Vec<Fragment>,
    objects: usize,
) -> Option<usize> {
    let last = fragments.last_mut().expect("objects have pages");
    *last =
        Fragment::new(a, (ARENA_PAGES * PAGE) as u64, o, last.dst_offset, PAGE as u64, last.tag);
    fragments.reverse();
    let report = engine.transfer_batch(objects, &fragments).unwrap();
    let bad = Tag::new(objects as u32 - 1);
    assert_eq!(report.aggregate(), BatchState::Failed);
    assert_eq!(report.status.completed_count(), objects - 1);
    assert_eq!(report.status.object(bad), Some(ObjectState::Rejected));
    assert!(report.failures.is_empty());
    Some(objects - 1)
}

fn check(
    got: &[u8],
    source: &[u8],
    pages: &[usize],
    objects: usize,
    rejected: Option<usize>,
    (thread, round): (usize, usize),
) {
    for slot in 0..OUT_PAGES {
        let out = &got[slot * PAGE..(slot + 1) * PAGE];
        let object = slot / OBJECT_PAGES;
        if object < objects && rejected != Some(object) {
            let page = pages[slot];
            assert!(
                out == &source[page * PAGE..(page + 1) * PAGE],
                "thread {thread}, round {round}: page {slot} differs"
            );
        } else {
            assert!(
                out.iter().all(|&b| b == POISON),
                "thread {thread}, round {round}: page {slot} was written"
            );
        }
    }
}
