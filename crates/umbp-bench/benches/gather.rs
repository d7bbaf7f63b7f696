//! Criterion: the device engine on the simulated device, scattered 4 KiB and 64 KiB fragments
//! from pinned host memory into device memory by one gather launch (the engine's default rule)
//! and by one copy per fragment (kernel off), with throughput in bytes. The simulator runs the
//! gather on the CPU: this measures descriptor building and CPU execution, not a GPU.

#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use umbp_bench::host_buffer::HostBuffer;
use umbp_bench::shape::SplitMix;
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_plan::{DeviceOrdinal, EndpointRegistry, Fragment, PlanBuilder, Tag, TransferEngine};

const BATCH: usize = 16 << 20;

fn simulated_gather(c: &mut Criterion) {
    let mut group = c.benchmark_group("sim_gather");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BATCH as u64));
    let device = DeviceOrdinal::new(0);
    let runtime = Arc::new(SimDevice::new(1));
    let src = HostBuffer::new(BATCH, 2);
    for (mode, kernel_min_fragments) in [("gather", 2), ("copies", usize::MAX)] {
        // Host memory registered with the engine is pinned for the device.
        let pin = Some(device);
        let config =
            HbmConfig { kernel_min_fragments, pin_registered_host: pin, ..HbmConfig::default() };
        let engine = HbmEngine::new(runtime.clone(), EndpointRegistry::new(), config);
        // SAFETY: `src` outlives the registration (dropped at the end of this iteration; each
        // submit synchronizes before it returns), and the bench never touches its bytes.
        let source = unsafe { src.lend(&engine) }.expect("pinned");
        let dev = engine.alloc_device(device, BATCH as u64).expect("device memory");
        let (s, d) = (source.id(), dev.id());
        for size in [4usize << 10, 64 << 10] {
            let n = BATCH / size;
            let mut slots: Vec<u64> = (0..n as u64).collect();
            let mut rng = SplitMix(size as u64);
            for i in (1..n).rev() {
                slots.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut builder = engine.incremental_builder();
            let id = BenchmarkId::new(mode, format!("{}KiB", size >> 10));
            group.bench_function(id, |b| {
                b.iter(|| {
                    builder.begin_object(Tag::new(0)).expect("no object open");
                    for (i, &slot) in slots.iter().enumerate() {
                        let (from, to) = (slot * size as u64, (i * size) as u64);
                        let f = Fragment::new(s, from, d, to, size as u64, Tag::new(0));
                        builder.push(f).expect("valid fragment");
                    }
                    builder.commit_object().expect("object open");
                    let settled = engine.submit(builder.finish().expect("finish")).into_settled();
                    assert!(settled.failures.is_empty());
                    builder.recycle(settled.plans);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, simulated_gather);
criterion_main!(benches);
