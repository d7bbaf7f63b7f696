//! The remote engine beside the local ones in one composite: a restore from local DRAM, local
//! SSD and another node's memory into the (simulated) device in one batch, and per-object
//! rollback across engines.

mod support;

use std::io::Write;
use std::sync::Arc;

use umbp_composite::{restore, CompositeEngine, ObjectRange, ObjectTransfer, PagedObject, Staging};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    BatchState, DeviceOrdinal, EndpointId, EndpointRegistry, Fragment, Register, Tag,
    TransferEngine,
};
use umbp_remote::RemoteEngine;
use umbp_ssd::{SsdConfig, SsdEngine};

use support::{fill_byte, ucx_or_skip, Served, POISON};

const PAGE: u64 = 16 << 10;
const GPU: DeviceOrdinal = DeviceOrdinal::new(0);

fn local_pattern(seed: u8, pages: usize) -> Vec<u8> {
    (0..pages * PAGE as usize)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 14) as u8)
        .collect()
}

/// Page `k` of object `o` (of `pages` pages): scattered over a tier of `tier_pages` pages.
fn page_table(o: usize, pages: usize, tier_pages: usize) -> Vec<u64> {
    (0..pages).map(|k| (((o * pages + k) * 7 + 3) % tier_pages) as u64 * PAGE).collect()
}

/// Object `o` of `tables` (its page table) as a transfer from tier `tier_of(o)` over
/// `ranges[o]`, tagged `o`.
fn transfers<'a>(
    tables: &'a [Vec<u64>],
    ranges: &'a [[ObjectRange; 1]],
    tier_of: impl Fn(usize) -> EndpointId,
    size: u64,
) -> Vec<ObjectTransfer<'a>> {
    (0..tables.len())
        .map(|o| {
            let object = PagedObject::new(tier_of(o), &tables[o], PAGE, size);
            ObjectTransfer::new(o as u64, object, &ranges[o])
        })
        .collect()
}

struct Tiers {
    composite: CompositeEngine,
    hbm: Arc<HbmEngine<SimDevice>>,
    server: Served,
    _dir: tempfile::TempDir,
    // Registrations live as long as the tiers.
    _keep: Vec<Box<dyn std::any::Any>>,
    dram: Vec<u8>,
    dram_id: EndpointId,
    file: Vec<u8>,
    file_id: EndpointId,
    remote_id: EndpointId,
}

/// [host copies, device (simulated), SSD, remote] over one registry, with a DRAM arena, an SSD
/// file and a peer's arena of `pages` pages each, and a bounce region.
fn tiers(pages: usize) -> Tiers {
    let server = Served::start("tcp", pages * PAGE as usize, 6);
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let hbm = Arc::new(HbmEngine::new(
        Arc::new(SimDevice::new(1)),
        registry.clone(),
        HbmConfig::default(),
    ));
    let ssd = Arc::new(SsdEngine::new(registry.clone(), SsdConfig::default()).unwrap());
    let ucx = Arc::new(RemoteEngine::new(registry.clone(), support::config("tcp")).unwrap());
    let peer = ucx.connect(server.addr).unwrap();
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ssd, ucx];
    let composite = CompositeEngine::new(registry, engines);

    let dram = local_pattern(11, pages);
    let dram_reg = composite.register_memory(dram.clone()).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = local_pattern(77, pages);
    let path = dir.path().join("tier.bin");
    std::fs::File::create(&path).unwrap().write_all(&file).unwrap();
    let file_reg = composite.register_file(path.as_path(), 0, file.len() as u64).unwrap();
    let arena = &peer.regions[0];
    let remote_reg = composite.register_remote(arena.region, 0, arena.len).unwrap();
    let bounce = composite.register_memory(vec![0u8; 256 << 10]).unwrap();
    composite.set_staging(Staging::new(bounce.id()).with_stage_bytes(64 << 10)).unwrap();
    Tiers {
        hbm,
        server,
        _dir: dir,
        dram,
        dram_id: dram_reg.id(),
        file,
        file_id: file_reg.id(),
        remote_id: remote_reg.id(),
        _keep: vec![Box::new(dram_reg), Box::new(file_reg), Box::new(remote_reg), Box::new(bounce)],
        composite,
    }
}

#[test]
fn one_batch_restores_from_dram_ssd_and_a_peer_into_the_device() {
    if !ucx_or_skip() {
        return;
    }
    let t = tiers(256);
    let (objects, per) = (24usize, 4usize);
    let size = per as u64 * PAGE;
    let dev = t.hbm.alloc_device(GPU, objects as u64 * size).unwrap();
    let dev_addr = dev.endpoint().addr();
    t.hbm.runtime().fill(dev_addr, objects as u64 * size, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..objects).map(|o| page_table(o, per, 256)).collect();
    let tier_of = |o: usize| [t.dram_id, t.file_id, t.remote_id][o % 3];
    // One range per object, leaving its first 1,000 bytes out.
    let ranges: Vec<[ObjectRange; 1]> = (0..objects)
        .map(|o| [ObjectRange::new(1000, size - 1000, dev.id(), o as u64 * size + 1000)])
        .collect();
    let batch = transfers(&tables, &ranges, tier_of, size);
    let report = restore(&mut t.composite.builder(), &batch).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");

    let device = t.hbm.runtime().read(dev_addr, objects as u64 * size).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let base = o * size as usize;
        for b in 1000..size as usize {
            let at = (table[b / PAGE as usize] + b as u64 % PAGE) as usize;
            let want = match o % 3 {
                0 => t.dram[at],
                1 => t.file[at],
                _ => fill_byte(6, at),
            };
            assert_eq!(device[base + b], want, "object {o} (tier {}) byte {b}", o % 3);
        }
        assert!(
            device[base..base + 1000].iter().all(|&x| x == POISON),
            "object {o}: bytes outside its range"
        );
    }
    let metrics = t.composite.metrics_snapshot();
    let remote_used =
        metrics.iter().any(|((e, d), c)| e.contains("ucx") && d == "remote->host" && c.bytes > 0);
    assert!(remote_used, "the remote objects went through the UCX engine: {metrics:?}");
}

#[test]
fn a_rolled_back_object_leaves_no_trace_on_any_engine() {
    if !ucx_or_skip() {
        return;
    }
    let t = tiers(256);
    let out = t.composite.register_memory(vec![POISON; 4 * PAGE as usize]).unwrap();
    let mut builder = t.composite.builder();
    let (doomed, kept) = (Tag::new(0), Tag::new(1));
    // Object 0 takes a page from DRAM (host copies) and one from the peer (UCX), then a
    // fragment past the end of its destination: the whole object is rolled back everywhere.
    builder.begin_object(doomed).unwrap();
    builder.push(Fragment::new(t.dram_id, 0, out.id(), 0, PAGE, doomed)).unwrap();
    builder.push(Fragment::new(t.remote_id, 0, out.id(), PAGE, PAGE, doomed)).unwrap();
    assert!(builder.push(Fragment::new(t.remote_id, 0, out.id(), 4 * PAGE, PAGE, doomed)).is_err());
    builder.rollback_object().unwrap();
    // Object 1 takes the same two sources into the other half.
    builder.begin_object(kept).unwrap();
    builder.push(Fragment::new(t.dram_id, PAGE, out.id(), 2 * PAGE, PAGE, kept)).unwrap();
    builder.push(Fragment::new(t.remote_id, PAGE, out.id(), 3 * PAGE, PAGE, kept)).unwrap();
    builder.commit_object().unwrap();
    let plans = builder.finish().unwrap();
    let engines: Vec<usize> = plans.parts().iter().map(|p| p.engine).collect();
    assert_eq!(engines.len(), 2, "one part per engine: {engines:?}");
    let segments: usize = plans.parts().iter().map(|p| p.plans.segment_count()).sum();
    assert_eq!(segments, 2, "only the kept object's two pages were planned");
    let report = t.composite.submit(plans).unwrap().wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    drop(builder);
    let got = out.deregister();
    let page = PAGE as usize;
    assert!(got[..2 * page].iter().all(|&b| b == POISON), "the rolled-back object was written");
    assert_eq!(&got[2 * page..3 * page], &t.dram[page..2 * page]);
    assert!(got[3 * page..].iter().enumerate().all(|(i, &b)| b == fill_byte(6, page + i)));
}

#[test]
fn a_peer_that_dies_mid_restore_costs_only_its_objects() {
    if !ucx_or_skip() {
        return;
    }
    let tier_pages = 4096; // 64 MiB per tier
    let mut t = tiers(tier_pages);
    let (objects, per) = (48usize, 64usize); // objects of 1 MiB, 16 per tier
    let size = per as u64 * PAGE;
    let out = t.composite.register_memory(vec![POISON; objects * size as usize]).unwrap();
    let tables: Vec<Vec<u64>> = (0..objects).map(|o| page_table(o, per, tier_pages)).collect();
    let tier_of = |o: usize| [t.dram_id, t.file_id, t.remote_id][o % 3];
    let ranges: Vec<[ObjectRange; 1]> =
        (0..objects).map(|o| [ObjectRange::new(0, size, out.id(), o as u64 * size)]).collect();
    let batch = transfers(&tables, &ranges, tier_of, size);
    let mut builder = t.composite.builder();
    let started = umbp_composite::start_restore(&mut builder, &batch).unwrap();
    t.server.kill();
    let report = started.wait();
    let got = out.deregister();
    let mut remote_failed = 0;
    for (o, table) in tables.iter().enumerate() {
        let result = report.object(o as u64).unwrap();
        let base = o * size as usize;
        if o % 3 != 2 {
            assert!(result.error.is_none(), "local object {o} failed: {:?}", result.error);
        }
        if result.error.is_some() {
            remote_failed += 1;
            continue;
        }
        for b in (0..size as usize).step_by(997) {
            let at = (table[b / PAGE as usize] + b as u64 % PAGE) as usize;
            let want = match o % 3 {
                0 => t.dram[at],
                1 => t.file[at],
                _ => fill_byte(6, at),
            };
            assert_eq!(got[base + b], want, "object {o} byte {b}");
        }
    }
    assert!(remote_failed > 0, "every remote object finished before the kill");
    eprintln!("{remote_failed} of {} remote objects failed with their peer", objects / 3);
}
