//! Sixteen threads share one engine and each restores its own region of one file into buffers
//! of its own from `AlignedBuffer::for_direct_io` that are large enough to be huge-page
//! mappings. Each round makes a fresh buffer, registers it, reads into it, takes it back and
//! drops it (unmapping it) while the other threads' reads are still in flight. Reads merged up
//! to 1 MiB cross the buffers' 2 MiB boundaries. Every byte must be right, with and without
//! `O_DIRECT`, on both backends.

mod support;

use std::sync::Arc;

use support::{Rng, POISON};
use umbp_plan::{AlignedBuffer, EndpointRegistry, Fragment, Tag};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::{Backend, SsdEngine};

const THREADS: u64 = 16;
const ROUNDS: u64 = 3;
/// Each thread's share of the file.
const REGION: u64 = 3 << 20;
const PAGE: u64 = 64 << 10;
/// Where a thread's bytes start in its buffer: a 1 MiB read from here on crosses the buffer's
/// first 2 MiB boundary.
const SHIFT: u64 = 1536 << 10;

fn thread_rounds(engine: &SsdEngine, file: umbp_plan::EndpointId, content: &[u8], t: u64) {
    let base = t * REGION;
    let want = &content[base as usize..(base + REGION) as usize];
    let mut rng = Rng(t + 7);
    for round in 0..ROUNDS {
        let mut buffer = AlignedBuffer::for_direct_io((SHIFT + REGION) as usize);
        assert_eq!(buffer.align(), AlignedBuffer::HUGE_PAGE, "a buffer of its own mapping");
        buffer.fill(POISON);
        let buffer = engine.register_memory(buffer).expect("register the buffer");
        let mut pages: Vec<u64> = (0..REGION / PAGE).collect();
        // Every other round in file order, so that the builder merges pages into 1 MiB reads;
        // in between shuffled, one read per page.
        if round % 2 == 1 {
            rng.shuffle(&mut pages);
        }
        let reads: Vec<Vec<Fragment>> = pages
            .iter()
            .map(|&p| {
                let (at, tag) = (p * PAGE, Tag::new(p as u32));
                vec![Fragment::new(file, base + at, buffer.id(), SHIFT + at, PAGE, tag)]
            })
            .collect();
        let outcome = support::transfer(engine, &reads);
        assert!(outcome.failed_tags().is_empty(), "thread {t} round {round}: {outcome:?}");
        let bytes = buffer.deregister();
        assert!(bytes[..SHIFT as usize].iter().all(|&b| b == POISON), "thread {t}: before");
        assert!(&bytes[SHIFT as usize..] == want, "thread {t} round {round}: bytes differ");
    }
}

fn restore_by_threads(backend: Backend, direct: bool, dir: &std::path::Path) {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(support::engine(&registry, backend));
    let path = dir.join(format!("huge_pages_{backend:?}_{direct}.bin"));
    let content =
        support::pattern(backend as u64 * 2 + u64::from(direct), (THREADS * REGION) as usize);
    support::write_file(&path, &content);
    let file_reg = engine
        .register_file(
            FileSource::open(&path, FileOptions::new().direct(direct).writable(false)),
            0,
            THREADS * REGION,
        )
        .unwrap();
    let file = file_reg.id();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (engine, content) = (Arc::clone(&engine), &content);
            scope.spawn(move || thread_rounds(&engine, file, content, t));
        }
    });
}

#[test]
fn sixteen_threads_restore_into_huge_page_buffers_byte_exact() {
    if !cfg!(target_os = "linux") {
        eprintln!("SKIP: huge-page buffers are made on Linux only");
        return;
    }
    let name = "sixteen_threads_restore_into_huge_page_buffers_byte_exact";
    support::each_backend_and_mode(name, restore_by_threads);
}
