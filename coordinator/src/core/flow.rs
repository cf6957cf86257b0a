//! Flow control: whether a task may start now and, when it may not for a
//! reason a person can act on, why — approvals, concurrency keys and
//! placement on worker labels.
//!
//! - **Approvals** (seed 003's plan mode): a task submitted with `--hold`,
//!   or one the approval policy names, is created `blocked` (durably) and
//!   queued only by an `Approve` from someone the policy allows; a kill ends
//!   it without it ever running.
//! - **Concurrency keys**: at most the key's limit of its tasks hold a
//!   worker — or may: `leased`, `running`, `stopping`, `paused`, and
//!   `unknown` (its process may still run) — cluster-wide. The count is
//!   rebuilt from the registry by every new leader, so a failover goes on
//!   exactly. The limit in force is the coordinators' configured one for the
//!   key, else the one the key's live tasks were submitted with; a submit
//!   naming another is refused with the one in force.
//! - **Placement**: a task goes only to a worker whose labels (from its last
//!   heartbeat) satisfy every constraint.
//!
//! A queued task held back by a full key or by no matching live worker is
//! *shown* `blocked` with the hint that says which ([`Core::blocked_by`]);
//! those reasons come and go with the cluster and are never written. This
//! module must never let a key's count pass its limit, nor a held task start
//! unapproved.

use std::collections::{BTreeSet, HashMap};

use tenure_protocol::messages::{ApiError, ApiReply, ApiResponse};
use tenure_protocol::placement::{labels_text, Concurrency, Labels};
use tenure_protocol::resources::ResourceSupport;
use tenure_protocol::{Decision, Event, HintTag, Kind, RecoveryHint, SessionId, Status, TaskId, TaskSpec, Unchanged};

use super::{Approver, Core, Effect, Now};
use crate::record::TaskRecord;

/// How many holders of a full key a hint names.
const NAMED_HOLDERS: usize = 5;

/// The live tasks of each concurrency key.
#[derive(Debug, Default)]
pub(super) struct Keys {
    by_key: HashMap<Box<str>, KeyState>,
}

#[derive(Debug, Default)]
struct KeyState {
    /// Every task of the key that is not terminal, with the limit it was
    /// submitted with.
    live: HashMap<TaskId, Option<u32>>,
    /// Those that hold a worker, or may, by task number (the first few are
    /// named in a hint without sorting them all).
    holding: BTreeSet<(u64, TaskId)>,
}

/// Whether a task in `status` counts against its key.
fn holds(status: Status) -> bool {
    status.is_on_worker() || status == Status::Unknown
}

impl Keys {
    /// Keeps the key of `task` in step with its status. A workflow holds no
    /// worker: its steps, which take its key, count.
    pub(super) fn index(&mut self, task: &TaskId, concurrency: Option<&Concurrency>, status: Status) {
        let Some(c) = concurrency else { return };
        if *task.kind() == Kind::workflow() {
            return;
        }
        if status.is_terminal() {
            self.forget(task, c);
            return;
        }
        let key = self.by_key.entry(c.key.as_str().into()).or_default();
        key.live.insert(task.clone(), c.limit);
        let entry = (task.number(), task.clone());
        match holds(status) {
            true => key.holding.insert(entry),
            false => key.holding.remove(&entry),
        };
    }

    /// Drops `task` from its key (it ended, or its record is gone).
    pub(super) fn forget(&mut self, task: &TaskId, c: &Concurrency) {
        if let Some(key) = self.by_key.get_mut(c.key.as_str()) {
            key.live.remove(task);
            key.holding.remove(&(task.number(), task.clone()));
            if key.live.is_empty() {
                self.by_key.remove(c.key.as_str());
            }
        }
    }

    /// The smallest limit the key's live tasks were submitted with.
    fn submitted_limit(&self, key: &str) -> Option<u32> {
        self.by_key.get(key)?.live.values().flatten().min().copied()
    }

    fn holding(&self, key: &str) -> usize {
        self.by_key.get(key).map_or(0, |k| k.holding.len())
    }

    /// A few of the key's holders, lowest task number first.
    fn holders(&self, key: &str) -> Vec<TaskId> {
        let Some(k) = self.by_key.get(key) else { return Vec::new() };
        k.holding.iter().take(NAMED_HOLDERS).map(|(_, t)| t.clone()).collect()
    }
}

impl Core {
    /// The limit in force for `key`, and where it comes from.
    pub(super) fn limit_in_force(&self, key: &str) -> Option<(u32, &'static str)> {
        match self.cfg.concurrency_limits.get(key) {
            Some(limit) => Some((*limit, "configured on the coordinators")),
            None => self.keys.submitted_limit(key).map(|l| (l, "set by the key's live tasks")),
        }
    }

    /// The limit a key's tasks are held to: the one in force, or 1 when none
    /// is (a configured limit removed while its tasks gave none) — never
    /// more than anyone set.
    fn limit(&self, key: &str) -> u32 {
        self.limit_in_force(key).map_or(1, |(l, _)| l)
    }

    /// A submit's concurrency key against the limit in force — or, when
    /// none is, the one an earlier task of the same batch set
    /// (`batch_limits`): a different limit is refused, and a key needs a
    /// limit from somewhere.
    pub(super) fn check_concurrency(
        &self,
        spec: &TaskSpec,
        batch_limits: &HashMap<Box<str>, u32>,
    ) -> Result<(), ApiError> {
        let Some(c) = super::concurrency(spec) else { return Ok(()) };
        let in_force = self
            .limit_in_force(&c.key)
            .or_else(|| batch_limits.get(c.key.as_str()).map(|l| (*l, "set by an earlier task of this batch")));
        match (in_force, c.limit) {
            (Some((in_force, source)), Some(asked)) if asked != in_force => {
                Err(ApiError::ConcurrencyLimitConflict { key: c.key.clone(), in_force, asked, from: source.into() })
            }
            (None, None) => Err(ApiError::InvalidSpec(format!(
                "concurrency key {:?} has no limit: give one with --concurrency-limit N (or configure one for the \
                 key on the coordinators)",
                c.key
            ))),
            _ => Ok(()),
        }
    }

    /// Whether `r`'s concurrency key has room for one more holder.
    pub(super) fn key_has_room(&self, r: &TaskRecord) -> bool {
        let Some(c) = super::concurrency(&r.spec) else { return true };
        self.keys.holding(&c.key) < self.limit(&c.key) as usize
    }

    /// Why the approval policy (or the submit itself) holds a new task, if
    /// it does: the rule, in words.
    fn held_by(&self, spec: &TaskSpec) -> Option<String> {
        let policy = &self.cfg.approval;
        if policy.kinds.contains(&spec.kind) && !spec.idempotent {
            return Some(format!("the approval policy holds {} tasks that are not idempotent", spec.kind));
        }
        let commands = std::iter::once(spec.command.as_str()).chain(spec.steps.iter().map(|s| s.command.as_str()));
        for command in commands {
            if let Some(rule) = policy.commands.iter().find(|re| re.is_match(command)) {
                return Some(format!("the approval policy holds commands matching `{}`", rule.as_str()));
            }
        }
        None
    }

    /// Who may approve a task held because `policy_rule` (or `--hold` when
    /// none), in words for a hint or a refusal.
    fn approvers_text(&self, policy_rule: bool) -> String {
        match (policy_rule, self.cfg.approval.approver) {
            (true, Approver::Operator) if self.cfg.operators.is_empty() => {
                "only an operator may approve it, and none is configured (the coordinators' `operators`)".into()
            }
            (true, Approver::Operator) => {
                format!("only an operator ({}) may approve it", self.cfg.operators.join(", "))
            }
            _ => "its owner or an operator may approve it".into(),
        }
    }

    /// The hint of a task held at submit, or none when it is not held.
    pub(super) fn hold_at_submit(&self, id: &TaskId, spec: &TaskSpec) -> Option<RecoveryHint> {
        let rule = self.held_by(spec);
        if rule.is_none() && !spec.hold {
            return None;
        }
        let why = rule.clone().unwrap_or_else(|| "it was submitted with --hold".into());
        let message = format!(
            "waiting for approval: {why}. {} with `tenure approve {id}`; or end it without it ever running with \
             `tenure kill {id}`",
            capitalised(&self.approvers_text(rule.is_some()))
        );
        Some(RecoveryHint { tag: HintTag::AwaitingApproval, message })
    }

    /// `tenure approve`: a held task of `session` (or any, for an operator
    /// where the policy allows) is queued — once; a second approval finds it
    /// queued and answers as it is.
    pub(super) fn approve(&mut self, session: &SessionId, task: &TaskId, now: Now, fx: &mut Vec<Effect>) -> ApiReply {
        let r = self.visible(session, task)?;
        let policy_rule = self.held_by(&r.spec);
        let (status, attempt) = (r.life.status, r.life.attempt);
        let held = policy_rule.is_some() || r.spec.hold;
        if status != Status::Blocked {
            // Approved already (not yet granted): the same answer again.
            if status == Status::Queued && attempt.0 == 0 && held {
                return Ok(ApiResponse::Snapshot(self.snapshot_of(r)));
            }
            return Err(ApiError::NotAwaitingApproval { task: task.to_string(), status: status.to_string() });
        }
        let by_owner = &r.owner == session;
        let operator = self.is_operator(session);
        let allowed = match (policy_rule.is_some(), self.cfg.approval.approver) {
            (true, Approver::Operator) => operator,
            _ => by_owner || operator,
        };
        if !allowed {
            let why = policy_rule.unwrap_or_else(|| "it was submitted with --hold".into());
            return Err(ApiError::ApprovalRefused {
                task: task.to_string(),
                reason: format!(
                    "{task} waits for approval because {why}, and {}; {} is not allowed to. Ask one to run \
                     `tenure approve {task}`, or end it without it ever running with `tenure kill {task}`",
                    self.approvers_text(true),
                    session.identity()
                ),
            });
        }
        let workflow = !r.spec.steps.is_empty();
        tracing::info!(task = %task, by = %session, "task approved");
        match self.event(task, Event::Approved, now, fx) {
            Some(Decision::Changed(_)) if workflow => self.begin_workflow(task, now, fx),
            Some(Decision::Changed(_) | Decision::Unchanged(Unchanged::Duplicate)) => {}
            other => tracing::warn!(task = %task, ?other, "approval of a blocked task changed nothing"),
        }
        Ok(ApiResponse::Snapshot(self.snapshot_of(self.visible(session, task)?)))
    }

    /// Why queued `r` cannot start now for a reason a person can act on: its
    /// concurrency key is full, or no live worker that runs its kind
    /// satisfies its placement. Shown, never stored.
    pub(super) fn blocked_by(&self, r: &TaskRecord) -> Option<RecoveryHint> {
        if r.life.status != Status::Queued {
            return None;
        }
        if let Some(hint) = self.awaiting_its_machine(r).or_else(|| self.no_matching_worker(&r.spec)) {
            return Some(hint);
        }
        let c = super::concurrency(&r.spec)?;
        if self.key_has_room(r) {
            return None;
        }
        let limit = self.limit(&c.key);
        let holders: Vec<String> = self.keys.holders(&c.key).iter().map(ToString::to_string).collect();
        let message = format!(
            "concurrency key {:?} is full: {} of its {limit} allowed hold a worker ({}{}); it starts when one of \
             them ends",
            c.key,
            self.keys.holding(&c.key),
            holders.join(", "),
            if self.keys.holding(&c.key) > holders.len() { ", …" } else { "" },
        );
        Some(RecoveryHint { tag: HintTag::ConcurrencyLimit, message })
    }
}

impl Core {
    /// Live workers run `spec`'s kind, and none of them both satisfies its
    /// placement and enforces its resource limits: the hint naming what is
    /// missing and the live workers (none when no worker runs the kind at
    /// all: the task is plainly queued then).
    fn no_matching_worker(&self, spec: &TaskSpec) -> Option<RecoveryHint> {
        let (placement, resources) = (spec.placement.as_deref(), spec.resources.as_deref());
        let constrained = placement.is_some_and(|p| !p.on.is_empty()) || resources.is_some();
        if !constrained {
            return None;
        }
        let live: Vec<_> = self.workers.live_running(spec).collect();
        let placed = |l: &Labels| placement.is_none_or(|p| p.admits(l));
        let enforced = |e: &ResourceSupport| resources.is_none_or(|r| r.unmet_by(e).is_empty());
        if live.is_empty() || live.iter().any(|(_, l, e)| placed(l) && enforced(e)) {
            return None;
        }
        let mut wants = Vec::new();
        if let Some(p) = placement.filter(|p| !p.on.is_empty()) {
            wants.push(format!("satisfies `{}`", p.constraints_text()));
        }
        if let Some(r) = resources {
            let unmet: BTreeSet<&str> = live.iter().flat_map(|(_, _, e)| r.unmet_by(e)).collect();
            if !unmet.is_empty() {
                wants.push(format!("enforces its {} limit", unmet.into_iter().collect::<Vec<_>>().join(", ")));
            }
        }
        let seen: Vec<String> = live
            .iter()
            .take(NAMED_HOLDERS)
            .map(|(w, l, e)| {
                let enforces = e.names();
                let enforces = if enforces.is_empty() { "nothing".to_owned() } else { enforces.join(",") };
                format!("{w} (labels {}; enforces {enforces})", labels_text(l))
            })
            .collect();
        let message = format!(
            "no live worker that runs {} tasks {} (live: {}{}); it starts when one that does joins (a worker with \
             the matching --label, on a host with cgroup v2 for limits), or kill it",
            spec.kind,
            wants.join(" and "),
            seen.join("; "),
            if live.len() > seen.len() { "; …" } else { "" },
        );
        Some(RecoveryHint { tag: HintTag::NoMatchingWorker, message })
    }
}

fn capitalised(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}
