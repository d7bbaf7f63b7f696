//! The overlap rule over a whole batch: every engine's plans of every layer group and every
//! fragment of the staged route, checked together at [`finish`](crate::CompositeBuilder::finish).
//!
//! The rule is umbp-plan's ([`OverlapCheck`](umbp_plan::OverlapCheck)): no byte that a fragment
//! writes may be read or written by any other fragment of the batch. Each engine checks its own
//! plan set at submit; only the composite sees two engines, two layer groups, or a direct part
//! and a stage writing the same bytes, so it checks the batch before anything runs. The bounce
//! region is not checked: each stage holds its own slot of it.
//!
//! The check works as the engines' does. Pass one looks at two covering ranges per plan (and
//! per run of staged fragments with one pair): what it reads, what it writes, and whether its
//! writes move forward; a restore, whose destinations grow and never alias its sources, is
//! settled there. Only when those ranges meet does pass two sort every object's pieces and sweep
//! them. Both passes reuse the check's buffers, so a reused builder allocates nothing here in the
//! common case.

use umbp_plan::{
    sweep_overlaps, EndpointId, EndpointKind, EndpointTable, RangeAccess, Space, SweepScratch, Tag,
};

use crate::routed::{RoutedPart, StagedFragment};

/// An object that breaks the rule, with the pair of one of its pieces that met another's.
pub(crate) type Conflict = (Tag, EndpointId, EndpointId);

/// One range a fragment (or a piece of one) reads or writes, owned by its object and the pair
/// it came from.
type Access = RangeAccess<Conflict>;

/// The whole-batch overlap check, with its buffers kept from one batch to the next.
#[derive(Debug, Default)]
pub(crate) struct BatchOverlap {
    accesses: Vec<Access>,
    /// The sweep's live writes and reads.
    live: SweepScratch<Conflict>,
    found: Vec<Conflict>,
}

/// Covering ranges of one run of pieces with one pair, built piece by piece.
struct Cover {
    read: (u64, u64),
    written: (u64, u64),
    /// Whether every piece wrote at or past the end of every earlier one.
    ordered: bool,
}

impl Cover {
    const EMPTY: Self = Self { read: (u64::MAX, 0), written: (u64::MAX, 0), ordered: true };

    fn add(&mut self, read_base: u64, write_base: u64, src_offset: u64, dst_offset: u64, len: u64) {
        let (r0, w0) =
            (read_base.saturating_add(src_offset), write_base.saturating_add(dst_offset));
        let (r1, w1) = (r0.saturating_add(len), w0.saturating_add(len));
        self.ordered &= w0 >= self.written.1;
        self.read = (self.read.0.min(r0), self.read.1.max(r1));
        self.written = (self.written.0.min(w0), self.written.1.max(w1));
    }
}

/// An endpoint's space and the address of its offset 0, as the engines resolve it.
fn locate(table: &EndpointTable, id: EndpointId) -> Option<(Space, u64)> {
    let e = table.get(id)?;
    match e.kind() {
        EndpointKind::Host => Some((Space::Host, e.addr())),
        EndpointKind::Device(d) => Some((Space::Device(d), e.addr())),
        EndpointKind::File(f) => Some((Space::File(f.fd), f.file_offset)),
        EndpointKind::Remote(r) => Some((Space::Remote(r), e.addr())),
        // A kind this composite does not know: its engine checks it alone.
        _ => None,
    }
}

impl BatchOverlap {
    /// The objects of the batch (`parts` and `staged`, endpoints resolved in `table`) whose
    /// bytes break the overlap rule, sorted by tag, each once. Empty, and allocation-free once
    /// the buffers are warm, in the common case.
    pub(crate) fn conflicts(
        &mut self,
        parts: &[RoutedPart],
        staged: &[StagedFragment],
        table: &EndpointTable,
    ) -> &[Conflict] {
        self.found.clear();
        if !self.pass_one(parts, staged, table) {
            self.pass_two(parts, staged, table);
        }
        &self.found
    }

    /// Whether the covering ranges settle the batch as free of overlaps.
    fn pass_one(
        &mut self,
        parts: &[RoutedPart],
        staged: &[StagedFragment],
        table: &EndpointTable,
    ) -> bool {
        self.accesses.clear();
        let mut ordered = true;
        let tag = Tag::new(0);
        let mut push = |accesses: &mut Vec<Access>, cover: &Cover, (rs, ws), (src, dst)| {
            ordered &= cover.ordered;
            let (start, end) = cover.read;
            accesses.push(Access { space: rs, start, end, write: false, owner: (tag, src, dst) });
            let (start, end) = cover.written;
            accesses.push(Access { space: ws, start, end, write: true, owner: (tag, src, dst) });
        };
        for plan in parts.iter().flat_map(|p| p.plans.plans()) {
            let (src, dst) = (plan.src(), plan.dst());
            let (Some((rs, rb)), Some((ws, wb))) = (locate(table, src), locate(table, dst)) else {
                continue;
            };
            let mut cover = Cover::EMPTY;
            for s in plan.segments() {
                cover.add(rb, wb, s.src_offset, s.dst_offset, s.len);
            }
            push(&mut self.accesses, &cover, (rs, ws), (src, dst));
        }
        for run in staged
            .chunk_by(|a, b| (a.fragment.src, a.fragment.dst) == (b.fragment.src, b.fragment.dst))
        {
            let (src, dst) = (run[0].fragment.src, run[0].fragment.dst);
            let (Some((rs, rb)), Some((ws, wb))) = (locate(table, src), locate(table, dst)) else {
                continue;
            };
            let mut cover = Cover::EMPTY;
            for f in run.iter().map(|s| &s.fragment) {
                cover.add(rb, wb, f.src_offset, f.dst_offset, f.len);
            }
            push(&mut self.accesses, &cover, (rs, ws), (src, dst));
        }
        ordered && sweep_overlaps(&mut self.accesses, &mut self.live, |_, _| {}) == 0
    }

    /// Every object's pieces, swept: the objects that really meet go to `found`.
    fn pass_two(&mut self, parts: &[RoutedPart], staged: &[StagedFragment], table: &EndpointTable) {
        self.accesses.clear();
        let mut piece = |tag,
                         (rs, rb): (Space, u64),
                         (ws, wb): (Space, u64),
                         src,
                         dst,
                         s: (u64, u64, u64)| {
            let (src_offset, dst_offset, len) = s;
            let (r0, w0) = (rb.saturating_add(src_offset), wb.saturating_add(dst_offset));
            let read = Access {
                space: rs,
                start: r0,
                end: r0.saturating_add(len),
                write: false,
                owner: (tag, src, dst),
            };
            let write =
                Access { space: ws, start: w0, end: w0.saturating_add(len), write: true, ..read };
            self.accesses.extend([read, write]);
        };
        for plan in parts.iter().flat_map(|p| p.plans.plans()) {
            let (src, dst) = (plan.src(), plan.dst());
            let (Some(r), Some(w)) = (locate(table, src), locate(table, dst)) else { continue };
            for (k, &tag) in plan.tags().iter().enumerate() {
                for p in plan.tag_pieces(k) {
                    piece(tag, r, w, src, dst, (p.src_offset, p.dst_offset, p.len));
                }
            }
        }
        for f in staged.iter().map(|s| &s.fragment) {
            let (Some(r), Some(w)) = (locate(table, f.src), locate(table, f.dst)) else { continue };
            piece(f.tag, r, w, f.src, f.dst, (f.src_offset, f.dst_offset, f.len));
        }
        let found = &mut self.found;
        sweep_overlaps(&mut self.accesses, &mut self.live, |a, b| found.extend([a.owner, b.owner]));
        // Each object keeps the pair of one of its meetings.
        found.sort_unstable_by_key(|c| c.0);
        found.dedup_by_key(|c| c.0);
    }
}
