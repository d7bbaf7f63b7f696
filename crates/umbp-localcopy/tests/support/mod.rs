//! Test support: host buffers that tests and the engine share through raw pointers only, and a
//! seeded generator.
#![allow(dead_code)] // each test file uses part of it

use std::sync::Arc;

use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::{Endpoint, EndpointId, EndpointRegistry};

/// The byte destinations hold before a transfer.
pub(crate) use umbp_plan::testing::POISON;

/// A heap buffer accessed only through its raw pointer, so that the test's own reads and writes
/// never invalidate the pointer the engine copies through. Transfers of this engine finish
/// inside `submit`, so test code never touches a buffer while a transfer runs.
pub(crate) struct HostBuf {
    ptr: *mut u8,
    len: usize,
}

impl HostBuf {
    /// `len` bytes, byte `i` set to `fill(i)`.
    pub(crate) fn new(len: usize, fill: impl Fn(usize) -> u8) -> Self {
        let bytes: Box<[u8]> = (0..len).map(fill).collect();
        Self { ptr: Box::into_raw(bytes).cast::<u8>(), len }
    }

    /// `len` bytes of [`POISON`].
    pub(crate) fn poisoned(len: usize) -> Self {
        Self::new(len, |_| POISON)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Registers the buffer with `engine`.
    pub(crate) fn register(&self, engine: &LocalCopyEngine) -> EndpointId {
        self.register_in(engine.registry())
    }

    /// Registers the buffer in `registry`.
    pub(crate) fn register_in(&self, registry: &Arc<EndpointRegistry>) -> EndpointId {
        let endpoint = Endpoint::host(self.ptr.expose_provenance() as u64, self.len as u64);
        // SAFETY: the buffer lives until dropped, after the tests' last transfer on it, and the
        // tests touch it only between transfers. (Raw and unguarded, so that tests can
        // deregister by id, mid-flight.)
        unsafe { registry.register(endpoint) }
    }

    /// A copy of the buffer's bytes.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        // SAFETY: `ptr .. ptr + len` is the live allocation; no transfer runs now.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }.to_vec()
    }

    /// Sets every byte to `byte`.
    pub(crate) fn fill(&self, byte: u8) {
        // SAFETY: as in `bytes`.
        unsafe { self.ptr.write_bytes(byte, self.len) };
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
        // SAFETY: `ptr` and `len` came from `Box::into_raw` of a boxed slice in `new`.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// A splitmix64 generator, so every test is a pure function of its seed.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// A random permutation of `0 .. n`.
    pub(crate) fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, self.below(i as u64 + 1) as usize);
        }
        order
    }
}

/// Byte `i` of a source buffer numbered `source`.
pub(crate) fn pattern(source: u64, i: usize) -> u8 {
    ((i as u64).wrapping_mul(131).wrapping_add(source * 71) % 251) as u8
}

/// The configurations every copy test runs under: the defaults (small batches inline), every
/// batch on the pool with streaming from 64 bytes, and one thread with plain stores only.
pub(crate) fn configs() -> [LocalCopyConfig; 3] {
    [
        LocalCopyConfig::default(),
        LocalCopyConfig {
            threads: 2,
            parallel_threshold: 0,
            non_temporal_threshold: 64,
            ..LocalCopyConfig::default()
        },
        LocalCopyConfig { threads: 1, non_temporal: false, ..LocalCopyConfig::default() },
    ]
}
