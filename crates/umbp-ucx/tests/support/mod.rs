//! What the remote tests share: UCX's presence, a serving process, patterns and poison.
#![allow(dead_code)] // Each test file uses its own part.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use umbp_plan::EndpointRegistry;
use umbp_ucx::{UcxConfig, UcxEngine};

/// The byte every destination holds before a transfer.
pub(crate) const POISON: u8 = 0xA5;

/// The shared secret of the tests' servers and engines.
pub(crate) const SECRET: &str = "umbp-ucx test secret, 32 bytes!!";

/// Whether UCX is here; prints why a test skips. `UMBP_REQUIRE_UCX=1` (CI) makes its absence a
/// failure.
pub(crate) fn ucx_or_skip() -> bool {
    match umbp_ucx::ucx_available() {
        Ok(()) => true,
        Err(e) => {
            assert!(
                std::env::var_os("UMBP_REQUIRE_UCX").is_none_or(|v| v != "1"),
                "UMBP_REQUIRE_UCX=1 but {e}"
            );
            eprintln!("skipped: {e}");
            false
        }
    }
}

/// Byte `i` of a region the server filled with `seed` (the formula of `umbp-ucx-serve`).
pub(crate) fn fill_byte(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 12).wrapping_mul(31)).wrapping_add(usize::from(seed)) as u8
}

/// A serving process: `umbp-ucx-serve`, killed when dropped.
pub(crate) struct Served {
    pub(crate) child: Child,
    stdin: Option<ChildStdin>,
    pub(crate) addr: SocketAddr,
}

impl Served {
    /// Starts a server of `bytes` bytes filled with `seed` over `transports`, with `extra`
    /// arguments.
    pub(crate) fn start(transports: &str, bytes: usize, seed: u8, extra: &[&str]) -> Self {
        Self::spawn(
            Command::new(env!("CARGO_BIN_EXE_umbp-ucx-serve")),
            transports,
            bytes,
            seed,
            extra,
        )
    }

    /// As [`start`](Self::start), in a process that may open at most `fds` descriptors.
    pub(crate) fn start_with_fd_limit(
        fds: u32,
        transports: &str,
        bytes: usize,
        seed: u8,
        extra: &[&str],
    ) -> Self {
        let mut shell = Command::new("sh");
        shell.args([
            "-c",
            &format!("ulimit -n {fds} && exec \"$0\" \"$@\""),
            env!("CARGO_BIN_EXE_umbp-ucx-serve"),
        ]);
        Self::spawn(shell, transports, bytes, seed, extra)
    }

    fn spawn(
        mut command: Command,
        transports: &str,
        bytes: usize,
        seed: u8,
        extra: &[&str],
    ) -> Self {
        let mut child = command
            .args([
                "--listen",
                "127.0.0.1:0",
                "--transports",
                transports,
                "--bytes",
                &bytes.to_string(),
                "--fill",
                &seed.to_string(),
            ])
            .args(extra)
            .env(umbp_ucx::SECRET_ENV, SECRET)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("umbp-ucx-serve starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line
            .strip_prefix("listening ")
            .unwrap_or_else(|| panic!("the server said {line:?}"))
            .trim()
            .parse()
            .unwrap();
        Self { stdin: child.stdin.take(), child, addr }
    }

    /// Kills the process at once (SIGKILL): a peer that dies.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = stdin.flush();
        }
        self.kill();
    }
}

/// The configuration of the tests' engines: `transports` and the tests' secret.
pub(crate) fn config(transports: &str) -> UcxConfig {
    UcxConfig {
        transports: Some(transports.to_owned()),
        secret: Some(SECRET.into()),
        ..UcxConfig::default()
    }
}

/// An engine over a new registry, on `transports`, with the tests' secret.
pub(crate) fn engine(transports: &str) -> UcxEngine {
    UcxEngine::new(EndpointRegistry::new(), config(transports)).expect("the engine starts")
}
