//! Restore and offload against a server in another process, over loopback.

mod support;

use umbp_plan::{Fragment, PlanBuilder, Register, Tag, TransferEngine};

use support::{engine, fill_byte, ucx_or_skip, Served, POISON};

const PAGE: usize = 64 << 10;

#[test]
fn restores_scattered_pages_byte_exact_over_tcp() {
    if !ucx_or_skip() {
        return;
    }
    let server = Served::start("tcp", 16 << 20, 3, &[]);
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
