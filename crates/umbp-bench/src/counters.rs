//! Instructions retired, from the CPU's performance counters (`perf_event_open`, through the
//! `perf-event2` crate), counted in user space only.
//!
//! A time per fragment moves with everything else a shared machine runs; the instructions a
//! build retires do not, so `umbp-bench plan` reports both. Where the counters cannot be read
//! (a virtual machine without a virtual PMU, `perf_event_paranoid` above 2, a container that
//! filters the system call) [`Instructions::new`] says why, and the same figure comes from
//! callgrind instead: see [`CALLGRIND`].

use perf_event::events::Hardware;
use perf_event::{Builder, Counter};

/// How to count the incremental builder's instructions where the counters are unavailable:
/// the repository's callgrind script, which runs the bench twice per page size and prints the
/// warm build's instructions per fragment (see its header for the arithmetic).
pub const CALLGRIND: &str = "bash scripts/plan-instructions";

/// A counter of user-space instructions retired by this thread.
pub struct Instructions {
    counter: Result<Counter, String>,
}

impl Instructions {
    /// A counter, or the reason there is none.
    pub fn new() -> Self {
        let counter = Builder::new(Hardware::INSTRUCTIONS)
            .exclude_kernel(true)
            .exclude_hv(true)
            .build()
            .map_err(|e| format!("perf_event_open: {e}"));
        Self { counter }
    }

    /// Why instructions cannot be counted here, if they cannot.
    pub fn unavailable(&self) -> Option<&str> {
        self.counter.as_ref().err().map(String::as_str)
    }

    /// Counts the instructions `f` retires; `None` where counters are unavailable or the
    /// kernel multiplexed the counter (its count would be an estimate).
    pub fn count<T>(&mut self, f: impl FnOnce() -> T) -> (T, Option<u64>) {
        let Ok(counter) = self.counter.as_mut() else { return (f(), None) };
        if counter.reset().and_then(|()| counter.enable()).is_err() {
            return (f(), None);
        }
        let out = f();
        let _ = counter.disable();
        let read = counter.read_count_and_time().ok();
        let exact = read.filter(|r| r.time_enabled == r.time_running).map(|r| r.count);
        (out, exact)
    }
}

impl Default for Instructions {
    fn default() -> Self {
        Self::new()
    }
}
