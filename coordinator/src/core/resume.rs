//! Resuming agents in the core (the rules are `tenure_protocol::resume`'s):
//! values captured from an `agent` task's matched output lines, what a lost
//! attempt becomes (resumed, or `unknown` as before), the machine a resumed
//! attempt may be placed on, the command and input its grant carries, and
//! input kept while no attempt runs.
//!
//! Everything it decides is stored in the task's record with the change that
//! needs it, so a new leader continues exactly: the captured values, the
//! resume count, the pinned machine, the kept input.
//!
//! It must never resume an attempt whose process is not proven gone
//! (`resume::proves_gone`), never resume a task with a kill requested, and
//! never hand kept input to more than one attempt.

use tenure_protocol::messages::{ApiError, ApiResponse, MatchedLine};
use tenure_protocol::resume::{self, LossWitness, ResumeState, ResumeVerdict};
use tenure_protocol::{Attempt, Decision, Epoch, Event, Lifecycle, RecoveryHint, SessionId, Status, TaskId, WorkerId};

use super::retry::Ended;
use super::{Core, Effect, Now, Version};
use crate::record::TaskRecord;

impl Core {
    /// An attempt of `task` proven lost by `witness` (its worker, or its
    /// machine's sidecar): resumed when the task declares how and the loss
    /// proves its process gone; otherwise the plain `Lost` event, with the
    /// hint saying why a resumable task was not resumed.
    pub(super) fn attempt_lost(
        &mut self,
        task: &TaskId,
        (attempt, epoch): (Attempt, Epoch),
        mut hint: RecoveryHint,
        witness: LossWitness,
        now: Now,
        fx: &mut Vec<Effect>,
    ) -> Option<Decision> {
        let verdict = self.tasks.get(task).and_then(|r| {
            let spec = r.spec.resume.as_deref()?;
            let state = r.resume().cloned().unwrap_or_default();
            let worker = r.life.worker.as_ref()?;
            let boot_now = self.workers.boot_of(worker);
            let gone = resume::proves_gone(witness, hint.tag, state.granted_boot.as_deref(), boot_now);
            let current = r.life.attempt == attempt && !r.life.status.is_terminal();
            current.then(|| resume::decide(spec, gone, r.life.kill_requested, state.resumes, &state.captured))
        });
        match verdict {
            Some(ResumeVerdict::Resume) => {
                let values = self.tasks.get(task).and_then(TaskRecord::resume).map(|s| s.captured.clone());
                let ended =
                    Ended::resumed(format!("{}: {}", hint.tag.as_str(), hint.message), values.unwrap_or_default());
                self.event_noting(task, Event::Resume { attempt, epoch }, Some(ended), now, fx)
            }
            Some(ResumeVerdict::Stays(why)) => {
                hint.message = format!("{} Not resumed: {why}.", hint.message);
                self.event(task, Event::Lost { attempt, epoch, hint }, now, fx)
            }
            None => self.event(task, Event::Lost { attempt, epoch, hint }, now, fx),
        }
    }

    /// Whether `task` declares a resume and `worker`'s machine has not yet
    /// heartbeated a boot other than the one its attempt was granted under
    /// (the proof a replaced store needs).
    pub(super) fn awaits_new_boot(&self, task: &TaskId, worker: &WorkerId) -> bool {
        let Some(r) = self.tasks.get(task) else { return false };
        if r.spec.resume.is_none() {
            return false;
        }
        let granted = r.resume().and_then(|s| s.granted_boot.as_deref());
        let now = self.workers.boot_of(worker);
        now.is_none() || now == granted
    }

    /// Takes the values `lines` of an `agent` task give its capture patterns
    /// (lines at or below the recorded offset are repeats); persists the
    /// record when a value changed.
    pub(super) fn captured(&mut self, task: &TaskId, lines: &[MatchedLine], fx: &mut Vec<Effect>) {
        let Some(r) = self.tasks.get_mut(task) else { return };
        let Some(spec) = r.spec.resume.as_deref() else { return };
        let through = r.matched_through;
        let mut fresh: Vec<&MatchedLine> = lines.iter().filter(|l| l.offset >= through && through < u64::MAX).collect();
        fresh.sort_by_key(|l| l.offset);
        let Some(last) = fresh.last().map(|l| l.offset) else { return };
        let capturer = spec.capturer();
        let values: Vec<(String, String)> = fresh.iter().flat_map(|l| capturer.capture(&l.text)).collect();
        let state = r.resume_mut();
        for (name, value) in values {
            tracing::info!(task = %task, name = %name, "captured a value for the resume command");
            state.captured.insert(name, value);
        }
        r.matched_through = last.saturating_add(1);
        fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
    }

    /// Whether `worker` may take `r`'s next attempt: anywhere, unless the
    /// task resumes only on the machine that lost it.
    pub(super) fn resumes_on(r: &TaskRecord, worker: &WorkerId) -> bool {
        r.resume().and_then(|s| s.machine.as_ref()).is_none_or(|m| m == worker)
    }

    /// What the current attempt's grant carries: the task's spec — with its
    /// resume command as the command, once it was resumed — and the input
    /// kept for it. `None` (nothing is sent) should the command not fill,
    /// which cannot happen (values are only ever added): the original
    /// command is never run again in its place.
    pub(super) fn granted_spec(r: &TaskRecord) -> Option<(tenure_protocol::TaskSpec, Vec<String>)> {
        let state = r.resume().filter(|s| s.resumes > 0);
        let (Some(resume), Some(state)) = (r.spec.resume.as_deref(), state) else {
            return Some((r.spec.clone(), Vec::new()));
        };
        let input = state.granted_input.clone();
        match resume.fill(&state.captured) {
            Ok(command) => Some((tenure_protocol::TaskSpec { command, ..r.spec.clone() }, input)),
            Err(missing) => {
                tracing::error!(task = %r.id, ?missing, "a resumed task's command does not fill: not granted");
                None
            }
        }
    }

    /// The hint of a queued task that resumes only on its machine, while
    /// that machine is not live.
    pub(super) fn awaiting_its_machine(&self, r: &TaskRecord) -> Option<RecoveryHint> {
        let machine = r.resume()?.machine.as_ref()?;
        if self.workers.alive(machine) {
            return None;
        }
        Some(RecoveryHint {
            tag: tenure_protocol::HintTag::NoMatchingWorker,
            message: format!(
                "it resumes only on {machine}, the machine that lost it (its session lives there), which is not \
                 live; it resumes when {machine} returns (submit with --resume-anywhere for sessions on shared \
                 storage), or kill it"
            ),
        })
    }

    /// Keeps one message for the next attempt of `task` (see
    /// `ApiRequest::KeepInput`).
    pub(super) fn keep_input(
        &mut self,
        session: &SessionId,
        task: &TaskId,
        message: String,
        fx: &mut Vec<Effect>,
    ) -> Result<ApiResponse, ApiError> {
        let r = self.owned(session, task)?;
        if r.spec.kind.as_str() != "agent" {
            return Err(ApiError::NoInput { task: task.to_string(), kind: r.spec.kind.to_string() });
        }
        let not_running = || ApiError::NotRunning { task: task.to_string(), status: r.life.status.to_string() };
        // Only while no attempt runs, and only for a task that a resume may
        // still bring back: `unknown` (its machine may yet prove the process
        // gone), or queued after a resume.
        let resumes = r.resume().map_or(0, |s| s.resumes);
        let waiting = match r.life.status {
            Status::Unknown => !r.life.kill_requested,
            Status::Queued => resumes > 0,
            _ => false,
        };
        if r.spec.resume.is_none() || !waiting {
            return Err(not_running());
        }
        let none = ResumeState::default();
        r.resume().unwrap_or(&none).room_for(message.len()).map_err(ApiError::InvalidRequest)?;
        let Some(r) = self.tasks.get_mut(task) else { return Err(ApiError::NotFound(task.to_string())) };
        let kept = &mut r.resume_mut().pending_input;
        kept.push(message);
        tracing::info!(task = %task, kept = kept.len(), "input kept for the resumed attempt");
        fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
        let r = self.tasks.get(task).ok_or_else(|| ApiError::NotFound(task.to_string()))?;
        Ok(ApiResponse::Snapshot(self.snapshot_of(r)))
    }
}

/// Keeps `record`'s resume state in step with `event`, which changed its
/// lifecycle from `prior` (persisted right after):
/// - a resume counts, and pins the machine that lost the attempt (unless the
///   task may resume anywhere); input handed to the lost attempt's grant is
///   not handed to another;
/// - a grant notes the machine's boot and hands it the kept input;
/// - a grant given back with nothing run returns its input to the front;
/// - a start clears the pin and the handed input (its shim wrote it before
///   the task started); input kept meanwhile for a resume that the start
///   proves will not come (the attempt lives) is dropped, never sent twice.
pub(super) fn note(record: &mut TaskRecord, prior: &Lifecycle, event: &Event, boot: Option<&str>) {
    let Some(spec) = record.spec.resume.as_deref() else { return };
    let anywhere = spec.anywhere;
    let after = record.life.status;
    let task = record.id.clone();
    let state = record.resume_mut();
    match event {
        Event::Resume { .. } => {
            state.resumes = state.resumes.saturating_add(1);
            state.machine = if anywhere { None } else { prior.worker.clone() };
            state.granted_input.clear();
            tracing::info!(task = %task, resumes = state.resumes, machine = ?state.machine, "the attempt's process is proven gone: resuming");
        }
        Event::Grant { .. } => {
            state.granted_boot = boot.map(Into::into);
            state.granted_input = std::mem::take(&mut state.pending_input);
        }
        Event::Refused { .. } if after == Status::Queued => {
            let mut back = std::mem::take(&mut state.granted_input);
            back.append(&mut state.pending_input);
            state.pending_input = back;
        }
        _ => {}
    }
    let started = matches!(after, Status::Running | Status::Paused | Status::Stopping)
        && matches!(prior.status, Status::Leased | Status::Unknown);
    if started {
        state.machine = None;
        state.granted_input.clear();
        if !state.pending_input.is_empty() {
            let dropped = state.pending_input.len();
            state.dropped_input = state.dropped_input.saturating_add(dropped as u32);
            state.pending_input.clear();
            tracing::warn!(task = %task, dropped, "the attempt the input was kept for lives: the kept input is dropped");
        }
    }
}
