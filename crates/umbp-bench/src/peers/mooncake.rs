//! Mooncake Transfer Engine, the transfer engine users would pick instead of umbp's remote
//! tier, as a peer of `umbp-bench remote`: its TCP transport with the P2P handshake on
//! loopback, reading the same scattered fragments with `batch_transfer_sync_read`.
//!
//! **Where it comes from.** PyPI's `mooncake-transfer-engine-non-cuda` ([`VERSION`]), installed
//! by the repository's `scripts/mooncake-venv` into a virtual environment cached outside the
//! repository (once per machine, about 30 s with a network) and reused; [`python`] runs that
//! script, or takes the interpreter named by [`PYTHON_ENV`]. Where neither gives a python that
//! imports `mooncake.engine`, [`python`] says why and the bench skips the peer.
//!
//! **Two processes.** [`Mooncake::start`] runs the program `mooncake_peer.py` (embedded in the
//! binary, run with `python -c`) twice: a *target* exporting a buffer of the arena's size
//! filled with a pattern, and an *initiator* with a destination of the same size. They speak
//! JSON lines over their stdin and stdout (the program's docstring has the protocol); Mooncake's
//! own log goes to their stderr, kept for errors. The initiator times one
//! `batch_transfer_sync_read` call per run: the address lists are built at setup, untimed, so
//! Mooncake's figure holds no planning (umbp's holds its build). `verify` poisons the
//! destination, reads once more and checks every byte against the target's pattern.
//!
//! **Batch limits.** Mooncake's TCP transport refuses a batch of more transfers per peer than
//! `MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER` and `MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER` allow
//! (1,024 by default; 65,536 is refused as invalid and replaced by the default): both are set
//! to [`MAX_BATCH`], and a setup of more fragments is refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::{json, Value};

/// The pinned version of PyPI's `mooncake-transfer-engine-non-cuda` (the script's pin).
pub const VERSION: &str = "0.3.13.post1";

/// An environment variable naming a python that imports `mooncake.engine`, used instead of
/// running `scripts/mooncake-venv` (a path that does not run makes the peer skip).
pub const PYTHON_ENV: &str = "UMBP_MOONCAKE_PYTHON";

/// The most fragments one batch may hold: both per-peer queue limits are raised to this.
pub const MAX_BATCH: usize = 16_384;

/// The script that installs (once) and names the venv's python, in this source tree.
pub const VENV_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/mooncake-venv");

/// The program both processes run.
const PROGRAM: &str = include_str!("mooncake_peer.py");

/// How long the venv script may take (a first install downloads the wheel).
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a process may take to start, and to answer a command.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// The python to run Mooncake with: [`PYTHON_ENV`]'s, else the one `scripts/mooncake-venv`
/// installs (or reuses) and prints. `Err` says why there is none.
pub fn python() -> Result<PathBuf, String> {
    match std::env::var_os(PYTHON_ENV) {
        Some(python) => imports_mooncake(PathBuf::from(python)),
        None => from_script(),
    }
}

/// `python` when it imports `mooncake.engine`; `Err` says why not.
fn imports_mooncake(python: PathBuf) -> Result<PathBuf, String> {
    match Command::new(&python)
        .args(["-c", "import mooncake.engine"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => Err(format!(
            "{PYTHON_ENV}={} does not import mooncake.engine: {}",
            python.display(),
            last_lines(&String::from_utf8_lossy(&out.stderr), 1)
        )),
        Err(e) => Err(format!("{PYTHON_ENV}={} does not run: {e}", python.display())),
    }
}

/// The python `scripts/mooncake-venv` prints, after installing the venv if need be.
fn from_script() -> Result<PathBuf, String> {
    let script = Path::new(VENV_SCRIPT);
    if !script.is_file() {
        return Err(format!(
            "{} is missing (a binary run outside its source tree); set {PYTHON_ENV}",
            script.display()
        ));
    }
    let mut child = Command::new("bash")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("bash {} does not run: {e}", script.display()))?;
    let out = drain(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>));
    let deadline = Instant::now() + INSTALL_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let (out, err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    match status {
        Some(s) if s.success() => match out.lines().last() {
            Some(line) if Path::new(line.trim()).is_file() => Ok(PathBuf::from(line.trim())),
            _ => Err(format!("{} named no python: {}", script.display(), last_lines(&out, 1))),
        },
        Some(s) => Err(format!(
            "installing mooncake-transfer-engine-non-cuda {VERSION} failed ({s}): {}",
            last_lines(&err, 2)
        )),
        None => Err(format!("{} ran past {INSTALL_TIMEOUT:?}", script.display())),
    }
}

/// A python program of a peer driver (this one's two processes, the Store driver's three):
/// its stdin for commands, its answers line by line (JSON), its stderr kept for errors.
pub(crate) struct Process {
    role: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    answers: Receiver<String>,
    stderr: Option<JoinHandle<String>>,
}

impl Process {
    fn start(python: &Path, role: &'static str, bytes: u64) -> anyhow::Result<Self> {
        Self::spawn(python, PROGRAM, role, &[role.to_owned(), bytes.to_string()])
    }

    /// Runs `program` (its source, with `python -c`) with `args`, as `role` in messages, with
    /// Mooncake's TCP transport allowed batches of [`MAX_BATCH`] transfers per peer.
    pub(crate) fn spawn(
        python: &Path,
        program: &str,
        role: &'static str,
        args: &[String],
    ) -> anyhow::Result<Self> {
        let limit = MAX_BATCH.to_string();
        let mut child = Command::new(python)
            .arg("-c")
            .arg(program)
            .args(args)
            .env("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", &limit)
            .env("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", &limit)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the Mooncake {role} ({})", python.display()))?;
        let stdin = child.stdin.take();
        let stderr = Some(drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>)));
        let (said, answers) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if said.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self { role, child, stdin, answers, stderr })
    }

    /// Sends `command` (none: only waits for the next answer) and returns the answer.
    pub(crate) fn ask(&mut self, command: Option<&Value>) -> anyhow::Result<Value> {
        if let Some(command) = command {
            let stdin = self.stdin.as_mut().context("the process was stopped")?;
            let sent = writeln!(stdin, "{command}").and_then(|()| stdin.flush());
            if let Err(e) = sent {
                let log = self.stop();
                bail!("the Mooncake {} is gone ({e}): {log}", self.role);
            }
        }
        let line = match self.answers.recv_timeout(ANSWER_TIMEOUT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Disconnected) => {
                let log = self.stop();
                bail!("the Mooncake {} exited: {log}", self.role)
            }
            Err(RecvTimeoutError::Timeout) => {
                bail!("the Mooncake {} gave no answer in {ANSWER_TIMEOUT:?}", self.role)
            }
        };
        let answer: Value = serde_json::from_str(&line)
            .with_context(|| format!("the Mooncake {} said {line:?}", self.role))?;
        if let Some(why) = answer.get("error") {
            let why = why.as_str().unwrap_or("").to_owned();
            let log = self.stop();
            bail!("the Mooncake {}: {why}: {log}", self.role);
        }
        Ok(answer)
    }

    /// Closes stdin (the process ends), kills it if it lingers; returns the last of its log.
    pub(crate) fn stop(&mut self) -> String {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = self.stderr.take().and_then(|t| t.join().ok()).unwrap_or_default();
        last_lines(&log, 2)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Mooncake target and initiator on loopback, both stopped when dropped.
pub struct Mooncake {
    // The initiator first: it is dropped (stopped) before the target it reads from.
    initiator: Process,
    target: Process,
    segment: String,
    base: u64,
    bytes_per_run: u64,
}

impl std::fmt::Debug for Mooncake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mooncake").field("segment", &self.segment).finish_non_exhaustive()
    }
}

impl Mooncake {
    /// Starts the target (exporting `bytes` bytes) and the initiator (a destination of
    /// `bytes` bytes) with `python`.
    pub fn start(python: &Path, bytes: u64) -> anyhow::Result<Self> {
        let mut target = Process::start(python, "target", bytes)?;
        let exported = target.ask(None)?;
        let segment = exported["segment"].as_str().context("the target named no segment")?;
        let base = exported["base"].as_u64().context("the target named no base address")?;
        let mut initiator = Process::start(python, "initiator", bytes)?;
        initiator.ask(None)?;
        Ok(Self { initiator, target, segment: segment.to_owned(), base, bytes_per_run: 0 })
    }

    /// The next runs read one fragment of `size` bytes from each target offset `src[i]` into
    /// destination offset `dst[i]`. Refused past [`MAX_BATCH`] fragments.
    pub fn setup(&mut self, size: u64, src: &[u64], dst: &[u64]) -> anyhow::Result<()> {
        ensure!(src.len() == dst.len(), "as many sources as destinations");
        ensure!(
            src.len() <= MAX_BATCH,
            "{} fragments in one batch; Mooncake's per-peer queues take {MAX_BATCH} at most",
            src.len()
        );
        let command = json!({
            "op": "setup", "segment": self.segment, "base": self.base, "size": size,
            "src": src, "dst": dst,
        });
        let answer = self.initiator.ask(Some(&command))?;
        ensure!(answer["fragments"] == src.len(), "the initiator answered {answer}");
        self.bytes_per_run = size * src.len() as u64;
        Ok(())
    }

    /// One timed `batch_transfer_sync_read` of every fragment: bytes per second.
    pub fn run(&mut self) -> anyhow::Result<f64> {
        let answer = self.initiator.ask(Some(&json!({"op": "run"})))?;
        let seconds = answer["seconds"].as_f64().context("a run without its seconds")?;
        ensure!(seconds > 0.0, "a run of {seconds} s");
        Ok(self.bytes_per_run as f64 / seconds)
    }

    /// Poisons the destination, reads once more and checks every byte.
    pub fn verify(&mut self) -> anyhow::Result<bool> {
        let answer = self.initiator.ask(Some(&json!({"op": "verify"})))?;
        answer["verified"].as_bool().context("a verify without its verdict")
    }

    /// Single 4 KiB reads one at a time, from target offset `src[i]` to destination offset
    /// `dst[i]`, each timed alone (after a [`setup`](Self::setup)): their µs, and whether
    /// every one delivered its bytes.
    pub fn singles(&mut self, src: &[u64], dst: &[u64]) -> anyhow::Result<(Vec<f64>, bool)> {
        ensure!(src.len() == dst.len(), "as many sources as destinations");
        let answer = self.initiator.ask(Some(&json!({"op": "singles", "src": src, "dst": dst})))?;
        let times = answer["us"].as_array().context("singles without their times")?;
        let times: Vec<f64> = times.iter().filter_map(Value::as_f64).collect();
        ensure!(times.len() == src.len(), "{} times for {} transfers", times.len(), src.len());
        Ok((times, answer["verified"] == true))
    }

    /// Stops both processes and says whether the target was still up.
    pub fn stop(mut self) -> bool {
        self.initiator.stop();
        matches!(self.target.child.try_wait(), Ok(None))
    }
}

/// Reads `from` to the end on a thread.
fn drain(from: Option<Box<dyn Read + Send>>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut from) = from {
            let _ = from.read_to_end(&mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// The last `n` non-empty lines of `text`, joined on one line.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_python_that_does_not_run_is_a_reason_not_a_failure() {
        // Only the variable's branch: the script's may install from the network.
        let missing = "/nonexistent/umbp-bench/python";
        let why = imports_mooncake(PathBuf::from(missing)).unwrap_err();
        assert!(why.contains(missing) && why.contains("does not run"), "{why}");
    }

    #[test]
    fn the_program_speaks_the_documented_commands() {
        for op in ["\"setup\"", "\"run\"", "\"verify\"", "batch_transfer_sync_read"] {
            assert!(PROGRAM.contains(op), "{op}");
        }
        assert!(Path::new(VENV_SCRIPT).is_file(), "the script ships with the source");
        let script = std::fs::read_to_string(VENV_SCRIPT).unwrap();
        assert!(script.contains(&format!("version=\"{VERSION}\"")), "the pins agree");
    }
}
