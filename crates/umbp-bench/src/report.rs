//! What one subcommand produced and where it goes: a human table or JSON lines on stdout, and
//! with `--out DIR` the JSON lines in `DIR/<name>.jsonl` and a chart in `DIR/<name>.svg`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::chart::BarChart;

/// A subcommand's results, ready to print and save.
#[derive(Clone, Debug)]
pub struct Report {
    /// The subcommand's name: the stem of the files `--out` writes.
    pub name: &'static str,
    /// One JSON object per row.
    pub json_lines: Vec<String>,
    /// The human-readable table, ending in a newline.
    pub table: String,
    /// The chart `--out` writes, if the subcommand has one.
    pub chart: Option<BarChart>,
}

impl Report {
    /// A report of `rows`, serialized one JSON object per row.
    pub fn new<T: Serialize>(
        name: &'static str,
        rows: &[T],
        table: String,
        chart: Option<BarChart>,
    ) -> anyhow::Result<Self> {
        let json_lines = rows
            .iter()
            .map(serde_json::to_string)
            .collect::<Result<_, _>>()
            .with_context(|| format!("serializing the {name} rows"))?;
        Ok(Self { name, json_lines, table, chart })
    }

    /// Writes the JSON lines (`json`) or the table to `out`.
    pub fn print(&self, json: bool, out: &mut impl Write) -> std::io::Result<()> {
        if json {
            for line in &self.json_lines {
                writeln!(out, "{line}")?;
            }
        } else {
            out.write_all(self.table.as_bytes())?;
        }
        out.flush()
    }

    /// Writes `dir/<name>.jsonl` and, with a chart, `dir/<name>.svg`; creates `dir` if needed.
    /// Returns the paths written.
    pub fn save(&self, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut written = Vec::new();
        let jsonl = dir.join(format!("{}.jsonl", self.name));
        let mut text = self.json_lines.join("\n");
        text.push('\n');
        std::fs::write(&jsonl, text).with_context(|| format!("writing {}", jsonl.display()))?;
        written.push(jsonl);
        if let Some(chart) = &self.chart {
            let svg = dir.join(format!("{}.svg", self.name));
            std::fs::write(&svg, chart.to_svg())
                .with_context(|| format!("writing {}", svg.display()))?;
            written.push(svg);
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Row {
        a: u32,
    }

    #[test]
    fn prints_and_saves_json_lines_and_the_chart() {
        let report = Report::new(
            "demo",
            &[Row { a: 1 }, Row { a: 2 }],
            "a table\n".into(),
            Some(BarChart::new("t", "y")),
        )
        .unwrap();
        let mut out = Vec::new();
        report.print(true, &mut out).unwrap();
        assert_eq!(out, b"{\"a\":1}\n{\"a\":2}\n");
        out.clear();
        report.print(false, &mut out).unwrap();
        assert_eq!(out, b"a table\n");
        let dir = tempfile::tempdir().unwrap();
        let written = report.save(&dir.path().join("new")).unwrap();
        assert_eq!(written.len(), 2);
        let jsonl = std::fs::read_to_string(&written[0]).unwrap();
        assert_eq!(jsonl, "{\"a\":1}\n{\"a\":2}\n");
        assert!(std::fs::read_to_string(&written[1]).unwrap().starts_with("<svg"));
    }
}
