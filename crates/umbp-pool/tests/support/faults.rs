//! Helpers of the fault tests (`tests/faults.rs`): tiers whose bytes live in a real file, the
//! bytes each writer puts in a block, and other processes of the pool (instances and an
//! embedded publisher) started by re-running this test binary, driven over their stdin and
//! stdout, and killed with SIGKILL.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use umbp_pool::{checksum, Index, Placement, Published, Reservation, Reserved, TierSpec};

use super::suite::key;

/// Names the role of a child process (unset in the parent).
pub const ROLE: &str = "UMBP_FAULTS_ROLE";

/// A tier's bytes in a file: slot `s` at `s * slot_size`.
pub struct FileTier {
    pub spec: TierSpec,
    pub path: PathBuf,
    file: File,
}

impl FileTier {
    /// Opens (creating, sized to the whole tier) the tier file at `path`.
    pub fn open(spec: TierSpec, path: &Path) -> Self {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap_or_else(|e| panic!("tier file {}: {e}", path.display()));
        let size = spec.slot_size * u64::from(spec.slot_count);
        if file.metadata().unwrap().len() < size {
            file.set_len(size).unwrap();
        }
        Self { spec, path: path.to_owned(), file }
    }

    /// Opens the tier file at `path` as it is (no creating, no resizing).
    pub fn open_existing(spec: TierSpec, path: &Path) -> Self {
        let file = OpenOptions::new().read(true).write(true).open(path).unwrap();
        Self { spec, path: path.to_owned(), file }
    }

    /// Writes `bytes` into `slot` (no fsync: a killed process's writes stay in the page cache).
    pub fn write(&self, slot: u32, bytes: &[u8]) {
        assert!(bytes.len() as u64 <= self.spec.slot_size);
        self.file.write_all_at(bytes, self.spec.slot_offset(slot)).unwrap();
    }

    /// Reads `len` bytes of `slot`.
    pub fn read(&self, slot: u32, len: u64) -> Vec<u8> {
        let mut b = vec![0u8; len as usize];
        self.file.read_exact_at(&mut b, self.spec.slot_offset(slot)).unwrap();
        b
    }

    /// Loads a placement's bytes and verifies them: the bytes, or the load error.
    pub fn load(&self, p: &Placement) -> Result<Vec<u8>, umbp_pool::Error> {
        let b = self.read(p.slot, p.len);
        p.verify(&b)?;
        Ok(b)
    }
}

/// The bytes writer `writer` saves under block `id`: every writer's differ, so a slot holding
/// another writer's (or another block's, or half of two) bytes is told apart by its CRC32C.
pub fn block_bytes(id: u64, writer: u8, len: u64) -> Vec<u8> {
    let mut x = (id + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(writer) << 56) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Reserves block `id` on `tier`, writes writer `writer`'s bytes into the slot and publishes
/// them with their CRC32C: the two-phase write a pool instance does.
pub fn save(index: &dyn Index, tier: &FileTier, id: u64, writer: u8, len: u64) -> Saved {
    let spec = &tier.spec;
    let r = match index.reserve(key(id), spec.node, spec.tier, len, Duration::from_secs(60)) {
        Ok(Reserved::Slot(r)) => r,
        Ok(Reserved::Present(p)) => return Saved::Present(p),
        Err(e) => return Saved::Failed(e.to_string()),
    };
    let bytes = block_bytes(id, writer, len);
    tier.write(r.slot, &bytes);
    match index.publish(&[(r, checksum(&bytes))]) {
        Ok(out) => Saved::Published(r, out[0]),
        Err(e) => Saved::Failed(e.to_string()),
    }
}

/// What [`save`] did.
#[derive(Debug)]
pub enum Saved {
    Present(Placement),
    Published(Reservation, Published),
    Failed(String),
}

/// Another process of the pool: this test binary run again with [`ROLE`] set, running one
/// test function (`test`) that serves commands from its stdin until killed. Answers are the
/// lines it prints after `@@ ` (the test harness prints others).
pub struct Process {
    child: Child,
    stdin: ChildStdin,
    answers: Receiver<String>,
}

impl Process {
    /// Starts `test` of this binary as a child with `role` and `env`.
    pub fn spawn(test: &str, role: &str, env: &[(&str, String)]) -> Self {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn a child process of the pool");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness prints "test NAME ... " before the first answer, on its line.
                if let Some(at) = line.find("@@ ") {
                    if tx.send(line[at + 3..].to_owned()).is_err() {
                        break;
                    }
                }
            }
        });
        Self { child, stdin, answers }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command line.
    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The next answer (waiting up to 60 s; a child that died or hung fails the test).
    pub fn answer(&mut self) -> String {
        self.answers
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no answer from child {}: {e}", self.child.id()))
    }

    /// Sends `command` and waits for its answer.
    pub fn ask(&mut self, command: &str) -> String {
        self.send(command);
        self.answer()
    }

    /// Every answer printed so far, without waiting.
    pub fn answers_so_far(&mut self) -> Vec<String> {
        self.answers.try_iter().collect()
    }

    /// Every answer until the process's stdout closes (after [`kill`](Self::kill)).
    pub fn remaining_answers(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(a) = self.answers.recv_timeout(Duration::from_secs(10)) {
            out.push(a);
        }
        out
    }

    /// SIGKILL: no destructor, no flush, no goodbye; waits until it is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let status = self.child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert!(
            status.signal() == Some(9) || !status.success(),
            "the child was to be killed, it exited: {status:?}"
        );
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In a child: the command lines of stdin, one by one, until stdin closes.
pub fn commands() -> impl Iterator<Item = String> {
    std::io::stdin().lines().map_while(Result::ok)
}

/// In a child: prints one answer and flushes it.
pub fn reply(answer: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "@@ {answer}").unwrap();
    out.flush().unwrap();
}

/// A small deterministic generator (xorshift64*), for random kill points that a failing run
/// prints and a rerun repeats.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
