//! The batched lookup's own path over plain TCP: the pipeline written as RESP by hand and each
//! reply's values decoded in place, without redis-rs's `Value` tree.
//!
//! Why: a lookup of 62,500 keys answers about 2.3 MB of `HMGET` replies (and a lookup through
//! group summaries about 1.9 MB in 250 values). redis-rs parses each value into its own
//! heap-allocated `Value::BulkString` inside nested arrays (62,500 allocations, then a copy
//! out). Here the reply is read 256 KiB at a time into one reused buffer and each value is
//! handed to the caller where it lies, so the client's share of a lookup is a small part of
//! the server's (the crate's CHANGELOG has the measured figures).
//!
//! The requests are the redis-rs path's (the alive-nodes script by `EVALSHA`, then one
//! `HMGET` per [`LOOKUP_CHUNK`](super::LOOKUP_CHUNK) fields, in one pipeline), so the server
//! does the same work and the answers are identical. Connections are this path's own, pooled,
//! authenticated and given the same timeouts as the others; one whose call failed is dropped.
//! TLS and Unix-socket servers keep the redis-rs path.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

use redis::{ErrorKind, RedisError};

use super::FieldRead;
use crate::Error;

/// Where and how to connect for the direct path.
#[derive(Debug)]
pub(super) struct Direct {
    host: String,
    port: u16,
    username: Option<String>,
    password: Option<String>,
    db: i64,
    timeout: Duration,
    idle: Mutex<Vec<Conn>>,
}

/// One connection and its buffers, reused from lookup to lookup.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    /// The request being written.
    out: Vec<u8>,
    /// Bytes read and not yet parsed: `buf[pos..len]`.
    buf: Vec<u8>,
    pos: usize,
    len: usize,
}

/// The read buffer: the chunks' replies stream through it (about 150 KB per 4,096-key chunk).
const READ_BUFFER: usize = 256 << 10;

fn protocol(what: String) -> Error {
    Error::Redis(RedisError::from((ErrorKind::ResponseError, "unexpected reply", what)))
}

fn io(e: std::io::Error) -> Error {
    Error::Redis(RedisError::from(e))
}

/// Appends one bulk string (`$len\r\nbytes\r\n`).
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    push_int(out, bytes.len() as i64);
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Appends `n\r\n`.
fn push_int(out: &mut Vec<u8>, n: i64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut v = n.unsigned_abs();
    loop {
        i -= 1;
        digits[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    if n < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&digits[i..]);
    out.extend_from_slice(b"\r\n");
}

/// Appends a command's array header (`*n\r\n`).
fn array(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    push_int(out, n as i64);
}

/// One reply header: its type byte and the rest of its line (without `\r\n`).
enum Header<'a> {
    /// `*n`, `$n`, `:n`: the number (`-1` for a RESP2 nil).
    Number(u8, i64),
    /// `_` (a RESP3 nil).
    Nil,
    /// `+text` (`+OK`).
    Simple,
    /// `-text`.
    Failure(&'a [u8]),
}

impl Conn {
    fn open(d: &Direct) -> Result<Self, Error> {
        let addrs = (d.host.as_str(), d.port).to_socket_addrs().map_err(io)?;
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, d.timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = match (stream, last) {
            (Some(s), _) => s,
            (None, Some(e)) => return Err(io(e)),
            (None, None) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} resolves to no address", d.host),
                )))
            }
        };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(Some(d.timeout)).map_err(io)?;
        stream.set_write_timeout(Some(d.timeout)).map_err(io)?;
        let mut conn = Self { stream, out: Vec::new(), buf: vec![0; READ_BUFFER], pos: 0, len: 0 };
        let mut expect = 0;
        if let Some(password) = &d.password {
            match &d.username {
                Some(user) => {
                    array(&mut conn.out, 3);
                    bulk(&mut conn.out, b"AUTH");
                    bulk(&mut conn.out, user.as_bytes());
                }
                None => {
                    array(&mut conn.out, 2);
                    bulk(&mut conn.out, b"AUTH");
                }
            }
            bulk(&mut conn.out, password.as_bytes());
            expect += 1;
        }
        if d.db != 0 {
            array(&mut conn.out, 2);
            bulk(&mut conn.out, b"SELECT");
            bulk(&mut conn.out, d.db.to_string().as_bytes());
            expect += 1;
        }
        if expect > 0 {
            conn.send()?;
            for _ in 0..expect {
                match conn.header()? {
                    Header::Simple => {}
                    Header::Failure(why) => {
                        let why = String::from_utf8_lossy(why).into_owned();
                        return Err(Error::Redis(RedisError::from((
                            ErrorKind::AuthenticationFailed,
                            "the server refused the connection's setup",
                            why,
                        ))));
                    }
                    _ => return Err(protocol("AUTH or SELECT answered oddly".into())),
                }
            }
        }
        Ok(conn)
    }

    fn send(&mut self) -> Result<(), Error> {
        self.stream.write_all(&self.out).map_err(io)?;
        self.out.clear();
        Ok(())
    }

    /// Makes at least `n` unparsed bytes available in `buf[pos..len]`.
    fn fill(&mut self, n: usize) -> Result<(), Error> {
        if self.len - self.pos >= n {
            return Ok(());
        }
        if self.buf.len() - self.pos < n {
            self.buf.copy_within(self.pos..self.len, 0);
            self.len -= self.pos;
            self.pos = 0;
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
        }
        while self.len - self.pos < n {
            let got = match self.stream.read(&mut self.buf[self.len..]) {
                Ok(got) => got,
                // A signal interrupted the read (a socket with a timeout is never restarted
                // by the kernel): nothing was read, read again.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io(e)),
            };
            if got == 0 {
                return Err(io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            self.len += got;
        }
        Ok(())
    }

    /// The next reply header line.
    fn header(&mut self) -> Result<Header<'_>, Error> {
        let mut scanned = 0;
        let end = loop {
            if let Some(i) = self.buf[self.pos + scanned..self.len].iter().position(|&b| b == b'\n')
            {
                break self.pos + scanned + i;
            }
            scanned = self.len - self.pos;
            if scanned > 64 << 10 {
                return Err(protocol("a reply line longer than 64 KiB".into()));
            }
            self.fill(scanned + 1)?;
        };
        let start = self.pos;
        self.pos = end + 1;
        let line = &self.buf[start..end];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let (&kind, rest) =
            line.split_first().ok_or_else(|| protocol("an empty reply line".into()))?;
        Ok(match kind {
            b'*' | b'$' | b':' => Header::Number(kind, parse_int(rest)?),
            b'_' => Header::Nil,
            b'+' => Header::Simple,
            b'-' => Header::Failure(rest),
            _ => return Err(protocol(format!("a reply of type {:?}", kind as char))),
        })
    }

    /// The next `n` bytes of a bulk string and its `\r\n`.
    fn bulk_body(&mut self, n: usize) -> Result<&[u8], Error> {
        self.fill(n + 2)?;
        let start = self.pos;
        self.pos += n + 2;
        if &self.buf[start + n..start + n + 2] != b"\r\n" {
            return Err(protocol("a bulk string without its end".into()));
        }
        Ok(&self.buf[start..start + n])
    }

    /// Skips one whole reply (of any shape).
    fn skip(&mut self) -> Result<(), Error> {
        let mut pending = 1usize;
        while pending > 0 {
            pending -= 1;
            match self.header()? {
                Header::Number(b'*', n) if n > 0 => pending += n as usize,
                Header::Number(b'$', n) if n >= 0 => {
                    self.bulk_body(n as usize)?;
                }
                _ => {}
            }
        }
        Ok(())
    }
}

fn parse_int(digits: &[u8]) -> Result<i64, Error> {
    let (neg, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 18 {
        return Err(protocol(format!("a bad length {:?}", String::from_utf8_lossy(digits))));
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(protocol(format!("a bad length {:?}", String::from_utf8_lossy(digits))));
        }
        v = v * 10 + i64::from(d - b'0');
    }
    Ok(if neg { -v } else { v })
}

/// Where one value of a pipelined read goes: `(alive, read, i, value)`, with the alive nodes
/// (sorted), the read's index in the call's reads, the field's position in that read and its
/// value in place (`None`: not there).
pub(super) type Visit<'v> =
    dyn FnMut(&[u32], usize, usize, Option<&[u8]>) -> Result<(), Error> + 'v;

impl Direct {
    /// The direct path for `info`, or `None` when its server is not plain TCP (TLS and Unix
    /// sockets keep the redis-rs path).
    pub(super) fn for_connection(info: &redis::ConnectionInfo, timeout: Duration) -> Option<Self> {
        let redis::ConnectionAddr::Tcp(host, port) = &info.addr else { return None };
        Some(Self {
            host: host.clone(),
            port: *port,
            username: info.redis.username.clone(),
            password: info.redis.password.clone(),
            db: info.redis.db,
            timeout,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// One pipeline: `EVALSHA alive_sha 0 prefix`, then per read `(hash, n, field)` an
    /// `HMGET prefix:hash` of its `n` fields per `chunk` of them; each value goes to `visit`
    /// as it is decoded. Returns `false` when the server did not know the alive-nodes script
    /// (`NOSCRIPT`: nothing was visited; load it and ask again).
    pub(super) fn read(
        &self,
        alive_sha: &str,
        prefix: &str,
        reads: &[FieldRead<'_, '_>],
        chunk: usize,
        visit: &mut Visit<'_>,
    ) -> Result<bool, Error> {
        let pooled = super::lock(&self.idle).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => Conn::open(self)?,
        };
        let known = Self::read_on(&mut conn, alive_sha, prefix, reads, chunk, visit)?;
        // Only a connection whose replies were read to the end goes back to the pool.
        super::lock(&self.idle).push(conn);
        Ok(known)
    }

    fn read_on(
        conn: &mut Conn,
        alive_sha: &str,
        prefix: &str,
        reads: &[FieldRead<'_, '_>],
        chunk: usize,
        visit: &mut Visit<'_>,
    ) -> Result<bool, Error> {
        let out = &mut conn.out;
        out.clear();
        array(out, 4);
        bulk(out, b"EVALSHA");
        bulk(out, alive_sha.as_bytes());
        bulk(out, b"0");
        bulk(out, prefix.as_bytes());
        for &(hash, n, field) in reads {
            let hash = format!("{prefix}:{hash}");
            out.reserve(n * 24 + n.div_ceil(chunk) * 32);
            for start in (0..n).step_by(chunk) {
                let end = n.min(start + chunk);
                array(out, 2 + end - start);
                bulk(out, b"HMGET");
                bulk(out, hash.as_bytes());
                for i in start..end {
                    bulk(out, field(i));
                }
            }
        }
        conn.send()?;

        // The alive nodes, sorted for a binary search per value.
        let mut alive: Vec<u32> = Vec::new();
        let mut no_script = false;
        match conn.header()? {
            Header::Number(b'*', n) => {
                for _ in 0..n.max(0) {
                    let id = match conn.header()? {
                        Header::Number(b':', v) => v,
                        Header::Number(b'$', len) if (0..=20).contains(&len) => {
                            parse_int(conn.bulk_body(len as usize)?)?
                        }
                        _ => return Err(protocol("an alive node that is not a number".into())),
                    };
                    alive.push(
                        u32::try_from(id)
                            .map_err(|_| protocol(format!("alive node id {id} out of range")))?,
                    );
                }
            }
            Header::Failure(why) if why.starts_with(b"NOSCRIPT") => no_script = true,
            Header::Failure(why) => {
                return Err(protocol(format!(
                    "the alive-nodes script failed: {}",
                    String::from_utf8_lossy(why)
                )))
            }
            _ => return Err(protocol("the alive-nodes script answered oddly".into())),
        }
        alive.sort_unstable();

        for (r, &(_, n, _)) in reads.iter().enumerate() {
            for start in (0..n).step_by(chunk) {
                let end = n.min(start + chunk);
                match conn.header()? {
                    Header::Number(b'*', count) if count == (end - start) as i64 => {}
                    Header::Failure(why) => {
                        return Err(protocol(format!(
                            "HMGET failed: {}",
                            String::from_utf8_lossy(why)
                        )))
                    }
                    _ => return Err(protocol("HMGET answered with the wrong count".into())),
                }
                for i in start..end {
                    if no_script {
                        conn.skip()?;
                        continue;
                    }
                    match conn.header()? {
                        Header::Number(b'$', -1) | Header::Nil => visit(&alive, r, i, None)?,
                        Header::Number(b'$', len) if len >= 0 => {
                            visit(&alive, r, i, Some(conn.bulk_body(len as usize)?))?
                        }
                        _ => return Err(protocol("HMGET answered a value of another type".into())),
                    }
                }
            }
        }
        Ok(!no_script)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_round_trip_through_the_wire_format() {
        for n in [0i64, 7, 16, 4096, 62_500, -1, i64::from(u32::MAX)] {
            let mut out = Vec::new();
            push_int(&mut out, n);
            assert_eq!(out, format!("{n}\r\n").as_bytes());
            assert_eq!(parse_int(&out[..out.len() - 2]).unwrap(), n);
        }
        for bad in [&b""[..], b"-", b"12a", b"1234567890123456789"] {
            assert!(parse_int(bad).is_err(), "{bad:?}");
        }
        let mut out = Vec::new();
        bulk(&mut out, b"HMGET");
        assert_eq!(out, b"$5\r\nHMGET\r\n");
    }
}
