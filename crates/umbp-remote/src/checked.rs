//! The checked request path: reads and writes that the server checks before it touches
//! memory, for every transport on which UCX does not enforce remote keys in hardware.
//!
//! Over TCP and shared memory UCX emulates one-sided operations in software and checks
//! neither a key's bounds nor its rights (UCT's TCP transport even writes a peer's put to
//! whatever address the peer names). There the server hands out no keys and runs no UCX at
//! all: after the handshake, the authenticated control connection carries requests, answered
//! in order, one at a time, each checked against the exported regions first. Every message is
//! a sealed record ([`crate::channel`]: its bytes, enciphered or not, and a 16-byte tag):
//!
//! ```text
//! request   one record: op u8 (1 get, 2 put, 3 heartbeat), 0 [3], region u32, id u64,
//!           offset u64, len u64; then, for a put, the len bytes as records of at most
//!           256 KiB each
//! response  one record: status u8 (0 done, else refused: 1 outside the export, 2 read-only,
//!           3 no such region, 4 unknown operation), 0 [7], id u64, len u64; then, for a
//!           done get, the len bytes as records of at most 256 KiB each
//! ```
//!
//! A record that does not open ends the connection at once, on either side: the server writes
//! a put's record into its region only once it opened (torn puts leave whole, authentic
//! records behind, never forged bytes), and the client reports a get done only once every
//! record of it opened (a failed one fails the get's objects, whatever bytes reached the
//! destination). A refused request ends the connection (the server reads no payload of it),
//! so a client that sends one is one that bypassed its own engine's checks.
//!
//! On the client, a checked peer is a [`Link`] of one or more lanes
//! ([`RemoteConfig::lanes`](crate::RemoteConfig)), each its own authenticated connection,
//! served by its own server thread. Each lane has a writer thread (requests, and the bytes of
//! puts; a heartbeat when it had nothing to send for
//! [`RemoteConfig::heartbeat`](crate::RemoteConfig)) and a reader thread (answers, and the
//! bytes of gets, received straight into the destination and opened there). Both touch local
//! memory only while holding their lane's guard (shared: neither waits on the other, so a
//! get's bytes are always read while a put's are sent) and only while the link is open;
//! closing it shuts every lane's socket down and then takes each guard exclusively, so once
//! [`Link::close`] returns no byte of local memory is touched again (what a forced UCX
//! endpoint close gives the one-sided path).
//!
//! Neither side waits for one message before sending the next: a client keeps many requests
//! in flight, and its writer sends the headers of gets queued one behind another in one
//! system call. Both sides read through an [`Inbox`] (a small read-ahead): the server reads
//! a client's queued requests in one receive and serves them without waiting on the socket
//! again (checking between any two that the server does not drain), and answers a get with
//! its header and first record in one send; the client receives a record straight into its
//! destination, and its tag and the next answer's header in the same call.
//!
//! On the server, a client thread ends when the client sends nothing (not even a heartbeat)
//! for [`RemoteConfig::idle_timeout`](crate::RemoteConfig), and when one answer is not sent whole
//! within [`RemoteConfig::peer_timeout`](crate::RemoteConfig) (a deadline for the whole answer,
//! however its bytes trickle out).

use std::io::{self, Read};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use socket2::TcpKeepalive;
use umbp_plan::checksum::crc32c_append;
use umbp_plan::{yield_until, SPIN_BEFORE_SLEEP};

use crate::channel::{Keys, Opener, Sealer, CHUNK, TAG};
use crate::config::Congestion;
use crate::inbox::{self, Inbox};
use crate::stats::Counters;

/// Bytes of a request header.
pub(crate) const REQUEST_LEN: usize = 32;
/// Bytes of a response header.
pub(crate) const RESPONSE_LEN: usize = 24;
const GET: u8 = 1;
const PUT: u8 = 2;
/// A heartbeat: no bytes, answered with an empty success.
const PING: u8 = 3;

/// Why the server refused a request.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Outside = 1,
    ReadOnly = 2,
    NoRegion = 3,
    BadOp = 4,
}

impl Refusal {
    fn from_status(status: u8) -> Option<Self> {
        Some(match status {
            1 => Self::Outside,
            2 => Self::ReadOnly,
            3 => Self::NoRegion,
            4 => Self::BadOp,
            _ => return None,
        })
    }

    pub(crate) fn words(self) -> &'static str {
        match self {
            Self::Outside => "the server refused a request outside the region it exported",
            Self::ReadOnly => "the server refused a write to a read-only region",
            Self::NoRegion => "the server refused a request for a region it did not export",
            Self::BadOp => "the server refused an unknown operation",
        }
    }
}

/// One request header.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) op: u8,
    pub(crate) region: u32,
    pub(crate) id: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl Request {
    pub(crate) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut out = [0; REQUEST_LEN];
        out[0] = self.op;
        out[4..8].copy_from_slice(&self.region.to_le_bytes());
        out[8..16].copy_from_slice(&self.id.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8; REQUEST_LEN]) -> Self {
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        Self { op: b[0], region: u32_at(4), id: u64_at(8), offset: u64_at(16), len: u64_at(24) }
    }

    /// A get of `len` bytes at `offset` of `region`.
    pub(crate) fn get(region: u32, id: u64, offset: u64, len: u64) -> Self {
        Self { op: GET, region, id, offset, len }
    }

    /// A put of `len` bytes at `offset` of `region` (its bytes follow it).
    pub(crate) fn put(region: u32, id: u64, offset: u64, len: u64) -> Self {
        Self { op: PUT, region, id, offset, len }
    }
}

fn response(status: u8, id: u64, len: u64) -> [u8; RESPONSE_LEN] {
    let mut out = [0; RESPONSE_LEN];
    out[0] = status;
    out[8..16].copy_from_slice(&id.to_le_bytes());
    out[16..24].copy_from_slice(&len.to_le_bytes());
    out
}

/// One exported region as the server checks requests against it.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) writable: bool,
    /// The locks of the region's stripes ([`STRIPE`] bytes each; stripe `s` takes lock
    /// `s % STRIPES`): taken (shared) while a client thread seals bytes of the stripe into its
    /// buffer, (exclusive) while one copies a verified record into it, so the server's own
    /// accesses never race, and two clients writing different stripes do not wait on each
    /// other. (One lock for the whole region made the lanes of one put take turns at the
    /// memory's write rate, and a thread preempted holding it stalled every other.)
    locks: [RwLock<()>; STRIPES],
}

/// Bytes of a region's stripe: one record's most, so a record touches at most two stripes.
const STRIPE: u64 = CHUNK as u64;

/// Locks per region: stripes this far apart share one.
const STRIPES: usize = 64;

/// The stripes' locks a record holds while it touches the region: one or two, taken in the
/// order of their index (the same order in every thread, so two records never wait on each
/// other in a cycle).
pub(crate) struct StripeGuards<G>(G, Option<G>);

impl Served {
    pub(crate) fn new(addr: u64, len: u64, writable: bool) -> Self {
        Self { addr, len, writable, locks: std::array::from_fn(|_| RwLock::new(())) }
    }

    /// The locks of the stripes that the `len` bytes (1 to [`CHUNK`]) at `addr` touch, first
    /// the lower index.
    fn stripes(&self, addr: u64, len: usize) -> (usize, Option<usize>) {
        debug_assert!((1..=CHUNK).contains(&len));
        let lock = |at: u64| ((at - self.addr) / STRIPE) as usize % STRIPES;
        let (first, last) = (lock(addr), lock(addr + len as u64 - 1));
        if first == last {
            (first, None)
        } else {
            (first.min(last), Some(first.max(last)))
        }
    }

    /// Holds the region's bytes `addr .. addr + len` for reading: no client thread writes
    /// them until the guards drop.
    fn read(&self, addr: u64, len: usize) -> StripeGuards<RwLockReadGuard<'_, ()>> {
        let (a, b) = self.stripes(addr, len);
        let take = |i: usize| self.locks[i].read().unwrap_or_else(PoisonError::into_inner);
        StripeGuards(take(a), b.map(take))
    }

    /// Holds the region's bytes `addr .. addr + len` for writing: no other client thread
    /// reads or writes them until the guards drop.
    fn write(&self, addr: u64, len: usize) -> StripeGuards<RwLockWriteGuard<'_, ()>> {
        let (a, b) = self.stripes(addr, len);
        let take = |i: usize| self.locks[i].write().unwrap_or_else(PoisonError::into_inner);
        StripeGuards(take(a), b.map(take))
    }
}

/// Checks a request against the exports: the region and the bytes it may touch, or why not.
pub(crate) fn check(regions: &[Served], r: &Request) -> Result<(u64, u64), Refusal> {
    if r.op != GET && r.op != PUT {
        return Err(Refusal::BadOp);
    }
    let region = regions.get(r.region as usize).ok_or(Refusal::NoRegion)?;
    if r.offset.checked_add(r.len).is_none_or(|end| end > region.len) {
        return Err(Refusal::Outside);
    }
    if r.op == PUT && !region.writable {
        return Err(Refusal::ReadOnly);
    }
    Ok((region.addr + r.offset, r.len))
}

/// How long the server waits on a client.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Timing {
    /// The deadline for sending one whole answer (a client that leaves its answers unread).
    pub(crate) stalled: Duration,
    /// How long a client may send nothing at all (its heartbeats included).
    pub(crate) idle: Duration,
}

/// How a server tells its client threads to end their sessions between requests.
#[derive(Copy, Clone)]
pub(crate) struct Drain<'a> {
    /// Turns readable once the server drains or stops: wakes a thread waiting for a request.
    pub(crate) fd: BorrowedFd<'a>,
    /// Cleared before `fd` turns readable: checked before serving a request that was read
    /// ahead (no wait on the socket, so no wake-up from `fd`).
    pub(crate) serving: &'a AtomicBool,
}

/// The payload's records: `(offset, len)` of each, [`CHUNK`] bytes but the last.
fn chunks(len: u64) -> impl Iterator<Item = (u64, usize)> {
    (0..len).step_by(CHUNK).map(move |at| (at, (len - at).min(CHUNK as u64) as usize))
}

/// Serves one authenticated client's requests until it leaves, the server stops (its socket
/// is shut down), it stays silent for `timing.idle`, it leaves an answer unread for
/// `timing.stalled`, it sends a record that does not open, or it sends a request the exports
/// do not allow.
///
/// A put's bytes are received into a buffer of the thread's own and written into the region
/// one record at a time, each only once it opened; a get's are sealed from the region into
/// that buffer (copied there and tagged, when the channel only authenticates).
///
/// # Safety
///
/// Every region of `regions` is memory of this process that stays mapped while this runs,
/// and its owner accepts that peers read it (and write the writable ones) at any time.
pub(crate) unsafe fn serve(
    mut stream: TcpStream,
    regions: &[Served],
    keys: Keys,
    timing: Timing,
    drain: Drain<'_>,
    counters: &Counters,
) -> io::Result<Ended> {
    // SAFETY: passed on from this function's own contract.
    let ended = unsafe { session(&mut stream, regions, keys, timing, drain, counters) };
    end(&stream, &ended, timing);
    ended
}

/// Ends a session's connection so that the client notices whatever it does. A client that
/// left an answer unread past its deadline has a full receive window: a FIN would wait
/// behind the unsent bytes for ever, so the connection is reset (`SO_LINGER` 0: the close
/// sends an RST and drops what was unsent). A drain or a refusal must deliver what was sent
/// (the answers served before it, the refusal's answer): the socket is shut down for writing
/// (a FIN behind them) and the client's further requests are read and dropped until it
/// closes its end ([`discard_until_closed`]): closing a socket with bytes unread resets the
/// connection, and the reset would drop the answers the client had not read yet. Any other
/// end the server chose is shut down both ways, so even while the server's other handle on
/// the socket is still open the client reads its end at once.
fn end(stream: &TcpStream, ended: &io::Result<Ended>, timing: Timing) {
    match ended {
        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
            let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
        }
        Ok(Ended::Left) | Err(_) => {}
        Ok(Ended::Drained | Ended::Refused) => {
            let _ = stream.shutdown(Shutdown::Write);
            discard_until_closed(stream, Instant::now() + timing.stalled);
        }
        Ok(_) => {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// Reads and drops what the client still sends until it closes its end, a read fails or
/// `deadline` passes (a client that neither reads its end nor closes gets the peer timeout,
/// as for an answer), then shuts the socket down both ways. A server that stops meanwhile
/// shuts it down itself, which ends the wait.
fn discard_until_closed(mut stream: &TcpStream, deadline: Instant) {
    let mut sink = [0u8; 16 << 10];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// [`serve`]'s loop.
///
/// # Safety
///
/// As [`serve`].
unsafe fn session(
    stream: &mut TcpStream,
    regions: &[Served],
    mut keys: Keys,
    timing: Timing,
    drain: Drain<'_>,
    counters: &Counters,
) -> io::Result<Ended> {
    stream.set_read_timeout(Some(timing.idle))?;
    let fd = stream.as_raw_fd();
    let mut scratch = vec![0u8; CHUNK];
    // A client keeps many requests in flight: one receive usually brings several, and the
    // next ones are then served without waiting on the socket.
    let mut inbox = Inbox::new();
    loop {
        // Between requests: a drain ends the session here, so no request is cut short.
        if inbox.buffered() < REQUEST_LEN + TAG {
            match wait_for_request(fd, drain.fd.as_raw_fd(), timing.idle)? {
                Wait::Request => {}
                Wait::Drain => return Ok(Ended::Drained),
                Wait::Idle => return Ok(Ended::Idle),
            }
        } else if !drain.serving.load(Ordering::Acquire) {
            return Ok(Ended::Drained);
        }
        let mut header = [0; REQUEST_LEN + TAG];
        match inbox.read_exact(stream.as_fd(), &mut header, inbox::CAPACITY) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(Ended::Left),
            Err(e) if is_timeout(&e) => return Ok(Ended::Idle),
            Err(e) => return Err(e),
        }
        let (body, tag) = header.split_at_mut(REQUEST_LEN);
        let tag: [u8; TAG] = (&*tag).try_into().expect("16 bytes");
        if keys.recv.open(body, &tag).is_err() {
            tracing::warn!("a request did not authenticate; closing the connection");
            return Ok(Ended::Tampered);
        }
        let request = Request::decode((&*body).try_into().expect("32 bytes"));
        let deadline = Instant::now() + timing.stalled;
        if request.op == PING {
            send_record(fd, &mut keys.send, response(0, request.id, 0), Some(deadline))?;
            continue;
        }
        let (addr, len) = match check(regions, &request) {
            Ok(bytes) => bytes,
            Err(refusal) => {
                tracing::warn!(?request, ?refusal, "refused a request; closing the connection");
                let answer = response(refusal as u8, request.id, 0);
                send_record(fd, &mut keys.send, answer, Some(deadline))?;
                return Ok(Ended::Refused);
            }
        };
        let region = &regions[request.region as usize];
        if request.op == GET {
            let mut answer = response(0, request.id, len);
            let answer_tag = keys.send.seal(&mut answer);
            if len == 0 {
                send_all(fd, &[&answer, &answer_tag], Some(deadline))?;
            }
            for (at, n) in chunks(len) {
                let record = &mut scratch[..n];
                let tag = {
                    let _shared = region.read(addr + at, n);
                    // SAFETY: `check` kept `addr .. addr + len` inside an exported region, which
                    // the caller keeps mapped and readable by peers; the stripes' locks keep
                    // every other client thread from writing these `n` bytes while the slice
                    // lives; `record` is this thread's own buffer, which it does not overlap.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(
                            std::ptr::with_exposed_provenance::<u8>((addr + at) as usize),
                            n,
                        )
                    };
                    keys.send.seal_into(bytes, record)
                };
                if at == 0 {
                    // The answer and its first record leave in one system call.
                    send_all(fd, &[&answer, &answer_tag, record, &tag], Some(deadline))?;
                } else {
                    send_all(fd, &[record, &tag], Some(deadline))?;
                }
            }
            counters.sent.fetch_add(len, Ordering::Relaxed);
        } else {
            for (at, n) in chunks(len) {
                let record = &mut scratch[..n];
                let mut tag = [0u8; TAG];
                inbox.read_exact(stream.as_fd(), record, TAG)?;
                inbox.read_exact(stream.as_fd(), &mut tag, REQUEST_LEN + TAG)?;
                if keys.recv.open(record, &tag).is_err() {
                    tracing::warn!("a put's bytes did not authenticate; closing the connection");
                    return Ok(Ended::Tampered);
                }
                let _only = region.write(addr + at, n);
                // SAFETY: inside a region exported writable (checked above), kept mapped by
                // the caller; the stripes' locks keep every other client thread out of these
                // `n` bytes meanwhile; the bytes come from this thread's buffer, which they do
                // not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        record.as_ptr(),
                        std::ptr::with_exposed_provenance_mut::<u8>((addr + at) as usize),
                        n,
                    );
                }
            }
            counters.received.fetch_add(len, Ordering::Relaxed);
            let deadline = Instant::now() + timing.stalled;
            send_record(fd, &mut keys.send, response(0, request.id, 0), Some(deadline))?;
        }
        counters.requests.fetch_add(1, Ordering::Relaxed);
    }
}

/// How a checked client's session ended (the server counts each by its reason).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The client closed its connection between requests.
    Left,
    /// The client sent nothing for the idle timeout.
    Idle,
    /// A record did not open with the session's keys (changed on the way, or forged).
    Tampered,
    /// The client asked for bytes the exports do not allow.
    Refused,
    /// The server drains: the session ended between requests.
    Drained,
}

/// What [`wait_for_request`] saw first.
enum Wait {
    /// Bytes of a request (or the client's end of the connection) are there to read.
    Request,
    /// The server drains.
    Drain,
    /// Nothing arrived for the idle timeout.
    Idle,
}

/// Waits until the client's socket `fd` is readable, the drain descriptor `drain` is (the
/// server drains: checked first), or `idle` passed.
fn wait_for_request(fd: i32, drain: i32, idle: Duration) -> io::Result<Wait> {
    let deadline = Instant::now() + idle;
    let mut fds = [
        libc::pollfd { fd: drain, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd, events: libc::POLLIN, revents: 0 },
    ];
    // A client that just had an answer often asks again at once (its next transfer).
    let mut ready = readable_soon(&mut fds);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if !ready {
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: `fds` is a live array of two initialised pollfds.
            if unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) } < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
        }
        ready = false;
        if fds[0].revents != 0 {
            return Ok(Wait::Drain);
        }
        if fds[1].revents != 0 {
            return Ok(Wait::Request);
        }
        if left.is_zero() {
            return Ok(Wait::Idle);
        }
    }
}

/// Whether one of `fds` became ready (its `revents` set) within [`SPIN_BEFORE_SLEEP`], looked
/// at between yields of the core: what a thread of the checked path does before it blocks
/// on the other side. A request and its answer are a chain of hand-offs between threads
/// (caller, progress, writer, server, reader), and on an idle machine each one that slept
/// costs its wake-up, about 10 µs; one that yields meanwhile is still running when its turn
/// comes. A failed look (an interrupted call) counts as not ready: the blocking wait after
/// reports what is wrong.
fn readable_soon(fds: &mut [libc::pollfd]) -> bool {
    yield_until(SPIN_BEFORE_SLEEP, || {
        // SAFETY: `fds` is a live slice of initialised pollfds, its length passed with it;
        // a zero timeout never blocks.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) > 0 }
    })
}

/// What `rx` hands over within [`SPIN_BEFORE_SLEEP`], looked for between yields of the
/// core, as [`readable_soon`] looks at a socket: `None` when nothing came (or every sender
/// is gone), for the caller's blocking receive to tell which.
pub(crate) fn recv_soon<T>(rx: &mpsc::Receiver<T>) -> Option<T> {
    let mut got = None;
    yield_until(SPIN_BEFORE_SLEEP, || match rx.try_recv() {
        Ok(value) => {
            got = Some(value);
            true
        }
        Err(mpsc::TryRecvError::Empty) => false,
        Err(mpsc::TryRecvError::Disconnected) => true,
    });
    got
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Seals `record` (a header) and sends it with its tag.
fn send_record<const N: usize>(
    fd: i32,
    sealer: &mut Sealer,
    mut record: [u8; N],
    deadline: Option<Instant>,
) -> io::Result<()> {
    let tag = sealer.seal(&mut record);
    send_all(fd, &[&record, &tag], deadline)
}

/// Sends every byte of `parts`, in order, in as few system calls as the socket takes; with a
/// deadline, fails with `TimedOut` once it passed (however the bytes trickled out).
fn send_all(fd: i32, parts: &[&[u8]], deadline: Option<Instant>) -> io::Result<()> {
    let mut iov: [libc::iovec; 4] = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 4];
    assert!(parts.len() <= iov.len(), "at most 4 parts");
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut done = 0usize;
    let flags = libc::MSG_NOSIGNAL | if deadline.is_some() { libc::MSG_DONTWAIT } else { 0 };
    while done < total {
        // The parts' bytes from `done` on.
        let (mut skip, mut count) = (done, 0);
        for part in parts {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            iov[count] = libc::iovec {
                iov_base: part[skip..].as_ptr() as *mut libc::c_void,
                iov_len: part.len() - skip,
            };
            skip = 0;
            count += 1;
        }
        // SAFETY: a zeroed msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = count;
        // SAFETY: `msg` names `count` iovecs, each inside a slice of `parts`, borrowed for
        // the whole call; the kernel only reads them. MSG_NOSIGNAL turns a closed peer into
        // EPIPE rather than a signal.
        let sent = unsafe { libc::sendmsg(fd, &msg, flags) };
        if sent >= 0 {
            done += sent as usize;
            continue;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => {}
            io::ErrorKind::WouldBlock => {
                let Some(deadline) = deadline else { return Err(e) };
                let unread = || {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer left an answer unread past the deadline",
                    )
                };
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(unread());
                }
                let mut pfd = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
                let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
                // SAFETY: one live pollfd.
                unsafe { libc::poll(&mut pfd, 1, ms) };
                // The deadline is the answer's, whatever the socket takes after it: past a
                // full window the kernel may take a few more bytes without a wake-up, and an
                // answer finished that way would start the next one's deadline afresh.
                if Instant::now() >= deadline {
                    return Err(unread());
                }
            }
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Turns on TCP keepalive (first probe after `idle`, then every second, three unanswered
/// ending the connection) and bounds how long sent data may stay unacknowledged
/// (`TCP_USER_TIMEOUT`, `unacknowledged`): a peer whose network vanished is noticed. The
/// kernel takes whole seconds and milliseconds: both are cut to them, and made at least one.
pub(crate) fn keepalive(
    stream: &TcpStream,
    idle: Duration,
    unacknowledged: Duration,
) -> io::Result<()> {
    let socket = socket2::SockRef::from(stream);
    let idle = Duration::from_secs(idle.as_secs().max(1));
    let probes =
        TcpKeepalive::new().with_time(idle).with_interval(Duration::from_secs(1)).with_retries(3);
    socket.set_tcp_keepalive(&probes)?;
    let ms = u64::try_from(unacknowledged.as_millis()).unwrap_or(u64::MAX).max(1);
    socket.set_tcp_user_timeout(Some(Duration::from_millis(ms)))
}

/// Gives a socket about to connect or listen the congestion control `congestion` asks for:
/// a [`Congestion::Named`] one always, [`Congestion::Auto`]'s on a `loopback` address (every
/// connection then stays on this host). Picked before the first byte because a socket that
/// starts under BBR keeps pacing its bytes after it moves to another algorithm (the kernel
/// leaves its pacing on).
pub(crate) fn pick_congestion(
    socket: &socket2::Socket,
    loopback: bool,
    congestion: &Congestion,
) -> io::Result<()> {
    match congestion {
        Congestion::Named(name) => socket.set_tcp_congestion(name.as_bytes()),
        Congestion::Auto if loopback => unpace(socket),
        Congestion::Auto | Congestion::System => Ok(()),
    }
}

/// After connecting or accepting: under [`Congestion::Auto`], a connection that turned out to
/// stay on this host (at this side's own address, not a loopback one; or accepted by a
/// listener on every address) moves off BBR now, which is the best left to do.
pub(crate) fn unpace_on_host(stream: &TcpStream, congestion: &Congestion) -> io::Result<()> {
    if *congestion != Congestion::Auto
        || !one_host(stream.local_addr()?.ip(), stream.peer_addr()?.ip())
    {
        return Ok(());
    }
    unpace(&socket2::SockRef::from(stream))
}

/// Connects to `addr` within `timeout`, the congestion control picked first
/// ([`pick_congestion`]) and fixed after ([`unpace_on_host`]).
pub(crate) fn connect(
    addr: SocketAddr,
    timeout: Duration,
    congestion: &Congestion,
) -> io::Result<TcpStream> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    pick_congestion(&socket, addr.ip().is_loopback(), congestion)?;
    socket.connect_timeout(&addr.into(), timeout)?;
    let stream = TcpStream::from(socket);
    unpace_on_host(&stream, congestion)?;
    Ok(stream)
}

/// Moves a socket under BBR (which paces) to `cubic`, or to `reno` where the kernel does not
/// let the process pick `cubic` (`reno` is always allowed); leaves any other algorithm.
fn unpace(socket: &socket2::Socket) -> io::Result<()> {
    if !socket.tcp_congestion()?.starts_with(b"bbr") {
        return Ok(());
    }
    socket.set_tcp_congestion(b"cubic").or_else(|_| socket.set_tcp_congestion(b"reno"))
}

/// Whether a connection from `local` to `peer` stays on this host.
fn one_host(local: IpAddr, peer: IpAddr) -> bool {
    peer.is_loopback() || peer == local
}

/// What a checked link tells the thread that posts to it (the client's progress thread turns
/// it into its own command: `From<LinkEvent>`).
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// A request completed, or was refused (the words); a completed get asked to hash
    /// ([`Post::hash`]) carries the CRC32C of the bytes it received.
    Done { user_data: u64, result: Result<(), String>, crc: Option<u32> },
    /// The link ended, for `reason`: the peer in `slot` is lost.
    Lost { slot: u32, reason: String },
}

/// One request the progress thread hands a checked link.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Post {
    /// What the completion reports ([`LinkEvent::Done`]).
    pub(crate) user_data: u64,
    pub(crate) write: bool,
    pub(crate) region: u32,
    pub(crate) offset: u64,
    /// The local bytes: written by a get, read by a put.
    pub(crate) local: u64,
    pub(crate) len: u64,
    /// Report the CRC32C of its bytes, hashed record by record while each is in the cache
    /// (a get's right after it opened, a put's between copying it out and sealing it), so
    /// whoever checksums them need not read them again.
    pub(crate) hash: bool,
}

/// Request headers a client's writer sends in one system call at most.
const HEADERS: usize = 32;

/// The user data of the link's own heartbeat (a progress thread's request never has it: its
/// flush bit is set).
const HEARTBEAT: u64 = u64::MAX;

impl Post {
    /// A put whose writer hashes its bytes and hands the CRC to the reader (see
    /// [`write_requests`]).
    fn hashed_put(&self) -> bool {
        self.write && self.hash && self.len > 0
    }

    fn heartbeat() -> Self {
        Self {
            user_data: HEARTBEAT,
            write: false,
            region: 0,
            offset: 0,
            local: 0,
            len: 0,
            hash: false,
        }
    }
}

/// A checked peer as the client's progress thread holds it: one or more *lanes*, each an
/// authenticated connection of its own (its own session keys, its own server thread) with a
/// writer and a reader thread. Requests go to the lane with the fewest bytes unanswered;
/// each lane's requests are answered in its own order. The server seals (or hashes) and
/// sends a client's answers on one thread per connection, and the client opens them on one
/// thread per connection: with one lane a single core bounds a peer's throughput, whatever
/// the network.
///
/// The lanes end together. An answer that breaks the protocol (it does not open, answers
/// what was not asked, refuses) ends the link at once: its reader reports it lost, and the
/// progress thread closes every lane. A lane whose connection ends (the server drains,
/// stops or went away) takes no more requests, and neither does the link; the others are
/// shut down for writing, so the server answers what it already received and closes them,
/// and their readers take those answers (each at most `peer_timeout` apart) before the last
/// one reports the link lost. So a drain delivers every answer the server sent, on every
/// lane.
pub(crate) struct Link {
    lanes: Vec<Lane>,
    ends: Arc<Ends>,
}

/// One connection of a [`Link`].
struct Lane {
    stream: TcpStream,
    posts: Option<mpsc::Sender<Post>>,
    /// Held (shared) while an I/O thread touches local memory, so the reader and the writer
    /// never wait on each other; taken exclusively to close, and `true` once closed.
    guard: Arc<RwLock<bool>>,
    /// Bytes posted and not yet answered, plus one per request (so a lane of zero-length
    /// requests is not taken for idle): where the next request goes.
    unanswered: Arc<AtomicU64>,
}

/// How a link's lanes end together.
struct Ends {
    /// Set by [`Link::close`]: the lanes' ends are not reported.
    closing: AtomicBool,
    /// Set once a lane's connection ended: the link takes no more requests.
    ending: AtomicBool,
    /// Lanes whose reader still runs.
    reading: AtomicUsize,
    /// Every lane's connection, to shut the others down when one ends.
    streams: Vec<TcpStream>,
    /// How long a lane's reader waits for the server once another lane ended.
    peer_timeout: Duration,
}

impl Ends {
    /// A lane's reader ended for `end`: reports the link lost once no reader is left or the
    /// protocol was broken; else lets the other lanes take what the server already sent.
    fn lane_ended<N: From<LinkEvent>>(&self, end: End, slot: u32, notify: &mpsc::Sender<N>) {
        let last = self.reading.fetch_sub(1, Ordering::AcqRel) == 1;
        let (broken, reason) = match end {
            End::Closed(reason) => (false, reason),
            End::Broken(reason) => (true, reason),
        };
        if !broken && !last {
            if !self.ending.swap(true, Ordering::AcqRel) {
                for stream in &self.streams {
                    let _ = stream.shutdown(Shutdown::Write);
                    let _ = stream.set_read_timeout(Some(self.peer_timeout));
                }
            }
            return;
        }
        self.ending.store(true, Ordering::Release);
        if !self.closing.load(Ordering::Acquire) {
            let _ = notify.send(LinkEvent::Lost { slot, reason }.into());
        }
    }
}

impl Link {
    /// Starts the threads of a lane on each authenticated connection of `connections`
    /// (with its session's keys). Completions and the link's end (as [`LinkEvent::Lost`] for
    /// `slot`) go to `notify`. A lane's writer with nothing to send for `heartbeat` sends a
    /// heartbeat (so the server knows the client lives); once a lane ended, the others wait
    /// at most `peer_timeout` for each answer.
    pub(crate) fn start<N: From<LinkEvent> + Send + 'static>(
        connections: Vec<(TcpStream, Keys)>,
        slot: u32,
        notify: mpsc::Sender<N>,
        heartbeat: Duration,
        peer_timeout: Duration,
    ) -> io::Result<Self> {
        assert!(!connections.is_empty(), "a link has at least one lane");
        let streams = connections.iter().map(|(s, _)| s.try_clone()).collect::<io::Result<_>>()?;
        let ends = Arc::new(Ends {
            closing: AtomicBool::new(false),
            ending: AtomicBool::new(false),
            // Every lane's reader, counted before any starts (so none ends as the last while
            // another is still to start); a lane that fails to start drops the link, which
            // closes and reports nothing.
            reading: AtomicUsize::new(connections.len()),
            streams,
            peer_timeout,
        });
        let mut link = Self { lanes: Vec::new(), ends };
        for (i, (stream, keys)) in connections.into_iter().enumerate() {
            let lane = Lane::start(stream, keys, slot, i, &notify, &link.ends, heartbeat)?;
            link.lanes.push(lane);
        }
        Ok(link)
    }

    /// Hands a request to the writer of the lane with the fewest bytes unanswered; `false`
    /// if the link is ending or gone.
    pub(crate) fn post(&self, post: Post) -> bool {
        if self.ends.ending.load(Ordering::Acquire) {
            return false;
        }
        let lane = self
            .lanes
            .iter()
            .min_by_key(|lane| lane.unanswered.load(Ordering::Relaxed))
            .expect("a link has at least one lane");
        lane.unanswered.fetch_add(post.len + 1, Ordering::Relaxed);
        lane.posts.as_ref().is_some_and(|p| p.send(post).is_ok())
    }

    /// Closes the link: once this returns, its threads touch no local memory again and do
    /// not report the link's end (a completion they had already read may still arrive; the
    /// progress thread ignores reports for requests it no longer has in flight).
    pub(crate) fn close(mut self) {
        self.close_now();
    }

    fn close_now(&mut self) {
        self.ends.closing.store(true, Ordering::Release);
        for lane in &mut self.lanes {
            lane.posts = None;
            let _ = lane.stream.shutdown(Shutdown::Both);
        }
        // Waits for the I/O threads inside a transfer (the shutdown ends their system calls).
        for lane in &self.lanes {
            *lane.guard.write().unwrap_or_else(PoisonError::into_inner) = true;
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close_now();
    }
}

impl Lane {
    /// Starts lane `index`'s writer and reader on `stream`.
    fn start<N: From<LinkEvent> + Send + 'static>(
        stream: TcpStream,
        keys: Keys,
        slot: u32,
        index: usize,
        notify: &mpsc::Sender<N>,
        ends: &Arc<Ends>,
        heartbeat: Duration,
    ) -> io::Result<Self> {
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let guard = Arc::new(RwLock::new(false));
        let unanswered = Arc::new(AtomicU64::new(0));
        let (posts, requests) = mpsc::channel::<Post>();
        let (expect, expected) = mpsc::channel::<Post>();
        let (hashed, hashes) = mpsc::channel::<u32>();
        let Keys { send: sealer, recv: mut opener } = keys;
        let writer = {
            let (stream, guard) = (stream.try_clone()?, Arc::clone(&guard));
            let sent = Sent { expect, hashed };
            move || write_requests(&stream, &guard, &requests, &sent, sealer, heartbeat)
        };
        let reader = {
            let (stream, guard) = (stream.try_clone()?, Arc::clone(&guard));
            let (notify, ends) = (notify.clone(), Arc::clone(ends));
            let unanswered = Arc::clone(&unanswered);
            let expected = Expected { posts: expected, hashes };
            move || {
                let end =
                    read_answers(&stream, &guard, &expected, &notify, &unanswered, &mut opener);
                ends.lane_ended(end, slot, &notify);
            }
        };
        // Thread names: at most 15 bytes reach the kernel.
        std::thread::Builder::new().name(format!("umbp-put-{slot}.{index}")).spawn(move || {
            if let Err(e) = writer() {
                tracing::debug!(error = %e, "checked link writer ended");
            }
        })?;
        std::thread::Builder::new().name(format!("umbp-get-{slot}.{index}")).spawn(reader)?;
        Ok(Self { stream, posts: Some(posts), guard, unanswered })
    }
}

/// What a lane's writer tells its reader: each request before it is sent (so an answer with
/// none queued answers nothing this side asked), and the CRC32C of each
/// [hashed put](Post::hashed_put) once its bytes are sent.
struct Sent {
    expect: mpsc::Sender<Post>,
    hashed: mpsc::Sender<u32>,
}

/// The reader's end of [`Sent`].
struct Expected {
    posts: mpsc::Receiver<Post>,
    hashes: mpsc::Receiver<u32>,
}

/// Why a lane's reader ended.
enum End {
    /// Its connection closed or failed (or the link closed).
    Closed(String),
    /// The server broke the protocol: an answer that does not open, that answers what was
    /// not asked, or refuses.
    Broken(String),
}

/// A lane's writer loop: each request posted is queued for the reader (which expects its
/// answer) and sent; a get's header (and a heartbeat) waits for the requests queued behind
/// it, up to [`HEADERS`], so they leave in one system call; a put's bytes follow its header,
/// sealed record by record from where they are into the writer's buffer (or tagged where
/// they are, when the channel only authenticates), each record hashed right after, from the
/// cache, when the put [hashes](Post::hashed_put). Ends when the link closes or the
/// reader ended.
fn write_requests(
    stream: &TcpStream,
    guard: &RwLock<bool>,
    requests: &mpsc::Receiver<Post>,
    sent: &Sent,
    mut sealer: Sealer,
    heartbeat: Duration,
) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    let mut scratch = if sealer.encrypts() { vec![0u8; CHUNK] } else { Vec::new() };
    // Headers of gets and heartbeats queued one behind another leave together.
    let mut headers = [0u8; HEADERS * (REQUEST_LEN + TAG)];
    let mut queued = 0usize;
    let mut next = None;
    for id in 0u64.. {
        if next.is_none() {
            // The next request often follows the last one's answer at once.
            next = recv_soon(requests);
        }
        let post = match next.take() {
            Some(post) => post,
            None => match requests.recv_timeout(heartbeat) {
                Ok(post) => post,
                Err(mpsc::RecvTimeoutError::Timeout) => Post::heartbeat(),
                Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
            },
        };
        if sent.expect.send(post).is_err() {
            return Ok(()); // The reader ended.
        }
        let r = if post.user_data == HEARTBEAT {
            Request { op: PING, region: 0, id, offset: 0, len: 0 }
        } else if post.write {
            Request::put(post.region, id, post.offset, post.len)
        } else {
            Request::get(post.region, id, post.offset, post.len)
        };
        let mut header = r.encode();
        let header_tag = sealer.seal(&mut header);
        if !post.write || post.len == 0 {
            let at = queued * (REQUEST_LEN + TAG);
            headers[at..at + REQUEST_LEN].copy_from_slice(&header);
            headers[at + REQUEST_LEN..at + REQUEST_LEN + TAG].copy_from_slice(&header_tag);
            queued += 1;
            next = requests.try_recv().ok();
            // A put next sends its own header with its bytes, after these.
            if queued == HEADERS || next.is_none_or(|p| p.write && p.len > 0) {
                send_all(fd, &[&headers[..queued * (REQUEST_LEN + TAG)]], None)?;
                queued = 0;
            }
            continue;
        }
        let closed = guard.read().unwrap_or_else(PoisonError::into_inner);
        if *closed {
            return Ok(());
        }
        let mut crc = 0u32;
        for (i, (at, n)) in chunks(post.len).enumerate() {
            // SAFETY: the progress thread posted this put from host memory its batch keeps
            // registered until the put completes or the link closes; closing takes the guard,
            // held here, so the bytes are valid now, and the overlap rule keeps the batch
            // from writing them meanwhile.
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    std::ptr::with_exposed_provenance::<u8>((post.local + at) as usize),
                    n,
                )
            };
            let (record, tag) = match sealer.tag_of(bytes) {
                Some(tag) => (bytes, tag),
                None => {
                    let record = &mut scratch[..n];
                    let tag = sealer.seal_into(bytes, record);
                    (&*record, tag)
                }
            };
            // Hashed right after the tag or the seal read the bytes: from the cache.
            if post.hash {
                crc = crc32c_append(crc, bytes);
            }
            if i == 0 {
                send_all(fd, &[&header, &header_tag, record, &tag], None)?;
            } else {
                send_all(fd, &[record, &tag], None)?;
            }
        }
        if post.hashed_put() && sent.hashed.send(crc).is_err() {
            return Ok(()); // The reader ended.
        }
    }
    Ok(())
}

/// The reader's loop: answers in order, each opened before it counts, get bytes received
/// into place and opened there record by record; a get is reported done only once every
/// record of it opened. Returns why it ended.
fn read_answers<N: From<LinkEvent>>(
    stream: &TcpStream,
    guard: &RwLock<bool>,
    expected: &Expected,
    notify: &mpsc::Sender<N>,
    unanswered: &AtomicU64,
    opener: &mut Opener,
) -> End {
    let failed = |e: io::Error| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            "its connection closed".to_owned()
        } else {
            format!("its connection failed: {e}")
        }
    };
    let broken = |why: &str| End::Broken(why.to_owned());
    // A record's tag and the next answer's header usually arrived with it: read with it.
    let mut inbox = Inbox::new();
    for id in 0u64.. {
        let mut crc = 0u32;
        let mut header = [0; RESPONSE_LEN + TAG];
        if inbox.buffered() < header.len() && unanswered.load(Ordering::Relaxed) > 0 {
            // An answer is due: look for it a moment before blocking (see `readable_soon`).
            let fd = stream.as_raw_fd();
            readable_soon(&mut [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }]);
        }
        if let Err(e) = inbox.read_exact(stream.as_fd(), &mut header, RESPONSE_LEN + TAG) {
            return End::Closed(failed(e));
        }
        let (body, tag) = header.split_at_mut(RESPONSE_LEN);
        let tag: [u8; TAG] = (&*tag).try_into().expect("16 bytes");
        if opener.open(body, &tag).is_err() {
            return broken(
                "an answer did not authenticate (forged, replayed, reordered or corrupted)",
            );
        }
        // The writer queues a request here before sending it: an answer with none queued
        // answers nothing this side asked.
        let post = match expected.posts.try_recv() {
            Ok(post) => post,
            Err(mpsc::TryRecvError::Empty) => return broken("it answered a request never sent"),
            Err(mpsc::TryRecvError::Disconnected) => return End::Closed("the link closed".into()),
        };
        let status = body[0];
        let got_id = u64::from_le_bytes(body[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(body[16..24].try_into().expect("8 bytes"));
        if got_id != id {
            return broken(&format!("it answered request {got_id} where {id} was due"));
        }
        if status != 0 {
            let words = Refusal::from_status(status).map_or("an unknown answer", Refusal::words);
            if post.user_data != HEARTBEAT {
                let _ = notify.send(
                    LinkEvent::Done {
                        user_data: post.user_data,
                        result: Err(words.to_owned()),
                        crc: None,
                    }
                    .into(),
                );
            }
            return broken(words);
        }
        if post.write || post.user_data == HEARTBEAT {
            if len != 0 {
                return broken(&format!("it answered a put or a heartbeat with {len} bytes"));
            }
            if post.user_data == HEARTBEAT {
                continue;
            }
            if post.hashed_put() {
                // Sent by the writer right after the put's bytes, which the server took
                // before it answered (or it lied, and the writer sends it once it has sent
                // them, or ends).
                match expected.hashes.recv() {
                    Ok(put_crc) => crc = put_crc,
                    Err(_) => return End::Closed("the link closed".into()),
                }
            }
        } else {
            if len != post.len {
                return broken(&format!("it answered a get of {} bytes with {len}", post.len));
            }
            let closed = guard.read().unwrap_or_else(PoisonError::into_inner);
            if *closed {
                return End::Closed("the link closed".into());
            }
            for (at, n) in chunks(len) {
                // SAFETY: the progress thread posted this get into host memory its batch
                // keeps registered, and nothing else touches (the overlap rule and the
                // registration's contract), until the get completes (reported below) or the
                // link closes; closing takes the guard, held here.
                let record = unsafe {
                    std::slice::from_raw_parts_mut(
                        std::ptr::with_exposed_provenance_mut::<u8>((post.local + at) as usize),
                        n,
                    )
                };
                let mut tag = [0u8; TAG];
                let read = inbox
                    .read_exact(stream.as_fd(), record, TAG + RESPONSE_LEN + TAG)
                    .and_then(|()| inbox.read_exact(stream.as_fd(), &mut tag, RESPONSE_LEN + TAG));
                if let Err(e) = read {
                    return End::Closed(format!("{} mid-get", failed(e)));
                }
                if opener.open(record, &tag).is_err() {
                    return broken(
                        "a get's bytes did not authenticate (forged, replayed, reordered or \
                         corrupted); its object fails",
                    );
                }
                if post.hash {
                    crc = crc32c_append(crc, record);
                }
            }
        }
        unanswered.fetch_sub(post.len + 1, Ordering::Relaxed);
        let crc = post.hash.then_some(crc);
        let _ =
            notify.send(LinkEvent::Done { user_data: post.user_data, result: Ok(()), crc }.into());
    }
    unreachable!("request ids do not run out")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `keepalive` sets is what the kernel then holds for the socket, read back: the
    /// probes' start (whole seconds), interval and count, and the unacknowledged-data bound
    /// (whole milliseconds); durations under the kernel's unit become one of it.
    #[test]
    fn keepalive_sets_the_probes_and_the_unacknowledged_bound() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (served, _) = listener.accept().unwrap();
        let cases = [
            (Duration::from_millis(7_300), Duration::from_micros(2_500_900), 7, 2_500),
            (Duration::ZERO, Duration::ZERO, 1, 1),
        ];
        for stream in [&client, &served] {
            let socket = socket2::SockRef::from(stream);
            assert!(!socket.keepalive().unwrap(), "off until asked");
            for (idle, unacknowledged, secs, ms) in cases {
                keepalive(stream, idle, unacknowledged).unwrap();
                assert!(socket.keepalive().unwrap());
                assert_eq!(socket.tcp_keepalive_time().unwrap(), Duration::from_secs(secs));
                assert_eq!(socket.tcp_keepalive_interval().unwrap(), Duration::from_secs(1));
                assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
                let bound = socket.tcp_user_timeout().unwrap();
                assert_eq!(bound, Some(Duration::from_millis(ms)));
            }
        }
    }

    /// A peer on a loopback address, or at this side's own address, is on this host; any
    /// other is not.
    #[test]
    fn one_host_is_loopback_or_this_sides_own_address() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(one_host(ip("127.0.0.1"), ip("127.0.0.1")));
        assert!(one_host(ip("10.0.0.5"), ip("127.0.0.2")));
        assert!(one_host(ip("10.0.0.5"), ip("10.0.0.5")));
        assert!(one_host(ip("::1"), ip("::1")));
        assert!(!one_host(ip("10.0.0.5"), ip("10.0.0.6")));
        assert!(!one_host(ip("fd00::1"), ip("fd00::2")));
    }

    /// The name of the congestion control the kernel holds for `socket`.
    fn held(socket: &socket2::Socket) -> String {
        let mut name = socket.tcp_congestion().unwrap();
        name.retain(|&b| b != 0);
        String::from_utf8(name).unwrap()
    }

    /// What the congestion functions set is what the kernel then holds, read back: `System`
    /// leaves the default; `Auto` moves a BBR socket to `cubic` or `reno` on loopback (and
    /// only there before connecting), leaving any other algorithm; `Named` sets its own.
    #[test]
    fn congestion_is_what_was_asked_read_back() {
        use socket2::{Domain, Socket, Type};
        let fresh = || Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        let default = held(&fresh());
        let unpaced = |name: &str| ["cubic", "reno"].contains(&name);
        let socket = fresh();
        pick_congestion(&socket, true, &Congestion::System).unwrap();
        assert_eq!(held(&socket), default);
        pick_congestion(&socket, false, &Congestion::Auto).unwrap();
        assert_eq!(held(&socket), default, "Auto does not guess before a loopback connection");
        pick_congestion(&socket, true, &Congestion::Auto).unwrap();
        assert!(held(&socket) == default || unpaced(&held(&socket)), "{}", held(&socket));
        assert_eq!(held(&socket) != default, default.starts_with("bbr"));
        pick_congestion(&socket, false, &Congestion::Named("reno".into())).unwrap();
        assert_eq!(held(&socket), "reno");
        pick_congestion(&socket, true, &Congestion::Auto).unwrap();
        assert_eq!(held(&socket), "reno", "Auto leaves an algorithm that does not pace");

        // A socket under BBR, where the kernel has it: Auto moves it, before connecting and
        // on a loopback connection after it.
        let bbr = fresh();
        match bbr.set_tcp_congestion(b"bbr") {
            Ok(()) => {
                pick_congestion(&bbr, true, &Congestion::Auto).unwrap();
                assert!(unpaced(&held(&bbr)), "{}", held(&bbr));
                let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
                let (served, _) = listener.accept().unwrap();
                for stream in [&client, &served] {
                    let socket = socket2::SockRef::from(stream);
                    socket.set_tcp_congestion(b"bbr").unwrap();
                    unpace_on_host(stream, &Congestion::System).unwrap();
                    assert_eq!(held(&socket), "bbr");
                    unpace_on_host(stream, &Congestion::Auto).unwrap();
                    assert!(unpaced(&held(&socket)), "{}", held(&socket));
                }
            }
            Err(e) => eprintln!("skipping the BBR cases: the kernel refuses bbr ({e})"),
        }
    }

    /// `connect` reaches a loopback listener with the congestion control asked for.
    #[test]
    fn connect_picks_the_congestion_control_first() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let timeout = Duration::from_secs(10);
        let stream = connect(addr, timeout, &Congestion::Named("reno".into())).unwrap();
        assert_eq!(held(&socket2::SockRef::from(&stream)), "reno");
        let stream = connect(addr, timeout, &Congestion::Auto).unwrap();
        let name = held(&socket2::SockRef::from(&stream));
        assert!(!name.starts_with("bbr"), "{name}");
        let missing = Congestion::Named("no-such-algorithm".into());
        assert!(connect(addr, timeout, &missing).is_err());
    }

    #[test]
    fn requests_round_trip_and_are_checked_against_the_exports() {
        let r = Request::put(3, 99, 1 << 40, 77);
        assert_eq!(Request::decode(&r.encode()), r);
        let regions = [Served::new(0x1000, 4096, true), Served::new(0x9000, 4096, false)];
        assert_eq!(check(&regions, &Request::get(0, 0, 0, 4096)), Ok((0x1000, 4096)));
        assert_eq!(check(&regions, &Request::put(0, 0, 4000, 96)), Ok((0x1000 + 4000, 96)));
        assert_eq!(check(&regions, &Request::get(0, 0, 1, 4096)), Err(Refusal::Outside));
        assert_eq!(check(&regions, &Request::get(0, 0, u64::MAX, 2)), Err(Refusal::Outside));
        assert_eq!(check(&regions, &Request::get(0, 0, 4097, 0)), Err(Refusal::Outside));
        assert_eq!(check(&regions, &Request::put(1, 0, 0, 1)), Err(Refusal::ReadOnly));
        assert_eq!(check(&regions, &Request::get(1, 0, 0, 1)), Ok((0x9000, 1)));
        assert_eq!(check(&regions, &Request::get(2, 0, 0, 1)), Err(Refusal::NoRegion));
        let bad = Request { op: 7, ..Request::get(0, 0, 0, 1) };
        assert_eq!(check(&regions, &bad), Err(Refusal::BadOp));
    }

    /// A server thread's wait between requests, whether what it waits for is there at once,
    /// arrives while it looks before blocking, or arrives after: a drain wins over a waiting
    /// request, a request is seen, and nothing at all is idle.
    #[test]
    fn a_record_locks_the_stripes_it_touches_lower_index_first() {
        let base = 0x7f00_0000_1000;
        let region = Served::new(base, 100 * STRIPE, true);
        let at = |stripe: u64, offset: u64| base + stripe * STRIPE + offset;
        let chunk = CHUNK;
        assert_eq!(region.stripes(at(0, 0), chunk), (0, None));
        assert_eq!(region.stripes(at(0, 1), chunk), (0, Some(1)));
        assert_eq!(region.stripes(at(5, STRIPE - 1), 1), (5, None));
        assert_eq!(region.stripes(at(5, STRIPE - 1), 2), (5, Some(6)));
        // Stripes 63 and 64 share no lock; 64 takes lock 0, which comes first.
        assert_eq!(region.stripes(at(63, 4096), chunk), (0, Some(63)));
        assert_eq!(region.stripes(at(64, 0), 4096), (0, None));
        // Two records that share a byte share a lock; a writer waits for a reader of it.
        let _reading = region.read(at(10, STRIPE - 10), 20);
        assert!(region.locks[11].try_write().is_err());
        assert!(region.locks[12].try_write().is_ok());
    }

    #[test]
    fn waiting_for_a_request_sees_the_drain_first_then_the_request_then_idleness() {
        use std::io::Write;
        use std::os::unix::net::UnixStream;
        let (mut client, server) = UnixStream::pair().unwrap();
        let (mut drain_tx, drain_rx) = UnixStream::pair().unwrap();
        let (fd, drain) = (server.as_raw_fd(), drain_rx.as_raw_fd());
        let idle = Duration::from_millis(1);
        assert!(matches!(wait_for_request(fd, drain, idle).unwrap(), Wait::Idle));
        client.write_all(&[1]).unwrap();
        assert!(matches!(wait_for_request(fd, drain, idle).unwrap(), Wait::Request));
        drain_tx.write_all(&[1]).unwrap();
        assert!(matches!(wait_for_request(fd, drain, idle).unwrap(), Wait::Drain));
        // Bytes that come after the look before blocking: the blocking wait sees them.
        let (mut client, server) = UnixStream::pair().unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(SPIN_BEFORE_SLEEP * 20);
            client.write_all(&[1]).unwrap();
            client
        });
        let (_open, quiet) = UnixStream::pair().unwrap(); // kept open: a closed peer reads as ready
        let waited =
            wait_for_request(server.as_raw_fd(), quiet.as_raw_fd(), Duration::from_secs(600));
        assert!(matches!(waited.unwrap(), Wait::Request));
        drop(late.join().unwrap());
    }
}
