//! The set-up both examples share: a KV-cache pool with a DRAM tier and an SSD tier, and the
//! engines a server uses to restore from them into device memory (here the simulated device,
//! which runs the same code path a GPU backend does).

use std::io::Write;
use std::sync::Arc;

use umbp_composite::{CompositeEngine, Staging};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{DeviceOrdinal, Endpoint, EndpointId, EndpointRegistry, TransferEngine};
use umbp_ssd::{FileOptions, SsdConfig, SsdEngine};

// The repository's README example runs as a doctest here, where its crates are at hand.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// The device the examples restore into.
pub const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

/// A pool of `pages` pages of `page` bytes in DRAM and the same layout in an SSD file, behind
/// one composite of [host copies, device, SSD] with a bounce region for SSD -> device.
pub struct Pool {
    /// Routes every transfer; shared by every thread of the server.
    pub composite: CompositeEngine,
    /// The device engine (for device memory).
    pub hbm: Arc<HbmEngine<SimDevice>>,
    /// The DRAM tier and its endpoint.
    pub dram: Vec<u8>,
    /// The DRAM tier's endpoint.
    pub dram_id: EndpointId,
    /// What the SSD tier's file holds.
    pub file: Vec<u8>,
    /// The SSD tier's endpoint.
    pub file_id: EndpointId,
    _bounce: Vec<u8>,
    _dir: tempfile::TempDir,
}

impl Pool {
    /// A pool of `pages` pages of `page` bytes per tier, filled with distinct patterns.
    pub fn new(pages: usize, page: usize) -> Result<Self, Box<dyn std::error::Error>> {
        let registry = EndpointRegistry::new();
        let host =
            Arc::new(LocalCopyEngine::with_config(registry.clone(), LocalCopyConfig::default()));
        // Host memory registered through the composite is pinned for the GPU, so the gather
        // kernel reads DRAM pages directly.
        let config = HbmConfig { pin_registered_host: Some(GPU), ..HbmConfig::default() };
        let hbm = Arc::new(HbmEngine::new(Arc::new(SimDevice::new(1)), registry.clone(), config));
        let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::new())?);

        let dir = tempfile::tempdir()?;
        let path = dir.path().join("kv-tier.bin");
        let file: Vec<u8> = (0..pages * page).map(|i| (i * 7 + i / page) as u8).collect();
        std::fs::File::create(&path)?.write_all(&file)?;
        let file_id = ssd.open_file(&path, 0, file.len() as u64, FileOptions::new())?;

        let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd];
        let composite = CompositeEngine::new(registry, engines);
        let mut dram: Vec<u8> = (0..pages * page).map(|i| (i * 13 + i / page) as u8).collect();
        let mut bounce = vec![0u8; 16 << 20];
        // SAFETY: both buffers live in the returned `Pool`, and every batch is waited on (or
        // dropped, which waits) before the pool goes.
        let (dram_id, bounce_id) = unsafe {
            (
                composite.register(Endpoint::host(dram.as_mut_ptr() as u64, dram.len() as u64))?,
                composite
                    .register(Endpoint::host(bounce.as_mut_ptr() as u64, bounce.len() as u64))?,
            )
        };
        // SSD -> device has no single engine: it goes through the bounce region, in stages.
        let composite = composite.with_staging(Staging::new(bounce_id))?;
        Ok(Self { composite, hbm, dram, dram_id, file, file_id, _bounce: bounce, _dir: dir })
    }

    /// Byte `i` of an object stored in `pages` (page offsets) of `tier`.
    pub fn object_byte(tier: &[u8], pages: &[u64], page: usize, i: usize) -> u8 {
        tier[pages[i / page] as usize + i % page]
    }
}
