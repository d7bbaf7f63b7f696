//! The persistent worker pool: threads, started once per engine, that help submitters drain
//! their task lists.
//!
//! # Strategy
//!
//! 1. A submit that goes parallel posts a [`Job`] (its task list and a claim cursor) at the back
//!    of the pool's queue, wakes as many idle workers as the job has chunks to spare, and then
//!    works on its own job: the calling thread is one of the copying threads.
//! 2. Every thread claims the next chunk of tasks with one `fetch_add` on the job's cursor, so
//!    large and small segments balance without any thread being assigned a share up front.
//! 3. A worker serves the oldest job in the queue until its cursor runs out, then retires it
//!    from the queue and takes the next. Concurrent submits therefore never wait for each other
//!    to finish: each submitter drains its own job, with help when workers are free.
//! 4. When its cursor runs out, the submitter retires its job and parks until the chunks other
//!    threads claimed are done (the completion count reaches zero); then every task has run.
//!
//! Nothing here is `unsafe`: the task list is owned by the job, and tasks are `Send + Sync` for
//! the reasons given in `copy.rs`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle, Thread};

use crate::copy::{run_tasks, Kernel, Task};

/// About this many bytes of tasks per claim: enough to make the cursor's cache line cold news
/// next to the copy, few enough that threads finish close together.
const CLAIM_BYTES: usize = 256 << 10;

/// Worker threads shared by every submit of one engine.
#[derive(Debug)]
pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Arc<Job>>,
    closed: bool,
}

/// One submit's task list, with its claim cursor and completion count.
#[derive(Debug)]
struct Job {
    tasks: Vec<Task>,
    /// Tasks per claim.
    chunk: usize,
    kernel: Kernel,
    /// The first task not yet claimed (may run past the end).
    next: AtomicUsize,
    /// Tasks not yet copied; the thread that brings it to zero unparks `owner`.
    remaining: AtomicUsize,
    owner: Thread,
}

impl Job {
    /// Claims and runs chunks until the cursor passes the end.
    fn work(&self) {
        let total = self.tasks.len();
        loop {
            // Relaxed: the cursor only hands out disjoint index ranges; the task list itself
            // was published to this thread through the queue's mutex.
            let start = self.next.fetch_add(self.chunk, Ordering::Relaxed);
            if start >= total {
                return;
            }
            let end = total.min(start + self.chunk);
            // `run_tasks` fences its non-temporal stores, so the release below orders them too.
            run_tasks(&self.tasks[start..end], self.kernel);
            let done = end - start;
            // Release: pairs with the owner's acquire load in `Pool::run`. The decrements of all
            // threads form one release sequence, so the owner that reads zero sees every byte.
            if self.remaining.fetch_sub(done, Ordering::Release) == done {
                self.owner.unpark();
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        // Nothing panics while holding the lock, and every change is a single push, removal
        // or flag store, so a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes `job` from the queue if it is still there (whoever sees it exhausted first).
    fn retire(&self, job: &Arc<Job>) {
        let mut queue = self.lock();
        if let Some(i) = queue.jobs.iter().position(|j| Arc::ptr_eq(j, job)) {
            queue.jobs.remove(i);
        }
    }

    /// The loop of one worker thread: serve the oldest job, sleep when there is none.
    fn serve(&self) {
        loop {
            let job = {
                let mut queue = self.lock();
                loop {
                    if queue.closed {
                        return;
                    }
                    if let Some(job) = queue.jobs.front() {
                        break Arc::clone(job);
                    }
                    queue = self.wake.wait(queue).unwrap_or_else(PoisonError::into_inner);
                }
            };
            job.work();
            self.retire(&job);
        }
    }
}

impl Pool {
    /// Starts `workers` threads. A thread that cannot be started is logged and left out: the
    /// pool then copies with fewer threads, never fewer than the caller's own.
    pub(crate) fn new(workers: usize) -> Self {
        let shared = Arc::new(Shared::default());
        let mut handles = Vec::with_capacity(workers);
        for i in 0..workers {
            let shared = Arc::clone(&shared);
            let spawned = thread::Builder::new()
                .name(format!("umbp-localcopy-{i}"))
                .spawn(move || shared.serve());
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(error) => {
                    tracing::warn!(%error, started = i, wanted = workers, "copy worker not started");
                    break;
                }
            }
        }
        Self { shared, workers: handles }
    }

    /// Worker threads running (the caller's thread not included).
    pub(crate) fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Runs every task of `tasks` with `kernel`, on this thread and on idle workers, and
    /// returns when all of them are done, after showing them to `done` (what they recorded,
    /// their checksums, is visible to it). Gives the list back, emptied, for reuse when no
    /// worker still holds the job.
    pub(crate) fn run(
        &self,
        tasks: Vec<Task>,
        kernel: Kernel,
        done: impl FnOnce(&[Task]),
    ) -> Vec<Task> {
        let total = tasks.len();
        let chunk = chunk_len(&tasks, self.workers() + 1);
        let job = Arc::new(Job {
            tasks,
            chunk,
            kernel,
            next: AtomicUsize::new(0),
            remaining: AtomicUsize::new(total),
            owner: thread::current(),
        });
        let helpers = self.workers().min(total.div_ceil(chunk).saturating_sub(1));
        if helpers > 0 {
            self.shared.lock().jobs.push_back(Arc::clone(&job));
            if helpers == self.workers() {
                self.shared.wake.notify_all();
            } else {
                (0..helpers).for_each(|_| self.shared.wake.notify_one());
            }
        }
        job.work();
        if helpers > 0 {
            self.shared.retire(&job);
        }
        // Acquire: pairs with the workers' release decrements (see `Job::work`). `park` may
        // return spuriously or for an older unpark; the loop re-checks.
        while job.remaining.load(Ordering::Acquire) != 0 {
            thread::park();
        }
        done(&job.tasks);
        match Arc::try_unwrap(job) {
            Ok(job) => {
                let mut tasks = job.tasks;
                tasks.clear();
                tasks
            }
            // A worker still holds the job (it has seen the cursor run out and will drop it);
            // the list is freed with the job.
            Err(_) => Vec::new(),
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // No submit is running: it would borrow the engine that owns the pool.
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
        for handle in self.workers.drain(..) {
            // A worker only runs copies, which do not panic; if one did, its job's submitter
            // would already have seen it, so there is nothing left to report here.
            let _ = handle.join();
        }
    }
}

/// Tasks per claim: about [`CLAIM_BYTES`] of copying, and at most a quarter of an even share of
/// the tasks per thread, so that late starters still find work.
fn chunk_len(tasks: &[Task], threads: usize) -> usize {
    let bytes: usize = tasks.iter().map(Task::len).sum();
    let average = (bytes / tasks.len().max(1)).max(1);
    let by_bytes = (CLAIM_BYTES / average).max(1);
    let balanced = (tasks.len() / (threads.max(1) * 4)).max(1);
    by_bytes.min(balanced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::HostRegion;
    use umbp_plan::{Endpoint, Segment};

    /// Tasks copying `src` into `dst` in `pieces` of `piece` bytes, in reverse order.
    fn tasks(src: &[u8], dst: &mut [u8], piece: usize) -> Vec<Task> {
        let region = |ptr: usize, len: usize| {
            HostRegion::of(&Endpoint::host(ptr as u64, len as u64)).expect("host region")
        };
        let from = region(src.as_ptr().expose_provenance(), src.len());
        let to = region(dst.as_mut_ptr().expose_provenance(), dst.len());
        (0..src.len() / piece)
            .rev()
            .map(|i| {
                let at = (i * piece) as u64;
                let segment = Segment { src_offset: at, dst_offset: at, len: piece as u64 };
                Task::resolve(&from, &to, &segment).expect("in bounds")
            })
            .collect()
    }

    #[test]
    fn every_task_runs_once_with_and_without_workers() {
        for workers in [0, 1, 3] {
            let pool = Pool::new(workers);
            for piece in [1, 7, 4096] {
                let src: Vec<u8> = (0..piece * 300).map(|i| (i % 253) as u8).collect();
                let mut dst = vec![0u8; src.len()];
                let list = tasks(&src, &mut dst, piece);
                let back = pool.run(list, Kernel::new(true, 64), |_| {});
                assert!(back.is_empty());
                assert!(dst == src, "{workers} workers, pieces of {piece}");
            }
        }
    }

    #[test]
    fn chunks_follow_bytes_and_balance() {
        let src = vec![1u8; 1 << 20];
        let mut dst = vec![0u8; 1 << 20];
        assert_eq!(chunk_len(&tasks(&src, &mut dst, 4096), 2), 32, "256 tasks over 2 threads");
        assert_eq!(chunk_len(&tasks(&src, &mut dst, 1 << 20), 2), 1);
        assert_eq!(chunk_len(&[], 2), 1);
    }
}
