//! Restore a cached prefix into device memory from DRAM and SSD in one batch, then promote
//! the objects that came from SSD into DRAM by offloading them back from the device.
//!
//! Run: `cargo run -p umbp-kv-server-examples --example mixed_restore`

use umbp_composite::{offload, restore, ObjectRange, ObjectTransfer, PagedObject};
use umbp_kv_server_examples::{Pool, GPU};
use umbp_plan::BatchState;

const PAGE: usize = 64 << 10;
const OBJECTS: usize = 8;
const PAGES_PER_OBJECT: usize = 8;
const SIZE: u64 = (PAGE * PAGES_PER_OBJECT) as u64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    umbp_kv_server_examples::install_log_subscriber();
    let pool = Pool::new(OBJECTS * PAGES_PER_OBJECT, PAGE)?;
    // The cache's page table: where each object's pages sit in its tier (byte offsets).
    let tables: Vec<Vec<u64>> = (0..OBJECTS)
        .map(|o| {
            (0..PAGES_PER_OBJECT)
                .map(|k| (((o * PAGES_PER_OBJECT + k) * 37 + 5) % 64 * PAGE) as u64)
                .collect()
        })
        .collect();
    // The KV cache on the device: one region per half of the layers; object `o`'s first half
    // goes to region 0 at `o × SIZE/2`, its second half to region 1.
    let kv = [
        pool.hbm.alloc_device(GPU, OBJECTS as u64 * SIZE / 2)?,
        pool.hbm.alloc_device(GPU, OBJECTS as u64 * SIZE / 2)?,
    ];
    let ranges: Vec<[ObjectRange; 2]> = (0..OBJECTS as u64)
        .map(|o| {
            [
                ObjectRange::new(0, SIZE / 2, kv[0].id(), o * SIZE / 2),
                ObjectRange::new(SIZE / 2, SIZE / 2, kv[1].id(), o * SIZE / 2),
            ]
        })
        .collect();
    // Even objects are cached in DRAM, odd ones on SSD; tags are the server's own ids.
    let tier = |o: usize| if o % 2 == 0 { pool.dram.id() } else { pool.ssd.id() };
    let objects: Vec<ObjectTransfer> = (0..OBJECTS)
        .map(|o| {
            ObjectTransfer::new(
                9000 + o as u64,
                PagedObject::new(tier(o), &tables[o], PAGE as u64, SIZE),
                &ranges[o],
            )
        })
        .collect();

    let mut builder = pool.composite.builder();
    let report = restore(&mut builder, &objects)?;
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");

    // Every byte of every object is where the server asked for it.
    let device = [pool.read_device(&kv[0])?, pool.read_device(&kv[1])?];
    for (o, table) in tables.iter().enumerate() {
        let source = if o % 2 == 0 { &pool.dram_bytes } else { &pool.file_bytes };
        for i in 0..SIZE as usize {
            let (half, at) = (i / (SIZE as usize / 2), i % (SIZE as usize / 2));
            let got = device[half][o * SIZE as usize / 2 + at];
            assert_eq!(got, Pool::object_byte(source, table, PAGE, i), "object {o} byte {i}");
        }
    }
    println!(
        "restored {OBJECTS} objects ({} MiB) from DRAM and SSD into device memory",
        (OBJECTS as u64 * SIZE) >> 20
    );

    // Promote the SSD objects: offload their device copies into the same pages of the DRAM
    // tier. An offload's ranges must cover the whole object.
    let promoted: Vec<ObjectTransfer> = objects
        .iter()
        .filter(|o| o.object.tier == pool.ssd.id())
        .map(|o| {
            let mut o = *o;
            o.object.tier = pool.dram.id();
            o
        })
        .collect();
    let report = offload(&mut builder, &promoted)?;
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    drop(builder);
    // Ending the DRAM tier's registration (it waits for any batch still using it) hands the
    // arena back to read.
    let dram = pool.dram.deregister();
    for o in (1..OBJECTS).step_by(2) {
        for &page in &tables[o] {
            let page = page as usize..page as usize + PAGE;
            assert!(dram[page.clone()] == pool.file_bytes[page], "object {o}");
        }
    }
    println!("offloaded the {} SSD objects into DRAM: the tiers now agree", promoted.len());
    Ok(())
}
