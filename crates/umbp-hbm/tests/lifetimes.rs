//! Freeing device memory and unpinning host memory while submits run: they wait for the
//! submits, so no copy or launch ever touches released memory; later submits fail with a typed
//! cause.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{
    DeviceOrdinal, EndpointRegistry, FailureCause, Fragment, Register, Tag, TransferEngine,
};

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

#[test]
fn free_device_and_deregister_during_running_submits_never_touch_released_memory() {
    // The free lands at a different point of a submit each time.
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
    let (mut completed, mut gone) = (0, 0);
    std::thread::scope(|scope| {
        let submitter = scope.spawn(|| {
            let (mut completed, mut gone) = (0, 0);
            for round in 0..200u32 {
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
                    [] if pushed => completed += 1,
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
        std::thread::sleep(std::time::Duration::from_millis(5));
        // Frees the device memory, then unpins and frees the host buffer: each waits for the
        // submit running now.
        drop(region);
        drop(src);
        stop.store(true, Ordering::Relaxed);
        (completed, gone) = submitter.join().unwrap();
    });
    assert!(completed > 0, "some submits ran before the memory went");
    assert!(gone > 0, "submits after it were refused or failed with EndpointGone");
}
