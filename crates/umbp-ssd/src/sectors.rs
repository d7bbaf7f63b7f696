//! Sector ownership, process-wide: what orders the read-modify-writes of partial `O_DIRECT`
//! blocks against every other write of those blocks, across batches, engines and
//! registrations.
//!
//! A piece of an `O_DIRECT` file that is not block-aligned is written through a bounce buffer:
//! the op reads the partial head and tail blocks, copies the caller's bytes in and writes the
//! whole blocks back. Another write of other bytes of those blocks that lands between that
//! read and that write is undone by it: both report success and one object's bytes are gone.
//! That other write may be a second rewrite, or a plain write through a buffered registration
//! of the same file (through the page cache, which the `O_DIRECT` write then replaces), from
//! the same engine or from another engine of the process. [`Sectors`], one table for the whole
//! process ([`Sectors::process`]) shared by every engine, worker, ring lane and fallback
//! executor, orders them:
//!
//! - **Rewrites own their blocks.** Before its first read, every write through a bounce buffer
//!   claims its whole window of blocks (`start .. end`, block-aligned) of its file
//!   ([`Claim::Rewrite`]), all at once or not at all, so two ops never wait for each other
//!   while holding part of what the other wants: no deadlock. It keeps the window until its
//!   write has landed or it ended otherwise (failure, deadline, cancel, a panicking batch): the
//!   claim is an [`Owned`] guard the op drops when it is done, or that drops with the op. An op
//!   that cannot claim its window stays queued in its batch and registers its executor's
//!   [`Waker`]; every release wakes the executors that wait, which then look at their waiting
//!   ops again.
//! - **Buffered writes hold their bytes.** Every write through a buffered registration, partial
//!   block or whole, claims exactly the bytes it writes ([`Claim::Write`]) for as long as it
//!   runs. Such claims exclude rewrites of the blocks they touch, not each other: the page cache
//!   orders writes of different bytes of a page itself.
//! - **Files by identity.** Windows are keyed by the file's device and inode ([`FileKey`],
//!   taken when an engine first inspects the descriptor), so any registrations (descriptors,
//!   `O_DIRECT` or not) of one file in any engines of the process are ordered like one. Two
//!   nodes of one block device are one device; a partition and its whole disk are not
//!   recognised as overlapping.
//! - **Bounce reads wait for rewrites.** A read through a bounce buffer whose window meets a
//!   rewritten one waits the same way, so it sees the blocks before or after the rewrite. A
//!   read already running when a rewrite starts sees each block before or after it, as the
//!   device writes a block whole.
//! - **Free when unused.** Aligned `O_DIRECT` reads and writes, and buffered reads, never look
//!   at the table. A bounce read reads one atomic count of rewrites first and takes the lock
//!   only when some window is being rewritten.
//!
//! What remains the caller's race: two batches writing the *same* bytes at once (either may
//! land last), and a block-aligned `O_DIRECT` write (straight from the caller's memory, never
//! looking at the table) of blocks that another batch rewrites partially at the same time.
//! Such a write covers the whole block, so it writes some of the same bytes as the rewrite;
//! the block may end as the rewrite read it, with only the rewrite's bytes new. Other
//! processes are not ordered (an exclusive registration keeps them off a tier file).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

use crate::wake::Waker;

/// A file as the kernel knows it, whichever descriptor names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FileKey {
    /// The device the file lives on (the device itself for a block device).
    pub(crate) dev: u64,
    /// The inode (`u64::MAX` for a block device).
    pub(crate) ino: u64,
}

/// Bytes `start .. end` of one file: whole blocks for a bounce op, the very bytes for a
/// buffered write.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) file: FileKey,
    pub(crate) start: u64,
    pub(crate) end: u64,
}

impl Window {
    fn meets(&self, other: &Self) -> bool {
        self.file == other.file && self.start < other.end && other.start < self.end
    }
}

/// How a write holds its window.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A read-modify-write through a bounce buffer: no other claim may meet the window.
    Rewrite,
    /// A buffered write: no rewrite may meet the window; other buffered writes may.
    Write,
}

/// The windows owned in the process, and the executors waiting for one to be released.
#[derive(Debug, Default)]
pub(crate) struct Sectors {
    /// Windows being rewritten now, read without the lock by [`readable`](Self::readable).
    rewrites: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The windows owned: one entry per write holding one. Rewritten windows meet no other.
    windows: Vec<(Window, Claim)>,
    /// Executors with an op that found its window taken: woken at the next release.
    waiting: Vec<Waker>,
}

/// The process's table.
static PROCESS: LazyLock<Arc<Sectors>> = LazyLock::new(Arc::default);

impl Sectors {
    /// The table every engine of the process shares.
    pub(crate) fn process() -> Arc<Self> {
        Arc::clone(&PROCESS)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Each critical section leaves the state whole (a push, a removal, a take): a
        // poisoned lock still guards a consistent table.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `window` as `claim` says; `None` if a claim it excludes meets it, after
    /// registering `waker` to be woken when a window is released.
    pub(crate) fn claim(
        self: &Arc<Self>,
        window: Window,
        claim: Claim,
        waker: &Waker,
    ) -> Option<Owned> {
        let mut state = self.lock();
        let excludes = |held: Claim| claim == Claim::Rewrite || held == Claim::Rewrite;
        if state.windows.iter().any(|&(w, held)| excludes(held) && w.meets(&window)) {
            state.wait(waker);
            return None;
        }
        state.windows.push((window, claim));
        if claim == Claim::Rewrite {
            self.rewrites.fetch_add(1, Ordering::AcqRel);
        }
        Some(Owned { sectors: Arc::clone(self), window, claim })
    }

    /// Whether a bounce read of `window` may start now: no part of it is being rewritten. If
    /// some is, `waker` is woken when a window is released.
    pub(crate) fn readable(&self, window: Window, waker: &Waker) -> bool {
        if self.rewrites.load(Ordering::Acquire) == 0 {
            return true;
        }
        let mut state = self.lock();
        if state.windows.iter().any(|&(w, held)| held == Claim::Rewrite && w.meets(&window)) {
            state.wait(waker);
            return false;
        }
        true
    }

    /// Windows owned now.
    #[cfg(test)]
    pub(crate) fn owned(&self) -> usize {
        self.lock().windows.len()
    }

    fn release(&self, window: Window, claim: Claim) {
        let waiting = {
            let mut state = self.lock();
            if let Some(at) = state.windows.iter().position(|&held| held == (window, claim)) {
                state.windows.swap_remove(at);
                if claim == Claim::Rewrite {
                    self.rewrites.fetch_sub(1, Ordering::AcqRel);
                }
            }
            std::mem::take(&mut state.waiting)
        };
        for waker in &waiting {
            waker.wake();
        }
    }
}

impl State {
    fn wait(&mut self, waker: &Waker) {
        if !self.waiting.iter().any(|w| w.same(waker)) {
            self.waiting.push(waker.clone());
        }
    }
}

/// A window owned by one write; dropping it releases the window and wakes the executors
/// waiting for one.
#[derive(Debug)]
pub(crate) struct Owned {
    sectors: Arc<Sectors>,
    window: Window,
    claim: Claim,
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.sectors.release(self.window, self.claim);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{Claim, FileKey, Sectors, Window};
    use crate::wake::Waker;

    fn window(ino: u64, start: u64, end: u64) -> Window {
        Window { file: FileKey { dev: 1, ino }, start, end }
    }

    #[test]
    fn windows_that_share_a_block_of_one_file_exclude_each_other_until_released() {
        let sectors = Arc::new(Sectors::default());
        let waker = Waker::current_thread();
        let a = sectors.claim(window(1, 0, 1024), Claim::Rewrite, &waker).expect("a free window");
        assert!(
            sectors.claim(window(1, 512, 1536), Claim::Rewrite, &waker).is_none(),
            "shares 512..1024"
        );
        assert!(!sectors.readable(window(1, 512, 1024), &waker));
        let b = sectors
            .claim(window(1, 1024, 2048), Claim::Rewrite, &waker)
            .expect("adjacent, not shared");
        let c = sectors.claim(window(2, 0, 1024), Claim::Rewrite, &waker).expect("another file");
        assert!(sectors.readable(window(1, 2048, 4096), &waker));
        assert_eq!(sectors.owned(), 3);
        drop(a);
        assert!(sectors.readable(window(1, 512, 1024), &waker));
        drop((b, c));
        assert_eq!(sectors.owned(), 0);
        assert!(sectors.lock().windows.is_empty() && sectors.lock().waiting.is_empty());
    }

    #[test]
    fn a_release_wakes_every_executor_that_waited_once() {
        let sectors = Arc::new(Sectors::default());
        let held =
            sectors.claim(window(1, 0, 512), Claim::Rewrite, &Waker::current_thread()).unwrap();
        let waiter = std::thread::spawn({
            let sectors = Arc::clone(&sectors);
            move || {
                let waker = Waker::current_thread();
                // Registers twice (as two blocked ops of one executor would): one entry.
                while sectors.claim(window(1, 0, 512), Claim::Rewrite, &waker).is_none() {
                    assert!(sectors.lock().waiting.len() <= 1);
                    std::thread::park();
                }
            }
        });
        while sectors.lock().waiting.is_empty() {
            std::thread::yield_now();
        }
        drop(held);
        waiter.join().unwrap();
        assert_eq!(sectors.owned(), 0);
    }

    #[test]
    fn buffered_writes_exclude_rewrites_of_their_bytes_but_not_each_other() {
        let sectors = Arc::new(Sectors::default());
        let waker = Waker::current_thread();
        // Two buffered writes of bytes of one block: both run at once.
        let a = sectors.claim(window(1, 3, 63), Claim::Write, &waker).expect("free");
        let b = sectors.claim(window(1, 63, 123), Claim::Write, &waker).expect("writes share");
        // A rewrite of the block they touch waits for both; of another block, it does not.
        assert!(sectors.claim(window(1, 0, 512), Claim::Rewrite, &waker).is_none());
        let c = sectors.claim(window(1, 512, 1024), Claim::Rewrite, &waker).expect("apart");
        // A buffered write into a rewritten block waits; bounce reads ignore buffered writes.
        assert!(sectors.claim(window(1, 600, 700), Claim::Write, &waker).is_none());
        assert!(sectors.readable(window(1, 0, 512), &waker));
        assert!(!sectors.readable(window(1, 512, 1024), &waker));
        drop(a);
        assert!(sectors.claim(window(1, 0, 512), Claim::Rewrite, &waker).is_none(), "b holds");
        drop(b);
        let d = sectors.claim(window(1, 0, 512), Claim::Rewrite, &waker).expect("released");
        assert_eq!(sectors.owned(), 2);
        drop((c, d));
        assert_eq!(sectors.owned(), 0);
        assert!(sectors.readable(window(1, 0, 1024), &waker));
    }

    #[test]
    fn every_engine_of_the_process_shares_one_table() {
        assert!(Arc::ptr_eq(&Sectors::process(), &Sectors::process()));
    }
}
