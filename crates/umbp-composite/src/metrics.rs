//! Counters per engine and direction, readable as a snapshot.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, PoisonError};

use umbp_plan::{Endpoint, EndpointKind};

/// The kinds of a transfer's two sides, for example `host->device`.
pub fn direction(src: &Endpoint, dst: &Endpoint) -> String {
    format!("{}->{}", kind(src), kind(dst))
}

fn kind(e: &Endpoint) -> &'static str {
    match e.kind() {
        EndpointKind::Host => "host",
        EndpointKind::Device(_) => "device",
        EndpointKind::File(_) => "file",
        EndpointKind::Remote(_) => "remote",
        _ => "other",
    }
}

/// What one engine did in one direction.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    /// Segments executed.
    pub operations: u64,
    /// Bytes executed.
    pub bytes: u64,
    /// Seconds spent executing (an engine's wall time, shared among its directions by bytes).
    pub seconds: f64,
    /// Failed plans or segments reported by the engine, and plans it panicked with.
    pub failures: u64,
    /// Fragments refused while planning.
    pub rejected_fragments: u64,
}

/// Counters keyed by (engine name, direction).
pub type MetricsSnapshot = BTreeMap<(String, String), Counters>;

/// The composite's metrics: updated by builds and submits, read with [`snapshot`](Self::snapshot).
#[derive(Debug, Default)]
pub struct Metrics {
    counters: Mutex<MetricsSnapshot>,
}

impl Metrics {
    /// Adds to the counters of `engine` in `direction`.
    pub(crate) fn record(
        &self,
        engine: &str,
        direction: String,
        update: impl FnOnce(&mut Counters),
    ) {
        let mut counters = self.counters.lock().unwrap_or_else(PoisonError::into_inner);
        update(counters.entry((engine.to_string(), direction)).or_default());
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        self.counters.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// Batches submitted and not yet settled, and the bytes they move.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlightSnapshot {
    /// Batches not yet settled.
    pub batches: u64,
    /// Bytes those batches move.
    pub bytes: u64,
}

/// The composite's in-flight counters; dropping the composite waits for them to reach zero.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    now: Mutex<InFlightSnapshot>,
    idle: Condvar,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, InFlightSnapshot> {
        // Two integers updated together: a poisoned lock still guards consistent values.
        self.now.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A batch of `bytes` started.
    pub(crate) fn begin(&self, bytes: u64) {
        let mut now = self.lock();
        now.batches += 1;
        now.bytes += bytes;
    }

    /// A batch of `bytes` settled.
    pub(crate) fn end(&self, bytes: u64) {
        let mut now = self.lock();
        now.batches = now.batches.saturating_sub(1);
        now.bytes = now.bytes.saturating_sub(bytes);
        if now.batches == 0 {
            self.idle.notify_all();
        }
    }

    pub(crate) fn snapshot(&self) -> InFlightSnapshot {
        *self.lock()
    }

    /// Blocks until no batch is in flight.
    pub(crate) fn wait_idle(&self) {
        let mut now = self.lock();
        while now.batches > 0 {
            now = self.idle.wait(now).unwrap_or_else(PoisonError::into_inner);
        }
    }
}
