//! Figures for the pool's notes: a batched lookup of 62,500 keys (the 999,936-token prefix in
//! 16-token blocks) through Redis on loopback and through the embedded index, and the embedded
//! index's durable publish rate. Starts its own `redis-server`s (skipped if it is missing).
//! The Redis lookup runs on the direct path and the redis-rs path in alternating rounds, with
//! the server's HMGET time (its command statistics) and the CPU the server's main thread and
//! this thread spent per lookup; the prefix through group summaries (the asks that build them,
//! what they cost Redis's memory, asks from block 0 and from block 100); then with the keys
//! sharded over 1, 2 and 4 servers, looked up in parallel. `umbp-bench pool` runs these beside Mooncake Store.
//!
//! `cargo run --release -p umbp-pool --example pool_figures`
//!
//! Each figure is the median of its rounds with the 10th-90th percentile range; the machine's
//! load average is printed before and after, as the figures mean little without it.

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use umbp_pool::{
    checksum, BlockKey, EmbeddedIndex, Index, NodeAnnouncement, NodeId, Published, Reserved,
    TierId, TierSpec,
};

const KEYS: u64 = 62_500;
const TTL: Duration = Duration::from_secs(600);

fn key(i: u64) -> BlockKey {
    BlockKey::from_u128(u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

/// Median, 10th and 90th percentile of `samples` (seconds), in milliseconds.
fn summary(mut samples: Vec<f64>) -> String {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] * 1e3;
    format!(
        "median {:.2} ms (p10 {:.2} .. p90 {:.2}, {} rounds)",
        at(0.5),
        at(0.1),
        at(0.9),
        samples.len()
    )
}

/// Saves keys `0..KEYS` into one tier of `index`, `batch` per reserve_many and publish call;
/// the seconds it took.
fn fill(index: &dyn Index, spec: &TierSpec, batch: usize) -> f64 {
    let t = Instant::now();
    let all: Vec<u64> = (0..KEYS).collect();
    for chunk in all.chunks(batch) {
        let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&i| (key(i), 16)).collect();
        let reserved = index.reserve_many(spec.node, spec.tier, &items, TTL).unwrap();
        let publish: Vec<_> = reserved
            .into_iter()
            .map(|r| match r.unwrap() {
                Reserved::Slot(r) => (r, checksum(&r.key.0)),
                other => panic!("fresh pool: {other:?}"),
            })
            .collect();
        let out = index.publish(&publish).unwrap();
        assert!(out.iter().all(|o| matches!(o, Published::Won(_))));
    }
    t.elapsed().as_secs_f64()
}

fn lookups(index: &dyn Index, rounds: usize) -> Vec<f64> {
    let keys: Vec<BlockKey> = (0..KEYS).map(key).collect();
    let _ = index.lookup(&keys).unwrap(); // warm
    (0..rounds)
        .map(|_| {
            let t = Instant::now();
            let found = index.lookup(&keys).unwrap();
            let dt = t.elapsed().as_secs_f64();
            assert!(found.iter().all(Option::is_some));
            dt
        })
        .collect()
}

/// An admin connection to `server`.
fn admin(server: &support::RedisServer) -> redis::Connection {
    redis::Client::open(format!("redis://:{}@127.0.0.1:{}/", server.password(), server.port()))
        .unwrap()
        .get_connection()
        .unwrap()
}

/// The server's total HMGET time so far, in microseconds (its command statistics).
fn hmget_usec(admin: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(admin).unwrap();
    info.lines()
        .find(|l| l.starts_with("cmdstat_hmget:"))
        .and_then(|l| l.split(',').find(|f| f.starts_with("usec=")))
        .and_then(|f| f["usec=".len()..].parse().ok())
        .unwrap_or(0.0)
}

/// The server's main-thread CPU seconds so far (user + system, its `INFO cpu`).
fn server_cpu(admin: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(admin).unwrap();
    info.lines()
        .filter(|l| {
            l.starts_with("used_cpu_user_main_thread:")
                || l.starts_with("used_cpu_sys_main_thread:")
        })
        .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        .sum()
}

/// The server's `used_memory` (its `INFO memory`), in bytes.
fn used_memory(admin: &mut redis::Connection) -> i64 {
    let info: String = redis::cmd("INFO").arg("memory").query(admin).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// This thread's CPU seconds so far (user + system, from /proc; 10 ms ticks).
fn thread_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    f.get(11).zip(f.get(12)).map_or(0.0, |(u, s)| (u + s) / 100.0)
}

fn main() {
    println!("load before: {}", load());
    let spec = TierSpec::new(NodeId(1), TierId(0), 16, KEYS as u32).durable().watermarks(0, 0);

    // Embedded: the durable publish rate at a few batch sizes, then lookups.
    let dir = tempfile::tempdir().unwrap();
    for batch in [1usize, 64, 1024, 4096] {
        let index = EmbeddedIndex::open(dir.path().join(format!("rate-{batch}.redb"))).unwrap();
        index.register_tier(&spec).unwrap();
        let n = if batch == 1 { 2_000 } else { KEYS };
        let t = Instant::now();
        let mut items = Vec::with_capacity(batch);
        let mut publish_time = Duration::ZERO;
        for i in 0..n {
            let Reserved::Slot(r) = index.reserve(key(i), spec.node, spec.tier, 16, TTL).unwrap()
            else {
                panic!()
            };
            items.push((r, i as u32));
            if items.len() == batch || i == n - 1 {
                let tp = Instant::now();
                index.publish(&items).unwrap();
                publish_time += tp.elapsed();
                items.clear();
            }
        }
        let total = t.elapsed().as_secs_f64();
        println!(
            "embedded publish, durable (fsync per call), batch {batch:>4}: {:>9.0} blocks/s publish only, {:>9.0} blocks/s reserve+publish ({n} blocks)",
            n as f64 / publish_time.as_secs_f64(),
            n as f64 / total
        );
    }
    let index = EmbeddedIndex::open(dir.path().join("lookup.redb")).unwrap();
    index.register_tier(&spec).unwrap();
    fill(&index, &spec, 1024);
    println!("embedded lookup of {KEYS} keys: {}", summary(lookups(&index, 50)));
    drop(index);
    let t = Instant::now();
    let index = EmbeddedIndex::open(dir.path().join("lookup.redb")).unwrap();
    println!(
        "embedded reopen with {KEYS} durable blocks: {:.1} ms (first lookup hits: {})",
        t.elapsed().as_secs_f64() * 1e3,
        index.lookup(&[key(0)]).unwrap()[0].is_some()
    );

    // Redis on loopback.
    match support::RedisServer::start() {
        None => println!("redis: skipped (no redis-server)"),
        Some(server) => {
            // The entry path's figures come from clients without group summaries; the
            // summaries' own come after.
            let entries_only = |direct: bool| {
                let mut config = support::config(&server, "figures");
                config.direct_lookup = direct;
                config.group_summaries = false;
                umbp_pool::RedisIndex::connect(&config).unwrap()
            };
            let index = entries_only(true);
            index
                .announce(
                    &NodeAnnouncement { node: spec.node, address: "local".into(), tiers: vec![] },
                    TTL,
                )
                .unwrap();
            index.register_tier(&spec).unwrap();
            let empty = used_memory(&mut admin(&server));
            let fill_s = fill(&index, &spec, 1024);
            println!(
                "redis reserve_many+publish, 1024 blocks per call: {:.0} blocks/s; the index's memory {:.0} bytes per block",
                KEYS as f64 / fill_s,
                (used_memory(&mut admin(&server)) - empty) as f64 / KEYS as f64
            );
            let rtt: Vec<f64> = (0..200)
                .map(|_| {
                    let t = Instant::now();
                    index.lookup(&[key(0)]).unwrap();
                    t.elapsed().as_secs_f64()
                })
                .collect();
            println!("redis lookup of 1 key (the round-trip floor): {}", summary(rtt));
            let mut admin = admin(&server);
            // The direct path (the default) and the redis-rs path, alternating lookup by
            // lookup; the server's HMGET time of each lookup from its command statistics.
            let values = entries_only(false);
            let keys: Vec<BlockKey> = (0..KEYS).map(key).collect();
            let _ = values.lookup(&keys).unwrap();
            let _ = index.lookup(&keys).unwrap();
            let (mut direct_t, mut values_t, mut direct_s, mut values_s) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            // CPU seconds over all rounds: [server main thread, this thread] per path.
            let mut cpu = [[0.0f64; 2]; 2];
            for _ in 0..20 {
                for (path, (which, t, s)) in [
                    (&index, &mut direct_t, &mut direct_s),
                    (&values, &mut values_t, &mut values_s),
                ]
                .into_iter()
                .enumerate()
                {
                    let before = hmget_usec(&mut admin);
                    let server_before = server_cpu(&mut admin);
                    let client_before = thread_cpu();
                    let start = Instant::now();
                    let found = which.lookup(&keys).unwrap();
                    t.push(start.elapsed().as_secs_f64());
                    cpu[path][1] += thread_cpu() - client_before;
                    cpu[path][0] += server_cpu(&mut admin) - server_before;
                    s.push((hmget_usec(&mut admin) - before) / 1e6);
                    assert!(found.iter().all(Option::is_some));
                }
            }
            println!("redis lookup of {KEYS} keys, direct path:   {}", summary(direct_t));
            println!("  of which the server's HMGET time:        {}", summary(direct_s));
            println!("redis lookup of {KEYS} keys, redis-rs path: {}", summary(values_t));
            println!("  of which the server's HMGET time:        {}", summary(values_s));
            for (path, [server, client]) in ["direct", "redis-rs"].iter().zip(cpu) {
                println!(
                    "  CPU per lookup, {path} path: server main thread {:.1} ms (HMGET and the rest: reading, parsing, writing), client thread {:.1} ms",
                    server / 20.0 * 1e3,
                    client / 20.0 * 1e3
                );
            }

            // Lookups through group summaries: the first ones build them (a budget of keys
            // per lookup, each group the second time it is found whole), then prefixes and
            // lookups from block 0 and from block 100 (a server holding the first 100 in HBM
            // asks from there) read them; what they cost Redis's memory.
            let index =
                umbp_pool::RedisIndex::connect(&support::config(&server, "figures")).unwrap();
            let memory_before = used_memory(&mut admin);
            let mut first = Vec::new();
            let mut summaries = 0;
            loop {
                let t = Instant::now();
                assert!(index.lookup(&keys).unwrap().iter().all(Option::is_some));
                first.push(t.elapsed().as_secs_f64());
                let now: usize =
                    redis::cmd("HLEN").arg("{figures}:groups").query(&mut admin).unwrap();
                if now == summaries && first.len() > 2 {
                    break;
                }
                summaries = now;
            }
            let grown = used_memory(&mut admin) - memory_before;
            println!(
                "redis lookup of {KEYS} keys, first {} lookups (summarizing): {}",
                first.len(),
                summary(first)
            );
            println!(
                "  {summaries} group summaries; Redis's used memory grew {:.1} MB ({:.0} bytes per block)",
                grown as f64 / 1e6,
                grown as f64 / KEYS as f64
            );
            for from in [0, 100] {
                let asked = &keys[from..];
                let (mut prefix, mut lookup) = (Vec::new(), Vec::new());
                for _ in 0..20 {
                    let t = Instant::now();
                    assert_eq!(index.prefix_hits(asked).unwrap(), asked.len());
                    prefix.push(t.elapsed().as_secs_f64());
                    let t = Instant::now();
                    assert!(index.lookup(asked).unwrap().iter().all(Option::is_some));
                    lookup.push(t.elapsed().as_secs_f64());
                }
                let n = asked.len();
                println!("redis prefix of {n} keys from block {from}: {}", summary(prefix));
                println!("redis lookup of {n} keys from block {from}: {}", summary(lookup));
            }
        }
    }

    // The keys sharded over 1, 2 and 4 servers (by the key's first byte), one lookup per
    // server in parallel threads: the wall time of the whole lookup.
    if umbp_pool::redis_server::available() {
        for shards in [1usize, 2, 4] {
            let servers: Vec<_> =
                (0..shards).map(|_| support::RedisServer::start().unwrap()).collect();
            let indexes: Vec<_> = servers
                .iter()
                .map(|s| {
                    let mut config = support::config(s, "figures");
                    config.group_summaries = false;
                    let index = umbp_pool::RedisIndex::connect(&config).unwrap();
                    index
                        .announce(
                            &NodeAnnouncement {
                                node: spec.node,
                                address: "local".into(),
                                tiers: vec![],
                            },
                            TTL,
                        )
                        .unwrap();
                    index.register_tier(&spec).unwrap();
                    index
                })
                .collect();
            let shard_of = |k: &BlockKey| usize::from(k.0[0]) % shards;
            let mut parts: Vec<Vec<BlockKey>> = vec![Vec::new(); shards];
            for k in (0..KEYS).map(key) {
                parts[shard_of(&k)].push(k);
            }
            for (index, part) in indexes.iter().zip(&parts) {
                for chunk in part.chunks(1024) {
                    let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&k| (k, 16)).collect();
                    let reserved = index.reserve_many(spec.node, spec.tier, &items, TTL).unwrap();
                    let publish: Vec<_> = reserved
                        .into_iter()
                        .map(|r| match r.unwrap() {
                            Reserved::Slot(r) => (r, 0),
                            other => panic!("fresh pool: {other:?}"),
                        })
                        .collect();
                    index.publish(&publish).unwrap();
                }
            }
            let samples: Vec<f64> = (0..21)
                .map(|_| {
                    let t = Instant::now();
                    std::thread::scope(|scope| {
                        let handles: Vec<_> = indexes
                            .iter()
                            .zip(&parts)
                            .map(|(index, part)| scope.spawn(move || index.lookup(part).unwrap()))
                            .collect();
                        for h in handles {
                            assert!(h.join().unwrap().iter().all(Option::is_some));
                        }
                    });
                    t.elapsed().as_secs_f64()
                })
                .collect();
            println!(
                "redis lookup of {KEYS} keys sharded over {shards} server(s), in parallel: {}",
                summary(samples[1..].to_vec())
            );
        }
    }
    println!("load after: {}", load());
}
