//! The engine's worker threads: each owns an executor (its own ring, or the blocking path) and
//! bounce-buffer pools, takes submitted plan sets from one shared queue and settles each
//! handle when its batch is done. A ring runs several batches at once (`ring::LANES`): the
//! next one starts filling the ring while the last requests of the one before complete. The
//! blocking path runs one at a time.
//!
//! Cancel and deadlines reach a job wherever it is. A job whose plan set has a cancel token
//! registers a wake-up with it at submit. While the job waits in the queue, the wake-up wakes
//! the engine's watcher thread, which settles it at once with every object `Cancelled`
//! (nothing of it was issued); once a worker took it, it wakes that worker's executor (a
//! ring's doorbell, a parked fallback thread), which stops the batch and cancels what it has
//! in flight. The watcher also settles the queued jobs whose deadline passed, as `TimedOut`:
//! a job queued behind workers whose every lane is stuck ends at its deadline all the same.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use umbp_plan::{
    EndpointId, EndpointKind, EndpointPins, EndpointRegistry, EndpointRelease, EndpointTable,
    Failure, FailureCause, OverlapCheck, PlanSet, SettleSlot, Settled, Space, TransferHandle,
};

use crate::batch::{plan_files, Batch, Context, Limits, PlanFiles};
use crate::fault::Faults;
use crate::file::FileTable;
use crate::op::BouncePool;
use crate::ring::{Feed, Ring};
use crate::sectors::Sectors;
use crate::wake::Waker;
use crate::{fallback, sys, Backend, Error};

/// What the engine and its workers share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) files: FileTable,
    pub(crate) faults: Arc<Faults>,
    pub(crate) limits: Limits,
    /// Which bytes the writes of the process own, across every engine, worker and lane
    /// (`sectors`).
    pub(crate) sectors: Arc<Sectors>,
    pub(crate) name: String,
    /// The overlap rule's buffers, shared by submitting threads.
    pub(crate) overlap: Mutex<OverlapCheck>,
}

/// Forgets a deregistered file endpoint (the guard of a [`Register`](umbp_plan::Register)
/// registration through the engine).
impl EndpointRelease for Shared {
    fn release(&self, id: EndpointId) {
        self.files.retire(id);
    }
}

/// How a worker moves bytes.
#[derive(Debug)]
enum Executor {
    Ring(Box<Ring>),
    Blocking,
}

/// What a job's cancel wake-up shares with the job.
#[derive(Debug, Default)]
struct Cancel {
    /// Set by the wake-up; the job's batch stops on it.
    flag: Arc<AtomicBool>,
    /// The executor running the job, once a worker took it (woken on cancel); `None` while
    /// the job is queued (the watcher is woken instead) and once it settled.
    runner: Mutex<Option<Waker>>,
}

impl Cancel {
    fn runner(&self) -> MutexGuard<'_, Option<Waker>> {
        // A single assignment or clone under the lock: never inconsistent.
        self.runner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One submitted plan set on its way to a worker.
struct Job {
    /// `None` once settled. Shared with the job's batch while it runs.
    plans: Option<Arc<PlanSet>>,
    table: Arc<EndpointTable>,
    /// Each plan's file, held open from submit until the job settles.
    files: PlanFiles,
    /// Failures found at submit (the overlap rule), reported with the job's own.
    early: Vec<Failure>,
    /// The endpoints the job uses, pinned from submit until it settles.
    pins: Option<EndpointPins>,
    slot: Arc<SettleSlot>,
    engine: Arc<Shared>,
    /// Present when the plan set has a cancel token.
    cancel: Option<Arc<Cancel>>,
}

impl Job {
    /// The batch that runs this job's plans, with `pool`'s bounce buffers, on the executor
    /// that `waker` wakes.
    fn batch(&self, pool: BouncePool, waker: &Waker) -> Batch {
        let plans = Arc::clone(self.plans.as_ref().expect("a job is run before it settles"));
        let shared = &self.engine;
        let context = Context {
            limits: shared.limits,
            faults: Arc::clone(&shared.faults),
            sectors: Arc::clone(&shared.sectors),
            waker: waker.clone(),
            cancel: self.cancel.as_ref().map(|c| Arc::clone(&c.flag)),
        };
        Batch::new(plans, &self.table, &self.files, pool, context)
    }

    /// Why the job, queued, must settle without running (`now` being the time): cancelled,
    /// or past its deadline.
    fn due(&self, now: Instant) -> Option<FailureCause> {
        let plans = self.plans.as_ref()?;
        if self.cancel.as_ref().is_some_and(|c| c.flag.load(Ordering::Acquire)) {
            Some(FailureCause::Cancelled)
        } else if plans.deadline().is_some_and(|d| now >= d) {
            Some(FailureCause::TimedOut)
        } else {
            None
        }
    }

    /// Settles the job, none of whose plans ran, with every object failing with `cause`.
    fn settle_all(&mut self, cause: FailureCause) {
        let Some(plans) = &self.plans else { return };
        let failures = plans.fail_all(&self.engine.name, cause);
        self.settle(failures);
    }

    fn settle(&mut self, mut failures: Vec<Failure>) {
        if let Some(cancel) = &self.cancel {
            // The token may outlive the engine: it keeps no executor.
            cancel.runner().take();
        }
        // The batch is gone by now (it hands the plans back when done, and drops before its
        // job when unwinding), so the plans are this job's alone; a clone covers the rest.
        let plans = self.plans.take().map(Arc::unwrap_or_clone).unwrap_or_default();
        failures.append(&mut self.early);
        // Unpinned before the handle sees the batch settled, so a deregistration right after
        // the wait does not wait again.
        drop(self.pins.take());
        self.slot.fill(Settled { failures, plans });
    }
}

impl Drop for Job {
    /// A job dropped unsettled (its batch, or its worker, panicked) fails every plan, so no
    /// handle waits forever.
    fn drop(&mut self) {
        let cause =
            FailureCause::NotAccepted("a panic in the engine's worker stopped this batch".into());
        self.settle_all(cause);
    }
}

/// The queue of submitted jobs, shared by the workers, the watcher and the submitters.
#[derive(Default)]
struct JobQueue {
    state: Mutex<QueueState>,
    /// Idle workers wait here for a job.
    work: Condvar,
    /// The watcher waits here for the next deadline, a cancel or the close.
    watch: Condvar,
}

#[derive(Default)]
struct QueueState {
    jobs: VecDeque<Box<Job>>,
    /// Workers waiting on `work`: while one does, busy workers leave new jobs to it, so that
    /// jobs spread over the workers.
    idle: usize,
    /// Workers running; a submit with none left fails at once.
    alive: usize,
    /// The earliest deadline the watcher waits for (`None`: it waits for a wake-up only).
    watching_until: Option<Instant>,
    /// A queued job was cancelled: the watcher looks at the queue at once.
    poked: bool,
    /// Set when the engine drops: workers run what is queued and exit; the watcher exits.
    closed: bool,
}

impl std::fmt::Debug for JobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("JobQueue")
            .field("queued", &state.jobs.len())
            .field("idle", &state.idle)
            .finish_non_exhaustive()
    }
}

impl JobQueue {
    fn lock(&self) -> MutexGuard<'_, QueueState> {
        // Every critical section leaves the state whole (jobs are pushed and popped whole, and
        // settled outside the lock): a poisoned lock still guards a consistent queue.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A queued job was cancelled: the watcher settles it.
    fn poke(&self) {
        self.lock().poked = true;
        self.watch.notify_one();
    }
}

/// Counts a worker running while it lives, in the queue's `alive`.
struct Alive<'a>(&'a JobQueue);

impl Drop for Alive<'_> {
    fn drop(&mut self) {
        self.0.lock().alive -= 1;
    }
}

/// The watcher's loop: settles the queued jobs that were cancelled or whose deadline passed,
/// sleeping until the next deadline or a wake-up in between; returns once the queue closes.
fn watch(queue: &JobQueue) {
    let mut state = queue.lock();
    loop {
        if state.closed {
            return;
        }
        state.poked = false;
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        let mut i = 0;
        while i < state.jobs.len() {
            if let Some(cause) = state.jobs[i].due(now) {
                due.extend(state.jobs.remove(i).map(|job| (job, cause)));
                continue;
            }
            let deadline = state.jobs[i].plans.as_ref().and_then(|p| p.deadline());
            next = match (next, deadline) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            i += 1;
        }
        if !due.is_empty() {
            drop(state);
            for (mut job, cause) in due {
                job.settle_all(cause);
            }
            state = queue.lock();
            continue;
        }
        state.watching_until = next;
        state = match next {
            Some(at) => {
                let left = at.saturating_duration_since(now);
                queue.watch.wait_timeout(state, left).unwrap_or_else(PoisonError::into_inner).0
            }
            None => queue.watch.wait(state).unwrap_or_else(PoisonError::into_inner),
        };
    }
}

/// The worker threads, the queue that feeds them and the watcher of queued jobs.
#[derive(Debug)]
pub(crate) struct Workers {
    queue: Arc<JobQueue>,
    /// The workers, then the watcher.
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
}

impl Workers {
    /// Starts `count` workers. With [`Backend::IoUring`] each creates its own ring (a ring
    /// with a single issuer must be set up by the thread that uses it) and reports whether it
    /// could; `start` fails if one could not. With [`Backend::Blocking`] they use
    /// `pread`/`pwrite`. Worker `i` first pins itself to `cpus[i % cpus.len()]` when `cpus` is
    /// not empty; `start` fails if it could not.
    pub(crate) fn start(
        shared: Arc<Shared>,
        backend: Backend,
        depth: u32,
        count: usize,
        cpus: &[usize],
    ) -> Result<Self, Error> {
        let queue = Arc::new(JobQueue::default());
        let (ready, started) = channel::<Result<(), Error>>();
        let mut workers = Self { queue, threads: Vec::new(), shared };
        for i in 0..count {
            let queue = Arc::clone(&workers.queue);
            let ready = ready.clone();
            let name = workers.shared.name.clone();
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread = std::thread::Builder::new()
                .name(format!("{}-{i}", workers.shared.name))
                .spawn(move || {
                    queue.lock().alive += 1;
                    let _alive = Alive(&queue);
                    // Pinned before the ring exists, so the ring's memory is first touched
                    // on the worker's own CPU.
                    let pinned = cpu.map_or(Ok(()), |cpu| {
                        sys::pin_current_thread(cpu)
                            .map_err(|source| Error::Affinity { cpu, source })
                    });
                    let executor = pinned.and_then(|()| match backend {
                        Backend::Blocking => Ok(Executor::Blocking),
                        _ => Ring::new(depth)
                            .map(|ring| Executor::Ring(Box::new(ring)))
                            .map_err(|source| Error::RingUnavailable { source }),
                    });
                    let executor = match executor {
                        Ok(executor) => executor,
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    drop(ready);
                    work(&queue, executor, &name);
                })
                .map_err(|source| Error::Spawn { source })?;
            workers.threads.push(thread);
        }
        drop(ready);
        for outcome in started.iter() {
            outcome?;
        }
        let queue = Arc::clone(&workers.queue);
        let watcher = std::thread::Builder::new()
            .name(format!("{}-watch", workers.shared.name))
            .spawn(move || watch(&queue))
            .map_err(|source| Error::Spawn { source })?;
        workers.threads.push(watcher);
        Ok(workers)
    }

    /// Queues `plans` for a worker, after the overlap rule and with every file it uses taken
    /// (so a deregistration after submit cannot fail the batch or close its files under it).
    /// A plan set cancelled already settles at once, every object `Cancelled`.
    pub(crate) fn submit(&self, mut plans: PlanSet) -> TransferHandle {
        // A deregistration waits until the batch settles; the plans resolve in the pinned table.
        let pins = self.shared.registry.pin(plans.endpoints());
        let table = Arc::clone(pins.table());
        let early = {
            let mut overlap = self.shared.overlap.lock().unwrap_or_else(PoisonError::into_inner);
            overlap.exclude(&mut plans, &self.shared.name, |id| {
                let e = table.get(id)?;
                match e.kind() {
                    EndpointKind::Host => Some((Space::Host, e.addr())),
                    EndpointKind::File(range) => Some((Space::File(range.fd), range.file_offset)),
                    _ => None,
                }
            })
        };
        if plans.plans().is_empty() {
            return TransferHandle::settled(early, plans);
        }
        let token = plans.cancel_token().cloned();
        if token.as_ref().is_some_and(|t| t.is_cancelled()) {
            let mut failures = plans.fail_all(&self.shared.name, FailureCause::Cancelled);
            failures.extend(early);
            return TransferHandle::settled(failures, plans);
        }
        let deadline = plans.deadline();
        let files = plan_files(&plans, &table, &self.shared.files);
        let slot = SettleSlot::new();
        let cancel = token.as_ref().map(|_| Arc::new(Cancel::default()));
        let job = Box::new(Job {
            plans: Some(Arc::new(plans)),
            table,
            files,
            early,
            pins: Some(pins),
            slot: Arc::clone(&slot),
            engine: Arc::clone(&self.shared),
            cancel: cancel.clone(),
        });
        {
            let mut state = self.queue.lock();
            if state.alive == 0 || state.closed {
                drop(state);
                let mut job = job;
                let cause = FailureCause::NotAccepted("the engine has no running worker".into());
                job.settle_all(cause);
                return slot.handle();
            }
            state.jobs.push_back(job);
            if state.idle > 0 {
                self.queue.work.notify_one();
            }
            if deadline.is_some_and(|d| state.watching_until.is_none_or(|w| d < w)) {
                state.watching_until = deadline;
                self.queue.watch.notify_one();
            }
        }
        // Registered once the job is queued, so that a cancel from now on finds it, queued
        // (the watcher settles it) or taken by a worker (whose executor stops it).
        if let (Some(token), Some(cancel)) = (token, cancel) {
            let queue = Arc::downgrade(&self.queue);
            token.on_cancel(Box::new(move || cancelled(&cancel, &queue)));
        }
        slot.handle()
    }
}

/// A job's cancel wake-up: marks the job cancelled and wakes whoever holds it.
fn cancelled(cancel: &Cancel, queue: &Weak<JobQueue>) {
    cancel.flag.store(true, Ordering::Release);
    let runner = cancel.runner().clone();
    match runner {
        Some(waker) => waker.wake(),
        None => {
            if let Some(queue) = queue.upgrade() {
                queue.poke();
            }
        }
    }
}

impl Drop for Workers {
    /// Closes the queue; every worker finishes the jobs already queued, then exits.
    fn drop(&mut self) {
        self.queue.lock().closed = true;
        self.queue.work.notify_all();
        self.queue.watch.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A worker's loop: run the jobs of the queue until it closes. A batch that panics in the ring,
/// while it is made or while it is settled fails alone (the ring catches it); a panic anywhere
/// else while running (the ring's own code, the blocking path) fails the jobs that were running
/// and the worker carries on.
fn work(queue: &JobQueue, mut executor: Executor, engine: &str) {
    let mut pools = Vec::new();
    let waker = match &executor {
        Executor::Ring(ring) => ring.waker(),
        Executor::Blocking => Waker::current_thread(),
    };
    loop {
        let mut feed = Queue { queue, pools: &mut pools, waker: &waker };
        let outcome = catch_unwind(AssertUnwindSafe(|| match &mut executor {
            Executor::Ring(ring) => ring.serve(&mut feed),
            Executor::Blocking => {
                while let Some((job, mut batch)) = feed.next(false) {
                    fallback::run(&mut batch);
                    feed.done(job, batch);
                }
            }
        }));
        match outcome {
            Ok(()) => return,
            Err(_) => {
                // The ring drained before unwinding past the batches; each job dropped with
                // its batch failed its objects.
                tracing::error!(engine, "the worker panicked; the batches it was running fail");
                pools.clear();
            }
        }
    }
}

/// A worker's side of the queue, for its executor: jobs in, settled jobs out.
struct Queue<'a> {
    queue: &'a JobQueue,
    /// Bounce-buffer pools not lent to a running batch.
    pools: &'a mut Vec<BouncePool>,
    /// Wakes the worker's executor.
    waker: &'a Waker,
}

impl Feed for Queue<'_> {
    type Owner = Box<Job>;

    fn next(&mut self, busy: bool) -> Option<(Box<Job>, Batch)> {
        let job = if busy {
            // Never wait for the lock while requests are in flight; and leave the job to an
            // idle worker if there is one, so that jobs spread over the workers.
            let mut state = match self.queue.state.try_lock() {
                Ok(state) => state,
                Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                Err(TryLockError::WouldBlock) => return None,
            };
            if state.idle > 0 {
                return None;
            }
            state.jobs.pop_front()?
        } else {
            let mut state = self.queue.lock();
            loop {
                if let Some(job) = state.jobs.pop_front() {
                    break job;
                }
                if state.closed {
                    return None;
                }
                state.idle += 1;
                state = self.queue.work.wait(state).unwrap_or_else(PoisonError::into_inner);
                state.idle -= 1;
            }
        };
        if let Some(cancel) = &job.cancel {
            // From here on a cancel wakes this executor, which sees the flag at its next look.
            *cancel.runner() = Some(self.waker.clone());
        }
        let batch = job.batch(self.pools.pop().unwrap_or_default(), self.waker);
        Some((job, batch))
    }

    fn done(&mut self, mut job: Box<Job>, batch: Batch) {
        let (failures, pool) = batch.outcome(&job.engine.name);
        self.pools.push(pool);
        job.settle(failures);
    }
}
