//! Grouped bar charts written as SVG by hand: a title, a subtitle, a y axis with grid lines
//! (linear or logarithmic), one group of bars per category with its value printed above each
//! bar, a legend, and optional dashed reference lines (targets), named in the legend.
//!
//! ```
//! use umbp_bench::chart::{BarChart, Series};
//!
//! let mut chart = BarChart::new("ns per transfer", "ns");
//! chart.groups = vec!["localcopy".into(), "ssd".into()];
//! chart.series = vec![
//!     Series::new("batch", vec![Some(12.0), Some(9_000.0)]),
//!     Series::new("single", vec![Some(240.0), Some(60_000.0)]),
//! ];
//! chart.log_y = true;
//! let svg = chart.to_svg();
//! assert!(svg.starts_with("<svg") && svg.contains("localcopy"));
//! ```

use std::fmt::Write;

/// One series: a name for the legend and one value per group (`None`: no bar).
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// One value per group of the chart.
    pub values: Vec<Option<f64>>,
    /// Fill colour (`#rrggbb`); `None` takes the palette's colour for the series' position.
    pub color: Option<&'static str>,
}

impl Series {
    /// A series named `name` with `values`, one per group, in the palette's colour.
    pub fn new(name: impl Into<String>, values: Vec<Option<f64>>) -> Self {
        Self { name: name.into(), values, color: None }
    }

    /// The same series in `color` (`#rrggbb`).
    pub fn with_color(mut self, color: &'static str) -> Self {
        self.color = Some(color);
        self
    }

    fn fill(&self, position: usize) -> &'static str {
        self.color.unwrap_or(PALETTE[position % PALETTE.len()])
    }
}

/// A horizontal dashed line across the plot, named in the legend.
#[derive(Clone, Debug, PartialEq)]
pub struct Reference {
    /// Where the line lies on the y axis.
    pub value: f64,
    /// Its label.
    pub label: String,
}

/// A grouped bar chart. Fill the public fields, then call [`to_svg`](Self::to_svg).
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// Title, at the top.
    pub title: String,
    /// A line under the title (what was measured, on which machine); empty for none.
    pub subtitle: String,
    /// Label of the y axis (the unit).
    pub y_label: String,
    /// One label per group of bars, along the x axis.
    pub groups: Vec<String>,
    /// The series; series `s` draws bar `s` of every group.
    pub series: Vec<Series>,
    /// A logarithmic y axis (values that are not positive get no bar).
    pub log_y: bool,
    /// Optional reference lines (targets, ceilings).
    pub references: Vec<Reference>,
}

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 500.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 100.0;
const BOTTOM: f64 = 70.0;
const REFERENCE_COLOR: &str = "#c0392b";
const PALETTE: [&str; 8] =
    ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#9c755f"];

impl BarChart {
    /// An empty chart with a title and a y-axis label.
    pub fn new(title: impl Into<String>, y_label: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            subtitle: String::new(),
            y_label: y_label.into(),
            groups: Vec::new(),
            series: Vec::new(),
            log_y: false,
            references: Vec::new(),
        }
    }

    /// The chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let mut svg = String::new();
        let _ = self.write_svg(&mut svg);
        svg
    }

    fn write_svg(&self, out: &mut String) -> std::fmt::Result {
        let (plot_left, plot_right) = (LEFT, WIDTH - RIGHT);
        let (plot_top, plot_bottom) = (TOP, HEIGHT - BOTTOM);
        writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#
        )?;
        writeln!(out, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##)?;
        writeln!(
            out,
            r##"<text x="{}" y="28" font-size="18" font-weight="bold" text-anchor="middle" fill="#222">{}</text>"##,
            WIDTH / 2.0,
            escape(&self.title)
        )?;
        if !self.subtitle.is_empty() {
            writeln!(
                out,
                r##"<text x="{}" y="48" font-size="12" text-anchor="middle" fill="#555">{}</text>"##,
                WIDTH / 2.0,
                escape(&self.subtitle)
            )?;
        }
        self.write_legend(out, plot_top - 30.0)?;

        let scale = Scale::new(self);
        // Grid lines and tick labels.
        for tick in scale.ticks() {
            let y = scale.y(tick, plot_top, plot_bottom);
            writeln!(
                out,
                r##"<line x1="{plot_left}" y1="{y:.1}" x2="{plot_right}" y2="{y:.1}" stroke="#e3e3e3" stroke-width="1"/>"##
            )?;
            writeln!(
                out,
                r##"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end" fill="#333">{}</text>"##,
                plot_left - 6.0,
                y + 4.0,
                format_value(tick)
            )?;
        }
        // Axes.
        writeln!(
            out,
            r##"<line x1="{plot_left}" y1="{plot_top}" x2="{plot_left}" y2="{plot_bottom}" stroke="#333" stroke-width="1"/>"##
        )?;
        writeln!(
            out,
            r##"<line x1="{plot_left}" y1="{plot_bottom}" x2="{plot_right}" y2="{plot_bottom}" stroke="#333" stroke-width="1"/>"##
        )?;
        let mid_y = (plot_top + plot_bottom) / 2.0;
        let axis_label =
            if self.log_y { format!("{} (log scale)", self.y_label) } else { self.y_label.clone() };
        writeln!(
            out,
            r##"<text x="20" y="{mid_y:.1}" font-size="12" text-anchor="middle" fill="#333" transform="rotate(-90 20 {mid_y:.1})">{}</text>"##,
            escape(&axis_label)
        )?;

        // Bars, their values and the group labels. A group's bars are centred on it, so a
        // group where some series have no value has no gaps.
        let groups = self.groups.len().max(1);
        let group_width = (plot_right - plot_left) / groups as f64;
        let most = (0..self.groups.len()).map(|g| self.bars_in(g).len()).max().unwrap_or(1);
        let bar_width = (group_width * 0.8 / most.max(1) as f64).min(70.0);
        let label_size = if bar_width >= 34.0 { 10.0 } else { 9.0 };
        for (g, name) in self.groups.iter().enumerate() {
            let center = plot_left + group_width * (g as f64 + 0.5);
            let bars = self.bars_in(g);
            let first = center - bar_width * bars.len() as f64 / 2.0;
            for (k, &(s, value)) in bars.iter().enumerate() {
                let series = &self.series[s];
                let x = first + bar_width * k as f64;
                let top = scale.y(value, plot_top, plot_bottom).clamp(plot_top, plot_bottom);
                let base = scale.y(scale.base(), plot_top, plot_bottom).min(plot_bottom);
                let (y, h) = if top <= base { (top, base - top) } else { (base, top - base) };
                writeln!(
                    out,
                    r#"<rect x="{:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                    x + 1.0,
                    bar_width - 2.0,
                    h.max(0.5),
                    series.fill(s),
                    escape(&series.name),
                    format_value(value)
                )?;
                writeln!(
                    out,
                    r##"<text x="{:.1}" y="{:.1}" font-size="{label_size}" text-anchor="middle" fill="#222">{}</text>"##,
                    x + bar_width / 2.0,
                    y - 3.0,
                    format_value(value)
                )?;
            }
            // The group's label, wrapped onto a second and third line when it is wider than
            // its group.
            for (line, text) in wrap(name, group_width).iter().enumerate() {
                writeln!(
                    out,
                    r##"<text x="{center:.1}" y="{:.1}" font-size="12" text-anchor="middle" fill="#222">{}</text>"##,
                    plot_bottom + 18.0 + 14.0 * line as f64,
                    escape(text)
                )?;
            }
        }

        // Reference lines, drawn over the bars.
        for reference in &self.references {
            if self.log_y && reference.value <= 0.0 {
                continue;
            }
            let y = scale.y(reference.value, plot_top, plot_bottom);
            if !(plot_top..=plot_bottom).contains(&y) {
                continue;
            }
            writeln!(
                out,
                r##"<line x1="{plot_left}" y1="{y:.1}" x2="{plot_right}" y2="{y:.1}" stroke="{REFERENCE_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/>"##
            )?;
        }
        writeln!(out, "</svg>")
    }

    /// The bars of group `g`: (series index, value) of every series with a drawable value.
    fn bars_in(&self, g: usize) -> Vec<(usize, f64)> {
        self.series
            .iter()
            .enumerate()
            .filter_map(|(s, series)| Some((s, series.values.get(g).copied().flatten()?)))
            .filter(|&(_, v)| v.is_finite() && (!self.log_y || v > 0.0))
            .collect()
    }

    /// One row of legend entries centred at height `y`: a swatch per series (when there are
    /// several) and a dashed line per reference.
    fn write_legend(&self, out: &mut String, y: f64) -> std::fmt::Result {
        const SWATCH: f64 = 12.0;
        const LINE: f64 = 26.0;
        const CHAR: f64 = 7.0;
        let mut entries: Vec<(Option<&'static str>, &str)> = Vec::new();
        if self.series.len() > 1 {
            entries.extend(
                self.series
                    .iter()
                    .enumerate()
                    .map(|(s, series)| (Some(series.fill(s)), series.name.as_str())),
            );
        }
        entries.extend(self.references.iter().map(|r| (None, r.label.as_str())));
        let width = |(color, name): &(Option<&str>, &str)| {
            let mark = if color.is_some() { SWATCH } else { LINE };
            mark + 6.0 + CHAR * name.chars().count() as f64 + 22.0
        };
        let total: f64 = entries.iter().map(width).sum();
        let mut x = (WIDTH - total).max(0.0) / 2.0;
        for entry in &entries {
            let (color, name) = *entry;
            let mark = match color {
                Some(color) => {
                    writeln!(
                        out,
                        r#"<rect x="{x:.1}" y="{:.1}" width="{SWATCH}" height="{SWATCH}" fill="{color}"/>"#,
                        y - SWATCH + 2.0
                    )?;
                    SWATCH
                }
                None => {
                    writeln!(
                        out,
                        r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{REFERENCE_COLOR}" stroke-width="1.5" stroke-dasharray="6 4"/>"#,
                        y - 4.0,
                        x + LINE,
                        y - 4.0
                    )?;
                    LINE
                }
            };
            writeln!(
                out,
                r##"<text x="{:.1}" y="{y:.1}" font-size="12" fill="#222">{}</text>"##,
                x + mark + 6.0,
                escape(name)
            )?;
            x += width(entry);
        }
        Ok(())
    }
}

/// `label` split at spaces into lines that fit `width` pixels at 12 px (at most three lines).
fn wrap(label: &str, width: f64) -> Vec<String> {
    let fits = ((width - 6.0) / 7.0).max(4.0) as usize;
    let mut lines: Vec<String> = Vec::new();
    for word in label.split(' ') {
        let room =
            lines.last().is_some_and(|l| l.chars().count() + 1 + word.chars().count() <= fits);
        if lines.is_empty() || (!room && lines.len() < 3) {
            lines.push(word.to_owned());
        } else if let Some(line) = lines.last_mut() {
            line.push(' ');
            line.push_str(word);
        }
    }
    lines
}

/// The y axis: where values go and which ticks it shows.
struct Scale {
    log: bool,
    low: f64,
    high: f64,
}

impl Scale {
    fn new(chart: &BarChart) -> Self {
        let values = chart
            .series
            .iter()
            .flat_map(|s| s.values.iter().copied().flatten())
            .chain(chart.references.iter().map(|r| r.value))
            .filter(|v| v.is_finite());
        if chart.log_y {
            let positive: Vec<f64> = values.filter(|&v| v > 0.0).collect();
            let min = positive.iter().copied().fold(f64::INFINITY, f64::min);
            let max = positive.iter().copied().fold(0.0, f64::max);
            if positive.is_empty() {
                return Self { log: true, low: 1.0, high: 10.0 };
            }
            let low = 10f64.powf(min.log10().floor());
            let mut high = 10f64.powf(max.log10().ceil());
            if high <= low {
                high = low * 10.0;
            }
            Self { log: true, low, high }
        } else {
            let (mut min, mut max) = (0.0f64, 0.0f64);
            for v in values {
                min = min.min(v);
                max = max.max(v);
            }
            if max <= min {
                max = min + 1.0;
            }
            let step = nice_step((max - min) / 5.0);
            // Leave room above the tallest bar for its value label.
            let high = ((max * 1.08) / step).ceil() * step;
            let low = (min / step).floor() * step;
            Self { log: false, low, high }
        }
    }

    /// Where bars start: zero on a linear axis, the bottom on a logarithmic one.
    fn base(&self) -> f64 {
        if self.log {
            self.low
        } else {
            0.0
        }
    }

    fn y(&self, value: f64, top: f64, bottom: f64) -> f64 {
        let fraction = if self.log {
            (value.log10() - self.low.log10()) / (self.high.log10() - self.low.log10())
        } else {
            (value - self.low) / (self.high - self.low)
        };
        bottom - fraction * (bottom - top)
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (first, last) = (self.low.log10().round() as i32, self.high.log10().round() as i32);
            (first..=last).map(|e| 10f64.powi(e)).collect()
        } else {
            let step = nice_step((self.high - self.low) / 5.0);
            let count = ((self.high - self.low) / step).round() as usize;
            (0..=count).map(|k| self.low + step * k as f64).collect()
        }
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let scaled = raw / magnitude;
    let nice = if scaled <= 1.0 {
        1.0
    } else if scaled <= 2.0 {
        2.0
    } else if scaled <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// A value with about three significant digits; large ones with k or M.
pub fn format_value(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_owned()
    } else if a >= 1e6 {
        trim(format!("{:.2}", v / 1e6)) + "M"
    } else if a >= 1e4 {
        trim(format!("{:.1}", v / 1e3)) + "k"
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        trim(format!("{v:.1}"))
    } else if a >= 1.0 {
        trim(format!("{v:.2}"))
    } else if a >= 0.001 {
        // Three significant digits.
        let decimals = (2.0 - a.log10().floor()) as usize;
        trim(format!("{v:.decimals$}"))
    } else {
        format!("{v:.1e}")
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(log_y: bool) -> BarChart {
        let mut chart = BarChart::new("a <title>", "GiB/s");
        chart.subtitle = "sub & title".into();
        chart.groups = vec!["4KiB".into(), "64KiB".into(), "1MiB".into()];
        chart.series = vec![
            Series::new("engine", vec![Some(3.0), Some(9.5), None]),
            Series::new("ceiling", vec![Some(10.0), Some(10.0), Some(11.0)]),
        ];
        chart.log_y = log_y;
        chart.references = vec![Reference { value: 9.0, label: "90% of the ceiling".into() }];
        chart
    }

    #[test]
    fn every_bar_label_and_legend_entry_is_drawn_and_text_is_escaped() {
        for log_y in [false, true] {
            let svg = sample(log_y).to_svg();
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            assert_eq!(svg.matches("<rect x=").count(), 5 + 2, "5 bars and 2 swatches");
            assert_eq!(svg.matches("stroke-dasharray").count(), 2, "the line and its legend");
            for text in ["4KiB", "64KiB", "1MiB", ">engine<", ">ceiling<", "90% of the ceiling"] {
                assert!(svg.contains(text), "{text} missing");
            }
            assert!(svg.contains("a &lt;title&gt;") && svg.contains("sub &amp; title"));
            assert!(!svg.contains("NaN") && !svg.contains("inf"));
        }
    }

    #[test]
    fn long_labels_wrap_onto_lines_that_fit() {
        assert_eq!(wrap("plan 32KiB", 200.0), ["plan 32KiB"]);
        assert_eq!(wrap("batch vs single localcopy", 100.0), ["batch vs", "single", "localcopy"]);
        assert_eq!(wrap("a b c d e f g h", 40.0).len(), 3);
    }

    #[test]
    fn ticks_cover_the_values() {
        let linear = Scale::new(&sample(false));
        assert_eq!(linear.low, 0.0);
        assert!(linear.high >= 11.0);
        assert!(linear.ticks().len() >= 3);
        let log = Scale::new(&sample(true));
        assert_eq!((log.low, log.high), (1.0, 100.0));
        assert_eq!(log.ticks(), [1.0, 10.0, 100.0]);
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(130.0), 200.0);
    }

    #[test]
    fn values_format_with_three_digits() {
        let cases = [
            (0.0, "0"),
            (4.494, "4.49"),
            (0.0213, "0.0213"),
            (0.74, "0.74"),
            (15.12, "15.1"),
            (240.0, "240"),
            (52_000.0, "52k"),
            (3_250_000.0, "3.25M"),
        ];
        for (v, text) in cases {
            assert_eq!(format_value(v), text);
        }
    }
}
