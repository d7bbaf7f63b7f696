//! The checked request path: reads and writes that the server checks before it touches
//! memory, for every transport on which UCX does not enforce remote keys in hardware.
//!
//! Over TCP and shared memory UCX emulates one-sided operations in software and checks
//! neither a key's bounds nor its rights (UCT's TCP transport even writes a peer's put to
//! whatever address the peer names). There the server hands out no keys and runs no UCX at
//! all: after the handshake, the authenticated control connection carries requests, answered
//! in order, one at a time, each checked against the exported regions first:
//!
//! ```text
//! request   op u8 (1 get, 2 put), 0 [3], region u32, id u64, offset u64, len u64
//!           then, for a put, len bytes
//! response  status u8 (0 done, else refused: 1 outside the export, 2 read-only,
//!           3 no such region, 4 unknown operation), 0 [7], id u64, len u64
//!           then, for a done get, len bytes
//! ```
//!
//! A refused request ends the connection (the server reads no payload of it), so a client
//! that sends one is one that bypassed its own engine's checks.
//!
//! On the client, each checked peer has a writer thread (requests, and the bytes of puts)
//! and a reader thread (answers, and the bytes of gets, received straight into the
//! destination). Both touch local memory only while holding the link's guard and only while
//! the link is open; closing it shuts the socket down and then takes the guard, so once
//! [`Link::close`] returns no byte of local memory is touched again (what a forced UCX
//! endpoint close gives the one-sided path).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};

use crate::progress::Command;

/// Bytes of a request header.
pub(crate) const REQUEST_LEN: usize = 32;
/// Bytes of a response header.
pub(crate) const RESPONSE_LEN: usize = 24;
const GET: u8 = 1;
const PUT: u8 = 2;

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
#[derive(Copy, Clone, Debug)]
pub(crate) struct Served {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) writable: bool,
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

/// Serves one authenticated client's requests until it leaves, the server stops (its socket
/// is shut down) or it sends a request the exports do not allow.
///
/// # Safety
///
/// Every region of `regions` is memory of this process that stays mapped while this runs,
/// and its owner accepts that peers read it (and write the writable ones) at any time.
pub(crate) unsafe fn serve(mut stream: TcpStream, regions: &[Served]) -> io::Result<()> {
    let fd = stream.as_raw_fd();
    loop {
        let mut header = [0; REQUEST_LEN];
        match stream.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let request = Request::decode(&header);
        let (addr, len) = match check(regions, &request) {
            Ok(bytes) => bytes,
            Err(refusal) => {
                tracing::warn!(?request, ?refusal, "refused a request; closing the connection");
                stream.write_all(&response(refusal as u8, request.id, 0))?;
                return Ok(());
            }
        };
        if request.op == GET {
            stream.write_all(&response(0, request.id, len))?;
            // SAFETY: `check` kept `addr .. addr + len` inside an exported region, which the
            // caller keeps mapped and readable by peers.
            unsafe { send_raw(fd, addr, len) }?;
        } else {
            // SAFETY: as above, inside a region exported writable.
            unsafe { recv_raw(fd, addr, len) }?;
            stream.write_all(&response(0, request.id, 0))?;
        }
    }
}

/// Sends `len` bytes from `addr`.
///
/// # Safety
///
/// `addr .. addr + len` is readable memory of this process for the whole call.
unsafe fn send_raw(fd: i32, addr: u64, len: u64) -> io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let chunk = (len - done).min(1 << 30) as usize;
        // SAFETY: inside the caller's range; MSG_NOSIGNAL turns a closed peer into EPIPE
        // rather than a signal.
        let sent = unsafe {
            libc::send(fd, (addr + done) as usize as *const libc::c_void, chunk, libc::MSG_NOSIGNAL)
        };
        if sent < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += sent as u64;
    }
    Ok(())
}

/// Receives exactly `len` bytes into `addr`.
///
/// # Safety
///
/// `addr .. addr + len` is writable memory of this process for the whole call, which nothing
/// else reads or writes meanwhile (beyond what its owner accepted).
unsafe fn recv_raw(fd: i32, addr: u64, len: u64) -> io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let chunk = (len - done).min(1 << 30) as usize;
        // SAFETY: inside the caller's range.
        let got = unsafe { libc::recv(fd, (addr + done) as usize as *mut libc::c_void, chunk, 0) };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        done += got as u64;
    }
    Ok(())
}

/// One request the progress thread hands a checked link.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Post {
    /// What the completion reports ([`Command::CheckedDone`]).
    pub(crate) user_data: u64,
    pub(crate) write: bool,
    pub(crate) region: u32,
    pub(crate) offset: u64,
    /// The local bytes: written by a get, read by a put.
    pub(crate) local: u64,
    pub(crate) len: u64,
}

/// A checked peer as the client's progress thread holds it.
pub(crate) struct Link {
    stream: TcpStream,
    posts: Option<mpsc::Sender<Post>>,
    /// Held while an I/O thread touches local memory; `true` once closed.
    guard: Arc<Mutex<bool>>,
    closing: Arc<AtomicBool>,
}

impl Link {
    /// Starts the link's threads on an authenticated connection. Completions and the link's
    /// end (as [`Command::PeerLost`] for `slot`) go to `notify`.
    pub(crate) fn start(
        stream: TcpStream,
        slot: u32,
        notify: mpsc::Sender<Command>,
    ) -> io::Result<Self> {
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let guard = Arc::new(Mutex::new(false));
        let closing = Arc::new(AtomicBool::new(false));
        let (posts, requests) = mpsc::channel::<Post>();
        let (expect, expected) = mpsc::channel::<Post>();
        let writer = {
            let (mut stream, guard) = (stream.try_clone()?, Arc::clone(&guard));
            move || -> io::Result<()> {
                let fd = stream.as_raw_fd();
                for (id, post) in (0u64..).zip(requests) {
                    let _ = expect.send(post);
                    let r = if post.write {
                        Request::put(post.region, id, post.offset, post.len)
                    } else {
                        Request::get(post.region, id, post.offset, post.len)
                    };
                    stream.write_all(&r.encode())?;
                    if post.write {
                        let closed = guard.lock().unwrap_or_else(PoisonError::into_inner);
                        if *closed {
                            return Ok(());
                        }
                        // SAFETY: the progress thread posted this put from host memory its
                        // batch keeps registered until the put completes or the link closes;
                        // closing takes the guard, held here, so the bytes are valid now.
                        unsafe { send_raw(fd, post.local, post.len) }?;
                    }
                }
                Ok(())
            }
        };
        let reader = {
            let (mut stream, guard) = (stream.try_clone()?, Arc::clone(&guard));
            let (notify, closing) = (notify.clone(), Arc::clone(&closing));
            move || {
                let why = read_answers(&mut stream, &guard, &expected, &notify);
                if !closing.load(Ordering::Acquire) {
                    let _ = notify.send(Command::PeerLost { slot, reason: why });
                }
            }
        };
        std::thread::Builder::new().name(format!("umbp-ucx-put-{slot}")).spawn(move || {
            if let Err(e) = writer() {
                tracing::debug!(error = %e, "checked link writer ended");
            }
        })?;
        std::thread::Builder::new().name(format!("umbp-ucx-get-{slot}")).spawn(reader)?;
        Ok(Self { stream, posts: Some(posts), guard, closing })
    }

    /// Hands a request to the writer; `false` if the link is gone.
    pub(crate) fn post(&self, post: Post) -> bool {
        self.posts.as_ref().is_some_and(|p| p.send(post).is_ok())
    }

    /// Closes the link: once this returns, its threads touch no local memory again and do
    /// not report the link's end (a completion they had already read may still arrive; the
    /// progress thread ignores reports for requests it no longer has in flight).
    pub(crate) fn close(mut self) {
        self.close_now();
    }

    fn close_now(&mut self) {
        self.closing.store(true, Ordering::Release);
        self.posts = None;
        let _ = self.stream.shutdown(Shutdown::Both);
        // Waits for an I/O thread inside a transfer (the shutdown ends its system call).
        *self.guard.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.close_now();
    }
}

/// The reader's loop: answers in order, get bytes into place; returns why it ended.
fn read_answers(
    stream: &mut TcpStream,
    guard: &Mutex<bool>,
    expected: &mpsc::Receiver<Post>,
    notify: &mpsc::Sender<Command>,
) -> String {
    let fd = stream.as_raw_fd();
    for id in 0u64.. {
        let mut header = [0; RESPONSE_LEN];
        if let Err(e) = stream.read_exact(&mut header) {
            return if e.kind() == io::ErrorKind::UnexpectedEof {
                "its connection closed".into()
            } else {
                format!("its connection failed: {e}")
            };
        }
        let Ok(post) = expected.recv() else { return "the link closed".into() };
        let status = header[0];
        let got_id = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        if got_id != id {
            return format!("it answered request {got_id} where {id} was due");
        }
        if status != 0 {
            let words = Refusal::from_status(status).map_or("an unknown answer", Refusal::words);
            let _ = notify.send(Command::CheckedDone {
                user_data: post.user_data,
                result: Err(words.to_owned()),
            });
            return words.into();
        }
        if post.write {
            if len != 0 {
                return format!("it answered a put with {len} bytes");
            }
        } else {
            if len != post.len {
                return format!("it answered a get of {} bytes with {len}", post.len);
            }
            let closed = guard.lock().unwrap_or_else(PoisonError::into_inner);
            if *closed {
                return "the link closed".into();
            }
            // SAFETY: the progress thread posted this get into host memory its batch keeps
            // registered, and nothing else touches, until the get completes (reported below)
            // or the link closes; closing takes the guard, held here.
            if let Err(e) = unsafe { recv_raw(fd, post.local, len) } {
                return format!("its connection failed mid-get: {e}");
            }
        }
        let _ = notify.send(Command::CheckedDone { user_data: post.user_data, result: Ok(()) });
    }
    unreachable!("request ids do not run out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_are_checked_against_the_exports() {
        let r = Request::put(3, 99, 1 << 40, 77);
        assert_eq!(Request::decode(&r.encode()), r);
        let regions = [
            Served { addr: 0x1000, len: 4096, writable: true },
            Served { addr: 0x9000, len: 4096, writable: false },
        ];
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
}
