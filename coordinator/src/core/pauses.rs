//! Pause and resume: the owner's wish for a running attempt, recorded in the
//! registry (`paused` and the record's `pause_requested`, decided by the
//! lifecycle table) before the worker is told, and carried to the worker
//! until its heartbeats show it.
//!
//! It owns the API's `Pause` and `Resume` (kill's owner rules: the owner, or
//! an operator), the `PauseCommand` sent with the attempt's epoch, and the
//! reconciliation of heartbeats against the registry: an attempt whose
//! machine lists another wish than the registry's is sent the registry's
//! again, at most once per [`RESEND_EVERY`] per task. So a wish outlives a
//! lost command, a worker restart and a leader change — a new leader needs no
//! memory of what was sent before it: the heartbeats tell it.
//!
//! It must never tell a worker a wish the registry does not hold yet (the
//! command follows the `Persist` of the event in the effects), send a wish
//! for an attempt other than the task's current one, or pause a task that is
//! not running on a worker.

use std::collections::HashMap;
use std::time::Duration;

use tenure_protocol::messages::{ApiError, ApiReply, ApiResponse, HeldAttempt, PauseCommand, WorkerCommand};
use tenure_protocol::{Decision, Event, Kind, SessionId, Status, TaskId, Unchanged, WorkerId};

use super::{Core, Effect, Now};

/// A wish a heartbeat contradicts is sent again at most this often per task.
pub(super) const RESEND_EVERY: Duration = Duration::from_secs(1);

/// When each task's wish was last sent (while a heartbeat contradicts it).
#[derive(Debug, Default)]
pub(super) struct Pauses {
    sent: HashMap<TaskId, Duration>,
}

impl Core {
    /// `tenure pause` (`paused`) or `tenure resume`.
    pub(super) fn pause(
        &mut self,
        session: &SessionId,
        task: &TaskId,
        paused: bool,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> ApiReply {
        self.visible(session, task)?;
        let event = if paused { Event::PauseRequested } else { Event::ResumeRequested };
        let decision = self.event(task, event, now, fx);
        let r = self.visible(session, task)?;
        if let Some(Decision::Unchanged(Unchanged::NotApplicable | Unchanged::Terminal)) = decision {
            let status = match (r.life.worker.is_none(), r.spec.kind == Kind::workflow()) {
                (true, true) => format!("it is a {} workflow: pause its running step", r.life.status),
                _ => format!("it is {}", r.life.status),
            };
            return Err(ApiError::NotRunning { task: task.to_string(), status });
        }
        // Also on a repeat: a wish carried again is harmless.
        self.send_pause(task, now, fx);
        let r = self.visible(session, task)?;
        Ok(ApiResponse::Snapshot(self.snapshot_of(r)))
    }

    /// Sends the registry's wish for `task`'s current attempt to its worker.
    pub(super) fn send_pause(&mut self, task: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get(task) else { return };
        let paused = match r.life.status {
            Status::Paused => true,
            Status::Running => false,
            _ => return,
        };
        let Some(worker) = r.life.worker.clone() else { return };
        let cmd =
            PauseCommand { task: task.clone(), attempt: r.life.attempt, epoch: self.epoch.max(r.life.epoch), paused };
        let Some(instance) = self.workers.instance_of(&worker) else { return };
        self.pauses.sent.insert(task.clone(), now.mono);
        fx.push(Effect::Command { worker, instance, command: WorkerCommand::Pause(cmd), trace: None });
    }

    /// A heartbeat's view of the wishes against the registry's: each current
    /// attempt of `worker` listed with another wish is sent the registry's.
    pub(super) fn reconcile_pauses(&mut self, worker: &WorkerId, held: &[HeldAttempt], now: Now, fx: &mut Vec<Effect>) {
        for h in held {
            let Some(r) = self.tasks.get(&h.task) else { continue };
            let current = r.life.attempt == h.attempt && r.life.worker.as_ref() == Some(worker);
            let wish = match r.life.status {
                Status::Paused => true,
                Status::Running => false,
                _ => continue,
            };
            if !current || h.paused == wish {
                self.pauses.sent.remove(&h.task);
                continue;
            }
            let due = self.pauses.sent.get(&h.task).is_none_or(|at| now.mono.saturating_sub(*at) >= RESEND_EVERY);
            if due {
                tracing::info!(%worker, task = %h.task, attempt = %h.attempt, paused = wish, "carrying the pause wish to the worker");
                self.send_pause(&h.task, now, fx);
            }
        }
    }
}
