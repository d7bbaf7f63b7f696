//! Copies over real memory: scattered pages, merging, separate pairs, rejected objects, refused
//! endpoints, and plans that fail at submit. Every destination starts poisoned.

mod support;

use support::{pattern, HostBuf, Rng, POISON};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{
    DeviceOrdinal, Endpoint, EndpointRegistry, Error, FailureCause, Fragment, IncrementalBuilder,
    ObjectState, PlanBuilder, PlanRules, RejectReason, Tag, TransferEngine,
};

const PAGE: usize = 4096;

fn engine(config: LocalCopyConfig) -> LocalCopyEngine {
    LocalCopyEngine::with_config(EndpointRegistry::new(), config)
}

fn tag(t: u32) -> Tag {
    Tag::new(t)
}

#[test]
fn scattered_out_of_order_non_adjacent_pages_copy_correctly() {
    for config in support::configs() {
        let engine = engine(config);
        let arena = HostBuf::new(64 * PAGE, |i| pattern(1, i));
        let out = HostBuf::poisoned(16 * PAGE);
        let (a, o) = (arena.register(&engine), out.register(&engine));

        // Two objects of eight pages each, taken from every third arena page in shuffled order:
        // no two fragments are adjacent in the arena.
        let pages: Vec<usize> = Rng(7).permutation(16).into_iter().map(|p| 3 * p + 1).collect();
        let mut builder = engine.incremental_builder();
        for object in 0..2u32 {
            builder.begin_object(tag(object)).unwrap();
            // Pushed in reverse destination order, too.
            for i in (0..8).rev() {
                let slot = object as usize * 8 + i;
                let f = Fragment::new(
                    a,
                    (pages[slot] * PAGE) as u64,
                    o,
                    (slot * PAGE) as u64,
                    PAGE as u64,
                    tag(object),
                );
                builder.push(f).unwrap();
            }
            builder.commit_object().unwrap();
        }
        let plans = builder.finish().unwrap();
        assert_eq!(plans.plans().len(), 1);
        assert_eq!(plans.segment_count(), 16, "no fragment is adjacent to another");

        let mut handle = engine.submit(plans);
        assert!(handle.wait().is_empty());
        let arena_bytes = arena.bytes();
        let mut want = Vec::new();
        for &page in &pages {
            want.extend_from_slice(&arena_bytes[page * PAGE..(page + 1) * PAGE]);
        }
        assert!(out.bytes() == want, "{:?}", engine.config());
    }
}

#[test]
fn adjacent_fragments_coalesce_into_one_segment_with_all_their_tags() {
    for config in support::configs() {
        let engine = engine(config);
        let arena = HostBuf::new(16 * PAGE, |i| pattern(2, i));
        let out = HostBuf::poisoned(4 * PAGE);
        let (a, o) = (arena.register(&engine), out.register(&engine));

        let mut builder = engine.incremental_builder();
        // Object 0: arena pages 4 and 5 to out pages 0 and 1; object 1: page 6 to page 2 (still
        // adjacent on both sides); object 2: page 9 to page 3 (not adjacent in the arena).
        let objects: [&[(u64, u64)]; 3] = [&[(4, 0), (5, 1)], &[(6, 2)], &[(9, 3)]];
        for (t, pages) in objects.iter().enumerate() {
            builder.begin_object(tag(t as u32)).unwrap();
            for &(from, to) in pages.iter() {
                let p = PAGE as u64;
                builder.push(Fragment::new(a, from * p, o, to * p, p, tag(t as u32))).unwrap();
            }
            builder.commit_object().unwrap();
        }
        let plans = builder.finish().unwrap();
        let plan = &plans.plans()[0];
        let lens: Vec<u64> = plan.segments().iter().map(|s| s.len).collect();
        assert_eq!(lens, [3 * PAGE as u64, PAGE as u64]);
        assert_eq!(plan.segment_tags(0), &[tag(0), tag(1)]);
        assert_eq!(plan.segment_tags(1), &[tag(2)]);

        assert!(engine.submit(plans).wait().is_empty());
        let arena_bytes = arena.bytes();
        let mut want = arena_bytes[4 * PAGE..7 * PAGE].to_vec();
        want.extend_from_slice(&arena_bytes[9 * PAGE..10 * PAGE]);
        assert!(out.bytes() == want);
    }
}

#[test]
fn separate_endpoint_pairs_give_separate_plans() {
    for config in support::configs() {
        let engine = engine(config);
        let (a1, a2) =
            (HostBuf::new(8 * PAGE, |i| pattern(3, i)), HostBuf::new(8 * PAGE, |i| pattern(4, i)));
        let (o1, o2) = (HostBuf::poisoned(2 * PAGE), HostBuf::poisoned(2 * PAGE));
        let ids = [
            a1.register(&engine),
            a2.register(&engine),
            o1.register(&engine),
            o2.register(&engine),
        ];
        let [s1, s2, d1, d2] = ids;
        let p = PAGE as u64;

        let mut builder = engine.incremental_builder();
        builder.begin_object(tag(0)).unwrap();
        builder.push(Fragment::new(s1, 0, d1, 0, p, tag(0))).unwrap();
        builder.push(Fragment::new(s2, 3 * p, d2, 0, p, tag(0))).unwrap();
        builder.push(Fragment::new(s1, p, d1, p, p, tag(0))).unwrap(); // merges into plan 1
        builder.push(Fragment::new(s1, 5 * p, d2, p, p, tag(0))).unwrap();
        builder.commit_object().unwrap();
        let plans = builder.finish().unwrap();
        let pairs: Vec<_> = plans.plans().iter().map(|plan| (plan.src(), plan.dst())).collect();
        assert_eq!(pairs, [(s1, d1), (s2, d2), (s1, d2)]);
        assert_eq!(plans.segment_count(), 3);

        assert!(engine.submit(plans).wait().is_empty());
        let (b1, b2) = (a1.bytes(), a2.bytes());
        assert!(o1.bytes() == b1[..2 * PAGE]);
        assert!(o2.bytes()[..PAGE] == b2[3 * PAGE..4 * PAGE]);
        assert!(o2.bytes()[PAGE..] == b1[5 * PAGE..6 * PAGE]);
    }
}

#[test]
fn an_out_of_bounds_fragment_rejects_its_object_and_its_siblings_complete() {
    for config in support::configs() {
        let engine = engine(config);
        let arena = HostBuf::new(8 * PAGE, |i| pattern(5, i));
        let out = HostBuf::poisoned(3 * PAGE);
        let (a, o) = (arena.register(&engine), out.register(&engine));
        let p = PAGE as u64;

        let mut builder = engine.incremental_builder();
        builder.begin_object(tag(0)).unwrap();
        builder.push(Fragment::new(a, 2 * p, o, 0, p, tag(0))).unwrap();
        builder.commit_object().unwrap();

        // Object 1: its first page is fine, its second starts past the end of the arena.
        builder.begin_object(tag(1)).unwrap();
        builder.push(Fragment::new(a, 3 * p, o, p, p / 2, tag(1))).unwrap();
        let refused = builder.push(Fragment::new(a, 8 * p - 10, o, p + p / 2, p / 2, tag(1)));
        assert!(
            matches!(
                refused,
                Err(Error::Rejected { tag: t, reason: RejectReason::OutOfBounds { endpoint, .. } })
                    if t == tag(1) && endpoint == a
            ),
            "{refused:?}"
        );
        let after = builder.push(Fragment::new(a, 0, o, p, 1, tag(1)));
        assert_eq!(after, Err(Error::ObjectRejected { tag: tag(1) }));
        builder.commit_object().unwrap();

        // Object 2 overflows the offset arithmetic; object 3 is fine.
        builder.begin_object(tag(2)).unwrap();
        let overflow = builder.push(Fragment::new(a, u64::MAX - 5, o, 2 * p, 100, tag(2)));
        assert!(matches!(
            overflow,
            Err(Error::Rejected { reason: RejectReason::Overflow { .. }, .. })
        ));
        builder.commit_object().unwrap();
        builder.begin_object(tag(3)).unwrap();
        builder.push(Fragment::new(a, 7 * p, o, 2 * p, p, tag(3))).unwrap();
        builder.commit_object().unwrap();

        let plans = builder.finish().unwrap();
        assert_eq!(plans.rejected(), &[tag(1), tag(2)]);
        assert_eq!(plans.plans()[0].tags(), &[tag(0), tag(3)]);
        assert!(engine.submit(plans).wait().is_empty());

        let (got, src) = (out.bytes(), arena.bytes());
        assert!(got[..PAGE] == src[2 * PAGE..3 * PAGE], "object 0 completed");
        assert!(got[PAGE..2 * PAGE].iter().all(|&b| b == POISON), "nothing of object 1 written");
        assert!(got[2 * PAGE..] == src[7 * PAGE..], "object 3 completed");
    }
}

#[test]
fn device_and_file_endpoints_are_refused_with_a_typed_error() {
    let engine = engine(LocalCopyConfig::default());
    let arena = HostBuf::new(PAGE, |i| pattern(6, i));
    let out = HostBuf::poisoned(PAGE);
    let (a, o) = (arena.register(&engine), out.register(&engine));
    // SAFETY: an invented device address; the engine refuses the endpoint at push, so nothing
    // ever dereferences it.
    let device = unsafe {
        engine.registry().register(Endpoint::device(DeviceOrdinal::new(0), 0x7000_0000, 1 << 20))
    };
    let file = umbp_plan::testing::invent_file(engine.registry(), -1, 0, 1 << 20, false);

    let mut builder = engine.incremental_builder();
    for (t, (src, dst)) in [(a, device), (device, o), (file, o), (a, file)].into_iter().enumerate()
    {
        let t = tag(t as u32);
        builder.begin_object(t).unwrap();
        assert_eq!(
            builder.push(Fragment::new(src, 0, dst, 0, 64, t)),
            Err(Error::Rejected { tag: t, reason: RejectReason::PairNotHandled { src, dst } })
        );
        builder.commit_object().unwrap();
    }
    let plans = builder.finish().unwrap();
    assert!(plans.plans().is_empty());
    assert_eq!(plans.rejected().len(), 4);

    let registry = engine.registry();
    let endpoint = |id| registry.get(id).unwrap();
    assert!(engine.can_handle(&endpoint(a), &endpoint(o)));
    assert!(!engine.can_handle(&endpoint(a), &endpoint(device)));
    assert!(!engine.can_handle(&endpoint(file), &endpoint(o)));

    // The boxed builder and the batch API refuse them the same way.
    let mut boxed = engine.builder();
    boxed.begin_object(tag(0)).unwrap();
    assert!(matches!(
        boxed.push(Fragment::new(a, 0, device, 0, 64, tag(0))),
        Err(Error::Rejected { reason: RejectReason::PairNotHandled { .. }, .. })
    ));
    let report = engine
        .transfer_batch(
            2,
            &[Fragment::new(file, 0, o, 0, 64, tag(0)), Fragment::new(a, 0, o, 0, 64, tag(1))],
        )
        .unwrap();
    assert_eq!(report.rejections, [(tag(0), RejectReason::PairNotHandled { src: file, dst: o })]);
    assert_eq!(out.bytes()[..64], arena.bytes()[..64]);
}

/// Carries every pair: plans built with it are submitted to the local copy engine to check its
/// own submit-time checks.
struct Anything;

impl PlanRules for Anything {
    fn carries(&self, _: &Endpoint, _: &Endpoint) -> bool {
        true
    }
}

#[test]
fn a_plan_naming_a_device_endpoint_fails_at_submit_and_its_siblings_copy() {
    let engine = engine(LocalCopyConfig::default());
    let arena = HostBuf::new(PAGE, |i| pattern(7, i));
    let out = HostBuf::poisoned(PAGE);
    let (a, o) = (arena.register(&engine), out.register(&engine));
    // SAFETY: an invented device address that only the permissive builder below sees; the
    // engine under test must refuse its plan without dereferencing it.
    let device = unsafe {
        engine.registry().register(Endpoint::device(
            DeviceOrdinal::new(1),
            0x7000_0000,
            PAGE as u64,
        ))
    };

    let mut builder = IncrementalBuilder::new(Anything, engine.registry().clone());
    for (t, dst) in [(0, device), (1, o)] {
        builder.begin_object(tag(t)).unwrap();
        builder.push(Fragment::new(a, 0, dst, 0, 512, tag(t))).unwrap();
        builder.commit_object().unwrap();
    }
    let mut handle = engine.submit(builder.finish().unwrap());
    let failures = handle.wait().to_vec();
    assert_eq!(failures.len(), 1);
    assert_eq!(
        (failures[0].src, failures[0].dst, failures[0].tags.as_slice()),
        (a, device, &[tag(0)][..])
    );
    assert!(
        matches!(&failures[0].cause, FailureCause::NotAccepted(why) if why.contains("not host memory"))
    );
    assert_eq!(failures[0].engine, engine.name());
    assert!(out.bytes()[..512] == arena.bytes()[..512]);
}

#[test]
fn a_deregistered_endpoint_fails_its_plan_with_endpoint_gone() {
    let engine = engine(LocalCopyConfig::default());
    let arena = HostBuf::new(PAGE, |i| pattern(8, i));
    let (out, other) = (HostBuf::poisoned(PAGE), HostBuf::poisoned(PAGE));
    let (a, o, x) = (arena.register(&engine), out.register(&engine), other.register(&engine));

    let mut builder = engine.incremental_builder();
    for (t, dst) in [(0, o), (1, x)] {
        builder.begin_object(tag(t)).unwrap();
        builder.push(Fragment::new(a, 0, dst, 0, PAGE as u64, tag(t))).unwrap();
        builder.commit_object().unwrap();
    }
    let plans = builder.finish().unwrap();
    engine.registry().deregister(o).unwrap();

    let settled = engine.submit(plans).into_settled();
    assert_eq!(settled.failures.len(), 1);
    assert_eq!(settled.failures[0].cause, FailureCause::EndpointGone(o));
    assert_eq!(settled.failures[0].tags, [tag(0)]);
    assert!(out.bytes().iter().all(|&b| b == POISON));
    assert!(other.bytes() == arena.bytes());
}

#[test]
fn a_segment_outside_its_endpoint_at_submit_fails_its_whole_plan() {
    let engine = engine(LocalCopyConfig::default());
    let arena = HostBuf::new(2 * PAGE, |i| pattern(9, i));
    let out = HostBuf::poisoned(PAGE);
    let (a, o) = (arena.register(&engine), out.register(&engine));

    // Another registry that believes the destination is twice as long, with the same ids.
    let liar = EndpointRegistry::new();
    let arena_addr = engine.registry().get(a).unwrap().addr();
    let out_addr = engine.registry().get(o).unwrap().addr();
    // SAFETY: plans built on `liar` are only submitted to `engine`, whose registry holds the
    // true lengths; nothing dereferences `liar`'s ranges.
    unsafe {
        liar.register(Endpoint::host(arena_addr, 2 * PAGE as u64));
        liar.register(Endpoint::host(out_addr, 2 * PAGE as u64));
    }
    let mut builder = IncrementalBuilder::new(Anything, liar);
    builder.begin_object(tag(0)).unwrap();
    builder.push(Fragment::new(a, 0, o, 0, 100, tag(0))).unwrap();
    builder.push(Fragment::new(a, 200, o, PAGE as u64, 100, tag(0))).unwrap();
    builder.commit_object().unwrap();

    let settled = engine.submit(builder.finish().unwrap()).into_settled();
    assert_eq!(settled.failures.len(), 1);
    assert!(
        matches!(&settled.failures[0].cause, FailureCause::NotAccepted(why) if why.contains("outside"))
    );
    assert!(out.bytes().iter().all(|&b| b == POISON), "not even the in-bounds segment");
}

#[test]
fn waiting_is_idempotent_and_dropping_a_handle_is_free() {
    let engine = engine(LocalCopyConfig::default());
    let arena = HostBuf::new(PAGE, |i| pattern(10, i));
    let out = HostBuf::poisoned(PAGE);
    let (a, o) = (arena.register(&engine), out.register(&engine));
    let report =
        engine.transfer_batch(1, &[Fragment::new(a, 0, o, 0, PAGE as u64, tag(0))]).unwrap();
    assert!(report.failures.is_empty());

    let mut builder = engine.incremental_builder();
    builder.begin_object(tag(0)).unwrap();
    builder.push(Fragment::new(a, 0, o, 0, 8, tag(0))).unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.is_done(), "settled at submit");
    assert!(handle.wait().is_empty());
    assert!(handle.wait().is_empty());
    drop(handle);
    drop(engine.submit(Default::default()));
    assert!(out.bytes() == arena.bytes());
}

#[test]
fn large_submits_spread_over_the_pool_and_huge_segments_split() {
    let engine = engine(LocalCopyConfig { threads: 2, ..LocalCopyConfig::default() });
    let arena = HostBuf::new(8 << 20, |i| pattern(11, i));
    let out = HostBuf::poisoned(6 << 20);
    let (a, o) = (arena.register(&engine), out.register(&engine));

    // One 3 MiB segment, then 512 scattered 4 KiB pages, then 1 MiB in 64 KiB pieces.
    let mut transfers = vec![Fragment::new(a, 5 << 20, o, 0, 3 << 20, tag(0))];
    let pages = Rng(11).permutation(1024);
    for (i, &page) in pages.iter().take(512).enumerate() {
        let f = Fragment::new(
            a,
            (page * PAGE) as u64,
            o,
            (3 << 20) + (i * PAGE) as u64,
            PAGE as u64,
            tag(1),
        );
        transfers.push(f);
    }
    for i in 0..16u64 {
        transfers.push(Fragment::new(
            a,
            (4 << 20) + i * 65536,
            o,
            (5 << 20) + i * 65536,
            65536,
            tag(2),
        ));
    }
    let report = engine.transfer_batch(3, &transfers).unwrap();
    assert_eq!(report.aggregate(), umbp_plan::BatchState::Completed, "{report:?}");

    let (got, src) = (out.bytes(), arena.bytes());
    assert!(got[..3 << 20] == src[5 << 20..]);
    for (i, &page) in pages.iter().take(512).enumerate() {
        let at = (3 << 20) + i * PAGE;
        assert!(got[at..at + PAGE] == src[page * PAGE..(page + 1) * PAGE], "page {i}");
    }
    assert!(got[5 << 20..] == src[4 << 20..5 << 20]);

    // A single segment of 3 MiB and a few bytes is split into pieces too.
    out.fill(POISON);
    let len = (3 << 20) + 5;
    let report = engine.transfer_batch(1, &[Fragment::new(a, 7, o, 3, len, tag(0))]).unwrap();
    assert_eq!(report.aggregate(), umbp_plan::BatchState::Completed);
    let got = out.bytes();
    assert!(got[3..3 + len as usize] == src[7..7 + len as usize]);
    assert!(got[..3].iter().chain(&got[3 + len as usize..]).all(|&b| b == POISON));
}

#[test]
fn objects_whose_bytes_overlap_fail_whole_and_the_others_run() {
    for config in support::configs() {
        let engine = engine(config);
        let n = 16usize << 10;
        let buf = HostBuf::new(8 * n, |i| pattern(12, i));
        let other = HostBuf::poisoned(8 * n);
        let (b, x) = (buf.register(&engine), other.register(&engine));
        let before = buf.bytes();
        let n64 = n as u64;

        let transfers = [
            // Object 0: b[0..n) -> b[n..2n) and b[n..2n) -> b[2n..3n). Adjacent on both sides,
            // so they merge into one segment whose meaning (a memmove) differs from copying
            // them one by one: the object fails, nothing of it is written.
            Fragment::new(b, 0, b, n64, n64, tag(0)),
            Fragment::new(b, n64, b, 2 * n64, n64, tag(0)),
            // Object 1 reads b[4n..5n), which object 2 writes: both fail.
            Fragment::new(b, 4 * n64, x, 0, n64, tag(1)),
            Fragment::new(b, 6 * n64, b, 4 * n64, n64, tag(2)),
            // Object 3 reads what object 0 would have written, but object 0 is out: it only
            // meets a failed object's bytes, and still fails (the rule is checked on the batch
            // as submitted).
            Fragment::new(b, 2 * n64, x, 2 * n64, 100, tag(3)),
            // Object 4 shares nothing: it runs, alone, on the pool or not.
            Fragment::new(b, 7 * n64, x, 4 * n64, n64, tag(4)),
        ];
        let report = engine.transfer_batch(5, &transfers).unwrap();
        let states: Vec<ObjectState> =
            (0..5).map(|t| report.status.object(tag(t)).unwrap()).collect();
        use ObjectState::{Completed as C, Failed as F};
        assert_eq!(states, [F, F, F, F, C]);
        assert!(report.failures.iter().all(|f| f.cause == FailureCause::Overlap));
        assert!(buf.bytes() == before, "no byte of an overlapping object was written");
        let out = other.bytes();
        assert!(out[..4 * n].iter().all(|&v| v == POISON));
        assert!(out[4 * n..5 * n] == before[7 * n..8 * n]);
    }
}

#[test]
fn deregistering_during_a_copy_waits_for_it() {
    let engine =
        engine(LocalCopyConfig { threads: 2, parallel_threshold: 0, ..LocalCopyConfig::default() });
    let len = 64usize << 20;
    let src = HostBuf::new(len, |i| pattern(3, i));
    let dst = HostBuf::poisoned(len);
    let (s, d) = (src.register(&engine), dst.register(&engine));
    let transfers: Vec<Fragment> =
        (0..64u64).map(|k| Fragment::new(s, k << 20, d, k << 20, 1 << 20, tag(0))).collect();
    std::thread::scope(|scope| {
        let copier = scope.spawn(|| engine.transfer_batch(1, &transfers).unwrap());
        // Wait until the copy has pinned its endpoints, then deregister the destination.
        while !engine.registry().is_pinned(d) && !copier.is_finished() {
            std::hint::spin_loop();
        }
        engine.registry().deregister(d).unwrap();
        assert!(dst.bytes() == src.bytes(), "deregister returned before the copy finished");
        assert_eq!(copier.join().unwrap().aggregate(), umbp_plan::BatchState::Completed);
    });
}
