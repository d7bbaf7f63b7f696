//! The `umbp-bench` command as a user runs it: help, argument errors and exit statuses, the
//! JSON fields of every subcommand (against the crate README), `--out`, and the tour at a tiny
//! scale with every restore verified. Sizes are tiny; nothing here is judged by time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

const SUBCOMMANDS: [&str; 12] = [
    "tour", "plan", "copy", "hbm", "ssd", "restore", "layers", "batch", "churn", "serve", "remote",
    "pool",
];

fn umbp_bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umbp-bench"))
        .args(args)
        .output()
        .expect("the umbp-bench binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `args` (which include `--json`), checks it succeeded quietly, and parses its lines.
fn json_lines(args: &[&str]) -> Vec<Map<String, Value>> {
    json_lines_noting(args, |_| false)
}

/// [`json_lines`], where stderr may hold lines that `expected` accepts (why a part skipped).
fn json_lines_noting(args: &[&str], expected: impl Fn(&str) -> bool) -> Vec<Map<String, Value>> {
    let out = umbp_bench(args);
    assert!(out.status.success(), "{args:?} failed: {}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(stderr.lines().all(expected), "{args:?}: stderr must stay quiet with --json: {stderr}");
    let stdout = text(&out.stdout);
    let lines: Vec<Map<String, Value>> = stdout
        .lines()
        .map(|line| match serde_json::from_str(line) {
            Ok(Value::Object(map)) => map,
            other => panic!("{args:?}: not a JSON object: {line} ({other:?})"),
        })
        .collect();
    assert!(!lines.is_empty(), "{args:?} printed nothing");
    lines
}

/// The README's section for `subcommand`: from its `## ` heading to the next one.
fn readme_section(subcommand: &str) -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("the crate README");
    let heading = format!("## `{subcommand}`");
    let start = readme.find(&heading).unwrap_or_else(|| panic!("README lacks `{heading}`"));
    let rest = &readme[start + heading.len()..];
    rest[..rest.find("\n## ").unwrap_or(rest.len())].to_owned()
}

/// Every line has exactly `fields` (each documented in the README's section), no more.
fn check_fields(subcommand: &str, lines: &[Map<String, Value>], fields: &[&str]) {
    let section = readme_section(subcommand);
    for field in fields {
        assert!(section.contains(&format!("`{field}`")), "README `{subcommand}` lacks `{field}`");
    }
    for line in lines {
        for field in fields {
            assert!(line.contains_key(*field), "{subcommand}: `{field}` missing in {line:?}");
        }
        for key in line.keys() {
            assert!(fields.contains(&key.as_str()), "{subcommand}: undocumented field `{key}`");
        }
    }
}

#[test]
fn help_explains_every_option_and_its_default() {
    for subcommand in SUBCOMMANDS {
        let out = umbp_bench(&[subcommand, "--help"]);
        assert!(out.status.success(), "{subcommand} --help");
        let help = text(&out.stdout);
        // Each option's entry runs from its `--name` line to the next option.
        let mut entries: Vec<String> = Vec::new();
        for line in help.lines() {
            let trimmed = line.trim_start();
            if trimmed.starts_with("--") || trimmed.starts_with("-h,") || trimmed.starts_with("-V,")
            {
                entries.push(String::new());
            }
            if let Some(entry) = entries.last_mut() {
                entry.push_str(line);
                entry.push('\n');
            }
        }
        assert!(entries.len() >= 3, "{subcommand}: no options found in\n{help}");
        for entry in entries {
            let name = entry.split_whitespace().next().unwrap_or_default();
            if name == "-h," || name == "-V," {
                continue;
            }
            // Whatever follows the option's name and value placeholder, on its line or below,
            // apart from clap's own `[default: ...]` and `[possible values: ...]`.
            let mut prose = String::new();
            let mut depth = 0usize;
            for c in entry.chars() {
                match c {
                    '[' => depth += 1,
                    ']' => depth = depth.saturating_sub(1),
                    _ if depth == 0 => prose.push(c),
                    _ => {}
                }
            }
            let described = prose
                .split_whitespace()
                .skip_while(|w| w.starts_with('-') || w.starts_with('<'))
                .any(|w| w.chars().any(char::is_alphabetic));
            assert!(described, "{subcommand} {name} is not explained:\n{entry}");
            assert!(
                entry.to_lowercase().contains("default"),
                "{subcommand} {name} does not state its default:\n{entry}"
            );
        }
    }
}

#[test]
fn bad_arguments_exit_2_with_one_line() {
    let cases: &[&[&str]] = &[
        &["nonsense"],
        &["plan", "--bogus"],
        &["plan", "--page-size", "12XB"],
        &["plan", "--page-size", "48KiB"],
        &["plan", "--contiguity", "1.5"],
        &["plan", "--objects", "0"],
        &["copy", "--threads", "0"],
        &["copy", "--batch", "0"],
        &["copy", "--batch", "1TiB"],
        &["hbm", "--fragment-size", "-4KiB"],
        &["ssd", "--seconds", "0"],
        &["ssd", "--block-size", "12", "--file-size", "1MiB"],
        &["ssd", "--block-size", "2MiB", "--file-size", "1MiB"],
        &["restore", "--scale", "652"],
        &["restore", "--ssd-fraction", "x"],
        &["batch", "--engine", "gpu"],
        &["batch", "--transfers", "0"],
        &["batch", "--transfer-size", "4QiB"],
        &["churn", "--cycles", "10"],
        &["churn", "--window", "15"],
        &["churn", "--cycles", "100", "--window", "60"],
        &["churn", "--to", "ssd"],
        &["tour", "--tiny=yes"],
        &["remote", "--fragment-sizes", "3KiB"],
        &["remote", "--bytes", "0"],
        &["remote", "--latency-transfers", "2000000"],
        &["remote", "--lanes", "0"],
        &["serve", "--perftest-port", "70000"],
        &["pool", "--keys", "0"],
        &["pool", "--block-size", "48KiB"],
        &["pool", "--lanes", "0"],
        &["pool", "--transfer-blocks", "4096", "--block-size", "1MiB", "--keys", "x"],
        &["--json", "--out"],
    ];
    for args in cases {
        let out = umbp_bench(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: not one line: {stderr}");
        assert!(stderr.starts_with("umbp-bench: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?} printed to stdout");
    }
}

#[test]
fn runtime_errors_exit_1_with_one_line() {
    let not_a_dir = tempfile::NamedTempFile::new().unwrap();
    let path = not_a_dir.path().to_str().unwrap();
    let cases: &[&[&str]] = &[
        &["restore", "--scale", "1", "--dir", "/nonexistent/umbp-bench"],
        &["batch", "--dir", path],
        &["--out", path, "plan", "--objects", "1", "--iterations", "1"],
    ];
    for args in cases {
        let out = umbp_bench(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: not one line: {stderr}");
        assert!(stderr.starts_with("umbp-bench: ") && !stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn plan_json_fields() {
    let lines =
        json_lines(&["plan", "--objects", "2", "--iterations", "1", "--warmup", "0", "--json"]);
    let fields = [
        "builder",
        "page_size",
        "fragments",
        "plans",
        "segments",
        "ns_per_fragment",
        "median_ms",
        "spread",
        "instructions_per_fragment",
        "allocs_per_iter",
        "minor_faults_per_iter",
        "vs_floor",
        "adjacent_fraction",
        "verified",
        "load",
        "cpus",
    ];
    check_fields("plan", &lines, &fields);
    assert_eq!(
        lines.len(),
        10,
        "four builders and the overlap check at the two default page sizes"
    );
    assert!(lines.iter().all(|l| l["verified"] == true));
}

#[test]
fn copy_json_fields() {
    let lines = json_lines(&[
        "copy",
        "--fragment-size",
        "4KiB,64KiB",
        "--batch",
        "1MiB",
        "--threads",
        "1",
        "--iterations",
        "1",
        "--submit-fragments",
        "32",
        "--submit-iterations",
        "1",
        "--json",
    ]);
    let (throughput, submit): (Vec<_>, Vec<_>) =
        lines.into_iter().partition(|l| l["kind"] == "throughput");
    let fields = [
        "kind",
        "fragment_size",
        "threads",
        "fragments",
        "batch_bytes",
        "non_temporal",
        "engine_seconds",
        "engine_spread",
        "ceiling_seconds",
        "ceiling_spread",
        "ceiling_copy",
        "other_copy_seconds",
        "engine_gib_s",
        "ceiling_gib_s",
        "ratio",
        "verdict",
        "verified",
    ];
    check_fields("copy", &throughput, &fields);
    // Only 64 KiB has a target; the ceiling is the faster of its two copies.
    for row in &throughput {
        assert_eq!(row["verdict"].is_null(), row["fragment_size"] != 65536, "{row:?}");
        let ceiling = row["ceiling_seconds"].as_f64().unwrap();
        assert!(ceiling <= row["other_copy_seconds"].as_f64().unwrap(), "{row:?}");
    }
    assert_eq!(throughput.len(), 2);
    let fields = [
        "kind",
        "fragments",
        "fragment_size",
        "threads",
        "floor_ns_per_fragment",
        "floor_spread",
        "batch_ns_per_fragment",
        "batch_spread",
        "single_ns_per_fragment",
        "single_spread",
        "batch_overhead_ns",
        "batch_noise_ns",
        "single_overhead_ns",
        "single_noise_ns",
        "ratio",
        "ratio_range",
        "verdict",
        "batch_submit_overhead_ns",
        "single_submit_overhead_ns",
        "submit_ratio",
        "verified",
    ];
    check_fields("copy", &submit, &fields);
    assert_eq!(submit.len(), 1);
    assert_eq!((&submit[0]["kind"], &submit[0]["fragments"]), (&Value::from("submit"), &32.into()));
}

#[test]
fn hbm_json_fields() {
    let lines = json_lines(&[
        "hbm",
        "--backend",
        "sim",
        "--fragment-size",
        "4KiB,16KiB",
        "--batch",
        "256KiB",
        "--iterations",
        "1",
        "--restore-objects",
        "1",
        "--json",
    ]);
    let of_kind = |kinds: &[&str]| -> Vec<Map<String, Value>> {
        lines.iter().filter(|l| kinds.iter().any(|k| l["kind"] == *k)).cloned().collect()
    };
    let calibration = of_kind(&["calibration"]);
    let checks = of_kind(&["check"]);
    let rows = of_kind(&["ceiling", "gather", "copies", "restore"]);
    assert_eq!(
        calibration.len() + checks.len() + rows.len(),
        lines.len(),
        "every line has a documented kind"
    );
    check_fields(
        "hbm",
        &calibration,
        &[
            "kind",
            "backend",
            "fragment_size",
            "kernel_seconds",
            "copies_seconds",
            "kernel_max_mean_bytes",
        ],
    );
    check_fields("hbm", &checks, &["kind", "backend", "check", "bytes", "passed"]);
    check_fields(
        "hbm",
        &rows,
        &[
            "kind",
            "backend",
            "direction",
            "fragment_size",
            "fragments",
            "launches_per_batch",
            "seconds",
            "spread",
            "gib_s",
            "vs_copies",
            "vs_ceiling",
            "verified",
        ],
    );
    assert!(!calibration.is_empty(), "the engine calibrates before measuring");
    assert_eq!(checks.len(), 4, "round trip, scattered gather, device to device, stream");
    assert!(checks.iter().all(|c| c["passed"] == true && c["backend"] == "sim"));
    let count = |kind: &str| rows.iter().filter(|r| r["kind"] == kind).count();
    assert_eq!(count("ceiling"), 2, "one ceiling each way");
    assert_eq!((count("gather"), count("copies")), (4, 4), "two sizes, two directions");
    assert_eq!(count("restore"), 1);
    assert!(rows.iter().all(|r| r["verified"] == true));
    for row in &rows {
        let has_ceiling_ratio = row["kind"] != "ceiling";
        assert_eq!(!row["vs_ceiling"].is_null(), has_ceiling_ratio, "{row:?}");
        assert_eq!(!row["vs_copies"].is_null(), row["kind"] == "gather", "{row:?}");
    }
}

#[test]
fn ssd_json_fields() {
    let dir = tempfile::tempdir().unwrap();
    let lines = json_lines(&[
        "ssd",
        "--file-size",
        "4MiB",
        "--block-size",
        "64KiB",
        "--queue-depth",
        "4",
        "--seconds",
        "0.02",
        "--repeats",
        "1",
        "--no-fio",
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let fields = [
        "block_size",
        "mode",
        "queue_depth",
        "gib_s",
        "iops",
        "bytes",
        "seconds",
        "samples",
        "min_gib_s",
        "max_gib_s",
        "backend",
        "cpu",
        "direct",
        "cache_dropped",
        "verified",
        "vs_fio",
        "vs_fio_spread",
        "verdict",
        "fio_huge_pages",
        "fio_ceiling",
        "vs_qd1",
    ];
    check_fields("ssd", &lines, &fields);
    let modes: Vec<&Value> = lines.iter().map(|l| &l["mode"]).collect();
    assert_eq!(modes, ["engine-qd1", "engine"]);
    assert!(lines.iter().all(|l| l["verified"] == true));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the test file is removed");
}

#[test]
fn restore_json_fields() {
    let dir = tempfile::tempdir().unwrap();
    let lines = json_lines(&[
        "restore",
        "--scale",
        "1",
        "--iterations",
        "1",
        "--callers",
        "1,2",
        "--no-fio",
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let fields = [
        "source",
        "builder",
        "objects",
        "bytes",
        "callers",
        "seconds",
        "spread",
        "gib_s",
        "verified",
        "ratio_to_slower_half",
        "ratio_to_one_caller",
        "ceiling_gib_s",
        "vs_ceiling",
        "ceiling_copy",
        "other_copy_gib_s",
        "gather_ceiling_gib_s",
        "vs_gather_ceiling",
        "gather_verdict",
        "verdict",
        "ssd_cpu",
        "fio_huge_pages",
        "unchecked_seconds",
        "checksum_cost",
        "checksum_cost_interval",
    ];
    check_fields("restore", &lines, &fields);
    assert!(lines.iter().all(|l| l["verified"] == true), "every restore is byte-correct");
    // The checksum rows: the same restore verifying every object, timed in turns without.
    let crc: Vec<&Map<String, Value>> = lines
        .iter()
        .filter(|l| l["source"].as_str().is_some_and(|s| s.ends_with("-crc")))
        .collect();
    let sources: Vec<&Value> = crc.iter().map(|l| &l["source"]).collect();
    assert_eq!(sources, ["dram-crc", "ssd-crc"]);
    for l in &crc {
        assert!(l["unchecked_seconds"].as_f64().is_some_and(|s| s > 0.0), "{l:?}");
        assert!(l["checksum_cost"].is_f64() && l["checksum_cost_interval"].is_array(), "{l:?}");
    }
    let other = lines.iter().filter(|l| !crc.contains(l));
    assert!(other.clone().all(|l| l["checksum_cost"].is_null()));
    let dram = lines.iter().find(|l| l["source"] == "dram" && l["callers"] == 1).unwrap();
    let (gather, vs) = (dram["gather_ceiling_gib_s"].as_f64(), dram["vs_gather_ceiling"].as_f64());
    assert!(gather.is_some_and(|g| g > 0.0) && vs.is_some_and(|v| v > 0.0), "{dram:?}");
    assert!(dram["gather_verdict"].is_string(), "{dram:?}");
    let mixed = lines.iter().filter(|l| l["source"] == "mixed" && l["callers"] == 1);
    assert!(
        mixed.clone().count() == 2 && mixed.clone().all(|l| l["ratio_to_slower_half"].is_f64())
    );
    let two = lines.iter().filter(|l| l["callers"] == 2);
    assert_eq!(two.clone().count(), 2, "DRAM and mixed with two callers");
    assert!(two.clone().all(|l| l["ratio_to_slower_half"].is_null()));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the SSD tier is removed");
}

#[test]
fn batch_json_fields_and_units() {
    let dir = tempfile::tempdir().unwrap();
    let lines = json_lines(&[
        "batch",
        "--transfers",
        "16",
        "--transfer-size",
        "8KiB",
        "--iterations",
        "1",
        "--ssd-iterations",
        "1",
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let fields = [
        "engine",
        "backend",
        "transfers",
        "transfer_size",
        "overhead",
        "floor_ns_per_transfer",
        "floor_spread",
        "batch_wall_ns_per_transfer",
        "batch_wall_spread",
        "single_wall_ns_per_transfer",
        "single_wall_spread",
        "batch_ns_per_transfer",
        "batch_noise_ns",
        "single_ns_per_transfer",
        "single_noise_ns",
        "ratio",
        "ratio_range",
        "target_ratio",
        "verdict",
        "verified",
    ];
    check_fields("batch", &lines, &fields);
    let engines: Vec<&Value> = lines.iter().map(|l| &l["engine"]).collect();
    assert_eq!(engines, ["localcopy", "hbm-sim", "ssd"]);
    for l in &lines {
        assert_eq!((&l["transfers"], &l["transfer_size"]), (&16.into(), &8192.into()));
        assert_eq!(l["verified"], true);
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the SSD file is removed");
}

#[test]
fn churn_json_fields_and_bounded_registry() {
    for to in ["host", "device"] {
        let args =
            ["churn", "--cycles", "200", "--window", "50", "--warmup", "10", "--to", to, "--json"];
        let lines = json_lines(&args);
        let fields = [
            "target",
            "cycles",
            "window",
            "objects",
            "bytes_per_cycle",
            "first_us_per_cycle",
            "last_us_per_cycle",
            "ratio",
            "ratio_range",
            "target_ratio",
            "time_verdict",
            "first_cpu_us_per_cycle",
            "last_cpu_us_per_cycle",
            "cpu_ratio",
            "cpu_ratio_range",
            "cpu_verdict",
            "rss_start_mib",
            "rss_warm_mib",
            "rss_end_mib",
            "rss_growth",
            "target_rss_growth",
            "rss_verdict",
            "registry_slots",
            "verified",
            "seconds",
        ];
        check_fields("churn", &lines, &fields);
        assert_eq!(lines.len(), 1);
        let l = &lines[0];
        assert_eq!(
            (&l["target"], &l["cycles"], &l["window"]),
            (&to.into(), &200.into(), &50.into())
        );
        assert_eq!(l["verified"], true);
        assert_eq!(l["bytes_per_cycle"], 4 * 4 * 4096);
        // 210 registrations: the arena's slot and one reused by every destination.
        assert_eq!(l["registry_slots"], 2, "{l:?}");
        for verdict in ["time_verdict", "cpu_verdict", "rss_verdict"] {
            let v = l[verdict].as_str().unwrap();
            assert!(["met", "unmet", "within noise", "below noise"].contains(&v), "{verdict}: {v}");
        }
    }
}

#[test]
fn the_tiny_tour_verifies_every_restore_and_writes_every_chart() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("charts");
    let ssd_dir = tmp.path().join("ssd");
    std::fs::create_dir(&ssd_dir).unwrap();
    let (out_arg, ssd_arg) = (out_dir.to_str().unwrap(), ssd_dir.to_str().unwrap());

    // The remote part runs where UCX loads, and says why it skipped elsewhere.
    let remote = ucx_or_skip();
    // Human output: every part's table, then the summary; stderr only names the files.
    let out = umbp_bench(&["tour", "--tiny", "--dir", ssd_arg, "--out", out_arg]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let mut headings =
        vec!["plan building", "restore of the Kimi-K3 shape", "batch submit vs", "summary"];
    let mut parts = vec!["plan", "restore", "batch", "tour"];
    if remote {
        // With the congestion control its loopback rows ran under, which bears on the peers'.
        headings.extend(["remote restore over UCX", "loopback TCP: "]);
        parts.push("remote");
    }
    for heading in headings {
        assert!(stdout.contains(heading), "`{heading}` missing from\n{stdout}");
    }
    let skip_note = |l: &str| !remote && l.starts_with("umbp-bench tour: skipping the remote part");
    assert!(
        stderr.lines().all(|l| l.starts_with("umbp-bench: wrote ") || skip_note(l)),
        "{stderr}"
    );
    for part in parts {
        let svg = std::fs::read_to_string(out_dir.join(format!("{part}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{part}.svg");
        assert!(!svg.contains("NaN"), "{part}.svg");
    }
    let restores = std::fs::read_to_string(out_dir.join("restore.jsonl")).unwrap();
    let restores: Vec<Value> = restores.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let sources: Vec<&str> = restores.iter().filter_map(|r| r["source"].as_str()).collect();
    assert_eq!(sources.len(), 8, "{sources:?}");
    assert_eq!(sources.iter().filter(|s| s.ends_with("-crc")).count(), 2, "{sources:?}");
    assert!(restores.iter().all(|r| r["verified"] == true), "{restores:?}");
    assert_eq!(std::fs::read_dir(&ssd_dir).unwrap().count(), 0, "temporary SSD files removed");

    // JSON output: the summary lines only, each with the documented fields.
    let lines = json_lines_noting(&["tour", "--tiny", "--dir", ssd_arg, "--json"], skip_note);
    let fields = ["part", "figure", "value", "unit", "comparison", "target", "verdict", "interval"];
    check_fields("tour", &lines, &fields);
    let correct: Vec<&Map<String, Value>> = lines
        .iter()
        .filter(|l| l["figure"].as_str().is_some_and(|f| f.contains("byte-correct")))
        .collect();
    assert_eq!(correct.len(), 2 + usize::from(remote), "restores, batch transfers (and remote)");
    assert!(correct.iter().all(|l| l["verdict"] == "met"), "{correct:?}");
    let restored = lines.iter().find(|l| l["figure"] == "restores byte-correct (of 8)").unwrap();
    assert_eq!((&restored["value"], &restored["target"]), (&8.0.into(), &8.0.into()));
}

#[test]
fn layers_json_fields() {
    let dir = tempfile::tempdir().unwrap();
    let lines = json_lines(&[
        "layers",
        "--scale",
        "1",
        "--iterations",
        "1",
        "--compute-us",
        "100",
        "--dir",
        dir.path().to_str().unwrap(),
        "--json",
    ]);
    let fields =
        ["source", "mode", "restore_ms", "ttfg_ms", "stall_ms", "compute_us", "spread", "verified"];
    check_fields("layers", &lines, &fields);
    assert_eq!(lines.len(), 6, "three sources, two modes");
    assert!(lines.iter().all(|l| l["verified"] == true), "every restore is byte-correct");
    assert!(lines.iter().all(|l| l["compute_us"] == 100.0));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the SSD tier is removed");
}

/// Whether UCX loads here; prints why a test skips. `UMBP_REQUIRE_UCX=1` (CI) makes its absence
/// a failure (the pattern of umbp-remote's tests).
fn ucx_or_skip() -> bool {
    umbp_plan::testing::available_or_skip("UMBP_REQUIRE_UCX", umbp_remote::ucx_available())
}

/// One JSON line of the command.
type Line = Map<String, Value>;

/// Runs `remote --tiny --json` with `args` and `UMBP_MOONCAKE_PYTHON=python`: its stderr and
/// its lines, split into restore rows and latency rows.
fn remote_json(args: &[&str], python: &Path) -> (String, Vec<Line>, Vec<Line>) {
    let out = Command::new(env!("CARGO_BIN_EXE_umbp-bench"))
        .args(["remote", "--tiny", "--json"])
        .args(args)
        .env("UMBP_MOONCAKE_PYTHON", python)
        .output()
        .expect("the umbp-bench binary runs");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "remote failed: {stderr}");
    let lines: Vec<Line> = stdout
        .lines()
        .map(|line| match serde_json::from_str(line) {
            Ok(Value::Object(map)) => map,
            other => panic!("not a JSON object: {line} ({other:?})"),
        })
        .collect();
    let (restores, latency) = lines.into_iter().partition(|l| l["row"] == "restore");
    (stderr, restores, latency)
}

const REMOTE_FIELDS: [&str; 28] = [
    "row",
    "transport",
    "path",
    "protection",
    "lanes",
    "server",
    "fragment_size",
    "objects",
    "bytes",
    "fragments",
    "segments",
    "in_flight",
    "repeats",
    "gib_s",
    "gib_s_spread",
    "perftest_gib_s",
    "perftest_spread",
    "ratio",
    "ratio_range",
    "verdict",
    "verified",
    "mooncake_gib_s",
    "mooncake_spread",
    "mooncake_ratio",
    "mooncake_ratio_range",
    "mooncake_verdict",
    "mooncake_verified",
    "mooncake_skipped",
];

#[test]
fn remote_json_fields_and_verified_restores() {
    if !ucx_or_skip() {
        return;
    }
    // Mooncake made absent: its fields say why, the rest is measured as ever.
    let missing = Path::new("/nonexistent/umbp-bench/python");
    let (stderr, lines, latency) = remote_json(&["--latency-transfers", "40"], missing);
    // Quiet, except the lines saying why a peer did not run.
    let skip = |l: &str| {
        l.starts_with("umbp-bench remote: no reference")
            || l.starts_with("umbp-bench remote: no Mooncake row: ")
    };
    assert!(stderr.lines().all(skip), "{stderr}");
    assert!(stderr.contains("no Mooncake row") && stderr.contains(missing.to_str().unwrap()));
    let with_perftest = !stderr.contains("no reference");
    check_fields("remote", &lines, &REMOTE_FIELDS);
    let sizes: Vec<&Value> = lines.iter().map(|l| &l["fragment_size"]).collect();
    let twice = [65536, 65536, 262144, 262144, 1048576, 1048576];
    assert_eq!(sizes, twice, "the default fragment sizes, a row per protection");
    let protections: Vec<&Value> = lines.iter().map(|l| &l["protection"]).collect();
    assert_eq!(protections, ["encrypted", "authenticated"].repeat(3));
    for l in &lines {
        assert_eq!(l["verified"], true, "{l:?}");
        assert_eq!((&l["transport"], &l["server"]), (&"tcp".into(), &"child".into()));
        assert_eq!(l["path"], "checked", "TCP goes through the checked path");
        assert_eq!(l["lanes"], 2, "the engine's default lanes, all taken by the server");
        assert_eq!(
            (&l["objects"], &l["bytes"], &l["repeats"]),
            (&1.into(), &(24 << 20).into(), &1.into())
        );
        assert_eq!(l["segments"], l["fragments"], "one request per fragment: nothing merged");
        assert!(l["gib_s"].as_f64().is_some_and(|g| g > 0.0), "{l:?}");
        assert_eq!(l["perftest_gib_s"].is_f64(), with_perftest, "{l:?}");
        // The raw one-sided path's ceiling stands beside the checked path, without a target.
        assert_eq!(l["verdict"], Value::Null, "no perftest target on the checked path: {l:?}");
        if with_perftest {
            let range = l["ratio_range"].as_array().expect("a range with a ratio");
            let ratio = l["ratio"].as_f64().unwrap();
            assert!(range[0].as_f64().unwrap() <= ratio && ratio <= range[1].as_f64().unwrap());
        }
        let why = l["mooncake_skipped"].as_str().unwrap_or_else(|| panic!("a reason: {l:?}"));
        assert!(why.contains("/nonexistent/umbp-bench/python"), "{why}");
        for field in
            REMOTE_FIELDS.iter().filter(|f| f.starts_with("mooncake_") && **f != "mooncake_skipped")
        {
            assert_eq!(l[*field], Value::Null, "{field} without Mooncake: {l:?}");
        }
    }
    let fields = [
        "row",
        "transport",
        "path",
        "protection",
        "load",
        "transfer_size",
        "transfers",
        "p50_us",
        "p90_us",
        "p99_us",
        "max_us",
        "p99_range",
        "target_p99_us",
        "verdict",
        "verified",
        "mooncake_p50_us",
        "mooncake_p90_us",
        "mooncake_p99_us",
        "mooncake_max_us",
        "mooncake_verified",
    ];
    check_fields("remote", &latency, &fields);
    let loads: Vec<(&Value, &Value)> =
        latency.iter().map(|l| (&l["load"], &l["protection"])).collect();
    let expected: [(Value, Value); 4] = [
        ("quiet".into(), "encrypted".into()),
        ("quiet".into(), "authenticated".into()),
        ("spinning".into(), "encrypted".into()),
        ("spinning".into(), "authenticated".into()),
    ];
    assert_eq!(loads, expected.iter().map(|(a, b)| (a, b)).collect::<Vec<_>>());
    for l in &latency {
        assert_eq!((&l["transfer_size"], &l["transfers"]), (&4096.into(), &40.into()), "{l:?}");
        assert_eq!(l["verified"], true, "every single transfer delivered its bytes: {l:?}");
        let at = |f: &str| l[f].as_f64().unwrap_or_else(|| panic!("{f}: {l:?}"));
        assert!(0.0 < at("p50_us") && at("p50_us") <= at("p90_us"), "{l:?}");
        assert!(at("p90_us") <= at("p99_us") && at("p99_us") <= at("max_us"), "{l:?}");
        let loaded = l["load"] == "spinning";
        assert_eq!(l["target_p99_us"].as_f64(), loaded.then_some(1000.0), "{l:?}");
        assert_eq!(l["verdict"].is_string(), loaded, "judged under load only: {l:?}");
        for field in fields.iter().filter(|f| f.starts_with("mooncake_")) {
            assert_eq!(l[*field], Value::Null, "{field} without Mooncake: {l:?}");
        }
    }
    // No latency rows when none are asked for; --no-mooncake says so in the rows.
    let (_, lines, latency) = remote_json(
        &["--latency-transfers", "0", "--no-mooncake", "--fragment-size", "1MiB"],
        missing,
    );
    assert!(latency.is_empty());
    assert_eq!(lines.len(), 2, "one row per protection");
    for l in &lines {
        assert_eq!(l["mooncake_skipped"], "not run (--no-mooncake)");
    }
}

/// The python of the Mooncake venv when it is installed already (UMBP_MOONCAKE_PYTHON, else
/// scripts/mooncake-venv's cache); tests do not install it (a download).
fn mooncake_python() -> Option<PathBuf> {
    if let Some(python) = std::env::var_os("UMBP_MOONCAKE_PYTHON") {
        return Some(PathBuf::from(python));
    }
    let venv = std::env::var_os("UMBP_MOONCAKE_VENV")
        .map_or_else(|| PathBuf::from("/root/.cache/umbp/mooncake-0.3.13.post1"), PathBuf::from);
    venv.join(".umbp-mooncake-complete").is_file().then(|| venv.join("bin/python"))
}

#[test]
fn remote_measures_mooncake_beside_the_engine() {
    if !ucx_or_skip() {
        return;
    }
    let Some(python) = mooncake_python() else {
        eprintln!("skipped: the Mooncake venv is not installed (bash scripts/mooncake-venv)");
        return;
    };
    let args = ["--fragment-sizes", "256KiB", "--latency-transfers", "30", "--no-perftest"];
    let (stderr, lines, latency) = remote_json(&args, &python);
    assert!(stderr.lines().all(|l| l.starts_with("umbp-bench remote: no reference")), "{stderr}");
    assert_eq!(latency.len(), 4, "quiet and spinning, each encrypted and authenticated");
    for l in &latency {
        assert_eq!(l["mooncake_verified"], true, "Mooncake's single reads landed: {l:?}");
        let p50 = l["mooncake_p50_us"].as_f64().expect("Mooncake's latency beside the engine's");
        assert!(0.0 < p50 && p50 <= l["mooncake_p99_us"].as_f64().unwrap(), "{l:?}");
    }
    check_fields("remote", &lines, &REMOTE_FIELDS);
    assert_eq!(lines.len(), 2, "one row per protection");
    let l = &lines[0];
    assert_eq!(l["mooncake_skipped"], Value::Null, "{l:?}");
    assert_eq!(l["mooncake_verified"], true, "Mooncake read every byte right: {l:?}");
    let gib_s = l["mooncake_gib_s"].as_f64().expect("a Mooncake figure");
    let ratio = l["mooncake_ratio"].as_f64().unwrap();
    assert!(gib_s > 0.0 && (ratio - l["gib_s"].as_f64().unwrap() / gib_s).abs() < 1e-9, "{l:?}");
    let range = l["mooncake_ratio_range"].as_array().unwrap();
    assert!(range[0].as_f64().unwrap() <= ratio && ratio <= range[1].as_f64().unwrap());
    let verdict = l["mooncake_verdict"].as_str().unwrap();
    assert!(["met", "unmet", "within noise"].contains(&verdict), "{verdict}");
}

#[test]
fn serve_listens_until_stdin_closes() {
    if !ucx_or_skip() {
        return;
    }
    // Without a shared secret it refuses to serve, with one line saying why.
    let out = Command::new(env!("CARGO_BIN_EXE_umbp-bench"))
        .args(["serve", "--bytes", "1MiB", "--transports", "tcp"])
        .env_remove("UMBP_UCX_SECRET")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.lines().count() == 1 && stderr.contains("UMBP_UCX_SECRET"), "{stderr}");
    assert!(out.stdout.is_empty());
    let mut child = Command::new(env!("CARGO_BIN_EXE_umbp-bench"))
        .args(["serve", "--bytes", "1MiB", "--transports", "tcp"])
        .env("UMBP_UCX_SECRET", "a secret of the serve test, 32 B")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.strip_prefix("listening ").unwrap_or_else(|| panic!("serve said {line:?}"));
    assert!(addr.trim().parse::<std::net::SocketAddr>().is_ok(), "{line:?}");
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve still runs 10 s after its stdin closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

/// The fields of every `pool` line.
const POOL_FIELDS: [&str; 17] = [
    "figure",
    "system",
    "items",
    "block_size",
    "protection",
    "lanes",
    "median",
    "interval",
    "unit",
    "rounds",
    "target",
    "vs_mooncake",
    "vs_mooncake_range",
    "verdict",
    "server_cpu_ms",
    "verified",
    "load",
];

/// The rows of `pool` whose `figure` and `system` are these.
fn pool_row<'a>(lines: &'a [Line], figure: &str, system: &str) -> Option<&'a Line> {
    lines
        .iter()
        .find(|l| l["figure"] == figure && l["system"].as_str().unwrap().starts_with(system))
}

#[test]
fn pool_json_fields_and_verified_rows() {
    if !umbp_pool::redis_server::available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap();
    let lines = json_lines_noting(
        &["pool", "--tiny", "--json", "--no-mooncake", "--lanes", "3", "--dir", dir_arg],
        |l| l.starts_with("umbp-bench pool: skipped the put/get rows"),
    );
    check_fields("pool", &lines, &POOL_FIELDS);
    for l in &lines {
        assert_eq!(l["verified"], true, "every round found or moved every block: {l:?}");
        assert_eq!(l["vs_mooncake"], Value::Null, "no Mooncake, no ratio: {l:?}");
        let [lo, hi] = [0, 1].map(|i| l["interval"][i].as_f64().unwrap());
        let median = l["median"].as_f64().unwrap();
        assert!(0.0 < lo && lo <= median && median <= hi, "{l:?}");
    }
    for (figure, system, target) in [
        ("lookup", "umbp embedded", Some(2.0)),
        ("lookup", "umbp redis", Some(5.0)),
        ("lookup", "umbp redis (redis-rs)", None),
        ("lookup", "umbp redis, entries only", None),
        ("lookup", "umbp redis cluster (3 shards, 3 masters)", Some(5.0)),
        ("prefix", "umbp redis prefix", Some(5.0)),
        ("prefix", "umbp redis cluster prefix (3 shards)", Some(5.0)),
        ("lookup, first asks", "umbp redis", None),
        ("lookup, first asks", "umbp redis cluster (3 shards, 3 masters)", None),
        ("publish", "umbp embedded", Some(100_000.0)),
        ("reserve+publish", "umbp embedded", None),
        ("publish", "umbp redis", None),
        ("reserve+publish", "umbp redis", None),
        ("reopen", "umbp embedded", None),
        ("restart", "umbp embedded", None),
    ] {
        let l = pool_row(&lines, figure, system).unwrap_or_else(|| panic!("{figure} {system}"));
        assert_eq!(l["target"]["value"].as_f64(), target, "{l:?}");
        assert_eq!(l["verdict"].is_null(), target.is_none(), "{l:?}");
    }
    let redis = pool_row(&lines, "lookup", "umbp redis").unwrap();
    assert_eq!(redis["items"], 2000);
    assert!(redis["server_cpu_ms"].as_f64().unwrap() >= 0.0, "{redis:?}");
    // Reserving and publishing 2,000 blocks is work Redis's clock sees.
    for figure in ["publish", "reserve+publish"] {
        let l = pool_row(&lines, figure, "umbp redis").unwrap();
        assert!(l["server_cpu_ms"].as_f64().unwrap() > 0.0, "{l:?}");
        assert_eq!(
            pool_row(&lines, figure, "umbp embedded").unwrap()["server_cpu_ms"],
            Value::Null
        );
    }
    assert_eq!(pool_row(&lines, "restart", "umbp embedded").unwrap()["items"], 5000);
    if ucx_or_skip() {
        // One row of each figure per channel protection, each named by it, and the default
        // protection again with the index on the Redis Cluster.
        for figure in ["put", "get"] {
            for (system, protection) in [
                ("umbp pool, encrypted", "encrypted"),
                ("umbp pool, authenticated", "authenticated"),
                ("umbp pool on redis cluster, encrypted", "encrypted"),
            ] {
                let l =
                    pool_row(&lines, figure, system).unwrap_or_else(|| panic!("{figure} {system}"));
                assert_eq!(l["protection"], protection, "{l:?}");
                assert_eq!(l["lanes"], 3, "the lanes asked for: {l:?}");
                // The standalone Redis's CPU per block; the Cluster's is not measured.
                let cpu = l["server_cpu_ms"].as_f64();
                assert_eq!(cpu.is_some(), !system.contains("cluster"), "{l:?}");
                assert!(cpu.is_none_or(|c| c > 0.0), "a put or get asks Redis: {l:?}");
                let (items, size) = (l["items"].as_u64(), l["block_size"].as_u64());
                assert_eq!((items, size), (Some(64), Some(64 << 10)), "{l:?}");
            }
        }
    }
    let index_rows =
        lines.iter().filter(|l| !["put", "get"].contains(&l["figure"].as_str().unwrap()));
    assert!(index_rows.clone().count() >= 13);
    for l in index_rows {
        assert_eq!(l["protection"], Value::Null, "only the memory node's rows have one: {l:?}");
        assert_eq!(l["lanes"], Value::Null, "{l:?}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the index files are removed");
}

#[test]
fn pool_measures_mooncake_store_beside_umbp() {
    if !umbp_pool::redis_server::available() {
        return;
    }
    let Some(python) = mooncake_python() else {
        eprintln!("skipped: the Mooncake venv is not installed (bash scripts/mooncake-venv)");
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_umbp-bench"))
        .args(["pool", "--tiny", "--json", "--restart-blocks", "100"])
        .env("UMBP_MOONCAKE_PYTHON", &python)
        .output()
        .expect("the umbp-bench binary runs");
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "pool failed: {stderr}");
    let lines: Vec<Line> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let mooncake = pool_row(&lines, "lookup", "mooncake store")
        .unwrap_or_else(|| panic!("no Mooncake lookup row: {stderr}"));
    assert_eq!(mooncake["verified"], true, "batch_is_exist found every key: {mooncake:?}");
    let redis = pool_row(&lines, "lookup", "umbp redis").unwrap();
    let ratio = redis["vs_mooncake"].as_f64().expect("umbp's lookup against Mooncake's");
    let expected = mooncake["median"].as_f64().unwrap() / redis["median"].as_f64().unwrap();
    assert!((ratio / expected - 1.0).abs() < 1e-9, "{redis:?}");
    let range = redis["vs_mooncake_range"].as_array().unwrap();
    assert!(range[0].as_f64().unwrap() <= ratio && ratio <= range[1].as_f64().unwrap());
    if umbp_remote::ucx_available().is_ok() {
        for figure in ["put", "get"] {
            let l =
                pool_row(&lines, figure, "mooncake store").unwrap_or_else(|| panic!("{stderr}"));
            assert_eq!(l["verified"], true, "Mooncake moved every byte right: {l:?}");
            for protection in ["encrypted", "authenticated"] {
                let ours = pool_row(&lines, figure, &format!("umbp pool, {protection}")).unwrap();
                assert!(ours["vs_mooncake"].as_f64().unwrap() > 0.0, "{ours:?}");
            }
        }
    }
}
