//! What the composite's engine hands its executor: the engines, the registry, the staged
//! route's bounce pool and the metrics, shared by every handle and every executor thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use umbp_plan::{
    BufferedPlanBuilder, EndpointId, EndpointRegistry, EndpointRelease, Failure, PlanBuilder,
    PlanSet, TransferEngine,
};

use crate::batch::BatchShared;
use crate::metrics::{direction, moved_by_direction, Metrics};
use crate::routed::StagedFragment;
use crate::staging::BouncePool;

/// What the executor's threads share with the composite.
pub(crate) struct Shared {
    pub(crate) engines: Vec<Arc<dyn TransferEngine>>,
    pub(crate) registry: Arc<EndpointRegistry>,
    /// Set once, by [`CompositeEngine::set_staging`](crate::CompositeEngine::set_staging).
    pub(crate) staging: OnceLock<BouncePool<StageJob>>,
    /// [`CompositeConfig::buffered_builders`](crate::CompositeConfig::buffered_builders).
    pub(crate) buffered: bool,
    pub(crate) metrics: Arc<Metrics>,
}

/// Tells every engine that a registration through the composite ended.
impl EndpointRelease for Shared {
    fn release(&self, id: EndpointId) {
        self.release_in(id, self.engines.len());
    }
}

impl Shared {
    /// Engine `i`'s builder: its own, or the buffered baseline.
    pub(crate) fn engine_builder(&self, i: usize) -> Box<dyn PlanBuilder + Send + '_> {
        engine_builder(&*self.engines[i], self.buffered)
    }

    /// Tells the first `count` engines that registration `id` ended. An engine that panics is
    /// logged and the others are still told, so each releases what it holds (a panic here
    /// would also leave a registration's drop, perhaps while unwinding already).
    pub(crate) fn release_in(&self, id: EndpointId, count: usize) {
        for (i, e) in self.engines[..count].iter().enumerate() {
            if catch_unwind(AssertUnwindSafe(|| e.endpoint_deregistering(id))).is_err() {
                let engine = self.engine_name(i);
                tracing::error!(%engine, endpoint = id.raw(), "an engine panicked releasing an endpoint");
            }
        }
    }

    /// Engine `i`'s name, even if asking the engine panics.
    pub(crate) fn engine_name(&self, i: usize) -> String {
        let engine = &self.engines[i];
        catch_unwind(AssertUnwindSafe(|| engine.name().to_string()))
            .unwrap_or_else(|_| format!("engine {i}"))
    }

    /// The bounce endpoint (only asked for when stages exist).
    pub(crate) fn bounce(&self) -> EndpointId {
        self.staging.get().map_or(EndpointId::from_raw(u64::MAX), |p| p.staging.bounce)
    }

    /// Adds what engine `i` did with a settled plan set to the metrics: per direction (one
    /// update per direction, not per plan), its failures by cause, and the part's latency.
    pub(crate) fn record(
        &self,
        i: usize,
        plans: &PlanSet,
        failures: &[Failure],
        elapsed: std::time::Duration,
    ) {
        let engine = self.engine_name(i);
        let direction_of = |s, d| Some(direction(&self.registry.get(s)?, &self.registry.get(d)?));
        for (dir, segments, bytes, objects) in moved_by_direction(plans, direction_of) {
            self.metrics.record_moved(&engine, dir, segments, bytes, objects);
        }
        self.metrics.record_part(&engine, elapsed);
        self.record_failures_of(&engine, failures);
    }

    /// Counts the failures of engine `i` that no settled plan set reports: those of plans it
    /// panicked with.
    pub(crate) fn record_failures(&self, i: usize, failures: &[Failure]) {
        self.record_failures_of(&self.engine_name(i), failures);
    }

    fn record_failures_of(&self, engine: &str, failures: &[Failure]) {
        for f in failures {
            let (Some(s), Some(d)) = (self.registry.get(f.src), self.registry.get(f.dst)) else {
                continue;
            };
            self.metrics.record_failure(engine, direction(&s, &d), &f.cause);
        }
    }
}

/// `engine`'s own builder, or the buffered baseline.
pub(crate) fn engine_builder(
    engine: &dyn TransferEngine,
    buffered: bool,
) -> Box<dyn PlanBuilder + Send + '_> {
    if buffered {
        Box::new(BufferedPlanBuilder::new(engine))
    } else {
        engine.builder()
    }
}

/// A stage waiting for, or holding, a bounce slot.
pub(crate) struct StageJob {
    pub(crate) shared: Arc<Shared>,
    pub(crate) batch: Arc<BatchShared>,
    pub(crate) part: usize,
    pub(crate) fragments: Vec<StagedFragment>,
}
