//! Behaviour of the plan builders on hand-made streams: merging, rollback, rejection, misuse.

use std::sync::Arc;

use umbp_plan::{
    BufferedPlanBuilder, DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, Error, Fragment,
    IncrementalBuilder, Plan, PlanBuilder, PlanRules, RejectReason, RulePlanner, Tag,
};

#[derive(Clone, Copy)]
struct HostOnly;

impl PlanRules for HostOnly {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }
}

/// Endpoints 0 (source, 1 MiB), 1 and 2 (destinations, 64 KiB), 3 (device, 64 KiB).
fn setup() -> (Arc<EndpointRegistry>, [EndpointId; 4]) {
    let registry = EndpointRegistry::new();
    // SAFETY: the plans built here are inspected only, never submitted.
    let ids = unsafe {
        [
            registry.register(Endpoint::host(0x10_0000, 1 << 20)),
            registry.register(Endpoint::host(0x90_0000, 64 << 10)),
            registry.register(Endpoint::host(0xA0_0000, 64 << 10)),
            registry.register(Endpoint::device(DeviceOrdinal::new(0), 0xB0_0000, 64 << 10)),
        ]
    };
    (registry, ids)
}

/// The segment lengths of a plan.
fn lens(plan: &Plan) -> Vec<u64> {
    plan.segments().iter().map(|s| s.len).collect()
}

fn t(n: u32) -> Tag {
    Tag::new(n)
}

#[test]
fn adjacent_fragments_merge_and_keep_every_tag() {
    let (registry, [src, d1, _, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    for (tag, off) in [(0, 0u64), (1, 4096)] {
        b.begin_object(t(tag)).unwrap();
        b.push(Fragment::new(src, off, d1, off, 2048, t(tag))).unwrap();
        b.push(Fragment::new(src, off + 2048, d1, off + 2048, 2048, t(tag))).unwrap();
        b.commit_object().unwrap();
    }
    let plans = b.finish().unwrap();
    let plan = &plans.plans()[0];
    assert_eq!(lens(plan), &[8192], "four adjacent fragments of two objects are one segment");
    assert_eq!(plan.tags(), &[t(0), t(1)]);
    assert_eq!(plan.segment_tags(0), &[t(0), t(1)]);
}

#[test]
fn fragments_adjacent_on_one_side_only_do_not_merge() {
    let (registry, [src, d1, _, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    b.begin_object(t(0)).unwrap();
    b.push(Fragment::new(src, 0, d1, 0, 100, t(0))).unwrap();
    b.push(Fragment::new(src, 100, d1, 200, 100, t(0))).unwrap(); // source adjacent only
    b.push(Fragment::new(src, 500, d1, 300, 100, t(0))).unwrap(); // destination adjacent only
    b.commit_object().unwrap();
    assert_eq!(lens(&b.finish().unwrap().plans()[0]), &[100, 100, 100]);
}

#[test]
fn each_pair_gets_its_own_plan() {
    let (registry, [src, d1, d2, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    b.begin_object(t(0)).unwrap();
    b.push(Fragment::new(src, 0, d1, 0, 10, t(0))).unwrap();
    b.push(Fragment::new(src, 10, d2, 10, 10, t(0))).unwrap();
    b.push(Fragment::new(src, 10, d1, 10, 10, t(0))).unwrap(); // back to d1: merges there
    b.commit_object().unwrap();
    let plans = b.finish().unwrap();
    assert_eq!(plans.plans().len(), 2);
    assert_eq!((plans.plans()[0].dst(), lens(&plans.plans()[0])), (d1, vec![20u64]));
    assert_eq!((plans.plans()[1].dst(), lens(&plans.plans()[1])), (d2, vec![10u64]));
}

#[test]
fn rollback_restores_a_segment_an_earlier_object_opened() {
    let (registry, [src, d1, d2, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    b.begin_object(t(0)).unwrap();
    b.push(Fragment::new(src, 0, d1, 0, 4096, t(0))).unwrap();
    b.commit_object().unwrap();
    let before = (b.plans().to_vec(), b.rejected().to_vec());

    // Object 1 extends object 0's segment, opens a second segment, a new plan, and is rolled back.
    b.begin_object(t(1)).unwrap();
    b.push(Fragment::new(src, 4096, d1, 4096, 4096, t(1))).unwrap();
    b.push(Fragment::new(src, 65536, d1, 16384, 4096, t(1))).unwrap();
    b.push(Fragment::new(src, 0, d2, 0, 4096, t(1))).unwrap();
    assert_eq!(lens(&b.plans()[0]), &[8192, 4096]);
    assert_eq!(b.plans().len(), 2);
    b.rollback_object().unwrap();
    assert_eq!((b.plans().to_vec(), b.rejected().to_vec()), before);

    // The restored segment is extended again by the next object exactly as before.
    b.begin_object(t(2)).unwrap();
    b.push(Fragment::new(src, 4096, d1, 4096, 4096, t(2))).unwrap();
    b.commit_object().unwrap();
    let plans = b.finish().unwrap();
    assert_eq!(plans.plans().len(), 1);
    assert_eq!(lens(&plans.plans()[0]), &[8192]);
    assert_eq!(plans.plans()[0].tags(), &[t(0), t(2)]);
}

#[test]
fn rollback_of_a_rejected_object_removes_its_rejection() {
    let (registry, [src, d1, _, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    b.begin_object(t(0)).unwrap();
    assert!(b.push(Fragment::new(src, 0, d1, 65536, 1, t(0))).is_err());
    assert_eq!(b.rejected(), &[t(0)]);
    b.rollback_object().unwrap();
    assert!(b.rejected().is_empty());
    assert!(b.finish().unwrap().is_empty());
}

#[test]
fn a_rejected_fragment_poisons_its_whole_object_once() {
    let (registry, [src, d1, _, dev]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    b.begin_object(t(0)).unwrap();
    b.push(Fragment::new(src, 0, d1, 0, 100, t(0))).unwrap();
    b.commit_object().unwrap();

    b.begin_object(t(1)).unwrap();
    b.push(Fragment::new(src, 100, d1, 100, 100, t(1))).unwrap(); // merged into object 0's segment
    let err = b.push(Fragment::new(src, 0, dev, 0, 100, t(1))).unwrap_err();
    assert_eq!(
        err,
        Error::Rejected { tag: t(1), reason: RejectReason::PairNotHandled { src, dst: dev } }
    );
    assert_eq!(
        b.push(Fragment::new(src, 300, d1, 300, 100, t(1))),
        Err(Error::ObjectRejected { tag: t(1) })
    );
    b.commit_object().unwrap();
    let plans = b.finish().unwrap();
    assert_eq!(lens(&plans.plans()[0]), &[100], "nothing of object 1 reached a plan");
    assert_eq!(plans.plans()[0].tags(), &[t(0)]);
    assert_eq!(plans.rejected(), &[t(1)]);
}

#[test]
fn bad_input_gets_typed_errors_never_a_panic() {
    let (registry, [src, d1, _, _]) = setup();
    let unknown = EndpointId::from_raw(99);
    let cases = [
        (
            Fragment::new(src, (1 << 20) - 10, d1, 0, 11, t(0)),
            RejectReason::OutOfBounds {
                endpoint: src,
                offset: (1 << 20) - 10,
                len: 11,
                endpoint_len: 1 << 20,
            },
        ),
        (
            Fragment::new(src, 0, d1, 65536, 1, t(0)),
            RejectReason::OutOfBounds { endpoint: d1, offset: 65536, len: 1, endpoint_len: 65536 },
        ),
        (
            Fragment::new(src, u64::MAX, d1, 0, 1, t(0)),
            RejectReason::Overflow { endpoint: src, offset: u64::MAX, len: 1 },
        ),
        (
            Fragment::new(src, 0, d1, u64::MAX - 5, 10, t(0)),
            RejectReason::Overflow { endpoint: d1, offset: u64::MAX - 5, len: 10 },
        ),
        (Fragment::new(unknown, 0, d1, 0, 1, t(0)), RejectReason::UnknownEndpoint(unknown)),
        (Fragment::new(src, 0, unknown, 0, 1, t(0)), RejectReason::UnknownEndpoint(unknown)),
    ];
    for (fragment, reason) in cases {
        // Through the cold path (first push of an object) and the hot path (after a good push).
        for warm in [false, true] {
            let mut b = IncrementalBuilder::new(HostOnly, registry.clone());
            b.begin_object(t(0)).unwrap();
            if warm {
                b.push(Fragment::new(src, 0, d1, 0, 1, t(0))).unwrap();
            }
            let same_pair = fragment.src == src && fragment.dst == d1;
            assert_eq!(
                b.push(fragment),
                Err(Error::Rejected { tag: t(0), reason }),
                "{fragment:?} warm={warm} same_pair={same_pair}"
            );
            b.commit_object().unwrap();
            let plans = b.finish().unwrap();
            assert!(plans.plans().is_empty(), "{fragment:?}");
            assert_eq!(plans.rejected(), &[t(0)]);
        }
    }
}

#[test]
fn misuse_of_object_scopes_is_a_typed_error() {
    let (registry, [src, d1, _, _]) = setup();
    let planner = RulePlanner::new(HostOnly, registry.clone());
    let builders: Vec<Box<dyn PlanBuilder>> = vec![
        Box::new(IncrementalBuilder::new(HostOnly, registry)),
        Box::new(BufferedPlanBuilder::new(planner)),
    ];
    for mut b in builders {
        let f = Fragment::new(src, 0, d1, 0, 1, t(0));
        assert_eq!(b.push(f), Err(Error::NoOpenObject));
        assert_eq!(b.commit_object(), Err(Error::NoOpenObject));
        assert_eq!(b.rollback_object(), Err(Error::NoOpenObject));
        b.begin_object(t(0)).unwrap();
        assert_eq!(b.begin_object(t(1)), Err(Error::ObjectOpen { open: t(0) }));
        assert_eq!(
            b.push(Fragment::new(src, 0, d1, 0, 1, t(5))),
            Err(Error::TagMismatch { object: t(0), fragment: t(5) })
        );
        assert_eq!(b.finish().map(|_| ()), Err(Error::ObjectOpen { open: t(0) }));
        b.push(Fragment::new(src, 0, d1, 0, 0, t(0))).unwrap(); // zero length: skipped
        b.commit_object().unwrap();
        assert!(
            b.finish().unwrap().is_empty(),
            "a zero-length fragment is neither planned nor rejected"
        );
    }
}

#[test]
fn a_builder_sees_endpoints_registered_after_it_was_made() {
    let (registry, [src, _, _, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry.clone());
    // SAFETY: inspected only, never submitted.
    let late = unsafe { registry.register(Endpoint::host(0xF0_0000, 4096)) };
    b.begin_object(t(0)).unwrap();
    b.push(Fragment::new(src, 0, late, 0, 4096, t(0))).unwrap();
    b.commit_object().unwrap();
    assert_eq!(b.finish().unwrap().plans()[0].dst(), late);
}

#[test]
fn segment_tags_name_exactly_the_objects_in_each_segment() {
    let (registry, [src, d1, _, _]) = setup();
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    // Object 0: segment 0. Object 1: joins segment 0, then opens segment 1.
    // Object 2: opens segment 2. Object 3: joins segment 2.
    let objects: [(u32, &[(u64, u64)]); 4] =
        [(0, &[(0, 10)]), (1, &[(10, 10), (100, 10)]), (2, &[(500, 10)]), (3, &[(510, 10)])];
    for (tag, pieces) in objects {
        b.begin_object(t(tag)).unwrap();
        for &(off, len) in pieces {
            b.push(Fragment::new(src, off, d1, off, len, t(tag))).unwrap();
        }
        b.commit_object().unwrap();
    }
    let plans = b.finish().unwrap();
    let plan = &plans.plans()[0];
    assert_eq!(lens(plan), &[20, 10, 20]);
    assert_eq!(plan.segment_tags(0), &[t(0), t(1)]);
    assert_eq!(plan.segment_tags(1), &[t(1)]);
    assert_eq!(plan.segment_tags(2), &[t(2), t(3)]);
    assert_eq!(plan.segment_tags(3), &[] as &[Tag]);
}

/// An object: its tag and its fragments as `(destination, source offset, length)`, the
/// destination offset equal to the source offset.
type Object<'a> = (u32, &'a [(EndpointId, u64, u64)]);

/// Builds one batch of `objects` from `src` with `b`.
fn batch(b: &mut dyn PlanBuilder, src: EndpointId, objects: &[Object<'_>]) {
    for &(tag, fragments) in objects {
        b.begin_object(t(tag)).unwrap();
        for &(dst, off, len) in fragments {
            b.push(Fragment::new(src, off, dst, off, len, t(tag))).unwrap();
        }
        b.commit_object().unwrap();
    }
}

#[test]
fn retaining_tags_joins_the_pieces_a_dropped_object_held_apart() {
    let (registry, [src, d1, _, _]) = setup();
    let planner = RulePlanner::new(HostOnly, registry.clone());
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    // Object 1 sits between object 0 and object 2, which are adjacent to each other.
    let objects: [Object<'_>; 3] =
        [(0, &[(d1, 0, 10)]), (1, &[(d1, 500, 10)]), (2, &[(d1, 10, 10), (d1, 20, 5)])];
    batch(&mut b, src, &objects);
    let mut plans = b.finish().unwrap();
    assert_eq!(lens(&plans.plans()[0]), [10, 10, 15]);
    plans.retain_tags(|tag| tag != t(1));
    assert_eq!(lens(&plans.plans()[0]), [25], "planning objects 0 and 2 gives one segment");
    assert_eq!(plans.plans()[0].tags(), [t(0), t(2)]);
    let mut without = BufferedPlanBuilder::new(planner);
    batch(&mut without, src, &[objects[0], objects[2]]);
    assert_eq!(plans, without.finish().unwrap());
}

#[test]
fn retaining_tags_orders_the_plans_as_planning_without_the_dropped_objects() {
    let (registry, [src, d1, d2, _]) = setup();
    let planner = RulePlanner::new(HostOnly, registry.clone());
    let mut b = IncrementalBuilder::new(HostOnly, registry);
    // Object 0 opens the plan to d1; object 1 writes d2 first, then d1.
    let objects: [Object<'_>; 2] = [(0, &[(d1, 0, 10)]), (1, &[(d2, 100, 10), (d1, 200, 10)])];
    batch(&mut b, src, &objects);
    let mut plans = b.finish().unwrap();
    let dsts = |plans: &umbp_plan::PlanSet| plans.plans().iter().map(Plan::dst).collect::<Vec<_>>();
    assert_eq!(dsts(&plans), [d1, d2]);
    plans.retain_tags(|tag| tag != t(0));
    assert_eq!(dsts(&plans), [d2, d1], "object 1's first bytes went to d2");
    let mut without = BufferedPlanBuilder::new(planner);
    batch(&mut without, src, &objects[1..]);
    assert_eq!(plans, without.finish().unwrap());
}

/// Host to host with a maximum segment of 4 KiB.
#[derive(Clone, Copy)]
struct Capped;

impl PlanRules for Capped {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }

    fn max_segment_len(&self) -> u64 {
        4096
    }
}

#[test]
fn a_fragment_past_the_maximum_segment_is_split_inside_its_object() {
    let (registry, [src, d1, _, _]) = setup();
    let planner = RulePlanner::new(Capped, registry.clone());
    let mut incremental = IncrementalBuilder::new(Capped, registry.clone());
    let mut buffered = BufferedPlanBuilder::new(planner);
    let builders: [&mut dyn PlanBuilder; 2] = [&mut incremental, &mut buffered];
    for b in builders {
        // Object 0: 1000 bytes, then 10,000 adjacent ones: 1000 | 4096, 4096, 1808.
        b.begin_object(t(0)).unwrap();
        b.push(Fragment::new(src, 0, d1, 0, 1000, t(0))).unwrap();
        b.push(Fragment::new(src, 1000, d1, 1000, 10_000, t(0))).unwrap();
        b.commit_object().unwrap();
        // Object 1: rolled back after 9000 bytes that would have been split: nothing remains.
        b.begin_object(t(1)).unwrap();
        b.push(Fragment::new(src, 11_000, d1, 11_000, 9000, t(1))).unwrap();
        b.rollback_object().unwrap();
        // Object 2: 2000 bytes joining object 0's short last piece, then 5000 more.
        b.begin_object(t(2)).unwrap();
        b.push(Fragment::new(src, 11_000, d1, 11_000, 2000, t(2))).unwrap();
        b.push(Fragment::new(src, 13_000, d1, 13_000, 5000, t(2))).unwrap();
        b.commit_object().unwrap();
        let plans = b.finish().unwrap();
        assert!(plans.rejected().is_empty());
        let plan = &plans.plans()[0];
        assert_eq!(lens(plan), &[1000, 4096, 4096, 3808, 4096, 904]);
        assert_eq!(plan.tags(), &[t(0), t(2)]);
        assert_eq!(plan.segment_tags(2), &[t(0)]);
        assert_eq!(plan.segment_tags(3), &[t(0), t(2)]);
        assert_eq!(plan.segment_tags(5), &[t(2)]);
        assert_eq!(plan.bytes(), 18_000);
    }
}
