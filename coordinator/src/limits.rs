//! What one submit may cost the cluster, decided before anything is stored:
//! the size of the task's record, its identity's quotas, and room in the
//! registry for the tasks already running to finish.
//!
//! **Record size.** A record is stored as one registry message and grows as
//! its task runs (a worker, an outcome with a final output of up to 64 KiB, a
//! detail, a recovery hint, a cleanup job). A submit is refused
//! ([`ApiError::RecordTooLarge`]) unless its record *at its largest* fits in
//! one message, so no later append of that task can be too large to store.
//! What a worker or a sidecar reports is cut to the limits that largest
//! record assumes ([`Outcome::bounded`], [`RecoveryHint::bounded`]).
//!
//! **Quotas.** Per identity ([`SessionId::identity`]): live (not terminal)
//! tasks, kept tasks (every record in the registry, terminal ones until they
//! are garbage-collected), and output bytes kept in the registry — the final
//! output of each kept final-output task: [`MAX_FINAL_OUTPUT_BYTES`]
//! reserved while it is live, its recorded size once it ended. A workflow
//! needs room for itself and one running step (live) and for itself and
//! every step (kept); its steps are counted as they are created. A refused
//! submit gets [`ApiError::Quota`] and stores nothing. The counts are kept
//! per identity and updated at each change, never by scanning the registry.
//!
//! **A full registry.** The registry stream has a byte limit and refuses new
//! messages past it, which would stop running tasks from recording their
//! ends. So submits are refused ([`ApiError::RegistryFull`]) once the bytes
//! used (sampled by the driver) plus what every live task may still add,
//! plus the new one, come within a margin of the limit: the tasks already
//! admitted can always finish. A live task may still add one message on its
//! own subject (which replaces the one before it there) or its end's entry in
//! a message that other tasks may keep alive (durability note a20), up to its
//! largest record, and, until it is granted, its first grant's entry in such a
//! message (note a13), up to [`grant_bound`]. What a grant or an end releases
//! of that reserve stays counted until the next sample, which sees the bytes
//! it appended. A task whose end is in such a message may still add its
//! subject's next message, up to that end's entry and [`POST_END_GROWTH`]:
//! the registry counts those ends and the driver adds them to the sample.
//!
//! It must never refuse or change anything but a new submit.

use std::collections::HashMap;

use tenure_protocol::messages::ApiError;
use tenure_protocol::{
    Attempt, Board, Ending, Epoch, Event, HintTag, Kind, Outcome, RecoveryHint, SessionId, Status, TaskId, TaskSpec,
    WorkerId, MAX_DETAIL_BYTES, MAX_FINAL_OUTPUT_BYTES, MAX_HINT_BYTES, MAX_KEPT_OUTPUT_BYTES,
};
use uuid::Uuid;

use crate::record::{AttemptLog, CleanupJob, RegistryEntry, StepOf, TaskRecord};
use std::collections::BTreeMap;
use tenure_protocol::resume::{
    ResumeState, MAX_CAPTURES, MAX_CAPTURE_NAME_BYTES, MAX_CAPTURE_VALUE_BYTES, MAX_PENDING_INPUT,
    MAX_PENDING_INPUT_BYTES, MAX_RESUMES,
};
use tenure_protocol::retry::{AttemptEnd, RetryCause, MAX_ATTEMPT_DETAIL_BYTES, MAX_RETRIES};

/// Per-identity quotas and the registry's limits. `None` is unlimited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest registry message one task record may take (bytes): the
    /// server's `max_payload` less room for headers, and at most the codec's
    /// limit. Set by the driver from the server it is connected to.
    pub record_bytes: usize,
    /// The registry stream's byte limit.
    pub registry_bytes: u64,
    /// Live (not terminal) tasks one identity may hold.
    pub live_tasks: Option<u64>,
    /// Tasks one identity may keep in the registry, terminal ones included
    /// until garbage-collected.
    pub kept_tasks: Option<u64>,
    /// Output bytes one identity may keep in the registry (final outputs).
    pub output_bytes: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            record_bytes: tenure_protocol::MAX_MESSAGE_BYTES,
            registry_bytes: DEFAULT_REGISTRY_BYTES,
            live_tasks: Some(DEFAULT_LIVE_TASKS),
            kept_tasks: Some(DEFAULT_KEPT_TASKS),
            output_bytes: Some(DEFAULT_OUTPUT_BYTES),
        }
    }
}

/// Default registry stream byte limit: 1 GiB (≈ 1.5 million small records,
/// about what the leader keeps in 1 GiB of memory). The server reserves it in
/// its JetStream store when the stream is created, so it stays modest.
pub const DEFAULT_REGISTRY_BYTES: u64 = 1 << 30;
/// Default live tasks per identity.
pub const DEFAULT_LIVE_TASKS: u64 = 100_000;
/// Default kept tasks per identity (≈ 300 MiB of coordinator memory and of
/// registry): one identity cannot take the whole default registry alone.
pub const DEFAULT_KEPT_TASKS: u64 = 500_000;
/// Default final-output bytes per identity: 512 MiB (8 192 live
/// final-output tasks at their 64 KiB reservation, many more once they ended
/// small).
pub const DEFAULT_OUTPUT_BYTES: u64 = 512 << 20;

/// The share of the registry's byte limit kept free beyond what live tasks
/// may still need (1/20): board moves and cleanup jobs of finished tasks, and
/// what was appended while a sample of the stream was on its way (the
/// reserve a grant or an end releases stays counted until the next sample).
const REGISTRY_MARGIN_DIVISOR: u64 = 20;

/// Room in a record for everything a spec does not say: field names, ids,
/// numbers, timestamps, a worker id, a cleanup job, a trace.
const RECORD_OVERHEAD: usize = 2048;

/// What the message a task's record goes in on its own subject after its end
/// may weigh beyond the end's record (durability note a20): what may change
/// after an end — `reported`, a board move, a cleanup job, the registry
/// time (`post_end_growth_covers_every_change_after_an_end` checks it with
/// every field at its largest) — and the message's subject and headers.
/// Only for tasks whose record holds nothing else that grows after an end
/// ([`end_may_share`]).
pub(crate) const POST_END_GROWTH: usize = 512;

/// Whether an end of a task of `spec` may share a registry message: its
/// record grows after the end by [`POST_END_GROWTH`] at most. A `monitor`'s
/// late matched lines and an agent's late captured values grow it more, and
/// a workflow's end is followed by its steps' moves: those end on their own
/// subject.
pub(crate) fn end_may_share(spec: &TaskSpec) -> bool {
    spec.pattern.is_none() && spec.resume.is_none() && spec.steps.is_empty()
}

/// What one task record weighs in its identity's quotas and in the
/// registry's reserve.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Weight {
    live: u64,
    output: u64,
    /// Not granted yet (attempt 0): its first grant may still add an entry
    /// to a message other tasks keep alive (durability note a13).
    ungranted: u64,
}

impl Weight {
    pub(crate) fn of(r: &TaskRecord) -> Weight {
        let terminal = r.life.status.is_terminal();
        let output = match (r.spec.final_output, terminal) {
            (false, _) => 0,
            (true, false) => MAX_FINAL_OUTPUT_BYTES as u64,
            (true, true) => r.life.outcome.as_ref().and_then(|o| o.output.as_ref()).map_or(0, |o| o.len() as u64),
        };
        let ungranted = u64::from(!terminal && r.life.attempt.0 == 0);
        Weight { live: u64::from(!terminal), output, ungranted }
    }

    /// The registry bytes the task may still add that no later message of
    /// its own replaces: while it is live, its subject's next message or its
    /// end's entry in a batch (a task that ends in a batch never wrote to its
    /// subject before: `SharedOnly`), up to its largest record; and its
    /// first grant's entry until it is granted.
    fn reserve(&self, spec: &TaskSpec) -> u64 {
        let mut bytes = 0;
        if self.live > 0 {
            bytes += (size_bound(spec) + crate::registry::BATCHED_OVERHEAD) as u64;
        }
        if self.ungranted > 0 {
            bytes += grant_bound(spec) as u64;
        }
        bytes
    }
}

/// What one identity holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub live: u64,
    pub kept: u64,
    pub output: u64,
}

/// The counts behind the quotas and the registry budget, updated at every
/// change of a kept task.
#[derive(Debug, Default, Clone)]
pub(crate) struct Usage {
    by_identity: HashMap<Box<str>, Held>,
    /// The registry bytes every live task may still add (see
    /// [`Weight::reserve`]).
    live_reserve: u64,
    /// The registry stream's bytes as the driver last sampled them.
    registry_used: u64,
    /// Reserve released since that sample (a grant, an end): the bytes
    /// those changes append are not in the sample yet, so the room stays
    /// counted until the next one.
    unsampled: u64,
}

impl Usage {
    /// A record enters the leader's memory (loaded, submitted, a step created).
    pub(crate) fn add(&mut self, r: &TaskRecord) {
        let w = Weight::of(r);
        let held = self.by_identity.entry(r.owner.identity().into()).or_default();
        held.kept = held.kept.saturating_add(1);
        held.live = held.live.saturating_add(w.live);
        held.output = held.output.saturating_add(w.output);
        self.live_reserve = self.live_reserve.saturating_add(w.reserve(&r.spec));
    }

    /// What [`Usage::add`] adds for a new task of `owner` with `spec`, before
    /// its record exists (a batch judging its later tasks).
    pub(crate) fn add_new(&mut self, owner: &SessionId, spec: &TaskSpec) {
        let held = self.by_identity.entry(owner.identity().into()).or_default();
        held.kept = held.kept.saturating_add(1);
        held.live = held.live.saturating_add(1);
        if spec.final_output {
            held.output = held.output.saturating_add(MAX_FINAL_OUTPUT_BYTES as u64);
        }
        let new = Weight { live: 1, output: 0, ungranted: 1 };
        self.live_reserve = self.live_reserve.saturating_add(new.reserve(spec));
    }

    /// A record leaves the leader's memory (garbage-collected, dropped).
    pub(crate) fn remove(&mut self, r: &TaskRecord) {
        let w = Weight::of(r);
        let id = r.owner.identity();
        if let Some(held) = self.by_identity.get_mut(id) {
            held.kept = held.kept.saturating_sub(1);
            held.live = held.live.saturating_sub(w.live);
            held.output = held.output.saturating_sub(w.output);
            if held.kept == 0 {
                self.by_identity.remove(id);
            }
        }
        self.live_reserve = self.live_reserve.saturating_sub(w.reserve(&r.spec));
    }

    /// A kept record changed from weighing `before` to what it weighs now.
    pub(crate) fn reweigh(&mut self, r: &TaskRecord, before: Weight) {
        let after = Weight::of(r);
        if after == before {
            return;
        }
        if let Some(held) = self.by_identity.get_mut(r.owner.identity()) {
            held.live = held.live.saturating_sub(before.live).saturating_add(after.live);
            held.output = held.output.saturating_sub(before.output).saturating_add(after.output);
        }
        if (after.live, after.ungranted) != (before.live, before.ungranted) {
            let (before, after) = (before.reserve(&r.spec), after.reserve(&r.spec));
            self.live_reserve = self.live_reserve.saturating_sub(before).saturating_add(after);
            self.unsampled = self.unsampled.saturating_add(before.saturating_sub(after));
        }
    }

    pub(crate) fn sampled(&mut self, registry_bytes: u64) {
        self.registry_used = registry_bytes;
        self.unsampled = 0;
    }

    pub(crate) fn held(&self, identity: &str) -> Held {
        self.by_identity.get(identity).copied().unwrap_or_default()
    }

    /// Whether `owner` may submit `spec` under `limits`: its record (and each
    /// step's) fits in one registry message at its largest, its identity's
    /// quotas hold, and the registry keeps room for every live task.
    pub(crate) fn admit(&self, limits: &Limits, owner: &SessionId, spec: &TaskSpec) -> Result<(), ApiError> {
        let mut cost = fits(limits, owner, spec, None)?;
        for index in 0..spec.steps.len() {
            let step = spec.step(index).ok_or_else(|| ApiError::InvalidSpec(format!("step {} missing", index + 1)))?;
            cost = cost.saturating_add(fits(limits, owner, &step, Some(index as u32))?);
        }
        let identity = owner.identity();
        let held = self.held(identity);
        let workflow = !spec.steps.is_empty();
        let live = if workflow { 2 } else { 1 };
        let kept = 1 + spec.steps.len() as u64;
        let output = if spec.final_output { MAX_FINAL_OUTPUT_BYTES as u64 } else { 0 };
        let quota = |limit: &str, current: u64, requested: u64, max: Option<u64>| match max {
            Some(max) if requested > 0 && current.saturating_add(requested) > max => {
                Err(ApiError::Quota { identity: identity.to_owned(), limit: limit.to_owned(), current, requested, max })
            }
            _ => Ok(()),
        };
        quota("live-tasks", held.live, live, limits.live_tasks)?;
        quota("kept-tasks", held.kept, kept, limits.kept_tasks)?;
        quota("output-bytes", held.output, output, limits.output_bytes)?;
        let budget = limits.registry_bytes.saturating_sub(limits.registry_bytes / REGISTRY_MARGIN_DIVISOR);
        let needed =
            self.registry_used.saturating_add(self.live_reserve).saturating_add(self.unsampled).saturating_add(cost);
        if needed > budget {
            return Err(ApiError::RegistryFull { used: self.registry_used, max: limits.registry_bytes });
        }
        Ok(())
    }
}

/// `event` with what a worker or sidecar reported cut to the limits a record
/// keeps, so that no report can make a record too large to store.
pub(crate) fn bounded(event: Event) -> Event {
    match event {
        Event::Finished { attempt, epoch, outcome } => Event::Finished { attempt, epoch, outcome: outcome.bounded() },
        Event::StepsEnded { outcome } => Event::StepsEnded { outcome: outcome.bounded() },
        Event::Lost { attempt, epoch, hint } => Event::Lost { attempt, epoch, hint: hint.bounded() },
        other => other,
    }
}

/// The registry bytes one task of `spec` may take at its largest (checked
/// exactly when the quick bound does not fit); `RecordTooLarge` if it cannot
/// be stored. `step` is its index when it is a workflow's step.
fn fits(limits: &Limits, owner: &SessionId, spec: &TaskSpec, step: Option<u32>) -> Result<u64, ApiError> {
    let bound = size_bound(spec);
    if bound <= limits.record_bytes {
        return Ok(bound as u64);
    }
    let what = match step {
        Some(i) => format!("step {} of the workflow", i + 1),
        None => format!("the {} task", spec.kind),
    };
    let too_large = |size: usize| ApiError::RecordTooLarge {
        what: what.clone(),
        size: size as u64,
        max: limits.record_bytes as u64,
    };
    let size = largest_size(owner, spec, step).map_err(|_| too_large(bound))?;
    match size <= limits.record_bytes {
        true => Ok(size as u64),
        false => Err(too_large(size)),
    }
}

/// An upper bound of the registry bytes a task of `spec` may take at its
/// largest, from the lengths of its fields alone (no encoding): every string
/// of the spec, a few bytes of framing per entry, the largest outcome and
/// hint, and [`RECORD_OVERHEAD`].
pub(crate) fn size_bound(spec: &TaskSpec) -> usize {
    let output = if spec.final_output { MAX_KEPT_OUTPUT_BYTES } else { 0 };
    unended_bound(spec) + history_entries_bound(spec) + output + MAX_DETAIL_BYTES + MAX_HINT_BYTES
}

/// An upper bound of the registry bytes the record of a task's first grant
/// may take in a batch (durability note a13): [`size_bound`] less what no
/// record holds before an attempt ended — an outcome (its detail, its
/// output), a recovery hint (a grant clears it), entries of the attempt
/// history — and the id a batch entry names it by.
pub(crate) fn grant_bound(spec: &TaskSpec) -> usize {
    unended_bound(spec) + crate::registry::BATCHED_OVERHEAD
}

/// The part of [`size_bound`] every record of the task may hold, ended or not.
fn unended_bound(spec: &TaskSpec) -> usize {
    let framing = 8;
    let env: usize = spec.env.iter().map(|(k, v)| k.len() + v.len() + 2 * framing).sum();
    let steps: usize = spec.steps.iter().map(|s| s.command.len() + s.kind.as_str().len() + 32).sum();
    spec.label.len()
        + spec.command.len()
        + spec.cwd.as_ref().map_or(0, |c| c.len())
        + spec.pattern.as_ref().map_or(0, |p| p.len())
        + resume_bound(spec)
        + env
        + steps
        + history_log_bound(spec)
        + RECORD_OVERHEAD
        + 10 * framing
}

/// Room for one entry of an attempt history beyond its detail: field names,
/// numbers, times, a worker id.
const ATTEMPT_ENTRY_OVERHEAD: usize = 192 + tenure_protocol::ids::MAX_WORKER_ID_LEN;

/// An upper bound of the bytes of a task's attempt log beyond its entries:
/// the times of a delayed start, a deadline, a resume.
fn history_log_bound(spec: &TaskSpec) -> usize {
    let logged = history_entries(spec) > 0 || spec.not_before.is_some() || spec.limits.is_some();
    if logged {
        128
    } else {
        0
    }
}

/// An upper bound of the bytes of a task's attempt history entries: one
/// entry per attempt its retry policy allows (retries + 1), each with its
/// detail at [`MAX_ATTEMPT_DETAIL_BYTES`] and, for a resumable task, the
/// values captured.
fn history_entries_bound(spec: &TaskSpec) -> usize {
    let values = if spec.resume.is_some() { captured_bound() } else { 0 };
    history_entries(spec) as usize * (MAX_ATTEMPT_DETAIL_BYTES + ATTEMPT_ENTRY_OVERHEAD + values)
}

/// How many entries a task's attempt history may hold: one per attempt its
/// retry policy allows, or per resume, and the last one.
fn history_entries(spec: &TaskSpec) -> u32 {
    let retries = spec.retry.as_ref().map(|p| p.retries.min(MAX_RETRIES));
    let resumes = spec.resume.as_ref().map(|_| MAX_RESUMES);
    match retries.max(resumes) {
        Some(n) => n + 1,
        None => 0,
    }
}

/// Room for every captured value, with its name and framing.
fn captured_bound() -> usize {
    MAX_CAPTURES * (MAX_CAPTURE_NAME_BYTES + MAX_CAPTURE_VALUE_BYTES + 16)
}

/// An upper bound of what a task that declares a resume command adds to its
/// record: the declaration (command and patterns), the captured values, the
/// kept input (pending and handed to a grant), the pinned machine and the
/// boot id. Nothing for other tasks.
fn resume_bound(spec: &TaskSpec) -> usize {
    let Some(r) = spec.resume.as_deref() else { return 0 };
    let declared = r.command.len() + r.captures.iter().map(|c| c.len() + 8).sum::<usize>() + 32;
    let kept = MAX_PENDING_INPUT_BYTES + MAX_PENDING_INPUT * 8;
    declared + captured_bound() + kept + tenure_protocol::ids::MAX_WORKER_ID_LEN + 128 + 64
}

/// The encoded size of the registry message holding a task of `spec` with
/// every field that grows at its limit: the longest ids and numbers, a
/// worker, the largest outcome, detail and hint, a cleanup job, a trace.
pub fn largest_size(owner: &SessionId, spec: &TaskSpec, step: Option<u32>) -> Result<usize, String> {
    encoded_size(largest_record(owner, spec, step)?)
}

fn encoded_size(r: TaskRecord) -> Result<usize, String> {
    tenure_protocol::encode(&RegistryEntry::Task(Box::new(r))).map(|b| b.len()).map_err(|e| e.to_string())
}

/// A task of `spec` with every field that grows at its limit.
fn largest_record(owner: &SessionId, spec: &TaskSpec, step: Option<u32>) -> Result<TaskRecord, String> {
    let number = u64::MAX;
    let id = TaskId::new(spec.kind.clone(), number).map_err(|e| e.to_string())?;
    let worker: WorkerId = "w".repeat(tenure_protocol::ids::MAX_WORKER_ID_LEN).parse().map_err(|e| format!("{e}"))?;
    let mut r = TaskRecord::new(id, owner.clone(), Uuid::max(), spec.clone(), u64::MAX);
    r.life.status = Status::Completed;
    r.life.attempt = Attempt(u32::MAX);
    r.life.epoch = Epoch(u64::MAX);
    r.life.worker = Some(worker);
    r.life.kill_requested = true;
    r.life.board = Board::Deleted;
    r.life.hint = Some(Box::new(RecoveryHint { tag: HintTag::WorkerUnreachable, message: "x".repeat(MAX_HINT_BYTES) }));
    r.life.outcome = Some(Outcome {
        ending: Ending::Completed,
        exit_code: Some(i32::MIN),
        detail: Some("x".repeat(MAX_DETAIL_BYTES).into()),
        output_dropped: u64::MAX,
        output: spec.final_output.then(|| "x".repeat(MAX_KEPT_OUTPUT_BYTES).into()),
    });
    r.started_at_ms = Some(u64::MAX);
    r.finished_at_ms = Some(u64::MAX);
    r.clock_ms = u64::MAX;
    r.ended_clock_ms = u64::MAX;
    r.reported = true;
    r.cleanup = Some(CleanupJob { job: u32::MAX, done: true, cancelled: true, cancel_confirmed: true });
    r.matched_through = u64::MAX;
    r.matches = u64::MAX;
    r.trace = Some("0".repeat(64).into());
    let captured: BTreeMap<String, String> = (0..MAX_CAPTURES)
        .map(|i| (format!("{i:0>width$}", width = MAX_CAPTURE_NAME_BYTES), "x".repeat(MAX_CAPTURE_VALUE_BYTES)))
        .collect();
    let resume = spec.resume.is_some().then(|| {
        // Kept input counts pending and handed-over messages together.
        let message = "x".repeat(MAX_PENDING_INPUT_BYTES / MAX_PENDING_INPUT);
        ResumeState {
            captured: captured.clone(),
            resumes: u32::MAX,
            pending_input: vec![message; MAX_PENDING_INPUT],
            granted_input: Vec::new(),
            dropped_input: u32::MAX,
            machine: r.life.worker.clone(),
            granted_boot: Some("0".repeat(64).into()),
        }
    });
    if spec.retry.is_some() || spec.not_before.is_some() || spec.resume.is_some() || spec.limits.is_some() {
        let entries = history_entries(spec);
        let entry = |attempt| AttemptEnd {
            attempt: Attempt(attempt),
            worker: r.life.worker.clone(),
            ending: Some(Ending::Failed),
            cause: Some(RetryCause::Timeout),
            exit_code: Some(i32::MIN),
            detail: Some("x".repeat(MAX_ATTEMPT_DETAIL_BYTES).into()),
            started_at_ms: Some(u64::MAX),
            ended_at_ms: u64::MAX,
            retried: true,
            resumed: spec.resume.is_some().then(|| captured.clone()),
        };
        r.attempts = Some(Box::new(AttemptLog {
            history: (0..entries).map(|i| entry(u32::MAX - i)).collect(),
            ready_clock_ms: u64::MAX,
            ready_wall_ms: Some(u64::MAX),
            started_at_ms: Some(u64::MAX),
            deadline_clock_ms: u64::MAX,
            resume,
        }));
    }
    if let Some(index) = step {
        let workflow = TaskId::new(Kind::workflow(), number).map_err(|e| e.to_string())?;
        r.parent = Some(Box::new(StepOf { workflow, index }));
    }
    Ok(r)
}

/// The encoded size of the record of a task's first grant at its largest:
/// [`largest_record`] as it can be before any attempt ended — leased as
/// attempt 1, no outcome, hint, kill, board move, cleanup or history entry.
#[cfg(test)]
fn largest_grant_size(owner: &SessionId, spec: &TaskSpec, step: Option<u32>) -> Result<usize, String> {
    let mut r = largest_record(owner, spec, step)?;
    r.life.status = Status::Leased;
    r.life.attempt = Attempt(1);
    r.life.kill_requested = false;
    r.life.board = Board::Active;
    r.life.hint = None;
    r.life.outcome = None;
    r.finished_at_ms = None;
    r.ended_clock_ms = 0;
    r.reported = false;
    r.cleanup = None;
    r.incarnation = Some(Box::new(Uuid::max()));
    if let Some(log) = r.attempts.as_mut() {
        log.history.clear();
    }
    encoded_size(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;
    use tenure_protocol::StepSpec;

    fn owner() -> SessionId {
        "s".repeat(tenure_protocol::ids::MAX_SESSION_LEN).parse().unwrap()
    }

    /// Everything that may change in a record after its end (`reported`, a
    /// board move, a cleanup job and its answers, the registry time), from
    /// its smallest to its largest, with the longest subject and the headers
    /// of an append, stays within [`POST_END_GROWTH`]: a task whose end
    /// shares a message may add no more than that beyond its end's entry.
    #[test]
    fn post_end_growth_covers_every_change_after_an_end() {
        // The longest task subject, and the headers an append carries (its
        // message id and the two expectations), with the server's framing.
        let subject = "tenure.registry.task.".len() + tenure_protocol::ids::MAX_KIND_LEN + 1 + 20;
        let headers = "NATS/1.0\r\n\r\n".len()
            + "Nats-Msg-Id: \r\n".len()
            + 36
            + 1
            + 20
            + "Nats-Expected-Last-Sequence: \r\n".len()
            + 20
            + "Nats-Expected-Last-Msg-Id: \r\n".len()
            + 36
            + 1
            + 20;
        let framing = 64;
        let message = subject + headers + framing;
        for spec in [TaskSpec::shell("", "true"), TaskSpec::shell("l".repeat(64), "c".repeat(300))] {
            assert!(end_may_share(&spec));
            let mut end = largest_record(&owner(), &spec, None).unwrap();
            end.trace = None;
            end.reported = false;
            end.life.board = Board::Active;
            end.cleanup = None;
            end.clock_ms = 1;
            let mut after = end.clone();
            after.reported = true;
            after.life.board = Board::Archived;
            after.cleanup = Some(CleanupJob { job: u32::MAX, done: true, cancelled: true, cancel_confirmed: true });
            after.clock_ms = u64::MAX;
            let grew = encoded_size(after.clone()).unwrap() - encoded_size(end.clone()).unwrap();
            after.life.board = Board::Deleted;
            let grew = grew.max(encoded_size(after).unwrap() - encoded_size(end).unwrap());
            assert!(grew + message <= POST_END_GROWTH, "{grew} + {message} > {POST_END_GROWTH}");
        }
        let monitor = TaskSpec { pattern: Some("x".into()), ..TaskSpec::shell("", "tail -f log") };
        assert!(!end_may_share(&monitor), "a monitor's matches may grow its record after its end");
    }

    proptest! {
        /// The quick bounds are never below the exact largest sizes (of any
        /// record, and of a first grant in a batch), whatever the spec.
        #[test]
        fn the_quick_bound_covers_the_largest_record(
            label in ".{0,64}",
            command in ".{1,300}",
            env in proptest::collection::btree_map("[A-Z_]{1,12}", ".{0,40}", 0..20),
            steps in proptest::collection::vec(".{1,80}", 0..6),
            final_output in any::<bool>(),
            cwd in proptest::option::of("/[a-z/]{0,60}"),
            retries in proptest::option::of(1u32..=MAX_RETRIES),
            delayed in any::<bool>(),
            resume in proptest::option::of((".{1,200}", proptest::collection::vec(".{1,100}", 0..=MAX_CAPTURES))),
        ) {
            let mut spec = TaskSpec { env: env.into_iter().collect::<BTreeMap<_, _>>(), cwd: cwd.map(Into::into), final_output, ..TaskSpec::shell(label, command) };
            spec.retry = retries.map(|retries| Box::new(tenure_protocol::retry::RetryPolicy {
                retries,
                backoff_ms: 1,
                backoff_max_ms: 1,
                on: RetryCause::ALL.to_vec(),
            }));
            spec.not_before = delayed.then(|| Box::new(tenure_protocol::retry::NotBefore::In { ms: u64::MAX }));
            spec.resume = resume.map(|(command, captures)| Box::new(tenure_protocol::resume::ResumeSpec {
                command: command.into(),
                captures: captures.into_iter().map(Into::into).collect(),
                anywhere: true,
            }));
            if !steps.is_empty() {
                spec = TaskSpec {
                    kind: Kind::workflow(),
                    steps: steps.into_iter().map(|command| StepSpec { kind: Kind::shell(), command }).collect(),
                    final_output: false,
                    ..spec
                };
            }
            let exact = largest_size(&owner(), &spec, None).unwrap();
            prop_assert!(size_bound(&spec) >= exact, "bound {} < exact {exact}", size_bound(&spec));
            let granted = largest_grant_size(&owner(), &spec, None).unwrap() + crate::registry::BATCHED_OVERHEAD;
            prop_assert!(grant_bound(&spec) >= granted, "grant bound {} < {granted}", grant_bound(&spec));
            prop_assert!(grant_bound(&spec) < size_bound(&spec));
            for i in 0..spec.steps.len() {
                let step = spec.step(i).unwrap();
                let exact = largest_size(&owner(), &step, Some(i as u32)).unwrap();
                prop_assert!(size_bound(&step) >= exact);
                let granted = largest_grant_size(&owner(), &step, Some(i as u32)).unwrap();
                prop_assert!(grant_bound(&step) >= granted + crate::registry::BATCHED_OVERHEAD);
            }
        }
    }
}
