//! The client API (submit, get, list, kill, wait, board moves, reads of a
//! final output) and what submits need kept: idempotency keys and task
//! numbering.
//!
//! Every reply follows, in the effects, the persist that makes it true. A
//! session sees its own tasks; an operator sees and kills every session's
//! but never waits on or reports them. Task numbers are never reused, and a
//! submit retried with its idempotency key returns the task it created.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, ApiResponse, ClusterStatus, KillResult, SubmitBatch, SubmitRequest, Submitted,
    TaskSnapshot, MAX_BATCH_TASKS, MAX_KILL_REASON_BYTES, MAX_LIST_PAGE_BYTES, MAX_WAIT_MS,
};
use tenure_protocol::{Board, Decision, Event, Kind, SessionId, Status, TaskId, TaskSpec, Unchanged};
use uuid::Uuid;

use super::waiters::Waiter;
use super::{Core, Effect, Now, Version};
use crate::record::TaskRecord;

/// Submits' idempotency keys and the task numbering.
#[derive(Debug)]
pub(super) struct Submits {
    /// Submits' idempotency keys → task number, while remembered (see
    /// `forget_old_keys`). Steps are not here: no client submitted them.
    by_key: HashMap<(SessionId, Uuid), u64>,
    /// The next task number to hand out.
    next: u64,
}

impl Default for Submits {
    fn default() -> Self {
        Submits { by_key: HashMap::new(), next: 1 }
    }
}

impl Submits {
    /// The task a submit of `session` with `key` created, while remembered.
    fn known(&self, session: &SessionId, key: Uuid) -> Option<u64> {
        self.by_key.get(&(session.clone(), key)).copied()
    }

    pub(super) fn remember(&mut self, session: SessionId, key: Uuid, task: u64) {
        self.by_key.insert((session, key), task);
    }

    pub(super) fn forget(&mut self, session: &SessionId, key: Uuid) {
        self.by_key.remove(&(session.clone(), key));
    }

    /// Keeps only the keys whose task `keep` says to remember.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        self.by_key.retain(|_, n| keep(*n));
    }

    /// Never hand out numbers at or below `n`.
    pub(super) fn reserve_through(&mut self, n: u64) {
        self.next = self.next.max(n.saturating_add(1));
    }

    /// The next task number. Numbers are never reused, so once the counter
    /// cannot step past one (`u64::MAX` itself is never handed out) nothing
    /// more can be created: refused, never wrapped.
    /// Refused unless `n` more numbers can be handed out.
    pub(super) fn check_room(&self, n: u64) -> Result<(), ApiError> {
        match self.next.checked_add(n) {
            Some(_) => Ok(()),
            None => Err(ApiError::Unavailable("task numbers are exhausted".into())),
        }
    }

    pub(super) fn allocate(&mut self) -> Result<u64, ApiError> {
        let n = self.next;
        self.next = n.checked_add(1).ok_or_else(|| ApiError::Unavailable("task numbers are exhausted".into()))?;
        Ok(n)
    }
}

/// What a batch does with one of its tasks, once all were judged.
enum Planned {
    /// Its key made this task before.
    Existing(TaskId),
    /// Created, starting after `delay` ms.
    New { delay: u64 },
}

/// Whether a listing of `session` shows `r`: its own (every session's for
/// an operator), by board — archived ones with `all`, deleted ones only to
/// an operator's `all` (their records stay for audit).
fn shown(r: &TaskRecord, session: &SessionId, all: bool, operator: bool) -> bool {
    let on_board = match r.life.board {
        Board::Active => all || !r.life.status.is_terminal() || !r.reported,
        Board::Archived => all,
        Board::Deleted => all && operator,
    };
    (&r.owner == session || operator) && on_board
}

impl Core {
    /// A client request; its reply (if anyone waits for one) follows the
    /// effects that make it true.
    pub(super) fn api(
        &mut self,
        reply_to: Option<String>,
        request: ApiRequest,
        trace: Option<String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let reply = match request {
            ApiRequest::Submit(req) => self.submit(req, trace, now, fx),
            // A wait for the task the submit names, answered as a `Wait` is.
            ApiRequest::Run { submit, timeout_ms, until } => {
                let session = submit.session.clone();
                match self.submit(submit, trace, now, fx) {
                    Ok(ApiResponse::Submitted { task, .. }) => {
                        let wait = ApiRequest::Wait { session, task, timeout_ms, until };
                        return self.api(reply_to, wait, None, now, fx);
                    }
                    other => other,
                }
            }
            ApiRequest::SubmitBatch(batch) => self.submit_batch(batch, trace, now, fx),
            ApiRequest::Get { session, task } => {
                self.visible(&session, &task).map(|r| ApiResponse::Snapshot(self.snapshot_of(r)))
            }
            ApiRequest::List { session, all } => {
                Ok(ApiResponse::List(self.listed(&session, all, 0).map(|r| self.snapshot_of(r)).collect()))
            }
            ApiRequest::ListPage { session, all, after, before } => {
                let (mut tasks, mut bytes, mut next) = (Vec::new(), 0usize, None);
                let records: Box<dyn Iterator<Item = &TaskRecord> + '_> = match before {
                    Some(before) => Box::new(self.listed_before(&session, all, before)),
                    None => Box::new(self.listed(&session, all, after.unwrap_or(0))),
                };
                for r in records {
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
            ApiRequest::Kill { session, task, reason } => self.kill(&session, &task, reason, now, fx),
            ApiRequest::Pause { session, task } => self.pause(&session, &task, true, now, fx),
            ApiRequest::Resume { session, task } => self.pause(&session, &task, false, now, fx),
            ApiRequest::Approve { session, task } => self.approve(&session, &task, now, fx),
            ApiRequest::KeepInput { session, task, message } => self.keep_input(&session, &task, message, fx),
            ApiRequest::Wait { session, task, timeout_ms, until } => match self.owned(&session, &task) {
                Err(e) => Err(e),
                Ok(r) if r.life.status.is_terminal() => {
                    self.mark_reported(&task, fx).map(|snapshot| ApiResponse::Waited { finished: true, snapshot })
                }
                Ok(r) if until.reached(r.life.status) => {
                    Ok(ApiResponse::Waited { finished: false, snapshot: self.snapshot_of(r) })
                }
                Ok(_) => {
                    if let Some(to) = reply_to {
                        let deadline = now.mono + Duration::from_millis(timeout_ms.min(MAX_WAIT_MS));
                        self.waiters.add(task, Waiter { to, session, deadline, until });
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
        self.tasks.after(after).filter(move |r| shown(r, session, all, operator))
    }

    /// The tasks a `List` of `session` shows (as [`Core::listed`]), numbered
    /// below `before`, newest (highest number) first.
    fn listed_before<'a>(
        &'a self,
        session: &'a SessionId,
        all: bool,
        before: u64,
    ) -> impl Iterator<Item = &'a TaskRecord> + 'a {
        let operator = self.is_operator(session);
        self.tasks.before(before).filter(move |r| shown(r, session, all, operator))
    }

    /// Kinds a submit may name: the builtin ones and those advertised by the
    /// workers this leader knows (alive now, or lost but not forgotten). A kind
    /// no worker runs any more is refused rather than queued forever.
    fn known_kinds(&self) -> BTreeSet<Kind> {
        let mut kinds: BTreeSet<Kind> = self.cfg.builtin_kinds.iter().cloned().collect();
        // The leader runs workflows itself.
        kinds.insert(Kind::workflow());
        kinds.extend(self.workers.kinds().cloned());
        kinds
    }

    /// Whether `session` acts for an identity with the operator role.
    pub(super) fn is_operator(&self, session: &SessionId) -> bool {
        self.cfg.operators.iter().any(|o| o == session.identity())
    }

    /// The task if `session` owns it or holds the operator role.
    pub(super) fn visible(&self, session: &SessionId, task: &TaskId) -> Result<&TaskRecord, ApiError> {
        match self.tasks.get(task) {
            Some(r) if &r.owner == session || self.is_operator(session) => Ok(r),
            _ => Err(ApiError::NotFound(task.to_string())),
        }
    }

    pub(super) fn owned(&self, session: &SessionId, task: &TaskId) -> Result<&TaskRecord, ApiError> {
        match self.tasks.get(task) {
            Some(r) if &r.owner == session => Ok(r),
            _ => Err(ApiError::NotFound(task.to_string())),
        }
    }

    fn submit(&mut self, req: SubmitRequest, trace: Option<String>, now: Now, fx: &mut Vec<Effect>) -> ApiReply {
        if let Some(task) = self.submitted_before(&req.session, req.idempotency_key) {
            return Ok(ApiResponse::Submitted { task, existing: true });
        }
        let delay = self.admissible(&req.spec, &HashMap::new(), now)?;
        self.usage.admit(&self.cfg.limits, &req.session, &req.spec)?;
        let task = self.create(req.session, req.idempotency_key, req.spec, delay, trace, now, fx)?;
        Ok(ApiResponse::Submitted { task, existing: false })
    }

    /// A batch: every new task is judged — alone, and against the quotas,
    /// limits and concurrency keys of the tasks before it in the batch —
    /// before any is created, so a refusal changes nothing. Creating a task
    /// judged admissible cannot fail but for task numbers running out, which
    /// is checked for the whole batch first.
    fn submit_batch(&mut self, batch: SubmitBatch, trace: Option<String>, now: Now, fx: &mut Vec<Effect>) -> ApiReply {
        let SubmitBatch { session, tasks } = batch;
        if tasks.is_empty() || tasks.len() > MAX_BATCH_TASKS {
            return Err(ApiError::InvalidRequest(format!(
                "a batch holds 1 to {MAX_BATCH_TASKS} tasks, not {}",
                tasks.len()
            )));
        }
        let in_batch =
            |index: usize, error: ApiError| ApiError::InBatch { index: index as u32, error: Box::new(error) };
        let mut keys = HashSet::with_capacity(tasks.len());
        let mut trial = self.usage.clone();
        let mut limits: HashMap<Box<str>, u32> = HashMap::new();
        let mut plan = Vec::with_capacity(tasks.len());
        for (index, t) in tasks.iter().enumerate() {
            if !keys.insert(t.idempotency_key) {
                let why = format!("its idempotency key {} is also an earlier task's of the batch", t.idempotency_key);
                return Err(in_batch(index, ApiError::InvalidRequest(why)));
            }
            if let Some(task) = self.submitted_before(&session, t.idempotency_key) {
                plan.push(Planned::Existing(task));
                continue;
            }
            let delay = self.admissible(&t.spec, &limits, now).map_err(|e| in_batch(index, e))?;
            trial.admit(&self.cfg.limits, &session, &t.spec).map_err(|e| in_batch(index, e))?;
            trial.add_new(&session, &t.spec);
            if let Some(c) = super::concurrency(&t.spec) {
                if let (None, Some(limit)) = (self.limit_in_force(&c.key), c.limit) {
                    limits.entry(c.key.as_str().into()).or_insert(limit);
                }
            }
            plan.push(Planned::New { delay });
        }
        // Numbers for the new tasks and their workflows' steps.
        let new = tasks.iter().zip(&plan).filter(|(_, p)| matches!(p, Planned::New { .. }));
        let numbers = new.map(|(t, _)| 1 + t.spec.steps.len() as u64);
        self.submits.check_room(numbers.sum())?;
        let mut done = Vec::with_capacity(tasks.len());
        for (t, planned) in tasks.into_iter().zip(plan) {
            let submitted = match planned {
                Planned::Existing(task) => Submitted { task, existing: true },
                Planned::New { delay } => {
                    let task =
                        self.create(session.clone(), t.idempotency_key, t.spec, delay, trace.clone(), now, fx)?;
                    Submitted { task, existing: false }
                }
            };
            done.push(submitted);
        }
        Ok(ApiResponse::SubmittedBatch(done))
    }

    /// The task `key` of `session` created, while the key is remembered.
    fn submitted_before(&self, session: &SessionId, key: Uuid) -> Option<TaskId> {
        let n = self.submits.known(session, key)?;
        self.tasks.by_number(n).map(|r| r.id.clone())
    }

    /// Whether `spec` may be submitted now (all but the quotas, which are
    /// the caller's): a valid spec, known kinds, a valid start time, a
    /// concurrency limit that agrees with the one in force — or with
    /// `batch_limits`, the ones earlier tasks of the same batch set. Its
    /// start delay (ms) if so.
    fn admissible(&self, spec: &TaskSpec, batch_limits: &HashMap<Box<str>, u32>, now: Now) -> Result<u64, ApiError> {
        spec.validate().map_err(|e| ApiError::InvalidSpec(e.to_string()))?;
        let known = self.known_kinds();
        let kinds = std::iter::once(&spec.kind).chain(spec.steps.iter().map(|s| &s.kind));
        if let Some(unknown) = kinds.into_iter().find(|k| !known.contains(*k)) {
            // A leader that just took over has not heard every worker's kinds:
            // "unknown" is not known yet; the client retries.
            if now.mono < self.clock.started + self.cfg.worker_ttl {
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
        let delay = match spec.not_before.as_deref().copied() {
            Some(at) => at.delay_from(now.wall_ms).map_err(|e| ApiError::InvalidSpec(format!("not before: {e}")))?,
            None => 0,
        };
        self.check_concurrency(spec, batch_limits)?;
        Ok(delay)
    }

    /// Creates an admitted task: its number, its record (held for approval
    /// when the policy says so), its indexes, and the append that makes it
    /// durable (the reply waits for it).
    #[allow(clippy::too_many_arguments)]
    fn create(
        &mut self,
        session: SessionId,
        key: Uuid,
        spec: TaskSpec,
        delay: u64,
        trace: Option<String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> Result<TaskId, ApiError> {
        let n = self.submits.allocate()?;
        let id = TaskId::new(spec.kind.clone(), n).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
        let held = self.hold_at_submit(&id, &spec);
        let mut record = TaskRecord {
            trace: trace.map(String::into_boxed_str),
            attempts: super::retry::delayed_start(delay, now, self.registry_ms(now)),
            ..TaskRecord::new(id.clone(), session.clone(), key, spec, now.wall_ms)
        };
        if let Some(hint) = held {
            tracing::info!(task = %id, reason = %hint.message, "task held for approval");
            record.life = tenure_protocol::Lifecycle::held(record.life.idempotent, hint);
        }
        self.submits.remember(session, key, id.number());
        self.index(&id, super::concurrency(&record.spec), record.spec.priority, None, record.life.status, None, now);
        let workflow = !record.spec.steps.is_empty() && record.life.status == Status::Queued;
        fx.push(Effect::Persist(Box::new(record.clone()), Version::First));
        self.usage.add(&record);
        self.tasks.insert(record);
        if workflow {
            self.begin_workflow(&id, now, fx);
        }
        Ok(id)
    }

    /// A task's record could not be stored: drop the task from memory, so
    /// this leader acts on nothing that is not durable. A task just created
    /// never existed (its number stays used); an existing one is loaded again
    /// by the next leader from the registry's last durable version. A step
    /// that could not be stored ends its workflow `failed` (it is never
    /// created again, so nothing loops).
    pub(super) fn persist_failed(&mut self, task: &TaskId, reason: &str, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.remove(task) else { return };
        tracing::error!(task = %task, %reason, "task record not stored; the task is dropped from this leader's memory");
        self.usage.remove(&r);
        if r.parent.is_none() {
            self.submits.forget(&r.owner, r.idempotency_key);
        }
        if let Some(of) = &r.parent {
            self.workflows.forget_step(of);
            let detail = format!("step {} ({task}) could not be stored: {reason}", of.index + 1);
            self.end_workflow(&of.workflow, tenure_protocol::Ending::Failed, detail, now, fx);
        }
        self.dispatch.forget(task);
        self.doubts.forget(task);
        if let Some(c) = super::concurrency(&r.spec) {
            self.keys.forget(task, c);
        }
        self.cleanups.settled(task);
        self.workflows.forget(task);
        let error = ApiError::Unavailable(format!("the record of {task} could not be stored: {reason}"));
        for w in self.waiters.take(task) {
            fx.push(Effect::Reply { to: w.to, reply: Err(error.clone()) });
        }
    }

    fn kill(
        &mut self,
        session: &SessionId,
        task: &TaskId,
        reason: Option<String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> ApiReply {
        let by_owner = &self.visible(session, task)?.owner == session;
        if let Some(r) = &reason {
            if r.len() > MAX_KILL_REASON_BYTES || r.contains('\0') {
                return Err(ApiError::InvalidRequest(format!(
                    "a kill reason is at most {MAX_KILL_REASON_BYTES} bytes, without NUL ({} given)",
                    r.len()
                )));
            }
        }
        let reason = reason.map(String::into_boxed_str);
        let result = match self.event(task, Event::KillRequested { reason }, now, fx) {
            Some(Decision::Unchanged(Unchanged::Terminal)) => KillResult::AlreadyFinished,
            _ => KillResult::Requested,
        };
        let status = self.visible(session, task)?.life.status;
        if status == Status::Stopping {
            self.send_kill(task, now, fx);
        }
        if self.workflows.has_steps(task) {
            // A workflow: its current step is stopped by the advance.
            self.workflows.due(task);
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
            fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
        }
        let r = self.tasks.get(task).ok_or_else(|| ApiError::NotFound(task.to_string()))?;
        Ok(self.snapshot_of(r))
    }

    /// The cluster as this leader sees it, whole: workers, tasks by status,
    /// this leader's term and the standbys.
    fn status(&self, now: Now) -> ClusterStatus {
        let counts = self.counts();
        let load = self.load();
        let mut status = ClusterStatus {
            leader_epoch: self.epoch,
            workers: self.workers.statuses(load, now),
            tasks_by_status: counts.into_iter().collect(),
            unconfirmed: self.dispatch.unconfirmed(),
            leader: None,
            standbys: Vec::new(),
        };
        self.presence.fill(&mut status, now.mono);
        status
    }
}
