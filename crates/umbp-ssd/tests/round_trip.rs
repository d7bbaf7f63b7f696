//! Round trip: 64 MiB of a known pattern written through the engine in scattered 64 KiB pages,
//! read back through the engine into poisoned memory in shuffled order, bytes exact; with
//! `O_DIRECT` and buffered, on io_uring and on the fallback.

mod support;

use std::path::Path;

use support::{HostBuf, Rng, POISON};
use umbp_plan::{EndpointRegistry, Fragment, Tag};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::Backend;

const PAGE: u64 = 64 << 10;
const TOTAL: u64 = 64 << 20;
const PAGES_PER_OBJECT: u64 = 16;

fn round_trip(dir: &Path, backend: Backend, direct: bool) {
    let registry = EndpointRegistry::new();
    let engine = support::engine(&registry, backend);
    let path = dir.join(format!("round_trip_{backend:?}_{direct}.bin"));
    let options = FileOptions::new().create(true).direct(direct);
    let file_reg = engine.register_file(FileSource::open(&path, options), 0, TOTAL).expect("open");
    let file = file_reg.id();
    assert_eq!(engine.file_info(file).map(|i| i.direct), Some(direct));

    let pages = TOTAL / PAGE;
    let mut rng = Rng(0x5eed ^ u64::from(direct));
    // Page `i` of the objects' bytes lives in file page `placement[i]`.
    let mut placement: Vec<u64> = (0..pages).collect();
    rng.shuffle(&mut placement);

    let mut source = HostBuf::new(&registry, TOTAL as usize, 0, 0);
    let pattern = support::pattern(7, TOTAL as usize);
    source.bytes_mut().copy_from_slice(&pattern);

    let object = |o: u64, to_file: bool, dst: &HostBuf| -> Vec<Fragment> {
        (o * PAGES_PER_OBJECT..(o + 1) * PAGES_PER_OBJECT)
            .map(|i| {
                let tag = Tag::new(o as u32);
                let file_offset = placement[i as usize] * PAGE;
                if to_file {
                    Fragment::new(source.id, i * PAGE, file, file_offset, PAGE, tag)
                } else {
                    Fragment::new(file, file_offset, dst.id, i * PAGE, PAGE, tag)
                }
            })
            .collect()
    };
    let objects = TOTAL / PAGE / PAGES_PER_OBJECT;

    let writes: Vec<Vec<Fragment>> = (0..objects).map(|o| object(o, true, &source)).collect();
    let outcome = support::transfer(&engine, &writes);
    assert!(outcome.failures.is_empty() && outcome.rejected.is_empty(), "{outcome:?}");

    let on_disk = std::fs::read(&path).expect("read back the file");
    assert_eq!(on_disk.len() as u64, TOTAL);
    for (i, &slot) in placement.iter().enumerate() {
        let (at, from) = ((slot * PAGE) as usize, i * PAGE as usize);
        assert!(
            on_disk[at..at + PAGE as usize] == pattern[from..from + PAGE as usize],
            "file page {slot} does not hold object page {i}"
        );
    }

    let destination = HostBuf::new(&registry, TOTAL as usize, 0, POISON);
    let mut order: Vec<u64> = (0..objects).collect();
    rng.shuffle(&mut order);
    let reads: Vec<Vec<Fragment>> = order
        .iter()
        .map(|&o| {
            let mut fragments = object(o, false, &destination);
            rng.shuffle(&mut fragments);
            fragments
        })
        .collect();
    let outcome = support::transfer(&engine, &reads);
    assert!(outcome.failures.is_empty() && outcome.rejected.is_empty(), "{outcome:?}");
    assert!(destination.bytes() == &pattern[..], "the bytes read back differ ({backend:?})");
    let file = file_reg.deregister();
    assert_eq!(file.metadata().expect("still open").len(), TOTAL);
}

#[test]
fn round_trip_64_mib_o_direct() {
    let Some(dir) = support::direct_dir("round_trip_64_mib_o_direct") else { return };
    for backend in support::backends("round_trip_64_mib_o_direct") {
        round_trip(dir.path(), backend, true);
    }
}

#[test]
fn round_trip_64_mib_buffered() {
    let dir = support::temp_dir();
    for backend in support::backends("round_trip_64_mib_buffered") {
        round_trip(dir.path(), backend, false);
    }
}
