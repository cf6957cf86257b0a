//! Worker loss, decided on evidence: when a worker stops heartbeating, the
//! leader asks that machine's sidecar what became of each attempt the worker
//! held before changing anything; only a machine that cannot be reached at all
//! makes its tasks `unknown` (or, when idempotent, queued again). A worker that
//! comes back holding attempts the registry moved past is told to stop them.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use tenure_protocol::messages::{
    AttemptEvidence, EvidenceReply, EvidenceRequest, HeldAttempt, KillCommand, SidecarRefusal, WorkerCommand,
};
use tenure_protocol::resume::LossWitness;
use tenure_protocol::{Attempt, Event, HintTag, RecoveryHint, Status, TaskId, WorkerId};

use super::{Core, Effect, Now};

/// Heartbeats in a row that may omit a started attempt before its machine is doubted.
const UNLISTED_BEATS: u32 = 3;

/// Tasks whose machine's evidence is (or may be) wanted.
#[derive(Debug, Default)]
pub(super) struct Doubts {
    /// Tasks `unknown` (their machine's evidence may still settle them).
    unknown: BTreeSet<TaskId>,
    /// When the sidecar of a lost worker was last asked about a task.
    asked: HashMap<TaskId, Duration>,
    /// Started tasks whose live worker has not listed their attempt, by how
    /// many heartbeats in a row.
    unlisted: HashMap<TaskId, u32>,
    /// Tasks whose machine is doubted (its store was replaced, or it stopped
    /// listing them): their evidence is asked for although the worker lives.
    doubted: HashSet<TaskId>,
}

impl Doubts {
    /// Keeps the `unknown` index in step with a status change.
    pub(super) fn index(&mut self, task: &TaskId, before: Option<Status>, after: Status) {
        if before == Some(Status::Unknown) {
            self.unknown.remove(task);
        }
        if after == Status::Unknown {
            self.unknown.insert(task.clone());
        }
    }

    /// Doubts the machine of `task`; whether it was not doubted yet.
    pub(super) fn doubt(&mut self, task: &TaskId) -> bool {
        self.doubted.insert(task.clone())
    }

    fn asked_within(&self, task: &TaskId, now: Now, within: Duration) -> bool {
        self.asked.get(task).is_some_and(|at| now.mono.saturating_sub(*at) < within)
    }

    /// Another heartbeat of a live worker that did not list `task`; how many in a row.
    fn missed(&mut self, task: &TaskId) -> u32 {
        let misses = self.unlisted.entry(task.clone()).or_insert(0);
        *misses = misses.saturating_add(1);
        *misses
    }

    /// The machine's evidence settled `task`: nothing more is asked.
    fn settled(&mut self, task: &TaskId) {
        self.asked.remove(task);
        self.doubted.remove(task);
        self.unlisted.remove(task);
    }

    /// `task` left its worker: its listing no longer matters.
    pub(super) fn off_worker(&mut self, task: &TaskId) {
        self.unlisted.remove(task);
        self.doubted.remove(task);
    }

    /// Drops `task` entirely (its record is gone from memory).
    pub(super) fn forget(&mut self, task: &TaskId) {
        self.unknown.remove(task);
        self.settled(task);
    }
}

impl Core {
    /// Asks the sidecars of lost workers about every attempt they still hold —
    /// at once for a newly lost worker, then again every worker TTL while the
    /// task stays on it (a shim that keeps running the task keeps it there).
    /// Tasks made `unknown` because the machine could not be reached at all
    /// are asked about every worker TTL too, until an answer settles them: a
    /// lost answer must not leave a task unknown for good when its machine is
    /// back (its worker reports only attempts it still holds, and an attempt
    /// the query revoked is held nowhere).
    pub(super) fn ask_about_lost_workers(&mut self, now: Now, fx: &mut Vec<Effect>) {
        let due: Vec<(TaskId, WorkerId, EvidenceRequest)> = self
            .dispatch
            .on_worker()
            .chain(self.doubts.unknown.iter())
            .filter_map(|t| {
                let r = self.tasks.get(t)?;
                let worker = r.life.worker.clone()?;
                let lost = self.workers.lost(&worker) || self.doubts.doubted.contains(t) || unreached(&r.life);
                let asked_recently = self.doubts.asked_within(t, now, self.cfg.worker_ttl);
                (lost && !asked_recently).then(|| {
                    let request = EvidenceRequest {
                        task: t.clone(),
                        attempt: r.life.attempt,
                        epoch: self.epoch,
                        incarnation: r.incarnation.as_deref().copied(),
                    };
                    (t.clone(), worker, request)
                })
            })
            .collect();
        for (task, worker, request) in due {
            self.doubts.asked.insert(task, now.mono);
            fx.push(Effect::AskEvidence { worker, request });
        }
    }

    /// Settles an attempt of a lost worker from its sidecar's answer.
    pub(super) fn evidence(
        &mut self,
        worker: WorkerId,
        request: EvidenceRequest,
        result: Result<EvidenceReply, String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let (task, attempt, epoch) = (request.task, request.attempt, request.epoch);
        let Some(life) = self.tasks.get(&task).map(|r| &r.life) else { return };
        let still_there = life.worker.as_ref() == Some(&worker) && life.attempt == attempt;
        let unreached = unreached(life);
        let worker_alive = self.workers.alive(&worker);
        if !still_there || (worker_alive && !self.doubts.doubted.contains(&task) && !unreached) {
            return;
        }
        // Still no answer about a task already unknown for want of one: it
        // waits for the next query.
        if unreached && result.is_err() {
            return;
        }
        let lost = |message: String, tag| Event::Lost { attempt, epoch, hint: RecoveryHint { tag, message } };
        let event = match result {
            Err(error) => {
                tracing::warn!(%worker, task = %task, %attempt, %error, "the lost worker's sidecar is unreachable too");
                Event::WorkerLost { worker: worker.clone() }
            }
            // A machine that has seen a higher epoch answers nothing of ours.
            // Its claim is checked against the registry first (a real newer
            // leader deposes this one) and the attempt asked about again; once
            // the registry showed the claim unfounded, the machine is as good
            // as unreachable.
            Ok(Err(SidecarRefusal::StaleEpoch { held, .. })) if held > self.epoch && !self.refuted(held) => {
                self.epoch_claimed(held, format!("the sidecar of {worker}"), now, fx);
                return;
            }
            Ok(Err(refusal)) => {
                tracing::warn!(%worker, task = %task, %attempt, %refusal, "the lost worker's sidecar refused the query");
                Event::WorkerLost { worker: worker.clone() }
            }
            Ok(Ok(evidence)) => {
                tracing::info!(%worker, task = %task, %attempt, ?evidence, "evidence from the lost worker's sidecar");
                match evidence {
                    AttemptEvidence::NeverStarted => Event::Refused { attempt, epoch },
                    AttemptEvidence::Exited(outcome) => Event::Finished { attempt, epoch, outcome },
                    // Its shim still runs it: only the worker process is gone.
                    AttemptEvidence::Running => return,
                    AttemptEvidence::NoEvidence => lost(
                        format!(
                            "worker {worker} was lost; its machine recorded the intent of attempt {attempt} but \
                             has neither a process nor an exit status: the task may have run"
                        ),
                        HintTag::MaybeRan,
                    ),
                    AttemptEvidence::MachineRestarted => lost(
                        format!(
                            "the machine of worker {worker} restarted (a power loss or a reboot) while attempt \
                             {attempt} ran: its process died with the machine and no exit status survived; the \
                             task may have run, and it is not run again. Check for its effects, then settle or \
                             resubmit it"
                        ),
                        HintTag::MachineRestarted,
                    ),
                    AttemptEvidence::Unreadable(reason) => lost(
                        format!("worker {worker} was lost and its record of attempt {attempt} is unreadable: {reason}"),
                        HintTag::SidecarCorrupt,
                    ),
                    // A rebuilt machine proves a resumable task's process gone
                    // only once its worker heartbeats the new boot, and its
                    // sidecar may answer first: such a task is asked about
                    // again (each TTL) rather than settled unproven.
                    AttemptEvidence::Replaced { .. } if !worker_alive && self.awaits_new_boot(&task, &worker) => {
                        return;
                    }
                    AttemptEvidence::Replaced { incarnation } => lost(
                        format!(
                            "the machine of worker {worker} no longer has the store attempt {attempt} was granted to \
                             (its data directory was wiped or replaced; now {incarnation}): the task may have run, \
                             and it is not run again. Check the machine for its effects, then settle or resubmit it"
                        ),
                        HintTag::MachineReplaced,
                    ),
                }
            }
        };
        self.doubts.settled(&task);
        match event {
            Event::Lost { attempt, epoch, hint } => {
                self.attempt_lost(&task, (attempt, epoch), hint, LossWitness::Sidecar, now, fx);
            }
            event => {
                self.event(&task, event, now, fx);
            }
        }
    }

    /// Heartbeats of a live worker, checked against the registry: a started
    /// attempt placed on it that it has not listed for [`UNLISTED_BEATS`]
    /// heartbeats in a row, or whose machine now has another store than the
    /// one it was granted to, is doubted — its evidence is asked for at once
    /// and settles it (a wiped machine would otherwise keep it `running`
    /// forever, and never say what became of it).
    pub(super) fn check_listed(
        &mut self,
        worker: &WorkerId,
        incarnation: Option<uuid::Uuid>,
        held: &[HeldAttempt],
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let listed: std::collections::HashSet<(&TaskId, Attempt)> = held.iter().map(|h| (&h.task, h.attempt)).collect();
        // (task, its machine's store was replaced, the worker holds it as far as we can tell)
        let placed: Vec<(TaskId, bool, bool)> = self
            .dispatch
            .on_worker()
            .filter_map(|t| {
                let r = self.tasks.get(t).filter(|r| r.life.worker.as_ref() == Some(worker))?;
                let replaced = matches!((r.incarnation.as_deref(), incarnation), (Some(a), Some(b)) if *a != b);
                let started = matches!(r.life.status, Status::Running | Status::Stopping | Status::Paused);
                Some((t.clone(), replaced, listed.contains(&(t, r.life.attempt)) || !started))
            })
            .collect();
        for (task, replaced, held_there) in placed {
            if held_there && !replaced {
                self.doubts.unlisted.remove(&task);
                continue;
            }
            let misses = self.doubts.missed(&task);
            if (replaced || misses >= UNLISTED_BEATS) && self.doubts.doubt(&task) {
                tracing::warn!(%worker, task = %task, replaced, "a live worker's machine does not hold a task placed on it: asking its evidence");
            }
        }
        if !self.doubts.doubted.is_empty() {
            self.ask_about_lost_workers(now, fx);
        }
    }

    /// A worker that comes back may still run attempts the registry has moved
    /// past (an idempotent task re-run elsewhere, a task settled meanwhile): its
    /// lease on them is gone, so it is told to stop them — at every heartbeat
    /// that still lists them (kills are idempotent).
    pub(super) fn stop_stale_copies(&mut self, worker: &WorkerId, held: &[HeldAttempt], fx: &mut Vec<Effect>) {
        for h in held {
            let Some(r) = self.tasks.get(&h.task) else { continue };
            // The current attempt (even if already terminal: the worker is still
            // finishing its report) is the worker's to keep.
            if r.life.attempt == h.attempt && r.life.worker.as_ref() == Some(worker) {
                self.dispatch.confirm(&h.task);
                continue;
            }
            tracing::info!(%worker, task = %h.task, attempt = %h.attempt, current = %r.life.attempt, "stopping a stale copy");
            let kill = KillCommand { task: h.task.clone(), attempt: h.attempt, epoch: self.epoch };
            let Some(instance) = self.workers.instance_of(worker) else { continue };
            let command = WorkerCommand::Kill(kill);
            fx.push(Effect::Command { worker: worker.clone(), instance, command, trace: None });
        }
    }
}

/// An `unknown` task whose machine could not be reached at all: no evidence
/// was had, so an answer from the machine may still settle it.
fn unreached(life: &tenure_protocol::Lifecycle) -> bool {
    life.status == Status::Unknown && life.hint.as_ref().is_some_and(|h| h.tag == HintTag::WorkerUnreachable)
}
