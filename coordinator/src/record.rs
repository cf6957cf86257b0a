//! The durable task record kept in the registry, and its client projection.
//!
//! A [`TaskRecord`] is the whole truth about one task; the registry stores its
//! latest version under the task's subject. [`RegistryEntry`] is what a registry
//! message holds: a task record or a leadership claim.

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::{CleanupState, TaskSnapshot};
use tenure_protocol::{Epoch, Lifecycle, SessionId, TaskId, TaskSpec};
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: TaskId,
    pub owner: SessionId,
    pub idempotency_key: Uuid,
    pub spec: TaskSpec,
    pub life: Lifecycle,
    pub created_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    pub reported: bool,
    /// The durable cleanup job of an archive or delete, if any.
    #[serde(default)]
    pub cleanup: Option<CleanupJob>,
    /// For a workflow step: which workflow, which step.
    #[serde(default)]
    pub parent: Option<StepOf>,
    /// For a monitor: the output offset up to which matched lines were
    /// notified (a repeated report below it notifies nothing), and how many.
    #[serde(default)]
    pub matched_through: u64,
    #[serde(default)]
    pub matches: u64,
    /// The W3C `traceparent` of the submit, when traced: grants continue that
    /// trace, on this leader or the next.
    #[serde(default)]
    pub trace: Option<String>,
}

/// The place of a child task in its workflow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepOf {
    pub workflow: TaskId,
    /// 0-based index into the workflow's steps.
    pub index: u32,
}

/// Releasing a finished task's files on its worker machine. Persisted (with the
/// board move that asks for it) before anything is sent; re-sent with backoff
/// until done; cancelled by `unarchive` while not done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanupJob {
    /// Numbered within the task; a re-sent job keeps its number.
    pub job: u32,
    pub done: bool,
    /// Cancelled by `unarchive`. A copy already on its way may still land:
    /// then it is also `done`, and the files are gone.
    #[serde(default)]
    pub cancelled: bool,
    /// The machine answered the cancellation with the files still there: no
    /// copy of the job can remove them any more.
    #[serde(default)]
    pub cancel_confirmed: bool,
}

impl CleanupJob {
    pub fn state(&self) -> CleanupState {
        match (self.done, self.cancelled, self.cancel_confirmed) {
            (true, _, _) => CleanupState::Done,
            (false, false, _) => CleanupState::Pending,
            (false, true, false) => CleanupState::Cancelling,
            (false, true, true) => CleanupState::Cancelled,
        }
    }

    /// Something must still be sent to the machine: the job itself, or the
    /// cancellation that settles whether a copy of it ran.
    pub fn unsettled(&self) -> bool {
        !self.done && (!self.cancelled || !self.cancel_confirmed)
    }
}

impl TaskRecord {
    /// A newly submitted (or created) task: queued, nothing run, nothing reported.
    pub fn new(id: TaskId, owner: SessionId, idempotency_key: Uuid, spec: TaskSpec, created_at_ms: u64) -> TaskRecord {
        TaskRecord {
            id,
            owner,
            idempotency_key,
            life: Lifecycle::queued(spec.idempotent),
            spec,
            created_at_ms,
            started_at_ms: None,
            finished_at_ms: None,
            reported: false,
            cleanup: None,
            parent: None,
            matched_through: 0,
            matches: 0,
            trace: None,
        }
    }

    pub fn snapshot(&self) -> TaskSnapshot {
        let outcome = self.life.outcome.as_ref();
        TaskSnapshot {
            id: self.id.clone(),
            kind: self.spec.kind.clone(),
            label: self.spec.label.clone(),
            owner: self.owner.clone(),
            status: self.life.status,
            detail: outcome.and_then(|o| o.detail.clone()),
            exit_code: outcome.and_then(|o| o.exit_code),
            output_dropped: outcome.map(|o| o.output_dropped).unwrap_or(0),
            attempt: self.life.attempt,
            epoch: self.life.epoch,
            worker: self.life.worker.clone(),
            idempotent: self.life.idempotent,
            kill_requested: self.life.kill_requested,
            hint: self.life.hint.clone(),
            created_at_ms: self.created_at_ms,
            started_at_ms: self.started_at_ms,
            finished_at_ms: self.finished_at_ms,
            reported: self.reported,
            board: self.life.board,
            cleaned: self.cleanup.is_some_and(|c| c.done),
            cleanup: self.cleanup.map(|c| c.state()),
            parent: self.parent.as_ref().map(|p| p.workflow.clone()),
            steps: Vec::new(),
            matches: self.matches,
            final_output: self.spec.final_output,
        }
    }
}

/// A leadership claim: the coordinator `by` leads from `epoch` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochClaim {
    pub epoch: Epoch,
    pub by: String,
    pub at_ms: u64,
}

/// The payload of one registry message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegistryEntry {
    Task(Box<TaskRecord>),
    /// A task garbage-collected after its retention: its record is compacted to
    /// this, so its number is never reused and nothing else of it remains.
    Forgotten {
        id: TaskId,
        at_ms: u64,
    },
    Epoch(EpochClaim),
}
