//! A submitted plan set as ops: resolution against the endpoints, scheduling for an executor,
//! and the mapping of failed segments back to their objects.
//!
//! Resolution looks every plan's endpoints up in the registry snapshot taken at submit and
//! checks every segment against them again (builders from elsewhere, or endpoints deregistered
//! since planning, must not reach the kernel). What fails there never becomes an op: a missing
//! endpoint fails its plan with `EndpointGone`; a segment outside its endpoints fails with
//! `NotAccepted`; a read past the end of the file fails with `ShortFile` before any byte moves.
//!
//! Scheduling hands the executor one request at a time: resubmissions first, then ops that had
//! to wait, then new ops in plan order. Bounce ops wait while the bounce buffers in use would
//! pass the budget; a bounce write waits while any other write of the process (of this batch
//! or another, of any engine) holds a byte of the blocks it rewrites, a buffered write while
//! one of its bytes is being rewritten, and a bounce read while one of its blocks is being
//! rewritten (see `sectors`). An op that waits for another batch's blocks registers the
//! executor's waker, so the executor looks again when they are released; with nothing of its
//! own in flight and nothing owned elsewhere, every op is admitted, so a batch always
//! finishes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use umbp_plan::{
    EndpointId, EndpointKind, EndpointTable, FailedAt, Failure, FailureCause, PlanSet, Tag,
};

use crate::fault::Faults;
use crate::file::{FileEntry, FileTable};
use crate::op::{BouncePool, Guard, Op, Step};
use crate::sectors::Sectors;
use crate::sys::{Dir, HostSlice, Request};
use crate::wake::Waker;

/// The largest single request: well inside the kernel's per-call limit and `i32` results.
pub(crate) const MAX_IO: u64 = 1 << 30;

/// What the executor does next for an op.
#[derive(Debug)]
pub(crate) enum Issue {
    /// Hand this request to the kernel.
    Io(Request),
    /// Complete the op with this result without issuing anything (an injected fault).
    Fail(i32),
}

/// Tunables of a batch, from the engine's configuration.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Limits {
    /// Longest op; longer segments are split.
    pub(crate) max_io: u64,
    /// Bounce-buffer bytes in use at once (one op may always run alone).
    pub(crate) bounce_budget: u64,
}

/// What a batch shares with its engine and with the executor that runs it.
#[derive(Clone, Debug)]
pub(crate) struct Context {
    pub(crate) limits: Limits,
    pub(crate) faults: Arc<Faults>,
    /// The process's sector ownership table.
    pub(crate) sectors: Arc<Sectors>,
    /// Wakes the executor running the batch (when blocks it waits for are released).
    pub(crate) waker: Waker,
    /// Set when the batch is cancelled (`None`: it cannot be).
    pub(crate) cancel: Option<Arc<AtomicBool>>,
}

/// A failure before it is mapped to the objects it costs.
#[derive(Debug)]
struct Failed {
    at: FailedAt,
    cause: FailureCause,
}

impl Failed {
    fn plan(plan: u32, cause: FailureCause) -> Self {
        Self { at: FailedAt::plan(plan as usize), cause }
    }

    fn segment(plan: u32, segment: u32, cause: FailureCause) -> Self {
        Self { at: FailedAt::segment(plan as usize, segment as usize), cause }
    }

    /// Of object `only`'s share of the segment when set, of the whole segment otherwise.
    fn share(plan: u32, segment: u32, only: Option<Tag>, cause: FailureCause) -> Self {
        let at = FailedAt { tag: only, ..FailedAt::segment(plan as usize, segment as usize) };
        Self { at, cause }
    }
}

/// The file entry of each plan of a plan set, taken at submit so that the batch keeps its
/// files open (and their ids valid) until it settles, whatever is deregistered meanwhile:
/// `None` for a plan with no file endpoint in `table`.
pub(crate) type PlanFiles = Vec<Option<Result<Arc<FileEntry>, FailureCause>>>;

/// Looks up the file of every plan of `plans` (see [`PlanFiles`]).
pub(crate) fn plan_files(plans: &PlanSet, table: &EndpointTable, files: &FileTable) -> PlanFiles {
    plans
        .plans()
        .iter()
        .map(|plan| {
            let kind = |id| table.get(id).map(|e| e.kind());
            match (kind(plan.src()), kind(plan.dst())) {
                (Some(EndpointKind::File(range)), _) => Some(files.get(plan.src(), range)),
                (_, Some(EndpointKind::File(range))) => Some(files.get(plan.dst(), range)),
                _ => None,
            }
        })
        .collect()
}

/// The ops of one plan set, and where each stands. It owns (shares) everything its requests
/// point into, so an executor can hold several at once.
#[derive(Debug)]
pub(crate) struct Batch {
    plans: Arc<PlanSet>,
    ops: Vec<Op>,
    /// The file endpoint of each plan (for fault rules).
    plan_files: Vec<EndpointId>,
    /// The entries of the files the batch uses. Their descriptors stay open while it runs
    /// because its job pins their endpoints (see [`FileEntry`]), not because of these.
    _files: Vec<Arc<FileEntry>>,
    pool: BouncePool,
    faults: Arc<Faults>,
    failed: Vec<Failed>,
    next: usize,
    ready: Vec<usize>,
    deferred: VecDeque<usize>,
    bounce_in_use: u64,
    bounce_budget: u64,
    sectors: Arc<Sectors>,
    waker: Waker,
    /// Set by the job's cancel wake-up (when the plan set has a cancel token).
    cancel: Option<Arc<AtomicBool>>,
    /// Why the batch stopped (`TimedOut`: its deadline passed; `Cancelled`): nothing more is
    /// issued, and what completes without its bytes fails with this cause.
    stopped: Option<FailureCause>,
}

/// Waiting ops looked at per issue, so that a long queue of them costs a bounded scan.
const DEFERRED_SCAN: usize = 8;

impl Batch {
    /// Resolves `plans` against `table` (the registry at submit) and their files (from
    /// [`plan_files`], at submit), with `pool`'s bounce buffers (handed back by
    /// [`outcome`](Self::outcome)), to run as `context` says.
    pub(crate) fn new(
        plans: Arc<PlanSet>,
        table: &EndpointTable,
        files: &PlanFiles,
        pool: BouncePool,
        context: Context,
    ) -> Self {
        let Context { limits, faults, sectors, waker, cancel } = context;
        let mut batch = Self {
            plans: Arc::clone(&plans),
            ops: Vec::with_capacity(plans.segment_count()),
            plan_files: Vec::with_capacity(plans.plans().len()),
            _files: Vec::new(),
            pool,
            faults,
            failed: Vec::new(),
            next: 0,
            ready: Vec::new(),
            deferred: VecDeque::new(),
            bounce_in_use: 0,
            bounce_budget: limits.bounce_budget,
            sectors,
            waker,
            cancel,
            stopped: None,
        };
        for (index, plan) in plans.plans().iter().enumerate() {
            let index = index as u32;
            let src = table.get(plan.src()).copied();
            let dst = table.get(plan.dst()).copied();
            let resolved = match (src, dst) {
                (None, _) => Err(FailureCause::EndpointGone(plan.src())),
                (_, None) => Err(FailureCause::EndpointGone(plan.dst())),
                (Some(src), Some(dst)) => match (src.kind(), dst.kind()) {
                    (EndpointKind::File(range), EndpointKind::Host) => {
                        Ok((Dir::Read, plan.src(), src, range, plan.dst()))
                    }
                    (EndpointKind::Host, EndpointKind::File(range)) => {
                        Ok((Dir::Write, plan.dst(), dst, range, plan.src()))
                    }
                    _ => Err(FailureCause::NotAccepted(
                        "umbp-ssd carries file -> host and host -> file only".into(),
                    )),
                },
            };
            let (dir, file_id, file, range, host_id) = match resolved {
                Ok(resolved) => resolved,
                Err(cause) => {
                    batch.plan_files.push(plan.src());
                    batch.failed.push(Failed::plan(index, cause));
                    continue;
                }
            };
            batch.plan_files.push(file_id);
            let entry = match files.get(index as usize) {
                Some(Some(Ok(entry))) => Arc::clone(entry),
                Some(Some(Err(cause))) => {
                    batch.failed.push(Failed::plan(index, cause.clone()));
                    continue;
                }
                _ => {
                    batch.failed.push(Failed::plan(index, FailureCause::EndpointGone(file_id)));
                    continue;
                }
            };
            if dir == Dir::Write && !entry.info.writable {
                let cause = FailureCause::Io { errno: libc::EBADF };
                batch.failed.push(Failed::plan(index, cause));
                continue;
            }
            // Reads past the end of the file fail before any byte moves.
            let size = match dir {
                Dir::Read => match crate::sys::file_size(entry.fd()) {
                    Ok(size) => size,
                    Err(e) => {
                        let cause =
                            FailureCause::Io { errno: e.raw_os_error().unwrap_or(libc::EBADF) };
                        batch.failed.push(Failed::plan(index, cause));
                        continue;
                    }
                },
                Dir::Write => None,
            };
            let align = entry.align();
            let chunk = match limits.max_io.min(MAX_IO) {
                max if align > 1 && max >= align => max - max % align,
                max => max.max(1),
            };
            for (s, segment) in plan.segments().iter().enumerate() {
                let s = s as u32;
                let (file_offset, host_offset) = match dir {
                    Dir::Read => (segment.src_offset, segment.dst_offset),
                    Dir::Write => (segment.dst_offset, segment.src_offset),
                };
                let len = segment.len;
                let host = HostSlice::lookup(table, host_id, host_offset, len);
                let absolute = range.file_offset.checked_add(file_offset);
                let (host, absolute) = match (file.contains(file_offset, len), host, absolute) {
                    (true, Some(host), Some(absolute)) if absolute.checked_add(len).is_some() => {
                        (host, absolute)
                    }
                    _ => {
                        let cause = FailureCause::NotAccepted(format!(
                            "segment {file_offset}..+{len} of file endpoint {} or {host_offset}..+{len} \
                             of host endpoint {} lies outside the endpoint",
                            file_id.raw(),
                            host_id.raw()
                        ));
                        batch.failed.push(Failed::segment(index, s, cause));
                        continue;
                    }
                };
                let key = (index, s, file_offset);
                let whole = Op::new(key, (entry.fd(), entry.key), dir, absolute, host, align);
                let Some(whole) = whole else {
                    let cause = FailureCause::NotAccepted(format!(
                        "file offset {absolute}..+{len} overflows at block alignment"
                    ));
                    batch.failed.push(Failed::segment(index, s, cause));
                    continue;
                };
                match size.filter(|&size| absolute + len > size) {
                    // Reads past the end of the file fail before any byte moves: the objects
                    // whose bytes lie past it, each on its own when the segment carries several.
                    Some(size) => {
                        let plan = &plans.plans()[index as usize];
                        if plan.segment_tags(s as usize).len() < 2 {
                            let got = size.saturating_sub(absolute);
                            let cause =
                                FailureCause::ShortFile { offset: absolute, expected: len, got };
                            batch.failed.push(Failed::segment(index, s, cause));
                            continue;
                        }
                        for (tag, from, n) in shares(plan, s as usize, dir, 0, len) {
                            let at = absolute + from;
                            if at + n > size {
                                let got = size.saturating_sub(at);
                                let cause =
                                    FailureCause::ShortFile { offset: at, expected: n, got };
                                batch.failed.push(Failed::share(index, s, Some(tag), cause));
                            } else if let Some(op) = whole.part(from, n, Some(tag)) {
                                batch.push_chunks(op, chunk);
                            }
                        }
                    }
                    None => batch.push_chunks(whole, chunk),
                }
            }
            batch._files.push(entry);
        }
        batch
    }

    /// Queues `op`, cut into ops of at most `chunk` bytes.
    fn push_chunks(&mut self, op: Op, chunk: u64) {
        let len = op.len();
        if len <= chunk {
            self.ops.push(op);
            return;
        }
        let mut at = 0;
        while at < len {
            let n = chunk.min(len - at);
            // In range by construction.
            self.ops.extend(op.part(at, n, op.only));
            at += n;
        }
    }

    /// Whether op `index` may start now: within the bounce budget, and clear in the sector
    /// table (a write then owns its window; see `sectors`). Aligned `O_DIRECT` ops and buffered
    /// reads always may.
    fn admits(&mut self, index: usize) -> bool {
        let op = &mut self.ops[index];
        let bytes = op.bounce_bytes();
        if bytes != 0 && self.bounce_in_use != 0 && self.bounce_in_use + bytes > self.bounce_budget
        {
            return false;
        }
        match op.guard() {
            Guard::None => true,
            Guard::Read(window) => self.sectors.readable(window, &self.waker),
            Guard::Write(window, claim) => match self.sectors.claim(window, claim, &self.waker) {
                Some(owned) => {
                    op.own(owned);
                    true
                }
                None => false,
            },
        }
    }

    /// Starts op `index`, admitted, and returns its first issue.
    fn start(&mut self, index: usize) -> Issue {
        let op = &mut self.ops[index];
        self.bounce_in_use += op.bounce_bytes();
        op.start(&mut self.pool);
        match self.faults.check(self.plan_files[op.plan as usize], op) {
            Some(errno) => Issue::Fail(-errno),
            None => Issue::Io(op.request()),
        }
    }

    /// The next op to issue and what to issue for it; `None` when nothing can be issued until
    /// something in flight completes (or when everything is done).
    pub(crate) fn issue(&mut self) -> Option<(usize, Issue)> {
        if let Some(index) = self.ready.pop() {
            return Some((index, Issue::Io(self.ops[index].request())));
        }
        for at in 0..self.deferred.len().min(DEFERRED_SCAN) {
            let index = self.deferred[at];
            if self.admits(index) {
                self.deferred.remove(at);
                return Some((index, self.start(index)));
            }
        }
        while self.next < self.ops.len() {
            let index = self.next;
            self.next += 1;
            if self.admits(index) {
                return Some((index, self.start(index)));
            }
            self.deferred.push_back(index);
        }
        None
    }

    /// Hands op `index` the result of its last request.
    pub(crate) fn complete(&mut self, index: usize, result: i32) {
        let step = match self.ops[index].complete(result) {
            // After the deadline or a cancel an op that is not done (cancelled in the kernel, or
            // wanting another request) is over.
            Step::Again | Step::Done(Err(_)) if self.stopped.is_some() => {
                Step::Done(Err(self.stopped.clone().expect("checked")))
            }
            step => step,
        };
        match step {
            Step::Again => self.ready.push(index),
            Step::Done(outcome) => {
                self.retire(index);
                if let Err(cause) = outcome {
                    self.fail_op(index, cause);
                }
            }
        }
    }

    /// Releases what started op `index` holds (bounce buffer, owned blocks).
    fn retire(&mut self, index: usize) {
        let op = &mut self.ops[index];
        self.bounce_in_use -= op.bounce_bytes();
        op.finish(&mut self.pool);
    }

    /// The plan set's deadline, if any.
    pub(crate) fn deadline(&self) -> Option<std::time::Instant> {
        self.plans.deadline()
    }

    /// Whether the batch can be cancelled (its plan set has a cancel token).
    pub(crate) fn cancellable(&self) -> bool {
        self.cancel.is_some()
    }

    /// Why the batch must [`stop`](Self::stop) now, if it must and has not: `Cancelled` once
    /// its token was cancelled, `TimedOut` once its deadline passed.
    pub(crate) fn stop_due(&self) -> Option<FailureCause> {
        if self.stopped.is_some() {
            None
        } else if self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Acquire)) {
            Some(FailureCause::Cancelled)
        } else if self.plans.expired() {
            Some(FailureCause::TimedOut)
        } else {
            None
        }
    }

    /// The deadline passed or the batch was cancelled (`cause`): every op not in flight fails
    /// with `cause` and nothing more is issued. The executor cancels what is in flight; those
    /// ops fail as they complete, unless their bytes arrived.
    pub(crate) fn stop(&mut self, cause: FailureCause) {
        self.stopped = Some(cause.clone());
        let unstarted: Vec<usize> =
            (self.next..self.ops.len()).chain(self.deferred.drain(..)).collect();
        self.next = self.ops.len();
        for index in unstarted {
            self.fail_op(index, cause.clone());
        }
        for index in std::mem::take(&mut self.ready) {
            self.retire(index);
            self.fail_op(index, cause.clone());
        }
    }

    /// Op `index` failed with `cause`. An op of a segment that carries several objects is
    /// re-issued as one op per object's share of its bytes, so that only the objects whose
    /// bytes really did not arrive fail; an op that carries one object fails it.
    fn fail_op(&mut self, index: usize, cause: FailureCause) {
        let op = &self.ops[index];
        let (plan_index, s) = (op.plan, op.segment);
        let plan = &self.plans.plans()[plan_index as usize];
        if self.stopped.is_some() || op.only.is_some() || plan.segment_tags(s as usize).len() < 2 {
            self.failed.push(Failed::share(plan_index, s, op.only, cause));
            return;
        }
        let segment = plan.segments()[s as usize];
        let file_start = match op.dir() {
            Dir::Read => segment.src_offset,
            Dir::Write => segment.dst_offset,
        };
        // The op covers bytes `from .. from + len` of its segment.
        let (from, len) = (op.endpoint_offset - file_start, op.len());
        let parts: Vec<Op> = shares(plan, s as usize, op.dir(), from, len)
            .filter_map(|(tag, at, n)| op.part(at - from, n, Some(tag)))
            .collect();
        tracing::debug!(plan = plan_index, segment = s, parts = parts.len(), %cause, "re-issuing a failed segment per object");
        self.ops.extend(parts);
    }

    /// Whether every op has been issued and none waits to be issued again: the batch is done
    /// once its last requests in flight complete.
    pub(crate) fn issued_all(&self) -> bool {
        self.next >= self.ops.len() && self.ready.is_empty() && self.deferred.is_empty()
    }

    /// The failures of the settled batch, one per failed plan, segment or object's share of a
    /// segment, each with the tags of exactly the objects it cost; and the bounce buffers back.
    pub(crate) fn outcome(mut self, engine: &str) -> (Vec<Failure>, BouncePool) {
        debug_assert!(self.ready.is_empty() && self.deferred.is_empty());
        let plans = &self.plans;
        // A segment split into several ops fails once, with its first cause.
        self.failed.sort_by_key(|f| f.at);
        self.failed.dedup_by_key(|f| f.at);
        let failures = std::mem::take(&mut self.failed)
            .into_iter()
            .map(|f| {
                let plan = &plans.plans()[f.at.plan];
                Failure {
                    engine: engine.to_owned(),
                    src: plan.src(),
                    dst: plan.dst(),
                    tags: plans.tags_at(f.at).to_vec(),
                    cause: f.cause,
                }
            })
            .collect();
        (failures, self.pool)
    }
}

/// The objects of segment `s` of `plan` whose bytes fall in `from .. from + len` of the
/// segment: each with where its share starts (from the segment's start) and its length.
fn shares(
    plan: &umbp_plan::Plan,
    s: usize,
    dir: Dir,
    from: u64,
    len: u64,
) -> impl Iterator<Item = (Tag, u64, u64)> + '_ {
    let segment = plan.segments().get(s).copied();
    plan.segment_pieces(s).filter_map(move |(tag, piece)| {
        let segment = segment?;
        let start = match dir {
            Dir::Read => piece.src_offset - segment.src_offset,
            Dir::Write => piece.dst_offset - segment.dst_offset,
        };
        let (a, b) = (start.max(from), (start + piece.len).min(from + len));
        (a < b).then_some((tag, a, b - a))
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use umbp_plan::{
        Endpoint, EndpointId, EndpointRegistry, FailureCause, FileOptions, FileSource, Fragment,
        IncrementalBuilder, PlanBuilder, PlanSet, Register, Registration, Tag,
    };

    use super::{plan_files, Batch, Context, Limits};
    use crate::fault::Faults;
    use crate::file::FileTable;
    use crate::op::BouncePool;
    use crate::ring::{Feed, Ring};
    use crate::sectors::{Claim, Sectors, Window};
    use crate::wake::Waker;
    use crate::{fallback, SsdRules};

    const PAGE: u64 = 64 << 10;
    const LIMITS: Limits = Limits { max_io: 1 << 20, bounce_budget: 16 << 20 };

    /// A ring of `depth`, or `None` after saying why the test is skipped.
    fn ring_or_skip(depth: u32) -> Option<Ring> {
        Ring::new(depth).map_err(|e| eprintln!("SKIP: no io_uring here: {e}")).ok()
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u64 * 131 + u64::from(seed) * 7 + (i as u64 >> 9)) as u8).collect()
    }

    /// Host memory kept alive by the test, `misalign` bytes past a 4 KiB boundary.
    struct Host {
        storage: Vec<u8>,
        start: usize,
        len: usize,
        id: EndpointId,
    }

    impl Host {
        fn new(registry: &EndpointRegistry, len: usize, misalign: usize, fill: u8) -> Self {
            let mut storage = vec![fill; len + 8192];
            let start = storage.as_ptr().align_offset(4096) + misalign;
            let addr = storage[start..].as_mut_ptr() as u64;
            // SAFETY: `storage` is never reallocated and outlives every batch of the test,
            // each of which runs to the end before the test reads the bytes.
            let id = unsafe { registry.register(Endpoint::host(addr, len as u64)) };
            Self { storage, start, len, id }
        }

        fn bytes(&self) -> &[u8] {
            &self.storage[self.start..self.start + self.len]
        }
    }

    struct Fixture {
        registry: Arc<EndpointRegistry>,
        files: FileTable,
        sectors: Arc<Sectors>,
        /// The open files, closed when the fixture goes (before the directory).
        opened: std::sync::Mutex<Vec<Registration<std::fs::File>>>,
        _dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Self {
            let dir = tempfile::tempdir().expect("a temporary directory");
            Self {
                _dir: dir,
                registry: EndpointRegistry::new(),
                files: FileTable::default(),
                sectors: Arc::default(),
                opened: Default::default(),
            }
        }

        fn path(&self, name: &str) -> std::path::PathBuf {
            self._dir.path().join(name)
        }

        /// Opens `path` as the engine would; `None` when O_DIRECT was asked for and refused.
        fn open(&self, path: &Path, len: u64, direct: bool) -> Option<EndpointId> {
            let source = FileSource::open(path, FileOptions::new().direct(direct));
            let registration = self.registry.register_file(source, 0, len).unwrap();
            let range = registration.endpoint().file_range().unwrap();
            if range.direct != direct {
                eprintln!(
                    "SKIP the O_DIRECT part: the filesystem of {} refuses it",
                    path.display()
                );
                return None;
            }
            let id = registration.id();
            self.files.register(id, range).unwrap();
            self.opened.lock().unwrap().push(registration);
            Some(id)
        }

        /// `plans` resolved as a submit would, against the registry and the files as they are.
        fn batch(&self, plans: PlanSet) -> Batch {
            self.batch_woken_by(plans, Waker::current_thread())
        }

        /// [`batch`](Self::batch), for the executor `waker` wakes.
        fn batch_woken_by(&self, plans: PlanSet, waker: Waker) -> Batch {
            let table = self.registry.snapshot();
            let files = plan_files(&plans, &table, &self.files);
            let context = Context {
                limits: LIMITS,
                faults: Arc::new(Faults::new()),
                sectors: Arc::clone(&self.sectors),
                waker,
                cancel: None,
            };
            Batch::new(Arc::new(plans), &table, &files, BouncePool::default(), context)
        }

        fn plan(&self, fragments: &[Fragment]) -> PlanSet {
            let mut builder =
                IncrementalBuilder::new(SsdRules::new(1 << 20), self.registry.clone());
            for &f in fragments {
                builder.begin_object(f.tag).unwrap();
                builder.push(f).unwrap();
                builder.commit_object().unwrap();
            }
            builder.finish().unwrap()
        }
    }

    /// Aligned and unaligned pieces, for reads from and writes to `file`.
    fn pieces(file: EndpointId, host: EndpointId, read: bool) -> Vec<Fragment> {
        let shapes = [(0, PAGE, 0), (3 * PAGE + 5, 10_001, PAGE), (7 * PAGE, 513, 3 * PAGE)];
        shapes
            .iter()
            .enumerate()
            .map(|(i, &(file_offset, len, host_offset))| {
                let tag = Tag::new(i as u32);
                if read {
                    Fragment::new(file, file_offset, host, host_offset, len, tag)
                } else {
                    Fragment::new(host, host_offset, file, file_offset, len, tag)
                }
            })
            .collect()
    }

    #[test]
    fn short_transfers_are_resubmitted_for_the_remainder() {
        for direct in [false, true] {
            let fx = Fixture::new();
            let path = fx.path("pieces.bin");
            let mut model = pattern(1, (16 * PAGE) as usize);
            std::fs::write(&path, &model).unwrap();
            let Some(file) = fx.open(&path, 16 * PAGE, direct) else { continue };
            let align = fx.files.info(file).map_or(1, |i| if i.direct { i.block_size } else { 1 });
            // O_DIRECT pieces must stay whole blocks; buffered ones may be anything.
            let piece = if direct { align as u32 } else { 1000 };
            let source = Host::new(&fx.registry, (4 * PAGE) as usize, 0, 0);
            let writes = pieces(file, source.id, false);
            let mut batch = fx.batch(fx.plan(&writes));
            fallback::run_in_pieces(&mut batch, piece);
            assert!(batch.outcome("t").0.is_empty());
            for f in &writes {
                let (at, from) = (f.dst_offset as usize, f.src_offset as usize);
                model[at..at + f.len as usize]
                    .copy_from_slice(&source.bytes()[from..from + f.len as usize]);
            }
            assert!(std::fs::read(&path).unwrap() == model, "writes in pieces (direct: {direct})");

            let destination = Host::new(&fx.registry, (4 * PAGE) as usize, 1, 0xA5);
            let reads = pieces(file, destination.id, true);
            let mut batch = fx.batch(fx.plan(&reads));
            fallback::run_in_pieces(&mut batch, piece);
            assert!(batch.outcome("t").0.is_empty());
            for f in &reads {
                let (at, from) = (f.dst_offset as usize, f.src_offset as usize);
                let got = &destination.bytes()[at..at + f.len as usize];
                assert!(
                    got == &model[from..from + f.len as usize],
                    "read {f:?} (direct: {direct})"
                );
            }
        }
    }

    #[test]
    fn the_end_of_the_file_met_while_running_fails_as_short_file() {
        for direct in [false, true] {
            for ring in [false, true] {
                let fx = Fixture::new();
                let path = fx.path("shrinks.bin");
                std::fs::write(&path, pattern(2, (16 * PAGE) as usize)).unwrap();
                let Some(file) = fx.open(&path, 16 * PAGE, direct) else { continue };
                let destination = Host::new(&fx.registry, (32 * PAGE) as usize, 0, 0xA5);
                let reads: Vec<Fragment> = (0..8)
                    .map(|i| {
                        Fragment::new(
                            file,
                            i * PAGE,
                            destination.id,
                            2 * i * PAGE,
                            PAGE,
                            Tag::new(i as u32),
                        )
                    })
                    .collect();
                let mut batch = fx.batch(fx.plan(&reads));
                // Resolved against 16 pages; the file now ends inside page 5, off any block
                // boundary (an O_DIRECT read stops there, short of a block).
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_len(5 * PAGE + 1000)
                    .unwrap();
                if ring {
                    match Ring::new(8) {
                        Ok(mut ring) => batch = ring.run(batch),
                        Err(e) => {
                            eprintln!("SKIP the io_uring part: {e}");
                            continue;
                        }
                    }
                } else {
                    fallback::run(&mut batch);
                }
                let (failures, _) = batch.outcome("t");
                let failed: Vec<u32> =
                    failures.iter().flat_map(|f| &f.tags).map(|t| t.get()).collect();
                assert_eq!(failed, [5, 6, 7], "direct: {direct}, ring: {ring}");
                let got: Vec<FailureCause> = failures.iter().map(|f| f.cause.clone()).collect();
                let short = |page: u64, got: u64| FailureCause::ShortFile {
                    offset: page * PAGE,
                    expected: PAGE,
                    got,
                };
                assert_eq!(got, [short(5, 1000), short(6, 0), short(7, 0)]);
            }
        }
    }

    /// A batch whose only op is an unaligned write of blocks another batch owns waits with
    /// nothing in flight, and finishes once they are released from another thread: the ring
    /// is woken by its doorbell, the fallback thread by an unpark. Byte-exact either way.
    #[test]
    fn a_write_waiting_for_blocks_owned_elsewhere_runs_once_they_are_released() {
        for ring in [false, true] {
            let fx = Fixture::new();
            let path = fx.path("owned.bin");
            let mut model = pattern(3, 16 << 10);
            std::fs::write(&path, &model).unwrap();
            let Some(file) = fx.open(&path, 16 << 10, true) else { return };
            let entry =
                fx.files.get(file, fx.registry.snapshot().get(file).unwrap().file_range().unwrap());
            let entry = entry.unwrap();
            let source = Host::new(&fx.registry, 4096, 0, 0x3C);
            let write = Fragment::new(source.id, 0, file, 4096 + 100, 60, Tag::new(0));
            // Another batch's read-modify-write of the block, held by this test.
            let window = Window { file: entry.key, start: 0, end: 16 << 10 };
            let held =
                fx.sectors.claim(window, Claim::Rewrite, &Waker::current_thread()).expect("free");
            let release = std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                drop(held);
            });
            // A deadline far off, so that a wake-up that never comes fails the test (as
            // `TimedOut`) instead of hanging it.
            let plans = || {
                let mut plans = fx.plan(&[write]);
                let far = std::time::Instant::now() + std::time::Duration::from_secs(30);
                plans.set_deadline(Some(far));
                plans
            };
            let batch = if ring {
                let Some(mut ring) = ring_or_skip(8) else { return };
                let batch = fx.batch_woken_by(plans(), ring.waker());
                ring.run(batch)
            } else {
                let mut batch = fx.batch(plans());
                fallback::run(&mut batch);
                batch
            };
            release.join().unwrap();
            assert!(batch.issued_all());
            let (failures, _) = batch.outcome("t");
            assert!(failures.is_empty(), "ring: {ring}: {failures:?}");
            assert_eq!(fx.sectors.owned(), 0, "the write released its blocks");
            model[4196..4256].fill(0x3C);
            assert!(std::fs::read(&path).unwrap() == model, "ring: {ring}");
        }
    }

    /// A round that issues many requests sends them to the kernel in chunks while it pushes
    /// them, until half the depth is there: of 40 reads at depth 64, the first 32 go early and
    /// at most the last 8 wait in the submission queue for the round's end. Every read lands.
    #[test]
    fn a_ring_submits_a_long_round_in_chunks() {
        let fx = Fixture::new();
        let path = fx.path("chunks.bin");
        let pages = 80u64;
        let content = pattern(4, (pages * PAGE) as usize);
        std::fs::write(&path, &content).unwrap();
        let file = fx.open(&path, pages * PAGE, false).expect("a buffered file");
        let destination = Host::new(&fx.registry, (2 * pages * PAGE) as usize, 0, 0);
        // Every other slot, so that no two reads merge: one request per page, 40 of them.
        let reads: Vec<Fragment> = (0..pages / 2)
            .map(|i| {
                let (page, slot) = (2 * i, 4 * i);
                Fragment::new(
                    file,
                    page * PAGE,
                    destination.id,
                    slot * PAGE,
                    PAGE,
                    Tag::new(i as u32),
                )
            })
            .collect();
        let Some(mut ring) = ring_or_skip(64) else { return };
        let batch = ring.run(fx.batch(fx.plan(&reads)));
        let (failures, _) = batch.outcome("t");
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(
            ring.most_left_queued(),
            40 - 32,
            "the first half of the depth goes early, in chunks; the rest waits for the round's end"
        );
        for f in &reads {
            let (from, to, len) = (f.src_offset as usize, f.dst_offset as usize, f.len as usize);
            assert!(destination.bytes()[to..to + len] == content[from..from + len], "{f:?}");
        }
    }

    /// A ring at depth 1 fed two batches takes the second (and sends its first read to the
    /// kernel) before it hands the first back, so the device does not wait for the hand-back's
    /// wake-up of its caller; and it waits for more work only once every batch it took is
    /// handed back (its callers may be what would submit the next one).
    #[test]
    fn a_ring_starts_the_next_batch_before_it_hands_the_last_one_back() {
        /// Hands out `batches` in order and records what the ring asks of it.
        struct Recorder {
            batches: std::vec::IntoIter<Batch>,
            events: Vec<String>,
            taken: usize,
            done: Vec<Batch>,
        }
        impl Feed for Recorder {
            type Owner = usize;
            fn next(&mut self, busy: bool) -> Option<(usize, Batch)> {
                if !busy {
                    assert_eq!(self.done.len(), self.taken, "waited with a batch to hand back");
                }
                let batch = self.batches.next()?;
                self.events.push(format!("take {}", self.taken));
                self.taken += 1;
                Some((self.taken - 1, batch))
            }
            fn done(&mut self, owner: usize, batch: Batch) {
                self.events.push(format!("hand back {owner}"));
                self.done.push(batch);
            }
        }

        let fx = Fixture::new();
        let path = fx.path("two-batches.bin");
        let content = pattern(9, (16 * PAGE) as usize);
        std::fs::write(&path, &content).unwrap();
        let file = fx.open(&path, 16 * PAGE, false).expect("a buffered file");
        let destination = Host::new(&fx.registry, (8 * PAGE) as usize, 0, 0);
        // Two reads per batch, none adjacent to another, so each is an op of its own.
        let read = |page: u64, slot: u64| {
            Fragment::new(file, page * PAGE, destination.id, slot * PAGE, PAGE, Tag::new(0))
        };
        let batches = vec![
            fx.batch(fx.plan(&[read(0, 0), read(4, 2)])),
            fx.batch(fx.plan(&[read(8, 4), read(12, 6)])),
        ];
        let Some(mut ring) = ring_or_skip(1) else { return };
        let mut feed =
            Recorder { batches: batches.into_iter(), events: Vec::new(), taken: 0, done: vec![] };
        ring.serve(&mut feed);
        assert_eq!(feed.events, ["take 0", "take 1", "hand back 0", "hand back 1"]);
        for batch in feed.done {
            let (failures, _) = batch.outcome("t");
            assert!(failures.is_empty(), "{failures:?}");
        }
        for (page, slot) in [(0, 0), (4, 2), (8, 4), (12, 6)] {
            let (from, to) = ((page * PAGE) as usize, (slot * PAGE) as usize);
            let len = PAGE as usize;
            assert!(destination.bytes()[to..to + len] == content[from..from + len], "page {page}");
        }
    }

    /// A panic while the feed makes a batch, or while it takes one back (a job settling),
    /// costs that batch alone: the ring runs the others to the end, hands each back, and
    /// returns as usual.
    #[test]
    fn a_panic_making_or_handing_back_a_batch_costs_that_batch_alone() {
        /// Hands out `batches`; making the second one panics, and so does taking back the
        /// first.
        struct Faulty {
            batches: std::vec::IntoIter<Batch>,
            made: usize,
            done: Vec<(usize, Batch)>,
        }
        impl Feed for Faulty {
            type Owner = usize;
            fn next(&mut self, _busy: bool) -> Option<(usize, Batch)> {
                let batch = self.batches.next()?;
                self.made += 1;
                assert_ne!(self.made, 2, "injected: making batch 1 panics");
                Some((self.made - 1, batch))
            }
            fn done(&mut self, owner: usize, batch: Batch) {
                assert_ne!(owner, 0, "injected: taking batch 0 back panics");
                self.done.push((owner, batch));
            }
        }

        let fx = Fixture::new();
        let path = fx.path("faulty-feed.bin");
        let content = pattern(5, (16 * PAGE) as usize);
        std::fs::write(&path, &content).unwrap();
        let file = fx.open(&path, 16 * PAGE, false).expect("a buffered file");
        let destination = Host::new(&fx.registry, (16 * PAGE) as usize, 0, 0);
        // Batch `b` reads pages 4b and 4b + 2 into the same slots.
        let read = |page: u64| {
            Fragment::new(file, page * PAGE, destination.id, page * PAGE, PAGE, Tag::new(0))
        };
        let batches =
            (0..4).map(|b| fx.batch(fx.plan(&[read(4 * b), read(4 * b + 2)]))).collect::<Vec<_>>();
        let Some(mut ring) = ring_or_skip(64) else { return };
        let mut feed = Faulty { batches: batches.into_iter(), made: 0, done: Vec::new() };
        let served =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ring.serve(&mut feed)));
        assert!(served.is_ok(), "a panic left the ring");
        let owners: Vec<usize> = feed.done.iter().map(|(owner, _)| *owner).collect();
        assert_eq!(owners, [2, 3], "batches 2 and 3 (owners 2 and 3) are handed back");
        for (_, batch) in feed.done {
            let (failures, _) = batch.outcome("t");
            assert!(failures.is_empty(), "{failures:?}");
        }
        // Batch 0 ran (only taking it back panicked); batch 1 never did.
        for page in [0, 2, 8, 10, 12, 14] {
            let at = (page * PAGE) as usize..((page + 1) * PAGE) as usize;
            assert!(destination.bytes()[at.clone()] == content[at], "page {page}");
        }
        for page in [4, 6] {
            let at = (page * PAGE) as usize..((page + 1) * PAGE) as usize;
            assert!(destination.bytes()[at].iter().all(|&b| b == 0), "page {page} was read");
        }
    }
}
