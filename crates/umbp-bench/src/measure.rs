//! Figures that cannot flatter: every timed figure with its spread, differences that stay
//! inside their own noise called so instead of turned into ratios, and verdicts that never count
//! noise as a met target.
//!
//! - [`Timed`]: the median of a figure's repetitions and their spread, `(max − min) / median`.
//! - [`Difference`]: a path's time minus its floor's, paired iteration by iteration (the two ran
//!   back to back, so drift of a shared machine cancels). Its *noise* is half the interquartile
//!   range of those differences. A difference whose median does not stand above its noise (a
//!   cost smaller than the measurement can see, or a negative one) is **below noise**: it has no
//!   value, only a bound.
//! - [`ratio_range`]: the range a ratio of two throughputs measured in turns spans over their
//!   repetitions, `[min a / max b, max a / min b]`.
//! - [`Verdict`]: `met`, `unmet`, `within noise` (the target lies inside the figure's spread)
//!   or `below noise` (the figure has no value). Only `met` counts as met.

use serde::Serialize;

/// The median of a figure's repetitions and their spread.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct Timed {
    /// The median.
    pub median: f64,
    /// `(max − min) / median` (0 for one repetition or a zero median).
    pub spread: f64,
}

impl Timed {
    /// The figure of `samples` (none: zero).
    pub fn of(samples: &[f64]) -> Self {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
        let range = match (sorted.first(), sorted.last()) {
            (Some(lo), Some(hi)) => hi - lo,
            _ => 0.0,
        };
        let spread = if median > 0.0 { range / median } else { 0.0 };
        Self { median, spread }
    }
}

/// A path's time minus its floor's, paired by iteration: the cost the path adds.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct Difference {
    /// The median of the differences (may be zero or negative when the cost is below noise).
    pub median: f64,
    /// Half the interquartile range of the differences.
    pub noise: f64,
}

impl Difference {
    /// The differences `path[i] − floor[i]`.
    pub fn of(path: &[f64], floor: &[f64]) -> Self {
        let mut d: Vec<f64> = path.iter().zip(floor).map(|(p, f)| p - f).collect();
        d.sort_by(f64::total_cmp);
        let at = |q: f64| d.get(((d.len().saturating_sub(1)) as f64 * q).round() as usize);
        let median = d.get(d.len() / 2).copied().unwrap_or(0.0);
        let noise = match (at(0.25), at(0.75)) {
            (Some(lo), Some(hi)) => (hi - lo) / 2.0,
            _ => 0.0,
        };
        Self { median, noise }
    }

    /// The median, when it stands above the noise (and above zero); `None`: below noise.
    pub fn value(&self) -> Option<f64> {
        (self.median > self.noise.max(0.0)).then_some(self.median)
    }

    /// `self / other` when both stand above their noise; `None` otherwise.
    pub fn ratio_to(&self, other: &Difference) -> Option<f64> {
        Some(self.value()? / other.value()?)
    }

    /// The range `self / other` spans within both noises, `[low, high]` (`high` infinite when
    /// `other`'s noise reaches zero); `None` when the ratio has no value.
    pub fn ratio_range(&self, other: &Difference) -> Option<[f64; 2]> {
        self.ratio_to(other)?;
        let low = (self.median - self.noise).max(0.0) / (other.median + other.noise);
        let floor = other.median - other.noise;
        let high = if floor > 0.0 { (self.median + self.noise) / floor } else { f64::INFINITY };
        Some([low, high])
    }
}

/// The range the ratio `a / b` of two figures measured in turns spans over their repetitions:
/// `[min a / max b, max a / min b]`. `None` when either has no repetition or a repetition of
/// `b` is not positive. Where [`Difference::ratio_range`] bounds a ratio of costs by their
/// noise, this bounds a ratio of throughputs by their whole spread, so a target inside it is
/// [`Verdict::WithinNoise`] under [`Verdict::range_at_least`].
pub fn ratio_range(a: &[f64], b: &[f64]) -> Option<[f64; 2]> {
    let min = |x: &[f64]| x.iter().copied().reduce(f64::min);
    let max = |x: &[f64]| x.iter().copied().reduce(f64::max);
    let (b_min, b_max) = (min(b)?, max(b)?);
    if b_min <= 0.0 {
        return None;
    }
    Some([min(a)? / b_max, max(a)? / b_min])
}

/// How a figure compares with its target.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Verdict {
    /// The figure reaches the target, by more than its spread.
    #[serde(rename = "met")]
    Met,
    /// The figure misses the target, by more than its spread.
    #[serde(rename = "unmet")]
    Unmet,
    /// The target lies inside the figure's own spread: neither met nor missed.
    #[serde(rename = "within noise")]
    WithinNoise,
    /// The figure is a difference smaller than its noise: it has no value to compare.
    #[serde(rename = "below noise")]
    BelowNoise,
}

impl Verdict {
    /// `value` against a target it must reach (`at least`), with the figure's relative spread.
    pub fn at_least(value: Option<f64>, target: f64, spread: f64) -> Self {
        Self::judge(value, target, spread, |v| v >= target)
    }

    /// A ratio known to lie in `range` against a target it must reach: met only when the whole
    /// range reaches it, unmet when none does, within noise otherwise.
    pub fn range_at_least(range: Option<[f64; 2]>, target: f64) -> Self {
        match range {
            None => Verdict::BelowNoise,
            Some([low, _]) if low >= target => Verdict::Met,
            Some([_, high]) if high < target => Verdict::Unmet,
            Some(_) => Verdict::WithinNoise,
        }
    }

    /// A figure known to lie in `range` against a target it must not exceed: met only when
    /// the whole range stays at or below it, unmet when none does, within noise otherwise.
    pub fn range_at_most(range: Option<[f64; 2]>, target: f64) -> Self {
        match range {
            None => Verdict::BelowNoise,
            Some([_, high]) if high <= target => Verdict::Met,
            Some([low, _]) if low > target => Verdict::Unmet,
            Some(_) => Verdict::WithinNoise,
        }
    }

    /// `value` against a target it must not exceed (`at most`).
    pub fn at_most(value: Option<f64>, target: f64, spread: f64) -> Self {
        Self::judge(value, target, spread, |v| v <= target)
    }

    fn judge(value: Option<f64>, target: f64, spread: f64, ok: impl Fn(f64) -> bool) -> Self {
        match value {
            None => Verdict::BelowNoise,
            Some(v) if spread > 0.0 && (v - target).abs() <= v.abs() * spread => {
                Verdict::WithinNoise
            }
            Some(v) if ok(v) => Verdict::Met,
            Some(_) => Verdict::Unmet,
        }
    }

    /// Whether the target was met (only [`Verdict::Met`]).
    pub fn is_met(self) -> bool {
        self == Verdict::Met
    }

    /// The verdict in words, as tables print it.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::Unmet => "unmet",
            Verdict::WithinNoise => "within noise",
            Verdict::BelowNoise => "below noise",
        }
    }
}

/// The 1-minute load average (0 where `/proc/loadavg` cannot be read).
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A line saying which TCP congestion control the rows over loopback ran under: the kernel's
/// default (`/proc/sys/net/ipv4/tcp_congestion_control`) for the peers, and for umbp's
/// connections what `umbp_remote::Congestion::Auto` makes of it (BBR paces; umbp's on-host
/// connections leave it, the peers' do not, so their rows are read against it).
pub fn congestion_line() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control");
    match kernel.as_deref().map(str::trim) {
        Ok(name) if name.starts_with("bbr") => format!(
            "loopback TCP: the kernel's congestion control is {name}, which paces: the peers' \
             connections run under it, umbp's leave it for cubic or reno (RemoteConfig::congestion)"
        ),
        Ok(name) => format!("loopback TCP: every connection runs the kernel's {name}"),
        Err(_) => "loopback TCP: the kernel's congestion control is unknown".to_owned(),
    }
}

/// The CPUs this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Past this spread (`(max − min) / median`), a figure's repetitions disagree by more than
/// half its value: it measures the machine's other work as much as the code.
pub const BUSY_SPREAD: f64 = 0.5;

/// The warning a run's figures carry when they cannot be read as measurements: the machine's
/// load average at or above its CPUs (other work took turns with the timed code), or a
/// figure's spread past [`BUSY_SPREAD`]. `None` on a quiet machine.
pub fn busy_warning(max_spread: f64, load: f64, cpus: usize) -> Option<String> {
    let loaded = load >= cpus as f64;
    if !loaded && max_spread <= BUSY_SPREAD {
        return None;
    }
    let mut why = Vec::new();
    if loaded {
        why.push(format!("load average {load:.1} on {cpus} CPUs"));
    }
    if max_spread > BUSY_SPREAD {
        why.push(format!("spreads up to {:.0} %", max_spread * 100.0));
    }
    Some(format!(
        "WARNING: the machine was busy ({}): these figures measure its other work as much as \
         the code, and are no regression or gain. Rerun on an idle machine, and compare ratios \
         within one run only.",
        why.join(", ")
    ))
}

/// `value` give or take `spread` (relative), the interval [`Verdict::at_least`] and
/// [`Verdict::at_most`] judge it by; `None` without a spread.
pub fn spread_interval(value: f64, spread: f64) -> Option<[f64; 2]> {
    let d = value.abs() * spread;
    (spread > 0.0 && d.is_finite()).then_some([value - d, value + d])
}

/// A verdict in words with the interval behind it, as tables print it:
/// `within noise [0.68, 0.96]`; the bare verdict without an interval.
pub fn verdict_text(verdict: Verdict, interval: Option<[f64; 2]>) -> String {
    match interval {
        Some([low, high]) => format!("{} [{low:.2}, {high:.2}]", verdict.as_str()),
        None => verdict.as_str().to_owned(),
    }
}

/// A ratio for a table: two decimals, or `below noise` when it has no value.
pub fn ratio_text(ratio: Option<f64>) -> String {
    ratio.map_or_else(|| "below noise".to_owned(), |r| format!("{r:.2}"))
}

/// A ratio with its range for a table: `18.5 [12.1, 35.0]`, or `below noise`.
pub fn range_text(ratio: Option<f64>, range: Option<[f64; 2]>) -> String {
    match (ratio, range) {
        (Some(r), Some([low, high])) => format!("{r:.1} [{low:.1}, {high:.1}]"),
        _ => "below noise".to_owned(),
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_busy_machine_is_named_and_a_quiet_one_is_not() {
        assert_eq!(busy_warning(0.2, 0.5, 2), None);
        assert_eq!(busy_warning(BUSY_SPREAD, 1.9, 2), None);
        let spread = busy_warning(4.09, 0.3, 2).unwrap();
        assert!(spread.contains("spreads up to 409 %") && !spread.contains("load"), "{spread}");
        let load = busy_warning(0.1, 4.5, 2).unwrap();
        assert!(load.contains("load average 4.5 on 2 CPUs") && !load.contains("spreads"), "{load}");
        let both = busy_warning(0.8, 2.0, 2).unwrap();
        assert!(both.contains("load average 2.0 on 2 CPUs, spreads up to 80 %"), "{both}");
    }

    use super::*;

    #[test]
    fn a_cost_inside_its_noise_or_negative_has_no_value_and_no_ratio() {
        // The path is as fast as its floor, give or take: differences straddle zero.
        let floor = [100.0, 101.0, 99.0, 100.0, 102.0];
        let path = [100.5, 100.0, 100.0, 101.0, 101.5];
        let d = Difference::of(&path, &floor);
        assert_eq!(d.value(), None);
        let single = Difference::of(&[150.0; 5], &floor);
        assert_eq!(single.ratio_to(&d), None, "never a ratio over noise");
        assert_eq!(Verdict::at_least(single.ratio_to(&d), 10.0, 0.0), Verdict::BelowNoise);
        assert!(!Verdict::BelowNoise.is_met());
        // A path faster than its floor: a negative median is below noise, never a value.
        let faster = Difference::of(&[90.0, 91.0, 92.0], &[100.0, 100.0, 100.0]);
        assert!(faster.median < 0.0 && faster.value().is_none());
    }

    #[test]
    fn a_cost_clear_of_its_noise_gives_a_ratio() {
        let floor = [100.0, 101.0, 99.0, 100.0, 102.0];
        let batch = Difference::of(&[110.0, 111.0, 109.0, 110.0, 112.0], &floor);
        let single = Difference::of(&[200.0, 201.0, 199.0, 200.0, 202.0], &floor);
        assert_eq!(batch.value(), Some(10.0));
        assert_eq!(single.ratio_to(&batch), Some(10.0));
        let [low, high] = single.ratio_range(&batch).unwrap();
        assert!(low <= 10.0 && 10.0 <= high && low > 0.0, "{low} {high}");
        assert_eq!(Verdict::range_at_least(Some([11.0, 30.0]), 10.0), Verdict::Met);
        assert_eq!(Verdict::range_at_least(Some([9.0, 30.0]), 10.0), Verdict::WithinNoise);
        assert_eq!(Verdict::range_at_least(Some([2.0, 9.0]), 10.0), Verdict::Unmet);
        assert_eq!(Verdict::range_at_most(Some([2.0, 9.0]), 10.0), Verdict::Met);
        assert_eq!(Verdict::range_at_most(Some([9.0, 30.0]), 10.0), Verdict::WithinNoise);
        assert_eq!(Verdict::range_at_most(Some([11.0, 30.0]), 10.0), Verdict::Unmet);
        assert_eq!(Verdict::range_at_most(None, 10.0), Verdict::BelowNoise);
        assert_eq!(Verdict::at_least(Some(10.0), 10.0, 0.0), Verdict::Met);
        assert_eq!(Verdict::at_least(Some(9.0), 10.0, 0.0), Verdict::Unmet);
    }

    #[test]
    fn a_target_inside_the_spread_is_within_noise_never_met() {
        assert_eq!(Verdict::at_least(Some(1.55), 1.5, 0.10), Verdict::WithinNoise);
        assert_eq!(Verdict::at_most(Some(1.12), 1.1, 0.05), Verdict::WithinNoise);
        assert_eq!(Verdict::at_most(Some(1.0), 1.1, 0.05), Verdict::Met);
        assert_eq!(Verdict::at_most(Some(1.3), 1.1, 0.05), Verdict::Unmet);
    }

    #[test]
    fn a_throughput_ratio_spans_both_spreads() {
        let engine = [0.9, 1.0, 1.1];
        let reference = [1.0, 1.2];
        let [low, high] = ratio_range(&engine, &reference).unwrap();
        assert!((low - 0.75).abs() < 1e-12 && (high - 1.1).abs() < 1e-12, "{low} {high}");
        // 0.8 lies inside: neither met nor missed.
        assert_eq!(Verdict::range_at_least(Some([low, high]), 0.8), Verdict::WithinNoise);
        assert_eq!(ratio_range(&engine, &[]), None);
        assert_eq!(ratio_range(&engine, &[0.0, 1.0]), None);
    }

    #[test]
    fn a_verdict_within_noise_is_printed_with_its_interval() {
        let interval = spread_interval(0.82, 0.17);
        let [low, high] = interval.unwrap();
        assert!((low - 0.6806).abs() < 1e-9 && (high - 0.9594).abs() < 1e-9, "{low} {high}");
        assert_eq!(Verdict::at_least(Some(0.82), 0.9, 0.17), Verdict::WithinNoise);
        assert_eq!(verdict_text(Verdict::WithinNoise, interval), "within noise [0.68, 0.96]");
        assert_eq!(verdict_text(Verdict::Met, None), "met");
        assert_eq!(spread_interval(1.0, 0.0), None);
    }

    #[test]
    fn timed_figures_carry_their_spread() {
        let t = Timed::of(&[2.0, 1.0, 3.0]);
        assert_eq!((t.median, t.spread), (2.0, 1.0));
        assert_eq!(Timed::of(&[]).median, 0.0);
    }
}
