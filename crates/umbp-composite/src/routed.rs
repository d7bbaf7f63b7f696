//! What a composite builder hands the engine: each engine's plans per layer group, and the
//! fragments of the staged route.

use std::sync::Arc;
use std::time::Instant;

use umbp_plan::{DeviceStream, Error, Failure, Fragment, GroupListener, PlanSet, Tag};

/// A fragment that takes the staged route: two hops through the bounce region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StagedFragment {
    /// The fragment as the caller pushed it.
    pub fragment: Fragment,
    /// Engine of the first hop.
    pub read: usize,
    /// Engine of the second hop.
    pub write: usize,
    /// The layer group it belongs to.
    pub group: u32,
}

/// One engine's share of one layer group of a batch.
#[derive(Debug)]
pub struct RoutedPart {
    /// The layer group.
    pub group: u32,
    /// The engine's position in the composite.
    pub engine: usize,
    /// The engine's plans, built by the engine's own builder.
    pub plans: PlanSet,
}

/// Everything a composite builder produced for one batch, ready for
/// [`CompositeEngine::submit`](crate::CompositeEngine::submit). Only a builder makes one, and only the composite whose builder
/// made it accepts it.
#[derive(Default)]
pub struct RoutedPlans {
    pub(crate) composite: u64,
    pub(crate) parts: Vec<RoutedPart>,
    pub(crate) staged: Vec<StagedFragment>,
    /// Every object of the batch, in the order it was begun (rolled-back objects are not).
    pub(crate) objects: Vec<Tag>,
    /// Every rejected object, from routing and from every engine's builder, with its reason.
    pub(crate) rejected: Vec<(Tag, Error)>,
    /// Objects failed before anything runs: those that break the overlap rule.
    pub(crate) failed: Vec<Failure>,
    pub(crate) listener: Option<Arc<dyn GroupListener>>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) stream: Option<DeviceStream>,
    /// The batch stays out of the metrics ([`CompositeBuilder::set_metered`](crate::CompositeBuilder::set_metered)).
    pub(crate) unmetered: bool,
}

impl RoutedPlans {
    /// Each engine's plans per layer group.
    pub fn parts(&self) -> &[RoutedPart] {
        &self.parts
    }

    /// Fragments for the staged route.
    pub fn staged(&self) -> &[StagedFragment] {
        &self.staged
    }

    /// The batch's objects, in the order they were begun.
    pub fn objects(&self) -> &[Tag] {
        &self.objects
    }

    /// The rejected objects with the reason of each.
    pub fn rejected(&self) -> &[(Tag, Error)] {
        &self.rejected
    }

    /// Objects that fail before anything runs: those whose bytes break the overlap rule
    /// across the batch (see [`CompositeBuilder::finish`](crate::CompositeBuilder::finish)), one failure per object, from
    /// engine `composite` with [`FailureCause::Overlap`](umbp_plan::FailureCause::Overlap). Nothing of them is in any plan.
    pub fn failed(&self) -> &[Failure] {
        &self.failed
    }

    /// When the batch must be over (see [`CompositeBuilder::set_deadline`](crate::CompositeBuilder::set_deadline)).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether there is nothing to execute and nothing rejected.
    pub fn is_empty(&self) -> bool {
        self.parts.iter().all(|p| p.plans.plans().is_empty())
            && self.staged.is_empty()
            && self.rejected.is_empty()
            && self.failed.is_empty()
    }
}

impl std::fmt::Debug for RoutedPlans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoutedPlans")
            .field("parts", &self.parts)
            .field("staged", &self.staged)
            .field("objects", &self.objects)
            .field("rejected", &self.rejected)
            .field("failed", &self.failed)
            .field("listener", &self.listener.is_some())
            .field("deadline", &self.deadline)
            .field("stream", &self.stream)
            .field("unmetered", &self.unmetered)
            .finish()
    }
}
