//! Eight threads submitting to one engine at once, for a bounded number of rounds, each
//! writing and reading back its own region of one shared file: every byte correct.

mod support;

use std::sync::Arc;

use support::{HostBuf, Rng, POISON};
use umbp_plan::{EndpointRegistry, Fragment, Tag};
use umbp_plan::{FileOptions, FileSource, Register};
use umbp_ssd::{Backend, SsdEngine};

const THREADS: u64 = 8;
const ROUNDS: u64 = 12;
const REGION: u64 = 2 << 20;
const PAGE: u64 = 32 << 10;

fn thread_rounds(
    engine: &SsdEngine,
    registry: &EndpointRegistry,
    file: umbp_plan::EndpointId,
    t: u64,
) {
    let base = t * REGION;
    let mut model = vec![0u8; REGION as usize];
    let mut rng = Rng(t * 1000 + 1);
    let mut source = HostBuf::new(registry, REGION as usize, (t as usize) % 3, 0);
    let mut destination = HostBuf::new(registry, REGION as usize, 0, POISON);
    for round in 0..ROUNDS {
        // Write a random subset of pages (some as unaligned halves) with this round's bytes.
        let fresh = support::pattern(t * 100 + round, REGION as usize);
        source.bytes_mut().copy_from_slice(&fresh);
        let mut writes = Vec::new();
        for page in 0..REGION / PAGE {
            if rng.below(3) == 0 {
                continue;
            }
            let tag = Tag::new(page as u32);
            let at = page * PAGE;
            let object = if rng.below(4) == 0 {
                // Two unaligned halves, the second first so that they do not merge: two
                // read-modify-writes of the block they share.
                let cut = 1 + rng.below(PAGE - 1);
                vec![
                    Fragment::new(source.id, at + cut, file, base + at + cut, PAGE - cut, tag),
                    Fragment::new(source.id, at, file, base + at, cut, tag),
                ]
            } else {
                vec![Fragment::new(source.id, at, file, base + at, PAGE, tag)]
            };
            model[at as usize..(at + PAGE) as usize]
                .copy_from_slice(&fresh[at as usize..(at + PAGE) as usize]);
            writes.push(object);
        }
        let outcome = support::transfer(engine, &writes);
        assert!(outcome.failed_tags().is_empty(), "thread {t} round {round}: {outcome:?}");

        // Read the whole region back, pages in shuffled order, into poisoned memory.
        destination.bytes_mut().fill(POISON);
        let mut pages: Vec<u64> = (0..REGION / PAGE).collect();
        rng.shuffle(&mut pages);
        let reads: Vec<Vec<Fragment>> = pages
            .iter()
            .map(|&p| {
                vec![Fragment::new(
                    file,
                    base + p * PAGE,
                    destination.id,
                    p * PAGE,
                    PAGE,
                    Tag::new(p as u32),
                )]
            })
            .collect();
        let outcome = support::transfer(engine, &reads);
        assert!(outcome.failed_tags().is_empty(), "thread {t} round {round}: {outcome:?}");
        assert!(destination.bytes() == &model[..], "thread {t} round {round}: bytes differ");
    }
}

fn concurrent(backend: Backend, direct: bool, dir: &std::path::Path) {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(support::engine(&registry, backend));
    let path = dir.join(format!("concurrent_{backend:?}_{direct}.bin"));
    support::write_file(&path, &vec![0; (THREADS * REGION) as usize]);
    let file_reg = engine
        .register_file(
            FileSource::open(&path, FileOptions::new().direct(direct)),
            0,
            THREADS * REGION,
        )
        .unwrap();
    let file = file_reg.id();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (engine, registry) = (Arc::clone(&engine), Arc::clone(&registry));
            scope.spawn(move || thread_rounds(&engine, &registry, file, t));
        }
    });
}

#[test]
fn eight_threads_submitting_concurrently_get_every_byte_right() {
    let name = "eight_threads_submitting_concurrently_get_every_byte_right";
    support::each_backend_and_mode(name, concurrent);
}
