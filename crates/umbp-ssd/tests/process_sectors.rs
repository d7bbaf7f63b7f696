//! Sector ownership is the process's, not an engine's or a registration's: writes of different
//! bytes of one sector all land whatever mix of registrations (`O_DIRECT` and buffered) and
//! engines they go through. Eight threads, released together each round, each write their own
//! 60-byte piece of one 512-byte sector, each piece its own batch; after every round every
//! piece whose write completed must be in the file. The lost pieces are counted over all
//! rounds (not only the first round that loses one), so a failure says how many.

mod support;

use std::path::Path;
use std::sync::{Arc, Barrier, Mutex};

use support::HostBuf;
use umbp_plan::{
    EndpointId, EndpointRegistry, FileOptions, FileSource, Fragment, Register, Registration, Tag,
};
use umbp_ssd::{Backend, SsdConfig, SsdEngine};

const WRITERS: usize = 8;
const ROUNDS: u64 = 300;
const FILE_LEN: u64 = 16 << 10;

/// Writer `t`'s piece: 60 bytes from byte `3 + 60 t`, all inside the first 512-byte sector.
fn piece(t: usize) -> (u64, u64) {
    (3 + 60 * t as u64, 60)
}

/// The bytes writer `t` writes in round `round`: every piece of every round differs.
fn bytes(t: usize, round: u64) -> Vec<u8> {
    support::pattern(7 + round * WRITERS as u64 + t as u64, 60)
}

/// The two ways into the file a test mixes.
#[derive(Copy, Clone, Debug)]
enum Mix {
    /// One engine; the file registered once with `O_DIRECT` and once buffered.
    DirectAndBuffered,
    /// Two engines, each with its own `O_DIRECT` registration of the file.
    TwoEngines,
}

/// The engines and the two registrations of one file; writer `t` goes through `ways[t % 2]`.
struct Setup {
    // Declared before the engines, so that they end first.
    _registrations: Vec<Registration<std::fs::File>>,
    /// (engine index, file endpoint) of each way in.
    ways: [(usize, EndpointId); 2],
    registry: Arc<EndpointRegistry>,
    engines: Vec<SsdEngine>,
}

impl Setup {
    /// `None` (after saying why) where the `O_DIRECT` registration came out buffered.
    fn open(mix: Mix, backend: Backend, path: &Path) -> Option<Self> {
        let registry = EndpointRegistry::new();
        let config = || SsdConfig { backend, workers: 4, ..SsdConfig::default() };
        let engine_count = match mix {
            Mix::DirectAndBuffered => 1,
            Mix::TwoEngines => 2,
        };
        let engines: Vec<SsdEngine> =
            (0..engine_count).map(|_| support::engine_with(&registry, config())).collect();
        support::write_file(path, &vec![0; FILE_LEN as usize]);
        let open = |engine: &SsdEngine, direct: bool| {
            let source = FileSource::open(path, FileOptions::new().direct(direct));
            engine.register_file(source, 0, FILE_LEN).expect("register the file")
        };
        let (registrations, ways) = match mix {
            Mix::DirectAndBuffered => {
                let regs = vec![open(&engines[0], true), open(&engines[0], false)];
                let ways = [(0, regs[0].id()), (0, regs[1].id())];
                (regs, ways)
            }
            Mix::TwoEngines => {
                let regs = vec![open(&engines[0], true), open(&engines[1], true)];
                let ways = [(0, regs[0].id()), (1, regs[1].id())];
                (regs, ways)
            }
        };
        let direct = |(e, id): (usize, EndpointId)| engines[e].file_info(id).expect("known").direct;
        if !direct(ways[0]) {
            eprintln!("SKIP {mix:?}: the file was opened without O_DIRECT");
            return None;
        }
        assert_eq!(direct(ways[1]), matches!(mix, Mix::TwoEngines));
        Some(Self { _registrations: registrations, ways, registry, engines })
    }

    /// Writes `source`'s first 60 bytes to `at` through way `which`; whether it completed.
    fn write(&self, source: &HostBuf, which: usize, at: u64) -> bool {
        let (engine, file) = self.ways[which];
        let f = Fragment::new(source.id, 0, file, at, 60, Tag::new(0));
        support::transfer(&self.engines[engine], &[vec![f]]).failed_tags().is_empty()
    }
}

/// Runs [`ROUNDS`] rounds of the eight writers on `mix` and returns (pieces completed, pieces
/// completed but not in the file after their round).
fn run(mix: Mix, backend: Backend, dir: &Path) -> Option<(u64, u64)> {
    let path = dir.join(format!("{mix:?}_{backend:?}.bin"));
    let setup = Setup::open(mix, backend, &path)?;
    let barrier = Barrier::new(WRITERS);
    let done: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());
    let counts = Mutex::new((0u64, 0u64));
    std::thread::scope(|scope| {
        for t in 0..WRITERS {
            let (setup, barrier, done, counts, path) = (&setup, &barrier, &done, &counts, &path);
            scope.spawn(move || {
                let mut source = HostBuf::new(&setup.registry, 64, 0, 0);
                for round in 0..ROUNDS {
                    source.bytes_mut()[..60].copy_from_slice(&bytes(t, round));
                    barrier.wait();
                    let completed = setup.write(&source, t % 2, piece(t).0);
                    done.lock().unwrap().push((t, completed));
                    if barrier.wait().is_leader() {
                        let file = std::fs::read(path).expect("read the file back");
                        let outcomes = std::mem::take(&mut *done.lock().unwrap());
                        let mut counts = counts.lock().unwrap();
                        for (t, completed) in outcomes {
                            let (at, len) = piece(t);
                            let range = at as usize..(at + len) as usize;
                            counts.0 += u64::from(completed);
                            counts.1 += u64::from(completed && file[range] != bytes(t, round)[..]);
                        }
                    }
                    barrier.wait();
                }
            });
        }
    });
    Some(counts.into_inner().unwrap())
}

fn check(name: &str, mix: Mix) {
    let Some(dir) = support::direct_dir(name) else { return };
    let mut lost_anywhere = Vec::new();
    for backend in support::backends(name) {
        let Some((completed, lost)) = run(mix, backend, dir.path()) else { continue };
        let pieces = WRITERS as u64 * ROUNDS;
        eprintln!("{mix:?} on {backend:?}: {completed} of {pieces} pieces completed, {lost} lost");
        assert_eq!(completed, pieces, "{mix:?} on {backend:?}: every write completes");
        if lost != 0 {
            lost_anywhere.push(format!("{lost} of {completed} completed pieces on {backend:?}"));
        }
    }
    assert!(lost_anywhere.is_empty(), "{mix:?}: lost {}", lost_anywhere.join(", "));
}

#[test]
fn writes_through_an_o_direct_and_a_buffered_registration_of_one_file_all_land() {
    let name = "writes_through_an_o_direct_and_a_buffered_registration_of_one_file_all_land";
    check(name, Mix::DirectAndBuffered);
}

#[test]
fn writes_through_two_engines_on_one_file_all_land() {
    check("writes_through_two_engines_on_one_file_all_land", Mix::TwoEngines);
}
