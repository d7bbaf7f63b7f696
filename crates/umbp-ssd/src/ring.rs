//! The io_uring executor: one ring per worker, up to `depth` requests in flight from up to
//! [`LANES`] batches, requests submitted early in small chunks while the device has little to
//! do, completions reaped in batches.
//!
//! A batch whose last request completed is handed back (its caller woken) only after the
//! requests queued meanwhile, the next batch's first ones among them, went to the kernel: at
//! depth 1 the wake-up used to sit between one read's completion and the next one's issue.
//! Traced at the block layer (256 KiB reads at depth 1 on this project's virtual machine), the
//! time from a completion to the next issue fell from mostly 16–32 µs to mostly 8–16 µs,
//! where fio's is. At 4 KiB, where a submit carries 128 reads and hand-backs are rare, some
//! engine runs sit at fio's 8–16 µs and others at 16–32 µs, for a reason those tracepoints do
//! not show.
//!
//! While fewer than half the depth are submitted, requests go to the kernel in chunks of
//! [`SUBMIT_CHUNK`] as they are pushed, not all at the end of a round: the kernel prepares
//! every request of one `io_uring_enter` (file system, block layer) before the device sees the
//! first of them, so after a round that reaped many completions the first new read waited for
//! the preparation of all the others.
//!
//! While it serves, a ring keeps one read of its doorbell (an eventfd, [`Ring::waker`]) in
//! flight, so another thread can end its wait for completions: the blocks a lane's op waits
//! for were released by another worker (see `sectors`). A lane with nothing in flight that
//! waits for them costs no CPU until then.
//!
//! The ring's submission queue holds at least `depth` entries and its completion queue twice
//! that, and at most `depth` requests are ever queued or in flight, so pushes never find the
//! submission queue full and completions never overflow.

use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring, Probe};

use crate::batch::{Batch, Issue};
use crate::sys::{Dir, Request};
use crate::wake::{RingBell, Waker};

/// Batches one ring runs at once. While the oldest drains its last requests, the next one
/// fills the ring: a worker fed submit after submit keeps the ring about as full as fio keeps
/// its queue, where one batch at a time let the ring run dry at the end of every submit.
pub(crate) const LANES: usize = 4;

/// Requests pushed before they are submitted, without waiting, while a round issues and fewer
/// than half the ring's depth are submitted. The kernel gathers the requests of one
/// `io_uring_enter` in a block plug and starts them on the device only once it has prepared
/// them (up to 32 at a time, traced here). At about 2 µs of kernel time per read on this
/// project's virtual machine, a round of 60 held its first request back by about 100 µs.
/// Eight keeps that wait short and costs one system call per eight requests.
///
/// Only while the device has little to do: submitting every round in chunks made the staged
/// SSD restore (`umbp-bench restore`, 64–320 KiB reads) slower in 10 of 11 runs alternating
/// with the build before, often by a third, in runs where the disk slowed down; there the
/// worker shares its CPU with the second hop's copies, and a device with half the depth or
/// more queued gains nothing from an early start. With the condition, four such pairs showed
/// no loss (the SSD half 1.52, 2.32, 2.44, 1.84 GiB/s against 2.35, 1.99, 2.26, 1.33).
///
/// Measured with 4 KiB random reads at depth 64 (`umbp-bench ssd`, three runs of each build in
/// turns): 116–122 k reads/s and 0.82–0.89 of fio submitting each round at once, 127–143 k and
/// 0.89–0.98 in chunks of eight. In shorter runs in turns with fio, chunks of 4, 8 and 16 were
/// alike, within that disk's noise; one request per call was no faster than eight.
pub(crate) const SUBMIT_CHUNK: usize = 8;

/// How long a ring that could take another batch waits for completions before it looks at the
/// queue again. Where the kernel cannot bound a wait (before Linux 5.11), it looks only when a
/// completion arrives.
const LOOK_FOR_WORK: std::time::Duration = std::time::Duration::from_millis(1);

/// Where a ring's batches come from and go ([`Ring::serve`]): the worker's queue.
pub(crate) trait Feed {
    /// What travels with a batch (the submitted job to settle).
    type Owner;

    /// The next batch. When the ring is `busy` (requests in flight, or batches to hand back)
    /// only one that is ready now, without waiting; otherwise the next one, waiting for it.
    /// `None` when not busy means the feed closed.
    fn next(&mut self, busy: bool) -> Option<(Self::Owner, Batch)>;

    /// A batch none of whose requests is in flight any more, done.
    ///
    /// A batch that panicked is not handed back: once none of its requests is in flight it is
    /// dropped, then its owner (a job fails its objects when dropped unsettled).
    fn done(&mut self, owner: Self::Owner, batch: Batch);
}

/// A batch in the ring, with the ring's count of its requests.
struct Lane<O> {
    /// Declared before `owner`, so dropped first: the owner (a job) settles its objects when
    /// dropped unsettled and wants the plans back.
    batch: Batch,
    owner: O,
    /// This batch's requests pushed and not yet completed.
    in_flight: usize,
    /// The user data of those requests, kept while the batch has a deadline or can be
    /// cancelled (to cancel them in the kernel when it stops).
    flying: Vec<u64>,
    /// Whether `flying` is kept.
    tracked: bool,
    deadline: Option<std::time::Instant>,
    /// Order of arrival: the oldest lane issues first.
    started: u64,
    /// Whether a call into the batch panicked. The ring then tells it nothing more and issues
    /// nothing more for it, cancels the requests it tracks (`flying`: only a batch with a
    /// deadline or a cancel token tracks them; the others' run to their end), and drops it
    /// (with its owner) once
    /// none is in flight; the batches beside it run on.
    panicked: bool,
}

impl<O> Lane<O> {
    /// Whether the lane will issue nothing more.
    fn issued_all(&self) -> bool {
        self.panicked || self.batch.issued_all()
    }

    /// `call` on the batch, unless it panicked before; a panic now marks the lane instead of
    /// unwinding through the ring and the batches beside it.
    fn guarded<R>(&mut self, call: impl FnOnce(&mut Batch) -> R) -> Option<R> {
        if self.panicked {
            return None;
        }
        match catch_unwind(AssertUnwindSafe(|| call(&mut self.batch))) {
            Ok(result) => Some(result),
            Err(_) => {
                tracing::error!("a batch panicked; it fails whole, the batches beside it run on");
                self.panicked = true;
                None
            }
        }
    }
}

/// A worker's ring.
pub(crate) struct Ring {
    ring: IoUring,
    depth: usize,
    /// Entries pushed and not yet completed (queued or in the kernel): requests, and the
    /// cancellations of a batch whose deadline passed.
    in_flight: usize,
    /// Whether `io_uring_enter` takes a timeout (Linux 5.11); without it a deadline is checked
    /// only when completions arrive.
    timed_waits: bool,
    /// The ring's doorbell ([`Ring::waker`]): while `serve` runs, a read of its eventfd is in
    /// flight (not counted in `in_flight`), and its completion ends a wait for completions.
    bell: Arc<RingBell>,
    /// Where the bell's read puts the count. Boxed, so it stays put while the read is in flight.
    bell_count: Box<[u8; 8]>,
    /// Whether the bell's read is in flight.
    bell_armed: bool,
    /// Set once the bell's read failed for good: a lane waiting for another batch's blocks is
    /// then looked at every [`LOOK_FOR_WORK`] instead.
    bell_broken: bool,
    /// The most requests left queued, not yet submitted, at the end of a round of issues.
    #[cfg(test)]
    most_left_queued: usize,
}

/// The user data of a cancellation entry. A request's is its lane in the high 32 bits and its
/// op in the low ones: lanes are few, so never all ones.
const CANCEL: u64 = u64::MAX;

/// The user data of the bell's read (see `Ring::bell`).
const BELL: u64 = u64::MAX - 1;

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("depth", &self.depth).finish_non_exhaustive()
    }
}

impl Ring {
    /// A ring for `depth` requests in flight, to be used only by the calling thread. Fails
    /// where the kernel (or a seccomp filter) refuses io_uring or lacks its read and write
    /// operations.
    ///
    /// The ring asks for a single issuer with deferred task work (Linux 6.1): completions are
    /// then posted only while the worker waits in `io_uring_enter`, in batches, instead of
    /// interrupting it one by one; fio's io_uring engine sets up its rings the same way. Older
    /// kernels refuse those flags with EINVAL, and the ring falls back to cooperative task
    /// work (5.19), then to none.
    pub(crate) fn new(depth: u32) -> io::Result<Self> {
        let depth = depth.max(1);
        let entries = depth.next_power_of_two();
        let deferred = || {
            let mut builder: io_uring::Builder = IoUring::builder();
            builder.setup_single_issuer().setup_defer_taskrun().setup_coop_taskrun();
            builder.build(entries)
        };
        let cooperative = || {
            let mut builder: io_uring::Builder = IoUring::builder();
            builder.setup_coop_taskrun();
            builder.build(entries)
        };
        let ring = deferred().or_else(|_| cooperative()).or_else(|_| IoUring::new(entries))?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        if !probe.is_supported(opcode::Read::CODE) || !probe.is_supported(opcode::Write::CODE) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the kernel's io_uring lacks IORING_OP_READ or IORING_OP_WRITE",
            ));
        }
        let timed_waits = ring.params().is_feature_ext_arg();
        Ok(Self {
            ring,
            depth: depth as usize,
            in_flight: 0,
            timed_waits,
            bell: Arc::new(RingBell::new()?),
            bell_count: Box::new([0; 8]),
            bell_armed: false,
            bell_broken: false,
            #[cfg(test)]
            most_left_queued: 0,
        })
    }

    /// Wakes this ring while it serves: its wait for completions ends, and it looks at its
    /// batches again.
    pub(crate) fn waker(&self) -> Waker {
        Waker::Ring(Arc::clone(&self.bell))
    }

    /// Runs `batch` to the end and hands it back. Returns only when no request of the batch is
    /// in flight, also when unwinding.
    #[cfg(test)]
    pub(crate) fn run(&mut self, batch: Batch) -> Batch {
        /// Yields one batch, then takes it back.
        struct Once(Option<Batch>, Option<Batch>);
        impl Feed for Once {
            type Owner = ();
            fn next(&mut self, _busy: bool) -> Option<((), Batch)> {
                self.0.take().map(|batch| ((), batch))
            }
            fn done(&mut self, (): (), batch: Batch) {
                self.1 = Some(batch);
            }
        }
        let mut feed = Once(Some(batch), None);
        self.serve(&mut feed);
        feed.1.expect("the ring runs the batch it was fed to the end")
    }

    /// Runs batches from `feed` until it closes, up to [`LANES`] at once: the oldest first, and
    /// the next one as soon as every batch in the ring has issued everything, so that the ring
    /// fills again while they drain. Each batch goes back through [`Feed::done`] when its last
    /// request completes. A batch that panics (a bug, or an injected fault) fails alone,
    /// whether in a call of the ring (see `Lane::panicked`), while the feed makes it or while
    /// it is handed back.
    ///
    /// Returns only when no request is in flight, also when unwinding: the requests' bytes
    /// belong to the batches in the lanes, dropped only after the ring drained.
    pub(crate) fn serve<F: Feed>(&mut self, feed: &mut F) {
        let mut lanes: Vec<Option<Lane<F::Owner>>> = (0..LANES).map(|_| None).collect();
        // Batches whose last request completed, handed back once the requests queued after
        // them are on their way to the device (see below). None of their requests is in
        // flight, so they may drop in any order.
        let mut finished: Vec<Lane<F::Owner>> = Vec::with_capacity(LANES);
        // Declared after `lanes`, so dropped (and drained) before them when unwinding.
        let ring = Drain(self);
        let ring = &mut *ring.0;
        let mut started = 0u64;
        loop {
            // (Again) after the bell's read completed.
            ring.arm_bell();
            for lane in lanes.iter_mut().flatten() {
                let due = lane.guarded(|b| b.stop_due()).flatten();
                let stopped = due.is_some();
                if let Some(cause) = due {
                    lane.guarded(|b| b.stop(cause));
                }
                if stopped || lane.panicked {
                    ring.cancel(&mut lane.flying);
                    // From here on the lane only waits for its cancelled requests.
                    lane.deadline = None;
                    lane.tracked = false;
                }
            }
            ring.issue(&mut lanes);
            for slot in lanes.iter_mut() {
                if slot.as_ref().is_some_and(|l| l.in_flight == 0 && l.issued_all()) {
                    finished.extend(slot.take());
                }
            }
            let free = lanes.iter().position(Option::is_none);
            let draining = lanes.iter().flatten().all(Lane::issued_all);
            let admitting = free.is_some() && draining && ring.in_flight < ring.depth;
            if let (Some(free), true) = (free, admitting) {
                // Never wait for work while batches wait to be handed back: their callers may
                // be what submits the next one. A panic while making the next batch costs that
                // one alone (its owner fails as it unwinds), not the batches in the ring.
                let busy = ring.in_flight > 0 || !finished.is_empty();
                let Ok(next) = catch_unwind(AssertUnwindSafe(|| feed.next(busy))) else {
                    tracing::error!("making the next batch panicked; the ring runs on");
                    continue;
                };
                match next {
                    Some((owner, batch)) => {
                        started += 1;
                        let deadline = batch.deadline();
                        let tracked = deadline.is_some() || batch.cancellable();
                        lanes[free] = Some(Lane {
                            batch,
                            owner,
                            in_flight: 0,
                            flying: Vec::new(),
                            tracked,
                            deadline,
                            started,
                            panicked: false,
                        });
                        continue;
                    }
                    None if ring.in_flight == 0 && finished.is_empty() => return,
                    None => {}
                }
            }
            if !finished.is_empty() {
                // Handing a batch back wakes its caller, a system call that on a virtual
                // machine takes microseconds: the requests queued meanwhile (the next batch's
                // first ones) go to the kernel before it, so at depth 1 the device does not
                // wait for it.
                ring.submit();
                for lane in finished.drain(..) {
                    if lane.panicked {
                        continue;
                    }
                    let (owner, batch) = (lane.owner, lane.batch);
                    // A panic handing one back (settling its job) costs that batch alone.
                    if catch_unwind(AssertUnwindSafe(|| feed.done(owner, batch))).is_err() {
                        tracing::error!("handing a finished batch back panicked; the ring runs on");
                    }
                }
                continue;
            }
            // With no lane, the feed waits for work; a lane with nothing in flight waits for
            // the blocks of another batch (see `sectors`), and the bell wakes the ring when
            // they are released.
            if ring.in_flight == 0 && lanes.iter().all(Option::is_none) {
                continue;
            }
            let mut deadline = lanes.iter().flatten().filter_map(|l| l.deadline).min();
            if admitting || ring.bell_broken {
                // A batch queued while this thread waits for completions would wait for the
                // next one (forever behind a request that never completes): look again soon.
                let again = std::time::Instant::now() + LOOK_FOR_WORK;
                deadline = Some(deadline.map_or(again, |d| d.min(again)));
            }
            if ring.in_flight == 0 && !ring.bell_armed {
                // Nothing the kernel could wake us for.
                if let Some(deadline) = deadline {
                    std::thread::sleep(
                        deadline.saturating_duration_since(std::time::Instant::now()),
                    );
                }
                continue;
            }
            ring.enter(deadline);
            for cqe in ring.ring.completion() {
                let data = cqe.user_data();
                if data == BELL {
                    ring.bell_armed = false;
                    ring.bell.answered();
                    let result = cqe.result();
                    if result < 0
                        && !matches!(-result, libc::EINTR | libc::EAGAIN | libc::ECANCELED)
                    {
                        tracing::error!(
                            errno = -result,
                            "a ring's doorbell failed; it polls instead"
                        );
                        ring.bell_broken = true;
                    }
                    continue;
                }
                ring.in_flight -= 1;
                if data == CANCEL {
                    continue;
                }
                let (lane, op) = ((data >> 32) as usize, (data & u64::from(u32::MAX)) as usize);
                let Some(Some(lane)) = lanes.get_mut(lane) else { continue };
                lane.in_flight -= 1;
                if let Some(at) = lane.flying.iter().position(|&f| f == data) {
                    lane.flying.swap_remove(at);
                }
                lane.guarded(|b| b.complete(op, cqe.result()));
            }
        }
    }

    /// Puts the bell's read in flight, unless it is or the bell is broken.
    fn arm_bell(&mut self) {
        if self.bell_armed || self.bell_broken {
            return;
        }
        let fd = types::Fd(self.bell.fd());
        let entry = opcode::Read::new(fd, self.bell_count.as_mut_ptr(), 8).build().user_data(BELL);
        for _ in 0..2 {
            // SAFETY: the read fills the 8 bytes of `bell_count`, a boxed array that stays put
            // and alive until the read completes: `serve` (whose `Drain` rings the bell and
            // waits for the read) returns, also when unwinding, only once it has, and the ring
            // is dropped only after that; nothing else touches the bytes meanwhile.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                // Submitted at once: the submission queue has room for `depth` requests, and
                // the ring counts the entries queued there as requests.
                let _ = self.ring.submit();
                self.bell_armed = true;
                return;
            }
            // The queue is full of requests not yet submitted: submit them and try once more.
            let _ = self.ring.submit();
        }
    }

    /// Pushes requests while the ring has room, from the oldest lane first.
    fn issue<O>(&mut self, lanes: &mut [Option<Lane<O>>]) {
        // Oldest first; free lanes sort last. A fixed array: this runs once per completion
        // round and allocates nothing.
        let mut order = [(u64::MAX, 0usize); LANES];
        for (i, lane) in lanes.iter().enumerate().take(LANES) {
            order[i] = (lane.as_ref().map_or(u64::MAX, |l| l.started), i);
        }
        order.sort_unstable();
        for (_, i) in order {
            let Some(lane) = lanes[i].as_mut() else { continue };
            while self.in_flight < self.depth {
                let Some(Some((index, issue))) = lane.guarded(Batch::issue) else { break };
                match issue {
                    Issue::Fail(result) => {
                        lane.guarded(|b| b.complete(index, result));
                    }
                    Issue::Io(request) => {
                        let data = (i as u64) << 32 | index as u64;
                        let entry = entry(&request).user_data(data);
                        // SAFETY:
                        // 1. the request's bytes stay valid until it completes: they belong to
                        //    the lane's batch (see the request invariant in `sys`), which
                        //    `serve` keeps until every request it pushed has completed, also
                        //    when unwinding;
                        // 2. the descriptor is only a number to the kernel, which cannot touch
                        //    our memory through it; it names the plan's file until the request
                        //    completes, since the batch's job pins its file endpoints until it
                        //    settles, after this ring is done with the batch (see `FileEntry`).
                        let pushed = unsafe { self.ring.submission().push(&entry) };
                        pushed.expect(
                            "at most `depth` requests are queued, and the queue holds them",
                        );
                        self.in_flight += 1;
                        lane.in_flight += 1;
                        if lane.tracked {
                            lane.flying.push(data);
                        }
                        // Entries pushed and not yet submitted; the rest are in the kernel.
                        let queued = self.ring.submission().len();
                        if queued >= SUBMIT_CHUNK && self.in_flight - queued < self.depth / 2 {
                            self.submit();
                        }
                    }
                }
            }
        }
        #[cfg(test)]
        {
            self.most_left_queued = self.most_left_queued.max(self.ring.submission().len());
        }
    }

    /// The most requests a round of issues left queued for the next `io_uring_enter`.
    #[cfg(test)]
    pub(crate) fn most_left_queued(&self) -> usize {
        self.most_left_queued
    }

    /// Asks the kernel to cancel the requests named in `flying` (a read blocked on a pipe, a
    /// device that stopped answering); each then completes, usually with `ECANCELED` or `EINTR`.
    fn cancel(&mut self, flying: &mut Vec<u64>) {
        for data in std::mem::take(flying) {
            let entry = opcode::AsyncCancel::new(data).build().user_data(CANCEL);
            // SAFETY: a cancellation carries no buffer; it names a request by its user data.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_err() {
                // The queue is full of requests not yet submitted: submit them (they are then
                // in flight and cancellable) and try once more.
                let _ = self.ring.submit();
                // SAFETY: as above.
                if unsafe { self.ring.submission().push(&entry) }.is_err() {
                    continue;
                }
            }
            self.in_flight += 1;
        }
    }

    /// Submits everything queued, without waiting. A failure leaves the requests queued, and
    /// the next [`enter`](Self::enter) submits them.
    fn submit(&mut self) {
        if self.ring.submission().is_empty() {
            return;
        }
        let _ = self.ring.submit();
    }

    /// Submits everything queued and waits for at least one completion, or until `deadline`.
    fn enter(&mut self, deadline: Option<std::time::Instant>) {
        let result = match deadline {
            Some(deadline) if self.timed_waits => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                let timespec = types::Timespec::from(left);
                let args = types::SubmitArgs::new().timespec(&timespec);
                self.ring.submitter().submit_with_args(1, &args)
            }
            _ => self.ring.submit_and_wait(1),
        };
        match result {
            Ok(_) => {}
            // The deadline passed without a completion; the caller's loop sees it.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME)) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR)) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY)) => {
                std::thread::yield_now();
            }
            Err(e) => {
                // Requests are in flight into memory the caller will reuse once we return:
                // without a working ring we can neither wait for them nor return.
                tracing::error!(error = %e, "io_uring_enter failed with requests in flight; aborting");
                std::process::abort();
            }
        }
    }
}

/// Waits for every in-flight request of a ring when dropped, so that an unwinding executor
/// never frees memory the kernel still writes.
struct Drain<'r>(&'r mut Ring);

impl Drop for Drain<'_> {
    fn drop(&mut self) {
        if self.0.bell_armed {
            // Ends the bell's read.
            self.0.bell.ring_always();
        }
        while self.0.in_flight > 0 || self.0.bell_armed {
            self.0.enter(None);
            for cqe in self.0.ring.completion() {
                if cqe.user_data() == BELL {
                    self.0.bell_armed = false;
                } else {
                    self.0.in_flight -= 1;
                }
            }
        }
    }
}

/// The submission entry of a request.
fn entry(request: &Request) -> squeue::Entry {
    let fd = types::Fd(request.fd());
    match request.dir() {
        Dir::Read => {
            opcode::Read::new(fd, request.buf(), request.len()).offset(request.offset()).build()
        }
        Dir::Write => opcode::Write::new(fd, request.buf().cast_const(), request.len())
            .offset(request.offset())
            .build(),
    }
}
