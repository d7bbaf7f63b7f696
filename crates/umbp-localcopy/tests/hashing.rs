//! Hashing while copying: with a checksum sink in the plan set, every object's bytes are
//! reported exactly once, each piece with the CRC32C of its source bytes, whether the submit
//! runs inline or on the pool (segments split into 1 MiB pieces), streamed or not, objects
//! merged into one segment or not; objects the overlap rule fails are not reported.

mod support;

use support::{pattern, HostBuf, Rng};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::testing::{assert_hashed_once, submit_hashed, CopyReports};
use umbp_plan::{EndpointRegistry, Fragment, Tag};

const PAGE: u64 = 4096;

/// Each object not in `failed` was reported exactly once per byte with the CRC32C of its
/// source bytes in `src` ([`assert_hashed_once`]) and arrived in `dst`; the failed ones were
/// not reported at all.
fn assert_reported_once(
    src: &HostBuf,
    dst: &HostBuf,
    fragments: &[Fragment],
    failed: &[Tag],
    reports: &CopyReports,
) {
    let (src, dst) = (src.bytes(), dst.bytes());
    let source = |at: u64, len: u64| src[at as usize..][..len as usize].to_vec();
    assert_hashed_once(fragments, failed, reports, source);
    for r in reports {
        assert!(!failed.contains(&r.0), "failed object {:?} reported: {r:?}", r.0);
    }
    for f in fragments.iter().filter(|f| !failed.contains(&f.tag)) {
        let (at, to, len) = (f.src_offset as usize, f.dst_offset as usize, f.len as usize);
        assert_eq!(dst[to..to + len], src[at..at + len], "object {:?}", f.tag);
    }
}

#[test]
fn scattered_and_merged_objects_are_reported_once_with_their_crc() {
    for config in support::configs() {
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
        let (failed, reports) = submit_hashed(&engine, &fragments);
        assert!(failed.is_empty(), "{config:?}: {failed:?}");
        assert_reported_once(&arena, &out, &fragments, &failed, &reports);
    }
}

#[test]
fn segments_split_across_the_pool_are_reported_piece_by_piece() {
    for config in support::configs() {
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
        let (failed, reports) = submit_hashed(&engine, &fragments);
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
    let (failed, reports) = submit_hashed(&engine, &fragments);
    assert_eq!(failed, [Tag::new(0), Tag::new(1)]);
    assert_reported_once(&arena, &out, &fragments, &failed, &reports);
}
