//! A real `redis-server` for the pool tests: loopback, a fresh port, a temp dir and a
//! password, started by the test and killed when dropped (as umbp-pool's tests do).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_pool::{RedisConfig, RedisIndex};

/// The password every test server requires.
pub(crate) const PASSWORD: &str = "umbp-ucx-pool-test-password";

/// Whether `redis-server` runs here; prints why a test skips, or panics when
/// `UMBP_REQUIRE_REDIS=1` (CI installs it).
pub(crate) fn redis_or_skip() -> bool {
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

/// A `redis-server` this test started.
pub(crate) struct Redis {
    child: Child,
    pub(crate) port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// Starts one on a fresh loopback port (a few tries: a port may be taken meanwhile).
    pub(crate) fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let mut child = Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--requirepass", PASSWORD, "--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                if ping(port) {
                    return Self { child, port, _dir: dir };
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("redis-server did not start");
    }

    /// `redis://127.0.0.1:PORT/`, without the password.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// A client of the pool `name` on this server.
    pub(crate) fn index(&self, name: &str) -> RedisIndex {
        let mut c = RedisConfig::new(self.url());
        c.password = Some(PASSWORD.into());
        c.prefix = name.into();
        RedisIndex::connect(&c).unwrap()
    }
}

fn ping(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else { return false };
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    if s.write_all(format!("AUTH {PASSWORD}\r\nPING\r\n").as_bytes()).is_err() {
        return false;
    }
    let mut r = BufReader::new(s);
    let (mut a, mut b) = (String::new(), String::new());
    r.read_line(&mut a).is_ok() && r.read_line(&mut b).is_ok() && b.starts_with("+PONG")
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
