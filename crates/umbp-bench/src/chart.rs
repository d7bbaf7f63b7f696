//! Grouped bar charts as SVG, drawn with `plotters` (its SVG backend only): a title, a
//! subtitle, a y axis with grid lines (linear or logarithmic), one group of bars per category
//! with its value printed above each bar, a legend, and optional dashed reference lines
//! (targets), named in the legend. A value that cannot be drawn (not finite, or not positive
//! on a logarithmic axis) gets no bar and is named under the plot, never dropped silently.
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

use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One series: a name for the legend and one value per group (`None`: no bar).
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend label.
    pub name: String,
    /// One value per group of the chart.
    pub values: Vec<Option<f64>>,
    /// Fill colour (`#rrggbb`); `None` takes the palette's colour for the series' position.
    pub color: Option<&'static str>,
    /// Per group, the interval the value lies in, drawn as an error bar over its bar (none
    /// where `None` or missing).
    pub errors: Vec<Option<[f64; 2]>>,
}

impl Series {
    /// A series named `name` with `values`, one per group, in the palette's colour.
    pub fn new(name: impl Into<String>, values: Vec<Option<f64>>) -> Self {
        Self { name: name.into(), values, color: None, errors: Vec::new() }
    }

    /// The same series with an error bar per group: the interval each value lies in.
    pub fn with_errors(mut self, errors: Vec<Option<[f64; 2]>>) -> Self {
        self.errors = errors;
        self
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

const WIDTH: u32 = 860;
const HEIGHT: u32 = 500;
const REFERENCE_COLOR: &str = "#c0392b";
const FONT: &str = "sans-serif";
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
        {
            let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
            // The backend writes into a String, which cannot fail; a chart that plotters
            // refuses to lay out is left as far as it got.
            let _ = self.draw(&root);
            let _ = root.present();
        }
        svg
    }

    fn draw(&self, root: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), Failed> {
        root.fill(&WHITE)?;
        let centre = (WIDTH / 2) as i32;
        let title =
            (FONT, 22).into_font().style(FontStyle::Bold).color(&RGBColor(0x22, 0x22, 0x22));
        let middle = Pos::new(HPos::Center, VPos::Center);
        root.draw(&Text::new(self.title.clone(), (centre, 24), title.pos(middle)))?;
        let small = (FONT, 15).into_font().color(&RGBColor(0x55, 0x55, 0x55)).pos(middle);
        if !self.subtitle.is_empty() {
            root.draw(&Text::new(self.subtitle.clone(), (centre, 46), small.clone()))?;
        }
        let unplotted = self.unplotted();
        if !unplotted.is_empty() {
            let note = format!("no bar (not drawable on this axis): {}", unplotted.join(", "));
            root.draw(&Text::new(note, (centre, HEIGHT as i32 - 10), small))?;
        }
        let scale = Scale::new(self);
        let groups = self.groups.len().max(1) as f64;
        let mut builder = ChartBuilder::on(root);
        builder.margin_top(64).margin_right(30).margin_bottom(24).x_label_area_size(50);
        builder.y_label_area_size(80);
        if scale.log {
            let chart =
                builder.build_cartesian_2d(0.0..groups, (scale.low..scale.high).log_scale())?;
            self.plot(chart, &scale)
        } else {
            self.plot(builder.build_cartesian_2d(0.0..groups, scale.low..scale.high)?, &scale)
        }
    }

    fn plot<'a, Y>(
        &self,
        mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<RangedCoordf64, Y>>,
        scale: &Scale,
    ) -> Result<(), Failed>
    where
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
        Cartesian2d<RangedCoordf64, Y>: CoordTranslate<From = (f64, f64)>,
    {
        let axis_label =
            if self.log_y { format!("{} (log scale)", self.y_label) } else { self.y_label.clone() };
        let format = |v: &f64| format_value(*v);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_labels(if scale.log { scale.ticks().len() } else { 6 })
            .y_label_formatter(&format)
            .y_desc(axis_label)
            .light_line_style(TRANSPARENT)
            .bold_line_style(RGBColor(0xe3, 0xe3, 0xe3))
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .draw()?;

        // Bars, centred on their group (a group where some series have no value has no gaps),
        // each with its value above it.
        let most = (0..self.groups.len()).map(|g| self.bars_in(g).len()).max().unwrap_or(1);
        let width = 0.8 / most.max(1) as f64;
        let base = scale.base();
        let label_size = if most <= 2 { 12 } else { 11 };
        for (s, series) in self.series.iter().enumerate() {
            let color = series_color(series.fill(s));
            let mut errors = Vec::new();
            let bars: Vec<(f64, f64)> = (0..self.groups.len())
                .filter_map(|g| {
                    let bars = self.bars_in(g);
                    let k = bars.iter().position(|&(bs, _)| bs == s)?;
                    let first = g as f64 + 0.5 - width * bars.len() as f64 / 2.0;
                    let x = first + width * k as f64;
                    if let Some(&Some([low, high])) = series.errors.get(g) {
                        // Clipped to the plot; a log axis cannot show zero or less.
                        let floor = if self.log_y { scale.low } else { f64::MIN };
                        let (low, high) = (low.max(floor).max(scale.low), high.min(scale.high));
                        if low.is_finite() && high.is_finite() && low <= high {
                            errors.push((x + width / 2.0, low, high, width / 4.0));
                        }
                    }
                    Some((x, bars[k].1))
                })
                .collect();
            let drawn = chart.draw_series(bars.iter().map(|&(x, v)| {
                Rectangle::new([(x + 0.01 * width, base), (x + 0.99 * width, v)], color.filled())
            }))?;
            if self.series.len() > 1 {
                drawn.label(series.name.clone()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 6), (x + 12, y + 6)], color.filled())
                });
            }
            // Error bars: the interval each value lies in, with caps.
            let ink = RGBColor(0x22, 0x22, 0x22).stroke_width(1);
            chart.draw_series(errors.iter().flat_map(|&(x, low, high, cap)| {
                [
                    PathElement::new(vec![(x, low), (x, high)], ink),
                    PathElement::new(vec![(x - cap / 2.0, low), (x + cap / 2.0, low)], ink),
                    PathElement::new(vec![(x - cap / 2.0, high), (x + cap / 2.0, high)], ink),
                ]
            }))?;
            let above = (FONT, label_size)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Bottom));
            chart.draw_series(bars.iter().map(|&(x, v)| {
                EmptyElement::at((x + width / 2.0, v))
                    + Text::new(format_value(v), (0, -3), above.clone())
            }))?;
        }

        // Group labels under the axis, wrapped when wider than their group.
        let plot_width = chart.plotting_area().dim_in_pixel().0 as f64;
        let group_px = plot_width / self.groups.len().max(1) as f64;
        let under = (FONT, 15).into_font().color(&BLACK).pos(Pos::new(HPos::Center, VPos::Top));
        for (g, name) in self.groups.iter().enumerate() {
            for (line, text) in wrap(name, group_px).into_iter().enumerate() {
                let at = EmptyElement::at((g as f64 + 0.5, scale.low));
                chart
                    .plotting_area()
                    .draw(&(at + Text::new(text, (0, 8 + 14 * line as i32), under.clone())))?;
            }
        }

        // Reference lines, over the bars.
        let red = series_color(REFERENCE_COLOR);
        for reference in &self.references {
            let v = reference.value;
            if !v.is_finite() || v < scale.low || v > scale.high {
                continue;
            }
            let line = DashedLineSeries::new(
                vec![(0.0, v), (self.groups.len().max(1) as f64, v)],
                6,
                4,
                red.stroke_width(2),
            );
            chart.draw_series(line)?.label(reference.label.clone()).legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 26, y)], 6, 4, red.stroke_width(2))
            });
        }
        if self.series.len() > 1 || !self.references.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.6))
                .border_style(RGBColor(0xcc, 0xcc, 0xcc))
                .label_font((FONT, 14))
                .draw()?;
        }
        Ok(())
    }

    /// The bars of group `g`: (series index, value) of every series with a drawable value.
    fn bars_in(&self, g: usize) -> Vec<(usize, f64)> {
        self.series
            .iter()
            .enumerate()
            .filter_map(|(s, series)| Some((s, series.values.get(g).copied().flatten()?)))
            .filter(|&(_, v)| self.drawable(v))
            .collect()
    }

    fn drawable(&self, v: f64) -> bool {
        v.is_finite() && (!self.log_y || v > 0.0)
    }

    /// `series / group = value` for every value given that cannot be drawn.
    fn unplotted(&self) -> Vec<String> {
        let mut out = Vec::new();
        for series in &self.series {
            for (g, v) in series.values.iter().enumerate() {
                if let Some(v) = *v {
                    if !self.drawable(v) {
                        let group = self.groups.get(g).map_or("?", String::as_str);
                        out.push(format!("{} / {group} = {}", series.name, format_value(v)));
                    }
                }
            }
        }
        out
    }
}

/// What plotters reports when drawing fails (the SVG backend writes into a String, so only a
/// layout it refuses).
type Failed = DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>;

/// `#rrggbb` as a colour; black for anything else.
fn series_color(hex: &str) -> RGBColor {
    let channel =
        |at: usize| u8::from_str_radix(hex.get(at..at + 2).unwrap_or("00"), 16).unwrap_or(0);
    RGBColor(channel(1), channel(3), channel(5))
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

    /// The text of every `<text>` element, trimmed.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_owned()))
            .collect()
    }

    #[test]
    fn every_bar_label_and_legend_entry_is_drawn_and_text_is_escaped() {
        for log_y in [false, true] {
            let svg = sample(log_y).to_svg();
            let texts = texts(&svg);
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            // 5 bars of the two series' colours, plus their 2 legend swatches.
            let bars = svg.matches("#4E79A7").count() + svg.matches("#F28E2B").count();
            assert_eq!(bars, 5 + 2, "{svg}");
            for text in ["4KiB", "64KiB", "1MiB", "engine", "ceiling", "90% of the ceiling"] {
                assert!(texts.iter().any(|t| t == text), "{text} missing");
            }
            for value in ["3", "9.5", "10", "11"] {
                assert!(texts.iter().any(|t| t == value), "bar label {value} missing");
            }
            assert!(texts.iter().any(|t| t == "a &lt;title&gt;"), "escaped title");
            assert!(texts.iter().any(|t| t == "sub &amp; title"), "escaped subtitle");
            assert!(!svg.contains("NaN") && !svg.contains("inf"));
            assert!(!svg.contains("no bar"), "every value is drawable");
        }
    }

    #[test]
    fn values_that_cannot_be_drawn_are_named_not_dropped() {
        let mut chart = sample(true);
        chart.series[0].values[2] = Some(-156.9);
        let svg = chart.to_svg();
        let note = "no bar (not drawable on this axis): engine / 1MiB = -157";
        assert!(texts(&svg).iter().any(|t| t == note), "{svg}");
        chart.log_y = false;
        assert!(!chart.to_svg().contains("no bar"), "a linear axis draws negative bars");
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
