//! The table and the chart of `umbp-bench ssd`'s rows ([`ssd_bench`](crate::ssd_bench) measures
//! them).

use crate::chart::{BarChart, Series};
use crate::measure::{spread_interval, verdict_text};
use crate::size::ByteSize;
use crate::ssd_bench::SsdRow;

/// A row's name in the table and the chart: its mode and queue depth (`fio` at depth 1 is
/// `fio-qd1`).
fn label(r: &SsdRow) -> String {
    match r.mode {
        "engine" | "fio" | "fio-registered" | "fio-huge" => {
            format!("{}-qd{}", r.mode, r.queue_depth)
        }
        mode => mode.to_owned(),
    }
}

/// The human table, with the targets of each block size.
pub fn table(rows: &[SsdRow]) -> String {
    let mut out =
        String::from("SSD engine: random O_DIRECT reads against fio (io_uring), same file\n");
    let cpus: Vec<Option<usize>> = rows.iter().map(|r| r.cpu).collect();
    out += &match cpus.first() {
        Some(Some(cpu)) if cpus.iter().all(|c| *c == Some(*cpu)) => {
            format!("the engine's worker and fio pinned to CPU {cpu}\n\n")
        }
        _ => "the engine's worker and fio unpinned\n\n".to_owned(),
    };
    out += &format!(
        "{:>9} {:<19} {:>8} {:>10} {:>13} {:<12} {:>6} {:>13} {:>24} {:>7} {:>8}\n",
        "block",
        "mode",
        "GiB/s",
        "IOPS",
        "GiB/s min-max",
        "backend",
        "direct",
        "vs fio",
        "verdict",
        "vs qd1",
        "verified"
    );
    let ratio = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.2}"));
    for r in rows {
        let vs_fio = match (r.vs_fio, r.vs_fio_spread) {
            (Some(x), Some(spread)) => format!("{x:.2} ±{:.0}%", spread * 50.0),
            _ => "-".to_owned(),
        };
        out += &format!(
            "{:>9} {:<19} {:>8.3} {:>10.0} {:>13} {:<12} {:>6} {:>13} {:>24} {:>7} {:>8}\n",
            ByteSize(r.block_size).to_string(),
            label(r),
            r.gib_s,
            r.iops,
            format!("{:.3}-{:.3}", r.min_gib_s, r.max_gib_s),
            r.backend,
            if r.direct { "yes" } else { "no" },
            vs_fio,
            r.verdict.map_or("-".into(), |v| {
                let interval =
                    r.vs_fio.zip(r.vs_fio_spread).and_then(|(x, s)| spread_interval(x, s));
                verdict_text(v, interval)
            }),
            ratio(r.vs_qd1),
            r.verified.map_or("-", |v| if v { "yes" } else { "NO" })
        );
    }
    out +=
        "\nvs fio: the median over the rounds of the engine over the same round's run of the fio \
            kind with the fastest median (± half the ratios' spread)\ntargets: `engine` at least 0.95 of fio at the \
            batched depth and 0.9 at depth 1; `engine` at least 1.3x `engine-qd1`\n";
    let ceilings: Vec<String> = rows
        .iter()
        .filter_map(|r| {
            let kind = r.fio_ceiling?;
            let block = ByteSize(r.block_size);
            Some(format!("{block} {} against {kind}-qd{}", label(r), r.queue_depth))
        })
        .collect();
    if !ceilings.is_empty() {
        out +=
            &format!("fio ceilings (the kind with the fastest median): {}\n", ceilings.join("; "));
    }
    if rows.iter().any(|r| r.fio_huge_pages == Some(false)) {
        out += "fio ran without huge pages (too few reserved and free: vm.nr_hugepages), while \
                the engine's buffers ask for them: its ratios may flatter it\n";
    }
    out
}

/// The chart: GiB/s of every mode by block size, on a log scale.
pub fn chart(rows: &[SsdRow]) -> BarChart {
    let mut chart = BarChart::new("SSD engine: random O_DIRECT reads against fio", "GiB/s");
    chart.subtitle = "same file, block size and queue depth; median of the repeats".into();
    let mut sizes: Vec<u64> = rows.iter().map(|r| r.block_size).collect();
    sizes.dedup();
    let mut labels: Vec<String> = Vec::new();
    for r in rows {
        let l = label(r);
        if !labels.contains(&l) {
            labels.push(l);
        }
    }
    chart.groups = sizes.iter().map(|&s| format!("{} reads", ByteSize(s))).collect();
    chart.series = labels
        .iter()
        .map(|l| {
            let values = sizes
                .iter()
                .map(|&s| {
                    rows.iter().find(|r| r.block_size == s && label(r) == *l).map(|r| r.gib_s)
                })
                .collect();
            Series::new(l.clone(), values)
        })
        .collect();
    chart.log_y = true;
    chart
}
