//! Retries and delayed starts in the core: whether an attempt's end is a
//! retry or final (from the task's policy and its attempt history), the
//! durable time before which a queued task is not granted, and the attempt
//! history kept in the task's record.
//!
//! Every decision here is made before the lifecycle table is asked: an end
//! the policy retries becomes [`Event::Retry`], a loss it does not becomes
//! [`Event::WorkerLostFinal`], and the table decides what either does to the
//! status. The delay is computed from a seed derived from the task number and
//! the attempt (`retry::seed`), never from a clock or a random source, and it
//! is stored in the record (registry time) with the change that queues the
//! task again: a new leader continues the wait, it never retries twice or
//! forgets. A task without a retry policy is not touched here (an idempotent
//! one whose worker is lost is queued again at once, as always).
//!
//! It must never turn an end into a retry for a task that is not idempotent,
//! nor for one with a kill requested; the table refuses both as well.

use std::collections::BTreeMap;

use tenure_protocol::retry::{self, AttemptEnd, RetryCause, Verdict};
use tenure_protocol::{Ending, Event, Lifecycle, Status, TaskId};

use super::{Core, Now};
use crate::record::{AttemptLog, TaskRecord};

/// An attempt's end as the history will remember it, decided with the event.
#[derive(Debug, Clone)]
pub(super) struct Ended {
    ending: Option<Ending>,
    cause: Option<RetryCause>,
    exit_code: Option<i32>,
    detail: Option<String>,
    /// `Some` for a retry: the backoff before the next attempt.
    delay_ms: Option<u64>,
    /// `Some` for a resume: the values filled into the resume command.
    resumed: Option<BTreeMap<String, String>>,
}

impl Ended {
    /// A lost attempt that its task resumes, with the values its resume
    /// command gets.
    pub(super) fn resumed(detail: String, values: BTreeMap<String, String>) -> Ended {
        Ended {
            ending: None,
            cause: Some(RetryCause::Lost),
            exit_code: None,
            detail: Some(detail),
            delay_ms: None,
            resumed: Some(values),
        }
    }
}

impl Core {
    /// The event a report, evidence or a lost worker really means for `task`
    /// under its retry policy, and what its history should keep of it.
    pub(super) fn retry_or_final(&self, task: &TaskId, event: Event) -> (Event, Option<Ended>) {
        let Some(r) = self.tasks.get(task) else { return (event, None) };
        let Some(policy) = r.spec.retry.as_deref() else { return (event, None) };
        let l = &r.life;
        let retried = r.attempts.as_ref().map_or(0, |a| a.retried());
        let verdict = |cause| {
            retry::decide(
                Some(policy),
                l.idempotent,
                l.kill_requested,
                cause,
                retried,
                retry::seed(task.number(), l.attempt),
            )
        };
        match event {
            Event::Finished { attempt, epoch, outcome } if attempt == l.attempt => {
                let cause = RetryCause::of(&outcome);
                let ended = |delay_ms| Ended {
                    ending: Some(outcome.ending),
                    cause,
                    exit_code: outcome.exit_code,
                    detail: outcome.detail.as_deref().map(str::to_owned),
                    delay_ms,
                    resumed: None,
                };
                match verdict(cause) {
                    Verdict::Retry { delay_ms } => (Event::Retry { attempt, epoch }, Some(ended(Some(delay_ms)))),
                    Verdict::Final => {
                        let ended = ended(None);
                        (Event::Finished { attempt, epoch, outcome }, Some(ended))
                    }
                }
            }
            Event::Lost { attempt, epoch, hint } if attempt == l.attempt => match verdict(Some(RetryCause::Lost)) {
                Verdict::Retry { delay_ms } => {
                    let ended = lost(Some(format!("{}: {}", hint.tag.as_str(), hint.message)), delay_ms);
                    (Event::Retry { attempt, epoch }, Some(ended))
                }
                // Unknown, not final: late evidence may still settle it.
                Verdict::Final => (Event::Lost { attempt, epoch, hint }, None),
            },
            Event::WorkerLost { worker } if l.worker.as_ref() == Some(&worker) && l.status.is_on_worker() => {
                match verdict(Some(RetryCause::Lost)) {
                    Verdict::Retry { delay_ms } => {
                        let detail = format!("worker-lost: worker {worker} and its sidecar stopped answering");
                        (Event::Retry { attempt: l.attempt, epoch: l.epoch }, Some(lost(Some(detail), delay_ms)))
                    }
                    Verdict::Final => (Event::WorkerLostFinal { worker }, None),
                }
            }
            other => (other, None),
        }
    }

    /// Whether `event` names an attempt whose retry (or resume) was already
    /// decided: whatever it says, that attempt's end is settled (a late or
    /// repeated report, or evidence asked before the retry).
    pub(super) fn retried_already(&self, task: &TaskId, event: &Event) -> bool {
        let attempt = match event {
            Event::Refused { attempt, .. }
            | Event::Started { attempt, .. }
            | Event::Finished { attempt, .. }
            | Event::Lost { attempt, .. }
            | Event::Retry { attempt, .. }
            | Event::Resume { attempt, .. } => *attempt,
            _ => return false,
        };
        self.tasks
            .get(task)
            .and_then(|r| r.attempts.as_ref())
            .is_some_and(|a| a.history.iter().any(|h| (h.retried || h.resumed.is_some()) && h.attempt == attempt))
    }

    /// Whether queued `task` must still wait for its delayed start or backoff.
    pub(super) fn waiting_for_its_time(&self, task: &TaskId, now: Now) -> bool {
        self.tasks.get(task).and_then(|r| r.attempts.as_ref()).is_some_and(|a| a.ready_clock_ms > self.registry_ms(now))
    }
}

fn lost(detail: Option<String>, delay_ms: u64) -> Ended {
    Ended {
        ending: None,
        cause: Some(RetryCause::Lost),
        exit_code: None,
        detail,
        delay_ms: Some(delay_ms),
        resumed: None,
    }
}

/// Updates the attempt history and delayed start of `record`, whose
/// lifecycle just changed from `before` (the change is persisted right
/// after). `clock` is the registry time now.
pub(super) fn note(record: &mut TaskRecord, before: &Lifecycle, ended: Option<Ended>, now: Now, clock: u64) {
    if record.spec.retry.is_none() && record.spec.resume.is_none() {
        return;
    }
    let after = record.life.status;
    let log = record.attempts.get_or_insert_with(Box::<AttemptLog>::default);
    if after == Status::Running && before.status != Status::Running {
        log.started_at_ms = Some(now.wall_ms);
    }
    let Some(ended) = ended else { return };
    let requeued = after == Status::Queued;
    // Only a retry, a resume or the end of the task closes an attempt in the history.
    if !requeued && !after.is_terminal() {
        return;
    }
    let retried = requeued && ended.resumed.is_none();
    log.history.push(AttemptEnd {
        attempt: before.attempt,
        worker: before.worker.clone(),
        ending: ended.ending,
        cause: ended.cause,
        exit_code: ended.exit_code,
        detail: ended.detail.as_deref().map(AttemptEnd::bounded_detail),
        started_at_ms: log.started_at_ms.take(),
        ended_at_ms: now.wall_ms,
        retried,
        resumed: ended.resumed,
    });
    if let (true, Some(delay)) = (retried, ended.delay_ms) {
        log.ready_clock_ms = clock.saturating_add(delay).max(1);
        log.ready_wall_ms = Some(now.wall_ms.saturating_add(delay));
        tracing::info!(
            task = %record.id,
            attempt = %before.attempt,
            epoch = %before.epoch,
            cause = ?ended.cause,
            delay_ms = delay,
            retries_used = log.retried(),
            "attempt failed; retrying after a backoff"
        );
    }
}

/// The delayed start of a submitted task: none, or the log that holds it.
pub(super) fn delayed_start(delay_ms: u64, now: Now, clock: u64) -> Option<Box<AttemptLog>> {
    (delay_ms > 0).then(|| {
        Box::new(AttemptLog {
            ready_clock_ms: clock.saturating_add(delay_ms),
            ready_wall_ms: Some(now.wall_ms.saturating_add(delay_ms)),
            ..AttemptLog::default()
        })
    })
}
