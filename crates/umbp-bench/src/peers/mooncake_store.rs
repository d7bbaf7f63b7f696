//! Mooncake Store, the distributed KV store users would pick instead of umbp's pool, as a peer
//! of `umbp-bench pool`: its `mooncake_master` (with its HTTP metadata server) on loopback,
//! and two store clients on the TCP transport, from the same wheel and venv as
//! [`super::mooncake`] (`scripts/mooncake-venv`).
//!
//! **Three processes.** [`MooncakeStore::start`] runs the master (the venv's `mooncake_master`,
//! beside its python), then the program `mooncake_store_peer.py` (embedded in the binary, run
//! with `python -c`) twice: a *holder* that mounts the store's memory (the memory node) and a
//! *client* that mounts none, so every object it puts lands in the holder's memory, and that
//! registers a buffer to put from and get into. The client speaks JSON lines (the program's
//! docstring has the protocol) and times each batch call itself, so Mooncake's figures hold
//! no Python list building, only the call. Mooncake's own logs go to the processes' stderr,
//! kept for errors.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde_json::json;

use super::mooncake::Process;

/// The program both store clients run.
const PROGRAM: &str = include_str!("mooncake_store_peer.py");

/// A master, a holder and a client on loopback; all stopped when dropped.
pub struct MooncakeStore {
    // Dropped in this order: the client, the holder, then the master they talk to.
    client: Process,
    holder: Process,
    master: Master,
}

impl std::fmt::Debug for MooncakeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeStore").field("rpc_port", &self.master.rpc_port).finish()
    }
}

/// The `mooncake_master` process, killed when dropped.
struct Master {
    child: Child,
    rpc_port: u16,
    http_port: u16,
}

impl Drop for Master {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn listening(port: u16) -> bool {
    TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(200)).is_ok()
}

impl Master {
    fn start(python: &Path) -> anyhow::Result<Self> {
        let program = python.with_file_name("mooncake_master");
        ensure!(
            program.is_file(),
            "{} is missing (the venv's wheel ships it beside its python)",
            program.display()
        );
        let (rpc_port, http_port) = (free_port()?, free_port()?);
        let child = Command::new(&program)
            .arg(format!("--rpc_port={rpc_port}"))
            .arg("--enable_http_metadata_server=true")
            .arg("--http_metadata_server_host=127.0.0.1")
            .arg(format!("--http_metadata_server_port={http_port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let mut master = Self { child, rpc_port, http_port };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(listening(rpc_port) && listening(http_port)) {
            if let Some(status) = master.child.try_wait()? {
                bail!("mooncake_master exited at start ({status})");
            }
            ensure!(Instant::now() < deadline, "mooncake_master did not listen in 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(master)
    }
}

impl MooncakeStore {
    /// Starts the master, a holder mounting `segment` bytes and a client with a registered
    /// buffer of `buffer` bytes, with `python` (the venv's).
    pub fn start(python: &Path, segment: u64, buffer: u64) -> anyhow::Result<Self> {
        let master = Master::start(python)?;
        let args = |role: &str, bytes: u64| {
            vec![
                role.to_owned(),
                format!("127.0.0.1:{}", master.rpc_port),
                format!("http://127.0.0.1:{}/metadata", master.http_port),
                bytes.to_string(),
            ]
        };
        let mut holder = Process::spawn(python, PROGRAM, "store holder", &args("holder", segment))?;
        holder.ask(None)?;
        let mut client = Process::spawn(python, PROGRAM, "store client", &args("client", buffer))?;
        client.ask(None)?;
        Ok(Self { client, holder, master })
    }

    /// Stores `n` objects of 16 bytes under the lookup keys `0..n` (untimed).
    pub fn fill(&mut self, n: usize) -> anyhow::Result<()> {
        let answer = self.client.ask(Some(&json!({"op": "fill", "n": n})))?;
        ensure!(answer["stored"] == n, "the store client answered {answer}");
        Ok(())
    }

    /// One `batch_is_exist` of the lookup keys `0..n`: its seconds and how many exist.
    pub fn exist(&mut self, n: usize) -> anyhow::Result<(f64, u64)> {
        let answer = self.client.ask(Some(&json!({"op": "exist", "n": n})))?;
        let seconds = answer["seconds"].as_f64().context("an exist without its seconds")?;
        Ok((seconds, answer["found"].as_u64().unwrap_or(0)))
    }

    /// One `batch_put_from` of `n` objects of `size` bytes under round `round`'s keys: its
    /// seconds and how many were stored.
    pub fn put(&mut self, round: u64, size: u64, n: usize) -> anyhow::Result<(f64, u64)> {
        let answer =
            self.client.ask(Some(&json!({"op": "put", "round": round, "size": size, "n": n})))?;
        let seconds = answer["seconds"].as_f64().context("a put without its seconds")?;
        Ok((seconds, answer["ok"].as_u64().unwrap_or(0)))
    }

    /// One `batch_get_into` of round `round`'s objects into the poisoned buffer: its seconds,
    /// how many came back whole, and whether every byte matched.
    pub fn get(&mut self, round: u64, size: u64, n: usize) -> anyhow::Result<(f64, u64, bool)> {
        let answer =
            self.client.ask(Some(&json!({"op": "get", "round": round, "size": size, "n": n})))?;
        let seconds = answer["seconds"].as_f64().context("a get without its seconds")?;
        Ok((seconds, answer["ok"].as_u64().unwrap_or(0), answer["verified"] == true))
    }

    /// Removes round `round`'s objects (untimed), making room for the next round's.
    pub fn remove(&mut self, round: u64, n: usize) -> anyhow::Result<()> {
        self.client.ask(Some(&json!({"op": "remove", "round": round, "n": n})))?;
        Ok(())
    }

    /// Stops the client and the holder, then the master.
    pub fn stop(mut self) {
        self.client.stop();
        self.holder.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_program_speaks_the_documented_commands() {
        for op in ["\"fill\"", "\"exist\"", "\"put\"", "\"get\"", "\"remove\""] {
            assert!(PROGRAM.contains(op), "{op}");
        }
        for call in ["batch_is_exist", "batch_put_from", "batch_get_into", "register_buffer"] {
            assert!(PROGRAM.contains(call), "{call}");
        }
    }
}
