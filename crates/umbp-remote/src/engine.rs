//! The engine: the public face ([`RemoteEngine`]) and what a submit does on the caller's thread.
//! The work itself runs on the progress thread ([`crate::progress`]).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umbp_plan::{
    plan_batch, Endpoint, EndpointId, EndpointRegistry, EndpointRelease, EndpointTable,
    EngineError, Failure, FailureCause, Fragment, IncrementalBuilder, OverlapCheck, Plan,
    PlanBuilder, PlanRules, PlanSet, Register, RegisterError, RejectReason, RemoteRegion,
    SettleSlot, Space, TransferEngine, TransferHandle,
};

use crate::channel::Keys;
use crate::config::NAME;
use crate::handshake::{self, Mode, WireRegion};
use crate::progress::{self, BatchRun, Command, LinkSpec, Op, Route};
use crate::{Error, HandshakeError, RemoteConfig};

/// Peer numbers are unique in the process, so two engines never claim each other's peers.
static NEXT_PEER: AtomicU32 = AtomicU32::new(0);

/// One region a connected peer exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedRegion {
    /// What fragments name it by: register it with
    /// [`Register::register_remote`](umbp_plan::Register::register_remote).
    pub region: RemoteRegion,
    /// The name the server gave it.
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// Whether the server lets peers write it (offload); reads (restore) always work.
    pub writable: bool,
}

/// A peer this engine is connected to. Made by [`RemoteEngine::connect`] only, so it may
/// grow fields (as `lanes` came).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PeerInfo {
    /// Its number, as in [`RemoteRegion::peer`].
    pub id: u32,
    /// The server's control address.
    pub addr: SocketAddr,
    /// The node the server names itself in its welcome ([`ServerBuilder::node`]), if any.
    ///
    /// [`ServerBuilder::node`]: crate::ServerBuilder::node
    pub node: Option<u32>,
    /// The connections requests to it travel on: up to [`RemoteConfig::lanes`] on the
    /// checked path (fewer where the server took no more: each is a client to it), one where
    /// it is reached one-sided.
    pub lanes: usize,
    /// What it exported, in its order.
    pub regions: Vec<ExportedRegion>,
}

impl PeerInfo {
    /// The region the server exported as `name`.
    pub fn region(&self, name: &str) -> Option<&ExportedRegion> {
        self.regions.iter().find(|r| r.name == name)
    }
}

/// A connected peer, as submits see it.
pub(crate) struct Peer {
    pub(crate) info: PeerInfo,
    /// The peer's index on the progress thread.
    pub(crate) slot: u32,
    /// The regions' addresses in the peer's process (one-sided); zeros when checked.
    pub(crate) bases: Vec<u64>,
    /// Reached through the checked request path.
    pub(crate) checked: bool,
    /// Cleared (Release) once the peer is declared dead; submits then fail its plans at once.
    pub(crate) alive: Arc<AtomicBool>,
    /// Why it died, once it did.
    pub(crate) reason: Arc<Mutex<String>>,
    /// The control connection, shut down when the engine goes.
    control: TcpStream,
}

/// What the engine and its builders share.
pub(crate) struct Shared {
    pub(crate) registry: Arc<EndpointRegistry>,
    pub(crate) config: RemoteConfig,
    pub(crate) peers: RwLock<HashMap<u32, Arc<Peer>>>,
    overlap: Mutex<OverlapCheck>,
}

impl Shared {
    pub(crate) fn peer(&self, id: u32) -> Option<Arc<Peer>> {
        self.peers.read().unwrap_or_else(PoisonError::into_inner).get(&id).cloned()
    }

    /// Checks that a remote endpoint names bytes its peer exported, and returns the peer.
    fn check_remote(&self, endpoint: &Endpoint) -> Result<Option<Arc<Peer>>, Error> {
        let Some(r) = endpoint.remote_region() else { return Ok(None) };
        let peer = self.peer(r.peer).ok_or(Error::UnknownPeer { peer: r.peer })?;
        let region = peer
            .info
            .regions
            .get(r.region as usize)
            .ok_or(Error::UnknownRegion { peer: r.peer, region: r.region })?;
        if !region_contains(region.len, endpoint.addr(), endpoint.len()) {
            return Err(Error::OutsideExport {
                peer: r.peer,
                region: r.region,
                offset: endpoint.addr(),
                len: endpoint.len(),
                region_len: region.len,
            });
        }
        Ok(Some(peer))
    }
}

fn region_contains(region_len: u64, offset: u64, len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

/// The plan rules: host memory to and from a region of a peer this engine is connected to;
/// writes only to writable regions.
#[derive(Clone)]
pub struct RemoteRules {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RemoteRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RemoteRules")
    }
}

impl PlanRules for RemoteRules {
    fn carries(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        let known =
            |e: &Endpoint| e.remote_region().is_some_and(|r| self.shared.peer(r.peer).is_some());
        (src.is_host() && known(dst)) || (known(src) && dst.is_host())
    }

    fn check_fragment(
        &self,
        _src: &Endpoint,
        dst: &Endpoint,
        fragment: &Fragment,
    ) -> Result<(), RejectReason> {
        if let Some(r) = dst.remote_region() {
            let writable = self
                .shared
                .peer(r.peer)
                .and_then(|p| p.info.regions.get(r.region as usize).map(|g| g.writable));
            if writable != Some(true) {
                return Err(RejectReason::ReadOnly(fragment.dst));
            }
        }
        Ok(())
    }
}

/// The incremental plan builder of [`RemoteEngine`].
pub type RemoteBuilder = IncrementalBuilder<RemoteRules>;

/// The remote memory engine: one-sided gets (restore) and puts (offload) between this
/// process's host memory and regions that peers exported, over UCX.
///
/// # Use
///
/// 1. [`connect`](Self::connect) to each peer's [`RemoteServer`](crate::RemoteServer): the handshake
///    returns its worker address and the keys of its regions ([`PeerInfo`]).
/// 2. Register what fragments name: host memory as usual, a peer's region with
///    [`Register::register_remote`] (refused unless the range lies inside what the peer
///    exported).
/// 3. Build plans ([`RemoteBuilder`], or through a composite) and [`submit`](TransferEngine::submit).
///
/// # Submit
///
/// On the caller's thread: pins the endpoints, applies the overlap rule, and turns every
/// segment into a request after checking it against its local endpoint and the region the
/// peer exported (a plan with a segment outside either fails whole, nothing of it sent); a
/// plan to a dead peer fails at once. The requests go to the engine's progress thread, which
/// keeps up to [`RemoteConfig::max_in_flight`] of them in flight over all peers, progresses UCX
/// and settles the batch: puts count only once a flush of their endpoint has confirmed them at
/// the peer. The handle returns at once.
///
/// # Failures
///
/// - A peer that goes away (its control connection closes, UCX reports its endpoint failed,
///   or it leaves requests unanswered for [`RemoteConfig::peer_timeout`]) is declared dead: its
///   endpoint is closed by force, which ends every request in flight to it, and exactly the
///   objects with bytes to or from it fail with [`FailureCause::PeerFailed`].
/// - A request that fails while its peer lives, on a segment that merged several objects, is
///   re-issued once per object, so only the objects whose bytes did not arrive fail.
/// - A deadline stops the batch from sending more; what is in flight completes (bounded by
///   the peer timeout), so the handle never returns while a get may still write.
pub struct RemoteEngine {
    shared: Arc<Shared>,
    commands: Option<mpsc::Sender<Command>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RemoteEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteEngine").field("config", &self.shared.config).finish()
    }
}

impl RemoteEngine {
    /// An engine over `registry`: starts its progress thread. Where the transports are RDMA
    /// alone, that thread creates the UCX context and worker for one-sided access (and the
    /// engine fails with [`Error::LibraryMissing`] where UCX is not installed); otherwise
    /// peers are reached through the checked request path and no UCX worker exists: over TCP
    /// one would listen on every interface, and UCX writes a connected stranger's put
    /// wherever the stranger says.
    pub fn new(registry: Arc<EndpointRegistry>, config: RemoteConfig) -> Result<Self, Error> {
        if config.max_in_flight == 0 {
            return Err(Error::Config {
                setting: "max_in_flight",
                reason: "must be at least 1".into(),
            });
        }
        if config.lanes == 0 {
            return Err(Error::Config { setting: "lanes", reason: "must be at least 1".into() });
        }
        config.check_congestion()?;
        let (commands, receiver) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let thread = progress::start(config.clone(), receiver, ready)?;
        let engine = Self {
            shared: Arc::new(Shared {
                registry,
                config,
                peers: RwLock::new(HashMap::new()),
                overlap: Mutex::new(OverlapCheck::new()),
            }),
            commands: Some(commands),
            thread: Some(thread),
        };
        match started.recv() {
            Ok(Ok(())) => Ok(engine),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::ProgressThreadGone),
        }
    }

    /// The registry the engine looks endpoints up in.
    pub fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared.registry
    }

    /// The configuration in effect.
    pub fn config(&self) -> &RemoteConfig {
        &self.shared.config
    }

    /// A new incremental plan builder, as its concrete type.
    pub fn incremental_builder(&self) -> RemoteBuilder {
        IncrementalBuilder::new(
            RemoteRules { shared: Arc::clone(&self.shared) },
            Arc::clone(&self.shared.registry),
        )
    }

    /// Connects to the server listening at `addr`: the TCP connection and the mutual
    /// authentication (see the README), then the path to its memory: the checked request
    /// path on that connection, or, where the server serves one-sided RDMA, a UCX endpoint to
    /// its worker with its regions' keys. The peer stays connected until it goes away or the
    /// engine is dropped.
    ///
    /// [`RemoteConfig::connect_timeout`] bounds all of it after the address resolved: a server
    /// that answers slowly, or not at all, is a [`HandshakeError::DeadlinePassed`] then.
    /// Nothing the server sends reaches UCX before it proved that it holds the secret.
    ///
    /// The handshake proves that the server holds the secret, not which node it is: to reach
    /// a node found by its id (in a pool's index, say), use
    /// [`connect_node`](Self::connect_node).
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<PeerInfo, Error> {
        self.connect_to(addr, None)
    }

    /// Connects as [`connect`](Self::connect) does to the server at `addr`, which must be
    /// node `node`: its welcome (bound to the session, so no relay changes it) names that node
    /// ([`ServerBuilder::node`](crate::ServerBuilder::node)). A server that names another node,
    /// or none, is refused with [`HandshakeError::WrongNode`] before anything it offers is
    /// used, and its connection closed: an address that points at another node (an index
    /// entry a stranger with write access to the index changed, a node that moved) reaches
    /// no memory of that node.
    pub fn connect_node(&self, addr: impl ToSocketAddrs, node: u32) -> Result<PeerInfo, Error> {
        self.connect_to(addr, Some(node))
    }

    fn connect_to(&self, addr: impl ToSocketAddrs, node: Option<u32>) -> Result<PeerInfo, Error> {
        let auth = self.shared.config.auth()?;
        let timeout = self.shared.config.connect_timeout;
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|source| Error::Connect { addr: "peer address".into(), source })?
            .collect();
        let deadline = Instant::now() + timeout;
        let mut last = None;
        let mut stream = None;
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Handshake { addr: *a, source: HandshakeError::DeadlinePassed });
            }
            match crate::checked::connect(*a, left, &self.shared.config.congestion) {
                Ok(s) => {
                    stream = Some((s, *a));
                    break;
                }
                Err(e) => last = Some(Error::Connect { addr: a.to_string(), source: e }),
            }
        }
        let Some((stream, addr)) = stream else {
            return Err(last.unwrap_or_else(|| Error::Connect {
                addr: "peer address".into(),
                source: io::Error::new(io::ErrorKind::NotFound, "no address"),
            }));
        };
        let handshake_error = |source| Error::Handshake { addr, source };
        let io = |e: io::Error| Error::Connect { addr: addr.to_string(), source: e };
        let (welcome, keys) = self.authenticate(&stream, addr, auth, deadline)?;
        if let Some(expected) = node {
            if welcome.node != Some(expected) {
                let _ = stream.shutdown(Shutdown::Both);
                return Err(handshake_error(HandshakeError::WrongNode {
                    expected,
                    named: welcome.node,
                }));
            }
        }
        if welcome.mode() == Mode::OneSided
            && !crate::config::hardware_enforced(self.shared.config.transports.as_deref())
        {
            // A worker address is parsed by UCX alone; it is taken only where one-sided access
            // is what this side chose too (RDMA transports alone), from a server that proved
            // the secret.
            return Err(handshake_error(HandshakeError::Refused(
                "the server offers one-sided access, which this side takes only on RDMA \
                 transports alone",
            )));
        }

        let id = NEXT_PEER.fetch_add(1, Ordering::Relaxed);
        let alive = Arc::new(AtomicBool::new(true));
        let reason = Arc::new(Mutex::new(String::new()));
        let (reply, answer) = mpsc::channel();
        let mode = welcome.mode();
        let link = match (&welcome.address, mode) {
            (Some(address), Mode::OneSided) => LinkSpec::Ucx {
                address: address.clone(),
                rkeys: welcome
                    .regions
                    .iter()
                    .map(|r| r.one_sided.as_ref().map(|(_, k)| k.clone()).unwrap_or_default())
                    .collect(),
            },
            _ => {
                let mut lanes = vec![(stream.try_clone().map_err(io)?, keys)];
                while lanes.len() < self.shared.config.lanes {
                    match self.open_lane(addr, auth, deadline, &welcome) {
                        Ok(lane) => lanes.push(lane),
                        Err(e) => {
                            tracing::warn!(
                                %addr,
                                lanes = lanes.len(),
                                error = %e,
                                "connected with fewer lanes than asked for"
                            );
                            break;
                        }
                    }
                }
                LinkSpec::Checked {
                    lanes,
                    notify: self.commands.clone().ok_or(Error::ProgressThreadGone)?,
                }
            }
        };
        let lanes = match &link {
            LinkSpec::Checked { lanes, .. } => lanes.len(),
            LinkSpec::Ucx { .. } => 1,
        };
        self.send(Command::Connect {
            peer: id,
            link,
            alive: Arc::clone(&alive),
            reason: Arc::clone(&reason),
            reply,
        })?;
        // The progress thread's part is local (no network wait): an endpoint, or two threads.
        let slot = answer.recv().map_err(|_| Error::ProgressThreadGone)??;
        let info = PeerInfo {
            id,
            addr,
            node: welcome.node,
            lanes,
            regions: welcome
                .regions
                .iter()
                .enumerate()
                .map(|(i, r): (usize, &WireRegion)| ExportedRegion {
                    region: RemoteRegion { peer: id, region: i as u32 },
                    name: r.name.clone(),
                    len: r.len,
                    writable: r.writable,
                })
                .collect(),
        };
        let checked = mode == Mode::Checked;
        let peer = Arc::new(Peer {
            info: info.clone(),
            slot,
            bases: welcome
                .regions
                .iter()
                .map(|r| r.one_sided.as_ref().map_or(0, |(base, _)| *base))
                .collect(),
            checked,
            alive,
            reason,
            control: stream.try_clone().map_err(io)?,
        });
        if !checked {
            // One-sided: the silent control connection's end says the peer went away (the
            // checked link's reader notices that itself).
            self.watch(stream, id, slot)?;
        }
        self.shared.peers.write().unwrap_or_else(PoisonError::into_inner).insert(id, peer);
        tracing::info!(peer = id, %addr, regions = info.regions.len(), checked, "connected");
        Ok(info)
    }

    /// Runs the handshake on a fresh connection to `addr` (all of it before `deadline`) and
    /// readies the connection for a link: no timeouts on reads and writes (the link's threads
    /// keep their own), keepalive and the unacknowledged-data bound on.
    fn authenticate(
        &self,
        stream: &TcpStream,
        addr: SocketAddr,
        auth: handshake::Auth<'_>,
        deadline: Instant,
    ) -> Result<(handshake::Welcome, Keys), Error> {
        let io = |e: io::Error| Error::Connect { addr: addr.to_string(), source: e };
        let _ = stream.set_nodelay(true);
        let protection = self.shared.config.protection;
        let (welcome, keys) =
            handshake::client(&mut Deadlined { stream, deadline }, auth, protection)
                .map_err(|e| match e {
                    HandshakeError::Io(e) if is_timeout(&e) => HandshakeError::DeadlinePassed,
                    other => other,
                })
                .map_err(|source| Error::Handshake { addr, source })?;
        stream.set_read_timeout(None).map_err(io)?;
        stream.set_write_timeout(None).map_err(io)?;
        // A server whose network vanished is noticed even while nothing is in flight.
        crate::checked::keepalive(
            stream,
            self.shared.config.heartbeat,
            self.shared.config.peer_timeout,
        )
        .map_err(io)?;
        Ok((welcome, keys))
    }

    /// Opens one more lane of a checked link to the server at `addr`, whose first lane was
    /// welcomed with `first`: a lane whose server welcomes it otherwise (another server now
    /// answers there: another node, other exports) is closed and refused, so every lane of a
    /// link reaches the same memory.
    fn open_lane(
        &self,
        addr: SocketAddr,
        auth: handshake::Auth<'_>,
        deadline: Instant,
        first: &handshake::Welcome,
    ) -> Result<(TcpStream, Keys), Error> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Handshake { addr, source: HandshakeError::DeadlinePassed });
        }
        let stream = crate::checked::connect(addr, left, &self.shared.config.congestion)
            .map_err(|source| Error::Connect { addr: addr.to_string(), source })?;
        let (welcome, keys) = self.authenticate(&stream, addr, auth, deadline)?;
        if welcome != *first {
            let _ = stream.shutdown(Shutdown::Both);
            return Err(Error::Handshake {
                addr,
                source: HandshakeError::Refused(
                    "the server welcomed a further lane otherwise than the first",
                ),
            });
        }
        Ok((stream, keys))
    }

    /// Disconnects `peer`: batches submitted from now on fail its objects at once
    /// ([`FailureCause::PeerFailed`], "disconnected by this node"), what is in flight to it
    /// finishes (puts confirmed), then its endpoint closes and its control connection with
    /// it. Returns once that is done. Its registered endpoints stay registered, and fail.
    pub fn disconnect(&self, peer: u32) -> Result<(), Error> {
        let entry = self.shared.peer(peer).ok_or(Error::UnknownPeer { peer })?;
        let (reply, answer) = mpsc::channel();
        self.send(Command::Disconnect { slot: entry.slot, reply })?;
        answer.recv().map_err(|_| Error::ProgressThreadGone)?;
        let _ = entry.control.shutdown(Shutdown::Both);
        tracing::info!(peer, "disconnected");
        Ok(())
    }

    /// Whether `peer` is connected and alive.
    pub fn is_alive(&self, peer: u32) -> bool {
        self.shared.peer(peer).is_some_and(|p| p.alive.load(Ordering::Acquire))
    }

    /// Watches the control connection: its end means the peer went away.
    fn watch(&self, mut stream: TcpStream, peer: u32, slot: u32) -> Result<(), Error> {
        let commands = self.commands.clone().ok_or(Error::ProgressThreadGone)?;
        std::thread::Builder::new()
            .name(format!("umbp-ucx-peer-{peer}"))
            .spawn(move || {
                use std::io::Read;
                let mut buf = [0u8; 64];
                let why = loop {
                    match stream.read(&mut buf) {
                        Ok(0) => break "its control connection closed".to_owned(),
                        Ok(_) => continue,
                        Err(e) => break format!("its control connection failed: {e}"),
                    }
                };
                let _ = commands.send(Command::PeerLost { slot, reason: why });
            })
            .map(|_| ())
            .map_err(|source| Error::Connect { addr: "watch thread".into(), source })
    }

    fn send(&self, command: Command) -> Result<(), Error> {
        let commands = self.commands.as_ref().ok_or(Error::ProgressThreadGone)?;
        commands.send(command).map_err(|_| Error::ProgressThreadGone)
    }

    /// Registers host memory with UCX for this engine's requests, or checks a remote
    /// endpoint against its peer's export. Returns whether the memory was mapped.
    ///
    /// A mapping UCX refuses (an RDMA pin limit, say) is logged and skipped, not an error:
    /// the memory still registers for the other engines, and UCX registers what a request
    /// touches on the fly.
    fn prepare_endpoint(&self, id: EndpointId, endpoint: &Endpoint) -> Result<bool, Error> {
        if self.shared.check_remote(endpoint)?.is_some() {
            return Ok(false);
        }
        let one_sided = crate::config::hardware_enforced(self.shared.config.transports.as_deref());
        if !(endpoint.is_host() && self.shared.config.map_host_memory && one_sided)
            || endpoint.is_empty()
        {
            return Ok(false);
        }
        let (reply, answer) = mpsc::channel();
        self.send(Command::Map { id, addr: endpoint.addr(), len: endpoint.len(), reply })?;
        match answer.recv().map_err(|_| Error::ProgressThreadGone)? {
            Ok(()) => Ok(true),
            Err(e) => {
                tracing::warn!(endpoint = id.raw(), error = %e, "host memory not mapped for UCX");
                Ok(false)
            }
        }
    }

    /// Resolves the plans of a submit into requests; returns the batch and the failures found.
    fn resolve(
        &self,
        plans: &mut PlanSet,
        table: &EndpointTable,
    ) -> (Vec<Route>, Vec<Op>, Vec<Failure>) {
        let mut failures = self
            .shared
            .overlap
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .exclude(plans, NAME, |id| {
                let e = table.get(id)?;
                match e.remote_region() {
                    Some(r) => Some((Space::Remote(r), e.addr())),
                    None => e.is_host().then_some((Space::Host, e.addr())),
                }
            });
        let mut routes = Vec::with_capacity(plans.plans().len());
        let mut ops = Vec::new();
        let hashing = plans.copy_hashes().is_some();
        for (index, plan) in plans.plans().iter().enumerate() {
            let start = ops.len();
            let routed = self.route(plan, table).and_then(|(route, local, remote)| {
                // A checked request hashes what it moves: one request per object's piece,
                // so each CRC is one object's.
                let per_object = hashing && route.checked;
                push_ops(index as u32, plan, &route, local, remote, per_object, &mut ops)
                    .map(|()| route)
            });
            match routed {
                Ok(route) => routes.push(route),
                Err(cause) => {
                    ops.truncate(start);
                    routes.push(Route::FAILED);
                    failures.push(plan.fail(NAME, cause));
                }
            }
        }
        (routes, ops, failures)
    }

    /// The route of one plan: which peer, which key, which direction, and its endpoints.
    fn route(
        &self,
        plan: &Plan,
        table: &EndpointTable,
    ) -> Result<(Route, Endpoint, Endpoint), FailureCause> {
        let endpoint =
            |id: EndpointId| table.get(id).copied().ok_or(FailureCause::EndpointGone(id));
        let (src, dst) = (endpoint(plan.src())?, endpoint(plan.dst())?);
        let not_accepted = |e: Error| FailureCause::NotAccepted(e.to_string());
        let (write, local_id, local, remote) = match (src.remote_region(), dst.remote_region()) {
            (Some(_), None) if dst.is_host() => (false, plan.dst(), dst, src),
            (None, Some(_)) if src.is_host() => (true, plan.src(), src, dst),
            _ => {
                return Err(not_accepted(Error::PairNotCarried {
                    src: plan.src().raw(),
                    dst: plan.dst().raw(),
                }))
            }
        };
        let peer =
            self.shared.check_remote(&remote).map_err(not_accepted)?.expect("a remote endpoint");
        if !peer.alive.load(Ordering::Acquire) {
            let message = peer.reason.lock().unwrap_or_else(PoisonError::into_inner).clone();
            return Err(FailureCause::PeerFailed { peer: peer.info.id, message });
        }
        let r = remote.remote_region().expect("a remote endpoint");
        let region = &peer.info.regions[r.region as usize];
        if write && !region.writable {
            return Err(not_accepted(Error::ReadOnly { peer: r.peer, region: r.region }));
        }
        let route = Route {
            peer: peer.slot,
            rkey: r.region,
            write,
            local: local_id,
            local_base: local.addr(),
            remote_base: peer.bases[r.region as usize] + remote.addr(),
            checked: peer.checked,
        };
        Ok((route, local, remote))
    }
}

/// A socket whose reads and writes all end by one deadline.
struct Deadlined<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether a socket error is its timeout firing.
fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
}

/// Appends one request per segment of `plan`, each checked against its local endpoint and
/// the remote one (which [`Shared::check_remote`] checked against the export); with
/// `per_object`, one per object's piece of each segment instead.
fn push_ops(
    plan_index: u32,
    plan: &Plan,
    route: &Route,
    local: Endpoint,
    remote: Endpoint,
    per_object: bool,
    ops: &mut Vec<Op>,
) -> Result<(), FailureCause> {
    let local_id = route.local;
    for (s, segment) in plan.segments().iter().enumerate() {
        let op = Op::new(plan_index, s as u32, None, segment, route.write);
        if !local.contains(op.local_offset, op.len) {
            let e = Error::OutsideLocal {
                endpoint: local_id.raw(),
                offset: op.local_offset,
                len: op.len,
            };
            return Err(FailureCause::NotAccepted(e.to_string()));
        }
        if !remote.contains(op.remote_offset, op.len) {
            let r = remote.remote_region().expect("a remote endpoint");
            let e = Error::OutsideExport {
                peer: r.peer,
                region: r.region,
                offset: remote.addr().saturating_add(op.remote_offset),
                len: op.len,
                region_len: remote.addr().saturating_add(remote.len()),
            };
            return Err(FailureCause::NotAccepted(e.to_string()));
        }
        if !per_object {
            ops.push(op);
            continue;
        }
        // Pieces of the segment just checked: inside both endpoints too.
        for (tag, piece) in plan.segment_pieces(s) {
            ops.push(Op::new(plan_index, s as u32, Some(tag), &piece, route.write));
        }
    }
    Ok(())
}

impl Drop for RemoteEngine {
    /// Lets the batches in flight settle, closes every peer and stops the progress thread.
    fn drop(&mut self) {
        if let Some(commands) = self.commands.take() {
            let _ = commands.send(Command::Shutdown);
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // Ends the watch threads (and tells the servers this client left).
        for peer in self.shared.peers.read().unwrap_or_else(PoisonError::into_inner).values() {
            let _ = peer.control.shutdown(Shutdown::Both);
        }
    }
}

/// Registration: host memory is mapped for UCX (when [`RemoteConfig::map_host_memory`]), a
/// remote endpoint is checked against its peer's export; other kinds register untouched.
impl Register for RemoteEngine {
    fn registry(&self) -> &Arc<EndpointRegistry> {
        &self.shared.registry
    }

    fn prepare(
        &self,
        id: EndpointId,
        endpoint: &Endpoint,
    ) -> Result<Option<Arc<dyn EndpointRelease>>, RegisterError> {
        match self.prepare_endpoint(id, endpoint) {
            Ok(false) => Ok(None),
            Ok(true) => Ok(Some(Arc::new(Unmap(self.commands.clone())))),
            Err(e) => Err(RegisterError::Engine { engine: NAME.into(), source: Box::new(e) }),
        }
    }
}

/// Unmaps a host endpoint once its registration ended.
struct Unmap(Option<mpsc::Sender<Command>>);

impl EndpointRelease for Unmap {
    fn release(&self, id: EndpointId) {
        if let Some(commands) = &self.0 {
            let _ = commands.send(Command::Unmap { id });
        }
    }
}

impl TransferEngine for RemoteEngine {
    fn name(&self) -> &str {
        NAME
    }

    fn can_handle(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        RemoteRules { shared: Arc::clone(&self.shared) }.carries(src, dst)
    }

    fn plan(&self, fragments: &[Fragment]) -> PlanSet {
        plan_batch(
            &RemoteRules { shared: Arc::clone(&self.shared) },
            &self.shared.registry.snapshot(),
            fragments,
        )
    }

    fn builder(&self) -> Box<dyn PlanBuilder + Send + '_> {
        Box::new(self.incremental_builder())
    }

    fn endpoint_registered(&self, id: EndpointId, endpoint: &Endpoint) -> Result<(), EngineError> {
        self.prepare_endpoint(id, endpoint).map(|_| ()).map_err(|e| Box::new(e) as EngineError)
    }

    fn endpoint_deregistering(&self, id: EndpointId) {
        let _ = self.send(Command::Unmap { id });
    }

    /// Between host memory and a peer reached through the checked path, both ways: a get's
    /// reader opens each record in place and hashes it right after, and a put's writer hashes
    /// each record between copying it out and sealing it, while it is in the cache (such a
    /// request is then one per object's piece). Not one-sided peers, whose bytes the NIC
    /// moves.
    fn hashes_while_copying(&self, src: &Endpoint, dst: &Endpoint) -> bool {
        let checked = |e: &Endpoint| {
            e.remote_region().and_then(|r| self.shared.peer(r.peer)).is_some_and(|p| p.checked)
        };
        (dst.is_host() && checked(src)) || (src.is_host() && checked(dst))
    }

    fn submit(&self, mut plans: PlanSet) -> TransferHandle {
        if plans.expired() {
            let failures = plans.fail_all(NAME, FailureCause::TimedOut);
            return TransferHandle::settled(failures, plans);
        }
        let pins = self.shared.registry.pin(plans.endpoints());
        let (routes, ops, failures) = self.resolve(&mut plans, pins.table());
        if ops.is_empty() {
            drop(pins);
            return TransferHandle::settled(failures, plans);
        }
        let slot = SettleSlot::new();
        let batch = BatchRun::new(plans, pins, routes, ops, failures, Arc::clone(&slot));
        if let Err(mpsc::SendError(Command::Submit(batch))) = self.send_batch(batch) {
            // Dropping an unsettled batch fails every plan of it into the slot.
            drop(batch);
        }
        slot.handle()
    }
}

impl RemoteEngine {
    fn send_batch(&self, batch: Box<BatchRun>) -> Result<(), mpsc::SendError<Command>> {
        match &self.commands {
            Some(commands) => commands.send(Command::Submit(batch)),
            None => Err(mpsc::SendError(Command::Submit(batch))),
        }
    }
}
