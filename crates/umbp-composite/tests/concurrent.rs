//! One composite shared by 16 threads, each restoring its own objects 20 times: staged file ->
//! device, DRAM -> device and file -> host in every batch. Every completed object is byte-exact,
//! bytes outside the ranges stay poisoned, and the process's thread count stays bounded during
//! the run and returns to where it was (no submit spawns threads).
//!
//! Its own test binary, so that no other test's threads disturb the count.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use support::tiered::*;
use support::*;
use umbp_composite::{restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_plan::{BatchState, Endpoint, ObjectState, Register};

const THREADS: usize = 16;
const ROUNDS: usize = 20;
/// Objects per restore; object `o` comes from the file through the bounce region into the
/// device (`o % 3 == 0`), from DRAM into the device (1) or from the file into host memory (2).
const OBJECTS: usize = 6;
/// 256 KiB objects of 16 KiB pages, staged in 64 KiB stages (four slots of a 256 KiB bounce).
const PAGES: usize = 16;
const TIER_PAGES: usize = 64;
/// Each range leaves the first bytes of its object out, to check nothing is written there.
const SKIP: u64 = 1000;

/// The names of the process's threads, less io_uring's kernel workers (`iou-wrk-*`,
/// `iou-sqp-*`), which the kernel starts and retires on its own as reads block, and less the
/// tasks that exited between listing and reading their name.
fn thread_names() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|comm| !comm.is_empty() && !comm.starts_with("iou-"))
        .collect()
}

#[test]
fn sixteen_threads_share_one_composite_and_every_completed_byte_is_right() {
    let t = tiered(TIER_PAGES, true);
    let size = PAGES as u64 * PAGE;
    let tables: Vec<Vec<u64>> =
        (0..OBJECTS * THREADS).map(|o| page_table(o, PAGES, TIER_PAGES)).collect();

    // Warm up: the executor and every engine's workers start here.
    let warm_dev = device(&t.hbm, size);
    let warm = [ObjectRange::new(0, size, warm_dev.id, 0)];
    let object = PagedObject::new(t.file_id, &tables[0], PAGE, size);
    let report = restore(&mut t.composite.builder(), &[ObjectTransfer::new(0, object, &warm)]);
    assert_eq!(report.unwrap().aggregate, BatchState::Completed);
    let baseline_names = thread_names();
    let baseline = baseline_names.len();

    let running = AtomicBool::new(true);
    let peak = AtomicUsize::new(baseline);
    let peak_names = std::sync::Mutex::new(Vec::new());
    let wrong = AtomicUsize::new(0);
    let completed = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            while running.load(Ordering::Relaxed) {
                let names = thread_names();
                if names.len() > peak.fetch_max(names.len(), Ordering::Relaxed) {
                    *peak_names.lock().unwrap() = names;
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        });
        let callers: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (t, tables, wrong, completed) = (&t, &tables, &wrong, &completed);
                scope.spawn(move || {
                    let dev = device(&t.hbm, OBJECTS as u64 * size);
                    let mut out = vec![POISON; OBJECTS * size as usize];
                    let out_endpoint = Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64);
                    // SAFETY: `out` outlives every restore of this thread (each is waited on).
                    let mut out_registration =
                        Some(unsafe { t.composite.register_raw_memory(out_endpoint) }.unwrap());
                    let out_id = out_registration.as_ref().unwrap().id();
                    let mut builder = t.composite.builder();
                    for round in 0..ROUNDS {
                        t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
                        out.fill(POISON);
                        let ranges: Vec<[ObjectRange; 1]> = (0..OBJECTS)
                            .map(|o| {
                                let to = if o % 3 == 2 { out_id } else { dev.id };
                                let at = o as u64 * size + SKIP;
                                [ObjectRange::new(SKIP, size - SKIP, to, at)]
                            })
                            .collect();
                        let objects: Vec<ObjectTransfer> = (0..OBJECTS)
                            .map(|o| {
                                ObjectTransfer::new(
                                    (thread * 1000 + round * 10 + o) as u64,
                                    PagedObject::new(
                                        if o % 3 == 1 { t.dram_id } else { t.file_id },
                                        &tables[thread * OBJECTS + o],
                                        PAGE,
                                        size,
                                    ),
                                    &ranges[o],
                                )
                            })
                            .collect();
                        let report = restore(&mut builder, &objects).unwrap();
                        assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
                        let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
                        for (o, r) in report.objects.iter().enumerate() {
                            assert_eq!(r.tag, objects[o].tag);
                            if r.state != ObjectState::Completed {
                                continue;
                            }
                            completed.fetch_add(1, Ordering::Relaxed);
                            let target: &[u8] = if o % 3 == 2 { &out } else { &device };
                            let tier: &[u8] = if o % 3 == 1 { &t.dram } else { &t.file };
                            let base = o * size as usize;
                            let expect = object_bytes(
                                tier,
                                &tables[thread * OBJECTS + o],
                                SKIP,
                                size - SKIP,
                            );
                            if target[base + SKIP as usize..base + size as usize] != expect[..]
                                || target[base..base + SKIP as usize].iter().any(|&x| x != POISON)
                            {
                                wrong.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    drop(out_registration.take());
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        running.store(false, Ordering::Relaxed);
        sampler.join().unwrap();
    });
    assert_eq!(wrong.load(Ordering::Relaxed), 0, "completed objects with wrong bytes");
    assert_eq!(completed.load(Ordering::Relaxed), THREADS * ROUNDS * OBJECTS);
    let peak = peak.load(Ordering::Relaxed);
    assert!(
        peak <= baseline + THREADS + 1,
        "threads peaked at {peak}, from {baseline} with {THREADS} callers and a sampler: {:?}",
        peak_names.lock().unwrap()
    );
    // Left behind: a thread the run started that is still there, i.e. one more of some name
    // than before the run. A joined thread can still be listed for a moment (the kernel wakes
    // the joiner before the task leaves /proc), so only one still there after 5 s counts; and
    // a thread of before the run may have ended since (fewer is no leak).
    let left_behind = || {
        let mut names = thread_names();
        for name in &baseline_names {
            if let Some(i) = names.iter().position(|n| n == name) {
                names.swap_remove(i);
            }
        }
        names
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !left_behind().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        left_behind(),
        Vec::<String>::new(),
        "threads left behind by the run (before it: {baseline_names:?})"
    );
    assert_eq!(t.composite.in_flight().batches, 0);
}
