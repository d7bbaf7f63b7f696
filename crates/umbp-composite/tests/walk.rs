//! `CompositeBuilder::push_walk` against the page walk feeding `push` one fragment at a time:
//! for random paged objects and ranges into host memory (the host copy engine), device memory
//! (the device engine) and an endpoint nobody registered, some ranges past the end of their
//! destination, both give the same routed plans and the same rejections.

mod support;

use proptest::prelude::*;
use support::*;
use umbp_plan::{EndpointId, Fragment, PageWalk, Tag};

const PAGE: u64 = 512;
const TIER_PAGES: u64 = 32;

#[derive(Clone, Debug)]
struct Object {
    pages: Vec<u64>,
    size: u64,
    /// (object offset, length, destination index, destination offset, layer group)
    ranges: Vec<(u64, u64, usize, u64, u32)>,
}

fn object() -> impl Strategy<Value = Object> {
    (1u64..5, 0u64..PAGE).prop_flat_map(|(pages, short)| {
        let size = pages * PAGE - short;
        let range = (0..size, 1..size + 1, 0usize..3, 0u64..6 * PAGE, 0u32..2);
        (
            proptest::collection::vec(0..TIER_PAGES, pages as usize),
            proptest::collection::vec(range, 1..4),
        )
            .prop_map(move |(pages, ranges)| Object {
                pages: pages.into_iter().map(|p| p * PAGE).collect(),
                size,
                ranges: ranges
                    .into_iter()
                    .map(|(o, l, d, at, g)| (o, l.min(size - o).max(1), d, at, g))
                    .collect(),
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn push_walk_routes_exactly_as_pushing_each_fragment(
        objects in proptest::collection::vec(object(), 1..6),
    ) {
        let rig = Rig::new();
        let mut tier = pattern((TIER_PAGES * PAGE) as usize, 1);
        let mut host = vec![0u8; (4 * PAGE) as usize];
        let tier_id = rig.host(&mut tier);
        let device = rig.device(4 * PAGE);
        let destinations = [rig.host(&mut host), device.id, EndpointId::from_raw(9999)];
        let mut by_walk = rig.composite.builder();
        let mut by_push = rig.composite.builder();
        for (i, o) in objects.iter().enumerate() {
            let tag = Tag::new(i as u32);
            let walk = PageWalk::new(&o.pages, PAGE, o.size).unwrap();
            by_walk.begin_object(tag).unwrap();
            by_push.begin_object(tag).unwrap();
            for &(offset, len, d, at, group) in &o.ranges {
                by_walk.set_group(group);
                by_push.set_group(group);
                let _ = by_walk.push_walk(tier_id, destinations[d], &walk, offset, len, at);
                let _ = walk.walk(offset, len, at, |p| {
                    by_push.push(Fragment::new(tier_id, p.tier_offset, destinations[d], p.dst_offset, p.len, tag))
                });
            }
            by_walk.commit_object().unwrap();
            by_push.commit_object().unwrap();
        }
        let (walked, pushed) = (by_walk.finish().unwrap(), by_push.finish().unwrap());
        prop_assert_eq!(walked.rejected(), pushed.rejected());
        // Ranges that write the same bytes twice fail the overlap rule, both ways alike.
        prop_assert_eq!(walked.failed(), pushed.failed());
        prop_assert_eq!(walked.parts().len(), pushed.parts().len());
        for (w, p) in walked.parts().iter().zip(pushed.parts()) {
            prop_assert_eq!((w.group, w.engine), (p.group, p.engine));
            prop_assert_eq!(&w.plans, &p.plans);
        }
        prop_assert!(
            !walked.parts().is_empty() || !walked.rejected().is_empty() || !walked.failed().is_empty()
        );
    }
}
