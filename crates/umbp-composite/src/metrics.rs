//! The composite's metrics: counters, latency histograms and in-flight gauges in one
//! Prometheus registry per composite, rendered in the Prometheus text format by
//! [`Metrics::render`] (and read back as a snapshot by [`Metrics::snapshot`]).
//!
//! Every metric is updated once per settled part (one engine's plans of one layer group, or
//! one hop of a stage), once per planned batch or once per settled batch: never per
//! fragment. `docs/OBSERVABILITY.md` at the repository root lists every metric.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use umbp_plan::{Endpoint, EndpointKind, FailureCause, ObjectState, PlanSet};

/// The kinds of a transfer's two sides, for example `host->device`.
pub fn direction(src: &Endpoint, dst: &Endpoint) -> &'static str {
    const NAMES: [[&str; 5]; 5] = [
        ["host->host", "host->device", "host->file", "host->remote", "host->other"],
        ["device->host", "device->device", "device->file", "device->remote", "device->other"],
        ["file->host", "file->device", "file->file", "file->remote", "file->other"],
        ["remote->host", "remote->device", "remote->file", "remote->remote", "remote->other"],
        ["other->host", "other->device", "other->file", "other->remote", "other->other"],
    ];
    NAMES[kind(src)][kind(dst)]
}

/// The kind of an endpoint: `host`, `device`, `file`, `remote` or `other`.
pub(crate) fn endpoint_kind_name(e: &Endpoint) -> &'static str {
    ["host", "device", "file", "remote", "other"][kind(e)]
}

fn kind(e: &Endpoint) -> usize {
    match e.kind() {
        EndpointKind::Host => 0,
        EndpointKind::Device(_) => 1,
        EndpointKind::File(_) => 2,
        EndpointKind::Remote(_) => 3,
        _ => 4,
    }
}

/// What one engine did in one direction: the Prometheus counters of that engine and direction,
/// read back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Segments executed (`umbp_transfer_segments_total`).
    pub segments: u64,
    /// Bytes executed (`umbp_transfer_bytes_total`).
    pub bytes: u64,
    /// Objects whose bytes rode in the engine's plans (`umbp_transfer_objects_total`).
    pub objects: u64,
    /// Failed plans or segments reported by the engine, and plans it panicked with, all
    /// causes (`umbp_transfer_failures_total`).
    pub failures: u64,
    /// Objects rejected while planning, all reasons (`umbp_rejected_objects_total`).
    pub rejected_objects: u64,
}

/// Counters keyed by (engine name, direction).
pub type MetricsSnapshot = BTreeMap<(String, String), Counters>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
struct EngineLabels {
    engine: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    engine: String,
    direction: &'static str,
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RejectLabels {
    engine: String,
    direction: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChecksumLabels {
    outcome: &'static str,
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartLabels {
    engine: String,
}

/// Latency buckets from 10 µs to about 42 s, by factors of 2.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.0, 23))
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// The composite's metrics: one Prometheus registry (every metric prefixed `umbp_`), updated
/// by builders, executor threads and settling batches, read with [`render`](Self::render)
/// (the Prometheus text format) or [`snapshot`](Self::snapshot).
pub struct Metrics {
    registry: Registry,
    bytes: Family<EngineLabels, Counter>,
    segments: Family<EngineLabels, Counter>,
    objects: Family<EngineLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
    rejected: Family<RejectLabels, Counter>,
    part_seconds: Histograms<PartLabels>,
    batch_seconds: Histogram,
    object_seconds: Histogram,
    plan_seconds: Histogram,
    batches: Family<OutcomeLabels, Counter>,
    object_outcomes: Family<OutcomeLabels, Counter>,
    object_failures: Family<CauseLabels, Counter>,
    checksums: Family<ChecksumLabels, Counter>,
    checksum_mismatches: Family<TierLabels, Counter>,
    checksum_bytes: Counter,
    /// Every (engine, direction) that has a counter, for [`snapshot`](Self::snapshot).
    seen: Mutex<BTreeSet<EngineLabels>>,
    pub(crate) in_flight: InFlight,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("umbp");
        let bytes = Family::<EngineLabels, Counter>::default();
        let segments = Family::<EngineLabels, Counter>::default();
        let objects = Family::<EngineLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        let rejected = Family::<RejectLabels, Counter>::default();
        let part_seconds: Histograms<PartLabels> = Family::new_with_constructor(seconds_histogram);
        let (batch_seconds, object_seconds, plan_seconds) =
            (seconds_histogram(), seconds_histogram(), seconds_histogram());
        let batches = Family::<OutcomeLabels, Counter>::default();
        let object_outcomes = Family::<OutcomeLabels, Counter>::default();
        let object_failures = Family::<CauseLabels, Counter>::default();
        let checksums = Family::<ChecksumLabels, Counter>::default();
        let checksum_mismatches = Family::<TierLabels, Counter>::default();
        let checksum_bytes = Counter::default();
        let (in_flight_batches, in_flight_bytes) = (Gauge::default(), Gauge::default());
        registry.register_with_unit(
            "transfer",
            "Bytes an engine moved, per engine and direction",
            Unit::Bytes,
            bytes.clone(),
        );
        registry.register(
            "transfer_segments",
            "Segments (merged fragments) an engine executed, per engine and direction",
            segments.clone(),
        );
        registry.register(
            "transfer_objects",
            "Objects whose bytes rode in an engine's plans, per engine and direction",
            objects.clone(),
        );
        registry.register(
            "transfer_failures",
            "Failed plans or segments an engine reported (or panicked with), per engine, \
             direction and cause",
            failures.clone(),
        );
        registry.register(
            "rejected_objects",
            "Objects rejected while planning, per engine (unrouted: no engine), direction and \
             reason",
            rejected.clone(),
        );
        registry.register_with_unit(
            "part_duration",
            "Submit to settle of one engine's share of one layer group (or one hop of a stage)",
            Unit::Seconds,
            part_seconds.clone(),
        );
        registry.register_with_unit(
            "batch_duration",
            "Submit to settle of a batch (every object settled, every listener told)",
            Unit::Seconds,
            batch_seconds.clone(),
        );
        registry.register_with_unit(
            "object_duration",
            "Submit to settle of one object that had bytes to move",
            Unit::Seconds,
            object_seconds.clone(),
        );
        registry.register_with_unit(
            "plan_duration",
            "Planning one batch: first begin_object to the end of finish",
            Unit::Seconds,
            plan_seconds.clone(),
        );
        registry.register(
            "batches",
            "Batches settled, per outcome (completed, failed)",
            batches.clone(),
        );
        registry.register(
            "objects",
            "Objects settled, per outcome (completed, failed, rejected, cancelled)",
            object_outcomes.clone(),
        );
        registry.register(
            "object_failures",
            "Objects that failed, per cause of their first failure",
            object_failures.clone(),
        );
        registry.register(
            "checksum_objects",
            "Checksummed objects of settled parts, per outcome (verified, mismatch, \
             unverifiable, recorded, unknown) and kind of tier",
            checksums.clone(),
        );
        registry.register(
            "checksum_mismatches",
            "Restored objects whose bytes did not match their checksum, per kind of tier",
            checksum_mismatches.clone(),
        );
        registry.register_with_unit(
            "checksum",
            "Bytes hashed for checksums",
            Unit::Bytes,
            checksum_bytes.clone(),
        );
        registry.register(
            "in_flight_batches",
            "Batches submitted and not yet settled",
            in_flight_batches.clone(),
        );
        registry.register_with_unit(
            "in_flight",
            "Bytes the batches in flight move",
            Unit::Bytes,
            in_flight_bytes.clone(),
        );
        Self {
            registry,
            bytes,
            segments,
            objects,
            failures,
            rejected,
            part_seconds,
            batch_seconds,
            object_seconds,
            plan_seconds,
            batches,
            object_outcomes,
            object_failures,
            checksums,
            checksum_mismatches,
            checksum_bytes,
            seen: Mutex::new(BTreeSet::new()),
            in_flight: InFlight {
                now: Mutex::default(),
                idle: Condvar::new(),
                batches: in_flight_batches,
                bytes: in_flight_bytes,
            },
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("in_flight", &self.in_flight.snapshot()).finish()
    }
}

impl Metrics {
    /// Every metric in the Prometheus text exposition format (the OpenMetrics flavour,
    /// ending in `# EOF`), as a scraper reads it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The per-engine counters, read back from the registry, keyed by (engine, direction).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
        let get = |family: &Family<EngineLabels, Counter>, l: &EngineLabels| {
            family.get(l).map_or(0, |c| c.get())
        };
        seen.into_iter()
            .map(|l| {
                let failures = self.failures_of(&l);
                let rejected = self.rejected_of(&l);
                let counters = Counters {
                    segments: get(&self.segments, &l),
                    bytes: get(&self.bytes, &l),
                    objects: get(&self.objects, &l),
                    failures,
                    rejected_objects: rejected,
                };
                ((l.engine, l.direction.to_string()), counters)
            })
            .collect()
    }

    fn failures_of(&self, l: &EngineLabels) -> u64 {
        CAUSES
            .iter()
            .filter_map(|&cause| {
                let labels =
                    FailureLabels { engine: l.engine.clone(), direction: l.direction, cause };
                self.failures.get(&labels).map(|c| c.get())
            })
            .sum()
    }

    fn rejected_of(&self, l: &EngineLabels) -> u64 {
        REASONS
            .iter()
            .filter_map(|&reason| {
                let labels =
                    RejectLabels { engine: l.engine.clone(), direction: l.direction, reason };
                self.rejected.get(&labels).map(|c| c.get())
            })
            .sum()
    }

    fn saw(&self, engine: &str, direction: &'static str) -> EngineLabels {
        let labels = EngineLabels { engine: engine.to_string(), direction };
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if !seen.contains(&labels) {
            seen.insert(labels.clone());
        }
        labels
    }

    /// An engine settled a plan set that moved `bytes` in `segments` segments for `objects`
    /// objects in `direction`.
    pub(crate) fn record_moved(
        &self,
        engine: &str,
        direction: &'static str,
        segments: u64,
        bytes: u64,
        objects: u64,
    ) {
        let labels = self.saw(engine, direction);
        self.segments.get_or_create(&labels).inc_by(segments);
        self.bytes.get_or_create(&labels).inc_by(bytes);
        self.objects.get_or_create(&labels).inc_by(objects);
    }

    /// An engine reported (or panicked with) a failure in `direction`.
    pub(crate) fn record_failure(
        &self,
        engine: &str,
        direction: &'static str,
        cause: &FailureCause,
    ) {
        let _ = self.saw(engine, direction);
        let labels =
            FailureLabels { engine: engine.to_string(), direction, cause: cause.kind_name() };
        self.failures.get_or_create(&labels).inc();
    }

    /// An object's checksum settled with `outcome`; `mismatch` when its bytes did not match.
    pub(crate) fn record_checksum(
        &self,
        outcome: &'static str,
        tier: &'static str,
        mismatch: bool,
    ) {
        self.checksums.get_or_create(&ChecksumLabels { outcome, tier }).inc();
        if mismatch {
            self.checksum_mismatches.get_or_create(&TierLabels { tier }).inc();
        }
    }

    /// `bytes` more were hashed.
    pub(crate) fn record_checksum_bytes(&self, bytes: u64) {
        self.checksum_bytes.inc_by(bytes);
    }

    /// Restored objects whose bytes did not match their checksum, every tier
    /// (`umbp_checksum_mismatches_total`).
    pub fn checksum_mismatches(&self) -> u64 {
        ["host", "device", "file", "remote", "other"]
            .into_iter()
            .filter_map(|tier| self.checksum_mismatches.get(&TierLabels { tier }).map(|c| c.get()))
            .sum()
    }

    /// Bytes hashed for checksums (`umbp_checksum_bytes_total`).
    pub fn checksum_bytes(&self) -> u64 {
        self.checksum_bytes.get()
    }

    /// An object was rejected while planning, for a reason of kind `reason` (a
    /// [`RejectReason::kind_name`](umbp_plan::RejectReason::kind_name), or `other` for what is
    /// not one).
    pub(crate) fn record_rejected(
        &self,
        engine: &str,
        direction: &'static str,
        reason: &'static str,
    ) {
        let _ = self.saw(engine, direction);
        let labels = RejectLabels { engine: engine.to_string(), direction, reason };
        self.rejected.get_or_create(&labels).inc();
    }

    /// An engine's part took `elapsed` from submit to settle.
    pub(crate) fn record_part(&self, engine: &str, elapsed: Duration) {
        let labels = PartLabels { engine: engine.to_string() };
        self.part_seconds.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }

    /// A batch took `elapsed` to plan.
    pub(crate) fn record_plan(&self, elapsed: Duration) {
        self.plan_seconds.observe(elapsed.as_secs_f64());
    }

    /// `count` objects settled `elapsed` after their batch was submitted.
    pub(crate) fn record_objects_settled(&self, count: usize, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        for _ in 0..count {
            self.object_seconds.observe(seconds);
        }
    }

    /// A batch settled `elapsed` after submit, its objects in `states` (and the cause of each
    /// failed one in `causes`).
    pub(crate) fn record_batch<'a>(
        &self,
        elapsed: Duration,
        states: &[ObjectState],
        causes: impl Iterator<Item = &'a FailureCause>,
    ) {
        self.batch_seconds.observe(elapsed.as_secs_f64());
        let mut counts = [0u64; 4];
        let mut completed = true;
        for state in states {
            let slot = match state {
                ObjectState::Completed => 0,
                ObjectState::Failed => 1,
                ObjectState::Rejected => 2,
                ObjectState::Cancelled => 3,
                _ => continue,
            };
            completed &= slot == 0;
            counts[slot] += 1;
        }
        for (outcome, n) in ["completed", "failed", "rejected", "cancelled"].into_iter().zip(counts)
        {
            if n > 0 {
                self.object_outcomes.get_or_create(&OutcomeLabels { outcome }).inc_by(n);
            }
        }
        let outcome = if completed { "completed" } else { "failed" };
        self.batches.get_or_create(&OutcomeLabels { outcome }).inc();
        for cause in causes {
            self.object_failures.get_or_create(&CauseLabels { cause: cause.kind_name() }).inc();
        }
    }
}

/// Every cause label, for [`Metrics::snapshot`].
const CAUSES: [&str; 13] = [
    "io",
    "short_file",
    "device",
    "endpoint_gone",
    "not_accepted",
    "overlap",
    "timed_out",
    "cancelled",
    "peer_failed",
    "panicked",
    "checksum_mismatch",
    "checksum_unverifiable",
    "other",
];

/// Every reason label, for [`Metrics::snapshot`].
const REASONS: [&str; 9] = [
    "unknown_endpoint",
    "pair_not_handled",
    "out_of_bounds",
    "overflow",
    "segment_too_long",
    "builder_panicked",
    "read_only",
    "misaligned",
    "other",
];

/// Batches submitted and not yet settled, and the bytes they move.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlightSnapshot {
    /// Batches not yet settled.
    pub batches: u64,
    /// Bytes those batches move.
    pub bytes: u64,
}

/// The composite's in-flight counters (also the `umbp_in_flight_*` gauges); dropping the
/// composite waits for them to reach zero.
#[derive(Debug)]
pub(crate) struct InFlight {
    now: Mutex<InFlightSnapshot>,
    idle: Condvar,
    batches: Gauge,
    bytes: Gauge,
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
        self.publish(&now);
    }

    /// A batch of `bytes` settled.
    pub(crate) fn end(&self, bytes: u64) {
        let mut now = self.lock();
        now.batches = now.batches.saturating_sub(1);
        now.bytes = now.bytes.saturating_sub(bytes);
        self.publish(&now);
        if now.batches == 0 {
            self.idle.notify_all();
        }
    }

    /// Sets the gauges, under the lock, so they never show a stale pair.
    fn publish(&self, now: &InFlightSnapshot) {
        self.batches.set(i64::try_from(now.batches).unwrap_or(i64::MAX));
        self.bytes.set(i64::try_from(now.bytes).unwrap_or(i64::MAX));
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

/// Sums what a settled plan set moved per direction (one label set per direction, not per
/// plan): `(direction, segments, bytes, objects)`.
pub(crate) fn moved_by_direction(
    plans: &PlanSet,
    direction_of: impl Fn(umbp_plan::EndpointId, umbp_plan::EndpointId) -> Option<&'static str>,
) -> Vec<(&'static str, u64, u64, u64)> {
    let mut out: Vec<(&'static str, u64, u64, u64)> = Vec::new();
    for plan in plans.plans() {
        let Some(d) = direction_of(plan.src(), plan.dst()) else { continue };
        let row = match out.iter_mut().position(|r| r.0 == d) {
            Some(i) => &mut out[i],
            None => {
                out.push((d, 0, 0, 0));
                out.last_mut().expect("pushed")
            }
        };
        row.1 += plan.segment_count() as u64;
        row.2 += plan.bytes();
        row.3 += plan.tags().len() as u64;
    }
    out
}
