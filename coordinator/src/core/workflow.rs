//! Workflows: an ordered list of steps, each run as a child task with its own
//! id, driven by the leader itself (no worker ever holds a workflow).
//!
//! The workflow's progress is never stored apart from its children: each child
//! record names its workflow and step ([`StepOf`]), so a new leader rebuilds
//! the step list from the registry and resumes with [`Core::advance`], which
//! looks only at durable facts. That makes every crash window safe: a step is
//! created only after the previous one is terminal in the registry, and a
//! repeated advance creates nothing twice (the next step exists, or the
//! workflow is terminal).
//!
//! Rules: the workflow fails fast (the first step that does not complete ends
//! it `failed`, later steps never begin); a kill stops the current step and
//! ends the workflow `killed`; the last step completing completes it. The
//! workflow's notice stands for its steps: a step that ends is `reported` with
//! it and raises no notice of its own.
//!
//! A workflow's `--timeout` covers its steps: its deadline (registry time) is
//! stored when its steps begin; each step is created with what is left of it
//! as its own timeout (so its machine ends it on time even while no leader
//! answers); once the deadline passed, a step still running is stopped, no
//! further step begins, and the workflow fails `timed-out`.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use tenure_protocol::messages::{StepView, TaskSnapshot};
use tenure_protocol::{Ending, Event, HintTag, Outcome, RecoveryHint, Status, TaskId};

use super::{Core, Effect, Now, Version};
use crate::record::{StepOf, TaskRecord};

/// Each workflow's steps, and the workflows to advance.
#[derive(Debug, Default)]
pub(super) struct Workflows {
    /// The steps of each workflow: step index → child task.
    steps: HashMap<TaskId, BTreeMap<u32, TaskId>>,
    /// Workflows to advance before this input's effects are returned.
    due: BTreeSet<TaskId>,
    /// Workflows with a deadline that have not ended: the only ones a tick
    /// looks at (see [`Core::workflow_deadlines`]).
    timed: BTreeSet<TaskId>,
}

impl Workflows {
    /// Remembers a child task under its workflow (at load and at creation).
    pub(super) fn index_step(&mut self, child: &TaskId, of: &StepOf) {
        self.steps.entry(of.workflow.clone()).or_default().insert(of.index, child.clone());
    }

    /// `workflow` has a deadline and has not ended (at its begin and at load).
    pub(super) fn timed(&mut self, workflow: &TaskId) {
        self.timed.insert(workflow.clone());
    }

    /// `workflow` is advanced before the effects of this input are returned.
    pub(super) fn due(&mut self, workflow: &TaskId) {
        self.due.insert(workflow.clone());
    }

    /// Whether `task` is a workflow with at least one step created.
    pub(super) fn has_steps(&self, task: &TaskId) -> bool {
        self.steps.contains_key(task)
    }

    /// The latest step of `workflow`: its index and task.
    fn current(&self, workflow: &TaskId) -> Option<(u32, TaskId)> {
        self.steps.get(workflow).and_then(|c| c.last_key_value()).map(|(i, t)| (*i, t.clone()))
    }

    /// A step whose record could not be stored: no longer one of its workflow's.
    pub(super) fn forget_step(&mut self, of: &StepOf) {
        if let Some(steps) = self.steps.get_mut(&of.workflow) {
            steps.remove(&of.index);
        }
    }

    /// Drops `task`'s steps (its record is gone from memory).
    pub(super) fn forget(&mut self, task: &TaskId) {
        self.steps.remove(task);
        self.timed.remove(task);
    }
}

impl Core {
    /// A fresh snapshot of `r`, with its steps when it is a workflow.
    pub(super) fn snapshot_of(&self, r: &TaskRecord) -> TaskSnapshot {
        let mut s = r.snapshot();
        if let Some(hint) = self.blocked_by(r) {
            s.status = Status::Blocked;
            s.hint = Some(hint);
        }
        if s.status == Status::Running && self.dispatch.is_waiting(&r.id) {
            s.status = Status::Waiting;
        }
        if !r.spec.steps.is_empty() {
            let children = self.workflows.steps.get(&r.id);
            s.steps = r
                .spec
                .steps
                .iter()
                .enumerate()
                .map(|(i, step)| {
                    let task = children.and_then(|c| c.get(&(i as u32)));
                    let child = task.and_then(|id| self.tasks.get(id));
                    StepView {
                        index: i as u32 + 1,
                        // The first line, cut: a snapshot stays small whatever the steps.
                        command: step.command.lines().next().unwrap_or("").chars().take(120).collect(),
                        task: task.cloned(),
                        status: child.map(|c| c.life.status),
                        detail: child
                            .and_then(|c| c.life.outcome.as_ref())
                            .and_then(|o| o.detail.as_deref().map(Into::into)),
                        hint: child.and_then(|c| c.life.hint.as_deref().cloned()),
                    }
                })
                .collect();
            // A workflow waiting on an unknown step says so: that step needs a
            // person (or its machine's evidence) before anything moves.
            if s.hint.is_none() && !s.status.is_terminal() {
                let stuck = s.steps.iter().rev().find(|st| st.status == Some(Status::Unknown));
                if let Some(step) = stuck {
                    let why = step.hint.as_ref().map(|h| h.message.as_str()).unwrap_or("its outcome is not proved");
                    s.hint = Some(RecoveryHint {
                        tag: step.hint.as_ref().map(|h| h.tag).unwrap_or(HintTag::MaybeRan),
                        message: format!(
                            "waiting on step {} ({}), which is unknown: {why}",
                            step.index,
                            step.task.as_ref().map(ToString::to_string).unwrap_or_default()
                        ),
                    });
                }
            }
        }
        s
    }

    /// Begins a just-submitted workflow: running at once (with its deadline,
    /// when it has a timeout), first step created.
    pub(super) fn begin_workflow(&mut self, workflow: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let clock = self.registry_ms(now);
        let timeout = self.tasks.get(workflow).and_then(|w| w.spec.limits.as_ref()).and_then(|l| l.timeout_ms);
        if let (Some(ms), Some(w)) = (timeout, self.tasks.get_mut(workflow)) {
            // Stored with the change `StepsBegan` persists.
            w.attempts.get_or_insert_with(Box::default).deadline_clock_ms = clock.saturating_add(ms).max(1);
            self.workflows.timed(workflow);
        }
        self.event(workflow, Event::StepsBegan { epoch: self.epoch }, now, fx);
        self.advance(workflow, now, fx);
    }

    /// Marks due every running workflow whose deadline passed (checked at
    /// each tick, over the workflows with a deadline only), so that
    /// `advance` stops it; forgets those that ended.
    pub(super) fn workflow_deadlines(&mut self, now: Now) {
        let clock = self.registry_ms(now);
        let tasks = &self.tasks;
        self.workflows.timed.retain(|w| tasks.get(w).is_some_and(|r| !r.life.status.is_terminal()));
        let late: Vec<TaskId> = self
            .workflows
            .timed
            .iter()
            .filter(|w| tasks.get(w).is_some_and(|r| r.life.status == Status::Running && past(r, clock)))
            .cloned()
            .collect();
        for w in late {
            self.workflows.due(&w);
        }
    }

    /// Advances every workflow something happened to since the last call.
    pub(super) fn advance_due_workflows(&mut self, now: Now, fx: &mut Vec<Effect>) {
        while let Some(workflow) = self.workflows.due.pop_first() {
            self.advance(&workflow, now, fx);
        }
    }

    /// Moves one workflow forward from what the registry says: create the next
    /// step, stop the current one for a kill, or settle the workflow.
    pub(super) fn advance(&mut self, workflow: &TaskId, now: Now, fx: &mut Vec<Effect>) {
        let Some(w) = self.tasks.get(workflow) else { return };
        if w.spec.steps.is_empty() || !matches!(w.life.status, Status::Running | Status::Stopping) {
            return;
        }
        let (steps, killing) = (w.spec.steps.len() as u32, w.life.kill_requested);
        let late = past(w, self.registry_ms(now)).then(|| timed_out(w));
        let current = self.workflows.current(workflow);
        let Some((index, child)) = current else {
            return match (killing, late) {
                (true, _) => {
                    self.end_workflow(workflow, Ending::Killed, "killed before its first step".into(), now, fx)
                }
                (false, Some(why)) => self.end_workflow(workflow, Ending::Failed, why, now, fx),
                (false, None) => self.create_step(workflow, 0, now, fx),
            };
        };
        let Some(c) = self.tasks.get(&child) else {
            // The step was garbage-collected (the workflow outlived its retention
            // without settling, which `advance` on every step end prevents).
            let detail = format!("step {} ({child}) is gone", index + 1);
            return self.end_workflow(workflow, Ending::Failed, detail, now, fx);
        };
        let (status, child_killed) = (c.life.status, c.life.kill_requested);
        let detail = c.life.outcome.as_ref().and_then(|o| o.detail.clone());
        let step = |what: &str| {
            let why = detail.as_deref().map(|d| format!(": {d}")).unwrap_or_default();
            format!("step {} of {steps} ({child}) {what}{why}", index + 1)
        };
        match status {
            Status::Completed if index + 1 == steps => {
                self.end_workflow(workflow, Ending::Completed, format!("all {steps} steps completed"), now, fx)
            }
            Status::Completed if killing => {
                let detail = format!("killed after step {} of {steps}", index + 1);
                self.end_workflow(workflow, Ending::Killed, detail, now, fx)
            }
            Status::Killed if killing => self.end_workflow(workflow, Ending::Killed, step("was killed"), now, fx),
            // Its time is up: no further step begins, and a step that ended
            // otherwise than completed ended for it (its own timeout is what
            // was left of the workflow's).
            Status::Completed | Status::Killed | Status::Failed if late.is_some() => {
                let why = late.unwrap_or_default();
                let detail = match status {
                    Status::Completed => format!("{why}, after step {} of {steps}", index + 1),
                    _ => format!("{why}; {}", step("did not complete")),
                };
                self.end_workflow(workflow, Ending::Failed, detail, now, fx)
            }
            Status::Completed => self.create_step(workflow, index + 1, now, fx),
            Status::Killed => self.end_workflow(workflow, Ending::Failed, step("was killed"), now, fx),
            Status::Failed => self.end_workflow(workflow, Ending::Failed, step("failed"), now, fx),
            // Not settled yet (running, or unknown until evidence arrives): a
            // kill of the workflow, or its deadline, is carried to the step, once.
            _ if (killing || late.is_some()) && !child_killed => {
                // The step is stopped for the workflow's reason.
                let reason = match &late {
                    Some(why) if !killing => Some(why.clone().into()),
                    _ => self.tasks.get(workflow).and_then(|w| w.life.kill_reason.clone()),
                };
                self.event(&child, Event::KillRequested { reason }, now, fx);
                if self.tasks.get(&child).is_some_and(|c| c.life.status == Status::Stopping) {
                    self.send_kill(&child, now, fx);
                }
            }
            _ => {}
        }
    }

    fn create_step(&mut self, workflow: &TaskId, index: u32, now: Now, fx: &mut Vec<Effect>) {
        let Some(w) = self.tasks.get(workflow) else { return };
        let Some(mut spec) = w.spec.step(index as usize) else { return };
        // What is left of the workflow's timeout is the step's own: its
        // machine ends it on time even while no leader answers.
        let deadline = w.attempts.as_ref().map_or(0, |a| a.deadline_clock_ms);
        if deadline > 0 {
            let left = deadline.saturating_sub(self.registry_ms(now)).max(1);
            spec.limits =
                Some(Box::new(tenure_protocol::spec::TimeLimits { timeout_ms: Some(left), idle_timeout_ms: None }));
        }
        let (owner, key, trace) = (w.owner.clone(), w.idempotency_key, w.trace.clone());
        let id = match self.submits.allocate().and_then(|n| {
            TaskId::new(spec.kind.clone(), n)
                .map_err(|e| tenure_protocol::messages::ApiError::InvalidRequest(e.to_string()))
        }) {
            Ok(id) => id,
            Err(error) => {
                let detail = format!("step {} cannot be created: {error}", index + 1);
                return self.end_workflow(workflow, Ending::Failed, detail, now, fx);
            }
        };
        let of = StepOf { workflow: workflow.clone(), index };
        // The key is derived from the workflow's: unique per step, and no
        // client can submit it (a client's key is its own random uuid).
        let key = uuid::Uuid::new_v5(&key, &index.to_be_bytes());
        let record = TaskRecord {
            parent: Some(Box::new(of.clone())),
            trace,
            ..TaskRecord::new(id.clone(), owner, key, spec, now.wall_ms)
        };
        tracing::info!(task = %id, workflow = %workflow, step = index + 1, "workflow step created");
        self.index(&id, super::concurrency(&record.spec), record.spec.priority, None, Status::Queued, None, now);
        self.workflows.index_step(&id, &of);
        fx.push(Effect::Persist(Box::new(record.clone()), Version::First));
        self.usage.add(&record);
        self.tasks.insert(record);
    }

    pub(super) fn end_workflow(
        &mut self,
        workflow: &TaskId,
        ending: Ending,
        detail: String,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        let exit_code = (ending == Ending::Completed).then_some(0);
        let outcome = Outcome::new(ending, exit_code, Some(detail));
        self.event(workflow, Event::StepsEnded { outcome }, now, fx);
    }

    /// The children of a workflow, in step order.
    pub(super) fn steps_of(&self, workflow: &TaskId) -> Vec<TaskId> {
        self.workflows.steps.get(workflow).map(|c| c.values().cloned().collect()).unwrap_or_default()
    }
}

/// Whether workflow `w` has a deadline and registry time `clock` is past it.
fn past(w: &TaskRecord, clock: u64) -> bool {
    w.attempts.as_ref().is_some_and(|a| a.deadline_clock_ms > 0 && clock >= a.deadline_clock_ms)
}

/// The detail of a workflow ended by its timeout.
fn timed_out(w: &TaskRecord) -> String {
    let ms = w.spec.limits.as_ref().and_then(|l| l.timeout_ms).unwrap_or_default();
    let timeout = tenure_protocol::spec::duration_text(ms);
    format!("{}: the workflow ran longer than its timeout of {timeout}", tenure_protocol::spec::TIMED_OUT)
}
