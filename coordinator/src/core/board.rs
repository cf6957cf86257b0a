//! Board moves of finished tasks (archive, unarchive, delete) and the durable
//! cleanup jobs that release their files on the worker machine.
//!
//! A job is persisted with the task before anything is sent; it is re-sent with
//! exponential backoff (1 s doubling to 60 s) until the machine's sidecar says
//! it is done; a repeated archive or delete reuses the pending job; `unarchive`
//! cancels a job that is not done yet, so no later retry destroys anything.
//! A copy already on its way when the job is cancelled may still land, so the
//! cancellation itself is sent to the machine (with the same backoff) until it
//! answers: the sidecar serves requests in order, so its answer says for
//! certain whether the files are still there. `cleaned` is the truth either way.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure_protocol::messages::{ApiError, ApiReply, ApiResponse, CleanupReply, CleanupRequest};
use tenure_protocol::{Board, Decision, Event, SessionId, TaskId, Unchanged, WorkerId};

use super::{Core, Effect, Now, Version};
use crate::record::CleanupJob;

const FIRST_RETRY: Duration = Duration::from_secs(1);
const LAST_RETRY: Duration = Duration::from_secs(60);
/// How often the garbage collector looks for expired tasks.
const GC_EVERY: Duration = Duration::from_secs(5);
/// How long after its task ended a submit's idempotency key is remembered.
pub(super) const KEEP_KEYS: Duration = Duration::from_secs(600);

/// Cleanup jobs in flight, and the garbage collector's pace.
#[derive(Debug, Default)]
pub(super) struct Cleanups {
    /// When each unsettled job was last sent, and how often: exactly the
    /// tasks with an unsettled job, so retries never scan the registry.
    tries: BTreeMap<TaskId, (Duration, u32)>,
    /// When the garbage collector last ran.
    last_gc: Option<Duration>,
}

impl Cleanups {
    /// A job the previous leader left pending: sent at the next tick.
    pub(super) fn resume(&mut self, task: &TaskId, now: Now) {
        self.tries.insert(task.clone(), (now.mono, 0));
    }

    /// The job of `task` was sent now.
    fn tried(&mut self, task: &TaskId, now: Now) {
        let tries = self.tries.entry(task.clone()).or_insert((now.mono, 0));
        *tries = (now.mono, tries.1.saturating_add(1));
    }

    /// The job of `task` is settled (or replaced, or its task gone): no retry.
    pub(super) fn settled(&mut self, task: &TaskId) {
        self.tries.remove(task);
    }

    /// The jobs whose backoff has passed (or never sent).
    fn due(&self, now: Now) -> Vec<TaskId> {
        self.tries
            .iter()
            .filter(|(_, (at, tries))| {
                let wait = FIRST_RETRY.saturating_mul(1 << (*tries).min(6)).min(LAST_RETRY);
                *tries == 0 || now.mono.saturating_sub(*at) >= wait
            })
            .map(|(task, _)| task.clone())
            .collect()
    }

    /// Whether the garbage collector runs now (at most every [`GC_EVERY`]).
    fn collect_now(&mut self, now: Now) -> bool {
        if self.last_gc.is_some_and(|at| now.mono.saturating_sub(at) < GC_EVERY) {
            return false;
        }
        self.last_gc = Some(now.mono);
        true
    }
}

impl Core {
    /// Applies a board event for the owner, then starts, reuses or cancels the
    /// task's cleanup job.
    pub(super) fn board(
        &mut self,
        session: &SessionId,
        task: &TaskId,
        event: Event,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> ApiReply {
        let (status, board) = self.owned(session, task).map(|r| (r.life.status, r.life.board))?;
        if let Some(Decision::Unchanged(Unchanged::NotApplicable)) = self.event(task, event.clone(), now, fx) {
            let why = match (&event, board) {
                (_, Board::Deleted) => format!("{task} is deleted"),
                (Event::Unarchive, _) => format!("{task} is not archived"),
                _ => format!("{task} is {status}: only a finished task can be archived or deleted"),
            };
            return Err(ApiError::InvalidRequest(why));
        }
        let Some(r) = self.tasks.get_mut(task) else { return Err(ApiError::NotFound(task.to_string())) };
        let pending = r.cleanup.filter(|j| !j.done && !j.cancelled);
        match event {
            Event::Archive | Event::Delete => self.start_cleanup(task, now, fx),
            Event::Unarchive if pending.is_some() => {
                r.cleanup = pending.map(|j| CleanupJob { cancelled: true, ..j });
                fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
                self.cleanups.settled(task);
                tracing::info!(task = %task, "unarchived: its pending cleanup job is cancelled");
                self.send_cleanup(task, now, fx);
            }
            _ => {}
        }
        // A workflow's steps move with it (each with its own cleanup job).
        for step in self.steps_of(task) {
            let _ = self.board(session, &step, event.clone(), now, fx);
        }
        self.owned(session, task).map(|r| ApiResponse::Snapshot(self.snapshot_of(r)))
    }

    /// Starts a cleanup job for a task that ran on a worker and has none going
    /// (or only a cancelled one): persisted first, then sent.
    fn start_cleanup(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get_mut(task) else { return };
        if r.life.worker.is_none() || r.cleanup.is_some_and(|j| !j.cancelled) {
            return;
        }
        let job = r.cleanup.map(|j| j.job.saturating_add(1)).unwrap_or(1);
        r.cleanup = Some(CleanupJob { job, done: false, cancelled: false, cancel_confirmed: false });
        fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
        self.cleanups.settled(task);
        self.send_cleanup(task, now, fx);
    }

    /// Garbage collection, at most every few seconds: a task finished longer
    /// than the retention ago first has its files released (a cleanup job),
    /// then its record compacted to a tombstone and dropped from memory. Only
    /// terminal tasks are ever touched; a machine that cannot be reached keeps
    /// the job pending, and the record, until it answers.
    pub(super) fn collect_garbage(&mut self, now: Now, fx: &mut Vec<Effect>) {
        if !self.cleanups.collect_now(now) {
            return;
        }
        self.forget_old_keys(now);
        let Some(retention) = self.cfg.retention else { return };
        // Registry time, not the wall clock: the end may have been stamped
        // by another leader whose clock differs from ours (see `registry_ms`).
        let Some(horizon) = self.registry_ms(now).checked_sub(retention.as_millis() as u64) else { return };
        let expired: Vec<TaskId> = self
            .tasks
            .values()
            .filter(|r| r.life.status.is_terminal() && r.ended_clock_ms != 0 && r.ended_clock_ms <= horizon)
            .map(|r| r.id.clone())
            .collect();
        for task in expired {
            let Some(r) = self.tasks.get(&task) else { continue };
            let released = r.life.worker.is_none() || r.cleanup.is_some_and(|j| j.done);
            if !released {
                self.start_cleanup(&task, now, fx);
                continue;
            }
            if let Some(r) = self.tasks.remove(&task) {
                self.usage.remove(&r);
                self.submits.forget(&r.owner, r.idempotency_key);
                self.workflows.forget(&task);
                self.waiters.take(&task);
                self.cleanups.settled(&task);
                self.doubts.forget(&task);
                tracing::info!(task = %task, "garbage-collected");
                fx.push(Effect::Forget { task, at_ms: now.wall_ms });
            }
        }
    }

    /// A submit's idempotency key is remembered until its task has been
    /// finished for [`KEEP_KEYS`] (a client retries a lost reply within
    /// seconds); past that it is only memory. The key stays in the record.
    /// Measured in registry time: a new leader whose wall clock runs ahead
    /// must not forget the key of a submit its client is retrying across the
    /// failover.
    fn forget_old_keys(&mut self, now: Now) {
        let Some(horizon) = self.registry_ms(now).checked_sub(KEEP_KEYS.as_millis() as u64) else { return };
        let tasks = &self.tasks;
        self.submits.retain(|n| {
            tasks
                .by_number(n)
                .is_some_and(|r| !r.life.status.is_terminal() || r.ended_clock_ms == 0 || r.ended_clock_ms > horizon)
        });
    }

    fn send_cleanup(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let pending =
            self.tasks.get(task).and_then(|r| Some((r.cleanup.filter(CleanupJob::unsettled)?, r.life.worker.clone()?)));
        let Some((job, worker)) = pending else {
            self.cleanups.settled(task);
            return;
        };
        self.cleanups.tried(task, now);
        let request = CleanupRequest { task: task.clone(), job: job.job, epoch: self.epoch, cancel: job.cancelled };
        fx.push(Effect::Cleanup { worker, request });
    }

    /// Re-sends unsettled jobs whose backoff has passed.
    pub(super) fn retry_cleanups(&mut self, now: Now, fx: &mut Vec<Effect>) {
        for task in self.cleanups.due(now) {
            self.send_cleanup(&task, now, fx);
        }
    }

    /// Marks a job done when its machine confirms it.
    pub(super) fn cleanup_result(
        &mut self,
        worker: WorkerId,
        request: CleanupRequest,
        result: Result<CleanupReply, String>,
        fx: &mut Vec<Effect>,
    ) {
        let task = request.task;
        match result {
            Ok(Ok(done)) => {
                let Some(r) = self.tasks.get_mut(&task) else { return };
                let Some(job) = r.cleanup.filter(|j| j.job == request.job && !j.done) else { return };
                // A job's answer, or a cancellation that found the files gone
                // (a copy of the job landed first): released. A cancellation
                // that found them: they stay, and nothing will remove them.
                let released = !request.cancel || done.files == 0;
                r.cleanup = Some(CleanupJob { done: released, cancel_confirmed: request.cancel, ..job });
                fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
                self.cleanups.settled(&task);
                match (request.cancel, released) {
                    (false, _) => {
                        tracing::info!(task = %task, %worker, files = done.files, records = done.records, "cleanup job done")
                    }
                    (true, true) => {
                        tracing::warn!(task = %task, %worker, "a copy of the cancelled cleanup job ran first: the files are released")
                    }
                    (true, false) => tracing::info!(task = %task, %worker, "cleanup job cancelled; the files stay"),
                }
            }
            Ok(Err(refusal)) => tracing::warn!(task = %task, %worker, %refusal, "cleanup job refused; will retry"),
            Err(error) => tracing::info!(task = %task, %worker, %error, "cleanup job not answered; will retry"),
        }
    }
}
