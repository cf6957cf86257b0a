//! Every message that crosses a process boundary: the client API, worker ↔
//! coordinator traffic, output reads, and the worker ↔ sidecar local protocol.
//!
//! Messages are plain data. Refusals that a peer must understand (`StaleEpoch`,
//! `NotFound`, …) are variants here, not strings in a log. All of them travel
//! through [`crate::codec`].

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ids::{Attempt, Epoch, Kind, SessionId, TaskId, WorkerId};
use crate::lifecycle::{Board, Outcome, RecoveryHint, Status};
use crate::resources::{ResourceLimits, ResourceSupport};
use crate::retry::{AttemptEnd, RetryPolicy};
use crate::spec::TaskSpec;

// ---------------------------------------------------------------- client API

/// A client's request to the leader coordinator (subject [`crate::subjects::API`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApiRequest {
    Submit(SubmitRequest),
    /// Many tasks in one request (see [`SubmitBatch`]).
    SubmitBatch(SubmitBatch),
    Get {
        session: SessionId,
        task: TaskId,
    },
    /// The whole list in one reply (refused as too large past about a
    /// thousand tasks: use `ListPage`).
    List {
        session: SessionId,
        all: bool,
    },
    /// One page of the list, by task number, after `after`: at most
    /// [`MAX_LIST_PAGE_BYTES`] of snapshots; `next` continues it. With
    /// `before`, newest first instead: tasks numbered below it (every task
    /// when `before` is `u64::MAX`), highest number first; `next` is then
    /// the `before` of the following page. `after` is ignored with `before`.
    ListPage {
        session: SessionId,
        all: bool,
        after: Option<u64>,
        /// Absent from older clients' requests: they page oldest first.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        before: Option<u64>,
    },
    Kill {
        session: SessionId,
        task: TaskId,
        /// Why, kept verbatim on the task (the first kill's; at most
        /// [`MAX_KILL_REASON_BYTES`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// Hold the reply until the task reached `until` (by default its end) or
    /// `timeout_ms` passed (capped by the coordinator at [`MAX_WAIT_MS`];
    /// clients loop for longer waits).
    Wait {
        session: SessionId,
        task: TaskId,
        timeout_ms: u64,
        /// Absent (the end) from older clients' requests, and left out of the
        /// bytes for the end, so an older coordinator reads the same wait.
        #[serde(default, skip_serializing_if = "WaitFor::is_end")]
        until: WaitFor,
    },
    /// A surface (a finished `logs` read, `watch`) delivered the task's terminal
    /// state to its owner: mark it `reported`. Refused unless the task is terminal.
    MarkReported {
        session: SessionId,
        task: TaskId,
    },
    /// Move a finished task to the archive; its files on the worker machine are
    /// released by a durable cleanup job.
    Archive {
        session: SessionId,
        task: TaskId,
    },
    /// Bring an archived task back; a cleanup job not yet done is cancelled.
    Unarchive {
        session: SessionId,
        task: TaskId,
    },
    /// Hide a finished task for good (its record stays for audit); its files
    /// are released like an archive's.
    Delete {
        session: SessionId,
        task: TaskId,
    },
    /// Cluster view: leader epoch and workers.
    Status,
    /// The final output of a final-output-only task: empty while it runs,
    /// its final output once it ended (idempotent; it reports the task).
    FinalOutput {
        session: SessionId,
        task: TaskId,
    },
    /// The caller's notices (task ends, monitor matches), read from the
    /// durable consumer the leader keeps for the caller's owner — clients never
    /// define consumers. First acknowledges `acks` (tokens of notices the
    /// caller handled; a token of another owner's consumer is refused), then
    /// returns up to `max` (capped at [`MAX_NOTICES`]) unacknowledged notices,
    /// waiting at most `wait_ms` (capped at [`MAX_NOTICE_WAIT_MS`]) for the
    /// first. A notice not acknowledged within 30 s is delivered again.
    Notices {
        session: SessionId,
        acks: Vec<String>,
        max: u32,
        wait_ms: u64,
    },
    /// Hold a running task's process group stopped (under kill's owner
    /// rules); refused `NotRunning` unless it runs on a worker. Answered
    /// with the snapshot once `paused` is recorded; the worker is told after.
    Pause {
        session: SessionId,
        task: TaskId,
    },
    /// Let a paused task go on; a running one is answered as it is.
    Resume {
        session: SessionId,
        task: TaskId,
    },
    /// Let a task held for approval start (see the coordinator's approval
    /// policy for who may); a task approved already is answered as it is.
    Approve {
        session: SessionId,
        task: TaskId,
    },
    /// Keep one message for the next attempt of an `agent` task that
    /// declares a resume command while no attempt of it runs (its machine
    /// lost it: `unknown`, or queued to resume). The resumed attempt's shim
    /// writes the kept messages, in order, into its input before the task
    /// starts. Refused `NotRunning` while an attempt is leased (its input
    /// goes to it once it runs) and for a task that cannot be resumed;
    /// answered with the snapshot (its `agent_resume.pending_input`).
    KeepInput {
        session: SessionId,
        task: TaskId,
        message: String,
    },
    /// A `Submit` and a `Wait` for the task it names, in one request: the
    /// submit is judged as one (a refusal is the answer, and nothing is
    /// created), then the reply is held as a `Wait`'s, for at most
    /// `timeout_ms` (capped at [`MAX_WAIT_MS`]): `Waited` with the task's
    /// end, or with its snapshot so far when the time passed (the client
    /// then waits on). A retry with the same key waits on the task the
    /// first created. A coordinator older than it refuses it as
    /// `InvalidRequest`; clients then submit and wait in two requests.
    Run {
        submit: SubmitRequest,
        timeout_ms: u64,
        /// As a `Wait`'s: what the reply is held for.
        #[serde(default, skip_serializing_if = "WaitFor::is_end")]
        until: WaitFor,
    },
}

/// What a `Wait` or a `Run` holds its reply for.
///
/// A coordinator that predates `Start` reads a start wait as a wait for the
/// end: its answer comes later, and says no less (an ended task has left the
/// queue too).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WaitFor {
    /// The task's end: `completed`, `killed` or `failed`.
    #[default]
    End,
    /// The task left the queue for good: `running` (the intent is durable
    /// and the process started), `paused`, `stopping`, `unknown`, or ended.
    /// A task that ended without ever running reaches it too: the snapshot's
    /// `started_at_ms` tells.
    Start,
}

impl WaitFor {
    pub fn is_end(&self) -> bool {
        *self == WaitFor::End
    }

    /// Whether a task in `status` has reached what is waited for.
    pub fn reached(self, status: Status) -> bool {
        match self {
            WaitFor::End => status.is_terminal(),
            WaitFor::Start => !matches!(status, Status::Queued | Status::Leased | Status::Blocked),
        }
    }
}

/// Longest a single `Wait` request is held by the coordinator.
pub const MAX_WAIT_MS: u64 = 20_000;
/// Most notices one `Notices` reply carries.
pub const MAX_NOTICES: u32 = 64;
/// Longest a `Notices` request waits for a first notice.
pub const MAX_NOTICE_WAIT_MS: u64 = 5_000;
/// Most acknowledgement tokens one `Notices` request may carry.
pub const MAX_NOTICE_ACKS: usize = 256;

impl ApiRequest {
    /// The verb, for logs, spans and metrics.
    pub fn verb(&self) -> &'static str {
        match self {
            ApiRequest::Submit(_) => "submit",
            ApiRequest::SubmitBatch(_) => "submit-batch",
            ApiRequest::Get { .. } => "get",
            ApiRequest::List { .. } | ApiRequest::ListPage { .. } => "list",
            ApiRequest::Kill { .. } => "kill",
            ApiRequest::Wait { .. } => "wait",
            ApiRequest::MarkReported { .. } => "mark-reported",
            ApiRequest::Archive { .. } => "archive",
            ApiRequest::Unarchive { .. } => "unarchive",
            ApiRequest::Delete { .. } => "delete",
            ApiRequest::Status => "status",
            ApiRequest::FinalOutput { .. } => "final-output",
            ApiRequest::Notices { .. } => "notices",
            ApiRequest::Pause { .. } => "pause",
            ApiRequest::Resume { .. } => "resume",
            ApiRequest::Approve { .. } => "approve",
            ApiRequest::KeepInput { .. } => "keep-input",
            ApiRequest::Run { .. } => "run",
        }
    }
}

impl ApiRequest {
    /// The owner the request claims to act for; the leader replaces it with
    /// the owner the transport vouches for before acting on it.
    pub fn session_mut(&mut self) -> Option<&mut SessionId> {
        match self {
            ApiRequest::Submit(req) | ApiRequest::Run { submit: req, .. } => Some(&mut req.session),
            ApiRequest::SubmitBatch(req) => Some(&mut req.session),
            ApiRequest::Get { session, .. }
            | ApiRequest::List { session, .. }
            | ApiRequest::ListPage { session, .. }
            | ApiRequest::Kill { session, .. }
            | ApiRequest::Wait { session, .. }
            | ApiRequest::MarkReported { session, .. }
            | ApiRequest::Archive { session, .. }
            | ApiRequest::Unarchive { session, .. }
            | ApiRequest::Delete { session, .. }
            | ApiRequest::FinalOutput { session, .. }
            | ApiRequest::Notices { session, .. }
            | ApiRequest::Pause { session, .. }
            | ApiRequest::Resume { session, .. }
            | ApiRequest::Approve { session, .. }
            | ApiRequest::KeepInput { session, .. } => Some(session),
            ApiRequest::Status => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitRequest {
    pub session: SessionId,
    /// A retried submit with the same key returns the task the first one created.
    pub idempotency_key: Uuid,
    pub spec: TaskSpec,
}

/// Most tasks one [`SubmitBatch`] carries.
pub const MAX_BATCH_TASKS: usize = 1000;

/// Many tasks of one owner submitted in one request: every task is judged
/// before any is created, so one refusal (`ApiError::InBatch`, naming the
/// task by its place) stores nothing. The reply names the tasks in the
/// order given, once every one of them is durable. Each task has its own
/// idempotency key: a batch retried after a lost reply (or after a takeover
/// that stored only part of it) returns the tasks already created and
/// creates the rest. Two tasks of one batch may not share a key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmitBatch {
    pub session: SessionId,
    /// 1 to [`MAX_BATCH_TASKS`] tasks.
    pub tasks: Vec<BatchTask>,
}

/// One task of a [`SubmitBatch`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchTask {
    pub idempotency_key: Uuid,
    pub spec: TaskSpec,
}

/// A task a submit created, or the one its key created before (`existing`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Submitted {
    pub task: TaskId,
    pub existing: bool,
}

/// The coordinator's answer to an [`ApiRequest`].
pub type ApiReply = Result<ApiResponse, ApiError>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApiResponse {
    Submitted {
        task: TaskId,
        existing: bool,
    },
    /// A batch's tasks, in the order they were given.
    SubmittedBatch(Vec<Submitted>),
    Snapshot(TaskSnapshot),
    List(Vec<TaskSnapshot>),
    Page {
        tasks: Vec<TaskSnapshot>,
        next: Option<u64>,
    },
    Kill {
        result: KillResult,
        snapshot: TaskSnapshot,
    },
    /// `finished` is false when the wait timed out; the snapshot is then live.
    Waited {
        finished: bool,
        snapshot: TaskSnapshot,
    },
    Status(ClusterStatus),
    FinalOutput {
        finished: bool,
        text: String,
    },
    /// Notices of the caller's owner, oldest first, each with the token that
    /// acknowledges it.
    Notices(Vec<NoticeItem>),
}

/// One notice delivered to its owner, and the token that acknowledges it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticeItem {
    pub ack: String,
    pub notice: Notice,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KillResult {
    /// The kill was recorded; the task settles as `killed` once its group is gone.
    Requested,
    /// The task was already terminal; nothing changed.
    AlreadyFinished,
}

impl KillResult {
    pub fn as_str(self) -> &'static str {
        match self {
            KillResult::Requested => "requested",
            KillResult::AlreadyFinished => "already-finished",
        }
    }
}

/// Refusals a client can receive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ApiError {
    /// The task does not exist, or belongs to another session. The two are not
    /// distinguished so that ids reveal nothing.
    #[error("task {0} not found or not yours")]
    NotFound(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("invalid task spec: {0}")]
    InvalidSpec(String),
    /// A batch refused because of one of its tasks: `index` is its place in
    /// the batch (from 0), `error` why. Nothing of the batch was stored.
    #[error("task {} of the batch (counting from 1): {error}; nothing of the batch was stored", index + 1)]
    InBatch { index: u32, error: Box<ApiError> },
    /// No live or past worker advertised the kind, and it is not builtin.
    #[error("unknown kind {kind:?}: no worker runs it (kinds known: {})", known.join(", "))]
    UnknownKind { kind: String, known: Vec<String> },
    #[error("this coordinator is not the leader")]
    NotLeader,
    #[error("coordinator unavailable: {0}")]
    Unavailable(String),
    /// Input for a task that is not running: not started yet, or ended.
    /// `status` says which, in words.
    #[error("task {task} is not running ({status}); input goes only to a running agent task")]
    NotRunning { task: String, status: String },
    /// Input for a task whose kind reads no input: only `agent` tasks do.
    #[error("task {task} is a {kind} task and takes no input; only agent tasks do (submit with --kind agent)")]
    NoInput { task: String, kind: String },
    /// An input message that is empty or larger than [`MAX_INPUT_BYTES`].
    #[error("input of {size} bytes refused: one message holds 1 to {max} bytes")]
    InputSize { size: u64, max: u64 },
    /// The task has not read its earlier input and its buffer has no room for
    /// this message. Nothing of the message was delivered.
    #[error("input buffer of task {task} is full (the task is not reading its input); nothing was sent")]
    InputFull { task: String },
    /// The request did not come with an identity the transport vouches for
    /// (on an authenticating cluster, only requests through the clients'
    /// account do).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// A per-identity quota would be exceeded: `limit` names it (`live-tasks`,
    /// `kept-tasks`, `output-bytes`), `current` is what the identity holds
    /// now, `requested` what the submit would add, `max` the limit. Nothing
    /// was stored. Retry once tasks end (live), are garbage-collected (kept),
    /// or with less output kept (output).
    #[error("quota exceeded for {identity:?}: {limit} holds {current} of {max}, this submit needs {requested} more; nothing was stored")]
    Quota { identity: String, limit: String, current: u64, requested: u64, max: u64 },
    /// The task's record, with room for its largest outcome (final output,
    /// detail, hint), would not fit in one registry message. Nothing was
    /// stored; `what` names the record (the task, or a workflow step).
    #[error("{what} would need {size} bytes in the registry with room for its outcome; one registry message holds {max}: make the command, environment or steps smaller; nothing was stored")]
    RecordTooLarge { what: String, size: u64, max: u64 },
    /// The registry is too full to take a new task while keeping room for the
    /// tasks already running to finish. Nothing was stored.
    #[error("the registry is full ({used} of {max} bytes, room kept for running tasks to finish); new tasks are refused until finished ones are garbage-collected or the limit is raised; nothing was stored")]
    RegistryFull { used: u64, max: u64 },
    /// The registry is behind the high-water mark kept outside it (it lost
    /// acknowledged writes, or was deleted, recreated or restored from an
    /// older backup): `coordinator` holds the leader lease and refuses to
    /// lead it. Nothing is scheduled, stored or answered until an operator
    /// restores the registry or accepts the loss.
    /// `witness` names who kept the mark when it was not the lease: a
    /// machine's store, whose grants carried marks the registry no longer
    /// reaches (the lease went back with the registry).
    #[error("coordinator {coordinator} refuses to lead: the registry is behind its high-water mark (expected at least {expected}{}, found {found}); restore the registry stream from a backup that holds the mark, or, once the loss is judged, restart one coordinator with --accept-registry-rollback (see operations.md, \"A registry that went back\")", witnessed(.witness))]
    RegistryBehind {
        coordinator: String,
        expected: RegistryMark,
        found: RegistryMark,
        #[serde(default)]
        witness: Option<String>,
    },
    /// The submit names a limit for its concurrency key other than the one
    /// in force (`from` says where that one comes from: the coordinators'
    /// configuration, or the key's live tasks). Nothing was stored.
    #[error("concurrency key {key:?} has the limit {in_force} in force ({from}); this submit asks for {asked}: give --concurrency-limit {in_force}, or none; nothing was stored")]
    ConcurrencyLimitConflict { key: String, in_force: u32, asked: u32, from: String },
    /// An approval by someone the approval policy does not allow; `reason`
    /// says the policy and how to go on. Nothing changed.
    #[error("{reason}")]
    ApprovalRefused { task: String, reason: String },
    /// An approval of a task that is not held for one (it was never held,
    /// or runs or ended). `status` says where it is.
    #[error("task {task} is {status}, not awaiting approval: only a task submitted held (--hold, or by the approval policy) and not yet approved can be approved")]
    NotAwaitingApproval { task: String, status: String },
}

/// The registry's high-water mark: how far the registry is known to have
/// come. It is kept outside the registry (in the leader lease) so that a
/// registry that went back — acknowledged writes lost, the stream deleted,
/// recreated or restored from an older backup — is noticed before anyone
/// leads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegistryMark {
    /// The registry stream's last sequence.
    pub last_seq: u64,
    /// The highest task number stored (task numbers are never reused).
    pub highest_task: u64,
    /// The highest epoch claimed in the registry.
    pub epoch: Epoch,
}

fn witnessed(witness: &Option<String>) -> String {
    witness.as_deref().map(|w| format!(", as kept by {w}")).unwrap_or_default()
}

impl RegistryMark {
    /// Whether a registry found at `found` is behind this mark in any part.
    pub fn is_ahead_of(&self, found: &RegistryMark) -> bool {
        found.last_seq < self.last_seq || found.highest_task < self.highest_task || found.epoch < self.epoch
    }

    /// The least mark at or past both, part by part.
    pub fn merge(self, other: RegistryMark) -> RegistryMark {
        RegistryMark {
            last_seq: self.last_seq.max(other.last_seq),
            highest_task: self.highest_task.max(other.highest_task),
            epoch: self.epoch.max(other.epoch),
        }
    }

    /// [`RegistryMark::merge`] over optional marks.
    pub fn merged(a: Option<RegistryMark>, b: Option<RegistryMark>) -> Option<RegistryMark> {
        match (a, b) {
            (Some(a), Some(b)) => Some(a.merge(b)),
            (a, b) => a.or(b),
        }
    }
}

impl std::fmt::Display for RegistryMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sequence {}, task number {}, epoch {}", self.last_seq, self.highest_task, self.epoch)
    }
}

/// A fresh read-only projection of one task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSnapshot {
    pub id: TaskId,
    pub kind: Kind,
    pub label: String,
    pub owner: SessionId,
    pub status: Status,
    pub detail: Option<String>,
    pub exit_code: Option<i32>,
    /// Output bytes dropped past the worker's per-task cap.
    pub output_dropped: u64,
    pub attempt: Attempt,
    pub epoch: Epoch,
    pub worker: Option<WorkerId>,
    pub idempotent: bool,
    pub kill_requested: bool,
    /// Why it was asked to stop, as the first kill said it.
    #[serde(default)]
    pub kill_reason: Option<String>,
    pub hint: Option<RecoveryHint>,
    /// Epoch milliseconds (wall clock, for humans).
    pub created_at_ms: u64,
    pub started_at_ms: Option<u64>,
    /// When its current attempt was seen running, for a task that keeps an
    /// attempt history (`started_at_ms` is its first attempt's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt_started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// A kill or a wait delivered the terminal state to the owner (`get` and
    /// `ls` never set it).
    pub reported: bool,
    /// Active, archived or deleted.
    #[serde(default)]
    pub board: Board,
    /// The task's files on its worker machine were released (archive/delete).
    #[serde(default)]
    pub cleaned: bool,
    /// Where the cleanup job of an archive or delete stands, if there is one.
    #[serde(default)]
    pub cleanup: Option<CleanupState>,
    /// For a workflow step: the workflow it belongs to.
    #[serde(default)]
    pub parent: Option<TaskId>,
    /// For a workflow: each step, in order, with its child task once created.
    #[serde(default)]
    pub steps: Vec<StepView>,
    /// For a monitor: how many output lines matched its pattern so far.
    #[serde(default)]
    pub matches: u64,
    /// A final-output-only task: read it with `FinalOutput`, not from the sidecar.
    #[serde(default)]
    pub final_output: bool,
    /// Each ended attempt of a task with a retry policy, oldest first
    /// (empty for other tasks, and left out of the encoding then).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<AttemptEnd>,
    /// A queued task that may not start before this wall-clock time (epoch
    /// ms, the leader's estimate): its `--not-before`, or the backoff before
    /// its next retry. Never silently queued: `get` names the time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before_ms: Option<u64>,
    /// The task's retry policy, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    /// Its dispatch priority (0 when not set, and then left out).
    #[serde(default, skip_serializing_if = "is_zero_i32")]
    pub priority: i32,
    /// Where it may run and its concurrency key, when it has them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<crate::placement::Placement>,
    /// For a task that ended, is `unknown` or `paused`: whether it can go on
    /// as it is, and how to go on either way — so a caller never has to
    /// guess from the status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resumability>,
    /// Its resource limits, when it has some.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceLimits>,
    /// An `agent` task that declares how it is resumed: the declaration,
    /// the values captured from its output, how often it was resumed, and
    /// the input kept for its next attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_resume: Option<crate::resume::ResumeView>,
}

/// Whether a task can go on as it is (`tenure resume` of a paused one), and
/// what to do to go on: the command, in words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resumability {
    pub resumable: bool,
    pub how: String,
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

/// Where a task's cleanup job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CleanupState {
    /// Sent (or being retried) until the machine answers.
    Pending,
    /// Cancelled by `unarchive`; waiting for the machine to say whether a copy
    /// already ran.
    Cancelling,
    /// Cancelled, and the machine confirmed the files are still there.
    Cancelled,
    /// The files are released.
    Done,
}

/// One step of a workflow as its snapshot shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepView {
    /// 1-based position in the workflow.
    pub index: u32,
    pub command: String,
    /// The child task running the step; `None` while the step has not begun
    /// (and for good when an earlier step failed or the workflow was killed).
    pub task: Option<TaskId>,
    pub status: Option<Status>,
    pub detail: Option<String>,
    pub hint: Option<RecoveryHint>,
}

/// What `tenure watch` receives on a session's notice subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Notice {
    /// A task ended (deduplicated by task id).
    Ended(Box<TaskSnapshot>),
    /// An output line of a `monitor` task matched its pattern (deduplicated by
    /// task and byte offset).
    Matched(MatchNotice),
}

impl Notice {
    /// The `Nats-Msg-Id` that makes a repeat of this notice a duplicate.
    pub fn dedupe_id(&self) -> String {
        match self {
            Notice::Ended(s) => s.id.to_string(),
            Notice::Matched(m) => format!("{}@{}", m.task, m.line.offset),
        }
    }

    pub fn owner(&self) -> &SessionId {
        match self {
            Notice::Ended(s) => &s.owner,
            Notice::Matched(m) => &m.owner,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchNotice {
    pub task: TaskId,
    pub owner: SessionId,
    pub label: String,
    pub line: MatchedLine,
    /// Epoch milliseconds when the leader recorded it.
    pub at_ms: u64,
}

/// An output line of a `monitor` task that matched its pattern.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchedLine {
    /// Where the line starts in the task's output stream (bytes, counting any
    /// dropped past the output cap): unique per task, so it deduplicates.
    pub offset: u64,
    /// The line without its newline, at most [`MAX_MATCH_LINE_BYTES`].
    pub text: String,
}

impl MatchedLine {
    /// The line at `offset`, cut to [`MAX_MATCH_LINE_BYTES`] on a character
    /// boundary.
    pub fn new(offset: u64, text: &str) -> MatchedLine {
        let mut cut = text.len().min(MAX_MATCH_LINE_BYTES);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        MatchedLine { offset, text: text[..cut].to_owned() }
    }
}

/// Longest matched line carried in a notice; longer ones are cut.
pub const MAX_MATCH_LINE_BYTES: usize = 1024;
/// Most matched lines in one report.
pub const MAX_MATCHES_PER_REPORT: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub leader_epoch: Epoch,
    pub workers: Vec<WorkerStatus>,
    pub tasks_by_status: Vec<(Status, u64)>,
    /// Tasks the registry places on a worker (leased, running, stopping) that
    /// their worker has not yet listed in a heartbeat to this leader since
    /// their last status change. Zero after a takeover means every running
    /// task was adopted: its worker holds it and reports to the new leader.
    #[serde(default)]
    pub unconfirmed: u64,
    /// The coordinator that answered (the leader) and its lease.
    #[serde(default)]
    pub leader: Option<LeaderStatus>,
    /// Standby coordinators the leader heard from in the last 5 s.
    #[serde(default)]
    pub standbys: Vec<StandbyStatus>,
}

/// The leader's view of its own lease. Durations are on the leader's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderStatus {
    pub name: String,
    /// Name and per-process nonce: unique to one coordinator process.
    pub holder: String,
    pub epoch: Epoch,
    /// Milliseconds since the last successful lease renewal was sent.
    pub lease_age_ms: u64,
    pub renewals: u64,
    pub lease_ttl_ms: u64,
    /// From judging the previous lease expired (or absent) to registry loaded
    /// and epoch claimed.
    pub adopted_in_ms: u64,
}

/// A standby coordinator as the leader last heard of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyStatus {
    pub name: String,
    pub holder: String,
    /// Milliseconds since its last presence message reached the leader.
    pub last_seen_ms: u64,
}

/// Published every second by each standby coordinator on
/// [`crate::subjects::COORD_PRESENCE`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorPresence {
    pub name: String,
    pub holder: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub id: WorkerId,
    pub slots: u32,
    pub running: u32,
    pub kinds: Vec<Kind>,
    /// Milliseconds since the leader last heard from the worker.
    pub last_seen_ms: u64,
    pub alive: bool,
    #[serde(default)]
    pub sidecar: SidecarHealth,
    /// An epoch above the leader's that this worker's machine claims to have
    /// seen and that no coordinator claimed in the registry: its sidecar
    /// refuses every command of this leader, so nothing is scheduled on it
    /// until it reports an epoch the registry knows.
    #[serde(default)]
    pub unproven_epoch: Option<Epoch>,
    /// Its labels, as its last heartbeat gave them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: crate::placement::Labels,
    /// Which resource limits the worker enforces, as its last heartbeat said.
    #[serde(default)]
    pub enforces: ResourceSupport,
}

// ----------------------------------------------------- worker → coordinator

/// Published every heartbeat interval on [`crate::subjects::heartbeat`] of its worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub worker: WorkerId,
    /// Changes each time the worker process starts.
    pub instance: Uuid,
    pub slots: u32,
    pub kinds: Vec<Kind>,
    /// Highest epoch the worker machine has seen.
    pub epoch_seen: Epoch,
    /// Attempts the worker holds (accepted, running or finished but unacknowledged).
    pub attempts: Vec<HeldAttempt>,
    /// How the machine's sidecar answered the worker's last probe.
    #[serde(default)]
    pub sidecar: SidecarHealth,
    /// The incarnation of the machine's store, as the sidecar last answered
    /// (none while it does not answer).
    #[serde(default)]
    pub incarnation: Option<Uuid>,
    /// The instance that ran on this machine's data directory before this
    /// one: a restarted worker takes its own predecessor's place at once,
    /// while a second live process with the same id is refused.
    #[serde(default)]
    pub replaces: Option<Uuid>,
    /// The highest registry mark this machine's store was given with a
    /// grant (see [`LeaseGrant::mark`]), as the sidecar last answered.
    #[serde(default)]
    pub mark: Option<RegistryMark>,
    /// The worker's labels (`--label KEY=VALUE`), matched against tasks'
    /// placement constraints. Left out of the encoding when empty.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: crate::placement::Labels,
    /// Which resource limits the worker enforces (none from an older
    /// worker, or on a host without control groups): a task with limits is
    /// granted only where they are all enforced.
    #[serde(default)]
    pub enforces: ResourceSupport,
    /// The machine's boot id (changes at every boot): the leader keeps the
    /// one a task was granted under, so that a machine that returns with
    /// another store and another boot proves that task's process gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<Box<str>>,
}

/// A worker machine's sidecar as its worker last saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SidecarHealth {
    /// Answering; intents can be recorded.
    #[default]
    Ok,
    /// Answering, but its store is unusable: nothing new can start there.
    Degraded,
    /// Not answering.
    Down,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldAttempt {
    pub task: TaskId,
    pub attempt: Attempt,
    /// The owner's pause wish the machine recorded for the attempt (the
    /// leader sends its own again while the two differ).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// An `agent` attempt with a process blocked reading its input (seen at
    /// two heartbeats in a row): it waits for `tenure send`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub waiting: bool,
}

/// A worker's report about one attempt (request on [`crate::subjects::report`] of its worker),
/// retried until acknowledged. Reports are idempotent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub worker: WorkerId,
    pub task: TaskId,
    pub attempt: Attempt,
    pub epoch: Epoch,
    pub event: ReportEvent,
}

/// Several reports of one worker in one request, on the same subject as one
/// [`Report`] (at most [`MAX_REPORTS`], each naming `worker`): each is judged
/// exactly as if it came alone, and the answer is one [`ReportAck`] per
/// report, in order (`Vec<ReportAck>`), once every change they made is
/// durable. A leader too old to read it does not answer; the worker then
/// sends them one by one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reports {
    pub worker: WorkerId,
    pub reports: Vec<Report>,
}

/// Most reports in one [`Reports`].
pub const MAX_REPORTS: usize = 64;

impl Reports {
    /// Whether every report speaks for the batch's worker, within the
    /// count: a batch that does not is refused whole.
    pub fn is_well_formed(&self) -> bool {
        self.reports.len() <= MAX_REPORTS && self.reports.iter().all(|r| r.worker == self.worker)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportEvent {
    /// Intent recorded and the process spawned.
    Started { pid: i32 },
    /// The attempt ended; its outcome is buffered in the sidecar.
    Finished(Outcome),
    /// The attempt was given up before its intent: nothing ran.
    NotStarted { reason: String },
    /// The attempt's process is gone and no exit status survived (its monitor
    /// died with it, or the machine's record of it is unreadable).
    Lost(RecoveryHint),
    /// Output lines of a running `monitor` task matched its pattern (or of
    /// an `agent` task, one of its capture patterns). Repeats are harmless:
    /// the leader keeps how far it has notified.
    Matched(Vec<MatchedLine>),
    /// As `Lost`, said by the worker that held the attempt once its shim
    /// was gone and it had ended what was left of the task's process group
    /// and control group: the process is proven gone (a task that declares
    /// a resume command may be resumed).
    Gone(RecoveryHint),
}

impl ReportEvent {
    /// A short name for logs and spans.
    pub fn name(&self) -> &'static str {
        match self {
            ReportEvent::Started { .. } => "started",
            ReportEvent::Finished(_) => "finished",
            ReportEvent::NotStarted { .. } => "not-started",
            ReportEvent::Lost(_) => "lost",
            ReportEvent::Gone(_) => "gone",
            ReportEvent::Matched(_) => "matched",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportAck {
    /// Recorded (or already recorded): stop retrying.
    Ack,
    /// The answer of coordinators before `StaleAt` existed: the report names
    /// an attempt or epoch the registry no longer holds. It says nothing of
    /// the epoch it was decided under, so it is believed as before (final);
    /// current coordinators send [`ReportAck::StaleAt`].
    Stale,
    NotLeader,
    /// The report names an attempt or epoch the registry no longer holds, as
    /// decided by a leader of `epoch`. Final only when `epoch` is at or above
    /// the highest epoch the machine has seen (see [`ReportAck::settles`]): a
    /// deposed leader's "stale" is a guess from an old view of the registry,
    /// so the report is kept and re-sent. A new variant, so a `Stale` from an
    /// older coordinator still decodes.
    StaleAt {
        epoch: Epoch,
    },
}

impl ReportAck {
    /// Whether a worker may stop re-sending a report and drop what it
    /// buffered for it, given the highest epoch its machine has seen (and
    /// the report carried): an `Ack` (a leader only acknowledges what it made
    /// durable under fencing), a `StaleAt` from a leader at that epoch or
    /// above, or a legacy `Stale`. `NotLeader`, and a `StaleAt` from a lower
    /// epoch, mean "not acknowledged: retry later".
    pub fn settles(&self, highest_seen: Epoch) -> bool {
        match self {
            ReportAck::Ack | ReportAck::Stale => true,
            ReportAck::StaleAt { epoch } => *epoch >= highest_seen,
            ReportAck::NotLeader => false,
        }
    }

    /// Whether this is a "stale" answer (either encoding).
    pub fn is_stale(&self) -> bool {
        matches!(self, ReportAck::Stale | ReportAck::StaleAt { .. })
    }
}

/// Longest kill reason kept on a task.
pub const MAX_KILL_REASON_BYTES: usize = 1024;

// ----------------------------------------------------- coordinator → worker

/// Commands from the leader to one worker ([`crate::subjects::worker_commands`]).
/// A message decoded once and consumed at once, never stored: the size of
/// its largest variant costs nothing, so a grant is not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerCommand {
    Grant(LeaseGrant),
    Kill(KillCommand),
    /// Published (no reply) on the worker id's shared subject: a live
    /// instance `holder` holds this worker id, so instance `instance` — a
    /// second process configured with the same id — must stop. Every other
    /// instance ignores it.
    InstanceTaken {
        instance: Uuid,
        holder: Uuid,
    },
    /// The owner's pause wish for a running attempt: held stopped
    /// (`paused`) or let go on. Idempotent; re-sent while the worker's
    /// heartbeat says otherwise.
    Pause(PauseCommand),
}

/// Grants to one worker made in one scheduling pass, sent together on its
/// command subject (at most [`MAX_GRANTS`]; never a traced grant, which goes
/// alone with its trace context). Each is judged exactly as if it came
/// alone; the answer is `Vec<Option<WorkerReply>>`, one per grant in order
/// (`None`: not answered, as a request that timed out — a copy of the same
/// grant was being recorded). A worker too old to read it refuses it
/// `Malformed`, and the leader sends the grants one by one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grants {
    pub grants: Vec<LeaseGrant>,
}

/// Most grants in one [`Grants`].
pub const MAX_GRANTS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    pub task: TaskId,
    pub attempt: Attempt,
    pub epoch: Epoch,
    pub owner: SessionId,
    pub spec: TaskSpec,
    /// The registry's high-water mark once this grant's lease was durable.
    /// The machine's store keeps the highest it was given, so that a
    /// registry which went back together with the lease (both in one
    /// JetStream that lost acknowledged writes, or restored from one backup)
    /// is still caught: the machine's heartbeats carry the mark. Not part of
    /// the grant's identity (a re-sent grant may carry a later mark).
    #[serde(default)]
    pub mark: Option<RegistryMark>,
    /// Input kept for this attempt while none ran (`tenure send` to a
    /// resumable agent its machine lost): the shim writes it, in order, into
    /// the task's input before the task starts. Empty for other grants.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub input: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseCommand {
    pub task: TaskId,
    pub attempt: Attempt,
    pub epoch: Epoch,
    pub paused: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillCommand {
    pub task: TaskId,
    pub attempt: Attempt,
    pub epoch: Epoch,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WorkerReply {
    /// Grant accepted (recorded by the sidecar), or kill under way.
    Accepted,
    Refused(Refusal),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    #[error("stale epoch {offered}: this machine has seen {held}")]
    StaleEpoch { held: Epoch, offered: Epoch },
    #[error("no free slot")]
    NoSlot,
    #[error("kind {0} is not run here")]
    UnsupportedKind(String),
    #[error("attempt not held here")]
    UnknownAttempt,
    #[error("sidecar unavailable: {0}")]
    SidecarUnavailable(String),
    #[error("malformed command: {0}")]
    Malformed(String),
    /// The machine's store failed while taking the grant (a failed write or
    /// flush may still have landed, or the attempt's record is unreadable):
    /// unlike the other refusals this does not prove the attempt never
    /// started there, so the leader asks the machine's evidence instead of
    /// giving the task back. A new variant: an older leader cannot decode it
    /// and re-sends the grant.
    #[error("the sidecar's store failed: {0}")]
    SidecarStorage(String),
    /// The task has resource limits this worker cannot enforce (their
    /// names: `memory`, `cpu`, `pids`); it never started here. A new
    /// variant: an older leader cannot decode it and re-sends the grant.
    #[error("resource limits not enforced here: {}", .0.join(", "))]
    UnenforcedLimits(Vec<String>),
}

// ----------------------------------------------------------- output reads

/// Read a task's output by byte offset from the sidecar of the machine it ran on
/// ([`crate::subjects::output`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRequest {
    pub session: SessionId,
    pub task: TaskId,
    pub offset: u64,
    /// Most bytes wanted; capped by the sidecar at [`MAX_OUTPUT_CHUNK`].
    pub max: u32,
}

/// Largest chunk returned by one output read.
pub const MAX_OUTPUT_CHUNK: u32 = 512 * 1024;

pub type OutputReply = Result<OutputChunk, ApiError>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputChunk {
    #[serde(with = "bytes_field")]
    pub data: Vec<u8>,
    /// Offset of the byte after `data`.
    pub next_offset: u64,
    /// Size of the output file at read time.
    pub size: u64,
    /// The attempt has ended: no byte will be added past `size`.
    pub finished: bool,
}

// ------------------------------------------------------- input to agent tasks

/// Deliver one message to the stdin of a running `agent` task, through the
/// sidecar of the machine it runs on ([`crate::subjects::input`]). The sidecar
/// checks the owner like an output read, writes the whole message or nothing,
/// and never interleaves two messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputRequest {
    pub session: SessionId,
    pub task: TaskId,
    /// The bytes, delivered as they are (the CLI adds the trailing newline).
    /// 1 to [`MAX_INPUT_BYTES`] bytes.
    #[serde(with = "bytes_field")]
    pub data: Vec<u8>,
}

/// Largest input message (it always fits an empty pipe of the default size,
/// which is what lets the sidecar deliver it whole or not at all).
pub const MAX_INPUT_BYTES: usize = 64 * 1024;

pub type InputReply = Result<InputAck, ApiError>;

/// The message is in the task's input pipe, whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputAck {
    /// The attempt that received it (kept: the attempt its machine lost).
    pub attempt: Attempt,
    pub bytes: u64,
    /// Kept by the coordinator for the task's resumed attempt, not written
    /// into a running task's input.
    #[serde(default)]
    pub kept: bool,
}

/// Serialize byte vectors as MessagePack `bin`, not as arrays of integers
/// (`#[serde(with = "tenure_protocol::messages::bytes_field")]`).
pub mod bytes_field {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
                let mut out = Vec::new();
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(out)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

// ------------------------------------------- coordinator → sidecar (evidence)

/// The leader asks a worker machine's sidecar about an attempt whose worker
/// stopped heartbeating ([`crate::subjects::evidence`]). Answering *revokes* an
/// attempt that never reached its intent, so a worker that is only cut off can
/// no longer start it: the answer stays true after it is given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvidenceRequest {
    pub task: TaskId,
    pub attempt: Attempt,
    /// The asking leader's epoch; a lower one than the machine has seen is refused.
    pub epoch: Epoch,
    /// The store incarnation the registry says the attempt was granted to: a
    /// machine with another one answers [`AttemptEvidence::Replaced`], never
    /// "never started".
    #[serde(default)]
    pub incarnation: Option<Uuid>,
}

pub type EvidenceReply = Result<AttemptEvidence, SidecarRefusal>;

/// What a worker machine knows about one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AttemptEvidence {
    /// No intent was ever recorded (an accepted attempt is revoked by the query):
    /// the attempt did not run and never will on this machine.
    NeverStarted,
    /// The intent is recorded and the attempt's monitor is alive: it runs.
    Running,
    /// The attempt ended; its outcome is recorded (by the sidecar or the monitor).
    Exited(Outcome),
    /// The intent is recorded, the monitor is gone, and no outcome was recorded.
    NoEvidence,
    /// The machine's record of the attempt is unreadable.
    Unreadable(String),
    /// The machine's store is not the one the attempt was granted to (its data
    /// directory was wiped or replaced): what became of the attempt is unknown.
    Replaced { incarnation: Uuid },
    /// As [`AttemptEvidence::NoEvidence`], on a machine that booted since the
    /// intent was recorded: the process died with the machine (power loss,
    /// reboot). A new variant: an older leader cannot decode it and asks again.
    MachineRestarted,
}

// -------------------------------------------- coordinator → sidecar (cleanup)

/// Release a finished task's files on its worker machine
/// ([`crate::subjects::cleanup`]): its output file, attempt directories and
/// recovery records, in that order. Idempotent; refused while any attempt of
/// the task still runs there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupRequest {
    pub task: TaskId,
    /// The job's number within the task (a re-sent job has the same number).
    pub job: u32,
    pub epoch: Epoch,
    /// Sent after `unarchive` cancelled the job: removes nothing and answers
    /// what of the task is still here ([`CleanupDone`] counts what is present).
    /// Requests are served one at a time in the order a leader sent them, and
    /// a deposed leader's are refused by epoch, so by the time this is answered
    /// no copy of the job can still run: no files left means one already did.
    #[serde(default)]
    pub cancel: bool,
}

pub type CleanupReply = Result<CleanupDone, SidecarRefusal>;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupDone {
    pub files: u32,
    pub records: u32,
}

// ------------------------------------------------ worker ↔ sidecar (local)

/// Requests from the worker to its machine's sidecar, over a unix socket.
/// Every mutating request is flushed to disk before the sidecar replies `Ok`.
/// Made one at a time and sent at once, never stored in bulk: the size of its
/// largest variant (a grant) costs nothing, so it is not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SidecarRequest {
    /// Raise the machine's highest epoch seen; refused if lower than held.
    ObserveEpoch(Epoch),
    /// Record an accepted grant (no side effect has happened yet).
    Accept(LeaseGrant),
    /// Record that the attempt is about to start its side effects. `trace` is
    /// the worker's W3C `traceparent` for the attempt, if it is traced.
    Intent {
        task: TaskId,
        attempt: Attempt,
        epoch: Epoch,
        #[serde(default)]
        trace: Option<String>,
    },
    /// Record the spawned process (its group id equals its pid).
    Spawned { task: TaskId, attempt: Attempt, pid: i32 },
    /// Buffer the attempt's outcome until the coordinator acknowledges it.
    Exited { task: TaskId, attempt: Attempt, outcome: Outcome },
    /// The coordinator acknowledged the final report: stop re-reporting it.
    Acknowledged { task: TaskId, attempt: Attempt },
    /// Give an accepted attempt back before its intent (nothing ran).
    Abandon { task: TaskId, attempt: Attempt },
    /// The machine's store incarnation and mark (the worker's heartbeat probe).
    Incarnation,
    /// Every record held, for recovery.
    List,
    /// The next page of records, after `(task, attempt)`.
    ListFrom { task: TaskId, attempt: Attempt },
    /// Several requests that [`SidecarRequest::batches`] allows, at most
    /// [`MAX_SIDECAR_MANY`]: applied in order, committed by one flush, and
    /// answered together by [`SidecarReply::Many`], one reply each, in
    /// order. Each is judged alone, exactly as if sent alone; one refused
    /// changes nothing for the others. A request that may not travel in a
    /// batch is refused (`Malformed`) in its place.
    Many(Vec<SidecarRequest>),
}

/// Most requests in one [`SidecarRequest::Many`] (the sidecar's group
/// commit takes as many per flush).
pub const MAX_SIDECAR_MANY: usize = 64;

impl SidecarRequest {
    /// Whether this request may travel in a [`SidecarRequest::Many`]: the
    /// epoch fence and the records of attempts, whose answers are small.
    /// Listings and the incarnation probe go alone. (A traced intent travels
    /// too: the sidecar continues its trace in a span that lasts until the
    /// batch is durable. An older sidecar refuses it in a batch as
    /// `Malformed`, and the worker then sends it alone.)
    pub fn batches(&self) -> bool {
        match self {
            SidecarRequest::ObserveEpoch(_)
            | SidecarRequest::Intent { .. }
            | SidecarRequest::Accept(_)
            | SidecarRequest::Spawned { .. }
            | SidecarRequest::Exited { .. }
            | SidecarRequest::Acknowledged { .. }
            | SidecarRequest::Abandon { .. } => true,
            SidecarRequest::Incarnation
            | SidecarRequest::List
            | SidecarRequest::ListFrom { .. }
            | SidecarRequest::Many(_) => false,
        }
    }
}

/// Most encoded bytes of records in one `Records` page: a machine holds any
/// number of records (every acknowledged attempt until cleanup), and no reply
/// may exceed the message limit.
pub const MAX_LIST_PAGE_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SidecarReply {
    Ok,
    /// The identity of the machine's store, created with it (the answer
    /// of sidecars before [`SidecarReply::Identity`]).
    Incarnation(Uuid),
    /// The answer to [`SidecarRequest::Incarnation`]: the store's identity,
    /// and the highest registry mark it was given with a grant.
    Identity {
        incarnation: Uuid,
        mark: Option<RegistryMark>,
    },
    /// One page of the machine's records, in (task, attempt) order, within
    /// [`MAX_LIST_PAGE_BYTES`]; `next` names the last record of the page when
    /// more follow (ask `ListFrom` it). `corrupt` comes with the first page.
    Records {
        epoch: Epoch,
        records: Vec<AttemptRecord>,
        corrupt: Vec<CorruptAttempt>,
        #[serde(default)]
        next: Option<(TaskId, Attempt)>,
    },
    Refused(SidecarRefusal),
    /// The answers to a [`SidecarRequest::Many`], one per request, in order.
    /// A batch answered by a refusal instead was refused as a whole: the
    /// store failed (a `Storage` refusal, which then answers every request
    /// in it), or the sidecar could not read it (`Malformed`: a sidecar
    /// older than `Many`; the worker sends the requests one by one).
    Many(Vec<SidecarReply>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum SidecarRefusal {
    #[error("stale epoch {offered}: this machine has seen {held}")]
    StaleEpoch { held: Epoch, offered: Epoch },
    #[error("no record of {task} attempt {attempt}")]
    UnknownAttempt { task: TaskId, attempt: Attempt },
    #[error("{task} attempt {attempt} is {phase:?}; cannot {action}")]
    WrongPhase { task: TaskId, attempt: Attempt, phase: Phase, action: String },
    #[error("storage failure: {0}")]
    Storage(String),
    /// The leader revoked this attempt (its worker was lost before the intent):
    /// it must never start on this machine.
    #[error("{task} attempt {attempt} was revoked by the leader; it must not start here")]
    Revoked { task: TaskId, attempt: Attempt },
    /// A cleanup job met an attempt of the task whose monitor still runs.
    #[error("{task} still runs on this machine; its files are kept")]
    StillRunning { task: TaskId },
    #[error("malformed request: {0}")]
    Malformed(String),
}

/// How far an attempt got on its worker machine. Ordered: phases only advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Granted and accepted; no side effect yet.
    Accepted,
    /// Intent durable: the process may have started.
    Intent,
    /// The process group exists (pid recorded).
    Spawned,
    /// The outcome is buffered, not yet acknowledged by the coordinator.
    Exited,
    /// The coordinator acknowledged the outcome. Kept (for output reads and
    /// owner checks) until garbage collection removes it.
    Acknowledged,
}

/// A stored attempt record that could not be read (checksum or decoding failed).
/// The task and attempt come from the record's key when that is readable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorruptAttempt {
    pub key: String,
    pub attempt: Option<(TaskId, Attempt)>,
    pub reason: String,
}

/// The sidecar's durable record of one attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub grant: LeaseGrant,
    pub phase: Phase,
    pub pid: Option<i32>,
    pub outcome: Option<Outcome>,
    /// The machine's boot (the kernel's boot id) when the intent was
    /// recorded: an attempt whose process is gone without an exit status on
    /// a machine that booted since died with the machine (a power loss, a
    /// reboot), which its hint then says.
    #[serde(default)]
    pub boot: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Run` names its owner where the leader replaces it with the one
    /// the transport vouches for (the submit's session), and a coordinator
    /// that predates it cannot read it as anything else (its clients then
    /// submit and wait in two requests).
    #[test]
    fn a_run_acts_for_the_owner_the_transport_vouches_for() {
        let spec = crate::TaskSpec::shell("t", "true");
        let submit = SubmitRequest { session: "claimed".parse().unwrap(), idempotency_key: Uuid::new_v4(), spec };
        let mut run = ApiRequest::Run { submit, timeout_ms: 10, until: WaitFor::End };
        *run.session_mut().expect("a run acts for an owner") = "vouched".parse().unwrap();
        let ApiRequest::Run { submit, .. } = &run else { unreachable!() };
        assert_eq!(submit.session.as_str(), "vouched");
        #[derive(Deserialize, Debug)]
        #[allow(dead_code)]
        enum Old {
            Submit(SubmitRequest),
            Wait { session: SessionId, task: crate::TaskId, timeout_ms: u64 },
        }
        assert!(crate::decode::<Old>(&crate::encode(&run).unwrap()).is_err());
    }

    /// An older client's `ListPage` (no `before`) decodes as oldest first,
    /// and a newer client's without `before` is the same bytes an older
    /// coordinator reads.
    #[test]
    fn a_list_page_without_before_is_the_old_request() {
        #[derive(Serialize)]
        enum Old {
            ListPage { session: SessionId, all: bool, after: Option<u64> },
        }
        let session: SessionId = "alice".parse().unwrap();
        let old = crate::encode(&Old::ListPage { session: session.clone(), all: true, after: Some(4) }).unwrap();
        let new = ApiRequest::ListPage { session, all: true, after: Some(4), before: None };
        assert_eq!(crate::decode::<ApiRequest>(&old).unwrap(), new);
        assert_eq!(crate::encode(&new).unwrap(), old);
        let newest =
            ApiRequest::ListPage { session: "alice".parse().unwrap(), all: true, after: None, before: Some(9) };
        assert_eq!(crate::decode::<ApiRequest>(&crate::encode(&newest).unwrap()).unwrap(), newest);
    }

    /// A wait for the end is the bytes an older coordinator reads; a start
    /// wait round-trips, and an older coordinator reads it as a wait.
    #[test]
    fn a_wait_for_the_end_is_the_old_request_and_a_start_wait_reads_as_a_wait_there() {
        #[derive(Serialize, Deserialize, Debug, PartialEq)]
        enum Old {
            Wait { session: SessionId, task: crate::TaskId, timeout_ms: u64 },
        }
        let (session, task): (SessionId, crate::TaskId) = ("alice".parse().unwrap(), "shell-3".parse().unwrap());
        let old = Old::Wait { session: session.clone(), task: task.clone(), timeout_ms: 7 };
        let end = ApiRequest::Wait { session: session.clone(), task: task.clone(), timeout_ms: 7, until: WaitFor::End };
        assert_eq!(crate::encode(&end).unwrap(), crate::encode(&old).unwrap());
        assert_eq!(crate::decode::<ApiRequest>(&crate::encode(&old).unwrap()).unwrap(), end);
        let start = ApiRequest::Wait { session, task, timeout_ms: 7, until: WaitFor::Start };
        assert_eq!(crate::decode::<ApiRequest>(&crate::encode(&start).unwrap()).unwrap(), start);
        assert_eq!(crate::decode::<Old>(&crate::encode(&start).unwrap()).unwrap(), old);
    }

    #[test]
    fn a_start_is_reached_by_every_status_past_the_queue_and_an_end_only_by_the_terminal_ones() {
        for status in Status::ALL {
            let left_the_queue = !matches!(status, Status::Queued | Status::Leased | Status::Blocked);
            assert_eq!(WaitFor::Start.reached(status), left_the_queue, "{status}");
            assert_eq!(WaitFor::End.reached(status), status.is_terminal(), "{status}");
        }
    }

    #[test]
    fn a_stale_answer_settles_a_report_only_from_an_epoch_at_or_above_the_highest_seen() {
        let seen = Epoch(5);
        assert!(ReportAck::Ack.settles(seen));
        assert!(ReportAck::StaleAt { epoch: Epoch(5) }.settles(seen));
        assert!(ReportAck::StaleAt { epoch: Epoch(6) }.settles(seen));
        // A deposed (paused, partitioned) leader's guess: retry later.
        assert!(!ReportAck::StaleAt { epoch: Epoch(4) }.settles(seen));
        assert!(!ReportAck::NotLeader.settles(seen));
        // An older coordinator's epoch-less answer keeps its old meaning.
        assert!(ReportAck::Stale.settles(seen));
    }

    #[test]
    fn an_epoch_less_stale_from_an_older_coordinator_still_decodes() {
        let old = crate::encode(&ReportAck::Stale).unwrap();
        assert_eq!(crate::decode::<ReportAck>(&old).unwrap(), ReportAck::Stale);
        let new = crate::encode(&ReportAck::StaleAt { epoch: Epoch(7) }).unwrap();
        assert_eq!(crate::decode::<ReportAck>(&new).unwrap(), ReportAck::StaleAt { epoch: Epoch(7) });
    }

    /// One report and a batch of reports share a subject: neither reads as
    /// the other, and a batch that speaks for another worker or holds too
    /// many is not well formed.
    #[test]
    fn a_report_and_a_batch_of_reports_never_read_as_each_other() {
        let report = |worker: &str| Report {
            worker: worker.parse().unwrap(),
            task: "shell-1".parse().unwrap(),
            attempt: Attempt(1),
            epoch: Epoch(2),
            event: ReportEvent::Started { pid: 7 },
        };
        let one = crate::encode(&report("w1")).unwrap();
        assert!(crate::decode::<Reports>(&one).is_err());
        let batch = Reports { worker: "w1".parse().unwrap(), reports: vec![report("w1"), report("w1")] };
        let bytes = crate::encode(&batch).unwrap();
        assert!(crate::decode::<Report>(&bytes).is_err());
        assert_eq!(crate::decode::<Reports>(&bytes).unwrap(), batch);
        assert!(batch.is_well_formed());
        let mut other = batch.clone();
        other.reports.push(report("w2"));
        assert!(!other.is_well_formed());
        let many = Reports { worker: "w1".parse().unwrap(), reports: vec![report("w1"); MAX_REPORTS + 1] };
        assert!(!many.is_well_formed());
    }
}
