//! What the engine carries, and its plan builder.

use umbp_plan::{Endpoint, IncrementalBuilder, PlanRules};

/// The planning rules of the local copy engine: host memory to host memory, any alignment,
/// segments of any length.
///
/// Device and file endpoints are refused: a fragment that names one poisons its object with
/// [`RejectReason::PairNotHandled`](umbp_plan::RejectReason::PairNotHandled).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalCopyRules;

impl PlanRules for LocalCopyRules {
    #[inline]
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.is_host()
    }
}

/// The engine's incremental plan builder: the `umbp-plan` incremental core under
/// [`LocalCopyRules`].
///
/// Holding the concrete type (from
/// [`LocalCopyEngine::incremental_builder`](crate::LocalCopyEngine::incremental_builder))
/// rather than the boxed trait object gives the inlined `push` and the run fast path
/// ([`begin_run`](IncrementalBuilder::begin_run), [`Run::push_walk`](umbp_plan::Run::push_walk)).
pub type LocalCopyBuilder = IncrementalBuilder<LocalCopyRules>;
