//! A memory node's membership in a pool: tiers registered, announcement renewed, leave.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umbp_pool::{Error, Index, NodeAnnouncement, NodeId, TierId, TierSpec};

/// How a memory node joins a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipConfig {
    /// The node's id in the pool: unique among the pool's nodes, the same across restarts of
    /// this node (a restart rejoins under it, empty).
    pub node: NodeId,
    /// Where clients reach the node's server (`host:port`), as announced.
    pub address: String,
    /// Bytes per slot of every tier (the largest block a tier stores): a region of `n` bytes
    /// is a tier of `n / slot_size` slots.
    pub slot_size: u64,
    /// How long an announcement lasts; it is renewed every third of it, so a node killed
    /// without leaving is dead in the pool at most this long after its last renewal.
    pub ttl: Duration,
}

impl MembershipConfig {
    /// Node `node` at `address` with slots of `slot_size` bytes and a 10 s announcement.
    pub fn new(node: NodeId, address: impl Into<String>, slot_size: u64) -> Self {
        Self { node, address: address.into(), slot_size, ttl: Duration::from_secs(10) }
    }

    /// The tiers of `regions` (name, length, writable, in the server's export order; see
    /// [`RemoteServer::regions`](umbp_remote::RemoteServer::regions)): tier `i` is region `i`, for each
    /// writable region; read-only ones are not tiers (the pool writes its blocks). Volatile
    /// (DRAM), with the index's default watermarks.
    ///
    /// Errors ([`Error::InvalidConfig`]): a zero slot size, a writable region smaller than one
    /// slot or of more than `u32::MAX` slots, more than 65,536 regions, no writable region.
    pub fn tiers(&self, regions: &[(String, u64, bool)]) -> Result<Vec<TierSpec>, Error> {
        if self.slot_size == 0 {
            return Err(Error::InvalidConfig("the pool's slot size must be positive".into()));
        }
        let mut tiers = Vec::new();
        for (i, (name, len, writable)) in regions.iter().enumerate() {
            if !writable {
                continue;
            }
            let tier = u16::try_from(i).map_err(|_| {
                Error::InvalidConfig("more than 65,536 regions: tier ids are 16 bits".into())
            })?;
            let slots = len / self.slot_size;
            let slots = u32::try_from(slots).map_err(|_| {
                Error::InvalidConfig(format!(
                    "region `{name}`: {slots} slots of {} bytes are more than a tier holds \
                     (u32::MAX); use larger slots",
                    self.slot_size
                ))
            })?;
            if slots == 0 {
                return Err(Error::InvalidConfig(format!(
                    "region `{name}` ({len} bytes) is smaller than one {}-byte slot",
                    self.slot_size
                )));
            }
            tiers.push(TierSpec::new(self.node, TierId(tier), self.slot_size, slots));
        }
        if tiers.is_empty() {
            return Err(Error::InvalidConfig(
                "no writable region to offer the pool (read-only regions are not tiers)".into(),
            ));
        }
        Ok(tiers)
    }
}

/// Where a [`Membership`] stands.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MembershipState {
    /// Announced, and the last renewal succeeded: clients find the node's blocks.
    Joined,
    /// The last renewal failed (the index is unreachable), but the last success is younger
    /// than the TTL: the pool may still count the node alive.
    Lapsing,
    /// Renewals have failed for longer than the TTL: the pool counts the node dead (its
    /// blocks left lookups). The next successful renewal rejoins it, empty.
    Expired,
    /// The node left the pool ([`Membership::leave`]).
    Left,
}

impl MembershipState {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Joined,
            1 => Self::Lapsing,
            2 => Self::Expired,
            _ => Self::Left,
        }
    }

    /// The state's name in logs and metrics: `joined`, `lapsing`, `expired`, `left`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Joined => "joined",
            Self::Lapsing => "lapsing",
            Self::Expired => "expired",
            Self::Left => "left",
        }
    }
}

struct Shared {
    node: NodeId,
    address: String,
    state: AtomicU8,
    announcements: AtomicU64,
    failures: AtomicU64,
    /// Free bytes per tier as last announced.
    free: Mutex<Vec<(TierId, u64)>>,
}

impl Shared {
    fn set(&self, state: MembershipState) {
        self.state.store(state as u8, Ordering::Release);
    }

    fn state(&self) -> MembershipState {
        MembershipState::from_u8(self.state.load(Ordering::Acquire))
    }
}

/// A reader of a [`Membership`]'s state and counters (for metrics); cheap to clone, valid
/// after the membership is gone.
#[derive(Clone)]
pub struct MembershipStats(Arc<Shared>);

impl std::fmt::Debug for MembershipStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MembershipStats").field(&self.read()).finish()
    }
}

/// The state and counters of a [`Membership`] at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipSnapshot {
    /// The node.
    pub node: NodeId,
    /// Its announced address.
    pub address: String,
    /// Where it stands.
    pub state: MembershipState,
    /// Announcements made (the join and every renewal that succeeded).
    pub announcements: u64,
    /// Renewals that failed.
    pub failures: u64,
    /// Free bytes of each tier, as last announced.
    pub free_bytes: Vec<(TierId, u64)>,
}

impl MembershipStats {
    /// The state and counters now.
    pub fn read(&self) -> MembershipSnapshot {
        let s = &self.0;
        MembershipSnapshot {
            node: s.node,
            address: s.address.clone(),
            state: s.state(),
            announcements: s.announcements.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            free_bytes: s.free.lock().unwrap_or_else(PoisonError::into_inner).clone(),
        }
    }
}

/// A memory node's membership in a pool: made by [`join`](Self::join), renewed by a thread
/// every third of the TTL, ended by [`leave`](Self::leave) (or by dropping it, which leaves
/// too). A process killed without leaving stops renewing: the pool counts it dead after the
/// TTL and its blocks leave lookups then.
///
/// The node's slots are written and read by clients; the node itself only offers them. Its
/// memory is volatile, so every join starts empty: blocks the index still lists for this node
/// from an earlier life (a restart within the TTL) are dropped first.
pub struct Membership {
    index: Arc<dyn Index>,
    config: MembershipConfig,
    tiers: Vec<TierSpec>,
    shared: Arc<Shared>,
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("config", &self.config)
            .field("state", &self.shared.state())
            .finish_non_exhaustive()
    }
}

impl Membership {
    /// Joins the pool of `index` as `config.node`, offering the writable ones of `regions`
    /// (see [`MembershipConfig::tiers`]): drops what the index still holds for this node,
    /// registers the tiers, announces the node, and starts renewing.
    ///
    /// The server must name the same node in its welcome
    /// ([`ServerBuilder::node`](umbp_remote::ServerBuilder::node)): the pool's clients
    /// ([`MemoryNodeResolver`](crate::MemoryNodeResolver)) refuse a server that names another node or
    /// none, so that an announcement pointed at another node's address reaches no memory.
    ///
    /// Errors: [`Error::InvalidConfig`] for the tiers (above), a TTL under 3 ms, or a node id
    /// that is alive in the pool at another address (another node uses this id, or this node
    /// restarted at another address before its old announcement expired: wait for the TTL or
    /// use another id); [`Error::TierConflict`] when the index has this node's tier with
    /// another shape (a new slot size needs a new node id); the index's own failures.
    pub fn join(
        index: Arc<dyn Index>,
        config: MembershipConfig,
        regions: &[(String, u64, bool)],
    ) -> Result<Self, Error> {
        if config.ttl < Duration::from_millis(3) {
            return Err(Error::InvalidConfig("the announcement TTL must be at least 3 ms".into()));
        }
        let tiers = config.tiers(regions)?;
        let node = config.node;
        if let Some(other) = index.nodes()?.into_iter().find(|a| a.node == node) {
            if other.address != config.address {
                return Err(Error::InvalidConfig(format!(
                    "node {node} is alive in the pool at {}, not {}: another memory node uses \
                     this node id (give each its own), or this node restarted at another address \
                     before its announcement expired (wait {:?} and start again)",
                    other.address, config.address, config.ttl
                )));
            }
            tracing::warn!(
                node = node.0,
                address = %config.address,
                "pool: this node was still announced (a restart within the TTL): its old blocks \
                 are dropped"
            );
        }
        // Whatever the index lists for this node is from an earlier life of its memory.
        index.leave(node)?;
        for spec in &tiers {
            index.register_tier(spec)?;
        }
        let shared = Arc::new(Shared {
            node,
            address: config.address.clone(),
            state: AtomicU8::new(MembershipState::Joined as u8),
            announcements: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            free: Mutex::new(Vec::new()),
        });
        announce(&*index, &config, &tiers, &shared)?;
        tracing::info!(
            node = node.0,
            address = %config.address,
            tiers = tiers.len(),
            slot_size = config.slot_size,
            ttl = ?config.ttl,
            "pool: joined"
        );
        for spec in &tiers {
            tracing::info!(
                node = node.0,
                tier = spec.tier.0,
                slots = spec.slot_count,
                slot_size = spec.slot_size,
                "pool: tier offered"
            );
        }
        let (stop, stopped) = mpsc::channel::<()>();
        let renewer = {
            let (index, config, tiers, shared) =
                (Arc::clone(&index), config.clone(), tiers.clone(), Arc::clone(&shared));
            std::thread::Builder::new()
                .name(format!("umbp-ucx-pool-{node}"))
                .spawn(move || renew(&*index, &config, &tiers, &shared, &stopped))
                .map_err(|e| {
                    Error::InvalidConfig(format!("cannot start the renewal thread: {e}"))
                })?
        };
        Ok(Self { index, config, tiers, shared, stop: Some(stop), renewer: Some(renewer) })
    }

    /// The tiers offered, as registered.
    pub fn tiers(&self) -> &[TierSpec] {
        &self.tiers
    }

    /// The configuration joined with.
    pub fn config(&self) -> &MembershipConfig {
        &self.config
    }

    /// A reader of the state and counters.
    pub fn stats(&self) -> MembershipStats {
        MembershipStats(Arc::clone(&self.shared))
    }

    /// Stops renewing and leaves the pool now ([`Index::leave`]): the node's blocks leave
    /// lookups at once, writes in progress to it publish nothing. Returns whether the index
    /// still counted it alive. An `Err` (the index unreachable) leaves it to the TTL: the
    /// node is dead in the pool once its last announcement expires.
    ///
    /// Requests already being served are not affected: stop the server after this, draining,
    /// so loads that leased a block before the leave complete.
    pub fn leave(mut self) -> Result<bool, Error> {
        self.leave_now()
    }

    fn leave_now(&mut self) -> Result<bool, Error> {
        drop(self.stop.take());
        if let Some(renewer) = self.renewer.take() {
            let _ = renewer.join();
        }
        if self.shared.state() == MembershipState::Left {
            return Ok(false);
        }
        let node = self.config.node;
        match self.index.leave(node) {
            Ok(was) => {
                self.shared.set(MembershipState::Left);
                tracing::info!(node = node.0, was_alive = was, "pool: left");
                Ok(was)
            }
            Err(e) => {
                tracing::warn!(
                    node = node.0,
                    error = %e,
                    ttl = ?self.config.ttl,
                    "pool: could not leave; the pool counts this node dead once its \
                     announcement expires"
                );
                Err(e)
            }
        }
    }
}

impl Drop for Membership {
    /// Leaves the pool, if [`leave`](Membership::leave) did not.
    fn drop(&mut self) {
        if self.stop.is_some() {
            let _ = self.leave_now();
        }
    }
}

/// Announces the node with its tiers' free bytes now. A tier the index forgot (its server
/// restarted without its data) is registered again first: it is empty, and so is the node
/// when this announcement rejoins it.
fn announce(
    index: &dyn Index,
    config: &MembershipConfig,
    tiers: &[TierSpec],
    shared: &Shared,
) -> Result<(), Error> {
    let mut free = Vec::with_capacity(tiers.len());
    for spec in tiers {
        let stats = match index.tier_stats(spec.node, spec.tier) {
            Err(Error::UnknownTier { .. }) => {
                tracing::info!(
                    node = spec.node.0,
                    tier = spec.tier.0,
                    "pool: the index forgot this tier; registering it again"
                );
                index.register_tier(spec)?;
                index.tier_stats(spec.node, spec.tier)?
            }
            other => other?,
        };
        free.push((spec.tier, u64::from(stats.free).saturating_mul(spec.slot_size)));
    }
    let a = NodeAnnouncement { node: config.node, address: config.address.clone(), tiers: free };
    index.announce(&a, config.ttl)?;
    shared.announcements.fetch_add(1, Ordering::Relaxed);
    *shared.free.lock().unwrap_or_else(PoisonError::into_inner) = a.tiers;
    Ok(())
}

/// The renewal thread: announces every third of the TTL until `stopped`.
fn renew(
    index: &dyn Index,
    config: &MembershipConfig,
    tiers: &[TierSpec],
    shared: &Shared,
    stopped: &mpsc::Receiver<()>,
) {
    let node = config.node.0;
    let mut last_ok = Instant::now();
    let mut failing = 0u64;
    loop {
        match stopped.recv_timeout(config.ttl / 3) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        match announce(index, config, tiers, shared) {
            Ok(()) => {
                if failing > 0 {
                    let expired = last_ok.elapsed() >= config.ttl;
                    tracing::info!(
                        node,
                        failed = failing,
                        rejoined_empty = expired,
                        "pool: announcement renewed again"
                    );
                }
                failing = 0;
                last_ok = Instant::now();
                shared.set(MembershipState::Joined);
            }
            Err(e) => {
                failing += 1;
                shared.failures.fetch_add(1, Ordering::Relaxed);
                let expired = last_ok.elapsed() >= config.ttl;
                let state =
                    if expired { MembershipState::Expired } else { MembershipState::Lapsing };
                if shared.state() != state || failing.is_power_of_two() {
                    tracing::warn!(
                        node,
                        error = %e,
                        failed = failing,
                        state = state.name(),
                        "pool: announcement not renewed"
                    );
                }
                shared.set(state);
            }
        }
    }
}
