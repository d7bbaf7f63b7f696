//! Test support: a real `redis-server` on loopback (fresh port, temp dir, `requirepass`),
//! started and stopped by the tests, and the suite of rules every index backend must keep.

#![allow(dead_code, unreachable_pub)]

pub mod faults;
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
    /// Serving TLS only (on `port`), with the certificates in `dir`.
    tls: bool,
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
        Self::start_in(tempfile::tempdir().unwrap(), false)
    }

    /// Starts a server that speaks TLS only, with a certificate for `127.0.0.1` signed by a
    /// fresh CA (`ca.pem` in [`dir`](Self::dir)); `None` (with the reason printed) when
    /// redis-server or the `openssl` command is missing.
    pub fn start_tls() -> Option<Self> {
        if !redis_available() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
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
        Self::start_in(dir, true)
    }

    fn start_in(dir: tempfile::TempDir, tls: bool) -> Option<Self> {
        let mut server = Self { child: None, port: 0, dir, tls };
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
        let child = cmd
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
        if self.tls {
            // Listening is enough: the TLS handshake is the client's test.
            return true;
        }
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
        let scheme = if self.tls { "rediss" } else { "redis" };
        let mut c = RedisConfig::new(format!("{scheme}://127.0.0.1:{}/", self.port));
        if self.tls {
            c.tls_ca_file = Some(self.dir.path().join("ca.pem"));
        }
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
