//! How a client's pool reaches memory nodes' tiers: [`MemoryNodeResolver`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use umbp_composite::CompositeEngine;
use umbp_plan::{Register, Registration};
use umbp_pool::{NodeAnnouncement, NodeId, TierId, TierRegion, TierResolver, TierSpec};

use umbp_remote::{Error, PeerInfo, RemoteEngine};

/// One memory node this resolver is connected to.
struct Peer {
    /// The address connected to (the node's announcement's).
    address: String,
    info: PeerInfo,
    /// The node's tiers registered with the composite so far.
    tiers: HashMap<TierId, Registration>,
}

/// What a resolver stops using: registrations to drop and a peer to disconnect, outside the
/// lock (dropping a registration waits for the batches that use it).
#[derive(Default)]
struct Retired {
    registrations: Vec<Registration>,
    peers: Vec<u32>,
}

/// Reaches memory nodes' tiers for a [`Pool`](umbp_pool::Pool): the [`TierResolver`] of the
/// remote engine.
///
/// For a tier of a node the pool meets, it connects this process's [`RemoteEngine`] to the
/// address the node announced, as that node ([`RemoteEngine::connect_node`]): the handshake
/// proves both hold the shared secret, so an address planted in the index reaches no
/// impostor, and the node's welcome names its node id, bound to the session, so an
/// announcement that points one node's id at another node's address (whoever can write the
/// index can do that) is refused with [`HandshakeError::WrongNode`](umbp_remote::HandshakeError)
/// ([`refusal`](Self::refusal) tells it): that node's blocks fail as load and put errors and
/// never reach the other node's slots. Once per node, it registers the node's
/// exported region for that tier (tier `i` is the node's `i`-th region, as
/// [`Membership`](crate::Membership) registers them) with the pool's composite, over
/// exactly the tier's `slot_size * slot_count` bytes.
///
/// A node is connected again, and its regions registered again, when its announcement names
/// another address, when the engine declared the peer dead (its process exited, its network
/// went: [`is_current`](TierResolver::is_current) then tells the pool, before a transfer
/// meets the dead connection), or after the pool [`forget`](TierResolver::forget)s its tier
/// (a transfer through it failed). A node whose connection failed is not tried again at that address for a second,
/// so the gets that meet a dead node fail at once rather than each after a connect timeout. A node that died costs only the blocks in flight to it and those of the gets that
/// meet it before it is dead in the index: they fail as load errors, never as wrong bytes,
/// and its blocks leave lookups once it left the pool or its announcement expired.
pub struct MemoryNodeResolver {
    engine: Arc<RemoteEngine>,
    composite: CompositeEngine,
    peers: Mutex<HashMap<NodeId, Peer>>,
    /// Nodes whose last connection attempt failed: the address tried, until when it is not
    /// tried again (so that the gets meeting a dead node before its announcement expires do
    /// not each wait for a connect timeout), and why it failed.
    refused: Mutex<HashMap<NodeId, Refused>>,
    /// One lock per node, held while connecting to it: the gets that meet a node at once wait
    /// for one connection instead of each making its own.
    connecting: Mutex<HashMap<NodeId, Arc<Mutex<()>>>>,
}

/// A node's failed connection attempt.
struct Refused {
    address: String,
    until: Instant,
    why: Arc<Error>,
}

/// How long a node whose connection failed is not tried again at the same address.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl std::fmt::Debug for MemoryNodeResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<(NodeId, String)> =
            self.lock().iter().map(|(n, p)| (*n, p.address.clone())).collect();
        f.debug_struct("MemoryNodeResolver").field("peers", &peers).finish_non_exhaustive()
    }
}

impl MemoryNodeResolver {
    /// A resolver that connects `engine` to memory nodes and registers their regions with
    /// `composite` (the pool's), of which `engine` must be one of the engines: both name
    /// endpoints in one registry ([`Error::Config`] otherwise).
    pub fn new(engine: Arc<RemoteEngine>, composite: CompositeEngine) -> Result<Self, Error> {
        if !Arc::ptr_eq(engine.registry(), composite.registry()) {
            return Err(Error::Config {
                setting: "registry",
                reason: "the engine and the pool's composite name endpoints in different \
                         registries: build the composite over this engine"
                    .into(),
            });
        }
        Ok(Self {
            engine,
            composite,
            peers: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            connecting: Mutex::new(HashMap::new()),
        })
    }

    /// The nodes connected now (their peer alive), with the address each was reached at.
    pub fn connected(&self) -> Vec<(NodeId, String)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .filter(|(_, p)| self.engine.is_alive(p.info.id))
            .map(|(n, p)| (*n, p.address.clone()))
            .collect();
        v.sort();
        v
    }

    /// Why the last attempt to connect to `node` failed, until one succeeds: for a node whose
    /// announced address reaches another node, [`Error::Handshake`] with
    /// [`HandshakeError::WrongNode`](umbp_remote::HandshakeError::WrongNode).
    pub fn refusal(&self, node: NodeId) -> Option<Arc<Error>> {
        self.refused
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&node)
            .map(|r| Arc::clone(&r.why))
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<NodeId, Peer>> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops what `retired` holds, then disconnects its peers.
    fn retire(&self, retired: Retired) {
        drop(retired.registrations);
        for peer in retired.peers {
            let _ = self.engine.disconnect(peer);
        }
    }

    fn try_resolve(&self, node: &NodeAnnouncement, spec: &TierSpec) -> Result<TierRegion, String> {
        let one = Arc::clone(
            self.connecting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(node.node)
                .or_default(),
        );
        let _connecting = one.lock().unwrap_or_else(PoisonError::into_inner);
        let mut retired = Retired::default();
        // A peer that moved or died is dropped; a connection, made outside the lock.
        let connected = {
            let mut peers = self.lock();
            match peers.get(&node.node) {
                Some(p) if p.address == node.address && self.engine.is_alive(p.info.id) => true,
                Some(_) => {
                    let p = peers.remove(&node.node).expect("present");
                    retired.registrations.extend(p.tiers.into_values());
                    retired.peers.push(p.info.id);
                    false
                }
                None => false,
            }
        };
        self.retire(retired);
        if !connected {
            {
                let refused = self.refused.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(r) = refused.get(&node.node) {
                    if r.address == node.address && Instant::now() < r.until {
                        return Err(format!(
                            "its last connection failed; not tried again for {RETRY_AFTER:?}"
                        ));
                    }
                }
            }
            // As that node: a server that names another node (or none) is refused.
            let info = match self.engine.connect_node(node.address.as_str(), node.node.0) {
                Ok(info) => {
                    self.refused.lock().unwrap_or_else(PoisonError::into_inner).remove(&node.node);
                    info
                }
                Err(e) => {
                    let why = format!("connecting to {}: {}", node.address, chain(&e));
                    self.refused.lock().unwrap_or_else(PoisonError::into_inner).insert(
                        node.node,
                        Refused {
                            address: node.address.clone(),
                            until: Instant::now() + RETRY_AFTER,
                            why: Arc::new(e),
                        },
                    );
                    return Err(why);
                }
            };
            tracing::info!(node = node.node.0, address = %node.address, peer = info.id, "pool: memory node connected");
            // Connections to a node are made under its lock: nothing was inserted meanwhile
            // but by `forget` (which only removes), so this is the node's one connection.
            let old = self.lock().insert(
                node.node,
                Peer { address: node.address.clone(), info, tiers: HashMap::new() },
            );
            if let Some(old) = old {
                self.retire(Retired {
                    registrations: old.tiers.into_values().collect(),
                    peers: vec![old.info.id],
                });
            }
        }
        let mut peers = self.lock();
        let peer = peers.get_mut(&node.node).ok_or("the connection was dropped meanwhile")?;
        if let Some(r) = peer.tiers.get(&spec.tier) {
            return Ok(TierRegion { endpoint: r.id(), base: 0, slot_size: spec.slot_size });
        }
        let region = peer.info.regions.get(usize::from(spec.tier.0)).ok_or_else(|| {
            format!("it exports {} regions, so none is tier {}", peer.info.regions.len(), spec.tier)
        })?;
        let size = spec
            .slot_size
            .checked_mul(u64::from(spec.slot_count))
            .ok_or("the tier's size overflows")?;
        if !region.writable || region.len < size {
            return Err(format!(
                "its region `{}` ({} bytes, writable {}) cannot hold tier {}: {} slots of {} bytes",
                region.name,
                region.len,
                region.writable,
                spec.tier,
                spec.slot_count,
                spec.slot_size
            ));
        }
        let registration = self
            .composite
            .register_remote(region.region, 0, size)
            .map_err(|e| format!("registering its region `{}`: {}", region.name, chain(&e)))?;
        registration.set_label(format!("node {} region {}", node.node, region.name));
        let out = TierRegion { endpoint: registration.id(), base: 0, slot_size: spec.slot_size };
        peer.tiers.insert(spec.tier, registration);
        Ok(out)
    }
}

/// The error's words, then its causes'.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s += &format!(": {c}");
        cause = c.source();
    }
    s
}

impl TierResolver for MemoryNodeResolver {
    fn resolve(&self, node: &NodeAnnouncement, spec: &TierSpec) -> Option<TierRegion> {
        match self.try_resolve(node, spec) {
            Ok(region) => Some(region),
            Err(why) => {
                tracing::warn!(
                    node = node.node.0,
                    tier = spec.tier.0,
                    address = %node.address,
                    "pool: memory node's tier not reachable: {why}"
                );
                None
            }
        }
    }

    /// Whether `region` is still registered for `node` over a live connection: a node that
    /// exited, restarted or lost its network is resolved again before a transfer meets it.
    fn is_current(&self, node: NodeId, region: &TierRegion) -> bool {
        let peers = self.lock();
        peers.get(&node).is_some_and(|p| {
            p.tiers.values().any(|r| r.id() == region.endpoint) && self.engine.is_alive(p.info.id)
        })
    }

    fn forget(&self, spec: &TierSpec) {
        let mut retired = Retired::default();
        {
            let mut peers = self.lock();
            let Some(peer) = peers.get_mut(&spec.node) else { return };
            retired.registrations.extend(peer.tiers.remove(&spec.tier));
            if peer.tiers.is_empty() || !self.engine.is_alive(peer.info.id) {
                let p = peers.remove(&spec.node).expect("present");
                retired.registrations.extend(p.tiers.into_values());
                retired.peers.push(p.info.id);
                tracing::info!(node = spec.node.0, address = %p.address, "pool: memory node dropped");
            }
        }
        self.retire(retired);
    }
}
