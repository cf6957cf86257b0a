//! Built-in kinds that run inside the worker process, without spawning
//! anything: `noop` (completes at once) and `sleep` (waits the number of
//! milliseconds given as its command, and can be killed).
//!
//! They exist to measure and exercise the runtime itself: a built-in attempt
//! goes through the same durable steps as a shell attempt — accepted, intent
//! flushed, started reported, outcome buffered as `exited`, reported until
//! acknowledged, acknowledged — only the shim and the process are missing.
//! Their "process" is a future of the worker: it dies with the worker, and a
//! restarted worker finds an intent without a shim and reports the attempt
//! lost (`maybe-ran`), as it would for a shell attempt whose shim vanished.
//!
//! This module must never spawn a process or touch the attempt's files.

use std::time::{Duration, Instant};

use tenure_protocol::{Ending, Kind, Outcome, TaskSpec};

use crate::limits::Deadlines;
use tokio::sync::Notify;

/// Longest `sleep` accepted (one day): a typo must not hold a slot for years.
pub const MAX_SLEEP_MS: u64 = 24 * 3600 * 1000;

/// A kind this module runs in process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    Noop,
    Sleep,
}

impl Builtin {
    /// The built-in behind `kind`, if any.
    pub fn of(kind: &Kind) -> Option<Builtin> {
        match kind.as_str() {
            "noop" => Some(Builtin::Noop),
            "sleep" => Some(Builtin::Sleep),
            _ => None,
        }
    }

    /// Runs the attempt to its outcome; a kill ends a sleep at once, and so
    /// does a time limit (a sleep writes no output: its idle timeout counts
    /// from its start, like its timeout).
    pub async fn run(self, spec: &TaskSpec, kill: &Notify) -> Outcome {
        match self {
            Builtin::Noop => Outcome::new(Ending::Completed, Some(0), None),
            Builtin::Sleep => {
                let ms = match parse_sleep(&spec.command) {
                    Ok(ms) => ms,
                    Err(detail) => return Outcome::new(Ending::Failed, None, Some(detail)),
                };
                let deadlines = Deadlines::new(spec.limits.as_deref(), Instant::now());
                let limit = deadlines.next_in(Instant::now()).unwrap_or(Duration::MAX);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(ms)) => Outcome::new(Ending::Completed, Some(0), None),
                    _ = tokio::time::sleep(limit), if limit < Duration::from_millis(ms) => {
                        let reason = deadlines.passed(Instant::now()).unwrap_or_else(|| "timed-out".into());
                        Outcome::new(Ending::Failed, None, Some(reason))
                    }
                    _ = kill.notified() => Outcome::new(Ending::Killed, None, Some(format!("killed during a sleep of {ms} ms"))),
                }
            }
        }
    }
}

/// The command of a `sleep` task: a whole number of milliseconds, at most a day.
fn parse_sleep(command: &str) -> Result<u64, String> {
    let text = command.trim();
    match text.parse::<u64>() {
        Ok(ms) if ms <= MAX_SLEEP_MS => Ok(ms),
        Ok(ms) => Err(format!("sleep of {ms} ms refused: at most {MAX_SLEEP_MS} ms")),
        Err(_) => {
            Err(format!("sleep expects a number of milliseconds, got {:?}", text.chars().take(80).collect::<String>()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::spec::TimeLimits;

    #[test]
    fn kinds_are_recognised_by_name() {
        assert_eq!(Builtin::of(&"noop".parse().unwrap()), Some(Builtin::Noop));
        assert_eq!(Builtin::of(&"sleep".parse().unwrap()), Some(Builtin::Sleep));
        assert_eq!(Builtin::of(&Kind::shell()), None);
    }

    #[test]
    fn sleep_commands_are_checked() {
        assert_eq!(parse_sleep(" 250\n"), Ok(250));
        assert!(parse_sleep("1.5").is_err());
        assert!(parse_sleep("sleep 3").is_err());
        assert!(parse_sleep(&(MAX_SLEEP_MS + 1).to_string()).is_err());
    }

    #[test]
    fn runs_complete_fail_or_die_by_kill_or_time_limit() {
        let spec =
            |kind: &str, command: &str| TaskSpec { kind: kind.parse().unwrap(), ..TaskSpec::shell("l", command) };
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(async {
            let kill = Notify::new();
            assert_eq!(Builtin::Noop.run(&spec("noop", "anything"), &kill).await.ending, Ending::Completed);
            assert_eq!(Builtin::Sleep.run(&spec("sleep", "1"), &kill).await.ending, Ending::Completed);
            assert_eq!(Builtin::Sleep.run(&spec("sleep", "soon"), &kill).await.ending, Ending::Failed);
            // A time limit shorter than the sleep ends it, saying which.
            for (limits, tag) in [
                (TimeLimits { timeout_ms: Some(20), idle_timeout_ms: None }, "timed-out: "),
                (TimeLimits { timeout_ms: Some(60_000), idle_timeout_ms: Some(20) }, "idle-timeout: "),
            ] {
                let limited = TaskSpec { limits: Some(Box::new(limits)), ..spec("sleep", "600000") };
                let outcome = Builtin::Sleep.run(&limited, &kill).await;
                assert_eq!(outcome.ending, Ending::Failed);
                assert!(outcome.detail.as_deref().is_some_and(|d| d.starts_with(tag)), "{outcome:?}");
            }
            // A longer limit changes nothing.
            let loose = TimeLimits { timeout_ms: Some(60_000), idle_timeout_ms: None };
            let limited = TaskSpec { limits: Some(Box::new(loose)), ..spec("sleep", "1") };
            assert_eq!(Builtin::Sleep.run(&limited, &kill).await.ending, Ending::Completed);
            // A kill that arrives first is kept by the Notify and ends the sleep.
            kill.notify_one();
            assert_eq!(Builtin::Sleep.run(&spec("sleep", "600000"), &kill).await.ending, Ending::Killed);
        });
    }
}
