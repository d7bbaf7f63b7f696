//! Batches awaited as futures: many batches from one thread, no thread parked per wait.

mod support;

use std::sync::Arc;

use support::*;
use umbp_composite::CompositeEngine;
use umbp_plan::{BatchState, EndpointRegistry, Fragment, Register, Tag};

const BATCHES: usize = 1000;
const HALF: u64 = 4096;

/// 1,000 batches of two layer groups each, submitted at once and awaited side by side by
/// tasks of a current-thread runtime: each task awaits its batch's group 0, checks those
/// bytes, then awaits the batch; every byte of every destination is checked.
#[test]
fn a_thousand_batches_are_awaited_from_one_thread() {
    let registry = EndpointRegistry::new();
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry, vec![host]);
    let per = 2 * HALF as usize;
    let source = pattern(BATCHES * per, 3);
    let src = composite.register_memory(source.clone()).unwrap();
    let mut out = vec![POISON; BATCHES * per];
    let dst = rig_host(&composite, &mut out);
    let mut builder = composite.builder();
    let mut batches = Vec::with_capacity(BATCHES);
    for b in 0..BATCHES {
        let tag = Tag::new(0);
        let at = (b * per) as u64;
        builder.begin_object(tag).unwrap();
        builder.push(Fragment::new(src.id(), at, dst, at, HALF, tag)).unwrap();
        builder.set_group(1);
        builder.push(Fragment::new(src.id(), at + HALF, dst, at + HALF, HALF, tag)).unwrap();
        builder.commit_object().unwrap();
        batches.push(composite.submit(builder.finish().unwrap()).unwrap());
    }
    let out_addr = out.as_ptr() as usize;
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let reports = runtime.block_on(async move {
        let tasks: Vec<_> = batches
            .into_iter()
            .enumerate()
            .map(|(b, batch)| {
                tokio::spawn(async move {
                    batch.group_settled(0).await;
                    assert!(batch.is_group_done(0), "batch {b}: group 0 not settled");
                    // The future resolves on the runtime's one thread.
                    (batch.await, std::thread::current().id())
                })
            })
            .collect();
        let mut reports = Vec::with_capacity(BATCHES);
        for task in tasks {
            reports.push(task.await.unwrap());
        }
        reports
    });
    assert_eq!(out.as_ptr() as usize, out_addr);
    let me = std::thread::current().id();
    for (b, (report, thread)) in reports.iter().enumerate() {
        assert_eq!(report.aggregate, BatchState::Completed, "batch {b}: {report:?}");
        assert_eq!(*thread, me, "batch {b} was awaited on another thread");
    }
    assert_eq!(out, source, "a byte differs");
    assert_eq!(composite.in_flight().batches, 0);
}

/// The future of a batch that is already done is ready at its first poll, and a batch's
/// `settled()` future can be awaited after a group future of the same batch.
#[test]
fn futures_of_done_batches_are_ready_at_once() {
    let registry = EndpointRegistry::new();
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry, vec![host]);
    let src = composite.register_memory(vec![5u8; 64]).unwrap();
    let dst = composite.register_memory(vec![0u8; 64]).unwrap();
    let mut builder = composite.builder();
    builder.begin_object(Tag::new(0)).unwrap();
    builder.push(Fragment::new(src.id(), 0, dst.id(), 0, 64, Tag::new(0))).unwrap();
    builder.commit_object().unwrap();
    let batch = composite.submit(builder.finish().unwrap()).unwrap();
    let blocking = batch.wait();
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let awaited = runtime.block_on(async {
        batch.group_enqueued(0).await;
        batch.group_settled(7).await;
        batch.settled().await
    });
    assert_eq!(awaited, blocking);
    drop(batch);
    assert_eq!(dst.deregister(), vec![5u8; 64]);
}

/// Registers `bytes` through `composite` for the rest of the test.
fn rig_host(composite: &CompositeEngine, bytes: &mut [u8]) -> umbp_plan::EndpointId {
    let endpoint = umbp_plan::Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
    // SAFETY: `bytes` outlives every batch of the test (all are awaited before it is read).
    unsafe { register(composite, endpoint) }.unwrap()
}

/// A callback registered on a batch runs once when it is done, on the thread that settles it,
/// or at once when it is done already; a thousand of them need no thread of their own.
#[test]
fn on_settled_calls_back_once_per_batch() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    let registry = EndpointRegistry::new();
    let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
    let composite = CompositeEngine::new(registry, vec![host]);
    let per = HALF as usize;
    let source = pattern(BATCHES * per, 9);
    let src = composite.register_memory(source.clone()).unwrap();
    let mut out = vec![POISON; BATCHES * per];
    let dst = rig_host(&composite, &mut out);
    let mut builder = composite.builder();
    let calls = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let mut batches = Vec::with_capacity(BATCHES);
    for b in 0..BATCHES {
        let tag = Tag::new(0);
        let at = (b * per) as u64;
        builder.begin_object(tag).unwrap();
        builder.push(Fragment::new(src.id(), at, dst, at, HALF, tag)).unwrap();
        builder.commit_object().unwrap();
        let batch = composite.submit(builder.finish().unwrap()).unwrap();
        let (calls, tx) = (Arc::clone(&calls), tx.clone());
        batch.on_settled(move || {
            calls.fetch_add(1, Ordering::Relaxed);
            tx.send(b).unwrap();
        });
        batches.push(batch);
    }
    let mut seen = vec![false; BATCHES];
    for _ in 0..BATCHES {
        let b = rx.recv().unwrap();
        assert!(!std::mem::replace(&mut seen[b], true), "batch {b} called back twice");
        assert!(batches[b].is_done(), "batch {b} called back before it was done");
    }
    // Done already: at once, here.
    let here = std::thread::current().id();
    let (tx, rx) = mpsc::channel();
    batches[0].on_settled(move || tx.send(std::thread::current().id()).unwrap());
    assert_eq!(rx.try_recv(), Ok(here));
    drop(batches);
    assert_eq!(calls.load(Ordering::Relaxed), BATCHES);
    assert_eq!(out, source, "a byte differs");
}
