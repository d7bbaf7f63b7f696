//! `umbp-ucx-serve --pool`: a real memory node process joins a pool whose index is a real
//! `redis-server`, renews its announcement, leaves the pool at once on SIGTERM, and is dead
//! after its TTL when SIGKILLed. Its settings are refused by name when wrong.

#[path = "support/pool.rs"]
mod pool_support;
mod support;

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use pool_support::{
    available, password_file, pool_args, scrape, value, Node, RedisServer, PASSWORD,
};
use umbp_pool::{
    checksum, BlockKey, Error, Index, NodeId, Placement, Published, RedisIndex, Reserved, TierId,
};

/// Reserves and publishes `key` (as a client writing it would) on tier 0 of `node`.
fn publish(index: &RedisIndex, node: NodeId, key: BlockKey) -> Placement {
    let bytes = key.0.repeat(4);
    let Reserved::Slot(r) =
        index.reserve(key, node, TierId(0), bytes.len() as u64, Duration::from_secs(30)).unwrap()
    else {
        panic!("{key} present already")
    };
    match index.publish(&[(r, checksum(&bytes))]).unwrap()[..] {
        [Published::Won(p)] => p,
        ref other => panic!("{other:?}"),
    }
}

/// A node joins with its writable region as tier 0 (16 slots of 64 KiB; the read-only region
/// is no tier), stays alive past several TTLs by renewing, says so in its log and /metrics,
/// and on SIGTERM leaves the pool before it exits 0: with a 60 s TTL, its blocks miss as soon
/// as the process is gone, not a minute later.
#[test]
fn a_node_joins_renews_and_leaves_at_once_on_sigterm() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let index = redis.index("join").unwrap();
    // Renewal: a 1 s announcement, alive 3 s later.
    let mut node =
        Node::start(&pool_args(&redis, dir.path(), "join", 3, 1000, &["--metrics", "127.0.0.1:0"]))
            .unwrap();
    let nodes = index.nodes().unwrap();
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert_eq!(nodes[0].node, NodeId(3));
    assert_eq!(nodes[0].address, node.addr.to_string());
    assert_eq!(nodes[0].tiers, vec![(TierId(0), 1 << 20)]);
    let stats = index.tier_stats(NodeId(3), TierId(0)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (16, 0, 0));
    assert!(matches!(index.tier_stats(NodeId(3), TierId(1)), Err(Error::UnknownTier { .. })));
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(index.nodes().unwrap().len(), 1, "renewed: {}", node.log());
    let p = publish(&index, NodeId(3), BlockKey::from_u128(1));
    let body = scrape(node.metrics.unwrap());
    let member = format!("umbp_ucx_serve_pool_member{{node=\"3\",address=\"{}\"}}", node.addr);
    assert_eq!(value(&body, &member), 1, "{body}");
    assert_eq!(value(&body, "umbp_ucx_serve_pool_state{state=\"joined\"}"), 1);
    assert!(value(&body, "umbp_ucx_serve_pool_announcements_total") >= 3, "{body}");
    assert_eq!(value(&body, "umbp_ucx_serve_pool_announce_failures_total"), 0);
    node.log_with("pool: joined");
    let status = node.signal(libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{}", node.log());
    assert!(index.lookup(&[p.key]).unwrap()[0].is_none());
    drop(node);

    // Leaving: a 60 s announcement, gone the moment the process is.
    let mut node = Node::start(&pool_args(&redis, dir.path(), "join", 4, 60_000, &[])).unwrap();
    let p = publish(&index, NodeId(4), BlockKey::from_u128(2));
    assert_eq!(index.lookup(&[p.key]).unwrap(), vec![Some(p)]);
    let lease = index.lease(&[p], Duration::from_secs(30)).unwrap();
    assert!(lease.all_granted());
    let status = node.signal(libc::SIGTERM, Duration::from_secs(10));
    let log = node.log();
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{log}");
    assert_eq!(index.lookup(&[p.key]).unwrap(), vec![None], "still found after the node left");
    assert!(index.nodes().unwrap().is_empty());
    assert_eq!(index.lease(&[p], Duration::from_secs(30)).unwrap().granted, vec![false]);
    assert!(matches!(
        index.reserve(BlockKey::from_u128(3), NodeId(4), TierId(0), 10, Duration::from_secs(5)),
        Err(Error::NodeNotAlive(NodeId(4)))
    ));
    index.release(lease.id).unwrap();
    // It left before it drained, and said so.
    let (left, drained) = (log.find("pool: left"), log.find("draining on a signal"));
    assert!(left.is_some() && left < drained, "{log}");
}

/// SIGKILL: nothing leaves, the announcement stops being renewed, and the node is dead once
/// it expires: gone from the nodes, its blocks out of lookups. A node restarted under the
/// same id at the same address before that (a restart within the TTL) drops its old blocks,
/// which its fresh memory no longer holds; one at another address is refused until the TTL.
#[test]
fn a_killed_node_is_dead_after_its_ttl_and_a_restart_drops_its_old_blocks() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let index = redis.index("kill").unwrap();
    let mut node = Node::start(&pool_args(&redis, dir.path(), "kill", 5, 1000, &[])).unwrap();
    let p = publish(&index, NodeId(5), BlockKey::from_u128(5));
    assert!(node.signal(libc::SIGKILL, Duration::from_secs(10)).is_some());
    let killed = Instant::now();
    let until = killed + Duration::from_secs(20);
    while !index.nodes().unwrap().is_empty() {
        assert!(Instant::now() < until, "a killed node still alive 20 s later");
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("dead {:?} after SIGKILL (TTL 1 s)", killed.elapsed());
    assert_eq!(index.lookup(&[p.key]).unwrap(), vec![None]);
    drop(node);

    // A restart at the same address within the TTL: the old block is dropped at once.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let args = pool_args(&redis, dir.path(), "kill", 6, 60_000, &["--listen", &listen]);
    let mut node = Node::start(&args).unwrap();
    let old = publish(&index, NodeId(6), BlockKey::from_u128(6));
    assert!(node.signal(libc::SIGKILL, Duration::from_secs(10)).is_some());
    assert_eq!(index.lookup(&[old.key]).unwrap(), vec![Some(old)], "alive for its 60 s TTL");
    // Another node claiming id 6 from another address is refused while 6 is alive.
    let elsewhere = pool_args(&redis, dir.path(), "kill", 6, 60_000, &[]);
    let (code, log) = Node::start(&elsewhere).err().expect("a second node 6 is refused");
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&format!("node 6 is alive in the pool at {listen}")), "{log}");
    let node = Node::start(&args).unwrap();
    node.log_with("a restart within the TTL");
    assert_eq!(index.lookup(&[old.key]).unwrap(), vec![None], "an old life's block");
    assert_eq!(index.tier_stats(NodeId(6), TierId(0)).unwrap().free, 16);
    let new = publish(&index, NodeId(6), BlockKey::from_u128(7));
    assert!(new.generation > old.generation);
}

/// Wrong pool settings: refused by name before serving (status 2), or when the pool cannot be
/// joined (status 1).
#[test]
fn bad_pool_settings_are_refused_by_name() {
    if !available() {
        return;
    }
    let redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let refused = |args: Vec<String>, code: i32, words: &[&str]| {
        let (status, log) = Node::start(&args).err().expect("refused");
        assert_eq!(status, Some(code), "{args:?}: {log}");
        for w in words {
            assert!(log.contains(w), "{args:?}: no {w:?} in {log}");
        }
    };
    let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    refused(s(&["--region", "kv=1MiB", "--node-id", "1"]), 2, &["--node-id", "no --pool URL"]);
    let url = redis.url();
    refused(
        s(&["--region", "kv=1MiB", "--pool", &url, "--pool-slot-size", "4KiB"]),
        2,
        &["--node-id"],
    );
    refused(
        s(&["--region", "kv=1MiB", "--pool", &url, "--node-id", "1"]),
        2,
        &["--pool-slot-size"],
    );
    refused(
        s(&["--region", "kv=32KiB", "--pool", &url, "--node-id", "1", "--pool-slot-size", "64KiB"]),
        2,
        &["region `kv`", "smaller than one 65536-byte slot"],
    );
    refused(
        s(&[
            "--region",
            "ro=1MiB:ro",
            "--pool",
            &url,
            "--node-id",
            "1",
            "--pool-slot-size",
            "4KiB",
        ]),
        2,
        &["no writable region"],
    );
    let exposed = password_file(dir.path());
    std::fs::set_permissions(&exposed, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut args = pool_args(&redis, dir.path(), "bad", 1, 1000, &[]);
    let at = args.iter().position(|a| a == "--pool-password-file").unwrap();
    let exposed_copy = dir.path().join("exposed");
    std::fs::copy(&exposed, &exposed_copy).unwrap();
    std::fs::set_permissions(&exposed_copy, std::fs::Permissions::from_mode(0o644)).unwrap();
    args[at + 1] = exposed_copy.to_str().unwrap().into();
    refused(args, 2, &["readable by other users"]);
    // Listening on every interface without --advertise: nothing to announce.
    refused(
        pool_args(&redis, dir.path(), "bad", 1, 1000, &["--listen", "0.0.0.0:0"]),
        1,
        &["--advertise"],
    );
    // A wrong password, an unreachable server: status 1, the URL named without a password.
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "not the password").unwrap();
    std::fs::set_permissions(&wrong, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut args = pool_args(&redis, dir.path(), "bad", 1, 1000, &[]);
    let at = args.iter().position(|a| a == "--pool-password-file").unwrap();
    args[at + 1] = wrong.to_str().unwrap().into();
    refused(args, 1, &[&format!("pool {url}")]);
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let gone = format!("redis://:{PASSWORD}@127.0.0.1:{closed}/");
    let (code, log) = Node::start(&s(&[
        "--listen",
        "127.0.0.1:0",
        "--region",
        "kv=1MiB",
        "--pool",
        &gone,
        "--node-id",
        "1",
        "--pool-slot-size",
        "4KiB",
    ]))
    .err()
    .expect("refused");
    assert_eq!(code, Some(1), "{log}");
    assert!(log.contains(&format!("redis://:***@127.0.0.1:{closed}/")), "{log}");
    assert!(!log.contains(PASSWORD), "the password leaked into the log: {log}");
    // With --advertise, the announced address is the one given.
    let args = pool_args(&redis, dir.path(), "adv", 2, 60_000, &["--advertise", "10.1.2.3"]);
    let node = Node::start(&args).unwrap();
    let nodes = redis.index("adv").unwrap().nodes().unwrap();
    assert_eq!(nodes[0].address, format!("10.1.2.3:{}", node.addr.port()));
}

/// Redis killed under a running node: the node keeps serving and says `lapsing`, then
/// `expired`, in its log and /metrics while its renewals fail; Redis restarted (empty): the
/// node rejoins by itself, its tier registered again and empty, and says `joined` again.
#[test]
fn a_node_rejoins_a_restarted_redis_by_itself() {
    if !available() {
        return;
    }
    let mut redis = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&pool_args(
        &redis,
        dir.path(),
        "restart",
        8,
        600,
        &["--metrics", "127.0.0.1:0"],
    ))
    .unwrap();
    let at = node.metrics.unwrap();
    let state =
        |s: &str| value(&scrape(at), &format!("umbp_ucx_serve_pool_state{{state=\"{s}\"}}"));
    let wait_for = |s: &str| {
        let until = Instant::now() + Duration::from_secs(20);
        while state(s) != 1 {
            assert!(Instant::now() < until, "never {s}: {}", node.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(state("joined"), 1);
    redis.kill();
    wait_for("expired");
    let body = scrape(at);
    assert!(value(&body, "umbp_ucx_serve_pool_announce_failures_total") >= 1, "{body}");
    let member = format!("umbp_ucx_serve_pool_member{{node=\"8\",address=\"{}\"}}", node.addr);
    assert_eq!(value(&body, &member), 0);
    redis.restart();
    wait_for("joined");
    let index = redis.index("restart").unwrap();
    let nodes = index.nodes().unwrap();
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert_eq!((nodes[0].node, nodes[0].address.clone()), (NodeId(8), node.addr.to_string()));
    assert_eq!(index.tier_stats(NodeId(8), TierId(0)).unwrap().free, 16);
    let p = publish(&index, NodeId(8), BlockKey::from_u128(8));
    assert_eq!(index.lookup(&[p.key]).unwrap(), vec![Some(p)]);
    let log = node.log();
    assert!(log.contains("announcement not renewed") && log.contains("state=\"expired\""), "{log}");
    assert!(
        log.contains("announcement renewed again") && log.contains("rejoined_empty=true"),
        "{log}"
    );
}
