//! The judge: a ledger of every process start, the durable registry's history,
//! the epochs each sidecar acknowledged, and the safety rules checked against
//! them — at every step where a rule can break, and once more at the end.
//!
//! It observes only what an outside observer of the real system could see
//! (process starts on machines, records appended to the registry, sidecar
//! answers, notices, client replies); it never reads a core's private state.
//! The first violation wins and stops the schedule. The rules:
//!
//! 1. A non-idempotent task's process starts at most once, across all attempts.
//! 2. A task's durable record never leaves a terminal status (nor changes its
//!    outcome), its attempt number never goes back, and it is first written queued.
//! 3. Once the healed cluster is quiet, every task is terminal, or `unknown`
//!    with a recovery hint; and it does get quiet.
//! 4. A completed (or failed) non-idempotent task started exactly once; an
//!    idempotent one at least once.
//! 5. An `unknown` (or killed) non-idempotent task started at most once.
//! 6. No sidecar accepts a grant, records an intent or answers a query under an
//!    epoch lower than one it acknowledged, and its fence never falls back.
//! 7. A process starts only for an attempt the registry durably leased to that
//!    machine, and never for a task the registry does not know.
//! 8. (client) A submit key always names the same task; no task answers two keys.
//! 9. A terminal notice is published only for a task whose terminal record is durable.
//! 11. A task with a retry policy of R retries starts at most R + 1 attempts
//!     (a retry is decided once per attempt, whatever reports repeat).
//! 10. A task that never started ends `killed` only if a client asked to kill
//!     it, and `unknown` only if a machine it was leased to was struck by a
//!     fault (crashed, wiped, cut off, its shim killed): nothing else
//!     explains an outcome that could not be proved.
//! 12. A task submitted held is first written `blocked`, and no process of it
//!     starts before its client asked to approve it.
//! 13. A task that declares a resume command (the exception to rules 1, 4
//!     and 5: it may start again once its process is proven gone) never has
//!     two attempts' processes alive at once, and starts at most
//!     `MAX_RESUMES` + 1 times.
//! 14. A record the leader lets share a registry message with other tasks'
//!     (durability notes a12, a13) is the task's first record or its first
//!     grant (leased as attempt 1 over a record of attempt 0), never an ended
//!     one, and a task has at most two in its life: the bound the registry's
//!     reserve relies on.

use std::collections::{BTreeMap, BTreeSet};

use tenure_coordinator::core::Version;
use tenure_coordinator::record::TaskRecord;
use tenure_protocol::messages::TaskSnapshot;
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
    /// Client requests answered wrongly by a deposed leader (no rule; counted).
    stale_answers: usize,
    /// Tasks a client asked to kill (rule 10).
    kills_asked: BTreeSet<TaskId>,
    /// Machines a fault struck at some point (rule 10).
    struck: BTreeSet<WorkerId>,
    /// Tasks a client asked to approve (rule 12).
    approvals_asked: BTreeSet<TaskId>,
    /// Tasks that declare a resume command (rule 13).
    resumable: BTreeSet<TaskId>,
    /// Records of each task appended as ones that may share a message (rule 14).
    shared: BTreeMap<TaskId, u32>,
    /// Tasks with a record appended as `Later`, on their own subject (rule 14).
    later: BTreeSet<TaskId>,
    /// Ends appended as ones that may share a message.
    shared_ends: usize,
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

    pub fn shared_ends(&self) -> usize {
        self.shared_ends
    }

    pub fn starts(&self, task: &TaskId) -> usize {
        self.starts.get(task).map_or(0, Vec::len)
    }

    pub fn stale_answer(&mut self) {
        self.stale_answers += 1;
    }

    pub fn stale_answers(&self) -> usize {
        self.stale_answers
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
        spec: &tenure_protocol::TaskSpec,
    ) {
        let (idempotent, retries) = (spec.idempotent, spec.retry.as_ref().map(|p| p.retries));
        let starts = self.starts.entry(task.clone()).or_default();
        starts.push((attempt, machine, now));
        let attempts: std::collections::BTreeSet<Attempt> = starts.iter().map(|s| s.0).collect();
        if let Some(retries) = retries.filter(|r| attempts.len() as u64 > u64::from(*r) + 1) {
            let starts = format!("{starts:?}");
            self.fail(format!(
                "rule 11: {task} with {retries} retries started {} attempts: (attempt, machine, tick) = {starts}",
                attempts.len()
            ));
        }
        if spec.resume.is_some() {
            self.resumable.insert(task.clone());
        }
        let starts = self.starts.entry(task.clone()).or_default();
        let most = tenure_protocol::resume::MAX_RESUMES as usize + 1;
        if spec.resume.is_some() && starts.len() > most {
            let starts = format!("{starts:?}");
            self.fail(format!("rule 13: resumable {task} started more than {most} times: {starts}"));
        } else if !idempotent && spec.resume.is_none() && starts.len() > 1 {
            let starts = format!("{starts:?}");
            self.fail(format!(
                "rule 1: non-idempotent {task} started more than once: (attempt, machine, tick) = {starts}"
            ));
        }
        if spec.hold && !self.approvals_asked.contains(task) {
            self.fail(format!("rule 12: held {task} started attempt {attempt} before anyone asked to approve it"));
        }
        if !self.granted.contains(&(task.clone(), attempt, worker.clone())) {
            self.fail(format!("rule 7: {worker} started {task} attempt {attempt}, never durably leased to it"));
        }
    }

    /// Rule 9, for each `Effect::Notify` a leader carries out.
    pub fn notified(&mut self, snapshot: &TaskSnapshot, durable: Option<&TaskRecord>) {
        let durable = durable.map(|r| r.life.status);
        if !snapshot.status.is_terminal() || durable != Some(snapshot.status) {
            self.fail(format!(
                "rule 9: notice of {} {} while the registry says {durable:?}",
                snapshot.id, snapshot.status
            ));
        }
    }

    /// Rule 2 (terminal is absorbing) and its neighbours, on every append the
    /// registry accepts: a new task starts queued (or blocked when held), or
    /// leased to its first attempt when it was leased at its submit (one
    /// append for both); attempts never go back.
    pub fn appended(&mut self, before: Option<&TaskRecord>, after: &TaskRecord, version: Version) {
        let id = &after.id;
        if version.may_share(after) {
            let fits = match version {
                Version::First => before.is_none(),
                Version::FirstGrant => {
                    after.life.status == Status::Leased
                        && after.life.attempt == Attempt(1)
                        && before.is_none_or(|b| b.life.attempt == Attempt(0))
                }
                // A task's end, when nothing of it went on its subject before.
                Version::End => {
                    after.life.status.is_terminal()
                        && before.is_some_and(|b| !b.life.status.is_terminal())
                        && !self.later.contains(id)
                }
                Version::Later => false,
            };
            self.shared_ends += usize::from(version == Version::End);
            let count = self.shared.entry(id.clone()).or_default();
            *count += 1;
            let count = *count;
            if !fits || count > 3 {
                let was = before.map(|b| (b.life.status, b.life.attempt));
                self.fail(format!(
                    "rule 14: {id} appended as {version:?} ({} #{}, shared {count} times) over {was:?}",
                    after.life.status, after.life.attempt
                ));
            }
        } else {
            self.later.insert(id.clone());
        }
        let first = match after.life.status {
            Status::Blocked => after.spec.hold,
            Status::Queued => !after.spec.hold,
            Status::Leased => !after.spec.hold && after.life.attempt.0 == 1,
            _ => false,
        };
        match before {
            None if !first => {
                self.fail(format!("rule 2: {id} first appended as {} (held: {})", after.life.status, after.spec.hold))
            }
            None => {}
            Some(b)
                if b.life.status.is_terminal()
                    && (after.life.status != b.life.status || after.life.outcome != b.life.outcome) =>
            {
                self.fail(format!(
                    "rule 2: {id} was {} ({:?}) and became {} ({:?})",
                    b.life.status, b.life.outcome, after.life.status, after.life.outcome
                ));
            }
            Some(b) if after.life.attempt < b.life.attempt => {
                self.fail(format!("rule 2: {id}: attempt went back from {} to {}", b.life.attempt, after.life.attempt))
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
    /// A machine's data directory was lost: its epoch fence went with it (a
    /// new store starts at epoch 0 until a leader's command raises it). The
    /// registry's conditional appends still fence a deposed leader; rule 6
    /// judges the new store from its start.
    pub fn store_replaced(&mut self, machine: usize) {
        self.fence.remove(&machine);
    }

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
            self.fail(format!(
                "rule 6: sidecar of machine {machine} holds epoch {fence_now} after acknowledging {seen}"
            ));
        }
    }

    /// Rule 13, at every tick: the processes alive now, as (machine,
    /// (task, attempt)); a resumable task has at most one.
    pub fn alive(&mut self, running: &[(usize, (TaskId, Attempt))]) {
        let mut seen: BTreeMap<&TaskId, (usize, Attempt)> = BTreeMap::new();
        for (machine, (task, attempt)) in running {
            if !self.resumable.contains(task) {
                continue;
            }
            if let Some((m, a)) = seen.insert(task, (*machine, *attempt)) {
                self.fail(format!(
                    "rule 13: resumable {task} runs attempts {a} (machine {m}) and {attempt} (machine {machine}) at once"
                ));
                return;
            }
        }
    }

    /// A client sent an approval of `task` (rule 12).
    pub fn approval_asked(&mut self, task: &TaskId) {
        self.approvals_asked.insert(task.clone());
    }

    /// A client sent a kill of `task` (rule 10).
    pub fn kill_asked(&mut self, task: &TaskId) {
        self.kills_asked.insert(task.clone());
    }

    /// A fault struck the machine of `worker` (rule 10).
    pub fn machine_struck(&mut self, worker: &WorkerId) {
        self.struck.insert(worker.clone());
    }

    /// Rules 3, 4, 5 and 10, once the healed cluster is quiet.
    pub fn settled(&mut self, records: &BTreeMap<TaskId, TaskRecord>) {
        for r in records.values() {
            let (status, id) = (r.life.status, &r.id);
            let starts = self.starts(id);
            if starts == 0 {
                let struck = self.granted.iter().any(|(t, _, w)| t == id && self.struck.contains(w));
                let explained = match status {
                    Status::Killed => self.kills_asked.contains(id),
                    Status::Unknown => struck,
                    _ => true,
                };
                if !explained {
                    self.fail(format!(
                        "rule 10: {id} never started and ended {status} (hint {:?}) with nothing to explain it",
                        r.life.hint
                    ));
                }
            }
            if !(status.is_terminal() || (status == Status::Unknown && r.life.hint.is_some())) {
                self.fail(format!("rule 3: {id} ended the healed run {status} (hint {:?})", r.life.hint));
            }
            if self.resumable.contains(id) {
                continue;
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
        let anonymous = self.starts.keys().find(|t| !records.contains_key(*t)).cloned();
        if let Some(task) = anonymous {
            self.fail(format!("rule 7: a process of {task} ran, but the registry has no such task"));
        }
    }
}
