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
//! # Ranges
//!
//! A page range ([`Run::push_walk`], [`PlanBuilder::push_walk`]) checks what holds for all its
//! pages once: the walk's range rules, one branch-free pass over the pages against the source
//! length, the destination range, and the pair (its plan found without moving the cursor,
//! whose copy of the plan's tail is used if it is on that plan). The pages are then written
//! through the spare capacity of the plan's segment array (`append.rs`), so a page costs the
//! merge decision and a store. Instructions per fragment, counted by `scripts/plan-instructions`
//! on the Kimi-K3 restore shape: 71.3 at 64 KiB pages and 53.0 at 32 KiB before this path,
//! 50.0 and 36.6 with it: about 430 of a range's instructions are fixed (finding the plan, the
//! undo and tag records, the checks), about 20 per page.
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

use crate::append::{append, Slots};
use crate::page_walk::Span;
use crate::plan::TagStart;
use crate::rules::{check_pair, validate};
use crate::{
    Endpoint, EndpointId, EndpointRegistry, EndpointTable, Error, Fragment, PageFragment, PageWalk,
    Plan, PlanBuilder, PlanRules, PlanSet, RejectReason, Segment, Tag,
};

/// Where a plan's last segment ends and its length: what decides whether the next fragment
/// merges into it. [`Tail::joins`] is the builder's one merge rule, and [`Tail::extend`] its
/// one way to append, for the cursor's pushes and a range's loop alike.
#[derive(Copy, Clone, Debug)]
struct Tail {
    next_src: u64,
    next_dst: u64,
    last_len: u64,
}

impl Tail {
    /// The tail of a plan without segments: no non-empty in-bounds fragment starts at
    /// `u64::MAX`, so nothing joins it.
    const EMPTY: Tail = Tail { next_src: u64::MAX, next_dst: u64::MAX, last_len: 0 };

    /// The tail of `segments` as they stand.
    fn of(segments: &[Segment]) -> Tail {
        match segments.last() {
            Some(s) => Tail {
                next_src: s.src_offset + s.len,
                next_dst: s.dst_offset + s.len,
                last_len: s.len,
            },
            None => Tail::EMPTY,
        }
    }

    /// Whether an accepted fragment extends the last segment: adjacent on both sides, and the
    /// merged length within the engine's maximum `max`. Adjacent and in bounds means the merged
    /// segment ends inside both endpoints, so the sum cannot overflow once adjacency holds.
    #[inline(always)]
    fn joins(&self, src: u64, dst: u64, len: u64, max: u64) -> bool {
        src == self.next_src && dst == self.next_dst && self.last_len + len <= max
    }

    /// Appends an accepted fragment to `out`, extending the last segment when the fragment
    /// [`joins`](Self::joins) it.
    #[inline(always)]
    fn extend(&mut self, out: &mut impl Segments, max: u64, src: u64, dst: u64, len: u64) {
        if self.joins(src, dst, len, max) {
            self.last_len += len;
            // A tail that something joins describes the last segment `out` holds.
            let last = out.last_mut();
            debug_assert!(last.is_some(), "a joining fragment needs its segment in `out`");
            if let Some(last) = last {
                last.len = self.last_len;
            }
        } else {
            out.push(Segment { src_offset: src, dst_offset: dst, len });
            self.last_len = len;
        }
        // In bounds (checked by the caller), so neither end overflows.
        self.next_src = src + len;
        self.next_dst = dst + len;
    }

    /// [`extend`](Self::extend) with a fragment whose destination starts where the tail's ends.
    #[inline(always)]
    fn extend_next(&mut self, out: &mut impl Segments, max: u64, src: u64, len: u64) {
        self.extend(out, max, src, self.next_dst, len);
    }
}

/// Where a [`Tail`]'s segments go: a plan's segment array (the cursor's pushes), or the spare
/// capacity of one (a range's, through [`append`]).
trait Segments {
    fn push(&mut self, segment: Segment);
    fn last_mut(&mut self) -> Option<&mut Segment>;
}

impl Segments for Vec<Segment> {
    #[inline(always)]
    fn push(&mut self, segment: Segment) {
        Vec::push(self, segment);
    }

    #[inline(always)]
    fn last_mut(&mut self) -> Option<&mut Segment> {
        self.as_mut_slice().last_mut()
    }
}

impl Segments for Slots<'_, Segment> {
    #[inline(always)]
    fn push(&mut self, segment: Segment) {
        Slots::push(self, segment);
    }

    #[inline(always)]
    fn last_mut(&mut self) -> Option<&mut Segment> {
        Slots::last_mut(self)
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
    /// Tag starts recorded so far in this batch, in every plan: the next start's order (see
    /// `TagStart`). Rollback leaves it: the order only has to grow.
    starts: u64,
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
    /// The plan's tail; the plan's [`PlanState`] holds it only while the cursor is elsewhere.
    tail: Tail,
}

impl Cursor {
    /// A cursor no fragment matches: the sentinel ids are never handed out together.
    const NONE: Cursor = Cursor {
        src: EndpointId::from_raw(u64::MAX),
        dst: EndpointId::from_raw(u64::MAX),
        tag: Cursor::DISARMED,
        plan: usize::MAX,
        src_len: 0,
        dst_len: 0,
        tail: Tail::EMPTY,
    };

    /// A tag value no fragment carries (tags are 32-bit).
    const DISARMED: u64 = u64::MAX;
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
    /// The plan's tail; written back from the cursor when it leaves the plan.
    tail: Tail,
    /// The plan's last tag.
    last_tag: Option<Tag>,
}

impl PlanState {
    /// Recomputes the tail and last tag from the plan itself (after an undo).
    fn resync(&mut self, plan: &Plan) {
        self.tail = Tail::of(&plan.segments);
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
            starts: 0,
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

    /// Opens a run of fragments from `src` to `dst` for the open object: the way to push the
    /// fragments of one pair without naming the pair and tag in each, and to push whole page
    /// ranges with [`Run::push_walk`]. The pair is looked up and checked at the run's first
    /// non-empty fragment, not here.
    ///
    /// Errors are those of [`PlanBuilder::push`]: no open object or a poisoned object here; a
    /// refused pair or fragment from [`Run::push`].
    pub fn begin_run(&mut self, src: EndpointId, dst: EndpointId) -> Result<Run<'_, R>, Error> {
        let tag = match self.scope {
            Scope::Open(tag) => tag,
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Closed => return Err(Error::NoOpenObject),
        };
        Ok(Run { builder: self, src, dst, tag })
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
        c.tail.extend(
            &mut self.plans[c.plan].segments,
            self.max_segment,
            f.src_offset,
            f.dst_offset,
            f.len,
        );
        Ok(())
    }

    /// Pushes the page fragments of object bytes `offset .. offset + len` of `walk`, stored in
    /// `src` and destined for `dst_offset ..` of `dst`, for the open object `tag`: exactly what
    /// [`PageWalk::walk`] feeding [`push`](Self::push) does, with what holds for the whole range
    /// checked once.
    ///
    /// One pass over the range's pages checks them against the source endpoint (which rules
    /// out overflow too), and the pair's plan is found (or opened) once. If every page fits,
    /// and the destination range and the page size fit the pair's endpoints and the engine's
    /// maximum segment, each page costs only the engine's own fragment check, the merge
    /// decision and a store, with the tail and the segment array in locals. Otherwise each page
    /// goes through `push`.
    ///
    /// The caller has checked that `tag` is the open object ([`open_for`](Self::open_for)).
    #[allow(clippy::too_many_arguments)] // A range: a pair, the walk, three offsets, a tag.
    fn push_range(
        &mut self,
        src: EndpointId,
        dst: EndpointId,
        walk: &PageWalk<'_>,
        offset: u64,
        len: u64,
        dst_offset: u64,
        tag: Tag,
    ) -> Result<(), Error> {
        let span = walk.span(offset, len, dst_offset)?;
        let page_size = walk.page_size();
        // Looked up without side effects: a range the walk refuses leaves no trace.
        let found = self.find_plan(src, dst);
        let src_len = match found {
            Some(index) => self.states[index].src_len,
            None => self.table.get(src).map_or(0, Endpoint::len),
        };
        let within = src_len
            .checked_sub(page_size)
            .is_some_and(|limit| limit < 1 << 63 && walk.pages_at_most(&span, limit));
        if !within && walk.overflows(&span) {
            return Err(Error::Walk(crate::WalkError::Overflow));
        }
        let index = match found {
            Some(index) => {
                self.log_touch(index);
                index
            }
            None => self.open_plan(tag, src, dst)?,
        };
        let state = &self.states[index];
        // The span's checks guarantee that `dst_offset + len` fits in 64 bits.
        let fits = within
            && src_len == state.src_len
            && page_size <= self.max_segment
            && dst_offset + len <= state.dst_len;
        if !fits {
            // Fragment by fragment through the cursor, which records the object's tag in the
            // plan on the first one (a cursor already on this pair and object has done so).
            let fragment =
                |p: PageFragment| Fragment::new(src, p.tier_offset, dst, p.dst_offset, p.len, tag);
            return walk.fragments(&span, len, dst_offset).try_for_each(|p| self.push(fragment(p)));
        }
        self.push_fitting(index, walk, &span, len, dst_offset, tag)
    }

    /// The pages of a range that fits plan `index` ([`push_range`](Self::push_range)). The
    /// cursor is left where it was: the plan's tail is the cursor's if the cursor is on it,
    /// the plan state's otherwise, and is updated where it lives.
    ///
    /// The engine's own check runs over every page first, in order, so a refused page rejects
    /// the object before anything is written (rules without one compile that pass away). Then
    /// every page is written through [`append`]'s slots: one reserve for the range, and per
    /// page the merge decision and a store, with no capacity check or call.
    fn push_fitting(
        &mut self,
        index: usize,
        walk: &PageWalk<'_>,
        span: &Span,
        len: u64,
        dst_offset: u64,
        tag: Tag,
    ) -> Result<(), Error> {
        let plan = &self.plans[index];
        let (src, dst, max) = (plan.src, plan.dst, self.max_segment);
        let page_size = walk.page_size();
        let fragment =
            |offset, dst_offset, len| Fragment::new(src, offset, dst, dst_offset, len, tag);
        let Some(first) = walk.fragments(span, len, dst_offset).next() else { return Ok(()) };
        let (later, last_piece) = walk.later_pages(span, len);
        let (whole, last) = match later.split_last() {
            Some((&last, whole)) => (whole, Some(last)),
            None => (later, None),
        };
        let whole_at = first.dst_offset + first.len;
        let last_at = whole_at + whole.len() as u64 * page_size;
        let accepts = |f: Fragment| check_fragment(&self.rules, &self.endpoints, index, &f);
        let first = fragment(first.tier_offset, first.dst_offset, first.len);
        let refused = if !accepts(first) {
            Some(first)
        } else if let Some(f) = whole
            .iter()
            .zip(0u64..)
            .map(|(&page, i)| fragment(page, whole_at + i * page_size, page_size))
            .find(|&f| !accepts(f))
        {
            Some(f)
        } else {
            last.map(|page| fragment(page, last_at, last_piece)).filter(|&f| !accepts(f))
        };
        if let Some(f) = refused {
            return self.reject(f);
        }
        let on_cursor = self.cursor.plan == index;
        let mut tail = if on_cursor { self.cursor.tail } else { self.states[index].tail };
        let joined = tail.joins(first.src_offset, first.dst_offset, first.len, max);
        let at = if joined { tail.last_len } else { 0 };
        self.note_tag(index, tag, self.plans[index].segments.len(), at);
        let segments = &mut self.plans[index].segments;
        // Every write goes to the slots, so a page that joins can only join a written slot: a
        // first page that joins the plan's last segment takes that segment along.
        let carried = if joined { segments.pop() } else { None };
        append(segments, later.len() + 2, |mut slots| {
            if let Some(segment) = carried {
                slots.push(segment);
            }
            tail.extend(&mut slots, max, first.src_offset, first.dst_offset, first.len);
            // The destination is contiguous: each later page starts where the last one ended.
            for &page in whole {
                tail.extend_next(&mut slots, max, page, page_size);
            }
            if let Some(page) = last {
                tail.extend_next(&mut slots, max, page, last_piece);
            }
            slots
        });
        if on_cursor {
            self.cursor.tail = tail;
        } else {
            self.states[index].tail = tail;
        }
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
        let index = self.aim(tag, f.src, f.dst)?;
        if !self.cursor_accepts(&f) {
            return self.reject(f);
        }
        let t = &self.cursor.tail;
        let at = if t.joins(f.src_offset, f.dst_offset, f.len, self.max_segment) {
            t.last_len
        } else {
            0
        };
        self.note_tag(index, tag, self.plans[index].segments.len(), at);
        self.push(f)
    }

    /// Points the cursor at the plan of `src → dst` for the open object `tag` (found, or
    /// opened after checking the pair; see [`plan_for`](Self::plan_for)), and returns its index.
    fn aim(&mut self, tag: Tag, src: EndpointId, dst: EndpointId) -> Result<usize, Error> {
        let index = self.plan_for(tag, src, dst)?;
        if self.cursor.plan == index {
            self.cursor.tag = u64::from(tag.get());
        } else {
            self.enter(index, tag);
        }
        Ok(index)
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
        match self.find_plan(src, dst) {
            Some(index) => {
                self.log_touch(index);
                Ok(index)
            }
            None => self.open_plan(tag, src, dst),
        }
    }

    /// The plan of a pair, if the batch has one: the destination's hint, else the map.
    #[inline]
    fn find_plan(&self, src: EndpointId, dst: EndpointId) -> Option<usize> {
        let hinted = self
            .dst_hint
            .get(dst.index())
            .copied()
            .filter(|&i| self.plans.get(i).is_some_and(|p| p.src == src && p.dst == dst));
        hinted.or_else(|| self.by_pair.get(&(src, dst)).copied())
    }

    /// Opens a plan for a pair the batch has none of, after checking that the engine carries
    /// it; a refused pair poisons the open object `tag`.
    fn open_plan(&mut self, tag: Tag, src: EndpointId, dst: EndpointId) -> Result<usize, Error> {
        match self.validate_pair(src, dst) {
            Ok(endpoints) => Ok(self.new_plan(src, dst, endpoints)),
            Err(reason) => Err(self.poison(tag, reason)),
        }
    }

    /// Records that object `tag` has bytes in plan `index`, if it is the first time: its first
    /// fragment either extended the plan's segment `segments_before - 1`, which was `at > 0`
    /// bytes long then, or (`at == 0`) opened segment `segments_before`.
    #[inline(always)]
    fn note_tag(&mut self, index: usize, tag: Tag, segments_before: usize, at: u64) {
        let state = &mut self.states[index];
        if state.last_tag != Some(tag) {
            state.last_tag = Some(tag);
            let segment = segments_before - usize::from(at != 0);
            let plan = &mut self.plans[index];
            plan.tags.push(tag);
            plan.tag_starts.push(TagStart { segment, at, order: self.starts });
            self.starts += 1;
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
                    && check_fragment(&self.rules, &self.endpoints, c.plan, f)
            }
            _ => false,
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
        self.save_tail();
        let plan = &self.plans[index];
        let state = &self.states[index];
        self.cursor = Cursor {
            src: plan.src,
            dst: plan.dst,
            tag: u64::from(tag.get()),
            plan: index,
            src_len: state.src_len,
            dst_len: state.dst_len,
            tail: state.tail,
        };
    }

    /// Writes the cursor's view of its plan's tail back to the plan's state and clears it.
    fn park(&mut self) {
        self.save_tail();
        self.cursor = Cursor::NONE;
    }

    /// Writes the cursor's view of its plan's tail back to the plan's state.
    #[inline]
    fn save_tail(&mut self) {
        if let Some(state) = self.states.get_mut(self.cursor.plan) {
            state.tail = self.cursor.tail;
        }
    }

    /// The cursor refused `f`: out of bounds or against the engine's rules (the object is
    /// rejected), or valid but longer than the maximum segment (it is split). Both are rare, so
    /// the cursor's one length compare is all that fragments below the maximum pay for this.
    #[cold]
    #[inline(never)]
    fn reject(&mut self, f: Fragment) -> Result<(), Error> {
        match validate(&self.rules, &self.table, &f) {
            Err(reason) => Err(self.poison(f.tag, reason)),
            Ok(_) => {
                debug_assert!(
                    f.len > self.max_segment,
                    "the cursor refuses only what validation refuses, and over-long fragments"
                );
                self.push_split(f);
                Ok(())
            }
        }
    }

    /// Appends a valid fragment longer than the maximum segment (the cursor on its plan) as
    /// the batch planner does: consecutive pieces of the maximum, the last one the rest, each
    /// merged as a fragment of its own. They go into the plan the object already logged for
    /// undo (or created), so a rollback takes every piece out.
    fn push_split(&mut self, f: Fragment) {
        let max = self.max_segment;
        let t = &self.cursor.tail;
        let at = if t.joins(f.src_offset, f.dst_offset, max, max) { t.last_len } else { 0 };
        let plan = self.cursor.plan;
        // Recorded already when the cursor was armed for this object; not when `push_cold`
        // aimed it for this fragment.
        self.note_tag(plan, f.tag, self.plans[plan].segments.len(), at);
        let c = &mut self.cursor;
        let segments = &mut self.plans[c.plan].segments;
        let mut done = 0;
        while done < f.len {
            let len = (f.len - done).min(max);
            c.tail.extend(segments, max, f.src_offset + done, f.dst_offset + done, len);
            done += len;
        }
    }

    /// Undoes the open object's fragments, rejects its tag once, and refuses its later pushes.
    /// Nothing is logged here: the error goes back to whoever pushed, and under the composite
    /// this builder's tags are batch positions, so the composite logs the rejection with the
    /// caller's tag instead.
    fn poison(&mut self, tag: Tag, reason: RejectReason) -> Error {
        self.undo_object();
        self.rejected.push(tag);
        self.reasons.push(reason);
        self.scope = Scope::Poisoned(tag);
        Error::Rejected { tag, reason }
    }

    /// Logs plan `index` in the undo log the first time the open object touches it.
    #[inline(always)]
    fn log_touch(&mut self, index: usize) {
        let state = &mut self.states[index];
        if state.touched != self.epoch {
            state.touched = self.epoch;
            let plan = &self.plans[index];
            // The cursor holds the tail of its plan; the state is current for every other.
            let last_len = if self.cursor.plan == index {
                self.cursor.tail.last_len
            } else {
                state.tail.last_len
            };
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
        let mut plan = self.spare.pop().unwrap_or_else(|| Plan::new(src, dst, self.max_segment));
        plan.reset(src, dst, self.max_segment);
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
            tail: Tail::EMPTY,
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

    /// The range pushed as by [`Run::push_walk`].
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
        self.open_for(tag)?;
        self.push_range(src, dst, walk, offset, len, dst_offset, tag)
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
        self.starts = 0;
        Ok(PlanSet {
            plans: std::mem::take(&mut self.plans),
            rejected: std::mem::take(&mut self.rejected),
            reasons: std::mem::take(&mut self.reasons),
            deadline: None,
            cancel: None,
            copy_hashes: None,
            stream: None,
        })
    }

    fn recycle(&mut self, plans: PlanSet) {
        let PlanSet { plans: mut list, mut rejected, mut reasons, .. } = plans;
        // Reversed, so that `new_plan` pops them in the order they were built: a batch that
        // opens the same pairs in the same order gets each plan's own buffers back, already
        // the right size.
        self.spare.extend(list.drain(..).rev());
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

/// The engine's own checks of an in-bounds fragment of plan `index`, whose endpoints are
/// `endpoints[index]`. Rules that keep the default `check_fragment` compile this away entirely.
#[inline(always)]
fn check_fragment<R: PlanRules>(
    rules: &R,
    endpoints: &[(Endpoint, Endpoint)],
    index: usize,
    f: &Fragment,
) -> bool {
    match endpoints.get(index) {
        Some((src, dst)) => rules.check_fragment(src, dst, f).is_ok(),
        None => true,
    }
}

/// A run of fragments that share one endpoint pair and the open object, opened by
/// [`IncrementalBuilder::begin_run`].
///
/// A push through the run is a push through the builder's cursor, which keeps the pair's plan
/// and tail between pushes: once the first fragment has bound the pair, a push is a bounds
/// check, an adjacency check and one store. A refused fragment poisons the object as by
/// [`PlanBuilder::push`], and every later push of the run fails with
/// [`Error::ObjectRejected`].
#[derive(Debug)]
pub struct Run<'a, R: PlanRules> {
    builder: &'a mut IncrementalBuilder<R>,
    src: EndpointId,
    dst: EndpointId,
    tag: Tag,
}

impl<R: PlanRules> Run<'_, R> {
    /// Adds the fragment `src_offset .. + len` to `dst_offset .. + len` of the run's pair. A
    /// zero-length fragment is skipped.
    #[inline]
    pub fn push(&mut self, src_offset: u64, dst_offset: u64, len: u64) -> Result<(), Error> {
        self.builder.push(Fragment::new(self.src, src_offset, self.dst, dst_offset, len, self.tag))
    }

    /// Pushes the page fragments of object bytes `offset .. offset + len` of `walk`, destined
    /// for `dst_offset ..`: exactly what [`PageWalk::walk`] feeding [`push`](Self::push) does,
    /// with the checks that hold for the whole range done once (the module doc's "Ranges"). If
    /// all pages, the destination range and the page size fit the pair's endpoints and the
    /// engine's maximum segment, every page costs only the engine's own check, the merge
    /// decision and a store; otherwise the pages go one by one through `push`.
    ///
    /// Errors: [`Error::ObjectRejected`] if the object was already refused; then a range the
    /// walk refuses returns [`Error::Walk`] with nothing pushed; then those of `push`.
    #[inline]
    pub fn push_walk(
        &mut self,
        walk: &PageWalk<'_>,
        offset: u64,
        len: u64,
        dst_offset: u64,
    ) -> Result<(), Error> {
        self.builder.open_for(self.tag)?;
        self.builder.push_range(self.src, self.dst, walk, offset, len, dst_offset, self.tag)
    }

    /// Ends the run; the same as dropping it.
    pub fn end(self) {}
}
