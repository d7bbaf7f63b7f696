//! Freeing device memory and unpinning host memory while submits run: they wait for the
//! submits, so no copy or launch ever touches released memory; later submits fail with a typed
//! cause.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use umbp_hbm::{Error, HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, EndpointRelease, FailureCause, Fragment,
    Register, RegisterError, Tag, TransferEngine,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

#[test]
fn free_device_and_deregister_during_running_submits_never_touch_released_memory() {
    // The free lands at a different point of a submit each time. No step depends on timing:
    // the memory goes once a submit completed, and submits go on until one found it gone.
    for _ in 0..6 {
        free_while_submitting();
    }
}

fn free_while_submitting() {
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let engine = HbmEngine::new(Arc::new(SimDevice::new(1)), EndpointRegistry::new(), config);
    let len = 4usize << 20;
    let src = engine.register_memory((0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let src = src.unwrap();
    let region = engine.alloc_device(GPU, len as u64).unwrap();
    let (host, device) = (src.id(), region.id());
    let stop = AtomicBool::new(false);
    let (first_completed, completion) = mpsc::channel();
    let (mut completed, mut gone) = (0, 0);
    std::thread::scope(|scope| {
        let submitter = scope.spawn(|| {
            let (mut completed, mut gone) = (0, 0);
            // Until a submit after the release found the memory gone (`stop` is set once both
            // releases returned, so every later submit does).
            for round in 0u32.. {
                let mut b = engine.builder();
                let tag = Tag::new(round);
                b.begin_object(tag).unwrap();
                // Large fragments, each its own runtime copy: the widest window for a free to
                // land between two of them.
                let pushed = (0..16u64).all(|k| {
                    let at = k * (256 << 10);
                    b.push(Fragment::new(host, at, device, at, 200 << 10, tag)).is_ok()
                });
                b.commit_object().unwrap();
                let Ok(plans) = b.finish() else { continue };
                let mut handle = engine.submit(plans);
                match handle.wait() {
                    [] if pushed => {
                        completed += 1;
                        // The receiver goes once the memory did; nothing to tell then.
                        let _ = first_completed.send(());
                    }
                    // Planned after the memory went: refused while planning (a typed error).
                    [] => gone += 1,
                    failures => {
                        for f in failures {
                            assert!(
                                matches!(f.cause, FailureCause::EndpointGone(_)),
                                "a submit met released memory: {f:?}"
                            );
                        }
                        gone += 1;
                    }
                }
                if stop.load(Ordering::Relaxed) && gone > 0 {
                    break;
                }
            }
            (completed, gone)
        });
        completion.recv().expect("the submitter completes a submit before the memory goes");
        // Frees the device memory, then unpins and frees the host buffer while submits keep
        // coming: each waits for the submit running now.
        drop(region);
        drop(src);
        drop(completion);
        stop.store(true, Ordering::Relaxed);
        (completed, gone) = submitter.join().unwrap();
    });
    assert!(completed > 0, "some submits ran before the memory went");
    assert!(gone > 0, "submits after it were refused or failed with EndpointGone");
}

/// Registers through the registry alone, then tells the engine of the registration and of its
/// end as a composite holding it does ([`TransferEngine::endpoint_registered`],
/// [`TransferEngine::endpoint_deregistering`]).
struct Composite(Arc<HbmEngine<SimDevice>>);

impl Register for Composite {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        self.0.registry()
    }

    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        self.0
            .endpoint_registered(id, endpoint)
            .map_err(|source| RegisterError::Engine { engine: "hbm".into(), source })?;
        Ok(Some(Arc::new(Composite(Arc::clone(&self.0)))))
    }
}

impl EndpointRelease for Composite {
    fn release(&self, id: EndpointId) {
        self.0.endpoint_deregistering(id);
    }
}

/// A pin ends with the registration it pins, however the memory was registered: through the
/// engine, or through a composite that tells it; memory whose end the engine never hears of
/// (registered through the registry alone, or another engine) is refused. So the same bytes
/// registered and pinned again later pin (the simulated device, like CUDA and HIP, refuses a
/// second pin of pinned memory with error 712), and freed memory never stays pinned.
#[test]
fn a_pin_ends_with_the_registration_it_pins() {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(HbmEngine::new(
        Arc::new(SimDevice::new(1)),
        Arc::clone(&registry),
        HbmConfig::default(),
    ));
    let composite = Composite(Arc::clone(&engine));
    let mut buffer = vec![7u8; 64 << 10];
    for round in 0..3 {
        // Through a composite: pinned, and unpinned when the registration ends.
        let told = composite.register_memory(buffer).unwrap();
        engine.pin(told.id(), GPU).unwrap_or_else(|e| panic!("round {round}: {e}"));
        buffer = told.deregister();
        // Through the engine.
        let own = engine.register_memory(buffer).unwrap();
        engine.pin(own.id(), GPU).unwrap_or_else(|e| panic!("round {round}: {e}"));
        buffer = own.deregister();
        // Through the registry alone: the engine would never hear of its end.
        let foreign = registry.register_memory(buffer).unwrap();
        let refused = engine.pin(foreign.id(), GPU);
        assert_eq!(refused, Err(Error::UnknownEndpoint(foreign.id())));
        buffer = foreign.deregister();
    }
    // A registration the engine refuses to pin leaves nothing followed or pinned behind.
    let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
    let pinning = HbmEngine::new(Arc::new(SimDevice::new(1)), registry, config);
    let whole = pinning.register_memory(buffer).unwrap();
    let base = whole.endpoint().addr();
    // SAFETY: a slice of `whole`'s buffer, which outlives it (refused before anything ran).
    let slice = unsafe { pinning.register_raw_memory(Endpoint::host(base + 4096, 4096)) };
    assert!(matches!(slice, Err(RegisterError::Engine { .. })), "pinned twice: {slice:?}");
    let buffer = whole.deregister();
    let again = pinning.register_memory(buffer).expect("the first pin went with its registration");
    drop(again);
}
