//! Figures for the pool's notes: a batched lookup of 62,500 keys (the 999,936-token prefix in
//! 16-token blocks) through Redis on loopback and through the embedded index, and the embedded
//! index's durable publish rate. Starts its own `redis-server` (skipped if it is missing).
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
            let index = umbp_pool::RedisIndex::connect(&server.config("figures")).unwrap();
            index
                .announce(
                    &NodeAnnouncement { node: spec.node, address: "local".into(), tiers: vec![] },
                    TTL,
                )
                .unwrap();
            index.register_tier(&spec).unwrap();
            let fill_s = fill(&index, &spec, 1024);
            println!(
                "redis reserve_many+publish, 1024 blocks per call: {:.0} blocks/s",
                KEYS as f64 / fill_s
            );
            let rtt: Vec<f64> = (0..200)
                .map(|_| {
                    let t = Instant::now();
                    index.lookup(&[key(0)]).unwrap();
                    t.elapsed().as_secs_f64()
                })
                .collect();
            println!("redis lookup of 1 key (the round-trip floor): {}", summary(rtt));
            let admin = redis::Client::open(format!(
                "redis://:{}@127.0.0.1:{}/",
                support::PASSWORD,
                server.port()
            ))
            .unwrap();
            let mut admin = admin.get_connection().unwrap();
            redis::cmd("CONFIG").arg("RESETSTAT").query::<()>(&mut admin).unwrap();
            let rounds = 30;
            println!(
                "redis lookup of {KEYS} keys, one round trip: {}",
                summary(lookups(&index, rounds))
            );
            // The server's own time per lookup (HMGET of every key; the alive-nodes script is
            // separate), from its command statistics.
            let info: String = redis::cmd("INFO").arg("commandstats").query(&mut admin).unwrap();
            let usec = |cmd: &str| -> f64 {
                info.lines()
                    .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))
                    .and_then(|l| l.split(',').find(|f| f.starts_with("usec=")))
                    .and_then(|f| f["usec=".len()..].parse().ok())
                    .unwrap_or(0.0)
            };
            println!(
                "redis server time per {KEYS}-key lookup: HMGET {:.2} ms, alive-nodes script {:.3} ms (mean of {} lookups)",
                usec("hmget") / 1e3 / (rounds + 1) as f64,
                usec("evalsha") / 1e3 / (rounds + 1) as f64,
                rounds + 1
            );
        }
    }
    println!("load after: {}", load());
}
