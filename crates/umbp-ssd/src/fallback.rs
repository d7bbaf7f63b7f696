//! The `pread`/`pwrite` executor, where io_uring is unavailable ([`Backend::Blocking`]): a
//! worker runs one batch at a time on its own thread, one request at a time, with the same
//! semantics as the ring (short transfers resubmitted, failures per segment).
//!
//! A blocking call cannot be cancelled, so a deadline or a cancel is seen between calls (and
//! at once while the batch waits for blocks another batch rewrites).
//!
//! [`Backend::Blocking`]: crate::Backend::Blocking

use crate::batch::{Batch, Issue};
use crate::sys;

/// Runs `batch` to the end on the calling thread with `pread`/`pwrite`, one request at a time.
/// While every op left waits for blocks another batch rewrites, the thread parks until they
/// are released or the batch is cancelled (the batch's waker is this thread's), or its
/// deadline passes.
pub(crate) fn run(batch: &mut Batch) {
    loop {
        if let Some(cause) = batch.stop_due() {
            batch.stop(cause);
        }
        let Some((index, issue)) = batch.issue() else {
            if batch.issued_all() {
                break;
            }
            match batch.deadline() {
                Some(deadline) => std::thread::park_timeout(
                    deadline.saturating_duration_since(std::time::Instant::now()),
                ),
                None => std::thread::park(),
            }
            continue;
        };
        let result = match issue {
            // SAFETY: `request` was just issued by `batch`, which this call keeps borrowed, and
            // `perform` returns only once the kernel is done with the bytes (the request
            // invariant in `sys`).
            Issue::Io(request) => unsafe { sys::perform(&request) },
            Issue::Fail(result) => result,
        };
        batch.complete(index, result);
    }
}

/// [`run`] with every request cut to at most `piece` bytes, so that every transfer comes back
/// short and is resubmitted for its remainder.
#[cfg(test)]
pub(crate) fn run_in_pieces(batch: &mut Batch, piece: u32) {
    while let Some((index, issue)) = batch.issue() {
        let result = match issue {
            // SAFETY: as in `run`; the shortened request names a prefix of the issued one's
            // bytes.
            Issue::Io(request) => unsafe { sys::perform(&request.prefix(piece)) },
            Issue::Fail(result) => result,
        };
        batch.complete(index, result);
    }
}
