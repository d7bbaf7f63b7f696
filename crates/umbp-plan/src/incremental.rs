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
use crate::rules::validate;
use crate::{
    Endpoint, EndpointId, EndpointRegistry, EndpointTable, Error, Fragment, Plan, PlanBuilder,
    PlanRules, PlanSet, RejectReason, Segment, Tag,
};

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
    rejected: Vec<Tag>,
    cursor: Cursor,
    scope: Scope,
    /// Objects opened so far; `touched[p] == epoch` once plan `p` is in this object's undo log.
    epoch: u64,
    touched: Vec<u64>,
    undo: Vec<PlanSnapshot>,
    plans_at_begin: usize,
    rejected_at_begin: usize,
}

/// What the hot path needs about the plan the last push went into.
#[derive(Copy, Clone, Debug)]
struct Cursor {
    src: EndpointId,
    dst: EndpointId,
    tag: Tag,
    plan: usize,
    src_len: u64,
    dst_len: u64,
    /// Where the plan's last segment ends; `u64::MAX` when the plan has none (no non-empty
    /// in-bounds fragment can start there).
    next_src: u64,
    next_dst: u64,
    last_len: u64,
    src_endpoint: Endpoint,
    dst_endpoint: Endpoint,
}

impl Cursor {
    /// A cursor no fragment matches: the sentinel ids are never handed out together.
    const NONE: Cursor = Cursor {
        src: EndpointId::from_raw(u32::MAX),
        dst: EndpointId::from_raw(u32::MAX),
        tag: Tag::new(u32::MAX),
        plan: usize::MAX,
        src_len: 0,
        dst_len: 0,
        next_src: u64::MAX,
        next_dst: u64::MAX,
        last_len: 0,
        src_endpoint: Endpoint::host(0, 0),
        dst_endpoint: Endpoint::host(0, 0),
    };
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Scope {
    Closed,
    Open(Tag),
    Poisoned(Tag),
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
            rejected: Vec::new(),
            cursor: Cursor::NONE,
            scope: Scope::Closed,
            epoch: 0,
            touched: Vec::new(),
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

    /// Adds one fragment; see [`PlanBuilder::push`]. This inherent method is what the trait
    /// calls, kept here so that callers holding the concrete type get it inlined.
    #[inline]
    pub fn push(&mut self, f: Fragment) -> Result<(), Error> {
        let c = &mut self.cursor;
        if f.src != c.src || f.dst != c.dst || f.tag != c.tag || f.len == 0 {
            return self.push_cold(f);
        }
        let (Some(src_end), Some(dst_end)) =
            (f.src_offset.checked_add(f.len), f.dst_offset.checked_add(f.len))
        else {
            return self.reject(f);
        };
        if src_end > c.src_len || dst_end > c.dst_len || f.len > self.max_segment {
            return self.reject(f);
        }
        if self.rules.check_fragment(&c.src_endpoint, &c.dst_endpoint, &f).is_err() {
            return self.reject(f);
        }
        let plan = &mut self.plans[c.plan];
        // Adjacent on both sides means the merged segment ends at `src_end`, which fits in the
        // endpoint, so `last_len + len` cannot overflow once adjacency holds.
        if f.src_offset == c.next_src
            && f.dst_offset == c.next_dst
            && c.last_len + f.len <= self.max_segment
        {
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
        c.next_src = src_end;
        c.next_dst = dst_end;
        Ok(())
    }

    /// Every push the cursor does not cover: zero length, scope errors, a new pair or object.
    #[cold]
    #[inline(never)]
    fn push_cold(&mut self, f: Fragment) -> Result<(), Error> {
        if f.len == 0 {
            return Ok(());
        }
        let tag = match self.scope {
            Scope::Closed => return Err(Error::NoOpenObject),
            Scope::Poisoned(tag) => return Err(Error::ObjectRejected { tag }),
            Scope::Open(tag) => tag,
        };
        if f.tag != tag {
            return Err(Error::TagMismatch { object: tag, fragment: f.tag });
        }
        let (src_endpoint, dst_endpoint) = match self.validate(&f) {
            Ok(pair) => pair,
            Err(reason) => return Err(self.poison(tag, reason)),
        };
        let plan_index = self.plan_for(f.src, f.dst);
        let plan = &mut self.plans[plan_index];
        let last = plan.segments.len().checked_sub(1);
        let (next_src, next_dst, last_len) = match plan.segments.last() {
            Some(s) => (s.src_offset + s.len, s.dst_offset + s.len, s.len),
            None => (u64::MAX, u64::MAX, 0),
        };
        self.cursor = Cursor {
            src: f.src,
            dst: f.dst,
            tag,
            plan: plan_index,
            src_len: src_endpoint.len(),
            dst_len: dst_endpoint.len(),
            next_src,
            next_dst,
            last_len,
            src_endpoint,
            dst_endpoint,
        };
        if plan.tags.last() != Some(&tag) {
            // The same adjacency rule the hot path applies; validated, so no overflow.
            let joined = f.src_offset == next_src
                && f.dst_offset == next_dst
                && last_len + f.len <= self.max_segment;
            let segment = if joined { last.unwrap_or(0) } else { plan.segments.len() };
            plan.tags.push(tag);
            plan.tag_starts.push(TagStart { segment, joined });
        }
        self.push(f)
    }

    /// Validates against the builder's snapshot, refreshing it once for an unknown endpoint.
    fn validate(&mut self, f: &Fragment) -> Result<(Endpoint, Endpoint), RejectReason> {
        match validate(&self.rules, &self.table, f) {
            Err(RejectReason::UnknownEndpoint(_)) => {
                self.table = self.registry.snapshot();
                validate(&self.rules, &self.table, f)
            }
            other => other,
        }
    }

    /// The hot path found the fragment out of bounds or against the engine's rules.
    #[cold]
    #[inline(never)]
    fn reject(&mut self, f: Fragment) -> Result<(), Error> {
        let reason = match self.validate(&f) {
            Err(reason) => reason,
            Ok(_) => unreachable!("the cursor accepted what validation accepts"),
        };
        Err(self.poison(f.tag, reason))
    }

    /// Undoes the open object's fragments, rejects its tag once, and refuses its later pushes.
    fn poison(&mut self, tag: Tag, reason: RejectReason) -> Error {
        self.undo_object();
        self.rejected.push(tag);
        self.scope = Scope::Poisoned(tag);
        tracing::debug!(tag = tag.get(), %reason, "object rejected");
        Error::Rejected { tag, reason }
    }

    /// The plan for a pair, created (from a spare if one is left) on first use, and logged in
    /// the undo log the first time the open object touches it.
    fn plan_for(&mut self, src: EndpointId, dst: EndpointId) -> usize {
        if let Some(&index) = self.by_pair.get(&(src, dst)) {
            if self.touched[index] != self.epoch {
                self.touched[index] = self.epoch;
                let plan = &self.plans[index];
                self.undo.push(PlanSnapshot {
                    plan: index,
                    segments: plan.segments.len(),
                    last_len: plan.segments.last().map_or(0, |s| s.len),
                    tags: plan.tags.len(),
                });
            }
            return index;
        }
        let mut plan = self.spare.pop().unwrap_or_else(|| Plan::new(src, dst));
        plan.reset(src, dst);
        let index = self.plans.len();
        self.plans.push(plan);
        self.by_pair.insert((src, dst), index);
        if self.touched.len() <= index {
            self.touched.resize(index + 1, 0);
        }
        // Created by this object: rollback drops it whole, no snapshot needed.
        self.touched[index] = self.epoch;
        index
    }

    /// Restores every plan to its state at `begin_object` (rejected tags are left alone).
    fn undo_object(&mut self) {
        for s in self.undo.drain(..) {
            let plan = &mut self.plans[s.plan];
            plan.segments.truncate(s.segments);
            if let Some(last) = plan.segments.last_mut() {
                last.len = s.last_len;
            }
            plan.tags.truncate(s.tags);
            plan.tag_starts.truncate(s.tags);
        }
        while self.plans.len() > self.plans_at_begin {
            if let Some(plan) = self.plans.pop() {
                self.by_pair.remove(&(plan.src, plan.dst));
                self.spare.push(plan);
            }
        }
        self.cursor = Cursor::NONE;
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
        self.cursor = Cursor::NONE;
        Ok(())
    }

    #[inline]
    fn push(&mut self, fragment: Fragment) -> Result<(), Error> {
        IncrementalBuilder::push(self, fragment)
    }

    fn commit_object(&mut self) -> Result<(), Error> {
        self.open_tag().ok_or(Error::NoOpenObject)?;
        self.scope = Scope::Closed;
        self.cursor = Cursor::NONE;
        self.undo.clear();
        Ok(())
    }

    fn rollback_object(&mut self) -> Result<(), Error> {
        self.open_tag().ok_or(Error::NoOpenObject)?;
        self.undo_object();
        self.rejected.truncate(self.rejected_at_begin);
        self.scope = Scope::Closed;
        Ok(())
    }

    fn finish(&mut self) -> Result<PlanSet, Error> {
        if let Some(open) = self.open_tag() {
            return Err(Error::ObjectOpen { open });
        }
        self.by_pair.clear();
        self.touched.clear();
        self.undo.clear();
        self.cursor = Cursor::NONE;
        self.plans_at_begin = 0;
        self.rejected_at_begin = 0;
        Ok(PlanSet {
            plans: std::mem::take(&mut self.plans),
            rejected: std::mem::take(&mut self.rejected),
        })
    }

    fn recycle(&mut self, plans: PlanSet) {
        let (mut list, mut rejected) = plans.into_parts();
        self.spare.append(&mut list);
        if self.plans.capacity() < list.capacity() && self.plans.is_empty() {
            self.plans = list;
        }
        if self.rejected.capacity() < rejected.capacity() && self.rejected.is_empty() {
            rejected.clear();
            self.rejected = rejected;
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
