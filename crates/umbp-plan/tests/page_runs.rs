//! `Run::push_walk` against the page walk feeding `push` one fragment at a time: for random
//! paged objects, ranges and destinations (some out of bounds, some refused by the walk), with
//! commits and rollbacks, engine rules that refuse some fragments mid-range, and some ranges
//! pushed fragment by fragment into the same builder, both give the batch planner's plan set
//! over the committed fragments; so does `PlanBuilder::push_walk`
//! through a boxed builder, incremental or buffered.

use proptest::prelude::*;
use umbp_plan::{
    BatchPlanner, BufferedPlanBuilder, Endpoint, EndpointId, EndpointRegistry, Error, Fragment,
    IncrementalBuilder, PageWalk, PlanBuilder, PlanRules, RejectReason, RulePlanner, Tag,
};

#[derive(Clone, Copy, Debug)]
struct Rules {
    max_segment: u64,
    /// Refuse fragments whose destination offset is 1 modulo this (an engine's alignment
    /// rule, say), so that pages deep inside a range get refused.
    refuse_modulo: Option<u64>,
}

impl PlanRules for Rules {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }

    fn max_segment_len(&self) -> u64 {
        self.max_segment
    }

    fn check_fragment(&self, _: &Endpoint, _: &Endpoint, f: &Fragment) -> Result<(), RejectReason> {
        match self.refuse_modulo {
            Some(m) if f.dst_offset % m == 1 => Err(RejectReason::Misaligned {
                endpoint: f.dst,
                offset: f.dst_offset,
                len: f.len,
                align: m,
            }),
            _ => Ok(()),
        }
    }
}

#[derive(Clone, Debug)]
struct Object {
    pages: Vec<u64>,
    size: u64,
    /// (object offset, length, destination index, destination offset)
    ranges: Vec<(u64, u64, usize, u64)>,
    commit: bool,
}

const PAGE: u64 = 64;
const ARENA_PAGES: u64 = 40;
/// Stands for a page whose tier offset overflows when its length is added.
const HUGE: u64 = u64::MAX;
/// Stands for a page that ends at the arena's end if it is the object's short last page.
const AT_END: u64 = u64::MAX - 1;

fn object() -> impl Strategy<Value = Object> {
    (1u64..6, 0u64..PAGE, any::<bool>()).prop_flat_map(|(pages, short, commit)| {
        let size = pages * PAGE - short.min(PAGE - 1);
        let pages_len = pages;
        // Pages mostly inside the arena, now and then one past it, one whose offset
        // overflows, or (for a short last page) one ending exactly at the arena's end; runs of
        // adjacent pages.
        let page = prop_oneof![
            18 => 0..ARENA_PAGES,
            2 => ARENA_PAGES..ARENA_PAGES + 3,
            1 => Just(HUGE),
            1 => Just(AT_END),
        ];
        let range = (0..size + 8, 0..size + 8, 0usize..3, 0u64..400);
        (
            proptest::collection::vec((page, any::<bool>()), pages as usize),
            proptest::collection::vec(range, 0..5),
        )
            .prop_map(move |(raw, ranges)| {
                let mut pages = Vec::new();
                let last_len = size - (pages_len - 1) * PAGE;
                for (p, follow) in raw {
                    let next = match pages.last() {
                        Some(&last) if follow && last < u64::MAX - PAGE => last + PAGE,
                        _ if p == HUGE => u64::MAX - 10,
                        // Valid only as the object's (short) last page.
                        _ if p == AT_END => ARENA_PAGES * PAGE - last_len,
                        _ => p * PAGE,
                    };
                    pages.push(next);
                }
                Object { pages, size, ranges, commit }
            })
    })
}

fn setup() -> (std::sync::Arc<EndpointRegistry>, EndpointId, [EndpointId; 3]) {
    let registry = EndpointRegistry::new();
    // SAFETY: the plans are compared, never submitted.
    let ids = unsafe {
        let arena = registry.register(Endpoint::host(1 << 30, ARENA_PAGES * PAGE));
        let dsts = [
            registry.register(Endpoint::host(2 << 30, 512)),
            registry.register(Endpoint::host(3 << 30, 512)),
            registry.register(Endpoint::host(4 << 30, 200)),
        ];
        (arena, dsts)
    };
    (registry, ids.0, ids.1)
}

/// Cases per property: a few under Miri, which interprets every step (and reads no
/// regression files: its isolation has no file system).
fn config() -> ProptestConfig {
    if cfg!(miri) {
        ProptestConfig { cases: 4, failure_persistence: None, ..ProptestConfig::default() }
    } else {
        ProptestConfig::with_cases(1000)
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn push_walk_equals_walk_and_push(
        objects in proptest::collection::vec(object(), 1..8),
        max_segment in prop_oneof![Just(u64::MAX), 64u64..300, 16u64..PAGE],
        refuse_modulo in prop_oneof![3 => Just(None), 1 => (5u64..40).prop_map(Some)],
    ) {
        let (registry, arena, dsts) = setup();
        let rules = Rules { max_segment, refuse_modulo };
        let mut by_walk = IncrementalBuilder::new(rules, registry.clone());
        let mut by_push = IncrementalBuilder::new(rules, registry.clone());
        // The same through the trait, as a caller holding a boxed builder (or the composite)
        // reaches it: the incremental builder's override and the default, on the buffered one.
        let mut by_trait: [Box<dyn PlanBuilder>; 2] = [
            Box::new(IncrementalBuilder::new(rules, registry.clone())),
            Box::new(BufferedPlanBuilder::new(RulePlanner::new(rules, registry.clone()))),
        ];
        let mut committed = Vec::new();

        for (i, o) in objects.iter().enumerate() {
            let tag = Tag::new(i as u32);
            by_walk.begin_object(tag).unwrap();
            by_push.begin_object(tag).unwrap();
            for b in &mut by_trait {
                b.begin_object(tag).unwrap();
            }
            let mut fragments = Vec::new();
            let mut walk_failed = false;
            match PageWalk::new(&o.pages, PAGE, o.size) {
                Err(_) => walk_failed = true,
                Ok(walk) => {
                    for &(offset, len, d, dst_offset) in &o.ranges {
                        // The reference: walk, collect, push one by one.
                        let mut pieces = Vec::new();
                        let walked = walk.walk(offset, len, dst_offset, |p| {
                            pieces.push(Fragment::new(arena, p.tier_offset, dsts[d], p.dst_offset, p.len, tag));
                            Ok::<(), Error>(())
                        });
                        // Every third range goes fragment by fragment through the same builder,
                        // so that ranges and single pushes share plans (the cursor's tail and
                        // the plan state's must agree).
                        let ran = if (offset + len + dst_offset) % 3 == 0 && walked.is_ok() {
                            pieces.iter().try_for_each(|f| by_walk.push(*f))
                        } else {
                            by_walk
                                .begin_run(arena, dsts[d])
                                .and_then(|mut run| run.push_walk(&walk, offset, len, dst_offset))
                        };
                        for b in &mut by_trait {
                            let through = b.push_walk(arena, dsts[d], &walk, offset, len, dst_offset, tag);
                            if walked.is_err() {
                                prop_assert!(matches!(through, Err(Error::Walk(_)) | Err(Error::ObjectRejected { .. })), "{through:?}");
                            }
                        }
                        if walked.is_err() {
                            prop_assert!(matches!(ran, Err(Error::Walk(_)) | Err(Error::ObjectRejected { .. })), "{ran:?}");
                            walk_failed = true;
                            break;
                        }
                        for f in &pieces {
                            let _ = by_push.push(*f);
                        }
                        fragments.extend(pieces);
                    }
                }
            }
            if walk_failed || !o.commit {
                // A refused walk fails the object: the caller rolls it back.
                by_walk.rollback_object().unwrap();
                by_push.rollback_object().unwrap();
                for b in &mut by_trait {
                    b.rollback_object().unwrap();
                }
            } else {
                by_walk.commit_object().unwrap();
                by_push.commit_object().unwrap();
                for b in &mut by_trait {
                    b.commit_object().unwrap();
                }
                committed.extend(fragments);
            }
        }
        let expected = RulePlanner::new(rules, registry).plan_batch(&committed);
        prop_assert_eq!(by_push.finish().unwrap(), expected.clone());
        for b in &mut by_trait {
            prop_assert_eq!(b.finish().unwrap(), expected.clone());
        }
        prop_assert_eq!(by_walk.finish().unwrap(), expected);
    }
}

/// A range continuing exactly where single pushes into the same plan stopped merges with them,
/// and single pushes after it merge with it: the cursor's view of the plan's tail and the range
/// path's agree, whichever went last. (Random ranges rarely line up like this.)
#[test]
fn ranges_and_single_pushes_into_one_plan_merge_across_each_other() {
    let (registry, arena, dsts) = setup();
    let rules = Rules { max_segment: u64::MAX, refuse_modulo: None };
    // One object of 8 adjacent pages starting at arena page 4 (the destination holds 8).
    let pages: Vec<u64> = (4..12).map(|p| p * PAGE).collect();
    let walk = PageWalk::new(&pages, PAGE, 8 * PAGE).unwrap();
    let tag = Tag::new(7);
    let single = |b: &mut IncrementalBuilder<Rules>, offset: u64, len: u64| {
        walk.walk(offset, len, offset, |p| {
            b.push(Fragment::new(arena, p.tier_offset, dsts[0], p.dst_offset, p.len, tag))
        })
    };
    for order in 0..4 {
        let mut b = IncrementalBuilder::new(rules, registry.clone());
        b.begin_object(tag).unwrap();
        // Four stretches of two pages, alternating single pushes and ranges, starting with
        // either; an unrelated pair in between when `order` is odd (the cursor leaves).
        for stretch in 0..4u64 {
            let (offset, len) = (stretch * 2 * PAGE, 2 * PAGE);
            if (stretch + order) % 2 == 0 {
                single(&mut b, offset, len).unwrap();
            } else {
                b.push_walk(arena, dsts[0], &walk, offset, len, offset, tag).unwrap();
            }
            if order % 2 == 1 {
                b.push(Fragment::new(arena, 0, dsts[1], stretch * 8, 8, tag)).unwrap();
            }
        }
        b.commit_object().unwrap();
        let plans = b.finish().unwrap();
        let plan = plans.plans().iter().find(|p| p.dst() == dsts[0]).unwrap();
        let whole = umbp_plan::Segment { src_offset: 4 * PAGE, dst_offset: 0, len: 8 * PAGE };
        assert_eq!(plan.segments(), [whole], "order {order}");
    }
}
