//! Retries of idempotent tasks and delayed starts: the policy a task declares
//! ([`RetryPolicy`], [`NotBefore`]), what one ended attempt looked like
//! ([`AttemptEnd`]), and the pure decisions the coordinator core takes with
//! them — whether an ended attempt is retried ([`decide`]) and after how long
//! ([`delay`]).
//!
//! Nothing here reads a clock or draws randomness: the jitter of a delay comes
//! from a seed the caller passes in (the coordinator derives it from the task
//! number and the attempt, so a decision is reproducible). The `backoff` crate
//! the coordinator uses for its registry appends is not used here: its
//! `next_backoff` draws from `rand` and reads an `Instant` on every call, which
//! this crate must never do; the same exponential rule is a few lines of
//! integer arithmetic.
//!
//! It must never decide that a non-idempotent task runs again: [`decide`]
//! answers [`Verdict::Final`] for one, whatever its policy says, and the
//! lifecycle table refuses the retry event for one as well.

use serde::{Deserialize, Serialize};

use crate::ids::{Attempt, WorkerId};
use crate::lifecycle::{Ending, Outcome};
use crate::spec::{IDLE_TIMEOUT, TIMED_OUT};

/// Most retries a task may ask for (so at most this many + 1 attempts end
/// under a policy, and its attempt history stays this short).
pub const MAX_RETRIES: u32 = 20;
/// Longest backoff between two attempts (1 day), as base or as cap.
pub const MAX_BACKOFF_MS: u64 = 24 * 3600 * 1000;
/// Longest delayed start accepted (30 days from the submit).
pub const MAX_NOT_BEFORE_MS: u64 = 30 * 24 * 3600 * 1000;
/// Longest detail kept in one entry of an attempt history; the last
/// attempt's full detail stays in the task's outcome.
pub const MAX_ATTEMPT_DETAIL_BYTES: usize = 256;
/// The detail tag a worker gives a task its machine stopped (a SIGTERM to its
/// shim that no kill explains): counted as a lost attempt, not a failed exit.
pub const MACHINE_SHUTDOWN: &str = "machine-shutdown";

/// Why an attempt ended without success, as far as a retry policy cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RetryCause {
    /// The process failed: a non-zero exit, a signal, or it could not start.
    Exit,
    /// The attempt was lost: its worker and machine stopped answering, the
    /// machine proved the process gone without an exit status, or the machine
    /// was shutting down.
    Lost,
    /// The attempt ran past its `--timeout` or `--idle-timeout`.
    Timeout,
}

impl RetryCause {
    pub const ALL: [RetryCause; 3] = [RetryCause::Exit, RetryCause::Lost, RetryCause::Timeout];

    pub fn as_str(self) -> &'static str {
        match self {
            RetryCause::Exit => "exit",
            RetryCause::Lost => "lost",
            RetryCause::Timeout => "timeout",
        }
    }

    /// What a failed outcome says about its cause (`None`: not a failure —
    /// completed or killed, which are never retried).
    pub fn of(outcome: &Outcome) -> Option<RetryCause> {
        if outcome.ending != Ending::Failed {
            return None;
        }
        let detail = outcome.detail.as_deref().unwrap_or("");
        let tagged = |tag: &str| detail.strip_prefix(tag).is_some_and(|rest| rest.is_empty() || rest.starts_with(':'));
        Some(if tagged(TIMED_OUT) || tagged(IDLE_TIMEOUT) {
            RetryCause::Timeout
        } else if tagged(MACHINE_SHUTDOWN) {
            RetryCause::Lost
        } else {
            RetryCause::Exit
        })
    }
}

impl std::fmt::Display for RetryCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for RetryCause {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        RetryCause::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| format!("unknown retry cause {s:?} (expected exit, lost or timeout)"))
    }
}

/// How an idempotent task is run again after a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetryPolicy {
    /// Attempts after the first, at most ([`MAX_RETRIES`]).
    pub retries: u32,
    /// The delay before the first retry; each later one doubles, up to
    /// `backoff_max_ms`. Jitter: a delay is drawn from its upper half.
    pub backoff_ms: u64,
    /// The longest delay between two attempts (at least `backoff_ms`).
    pub backoff_max_ms: u64,
    /// The causes retried; by default all three ([`RetryPolicy::DEFAULT_ON`]).
    pub on: Vec<RetryCause>,
}

impl RetryPolicy {
    /// The causes retried when none are named: an idempotent task is, by its
    /// own declaration, safe to run again, whatever ended the attempt.
    pub const DEFAULT_ON: [RetryCause; 3] = RetryCause::ALL;
    /// The backoff base when none is given.
    pub const DEFAULT_BACKOFF_MS: u64 = 1000;
    /// The backoff cap when none is given (at least the base).
    pub const DEFAULT_BACKOFF_MAX_MS: u64 = 5 * 60 * 1000;

    /// A policy of `retries`, with the defaults for what is not given: a
    /// backoff of [`Self::DEFAULT_BACKOFF_MS`], a cap of
    /// [`Self::DEFAULT_BACKOFF_MAX_MS`] (or the backoff, if larger), every
    /// cause. Not validated: [`Self::validate`] (at submit) says what is wrong.
    pub fn with_defaults(
        retries: u32,
        backoff_ms: Option<u64>,
        backoff_max_ms: Option<u64>,
        on: Option<Vec<RetryCause>>,
    ) -> RetryPolicy {
        let backoff_ms = backoff_ms.unwrap_or(Self::DEFAULT_BACKOFF_MS);
        RetryPolicy {
            retries,
            backoff_ms,
            backoff_max_ms: backoff_max_ms.unwrap_or(Self::DEFAULT_BACKOFF_MAX_MS.max(backoff_ms)),
            on: on.unwrap_or_else(|| Self::DEFAULT_ON.to_vec()),
        }
    }

    /// Checks the bounds: `retries` 1..=[`MAX_RETRIES`], a backoff base of at
    /// least 1 ms, a cap at least the base, both at most [`MAX_BACKOFF_MS`], at
    /// least one cause, none twice.
    pub fn validate(&self) -> Result<(), String> {
        if self.retries == 0 || self.retries > MAX_RETRIES {
            return Err(format!("retries must be 1 to {MAX_RETRIES}, not {}", self.retries));
        }
        if self.backoff_ms == 0 || self.backoff_ms > MAX_BACKOFF_MS {
            return Err("the backoff must be above zero and at most 1 day".into());
        }
        if self.backoff_max_ms < self.backoff_ms || self.backoff_max_ms > MAX_BACKOFF_MS {
            return Err("the backoff cap must be at least the backoff and at most 1 day".into());
        }
        if self.on.is_empty() {
            return Err("no cause to retry on".into());
        }
        let mut seen = self.on.clone();
        seen.sort();
        seen.dedup();
        if seen.len() != self.on.len() {
            return Err("a retry cause is named twice".into());
        }
        Ok(())
    }

    pub fn retries_on(&self, cause: RetryCause) -> bool {
        self.on.contains(&cause)
    }
}

/// When a task may start at the earliest, as submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NotBefore {
    /// This long after the leader accepted the submit.
    In { ms: u64 },
    /// At this wall-clock time (Unix epoch milliseconds), as the leader's
    /// clock reads it when it accepts the submit.
    At { unix_ms: u64 },
}

impl NotBefore {
    /// The delay from a submit accepted at `now_unix_ms` (a time in the past
    /// is no delay); refused past [`MAX_NOT_BEFORE_MS`].
    pub fn delay_from(self, now_unix_ms: u64) -> Result<u64, String> {
        let ms = match self {
            NotBefore::In { ms } => ms,
            NotBefore::At { unix_ms } => unix_ms.saturating_sub(now_unix_ms),
        };
        match ms > MAX_NOT_BEFORE_MS {
            true => Err("a delayed start is at most 30 days away".into()),
            false => Ok(ms),
        }
    }
}

/// How one ended attempt is remembered in its task's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptEnd {
    pub attempt: Attempt,
    /// The worker that held it.
    pub worker: Option<WorkerId>,
    /// `completed`, `failed`, `killed`, or `lost` (no exit evidence).
    pub ending: Option<Ending>,
    /// Why it counted as a failure, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<RetryCause>,
    pub exit_code: Option<i32>,
    /// The outcome's detail or the loss's hint, cut to [`MAX_ATTEMPT_DETAIL_BYTES`].
    pub detail: Option<Box<str>>,
    /// Wall clock (epoch ms, for humans) when it was seen running, and when
    /// its end was recorded.
    pub started_at_ms: Option<u64>,
    pub ended_at_ms: u64,
    /// The task was queued again after it.
    pub retried: bool,
    /// The task was resumed after it (its process proven gone), with these
    /// captured values filled into its resume command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed: Option<std::collections::BTreeMap<String, String>>,
}

impl AttemptEnd {
    /// The entry's detail cut to [`MAX_ATTEMPT_DETAIL_BYTES`] on a character boundary.
    pub fn bounded_detail(detail: &str) -> Box<str> {
        let mut cut = detail.len().min(MAX_ATTEMPT_DETAIL_BYTES);
        while !detail.is_char_boundary(cut) {
            cut -= 1;
        }
        detail[..cut].into()
    }
}

/// What [`decide`] says about an ended attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Run the task again, not before this delay.
    Retry { delay_ms: u64 },
    /// The end stands: no policy, a cause it does not list, retries used up,
    /// a kill, a success, or a task that is not idempotent.
    Final,
}

/// Whether an attempt that ended for `cause` is retried. `retried` is how
/// many retries the task had already (the attempts of its history that were
/// retried); `seed` draws the jitter of the delay.
pub fn decide(
    policy: Option<&RetryPolicy>,
    idempotent: bool,
    kill_requested: bool,
    cause: Option<RetryCause>,
    retried: u32,
    seed: u64,
) -> Verdict {
    let (Some(policy), Some(cause)) = (policy, cause) else { return Verdict::Final };
    if !idempotent || kill_requested || !policy.retries_on(cause) || retried >= policy.retries.min(MAX_RETRIES) {
        return Verdict::Final;
    }
    Verdict::Retry { delay_ms: delay(policy, retried + 1, seed) }
}

/// The delay before retry number `n` (1-based): `backoff · 2^(n-1)`, capped
/// at `backoff_max` (and [`MAX_BACKOFF_MS`]), drawn from its upper half by
/// `seed` ("equal jitter": never less than half, so retries of many tasks
/// that failed together spread out without any being retried at once).
pub fn delay(policy: &RetryPolicy, n: u32, seed: u64) -> u64 {
    let cap = policy.backoff_max_ms.clamp(1, MAX_BACKOFF_MS);
    let base = policy.backoff_ms.clamp(1, cap);
    let shift = n.saturating_sub(1).min(63);
    let exp = base.checked_shl(shift).filter(|v| v >> shift == base).unwrap_or(u64::MAX).min(cap);
    let half = exp / 2;
    let span = exp - half;
    half + mix(seed) % (span + 1)
}

/// A seed for the jitter of `task`'s retry after `attempt`: the same inputs
/// give the same delay on any leader.
pub fn seed(task_number: u64, attempt: Attempt) -> u64 {
    mix(task_number ^ (u64::from(attempt.0) << 40))
}

/// SplitMix64's finalizer: spreads close inputs over the whole range.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy(retries: u32, on: &[RetryCause]) -> RetryPolicy {
        RetryPolicy { retries, backoff_ms: 100, backoff_max_ms: 1000, on: on.to_vec() }
    }

    fn failed(detail: &str) -> Outcome {
        Outcome::new(Ending::Failed, Some(1), Some(detail.into()))
    }

    #[test]
    fn causes_are_read_from_the_outcome() {
        assert_eq!(RetryCause::of(&failed("exit code: 3")), Some(RetryCause::Exit));
        assert_eq!(RetryCause::of(&failed("timed-out: ran longer than its timeout of 1s")), Some(RetryCause::Timeout));
        assert_eq!(RetryCause::of(&failed("idle-timeout: wrote no output")), Some(RetryCause::Timeout));
        assert_eq!(
            RetryCause::of(&failed("machine-shutdown: the task's shim was sent SIGTERM")),
            Some(RetryCause::Lost)
        );
        // A tag only counts as the whole first word.
        assert_eq!(RetryCause::of(&failed("timed-outish")), Some(RetryCause::Exit));
        assert_eq!(RetryCause::of(&Outcome::new(Ending::Completed, Some(0), None)), None);
        assert_eq!(RetryCause::of(&Outcome::new(Ending::Killed, None, Some("timed-out".into()))), None);
    }

    /// Every row: policy, idempotent, kill requested, cause, retries so far → retried?
    #[test]
    fn retry_or_final_as_a_table() {
        use RetryCause::*;
        let all = policy(2, &RetryCause::ALL);
        let exit_only = policy(2, &[Exit]);
        type Row<'a> = (Option<&'a RetryPolicy>, bool, bool, Option<RetryCause>, u32, bool);
        let rows: &[Row] = &[
            (Some(&all), true, false, Some(Exit), 0, true),
            (Some(&all), true, false, Some(Lost), 1, true),
            (Some(&all), true, false, Some(Timeout), 1, true),
            (Some(&all), true, false, Some(Exit), 2, false),  // used up
            (Some(&all), false, false, Some(Exit), 0, false), // never a non-idempotent task
            (Some(&all), true, true, Some(Exit), 0, false),   // a kill stands
            (Some(&all), true, false, None, 0, false),        // success or kill
            (Some(&exit_only), true, false, Some(Lost), 0, false),
            (Some(&exit_only), true, false, Some(Timeout), 0, false),
            (Some(&exit_only), true, false, Some(Exit), 1, true),
            (None, true, false, Some(Exit), 0, false),
        ];
        for (i, (p, idem, kill, cause, retried, want)) in rows.iter().enumerate() {
            let got = decide(*p, *idem, *kill, *cause, *retried, 7);
            assert_eq!(matches!(got, Verdict::Retry { .. }), *want, "row {i}: {got:?}");
        }
    }

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_in_the_upper_half() {
        let p = policy(20, &[RetryCause::Exit]);
        for seed in [0, 1, 42, u64::MAX] {
            let d: Vec<u64> = (1..=6).map(|n| delay(&p, n, seed)).collect();
            for (n, (got, exp)) in d.iter().zip([100u64, 200, 400, 800, 1000, 1000]).enumerate() {
                assert!(*got >= exp / 2 && *got <= exp, "retry {}: {got} not in [{}, {exp}]", n + 1, exp / 2);
            }
        }
        // Deterministic: the same seed, the same delay.
        assert_eq!(delay(&p, 3, 99), delay(&p, 3, 99));
        // Different tasks spread out.
        let spread: std::collections::BTreeSet<u64> = (0..50).map(|t| delay(&p, 4, seed(t, Attempt(4)))).collect();
        assert!(spread.len() > 10, "{spread:?}");
    }

    #[test]
    fn policies_are_bounded() {
        assert_eq!(policy(3, &[RetryCause::Exit]).validate(), Ok(()));
        let bad = [
            policy(0, &[RetryCause::Exit]),
            policy(MAX_RETRIES + 1, &[RetryCause::Exit]),
            policy(3, &[]),
            policy(3, &[RetryCause::Exit, RetryCause::Exit]),
            RetryPolicy { backoff_ms: 0, ..policy(3, &[RetryCause::Exit]) },
            RetryPolicy { backoff_max_ms: 50, ..policy(3, &[RetryCause::Exit]) },
            RetryPolicy { backoff_ms: MAX_BACKOFF_MS + 1, backoff_max_ms: MAX_BACKOFF_MS + 1, ..policy(3, &[]) },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
        assert_eq!(NotBefore::In { ms: 5 }.delay_from(1000), Ok(5));
        assert_eq!(NotBefore::At { unix_ms: 900 }.delay_from(1000), Ok(0));
        assert_eq!(NotBefore::At { unix_ms: 1500 }.delay_from(1000), Ok(500));
        assert!(NotBefore::In { ms: MAX_NOT_BEFORE_MS + 1 }.delay_from(0).is_err());
    }

    #[test]
    fn details_are_cut_on_a_character_boundary() {
        let d = AttemptEnd::bounded_detail(&"é".repeat(MAX_ATTEMPT_DETAIL_BYTES));
        assert!(d.len() <= MAX_ATTEMPT_DETAIL_BYTES && d.chars().all(|c| c == 'é'));
    }

    proptest! {
        /// Whatever the policy's numbers, a delay never exceeds the cap, and
        /// never the absolute bound.
        #[test]
        fn delays_stay_within_their_bounds(base in 0u64..u64::MAX, max in 0u64..u64::MAX, n in 0u32..100, seed: u64) {
            let p = RetryPolicy { retries: 3, backoff_ms: base, backoff_max_ms: max, on: vec![RetryCause::Exit] };
            let d = delay(&p, n, seed);
            prop_assert!(d <= MAX_BACKOFF_MS);
            prop_assert!(d <= max.max(1));
        }
    }
}
