//! Block checksums: the CRC32C of an object's bytes, recorded when it is offloaded and verified
//! when it is restored, so that no load ever reports success with bytes other than the saved
//! ones.
//!
//! # What is hashed
//!
//! An object's *message* is the bytes of its ranges, concatenated in range order (ranges are
//! sorted and disjoint): the whole object when the caller moves all of it, as the connectors
//! do. Its checksum is `crc32c(message)`, the CRC-32C (Castagnoli) every storage stack uses,
//! computed with the CPU's instruction.
//!
//! # Where it is hashed
//!
//! By the engine that copies them, where it can: an engine that [hashes while
//! copying](umbp_plan::TransferEngine::hashes_while_copying) every pair of a part (the host-copy
//! engine, the simulated device) gets a sink with the part's plan set and reports each object's
//! pieces with their CRC32C as it copies them, one read of the bytes for both; the composite
//! places each piece in its object's message ([`Checks::span`]) and hashes none of the part
//! itself. An engine that promises this and reports a wrong CRC, or none, fails the object as a
//! mismatch or as unverifiable, never as a success.
//!
//! Otherwise wherever the bytes sit in host memory on their way, so that no extra copy is
//! made:
//!
//! - the staged route (SSD or remote to device, device to SSD or remote): each stage hashes its
//!   fragments in the bounce slot once the first hop landed, while the second hop's engine
//!   reads them out (an asynchronous copy to a GPU, SSD writes), before the slot is released;
//! - a direct route with a host side: the side the engine reads when it is host memory (a
//!   restore's DRAM tier pages, an offload's source), right after the part is submitted,
//!   while the engine works; else the side it writes (a restore's destination, an offload's
//!   DRAM tier pages) once the part settled;
//! - a direct route with no host side (device to device, which no connector uses) cannot be
//!   hashed: the checksum is unknown. An offload reports none; a restore that expected one
//!   fails the object with [`FailureCause::ChecksumUnverifiable`] rather than serve it
//!   unverified.
//!
//! Pieces land in any order on any executor or engine thread. Each object keeps the CRC of its
//! message's longest prefix hashed so far: a piece that starts where the prefix ends is hashed
//! onto it (`crc32c_append`), one that lands early is hashed alone and joined later
//! ([`checksum::combine`], a few dozen nanoseconds whatever the length). Nothing is allocated
//! or hashed per fragment when checksums are off: a batch without checked objects has no
//! [`Checks`] at all.
//!
//! # When it is checked
//!
//! When an object's last part has run (every hop of every stage and every direct part that
//! carried it), before the part settles, so an object is never seen completed before its
//! checksum is known. A mismatch fails exactly that object, with
//! [`FailureCause::ChecksumMismatch`]; its siblings are untouched.

// One block reads registered host memory to hash it (`host_crc`); it says why that holds.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use umbp_plan::checksum::{self, CopyHashes};
use umbp_plan::{
    Endpoint, EndpointId, EndpointKind, EndpointTable, Failure, FailureCause, PageWalk, Plan,
    PlanSet, Segment, Tag, TransferEngine, WalkError,
};

use crate::metrics::{endpoint_kind_name, Metrics};
use crate::object::ObjectTransfer;
use crate::staging::StagePiece;

/// Which objects a composite checksums, by the kind of tier that holds them
/// ([`CompositeConfig::checksums`](crate::CompositeConfig::checksums)).
///
/// For a covered object, an offload reports the CRC32C of the bytes it wrote
/// ([`ObjectResult::checksum`](crate::ObjectResult::checksum)) and a restore given an expected
/// checksum ([`ObjectTransfer::checksum`]) verifies it. Objects of other tiers move unhashed:
/// an offload reports no checksum, and a restore ignores the one it was given.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum ChecksumPolicy {
    /// Nothing is hashed.
    Off,
    /// Objects in a file (SSD) or in another node's memory: their bytes cross the bounce
    /// region or host memory anyway, and hashing them costs a small share of the disk's or
    /// the network's time. The default.
    #[default]
    FilesAndRemote,
    /// Objects in every tier, DRAM included. Where the engine that moves a DRAM object hashes
    /// while copying (the host-copy engine, the simulated device), this costs a few percent of
    /// the copy; where it does not (a GPU's DMA reads the pages), the composite hashes the
    /// source pages beside it, an extra pass over host memory.
    AllTiers,
}

impl ChecksumPolicy {
    /// Whether objects held in `tier` are checksummed.
    pub fn covers(self, tier: &Endpoint) -> bool {
        match self {
            Self::Off => false,
            Self::FilesAndRemote => {
                matches!(tier.kind(), EndpointKind::File(_) | EndpointKind::Remote(_))
            }
            Self::AllTiers => true,
        }
    }

    /// The policy's name in the bindings: `"off"`, `"files_and_remote"`, `"all_tiers"`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::FilesAndRemote => "files_and_remote",
            Self::AllTiers => "all_tiers",
        }
    }

    /// The policy named `name` ([`name`](Self::name)).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Off, Self::FilesAndRemote, Self::AllTiers].into_iter().find(|p| p.name() == name)
    }
}

/// One object's layout, copied from the caller's [`ObjectTransfer`].
struct ObjectCheck {
    /// The caller's tag, for the log.
    tag: u64,
    /// Whether the object is hashed (decided against the policy at submit).
    tracked: bool,
    /// The checksum a restore must find.
    expect: Option<u32>,
    tier: EndpointId,
    /// Its ranges in [`Checks::ranges`].
    ranges: (usize, usize),
    /// Its page table in [`Checks::pages`].
    pages: (usize, usize),
    page_size: u64,
    size: u64,
    /// The message's length: the sum of its ranges.
    total: u64,
}

/// One range, and where its bytes sit in the object's message.
#[derive(Copy, Clone)]
struct RangeCheck {
    offset: u64,
    len: u64,
    endpoint: EndpointId,
    endpoint_offset: u64,
    group: u32,
    /// Message position of its first byte.
    at: u64,
}

/// The layout of a restore's or offload's objects, made before submit (see [`Checks`]).
pub(crate) struct ChecksPlan {
    restore: bool,
    objects: Vec<ObjectCheck>,
    ranges: Vec<RangeCheck>,
    pages: Vec<u64>,
}

impl ChecksPlan {
    /// Copies the layout of `objects` (positions are the batch's tags). A restore tracks the
    /// objects given an expected checksum, an offload every object; the policy narrows that
    /// at submit.
    pub(crate) fn new(restore: bool, objects: &[ObjectTransfer<'_>]) -> Self {
        let mut ranges = Vec::with_capacity(objects.iter().map(|o| o.ranges.len()).sum());
        let mut pages =
            Vec::with_capacity(objects.iter().map(|o| o.object.page_offsets.len()).sum());
        let objects = objects
            .iter()
            .map(|o| {
                let (r0, p0) = (ranges.len(), pages.len());
                let mut at = 0u64;
                for r in o.ranges {
                    ranges.push(RangeCheck {
                        offset: r.offset,
                        len: r.len,
                        endpoint: r.endpoint,
                        endpoint_offset: r.endpoint_offset,
                        group: r.group,
                        at,
                    });
                    at = at.saturating_add(r.len);
                }
                pages.extend_from_slice(o.object.page_offsets);
                ObjectCheck {
                    tag: o.tag,
                    tracked: !restore || o.checksum.is_some(),
                    expect: o.checksum,
                    tier: o.object.tier,
                    ranges: (r0, ranges.len()),
                    pages: (p0, pages.len()),
                    page_size: o.object.page_size,
                    size: o.object.size,
                    total: at,
                }
            })
            .collect();
        Self { restore, objects, ranges, pages }
    }

    /// The batch's checks under `policy`, its endpoints described by `table`; `None` when no
    /// object is covered (then nothing is hashed).
    pub(crate) fn resolve(
        mut self,
        policy: ChecksumPolicy,
        table: Arc<EndpointTable>,
        metrics: Arc<Metrics>,
        metered: bool,
    ) -> Option<Checks> {
        for o in &mut self.objects {
            o.tracked &= table.get(o.tier).is_some_and(|t| policy.covers(t));
        }
        if !self.objects.iter().any(|o| o.tracked) {
            return None;
        }
        let n = self.objects.len();
        Some(Checks {
            restore: self.restore,
            table,
            objects: self.objects,
            ranges: self.ranges,
            pages: self.pages,
            left: (0..n).map(|_| AtomicU32::new(0)).collect(),
            hints: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            state: Mutex::new((0..n).map(|_| Running::default()).collect()),
            metrics,
            metered,
        })
    }
}

/// The side of a direct route that is hashed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// The side the engine reads: its bytes are there before the part runs.
    Read,
    /// The side the engine writes: its bytes are there once the part settled.
    Written,
}

/// A piece of a message hashed alone, waiting to join the prefix.
#[derive(Copy, Clone)]
struct Piece {
    at: u64,
    len: u64,
    crc: u32,
}

/// One object's hashing so far.
#[derive(Default)]
struct Running {
    /// The message's first `len` bytes are hashed, into `crc`.
    len: u64,
    crc: u32,
    /// A thread is hashing onto the prefix (outside the lock).
    extending: bool,
    /// Some bytes could not be hashed: the checksum is unknown.
    unknown: bool,
    /// Pieces past the prefix.
    later: Vec<Piece>,
    /// The final checksum, once the object's last part ran.
    sum: Option<u32>,
}

/// What a settled object's checksum came to.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Outcome {
    Verified,
    Mismatch,
    Unverifiable,
    Recorded,
    Unknown,
}

impl Outcome {
    const fn name(self) -> &'static str {
        match self {
            Self::Verified => "verified",
            Self::Mismatch => "mismatch",
            Self::Unverifiable => "unverifiable",
            Self::Recorded => "recorded",
            Self::Unknown => "unknown",
        }
    }
}

/// One batch's checksums: the objects' layout, each object's hashing so far, and how many of
/// its parts are still to run.
pub(crate) struct Checks {
    restore: bool,
    /// The batch's pinned endpoints.
    table: Arc<EndpointTable>,
    objects: Vec<ObjectCheck>,
    ranges: Vec<RangeCheck>,
    pages: Vec<u64>,
    /// Parts still to run, per object; the part that brings it to zero finishes the checksum.
    left: Vec<AtomicU32>,
    /// Where each object's last piece reported by an engine was found (a range or page), where
    /// its next one usually is: engines report an object's pieces mostly in order.
    hints: Vec<AtomicUsize>,
    state: Mutex<Vec<Running>>,
    metrics: Arc<Metrics>,
    metered: bool,
}

impl Checks {
    fn lock(&self) -> MutexGuard<'_, Vec<Running>> {
        // Each critical section leaves every `Running` consistent before anything can panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Object `tag`'s position, when it is tracked.
    fn tracked(&self, tag: Tag) -> Option<usize> {
        let i = tag.index();
        self.objects.get(i).filter(|o| o.tracked).map(|_| i)
    }

    /// Sets how many parts carry each object (the batch's count at submit).
    pub(crate) fn set_parts(&self, pending: &[u32]) {
        for (left, &n) in self.left.iter().zip(pending) {
            // Relaxed: set before the batch is shared with any executor thread.
            left.store(n, Ordering::Relaxed);
        }
    }

    /// The checksum object `i` came to, once its last part ran (or at submit, for an object
    /// with nothing to move).
    pub(crate) fn checksum(&self, i: usize) -> Option<u32> {
        self.lock().get(i).and_then(|r| r.sum)
    }

    /// Adds `len` bytes at message position `at` of object `o`, which `feed` hashes: given a
    /// CRC it returns that CRC extended with the bytes, or `None` if they cannot be read.
    fn add(&self, o: usize, at: u64, len: u64, feed: impl FnOnce(u32) -> Option<u32>) {
        if len == 0 {
            return;
        }
        let start = {
            let mut state = self.lock();
            let r = &mut state[o];
            if r.unknown {
                return;
            }
            let onto = !r.extending && r.len == at;
            r.extending |= onto;
            onto.then_some(r.crc)
        };
        let crc = feed(start.unwrap_or(0));
        if self.metered {
            self.metrics.record_checksum_bytes(len);
        }
        let mut state = self.lock();
        let r = &mut state[o];
        let Some(crc) = crc else {
            r.unknown = true;
            r.extending &= start.is_none();
            return;
        };
        match start {
            Some(_) => {
                r.extending = false;
                r.len = at + len;
                r.crc = crc;
            }
            // The prefix reached the piece while it was hashed alone.
            None if !r.extending && r.len == at => {
                r.crc = checksum::combine(r.crc, crc, len);
                r.len = at + len;
            }
            None => {
                r.later.push(Piece { at, len, crc });
                return;
            }
        }
        absorb(r);
    }

    /// The sink through which `engine` reports the checksums of what it copies for `plans`,
    /// when it [hashes while copying](TransferEngine::hashes_while_copying) every pair of them
    /// and they carry a tracked object; `None` when the executor must hash the part itself.
    pub(crate) fn copy_sink(
        self: &Arc<Self>,
        engine: &dyn TransferEngine,
        plans: &PlanSet,
    ) -> Option<CopyHashes> {
        let tracked =
            plans.plans().iter().flat_map(Plan::tags).any(|&t| self.is_tracked(t.index()));
        let hashed = plans.plans().iter().all(|p| {
            let (src, dst) = (self.table.get(p.src()), self.table.get(p.dst()));
            src.zip(dst).is_some_and(|(s, d)| engine.hashes_while_copying(s, d))
        });
        if !tracked || !hashed {
            return None;
        }
        let checks = Arc::clone(self);
        Some(CopyHashes::new(move |plan, tag, piece, crc| checks.copied(plan, tag, piece, crc)))
    }

    /// An engine copied `piece` of object `tag` in `plan`, its bytes hashing to `crc`: joins it
    /// at its place in the object's message, found from the side it writes (as a staged
    /// piece's). A piece whose place cannot be found leaves the checksum unknown.
    fn copied(&self, plan: &Plan, tag: Tag, piece: Segment, crc: u32) {
        let Some(i) = self.tracked(tag) else { return };
        let o = &self.objects[i];
        let tier = if self.restore { plan.src() } else { plan.dst() };
        if o.tier != tier {
            return;
        }
        // Relaxed: a hint; any value is correct, a stale one only slower.
        let mut hint = self.hints[i].load(Ordering::Relaxed);
        let at = self.span(o, &mut hint, plan.dst(), piece.dst_offset, piece.len);
        self.hints[i].store(hint, Ordering::Relaxed);
        if self.metered {
            self.metrics.record_checksum_bytes(piece.len);
        }
        let mut state = self.lock();
        let r = &mut state[i];
        match at {
            // Hashed already: joined under one lock, onto the prefix or kept for later.
            Some(at) if !r.unknown && !r.extending && r.len == at => {
                r.crc = checksum::combine(r.crc, crc, piece.len);
                r.len = at + piece.len;
                absorb(r);
            }
            Some(at) if !r.unknown => r.later.push(Piece { at, len: piece.len, crc }),
            Some(_) => {}
            None => r.unknown = true,
        }
    }

    /// Hashes the ranges a direct part of layer group `group` moves whose host side is
    /// `side`, for the objects of its plans (`(source, destination, tags)` each) that `failed`
    /// does not name. The read side is hashed once the part is submitted, while its engine
    /// works; the written side once the part settled.
    pub(crate) fn hash_part<'a>(
        &self,
        group: u32,
        plans: impl Iterator<Item = (EndpointId, EndpointId, &'a [Tag])>,
        side: Side,
        failed: &dyn Fn(Tag) -> bool,
    ) {
        for (src, dst, tags) in plans {
            let (tier, caller) = match self.restore {
                true => (src, dst),
                false => (dst, src),
            };
            for &tag in tags {
                let Some(i) = self.tracked(tag) else { continue };
                let o = &self.objects[i];
                if o.tier != tier || failed(tag) {
                    continue;
                }
                let ranges = &self.ranges[o.ranges.0..o.ranges.1];
                let Some(host) = self.host_side(o, caller) else {
                    // Neither side is host memory: the object's checksum is unknown.
                    self.lock()[i].unknown = true;
                    continue;
                };
                if host != side {
                    continue;
                }
                let ours = |r: &RangeCheck| r.group == group && r.endpoint == caller && r.len > 0;
                let mut k = 0;
                while k < ranges.len() {
                    if !ours(&ranges[k]) {
                        k += 1;
                        continue;
                    }
                    // A run of consecutive ranges: contiguous in the message, hashed as one.
                    let end = k + ranges[k..].iter().take_while(|r| ours(r)).count();
                    let run = &ranges[k..end];
                    let len = run.iter().map(|r| r.len).sum();
                    self.add(i, run[0].at, len, |crc| {
                        run.iter().try_fold(crc, |crc, r| self.range_crc(o, r, crc))
                    });
                    k = end;
                }
            }
        }
    }

    /// Which side of a direct route between object `o`'s tier and `caller` is hashed: the
    /// side read when it is host memory (hashed while the engine works), else the side
    /// written; `None` when neither is host memory.
    fn host_side(&self, o: &ObjectCheck, caller: EndpointId) -> Option<Side> {
        let tier = self.table.get(o.tier)?.is_host();
        let caller = self.table.get(caller)?.is_host();
        let (read, written) = if self.restore { (tier, caller) } else { (caller, tier) };
        match (read, written) {
            (true, _) => Some(Side::Read),
            (false, true) => Some(Side::Written),
            (false, false) => None,
        }
    }

    /// `crc` extended with range `r` of object `o`, read from its host side (see
    /// [`host_side`](Self::host_side)); `None` when it cannot be read.
    fn range_crc(&self, o: &ObjectCheck, r: &RangeCheck, crc: u32) -> Option<u32> {
        let caller = self.table.get(r.endpoint)?;
        let tier = self.table.get(o.tier)?;
        let from_tier = match self.host_side(o, r.endpoint)? {
            Side::Read => self.restore,
            Side::Written => !self.restore,
        };
        if !from_tier {
            return host_crc(caller, r.endpoint_offset, r.len, crc);
        }
        let pages = &self.pages[o.pages.0..o.pages.1];
        let walk = PageWalk::new(pages, o.page_size, o.size).ok()?;
        let mut crc = Some(crc);
        let walked = walk.walk(r.offset, r.len, 0, |page| {
            crc = crc.and_then(|c| host_crc(tier, page.tier_offset, page.len, c));
            Ok::<(), WalkError>(())
        });
        walked.ok().and(crc)
    }

    /// Hashes a stage's pieces in its bounce slot (`bounce` from `base`), after its first hop
    /// landed, skipping the objects `failed` names.
    pub(crate) fn hash_stage(
        &self,
        bounce: &Endpoint,
        base: u64,
        pieces: &[StagePiece],
        failed: &dyn Fn(Tag) -> bool,
    ) {
        for run in pieces.chunk_by(|a, b| a.fragment.fragment.tag == b.fragment.fragment.tag) {
            let tag = run[0].fragment.fragment.tag;
            let Some(i) = self.tracked(tag) else { continue };
            if failed(tag) {
                continue;
            }
            let o = &self.objects[i];
            let mut hint = 0;
            let mut k = 0;
            while k < run.len() {
                let Some(at) = self.position(o, &mut hint, &run[k]) else {
                    self.lock()[i].unknown = true;
                    break;
                };
                // Pieces that follow each other in the message, hashed as one.
                let mut end = at + run[k].fragment.fragment.len;
                let mut j = k + 1;
                while j < run.len() && self.position(o, &mut hint, &run[j]) == Some(end) {
                    end += run[j].fragment.fragment.len;
                    j += 1;
                }
                let sub = &run[k..j];
                self.add(i, at, end - at, |crc| {
                    sub.iter().try_fold(crc, |crc, p| {
                        host_crc(bounce, base + p.at, p.fragment.fragment.len, crc)
                    })
                });
                k = j;
            }
        }
    }

    /// The message position of a staged piece of object `o` (see [`span`](Self::span)).
    fn position(&self, o: &ObjectCheck, hint: &mut usize, p: &StagePiece) -> Option<u64> {
        let f = p.fragment.fragment;
        self.span(o, hint, f.dst, f.dst_offset, f.len)
    }

    /// The message position of `len` bytes of object `o` written at `dst_offset` of `dst`,
    /// found from the side they are written to, which the overlap rule makes unique: a
    /// restore's destination ranges, an offload's tier pages. The bytes may run over several
    /// ranges or pages only where those follow each other both there and in the message;
    /// `None` otherwise, or when they are not the object's. `hint` remembers the last range or
    /// page found, where the next piece usually is.
    fn span(
        &self,
        o: &ObjectCheck,
        hint: &mut usize,
        dst: EndpointId,
        dst_offset: u64,
        len: u64,
    ) -> Option<u64> {
        let ranges = &self.ranges[o.ranges.0..o.ranges.1];
        if self.restore {
            let starts = |r: &RangeCheck| {
                r.endpoint == dst
                    && dst_offset >= r.endpoint_offset
                    && dst_offset - r.endpoint_offset < r.len
            };
            let k = find(ranges.len(), hint, |k| starts(&ranges[k]))?;
            let r = &ranges[k];
            // The ranges after it must go on where it ends, in the destination.
            let follows = |prev: &RangeCheck, next: &RangeCheck| {
                next.endpoint == dst && next.endpoint_offset == prev.endpoint_offset + prev.len
            };
            let first = r.endpoint_offset + r.len - dst_offset;
            return covers(&ranges[k..], first, len, follows)
                .then(|| r.at + (dst_offset - r.endpoint_offset));
        }
        let (pages, size) = (&self.pages[o.pages.0..o.pages.1], o.page_size);
        let k =
            find(pages.len(), hint, |k| dst_offset >= pages[k] && dst_offset - pages[k] < size)?;
        // Pages after it must go on where it ends, in the tier.
        let mut covered = pages[k] + size - dst_offset;
        let mut j = k;
        while covered < len {
            j += 1;
            if *pages.get(j)? != pages[j - 1] + size {
                return None;
            }
            covered += size;
        }
        // The next piece usually starts on the page after the last one this one covers.
        *hint = j;
        let offset = k as u64 * size + (dst_offset - pages[k]);
        let k = ranges.iter().position(|r| offset >= r.offset && offset - r.offset < r.len)?;
        let r = &ranges[k];
        // Ranges after it must go on where it ends, in the object.
        let follows = |prev: &RangeCheck, next: &RangeCheck| next.offset == prev.offset + prev.len;
        covers(&ranges[k..], r.offset + r.len - offset, len, follows)
            .then(|| r.at + (offset - r.offset))
    }

    /// A part that ran has settled with `failures`: counts it off the objects it carried
    /// (`tags`), and finishes the checksum of each whose last part it was and that did not
    /// fail (`failed`). A restore whose bytes do not match gets a failure in `failures`.
    pub(crate) fn part_ran(
        &self,
        tags: &[Tag],
        failed: &dyn Fn(Tag) -> bool,
        failures: &mut Vec<Failure>,
    ) {
        for &tag in tags {
            let Some(i) = self.tracked(tag) else { continue };
            // AcqRel: the part that counts the last one off sees every other part's pieces
            // (each added before its part counted itself off).
            if self.left[i].fetch_sub(1, Ordering::AcqRel) == 1 && !failed(tag) {
                failures.extend(self.finish(i));
            }
        }
    }

    /// Finishes object `i`'s checksum and checks it: the failure of a restore that does not
    /// match (or could not be verified).
    pub(crate) fn finish(&self, i: usize) -> Option<Failure> {
        let o = &self.objects[i];
        let sum = {
            let mut state = self.lock();
            let r = &mut state[i];
            r.later.sort_unstable_by_key(|p| p.at);
            absorb(r);
            let whole = !r.unknown && r.later.is_empty() && !r.extending && r.len == o.total;
            r.sum = whole.then_some(r.crc);
            r.sum
        };
        let (outcome, cause) = match (self.restore, o.expect, sum) {
            (true, Some(expected), Some(actual)) if actual == expected => (Outcome::Verified, None),
            (true, Some(expected), Some(actual)) => {
                (Outcome::Mismatch, Some(FailureCause::ChecksumMismatch { expected, actual }))
            }
            (true, Some(expected), None) => {
                (Outcome::Unverifiable, Some(FailureCause::ChecksumUnverifiable { expected }))
            }
            (_, _, Some(_)) => (Outcome::Recorded, None),
            (_, _, None) => (Outcome::Unknown, None),
        };
        let tier = self.table.get(o.tier);
        if self.metered {
            let kind = tier.map_or("other", endpoint_kind_name);
            self.metrics.record_checksum(outcome.name(), kind, outcome == Outcome::Mismatch);
        }
        let cause = cause?;
        let first = self.ranges[o.ranges.0..o.ranges.1].first().map_or(o.tier, |r| r.endpoint);
        let (src, dst) = if self.restore { (o.tier, first) } else { (first, o.tier) };
        tracing::warn!(
            tag = o.tag,
            %cause,
            "an object's bytes failed their checksum: it fails as a load error"
        );
        Some(Failure { engine: "checksum".into(), src, dst, tags: vec![Tag::new(i as u32)], cause })
    }

    /// Whether object `i` is tracked.
    pub(crate) fn is_tracked(&self, i: usize) -> bool {
        self.objects.get(i).is_some_and(|o| o.tracked)
    }
}

/// Joins the pieces that now continue `r`'s prefix (`r.later` sorted or not).
fn absorb(r: &mut Running) {
    while let Some(k) = r.later.iter().position(|p| p.at == r.len) {
        let p = r.later.swap_remove(k);
        r.crc = checksum::combine(r.crc, p.crc, p.len);
        r.len += p.len;
    }
}

/// The first of `0 .. n` that `fits`, trying `hint` and the one after it first; remembered in
/// `hint`.
fn find(n: usize, hint: &mut usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let k = [*hint, *hint + 1]
        .into_iter()
        .filter(|&k| k < n)
        .find(|&k| fits(k))
        .or_else(|| (0..n).find(|&k| fits(k)))?;
    *hint = k;
    Some(k)
}

/// Whether `len` bytes starting `first` bytes before the end of `ranges[0]` lie in it and
/// the non-empty ranges after it, each of which `follows` the one before.
fn covers(
    ranges: &[RangeCheck],
    first: u64,
    len: u64,
    follows: impl Fn(&RangeCheck, &RangeCheck) -> bool,
) -> bool {
    let mut covered = first;
    let Some(mut prev) = ranges.first() else { return false };
    for next in ranges[1..].iter().filter(|r| r.len > 0) {
        if covered >= len {
            break;
        }
        if !follows(prev, next) {
            return false;
        }
        covered += next.len;
        prev = next;
    }
    covered >= len
}

/// `crc` extended with bytes `offset .. offset + len` of `endpoint`; `None` unless it is host
/// memory holding them.
fn host_crc(endpoint: &Endpoint, offset: u64, len: u64, crc: u32) -> Option<u32> {
    if !endpoint.is_host() || !endpoint.contains(offset, len) {
        return None;
    }
    if len == 0 {
        return Some(crc);
    }
    let start = usize::try_from(endpoint.addr().checked_add(offset)?).ok()?;
    let len = usize::try_from(len).ok()?;
    // SAFETY:
    // 1. `endpoint` is a host endpoint of the batch's pinned table: its registration promised
    //    that `addr .. addr + len` is host memory valid for reads until the registration ends,
    //    and the batch's pins keep it registered until the batch settles, which is after this
    //    call (the executor hashes before it settles the part that hashes).
    // 2. `offset .. offset + len` lies inside the endpoint (checked above) and is not empty,
    //    so the slice is non-null and inside one registered region.
    // 3. Nothing writes these bytes while they are read: the transfer that wrote them (a
    //    restore's destination, a stage's first hop into its bounce slot, an offload into
    //    DRAM tier pages) has settled, what runs meanwhile only reads them (a stage's second
    //    hop), and the registration promises that while a transfer runs nothing else writes
    //    the bytes it reads or accesses the bytes it writes.
    let bytes = unsafe { std::slice::from_raw_parts(start as *const u8, len) };
    Some(checksum::crc32c_append(crc, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_round_trip() {
        for p in [ChecksumPolicy::Off, ChecksumPolicy::FilesAndRemote, ChecksumPolicy::AllTiers] {
            assert_eq!(ChecksumPolicy::from_name(p.name()), Some(p));
        }
        assert_eq!(ChecksumPolicy::from_name("sometimes"), None);
    }

    #[test]
    fn pieces_in_any_order_join_to_the_whole_message() {
        let message: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let whole = crc32c::crc32c(&message);
        let cuts = [0usize, 1, 700, 701, 4096, 9000, 10_000];
        let mut r = Running::default();
        // Out of order: the later pieces first, then the rest.
        let mut order: Vec<usize> = (0..cuts.len() - 1).collect();
        order.rotate_left(3);
        for k in order {
            let (a, b) = (cuts[k], cuts[k + 1]);
            let crc = crc32c::crc32c(&message[a..b]);
            if r.len == a as u64 {
                r.crc = checksum::combine(r.crc, crc, (b - a) as u64);
                r.len = b as u64;
            } else {
                r.later.push(Piece { at: a as u64, len: (b - a) as u64, crc });
            }
            absorb(&mut r);
        }
        assert_eq!((r.len, r.crc), (10_000, whole));
        assert!(r.later.is_empty());
    }

    #[test]
    fn find_tries_the_hint_first_and_remembers() {
        let mut hint = 3;
        assert_eq!(find(10, &mut hint, |k| k == 4), Some(4));
        assert_eq!(hint, 4);
        assert_eq!(find(10, &mut hint, |k| k == 1), Some(1));
        assert_eq!(find(10, &mut hint, |_| false), None);
        assert_eq!(hint, 1);
    }
}
