//! The table and the chart of `umbp-bench ssd`'s rows ([`ssd_bench`](crate::ssd_bench) measures
//! them).

use crate::chart::{BarChart, Series};
use crate::size::ByteSize;
use crate::ssd_bench::SsdRow;

/// A row's name in the table and the chart: its mode and queue depth (`fio` at depth 1 is
/// `fio-qd1`).
fn label(r: &SsdRow) -> String {
    match r.mode {
        "fio" if r.queue_depth == 1 => "fio-qd1".to_owned(),
        "engine" | "fio" => format!("{}-qd{}", r.mode, r.queue_depth),
        mode => mode.to_owned(),
    }
}

/// The human table, with the targets of each block size.
pub fn table(rows: &[SsdRow]) -> String {
    let mut out =
        String::from("SSD engine: random O_DIRECT reads against fio (io_uring), same file\n\n");
    out += &format!(
        "{:>9} {:<11} {:>5} {:>8} {:>10} {:>13} {:<12} {:>6} {:>7} {:>7} {:>8}\n",
        "block",
        "mode",
        "depth",
        "GiB/s",
        "IOPS",
        "GiB/s min-max",
        "backend",
        "direct",
        "vs fio",
        "vs qd1",
        "verified"
    );
    let ratio = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.2}"));
    for r in rows {
        out += &format!(
            "{:>9} {:<11} {:>5} {:>8.3} {:>10.0} {:>13} {:<12} {:>6} {:>7} {:>7} {:>8}\n",
            ByteSize(r.block_size).to_string(),
            label(r),
            r.queue_depth,
            r.gib_s,
            r.iops,
            format!("{:.3}-{:.3}", r.min_gib_s, r.max_gib_s),
            r.backend,
            if r.direct { "yes" } else { "no" },
            ratio(r.vs_fio),
            ratio(r.vs_qd1),
            r.verified.map_or("-", |v| if v { "yes" } else { "NO" })
        );
    }
    out += "\ntargets: `engine` at least 0.95 of fio at the same depth for 256KiB reads; \
            `engine` at least 1.3x `engine-qd1`\n";
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
