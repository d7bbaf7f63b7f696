//! A socket's read-ahead: what arrived behind the bytes asked for, kept for the next read.
//!
//! The checked path's messages are small headers and tags around large records. Read one
//! `read` at a time, a 64 KiB get costs the client three receives (its answer's header, the
//! record, the tag) and the server two system calls per request (a `poll`, then the header),
//! although the bytes usually arrived together. An [`Inbox`] fills the destination first and,
//! in the same `readv`, up to `ahead` more bytes into a small buffer of its own: the tag and
//! the next header come with the record, and a server finds a client's queued requests
//! already read. `ahead` is bounded by the caller, so a record's bytes are received straight
//! into their destination (only what was read ahead of a record, at most a buffer, is copied
//! once more).
//!
//! Written by hand rather than through `std::io::BufReader`, which reads into its buffer
//! whenever it is empty and only bypasses it for reads at least as large as the whole buffer:
//! every record would go through the buffer, or the buffer would never hold the next header.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Bytes an [`Inbox`] can hold: 85 request headers with their tags.
pub(crate) const CAPACITY: usize = 4096;

/// Bytes read ahead of what a caller asked for, not yet handed out.
pub(crate) struct Inbox {
    buf: Box<[u8; CAPACITY]>,
    /// `buf[start..end]` is unread.
    start: usize,
    end: usize,
}

impl Inbox {
    pub(crate) fn new() -> Self {
        Self { buf: Box::new([0; CAPACITY]), start: 0, end: 0 }
    }

    /// Bytes read ahead and not yet handed out.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Fills `dst` whole: first from what was read ahead, then from the socket `fd`, each
    /// system call also reading up to `ahead` bytes past `dst` (less where the buffer holds
    /// less) into the inbox. Fails with `UnexpectedEof` when the peer closed before `dst` was
    /// full, and as the socket fails otherwise (a receive timeout as `WouldBlock`); what was
    /// read of `dst` before is then unspecified.
    pub(crate) fn read_exact(
        &mut self,
        fd: BorrowedFd<'_>,
        dst: &mut [u8],
        ahead: usize,
    ) -> io::Result<()> {
        let from_buf = self.buffered().min(dst.len());
        dst[..from_buf].copy_from_slice(&self.buf[self.start..self.start + from_buf]);
        self.start += from_buf;
        let mut done = from_buf;
        if done == dst.len() {
            return Ok(());
        }
        // Everything buffered went into `dst`: the buffer is empty, start it over.
        (self.start, self.end) = (0, 0);
        let ahead = ahead.min(CAPACITY);
        while done < dst.len() {
            let rest = &mut dst[done..];
            let mut iov = [
                libc::iovec { iov_base: rest.as_mut_ptr().cast(), iov_len: rest.len() },
                libc::iovec { iov_base: self.buf.as_mut_ptr().cast(), iov_len: ahead },
            ];
            // SAFETY: both iovecs name memory borrowed mutably for the whole call (`rest`
            // from `dst`, the first `ahead <= CAPACITY` bytes of `buf`), which do not
            // overlap; the kernel writes at most their lengths and nothing after the call.
            let got = unsafe { libc::readv(fd.as_raw_fd(), iov.as_mut_ptr(), 2) };
            if got < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let got = got as usize;
            if got == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed"));
            }
            let wanted = rest.len();
            done += got.min(wanted);
            self.end = got.saturating_sub(wanted);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// Whatever the reads ask for and however far ahead they read, they hand out the stream's
    /// bytes in order, each exactly once, and read ahead no more than asked.
    #[test]
    fn reads_hand_out_the_stream_in_order_and_never_read_further_ahead_than_asked() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        let stream: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let writer = {
            let stream = stream.clone();
            std::thread::spawn(move || {
                for piece in stream.chunks(1_000) {
                    tx.write_all(piece).unwrap();
                }
            })
        };
        let mut inbox = Inbox::new();
        let mut got = Vec::new();
        let mut seed = 0x9e37_79b9u32;
        while got.len() < stream.len() {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let want = ((seed >> 8) as usize % 70_000).clamp(1, stream.len() - got.len());
            let ahead = (seed >> 4) as usize % 5_000;
            let before = inbox.buffered();
            let mut dst = vec![0u8; want];
            inbox.read_exact(rx.as_fd(), &mut dst, ahead).unwrap();
            got.extend_from_slice(&dst);
            if before < want {
                assert!(inbox.buffered() <= ahead.min(CAPACITY), "read ahead past {ahead}");
            } else {
                assert_eq!(inbox.buffered(), before - want, "served from the buffer alone");
            }
        }
        writer.join().unwrap();
        assert!(got == stream, "the bytes came out in order, each once");
        assert_eq!(inbox.buffered(), 0);
    }

    /// The peer closing mid-read is `UnexpectedEof`; bytes read ahead before it still come
    /// out first.
    #[test]
    fn a_close_mid_read_is_unexpected_eof_after_the_buffered_bytes() {
        let (mut tx, rx) = UnixStream::pair().unwrap();
        tx.write_all(&[1, 2, 3, 4, 5]).unwrap();
        drop(tx);
        let mut inbox = Inbox::new();
        let mut two = [0u8; 2];
        inbox.read_exact(rx.as_fd(), &mut two, 64).unwrap();
        assert_eq!((two, inbox.buffered()), ([1, 2], 3));
        let mut five = [0u8; 5];
        let e = inbox.read_exact(rx.as_fd(), &mut five, 64).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(five[..3], [3, 4, 5]);
    }
}
