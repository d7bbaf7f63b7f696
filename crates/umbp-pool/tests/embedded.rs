//! The embedded (redb) index: the shared rules, then what only it promises (restart and crash
//! safety).

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use support::suite::{self, key, put, reserve, setup, NODE, TTL};
use umbp_pool::{checksum, EmbeddedIndex, Index, Published, TierId, TierSpec};

fn fresh() -> (tempfile::TempDir, EmbeddedIndex) {
    let dir = tempfile::tempdir().unwrap();
    let index = EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap();
    (dir, index)
}

macro_rules! shared {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            let (_dir, index) = fresh();
            suite::$name(&index);
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

#[test]
fn long_prefixes_follow_every_change() {
    let (_dir, index) = fresh();
    suite::long_prefixes_follow_every_change(&index, &index);
}

#[test]
fn concurrent_churn_serves_nothing_wrong() {
    let (_dir, index) = fresh();
    suite::concurrent_churn_serves_nothing_wrong(Arc::new(index), 2000);
}

#[test]
fn racing_writers_one_winner() {
    let (_dir, index) = fresh();
    suite::racing_writers_one_winner(Arc::new(index));
}

#[test]
fn restart_keeps_durable_published_blocks_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.redb");
    let ssd = TierSpec::new(NODE, TierId(1), 4096, 16).durable();
    let dram = TierSpec::new(NODE, TierId(0), 4096, 16);
    let (kept, gone, gen_before);
    {
        let index = EmbeddedIndex::open(&path).unwrap();
        setup(&index, &ssd);
        setup(&index, &dram);
        kept = put(&index, key(1), &ssd);
        gone = put(&index, key(2), &dram);
        // Reserved, written, never published: the process "dies" here.
        let pending = reserve(&index, key(3), &ssd, 100);
        gen_before = pending.generation;
        assert_eq!(index.durable_blocks().unwrap(), 1);
    }
    let index = EmbeddedIndex::open(&path).unwrap();
    // Tiers are known again without registering; the same shape may be registered again.
    index.register_tier(&ssd).unwrap();
    assert_eq!(index.lookup(&[key(1), key(2), key(3)]).unwrap(), vec![Some(kept), None, None]);
    let _ = gone;
    let stats = index.tier_stats(NODE, TierId(1)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (15, 0, 1));
    assert_eq!(index.tier_stats(NODE, TierId(0)).unwrap().published, 0);
    // Generations keep growing across the restart.
    let r = reserve(&index, key(4), &ssd, 100);
    assert!(r.generation > kept.generation && r.generation > 0, "{r:?} after {gen_before}");
    let lease = index.lease(&[kept], TTL).unwrap();
    assert!(lease.all_granted());
}

#[test]
fn eviction_is_durable_before_the_slot_is_reused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.redb");
    let ssd = TierSpec::new(NODE, TierId(1), 64, 1).durable();
    {
        let index = EmbeddedIndex::open(&path).unwrap();
        setup(&index, &ssd);
        put(&index, key(1), &ssd);
        // The slot is evicted for key 2, whose bytes start to overwrite it; crash before publish.
        let r = reserve(&index, key(2), &ssd, 64);
        assert_eq!(r.slot, 0);
    }
    let index = EmbeddedIndex::open(&path).unwrap();
    // Key 1 must not come back: its slot may hold key 2's partial bytes.
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![None, None]);
    assert_eq!(index.tier_stats(NODE, TierId(1)).unwrap().free, 1);
}

const CHILD_ENV: &str = "UMBP_POOL_CRASH_CHILD";

/// Power loss between write and publish, for real: a child process publishes 100 blocks,
/// reserves 50 more (and "writes" them), then is killed by SIGKILL-like abort with no cleanup.
/// After reopening, exactly the 100 published blocks are there, and every slot of the 50 is
/// free.
#[test]
fn crash_between_reserve_and_publish_leaves_nothing_half_there() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        return crash_child(Path::new(&path));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pool.redb");
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_between_reserve_and_publish_leaves_nothing_half_there",
            "--nocapture",
        ])
        .env(CHILD_ENV, &path)
        .status()
        .unwrap();
    assert!(!status.success(), "the child must die by abort, not exit: {status:?}");
    let index = EmbeddedIndex::open(&path).unwrap();
    let keys: Vec<_> = (0..150).map(key).collect();
    let found = index.lookup(&keys).unwrap();
    for (i, p) in found.iter().enumerate() {
        if i < 100 {
            let p = p.unwrap_or_else(|| panic!("published block {i} lost"));
            assert_eq!(p.checksum, checksum(&keys[i].0));
        } else {
            assert_eq!(*p, None, "block {i} was never published");
        }
    }
    let stats = index.tier_stats(NODE, TierId(1)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (156, 0, 100));
}

fn crash_child(path: &Path) {
    let ssd = TierSpec::new(NODE, TierId(1), 4096, 256).durable();
    let index = EmbeddedIndex::open(path).unwrap();
    setup(&index, &ssd);
    let batch: Vec<_> =
        (0..100).map(|i| (reserve(&index, key(i), &ssd, 100), checksum(&key(i).0))).collect();
    let out = index.publish(&batch).unwrap();
    assert!(out.iter().all(|o| matches!(o, Published::Won(_))));
    for i in 100..150 {
        reserve(&index, key(i), &ssd, 100);
    }
    // No drop, no destructor, no flush: the process ends here.
    std::process::abort();
}

#[test]
fn one_file_one_process() {
    let (dir, _index) = fresh();
    let second = EmbeddedIndex::open(dir.path().join("pool.redb"));
    assert!(second.is_err(), "a second open of a held file must fail, not share it");
}

#[test]
fn nodes_expire() {
    let (_dir, index) = fresh();
    let spec = TierSpec::new(NODE, TierId(0), 64, 1);
    setup(&index, &spec);
    assert_eq!(index.nodes().unwrap().len(), 1);
    index
        .announce(
            &umbp_pool::NodeAnnouncement { node: NODE, address: "x".into(), tiers: vec![] },
            Duration::from_millis(50),
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    assert!(index.nodes().unwrap().is_empty());
}
