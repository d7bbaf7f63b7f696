//! The equivalence property (docs/ARCHITECTURE.md, "Equivalence"): for any stream of fragments with
//! any mix of commits, rollbacks and invalid fragments, and fragments longer than the engine's
//! maximum segment (split into pieces), the incremental builder's `finish()` equals the batch
//! planner over the committed objects, the buffered builder agrees, and executing the plans
//! writes the same bytes as executing the fragments one by one.

use proptest::prelude::*;
use umbp_plan::testing::{drive, drive_runs, scenarios, ReferenceMemory, Scenario, ScenarioConfig};
use umbp_plan::{
    BatchPlanner, BufferedPlanBuilder, Endpoint, EndpointRegistry, FailedAt, Fragment,
    IncrementalBuilder, OverlapCheck, PlanBuilder, PlanRules, RejectReason, RulePlanner, Space,
};

/// Host to host only, with an optional segment cap and an optional alignment rule.
#[derive(Clone, Copy, Debug)]
struct Rules {
    max_segment: u64,
    align: u64,
}

impl PlanRules for Rules {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }

    fn max_segment_len(&self) -> u64 {
        self.max_segment
    }

    fn check_fragment(&self, _: &Endpoint, _: &Endpoint, f: &Fragment) -> Result<(), RejectReason> {
        if f.dst_offset % self.align == 0 {
            Ok(())
        } else {
            Err(RejectReason::Misaligned {
                endpoint: f.dst,
                offset: f.dst_offset,
                len: f.len,
                align: self.align,
            })
        }
    }
}

fn check(scenario: &Scenario, rules: Rules) {
    let registry = EndpointRegistry::new();
    // SAFETY: these plans are compared and run by the reference executor only.
    unsafe { scenario.register_invented(&registry) };
    let planner = RulePlanner::new(rules, registry.clone());

    let mut incremental = IncrementalBuilder::new(rules, registry.clone());
    let outcome = drive(&mut incremental, scenario).expect("no builder misuse");
    let expected = planner.plan_batch(&outcome.committed);
    assert_eq!(outcome.plans, expected, "incremental differs from the batch planner");
    // A fragment past the maximum is split, never refused for its length, and no segment
    // passes the maximum.
    for (tag, reason) in expected.rejections() {
        assert!(!matches!(reason, RejectReason::SegmentTooLong { .. }), "{tag:?}: {reason}");
    }
    for plan in expected.plans() {
        assert!(plan.segments().iter().all(|s| s.len <= rules.max_segment), "past the cap");
    }

    let mut buffered = BufferedPlanBuilder::new(planner.clone());
    let buffered_outcome = drive(&mut buffered, scenario).expect("no builder misuse");
    assert_eq!(buffered_outcome.plans, expected, "buffered differs from the batch planner");

    ReferenceMemory::assert_same_bytes(scenario, &outcome);

    let mut runs = IncrementalBuilder::new(rules, registry.clone());
    let run_outcome = drive_runs(&mut runs, scenario).expect("no builder misuse");
    assert_eq!(run_outcome.plans, expected, "runs differ from the batch planner");
    assert_eq!(run_outcome.committed, outcome.committed);

    // A recycled builder plans the same scenario the same way.
    incremental.recycle(outcome.plans);
    let again = drive(&mut incremental, scenario).expect("no builder misuse");
    assert_eq!(again.plans, expected, "a recycled builder differs");
}

/// Taking objects out of a finished plan set, to the byte, gives the batch planner's plans of
/// the kept objects' fragments: identical plans in the same order without a segment cap. With a
/// cap, a plan no longer knows where its fragments began, so where the cap cuts a run of kept
/// pieces it cuts them as the planner cuts the pieces themselves: each plan equals the
/// planner's plan of its kept pieces, and the plan order, the objects of each plan and the
/// bytes moved equal planning the kept fragments.
fn check_retain(scenario: &Scenario, rules: Rules, drop_mask: u64) {
    let registry = EndpointRegistry::new();
    // SAFETY: these plans are compared, never executed.
    unsafe { scenario.register_invented(&registry) };
    let planner = RulePlanner::new(rules, registry.clone());
    let mut incremental = IncrementalBuilder::new(rules, registry.clone());
    let outcome = drive(&mut incremental, scenario).expect("no builder misuse");
    let dropped = |t: umbp_plan::Tag| drop_mask >> (t.get() % 64) & 1 == 1;

    // Every object's pieces add up to its committed bytes in each plan, and each segment's
    // pieces tile it, in order, with the objects `segment_tags` names.
    for (p, plan) in outcome.plans.plans().iter().enumerate() {
        assert_eq!(outcome.plans.tags_at(FailedAt::plan(p)), plan.tags());
        let pieces: u64 =
            (0..plan.tags().len()).flat_map(|k| plan.tag_pieces(k)).map(|s| s.len).sum();
        assert_eq!(pieces, plan.bytes(), "pieces do not tile the plan");
        for (i, segment) in plan.segments().iter().enumerate() {
            let mut at = (segment.src_offset, segment.dst_offset);
            let mut tags = Vec::new();
            assert_eq!(outcome.plans.tags_at(FailedAt::segment(p, i)), plan.segment_tags(i));
            for (tag, piece) in plan.segment_pieces(i) {
                assert_eq!(outcome.plans.tags_at(FailedAt::share(p, i, tag)), [tag]);
                assert_eq!((piece.src_offset, piece.dst_offset), at, "a gap in segment {i}");
                at = (at.0 + piece.len, at.1 + piece.len);
                tags.push(tag);
            }
            assert_eq!(at.0, segment.src_offset + segment.len, "segment {i} not covered");
            assert_eq!(tags, plan.segment_tags(i));
        }
    }

    let mut narrowed = outcome.plans.clone();
    narrowed.retain_tags(|t| !dropped(t));
    let kept: Vec<Fragment> =
        outcome.committed.iter().copied().filter(|f| !dropped(f.tag)).collect();
    let expected = planner.plan_batch(&kept);
    if rules.max_segment == u64::MAX {
        assert_eq!(narrowed.plans(), expected.plans(), "retain_tags differs from planning");
    }
    let tags = |plans: &[umbp_plan::Plan]| -> Vec<_> {
        plans.iter().map(|p| (p.src(), p.dst(), p.tags().to_vec())).collect()
    };
    assert_eq!(tags(narrowed.plans()), tags(expected.plans()), "plan order or objects differ");
    for plan in narrowed.plans() {
        assert!(
            plan.segments().iter().all(|s| s.len <= rules.max_segment),
            "a segment passes the cap"
        );
        // The planner's plan of the kept pieces, each piece one fragment.
        let pieces: Vec<Fragment> = (0..plan.tags().len())
            .flat_map(|k| plan.tag_pieces(k).map(move |s| (plan.tags()[k], s)))
            .map(|(tag, s)| {
                Fragment::new(plan.src(), s.src_offset, plan.dst(), s.dst_offset, s.len, tag)
            })
            .collect();
        assert_eq!(
            planner.plan_batch(&pieces).plans(),
            std::slice::from_ref(plan),
            "pieces differ"
        );
    }
    let mut by_plans = ReferenceMemory::for_scenario(scenario);
    by_plans.execute_plans(&narrowed);
    let mut by_fragments = ReferenceMemory::for_scenario(scenario);
    by_fragments.execute_fragments(&kept, outcome.plans.rejected());
    assert!(by_plans == by_fragments, "retain_tags moves other bytes");
}

/// The overlap check names exactly the planned objects that share a written byte with any
/// fragment of the batch, as checking every pair of committed fragments does.
fn check_overlap(scenario: &Scenario, rules: Rules) {
    let registry = EndpointRegistry::new();
    // SAFETY: these plans are checked, never executed.
    unsafe { scenario.register_invented(&registry) };
    let table = registry.snapshot();
    let locate = |id: umbp_plan::EndpointId| {
        let e = table.get(id)?;
        let space = match e.device_ordinal() {
            Some(d) => Space::Device(d),
            None => Space::Host,
        };
        Some((space, e.addr()))
    };
    let mut builder = IncrementalBuilder::new(rules, registry.clone());
    let outcome = drive(&mut builder, scenario).expect("no builder misuse");
    let planned: Vec<&Fragment> = outcome
        .committed
        .iter()
        .filter(|f| f.len > 0 && !outcome.plans.rejected().contains(&f.tag))
        .collect();
    let mut want = Vec::new();
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i..] {
            let ranges = |f: &Fragment| {
                let (s, d) = (locate(f.src).unwrap(), locate(f.dst).unwrap());
                [(s.0, s.1 + f.src_offset, false), (d.0, d.1 + f.dst_offset, true)]
                    .map(|(space, start, write)| (space, start, start + f.len, write))
            };
            let meet = ranges(a).iter().any(|x| {
                ranges(b).iter().enumerate().any(|(j, y)| {
                    // A fragment's read and write are two accesses; with itself, only the
                    // read against the write counts (j == 1 is its own write).
                    let same = std::ptr::eq(*a, *b);
                    (!same || (!x.3 && j == 1))
                        && x.0 == y.0
                        && x.1.max(y.1) < x.2.min(y.2)
                        && (x.3 || y.3)
                })
            });
            if meet {
                want.extend([a.tag, b.tag]);
            }
        }
    }
    want.sort_unstable();
    want.dedup();
    let got = OverlapCheck::new().conflicts(&outcome.plans, locate);
    assert_eq!(got, want);
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
    fn the_overlap_check_names_exactly_the_objects_that_meet(
        scenario in scenarios(ScenarioConfig::default()),
        max_segment in prop_oneof![Just(u64::MAX), 1u64..20_000],
    ) {
        check_overlap(&scenario, Rules { max_segment, align: 1 });
    }

    #[test]
    fn retaining_tags_equals_planning_without_them(
        scenario in scenarios(ScenarioConfig::default()),
        drop_mask in any::<u64>(),
        max_segment in prop_oneof![Just(u64::MAX), 1u64..20_000],
    ) {
        check_retain(&scenario, Rules { max_segment, align: 1 }, drop_mask);
    }

    #[test]
    fn incremental_equals_batch_planner(scenario in scenarios(ScenarioConfig::default())) {
        check(&scenario, Rules { max_segment: u64::MAX, align: 1 });
    }

    #[test]
    fn equivalence_holds_with_segment_cap_and_alignment(
        scenario in scenarios(ScenarioConfig { max_fragment: 48, ..ScenarioConfig::default() }),
        max_segment in 48u64..200,
        align in prop_oneof![Just(1u64), Just(2u64)],
    ) {
        check(&scenario, Rules { max_segment, align });
    }

    /// Fragments up to 96 bytes against maxima from 1 byte: most fragments are split into
    /// pieces, and pieces of different objects meet and merge.
    #[test]
    fn equivalence_holds_when_fragments_pass_the_segment_cap(
        scenario in scenarios(ScenarioConfig::default()),
        max_segment in prop_oneof![1u64..8, 8u64..96],
        align in prop_oneof![Just(1u64), Just(2u64)],
    ) {
        check(&scenario, Rules { max_segment, align });
    }

    #[test]
    fn equivalence_holds_with_many_invalid_fragments(
        scenario in scenarios(ScenarioConfig { invalid_percent: 30, ..ScenarioConfig::default() }),
    ) {
        check(&scenario, Rules { max_segment: u64::MAX, align: 1 });
    }
}
