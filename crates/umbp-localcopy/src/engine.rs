//! The engine: plans under [`LocalCopyRules`] and executes plan sets before `submit` returns.
//!
//! The steps of a submit are documented on [`LocalCopyEngine`], where callers read them.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, PoisonError};

use umbp_plan::{
    plan_batch, Endpoint, EndpointId, EndpointRegistry, EndpointRelease, EndpointTable, Failure,
    FailureCause, Fragment, IncrementalBuilder, OverlapCheck, Plan, PlanBuilder, PlanRules,
    PlanSet, Register, RegisterError, Space, TransferEngine, TransferHandle,
};

use crate::copy::{run_tasks, HostRegion, Kernel, Task};
use crate::pool::Pool;
use crate::{Error, LocalCopyBuilder, LocalCopyConfig, LocalCopyRules};

/// The engine's name in logs and [`Failure`]s.
const NAME: &str = "localcopy";

/// Segments longer than this are copied as pieces of this size, claimed independently.
const PIECE_BYTES: usize = 1 << 20;

/// Scratch buffers kept for reuse between submits (one per concurrent submitter, up to this).
const SCRATCH_KEPT: usize = 8;

/// The host-to-host copy engine.
///
/// It carries exactly the pairs where both endpoints are host memory
/// ([`LocalCopyRules`]). Its plan builder is the `umbp-plan` incremental builder
/// ([`incremental_builder`](Self::incremental_builder), or boxed through
/// [`TransferEngine::builder`]). [`submit`](TransferEngine::submit) copies every segment
/// before it returns, on the calling thread and a pool of worker threads started once with
/// the engine, and returns an already settled [`TransferHandle`] (waiting is immediate and
/// idempotent, dropping it is free). [`transfer_batch`](Self::transfer_batch) plans and
/// copies a list of transfers in one call.
///
/// Host memory enters through [`Register`] (safely for buffers Rust owns, with a promise for
/// raw memory) and every later access is bounds-checked against the registered region.
///
/// # Submit
///
/// 1. Pin every endpoint the plans use ([`EndpointRegistry::pin`]: a deregistration waits
///    until the copy is done), then look them up in the registry as it is *now* (one
///    snapshot). A plan
///    whose endpoint was deregistered fails with [`FailureCause::EndpointGone`]; one that names
///    a device or file endpoint fails with [`FailureCause::NotAccepted`].
/// 2. Bounds-check every segment against its endpoints and turn it into a copy task; a plan
///    with one bad segment fails whole (`NotAccepted`, nothing of it written).
/// 3. Before any of that, apply the overlap rule ([`OverlapCheck`]): an object whose bytes
///    are written by two fragments of the submit, or written by one and read by another (an
///    endpoint copied onto itself), fails with [`FailureCause::Overlap`] and nothing of it is
///    written; the other objects run. Two ranges per plan settle the usual case; only when
///    those meet is every object's share checked. So the tasks that run never share a written
///    byte, which is what lets them run in any order, on any thread.
/// 4. Otherwise run the tasks: on the calling thread alone when the submit is small (fewer
///    bytes than [`LocalCopyConfig::parallel_threshold`], or fewer than two pieces of work),
///    else on the calling thread and the pool's workers together. Pieces are the segments,
///    with those longer than 1 MiB split into 1 MiB pieces, so that even one huge segment
///    spreads over the threads.
/// 5. Return a settled handle: every byte has arrived (or its plan failed) before `submit`
///    returns.
#[derive(Debug)]
pub struct LocalCopyEngine {
    registry: Arc<EndpointRegistry>,
    /// The configuration in effect (threads clamped to the machine).
    config: LocalCopyConfig,
    kernel: Kernel,
    pool: Pool,
    scratch: Mutex<Vec<Scratch>>,
}

/// Buffers one submit needs, kept between submits so a steady stream allocates nothing.
#[derive(Debug, Default)]
struct Scratch {
    tasks: Vec<Task>,
    /// Tasks on their way to being split into pieces.
    pieces: Vec<Task>,
    overlap: OverlapCheck,
}

impl LocalCopyEngine {
    /// An engine over `registry` with the default [`LocalCopyConfig`]. To take the settings
    /// from the environment, say so: `with_config(registry, LocalCopyConfig::from_env()?)`.
    pub fn new(registry: Arc<EndpointRegistry>) -> Self {
        Self::with_config(registry, LocalCopyConfig::default())
    }

    /// An engine over `registry` with `config`. Starts `threads - 1` worker threads (after
    /// clamping `threads` to the machine); they live as long as the engine.
    pub fn with_config(registry: Arc<EndpointRegistry>, config: LocalCopyConfig) -> Self {
        let available = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        let mut config = config;
        config.threads = config.threads.clamp(1, available);
        let pool = Pool::new(config.threads - 1);
        config.threads = pool.workers() + 1;
        let kernel = Kernel::new(config.non_temporal, config.non_temporal_threshold);
        tracing::debug!(
            threads = config.threads,
            parallel_threshold = config.parallel_threshold,
            non_temporal = kernel.non_temporal(),
            non_temporal_threshold = config.non_temporal_threshold,
            "local copy engine started"
        );
        Self { registry, config, kernel, pool, scratch: Mutex::new(Vec::new()) }
    }

    /// The configuration in effect: `threads` is what the engine really runs with.
    pub fn config(&self) -> &LocalCopyConfig {
        &self.config
    }

    /// Whether large segments are copied with non-temporal stores (enabled in the
    /// configuration and supported by this CPU).
    pub fn uses_non_temporal_stores(&self) -> bool {
        self.kernel.non_temporal()
    }

    /// The registry the engine looks endpoints up in.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    /// A new incremental plan builder for this engine, as its concrete type: the fast path for
    /// callers that push many fragments (see [`LocalCopyBuilder`]).
    pub fn incremental_builder(&self) -> LocalCopyBuilder {
        IncrementalBuilder::new(LocalCopyRules, Arc::clone(&self.registry))
    }

    fn take_scratch(&self) -> Scratch {
        self.scratch.lock().unwrap_or_else(PoisonError::into_inner).pop().unwrap_or_default()
    }

    fn keep_scratch(&self, scratch: Scratch) {
        let mut kept = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.len() < SCRATCH_KEPT {
            kept.push(scratch);
        }
    }

    /// Steps 1 to 4 of a submit (see the type's doc): takes overlapping objects out of `plans`,
    /// copies every plan it can and returns the failures. With a checksum sink in `plans`,
    /// each object's pieces are copied apart, hashed on the way, and reported to it.
    fn execute(
        &self,
        plans: &mut PlanSet,
        table: &EndpointTable,
        scratch: &mut Scratch,
    ) -> Vec<Failure> {
        let mut failures = scratch.overlap.exclude(plans, NAME, |id| {
            table.get(id).filter(|e| e.is_host()).map(|e| (Space::Host, e.addr()))
        });
        let hashing = plans.copy_hashes().is_some();
        let mut bytes = 0usize;
        for (index, plan) in plans.plans().iter().enumerate() {
            let pushed = regions_of(table, plan.src(), plan.dst()).and_then(|(src, dst)| {
                let hashing = hashing.then_some(index);
                push_tasks(plan, hashing, &src, &dst, &mut scratch.tasks)
            });
            match pushed {
                Ok(plan_bytes) => bytes = bytes.saturating_add(plan_bytes),
                Err(cause) => failures.push(failure(plan, cause)),
            }
        }

        let tasks = scratch.tasks.len();
        let splits = scratch.tasks.iter().any(|t| t.len() > PIECE_BYTES);
        let pieces = if splits { bytes.div_ceil(PIECE_BYTES).max(tasks) } else { tasks };
        // Reports the hashing tasks' checksums to the plan set's sink, once they all ran.
        let report = |tasks: &[Task]| {
            let Some(sink) = plans.copy_hashes() else { return };
            for hashed in tasks.iter().filter_map(Task::hashed) {
                sink.copied(&plans.plans()[hashed.plan], hashed.tag, hashed.piece, hashed.crc());
            }
        };
        if pieces < 2 || bytes < self.config.parallel_threshold || self.pool.workers() == 0 {
            run_tasks(&scratch.tasks, self.kernel);
            report(&scratch.tasks);
        } else {
            if splits {
                scratch.pieces.append(&mut scratch.tasks);
                for task in scratch.pieces.drain(..) {
                    task.split(PIECE_BYTES, |piece| scratch.tasks.push(piece));
                }
            }
            let tasks = std::mem::take(&mut scratch.tasks);
            scratch.tasks = self.pool.run(tasks, self.kernel, report);
        }
        scratch.tasks.clear();
        tracing::trace!(
            plans = plans.plans().len(),
            tasks,
            bytes,
            failed = failures.len(),
            "copied"
        );
        failures
    }
}

/// Host memory registers as everywhere else ([`Register`]); the engine prepares nothing for it.
/// Memory it cannot copy (device memory, files) registers too, and its transfers are refused at
/// planning.
impl Register for LocalCopyEngine {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.registry
    }

    fn prepare(
        &self,
        _: EndpointId,
        _: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        Ok(None)
    }
}

impl TransferEngine for LocalCopyEngine {
    fn name(&self) -> &str {
        NAME
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        LocalCopyRules.carries(src, dst)
    }

    /// Every pair it carries: its copies run on the CPU, which hashes the bytes on the way.
    fn hashes_while_copying(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        LocalCopyRules.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&LocalCopyRules, &self.registry.snapshot(), fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(self.incremental_builder())
    }

    /// Copies every segment of `plans` before returning; see [the steps](LocalCopyEngine#submit)
    /// for the checks. The handle is settled: [`TransferHandle::wait`] returns the failures at once
    /// and as often as asked, and dropping the handle does not block.
    fn submit(&self, mut plans: PlanSet) -> TransferHandle {
        if plans.expired() {
            let failures = plans.fail_all(NAME, FailureCause::TimedOut);
            return TransferHandle::settled(failures, plans);
        }
        // A deregistration waits for this copy; the plans resolve in the pinned table.
        let pins = self.registry.pin(plans.endpoints());
        let mut scratch = self.take_scratch();
        let failures = self.execute(&mut plans, pins.table(), &mut scratch);
        self.keep_scratch(scratch);
        TransferHandle::settled(failures, plans)
    }
}

/// The regions of a plan's two endpoints as registered now, or why the plan cannot run.
fn regions_of(
    table: &EndpointTable,
    src: EndpointId,
    dst: EndpointId,
) -> Result<(HostRegion, HostRegion), FailureCause> {
    let region = |id: EndpointId| {
        let endpoint = table.get(id).ok_or(FailureCause::EndpointGone(id))?;
        HostRegion::of(endpoint).ok_or_else(|| {
            FailureCause::NotAccepted(Error::NotHostMemory { endpoint: id }.to_string())
        })
    };
    Ok((region(src)?, region(dst)?))
}

/// Appends a task for every segment of `plan` (with `hashing`, the plan's index: a hashing
/// task for every object's piece of a segment) and returns the plan's bytes. A segment outside
/// its endpoints takes the plan's tasks back out: a plan runs whole or not at all.
fn push_tasks(
    plan: &Plan,
    hashing: Option<usize>,
    src: &HostRegion,
    dst: &HostRegion,
    tasks: &mut Vec<Task>,
) -> Result<usize, FailureCause> {
    let start = tasks.len();
    let mut bytes = 0usize;
    for (index, segment) in plan.segments().iter().enumerate() {
        let Some(task) = Task::resolve(src, dst, segment) else {
            tasks.truncate(start);
            let error = Error::SegmentOutOfBounds {
                src: plan.src(),
                dst: plan.dst(),
                src_offset: segment.src_offset,
                dst_offset: segment.dst_offset,
                len: segment.len,
            };
            return Err(FailureCause::NotAccepted(error.to_string()));
        };
        bytes = bytes.saturating_add(task.len());
        match hashing {
            None => tasks.push(task),
            Some(p) => {
                for (tag, piece) in plan.segment_pieces(index) {
                    // Inside the segment, which `resolve` checked just now.
                    let Some(task) = Task::resolve(src, dst, &piece) else { continue };
                    tasks.push(task.hashing(p, tag, piece));
                }
            }
        }
    }
    Ok(bytes)
}

/// The failure of `plan`: every object it carries.
#[cold]
fn failure(plan: &Plan, cause: FailureCause) -> Failure {
    tracing::debug!(src = plan.src().raw(), dst = plan.dst().raw(), %cause, "plan failed");
    plan.fail(NAME, cause)
}
