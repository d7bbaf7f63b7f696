//! The CUDA backend (feature `cuda`): the kernel source compiles with NVRTC to PTX for Hopper
//! and Ampere (no GPU needed, only NVRTC); a machine without the CUDA driver gets a typed
//! error, never a panic; on a machine with an NVIDIA GPU the engine moves bytes exactly. Tests
//! that need what is absent print why they skip, except that `UMBP_REQUIRE_NVRTC=1` (set by
//! CI, which installs NVRTC) turns a missing NVRTC into a failure.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use umbp_hbm::cuda::{compile_gather_kernel, nvrtc_version};
use umbp_hbm::{CudaRuntime, DeviceError, DeviceRuntime, HbmConfig, HbmEngine, GATHER_KERNEL_NAME};
use umbp_plan::{DeviceOrdinal, EndpointRegistry, Fragment, Register, Tag, TransferEngine};

/// NVRTC's version, or `None` after printing why the compile tests skip.
fn nvrtc() -> Option<(i32, i32)> {
    match nvrtc_version() {
        Ok(v) => Some(v),
        Err(e) => {
            let required = std::env::var_os("UMBP_REQUIRE_NVRTC").is_some_and(|v| v == "1");
            assert!(!required, "UMBP_REQUIRE_NVRTC=1 but NVRTC does not load: {e}");
            assert!(matches!(e, DeviceError::LibraryMissing { library: "libnvrtc", .. }), "{e}");
            eprintln!("skipping: NVRTC is not on the loader's search path ({e})");
            None
        }
    }
}

#[test]
fn the_gather_kernel_compiles_to_ptx_for_hopper_and_ampere() {
    let Some(version) = nvrtc() else { return };
    eprintln!("NVRTC {}.{}", version.0, version.1);
    for (arch, target) in [("compute_90", ".target sm_90"), ("compute_80", ".target sm_80")] {
        let ptx = compile_gather_kernel(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(ptx.contains(&format!(".entry {GATHER_KERNEL_NAME}(")), "{arch}: no entry");
        assert!(ptx.contains(target), "{arch}: PTX for another target");
        // The kernel's three parameters: two pointers and the descriptor count.
        assert_eq!(ptx.matches(".param .u64").count(), 2, "{arch}");
        assert_eq!(ptx.matches(".param .u32").count(), 1, "{arch}");
    }
}

#[test]
fn an_architecture_nvrtc_does_not_know_is_a_typed_error() {
    if nvrtc().is_none() {
        return;
    }
    let e = compile_gather_kernel("compute_1").unwrap_err();
    assert!(matches!(&e, DeviceError::KernelCompile { arch, .. } if arch == "compute_1"), "{e}");
}

/// The CUDA runtime, or `None` after printing why the device tests skip. Without a driver or
/// a GPU, the error is typed: no panic, whatever is missing.
fn gpu() -> Option<Arc<CudaRuntime>> {
    match CudaRuntime::new() {
        Ok(rt) => Some(Arc::new(rt)),
        Err(e) => {
            assert!(
                matches!(e, DeviceError::LibraryMissing { library: "libcuda", .. })
                    || matches!(e, DeviceError::NoDevice(_)),
                "an unexpected error without a GPU: {e}"
            );
            eprintln!("skipping: no NVIDIA GPU is usable here ({e})");
            None
        }
    }
}

#[test]
fn without_a_driver_or_a_gpu_the_runtime_is_a_typed_error() {
    if let Some(rt) = gpu() {
        assert!(rt.device_count().unwrap() > 0);
        let (major, _) = rt.compute_capability(DeviceOrdinal::new(0)).unwrap();
        assert!(major >= 3, "a real compute capability");
    }
}

/// Copies `len` bytes of device memory back to the host through the engine.
fn read_back(e: &HbmEngine<CudaRuntime>, src: umbp_plan::EndpointId, len: usize) -> Vec<u8> {
    let out = e.register_memory(vec![0u8; len]).unwrap();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(Fragment::new(src, 0, out.id(), 0, len as u64, Tag::new(0))).unwrap();
    b.commit_object().unwrap();
    assert!(e.submit(b.finish().unwrap()).wait().is_empty());
    out.deregister()
}

#[test]
fn host_device_host_device_device_and_scattered_pages_arrive_exactly_on_a_gpu() {
    let Some(rt) = gpu() else { return };
    let gpu0 = DeviceOrdinal::new(0);
    let config = HbmConfig { pin_registered_host: Some(gpu0), ..HbmConfig::default() };
    let e = HbmEngine::new(rt, EndpointRegistry::new(), config);
    // A 256 KiB round trip: host -> device -> host, as one copy each.
    let len = 256 << 10;
    let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let host = e.register_memory(src.clone()).unwrap();
    let dev = e.alloc_device(gpu0, len as u64).unwrap();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(Fragment::new(host.id(), 0, dev.id(), 0, len as u64, Tag::new(0))).unwrap();
    b.commit_object().unwrap();
    assert!(e.submit(b.finish().unwrap()).wait().is_empty());
    assert!(read_back(&e, dev.id(), len) == src, "host -> device -> host");

    // Device -> device.
    let copy = e.alloc_device(gpu0, len as u64).unwrap();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(Fragment::new(dev.id(), 0, copy.id(), 0, len as u64, Tag::new(0))).unwrap();
    b.commit_object().unwrap();
    assert!(e.submit(b.finish().unwrap()).wait().is_empty());
    assert!(read_back(&e, copy.id(), len) == src, "device -> device");

    // 64 scattered, misaligned 3,001-byte pieces of pinned host memory through one launch.
    let scattered = e.alloc_device(gpu0, len as u64).unwrap();
    let pieces: Vec<(u64, u64)> =
        (0..64u64).map(|i| (((i * 37) % 64) * 4001 + i % 3, i * 4001 + 1)).collect();
    let launches = e.launches();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    for &(s, d) in &pieces {
        b.push(Fragment::new(host.id(), s, scattered.id(), d, 3001, Tag::new(0))).unwrap();
    }
    b.commit_object().unwrap();
    assert!(e.submit(b.finish().unwrap()).wait().is_empty());
    assert_eq!(e.launches() - launches, 1, "one gather launch");
    let got = read_back(&e, scattered.id(), len);
    for &(s, d) in &pieces {
        assert_eq!(&got[d as usize..][..3001], &src[s as usize..][..3001]);
    }
}
