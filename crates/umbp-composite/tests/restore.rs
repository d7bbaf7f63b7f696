//! The restore and offload entry points over DRAM arenas, into device and host memory.

mod support;

use support::*;
use umbp_composite::{offload, restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_plan::{BatchState, Endpoint, EndpointId, ObjectState, Register, Tag};

const PAGE: u64 = 4096;

/// Objects of `pages` pages each, scattered over an arena: object `o` page `k` sits at arena
/// page `perm[o * pages + k]`.
struct Arena {
    bytes: Vec<u8>,
    id: EndpointId,
    page_tables: Vec<Vec<u64>>,
}

fn arena(rig: &Rig, objects: usize, pages: usize, seed: u8) -> Arena {
    let total = objects * pages;
    let mut bytes = pattern(total * PAGE as usize, seed);
    let id = rig.host(&mut bytes);
    let perm: Vec<usize> = (0..total).map(|i| (i * 7 + 5) % total).collect();
    let page_tables = (0..objects)
        .map(|o| (0..pages).map(|k| perm[o * pages + k] as u64 * PAGE).collect())
        .collect();
    Arena { bytes, id, page_tables }
}

impl Arena {
    /// Object byte `offset .. + len`, reassembled from the arena.
    fn object_bytes(&self, object: usize, offset: u64, len: u64) -> Vec<u8> {
        (offset..offset + len)
            .map(|b| {
                self.bytes[(self.page_tables[object][(b / PAGE) as usize] + b % PAGE) as usize]
            })
            .collect()
    }
}

#[test]
fn a_mixed_batch_into_device_and_host_memory_lands_exactly() {
    let rig = Rig::new();
    let (objects, pages) = (16usize, 6usize);
    let size = pages as u64 * PAGE;
    let a = arena(&rig, objects, pages, 1);
    let dev = rig.device(objects as u64 * size);
    let mut host_out = vec![POISON; objects * size as usize];
    let host_id = rig.host(&mut host_out);
    // Each object: two ranges (a gap in the middle stays poisoned), even objects to the device,
    // odd ones to host memory.
    let ranges: Vec<[ObjectRange; 2]> = (0..objects)
        .map(|o| {
            let dst = if o % 2 == 0 { dev.id } else { host_id };
            let base = o as u64 * size;
            [
                ObjectRange::new(100, 2 * PAGE, dst, base + 100),
                ObjectRange::new(3 * PAGE + 7, 2 * PAGE, dst, base + 3 * PAGE + 7),
            ]
        })
        .collect();
    let batch: Vec<ObjectTransfer> = (0..objects)
        .map(|o| {
            ObjectTransfer::new(
                1000 + o as u64,
                PagedObject::new(a.id, &a.page_tables[o], PAGE, size),
                &ranges[o],
            )
        })
        .collect();
    let report = restore(&mut rig.composite.builder(), &batch).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{:?}", report);
    assert!(report.objects.iter().enumerate().all(|(o, r)| r.tag == 1000 + o as u64));
    let device = rig.read_device(&dev);
    for (o, object_ranges) in ranges.iter().enumerate() {
        let out: &[u8] = if o % 2 == 0 { &device } else { &host_out };
        let base = o * size as usize;
        for r in object_ranges {
            let at = base + r.offset as usize;
            assert_eq!(
                &out[at..at + r.len as usize],
                a.object_bytes(o, r.offset, r.len),
                "object {o}"
            );
        }
        // Outside the ranges: poison.
        assert!(out[base..base + 100].iter().all(|&x| x == POISON));
        assert!(out[base + 100 + 2 * PAGE as usize..base + 3 * PAGE as usize + 7]
            .iter()
            .all(|&x| x == POISON));
    }
    assert!(rig.hbm.launches() >= 1, "the device half went through the gather kernel");
}

#[test]
fn a_range_past_the_object_end_fails_that_object_only() {
    let rig = Rig::new();
    let a = arena(&rig, 2, 4, 2);
    let size = 4 * PAGE;
    let dev = rig.device(2 * size);
    let good = [ObjectRange::new(0, size, dev.id, 0)];
    let bad = [
        ObjectRange::new(0, PAGE, dev.id, size),
        ObjectRange::new(2 * PAGE, 2 * PAGE + 1, dev.id, size + 2 * PAGE),
    ];
    let batch = [
        ObjectTransfer::new(7, PagedObject::new(a.id, &a.page_tables[0], PAGE, size), &good),
        ObjectTransfer::new(8, PagedObject::new(a.id, &a.page_tables[1], PAGE, size), &bad),
    ];
    let report = restore(&mut rig.composite.builder(), &batch).unwrap();
    assert_eq!(report.aggregate, BatchState::Failed);
    assert_eq!(report.objects[0].state, ObjectState::Completed);
    assert_eq!(report.objects[1].state, ObjectState::Rejected);
    let device = rig.read_device(&dev);
    assert_eq!(&device[..size as usize], a.object_bytes(0, 0, size));
    assert!(
        device[size as usize..].iter().all(|&x| x == POISON),
        "the failed object's destination is untouched"
    );
}

#[test]
fn offload_writes_device_ranges_into_pages_and_ranges_need_not_cover_the_object() {
    let rig = Rig::new();
    let size = 6 * PAGE;
    let mut pages_area = vec![POISON; 12 * PAGE as usize];
    let tier = rig.host(&mut pages_area);
    let dev = rig.device(2 * size);
    let mut src = pattern(2 * size as usize, 9);
    let staging = rig.host(&mut src);
    // Fill the device buffer from host memory first (a plain transfer).
    let mut b = rig.composite.builder();
    b.begin_object(Tag::new(0)).unwrap();
    b.push(umbp_plan::Fragment::new(staging, 0, dev.id, 0, 2 * size, Tag::new(0))).unwrap();
    b.commit_object().unwrap();
    assert_eq!(
        rig.composite.submit(b.finish().unwrap()).unwrap().wait().aggregate,
        BatchState::Completed
    );
    let tables = [
        vec![5 * PAGE, 0, 9 * PAGE, 2 * PAGE, 11 * PAGE, 7 * PAGE],
        vec![PAGE, 3 * PAGE, 4 * PAGE, 6 * PAGE, 8 * PAGE, 10 * PAGE],
    ];
    let tiled = [
        ObjectRange::new(0, 2 * PAGE + 5, dev.id, 0),
        ObjectRange::new(2 * PAGE + 5, 4 * PAGE - 5, dev.id, 2 * PAGE + 5),
    ];
    let gap = [ObjectRange::new(0, 5 * PAGE, dev.id, size)];
    let batch = [
        ObjectTransfer::new(1, PagedObject::new(tier, &tables[0], PAGE, size), &tiled),
        ObjectTransfer::new(2, PagedObject::new(tier, &tables[1], PAGE, size), &gap),
    ];
    let report = offload(&mut rig.composite.builder(), &batch).unwrap();
    // Object 2's one range covers 5 of its 6 pages: it is written, not refused with a false
    // "range passes the end" (what a check that the ranges tile the object reported).
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    for (k, &p) in tables[0].iter().enumerate() {
        let p = p as usize;
        assert_eq!(
            &pages_area[p..p + PAGE as usize],
            &src[k * PAGE as usize..][..PAGE as usize],
            "page {k}"
        );
    }
    for (k, &p) in tables[1].iter().enumerate() {
        let page = &pages_area[p as usize..][..PAGE as usize];
        if k < 5 {
            assert_eq!(page, &src[size as usize + k * PAGE as usize..][..PAGE as usize], "{k}");
        } else {
            assert!(page.iter().all(|&x| x == POISON), "the page no range names was written");
        }
    }
}

#[test]
fn concurrent_restores_of_mixed_shapes_never_report_a_wrong_completed_object() {
    let rig = Rig::new();
    let (objects, pages) = (12usize, 5usize);
    let size = pages as u64 * PAGE;
    let a = arena(&rig, objects, pages, 4);
    let mut mismatches = 0usize;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let (rig, a) = (&rig, &a);
                scope.spawn(move || {
                    let mut builder = rig.composite.builder();
                    let mut wrong = 0;
                    for round in 0..3 {
                        let dev = rig.device(objects as u64 * size);
                        let mut out = vec![POISON; objects * size as usize];
                        let endpoint = Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64);
                        // SAFETY: `out` outlives the registration, which ends below after the
                        // restore was waited on.
                        let registration =
                            unsafe { rig.composite.register_raw_memory(endpoint) }.unwrap();
                        let host_id = registration.id();
                        // Shapes differ per object: whole object, a prefix, two ranges.
                        let ranges: Vec<Vec<ObjectRange>> = (0..objects)
                            .map(|o| {
                                let dst = if (o + t + round) % 2 == 0 { dev.id } else { host_id };
                                let base = o as u64 * size;
                                match o % 3 {
                                    0 => vec![ObjectRange::new(0, size, dst, base)],
                                    1 => vec![ObjectRange::new(0, PAGE + 1, dst, base)],
                                    _ => vec![
                                        ObjectRange::new(10, PAGE, dst, base + 10),
                                        ObjectRange::new(3 * PAGE, 2 * PAGE, dst, base + 3 * PAGE),
                                    ],
                                }
                            })
                            .collect();
                        let batch: Vec<ObjectTransfer> = (0..objects)
                            .map(|o| {
                                ObjectTransfer::new(
                                    o as u64,
                                    PagedObject::new(a.id, &a.page_tables[o], PAGE, size),
                                    &ranges[o],
                                )
                            })
                            .collect();
                        let report = restore(&mut builder, &batch).unwrap();
                        let device = rig.read_device(&dev);
                        for (o, r) in report.objects.iter().enumerate() {
                            if r.state != ObjectState::Completed {
                                continue;
                            }
                            for range in &ranges[o] {
                                let out: &[u8] =
                                    if range.endpoint == dev.id { &device } else { &out };
                                let at = range.endpoint_offset as usize;
                                if out[at..at + range.len as usize]
                                    != a.object_bytes(o, range.offset, range.len)[..]
                                {
                                    wrong += 1;
                                }
                            }
                        }
                        assert_eq!(report.aggregate, BatchState::Completed);
                        drop(registration);
                        drop(dev);
                    }
                    wrong
                })
            })
            .collect();
        mismatches = workers.into_iter().map(|w| w.join().unwrap()).sum();
    });
    assert_eq!(mismatches, 0);
}
