//! Block checksums on loads from another node's memory: the composite's default policy
//! verifies remote tiers, on the staged route into the device and the direct one into host
//! memory (where the engine hashes each get's bytes as it opens them, and each put's as it
//! seals them), and a block whose bytes are not the expected ones fails alone.

mod support;

use std::sync::{Arc, Mutex};

use umbp_composite::{
    restore, CompositeEngine, ObjectError, ObjectRange, ObjectTransfer, PagedObject, Staging,
};
use umbp_hbm::{HbmConfig, HbmEngine, SimDevice};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::checksum::CopyHashes;
use umbp_plan::{
    DeviceOrdinal, EndpointRegistry, FailureCause, Fragment, ObjectState, PlanBuilder, Register,
    Segment, Tag, TransferEngine,
};
use umbp_remote::RemoteEngine;

use support::{fill_byte, ucx_or_skip, Served};

const PAGE: u64 = 16 << 10;

#[test]
fn remote_loads_are_verified_and_a_wrong_block_fails_alone() {
    if !ucx_or_skip() {
        return;
    }
    let pages = 64usize;
    let server = Served::start("tcp", pages * PAGE as usize, 9);
    let registry = EndpointRegistry::new();
    let host = Arc::new(LocalCopyEngine::new(registry.clone()));
    let hbm = Arc::new(HbmEngine::new(
        Arc::new(SimDevice::new(1)),
        registry.clone(),
        HbmConfig::default(),
    ));
    let ucx = Arc::new(RemoteEngine::new(registry.clone(), support::config("tcp")).unwrap());
    let peer = ucx.connect(server.addr).unwrap();
    let engines: Vec<Arc<dyn TransferEngine>> = vec![host, hbm.clone(), ucx];
    let composite = CompositeEngine::new(registry, engines);
    let arena = &peer.regions[0];
    let remote = composite.register_remote(arena.region, 0, arena.len).unwrap();
    let bounce = composite.register_memory(vec![0u8; 256 << 10]).unwrap();
    composite.set_staging(Staging::new(bounce.id()).with_stage_bytes(24 << 10)).unwrap();
    let dev = hbm.alloc_device(DeviceOrdinal::new(0), 4 * 3 * PAGE).unwrap();
    let out = composite.register_memory(vec![0u8; (4 * 3 * PAGE) as usize]).unwrap();

    let size = 3 * PAGE;
    let tables: Vec<Vec<u64>> =
        (0..4u64).map(|o| (0..3).map(|k| ((o * 3 + k) * 5 % 64) * PAGE).collect()).collect();
    let crc = |table: &[u64]| {
        let bytes: Vec<u8> = (0..size)
            .map(|b| fill_byte(9, (table[(b / PAGE) as usize] + b % PAGE) as usize))
            .collect();
        crc32c::crc32c(&bytes)
    };
    // Objects 0 and 1 into the device (staged), 2 and 3 into host memory (direct); object 1
    // and object 3 are given a checksum their bytes do not have.
    let ranges: Vec<[ObjectRange; 2]> = (0..4u64)
        .map(|o| {
            let dst = if o < 2 { dev.id() } else { out.id() };
            [
                ObjectRange::new(0, 5000, dst, o * size),
                ObjectRange::new(5000, size - 5000, dst, o * size + 5000).in_group(1),
            ]
        })
        .collect();
    let objects: Vec<ObjectTransfer> = (0..4)
        .map(|o| {
            let object = PagedObject::new(remote.id(), &tables[o], PAGE, size);
            let wrong = u32::from(o % 2 == 1);
            ObjectTransfer::new(o as u64, object, &ranges[o]).with_checksum(crc(&tables[o]) ^ wrong)
        })
        .collect();
    let report = restore(&mut composite.builder(), &objects).unwrap();
    for (o, r) in report.objects.iter().enumerate() {
        if o % 2 == 0 {
            assert_eq!(r.state, ObjectState::Completed, "{r:?}");
            assert_eq!(r.checksum, Some(crc(&tables[o])));
        } else {
            assert!(
                matches!(
                    r.error,
                    Some(ObjectError::Failed { cause: FailureCause::ChecksumMismatch { .. }, .. })
                ),
                "{r:?}"
            );
        }
    }
    assert_eq!(composite.metrics().checksum_mismatches(), 2);
    assert!(composite.metrics_text().contains("umbp_checksum_mismatches_total{tier=\"remote\"} 2"));
}

/// What a checksum sink saw: (object, piece, CRC32C).
type Seen = Arc<Mutex<Vec<(Tag, Segment, u32)>>>;

/// The engine hashes what a checked request moves, a get's bytes as it opens them and a
/// put's as it seals them: with a checksum sink, 16 threads restoring and then offloading at
/// once over two lanes each see every byte of each of their objects reported exactly once, in
/// pieces of one object each, with the CRC32C of the bytes moved (a get's as the server holds
/// them, a put's as the caller's buffer holds them, which the server then holds too),
/// although the objects' fragments are adjacent and merge into shared segments.
#[test]
fn a_checked_request_reports_each_objects_pieces_with_their_crc_as_it_moves_them() {
    if !ucx_or_skip() {
        return;
    }
    const THREADS: usize = 16;
    const OBJECTS: u64 = 6;
    const SPAN: u64 = OBJECTS * 3 * PAGE;
    let server = Served::start("tcp", THREADS * SPAN as usize, 4);
    let engine = Arc::new(support::engine("tcp"));
    let peer = engine.connect(server.addr).unwrap();
    assert_eq!(peer.lanes, 2);
    let region = &peer.regions[0];
    let remote = Arc::new(engine.register_remote(region.region, 0, region.len).unwrap());
    let local = engine.register_memory(vec![0u8; 4096]).unwrap();
    assert!(engine.hashes_while_copying(remote.endpoint(), local.endpoint()));
    assert!(engine.hashes_while_copying(local.endpoint(), remote.endpoint()));
    assert!(!engine.hashes_while_copying(local.endpoint(), local.endpoint()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (engine, remote) = (Arc::clone(&engine), Arc::clone(&remote));
            std::thread::spawn(move || {
                let base = t as u64 * SPAN;
                // A get of what the server was filled with, then a put of other bytes.
                let restored = vec![0u8; SPAN as usize];
                let offloaded: Vec<u8> =
                    (0..SPAN).map(|i| (i as u8).wrapping_mul(31) ^ t as u8 ^ 0x5a).collect();
                for (write, bytes) in [(false, restored), (true, offloaded)] {
                    let host = engine.register_memory(bytes).unwrap();
                    let (src, dst) = match write {
                        true => (host.id(), remote.id()),
                        false => (remote.id(), host.id()),
                    };
                    let (src_base, dst_base) = if write { (0, base) } else { (base, 0) };
                    // Object o: 1, 2 or 3 pages (odd lengths, so pieces end mid-page), each
                    // object right behind the previous one on both sides: their fragments
                    // merge.
                    let mut at = 0u64;
                    let mut objects = Vec::new();
                    let mut builder = engine.incremental_builder();
                    for o in 0..OBJECTS {
                        let len = (o % 3 + 1) * PAGE - 100 * o;
                        let tag = Tag::new(o as u32);
                        builder.begin_object(tag).unwrap();
                        let half = len / 2;
                        for (off, n) in [(0, half), (half, len - half)] {
                            let (s, d) = (src_base + at + off, dst_base + at + off);
                            builder.push(Fragment::new(src, s, dst, d, n, tag)).unwrap();
                        }
                        builder.commit_object().unwrap();
                        objects.push((tag, at, len));
                        at += len;
                    }
                    let mut plans = builder.finish().unwrap();
                    assert!(
                        plans.segment_count() < OBJECTS as usize,
                        "the objects' fragments merged ({} segments)",
                        plans.segment_count()
                    );
                    let seen: Seen = Seen::default();
                    let log = Arc::clone(&seen);
                    plans.set_copy_hashes(Some(CopyHashes::new(move |_plan, tag, piece, crc| {
                        log.lock().unwrap().push((tag, piece, crc));
                    })));
                    let mut handle = engine.submit(plans);
                    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
                    drop(handle);
                    let bytes = host.deregister();
                    // What the server holds at byte `i` of this thread's share.
                    let held = |i: u64| match write {
                        true => bytes[i as usize],
                        false => fill_byte(4, (base + i) as usize),
                    };
                    // A piece's offset on the host side, and on the server's.
                    let sides = |p: &Segment| match write {
                        true => (p.src_offset, p.dst_offset),
                        false => (p.dst_offset, p.src_offset),
                    };
                    let mut seen = seen.lock().unwrap().clone();
                    seen.sort_by_key(|(tag, piece, _)| (tag.get(), sides(piece).0));
                    for &(tag, at, len) in &objects {
                        let mut next = at;
                        for (_, piece, crc) in seen.iter().filter(|(t, _, _)| *t == tag) {
                            let (host_at, server_at) = sides(piece);
                            assert_eq!(host_at, next, "object {tag:?}: a gap or an overlap");
                            assert_eq!(server_at, base + host_at);
                            let expected: Vec<u8> =
                                (host_at..host_at + piece.len).map(held).collect();
                            let landed = &bytes[host_at as usize..][..piece.len as usize];
                            assert!(landed == expected, "object {tag:?}: wrong bytes");
                            assert_eq!(*crc, crc32c::crc32c(&expected), "object {tag:?}: CRC");
                            next += piece.len;
                        }
                        assert_eq!(next, at + len, "object {tag:?}: not every byte reported");
                    }
                    assert_eq!(
                        seen.iter().filter(|(t, _, _)| t.get() >= OBJECTS as u32).count(),
                        0
                    );
                    if write {
                        // The server holds what was offloaded.
                        let back = engine.register_memory(vec![0u8; at as usize]).unwrap();
                        let f = Fragment::new(remote.id(), base, back.id(), 0, at, Tag::new(0));
                        let mut handle = engine.submit(engine.plan(&[f]));
                        assert!(handle.wait().is_empty(), "{:?}", handle.wait());
                        drop(handle);
                        assert!(back.deregister() == bytes[..at as usize], "the server's bytes");
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}
