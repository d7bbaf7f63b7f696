//! A progress line on stderr for long runs.
//!
//! Shown only when stderr is a terminal and the caller asks for it (the command does not with
//! `--json`); otherwise every method is a no-op, so the workloads call it unconditionally. A
//! background thread redraws the line four times a second (the elapsed time moves even while
//! one long step runs); it sleeps on a condition variable in between, so it costs the
//! measurements nothing measurable.
//!
//! The line reads `prefix section [=====-----] done/steps  step  12s`.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The progress line; see the [module docs](self).
#[derive(Debug)]
pub struct Progress {
    shown: Option<Shown>,
}

#[derive(Debug)]
struct Shown {
    shared: Arc<Shared>,
    ticker: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Debug)]
struct State {
    prefix: String,
    section: String,
    steps: usize,
    done: usize,
    step: String,
    running: bool,
    started: Instant,
    /// Nothing is drawn until the next `section` or `step` (the caller prints meanwhile).
    hidden: bool,
    /// A line is on the screen and must be cleared before anything else is printed.
    drawn: bool,
    stop: bool,
}

const REDRAW: Duration = Duration::from_millis(250);
const BAR: usize = 20;

impl Progress {
    /// A progress line that never shows.
    pub fn quiet() -> Self {
        Self { shown: None }
    }

    /// A progress line on stderr when `wanted` and stderr is a terminal; quiet otherwise.
    pub fn on_stderr(wanted: bool) -> Self {
        if !wanted || !std::io::stderr().is_terminal() {
            return Self::quiet();
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                prefix: String::new(),
                section: String::new(),
                steps: 0,
                done: 0,
                step: String::new(),
                running: false,
                started: Instant::now(),
                hidden: true,
                drawn: false,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let ticker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("umbp-bench-progress".into())
                .spawn(move || tick(&shared))
                .ok()
        };
        Self { shown: Some(Shown { shared, ticker }) }
    }

    /// Whether the line is shown at all.
    pub fn is_shown(&self) -> bool {
        self.shown.is_some()
    }

    /// Text put before the section name (the tour uses `tour 2/3 ·`).
    pub fn set_prefix(&self, prefix: impl Into<String>) {
        self.update(|s| s.prefix = prefix.into());
    }

    /// Starts a section of `steps` steps; resets the count and the clock.
    pub fn section(&self, name: impl Into<String>, steps: usize) {
        self.update(|s| {
            s.section = name.into();
            s.steps = steps;
            s.done = 0;
            s.step.clear();
            s.running = false;
            s.started = Instant::now();
            s.hidden = false;
        });
    }

    /// Marks the running step done (if any) and names the one that starts now.
    pub fn step(&self, name: impl Into<String>) {
        self.update(|s| {
            if s.running {
                s.done = (s.done + 1).min(s.steps);
            }
            s.step = name.into();
            s.running = true;
            s.hidden = false;
        });
    }

    /// Clears the line and keeps it hidden until the next [`section`](Self::section) or
    /// [`step`](Self::step): call it before printing to the terminal.
    pub fn suspend(&self) {
        if let Some(shown) = &self.shown {
            let mut state = lock(&shown.shared.state);
            state.hidden = true;
            clear(&mut state);
        }
    }

    fn update(&self, change: impl FnOnce(&mut State)) {
        if let Some(shown) = &self.shown {
            let mut state = lock(&shown.shared.state);
            change(&mut state);
            draw(&mut state);
            shown.shared.wake.notify_one();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(shown) = &mut self.shown {
            {
                let mut state = lock(&shown.shared.state);
                state.stop = true;
                clear(&mut state);
            }
            shown.shared.wake.notify_one();
            if let Some(ticker) = shown.ticker.take() {
                let _ = ticker.join();
            }
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The ticker thread: redraws every [`REDRAW`] until told to stop.
fn tick(shared: &Shared) {
    let mut state = lock(&shared.state);
    while !state.stop {
        draw(&mut state);
        state = shared.wake.wait_timeout(state, REDRAW).unwrap_or_else(PoisonError::into_inner).0;
    }
}

fn draw(state: &mut State) {
    if state.hidden || state.stop || state.section.is_empty() {
        return;
    }
    let filled = (state.done * BAR).checked_div(state.steps).unwrap_or(0).min(BAR);
    let mut step: String = state.step.chars().take(36).collect();
    if step.len() < state.step.len() {
        step.push('~');
    }
    let line = format!(
        "\r\x1b[2K{}{} [{}{}] {}/{}  {}  {:.0}s",
        state.prefix,
        state.section,
        "=".repeat(filled),
        "-".repeat(BAR - filled),
        state.done,
        state.steps,
        step,
        state.started.elapsed().as_secs_f64()
    );
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(line.as_bytes());
    let _ = err.flush();
    state.drawn = true;
}

fn clear(state: &mut State) {
    if state.drawn {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(b"\r\x1b[2K");
        let _ = err.flush();
        state.drawn = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_line_accepts_every_call() {
        let p = Progress::quiet();
        p.set_prefix("tour 1/3 · ");
        p.section("plan", 2);
        p.step("64KiB");
        p.suspend();
        p.step("32KiB");
        assert!(!p.is_shown());
    }

    #[test]
    fn an_unwanted_line_is_quiet() {
        assert!(!Progress::on_stderr(false).is_shown());
    }
}
