//! A real `redis-server` for tests and benchmarks (feature `redis-server`): started on a fresh
//! loopback port with a password ([`PASSWORD`]) in its own temp directory, without persistence
//! (`--save ""`, `--appendonly no`: a restarted server is empty), answered `PING` before
//! [`RedisServer::start`] returns, and SIGKILLed when dropped. A fault test can
//! [`kill`](RedisServer::kill) it and [`restart`](RedisServer::restart) it on the same port.
//!
//! Tests call [`available`] first: without `redis-server` it prints why the test skips and
//! returns false, or panics when `UMBP_REQUIRE_REDIS=1` (CI installs it).
//!
//! [`RedisCluster`] starts a real Redis Cluster the same way: masters with a replica each,
//! joined by `redis-cli --cluster create`, whose nodes a test can kill (a failover) or whose
//! slots it can move (`redis-cli --cluster reshard`) under load.
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
    /// A node of a Redis Cluster (`--cluster-enabled yes`).
    cluster: bool,
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
        Self::start_in(tempfile::tempdir()?, false, false)
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
        Some(Self::start_in(dir, true, false).unwrap_or_else(|e| panic!("{e}")))
    }

    fn start_in(dir: tempfile::TempDir, tls: bool, cluster: bool) -> io::Result<Self> {
        let mut server = Self { child: None, port: 0, dir, tls, cluster };
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
        if self.cluster {
            // A node that misses its peers for a second is failed over; replicas follow their
            // master with the same password.
            // The bus port on a free port of its own (the default, port + 10,000, may be taken
            // or past 65,535).
            let bus = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-port", &bus])
                .arg("--cluster-config-file")
                .arg(d("nodes.conf"))
                .args(["--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0"]);
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

/// A real Redis Cluster on loopback: `masters` masters with a replica each (so a killed
/// master fails over), every node a [`RedisServer`] of its own, joined by `redis-cli
/// --cluster create`, with a one-second node timeout. Dropped, every node is killed.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// One node as `CLUSTER NODES` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterNode {
    /// The node's id.
    pub id: String,
    /// Its loopback port.
    pub port: u16,
    /// Whether it serves slots as a master now.
    pub master: bool,
    /// Whether the others take it for failed.
    pub failed: bool,
    /// How many hash slots it serves.
    pub slots: u32,
}

impl RedisCluster {
    /// Starts `masters` masters and as many replicas and joins them, or `None` (the reason
    /// printed) when `redis-server` or `redis-cli` is missing.
    ///
    /// # Panics
    ///
    /// As [`RedisServer::start`]; or when the cluster does not form.
    pub fn start(masters: usize) -> Option<Self> {
        if !available() {
            return None;
        }
        if !Command::new("redis-cli").arg("--version").output().is_ok_and(|o| o.status.success()) {
            assert!(
                std::env::var_os("UMBP_REQUIRE_REDIS").is_none_or(|v| v != "1"),
                "redis-cli is not installed, and UMBP_REQUIRE_REDIS=1"
            );
            eprintln!("skipped: redis-cli is not installed (apt-get install redis-tools)");
            return None;
        }
        let nodes: Vec<RedisServer> = (0..2 * masters)
            .map(|_| {
                let dir = tempfile::tempdir().expect("a temp dir for redis-server");
                RedisServer::start_in(dir, false, true).unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        let cluster = Self { nodes };
        let mut create = Command::new("redis-cli");
        create.args(["-a", PASSWORD, "--no-auth-warning", "--cluster", "create"]);
        for n in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", n.port));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_until_ok();
        // A replica that never synced cannot take over: wait until every one has.
        let deadline = Instant::now() + Duration::from_secs(60);
        for n in &cluster.nodes {
            loop {
                let info = Self::cli(n.port, &["info", "replication"]).unwrap_or_default();
                if info.contains("role:master") || info.contains("master_link_status:up") {
                    break;
                }
                assert!(Instant::now() < deadline, "replica {} never synced: {info}", n.port);
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // Every node's view names each replica as one (gossip carries the roles some time
        // after the create: a test that looks for a replica must find one).
        for n in &cluster.nodes {
            loop {
                let replicas = Self::nodes_seen_by(n.port).iter().filter(|v| !v.master).count();
                if replicas == masters {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "node {} sees {replicas} replicas of {masters}",
                    n.port
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(cluster)
    }

    /// Its nodes' servers (masters and replicas, in start order).
    pub fn servers(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Settings for a client of the pool `prefix` on this Cluster, reaching it through the
    /// node on `seed` (any one: the client learns the others).
    pub fn config(&self, prefix: &str, seed: u16) -> RedisConfig {
        let mut c = RedisConfig::cluster(format!("redis://127.0.0.1:{seed}/"));
        c.password = Some(PASSWORD.into());
        c.prefix = prefix.into();
        c.timeout = Duration::from_secs(2);
        c
    }

    /// `redis-cli` against the node on `port` with `args`: its standard output, or `None` if
    /// it failed.
    pub fn cli(port: u16, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-a", PASSWORD, "--no-auth-warning", "-p", &port.to_string()])
            .args(args)
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The nodes as the node on `port` sees them (`CLUSTER NODES`).
    pub fn nodes_seen_by(port: u16) -> Vec<ClusterNode> {
        let Some(text) = Self::cli(port, &["cluster", "nodes"]) else { return Vec::new() };
        text.lines()
            .filter_map(|line| {
                let w: Vec<&str> = line.split_whitespace().collect();
                if w.len() < 8 {
                    return None;
                }
                let port = w[1].split(['@', ':']).nth(1)?.parse().ok()?;
                let slots = w[8..]
                    .iter()
                    .filter(|r| !r.starts_with('['))
                    .map(|r| match r.split_once('-') {
                        Some((a, b)) => {
                            b.parse::<u32>().unwrap_or(0) + 1 - a.parse::<u32>().unwrap_or(0)
                        }
                        None => 1,
                    })
                    .sum();
                Some(ClusterNode {
                    id: w[0].to_owned(),
                    port,
                    master: w[2].contains("master"),
                    failed: w[2].contains("fail") && !w[2].contains("fail?"),
                    slots,
                })
            })
            .collect()
    }

    /// The port of the master serving `key`'s hash slot (its hash tag's), as the first
    /// running node sees the slot map; `None` if no master serves it.
    pub fn master_serving(&self, key: &str) -> Option<u16> {
        let seed = self.nodes.iter().find(|n| n.child.is_some())?.port;
        let slot: u16 = Self::cli(seed, &["cluster", "keyslot", key])?.trim().parse().ok()?;
        let text = Self::cli(seed, &["cluster", "slots"])?;
        // redis-cli prints CLUSTER SLOTS flat: start, end, then each node's ip, port and id.
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        lines.windows(4).find_map(|w| {
            let (a, b) = (w[0].parse::<u16>().ok()?, w[1].parse::<u16>().ok()?);
            (w[2] == "127.0.0.1" && (a..=b).contains(&slot)).then(|| w[3].parse().ok())?
        })
    }

    /// A pool prefix starting with `base` whose `shards` shard tags (`{prefix.s}`) are served
    /// by as many different masters as there are (or shards, if fewer): each shard on a
    /// server of its own where the Cluster allows.
    pub fn spread_prefix(&self, base: &str, shards: u16) -> String {
        let masters = Self::nodes_seen_by(self.nodes[0].port)
            .iter()
            .filter(|n| n.master && n.slots > 0)
            .count()
            .min(usize::from(shards));
        let mut best = (0, base.to_owned());
        for i in 0..1000 {
            let prefix = format!("{base}{i}");
            let owners: std::collections::HashSet<Option<u16>> =
                (0..shards).map(|s| self.master_serving(&format!("{{{prefix}.{s}}}"))).collect();
            if owners.len() > best.0 {
                best = (owners.len(), prefix);
            }
            if best.0 >= masters {
                break;
            }
        }
        best.1
    }

    /// Waits (up to 60 s) until every running node says `cluster_state:ok` and agrees that
    /// every one of the 16,384 slots is served by a master that is not failed.
    ///
    /// # Panics
    ///
    /// When that does not happen in 60 s.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let running: Vec<u16> =
                self.nodes.iter().filter(|n| n.child.is_some()).map(|n| n.port).collect();
            let ok = running.iter().all(|&p| {
                Self::cli(p, &["cluster", "info"]).is_some_and(|i| i.contains("cluster_state:ok"))
                    && Self::nodes_seen_by(p)
                        .iter()
                        .filter(|n| n.master && !n.failed && running.contains(&n.port))
                        .map(|n| n.slots)
                        .sum::<u32>()
                        == 16_384
            });
            if ok {
                return;
            }
            if Instant::now() >= deadline {
                let views: Vec<String> = running
                    .iter()
                    .map(|&p| {
                        format!(
                            "node {p}: {}\n{}",
                            Self::cli(p, &["cluster", "info"])
                                .unwrap_or_default()
                                .lines()
                                .next()
                                .unwrap_or(""),
                            Self::cli(p, &["cluster", "nodes"]).unwrap_or_default()
                        )
                    })
                    .collect();
                let logs: Vec<String> = self
                    .nodes
                    .iter()
                    .filter(|n| n.child.is_some())
                    .map(|n| {
                        let log = n.log();
                        let tail: Vec<&str> = log.lines().rev().take(12).collect();
                        format!(
                            "log of node {}:\n{}",
                            n.port,
                            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                        )
                    })
                    .collect();
                panic!(
                    "the cluster is not ok after 60 s:\n{}\n{}",
                    views.join("\n"),
                    logs.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the node on `port` (SIGKILL); a master's replica is promoted in about the node
    /// timeout (see [`wait_until_ok`](Self::wait_until_ok)).
    pub fn kill(&mut self, port: u16) {
        for n in &mut self.nodes {
            if n.port == port {
                n.kill();
            }
        }
    }

    /// Moves `slots` hash slots from the master `from` to the master `to` (node ids) with
    /// `redis-cli --cluster reshard`, keys and all, while clients run.
    ///
    /// # Panics
    ///
    /// When `redis-cli` fails (its output in the panic).
    pub fn reshard(&self, from: &str, to: &str, slots: u32) {
        let seed = self.nodes.iter().find(|n| n.child.is_some()).expect("a running node").port;
        let out = Command::new("redis-cli")
            .args(["-a", PASSWORD, "--no-auth-warning", "--cluster", "reshard"])
            .arg(format!("127.0.0.1:{seed}"))
            .args(["--cluster-from", from, "--cluster-to", to])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
