//! Hashing while copying: with a checksum sink in the plan set, every object's bytes are
//! reported exactly once, each piece with the CRC32C of its source bytes, whether the submit
//! runs inline or on the pool (segments split into 1 MiB pieces), streamed or not, objects
//! merged into one segment or not; objects the overlap rule fails are not reported.

mod support;

use std::sync::{Arc, Mutex};

use support::{pattern, HostBuf, Rng};
use umbp_localcopy::{LocalCopyConfig, LocalCopyEngine};
use umbp_plan::checksum::CopyHashes;
use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Segment, Tag, TransferEngine};

const PAGE: u64 = 4096;

fn configs() -> [LocalCopyConfig; 3] {
    [
        LocalCopyConfig::default(),
        LocalCopyConfig {
            threads: 2,
            parallel_threshold: 0,
            non_temporal_threshold: 64,
            ..LocalCopyConfig::default()
        },
        LocalCopyConfig { threads: 1, non_temporal: false, ..LocalCopyConfig::default() },
    ]
}

/// Plans `fragments` (an object per run of equal tags) with a checksum sink, submits: the
/// failed objects and the reports, (object, piece, CRC) each.
fn hashed(
    engine: &LocalCopyEngine,
    fragments: &[Fragment],
) -> (Vec<Tag>, Vec<(Tag, Segment, u32)>) {
    let mut b = engine.incremental_builder();
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        b.begin_object(group[0].tag).unwrap();
        for f in group {
            b.push(*f).unwrap();
        }
        b.commit_object().unwrap();
    }
    let mut plans = b.finish().unwrap();
    let reports = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&reports);
    plans.set_copy_hashes(Some(CopyHashes::new(move |_, tag, piece, crc| {
        log.lock().unwrap().push((tag, piece, crc));
    })));
    let mut failed: Vec<Tag> =
        engine.submit(plans).wait().iter().flat_map(|f| f.tags.clone()).collect();
    failed.sort_unstable();
    failed.dedup();
    let reports = reports.lock().unwrap().clone();
    (failed, reports)
}

/// Sorted, adjacent runs merged.
fn merged(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (at, len) in runs {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == at => last.1 += len,
            _ => out.push((at, len)),
        }
    }
    out
}

/// Each object not in `failed` was reported exactly once per source byte, with the CRC32C of
/// the bytes of `src`; the failed ones not at all; every reported byte arrived in `dst`.
fn assert_reported_once(
    src: &HostBuf,
    dst: &HostBuf,
    fragments: &[Fragment],
    failed: &[Tag],
    reports: &[(Tag, Segment, u32)],
) {
    let (src, dst) = (src.bytes(), dst.bytes());
    for group in fragments.chunk_by(|a, b| a.tag == b.tag) {
        let tag = group[0].tag;
        let mine: Vec<&(Tag, Segment, u32)> = reports.iter().filter(|r| r.0 == tag).collect();
        if failed.contains(&tag) {
            assert!(mine.is_empty(), "failed object {tag:?} reported: {mine:?}");
            continue;
        }
        let pieces = merged(mine.iter().map(|r| (r.1.src_offset, r.1.len)).collect());
        let want = merged(group.iter().map(|f| (f.src_offset, f.len)).collect());
        assert_eq!(pieces, want, "object {tag:?}");
        let total: u64 = mine.iter().map(|r| r.1.len).sum();
        assert_eq!(total, want.iter().map(|w| w.1).sum::<u64>(), "object {tag:?}: overlap");
        for &&(_, p, crc) in &mine {
            let bytes = &src[p.src_offset as usize..][..p.len as usize];
            assert_eq!(crc, crc32c::crc32c(bytes), "object {tag:?}, piece {p:?}");
            assert_eq!(&dst[p.dst_offset as usize..][..p.len as usize], bytes);
        }
    }
}

#[test]
fn scattered_and_merged_objects_are_reported_once_with_their_crc() {
    for config in configs() {
        let engine = LocalCopyEngine::with_config(EndpointRegistry::new(), config.clone());
        let arena = HostBuf::new(256 * PAGE as usize, |i| pattern(3, i));
        let out = HostBuf::poisoned(128 * PAGE as usize);
        let (a, o) = (arena.register(&engine), out.register(&engine));
        // 16 objects of 8 pages; even objects take adjacent arena pages in order (one merged
        // segment each, merging with the next object where it follows on), odd ones scattered.
        let mut rng = Rng(11);
        let scattered = rng.permutation(128);
        let fragments: Vec<Fragment> = (0..128u64)
            .map(|slot| {
                let object = slot / 8;
                let from = if object % 2 == 0 {
                    slot
                } else {
                    128 + scattered[slot as usize] as u64 % 128
                };
                Fragment::new(a, from * PAGE, o, slot * PAGE, PAGE, Tag::new(object as u32))
            })
            .collect();
        let (failed, reports) = hashed(&engine, &fragments);
        assert!(failed.is_empty(), "{config:?}: {failed:?}");
        assert_reported_once(&arena, &out, &fragments, &failed, &reports);
    }
}

#[test]
fn segments_split_across_the_pool_are_reported_piece_by_piece() {
    for config in configs() {
        let engine = LocalCopyEngine::with_config(EndpointRegistry::new(), config.clone());
        let len = 3 << 20;
        let arena = HostBuf::new(3 * len, |i| pattern(5, i));
        let out = HostBuf::poisoned(3 * len);
        let (a, o) = (arena.register(&engine), out.register(&engine));
        // Three objects of 3 MiB + 1 KiB - 1 .. in one run: one segment of them all.
        let cuts = [0u64, len as u64 + 1023, 2 * len as u64 - 17, 3 * len as u64];
        let fragments: Vec<Fragment> = cuts
            .windows(2)
            .enumerate()
            .map(|(k, w)| Fragment::new(a, w[0], o, w[0], w[1] - w[0], Tag::new(k as u32)))
            .collect();
        let (failed, reports) = hashed(&engine, &fragments);
        assert!(failed.is_empty(), "{config:?}: {failed:?}");
        assert_reported_once(&arena, &out, &fragments, &failed, &reports);
    }
}

#[test]
fn objects_the_overlap_rule_fails_are_not_reported() {
    let engine = LocalCopyEngine::new(EndpointRegistry::new());
    let arena = HostBuf::new(8 * PAGE as usize, |i| pattern(9, i));
    let out = HostBuf::poisoned(8 * PAGE as usize);
    let (a, o) = (arena.register(&engine), out.register(&engine));
    // Objects 0 and 1 both write page 0 of `out`; object 2 writes pages 4 and 5.
    let fragments = [
        Fragment::new(a, 0, o, 0, PAGE, Tag::new(0)),
        Fragment::new(a, PAGE, o, 0, PAGE, Tag::new(1)),
        Fragment::new(a, 2 * PAGE, o, 4 * PAGE, 2 * PAGE, Tag::new(2)),
    ];
    let (failed, reports) = hashed(&engine, &fragments);
    assert_eq!(failed, [Tag::new(0), Tag::new(1)]);
    assert_reported_once(&arena, &out, &fragments, &failed, &reports);
}
