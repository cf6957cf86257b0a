//! The judge: a ledger of every process start, the durable registry's history,
//! the epochs each sidecar acknowledged, and the safety rules checked against
//! them — at every step where a rule can break, and once more at the end.
//!
//! It observes only what an outside observer of the real system could see
//! (process starts on machines, records appended to the registry, sidecar
//! answers); it never reads a core's private state. The first violation wins
//! and stops the schedule.

use std::collections::{BTreeMap, BTreeSet};

use tenure_coordinator::record::TaskRecord;
use tenure_protocol::{Attempt, Epoch, Status, TaskId, WorkerId};

/// One line per event, kept only when asked (a failing seed is replayed with it on).
pub struct Trace {
    pub enabled: bool,
    pub lines: Vec<String>,
}

impl Trace {
    pub fn push(&mut self, now: u64, line: impl FnOnce() -> String) {
        if self.enabled {
            self.lines.push(format!("t{now:<5} {}", line()));
        }
    }
}

#[derive(Default)]
pub struct Checker {
    failure: Option<String>,
    /// Every process start: task → (attempt, machine, tick).
    starts: BTreeMap<TaskId, Vec<(Attempt, usize, u64)>>,
    /// Every (task, attempt, worker) the registry durably leased.
    granted: BTreeSet<(TaskId, Attempt, WorkerId)>,
    /// Per machine: the highest epoch its sidecar acknowledged.
    fence: BTreeMap<usize, Epoch>,
}

impl Checker {
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    pub fn fail(&mut self, why: String) {
        if self.failure.is_none() {
            self.failure = Some(why);
        }
    }

    pub fn starts(&self, task: &TaskId) -> usize {
        self.starts.get(task).map_or(0, Vec::len)
    }

    pub fn total_starts(&self) -> usize {
        self.starts.values().map(Vec::len).sum()
    }

    /// Rules 1 and 7: a non-idempotent task's process starts at most once, and
    /// only an attempt the registry durably leased to this machine starts here.
    pub fn process_started(
        &mut self,
        now: u64,
        machine: usize,
        worker: &WorkerId,
        task: &TaskId,
        attempt: Attempt,
        idempotent: bool,
    ) {
        let starts = self.starts.entry(task.clone()).or_default();
        starts.push((attempt, machine, now));
        if !idempotent && starts.len() > 1 {
            let starts = format!("{starts:?}");
            self.fail(format!(
                "rule 1: non-idempotent {task} started more than once: (attempt, machine, tick) = {starts}"
            ));
        }
        if !self.granted.contains(&(task.clone(), attempt, worker.clone())) {
            self.fail(format!("rule 7: {worker} started {task} attempt {attempt}, never durably leased to it"));
        }
    }

    /// Rule 2 (terminal is absorbing) and its neighbours, on every append the
    /// registry accepts: a new task starts queued, attempts never go back.
    pub fn appended(&mut self, before: Option<&TaskRecord>, after: &TaskRecord) {
        let id = &after.id;
        match before {
            None if after.life.status != Status::Queued => {
                self.fail(format!("{id} first appended as {}, not queued", after.life.status))
            }
            None => {}
            Some(b) if b.life.status.is_terminal() => {
                if after.life.status != b.life.status || after.life.outcome != b.life.outcome {
                    self.fail(format!(
                        "rule 2: {id} was {} ({:?}) and became {} ({:?})",
                        b.life.status, b.life.outcome, after.life.status, after.life.outcome
                    ));
                }
            }
            Some(b) if after.life.attempt < b.life.attempt => {
                self.fail(format!("{id}: attempt went back from {} to {}", b.life.attempt, after.life.attempt))
            }
            Some(_) => {}
        }
        if after.life.status == Status::Leased {
            if let Some(w) = &after.life.worker {
                self.granted.insert((id.clone(), after.life.attempt, w.clone()));
            }
        }
    }

    /// Rule 6: a sidecar never accepts a grant, records an intent or answers
    /// under an epoch lower than one it already acknowledged; and its own
    /// fence never falls below what it acknowledged.
    pub fn sidecar_ok(&mut self, machine: usize, what: &str, epoch: Epoch, fence_now: Epoch) {
        let seen = self.fence.entry(machine).or_default();
        if epoch < *seen && what != "observe" {
            let seen = *seen;
            self.fail(format!("rule 6: sidecar of machine {machine} did `{what}` under epoch {epoch} after {seen}"));
            return;
        }
        *seen = (*seen).max(epoch);
        if fence_now < *seen {
            let seen = *seen;
            self.fail(format!("rule 6: sidecar of machine {machine} holds epoch {fence_now} after acknowledging {seen}"));
        }
    }

    /// Rules 3, 4 and 5, once the healed cluster is quiet.
    pub fn settled(&mut self, records: &BTreeMap<TaskId, TaskRecord>) {
        for r in records.values() {
            let (status, id) = (r.life.status, &r.id);
            let starts = self.starts(id);
            if !(status.is_terminal() || (status == Status::Unknown && r.life.hint.is_some())) {
                self.fail(format!("rule 3: {id} ended the healed run {status} (hint {:?})", r.life.hint));
            }
            match (r.life.idempotent, status) {
                (false, Status::Completed | Status::Failed) if starts != 1 => {
                    self.fail(format!("rule 4: non-idempotent {id} is {status} after {starts} process starts"))
                }
                (false, Status::Unknown | Status::Killed) if starts > 1 => {
                    self.fail(format!("rule 5: non-idempotent {id} is {status} after {starts} process starts"))
                }
                (true, Status::Completed | Status::Failed) if starts == 0 => {
                    self.fail(format!("rule 4: idempotent {id} is {status} but never started"))
                }
                _ => {}
            }
        }
        for task in self.starts.keys() {
            if !records.contains_key(task) {
                self.fail(format!("a process of {task} ran, but the registry has no such task"));
            }
        }
    }
}
