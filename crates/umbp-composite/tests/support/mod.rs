//! Shared set-up for the composite's tests: the host copy engine, the device engine on a
//! simulated device, and helpers for paged arenas and poisoned destinations.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

pub(crate) mod tiered;
pub(crate) mod wrapped;

use umbp_composite::CompositeEngine;
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    plan_batch, DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, EngineError, Failure,
    FailureCause, Fragment, PlanBuilder, PlanRules, PlanSet, Register, RegisterError, Registration,
    TransferEngine, TransferHandle,
};

pub(crate) const GPU: DeviceOrdinal = DeviceOrdinal::new(0);
pub(crate) const POISON: u8 = 0xA5;

/// Byte `i` of arena `seed`.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed).wrapping_add((i >> 12) as u8))
        .collect()
}

pub(crate) struct Rig {
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) host: Arc<LocalCopyEngine>,
    pub(crate) hbm: Arc<HbmEngine<SimDevice>>,
    pub(crate) composite: CompositeEngine,
}

impl Rig {
    /// Host copies first, then the device engine (which pins registered host memory for the
    /// GPU, so gathers can read the arenas).
    pub(crate) fn new() -> Self {
        let registry = EndpointRegistry::new();
        let host = Arc::new(LocalCopyEngine::new(registry.clone()));
        let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
        let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
        let composite = CompositeEngine::new(registry.clone(), vec![host.clone(), hbm.clone()]);
        Self { registry, host, hbm, composite }
    }

    /// Registers `bytes` (kept alive by the caller) through the composite, for the rest of
    /// the test.
    pub(crate) fn host(&self, bytes: &mut [u8]) -> EndpointId {
        let endpoint = Endpoint::host(bytes.as_mut_ptr() as u64, bytes.len() as u64);
        // SAFETY: every test keeps its buffers alive until its transfers were waited on.
        unsafe { register(&self.composite, endpoint) }.unwrap()
    }

    /// A poisoned device buffer of `len` bytes.
    pub(crate) fn device(&self, len: u64) -> Dev {
        let region = device(&self.hbm, len);
        self.hbm.runtime().fill(region.addr, len, POISON).unwrap();
        region
    }

    pub(crate) fn read_device(&self, region: &Dev) -> Vec<u8> {
        self.hbm.runtime().read(region.addr, region.len).unwrap()
    }
}

/// Registers raw memory through `composite` for the rest of the test: the guard is leaked, so
/// the endpoint stays registered (and the engines prepared) until the process ends. Tests that
/// end a registration hold the guard instead.
///
/// # Safety
///
/// As [`Register::register_raw_memory`], with the registration never ending: the caller keeps
/// the memory alive and untouched while transfers that use it run.
pub(crate) unsafe fn register(
    composite: &CompositeEngine,
    endpoint: Endpoint,
) -> Result<EndpointId, RegisterError> {
    // SAFETY: the caller's promise.
    let registration = unsafe { composite.register_raw_memory(endpoint) }?;
    let id = registration.id();
    std::mem::forget(registration);
    Ok(id)
}

/// Device memory from `hbm`, with its address at hand; freed when dropped.
pub(crate) struct Dev {
    pub(crate) registration: Registration,
    pub(crate) id: EndpointId,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

pub(crate) fn device(hbm: &HbmEngine<SimDevice>, len: u64) -> Dev {
    let registration = hbm.alloc_device(GPU, len).unwrap();
    let (id, addr) = (registration.id(), registration.endpoint().addr());
    Dev { registration, id, addr, len }
}

/// An engine that claims host -> device pairs, counts what the composite asks of it, and
/// either fails everything it is given (`refuse`) or does nothing and succeeds.
pub(crate) struct CountingEngine {
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) refuse: bool,
    pub(crate) registered: AtomicUsize,
    pub(crate) released: AtomicUsize,
    pub(crate) builders: AtomicUsize,
    pub(crate) submits: AtomicUsize,
}

impl CountingEngine {
    pub(crate) fn new(registry: Arc<EndpointRegistry>, refuse: bool) -> Self {
        Self {
            registry,
            refuse,
            registered: 0.into(),
            released: 0.into(),
            builders: 0.into(),
            submits: 0.into(),
        }
    }
}

#[derive(Clone, Copy)]
pub(crate) struct HostToDevice;

impl PlanRules for HostToDevice {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        src.is_host() && dst.device_ordinal().is_some()
    }
}

impl TransferEngine for CountingEngine {
    fn name(&self) -> &str {
        if self.refuse {
            "refusing"
        } else {
            "counting"
        }
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        HostToDevice.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(&HostToDevice, &self.registry.snapshot(), fragments)
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        self.builders.fetch_add(1, Ordering::Relaxed);
        Box::new(umbp_plan::IncrementalBuilder::new(HostToDevice, self.registry.clone()))
    }

    fn endpoint_registered(&self, _: EndpointId, _: &Endpoint) -> Result<(), EngineError> {
        self.registered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn endpoint_deregistering(&self, _: EndpointId) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }

    fn submit(&self, plans: PlanSet) -> TransferHandle {
        self.submits.fetch_add(1, Ordering::Relaxed);
        let failures = if self.refuse {
            plans
                .plans()
                .iter()
                .map(|p| Failure {
                    engine: self.name().into(),
                    src: p.src(),
                    dst: p.dst(),
                    tags: p.tags().to_vec(),
                    cause: FailureCause::NotAccepted("this engine accepts nothing".into()),
                })
                .collect()
        } else {
            Vec::new()
        };
        TransferHandle::settled(failures, plans)
    }
}
