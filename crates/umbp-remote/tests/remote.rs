//! Restore and offload against a server in another process, over loopback.

mod support;

use umbp_plan::{Fragment, PlanBuilder, Register, Tag, TransferEngine};

use support::{engine, fill_byte, ucx_or_skip, Exported, Served, POISON};

const PAGE: usize = 64 << 10;

#[test]
fn restores_scattered_pages_byte_exact_over_tcp() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 16 << 20, 3);
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let arena = peer.region("arena").unwrap();
    assert_eq!(arena.len, 16 << 20);
    let remote = engine.register_remote(arena.region, 0, arena.len).unwrap();
    let local = engine.register_memory(vec![POISON; 64 * PAGE]).unwrap();

    // 8 objects of 4 pages each, scattered over the arena, into every other page slot here.
    let mut builder = engine.incremental_builder();
    let mut expected = vec![POISON; 64 * PAGE];
    for object in 0..8u32 {
        let tag = Tag::new(object);
        builder.begin_object(tag).unwrap();
        for page in 0..4usize {
            let src = ((object as usize * 37 + page * 11) % 256) * PAGE;
            let dst = (object as usize * 8 + page * 2) * PAGE;
            builder
                .push(Fragment::new(
                    remote.id(),
                    src as u64,
                    local.id(),
                    dst as u64,
                    PAGE as u64,
                    tag,
                ))
                .unwrap();
            for i in 0..PAGE {
                expected[dst + i] = fill_byte(3, src + i);
            }
        }
        builder.commit_object().unwrap();
    }
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
    drop(handle);
    let got = local.deregister();
    assert!(got == expected, "restored bytes differ");
}

/// Reads the whole of region `name` of the peer back into a new buffer.
fn read_back(
    engine: &umbp_remote::RemoteEngine,
    peer: &umbp_remote::PeerInfo,
    name: &str,
) -> Vec<u8> {
    let region = peer.region(name).unwrap();
    let remote = engine.register_remote(region.region, 0, region.len).unwrap();
    let local = engine.register_memory(vec![0u8; region.len as usize]).unwrap();
    let mut builder = engine.incremental_builder();
    let tag = Tag::new(0);
    builder.begin_object(tag).unwrap();
    builder.push(Fragment::new(remote.id(), 0, local.id(), 0, region.len, tag)).unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
    drop(handle);
    local.deregister()
}

#[test]
fn offload_writes_exactly_its_ranges_at_the_peer() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 16 << 20, 9);
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let arena = peer.region("arena").unwrap();
    let remote = engine.register_remote(arena.region, 0, arena.len).unwrap();
    let source: Vec<u8> = (0..32 * PAGE).map(|i| (i % 251) as u8).collect();
    let local = engine.register_memory(source.clone()).unwrap();

    // 4 objects of 8 pages; each page to a scattered slot of the arena, some adjacent (merged).
    let mut expected: Vec<u8> = (0..16 << 20).map(|i| fill_byte(9, i)).collect();
    let mut builder = engine.incremental_builder();
    for object in 0..4u32 {
        let tag = Tag::new(object);
        builder.begin_object(tag).unwrap();
        for page in 0..8usize {
            let src = (object as usize * 8 + page) * PAGE;
            let slot = if page < 4 {
                object as usize * 20 + page
            } else {
                100 + object as usize * 7 + page * 3
            };
            let dst = slot * PAGE;
            builder
                .push(Fragment::new(
                    local.id(),
                    src as u64,
                    remote.id(),
                    dst as u64,
                    PAGE as u64,
                    tag,
                ))
                .unwrap();
            expected[dst..dst + PAGE].copy_from_slice(&source[src..src + PAGE]);
        }
        builder.commit_object().unwrap();
    }
    let plans = builder.finish().unwrap();
    assert!(
        plans.segment_count() < 32,
        "adjacent pages merged: {} segments",
        plans.segment_count()
    );
    let mut handle = engine.submit(plans);
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
    drop(handle);
    assert!(
        read_back(&engine, &peer, "arena") == expected,
        "the arena differs from what was offloaded"
    );
}

/// Plan rules that accept every pair: how a hand-built plan set reaches an engine without its
/// own rules' checks.
struct AnyPair;
impl umbp_plan::PlanRules for AnyPair {
    fn carries(&self, _: &umbp_plan::Endpoint, _: &umbp_plan::Endpoint) -> bool {
        true
    }
}

#[test]
fn bytes_past_the_export_are_refused_before_any_byte_moves() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 1 << 20, 5);
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let arena = peer.region("arena").unwrap();

    // Through the engine, a remote endpoint past the export does not register.
    let refused = engine.register_remote(arena.region, arena.len - 4096, 8192).unwrap_err();
    // The engine's refusal is the cause, after the registration's own words.
    let cause = std::error::Error::source(&refused).map(ToString::to_string).unwrap_or_default();
    assert!(cause.contains("outside its"), "{refused:?}");
    let unknown = umbp_plan::RemoteRegion { peer: peer.id, region: 7 };
    assert!(engine.register_remote(unknown, 0, 4096).is_err());

    // Registered around the engine (the bare registry checks nothing), it still moves nothing:
    // object 0 reads past the export through it, object 1 reads inside through a good one.
    let oversized = engine.registry().register_remote(arena.region, 0, 2 * arena.len).unwrap();
    let good = engine.register_remote(arena.region, 0, arena.len).unwrap();
    let local = engine.register_memory(vec![POISON; 2 * PAGE]).unwrap();
    let mut builder = engine.incremental_builder();
    let (bad, fine) = (Tag::new(0), Tag::new(1));
    builder.begin_object(bad).unwrap();
    builder
        .push(Fragment::new(oversized.id(), arena.len, local.id(), 0, PAGE as u64, bad))
        .unwrap();
    builder.commit_object().unwrap();
    builder.begin_object(fine).unwrap();
    builder.push(Fragment::new(good.id(), 0, local.id(), PAGE as u64, PAGE as u64, fine)).unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    let failures = handle.wait().to_vec();
    drop(handle);
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(failures[0].tags, [bad]);
    assert!(matches!(failures[0].cause, umbp_plan::FailureCause::NotAccepted(_)), "{failures:?}");
    let got = local.deregister();
    assert!(
        got[..PAGE].iter().all(|&b| b == POISON),
        "the refused object's destination was written"
    );
    assert!(got[PAGE..].iter().enumerate().all(|(i, &b)| b == fill_byte(5, i)));
}

#[test]
fn a_read_only_region_takes_no_writes() {
    if !ucx_or_skip() {
        return;
    }
    let server =
        Served::with("tcp", Exported { read_only_bytes: 1 << 20, ..Exported::arena(1 << 20, 1) });
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let ro = peer.region("ro").unwrap();
    assert!(!ro.writable);
    let remote = engine.register_remote(ro.region, 0, ro.len).unwrap();
    let local = engine.register_memory(vec![0u8; PAGE]).unwrap();

    // The engine's builder refuses the object with a typed reason.
    let mut builder = engine.incremental_builder();
    let tag = Tag::new(0);
    builder.begin_object(tag).unwrap();
    let refused =
        builder.push(Fragment::new(local.id(), 0, remote.id(), 0, PAGE as u64, tag)).unwrap_err();
    assert!(
        matches!(
            refused,
            umbp_plan::Error::Rejected { reason: umbp_plan::RejectReason::ReadOnly(_), .. }
        ),
        "{refused:?}"
    );

    // A hand-built plan set that writes it anyway fails at submit, and the region is intact.
    let mut hand =
        umbp_plan::IncrementalBuilder::new(AnyPair, std::sync::Arc::clone(engine.registry()));
    hand.begin_object(tag).unwrap();
    hand.push(Fragment::new(local.id(), 0, remote.id(), 0, PAGE as u64, tag)).unwrap();
    hand.commit_object().unwrap();
    let mut handle = engine.submit(hand.finish().unwrap());
    let failures = handle.wait().to_vec();
    drop(handle);
    assert_eq!(failures.len(), 1);
    assert!(failures[0].cause.to_string().contains("read-only"), "{}", failures[0].cause);
    let back = read_back(&engine, &peer, "ro");
    assert!(
        back.iter().enumerate().all(|(i, &b)| b == fill_byte(2, i)),
        "the read-only region changed"
    );
}

#[test]
fn restores_over_shared_memory_where_the_machine_allows_it() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("sm", 4 << 20, 12);
    let engine = match umbp_remote::RemoteEngine::new(
        umbp_plan::EndpointRegistry::new(),
        support::config("sm"),
    ) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("skipped: UCX has no shared-memory transport here: {e}");
            return;
        }
    };
    let peer = match engine.connect(server.addr) {
        Ok(peer) => peer,
        Err(e) => {
            eprintln!("skipped: no shared-memory path between the two processes: {e}");
            return;
        }
    };
    let arena = peer.region("arena").unwrap();
    let remote = engine.register_remote(arena.region, 0, arena.len).unwrap();
    let local = engine.register_memory(vec![POISON; 8 * PAGE]).unwrap();
    let mut builder = engine.incremental_builder();
    let tag = Tag::new(0);
    builder.begin_object(tag).unwrap();
    for page in 0..4usize {
        let src = (page * 13 % 64) * PAGE;
        builder
            .push(Fragment::new(
                remote.id(),
                src as u64,
                local.id(),
                (2 * page * PAGE) as u64,
                PAGE as u64,
                tag,
            ))
            .unwrap();
    }
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty(), "{:?}", handle.wait());
    drop(handle);
    let got = local.deregister();
    for page in 0..4usize {
        let src = (page * 13 % 64) * PAGE;
        let dst = 2 * page * PAGE;
        assert!((0..PAGE).all(|i| got[dst + i] == fill_byte(12, src + i)), "page {page}");
        assert!(got[dst + PAGE..dst + 2 * PAGE].iter().all(|&b| b == POISON));
    }
}
