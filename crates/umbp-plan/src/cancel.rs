//! Cancelling a submitted plan set: a token the submitter keeps and every engine running part
//! of the batch watches.
//!
//! The submitter [attaches](crate::PlanSet::set_cancel) one [`CancelToken`] to the plan sets of
//! a batch and keeps a clone. [`cancel`](CancelToken::cancel) marks it; an engine that cancels
//! (the SSD engine cancels its I/O in the kernel) checks [`is_cancelled`](CancelToken::is_cancelled)
//! before issuing and registers a wake-up with [`on_cancel`](CancelToken::on_cancel) so that a
//! thread blocked on the batch's work hears of it at once. What a cancelled transfer had not
//! finished fails its objects with [`FailureCause::Cancelled`](crate::FailureCause::Cancelled).

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError};

/// A wake-up registered with [`CancelToken::on_cancel`].
type Waker = Box<dyn FnOnce() + Send>;

/// Marks a batch cancelled for every engine that runs a part of it; clones share the mark.
///
/// ```
/// use umbp_plan::CancelToken;
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
///
/// let token = CancelToken::new();
/// let woken = Arc::new(AtomicBool::new(false));
/// let flag = Arc::clone(&woken);
/// token.on_cancel(Box::new(move || flag.store(true, Ordering::SeqCst)));
/// token.clone().cancel();
/// assert!(token.is_cancelled() && woken.load(Ordering::SeqCst));
/// ```
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<Mutex<State>>,
}

#[derive(Default)]
struct State {
    cancelled: bool,
    wakers: Vec<Waker>,
}

impl CancelToken {
    /// A token not yet cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks the token cancelled and runs every registered wake-up once, on this thread. Later
    /// calls do nothing. A wake-up that panics is contained: the others still run.
    pub fn cancel(&self) {
        let wakers = {
            let mut state = self.lock();
            if state.cancelled {
                return;
            }
            state.cancelled = true;
            std::mem::take(&mut state.wakers)
        };
        for wake in wakers {
            if catch_unwind(AssertUnwindSafe(wake)).is_err() {
                tracing::error!("a cancel wake-up panicked");
            }
        }
    }

    /// Whether [`cancel`](Self::cancel) was called on this token or a clone.
    pub fn is_cancelled(&self) -> bool {
        self.lock().cancelled
    }

    /// Runs `wake` once the token is cancelled: at once, on this thread, if it already is;
    /// otherwise on the thread that cancels it. Keep it short and non-blocking (wake a thread,
    /// set a flag): the canceller waits for it.
    pub fn on_cancel(&self, wake: Box<dyn FnOnce() + Send>) {
        let mut state = self.lock();
        if state.cancelled {
            drop(state);
            wake();
        } else {
            state.wakers.push(wake);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a flag and a list taken whole: a poisoned lock still guards it.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken").field("cancelled", &self.is_cancelled()).finish()
    }
}

/// Two tokens are equal when they are clones of one another (they share the mark).
impl PartialEq for CancelToken {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for CancelToken {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_wake_up_runs_exactly_once_whenever_it_was_registered() {
        let token = CancelToken::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let count = |runs: &Arc<AtomicUsize>| {
            let runs = Arc::clone(runs);
            Box::new(move || {
                runs.fetch_add(1, Ordering::SeqCst);
            })
        };
        token.on_cancel(count(&runs));
        token.on_cancel(Box::new(|| panic!("a misbehaving wake-up")));
        token.on_cancel(count(&runs));
        assert!(!token.is_cancelled());
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        let clone = token.clone();
        std::thread::spawn(move || clone.cancel()).join().unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 2, "the panic did not stop the others");
        token.cancel();
        assert_eq!(runs.load(Ordering::SeqCst), 2, "a second cancel runs nothing again");
        token.on_cancel(count(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 3, "registered late, run at once");
        assert!(token.is_cancelled());
        assert_eq!(token, token.clone());
        assert_ne!(token, CancelToken::new());
    }

    #[test]
    fn many_threads_cancelling_and_registering_run_each_wake_up_once() {
        for _ in 0..50 {
            let token = CancelToken::new();
            let runs = Arc::new(AtomicUsize::new(0));
            std::thread::scope(|scope| {
                for i in 0..16 {
                    let (token, runs) = (token.clone(), Arc::clone(&runs));
                    scope.spawn(move || {
                        if i % 4 == 0 {
                            token.cancel();
                        } else {
                            token.on_cancel(Box::new(move || {
                                runs.fetch_add(1, Ordering::SeqCst);
                            }));
                        }
                    });
                }
            });
            assert_eq!(runs.load(Ordering::SeqCst), 12);
        }
    }
}
