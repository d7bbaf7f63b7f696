//! A real `redis-server` for tests and benchmarks (feature `redis-server`): started on a fresh
//! loopback port with a password ([`PASSWORD`]) in its own temp directory, without persistence
//! (`--save ""`, `--appendonly no`: a restarted server is empty), answered `PING` before
//! [`RedisServer::start`] returns, and SIGKILLed when dropped. A fault test can
//! [`kill`](RedisServer::kill) it and [`restart`](RedisServer::restart) it on the same port.
//!
//! Tests call [`available`] first: without `redis-server` it prints why the test skips and
//! returns false, or panics when `UMBP_REQUIRE_REDIS=1` (CI installs it).
//!
//! ```no_run
//! use umbp_pool::redis_server::RedisServer;
//! use umbp_pool::Index;
//!
//! # fn main() -> Result<(), umbp_pool::Error> {
//! let Some(server) = RedisServer::start() else { return Ok(()) }; // skipped, reason printed
//! let index = server.index("my-test")?;
//! assert!(index.nodes()?.is_empty());
//! # Ok(())
//! # }
//! ```

use std::io::{self, BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, RedisConfig, RedisIndex};

/// The password every server started here requires (`--requirepass`).
pub const PASSWORD: &str = "umbp-test-secret";

/// Whether `redis-server` can be run here. If not, prints why (the caller skips) and returns
/// false, or panics when the environment has `UMBP_REQUIRE_REDIS=1`.
pub fn available() -> bool {
    let ok = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("UMBP_REQUIRE_REDIS").is_none_or(|v| v != "1"),
            "redis-server is not installed, and UMBP_REQUIRE_REDIS=1"
        );
        eprintln!("skipped: redis-server is not installed (apt-get install redis-server)");
    }
    ok
}

/// A `redis-server` child process on `127.0.0.1`, SIGKILLed when dropped (its temp directory
/// removed).
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
    /// Serving TLS only (on `port`), with the certificates in `dir`.
    tls: bool,
}

impl RedisServer {
    /// Starts a server on a fresh loopback port, or `None` when [`available`] says
    /// `redis-server` is missing (the reason printed).
    ///
    /// # Panics
    ///
    /// When `UMBP_REQUIRE_REDIS=1` and `redis-server` is missing, or when it runs but does not
    /// start (the panic shows its log).
    pub fn start() -> Option<Self> {
        if !available() {
            return None;
        }
        Some(Self::try_start().unwrap_or_else(|e| panic!("{e}")))
    }

    /// Starts a server on a fresh loopback port (a few ports are tried: one may be taken
    /// meanwhile); `Err` says why not: `redis-server` does not run, or it did not answer.
    pub fn try_start() -> io::Result<Self> {
        Self::start_in(tempfile::tempdir()?, false)
    }

    /// Starts a server that speaks TLS only, with a certificate for `127.0.0.1` signed by a
    /// fresh CA (`ca.pem` in [`dir`](Self::dir), set by [`config`](Self::config)); `None`, the
    /// reason printed, when `redis-server` or the `openssl` command is missing. Clients need
    /// umbp-pool's `tls` feature.
    ///
    /// # Panics
    ///
    /// As [`start`](Self::start).
    pub fn start_tls() -> Option<Self> {
        if !available() {
            return None;
        }
        let dir = tempfile::tempdir().expect("a temp dir for redis-server");
        let sh = |script: &str| {
            Command::new("sh")
                .arg("-c")
                .arg(script)
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let made = sh("openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=umbp-test-ca \
             && openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1 \
             && printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' > ext.cnf \
             && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile ext.cnf");
        if !made {
            eprintln!(
                "skipped: the openssl command is missing or failed to make test certificates"
            );
            return None;
        }
        Some(Self::start_in(dir, true).unwrap_or_else(|e| panic!("{e}")))
    }

    fn start_in(dir: tempfile::TempDir, tls: bool) -> io::Result<Self> {
        let mut server = Self { child: None, port: 0, dir, tls };
        for _ in 0..5 {
            server.port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            if server.launch()? {
                return Ok(server);
            }
        }
        Err(io::Error::other(format!(
            "redis-server did not start on loopback; its log:\n{}",
            server.log()
        )))
    }

    /// Starts the process on `self.port` and waits (up to 10 s) until it answers; false if it
    /// exited (the port was taken meanwhile, say) or did not answer (then it is killed).
    fn launch(&mut self) -> io::Result<bool> {
        let port = self.port.to_string();
        let d = |f: &str| self.dir.path().join(f).into_os_string();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1"]);
        if self.tls {
            cmd.args(["--port", "0", "--tls-port", &port, "--tls-auth-clients", "no"])
                .arg("--tls-cert-file")
                .arg(d("server.pem"))
                .arg("--tls-key-file")
                .arg(d("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(d("ca.pem"));
        } else {
            cmd.args(["--port", &port]);
        }
        let mut child = cmd
            .args(["--requirepass", PASSWORD])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--logfile")
            .arg(d("redis.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("redis-server does not run (apt-get install redis-server): {e}"),
                )
            })?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if child.try_wait()?.is_some() {
                return Ok(false);
            }
            if self.ping() {
                self.child = Some(child);
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        Ok(false)
    }

    fn ping(&self) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) else { return false };
        if self.tls {
            // Listening is enough: the TLS handshake is the client's test.
            return true;
        }
        if s.set_read_timeout(Some(Duration::from_secs(1))).is_err()
            || s.write_all(format!("AUTH {PASSWORD}\r\nPING\r\n").as_bytes()).is_err()
        {
            return false;
        }
        let mut r = BufReader::new(s);
        let mut line = String::new();
        let ok = r.read_line(&mut line).is_ok() && line.starts_with("+OK");
        line.clear();
        ok && r.read_line(&mut line).is_ok() && line.starts_with("+PONG")
    }

    /// The server's log (`redis.log` in [`dir`](Self::dir)), empty if it wrote none.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// The loopback port it listens on (TLS only, for [`start_tls`](Self::start_tls)).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The password it requires: [`PASSWORD`].
    pub fn password(&self) -> &'static str {
        PASSWORD
    }

    /// Its temp directory: its working directory, its log, and [`start_tls`](Self::start_tls)'s
    /// certificates (`ca.pem`).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `redis://127.0.0.1:PORT/` (`rediss://` for TLS), without the password.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// Settings for a client of the pool `prefix` on this server: its [`url`](Self::url), its
    /// password, for TLS its CA file; everything else [`RedisConfig::new`]'s defaults.
    pub fn config(&self, prefix: &str) -> RedisConfig {
        let mut c = RedisConfig::new(self.url());
        if self.tls {
            c.tls_ca_file = Some(self.dir.path().join("ca.pem"));
        }
        c.password = Some(PASSWORD.into());
        c.prefix = prefix.into();
        c
    }

    /// A client of the pool `prefix` on this server, with [`config`](Self::config)'s settings.
    pub fn index(&self, prefix: &str) -> Result<RedisIndex, Error> {
        RedisIndex::connect(&self.config(prefix))
    }

    /// Kills the server (SIGKILL: nothing saved) and waits for it; nothing if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills the server if it runs and starts it again on the same port, empty (it keeps no
    /// data), retrying for up to 10 s while the port is not yet free.
    ///
    /// # Panics
    ///
    /// When it does not start again in those 10 s (the panic shows its log).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.launch().unwrap_or_else(|e| panic!("{e}")) {
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
