//! The composite engine: engines in preference order, registration fan-out, concurrent submit,
//! and the staged route through a bounce region.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use umbp_plan::{
    BufferedPlanBuilder, Endpoint, EndpointId, EndpointRegistry, Failure, FailureCause, Fragment,
    PlanBuilder, PlanSet, Tag, TransferEngine,
};

use crate::builder::{RoutedPart, RoutedPlans, StagedFragment};
use crate::metrics::{direction, Metrics, MetricsSnapshot};
use crate::{CompositeBuilder, Error};

/// The staged route's configuration: a registered host region that carries bytes between two
/// engines when no single engine claims a pair (SSD to device memory, say).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Staging {
    /// The bounce region: a registered host endpoint, pinned for the device engine if the
    /// second hop should use its gather kernel. Only the composite may use it.
    pub bounce: EndpointId,
    /// Bytes one pipeline stage moves at most. The region is used as two halves, so a stage is
    /// also at most half of it. Default in [`Staging::new`]: 8 MiB.
    pub stage_bytes: u64,
}

impl Staging {
    /// Staging through `bounce` in stages of at most 8 MiB.
    pub const fn new(bounce: EndpointId) -> Self {
        Self { bounce, stage_bytes: 8 << 20 }
    }
}

/// Holds engines in preference order and routes every fragment to the first that claims it;
/// see the [crate docs](crate).
pub struct CompositeEngine {
    engines: Vec<Arc<dyn TransferEngine>>,
    registry: Arc<EndpointRegistry>,
    staging: Option<Staging>,
    buffered: bool,
    metrics: Metrics,
}

/// What a submit did: every failure, and the plans back for [`CompositeBuilder::recycle`].
#[derive(Debug, Default)]
pub struct Outcome {
    /// Every failure of every engine (and of the staged route).
    pub failures: Vec<Failure>,
    /// The executed plans.
    pub plans: RoutedPlans,
}

impl Outcome {
    /// The objects that failed while executing (rejected objects are in
    /// `plans.rejected`), each once.
    pub fn failed_tags(&self) -> Vec<Tag> {
        let mut seen = HashSet::new();
        self.failures.iter().flat_map(|f| &f.tags).copied().filter(|t| seen.insert(*t)).collect()
    }
}

impl CompositeEngine {
    /// A composite over `engines`, in preference order, naming endpoints in `registry`. The
    /// engines must name endpoints in the same registry.
    pub fn new(registry: Arc<EndpointRegistry>, engines: Vec<Arc<dyn TransferEngine>>) -> Self {
        Self { engines, registry, staging: None, buffered: false, metrics: Metrics::default() }
    }

    /// Gives every engine the buffered builder (collect, then plan at finish) instead of its
    /// own: the baseline the incremental path is measured against.
    pub fn with_buffered_builders(mut self) -> Self {
        self.buffered = true;
        self
    }

    /// Engine `i`'s builder: its own, or the buffered baseline.
    pub(crate) fn engine_builder(&self, i: usize) -> Box<dyn PlanBuilder + Send + '_> {
        let engine: &dyn TransferEngine = &*self.engines[i];
        if self.buffered {
            Box::new(BufferedPlanBuilder::new(engine))
        } else {
            engine.builder()
        }
    }

    /// Enables the staged route through `staging.bounce`, which must be a registered host
    /// endpoint.
    pub fn with_staging(mut self, staging: Staging) -> Result<Self, Error> {
        match self.registry.get(staging.bounce) {
            Some(e) if e.is_host() && e.len() >= 2 => {
                self.staging = Some(staging);
                Ok(self)
            }
            _ => Err(Error::BadBounce(staging.bounce)),
        }
    }

    /// The engines, in preference order.
    pub fn engines(&self) -> &[Arc<dyn TransferEngine>] {
        &self.engines
    }

    /// The shared registry.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    /// The bounce region of the staged route, if configured.
    pub fn bounce(&self) -> Option<EndpointId> {
        self.staging.map(|s| s.bounce)
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Counters per engine and direction.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// A builder that routes fragments into the engines' own builders. Reuse it across
    /// batches (with [`CompositeBuilder::recycle`]).
    pub fn builder(&self) -> CompositeBuilder<'_> {
        CompositeBuilder::new(self)
    }

    /// Registers an endpoint and tells every engine (each once); if one refuses, the engines
    /// told so far forget it again and the registration is undone.
    ///
    /// # Safety
    ///
    /// As [`EndpointRegistry::register`]: a memory endpoint must stay valid until it is
    /// deregistered and every transfer that used it has been waited on.
    #[allow(unsafe_code)] // Forwards the registry's obligation; dereferences nothing.
    pub unsafe fn register(&self, endpoint: Endpoint) -> Result<EndpointId, Error> {
        // SAFETY: the caller's contract is the registry's.
        let id = unsafe { self.registry.register(endpoint) };
        self.fan_out(id, &endpoint)?;
        Ok(id)
    }

    /// Registers a file range and tells every engine.
    pub fn register_file(
        &self,
        fd: i32,
        file_offset: u64,
        len: u64,
        direct: bool,
    ) -> Result<EndpointId, Error> {
        let id = self.registry.register_file(fd, file_offset, len, direct);
        let endpoint = Endpoint::file(fd, file_offset, len, direct);
        self.fan_out(id, &endpoint)?;
        Ok(id)
    }

    /// Tells every engine that `id` goes, then deregisters it.
    pub fn deregister(&self, id: EndpointId) -> Result<(), Error> {
        if self.registry.get(id).is_none() {
            return Err(Error::UnknownEndpoint(id));
        }
        for e in &self.engines {
            e.endpoint_deregistering(id);
        }
        self.registry.deregister(id).map(drop).map_err(|_| Error::UnknownEndpoint(id))
    }

    fn fan_out(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), Error> {
        for (i, e) in self.engines.iter().enumerate() {
            if let Err(source) = e.endpoint_registered(id, endpoint) {
                for told in &self.engines[..i] {
                    told.endpoint_deregistering(id);
                }
                let _ = self.registry.deregister(id);
                return Err(Error::Engine { engine: e.name().to_string(), id, source });
            }
        }
        Ok(())
    }

    /// Executes a batch: every engine's plans at once, each engine on its own thread so that
    /// host copies, device copies and SSD reads overlap, plus the staged route; then gathers
    /// every failure. An engine that panics fails all the tags of its plans.
    pub fn submit(&self, plans: RoutedPlans) -> Outcome {
        let span = tracing::info_span!(
            "umbp.submit",
            parts = plans.parts.len(),
            staged = plans.staged.len()
        );
        let _enter = span.enter();
        let RoutedPlans { parts, staged, rejected } = plans;
        let mut failures = Vec::new();
        let mut done_parts = Vec::new();
        std::thread::scope(|scope| {
            let running: Vec<_> = parts
                .into_iter()
                .map(|part| {
                    let tags: Vec<Tag> =
                        part.plans.plans().iter().flat_map(|p| p.tags()).copied().collect();
                    let engine = part.engine;
                    let worker = scope.spawn(move || self.run_part(part));
                    (engine, tags, worker)
                })
                .collect();
            if !staged.is_empty() {
                failures.extend(self.run_staged(&staged));
            }
            for (engine, tags, worker) in running {
                match worker.join() {
                    Ok((part, part_failures)) => {
                        failures.extend(part_failures);
                        done_parts.push(part);
                    }
                    Err(_) => {
                        let name = self.engines[engine].name();
                        tracing::error!(engine = name, "engine panicked while executing");
                        failures.push(Failure {
                            engine: name.to_string(),
                            src: EndpointId::from_raw(u32::MAX),
                            dst: EndpointId::from_raw(u32::MAX),
                            tags,
                            cause: FailureCause::NotAccepted(format!(
                                "engine {name} panicked while executing"
                            )),
                        });
                    }
                }
            }
        });
        done_parts.sort_by_key(|p| p.engine);
        Outcome { failures, plans: RoutedPlans { parts: done_parts, staged, rejected } }
    }

    /// Submits one engine's part, waits, and records metrics.
    fn run_part(&self, part: RoutedPart) -> (RoutedPart, Vec<Failure>) {
        let engine = &self.engines[part.engine];
        let span = tracing::info_span!("umbp.engine", engine = engine.name());
        let _enter = span.enter();
        let t = Instant::now();
        let settled = engine.submit(part.plans).into_settled();
        let seconds = t.elapsed().as_secs_f64();
        self.record(engine.name(), &settled.plans, &settled.failures, seconds);
        (RoutedPart { engine: part.engine, plans: settled.plans }, settled.failures)
    }

    fn record(&self, engine: &str, plans: &PlanSet, failures: &[Failure], seconds: f64) {
        let total = plans.bytes().max(1) as f64;
        for plan in plans.plans() {
            let (Some(s), Some(d)) = (self.registry.get(plan.src()), self.registry.get(plan.dst()))
            else {
                continue;
            };
            let failed =
                failures.iter().filter(|f| f.src == plan.src() && f.dst == plan.dst()).count();
            self.metrics.record(engine, direction(&s, &d), |c| {
                c.operations += plan.segment_count() as u64;
                c.bytes += plan.bytes();
                c.seconds += seconds * plan.bytes() as f64 / total;
                c.failures += failed as u64;
            });
        }
    }

    /// Moves staged fragments in two hops through the bounce region, in stages that alternate
    /// between its two halves: the second hop of one stage overlaps the first hop of the next.
    /// A fragment whose first hop failed never takes the second, and every failure names the
    /// objects of the failed fragments.
    fn run_staged(&self, staged: &[StagedFragment]) -> Vec<Failure> {
        let Some(staging) = self.staging else {
            return Vec::new();
        };
        let Some(bounce) = self.registry.get(staging.bounce) else {
            let tags = staged.iter().map(|s| s.fragment.tag).collect();
            return vec![Failure {
                engine: "staged".into(),
                src: staging.bounce,
                dst: staging.bounce,
                tags,
                cause: FailureCause::EndpointGone(staging.bounce),
            }];
        };
        let half = (bounce.len() / 2).min(staging.stage_bytes).max(1);
        let stages = stage(staged, half);
        let mut failures = Vec::new();
        let mut failed_tags: HashSet<Tag> = HashSet::new();
        let mut pending: Option<(usize, Vec<(StagedFragment, u64)>)> = None;
        let nothing = HashSet::new();
        for (k, current) in stages.into_iter().enumerate() {
            let previous = pending.take();
            // The second hop of the previous stage (one half of the region) alongside the first
            // hop of this one (the other half).
            let (first, second) = std::thread::scope(|scope| {
                let second = previous.as_ref().map(|(pk, prev)| {
                    let skip = &failed_tags;
                    scope.spawn(move || {
                        self.hop(prev, staging.bounce, base_of(*pk, half), false, skip)
                    })
                });
                let first = self.hop(&current, staging.bounce, base_of(k, half), true, &nothing);
                (first, second.map(|h| h.join().unwrap_or_default()))
            });
            for f in first.iter().chain(second.iter().flatten()) {
                failed_tags.extend(f.tags.iter().copied());
            }
            failures.extend(first);
            failures.extend(second.into_iter().flatten());
            pending = Some((k, current));
        }
        if let Some((k, last)) = pending {
            failures.extend(self.hop(&last, staging.bounce, base_of(k, half), false, &failed_tags));
        }
        failures
    }

    /// One hop of one stage: the first (source to bounce) or the second (bounce to
    /// destination), skipping fragments of objects in `skip`.
    fn hop(
        &self,
        stage: &[(StagedFragment, u64)],
        bounce: EndpointId,
        base: u64,
        first: bool,
        skip: &HashSet<Tag>,
    ) -> Vec<Failure> {
        let Some(s) = stage.first() else { return Vec::new() };
        let index = if first { s.0.read } else { s.0.write };
        let engine = &self.engines[index];
        let mut builder = self.engine_builder(index);
        let mut rejected = Vec::new();
        for (sf, at) in stage.iter().filter(|(sf, _)| !skip.contains(&sf.fragment.tag)) {
            let f = sf.fragment;
            let hop = if first {
                Fragment::new(f.src, f.src_offset, bounce, base + at, f.len, f.tag)
            } else {
                Fragment::new(bounce, base + at, f.dst, f.dst_offset, f.len, f.tag)
            };
            let planned = builder.begin_object(f.tag).is_ok() && builder.push(hop).is_ok();
            let closed = builder.commit_object().is_ok();
            if !(planned && closed) {
                rejected.push(f.tag);
            }
        }
        let mut failures = match builder.finish() {
            Ok(plans) => {
                rejected.extend_from_slice(plans.rejected());
                let t = Instant::now();
                let settled = engine.submit(plans).into_settled();
                self.record(
                    engine.name(),
                    &settled.plans,
                    &settled.failures,
                    t.elapsed().as_secs_f64(),
                );
                settled.failures
            }
            Err(e) => vec![Failure {
                engine: engine.name().to_string(),
                src: bounce,
                dst: bounce,
                tags: stage.iter().map(|(sf, _)| sf.fragment.tag).collect(),
                cause: FailureCause::NotAccepted(e.to_string()),
            }],
        };
        if !rejected.is_empty() {
            failures.push(Failure {
                engine: engine.name().to_string(),
                src: bounce,
                dst: bounce,
                tags: rejected,
                cause: FailureCause::NotAccepted("staged hop refused by its engine".into()),
            });
        }
        failures
    }
}

/// Where stage `k` sits in the bounce region: alternating halves.
fn base_of(k: usize, half: u64) -> u64 {
    (k as u64 % 2) * half
}

/// Cuts staged fragments into stages of at most `half` bytes, each fragment with its offset
/// inside its stage; a fragment longer than a stage is cut into pieces of the same object.
fn stage(staged: &[StagedFragment], half: u64) -> Vec<Vec<(StagedFragment, u64)>> {
    let mut stages: Vec<Vec<(StagedFragment, u64)>> = vec![Vec::new()];
    let mut used = 0u64;
    for sf in staged {
        let mut done = 0;
        while done < sf.fragment.len {
            if used == half {
                stages.push(Vec::new());
                used = 0;
            }
            let n = (sf.fragment.len - done).min(half - used);
            let mut piece = *sf;
            piece.fragment.src_offset += done;
            piece.fragment.dst_offset += done;
            piece.fragment.len = n;
            if let Some(s) = stages.last_mut() {
                s.push((piece, used));
            }
            used += n;
            done += n;
        }
    }
    stages.retain(|s| !s.is_empty());
    stages
}
