//! The `umbp-ucx-serve` memory node as a service: its flags and configuration file, its
//! drain on SIGTERM under load, its logs and its `/metrics`.

#[path = "support/pool.rs"]
mod pool_support;
mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_plan::{EndpointRegistry, Fragment, PlanBuilder, Register, Tag, TransferEngine};
use umbp_remote::{PeerInfo, RemoteConfig, RemoteEngine};

use pool_support::Node;
use support::{engine, ucx_or_skip, SECRET};
use umbp_memory_node::serve::fill_byte;

const SERVE: &str = env!("CARGO_BIN_EXE_umbp-ucx-serve");

/// Runs the command to its end with `args` and no secret in the environment.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(SERVE)
        .args(args)
        .env_remove(umbp_remote::SECRET_ENV)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.stdout.is_empty() || args.contains(&"--help"), "it served: {out:?}");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code(), text)
}

#[test]
fn help_lists_every_flag_with_its_words() {
    let (code, help) = run(&["--help"]);
    assert_eq!(code, Some(0), "{help}");
    let flags = [
        "--config",
        "--listen",
        "--region",
        "--secret-file",
        "--insecure-no-auth",
        "--protection",
        "--transports",
        "--congestion",
        "--idle-timeout-ms",
        "--peer-timeout-ms",
        "--handshake-timeout-ms",
        "--max-clients",
        "--max-clients-per-ip",
        "--metrics",
        "--drain-timeout-ms",
        "--exit-on-stdin-close",
        "--pool",
        "--pool-password-file",
        "--pool-name",
        "--node-id",
        "--advertise",
        "--pool-slot-size",
        "--pool-ttl-ms",
        "--bytes",
        "--read-only-bytes",
        "--fill",
        "--help",
        "--version",
    ];
    for flag in flags {
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "{flag}"
        );
    }
    // Every flag the help lists is one of those, and each has its words under it.
    let listed: Vec<&str> = help
        .lines()
        .map(|l| l.trim_start())
        // `-h, --help`: the long name.
        .map(|l| if l.len() > 4 && &l[2..4] == ", " { &l[4..] } else { l })
        .filter_map(|l| l.strip_prefix("--").map(|f| f.split([' ', '<']).next().unwrap()))
        .collect();
    assert_eq!(listed.len(), flags.len(), "{listed:?}");
    let lines: Vec<&str> = help.lines().collect();
    for flag in &listed {
        let at = lines
            .iter()
            .position(|l| {
                l.trim_start().starts_with(&format!("--{flag}"))
                    || l.contains(&format!(", --{flag}"))
            })
            .unwrap();
        let words = lines.get(at + 1).copied().unwrap_or_default();
        assert!(words.trim().len() > 10, "--{flag} has no words: {words:?}");
    }
}

#[test]
fn bad_flags_and_configuration_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    // A size parse-size does not read.
    let (code, text) = run(&["--region", "kv=64XB"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("--region") && text.contains("64XB") && text.contains("not a size"),
        "{text}"
    );
    // No region.
    let (code, text) = run(&["--insecure-no-auth"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("no region to serve"), "{text}");
    // An unknown key in the file, named with its line.
    let file = dir.path().join("node.toml");
    std::fs::write(&file, "listen = \"127.0.0.1:0\"\nidle_timeout = 5\n").unwrap();
    let (code, text) = run(&["--config", file.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("node.toml") && text.contains("idle_timeout") && text.contains("line 2"),
        "{text}"
    );
    // A bad size in the file, named with its region.
    std::fs::write(&file, "[[region]]\nname = \"kv\"\nsize = \"lots\"\n").unwrap();
    let (code, text) = run(&["--config", file.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("region `kv`") && text.contains("`lots` is not a size"), "{text}");
    // A secret file other users may read.
    let secret = dir.path().join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, text) = run(&["--region", "kv=1MiB", "--secret-file", secret.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("readable by other users") && text.contains("chmod 600"), "{text}");
    // A secret file and --insecure-no-auth: the library's refusal, status 1.
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, text) = run(&[
        "--region",
        "kv=1MiB",
        "--secret-file",
        secret.to_str().unwrap(),
        "--insecure-no-auth",
    ]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("insecure_no_auth"), "{text}");
    // A congestion control that cannot be an algorithm's name: status 2; one the kernel does
    // not have: the library's refusal at start, status 1. Both name the setting.
    let (code, text) = run(&["--region", "kv=1MiB", "--congestion", "cubic;ls"]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.contains("--congestion") && text.contains("cubic;ls"), "{text}");
    let (code, text) =
        run(&["--region", "kv=1MiB", "--insecure-no-auth", "--congestion", "no-such-cc"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("congestion") && text.contains("no-such-cc"), "{text}");
}

/// Starts `umbp-ucx-serve` on a fresh loopback port with `args` (the pool tests' launcher).
fn start(args: &[&str]) -> Node {
    let all: Vec<String> =
        ["--listen", "127.0.0.1:0"].iter().chain(args).map(|a| a.to_string()).collect();
    Node::start(&all).unwrap_or_else(|(code, log)| panic!("the node exited ({code:?}): {log}"))
}

/// Reads `len` bytes of region `name` of `peer` from `offset`: the bytes, or the failure.
fn get(
    engine: &RemoteEngine,
    peer: &PeerInfo,
    name: &str,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, String> {
    let region = peer.region(name).unwrap();
    let remote = engine.register_remote(region.region, 0, region.len).map_err(|e| e.to_string())?;
    let local = engine.register_memory(vec![0xA5u8; len]).map_err(|e| e.to_string())?;
    let mut builder = engine.incremental_builder();
    let tag = Tag::new(0);
    builder.begin_object(tag).unwrap();
    builder.push(Fragment::new(remote.id(), offset, local.id(), 0, len as u64, tag)).unwrap();
    builder.commit_object().unwrap();
    let mut handle = engine.submit(builder.finish().unwrap());
    let failed = format!("{:?}", handle.wait());
    let ok = handle.wait().is_empty();
    drop(handle);
    let bytes = local.deregister();
    if ok {
        Ok(bytes)
    } else {
        Err(failed)
    }
}

/// SIGTERM while a client restores in a loop: the server drains and exits 0 well within the
/// bound (a never-settles signal), and every get either completed byte-exact or failed as a
/// reported failure (none hangs, none returns wrong bytes).
#[test]
fn sigterm_under_load_drains_and_exits_zero() {
    if !ucx_or_skip() {
        return;
    }
    const LEN: usize = 8 << 20;
    let mut node = start(&["--bytes", "8MiB", "--fill", "5", "--drain-timeout-ms", "3000"]);
    let engine = Arc::new(engine("tcp"));
    let peer = engine.connect(node.addr).unwrap();
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    let loader = {
        let engine = Arc::clone(&engine);
        std::thread::spawn(move || {
            let expected: Vec<u8> = (0..LEN).map(|i| fill_byte(5, i)).collect();
            let (mut completed, mut failures) = (0u32, Vec::new());
            let started = Instant::now();
            while failures.is_empty() && started.elapsed() < Duration::from_secs(60) {
                match get(&engine, &peer, "arena", 0, LEN) {
                    Ok(bytes) => {
                        assert!(bytes == expected, "a completed get returned other bytes");
                        completed += 1;
                        let _ = first_tx.send(());
                    }
                    Err(failed) => failures.push(failed),
                }
            }
            (completed, failures)
        })
    };
    first_rx.recv_timeout(Duration::from_secs(30)).expect("a first get completes");
    let status = node.signal(libc::SIGTERM, Duration::from_secs(10));
    let log = node.log();
    assert!(status.is_some(), "still running 10 s after SIGTERM; log: {log}");
    assert_eq!(status.unwrap().code(), Some(0), "{log}");
    let (completed, failures) = loader.join().expect("every get settled");
    eprintln!("{completed} gets completed; then {failures:?}");
    assert!(completed >= 1);
    assert_eq!(failures.len(), 1, "the loop stops at the first failure");
    assert!(log.contains("draining on a signal") && log.contains("stopped"), "{log}");
    assert!(log.contains("client disconnected") && log.contains("reason=\"shutdown\""), "{log}");
}

/// `GET /metrics` over HTTP.
fn scrape(at: SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(at).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_owned(), body.to_owned())
}

/// The value of the metric line that starts with `name ` (labels included in `name`).
fn value(body: &str, name: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {name} in\n{body}"))
        .parse()
        .unwrap()
}

/// After a client's restore, `/metrics` counts it: the client connected, the bytes and
/// requests it read, a stranger's refused handshake, then the client's session closed; each
/// client's coming and going and the stranger's refusal are one log line with its address.
#[test]
fn metrics_count_a_clients_restore_and_the_log_names_each_client() {
    if !ucx_or_skip() {
        return;
    }
    let node = start(&["--bytes", "4MiB", "--fill", "2", "--metrics", "127.0.0.1:0"]);
    let at = node.metrics.expect("a metrics address");
    let (status, body) = scrape(at, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK");
    assert_eq!(value(&body, "umbp_ucx_serve_requests_total"), 0);
    assert_eq!(
        value(&body, "umbp_ucx_serve_region_bytes{region=\"arena\",writable=\"true\"}"),
        4 << 20
    );

    let client = engine("tcp");
    let peer = client.connect(node.addr).unwrap();
    let bytes = get(&client, &peer, "arena", 4096, 1 << 20).unwrap();
    assert!(bytes.iter().enumerate().all(|(i, &b)| b == fill_byte(2, 4096 + i)));
    let stranger = RemoteEngine::new(
        EndpointRegistry::new(),
        RemoteConfig {
            transports: Some("tcp".into()),
            secret: Some(b"another secret of 32 bytes here!".to_vec()),
            ..RemoteConfig::default()
        },
    )
    .unwrap();
    let refused = stranger.connect(node.addr).unwrap_err();
    let words = format!("{refused:#}")
        + &std::error::Error::source(&refused).map(|s| s.to_string()).unwrap_or_default();
    assert!(
        words.contains(
            "authentication failed (wrong or missing secret on this side or the server's)"
        ),
        "{words}"
    );

    let (_, body) = scrape(at, "/metrics");
    // One client, connected over the default lanes.
    let lanes = RemoteConfig::default().lanes as u64;
    assert_eq!(value(&body, "umbp_ucx_serve_clients_connected"), lanes);
    assert_eq!(value(&body, "umbp_ucx_serve_bytes_read_total"), 1 << 20);
    assert_eq!(value(&body, "umbp_ucx_serve_bytes_written_total"), 0);
    assert!(value(&body, "umbp_ucx_serve_requests_total") >= 1, "{body}");
    assert_eq!(value(&body, "umbp_ucx_serve_handshakes_refused_total{reason=\"wrong_secret\"}"), 1);
    assert_eq!(scrape(at, "/other").0, "HTTP/1.1 404 Not Found");
    // The responder is bounded: a request past 8 KiB is refused, and a client that connects and
    // says nothing holds it for its 2 s timeout at most (10 s: a never-settles signal).
    let mut long = TcpStream::connect(at).unwrap();
    long.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = long.write_all(&[b'x'; 10 << 10]);
    let mut answer = String::new();
    let _ = long.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
    let _silent = TcpStream::connect(at).unwrap();
    let started = Instant::now();
    assert_eq!(scrape(at, "/metrics").0, "HTTP/1.1 200 OK");
    assert!(started.elapsed() < Duration::from_secs(10), "a silent client held /metrics");

    drop(peer);
    drop(client);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = scrape(at, "/metrics");
        if value(&body, "umbp_ucx_serve_sessions_closed_total{reason=\"left\"}") == lanes {
            assert_eq!(value(&body, "umbp_ucx_serve_clients_connected"), 0);
            break;
        }
        assert!(Instant::now() < until, "the session never closed:\n{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = node.log();
    let lines = |what: &str| {
        log.lines().filter(|l| l.contains(what) && l.contains("peer=127.0.0.1:")).count()
    };
    assert_eq!(lines("client connected") as u64, lanes, "{log}");
    assert_eq!(lines("client disconnected") as u64, lanes, "{log}");
    assert_eq!(lines("authentication failed"), 1, "{log}");
}

/// SIGINT drains as SIGTERM does: an idle node exits 0 (within 10 s: a never-settles signal).
#[test]
fn sigint_stops_an_idle_node_with_status_zero() {
    if !ucx_or_skip() {
        return;
    }
    let mut node = start(&["--region", "kv=1MiB", "--region", "ro=64KiB:ro"]);
    let client = engine("tcp");
    let peer = client.connect(node.addr).unwrap();
    let regions: Vec<_> =
        peer.regions.iter().map(|r| (r.name.clone(), r.len, r.writable)).collect();
    assert_eq!(regions, [("kv".to_owned(), 1 << 20, true), ("ro".to_owned(), 64 << 10, false)]);
    // SAFETY: kill(2) on our own child's pid, which it still is (not yet waited for).
    #[allow(unsafe_code)]
    let sent = unsafe { libc::kill(node.child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(sent, 0);
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = node.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < until, "still running 10 s after SIGINT: {}", node.log());
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(0), "{}", node.log());
}
/// `umbp-ucx-serve --insecure-no-auth` with a secret set refuses to start, as the library
/// does: the two contradict each other.
#[test]
fn the_serve_command_refuses_a_secret_and_the_insecure_flag_together() {
    let out = Command::new(SERVE)
        .args(["--insecure-no-auth", "--bytes", "4096", "--listen", "127.0.0.1:0"])
        .env(umbp_remote::SECRET_ENV, SECRET)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(out.stdout.is_empty(), "it served: {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains("insecure_no_auth"), "{stderr}");
    // Without the secret it serves (insecure, and says so).
    let mut child = Command::new(SERVE)
        .args(["--insecure-no-auth", "--bytes", "4096", "--listen", "127.0.0.1:0"])
        .arg("--exit-on-stdin-close")
        .env_remove(umbp_remote::SECRET_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("listening "), "{line}");
    drop(child.stdin.take());
    child.wait().unwrap();
}
