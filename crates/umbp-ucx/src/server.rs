//! The serving side: the node that owns the memory exports regions of it to peers.

use std::any::Any;
use std::collections::HashMap;
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use umbp_plan::HostMemory;

use crate::handshake::{self, Welcome, WireRegion};
use crate::ucp::{self, Access, Context, Worker};
use crate::{Error, UcxConfig};

/// How long the server's thread sleeps between checks for shutdown while idle.
const IDLE_TICK: Duration = Duration::from_millis(50);
/// Empty polls before the server's thread sleeps on the worker's descriptor: while clients
/// keep requests coming (TCP needs the target to take part), it answers without a wake-up.
const SPINS_BEFORE_SLEEP: u32 = 4096;

/// One region to export, before serving.
struct Export {
    name: String,
    addr: u64,
    len: u64,
    writable: bool,
    keep: Box<dyn Any + Send>,
}

/// Gathers the regions a [`UcxServer`] exports.
///
/// ```no_run
/// use umbp_ucx::{ServerBuilder, UcxConfig};
///
/// let arena = vec![0u8; 64 << 20]; // the KV pool's pages
/// let server = ServerBuilder::new(UcxConfig::default())
///     .export("kv-arena", arena, true)
///     .serve("0.0.0.0:7400")?;
/// println!("serving on {}", server.local_addr());
/// // ... until the node shuts down; `shutdown` hands the arena back.
/// let arena: Vec<u8> = server.shutdown().take("kv-arena").unwrap();
/// # Ok::<(), umbp_ucx::Error>(())
/// ```
pub struct ServerBuilder {
    config: UcxConfig,
    exports: Vec<Export>,
}

impl ServerBuilder {
    /// A server with `config` (its transports and token) and no region yet.
    pub fn new(config: UcxConfig) -> Self {
        Self { config, exports: Vec::new() }
    }

    /// Exports `memory` as region `name` (regions are numbered in the order they are
    /// exported). Peers may read it, and write it when `writable`, until the server shuts
    /// down; the server owns it meanwhile and [`UcxServer::shutdown`] hands it back.
    pub fn export<M: HostMemory + Send>(
        mut self,
        name: &str,
        mut memory: M,
        writable: bool,
    ) -> Self {
        // Exposed, so that the address UCX is given can be turned back into a pointer.
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
    /// and the caller accepts that peers read it, and write it when `writable`, at any time
    /// meanwhile.
    #[allow(unsafe_code)] // Declares the obligation; the server maps what it is given.
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

    /// Starts serving: a thread that progresses UCX (transports such as TCP need the target
    /// to take part in one-sided operations), and a thread that accepts control connections
    /// on `listen` and answers their handshakes.
    pub fn serve(self, listen: impl ToSocketAddrs) -> Result<UcxServer, Error> {
        let listener = TcpListener::bind(listen)
            .map_err(|source| Error::Connect { addr: "listen address".into(), source })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| Error::Connect { addr: "listener".into(), source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let ranges: Vec<(u64, u64, bool)> =
            self.exports.iter().map(|e| (e.addr, e.len, e.writable)).collect();
        let (ready, started) = mpsc::channel();
        let transports = self.config.transports.clone();
        let progress = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("umbp-ucx-serve".into())
                .spawn(move || serve_ucx(transports.as_deref(), &ranges, &ready, &stop))
                .map_err(|source| Error::Connect { addr: "progress thread".into(), source })?
        };
        let mut server = UcxServer {
            local_addr,
            stop,
            progress: Some(progress),
            accept: None,
            clients: Arc::new(Mutex::new(HashMap::new())),
            regions: Vec::new(),
            exports: Mutex::new(Vec::new()),
        };
        let (address, rkeys) = match started.recv() {
            Ok(Ok(keys)) => keys,
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(Error::ProgressThreadGone),
        };
        let regions: Vec<WireRegion> = self
            .exports
            .iter()
            .zip(rkeys)
            .map(|(e, rkey)| WireRegion {
                name: e.name.clone(),
                writable: e.writable,
                base: e.addr,
                len: e.len,
                rkey,
            })
            .collect();
        server.regions = regions.iter().map(|r| (r.name.clone(), r.len, r.writable)).collect();
        server.exports = Mutex::new(self.exports.into_iter().map(|e| (e.name, e.keep)).collect());
        let welcome = Arc::new(Welcome { address, regions });
        let accept = {
            let (stop, clients) = (Arc::clone(&server.stop), Arc::clone(&server.clients));
            let (token, timeout) = (self.config.token.clone(), self.config.connect_timeout);
            std::thread::Builder::new()
                .name("umbp-ucx-accept".into())
                .spawn(move || {
                    accept(listener, &welcome, token.as_deref(), timeout, &stop, &clients)
                })
                .map_err(|source| Error::Connect { addr: "accept thread".into(), source })?
        };
        server.accept = Some(accept);
        tracing::info!(%local_addr, regions = server.regions.len(), "serving");
        Ok(server)
    }
}

/// Memory exported to peers over UCX, served until [`shutdown`](Self::shutdown) or drop.
pub struct UcxServer {
    local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    accept: Option<JoinHandle<()>>,
    /// Control connections of connected clients, shut down when the server stops.
    clients: Clients,
    regions: Vec<(String, u64, bool)>,
    /// What backs each region; dropped only after the UCX mappings are gone.
    /// (Behind a lock only so that the server is `Sync`: nothing reads them while serving.)
    exports: Mutex<Vec<(String, Box<dyn Any + Send>)>>,
}

impl std::fmt::Debug for UcxServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxServer")
            .field("local_addr", &self.local_addr)
            .field("regions", &self.regions)
            .finish()
    }
}

impl UcxServer {
    /// The address clients connect to ([`UcxEngine::connect`](crate::UcxEngine::connect)).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The exported regions in order: name, length, writable.
    pub fn regions(&self) -> &[(String, u64, bool)] {
        &self.regions
    }

    /// Clients whose control connection is open now.
    pub fn clients(&self) -> usize {
        self.clients.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Stops serving (clients see their peer go away) and hands back what backed the regions.
    pub fn shutdown(mut self) -> Exports {
        self.stop_threads();
        Exports(std::mem::take(self.exports.get_mut().unwrap_or_else(PoisonError::into_inner)))
    }

    fn stop_threads(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop.
        let _ = TcpStream::connect_timeout(&self.local_addr, Duration::from_secs(1));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        for (_, client) in self.clients.lock().unwrap_or_else(PoisonError::into_inner).drain() {
            let _ = client.shutdown(Shutdown::Both);
        }
        if let Some(progress) = self.progress.take() {
            let _ = progress.join();
        }
    }
}

impl Drop for UcxServer {
    fn drop(&mut self) {
        self.stop_threads();
        // `exports` drops after this, once UCX has unmapped them.
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
type Keys = (Vec<u8>, Vec<Vec<u8>>);

/// The server's UCX thread: maps the regions, reports the keys, then progresses until told
/// to stop.
fn serve_ucx(
    transports: Option<&str>,
    ranges: &[(u64, u64, bool)],
    ready: &mpsc::Sender<Result<Keys, Error>>,
    stop: &AtomicBool,
) {
    let setup = || -> Result<_, Error> {
        let context = Context::new(transports)?;
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

/// The control connections of accepted clients, by connection number.
type Clients = Arc<Mutex<HashMap<u64, TcpStream>>>;

/// Accepts control connections until told to stop. Each gets its own thread, which answers the
/// handshake (so a slow or silent client delays no other) and then watches the connection
/// until the client goes away; connections are few, one per client node.
fn accept(
    listener: TcpListener,
    welcome: &Arc<Welcome>,
    token: Option<&[u8]>,
    timeout: Duration,
    stop: &AtomicBool,
    clients: &Clients,
) {
    for (number, stream) in (0u64..).zip(listener.incoming()) {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let (welcome, clients) = (Arc::clone(welcome), Arc::clone(clients));
        let token = token.map(<[u8]>::to_vec);
        let _ = std::thread::Builder::new().name("umbp-ucx-client".into()).spawn(move || {
            serve_client(stream, number, &welcome, token.as_deref(), timeout, &clients)
        });
    }
}

/// Answers one client's handshake, then holds its connection until it closes.
fn serve_client(
    mut stream: TcpStream,
    number: u64,
    welcome: &Welcome,
    token: Option<&[u8]>,
    timeout: Duration,
    clients: &Clients,
) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let _ = stream.set_nodelay(true);
    let answered = handshake::read_hello(&mut stream).and_then(|got| {
        let accepted = token.is_none_or(|t| handshake::tokens_match(t, &got));
        handshake::send_welcome(&mut stream, accepted.then_some(welcome)).map(|()| accepted)
    });
    match answered {
        Ok(true) => tracing::debug!(?peer, "client connected"),
        Ok(false) => return tracing::warn!(?peer, "refused a client with the wrong token"),
        Err(e) => {
            let error = &e as &dyn std::error::Error;
            return tracing::warn!(?peer, error, "malformed handshake");
        }
    }
    let _ = stream.set_read_timeout(None);
    let Ok(kept) = stream.try_clone() else { return };
    clients.lock().unwrap_or_else(PoisonError::into_inner).insert(number, kept);
    let mut buf = [0u8; 64];
    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    clients.lock().unwrap_or_else(PoisonError::into_inner).remove(&number);
    tracing::debug!(?peer, "client left");
}
