//! `Pool`, the data path over an index and a composite: round trips on the embedded index and
//! on a real redis-server, 16 threads on one pool with every loaded byte compared, a slot
//! reused between lookup and lease, a clobbered slot, failed and refused transfers, a dead
//! peer reached through a resolver, a get that outlives its lease TTL, the announcer.

mod support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use umbp_composite::{
    offload, ChecksumPolicy, CompositeConfig, CompositeEngine, ObjectRange, ObjectTransfer,
};
use umbp_localcopy::LocalCopyEngine;
use umbp_plan::{
    BatchState, Endpoint, EndpointId, EndpointRegistry, FailureCause, Fragment, PlanBuilder,
    PlanSet, Register, Registration, TransferEngine, TransferHandle,
};
use umbp_pool::{
    BlockError, BlockKey, EmbeddedIndex, GetBlock, GetOutcome, Index, Lease, NodeAnnouncement,
    NodeId, Placement, Pool, PoolConfig, Published, PutBlock, PutOutcome, Removed, Reservation,
    Reserved, TierId, TierRegion, TierResolver, TierSpec, TierStats,
};

use support::RedisServer;

const SLOT: u64 = 16 << 10;
const NODE: NodeId = NodeId(3);
const DRAM: TierId = TierId(0);

/// The host copy engine, failing (or delaying) on demand: every plan touching an endpoint in
/// `fail` fails with an I/O error, and every submit waits `delay` first.
struct Flaky {
    inner: LocalCopyEngine,
    fail: Mutex<HashSet<EndpointId>>,
    delay: Mutex<Duration>,
    submits: AtomicUsize,
}

impl TransferEngine for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }
    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        self.inner.can_handle(src, dst)
    }
    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        self.inner.plan(fragments)
    }
    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        self.inner.builder()
    }
    fn submit(&self, plans: PlanSet) -> TransferHandle {
        self.submits.fetch_add(1, Ordering::Relaxed);
        let delay = *self.delay.lock().unwrap();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let fail = self.fail.lock().unwrap().clone();
        if fail.is_empty() {
            return self.inner.submit(plans);
        }
        // The plans touching a failing endpoint fail (whatever they copied is not to be
        // used, as after a real engine's failure); the others complete.
        let mut settled = self.inner.submit(plans).into_settled();
        for p in settled.plans.plans() {
            if fail.contains(&p.src()) || fail.contains(&p.dst()) {
                settled.failures.push(p.fail("flaky", FailureCause::Io { errno: 5 }));
            }
        }
        TransferHandle::settled(settled.failures, settled.plans)
    }
}

struct Rig {
    composite: CompositeEngine,
    engine: Arc<Flaky>,
    arena: Registration<Vec<u8>>,
    spec: TierSpec,
}

fn rig(slots: u32) -> Rig {
    let registry = EndpointRegistry::new();
    let engine = Arc::new(Flaky {
        inner: LocalCopyEngine::new(registry.clone()),
        fail: Mutex::new(HashSet::new()),
        delay: Mutex::new(Duration::ZERO),
        submits: AtomicUsize::new(0),
    });
    let config =
        CompositeConfig { checksums: ChecksumPolicy::AllTiers, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, vec![engine.clone()], config);
    let arena =
        composite.register_memory(vec![0xeeu8; (SLOT * u64::from(slots)) as usize]).unwrap();
    let spec = TierSpec::new(NODE, DRAM, SLOT, slots);
    Rig { composite, engine, arena, spec }
}

fn pool_on(rig: &Rig, index: Arc<dyn Index>, config: PoolConfig) -> Pool {
    let pool = Pool::new(index, rig.composite.clone(), config).unwrap();
    pool.add_tier(rig.spec, TierRegion::new(rig.arena.id(), 0, &rig.spec)).unwrap();
    pool
}

fn embedded(dir: &tempfile::TempDir) -> Arc<dyn Index> {
    Arc::new(EmbeddedIndex::open(dir.path().join("pool.redb")).unwrap())
}

/// The bytes of block `k` (`len` of them): a pattern no other key shares.
fn bytes_of(k: u128, len: u64) -> Vec<u8> {
    (0..len).map(|i| ((i * 131 + (k as u64) * 7919) % 251) as u8).collect()
}

fn key(k: u128) -> BlockKey {
    BlockKey::from_u128(k)
}

fn round_trip(index: Arc<dyn Index>) {
    let rig = rig(8);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let lens = [SLOT, SLOT - 1, 1, 4097];
    let mut src = Vec::new();
    for (i, len) in lens.iter().enumerate() {
        src.extend(bytes_of(i as u128, *len));
    }
    let src = rig.composite.register_memory(src).unwrap();
    let mut at = 0;
    let blocks: Vec<PutBlock> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let b = PutBlock { key: key(i as u128), src: src.id(), offset: at, len };
            at += len;
            b
        })
        .collect();
    assert_eq!(index.lookup(&[key(0)]).unwrap(), vec![None]);
    let put = pool.put(DRAM, &blocks).unwrap();
    let placements: Vec<Placement> = put
        .iter()
        .map(|o| match o {
            PutOutcome::Stored(p) => *p,
            other => panic!("{other:?}"),
        })
        .collect();
    for (p, b) in placements.iter().zip(&blocks) {
        assert_eq!((p.key, p.len, p.node, p.tier), (b.key, b.len, NODE, DRAM));
        assert_eq!(p.checksum, umbp_pool::checksum(&bytes_of(p.key.as_u128(), p.len)));
    }
    // Again: present, nothing written (the engine sees no batch).
    let submits = rig.engine.submits.load(Ordering::Relaxed);
    let again = pool.put(DRAM, &blocks[..1]).unwrap();
    assert!(matches!(again[0], PutOutcome::Present(p) if p == placements[0]), "{again:?}");
    assert_eq!(rig.engine.submits.load(Ordering::Relaxed), submits);
    assert_eq!(pool.exists(&[key(0), key(99)]).unwrap(), vec![true, false]);
    assert_eq!(pool.prefix_hits(&[key(0), key(1), key(99), key(2)]).unwrap(), 2);

    let dst = rig.composite.register_memory(vec![0u8; 5 * SLOT as usize]).unwrap();
    let gets: Vec<GetBlock> = (0..5)
        .map(|i| GetBlock { key: key(i), dst: dst.id(), offset: i as u64 * SLOT, capacity: SLOT })
        .collect();
    let got = pool.get(&gets).unwrap();
    for (i, o) in got.iter().enumerate().take(4) {
        assert!(matches!(o, GetOutcome::Loaded(p) if *p == placements[i]), "{i}: {o:?}");
    }
    assert!(matches!(got[4], GetOutcome::Miss), "{:?}", got[4]);
    // Every lease was released: the blocks can be removed.
    assert_eq!(pool.remove(&[key(3)]).unwrap(), vec![Removed::Removed]);
    let m = pool.metrics();
    assert_eq!(m.hits.load(Ordering::Relaxed), 4);
    assert_eq!(m.misses.load(Ordering::Relaxed), 1);
    assert_eq!(m.stored.load(Ordering::Relaxed), 4);
    assert_eq!(m.present.load(Ordering::Relaxed), 1);
    drop(pool);
    let out = dst.deregister();
    for (i, &len) in lens.iter().enumerate() {
        let at = i * SLOT as usize;
        assert_eq!(&out[at..at + len as usize], &bytes_of(i as u128, len)[..], "block {i}");
        assert!(out[at + len as usize..at + SLOT as usize].iter().all(|&b| b == 0));
    }
    assert!(out[4 * SLOT as usize..].iter().all(|&b| b == 0), "a miss wrote bytes");
}

#[test]
fn round_trip_embedded() {
    let dir = tempfile::tempdir().unwrap();
    round_trip(embedded(&dir));
}

#[test]
fn round_trip_redis() {
    let Some(server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> =
        Arc::new(umbp_pool::RedisIndex::connect(&support::config(&server, "pool-rt")).unwrap());
    round_trip(index);
}

/// 16 threads put and get overlapping key sets on one pool, over a tier with fewer slots than
/// keys (so eviction runs under them); every loaded byte is compared with its key's.
fn sixteen_threads(index: Arc<dyn Index>) {
    const KEYS: u128 = 48;
    const PER: usize = 4;
    let rig = rig(32);
    let pool = pool_on(&rig, index, PoolConfig::new(NODE));
    let mut all = Vec::new();
    for k in 0..KEYS {
        all.extend(bytes_of(k, SLOT));
    }
    let src = rig.composite.register_memory(all).unwrap();
    let loaded = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..16u128 {
            let (pool, src, rig, loaded) = (&pool, &src, &rig, &loaded);
            s.spawn(move || {
                let dst = rig.composite.register_memory(vec![0u8; PER * SLOT as usize]).unwrap();
                for round in 0..20u128 {
                    let ks: Vec<u128> =
                        (0..PER as u128).map(|j| (t * 5 + round * 3 + j) % KEYS).collect();
                    let puts: Vec<PutBlock> = ks
                        .iter()
                        .map(|&k| PutBlock {
                            key: key(k),
                            src: src.id(),
                            offset: k as u64 * SLOT,
                            len: SLOT,
                        })
                        .collect();
                    for o in pool.put(DRAM, &puts).unwrap() {
                        match o {
                            PutOutcome::Stored(_) | PutOutcome::Present(_) => {}
                            // Every slot reserved or leased by the other threads right now.
                            PutOutcome::Failed(BlockError::Index(e))
                                if matches!(*e, umbp_pool::Error::TierFull { .. }) => {}
                            other => panic!("{other:?}"),
                        }
                    }
                    let gets: Vec<GetBlock> = ks
                        .iter()
                        .enumerate()
                        .map(|(j, &k)| GetBlock {
                            key: key(k),
                            dst: dst.id(),
                            offset: j as u64 * SLOT,
                            capacity: SLOT,
                        })
                        .collect();
                    let got = pool.get(&gets).unwrap();
                    let snapshot = read_back(rig, &dst, PER);
                    for (j, (o, &k)) in got.iter().zip(&ks).enumerate() {
                        match o {
                            GetOutcome::Loaded(p) => {
                                assert_eq!(p.key, key(k));
                                let at = j * SLOT as usize;
                                assert!(
                                    snapshot[at..at + SLOT as usize] == bytes_of(k, SLOT)[..],
                                    "thread {t} key {k}: wrong bytes"
                                );
                                loaded.fetch_add(1, Ordering::Relaxed);
                            }
                            GetOutcome::Miss => {}
                            GetOutcome::Failed(e) => panic!("thread {t} key {k}: {e}"),
                        }
                    }
                }
            });
        }
    });
    let m = pool.metrics();
    assert!(loaded.load(Ordering::Relaxed) > 0);
    assert_eq!(m.hits.load(Ordering::Relaxed), loaded.load(Ordering::Relaxed) as u64);
    assert_eq!(m.checksum_failures.load(Ordering::Relaxed), 0);
    assert_eq!(m.get_failures.load(Ordering::Relaxed), 0);
}

/// The destination's bytes, read through the composite into fresh memory.
fn read_back(rig: &Rig, dst: &Registration<Vec<u8>>, blocks: usize) -> Vec<u8> {
    let out = rig.composite.register_memory(vec![0u8; blocks * SLOT as usize]).unwrap();
    let mut builder = rig.composite.builder();
    let pages = [0u64];
    let ranges = [ObjectRange::new(0, blocks as u64 * SLOT, out.id(), 0)];
    let object = umbp_composite::PagedObject::new(
        dst.id(),
        &pages,
        blocks as u64 * SLOT,
        blocks as u64 * SLOT,
    );
    let report =
        umbp_composite::restore(&mut builder, &[ObjectTransfer::new(0, object, &ranges)]).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed, "{report:?}");
    out.deregister()
}

#[test]
fn sixteen_threads_embedded() {
    let dir = tempfile::tempdir().unwrap();
    sixteen_threads(embedded(&dir));
}

#[test]
fn sixteen_threads_redis() {
    let Some(server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> =
        Arc::new(umbp_pool::RedisIndex::connect(&support::config(&server, "pool-16")).unwrap());
    sixteen_threads(index);
}

/// What [`BeforeLease`] runs, once.
type Hook = Box<dyn FnOnce(&dyn Index) + Send>;

/// An index that runs a hook just before a lease: what happens between a get's lookup and its
/// lease. It also fails `reserve_many` from its `fail_reserve_from`th call on, and `lease`
/// from its `fail_lease_from`th (counting from 1; 0: never), as an index that goes away in
/// the middle of a large put or get.
struct BeforeLease {
    inner: Arc<dyn Index>,
    hook: Mutex<Option<Hook>>,
    reserve_calls: AtomicUsize,
    fail_reserve_from: usize,
    lease_calls: AtomicUsize,
    fail_lease_from: AtomicUsize,
}

impl BeforeLease {
    fn new(inner: Arc<dyn Index>, fail_reserve_from: usize) -> Self {
        Self {
            inner,
            hook: Mutex::new(None),
            reserve_calls: AtomicUsize::new(0),
            fail_reserve_from,
            lease_calls: AtomicUsize::new(0),
            fail_lease_from: AtomicUsize::new(0),
        }
    }
}

impl Index for BeforeLease {
    fn register_tier(&self, spec: &TierSpec) -> Result<(), umbp_pool::Error> {
        self.inner.register_tier(spec)
    }
    fn tier_spec(&self, node: NodeId, tier: TierId) -> Result<Option<TierSpec>, umbp_pool::Error> {
        self.inner.tier_spec(node, tier)
    }
    fn reserve(
        &self,
        key: BlockKey,
        node: NodeId,
        tier: TierId,
        len: u64,
        ttl: Duration,
    ) -> Result<Reserved, umbp_pool::Error> {
        self.inner.reserve(key, node, tier, len, ttl)
    }
    fn reserve_many(
        &self,
        node: NodeId,
        tier: TierId,
        items: &[(BlockKey, u64)],
        ttl: Duration,
    ) -> Result<Vec<Result<Reserved, umbp_pool::Error>>, umbp_pool::Error> {
        let call = self.reserve_calls.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_reserve_from != 0 && call >= self.fail_reserve_from {
            return Err(umbp_pool::Error::Store("the index went away".into()));
        }
        self.inner.reserve_many(node, tier, items, ttl)
    }
    fn publish(&self, items: &[(Reservation, u32)]) -> Result<Vec<Published>, umbp_pool::Error> {
        self.inner.publish(items)
    }
    fn abort(&self, reservations: &[Reservation]) -> Result<(), umbp_pool::Error> {
        self.inner.abort(reservations)
    }
    fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, umbp_pool::Error> {
        self.inner.lookup(keys)
    }
    fn lease(&self, placements: &[Placement], ttl: Duration) -> Result<Lease, umbp_pool::Error> {
        if let Some(hook) = self.hook.lock().unwrap().take() {
            hook(&*self.inner);
        }
        let call = self.lease_calls.fetch_add(1, Ordering::Relaxed) + 1;
        let from = self.fail_lease_from.load(Ordering::Relaxed);
        if from != 0 && call >= from {
            return Err(umbp_pool::Error::Store("the index went away".into()));
        }
        self.inner.lease(placements, ttl)
    }
    fn renew(&self, id: u64, ttl: Duration) -> Result<(), umbp_pool::Error> {
        self.inner.renew(id, ttl)
    }
    fn release(&self, id: u64) -> Result<(), umbp_pool::Error> {
        self.inner.release(id)
    }
    fn remove(&self, keys: &[BlockKey]) -> Result<Vec<Removed>, umbp_pool::Error> {
        self.inner.remove(keys)
    }
    fn evict(&self, node: NodeId, tier: TierId, count: u32) -> Result<u32, umbp_pool::Error> {
        self.inner.evict(node, tier, count)
    }
    fn tier_stats(&self, node: NodeId, tier: TierId) -> Result<TierStats, umbp_pool::Error> {
        self.inner.tier_stats(node, tier)
    }
    fn announce(&self, node: &NodeAnnouncement, ttl: Duration) -> Result<(), umbp_pool::Error> {
        self.inner.announce(node, ttl)
    }
    fn nodes(&self) -> Result<Vec<NodeAnnouncement>, umbp_pool::Error> {
        self.inner.nodes()
    }
    fn leave(&self, node: NodeId) -> Result<bool, umbp_pool::Error> {
        self.inner.leave(node)
    }
}

#[test]
fn slot_reused_between_lookup_and_lease_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let index = Arc::new(BeforeLease::new(embedded(&dir), 0));
    // One slot: the block that follows A lands in A's slot.
    let rig = rig(1);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let src = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    let put =
        pool.put(DRAM, &[PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT }]).unwrap();
    let PutOutcome::Stored(a) = put[0] else { panic!("{put:?}") };

    // Between the get's lookup and its lease, A is evicted and its slot reused by B, whose
    // bytes land there.
    let b_bytes = bytes_of(2, SLOT);
    let composite = rig.composite.clone();
    let arena = rig.arena.id();
    *index.hook.lock().unwrap() = Some(Box::new(move |ix: &dyn Index| {
        assert_eq!(ix.evict(NODE, DRAM, 1).unwrap(), 1);
        let Reserved::Slot(r) =
            ix.reserve(key(2), NODE, DRAM, SLOT, Duration::from_secs(30)).unwrap()
        else {
            panic!()
        };
        assert_eq!(r.slot, a.slot);
        assert!(r.generation > a.generation);
        let b = composite.register_memory(b_bytes.clone()).unwrap();
        let pages = [u64::from(r.slot) * SLOT];
        let ranges = [ObjectRange::new(0, SLOT, b.id(), 0)];
        let object = umbp_composite::PagedObject::new(arena, &pages, SLOT, SLOT);
        let report =
            offload(&mut composite.builder(), &[ObjectTransfer::new(0, object, &ranges)]).unwrap();
        ix.publish(&[(r, report.objects[0].checksum.unwrap())]).unwrap();
    }));
    let dst = rig.composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let got =
        pool.get(&[GetBlock { key: key(1), dst: dst.id(), offset: 0, capacity: SLOT }]).unwrap();
    assert!(matches!(got[0], GetOutcome::Miss), "{got:?}");
    assert_eq!(pool.metrics().stale.load(Ordering::Relaxed), 1);
    assert_eq!(pool.metrics().hits.load(Ordering::Relaxed), 0);
    assert!(dst.deregister().iter().all(|&b| b == 0), "a stale placement wrote bytes");
    // B is there, whole.
    let dst = rig.composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let got =
        pool.get(&[GetBlock { key: key(2), dst: dst.id(), offset: 0, capacity: SLOT }]).unwrap();
    assert!(got[0].is_loaded(), "{got:?}");
    assert_eq!(dst.deregister(), bytes_of(2, SLOT));
}

#[test]
fn clobbered_slot_is_a_counted_checksum_failure_and_leaves_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    let rig = rig(4);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let src =
        rig.composite.register_memory([bytes_of(1, SLOT), bytes_of(2, SLOT)].concat()).unwrap();
    let put = pool
        .put(
            DRAM,
            &[
                PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT },
                PutBlock { key: key(2), src: src.id(), offset: SLOT, len: SLOT },
            ],
        )
        .unwrap();
    let PutOutcome::Stored(p1) = put[0] else { panic!("{put:?}") };
    // One byte of block 1's slot changes behind the index's back.
    let poison = rig.composite.register_memory(vec![0x5a_u8]).unwrap();
    let pages = [u64::from(p1.slot) * SLOT];
    let ranges = [ObjectRange::new(100, 1, poison.id(), 0)];
    let object = umbp_composite::PagedObject::new(rig.arena.id(), &pages, SLOT, SLOT);
    let report =
        offload(&mut rig.composite.builder(), &[ObjectTransfer::new(0, object, &ranges)]).unwrap();
    assert_eq!(report.aggregate, BatchState::Completed);

    let dst = rig.composite.register_memory(vec![0u8; 2 * SLOT as usize]).unwrap();
    let gets = [
        GetBlock { key: key(1), dst: dst.id(), offset: 0, capacity: SLOT },
        GetBlock { key: key(2), dst: dst.id(), offset: SLOT, capacity: SLOT },
    ];
    let got = pool.get(&gets).unwrap();
    assert!(
        matches!(got[0], GetOutcome::Failed(BlockError::ChecksumMismatch { expected, actual: Some(a) }) if expected == p1.checksum && a != expected),
        "{got:?}"
    );
    assert!(got[1].is_loaded(), "the other block pays nothing: {got:?}");
    assert_eq!(pool.metrics().checksum_failures.load(Ordering::Relaxed), 1);
    assert_eq!(pool.metrics().hits.load(Ordering::Relaxed), 1);
    // Removed from the pool: a miss from now on, and its slot is free.
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![None]);
    let again = pool.get(&gets[..1]).unwrap();
    assert!(matches!(again[0], GetOutcome::Miss), "{again:?}");
    assert_eq!(index.tier_stats(NODE, DRAM).unwrap().published, 1);
}

#[test]
fn failed_or_refused_put_publishes_nothing_and_frees_its_slots() {
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    let rig = rig(4);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let free = |ix: &Arc<dyn Index>| ix.tier_stats(NODE, DRAM).unwrap();

    // The source was deregistered before the put: the composite refuses the object.
    let gone = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    let gone_id = gone.id();
    drop(gone);
    let good = rig.composite.register_memory(bytes_of(2, SLOT)).unwrap();
    let put = pool
        .put(
            DRAM,
            &[
                PutBlock { key: key(1), src: gone_id, offset: 0, len: SLOT },
                PutBlock { key: key(2), src: good.id(), offset: 0, len: SLOT },
            ],
        )
        .unwrap();
    assert!(matches!(put[0], PutOutcome::Failed(BlockError::Transfer(_))), "{put:?}");
    assert!(matches!(put[1], PutOutcome::Stored(_)), "{put:?}");
    assert_eq!(index.lookup(&[key(1)]).unwrap(), vec![None]);
    assert_eq!(free(&index), TierStats { free: 3, reserved: 0, published: 1 });

    // The engine fails every transfer into the tier (a failing device): aborted, nothing
    // published, the slots free again at once (not after the reservation TTL).
    rig.engine.fail.lock().unwrap().insert(rig.arena.id());
    let src =
        rig.composite.register_memory([bytes_of(3, SLOT), bytes_of(4, SLOT)].concat()).unwrap();
    let blocks = [
        PutBlock { key: key(3), src: src.id(), offset: 0, len: SLOT },
        PutBlock { key: key(4), src: src.id(), offset: SLOT, len: SLOT },
    ];
    let put = pool.put(DRAM, &blocks).unwrap();
    for o in &put {
        assert!(matches!(o, PutOutcome::Failed(BlockError::Transfer(_))), "{put:?}");
    }
    assert_eq!(index.lookup(&[key(3), key(4)]).unwrap(), vec![None, None]);
    assert_eq!(free(&index), TierStats { free: 3, reserved: 0, published: 1 });
    assert_eq!(pool.metrics().put_failures.load(Ordering::Relaxed), 3);

    // A source range past its endpoint, and a block larger than a slot: refused per block.
    rig.engine.fail.lock().unwrap().clear();
    let put = pool
        .put(
            DRAM,
            &[
                PutBlock { key: key(5), src: src.id(), offset: SLOT + 1, len: SLOT },
                PutBlock { key: key(6), src: src.id(), offset: 0, len: SLOT + 1 },
                PutBlock { key: key(7), src: src.id(), offset: 0, len: SLOT },
            ],
        )
        .unwrap();
    assert!(matches!(put[0], PutOutcome::Failed(BlockError::Transfer(_))), "{put:?}");
    assert!(
        matches!(&put[1], PutOutcome::Failed(BlockError::Index(e)) if matches!(**e, umbp_pool::Error::TooLarge { .. })),
        "{put:?}"
    );
    assert!(matches!(put[2], PutOutcome::Stored(_)), "{put:?}");
    assert_eq!(free(&index), TierStats { free: 2, reserved: 0, published: 2 });

    // A tier this pool cannot reach: every block fails, nothing reserved.
    let put = pool.put(TierId(9), &blocks).unwrap();
    assert!(matches!(put[0], PutOutcome::Failed(BlockError::Unreachable { .. })), "{put:?}");
}

/// A resolver that reaches node 7's tier through an endpoint of this process (as a memory
/// node's region is reached through the remote engine), and records what it is asked.
struct Loopback {
    region: TierRegion,
    resolved: AtomicUsize,
    forgotten: AtomicUsize,
    /// What `is_current` answers.
    current: AtomicBool,
}

impl TierResolver for Loopback {
    fn resolve(&self, node: &NodeAnnouncement, spec: &TierSpec) -> Option<TierRegion> {
        assert_eq!((node.node, spec.slot_size), (NodeId(7), SLOT));
        assert_eq!(node.address, "10.0.0.7:7000");
        self.resolved.fetch_add(1, Ordering::Relaxed);
        Some(self.region)
    }
    fn forget(&self, _spec: &TierSpec) {
        self.forgotten.fetch_add(1, Ordering::Relaxed);
    }
    fn is_current(&self, node: NodeId, region: &TierRegion) -> bool {
        assert_eq!((node, *region), (NodeId(7), self.region));
        self.current.load(Ordering::Relaxed)
    }
}

#[test]
fn other_nodes_tiers_through_a_resolver_and_a_dead_peer_costs_only_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    let rig = rig(4);
    // Node 7 (a memory node) and node 3 (this instance) share the index and the composite.
    let node7 = Pool::new(
        index.clone(),
        rig.composite.clone(),
        PoolConfig { address: "10.0.0.7:7000".into(), ..PoolConfig::new(NodeId(7)) },
    )
    .unwrap();
    let remote = rig.composite.register_memory(vec![0u8; 4 * SLOT as usize]).unwrap();
    let spec7 = TierSpec::new(NodeId(7), TierId(2), SLOT, 4);
    node7.add_tier(spec7, TierRegion::new(remote.id(), 0, &spec7)).unwrap();
    let resolver = Arc::new(Loopback {
        region: TierRegion::new(remote.id(), 0, &spec7),
        resolved: AtomicUsize::new(0),
        forgotten: AtomicUsize::new(0),
        current: AtomicBool::new(true),
    });
    let me = Pool::with_resolver(
        index.clone(),
        rig.composite.clone(),
        PoolConfig::new(NODE),
        Some(resolver.clone()),
    )
    .unwrap();
    me.add_tier(rig.spec, TierRegion::new(rig.arena.id(), 0, &rig.spec)).unwrap();

    // Node 7 holds block 1 (put through `put_on`, by this instance, via the resolver), this
    // node's DRAM block 2.
    let src =
        rig.composite.register_memory([bytes_of(1, SLOT), bytes_of(2, SLOT)].concat()).unwrap();
    let put = me
        .put_on(
            NodeId(7),
            TierId(2),
            &[PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT }],
        )
        .unwrap();
    assert!(matches!(put[0], PutOutcome::Stored(p) if p.node == NodeId(7)), "{put:?}");
    assert!(me
        .put(DRAM, &[PutBlock { key: key(2), src: src.id(), offset: SLOT, len: SLOT }])
        .unwrap()[0]
        .is_in_pool());
    assert_eq!(resolver.resolved.load(Ordering::Relaxed), 1);

    let dst = rig.composite.register_memory(vec![0u8; 2 * SLOT as usize]).unwrap();
    let gets = [
        GetBlock { key: key(1), dst: dst.id(), offset: 0, capacity: SLOT },
        GetBlock { key: key(2), dst: dst.id(), offset: SLOT, capacity: SLOT },
    ];
    let got = me.get(&gets).unwrap();
    assert!(got.iter().all(GetOutcome::is_loaded), "{got:?}");
    assert_eq!(resolver.resolved.load(Ordering::Relaxed), 1, "the region is cached");
    assert_eq!(read_back(&rig, &dst, 2), [bytes_of(1, SLOT), bytes_of(2, SLOT)].concat());

    // The peer dies: its block fails (a load error, not a hit, not a miss), the local one
    // loads, the region is forgotten and resolved again by the next get.
    rig.engine.fail.lock().unwrap().insert(remote.id());
    let got = me.get(&gets).unwrap();
    assert!(matches!(got[0], GetOutcome::Failed(BlockError::Transfer(_))), "{got:?}");
    assert!(got[1].is_loaded(), "{got:?}");
    assert_eq!(resolver.forgotten.load(Ordering::Relaxed), 1);
    assert_eq!(me.metrics().get_failures.load(Ordering::Relaxed), 1);
    rig.engine.fail.lock().unwrap().clear();
    let got = me.get(&gets).unwrap();
    assert!(got.iter().all(GetOutcome::is_loaded), "{got:?}");
    assert_eq!(resolver.resolved.load(Ordering::Relaxed), 2);

    // The resolver says its cached region is stale (its peer reconnected): the pool resolves
    // again before using it, and no block fails.
    resolver.current.store(false, Ordering::Relaxed);
    let got = me.get(&gets).unwrap();
    resolver.current.store(true, Ordering::Relaxed);
    assert!(got.iter().all(GetOutcome::is_loaded), "{got:?}");
    assert_eq!(resolver.resolved.load(Ordering::Relaxed), 3);
    assert_eq!(resolver.forgotten.load(Ordering::Relaxed), 2);

    // Without a resolver, another node's block is unreachable: a failure, not a hit.
    let alone =
        Pool::new(index.clone(), rig.composite.clone(), PoolConfig::new(NodeId(8))).unwrap();
    let got = alone.get(&gets[..1]).unwrap();
    assert!(
        matches!(got[0], GetOutcome::Failed(BlockError::Unreachable { node: NodeId(7), .. })),
        "{got:?}"
    );
}

#[test]
fn a_get_that_outlives_its_lease_ttl_renews_it() {
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    let rig = rig(4);
    let config = PoolConfig { lease_ttl: Duration::from_millis(1200), ..PoolConfig::new(NODE) };
    let pool = pool_on(&rig, index.clone(), config);
    let src = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    assert!(pool
        .put(DRAM, &[PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT }])
        .unwrap()[0]
        .is_in_pool());
    // Every transfer now takes 4 s, more than three lease TTLs (renewed every 600 ms: a
    // renewal may come 600 ms late on a loaded machine and still hold).
    *rig.engine.delay.lock().unwrap() = Duration::from_secs(4);
    let dst = rig.composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let removed_meanwhile = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Past two TTLs: the lease still holds the block, so it stays.
            std::thread::sleep(Duration::from_millis(2600));
            let r = index.remove(&[key(1)]).unwrap();
            removed_meanwhile.store(r == vec![Removed::Removed], Ordering::Relaxed);
        });
        let got = pool
            .get(&[GetBlock { key: key(1), dst: dst.id(), offset: 0, capacity: SLOT }])
            .unwrap();
        assert!(got[0].is_loaded(), "{got:?}");
    });
    assert!(!removed_meanwhile.load(Ordering::Relaxed), "the lease ran out under the get");
    *rig.engine.delay.lock().unwrap() = Duration::ZERO;
    assert_eq!(read_back(&rig, &dst, 1), bytes_of(1, SLOT));
    // Released at the end.
    assert_eq!(index.remove(&[key(1)]).unwrap(), vec![Removed::Removed]);
}

/// A get runs two chunks at once: the chunk started behind the one being waited for keeps its
/// lease too. Every transfer takes 3 s, more than two lease TTLs: the second chunk, leased
/// before the first one's wait began, is renewed during it, so its blocks cannot be removed
/// meanwhile and all of them load (not `LeaseLost`).
#[test]
fn a_long_get_keeps_the_lease_of_the_chunk_waiting_behind() {
    const N: usize = 600; // chunks of 256, 88 and 256 blocks
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    // Room to spare: no block is evicted to make room.
    let rig = rig(2 * N as u32 + 8);
    let config = PoolConfig { lease_ttl: Duration::from_millis(1200), ..PoolConfig::new(NODE) };
    let pool = pool_on(&rig, index.clone(), config);
    let src: Vec<u8> = (0..N as u128).flat_map(|k| bytes_of(k, SLOT)).collect();
    let src = rig.composite.register_memory(src).unwrap();
    let blocks: Vec<PutBlock> = (0..N as u64)
        .map(|i| PutBlock { key: key(i.into()), src: src.id(), offset: i * SLOT, len: SLOT })
        .collect();
    assert!(pool.put(DRAM, &blocks).unwrap().iter().all(PutOutcome::is_in_pool));
    *rig.engine.delay.lock().unwrap() = Duration::from_secs(3);
    let dst = rig.composite.register_memory(vec![0u8; N * SLOT as usize]).unwrap();
    let gets: Vec<GetBlock> = (0..N as u64)
        .map(|i| GetBlock { key: key(i.into()), dst: dst.id(), offset: i * SLOT, capacity: SLOT })
        .collect();
    let removed_meanwhile = AtomicBool::new(false);
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            // Past the second chunk's first TTL, while the first chunk is still waited for.
            std::thread::sleep(Duration::from_millis(2000));
            let r = index.remove(&[key(300)]).unwrap();
            removed_meanwhile.store(r == vec![Removed::Removed], Ordering::Relaxed);
        });
        pool.get(&gets).unwrap()
    });
    assert!(!removed_meanwhile.load(Ordering::Relaxed), "the second chunk's lease ran out");
    *rig.engine.delay.lock().unwrap() = Duration::ZERO;
    let back = read_back(&rig, &dst, N);
    for (i, g) in got.iter().enumerate() {
        assert!(g.is_loaded(), "{i}: {g:?}");
        let at = i * SLOT as usize;
        assert_eq!(&back[at..at + SLOT as usize], &bytes_of(i as u128, SLOT)[..], "block {i}");
    }
    // Every lease ended with the get.
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.key).collect();
    assert!(index.remove(&keys).unwrap().iter().all(|r| *r == Removed::Removed));
}

#[test]
fn the_node_is_announced_while_the_pool_lives() {
    let Some(server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> =
        Arc::new(umbp_pool::RedisIndex::connect(&support::config(&server, "pool-ann")).unwrap());
    let rig = rig(4);
    let config = PoolConfig {
        announce_ttl: Duration::from_millis(1500),
        address: "10.1.2.3:9".into(),
        ..PoolConfig::new(NODE)
    };
    let pool = pool_on(&rig, index.clone(), config);
    let nodes = index.nodes().unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!((nodes[0].node, nodes[0].address.as_str()), (NODE, "10.1.2.3:9"));
    assert_eq!(nodes[0].tiers, vec![(DRAM, 4 * SLOT)]);
    // Twice the TTL later it is still alive: the thread renewed it.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(index.nodes().unwrap().len(), 1);
    // Puts need a live node on Redis: they work.
    let src = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    assert!(pool
        .put(DRAM, &[PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT }])
        .unwrap()[0]
        .is_in_pool());
    drop(pool);
    // Dropped: no more renewals; the node expires.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(index.nodes().unwrap().is_empty());
}

#[test]
fn add_tier_refuses_what_it_cannot_verify_or_hold() {
    let dir = tempfile::tempdir().unwrap();
    let index = embedded(&dir);
    let rig = rig(4);
    let pool = Pool::new(index.clone(), rig.composite.clone(), PoolConfig::new(NODE)).unwrap();
    let bad = |spec: TierSpec, region: TierRegion| {
        matches!(pool.add_tier(spec, region), Err(umbp_pool::Error::InvalidConfig(_)))
    };
    // More slots than the arena has.
    let big = TierSpec::new(NODE, DRAM, SLOT, 5);
    assert!(bad(big, TierRegion::new(rig.arena.id(), 0, &big)));
    // Another slot size than the spec's.
    let region = TierRegion { endpoint: rig.arena.id(), base: 0, slot_size: SLOT / 2 };
    assert!(bad(rig.spec, region));
    // A DRAM tier under a composite that does not checksum DRAM.
    let registry = EndpointRegistry::new();
    let plain =
        CompositeEngine::new(registry.clone(), vec![Arc::new(LocalCopyEngine::new(registry))]);
    let arena = plain.register_memory(vec![0u8; 4 * SLOT as usize]).unwrap();
    let pool2 = Pool::new(index.clone(), plain, PoolConfig::new(NodeId(4))).unwrap();
    let spec = TierSpec::new(NodeId(4), DRAM, SLOT, 4);
    assert!(matches!(
        pool2.add_tier(spec, TierRegion::new(arena.id(), 0, &spec)),
        Err(umbp_pool::Error::InvalidConfig(_))
    ));
    // Nothing registered with the index by the refusals.
    assert!(index.tier_spec(NODE, DRAM).unwrap().is_none());
    assert!(index.tier_spec(NodeId(4), DRAM).unwrap().is_none());
    // Zero TTLs are refused.
    let zero = PoolConfig { lease_ttl: Duration::ZERO, ..PoolConfig::new(NODE) };
    assert!(matches!(
        Pool::new(index, rig.composite.clone(), zero),
        Err(umbp_pool::Error::InvalidConfig(_))
    ));
}

#[test]
fn after_a_redis_restart_the_node_comes_back_and_puts_work() {
    let Some(mut server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> = Arc::new(
        umbp_pool::RedisIndex::connect(&support::config(&server, "pool-restart")).unwrap(),
    );
    let rig = rig(4);
    let config = PoolConfig { announce_ttl: Duration::from_millis(600), ..PoolConfig::new(NODE) };
    let pool = pool_on(&rig, index.clone(), config);
    let src = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    let block = |k| [PutBlock { key: key(k), src: src.id(), offset: 0, len: SLOT }];
    assert!(matches!(pool.put(DRAM, &block(1)).unwrap()[0], PutOutcome::Stored(_)));
    // The server restarts empty: it forgot the node, its tier and the block.
    server.restart();
    // The announcer registers the tier again and announces the node (every 200 ms): within a
    // few periods, a put works again. Polled, not timed: a loaded machine only makes it later.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match pool.put(DRAM, &block(2)) {
            Ok(out) if matches!(out[0], PutOutcome::Stored(_)) => break,
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the node never came back: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    assert_eq!(index.nodes().unwrap().len(), 1);
    assert_eq!(pool.exists(&[key(1), key(2)]).unwrap(), vec![false, true]);
    let dst = rig.composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let got =
        pool.get(&[GetBlock { key: key(2), dst: dst.id(), offset: 0, capacity: SLOT }]).unwrap();
    assert!(got[0].is_loaded(), "{got:?}");
    assert_eq!(dst.deregister(), bytes_of(1, SLOT));
}

#[test]
fn leaving_withdraws_the_node_at_once_and_for_good() {
    let Some(server) = RedisServer::start() else { return };
    let index: Arc<dyn Index> =
        Arc::new(umbp_pool::RedisIndex::connect(&support::config(&server, "pool-leave")).unwrap());
    let rig = rig(4);
    let config = PoolConfig { announce_ttl: Duration::from_millis(300), ..PoolConfig::new(NODE) };
    let pool = pool_on(&rig, index.clone(), config);
    let src = rig.composite.register_memory(bytes_of(1, SLOT)).unwrap();
    let block = |k| [PutBlock { key: key(k), src: src.id(), offset: 0, len: SLOT }];
    assert!(matches!(pool.put(DRAM, &block(1)).unwrap()[0], PutOutcome::Stored(_)));
    assert!(pool.leave().unwrap());
    // At once: no node, its block a miss.
    assert!(index.nodes().unwrap().is_empty());
    assert_eq!(pool.exists(&[key(1)]).unwrap(), vec![false]);
    // And for good: the announcer is stopped (several of its periods later, still gone), so a
    // put finds the node dead.
    std::thread::sleep(Duration::from_millis(500));
    assert!(index.nodes().unwrap().is_empty());
    let put = pool.put(DRAM, &block(2)).unwrap();
    assert!(
        matches!(&put[0], PutOutcome::Failed(BlockError::Index(e)) if matches!(**e, umbp_pool::Error::NodeNotAlive(_))),
        "{put:?}"
    );
    assert!(!pool.leave().unwrap(), "already gone");
}

/// A put of more blocks than one step of its pipeline (1,024) runs in chunks whose transfers
/// overlap the next chunk's reservation and the previous one's publish: every block lands
/// and is published with its own bytes, a present key and a failed source are reported for
/// their blocks alone, in whichever chunk they are; when the index goes away after the first
/// chunk, that chunk stays stored and the rest fail per block, with nothing left reserved;
/// when it is gone from the start, the put is an error and nothing is reserved.
#[test]
fn a_large_put_runs_in_chunks_and_each_block_lands_with_its_bytes() {
    const N: usize = 2_500;
    const LEN: u64 = 512;
    let dir = tempfile::tempdir().unwrap();
    let rig = rig(2 * N as u32 + 8);
    let index = embedded(&dir);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let src: Vec<u8> = (0..N as u128).flat_map(|k| bytes_of(k, LEN)).collect();
    let src = rig.composite.register_memory(src).unwrap();
    // The chunks: 256 blocks, 994, 994, 256. Key 1,500 (in the third) is published already.
    let early = pool
        .put(DRAM, &[PutBlock { key: key(1_500), src: src.id(), offset: 1_500 * LEN, len: LEN }])
        .unwrap();
    assert!(matches!(early[0], PutOutcome::Stored(_)), "{early:?}");
    let gone = rig.composite.register_memory(vec![1u8; LEN as usize]).unwrap();
    let gone_id = gone.id();
    drop(gone);
    let mut blocks: Vec<PutBlock> = (0..N as u64)
        .map(|i| PutBlock { key: key(i.into()), src: src.id(), offset: i * LEN, len: LEN })
        .collect();
    // Block 2,300 (in the last chunk) comes from a source that is gone.
    blocks[2_300].src = gone_id;
    let put = pool.put(DRAM, &blocks).unwrap();
    assert_eq!(put.len(), N);
    for (i, o) in put.iter().enumerate() {
        match i {
            1_500 => assert!(matches!(o, PutOutcome::Present(_)), "{i}: {o:?}"),
            2_300 => assert!(matches!(o, PutOutcome::Failed(BlockError::Transfer(_))), "{o:?}"),
            _ => {
                assert!(matches!(o, PutOutcome::Stored(p) if p.key == key(i as u128)), "{i}: {o:?}")
            }
        }
    }
    let dst = rig.composite.register_memory(vec![0u8; N * LEN as usize]).unwrap();
    let gets: Vec<GetBlock> = (0..N as u64)
        .map(|i| GetBlock { key: key(i.into()), dst: dst.id(), offset: i * LEN, capacity: LEN })
        .collect();
    let got = pool.get(&gets).unwrap();
    let back = dst.deregister();
    for (i, g) in got.iter().enumerate() {
        if i == 2_300 {
            assert!(matches!(g, GetOutcome::Miss), "{g:?}");
            continue;
        }
        assert!(g.is_loaded(), "{i}: {g:?}");
        let at = i * LEN as usize;
        assert_eq!(&back[at..at + LEN as usize], &bytes_of(i as u128, LEN)[..], "block {i}");
    }
    let stats = index.tier_stats(NODE, DRAM).unwrap();
    assert_eq!(stats.reserved, 0);
    assert_eq!(stats.published as usize, N - 1);

    // The index fails from the second reservation call on.
    let dir = tempfile::tempdir().unwrap();
    let flaky = Arc::new(BeforeLease::new(embedded(&dir), 2));
    let rig2 = crate::rig(2 * N as u32 + 8);
    let pool = pool_on(&rig2, flaky.clone(), PoolConfig::new(NODE));
    let src: Vec<u8> = (0..N as u128).flat_map(|k| bytes_of(k, LEN)).collect();
    let src = rig2.composite.register_memory(src).unwrap();
    let blocks: Vec<PutBlock> = (0..N as u64)
        .map(|i| PutBlock { key: key(i.into()), src: src.id(), offset: i * LEN, len: LEN })
        .collect();
    let put = pool.put(DRAM, &blocks).unwrap();
    // The first chunk: 256 blocks.
    for (i, o) in put.iter().enumerate() {
        if i < 256 {
            assert!(matches!(o, PutOutcome::Stored(_)), "{i}: {o:?}");
        } else {
            assert!(matches!(o, PutOutcome::Failed(BlockError::Index(_))), "{i}: {o:?}");
        }
    }
    let found = flaky.inner.lookup(&blocks.iter().map(|b| b.key).collect::<Vec<_>>()).unwrap();
    assert_eq!(found.iter().filter(|p| p.is_some()).count(), 256);
    assert!(found[..256].iter().all(Option::is_some));
    let stats = flaky.inner.tier_stats(NODE, DRAM).unwrap();
    assert_eq!((stats.reserved, stats.published), (0, 256));
    // Gone from the first call: an error, nothing reserved.
    assert!(pool.put(DRAM, &blocks).is_err());
    let stats = flaky.inner.tier_stats(NODE, DRAM).unwrap();
    assert_eq!((stats.reserved, stats.published), (0, 256));
}

/// A large get runs in chunks (256 blocks, 994, 994, 256), each under a lease of its own:
/// every block loads its own bytes, and a block removed between the lookup and its chunk's
/// lease is a miss alone; when the index goes away after the first lease, that chunk loads
/// and the rest fail per block, and no lease is left behind; when it is gone from the start,
/// the get is an error and nothing is written.
#[test]
fn a_large_get_runs_in_chunks_each_under_its_own_lease() {
    const N: usize = 2_500;
    const LEN: u64 = 512;
    let dir = tempfile::tempdir().unwrap();
    let index = Arc::new(BeforeLease::new(embedded(&dir), 0));
    // Room to spare: no block is evicted to make room.
    let rig = rig(2 * N as u32 + 8);
    let pool = pool_on(&rig, index.clone(), PoolConfig::new(NODE));
    let src: Vec<u8> = (0..N as u128).flat_map(|k| bytes_of(k, LEN)).collect();
    let src = rig.composite.register_memory(src).unwrap();
    let blocks: Vec<PutBlock> = (0..N as u64)
        .map(|i| PutBlock { key: key(i.into()), src: src.id(), offset: i * LEN, len: LEN })
        .collect();
    assert!(pool.put(DRAM, &blocks).unwrap().iter().all(|o| matches!(o, PutOutcome::Stored(_))));
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.key).collect();
    let gets = |dst: EndpointId| -> Vec<GetBlock> {
        (0..N as u64)
            .map(|i| GetBlock { key: key(i.into()), dst, offset: i * LEN, capacity: LEN })
            .collect()
    };
    // Block 1,800 (in the third chunk) leaves after the lookup.
    let gone = keys[1_800];
    *index.hook.lock().unwrap() = Some(Box::new(move |inner: &dyn Index| {
        assert_eq!(inner.remove(&[gone]).unwrap(), vec![Removed::Removed]);
    }));
    let dst = rig.composite.register_memory(vec![0u8; N * LEN as usize]).unwrap();
    let got = pool.get(&gets(dst.id())).unwrap();
    let back = dst.deregister();
    for (i, g) in got.iter().enumerate() {
        let at = i * LEN as usize;
        if i == 1_800 {
            assert!(matches!(g, GetOutcome::Miss), "{g:?}");
            assert!(back[at..at + LEN as usize].iter().all(|&b| b == 0), "block {i} written");
            continue;
        }
        assert!(g.is_loaded(), "{i}: {g:?}");
        assert_eq!(&back[at..at + LEN as usize], &bytes_of(i as u128, LEN)[..], "block {i}");
    }
    assert_eq!(index.lease_calls.load(Ordering::Relaxed), 4);

    // The index fails from the next get's second lease call on.
    index.lease_calls.store(0, Ordering::Relaxed);
    index.fail_lease_from.store(2, Ordering::Relaxed);
    let dst = rig.composite.register_memory(vec![0u8; N * LEN as usize]).unwrap();
    let got = pool.get(&gets(dst.id())).unwrap();
    let back = dst.deregister();
    for (i, g) in got.iter().enumerate() {
        let at = i * LEN as usize;
        if i < 256 {
            assert!(g.is_loaded(), "{i}: {g:?}");
            assert_eq!(&back[at..at + LEN as usize], &bytes_of(i as u128, LEN)[..], "block {i}");
        } else if i != 1_800 {
            assert!(matches!(g, GetOutcome::Failed(BlockError::Index(_))), "{i}: {g:?}");
        }
    }
    // Every lease ended: each block can be removed.
    let removed = index.inner.remove(&keys[..256]).unwrap();
    assert!(removed.iter().all(|r| *r == Removed::Removed), "{removed:?}");
    // Gone from the first lease call: an error, nothing written.
    index.fail_lease_from.store(1, Ordering::Relaxed);
    let dst = rig.composite.register_memory(vec![0u8; N * LEN as usize]).unwrap();
    assert!(pool.get(&gets(dst.id())).is_err());
    assert!(dst.deregister().iter().all(|&b| b == 0));
}

/// Issue 42, case 4: a get whose destination is the pool's own DRAM tier (loading B into A's
/// slot) was done and reported loaded, and A was lost. It is refused for that block alone
/// (`BlockError::IntoTier`), nothing is written, and A still loads its own bytes; a
/// destination beside the tier in the same endpoint is fine.
#[test]
fn a_get_into_the_pools_own_tier_is_refused() {
    let registry = EndpointRegistry::new();
    let copy = Arc::new(LocalCopyEngine::new(registry.clone()));
    let config =
        CompositeConfig { checksums: ChecksumPolicy::AllTiers, ..CompositeConfig::default() };
    let composite = CompositeEngine::with_config(registry, vec![copy], config);
    // One endpoint: a spare slot's room, then the tier's 4 slots.
    let arena = composite.register_memory(vec![0u8; 5 * SLOT as usize]).unwrap();
    let spec = TierSpec::new(NODE, DRAM, SLOT, 4);
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(embedded(&dir), composite.clone(), PoolConfig::new(NODE)).unwrap();
    pool.add_tier(spec, TierRegion::new(arena.id(), SLOT, &spec)).unwrap();
    let src = composite.register_memory([bytes_of(1, SLOT), bytes_of(2, SLOT)].concat()).unwrap();
    let put = pool
        .put(
            DRAM,
            &[
                PutBlock { key: key(1), src: src.id(), offset: 0, len: SLOT },
                PutBlock { key: key(2), src: src.id(), offset: SLOT, len: SLOT },
            ],
        )
        .unwrap();
    let [PutOutcome::Stored(a), PutOutcome::Stored(_)] = put[..] else { panic!("{put:?}") };
    let slot_of_a = SLOT + u64::from(a.slot) * SLOT;
    let got = pool
        .get(&[
            // B into A's slot; B over the tier's last byte only; B into the spare room.
            GetBlock { key: key(2), dst: arena.id(), offset: slot_of_a, capacity: SLOT },
            GetBlock { key: key(2), dst: arena.id(), offset: 5 * SLOT - 1, capacity: SLOT },
            GetBlock { key: key(2), dst: arena.id(), offset: 0, capacity: SLOT },
        ])
        .unwrap();
    for o in &got[..2] {
        assert!(
            matches!(o, GetOutcome::Failed(BlockError::IntoTier { node: NODE, tier: DRAM })),
            "{got:?}"
        );
    }
    assert!(got[2].is_loaded(), "{got:?}");
    let dst = composite.register_memory(vec![0u8; SLOT as usize]).unwrap();
    let a_again = pool.get(&[GetBlock { key: key(1), dst: dst.id(), offset: 0, capacity: SLOT }]);
    assert!(a_again.unwrap()[0].is_loaded(), "A must survive");
    assert_eq!(dst.deregister(), bytes_of(1, SLOT));
    drop(pool);
    let arena = arena.deregister();
    assert_eq!(&arena[..SLOT as usize], &bytes_of(2, SLOT)[..]);
    assert_eq!(&arena[slot_of_a as usize..][..SLOT as usize], &bytes_of(1, SLOT)[..]);
}
