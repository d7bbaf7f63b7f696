//! The Redis index against a real `redis-server` (loopback, fresh port, temp dir, password),
//! one per test: the shared rules, then what only a shared index promises (node expiry, a
//! server killed and restarted, authentication).

mod support;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::suite::{self, key, put, setup, NODE, TTL};
use support::RedisServer;
use umbp_pool::{
    Error, Index, NodeAnnouncement, NodeId, Placement, RedisIndex, Removed, TierId, TierSpec,
};

fn connect(server: &RedisServer) -> RedisIndex {
    RedisIndex::connect(&support::config(server, "test")).unwrap()
}

macro_rules! shared {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let Some(server) = RedisServer::start() else { return };
            suite::$name(&connect(&server));
        }
    )*};
}

shared!(
    visible_only_after_publish,
    caller_mistakes_are_typed,
    abort_frees_and_full_is_typed,
    expired_reservation_publishes_nothing,
    leases_block_eviction_and_expire,
    release_and_recency,
    stale_generation_is_a_miss,
    batched_lookup_of_62500_keys,
    reserve_many_answers_per_item,
    batches_decide_item_by_item,
    a_slot_stays_leased_until_its_last_lease_ends,
);

/// A client of the test pool that reads every entry (no group summaries): the truth the
/// summaries are held to.
fn entries_only(server: &RedisServer) -> RedisIndex {
    let mut config = support::config(server, "test");
    config.group_summaries = false;
    RedisIndex::connect(&config).unwrap()
}

#[test]
fn long_prefixes_follow_every_change() {
    let Some(server) = RedisServer::start() else { return };
    suite::long_prefixes_follow_every_change(&connect(&server), &entries_only(&server));
}

#[test]
fn concurrent_churn_serves_nothing_wrong() {
    let Some(server) = RedisServer::start() else { return };
    suite::concurrent_churn_serves_nothing_wrong(Arc::new(connect(&server)), 600);
}

#[test]
fn racing_writers_one_winner() {
    let Some(server) = RedisServer::start() else { return };
    suite::racing_writers_one_winner(Arc::new(connect(&server)));
}

#[test]
fn two_clients_share_one_pool_and_prefixes_keep_pools_apart() {
    let Some(server) = RedisServer::start() else { return };
    let a = connect(&server);
    let b = connect(&server);
    let spec = TierSpec::new(NODE, TierId(0), 64, 8);
    setup(&a, &spec);
    let p = put(&a, key(1), &spec);
    assert_eq!(b.lookup(&[key(1)]).unwrap(), vec![Some(p)]);
    assert!(b.lease(&[p], TTL).unwrap().all_granted());
    let other = RedisIndex::connect(&support::config(&server, "other-pool")).unwrap();
    assert_eq!(other.lookup(&[key(1)]).unwrap(), vec![None]);
}

#[test]
fn authentication_is_required() {
    let Some(server) = RedisServer::start() else { return };
    let mut config = support::config(&server, "test");
    config.password = None;
    assert!(matches!(RedisIndex::connect(&config), Err(Error::Redis(_))));
    config.password = Some("wrong".into());
    assert!(matches!(RedisIndex::connect(&config), Err(Error::Redis(_))));
    config.prefix = "bad{prefix}".into();
    assert!(matches!(RedisIndex::connect(&config), Err(Error::InvalidConfig(_))));
}

#[test]
fn an_acl_user_with_its_own_password() {
    let Some(server) = RedisServer::start() else { return };
    let admin =
        redis::Client::open(format!("redis://:{}@127.0.0.1:{}/", server.password(), server.port()))
            .unwrap();
    let mut c = admin.get_connection().unwrap();
    redis::cmd("ACL")
        .arg(&["SETUSER", "pool", "on", ">pool-secret", "~{test}:*", "+@all"])
        .query::<()>(&mut c)
        .unwrap();
    let mut config = support::config(&server, "test");
    config.username = Some("pool".into());
    config.password = Some("pool-secret".into());
    let index = RedisIndex::connect(&config).unwrap();
    suite::visible_only_after_publish(&index);
    // The user reaches only its pool's keys.
    let mut outside = support::config(&server, "elsewhere");
    outside.username = Some("pool".into());
    outside.password = Some("pool-secret".into());
    // Refused at connect: the client checks the pool's shard count, which it may not read.
    assert!(matches!(RedisIndex::connect(&outside), Err(Error::Redis(_))));
}

#[test]
fn tls_without_the_feature_is_a_typed_error() {
    let mut config = umbp_pool::RedisConfig::new("rediss://127.0.0.1:1/");
    config.password = Some("x".into());
    let result = RedisIndex::connect(&config);
    if cfg!(feature = "tls") {
        // Nothing listens on port 1: a connection error, not a configuration one.
        assert!(matches!(result, Err(Error::Redis(_))), "{result:?}");
    } else {
        assert!(matches!(result, Err(Error::TlsUnavailable)), "{result:?}");
    }
}

/// TLS with a private CA: the pool works over it; without the CA the server is not trusted.
#[cfg(feature = "tls")]
#[test]
fn tls_with_a_private_ca() {
    let Some(server) = RedisServer::start_tls() else { return };
    suite::visible_only_after_publish(&connect(&server));
    let mut untrusted = support::config(&server, "test");
    untrusted.tls_ca_file = None;
    assert!(matches!(RedisIndex::connect(&untrusted), Err(Error::Redis(_))));
    let mut plain = support::config(&server, "test");
    plain.url = format!("redis://127.0.0.1:{}/", server.port());
    plain.tls_ca_file = None;
    assert!(RedisIndex::connect(&plain).is_err(), "plaintext to a TLS-only port must fail");
}

/// A node that stops renewing is dead: its placements leave lookups and leases at once, reaping
/// deletes them, and when it comes back it rejoins empty, under new generations.
#[test]
fn node_expiry_drops_its_placements() {
    let Some(server) = RedisServer::start() else { return };
    let index = connect(&server);
    let live = TierSpec::new(NodeId(1), TierId(0), 64, 4);
    let dying = TierSpec::new(NodeId(2), TierId(0), 64, 4);
    setup(&index, &live);
    setup(&index, &dying);
    let kept = put(&index, key(1), &live);
    let lost = put(&index, key(2), &dying);
    let short = Duration::from_millis(300);
    let announce = |node: NodeId, ttl| {
        index
            .announce(
                &NodeAnnouncement { node, address: format!("node-{node}"), tiers: vec![] },
                ttl,
            )
            .unwrap()
    };
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![Some(kept), Some(lost)]);
    assert_eq!(index.nodes().unwrap().len(), 2);
    // Node 2 renews once for a short time, then stops.
    announce(NodeId(2), short);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![Some(kept), None]);
    assert_eq!(index.lease(&[kept, lost], TTL).unwrap().granted, vec![true, false]);
    let nodes = index.nodes().unwrap();
    assert_eq!(nodes.iter().map(|n| n.node).collect::<Vec<_>>(), vec![NodeId(1)]);
    assert_eq!(nodes[0].address, "127.0.0.1:7001");
    assert!(matches!(
        index.reserve(key(3), NodeId(2), TierId(0), 64, TTL),
        Err(Error::NodeNotAlive(NodeId(2)))
    ));
    assert_eq!(index.reap_dead_nodes().unwrap(), 1);
    // Reaped whole: its tier is gone with its entries.
    assert!(matches!(index.tier_stats(NodeId(2), TierId(0)), Err(Error::UnknownTier { .. })));
    // It comes back: empty (the client registers its tier again), and its old placement
    // never matches again.
    announce(NodeId(2), TTL);
    assert_eq!(index.tier_stats(NodeId(2), TierId(0)).unwrap().free, 4);
    let again = put(&index, key(4), &dying);
    assert_eq!(again.slot, lost.slot);
    assert!(again.generation > lost.generation);
    assert_eq!(index.lease(&[lost], TTL).unwrap().granted, vec![false]);
    assert_eq!(index.lookup(&[key(2)]).unwrap(), vec![None]);
}

/// Redis killed mid-run: every call fails cleanly (an error, never a wrong hit); restarted
/// (empty), the client reconnects, re-registers its tiers when its node rejoins, and
/// everything resumes.
#[test]
fn redis_killed_and_restarted_mid_run() {
    let Some(mut server) = RedisServer::start() else { return };
    let index = Arc::new(connect(&server));
    let spec = TierSpec::new(NODE, TierId(0), 64, 64);
    setup(&*index, &spec);
    let before: Vec<_> = (0..8).map(|i| put(&*index, key(i), &spec)).collect();
    // A reader loops on lookups while the server dies and comes back: each answer is an error,
    // a miss, or exactly the placement that was published.
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(AtomicU32::new(0));
    let reader = {
        let (index, stop, answers, before) =
            (index.clone(), stop.clone(), answers.clone(), before.clone());
        std::thread::spawn(move || {
            let keys: Vec<_> = (0..8).map(key).collect();
            let mut errors = 0u32;
            while !stop.load(Ordering::Relaxed) {
                match index.lookup(&keys) {
                    Ok(found) => {
                        for (f, b) in found.iter().zip(&before) {
                            assert!(f.is_none() || *f == Some(*b), "wrong hit {f:?}");
                        }
                        answers.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(Error::Redis(_)) => errors += 1,
                    Err(e) => panic!("unexpected error {e}"),
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            errors
        })
    };
    let wait_for_answers = |more_than: u32| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while answers.load(Ordering::Relaxed) <= more_than {
            assert!(Instant::now() < deadline, "the reader got no answer in 10 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_for_answers(0);
    server.kill();
    let t = Instant::now();
    assert!(matches!(index.lookup(&[key(0)]), Err(Error::Redis(_))));
    assert!(matches!(index.reserve(key(100), NODE, TierId(0), 8, TTL), Err(Error::Redis(_))));
    assert!(t.elapsed() < Duration::from_secs(10), "a dead server must fail fast, not hang");
    std::thread::sleep(Duration::from_millis(50));
    server.restart();
    // The server lost everything: misses, and the node must announce again to be alive.
    assert_eq!(index.lookup(&[key(0)]).unwrap(), vec![None]);
    assert!(matches!(
        index.reserve(key(100), NODE, TierId(0), 8, TTL),
        Err(Error::NodeNotAlive(_))
    ));
    index
        .announce(&NodeAnnouncement { node: NODE, address: "again".into(), tiers: vec![] }, TTL)
        .unwrap();
    // Its tier is registered again by the client: writes resume.
    let p = put(&*index, key(100), &spec);
    assert_eq!(index.lookup(&[key(100)]).unwrap(), vec![Some(p)]);
    assert!(index.lease(&[p], TTL).unwrap().all_granted());
    // The reader resumes too.
    wait_for_answers(answers.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    let errors = reader.join().unwrap();
    eprintln!(
        "reader: {} answers, {errors} clean errors across the restart",
        answers.load(Ordering::Relaxed)
    );
}

/// Batched lookups decode their reply directly (plain TCP) or through redis-rs (`direct_lookup:
/// false`, and TLS): both answer the same, over chunk boundaries, with misses, a dead node's
/// placements and a server that forgot the alive-nodes script; a corrupt value is a typed
/// error on both, and the direct path goes on serving after it.
#[test]
fn direct_and_redis_rs_lookups_agree() {
    let Some(server) = RedisServer::start() else { return };
    let direct = connect(&server);
    let mut config = support::config(&server, "test");
    config.direct_lookup = false;
    let values = RedisIndex::connect(&config).unwrap();
    let one = TierSpec::new(NODE, TierId(0), 64, 12_000);
    let two = TierSpec::new(NodeId(2), TierId(0), 64, 100);
    setup(&direct, &one);
    setup(&direct, &two);
    let mut saved = Vec::new();
    for chunk in (0..9_000u64).collect::<Vec<_>>().chunks(1024) {
        let items: Vec<_> = chunk.iter().map(|&i| (key(i), 16)).collect();
        let reserved = direct.reserve_many(NODE, TierId(0), &items, TTL).unwrap();
        let publish: Vec<_> = reserved
            .into_iter()
            .map(|r| match r.unwrap() {
                umbp_pool::Reserved::Slot(r) => (r, umbp_pool::checksum(&r.key.0)),
                other => panic!("{other:?}"),
            })
            .collect();
        saved.extend(direct.publish(&publish).unwrap());
    }
    let on_two = put(&direct, key(50_000), &two);
    // Hits of both nodes, and misses, spread over three 4,096-key chunks.
    let keys: Vec<_> = (0..12_000u64)
        .map(|i| if i % 7 == 3 { key(100_000 + i) } else { key(i % 9_000) })
        .collect();
    let mut keys = keys;
    keys[4_095] = key(50_000);
    keys[4_096] = key(50_000);
    let a = direct.lookup(&keys).unwrap();
    assert_eq!(a, values.lookup(&keys).unwrap());
    assert_eq!(a[4_095], Some(on_two));
    for (i, found) in a.iter().enumerate() {
        match i {
            4_095 | 4_096 => {}
            i if i % 7 == 3 => assert_eq!(*found, None, "key {i}"),
            i => {
                let umbp_pool::Published::Won(p) = saved[i % 9_000] else { panic!() };
                assert_eq!(*found, Some(p), "key {i}");
            }
        }
    }
    assert_eq!(direct.lookup(&[]).unwrap(), vec![]);

    let admin =
        redis::Client::open(format!("redis://:{}@127.0.0.1:{}/", server.password(), server.port()))
            .unwrap();
    let mut admin = admin.get_connection().unwrap();
    // Node 2 dies: its placement leaves both paths' lookups at once.
    redis::cmd("DEL").arg("{test}:node:2").query::<()>(&mut admin).unwrap();
    let a = direct.lookup(&keys).unwrap();
    assert_eq!(a, values.lookup(&keys).unwrap());
    assert_eq!((a[4_095], a[4_096]), (None, None));
    assert!(a[0].is_some());
    // The server forgets every script: both paths load the alive-nodes script again.
    redis::cmd("SCRIPT").arg("FLUSH").query::<()>(&mut admin).unwrap();
    assert_eq!(direct.lookup(&keys).unwrap(), a);
    redis::cmd("SCRIPT").arg("FLUSH").query::<()>(&mut admin).unwrap();
    assert_eq!(values.lookup(&keys).unwrap(), a);
    // A value of the wrong shape is no sealed entry: a miss on both paths, counted, and the
    // rest of the answer is unchanged.
    redis::cmd("HSET")
        .arg("{test}:blocks")
        .arg(&key(5).0[..])
        .arg("short")
        .query::<()>(&mut admin)
        .unwrap();
    let mut expected = a.clone();
    for (i, k) in keys.iter().enumerate() {
        if *k == key(5) {
            expected[i] = None;
        }
    }
    assert_eq!(direct.lookup(&keys).unwrap(), expected);
    assert_eq!(values.lookup(&keys).unwrap(), expected);
    assert!(direct.forged_entries() >= 1 && values.forged_entries() >= 1);
    assert_eq!(direct.lookup(&[key(6), key(100_003)]).unwrap(), vec![a[6], None]);
}

/// An admin connection to `server`, for what a Redis writer (or an operator) does by hand.
fn admin(server: &RedisServer) -> redis::Connection {
    redis::Client::open(format!("redis://:{}@127.0.0.1:{}/", server.password(), server.port()))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// Asserts two lookups' answers are the same, naming the first key where they differ.
fn same(got: &[Option<Placement>], want: &[Option<Placement>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{what}: key {i}: {:?} where {:?}", got[i], want[i]);
    }
}

/// Polls `done` until it holds (no time budget: a slow machine only waits longer).
fn eventually(mut done: impl FnMut() -> bool) {
    while !done() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Group summaries stand for their entries only while they hold: the first lookups summarize
/// a long list's groups (the second time each is found whole), a removal deletes its group's
/// summary, a summary copied under another group or edited is ignored (and counted as
/// forged), a node that stopped renewing has its placements missed though its summaries are
/// still in Redis, and when it rejoins empty its summaries go with its entries.
#[test]
fn group_summaries_need_live_nodes_and_their_own_seal() {
    let Some(server) = RedisServer::start() else { return };
    let index = connect(&server);
    let truth = entries_only(&server);
    let mut admin = admin(&server);
    let node = NodeId(2);
    let spec = TierSpec::new(node, TierId(0), 16, 5000).watermarks(0, 0);
    setup(&index, &spec);
    let keys: Vec<_> = (0..4106).map(key).collect();
    suite::store_all(&index, &spec, &keys);
    let count = |admin: &mut redis::Connection, what: &str| -> usize {
        redis::cmd("HLEN").arg(format!("{{test}}:{what}")).query(admin).unwrap()
    };
    let summaries = |admin: &mut redis::Connection| -> Vec<(Vec<u8>, Vec<u8>)> {
        redis::cmd("HGETALL").arg("{test}:groups").query(admin).unwrap()
    };
    let all = truth.lookup(&keys).unwrap();
    assert!(all.iter().all(Option::is_some));

    // Each lookup summarizes groups of up to 4,096 keys in all, each the second time it is
    // found whole, until every group between the head and the tail is.
    let mut groups = 0;
    for asked in 1.. {
        same(&index.lookup(&keys).unwrap(), &all, "all stored");
        let now = count(&mut admin, "groups");
        if now == groups && asked > 2 {
            break;
        }
        groups = now;
    }
    assert!(groups >= 8, "{groups} groups");
    assert_eq!(count(&mut admin, "heads"), groups);
    assert!(count(&mut admin, "member") >= 2000);
    assert_eq!(index.prefix_hits(&keys).unwrap(), 4106);

    // Removing block 2000 deletes its group's summary, whichever client reads next.
    let before = summaries(&mut admin);
    index.remove(&[keys[2000]]).unwrap();
    let after = summaries(&mut admin);
    assert_eq!(after.len(), groups - 1);
    let (gone, own) = before.iter().find(|(id, _)| !after.iter().any(|(a, _)| a == id)).unwrap();
    assert_eq!(index.prefix_hits(&keys).unwrap(), 2000);
    let mut want = all.clone();
    want[2000] = None;
    assert_eq!(count(&mut admin, "heads"), groups - 1);
    // A writer copies another group's summary (or its head, which prefixes read) under that
    // group's id, or edits its old one: neither is taken.
    let heads: Vec<(Vec<u8>, Vec<u8>)> =
        redis::cmd("HGETALL").arg("{test}:heads").query(&mut admin).unwrap();
    redis::cmd("HSET")
        .arg("{test}:heads")
        .arg(gone)
        .arg(&heads[0].1)
        .query::<()>(&mut admin)
        .unwrap();
    let seen = index.forged_entries();
    assert_eq!(index.prefix_hits(&keys).unwrap(), 2000);
    assert!(index.forged_entries() > seen);
    redis::cmd("HDEL").arg("{test}:heads").arg(gone).query::<()>(&mut admin).unwrap();
    let mut edited = own.clone();
    edited[0] ^= 1;
    for forged in [after[0].1.clone(), edited.clone(), own.clone()] {
        redis::cmd("HSET")
            .arg("{test}:groups")
            .arg(gone)
            .arg(&forged)
            .query::<()>(&mut admin)
            .unwrap();
        let seen = index.forged_entries();
        if forged != *own {
            same(&index.lookup(&keys).unwrap(), &want, "a forged summary");
            assert!(index.forged_entries() > seen);
        }
    }
    // The old summary put back (a replay) gives block 2000's old placement, which no lease
    // grants once the block is stored again (a new generation): a miss, as a replayed entry.
    suite::store_all(&index, &spec, &keys[2000..2001]);
    let stale = index.lookup(&keys).unwrap()[2000].unwrap();
    assert_eq!(stale, all[2000].unwrap());
    assert_eq!(index.lease(&[stale], TTL).unwrap().granted, vec![false]);
    // Without the replayed value, the group is found whole and summarized again.
    redis::cmd("HDEL").arg("{test}:groups").arg(gone).query::<()>(&mut admin).unwrap();
    let restored = truth.lookup(&keys).unwrap();
    assert!(restored.iter().all(Option::is_some));
    for _ in 0..2 {
        same(&index.lookup(&keys).unwrap(), &restored, "stored again");
    }
    let value = summaries(&mut admin).into_iter().find(|(id, _)| id == gone).unwrap().1;
    assert!(value != *own && value != edited);
    same(&index.lookup(&keys).unwrap(), &restored, "summarized again");

    // The node stops renewing: its summaries are still in Redis, and its placements miss.
    let announce = |ttl| {
        index
            .announce(&NodeAnnouncement { node, address: "node-2".into(), tiers: vec![] }, ttl)
            .unwrap()
    };
    announce(Duration::from_millis(200));
    eventually(|| index.nodes().unwrap().is_empty());
    assert_eq!(count(&mut admin, "groups"), groups);
    assert!(index.lookup(&keys).unwrap().iter().all(Option::is_none));
    // It rejoins empty: its entries and the summaries that held them are gone.
    announce(TTL);
    assert_eq!(count(&mut admin, "groups"), 0);
    assert_eq!(count(&mut admin, "heads"), 0);
    assert_eq!(count(&mut admin, "member"), 0);
    assert!(index.lookup(&keys).unwrap().iter().all(Option::is_none));
}

/// One index shared by 16 threads: 15 ask for a 4,196-block prefix over and over while one
/// removes blocks from its end towards its start. The prefix only shrinks, so every answer
/// must lie between what was removed when the question was asked and what was about to be
/// removed when it was answered: a summary that outlived a removal would answer more.
#[test]
fn prefix_answers_never_run_past_a_removal_under_sixteen_threads() {
    use std::sync::atomic::AtomicUsize;
    let Some(server) = RedisServer::start() else { return };
    let index = Arc::new(connect(&server));
    let spec = TierSpec::new(NODE, TierId(0), 16, 5000).watermarks(0, 0);
    setup(&*index, &spec);
    const N: usize = 4196;
    let keys: Arc<Vec<_>> = Arc::new((0..N as u64).map(key).collect());
    suite::store_all(&*index, &spec, &keys);
    assert_eq!(index.prefix_hits(&keys).unwrap(), N);
    // The first position removed (done: the removal returned; intended: about to start).
    let done = Arc::new(AtomicUsize::new(N));
    let intended = Arc::new(AtomicUsize::new(N));
    let stop = Arc::new(AtomicBool::new(false));
    let askers: Vec<_> = (0..15)
        .map(|_| {
            let (index, keys) = (index.clone(), keys.clone());
            let (done, intended, stop) = (done.clone(), intended.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut asked = 0u32;
                loop {
                    let upper = done.load(Ordering::SeqCst);
                    let got = index.prefix_hits(&keys).unwrap();
                    let lower = intended.load(Ordering::SeqCst);
                    assert!(lower <= got && got <= upper, "{got} outside [{lower}, {upper}]");
                    asked += 1;
                    if stop.load(Ordering::SeqCst) {
                        return asked;
                    }
                }
            })
        })
        .collect();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..150 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let at = N - 1 - 27 * i - (rng % 27) as usize;
        intended.store(at, Ordering::SeqCst);
        index.remove(&[keys[at]]).unwrap();
        done.store(at, Ordering::SeqCst);
    }
    stop.store(true, Ordering::SeqCst);
    for a in askers {
        assert!(a.join().unwrap() > 0);
    }
    let last = done.load(Ordering::SeqCst);
    assert_eq!(index.prefix_hits(&keys).unwrap(), last);
    assert_eq!(suite::looked_up_prefix(&*index, &keys), last);
}

/// Lookups and prefixes through group summaries answer the same on the direct path, on the
/// redis-rs path and from a client reading every entry, while the summaries are built and
/// once they are.
#[test]
fn summaries_read_the_same_on_both_paths() {
    let Some(server) = RedisServer::start() else { return };
    let direct = connect(&server);
    let mut config = support::config(&server, "test");
    config.direct_lookup = false;
    let values = RedisIndex::connect(&config).unwrap();
    let truth = entries_only(&server);
    let spec = TierSpec::new(NODE, TierId(0), 16, 10_000).watermarks(0, 0);
    setup(&direct, &spec);
    let keys: Vec<_> = (0..9_000).map(key).collect();
    suite::store_all(&direct, &spec, &keys);
    let want = truth.lookup(&keys).unwrap();
    assert!(want.iter().all(Option::is_some));
    for round in 0..4 {
        for (path, index) in [("direct", &direct), ("redis-rs", &values)] {
            same(&index.lookup(&keys).unwrap(), &want, &format!("{path}, round {round}"));
            assert_eq!(index.prefix_hits(&keys).unwrap(), keys.len(), "{path}, round {round}");
        }
    }
    let summaries: usize =
        redis::cmd("HLEN").arg("{test}:groups").query(&mut admin(&server)).unwrap();
    assert!(summaries >= 20, "{summaries} summaries");
}

/// A relay to a Redis server that, once armed with a marker, loses the answer to the next
/// request carrying it: it forwards the request (Redis runs it) and then closes the connection
/// instead of forwarding the answer, as a proxy that restarts or a reset connection does.
struct AnswerCutter {
    port: u16,
    marker: Arc<std::sync::Mutex<Option<Vec<u8>>>>,
    cuts: Arc<AtomicU32>,
}

impl AnswerCutter {
    fn start(to: u16) -> Self {
        use std::io::{Read, Write};
        use std::net::{Shutdown, TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let marker: Arc<std::sync::Mutex<Option<Vec<u8>>>> = Arc::default();
        let cuts = Arc::new(AtomicU32::new(0));
        let (armed, counted) = (Arc::clone(&marker), Arc::clone(&cuts));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect(("127.0.0.1", to)).unwrap();
                let cut = Arc::new(AtomicBool::new(false));
                let (mut c_in, mut s_out) =
                    (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (armed, flag) = (Arc::clone(&armed), Arc::clone(&cut));
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut seen = Vec::new();
                    while let Ok(n @ 1..) = c_in.read(&mut buf) {
                        // The tail of the last read too, for a marker split across reads.
                        seen.extend_from_slice(&buf[..n]);
                        let mut m = armed.lock().unwrap();
                        let want = m.as_ref().map_or(0, Vec::len);
                        if m.as_deref().is_some_and(|w| seen.windows(w.len()).any(|s| s == w)) {
                            *m = None;
                            flag.store(true, Ordering::SeqCst);
                        }
                        seen.drain(..seen.len() - want.saturating_sub(1).min(seen.len()));
                        drop(m);
                        if s_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = s_out.shutdown(Shutdown::Write);
                });
                let (mut s_in, mut c_out) = (server, client);
                let counted = Arc::clone(&counted);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 1 << 16];
                    while let Ok(n @ 1..) = s_in.read(&mut buf) {
                        if cut.load(Ordering::SeqCst) {
                            counted.fetch_add(1, Ordering::SeqCst);
                            let _ = c_out.shutdown(Shutdown::Both);
                            let _ = s_in.shutdown(Shutdown::Both);
                            return;
                        }
                        if c_out.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = c_out.shutdown(Shutdown::Both);
                });
            }
        });
        Self { port, marker, cuts }
    }

    /// Loses the answer to the next request that carries `marker`.
    fn arm(&self, marker: &[u8]) {
        *self.marker.lock().unwrap() = Some(marker.to_vec());
    }
}

/// A reserve, a publish, a removal, an eviction and a leave whose answers are lost (the
/// connection closes after Redis ran them) are made again on a fresh connection; each repeat
/// answers as the call did and does nothing more: the reserve holds one slot, not two, the
/// block it published is `Won`, not `Expired`, the one it removed `Removed`, not `Absent`,
/// the eviction evicts one block, not two, and the node that left was alive.
#[test]
fn a_call_made_again_after_its_answer_was_lost_answers_as_it_did() {
    let Some(server) = RedisServer::start() else { return };
    let cutter = AnswerCutter::start(server.port());
    let mut config = support::config(&server, "test");
    config.url = format!("redis://127.0.0.1:{}/", cutter.port);
    let index = RedisIndex::connect(&config).unwrap();
    let direct = connect(&server);
    let spec = TierSpec::new(NODE, TierId(0), 4096, 8);
    setup(&index, &spec);
    // Redis has the scripts loaded, so a lost answer is never a `NOSCRIPT` that ran nothing.
    put(&index, key(99), &spec);
    assert_eq!(index.remove(&[key(99)]).unwrap(), [Removed::Removed]);
    assert!(!index.leave(NodeId(77)).unwrap());
    for i in 0..3u64 {
        let k = key(100 + i);
        // Reserving pools the connection whose publish answer is then lost.
        let r = suite::reserve(&index, k, &spec, 100);
        cutter.arm(&k.0);
        let published = index.publish(&[(r, 7)]).unwrap();
        assert_eq!(cutter.cuts.load(Ordering::SeqCst), 2 * i as u32 + 1, "publish {i} cut");
        let [umbp_pool::Published::Won(p)] = published[..] else {
            panic!("publish {i} made again answered {published:?}")
        };
        assert_eq!(direct.lookup(&[k]).unwrap(), [Some(p)]);
        cutter.arm(&k.0);
        let removed = index.remove(&[k, key(900)]).unwrap();
        assert_eq!(cutter.cuts.load(Ordering::SeqCst), 2 * i as u32 + 2, "removal {i} cut");
        assert_eq!(removed, [Removed::Removed, Removed::Absent]);
        assert_eq!(direct.lookup(&[k]).unwrap(), [None]);
    }
    // The tier holds nothing: every slot free again, none reserved twice.
    let stats = direct.tier_stats(NODE, TierId(0)).unwrap();
    assert_eq!((stats.published, stats.reserved, stats.free), (0, 0, 8), "{stats:?}");
    // A reserve: the repeat hands out the call's slot, and holds no second one.
    let k = key(300);
    cutter.arm(&k.0);
    let r = suite::reserve(&index, k, &spec, 100);
    assert_eq!(cutter.cuts.load(Ordering::SeqCst), 7, "reserve cut");
    let stats = direct.tier_stats(NODE, TierId(0)).unwrap();
    assert_eq!((stats.reserved, stats.free), (1, 7), "{stats:?}");
    assert!(matches!(index.publish(&[(r, 7)]).unwrap()[..], [umbp_pool::Published::Won(_)]));
    // An eviction: the repeat evicts nothing more.
    let evicting = TierSpec::new(NODE, TierId(4242), 4096, 8);
    index.register_tier(&evicting).unwrap();
    assert_eq!(index.evict(NODE, evicting.tier, 1).unwrap(), 0);
    for i in 0..3 {
        put(&index, key(400 + i), &evicting);
    }
    cutter.arm(b"\r\n4242\r\n");
    assert_eq!(index.evict(NODE, evicting.tier, 1).unwrap(), 1);
    assert_eq!(cutter.cuts.load(Ordering::SeqCst), 8, "eviction cut");
    assert_eq!(direct.tier_stats(NODE, evicting.tier).unwrap().published, 2);
    // A leave: the node was alive, not "already gone".
    let leaving = TierSpec::new(NodeId(48_611), TierId(0), 4096, 8);
    setup(&index, &leaving);
    let p = put(&index, key(200), &leaving);
    assert_eq!(direct.lookup(&[key(200)]).unwrap(), [Some(p)]);
    cutter.arm(b"\r\n48611\r\n");
    assert!(
        index.leave(leaving.node).unwrap(),
        "the leave made again answered that the node had left already"
    );
    assert_eq!(cutter.cuts.load(Ordering::SeqCst), 9, "leave cut");
    assert_eq!(direct.lookup(&[key(200)]).unwrap(), [None]);
}

/// A lease is one hash and one set entry per tier it holds slots of, not a key per slot:
/// releasing it leaves nothing behind in either tier, and a lease that ended without a release
/// (its TTL ran out) holds nothing and leaves its tier's set once a removal or an eviction
/// asks whether the tier's slots are leased.
#[test]
fn leases_leave_nothing_behind_in_any_tier() {
    let Some(server) = RedisServer::start() else { return };
    let index = connect(&server);
    let mut admin = admin(&server);
    let (zero, one) =
        (TierSpec::new(NODE, TierId(0), 64, 4), TierSpec::new(NODE, TierId(1), 64, 4));
    setup(&index, &zero);
    setup(&index, &one);
    let (a, b) = (put(&index, key(1), &zero), put(&index, key(2), &one));
    let members = |admin: &mut redis::Connection, tier: u16| -> usize {
        redis::cmd("SCARD").arg(format!("{{test}}:tl:{}:{tier}", NODE.0)).query(admin).unwrap()
    };
    let lease = index.lease(&[a, b], TTL).unwrap();
    assert!(lease.all_granted());
    assert_eq!((members(&mut admin, 0), members(&mut admin, 1)), (1, 1));
    // Held in both tiers: neither block leaves.
    assert_eq!(index.remove(&[key(1), key(2)]).unwrap(), vec![Removed::Leased, Removed::Leased]);
    index.release(lease.id).unwrap();
    assert_eq!((members(&mut admin, 0), members(&mut admin, 1)), (0, 0));
    let left: usize =
        redis::cmd("EXISTS").arg(format!("{{test}}:lease:{}", lease.id)).query(&mut admin).unwrap();
    assert_eq!(left, 0);
    // A lease that runs out unreleased: it holds nothing once gone, and the removal that
    // finds it gone takes it out of the tier's set.
    let short = index.lease(&[a, b], Duration::from_millis(50)).unwrap();
    assert!(short.all_granted());
    eventually(|| {
        let exists: usize = redis::cmd("EXISTS")
            .arg(format!("{{test}}:lease:{}", short.id))
            .query(&mut admin)
            .unwrap();
        exists == 0
    });
    assert_eq!(members(&mut admin, 0), 1);
    assert_eq!(index.remove(&[key(1)]).unwrap(), vec![Removed::Removed]);
    assert_eq!((members(&mut admin, 0), members(&mut admin, 1)), (0, 1));
    assert_eq!(index.remove(&[key(2)]).unwrap(), vec![Removed::Removed]);
    assert_eq!(members(&mut admin, 1), 0);
}
