//! Plans: what one engine executes for one (source, destination) endpoint pair.

use crate::{EndpointId, Tag};

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

/// Where a tag's fragments start inside a plan: the segment that holds its first fragment, and
/// whether that fragment extended a segment an earlier tag had opened.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct TagStart {
    pub(crate) segment: usize,
    pub(crate) joined: bool,
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
    pub(crate) segments: Vec<Segment>,
    pub(crate) tags: Vec<Tag>,
    pub(crate) tag_starts: Vec<TagStart>,
}

impl Plan {
    /// The source endpoint of every segment.
    pub fn src(&self) -> EndpointId {
        self.src
    }

    /// The destination endpoint of every segment.
    pub fn dst(&self) -> EndpointId {
        self.dst
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
        if index >= self.segments.len() {
            return &[];
        }
        // Tags start in segment order, so the tags starting at or before `index` form a prefix.
        let end = self.tag_starts.partition_point(|s| s.segment <= index);
        // Of those, the ones still running at `index` form a suffix of that prefix.
        let mut begin = end;
        while begin > 0 && self.tag_reaches(begin - 1, index) {
            begin -= 1;
        }
        &self.tags[begin..end]
    }

    /// Whether tag `k` (which starts at or before `index`) still has bytes in segment `index`.
    /// Tag `k` runs until tag `k + 1` starts; it shares that segment only if tag `k + 1` joined it.
    fn tag_reaches(&self, k: usize, index: usize) -> bool {
        match self.tag_starts.get(k + 1) {
            None => true,
            Some(next) if next.joined => next.segment >= index,
            Some(next) => next.segment > index,
        }
    }

    pub(crate) fn new(src: EndpointId, dst: EndpointId) -> Self {
        Self { src, dst, segments: Vec::new(), tags: Vec::new(), tag_starts: Vec::new() }
    }

    pub(crate) fn reset(&mut self, src: EndpointId, dst: EndpointId) {
        self.src = src;
        self.dst = dst;
        self.segments.clear();
        self.tags.clear();
        self.tag_starts.clear();
    }
}

/// Everything a builder produced for one batch: the plans, and the tags of objects that can never
/// succeed. A rejected tag is never silently dropped: the caller must report its object failed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanSet {
    pub(crate) plans: Vec<Plan>,
    pub(crate) rejected: Vec<Tag>,
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

    /// Takes the plans and rejected tags out, for engines that execute plans by value.
    pub fn into_parts(self) -> (Vec<Plan>, Vec<Tag>) {
        (self.plans, self.rejected)
    }
}
