//! Criterion: the host copy engine moving a batch of scattered fragments (plan with a reused
//! builder, one submit, wait), per fragment size, with throughput in bytes.

#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use umbp_bench::host_buffer::HostBuffer;
use umbp_bench::shape::SplitMix;
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Tag, TransferEngine};

/// Bytes per batch: large enough to leave the caches, small enough for quick samples.
const BATCH: usize = 32 << 20;

fn host_copy(c: &mut Criterion) {
    let mut group = c.benchmark_group("host_copy");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BATCH as u64));
    let engine = LocalCopyEngine::new(EndpointRegistry::new());
    let src = HostBuffer::new(BATCH, 1);
    let dst = HostBuffer::zeroed(BATCH);
    // SAFETY: both buffers outlive their registrations (declared after them; this engine
    // finishes inside `submit`), and the bench never reads or writes them itself.
    let (src_reg, dst_reg) = unsafe {
        (src.lend(&engine).expect("host memory"), dst.lend(&engine).expect("host memory"))
    };
    let (s, d) = (src_reg.id(), dst_reg.id());
    for size in [4usize << 10, 64 << 10] {
        let n = BATCH / size;
        let mut slots: Vec<u64> = (0..n as u64).collect();
        let mut rng = SplitMix(size as u64);
        for i in (1..n).rev() {
            slots.swap(i, rng.below(i as u64 + 1) as usize);
        }
        // One object per MiB of destination, as a restore's ranges.
        let per_object = ((1 << 20) / size).max(1);
        let fragments: Vec<Fragment> = slots
            .iter()
            .enumerate()
            .map(|(i, &slot)| {
                let tag = Tag::new((i / per_object) as u32);
                let (from, to) = (slot * size as u64, (i * size) as u64);
                Fragment::new(s, from, d, to, size as u64, tag)
            })
            .collect();
        let mut builder = engine.incremental_builder();
        group.bench_function(BenchmarkId::from_parameter(format!("{}KiB", size >> 10)), |b| {
            b.iter(|| {
                for object in fragments.chunks(per_object) {
                    builder.begin_object(object[0].tag).expect("no object open");
                    for &f in object {
                        builder.push(f).expect("valid fragment");
                    }
                    builder.commit_object().expect("object open");
                }
                let settled = engine.submit(builder.finish().expect("finish")).into_settled();
                assert!(settled.failures.is_empty());
                builder.recycle(settled.plans);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, host_copy);
criterion_main!(benches);
