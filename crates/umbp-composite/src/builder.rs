//! The composite builder: one object scope over every engine's own builder, per layer group.

use std::collections::{HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Instant;

use umbp_plan::{
    DeviceStream, EndpointId, EndpointTable, Error, Failure, FailureCause, Fragment, GroupListener,
    PageWalk, PlanBuilder, RejectReason, Tag, TransferEngine,
};

use crate::engine::CompositeEngine;
use crate::metrics::direction;
use crate::overlap::BatchOverlap;
use crate::route::{route, Route};
use crate::routed::{RoutedPart, RoutedPlans, StagedFragment};
use crate::shared::engine_builder;

/// The engine label of a rejection no engine gave (`umbp_rejected_objects_total`).
const UNROUTED: &str = "unrouted";

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Scope {
    Closed,
    Open(Tag),
    Poisoned(Tag),
}

/// An engine's plan builder, which borrows the engine.
type EngineBuilder<'a> = Box<dyn PlanBuilder + Send + 'a>;

self_cell::self_cell!(
    /// An engine's plan builder kept beside the `Arc` of the engine it borrows, so that a
    /// composite builder owns what it plans with (no lifetime ties it to the composite).
    struct OwnedBuilder {
        owner: Arc<dyn TransferEngine>,
        #[covariant]
        dependent: EngineBuilder,
    }
);

/// One engine's builder for one layer group.
struct Sub {
    group: u32,
    engine: usize,
    /// `None` once the engine failed to make a builder (it panicked): objects routed here are
    /// rejected.
    builder: Option<OwnedBuilder>,
    /// Whether the open object is open in it.
    open: bool,
    /// The objects begun in it this batch: what a panic of it would lose.
    objects: Vec<Tag>,
    /// Objects a panic of it lost this batch.
    lost: Vec<Tag>,
}

/// The pair, group and route of the last push, so that runs of one pair skip every lookup.
#[derive(Copy, Clone)]
struct LastPush {
    pair: (EndpointId, EndpointId),
    group: u32,
    route: Route,
    /// The sub-builder of a direct route.
    sub: usize,
}

/// Routes each fragment to the first engine that claims its pair and pushes it into that
/// engine's own builder (created on first use, one per layer group), under one object scope:
/// committing, rolling back or rejecting an object does so in every engine and group it
/// touched.
///
/// It keeps the [`PlanBuilder`] protocol (`begin_object`, `push`, `commit_object`,
/// `rollback_object`, `finish`, `recycle`) with the same errors; [`set_group`](Self::set_group)
/// chooses the layer group of the fragments pushed next.
///
/// It owns a handle of its composite (`'static`, `Send`): keep one per planning thread and
/// reuse it across batches, in a struct beside the composite or in a `thread_local!`.
pub struct CompositeBuilder {
    composite: CompositeEngine,
    table: Arc<EndpointTable>,
    subs: Vec<Sub>,
    /// Sub-builders the open object is open in.
    touched: Vec<usize>,
    /// Routes of the pairs seen, pruned of deregistered endpoints as it grows.
    routes: HashMap<(EndpointId, EndpointId), Route>,
    /// The cache's size at which it is next pruned.
    prune_routes_at: usize,
    last: Option<LastPush>,
    group: u32,
    staged: Vec<StagedFragment>,
    staged_at_begin: usize,
    objects: Vec<Tag>,
    seen: HashSet<Tag>,
    rejected: Vec<(Tag, Error)>,
    listener: Option<Arc<dyn GroupListener>>,
    deadline: Option<Instant>,
    stream: Option<DeviceStream>,
    scope: Scope,
    /// When the batch's first object was begun (for the plan-time histogram).
    planning_since: Option<Instant>,
    /// Whether the next batch counts in the metrics.
    metered: bool,
    /// The whole batch's overlap check, its buffers kept for the next batch.
    overlap: BatchOverlap,
    /// The caller's tags of a restore's or offload's objects, by position (their tags here):
    /// what the log names an object by. Empty when the caller's tags are the builder's own.
    caller_tags: Vec<u64>,
}

impl CompositeEngine {
    /// A builder that routes fragments into the engines' own builders. It holds a handle of
    /// the composite (no borrow), so it can be kept anywhere: reuse it across batches (with
    /// [`CompositeBuilder::recycle`]), one per planning thread.
    pub fn builder(&self) -> CompositeBuilder {
        CompositeBuilder::new(self.clone())
    }
}

impl CompositeBuilder {
    fn new(composite: CompositeEngine) -> Self {
        Self {
            table: composite.registry().snapshot(),
            composite,
            subs: Vec::new(),
            touched: Vec::new(),
            routes: HashMap::new(),
            prune_routes_at: ROUTES_KEPT,
            last: None,
            group: 0,
            staged: Vec::new(),
            staged_at_begin: 0,
            objects: Vec::new(),
            seen: HashSet::new(),
            rejected: Vec::new(),
            listener: None,
            deadline: None,
            stream: None,
            scope: Scope::Closed,
            planning_since: None,
            metered: true,
            overlap: BatchOverlap::default(),
            caller_tags: Vec::new(),
        }
    }

    /// The composite this builder plans for.
    pub fn composite(&self) -> &CompositeEngine {
        &self.composite
    }

    /// Whether no object is open and none has been begun since the last `finish`.
    pub fn is_idle(&self) -> bool {
        self.scope == Scope::Closed && self.objects.is_empty() && self.rejected.is_empty()
    }

    /// Puts the fragments pushed from now on into layer group `group` (0 until set; back to 0
    /// after `finish`). The executor starts group `k`'s transfers before group `k + 1`'s on
    /// every engine, and [`Batch::wait_group`](crate::Batch::wait_group) returns once groups up
    /// to `k` have landed. An object may span groups (one range per layer group, say): it
    /// completes when its last group does. May be called inside an object.
    pub fn set_group(&mut self, group: u32) {
        self.group = group;
    }

    /// Tells `listener` of each layer group of the next batch as it settles (see
    /// [`GroupListener`]). Cleared by `finish`, which hands it to the batch.
    pub fn set_group_listener(&mut self, listener: Arc<dyn GroupListener>) {
        self.listener = Some(listener);
    }

    /// Queues the next batch's device work on the caller's `stream` (see [`DeviceStream`]):
    /// each direct part is submitted with it, so the device engine queues the bucket of the
    /// stream's device there, and the part counts as *enqueued* once submitted
    /// ([`Batch::wait_group_enqueued`](crate::Batch::wait_group_enqueued),
    /// [`GroupListener::group_enqueued`]). Work of other engines, and the staged route (whose
    /// bounce slot must be free again before the stage ends), finish on the host first.
    /// Cleared by `finish`, which hands it to the batch.
    pub fn set_stream(&mut self, stream: Option<DeviceStream>) {
        self.stream = stream;
    }

    /// Gives the next batch a deadline: work not started by then settles the moment it passes
    /// (the executor's deadline watcher settles it wherever it waits, whatever the executor's
    /// threads are busy with), its objects failing with
    /// [`FailureCause::TimedOut`](umbp_plan::FailureCause::TimedOut); work running then gets
    /// it as its plan set's [deadline](umbp_plan::PlanSet::deadline), which engines that can
    /// cancel honour (the SSD engine cancels its I/O). Set it before
    /// [`start_restore`](crate::start_restore) / [`start_offload`](crate::start_offload) (or
    /// [`finish`](Self::finish), which they call): the batch they start takes it, and the
    /// builder forgets it.
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// Whether the next batch counts in the composite's [metrics](crate::Metrics) (yes by
    /// default): a probe the caller does not want counted as traffic (reading a few bytes
    /// back to check them, say) turns it off. Back to `true` after `finish`.
    pub fn set_metered(&mut self, metered: bool) {
        self.metered = metered;
    }

    /// Opens object `tag`. Each tag names one object of the batch: a tag already begun (and
    /// not rolled back) in this batch is [`Error::DuplicateTag`].
    pub fn begin_object(&mut self, tag: Tag) -> Result<(), Error> {
        match self.scope {
            Scope::Open(open) | Scope::Poisoned(open) => Err(Error::ObjectOpen { open }),
            Scope::Closed => {
                if !self.seen.insert(tag) {
                    return Err(Error::DuplicateTag { tag });
                }
                if self.planning_since.is_none() {
                    self.planning_since = Some(Instant::now());
                }
                self.objects.push(tag);
                self.scope = Scope::Open(tag);
                self.staged_at_begin = self.staged.len();
                Ok(())
            }
        }
    }

    /// Routes and pushes one fragment of the open object. A fragment no engine claims, or one
    /// the claiming engine refuses, rejects the object in every engine.
    pub fn push(&mut self, f: Fragment) -> Result<(), Error> {
        if f.len == 0 {
            return Ok(());
        }
        let tag = match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Open(tag) if tag != f.tag => {
                return Err(Error::TagMismatch { object: tag, fragment: f.tag })
            }
            Scope::Open(tag) => tag,
        };
        let last = match self.last {
            Some(last) if last.pair == (f.src, f.dst) && last.group == self.group => last,
            _ => self.lookup(f.src, f.dst),
        };
        match last.route {
            Route::Direct(i) => {
                let pushed = self.open_sub(last.sub, tag).and_then(|()| {
                    let sub = &mut self.subs[last.sub];
                    guarded(sub, |b| b.push(f))
                });
                match pushed {
                    Err(Error::Rejected { reason, .. }) => {
                        Err(self.poison(tag, reason, &f, Some(i)))
                    }
                    other => other,
                }
            }
            Route::Staged { read, write } => match self.check_staged(&f, read, write) {
                Ok(()) => {
                    self.staged.push(StagedFragment {
                        fragment: f,
                        read,
                        write,
                        group: self.group,
                    });
                    Ok(())
                }
                Err((reason, engine)) => Err(self.poison(tag, reason, &f, Some(engine))),
            },
            Route::Unrouted => {
                let reason = match (self.table.get(f.src), self.table.get(f.dst)) {
                    (None, _) => RejectReason::UnknownEndpoint(f.src),
                    (_, None) => RejectReason::UnknownEndpoint(f.dst),
                    _ => RejectReason::PairNotHandled { src: f.src, dst: f.dst },
                };
                Err(self.poison(tag, reason, &f, None))
            }
        }
    }

    /// Pushes the page fragments of bytes `offset .. offset + len` of the object `walk`
    /// describes, stored in `src` (the walk's tier) and destined for `dst_offset ..` of `dst`:
    /// what feeding each of them to [`push`](Self::push) does, with the pair routed once for
    /// the whole range and the range handed to the engine's builder in one call
    /// ([`PlanBuilder::push_walk`]: the incremental builder's fast path). A range the walk
    /// refuses returns [`Error::Walk`] with nothing pushed; the caller rejects or rolls back
    /// the object.
    pub fn push_walk(
        &mut self,
        src: EndpointId,
        dst: EndpointId,
        walk: &PageWalk<'_>,
        offset: u64,
        len: u64,
        dst_offset: u64,
    ) -> Result<(), Error> {
        let tag = match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Open(tag) => tag,
        };
        let last = match self.last {
            Some(last) if last.pair == (src, dst) && last.group == self.group => last,
            _ => self.lookup(src, dst),
        };
        let Route::Direct(i) = last.route else {
            // Staged and unrouted pairs take each fragment's own path.
            return walk.walk(offset, len, dst_offset, |page| {
                self.push(Fragment::new(src, page.tier_offset, dst, page.dst_offset, page.len, tag))
            });
        };
        let pushed = self.open_sub(last.sub, tag).and_then(|()| {
            let sub = &mut self.subs[last.sub];
            guarded(sub, |b| b.push_walk(src, dst, walk, offset, len, dst_offset, tag))
        });
        match pushed {
            Err(Error::Rejected { reason, .. }) => {
                let pair = Fragment::new(src, 0, dst, 0, 0, tag);
                Err(self.poison(tag, reason, &pair, Some(i)))
            }
            other => other,
        }
    }

    /// Commits the open object in every engine and group it touched.
    pub fn commit_object(&mut self) -> Result<(), Error> {
        if self.scope == Scope::Closed {
            return Err(Error::NoOpenObject);
        }
        let mut result = Ok(());
        for i in std::mem::take(&mut self.touched) {
            let sub = &mut self.subs[i];
            sub.open = false;
            match guarded(sub, |b| b.commit_object()) {
                // The engine's builder panicked: `guarded` counted the object lost.
                Err(Error::Rejected { .. }) => {}
                other => result = result.and(other),
            }
        }
        self.scope = Scope::Closed;
        result
    }

    /// Rolls the open object back in every engine and group it touched; it is no longer part
    /// of the batch.
    pub fn rollback_object(&mut self) -> Result<(), Error> {
        let tag = match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Open(tag) | Scope::Poisoned(tag) => tag,
        };
        let result = self.rollback_subs();
        self.staged.truncate(self.staged_at_begin);
        if self.scope == Scope::Poisoned(tag) {
            self.rejected.pop();
        }
        self.objects.pop();
        self.seen.remove(&tag);
        self.scope = Scope::Closed;
        result
    }

    /// Closes the open object as rejected for `reason` (a range or page list the caller's own
    /// checks refused, say): nothing of it stays in any engine, and the batch reports it
    /// rejected with `reason`. An object already rejected by a push keeps that push's reason.
    pub fn reject_object(&mut self, reason: Error) -> Result<(), Error> {
        match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Poisoned(_) => {}
            Scope::Open(tag) => {
                let _ = self.rollback_subs();
                self.staged.truncate(self.staged_at_begin);
                if self.metered {
                    // No engine refused it: the caller did, before or between its fragments.
                    let kind = match &reason {
                        Error::Rejected { reason, .. } => reason.kind_name(),
                        _ => "other",
                    };
                    self.composite.metrics().record_rejected(UNROUTED, "unknown", kind);
                }
                self.rejected.push((tag, reason));
            }
        }
        self.scope = Scope::Closed;
        Ok(())
    }

    /// Returns every engine's plans per layer group, the staged fragments, the batch's objects
    /// and every rejected object, and leaves the builder ready for the next batch.
    ///
    /// An object that an engine rejects only here (an engine with a buffered builder validates
    /// at `finish`) is taken out of every other engine's plans too, to the byte, so no byte of
    /// a rejected object is ever written.
    ///
    /// Then the overlap rule ([`OverlapCheck`](umbp_plan::OverlapCheck)) applies to the whole
    /// batch, as each engine applies it to its own plan set: no byte one object writes may be
    /// read or written by another object, whichever engines, layer groups, routes (direct or
    /// staged) and stages carry them. Objects that break it are taken out of every plan and
    /// every stage and fail before anything runs ([`RoutedPlans::failed`]: engine `composite`,
    /// [`FailureCause::Overlap`]); nothing of them is written, and the other objects run as
    /// usual. The check reuses its buffers: a reused builder allocates nothing for it in the
    /// common case.
    ///
    /// An engine's builder that fails here otherwise (breaking its contract) refuses the whole
    /// batch with its error; the builder is still left ready for the next batch.
    pub fn finish(&mut self) -> Result<RoutedPlans, Error> {
        if let Scope::Open(open) | Scope::Poisoned(open) = self.scope {
            return Err(Error::ObjectOpen { open });
        }
        let metered = self.metered;
        let mut out = RoutedPlans {
            composite: self.composite.id(),
            parts: Vec::new(),
            staged: std::mem::take(&mut self.staged),
            objects: std::mem::take(&mut self.objects),
            rejected: std::mem::take(&mut self.rejected),
            failed: Vec::new(),
            listener: self.listener.take(),
            deadline: self.deadline.take(),
            stream: self.stream.take(),
            unmetered: !std::mem::replace(&mut self.metered, true),
        };
        // Objects rejected at push are out of every plan already; seen here so that a rejection
        // found below is not listed twice.
        let mut late: HashSet<Tag> = out.rejected.iter().map(|&(t, _)| t).collect();
        let rejected_at_push = late.len();
        // The first error an engine's builder gave that `finish` may not give (anything but a
        // rejection): the batch is refused with it, once the builder is left clean below.
        let mut broken = None;
        // A rejection found here is counted under the engine whose builder gave it; which
        // pair the object's refused fragment had is not known any more (`unknown` direction).
        let composite = &self.composite;
        let count = |engine: usize, reason: &RejectReason| {
            if metered {
                let name = composite.engine_name(engine);
                composite.metrics().record_rejected(&name, "unknown", reason.kind_name());
            }
        };
        for sub in &mut self.subs {
            match guarded(sub, |b| b.finish()) {
                Ok(plans) => {
                    for (tag, reason) in plans.rejections() {
                        if late.insert(tag) {
                            count(sub.engine, &reason);
                            out.rejected.push((tag, Error::Rejected { tag, reason }));
                        }
                    }
                    if !plans.plans().is_empty() {
                        out.parts.push(RoutedPart { group: sub.group, engine: sub.engine, plans });
                    }
                }
                // Its plans went with the panic; `guarded` counted its objects lost.
                Err(Error::Rejected { .. }) => {}
                // A builder that broke its contract is not trusted with the next batch: the
                // sub gets a fresh one, as after a panic.
                Err(other) => {
                    tracing::error!(engine = sub.engine, %other, "an engine's builder failed finish");
                    sub.builder = None;
                    sub.open = false;
                    broken.get_or_insert(other);
                }
            }
            sub.objects.clear();
            for tag in sub.lost.drain(..) {
                if late.insert(tag) {
                    let reason = RejectReason::BuilderPanicked;
                    count(sub.engine, &reason);
                    out.rejected.push((tag, Error::Rejected { tag, reason }));
                }
            }
        }
        if late.len() > rejected_at_push {
            for part in &mut out.parts {
                part.plans.retain_tags(|t| !late.contains(&t));
            }
            out.parts.retain(|p| !p.plans.plans().is_empty());
            out.staged.retain(|s| !late.contains(&s.fragment.tag));
        }
        let found = self.overlap.conflicts(&out.parts, &out.staged, &self.table);
        if !found.is_empty() {
            let hit = |t: Tag| found.binary_search_by_key(&t, |c| c.0).is_ok();
            for part in &mut out.parts {
                part.plans.retain_tags(|t| !hit(t));
            }
            out.parts.retain(|p| !p.plans.plans().is_empty());
            out.staged.retain(|s| !hit(s.fragment.tag));
            tracing::debug!(objects = found.len(), "objects overlapping across the batch excluded");
            out.failed = found
                .iter()
                .map(|&(tag, src, dst)| Failure {
                    engine: "composite".into(),
                    src,
                    dst,
                    tags: vec![tag],
                    cause: FailureCause::Overlap,
                })
                .collect();
        }
        out.parts.sort_by_key(|p| (p.group, p.engine));
        self.staged_at_begin = 0;
        self.caller_tags.clear();
        self.seen.clear();
        self.group = 0;
        self.last = None;
        self.table = self.composite.registry().snapshot();
        if let Some(since) = self.planning_since.take().filter(|_| !out.unmetered) {
            self.composite.metrics().record_plan(since.elapsed());
        }
        match broken {
            Some(error) => Err(error),
            None => Ok(out),
        }
    }

    /// Hands a batch's buffers back to the engines' builders for the next batch (from
    /// [`Batch::into_plans`](crate::Batch::into_plans)).
    pub fn recycle(&mut self, plans: RoutedPlans) {
        for part in plans.parts {
            if let Some(sub) =
                self.subs.iter_mut().find(|s| (s.group, s.engine) == (part.group, part.engine))
            {
                let _ = guarded(sub, |b| {
                    b.recycle(part.plans);
                    Ok(())
                });
            }
        }
        let mut staged = plans.staged;
        if self.staged.is_empty() && staged.capacity() > self.staged.capacity() {
            staged.clear();
            self.staged = staged;
        }
        let mut objects = plans.objects;
        if self.objects.is_empty() && objects.capacity() > self.objects.capacity() {
            objects.clear();
            self.objects = objects;
        }
    }

    /// Routes a pair for the current group: the route, and for a direct one the sub-builder.
    fn lookup(&mut self, src: EndpointId, dst: EndpointId) -> LastPush {
        let route = match self.routes.get(&(src, dst)) {
            Some(&r) => r,
            None => {
                if self.table.get(src).is_none() || self.table.get(dst).is_none() {
                    self.table = self.composite.registry().snapshot();
                }
                let bounce = self.composite.bounce().and_then(|b| self.table.get(b)).copied();
                let engines = self.composite.engines();
                let r = match (self.table.get(src), self.table.get(dst)) {
                    // An engine whose `can_handle` panics carries nothing.
                    (Some(s), Some(d)) => {
                        catch_unwind(AssertUnwindSafe(|| route(engines, bounce.as_ref(), s, d)))
                            .unwrap_or(Route::Unrouted)
                    }
                    _ => Route::Unrouted,
                };
                // Unknown endpoints may be registered later: only cache known pairs.
                if r != Route::Unrouted {
                    if self.routes.len() >= self.prune_routes_at {
                        self.prune_routes();
                    }
                    self.routes.insert((src, dst), r);
                }
                r
            }
        };
        let sub = match route {
            Route::Direct(engine) => self.sub_for(self.group, engine),
            _ => usize::MAX,
        };
        let last = LastPush { pair: (src, dst), group: self.group, route, sub };
        self.last = Some(last);
        last
    }

    /// Drops the cached routes of pairs with an endpoint no longer registered (a deregistered
    /// id never names an endpoint again, so those routes would never be asked for), and prunes
    /// next when the cache has doubled: it stays within twice the pairs of live endpoints (plus
    /// [`ROUTES_KEPT`]), however many endpoints came and went, at one step per route cached.
    #[cold]
    fn prune_routes(&mut self) {
        self.table = self.composite.registry().snapshot();
        let table = &self.table;
        self.routes.retain(|&(s, d), _| table.get(s).is_some() && table.get(d).is_some());
        self.prune_routes_at = (2 * self.routes.len()).max(ROUTES_KEPT);
    }

    /// How many pairs' routes the builder has cached.
    #[cfg(test)]
    fn cached_routes(&self) -> usize {
        self.routes.len()
    }

    /// The sub-builder of `engine` for `group`, created on first use.
    fn sub_for(&mut self, group: u32, engine: usize) -> usize {
        if let Some(i) = self.subs.iter().position(|s| (s.group, s.engine) == (group, engine)) {
            return i;
        }
        let builder = new_builder(&self.composite, engine);
        self.subs.push(Sub {
            group,
            engine,
            builder,
            open: false,
            objects: Vec::new(),
            lost: Vec::new(),
        });
        self.subs.len() - 1
    }

    /// Opens object `tag` in sub-builder `i`, if not yet (giving it a fresh builder if a panic
    /// took its last one).
    fn open_sub(&mut self, i: usize, tag: Tag) -> Result<(), Error> {
        let sub = &mut self.subs[i];
        if sub.builder.is_none() {
            sub.builder = new_builder(&self.composite, sub.engine);
        }
        if !sub.open {
            sub.objects.push(tag);
            guarded(sub, |b| b.begin_object(tag))?;
            sub.open = true;
            self.touched.push(i);
        }
        Ok(())
    }

    /// Bounds of a staged fragment against both endpoints; a refusal comes with the engine it
    /// is counted under: the first hop's (`read`) for the source, the second's (`write`) for
    /// the destination. The pair is routed, so it is never counted as unrouted.
    fn check_staged(
        &self,
        f: &Fragment,
        read: usize,
        write: usize,
    ) -> Result<(), (RejectReason, usize)> {
        for (id, offset, engine) in [(f.src, f.src_offset, read), (f.dst, f.dst_offset, write)] {
            let e = self.table.get(id).ok_or((RejectReason::UnknownEndpoint(id), engine))?;
            let reason = match offset.checked_add(f.len) {
                None => RejectReason::Overflow { endpoint: id, offset, len: f.len },
                Some(end) if end > e.len() => RejectReason::OutOfBounds {
                    endpoint: id,
                    offset,
                    len: f.len,
                    endpoint_len: e.len(),
                },
                Some(_) => continue,
            };
            return Err((reason, engine));
        }
        Ok(())
    }

    /// Rejects the open object everywhere: every engine it touched rolls it back, its staged
    /// fragments go, and its tag is rejected once, here.
    fn poison(
        &mut self,
        tag: Tag,
        reason: RejectReason,
        f: &Fragment,
        engine: Option<usize>,
    ) -> Error {
        let _ = self.rollback_subs();
        self.staged.truncate(self.staged_at_begin);
        let error = Error::Rejected { tag, reason };
        self.rejected.push((tag, error));
        self.scope = Scope::Poisoned(tag);
        // Asking the engine its name may panic; the composite's answer does not.
        let name = engine.map_or_else(|| UNROUTED.to_string(), |i| self.composite.engine_name(i));
        let dir = match (self.table.get(f.src), self.table.get(f.dst)) {
            (Some(s), Some(d)) => direction(s, d),
            _ => "unknown",
        };
        if self.metered {
            self.composite.metrics().record_rejected(&name, dir, reason.kind_name());
        }
        tracing::debug!(tag = self.caller_tag(tag), %reason, "object rejected");
        error
    }

    /// Names the objects of the next batch, by position, with the caller's `tags` in the log
    /// (restore and offload number their objects `0 ..`). Cleared by `finish`.
    pub(crate) fn set_caller_tags(&mut self, tags: impl IntoIterator<Item = u64>) {
        self.caller_tags.clear();
        self.caller_tags.extend(tags);
    }

    /// The tag the caller knows object `tag` by.
    fn caller_tag(&self, tag: Tag) -> u64 {
        self.caller_tags.get(tag.get() as usize).copied().unwrap_or(u64::from(tag.get()))
    }

    fn rollback_subs(&mut self) -> Result<(), Error> {
        let mut result = Ok(());
        for i in std::mem::take(&mut self.touched) {
            let sub = &mut self.subs[i];
            sub.open = false;
            // The object leaves the batch, so it is not among what a later panic loses.
            if let Scope::Open(tag) | Scope::Poisoned(tag) = self.scope {
                if sub.objects.last() == Some(&tag) {
                    sub.objects.pop();
                }
            }
            match guarded(sub, |b| b.rollback_object()) {
                Err(Error::Rejected { .. }) => {}
                other => result = result.and(other),
            }
        }
        result
    }
}

/// The route cache's size below which it is never pruned.
const ROUTES_KEPT: usize = 64;

/// Engine `engine`'s builder from `composite`, or `None` if making it panics.
fn new_builder(composite: &CompositeEngine, engine: usize) -> Option<OwnedBuilder> {
    let owner = Arc::clone(&composite.engines()[engine]);
    let buffered = composite.buffered();
    catch_unwind(AssertUnwindSafe(|| {
        OwnedBuilder::new(owner, |engine| engine_builder(&**engine, buffered))
    }))
    .ok()
}

/// Runs `call` on the sub-builder, catching a panic of the engine's builder: the sub-builder
/// is dropped (the next object that needs it gets a fresh one), every object it held for the
/// batch is lost (rejected at `finish` with `BuilderPanicked` and taken out of every other
/// engine's plans), and the call fails with `Rejected { reason: BuilderPanicked }` for the
/// open object.
fn guarded<T>(
    sub: &mut Sub,
    call: impl FnOnce(&mut (dyn PlanBuilder + Send + '_)) -> Result<T, Error>,
) -> Result<T, Error> {
    let tag = sub.objects.last().copied().unwrap_or(Tag::new(0));
    let Some(builder) = sub.builder.as_mut() else {
        return Err(Error::Rejected { tag, reason: RejectReason::BuilderPanicked });
    };
    let run = || builder.with_dependent_mut(|_, b| call(&mut **b));
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(result) => result,
        Err(_) => {
            tracing::error!(
                engine = sub.engine,
                "an engine's plan builder panicked; its objects of this batch are rejected"
            );
            sub.builder = None;
            sub.open = false;
            let mut objects = std::mem::take(&mut sub.objects);
            sub.lost.append(&mut objects);
            Err(Error::Rejected { tag, reason: RejectReason::BuilderPanicked })
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use umbp_plan::{BatchState, EndpointRegistry, Fragment, Register, Tag};

    use super::ROUTES_KEPT;
    use crate::CompositeEngine;

    #[test]
    fn the_route_cache_stays_bounded_as_endpoints_come_and_go() {
        let registry = EndpointRegistry::new();
        let host = Arc::new(umbp_localcopy::LocalCopyEngine::new(registry.clone()));
        let composite = CompositeEngine::new(registry, vec![host]);
        let src = composite.register_memory(vec![7u8; 64]).unwrap();
        let mut builder = composite.builder();
        let mut most = 0;
        // Register, copy into, deregister: a new pair each cycle.
        for _ in 0..20_000 {
            let dst = composite.register_memory(vec![0u8; 64]).unwrap();
            let tag = Tag::new(0);
            builder.begin_object(tag).unwrap();
            builder.push(Fragment::new(src.id(), 0, dst.id(), 0, 64, tag)).unwrap();
            builder.commit_object().unwrap();
            let batch = composite.submit(builder.finish().unwrap()).unwrap();
            assert_eq!(batch.wait().aggregate, BatchState::Completed);
            builder.recycle(batch.into_plans());
            assert_eq!(dst.deregister(), vec![7u8; 64]);
            most = most.max(builder.cached_routes());
        }
        assert!(most <= ROUTES_KEPT, "the route cache grew to {most} pairs with 2 endpoints live");
    }
}
