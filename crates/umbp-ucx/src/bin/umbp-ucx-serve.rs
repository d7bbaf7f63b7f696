//! `umbp-ucx-serve`: exports a patterned memory region over UCX until its standard input
//! closes, for tests, benchmarks and trying the engine against another node.
//!
//! ```text
//! umbp-ucx-serve [--listen ADDR] [--bytes N] [--fill SEED] [--transports TLS]
//!                [--read-only-bytes N] [--secret-file PATH | --insecure-no-auth]
//!                [--max-clients N] [--handshake-timeout-ms N] [--idle-timeout-ms N]
//!                [--peer-timeout-ms N] [--protection encrypted|authenticated]
//! ```
//!
//! The shared secret comes from `--secret-file` (the file's bytes, a trailing newline
//! dropped) or else from the environment variable `UMBP_UCX_SECRET`; never from the command
//! line, which other users of the machine can read. Without one it refuses to start unless
//! `--insecure-no-auth` says to serve whoever connects; with one (from either place) and
//! `--insecure-no-auth` it refuses to start too, as the library does: the two contradict each
//! other. It listens on 127.0.0.1 unless `--listen` says otherwise.
//!
//! Region 0, `arena`, is writable and holds `--bytes` bytes (default 64 MiB); byte `i` is
//! `fill_byte(SEED, i)` (see [`fill_byte`]). With `--read-only-bytes`, region 1, `ro`, is
//! read-only and filled the same way with `SEED + 1`. Prints `listening ADDR` once serving.

use std::io::{BufRead, Write};

use umbp_ucx::{Protection, ServerBuilder, UcxConfig};

/// Byte `i` of a region filled with `seed`: varies within and across pages.
fn fill_byte(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 12).wrapping_mul(31)).wrapping_add(usize::from(seed)) as u8
}

fn fill(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| fill_byte(seed, i)).collect()
}

fn main() {
    let mut listen = "127.0.0.1:0".to_owned();
    let mut bytes = 64usize << 20;
    let mut read_only = 0usize;
    let mut seed = 0u8;
    let mut config = UcxConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--listen" => listen = value(),
            "--bytes" => bytes = value().parse().unwrap_or_else(|_| usage("--bytes: a number")),
            "--read-only-bytes" => {
                read_only = value().parse().unwrap_or_else(|_| usage("--read-only-bytes: a number"))
            }
            "--fill" => seed = value().parse().unwrap_or_else(|_| usage("--fill: 0..=255")),
            "--transports" => config.transports = Some(value()),
            "--secret-file" => {
                let path = value();
                let mut secret = std::fs::read(&path)
                    .unwrap_or_else(|e| usage(&format!("--secret-file {path}: {e}")));
                if secret.last() == Some(&b'\n') {
                    secret.pop();
                }
                config.token = Some(secret);
            }
            "--insecure-no-auth" => config.insecure_no_auth = true,
            "--max-clients" => {
                config.limits.max_clients =
                    value().parse().unwrap_or_else(|_| usage("--max-clients: a number"))
            }
            "--handshake-timeout-ms" => {
                let ms =
                    value().parse().unwrap_or_else(|_| usage("--handshake-timeout-ms: a number"));
                config.connect_timeout = std::time::Duration::from_millis(ms);
            }
            "--idle-timeout-ms" => {
                let ms = value().parse().unwrap_or_else(|_| usage("--idle-timeout-ms: a number"));
                config.idle_timeout = std::time::Duration::from_millis(ms);
            }
            "--peer-timeout-ms" => {
                let ms = value().parse().unwrap_or_else(|_| usage("--peer-timeout-ms: a number"));
                config.peer_timeout = std::time::Duration::from_millis(ms);
            }
            "--protection" => {
                config.protection = match value().as_str() {
                    "encrypted" => Protection::Encrypted,
                    "authenticated" => Protection::Authenticated,
                    _ => usage("--protection: encrypted or authenticated"),
                }
            }
            "--help" | "-h" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    if config.insecure_no_auth && config.token.is_none() {
        eprintln!(
            "umbp-ucx-serve: serving WITHOUT authentication: whoever reaches {listen} reads \
             and writes the exported regions"
        );
    }
    let mut builder = ServerBuilder::new(config).export("arena", fill(seed, bytes), true);
    if read_only > 0 {
        builder = builder.export("ro", fill(seed.wrapping_add(1), read_only), false);
    }
    let server = builder.serve(listen.as_str()).unwrap_or_else(|e| {
        // The error's words, then its causes'.
        let mut message = format!("umbp-ucx-serve: {e}");
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            message += &format!(": {c}");
            cause = c.source();
        }
        eprintln!("{message}");
        std::process::exit(1);
    });
    println!("listening {}", server.local_addr());
    std::io::stdout().flush().ok();
    // Serve until whoever started us closes our standard input (or exits).
    for _ in std::io::stdin().lock().lines() {}
    drop(server);
}

fn usage(problem: &str) -> ! {
    if !problem.is_empty() {
        eprintln!("umbp-ucx-serve: {problem}");
    }
    eprintln!(
        "usage: umbp-ucx-serve [--listen ADDR] [--bytes N] [--fill SEED] [--transports TLS] \
         [--read-only-bytes N] [--secret-file PATH | --insecure-no-auth] [--max-clients N] \
         [--handshake-timeout-ms N] [--idle-timeout-ms N] [--peer-timeout-ms N] \
         [--protection encrypted|authenticated]"
    );
    std::process::exit(if problem.is_empty() { 0 } else { 2 })
}
