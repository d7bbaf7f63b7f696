//! Test support: a real `redis-server` on loopback (fresh port, temp dir, `requirepass`),
//! started and stopped by the tests, and the suite of rules every index backend must keep.

#![allow(dead_code, unreachable_pub)]

pub mod suite;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_pool::RedisConfig;

/// The password every test server requires.
pub const PASSWORD: &str = "umbp-test-secret";

/// A `redis-server` this test started, stopped (SIGKILL) when dropped.
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

/// Whether `redis-server` can be run; if not, prints why and returns false, or panics when
/// `UMBP_REQUIRE_REDIS=1` (CI installs it).
pub fn redis_available() -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        if std::env::var("UMBP_REQUIRE_REDIS").as_deref() == Ok("1") {
            panic!("redis-server is not installed, and UMBP_REQUIRE_REDIS=1");
        }
        eprintln!("skipped: redis-server is not installed (apt-get install redis-server)");
    }
    ok
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl RedisServer {
    /// Starts a server on a fresh loopback port, or `None` (with the reason printed) when
    /// redis-server is missing and not required.
    pub fn start() -> Option<Self> {
        if !redis_available() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mut server = Self { child: None, port: 0, dir };
        for _ in 0..5 {
            server.port = free_port();
            if server.launch() {
                return Some(server);
            }
        }
        panic!("redis-server did not start: {}", server.log());
    }

    /// Starts the process on `self.port` and waits (up to 10 s) until it answers; false if it
    /// exited (for example, the port was taken meanwhile).
    fn launch(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--requirepass", PASSWORD])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--logfile")
            .arg(self.dir.path().join("redis.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.as_mut().unwrap().try_wait() {
                self.child = None;
                return false;
            }
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server on port {} did not answer in 10 s: {}", self.port, self.log());
    }

    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let cmd = format!("AUTH {PASSWORD}\r\nPING\r\n");
        if s.write_all(cmd.as_bytes()).is_err() {
            return false;
        }
        let mut r = BufReader::new(s);
        let mut line = String::new();
        let ok = r.read_line(&mut line).is_ok() && line.starts_with("+OK");
        line.clear();
        ok && r.read_line(&mut line).is_ok() && line.starts_with("+PONG")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's temp dir.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Settings for this server, authenticated with its password, under pool `prefix`.
    pub fn config(&self, prefix: &str) -> RedisConfig {
        let mut c = RedisConfig::new(format!("redis://127.0.0.1:{}/", self.port));
        c.password = Some(PASSWORD.into());
        c.prefix = prefix.into();
        c.timeout = Duration::from_secs(2);
        c
    }

    /// Kills the server (SIGKILL: no shutdown save) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port (empty: it keeps no data).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.launch() {
            assert!(Instant::now() < deadline, "redis-server did not restart: {}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
