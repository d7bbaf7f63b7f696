//! The simulated device runs launches from several threads side by side, as a GPU runs several
//! streams, yet never lets two of them touch bytes one of them writes at the same time.

use umbp_hbm::{DeviceRuntime, GatherDescriptor, LaunchTable, Queue, SimDevice};
use umbp_plan::DeviceOrdinal;

const GPU: DeviceOrdinal = DeviceOrdinal::new(0);
const REGION: usize = 64 << 10;
/// Long enough (a few milliseconds a launch) that unguarded launches would overlap reads.
const SHARED: usize = 8 << 20;
const PIECE: usize = 4 << 10;

/// A launch copying `len` bytes of pinned host memory at `src` to `dst` in 4 KiB pieces.
fn launch(sim: &SimDevice, src: u64, dst: u64, len: usize) {
    let mut table = LaunchTable::default();
    for k in 0..(len / PIECE) as u64 {
        let at = k * PIECE as u64;
        table.push(GatherDescriptor { src: src + at, dst: dst + at, len: PIECE as u64 });
    }
    // SAFETY: the sources are pinned host buffers alive until the test unpins them, the
    // destinations lie in one live allocation, and no descriptor overlaps another.
    unsafe { sim.gather(GPU, &table, Queue::Own) }.unwrap();
}

/// Pins `bytes` for the device; returns its address.
fn pin(sim: &SimDevice, bytes: &[u8]) -> u64 {
    let addr = bytes.as_ptr() as u64;
    // SAFETY: the buffer outlives its pinning (each test unpins before it drops the buffer).
    unsafe { sim.register_host(GPU, addr, bytes.len() as u64) }.unwrap()
}

#[test]
fn launches_from_sixteen_threads_land_every_byte() {
    let sim = SimDevice::new(1);
    let threads = 16;
    let device = sim.alloc(GPU, (threads * REGION) as u64).unwrap();
    let sources: Vec<Vec<u8>> =
        (0..threads).map(|t| (0..REGION).map(|i| (i * 13 + t * 7) as u8).collect()).collect();
    let pinned: Vec<u64> = sources.iter().map(|s| pin(&sim, s)).collect();
    std::thread::scope(|scope| {
        for (t, &src) in pinned.iter().enumerate() {
            let sim = &sim;
            scope.spawn(move || {
                for _ in 0..50 {
                    launch(sim, src, device + (t * REGION) as u64, REGION);
                }
            });
        }
    });
    for (t, source) in sources.iter().enumerate() {
        let got = sim.read(device + (t * REGION) as u64, REGION as u64).unwrap();
        assert!(got == *source, "region {t}");
    }
    for &src in &pinned {
        // SAFETY: pinned above; no work runs any more.
        unsafe { sim.unregister_host(GPU, src) }.unwrap();
    }
    // SAFETY: allocated above; no work runs any more.
    unsafe { sim.free(GPU, device) }.unwrap();
}

#[test]
fn launches_writing_the_same_bytes_take_turns() {
    let sim = SimDevice::new(1);
    let device = sim.alloc(GPU, SHARED as u64).unwrap();
    let sources = [vec![0x11u8; SHARED], vec![0x22u8; SHARED]];
    let pinned: Vec<u64> = sources.iter().map(|s| pin(&sim, s)).collect();
    std::thread::scope(|scope| {
        for &src in &pinned {
            let sim = &sim;
            scope.spawn(move || {
                for _ in 0..40 {
                    launch(sim, src, device, SHARED);
                }
            });
        }
        // Reads wait for running launches that write what they read: each one sees one whole
        // launch's bytes, never two launches' bytes mixed.
        let sim = &sim;
        scope.spawn(move || {
            for _ in 0..40 {
                let got = sim.read(device, SHARED as u64).unwrap();
                assert!(got.iter().all(|&b| b == got[0]), "a read saw two launches at once");
                assert!([0, 0x11, 0x22].contains(&got[0]));
            }
        });
    });
    for &src in &pinned {
        // SAFETY: pinned above; no work runs any more.
        unsafe { sim.unregister_host(GPU, src) }.unwrap();
    }
    // SAFETY: allocated above; no work runs any more.
    unsafe { sim.free(GPU, device) }.unwrap();
}
