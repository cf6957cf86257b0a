//! The durable task record kept in the registry, and its client projection.
//!
//! A [`TaskRecord`] is the whole truth about one task; the registry stores its
//! latest version under the task's subject, or — for the first record of
//! tasks created together, the first grant of tasks granted together, and
//! the end of tasks that end together — in one batch message ([`Batched`]).
//! [`RegistryEntry`] is what a registry message holds: a task record, a
//! batch, a tombstone, or a leadership claim.

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::{CleanupState, Resumability, TaskSnapshot};
use tenure_protocol::resume::{ResumeState, ResumeView};
use tenure_protocol::retry::AttemptEnd;
use tenure_protocol::{Epoch, Kind, Lifecycle, SessionId, Status, TaskId, TaskSpec};
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
    /// Boxed: rarely set, and every kept task carries the field.
    #[serde(default)]
    pub parent: Option<Box<StepOf>>,
    /// For a `monitor` task: the output offset up to which matched lines were
    /// notified (a repeated report below it notifies nothing), and how many.
    #[serde(default)]
    pub matched_through: u64,
    #[serde(default)]
    pub matches: u64,
    /// The W3C `traceparent` of the submit, when traced: grants continue that
    /// trace, on this leader or the next.
    #[serde(default)]
    pub trace: Option<Box<str>>,
    /// The store incarnation of the machine the current attempt was granted
    /// to: evidence from another one (a wiped or replaced machine) is never
    /// taken for "never started". Boxed, and dropped once the task ended: only
    /// tasks on a worker need it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<Box<Uuid>>,
    /// Registry time (milliseconds) when this version was written: elapsed
    /// leader time accumulated from monotonic clocks only, never a wall
    /// clock (see `Core` and docs/durability.md). 0 in records written
    /// before it existed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clock_ms: u64,
    /// Registry time when the task ended: what idempotency-key memory,
    /// garbage collection and notice republication measure age from. 0 when
    /// not recorded (not ended, or ended before it existed: a new leader then
    /// counts the age from its takeover).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ended_clock_ms: u64,
    /// The attempt history and the delayed start of a task with a retry
    /// policy or a `--not-before` (see `core/retry.rs`). Boxed, and left out
    /// of the encoding when absent: other tasks keep their bytes, and records
    /// written before it existed load as tasks without either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<Box<AttemptLog>>,
}

/// What a task with a retry policy, a delayed start or a resume command
/// keeps beyond its lifecycle: its ended attempts, the time before which it
/// is not granted, and its resume state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptLog {
    /// Each ended attempt, oldest first: the retried ones and the final one
    /// (at most the policy's retries + 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<AttemptEnd>,
    /// Registry time (see `clock_ms`) before which the queued task is not
    /// granted; 0 for none. In registry time, so a new leader continues the
    /// wait where the last one left it (never shorter: registry time only
    /// lags), and no two leaders' wall clocks are compared.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ready_clock_ms: u64,
    /// The same time on the wall clock of the leader that decided it (epoch
    /// ms): what `get` shows. Never decides anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_wall_ms: Option<u64>,
    /// When the current attempt was seen running (wall clock, for humans).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// A workflow with a timeout: the registry time (see `clock_ms`) by
    /// which it must have ended, fixed when its steps began; 0 for none. In
    /// registry time, so a new leader holds the same deadline.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deadline_clock_ms: u64,
    /// What an `agent` task that declares a resume command has captured,
    /// how often it was resumed, the input kept for its next attempt and
    /// where it resumes (see `core/resume.rs`). Kept here, not in a field
    /// of the record: every record pays for its fields, and few tasks
    /// declare one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<ResumeState>,
}

impl AttemptLog {
    /// How many attempts were retried so far.
    pub fn retried(&self) -> u32 {
        self.history.iter().filter(|a| a.retried).count() as u32
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
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
    /// The resume state of a task that declares a resume command (none
    /// before it captured, was resumed or kept anything).
    pub fn resume(&self) -> Option<&ResumeState> {
        self.attempts.as_ref().and_then(|a| a.resume.as_ref())
    }

    /// The resume state, made when absent.
    pub fn resume_mut(&mut self) -> &mut ResumeState {
        self.attempts.get_or_insert_with(Box::default).resume.get_or_insert_with(ResumeState::default)
    }

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
            incarnation: None,
            clock_ms: 0,
            ended_clock_ms: 0,
            attempts: None,
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
            detail: outcome.and_then(|o| o.detail.as_deref().map(Into::into)),
            exit_code: outcome.and_then(|o| o.exit_code),
            output_dropped: outcome.map(|o| o.output_dropped).unwrap_or(0),
            attempt: self.life.attempt,
            epoch: self.life.epoch,
            worker: self.life.worker.clone(),
            idempotent: self.life.idempotent,
            kill_requested: self.life.kill_requested,
            kill_reason: self.life.kill_reason.as_deref().map(Into::into),
            hint: self.life.hint.as_deref().cloned(),
            created_at_ms: self.created_at_ms,
            started_at_ms: self.started_at_ms,
            attempt_started_at_ms: self.attempts.as_ref().and_then(|a| a.started_at_ms),
            finished_at_ms: self.finished_at_ms,
            reported: self.reported,
            board: self.life.board,
            cleaned: self.cleanup.is_some_and(|c| c.done),
            cleanup: self.cleanup.map(|c| c.state()),
            parent: self.parent.as_ref().map(|p| p.workflow.clone()),
            steps: Vec::new(),
            matches: self.matches,
            final_output: self.spec.final_output,
            attempts: self.attempts.as_ref().map(|a| a.history.clone()).unwrap_or_default(),
            not_before_ms: self
                .attempts
                .as_ref()
                .filter(|a| self.life.status == tenure_protocol::Status::Queued && a.ready_clock_ms > 0)
                .and_then(|a| a.ready_wall_ms),
            retry: self.spec.retry.as_deref().cloned(),
            priority: self.spec.priority,
            placement: self.spec.placement.as_deref().cloned(),
            resume: self.resumability(),
            resources: self.spec.resources.as_deref().cloned(),
            agent_resume: self.spec.resume.as_deref().map(|s| ResumeView::of(s, self.resume())),
        }
    }

    /// Whether the task can go on as it is, and how to go on: for a paused,
    /// finished or `unknown` task (none for the others: they go on by
    /// themselves, or their hint says what they wait for).
    fn resumability(&self) -> Option<Resumability> {
        let id = &self.id;
        let again = || {
            let command = match self.spec.steps.first() {
                Some(_) => self
                    .spec
                    .steps
                    .iter()
                    .map(|s| format!("--step {}", quoted(&s.command)))
                    .collect::<Vec<_>>()
                    .join(" "),
                None => format!("-- {}", quoted(&self.spec.command)),
            };
            let kind = match self.spec.kind == Kind::shell() || !self.spec.steps.is_empty() {
                true => String::new(),
                false => format!("--kind {} ", self.spec.kind),
            };
            let idempotent = if self.spec.idempotent { "--idempotent " } else { "" };
            format!("tenure submit {kind}{idempotent}{command}")
        };
        let (resumable, how) = match self.life.status {
            Status::Paused => (true, format!("paused: `tenure resume {id}` lets it go on where it stopped")),
            Status::Completed => (false, format!("it completed; to run it again: `{}`", again())),
            Status::Failed | Status::Killed => {
                let retried = self.attempts.as_ref().map_or(0, |a| a.history.iter().filter(|e| e.retried).count());
                let tries = match retried {
                    0 => String::new(),
                    n => format!(" after {} attempts", n + 1),
                };
                (false, format!("its process ended{tries} and nothing of it runs; to run it again: `{}`", again()))
            }
            Status::Unknown if self.spec.resume.is_some() => (
                true,
                format!(
                    "it declares a resume command: it is resumed by itself once its machine proves its process gone \
                     (the machine restarted, or its worker saw the process end); input sent meanwhile is kept for \
                     the resumed attempt. To give up on it: `tenure kill {id}`"
                ),
            ),
            Status::Unknown => (
                false,
                format!(
                    "its attempt may have run (see the hint) and is not run again by itself; once you know it did                      not finish, run it again: `{}`, and settle this one with `tenure kill {id}`",
                    again()
                ),
            ),
            _ => return None,
        };
        Some(Resumability { resumable, how })
    }
}

/// Longest command quoted in a snapshot's advice (bytes); a longer one is cut.
const MAX_QUOTED_COMMAND: usize = 200;

/// `command` as one single-quoted shell word, its first line cut to
/// [`MAX_QUOTED_COMMAND`] (`…` marks a cut: the full command is in the
/// task's spec).
fn quoted(command: &str) -> String {
    let line = command.lines().next().unwrap_or("");
    let mut cut = line.len().min(MAX_QUOTED_COMMAND);
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    let more = if cut < command.len() { "…" } else { "" };
    format!("'{}'{more}", line[..cut].replace('\'', "'\\''"))
}

/// A leadership claim: the coordinator `by` leads from `epoch` on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochClaim {
    pub epoch: Epoch,
    pub by: String,
    pub at_ms: u64,
    /// The claim was made on a registry behind its high-water mark, which an
    /// operator accepted (`--accept-registry-rollback`): what the mark said
    /// and what was found. Kept with the claim as the durable record of the
    /// acceptance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_rollback: Option<crate::mark::Behind>,
    /// Every acceptance so far, merged, carried on by each later claim: a
    /// machine's store may still hold a mark from before an accepted
    /// rollback, which is then no news (see `mark::witnessed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_floor: Option<tenure_protocol::messages::RegistryMark>,
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
    /// The first records of tasks created by one input (a batch submit), the
    /// first grants of tasks granted by one input, or the ends of tasks that
    /// ended in one input, in one message on its own subject
    /// ([`tenure_protocol::subjects::registry_batch`],
    /// [`tenure_protocol::subjects::registry_grant_batch`],
    /// [`tenure_protocol::subjects::registry_end_batch`]). Every other
    /// record of each task goes on the task's subject, so the batch is
    /// superseded task by task (see `registry.rs`).
    Batch(Vec<Batched>),
    /// A batch every task of which has a later record: the batch's subject
    /// is compacted to this, so the batch's bytes are freed.
    Retired {
        at_ms: u64,
    },
}

/// [`RegistryEntry::Task`] borrowed: it encodes to the same bytes (same
/// variant, same name), so an append encodes a record without cloning it.
#[derive(Serialize)]
pub(crate) enum TaskEntry<'a> {
    Task(&'a TaskRecord),
}

/// One task's record inside a [`RegistryEntry::Batch`]: its id in clear (so
/// an unreadable record still names its task) and the record encoded as a
/// [`RegistryEntry::Task`] on its own, exactly as it would be on its subject.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batched {
    pub id: TaskId,
    #[serde(with = "tenure_protocol::messages::bytes_field")]
    pub entry: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::{Attempt, Ending, HintTag, Status, TaskSpec};

    #[test]
    fn a_command_is_quoted_as_one_shell_word_and_cut_on_its_first_line() {
        assert_eq!(quoted("echo hi"), "'echo hi'");
        assert_eq!(quoted("echo 'a b'"), r"'echo '\''a b'\'''");
        assert_eq!(quoted("make\nmake test"), "'make'…");
        let long = "é".repeat(MAX_QUOTED_COMMAND);
        let q = quoted(&long);
        assert!(q.len() <= MAX_QUOTED_COMMAND + 8 && q.ends_with("'…"), "{q}");
    }

    /// Every status says whether the task can go on and how, or says
    /// nothing (it goes on by itself, or its hint says what it waits for).
    #[test]
    fn ended_unknown_and_paused_tasks_say_whether_and_how_they_go_on() {
        let id: TaskId = "agent-4".parse().unwrap();
        let spec = TaskSpec { kind: Kind::agent(), idempotent: true, ..TaskSpec::shell("l", "claude -p 'fix it'") };
        let mut r = TaskRecord::new(id, "alice".parse().unwrap(), Uuid::nil(), spec, 0);
        for status in Status::ALL.into_iter().filter(|s| s.is_stored()) {
            r.life.status = status;
            let advice = r.resumability();
            match status {
                Status::Paused => assert_eq!(
                    advice.map(|a| (a.resumable, a.how.contains("tenure resume agent-4"))),
                    Some((true, true))
                ),
                Status::Completed | Status::Failed | Status::Killed | Status::Unknown => {
                    let a = advice.unwrap_or_else(|| panic!("{status}: no advice"));
                    assert!(!a.resumable, "{status}");
                    let again = r"`tenure submit --kind agent --idempotent -- 'claude -p '\''fix it'\'''`";
                    assert!(a.how.contains(again), "{status}: {}", a.how);
                }
                s => assert_eq!(advice, None, "{s}"),
            }
        }
    }

    /// A registry record as written before kinds, sessions and worker ids were
    /// interned and the hint, step and trace fields boxed: an unknown step
    /// with every rarely-set field present (hex of the whole registry message).
    const OLD_RECORD: &[&str] = &[
        "0181a45461736b8ea26964a77368656c6c2d38a56f776e6572aa616c69636540686f7374af6964656d706f74656e6379",
        "5f6b6579c41000000000000000000000000000001234a47370656389a46b696e64a57368656c6ca56c6162656cb47374",
        "65702031206f6620323a206563686f206869a7636f6d6d616e64a76563686f206869a3637764a42f746d70a3656e7681",
        "a141a131aa6964656d706f74656e74c2a77061747465726ec0a5737465707390ac66696e616c5f6f7574707574c2a46c",
        "69666589a6737461747573a7756e6b6e6f776ea7617474656d707402a565706f636803a6776f726b6572a27731aa6964",
        "656d706f74656e74c2ae6b696c6c5f726571756573746564c2a468696e7482a3746167b2776f726b65722d756e726561",
        "636861626c65a76d657373616765a461776179a76f7574636f6d6585a6656e64696e67a66661696c6564a9657869745f",
        "636f646503a664657461696cac6578697420636f64653a2033ae6f75747075745f64726f7070656400a66f7574707574",
        "c0a5626f617264a6616374697665ad637265617465645f61745f6d73cf0000018bcfe56800ad737461727465645f6174",
        "5f6d73cf0000018bcfe56864ae66696e69736865645f61745f6d73c0a87265706f72746564c2a7636c65616e757084a3",
        "6a6f6201a4646f6e65c2a963616e63656c6c6564c3b063616e63656c5f636f6e6669726d6564c2a6706172656e7482a8",
        "776f726b666c6f77aa776f726b666c6f772d37a5696e64657800af6d6174636865645f7468726f75676800a76d617463",
        "68657300a57472616365d93730302d30616637363531393136636434336464383434386562323131633830333139632d",
        "623761643662373136393230333333312d3031",
    ];

    /// A task without a retry policy, a delayed start or a priority is
    /// stored without any of their fields (the bytes of records written
    /// before them); one with them round-trips whole.
    #[test]
    fn retry_fields_are_left_out_when_absent_and_round_trip_when_present() {
        use tenure_protocol::retry::{AttemptEnd, NotBefore, RetryCause, RetryPolicy};
        let plain = TaskRecord::new(
            "shell-1".parse().unwrap(),
            "s".parse().unwrap(),
            Uuid::nil(),
            TaskSpec::shell("l", "x"),
            1,
        );
        let bytes = tenure_protocol::encode(&RegistryEntry::Task(Box::new(plain))).unwrap();
        for field in [&b"attempts"[..], b"retry", b"not_before", b"priority"] {
            assert!(!bytes.windows(field.len()).any(|w| w == field), "{:?} stored", String::from_utf8_lossy(field));
        }
        let spec = TaskSpec {
            idempotent: true,
            retry: Some(Box::new(RetryPolicy::with_defaults(2, None, None, Some(vec![RetryCause::Exit])))),
            not_before: Some(Box::new(NotBefore::At { unix_ms: 9 })),
            priority: -4,
            ..TaskSpec::shell("l", "x")
        };
        let mut r = TaskRecord::new("shell-2".parse().unwrap(), "s".parse().unwrap(), Uuid::nil(), spec, 1);
        r.attempts = Some(Box::new(AttemptLog {
            deadline_clock_ms: 0,
            resume: None,
            history: vec![AttemptEnd {
                resumed: None,
                attempt: Attempt(1),
                worker: Some("w1".parse().unwrap()),
                ending: Some(Ending::Failed),
                cause: Some(RetryCause::Exit),
                exit_code: Some(3),
                detail: Some("exit code: 3".into()),
                started_at_ms: Some(5),
                ended_at_ms: 6,
                retried: true,
            }],
            ready_clock_ms: 700,
            ready_wall_ms: Some(800),
            started_at_ms: None,
        }));
        let entry = RegistryEntry::Task(Box::new(r));
        let back: RegistryEntry = tenure_protocol::decode(&tenure_protocol::encode(&entry).unwrap()).unwrap();
        assert_eq!(back, entry);
    }

    #[test]
    fn a_borrowed_task_entry_encodes_as_the_owned_one() {
        let r = TaskRecord::new(
            TaskId::new(Kind::shell(), 9).unwrap(),
            "alice@host".parse().unwrap(),
            Uuid::from_u128(7),
            TaskSpec::shell("l", "echo hi"),
            5,
        );
        let borrowed = tenure_protocol::encode(&TaskEntry::Task(&r)).unwrap();
        assert_eq!(borrowed, tenure_protocol::encode(&RegistryEntry::Task(Box::new(r))).unwrap());
    }

    #[test]
    fn records_written_before_the_compact_layout_still_decode_to_the_same_bytes() {
        let hex: String = OLD_RECORD.concat();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let Ok(RegistryEntry::Task(r)) = tenure_protocol::decode::<RegistryEntry>(&bytes) else {
            panic!("the old record does not decode")
        };
        assert_eq!(r.id.to_string(), "shell-8");
        assert_eq!(r.owner.as_str(), "alice@host");
        assert_eq!(r.idempotency_key, Uuid::from_u128(0x1234));
        assert_eq!((r.spec.command.as_str(), r.spec.cwd.as_deref()), ("echo hi", Some("/tmp")));
        assert_eq!(r.spec.env.get("A").map(String::as_str), Some("1"));
        assert_eq!((r.life.status, r.life.attempt, r.life.epoch), (Status::Unknown, Attempt(2), Epoch(3)));
        assert_eq!(r.life.worker.as_ref().map(|w| w.as_str()), Some("w1"));
        assert_eq!(
            r.life.hint.as_ref().map(|h| (h.tag, h.message.as_str())),
            Some((HintTag::WorkerUnreachable, "away"))
        );
        let outcome = r.life.outcome.as_ref().unwrap();
        assert_eq!(
            (outcome.ending, outcome.exit_code, outcome.detail.as_deref()),
            (Ending::Failed, Some(3), Some("exit code: 3"))
        );
        assert_eq!(r.parent.as_deref(), Some(&StepOf { workflow: "workflow-7".parse().unwrap(), index: 0 }));
        assert_eq!(r.trace.as_deref(), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
        assert_eq!(r.cleanup.map(|c| c.state()), Some(CleanupState::Cancelling));
        assert_eq!(r.started_at_ms, Some(1_700_000_000_100));
        // Nothing was lost or reshaped: the record encodes to the same bytes.
        assert_eq!(tenure_protocol::encode(&RegistryEntry::Task(r)).unwrap(), bytes);
    }
}
