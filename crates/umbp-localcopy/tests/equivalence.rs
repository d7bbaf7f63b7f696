//! The properties every engine keeps (docs/ARCHITECTURE.md), checked on this engine:
//! - its builder (concrete, boxed, and driven through runs) equals its batch planner over the
//!   committed objects, for any stream of fragments, commits, rollbacks and invalid fragments;
//! - random plans executed by the engine over real memory give exactly the bytes of the
//!   reference executor that copies the committed fragments one by one.

mod support;

use proptest::prelude::*;
use support::HostBuf;
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::testing::{
    drive, drive_runs, pattern_byte, scenarios, ReferenceMemory, Scenario, ScenarioConfig, POISON,
};
use umbp_plan::{
    EndpointId, EndpointKind, EndpointRegistry, FailureCause, Fragment, PlanBuilder, Tag,
    TransferEngine,
};

fn builder_equals_planner(scenario: &Scenario) {
    let registry = EndpointRegistry::new();
    // SAFETY: plans built over these invented addresses are compared and run by the reference
    // executor only, never submitted.
    unsafe { scenario.register_invented(&registry) };
    let engine = LocalCopyEngine::with_config(
        registry,
        LocalCopyConfig { threads: 1, ..LocalCopyConfig::default() },
    );

    let mut builder = engine.incremental_builder();
    let outcome = drive(&mut builder, scenario).expect("no builder misuse");
    let expected = engine.plan(&outcome.committed);
    assert_eq!(outcome.plans, expected, "incremental builder differs from the batch planner");
    ReferenceMemory::assert_same_bytes(scenario, &outcome);

    let boxed = drive(engine.builder().as_mut(), scenario).expect("no builder misuse");
    assert_eq!(boxed.plans, expected, "boxed builder differs from the batch planner");

    let runs = drive_runs(&mut engine.incremental_builder(), scenario).expect("no builder misuse");
    assert_eq!(runs.plans, expected, "runs differ from the batch planner");

    // A recycled builder plans the same scenario the same way.
    builder.recycle(outcome.plans);
    let again = drive(&mut builder, scenario).expect("no builder misuse");
    assert_eq!(again.plans, expected, "a recycled builder differs");
}

/// Host-only scenarios over real buffers: fragments up to 600 bytes (so the streaming kernel's
/// 64-byte loop, its 16-byte loop and both plain edges all run) in endpoints of `endpoint_len`
/// bytes. In 8 KiB endpoints most scenarios write some byte twice (the engine must then keep
/// plan order); in 256 KiB ones most do not (the engine spreads them over its threads).
fn host_scenarios(endpoint_len: u64) -> ScenarioConfig {
    ScenarioConfig {
        sources: vec![EndpointKind::Host, EndpointKind::Host],
        destinations: vec![EndpointKind::Host, EndpointKind::Host, EndpointKind::Host],
        endpoint_len,
        max_fragment: 600,
        ..ScenarioConfig::default()
    }
}

fn engine_bytes_equal_reference(scenario: &Scenario, config: LocalCopyConfig) {
    // Real buffers in scenario order: sources hold the pattern, destinations poison. Registered
    // in order into a fresh registry, their ids are the scenario's ids `0 .. n`.
    let registry = EndpointRegistry::new();
    let buffers: Vec<HostBuf> = scenario
        .endpoints
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let id = EndpointId::from_raw(i as u64);
            let len = e.len() as usize;
            let buf = if i < scenario.sources {
                HostBuf::new(len, |k| pattern_byte(id, k as u64))
            } else {
                HostBuf::poisoned(len)
            };
            assert_eq!(buf.register_in(&registry), id);
            buf
        })
        .collect();
    let engine = LocalCopyEngine::with_config(registry, config);

    let outcome = drive(&mut engine.incremental_builder(), scenario).expect("no builder misuse");
    // The overlap rule: objects that write a byte another planned object writes fail whole
    // (sources and destinations are distinct endpoints here, so only writes can meet).
    let planned: Vec<&Fragment> = outcome
        .committed
        .iter()
        .filter(|f| f.len > 0 && !outcome.plans.rejected().contains(&f.tag))
        .collect();
    let mut overlapping = Vec::new();
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i + 1..] {
            let meet = a.dst == b.dst
                && a.dst_offset.max(b.dst_offset)
                    < (a.dst_offset + a.len).min(b.dst_offset + b.len);
            if meet {
                overlapping.extend([a.tag, b.tag]);
            }
        }
    }
    overlapping.sort_unstable();
    overlapping.dedup();
    let mut skipped = outcome.plans.rejected().to_vec();
    skipped.extend_from_slice(&overlapping);
    let mut reference = ReferenceMemory::for_scenario(scenario);
    reference.execute_fragments(&outcome.committed, &skipped);

    let mut handle = engine.submit(outcome.plans);
    let failures = handle.wait();
    assert!(failures.iter().all(|f| f.cause == FailureCause::Overlap), "{failures:?}");
    let mut failed: Vec<Tag> = failures.iter().flat_map(|f| f.tags.iter().copied()).collect();
    failed.sort_unstable();
    failed.dedup();
    assert_eq!(failed, overlapping, "exactly the overlapping objects fail");
    for (i, buf) in buffers.iter().enumerate() {
        let id = EndpointId::from_raw(i as u64);
        let want = reference.get(id).expect("every endpoint has memory");
        assert!(buf.bytes() == want, "endpoint {i} differs from the reference executor");
        if i >= scenario.sources {
            // Sanity: the reference left untouched bytes poisoned, and so did the engine.
            let untouched = want.iter().filter(|&&b| b == POISON).count();
            assert_eq!(buf.bytes().iter().filter(|&&b| b == POISON).count(), untouched);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn builder_equals_batch_planner(scenario in scenarios(ScenarioConfig::default())) {
        builder_equals_planner(&scenario);
    }

    #[test]
    fn builder_equals_batch_planner_with_many_invalid_fragments(
        scenario in scenarios(ScenarioConfig { invalid_percent: 30, ..ScenarioConfig::default() }),
    ) {
        builder_equals_planner(&scenario);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn engine_bytes_equal_the_reference_executor_inline(scenario in scenarios(host_scenarios(8192))) {
        engine_bytes_equal_reference(&scenario, LocalCopyConfig { non_temporal_threshold: 64, ..LocalCopyConfig::default() });
    }

    #[test]
    fn engine_bytes_equal_the_reference_executor_on_the_pool(
        scenario in prop_oneof![scenarios(host_scenarios(8192)), scenarios(host_scenarios(256 << 10))],
        threshold in prop_oneof![Just(1usize), Just(64), Just(2048)],
    ) {
        let config = LocalCopyConfig { threads: 2, parallel_threshold: 0, non_temporal_threshold: threshold, ..LocalCopyConfig::default() };
        engine_bytes_equal_reference(&scenario, config);
    }
}
