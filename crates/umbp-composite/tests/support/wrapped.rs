//! An engine that wraps a real one and misbehaves on demand: slow submits, submits held at a
//! gate, panics on chosen objects or when an endpoint is released, refusals at `finish` (a
//! buffered builder), and a log of what each submit carried and which endpoints it was told to
//! release.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use umbp_plan::{
    plan_batch, BufferedPlanBuilder, CancelToken, Endpoint, EndpointId, EndpointRegistry,
    EngineError, FailureCause, Fragment, PlanBuilder, PlanRules, PlanSet, RejectReason, Tag,
    TransferEngine, TransferHandle,
};

/// Holds every submit of a gated engine, as a job that runs for up to [`Gate::HOLD`] would,
/// until opened, or until the submitted plan set's cancel token is cancelled: the engine then
/// cancels, as the SSD engine cancels its I/O, failing the objects with `Cancelled`.
pub(crate) struct Gate {
    /// Whether open, and how many submits came to the gate.
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Gate {
    /// How long a closed gate holds a submit at most.
    pub(crate) const HOLD: Duration = Duration::from_secs(15);

    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self { state: Mutex::new((false, 0)), changed: Condvar::new() })
    }

    pub(crate) fn open(&self) {
        self.state.lock().unwrap().0 = true;
        self.changed.notify_all();
    }

    /// Blocks until `n` submits came to the gate (panics after 10 s).
    pub(crate) fn wait_arrivals(&self, n: usize) {
        let state = self.state.lock().unwrap();
        let (state, timeout) =
            self.changed.wait_timeout_while(state, Duration::from_secs(10), |s| s.1 < n).unwrap();
        assert!(!timeout.timed_out(), "{} of {n} submits came to the gate", state.1);
    }

    /// Holds a submit until the gate opens or [`HOLD`](Self::HOLD) passes (`false`), or
    /// `token` is cancelled (`true`).
    fn pass(self: &Arc<Self>, token: Option<&CancelToken>) -> bool {
        if let Some(token) = token {
            let gate = Arc::clone(self);
            token.on_cancel(Box::new(move || {
                let _state = gate.state.lock().unwrap();
                gate.changed.notify_all();
            }));
        }
        let cancelled = || token.is_some_and(CancelToken::is_cancelled);
        let mut state = self.state.lock().unwrap();
        state.1 += 1;
        self.changed.notify_all();
        let (_state, _) =
            self.changed.wait_timeout_while(state, Self::HOLD, |s| !s.0 && !cancelled()).unwrap();
        cancelled()
    }
}

/// What one submit carried and when it started and ended.
#[derive(Clone, Debug)]
pub(crate) struct SubmitRecord {
    pub(crate) tags: Vec<Tag>,
    pub(crate) started: Instant,
    pub(crate) ended: Instant,
}

pub(crate) struct Wrapped {
    pub(crate) inner: Arc<dyn TransferEngine>,
    /// The registry the inner engine names endpoints in.
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) name: String,
    /// Each submit sleeps this long before the inner engine runs.
    pub(crate) delay: Duration,
    /// Each submit waits at this gate before the inner engine runs.
    pub(crate) gate: Option<Arc<Gate>>,
    /// A submit whose plans carry one of these objects panics (before any byte moves).
    pub(crate) panic_on: Mutex<HashSet<Tag>>,
    /// When set, the engine plans with a buffered builder whose planner refuses the fragments
    /// this length divides evenly (so rejections appear only at `finish`).
    pub(crate) refuse_len_multiple_of: Option<u64>,
    /// When set, the engine's builder panics on the first push of this object.
    pub(crate) builder_panics_on: Option<Tag>,
    /// When set, the engine panics when told an endpoint is released (after logging it).
    pub(crate) release_panics: bool,
    /// While set, the next builder's `finish` fails with an error it may not give (and
    /// clears it).
    pub(crate) finish_fails_once: AtomicBool,
    pub(crate) log: Mutex<Vec<SubmitRecord>>,
    /// The endpoints it was told are released, in order.
    pub(crate) released: Mutex<Vec<EndpointId>>,
}

impl Wrapped {
    pub(crate) fn new(
        inner: Arc<dyn TransferEngine>,
        registry: Arc<EndpointRegistry>,
        name: &str,
    ) -> Self {
        Self {
            inner,
            registry,
            name: name.into(),
            delay: Duration::ZERO,
            gate: None,
            panic_on: Mutex::new(HashSet::new()),
            refuse_len_multiple_of: None,
            builder_panics_on: None,
            release_panics: false,
            finish_fails_once: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
            released: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn slow(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub(crate) fn gated(mut self, gate: &Arc<Gate>) -> Self {
        self.gate = Some(Arc::clone(gate));
        self
    }

    pub(crate) fn panicking_on(self, tags: &[u32]) -> Self {
        self.panic_on.lock().unwrap().extend(tags.iter().map(|&t| Tag::new(t)));
        self
    }

    pub(crate) fn buffered_refusing(mut self, multiple_of: u64) -> Self {
        self.refuse_len_multiple_of = Some(multiple_of);
        self
    }

    pub(crate) fn builder_panicking_on(mut self, tag: u32) -> Self {
        self.builder_panics_on = Some(Tag::new(tag));
        self
    }

    pub(crate) fn finish_failing_once(self) -> Self {
        self.finish_fails_once.store(true, Ordering::Relaxed);
        self
    }

    pub(crate) fn panicking_on_release(mut self) -> Self {
        self.release_panics = true;
        self
    }

    pub(crate) fn records(&self) -> Vec<SubmitRecord> {
        self.log.lock().unwrap().clone()
    }
}

/// The inner engine's pairs, refusing fragments whose length is a multiple of `refuse`.
struct Refusing<'a> {
    inner: &'a dyn TransferEngine,
    refuse: u64,
}

impl PlanRules for Refusing<'_> {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.inner.can_handle(src, dst)
    }

    fn check_fragment(&self, _: &Endpoint, _: &Endpoint, f: &Fragment) -> Result<(), RejectReason> {
        if f.len % self.refuse == 0 {
            Err(RejectReason::Misaligned {
                endpoint: f.dst,
                offset: f.dst_offset,
                len: f.len,
                align: self.refuse,
            })
        } else {
            Ok(())
        }
    }
}

impl TransferEngine for Wrapped {
    fn name(&self) -> &str {
        &self.name
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.inner.can_handle(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        match self.refuse_len_multiple_of {
            Some(refuse) => {
                let rules = Refusing { inner: &*self.inner, refuse };
                plan_batch(&rules, &self.registry.snapshot(), fragments)
            }
            None => self.inner.plan(fragments),
        }
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        let inner: Box<dyn PlanBuilder + Send + '_> = match self.refuse_len_multiple_of {
            Some(_) => Box::new(BufferedPlanBuilder::new(self)),
            None => self.inner.builder(),
        };
        let (panic_on, fail_finish) = (self.builder_panics_on, &self.finish_fails_once);
        Box::new(Misbehaving { inner, panic_on, fail_finish })
    }

    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        self.inner.endpoint_registered(id, endpoint)
    }

    fn endpoint_deregistering(&self, id: EndpointId) {
        self.inner.endpoint_deregistering(id);
        self.released.lock().unwrap().push(id);
        assert!(!self.release_panics, "{} was told to panic on release", self.name);
    }

    fn submit(&self, plans: PlanSet) -> TransferHandle {
        let started = Instant::now();
        let tags: Vec<Tag> = plans.plans().iter().flat_map(|p| p.tags()).copied().collect();
        std::thread::sleep(self.delay);
        if self.gate.as_ref().is_some_and(|gate| gate.pass(plans.cancel_token())) {
            let failures = plans.fail_all(&self.name, FailureCause::Cancelled);
            self.log.lock().unwrap().push(SubmitRecord { tags, started, ended: Instant::now() });
            return TransferHandle::settled(failures, plans);
        }
        let boom = {
            let panic_on = self.panic_on.lock().unwrap();
            tags.iter().find(|t| panic_on.contains(t)).copied()
        };
        if let Some(tag) = boom {
            self.log.lock().unwrap().push(SubmitRecord { tags, started, ended: Instant::now() });
            panic!("{} was told to panic on object {}", self.name, tag.get());
        }
        let settled = self.inner.submit(plans).into_settled();
        self.log.lock().unwrap().push(SubmitRecord { tags, started, ended: Instant::now() });
        TransferHandle::settled(settled.failures, settled.plans)
    }
}

/// A builder that misbehaves as a broken engine's would: it panics on a push of `panic_on`,
/// and its `finish`, while `fail_finish` is set, clears it and fails with an error `finish`
/// may not give (an object still open, though none is).
struct Misbehaving<'a> {
    inner: Box<dyn PlanBuilder + Send + 'a>,
    panic_on: Option<Tag>,
    fail_finish: &'a AtomicBool,
}

impl PlanBuilder for Misbehaving<'_> {
    fn begin_object(&mut self, tag: Tag) -> Result<(), umbp_plan::Error> {
        self.inner.begin_object(tag)
    }

    fn push(&mut self, f: Fragment) -> Result<(), umbp_plan::Error> {
        if Some(f.tag) == self.panic_on {
            panic!("the builder was told to panic on object {}", f.tag.get());
        }
        self.inner.push(f)
    }

    fn commit_object(&mut self) -> Result<(), umbp_plan::Error> {
        self.inner.commit_object()
    }

    fn rollback_object(&mut self) -> Result<(), umbp_plan::Error> {
        self.inner.rollback_object()
    }

    fn finish(&mut self) -> Result<PlanSet, umbp_plan::Error> {
        let plans = self.inner.finish()?;
        if self.fail_finish.swap(false, Ordering::Relaxed) {
            return Err(umbp_plan::Error::ObjectOpen { open: Tag::new(0) });
        }
        Ok(plans)
    }

    fn recycle(&mut self, plans: PlanSet) {
        self.inner.recycle(plans)
    }
}
