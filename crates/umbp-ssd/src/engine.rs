//! The engine: configuration, file endpoints, planning and submission.

use std::sync::Arc;

use umbp_plan::{
    plan_batch, Endpoint, EndpointId, EndpointRegistry, EndpointRelease, EngineError, Fragment,
    IncrementalBuilder, PlanBuilder, PlanRules, PlanSet, Register, RegisterError, TransferEngine,
    TransferHandle,
};

use crate::batch::Limits;
use crate::fault::Faults;
use crate::file::FileTable;
use crate::ring::Ring;
use crate::sys;
use crate::worker::{Shared, Workers};
use crate::{Backend, Error, FileInfo, SsdConfig, SsdRules};

/// The io_uring engine for transfers between file endpoints and host memory.
///
/// - It carries file → host (restore) and host → file (offload) pairs; builders reject every
///   other pair.
/// - [`submit`](TransferEngine::submit) queues the plan set for a worker and returns a pending
///   [`TransferHandle`] at once (an empty plan set settles at once). The handle's rules hold:
///   waiting is idempotent, and dropping a handle waits for its batch.
/// - Each plan's endpoints are looked up again at submit and every segment is bounds-checked
///   against them; a plan whose endpoint was deregistered fails with
///   [`FailureCause::EndpointGone`](umbp_plan::FailureCause::EndpointGone).
/// - Failures are per segment and carry exactly the tags of the objects in that segment
///   ([`Plan::segment_tags`](umbp_plan::Plan::segment_tags)): a failed read costs only its
///   objects, and one plan's failure never stops the others.
///
/// Dropping the engine lets every queued batch finish, then stops the workers.
#[derive(Debug)]
pub struct SsdEngine {
    shared: Arc<Shared>,
    rules: SsdRules,
    backend: Backend,
    queue_depth: u32,
    workers: Workers,
}

impl SsdEngine {
    /// An engine over the endpoints of `registry`, running as `config` says. Creates every
    /// worker's ring up front, so a refused io_uring shows here: with [`Backend::Auto`] the
    /// engine falls back to `pread`/`pwrite` and logs that once, with [`Backend::IoUring`] it
    /// fails with [`Error::RingUnavailable`].
    pub fn new(registry: Arc<EndpointRegistry>, config: SsdConfig) -> Result<Self, Error> {
        if !(1..=4096).contains(&config.queue_depth) {
            return Err(Error::InvalidConfig("the queue depth must lie in 1..=4096"));
        }
        if config.max_segment == 0 {
            return Err(Error::InvalidConfig("the maximum segment must be at least one byte"));
        }
        if !(1..=256).contains(&config.workers) {
            return Err(Error::InvalidConfig("the worker count must lie in 1..=256"));
        }
        if config.worker_cpus.iter().any(|&cpu| cpu >= sys::MAX_CPUS) {
            return Err(Error::InvalidConfig("a worker CPU must be below 1024"));
        }
        // Whether io_uring works here, asked once on this thread; each worker then sets up
        // its own ring.
        let backend = match config.backend {
            Backend::Blocking => Backend::Blocking,
            wanted => match Ring::new(config.queue_depth) {
                Ok(_) => Backend::IoUring,
                Err(source) if wanted == Backend::IoUring => {
                    return Err(Error::RingUnavailable { source });
                }
                Err(error) => {
                    tracing::warn!(
                        engine = %config.name,
                        %error,
                        "io_uring is unavailable; falling back to pread/pwrite"
                    );
                    Backend::Blocking
                }
            },
        };
        let limits = Limits { max_io: config.max_segment, bounce_budget: config.bounce_budget };
        let shared = Arc::new(Shared {
            registry,
            files: FileTable::default(),
            faults: Arc::new(Faults::new()),
            limits,
            sectors: crate::sectors::Sectors::process(),
            name: config.name,
            overlap: Default::default(),
        });
        let workers = Workers::start(
            Arc::clone(&shared),
            backend,
            config.queue_depth,
            config.workers,
            &config.worker_cpus,
        )?;
        Ok(Self {
            shared,
            rules: SsdRules::new(config.max_segment),
            backend,
            queue_depth: config.queue_depth,
            workers,
        })
    }

    /// The registry whose endpoints the engine reads and writes.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared.registry
    }

    /// The executor in use: [`Backend::IoUring`] or [`Backend::Blocking`].
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Requests each worker keeps in flight.
    pub fn queue_depth(&self) -> u32 {
        self.queue_depth
    }

    /// The engine's planning rules.
    pub fn rules(&self) -> SsdRules {
        self.rules
    }

    /// The engine's incremental builder as its concrete type, for callers that use its
    /// [`Run`](umbp_plan::Run)s. [`TransferEngine::builder`] returns the same builder boxed.
    pub fn incremental_builder(&self) -> IncrementalBuilder<SsdRules> {
        IncrementalBuilder::new(self.rules, Arc::clone(&self.shared.registry))
    }

    /// What the engine knows about file endpoint `id`: registered through the engine (or a
    /// composite over it), or used by a submitted batch.
    pub fn file_info(&self, id: EndpointId) -> Option<FileInfo> {
        self.shared.files.info(id)
    }

    /// Arms a fault: matching operations fail with its errno instead of reaching the kernel.
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self, fault: crate::IoFault) {
        self.shared.faults.inject(fault);
    }

    /// Disarms every fault.
    #[cfg(feature = "fault-injection")]
    pub fn clear_faults(&self) {
        self.shared.faults.clear();
    }
}

/// Files register as everywhere else ([`Register`]): the engine inspects the descriptor (its
/// `O_DIRECT` flag, its block size) at once, so a bad one is refused here, and forgets it when
/// the registration ends. Host memory needs no preparation.
impl Register for SsdEngine {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared.registry
    }

    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        let Some(range) = endpoint.file_range() else { return Ok(None) };
        self.shared
            .files
            .register(id, range)
            .map_err(|source| RegisterError::Inspect { fd: range.fd, source })?;
        Ok(Some(Arc::clone(&self.shared) as Arc<dyn EndpointRelease>))
    }
}

impl TransferEngine for SsdEngine {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.rules.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&self.rules, &self.shared.registry.snapshot(), fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(self.incremental_builder())
    }

    /// Queues `plans` for a worker; see [`TransferHandle`] for waiting and dropping.
    fn submit(&self, plans: PlanSet) -> TransferHandle {
        self.workers.submit(plans)
    }

    /// Inspects a file endpoint registered through a composite, as [`Register`] does.
    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        match Register::prepare(self, id, endpoint) {
            Ok(_) => Ok(()),
            Err(e) => Err(Box::new(e)),
        }
    }

    /// Forgets a file endpoint deregistered through a composite.
    fn endpoint_deregistering(&self, id: EndpointId) {
        self.shared.files.retire(id);
    }
}
