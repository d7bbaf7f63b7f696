//! One batch never writes the same byte twice: the overlap rule over the whole batch, across
//! engines, layer groups and the direct and staged routes. The objects involved fail with
//! `Overlap` before anything runs and nothing of them is written; their siblings complete.

mod support;

use support::tiered::*;
use support::*;
use umbp_composite::{
    restore, ObjectError, ObjectRange, ObjectTransfer, PagedObject, TransferReport,
};
use umbp_plan::{FailureCause, Fragment, ObjectState, Tag};

const PAGE4K: u64 = 4096;

/// Whether the object the caller tagged `tag` failed with the overlap rule, from the composite.
fn overlapped(report: &TransferReport, tag: u64) -> bool {
    let o = report.object(tag).unwrap();
    o.state == ObjectState::Failed
        && matches!(
            &o.error,
            Some(ObjectError::Failed { engine, cause: FailureCause::Overlap, .. }) if engine == "composite"
        )
}

fn states(report: &TransferReport) -> Vec<(u64, ObjectState)> {
    report.objects.iter().map(|o| (o.tag, o.state)).collect()
}

#[test]
fn two_layer_groups_restoring_into_the_same_device_bytes_both_fail_and_write_nothing() {
    let rig = Rig::new();
    let mut arena = pattern(4 * PAGE4K as usize, 9);
    let arena_id = rig.host(&mut arena);
    let dev = rig.device(4 * PAGE4K);
    let pages: Vec<[u64; 1]> = (0..4).map(|p| [p * PAGE4K]).collect();
    // Object 10 (group 0) writes device bytes 0..4096, object 11 (group 1) 2048..6144: the
    // same bytes from two layer groups. Objects 12 and 13 (groups 0 and 1) write elsewhere.
    let ranges = [
        [ObjectRange::new(0, PAGE4K, dev.id, 0)],
        [ObjectRange::new(0, PAGE4K, dev.id, 2048).in_group(1)],
        [ObjectRange::new(0, PAGE4K / 2, dev.id, 8192)],
        [ObjectRange::new(0, PAGE4K, dev.id, 3 * PAGE4K).in_group(1)],
    ];
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            ObjectTransfer::new(
                10 + o as u64,
                PagedObject::new(arena_id, &pages[o], PAGE4K, PAGE4K),
                &ranges[o],
            )
        })
        .collect();
    let mut builder = rig.composite.builder();
    let report = restore(&mut builder, &objects).unwrap();
    assert!(overlapped(&report, 10) && overlapped(&report, 11), "{report:?}");
    assert_eq!(
        states(&report)[2..],
        [(12, ObjectState::Completed), (13, ObjectState::Completed)],
        "{report:?}"
    );
    let device = rig.read_device(&dev);
    // Every byte: nothing of 10 and 11 (0..6144), nothing outside 12's and 13's ranges.
    for (i, &b) in device.iter().enumerate() {
        let want = match i as u64 {
            8192..10240 => arena[2 * PAGE4K as usize + i - 8192],
            12288..16384 => arena[3 * PAGE4K as usize + i - 12288],
            _ => POISON,
        };
        assert_eq!(b, want, "device byte {i}");
    }

    // The builder is reused: the same objects without the clash all complete.
    let ranges = [
        [ObjectRange::new(0, PAGE4K, dev.id, 0)],
        [ObjectRange::new(0, PAGE4K, dev.id, PAGE4K).in_group(1)],
    ];
    let objects: Vec<ObjectTransfer> = (0..2)
        .map(|i| {
            let mut o = objects[i];
            o.ranges = &ranges[i];
            o
        })
        .collect();
    let report = restore(&mut builder, &objects).unwrap();
    assert!(report.objects.iter().all(|o| o.state == ObjectState::Completed), "{report:?}");
    assert_eq!(rig.read_device(&dev)[..2 * PAGE4K as usize], arena[..2 * PAGE4K as usize]);
}

#[test]
fn a_direct_and_a_staged_object_writing_the_same_bytes_both_fail_and_write_nothing() {
    let t = tiered(16, true);
    let dev = device(&t.hbm, 4 * PAGE);
    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
    let tables: Vec<Vec<u64>> = (0..4).map(|o| page_table(o, 1, 16)).collect();
    // Object 0 from DRAM (direct, the device engine) into device bytes 0..PAGE; object 1 from
    // the SSD file (staged: file -> bounce -> device) into PAGE/2..; objects 2 (file) and 3
    // (DRAM) into pages 2 and 3.
    let at = [0, PAGE / 2, 2 * PAGE, 3 * PAGE];
    let tiers = [t.dram_id, t.file_id, t.file_id, t.dram_id];
    let ranges: Vec<[ObjectRange; 1]> =
        (0..4).map(|o| [ObjectRange::new(0, PAGE, dev.id, at[o])]).collect();
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            ObjectTransfer::new(
                o as u64,
                PagedObject::new(tiers[o], &tables[o], PAGE, PAGE),
                &ranges[o],
            )
        })
        .collect();
    let report = restore(&mut t.composite.builder(), &objects).unwrap();
    assert!(overlapped(&report, 0) && overlapped(&report, 1), "{report:?}");
    assert_eq!(
        states(&report)[2..],
        [(2, ObjectState::Completed), (3, ObjectState::Completed)],
        "{report:?}"
    );
    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
    let page = PAGE as usize;
    assert!(device[..2 * page].iter().all(|&b| b == POISON), "nothing of objects 0 and 1");
    assert_eq!(device[2 * page..3 * page], object_bytes(&t.file, &tables[2], 0, PAGE));
    assert_eq!(device[3 * page..], object_bytes(&t.dram, &tables[3], 0, PAGE));
}

#[test]
fn an_object_writing_bytes_another_object_reads_fails_with_it() {
    let rig = Rig::new();
    let mut src = pattern(3 * PAGE4K as usize, 4);
    // Two poisoned pages, then a page of its own pattern.
    let mut mid = vec![POISON; 2 * PAGE4K as usize];
    mid.extend(pattern(PAGE4K as usize, 6));
    let third = mid[2 * PAGE4K as usize..].to_vec();
    let (src_id, mid_id) = (rig.host(&mut src), rig.host(&mut mid));
    let dev = rig.device(3 * PAGE4K);
    let mut b = rig.composite.builder();
    let mut object = |tag: u32, f: Fragment| {
        b.begin_object(Tag::new(tag)).unwrap();
        b.push(f).unwrap();
        b.commit_object().unwrap();
    };
    let t = Tag::new;
    // Object 1 writes host bytes mid[0..4096] (host copies); object 2 reads mid[1000..3000]
    // into the device (the device engine): another engine, in the same batch.
    object(1, Fragment::new(src_id, 0, mid_id, 0, PAGE4K, t(1)));
    object(2, Fragment::new(mid_id, 1000, dev.id, 0, 2000, t(2)));
    // Siblings: host copy into mid's second page, and mid's third page to the device.
    object(3, Fragment::new(src_id, PAGE4K, mid_id, PAGE4K, PAGE4K, t(3)));
    object(4, Fragment::new(mid_id, 2 * PAGE4K, dev.id, 2 * PAGE4K, PAGE4K, t(4)));
    let plans = b.finish().unwrap();
    let failed: Vec<(u32, FailureCause)> =
        plans.failed().iter().map(|f| (f.tags[0].get(), f.cause.clone())).collect();
    assert_eq!(failed, [(1, FailureCause::Overlap), (2, FailureCause::Overlap)]);
    let report = rig.composite.submit(plans).unwrap().wait();
    assert!(overlapped(&report, 1) && overlapped(&report, 2), "{report:?}");
    assert_eq!(
        states(&report)[2..],
        [(3, ObjectState::Completed), (4, ObjectState::Completed)],
        "{report:?}"
    );
    let page = PAGE4K as usize;
    assert!(mid[..page].iter().all(|&x| x == POISON), "nothing of object 1");
    assert_eq!(mid[page..2 * page], src[page..2 * page]);
    let device = rig.read_device(&dev);
    assert!(device[..2 * page].iter().all(|&x| x == POISON), "nothing of object 2");
    assert_eq!(device[2 * page..], third);
    assert_eq!(mid[2 * page..], third, "mid's third page was only read");
}
