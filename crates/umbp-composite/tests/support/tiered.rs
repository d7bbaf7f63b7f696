//! A DRAM arena and an SSD file behind one composite of [host copies, device, SSD], with a
//! bounce region for the staged route.

use std::io::Write;
use std::sync::Arc;

use umbp_composite::{CompositeEngine, Staging};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{Endpoint, EndpointId, EndpointRegistry, Register, Registration, TransferEngine};
use umbp_ssd::{SsdConfig, SsdEngine};

use super::{pattern, GPU};

pub(crate) const PAGE: u64 = 16 << 10;

pub(crate) struct Tiered {
    pub(crate) composite: CompositeEngine,
    /// Closes the file once the composite (and its batches) are gone.
    _file_registration: Registration<std::fs::File>,
    pub(crate) hbm: Arc<HbmEngine<SimDevice>>,
    pub(crate) ssd: Arc<SsdEngine>,
    _dir: tempfile::TempDir,
    pub(crate) dram: Vec<u8>,
    pub(crate) dram_id: EndpointId,
    pub(crate) file: Vec<u8>,
    pub(crate) file_id: EndpointId,
    _bounce: Vec<u8>,
}

/// DRAM arena and SSD file of `pages` pages each (distinct patterns), engines
/// [host copies, device, SSD], and a 256 KiB bounce region (pinned for the GPU when `pin`).
pub(crate) fn tiered(pages: usize, pin: bool) -> Tiered {
    tiered_with(pages, pin, |_, engine, _| engine)
}

/// [`tiered`], with each engine passed through `wrap` (given its position: 0 host copies,
/// 1 device, 2 SSD, and the registry) before the composite takes it.
pub(crate) fn tiered_with(
    pages: usize,
    pin: bool,
    wrap: impl Fn(usize, Arc<dyn TransferEngine>, &Arc<EndpointRegistry>) -> Arc<dyn TransferEngine>,
) -> Tiered {
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config = HbmConfig { pin_registered_host: pin.then_some(GPU), ..HbmConfig::default() };
    let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default()).unwrap());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let len = pages * PAGE as usize;
    let file = pattern(len, 77);
    let path = dir.path().join("tier.bin");
    std::fs::File::create(&path).unwrap().write_all(&file).unwrap();
    let file_registration = ssd.register_file(path.as_path(), 0, len as u64).unwrap();
    let file_id = file_registration.id();
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd.clone()];
    let engines = engines.into_iter().enumerate().map(|(i, e)| wrap(i, e, &registry)).collect();
    let composite = CompositeEngine::new(registry, engines);
    let mut dram = pattern(len, 11);
    let mut bounce = vec![0u8; 256 << 10];
    // SAFETY: the buffers live in the returned struct, alive for every transfer of the test.
    let (dram_id, bounce_id) = unsafe {
        (
            super::register(&composite, Endpoint::host(dram.as_mut_ptr() as u64, len as u64))
                .unwrap(),
            super::register(
                &composite,
                Endpoint::host(bounce.as_mut_ptr() as u64, bounce.len() as u64),
            )
            .unwrap(),
        )
    };
    composite.set_staging(Staging::new(bounce_id).with_stage_bytes(64 << 10)).unwrap();
    Tiered {
        composite,
        _file_registration: file_registration,
        hbm,
        ssd,
        _dir: dir,
        dram,
        dram_id,
        file,
        file_id,
        _bounce: bounce,
    }
}

/// Object `o` of a tier: pages `perm(o, k)` scattered over the tier.
pub(crate) fn page_table(o: usize, pages_per_object: usize, tier_pages: usize) -> Vec<u64> {
    (0..pages_per_object)
        .map(|k| (((o * pages_per_object + k) * 7 + 3) % tier_pages) as u64 * PAGE)
        .collect()
}

pub(crate) fn object_bytes(tier: &[u8], table: &[u64], offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(|b| tier[(table[(b / PAGE) as usize] + b % PAGE) as usize]).collect()
}
