//! Batches that span DRAM and SSD: the SSD engine for file <-> host, the staged route for
//! file -> device, and failures attributed to the right objects.

mod support;

use support::tiered::*;
use support::*;
use umbp_composite::{restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_hbm::DeviceFault;
use umbp_plan::{BatchState, Endpoint, EndpointId, ObjectState};
use umbp_ssd::IoFault;

#[test]
fn a_mixed_dram_and_ssd_batch_into_device_and_host_memory_is_exact() {
    let (objects, per) = (64usize, 4usize);
    let tier_pages = objects / 2 * per;
    let mut t = tiered(tier_pages, true);
    let size = per as u64 * PAGE;
    let dev = device(&t.hbm, objects as u64 * size);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let mut out = vec![POISON; objects * size as usize];
    // SAFETY: `out` outlives the restore.
    let out_id = unsafe {
        register(&t.composite, Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64)).unwrap()
    };
    let tables: Vec<Vec<u64>> = (0..objects).map(|o| page_table(o / 2, per, tier_pages)).collect();
    // Object o: from DRAM (even) or SSD (odd); to the device (o % 4 < 2) or host memory; one
    // range leaving the first 1,000 bytes of the object out.
    let ranges: Vec<[ObjectRange; 1]> = (0..objects)
        .map(|o| {
            let dst = if o % 4 < 2 { dev.id } else { out_id };
            [ObjectRange::new(1000, size - 1000, dst, o as u64 * size + 1000)]
        })
        .collect();
    let batch: Vec<ObjectTransfer> = (0..objects)
        .map(|o| ObjectTransfer {
            tag: o as u64,
            object: PagedObject {
                tier: if o % 2 == 0 { t.dram_id } else { t.file_id },
                page_offsets: &tables[o],
                page_size: PAGE,
                size,
            },
            ranges: &ranges[o],
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &batch).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{:?}", report);
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let target: &[u8] = if o % 4 < 2 { &device } else { &out };
        let tier: &[u8] = if o % 2 == 0 { &t.dram } else { &t.file };
        let base = o * size as usize;
        assert_eq!(
            &target[base + 1000..base + size as usize],
            object_bytes(tier, table, 1000, size - 1000),
            "object {o}"
        );
        assert!(
            target[base..base + 1000].iter().all(|&x| x == POISON),
            "object {o}: bytes outside its range"
        );
    }
    let metrics = t.composite.metrics_snapshot();
    for key in [("localcopy", "host->host"), ("hbm", "host->device"), ("ssd", "file->host")] {
        let found =
            metrics.iter().any(|((e, d), c)| e.contains(key.0) && d == key.1 && c.bytes > 0);
        assert!(found, "metrics for {key:?}: {metrics:?}");
    }
    t.dram.clear();
}

#[test]
fn an_injected_ssd_read_error_fails_only_its_object() {
    let per = 4usize;
    let t = tiered(16, false);
    let size = per as u64 * PAGE;
    let mut out = vec![POISON; 4 * size as usize];
    // SAFETY: `out` outlives the restore.
    let out_id = unsafe {
        register(&t.composite, Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64)).unwrap()
    };
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, per, 16)).collect();
    // Fail the read of object 2's third page.
    t.ssd.inject_fault(IoFault::read_covering(t.file_id, tables[2][2], EIO));
    let states = restore_file_objects(&t, out_id, &tables);
    assert_eq!(
        states,
        [
            ObjectState::Completed,
            ObjectState::Completed,
            ObjectState::Failed,
            ObjectState::Completed
        ]
    );
    for o in [0usize, 1, 3] {
        let base = o * size as usize;
        assert_eq!(&out[base..base + size as usize], object_bytes(&t.file, &tables[o], 0, size));
    }
    // The failed page's destination was never written.
    let failed_page = 2 * size as usize + 2 * PAGE as usize;
    assert!(out[failed_page..failed_page + PAGE as usize].iter().all(|&x| x == POISON));
}

/// `EIO`.
const EIO: i32 = 5;

/// Restores objects 0..4 (pages `tables`) from the SSD file, whole, into `endpoint` at
/// `o × size`; returns each object's state.
fn restore_file_objects(t: &Tiered, endpoint: EndpointId, tables: &[Vec<u64>]) -> Vec<ObjectState> {
    let size = 4 * PAGE;
    let ranges: Vec<[ObjectRange; 1]> =
        (0..4).map(|o| [ObjectRange::new(0, size, endpoint, o as u64 * size)]).collect();
    let batch: Vec<ObjectTransfer> = (0..4)
        .map(|o| ObjectTransfer {
            tag: o as u64,
            object: PagedObject {
                tier: t.file_id,
                page_offsets: &tables[o],
                page_size: PAGE,
                size,
            },
            ranges: &ranges[o],
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &batch).unwrap();
    report.objects.iter().map(|r| r.state).collect()
}

#[test]
fn ssd_to_device_goes_through_the_bounce_region_in_stages() {
    let t = tiered(16, true);
    let dev = device(&t.hbm, 16 * PAGE);
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 4, 16)).collect();
    let states = restore_file_objects(&t, dev.id, &tables);
    assert!(states.iter().all(|&s| s == ObjectState::Completed), "{states:?}");
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let base = o * 4 * PAGE as usize;
        assert_eq!(
            &device[base..base + 4 * PAGE as usize],
            object_bytes(&t.file, table, 0, 4 * PAGE)
        );
    }
    // 256 KiB in stages of at most 64 KiB: several first and second hops.
    let m = t.composite.metrics_snapshot();
    let hop1 =
        m.iter().find(|((e, d), _)| e.contains("ssd") && d == "file->host").map(|(_, c)| c.bytes);
    let hop2 = m.iter().find(|((e, d), _)| e == "hbm" && d == "host->device").map(|(_, c)| c.bytes);
    assert_eq!((hop1, hop2), (Some(16 * PAGE), Some(16 * PAGE)));
}

#[test]
fn a_failure_in_either_hop_fails_only_its_object() {
    // First hop: an SSD read of object 1 fails; its bytes never reach the device.
    let t = tiered(16, false);
    let dev = device(&t.hbm, 16 * PAGE);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 4, 16)).collect();
    t.ssd.inject_fault(IoFault::read_covering(t.file_id, tables[1][0], EIO));
    let states = restore_file_objects(&t, dev.id, &tables);
    assert_eq!(
        states,
        [
            ObjectState::Completed,
            ObjectState::Failed,
            ObjectState::Completed,
            ObjectState::Completed
        ]
    );
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    assert!(device[4 * PAGE as usize..8 * PAGE as usize].iter().all(|&x| x == POISON));
    t.ssd.clear_faults();

    // Second hop: the first device copy fails (the bounce is not pinned, so the hop copies);
    // exactly the objects of that copy fail, the others arrive.
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    t.hbm.runtime().inject(DeviceFault::Copy);
    let states = restore_file_objects(&t, dev.id, &tables);
    let failed: Vec<usize> = (0..4).filter(|&o| states[o] == ObjectState::Failed).collect();
    assert_eq!(failed.len(), 1, "{states:?}");
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    for (o, table) in tables.iter().enumerate() {
        let base = o * 4 * PAGE as usize;
        if states[o] == ObjectState::Completed {
            assert_eq!(
                &device[base..base + 4 * PAGE as usize],
                object_bytes(&t.file, table, 0, 4 * PAGE)
            );
        }
    }
}
