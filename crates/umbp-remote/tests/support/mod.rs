//! What the remote tests share: UCX's presence, a serving process, patterns and poison.
#![allow(dead_code)] // Each test file uses its own part.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use umbp_plan::EndpointRegistry;
use umbp_remote::{RemoteConfig, RemoteEngine};

/// The byte every destination holds before a transfer.
pub(crate) const POISON: u8 = 0xA5;

/// The shared secret of the tests' servers and engines.
pub(crate) const SECRET: &str = "umbp-remote test secret, 32 bytes!!";

/// Whether UCX is here; prints why a test skips. `UMBP_REQUIRE_UCX=1` (CI) makes its absence a
/// failure.
pub(crate) fn ucx_or_skip() -> bool {
    umbp_plan::testing::available_or_skip("UMBP_REQUIRE_UCX", umbp_remote::ucx_available())
}

/// Byte `i` of a region the server filled with `seed` (the formula of the memory node's
/// `--fill`, umbp-memory-node's `umbp-ucx-serve`).
pub(crate) fn fill_byte(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 12).wrapping_mul(31)).wrapping_add(usize::from(seed)) as u8
}

/// The environment variable that carries a serving process's settings (see [`serve_child`]).
const SERVER_ENV: &str = "UMBP_UCX_TEST_SERVER";

/// A serving process, killed when dropped: this very test binary running [`serve_child`], so
/// the tests need no program outside this crate (the memory node command lives in the crate
/// above, umbp-memory-node).
pub(crate) struct Served {
    pub(crate) child: Child,
    stdin: Option<ChildStdin>,
    pub(crate) addr: SocketAddr,
}

/// What a serving process exports and how it limits its clients.
#[derive(Clone, Copy)]
pub(crate) struct Exported {
    /// A writable region `arena` of this many bytes, filled with `seed` ([`fill_byte`]).
    pub(crate) bytes: usize,
    pub(crate) seed: u8,
    /// A read-only region `ro` of this many bytes (none when 0), filled with `seed + 1`.
    pub(crate) read_only_bytes: usize,
    /// `ServerLimits::max_clients`, when set.
    pub(crate) max_clients: Option<usize>,
    /// `RemoteConfig::connect_timeout` (the handshake's deadline), when set.
    pub(crate) handshake_timeout_ms: Option<u64>,
}

impl Exported {
    /// A writable `arena` of `bytes` filled with `seed`, and the default limits.
    pub(crate) fn arena(bytes: usize, seed: u8) -> Self {
        Self { bytes, seed, read_only_bytes: 0, max_clients: None, handshake_timeout_ms: None }
    }
}

impl Served {
    /// Starts a server of `bytes` bytes filled with `seed` over `transports`.
    pub(crate) fn start(transports: &str, bytes: usize, seed: u8) -> Self {
        Self::with(transports, Exported::arena(bytes, seed))
    }

    /// Starts a server exporting `exported` over `transports`.
    pub(crate) fn with(transports: &str, exported: Exported) -> Self {
        Self::spawn(Command::new(std::env::current_exe().unwrap()), transports, exported)
    }

    /// As [`with`](Self::with), in a process that may open at most `fds` descriptors.
    pub(crate) fn with_fd_limit(fds: u32, transports: &str, exported: Exported) -> Self {
        let mut shell = Command::new("sh");
        shell.args(["-c", &format!("ulimit -n {fds} && exec \"$0\" \"$@\"")]);
        shell.arg(std::env::current_exe().unwrap());
        Self::spawn(shell, transports, exported)
    }

    fn spawn(mut command: Command, transports: &str, e: Exported) -> Self {
        let spec = format!(
            "{transports} {} {} {} {} {}",
            e.bytes,
            e.seed,
            e.read_only_bytes,
            e.max_clients.map_or(0, |n| n),
            e.handshake_timeout_ms.map_or(0, |t| t)
        );
        let mut child = command
            .args(["--exact", "support::serve_child", "--ignored", "--nocapture", "-q"])
            .env(SERVER_ENV, spec)
            .env(umbp_remote::SECRET_ENV, SECRET)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the serving process starts");
        // The test harness prints its own lines first.
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let addr = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the serving process ended");
            if let Some(addr) = line.strip_prefix("listening ") {
                break addr.trim().parse().unwrap();
            }
        };
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
pub(crate) fn config(transports: &str) -> RemoteConfig {
    RemoteConfig {
        transports: Some(transports.to_owned()),
        secret: Some(SECRET.into()),
        ..RemoteConfig::default()
    }
}

/// An engine over a new registry, on `transports`, with the tests' secret.
pub(crate) fn engine(transports: &str) -> RemoteEngine {
    RemoteEngine::new(EndpointRegistry::new(), config(transports)).expect("the engine starts")
}

/// The serving process of [`Served`]: exports what `UMBP_UCX_TEST_SERVER` says, prints
/// `listening ADDR`, and serves until its standard input closes. Ignored: only [`Served`]
/// runs it, as this test binary's child (`--ignored --exact support::serve_child`).
#[test]
#[ignore = "the serving process the tests start (Served), not a test of its own"]
fn serve_child() {
    let Ok(spec) = std::env::var(SERVER_ENV) else {
        return;
    };
    let f: Vec<&str> = spec.split(' ').collect();
    let number = |i: usize| f[i].parse::<u64>().unwrap();
    let (bytes, seed, read_only_bytes) = (number(1) as usize, number(2) as u8, number(3) as usize);
    let mut config = RemoteConfig {
        transports: Some(f[0].to_owned()),
        secret: Some(SECRET.into()),
        ..RemoteConfig::default()
    };
    if number(4) > 0 {
        config.limits.max_clients = number(4) as usize;
    }
    if number(5) > 0 {
        config.connect_timeout = std::time::Duration::from_millis(number(5));
    }
    let filled = |len: usize, seed: u8| (0..len).map(|i| fill_byte(seed, i)).collect::<Vec<u8>>();
    let mut builder =
        umbp_remote::ServerBuilder::new(config).export("arena", filled(bytes, seed), true);
    if read_only_bytes > 0 {
        builder = builder.export("ro", filled(read_only_bytes, seed.wrapping_add(1)), false);
    }
    let server = builder.serve("127.0.0.1:0").expect("serving starts");
    println!("listening {}", server.local_addr());
    std::io::stdout().flush().unwrap();
    for _ in std::io::stdin().lock().lines() {}
    drop(server);
}
