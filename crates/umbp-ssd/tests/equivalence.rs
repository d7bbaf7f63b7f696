//! The equivalence property (docs/ARCHITECTURE.md, "Equivalence") on the engine's own builder: for
//! any stream of fragments between file and host endpoints (plus pairs the engine refuses), with
//! any mix of commits, rollbacks and invalid fragments, `finish()` equals the engine's batch
//! planner over the committed objects, and the plans write the same bytes as the fragments one by
//! one.

use proptest::prelude::*;
use umbp_plan::testing::{drive, scenarios, ReferenceMemory, Scenario, ScenarioConfig};
use umbp_plan::{DeviceOrdinal, EndpointKind, EndpointRegistry, FileRange, TransferEngine};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

/// Files as sources and destinations, host memory on the other side, and a device destination
/// the engine refuses. Destination `d` receives from source `d % 2`: file -> host, host ->
/// file, file -> host, host -> device.
fn config(max_fragment: u64, invalid_percent: u32) -> ScenarioConfig {
    let file = |fd| EndpointKind::File(FileRange { fd, file_offset: 4096, direct: true });
    ScenarioConfig {
        sources: vec![file(3), EndpointKind::Host],
        destinations: vec![
            EndpointKind::Host,
            file(4),
            EndpointKind::Host,
            EndpointKind::Device(DeviceOrdinal::new(0)),
        ],
        max_fragment,
        invalid_percent,
        ..ScenarioConfig::default()
    }
}

fn check(scenario: &Scenario, max_segment: u64) {
    let registry = EndpointRegistry::new();
    // SAFETY: the plans are compared and run by the reference executor only, never submitted.
    unsafe { scenario.register_invented(&registry) };
    let config =
        SsdConfig { max_segment, backend: Backend::Blocking, workers: 1, ..SsdConfig::default() };
    let engine = SsdEngine::new(registry, config).expect("engine");

    let mut builder = engine.builder();
    let outcome = drive(&mut *builder, scenario).expect("no builder misuse");
    let expected = engine.plan(&outcome.committed);
    assert_eq!(outcome.plans, expected, "the builder differs from the batch planner");
    ReferenceMemory::assert_same_bytes(scenario, &outcome);

    // A recycled builder plans the same scenario the same way.
    builder.recycle(outcome.plans);
    let again = drive(&mut *builder, scenario).expect("no builder misuse");
    assert_eq!(again.plans, expected, "a recycled builder differs");
    for plan in expected.plans() {
        assert!(plan.segments().iter().all(|s| s.len <= max_segment));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn builder_equals_batch_planner(scenario in scenarios(config(96, 5))) {
        check(&scenario, SsdConfig::DEFAULT_MAX_SEGMENT);
    }

    #[test]
    fn builder_equals_batch_planner_with_a_small_segment_cap(
        scenario in scenarios(config(48, 5)),
        max_segment in 48u64..200,
    ) {
        check(&scenario, max_segment);
    }

    #[test]
    fn builder_equals_batch_planner_with_many_invalid_fragments(
        scenario in scenarios(config(96, 30)),
    ) {
        check(&scenario, SsdConfig::DEFAULT_MAX_SEGMENT);
    }
}

/// The generated scenarios do exercise both directions (and the refused pair).
#[test]
fn scenarios_plan_restores_and_offloads() {
    let (mut restores, mut offloads, mut rejected) = (0, 0, 0);
    for seed in 0..32 {
        let scenario = Scenario::generate(seed, &config(96, 5));
        let registry = EndpointRegistry::new();
        // SAFETY: the plans are inspected only, never submitted.
        unsafe { scenario.register_invented(&registry) };
        let engine = SsdEngine::new(
            registry.clone(),
            SsdConfig { backend: Backend::Blocking, ..SsdConfig::default() },
        )
        .expect("engine");
        let outcome = drive(&mut *engine.builder(), &scenario).expect("no builder misuse");
        for plan in outcome.plans.plans() {
            let src = registry.get(plan.src()).expect("registered");
            if src.file_range().is_some() {
                restores += 1;
            } else {
                offloads += 1;
            }
        }
        rejected += outcome.plans.rejected().len();
    }
    assert!(restores > 0 && offloads > 0 && rejected > 0, "{restores} {offloads} {rejected}");
}
