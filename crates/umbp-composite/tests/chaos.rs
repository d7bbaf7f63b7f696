//! Everything users do to a composite at once: 16 threads restoring mixed DRAM + SSD batches
//! into device and host memory through one composite whose host-copy engine panics on some
//! objects, with invalid ranges among them, while batches are cancelled at random moments, run
//! against short deadlines, and have their destination deregistered while in flight. Whatever happens to an object:
//!
//! - completed means every byte of it is right; rejected means none of it was written;
//! - no byte outside the ranges of the batch's objects is ever written;
//! - nothing hangs, nothing panics out, and every batch settles.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::tiered::*;
use support::wrapped::Wrapped;
use support::*;
use umbp_composite::{start_restore, ObjectRange, ObjectTransfer, PagedObject, TransferReport};
use umbp_plan::{Endpoint, ObjectState, Register};

const THREADS: usize = 16;
const ROUNDS: usize = 12;
const OBJECTS: usize = 6;
const PAGES: usize = 4;
const TIER_PAGES: usize = 64;
/// Object 4 of every batch (a position) takes the host-copy engine's panic.
const PANICS_ON: u32 = 4;

/// A tiny deterministic generator per thread.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn a_composite_under_every_fault_at_once_keeps_every_promise() {
    let t = tiered_with(TIER_PAGES, true, |i, engine, registry| {
        if i == 0 {
            Arc::new(
                Wrapped::new(engine, registry.clone(), "host-copies").panicking_on(&[PANICS_ON]),
            )
        } else {
            engine
        }
    });
    let size = PAGES as u64 * PAGE;
    let tables: Vec<Vec<u64>> =
        (0..THREADS * OBJECTS).map(|o| page_table(o, PAGES, TIER_PAGES)).collect();
    let outcomes = [(); 5].map(|()| AtomicUsize::new(0));

    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (t, tables, outcomes) = (&t, &tables, &outcomes);
            scope.spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((thread as u64 + 1) * 0x2545_f491));
                let dev = device(&t.hbm, OBJECTS as u64 * size);
                let mut builder = t.composite.builder();
                for round in 0..ROUNDS {
                    let mut out = vec![POISON; OBJECTS * size as usize];
                    let out_endpoint = Endpoint::host(out.as_mut_ptr() as u64, out.len() as u64);
                    // SAFETY: `out` outlives the batch: it is waited on (or its endpoint
                    // deregistered, which waits) before `out` goes at the end of the round.
 let mut out_registration = Some(unsafe { t.composite.register_raw_memory(out_endpoint) }.unwrap());
 let out_id = out_registration.as_ref().unwrap().id();
                    t.hbm.runtime().fill(dev.addr, dev.len, POISON).unwrap();
                    // Object o: from DRAM or SSD, into the device or host memory, one or two
                    // ranges at random offsets inside its own slot.
                    let ranges: Vec<Vec<ObjectRange>> = (0..OBJECTS)
                        .map(|o| {
                            let to = if rng.below(2) == 0 { dev.id } else { out_id };
                            let a = rng.below(size / 2);
                            let b = size / 2 + rng.below(size / 2 - 1);
                            let base = o as u64 * size;
                            if rng.below(8) == 0 {
                                // Past the object's end: rejected, nothing of it written.
                                return vec![ObjectRange::new(size - 10, 20, to, base)];
                            }
                            let mut v = vec![ObjectRange::new(a, size / 2 - a, to, base + a).in_group(0)];
                            if rng.below(2) == 0 {
                                v.push(ObjectRange::new(b, size - b, to, base + b).in_group(1));
                            }
                            v
                        })
                        .collect();
                    let objects: Vec<ObjectTransfer> = (0..OBJECTS)
                        .map(|o| {
                            let tier = if rng.below(2) == 0 { t.dram_id } else { t.file_id };
                            let pages = &tables[thread * OBJECTS + o];
                            let object = PagedObject::new(tier, pages, PAGE, size);
                            let tag = (thread * 1000 + round * 10 + o) as u64;
                            ObjectTransfer::new(tag, object, &ranges[o])
                        })
                        .collect();
                    let mode = rng.below(4);
                    if mode == 1 {
                        builder.set_deadline(Some(Instant::now() + Duration::from_micros(rng.below(3000))));
                    }
                    let batch = start_restore(&mut builder, &objects).unwrap();
                    let report: TransferReport = match mode {
                        0 => {
                            std::thread::sleep(Duration::from_micros(rng.below(2000)));
                            batch.cancel()
                        }
                        2 => {
                            // The host destination goes while the batch may still write it:
                            // deregister waits for the batch.
                            drop(out_registration.take());
                            let uses_out = ranges.iter().flatten().any(|r| r.endpoint == out_id);
                            assert!(
                                !uses_out || batch.is_done(),
                                "deregister returned while a batch using the endpoint was in flight"
                            );
                            batch.wait()
                        }
                        _ => batch.wait(),
                    };
                    builder.recycle(batch.into_plans());
                    if mode != 2 {
                        drop(out_registration.take());
                    }

                    let device = t.hbm.runtime().read(dev.addr, dev.len).unwrap();
                    let mut covered = [vec![false; out.len()], vec![false; device.len()]];
                    for (o, result) in report.objects.iter().enumerate() {
                        assert_eq!(result.tag, objects[o].tag);
                        assert_ne!(result.state, ObjectState::InFlight, "a settled batch");
                        let slot = match result.state {
                            ObjectState::Completed => 0,
                            ObjectState::Failed => 1,
                            ObjectState::Cancelled => 2,
                            ObjectState::Rejected => 3,
                            ObjectState::InFlight => 4,
                        };
                        outcomes[slot].fetch_add(1, Ordering::Relaxed);
                        let tier: &[u8] = if objects[o].object.tier == t.dram_id { &t.dram } else { &t.file };
                        for r in &ranges[o] {
                            let (bytes, cover): (&[u8], &mut Vec<bool>) = if r.endpoint == dev.id {
                                (&device, &mut covered[1])
                            } else {
                                (&out, &mut covered[0])
                            };
                            let at = r.endpoint_offset as usize..(r.endpoint_offset + r.len) as usize;
                            // A rejected object may write nothing at all: its ranges stay
                            // uncovered, so the poison check below holds them to it.
                            if result.state != ObjectState::Rejected {
                                cover[at.clone()].iter_mut().for_each(|c| *c = true);
                            }
                            if result.state == ObjectState::Completed {
                                let want = object_bytes(tier, objects[o].object.page_offsets, r.offset, r.len);
                                assert!(bytes[at] == want[..], "thread {thread} round {round}: object {o} completed with wrong bytes");
                            }
                        }
                    }
                    for (bytes, cover) in [(&out[..], &covered[0]), (&device[..], &covered[1])] {
                        let stray = bytes.iter().zip(cover).position(|(&b, &c)| !c && b != POISON);
                        assert_eq!(stray, None, "thread {thread} round {round}: a byte outside every range was written");
                    }
                }
                drop(dev);
            });
        }
    });
    let counts: Vec<usize> = outcomes.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    eprintln!("completed, failed, cancelled, rejected: {:?}", &counts[..4]);
    assert_eq!(counts.iter().sum::<usize>(), THREADS * ROUNDS * OBJECTS);
    assert!(counts[..4].iter().all(|&c| c > 0), "every outcome happened: {counts:?}");
    assert_eq!(t.composite.in_flight().batches, 0);
}
