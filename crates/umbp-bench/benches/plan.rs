//! Criterion: plan building for the Kimi-K3 restore shape (a quarter of its objects), per builder
//! and page size, with throughput in fragments.

#![allow(missing_docs)] // `criterion_group!` generates an undocumented public function.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use umbp_bench::plan_bench::{MemoryRules, RestoreWorkload};
use umbp_bench::shape::RestoreShape;
use umbp_plan::{BufferedPlanBuilder, IncrementalBuilder, PlanBuilder, RulePlanner};

fn plan_build(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_build");
    // 50 samples of under a millisecond fit `--measurement-time 2`.
    group.sample_size(50);
    for page_size in [64u64 << 10, 32 << 10] {
        let shape = RestoreShape { objects: 160, ..RestoreShape::kimi_k3(page_size) };
        let work = RestoreWorkload::new(shape, 0.1, 42);
        group.throughput(Throughput::Elements(shape.fragments()));
        let label = format!("{}KiB", page_size >> 10);

        let mut incremental = IncrementalBuilder::new(MemoryRules, work.registry.clone());
        group.bench_function(BenchmarkId::new("incremental", &label), |b| {
            b.iter(|| {
                let plans = work.plan_with_runs(&mut incremental).expect("valid restore");
                incremental.recycle(plans);
            })
        });

        let planner = RulePlanner::new(MemoryRules, work.registry.clone());
        let mut buffered = BufferedPlanBuilder::new(planner);
        group.bench_function(BenchmarkId::new("buffered", &label), |b| {
            b.iter(|| work.plan_with(&mut buffered).expect("valid restore"))
        });
    }
    group.finish();
}

criterion_group!(benches, plan_build);
criterion_main!(benches);
