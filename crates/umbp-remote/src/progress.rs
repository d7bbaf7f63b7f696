//! The progress thread: owns the UCX worker and every endpoint, posts the requests of
//! submitted batches, progresses UCX, maps completions and failures back to objects, and
//! settles batches.
//!
//! One thread per engine because UCX workers are single-threaded (`UCS_THREAD_MODE_SINGLE`
//! costs no locks on the request path) and because one-sided requests complete only while
//! someone progresses the worker. Submitters never touch UCX: they resolve their plans into
//! flat request lists ([`Op`]) on their own thread and hand the batch over a channel.
//!
//! The thread busy-polls while requests are in flight (what `ucx_perftest` does), and after
//! [`SPINS_BEFORE_SLEEP`] empty polls sleeps on the worker's event descriptor for up to
//! [`SLEEP`], so a slow peer does not burn a core. With nothing in flight it blocks on its
//! command channel, waking every [`IDLE_TICK`] to let UCX notice failed peers.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umbp_plan::{
    EndpointId, EndpointPins, FailedAt, Failure, FailureCause, PlanSet, Segment, SettleSlot,
    Settled, Tag,
};

use crate::channel::Keys;
use crate::checked;
use crate::config::NAME;
use crate::ucp::{self, Access, Context, Endpoint, Event, MemMap, Posted, Worker};
use crate::{Error, RemoteConfig};

/// Empty polls with requests in flight before the thread sleeps on the worker's descriptor.
const SPINS_BEFORE_SLEEP: u32 = 4096;
/// The longest such sleep.
const SLEEP: Duration = Duration::from_millis(1);
/// How often an idle thread progresses UCX anyway.
const IDLE_TICK: Duration = Duration::from_millis(20);
/// How long closing an endpoint may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);
/// Marks the user data of a flush request (else: an op).
const FLUSH: u64 = 1 << 63;
/// Batches in flight at once at most: a batch's slot is 16 bits of a request's user data.
const MAX_BATCHES: usize = 1 << 16;

/// A request's user data: what it is for (an op's index, or a flush's peer), the batch's slot,
/// and the slot's generation, so that a report that came late for a batch that settled (its
/// request swept when its peer died) can never be taken for one of the slot's next batch.
fn user_data(flush: bool, key: u32, generation: u16, index: u32) -> u64 {
    (if flush { FLUSH } else { 0 })
        | (u64::from(generation & 0x7fff) << 48)
        | (u64::from(key) << 32)
        | u64::from(index)
}

/// The parts of a request's user data: flush or op, slot, generation, index.
fn parts(user_data: u64) -> (bool, usize, u16, u32) {
    let key = ((user_data >> 32) & 0xffff) as usize;
    let generation = ((user_data >> 48) & 0x7fff) as u16;
    (user_data & FLUSH != 0, key, generation, user_data as u32)
}

/// How one plan's requests go: to which peer, through which key, which way, from and to
/// which base addresses.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Route {
    /// The peer's index on this thread.
    pub(crate) peer: u32,
    /// The region's key on the peer's endpoint.
    pub(crate) rkey: u32,
    /// A put (offload); else a get (restore).
    pub(crate) write: bool,
    /// The local (host) endpoint.
    pub(crate) local: EndpointId,
    /// Its address.
    pub(crate) local_base: u64,
    /// The remote endpoint's first byte: in the peer's process (one-sided), or in its
    /// region (checked).
    pub(crate) remote_base: u64,
    /// Through the checked request path (no flush: the server confirms each put).
    pub(crate) checked: bool,
}

impl Route {
    /// The route of a plan that failed at submit; it has no requests.
    pub(crate) const FAILED: Self = Self {
        peer: u32::MAX,
        rkey: u32::MAX,
        write: false,
        local: EndpointId::from_raw(u64::MAX),
        local_base: 0,
        remote_base: 0,
        checked: false,
    };
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum OpState {
    Waiting,
    InFlight,
    Done,
    Failed,
}

/// One request: a segment of a plan, or one object's share of it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Op {
    plan: u32,
    segment: u32,
    /// Set on one object's share (re-issued, or hashed): the one object it carries.
    only: Option<Tag>,
    /// Where its bytes are in the local endpoint, and in the remote one.
    pub(crate) local_offset: u64,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    state: OpState,
}

impl Op {
    /// The request moving `bytes` (segment `segment` of plan `plan`, or the share of it
    /// object `only` owns) between the plan's endpoints: from the local one when `write`.
    pub(crate) fn new(
        plan: u32,
        segment: u32,
        only: Option<Tag>,
        bytes: &Segment,
        write: bool,
    ) -> Self {
        let (local_offset, remote_offset) = if write {
            (bytes.src_offset, bytes.dst_offset)
        } else {
            (bytes.dst_offset, bytes.src_offset)
        };
        let len = bytes.len;
        Self { plan, segment, only, local_offset, remote_offset, len, state: OpState::Waiting }
    }
}

/// How the progress thread reaches a peer it connects to.
pub(crate) enum LinkSpec {
    /// One-sided UCX operations: the server's worker address and its regions' keys.
    Ucx { address: Vec<u8>, rkeys: Vec<Vec<u8>> },
    /// The checked request path on authenticated connections (the lanes), each with its
    /// session's keys; their threads report to `notify` (this thread's own command channel).
    Checked { lanes: Vec<(std::net::TcpStream, Keys)>, notify: mpsc::Sender<Command> },
}

/// What the engine (and the checked links' threads) ask of the progress thread.
pub(crate) enum Command {
    Connect {
        peer: u32,
        link: LinkSpec,
        alive: Arc<AtomicBool>,
        reason: Arc<Mutex<String>>,
        reply: mpsc::Sender<Result<u32, Error>>,
    },
    Map {
        id: EndpointId,
        addr: u64,
        len: u64,
        reply: mpsc::Sender<Result<(), Error>>,
    },
    Unmap {
        id: EndpointId,
    },
    Submit(Box<BatchRun>),
    /// A checked request completed (or was refused: the words), with its bytes' CRC32C
    /// where it was asked to hash them.
    CheckedDone {
        user_data: u64,
        result: Result<(), String>,
        crc: Option<u32>,
    },
    PeerLost {
        slot: u32,
        reason: String,
    },
    /// Take no more requests for the peer; close its endpoint once nothing is in flight to it.
    Disconnect {
        slot: u32,
        reply: mpsc::Sender<()>,
    },
    Shutdown,
}

impl From<checked::LinkEvent> for Command {
    fn from(event: checked::LinkEvent) -> Self {
        match event {
            checked::LinkEvent::Done { user_data, result, crc } => {
                Self::CheckedDone { user_data, result, crc }
            }
            checked::LinkEvent::Lost { slot, reason } => Self::PeerLost { slot, reason },
        }
    }
}

/// A submitted batch on its way through the thread.
pub(crate) struct BatchRun {
    plans: Option<PlanSet>,
    pins: Option<EndpointPins>,
    routes: Vec<Route>,
    ops: Vec<Op>,
    /// Failures found at submit.
    early: Vec<Failure>,
    slot: Arc<SettleSlot>,
    deadline: Option<Instant>,
    /// The next op to post.
    next: usize,
    in_flight: usize,
    /// Peers with completed puts, to flush before the batch settles.
    flush: Vec<u32>,
    /// Peers whose flush is in flight.
    flushing: Vec<u32>,
    flush_started: bool,
    failed: Vec<(FailedAt, FailureCause)>,
}

impl BatchRun {
    pub(crate) fn new(
        plans: PlanSet,
        pins: EndpointPins,
        routes: Vec<Route>,
        ops: Vec<Op>,
        early: Vec<Failure>,
        slot: Arc<SettleSlot>,
    ) -> Box<Self> {
        Box::new(Self {
            deadline: plans.deadline(),
            plans: Some(plans),
            pins: Some(pins),
            routes,
            ops,
            early,
            slot,
            next: 0,
            in_flight: 0,
            flush: Vec::new(),
            flushing: Vec::new(),
            flush_started: false,
            failed: Vec::new(),
        })
    }

    fn plans(&self) -> &PlanSet {
        self.plans.as_ref().expect("an unsettled batch has its plans")
    }

    /// Whether the batch's plan set carries a checksum sink (see `hashes_while_copying`).
    fn hashing(&self) -> bool {
        self.plans().copy_hashes().is_some()
    }

    /// Reports op `i`'s piece (one object's) to the plan set's checksum sink.
    fn report_crc(&self, i: usize, crc: u32) {
        let op = self.ops[i];
        let (Some(sink), Some(tag)) = (self.plans().copy_hashes(), op.only) else { return };
        let (src_offset, dst_offset) = match self.routes[op.plan as usize].write {
            true => (op.local_offset, op.remote_offset),
            false => (op.remote_offset, op.local_offset),
        };
        let piece = Segment { src_offset, dst_offset, len: op.len };
        sink.copied(&self.plans().plans()[op.plan as usize], tag, piece, crc);
    }

    fn record(&mut self, op: usize, cause: FailureCause) {
        let op = &mut self.ops[op];
        op.state = OpState::Failed;
        let at =
            FailedAt { tag: op.only, ..FailedAt::segment(op.plan as usize, op.segment as usize) };
        self.failed.push((at, cause));
    }

    /// Fails the completed puts to `peer`: their flush did not confirm them.
    fn fail_puts(&mut self, peer: u32, cause: &FailureCause) {
        for i in 0..self.ops.len() {
            let route = self.routes[self.ops[i].plan as usize];
            if route.write && route.peer == peer && self.ops[i].state == OpState::Done {
                self.record(i, cause.clone());
            }
        }
    }

    /// Re-issues a failed segment as one op per object's share of it.
    fn reissue(&mut self, op: usize) {
        let Op { plan, segment, .. } = self.ops[op];
        self.ops[op].state = OpState::Failed;
        let write = self.routes[plan as usize].write;
        let plans = self.plans.as_ref().expect("an unsettled batch has its plans");
        let pieces: Vec<Op> = plans.plans()[plan as usize]
            .segment_pieces(segment as usize)
            .map(|(tag, piece)| Op::new(plan, segment, Some(tag), &piece, write))
            .collect();
        tracing::debug!(
            plan,
            segment,
            pieces = pieces.len(),
            "re-issuing a failed segment per object"
        );
        self.ops.extend(pieces);
    }

    /// Settles the batch, unsettled and with nothing in flight, with every plan failed.
    fn fail_whole(&mut self, cause: FailureCause) {
        let Some(plans) = self.plans.take() else { return };
        let mut failures = plans.fail_all(NAME, cause);
        failures.append(&mut self.early);
        drop(self.pins.take());
        self.slot.fill(Settled { failures, plans });
    }

    fn finished(&self) -> bool {
        self.next == self.ops.len() && self.in_flight == 0 && self.flushing.is_empty()
    }

    /// Settles the batch into its slot.
    fn settle(&mut self) {
        let Some(plans) = self.plans.take() else { return };
        let mut failures = std::mem::take(&mut self.early);
        self.failed.sort_by_key(|(at, _)| *at);
        self.failed.dedup_by_key(|(at, _)| *at);
        for (at, cause) in self.failed.drain(..) {
            let plan = &plans.plans()[at.plan];
            failures.push(Failure {
                engine: NAME.to_owned(),
                src: plan.src(),
                dst: plan.dst(),
                tags: plans.tags_at(at).to_vec(),
                cause,
            });
        }
        // Unpinned before the handle sees the batch settled, so a deregistration right after
        // the wait does not wait again.
        drop(self.pins.take());
        self.slot.fill(Settled { failures, plans });
    }
}

impl Drop for BatchRun {
    /// A batch dropped unsettled (the thread panicked or is gone) fails every plan, so no
    /// handle waits forever. The thread drops its batches only after its endpoints, so no
    /// request of the batch is in flight any more.
    fn drop(&mut self) {
        if self.plans.is_none() {
            return; // Settled.
        }
        let cause = if std::thread::panicking() {
            FailureCause::Panicked { message: "the UCX progress thread panicked".into() }
        } else {
            FailureCause::NotAccepted(Error::ProgressThreadGone.to_string())
        };
        self.fail_whole(cause);
    }
}

/// How the thread reaches a peer.
enum Link {
    Ucx(Endpoint),
    Checked(checked::Link),
}

impl Link {
    /// Closes the link; with `force`, without waiting for what is in flight (which ends).
    /// Either way, once this returns nothing of the link touches local memory any more.
    fn close(self, force: bool) {
        match self {
            Self::Ucx(ep) => ep.close(force, CLOSE_TIMEOUT),
            Self::Checked(link) => link.close(),
        }
    }
}

/// A peer as the thread holds it.
struct PeerConn {
    id: u32,
    ep: Option<Link>,
    alive: Arc<AtomicBool>,
    reason: Arc<Mutex<String>>,
    /// Requests (ops and flushes) in flight to it.
    in_flight: usize,
    /// When it last answered (or when its first request of a quiet spell went out).
    last_progress: Instant,
}

impl PeerConn {
    fn failure(&self) -> FailureCause {
        let message = self.reason.lock().unwrap_or_else(PoisonError::into_inner).clone();
        FailureCause::PeerFailed { peer: self.id, message }
    }
}

/// The thread's state. Field order is drop order: endpoints close (ending every request)
/// before the mappings, the worker and the context go, and all of them before the batches,
/// whose drop releases the memory the requests used.
struct Progress {
    peers: Vec<PeerConn>,
    maps: HashMap<EndpointId, MemMap>,
    /// UCX, only where one-sided RDMA is configured (see [`start`]).
    worker: Option<Rc<Worker>>,
    context: Option<Rc<Context>>,
    batches: Vec<Option<Box<BatchRun>>>,
    /// Each slot's generation, bumped when a batch settles there.
    generations: Vec<u16>,
    free: Vec<u32>,
    /// Keys of the live batches, oldest first: requests are posted in submission order.
    order: Vec<u32>,
    live: usize,
    in_flight: usize,
    config: RemoteConfig,
    commands: mpsc::Receiver<Command>,
    shutting_down: bool,
    events: Vec<Event>,
    /// Peers being disconnected, with whom to tell once their endpoint closed.
    closing: Vec<(u32, mpsc::Sender<()>)>,
}

/// Starts the progress thread; it reports on `ready` whether UCX came up.
pub(crate) fn start(
    config: RemoteConfig,
    commands: mpsc::Receiver<Command>,
    ready: mpsc::Sender<Result<(), Error>>,
) -> Result<JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name("umbp-ucx-progress".into())
        .spawn(move || {
            // A UCX worker listens for connections on every transport it opens, and over TCP
            // UCX writes a connected peer's put wherever the peer says: a worker is made only
            // where peers are reached one-sided, on RDMA transports alone.
            let (context, worker) =
                if crate::config::hardware_enforced(config.transports.as_deref()) {
                    let setup =
                        Context::new(config.transports.as_deref(), ucp::Features::Initiator)
                            .and_then(|context| {
                                Worker::new(&context).map(|worker| (context, worker))
                            });
                    match setup {
                        Ok((context, worker)) => (Some(context), Some(worker)),
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    }
                } else {
                    (None, None)
                };
            let _ = ready.send(Ok(()));
            let mut progress = Progress {
                peers: Vec::new(),
                maps: HashMap::new(),
                worker,
                context,
                batches: Vec::new(),
                generations: Vec::new(),
                free: Vec::new(),
                order: Vec::new(),
                live: 0,
                in_flight: 0,
                config,
                commands,
                shutting_down: false,
                events: Vec::new(),
                closing: Vec::new(),
            };
            progress.run();
        })
        .map_err(|source| Error::Connect { addr: "progress thread".into(), source })
}

impl Progress {
    fn run(&mut self) {
        let mut spins = 0u32;
        // Whether the last wait for a command got one (not an idle tick).
        let mut busy = false;
        loop {
            // Nothing to poll UCX for (checked requests report through the channel): block,
            // after yielding the core a moment (see `SPIN_BEFORE_SLEEP`) while a batch is in
            // flight (its completions are about to come) or one just ended (a caller waiting
            // on it often submits the next at once); not at every idle tick.
            if self.live == 0 || !self.ucx_in_flight() {
                let next =
                    if self.live > 0 || busy { checked::recv_soon(&self.commands) } else { None };
                let next = match next {
                    Some(command) => Ok(command),
                    None => self.commands.recv_timeout(IDLE_TICK),
                };
                busy = next.is_ok();
                match next {
                    Ok(command) => self.handle(command),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => self.shutting_down = true,
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(command) => self.handle(command),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutting_down = true;
                        break;
                    }
                }
            }
            if self.shutting_down && self.live == 0 {
                break;
            }
            self.post();
            let progressed = self.worker.as_ref().map_or(0, |w| w.progress());
            self.drain_events();
            self.check_timeouts();
            self.settle_finished();
            if !self.closing.is_empty() {
                self.close_drained();
            }
            if progressed == 0 && self.ucx_in_flight() {
                spins += 1;
                if spins >= SPINS_BEFORE_SLEEP {
                    if let Some(worker) = &self.worker {
                        worker.wait(SLEEP);
                    }
                    spins = 0;
                }
            } else {
                spins = 0;
            }
        }
        for peer in &mut self.peers {
            if let Some(link) = peer.ep.take() {
                link.close(false);
            }
        }
    }

    /// Whether a UCX request (or flush) is in flight, which only polling the worker completes.
    fn ucx_in_flight(&self) -> bool {
        self.peers.iter().any(|p| p.in_flight > 0 && matches!(p.ep, Some(Link::Ucx(_))))
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Connect { peer, link, alive, reason, reply } => {
                let slot = self.peers.len() as u32;
                let connected = match link {
                    LinkSpec::Ucx { address, rkeys } => self
                        .worker
                        .as_ref()
                        .ok_or(Error::Config {
                            setting: "transports",
                            reason: "one-sided access needs RDMA transports alone".into(),
                        })
                        .and_then(|worker| worker.connect(&address, slot as usize))
                        .map_err(explain_unreachable)
                        .and_then(|mut ep| {
                            for rkey in &rkeys {
                                ep.unpack(rkey)?;
                            }
                            Ok(Link::Ucx(ep))
                        }),
                    LinkSpec::Checked { lanes, notify } => {
                        let (heartbeat, timeout) =
                            (self.config.heartbeat, self.config.peer_timeout);
                        checked::Link::start(lanes, slot, notify, heartbeat, timeout)
                            .map(Link::Checked)
                            .map_err(|source| Error::Connect {
                                addr: "checked link".into(),
                                source,
                            })
                    }
                };
                let answer = connected.map(|ep| {
                    self.peers.push(PeerConn {
                        id: peer,
                        ep: Some(ep),
                        alive,
                        reason,
                        in_flight: 0,
                        last_progress: Instant::now(),
                    });
                    slot
                });
                let _ = reply.send(answer);
            }
            Command::Map { id, addr, len, reply } => {
                let mapped = match &self.context {
                    Some(context) => {
                        // SAFETY: not a request: `map` registers memory of an endpoint
                        // registered (as host memory, valid until deregistered) and unmaps it
                        // at `Unmap`, which comes once the registration ended and no batch
                        // uses it.
                        let map = unsafe { context.map(addr, len, Access::Local) };
                        map.map(|map| {
                            self.maps.insert(id, map);
                        })
                    }
                    // No UCX: nothing reads the memory but the checked links' threads.
                    None => Ok(()),
                };
                let _ = reply.send(mapped);
            }
            Command::Unmap { id } => {
                self.maps.remove(&id);
            }
            Command::Submit(mut batch) => {
                let key = match self.free.pop() {
                    Some(key) => key,
                    None if self.batches.len() < MAX_BATCHES => {
                        self.batches.push(None);
                        self.generations.push(0);
                        (self.batches.len() - 1) as u32
                    }
                    None => {
                        batch.fail_whole(FailureCause::NotAccepted(format!(
                            "{MAX_BATCHES} batches are in flight on this engine already"
                        )));
                        return;
                    }
                };
                self.batches[key as usize] = Some(batch);
                self.order.push(key);
                self.live += 1;
            }
            Command::CheckedDone { user_data, result, crc } => self.done(user_data, result, crc),
            Command::PeerLost { slot, reason } => self.kill(slot, reason),
            Command::Disconnect { slot, reply } => {
                if let Some(peer) = self.peers.get(slot as usize) {
                    *peer.reason.lock().unwrap_or_else(PoisonError::into_inner) =
                        "disconnected by this node".into();
                    peer.alive.store(false, Ordering::Release);
                }
                self.closing.push((slot, reply));
            }
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Posts waiting ops, oldest batch first, up to the in-flight limit.
    fn post(&mut self) {
        let max = self.config.max_in_flight;
        let now = Instant::now();
        for &key in &self.order {
            let Some(b) = self.batches[key as usize].as_mut() else { continue };
            if b.next < b.ops.len() && b.deadline.is_some_and(|d| now >= d) {
                for i in b.next..b.ops.len() {
                    b.record(i, FailureCause::TimedOut);
                }
                b.next = b.ops.len();
            }
            while b.next < b.ops.len() && self.in_flight < max {
                let i = b.next;
                b.next += 1;
                let op = b.ops[i];
                let route = b.routes[op.plan as usize];
                let peer = &mut self.peers[route.peer as usize];
                let Some(ep) = peer.ep.as_ref().filter(|_| peer.alive.load(Ordering::Acquire))
                else {
                    b.record(i, peer.failure());
                    continue;
                };
                let (local, remote) =
                    (route.local_base + op.local_offset, route.remote_base + op.remote_offset);
                let user_data = user_data(false, key, self.generations[key as usize], i as u32);
                let ep = match ep {
                    Link::Ucx(ep) => ep,
                    Link::Checked(link) => {
                        // The same promise as for a UCX request below: `local .. + len` stays
                        // registered and untouched by others until the request completes or
                        // the link closes (which ends every touch of it).
                        let post = checked::Post {
                            user_data,
                            write: route.write,
                            region: route.rkey,
                            offset: remote,
                            local,
                            len: op.len,
                            // One object's piece (see `push_ops`), hashed for the sink.
                            hash: op.only.is_some() && b.hashing(),
                        };
                        if link.post(post) {
                            b.ops[i].state = OpState::InFlight;
                            b.in_flight += 1;
                            self.in_flight += 1;
                            if peer.in_flight == 0 {
                                peer.last_progress = now;
                            }
                            peer.in_flight += 1;
                        } else {
                            let cause = FailureCause::PeerFailed {
                                peer: peer.id,
                                message: "its link is gone".into(),
                            };
                            b.record(i, cause);
                        }
                        continue;
                    }
                };
                let memh = self.maps.get(&route.local);
                // SAFETY: `local .. local + len` lies inside the host endpoint `route.local`
                // (checked at submit against the pinned registration), which stays registered,
                // hence valid, until this batch settles, and the batch settles only after this
                // request completed or its endpoint was closed. The overlap rule (applied at
                // submit) keeps every other request of the batch from writing the bytes this
                // one reads (a put) or touching those it writes (a get); the registration's
                // contract keeps everyone else off them. `remote .. + len`
                // lies inside the region of key `route.rkey` (checked at submit against the
                // export).
                let posted = unsafe {
                    let local = std::ptr::with_exposed_provenance_mut::<u8>(local as usize);
                    ep.rma(route.write, route.rkey as usize, local, op.len, remote, memh, user_data)
                };
                match posted {
                    Posted::Done => complete(b, i),
                    Posted::Pending => {
                        b.ops[i].state = OpState::InFlight;
                        b.in_flight += 1;
                        self.in_flight += 1;
                        if peer.in_flight == 0 {
                            peer.last_progress = now;
                        }
                        peer.in_flight += 1;
                    }
                    Posted::Failed(status) => fail(b, i, peer, status_failure(status)),
                }
            }
        }
    }

    /// Handles what UCX reported since the last call.
    fn drain_events(&mut self) {
        let mut events = std::mem::take(&mut self.events);
        ucp::take_events(&mut events);
        for event in events.drain(..) {
            match event {
                Event::Done { user_data, status } => {
                    let result = if status == ucp::sys::UCS_OK {
                        Ok(())
                    } else {
                        Err(status_failure(status).1)
                    };
                    self.done(user_data, result, None);
                }
                Event::EndpointFailed { arg, status } => {
                    self.kill(arg as u32, format!("UCX: {}", ucp::status_message(status)));
                }
            }
        }
        self.events = events;
    }

    fn done(&mut self, user_data: u64, result: Result<(), String>, crc: Option<u32>) {
        let (flush, key, generation, index) = parts(user_data);
        if self.generations.get(key).is_none_or(|&g| g & 0x7fff != generation) {
            return; // For a batch that settled: its request was swept.
        }
        let Some(Some(b)) = self.batches.get_mut(key) else { return };
        if flush {
            let Some(at) = b.flushing.iter().position(|&p| p == index) else { return };
            b.flushing.swap_remove(at);
            let peer = &mut self.peers[index as usize];
            peer.in_flight -= 1;
            peer.last_progress = Instant::now();
            if let Err(message) = result {
                let cause = FailureCause::PeerFailed {
                    peer: peer.id,
                    message: format!("flush: {message}"),
                };
                b.fail_puts(index, &cause);
            }
            return;
        }
        let i = index as usize;
        if b.ops.get(i).is_none_or(|op| op.state != OpState::InFlight) {
            return; // Swept when its peer died.
        }
        b.in_flight -= 1;
        self.in_flight -= 1;
        let peer = &mut self.peers[b.routes[b.ops[i].plan as usize].peer as usize];
        peer.in_flight -= 1;
        peer.last_progress = Instant::now();
        match result {
            Ok(()) => {
                if let Some(crc) = crc {
                    b.report_crc(i, crc);
                }
                complete(b, i);
            }
            Err(message) => fail(b, i, peer, (false, message)),
        }
    }

    /// Declares a peer dead: closes its endpoint by force (every request to it ends) and
    /// fails what is in flight to it.
    fn kill(&mut self, slot: u32, reason: String) {
        let Some(peer) = self.peers.get_mut(slot as usize) else { return };
        if peer.ep.is_none() {
            return;
        }
        tracing::warn!(peer = peer.id, %reason, "peer declared dead");
        *peer.reason.lock().unwrap_or_else(PoisonError::into_inner) = reason;
        peer.alive.store(false, Ordering::Release);
        if let Some(link) = peer.ep.take() {
            link.close(true);
        }
        // The forced close completed every request on the endpoint with an error (UCX purges
        // the requests it tracks for endpoints in peer-failure mode inside the close); handle
        // those reports, then fail any request whose report did not come, as bookkeeping. A
        // report that still came later would carry a settled batch's generation and be
        // ignored.
        self.drain_events();
        let cause = self.peers[slot as usize].failure();
        for b in self.batches.iter_mut().flatten() {
            for i in 0..b.ops.len() {
                let route = b.routes[b.ops[i].plan as usize];
                if route.peer == slot && b.ops[i].state == OpState::InFlight {
                    b.in_flight -= 1;
                    self.in_flight -= 1;
                    b.record(i, cause.clone());
                }
            }
            if let Some(at) = b.flushing.iter().position(|&p| p == slot) {
                b.flushing.swap_remove(at);
                b.fail_puts(slot, &cause);
            }
        }
        self.peers[slot as usize].in_flight = 0;
    }

    /// Closes the endpoints of peers being disconnected once no request is in flight to them
    /// and no batch still has puts to confirm there.
    fn close_drained(&mut self) {
        let (peers, batches) = (&mut self.peers, &self.batches);
        self.closing.retain(|(slot, reply)| {
            let Some(peer) = peers.get_mut(*slot as usize) else { return false };
            let unconfirmed = batches
                .iter()
                .flatten()
                .any(|b| b.flush.contains(slot) || b.flushing.contains(slot));
            if peer.in_flight > 0 || unconfirmed {
                return true;
            }
            if let Some(link) = peer.ep.take() {
                link.close(false);
            }
            let _ = reply.send(());
            false
        });
    }

    fn check_timeouts(&mut self) {
        let timeout = self.config.peer_timeout;
        let now = Instant::now();
        let late: Vec<u32> = (0..self.peers.len() as u32)
            .filter(|&s| {
                let p = &self.peers[s as usize];
                p.ep.is_some() && p.in_flight > 0 && now.duration_since(p.last_progress) > timeout
            })
            .collect();
        for slot in late {
            self.kill(slot, format!("no answer for {timeout:?}"));
        }
    }

    /// Flushes the puts of batches whose requests all completed, and settles the batches
    /// with nothing left in flight.
    fn settle_finished(&mut self) {
        let mut settled = false;
        for key in self.order.iter().map(|&k| k as usize) {
            let Some(b) = self.batches[key].as_mut() else { continue };
            if !b.finished() {
                continue;
            }
            if !b.flush_started {
                b.flush_started = true;
                for peer_slot in std::mem::take(&mut b.flush) {
                    let peer = &mut self.peers[peer_slot as usize];
                    let Some(Link::Ucx(ep)) = peer.ep.as_ref() else {
                        b.fail_puts(peer_slot, &peer.failure());
                        continue;
                    };
                    let data = user_data(true, key as u32, self.generations[key], peer_slot);
                    match ep.flush(data) {
                        Posted::Done => {}
                        Posted::Pending => {
                            b.flushing.push(peer_slot);
                            if peer.in_flight == 0 {
                                peer.last_progress = Instant::now();
                            }
                            peer.in_flight += 1;
                        }
                        Posted::Failed(status) => {
                            let cause = FailureCause::PeerFailed {
                                peer: peer.id,
                                message: format!("flush: {}", ucp::status_message(status)),
                            };
                            b.fail_puts(peer_slot, &cause);
                        }
                    }
                }
                if !b.finished() {
                    continue;
                }
            }
            let mut b = self.batches[key].take().expect("checked above");
            b.settle();
            self.generations[key] = self.generations[key].wrapping_add(1);
            self.free.push(key as u32);
            self.live -= 1;
            settled = true;
        }
        if settled {
            let batches = &self.batches;
            self.order.retain(|&k| batches[k as usize].is_some());
        }
    }
}

/// Endpoints fail every request to a dead peer only on transports that can report one
/// (`UCP_ERR_HANDLING_MODE_PEER`); UCX leaves the others out, and with none left the peer is
/// "unreachable". Says so, since UCX's own words do not.
fn explain_unreachable(e: Error) -> Error {
    match e {
        Error::Ucx { op, status: -6, message } => Error::Ucx {
            op,
            status: -6,
            message: format!(
                "{message}: no transport allowed here can report a dead peer, which the engine \
                 needs to fail exactly the objects in flight to it (UCX 1.13's shared-memory \
                 transports cannot; allow tcp or an RDMA transport)"
            ),
        },
        other => other,
    }
}

/// Op `i` of `b` completed.
fn complete(b: &mut BatchRun, i: usize) {
    b.ops[i].state = OpState::Done;
    let route = b.routes[b.ops[i].plan as usize];
    if route.write && !route.checked && !b.flush.contains(&route.peer) {
        b.flush.push(route.peer);
    }
}

/// A UCX status as a failure: whether the request was cancelled, and UCX's words.
fn status_failure(status: ucp::sys::Status) -> (bool, String) {
    (ucp::is_canceled(status), ucp::status_message(status))
}

/// Op `i` of `b` failed (`canceled` by a forced close, or with `message`): re-issued per
/// object when it carried several and its peer lives, else recorded.
fn fail(b: &mut BatchRun, i: usize, peer: &PeerConn, (canceled, message): (bool, String)) {
    let op = b.ops[i];
    let alive = peer.alive.load(Ordering::Acquire) && !canceled;
    let shared = b.plans().plans()[op.plan as usize].segment_tags(op.segment as usize).len() > 1;
    if alive && op.only.is_none() && shared {
        b.reissue(i);
        return;
    }
    let cause = if alive {
        FailureCause::PeerFailed { peer: peer.id, message: format!("request: {message}") }
    } else {
        peer.failure()
    };
    b.record(i, cause);
}

#[cfg(test)]
mod tests {
    use super::{parts, user_data, MAX_BATCHES};

    #[test]
    fn user_data_keeps_every_part_apart() {
        for flush in [false, true] {
            for key in [0, 1, (MAX_BATCHES - 1) as u32] {
                for generation in [0u16, 1, 0x7fff, 0x8001] {
                    for index in [0, 7, u32::MAX] {
                        let got = parts(user_data(flush, key, generation, index));
                        assert_eq!(got, (flush, key as usize, generation & 0x7fff, index));
                    }
                }
            }
        }
    }
}
