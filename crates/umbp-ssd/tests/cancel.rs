//! Cancel and deadlines settle a batch wherever it is: running (its reads cancelled in the
//! kernel), or queued behind workers whose every lane is stuck (settled without a lane).
//!
//! Reads of a FIFO nobody writes are the stuck reads. The bound each test waits for a handle
//! to settle (5 s) is only the failure signal for "never settles": a correct engine settles
//! these handles within milliseconds.

mod support;

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::{HostBuf, POISON};
use umbp_plan::{
    CancelToken, EndpointId, FailureCause, FileOptions, FileSource, Fragment, PlanSet, Register,
    Registration, Tag, TransferEngine, TransferHandle,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

const PAGE: u64 = 64 << 10;

/// How long a test waits for a handle that must settle before calling it stuck.
const NEVER: Duration = Duration::from_secs(5);

/// A FIFO that stuck reads wait on. [`unstick`](Self::unstick) (also on drop, and before a
/// test gives up on a handle) writes enough bytes into it for every read that waits, so that
/// their batches complete and the handles and the engine can be dropped, whatever the test
/// asserted.
struct Fifo {
    path: PathBuf,
    unstick: usize,
    done: std::sync::atomic::AtomicBool,
}

impl Fifo {
    fn new(dir: &Path, name: &str, unstick: usize) -> Self {
        let path = dir.join(name);
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
        Self { path, unstick, done: Default::default() }
    }

    /// Writes the bytes the reads wait for, once.
    fn unstick(&self) {
        if self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // Non-blocking: the engine's descriptor is a reader, so the open succeeds, and the
        // pipe holds far more than the few pages the tests' reads wait for.
        let opened =
            std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&self.path);
        if let Ok(mut writer) = opened {
            let _ = writer.write_all(&vec![0x5A; self.unstick]);
        }
    }

    /// Registers the FIFO with `engine`: opened for reading and writing, which does not wait
    /// for a writer; a read of it waits until someone writes.
    fn register(&self, engine: &SsdEngine) -> Registration<std::fs::File> {
        let source = FileSource::open(&self.path, FileOptions::new().direct(false));
        engine.register_file(source, 0, 1 << 20).unwrap()
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        self.unstick();
    }
}

/// Unsticks a FIFO when dropped: declared after the handles of a test, so that a failing
/// assertion unsticks their batches before dropping a handle waits for its batch.
struct Unstick<'a>(&'a Fifo);

impl Drop for Unstick<'_> {
    fn drop(&mut self) {
        self.0.unstick();
    }
}

/// A plan set of one object per `(file, file offset, destination offset)`, 4 KiB each, tagged
/// 0, 1, ...
fn reads(
    engine: &SsdEngine,
    destination: EndpointId,
    objects: &[(EndpointId, u64, u64)],
) -> PlanSet {
    let mut builder = engine.builder();
    for (tag, &(file, at, to)) in objects.iter().enumerate() {
        let tag = Tag::new(tag as u32);
        builder.begin_object(tag).unwrap();
        builder.push(Fragment::new(file, at, destination, to, 4096, tag)).unwrap();
        builder.commit_object().unwrap();
    }
    builder.finish().unwrap()
}

/// Waits for `handle` to settle, for at most [`NEVER`]; its failures as (tag, cause). Gives
/// up (unsticking `fifo` first, so that dropping the handle does not wait forever) after
/// that.
fn settle(handle: TransferHandle, what: &str, fifo: Option<&Fifo>) -> Vec<(u32, FailureCause)> {
    let give_up = Instant::now() + NEVER;
    while !handle.is_done() {
        if Instant::now() >= give_up {
            fifo.map(Fifo::unstick);
            panic!("{what}: not settled after {NEVER:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut failed: Vec<(u32, FailureCause)> = handle
        .into_settled()
        .failures
        .into_iter()
        .flat_map(|f| f.tags.iter().map(|t| (t.get(), f.cause.clone())).collect::<Vec<_>>())
        .collect();
    failed.sort_by_key(|(tag, _)| *tag);
    failed
}

/// A regular file of `PAGE` pattern bytes registered with `engine`.
fn regular(engine: &SsdEngine, dir: &Path, name: &str) -> (Registration<std::fs::File>, Vec<u8>) {
    let path = dir.join(name);
    let bytes = support::pattern(7, PAGE as usize);
    support::write_file(&path, &bytes);
    let source = FileSource::open(&path, FileOptions::new().direct(false));
    (engine.register_file(source, 0, PAGE).unwrap(), bytes)
}

fn io_uring_or_skip(test: &str) -> bool {
    support::backends(test).contains(&Backend::IoUring)
}

/// A batch with a read that never completes (a FIFO) and a read of a regular file, no
/// deadline: cancelling the token settles the batch promptly, the stuck object `Cancelled`
/// (cancelled in the kernel, or never issued if the cancel came first) and nothing in its
/// destination; the other object either completed, byte-exact, or was cancelled untouched.
#[test]
fn cancelling_a_batch_stuck_in_the_kernel_settles_it_cancelled() {
    let test = "cancelling_a_batch_stuck_in_the_kernel_settles_it_cancelled";
    if !io_uring_or_skip(test) {
        return;
    }
    let dir = support::temp_dir();
    let registry = umbp_plan::EndpointRegistry::new();
    let engine = support::engine_with(
        &registry,
        SsdConfig { backend: Backend::IoUring, ..SsdConfig::default() },
    );
    let fifo = Fifo::new(dir.path(), "stuck.fifo", 4096);
    let stuck = fifo.register(&engine);
    let (fine, fine_bytes) = regular(&engine, dir.path(), "fine.bin");
    let destination = HostBuf::new(&registry, (2 * PAGE) as usize, 0, POISON);

    let token = CancelToken::new();
    let mut plans = reads(&engine, destination.id, &[(stuck.id(), 0, 0), (fine.id(), 0, PAGE)]);
    plans.set_cancel(Some(token.clone()));
    let handle = engine.submit(plans);
    let _unstick = Unstick(&fifo);
    // Time for the reads to reach the kernel (the outcome is the same if they have not).
    std::thread::sleep(Duration::from_millis(50));
    assert!(!handle.is_done(), "the FIFO read completed with nothing written");
    token.cancel();
    let failed = settle(handle, "the cancelled batch", Some(&fifo));
    assert_eq!(failed.first(), Some(&(0, FailureCause::Cancelled)), "{failed:?}");
    assert!(destination.bytes()[..4096].iter().all(|&b| b == POISON), "the FIFO gave nothing");
    let other = &destination.bytes()[PAGE as usize..][..4096];
    match failed.get(1) {
        None => assert!(other == &fine_bytes[..4096], "completed, with the wrong bytes"),
        Some(f) => {
            assert_eq!(*f, (1, FailureCause::Cancelled));
            assert!(other.iter().all(|&b| b == POISON), "cancelled, yet written");
        }
    }
}

/// Two workers of four lanes each, every lane held by a read that never completes: a batch
/// submitted behind them with a 300 ms deadline settles `TimedOut`, and one with a cancel
/// token settles `Cancelled` once cancelled, neither waiting for a lane, neither issuing a
/// byte. Once the FIFO is written, the stuck batches complete.
#[test]
fn batches_queued_behind_stuck_lanes_settle_at_their_deadline_or_cancel() {
    let test = "batches_queued_behind_stuck_lanes_settle_at_their_deadline_or_cancel";
    if !io_uring_or_skip(test) {
        return;
    }
    const STUCK: u64 = 8; // 2 workers x 4 lanes
    let dir = support::temp_dir();
    let registry = umbp_plan::EndpointRegistry::new();
    let config = SsdConfig { backend: Backend::IoUring, workers: 2, ..SsdConfig::default() };
    let engine = support::engine_with(&registry, config);
    let fifo = Fifo::new(dir.path(), "lanes.fifo", (STUCK * 4096) as usize);
    let stuck = fifo.register(&engine);
    let (fine, _) = regular(&engine, dir.path(), "fine.bin");
    let destination = HostBuf::new(&registry, ((STUCK + 2) * PAGE) as usize, 0, POISON);

    // One stuck read per batch, each into its own page of the destination.
    let stuck_handles: Vec<TransferHandle> = (0..STUCK)
        .map(|i| engine.submit(reads(&engine, destination.id, &[(stuck.id(), 0, i * PAGE)])))
        .collect();
    // Queued behind them (a lane takes batches in order): a deadline, and a cancel token.
    let mut late = reads(&engine, destination.id, &[(fine.id(), 0, STUCK * PAGE)]);
    let start = Instant::now();
    late.set_deadline(Some(start + Duration::from_millis(300)));
    let late = engine.submit(late);
    let token = CancelToken::new();
    let mut cancelled = reads(&engine, destination.id, &[(fine.id(), 0, (STUCK + 1) * PAGE)]);
    cancelled.set_cancel(Some(token.clone()));
    let cancelled = engine.submit(cancelled);
    let _unstick = Unstick(&fifo);

    assert_eq!(
        settle(late, "the batch with a deadline", Some(&fifo)),
        [(0, FailureCause::TimedOut)]
    );
    assert!(start.elapsed() >= Duration::from_millis(300), "settled before its deadline");
    assert!(!cancelled.is_done(), "settled before it was cancelled");
    token.cancel();
    assert_eq!(
        settle(cancelled, "the cancelled batch", Some(&fifo)),
        [(0, FailureCause::Cancelled)]
    );
    let late_pages = &destination.bytes()[(STUCK * PAGE) as usize..];
    assert!(late_pages.iter().all(|&b| b == POISON), "a queued batch moved bytes");

    assert!(stuck_handles.iter().all(|h| !h.is_done()), "a FIFO read completed unwritten");
    fifo.unstick();
    for (i, handle) in stuck_handles.into_iter().enumerate() {
        assert_eq!(settle(handle, "a stuck batch, unstuck", None), [], "stuck batch {i}");
    }
}

/// A plan set whose token was cancelled before submit settles at once with every object
/// `Cancelled`, and moves nothing: no read lands, no write reaches the file.
#[test]
fn a_batch_cancelled_before_submit_moves_nothing() {
    let test = "a_batch_cancelled_before_submit_moves_nothing";
    let dir = support::temp_dir();
    for backend in support::backends(test) {
        let registry = umbp_plan::EndpointRegistry::new();
        let engine = support::engine(&registry, backend);
        let (file, file_bytes) = regular(&engine, dir.path(), &format!("{backend:?}.bin"));
        let destination = HostBuf::new(&registry, PAGE as usize, 0, POISON);
        let token = CancelToken::new();
        token.cancel();

        let mut plans =
            reads(&engine, destination.id, &[(file.id(), 0, 0), (file.id(), 8192, 8192)]);
        plans.set_cancel(Some(token.clone()));
        let failed = settle(engine.submit(plans), "a read cancelled before submit", None);
        assert_eq!(failed, [(0, FailureCause::Cancelled), (1, FailureCause::Cancelled)]);
        assert!(destination.bytes().iter().all(|&b| b == POISON), "{backend:?}: a read landed");

        let mut builder = engine.builder();
        builder.begin_object(Tag::new(0)).unwrap();
        builder.push(Fragment::new(destination.id, 0, file.id(), 0, 4096, Tag::new(0))).unwrap();
        builder.commit_object().unwrap();
        let mut plans = builder.finish().unwrap();
        drop(builder);
        plans.set_cancel(Some(token));
        let failed = settle(engine.submit(plans), "a write cancelled before submit", None);
        assert_eq!(failed, [(0, FailureCause::Cancelled)]);
        let path = dir.path().join(format!("{backend:?}.bin"));
        assert!(std::fs::read(path).unwrap() == file_bytes, "{backend:?}: a write landed");
    }
}
