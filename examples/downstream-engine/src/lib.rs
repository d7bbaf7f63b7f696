//! A downstream engine: host-to-host copies, planned by umbp-plan's incremental builder and
//! executed one segment at a time. It exists to show (and test) that an engine from another
//! crate plugs into the composite with nothing but the public `umbp-plan` API.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use umbp_plan::{
    plan_batch, Endpoint, EndpointId, EndpointRegistry, EndpointRelease, Failure, FailureCause,
    Fragment, IncrementalBuilder, PlanBuilder, PlanRules, PlanSet, Register, RegisterError,
    TransferEngine, TransferHandle,
};

/// Carries host to host.
#[derive(Copy, Clone, Debug, Default)]
pub struct HostPairs;

impl PlanRules for HostPairs {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }
}

/// The downstream engine; counts the segments it executed.
pub struct DownstreamEngine {
    registry: Arc<EndpointRegistry>,
    segments: AtomicU64,
}

impl DownstreamEngine {
    /// An engine naming endpoints in `registry`.
    pub fn new(registry: Arc<EndpointRegistry>) -> Self {
        Self { registry, segments: AtomicU64::new(0) }
    }

    /// Segments executed so far.
    pub fn segments(&self) -> u64 {
        // Relaxed: a statistic, read after the submits that counted it returned.
        self.segments.load(Ordering::Relaxed)
    }
}

/// Registration as with every umbp engine: this engine prepares nothing per endpoint, so it
/// needs no release either.
impl Register for DownstreamEngine {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    fn prepare(
        &self,
        _: EndpointId,
        _: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        Ok(None)
    }
}

impl TransferEngine for DownstreamEngine {
    fn name(&self) -> &str {
        "downstream"
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        HostPairs.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&HostPairs, &self.registry.snapshot(), fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(IncrementalBuilder::new(HostPairs, self.registry.clone()))
    }

    fn submit(&self, plans: PlanSet) -> TransferHandle {
        let mut failures = Vec::new();
        for plan in plans.plans() {
            let (Some(src), Some(dst)) =
                (self.registry.get(plan.src()), self.registry.get(plan.dst()))
            else {
                failures.push(Failure {
                    engine: self.name().into(),
                    src: plan.src(),
                    dst: plan.dst(),
                    tags: plan.tags().to_vec(),
                    cause: FailureCause::EndpointGone(plan.src()),
                });
                continue;
            };
            for s in plan.segments() {
                if !src.contains(s.src_offset, s.len) || !dst.contains(s.dst_offset, s.len) {
                    continue;
                }
                let from = (src.addr() + s.src_offset) as *const u8;
                let to = (dst.addr() + s.dst_offset) as *mut u8;
                // SAFETY: both ranges lie inside host endpoints (checked above), which their
                // registration promised valid and not otherwise accessed during the transfer.
                #[allow(unsafe_code)]
                unsafe {
                    std::ptr::copy(from, to, s.len as usize)
                };
                // Relaxed: a statistic.
                self.segments.fetch_add(1, Ordering::Relaxed);
            }
        }
        TransferHandle::settled(failures, plans)
    }
}

#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
