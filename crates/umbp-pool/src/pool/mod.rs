//! The pool's data path: keyed blocks in and out of tier slots over one [`Index`] and one
//! [`CompositeEngine`], so that no caller repeats reserve → offload → publish or
//! lookup → lease → restore → release.

mod resolver;

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umbp_composite::{
    start_offload, start_restore, Batch, CompositeBuilder, CompositeEngine, ObjectError,
    ObjectRange, ObjectTransfer, TransferReport,
};
use umbp_plan::{EndpointId, FailureCause, ObjectState};

pub use resolver::TierResolver;

use crate::{
    BlockKey, Error, Index, NodeAnnouncement, NodeId, Placement, Published, Reservation, Reserved,
    TierId, TierRegion, TierSpec,
};

/// How a [`Pool`] runs.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// This instance's node in the pool: the node of the tiers it adds and announces.
    pub node: NodeId,
    /// Where peers reach this node, announced with it (free-form; for a memory node its UCX
    /// server's address). Default: empty.
    pub address: String,
    /// How long a put's reservations last. A put whose transfer has not finished by three
    /// quarters of it is cancelled and aborted, so its late bytes never land in a slot the
    /// index handed to someone else. Default: 30 s.
    pub reservation_ttl: Duration,
    /// How long a get's lease lasts; a get whose transfer outlives half of it renews it.
    /// Default: 30 s.
    pub lease_ttl: Duration,
    /// How long this node's announcement lasts; a background thread renews it every third of
    /// it while the pool lives. Default: 10 s.
    pub announce_ttl: Duration,
}

impl PoolConfig {
    /// The defaults for node `node`.
    pub fn new(node: NodeId) -> Self {
        Self {
            node,
            address: String::new(),
            reservation_ttl: Duration::from_secs(30),
            lease_ttl: Duration::from_secs(30),
            announce_ttl: Duration::from_secs(10),
        }
    }
}

/// One block to [`put`](Pool::put): its key and where its bytes are (a range of a registered
/// endpoint of the pool's composite).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PutBlock {
    /// The block's key.
    pub key: BlockKey,
    /// The endpoint holding its bytes.
    pub src: EndpointId,
    /// Where they start inside it.
    pub offset: u64,
    /// How many (the block's length).
    pub len: u64,
}

/// One block to [`get`](Pool::get): its key and where its bytes go.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GetBlock {
    /// The block's key.
    pub key: BlockKey,
    /// The endpoint its bytes are written into.
    pub dst: EndpointId,
    /// Where they start inside it.
    pub offset: u64,
    /// How many bytes the destination has room for: a longer block fails
    /// ([`BlockError::TooSmall`]) and nothing of it is written.
    pub capacity: u64,
}

/// Why one block of a put or get failed. Each names only its block: the others of the call
/// have their own outcome.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BlockError {
    /// The index refused the block's reservation ([`Error::TooLarge`], [`Error::TierFull`],
    /// [`Error::UnknownTier`], [`Error::NodeNotAlive`]), or failed a call the block needed
    /// (its publish: whether that publish happened is unknown, and if it did, the bytes are
    /// right).
    #[error("index: {0}")]
    Index(Arc<Error>),
    /// The pool has no region for the tier: not added, and no [`TierResolver`] reaches it
    /// (or its node is not alive).
    #[error("tier {tier} of node {node} is not reachable from this pool")]
    Unreachable {
        /// The node.
        node: NodeId,
        /// The tier.
        tier: TierId,
    },
    /// The destination range is shorter than the block.
    #[error("the block has {len} bytes, its destination room for {capacity}")]
    TooSmall {
        /// The block's length.
        len: u64,
        /// The destination's room.
        capacity: u64,
    },
    /// The composite refused or failed the block's transfer (a deregistered endpoint, a dead
    /// peer, an I/O error, cancelled at the put's deadline).
    #[error("transfer: {0}")]
    Transfer(ObjectError),
    /// The composite refused the whole batch the block was in (a builder in use, its
    /// executor gone): nothing of the batch moved.
    #[error("transfer batch: {0}")]
    Batch(Arc<umbp_composite::Error>),
    /// The bytes loaded do not match the checksum recorded at publish: a load error, never
    /// a hit. `actual` is `None` where the composite could not hash them.
    #[error("checksum mismatch: recorded {expected:#010x}, loaded {actual:?}")]
    ChecksumMismatch {
        /// Recorded at publish.
        expected: u32,
        /// Of the bytes loaded, where known.
        actual: Option<u32>,
    },
    /// The put's transfer completed but the composite reported no checksum for it (its
    /// bytes never passed host memory): nothing to publish with, so nothing was published.
    #[error("the transfer reported no checksum to publish the block with")]
    NoChecksum,
    /// The reservation expired before the publish (the transfer outlived the reservation
    /// TTL): nothing was published.
    #[error("the reservation expired before the block was published")]
    Expired,
    /// The get's lease could not be renewed while its transfer ran: the slot may have been
    /// reused under it, so the bytes are not reported as a hit.
    #[error("the lease on the block's slot ended while it was loading")]
    LeaseLost,
    /// The get's destination range overlaps the slots of a tier this pool reaches (its own
    /// DRAM arena, say): loading there would overwrite other blocks of the pool, so nothing
    /// is written.
    #[error("the destination overlaps the slots of tier {tier} of node {node}")]
    IntoTier {
        /// The node of the tier.
        node: NodeId,
        /// The tier.
        tier: TierId,
    },
}

impl BlockError {
    fn index(e: Error) -> Self {
        Self::Index(Arc::new(e))
    }
}

/// The outcome of one block of a [`put`](Pool::put).
#[derive(Clone, Debug)]
pub enum PutOutcome {
    /// Written and published by this put.
    Stored(Placement),
    /// The key was already published (before this put, or by a writer that won the race):
    /// nothing of this put's bytes is visible.
    Present(Placement),
    /// Nothing was published for this block and its slot (if one was reserved) is free.
    Failed(BlockError),
}

impl PutOutcome {
    /// Whether the key is in the pool now (stored or present).
    pub fn is_in_pool(&self) -> bool {
        !matches!(self, Self::Failed(_))
    }
}

/// The outcome of one block of a [`get`](Pool::get).
#[derive(Clone, Debug)]
pub enum GetOutcome {
    /// Every byte of the block is in its destination and matched the recorded checksum.
    Loaded(Placement),
    /// Not in the pool (never published, removed, evicted, or its slot reused since the
    /// lookup): nothing was written.
    Miss,
    /// In the pool but not loaded: the destination range may hold some bytes, none of them
    /// to be used.
    Failed(BlockError),
}

impl GetOutcome {
    /// Whether every byte of the block arrived (and was verified).
    pub fn is_loaded(&self) -> bool {
        matches!(self, Self::Loaded(_))
    }
}

/// Counters of a [`Pool`], plain atomics that callers read (`Ordering::Relaxed` suffices).
#[derive(Debug, Default)]
pub struct PoolMetrics {
    /// Blocks loaded and verified.
    pub hits: AtomicU64,
    /// Blocks asked for and not in the pool (including stale ones).
    pub misses: AtomicU64,
    /// Of the misses: blocks found by the lookup whose slot had been evicted or reused by
    /// the time of the lease (a generation mismatch).
    pub stale: AtomicU64,
    /// Blocks whose loaded bytes did not match their recorded checksum.
    pub checksum_failures: AtomicU64,
    /// Blocks that were in the pool but failed to load for another reason (unreachable
    /// tier, failed transfer, destination too small, lease lost).
    pub get_failures: AtomicU64,
    /// Blocks written and published by a put.
    pub stored: AtomicU64,
    /// Blocks a put found already published.
    pub present: AtomicU64,
    /// Blocks a put failed to store (nothing published).
    pub put_failures: AtomicU64,
}

impl PoolMetrics {
    fn add(counter: &AtomicU64, n: u64) {
        if n > 0 {
            counter.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// A tier the pool reaches: its shape and where its slots are.
#[derive(Copy, Clone, Debug)]
struct Reach {
    spec: TierSpec,
    region: TierRegion,
}

/// Blocks a put reserves, writes and publishes (or a get leases, loads and releases) in one
/// step of its pipeline, at most: a large put or get is cut into chunks of up to this many.
const PIPELINE_CHUNK: usize = 1024;

/// Chunks of a put whose transfers are in flight at once, at most (the newest started, the
/// oldest waited for and published): see `Inner::put`.
const PUT_IN_FLIGHT: usize = 3;

/// Blocks of a pipeline's first and last chunks: the first chunk's reservation (or lease) and
/// the last one's publish (or release) overlap no transfer, so they are kept short.
const PIPELINE_EDGE: usize = PIPELINE_CHUNK / 4;

/// The chunks of a put or get of `n` blocks, in order: all in one up to `2 * PIPELINE_EDGE`
/// blocks; else `PIPELINE_EDGE` blocks, the middle in equal chunks of at most
/// `PIPELINE_CHUNK`, and `PIPELINE_EDGE` blocks.
fn pipeline_chunks(n: usize) -> Vec<Range<usize>> {
    if n <= 2 * PIPELINE_EDGE {
        return vec![Range { start: 0, end: n }];
    }
    let middle = n - 2 * PIPELINE_EDGE;
    let parts = middle.div_ceil(PIPELINE_CHUNK);
    let mut out = Vec::with_capacity(parts + 2);
    out.push(0..PIPELINE_EDGE);
    let mut at = PIPELINE_EDGE;
    for p in 0..parts {
        let len = middle / parts + usize::from(p < middle % parts);
        out.push(at..at + len);
        at += len;
    }
    out.push(at..n);
    out
}

/// One chunk of a get whose bytes are moving: its leased loads (position in the get, placement,
/// tier), its lease, and the restore batch (with the builder to recycle) or why it did not
/// start; `None` when it did not start because nothing was granted or the lease was lost.
struct Loading {
    loads: Vec<(usize, Placement, Reach)>,
    lease: u64,
    /// When the lease was last known to hold: when it was taken, or when a renewal that
    /// succeeded was asked (a renewal only extends a lease that has not ended).
    held_at: Instant,
    /// The lease ended before a renewal: nothing the chunk loads is a hit.
    lost: bool,
    batch: Option<Result<(CompositeBuilder, Batch), Arc<umbp_composite::Error>>>,
}

impl Loading {
    /// Whether its lease must be kept: its batch runs and the lease has not ended.
    fn running(&self) -> bool {
        !self.lost && matches!(self.batch, Some(Ok(_)))
    }
}

/// One chunk of a put whose bytes are moving: its reservations, the offload batch (with the
/// builder to recycle) or why it did not start, and when it was reserved.
struct Writing {
    writes: Vec<(usize, Reservation)>,
    batch: Result<(CompositeBuilder, Batch), Arc<umbp_composite::Error>>,
    reserved_at: Instant,
}

struct Inner {
    index: Arc<dyn Index>,
    composite: CompositeEngine,
    config: PoolConfig,
    /// Tiers added by [`Pool::add_tier`].
    local: RwLock<HashMap<(NodeId, TierId), Reach>>,
    /// Tiers of other nodes, as the resolver answered.
    resolved: RwLock<HashMap<(NodeId, TierId), Reach>>,
    resolver: Option<Arc<dyn TierResolver>>,
    metrics: PoolMetrics,
    /// Idle builders, reused by calls (one per call in flight).
    builders: Mutex<Vec<CompositeBuilder>>,
}

/// The pool's data path over one [`Index`] and one [`CompositeEngine`]: puts and gets of
/// keyed blocks between registered memory and tier slots, with every rule of the index kept
/// (see the [crate] docs) and one outcome per block.
///
/// - [`put`](Self::put): one `reserve_many`, one offload batch into the reserved slots, one
///   `publish` with the CRC32C the composite reported for each block; a block whose transfer
///   failed (or whose reservation expired) is aborted and publishes nothing.
/// - [`get`](Self::get): one lookup, one lease, one restore batch in which each block's
///   recorded checksum is verified, one release. A stale placement is a miss, a checksum
///   mismatch a failure (never a hit; the key is removed from the pool, so later gets miss
///   it); a failed read (a dead peer) costs only its blocks.
///
/// Both run large batches (more than 512 blocks) as a pipeline of chunks, the index's calls
/// for one chunk made while another chunk's bytes move.
///
/// The composite's [`ChecksumPolicy`](umbp_composite::ChecksumPolicy) must cover every tier
/// the pool uses ([`add_tier`](Self::add_tier) refuses one it does not): a block is published
/// only with a checksum, and loaded only when verified.
///
/// While the pool lives, a background thread renews this node's announcement (every third
/// of [`PoolConfig::announce_ttl`]); dropping the pool stops it.
pub struct Pool {
    inner: Arc<Inner>,
    /// Dropped to stop the announcer.
    stop: Mutex<Option<mpsc::Sender<()>>>,
    announcer: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

impl Pool {
    /// A pool over `index` and `composite` for node `config.node`, with no tiers yet and no
    /// resolver. Announces the node once now (an error here is the index's), then renews the
    /// announcement from a background thread.
    pub fn new(
        index: Arc<dyn Index>,
        composite: CompositeEngine,
        config: PoolConfig,
    ) -> Result<Self, Error> {
        Self::with_resolver(index, composite, config, None)
    }

    /// [`new`](Self::new), reaching other nodes' tiers through `resolver`.
    pub fn with_resolver(
        index: Arc<dyn Index>,
        composite: CompositeEngine,
        config: PoolConfig,
        resolver: Option<Arc<dyn TierResolver>>,
    ) -> Result<Self, Error> {
        for (what, ttl) in [
            ("reservation_ttl", config.reservation_ttl),
            ("lease_ttl", config.lease_ttl),
            ("announce_ttl", config.announce_ttl),
        ] {
            if ttl < Duration::from_millis(3) {
                return Err(Error::InvalidConfig(format!("{what} must be at least 3 ms")));
            }
        }
        let inner = Arc::new(Inner {
            index,
            composite,
            config,
            local: RwLock::new(HashMap::new()),
            resolved: RwLock::new(HashMap::new()),
            resolver,
            metrics: PoolMetrics::default(),
            builders: Mutex::new(Vec::new()),
        });
        inner.announce()?;
        let (stop, stopped) = mpsc::channel::<()>();
        let every = inner.config.announce_ttl / 3;
        let weak = Arc::downgrade(&inner);
        let announcer = std::thread::Builder::new()
            .name(format!("umbp-pool-announce-{}", inner.config.node))
            .spawn(move || loop {
                match stopped.recv_timeout(every) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                if let Err(e) = inner.announce() {
                    tracing::warn!(node = inner.config.node.0, error = %e, "pool: announcement not renewed");
                }
            })
            .map_err(|e| Error::InvalidConfig(format!("cannot start the announcer: {e}")))?;
        Ok(Self { inner, stop: Mutex::new(Some(stop)), announcer: Mutex::new(Some(announcer)) })
    }

    /// The index.
    pub fn index(&self) -> &Arc<dyn Index> {
        &self.inner.index
    }

    /// The composite.
    pub fn composite(&self) -> &CompositeEngine {
        &self.inner.composite
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// The counters.
    pub fn metrics(&self) -> &PoolMetrics {
        &self.inner.metrics
    }

    /// Adds a tier this process reaches through `region` (its DRAM arena, its SSD file, or
    /// another node's region it registered itself), registering `spec` with the index, and
    /// announces the node again with it.
    ///
    /// A volatile tier of this pool's node starts empty: blocks the index still lists on it
    /// (this node restarted before its announcement expired) are dropped, since the region
    /// is new. A durable tier keeps them (see `EmbeddedIndex::reconcile`).
    ///
    /// Errors: [`Error::InvalidConfig`] when the region's slot size is not the spec's, its
    /// endpoint is not registered with the composite, is shorter than the tier, or is a
    /// tier kind the composite's checksum policy does not cover; the index's
    /// ([`Error::TierConflict`]...).
    pub fn add_tier(&self, spec: TierSpec, region: TierRegion) -> Result<(), Error> {
        self.inner.check_region(&spec, &region)?;
        self.inner.index.register_tier(&spec)?;
        if !spec.durable && spec.node == self.inner.config.node {
            // A volatile tier's bytes did not outlive the process that wrote them: blocks the
            // index still lists on it are an earlier life's (this node restarted before its
            // announcement expired), and the fresh region holds none of them.
            let stale = self.inner.index.evict(spec.node, spec.tier, spec.slot_count)?;
            if stale > 0 {
                tracing::info!(
                    node = spec.node.0,
                    tier = spec.tier.0,
                    blocks = stale,
                    "pool: dropped an earlier life's blocks of a volatile tier"
                );
            }
        }
        write(&self.inner.local).insert((spec.node, spec.tier), Reach { spec, region });
        self.inner.announce()
    }

    /// Announces this node now (its address and its tiers' free bytes), as the background
    /// thread does.
    pub fn announce(&self) -> Result<(), Error> {
        self.inner.announce()
    }

    /// Leaves the pool now, for a planned stop: stops renewing the announcement and withdraws
    /// the node ([`Index::leave`]), so that readers miss its blocks at once instead of failing
    /// their loads until the announcement expires. On Redis its placements are dropped and
    /// later puts to its tiers fail ([`Error::NodeNotAlive`]); a new pool of the node rejoins
    /// empty. Returns whether the node was alive.
    pub fn leave(&self) -> Result<bool, Error> {
        // The announcer ends first: an announcement of its after the leave would bring the
        // node back.
        self.stop_announcing();
        self.inner.index.leave(self.inner.config.node)
    }

    /// Stops the announcer and waits for it (at most one index call in flight).
    fn stop_announcing(&self) {
        drop(self.stop.lock().unwrap_or_else(PoisonError::into_inner).take());
        let thread = self.announcer.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }

    /// Stores `blocks` in tier `tier` of this node ([`put_on`](Self::put_on)).
    pub fn put(&self, tier: TierId, blocks: &[PutBlock]) -> Result<Vec<PutOutcome>, Error> {
        self.put_on(self.inner.config.node, tier, blocks)
    }

    /// Stores `blocks` in tier `tier` of node `node` (one added with
    /// [`add_tier`](Self::add_tier), or one the resolver reaches): one `reserve_many`, one
    /// offload batch, one `publish`. One outcome per block, in order.
    ///
    /// More than 512 blocks run as a pipeline of chunks (the first and the last 256 blocks,
    /// the rest in equal chunks of at most 1,024), each reserved, written and published as
    /// above, the next chunk reserved and the oldest one published while chunks' bytes move
    /// (at most three chunks' transfers at once).
    ///
    /// `Err` only when the first reservation call failed (the index is unreachable): then
    /// nothing was reserved or written. When a later chunk's reservation call fails, the
    /// chunks before it are stored as usual and the blocks of that chunk and every later one
    /// fail with [`BlockError::Index`].
    pub fn put_on(
        &self,
        node: NodeId,
        tier: TierId,
        blocks: &[PutBlock],
    ) -> Result<Vec<PutOutcome>, Error> {
        self.inner.put(node, tier, blocks)
    }

    /// Loads `blocks` from wherever the pool holds them: one lookup, one lease, one restore
    /// batch verifying each block's checksum, one release. One outcome per block, in order.
    ///
    /// More than 512 blocks found run as a pipeline of chunks cut as a put's, each leased,
    /// restored and released as above: the next chunk is leased while a chunk's bytes move
    /// and started before that chunk is waited for (two chunks' transfers at a time).
    ///
    /// A lease lasts [`PoolConfig::lease_ttl`] and is renewed while its transfer runs, and
    /// while the chunk ahead of it is waited for.
    /// `Err` only when the lookup or the first lease call itself failed (the index is
    /// unreachable): then nothing was written. When a later chunk's lease call fails, the
    /// chunks before it load as usual and the blocks of that chunk and every later one fail
    /// with [`BlockError::Index`].
    pub fn get(&self, blocks: &[GetBlock]) -> Result<Vec<GetOutcome>, Error> {
        self.inner.get(blocks)
    }

    /// Whether each key is published (one lookup).
    pub fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>, Error> {
        Ok(self.inner.index.lookup(keys)?.iter().map(Option::is_some).collect())
    }

    /// The placement of each key (one lookup).
    pub fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<Option<Placement>>, Error> {
        self.inner.index.lookup(keys)
    }

    /// How many of `keys`, from the first, are published.
    pub fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Error> {
        self.inner.index.prefix_hits(keys)
    }

    /// Removes keys from the pool ([`Index::remove`]).
    pub fn remove(&self, keys: &[BlockKey]) -> Result<Vec<crate::Removed>, Error> {
        self.inner.index.remove(keys)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop_announcing();
    }
}

impl Inner {
    fn check_region(&self, spec: &TierSpec, region: &TierRegion) -> Result<(), Error> {
        if region.slot_size != spec.slot_size {
            return Err(Error::InvalidConfig(format!(
                "tier {} of node {}: the region's slot size {} is not the spec's {}",
                spec.tier, spec.node, region.slot_size, spec.slot_size
            )));
        }
        let endpoint = self.composite.registry().get(region.endpoint).ok_or_else(|| {
            Error::InvalidConfig(format!(
                "tier {} of node {}: endpoint {:?} is not registered with the pool's composite",
                spec.tier, spec.node, region.endpoint
            ))
        })?;
        let size = spec.slot_size.checked_mul(u64::from(spec.slot_count));
        if !size.is_some_and(|size| endpoint.contains(region.base, size)) {
            return Err(Error::InvalidConfig(format!(
                "tier {} of node {}: {} slots of {} bytes at {} do not fit its endpoint's {} bytes",
                spec.tier,
                spec.node,
                spec.slot_count,
                spec.slot_size,
                region.base,
                endpoint.len()
            )));
        }
        let policy = self.composite.config().checksums;
        if !policy.covers(&endpoint) {
            return Err(Error::InvalidConfig(format!(
                "tier {} of node {}: the composite's checksum policy `{}` does not cover its \
                 endpoint ({:?}); the pool publishes and loads only checksummed blocks",
                spec.tier,
                spec.node,
                policy.name(),
                endpoint.kind()
            )));
        }
        Ok(())
    }

    fn announce(&self) -> Result<(), Error> {
        let tiers: Vec<Reach> = read(&self.local)
            .values()
            .filter(|r| r.spec.node == self.config.node)
            .copied()
            .collect();
        let mut free = Vec::with_capacity(tiers.len());
        for r in tiers {
            let stats = match self.index.tier_stats(r.spec.node, r.spec.tier) {
                // The index forgot the tier (a Redis server restarted empty): register it
                // again, or the node would never be announced again and every put to it
                // would find it dead.
                Err(Error::UnknownTier { .. }) => {
                    self.index.register_tier(&r.spec)?;
                    self.index.tier_stats(r.spec.node, r.spec.tier)?
                }
                other => other?,
            };
            free.push((r.spec.tier, u64::from(stats.free).saturating_mul(r.spec.slot_size)));
        }
        free.sort_by_key(|t| t.0);
        let a = NodeAnnouncement {
            node: self.config.node,
            address: self.config.address.clone(),
            tiers: free,
        };
        self.index.announce(&a, self.config.announce_ttl)
    }

    fn builder(&self) -> CompositeBuilder {
        let idle = self.builders.lock().unwrap_or_else(PoisonError::into_inner).pop();
        idle.unwrap_or_else(|| self.composite.builder())
    }

    fn recycle(&self, mut builder: CompositeBuilder, batch: Batch) {
        builder.recycle(batch.into_plans());
        self.builders.lock().unwrap_or_else(PoisonError::into_inner).push(builder);
    }

    /// The tier's region: one added, one resolved before, or one the resolver finds now
    /// (`nodes` is the alive nodes, fetched once per call when first needed).
    fn reach(
        &self,
        node: NodeId,
        tier: TierId,
        nodes: &mut Option<Vec<NodeAnnouncement>>,
    ) -> Result<Option<Reach>, Error> {
        if let Some(r) = read(&self.local).get(&(node, tier)) {
            return Ok(Some(*r));
        }
        let Some(resolver) = &self.resolver else { return Ok(None) };
        let cached = read(&self.resolved).get(&(node, tier)).copied();
        if let Some(r) = cached {
            if resolver.is_current(node, &r.region) {
                return Ok(Some(r));
            }
            // The resolver knows the region is gone (its peer died or moved): resolve again
            // now rather than fail a transfer through it first.
            self.forget(node, tier, &r.region);
        }
        if nodes.is_none() {
            *nodes = Some(self.index.nodes()?);
        }
        let Some(a) = nodes.iter().flatten().find(|a| a.node == node) else { return Ok(None) };
        let Some(spec) = self.index.tier_spec(node, tier)? else { return Ok(None) };
        let Some(region) = resolver.resolve(a, &spec) else { return Ok(None) };
        if let Err(e) = self.check_region(&spec, &region) {
            tracing::warn!(node = node.0, tier = tier.0, error = %e, "pool: resolver's region refused");
            resolver.forget(&spec);
            return Ok(None);
        }
        let reach = Reach { spec, region };
        // Two gets may resolve at once: the first one kept wins, the other is forgotten.
        let mut resolved = write(&self.resolved);
        let kept = *resolved.entry((node, tier)).or_insert(reach);
        if kept.region != region {
            drop(resolved);
            resolver.forget(&spec);
        }
        Ok(Some(kept))
    }

    /// The tier (added or resolved) whose slots `b`'s destination range overlaps, if any.
    fn tier_under(&self, b: &GetBlock) -> Option<(NodeId, TierId)> {
        let end = b.offset.saturating_add(b.capacity);
        let overlaps = |r: &Reach| {
            let size = r.spec.slot_size.saturating_mul(u64::from(r.spec.slot_count));
            r.region.endpoint == b.dst
                && b.offset < r.region.base.saturating_add(size)
                && r.region.base < end
        };
        [&self.local, &self.resolved].into_iter().find_map(|m| {
            read(m).values().find(|r| overlaps(r)).map(|r| (r.spec.node, r.spec.tier))
        })
    }

    /// Drops a resolved region after a transfer through it failed: the next get resolves
    /// again (a restarted node, a new connection).
    fn forget(&self, node: NodeId, tier: TierId, region: &TierRegion) {
        let mut resolved = write(&self.resolved);
        let Some(r) = resolved.get(&(node, tier)).copied() else { return };
        if r.region != *region {
            return;
        }
        resolved.remove(&(node, tier));
        drop(resolved);
        if let Some(resolver) = &self.resolver {
            resolver.forget(&r.spec);
        }
    }

    fn put(
        &self,
        node: NodeId,
        tier: TierId,
        blocks: &[PutBlock],
    ) -> Result<Vec<PutOutcome>, Error> {
        let m = &self.metrics;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let Some(reach) = self.reach(node, tier, &mut None)? else {
            PoolMetrics::add(&m.put_failures, blocks.len() as u64);
            return Ok(blocks
                .iter()
                .map(|_| PutOutcome::Failed(BlockError::Unreachable { node, tier }))
                .collect());
        };
        let items: Vec<(BlockKey, u64)> = blocks.iter().map(|b| (b.key, b.len)).collect();
        let mut out: Vec<Option<PutOutcome>> = vec![None; blocks.len()];
        // A large put runs as a pipeline of chunks: while chunks' bytes move, the next chunk
        // is reserved and the oldest one published, so the index's round trips overlap the
        // transfer instead of adding to it. At most `PUT_IN_FLIGHT` chunks' transfers are in
        // flight, so the engine has a chunk queued behind the one it moves while the caller
        // waits on the index.
        let mut in_flight: VecDeque<Writing> = VecDeque::with_capacity(PUT_IN_FLIGHT);
        for (c, Range { start, end }) in pipeline_chunks(blocks.len()).into_iter().enumerate() {
            let reserved_at = Instant::now();
            let reserved = match self.index.reserve_many(
                node,
                tier,
                &items[start..end],
                self.config.reservation_ttl,
            ) {
                Ok(r) if r.len() == end - start => r,
                answer => {
                    let e = match answer {
                        Err(e) => e,
                        Ok(r) => Error::Corrupt(format!(
                            "reserve_many answered {} items for {}",
                            r.len(),
                            end - start
                        )),
                    };
                    if c == 0 {
                        // Nothing was reserved or written.
                        return Err(e);
                    }
                    // Earlier chunks went their way; this one and the rest fail.
                    let e = Arc::new(e);
                    for o in &mut out[start..] {
                        *o = Some(PutOutcome::Failed(BlockError::Index(e.clone())));
                    }
                    break;
                }
            };
            // (position in `blocks`, reservation) of the slots to write.
            let mut writes: Vec<(usize, Reservation)> = Vec::new();
            for (i, r) in (start..end).zip(reserved) {
                out[i] = match r {
                    Ok(Reserved::Slot(r)) => {
                        writes.push((i, r));
                        None
                    }
                    Ok(Reserved::Present(p)) => Some(PutOutcome::Present(p)),
                    Err(e) => Some(PutOutcome::Failed(BlockError::index(e))),
                };
            }
            if !writes.is_empty() {
                in_flight.push_back(self.start_write(&reach, blocks, writes, reserved_at));
            }
            while in_flight.len() >= PUT_IN_FLIGHT {
                let oldest = in_flight.pop_front().expect("in flight");
                self.finish_write(oldest, &mut out);
            }
        }
        for last in in_flight {
            self.finish_write(last, &mut out);
        }
        let out: Vec<PutOutcome> =
            out.into_iter().map(|o| o.unwrap_or(PutOutcome::Failed(BlockError::Expired))).collect();
        for o in &out {
            PoolMetrics::add(
                match o {
                    PutOutcome::Stored(_) => &m.stored,
                    PutOutcome::Present(_) => &m.present,
                    PutOutcome::Failed(_) => &m.put_failures,
                },
                1,
            );
        }
        Ok(out)
    }

    /// Starts offloading each reserved block into its slot.
    fn start_write(
        &self,
        reach: &Reach,
        blocks: &[PutBlock],
        writes: Vec<(usize, Reservation)>,
        reserved_at: Instant,
    ) -> Writing {
        let mut pages = vec![[0u64; 1]; writes.len()];
        let ranges: Vec<[ObjectRange; 1]> = writes
            .iter()
            .map(|&(i, _)| [ObjectRange::new(0, blocks[i].len, blocks[i].src, blocks[i].offset)])
            .collect();
        let objects: Vec<ObjectTransfer<'_>> = writes
            .iter()
            .zip(pages.iter_mut())
            .zip(&ranges)
            .enumerate()
            .map(|(tag, ((&(_, r), page), range))| {
                ObjectTransfer::new(tag as u64, reach.region.object(r.slot, r.len, page), range)
            })
            .collect();
        let mut builder = self.builder();
        let batch = match start_offload(&mut builder, &objects) {
            Ok(batch) => Ok((builder, batch)),
            Err(e) => Err(Arc::new(e)),
        };
        Writing { writes, batch, reserved_at }
    }

    /// Waits for a write started by [`start_write`](Self::start_write), publishes the blocks
    /// that landed with their checksum, aborts the others; fills `out` at each write's
    /// position.
    fn finish_write(&self, writing: Writing, out: &mut [Option<PutOutcome>]) {
        let Writing { writes, batch, reserved_at } = writing;
        // The transfer must end well before the reservations do: bytes landing after the
        // index freed the slot could overwrite the next holder's.
        let deadline = (self.config.reservation_ttl * 3 / 4).saturating_sub(reserved_at.elapsed());
        let report = batch.map(|(builder, batch)| {
            let report = batch.wait_timeout(deadline).unwrap_or_else(|| batch.cancel());
            self.recycle(builder, batch);
            report
        });
        let mut publish: Vec<(Reservation, u32)> = Vec::with_capacity(writes.len());
        let mut published_at: Vec<usize> = Vec::with_capacity(writes.len());
        let mut aborts: Vec<Reservation> = Vec::new();
        for (tag, &(i, r)) in writes.iter().enumerate() {
            let failed = match &report {
                Err(e) => BlockError::Batch(e.clone()),
                Ok(report) => match object_outcome(report, tag) {
                    Ok(Some(crc)) => {
                        publish.push((r, crc));
                        published_at.push(i);
                        continue;
                    }
                    Ok(None) => BlockError::NoChecksum,
                    Err(e) => e,
                },
            };
            aborts.push(r);
            out[i] = Some(PutOutcome::Failed(failed));
        }
        if !publish.is_empty() {
            match self.index.publish(&publish) {
                Ok(answers) if answers.len() == publish.len() => {
                    for (&i, answer) in published_at.iter().zip(answers) {
                        out[i] = Some(match answer {
                            Published::Won(p) => PutOutcome::Stored(p),
                            Published::Lost { winner } => PutOutcome::Present(winner),
                            Published::Expired => PutOutcome::Failed(BlockError::Expired),
                        });
                    }
                }
                answer => {
                    // Unknown whether they were published (a lost answer): abort leaves a
                    // published one alone, and its bytes are right.
                    let e = Arc::new(match answer {
                        Err(e) => e,
                        Ok(a) => Error::Corrupt(format!(
                            "publish answered {} items for {}",
                            a.len(),
                            publish.len()
                        )),
                    });
                    for &i in &published_at {
                        out[i] = Some(PutOutcome::Failed(BlockError::Index(e.clone())));
                    }
                    aborts.extend(publish.iter().map(|&(r, _)| r));
                }
            }
        }
        if !aborts.is_empty() {
            if let Err(e) = self.index.abort(&aborts) {
                // The reservations expire by themselves: the slots come back then.
                tracing::warn!(blocks = aborts.len(), error = %e, "pool: abort failed; the reservations will expire");
            }
        }
    }

    fn get(&self, blocks: &[GetBlock]) -> Result<Vec<GetOutcome>, Error> {
        let m = &self.metrics;
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.key).collect();
        let found = self.index.lookup(&keys)?;
        if found.len() != blocks.len() {
            return Err(Error::Corrupt(format!(
                "lookup answered {} keys for {}",
                found.len(),
                blocks.len()
            )));
        }
        let mut out: Vec<Option<GetOutcome>> = Vec::with_capacity(blocks.len());
        // (position, placement, reach) of the blocks to lease and load.
        let mut loads: Vec<(usize, Placement, Reach)> = Vec::new();
        let mut nodes = None;
        for (i, (b, p)) in blocks.iter().zip(found).enumerate() {
            if let Some((node, tier)) = self.tier_under(b) {
                out.push(Some(GetOutcome::Failed(BlockError::IntoTier { node, tier })));
                continue;
            }
            let Some(p) = p else {
                out.push(Some(GetOutcome::Miss));
                continue;
            };
            if p.len > b.capacity {
                out.push(Some(GetOutcome::Failed(BlockError::TooSmall {
                    len: p.len,
                    capacity: b.capacity,
                })));
                continue;
            }
            match self.reach(p.node, p.tier, &mut nodes) {
                Ok(Some(r)) => {
                    loads.push((i, p, r));
                    out.push(None);
                }
                Ok(None) => out.push(Some(GetOutcome::Failed(BlockError::Unreachable {
                    node: p.node,
                    tier: p.tier,
                }))),
                Err(e) => out.push(Some(GetOutcome::Failed(BlockError::index(e)))),
            }
        }
        if !loads.is_empty() {
            // A large get runs as a pipeline of chunks, as a put does: the next chunk is
            // leased while a chunk's bytes move, and started before the chunk ahead of it is
            // waited for, so the index's round trips (a lease of 4,096 blocks is milliseconds
            // of Redis) and the next batch's planning overlap the transfer instead of adding
            // to it, and the engine never drains between chunks. At most two chunks'
            // transfers are in flight, each chunk under a lease of its own.
            let mut running: Option<Loading> = None;
            for (c, range) in pipeline_chunks(loads.len()).into_iter().enumerate() {
                let chunk = &loads[range.clone()];
                let placements: Vec<Placement> = chunk.iter().map(|l| l.1).collect();
                let lease = match self.index.lease(&placements, self.config.lease_ttl) {
                    Ok(lease) => lease,
                    // Nothing was leased or written.
                    Err(e) if c == 0 => return Err(e),
                    Err(e) => {
                        // Earlier chunks go their way; this one and the rest fail.
                        let e = Arc::new(e);
                        for l in &loads[range.start..] {
                            out[l.0] = Some(GetOutcome::Failed(BlockError::Index(e.clone())));
                        }
                        break;
                    }
                };
                let leased_at = Instant::now();
                let granted: Vec<(usize, Placement, Reach)> = chunk
                    .iter()
                    .zip(lease.granted.iter().copied().chain(std::iter::repeat(false)))
                    .filter_map(|(l, g)| {
                        if !g {
                            PoolMetrics::add(&m.stale, 1);
                            out[l.0] = Some(GetOutcome::Miss);
                        }
                        g.then_some(*l)
                    })
                    .collect();
                let previous =
                    running.replace(self.start_load(blocks, granted, lease.id, leased_at));
                if let Some(previous) = previous {
                    let id = self.finish_load(previous, running.as_mut(), &mut out);
                    self.release(id);
                }
            }
            if let Some(last) = running {
                let id = self.finish_load(last, None, &mut out);
                self.release(id);
            }
            // A block whose bytes no longer match its checksum leaves the pool, so it is not
            // found (and failed) again: a miss from now on. Removing is always safe; a key
            // published again meanwhile loses only a good copy.
            let corrupt: Vec<BlockKey> = loads
                .iter()
                .filter(|l| {
                    matches!(
                        out[l.0],
                        Some(GetOutcome::Failed(BlockError::ChecksumMismatch { .. }))
                    )
                })
                .map(|l| l.1.key)
                .collect();
            if !corrupt.is_empty() {
                tracing::warn!(
                    blocks = corrupt.len(),
                    "pool: blocks failed their checksum; removed"
                );
                if let Err(e) = self.index.remove(&corrupt) {
                    tracing::warn!(error = %e, "pool: removing blocks that failed their checksum failed");
                }
            }
        }
        let out: Vec<GetOutcome> = out.into_iter().map(|o| o.unwrap_or(GetOutcome::Miss)).collect();
        for o in &out {
            match o {
                GetOutcome::Loaded(_) => PoolMetrics::add(&m.hits, 1),
                GetOutcome::Miss => PoolMetrics::add(&m.misses, 1),
                GetOutcome::Failed(BlockError::ChecksumMismatch { .. }) => {
                    PoolMetrics::add(&m.checksum_failures, 1)
                }
                GetOutcome::Failed(_) => PoolMetrics::add(&m.get_failures, 1),
            }
        }
        Ok(out)
    }

    /// Starts restoring a chunk's leased blocks (renewing the lease first if it is half
    /// gone: it was taken while the chunk before ran).
    fn start_load(
        &self,
        blocks: &[GetBlock],
        loads: Vec<(usize, Placement, Reach)>,
        lease: u64,
        leased_at: Instant,
    ) -> Loading {
        let mut loading = Loading { loads, lease, held_at: leased_at, lost: false, batch: None };
        if loading.loads.is_empty()
            || leased_at.elapsed() >= self.config.lease_ttl / 2
                && !self.renew(lease, &mut loading.held_at)
        {
            return loading;
        }
        let mut pages = vec![[0u64; 1]; loading.loads.len()];
        let ranges: Vec<[ObjectRange; 1]> = loading
            .loads
            .iter()
            .map(|&(i, p, _)| [ObjectRange::new(0, p.len, blocks[i].dst, blocks[i].offset)])
            .collect();
        let objects: Vec<ObjectTransfer<'_>> = loading
            .loads
            .iter()
            .zip(pages.iter_mut())
            .zip(&ranges)
            .enumerate()
            .map(|(tag, ((&(_, p, r), page), range))| {
                ObjectTransfer::new(tag as u64, r.region.object(p.slot, p.len, page), range)
                    .with_checksum(p.checksum)
            })
            .collect();
        let mut builder = self.builder();
        loading.batch = Some(match start_restore(&mut builder, &objects) {
            Ok(batch) => Ok((builder, batch)),
            Err(e) => Err(Arc::new(e)),
        });
        loading
    }

    /// Waits for a chunk started by [`start_load`](Self::start_load), renewing its lease
    /// while the batch runs, and the lease of the chunk started `behind` it (whose transfer
    /// waits behind this one's); fills `out` at each load's position. Returns the lease to
    /// release.
    fn finish_load(
        &self,
        loading: Loading,
        mut behind: Option<&mut Loading>,
        out: &mut [Option<GetOutcome>],
    ) -> u64 {
        let Loading { loads, lease, mut held_at, mut lost, batch } = loading;
        // A lease is renewed half a TTL after it was last known to hold, and a report is
        // trusted only if it came before then or a renewal after it succeeded: every block
        // called loaded was read under its lease.
        let due = |held_at: Instant| held_at + self.config.lease_ttl / 2;
        let report = batch.map(|batch| {
            batch.map(|(builder, batch)| {
                let report = loop {
                    if lost {
                        // Not protected any more: whatever arrives is not a hit. Cancel, so
                        // the batch ends now.
                        break batch.cancel();
                    }
                    let mut wake = due(held_at);
                    if let Some(b) = behind.as_deref().filter(|b| b.running()) {
                        wake = wake.min(due(b.held_at));
                    }
                    let report = batch.wait_timeout(wake.saturating_duration_since(Instant::now()));
                    let now = Instant::now();
                    lost = now >= due(held_at) && !self.renew(lease, &mut held_at);
                    if let Some(report) = report {
                        break report;
                    }
                    if let Some(b) = behind.as_deref_mut().filter(|b| b.running()) {
                        if now >= due(b.held_at) {
                            b.lost = !self.renew(b.lease, &mut b.held_at);
                        }
                    }
                    tracing::debug!(lease, "pool: a long get renewed its leases as they came due");
                };
                self.recycle(builder, batch);
                report
            })
        });
        for (tag, &(i, p, r)) in loads.iter().enumerate() {
            let outcome = match &report {
                // Not started (its lease was lost first), or cancelled when it was lost.
                None => GetOutcome::Failed(BlockError::LeaseLost),
                Some(_) if lost => GetOutcome::Failed(BlockError::LeaseLost),
                Some(Err(e)) => GetOutcome::Failed(BlockError::Batch(e.clone())),
                Some(Ok(report)) => match object_outcome(report, tag) {
                    Ok(Some(crc)) if crc == p.checksum => GetOutcome::Loaded(p),
                    Ok(actual) => GetOutcome::Failed(BlockError::ChecksumMismatch {
                        expected: p.checksum,
                        actual,
                    }),
                    Err(e) => {
                        if matches!(e, BlockError::Transfer(_)) {
                            self.forget(p.node, p.tier, &r.region);
                        }
                        GetOutcome::Failed(e)
                    }
                },
            };
            out[i] = Some(outcome);
        }
        lease
    }

    /// Renews `lease`; if it still held, `held_at` becomes when the renewal was asked.
    fn renew(&self, lease: u64, held_at: &mut Instant) -> bool {
        let asked = Instant::now();
        let held = self.index.renew(lease, self.config.lease_ttl).is_ok();
        if held {
            *held_at = asked;
        }
        held
    }

    /// Ends a lease; one that fails to end expires by itself.
    fn release(&self, lease: u64) {
        if let Err(e) = self.index.release(lease) {
            tracing::warn!(lease, error = %e, "pool: release failed; the lease will expire");
        }
    }
}

/// Object `tag`'s result: `Ok(checksum)` when it completed, else why not.
fn object_outcome(report: &TransferReport, tag: usize) -> Result<Option<u32>, BlockError> {
    let Some(o) = report.objects.get(tag) else {
        return Err(BlockError::Transfer(ObjectError::Cancelled));
    };
    match (o.state, &o.error) {
        (ObjectState::Completed, _) => Ok(o.checksum),
        (
            _,
            Some(ObjectError::Failed {
                cause: FailureCause::ChecksumMismatch { expected, actual },
                ..
            }),
        ) => Err(BlockError::ChecksumMismatch { expected: *expected, actual: Some(*actual) }),
        (
            _,
            Some(ObjectError::Failed {
                cause: FailureCause::ChecksumUnverifiable { expected },
                ..
            }),
        ) => Err(BlockError::ChecksumMismatch { expected: *expected, actual: None }),
        (_, Some(e)) => Err(BlockError::Transfer(e.clone())),
        (_, None) => Err(BlockError::Transfer(ObjectError::Cancelled)),
    }
}

#[cfg(test)]
mod tests {
    use super::{pipeline_chunks, PIPELINE_CHUNK, PIPELINE_EDGE};

    /// Every size: the chunks cover the blocks in order, none empty or above
    /// `PIPELINE_CHUNK`, and a batch cut at all starts and ends with `PIPELINE_EDGE` blocks.
    #[test]
    fn pipeline_chunks_cover_each_block_once_with_short_ends() {
        for n in 1..6 * PIPELINE_CHUNK {
            let chunks = pipeline_chunks(n);
            let mut at = 0;
            for c in &chunks {
                assert_eq!(c.start, at, "n = {n}: {chunks:?}");
                assert!(!c.is_empty() && c.len() <= PIPELINE_CHUNK, "n = {n}: {chunks:?}");
                at = c.end;
            }
            assert_eq!(at, n);
            if n > 2 * PIPELINE_EDGE {
                assert_eq!(chunks[0].len(), PIPELINE_EDGE);
                assert_eq!(chunks[chunks.len() - 1].len(), PIPELINE_EDGE);
            } else {
                assert_eq!(chunks.len(), 1);
            }
        }
        assert_eq!(
            pipeline_chunks(4096).iter().map(|c| c.len()).collect::<Vec<_>>(),
            [256, 896, 896, 896, 896, 256]
        );
    }
}
