//! The engine's worker threads: each owns an executor (its own ring, or the blocking path) and
//! bounce-buffer pools, takes submitted plan sets from one shared queue and settles each
//! handle when its batch is done. A ring runs several batches at once (`ring::LANES`): the
//! next one starts filling the ring while the last requests of the one before complete. The
//! blocking path runs one at a time.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::thread::JoinHandle;

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
    /// Which blocks the engine's bounce writes own, across every worker and lane.
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
        };
        Batch::new(plans, &self.table, &self.files, pool, context)
    }

    fn settle(&mut self, mut failures: Vec<Failure>) {
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
        let Some(plans) = &self.plans else { return };
        let cause =
            FailureCause::NotAccepted("a panic in the engine's worker stopped this batch".into());
        let failures = plans.fail_all(&self.engine.name, cause);
        self.settle(failures);
    }
}

/// The worker threads and the queue that feeds them.
#[derive(Debug)]
pub(crate) struct Workers {
    sender: Option<Sender<Box<Job>>>,
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
        let (sender, receiver) = channel::<Box<Job>>();
        let receiver = Arc::new(Mutex::new(receiver));
        let (ready, started) = channel::<Result<(), Error>>();
        let mut workers = Self { sender: Some(sender), threads: Vec::new(), shared };
        for i in 0..count {
            let receiver = Arc::clone(&receiver);
            let ready = ready.clone();
            let name = workers.shared.name.clone();
            let cpu = (!cpus.is_empty()).then(|| cpus[i % cpus.len()]);
            let thread = std::thread::Builder::new()
                .name(format!("{}-{i}", workers.shared.name))
                .spawn(move || {
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
                    work(&receiver, executor, &name);
                })
                .map_err(|source| Error::Spawn { source })?;
            workers.threads.push(thread);
        }
        drop(ready);
        for outcome in started.iter() {
            outcome?;
        }
        Ok(workers)
    }

    /// Queues `plans` for the next free worker.
    /// Queues `plans` for a worker, after the overlap rule and with every file it uses taken
    /// (so a deregistration after submit cannot fail the batch or close its files under it).
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
        let files = plan_files(&plans, &table, &self.shared.files);
        let slot = SettleSlot::new();
        let job = Box::new(Job {
            plans: Some(Arc::new(plans)),
            table,
            files,
            early,
            pins: Some(pins),
            slot: Arc::clone(&slot),
            engine: Arc::clone(&self.shared),
        });
        match self.sender.as_ref().map(|s| s.send(job)) {
            Some(Ok(())) => slot.handle(),
            // No worker left to take it: the job came back and settles as failed when dropped.
            Some(Err(returned)) => {
                let mut job = returned.0;
                let plans = job.plans.take().map(Arc::unwrap_or_clone).unwrap_or_default();
                let cause = FailureCause::NotAccepted("the engine has no running worker".into());
                let mut failures = plans.fail_all(&self.shared.name, cause);
                failures.append(&mut job.early);
                TransferHandle::settled(failures, plans)
            }
            None => unreachable!("the sender lives until the workers are dropped"),
        }
    }
}

impl Drop for Workers {
    /// Closes the queue; every worker finishes the jobs already queued, then exits.
    fn drop(&mut self) {
        drop(self.sender.take());
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A worker's loop: run the jobs of the queue until it closes. A batch that panics in the ring,
/// while it is made or while it is settled fails alone (the ring catches it); a panic anywhere
/// else while running (the ring's own code, the blocking path) fails the jobs that were running
/// and the worker carries on.
fn work(receiver: &Mutex<Receiver<Box<Job>>>, mut executor: Executor, engine: &str) {
    let mut pools = Vec::new();
    let waker = match &executor {
        Executor::Ring(ring) => ring.waker(),
        Executor::Blocking => Waker::current_thread(),
    };
    loop {
        let mut feed = Queue { receiver, pools: &mut pools, waker: &waker };
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
    receiver: &'a Mutex<Receiver<Box<Job>>>,
    /// Bounce-buffer pools not lent to a running batch.
    pools: &'a mut Vec<BouncePool>,
    /// Wakes the worker's executor.
    waker: &'a Waker,
}

impl Feed for Queue<'_> {
    type Owner = Box<Job>;

    fn next(&mut self, busy: bool) -> Option<(Box<Job>, Batch)> {
        loop {
            let job = if busy {
                // Never wait for the lock while requests are in flight: an idle worker holds
                // it while it waits for a job, and will take the next one itself.
                let receiver = match self.receiver.try_lock() {
                    Ok(receiver) => receiver,
                    Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                    Err(TryLockError::WouldBlock) => return None,
                };
                receiver.try_recv().ok()?
            } else {
                let receiver = self.receiver.lock().unwrap_or_else(PoisonError::into_inner);
                receiver.recv().ok()?
            };
            if job.plans.is_none() {
                continue;
            }
            let batch = job.batch(self.pools.pop().unwrap_or_default(), self.waker);
            return Some((job, batch));
        }
    }

    fn done(&mut self, mut job: Box<Job>, batch: Batch) {
        let (failures, pool) = batch.outcome(&job.engine.name);
        self.pools.push(pool);
        job.settle(failures);
    }
}
