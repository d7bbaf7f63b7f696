//! The incremental builder: validate and merge each fragment straight into the plan set.
//!
//! # Layout
//!
//! Plans live in one `Vec<Plan>`, each with parallel segment arrays. A *cursor* caches what the
//! last push needed: the plan index, the endpoint pair and tag, both endpoint lengths, and where
//! the plan's last segment ends on each side. A push whose pair and tag match the cursor (the
//! page walk produces long runs of those) costs two overflow-checked bounds checks, one
//! adjacency check, and either one length update or three array pushes. Everything else (a new
//! pair, a new object, a rejection, a zero-length fragment, a misuse) takes the cold path.
//!
//! # Undo log
//!
//! `begin_object` remembers how many plans and rejected tags exist. The first time an object
//! touches an older plan, the plan's segment count, last segment length and tag count go into
//! an undo log (once per plan per object, on the cold path). Rolling back truncates every logged
//! plan to its snapshot, restores its last length, drops plans the object created, and truncates
//! the rejected tags: the builder is exactly as it was at `begin_object`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::plan::TagStart;
use crate::rules::{check_pair, validate};
use crate::{
    Endpoint, EndpointId, EndpointRegistry, EndpointTable, Error, Fragment, PageWalk, Plan,
    PlanBuilder, PlanRules, PlanSet, RejectReason, Segment, Tag,
};

/// Where a plan's (or a run's) last segment ends and its length: what decides whether the next
/// fragment merges into it.
#[derive(Copy, Clone, Debug)]
struct Tail {
    next_src: u64,
    next_dst: u64,
    last_len: u64,
}

impl Tail {
    /// Appends an in-bounds fragment to `segments`, extending the last segment when adjacent
    /// on both sides and the merged length stays within `max` (in bounds and adjacent, the sum
    /// cannot overflow).
    #[inline(always)]
    fn extend(&mut self, segments: &mut Vec<Segment>, max: u64, src: u64, dst: u64, len: u64) {
        if src == self.next_src && dst == self.next_dst && self.last_len + len <= max {
            self.last_len += len;
            if let Some(last) = segments.last_mut() {
                last.len = self.last_len;
            }
        } else {
            segments.push(Segment { src_offset: src, dst_offset: dst, len });
            self.last_len = len;
        }
        self.next_src = src + len;
        self.next_dst = dst + len;
    }
}

/// A plan builder that validates and range-merges fragments into the executable plan as they
/// are pushed, with an undo log for per-object rollback. Engines wrap it with their own
/// [`PlanRules`].
///
/// Reused across batches (with [`recycle`](PlanBuilder::recycle)), it allocates nothing in
/// steady state.
#[derive(Debug)]
pub struct IncrementalBuilder<R> {
    rules: R,
    max_segment: u64,
    registry: Arc<EndpointRegistry>,
    table: Arc<EndpointTable>,
    plans: Vec<Plan>,
    /// Cleared plans whose buffers the next new pair reuses.
    spare: Vec<Plan>,
    by_pair: HashMap<(EndpointId, EndpointId), usize, BuildHasherDefault<PairHasher>>,
    /// The plan most recently opened for each destination id below [`DST_HINTS`]: checked
    /// before `by_pair`, it finds the plan without hashing when a destination has one source.
    dst_hint: Vec<usize>,
    rejected: Vec<Tag>,
    /// Why each rejected tag was rejected, beside it.
    reasons: Vec<RejectReason>,
    cursor: Cursor,
    scope: Scope,
    /// Objects opened so far.
    epoch: u64,
    /// What the push paths need about each plan, beside it in one small flat array so that
    /// switching plans reads nothing from the (large, cold) segment and tag arrays.
    states: Vec<PlanState>,
    /// The endpoint descriptions of each plan's pair, for the engine's per-fragment checks.
    endpoints: Vec<(Endpoint, Endpoint)>,
    undo: Vec<PlanSnapshot>,
    plans_at_begin: usize,
    rejected_at_begin: usize,
}

/// Destination ids below this get a slot in the builder's hint table.
const DST_HINTS: usize = 4096;

/// What the hot path needs about the plan the last push went into.
#[derive(Copy, Clone, Debug)]
struct Cursor {
    src: EndpointId,
    dst: EndpointId,
    /// The open object's tag while the cursor is armed; [`Cursor::DISARMED`] between objects,
    /// when the cursor still caches its plan's tail but no fragment matches it.
    tag: u64,
    plan: usize,
    src_len: u64,
    dst_len: u64,
    /// Where the plan's last segment ends; `u64::MAX` when the plan has none (no non-empty
    /// in-bounds fragment can start there).
    next_src: u64,
    next_dst: u64,
    last_len: u64,
}

impl Cursor {
    /// A cursor no fragment matches: the sentinel ids are never handed out together.
    const NONE: Cursor = Cursor {
        src: EndpointId::from_raw(u32::MAX),
        dst: EndpointId::from_raw(u32::MAX),
        tag: Cursor::DISARMED,
        plan: usize::MAX,
        src_len: 0,
        dst_len: 0,
        next_src: u64::MAX,
        next_dst: u64::MAX,
        last_len: 0,
    };
}

impl Cursor {
    /// A tag value no fragment carries (tags are 32-bit).
    const DISARMED: u64 = u64::MAX;

    /// Whether an accepted fragment extends the plan's last segment: adjacent on both sides,
    /// and the merged length within the engine's maximum. Adjacent and in bounds means the
    /// merged segment ends inside both endpoints, so the sum cannot overflow once adjacency holds.
    #[inline(always)]
    fn merges(&self, f: &Fragment, max_segment: u64) -> bool {
        f.src_offset == self.next_src
            && f.dst_offset == self.next_dst
            && self.last_len + f.len <= max_segment
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Scope {
    Closed,
    Open(Tag),
    Poisoned(Tag),
}

/// The push paths' view of one plan.
#[derive(Copy, Clone, Debug)]
struct PlanState {
    /// The epoch of the object that last logged this plan for undo.
    touched: u64,
    src_len: u64,
    dst_len: u64,
    /// Where the last segment ends (`u64::MAX` with no segment) and its length; written back
    /// from the cursor or a run when they leave the plan.
    next_src: u64,
    next_dst: u64,
    last_len: u64,
    /// The plan's last tag.
    last_tag: Option<Tag>,
}

impl PlanState {
    /// Recomputes the tail fields from the plan itself (after an undo).
    fn resync(&mut self, plan: &Plan) {
        (self.next_src, self.next_dst, self.last_len) = match plan.segments.last() {
            Some(s) => (s.src_offset + s.len, s.dst_offset + s.len, s.len),
            None => (u64::MAX, u64::MAX, 0),
        };
        self.last_tag = plan.tags.last().copied();
    }
}

/// A plan's state before the open object first touched it.
#[derive(Copy, Clone, Debug)]
struct PlanSnapshot {
    plan: usize,
    segments: usize,
    last_len: u64,
    tags: usize,
}

impl<R: PlanRules> IncrementalBuilder<R> {
    /// A builder that checks fragments with `rules` against the endpoints of `registry`.
    pub fn new(rules: R, registry: Arc<EndpointRegistry>) -> Self {
        Self {
            max_segment: rules.max_segment_len(),
            rules,
            table: registry.snapshot(),
            registry,
            plans: Vec::new(),
            spare: Vec::new(),
            by_pair: HashMap::default(),
            dst_hint: Vec::new(),
            rejected: Vec::new(),
            reasons: Vec::new(),
            cursor: Cursor::NONE,
            scope: Scope::Closed,
            epoch: 0,
            states: Vec::new(),
            endpoints: Vec::new(),
            undo: Vec::new(),
            plans_at_begin: 0,
            rejected_at_begin: 0,
        }
    }

    /// The rules this builder checks fragments with.
    pub fn rules(&self) -> &R {
        &self.rules
    }

    /// The plans built so far in this batch.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// The objects rejected so far in this batch.
    pub fn rejected(&self) -> &[Tag] {
        &self.rejected
    }

    /// Opens a run of fragments from `src` to `dst` for the open object: the fast way to push
    /// the fragments of one range (one page walk). The pair is looked up and checked once, at
    /// the run's first non-empty fragment; each [`Run::push`] then checks bounds and merges or
    /// appends, with the run's state in locals. The run hands everything back when dropped.
    ///
    /// Errors are those of [`PlanBuilder::push`]: no open object or a poisoned object here; a
    /// refused pair or fragment from [`Run::push`].
    pub fn begin_run(&mut self, src: EndpointId, dst: EndpointId) -> Result<Run<'_, R>, Error> {
        let tag = match self.scope {
            Scope::Open(tag) => tag,
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Closed => return Err(Error::NoOpenObject),
        };
        self.park();
        Ok(Run {
            plan: None,
            segments: Vec::new(),
            tag,
            src,
            dst,
            // Unbound: lengths of zero send the first non-empty push to `Run::push_cold`.
            src_len: 0,
            dst_len: 0,
            max_segment: self.max_segment,
            tail: Tail { next_src: u64::MAX, next_dst: u64::MAX, last_len: 0 },
            segments_before: 0,
            first_join_at: 0,
            live: true,
            builder: self,
        })
    }

    /// Adds one fragment; see [`PlanBuilder::push`]. This inherent method is what the trait
    /// calls, kept here so that callers holding the concrete type get it inlined.
    #[inline]
    pub fn push(&mut self, f: Fragment) -> Result<(), Error> {
        let c = &self.cursor;
        if f.src != c.src || f.dst != c.dst || u64::from(f.tag.get()) != c.tag || f.len == 0 {
            return self.push_cold(f);
        }
        if !self.cursor_accepts(&f) {
            return self.reject(f);
        }
        let c = &mut self.cursor;
        let plan = &mut self.plans[c.plan];
        if c.merges(&f, self.max_segment) {
            c.last_len += f.len;
            if let Some(last) = plan.segments.last_mut() {
                last.len = c.last_len;
            }
        } else {
            plan.segments.push(Segment {
                src_offset: f.src_offset,
                dst_offset: f.dst_offset,
                len: f.len,
            });
            c.last_len = f.len;
        }
        // In bounds (checked above), so neither end overflows.
        c.next_src = f.src_offset + f.len;
        c.next_dst = f.dst_offset + f.len;
        Ok(())
    }

    /// Every push the cursor does not cover: zero length, scope errors, a new pair or object.
    #[cold]
    #[inline(never)]
    fn push_cold(&mut self, f: Fragment) -> Result<(), Error> {
        if f.len == 0 {
            return Ok(());
        }
        let tag = self.open_for(f.tag)?;
        let index = self.plan_for(tag, f.src, f.dst)?;
        if self.cursor.plan == index {
            self.cursor.tag = u64::from(tag.get());
        } else {
            self.enter(index, tag);
        }
        if !self.cursor_accepts(&f) {
            return self.reject(f);
        }
        let at = if self.cursor.merges(&f, self.max_segment) { self.cursor.last_len } else { 0 };
        self.note_tag(index, tag, self.plans[index].segments.len(), at);
        self.push(f)
    }

    /// The open object's tag, if pushes for `tag` may go into it.
    fn open_for(&self, tag: Tag) -> Result<Tag, Error> {
        match self.scope {
            Scope::Closed => Err(Error::NoOpenObject),
            Scope::Poisoned(open) => Err(Error::ObjectRejected { tag: open }),
            Scope::Open(open) if open != tag => {
                Err(Error::TagMismatch { object: open, fragment: tag })
            }
            Scope::Open(open) => Ok(open),
        }
    }

    /// The plan of a pair for the open object `tag`: found (and logged for undo on the object's
    /// first touch) or opened. A pair the engine refuses poisons the object.
    fn plan_for(&mut self, tag: Tag, src: EndpointId, dst: EndpointId) -> Result<usize, Error> {
        let hinted = self
            .dst_hint
            .get(dst.index())
            .copied()
            .filter(|&i| self.plans.get(i).is_some_and(|p| p.src == src && p.dst == dst));
        if let Some(index) = hinted.or_else(|| self.by_pair.get(&(src, dst)).copied()) {
            self.log_touch(index);
            return Ok(index);
        }
        match self.validate_pair(src, dst) {
            Ok(endpoints) => Ok(self.new_plan(src, dst, endpoints)),
            Err(reason) => Err(self.poison(tag, reason)),
        }
    }

    /// Records that object `tag` has bytes in plan `index`, if it is the first time: its first
    /// fragment either extended the plan's segment `segments_before - 1`, which was `at > 0`
    /// bytes long then, or (`at == 0`) opened segment `segments_before`.
    fn note_tag(&mut self, index: usize, tag: Tag, segments_before: usize, at: u64) {
        let state = &mut self.states[index];
        if state.last_tag != Some(tag) {
            state.last_tag = Some(tag);
            let segment = segments_before - usize::from(at != 0);
            let plan = &mut self.plans[index];
            plan.tags.push(tag);
            plan.tag_starts.push(TagStart { segment, at });
        }
    }

    /// Whether the cursor's endpoints and the engine's rules accept `f` (pair already matched).
    #[inline(always)]
    fn cursor_accepts(&self, f: &Fragment) -> bool {
        let c = &self.cursor;
        match (f.src_offset.checked_add(f.len), f.dst_offset.checked_add(f.len)) {
            (Some(src_end), Some(dst_end)) => {
                src_end <= c.src_len
                    && dst_end <= c.dst_len
                    && f.len <= self.max_segment
                    && self.check_fragment(c.plan, f)
            }
            _ => false,
        }
    }

    /// The engine's own checks of an in-bounds fragment of plan `index`. Rules that keep the
    /// default `check_fragment` compile this away entirely.
    #[inline(always)]
    fn check_fragment(&self, index: usize, f: &Fragment) -> bool {
        match self.endpoints.get(index) {
            Some((src, dst)) => self.rules.check_fragment(src, dst, f).is_ok(),
            None => true,
        }
    }

    /// Looks up both endpoints (refreshing the snapshot once for an unknown one) and checks
    /// that the engine carries the pair. Called once per new plan.
    fn validate_pair(
        &mut self,
        src: EndpointId,
        dst: EndpointId,
    ) -> Result<(Endpoint, Endpoint), RejectReason> {
        if self.table.get(src).is_none() || self.table.get(dst).is_none() {
            self.table = self.registry.snapshot();
        }
        check_pair(&self.rules, &self.table, src, dst)
    }

    /// Points the cursor at plan `index` for object `tag`.
    fn enter(&mut self, index: usize, tag: Tag) {
        self.park();
        let plan = &self.plans[index];
        let state = &self.states[index];
        self.cursor = Cursor {
            src: plan.src,
            dst: plan.dst,
            tag: u64::from(tag.get()),
            plan: index,
            src_len: state.src_len,
            dst_len: state.dst_len,
            next_src: state.next_src,
            next_dst: state.next_dst,
            last_len: state.last_len,
        };
    }

    /// Writes the cursor's view of its plan's tail back to the plan's state and clears it.
    fn park(&mut self) {
        let c = &self.cursor;
        if let Some(state) = self.states.get_mut(c.plan) {
            state.next_src = c.next_src;
            state.next_dst = c.next_dst;
            state.last_len = c.last_len;
        }
        self.cursor = Cursor::NONE;
    }

    /// The hot path found the fragment out of bounds or against the engine's rules.
    #[cold]
    #[inline(never)]
    fn reject(&mut self, f: Fragment) -> Result<(), Error> {
        let reason = match validate(&self.rules, &self.table, &f) {
            Err(reason) => reason,
            Ok(_) => unreachable!("the cursor refuses only what validation refuses"),
        };
        Err(self.poison(f.tag, reason))
    }

    /// Undoes the open object's fragments, rejects its tag once, and refuses its later pushes.
    fn poison(&mut self, tag: Tag, reason: RejectReason) -> Error {
        self.undo_object();
        self.rejected.push(tag);
        self.reasons.push(reason);
        self.scope = Scope::Poisoned(tag);
        tracing::debug!(tag = tag.get(), %reason, "object rejected");
        Error::Rejected { tag, reason }
    }

    /// Logs plan `index` in the undo log the first time the open object touches it.
    fn log_touch(&mut self, index: usize) {
        let state = &mut self.states[index];
        if state.touched != self.epoch {
            state.touched = self.epoch;
            let plan = &self.plans[index];
            // The cursor holds the tail of its plan; the state is current for every other.
            let last_len =
                if self.cursor.plan == index { self.cursor.last_len } else { state.last_len };
            self.undo.push(PlanSnapshot {
                plan: index,
                segments: plan.segments.len(),
                last_len,
                tags: plan.tags.len(),
            });
        }
    }

    /// Opens a plan for a new pair, reusing a spare plan's buffers when one is left.
    fn new_plan(
        &mut self,
        src: EndpointId,
        dst: EndpointId,
        endpoints: (Endpoint, Endpoint),
    ) -> usize {
        let mut plan = self.spare.pop().unwrap_or_else(|| Plan::new(src, dst));
        plan.reset(src, dst);
        let index = self.plans.len();
        self.plans.push(plan);
        self.by_pair.insert((src, dst), index);
        if dst.index() < DST_HINTS {
            if self.dst_hint.len() <= dst.index() {
                self.dst_hint.resize(dst.index() + 1, usize::MAX);
            }
            self.dst_hint[dst.index()] = index;
        }
        let state = PlanState {
            // Created by this object: rollback drops it whole, no snapshot needed.
            touched: self.epoch,
            src_len: endpoints.0.len(),
            dst_len: endpoints.1.len(),
            next_src: u64::MAX,
            next_dst: u64::MAX,
            last_len: 0,
            last_tag: None,
        };
        self.states.truncate(index);
        self.states.push(state);
        self.endpoints.truncate(index);
        self.endpoints.push(endpoints);
        index
    }

    /// Restores every plan to its state at `begin_object` (rejected tags are left alone).
    fn undo_object(&mut self) {
        self.park();
        for s in self.undo.drain(..) {
            let plan = &mut self.plans[s.plan];
            plan.segments.truncate(s.segments);
            if let Some(last) = plan.segments.last_mut() {
                last.len = s.last_len;
            }
            plan.tags.truncate(s.tags);
            plan.tag_starts.truncate(s.tags);
            self.states[s.plan].resync(plan);
        }
        while self.plans.len() > self.plans_at_begin {
            if let Some(plan) = self.plans.pop() {
                self.by_pair.remove(&(plan.src, plan.dst));
                self.spare.push(plan);
            }
        }
        self.states.truncate(self.plans.len());
        self.endpoints.truncate(self.plans.len());
    }

    fn open_tag(&self) -> Option<Tag> {
        match self.scope {
            Scope::Closed => None,
            Scope::Open(tag) | Scope::Poisoned(tag) => Some(tag),
        }
    }
}

impl<R: PlanRules> PlanBuilder for IncrementalBuilder<R> {
    fn begin_object(&mut self, tag: Tag) -> Result<(), Error> {
        if let Some(open) = self.open_tag() {
            return Err(Error::ObjectOpen { open });
        }
        self.scope = Scope::Open(tag);
        self.epoch += 1;
        self.undo.clear();
        self.plans_at_begin = self.plans.len();
        self.rejected_at_begin = self.rejected.len();
        // Every way out of the previous object (commit, rollback, finish) left the cursor
        // disarmed or cleared, so no fragment of this object matches it by accident.
        debug_assert_eq!(self.cursor.tag, Cursor::DISARMED);
        Ok(())
    }

    #[inline]
    fn push(&mut self, fragment: Fragment) -> Result<(), Error> {
        IncrementalBuilder::push(self, fragment)
    }

    /// One [`Run`] over the range ([`Run::push_walk`]).
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
        if let Scope::Open(object) = self.scope {
            if object != tag {
                return Err(Error::TagMismatch { object, fragment: tag });
            }
        }
        self.begin_run(src, dst)?.push_walk(walk, offset, len, dst_offset)
    }

    fn commit_object(&mut self) -> Result<(), Error> {
        self.open_tag().ok_or(Error::NoOpenObject)?;
        self.scope = Scope::Closed;
        // Keep the cursor's plan and tail: the next object often continues the same pair.
        self.cursor.tag = Cursor::DISARMED;
        self.undo.clear();
        Ok(())
    }

    fn rollback_object(&mut self) -> Result<(), Error> {
        self.open_tag().ok_or(Error::NoOpenObject)?;
        self.undo_object();
        self.rejected.truncate(self.rejected_at_begin);
        self.reasons.truncate(self.rejected_at_begin);
        self.scope = Scope::Closed;
        Ok(())
    }

    fn finish(&mut self) -> Result<PlanSet, Error> {
        if let Some(open) = self.open_tag() {
            return Err(Error::ObjectOpen { open });
        }
        self.by_pair.clear();
        self.dst_hint.clear();
        self.cursor = Cursor::NONE;
        self.states.clear();
        self.endpoints.clear();
        self.undo.clear();
        self.plans_at_begin = 0;
        self.rejected_at_begin = 0;
        Ok(PlanSet {
            plans: std::mem::take(&mut self.plans),
            rejected: std::mem::take(&mut self.rejected),
            reasons: std::mem::take(&mut self.reasons),
            deadline: None,
            stream: None,
        })
    }

    fn recycle(&mut self, plans: PlanSet) {
        let PlanSet { plans: mut list, mut rejected, mut reasons, .. } = plans;
        self.spare.append(&mut list);
        if self.plans.capacity() < list.capacity() && self.plans.is_empty() {
            self.plans = list;
        }
        if self.rejected.capacity() < rejected.capacity() && self.rejected.is_empty() {
            rejected.clear();
            reasons.clear();
            self.rejected = rejected;
            self.reasons = reasons;
        }
    }
}

/// A multiplicative hasher for endpoint pairs: two `u32` writes, no SipHash rounds.
#[derive(Default, Clone, Copy, Debug)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// A run of fragments that share one endpoint pair and the open object, opened by
/// [`IncrementalBuilder::begin_run`].
///
/// The run borrows the builder and holds the plan's segment array and its last segment's end
/// in locals, so a push is a bounds check, an adjacency check and one store. Dropping the run
/// (or [`end`](Self::end)) hands the segments back and records the object's tag in the plan.
/// A refused fragment ends the run: the object is poisoned as by [`PlanBuilder::push`], and
/// every later push of the run fails with [`Error::ObjectRejected`].
#[derive(Debug)]
pub struct Run<'a, R: PlanRules> {
    builder: &'a mut IncrementalBuilder<R>,
    /// The plan the run writes into, once its first non-empty fragment bound it.
    plan: Option<usize>,
    segments: Vec<Segment>,
    tag: Tag,
    src: EndpointId,
    dst: EndpointId,
    src_len: u64,
    dst_len: u64,
    max_segment: u64,
    /// The tail of the plan's segments, in the run's locals while it is bound.
    tail: Tail,
    /// The plan's segment count when the run bound it, and, when the run's first fragment
    /// extended the plan's last segment, that segment's length then (0 otherwise).
    segments_before: usize,
    first_join_at: u64,
    live: bool,
}

impl<R: PlanRules> Run<'_, R> {
    /// Adds the fragment `src_offset .. + len` to `dst_offset .. + len` of the run's pair. A
    /// zero-length fragment is skipped.
    #[inline]
    pub fn push(&mut self, src_offset: u64, dst_offset: u64, len: u64) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        let (Some(src_end), Some(dst_end)) =
            (src_offset.checked_add(len), dst_offset.checked_add(len))
        else {
            return self.push_cold(src_offset, dst_offset, len);
        };
        let f = Fragment::new(self.src, src_offset, self.dst, dst_offset, len, self.tag);
        if src_end > self.src_len
            || dst_end > self.dst_len
            || len > self.max_segment
            || !self.builder.check_fragment(self.plan.unwrap_or(usize::MAX), &f)
        {
            return self.push_cold(src_offset, dst_offset, len);
        }
        self.push_in_bounds(src_offset, dst_offset, len);
        Ok(())
    }

    /// Pushes the page fragments of object bytes `offset .. offset + len` of `walk`, destined
    /// for `dst_offset ..`: exactly what [`PageWalk::walk`] feeding [`push`](Self::push) does,
    /// with the checks that hold for the whole range done once. One pass over the range's pages
    /// checks them for overflow and against the source endpoint; after the first page (which
    /// binds the run), if all pages, the destination range and the page size fit the run's
    /// endpoints and the engine's maximum segment, every later page costs only the engine's
    /// own check, the merge decision and a store.
    ///
    /// A range the walk refuses returns [`Error::Walk`] with nothing pushed.
    #[inline]
    pub fn push_walk(
        &mut self,
        walk: &PageWalk<'_>,
        offset: u64,
        len: u64,
        dst_offset: u64,
    ) -> Result<(), Error> {
        let span = walk.span(offset, len, dst_offset)?;
        let src_len = match self.plan {
            Some(_) => Some(self.src_len),
            None => self.builder.table.get(self.src).map(Endpoint::len),
        };
        let (maybe_over, pages_within) = walk.scan(&span, src_len);
        if maybe_over && walk.overflows(&span) {
            return Err(Error::Walk(crate::WalkError::Overflow));
        }
        let mut pages = walk.fragments(&span, len, dst_offset);
        let Some(first) = pages.next() else { return Ok(()) };
        // The first page binds the run; after it, the rest is known in bounds or not at once.
        self.push(first.tier_offset, first.dst_offset, first.len)?;
        if !(pages_within && src_len == Some(self.src_len) && self.covers(walk, len, dst_offset)) {
            return pages.try_for_each(|p| self.push(p.tier_offset, p.dst_offset, p.len));
        }
        // The hot loop, over plain values: every later page is whole but the last; the run's
        // tail is in locals and the segment array has room for every page (reserved once), and
        // both are written back when the range is done or a page is refused.
        let (later, last_piece) = walk.later_pages(&span, len);
        let Some((&last_page, whole)) = later.split_last() else { return Ok(()) };
        let plan = self.plan.unwrap_or(usize::MAX);
        let page_size = walk.page_size();
        let max = self.max_segment;
        let mut tail = self.tail;
        let mut segments = std::mem::take(&mut self.segments);
        segments.reserve(later.len());
        let mut dst = first.dst_offset + first.len;
        let pieces = whole.iter().map(|&p| (p, page_size)).chain([(last_page, last_piece)]);
        let mut refused = None;
        for (src_offset, piece) in pieces {
            let f = Fragment::new(self.src, src_offset, self.dst, dst, piece, self.tag);
            if !self.builder.check_fragment(plan, &f) {
                refused = Some((src_offset, dst, piece));
                break;
            }
            tail.extend(&mut segments, max, src_offset, dst, piece);
            dst += piece;
        }
        self.segments = segments;
        self.tail = tail;
        match refused {
            // Refused by the engine: `push` (with everything written back) rejects the object.
            Some((src_offset, dst_offset, piece)) => self.push(src_offset, dst_offset, piece),
            None => Ok(()),
        }
    }

    /// Whether this run is bound and live, its destination holds `dst_offset .. + len`, and a
    /// page of `walk` fits the maximum segment.
    fn covers(&self, walk: &PageWalk<'_>, len: u64, dst_offset: u64) -> bool {
        self.live
            && self.plan.is_some()
            && walk.page_size() <= self.max_segment
            && dst_offset.checked_add(len).is_some_and(|end| end <= self.dst_len)
    }

    /// `push` for a fragment already known to be in bounds and within the maximum segment.
    #[inline(always)]
    fn push_in_bounds(&mut self, src_offset: u64, dst_offset: u64, len: u64) {
        debug_assert!(src_offset + len <= self.src_len && dst_offset + len <= self.dst_len);
        self.tail.extend(&mut self.segments, self.max_segment, src_offset, dst_offset, len);
    }

    /// Ends the run; the same as dropping it.
    pub fn end(self) {}

    /// Every push the bound run does not accept: the first one (which binds the plan), a
    /// refused fragment, and any push after a refusal.
    #[cold]
    #[inline(never)]
    fn push_cold(&mut self, src_offset: u64, dst_offset: u64, len: u64) -> Result<(), Error> {
        if !self.live {
            return Err(Error::ObjectRejected { tag: self.tag });
        }
        if self.plan.is_none() {
            if let Err(e) = self.bind() {
                self.live = false;
                return Err(e);
            }
            // Only the run's first fragment can extend the segment the plan ended with.
            let t = self.tail;
            let joins = src_offset == t.next_src
                && dst_offset == t.next_dst
                && t.last_len.saturating_add(len) <= self.max_segment;
            self.first_join_at = if joins { t.last_len } else { 0 };
            return self.push(src_offset, dst_offset, len);
        }
        self.hand_back();
        self.live = false;
        let f = Fragment::new(self.src, src_offset, self.dst, dst_offset, len, self.tag);
        self.builder.reject(f)
    }

    /// Finds or opens the plan of the run's pair and takes its segments.
    fn bind(&mut self) -> Result<(), Error> {
        let index = self.builder.plan_for(self.tag, self.src, self.dst)?;
        let segments = std::mem::take(&mut self.builder.plans[index].segments);
        let state = &self.builder.states[index];
        self.tail =
            Tail { next_src: state.next_src, next_dst: state.next_dst, last_len: state.last_len };
        self.segments_before = segments.len();
        self.segments = segments;
        self.src_len = state.src_len;
        self.dst_len = state.dst_len;
        self.plan = Some(index);
        Ok(())
    }

    /// Hands the segments back to the plan and records the object's tag if the run added bytes.
    fn hand_back(&mut self) {
        let Some(index) = self.plan.take() else {
            return;
        };
        let grew = self.segments.len() > self.segments_before;
        let at = self.first_join_at;
        let state = &mut self.builder.states[index];
        (state.next_src, state.next_dst, state.last_len) =
            (self.tail.next_src, self.tail.next_dst, self.tail.last_len);
        self.builder.plans[index].segments = std::mem::take(&mut self.segments);
        if grew || at != 0 {
            self.builder.note_tag(index, self.tag, self.segments_before, at);
        }
    }
}

impl<R: PlanRules> Drop for Run<'_, R> {
    fn drop(&mut self) {
        self.hand_back();
    }
}
