//! Batches in flight: the handle [`submit`](crate::CompositeEngine::submit) returns at once,
//! per-object and per-group progress while the executor works, and the report of a settled
//! batch.
//!
//! # How a batch settles
//!
//! At submit the batch is cut into *parts*: one engine's plans for one layer group, or one stage
//! of the staged route. Every object counts the parts that carry its bytes and every group
//! counts its parts. When a part settles (its engine returned, failed, panicked, or the part was
//! cancelled before it started) the objects it carried lose one pending part; an object whose
//! last part settled without failing it is completed. A failure, a rejection or a cancellation
//! is final: a later part cannot revive the object. Groups settle in order: group `k` is
//! settled once every part of it and of every earlier group has settled.
//!
//! A part settles exactly once, by whoever *claims* it first: the executor thread that is about
//! to run it, or [`Batch::cancel`] and the deadline watcher, which settle every part still
//! waiting (in the executor's queue, for a bounce slot, behind the earlier parts of its lane)
//! at once, as cancelled or timed out, without waiting for a thread to pick it up. A thread
//! that finds its part already claimed drops it.
//!
//! The batch is *done* once its last part settled, the listener heard of every group and the
//! batch's endpoints went free: [`Batch::wait`] returns only then, so a caller that waited may
//! deregister at once and finds every listener call made.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use umbp_plan::{
    BatchState, BatchStatus, CancelToken, DeviceStream, EndpointId, EndpointPins, EndpointRegistry,
    Failure, FailureCause, GroupListener, ObjectState, PlanSet, Tag,
};

use crate::integrity::Checks;
use crate::metrics::Metrics;
use crate::routed::{RoutedPart, RoutedPlans, StagedFragment};

/// Why one object did not complete.
///
/// `Debug` of a rejection shows the reason only, as `Display` does: the plan error's tag is
/// the batch's internal one, and the [`ObjectResult`] carrying the error names the caller's.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectError {
    /// Refused while planning (a bad range or page list, a fragment no engine carries or one
    /// the engine refused); no byte of it was written. Displayed with the reason only, naming
    /// endpoints by the caller's names (the second field): the plan error's tag is the batch's
    /// internal one, and the result names the caller's.
    #[error("rejected: {}", Reason(.0, .1))]
    Rejected(umbp_plan::Error, EndpointNames),
    /// A transfer carrying its bytes failed. Its destination ranges may hold some of its bytes;
    /// nothing outside them was written.
    #[error("{engine} failed {} -> {}: {cause}", .names.show(*.src), .names.show(*.dst))]
    Failed {
        /// The engine that ran the transfer (`staged` for a bounce region that went away).
        engine: String,
        /// The source endpoint of the failed transfer.
        src: EndpointId,
        /// The destination endpoint of the failed transfer.
        dst: EndpointId,
        /// What went wrong.
        cause: FailureCause,
        /// The caller's names of `src` and `dst`, for the message.
        names: EndpointNames,
    },
    /// The batch was cancelled before all of the object's bytes arrived: its transfers not
    /// yet started were skipped, and those running were cancelled where their engine can
    /// cancel (the SSD engine cancels its I/O) and finished otherwise. Its destination ranges
    /// may hold some of its bytes; nothing outside them was written.
    #[error("cancelled before all of its bytes arrived")]
    Cancelled,
}

impl std::fmt::Debug for ObjectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rejected(umbp_plan::Error::Rejected { reason, .. }, _) => {
                f.debug_tuple("Rejected").field(reason).finish()
            }
            Self::Rejected(other, _) => f.debug_tuple("Rejected").field(other).finish(),
            Self::Failed { engine, src, dst, cause, .. } => f
                .debug_struct("Failed")
                .field("engine", engine)
                .field("src", src)
                .field("dst", dst)
                .field("cause", cause)
                .finish(),
            Self::Cancelled => f.write_str("Cancelled"),
        }
    }
}

impl ObjectError {
    /// Why the object was rejected, in the words of its message without `rejected: ` (endpoints
    /// by the caller's names); `None` unless it was rejected.
    pub fn rejection(&self) -> Option<String> {
        match self {
            Self::Rejected(error, names) => Some(Reason(error, names).to_string()),
            _ => None,
        }
    }
}

/// What the caller calls the endpoints an [`ObjectError`] names: the label given at
/// registration ([`Registration::set_label`](umbp_plan::Registration::set_label)) or the path
/// of a file registered by path, looked up when the error was made. An endpoint without one is
/// `endpoint N`, its id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EndpointNames(Vec<(EndpointId, Arc<str>)>);

impl EndpointNames {
    /// The names `registry` has for `ids` (nothing is allocated when none has one).
    pub fn lookup(registry: &EndpointRegistry, ids: impl IntoIterator<Item = EndpointId>) -> Self {
        Self(ids.into_iter().filter_map(|id| registry.name(id).map(|name| (id, name))).collect())
    }

    /// The caller's name of endpoint `id`, if it has one.
    pub fn get(&self, id: EndpointId) -> Option<&str> {
        self.0.iter().find(|(e, _)| *e == id).map(|(_, name)| &**name)
    }

    /// `id` as a message shows it: its name in double quotes, else `endpoint N`.
    pub fn show(&self, id: EndpointId) -> impl std::fmt::Display + '_ {
        Shown(self.get(id), id)
    }
}

struct Shown<'a>(Option<&'a str>, EndpointId);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(name) => write!(f, "\"{name}\""),
            None => write!(f, "endpoint {}", self.1.raw()),
        }
    }
}

/// A plan error without the object it names (for [`ObjectError::Rejected`]), its endpoints by
/// the caller's names.
struct Reason<'a>(&'a umbp_plan::Error, &'a EndpointNames);

impl std::fmt::Display for Reason<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use umbp_plan::RejectReason as R;
        let n = self.1;
        let reason = match self.0 {
            umbp_plan::Error::Rejected { reason, .. } => reason,
            other => return other.fmt(f),
        };
        match *reason {
            // Only routing rejects a pair (an engine's builder is given the pairs it claims):
            // say what would carry it.
            R::PairNotHandled { src, dst } => write!(
                f,
                "no engine carries {} -> {}; a pair two engines carry only through host memory \
                 (file -> device, say) needs a staging region: register host memory and pass \
                 it to `CompositeEngine::set_staging`",
                n.show(src),
                n.show(dst)
            ),
            R::UnknownEndpoint(id) => write!(f, "{} is not registered", n.show(id)),
            R::OutOfBounds { endpoint, offset, len, endpoint_len } => write!(
                f,
                "bytes {offset}..+{len} lie outside {} of {endpoint_len} bytes",
                n.show(endpoint)
            ),
            R::Overflow { endpoint, offset, len } => {
                write!(f, "offset {offset} + length {len} overflows on {}", n.show(endpoint))
            }
            R::ReadOnly(id) => write!(f, "{} is read-only", n.show(id)),
            R::Misaligned { endpoint, offset, len, align } => write!(
                f,
                "bytes {offset}..+{len} of {} are not aligned to {align}",
                n.show(endpoint)
            ),
            _ => reason.fmt(f),
        }
    }
}

/// Object failure `cause` of a transfer `src -> dst` by `engine`, its endpoints named.
fn failed(
    registry: &EndpointRegistry,
    engine: String,
    src: EndpointId,
    dst: EndpointId,
    cause: FailureCause,
) -> ObjectError {
    let names = EndpointNames::lookup(registry, [src, dst]);
    ObjectError::Failed { engine, src, dst, cause, names }
}

/// Object rejection `error`, its endpoints named.
fn rejected(registry: &EndpointRegistry, error: umbp_plan::Error) -> ObjectError {
    let names = EndpointNames::lookup(registry, named_endpoints(&error).into_iter().flatten());
    ObjectError::Rejected(error, names)
}

/// The endpoints a plan error names.
fn named_endpoints(error: &umbp_plan::Error) -> [Option<EndpointId>; 2] {
    use umbp_plan::RejectReason as R;
    let umbp_plan::Error::Rejected { reason, .. } = error else { return [None, None] };
    match *reason {
        R::PairNotHandled { src, dst } => [Some(src), Some(dst)],
        R::UnknownEndpoint(id) | R::ReadOnly(id) => [Some(id), None],
        R::OutOfBounds { endpoint, .. }
        | R::Overflow { endpoint, .. }
        | R::Misaligned { endpoint, .. } => [Some(endpoint), None],
        _ => [None, None],
    }
}

/// The result of one object of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectResult {
    /// The caller's tag for the object.
    pub tag: u64,
    /// Where the object stands.
    pub state: ObjectState,
    /// Why it did not complete, once it is rejected, failed or cancelled.
    pub error: Option<ObjectError>,
    /// The CRC32C of the object's bytes (its ranges, concatenated in range order), where the
    /// composite's [`ChecksumPolicy`](crate::ChecksumPolicy) covers its tier: for an offload,
    /// of the bytes it wrote, to record with the block and verify when it is restored; for a
    /// restore given a checksum, of the bytes that arrived. `None` for objects not hashed
    /// (not covered, a restore given no checksum, not settled, failed before all its bytes
    /// arrived) and for an offload part of whose bytes never passed host memory.
    pub checksum: Option<u32>,
}

/// Where a batch stands: one result per object, in the batch's order, and the aggregate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransferReport {
    /// One result per object.
    pub objects: Vec<ObjectResult>,
    /// Completed only when every object completed; failed only once nothing is in flight and
    /// some object did not complete.
    pub aggregate: BatchState,
}

impl TransferReport {
    /// The objects that did not complete (rejected, failed or cancelled).
    pub fn unsuccessful(&self) -> impl Iterator<Item = &ObjectResult> {
        self.objects.iter().filter(|o| o.state.is_unsuccessful())
    }

    /// The result of the object the caller tagged `tag`.
    pub fn object(&self, tag: u64) -> Option<&ObjectResult> {
        self.objects.iter().find(|o| o.tag == tag)
    }
}

/// Where a batch's tags sit in its object list.
enum Positions {
    /// Tags are the positions `0 .. n` (restore and offload number their objects so).
    Dense,
    /// Any tags, looked up.
    Map(HashMap<Tag, usize>),
}

/// One part of a batch: the group it belongs to, its engine (`None` for a stage of the staged
/// route) and the objects it carries, each once, with the pair of the first plan or fragment
/// of the part that carries it.
pub(crate) struct Part {
    group_slot: usize,
    engine: Option<usize>,
    tags: Vec<Tag>,
    pairs: Vec<(EndpointId, EndpointId)>,
}

impl Part {
    /// The tags of the objects the part carries.
    pub(crate) fn tags(&self) -> &[Tag] {
        &self.tags
    }
}

/// How a part ended.
pub(crate) enum PartEnd {
    /// The engine ran it; these are its failures.
    Ran(Vec<Failure>),
    /// It never started: the batch was cancelled.
    Cancelled,
    /// It never started: the batch's deadline passed first. Its objects fail with
    /// [`FailureCause::TimedOut`], named after this engine (`staged` for a stage).
    TimedOut(String),
}

/// A part not yet claimed (see the module docs).
const WAITING: u8 = 0;
/// A part an executor thread claimed to run it.
const STARTED: u8 = 1;
/// A part settled without running (cancelled or timed out while it waited).
const SKIPPED: u8 = 2;

/// Group slots the listener heard of, as prefixes of the batch's groups.
#[derive(Default)]
struct Told {
    enqueued: usize,
    settled: usize,
}

/// Everything the handle and the executor share about one batch.
pub(crate) struct BatchShared {
    keys: Vec<u64>,
    by_key: HashMap<u64, usize>,
    positions: Positions,
    /// The batch's distinct groups, ascending; parts name a group by its slot here.
    groups: Vec<u32>,
    parts: Vec<Part>,
    bytes: u64,
    progress: Mutex<Progress>,
    /// Signalled on every change of `progress`.
    changed: Condvar,
    cancelled: AtomicBool,
    /// Given to every plan set the batch submits; cancelled by [`Batch::cancel`].
    token: CancelToken,
    /// Per part: [`WAITING`], [`STARTED`] or [`SKIPPED`].
    claims: Vec<AtomicU8>,
    listener: Option<Arc<dyn GroupListener>>,
    /// The group slots the listener has been told of, enqueued and settled. Held while telling,
    /// so that calls from threads settling parts side by side queue up in group order.
    told: Mutex<Told>,
    metrics: Arc<Metrics>,
    /// When the batch was submitted.
    submitted: Instant,
    /// Whether the batch counts in the metrics (in flight or not, it counts as in flight).
    metered: bool,
    /// The batch's endpoints, pinned until it settles.
    pins: Mutex<Option<EndpointPins>>,
    /// Where errors find the caller's names of endpoints.
    registry: Arc<EndpointRegistry>,
    deadline: Option<Instant>,
    stream: Option<DeviceStream>,
    /// The objects' checksums, when the batch hashes any (shared with the engines that hash
    /// while copying, through their plan sets' sinks).
    checks: Option<Arc<Checks>>,
}

struct Progress {
    status: BatchStatus,
    errors: Vec<Option<ObjectError>>,
    /// Parts still to settle, per object.
    pending: Vec<u32>,
    /// Parts still to settle, per group slot.
    group_pending: Vec<usize>,
    /// Whether each part is enqueued (submitted, or settled without running).
    part_enqueued: Vec<bool>,
    /// Parts still to enqueue, per group slot.
    group_unqueued: Vec<usize>,
    /// Group slots enqueued so far, as a prefix of `groups` (the listener hears of them after).
    groups_enqueued: usize,
    /// Group slots settled so far, as a prefix of `groups` (the listener hears of them after).
    groups_settled: usize,
    parts_pending: usize,
    /// The last part settled, the listener heard of every group and the endpoints went free.
    done: bool,
    /// Futures waiting for a change (see [`Batch::settled`]), woken with `changed`.
    wakers: Vec<Waker>,
    /// What the engines gave back, for the builder's next batch.
    returned: RoutedPlans,
}

/// What the executor gets for one batch: the shared state and the work, cut into parts.
pub(crate) struct Prepared {
    pub(crate) batch: Arc<BatchShared>,
    /// Each direct part: its part index and engine, and the plans.
    pub(crate) direct: Vec<(usize, RoutedPart)>,
    /// Each stage of the staged route: its part index and its fragments.
    pub(crate) stages: Vec<(usize, Vec<StagedFragment>)>,
}

impl BatchShared {
    /// Cuts `plans` into parts and builds the batch's state. `keys` are the caller's tags in
    /// the batch's order when tags are positions (restore and offload); otherwise each tag is
    /// its own key. `stages` cuts the staged fragments into stages.
    pub(crate) fn prepare(
        mut plans: RoutedPlans,
        keys: Option<Vec<u64>>,
        stages: impl FnOnce(Vec<StagedFragment>) -> Vec<Vec<StagedFragment>>,
        metrics: Arc<Metrics>,
        pins: EndpointPins,
        checks: Option<Checks>,
        registry: Arc<EndpointRegistry>,
    ) -> Prepared {
        let objects = std::mem::take(&mut plans.objects);
        let (keys, positions) = match keys {
            Some(keys) => (keys, Positions::Dense),
            None => {
                let map = objects.iter().enumerate().map(|(i, &t)| (t, i)).collect();
                (objects.iter().map(|t| u64::from(t.get())).collect(), Positions::Map(map))
            }
        };
        let by_key = keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
        let position = |tag: Tag| match &positions {
            Positions::Dense => Some(tag.index()).filter(|&i| i < keys.len()),
            Positions::Map(map) => map.get(&tag).copied(),
        };

        let mut groups: Vec<u32> = plans.parts.iter().map(|p| p.group).collect();
        groups.extend(plans.staged.iter().map(|s| s.group));
        groups.sort_unstable();
        groups.dedup();
        let slot = |g: u32| groups.partition_point(|&x| x < g);

        let n = keys.len();
        let mut pending = vec![0u32; n];
        let mut stamp = vec![usize::MAX; n];
        let mut parts = Vec::new();
        let mut part_of =
            |group: u32,
             engine: Option<usize>,
             tags: &mut dyn Iterator<Item = (Tag, EndpointId, EndpointId)>| {
                let index = parts.len();
                let (mut carried, mut pairs) = (Vec::new(), Vec::new());
                for (tag, src, dst) in tags {
                    if let Some(i) = position(tag) {
                        if stamp[i] != index {
                            stamp[i] = index;
                            pending[i] += 1;
                            carried.push(tag);
                            pairs.push((src, dst));
                        }
                    }
                }
                parts.push(Part { group_slot: slot(group), engine, tags: carried, pairs });
                index
            };

        let mut direct = Vec::new();
        let mut bytes = 0;
        for part in std::mem::take(&mut plans.parts) {
            bytes += part.plans.bytes();
            let mut tags = part
                .plans
                .plans()
                .iter()
                .flat_map(|p| p.tags().iter().map(|&t| (t, p.src(), p.dst())));
            let index = part_of(part.group, Some(part.engine), &mut tags);
            direct.push((index, part));
        }
        let mut staged_parts = Vec::new();
        for stage in stages(std::mem::take(&mut plans.staged)) {
            let Some(first) = stage.first() else { continue };
            bytes += stage.iter().map(|s| s.fragment.len).sum::<u64>();
            let mut tags = stage.iter().map(|s| (s.fragment.tag, s.fragment.src, s.fragment.dst));
            let index = part_of(first.group, None, &mut tags);
            staged_parts.push((index, stage));
        }

        let mut status = BatchStatus::new(n);
        let mut errors = vec![None; n];
        for (tag, error) in std::mem::take(&mut plans.rejected) {
            if let Some(i) = position(tag) {
                let _ = status.set(Tag::new(i as u32), ObjectState::Rejected);
                errors[i].get_or_insert_with(|| rejected(&registry, error));
            }
        }
        // Objects the builder failed before anything runs (the overlap rule across parts).
        for f in std::mem::take(&mut plans.failed) {
            for &tag in &f.tags {
                if let Some(i) = position(tag) {
                    let _ = status.set(Tag::new(i as u32), ObjectState::Failed);
                    errors[i].get_or_insert_with(|| {
                        failed(&registry, f.engine.clone(), f.src, f.dst, f.cause.clone())
                    });
                }
            }
        }
        // Objects no part carries (nothing but empty ranges) have nothing left to wait for;
        // a checked one has the checksum of no bytes.
        if let Some(checks) = &checks {
            checks.set_parts(&pending);
        }
        for (i, &p) in pending.iter().enumerate() {
            if p == 0 {
                let tag = Tag::new(i as u32);
                let failure = match &checks {
                    Some(c) if c.is_tracked(i) && !status.objects()[i].is_unsuccessful() => {
                        c.finish(i)
                    }
                    _ => None,
                };
                match failure {
                    None => {
                        let _ = status.set(tag, ObjectState::Completed);
                    }
                    Some(f) => {
                        let _ = status.set(tag, ObjectState::Failed);
                        errors[i] = Some(failed(&registry, f.engine, f.src, f.dst, f.cause));
                    }
                }
            }
        }
        let mut group_pending = vec![0; groups.len()];
        for part in &parts {
            group_pending[part.group_slot] += 1;
        }
        let parts_pending = parts.len();
        let group_unqueued = group_pending.clone();
        let listener = plans.listener.take();
        let unmetered = plans.unmetered;
        let deadline = plans.deadline;
        let stream = plans.stream;
        let batch = Arc::new(BatchShared {
            keys,
            by_key,
            positions,
            groups,
            parts,
            bytes,
            progress: Mutex::new(Progress {
                status,
                errors,
                pending,
                group_pending,
                part_enqueued: vec![false; parts_pending],
                group_unqueued,
                groups_enqueued: 0,
                groups_settled: 0,
                parts_pending,
                done: false,
                wakers: Vec::new(),
                returned: plans,
            }),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
            token: CancelToken::new(),
            claims: (0..parts_pending).map(|_| AtomicU8::new(WAITING)).collect(),
            listener,
            told: Mutex::default(),
            metrics,
            submitted: Instant::now(),
            metered: !unmetered,
            pins: Mutex::new(Some(pins)),
            registry,
            deadline,
            stream,
            checks: checks.map(Arc::new),
        });
        batch.metrics.in_flight.begin(batch.bytes);
        if parts_pending == 0 {
            batch.finished();
        }
        Prepared { batch, direct, stages: staged_parts }
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        // Every update leaves `Progress` consistent before anything that could panic, so a
        // poisoned lock still guards a usable state.
        self.progress.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn position(&self, tag: Tag) -> Option<usize> {
        match &self.positions {
            Positions::Dense => Some(tag.index()).filter(|&i| i < self.keys.len()),
            Positions::Map(map) => map.get(&tag).copied(),
        }
    }

    /// Part `index`.
    pub(crate) fn part(&self, index: usize) -> &Part {
        &self.parts[index]
    }

    /// The objects' checksums, when the batch hashes any.
    pub(crate) fn checks(&self) -> Option<&Arc<Checks>> {
        self.checks.as_ref()
    }

    /// Whether the batch counts in the metrics.
    pub(crate) fn is_metered(&self) -> bool {
        self.metered
    }

    /// Whether the caller cancelled the batch.
    pub(crate) fn is_cancelled(&self) -> bool {
        // Relaxed: the flag only makes parts that have not started skip; the batch's state is
        // published under the progress lock.
        self.cancelled.load(Ordering::Relaxed)
    }

    /// The batch's deadline, if any.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The stream device work of the batch may be queued on.
    pub(crate) fn stream(&self) -> Option<DeviceStream> {
        self.stream
    }

    /// Whether the batch's deadline has passed.
    pub(crate) fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// The token every plan set of the batch carries ([`PlanSet::set_cancel`]).
    pub(crate) fn token(&self) -> &CancelToken {
        &self.token
    }

    /// Claims part `index` for an executor thread that is about to run it (or settle it
    /// itself); `false` if it was settled while it waited, and the thread drops it.
    pub(crate) fn claim(&self, index: usize) -> bool {
        self.claim_as(index, STARTED)
    }

    /// Moves part `index` from waiting to `to`; whether this call did. One atomic location
    /// decides, so exactly one of the executor and the cancellers wins; what the winner then
    /// does to the batch is published under the progress lock, hence `Relaxed`.
    fn claim_as(&self, index: usize, to: u8) -> bool {
        self.claims[index]
            .compare_exchange(WAITING, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Settles every part still waiting, with what `end` says for it; returns how many.
    fn settle_waiting(&self, end: impl Fn(&Part) -> PartEnd) -> usize {
        let mut settled = 0;
        for (index, part) in self.parts.iter().enumerate() {
            if self.claim_as(index, SKIPPED) {
                self.settle(index, end(part), None);
                settled += 1;
            }
        }
        settled
    }

    /// Cancels the batch: later claims see it, running parts' engines are told through the
    /// token, and every part still waiting settles as cancelled now.
    pub(crate) fn cancel(&self) {
        // Relaxed: see `is_cancelled`.
        self.cancelled.store(true, Ordering::Relaxed);
        self.token.cancel();
        self.settle_waiting(|_| PartEnd::Cancelled);
    }

    /// The deadline passed: every part still waiting settles as timed out now, its failures
    /// named after `name(engine)`. Returns how many parts it settled.
    pub(crate) fn expire(&self, name: &dyn Fn(usize) -> String) -> usize {
        self.settle_waiting(|part| {
            PartEnd::TimedOut(part.engine.map_or_else(|| "staged".to_string(), name))
        })
    }

    /// Whether the batch is done (see [`Batch::wait`]).
    pub(crate) fn is_done(&self) -> bool {
        self.lock().done
    }

    /// Whether object `tag` already failed, was rejected or cancelled (so later hops can skip
    /// it).
    pub(crate) fn has_failed(&self, tag: Tag) -> bool {
        self.position(tag).is_some_and(|i| self.lock().status.objects()[i].is_unsuccessful())
    }

    /// Part `index` is enqueued: submitted to its engine, whose handle may still be pending on
    /// a stream. Tells the listener of the groups that became enqueued by it.
    pub(crate) fn enqueued(&self, index: usize) {
        self.mark_enqueued(&mut self.lock(), index);
        self.deliver();
        self.notify();
    }

    /// Marks part `index` enqueued (once), advancing the enqueued groups.
    fn mark_enqueued(&self, p: &mut Progress, index: usize) {
        if std::mem::replace(&mut p.part_enqueued[index], true) {
            return;
        }
        p.group_unqueued[self.parts[index].group_slot] -= 1;
        while p.groups_enqueued < self.groups.len() && p.group_unqueued[p.groups_enqueued] == 0 {
            p.groups_enqueued += 1;
        }
    }

    /// Tells the listener, if any, of every group enqueued or settled that it has not heard of:
    /// in group order, each group's enqueueing before its settling, however the threads that
    /// advanced them interleave (a thread that finds another telling waits for it on `told`,
    /// then tells what is left). A panicking listener is logged, not spread.
    fn deliver(&self) {
        let Some(listener) = &self.listener else { return };
        let mut told = self.told.lock().unwrap_or_else(PoisonError::into_inner);
        // A group settles only once enqueued (settling a part enqueues it), so every group
        // settled in this snapshot is told enqueued first.
        let (enqueued, settled) = {
            let p = self.lock();
            (p.groups_enqueued, p.groups_settled)
        };
        let tell = |slot: usize, call: fn(&dyn GroupListener, u32)| {
            let group = self.groups[slot];
            let listener = std::panic::AssertUnwindSafe(&**listener);
            if std::panic::catch_unwind(|| call(*listener, group)).is_err() {
                tracing::error!(group, "a group listener panicked");
            }
        };
        for slot in told.enqueued..enqueued {
            tell(slot, |listener, group| listener.group_enqueued(group));
        }
        for slot in told.settled..settled {
            tell(slot, |listener, group| listener.group_settled(group));
        }
        // The snapshot was taken under `told` and the counts only grow: it is at or past it.
        *told = Told { enqueued, settled };
    }

    /// Settles part `index`: fails the objects its failures name, cancels its objects if it
    /// never ran, completes the objects whose last part this was, and advances the groups.
    pub(crate) fn settle(&self, index: usize, end: PartEnd, returned: Option<ReturnedWork>) {
        let part = &self.parts[index];
        let all_done;
        let mut objects_settled = 0;
        {
            let mut p = self.lock();
            // A part that settles without having been submitted (cancelled, timed out, a
            // stage that failed before its second hop) is enqueued by settling.
            self.mark_enqueued(&mut p, index);
            match end {
                PartEnd::Ran(failures) => {
                    for f in failures {
                        for &tag in &f.tags {
                            let Some(i) = self.position(tag) else { continue };
                            if p.status.objects()[i].is_unsuccessful() {
                                continue;
                            }
                            // An engine that cancelled the object's transfers on the batch's
                            // token: the object is cancelled, as if they had never started.
                            let (state, error) = match f.cause {
                                FailureCause::Cancelled if self.is_cancelled() => {
                                    (ObjectState::Cancelled, ObjectError::Cancelled)
                                }
                                _ => (
                                    ObjectState::Failed,
                                    failed(
                                        &self.registry,
                                        f.engine.clone(),
                                        f.src,
                                        f.dst,
                                        f.cause.clone(),
                                    ),
                                ),
                            };
                            let _ = p.status.set(Tag::new(i as u32), state);
                            p.errors[i] = Some(error);
                        }
                    }
                }
                PartEnd::TimedOut(engine) => {
                    for (&tag, &(src, dst)) in part.tags.iter().zip(&part.pairs) {
                        let Some(i) = self.position(tag) else { continue };
                        if !p.status.objects()[i].is_unsuccessful() {
                            let _ = p.status.set(Tag::new(i as u32), ObjectState::Failed);
                            let cause = FailureCause::TimedOut;
                            p.errors[i] =
                                Some(failed(&self.registry, engine.clone(), src, dst, cause));
                        }
                    }
                }
                PartEnd::Cancelled => {
                    for &tag in &part.tags {
                        let Some(i) = self.position(tag) else { continue };
                        if !p.status.objects()[i].is_unsuccessful() {
                            let _ = p.status.set(Tag::new(i as u32), ObjectState::Cancelled);
                            p.errors[i] = Some(ObjectError::Cancelled);
                        }
                    }
                }
            }
            for &tag in &part.tags {
                let Some(i) = self.position(tag) else { continue };
                p.pending[i] = p.pending[i].saturating_sub(1);
                if p.pending[i] == 0 {
                    let _ = p.status.set(Tag::new(i as u32), ObjectState::Completed);
                    objects_settled += 1;
                }
            }
            match returned {
                Some(ReturnedWork::Direct(part)) => p.returned.parts.push(part),
                Some(ReturnedWork::Staged(mut staged)) => p.returned.staged.append(&mut staged),
                None => {}
            }
            p.group_pending[part.group_slot] -= 1;
            while p.groups_settled < self.groups.len() && p.group_pending[p.groups_settled] == 0 {
                p.groups_settled += 1;
            }
            p.parts_pending -= 1;
            all_done = p.parts_pending == 0;
        }
        if self.metered {
            self.metrics.record_objects_settled(objects_settled, self.submitted.elapsed());
        }
        self.deliver();
        if all_done {
            self.finished();
        }
        self.notify();
    }

    /// Wakes every thread and future waiting for a change of the progress.
    fn notify(&self) {
        let wakers = std::mem::take(&mut self.lock().wakers);
        self.changed.notify_all();
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Whether `done` holds of the progress; if not, `waker` is woken at the next change.
    fn poll_until(&self, waker: &Waker, done: impl Fn(&Progress) -> bool) -> bool {
        let mut p = self.lock();
        if done(&p) {
            return true;
        }
        if !p.wakers.iter().any(|w| w.will_wake(waker)) {
            p.wakers.push(waker.clone());
        }
        false
    }

    /// The last part settled and the listener heard of it: the endpoints go free, the batch
    /// leaves the in-flight count and is done, all under the progress lock, so that whoever
    /// sees one of them (a deregistration that returns, a wait) finds the others done too.
    /// (Releasing pins only counts down and notifies; it takes no lock of a batch.)
    fn finished(&self) {
        let mut p = self.lock();
        drop(self.pins.lock().unwrap_or_else(PoisonError::into_inner).take());
        self.metrics.in_flight.end(self.bytes);
        p.done = true;
        let causes = p.errors.iter().filter_map(|e| match e {
            Some(ObjectError::Failed { cause, .. }) => Some(cause),
            _ => None,
        });
        if self.metered {
            self.metrics.record_batch(self.submitted.elapsed(), p.status.objects(), causes);
        }
    }

    fn report(&self, p: &Progress) -> TransferReport {
        let objects = self
            .keys
            .iter()
            .zip(p.status.objects())
            .zip(&p.errors)
            .enumerate()
            .map(|(i, ((&tag, &state), error))| ObjectResult {
                tag,
                state,
                error: error.clone(),
                checksum: self.checks.as_ref().and_then(|c| c.checksum(i)),
            })
            .collect();
        TransferReport { objects, aggregate: p.status.aggregate() }
    }

    /// Blocks until `done` holds of the progress or `deadline` passes; whether it holds.
    fn wait_until(&self, deadline: Option<Instant>, done: impl Fn(&Progress) -> bool) -> bool {
        let mut p = self.lock();
        loop {
            if done(&p) {
                return true;
            }
            p = match deadline {
                None => self.changed.wait(p).unwrap_or_else(PoisonError::into_inner),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        return false;
                    };
                    self.changed.wait_timeout(p, left).unwrap_or_else(PoisonError::into_inner).0
                }
            };
        }
    }

    /// Group slots at or below `group`.
    fn groups_through(&self, group: u32) -> usize {
        self.groups.partition_point(|&g| g <= group)
    }
}

/// What a part hands back once its engine is done with it, for the builder's next batch.
pub(crate) enum ReturnedWork {
    Direct(RoutedPart),
    Staged(Vec<StagedFragment>),
}

/// A submitted batch: poll it, wait for it (whole, by layer group, or with a deadline), or
/// cancel it.
///
/// - Every method takes `&self`: one thread may wait for layer groups while another polls.
/// - [`wait`](Self::wait) blocks until the batch is done (every object settled, every listener
///   call made, the endpoints free) and returns the report; it may be called again and returns
///   the same report.
/// - Dropping a batch waits for it, so no memory a transfer reads or writes is freed under it.
///   [`cancel`](Self::cancel) is the quick way out: work not yet started settles at once and
///   running work is cancelled where its engine can.
/// - A [deadline](crate::CompositeBuilder::set_deadline) settles the work not started by then
///   the moment it passes (the executor's deadline watcher does it, whatever the executor's
///   threads are busy with), its objects failing with
///   [`TimedOut`](umbp_plan::FailureCause::TimedOut).
#[must_use = "dropping a batch blocks until its transfers finish"]
pub struct Batch {
    shared: Arc<BatchShared>,
}

impl Batch {
    pub(crate) fn new(shared: Arc<BatchShared>) -> Self {
        Self { shared }
    }

    /// Number of objects in the batch.
    pub fn len(&self) -> usize {
        self.shared.keys.len()
    }

    /// Whether the batch has no objects.
    pub fn is_empty(&self) -> bool {
        self.shared.keys.is_empty()
    }

    /// Bytes the batch moves (planned bytes, the staged route's counted once).
    pub fn bytes(&self) -> u64 {
        self.shared.bytes
    }

    /// Whether the batch is done (see [`wait`](Self::wait)), without blocking.
    pub fn is_done(&self) -> bool {
        self.shared.lock().done
    }

    /// Where the object the caller tagged `tag` stands now, without blocking.
    pub fn state(&self, tag: u64) -> Option<ObjectState> {
        let i = *self.shared.by_key.get(&tag)?;
        Some(self.shared.lock().status.objects()[i])
    }

    /// The aggregate state now, without blocking.
    pub fn aggregate(&self) -> BatchState {
        self.shared.lock().status.aggregate()
    }

    /// Every object's state now, without blocking (objects still moving are in flight).
    pub fn report(&self) -> TransferReport {
        self.shared.report(&self.shared.lock())
    }

    /// The layer groups the batch's transfers belong to, ascending (`[0]` when the caller never
    /// set one).
    pub fn groups(&self) -> &[u32] {
        &self.shared.groups
    }

    /// Whether every transfer of groups up to `group` has settled, without blocking.
    pub fn is_group_done(&self, group: u32) -> bool {
        let through = self.shared.groups_through(group);
        self.shared.lock().groups_settled >= through
    }

    /// Blocks until the batch is done, and returns the report. Done: every object has settled,
    /// the [group listener](crate::CompositeBuilder::set_group_listener) heard of every group,
    /// the batch's endpoints are free (deregistering one returns at once) and the batch left
    /// [`in_flight`](crate::CompositeEngine::in_flight).
    pub fn wait(&self) -> TransferReport {
        self.shared.wait_until(None, |p| p.done);
        self.report()
    }

    /// Blocks until the batch is done (see [`wait`](Self::wait)) or `timeout` passes; the
    /// report if it is done.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<TransferReport> {
        let deadline = Instant::now().checked_add(timeout);
        self.shared.wait_until(deadline, |p| p.done).then(|| self.report())
    }

    /// Whether every transfer of groups up to `group` is enqueued (see
    /// [`wait_group_enqueued`](Self::wait_group_enqueued)), without blocking.
    pub fn is_group_enqueued(&self, group: u32) -> bool {
        let through = self.shared.groups_through(group);
        self.shared.lock().groups_enqueued >= through
    }

    /// Blocks until every transfer of groups up to `group` either finished on the host or is
    /// queued on the batch's stream ([`CompositeBuilder::set_stream`](crate::CompositeBuilder::set_stream)):
    /// work the caller queues on that stream from now on runs after these groups' bytes are in
    /// place, with no further host wait. Without a stream it returns when the groups settled,
    /// as [`wait_group`](Self::wait_group) does. Failures still show only once settled: check
    /// the report before trusting the bytes.
    pub fn wait_group_enqueued(&self, group: u32) {
        let through = self.shared.groups_through(group);
        self.shared.wait_until(None, |p| p.groups_enqueued >= through);
    }

    /// [`wait_group_enqueued`](Self::wait_group_enqueued) with a deadline; whether the groups
    /// were enqueued.
    pub fn wait_group_enqueued_timeout(&self, group: u32, timeout: Duration) -> bool {
        let through = self.shared.groups_through(group);
        let deadline = Instant::now().checked_add(timeout);
        self.shared.wait_until(deadline, |p| p.groups_enqueued >= through)
    }

    /// Blocks until every transfer of groups up to `group` has settled, while later groups may
    /// still be moving. An object whose bytes span several groups is settled only with its last
    /// group: its earlier ranges are in place (unless the batch reports it failed).
    pub fn wait_group(&self, group: u32) {
        let through = self.shared.groups_through(group);
        self.shared.wait_until(None, |p| p.groups_settled >= through);
    }

    /// [`wait_group`](Self::wait_group) with a deadline; whether the groups settled.
    pub fn wait_group_timeout(&self, group: u32, timeout: Duration) -> bool {
        let through = self.shared.groups_through(group);
        let deadline = Instant::now().checked_add(timeout);
        self.shared.wait_until(deadline, |p| p.groups_settled >= through)
    }

    /// A future of the report once the batch is done (see [`wait`](Self::wait)), for async
    /// code: no thread waits for it. The batch wakes the future's task when it settles (every
    /// change of its progress wakes the tasks waiting on it; each re-checks and goes back to
    /// sleep); there is no polling loop. Awaiting the batch itself does the same and consumes
    /// it.
    pub fn settled(&self) -> Settled<'_> {
        Settled { batch: &self.shared }
    }

    /// A future that is ready once every transfer of groups up to `group` has settled (what
    /// [`wait_group`](Self::wait_group) waits for), without a thread per wait.
    pub fn group_settled(&self, group: u32) -> GroupReady<'_> {
        let through = self.shared.groups_through(group);
        GroupReady { batch: &self.shared, through, enqueued: false }
    }

    /// A future that is ready once every transfer of groups up to `group` is enqueued (what
    /// [`wait_group_enqueued`](Self::wait_group_enqueued) waits for), without a thread per
    /// wait.
    pub fn group_enqueued(&self, group: u32) -> GroupReady<'_> {
        let through = self.shared.groups_through(group);
        GroupReady { batch: &self.shared, through, enqueued: true }
    }

    /// Calls `callback` once the batch is done (see [`wait`](Self::wait)): on the thread that
    /// finishes it (an executor thread, or a thread cancelling it), or here and now if it is
    /// done already. No thread waits for it: the callback rides on the batch's wakers. Keep
    /// it short and never block in it (it runs where the composite settles batches): hand
    /// the news to your event loop (Python's `loop.call_soon_threadsafe`, say). A panicking
    /// callback is logged, not spread.
    pub fn on_settled(&self, callback: impl FnOnce() + Send + 'static) {
        let on = OnSettled {
            batch: Arc::downgrade(&self.shared),
            callback: Mutex::new(Some(Box::new(callback))),
        };
        Arc::new(on).check();
    }

    /// Cancels the batch and returns the final report once no engine works for it any more.
    ///
    /// - Parts not yet started settle at once, here, wherever they wait (behind other batches
    ///   in the executor's queue, for a bounce slot, behind earlier groups of their lane): no
    ///   engine ever sees them, and their objects are reported
    ///   [`Cancelled`](ObjectState::Cancelled).
    /// - Parts running are told through the batch's [`CancelToken`] (every plan set the batch
    ///   submits carries it, [`PlanSet::cancel_token`]): engines that can cancel (the SSD
    ///   engine cancels its I/O in the kernel) stop, and the objects whose bytes had not
    ///   arrived are reported cancelled too; other engines finish what they were given.
    ///
    /// So `cancel` returns as soon as the running parts' engines let go of the caller's memory:
    /// it never returns while an engine still writes it.
    pub fn cancel(&self) -> TransferReport {
        self.shared.cancel();
        self.wait()
    }

    /// Waits, then gives back the executed plans, for
    /// [`CompositeBuilder::recycle`](crate::CompositeBuilder::recycle).
    pub fn into_plans(self) -> RoutedPlans {
        self.wait();
        let mut p = self.shared.lock();
        let mut plans = std::mem::take(&mut p.returned);
        plans.parts.sort_by_key(|part| (part.group, part.engine));
        plans
    }
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.shared.lock();
        f.debug_struct("Batch")
            .field("objects", &self.shared.keys.len())
            .field("parts_pending", &p.parts_pending)
            .field("aggregate", &p.status.aggregate())
            .finish()
    }
}

/// Awaiting a batch waits for it to be done, as [`Batch::settled`] does, and gives its report;
/// the batch is dropped done, so dropping it does not block.
impl Future for Batch {
    type Output = TransferReport;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<TransferReport> {
        let shared = &self.shared;
        match shared.poll_until(cx.waker(), |p| p.done) {
            true => Poll::Ready(shared.report(&shared.lock())),
            false => Poll::Pending,
        }
    }
}

/// A callback waiting for its batch to be done ([`Batch::on_settled`]): a waker that checks,
/// at each change of the batch's progress, whether it is done, and calls the callback once.
struct OnSettled {
    batch: Weak<BatchShared>,
    callback: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl OnSettled {
    /// Calls the callback if the batch is done; waits for the next change otherwise.
    fn check(self: Arc<Self>) {
        // The batch lives while anything can still change it (the executor holds it while it
        // settles parts), so a batch that is gone was done, and its wakers were woken then.
        let Some(batch) = self.batch.upgrade() else { return };
        let waker = Waker::from(Arc::clone(&self));
        if !batch.poll_until(&waker, |p| p.done) {
            return;
        }
        let callback = self.callback.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(callback) = callback {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(callback)).is_err() {
                tracing::error!("a batch's on_settled callback panicked");
            }
        }
    }
}

impl Wake for OnSettled {
    fn wake(self: Arc<Self>) {
        self.check();
    }
}

/// The future of a batch's report once it is done, from [`Batch::settled`].
#[must_use = "futures do nothing unless awaited"]
#[derive(Debug)]
pub struct Settled<'a> {
    batch: &'a BatchShared,
}

impl Future for Settled<'_> {
    type Output = TransferReport;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<TransferReport> {
        match self.batch.poll_until(cx.waker(), |p| p.done) {
            true => Poll::Ready(self.batch.report(&self.batch.lock())),
            false => Poll::Pending,
        }
    }
}

/// The future of layer groups settled or enqueued, from [`Batch::group_settled`] and
/// [`Batch::group_enqueued`].
#[must_use = "futures do nothing unless awaited"]
#[derive(Debug)]
pub struct GroupReady<'a> {
    batch: &'a BatchShared,
    /// Group slots that must be settled (or enqueued).
    through: usize,
    enqueued: bool,
}

impl Future for GroupReady<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let (through, enqueued) = (self.through, self.enqueued);
        let ready = self.batch.poll_until(cx.waker(), |p| match enqueued {
            true => p.groups_enqueued >= through,
            false => p.groups_settled >= through,
        });
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl std::fmt::Debug for BatchShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchShared").field("objects", &self.keys.len()).finish_non_exhaustive()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.shared.wait_until(None, |p| p.done);
    }
}

/// Plans given back by an engine keep their buffers; an empty set stands in for a part whose
/// engine panicked with them.
pub(crate) fn returned_part(group: u32, engine: usize, plans: PlanSet) -> ReturnedWork {
    ReturnedWork::Direct(RoutedPart { group, engine, plans })
}
