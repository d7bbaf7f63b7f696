//! One read or write of a plan segment (or of a piece of a long one), as a small state machine
//! that both executors drive: ask it for its next [`Request`], hand it the result, repeat until
//! it is done.
//!
//! - A *direct* op moves the caller's bytes straight between the file and the caller's memory.
//!   A short transfer is resubmitted for the remainder.
//! - A *bounce* op (an `O_DIRECT` file and a file offset, length or memory address that is not
//!   aligned to the file's block size) goes through an aligned buffer covering the whole blocks
//!   around the caller's bytes. A read fills the buffer and copies the caller's bytes out; a
//!   write first reads the partial head and tail blocks (read-modify-write), copies the caller's
//!   bytes in, then writes the whole blocks.

use std::os::fd::RawFd;

use umbp_plan::{FailureCause, Tag};

use crate::sectors::{Claim, FileKey, Owned, Window};
use crate::sys::{BounceBuf, Dir, HostSlice, Request};

/// Transient errors that are retried, at most this many times per op.
const MAX_RETRIES: u32 = 64;

/// What an op waits for or holds in the sector table ([`Op::guard`]).
#[derive(Copy, Clone, Debug)]
pub(crate) enum Guard {
    /// Nothing: it may always start.
    None,
    /// It may start once no part of the window is being rewritten.
    Read(Window),
    /// It claims the window so, and keeps it until it is done.
    Write(Window, Claim),
}

/// What an op needs after a completion.
#[derive(Debug)]
pub(crate) enum Step {
    /// Issue [`Op::request`] again.
    Again,
    /// The op is finished.
    Done(Result<(), FailureCause>),
}

/// One op: the caller's `host.len()` bytes at absolute `file_offset` of `fd`.
#[derive(Debug)]
pub(crate) struct Op {
    /// Index of the plan, and of the segment inside it, that this op belongs to.
    pub(crate) plan: u32,
    pub(crate) segment: u32,
    /// Offset of the caller's first byte inside the file endpoint (for fault rules).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    pub(crate) endpoint_offset: u64,
    fd: RawFd,
    /// The file's identity, for the blocks a bounce op reads or rewrites.
    file: FileKey,
    dir: Dir,
    file_offset: u64,
    host: HostSlice,
    /// The file's `O_DIRECT` alignment; 1 for a buffered file.
    align: u64,
    mode: Mode,
    retries: u32,
    /// The window a started write owns (see `sectors`), released when the op is done or
    /// dropped.
    owned: Option<Owned>,
    /// Set on an op re-issued for one object's share of a failed segment: its failure costs
    /// that object only.
    pub(crate) only: Option<Tag>,
}

#[derive(Debug)]
enum Mode {
    Direct { done: u64 },
    Bounce(Bounce),
}

/// The aligned window `start .. start + span` of the file around the caller's bytes.
#[derive(Debug)]
struct Bounce {
    align: u64,
    start: u64,
    span: u64,
    stage: Stage,
    buf: Option<BounceBuf>,
}

/// Where a bounce op stands; each carries the bytes done in that stage.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Stage {
    /// Read-modify-write: reading the first block.
    Head(u64),
    /// Read-modify-write: reading the last block.
    Tail(u64),
    /// Reading or writing the whole window.
    Data(u64),
}

impl Op {
    /// An op moving `host` to or from `file_offset` of `fd` (the file `file`). `align` is the
    /// file's `O_DIRECT` alignment, or 1 for a buffered file. `None` if the aligned window
    /// overflows.
    pub(crate) fn new(
        (plan, segment, endpoint_offset): (u32, u32, u64),
        (fd, file): (RawFd, FileKey),
        dir: Dir,
        file_offset: u64,
        host: HostSlice,
        align: u64,
    ) -> Option<Self> {
        let align = align.max(1);
        let len = host.len() as u64;
        let aligned = |x: u64| x % align == 0;
        let mode = if align == 1
            || (aligned(file_offset) && aligned(len) && aligned(host.addr() as u64))
        {
            Mode::Direct { done: 0 }
        } else {
            let start = file_offset - file_offset % align;
            let end = file_offset.checked_add(len)?.checked_next_multiple_of(align)?;
            let span = end - start;
            let stage = match dir {
                Dir::Read => Stage::Data(0),
                Dir::Write if start != file_offset => Stage::Head(0),
                Dir::Write if end != file_offset + len => Stage::Tail(0),
                Dir::Write => Stage::Data(0),
            };
            Mode::Bounce(Bounce { align, start, span, stage, buf: None })
        };
        Some(Self {
            plan,
            segment,
            endpoint_offset,
            fd,
            file,
            dir,
            file_offset,
            host,
            align,
            mode,
            retries: 0,
            owned: None,
            only: None,
        })
    }

    /// A fresh op for bytes `from .. from + len` of this one (the same file, direction and
    /// memory), carrying only object `only` when set; `None` if the range leaves the op.
    pub(crate) fn part(&self, from: u64, len: u64, only: Option<Tag>) -> Option<Self> {
        if from.checked_add(len)? > self.len() || len == 0 {
            return None;
        }
        let host = self.host.sub(from as usize, len as usize);
        let key = (self.plan, self.segment, self.endpoint_offset + from);
        let file = (self.fd, self.file);
        let mut op = Self::new(key, file, self.dir, self.file_offset + from, host, self.align)?;
        op.only = only;
        Some(op)
    }

    pub(crate) fn dir(&self) -> Dir {
        self.dir
    }

    /// The caller's bytes.
    pub(crate) fn len(&self) -> u64 {
        self.host.len() as u64
    }

    /// Bytes of bounce buffer the op holds while it runs (0 for a direct op).
    pub(crate) fn bounce_bytes(&self) -> u64 {
        match &self.mode {
            Mode::Direct { .. } => 0,
            Mode::Bounce(b) => b.span,
        }
    }

    /// What the op must wait for, or hold, in the process's sector table before it starts
    /// (see `sectors`): a bounce read waits for rewrites of its blocks, a bounce write claims
    /// its blocks to rewrite them, a buffered write claims the bytes it writes. Aligned
    /// `O_DIRECT` ops and buffered reads need nothing.
    pub(crate) fn guard(&self) -> Guard {
        match (&self.mode, self.dir) {
            (Mode::Bounce(b), dir) => {
                let window = Window { file: self.file, start: b.start, end: b.start + b.span };
                match dir {
                    Dir::Read => Guard::Read(window),
                    Dir::Write => Guard::Write(window, Claim::Rewrite),
                }
            }
            // A buffered file is the one with an alignment of 1 (`Op::new`).
            (Mode::Direct { .. }, Dir::Write) if self.align == 1 => {
                let end = self.file_offset + self.len();
                Guard::Write(Window { file: self.file, start: self.file_offset, end }, Claim::Write)
            }
            (Mode::Direct { .. }, _) => Guard::None,
        }
    }

    /// Keeps `owned` (the op's window) until the op is done.
    pub(crate) fn own(&mut self, owned: Owned) {
        self.owned = Some(owned);
    }

    /// Takes a bounce buffer, if the op needs one, and prepares the first request.
    pub(crate) fn start(&mut self, pool: &mut BouncePool) {
        if let Mode::Bounce(b) = &mut self.mode {
            b.buf = Some(pool.take(b.span as usize, b.align as usize));
            if b.stage == Stage::Data(0) && self.dir == Dir::Write {
                b.fill(&self.host, self.file_offset);
            }
        }
    }

    /// Gives the bounce buffer back, and releases the op's blocks, once the op is done.
    pub(crate) fn finish(&mut self, pool: &mut BouncePool) {
        self.owned = None;
        if let Mode::Bounce(b) = &mut self.mode {
            if let Some(buf) = b.buf.take() {
                pool.give(buf);
            }
        }
    }

    /// The op's next request. Must not be called between issuing a request and completing it.
    pub(crate) fn request(&mut self) -> Request {
        let (fd, dir, len) = (self.fd, self.dir, self.len());
        match &mut self.mode {
            Mode::Direct { done } => {
                let remaining = u32::try_from(len - *done).expect("ops are at most 1 GiB");
                self.host.request(fd, dir, self.file_offset + *done, *done as usize, remaining)
            }
            Mode::Bounce(b) => {
                let tail_at = b.span - b.align;
                let (dir, at, end) = match b.stage {
                    Stage::Head(done) => (Dir::Read, done, b.align),
                    Stage::Tail(done) => (Dir::Read, tail_at + done, b.span),
                    Stage::Data(done) => (dir, done, b.span),
                };
                let buf = b.buf.as_mut().expect("a started bounce op holds its buffer");
                buf.request(fd, dir, b.start + at, at as usize..end as usize)
            }
        }
    }

    /// Takes the result of the last request: a byte count or a negated errno.
    pub(crate) fn complete(&mut self, result: i32) -> Step {
        if result < 0 {
            let errno = -result;
            if matches!(errno, libc::EINTR | libc::EAGAIN) && self.retries < MAX_RETRIES {
                self.retries += 1;
                return Step::Again;
            }
            return Step::Done(Err(FailureCause::Io { errno }));
        }
        let n = result as u64;
        let (dir, len, file_offset) = (self.dir, self.len(), self.file_offset);
        match &mut self.mode {
            Mode::Direct { done } => {
                if n == 0 {
                    return Step::Done(Err(match dir {
                        Dir::Read => short(file_offset, len, *done),
                        Dir::Write => FailureCause::Io { errno: libc::EIO },
                    }));
                }
                *done = (*done + n).min(len);
                if *done == len {
                    Step::Done(Ok(()))
                } else if dir == Dir::Read && (file_offset + *done) % self.align != 0 {
                    // An O_DIRECT read that stops off a block boundary met the end of the file;
                    // resubmitting the remainder would only fail with EINVAL.
                    Step::Done(Err(short(file_offset, len, *done)))
                } else {
                    Step::Again
                }
            }
            Mode::Bounce(b) => b.complete(n, dir, &self.host, file_offset, len),
        }
    }
}

/// The failure of a read of `len` bytes at `offset` that got only `got` before the file ended.
fn short(offset: u64, len: u64, got: u64) -> FailureCause {
    FailureCause::ShortFile { offset, expected: len, got }
}

impl Bounce {
    fn complete(&mut self, n: u64, dir: Dir, host: &HostSlice, file_offset: u64, len: u64) -> Step {
        match self.stage {
            Stage::Head(done) | Stage::Tail(done) => {
                let base =
                    if matches!(self.stage, Stage::Head(_)) { 0 } else { self.span - self.align };
                let done = (done + n).min(self.align);
                // A block read that comes up short met the end of the file: the rest reads as
                // zeros (writing it extends the file to the block boundary).
                let at_eof = n == 0 || (self.start + base + done) % self.align != 0;
                if done < self.align && !at_eof {
                    self.stage = match self.stage {
                        Stage::Head(_) => Stage::Head(done),
                        _ => Stage::Tail(done),
                    };
                    return Step::Again;
                }
                let buf = self.buf.as_mut().expect("a started bounce op holds its buffer");
                buf.bytes_mut()[(base + done) as usize..(base + self.align) as usize].fill(0);
                let tail_partial = file_offset + len != self.start + self.span;
                self.stage = if matches!(self.stage, Stage::Head(_))
                    && tail_partial
                    && self.span > self.align
                {
                    Stage::Tail(0)
                } else {
                    self.fill(host, file_offset);
                    Stage::Data(0)
                };
                Step::Again
            }
            Stage::Data(done) => {
                let done = (done + n).min(self.span);
                self.stage = Stage::Data(done);
                let got = (self.start + done).saturating_sub(file_offset).min(len);
                match dir {
                    Dir::Read if got == len => {
                        let buf = self.buf.as_ref().expect("a started bounce op holds its buffer");
                        let at = (file_offset - self.start) as usize;
                        host.write_at(0, &buf.bytes()[at..at + len as usize]);
                        Step::Done(Ok(()))
                    }
                    Dir::Read if n == 0 || (self.start + done) % self.align != 0 => {
                        Step::Done(Err(short(file_offset, len, got)))
                    }
                    Dir::Write if done == self.span => Step::Done(Ok(())),
                    Dir::Write if n == 0 => Step::Done(Err(FailureCause::Io { errno: libc::EIO })),
                    _ => Step::Again,
                }
            }
        }
    }

    /// Copies the caller's bytes into the window.
    fn fill(&mut self, host: &HostSlice, file_offset: u64) {
        let buf = self.buf.as_mut().expect("a started bounce op holds its buffer");
        let at = (file_offset - self.start) as usize;
        host.read_at(0, &mut buf.bytes_mut()[at..at + host.len()]);
    }
}

/// A worker's spare bounce buffers, reused across ops and batches.
#[derive(Debug, Default)]
pub(crate) struct BouncePool {
    spare: Vec<BounceBuf>,
}

impl BouncePool {
    /// Spare buffers kept for reuse; more are freed when given back.
    const KEEP: usize = 32;

    /// A buffer of at least `len` bytes aligned to at least `align`.
    pub(crate) fn take(&mut self, len: usize, align: usize) -> BounceBuf {
        let found = self.spare.iter().position(|b| b.capacity() >= len && b.align() >= align);
        match found {
            Some(i) => self.spare.swap_remove(i),
            None => BounceBuf::new(len.max(4096).next_power_of_two(), align.max(4096)),
        }
    }

    /// Returns a buffer for reuse.
    pub(crate) fn give(&mut self, buf: BounceBuf) {
        if self.spare.len() < Self::KEEP {
            self.spare.push(buf);
        }
    }
}
