//! The engine's worker threads: each owns an executor (its own ring, or the blocking path) and
//! a bounce-buffer pool, takes submitted plan sets from one shared queue, runs each to the end
//! and settles its handle.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use umbp_plan::{
    EndpointId, EndpointKind, EndpointPins, EndpointRegistry, EndpointRelease, EndpointTable,
    Failure, FailureCause, OverlapCheck, PlanSet, SettleSlot, Settled, Space, TransferHandle,
};

use crate::batch::{plan_files, Batch, Limits, PlanFiles};
use crate::fault::Faults;
use crate::file::FileTable;
use crate::op::BouncePool;
use crate::ring::Ring;
use crate::{sys, Backend, Error};

/// What the engine and its workers share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) files: FileTable,
    pub(crate) faults: Faults,
    pub(crate) limits: Limits,
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
    /// `None` once settled.
    plans: Option<PlanSet>,
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
    fn settle(&mut self, mut failures: Vec<Failure>) {
        let plans = self.plans.take().unwrap_or_default();
        failures.append(&mut self.early);
        // Unpinned before the handle sees the batch settled, so a deregistration right after
        // the wait does not wait again.
        drop(self.pins.take());
        self.slot.fill(Settled { failures, plans });
    }
}

impl Drop for Job {
    /// A job dropped unsettled (its worker panicked) fails every plan, so no handle waits
    /// forever.
    fn drop(&mut self) {
        let Some(plans) = &self.plans else { return };
        let cause = FailureCause::NotAccepted("the worker running this batch panicked".into());
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
    /// `pread`/`pwrite`.
    pub(crate) fn start(
        shared: Arc<Shared>,
        backend: Backend,
        depth: u32,
        count: usize,
    ) -> Result<Self, Error> {
        let (sender, receiver) = channel::<Box<Job>>();
        let receiver = Arc::new(Mutex::new(receiver));
        let (ready, started) = channel::<std::io::Result<()>>();
        let mut workers = Self { sender: Some(sender), threads: Vec::new(), shared };
        for i in 0..count {
            let receiver = Arc::clone(&receiver);
            let ready = ready.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{}-{i}", workers.shared.name))
                .spawn(move || {
                    let executor = match backend {
                        Backend::Blocking => Ok(Executor::Blocking),
                        _ => Ring::new(depth).map(|ring| Executor::Ring(Box::new(ring))),
                    };
                    let executor = match executor {
                        Ok(executor) => executor,
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    drop(ready);
                    work(&receiver, executor);
                })
                .map_err(|source| Error::Spawn { source })?;
            workers.threads.push(thread);
        }
        drop(ready);
        for outcome in started.iter() {
            outcome.map_err(|source| Error::RingUnavailable { source })?;
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
            plans: Some(plans),
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
                let plans = job.plans.take().unwrap_or_default();
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

/// A worker's loop: take a job, run it, settle it, until the queue closes.
fn work(receiver: &Mutex<Receiver<Box<Job>>>, mut executor: Executor) {
    let mut pool = BouncePool::default();
    loop {
        let job = receiver.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(mut job) = job else { return };
        let Some(plans) = job.plans.as_ref() else { continue };
        let shared = Arc::clone(&job.engine);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let mut batch =
                Batch::new(plans, &job.table, &job.files, shared.limits, &mut pool, &shared.faults);
            match &mut executor {
                Executor::Ring(ring) => ring.run(&mut batch),
                Executor::Blocking => sys::run_blocking(&mut batch),
            }
            batch.failures(&shared.name)
        }));
        match outcome {
            Ok(failures) => job.settle(failures),
            Err(_) => {
                tracing::error!(engine = %shared.name, "a batch panicked; its plans fail");
                pool = BouncePool::default();
                drop(job);
            }
        }
    }
}
