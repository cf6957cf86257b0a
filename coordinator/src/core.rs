//! The coordinator's decision core: registry state in memory, scheduling, worker
//! liveness, kills and waits — as a deterministic state machine.
//!
//! [`Core::handle`] takes one [`Input`] and the current time and returns the
//! [`Effect`]s to carry out, in order. It never awaits, never reads a clock and
//! never touches NATS: the driver in `daemon.rs` does that. Task status changes
//! only through [`tenure_protocol::apply`]; this module decides *which* events
//! happen (a grant to which worker, a worker judged lost) and keeps indexes.
//!
//! This file holds the inputs, the effects, the lifecycle step every change
//! goes through (`Core::event`) and the tick. The core's state is kept in
//! named parts, each in its own module with the decisions that use it:
//!
//! | part | module | what it keeps |
//! |---|---|---|
//! | `tasks` | `crate::tasks` | every kept record, by task number |
//! | `submits` | `api` | idempotency keys, task numbering (and the client API) |
//! | `dispatch` | `dispatch` | the queue, slot holders, grants and kills in flight |
//! | `workers` | `workers` | each worker's process, store, slots, kinds, liveness |
//! | `doubts` | `liveness` | `unknown` tasks and attempts whose evidence is asked |
//! | `waiters` | `waiters` | clients waiting for a task's end or start |
//! | `cleanups` | `board` | cleanup jobs in flight, the garbage collector's pace |
//! | `workflows` | `workflow` | each workflow's steps, workflows to advance |
//! | `clock` | here | registry time ([`Core::registry_ms`]) |
//! | `usage` | `crate::limits` | what each identity holds, the registry's room |
//! | `claims` | `epochs` | higher epochs others reported |
//! | `presence` | `presence` | this leader's term and the standbys, for `Status` |
//! | `pauses` | `pauses` | when each pause wish a heartbeat contradicts was last sent |
//!
//! Two modules keep no part of their own: `retry` (an attempt's end turned
//! into a retry or a final event under the task's policy, the attempt
//! history and the ready time kept in the record) and `priority` (the order
//! in which queued tasks are offered to workers).
//!
//! **Invariant:** every effect that changes a task is preceded, in the returned
//! list, by the `Persist` of the record that justifies it; the driver executes
//! effects in order and stops at the first failed persist, so no reply, grant or
//! kill ever reflects state that is not durable.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure_protocol::messages::{
    ApiReply, ApiRequest, ApiResponse, CleanupReply, CleanupRequest, CoordinatorPresence, EvidenceReply,
    EvidenceRequest, Heartbeat, LeaseGrant, Notice, Report, ReportAck, WorkerCommand, WorkerReply,
};
use tenure_protocol::placement::Concurrency;
use tenure_protocol::{apply, Attempt, Decision, Epoch, Event, Kind, Status, TaskId, WorkerId};
use uuid::Uuid;

use crate::limits::{Limits, Usage, Weight};
use crate::record::TaskRecord;
use crate::tasks::Tasks;
pub use presence::Leader;

/// Timing rules of the core. Durations are measured on the leader's monotonic clock.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// A worker not heard from for this long is lost; its tasks are settled.
    pub worker_ttl: Duration,
    /// Re-send an unanswered grant after this long.
    pub grant_retry: Duration,
    /// Re-send a kill to a stopping task after this long.
    pub kill_retry: Duration,
    /// Kinds accepted at submit even before any worker advertised them.
    pub builtin_kinds: Vec<Kind>,
    /// Finished tasks are garbage-collected this long after they ended (their
    /// files released on the worker machine first, then the registry record
    /// compacted). `None` keeps them forever.
    pub retention: Option<Duration>,
    /// Identities with the operator role: every owner under them may get, list
    /// and kill every owner's tasks (never wait on them or mark them
    /// reported). An identity is what the transport authenticated (the part of
    /// an owner before its `/`); on a cluster without authentication it is
    /// whatever a client claims, so the role protects nothing there.
    pub operators: Vec<String>,
    /// Record size, per-identity quotas and the registry's byte limit.
    pub limits: Limits,
    /// A task queued (and free to start) this long goes before every task
    /// queued later, whatever their priorities: no task starves.
    pub priority_max_age: Duration,
    /// Concurrency limits by key: they win over a task's own (see `flow.rs`).
    pub concurrency_limits: BTreeMap<String, u32>,
    /// Which submitted tasks wait for approval, and who may give it.
    pub approval: ApprovalPolicy,
}

/// The coordinators' approval policy (seed 003's plan mode): which tasks
/// are held `blocked` at submit until someone allowed approves them. A task
/// submitted with `--hold` is held whatever the policy, and its owner may
/// approve it.
#[derive(Debug, Clone, Default)]
pub struct ApprovalPolicy {
    /// Tasks of these kinds that are not idempotent are held.
    pub kinds: Vec<Kind>,
    /// Tasks whose command (or, for a workflow, a step's) matches one of
    /// these are held, idempotent or not.
    pub commands: Vec<regex::Regex>,
    /// Who may approve a task the policy held: its owner or an operator
    /// (`Owner`), or only an operator (`Operator`).
    pub approver: Approver,
}

/// Who may approve a task held by the approval policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Approver {
    #[default]
    Owner,
    Operator,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            worker_ttl: Duration::from_secs(6),
            grant_retry: Duration::from_secs(1),
            kill_retry: Duration::from_secs(2),
            builtin_kinds: vec![Kind::shell()],
            operators: Vec::new(),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            limits: Limits::default(),
            priority_max_age: Duration::from_secs(10 * 60),
            concurrency_limits: BTreeMap::new(),
            approval: ApprovalPolicy::default(),
        }
    }
}

/// The time, as the driver read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// Monotonic time since the coordinator started; used for every expiry.
    pub mono: Duration,
    /// Wall clock in epoch milliseconds; only stamped on records for humans.
    pub wall_ms: u64,
}

/// Something the driver observed.
#[derive(Debug, Clone)]
pub enum Input {
    Api {
        reply_to: Option<String>,
        request: ApiRequest,
        /// The W3C `traceparent` of the request's span, if traced: a submitted
        /// task keeps it, so its whole life is one trace.
        trace: Option<String>,
    },
    Heartbeat(Heartbeat),
    Report {
        reply_to: Option<String>,
        report: Report,
    },
    /// A worker's reports sent together (well formed: every one speaks for
    /// the worker whose subject they came on): each is judged as if it came
    /// alone, and all are answered by one [`Effect::Acks`].
    Reports {
        reply_to: Option<String>,
        reports: Vec<Report>,
    },
    /// The answer (or transport failure) to a command the driver sent for an effect.
    CommandResult {
        worker: WorkerId,
        command: WorkerCommand,
        result: Result<WorkerReply, String>,
    },
    /// A sidecar's answer to a cleanup job (or the transport failure).
    CleanupResult {
        worker: WorkerId,
        request: CleanupRequest,
        result: Result<CleanupReply, String>,
    },
    /// The answer of a lost worker's sidecar to an evidence query, or the
    /// transport failure that says the whole machine is unreachable.
    Evidence {
        worker: WorkerId,
        request: EvidenceRequest,
        result: Result<EvidenceReply, String>,
    },
    /// The registry's highest epoch claim, read for a [`Effect::CheckEpoch`]
    /// (or why it could not be read).
    EpochChecked {
        claimed: Epoch,
        by: String,
        registry: Result<Epoch, String>,
    },
    /// The registry stream's bytes, as sampled by the driver, and what the
    /// tasks whose end is the latest record in a batch may still add (the
    /// registry counts those: durability note a20).
    RegistryUsage {
        bytes: u64,
    },
    /// The record of `task` could not be stored (it cannot be encoded, or the
    /// registry refused its size): the change was not made durable, so the
    /// leader drops the task from memory — a new task never existed; an
    /// existing one is read again from the registry by the next leader.
    PersistFailed {
        task: TaskId,
        reason: String,
    },
    /// This process's leadership term as the leadership task published it:
    /// at the start of the term and after every change (a renewal, say).
    Leader(Leader),
    /// A standby coordinator's presence message.
    Presence(CoordinatorPresence),
    Tick,
}

/// Which version of its task a persisted record is. Three versions of a task
/// happen once in its life, and only those may share a registry message with
/// other tasks' records (durability notes a12, a13 and a20): that is what
/// keeps a task's share of the registry bounded while its records are spread
/// over messages that other tasks keep alive (`limits.rs` and the registry
/// reserve for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    /// The task's first record: the input created the task.
    First,
    /// The record of its first grant (`queued` → `leased` with attempt 1;
    /// an attempt number is never given twice).
    FirstGrant,
    /// The record of its end (its first terminal status: terminal statuses
    /// are absorbing), of a task none of whose records so far was `Later`:
    /// its subject holds no record the end would have replaced.
    End,
    /// Any other record.
    Later,
}

impl Version {
    /// Whether `record`, of this version, may share a message with other
    /// tasks' records: a first record or a first grant of a task that has
    /// not ended, or an end. A first record or grant merged with its task's
    /// end in one input goes on the task's subject (its name is the first
    /// record's or the grant's, and an end there would not be told apart).
    pub fn may_share(self, record: &TaskRecord) -> bool {
        match self {
            Version::First | Version::FirstGrant => !record.life.status.is_terminal(),
            Version::End => true,
            Version::Later => false,
        }
    }
}

/// Something the driver must do, in order. Carried out as soon as the
/// batch is, never kept: the size of its largest variant (a command with a
/// grant) costs nothing, so it is not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Append this record to the registry (conditionally). Must succeed before
    /// any later effect of the same batch is carried out. The version says
    /// whether it may share a message with other tasks' records
    /// ([`Version::may_share`]).
    Persist(Box<TaskRecord>, Version),
    /// Send a command to a worker — to the instance the id is bound to; its
    /// answer comes back as `Input::CommandResult`.
    Command {
        worker: WorkerId,
        instance: Uuid,
        command: WorkerCommand,
        /// The W3C `traceparent` the command is sent under: a grant continues
        /// the trace of its task's submit (kept in the record, so a new leader
        /// continues it too); `None` for a kill, or an untraced task.
        trace: Option<String>,
    },
    /// Tell a second live process with a bound worker id to stop (published on
    /// the id's shared subject; no answer).
    InstanceTaken {
        worker: WorkerId,
        instance: Uuid,
        holder: Uuid,
    },
    /// Send a cleanup job to a worker machine's sidecar; the answer comes back
    /// as `Input::CleanupResult`.
    Cleanup {
        worker: WorkerId,
        request: CleanupRequest,
    },
    /// Ask a worker machine's sidecar about an attempt; the answer comes back as
    /// `Input::Evidence`.
    AskEvidence {
        worker: WorkerId,
        request: EvidenceRequest,
    },
    Reply {
        to: String,
        reply: ApiReply,
    },
    Ack {
        to: String,
        ack: ReportAck,
    },
    /// Grants to one worker process sent together as one
    /// [`Grants`](tenure_protocol::messages::Grants)
    /// message (each answer comes back as its own `CommandResult`); see
    /// `group_grants`.
    Grants {
        worker: WorkerId,
        instance: Uuid,
        grants: Vec<LeaseGrant>,
    },
    /// The answers to [`Input::Reports`], in order: after every append of the
    /// input, like any effect.
    Acks {
        to: String,
        acks: Vec<ReportAck>,
    },
    /// Compact a garbage-collected task's record to a tombstone (conditional).
    Forget {
        task: TaskId,
        at_ms: u64,
    },
    /// Publish a notice (after the record that justifies it is persisted): a
    /// task's end, or a `monitor` task's matched line.
    Notify(Box<Notice>),
    /// Someone (`by`) says epoch `claimed`, above ours, exists: read the
    /// registry's highest epoch claim; the answer comes back as
    /// `Input::EpochChecked`.
    CheckEpoch {
        claimed: Epoch,
        by: String,
    },
    /// A newer leader exists: stop writing and commanding.
    StepDown {
        reason: String,
    },
}

/// The leader's in-memory view of the registry and the cluster, in named parts
/// (see the module documentation).
pub struct Core {
    cfg: CoreConfig,
    epoch: Epoch,
    tasks: Tasks,
    submits: api::Submits,
    dispatch: dispatch::Dispatch,
    workers: workers::Workers,
    doubts: liveness::Doubts,
    waiters: waiters::Waiters,
    cleanups: board::Cleanups,
    workflows: workflow::Workflows,
    pauses: pauses::Pauses,
    /// The live tasks of each concurrency key (see `flow.rs`).
    keys: flow::Keys,
    clock: RegistryClock,
    /// What each identity holds, and the registry budget (see `limits.rs`).
    usage: Usage,
    /// Higher epochs others reported, to check against the registry.
    claims: epochs::Claims,
    /// This leader's term and the standbys, for the status view.
    presence: presence::Presence,
    /// The tasks whose end may share a registry message ([`Version::End`]).
    shared_only: outgoing::SharedOnly,
}

/// Registry time: milliseconds of leadership accumulated across terms (see
/// [`Core::registry_ms`]).
#[derive(Debug, Clone, Copy)]
struct RegistryClock {
    /// When this core was built (the leader's term began), on its monotonic clock.
    started: Duration,
    /// Registry time when this core was built: the highest registry time
    /// stamped on a loaded record.
    at_start: u64,
}

impl RegistryClock {
    fn ms(&self, now: Now) -> u64 {
        let elapsed = now.mono.saturating_sub(self.started).as_millis();
        self.at_start.saturating_add(u64::try_from(elapsed).unwrap_or(u64::MAX))
    }
}

impl Core {
    /// Builds the core from the registry as loaded. Workers that hold tasks get a
    /// full TTL of grace from `now` before they can be judged lost: a restarted
    /// leader has not heard from anyone yet.
    pub fn new(cfg: CoreConfig, epoch: Epoch, records: Vec<TaskRecord>, now: Now) -> Core {
        let clock = RegistryClock {
            started: now.mono,
            at_start: records.iter().map(|r| r.clock_ms.max(r.ended_clock_ms)).max().unwrap_or(0),
        };
        let mut core = Core {
            cfg,
            epoch,
            tasks: Tasks::default(),
            submits: api::Submits::default(),
            dispatch: dispatch::Dispatch::default(),
            workers: workers::Workers::default(),
            doubts: liveness::Doubts::default(),
            waiters: waiters::Waiters::default(),
            cleanups: board::Cleanups::default(),
            workflows: workflow::Workflows::default(),
            pauses: pauses::Pauses::default(),
            keys: flow::Keys::default(),
            clock,
            usage: Usage::default(),
            claims: epochs::Claims::default(),
            presence: presence::Presence::default(),
            shared_only: outgoing::SharedOnly::default(),
        };
        for mut r in records {
            // Ended before registry time was recorded: its age is counted
            // from this takeover (later, never earlier, than the truth).
            if r.life.status.is_terminal() && r.ended_clock_ms == 0 {
                r.ended_clock_ms = clock.at_start.max(1);
            }
            core.submits.reserve_through(r.id.number());
            core.usage.add(&r);
            if r.parent.is_none() {
                core.submits.remember(r.owner.clone(), r.idempotency_key, r.id.number());
            }
            if let (true, Some(w)) = (r.life.status.is_on_worker(), &r.life.worker) {
                core.workers.holding_tasks(w, now);
            }
            core.index(&r.id, concurrency(&r.spec), r.spec.priority, None, r.life.status, r.life.worker.as_ref(), now);
            if let Some(of) = &r.parent {
                core.workflows.index_step(&r.id, of);
            }
            // A workflow is advanced at once: the last leader may have died
            // between a step's end and the workflow's next move.
            if !r.spec.steps.is_empty() && !r.life.status.is_terminal() {
                if r.attempts.as_ref().is_some_and(|a| a.deadline_clock_ms > 0) {
                    core.workflows.timed(&r.id);
                }
                core.workflows.due(&r.id);
            }
            // A cleanup job the previous leader left pending is resumed at once.
            if r.cleanup.is_some_and(|j| j.unsettled()) {
                core.cleanups.resume(&r.id, now);
            }
            core.tasks.insert(r);
        }
        core
    }

    /// Notices to (re)publish when this core starts leading: every terminal task
    /// not yet reported. The previous leader may have died between persisting a
    /// task's end and publishing its notice; the stream deduplicates repeats by
    /// task id, and watchers skip tasks reported meanwhile, so a notice is never
    /// shown twice and never lost.
    ///
    /// With `window`, only tasks that ended within that much registry time
    /// before the takeover (the last write the previous leader made) are
    /// republished: a leader publishes a notice right after persisting the
    /// end, so only ends near its last write can lack one. Registry time is
    /// never another machine's wall clock, so no skew widens or narrows the
    /// window. Without it (no previous leader), all.
    pub fn pending_notices(&self, window: Option<Duration>) -> Vec<Notice> {
        let since = window.map(|w| self.clock.at_start.saturating_sub(w.as_millis() as u64));
        let recent = |r: &&TaskRecord| since.is_none_or(|since| r.ended_clock_ms == 0 || r.ended_clock_ms >= since);
        // In task number order.
        let ended = self.tasks.values().filter(|r| r.life.status.is_terminal() && !r.reported).filter(recent);
        ended.map(|r| Notice::Ended(Box::new(self.snapshot_of(r)))).collect()
    }

    /// Never allocate task numbers at or below `n` (seen in the registry, even in
    /// records that could not be read).
    pub fn reserve_through(&mut self, n: u64) {
        self.submits.reserve_through(n);
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Registry time: milliseconds of leadership accumulated across terms,
    /// each term measured on its own leader's monotonic clock from the
    /// highest registry time it loaded. Every elapsed-time decision about a
    /// record (idempotency-key memory, retention, notice republication)
    /// compares registry times, never a wall clock with a time another
    /// leader wrote. It can only lag the truth (the gap between the last
    /// write and a takeover is not counted), so skew or failover makes a
    /// key remembered, or a task kept, longer — never shorter.
    pub fn registry_ms(&self, now: Now) -> u64 {
        self.clock.ms(now)
    }

    pub fn task(&self, id: &TaskId) -> Option<&TaskRecord> {
        self.tasks.get(id)
    }

    /// Tasks by status (for metrics; one pass over the registry).
    pub fn counts(&self) -> BTreeMap<Status, u64> {
        let mut counts = BTreeMap::new();
        for r in self.tasks.values() {
            *counts.entry(r.life.status).or_default() += 1;
        }
        counts
    }

    /// How long ago each known worker was last heard from.
    pub fn heartbeat_ages(&self, now: Now) -> Vec<(WorkerId, Duration)> {
        self.workers.ages(now)
    }

    /// Submit → running latencies (ms) of the tasks started since the last call.
    pub fn take_dispatch_latencies(&mut self) -> Vec<u64> {
        self.dispatch.take_latencies()
    }

    pub fn handle(&mut self, input: Input, now: Now) -> Vec<Effect> {
        let mut fx = Vec::new();
        match input {
            Input::Api { reply_to, request, trace } => self.api(reply_to, request, trace, now, &mut fx),
            Input::Heartbeat(hb) => self.heartbeat(hb, now, &mut fx),
            Input::Report { reply_to, report } => {
                let ack = self.report(report, now, &mut fx);
                if let Some(to) = reply_to {
                    fx.push(Effect::Ack { to, ack });
                }
            }
            Input::Reports { reply_to, reports } => {
                let acks = reports.into_iter().map(|report| self.report(report, now, &mut fx)).collect();
                if let Some(to) = reply_to {
                    fx.push(Effect::Acks { to, acks });
                }
            }
            Input::CommandResult { worker, command, result } => {
                self.command_result(worker, command, result, now, &mut fx)
            }
            Input::Evidence { worker, request, result } => self.evidence(worker, request, result, now, &mut fx),
            Input::CleanupResult { worker, request, result } => self.cleanup_result(worker, request, result, &mut fx),
            Input::EpochChecked { claimed, by, registry } => self.epoch_checked(claimed, by, registry, now, &mut fx),
            Input::RegistryUsage { bytes } => self.usage.sampled(bytes),
            Input::PersistFailed { task, reason } => self.persist_failed(&task, &reason, now, &mut fx),
            Input::Leader(leader) => self.presence.leader(leader),
            Input::Presence(presence) => self.presence.seen(presence, now.mono),
            Input::Tick => self.tick(now, &mut fx),
        }
        if !fx.iter().any(|e| matches!(e, Effect::StepDown { .. })) {
            self.advance_due_workflows(now, &mut fx);
            self.schedule(now, &mut fx);
        }
        coalesce_persists(&mut fx);
        group_grants(&mut fx);
        notices_last(&mut fx);
        let clock = self.registry_ms(now);
        for e in &mut fx {
            if let Effect::Persist(r, version) = e {
                r.clock_ms = clock;
                self.shared_only.persisted(r, *version);
            }
        }
        fx
    }

    /// The passing of time: epoch claims to check, cleanups to retry, garbage
    /// to collect, workers lost, waits expired, grants and kills unanswered.
    fn tick(&mut self, now: Now, fx: &mut Vec<Effect>) {
        self.check_claims(now, fx);
        self.retry_cleanups(now, fx);
        self.collect_garbage(now, fx);
        let ttl = self.cfg.worker_ttl;
        for worker in self.workers.judge_lost(now, ttl) {
            tracing::warn!(%worker, ttl_ms = ttl.as_millis() as u64, "worker lost: no heartbeat within ttl; asking its sidecar");
        }
        self.ask_about_lost_workers(now, fx);
        self.workflow_deadlines(now);
        self.expire_waits(now, fx);
        self.resend_unanswered(now, fx);
    }

    // ------------------------------------------------------------ lifecycle

    /// Applies `event` to `task` through the lifecycle table; on a change, updates
    /// the record and indexes, stamps times, persists, and answers waiters.
    fn event(&mut self, task: &TaskId, event: Event, now: Now, fx: &mut Vec<Effect>) -> Option<Decision> {
        let event = crate::limits::bounded(event);
        // Retries: an attempt whose retry was decided is settled; an end the
        // task's policy retries becomes a retry (see `retry.rs`).
        if self.retried_already(task, &event) {
            tracing::debug!(task = %task, ?event, "the attempt was already retried; changes nothing");
            return Some(Decision::Unchanged(tenure_protocol::Unchanged::Stale));
        }
        let (event, ended) = self.retry_or_final(task, event);
        self.event_noting(task, event, ended, now, fx)
    }

    /// [`Core::event`] with the attempt history's entry already decided
    /// (`ended`: a retry's, or a resume's).
    fn event_noting(
        &mut self,
        task: &TaskId,
        event: Event,
        ended: Option<retry::Ended>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> Option<Decision> {
        let granted_to = match &event {
            Event::Grant { worker, .. } => Some(self.workers.incarnation_of(worker)),
            _ => None,
        };
        let boot = match &event {
            Event::Grant { worker, .. } => self.workers.boot_of(worker).map(str::to_owned),
            _ => None,
        };
        let clock = self.registry_ms(now);
        let record = self.tasks.get_mut(task)?;
        let decision = apply(&record.life, &event);
        let Decision::Changed(life) = &decision else {
            tracing::debug!(task = %task, ?event, ?decision, "event changed nothing");
            return Some(decision);
        };
        let before = record.life.status;
        let weight = Weight::of(record);
        let prior = std::mem::replace(&mut record.life, life.clone());
        retry::note(record, &prior, ended, now, clock);
        resume::note(record, &prior, &event, boot.as_deref());
        if let Some(incarnation) = granted_to {
            record.incarnation = incarnation.map(Box::new);
        }
        let after = life.status;
        let key = concurrency(&record.spec).cloned();
        let priority = record.spec.priority;
        let worker = record.life.worker.clone();
        // Dispatched: the process started — or ended before its start report
        // was seen (a short task).
        // (A start may land `paused`: evidence of an attempt its owner paused.)
        let started = matches!(after, Status::Running | Status::Paused);
        let dispatched = started || (before == Status::Leased && after.is_terminal());
        if dispatched && record.started_at_ms.is_none() {
            self.dispatch.dispatched(now.wall_ms.saturating_sub(record.created_at_ms));
        }
        if started && record.started_at_ms.is_none() {
            record.started_at_ms = Some(now.wall_ms);
        }
        let parent = record.parent.as_ref().map(|p| p.workflow.clone());
        let waiters = if after.is_terminal() {
            record.finished_at_ms = Some(now.wall_ms);
            record.ended_clock_ms = clock.max(1);
            record.incarnation = None;
            // Only grants continue a task's trace: a finished task needs none.
            record.trace = None;
            let ws = self.waiters.take(task);
            // A step's end is reported by its workflow.
            if !ws.is_empty() || parent.is_some() {
                record.reported = true;
            }
            ws
        } else {
            // A start is answered, and marks nothing reported.
            self.waiters.take_reached(task, after)
        };
        self.usage.reweigh(record, weight);
        tracing::debug!(task = %task, attempt = %life.attempt, epoch = %life.epoch, from = %before, to = %after, "task transition");
        let reported = record.reported;
        let ended = after.is_terminal() && !before.is_terminal();
        let version = match (before, after, life.attempt) {
            (Status::Queued, Status::Leased, Attempt(1)) => Version::FirstGrant,
            _ if ended && self.shared_only.contains(&task.number()) => Version::End,
            _ => Version::Later,
        };
        fx.push(Effect::Persist(Box::new(record.clone()), version));
        // An end is noticed only if nothing reported it: an end handed to a
        // waiter with this very change is `reported`, and every reader of
        // notices (`watch`, the gateway's streams, MCP) skips such ends.
        // A snapshot only for a notice or a waiter: most transitions need none.
        let notify = ended && parent.is_none() && !reported;
        let snapshot = match notify || !waiters.is_empty() {
            true => self.tasks.get(task).map(|r| self.snapshot_of(r)),
            false => None,
        };
        if let (true, Some(workflow)) = (ended, parent) {
            self.workflows.due(&workflow);
        }
        if let (true, Some(s)) = (notify, &snapshot) {
            fx.push(Effect::Notify(Box::new(Notice::Ended(Box::new(s.clone())))));
        }
        if let Some(snapshot) = &snapshot {
            let finished = after.is_terminal();
            for w in waiters {
                let reply = Ok(ApiResponse::Waited { finished, snapshot: snapshot.clone() });
                fx.push(Effect::Reply { to: w.to, reply });
            }
        }
        if before != after {
            self.index(task, key.as_ref(), priority, Some(before), after, worker.as_ref(), now);
            if !after.is_on_worker() {
                self.dispatch.off_worker(task);
                self.doubts.off_worker(task);
            }
            if after.is_terminal() {
                self.dispatch.ended(task);
            }
        }
        Some(decision)
    }

    /// Moves `task` between the parts' status indexes (`before` is `None`
    /// for a task new to this leader); `worker` is the one it is on after.
    #[allow(clippy::too_many_arguments)]
    fn index(
        &mut self,
        task: &TaskId,
        key: Option<&Concurrency>,
        priority: i32,
        before: Option<Status>,
        after: Status,
        worker: Option<&WorkerId>,
        now: Now,
    ) {
        self.dispatch.index(task, priority, before, after, worker, now.mono);
        self.doubts.index(task, before, after);
        self.keys.index(task, key, after);
    }
}

/// The concurrency key a task of `spec` counts against, if any.
fn concurrency(spec: &tenure_protocol::TaskSpec) -> Option<&Concurrency> {
    spec.placement.as_ref().and_then(|p| p.concurrency.as_ref())
}

mod api;
mod board;
mod dispatch;
mod epochs;
mod flow;
mod liveness;
mod outgoing;
mod pauses;
mod presence;
mod priority;
mod resume;
mod retry;
mod waiters;
mod workers;
mod workflow;

use outgoing::{coalesce_persists, group_grants, notices_last};

#[cfg(test)]
mod tests;
