//! The io_uring executor: one ring per worker, up to `depth` requests in flight, every request
//! queued since the last call submitted by one `io_uring_enter`, completions reaped in batches.
//!
//! The ring's submission queue holds at least `depth` entries and its completion queue twice
//! that, and at most `depth` requests are ever queued or in flight, so pushes never find the
//! submission queue full and completions never overflow.

use std::io;

use io_uring::{opcode, squeue, types, IoUring, Probe};

use crate::batch::{Batch, Issue};
use crate::sys::{Dir, Request};

/// A worker's ring.
pub(crate) struct Ring {
    ring: IoUring,
    depth: usize,
    /// Entries pushed and not yet completed (queued or in the kernel): requests, and the
    /// cancellations of a batch whose deadline passed.
    in_flight: usize,
    /// The user data of the requests in flight, kept while the batch has a deadline (to cancel
    /// them when it passes).
    flying: Vec<u64>,
    /// Whether `io_uring_enter` takes a timeout (Linux 5.11); without it a deadline is checked
    /// only when completions arrive.
    timed_waits: bool,
}

/// The user data of a cancellation entry (ops are numbered from 0 and never reach it).
const CANCEL: u64 = u64::MAX;

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
        Ok(Self { ring, depth: depth as usize, in_flight: 0, flying: Vec::new(), timed_waits })
    }

    /// Runs `batch` to the end. Returns only when no request of the batch is in flight, also
    /// when unwinding: the bytes of in-flight requests belong to `batch`, which this call keeps
    /// borrowed.
    pub(crate) fn run(&mut self, batch: &mut Batch<'_>) {
        let ring = Drain(self);
        ring.0.pump(batch);
    }

    fn pump(&mut self, batch: &mut Batch<'_>) {
        let mut deadline = batch.deadline();
        self.flying.clear();
        loop {
            if batch.expired() {
                batch.time_out();
                self.cancel_flying();
                // From here on the ring only waits for the cancelled requests to complete.
                deadline = None;
            }
            while self.in_flight < self.depth {
                let Some((index, issue)) = batch.issue() else { break };
                match issue {
                    Issue::Fail(result) => batch.complete(index, result),
                    Issue::Io(request) => {
                        let entry = entry(&request).user_data(index as u64);
                        // SAFETY:
                        // 1. the request's bytes stay valid until it completes: they belong to
                        //    `batch` (see the request invariant in `sys`), which `run` keeps
                        //    borrowed until every pushed request has completed;
                        // 2. the descriptor is only a number to the kernel: a closed one fails
                        //    the request with EBADF, it cannot touch our memory.
                        let pushed = unsafe { self.ring.submission().push(&entry) };
                        pushed.expect(
                            "at most `depth` requests are queued, and the queue holds them",
                        );
                        self.in_flight += 1;
                        if deadline.is_some() {
                            self.flying.push(index as u64);
                        }
                    }
                }
            }
            if self.in_flight == 0 {
                return;
            }
            self.enter(deadline);
            for cqe in self.ring.completion() {
                self.in_flight -= 1;
                let data = cqe.user_data();
                if data == CANCEL {
                    continue;
                }
                if let Some(at) = self.flying.iter().position(|&f| f == data) {
                    self.flying.swap_remove(at);
                }
                batch.complete(data as usize, cqe.result());
            }
        }
    }

    /// Asks the kernel to cancel every request in flight (a read blocked on a pipe, a device
    /// that stopped answering); each then completes, usually with `ECANCELED` or `EINTR`.
    fn cancel_flying(&mut self) {
        for data in std::mem::take(&mut self.flying) {
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
        while self.0.in_flight > 0 {
            self.0.enter(None);
            let reaped = self.0.ring.completion().count();
            self.0.in_flight -= reaped;
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
