//! Writes of different bytes of one `O_DIRECT` block from many batches at once: each is a
//! read-modify-write of the block, and every one that reports success must be in the file,
//! whatever worker, ring lane or descriptor (registration) of the file it went through. Reads
//! of the block racing those rewrites see each piece as it was before or after, never
//! anything else.

mod support;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, Mutex};

use support::{HostBuf, POISON};
use umbp_plan::{
    EndpointId, EndpointRegistry, FileOptions, FileSource, Fragment, Register, Registration, Tag,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

const THREADS: usize = 16;
/// Rounds of the write test; at about 1 ms a round on this project's virtual disk, a few
/// seconds per backend.
const ROUNDS: u64 = 2_000;
/// The file: four blocks of 4 KiB (whatever the logical block size, 512 here).
const FILE_LEN: u64 = 16 << 10;

/// Where thread `t` writes in round `round`, and how many bytes: even rounds put all sixteen
/// 30-byte pieces inside the first 512 bytes (one sector, whatever the block size); odd rounds
/// write 60-byte pieces 64 bytes apart from 13 bytes before a 4 KiB boundary on, so that they
/// straddle 512-byte and 4 KiB block boundaries, and pieces share blocks on both sides.
fn piece(t: usize, round: u64) -> (u64, u64) {
    if round % 2 == 0 {
        (1 + 32 * t as u64, 30)
    } else {
        (4096 - 8 * 64 - 13 + 64 * t as u64, 60)
    }
}

/// The bytes thread `t` writes in round `round`: every piece of every round differs.
fn bytes(t: usize, round: u64, len: u64) -> Vec<u8> {
    support::pattern(1 + round * THREADS as u64 + t as u64, len as usize)
}

/// One engine of four workers and an `O_DIRECT` file registered twice with it (two
/// descriptors of one file); `None` (after saying why) where the filesystem refuses
/// `O_DIRECT`.
struct SharedFile {
    // Declared before the engine, so that they end first.
    _registrations: [Registration<std::fs::File>; 2],
    files: [EndpointId; 2],
    path: PathBuf,
    registry: Arc<EndpointRegistry>,
    engine: SsdEngine,
    /// The first thing that went wrong; every thread stops at the end of that round.
    failure: Mutex<Option<String>>,
}

impl SharedFile {
    fn open(backend: Backend, dir: &Path, name: &str) -> Option<Self> {
        let registry = EndpointRegistry::new();
        let config = SsdConfig { backend, workers: 4, ..SsdConfig::default() };
        let engine = support::engine_with(&registry, config);
        let path = dir.join(format!("{name}_{backend:?}.bin"));
        support::write_file(&path, &vec![0; FILE_LEN as usize]);
        let open = || {
            let source = FileSource::open(&path, FileOptions::new().direct(true));
            engine.register_file(source, 0, FILE_LEN).unwrap()
        };
        let registrations = [open(), open()];
        let files = [registrations[0].id(), registrations[1].id()];
        for id in files {
            let info = engine.file_info(id).expect("registered");
            if !info.direct {
                eprintln!("SKIP {name}: the file was opened without O_DIRECT");
                return None;
            }
        }
        assert_ne!(engine.file_info(files[0]).unwrap().fd, engine.file_info(files[1]).unwrap().fd);
        let failure = Mutex::new(None);
        Some(Self { _registrations: registrations, files, path, registry, engine, failure })
    }

    /// Writes `data` at `at` through registration `which`, as one object of its own batch;
    /// whether it completed.
    fn write(&self, source: &HostBuf, which: usize, at: u64, len: u64) -> bool {
        let tag = Tag::new(0);
        let f = Fragment::new(source.id, 0, self.files[which], at, len, tag);
        support::transfer(&self.engine, &[vec![f]]).failed_tags().is_empty()
    }

    /// Reads `len` bytes at `at` through registration `which` into `destination` (poisoned
    /// first); whether it completed.
    fn read(&self, destination: &mut HostBuf, which: usize, at: u64, len: u64) -> bool {
        destination.bytes_mut().fill(POISON);
        let f = Fragment::new(self.files[which], at, destination.id, 0, len, Tag::new(0));
        support::transfer(&self.engine, &[vec![f]]).failed_tags().is_empty()
    }

    /// The file as it is now, read around the engine (buffered: the kernel drops cached pages
    /// that an `O_DIRECT` write replaces).
    fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.path).expect("read the file back")
    }

    /// Records the first failure (a panic would leave the other threads at the barrier).
    fn fail(&self, message: String) {
        self.failure.lock().unwrap().get_or_insert(message);
    }

    /// Whether something failed: the threads stop, together, at the end of a round.
    fn failed(&self) -> bool {
        self.failure.lock().unwrap().is_some()
    }

    /// Panics with the first failure, if any.
    fn check(self) {
        if let Some(message) = self.failure.into_inner().unwrap() {
            panic!("{message}");
        }
    }
}

/// Sixteen threads, released together each round, each write their own piece of one shared
/// block through one engine (four workers; half the threads through one registration of the
/// file, half through another): after every round, every piece whose write completed is in
/// the file, byte for byte.
fn disjoint_pieces_of_one_block(backend: Backend, dir: &Path) {
    let Some(shared) = SharedFile::open(backend, dir, "disjoint_pieces") else { return };
    let barrier = Barrier::new(THREADS);
    let completed: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());
    let started = std::time::Instant::now();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (shared, barrier, completed) = (&shared, &barrier, &completed);
            scope.spawn(move || {
                let mut source = HostBuf::new(&shared.registry, 64, 0, 0);
                for round in 0..ROUNDS {
                    let (at, len) = piece(t, round);
                    source.bytes_mut()[..len as usize].copy_from_slice(&bytes(t, round, len));
                    barrier.wait();
                    let done = shared.write(&source, t % 2, at, len);
                    completed.lock().unwrap().push((t, done));
                    if barrier.wait().is_leader() {
                        let file = shared.contents();
                        let mut outcomes = std::mem::take(&mut *completed.lock().unwrap());
                        outcomes.sort_unstable();
                        let lost: Vec<usize> = outcomes
                            .iter()
                            .filter(|&&(t, done)| {
                                let (at, len) = piece(t, round);
                                let range = at as usize..(at + len) as usize;
                                done && file[range] != bytes(t, round, len)[..]
                            })
                            .map(|&(t, _)| t)
                            .collect();
                        if !lost.is_empty() || !outcomes.iter().all(|&(_, done)| done) {
                            shared.fail(format!(
                                "{backend:?} round {round}: the completed writes of threads \
                                 {lost:?} are not in the file (thread, completed: {outcomes:?})"
                            ));
                        }
                    }
                    barrier.wait();
                    if shared.failed() {
                        break;
                    }
                }
            });
        }
    });
    if !shared.failed() {
        eprintln!("{backend:?}: {ROUNDS} rounds of {THREADS} writes in {:?}", started.elapsed());
    }
    shared.check();
}

#[test]
fn sixteen_batches_writing_disjoint_pieces_of_one_block_all_land() {
    let name = "sixteen_batches_writing_disjoint_pieces_of_one_block_all_land";
    let Some(dir) = support::direct_dir(name) else { return };
    for backend in support::backends(name) {
        disjoint_pieces_of_one_block(backend, dir.path());
    }
}

/// Rounds of the read test.
const READ_ROUNDS: u64 = 500;

/// Eight writers rewrite their piece of one 512-byte sector each round (one read-modify-write
/// each) while eight readers read the sector through the engine (unaligned, through a bounce
/// buffer, and aligned, straight into their memory), through either registration: every read
/// shows each piece whole, as it was before the round or as the round wrote it, and after the
/// round every piece is the new one.
fn reads_racing_rewrites(backend: Backend, dir: &Path) {
    const WRITERS: usize = 8;
    let Some(shared) = SharedFile::open(backend, dir, "reads_racing") else { return };
    // Piece `t` of version `v` (version 0: the zeros the file starts with).
    let slot = |t: usize| (3 + 60 * t as u64, 60u64);
    let version = |t: usize, v: u64| {
        if v == 0 {
            vec![0; 60]
        } else {
            bytes(t, v, 60)
        }
    };
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (shared, barrier) = (&shared, &barrier);
            scope.spawn(move || {
                let mut buf = HostBuf::new(&shared.registry, 512, 0, 0);
                for round in 1..=READ_ROUNDS {
                    if t < WRITERS {
                        let (at, len) = slot(t);
                        buf.bytes_mut()[..60].copy_from_slice(&version(t, round));
                        barrier.wait();
                        if !shared.write(&buf, t % 2, at, len) {
                            shared.fail(format!("{backend:?} round {round}: a write failed"));
                        }
                    } else {
                        barrier.wait();
                        // Unaligned reads (bytes 1..511) go through a bounce buffer; every
                        // fourth read is the aligned sector, straight into memory.
                        let (at, len) = if round % 4 == 0 { (0, 512) } else { (1, 510) };
                        for _ in 0..4 {
                            if !shared.read(&mut buf, t % 2, at, len) {
                                shared.fail(format!("{backend:?} round {round}: a read failed"));
                            }
                            let got = &buf.bytes()[..len as usize];
                            for w in 0..WRITERS {
                                let (p, n) = slot(w);
                                let seen = &got[(p - at) as usize..(p - at + n) as usize];
                                if seen != version(w, round - 1) && seen != version(w, round) {
                                    shared.fail(format!(
                                        "{backend:?} round {round}: a read saw piece {w} neither \
                                         before nor after the round: {seen:?}"
                                    ));
                                }
                            }
                        }
                    }
                    if barrier.wait().is_leader() {
                        let file = shared.contents();
                        for w in 0..WRITERS {
                            let (p, n) = slot(w);
                            if file[p as usize..(p + n) as usize] != version(w, round)[..] {
                                shared.fail(format!("{backend:?} round {round}: piece {w} lost"));
                            }
                        }
                    }
                    barrier.wait();
                    if shared.failed() {
                        break;
                    }
                }
            });
        }
    });
    shared.check();
}

#[test]
fn reads_racing_rewrites_of_their_block_see_each_piece_before_or_after() {
    let name = "reads_racing_rewrites_of_their_block_see_each_piece_before_or_after";
    let Some(dir) = support::direct_dir(name) else { return };
    for backend in support::backends(name) {
        reads_racing_rewrites(backend, dir.path());
    }
}
