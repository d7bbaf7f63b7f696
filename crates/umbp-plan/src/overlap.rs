//! The overlap rule, and the check every engine runs at submit (see [`OverlapCheck`]).

use crate::{DeviceOrdinal, EndpointId, Failure, FailureCause, PlanSet, RemoteRegion, Tag};

/// A space of addresses: equal addresses in one space are the same bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Space {
    /// The process's host memory (pinned host memory seen through a device alias included).
    Host,
    /// Memory of one device.
    Device(DeviceOrdinal),
    /// One open file, by descriptor, in file offsets (a file open twice is two spaces).
    File(i32),
    /// One region another node exported, in offsets from its start.
    Remote(RemoteRegion),
}

/// One range that a transfer (or a piece of one) reads or writes, and what it belongs to: what
/// [`sweep_overlaps`] pairs up. [`OverlapCheck`] owns ranges by object tag; a layer that checks
/// more than one plan set at once (a composite checking a whole batch) may carry more in `owner`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RangeAccess<T = Tag> {
    /// Where.
    pub space: Space,
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Whether the range is written (else read).
    pub write: bool,
    /// What the range belongs to (the object's tag, say).
    pub owner: T,
}

/// The accesses a [`sweep_overlaps`] keeps open while it sweeps; reuse one so that a sweep
/// allocates nothing once it is warm.
#[derive(Debug)]
pub struct SweepScratch<T> {
    writes: Vec<RangeAccess<T>>,
    reads: Vec<RangeAccess<T>>,
}

impl<T> Default for SweepScratch<T> {
    fn default() -> Self {
        Self { writes: Vec::new(), reads: Vec::new() }
    }
}

type Access = RangeAccess<Tag>;

/// Checks plan sets against the overlap rule, with buffers reused from one check to the next.
///
/// # The rule
///
/// In one submitted plan set, no byte that a fragment writes may be read or written by
/// any fragment of the set, itself included. Reads may overlap reads freely (one page restored
/// to many places is fine). A plan set that breaks the rule has no single meaning (copying its
/// fragments in another order, merged or in parallel, gives other bytes) and, for a kernel that
/// copies without ordering, no defined behaviour; so the objects whose bytes take part in an
/// overlap fail with [`FailureCause::Overlap`](crate::FailureCause::Overlap) before anything
/// runs, and nothing of them is written. The other objects run as usual. Because a merged
/// segment covers exactly the bytes of its fragments, checking segments (or their object
/// pieces) is checking fragments: merging never changes what a batch means.
///
/// # Where bytes are
///
/// Endpoint ids can alias (two registrations of one buffer), so the check
/// works on [`Space`]s and addresses the engine resolves at submit, not on ids.
///
/// # Cost
///
/// [`conflicts`](Self::conflicts) first looks at two ranges per plan (what it reads,
/// what it writes) and whether each plan's writes move forward; a restore, whose destinations
/// grow and never alias its sources, is settled there, allocation-free once the check's buffers
/// are warm. Only when those ranges meet does it sort every object's pieces and sweep them.
#[derive(Debug, Default)]
pub struct OverlapCheck {
    accesses: Vec<Access>,
    /// The sweep's live writes and reads.
    live: SweepScratch<Tag>,
}

impl OverlapCheck {
    /// A check with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// The objects of `plans` whose bytes break the overlap rule, sorted, each once. `locate`
    /// gives an endpoint's space and base address (offset 0 of the endpoint); plans with an
    /// endpoint it does not know are skipped (the engine fails them on its own). Offsets past
    /// the address space saturate, so nothing here overflows.
    pub fn conflicts(
        &mut self,
        plans: &PlanSet,
        locate: impl Fn(EndpointId) -> Option<(Space, u64)>,
    ) -> Vec<Tag> {
        // Pass one: what each plan reads and writes, as two covering ranges.
        self.accesses.clear();
        let mut ordered = true;
        for plan in plans.plans() {
            let (Some((rs, rb)), Some((ws, wb))) = (locate(plan.src()), locate(plan.dst())) else {
                continue;
            };
            let mut read = (u64::MAX, 0u64);
            let mut written = (u64::MAX, 0u64);
            for s in plan.segments() {
                let (r0, w0) = (rb.saturating_add(s.src_offset), wb.saturating_add(s.dst_offset));
                let (r1, w1) = (r0.saturating_add(s.len), w0.saturating_add(s.len));
                ordered &= w0 >= written.1;
                read = (read.0.min(r0), read.1.max(r1));
                written = (written.0.min(w0), written.1.max(w1));
            }
            let owner = Tag::new(0);
            self.accesses.push(Access {
                space: rs,
                start: read.0,
                end: read.1,
                write: false,
                owner,
            });
            self.accesses.push(Access {
                space: ws,
                start: written.0,
                end: written.1,
                write: true,
                owner,
            });
        }
        // One plan (a single transfer, say): its two ranges meet only in one space.
        let alone = match &self.accesses[..] {
            [read, write] => read.space != write.space || !meet(read, write),
            _ => false,
        };
        if ordered && (alone || sweep_overlaps(&mut self.accesses, &mut self.live, |_, _| {}) == 0)
        {
            return Vec::new();
        }
        // Pass two: every object's pieces, swept for the objects that really meet.
        self.accesses.clear();
        for plan in plans.plans() {
            let (Some((rs, rb)), Some((ws, wb))) = (locate(plan.src()), locate(plan.dst())) else {
                continue;
            };
            for (k, &tag) in plan.tags().iter().enumerate() {
                for p in plan.tag_pieces(k) {
                    let (r0, w0) =
                        (rb.saturating_add(p.src_offset), wb.saturating_add(p.dst_offset));
                    self.accesses.push(Access {
                        space: rs,
                        start: r0,
                        end: r0.saturating_add(p.len),
                        write: false,
                        owner: tag,
                    });
                    self.accesses.push(Access {
                        space: ws,
                        start: w0,
                        end: w0.saturating_add(p.len),
                        write: true,
                        owner: tag,
                    });
                }
            }
        }
        let mut tags = Vec::new();
        sweep_overlaps(&mut self.accesses, &mut self.live, |a, b| tags.extend([a.owner, b.owner]));
        tags.sort_unstable();
        tags.dedup();
        tags
    }
}

impl OverlapCheck {
    /// What an engine does at submit: finds the objects of `plans` that break the rule, takes
    /// them out of every plan (to the byte, [`PlanSet::retain_tags`]) and returns one
    /// [`Failure`] per plan that carried some, with [`FailureCause::Overlap`], named `engine`.
    /// Returns nothing and changes nothing in the common case.
    pub fn exclude(
        &mut self,
        plans: &mut PlanSet,
        engine: &str,
        locate: impl Fn(EndpointId) -> Option<(Space, u64)>,
    ) -> Vec<Failure> {
        let conflicts = self.conflicts(plans, locate);
        if conflicts.is_empty() {
            return Vec::new();
        }
        let failed = |t: &Tag| conflicts.binary_search(t).is_ok();
        let failures = plans
            .plans()
            .iter()
            .filter(|p| p.tags().iter().any(failed))
            .map(|p| Failure {
                engine: engine.to_owned(),
                src: p.src(),
                dst: p.dst(),
                tags: p.tags().iter().copied().filter(failed).collect(),
                cause: FailureCause::Overlap,
            })
            .collect();
        tracing::debug!(engine, objects = conflicts.len(), "overlapping objects excluded");
        plans.retain_tags(|t| !failed(&t));
        failures
    }
}

/// Whether two ranges share a byte.
fn meet(a: &Access, b: &Access) -> bool {
    a.start.max(b.start) < a.end.min(b.end)
}

/// Sorts `accesses` and calls `meet` for every pair that shares a byte where at least one of
/// the two writes; returns how many pairs met. Reads that meet reads are not scanned: the cost
/// is the sort plus one step per real meeting. Empty ranges meet nothing; ranges of different
/// spaces never meet. This is the sweep [`OverlapCheck`] runs over one plan set, for layers that
/// gather accesses from several.
pub fn sweep_overlaps<T: Copy>(
    accesses: &mut [RangeAccess<T>],
    scratch: &mut SweepScratch<T>,
    mut meet: impl FnMut(&RangeAccess<T>, &RangeAccess<T>),
) -> usize {
    accesses.sort_unstable_by_key(|a| (a.space, a.start));
    let mut met = 0;
    // Accesses seen in the current space that may still reach the next one: writes (checked
    // against every later access) and reads (checked against later writes only).
    let SweepScratch { writes, reads } = scratch;
    writes.clear();
    reads.clear();
    let mut space = None;
    for &a in accesses.iter().filter(|a| a.start < a.end) {
        if space != Some(a.space) {
            space = Some(a.space);
            writes.clear();
            reads.clear();
        }
        // Sorted by start: an earlier access meets `a` exactly when it ends after `a` starts.
        writes.retain(|w| w.end > a.start);
        for w in writes.iter() {
            met += 1;
            meet(w, &a);
        }
        if a.write {
            reads.retain(|r| r.end > a.start);
            for r in reads.iter() {
                met += 1;
                meet(r, &a);
            }
            writes.push(a);
        } else {
            reads.push(a);
        }
    }
    met
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(start: u64, end: u64, write: bool, tag: u32) -> Access {
        Access { space: Space::Host, start, end, write, owner: Tag::new(tag) }
    }

    fn meetings(mut accesses: Vec<Access>) -> Vec<(u32, u32)> {
        let mut pairs = Vec::new();
        sweep_overlaps(&mut accesses, &mut Default::default(), |a, b| {
            let (a, b) = (a.owner.get(), b.owner.get());
            let (a, b) = (a.min(b), a.max(b));
            pairs.push((a, b));
        });
        pairs.sort_unstable();
        pairs
    }

    #[test]
    fn writes_meet_everything_they_share_a_byte_with_and_reads_meet_only_writes() {
        // Adjacent ranges share nothing.
        assert!(meetings(vec![access(0, 10, false, 0), access(10, 20, true, 1)]).is_empty());
        // Reads of the same bytes are fine.
        assert!(meetings(vec![access(0, 10, false, 0), access(0, 10, false, 1)]).is_empty());
        assert_eq!(meetings(vec![access(20, 30, true, 0), access(25, 35, true, 1)]), [(0, 1)]);
        assert_eq!(meetings(vec![access(5, 15, true, 0), access(0, 10, false, 1)]), [(0, 1)]);
        // A long write meets every read inside it; the reads do not meet each other.
        let inside = vec![
            access(0, 100, true, 0),
            access(10, 20, false, 1),
            access(30, 40, false, 2),
            access(35, 45, false, 3),
        ];
        assert_eq!(meetings(inside), [(0, 1), (0, 2), (0, 3)]);
        // A read that a later write starts inside of.
        assert_eq!(meetings(vec![access(0, 50, false, 4), access(49, 60, true, 5)]), [(4, 5)]);
        // Different spaces never meet; empty ranges never meet.
        let mut device = access(0, 10, true, 6);
        device.space = Space::Device(DeviceOrdinal::new(0));
        assert!(meetings(vec![device, access(0, 10, true, 7), access(5, 5, true, 8)]).is_empty());
    }

    #[test]
    fn the_sweep_agrees_with_checking_every_pair() {
        // A fixed pseudo-random stream of small ranges over two spaces.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        for _ in 0..300 {
            let accesses: Vec<Access> = (0..next(12) as u32)
                .map(|tag| {
                    let start = next(64);
                    Access {
                        space: if next(4) == 0 { Space::File(3) } else { Space::Host },
                        start,
                        end: start + next(16),
                        write: next(2) == 0,
                        owner: Tag::new(tag),
                    }
                })
                .collect();
            let mut want = Vec::new();
            for (i, a) in accesses.iter().enumerate() {
                for b in &accesses[i + 1..] {
                    let share = a.space == b.space && a.start.max(b.start) < a.end.min(b.end);
                    if share && (a.write || b.write) {
                        want.push((
                            a.owner.get().min(b.owner.get()),
                            a.owner.get().max(b.owner.get()),
                        ));
                    }
                }
            }
            want.sort_unstable();
            assert_eq!(meetings(accesses.clone()), want, "{accesses:?}");
        }
    }
}
