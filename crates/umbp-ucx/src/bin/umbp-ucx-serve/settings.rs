//! The command line, the configuration file, and the settings the two make (flags override
//! the file).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde::Deserialize;
use umbp_ucx::{Protection, UcxConfig};

/// Serve this node's memory to other nodes' umbp engines over UCX: a memory node.
///
/// Each region is host memory of this process, named, zeroed at start, readable by every
/// authenticated client and writable unless marked read-only. Clients prove they hold the
/// shared secret (`--secret-file`, or the environment variable UMBP_UCX_SECRET); the
/// connection after that is sealed (`--protection`).
///
/// Settings come from `--config FILE` (TOML; see docs/MEMORY-NODE.md) and the flags, a flag
/// overriding the file's key of the same name (`--region` flags replace the file's regions).
/// Prints `listening ADDR` on standard output once serving; logs go to standard error
/// (filtered by RUST_LOG, default `info`). SIGTERM or SIGINT drains: the listener closes,
/// requests in progress finish (up to `--drain-timeout-ms`), then it exits 0; a second
/// signal exits at once (status 1).
#[derive(Debug, Parser)]
#[command(name = "umbp-ucx-serve", version)]
pub(crate) struct Args {
    /// A TOML configuration file (its keys are the flags' long names with `_` for `-`, and
    /// `[[region]]` tables with `name`, `size` and `read_only`). Unknown keys are refused.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,

    /// The address to listen on: the interface the compute nodes reach (default
    /// 127.0.0.1:7400; port 0 picks a free one).
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<String>,

    /// A region to export: NAME=SIZE, `:ro` appended for read-only (`kv=64GiB`,
    /// `prefix=1GiB:ro`). Sizes as everywhere in umbp: `64K` is 64,000 bytes, `64KiB`
    /// 65,536. Repeat for several; regions are numbered in order.
    #[arg(long = "region", value_name = "NAME=SIZE[:ro]", value_parser = parse_region)]
    pub(crate) regions: Vec<RegionSpec>,

    /// The file holding the shared secret (16 to 4096 bytes; one trailing newline dropped).
    /// Refused when other users may read it (chmod 600). Without it: UMBP_UCX_SECRET.
    #[arg(long, value_name = "PATH")]
    pub(crate) secret_file: Option<PathBuf>,

    /// Serve whoever connects, without authentication: anyone who reaches the port reads
    /// every region and writes the writable ones. Refused together with a secret.
    #[arg(long)]
    pub(crate) insecure_no_auth: bool,

    /// What protects each session after the handshake: `encrypted` (AES-256-GCM) or
    /// `authenticated` (keyed BLAKE3 tags, bytes in the clear). A session is encrypted when
    /// either side asks. Default: encrypted.
    #[arg(long, value_name = "MODE")]
    pub(crate) protection: Option<ProtectionArg>,

    /// UCX transports (UCX_TLS's syntax: `tcp`, `rc`...). Only RDMA transports alone give
    /// clients one-sided access; anything else is served on the checked path.
    #[arg(long, value_name = "TLS")]
    pub(crate) transports: Option<String>,

    /// Close a client's session when nothing (not even a heartbeat) arrived for this long,
    /// in milliseconds (default 10000).
    #[arg(long, value_name = "MS")]
    pub(crate) idle_timeout_ms: Option<u64>,

    /// Close a client's session when it leaves one answer unread this long, in milliseconds
    /// (default 5000).
    #[arg(long, value_name = "MS")]
    pub(crate) peer_timeout_ms: Option<u64>,

    /// Close a connection whose handshake is not done within this long, in milliseconds
    /// (default 10000).
    #[arg(long, value_name = "MS")]
    pub(crate) handshake_timeout_ms: Option<u64>,

    /// Clients served at once (default 64).
    #[arg(long, value_name = "N")]
    pub(crate) max_clients: Option<usize>,

    /// Clients from one IP address served at once (default 16).
    #[arg(long, value_name = "N")]
    pub(crate) max_clients_per_ip: Option<usize>,

    /// Serve Prometheus metrics at http://ADDR/metrics (default: none). Keep it on an
    /// address only the monitoring reaches.
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<String>,

    /// On SIGTERM or SIGINT, how long requests in progress may take to finish before the
    /// remaining sessions are cut, in milliseconds (default 5000).
    #[arg(long, value_name = "MS")]
    pub(crate) drain_timeout_ms: Option<u64>,

    /// Also drain and exit when standard input closes (for a parent process that holds a
    /// pipe to it: its death stops the server).
    #[arg(long)]
    pub(crate) exit_on_stdin_close: bool,

    /// Test pattern (tests and benchmarks): a writable region `arena` of this size whose byte
    /// i is a function of i and `--fill`, exported before the `--region` ones.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub(crate) bytes: Option<u64>,

    /// Test pattern: a read-only region `ro` of this size, filled with the seed `--fill` + 1,
    /// exported after `arena`.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub(crate) read_only_bytes: Option<u64>,

    /// Test pattern: the seed of `arena`'s bytes (0 to 255, default 0).
    #[arg(long, value_name = "SEED")]
    pub(crate) fill: Option<u8>,
}

/// `--protection`'s values.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ProtectionArg {
    /// AES-256-GCM: an observer sees no byte of the regions.
    Encrypted,
    /// Keyed BLAKE3 tags: the bytes travel in the clear, changed ones are refused.
    Authenticated,
}

/// One region to export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RegionSpec {
    pub(crate) name: String,
    pub(crate) size: u64,
    pub(crate) read_only: bool,
    /// The test pattern's seed; `None`: zeroed.
    pub(crate) fill: Option<u8>,
}

/// What stops the server from starting; printed with its causes, exit status 2.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettingsError {
    /// The configuration file could not be read.
    #[error("config file {path}: {source}")]
    ReadConfig { path: PathBuf, source: std::io::Error },
    /// The configuration file is not valid TOML or has a key this version does not know.
    #[error("config file {path}: {message}")]
    ParseConfig { path: PathBuf, message: String },
    /// A size that parse-size does not read.
    #[error("{what}: `{value}` is not a size ({reason}; e.g. 64GiB, 512MiB, 4096)")]
    BadSize { what: String, value: String, reason: String },
    /// A region that cannot be served as given.
    #[error("region `{name}`: {reason}")]
    BadRegion { name: String, reason: String },
    /// No region at all.
    #[error("no region to serve: give one with --region NAME=SIZE (or [[region]] in --config)")]
    NoRegion,
    /// The secret file could not be read.
    #[error("secret file {path}: {source}")]
    ReadSecret { path: PathBuf, source: std::io::Error },
    /// The secret file may be read by other users.
    #[error(
        "secret file {path} is readable by other users (mode {mode:04o}): make it private \
         (chmod 600, owned by the user the server runs as) or pass it as a systemd credential"
    )]
    SecretExposed { path: PathBuf, mode: u32 },
}

/// A size as everywhere in umbp: a number with an optional unit (`parse-size`).
pub(crate) fn parse_size_text(what: &str, value: &str) -> Result<u64, SettingsError> {
    parse_size::parse_size(value.trim()).map_err(|e| SettingsError::BadSize {
        what: what.to_owned(),
        value: value.to_owned(),
        reason: e.to_string(),
    })
}

fn parse_bytes(value: &str) -> Result<u64, String> {
    parse_size::parse_size(value.trim())
        .map_err(|e| format!("not a size ({e}; e.g. 64GiB, 512MiB, 4096)"))
}

/// `NAME=SIZE[:ro]`.
pub(crate) fn parse_region(value: &str) -> Result<RegionSpec, String> {
    let (name, rest) = value
        .split_once('=')
        .ok_or_else(|| "expected NAME=SIZE or NAME=SIZE:ro (e.g. kv=64GiB)".to_owned())?;
    let (size, read_only) = match rest.rsplit_once(':') {
        Some((size, "ro")) => (size, true),
        Some((size, "rw")) => (size, false),
        Some((_, other)) => {
            return Err(format!("`:{other}`: only `:ro` or `:rw` may follow the size"))
        }
        None => (rest, false),
    };
    let size = parse_size::parse_size(size.trim())
        .map_err(|e| format!("`{size}` is not a size ({e}; e.g. 64GiB, 512MiB, 4096)"))?;
    Ok(RegionSpec { name: name.trim().to_owned(), size, read_only, fill: None })
}

/// The configuration file: the flags' keys, and `[[region]]` tables.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    listen: Option<String>,
    #[serde(default, rename = "region")]
    regions: Vec<FileRegion>,
    secret_file: Option<PathBuf>,
    insecure_no_auth: Option<bool>,
    protection: Option<ProtectionArg>,
    transports: Option<String>,
    idle_timeout_ms: Option<u64>,
    peer_timeout_ms: Option<u64>,
    handshake_timeout_ms: Option<u64>,
    max_clients: Option<usize>,
    max_clients_per_ip: Option<usize>,
    metrics: Option<String>,
    drain_timeout_ms: Option<u64>,
}

/// A `[[region]]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRegion {
    name: String,
    size: SizeValue,
    #[serde(default)]
    read_only: bool,
}

/// A size in the file: a number of bytes or a string with a unit.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum SizeValue {
    Bytes(u64),
    Text(String),
}

impl FileConfig {
    /// Reads and parses `path`.
    pub(crate) fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::ReadConfig { path: path.to_owned(), source })?;
        Self::parse(path, &text)
    }

    /// Parses `text` (read from `path`).
    pub(crate) fn parse(path: &Path, text: &str) -> Result<Self, SettingsError> {
        toml::from_str(text).map_err(|e| SettingsError::ParseConfig {
            path: path.to_owned(),
            // toml's message names the key and shows the line; one line of it is enough.
            message: e.message().to_owned() + &line_of(text, e.span()),
        })
    }
}

/// " (line N)" for a span of `text`.
fn line_of(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    span.map(|s| format!(" (line {})", text[..s.start.min(text.len())].matches('\n').count() + 1))
        .unwrap_or_default()
}

/// What the server runs with.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) listen: String,
    pub(crate) regions: Vec<RegionSpec>,
    pub(crate) ucx: UcxConfig,
    pub(crate) metrics: Option<String>,
    pub(crate) drain_timeout: Duration,
    pub(crate) exit_on_stdin_close: bool,
    /// Warnings to log once logging is up (a group-readable secret file).
    pub(crate) warnings: Vec<String>,
}

impl Settings {
    /// The flags over the file (when `--config` names one).
    pub(crate) fn from_args(args: Args) -> Result<Self, SettingsError> {
        let file = match &args.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        Self::merge(args, file)
    }

    /// `args` over `file`.
    pub(crate) fn merge(args: Args, file: FileConfig) -> Result<Self, SettingsError> {
        let mut warnings = Vec::new();
        let mut regions = Vec::new();
        let seed = args.fill.unwrap_or(0);
        if let Some(bytes) = args.bytes {
            regions.push(RegionSpec {
                name: "arena".into(),
                size: bytes,
                read_only: false,
                fill: Some(seed),
            });
        }
        if let Some(bytes) = args.read_only_bytes.filter(|&b| b > 0) {
            regions.push(RegionSpec {
                name: "ro".into(),
                size: bytes,
                read_only: true,
                fill: Some(seed.wrapping_add(1)),
            });
        }
        if args.regions.is_empty() {
            for r in file.regions {
                let size = match r.size {
                    SizeValue::Bytes(n) => n,
                    SizeValue::Text(text) => {
                        parse_size_text(&format!("region `{}`'s size", r.name), &text)?
                    }
                };
                regions.push(RegionSpec { name: r.name, size, read_only: r.read_only, fill: None });
            }
        } else {
            regions.extend(args.regions);
        }
        check_regions(&regions)?;

        let mut ucx = UcxConfig {
            transports: args.transports.or(file.transports),
            insecure_no_auth: args.insecure_no_auth || file.insecure_no_auth.unwrap_or(false),
            ..UcxConfig::default()
        };
        if let Some(path) = args.secret_file.or(file.secret_file) {
            let (secret, warning) = read_secret(&path)?;
            ucx.secret = Some(secret);
            warnings.extend(warning);
        }
        if let Some(p) = args.protection.or(file.protection) {
            ucx.protection = match p {
                ProtectionArg::Encrypted => Protection::Encrypted,
                ProtectionArg::Authenticated => Protection::Authenticated,
            };
        }
        let ms = Duration::from_millis;
        if let Some(t) = args.idle_timeout_ms.or(file.idle_timeout_ms) {
            ucx.idle_timeout = ms(t);
        }
        if let Some(t) = args.peer_timeout_ms.or(file.peer_timeout_ms) {
            ucx.peer_timeout = ms(t);
        }
        if let Some(t) = args.handshake_timeout_ms.or(file.handshake_timeout_ms) {
            ucx.connect_timeout = ms(t);
        }
        if let Some(n) = args.max_clients.or(file.max_clients) {
            ucx.limits.max_clients = n;
        }
        if let Some(n) = args.max_clients_per_ip.or(file.max_clients_per_ip) {
            ucx.limits.max_clients_per_ip = n;
        }
        Ok(Self {
            listen: args.listen.or(file.listen).unwrap_or_else(|| "127.0.0.1:7400".into()),
            regions,
            ucx,
            metrics: args.metrics.or(file.metrics),
            drain_timeout: ms(args.drain_timeout_ms.or(file.drain_timeout_ms).unwrap_or(5000)),
            exit_on_stdin_close: args.exit_on_stdin_close,
            warnings,
        })
    }
}

/// Names unique and not empty, sizes above zero.
fn check_regions(regions: &[RegionSpec]) -> Result<(), SettingsError> {
    if regions.is_empty() {
        return Err(SettingsError::NoRegion);
    }
    for (i, r) in regions.iter().enumerate() {
        let bad =
            |reason: &str| SettingsError::BadRegion { name: r.name.clone(), reason: reason.into() };
        if r.name.is_empty() {
            return Err(bad("a region needs a name"));
        }
        if r.size == 0 {
            return Err(bad("a size of 0 bytes"));
        }
        if usize::try_from(r.size).is_err() {
            return Err(bad("larger than this machine's address space"));
        }
        if regions[..i].iter().any(|o| o.name == r.name) {
            return Err(bad("named twice"));
        }
    }
    Ok(())
}

/// The secret in `path` (one trailing newline dropped), refused when other users may read
/// it; a warning when the file's group may.
fn read_secret(path: &Path) -> Result<(Vec<u8>, Option<String>), SettingsError> {
    let read = |source| SettingsError::ReadSecret { path: path.to_owned(), source };
    let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o7777;
    if mode & 0o007 != 0 {
        return Err(SettingsError::SecretExposed { path: path.to_owned(), mode });
    }
    let warning = (mode & 0o070 != 0).then(|| {
        format!(
            "secret file {} is readable by its group (mode {mode:04o}); chmod 600 it",
            path.display()
        )
    });
    let mut secret = std::fs::read(path).map_err(read)?;
    if secret.last() == Some(&b'\n') {
        secret.pop();
        if secret.last() == Some(&b'\r') {
            secret.pop();
        }
    }
    Ok((secret, warning))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("umbp-ucx-serve").chain(flags.iter().copied()))
    }

    #[test]
    fn regions_read_sizes_as_parse_size_does() {
        let r = parse_region("kv=64GiB").unwrap();
        assert_eq!((r.name.as_str(), r.size, r.read_only), ("kv", 64 << 30, false));
        let r = parse_region("prefix=1.5MB:ro").unwrap();
        assert_eq!((r.size, r.read_only), (1_500_000, true));
        assert_eq!(parse_region("x=4096:rw").unwrap().size, 4096);
        for bad in ["kv", "kv=64XB", "kv=", "kv=1GiB:wo", "kv=-1"] {
            assert!(parse_region(bad).is_err(), "{bad}");
        }
        let e = args(&["--region", "kv=64XB"]).unwrap_err().to_string();
        assert!(e.contains("--region") && e.contains("64XB") && e.contains("not a size"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let file = FileConfig::parse(
            Path::new("t.toml"),
            r#"
            listen = "127.0.0.1:9000"
            idle_timeout_ms = 2000
            metrics = "127.0.0.1:9100"
            insecure_no_auth = true
            [[region]]
            name = "kv"
            size = "2MiB"
            [[region]]
            name = "ro"
            size = 4096
            read_only = true
            "#,
        )
        .unwrap();
        let s = Settings::merge(args(&["--listen", "127.0.0.1:9001"]).unwrap(), file).unwrap();
        assert_eq!(s.listen, "127.0.0.1:9001");
        assert_eq!(s.ucx.idle_timeout, Duration::from_secs(2));
        assert_eq!(s.metrics.as_deref(), Some("127.0.0.1:9100"));
        assert!(s.ucx.insecure_no_auth);
        let names: Vec<_> =
            s.regions.iter().map(|r| (r.name.as_str(), r.size, r.read_only)).collect();
        assert_eq!(names, [("kv", 2 << 20, false), ("ro", 4096, true)]);
        // --region flags replace the file's regions.
        let file = FileConfig::parse(Path::new("t.toml"), "[[region]]\nname = \"kv\"\nsize = 1\n")
            .unwrap();
        let s = Settings::merge(args(&["--region", "other=1KiB"]).unwrap(), file).unwrap();
        assert_eq!(
            s.regions,
            [RegionSpec { name: "other".into(), size: 1024, read_only: false, fill: None }]
        );
    }

    #[test]
    fn the_file_refuses_unknown_keys_and_bad_sizes_by_name() {
        let e = FileConfig::parse(Path::new("t.toml"), "listen = \"x\"\nidle_timeout = 5\n")
            .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, SettingsError::ParseConfig { .. }), "{text}");
        assert!(
            text.contains("idle_timeout") && text.contains("t.toml") && text.contains("line 2"),
            "{text}"
        );
        let e = FileConfig::parse(
            Path::new("t.toml"),
            "[[region]]\nname = \"kv\"\nsize = \"1GiB\"\nwritable = true\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("writable"), "{e}");
        let file = FileConfig::parse(
            Path::new("t.toml"),
            "[[region]]\nname = \"kv\"\nsize = \"64 gigs\"\n",
        )
        .unwrap();
        let e = Settings::merge(args(&[]).unwrap(), file).unwrap_err();
        assert!(matches!(&e, SettingsError::BadSize { value, .. } if value == "64 gigs"), "{e}");
        assert!(e.to_string().contains("region `kv`"), "{e}");
    }

    #[test]
    fn regions_are_checked() {
        let e = Settings::merge(args(&[]).unwrap(), FileConfig::default()).unwrap_err();
        assert!(matches!(e, SettingsError::NoRegion), "{e}");
        let e = Settings::merge(
            args(&["--region", "a=1", "--region", "a=2"]).unwrap(),
            FileConfig::default(),
        )
        .unwrap_err();
        assert!(matches!(&e, SettingsError::BadRegion { name, .. } if name == "a"), "{e}");
        let e = Settings::merge(args(&["--region", "a=0"]).unwrap(), FileConfig::default())
            .unwrap_err();
        assert!(e.to_string().contains("0 bytes"), "{e}");
    }

    #[test]
    fn a_secret_file_other_users_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a secret of at least sixteen bytes\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_secret(&path).unwrap_err();
        assert!(matches!(e, SettingsError::SecretExposed { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let (secret, warning) = read_secret(&path).unwrap();
        assert_eq!(secret, b"a secret of at least sixteen bytes");
        assert!(warning.is_some_and(|w| w.contains("group")));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(read_secret(&path).unwrap().1.is_none());
    }
}
