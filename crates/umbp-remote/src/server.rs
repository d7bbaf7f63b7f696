//! The serving side: the node that owns the memory exports regions of it to peers.
//!
//! One thread (an event loop over non-blocking sockets) accepts connections and runs every
//! handshake, each under one deadline for the whole of it; a connection that has not proved
//! the secret costs a socket and no thread, and past [`ServerLimits`]' bounds one such
//! connection is closed, chosen fairly ([`Table::victim`]); refusals are counted, and a log
//! thread summarizes them at most once a second. An authenticated client gets one thread, which serves its checked
//! requests (or, in one-sided mode, watches its connection), up to
//! [`ServerLimits::max_clients`].

use std::any::Any;
use std::cmp::Reverse;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use umbp_plan::HostMemory;

use crate::channel::{Keys, Protection, Side};
use crate::checked::{self, Ended, Served};
use crate::config::{hardware_enforced, Congestion};
use crate::handshake::{self, Auth, Verdict, Welcome, WireRegion};
use crate::stats::{Counters, ServerStats};
use crate::ucp::{self, Access, Context, Worker};
use crate::{Error, RemoteConfig, ServerLimits};

/// How long the server's threads sleep between checks for shutdown while idle.
const IDLE_TICK: Duration = Duration::from_millis(50);
/// Empty polls before the UCX thread sleeps on the worker's descriptor.
const SPINS_BEFORE_SLEEP: u32 = 4096;
/// The first pause after `accept` fails (out of descriptors, say); doubled up to the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);
/// Connections accepted at most before the handshakes in progress are stepped again.
const ACCEPTS_PER_TURN: usize = 32;
/// The least backlog the listening socket asks the kernel for (which caps it at
/// `net.core.somaxconn`): a flood that fills a short queue has honest clients' connection
/// requests dropped before the server sees them.
const MIN_BACKLOG: usize = 1024;
/// The refusals' log writes at most one line per this long.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(1);

/// One region to export, before serving.
struct Export {
    name: String,
    addr: u64,
    len: u64,
    writable: bool,
    keep: Box<dyn Any + Send>,
}

/// Gathers the regions a [`RemoteServer`] exports.
///
/// ```no_run
/// use umbp_remote::{ServerBuilder, RemoteConfig};
///
/// let arena = vec![0u8; 64 << 20]; // the KV pool's pages
/// // The secret comes from UMBP_UCX_SECRET; clients need the same one.
/// let server = ServerBuilder::new(RemoteConfig::default())
///     .export("kv-arena", arena, true)
///     .serve("10.0.0.2:7400")?; // the interface the compute nodes reach, not 0.0.0.0
/// println!("serving on {}", server.local_addr());
/// // ... until the node shuts down; `shutdown` hands the arena back.
/// let arena: Vec<u8> = server.shutdown().take("kv-arena").unwrap();
/// # Ok::<(), umbp_remote::Error>(())
/// ```
pub struct ServerBuilder {
    config: RemoteConfig,
    exports: Vec<Export>,
    node: Option<u32>,
}

impl ServerBuilder {
    /// A server with `config` (its transports, secret and limits) and no region yet.
    pub fn new(config: RemoteConfig) -> Self {
        Self { config, exports: Vec::new(), node: None }
    }

    /// Names the node this server serves as (its node id in a pool, as its
    /// `pool::Membership` announces it) in every client's welcome, bound to the session like
    /// the rest of it. A client that dials a node it looked up
    /// ([`RemoteEngine::connect_node`](crate::RemoteEngine::connect_node), as the pool's resolver
    /// does) refuses a server that names another node or none: a memory node that joins a
    /// pool must be named with the id it joins under, or the pool's clients refuse it.
    /// `umbp-ucx-serve --pool` names it with `--node-id`.
    pub fn node(mut self, node: u32) -> Self {
        self.node = Some(node);
        self
    }

    /// Exports `memory` as region `name` (regions are numbered in the order they are
    /// exported). Authenticated peers may read it, and write it when `writable`, until the
    /// server shuts down; the server owns it meanwhile and [`RemoteServer::shutdown`] hands it
    /// back.
    pub fn export<M: HostMemory + Send>(
        mut self,
        name: &str,
        mut memory: M,
        writable: bool,
    ) -> Self {
        // Exposed, so that the address can be turned back into a pointer.
        let (addr, len) = (memory.as_mut_ptr().expose_provenance() as u64, memory.len() as u64);
        self.exports.push(Export {
            name: name.to_owned(),
            addr,
            len,
            writable,
            keep: Box::new(memory),
        });
        self
    }

    /// Exports memory only the caller can vouch for (a pool allocated elsewhere).
    ///
    /// # Safety
    ///
    /// `addr .. addr + len` stays mapped until the server has shut down (or been dropped),
    /// and the caller accepts that authenticated peers read it, and write it when
    /// `writable`, at any time meanwhile.
    #[allow(unsafe_code)] // Declares the obligation; the server serves what it is given.
    pub unsafe fn export_raw(mut self, name: &str, addr: u64, len: u64, writable: bool) -> Self {
        self.exports.push(Export {
            name: name.to_owned(),
            addr,
            len,
            writable,
            keep: Box::new(()),
        });
        self
    }

    /// Starts serving on `listen`: a thread that accepts connections and answers their
    /// handshakes, and, on RDMA transports only, a thread that progresses UCX.
    ///
    /// Refused ([`Error::Config`]) without a shared secret unless the configuration says
    /// [`insecure_no_auth`](RemoteConfig::insecure_no_auth).
    pub fn serve(self, listen: impl ToSocketAddrs) -> Result<RemoteServer, Error> {
        let auth = match self.config.auth()? {
            Auth::Keyed(secret) => Some(secret.to_vec()),
            Auth::Insecure => None,
        };
        self.config.check_congestion()?;
        let limits = self.config.limits.clone();
        if limits.max_clients == 0 || limits.max_handshakes == 0 {
            return Err(Error::Config {
                setting: "limits",
                reason: "a server must take at least one client and one handshake".into(),
            });
        }
        let backlog = limits.max_handshakes.max(MIN_BACKLOG);
        let listener = listen_on(listen, backlog, &self.config.congestion)
            .map_err(|source| Error::Connect { addr: "listen address".into(), source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| Error::Connect { addr: "listener".into(), source })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| Error::Connect { addr: "listener".into(), source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let one_sided = hardware_enforced(self.config.transports.as_deref());
        // Client threads wait on the reading end besides their socket: shutting the writing
        // end down (a drain) wakes them all between requests.
        let (drain_tx, drain_rx) = UnixStream::pair()
            .map_err(|source| Error::Connect { addr: "drain pipe".into(), source })?;
        let mut server = RemoteServer {
            local_addr,
            stop,
            accepting: Arc::new(AtomicBool::new(true)),
            drain: drain_tx,
            counters: Arc::new(Counters::default()),
            progress: None,
            accept: None,
            log: None,
            clients: Arc::new(Mutex::new(HashMap::new())),
            regions: self.exports.iter().map(|e| (e.name.clone(), e.len, e.writable)).collect(),
            exports: Mutex::new(Vec::new()),
            one_sided,
            node: self.node,
        };
        let keys = if one_sided {
            let ranges: Vec<(u64, u64, bool)> =
                self.exports.iter().map(|e| (e.addr, e.len, e.writable)).collect();
            let (ready, started) = mpsc::channel();
            let transports = self.config.transports.clone();
            let stop = Arc::clone(&server.stop);
            server.progress = Some(
                std::thread::Builder::new()
                    .name("umbp-ucx-serve".into())
                    .spawn(move || serve_ucx(transports.as_deref(), &ranges, &ready, &stop))
                    .map_err(|source| Error::Connect { addr: "progress thread".into(), source })?,
            );
            match started.recv() {
                Ok(Ok(keys)) => Some(keys),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(Error::ProgressThreadGone),
            }
        } else {
            None
        };
        let served: Arc<[Served]> =
            self.exports.iter().map(|e| Served::new(e.addr, e.len, e.writable)).collect();
        let (address, rkeys) = match keys {
            Some((address, rkeys)) => (Some(address), rkeys.into_iter().map(Some).collect()),
            None => (None, vec![None; self.exports.len()]),
        };
        let regions: Vec<WireRegion> = self
            .exports
            .iter()
            .zip(rkeys)
            .map(|(e, rkey)| WireRegion {
                name: e.name.clone(),
                writable: e.writable,
                len: e.len,
                one_sided: rkey.map(|k| (e.addr, k)),
            })
            .collect();
        server.exports = Mutex::new(self.exports.into_iter().map(|e| (e.name, e.keep)).collect());
        let welcome = handshake::welcome_bytes(&Welcome { address, node: self.node, regions });
        // The refusals' log: the handshake thread wakes it (never waiting) and it writes at most
        // a line a second; it ends once the handshake thread has (its sender dropped).
        let (wake_log, woken) = mpsc::sync_channel(1);
        server.log = Some({
            let counters = Arc::clone(&server.counters);
            std::thread::Builder::new()
                .name("umbp-ucx-log".into())
                .spawn(move || log_refusals(&counters, &woken))
                .map_err(|source| Error::Connect { addr: "log thread".into(), source })?
        });
        let accept = {
            let ctx = Handshakes {
                listener,
                welcome,
                secret: auth,
                protection: self.config.protection,
                deadline: self.config.connect_timeout,
                timing: checked::Timing {
                    stalled: self.config.peer_timeout,
                    idle: self.config.idle_timeout,
                },
                limits,
                congestion: self.config.congestion.clone(),
                served,
                one_sided,
                accepting: Arc::clone(&server.accepting),
                drain: Arc::new(drain_rx),
                counters: Arc::clone(&server.counters),
                clients: Arc::clone(&server.clients),
                next: 0,
                log: wake_log,
            };
            std::thread::Builder::new()
                .name("umbp-ucx-accept".into())
                .spawn(move || ctx.run())
                .map_err(|source| Error::Connect { addr: "accept thread".into(), source })?
        };
        server.accept = Some(accept);
        tracing::info!(%local_addr, regions = server.regions.len(), one_sided, "serving");
        Ok(server)
    }
}

/// Memory exported to peers, served until [`shutdown`](Self::shutdown) or drop.
pub struct RemoteServer {
    local_addr: SocketAddr,
    /// Stops the UCX thread.
    stop: Arc<AtomicBool>,
    /// Cleared to stop the accept thread (which then closes the listener).
    accepting: Arc<AtomicBool>,
    /// Shut down to wake the client threads for a drain.
    drain: UnixStream,
    counters: Arc<Counters>,
    progress: Option<JoinHandle<()>>,
    accept: Option<JoinHandle<()>>,
    /// The refusals' log; ends after the accept thread.
    log: Option<JoinHandle<()>>,
    /// Authenticated clients: their connection and their thread, ended when the server stops.
    clients: Clients,
    regions: Vec<(String, u64, bool)>,
    /// What backs each region; dropped only once no thread can reach it.
    /// (Behind a lock only so that the server is `Sync`: nothing reads them while serving.)
    exports: Mutex<Vec<(String, Box<dyn Any + Send>)>>,
    one_sided: bool,
    /// The node named in every welcome ([`ServerBuilder::node`]).
    node: Option<u32>,
}

impl std::fmt::Debug for RemoteServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteServer")
            .field("local_addr", &self.local_addr)
            .field("regions", &self.regions)
            .field("one_sided", &self.one_sided)
            .field("node", &self.node)
            .finish()
    }
}

impl RemoteServer {
    /// The address clients connect to ([`RemoteEngine::connect`](crate::RemoteEngine::connect)).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The exported regions in order: name, length, writable.
    pub fn regions(&self) -> &[(String, u64, bool)] {
        &self.regions
    }

    /// The node this server names in its welcome ([`ServerBuilder::node`]), if any.
    pub fn node(&self) -> Option<u32> {
        self.node
    }

    /// Authenticated clients whose connection is open now: connections, so an engine's
    /// link counts once per lane ([`RemoteConfig::lanes`](crate::RemoteConfig::lanes)).
    pub fn clients(&self) -> usize {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether clients reach the regions with one-sided RDMA operations (remote keys,
    /// enforced by the NIC); else every access is a request the server checks.
    pub fn one_sided(&self) -> bool {
        self.one_sided
    }

    /// What the server counted so far (a handle that reads them from any thread, also after
    /// the server stopped).
    pub fn stats(&self) -> ServerStats {
        ServerStats::of(Arc::clone(&self.counters))
    }

    /// Stops serving (clients see their peer go away) and hands back what backed the regions,
    /// once no thread of the server can touch them.
    pub fn shutdown(mut self) -> Exports {
        self.stop_threads();
        Exports(std::mem::take(self.exports.get_mut().unwrap_or_else(PoisonError::into_inner)))
    }

    /// Stops serving gracefully: closes the listener at once (new connections are refused,
    /// handshakes in progress closed), lets every checked client's request in progress finish
    /// and reach the client (its session then ends before the next request: the client sees
    /// its peer go away, and what it had not yet had answered fails), waits up to `deadline`
    /// for that (a client that neither reads its end nor closes its connection is given
    /// at most `peer_timeout` of it), then stops
    /// as [`shutdown`](Self::shutdown) does and hands back the regions. One-sided clients'
    /// requests are the NIC's, and are not waited for.
    pub fn drain(mut self, deadline: Duration) -> Exports {
        let until = Instant::now() + deadline;
        self.stop_accepting();
        let _ = self.drain.shutdown(Shutdown::Write);
        while !self.one_sided && self.clients() > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.shutdown()
    }

    fn stop_accepting(&mut self) {
        self.accepting.store(false, Ordering::Release);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        if let Some(log) = self.log.take() {
            let _ = log.join();
        }
    }

    fn stop_threads(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.stop_accepting();
        let clients: Vec<_> =
            self.clients.lock().unwrap_or_else(PoisonError::into_inner).drain().collect();
        for (_, (stream, _)) in &clients {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, (_, thread)) in clients {
            let _ = thread.join();
        }
        if let Some(progress) = self.progress.take() {
            let _ = progress.join();
        }
    }
}

impl Drop for RemoteServer {
    fn drop(&mut self) {
        self.stop_threads();
        // `exports` drops after this, once nothing can reach them.
    }
}

/// What backed the regions of a server that shut down, by region name.
pub struct Exports(Vec<(String, Box<dyn Any + Send>)>);

impl Exports {
    /// The memory exported as `name`, if it was exported with [`ServerBuilder::export`] as an
    /// `M`.
    pub fn take<M: 'static>(&mut self, name: &str) -> Option<M> {
        let at = self.0.iter().position(|(n, keep)| n == name && keep.is::<M>())?;
        self.0.swap_remove(at).1.downcast().ok().map(|b| *b)
    }
}

/// What the server's UCX thread reports once up: its worker address and each region's packed
/// remote key.
type UcxKeys = (Vec<u8>, Vec<Vec<u8>>);

/// The server's UCX thread (one-sided mode): maps the regions, reports the keys, then
/// progresses until told to stop. Its context has no RMA feature, so UCX's software
/// emulation of one-sided operations (which checks no key) is not even installed: only the
/// NIC serves peers' gets and puts, within the registered regions and their rights.
fn serve_ucx(
    transports: Option<&str>,
    ranges: &[(u64, u64, bool)],
    ready: &mpsc::Sender<Result<UcxKeys, Error>>,
    stop: &AtomicBool,
) {
    let setup = || -> Result<_, Error> {
        let context = Context::new(transports, ucp::Features::TargetOnly)?;
        let worker = Worker::new(&context)?;
        let mut maps = Vec::new();
        let mut keys = Vec::new();
        for &(addr, len, writable) in ranges {
            let access = if writable { Access::RemoteWrite } else { Access::RemoteRead };
            // SAFETY: the builder's `export` owns the memory (kept by the server until this
            // thread has exited and dropped the mapping) or the caller of `export_raw`
            // promised it stays mapped that long.
            #[allow(unsafe_code)]
            let map = unsafe { context.map(addr, len, access) }?;
            keys.push(map.pack()?);
            maps.push(map);
        }
        Ok((worker.address()?, keys, worker, maps))
    };
    let (worker, _maps) = match setup() {
        Ok((address, keys, worker, maps)) => {
            let _ = ready.send(Ok((address, keys)));
            (worker, maps)
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut events = Vec::new();
    let mut idle = 0u32;
    while !stop.load(Ordering::Acquire) {
        if worker.progress() > 0 {
            idle = 0;
        } else {
            idle += 1;
            if idle >= SPINS_BEFORE_SLEEP {
                worker.wait(IDLE_TICK);
            }
        }
        // The server posts nothing; failures of clients' endpoints are theirs to handle.
        ucp::take_events(&mut events);
        events.clear();
    }
}

/// Authenticated clients by connection number: their connection and their thread.
type Clients = Arc<Mutex<HashMap<u64, (TcpStream, JoinHandle<()>)>>>;

/// Where one connection's handshake stands.
enum Step {
    /// Reading the hello (`have` bytes so far).
    Hello { buf: [u8; handshake::HELLO_LEN], have: usize },
    /// Sending the challenge.
    Challenge {
        out: [u8; handshake::CHALLENGE_LEN],
        sent: usize,
        hello: [u8; handshake::HELLO_LEN],
    },
    /// Reading the client's proof.
    Proof {
        buf: [u8; handshake::PROOF],
        have: usize,
        hello: [u8; handshake::HELLO_LEN],
        challenge: [u8; handshake::CHALLENGE_LEN],
    },
    /// Sending the verdict; with the session's keys when it accepts the client.
    Verdict { out: Vec<u8>, sent: usize, admit: Option<Box<Keys>> },
}

impl Step {
    /// How far the handshake got, in steps. Of one address's connections, one that got least
    /// far goes first: connections that never finish a hello (silent, or trickling it) never
    /// push out one that is answering. Only after the address and the wait (see
    /// [`Table::victim`]): a flood that says its hello and stops gets as far as an honest
    /// client waiting for its proof.
    fn progress(&self) -> u8 {
        match self {
            Self::Hello { .. } => 0,
            Self::Challenge { .. } | Self::Proof { .. } => 1,
            Self::Verdict { .. } => 2,
        }
    }
}

/// A connection in its handshake.
struct Pending {
    stream: TcpStream,
    ip: IpAddr,
    /// The client's address and port, for the logs.
    peer: SocketAddr,
    deadline: Instant,
    step: Step,
    /// When its handshake last moved on a step (accepted, hello read, challenge sent, proof
    /// read): an honest client answers the challenge within its round trip, while a
    /// connection that stops after its hello waits here until it is closed. Of the
    /// connections that may make room, the one waiting longest goes first.
    moved: Instant,
    /// Whether it was in a `poll` of the handshake loop since it was accepted (and was read
    /// and answered as far as its bytes allowed, at its accept and then when ready). Only such
    /// a connection is closed to make room: a new one always has its turn first.
    polled: bool,
}

/// The connections in their handshake, and how many each address has.
#[derive(Default)]
struct Table {
    list: Vec<Pending>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Table {
    fn len(&self) -> usize {
        self.list.len()
    }

    /// Connections of `ip` in their handshake.
    fn count(&self, ip: IpAddr) -> usize {
        self.per_ip.get(&ip).copied().unwrap_or(0)
    }

    fn push(&mut self, p: Pending) {
        *self.per_ip.entry(p.ip).or_default() += 1;
        self.list.push(p);
    }

    /// Takes connection `at` out (the last one takes its place).
    fn remove(&mut self, at: usize) -> Pending {
        let p = self.list.swap_remove(at);
        if let Entry::Occupied(mut n) = self.per_ip.entry(p.ip) {
            *n.get_mut() -= 1;
            if *n.get() == 0 {
                n.remove();
            }
        }
        p
    }

    /// Closes the connections `keep` says no to; returns how many.
    fn retain(&mut self, mut keep: impl FnMut(&Pending) -> bool) -> u64 {
        let (mut at, mut closed) = (0, 0);
        while at < self.list.len() {
            if keep(&self.list[at]) {
                at += 1;
            } else {
                self.remove(at);
                closed += 1;
            }
        }
        closed
    }

    /// The connection to close to make room (one of `ip`'s, when given), if any may be: of
    /// those polled at least once, one of the address with the most connections in their
    /// handshake; of its, one that got least far ([`Step::progress`]), and of those the one
    /// that waited longest since its handshake last moved on.
    ///
    /// So a flood from some addresses is paid for by those addresses (an address that holds
    /// one connection loses it only once no address holds more), a connection that was never
    /// read is never closed for room, and of one address's connections those that stopped
    /// answering go before one that is answering (an honest client sends its proof as soon
    /// as it read the challenge; a flood that only says hello never does).
    fn victim(&self, ip: Option<IpAddr>) -> Option<usize> {
        self.list
            .iter()
            .enumerate()
            .filter(|(_, p)| p.polled && ip.is_none_or(|ip| p.ip == ip))
            .max_by_key(|(_, p)| (self.count(p.ip), Reverse(p.step.progress()), Reverse(p.moved)))
            .map(|(at, _)| at)
    }
}

/// The accept thread's state.
struct Handshakes {
    listener: TcpListener,
    /// The welcome, the same for every client (sealed for each).
    welcome: Vec<u8>,
    /// The shared secret; `None` when running insecure.
    secret: Option<Vec<u8>>,
    /// The least protection this server serves a session with.
    protection: Protection,
    deadline: Duration,
    /// How long a client may take to read one answer before its connection is closed, and
    /// how long one may stay silent.
    timing: checked::Timing,
    limits: ServerLimits,
    /// The congestion control each admitted client's connection gets.
    congestion: Congestion,
    served: Arc<[Served]>,
    one_sided: bool,
    /// Cleared when the server stops accepting.
    accepting: Arc<AtomicBool>,
    /// The drain descriptor the client threads wait on.
    drain: Arc<UnixStream>,
    counters: Arc<Counters>,
    clients: Clients,
    next: u64,
    /// Wakes the refusals' log ([`log_refusals`]); sent to with `try_send` only.
    log: mpsc::SyncSender<()>,
}

/// What one step of a handshake came to.
enum Outcome {
    /// Waiting for the socket.
    Wait,
    /// Handshake done: serve the client with the session's keys.
    Admit(Box<Keys>),
    /// Over (refused, failed, or finished telling a refusal).
    Close,
}

impl Handshakes {
    fn run(mut self) {
        let mut pending = Table::default();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut backoff = ACCEPT_BACKOFF;
        let mut accept_after = Instant::now();
        while self.accepting.load(Ordering::Acquire) {
            let now = Instant::now();
            // Close what passed its deadline.
            let late = pending.retain(|p| p.deadline > now);
            if late > 0 {
                self.counters.refused_deadline.fetch_add(late, Ordering::Relaxed);
                let _ = self.log.try_send(());
            }
            fds.clear();
            let listening = now >= accept_after;
            fds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: if listening { libc::POLLIN } else { 0 },
                revents: 0,
            });
            for p in &pending.list {
                let events = match p.step {
                    Step::Hello { .. } | Step::Proof { .. } => libc::POLLIN,
                    Step::Challenge { .. } | Step::Verdict { .. } => libc::POLLOUT,
                };
                fds.push(libc::pollfd { fd: p.stream.as_raw_fd(), events, revents: 0 });
            }
            let mut wait = IDLE_TICK;
            if let Some(first) = pending.list.iter().map(|p| p.deadline).min() {
                wait = wait.min(first.saturating_duration_since(now));
            }
            if !listening {
                wait = wait.min(accept_after.saturating_duration_since(now));
            }
            // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfds.
            #[allow(unsafe_code)]
            let ready = unsafe {
                libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait.as_millis() as i32)
            };
            // Every connection here had its turn: what it had sent is read below.
            for p in &mut pending.list {
                p.polled = true;
            }
            if ready <= 0 {
                continue;
            }
            // Step the connections that are ready (before accepting, so indexes match).
            let mut i = 0;
            let mut k = 1;
            while i < pending.len() {
                let revents = fds[k].revents;
                k += 1;
                if revents == 0 {
                    i += 1;
                    continue;
                }
                match self.step(&mut pending.list[i]) {
                    Outcome::Wait => i += 1,
                    Outcome::Admit(keys) => {
                        let p = pending.remove(i);
                        fds.swap_remove(k - 1);
                        k -= 1;
                        self.admit(p, *keys, &mut pending);
                    }
                    Outcome::Close => {
                        pending.remove(i);
                        fds.swap_remove(k - 1);
                        k -= 1;
                    }
                }
            }
            if listening && fds[0].revents != 0 {
                match self.accept(&mut pending) {
                    Ok(()) => backoff = ACCEPT_BACKOFF,
                    // Out of descriptors with handshakes pending: one makes room (as past a
                    // bound), so new connections (an honest client among them) still get in.
                    Err(e) if out_of_descriptors(&e) && pending.len() > 0 => {
                        if let Some(at) = pending.victim(None) {
                            let p = pending.remove(at);
                            self.refused(&self.counters.refused_displaced, p.peer);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, pause = ?backoff, "accept failed; pausing");
                        accept_after = Instant::now() + backoff;
                        backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                    }
                }
            }
        }
    }

    /// Accepts waiting connections, at most [`ACCEPTS_PER_TURN`] before the handshakes in
    /// progress are stepped again (a flood queue is never drained first); each starts its
    /// handshake under its deadline and is stepped at once (an honest client's hello is
    /// usually there already, and its challenge goes out now).
    ///
    /// Past a bound a connection polled at least once makes room ([`Table::victim`]): past
    /// the address's bound one of that address (or, when all of its were accepted in this
    /// turn, the new one is closed); past the bound of all, one of the address with the most.
    /// When only connections accepted in this turn could make room, accepting stops until
    /// they were polled: the rest wait in the kernel's queue meanwhile.
    fn accept(&mut self, pending: &mut Table) -> io::Result<()> {
        for _ in 0..ACCEPTS_PER_TURN {
            let full = pending.len() >= self.limits.max_handshakes;
            let room = if full {
                match pending.victim(None) {
                    Some(at) => Some(at),
                    None => return Ok(()),
                }
            } else {
                None
            };
            let (stream, peer) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
                Err(e) => return Err(e),
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = stream.set_nodelay(true);
            let ip = peer.ip();
            if pending.count(ip) >= self.limits.max_handshakes_per_ip.max(1) {
                match pending.victim(Some(ip)) {
                    Some(at) => {
                        let p = pending.remove(at);
                        self.refused(&self.counters.refused_displaced, p.peer);
                    }
                    None => {
                        // Every connection of this address came in this turn: this one waits
                        // for none of them.
                        self.refused(&self.counters.refused_displaced, peer);
                        continue;
                    }
                }
            } else if let Some(at) = room {
                let p = pending.remove(at);
                self.refused(&self.counters.refused_displaced, p.peer);
            }
            let now = Instant::now();
            let mut p = Pending {
                stream,
                ip,
                peer,
                deadline: now + self.deadline,
                step: Step::Hello { buf: [0; handshake::HELLO_LEN], have: 0 },
                moved: now,
                polled: false,
            };
            match self.step(&mut p) {
                Outcome::Wait => pending.push(p),
                Outcome::Admit(keys) => self.admit(p, *keys, pending),
                Outcome::Close => {}
            }
        }
        Ok(())
    }

    /// Counts a refused (or closed) handshake of `peer` under `counter`, and wakes the
    /// refusals' log, which writes at most a line a second: this thread never waits on it.
    fn refused(&self, counter: &AtomicU64, peer: SocketAddr) {
        counter.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.counters.last_refused.try_lock() {
            *last = Some(peer);
        }
        let _ = self.log.try_send(());
    }

    /// Moves one handshake on as far as its socket allows. Refusals are counted, never
    /// logged here (see [`refused`](Self::refused)).
    fn step(&self, p: &mut Pending) -> Outcome {
        let peer = p.peer;
        loop {
            let next = match &mut p.step {
                Step::Hello { buf, have } => match fill(&mut p.stream, &mut buf[..], have) {
                    Ok(false) => return Outcome::Wait,
                    Err(_) => return self.failed(peer),
                    Ok(true) => {
                        let Ok((client, asked)) = handshake::parse_hello(buf) else {
                            self.refused(&self.counters.refused_malformed, peer);
                            return Outcome::Close;
                        };
                        let Ok(server) = handshake::nonce() else {
                            return self.failed(peer);
                        };
                        let out = handshake::challenge(
                            self.auth(),
                            &client,
                            &server,
                            asked.max(self.protection),
                        );
                        Step::Challenge { out, sent: 0, hello: *buf }
                    }
                },
                Step::Challenge { out, sent, hello } => match drain(&mut p.stream, out, sent) {
                    Ok(false) => return Outcome::Wait,
                    Err(_) => return self.failed(peer),
                    Ok(true) => Step::Proof {
                        buf: [0; handshake::PROOF],
                        have: 0,
                        hello: *hello,
                        challenge: *out,
                    },
                },
                Step::Proof { buf, have, hello, challenge } => {
                    match fill(&mut p.stream, &mut buf[..], have) {
                        Ok(false) => return Outcome::Wait,
                        // A client checks the server's proof before it sends its own, and
                        // hangs up when it does not verify: its secret differs.
                        Err(e) if *have == 0 && e.kind() == io::ErrorKind::UnexpectedEof => {
                            self.refused(&self.counters.refused_secret, peer);
                            return Outcome::Close;
                        }
                        Err(_) => return self.failed(peer),
                        Ok(true) => {
                            let client = &hello[12..12 + handshake::NONCE];
                            let server = &challenge[13..13 + handshake::NONCE];
                            let proven = self.secret.as_deref().is_none_or(|secret| {
                                handshake::verify(
                                    secret,
                                    handshake::CLIENT_LABEL,
                                    client.try_into().expect("32 bytes"),
                                    server.try_into().expect("32 bytes"),
                                    buf,
                                )
                            });
                            if !proven {
                                self.refused(&self.counters.refused_secret, peer);
                                let out = handshake::verdict(
                                    Verdict::WrongProof,
                                    &Welcome { address: None, node: None, regions: Vec::new() },
                                );
                                Step::Verdict { out, sent: 0, admit: None }
                            } else if !self.room_for(p.ip) {
                                self.refused(&self.counters.refused_full, peer);
                                let out = handshake::verdict(
                                    Verdict::Full,
                                    &Welcome { address: None, node: None, regions: Vec::new() },
                                );
                                Step::Verdict { out, sent: 0, admit: None }
                            } else {
                                let mut keys = handshake::session_keys(
                                    Side::Server,
                                    self.auth(),
                                    hello,
                                    challenge,
                                    buf,
                                );
                                let out = handshake::sealed_welcome(&mut keys, &self.welcome);
                                Step::Verdict { out, sent: 0, admit: Some(Box::new(keys)) }
                            }
                        }
                    }
                }
                Step::Verdict { out, sent, admit } => match drain(&mut p.stream, out, sent) {
                    Ok(false) => return Outcome::Wait,
                    Err(_) => return self.failed(peer),
                    Ok(true) => match admit.take() {
                        Some(keys) => return Outcome::Admit(keys),
                        None => return Outcome::Close,
                    },
                },
            };
            p.step = next;
            p.moved = Instant::now();
        }
    }

    /// A handshake whose connection failed: counted, and closed.
    fn failed(&self, peer: SocketAddr) -> Outcome {
        self.refused(&self.counters.refused_failed, peer);
        Outcome::Close
    }

    /// How this server authenticates.
    fn auth(&self) -> Auth<'_> {
        self.secret.as_deref().map_or(Auth::Insecure, Auth::Keyed)
    }

    /// Whether another client from `ip` may be served now.
    fn room_for(&self, ip: IpAddr) -> bool {
        let clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
        let of_ip =
            clients.values().filter(|(s, _)| s.peer_addr().is_ok_and(|a| a.ip() == ip)).count();
        clients.len() < self.limits.max_clients && of_ip < self.limits.max_clients_per_ip
    }

    /// Serves an authenticated client on a thread of its own.
    /// Out of descriptors for it, a handshake in progress makes room (as for `accept`).
    fn admit(&mut self, p: Pending, keys: Keys, pending: &mut Table) {
        let number = self.next;
        self.next += 1;
        let stream = p.stream;
        // Blocking from now on. A client that stops reading its answers, or whose network
        // vanished, frees its thread: each answer has a deadline, a checked client that sends
        // nothing (not even its heartbeat) for the idle timeout is closed, and TCP keepalive
        // and the user timeout notice a peer that stopped acknowledging.
        //
        // The kernel's bound on unacknowledged data (`TCP_USER_TIMEOUT`) is twice the answer's
        // deadline: it also runs while a live client that reads nothing keeps its window shut,
        // and when it ends a connection it tells the client nothing. The answer's deadline
        // passes first, and the server resets the connection itself, which the client sees.
        let unacknowledged = self.timing.stalled.saturating_mul(2);
        if stream.set_nonblocking(false).is_err()
            || checked::keepalive(&stream, self.timing.idle, unacknowledged).is_err()
        {
            return;
        }
        if let Err(e) = checked::unpace_on_host(&stream, &self.congestion) {
            tracing::warn!(peer = %p.peer, error = %e, "could not set the connection's congestion control");
        }
        let kept = match stream.try_clone() {
            Ok(kept) => kept,
            Err(e) if out_of_descriptors(&e) => {
                let Some(at) = pending.victim(None) else { return };
                let room = pending.remove(at);
                self.refused(&self.counters.refused_displaced, room.peer);
                drop(room);
                let Ok(kept) = stream.try_clone() else { return };
                kept
            }
            Err(_) => return,
        };
        let (served, clients, one_sided) =
            (Arc::clone(&self.served), Arc::clone(&self.clients), self.one_sided);
        let (drain, counters, accepting) =
            (Arc::clone(&self.drain), Arc::clone(&self.counters), Arc::clone(&self.accepting));
        let timing = self.timing;
        let peer = p.peer;
        // Registered under the lock before the thread can remove itself.
        let mut map = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
        let thread = std::thread::Builder::new().name("umbp-ucx-client".into()).spawn(move || {
            tracing::info!(%peer, "client connected");
            counters.admitted.fetch_add(1, Ordering::Relaxed);
            counters.connected.fetch_add(1, Ordering::Relaxed);
            let ended = if one_sided {
                watch(stream).map(|()| Ended::Left)
            } else {
                // SAFETY: the regions stay mapped until the server stopped, which joins this
                // thread first (`stop_threads`); their owner accepted peers' access.
                #[allow(unsafe_code)]
                unsafe {
                    let drain = checked::Drain { fd: drain.as_fd(), serving: &accepting };
                    checked::serve(stream, &served, keys, timing, drain, &counters)
                }
            };
            // The server stopping shuts the socket down: whatever this thread then saw, that
            // is why the session ended.
            let stopping = !accepting.load(Ordering::Acquire);
            let (reason, counter) = match &ended {
                Ok(Ended::Drained) => ("shutdown", &counters.closed_shutdown),
                _ if stopping => ("shutdown", &counters.closed_shutdown),
                Ok(Ended::Left) => ("left", &counters.closed_left),
                Ok(Ended::Idle) => ("idle", &counters.closed_idle),
                Ok(Ended::Tampered) => ("tamper", &counters.closed_tampered),
                Ok(Ended::Refused) => ("refused_request", &counters.closed_refused),
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    ("timeout", &counters.closed_stalled)
                }
                Err(_) => ("failed", &counters.closed_failed),
            };
            counter.fetch_add(1, Ordering::Relaxed);
            clients.lock().unwrap_or_else(PoisonError::into_inner).remove(&number);
            counters.connected.fetch_sub(1, Ordering::Relaxed);
            match ended {
                Err(e) => tracing::info!(%peer, reason, error = %e, "client disconnected"),
                Ok(_) => tracing::info!(%peer, reason, "client disconnected"),
            }
        });
        match thread {
            Ok(thread) => {
                map.insert(number, (kept, thread));
            }
            Err(e) => tracing::warn!(error = %e, "no thread for a client; closed"),
        }
    }
}

/// A listening socket on the first of `listen`'s addresses that takes one, asking the kernel
/// for a queue of `backlog` connections not yet accepted (`TcpListener::bind` asks for 128).
/// The accepted connections inherit the congestion control picked on it
/// ([`checked::pick_congestion`]).
fn listen_on(
    listen: impl ToSocketAddrs,
    backlog: usize,
    congestion: &Congestion,
) -> io::Result<TcpListener> {
    let backlog = i32::try_from(backlog).unwrap_or(i32::MAX);
    let mut last = None;
    for addr in listen.to_socket_addrs()? {
        let bound = (|| {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )?;
            // As `TcpListener::bind` does: a restarted node takes its port back at once.
            socket.set_reuse_address(true)?;
            checked::pick_congestion(&socket, addr.ip().is_loopback(), congestion)?;
            socket.bind(&addr.into())?;
            socket.listen(backlog)?;
            Ok::<_, io::Error>(TcpListener::from(socket))
        })();
        match bound {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last
        .unwrap_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no address to listen on")))
}

/// The refusals' log, on a thread of its own: woken by the handshake thread at each refused
/// handshake (which never waits for it), it writes one line for the refusals since its last,
/// at once after a quiet second and at most one a second ([`REFUSAL_LOG_EVERY`]) under a
/// flood, so an unauthenticated connection costs at most a share of a line. Ends when the
/// handshake thread has (its sender dropped), after a last line for what is left.
fn log_refusals(counters: &Counters, woken: &mpsc::Receiver<()>) {
    let mut logged = counters.refusals();
    let mut last_line: Option<Instant> = None;
    loop {
        let mut over = woken.recv().is_err();
        if let Some(at) = last_line {
            let next = at + REFUSAL_LOG_EVERY;
            while !over {
                match woken.recv_timeout(next.saturating_duration_since(Instant::now())) {
                    Ok(()) => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(mpsc::RecvTimeoutError::Disconnected) => over = true,
                }
            }
        }
        let now = counters.refusals();
        let words = [
            "authentication failed (wrong or no secret)",
            "serving as many clients as allowed",
            "not an umbp-remote hello",
            "past the handshake deadline",
            "closed to make room",
            "the connection failed",
        ];
        let mut parts = Vec::new();
        let mut total = 0;
        for ((_, was), ((_, is), what)) in logged.iter().zip(now.iter().zip(words)) {
            let n = is.saturating_sub(*was);
            if n > 0 {
                total += n;
                parts.push(format!("{what}: {n}"));
            }
        }
        logged = now;
        if total > 0 {
            let peer = counters
                .last_refused
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .map_or_else(|| "unknown".to_owned(), |p| p.to_string());
            tracing::warn!(
                refused = total,
                %peer,
                "handshakes refused since the last such line: {} (`peer`: the last one's)",
                parts.join(", ")
            );
            last_line = Some(Instant::now());
        }
        if over {
            return;
        }
    }
}

/// Whether `accept` failed for want of a file descriptor (the process's or the system's).
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Reads into `buf` from `*have`; `Ok(true)` once full. End of file is an error.
fn fill(stream: &mut TcpStream, buf: &mut [u8], have: &mut usize) -> io::Result<bool> {
    while *have < buf.len() {
        match stream.read(&mut buf[*have..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => *have += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Writes `out` from `*sent`; `Ok(true)` once all is sent.
fn drain(stream: &mut TcpStream, out: &[u8], sent: &mut usize) -> io::Result<bool> {
    while *sent < out.len() {
        match stream.write(&out[*sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => *sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// One-sided mode: holds a client's connection until it closes (its end tells the client
/// the server went away, and the other way round). Anything the client sends is ignored.
fn watch(mut stream: TcpStream) -> io::Result<()> {
    let mut buf = [0u8; 64];
    while stream.read(&mut buf)? > 0 {}
    Ok(())
}
