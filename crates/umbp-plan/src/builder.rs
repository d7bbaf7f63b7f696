//! The plan-builder trait and the buffered builder every engine gets for free.

use std::sync::Arc;

use crate::batch::plan_batch;
use crate::{
    EndpointId, EndpointRegistry, Error, Fragment, PageWalk, PlanRules, PlanSet, Tag,
    TransferEngine,
};

/// Builds the plan set of one batch, one object at a time.
///
/// The caller opens an object with [`begin_object`](Self::begin_object), pushes its fragments,
/// then either commits it or rolls it back. A fragment the engine cannot carry *poisons* its
/// object: none of the object's fragments reach a plan and its tag lands once in the plan set's
/// rejected tags. [`rollback_object`](Self::rollback_object) restores the builder exactly to its
/// state at `begin_object`, rejected tags included.
///
/// Whatever the implementation, [`finish`](Self::finish) returns exactly what the engine's batch
/// planner returns for the fragments of the committed objects.
pub trait PlanBuilder {
    /// Opens object `tag`. Fails with [`Error::ObjectOpen`] if an object is already open.
    fn begin_object(&mut self, tag: Tag) -> Result<(), Error>;

    /// Adds one fragment of the open object. A zero-length fragment is skipped.
    ///
    /// Errors: [`Error::NoOpenObject`]; [`Error::TagMismatch`] (nothing changes); and, from
    /// builders that validate as they go, [`Error::Rejected`] for the fragment that poisoned the
    /// object and [`Error::ObjectRejected`] for every later push into it.
    fn push(&mut self, fragment: Fragment) -> Result<(), Error>;

    /// Pushes the page fragments of bytes `offset .. offset + len` of the object `walk`
    /// describes, stored in `src` (the walk's tier) and destined for `dst_offset ..` of `dst`,
    /// into open object `tag`: exactly what [`PageWalk::walk`] feeding [`push`](Self::push)
    /// does. A range the walk refuses returns [`Error::Walk`] with nothing pushed.
    ///
    /// The default does just that. The incremental builder overrides it with the path of
    /// [`Run::push_walk`](crate::Run::push_walk), which checks what holds for the whole range
    /// once, so a caller holding any builder (a boxed one, the composite's) gets the fast path
    /// with one call per range.
    #[allow(clippy::too_many_arguments)] // A range: a pair, the walk, three offsets, a tag.
    fn push_walk(
        &mut self,
        src: EndpointId,
        dst: EndpointId,
        walk: &PageWalk<'_>,
        offset: u64,
        len: u64,
        dst_offset: u64,
        tag: Tag,
    ) -> Result<(), Error> {
        walk.walk(offset, len, dst_offset, |page| {
            self.push(Fragment::new(src, page.tier_offset, dst, page.dst_offset, page.len, tag))
        })
    }

    /// Closes the open object, keeping its fragments (or its rejection).
    fn commit_object(&mut self) -> Result<(), Error>;

    /// Closes the open object and undoes everything it did.
    fn rollback_object(&mut self) -> Result<(), Error>;

    /// Returns the batch's plan set and leaves the builder empty, ready for the next batch.
    /// Fails with [`Error::ObjectOpen`] while an object is open.
    fn finish(&mut self) -> Result<PlanSet, Error>;

    /// Hands a plan set's buffers back so that the next batch reuses them instead of allocating.
    fn recycle(&mut self, plans: PlanSet);
}

/// Plans a whole list of fragments at once: the engine's batch planner.
pub trait BatchPlanner {
    /// Plans `fragments`; see [`plan_batch`] for the meaning every planner keeps.
    fn plan_batch(&self, fragments: &[Fragment]) -> PlanSet;
}

impl<E: TransferEngine + ?Sized> BatchPlanner for &E {
    fn plan_batch(&self, fragments: &[Fragment]) -> PlanSet {
        self.plan(fragments)
    }
}

/// A batch planner made from an engine's [`PlanRules`] and the endpoint registry.
#[derive(Clone, Debug)]
pub struct RulePlanner<R> {
    rules: R,
    registry: Arc<EndpointRegistry>,
}

impl<R: PlanRules> RulePlanner<R> {
    /// A planner that checks fragments with `rules` against `registry`'s endpoints.
    pub fn new(rules: R, registry: Arc<EndpointRegistry>) -> Self {
        Self { rules, registry }
    }
}

impl<R: PlanRules> BatchPlanner for RulePlanner<R> {
    fn plan_batch(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&self.rules, &self.registry.snapshot(), fragments)
    }
}

/// Collects fragments and runs a [`BatchPlanner`] at [`finish`](PlanBuilder::finish).
///
/// The default builder of engines without their own, and the baseline every incremental
/// builder is measured against. It validates nothing on `push`: a bad fragment shows up as a
/// rejected tag in the finished plan set.
#[derive(Debug)]
pub struct BufferedPlanBuilder<P> {
    planner: P,
    items: Vec<Fragment>,
    /// The open object and the number of items before it.
    open: Option<(Tag, usize)>,
}

impl<P: BatchPlanner> BufferedPlanBuilder<P> {
    /// A buffered builder that plans with `planner`.
    pub fn new(planner: P) -> Self {
        Self { planner, items: Vec::new(), open: None }
    }
}

impl<P: BatchPlanner> PlanBuilder for BufferedPlanBuilder<P> {
    fn begin_object(&mut self, tag: Tag) -> Result<(), Error> {
        if let Some((open, _)) = self.open {
            return Err(Error::ObjectOpen { open });
        }
        self.open = Some((tag, self.items.len()));
        Ok(())
    }

    fn push(&mut self, fragment: Fragment) -> Result<(), Error> {
        let (object, _) = self.open.ok_or(Error::NoOpenObject)?;
        if fragment.tag != object {
            return Err(Error::TagMismatch { object, fragment: fragment.tag });
        }
        if fragment.len != 0 {
            self.items.push(fragment);
        }
        Ok(())
    }

    fn commit_object(&mut self) -> Result<(), Error> {
        self.open.take().map(drop).ok_or(Error::NoOpenObject)
    }

    fn rollback_object(&mut self) -> Result<(), Error> {
        let (_, start) = self.open.take().ok_or(Error::NoOpenObject)?;
        self.items.truncate(start);
        Ok(())
    }

    fn finish(&mut self) -> Result<PlanSet, Error> {
        if let Some((open, _)) = self.open {
            return Err(Error::ObjectOpen { open });
        }
        let plans = self.planner.plan_batch(&self.items);
        self.items.clear();
        Ok(plans)
    }

    fn recycle(&mut self, _plans: PlanSet) {}
}
