//! A task's time limits (`--timeout`, `--idle-timeout`), decided on the
//! monotonic clock of the process that runs it: the attempt's shim (which
//! outlives the worker, so the limits hold through worker restarts,
//! coordinator failovers and while no coordinator is reachable), or the
//! worker for a built-in kind. Pure over the instants it is given; it never
//! reads the clock or signals anything.
//!
//! A pause (`tenure pause`) stops the task's group but not its run time: the
//! `--timeout` keeps counting while the task is paused, because a paused task
//! still holds its slot and its lease, and a pause must not be a way around
//! the limit. Its silence does not count: a stopped task cannot write, so
//! `--idle-timeout` counts only the time it was let run.

use std::time::{Duration, Instant};

use tenure_protocol::spec::{duration_text, TimeLimits, IDLE_TIMEOUT, TIMED_OUT};

/// A task's time limits on the monotonic clock of whoever runs it (its shim,
/// or the worker for a built-in kind), from the start: its
/// run time ([`TIMED_OUT`]) and its silence ([`IDLE_TIMEOUT`], from the last
/// byte of output). Pure over the instants it is given.
pub struct Deadlines {
    started: Instant,
    last_output: Instant,
    timeout: Option<Duration>,
    idle: Option<Duration>,
    /// Since when the task is paused (its silence is not counted).
    paused_since: Option<Instant>,
}

impl Deadlines {
    pub fn new(limits: Option<&TimeLimits>, now: Instant) -> Deadlines {
        let ms = |v: Option<u64>| v.map(Duration::from_millis);
        Deadlines {
            started: now,
            last_output: now,
            timeout: limits.and_then(|l| ms(l.timeout_ms)),
            idle: limits.and_then(|l| ms(l.idle_timeout_ms)),
            paused_since: None,
        }
    }

    /// The task was stopped at `now`; a repeated pause changes nothing.
    pub fn pause(&mut self, now: Instant) {
        self.paused_since.get_or_insert(now);
    }

    /// The task goes on at `now`: its silence counts again, less the pause.
    pub fn resume(&mut self, now: Instant) {
        if let Some(since) = self.paused_since.take() {
            self.last_output += now.saturating_duration_since(since);
        }
    }

    /// The idle limit, while it counts (not during a pause).
    fn idle(&self) -> Option<Duration> {
        self.idle.filter(|_| self.paused_since.is_none())
    }

    pub fn output(&mut self, now: Instant) {
        self.last_output = now;
    }

    /// How long until the nearest limit; `None` without limits.
    pub fn next_in(&self, now: Instant) -> Option<Duration> {
        let run = self.timeout.map(|t| (self.started + t).saturating_duration_since(now));
        let idle = self.idle().map(|t| (self.last_output + t).saturating_duration_since(now));
        run.into_iter().chain(idle).min()
    }

    /// The limit that has passed, as the failure's detail.
    pub fn passed(&self, now: Instant) -> Option<String> {
        if let Some(t) = self.timeout.filter(|t| now.saturating_duration_since(self.started) >= *t) {
            return Some(format!(
                "{TIMED_OUT}: ran longer than its timeout of {}",
                duration_text(t.as_millis() as u64)
            ));
        }
        let idle = self.idle().filter(|t| now.saturating_duration_since(self.last_output) >= *t)?;
        Some(format!(
            "{IDLE_TIMEOUT}: wrote no output for its idle timeout of {}",
            duration_text(idle.as_millis() as u64)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_limits_pass_on_run_time_and_on_silence() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let none = Deadlines::new(None, t0);
        assert_eq!((none.next_in(t0 + s(100)), none.passed(t0 + s(100_000))), (None, None));
        let limits = TimeLimits { timeout_ms: Some(10_000), idle_timeout_ms: Some(3_000) };
        let mut d = Deadlines::new(Some(&limits), t0);
        assert_eq!(d.next_in(t0), Some(s(3)));
        assert_eq!(d.passed(t0 + s(2)), None);
        // Output pushes the idle limit back, never the run-time one.
        d.output(t0 + s(2));
        assert_eq!(d.next_in(t0 + s(2)), Some(s(3)));
        assert_eq!(d.passed(t0 + s(4)), None);
        let idle = d.passed(t0 + s(5)).expect("silent for 3 s");
        assert!(idle.starts_with("idle-timeout: ") && idle.contains("3s"), "{idle}");
        for at in [8, 9] {
            d.output(t0 + s(at));
        }
        assert_eq!(d.next_in(t0 + s(9)), Some(s(1)));
        let run = d.passed(t0 + s(10)).expect("ran 10 s");
        assert!(run.starts_with("timed-out: ") && run.contains("10s"), "{run}");
        // A limit already passed is due now.
        assert_eq!(d.next_in(t0 + s(60)), Some(Duration::ZERO));
    }

    /// A pause stops the silence from counting, never the run time.
    #[test]
    fn a_pause_holds_the_idle_limit_and_not_the_timeout() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let limits = TimeLimits { timeout_ms: Some(100_000), idle_timeout_ms: Some(3_000) };
        let mut d = Deadlines::new(Some(&limits), t0);
        d.pause(t0 + s(2));
        d.pause(t0 + s(4)); // repeated: the first one counts
        assert_eq!(d.passed(t0 + s(50)), None, "paused for 48 s, silent for 2 s of running");
        assert_eq!(d.next_in(t0 + s(50)), Some(s(50)), "only the timeout is due while paused");
        d.resume(t0 + s(50));
        d.resume(t0 + s(60)); // repeated: nothing more
        assert_eq!(d.next_in(t0 + s(50)), Some(s(1)), "one more second of silence");
        assert!(d.passed(t0 + s(51)).is_some_and(|r| r.starts_with("idle-timeout: ")));
        // The run time went on through the pause.
        let mut d = Deadlines::new(Some(&TimeLimits { timeout_ms: Some(10_000), idle_timeout_ms: None }), t0);
        d.pause(t0 + s(1));
        assert!(d.passed(t0 + s(10)).is_some_and(|r| r.starts_with("timed-out: ")));
    }
}
