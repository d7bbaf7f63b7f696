//! The HIP backend (feature `hip`): the kernel source compiles with hiprtc for a real AMD
//! architecture (no GPU needed), and on a machine with an AMD GPU the engine moves bytes
//! exactly; without one, the device tests print why they skip.
#![cfg(hip_backend)]

use std::sync::Arc;

use umbp_hbm::hip::compile_gather_kernel;
use umbp_hbm::{HbmConfig, HbmEngine, HipRuntime};
use umbp_plan::{DeviceOrdinal, EndpointRegistry, Fragment, Register, Tag, TransferEngine};

#[test]
fn the_gather_kernel_compiles_for_gfx90a() {
    let code = compile_gather_kernel("gfx90a").expect("hiprtc compiles the kernel for gfx90a");
    assert!(code.len() > 256, "a code object came back ({} bytes)", code.len());
    let elf = code.starts_with(b"\x7fELF");
    let bundle = code.starts_with(b"__CLANG_OFFLOAD_BUNDLE__");
    assert!(elf || bundle, "an ELF code object or an offload bundle");
}

/// The HIP runtime, or `None` after printing why the device tests skip.
fn gpu() -> Option<Arc<HipRuntime>> {
    match HipRuntime::new() {
        Ok(rt) => Some(Arc::new(rt)),
        Err(e) => {
            eprintln!("skipping: no AMD GPU is usable here ({e})");
            None
        }
    }
}

/// Copies `len` bytes of device memory back to the host through the engine.
fn read_back(e: &HbmEngine<HipRuntime>, src: umbp_plan::EndpointId, len: usize) -> Vec<u8> {
    let out = e.register_memory(vec![0u8; len]).unwrap();
    let dst = out.id();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(Fragment::new(src, 0, dst, 0, len as u64, Tag::new(0))).unwrap();
    b.commit_object().unwrap();
    let mut h = e.submit(b.finish().unwrap());
    assert!(h.wait().is_empty());
    drop(h);
    out.deregister()
}

#[test]
fn scattered_unaligned_fragments_arrive_exactly_on_a_gpu() {
    let Some(rt) = gpu() else { return };
    let gpu0 = DeviceOrdinal::new(0);
    let e = HbmEngine::new(rt, EndpointRegistry::new(), HbmConfig::default());
    let len = 1 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let registered = e.register_memory(src.clone()).unwrap();
    let host = registered.id();
    e.pin(host, gpu0).unwrap();
    let dev = e.alloc_device(gpu0, len as u64).unwrap();
    let mut b = e.builder();
    b.begin_object(Tag::new(0)).unwrap();
    // 3,001-byte fragments, scattered and misaligned, plus 16-byte aligned ones.
    let pieces: Vec<(u64, u64)> =
        (0..100u64).map(|i| (((i * 37) % 100) * 9001 + i % 3, i * 3001 + 1)).collect();
    for &(s, d) in &pieces {
        b.push(Fragment::new(host, s, dev.id(), d, 3001, Tag::new(0))).unwrap();
    }
    b.commit_object().unwrap();
    let mut h = e.submit(b.finish().unwrap());
    assert!(h.wait().is_empty());
    drop(h);
    assert_eq!(e.launches(), 1);
    let got = read_back(&e, dev.id(), len);
    for &(s, d) in &pieces {
        assert_eq!(&got[d as usize..][..3001], &src[s as usize..][..3001]);
    }
}
