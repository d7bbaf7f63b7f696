//! The composite's executor: a fixed set of threads, started at the first submit, that run the
//! parts of every batch, and the code that runs one part.
//!
//! # What runs where
//!
//! - A *direct lane* is one engine's share of one batch: its plans per layer group, run group
//!   after group on one executor thread, so group `k`'s bytes move before group `k + 1`'s on
//!   that engine while other engines' lanes move theirs at the same time. A part whose engine
//!   queued it on the batch's stream ([`TransferHandle::is_queued`]) is *enqueued* at once and
//!   the lane submits the next group without waiting (the stream keeps their order); it
//!   settles when its handle does. Any other part is waited for before the next one starts.
//! - A *stage* of the staged route leases a bounce slot ([`crate::staging`]), runs its first hop
//!   (source to slot) and its second (slot to destination), and returns the slot. Stages of one
//!   batch run on as many threads as there are free slots, so one stage's second hop overlaps
//!   the next stage's first.
//! - Every engine call is caught: an engine that panics fails exactly the objects of the part
//!   it was running, with [`FailureCause::Panicked`], and the executor thread lives on.
//!
//! Threads block inside engines (a host copy, an SSD wait), which is why their number is a
//! configuration ([`CompositeConfig::workers`](crate::CompositeConfig)) and not the core count;
//! no thread is spawned per submit.
//!
//! # Deadlines
//!
//! One more thread, the deadline watcher, starts with the executor. It sleeps until the
//! earliest deadline of the batches submitted with one and, the moment it passes, settles
//! every part of that batch still waiting (behind other batches in the queue, for a bounce
//! slot, behind earlier groups of its lane) as timed out, whatever the executor's threads are
//! busy with. Parts already running got the deadline with their plan set, which engines that
//! can cancel honour.

use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use umbp_plan::{Failure, FailureCause, Fragment, PlanSet, Tag, TransferHandle};

use crate::batch::{returned_part, BatchShared, PartEnd, ReturnedWork};
use crate::integrity::Side;
use crate::routed::RoutedPart;
use crate::shared::{Shared, StageJob};
use crate::staging::{place, Lease, StagePiece};

type Job = Box<dyn FnOnce() + Send>;

/// The executor's threads and the queue they take jobs from, and the deadline watcher.
pub(crate) struct Executor {
    sender: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Dropped after the threads are joined.
    watcher: Watcher,
}

impl Executor {
    /// Starts `workers` threads (at least one) and the deadline watcher, which names the
    /// engines of the parts it times out through `shared`.
    pub(crate) fn start(workers: usize, shared: Arc<Shared>) -> std::io::Result<Self> {
        let watcher = Watcher::start(shared)?;
        let (sender, receiver) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::new();
        for i in 0..workers.max(1) {
            let receiver: Receiver<Job> = receiver.clone();
            let thread =
                std::thread::Builder::new().name(format!("umbp-composite-{i}")).spawn(move || {
                    for job in receiver.iter() {
                        // Jobs catch engine panics themselves; this keeps the thread alive if
                        // the composite's own code ever panics.
                        if catch_unwind(AssertUnwindSafe(job)).is_err() {
                            tracing::error!("an executor job panicked");
                        }
                    }
                });
            match thread {
                Ok(t) => threads.push(t),
                Err(e) if threads.is_empty() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, started = threads.len(), "fewer executor threads");
                    break;
                }
            }
        }
        Ok(Self { sender: Some(sender), threads, watcher })
    }

    /// Has the watcher settle `batch`'s waiting parts once `deadline` passes.
    pub(crate) fn watch(&self, deadline: Instant, batch: &Arc<BatchShared>) {
        self.watcher.watch(deadline, batch);
    }

    /// Queues `job`; jobs start in the order they were queued.
    pub(crate) fn spawn(&self, job: Job) {
        if let Some(sender) = &self.sender {
            // The receivers live as long as the threads, which live as long as `self`.
            let _ = sender.send(job);
        }
    }

    /// Number of threads.
    pub(crate) fn threads(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // Closing the queue ends each thread once the queue is drained.
        self.sender = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The deadline watcher: one thread that times out the waiting parts of each batch the moment
/// its deadline passes (see the module docs).
struct Watcher {
    state: Arc<WatchState>,
    thread: Option<JoinHandle<()>>,
}

struct WatchState {
    deadlines: Mutex<Deadlines>,
    /// Signalled when an earlier deadline arrives, and to stop.
    changed: Condvar,
}

struct Deadlines {
    /// Earliest first.
    heap: BinaryHeap<Reverse<Watched>>,
    /// The heap's size at which batches done before their deadline are dropped from it: twice
    /// what was left the last time, so the heap stays within twice the batches still pending
    /// at a cost of one step per batch watched.
    prune_at: usize,
    stop: bool,
}

/// A batch and its deadline; ordered by the deadline alone.
struct Watched {
    at: Instant,
    batch: Weak<BatchShared>,
}

impl PartialEq for Watched {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Watched {}

impl PartialOrd for Watched {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Watched {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.at.cmp(&other.at)
    }
}

/// The fewest watched batches the heap is pruned at.
const PRUNE_MIN: usize = 64;

impl WatchState {
    fn lock(&self) -> MutexGuard<'_, Deadlines> {
        // Each critical section is one push, pop or prune of the heap: a poisoned lock still
        // guards a valid heap.
        self.deadlines.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Watcher {
    fn start(shared: Arc<Shared>) -> std::io::Result<Self> {
        let state = Arc::new(WatchState {
            deadlines: Mutex::new(Deadlines {
                heap: BinaryHeap::new(),
                prune_at: PRUNE_MIN,
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let watched = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("umbp-composite-deadlines".into())
            .spawn(move || watch(&watched, &shared))?;
        Ok(Self { state, thread: Some(thread) })
    }

    fn watch(&self, at: Instant, batch: &Arc<BatchShared>) {
        let mut deadlines = self.state.lock();
        if deadlines.heap.len() >= deadlines.prune_at {
            deadlines.heap.retain(|Reverse(w)| w.batch.upgrade().is_some_and(|b| !b.is_done()));
            deadlines.prune_at = (2 * deadlines.heap.len()).max(PRUNE_MIN);
        }
        let earliest = deadlines.heap.peek().is_none_or(|Reverse(w)| at < w.at);
        deadlines.heap.push(Reverse(Watched { at, batch: Arc::downgrade(batch) }));
        drop(deadlines);
        if earliest {
            self.state.changed.notify_one();
        }
    }
}

/// The watcher's thread: sleeps until the earliest deadline, then times out what of that
/// batch still waits.
fn watch(state: &WatchState, shared: &Shared) {
    let mut deadlines = state.lock();
    loop {
        if deadlines.stop {
            return;
        }
        let now = Instant::now();
        deadlines = match deadlines.heap.peek().map(|Reverse(w)| w.at) {
            None => state.changed.wait(deadlines).unwrap_or_else(PoisonError::into_inner),
            Some(at) if at > now => {
                let slept = state.changed.wait_timeout(deadlines, at - now);
                slept.unwrap_or_else(PoisonError::into_inner).0
            }
            Some(_) => {
                let due = deadlines.heap.pop();
                drop(deadlines);
                if let Some(batch) = due.and_then(|Reverse(w)| w.batch.upgrade()) {
                    let expire = || batch.expire(&|i| shared.engine_name(i));
                    match catch_unwind(AssertUnwindSafe(expire)) {
                        Ok(0) => {}
                        Ok(parts) => {
                            tracing::debug!(parts, "deadline passed: waiting parts timed out")
                        }
                        Err(_) => tracing::error!("timing out a batch's waiting parts panicked"),
                    }
                }
                state.lock()
            }
        };
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.state.lock().stop = true;
        self.state.changed.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The panic message of `payload`, when it is a string.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".into())
}

/// A plan set an engine accepted, until its handle settles.
struct Submitted {
    index: usize,
    handle: TransferHandle,
    /// Each plan's pair and objects, to fail them if the engine panics while settling.
    carried: Vec<(umbp_plan::EndpointId, umbp_plan::EndpointId, Vec<Tag>)>,
    started: Instant,
    /// Whether the batch counts in the metrics ([`CompositeBuilder::set_metered`](crate::CompositeBuilder::set_metered)).
    metered: bool,
    /// Whether the engine reports the checksums of what it copies (the plan set carried a
    /// sink): then the executor hashes none of the part's bytes itself.
    engine_hashes: bool,
}

/// One failure per carried plan, for an engine that panicked with `payload`.
fn panicked(
    shared: &Shared,
    index: usize,
    carried: Vec<(umbp_plan::EndpointId, umbp_plan::EndpointId, Vec<Tag>)>,
    payload: &(dyn Any + Send),
    metered: bool,
) -> Vec<Failure> {
    let name = shared.engine_name(index);
    let message = panic_message(payload);
    tracing::error!(engine = %name, %message, "engine panicked while executing");
    let failures: Vec<Failure> = carried
        .into_iter()
        .map(|(src, dst, tags)| Failure {
            engine: name.clone(),
            src,
            dst,
            tags,
            cause: FailureCause::Panicked { message: message.clone() },
        })
        .collect();
    if metered {
        shared.record_failures(index, &failures);
    }
    failures
}

/// Submits `plans` to engine `index`. A panic fails every object of every plan (one failure
/// per plan) and loses the plans.
fn submit(
    shared: &Shared,
    index: usize,
    plans: PlanSet,
    metered: bool,
) -> Result<Submitted, Vec<Failure>> {
    let engine = &shared.engines[index];
    let carried: Vec<_> =
        plans.plans().iter().map(|p| (p.src(), p.dst(), p.tags().to_vec())).collect();
    let engine_hashes = plans.copy_hashes().is_some();
    let started = Instant::now();
    match catch_unwind(AssertUnwindSafe(|| engine.submit(plans))) {
        Ok(handle) => Ok(Submitted { index, handle, carried, started, metered, engine_hashes }),
        Err(payload) => Err(panicked(shared, index, carried, &*payload, metered)),
    }
}

/// Waits for a submitted plan set and records metrics; a panic while waiting fails every
/// object it carried.
fn settle(shared: &Shared, submitted: Submitted) -> (Vec<Failure>, PlanSet) {
    let Submitted { index, handle, carried, started, metered, .. } = submitted;
    match catch_unwind(AssertUnwindSafe(|| handle.into_settled())) {
        Ok(settled) => {
            if metered {
                shared.record(index, &settled.plans, &settled.failures, started.elapsed());
            }
            (settled.failures, settled.plans)
        }
        Err(payload) => (panicked(shared, index, carried, &*payload, metered), PlanSet::default()),
    }
}

/// Asks a submitted handle `question` (whether it is queued on the stream, whether it is
/// done), which the engine's completion answers; `Err` with the payload if it panicked.
fn ask(
    submitted: &Submitted,
    question: impl FnOnce(&TransferHandle) -> bool,
) -> Result<bool, Box<dyn Any + Send>> {
    catch_unwind(AssertUnwindSafe(|| question(&submitted.handle)))
}

/// Settles a plan set whose engine panicked while asked about it (`payload`): waits for the
/// engine to be done with the memory, then fails every object it carried, whatever the wait
/// says, since an engine that panicked is not trusted with a success.
fn settle_panicked(
    shared: &Shared,
    submitted: Submitted,
    payload: Box<dyn Any + Send>,
) -> (Vec<Failure>, PlanSet) {
    let Submitted { index, handle, carried, metered, .. } = submitted;
    let plans = catch_unwind(AssertUnwindSafe(|| handle.into_settled().plans)).unwrap_or_default();
    (panicked(shared, index, carried, &*payload, metered), plans)
}

/// Runs one engine's lane of a batch: its parts in group order. A part queued on the batch's
/// stream is enqueued at once and settled when its handle is done; any other is settled
/// before the next part starts.
pub(crate) fn run_lane(shared: &Shared, batch: &BatchShared, lane: Vec<(usize, RoutedPart)>) {
    // Parts queued on the stream, oldest first: (part index, group, engine, submitted).
    let mut queued: VecDeque<(usize, u32, usize, Submitted)> = VecDeque::new();
    // Settles a submitted part; `panic` when its engine panicked while asked about it.
    let settle_part = |(index, group, engine, submitted): (usize, u32, usize, Submitted),
                       panic: Option<Box<dyn Any + Send>>| {
        let engine_hashes = submitted.engine_hashes;
        let (mut failures, mut plans) = match panic {
            None => settle(shared, submitted),
            Some(payload) => settle_panicked(shared, submitted, payload),
        };
        plans.set_copy_hashes(None);
        if let Some(checks) = batch.checks() {
            check_part(batch, index, &mut failures, |failed| {
                if !engine_hashes {
                    let carried = plans.plans().iter().map(|p| (p.src(), p.dst(), p.tags()));
                    checks.hash_part(group, carried, Side::Written, failed);
                }
            });
        }
        batch.settle(index, PartEnd::Ran(failures), Some(returned_part(group, engine, plans)));
    };
    for (index, mut part) in lane {
        // Settled while it waited (a cancel, the deadline watcher): nothing left to do.
        if !batch.claim(index) {
            continue;
        }
        if batch.is_cancelled() {
            let returned = returned_part(part.group, part.engine, part.plans);
            batch.settle(index, PartEnd::Cancelled, Some(returned));
            continue;
        }
        if batch.expired() {
            let failures =
                part.plans.fail_all(&shared.engine_name(part.engine), FailureCause::TimedOut);
            let returned = returned_part(part.group, part.engine, part.plans);
            batch.settle(index, PartEnd::Ran(failures), Some(returned));
            continue;
        }
        part.plans.set_deadline(batch.deadline());
        part.plans.set_stream(batch.stream());
        part.plans.set_cancel(Some(batch.token().clone()));
        // An engine that hashes what it copies reports the checksums itself: one read of the
        // bytes instead of two.
        let sink =
            batch.checks().and_then(|c| c.copy_sink(&*shared.engines[part.engine], &part.plans));
        part.plans.set_copy_hashes(sink);
        let span = tracing::info_span!("umbp.part", engine = part.engine, group = part.group);
        let _enter = span.enter();
        match submit(shared, part.engine, part.plans, batch.is_metered()) {
            Err(failures) => {
                let returned = returned_part(part.group, part.engine, PlanSet::default());
                batch.settle(index, PartEnd::Ran(failures), Some(returned));
            }
            Ok(submitted) => {
                // Checksums of the bytes the engine reads from host memory: hashed while it
                // works (unless it hashes them itself).
                if let Some(checks) = batch.checks().filter(|_| !submitted.engine_hashes) {
                    let carried = submitted.carried.iter().map(|(s, d, t)| (*s, *d, &t[..]));
                    let failed = |tag| batch.has_failed(tag);
                    checks.hash_part(part.group, carried, Side::Read, &failed);
                }
                let on_stream = ask(&submitted, |h| h.is_queued() && !h.is_done());
                let part = (index, part.group, part.engine, submitted);
                match on_stream {
                    Ok(true) => {
                        batch.enqueued(index);
                        queued.push_back(part);
                    }
                    asked => settle_part(part, asked.err()),
                }
            }
        }
        while let Some(front) = queued.front() {
            let asked = ask(&front.3, TransferHandle::is_done);
            if asked.as_ref().is_ok_and(|done| !done) {
                break;
            }
            settle_part(queued.pop_front().expect("checked above"), asked.err());
        }
    }
    queued.into_iter().for_each(|part| settle_part(part, None));
}

/// Checksums of a part that ran and settled with `failures`: `hash` hashes what it moved for
/// the objects that did not fail, then the objects whose last part it was get their checksum
/// finished, and a restore that does not match gets its failure added to `failures`.
fn check_part(
    batch: &BatchShared,
    index: usize,
    failures: &mut Vec<Failure>,
    hash: impl FnOnce(&dyn Fn(Tag) -> bool),
) {
    let Some(checks) = batch.checks() else { return };
    let mut here: Vec<Tag> = failures.iter().flat_map(|f| f.tags.iter().copied()).collect();
    here.sort_unstable();
    let failed = |tag| here.binary_search(&tag).is_ok() || batch.has_failed(tag);
    hash(&failed);
    checks.part_ran(batch.part(index).tags(), &failed, failures);
}

/// Runs a stage when a slot is free (parks it otherwise), then every stage its returned slots
/// unpark, on this thread.
pub(crate) fn run_stage(job: StageJob) {
    let shared = Arc::clone(&job.shared);
    let Some(pool) = shared.staging.get() else {
        unreachable!("stages exist only with staging configured")
    };
    // A stage that will not run does not wait for a slot.
    if job.batch.is_cancelled() || job.batch.expired() {
        if !job.batch.claim(job.part) {
            // Already settled while it waited in the queue.
        } else if job.batch.is_cancelled() {
            cancel_stage(job);
        } else {
            time_out_stage(job);
        }
        return;
    }
    let mut next = pool.lease_or_park(job);
    while let Some((job, lease)) = next {
        let lease = if !job.batch.claim(job.part) {
            // Settled while it waited for the slot: the slot goes straight on.
            lease
        } else if job.batch.is_cancelled() {
            cancel_stage(job);
            lease
        } else if job.batch.expired() {
            time_out_stage(job);
            lease
        } else {
            run_leased(job, lease)
        };
        next = pool.give_back(lease);
    }
}

fn cancel_stage(job: StageJob) {
    job.batch.settle(job.part, PartEnd::Cancelled, Some(ReturnedWork::Staged(job.fragments)));
}

/// A stage that had not started by the batch's deadline: its objects fail with `TimedOut`.
fn time_out_stage(job: StageJob) {
    let bounce = job.shared.bounce();
    let failure = Failure {
        engine: "staged".into(),
        src: bounce,
        dst: bounce,
        tags: job.batch.part(job.part).tags().to_vec(),
        cause: FailureCause::TimedOut,
    };
    job.batch.settle(
        job.part,
        PartEnd::Ran(vec![failure]),
        Some(ReturnedWork::Staged(job.fragments)),
    );
}

/// Both hops of one stage through the slot `lease` holds; gives the lease back to the caller.
fn run_leased(job: StageJob, lease: Lease) -> Lease {
    let StageJob { shared, batch, part, fragments } = job;
    let span = tracing::info_span!("umbp.stage", fragments = fragments.len());
    let _enter = span.enter();
    let pieces = place(&fragments);
    let failures = match shared.registry.get(shared.bounce()) {
        None => {
            let bounce = shared.bounce();
            vec![Failure {
                engine: "staged".into(),
                src: bounce,
                dst: bounce,
                tags: batch.part(part).tags().to_vec(),
                cause: FailureCause::EndpointGone(bounce),
            }]
        }
        Some(bounce) => {
            let mut failures =
                hop(&shared, &batch, &pieces, lease.base, Hop::First, &HashSet::new(), None);
            let failed: HashSet<Tag> =
                failures.iter().flat_map(|f| f.tags.iter().copied()).collect();
            // The slot holds the stage's bytes now: they are hashed there while the second
            // hop's engine reads them out (an asynchronous copy to a GPU, SSD writes).
            let hash = || {
                if let Some(checks) = batch.checks() {
                    let skip = |tag| failed.contains(&tag) || batch.has_failed(tag);
                    checks.hash_stage(&bounce, lease.base, &pieces, &skip);
                }
            };
            let second =
                hop(&shared, &batch, &pieces, lease.base, Hop::Second, &failed, Some(&hash));
            failures.extend(second);
            if batch.checks().is_some() {
                check_part(&batch, part, &mut failures, |_| {});
            }
            failures
        }
    };
    batch.settle(part, PartEnd::Ran(failures), Some(ReturnedWork::Staged(fragments)));
    lease
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Hop {
    /// Source to the slot.
    First,
    /// The slot to the destination.
    Second,
}

/// One hop of one stage, skipping objects in `skip` and objects the batch already failed. The
/// stage holds one route, so one engine carries the whole hop. `meanwhile` runs once the
/// hop's plans are submitted, while its engine works, before waiting for them.
fn hop(
    shared: &Shared,
    batch: &BatchShared,
    pieces: &[StagePiece],
    base: u64,
    which: Hop,
    skip: &HashSet<Tag>,
    meanwhile: Option<&dyn Fn()>,
) -> Vec<Failure> {
    let Some(first) = pieces.first() else { return Vec::new() };
    let index = match which {
        Hop::First => first.fragment.read,
        Hop::Second => first.fragment.write,
    };
    let bounce = shared.bounce();
    let planned = catch_unwind(AssertUnwindSafe(|| {
        let mut builder = shared.engine_builder(index);
        let mut rejected = Vec::new();
        for run in pieces.chunk_by(|a, b| a.fragment.fragment.tag == b.fragment.fragment.tag) {
            let tag = run[0].fragment.fragment.tag;
            if skip.contains(&tag) || batch.has_failed(tag) {
                continue;
            }
            let mut ok = builder.begin_object(tag).is_ok();
            for p in run {
                let f = p.fragment.fragment;
                let hop = match which {
                    Hop::First => {
                        Fragment::new(f.src, f.src_offset, bounce, base + p.at, f.len, tag)
                    }
                    Hop::Second => {
                        Fragment::new(bounce, base + p.at, f.dst, f.dst_offset, f.len, tag)
                    }
                };
                ok = ok && builder.push(hop).is_ok();
            }
            if !(builder.commit_object().is_ok() && ok) {
                rejected.push(tag);
            }
        }
        builder.finish().map(|plans| (plans, rejected))
    }));
    let name = shared.engine_name(index);
    let refused = |tags: Vec<Tag>, why: String| Failure {
        engine: name.clone(),
        src: bounce,
        dst: bounce,
        tags,
        cause: FailureCause::NotAccepted(why),
    };
    match planned {
        Ok(Ok((mut plans, mut rejected))) => {
            rejected.extend_from_slice(plans.rejected());
            plans.set_deadline(batch.deadline());
            plans.set_cancel(Some(batch.token().clone()));
            let (mut failures, _) = match submit(shared, index, plans, batch.is_metered()) {
                Ok(submitted) => {
                    meanwhile.into_iter().for_each(|f| f());
                    settle(shared, submitted)
                }
                Err(failures) => (failures, PlanSet::default()),
            };
            if !rejected.is_empty() {
                failures.push(refused(rejected, "staged hop refused by its engine".into()));
            }
            failures
        }
        Ok(Err(e)) => {
            vec![refused(pieces.iter().map(|p| p.fragment.fragment.tag).collect(), e.to_string())]
        }
        Err(payload) => vec![Failure {
            engine: name.clone(),
            src: bounce,
            dst: bounce,
            tags: pieces.iter().map(|p| p.fragment.fragment.tag).collect(),
            cause: FailureCause::Panicked { message: panic_message(&*payload) },
        }],
    }
}
