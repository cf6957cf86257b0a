//! A task's status history as views show it, derived from the durable facts
//! its snapshot already carries: when it was submitted, whether it is held
//! for approval, each ended attempt of its attempt history, its current
//! attempt and its end.
//!
//! The registry keeps only each task's latest record, and a record must not
//! grow with every transition (the coordinator's memory budget per finished
//! task), so this is a *derivation*, never a log: transitions that leave no
//! durable fact (leased, stopping, a pause, the time of an approval or of a
//! kill request) are not in it. It never reads a clock: every time in it
//! comes from the snapshot.

use serde::{Deserialize, Serialize};

use crate::ids::WorkerId;
use crate::lifecycle::{Ending, HintTag, Status};
use crate::messages::TaskSnapshot;
use crate::retry::AttemptEnd;

/// What an entry of a timeline says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Step {
    /// The task was created.
    Submitted,
    /// It waits for an approval (still; when it was approved is not stored).
    Held,
    /// An attempt was seen running on a worker.
    AttemptStarted,
    /// An attempt ended and the task went on (retried or resumed), or it was
    /// the last one of a task whose end follows.
    AttemptEnded,
    /// A queued task may not start before this time (its `not_before`, or
    /// the backoff before a retry).
    NotBefore,
    /// Someone asked to stop it (the time of the request is not stored).
    KillRequested,
    /// Its outcome could not be proved (`unknown`): see the detail.
    InDoubt,
    /// It ended: completed, failed or killed.
    Ended,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Submitted => "submitted",
            Step::Held => "held",
            Step::AttemptStarted => "attempt-started",
            Step::AttemptEnded => "attempt-ended",
            Step::NotBefore => "not-before",
            Step::KillRequested => "kill-requested",
            Step::InDoubt => "in-doubt",
            Step::Ended => "ended",
        }
    }
}

/// One entry of a task's timeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Wall clock, epoch milliseconds; `None` when the fact has no stored
    /// time (a kill request).
    pub at_ms: Option<u64>,
    pub what: Step,
    pub attempt: Option<u32>,
    pub worker: Option<WorkerId>,
    /// What a person reads: how an attempt ended, the status and detail of
    /// the end, why it is held.
    pub detail: Option<String>,
}

fn ending_str(e: Ending) -> &'static str {
    match e {
        Ending::Completed => "completed",
        Ending::Killed => "killed",
        Ending::Failed => "failed",
    }
}

/// How one ended attempt of the history reads.
fn attempt_detail(a: &AttemptEnd) -> String {
    let mut text = a.ending.map(ending_str).unwrap_or("lost").to_owned();
    if let Some(cause) = a.cause {
        text.push_str(&format!(" ({})", cause.as_str()));
    }
    if let Some(code) = a.exit_code {
        text.push_str(&format!(", exit code {code}"));
    }
    if let Some(d) = a.detail.as_deref().filter(|d| !d.is_empty()) {
        text.push_str(&format!(": {d}"));
    }
    if a.resumed.is_some() {
        text.push_str("; resumed");
    } else if a.retried {
        text.push_str("; queued again");
    }
    text
}

impl TaskSnapshot {
    /// The task's history, oldest first, from what its snapshot holds (see
    /// the module docs for what it cannot show).
    pub fn timeline(&self) -> Vec<Entry> {
        let entry = |at_ms, what, attempt: Option<u32>, worker: Option<&WorkerId>, detail: Option<String>| Entry {
            at_ms,
            what,
            attempt,
            worker: worker.cloned(),
            detail,
        };
        let mut out = vec![entry(Some(self.created_at_ms), Step::Submitted, None, None, None)];
        if let Some(h) = self.hint.as_ref().filter(|h| h.tag == HintTag::AwaitingApproval) {
            if self.status == Status::Blocked {
                out.push(entry(Some(self.created_at_ms), Step::Held, None, None, Some(h.message.clone())));
            }
        }
        for a in &self.attempts {
            if let Some(at) = a.started_at_ms {
                out.push(entry(Some(at), Step::AttemptStarted, Some(a.attempt.0), a.worker.as_ref(), None));
            }
            out.push(entry(
                Some(a.ended_at_ms),
                Step::AttemptEnded,
                Some(a.attempt.0),
                a.worker.as_ref(),
                Some(attempt_detail(a)),
            ));
        }
        // The current attempt, unless the history already holds it (the last
        // attempt of a task with a history). Without a history the record's
        // start is the start of its only attempt.
        let current = self.attempt.0;
        let in_history = self.attempts.iter().any(|a| a.attempt.0 == current);
        let started = match self.attempts.is_empty() {
            true => self.started_at_ms,
            false => self.attempt_started_at_ms,
        };
        if let (false, Some(at)) = (in_history, started) {
            let detail = Some(format!("epoch {}", self.epoch.0));
            out.push(entry(Some(at), Step::AttemptStarted, Some(current), self.worker.as_ref(), detail));
        }
        if let Some(at) = self.not_before_ms.filter(|_| self.status == Status::Queued) {
            out.push(entry(Some(at), Step::NotBefore, None, None, None));
        }
        let terminal = self.status.is_terminal();
        if self.kill_requested && !terminal {
            out.push(entry(None, Step::KillRequested, None, None, self.kill_reason.clone()));
        }
        if self.status == Status::Unknown {
            let detail = self.hint.as_ref().map(|h| format!("{}: {}", h.tag.as_str(), h.message));
            out.push(entry(None, Step::InDoubt, Some(current), self.worker.as_ref(), detail));
        }
        if terminal {
            let mut text = self.status.as_str().to_owned();
            if let Some(code) = self.exit_code {
                text.push_str(&format!(", exit code {code}"));
            }
            if let Some(d) = self.detail.as_deref().filter(|d| !d.is_empty()) {
                text.push_str(&format!(": {d}"));
            }
            if let Some(r) = self.kill_reason.as_deref() {
                text.push_str(&format!(" (kill reason: {r})"));
            }
            let attempt = (current > 0).then_some(current);
            out.push(entry(self.finished_at_ms, Step::Ended, attempt, self.worker.as_ref(), Some(text)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Attempt, Epoch, Kind, TaskId};
    use crate::lifecycle::{Board, RecoveryHint};
    use crate::retry::RetryCause;

    fn base(status: Status) -> TaskSnapshot {
        TaskSnapshot {
            id: TaskId::new(Kind::shell(), 7).unwrap(),
            kind: Kind::shell(),
            label: "t".into(),
            owner: "alice".parse().unwrap(),
            status,
            detail: None,
            exit_code: None,
            output_dropped: 0,
            attempt: Attempt(0),
            epoch: Epoch(0),
            worker: None,
            idempotent: false,
            kill_requested: false,
            kill_reason: None,
            hint: None,
            created_at_ms: 1_000,
            started_at_ms: None,
            attempt_started_at_ms: None,
            finished_at_ms: None,
            reported: false,
            board: Board::Active,
            cleaned: false,
            cleanup: None,
            parent: None,
            steps: Vec::new(),
            matches: 0,
            final_output: false,
            attempts: Vec::new(),
            not_before_ms: None,
            retry: None,
            priority: 0,
            placement: None,
            resume: None,
            resources: None,
            agent_resume: None,
        }
    }

    fn w(name: &str) -> WorkerId {
        name.parse().unwrap()
    }

    fn ended(attempt: u32, worker: &str, at: (u64, u64), cause: Option<RetryCause>, retried: bool) -> AttemptEnd {
        AttemptEnd {
            attempt: Attempt(attempt),
            worker: Some(w(worker)),
            ending: cause.map(|_| Ending::Failed),
            cause,
            exit_code: cause.filter(|c| *c == RetryCause::Exit).map(|_| 3),
            detail: None,
            started_at_ms: Some(at.0),
            ended_at_ms: at.1,
            retried,
            resumed: None,
        }
    }

    /// What each entry says, compactly: `what@at#attempt/worker`.
    fn shape(s: &TaskSnapshot) -> Vec<String> {
        s.timeline()
            .iter()
            .map(|e| {
                let at = e.at_ms.map(|t| t.to_string()).unwrap_or_else(|| "-".into());
                let attempt = e.attempt.map(|a| format!("#{a}")).unwrap_or_default();
                let worker = e.worker.as_ref().map(|w| format!("/{w}")).unwrap_or_default();
                format!("{}@{at}{attempt}{worker}", e.what.as_str())
            })
            .collect()
    }

    #[test]
    fn each_state_reads_as_its_durable_facts() {
        let queued = base(Status::Queued);
        let held = TaskSnapshot {
            hint: Some(RecoveryHint { tag: HintTag::AwaitingApproval, message: "needs ops".into() }),
            ..base(Status::Blocked)
        };
        let running = TaskSnapshot {
            attempt: Attempt(1),
            epoch: Epoch(4),
            worker: Some(w("w1")),
            started_at_ms: Some(2_000),
            ..base(Status::Running)
        };
        let stopping = TaskSnapshot { kill_requested: true, kill_reason: Some("enough".into()), ..running.clone() };
        let completed = TaskSnapshot {
            exit_code: Some(0),
            finished_at_ms: Some(3_000),
            ..TaskSnapshot { status: Status::Completed, ..running.clone() }
        };
        let killed = TaskSnapshot { status: Status::Killed, finished_at_ms: Some(2_500), ..stopping.clone() };
        let retried = TaskSnapshot {
            attempt: Attempt(2),
            worker: Some(w("w2")),
            started_at_ms: Some(2_000),
            attempt_started_at_ms: Some(5_000),
            attempts: vec![ended(1, "w1", (2_000, 3_000), Some(RetryCause::Exit), true)],
            ..base(Status::Running)
        };
        let backing_off = TaskSnapshot {
            attempt: Attempt(1),
            worker: None,
            not_before_ms: Some(4_000),
            attempts: vec![ended(1, "w1", (2_000, 3_000), Some(RetryCause::Lost), true)],
            ..base(Status::Queued)
        };
        let retried_then_done = TaskSnapshot {
            status: Status::Completed,
            attempt: Attempt(2),
            worker: Some(w("w2")),
            finished_at_ms: Some(6_000),
            attempts: vec![
                ended(1, "w1", (2_000, 3_000), Some(RetryCause::Exit), true),
                ended(2, "w2", (5_000, 6_000), None, false),
            ],
            ..base(Status::Queued)
        };
        let in_doubt = TaskSnapshot {
            hint: Some(RecoveryHint { tag: HintTag::WorkerLost, message: "gone".into() }),
            ..TaskSnapshot { status: Status::Unknown, ..running.clone() }
        };
        let killed_held = TaskSnapshot {
            status: Status::Killed,
            finished_at_ms: Some(1_500),
            detail: Some("killed while awaiting approval: it never ran".into()),
            ..base(Status::Killed)
        };
        let table: Vec<(&str, TaskSnapshot, Vec<&str>)> = vec![
            ("queued", queued, vec!["submitted@1000"]),
            ("held", held, vec!["submitted@1000", "held@1000"]),
            ("running", running, vec!["submitted@1000", "attempt-started@2000#1/w1"]),
            ("stopping", stopping, vec!["submitted@1000", "attempt-started@2000#1/w1", "kill-requested@-"]),
            ("completed", completed, vec!["submitted@1000", "attempt-started@2000#1/w1", "ended@3000#1/w1"]),
            ("killed", killed, vec!["submitted@1000", "attempt-started@2000#1/w1", "ended@2500#1/w1"]),
            (
                "retried",
                retried,
                vec![
                    "submitted@1000",
                    "attempt-started@2000#1/w1",
                    "attempt-ended@3000#1/w1",
                    "attempt-started@5000#2/w2",
                ],
            ),
            (
                "backing off",
                backing_off,
                vec!["submitted@1000", "attempt-started@2000#1/w1", "attempt-ended@3000#1/w1", "not-before@4000"],
            ),
            (
                "retried then done",
                retried_then_done,
                vec![
                    "submitted@1000",
                    "attempt-started@2000#1/w1",
                    "attempt-ended@3000#1/w1",
                    "attempt-started@5000#2/w2",
                    "attempt-ended@6000#2/w2",
                    "ended@6000#2/w2",
                ],
            ),
            ("in doubt", in_doubt, vec!["submitted@1000", "attempt-started@2000#1/w1", "in-doubt@-#1/w1"]),
            ("killed while held", killed_held, vec!["submitted@1000", "ended@1500"]),
        ];
        for (name, snapshot, want) in table {
            assert_eq!(shape(&snapshot), want, "{name}");
        }
    }

    #[test]
    fn details_say_how_attempts_and_tasks_ended() {
        let s = TaskSnapshot {
            status: Status::Killed,
            attempt: Attempt(2),
            worker: Some(w("w2")),
            finished_at_ms: Some(6_000),
            detail: Some("terminated".into()),
            kill_reason: Some("enough".into()),
            attempts: vec![ended(1, "w1", (2_000, 3_000), Some(RetryCause::Exit), true)],
            ..base(Status::Killed)
        };
        let t = s.timeline();
        assert_eq!(t[2].detail.as_deref(), Some("failed (exit), exit code 3; queued again"));
        let end = t.last().unwrap();
        assert_eq!(end.what, Step::Ended);
        assert_eq!(end.detail.as_deref(), Some("killed: terminated (kill reason: enough)"));
        let running =
            TaskSnapshot { attempt: Attempt(1), epoch: Epoch(9), started_at_ms: Some(2), ..base(Status::Running) };
        assert_eq!(running.timeline()[1].detail.as_deref(), Some("epoch 9"));
    }
}
