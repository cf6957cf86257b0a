//! Workers: which process each worker id is bound to, the store it runs on,
//! what it offers (slots, kinds, labels, sidecar health) and when it was last heard
//! from — and what it says: heartbeats and reports.
//!
//! A worker id is bound to one live process: a second live process with the
//! id is told to stop, never commanded. A worker not heard from for the
//! worker TTL is lost (see `liveness.rs` for what that means for its tasks).
//! Nothing is scheduled on a worker that is not alive, whose sidecar is not
//! healthy, that claims an epoch no coordinator claimed, or whose process or
//! store this leader does not know yet.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use tenure_protocol::messages::{
    Heartbeat, MatchNotice, MatchedLine, Notice, Report, ReportAck, ReportEvent, SidecarHealth, WorkerStatus,
    MAX_MATCHES_PER_REPORT, MAX_MATCH_LINE_BYTES,
};
use tenure_protocol::placement::{check_labels, Labels, Placement};
use tenure_protocol::resources::ResourceSupport;
use tenure_protocol::resume::LossWitness;
use tenure_protocol::{Decision, Epoch, Event, Kind, Status, TaskId, TaskSpec, Unchanged, WorkerId};
use uuid::Uuid;

use super::{Core, Effect, Now, Version};

#[derive(Debug, Clone)]
struct WorkerState {
    /// The process this worker id is bound to: commands go to it alone, and
    /// heartbeats of another live process with the id are refused. `None`
    /// until the first heartbeat to this leader (a worker known from the
    /// registry at takeover): commands wait for it.
    instance: Option<Uuid>,
    /// The incarnation of the machine's store, as the last heartbeat that
    /// knew it said.
    incarnation: Option<Uuid>,
    slots: u32,
    kinds: BTreeSet<Kind>,
    last_seen: Duration,
    alive: bool,
    sidecar: SidecarHealth,
    /// An epoch above ours its last heartbeat (or refusal) claimed, not yet
    /// claimed in the registry: nothing is scheduled on it meanwhile.
    unproven_epoch: Option<Epoch>,
    /// It refused a grant for want of a slot (it had not yet released one
    /// this leader saw freed): nothing is granted to it before this time,
    /// and the refused task keeps its place in the dispatch order.
    full_until: Option<Duration>,
    /// Its labels, as its last heartbeat gave them (checked: a heartbeat
    /// with malformed labels is taken as one without any).
    labels: Labels,
    /// Which resource limits it enforces, as its last heartbeat said.
    enforces: ResourceSupport,
    /// The machine's boot id, as its last heartbeat said.
    boot: Option<Box<str>>,
}

impl WorkerState {
    /// Alive as of `now`, offering nothing until it heartbeats.
    fn new(instance: Option<Uuid>, now: Now) -> WorkerState {
        WorkerState {
            instance,
            incarnation: None,
            slots: 0,
            kinds: BTreeSet::new(),
            last_seen: now.mono,
            alive: true,
            sidecar: SidecarHealth::Ok,
            unproven_epoch: None,
            full_until: None,
            labels: Labels::new(),
            enforces: ResourceSupport::default(),
            boot: None,
        }
    }
}

/// Every worker this leader knows, by id.
#[derive(Debug, Default)]
pub(super) struct Workers {
    by_id: BTreeMap<WorkerId, WorkerState>,
}

impl Workers {
    /// A worker that holds tasks in the registry as loaded: known, and given
    /// a full TTL from `now` before it can be judged lost.
    pub(super) fn holding_tasks(&mut self, worker: &WorkerId, now: Now) {
        self.by_id.entry(worker.clone()).or_insert(WorkerState::new(None, now));
    }

    /// The live process `hb`'s worker id is bound to, when `hb` comes from
    /// another process that does not say it replaces it.
    fn bound_elsewhere(&self, hb: &Heartbeat, now: Now, ttl: Duration) -> Option<Uuid> {
        let w = self.by_id.get(&hb.worker)?;
        let holder = w.instance?;
        if holder == hb.instance {
            return None;
        }
        let holder_live = w.alive && now.mono.saturating_sub(w.last_seen) < ttl;
        if holder_live && hb.replaces != Some(holder) {
            return Some(holder);
        }
        tracing::info!(worker = %hb.worker, instance = %hb.instance, previous = %holder, "worker id bound to a new process");
        None
    }

    /// Takes in a heartbeat: the worker is alive, bound to its process, and
    /// offers what it says.
    fn beat(&mut self, hb: &Heartbeat, unproven_epoch: Option<Epoch>, now: Now) {
        let w = self.by_id.entry(hb.worker.clone()).or_insert(WorkerState::new(Some(hb.instance), now));
        if !w.alive {
            tracing::info!(worker = %hb.worker, "worker is back");
        }
        // A new process knows nothing of its predecessor's store: the
        // incarnation is what it says, unknown until its sidecar answers.
        let rebound = w.instance != Some(hb.instance);
        w.instance = Some(hb.instance);
        if rebound || hb.incarnation.is_some() {
            w.incarnation = hb.incarnation;
        }
        w.slots = hb.slots;
        w.kinds = hb.kinds.iter().cloned().collect();
        w.last_seen = now.mono;
        w.alive = true;
        w.sidecar = hb.sidecar;
        w.unproven_epoch = unproven_epoch;
        if w.labels != hb.labels {
            w.labels = match check_labels(&hb.labels) {
                Ok(()) => hb.labels.clone(),
                Err(error) => {
                    tracing::warn!(worker = %hb.worker, %error, "worker labels refused: it is taken as unlabelled");
                    Labels::new()
                }
            };
        }
        w.enforces = hb.enforces;
        w.boot = hb.boot.clone();
    }

    /// Marks lost every live worker not heard from for `ttl`; returns them.
    pub(super) fn judge_lost(&mut self, now: Now, ttl: Duration) -> Vec<WorkerId> {
        self.by_id
            .iter_mut()
            .filter(|(_, w)| w.alive && now.mono.saturating_sub(w.last_seen) > ttl)
            .map(|(id, w)| {
                w.alive = false;
                id.clone()
            })
            .collect()
    }

    pub(super) fn alive(&self, worker: &WorkerId) -> bool {
        self.by_id.get(worker).is_some_and(|w| w.alive)
    }

    /// Known and judged lost (a worker this leader never knew is not lost).
    pub(super) fn lost(&self, worker: &WorkerId) -> bool {
        self.by_id.get(worker).is_some_and(|w| !w.alive)
    }

    /// The process `worker` is bound to, once one heartbeated to this leader.
    pub(super) fn instance_of(&self, worker: &WorkerId) -> Option<Uuid> {
        self.by_id.get(worker).and_then(|w| w.instance)
    }

    /// The incarnation of `worker`'s store, as its latest heartbeat named it.
    pub(super) fn incarnation_of(&self, worker: &WorkerId) -> Option<Uuid> {
        self.by_id.get(worker).and_then(|w| w.incarnation)
    }

    /// The boot id of `worker`'s machine, as its latest heartbeat named it.
    pub(super) fn boot_of(&self, worker: &WorkerId) -> Option<&str> {
        self.by_id.get(worker).and_then(|w| w.boot.as_deref())
    }

    /// Whether `worker` advertised `kind`.
    pub(super) fn runs(&self, worker: &WorkerId, kind: &Kind) -> bool {
        self.by_id.get(worker).is_some_and(|w| w.kinds.contains(kind))
    }

    /// Whether `worker` may run `spec` besides its kind: its labels satisfy
    /// the placement, and it enforces every resource limit.
    pub(super) fn admits(&self, worker: &WorkerId, spec: &TaskSpec) -> bool {
        self.by_id.get(worker).is_some_and(|w| fits(w, spec))
    }

    /// The live workers that run `kind`, with their labels and whether `spec`
    /// fits them.
    pub(super) fn live_running<'a>(
        &'a self,
        spec: &'a TaskSpec,
    ) -> impl Iterator<Item = (&'a WorkerId, &'a Labels, ResourceSupport)> + 'a {
        self.by_id
            .iter()
            .filter(move |(_, w)| w.alive && w.kinds.contains(&spec.kind))
            .map(|(id, w)| (id, &w.labels, w.enforces))
    }

    /// `worker` refused a grant of `kind`: it is not offered there again
    /// until its next heartbeat says otherwise.
    pub(super) fn no_longer_runs(&mut self, worker: &WorkerId, kind: &Kind) {
        if let Some(w) = self.by_id.get_mut(worker) {
            w.kinds.remove(kind);
        }
    }

    /// `worker` claims `epoch`, above ours and not yet proven.
    pub(super) fn claims_epoch(&mut self, worker: &WorkerId, epoch: Epoch) {
        if let Some(w) = self.by_id.get_mut(worker) {
            w.unproven_epoch = Some(epoch);
        }
    }

    /// Every kind some known worker (alive now, or lost but not forgotten) advertised.
    pub(super) fn kinds(&self) -> impl Iterator<Item = &Kind> {
        self.by_id.values().flat_map(|w| w.kinds.iter())
    }

    /// Free slots of the workers new work may go to, given the slots in use.
    /// `worker` refused a grant for want of a slot: nothing more for it before `until`.
    pub(super) fn full_until(&mut self, worker: &WorkerId, until: Duration) {
        if let Some(w) = self.by_id.get_mut(worker) {
            w.full_until = Some(until);
        }
    }

    pub(super) fn free_slots(&self, load: &HashMap<WorkerId, u32>, now: Now) -> BTreeMap<WorkerId, u32> {
        self.by_id
            .iter()
            // A machine whose sidecar is down or degraded would refuse the
            // grant, and one that claims an epoch no coordinator claimed too.
            // Only a process that heartbeated to this leader, with its store's
            // incarnation: the grant is recorded against that store.
            .filter(|(_, w)| {
                w.alive
                    && w.sidecar == SidecarHealth::Ok
                    && w.unproven_epoch.is_none()
                    && w.instance.is_some()
                    && w.incarnation.is_some()
                    && w.full_until.is_none_or(|until| now.mono >= until)
            })
            .map(|(id, w)| (id.clone(), w.slots.saturating_sub(load.get(id).copied().unwrap_or(0))))
            .filter(|(_, f)| *f > 0)
            .collect()
    }

    /// How long ago each known worker was last heard from.
    pub(super) fn ages(&self, now: Now) -> Vec<(WorkerId, Duration)> {
        self.by_id.iter().map(|(id, w)| (id.clone(), now.mono.saturating_sub(w.last_seen))).collect()
    }

    /// The status view of every known worker, given the slots in use.
    pub(super) fn statuses(&self, load: &HashMap<WorkerId, u32>, now: Now) -> Vec<WorkerStatus> {
        self.by_id
            .iter()
            .map(|(id, w)| WorkerStatus {
                id: id.clone(),
                slots: w.slots,
                running: load.get(id).copied().unwrap_or(0),
                kinds: w.kinds.iter().cloned().collect(),
                last_seen_ms: now.mono.saturating_sub(w.last_seen).as_millis() as u64,
                alive: w.alive,
                sidecar: w.sidecar,
                unproven_epoch: w.unproven_epoch,
                labels: w.labels.clone(),
                enforces: w.enforces,
            })
            .collect()
    }
}

/// Whether `spec`'s placement admits `w`'s labels and `w` enforces every
/// resource limit of it.
fn fits(w: &WorkerState, spec: &TaskSpec) -> bool {
    let placed = spec.placement.as_deref().is_none_or(|p: &Placement| p.admits(&w.labels));
    let enforced = spec.resources.as_deref().is_none_or(|r| r.unmet_by(&w.enforces).is_empty());
    placed && enforced
}

impl Core {
    /// A worker's heartbeat: binds its id to one live process, refreshes
    /// what it offers, and checks what it holds against the registry.
    pub(super) fn heartbeat(&mut self, hb: Heartbeat, now: Now, fx: &mut Vec<Effect>) {
        if let Some(holder) = self.workers.bound_elsewhere(&hb, now, self.cfg.worker_ttl) {
            tracing::warn!(
                worker = %hb.worker, instance = %hb.instance, %holder,
                "a second live process claims this worker id (the same id on two hosts?): refused, told to stop"
            );
            fx.push(Effect::InstanceTaken { worker: hb.worker, instance: hb.instance, holder });
            return;
        }
        // A higher epoch is believed only once the registry shows it claimed.
        let unproven = (hb.epoch_seen > self.epoch).then_some(hb.epoch_seen);
        if let Some(claimed) = unproven {
            self.epoch_claimed(claimed, format!("worker {}", hb.worker), now, fx);
        }
        self.workers.beat(&hb, unproven, now);
        self.stop_stale_copies(&hb.worker, &hb.attempts, fx);
        self.check_listed(&hb.worker, hb.incarnation, &hb.attempts, now, fx);
        self.reconcile_pauses(&hb.worker, &hb.attempts, now, fx);
        // Waiting for input: believed of the current attempt of a running
        // task on this very worker.
        for held in &hb.attempts {
            let current = self.tasks.get(&held.task).is_some_and(|r| {
                r.life.status == Status::Running
                    && r.life.attempt == held.attempt
                    && r.life.worker.as_ref() == Some(&hb.worker)
            });
            if current {
                self.dispatch.set_waiting(&held.task, held.waiting);
            }
        }
    }

    /// A worker's report about an attempt it holds; the answer says whether
    /// the worker may forget it.
    pub(super) fn report(&mut self, report: Report, now: Now, fx: &mut Vec<Effect>) -> ReportAck {
        // "Stale" says under which epoch it was decided: a worker believes
        // it only from a leader at or above the highest epoch it has seen.
        let stale = ReportAck::StaleAt { epoch: self.epoch };
        let Some(record) = self.tasks.get(&report.task) else {
            return stale;
        };
        if record.life.worker.as_ref() != Some(&report.worker) || record.life.attempt != report.attempt {
            return stale;
        }
        let event = match report.event {
            ReportEvent::Matched(lines) => return self.matched(&report.task, lines, now, fx),
            ReportEvent::Started { .. } => Event::Started { attempt: report.attempt, epoch: report.epoch },
            ReportEvent::Finished(outcome) => Event::Finished { attempt: report.attempt, epoch: report.epoch, outcome },
            ReportEvent::NotStarted { .. } => Event::Refused { attempt: report.attempt, epoch: report.epoch },
            ReportEvent::Lost(hint) => Event::Lost { attempt: report.attempt, epoch: report.epoch, hint },
            ReportEvent::Gone(hint) => {
                let (task, attempt) = (report.task.clone(), (report.attempt, report.epoch));
                let decision = self.attempt_lost(&task, attempt, hint, LossWitness::Worker, now, fx);
                return ack_of(decision, stale);
            }
        };
        let decision = self.event(&report.task, event, now, fx);
        ack_of(decision, stale)
    }

    /// Records how far a `monitor` task's matched lines were notified and publishes
    /// the new ones. Lines at or below the recorded offset are repeats.
    fn matched(&mut self, task: &TaskId, lines: Vec<MatchedLine>, now: Now, fx: &mut Vec<Effect>) -> ReportAck {
        let epoch = self.epoch;
        // An agent's lines feed its resume command's values.
        if self.tasks.get(task).is_some_and(|r| r.spec.resume.is_some()) {
            self.captured(task, &lines, fx);
            return ReportAck::Ack;
        }
        let Some(r) = self.tasks.get_mut(task).filter(|r| r.spec.pattern.is_some()) else {
            return ReportAck::StaleAt { epoch };
        };
        let through = r.matched_through;
        let mut lines = lines;
        lines.sort_by_key(|l| l.offset);
        lines.dedup_by_key(|l| l.offset);
        let fresh: Vec<MatchedLine> = lines
            .into_iter()
            // `through` saturates: at `u64::MAX` every offset was notified.
            .filter(|l| l.offset >= through && through < u64::MAX)
            .take(MAX_MATCHES_PER_REPORT)
            .map(|l| match l.text.len() > MAX_MATCH_LINE_BYTES {
                true => MatchedLine::new(l.offset, &l.text),
                false => l,
            })
            .collect();
        let Some(last) = fresh.iter().map(|l| l.offset).max() else { return ReportAck::Ack };
        r.matched_through = last.saturating_add(1);
        r.matches = r.matches.saturating_add(fresh.len() as u64);
        fx.push(Effect::Persist(Box::new(r.clone()), Version::Later));
        for line in fresh {
            tracing::info!(task = %task, offset = line.offset, "monitor line matched");
            let notice = MatchNotice {
                task: task.clone(),
                owner: r.owner.clone(),
                label: r.spec.label.clone(),
                line,
                at_ms: now.wall_ms,
            };
            fx.push(Effect::Notify(Box::new(Notice::Matched(notice))));
        }
        ReportAck::Ack
    }
}

/// The answer to a report whose event was applied with `decision`: anything
/// but a stale attempt is recorded (or was already).
fn ack_of(decision: Option<Decision>, stale: ReportAck) -> ReportAck {
    match decision {
        Some(Decision::Changed(_))
        | Some(Decision::Unchanged(Unchanged::Duplicate | Unchanged::Terminal | Unchanged::NotApplicable)) => {
            ReportAck::Ack
        }
        Some(Decision::Unchanged(Unchanged::Stale)) | None => stale,
    }
}
