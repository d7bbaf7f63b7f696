//! The rules every [`Index`] backend keeps, as functions over a fresh index; `tests/embedded.rs`
//! and `tests/redis.rs` run each against their backend.

use std::collections::HashSet;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use umbp_pool::{
    checksum, BlockKey, Error, Index, NodeAnnouncement, NodeId, Placement, Published, Removed,
    Reservation, Reserved, TierId, TierSpec,
};

pub const NODE: NodeId = NodeId(1);
pub const TTL: Duration = Duration::from_secs(60);

/// Registers `spec` and announces its node (for a minute).
pub fn setup(index: &dyn Index, spec: &TierSpec) {
    index
        .announce(
            &NodeAnnouncement {
                node: spec.node,
                address: format!("127.0.0.1:{}", 7000 + spec.node.0),
                tiers: vec![(spec.tier, spec.slot_size * u64::from(spec.slot_count))],
            },
            TTL,
        )
        .unwrap();
    index.register_tier(spec).unwrap();
}

pub fn key(i: u64) -> BlockKey {
    // Spread the bits so keys are not small integers only.
    BlockKey::from_u128(
        u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) ^ 0xabcd,
    )
}

pub fn reserve(index: &dyn Index, k: BlockKey, spec: &TierSpec, len: u64) -> Reservation {
    match index.reserve(k, spec.node, spec.tier, len, TTL).unwrap() {
        Reserved::Slot(r) => r,
        Reserved::Present(p) => panic!("{k} unexpectedly present at {p:?}"),
    }
}

/// Reserves, "writes" and publishes `k` with a checksum of a pattern; its placement.
pub fn put(index: &dyn Index, k: BlockKey, spec: &TierSpec) -> Placement {
    let r = reserve(index, k, spec, spec.slot_size.min(100));
    match index.publish(&[(r, checksum(&k.0))]).unwrap()[..] {
        [Published::Won(p)] => p,
        ref other => panic!("publish of {k}: {other:?}"),
    }
}

pub fn visible_only_after_publish(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 4096, 8);
    setup(index, &spec);
    let k = key(1);
    let r = reserve(index, k, &spec, 1000);
    assert_eq!(r.len, 1000);
    assert!(r.slot < 8);
    assert_eq!(index.lookup(&[k]).unwrap(), vec![None], "visible before publish");
    assert_eq!(index.prefix_hits(&[k]).unwrap(), 0);
    assert_eq!(index.tier_stats(NODE, TierId(0)).unwrap().reserved, 1);
    let crc = checksum(b"the bytes");
    let out = index.publish(&[(r, crc)]).unwrap();
    let p = r.placement(crc);
    assert_eq!(out, vec![Published::Won(p)]);
    assert_eq!(index.lookup(&[k, key(2)]).unwrap(), vec![Some(p), None]);
    assert_eq!(index.prefix_hits(&[k, key(2), k]).unwrap(), 1);
    // A second writer finds it present: nothing to write.
    assert_eq!(index.reserve(k, NODE, TierId(0), 1000, TTL).unwrap(), Reserved::Present(p));
    // Publishing the same reservation again is refused: it is no longer a reservation.
    assert_eq!(index.publish(&[(r, crc)]).unwrap(), vec![Published::Expired]);
    let stats = index.tier_stats(NODE, TierId(0)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (7, 0, 1));
}

pub fn caller_mistakes_are_typed(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 4096, 8);
    setup(index, &spec);
    assert!(matches!(
        index.reserve(key(1), NODE, TierId(9), 10, TTL),
        Err(Error::UnknownTier { tier: TierId(9), .. })
    ));
    assert!(matches!(
        index.reserve(key(1), NODE, TierId(0), 4097, TTL),
        Err(Error::TooLarge { len: 4097, slot_size: 4096, .. })
    ));
    let other = TierSpec::new(NODE, TierId(0), 8192, 8);
    assert!(matches!(index.register_tier(&other), Err(Error::TierConflict { .. })));
    // The same shape again is fine (a restart registers again).
    index.register_tier(&spec).unwrap();
    assert!(matches!(index.tier_stats(NODE, TierId(5)), Err(Error::UnknownTier { .. })));
}

pub fn abort_frees_and_full_is_typed(index: &dyn Index) {
    // Two slots, eviction only when nothing is free (and nothing published to evict).
    let spec = TierSpec::new(NODE, TierId(0), 64, 2);
    setup(index, &spec);
    let a = reserve(index, key(1), &spec, 64);
    let b = reserve(index, key(2), &spec, 64);
    assert_ne!(a.slot, b.slot);
    assert!(matches!(index.reserve(key(3), NODE, TierId(0), 64, TTL), Err(Error::TierFull { .. })));
    index.abort(&[a]).unwrap();
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![None]);
    // Aborting twice, or publishing an aborted reservation, does nothing.
    index.abort(&[a]).unwrap();
    assert_eq!(index.publish(&[(a, 1)]).unwrap(), vec![Published::Expired]);
    let c = reserve(index, key(3), &spec, 64);
    assert_eq!(c.slot, a.slot, "the aborted slot is the free one");
    assert!(c.generation > a.generation, "a reused slot has a new generation");
    assert_eq!(index.lookup(&[key(1), key(3)]).unwrap(), vec![None, None]);
    index.abort(&[b, c]).unwrap();
    assert_eq!(index.tier_stats(NODE, TierId(0)).unwrap().free, 2);
}

pub fn expired_reservation_publishes_nothing(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 1);
    setup(index, &spec);
    let r = match index.reserve(key(1), NODE, TierId(0), 10, Duration::from_millis(100)).unwrap() {
        Reserved::Slot(r) => r,
        other => panic!("{other:?}"),
    };
    std::thread::sleep(Duration::from_millis(300));
    // The slot is free again: another key can have it.
    let other = reserve(index, key(2), &spec, 10);
    assert_eq!(other.slot, r.slot);
    assert_eq!(index.publish(&[(r, 7)]).unwrap(), vec![Published::Expired]);
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![None]);
    index.publish(&[(other, 8)]).unwrap();
    assert_eq!(index.lookup(&[key(2)]).unwrap()[0].unwrap().checksum, 8);
}

/// 16 threads write one key at once: exactly one publish wins, every other writer either finds
/// it present at reserve or loses the publish, and no slot leaks.
pub fn racing_writers_one_winner(index: Arc<dyn Index>) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 32).watermarks(0, 0);
    setup(&*index, &spec);
    for round in 0..4u64 {
        let k = key(1000 + round);
        let barrier = Arc::new(Barrier::new(16));
        let outcomes: Vec<(Option<Published>, Option<Placement>)> = (0..16u32)
            .map(|t| {
                let (index, barrier) = (index.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    match index.reserve(k, NODE, TierId(0), 64, TTL).unwrap() {
                        Reserved::Present(p) => (None, Some(p)),
                        Reserved::Slot(r) => {
                            let out = index.publish(&[(r, t)]).unwrap();
                            (Some(out[0]), None)
                        }
                    }
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        let winners: Vec<Placement> = outcomes
            .iter()
            .filter_map(|(o, _)| match o {
                Some(Published::Won(p)) => Some(*p),
                _ => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {outcomes:?}");
        let w = winners[0];
        for (o, present) in &outcomes {
            match (o, present) {
                (Some(Published::Won(_)), _) => {}
                (Some(Published::Lost { winner }), _) => assert_eq!(*winner, w),
                (None, Some(p)) => assert_eq!(*p, w),
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(index.lookup(&[k]).unwrap(), vec![Some(w)]);
        let stats = index.tier_stats(NODE, TierId(0)).unwrap();
        assert_eq!(stats.reserved, 0, "round {round}: a loser's slot leaked");
        assert_eq!(stats.published, round as u32 + 1);
        assert_eq!(stats.free, 32 - (round as u32 + 1));
    }
}

/// Leased blocks are never evicted; unleased ones are, least recently used first; when every
/// slot is leased the tier is full; once the leases expire, eviction proceeds.
pub fn leases_block_eviction_and_expire(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 4).watermarks(1, 1);
    setup(index, &spec);
    let ps: Vec<Placement> = (0..4).map(|i| put(index, key(i), &spec)).collect();
    let lease = index.lease(&ps[..3], TTL).unwrap();
    assert_eq!(lease.granted, vec![true, true, true]);
    // Only key 3 is unleased: the next reserve must evict exactly it.
    let r = reserve(index, key(10), &spec, 64);
    assert_eq!(r.slot, ps[3].slot);
    assert!(r.generation > ps[3].generation);
    assert_eq!(
        index.lookup(&[key(0), key(1), key(2), key(3)]).unwrap(),
        vec![Some(ps[0]), Some(ps[1]), Some(ps[2]), None]
    );
    // Every slot is leased or reserved: nothing to evict.
    assert!(matches!(
        index.reserve(key(11), NODE, TierId(0), 64, TTL),
        Err(Error::TierFull { .. })
    ));
    assert_eq!(index.evict(NODE, TierId(0), 4).unwrap(), 0);
    assert_eq!(index.remove(&[key(0)]).unwrap(), vec![Removed::Leased]);
    index.abort(&[r]).unwrap();
    // The holder renews once, for a short time, then stops: after that the leases are gone by
    // themselves.
    index.renew(lease.id, Duration::from_millis(200)).unwrap();
    std::thread::sleep(Duration::from_millis(600));
    assert!(matches!(index.renew(lease.id, TTL), Err(Error::LeaseExpired(id)) if id == lease.id));
    assert_eq!(index.evict(NODE, TierId(0), 2).unwrap(), 2);
    assert_eq!(
        index
            .remove(&[key(0), key(1), key(2)])
            .unwrap()
            .iter()
            .filter(|r| **r == Removed::Removed)
            .count(),
        1
    );
    assert_eq!(index.tier_stats(NODE, TierId(0)).unwrap().free, 4);
}

/// Release ends a lease at once; a granted lease counts as a use, so the least recently used
/// unleased block goes first.
pub fn release_and_recency(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 3).watermarks(1, 1);
    setup(index, &spec);
    let ps: Vec<Placement> = (0..3).map(|i| put(index, key(i), &spec)).collect();
    let lease = index.lease(&ps, TTL).unwrap();
    assert!(lease.all_granted());
    assert_eq!(index.remove(&[key(2)]).unwrap(), vec![Removed::Leased]);
    index.release(lease.id).unwrap();
    index.release(lease.id).unwrap(); // idempotent
                                      // Use key 0 and key 2 again; key 1 is the least recently used.
    std::thread::sleep(Duration::from_millis(5));
    let l2 = index.lease(&[ps[0], ps[2]], TTL).unwrap();
    index.release(l2.id).unwrap();
    assert_eq!(index.evict(NODE, TierId(0), 1).unwrap(), 1);
    let found = index.lookup(&[key(0), key(1), key(2)]).unwrap();
    assert_eq!(found.iter().filter(|p| p.is_some()).count(), 2);
    assert_eq!(found[1], None, "key 1 was the least recently used: {found:?}");
    assert_eq!(
        index.remove(&[key(2), key(2), key(9)]).unwrap(),
        vec![Removed::Removed, Removed::Absent, Removed::Absent]
    );
    assert_eq!(index.lookup(&[key(2)]).unwrap(), vec![None]);
}

/// A placement from before its slot was reused is a miss: its lease is not granted.
pub fn stale_generation_is_a_miss(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 1);
    setup(index, &spec);
    let old = put(index, key(1), &spec);
    // A reader looked it up; before it takes its lease, the slot is evicted and reused.
    let seen = index.lookup(&[key(1)]).unwrap()[0].unwrap();
    assert_eq!(index.evict(NODE, TierId(0), 1).unwrap(), 1);
    let new = put(index, key(2), &spec);
    assert_eq!(new.slot, old.slot);
    assert!(new.generation > old.generation);
    let lease = index.lease(&[seen, new], TTL).unwrap();
    assert_eq!(lease.granted, vec![false, true], "a stale placement must be a miss");
    // Same slot and key but a forged generation: a miss too.
    let forged = Placement { generation: old.generation, ..new };
    assert_eq!(index.lease(&[forged], TTL).unwrap().granted, vec![false]);
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![None, Some(new)]);
}

/// One batched lookup of 62,500 keys (a 999,936-token prefix in 16-token blocks), every other
/// one published: each answer is the right placement or a miss.
pub fn batched_lookup_of_62500_keys(index: &dyn Index) {
    const N: u64 = 62_500;
    let spec = TierSpec::new(NODE, TierId(0), 16, N as u32 / 2).watermarks(0, 0);
    setup(index, &spec);
    let mut published = Vec::new();
    let evens: Vec<u64> = (0..N).step_by(2).collect();
    for chunk in evens.chunks(1000) {
        let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&i| (key(i), 16)).collect();
        let batch: Vec<(Reservation, u32)> = index
            .reserve_many(NODE, TierId(0), &items, TTL)
            .unwrap()
            .into_iter()
            .zip(chunk)
            .map(|(r, &i)| match r.unwrap() {
                Reserved::Slot(r) => (r, i as u32),
                other => panic!("{other:?}"),
            })
            .collect();
        published.extend(index.publish(&batch).unwrap());
    }
    assert!(published.iter().all(|p| matches!(p, Published::Won(_))));
    let keys: Vec<BlockKey> = (0..N).map(key).collect();
    let found = index.lookup(&keys).unwrap();
    assert_eq!(found.len(), N as usize);
    let mut slots = HashSet::new();
    for (i, p) in found.iter().enumerate() {
        if i % 2 == 1 {
            assert_eq!(*p, None, "key {i}");
            continue;
        }
        let p = p.unwrap_or_else(|| panic!("key {i} missing"));
        assert_eq!(p.key, keys[i]);
        assert_eq!(p.checksum, i as u32);
        assert!(slots.insert(p.slot), "slot {} given twice", p.slot);
    }
    let evens: Vec<BlockKey> = (0..N).step_by(2).map(key).collect();
    assert_eq!(index.prefix_hits(&evens).unwrap(), evens.len());
    assert_eq!(index.prefix_hits(&keys).unwrap(), 1);
}

/// A batched reserve answers per item, as single reserves would, in one call.
pub fn reserve_many_answers_per_item(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 4).watermarks(0, 0);
    setup(index, &spec);
    let present = put(index, key(1), &spec);
    // Leased, so the last item finds the tier full rather than evicting it.
    let lease = index.lease(&[present], TTL).unwrap();
    assert!(lease.all_granted());
    let items =
        [(key(2), 64), (key(1), 64), (key(3), 65), (key(4), 10), (key(5), 10), (key(6), 10)];
    let out = index.reserve_many(NODE, TierId(0), &items, TTL).unwrap();
    assert_eq!(out.len(), items.len());
    let slots: Vec<Reservation> = out
        .iter()
        .filter_map(|r| match r {
            Ok(Reserved::Slot(r)) => Some(*r),
            _ => None,
        })
        .collect();
    assert_eq!(slots.iter().map(|r| r.key).collect::<Vec<_>>(), vec![key(2), key(4), key(5)]);
    assert!(matches!(out[1], Ok(Reserved::Present(p)) if p == present));
    assert!(matches!(out[2], Err(Error::TooLarge { len: 65, .. })));
    assert!(matches!(out[5], Err(Error::TierFull { .. })), "{:?}", out[5]);
    let set: HashSet<u32> = slots.iter().map(|r| r.slot).chain([present.slot]).collect();
    assert_eq!(set.len(), 4, "every slot handed out once");
    assert_eq!(index.lookup(&[key(2)]).unwrap(), vec![None]);
    let published = index.publish(&slots.iter().map(|r| (*r, 5)).collect::<Vec<_>>()).unwrap();
    assert!(published.iter().all(|p| matches!(p, Published::Won(_))));
    assert_eq!(index.prefix_hits(&[key(1), key(2), key(4), key(5), key(3)]).unwrap(), 4);
    let unknown = index.reserve_many(NODE, TierId(7), &[(key(9), 1)], TTL).unwrap();
    assert!(matches!(unknown[0], Err(Error::UnknownTier { .. })));
    assert!(index.reserve_many(NODE, TierId(0), &[], TTL).unwrap().is_empty());
}

/// A slot stays leased until the last lease on it ends, however many leases (or times in
/// one lease) name it.
pub fn a_slot_stays_leased_until_its_last_lease_ends(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 2).watermarks(1, 1);
    setup(index, &spec);
    let first = put(index, key(1), &spec);
    std::thread::sleep(Duration::from_millis(5));
    let second = put(index, key(2), &spec);
    let a = index.lease(&[first], TTL).unwrap();
    let b = index.lease(&[first, second, first], TTL).unwrap();
    assert_eq!(b.granted, vec![true, true, true]);
    index.release(b.id).unwrap();
    // Key 1, the least recently used, is still under lease a: key 2 makes room.
    let r = reserve(index, key(3), &spec, 8);
    assert_eq!(r.slot, second.slot);
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![Some(first), None]);
    index.abort(&[r]).unwrap();
    assert_eq!(index.remove(&[key(1)]).unwrap(), vec![Removed::Leased]);
    index.release(a.id).unwrap();
    assert_eq!(index.remove(&[key(1)]).unwrap(), vec![Removed::Removed]);
}

/// A batch decides its items in order, as calls one by one would: a key reserved twice gets
/// two slots, and of its two publishes in one call the first wins and the second loses to it
/// (its slot free again); a reservation named twice in one publish is ended by the first; a
/// reserve that evicts to make room never evicts a block the same batch answers present; the
/// items it refuses take no free slot; and reservations past their deadline come back to a
/// batch however many there are.
pub fn batches_decide_item_by_item(index: &dyn Index) {
    let spec = TierSpec::new(NODE, TierId(0), 64, 4).watermarks(1, 1);
    setup(index, &spec);
    let out = index.reserve_many(NODE, TierId(0), &[(key(1), 8), (key(1), 8)], TTL).unwrap();
    let [Ok(Reserved::Slot(a)), Ok(Reserved::Slot(b))] = out[..] else { panic!("{out:?}") };
    assert_ne!(a.slot, b.slot);
    let won = a.placement(1);
    assert_eq!(
        index.publish(&[(a, 1), (b, 2), (b, 2)]).unwrap(),
        vec![Published::Won(won), Published::Lost { winner: won }, Published::Expired]
    );
    let stats = index.tier_stats(NODE, TierId(0)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (3, 0, 1));
    // Fill the tier; key 1, published first, is the least recently used.
    let mut next = None;
    for i in 2..5 {
        std::thread::sleep(Duration::from_millis(5));
        let p = put(index, key(i), &spec);
        next.get_or_insert(p);
    }
    let out = index.reserve_many(NODE, TierId(0), &[(key(1), 8), (key(5), 8)], TTL).unwrap();
    assert!(matches!(out[0], Ok(Reserved::Present(p)) if p == won), "{out:?}");
    let Ok(Reserved::Slot(c)) = out[1] else { panic!("{out:?}") };
    assert_eq!(c.slot, next.unwrap().slot, "the next least recently used block made room");
    assert_eq!(index.lookup(&[key(1), key(2)]).unwrap(), vec![Some(won), None]);
    index.abort(&[c]).unwrap();

    // A used tier, its slots on the free list: the items refused take none of them.
    let used = TierSpec::new(NODE, TierId(2), 64, 4).watermarks(0, 0);
    index.register_tier(&used).unwrap();
    let keys: Vec<BlockKey> = (10..14).map(key).collect();
    for &k in &keys {
        put(index, k, &used);
    }
    assert!(index.remove(&keys).unwrap().iter().all(|r| *r == Removed::Removed));
    let items = [(key(20), 64), (key(21), 65), (key(22), 8), (key(23), 65)];
    let out = index.reserve_many(NODE, TierId(2), &items, TTL).unwrap();
    let refused = out.iter().filter(|r| matches!(r, Err(Error::TooLarge { .. }))).count();
    assert_eq!(refused, 2, "{out:?}");
    let stats = index.tier_stats(NODE, TierId(2)).unwrap();
    assert_eq!((stats.free, stats.reserved, stats.published), (2, 2, 0), "{out:?}");

    let big = TierSpec::new(NODE, TierId(1), 64, 300).watermarks(0, 0);
    index.register_tier(&big).unwrap();
    let items = |from: u64| (from..from + 300).map(|i| (key(i), 8)).collect::<Vec<_>>();
    let short = index.reserve_many(NODE, TierId(1), &items(100), Duration::from_millis(50));
    assert!(short.unwrap().iter().all(|r| matches!(r, Ok(Reserved::Slot(_)))));
    std::thread::sleep(Duration::from_millis(200));
    let again = index.reserve_many(NODE, TierId(1), &items(400), TTL).unwrap();
    let refused: Vec<_> = again.iter().filter(|r| !matches!(r, Ok(Reserved::Slot(_)))).collect();
    assert!(refused.is_empty(), "{} of 300 refused: {:?}", refused.len(), refused.first());
}

/// Many threads save, load, abort and evict over a small tier at once, with the slots' "bytes"
/// modelled by an arena of words a writer fills between reserve and publish. Whatever the
/// interleaving, a load under a granted lease finds exactly its key's bytes (nothing wrong is
/// ever served), and at the end no slot is lost or handed out twice.
pub fn concurrent_churn_serves_nothing_wrong(index: Arc<dyn Index>, ops_per_thread: u32) {
    use std::sync::atomic::{AtomicU64, Ordering};
    const SLOTS: u32 = 32;
    const KEYS: u64 = 96;
    let spec = TierSpec::new(NODE, TierId(0), 64, SLOTS).watermarks(2, 6);
    setup(&*index, &spec);
    // What each slot "holds": the id + 1 of the key last written there (0: nothing).
    let arena: Arc<Vec<AtomicU64>> = Arc::new((0..SLOTS).map(|_| AtomicU64::new(0)).collect());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (index, arena) = (index.clone(), arena.clone());
            std::thread::spawn(move || {
                let mut rng =
                    0x9e37_79b9_7f4a_7c15u64 ^ (t + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let (mut hits, mut saves) = (0u32, 0u32);
                for _ in 0..ops_per_thread {
                    let id = next() % KEYS;
                    let k = key(id);
                    let found = index.lookup(&[k]).unwrap()[0];
                    if let Some(p) = found {
                        let lease = index.lease(&[p], TTL).unwrap();
                        if lease.granted[0] {
                            let held = arena[p.slot as usize].load(Ordering::SeqCst);
                            assert_eq!(
                                held,
                                id + 1,
                                "slot {} served another block's bytes",
                                p.slot
                            );
                            hits += 1;
                        }
                        index.release(lease.id).unwrap();
                        continue;
                    }
                    let r = match index.reserve(k, NODE, TierId(0), 64, TTL) {
                        Ok(Reserved::Slot(r)) => r,
                        Ok(Reserved::Present(_)) | Err(Error::TierFull { .. }) => continue,
                        Err(e) => panic!("{e}"),
                    };
                    // Write the bytes; one write in eight is torn and aborted.
                    if next() % 8 == 0 {
                        arena[r.slot as usize].store(u64::MAX, Ordering::SeqCst);
                        index.abort(&[r]).unwrap();
                        continue;
                    }
                    arena[r.slot as usize].store(id + 1, Ordering::SeqCst);
                    if let Published::Won(_) = index.publish(&[(r, id as u32)]).unwrap()[0] {
                        saves += 1;
                    }
                    if next() % 16 == 0 {
                        index.evict(NODE, TierId(0), 2).unwrap();
                    }
                }
                (hits, saves)
            })
        })
        .collect();
    let (mut hits, mut saves) = (0, 0);
    for t in threads {
        let (h, s) = t.join().unwrap();
        hits += h;
        saves += s;
    }
    assert!(hits > 0 && saves > 0, "the churn exercised nothing: {hits} hits, {saves} saves");
    let stats = index.tier_stats(NODE, TierId(0)).unwrap();
    assert_eq!(stats.reserved, 0);
    assert_eq!(stats.free + stats.published, SLOTS, "{stats:?}");
    let all: Vec<BlockKey> = (0..KEYS).map(key).collect();
    let found: Vec<Placement> = index.lookup(&all).unwrap().into_iter().flatten().collect();
    assert_eq!(found.len() as u32, stats.published);
    let slots: HashSet<u32> = found.iter().map(|p| p.slot).collect();
    assert_eq!(slots.len(), found.len(), "a slot holds two published keys");
    for p in &found {
        let id = all.iter().position(|k| *k == p.key).unwrap() as u64;
        assert_eq!(arena[p.slot as usize].load(Ordering::SeqCst), id + 1);
    }
}

/// Stores every key of `keys` not stored yet (reserve, then publish), 1,000 per call.
pub fn store_all(index: &dyn Index, spec: &TierSpec, keys: &[BlockKey]) {
    for chunk in keys.chunks(1000) {
        let items: Vec<(BlockKey, u64)> = chunk.iter().map(|&k| (k, 16)).collect();
        let batch: Vec<(Reservation, u32)> = index
            .reserve_many(spec.node, spec.tier, &items, TTL)
            .unwrap()
            .into_iter()
            .filter_map(|r| match r.unwrap() {
                Reserved::Slot(r) => Some((r, checksum(&r.key.0))),
                Reserved::Present(_) => None,
            })
            .collect();
        let out = index.publish(&batch).unwrap();
        assert!(out.iter().all(|p| matches!(p, Published::Won(_))), "{out:?}");
    }
}

/// How many of `keys`, from the first, `lookup` finds: what `prefix_hits` must answer.
pub fn looked_up_prefix(index: &dyn Index, keys: &[BlockKey]) -> usize {
    index.lookup(keys).unwrap().iter().take_while(|p| p.is_some()).count()
}

/// Long lists of keys (groups of about 256 and partial ones; two prefixes that share 300 keys
/// and then part; the same keys from one to five blocks further on, so a key stands in more
/// groups than one key's record of them holds) answer `lookup` and `prefix_hits` exactly as
/// `truth` (a client reading every entry; the index itself where it has no summaries)
/// answers, asked three times after every change (the first asks may build summaries, the
/// last are read from them): removals, evictions, keys stored again.
pub fn long_prefixes_follow_every_change(index: &dyn Index, truth: &dyn Index) {
    const N: u64 = 1300;
    let spec = TierSpec::new(NODE, TierId(0), 16, 4000).watermarks(0, 0);
    setup(index, &spec);
    let a: Vec<BlockKey> = (0..N).map(key).collect();
    let b: Vec<BlockKey> = a[..300].iter().copied().chain((5000..6000).map(key)).collect();
    let mut prefixes = vec![a.clone(), b.clone()];
    prefixes.extend((1..=5).map(|shift| a[shift..].to_vec()));
    store_all(index, &spec, &a);
    store_all(index, &spec, &b);
    let check = |step: &str| {
        for (i, p) in prefixes.iter().enumerate() {
            let want = truth.lookup(p).unwrap();
            let hits = want.iter().take_while(|p| p.is_some()).count();
            for ask in 1..=3 {
                let got = index.lookup(p).unwrap();
                if let Some(k) = (0..got.len()).find(|&k| got[k] != want[k]) {
                    panic!(
                        "{step}: prefix {i}, lookup {ask}, key {k}: {:?} where {:?}",
                        got[k], want[k]
                    );
                }
                let got = index.prefix_hits(p).unwrap();
                assert_eq!(got, hits, "{step}: prefix {i}, prefix_hits {ask}");
            }
        }
    };
    check("all stored");
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for step in 0..30 {
        let what = match next() % 4 {
            0 | 1 => {
                // Most removals fall late in a prefix, so summaries before them stay useful.
                let from = if next() % 2 == 0 { &a } else { &b };
                let at = from.len() - 1 - (next() % 700) as usize;
                index.remove(&[from[at]]).unwrap();
                format!("step {step}: removed key {at} of {}", if from == &a { "a" } else { "b" })
            }
            2 => {
                let evicted = index.evict(NODE, TierId(0), 3).unwrap();
                format!("step {step}: evicted {evicted}")
            }
            _ => {
                store_all(index, &spec, &a);
                store_all(index, &spec, &b);
                format!("step {step}: stored everything again")
            }
        };
        check(&what);
    }
}
