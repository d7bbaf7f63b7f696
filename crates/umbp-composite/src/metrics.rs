//! Counters per engine and direction, readable as a snapshot.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

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
    /// Failed plans or segments reported by the engine.
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
