//! A layer-wise restore: the server starts restoring a prefix, then runs its forward pass layer
//! group by layer group, each group waiting only for its own KV ranges.
//!
//! Then the same restore on the server's compute stream: the device work is queued there, the
//! host waits only until each group is *queued*, and one event per group is recorded for any
//! other stream to wait on. (The simulated device takes any handle as a stream; on a GPU it is
//! the server's `CUstream`, such as `torch.cuda.current_stream().cuda_stream`.)
//!
//! Run: `cargo run -p umbp-kv-server-examples --example layerwise_restore`

use std::time::{Duration, Instant};

use umbp_composite::{start_restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_kv_server_examples::{Pool, GPU};
use umbp_plan::{BatchState, DeviceStream};

const PAGE: usize = 64 << 10;
const OBJECTS: usize = 16;
/// Each object holds one range per layer group.
const GROUPS: u64 = 8;
const RANGE: u64 = 2 * PAGE as u64;
const SIZE: u64 = GROUPS * RANGE;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    umbp_kv_server_examples::install_log_subscriber();
    let pages_per_object = (SIZE / PAGE as u64) as usize;
    let pool = Pool::new(OBJECTS * pages_per_object, PAGE)?;
    let tables: Vec<Vec<u64>> = (0..OBJECTS)
        .map(|o| {
            (0..pages_per_object)
                .map(|k| {
                    (((o * pages_per_object + k) * 29) % (OBJECTS * pages_per_object) * PAGE) as u64
                })
                .collect()
        })
        .collect();
    // One device region per layer group; object `o`'s range of group `g` lands in region `g`.
    let regions = (0..GROUPS)
        .map(|_| pool.hbm.alloc_device(GPU, OBJECTS as u64 * RANGE))
        .collect::<Result<Vec<_>, _>>()?;
    let ranges: Vec<Vec<ObjectRange>> = (0..OBJECTS as u64)
        .map(|o| {
            (0..GROUPS)
                .map(|g| {
                    ObjectRange::new(g * RANGE, RANGE, regions[g as usize].id(), o * RANGE)
                        .in_group(g as u32)
                })
                .collect()
        })
        .collect();
    let objects: Vec<ObjectTransfer> = (0..OBJECTS)
        .map(|o| {
            ObjectTransfer::new(
                o as u64,
                PagedObject::new(
                    if o % 4 == 3 { pool.ssd.id() } else { pool.dram.id() },
                    &tables[o],
                    PAGE as u64,
                    SIZE,
                ),
                &ranges[o],
            )
        })
        .collect();

    let mut builder = pool.composite.builder();
    let start = Instant::now();
    // Returns at once: the composite's executor moves group 0 first on every engine.
    let batch = start_restore(&mut builder, &objects)?;
    for g in 0..GROUPS as u32 {
        batch.wait_group(g);
        println!("layer group {g} ready after {:?}", start.elapsed());
        // The forward pass of this group's layers (here: a pause).
        std::thread::sleep(Duration::from_millis(2));
    }
    let report = batch.wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    for (g, region) in regions.iter().enumerate() {
        let bytes = pool.read_device(region)?;
        for (o, table) in tables.iter().enumerate() {
            let source = if o % 4 == 3 { &pool.file_bytes } else { &pool.dram_bytes };
            for i in 0..RANGE as usize {
                let want = Pool::object_byte(source, table, PAGE, g * RANGE as usize + i);
                assert_eq!(bytes[o * RANGE as usize + i], want, "group {g} object {o}");
            }
        }
    }
    println!("all {OBJECTS} objects restored and verified in {:?}", start.elapsed());

    // The same restore on the compute stream, with one event per layer group.
    // SAFETY: the simulated device accepts any handle; on a GPU this must be a live stream of
    // `GPU` that outlives the batch.
    let stream = unsafe { DeviceStream::new(GPU, 0x57) };
    let events = pool.hbm.layer_events(stream);
    let mut builder = pool.composite.builder();
    builder.set_stream(Some(stream));
    builder.set_group_listener(events.clone());
    let start = Instant::now();
    let batch = start_restore(&mut builder, &objects)?;
    for g in 0..GROUPS as u32 {
        // Returns once group `g` is done on the host (SSD, staging) or queued on the stream:
        // the layer's kernels, queued next on the same stream, run after its bytes.
        batch.wait_group_enqueued(g);
        let event = events.event(g, None)?.expect("recorded when enqueued");
        println!("layer group {g} queued after {:?} (event {event:#x})", start.elapsed());
    }
    let report = batch.wait();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    for g in 0..GROUPS as u32 {
        events.synchronize(g)?; // the host can wait for any group's event too
    }
    println!("the same restore on a stream: completed, {GROUPS} group events reached");
    Ok(())
}
