//! The Redis index on a real Redis Cluster on loopback (three masters with a replica each,
//! joined by `redis-cli --cluster create`, one per test): the rules every index keeps, a pool
//! cut into 16 shards spread over the masters, a client that starts with one seed node, a
//! master killed mid-workload (its replica promoted), and a resharding under load. Every get
//! of the workloads is checked byte for byte: whatever the Cluster does, a hit has the right
//! bytes; a lost publish is a miss and a lost lease a load error.
//!
//! Skipped (with the reason printed) without `redis-server` and `redis-cli`, unless
//! `UMBP_REQUIRE_REDIS=1`.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::dram::DramPool;
use support::suite;
use umbp_pool::redis_server::{ClusterNode, RedisCluster};
use umbp_pool::{Index, NodeId, RedisIndex, TierId, TierSpec};

/// A client of pool `prefix` through the node on `seed`, with `shards` shards.
fn connect(cluster: &RedisCluster, prefix: &str, seed: u16, shards: u16) -> RedisIndex {
    let mut config = cluster.config(prefix, seed);
    config.shards = Some(shards);
    RedisIndex::connect(&config).unwrap()
}

fn masters(cluster: &RedisCluster) -> Vec<ClusterNode> {
    let seed = cluster.servers().iter().map(|s| s.port()).next().unwrap();
    RedisCluster::nodes_seen_by(seed).into_iter().filter(|n| n.master && n.slots > 0).collect()
}

/// The rules every index keeps, on a Cluster: each suite in a pool of its own (one shard, so
/// the suites' few-slot tiers keep their exact accounting), reached through a different
/// seed node each time (replicas too: they redirect).
#[test]
fn the_shared_rules_hold_on_a_cluster() {
    let Some(cluster) = RedisCluster::start(3) else { return };
    let seeds: Vec<u16> = cluster.servers().iter().map(|s| s.port()).collect();
    type Suite = fn(&dyn Index);
    let suites: [(&str, Suite); 10] = [
        ("visible", suite::visible_only_after_publish),
        ("mistakes", suite::caller_mistakes_are_typed),
        ("abort", suite::abort_frees_and_full_is_typed),
        ("expired", suite::expired_reservation_publishes_nothing),
        ("leases", suite::leases_block_eviction_and_expire),
        ("recency", suite::release_and_recency),
        ("stale", suite::stale_generation_is_a_miss),
        ("many", suite::reserve_many_answers_per_item),
        ("batches", suite::batches_decide_item_by_item),
        ("last-lease", suite::a_slot_stays_leased_until_its_last_lease_ends),
    ];
    for (i, (name, run)) in suites.iter().enumerate() {
        run(&connect(&cluster, name, seeds[i % seeds.len()], 1));
    }
    suite::racing_writers_one_winner(Arc::new(connect(&cluster, "race", seeds[0], 1)));
    suite::concurrent_churn_serves_nothing_wrong(
        Arc::new(connect(&cluster, "churn", seeds[1], 1)),
        200,
    );
}

/// A pool of 16 shards: its hash tags land on every master, every key is stored and loaded
/// byte for byte through the pool, a 62,500-key lookup answers every key in order, long
/// prefixes follow every change through group summaries kept per shard, and clients must
/// agree on the shard count.
#[test]
fn sixteen_shards_spread_over_the_masters() {
    let Some(cluster) = RedisCluster::start(3) else { return };
    let seed = cluster.servers()[0].port();
    let index = Arc::new(connect(&cluster, "sharded", seed, 16));
    assert_eq!(index.shard_count(), 16);
    // Which master serves each shard's tag: all three serve some.
    let serving: HashSet<Option<u16>> =
        (0..16).map(|s| cluster.master_serving(&format!("{{sharded.{s}}}"))).collect();
    assert_eq!(serving.len(), 3, "16 shards should land on all 3 masters: {serving:?}");
    assert!(!serving.contains(&None));
    // A prefix whose 3 shards land on 3 different masters can be found.
    let spread = cluster.spread_prefix("three", 3);
    let owners: HashSet<Option<u16>> =
        (0..3).map(|s| cluster.master_serving(&format!("{{{spread}.{s}}}"))).collect();
    assert_eq!(owners.len(), 3, "{spread}: {owners:?}");

    let pool = DramPool::with_tier(
        index.clone(),
        NodeId(1),
        Duration::from_secs(60),
        TierSpec::new(NodeId(1), TierId(0), 4096, 1024).watermarks(0, 0),
    );
    assert_eq!(pool.put(0, 600).unwrap(), 600);
    assert_eq!(pool.get(0, 600).unwrap(), "L".repeat(600));
    assert_eq!(pool.get(600, 604).unwrap(), "MMMM");
    let s = index.tier_stats(NodeId(1), TierId(0)).unwrap();
    assert_eq!((s.published, s.free), (600, 424));
    // A prefix of 62,500 keys whose first 600 are stored: one lookup over every shard.
    let keys: Vec<_> = (0..62_500).map(suite::key).collect();
    let found = index.lookup(&keys).unwrap();
    assert!(found[..600].iter().all(Option::is_some) && found[600..].iter().all(Option::is_none));
    assert_eq!(index.prefix_hits(&keys).unwrap(), 600);
    // Long prefixes answered through group summaries spread over the 16 shards.
    let mut entries_only = cluster.config("prefixes", seed);
    entries_only.shards = Some(16);
    entries_only.group_summaries = false;
    suite::long_prefixes_follow_every_change(
        &connect(&cluster, "prefixes", seed, 16),
        &RedisIndex::connect(&entries_only).unwrap(),
    );
    // Another shard count for the same pool is refused.
    let mut other = cluster.config("sharded", seed);
    other.shards = Some(4);
    assert!(matches!(RedisIndex::connect(&other), Err(umbp_pool::Error::InvalidConfig(_))));
}

/// A client given one seed node only (a replica) reaches every shard: it learns the rest.
#[test]
fn a_client_that_starts_with_one_seed_node() {
    let Some(cluster) = RedisCluster::start(3) else { return };
    let replica = RedisCluster::nodes_seen_by(cluster.servers()[0].port())
        .into_iter()
        .find(|n| !n.master)
        .expect("a replica")
        .port;
    let index = Arc::new(connect(&cluster, "seed", replica, 16));
    let pool = DramPool::with_tier(
        index,
        NodeId(3),
        Duration::from_secs(60),
        TierSpec::new(NodeId(3), TierId(0), 4096, 512).watermarks(0, 0),
    );
    assert_eq!(pool.put(0, 200).unwrap(), 200);
    assert_eq!(pool.get(0, 200).unwrap(), "L".repeat(200));
}

/// What a workload thread saw: gets with right bytes, misses, failed blocks, failed calls,
/// and gets that loaded wrong bytes (must stay 0).
#[derive(Default)]
struct Seen {
    loaded: AtomicU64,
    missed: AtomicU64,
    failed: AtomicU64,
    errors: AtomicU64,
    wrong: AtomicU64,
}

impl Seen {
    fn summary(&self) -> String {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} loaded, {} missed, {} failed blocks, {} failed calls, {} wrong",
            r(&self.loaded),
            r(&self.missed),
            r(&self.failed),
            r(&self.errors),
            r(&self.wrong)
        )
    }
}

/// Two instances (nodes 1 and 2) putting and getting overlapping ranges of 64 blocks in a
/// loop until `stop`, every get compared byte for byte.
fn workload(
    cluster: &RedisCluster,
    prefix: &'static str,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) -> Vec<std::thread::JoinHandle<()>> {
    let seed = cluster.servers()[0].port();
    (1..=2u32)
        .map(|n| {
            let index: Arc<dyn Index> = Arc::new(connect(cluster, prefix, seed, 16));
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let spec = TierSpec::new(NodeId(n), TierId(0), 4096, 256).watermarks(16, 64);
                let pool = DramPool::with_tier(index, NodeId(n), Duration::from_secs(2), spec);
                // Each instance its own keys: another node's DRAM tier is not reachable here
                // (no resolver), so its blocks would fail as unreachable.
                let base = u64::from(n) * 10_000;
                let mut round = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let from = base + (round * 37) % 400;
                    round += 1;
                    if pool.put(from, from + 64).is_err() {
                        seen.errors.fetch_add(1, Ordering::Relaxed);
                    }
                    match pool.get(from, from + 64) {
                        Ok(letters) => {
                            for c in letters.chars() {
                                let counter = match c {
                                    'L' => &seen.loaded,
                                    'M' => &seen.missed,
                                    'F' => &seen.failed,
                                    _ => &seen.wrong,
                                };
                                counter.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(_) => {
                            seen.errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect()
}

/// Stops the workload, prints what it saw as `what`, and checks that nothing was wrong.
fn finish(what: &str, stop: &AtomicBool, threads: Vec<std::thread::JoinHandle<()>>, seen: &Seen) {
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    eprintln!("{what}: {}", seen.summary());
    assert_eq!(seen.wrong.load(Ordering::Relaxed), 0, "a get loaded wrong bytes");
}

/// Waits until the workload has loaded `more` blocks beyond what it had.
fn wait_for_loads(seen: &Seen, more: u64) {
    let from = seen.loaded.load(Ordering::Relaxed);
    let start = Instant::now();
    while seen.loaded.load(Ordering::Relaxed) < from + more {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the workload stopped loading: {}",
            seen.summary()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A master is SIGKILLed mid-workload; its replica is promoted. Calls fail while the Cluster
/// fails over (whole calls: errors, or blocks failed), nothing is ever loaded wrong, and the
/// workload loads again once the replica serves.
#[test]
fn a_master_killed_mid_workload_fails_over_and_nothing_wrong_is_served() {
    let Some(mut cluster) = RedisCluster::start(3) else { return };
    let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(Seen::default()));
    let threads = workload(&cluster, "failover", stop.clone(), seen.clone());
    wait_for_loads(&seen, 2_000);
    // The master the clients were seeded with: new connections after its death must still
    // find the Cluster.
    let victim = cluster.servers()[0].port();
    assert!(masters(&cluster).iter().any(|m| m.port == victim), "the seed is a master");
    cluster.kill(victim);
    cluster.wait_until_ok();
    assert!(
        !masters(&cluster).iter().any(|m| m.port == victim),
        "the killed master still serves slots"
    );
    wait_for_loads(&seen, 2_000);
    finish("failover", &stop, threads, &seen);
}

/// Every slot of one master moves to another (`redis-cli --cluster reshard`, keys and all)
/// while the workload runs: nothing is ever loaded wrong, and it loads after the move.
#[test]
fn a_resharding_under_load_serves_nothing_wrong() {
    let Some(cluster) = RedisCluster::start(3) else { return };
    let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(Seen::default()));
    let threads = workload(&cluster, "reshard", stop.clone(), seen.clone());
    wait_for_loads(&seen, 2_000);
    let m = masters(&cluster);
    cluster.reshard(&m[0].id, &m[1].id, m[0].slots);
    cluster.wait_until_ok();
    let after = masters(&cluster);
    assert!(!after.iter().any(|n| n.id == m[0].id), "the emptied master still serves slots");
    wait_for_loads(&seen, 2_000);
    finish("reshard", &stop, threads, &seen);
}
