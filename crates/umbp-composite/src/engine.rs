//! The composite engine: engines in preference order, registration fan-out, and the
//! non-blocking submit onto the composite's executor.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use umbp_plan::{
    Endpoint, EndpointId, EndpointRegistry, EndpointRelease, Register, RegisterError,
    TransferEngine,
};

use crate::batch::{Batch, BatchShared, Prepared};
use crate::error::Error;
use crate::executor::{panic_message, run_lane, run_stage, Executor};
use crate::integrity::{ChecksPlan, ChecksumPolicy};
use crate::metrics::{InFlightSnapshot, Metrics, MetricsSnapshot};
use crate::routed::{RoutedPart, RoutedPlans};
use crate::shared::{Shared, StageJob};
use crate::staging::{cut_stages, BouncePool, Staging};

/// How a composite runs its batches: plain data, written as a struct literal over the
/// default, as every umbp engine's configuration is:
///
/// ```
/// # use umbp_composite::CompositeConfig;
/// let config = CompositeConfig { workers: 4, ..CompositeConfig::default() };
/// # assert!(!config.buffered_builders);
/// ```
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CompositeConfig {
    /// Executor threads, started once at the first submit. Each runs one engine's lane of one
    /// batch, or one stage of the staged route, at a time, and blocks while its engine works;
    /// so this bounds how many engine submits run at once across all callers. Default: 8.
    /// (One more thread, the deadline watcher, starts with them; work waiting for a thread
    /// still settles at once when its batch is cancelled or its deadline passes.)
    pub workers: usize,
    /// Gives every engine the buffered builder (collect, then plan at finish) instead of its
    /// own: the baseline the incremental path is measured against. Default: `false`.
    pub buffered_builders: bool,
    /// Which objects of [`start_restore`](crate::start_restore) and
    /// [`start_offload`](crate::start_offload) batches get a CRC32C: offloads report it,
    /// restores given one verify it. Default: [`ChecksumPolicy::FilesAndRemote`] (SSD and
    /// remote tiers), whose cost is a small share of those tiers' restore time; DRAM
    /// restores verify with [`ChecksumPolicy::AllTiers`] (see the crate README for the
    /// measured costs).
    pub checksums: ChecksumPolicy,
}

impl Default for CompositeConfig {
    fn default() -> Self {
        Self { workers: 8, buffered_builders: false, checksums: ChecksumPolicy::default() }
    }
}

/// Holds engines in preference order, routes every fragment to the first that claims it, and
/// runs batches on its own executor; see the [crate docs](crate).
///
/// A handle: clones share the engines, the executor, the staged route and the metrics, and
/// every [`CompositeBuilder`](crate::CompositeBuilder) holds one, so a builder can live anywhere (in a struct beside
/// the composite, in a `thread_local!`). When the last handle goes, it waits for every batch
/// in flight, then stops the executor.
#[derive(Clone)]
pub struct CompositeEngine {
    core: Arc<Core>,
}

/// What the handles of one composite share.
struct Core {
    id: u64,
    shared: Arc<Shared>,
    config: CompositeConfig,
    /// Started at the first submit, so composites that are only configured or only plan spawn
    /// nothing.
    executor: Mutex<Option<Executor>>,
}

/// Tells composites apart, so that one never runs plans another's builder made.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl CompositeEngine {
    /// A composite over `engines`, in preference order, naming endpoints in `registry`, with the
    /// default [`CompositeConfig`]. The engines must name endpoints in the same registry.
    pub fn new(registry: Arc<EndpointRegistry>, engines: Vec<Arc<dyn TransferEngine>>) -> Self {
        Self::with_config(registry, engines, CompositeConfig::default())
    }

    /// [`new`](Self::new) with `config`.
    pub fn with_config(
        registry: Arc<EndpointRegistry>,
        engines: Vec<Arc<dyn TransferEngine>>,
        config: CompositeConfig,
    ) -> Self {
        let shared = Shared {
            engines,
            registry,
            staging: OnceLock::new(),
            buffered: config.buffered_builders,
            metrics: Arc::new(Metrics::default()),
        };
        let core = Core {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shared: Arc::new(shared),
            config,
            executor: Mutex::new(None),
        };
        Self { core: Arc::new(core) }
    }

    /// Enables the staged route through `staging.bounce`, which must be a registered host
    /// endpoint (registered through this composite, usually) of at least two bytes, with a
    /// non-zero stage size. The route is set once, before the batches that need it: a second
    /// call is [`Error::BadBounce`].
    ///
    /// A pair no engine carries alone but two carry through host memory (file -> device, say)
    /// is rejected with `PairNotHandled` until this is called.
    pub fn set_staging(&self, staging: Staging) -> Result<(), Error> {
        match self.shared().registry.get(staging.bounce) {
            Some(e) if e.is_host() && e.len() >= 2 && staging.stage_bytes > 0 => {
                let pool = BouncePool::new(staging, e.len());
                self.shared().staging.set(pool).map_err(|_| Error::BadBounce(staging.bounce))
            }
            _ => Err(Error::BadBounce(staging.bounce)),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.core.shared
    }

    pub(crate) fn id(&self) -> u64 {
        self.core.id
    }

    /// Whether engines get the buffered builder ([`CompositeConfig::buffered_builders`]).
    pub(crate) fn buffered(&self) -> bool {
        self.shared().buffered
    }

    /// Engine `i`'s name, even if asking the engine panics.
    pub(crate) fn engine_name(&self, i: usize) -> String {
        self.shared().engine_name(i)
    }

    /// The engines, in preference order.
    pub fn engines(&self) -> &[Arc<dyn TransferEngine>] {
        &self.shared().engines
    }

    /// The shared registry.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared().registry
    }

    /// The staged route's configuration, if any.
    pub fn staging(&self) -> Option<Staging> {
        self.shared().staging.get().map(|p| p.staging)
    }

    /// The bounce region of the staged route, if configured.
    pub fn bounce(&self) -> Option<EndpointId> {
        self.staging().map(|s| s.bounce)
    }

    /// The executor's configuration.
    pub fn config(&self) -> CompositeConfig {
        self.core.config
    }

    /// The composite's metrics: counters, latency histograms and in-flight gauges, one
    /// Prometheus registry per composite (see [`Metrics`]).
    pub fn metrics(&self) -> &Metrics {
        &self.shared().metrics
    }

    /// Every metric in the Prometheus text format, for a scraper ([`Metrics::render`]).
    pub fn metrics_text(&self) -> String {
        self.shared().metrics.render()
    }

    /// Counters per engine and direction, read back from the metrics
    /// ([`Metrics::snapshot`]).
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        self.shared().metrics.snapshot()
    }

    /// Batches submitted and not yet settled, and the bytes they move.
    pub fn in_flight(&self) -> InFlightSnapshot {
        self.shared().metrics.in_flight.snapshot()
    }

    /// Starts a batch and returns its handle at once: every engine's lane and every stage of
    /// the staged route run on the composite's executor, engines side by side, layer groups in
    /// order on each engine. Objects are named by their tags; see [`Batch`] for polling,
    /// waiting, layer groups and cancelling.
    ///
    /// Errors: [`Error::ForeignPlans`] for plans another composite's builder made;
    /// [`Error::Executor`] if no executor thread could be started.
    pub fn submit(&self, plans: RoutedPlans) -> Result<Batch, Error> {
        self.start(plans, None, None)
    }

    /// [`submit`](Self::submit) for a batch whose tags are the positions `0 .. keys.len()`,
    /// reported under the caller's `keys`, with the objects' layout for checksums, if any.
    pub(crate) fn start(
        &self,
        plans: RoutedPlans,
        keys: Option<Vec<u64>>,
        checks: Option<ChecksPlan>,
    ) -> Result<Batch, Error> {
        let Core { id, shared, config, executor } = &*self.core;
        if plans.composite != *id {
            return Err(Error::ForeignPlans);
        }
        let span = tracing::info_span!(
            "umbp.submit",
            parts = plans.parts.len(),
            staged = plans.staged.len()
        );
        let _enter = span.enter();
        let mut executor = executor.lock().unwrap_or_else(PoisonError::into_inner);
        if executor.is_none() {
            let started = Executor::start(config.workers, Arc::clone(shared));
            *executor = Some(started.map_err(Error::Executor)?);
        }
        let Some(executor) = executor.as_ref() else { unreachable!("started above") };
        tracing::trace!(threads = executor.threads(), "executor");
        let slot = shared.staging.get().map_or(u64::MAX, |p| p.slot_bytes);
        let metrics = Arc::clone(&self.shared().metrics);
        // Every endpoint the batch uses stays registered until the batch settles.
        let staged_endpoints = plans.staged.iter().flat_map(|s| [s.fragment.src, s.fragment.dst]);
        let bounce = self.bounce().filter(|_| !plans.staged.is_empty());
        let pins = shared.registry.pin(
            plans
                .parts
                .iter()
                .flat_map(|p| p.plans.endpoints())
                .chain(staged_endpoints)
                .chain(bounce),
        );
        // Stages into an `O_DIRECT` file end on its blocks where they can.
        let table = Arc::clone(pins.table());
        let direct_file = |id| {
            let file = table.get(id).and_then(|e| e.file_range()).filter(|f| f.direct);
            file.map(|f| f.file_offset)
        };
        let cut = |staged| cut_stages(staged, slot, direct_file);
        let metered = !plans.unmetered;
        let checks = checks.and_then(|c| {
            c.resolve(config.checksums, Arc::clone(&table), Arc::clone(&metrics), metered)
        });
        let registry = Arc::clone(&shared.registry);
        let Prepared { batch, direct, stages } =
            BatchShared::prepare(plans, keys, cut, metrics, pins, checks, registry);

        // One lane per engine, its parts in group order (the builder sorted them so).
        let mut lanes: Vec<Vec<(usize, RoutedPart)>> = Vec::new();
        for (index, part) in direct {
            match lanes.iter_mut().find(|l| l[0].1.engine == part.engine) {
                Some(lane) => lane.push((index, part)),
                None => lanes.push(vec![(index, part)]),
            }
        }
        for lane in lanes {
            let (shared, batch) = (Arc::clone(shared), Arc::clone(&batch));
            executor.spawn(Box::new(move || run_lane(&shared, &batch, lane)));
        }
        for (part, fragments) in stages {
            let job =
                StageJob { shared: Arc::clone(shared), batch: Arc::clone(&batch), part, fragments };
            executor.spawn(Box::new(move || run_stage(job)));
        }
        if let Some(deadline) = batch.deadline() {
            executor.watch(deadline, &batch);
        }
        Ok(Batch::new(batch))
    }
}

impl Drop for Core {
    /// The last handle went: waits for every batch still in flight, then stops the executor.
    fn drop(&mut self) {
        self.shared.metrics.in_flight.wait_idle();
        let executor = self.executor.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        drop(executor);
    }
}

impl std::fmt::Debug for CompositeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompositeEngine")
            .field(
                "engines",
                &(0..self.shared().engines.len()).map(|i| self.engine_name(i)).collect::<Vec<_>>(),
            )
            .field("staging", &self.staging())
            .field("config", &self.core.config)
            .finish()
    }
}

/// Memory and files register once for every engine of the composite ([`Register`]): each
/// engine prepares for the endpoint ([`TransferEngine::endpoint_registered`]: the device
/// engine pins host memory, the SSD engine inspects a file); if one refuses, the engines told
/// so far release it again and nothing remains. When the registration ends, after the batches
/// that use the endpoint, every engine releases what it held.
impl Register for CompositeEngine {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared().registry
    }

    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        let engines = &self.shared().engines;
        for (i, e) in engines.iter().enumerate() {
            let told = catch_unwind(AssertUnwindSafe(|| e.endpoint_registered(id, endpoint)));
            let refusal = match told {
                Ok(Ok(())) => continue,
                Ok(Err(source)) => source,
                Err(panic) => format!("panicked: {}", panic_message(&*panic)).into(),
            };
            self.shared().release_in(id, i);
            let engine = self.shared().engine_name(i);
            return Err(RegisterError::Engine { engine, source: refusal });
        }
        Ok(Some(Arc::clone(self.shared()) as Arc<dyn EndpointRelease>))
    }
}
