//! Plans: what one engine executes for one (source, destination) endpoint pair.

use std::time::Instant;

use crate::checksum::CopyHashes;
use crate::{CancelToken, DeviceStream, EndpointId, Failure, FailureCause, RejectReason, Tag};

/// One contiguous copy inside a plan. The layout is fixed (`repr(C)`, three `u64`s) so that an
/// engine can hand a plan's segment array to an executor as descriptors without converting it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct Segment {
    /// Offset inside the plan's source endpoint.
    pub src_offset: u64,
    /// Offset inside the plan's destination endpoint.
    pub dst_offset: u64,
    /// Number of bytes.
    pub len: u64,
}

/// Where a tag's bytes start inside a plan: the segment that holds its first fragment, and the
/// byte of that segment where they start. `at` is 0 when the fragment opened the segment, and
/// the segment's length so far when it extended a segment an earlier tag had opened (a
/// *joined* start), so a plan knows to the byte which object owns which part of a merged
/// segment.
///
/// `order` says when the start happened among all the tag starts of its plan set (it grows
/// with every start a builder records, in any plan): the one record of how the fragments of
/// different plans interleaved, which [`PlanSet::retain_tags`] needs to put the plans in the
/// order planning without the dropped objects gives. It is bookkeeping, not meaning: two
/// starts are equal when `segment` and `at` are, whatever their `order`.
#[derive(Copy, Clone, Debug)]
pub(crate) struct TagStart {
    pub(crate) segment: usize,
    pub(crate) at: u64,
    pub(crate) order: u64,
}

impl PartialEq for TagStart {
    fn eq(&self, other: &Self) -> bool {
        (self.segment, self.at) == (other.segment, other.at)
    }
}

impl Eq for TagStart {}

impl TagStart {
    /// Whether the tag's first bytes extended a segment an earlier tag opened.
    pub(crate) fn joined(self) -> bool {
        self.at != 0
    }
}

/// Everything one engine executes for one (source endpoint, destination endpoint) pair: its
/// segments in execution order, and the tags of the objects whose bytes ride in them.
///
/// Segments are one flat array of fixed-layout [`Segment`]s rather than three parallel arrays:
/// a new segment is then one bounds check and one 24-byte store on the push path, and the array
/// is already the (offset, offset, length) descriptor list executors read.
///
/// Tags are kept in order of first appearance, each object once (an object's fragments arrive
/// inside one object scope, so its tag forms one run). [`segment_tags`](Self::segment_tags) maps a
/// failed segment back to exactly the objects it carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub(crate) src: EndpointId,
    pub(crate) dst: EndpointId,
    /// The longest segment the engine that planned it issues (its
    /// [`PlanRules::max_segment_len`](crate::PlanRules::max_segment_len)).
    pub(crate) max_segment: u64,
    pub(crate) segments: Vec<Segment>,
    pub(crate) tags: Vec<Tag>,
    pub(crate) tag_starts: Vec<TagStart>,
}

impl Plan {
    /// The [`Failure`] of this whole plan: all of its objects, with `cause`, named `engine`.
    pub fn fail(&self, engine: &str, cause: FailureCause) -> Failure {
        Failure {
            engine: engine.to_owned(),
            src: self.src,
            dst: self.dst,
            tags: self.tags.clone(),
            cause,
        }
    }

    /// The source endpoint of every segment.
    pub fn src(&self) -> EndpointId {
        self.src
    }

    /// The destination endpoint of every segment.
    pub fn dst(&self) -> EndpointId {
        self.dst
    }

    /// The longest segment the engine that planned this plan issues: no segment is longer, and
    /// [`retain_tags`](Self::retain_tags) joins pieces only up to it.
    pub fn max_segment(&self) -> u64 {
        self.max_segment
    }

    /// Number of segments.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// The segments in execution order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Total bytes the plan moves.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// The tags of the objects carried by this plan, in order of first appearance.
    pub fn tags(&self) -> &[Tag] {
        &self.tags
    }

    /// The tags of the objects whose bytes ride in segment `index` (empty if out of range).
    pub fn segment_tags(&self, index: usize) -> &[Tag] {
        &self.tags[self.segment_tag_range(index)]
    }

    /// The indices into `tags` of the objects whose bytes ride in segment `index`.
    fn segment_tag_range(&self, index: usize) -> std::ops::Range<usize> {
        if index >= self.segments.len() {
            return 0..0;
        }
        // Tags start in segment order, so the tags starting at or before `index` form a prefix.
        let end = self.tag_starts.partition_point(|s| s.segment <= index);
        // Of those, the ones still running at `index` form a suffix of that prefix.
        let mut begin = end;
        while begin > 0 && self.tag_reaches(begin - 1, index) {
            begin -= 1;
        }
        begin..end
    }

    /// Whether tag `k` (which starts at or before `index`) still has bytes in segment `index`.
    /// Tag `k` runs until tag `k + 1` starts; it shares that segment only if tag `k + 1` joined it.
    fn tag_reaches(&self, k: usize, index: usize) -> bool {
        match self.tag_starts.get(k + 1) {
            None => true,
            Some(next) if next.joined() => next.segment >= index,
            Some(next) => next.segment > index,
        }
    }

    /// The pieces of the plan that carry object `tags()[k]`'s bytes, in order: each a segment
    /// of this plan narrowed to the bytes of that object (nothing if `k` is out of range).
    ///
    /// An object's fragments arrive inside one object scope, so in each plan its bytes are one
    /// run: from where its tag starts to where the next tag starts. Engines use this to re-issue
    /// a failed merged segment object by object, and layers above engines to take an object's
    /// bytes out of a plan ([`retain_tags`](Self::retain_tags)).
    pub fn tag_pieces(&self, k: usize) -> impl Iterator<Item = Segment> + '_ {
        self.indexed_pieces(k).map(|(_, piece)| piece)
    }

    /// Segment `index` cut at object boundaries: each object it carries, with the part of the
    /// segment that holds that object's bytes, in order (nothing if `index` is out of range).
    /// An engine whose merged segment failed re-issues these, so that only the objects whose
    /// bytes really did not arrive fail.
    pub fn segment_pieces(&self, index: usize) -> impl Iterator<Item = (Tag, Segment)> + '_ {
        self.segment_tag_range(index).flat_map(move |k| {
            let tag = self.tags[k];
            self.indexed_pieces(k).filter(move |&(i, _)| i == index).map(move |(_, p)| (tag, p))
        })
    }

    /// [`tag_pieces`](Self::tag_pieces), each with the index of the segment it comes from.
    fn indexed_pieces(&self, k: usize) -> impl Iterator<Item = (usize, Segment)> + '_ {
        let start = self.tag_starts.get(k).copied();
        let end = self.tag_starts.get(k + 1).copied();
        let segments = match (start, end) {
            (None, _) => 0..0,
            (Some(s), None) => s.segment..self.segments.len(),
            // The next tag's first segment is ours too when it joined it.
            (Some(s), Some(e)) => s.segment..e.segment + usize::from(e.joined()),
        };
        segments.filter_map(move |i| {
            let s = self.segments.get(i)?;
            let from = start.filter(|t| t.segment == i).map_or(0, |t| t.at);
            let to = end.filter(|t| t.segment == i && t.joined()).map_or(s.len, |t| t.at);
            (to > from).then_some((
                i,
                Segment {
                    src_offset: s.src_offset + from,
                    dst_offset: s.dst_offset + from,
                    len: to - from,
                },
            ))
        })
    }

    /// Keeps only the bytes of the objects whose tag `keep` accepts, to the byte: the plan
    /// becomes what the batch planner makes of the kept objects' bytes alone. Segments shared
    /// with dropped objects are narrowed, segments of dropped objects alone disappear, and kept
    /// pieces that a dropped object's bytes held apart join again where they are adjacent on
    /// both sides and the joined segment stays within [`max_segment`](Self::max_segment), as
    /// the planner joins fragments. `keep` is called once per tag.
    ///
    /// Without a binding maximum segment the result is exactly the plan the engine's batch
    /// planner makes of the kept objects' fragments. When the maximum cuts a run of adjacent
    /// pieces, the planner would have cut it at a fragment boundary, which a plan no longer
    /// knows; the result is then the planner's plan of the kept objects' pieces (each piece one
    /// fragment): the same bytes, the same objects in the same order, no segment past the
    /// maximum, but possibly cut at other places. Allocates only when some tag is dropped.
    pub fn retain_tags(&mut self, mut keep: impl FnMut(Tag) -> bool) {
        let Some(first_dropped) = self.tags.iter().position(|&t| !keep(t)) else { return };
        let keeps: Vec<bool> = (0..self.tags.len())
            .map(|k| k < first_dropped || (k > first_dropped && keep(self.tags[k])))
            .collect();
        let mut plan = Plan::new(self.src, self.dst, self.max_segment);
        for (k, &tag) in self.tags.iter().enumerate().filter(|&(k, _)| keeps[k]) {
            let order = self.tag_starts[k].order;
            for piece in self.tag_pieces(k) {
                plan.append(piece, tag, order);
            }
        }
        *self = plan;
    }

    /// Appends the bytes `piece` of object `tag` as the batch planner appends a fragment:
    /// extending the last segment when both sides are exactly adjacent to it and the joined
    /// length stays within the maximum, else as a new segment; the tag is recorded (with
    /// `order`) when it is not the plan's last tag already. Returns whether it was recorded.
    pub(crate) fn append(&mut self, piece: Segment, tag: Tag, order: u64) -> bool {
        let max = self.max_segment;
        let (segment, at) = match self.segments.last_mut() {
            Some(s)
                if s.src_offset.checked_add(s.len) == Some(piece.src_offset)
                    && s.dst_offset.checked_add(s.len) == Some(piece.dst_offset)
                    && s.len.checked_add(piece.len).is_some_and(|sum| sum <= max) =>
            {
                let at = s.len;
                s.len += piece.len;
                (self.segments.len() - 1, at)
            }
            _ => {
                self.segments.push(piece);
                (self.segments.len() - 1, 0)
            }
        };
        let starts = self.tags.last() != Some(&tag);
        if starts {
            self.tags.push(tag);
            self.tag_starts.push(TagStart { segment, at, order });
        }
        starts
    }

    pub(crate) fn new(src: EndpointId, dst: EndpointId, max_segment: u64) -> Self {
        Self {
            src,
            dst,
            max_segment,
            segments: Vec::new(),
            tags: Vec::new(),
            tag_starts: Vec::new(),
        }
    }

    pub(crate) fn reset(&mut self, src: EndpointId, dst: EndpointId, max_segment: u64) {
        self.src = src;
        self.dst = dst;
        self.max_segment = max_segment;
        self.segments.clear();
        self.tags.clear();
        self.tag_starts.clear();
    }
}

/// Where in a plan set a failure lies: a whole plan, one segment of it, or one object's share
/// of a segment. Engines record these while executing, and [`PlanSet::tags_at`] maps each to
/// the objects it costs. The order (plan, segment, object) groups a plan's failures together.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FailedAt {
    /// Index of the plan in [`PlanSet::plans`].
    pub plan: usize,
    /// Index of the segment in [`Plan::segments`], or `None` for the whole plan.
    pub segment: Option<usize>,
    /// The one object whose share of the segment failed, or `None` for every object there.
    pub tag: Option<Tag>,
}

impl FailedAt {
    /// The whole of plan `plan`.
    pub const fn plan(plan: usize) -> Self {
        Self { plan, segment: None, tag: None }
    }

    /// Segment `segment` of plan `plan`.
    pub const fn segment(plan: usize, segment: usize) -> Self {
        Self { plan, segment: Some(segment), tag: None }
    }

    /// Object `tag`'s share of segment `segment` of plan `plan`.
    pub const fn share(plan: usize, segment: usize, tag: Tag) -> Self {
        Self { plan, segment: Some(segment), tag: Some(tag) }
    }
}

/// Everything a builder produced for one batch: the plans, and the tags of objects that can never
/// succeed. A rejected tag is never silently dropped: the caller must report its object failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanSet {
    pub(crate) plans: Vec<Plan>,
    pub(crate) rejected: Vec<Tag>,
    /// Why each rejected tag was rejected, beside it.
    pub(crate) reasons: Vec<RejectReason>,
    pub(crate) deadline: Option<Instant>,
    pub(crate) stream: Option<DeviceStream>,
    pub(crate) cancel: Option<CancelToken>,
    pub(crate) copy_hashes: Option<CopyHashes>,
}

impl PlanSet {
    /// The plans, one per endpoint pair, in order of the pair's first committed fragment.
    pub fn plans(&self) -> &[Plan] {
        &self.plans
    }

    /// Objects rejected while planning, in the order they were rejected.
    pub fn rejected(&self) -> &[Tag] {
        &self.rejected
    }

    /// When the batch must be over: transfers that have not finished by then are cancelled
    /// and fail their objects with [`FailureCause::TimedOut`](crate::FailureCause::TimedOut).
    /// `None` (the default, and what builders produce) waits as long as the transfers take.
    /// Engines that cannot cancel a transfer once issued check it before issuing.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Sets (or clears) the [deadline](Self::deadline).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// The caller's stream that device work of this plan set may be queued on; `None` (the
    /// default, and what builders produce) lets engines use their own queues and finish on
    /// the host. See [`DeviceStream`].
    pub fn stream(&self) -> Option<DeviceStream> {
        self.stream
    }

    /// Sets (or clears) the [stream](Self::stream).
    pub fn set_stream(&mut self, stream: Option<DeviceStream>) {
        self.stream = stream;
    }

    /// The token that cancels this plan set's transfers; `None` (the default, and what builders
    /// produce) means nothing cancels them. Engines that can cancel transfers in flight (the
    /// SSD engine) stop on it and fail what had not arrived with
    /// [`FailureCause::Cancelled`](crate::FailureCause::Cancelled); others run what they were
    /// given, and the submitter (a composite) leaves the parts it has not submitted yet. See
    /// [`CancelToken`].
    pub fn cancel_token(&self) -> Option<&CancelToken> {
        self.cancel.as_ref()
    }

    /// Sets (or clears) the [cancel token](Self::cancel_token).
    pub fn set_cancel(&mut self, token: Option<CancelToken>) {
        self.cancel = token;
    }

    /// Where an engine that [hashes while
    /// copying](crate::TransferEngine::hashes_while_copying) reports the CRC32C of each piece
    /// it copies; `None` (the default, and what builders produce) asks for no hashing. Engines
    /// that do not hash while copying ignore it.
    pub fn copy_hashes(&self) -> Option<&CopyHashes> {
        self.copy_hashes.as_ref()
    }

    /// Sets (or clears) the [sink for checksums](Self::copy_hashes).
    pub fn set_copy_hashes(&mut self, sink: Option<CopyHashes>) {
        self.copy_hashes = sink;
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// One [`Failure`] per plan, naming all of its objects, with `cause`: what an engine
    /// reports for a plan set it does not run at all (an expired deadline, a lost worker).
    pub fn fail_all(&self, engine: &str, cause: FailureCause) -> Vec<Failure> {
        self.plans.iter().map(|plan| plan.fail(engine, cause.clone())).collect()
    }

    /// Each rejected object with the reason its first refused fragment got.
    pub fn rejections(&self) -> impl Iterator<Item = (Tag, RejectReason)> + '_ {
        self.rejected.iter().copied().zip(self.reasons.iter().copied())
    }

    /// Total segments over all plans.
    pub fn segment_count(&self) -> usize {
        self.plans.iter().map(Plan::segment_count).sum()
    }

    /// Total bytes over all plans.
    pub fn bytes(&self) -> u64 {
        self.plans.iter().map(Plan::bytes).sum()
    }

    /// Whether there is nothing to execute and nothing rejected.
    pub fn is_empty(&self) -> bool {
        self.plans.is_empty() && self.rejected.is_empty()
    }

    /// Every endpoint the plans read or write (an endpoint may appear more than once): what a
    /// submit [pins](crate::EndpointRegistry::pin).
    pub fn endpoints(&self) -> impl Iterator<Item = EndpointId> + '_ {
        self.plans.iter().flat_map(|p| [p.src, p.dst])
    }

    /// Keeps only the bytes of the objects whose tag `keep` accepts, in every plan (see
    /// [`Plan::retain_tags`]): plans left empty go, and the others are put in the order of
    /// their first kept object's first bytes, as planning without the dropped objects orders
    /// them. Rejected tags are left as they are. Without a binding maximum segment the plans
    /// are then exactly the batch planner's plans of the kept objects' fragments.
    pub fn retain_tags(&mut self, mut keep: impl FnMut(Tag) -> bool) {
        for plan in &mut self.plans {
            plan.retain_tags(&mut keep);
        }
        self.plans.retain(|p| !p.segments.is_empty());
        let first = |p: &Plan| p.tag_starts.first().map_or(0, |s| s.order);
        // Already sorted unless a plan's first object went.
        if !self.plans.is_sorted_by_key(first) {
            self.plans.sort_by_key(first);
        }
    }

    /// The objects a failure at `at` costs: every object of the plan, of the segment, or the
    /// one object named (nothing if `at` is out of range).
    pub fn tags_at(&self, at: FailedAt) -> &[Tag] {
        let Some(plan) = self.plans.get(at.plan) else { return &[] };
        match (at.segment, at.tag) {
            (None, _) => plan.tags(),
            (Some(s), None) => plan.segment_tags(s),
            (Some(s), Some(tag)) => {
                let tags = plan.segment_tags(s);
                tags.iter().position(|&t| t == tag).map_or(&[], |k| &tags[k..=k])
            }
        }
    }

    /// Takes the plans and rejected tags out, for engines that execute plans by value.
    pub fn into_parts(self) -> (Vec<Plan>, Vec<Tag>) {
        (self.plans, self.rejected)
    }
}
