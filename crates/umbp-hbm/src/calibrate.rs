//! Calibration: where the gather kernel beats one copy per fragment, measured on the device.
//!
//! Whether one launch over many descriptors beats one runtime copy per fragment depends on
//! the GPU, the link and the runtime's per-copy cost, so the engine's threshold
//! ([`HbmConfig::kernel_max_mean_bytes`](crate::HbmConfig::kernel_max_mean_bytes)) is only a
//! default. [`HbmEngine::calibrate`](crate::HbmEngine::calibrate) measures both ways, pinned
//! host memory into device memory, at a few fragment sizes, and sets the device's threshold
//! from what it saw; [`HbmConfig::calibrate`](crate::HbmConfig::calibrate) does it for every
//! device when the engine starts.

use std::time::Instant;

use umbp_plan::DeviceOrdinal;

use crate::{chunk_launches, DeviceError, DeviceRuntime, GatherDescriptor, LaunchTable, Queue};

/// Fragment sizes calibration measures.
pub const CALIBRATION_SIZES: [u64; 6] =
    [4 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10];

/// Bytes each measurement moves: large enough that a launch's fixed cost is amortised the way
/// a real restore's is, small enough to stay well under a second on a simulated device.
pub const CALIBRATION_BYTES: u64 = 8 << 20;

/// One fragment size as calibration measured it.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct CalibrationPoint {
    /// Bytes per fragment.
    pub fragment_size: u64,
    /// Best of the repetitions, seconds, with the gather kernel.
    pub kernel_seconds: f64,
    /// Best of the repetitions, seconds, with one copy per fragment.
    pub copies_seconds: f64,
}

/// What calibration measured on one device, and the threshold it set.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// The device.
    pub device: DeviceOrdinal,
    /// One point per size of [`CALIBRATION_SIZES`].
    pub points: Vec<CalibrationPoint>,
    /// The mean fragment size under which buckets now go through the kernel: twice the
    /// largest size where the kernel was faster (so sizes between two measured ones follow the
    /// faster side), or 0 where it never was (the kernel is then never used on this device).
    pub kernel_max_mean_bytes: u64,
}

/// Measures `device`: `CALIBRATION_BYTES` of pinned host memory into device memory at every
/// size, by kernel and by copies, best of `repetitions`.
pub(crate) fn measure<D: DeviceRuntime>(
    runtime: &D,
    device: DeviceOrdinal,
    repetitions: usize,
    launch_max_bytes: u64,
) -> Result<Calibration, DeviceError> {
    let len = CALIBRATION_BYTES;
    // Pinned host memory owned here: a boxed slice, registered with the runtime for the
    // measurement and unregistered before it is freed.
    let mut pinned = vec![0x5Au8; len as usize].into_boxed_slice();
    let host_addr = pinned.as_mut_ptr() as u64;
    let dev = runtime.alloc(device, len)?;
    // SAFETY: `pinned` lives until after `unregister_host` below and nothing else touches it.
    let alias = match unsafe { runtime.register_host(device, host_addr, len) } {
        Ok(alias) => alias,
        Err(e) => {
            // SAFETY: allocated above; nothing was queued on it.
            let _ = unsafe { runtime.free(device, dev) };
            return Err(e);
        }
    };
    let host = (host_addr, alias);
    let measured = measure_sizes(runtime, device, repetitions, launch_max_bytes, host, dev);
    // Whatever happened, wait for the queue before releasing what it may touch.
    let synced = runtime.synchronize(device);
    // SAFETY: registered and allocated above; the device was synchronized, so no work touches
    // either; each is released once.
    unsafe {
        let _ = runtime.unregister_host(device, host_addr);
        let _ = runtime.free(device, dev);
    }
    drop(pinned);
    synced?;
    let points = measured?;
    let fastest = points.iter().rev().find(|p| p.kernel_seconds < p.copies_seconds);
    let kernel_max_mean_bytes = fastest.map_or(0, |p| 2 * p.fragment_size);
    Ok(Calibration { device, points, kernel_max_mean_bytes })
}

fn measure_sizes<D: DeviceRuntime>(
    runtime: &D,
    device: DeviceOrdinal,
    repetitions: usize,
    launch_max_bytes: u64,
    (host, alias): (u64, u64),
    dst: u64,
) -> Result<Vec<CalibrationPoint>, DeviceError> {
    let mut table = LaunchTable::default();
    let mut points = Vec::new();
    for size in CALIBRATION_SIZES {
        let n = CALIBRATION_BYTES / size;
        // Every other source fragment, reversed, into consecutive destinations: scattered
        // reads, as a restore's, that never merge into one long copy.
        // The kernel reads pinned memory through its device alias; copies take host addresses.
        let at = |i: u64| (n - 2 - 2 * i) * size;
        let descriptors: Vec<GatherDescriptor> = (0..n / 2)
            .map(|i| GatherDescriptor { src: alias + at(i), dst: dst + i * size, len: size })
            .collect();
        let (mut kernel, mut copies) = (f64::INFINITY, f64::INFINITY);
        // One untimed round each first: the kernel's compilation, the copies' first touch.
        for round in 0..=repetitions.max(1) {
            let t = Instant::now();
            chunk_launches(&descriptors, launch_max_bytes, &mut table, |t| {
                // SAFETY: every descriptor lies inside the pinned host region (through its
                // device alias) or the device allocation, both live until the caller releases
                // them after synchronizing; destinations are disjoint and never sources.
                unsafe { runtime.gather(device, t, Queue::Own) }
            })?;
            runtime.synchronize(device)?;
            let k = t.elapsed().as_secs_f64();
            let t = Instant::now();
            for (i, d) in descriptors.iter().enumerate() {
                // SAFETY: as above, the source through its host address.
                unsafe { runtime.copy(device, d.dst, host + at(i as u64), d.len, Queue::Own)? };
            }
            runtime.synchronize(device)?;
            let c = t.elapsed().as_secs_f64();
            if round > 0 {
                kernel = kernel.min(k);
                copies = copies.min(c);
            }
        }
        points.push(CalibrationPoint {
            fragment_size: size,
            kernel_seconds: kernel,
            copies_seconds: copies,
        });
    }
    Ok(points)
}
