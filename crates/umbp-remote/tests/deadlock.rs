//! A restore and an offload to one peer at once: the checked link's reads and writes never
//! wait on each other, whatever the sizes.

mod support;

use std::time::Duration;

use umbp_plan::{Fragment, PlanBuilder, Register, Tag, TransferEngine};

use support::{engine, fill_byte, ucx_or_skip, Served, POISON};

const MIB: u64 = 1 << 20;

/// Round after round, a get of `get` (pieces of `piece` bytes, scattered so that they merge
/// into one request where they are adjacent) submitted just before a put of as many bytes, to
/// one peer: both complete, every byte right.
fn restore_beside_offload(piece: u64, total: u64, rounds: usize) {
    let server = Served::start("tcp", (4 * total) as usize, 3);
    let engine = engine("tcp");
    let peer = engine.connect(server.addr).unwrap();
    let remote = engine.register_remote(peer.regions[0].region, 0, peer.regions[0].len).unwrap();
    let outgoing: Vec<u8> = (0..total as usize).map(|i| (i % 251) as u8 ^ 0x5a).collect();
    let source = engine.register_memory(outgoing.clone()).unwrap();
    for round in 0..rounds {
        let sink = engine.register_memory(vec![POISON; total as usize]).unwrap();
        // The get reads the first `total` bytes of the arena; the put writes the third quarter.
        let mut builder = engine.incremental_builder();
        builder.begin_object(Tag::new(0)).unwrap();
        for at in (0..total).step_by(piece as usize) {
            builder
                .push(Fragment::new(remote.id(), at, sink.id(), at, piece, Tag::new(0)))
                .unwrap();
        }
        builder.commit_object().unwrap();
        let get = engine.submit(builder.finish().unwrap());
        let mut builder = engine.incremental_builder();
        builder.begin_object(Tag::new(0)).unwrap();
        for at in (0..total).step_by(piece as usize) {
            let dst = 2 * total + at;
            builder
                .push(Fragment::new(source.id(), at, remote.id(), dst, piece, Tag::new(0)))
                .unwrap();
        }
        builder.commit_object().unwrap();
        let put = engine.submit(builder.finish().unwrap());
        let (mut get, mut put) = (get, put);
        let started = std::time::Instant::now();
        let (got, sent) = (get.wait(), put.wait());
        assert!(
            got.is_empty(),
            "round {round}: the restore failed after {:?}: {got:?}",
            started.elapsed()
        );
        assert!(
            sent.is_empty(),
            "round {round}: the offload failed after {:?}: {sent:?}",
            started.elapsed()
        );
        drop((get, put));
        let bytes = sink.deregister();
        let wrong = (0..total as usize).find(|&i| bytes[i] != fill_byte(3, i));
        assert_eq!(wrong, None, "round {round}: restored byte differs");
    }
    // What the puts wrote, read back.
    let back = engine.register_memory(vec![POISON; total as usize]).unwrap();
    let mut builder = engine.incremental_builder();
    builder.begin_object(Tag::new(0)).unwrap();
    builder.push(Fragment::new(remote.id(), 2 * total, back.id(), 0, total, Tag::new(0))).unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    assert!(handle.wait().is_empty());
    drop(handle);
    assert!(back.deregister() == outgoing, "the offloaded bytes differ at the peer");
    let _ = Duration::ZERO;
}

#[test]
fn a_16_mib_restore_beside_a_16_mib_offload_never_deadlocks() {
    if !ucx_or_skip() {
        return;
    }
    // One request each way, far larger than the sockets' buffers.
    restore_beside_offload(16 * MIB, 16 * MIB, 20);
}

#[test]
fn merged_64_kib_fragments_of_64_mib_each_way_never_deadlock() {
    if !ucx_or_skip() {
        return;
    }
    // 1,024 adjacent 64 KiB fragments each way, merged into large requests.
    restore_beside_offload(64 << 10, 64 * MIB, 3);
}
