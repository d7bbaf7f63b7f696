//! The set-up both examples share: a KV-cache pool with a DRAM tier and an SSD tier, and the
//! engines a server uses to restore from them into device memory (here the simulated device,
//! which runs the same code path a GPU backend does).

use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use umbp_composite::{CompositeEngine, Staging};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{DeviceOrdinal, EndpointRegistry, Register, Registration, TransferEngine};
use umbp_ssd::{SsdConfig, SsdEngine};

// The repository's README example runs as a doctest here, where its crates are at hand.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;

/// Prints the crates' `tracing` events on stderr, filtered by `RUST_LOG` (`warn` when unset;
/// `RUST_LOG=umbp_composite=debug`, say, for per-batch decisions). `docs/OBSERVABILITY.md`
/// lists the targets and levels.
pub fn install_log_subscriber() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // A second call (or a subscriber the program installed) keeps the first.
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

/// The device the examples restore into.
pub const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

/// A pool of `pages` pages of `page` bytes in DRAM and the same layout in an SSD file, behind
/// one composite of [host copies, device, SSD] with a bounce region for SSD -> device.
///
/// Fields drop in order: the composite first (it waits for its batches), then the
/// registrations (each deregisters, then frees its buffer or closes its file).
pub struct Pool {
    /// Routes every transfer; shared by every thread of the server.
    pub composite: CompositeEngine,
    /// The device engine (for device memory).
    pub hbm: Arc<HbmEngine<SimDevice>>,
    /// The DRAM tier. The registration owns the arena; `dram.deregister()` hands it back.
    pub dram: Registration<Vec<u8>>,
    /// The SSD tier: a registered range of a file (the registration owns the descriptor).
    pub ssd: Registration<File>,
    /// What the DRAM tier held when the pool was made, to check restores against.
    pub dram_bytes: Vec<u8>,
    /// What the SSD tier's file holds.
    pub file_bytes: Vec<u8>,
    _bounce: Registration<Vec<u8>>,
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
        let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default())?);
        let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd];
        let composite = CompositeEngine::new(registry, engines);

        // Registered through the composite, once for every engine.
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("kv-tier.bin");
        let file_bytes: Vec<u8> = (0..pages * page).map(|i| (i * 7 + i / page) as u8).collect();
        File::create(&path)?.write_all(&file_bytes)?;
        let ssd = composite.register_file(path.as_path(), 0, file_bytes.len() as u64)?;
        let dram_bytes: Vec<u8> = (0..pages * page).map(|i| (i * 13 + i / page) as u8).collect();
        let dram = composite.register_memory(dram_bytes.clone())?;
        let bounce = composite.register_memory(vec![0u8; 16 << 20])?;
        // SSD -> device has no single engine: it goes through the bounce region, in stages.
        composite.set_staging(Staging::new(bounce.id()))?;
        Ok(Self { composite, hbm, dram, ssd, dram_bytes, file_bytes, _bounce: bounce, _dir: dir })
    }

    /// Byte `i` of an object stored in `pages` (page offsets) of `tier`.
    pub fn object_byte(tier: &[u8], pages: &[u64], page: usize, i: usize) -> u8 {
        tier[pages[i / page] as usize + i % page]
    }

    /// The bytes of device memory from [`HbmEngine::alloc_device`].
    pub fn read_device(&self, memory: &Registration) -> Result<Vec<u8>, umbp_hbm::DeviceError> {
        let endpoint = memory.endpoint();
        self.hbm.runtime().read(endpoint.addr(), endpoint.len())
    }
}
