//! Shared helpers of the integration tests: temporary directories on a filesystem that takes
//! `O_DIRECT`, engines per backend (skipping io_uring with a message where the kernel refuses
//! it), host buffers with a chosen alignment, patterns, and one-call transfers.

#![allow(dead_code, unreachable_pub)] // Each test binary uses a different part.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use tempfile::TempDir;
use umbp_plan::{Endpoint, EndpointId, EndpointRegistry, Failure, Fragment, Tag, TransferEngine};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

/// The value destinations hold before a transfer.
pub const POISON: u8 = 0xA5;

/// A temporary directory under the target directory (a real filesystem, unlike a tmpfs /tmp).
pub fn temp_dir() -> TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory")
}

/// A temporary directory whose filesystem accepts `O_DIRECT`, or `None` after printing why
/// the calling test skips its `O_DIRECT` part.
pub fn direct_dir(test: &str) -> Option<TempDir> {
    let dir = temp_dir();
    let probe = dir.path().join("o_direct_probe");
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe);
    match opened {
        Ok(_) => Some(dir),
        Err(e) => {
            eprintln!(
                "SKIP {test} (O_DIRECT part): the filesystem of {} refuses O_DIRECT: {e}",
                dir.path().display()
            );
            None
        }
    }
}

/// The backends a test runs on: io_uring (when the kernel allows it, else a skip message) and
/// the blocking fallback.
pub fn backends(test: &str) -> Vec<Backend> {
    let mut out = Vec::new();
    match SsdEngine::new(
        EndpointRegistry::new(),
        SsdConfig { backend: Backend::IoUring, ..SsdConfig::default() },
    ) {
        Ok(_) => out.push(Backend::IoUring),
        Err(e) => eprintln!("SKIP {test} on io_uring: {e:?}"),
    }
    out.push(Backend::Blocking);
    out
}

/// Runs `run(backend, direct, dir)` on every backend this machine has ([`backends`]): on a
/// buffered file in a temporary directory, then with `O_DIRECT` where the filesystem takes it
/// ([`direct_dir`]; skipped with a message otherwise).
pub fn each_backend_and_mode(test: &str, mut run: impl FnMut(Backend, bool, &Path)) {
    let buffered = temp_dir();
    let direct = direct_dir(test);
    for backend in backends(test) {
        run(backend, false, buffered.path());
        if let Some(dir) = &direct {
            run(backend, true, dir.path());
        }
    }
}

/// An engine with `backend` and otherwise default settings.
pub fn engine(registry: &Arc<EndpointRegistry>, backend: Backend) -> SsdEngine {
    engine_with(registry, SsdConfig { backend, ..SsdConfig::default() })
}

pub fn engine_with(registry: &Arc<EndpointRegistry>, config: SsdConfig) -> SsdEngine {
    SsdEngine::new(Arc::clone(registry), config).expect("engine")
}

/// Host memory at a chosen distance from a 4 KiB boundary, registered as an endpoint.
pub struct HostBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
    pub id: EndpointId,
}

impl HostBuf {
    /// `len` bytes starting `misalign` bytes past a 4 KiB boundary, filled with `fill`.
    pub fn new(registry: &EndpointRegistry, len: usize, misalign: usize, fill: u8) -> Self {
        let mut storage = vec![fill; len + 8192 + misalign];
        let start = storage.as_ptr().align_offset(4096) + misalign;
        let addr = storage[start..].as_mut_ptr() as u64;
        // SAFETY: the buffer is registered for `len` bytes inside `storage`, which is never
        // reallocated and outlives every transfer: each test waits on its handles before
        // touching or dropping the buffer, and deregisters nothing it still uses.
        let id = unsafe { registry.register(Endpoint::host(addr, len as u64)) };
        Self { storage, start, len, id }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Byte `i` of pattern `seed`: every 8-byte word differs, so a misplaced page shows.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut k = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    while out.len() < len {
        k = k.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = k;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Creates `path` holding `bytes`.
pub fn write_file(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("write the test file");
}

/// A small deterministic generator for layouts.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// What a transfer returned: the failures and the rejected tags.
#[derive(Debug, Default)]
pub struct Outcome {
    pub failures: Vec<Failure>,
    pub rejected: Vec<Tag>,
}

impl Outcome {
    /// Every object that did not complete, sorted.
    pub fn failed_tags(&self) -> Vec<Tag> {
        let mut tags: Vec<Tag> = self
            .failures
            .iter()
            .flat_map(|f| f.tags.iter().copied())
            .chain(self.rejected.iter().copied())
            .collect();
        tags.sort();
        tags.dedup();
        tags
    }
}

/// Plans `objects` (each a list of fragments sharing one tag) with the engine's builder,
/// submits them, and waits.
pub fn transfer(engine: &SsdEngine, objects: &[Vec<Fragment>]) -> Outcome {
    let mut builder = engine.builder();
    for object in objects {
        let Some(first) = object.first() else { continue };
        builder.begin_object(first.tag).expect("begin");
        for &f in object {
            if builder.push(f).is_err() {
                break;
            }
        }
        builder.commit_object().expect("commit");
    }
    let plans = builder.finish().expect("finish");
    let rejected = plans.rejected().to_vec();
    let settled = engine.submit(plans).into_settled();
    Outcome { failures: settled.failures, rejected }
}
