//! The task lifecycle: every status, every event, and the one pure function that
//! decides what an event does to a task ([`apply`]).
//!
//! This is the only place where a task's status changes. It reads no clock and
//! does no IO: the coordinator feeds it the current [`Lifecycle`] and an
//! [`Event`], and persists the result. The rules it enforces:
//!
//! - terminal statuses (`completed`, `killed`, `failed`) absorb every event;
//! - an event naming another attempt, or an older epoch than the task's lease,
//!   changes nothing (a late or replayed message cannot rewind a task);
//! - a non-idempotent task whose worker is lost is never queued again: it becomes
//!   `unknown` with a recovery hint, and only evidence from its attempt settles it;
//! - only a started attempt on a worker is `paused` (by its owner), and a paused
//!   task still ends, is killed and is lost like a running one ([`pause_move`]).

use serde::{Deserialize, Serialize};

use crate::ids::{Attempt, Epoch, WorkerId};
use crate::spec::MAX_FINAL_OUTPUT_BYTES;

/// A task's status as clients see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Waiting for a worker with a free slot.
    Queued,
    /// Granted to a worker under an epoch; the process may not have started yet.
    Leased,
    /// The worker reported the process started (its intent is durable).
    Running,
    /// A kill was requested; waiting for the worker to prove the process group gone.
    Stopping,
    /// Finished by itself with exit code 0.
    Completed,
    /// Terminated on request.
    Killed,
    /// Finished with a non-zero exit, a signal, or could not be started.
    Failed,
    /// The outcome cannot be proved; carries a [`RecoveryHint`]. Late evidence may settle it.
    Unknown,
    /// Running, and stopped on its owner's request (`tenure pause`): its
    /// process group is held with SIGSTOP until `tenure resume`. It keeps its
    /// worker slot and its lease; a kill still ends it.
    Paused,
    /// Not started, for a reason a person can act on; the hint names it. In
    /// the registry only while it awaits approval (`--hold`, or the
    /// coordinator's approval policy): `tenure approve` queues it, a kill
    /// ends it without it ever running. Views also show a queued task
    /// `blocked` while its concurrency key is full or no live worker
    /// satisfies its placement — those come and go with the cluster and are
    /// never written.
    Blocked,
    /// Shown, never stored: a running `agent` task with a process blocked
    /// reading its input (no input pending); it goes back to `running` when
    /// input arrives. The lifecycle sees it as `running`.
    Waiting,
}

impl Status {
    pub const ALL: [Status; 11] = [
        Status::Queued,
        Status::Leased,
        Status::Running,
        Status::Stopping,
        Status::Completed,
        Status::Killed,
        Status::Failed,
        Status::Unknown,
        Status::Paused,
        Status::Blocked,
        Status::Waiting,
    ];

    /// Completed, killed or failed: nothing moves the task again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Completed | Status::Killed | Status::Failed)
    }

    /// Whether a lifecycle can be in it: every status but `waiting`, which
    /// views show for a `running` task.
    pub fn is_stored(self) -> bool {
        self != Status::Waiting
    }

    /// Holds (or may hold) a worker slot.
    pub fn is_on_worker(self) -> bool {
        matches!(self, Status::Leased | Status::Running | Status::Stopping | Status::Paused)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Leased => "leased",
            Status::Running => "running",
            Status::Stopping => "stopping",
            Status::Completed => "completed",
            Status::Killed => "killed",
            Status::Failed => "failed",
            Status::Unknown => "unknown",
            Status::Paused => "paused",
            Status::Blocked => "blocked",
            Status::Waiting => "waiting",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a finished attempt ended, as reported by its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ending {
    Completed,
    Killed,
    Failed,
}

impl Ending {
    fn status(self) -> Status {
        match self {
            Ending::Completed => Status::Completed,
            Ending::Killed => Status::Killed,
            Ending::Failed => Status::Failed,
        }
    }
}

/// The terminal facts of one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub ending: Ending,
    /// Exit code when the process exited normally.
    pub exit_code: Option<i32>,
    /// Kind-specific detail ("exit code: 3", "signal 9", "spawn failed: …").
    /// `Box<str>` rather than `String` here and below: the same on the wire,
    /// 8 bytes less in every finished task the coordinator keeps.
    pub detail: Option<Box<str>>,
    /// Output bytes dropped past the per-task cap.
    #[serde(default)]
    pub output_dropped: u64,
    /// The final output of a final-output-only task (its output's tail).
    #[serde(default)]
    pub output: Option<Box<str>>,
}

/// Longest outcome detail kept in a record; longer ones (from a worker or a
/// sidecar) are cut on a character boundary.
pub const MAX_DETAIL_BYTES: usize = 2048;
/// Longest recovery hint message kept in a record.
pub const MAX_HINT_BYTES: usize = 2048;
/// Longest final output kept in a record: the last
/// [`MAX_FINAL_OUTPUT_BYTES`] of the output and a note on what came before.
/// A worker's own tail can be longer (bytes that are not UTF-8 grow when
/// replaced); the coordinator cuts it to this.
pub const MAX_KEPT_OUTPUT_BYTES: usize = MAX_FINAL_OUTPUT_BYTES + 256;

impl Outcome {
    pub fn new(ending: Ending, exit_code: Option<i32>, detail: Option<String>) -> Outcome {
        Outcome { ending, exit_code, detail: detail.map(String::into_boxed_str), output_dropped: 0, output: None }
    }

    /// The outcome with its detail and final output cut to the limits a record
    /// keeps ([`MAX_DETAIL_BYTES`], [`MAX_KEPT_OUTPUT_BYTES`]): what a worker
    /// reports can never make a task's record too large to store.
    pub fn bounded(mut self) -> Outcome {
        if self.detail.as_ref().is_some_and(|d| d.len() > MAX_DETAIL_BYTES) {
            self.detail = self.detail.map(|d| head(&d, MAX_DETAIL_BYTES).into());
        }
        if self.output.as_ref().is_some_and(|o| o.len() > MAX_KEPT_OUTPUT_BYTES) {
            self.output = self.output.map(|o| tail(&o, MAX_FINAL_OUTPUT_BYTES).into());
        }
        self
    }
}

impl RecoveryHint {
    /// The hint with its message cut to [`MAX_HINT_BYTES`].
    pub fn bounded(mut self) -> RecoveryHint {
        if self.message.len() > MAX_HINT_BYTES {
            self.message = head(&self.message, MAX_HINT_BYTES).to_owned();
        }
        self
    }
}

/// The longest prefix of `s` of at most `max` bytes, on a character boundary.
fn head(s: &str, max: usize) -> &str {
    let mut cut = s.len().min(max);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// The last `max` bytes of `s` (on a character boundary) after a note saying
/// how many came before; at most `max` + 64 bytes.
fn tail(s: &str, max: usize) -> String {
    let mut cut = s.len().saturating_sub(max);
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    format!("[tenure: {cut} earlier bytes of the final output left out]\n{}", &s[cut..])
}

/// Machine-readable tag of a [`RecoveryHint`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HintTag {
    /// The attempt's intent may have been recorded; it may or may not have run.
    MaybeRan,
    /// The worker stopped heartbeating while it held the task.
    WorkerLost,
    /// The worker machine's recovery records for the attempt were unreadable.
    SidecarCorrupt,
    /// The worker cannot be reached; its sidecar's evidence will settle the task.
    WorkerUnreachable,
    /// A kill was requested but the worker holding the task cannot be reached:
    /// the task is not called killed until its process is proven gone.
    KillPending,
    /// The worker machine's store is not the one the attempt was granted to:
    /// its data directory was wiped or replaced, and with it the evidence.
    MachineReplaced,
    /// The worker machine restarted (power loss, reboot) while the attempt
    /// ran: its process died with the machine and no exit status survived.
    MachineRestarted,
    /// Held before its first attempt until someone allowed to approves it.
    AwaitingApproval,
    /// Queued, and as many tasks of its concurrency key as its limit allows
    /// hold a worker (or may: `unknown` ones count).
    ConcurrencyLimit,
    /// Queued, and no live worker that runs its kind satisfies its placement.
    NoMatchingWorker,
}

impl HintTag {
    pub fn as_str(self) -> &'static str {
        match self {
            HintTag::MaybeRan => "maybe-ran",
            HintTag::WorkerLost => "worker-lost",
            HintTag::SidecarCorrupt => "sidecar-corrupt",
            HintTag::WorkerUnreachable => "worker-unreachable",
            HintTag::KillPending => "kill-pending",
            HintTag::MachineReplaced => "machine-replaced",
            HintTag::MachineRestarted => "machine-restarted",
            HintTag::AwaitingApproval => "awaiting-approval",
            HintTag::ConcurrencyLimit => "concurrency-limit",
            HintTag::NoMatchingWorker => "no-matching-worker",
        }
    }
}

/// Why a task could not be finished safely, and what the operator can do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryHint {
    pub tag: HintTag,
    pub message: String,
}

/// The part of a task record the lifecycle reads and writes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub status: Status,
    /// The current (latest granted) attempt; 0 before the first grant.
    pub attempt: Attempt,
    /// The epoch the current attempt was leased (or last re-leased) under.
    pub epoch: Epoch,
    /// The worker holding or last holding the current attempt.
    pub worker: Option<WorkerId>,
    pub idempotent: bool,
    pub kill_requested: bool,
    /// Why the task was asked to stop, as the first kill said it (kept
    /// verbatim; later kills do not change it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_reason: Option<Box<str>>,
    /// Boxed: rarely set, and every kept task carries the field.
    pub hint: Option<Box<RecoveryHint>>,
    pub outcome: Option<Outcome>,
    /// Where the task shows on the board; orthogonal to its status.
    #[serde(default)]
    pub board: Board,
    /// The owner asked for the current attempt to be held stopped (`paused`)
    /// and has not resumed it. Kept while the task is `unknown` or queued
    /// again after its worker was lost, so that evidence of that attempt
    /// brings it back `paused`, not `running`; a new grant clears it (a new
    /// attempt starts running).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_requested: bool,
}

/// The board projection of a finished task. `deleted` hides it
/// for good — no late evidence, resume or old client brings it back — while its
/// record stays for audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Board {
    #[default]
    Active,
    Archived,
    Deleted,
}

impl Board {
    pub fn as_str(self) -> &'static str {
        match self {
            Board::Active => "active",
            Board::Archived => "archived",
            Board::Deleted => "deleted",
        }
    }
}

impl Lifecycle {
    /// A newly submitted task.
    pub fn queued(idempotent: bool) -> Lifecycle {
        Lifecycle {
            status: Status::Queued,
            attempt: Attempt(0),
            epoch: Epoch(0),
            worker: None,
            idempotent,
            kill_requested: false,
            kill_reason: None,
            hint: None,
            outcome: None,
            board: Board::Active,
            pause_requested: false,
        }
    }

    /// A newly submitted task held for approval (`blocked`, with `hint`).
    pub fn held(idempotent: bool, hint: RecoveryHint) -> Lifecycle {
        Lifecycle { status: Status::Blocked, hint: Some(Box::new(hint)), ..Lifecycle::queued(idempotent) }
    }

    /// What a start of the current attempt makes of the task: a pending kill
    /// first, then a pending pause.
    fn started_status(&self) -> Status {
        match (self.kill_requested, self.pause_requested) {
            (true, _) => Status::Stopping,
            (false, true) => Status::Paused,
            (false, false) => Status::Running,
        }
    }
}

/// Something that happened to a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The leader grants the next attempt to `worker` under `epoch`.
    Grant { worker: WorkerId, epoch: Epoch },
    /// The worker refused the grant, or its sidecar proved the attempt never
    /// recorded an intent: nothing ran.
    Refused { attempt: Attempt, epoch: Epoch },
    /// The worker recorded the intent and spawned the process.
    Started { attempt: Attempt, epoch: Epoch },
    /// The attempt finished; evidence from the worker or its sidecar.
    Finished { attempt: Attempt, epoch: Epoch, outcome: Outcome },
    /// A client asked to stop the task, saying why (or not).
    KillRequested { reason: Option<Box<str>> },
    /// The leader judged `worker` lost (no heartbeat for the worker TTL) and
    /// could not reach its sidecar either: no evidence either way.
    WorkerLost { worker: WorkerId },
    /// The worker machine proved the attempt's process gone without exit
    /// evidence (its monitor died with it, or its records are unreadable).
    Lost { attempt: Attempt, epoch: Epoch, hint: RecoveryHint },
    /// The coordinator begins a workflow's steps. A workflow never goes to a
    /// worker: it runs (attempt 1, no worker) while its child tasks run.
    StepsBegan { epoch: Epoch },
    /// A workflow's steps settled it: the last one completed, one did not, or a
    /// kill stopped them.
    StepsEnded { outcome: Outcome },
    /// The owner archives a finished task.
    Archive,
    /// The owner brings an archived task back to the board.
    Unarchive,
    /// The owner deletes a finished task: hidden for good.
    Delete,
    // ---- retries (see `retry_move`) ----
    /// The current attempt ended for a cause the task's retry policy lists,
    /// with retries left (the coordinator decided so from the policy and the
    /// attempt count): queued again, to be granted as the next attempt once its
    /// backoff passed. Only for an idempotent task nobody asked to kill.
    Retry { attempt: Attempt, epoch: Epoch },
    /// `worker` was judged lost with no evidence either way, and the task's
    /// retry policy allows no further attempt for a lost one (it does not list
    /// `lost`, or its retries are used up): the idempotent task waits `unknown`
    /// for its machine's evidence, as a non-idempotent one does, instead of
    /// being queued again.
    WorkerLostFinal { worker: WorkerId },
    /// The current attempt's process is proven gone without an exit status,
    /// and the task declares how to resume it (the coordinator decided so
    /// with [`crate::resume::decide`]): queued again, to run its resume
    /// command as the next attempt. The one way a task that is not
    /// idempotent runs a second attempt after its intent — allowed only on
    /// proof that the first can no longer run. Never for a task with a kill
    /// requested.
    Resume { attempt: Attempt, epoch: Epoch },
    // ---- pause and resume (see `pause_move`) ----
    /// The owner asks for the running attempt to be held stopped.
    PauseRequested,
    // ---- approval ----
    /// Someone allowed to (see the coordinator's approval policy) lets a
    /// task held for approval start: it is queued. Applied once: a second
    /// approval finds it queued (a duplicate) or beyond.
    Approved,
    /// The owner asks for a paused attempt to go on.
    ResumeRequested,
}

/// Why an event changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unchanged {
    /// The task is terminal; nothing moves it again.
    Terminal,
    /// The event names another attempt or an older epoch.
    Stale,
    /// The event repeats what the task already says (a retried report, a second kill).
    Duplicate,
    /// The event does not apply to the task's status (a start of a queued task, …).
    NotApplicable,
}

/// What [`apply`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Persist this new lifecycle.
    Changed(Lifecycle),
    /// Keep the task as it is.
    Unchanged(Unchanged),
}

impl Decision {
    /// The lifecycle after the event, whether or not it changed.
    pub fn resulting(&self, before: &Lifecycle) -> Lifecycle {
        match self {
            Decision::Changed(l) => l.clone(),
            Decision::Unchanged(_) => before.clone(),
        }
    }
}

fn is_current(l: &Lifecycle, attempt: Attempt, epoch: Epoch) -> bool {
    attempt == l.attempt && attempt.0 > 0 && epoch >= l.epoch
}

/// The transition table. Pure: same input, same output.
pub fn apply(l: &Lifecycle, event: &Event) -> Decision {
    use Decision::{Changed, Unchanged as Keep};
    use Status::*;
    // Board moves apply to finished tasks only (an `unknown` one may still come
    // back to life on evidence; settle it first); they never touch the status,
    // and terminal still absorbs everything else.
    if let Some(board) = board_move(l, event) {
        return board;
    }
    if let Some(pause) = pause_move(l, event) {
        return pause;
    }
    if l.status.is_terminal() {
        return Keep(Unchanged::Terminal);
    }
    if let Some(retry) = retry_move(l, event) {
        return retry;
    }
    let mut next = l.clone();
    match event {
        Event::Grant { worker, epoch } => {
            // An attempt number is never given twice: past the last one the
            // task is not granted again (saturating would repeat it).
            if l.status != Queued || l.kill_requested || *epoch < l.epoch || l.attempt.0 == u32::MAX {
                return Keep(Unchanged::NotApplicable);
            }
            next.status = Leased;
            next.attempt = l.attempt.next();
            next.epoch = *epoch;
            next.worker = Some(worker.clone());
            next.hint = None;
            next.pause_requested = false;
            Changed(next)
        }
        Event::Refused { attempt, epoch } => {
            if !is_current(l, *attempt, *epoch) {
                return Keep(Unchanged::Stale);
            }
            match l.status {
                Leased => {
                    next.status = Queued;
                    next.worker = None;
                    Changed(next)
                }
                // Nothing ran and a kill is pending: the kill wins without a process.
                Stopping | Unknown if l.kill_requested => {
                    next.status = Killed;
                    next.hint = None;
                    next.outcome = Some(Outcome::new(Ending::Killed, None, Some("killed before it started".into())));
                    Changed(next)
                }
                // Proof that the attempt never started settles an unknown task:
                // it may run again.
                Unknown => {
                    next.status = Queued;
                    next.worker = None;
                    next.hint = None;
                    Changed(next)
                }
                Queued => Keep(Unchanged::Duplicate),
                _ => Keep(Unchanged::NotApplicable),
            }
        }
        Event::Started { attempt, epoch } => {
            if !is_current(l, *attempt, *epoch) {
                return Keep(Unchanged::Stale);
            }
            match l.status {
                // A start seen after the task was marked unknown because its
                // machine was unreachable is evidence that the attempt lives.
                // After the machine itself said the process is gone (`Lost`), a
                // late start report proves nothing; nor does one about an attempt
                // given up by queueing the task again (its copy is stopped where
                // it still runs).
                Leased => {
                    next.status = l.started_status();
                    next.hint = None;
                    Changed(next)
                }
                Unknown if l.hint.as_ref().is_none_or(|h| h.tag == HintTag::WorkerUnreachable) => {
                    next.status = l.started_status();
                    next.hint = None;
                    Changed(next)
                }
                Running | Stopping | Paused => Keep(Unchanged::Duplicate),
                _ => Keep(Unchanged::NotApplicable),
            }
        }
        Event::Finished { attempt, epoch, outcome } => {
            if !is_current(l, *attempt, *epoch) {
                return Keep(Unchanged::Stale);
            }
            if matches!(l.status, Queued | Blocked) {
                return Keep(Unchanged::NotApplicable);
            }
            next.status = outcome.ending.status();
            next.outcome = Some(outcome.clone());
            next.hint = None;
            Changed(next)
        }
        Event::Lost { attempt, epoch, hint } => {
            if !is_current(l, *attempt, *epoch) {
                return Keep(Unchanged::Stale);
            }
            match l.status {
                // Without exit evidence nothing proves the outcome, idempotent or
                // not: the task waits, unknown, for an operator or late evidence.
                Leased | Running | Stopping | Unknown | Paused => {
                    next.status = Unknown;
                    next.hint = Some(Box::new(hint.clone()));
                    if next == *l {
                        Keep(Unchanged::Duplicate)
                    } else {
                        Changed(next)
                    }
                }
                _ => Keep(Unchanged::NotApplicable),
            }
        }
        Event::StepsBegan { epoch } => match l.status {
            // Only a task never granted: a workflow is submitted and begun at once.
            Queued if l.attempt.0 == 0 && !l.kill_requested => {
                next.status = Running;
                next.attempt = l.attempt.next();
                next.epoch = *epoch;
                Changed(next)
            }
            Running if l.worker.is_none() && l.attempt.0 > 0 => Keep(Unchanged::Duplicate),
            _ => Keep(Unchanged::NotApplicable),
        },
        Event::StepsEnded { outcome } => match l.status {
            Running | Stopping if l.worker.is_none() && l.attempt.0 > 0 => {
                next.status = outcome.ending.status();
                next.outcome = Some(outcome.clone());
                next.hint = None;
                Changed(next)
            }
            _ => Keep(Unchanged::NotApplicable),
        },
        Event::Archive | Event::Unarchive | Event::Delete => Keep(Unchanged::NotApplicable),
        // Decided by `retry_move` above.
        Event::Retry { .. } | Event::WorkerLostFinal { .. } | Event::Resume { .. } => Keep(Unchanged::NotApplicable),
        Event::PauseRequested | Event::ResumeRequested => Keep(Unchanged::NotApplicable),
        Event::Approved => match l.status {
            Blocked => {
                next.status = Queued;
                next.hint = None;
                Changed(next)
            }
            Queued if l.attempt.0 == 0 => Keep(Unchanged::Duplicate),
            _ => Keep(Unchanged::NotApplicable),
        },
        Event::KillRequested { reason } => {
            // The first kill's reason is the one kept.
            next.kill_reason = l.kill_reason.clone().or_else(|| reason.clone());
            match l.status {
                Queued => {
                    next.status = Killed;
                    next.kill_requested = true;
                    next.outcome = Some(Outcome::new(Ending::Killed, None, Some("killed while queued".into())));
                    Changed(next)
                }
                Blocked => {
                    next.status = Killed;
                    next.kill_requested = true;
                    next.hint = None;
                    let detail = "killed while awaiting approval: it never ran";
                    next.outcome = Some(Outcome::new(Ending::Killed, None, Some(detail.into())));
                    Changed(next)
                }
                // A paused group is ended too: the shim continues it after
                // SIGTERM so that it can handle the signal.
                Leased | Running | Paused => {
                    next.status = Stopping;
                    next.kill_requested = true;
                    Changed(next)
                }
                Unknown if !l.kill_requested => {
                    next.kill_requested = true;
                    Changed(next)
                }
                _ => Keep(Unchanged::Duplicate),
            }
        }
        Event::WorkerLost { worker } => {
            if l.worker.as_ref() != Some(worker) || !l.status.is_on_worker() {
                return Keep(Unchanged::NotApplicable);
            }
            match l.status {
                Leased | Running | Paused if l.idempotent => {
                    next.status = Queued;
                    next.worker = None;
                    Changed(next)
                }
                Stopping => {
                    next.hint = Some(Box::new(RecoveryHint {
                        tag: HintTag::KillPending,
                        message: format!(
                            "a kill was requested but worker {worker} and its sidecar are unreachable while holding \
                             attempt {}; the task stays stopping until the process is proven gone: the kill is \
                             carried out when the machine returns (or its evidence settles the task)",
                            l.attempt
                        ),
                    }));
                    if next == *l {
                        Keep(Unchanged::Duplicate)
                    } else {
                        Changed(next)
                    }
                }
                Leased | Running | Paused => {
                    next.status = Unknown;
                    next.hint = Some(Box::new(RecoveryHint {
                        tag: HintTag::WorkerUnreachable,
                        message: format!(
                            "worker {worker} and its sidecar are unreachable while holding attempt {}; the task is \
                             not idempotent so it will not be run again. It settles by itself when the machine \
                             returns with evidence; otherwise check the worker machine and resubmit if it did not \
                             run.",
                            l.attempt
                        ),
                    }));
                    if next == *l {
                        Keep(Unchanged::Duplicate)
                    } else {
                        Changed(next)
                    }
                }
                _ => Keep(Unchanged::NotApplicable),
            }
        }
    }
}

/// The retry and resume rules, for a task that is not terminal: `Some` for
/// a retry or resume event, `None` for every other event.
///
/// A retry queues again only an idempotent task whose current attempt it
/// names, on a worker (`leased`, `running`, `paused`) or `unknown` (late evidence of a
/// failure), and never one with a kill requested: a kill always wins. A
/// resume does the same for a task of either kind (the coordinator sends it
/// only on proof that the attempt's process is gone).
fn retry_move(l: &Lifecycle, event: &Event) -> Option<Decision> {
    use Status::*;
    let decision = match event {
        Event::Retry { attempt, epoch } => requeue(l, *attempt, *epoch, l.idempotent),
        Event::Resume { attempt, epoch } => requeue(l, *attempt, *epoch, true),
        Event::WorkerLostFinal { worker } => {
            if l.worker.as_ref() != Some(worker) || !l.status.is_on_worker() {
                return Some(Decision::Unchanged(Unchanged::NotApplicable));
            }
            // As for a task that may not run again: the plain rule, read as
            // if the task were not idempotent.
            let as_final = Lifecycle { idempotent: false, ..l.clone() };
            match apply(&as_final, &Event::WorkerLost { worker: worker.clone() }) {
                Decision::Changed(mut next) => {
                    next.idempotent = l.idempotent;
                    if next.status == Unknown {
                        next.hint = Some(Box::new(RecoveryHint {
                            tag: HintTag::WorkerUnreachable,
                            message: format!(
                                "worker {worker} and its sidecar are unreachable while holding attempt {}; the \
                                 task's retry policy allows no further attempt after a lost one, so it is not run \
                                 again. It settles by itself when the machine returns with evidence; otherwise \
                                 check the worker machine and resubmit if it did not run.",
                                l.attempt
                            ),
                        }));
                    }
                    Decision::Changed(next)
                }
                keep => keep,
            }
        }
        _ => return None,
    };
    Some(decision)
}

/// A retry or resume of the current attempt (`allowed`: the event's own
/// condition): queued again from a worker (`leased`, `running`, `paused`)
/// or `unknown`, clean of worker, hint and outcome, its attempt number kept
/// (the next grant is a new attempt); never with a kill requested.
fn requeue(l: &Lifecycle, attempt: Attempt, epoch: Epoch, allowed: bool) -> Decision {
    use Status::*;
    if !is_current(l, attempt, epoch) {
        return Decision::Unchanged(Unchanged::Stale);
    }
    match l.status {
        Leased | Running | Paused | Unknown if allowed && !l.kill_requested => {
            let mut next = l.clone();
            next.status = Queued;
            next.worker = None;
            next.hint = None;
            next.outcome = None;
            Decision::Changed(next)
        }
        Queued => Decision::Unchanged(Unchanged::Duplicate),
        _ => Decision::Unchanged(Unchanged::NotApplicable),
    }
}

/// The pause rules: `Some` for a pause or resume, `None` for every other
/// event. Only a started attempt on a worker is paused (not a queued or
/// leased task, not a workflow, whose steps are tasks of their own, not a
/// task being killed); the wish is kept through `unknown`, where a resume
/// withdraws it.
fn pause_move(l: &Lifecycle, event: &Event) -> Option<Decision> {
    use Decision::{Changed, Unchanged as Keep};
    use Status::*;
    let pause = match event {
        Event::PauseRequested => true,
        Event::ResumeRequested => false,
        _ => return None,
    };
    if l.status.is_terminal() {
        return Some(Keep(Unchanged::Terminal));
    }
    let mut next = l.clone();
    next.pause_requested = pause;
    let decision = match (pause, l.status) {
        (true, Running) if l.worker.is_some() => {
            next.status = Paused;
            Changed(next)
        }
        (true, Paused) | (false, Running) => Keep(Unchanged::Duplicate),
        (false, Paused) => {
            next.status = Running;
            Changed(next)
        }
        // A resume withdraws the wish of a task whose attempt is in doubt
        // (`unknown`, or queued again after its worker was lost).
        (false, Unknown | Queued) if l.pause_requested => Changed(next),
        (false, Unknown) => Keep(Unchanged::Duplicate),
        _ => Keep(Unchanged::NotApplicable),
    };
    Some(decision)
}

/// The board rules: `Some` for a board event, `None` for every other event.
fn board_move(l: &Lifecycle, event: &Event) -> Option<Decision> {
    use Board::*;
    let settled = l.status.is_terminal();
    let to = match (event, l.board) {
        (Event::Archive | Event::Unarchive | Event::Delete, _) if !settled => {
            return Some(Decision::Unchanged(Unchanged::NotApplicable))
        }
        (Event::Archive, Active) => Archived,
        (Event::Unarchive, Archived) => Active,
        (Event::Delete, Active | Archived) => Deleted,
        (Event::Archive, Archived) | (Event::Unarchive, Active) | (Event::Delete, Deleted) => {
            return Some(Decision::Unchanged(Unchanged::Duplicate))
        }
        (Event::Archive | Event::Unarchive, Deleted) => return Some(Decision::Unchanged(Unchanged::NotApplicable)),
        _ => return None,
    };
    Some(Decision::Changed(Lifecycle { board: to, ..l.clone() }))
}

#[cfg(test)]
#[path = "lifecycle_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "lifecycle_pause_tests.rs"]
mod pause_tests;
