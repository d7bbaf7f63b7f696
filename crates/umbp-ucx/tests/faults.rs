//! Peers that die, many threads at once, deadlines, deregistration while in flight.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_plan::{FailureCause, Fragment, PlanBuilder, Register, Tag, TransferEngine};

use support::{engine, fill_byte, ucx_or_skip, Served, POISON};

const MIB: usize = 1 << 20;

#[test]
fn a_peer_killed_mid_batch_fails_exactly_its_objects_in_bounded_time() {
    if !ucx_or_skip() {
        return;
    }
    let mut doomed = Served::start("tcp", 64 * MIB, 1, &[]);
    let healthy = Served::start("tcp", 64 * MIB, 2, &[]);
    let engine = engine("tcp");
    let (a, b) = (engine.connect(doomed.addr).unwrap(), engine.connect(healthy.addr).unwrap());
    let ra = engine.register_remote(a.regions[0].region, 0, a.regions[0].len).unwrap();
    let rb = engine.register_remote(b.regions[0].region, 0, b.regions[0].len).unwrap();
    // 32 objects of 4 MiB: even ones from the doomed peer, odd ones from the healthy one.
    let objects = 32usize;
    let local = engine.register_memory(vec![POISON; objects * 4 * MIB]).unwrap();
    let mut builder = engine.incremental_builder();
    for o in 0..objects {
        let tag = Tag::new(o as u32);
        let src = if o % 2 == 0 { ra.id() } else { rb.id() };
        builder.begin_object(tag).unwrap();
        for piece in 0..4 {
            let at = ((o / 2) * 4 + piece) * MIB;
            builder
                .push(Fragment::new(
                    src,
                    at as u64,
                    local.id(),
                    (o * 4 * MIB + piece * MIB) as u64,
                    MIB as u64,
                    tag,
                ))
                .unwrap();
        }
        builder.commit_object().unwrap();
    }
    let mut handle = engine.submit(builder.finish().unwrap());
    doomed.kill();
    let started = Instant::now();
    let failures = handle.wait().to_vec();
    let took = started.elapsed();
    drop(handle);
    assert!(took < Duration::from_secs(10), "the batch took {took:?} to settle after the kill");

    let got = local.deregister();
    let mut failed = 0;
    for o in 0..objects {
        let bytes = &got[o * 4 * MIB..(o + 1) * 4 * MIB];
        let (seed, base) = (if o % 2 == 0 { 1 } else { 2 }, (o / 2) * 4 * MIB);
        let causes: Vec<&FailureCause> = failures
            .iter()
            .filter(|f| f.tags.contains(&Tag::new(o as u32)))
            .map(|f| &f.cause)
            .collect();
        if causes.is_empty() {
            assert!(
                bytes.iter().enumerate().all(|(i, &v)| v == fill_byte(seed, base + i)),
                "object {o} completed with wrong bytes"
            );
            continue;
        }
        assert_eq!(o % 2, 0, "object {o} of the healthy peer failed: {causes:?}");
        for cause in causes {
            assert!(
                matches!(cause, FailureCause::PeerFailed { peer, .. } if *peer == a.id),
                "{cause}"
            );
        }
        failed += 1;
    }
    eprintln!(
        "settled {took:?} after the kill; {failed} of {} objects of the killed peer failed",
        objects / 2
    );
    assert!(
        failed > 0,
        "every object of the killed peer completed: kill it earlier or move more bytes"
    );
    assert!(!engine.is_alive(a.id) && engine.is_alive(b.id));

    // Later batches to the dead peer fail at once; the healthy one still serves.
    let again = engine.register_memory(vec![0u8; MIB]).unwrap();
    for (remote, dead) in [(ra.id(), true), (rb.id(), false)] {
        let mut builder = engine.incremental_builder();
        let tag = Tag::new(0);
        builder.begin_object(tag).unwrap();
        builder.push(Fragment::new(remote, 0, again.id(), 0, MIB as u64, tag)).unwrap();
        builder.commit_object().unwrap();
        let mut handle = engine.submit(builder.finish().unwrap());
        assert_eq!(handle.wait().len(), usize::from(dead), "{:?}", handle.wait());
    }
}

#[test]
fn sixteen_threads_share_one_engine_and_every_byte_is_right() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 32 * MIB, 7, &[]);
    let engine = Arc::new(engine("tcp"));
    let peer = engine.connect(server.addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, peer.regions[0].len).unwrap();
    let remote = remote.id();
    let page = 64 << 10;
    std::thread::scope(|scope| {
        for t in 0..16usize {
            let engine = Arc::clone(&engine);
            scope.spawn(move || {
                for round in 0..4usize {
                    let local = engine.register_memory(vec![POISON; 32 * page]).unwrap();
                    let mut builder = engine.incremental_builder();
                    let mut expected = vec![POISON; 32 * page];
                    for o in 0..4u32 {
                        let tag = Tag::new(o);
                        builder.begin_object(tag).unwrap();
                        for p in 0..4usize {
                            let src = ((t * 53 + round * 17 + o as usize * 5 + p * 3) % 512) * page;
                            let dst = (o as usize * 8 + p * 2) * page;
                            builder
                                .push(Fragment::new(
                                    remote,
                                    src as u64,
                                    local.id(),
                                    dst as u64,
                                    page as u64,
                                    tag,
                                ))
                                .unwrap();
                            for i in 0..page {
                                expected[dst + i] = fill_byte(7, src + i);
                            }
                        }
                        builder.commit_object().unwrap();
                    }
                    let mut handle = engine.submit(builder.finish().unwrap());
                    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
                    drop(handle);
                    assert!(
                        local.deregister() == expected,
                        "thread {t} round {round}: wrong bytes"
                    );
                }
            });
        }
    });
}

#[test]
fn deregistering_local_memory_waits_for_the_batch_that_writes_it() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 64 * MIB, 4, &[]);
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, peer.regions[0].len).unwrap();
    let local = engine.register_memory(vec![POISON; 64 * MIB]).unwrap();
    let mut builder = engine.incremental_builder();
    let tag = Tag::new(0);
    builder.begin_object(tag).unwrap();
    for piece in 0..64u64 {
        // Reversed order, so nothing merges: 64 requests of 1 MiB.
        let at = (63 - piece) * MIB as u64;
        builder.push(Fragment::new(remote.id(), at, local.id(), at, MIB as u64, tag)).unwrap();
    }
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    // The buffer comes back only once no request can write it any more: every byte has
    // arrived by then (the batch unpins its endpoints just before its handle settles).
    assert!(!handle.is_done(), "the batch finished before the deregistration began");
    let got = local.deregister();
    assert!(got.iter().enumerate().all(|(i, &b)| b == fill_byte(4, i)), "deregistered mid-flight");
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
}

#[test]
fn a_deadline_stops_sending_and_never_returns_while_a_get_may_write() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 64 * MIB, 8, &[]);
    let registry = umbp_plan::EndpointRegistry::new();
    // One request in flight at a time, so the deadline finds most of them unsent.
    let config =
        umbp_ucx::UcxConfig { max_in_flight: 1, ..umbp_ucx::UcxConfig::with_transports("tcp") };
    let engine = umbp_ucx::UcxEngine::new(registry, config).unwrap();
    let peer = engine.connect(server.addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, peer.regions[0].len).unwrap();
    let local = engine.register_memory(vec![POISON; 64 * MIB]).unwrap();
    let mut builder = engine.incremental_builder();
    for o in 0..64u32 {
        let tag = Tag::new(o);
        builder.begin_object(tag).unwrap();
        // Descending, so that nothing merges: one request per object.
        let at = u64::from(63 - o) * MIB as u64;
        builder.push(Fragment::new(remote.id(), at, local.id(), at, MIB as u64, tag)).unwrap();
        builder.commit_object().unwrap();
    }
    let mut plans = builder.finish().unwrap();
    plans.set_deadline(Some(Instant::now() + Duration::from_millis(5)));
    let mut handle = engine.submit(plans);
    let failures = handle.wait().to_vec();
    drop(handle);
    let got = local.deregister();
    let timed_out: Vec<u32> = failures
        .iter()
        .filter(|f| f.cause == FailureCause::TimedOut)
        .flat_map(|f| f.tags.iter().map(|t| t.get()))
        .collect();
    assert!(!timed_out.is_empty(), "nothing timed out: {failures:?}");
    assert!(timed_out.len() < 64, "the deadline passed before anything was sent; nothing shows it");
    for o in 0..64usize {
        let at = (63 - o) * MIB;
        let bytes = &got[at..at + MIB];
        if timed_out.contains(&(o as u32)) {
            // Never sent: its destination is untouched.
            assert!(bytes.iter().all(|&b| b == POISON), "timed-out object {o} was written");
        } else {
            assert!(
                bytes.iter().enumerate().all(|(i, &b)| b == fill_byte(8, at + i)),
                "object {o}"
            );
        }
    }
}
