//! Issue 36's faults, each with real processes: a real `redis-server` killed and restarted,
//! other instances of the pool in child processes (this binary run again) killed with
//! SIGKILL while they hold leases or publish, two processes saving the same keys at once, a
//! stale lookup result used after its slot was evicted and reused by another process, and the
//! embedded index killed at random points of its publishes. Every block's bytes live in a real
//! tier file; every check is the same: nothing wrong is ever served (a hit's bytes verify
//! against its CRC32C and are the winner's), and what fails, fails for that block alone.
//!
//! The Redis tests skip (with a printed reason) without `redis-server`, unless
//! `UMBP_REQUIRE_REDIS=1`.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::dram::DramPool;
use support::faults::{block_bytes, commands, reply, save, FileTier, Process, Rng, Saved, ROLE};
use support::suite::{key, put, reserve, setup, TTL};
use support::RedisServer;
use umbp_pool::{
    checksum, DropReason, EmbeddedIndex, Error, Index, NodeAnnouncement, NodeId, Placement,
    Published, RedisConfig, RedisIndex, Removed, Reserved, TierFile, TierId, TierSpec, Verify,
};

/// The tier every instance of the Redis tests has: 256 slots of 4 KiB in a file, no eviction
/// unless asked.
fn instance_tier(node: NodeId) -> TierSpec {
    TierSpec::new(node, TierId(0), 4096, 256).watermarks(0, 0)
}

const PREFIX: &str = "faults";

fn redis_config(port: u16) -> RedisConfig {
    let mut c = RedisConfig::new(format!("redis://127.0.0.1:{port}/"));
    c.password = Some(umbp_pool::redis_server::PASSWORD.into());
    c.prefix = PREFIX.into();
    c.timeout = Duration::from_secs(2);
    c
}

fn env<T: std::str::FromStr>(name: &str) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("child process without {name}"))
}

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// Starts an instance of the pool in another process: its own Redis client, node `node`
/// (announced), the instance tier in `tier_file`.
fn spawn_instance(server: &RedisServer, node: u32, tier_file: &Path) -> Process {
    let mut p = Process::spawn(
        "child_instance",
        "instance",
        &[
            ("UMBP_FAULTS_PORT", server.port().to_string()),
            ("UMBP_FAULTS_NODE", node.to_string()),
            ("UMBP_FAULTS_TIER", tier_file.display().to_string()),
        ],
    );
    assert_eq!(p.answer(), "ready");
    p
}

/// The child side of [`spawn_instance`]: serves commands until killed. Commands:
/// `put ID WRITER LEN`, `putmany FROM TO WRITER LEN`, `reserve ID WRITER LEN` (and write),
/// `publish` (every reservation so far), `lease TTL_MS RENEW ID...`, `evict N`.
#[test]
fn child_instance() {
    if role().as_deref() != Some("instance") {
        return;
    }
    let index = RedisIndex::connect(&redis_config(env("UMBP_FAULTS_PORT"))).unwrap();
    let spec = instance_tier(NodeId(env("UMBP_FAULTS_NODE")));
    setup(&index, &spec);
    let path: String = env("UMBP_FAULTS_TIER");
    let tier = FileTier::open(spec, Path::new(&path));
    let index = Arc::new(index);
    let mut pending = Vec::new();
    reply("ready");
    for line in commands() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { w[i].parse().unwrap() };
        match w[0] {
            "put" => reply(match save(&*index, &tier, num(1), num(2) as u8, num(3)) {
                Saved::Published(r, Published::Won(_)) => {
                    format!("won {} {}", r.slot, r.generation)
                }
                Saved::Published(_, Published::Lost { winner }) => format!("lost {}", winner.node),
                Saved::Published(_, Published::Expired) => "expired".into(),
                Saved::Present(p) => format!("present {}", p.node),
                Saved::Failed(e) => format!("failed {e}"),
            }),
            "putmany" => {
                let (mut won, mut lost, mut present, mut failed) = (0, 0, 0, 0);
                for id in num(1)..num(2) {
                    match save(&*index, &tier, id, num(3) as u8, num(4)) {
                        Saved::Published(_, Published::Won(_)) => won += 1,
                        Saved::Published(_, Published::Lost { .. }) => lost += 1,
                        Saved::Present(_) => present += 1,
                        _ => failed += 1,
                    }
                }
                reply(format!("done {won} {lost} {present} {failed}"));
            }
            "reserve" => {
                let (id, writer, len) = (num(1), num(2) as u8, num(3));
                let r = reserve(&*index, key(id), &spec, len);
                let bytes = block_bytes(id, writer, len);
                tier.write(r.slot, &bytes);
                pending.push((r, checksum(&bytes)));
                reply(format!("reserved {} {}", r.slot, r.generation));
            }
            "publish" => {
                let out = index.publish(&pending).unwrap();
                pending.clear();
                let codes: Vec<&str> = out
                    .iter()
                    .map(|o| match o {
                        Published::Won(_) => "W",
                        Published::Lost { .. } => "L",
                        Published::Expired => "E",
                    })
                    .collect();
                reply(codes.join(","));
            }
            "lease" => {
                let ttl = Duration::from_millis(num(1));
                let renew = num(2) == 1;
                let keys: Vec<_> = w[3..].iter().map(|i| key(i.parse().unwrap())).collect();
                let found: Vec<Placement> =
                    index.lookup(&keys).unwrap().into_iter().flatten().collect();
                let lease = index.lease(&found, ttl).unwrap();
                let granted = lease.granted.iter().filter(|&&g| g).count();
                if renew {
                    let index = index.clone();
                    std::thread::spawn(move || loop {
                        std::thread::sleep(ttl / 4);
                        index.renew(lease.id, ttl).unwrap();
                    });
                }
                reply(format!("leased {granted}"));
            }
            "evict" => reply(format!(
                "evicted {}",
                index.evict(spec.node, spec.tier, num(1) as u32).unwrap()
            )),
            other => panic!("unknown command {other}"),
        }
    }
}

/// The placement of block `id` and its bytes as loaded from the tier file of its node,
/// verified: `Err` is a load error (a miss for the caller), never wrong bytes.
fn load(files: &HashMap<NodeId, FileTier>, p: &Placement) -> Result<Vec<u8>, Error> {
    files[&p.node].load(p)
}

/// A Redis restart loses every generation counter with the rest of its data. Before the fix,
/// generations started at 1 again, so a placement looked up before the restart matched the
/// slot again once the same key was saved there (with other bytes: a lease was granted on a
/// stale placement), and a reservation made before the restart published over a new writer's
/// reservation of the same slot. Generations are now seeded from the server's clock when a
/// slot has none.
#[test]
fn redis_restart_never_repeats_a_generation() {
    let Some(mut server) = RedisServer::start() else { return };
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let spec = TierSpec::new(NodeId(1), TierId(0), 64, 2).watermarks(0, 0);
    setup(&index, &spec);
    let before = put(&index, key(1), &spec);
    assert_eq!(before.slot, 0);
    let in_flight = reserve(&index, key(2), &spec, 64);
    assert_eq!(in_flight.slot, 1);

    server.kill();
    server.restart();
    setup(&index, &spec);

    // The same key saved again, into the same slot, with other bytes (another checksum).
    let again = match index.reserve(key(1), spec.node, spec.tier, before.len, TTL).unwrap() {
        Reserved::Slot(r) => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(again.slot, before.slot);
    let Published::Won(after) = index.publish(&[(again, before.checksum ^ 1)]).unwrap()[0] else {
        panic!("the only writer of key 1 must win")
    };
    assert!(
        after.generation > before.generation,
        "a generation was handed out twice: {} before the restart, {} after",
        before.generation,
        after.generation
    );
    assert_eq!(
        index.lease(&[before, after], TTL).unwrap().granted,
        vec![false, true],
        "a placement from before the restart must be a miss"
    );
    // A new writer of key 2 gets the slot the lost reservation had; the old reservation's
    // publish must not take it over.
    let new_writer = reserve(&index, key(2), &spec, 64);
    assert_eq!(new_writer.slot, in_flight.slot);
    assert_eq!(index.publish(&[(in_flight, 7)]).unwrap(), vec![Published::Expired]);
    assert!(matches!(index.publish(&[(new_writer, 8)]).unwrap()[0], Published::Won(_)));
    assert_eq!(index.lookup(&[key(2)]).unwrap()[0].unwrap().checksum, 8);
}

/// Redis killed and restarted while four threads save and load blocks through a real tier
/// file and a node renews its announcement: while it is down every call is a clean
/// `Error::Redis` (a save fails, a lookup is a miss for the caller), a hit's bytes always
/// verify, and once it is back the node rejoins, saves publish and loads hit again. A
/// reservation made before the kill publishes nothing after it; a lease held across it is gone.
#[test]
fn redis_killed_and_restarted_under_saves_and_loads() {
    let Some(mut server) = RedisServer::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let index = Arc::new(RedisIndex::connect(&support::config(&server, PREFIX)).unwrap());
    let spec = instance_tier(NodeId(1)).watermarks(8, 16);
    setup(&*index, &spec);
    let tier = Arc::new(FileTier::open(spec, &dir.path().join("tier")));
    let stop = Arc::new(AtomicBool::new(false));
    // The node renews its announcement as a running node does (a failed renewal is retried).
    let renewer = {
        let (index, stop) = (index.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let a = NodeAnnouncement { node: spec.node, address: "n1".into(), tiers: vec![] };
                let _ = index.announce(&a, Duration::from_secs(2));
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    // [hits, saves won, redis errors, verified-bad loads]
    let counts: Arc<[AtomicU64; 4]> = Arc::new(Default::default());
    let workers: Vec<_> = (0..4u8)
        .map(|w| {
            let (index, tier, stop, counts) =
                (index.clone(), tier.clone(), stop.clone(), counts.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x5eed ^ u64::from(w + 1) << 32);
                while !stop.load(Ordering::Relaxed) {
                    let id = rng.below(512);
                    let found = match index.lookup(&[key(id)]) {
                        Ok(f) => f[0],
                        Err(Error::Redis(_)) => {
                            counts[2].fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Err(e) => panic!("{e}"),
                    };
                    match found {
                        Some(p) => {
                            let Ok(lease) = index.lease(&[p], TTL) else {
                                counts[2].fetch_add(1, Ordering::Relaxed);
                                continue;
                            };
                            if lease.granted[0] {
                                let bytes = tier.load(&p).unwrap_or_else(|e| {
                                    panic!("a leased hit served wrong bytes: {e}")
                                });
                                assert_eq!(bytes.len() as u64, 100 + id);
                                counts[0].fetch_add(1, Ordering::Relaxed);
                            }
                            let _ = index.release(lease.id);
                        }
                        None => match save(&*index, &tier, id, w, 100 + id) {
                            Saved::Published(_, Published::Won(_)) => {
                                counts[1].fetch_add(1, Ordering::Relaxed);
                            }
                            Saved::Failed(_) => {
                                counts[2].fetch_add(1, Ordering::Relaxed);
                            }
                            _ => {}
                        },
                    }
                }
            })
        })
        .collect();
    let wait_for = |what: usize, more_than: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while counts[what].load(Ordering::Relaxed) <= more_than {
            assert!(Instant::now() < deadline, "counter {what} stuck at {more_than}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_for(0, 20);
    // A save and a load in flight across the restart.
    let in_flight = reserve(&*index, key(10_000), &spec, 100);
    let held = index.lookup(&[key(0), key(1), key(2), key(3)]).unwrap();
    let held: Vec<Placement> = held.into_iter().flatten().collect();
    let lease = index.lease(&held, TTL).unwrap();

    let errors_before = counts[2].load(Ordering::Relaxed);
    server.kill();
    wait_for(2, errors_before + 10);
    server.restart();
    let (hits, saves) = (counts[0].load(Ordering::Relaxed), counts[1].load(Ordering::Relaxed));
    wait_for(1, saves + 5);
    wait_for(0, hits + 5);

    assert_eq!(index.publish(&[(in_flight, 1)]).unwrap(), vec![Published::Expired]);
    assert_eq!(index.lookup(&[key(10_000)]).unwrap(), vec![None]);
    if !held.is_empty() {
        assert!(matches!(index.renew(lease.id, TTL), Err(Error::LeaseExpired(_))));
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    renewer.join().unwrap();
    let [hits, saves, errors, _] = &*counts;
    eprintln!(
        "{} hits, {} saves, {} clean errors across the restart",
        hits.load(Ordering::Relaxed),
        saves.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed)
    );
    // Every published block still verifies in the file.
    let all: Vec<_> = (0..512).map(key).collect();
    for p in index.lookup(&all).unwrap().into_iter().flatten() {
        tier.load(&p).unwrap();
    }
}

/// Another instance (a child process) leases every block of a tier and keeps renewing, then is
/// killed with SIGKILL: while it lives nothing of the tier can be evicted, removed or reused,
/// even long past one lease TTL; once it is dead its leases expire by themselves and the
/// slots come back.
#[test]
fn instance_killed_holding_leases_frees_them() {
    let Some(server) = RedisServer::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let spec = TierSpec::new(NodeId(1), TierId(0), 4096, 8).watermarks(1, 1);
    setup(&index, &spec);
    let tier = FileTier::open(spec, &dir.path().join("tier1"));
    for id in 0..8 {
        assert!(matches!(save(&index, &tier, id, 0, 1000), Saved::Published(_, Published::Won(_))));
    }
    let mut reader = spawn_instance(&server, 2, &dir.path().join("tier2"));
    let ids: Vec<String> = (0..8).map(|i| i.to_string()).collect();
    // A 2 s lease renewed every 0.5 s: a loaded machine may delay a renewal, not by 1.5 s.
    assert_eq!(reader.ask(&format!("lease 2000 1 {}", ids.join(" "))), "leased 8");
    let full = |index: &RedisIndex| {
        matches!(
            index.reserve(key(100), spec.node, spec.tier, 10, TTL),
            Err(Error::TierFull { .. })
        )
    };
    std::thread::sleep(Duration::from_millis(3000));
    assert!(full(&index), "a renewed lease must hold past its TTL");
    assert_eq!(index.evict(spec.node, spec.tier, 8).unwrap(), 0);
    assert_eq!(index.remove(&[key(3)]).unwrap(), vec![Removed::Leased]);

    reader.kill();
    let killed = Instant::now();
    while full(&index) {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "the dead reader's leases never expired"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("slots back {:?} after the kill (lease TTL 2 s)", killed.elapsed());
    // Every block can go now; what is still published still verifies.
    let all: Vec<_> = (0..8).map(key).collect();
    for p in index.lookup(&all).unwrap().into_iter().flatten() {
        tier.load(&p).unwrap();
    }
    // The reserve that found a free slot evicted one block (watermarks 1, 1): 7 are left.
    assert_eq!(index.evict(spec.node, spec.tier, 8).unwrap(), 7);
}

/// The embedded index's leases live in its process: an instance killed holding leases leaves
/// none behind, and every block it published is there and unleased at reopen.
#[test]
fn embedded_instance_killed_holding_leases() {
    if role().as_deref() == Some("embedded-leaser") {
        let spec = embedded_tier();
        let index = EmbeddedIndex::open(env::<String>("UMBP_FAULTS_INDEX")).unwrap();
        index.register_tier(&spec).unwrap();
        let tier = FileTier::open(spec, Path::new(&env::<String>("UMBP_FAULTS_TIER")));
        let placements: Vec<Placement> = (0..8)
            .map(|id| match save(&index, &tier, id, 0, 1000) {
                Saved::Published(_, Published::Won(p)) => p,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(index.lease(&placements, TTL).unwrap().all_granted());
        reply("leased");
        for _ in commands() {}
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (index_path, tier_path) = (dir.path().join("pool.redb"), dir.path().join("tier"));
    let mut child = Process::spawn(
        "embedded_instance_killed_holding_leases",
        "embedded-leaser",
        &[
            ("UMBP_FAULTS_INDEX", index_path.display().to_string()),
            ("UMBP_FAULTS_TIER", tier_path.display().to_string()),
        ],
    );
    assert_eq!(child.answer(), "leased");
    child.kill();
    let index = EmbeddedIndex::open(&index_path).unwrap();
    let tier = FileTier::open(embedded_tier(), &tier_path);
    let all: Vec<_> = (0..8).map(key).collect();
    let found: Vec<Placement> = index.lookup(&all).unwrap().into_iter().flatten().collect();
    assert_eq!(found.len(), 8);
    for p in &found {
        tier.load(p).unwrap();
    }
    assert_eq!(index.remove(&all[..4]).unwrap(), vec![Removed::Removed; 4]);
    assert_eq!(index.evict(embedded_tier().node, embedded_tier().tier, 8).unwrap(), 4);
}

fn embedded_tier() -> TierSpec {
    TierSpec::new(NodeId(0), TierId(1), 4096, 4096).durable().watermarks(0, 0)
}

/// A lookup result in flight while another process evicts its slot and saves another block
/// there: the stale placement's lease is refused (a miss), and its bytes, if read anyway, fail
/// verification. A reader whose lease ran out during a slow load finds the same: its renew
/// fails and the bytes it read do not verify.
#[test]
fn stale_lookup_while_another_process_reuses_the_slot() {
    let Some(server) = RedisServer::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let spec = instance_tier(NodeId(1));
    setup(&index, &spec);
    let tier_path = dir.path().join("tier1");
    let mut files = HashMap::new();
    files.insert(spec.node, FileTier::open(spec, &tier_path));
    // Another instance of the same node: it shares the tier and its file.
    let mut other = spawn_instance(&server, 1, &tier_path);

    let Saved::Published(_, Published::Won(seen)) = save(&index, &files[&spec.node], 1, 0, 3000)
    else {
        panic!()
    };
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![Some(seen)]);
    // The other process evicts it and saves block 2 into the same slot.
    assert_eq!(other.ask("evict 256"), "evicted 1");
    let answer = other.ask("put 2 1 3000");
    let won: Vec<u64> = answer.split_whitespace().skip(1).map(|w| w.parse().unwrap()).collect();
    assert_eq!(won[0], u64::from(seen.slot), "{answer}");
    assert!(won[1] > seen.generation, "{answer}: a reused slot's generation grows");
    // The stale result: not leased, not a hit; its bytes are block 2's and fail verification.
    assert_eq!(index.lease(&[seen], TTL).unwrap().granted, vec![false]);
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![None]);
    assert!(matches!(load(&files, &seen), Err(Error::ChecksumMismatch { .. })));

    // A slow load: leased, the reader stalls past its lease's end, the slot is reused.
    let p2 = index.lookup(&[key(2)]).unwrap()[0].unwrap();
    let lease = index.lease(&[p2], TTL).unwrap();
    assert!(lease.all_granted());
    assert_eq!(other.ask("evict 256"), "evicted 0", "a live lease must keep its slot");
    index.renew(lease.id, Duration::from_millis(100)).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(other.ask("evict 256"), "evicted 1");
    assert!(other.ask("put 3 1 3000").starts_with(&format!("won {} ", p2.slot)));
    assert!(matches!(index.renew(lease.id, TTL), Err(Error::LeaseExpired(_))));
    assert!(matches!(load(&files, &p2), Err(Error::ChecksumMismatch { .. })));
    let p3 = index.lookup(&[key(3)]).unwrap()[0].unwrap();
    assert_eq!(load(&files, &p3).unwrap(), block_bytes(3, 1, 3000));
}

/// Two instances (two processes, each with its own node and tier file) save the same keys at
/// once. First both have written their bytes before either publishes: exactly one publish wins,
/// the loser's slot is free again, and the winner's bytes are served. Then both save 200 keys
/// each as fast as they can: every key is published once, by one of them, and its bytes are
/// that writer's; no slot leaks on either tier.
#[test]
fn two_processes_save_the_same_keys_at_once() {
    let Some(server) = RedisServer::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let mut files = HashMap::new();
    let mut instances = Vec::new();
    for node in [1u32, 2] {
        let path = dir.path().join(format!("tier{node}"));
        instances.push(spawn_instance(&server, node, &path));
        files.insert(NodeId(node), FileTier::open(instance_tier(NodeId(node)), &path));
    }
    // Writer id = node id, so the bytes tell who wrote them.
    for (i, p) in instances.iter_mut().enumerate() {
        assert!(p.ask(&format!("reserve 7 {} 2000", i + 1)).starts_with("reserved "));
    }
    for p in instances.iter_mut() {
        p.send("publish");
    }
    let outcomes: Vec<String> = instances.iter_mut().map(|p| p.answer()).collect();
    let mut sorted = outcomes.clone();
    sorted.sort();
    assert_eq!(sorted, vec!["L", "W"], "exactly one publish of key 7 wins: {outcomes:?}");
    let winner = NodeId(if outcomes[0] == "W" { 1 } else { 2 });
    let p = index.lookup(&[key(7)]).unwrap()[0].unwrap();
    assert_eq!(p.node, winner);
    assert_eq!(load(&files, &p).unwrap(), block_bytes(7, winner.0 as u8, 2000));
    let loser = NodeId(3 - winner.0);
    let stats = index.tier_stats(loser, TierId(0)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (256, 0, 0), "the loser's slot");

    for (i, p) in instances.iter_mut().enumerate() {
        p.send(&format!("putmany 100 300 {} 1500", i + 1));
    }
    let done: Vec<Vec<u32>> = instances
        .iter_mut()
        .map(|p| {
            let a = p.answer();
            a.strip_prefix("done ").unwrap().split(' ').map(|n| n.parse().unwrap()).collect()
        })
        .collect();
    // [won, lost, present, failed] per process.
    assert_eq!(done[0][3] + done[1][3], 0, "{done:?}");
    assert_eq!(done[0][0] + done[1][0], 200, "each key won once: {done:?}");
    assert_eq!(done[0][1] + done[0][2] + done[1][1] + done[1][2], 200, "{done:?}");
    let all: Vec<_> = (100..300).map(key).collect();
    let mut by_node = HashMap::new();
    for (p, id) in index.lookup(&all).unwrap().into_iter().zip(100..300u64) {
        let p = p.unwrap_or_else(|| panic!("key {id} lost"));
        assert_eq!(load(&files, &p).unwrap(), block_bytes(id, p.node.0 as u8, 1500));
        *by_node.entry(p.node).or_insert(0u32) += 1;
    }
    eprintln!("winners by node: {by_node:?}");
    for node in [NodeId(1), NodeId(2)] {
        let s = index.tier_stats(node, TierId(0)).unwrap();
        let expected = by_node.get(&node).copied().unwrap_or(0) + u32::from(node == winner);
        assert_eq!((s.reserved, s.published, s.free), (0, expected, 256 - expected), "{node:?}");
    }
}

/// Power loss in the embedded index, for real processes: a child publishes batches of blocks
/// (each written into the tier file first) and removes some, telling the parent after each
/// call returns; the parent kills it with SIGKILL at a random moment (during a write, between
/// write and publish, during redb's commit, during a removal's commit, during open), 30 times
/// over one index file. After every reopen: every acknowledged publish is there and its bytes
/// verify, every acknowledged removal is gone, the batch in flight is all there or all absent,
/// every block present verifies (never half there), and no slot is lost.
#[test]
fn embedded_killed_at_random_points() {
    if role().as_deref() == Some("publisher") {
        return publisher();
    }
    random_kills("embedded_killed_at_random_points", 4096);
}

/// [`embedded_killed_at_random_points`] on a tier of 64 slots, so that reservations evict
/// blocks and write new ones into their slots all the time: a kill after a slot was reused
/// and before its new block's publish must not bring the evicted block back over the new
/// bytes (the eviction's deletion is committed before the slot is handed out). Every block
/// present after a reopen verifies; acknowledged blocks may have been evicted since.
#[test]
fn embedded_killed_at_random_points_while_evicting() {
    if role().as_deref() == Some("publisher") {
        return publisher();
    }
    random_kills("embedded_killed_at_random_points_while_evicting", 64);
}

/// The tier of the random-kill tests: `slots` slots of 4 KiB, durable; a small one evicts.
fn publisher_tier(slots: u32) -> TierSpec {
    if slots >= embedded_tier().slot_count {
        embedded_tier()
    } else {
        TierSpec { slot_count: slots, ..embedded_tier() }.watermarks(4, 16)
    }
}

/// Spawns the publisher of test `test` 30 times over one index and tier file of `slots`
/// slots, kills it at a random moment each time, and checks the reopened index.
fn random_kills(test: &str, slots: u32) {
    let evicting = slots < embedded_tier().slot_count;
    let seed: u64 = std::env::var("UMBP_FAULTS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::process::id().into());
    eprintln!("seed {seed} (UMBP_FAULTS_SEED={seed} repeats this run)");
    let mut rng = Rng(seed | 1);
    let dir = tempfile::tempdir().unwrap();
    let (index_path, tier_path) = (dir.path().join("pool.redb"), dir.path().join("tier"));
    let spec = publisher_tier(slots);
    let (mut published_total, mut in_flight_seen, mut evicted_rounds) = (0u64, [0u32; 2], 0);
    for round in 0..30u64 {
        let start = round * 100_000;
        let mut child = Process::spawn(
            test,
            "publisher",
            &[
                ("UMBP_FAULTS_INDEX", index_path.display().to_string()),
                ("UMBP_FAULTS_TIER", tier_path.display().to_string()),
                ("UMBP_FAULTS_START", start.to_string()),
                ("UMBP_FAULTS_SLOTS", slots.to_string()),
            ],
        );
        // Long enough on the small tier for the child to go round it several times.
        let delay = Duration::from_micros(rng.below(if evicting { 600_000 } else { 150_000 }));
        std::thread::sleep(delay);
        child.kill();
        let answers = child.remaining_answers();
        let (mut acked, mut removed, mut removing) = (HashSet::new(), HashSet::new(), Vec::new());
        let mut next = start;
        for a in &answers {
            let w: Vec<u64> = a.split(' ').skip(1).map(|n| n.parse().unwrap()).collect();
            match a.split(' ').next() {
                Some("pub") => {
                    acked.extend(w[0]..w[0] + w[1]);
                    next = w[0] + w[1];
                }
                Some("rm") => {
                    removed.extend(w[0]..w[0] + w[1]);
                    removing.clear();
                }
                Some("removing") => removing = (w[0]..w[0] + w[1]).collect(),
                _ => panic!("{a}"),
            }
        }
        let index = EmbeddedIndex::open(&index_path)
            .unwrap_or_else(|e| panic!("round {round}: reopen after the kill failed: {e}"));
        // The child may have died before it registered the tier: the same shape again is a no-op.
        index.register_tier(&spec).unwrap();
        let tier = FileTier::open(spec, &tier_path);
        let ids: Vec<u64> = (start..next + BATCH).collect();
        let keys: Vec<_> = ids.iter().map(|&i| key(i)).collect();
        let found = index.lookup(&keys).unwrap();
        let mut present = Vec::new();
        for (&id, p) in ids.iter().zip(&found) {
            if let Some(p) = p {
                let bytes = tier
                    .load(p)
                    .unwrap_or_else(|e| panic!("round {round}: block {id} half there: {e}"));
                assert_eq!(bytes, block_bytes(id, 0, block_len(id)), "round {round}: {id}");
                present.push(key(id));
            }
            let acked_here = acked.contains(&id) && !removed.contains(&id);
            let gone = removed.contains(&id) && !removing.contains(&id);
            assert!(
                evicting || !acked_here || p.is_some() || removing.contains(&id),
                "round {round}: {id} lost"
            );
            assert!(!gone || p.is_none(), "round {round}: removed {id} came back");
        }
        let in_flight = found[(next - start) as usize..].iter().filter(|p| p.is_some()).count();
        assert!(
            in_flight == 0 || in_flight == BATCH as usize,
            "round {round}: {in_flight} of the batch in flight are there"
        );
        in_flight_seen[usize::from(in_flight > 0)] += 1;
        let s = index.tier_stats(spec.node, spec.tier).unwrap();
        assert_eq!(s.reserved, 0);
        assert_eq!(s.published as usize, present.len(), "round {round}: {s:?}");
        assert_eq!(s.free + s.published, spec.slot_count, "round {round}: slots lost");
        published_total += present.len() as u64;
        evicted_rounds += u32::from(acked.len() > spec.slot_count as usize);
        // Empty the tier for the next round (the file keeps its history of crashes).
        assert!(index.remove(&present).unwrap().iter().all(|r| *r == Removed::Removed));
        eprintln!(
            "round {round}: killed after {delay:?}: {} acknowledged, {} present",
            acked.len(),
            present.len()
        );
    }
    eprintln!(
        "{published_total} blocks checked; in-flight batch absent {} times, whole {} times; \
         {evicted_rounds} rounds published more blocks than the tier has slots",
        in_flight_seen[0], in_flight_seen[1]
    );
    assert!(!evicting || evicted_rounds > 0, "no round went round the small tier: nothing evicted");
}

const BATCH: u64 = 16;

fn block_len(id: u64) -> u64 {
    1000 + id % 3000
}

/// The child of the random-kill tests: publishes batches of `BATCH` blocks
/// from `UMBP_FAULTS_START` on, each written into the tier file first, and after every third
/// batch removes half of the one before; says so after each call returns.
fn publisher() {
    let spec = publisher_tier(env("UMBP_FAULTS_SLOTS"));
    let index = EmbeddedIndex::open(env::<String>("UMBP_FAULTS_INDEX")).unwrap();
    index.register_tier(&spec).unwrap();
    let tier = FileTier::open(spec, Path::new(&env::<String>("UMBP_FAULTS_TIER")));
    let start: u64 = env("UMBP_FAULTS_START");
    let mut first = start;
    // 2,000 blocks: below the big tier's size (no eviction there, so every acknowledged block
    // must be there), many times the small one's.
    while first + BATCH <= start + 2000 {
        let items: Vec<_> = (first..first + BATCH).map(|id| (key(id), block_len(id))).collect();
        let batch: Vec<_> = index
            .reserve_many(spec.node, spec.tier, &items, TTL)
            .unwrap()
            .into_iter()
            .zip(first..)
            .map(|(r, id)| {
                let Ok(Reserved::Slot(r)) = r else { panic!("{r:?}") };
                let bytes = block_bytes(id, 0, block_len(id));
                tier.write(r.slot, &bytes);
                (r, checksum(&bytes))
            })
            .collect();
        let out = index.publish(&batch).unwrap();
        assert!(out.iter().all(|o| matches!(o, Published::Won(_))));
        reply(format!("pub {first} {BATCH}"));
        if (first - start) / BATCH % 3 == 2 {
            let from = first - BATCH;
            reply(format!("removing {from} {}", BATCH / 2));
            let keys: Vec<_> = (from..from + BATCH / 2).map(key).collect();
            // On the small tier some may have been evicted already.
            let out = index.remove(&keys).unwrap();
            assert!(out.iter().all(|r| matches!(r, Removed::Removed | Removed::Absent)), "{out:?}");
            reply(format!("rm {from} {}", BATCH / 2));
        }
        first += BATCH;
    }
    // Done: wait to be killed.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A child process saves `n` blocks (ids `0..n`, lengths [`block_len`]) into the embedded
/// tier of `dir` and is killed: the crash before the reconcile tests.
fn crash_after_saving(dir: &Path, n: u64) {
    let mut child = Process::spawn(
        "child_embedded_saver",
        "embedded-saver",
        &[
            ("UMBP_FAULTS_INDEX", dir.join("pool.redb").display().to_string()),
            ("UMBP_FAULTS_TIER", dir.join("tier").display().to_string()),
            ("UMBP_FAULTS_COUNT", n.to_string()),
        ],
    );
    assert_eq!(child.answer(), "saved");
    child.kill();
}

#[test]
fn child_embedded_saver() {
    if role().as_deref() != Some("embedded-saver") {
        return;
    }
    let spec = embedded_tier();
    let index = EmbeddedIndex::open(env::<String>("UMBP_FAULTS_INDEX")).unwrap();
    index.register_tier(&spec).unwrap();
    let tier = FileTier::open(spec, Path::new(&env::<String>("UMBP_FAULTS_TIER")));
    for id in 0..env::<u64>("UMBP_FAULTS_COUNT") {
        let Saved::Published(_, Published::Won(_)) = save(&index, &tier, id, 0, block_len(id))
        else {
            panic!("save {id}")
        };
    }
    reply("saved");
    for _ in commands() {}
}

/// Every key of `0..n` that the index still has loads and verifies from the tier file; the
/// number of them.
fn served_blocks_verify(index: &EmbeddedIndex, tier_path: &Path, n: u64) -> usize {
    let keys: Vec<_> = (0..n).map(key).collect();
    let found: Vec<(u64, Placement)> = index
        .lookup(&keys)
        .unwrap()
        .into_iter()
        .zip(0..)
        .filter_map(|(p, id)| p.map(|p| (id, p)))
        .collect();
    if found.is_empty() {
        return 0;
    }
    let tier = FileTier::open_existing(embedded_tier(), tier_path);
    for (id, p) in &found {
        assert_eq!(tier.load(p).unwrap(), block_bytes(*id, 0, block_len(*id)), "block {id}");
    }
    found.len()
}

/// After a crash the tier file was truncated (or recreated shorter), then deleted: the index
/// still lists every block (the disagreement), and the reconcile at start drops exactly the
/// blocks the file no longer holds, each with its reason, without reading a block; what stays
/// is served and verifies.
#[test]
fn reconcile_a_truncated_then_missing_tier_file() {
    let dir = tempfile::tempdir().unwrap();
    crash_after_saving(dir.path(), 64);
    let spec = embedded_tier();
    let tier_path = dir.path().join("tier");
    // 20 slots and half of the 21st block's slot.
    let cut = spec.slot_offset(20) + 500;
    std::fs::OpenOptions::new().write(true).open(&tier_path).unwrap().set_len(cut).unwrap();

    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let all: Vec<_> = (0..64).map(key).collect();
    let before: Vec<Placement> = index.lookup(&all).unwrap().into_iter().flatten().collect();
    assert_eq!(before.len(), 64, "the index lists blocks the file no longer holds");
    let report = index.reconcile(&[TierFile::new(spec, &tier_path)], Verify::Shape).unwrap();
    assert_eq!(report.bytes_read, 0);
    let past: HashSet<u32> =
        before.iter().filter(|p| spec.slot_offset(p.slot) + p.len > cut).map(|p| p.slot).collect();
    assert_eq!(report.dropped.len(), past.len());
    for d in &report.dropped {
        assert!(past.contains(&d.placement.slot), "{d:?}");
        assert_eq!(d.reason, DropReason::PastEnd { file_len: cut });
    }
    assert_eq!(report.kept as usize, 64 - past.len());
    assert_eq!(served_blocks_verify(&index, &tier_path, 64), 64 - past.len());
    let s = index.tier_stats(spec.node, spec.tier).unwrap();
    assert_eq!((s.published as usize, s.free + s.published), (64 - past.len(), spec.slot_count));
    drop(index);

    // Reopened (the drops were durable), then the file is gone.
    std::fs::remove_file(&tier_path).unwrap();
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    assert_eq!(index.lookup(&all).unwrap().iter().flatten().count(), 64 - past.len());
    let report = index.reconcile(&[TierFile::new(spec, &tier_path)], Verify::Full).unwrap();
    assert_eq!(report.dropped.len(), 64 - past.len());
    assert!(report.dropped.iter().all(|d| matches!(d.reason, DropReason::FileMissing { .. })));
    assert_eq!(index.lookup(&all).unwrap().iter().flatten().count(), 0);
    assert_eq!(index.durable_blocks().unwrap(), 0);
}

/// After a crash the tier file was replaced by another of the same size: the cheap check
/// cannot see it, a sample can (and then verifies the whole tier, dropping every block); a
/// single block overwritten behind the index's back is found by a full verify and dropped
/// alone. Nothing dropped is served again, everything kept verifies.
#[test]
fn reconcile_a_replaced_or_damaged_tier_file() {
    let dir = tempfile::tempdir().unwrap();
    crash_after_saving(dir.path(), 64);
    let spec = embedded_tier();
    let tier_path = dir.path().join("tier");
    let file = TierFile::new(spec, &tier_path);

    // One block damaged: found by the full verify, dropped alone.
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let damaged = index.lookup(&[key(17)]).unwrap()[0].unwrap();
    {
        let tier = FileTier::open_existing(spec, &tier_path);
        let mut bytes = tier.read(damaged.slot, damaged.len);
        bytes[123] ^= 0x40;
        tier.write(damaged.slot, &bytes);
    }
    assert!(index
        .reconcile(std::slice::from_ref(&file), Verify::Shape)
        .unwrap()
        .dropped
        .is_empty());
    let report = index.reconcile(std::slice::from_ref(&file), Verify::Full).unwrap();
    assert_eq!(report.dropped.len(), 1, "{report:?}");
    assert_eq!(report.dropped[0].placement, damaged);
    assert!(matches!(report.dropped[0].reason, DropReason::ChecksumMismatch { .. }));
    assert_eq!((report.verified, report.kept), (63, 63));
    assert_eq!(index.lookup(&[key(17)]).unwrap(), vec![None]);
    assert_eq!(served_blocks_verify(&index, &tier_path, 64), 63);
    drop(index);

    // The whole file replaced by one of the same size.
    let len = std::fs::metadata(&tier_path).unwrap().len();
    std::fs::remove_file(&tier_path).unwrap();
    std::fs::write(&tier_path, vec![0x5a; len as usize]).unwrap();
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let cheap = index.reconcile(std::slice::from_ref(&file), Verify::Shape).unwrap();
    assert!(cheap.dropped.is_empty() && cheap.kept == 63, "the length alone cannot tell");
    let report = index
        .reconcile(std::slice::from_ref(&file), Verify::Sample { max_bytes: 8 << 10 })
        .unwrap();
    assert_eq!(report.escalated, 1, "a failed sample verifies the whole tier");
    assert_eq!(report.dropped.len(), 63);
    assert_eq!((report.kept, report.verified), (0, 0));
    assert_eq!(served_blocks_verify(&index, &tier_path, 64), 0);
}

/// After a restart the tier is configured smaller, then with another slot size: the reconcile
/// drops the blocks past the new end (then every block), registers the new shape (which a
/// plain `register_tier` refuses), and reservations follow it.
#[test]
fn reconcile_a_tier_that_shrank_or_changed_shape() {
    let dir = tempfile::tempdir().unwrap();
    crash_after_saving(dir.path(), 64);
    let tier_path = dir.path().join("tier");
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    let smaller = TierSpec { slot_count: 40, ..embedded_tier() };
    assert!(matches!(index.register_tier(&smaller), Err(Error::TierConflict { .. })));
    let report = index
        .reconcile(&[TierFile::new(smaller, &tier_path)], Verify::Sample { max_bytes: 1 << 20 })
        .unwrap();
    assert_eq!(report.dropped.len(), 24);
    assert!(report
        .dropped
        .iter()
        .all(|d| d.reason == DropReason::Shrunk && d.placement.slot >= 40));
    assert_eq!((report.kept, report.verified), (40, 40));
    let s = index.tier_stats(smaller.node, smaller.tier).unwrap();
    assert_eq!((s.published, s.free), (40, 0));
    index.register_tier(&smaller).unwrap();
    assert_eq!(served_blocks_verify(&index, &tier_path, 64), 40);
    drop(index);

    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    assert_eq!(
        index.lookup(&(0..64).map(key).collect::<Vec<_>>()).unwrap().iter().flatten().count(),
        40
    );
    let other = TierSpec { slot_size: 8192, ..smaller };
    let report = index.reconcile(&[TierFile::new(other, &tier_path)], Verify::Shape).unwrap();
    assert_eq!(report.dropped.len(), 40);
    assert!(report.dropped.iter().all(|d| d.reason == DropReason::Reshaped));
    let r = reserve(&index, key(1000), &other, 8000);
    assert!(r.slot < 40);
    let s = index.tier_stats(other.node, other.tier).unwrap();
    assert_eq!((s.reserved, s.published, s.free), (1, 0, 39));
}

/// What the reconcile leaves to the loads: a block whose bytes changed in its slot after its
/// publish (a torn write, a writer that outlived its reservation, bit rot) fails its get, alone
/// in its batch, and is removed from the index, so it is a miss afterwards, never a hit that
/// fails again. The blocks beside it load and verify.
#[test]
fn pool_drops_a_block_that_fails_verification() {
    use umbp_composite::{
        offload, ChecksumPolicy, CompositeConfig, CompositeEngine, ObjectRange, ObjectTransfer,
    };
    use umbp_localcopy::LocalCopyEngine;
    use umbp_plan::{BatchState, EndpointRegistry, Register};
    use umbp_pool::{
        BlockError, GetBlock, GetOutcome, Pool, PoolConfig, PutBlock, PutOutcome, TierRegion,
    };

    const SLOT: u64 = 4096;
    let registry = EndpointRegistry::new();
    let copy = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config =
        CompositeConfig { checksums: ChecksumPolicy::AllTiers, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, vec![copy], config);
    let dir = tempfile::tempdir().unwrap();
    let index = Arc::new(EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap());
    let spec = TierSpec::new(NodeId(0), TierId(0), SLOT, 8).watermarks(0, 0);
    let arena = composite.register_memory(vec![0u8; (SLOT * 8) as usize]).unwrap();
    let region = TierRegion::new(arena.id(), 0, &spec);
    let pool = Pool::new(index.clone(), composite.clone(), PoolConfig::new(NodeId(0))).unwrap();
    pool.add_tier(spec, region).unwrap();

    let blocks: Vec<Vec<u8>> = (0..3).map(|id| block_bytes(id, 0, 3000)).collect();
    let src = composite.register_memory(blocks.concat()).unwrap();
    let puts: Vec<PutBlock> = (0..3)
        .map(|i| PutBlock { key: key(i), src: src.id(), offset: i * 3000, len: 3000 })
        .collect();
    let stored: Vec<Placement> = pool
        .put(spec.tier, &puts)
        .unwrap()
        .into_iter()
        .map(|o| match o {
            PutOutcome::Stored(p) => p,
            other => panic!("{other:?}"),
        })
        .collect();
    // Block 1's slot is overwritten behind the index's back.
    let junk = composite.register_memory(vec![0x77u8; 3000]).unwrap();
    let mut page = [0u64; 1];
    let ranges = [ObjectRange::new(0, 3000, junk.id(), 0)];
    let clobber = [ObjectTransfer::new(1, region.object(stored[1].slot, 3000, &mut page), &ranges)];
    let mut builder = composite.builder();
    assert_eq!(offload(&mut builder, &clobber).unwrap().aggregate, BatchState::Completed);

    let dst = composite.register_memory(vec![0u8; 3 * 3000]).unwrap();
    let gets: Vec<GetBlock> = (0..3)
        .map(|i| GetBlock { key: key(i), dst: dst.id(), offset: i * 3000, capacity: 3000 })
        .collect();
    let out = pool.get(&gets).unwrap();
    assert!(out[0].is_loaded() && out[2].is_loaded(), "{out:?}");
    assert!(matches!(out[1], GetOutcome::Failed(BlockError::ChecksumMismatch { .. })), "{out:?}");
    assert_eq!(
        index.lookup(&[key(0), key(1), key(2)]).unwrap(),
        vec![Some(stored[0]), None, Some(stored[2])],
        "a block that failed verification must not stay a hit"
    );
    let again = pool.get(&gets[1..2]).unwrap();
    assert!(matches!(again[0], GetOutcome::Miss), "{again:?}");
    let loaded = dst.deregister();
    assert_eq!(&loaded[..3000], &blocks[0][..]);
    assert_eq!(&loaded[6000..], &blocks[2][..]);
    // Its slot is free again: the tier holds the two good blocks only.
    let s = index.tier_stats(spec.node, spec.tier).unwrap();
    assert_eq!((s.published, s.free), (2, 6));
}

/// The pool's data path across a Redis restart: while the server is down a put and a get fail
/// as calls (`Error::Redis`, nothing written or loaded); once it is back (empty) the pool's own
/// announcer rejoins the node, gets are misses, and puts store and gets load again, with no
/// help from the caller.
#[test]
fn pool_resumes_by_itself_after_a_redis_restart() {
    let Some(mut server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> =
        Arc::new(RedisIndex::connect(&support::config(&server, PREFIX)).unwrap());
    let pool = DramPool::new(index, NodeId(1), Duration::from_millis(300));
    assert_eq!(pool.put(0, 8).unwrap(), 8);
    assert_eq!(pool.get(0, 8).unwrap(), "LLLLLLLL");
    server.kill();
    assert!(matches!(pool.put(8, 16), Err(Error::Redis(_))));
    assert!(matches!(pool.get(0, 8), Err(Error::Redis(_))));
    server.restart();
    assert_eq!(pool.get(0, 8).unwrap(), "MMMMMMMM", "the restarted server knows nothing");
    // The announcer (every 100 ms) rejoins the node; the index registers its tier again.
    let back = Instant::now();
    while pool.put(0, 8).ok() != Some(8) {
        if back.elapsed() > Duration::from_secs(10) {
            let r = pool.pool.index().reserve(key(0), pool.spec.node, pool.spec.tier, 1, TTL);
            panic!(
                "puts never resumed: {:?}; {r:?}; nodes {:?}",
                pool.put(0, 8),
                pool.pool.index().nodes()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("puts resumed {:?} after the restart", back.elapsed());
    assert_eq!(pool.get(0, 10).unwrap(), "LLLLLLLLMM");
}

/// The child of [`restarted_instance_serves_none_of_its_old_dram_blocks`]: a [`DramPool`] over
/// the shared Redis as node `UMBP_FAULTS_NODE`, announced for `UMBP_FAULTS_ANNOUNCE_MS` (a
/// minute when unset, so a killed instance is still alive in the index when it restarts). Commands: `put FROM TO` (answers `stored N`),
/// `get FROM TO` (answers [`DramPool::get`]'s letters).
#[test]
fn child_pool_instance() {
    if role().as_deref() != Some("pool-instance") {
        return;
    }
    let index = Arc::new(RedisIndex::connect(&redis_config(env("UMBP_FAULTS_PORT"))).unwrap());
    let announce = std::env::var("UMBP_FAULTS_ANNOUNCE_MS").map_or(60_000, |v| v.parse().unwrap());
    let pool =
        DramPool::new(index, NodeId(env("UMBP_FAULTS_NODE")), Duration::from_millis(announce));
    reply("ready");
    for line in commands() {
        let w: Vec<&str> = line.split_whitespace().collect();
        let (from, to): (u64, u64) = (w[1].parse().unwrap(), w[2].parse().unwrap());
        match w[0] {
            "put" => reply(format!("stored {}", pool.put(from, to).unwrap())),
            "get" => reply(pool.get(from, to).unwrap()),
            other => panic!("unknown command {other}"),
        }
    }
}

/// An instance (a child process running a `Pool` over the shared Redis, with a DRAM tier) saves
/// blocks and is killed with SIGKILL; restarted at once as the same node (its announcement
/// has not expired), its DRAM arena is new. Its old blocks are never served: they are misses
/// from the start (the restarted pool rejoins empty), and what it saves afterwards is served.
#[test]
fn restarted_instance_serves_none_of_its_old_dram_blocks() {
    let Some(server) = RedisServer::start() else { return };
    let spawn = |node: u32| {
        let mut p = Process::spawn(
            "child_pool_instance",
            "pool-instance",
            &[
                ("UMBP_FAULTS_PORT", server.port().to_string()),
                ("UMBP_FAULTS_NODE", node.to_string()),
            ],
        );
        assert_eq!(p.answer(), "ready");
        p
    };
    let mut a = spawn(2);
    assert_eq!(a.ask("put 0 8"), "stored 8");
    assert_eq!(a.ask("get 0 8"), "LLLLLLLL");
    a.kill();
    let mut a = spawn(2);
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    assert_eq!(
        index.lookup(&(0..8).map(key).collect::<Vec<_>>()).unwrap(),
        vec![None; 8],
        "the restarted node's old DRAM blocks are still listed"
    );
    assert_eq!(a.ask("get 0 8"), "MMMMMMMM");
    assert_eq!(a.ask("put 0 4"), "stored 4");
    assert_eq!(a.ask("get 0 8"), "LLLLMMMM");
}

/// The embedded index killed (SIGKILL) while it creates its file, at random moments of a
/// child process's start: the next open must always succeed (an empty index), never find a
/// half-created file it cannot read. Before the fix, a kill during redb's creation left a file
/// that failed every later open ("I/O error: invalid data"), so the instance could not start
/// until someone deleted it.
#[test]
fn embedded_killed_while_creating_its_index() {
    if role().as_deref() == Some("creator") {
        let index = EmbeddedIndex::open(env::<String>("UMBP_FAULTS_INDEX")).unwrap();
        index.register_tier(&embedded_tier()).unwrap();
        reply("created");
        for _ in commands() {}
        return;
    }
    let seed: u64 = std::env::var("UMBP_FAULTS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::process::id().into());
    eprintln!("seed {seed} (UMBP_FAULTS_SEED={seed} repeats this run)");
    let mut rng = Rng(seed | 1);
    let spawn = |path: &Path| {
        Process::spawn(
            "embedded_killed_while_creating_its_index",
            "creator",
            &[("UMBP_FAULTS_INDEX", path.display().to_string())],
        )
    };
    // How long a child takes to start and create its index on this machine now: the kills
    // land anywhere in that span, so the test does not depend on the machine's load.
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    assert_eq!(spawn(&dir.path().join("pool.redb")).answer(), "created");
    let span = started.elapsed();
    eprintln!("a child starts and creates its index in {span:?}");
    let mut created_before_kill = 0;
    for round in 0..25 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.redb");
        let mut child = spawn(&path);
        // The creation is the end of the span: most kills land in its second half.
        std::thread::sleep(span.mul_f64(0.3 + rng.below(800) as f64 / 1000.0));
        child.kill();
        created_before_kill += child.remaining_answers().len();
        let index = EmbeddedIndex::open(&path).unwrap_or_else(|e| {
            let len = std::fs::metadata(&path).map(|m| m.len());
            panic!("round {round}: the index cannot be opened after a kill during its creation ({len:?} bytes): {e}")
        });
        assert_eq!(index.durable_blocks().unwrap(), 0);
        index.register_tier(&embedded_tier()).unwrap();
    }
    eprintln!("{created_before_kill} of 25 children finished creating before the kill");
}

/// Polls `done` until it holds, for at most a minute (a check of an outcome, never a time
/// budget: a loaded machine only makes it slower).
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "{what}: not after a minute");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An admin connection to the test's Redis: what an operator (or an attacker with the
/// password) sees and does.
fn admin(server: &RedisServer) -> redis::Connection {
    redis::Client::open(format!("redis://:{}@127.0.0.1:{}/", server.password(), server.port()))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Issue 42, case 1: node 11 (a child process) stores 32 blocks and is SIGKILLed. Once its
/// announcement lapsed, node 12 stores the same keys (before the fix: "stored 0 present 32",
/// every get a miss, for as long as nobody called `reap_dead_nodes`), loads every byte back,
/// and node 12's own renewals reap node 11's state from Redis with nobody asking.
#[test]
fn a_dead_nodes_keys_are_stored_again_and_it_is_reaped_by_the_living() {
    let Some(server) = RedisServer::start() else { return };
    let mut eleven = Process::spawn(
        "child_pool_instance",
        "pool-instance",
        &[
            ("UMBP_FAULTS_PORT", server.port().to_string()),
            ("UMBP_FAULTS_NODE", "11".into()),
            ("UMBP_FAULTS_ANNOUNCE_MS", "600".into()),
        ],
    );
    assert_eq!(eleven.answer(), "ready");
    assert_eq!(eleven.ask("put 0 32"), "stored 32");
    assert_eq!(eleven.ask("get 0 32"), "L".repeat(32));
    eleven.kill();
    let index = Arc::new(RedisIndex::connect(&support::config(&server, PREFIX)).unwrap());
    eventually("node 11's announcement lapses", || {
        index.nodes().unwrap().iter().all(|n| n.node != NodeId(11))
    });

    let twelve = DramPool::new(index.clone(), NodeId(12), Duration::from_millis(300));
    let out = twelve.put_outcomes(0, 32).unwrap();
    let stored = out.iter().filter(|o| matches!(o, umbp_pool::PutOutcome::Stored(_))).count();
    assert_eq!(stored, 32, "node 12 must store the dead node's keys: {:?}", &out[..2]);
    assert_eq!(twelve.get(0, 32).unwrap(), "L".repeat(32));
    for p in index.lookup(&(0..32).map(key).collect::<Vec<_>>()).unwrap() {
        assert_eq!(p.unwrap().node, NodeId(12));
    }

    // Nobody calls reap_dead_nodes: node 12's renewals (every 100 ms) reap node 11 whole.
    let mut admin = admin(&server);
    eventually("node 11 is reaped by the living", || {
        let member: bool = redis::cmd("SISMEMBER")
            .arg(format!("{{{PREFIX}}}:nodes"))
            .arg(11)
            .query(&mut admin)
            .unwrap();
        let left: u32 = redis::cmd("EXISTS")
            .arg(format!("{{{PREFIX}}}:owner:11:0"))
            .arg(format!("{{{PREFIX}}}:tier:11:0"))
            .arg(format!("{{{PREFIX}}}:gen:11:0"))
            .query(&mut admin)
            .unwrap();
        !member && left == 0
    });
    // Reaping took only node 11's entries: node 12's blocks are all still there.
    assert_eq!(twelve.get(0, 32).unwrap(), "L".repeat(32));
}

/// Issue 42, case 2: a node whose tier comes back with another shape (a memory node restarted
/// with `kv=8MiB` instead of 4 MiB) rejoins after it left, after its announcement expired,
/// and after a reap, its old placements misses; while it is alive another shape is still a
/// conflict (its blocks live in the registered shape). Before the fix every one of the
/// three rejoins was `TierConflict`.
#[test]
fn a_node_rejoins_with_another_shape() {
    let Some(server) = RedisServer::start() else { return };
    let index = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let node = NodeId(77);
    let announce = |ttl: Duration| {
        index
            .announce(&NodeAnnouncement { node, address: "node-77".into(), tiers: vec![] }, ttl)
            .unwrap()
    };
    let mut slots = 4u32;
    let mut shape = || {
        slots *= 2;
        TierSpec::new(node, TierId(0), 4096, slots)
    };
    let first = shape();
    setup(&index, &first);
    let old: Vec<Placement> = (0..3).map(|i| put(&index, key(i), &first)).collect();
    assert!(matches!(index.register_tier(&shape()), Err(Error::TierConflict { .. })));

    // 1. After a planned leave.
    assert!(index.leave(node).unwrap());
    let second = shape();
    index.register_tier(&second).unwrap();
    announce(TTL);
    assert_eq!(index.tier_spec(node, TierId(0)).unwrap(), Some(second));
    assert_eq!(index.lookup(&[key(0), key(1), key(2)]).unwrap(), vec![None; 3]);
    assert_eq!(index.lease(&old, TTL).unwrap().granted, vec![false; 3]);
    let p = put(&index, key(10), &second);
    let s = index.tier_stats(node, TierId(0)).unwrap();
    assert_eq!((s.free, s.published), (second.slot_count - 1, 1));

    // 2. After its announcement expired (a crash), with 2,500 blocks to drop: more than one
    // bounded step of deletion.
    let many: Vec<_> = (100..2_600u64).map(|i| (key(i), 16)).collect();
    let third = TierSpec::new(node, TierId(0), 4096, 4096);
    assert!(index.leave(node).unwrap());
    index.register_tier(&third).unwrap();
    announce(TTL);
    for r in index.reserve_many(node, TierId(0), &many, TTL).unwrap() {
        let Reserved::Slot(r) = r.unwrap() else { panic!("present") };
        assert!(matches!(index.publish(&[(r, 1)]).unwrap()[..], [Published::Won(_)]));
    }
    announce(Duration::from_millis(200));
    eventually("node 77's announcement lapses", || index.nodes().unwrap().is_empty());
    let fourth = TierSpec::new(node, TierId(0), 8192, 100);
    index.register_tier(&fourth).unwrap();
    announce(TTL);
    assert_eq!(index.tier_spec(node, TierId(0)).unwrap(), Some(fourth));
    let found = index.lookup(&many.iter().map(|m| m.0).chain([key(10)]).collect::<Vec<_>>());
    assert!(found.unwrap().iter().all(Option::is_none));
    assert_eq!(index.lease(&[p], TTL).unwrap().granted, vec![false]);
    assert_eq!(index.tier_stats(node, TierId(0)).unwrap().free, 100);

    // 3. After a reap: nothing of it is left, and it registers afresh (a new process, as a
    // restarted memory node: registers, then announces).
    announce(Duration::from_millis(200));
    eventually("node 77's announcement lapses", || index.nodes().unwrap().is_empty());
    assert_eq!(index.reap_dead_nodes().unwrap(), 1);
    assert_eq!(index.tier_spec(node, TierId(0)).unwrap(), None);
    let restarted = RedisIndex::connect(&support::config(&server, PREFIX)).unwrap();
    let fifth = TierSpec::new(node, TierId(0), 1 << 20, 3);
    restarted.register_tier(&fifth).unwrap();
    restarted
        .announce(&NodeAnnouncement { node, address: "node-77".into(), tiers: vec![] }, TTL)
        .unwrap();
    let q = put(&restarted, key(11), &fifth);
    assert!(q.generation > p.generation, "a reaped node's slots never repeat a generation");
    assert_eq!(index.lookup(&[key(11)]).unwrap(), vec![Some(q)]);
}

/// Issue 42, case 3: the index is not trusted with the bytes. With only the Redis password,
/// copying K2's entry under K1 (two HSETs: the entry, and K1 as its slot's owner) made a get
/// of K1 load K2's bytes as a verified hit (`checksum_failures 0`): the checksum lived in the
/// entry it protected. Entries are sealed to their key now: the copy is a miss, counted, and
/// K2 still loads. With a cluster secret, a writer that has the Redis password but not the
/// secret (here: umbp's own client configured without it) cannot make an entry that a client
/// with the secret takes for a hit; the client replaces such entries when it stores the keys.
#[test]
fn a_copied_or_forged_entry_is_never_a_hit() {
    let Some(server) = RedisServer::start() else { return };
    let mut with_secret = support::config(&server, PREFIX);
    with_secret.secret = Some(b"the cluster's secret".to_vec());
    for config in [support::config(&server, PREFIX), with_secret.clone()] {
        let mut admin = admin(&server);
        redis::cmd("FLUSHALL").query::<()>(&mut admin).unwrap();
        let index = Arc::new(RedisIndex::connect(&config).unwrap());
        let pool = DramPool::new(index.clone(), NodeId(1), TTL);
        assert_eq!(pool.put(1, 3).unwrap(), 2);
        assert_eq!(pool.get(1, 3).unwrap(), "LL");
        let k1: [u8; 16] = key(1).0;
        let k2: [u8; 16] = key(2).0;
        let blocks = format!("{{{PREFIX}}}:blocks");
        let entry: Vec<u8> =
            redis::cmd("HGET").arg(&blocks).arg(&k2[..]).query(&mut admin).unwrap();
        let p2 = index.lookup(&[key(2)]).unwrap()[0].unwrap();
        redis::cmd("HSET").arg(&blocks).arg(&k1[..]).arg(&entry).query::<()>(&mut admin).unwrap();
        redis::cmd("HSET")
            .arg(format!("{{{PREFIX}}}:owner:1:0"))
            .arg(p2.slot)
            .arg(&k1[..])
            .query::<()>(&mut admin)
            .unwrap();
        let forged_before = index.forged_entries();
        assert_eq!(pool.get(1, 2).unwrap(), "M", "K1 must not load K2's bytes");
        assert_eq!(pool.pool.metrics().checksum_failures.load(Ordering::Relaxed), 0);
        assert!(index.forged_entries() > forged_before);
        // Storing K1 again replaces the copy; K2 was never touched... but its slot's owner was
        // edited, so K2's lease is refused: a miss, never wrong bytes.
        assert_eq!(pool.put(1, 2).unwrap(), 1);
        assert_eq!(pool.get(1, 2).unwrap(), "L");
        assert!(matches!(pool.get(2, 3).unwrap().as_str(), "L" | "M"));
    }

    // A writer with the Redis password and umbp's own client, but without the secret, stores
    // keys 10..14: a client with the secret misses every one of them, and stores them anew.
    let mut admin = admin(&server);
    redis::cmd("FLUSHALL").query::<()>(&mut admin).unwrap();
    let outsider = Arc::new(RedisIndex::connect(&support::config(&server, PREFIX)).unwrap());
    let forger = DramPool::new(outsider, NodeId(5), TTL);
    assert_eq!(forger.put(10, 14).unwrap(), 4);
    assert_eq!(forger.get(10, 14).unwrap(), "LLLL");
    let index = Arc::new(RedisIndex::connect(&with_secret).unwrap());
    assert_eq!(index.lookup(&(10..14).map(key).collect::<Vec<_>>()).unwrap(), vec![None; 4]);
    assert_eq!(index.forged_entries(), 4);
    let honest = DramPool::new(index.clone(), NodeId(6), TTL);
    assert_eq!(honest.get(10, 14).unwrap(), "MMMM");
    assert_eq!(honest.put(10, 14).unwrap(), 4, "the forged entries are replaced");
    assert_eq!(honest.get(10, 14).unwrap(), "LLLL");
    for p in index.lookup(&(10..14).map(key).collect::<Vec<_>>()).unwrap() {
        assert_eq!(p.unwrap().node, NodeId(6));
    }
}
