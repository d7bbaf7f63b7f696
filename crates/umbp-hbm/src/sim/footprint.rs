//! What a running launch or copy reads and writes, so that the simulator can run several side by
//! side, outside its state lock, as a GPU runs kernels from several streams at once.
//!
//! Two pieces of work may run together unless one writes bytes the other reads or writes: then
//! the later one waits. Streams of a GPU keep no order between them, so waiting changes no
//! result a program may rely on, and it keeps two threads from ever writing the same bytes at
//! once (a data race in host memory, where the simulator's device memory lives).

/// Sorted, disjoint byte ranges `start .. end` read and written by one piece of work.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Footprint {
    reads: Vec<(u64, u64)>,
    writes: Vec<(u64, u64)>,
}

impl Footprint {
    /// The footprint of ranges `(start, end, written, _)` sorted by start (the overlap check's
    /// scratch after it ran).
    pub(super) fn of_sorted(ranges: &[(u64, u64, bool, usize)]) -> Self {
        let mut f = Self::default();
        for &(start, end, written, _) in ranges {
            push_merged(if written { &mut f.writes } else { &mut f.reads }, start, end);
        }
        f
    }

    /// A copy's footprint: `len` bytes read at `src`, written at `dst`.
    pub(super) fn copy(src: u64, dst: u64, len: u64) -> Self {
        let mut f = Self::default();
        push_merged(&mut f.reads, src, src.saturating_add(len));
        push_merged(&mut f.writes, dst, dst.saturating_add(len));
        f
    }

    /// Writing (or freeing) `len` bytes at `addr`.
    pub(super) fn write(addr: u64, len: u64) -> Self {
        let mut f = Self::default();
        push_merged(&mut f.writes, addr, addr.saturating_add(len));
        f
    }

    /// Reading `len` bytes at `addr`.
    pub(super) fn read(addr: u64, len: u64) -> Self {
        let mut f = Self::default();
        push_merged(&mut f.reads, addr, addr.saturating_add(len));
        f
    }

    /// Whether the two may not run at once: one writes what the other reads or writes.
    pub(super) fn conflicts(&self, other: &Self) -> bool {
        meet(&self.writes, &other.writes)
            || meet(&self.writes, &other.reads)
            || meet(&self.reads, &other.writes)
    }
}

/// Appends `start .. end` to sorted, disjoint `ranges` (starts arrive in ascending order),
/// merging it into the last range when the two overlap or touch.
fn push_merged(ranges: &mut Vec<(u64, u64)>, start: u64, end: u64) {
    if start >= end {
        return;
    }
    match ranges.last_mut() {
        Some(last) if start <= last.1 => last.1 = last.1.max(end),
        _ => ranges.push((start, end)),
    }
}

/// Whether two sorted lists of disjoint ranges share a byte.
fn meet(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (x, y) = (a[i], b[j]);
        if x.0 < y.1 && y.0 < x.1 {
            return true;
        }
        if x.1 <= y.1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_conflicts_only_where_one_side_writes_what_the_other_touches() {
        let a = Footprint::copy(0, 100, 10); // reads 0..10, writes 100..110
        assert!(!a.conflicts(&Footprint::copy(0, 200, 10)), "reading the same bytes is fine");
        assert!(a.conflicts(&Footprint::copy(300, 105, 10)), "both write 105..110");
        assert!(a.conflicts(&Footprint::copy(108, 400, 10)), "one reads what the other writes");
        assert!(a.conflicts(&Footprint::copy(400, 5, 10)), "one writes what the other reads");
        assert!(!a.conflicts(&Footprint::copy(110, 10, 10)), "touching ends share no byte");
        assert!(!a.conflicts(&Footprint::default()));
    }

    #[test]
    fn sorted_ranges_merge_and_are_searched_past_their_first() {
        // Sorted by start: reads 0..10 and 15..20, writes 30..40 and 35..50 (merged to 30..50).
        let f = Footprint::of_sorted(&[
            (0, 10, false, 0),
            (15, 20, false, 1),
            (30, 40, true, 2),
            (35, 50, true, 3),
        ]);
        assert_eq!(f.reads, [(0, 10), (15, 20)]);
        assert_eq!(f.writes, [(30, 50)]);
        assert!(f.conflicts(&Footprint::write(18, 1)), "the second read range counts");
        assert!(f.conflicts(&Footprint::read(49, 1)));
        assert!(!f.conflicts(&Footprint::read(20, 10)));
        assert!(!f.conflicts(&Footprint::write(50, 10)));
    }
}
