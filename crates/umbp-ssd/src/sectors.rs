//! Sector ownership, engine-wide: what orders the read-modify-writes of partial `O_DIRECT`
//! blocks across batches.
//!
//! A piece of an `O_DIRECT` file that is not block-aligned is written through a bounce buffer:
//! the op reads the partial head and tail blocks, copies the caller's bytes in and writes the
//! whole blocks back. Two such ops on one block, running at once, each write back the block as
//! they read it, so the later write puts back the earlier one's bytes as they were: both
//! report success and one object's bytes are gone. [`Sectors`], one per engine and shared by
//! every worker, ring lane and fallback executor of it, orders them:
//!
//! - **Bounce writes own their blocks.** Before its first read, every write through a bounce
//!   buffer claims its whole window of blocks (`start .. end`, block-aligned) of its file, all
//!   at once or not at all, so two ops never wait for each other while holding part of what
//!   the other wants: no deadlock. It keeps the window until its write has landed or it ended
//!   otherwise (failure, deadline, cancel, a panicking batch): the claim is an [`Owned`]
//!   guard the op drops when it is done, or that drops with the op. An op that cannot claim
//!   its window stays queued in its batch and registers its executor's [`Waker`]; every
//!   release wakes the executors that wait, which then look at their waiting ops again.
//! - **Files by identity.** Windows are keyed by the file's device and inode ([`FileKey`],
//!   taken when the engine first inspects the descriptor), so two registrations (two
//!   descriptors) of one file are ordered like one. Two nodes of one block device are one
//!   device; a partition and its whole disk are not recognised as overlapping.
//! - **Bounce reads wait for owned blocks.** A read through a bounce buffer whose window meets
//!   an owned one waits the same way, so it sees the blocks before or after the rewrite. A
//!   read already running when a rewrite starts sees each block before or after it, as the
//!   device writes a block whole.
//! - **Free when unused.** Aligned reads and writes never look at the table. A bounce read
//!   reads one atomic count of owned windows first and takes the lock only when some window is
//!   owned.
//!
//! What remains the caller's race: two batches writing the *same* bytes at once (either may
//! land last), and a block-aligned write (straight from the caller's memory, never looking at
//! the table) of blocks that another batch rewrites partially at the same time. Such a
//! write covers the whole block, so it writes some of the same bytes as the rewrite; the block
//! may end as the rewrite read it, with only the rewrite's bytes new.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::wake::Waker;

/// A file as the kernel knows it, whichever descriptor names it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct FileKey {
    /// The device the file lives on (the device itself for a block device).
    pub(crate) dev: u64,
    /// The inode (`u64::MAX` for a block device).
    pub(crate) ino: u64,
}

/// Whole blocks `start .. end` (bytes, block-aligned) of one file.
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

/// The windows owned in one engine, and the executors waiting for one to be released.
#[derive(Debug, Default)]
pub(crate) struct Sectors {
    /// Windows owned now, read without the lock by [`readable`](Self::readable).
    owned: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The windows owned; at most one entry per bounce write running in the engine, each
    /// disjoint from the others.
    windows: Vec<Window>,
    /// Executors with an op that found its window taken: woken at the next release.
    waiting: Vec<Waker>,
}

impl Sectors {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Each critical section leaves the state whole (a push, a removal, a take): a
        // poisoned lock still guards a consistent table.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Claims `window` whole for a bounce write; `None` if some of it is owned, after
    /// registering `waker` to be woken when a window is released.
    pub(crate) fn claim(self: &Arc<Self>, window: Window, waker: &Waker) -> Option<Owned> {
        let mut state = self.lock();
        if state.windows.iter().any(|w| w.meets(&window)) {
            state.wait(waker);
            return None;
        }
        state.windows.push(window);
        self.owned.fetch_add(1, Ordering::AcqRel);
        Some(Owned { sectors: Arc::clone(self), window })
    }

    /// Whether a bounce read of `window` may start now: no part of it is owned. If some is,
    /// `waker` is woken when a window is released.
    pub(crate) fn readable(&self, window: Window, waker: &Waker) -> bool {
        if self.owned.load(Ordering::Acquire) == 0 {
            return true;
        }
        let mut state = self.lock();
        if state.windows.iter().any(|w| w.meets(&window)) {
            state.wait(waker);
            return false;
        }
        true
    }

    /// Windows owned now.
    #[cfg(test)]
    pub(crate) fn owned(&self) -> usize {
        self.owned.load(Ordering::Acquire)
    }

    fn release(&self, window: Window) {
        let waiting = {
            let mut state = self.lock();
            if let Some(at) = state.windows.iter().position(|w| *w == window) {
                state.windows.swap_remove(at);
                self.owned.fetch_sub(1, Ordering::AcqRel);
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

/// A window owned by one bounce write; dropping it releases the window and wakes the
/// executors waiting for one.
#[derive(Debug)]
pub(crate) struct Owned {
    sectors: Arc<Sectors>,
    window: Window,
}

impl Drop for Owned {
    fn drop(&mut self) {
        self.sectors.release(self.window);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{FileKey, Sectors, Window};
    use crate::wake::Waker;

    fn window(ino: u64, start: u64, end: u64) -> Window {
        Window { file: FileKey { dev: 1, ino }, start, end }
    }

    #[test]
    fn windows_that_share_a_block_of_one_file_exclude_each_other_until_released() {
        let sectors = Arc::new(Sectors::default());
        let waker = Waker::current_thread();
        let a = sectors.claim(window(1, 0, 1024), &waker).expect("a free window");
        assert!(sectors.claim(window(1, 512, 1536), &waker).is_none(), "shares 512..1024");
        assert!(!sectors.readable(window(1, 512, 1024), &waker));
        let b = sectors.claim(window(1, 1024, 2048), &waker).expect("adjacent, not shared");
        let c = sectors.claim(window(2, 0, 1024), &waker).expect("another file");
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
        let held = sectors.claim(window(1, 0, 512), &Waker::current_thread()).unwrap();
        let waiter = std::thread::spawn({
            let sectors = Arc::clone(&sectors);
            move || {
                let waker = Waker::current_thread();
                // Registers twice (as two blocked ops of one executor would): one entry.
                while sectors.claim(window(1, 0, 512), &waker).is_none() {
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
}
