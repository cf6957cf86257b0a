//! The coordinator's decision core: registry state in memory, scheduling, worker
//! liveness, kills and waits — as a deterministic state machine.
//!
//! [`Core::handle`] takes one [`Input`] and the current time and returns the
//! [`Effect`]s to carry out, in order. It never awaits, never reads a clock and
//! never touches NATS: the driver in `daemon.rs` does that. Task status changes
//! only through [`tenure_protocol::apply`]; this module decides *which* events
//! happen (a grant to which worker, a worker judged lost) and keeps indexes.
//!
//! **Invariant:** every effect that changes a task is preceded, in the returned
//! list, by the `Persist` of the record that justifies it; the driver executes
//! effects in order and stops at the first failed persist, so no reply, grant or
//! kill ever reflects state that is not durable.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, ApiResponse, CleanupReply, CleanupRequest, ClusterStatus, CoordinatorPresence,
    EvidenceReply, EvidenceRequest, Heartbeat, KillCommand, KillResult, LeaseGrant, MatchNotice, MatchedLine, Notice,
    Refusal, Report, ReportAck, ReportEvent, SidecarHealth, SubmitRequest, TaskSnapshot, WorkerCommand, WorkerReply,
    WorkerStatus, MAX_LIST_PAGE_BYTES, MAX_MATCHES_PER_REPORT, MAX_MATCH_LINE_BYTES, MAX_WAIT_MS,
};
use tenure_protocol::{apply, Board, Decision, Epoch, Event, Kind, SessionId, Status, TaskId, Unchanged, WorkerId};
use uuid::Uuid;

use crate::limits::{Limits, Usage, Weight};
use crate::record::TaskRecord;
use crate::tasks::Tasks;
pub use presence::Leader;
use presence::Presence;

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
    /// The registry stream's bytes, as sampled by the driver.
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

/// Something the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Append this record to the registry (conditionally). Must succeed before
    /// any later effect of the same batch is carried out.
    Persist(Box<TaskRecord>),
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
    /// Compact a garbage-collected task's record to a tombstone (conditional).
    Forget {
        task: TaskId,
        at_ms: u64,
    },
    /// Publish a notice (after the record that justifies it is persisted): a
    /// task's end, or a monitor's matched line.
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

#[derive(Debug, Clone)]
struct WorkerState {
    /// The process this worker id is bound to: commands go to it alone, and
    /// heartbeats of another live process with the id are refused. `None`
    /// until the first heartbeat to this leader (a worker known from the
    /// registry at takeover): commands wait for it.
    instance: Option<Uuid>,
    /// The incarnation of the machine's store, as the last heartbeat that
    /// knew it said.
    incarnation: Option<Uuid>,
    slots: u32,
    kinds: BTreeSet<Kind>,
    last_seen: Duration,
    alive: bool,
    sidecar: SidecarHealth,
    /// An epoch above ours its last heartbeat (or refusal) claimed, not yet
    /// claimed in the registry: nothing is scheduled on it meanwhile.
    unproven_epoch: Option<Epoch>,
}

#[derive(Debug, Clone)]
struct Waiter {
    to: String,
    session: SessionId,
    deadline: Duration,
}

/// The leader's in-memory view of the registry and the cluster.
pub struct Core {
    cfg: CoreConfig,
    epoch: Epoch,
    tasks: Tasks,
    /// Submits' idempotency keys → task number, while remembered (see
    /// `forget_old_keys`). Steps are not here: no client submitted them.
    by_key: HashMap<(SessionId, Uuid), u64>,
    /// Queued tasks in submission order.
    queue: BTreeSet<(u64, TaskId)>,
    /// Tasks that hold a worker slot (leased, running, stopping).
    on_worker: BTreeSet<TaskId>,
    /// Tasks `unknown` (their machine's evidence may still settle them).
    unknown: BTreeSet<TaskId>,
    /// Tasks of `on_worker` whose worker listed their current attempt in a
    /// heartbeat to this leader since they last changed status: adopted, as
    /// far as this leader can see. Only for the status view.
    confirmed: HashSet<TaskId>,
    workers: BTreeMap<WorkerId, WorkerState>,
    next_n: u64,
    /// When a grant or kill was last sent for a task.
    sent: HashMap<TaskId, Duration>,
    /// A task given back by a refusal is not granted again before this time, so a
    /// worker that keeps refusing (sidecar down, full) is not hammered.
    not_before: HashMap<TaskId, Duration>,
    waiters: HashMap<TaskId, Vec<Waiter>>,
    /// When the sidecar of a lost worker was last asked about a task.
    asked: HashMap<TaskId, Duration>,
    /// Started tasks whose live worker has not listed their attempt, by how
    /// many heartbeats in a row; and tasks whose machine is doubted (its store
    /// was replaced, or it stopped listing them): their evidence is asked for
    /// although the worker lives.
    unlisted: HashMap<TaskId, u32>,
    doubted: HashSet<TaskId>,
    /// When a task's cleanup job was last sent, and how often.
    cleanup_tries: HashMap<TaskId, (Duration, u32)>,
    /// When the garbage collector last ran.
    last_gc: Option<Duration>,
    /// The steps of each workflow: step index → child task.
    children: HashMap<TaskId, BTreeMap<u32, TaskId>>,
    /// Workflows to advance before this input's effects are returned.
    workflows_due: BTreeSet<TaskId>,
    /// Submit → running of tasks that started since the driver last took them
    /// (wall-clock milliseconds, for the dispatch-latency metric).
    dispatched_ms: Vec<u64>,
    /// When this core was built (the leader's term began).
    started: Duration,
    /// Registry time when this core was built: the highest registry time
    /// stamped on a loaded record (see [`Core::registry_ms`]).
    clock_at_start: u64,
    /// What each identity holds, and the registry budget (see `limits.rs`).
    usage: Usage,
    /// Higher epochs others reported, to check against the registry.
    claims: epochs::Claims,
    /// This leader's term and the standbys, for the status view.
    presence: Presence,
}

impl Core {
    /// Builds the core from the registry as loaded. Workers that hold tasks get a
    /// full TTL of grace from `now` before they can be judged lost: a restarted
    /// leader has not heard from anyone yet.
    pub fn new(cfg: CoreConfig, epoch: Epoch, records: Vec<TaskRecord>, now: Now) -> Core {
        let mut core = Core {
            cfg,
            epoch,
            tasks: Tasks::default(),
            by_key: HashMap::new(),
            queue: BTreeSet::new(),
            on_worker: BTreeSet::new(),
            unknown: BTreeSet::new(),
            confirmed: HashSet::new(),
            workers: BTreeMap::new(),
            next_n: 1,
            sent: HashMap::new(),
            not_before: HashMap::new(),
            waiters: HashMap::new(),
            asked: HashMap::new(),
            unlisted: HashMap::new(),
            doubted: HashSet::new(),
            cleanup_tries: HashMap::new(),
            last_gc: None,
            children: HashMap::new(),
            workflows_due: BTreeSet::new(),
            dispatched_ms: Vec::new(),
            started: now.mono,
            clock_at_start: records.iter().map(|r| r.clock_ms.max(r.ended_clock_ms)).max().unwrap_or(0),
            usage: Usage::default(),
            claims: epochs::Claims::default(),
            presence: Presence::default(),
        };
        for mut r in records {
            // Ended before registry time was recorded: its age is counted
            // from this takeover (later, never earlier, than the truth).
            if r.life.status.is_terminal() && r.ended_clock_ms == 0 {
                r.ended_clock_ms = core.clock_at_start.max(1);
            }
            core.next_n = core.next_n.max(r.id.number().saturating_add(1));
            core.usage.add(&r);
            if r.parent.is_none() {
                core.by_key.insert((r.owner.clone(), r.idempotency_key), r.id.number());
            }
            if let (true, Some(w)) = (r.life.status.is_on_worker(), &r.life.worker) {
                core.workers.entry(w.clone()).or_insert(WorkerState {
                    instance: None,
                    incarnation: None,
                    slots: 0,
                    kinds: BTreeSet::new(),
                    last_seen: now.mono,
                    alive: true,
                    sidecar: SidecarHealth::Ok,
                    unproven_epoch: None,
                });
            }
            core.index(&r.id, None, r.life.status);
            if let Some(of) = &r.parent {
                core.index_child(&r.id, of);
            }
            // A workflow is advanced at once: the last leader may have died
            // between a step's end and the workflow's next move.
            if !r.spec.steps.is_empty() && !r.life.status.is_terminal() {
                core.workflows_due.insert(r.id.clone());
            }
            // A cleanup job the previous leader left pending is resumed at once.
            if r.cleanup.is_some_and(|j| j.unsettled()) {
                core.cleanup_tries.insert(r.id.clone(), (now.mono, 0));
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
        let since = window.map(|w| self.clock_at_start.saturating_sub(w.as_millis() as u64));
        let recent = |r: &&TaskRecord| since.is_none_or(|since| r.ended_clock_ms == 0 || r.ended_clock_ms >= since);
        // In task number order.
        let ended = self.tasks.values().filter(|r| r.life.status.is_terminal() && !r.reported).filter(recent);
        ended.map(|r| Notice::Ended(Box::new(self.snapshot_of(r)))).collect()
    }

    /// Never allocate task numbers at or below `n` (seen in the registry, even in
    /// records that could not be read).
    pub fn reserve_through(&mut self, n: u64) {
        self.next_n = self.next_n.max(n.saturating_add(1));
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
        let elapsed = now.mono.saturating_sub(self.started).as_millis();
        self.clock_at_start.saturating_add(u64::try_from(elapsed).unwrap_or(u64::MAX))
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
        self.workers.iter().map(|(id, w)| (id.clone(), now.mono.saturating_sub(w.last_seen))).collect()
    }

    /// Submit → running latencies (ms) of the tasks started since the last call.
    pub fn take_dispatch_latencies(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.dispatched_ms)
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
        let clock = self.registry_ms(now);
        for e in &mut fx {
            if let Effect::Persist(r) = e {
                r.clock_ms = clock;
            }
        }
        fx
    }

    // ------------------------------------------------------------ client API

    fn api(
        &mut self,
        reply_to: Option<String>,
        request: ApiRequest,
        trace: Option<String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let reply = match request {
            ApiRequest::Submit(req) => self.submit(req, trace, now, fx),
            ApiRequest::Get { session, task } => {
                self.visible(&session, &task).map(|r| ApiResponse::Snapshot(self.snapshot_of(r)))
            }
            ApiRequest::List { session, all } => {
                Ok(ApiResponse::List(self.listed(&session, all, 0).map(|r| self.snapshot_of(r)).collect()))
            }
            ApiRequest::ListPage { session, all, after } => {
                let (mut tasks, mut bytes, mut next) = (Vec::new(), 0usize, None);
                for r in self.listed(&session, all, after.unwrap_or(0)) {
                    let snapshot = self.snapshot_of(r);
                    let size = tenure_protocol::encode(&snapshot).map(|b| b.len()).unwrap_or(usize::MAX);
                    if !tasks.is_empty() && bytes.saturating_add(size) > MAX_LIST_PAGE_BYTES {
                        next = tasks.last().map(|s: &TaskSnapshot| s.id.number());
                        break;
                    }
                    bytes = bytes.saturating_add(size);
                    tasks.push(snapshot);
                }
                Ok(ApiResponse::Page { tasks, next })
            }
            ApiRequest::Kill { session, task } => self.kill(&session, &task, now, fx),
            ApiRequest::Wait { session, task, timeout_ms } => match self.owned(&session, &task) {
                Err(e) => Err(e),
                Ok(r) if r.life.status.is_terminal() => {
                    self.mark_reported(&task, fx).map(|snapshot| ApiResponse::Waited { finished: true, snapshot })
                }
                Ok(_) => {
                    if let Some(to) = reply_to {
                        let deadline = now.mono + Duration::from_millis(timeout_ms.min(MAX_WAIT_MS));
                        self.waiters.entry(task).or_default().push(Waiter { to, session, deadline });
                    }
                    return;
                }
            },
            ApiRequest::Status => Ok(ApiResponse::Status(self.status(now))),
            ApiRequest::Archive { session, task } => self.board(&session, &task, Event::Archive, now, fx),
            ApiRequest::Unarchive { session, task } => self.board(&session, &task, Event::Unarchive, now, fx),
            ApiRequest::Delete { session, task } => self.board(&session, &task, Event::Delete, now, fx),
            // Served by the driver from the notice stream, never by the core.
            ApiRequest::Notices { .. } => {
                Err(ApiError::InvalidRequest("notices are read from the notice stream, not the registry".into()))
            }
            ApiRequest::FinalOutput { session, task } => match self.owned(&session, &task) {
                Err(e) => Err(e),
                Ok(r) if !r.spec.final_output => Err(ApiError::InvalidRequest(format!(
                    "{task} streams its output: read it with `tenure logs` from its worker machine"
                ))),
                Ok(r) if !r.life.status.is_terminal() => {
                    Ok(ApiResponse::FinalOutput { finished: false, text: String::new() })
                }
                Ok(r) => {
                    let text = r.life.outcome.as_ref().and_then(|o| o.output.clone()).unwrap_or_default();
                    // Its owner has the end: that reports the task.
                    self.mark_reported(&task, fx)
                        .map(|_| ApiResponse::FinalOutput { finished: true, text: text.into() })
                }
            },
            ApiRequest::MarkReported { session, task } => match self.owned(&session, &task) {
                Err(e) => Err(e),
                Ok(r) if !r.life.status.is_terminal() => Err(ApiError::InvalidRequest(format!(
                    "{task} is {}: only a finished task can be reported",
                    r.life.status
                ))),
                Ok(_) => self.mark_reported(&task, fx).map(ApiResponse::Snapshot),
            },
        };
        if let Some(to) = reply_to {
            fx.push(Effect::Reply { to, reply });
        }
    }

    /// The tasks a `List` of `session` shows: its own (every session's for an
    /// operator), by board — archived ones with `all`, deleted ones only to an
    /// operator's `all` (their records stay for audit). Numbered above
    /// `after`, in task number order.
    fn listed<'a>(
        &'a self,
        session: &'a SessionId,
        all: bool,
        after: u64,
    ) -> impl Iterator<Item = &'a TaskRecord> + 'a {
        let operator = self.is_operator(session);
        self.tasks.after(after).filter(move |r| {
            let shown = match r.life.board {
                Board::Active => all || !r.life.status.is_terminal() || !r.reported,
                Board::Archived => all,
                Board::Deleted => all && operator,
            };
            (&r.owner == session || operator) && shown
        })
    }

    /// Kinds a submit may name: the builtin ones and those advertised by the
    /// workers this leader knows (alive now, or lost but not forgotten). A kind
    /// no worker runs any more is refused rather than queued forever.
    fn known_kinds(&self) -> BTreeSet<Kind> {
        let mut kinds: BTreeSet<Kind> = self.cfg.builtin_kinds.iter().cloned().collect();
        // The leader runs workflows itself.
        kinds.insert(Kind::workflow());
        kinds.extend(self.workers.values().flat_map(|w| w.kinds.iter().cloned()));
        kinds
    }

    /// Whether `session` acts for an identity with the operator role.
    fn is_operator(&self, session: &SessionId) -> bool {
        self.cfg.operators.iter().any(|o| o == session.identity())
    }

    /// The task if `session` owns it or holds the operator role.
    fn visible(&self, session: &SessionId, task: &TaskId) -> Result<&TaskRecord, ApiError> {
        match self.tasks.get(task) {
            Some(r) if &r.owner == session || self.is_operator(session) => Ok(r),
            _ => Err(ApiError::NotFound(task.to_string())),
        }
    }

    fn owned(&self, session: &SessionId, task: &TaskId) -> Result<&TaskRecord, ApiError> {
        match self.tasks.get(task) {
            Some(r) if &r.owner == session => Ok(r),
            _ => Err(ApiError::NotFound(task.to_string())),
        }
    }

    fn submit(&mut self, req: SubmitRequest, trace: Option<String>, now: Now, fx: &mut Vec<Effect>) -> ApiReply {
        let existing = self.by_key.get(&(req.session.clone(), req.idempotency_key));
        if let Some(r) = existing.and_then(|n| self.tasks.by_number(*n)) {
            return Ok(ApiResponse::Submitted { task: r.id.clone(), existing: true });
        }
        req.spec.validate().map_err(|e| ApiError::InvalidSpec(e.to_string()))?;
        let known = self.known_kinds();
        let kinds = std::iter::once(&req.spec.kind).chain(req.spec.steps.iter().map(|s| &s.kind));
        if let Some(unknown) = kinds.into_iter().find(|k| !known.contains(*k)) {
            // A leader that just took over has not heard every worker's kinds:
            // "unknown" is not known yet; the client retries.
            if now.mono < self.started + self.cfg.worker_ttl {
                return Err(ApiError::Unavailable(format!(
                    "kind {:?} is not known to this leader yet: workers report their kinds within the worker TTL of a takeover; retry",
                    unknown.as_str()
                )));
            }
            return Err(ApiError::UnknownKind {
                kind: unknown.to_string(),
                known: known.iter().map(ToString::to_string).collect(),
            });
        }
        self.usage.admit(&self.cfg.limits, &req.session, &req.spec)?;
        let n = self.allocate()?;
        let id = TaskId::new(req.spec.kind.clone(), n).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        let record = TaskRecord {
            trace: trace.map(String::into_boxed_str),
            ..TaskRecord::new(id.clone(), req.session.clone(), req.idempotency_key, req.spec, now.wall_ms)
        };
        self.by_key.insert((req.session, req.idempotency_key), id.number());
        self.index(&id, None, Status::Queued);
        let workflow = !record.spec.steps.is_empty();
        fx.push(Effect::Persist(Box::new(record.clone())));
        self.usage.add(&record);
        self.tasks.insert(record);
        if workflow {
            self.begin_workflow(&id, now, fx);
        }
        Ok(ApiResponse::Submitted { task: id, existing: false })
    }

    /// The next task number. Numbers are never reused, so once the counter
    /// cannot step past one (`u64::MAX` itself is never handed out) nothing
    /// more can be created: refused, never wrapped.
    fn allocate(&mut self) -> Result<u64, ApiError> {
        let n = self.next_n;
        self.next_n = n.checked_add(1).ok_or_else(|| ApiError::Unavailable("task numbers are exhausted".into()))?;
        Ok(n)
    }

    /// A task's record could not be stored: drop the task from memory, so
    /// this leader acts on nothing that is not durable. A task just created
    /// never existed (its number stays used); an existing one is loaded again
    /// by the next leader from the registry's last durable version. A step
    /// that could not be stored ends its workflow `failed` (it is never
    /// created again, so nothing loops).
    fn persist_failed(&mut self, task: &TaskId, reason: &str, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.remove(task) else { return };
        tracing::error!(task = %task, %reason, "task record not stored; the task is dropped from this leader's memory");
        self.usage.remove(&r);
        if r.parent.is_none() {
            self.by_key.remove(&(r.owner.clone(), r.idempotency_key));
        }
        if let Some(of) = &r.parent {
            if let Some(steps) = self.children.get_mut(&of.workflow) {
                steps.remove(&of.index);
            }
            let detail = format!("step {} ({task}) could not be stored: {reason}", of.index + 1);
            self.end_workflow(&of.workflow, tenure_protocol::Ending::Failed, detail, now, fx);
        }
        self.queue.remove(&(task.number(), task.clone()));
        self.on_worker.remove(task);
        self.unknown.remove(task);
        self.confirmed.remove(task);
        self.sent.remove(task);
        self.not_before.remove(task);
        self.asked.remove(task);
        self.cleanup_tries.remove(task);
        self.children.remove(task);
        let error = ApiError::Unavailable(format!("the record of {task} could not be stored: {reason}"));
        for w in self.waiters.remove(task).unwrap_or_default() {
            fx.push(Effect::Reply { to: w.to, reply: Err(error.clone()) });
        }
    }

    fn kill(&mut self, session: &SessionId, task: &TaskId, now: Now, fx: &mut Vec<Effect>) -> ApiReply {
        let by_owner = &self.visible(session, task)?.owner == session;
        let result = match self.event(task, Event::KillRequested, now, fx) {
            Some(Decision::Unchanged(Unchanged::Terminal)) => KillResult::AlreadyFinished,
            _ => KillResult::Requested,
        };
        let status = self.visible(session, task)?.life.status;
        if status == Status::Stopping {
            self.send_kill(task, now, fx);
        }
        if self.children.contains_key(task) {
            // A workflow: its current step is stopped by the advance.
            self.workflows_due.insert(task.clone());
        }
        // Only the owner receiving the end counts as reported.
        if status.is_terminal() && by_owner {
            let snapshot = self.mark_reported(task, fx)?;
            return Ok(ApiResponse::Kill { result, snapshot });
        }
        let snapshot = self.snapshot_of(self.visible(session, task)?);
        Ok(ApiResponse::Kill { result, snapshot })
    }

    /// Sets `reported` (persisting it when it changes) and returns the snapshot.
    fn mark_reported(&mut self, task: &TaskId, fx: &mut Vec<Effect>) -> Result<TaskSnapshot, ApiError> {
        let r = self.tasks.get_mut(task).ok_or_else(|| ApiError::NotFound(task.to_string()))?;
        if !r.reported {
            r.reported = true;
            fx.push(Effect::Persist(Box::new(r.clone())));
        }
        let r = self.tasks.get(task).ok_or_else(|| ApiError::NotFound(task.to_string()))?;
        Ok(self.snapshot_of(r))
    }

    fn status(&self, now: Now) -> ClusterStatus {
        let counts = self.counts();
        let load = self.load();
        let mut status = ClusterStatus {
            leader_epoch: self.epoch,
            workers: self
                .workers
                .iter()
                .map(|(id, w)| WorkerStatus {
                    id: id.clone(),
                    slots: w.slots,
                    running: load.get(id).copied().unwrap_or(0),
                    kinds: w.kinds.iter().cloned().collect(),
                    last_seen_ms: now.mono.saturating_sub(w.last_seen).as_millis() as u64,
                    alive: w.alive,
                    sidecar: w.sidecar,
                    unproven_epoch: w.unproven_epoch,
                })
                .collect(),
            tasks_by_status: counts.into_iter().collect(),
            unconfirmed: self.on_worker.iter().filter(|t| !self.confirmed.contains(*t)).count() as u64,
            leader: None,
            standbys: Vec::new(),
        };
        self.presence.fill(&mut status, now.mono);
        status
    }

    // -------------------------------------------------------------- workers

    fn heartbeat(&mut self, hb: Heartbeat, now: Now, fx: &mut Vec<Effect>) {
        if let Some((w, holder)) = self.workers.get(&hb.worker).and_then(|w| Some((w, w.instance?))) {
            let holder_live = w.alive && now.mono.saturating_sub(w.last_seen) < self.cfg.worker_ttl;
            if holder != hb.instance {
                if holder_live && hb.replaces != Some(holder) {
                    tracing::warn!(
                        worker = %hb.worker, instance = %hb.instance, %holder,
                        "a second live process claims this worker id (the same id on two hosts?): refused, told to stop"
                    );
                    fx.push(Effect::InstanceTaken { worker: hb.worker, instance: hb.instance, holder });
                    return;
                }
                tracing::info!(worker = %hb.worker, instance = %hb.instance, previous = %holder, "worker id bound to a new process");
            }
        }
        // A higher epoch is believed only once the registry shows it claimed.
        let unproven = (hb.epoch_seen > self.epoch).then_some(hb.epoch_seen);
        if let Some(claimed) = unproven {
            self.epoch_claimed(claimed, format!("worker {}", hb.worker), now, fx);
        }
        let w = self.workers.entry(hb.worker.clone()).or_insert(WorkerState {
            instance: Some(hb.instance),
            incarnation: None,
            slots: 0,
            kinds: BTreeSet::new(),
            last_seen: now.mono,
            alive: true,
            sidecar: SidecarHealth::Ok,
            unproven_epoch: None,
        });
        if !w.alive {
            tracing::info!(worker = %hb.worker, "worker is back");
        }
        // A new process knows nothing of its predecessor's store: the
        // incarnation is what it says, unknown until its sidecar answers.
        let rebound = w.instance != Some(hb.instance);
        w.instance = Some(hb.instance);
        if rebound || hb.incarnation.is_some() {
            w.incarnation = hb.incarnation;
        }
        w.slots = hb.slots;
        w.kinds = hb.kinds.into_iter().collect();
        w.last_seen = now.mono;
        w.alive = true;
        w.sidecar = hb.sidecar;
        w.unproven_epoch = unproven;
        self.stop_stale_copies(&hb.worker, &hb.attempts, fx);
        self.check_listed(&hb.worker, hb.incarnation, &hb.attempts, now, fx);
    }

    fn report(&mut self, report: Report, now: Now, fx: &mut Vec<Effect>) -> ReportAck {
        // "Stale" says under which epoch it was decided: a worker believes
        // it only from a leader at or above the highest epoch it has seen.
        let stale = ReportAck::StaleAt { epoch: self.epoch };
        let Some(record) = self.tasks.get(&report.task) else {
            return stale;
        };
        if record.life.worker.as_ref() != Some(&report.worker) || record.life.attempt != report.attempt {
            return stale;
        }
        let event = match report.event {
            ReportEvent::Matched(lines) => return self.matched(&report.task, lines, now, fx),
            ReportEvent::Started { .. } => Event::Started { attempt: report.attempt, epoch: report.epoch },
            ReportEvent::Finished(outcome) => Event::Finished { attempt: report.attempt, epoch: report.epoch, outcome },
            ReportEvent::NotStarted { .. } => Event::Refused { attempt: report.attempt, epoch: report.epoch },
            ReportEvent::Lost(hint) => Event::Lost { attempt: report.attempt, epoch: report.epoch, hint },
        };
        match self.event(&report.task, event, now, fx) {
            Some(Decision::Changed(_))
            | Some(Decision::Unchanged(Unchanged::Duplicate | Unchanged::Terminal | Unchanged::NotApplicable)) => {
                ReportAck::Ack
            }
            Some(Decision::Unchanged(Unchanged::Stale)) | None => stale,
        }
    }

    /// Records how far a monitor's matched lines were notified and publishes
    /// the new ones. Lines at or below the recorded offset are repeats.
    fn matched(&mut self, task: &TaskId, lines: Vec<MatchedLine>, now: Now, fx: &mut Vec<Effect>) -> ReportAck {
        let epoch = self.epoch;
        let Some(r) = self.tasks.get_mut(task).filter(|r| r.spec.pattern.is_some()) else {
            return ReportAck::StaleAt { epoch };
        };
        let through = r.matched_through;
        let mut lines = lines;
        lines.sort_by_key(|l| l.offset);
        lines.dedup_by_key(|l| l.offset);
        let fresh: Vec<MatchedLine> = lines
            .into_iter()
            // `through` saturates: at `u64::MAX` every offset was notified.
            .filter(|l| l.offset >= through && through < u64::MAX)
            .take(MAX_MATCHES_PER_REPORT)
            .map(|l| match l.text.len() > MAX_MATCH_LINE_BYTES {
                true => MatchedLine::new(l.offset, &l.text),
                false => l,
            })
            .collect();
        let Some(last) = fresh.iter().map(|l| l.offset).max() else { return ReportAck::Ack };
        r.matched_through = last.saturating_add(1);
        r.matches = r.matches.saturating_add(fresh.len() as u64);
        fx.push(Effect::Persist(Box::new(r.clone())));
        for line in fresh {
            tracing::info!(task = %task, offset = line.offset, "monitor line matched");
            let notice = MatchNotice {
                task: task.clone(),
                owner: r.owner.clone(),
                label: r.spec.label.clone(),
                line,
                at_ms: now.wall_ms,
            };
            fx.push(Effect::Notify(Box::new(Notice::Matched(notice))));
        }
        ReportAck::Ack
    }

    fn command_result(
        &mut self,
        worker: WorkerId,
        command: WorkerCommand,
        result: Result<WorkerReply, String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let (task, attempt, epoch, is_kill) = match &command {
            WorkerCommand::Grant(g) => (g.task.clone(), g.attempt, g.epoch, false),
            WorkerCommand::Kill(k) => (k.task.clone(), k.attempt, k.epoch, true),
            // Published, never answered.
            WorkerCommand::InstanceTaken { .. } => return,
        };
        match result {
            Ok(WorkerReply::Accepted) => {}
            Err(error) => {
                tracing::debug!(%worker, task = %task, %attempt, %error, "command not answered; will retry");
            }
            Ok(WorkerReply::Refused(reason)) => {
                // A machine that has seen a higher epoch refuses every command
                // of ours: believed once the registry shows it claimed; until
                // then nothing more is scheduled there.
                if let Refusal::StaleEpoch { held, .. } = &reason {
                    if *held > self.epoch {
                        if let Some(w) = self.workers.get_mut(&worker) {
                            w.unproven_epoch = Some(*held);
                        }
                        self.epoch_claimed(*held, format!("worker {worker}"), now, fx);
                    }
                }
                tracing::info!(%worker, task = %task, %attempt, %reason, kill = is_kill, "worker refused");
                if let Refusal::UnsupportedKind(kind) = &reason {
                    if let (Some(w), Ok(kind)) = (self.workers.get_mut(&worker), kind.parse::<Kind>()) {
                        w.kinds.remove(&kind);
                    }
                }
                // A refused grant, or a kill of an attempt the worker never held,
                // proves nothing ran — but only while the registry still waits for
                // that attempt to start (`leased`, or `stopping` for a kill): a
                // refusal of a late copy of the grant, after the attempt ran or was
                // settled otherwise (`unknown`, say), proves nothing.
                let waiting = self.tasks.get(&task).is_some_and(|r| {
                    r.life.attempt == attempt
                        && (r.life.status == Status::Leased || (is_kill && r.life.status == Status::Stopping))
                });
                // A store failure proves nothing either: the intent may be
                // recorded there. The machine's evidence settles the task.
                if let (false, Refusal::SidecarStorage(_), true) = (is_kill, &reason, waiting) {
                    tracing::warn!(%worker, task = %task, %attempt, "grant refused by a failing store: asking its evidence");
                    self.doubted.insert(task);
                    self.ask_about_lost_workers(now, fx);
                    return;
                }
                let never_held = !is_kill || reason == Refusal::UnknownAttempt;
                if never_held && waiting {
                    self.event(&task, Event::Refused { attempt, epoch }, now, fx);
                    self.not_before.insert(task, now.mono + self.cfg.grant_retry / 2);
                }
            }
        }
    }

    fn tick(&mut self, now: Now, fx: &mut Vec<Effect>) {
        self.check_claims(now, fx);
        self.retry_cleanups(now, fx);
        self.collect_garbage(now, fx);
        let ttl = self.cfg.worker_ttl;
        let lost: Vec<WorkerId> = self
            .workers
            .iter_mut()
            .filter(|(_, w)| w.alive && now.mono.saturating_sub(w.last_seen) > ttl)
            .map(|(id, w)| {
                w.alive = false;
                id.clone()
            })
            .collect();
        for worker in &lost {
            tracing::warn!(%worker, ttl_ms = ttl.as_millis() as u64, "worker lost: no heartbeat within ttl; asking its sidecar");
        }
        self.ask_about_lost_workers(now, fx);

        let expired: Vec<TaskId> = self
            .waiters
            .iter()
            .filter(|(_, ws)| ws.iter().any(|w| w.deadline <= now.mono))
            .map(|(t, _)| t.clone())
            .collect();
        for task in expired {
            let Some(list) = self.waiters.remove(&task) else { continue };
            let (due, keep): (Vec<Waiter>, Vec<Waiter>) = list.into_iter().partition(|w| w.deadline <= now.mono);
            if !keep.is_empty() {
                self.waiters.insert(task.clone(), keep);
            }
            for w in due {
                let reply = self
                    .owned(&w.session, &task)
                    .map(|r| ApiResponse::Waited { finished: false, snapshot: self.snapshot_of(r) });
                fx.push(Effect::Reply { to: w.to, reply });
            }
        }

        let resend: Vec<(TaskId, Status)> = self
            .on_worker
            .iter()
            .filter_map(|t| {
                let r = self.tasks.get(t)?;
                let retry = match r.life.status {
                    Status::Leased => self.cfg.grant_retry,
                    Status::Stopping => self.cfg.kill_retry,
                    _ => return None,
                };
                let alive = r.life.worker.as_ref().and_then(|w| self.workers.get(w)).is_some_and(|w| w.alive);
                let due = self.sent.get(t).is_none_or(|at| now.mono.saturating_sub(*at) >= retry);
                (alive && due).then(|| (t.clone(), r.life.status))
            })
            .collect();
        for (task, status) in resend {
            if status == Status::Leased {
                self.send_grant(&task, now, fx);
            } else {
                self.send_kill(&task, now, fx);
            }
        }
    }

    /// Slots in use per worker.
    fn load(&self) -> HashMap<WorkerId, u32> {
        let mut load = HashMap::new();
        for t in &self.on_worker {
            if let Some(w) = self.tasks.get(t).and_then(|r| r.life.worker.clone()) {
                *load.entry(w).or_insert(0) += 1;
            }
        }
        load
    }

    fn schedule(&mut self, now: Now, fx: &mut Vec<Effect>) {
        if self.queue.is_empty() {
            return;
        }
        let load = self.load();
        let mut free: BTreeMap<WorkerId, u32> = self
            .workers
            .iter()
            // A machine whose sidecar is down or degraded would refuse the
            // grant, and one that claims an epoch no coordinator claimed too.
            // Only a process that heartbeated to this leader, with its store's
            // incarnation: the grant is recorded against that store.
            .filter(|(_, w)| {
                w.alive
                    && w.sidecar == SidecarHealth::Ok
                    && w.unproven_epoch.is_none()
                    && w.instance.is_some()
                    && w.incarnation.is_some()
            })
            .map(|(id, w)| (id.clone(), w.slots.saturating_sub(load.get(id).copied().unwrap_or(0))))
            .filter(|(_, f)| *f > 0)
            .collect();
        let queued: Vec<TaskId> = self.queue.iter().map(|(_, t)| t.clone()).collect();
        for task in queued {
            if free.is_empty() {
                break;
            }
            if self.not_before.get(&task).is_some_and(|t| *t > now.mono) {
                continue;
            }
            self.not_before.remove(&task);
            let Some(kind) = self.tasks.get(&task).map(|r| r.spec.kind.clone()) else { continue };
            let best = free
                .iter()
                .filter(|(w, _)| self.workers.get(*w).is_some_and(|s| s.kinds.contains(&kind)))
                .max_by_key(|(_, f)| **f)
                .map(|(w, _)| w.clone());
            let Some(worker) = best else { continue };
            let grant = Event::Grant { worker: worker.clone(), epoch: self.epoch };
            if let Some(Decision::Changed(_)) = self.event(&task, grant, now, fx) {
                self.send_grant(&task, now, fx);
                if let Some(f) = free.get_mut(&worker) {
                    *f -= 1;
                    if *f == 0 {
                        free.remove(&worker);
                    }
                }
            }
        }
    }

    /// The process `worker` is bound to, once one heartbeated to this leader.
    fn instance_of(&self, worker: &WorkerId) -> Option<Uuid> {
        self.workers.get(worker).and_then(|w| w.instance)
    }

    fn send_grant(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get(task) else { return };
        let Some(worker) = r.life.worker.clone() else { return };
        // Sent only to the store it was granted to, as the machine's latest
        // heartbeat names it: another store (a wiped machine, or one not yet
        // known) may face an attempt that ran before. Its evidence settles it.
        let current = self.workers.get(&worker).and_then(|w| w.incarnation);
        if r.incarnation.as_deref().is_some_and(|a| current != Some(*a)) {
            return;
        }
        let grant = LeaseGrant {
            task: task.clone(),
            attempt: r.life.attempt,
            epoch: r.life.epoch,
            owner: r.owner.clone(),
            spec: r.spec.clone(),
            // Filled in by the driver when it sends the grant.
            mark: None,
        };
        // Sent only to a bound process; until one heartbeats, the retry sends it.
        let Some(instance) = self.instance_of(&worker) else { return };
        let trace = r.trace.as_deref().map(str::to_owned);
        self.sent.insert(task.clone(), now.mono);
        fx.push(Effect::Command { worker, instance, command: WorkerCommand::Grant(grant), trace });
    }

    fn send_kill(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get(task) else { return };
        let Some(worker) = r.life.worker.clone() else { return };
        let kill = KillCommand { task: task.clone(), attempt: r.life.attempt, epoch: self.epoch.max(r.life.epoch) };
        let Some(instance) = self.instance_of(&worker) else { return };
        self.sent.insert(task.clone(), now.mono);
        fx.push(Effect::Command { worker, instance, command: WorkerCommand::Kill(kill), trace: None });
    }

    // ------------------------------------------------------------ lifecycle

    /// Applies `event` to `task` through the lifecycle table; on a change, updates
    /// the record and indexes, stamps times, persists, and answers waiters.
    fn event(&mut self, task: &TaskId, event: Event, now: Now, fx: &mut Vec<Effect>) -> Option<Decision> {
        let event = crate::limits::bounded(event);
        let granted_to = match &event {
            Event::Grant { worker, .. } => Some(self.workers.get(worker).and_then(|w| w.incarnation)),
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
        record.life = life.clone();
        if let Some(incarnation) = granted_to {
            record.incarnation = incarnation.map(Box::new);
        }
        let after = life.status;
        // Dispatched: the process started — or ended before its start report
        // was seen (a short task).
        let dispatched = after == Status::Running || (before == Status::Leased && after.is_terminal());
        if dispatched && record.started_at_ms.is_none() && self.dispatched_ms.len() < 100_000 {
            self.dispatched_ms.push(now.wall_ms.saturating_sub(record.created_at_ms));
        }
        if after == Status::Running && record.started_at_ms.is_none() {
            record.started_at_ms = Some(now.wall_ms);
        }
        let parent = record.parent.as_ref().map(|p| p.workflow.clone());
        let waiters = if after.is_terminal() {
            record.finished_at_ms = Some(now.wall_ms);
            record.ended_clock_ms = clock.max(1);
            record.incarnation = None;
            // Only grants continue a task's trace: a finished task needs none.
            record.trace = None;
            let ws = self.waiters.remove(task).unwrap_or_default();
            // A step's end is reported by its workflow.
            if !ws.is_empty() || parent.is_some() {
                record.reported = true;
            }
            ws
        } else {
            Vec::new()
        };
        self.usage.reweigh(record, weight);
        tracing::info!(task = %task, attempt = %life.attempt, epoch = %life.epoch, from = %before, to = %after, "task transition");
        fx.push(Effect::Persist(Box::new(record.clone())));
        let ended = after.is_terminal() && !before.is_terminal();
        // A snapshot only for a notice or a waiter: most transitions need none.
        let notify = ended && parent.is_none();
        let snapshot = match notify || !waiters.is_empty() {
            true => self.tasks.get(task).map(|r| self.snapshot_of(r)),
            false => None,
        };
        if let (true, Some(workflow)) = (ended, parent) {
            self.workflows_due.insert(workflow);
        }
        if let (true, Some(s)) = (notify, &snapshot) {
            fx.push(Effect::Notify(Box::new(Notice::Ended(Box::new(s.clone())))));
        }
        if let Some(snapshot) = &snapshot {
            for w in waiters {
                let reply = Ok(ApiResponse::Waited { finished: true, snapshot: snapshot.clone() });
                fx.push(Effect::Reply { to: w.to, reply });
            }
        }
        if before != after {
            self.index(task, Some(before), after);
            if !after.is_on_worker() {
                self.sent.remove(task);
                self.unlisted.remove(task);
                self.doubted.remove(task);
            }
            if after.is_terminal() {
                self.not_before.remove(task);
            }
        }
        Some(decision)
    }

    fn index(&mut self, task: &TaskId, before: Option<Status>, after: Status) {
        if let Some(before) = before {
            match before {
                Status::Queued => {
                    self.queue.remove(&(task.number(), task.clone()));
                }
                s if s.is_on_worker() => {
                    self.on_worker.remove(task);
                    self.confirmed.remove(task);
                }
                Status::Unknown => {
                    self.unknown.remove(task);
                }
                _ => {}
            }
        }
        match after {
            Status::Queued => {
                self.queue.insert((task.number(), task.clone()));
            }
            // A workflow holds no slot: its steps do.
            s if s.is_on_worker() && *task.kind() != Kind::workflow() => {
                self.on_worker.insert(task.clone());
            }
            Status::Unknown => {
                self.unknown.insert(task.clone());
            }
            _ => {}
        }
    }
}

#[path = "board.rs"]
mod board;
#[path = "epochs.rs"]
mod epochs;
#[path = "liveness.rs"]
mod liveness;
#[path = "presence.rs"]
mod presence;
#[path = "workflow.rs"]
mod workflow;

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
