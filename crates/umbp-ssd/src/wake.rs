//! Waking an executor that waits: a ring blocked in `io_uring_enter`, or a fallback worker
//! parked between calls. Released sectors (`sectors`) wake the executors whose ops wait for
//! them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::Thread;

use crate::sys::EventFd;

/// How to wake one executor. Cheap to clone; two clones wake the same executor.
#[derive(Clone, Debug)]
pub(crate) enum Waker {
    /// A ring, through the eventfd it keeps a read armed on.
    Ring(Arc<RingBell>),
    /// A thread that parks while it waits (the fallback executor).
    Thread(Thread),
}

impl Waker {
    /// A waker for the calling thread.
    pub(crate) fn current_thread() -> Self {
        Self::Thread(std::thread::current())
    }

    /// Wakes the executor, or makes its next wait return at once.
    pub(crate) fn wake(&self) {
        match self {
            Self::Ring(bell) => bell.ring(),
            Self::Thread(thread) => thread.unpark(),
        }
    }

    /// Whether `self` and `other` wake the same executor.
    pub(crate) fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Ring(a), Self::Ring(b)) => Arc::ptr_eq(a, b),
            (Self::Thread(a), Self::Thread(b)) => a.id() == b.id(),
            _ => false,
        }
    }
}

/// A ring's doorbell: an eventfd the ring keeps a read armed on, so that ringing it ends the
/// ring's wait for completions. Rings coalesce: while one is unanswered, more cost nothing.
#[derive(Debug)]
pub(crate) struct RingBell {
    fd: EventFd,
    /// Rung and not yet answered by the ring.
    pending: AtomicBool,
}

impl RingBell {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self { fd: EventFd::new()?, pending: AtomicBool::new(false) })
    }

    /// The eventfd the ring reads.
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.fd.fd()
    }

    /// Wakes the ring, unless a ring it has not answered yet will.
    pub(crate) fn ring(&self) {
        if !self.pending.swap(true, Ordering::AcqRel) {
            self.fd.signal();
        }
    }

    /// The ring read the bell: rings from now on wake it again. Called before the ring looks
    /// at what it was woken for, so that nothing rung meanwhile is missed.
    pub(crate) fn answered(&self) {
        self.pending.store(false, Ordering::Release);
    }

    /// Rings whether or not a ring is pending (to end the ring's armed read when it stops).
    pub(crate) fn ring_always(&self) {
        self.fd.signal();
    }
}
