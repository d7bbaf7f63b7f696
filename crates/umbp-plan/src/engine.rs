//! The transfer-engine trait, transfer handles and failures.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::{
    BufferedPlanBuilder, DeviceOrdinal, Endpoint, EndpointId, Fragment, PlanBuilder, PlanSet, Tag,
};

/// An engine that moves bytes between some kinds of endpoints.
///
/// An engine names the pairs it carries ([`can_handle`](Self::can_handle)), plans a batch of
/// fragments ([`plan`](Self::plan), the meaning every builder of the engine must reproduce),
/// hands out a plan builder, and executes plan sets ([`submit`](Self::submit)).
pub trait TransferEngine: Send + Sync {
    /// A short name for logs, metrics and failures.
    fn name(&self) -> &str;

    /// Whether the engine carries bytes from `src` to `dst`.
    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool;

    /// The batch planner: plans `fragments` at once. See [`plan_batch`](crate::plan_batch).
    fn plan(&self, fragments: &[Fragment]) -> PlanSet;

    /// A plan builder for this engine. The default is a [`BufferedPlanBuilder`] over
    /// [`plan`](Self::plan); engines with an incremental builder return that instead.
    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(BufferedPlanBuilder::new(self))
    }

    /// Tells the engine that `id` was registered for every engine of a composite: an engine
    /// that prepares its endpoints (pins host memory for its device, opens or inspects a file)
    /// does it here. Called once per registration. Default: nothing to do.
    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        let _ = (id, endpoint);
        Ok(())
    }

    /// Tells the engine that `id` was deregistered through a composite: no submitted batch uses
    /// it any more and none can (the registry waited for them, see
    /// [`EndpointRegistry::deregister`](crate::EndpointRegistry::deregister)), so the engine
    /// undoes what [`endpoint_registered`](Self::endpoint_registered) did (unpins, closes).
    /// Default: nothing to do.
    fn endpoint_deregistering(&self, id: EndpointId) {
        let _ = id;
    }

    /// Whether the engine hashes the bytes it moves from `src` to `dst` while it copies them.
    /// If so, for a plan set that carries a [`CopyHashes`](crate::checksum::CopyHashes) sink,
    /// it reports the CRC32C of the source bytes of every object's piece it copies between
    /// such endpoints, before the submit's handle completes, so that whoever verifies the
    /// bytes need not read them again. Every byte of an object that does not fail is reported
    /// exactly once; the pieces of objects that fail may be reported or not. Default: `false`
    /// (engines whose bytes the CPU never touches, such as a GPU's DMA or the kernel's I/O).
    fn hashes_while_copying(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        let _ = (src, dst);
        false
    }

    /// Starts executing `plans`. Every plan either completes or yields a [`Failure`] naming its
    /// tags; the plan set's rejected tags are the caller's to report. The returned handle
    /// follows the rules of [`TransferHandle`]: waiting is idempotent and dropping waits.
    ///
    /// A panic here or in the handle's [`Completion`] ends the plan set for the caller: a
    /// composite fails its objects, hands its bounce slots to other batches and releases its
    /// endpoints (so their memory may be freed). An engine must therefore not touch a plan
    /// set's memory after panicking with it: finish or cancel what it started before the
    /// panic leaves it, as the SSD engine's ring does for a batch that panics.
    fn submit(&self, plans: PlanSet) -> TransferHandle;
}

/// An engine's own error, boxed so that layers above engines (a composite) can carry it
/// without knowing the engine's type; downcast it to the engine's error type for details.
pub type EngineError = Box<dyn std::error::Error + Send + Sync>;

/// Why a plan (or part of one) failed while executing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FailureCause {
    /// The operating system failed an I/O operation with `errno`.
    #[error("I/O error (errno {errno})")]
    Io {
        /// The raw `errno`.
        errno: i32,
    },
    /// The file ended before the requested bytes.
    #[error("file ended at {got} of {expected} bytes requested at offset {offset}")]
    ShortFile {
        /// File offset of the request.
        offset: u64,
        /// Bytes requested.
        expected: u64,
        /// Bytes the file held.
        got: u64,
    },
    /// The device runtime failed an operation.
    #[error("device {} failed with code {code}: {message}", .device.get())]
    Device {
        /// The device.
        device: DeviceOrdinal,
        /// The runtime's error code.
        code: i32,
        /// The runtime's error message.
        message: String,
    },
    /// An endpoint was deregistered between planning and submit.
    #[error("endpoint {} is no longer registered", .0.raw())]
    EndpointGone(EndpointId),
    /// The engine refused the plan as a whole.
    #[error("not accepted: {0}")]
    NotAccepted(String),
    /// The object's bytes overlap bytes another fragment of the same submit (or the object
    /// itself) writes, or it writes bytes another fragment reads: the batch has no single
    /// meaning there, so the object did not run and nothing of it was written (see
    /// [`OverlapCheck`](crate::OverlapCheck)).
    #[error("its bytes overlap bytes another transfer of the same submit writes")]
    Overlap,
    /// The plan set's [deadline](crate::PlanSet::deadline) passed before the object's bytes
    /// arrived; what was in flight was cancelled, and the object's destination may hold some
    /// of its bytes.
    #[error("the batch's deadline passed")]
    TimedOut,
    /// The plan set's [cancel token](crate::PlanSet::cancel_token) was cancelled before the
    /// object's bytes arrived; what was in flight was cancelled, and the object's destination
    /// may hold some of its bytes.
    #[error("the batch was cancelled")]
    Cancelled,
    /// The remote peer holding the bytes failed, went away or stopped answering: every object
    /// in flight to it fails with this, and nothing else does.
    #[error("peer {peer} failed: {message}")]
    PeerFailed {
        /// The peer, as its engine numbers it ([`RemoteRegion::peer`](crate::RemoteRegion)).
        peer: u32,
        /// What the transport said.
        message: String,
    },
    /// The engine panicked while executing; whatever it was doing fails. The message is the
    /// panic's payload when it was a string.
    #[error("the engine panicked: {message}")]
    Panicked {
        /// The panic message.
        message: String,
    },
    /// The object's bytes arrived but their checksum (CRC32C of the object's ranges, in range
    /// order) is not the one the caller expected: the bytes in the tier are not the bytes
    /// that were saved. The object's destination holds those wrong bytes; use none of them.
    #[error("checksum mismatch: expected crc32c {expected:#010x}, the bytes have {actual:#010x}")]
    ChecksumMismatch {
        /// The checksum the caller gave.
        expected: u32,
        /// The checksum of the bytes that arrived.
        actual: u32,
    },
    /// The caller expected a checksum, but some of the object's bytes took a route where they
    /// never sit in host memory (device to device), so they could not be hashed: the object
    /// fails rather than being served unverified.
    #[error("checksum {expected:#010x} could not be verified: part of the object moved without passing host memory")]
    ChecksumUnverifiable {
        /// The checksum the caller gave.
        expected: u32,
    },
}

impl FailureCause {
    /// A short, stable name of the cause's kind (`"io"`, `"short_file"`, `"device"`,
    /// `"endpoint_gone"`, `"not_accepted"`, `"overlap"`, `"timed_out"`, `"cancelled"`,
    /// `"peer_failed"`, `"panicked"`, `"checksum_mismatch"`, `"checksum_unverifiable"`): what
    /// metrics label failures with and what bindings name them by.
    pub const fn kind_name(&self) -> &'static str {
        match self {
            Self::Io { .. } => "io",
            Self::ShortFile { .. } => "short_file",
            Self::Device { .. } => "device",
            Self::EndpointGone(_) => "endpoint_gone",
            Self::NotAccepted(_) => "not_accepted",
            Self::Overlap => "overlap",
            Self::TimedOut => "timed_out",
            Self::Cancelled => "cancelled",
            Self::PeerFailed { .. } => "peer_failed",
            Self::Panicked { .. } => "panicked",
            Self::ChecksumMismatch { .. } => "checksum_mismatch",
            Self::ChecksumUnverifiable { .. } => "checksum_unverifiable",
        }
    }
}

/// One failed plan, or one failed segment of a plan: the objects whose bytes did not arrive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The engine that ran the plan.
    pub engine: String,
    /// The plan's source endpoint.
    pub src: EndpointId,
    /// The plan's destination endpoint.
    pub dst: EndpointId,
    /// The objects that failed.
    pub tags: Vec<Tag>,
    /// Why.
    pub cause: FailureCause,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: endpoint {} -> endpoint {} ({} objects): {}",
            self.engine,
            self.src.raw(),
            self.dst.raw(),
            self.tags.len(),
            self.cause
        )
    }
}

impl std::error::Error for Failure {}

/// What an engine returns once a submitted plan set is done.
#[derive(Debug, Default)]
pub struct Settled {
    /// Every failure, empty when all plans completed.
    pub failures: Vec<Failure>,
    /// The executed plan set, given back so its buffers can be recycled.
    pub plans: PlanSet,
}

/// Work an engine still has in flight. Engines that finish inside `submit` use
/// [`TransferHandle::settled`] instead.
pub trait Completion: Send {
    /// Whether the work has finished, without blocking.
    fn is_done(&self) -> bool;

    /// Blocks until the work has finished. Called at most once.
    fn wait(&mut self) -> Settled;
}

/// How long a thread about to sleep until another thread hands it something (a waiter on a
/// [`SettleSlot`], an engine's progress thread between completions, umbp-remote's lane
/// writers, readers and server threads between requests) first yields its core and looks
/// again: see [`yield_until`].
///
/// Why: on an idle machine a sleeping thread's wake-up costs about 10 µs more than the work
/// that wakes it (the core leaves its idle state; in a VM the virtual CPU is scheduled again),
/// and a short transfer is a chain of such hand-offs. A single 4 KiB get from a memory node
/// on loopback took 35–37 µs at p50 with every thread sleeping, 22–24 µs with the waiter and
/// the remote engine's progress thread yielding first, and 16–27 µs (against 40–49 the same
/// day) once every thread of the chain did (umbp-remote's README has the runs), while its
/// restores' throughput stayed within noise. A longer wait pays this once.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(50);

/// Yields the core (`sched_yield`) until `ready` holds or `limit` has passed; whether it
/// holds. For a thread about to block on something another thread is about to do: runnable
/// threads get the core meanwhile, and an idle core never sleeps (see [`SPIN_BEFORE_SLEEP`]).
pub fn yield_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::yield_now();
    }
}

/// Where an engine's own thread leaves a settled plan set for its handle: a one-shot slot.
///
/// An engine that executes on threads of its own makes one per submit, hands
/// [`handle`](Self::handle) to the caller and [`fill`](Self::fill)s it once the work is done.
/// Waiting yields the core for up to [`SPIN_BEFORE_SLEEP`], then blocks on a condition
/// variable; [`TransferHandle::is_done`] reads a flag without locking.
#[derive(Debug, Default)]
pub struct SettleSlot {
    settled: Mutex<Option<Settled>>,
    ready: Condvar,
    /// Set (Release) after `settled` is filled; read (Acquire) without locking.
    done: AtomicBool,
}

impl SettleSlot {
    /// An empty slot.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// A pending handle that settles when the slot is filled.
    pub fn handle(self: &Arc<Self>) -> TransferHandle {
        TransferHandle::pending(Box::new(SlotCompletion(Arc::clone(self))))
    }

    /// Settles the slot: its handle's wait returns `settled`. Called once.
    pub fn fill(&self, settled: Settled) {
        *self.lock() = Some(settled);
        self.done.store(true, Ordering::Release);
        self.ready.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, Option<Settled>> {
        // Filling and taking are single stores: a poisoned slot is still consistent.
        self.settled.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The completion behind a [`SettleSlot`]'s handle.
struct SlotCompletion(Arc<SettleSlot>);

impl Completion for SlotCompletion {
    fn is_done(&self) -> bool {
        self.0.done.load(Ordering::Acquire)
    }

    fn wait(&mut self) -> Settled {
        yield_until(SPIN_BEFORE_SLEEP, || self.0.done.load(Ordering::Acquire));
        let mut settled = self.0.lock();
        loop {
            if let Some(settled) = settled.take() {
                return settled;
            }
            settled = self.0.ready.wait(settled).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// The handle of one submitted plan set.
///
/// - [`wait`](Self::wait) blocks until the engine has finished with every plan and returns the
///   failures; calling it again returns the same failures without blocking.
/// - Dropping a handle waits, so memory a transfer reads or writes is never freed under it.
#[must_use = "dropping a handle blocks until its transfers finish"]
pub struct TransferHandle {
    pending: Option<Box<dyn Completion>>,
    /// The pending work is all queued on the plan set's stream.
    on_stream: bool,
    settled: Settled,
}

impl TransferHandle {
    /// A handle for work that already finished.
    pub fn settled(failures: Vec<Failure>, plans: PlanSet) -> Self {
        Self { pending: None, on_stream: false, settled: Settled { failures, plans } }
    }

    /// A handle for work still in flight.
    pub fn pending(completion: Box<dyn Completion>) -> Self {
        Self { pending: Some(completion), on_stream: false, settled: Settled::default() }
    }

    /// A handle for work still in flight whose every remaining step is queued on the plan
    /// set's [stream](crate::PlanSet::stream): work the caller queues there afterwards runs
    /// after it. What a device engine returns for a plan set with a stream.
    pub fn queued_on_stream(completion: Box<dyn Completion>) -> Self {
        Self { pending: Some(completion), on_stream: true, settled: Settled::default() }
    }

    /// Whether the work is done or queued on the plan set's stream, without blocking: from
    /// then on, work queued on that stream is ordered after it.
    pub fn is_queued(&self) -> bool {
        self.on_stream || self.is_done()
    }

    /// Whether the work has finished, without blocking.
    pub fn is_done(&self) -> bool {
        self.pending.as_ref().is_none_or(|c| c.is_done())
    }

    /// Blocks until every plan has finished and returns the failures. Idempotent.
    pub fn wait(&mut self) -> &[Failure] {
        if let Some(mut completion) = self.pending.take() {
            self.settled = completion.wait();
        }
        &self.settled.failures
    }

    /// Waits, then returns the failures and the plan set (for [`PlanBuilder::recycle`]).
    pub fn into_settled(mut self) -> Settled {
        self.wait();
        std::mem::take(&mut self.settled)
    }
}

impl fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferHandle")
            .field("pending", &self.pending.is_some())
            .field("failures", &self.settled.failures)
            .finish()
    }
}

impl Drop for TransferHandle {
    fn drop(&mut self) {
        self.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yield_until_returns_once_ready_or_after_its_limit() {
        let mut asked = 0;
        assert!(yield_until(Duration::from_secs(3600), || {
            asked += 1;
            asked == 5
        }));
        assert_eq!(asked, 5);
        let start = Instant::now();
        assert!(!yield_until(Duration::from_millis(2), || false));
        assert!(start.elapsed() >= Duration::from_millis(2));
        // Ready at once: not a single yield.
        assert!(yield_until(Duration::ZERO, || true));
    }

    #[test]
    fn a_slot_filled_by_another_thread_after_the_spin_wakes_its_waiter() {
        let slot = SettleSlot::new();
        let mut handle = slot.handle();
        let filler = std::thread::spawn(move || {
            // Past the waiter's spin: the condition variable must wake it.
            std::thread::sleep(SPIN_BEFORE_SLEEP * 20);
            slot.fill(Settled { failures: Vec::new(), plans: PlanSet::default() });
        });
        assert!(handle.wait().is_empty());
        filler.join().unwrap();
    }
}
