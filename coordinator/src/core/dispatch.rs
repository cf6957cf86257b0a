//! Dispatch: the queue, the tasks that hold a worker slot, and the grants and
//! kills in flight — which queued task goes to which worker, what is sent
//! again when unanswered, and what a worker's refusal proves.
//!
//! A grant goes only to the process a worker id is bound to, and only to the
//! store the task was granted to; a refusal gives a task back only while the
//! registry still waits for that very attempt to start. It must never grant
//! past a worker's free slots, nor take a refusal of a late copy of a grant
//! for proof that nothing ran.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use tenure_protocol::messages::{KillCommand, LeaseGrant, Refusal, WorkerCommand, WorkerReply};
use tenure_protocol::{Decision, Event, Kind, Status, TaskId, WorkerId};

use super::priority::{Cursor, QueueOrder};
use super::{Core, Effect, Now};

/// Queued tasks looked at per scheduling chunk beyond the free slots (the
/// ones that cannot start now: held back, delayed, their key full, no
/// worker for them).
const SCHEDULE_LOOKAHEAD: usize = 64;

/// Submit → running latencies kept for the metric between two reads, at most.
const MAX_LATENCIES: usize = 100_000;

/// The queue, the slot holders and what was sent to them.
#[derive(Debug, Default)]
pub(super) struct Dispatch {
    /// Queued tasks in dispatch order.
    pub(super) order: QueueOrder,
    /// Tasks that hold a worker slot (leased, running, stopping), with the
    /// worker each holds it on.
    on_worker: BTreeMap<TaskId, Option<WorkerId>>,
    /// How many of `on_worker` each worker holds, kept with it: scheduling
    /// reads it at every input, whatever the number of running tasks.
    load: HashMap<WorkerId, u32>,
    /// Tasks of `on_worker` whose worker listed their current attempt in a
    /// heartbeat to this leader since they last changed status: adopted, as
    /// far as this leader can see. Only for the status view.
    confirmed: HashSet<TaskId>,
    /// Running `agent` tasks whose worker's last heartbeat said a process of
    /// theirs is blocked reading its input: shown `waiting`, never stored.
    waiting: HashSet<TaskId>,
    /// When a grant or kill was last sent for a task.
    sent: HashMap<TaskId, Duration>,
    /// A task given back by a refusal is not granted again before this time, so a
    /// worker that keeps refusing (sidecar down, full) is not hammered.
    not_before: HashMap<TaskId, Duration>,
    /// Submit → running of tasks that started since the driver last took them
    /// (wall-clock milliseconds, for the dispatch-latency metric).
    latencies: Vec<u64>,
}

impl Dispatch {
    /// Keeps the queue and the slot holders in step with a status change at
    /// `at` (the queue counts a task's age from when it entered it, on this
    /// leader's clock; a new leader counts from its takeover). `worker` is
    /// the one a slot holder holds its slot on.
    pub(super) fn index(
        &mut self,
        task: &TaskId,
        priority: i32,
        before: Option<Status>,
        after: Status,
        worker: Option<&WorkerId>,
        at: Duration,
    ) {
        match before {
            Some(Status::Queued) => self.order.remove(task),
            Some(s) if s.is_on_worker() => {
                self.release_slot(task);
                self.confirmed.remove(task);
                self.waiting.remove(task);
            }
            _ => {}
        }
        match after {
            Status::Queued => self.order.insert(task, priority, at),
            // A workflow holds no slot: its steps do.
            s if s.is_on_worker() && *task.kind() != Kind::workflow() => {
                if let Some(w) = worker {
                    *self.load.entry(w.clone()).or_insert(0) += 1;
                }
                self.on_worker.insert(task.clone(), worker.cloned());
            }
            _ => {}
        }
    }

    pub(super) fn nothing_queued(&self) -> bool {
        self.order.is_empty()
    }

    /// `task` no longer holds a slot (if it held one).
    fn release_slot(&mut self, task: &TaskId) {
        if let Some(Some(w)) = self.on_worker.remove(task) {
            if let Some(n) = self.load.get_mut(&w) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.load.remove(&w);
                }
            }
        }
    }

    /// The tasks that hold a worker slot, in task order.
    pub(super) fn on_worker(&self) -> impl Iterator<Item = &TaskId> {
        self.on_worker.keys()
    }

    /// How many slots each worker's tasks hold.
    pub(super) fn load(&self) -> &HashMap<WorkerId, u32> {
        &self.load
    }

    /// Its worker listed the current attempt of `task` (a slot holder).
    pub(super) fn confirm(&mut self, task: &TaskId) {
        if self.on_worker.contains_key(task) {
            self.confirmed.insert(task.clone());
        }
    }

    /// Slot holders whose worker has not listed them to this leader.
    pub(super) fn unconfirmed(&self) -> u64 {
        self.on_worker.keys().filter(|t| !self.confirmed.contains(*t)).count() as u64
    }

    /// A grant or kill of `task` was sent now.
    pub(super) fn sent(&mut self, task: &TaskId, now: Now) {
        self.sent.insert(task.clone(), now.mono);
    }

    /// Whether nothing was sent for `task` within `retry`.
    pub(super) fn unanswered_for(&self, task: &TaskId, now: Now, retry: Duration) -> bool {
        self.sent.get(task).is_none_or(|at| now.mono.saturating_sub(*at) >= retry)
    }

    /// `task` is not granted again before `until`.
    pub(super) fn hold_back(&mut self, task: &TaskId, until: Duration) {
        self.not_before.insert(task.clone(), until);
    }

    /// Whether `task` is still held back; a hold that passed is dropped.
    pub(super) fn held_back(&mut self, task: &TaskId, now: Now) -> bool {
        if self.not_before.get(task).is_some_and(|t| *t > now.mono) {
            return true;
        }
        self.not_before.remove(task);
        false
    }

    /// `task` left its worker: nothing of it is in flight any more.
    pub(super) fn off_worker(&mut self, task: &TaskId) {
        self.sent.remove(task);
    }

    /// `task` ended: it is never granted again.
    pub(super) fn ended(&mut self, task: &TaskId) {
        self.not_before.remove(task);
    }

    /// A task was dispatched `ms` after its submit (kept for the metric, up
    /// to a bound between two reads).
    pub(super) fn dispatched(&mut self, ms: u64) {
        if self.latencies.len() < MAX_LATENCIES {
            self.latencies.push(ms);
        }
    }

    pub(super) fn take_latencies(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.latencies)
    }

    /// Drops `task` from every index (its record is gone from memory).
    pub(super) fn forget(&mut self, task: &TaskId) {
        self.order.remove(task);
        self.on_worker.remove(task);
        self.confirmed.remove(task);
        self.waiting.remove(task);
        self.sent.remove(task);
        self.not_before.remove(task);
    }

    /// Whether `task`'s worker says it waits for input.
    pub(super) fn is_waiting(&self, task: &TaskId) -> bool {
        self.waiting.contains(task)
    }

    /// What `task`'s worker's heartbeat says of its input.
    pub(super) fn set_waiting(&mut self, task: &TaskId, waiting: bool) {
        match waiting {
            true => self.waiting.insert(task.clone()),
            false => self.waiting.remove(task),
        };
    }
}

impl Core {
    /// The slots each worker's tasks hold, as kept with the status index.
    /// Debug builds (every test) check it against the records each time.
    pub(super) fn load(&self) -> &HashMap<WorkerId, u32> {
        #[cfg(debug_assertions)]
        {
            let mut counted = HashMap::new();
            for t in self.dispatch.on_worker() {
                if let Some(w) = self.tasks.get(t).and_then(|r| r.life.worker.clone()) {
                    *counted.entry(w).or_insert(0) += 1;
                }
            }
            assert_eq!(&counted, self.dispatch.load(), "the kept worker load drifted from the records");
        }
        self.dispatch.load()
    }

    /// Grants queued tasks, in dispatch order (priority, then submission;
    /// see `priority.rs`), to the live worker with the most free slots that
    /// runs their kind.
    pub(super) fn schedule(&mut self, now: Now, fx: &mut Vec<Effect>) {
        if self.dispatch.nothing_queued() {
            return;
        }
        let mut free = self.workers.free_slots(self.load(), now);
        if free.is_empty() {
            return;
        }
        self.age_queue(now);
        // In chunks, so that a long queue costs only the tasks looked at.
        let mut cursor = Cursor::START;
        let chunk = free.values().sum::<u32>() as usize + SCHEDULE_LOOKAHEAD;
        while !free.is_empty() && cursor != Cursor::End {
            for task in self.dispatch.order.next(&mut cursor, chunk) {
                if free.is_empty() {
                    break;
                }
                if self.dispatch.held_back(&task, now) || self.waiting_for_its_time(&task, now) {
                    continue;
                }
                let Some(r) = self.tasks.get(&task) else { continue };
                if !self.key_has_room(r) {
                    continue;
                }
                let best = free
                    .iter()
                    .filter(|(w, _)| {
                        self.workers.runs(w, &r.spec.kind) && self.workers.admits(w, &r.spec) && Core::resumes_on(r, w)
                    })
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
    }

    pub(super) fn send_grant(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get(task) else { return };
        let Some(worker) = r.life.worker.clone() else { return };
        // Sent only to the store it was granted to, as the machine's latest
        // heartbeat names it: another store (a wiped machine, or one not yet
        // known) may face an attempt that ran before. Its evidence settles it.
        let current = self.workers.incarnation_of(&worker);
        if r.incarnation.as_deref().is_some_and(|a| current != Some(*a)) {
            return;
        }
        let Some((spec, input)) = Core::granted_spec(r) else { return };
        let grant = LeaseGrant {
            task: task.clone(),
            attempt: r.life.attempt,
            epoch: r.life.epoch,
            owner: r.owner.clone(),
            spec,
            // Filled in by the driver when it sends the grant.
            mark: None,
            input,
        };
        // Sent only to a bound process; until one heartbeats, the retry sends it.
        let Some(instance) = self.workers.instance_of(&worker) else { return };
        let trace = r.trace.as_deref().map(str::to_owned);
        self.dispatch.sent(task, now);
        fx.push(Effect::Command { worker, instance, command: WorkerCommand::Grant(grant), trace });
    }

    pub(super) fn send_kill(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get(task) else { return };
        let Some(worker) = r.life.worker.clone() else { return };
        let kill = KillCommand { task: task.clone(), attempt: r.life.attempt, epoch: self.epoch.max(r.life.epoch) };
        let Some(instance) = self.workers.instance_of(&worker) else { return };
        self.dispatch.sent(task, now);
        fx.push(Effect::Command { worker, instance, command: WorkerCommand::Kill(kill), trace: None });
    }

    /// Re-sends the grants and kills of live workers left unanswered for
    /// their retry time.
    pub(super) fn resend_unanswered(&mut self, now: Now, fx: &mut Vec<Effect>) {
        let resend: Vec<(TaskId, Status)> = self
            .dispatch
            .on_worker()
            .filter_map(|t| {
                let r = self.tasks.get(t)?;
                let retry = match r.life.status {
                    Status::Leased => self.cfg.grant_retry,
                    Status::Stopping => self.cfg.kill_retry,
                    _ => return None,
                };
                let alive = r.life.worker.as_ref().is_some_and(|w| self.workers.alive(w));
                let due = self.dispatch.unanswered_for(t, now, retry);
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

    /// A worker's answer to a grant or kill (or the transport failure).
    pub(super) fn command_result(
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
            // A wish not taken is carried again while heartbeats contradict it.
            WorkerCommand::Pause(p) => {
                if let Ok(WorkerReply::Refused(reason)) = &result {
                    tracing::info!(%worker, task = %p.task, attempt = %p.attempt, %reason, "pause wish refused");
                }
                return;
            }
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
                        self.workers.claims_epoch(&worker, *held);
                        self.epoch_claimed(*held, format!("worker {worker}"), now, fx);
                    }
                }
                tracing::info!(%worker, task = %task, %attempt, %reason, kill = is_kill, "worker refused");
                if let Refusal::UnsupportedKind(kind) = &reason {
                    if let Ok(kind) = kind.parse::<Kind>() {
                        self.workers.no_longer_runs(&worker, &kind);
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
                    self.doubts.doubt(&task);
                    self.ask_about_lost_workers(now, fx);
                    return;
                }
                let never_held = !is_kill || reason == Refusal::UnknownAttempt;
                if never_held && waiting {
                    self.event(&task, Event::Refused { attempt, epoch }, now, fx);
                    let pause = now.mono + self.cfg.grant_retry / 2;
                    // A worker without a free slot yet (it releases one only
                    // once its last report was acknowledged) is paused, not
                    // the task: the task keeps its place in the dispatch
                    // order, and no lower-priority task overtakes it.
                    if !is_kill && reason == Refusal::NoSlot {
                        self.workers.full_until(&worker, pause);
                    } else {
                        self.dispatch.hold_back(&task, pause);
                    }
                }
            }
        }
    }
}
