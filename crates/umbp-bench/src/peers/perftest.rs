//! `ucx_perftest`, UCX's own benchmark, as the reference of `umbp-bench remote`: its client
//! (one run, its `Final:` bandwidth read back) and a server that stays up for many runs.
//!
//! **What the figure is.** `ucx_perftest` prints, per second and once at the end, a row of
//! eight numbers: iterations, latency (percentile, average, overall) in µs, bandwidth (average,
//! overall) in MB/s, message rate (average, overall) in messages/s. The figure taken is the
//! `Final:` row's *overall* bandwidth (the whole timed run, warm-up excluded). Its "MB" is 2^20
//! bytes: ucx_perftest computes it as bytes / 2^20 per second, which the parser checks on
//! every run against the overall message rate times the message size (the two must agree to
//! within 1 %, else the output is refused as not understood).
//!
//! **One server per run.** A `ucx_perftest -p PORT` server serves one client run and exits,
//! so [`PerftestServer`] restarts it after every run until it is dropped, and the client
//! retries for a while when the server is between runs (connection refused).

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// The program's name, looked up on `PATH`.
pub const PROGRAM: &str = "ucx_perftest";

/// How long a client keeps retrying while the server is not (yet, or again) listening.
const CONNECT_RETRY: Duration = Duration::from_secs(10);

/// Whether `ucx_perftest` runs here; `Err` says why not.
pub fn available() -> Result<(), String> {
    match Command::new(PROGRAM).arg("-h").stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("`{PROGRAM} -h` failed ({status})")),
        Err(e) => Err(format!("{PROGRAM} is not installed ({e}); it comes with ucx-utils")),
    }
}

/// One client run: a `ucp_get` bandwidth test of `size`-byte messages.
#[derive(Clone, Debug)]
pub struct GetRun<'a> {
    /// The server's host (its `ucx_perftest -p PORT` must be running).
    pub host: &'a str,
    /// The server's port.
    pub port: u16,
    /// `UCX_TLS` for the client (the server's must allow the same).
    pub transports: &'a str,
    /// Bytes per get (`-s`).
    pub size: u64,
    /// Timed gets (`-n`).
    pub iterations: u64,
    /// Gets before timing (`-w`).
    pub warmup: u64,
    /// Gets in flight at most (`-O`).
    pub outstanding: usize,
    /// How long the run may take before it is killed.
    pub timeout: Duration,
}

impl GetRun<'_> {
    /// The client's arguments, as run.
    pub fn args(&self) -> Vec<String> {
        vec![
            self.host.to_owned(),
            "-p".into(),
            self.port.to_string(),
            "-t".into(),
            "ucp_get".into(),
            "-s".into(),
            self.size.to_string(),
            "-n".into(),
            self.iterations.to_string(),
            "-w".into(),
            self.warmup.to_string(),
            "-O".into(),
            self.outstanding.to_string(),
        ]
    }

    /// Runs the client (retrying while the server is not listening) and returns the overall
    /// bandwidth in bytes per second.
    pub fn run(&self) -> anyhow::Result<f64> {
        let started = Instant::now();
        loop {
            let output = self.run_once()?;
            if output.contains("connect() failed") && started.elapsed() < CONNECT_RETRY {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            return parse_final(&output, self.size).with_context(|| {
                format!("{PROGRAM} {} said: {}", self.args().join(" "), last_lines(&output, 3))
            });
        }
    }

    /// One attempt: stdout and stderr together.
    fn run_once(&self) -> anyhow::Result<String> {
        let mut child = Command::new(PROGRAM)
            .args(self.args())
            .env("UCX_TLS", self.transports)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {PROGRAM}"))?;
        let readers = [
            drain(child.stdout.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
            drain(child.stderr.take().map(|s| Box::new(s) as Box<dyn Read + Send>)),
        ];
        let deadline = Instant::now() + self.timeout;
        let status = loop {
            if let Some(status) = child.try_wait().context("waiting for ucx_perftest")? {
                break Some(status);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut output = String::new();
        for reader in readers {
            output += &reader.join().unwrap_or_default();
        }
        if status.is_none() {
            bail!(
                "{PROGRAM} {} ran past {:?} and was killed; it said: {}",
                self.args().join(" "),
                self.timeout,
                last_lines(&output, 3)
            );
        }
        Ok(output)
    }
}

/// Reads `from` to the end on a thread.
fn drain(from: Option<Box<dyn Read + Send>>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut from) = from {
            let mut bytes = Vec::new();
            let _ = from.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    })
}

/// The last `n` non-empty lines of `text`, joined on one line.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The overall bandwidth of the `Final:` row of `ucx_perftest`'s output, in bytes per second,
/// checked against the overall message rate times `message_size` (see the
/// [module docs](self)).
pub fn parse_final(output: &str, message_size: u64) -> anyhow::Result<f64> {
    if !output.contains("bandwidth (MB/s)") {
        bail!("no `bandwidth (MB/s)` header in the output");
    }
    let Some(line) = output.lines().find_map(|l| l.trim_start().strip_prefix("Final:")) else {
        bail!("no `Final:` row in the output");
    };
    let numbers: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("the `Final:` row is not eight numbers: {}", line.trim()))?;
    let [_iterations, _lat50, _lat_avg, _lat_all, _bw_avg, bw_overall, _rate_avg, rate_overall] =
        numbers[..]
    else {
        bail!("the `Final:` row has {} numbers, not eight: {}", numbers.len(), line.trim());
    };
    let bytes_per_s = bw_overall * f64::from(1u32 << 20);
    let from_rate = rate_overall * message_size as f64;
    // The rate is printed as a whole number: allow its rounding on top of 1 %.
    let tolerance = 0.01 * from_rate.max(bytes_per_s) + message_size as f64;
    if !(bw_overall > 0.0 && (bytes_per_s - from_rate).abs() <= tolerance) {
        bail!(
            "the overall bandwidth ({bw_overall} MB/s) does not match the overall message rate \
             ({rate_overall}/s) times {message_size} B with MB = 2^20 B"
        );
    }
    Ok(bytes_per_s)
}

/// A `ucx_perftest -p PORT` server kept running for one client run after another, until
/// dropped. Its output is discarded.
#[derive(Debug)]
pub struct PerftestServer {
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<Child>>>,
    thread: Option<JoinHandle<()>>,
}

impl PerftestServer {
    /// Starts serving on `port` with `UCX_TLS=transports` (none: the environment's). Fails
    /// when `ucx_perftest` does not run.
    pub fn start(port: u16, transports: Option<&str>) -> anyhow::Result<Self> {
        available().map_err(anyhow::Error::msg)?;
        let stop = Arc::new(AtomicBool::new(false));
        let current: Arc<Mutex<Option<Child>>> = Arc::new(Mutex::new(None));
        let transports = transports.map(str::to_owned);
        let thread = {
            let (stop, current) = (Arc::clone(&stop), Arc::clone(&current));
            std::thread::Builder::new()
                .name("perftest-server".into())
                .spawn(move || serve(port, transports.as_deref(), &stop, &current))
                .context("starting the ucx_perftest server thread")?
        };
        Ok(Self { stop, current, thread: Some(thread) })
    }
}

/// Starts one server after another until `stop`.
fn serve(port: u16, transports: Option<&str>, stop: &AtomicBool, current: &Mutex<Option<Child>>) {
    let mut quick_failures = 0u32;
    while !stop.load(Ordering::Acquire) {
        let mut command = Command::new(PROGRAM);
        command
            .args(["-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(tls) = transports {
            command.env("UCX_TLS", tls);
        }
        let started = Instant::now();
        {
            let mut slot = current.lock().unwrap_or_else(PoisonError::into_inner);
            if stop.load(Ordering::Acquire) {
                return;
            }
            match command.spawn() {
                Ok(child) => *slot = Some(child),
                Err(e) => {
                    eprintln!("umbp-bench serve: cannot start {PROGRAM}: {e}");
                    return;
                }
            }
        }
        let status = loop {
            let mut slot = current.lock().unwrap_or_else(PoisonError::into_inner);
            match slot.as_mut().map(Child::try_wait) {
                Some(Ok(None)) => {}
                Some(Ok(Some(status))) => {
                    *slot = None;
                    break Some(status);
                }
                Some(Err(_)) | None => {
                    *slot = None;
                    break None;
                }
            }
            drop(slot);
            std::thread::sleep(Duration::from_millis(10));
        };
        // A server that fails at once (its port taken, UCX refusing the transports) would
        // spin: back off, and say so once.
        if status.is_some_and(|s| !s.success()) && started.elapsed() < Duration::from_secs(1) {
            quick_failures += 1;
            if quick_failures == 3 {
                eprintln!(
                    "umbp-bench serve: `{PROGRAM} -p {port}` keeps failing at once (port taken, \
                     or transports refused?); retrying"
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        } else {
            quick_failures = 0;
        }
    }
}

impl Drop for PerftestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(mut child) = self.current.lock().unwrap_or_else(PoisonError::into_inner).take()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client's output from UCX 1.13.1 (`ucx_perftest 127.0.0.1 -p 13401 -t ucp_get -s 65536
    /// -n 20000 -w 1000 -O 256`, UCX_TLS=tcp), trimmed.
    const OUTPUT: &str = "\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |        latency (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
[thread 0]             12540     69.501    79.726    79.726      783.94     783.94       12543       12543
Final:                 20000     74.221    72.953    77.199      856.72     809.59       13708       12953
| Message size: 65536                                                                                      |
";

    #[test]
    fn the_final_overall_bandwidth_is_read_in_mebibytes() {
        let bytes_per_s = parse_final(OUTPUT, 65536).unwrap();
        assert_eq!(bytes_per_s, 809.59 * 1048576.0);
        // 12953 messages/s of 64 KiB are 809.56 MiB/s: the MB is 2^20 bytes, not 10^6.
        assert!(parse_final(&OUTPUT.replace("809.59", "848.92"), 65536).is_err());
    }

    #[test]
    fn output_without_a_final_row_is_refused() {
        assert!(parse_final("connect() failed: Connection refused", 65536).is_err());
        let no_final = OUTPUT.replace("Final:", "Total:");
        assert!(parse_final(&no_final, 65536).is_err());
        let short = OUTPUT.replace("12953\n", "\n");
        assert!(parse_final(&short, 65536).is_err());
    }

    #[test]
    fn the_client_arguments_are_the_documented_ones() {
        let run = GetRun {
            host: "127.0.0.1",
            port: 13337,
            transports: "tcp",
            size: 65536,
            iterations: 100,
            warmup: 10,
            outstanding: 256,
            timeout: Duration::from_secs(1),
        };
        assert_eq!(
            run.args().join(" "),
            "127.0.0.1 -p 13337 -t ucp_get -s 65536 -n 100 -w 10 -O 256"
        );
    }
}
