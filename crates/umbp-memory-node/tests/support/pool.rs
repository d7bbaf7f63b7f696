//! What the pool tests share: a real `redis-server` (loopback, a fresh port, a temp dir and a
//! password, started by the test and killed when dropped: umbp-pool's `redis-server` feature,
//! as umbp-pool's tests use it) and a real `umbp-ucx-serve` memory node joining its pool.
#![allow(dead_code)] // Each test file uses its own part.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{ucx_or_skip, SECRET};

/// The `redis-server` a test starts (umbp-pool's `redis-server` feature), and its password.
pub(crate) use umbp_pool::redis_server::{RedisServer, PASSWORD};

pub(crate) const SERVE: &str = env!("CARGO_BIN_EXE_umbp-ucx-serve");

/// Whether both redis-server and UCX are here (each prints why not).
pub(crate) fn available() -> bool {
    umbp_pool::redis_server::available() && ucx_or_skip()
}

/// A file holding the pool's password, private.
pub(crate) fn password_file(dir: &Path) -> PathBuf {
    let path = dir.join("redis-password");
    std::fs::write(&path, format!("{PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A running memory node with its standard error collected; SIGKILLed when dropped.
pub(crate) struct Node {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
    pub(crate) metrics: Option<SocketAddr>,
    log: Arc<Mutex<String>>,
}

impl Node {
    /// Starts `umbp-ucx-serve` with `args` and waits for `listening` (printed once joined);
    /// `Err` with its exit status and log when it exits instead.
    pub(crate) fn start(args: &[String]) -> Result<Self, (Option<i32>, String)> {
        let mut child = Command::new(SERVE)
            .args(["--transports", "tcp"])
            .args(args)
            .env(umbp_remote::SECRET_ENV, SECRET)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let mut stderr = child.stderr.take().unwrap();
        let into = Arc::clone(&log);
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                into.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut node =
            Self { child, addr: SocketAddr::from(([0, 0, 0, 0], 0)), metrics: None, log };
        loop {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            if let Some(at) = line.strip_prefix("metrics ") {
                node.metrics = Some(at.trim().parse().unwrap());
            } else if let Some(at) = line.strip_prefix("listening ") {
                node.addr = at.trim().parse().unwrap();
                return Ok(node);
            } else if line.is_empty() {
                let status = node.child.wait().unwrap();
                let _ = reader.join();
                return Err((status.code(), node.log()));
            } else {
                panic!("the server said {line:?}; log: {}", node.log());
            }
        }
    }

    pub(crate) fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The log once it holds `needle`. A line the node wrote to stderr before it printed
    /// `listening` to stdout may still be in the pipe, unread, when [`start`](Self::start)
    /// returns: the two pipes keep no order between them. Panics with the log if the line
    /// never comes (20 s).
    pub(crate) fn log_with(&self, needle: &str) -> String {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let log = self.log();
            if log.contains(needle) {
                return log;
            }
            assert!(Instant::now() < until, "never logged {needle:?}: {log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `signal` and waits at most `bound` for the exit status.
    pub(crate) fn signal(&mut self, signal: libc::c_int, bound: Duration) -> Option<ExitStatus> {
        // SAFETY: kill(2) on our own child's pid, which it still is (not yet waited for).
        #[allow(unsafe_code)]
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(sent, 0);
        let until = Instant::now() + bound;
        while Instant::now() < until {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The flags of a node joining the pool `name` of `redis` as `node`, TTL `ttl_ms`, exporting
/// `regions` (`NAME=SIZE[:ro]`, in order; its tiers are the writable ones) in slots of `slot`,
/// on a fresh loopback port unless `extra` names `--listen`, and `extra`.
#[allow(clippy::too_many_arguments)] // Each is one flag's value.
pub(crate) fn node_args(
    redis: &RedisServer,
    dir: &Path,
    name: &str,
    node: u32,
    ttl_ms: u64,
    regions: &[&str],
    slot: &str,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = Vec::new();
    for region in regions {
        args.extend(["--region".into(), region.to_string()]);
    }
    let password = password_file(dir);
    let (node, ttl_ms) = (node.to_string(), ttl_ms.to_string());
    let pool = [
        ("--pool", redis.url()),
        ("--pool-password-file", password.to_str().unwrap().to_owned()),
        ("--pool-name", name.to_owned()),
        ("--node-id", node),
        ("--pool-slot-size", slot.to_owned()),
        ("--pool-ttl-ms", ttl_ms),
    ];
    for (flag, value) in pool {
        args.extend([flag.to_owned(), value]);
    }
    if !extra.contains(&"--listen") {
        args.extend(["--listen".into(), "127.0.0.1:0".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// [`node_args`] with a 1 MiB writable region `kv` (tier 0), a 64 KiB read-only `ro`, and
/// 64 KiB slots.
pub(crate) fn pool_args(
    redis: &RedisServer,
    dir: &Path,
    name: &str,
    node: u32,
    ttl_ms: u64,
    extra: &[&str],
) -> Vec<String> {
    node_args(redis, dir, name, node, ttl_ms, &["kv=1MiB", "ro=64KiB:ro"], "64KiB", extra)
}

/// `GET /metrics`.
pub(crate) fn scrape(at: SocketAddr) -> String {
    let mut s = TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer.split_once("\r\n\r\n").unwrap().1.to_owned()
}

pub(crate) fn value(body: &str, name: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{body}"))
        .parse()
        .unwrap()
}
