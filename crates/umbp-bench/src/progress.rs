//! A progress line on stderr for long runs, drawn by `indicatif`.
//!
//! Shown only when stderr is a terminal and the caller asks for it (the command does not with
//! `--json`); otherwise the bar is hidden and every method costs next to nothing, so the
//! workloads call it unconditionally. indicatif's steady tick redraws the line four times a
//! second from its own thread, so the elapsed time moves even while one long step runs.
//!
//! The line reads `prefix section [=====-----] done/steps  step  12s`.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The progress line; see the [module docs](self).
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    /// Put before each section's name.
    prefix: Mutex<String>,
    /// Whether a step of the current section is running (so the next one finishes it).
    running: AtomicBool,
}

impl Progress {
    /// A progress line that never shows.
    pub fn quiet() -> Self {
        Self::with(ProgressBar::hidden())
    }

    /// A progress line on stderr when `wanted` and stderr is a terminal; quiet otherwise.
    pub fn on_stderr(wanted: bool) -> Self {
        if !wanted || !std::io::stderr().is_terminal() {
            return Self::quiet();
        }
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{prefix} [{bar:20}] {pos}/{len}  {msg:36!}  {elapsed}")
                .expect("a valid template")
                .progress_chars("==-");
        bar.set_style(style);
        bar.enable_steady_tick(Duration::from_millis(250));
        Self::with(bar)
    }

    fn with(bar: ProgressBar) -> Self {
        Self { bar, prefix: Mutex::new(String::new()), running: AtomicBool::new(false) }
    }

    /// Whether the line is shown at all.
    pub fn is_shown(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Text put before the section name (the tour uses `tour 2/3 ·`).
    pub fn set_prefix(&self, prefix: impl Into<String>) {
        *self.prefix.lock().unwrap_or_else(PoisonError::into_inner) = prefix.into();
    }

    /// Starts a section of `steps` steps; resets the count and the clock.
    ///
    /// The tick thread may draw between any two of these updates, so they go in an order
    /// where every state in between is true: the last section's step name goes first, then
    /// its count (before the new, perhaps smaller, total: never "11/4"), then the new total
    /// and name.
    pub fn section(&self, name: impl Into<String>, steps: usize) {
        let prefix = self.prefix.lock().unwrap_or_else(PoisonError::into_inner).clone();
        self.running.store(false, Ordering::Relaxed);
        self.bar.set_message("");
        self.bar.set_position(0);
        self.bar.set_length(steps as u64);
        self.bar.set_prefix(format!("{prefix}{}", name.into()));
        self.bar.reset_elapsed();
    }

    /// Marks the running step done (if any) and names the one that starts now: the new name
    /// first, so no frame shows the finished step beside the count that includes it.
    pub fn step(&self, name: impl Into<String>) {
        self.bar.set_message(name.into());
        if self.running.swap(true, Ordering::Relaxed)
            && self.bar.position() < self.bar.length().unwrap_or(0)
        {
            self.bar.inc(1);
        }
    }

    /// Runs `print` with the line cleared, then draws it again: for printing to the terminal.
    pub fn suspend<R>(&self, print: impl FnOnce() -> R) -> R {
        self.bar.suspend(print)
    }

    /// Steps done in the current section.
    #[cfg(test)]
    fn done(&self) -> u64 {
        self.bar.position()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_line_accepts_every_call_and_counts_steps() {
        let p = Progress::quiet();
        p.set_prefix("tour 1/3 · ");
        p.section("plan", 2);
        p.step("64KiB");
        assert_eq!(p.done(), 0, "the first step is running, not done");
        assert_eq!(p.suspend(|| 7), 7);
        p.step("32KiB");
        p.step("one too many");
        assert_eq!(p.done(), 2, "never past the section's steps");
        p.section("copy", 1);
        assert_eq!(p.done(), 0);
        assert!(!p.is_shown());
    }

    #[test]
    fn an_unwanted_line_is_quiet() {
        assert!(!Progress::on_stderr(false).is_shown());
    }
}
