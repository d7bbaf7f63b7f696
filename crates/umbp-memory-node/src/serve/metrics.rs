//! `GET /metrics` in Prometheus' text format, on one thread.
//!
//! Hand-written on `std::net::TcpListener` rather than an HTTP crate: it answers one path to a
//! scraper, one request per connection, so the whole of HTTP it needs is a request line; a
//! server crate would bring a thread pool and a dependency tree for that. It stays robust by
//! bounding everything a client controls: a request is read for at most
//! [`REQUEST_TIMEOUT`] and [`MAX_REQUEST`] bytes, the answer written within the same timeout,
//! and one connection is served at a time (a scraper polls every few seconds), so a stalled
//! client delays the next scrape by at most the timeout and costs nothing else.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{MembershipSnapshot, MembershipState, MembershipStats};
use umbp_remote::{ServerStats, StatsSnapshot};

/// The most bytes of a request read (its line and headers).
const MAX_REQUEST: usize = 8 << 10;
/// How long one connection may take to send its request and read the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The exported regions, for `umbp_ucx_serve_region_bytes`.
pub(crate) type Regions = Vec<(String, u64, bool)>;

/// Serves `/metrics` on `listener` until `stop`; one connection at a time.
pub(crate) fn serve(
    listener: TcpListener,
    stats: ServerStats,
    pool: Option<MembershipStats>,
    regions: Regions,
    stop: Arc<AtomicBool>,
) {
    // Non-blocking accepts, so that `stop` is seen within a tick.
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "metrics listener; not serving metrics");
        return;
    }
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if let Err(e) = answer(stream, &stats, pool.as_ref(), &regions) {
                    tracing::debug!(%peer, error = %e, "metrics request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Reads one request and answers it: 200 with the metrics for `GET /metrics`, 404 for
/// another path, 405 for another method, 400 for anything else.
fn answer(
    mut stream: TcpStream,
    stats: &ServerStats,
    pool: Option<&MembershipStats>,
    regions: &Regions,
) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
    let mut request = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && !request.windows(2).any(|w| w == b"\n\n")
    {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
        if request.len() > MAX_REQUEST {
            return respond(&mut stream, "431 Request Header Fields Too Large", "too long\n");
        }
    }
    let line = request.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("GET"), Some(path)) if path == "/metrics" || path.starts_with("/metrics?") => {
            let mut body = render(&stats.read(), regions);
            if let Some(pool) = pool {
                render_pool(&mut body, &pool.read(), regions);
            }
            respond(&mut stream, "200 OK", &body)
        }
        (Some("GET"), Some(_)) => respond(&mut stream, "404 Not Found", "only /metrics here\n"),
        (Some(_), Some(_)) => respond(&mut stream, "405 Method Not Allowed", "GET only\n"),
        _ => respond(&mut stream, "400 Bad Request", "not an HTTP request\n"),
    }
}

fn respond(stream: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// The counters in Prometheus' text exposition format (0.0.4).
pub(crate) fn render(s: &StatsSnapshot, regions: &Regions) -> String {
    let mut out = String::new();
    let mut one = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    };
    one(
        "umbp_ucx_serve_clients_connected",
        "gauge",
        "Authenticated clients connected now.",
        s.clients_connected,
    );
    one(
        "umbp_ucx_serve_clients_admitted_total",
        "counter",
        "Clients authenticated and served since start.",
        s.clients_admitted,
    );
    one(
        "umbp_ucx_serve_bytes_read_total",
        "counter",
        "Bytes clients read out of the regions (gets).",
        s.bytes_sent,
    );
    one(
        "umbp_ucx_serve_bytes_written_total",
        "counter",
        "Bytes clients wrote into the regions (puts).",
        s.bytes_received,
    );
    one(
        "umbp_ucx_serve_requests_total",
        "counter",
        "Gets and puts served whole on the checked path.",
        s.requests,
    );
    let mut by = |name: &str, help: &str, values: &[(&str, u64)]| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (reason, value) in values {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {value}");
        }
    };
    by(
        "umbp_ucx_serve_handshakes_refused_total",
        "Handshakes refused or closed, by reason.",
        &s.handshakes_refused,
    );
    by(
        "umbp_ucx_serve_sessions_closed_total",
        "Client sessions ended, by reason.",
        &s.sessions_closed,
    );
    let _ = writeln!(
        out,
        "# HELP umbp_ucx_serve_region_bytes Size of each exported region.\n\
         # TYPE umbp_ucx_serve_region_bytes gauge"
    );
    for (name, len, writable) in regions {
        let name = name.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let _ = writeln!(
            out,
            "umbp_ucx_serve_region_bytes{{region=\"{name}\",writable=\"{writable}\"}} {len}"
        );
    }
    out
}

/// Escapes a label value.
fn label(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The pool membership's lines, appended to `out`.
pub(crate) fn render_pool(out: &mut String, m: &MembershipSnapshot, regions: &Regions) {
    let _ = writeln!(
        out,
        "# HELP umbp_ucx_serve_pool_member Whether the node is in the pool now (announced, last \
         renewal succeeded).\n# TYPE umbp_ucx_serve_pool_member gauge\n\
         umbp_ucx_serve_pool_member{{node=\"{}\",address=\"{}\"}} {}",
        m.node,
        label(&m.address),
        u8::from(m.state == MembershipState::Joined)
    );
    let _ = writeln!(
        out,
        "# HELP umbp_ucx_serve_pool_state The node's pool membership state (1 for the current \
         one).\n# TYPE umbp_ucx_serve_pool_state gauge"
    );
    for s in [
        MembershipState::Joined,
        MembershipState::Lapsing,
        MembershipState::Expired,
        MembershipState::Left,
    ] {
        let _ = writeln!(
            out,
            "umbp_ucx_serve_pool_state{{state=\"{}\"}} {}",
            s.name(),
            u8::from(m.state == s)
        );
    }
    let _ = writeln!(
        out,
        "# HELP umbp_ucx_serve_pool_announcements_total Announcements made (the join and every \
         renewal).\n# TYPE umbp_ucx_serve_pool_announcements_total counter\n\
         umbp_ucx_serve_pool_announcements_total {}\n\
         # HELP umbp_ucx_serve_pool_announce_failures_total Renewals that failed (the index \
         unreachable).\n# TYPE umbp_ucx_serve_pool_announce_failures_total counter\n\
         umbp_ucx_serve_pool_announce_failures_total {}",
        m.announcements, m.failures
    );
    let _ = writeln!(
        out,
        "# HELP umbp_ucx_serve_pool_free_bytes Free bytes of each tier, as last announced.\n\
         # TYPE umbp_ucx_serve_pool_free_bytes gauge"
    );
    for (tier, free) in &m.free_bytes {
        let region = regions.get(usize::from(tier.0)).map_or("", |r| r.0.as_str());
        let _ = writeln!(
            out,
            "umbp_ucx_serve_pool_free_bytes{{tier=\"{}\",region=\"{}\"}} {free}",
            tier,
            label(region)
        );
    }
}
