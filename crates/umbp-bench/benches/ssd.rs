//! Criterion: the SSD engine reading random blocks of a temporary file (`O_DIRECT` where the
//! filesystem takes it) into host memory, 256 KiB and 4 KiB reads, one plan set of many reads
//! per submit, with throughput in bytes. The file lives in a temporary directory, removed when
//! the bench ends.

#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function.

use std::io::Write;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use umbp_bench::host_buffer::HostBuffer;
use umbp_bench::shape::SplitMix;
use umbp_plan::{
    EndpointRegistry, FileOptions, FileSource, Fragment, PlanBuilder, Register, Tag, TransferEngine,
};
use umbp_ssd::{SsdConfig, SsdEngine};

/// The file: bigger than one iteration reads, so reads land at random places.
const FILE: usize = 256 << 20;
/// Bytes one iteration reads.
const READ: usize = 8 << 20;

fn ssd_reads(c: &mut Criterion) {
    let mut group = c.benchmark_group("ssd_read");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(READ as u64));
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("ssd-bench.bin");
    let content = HostBuffer::new(FILE, 3);
    let mut file = std::fs::File::create(&path).expect("create the file");
    file.write_all(content.bytes()).expect("write the file");
    file.sync_all().expect("sync the file");
    drop(content);

    let registry = EndpointRegistry::new();
    let engine = SsdEngine::new(registry.clone(), SsdConfig::default()).expect("the SSD engine");
    let source = FileSource::open(&path, FileOptions::new().writable(false));
    let registration = engine.register_file(source, 0, FILE as u64).expect("open the file");
    let file = registration.id();
    let dst = HostBuffer::zeroed(READ);
    // SAFETY: `dst` outlives its registration (declared after it; every transfer is waited on
    // inside the iteration), and the bench never touches its bytes.
    let dst_reg = unsafe { dst.lend(&engine) }.expect("host memory");
    let d = dst_reg.id();
    for block in [256usize << 10, 4 << 10] {
        let (blocks, reads) = ((FILE / block) as u64, READ / block);
        let mut rng = SplitMix(block as u64);
        let mut builder = engine.incremental_builder();
        group.bench_function(BenchmarkId::from_parameter(format!("{}KiB", block >> 10)), |b| {
            b.iter(|| {
                for i in 0..reads {
                    let tag = Tag::new(i as u32);
                    let from = rng.below(blocks) * block as u64;
                    let f = Fragment::new(file, from, d, (i * block) as u64, block as u64, tag);
                    builder.begin_object(tag).expect("no object open");
                    builder.push(f).expect("valid read");
                    builder.commit_object().expect("object open");
                }
                let settled = engine.submit(builder.finish().expect("finish")).into_settled();
                assert!(settled.failures.is_empty(), "{:?}", settled.failures);
                builder.recycle(settled.plans);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, ssd_reads);
criterion_main!(benches);
