//! One worker machine: the real sidecar decision logic (`Machine<MemoryStore>`),
//! the attempts' monitored processes, and a model of the worker process that
//! follows the real worker's protocol step by step (`worker/src/service.rs`
//! and `worker/src/attempt.rs`): accept → intent → spawn → spawned → watch →
//! exited → report until acknowledged → acknowledged, start-up recovery from
//! the sidecar's records, kills, heartbeats and epoch announcements.
//!
//! What survives what, as on a real machine:
//!
//! | crash   | worker memory | sidecar records | processes (monitors) | exit status files |
//! |---------|---------------|-----------------|----------------------|-------------------|
//! | worker  | lost          | kept            | keep running         | kept              |
//! | sidecar | kept          | kept (flushed)  | keep running         | kept              |
//! | machine | lost          | kept (flushed)  | die, no status       | kept              |
//!
//! Each held attempt advances at most one step per tick, and only sometimes,
//! so crashes land between any two steps. Every process start is reported to
//! the checker's ledger.

use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use rand::Rng;
use tenure_machine::evidence::{self, FileFacts, RecordView, Settled};
use tenure_protocol::messages::{
    EvidenceReply, EvidenceRequest, Heartbeat, HeldAttempt, KillCommand, LeaseGrant, Phase, Refusal, Report, ReportAck,
    ReportEvent, SidecarRefusal, SidecarReply, SidecarRequest, WorkerCommand, WorkerReply,
};
use tenure_protocol::{Attempt, Ending, Epoch, Kind, Outcome, TaskId, WorkerId};
use tenure_sidecar::{Machine, MemoryStore};
use uuid::Uuid;

use super::bus::{Asked, Dest, Envelope, Msg, Node, Reply, ReqId};
use super::coord::host_id;
use super::{Bug, Ctx, HEARTBEAT_EVERY, REPORT_TIMEOUT};

type Key = (TaskId, Attempt);

/// An attempt's monitor and process group, as the machine sees it.
#[derive(Debug, Clone)]
enum Proc {
    Running {
        until: u64,
        outcome: Outcome,
        killed: bool,
    },
    /// The monitor recorded the exit status (a file: it survives everything).
    Exited(Outcome),
    /// The monitor died without recording anything (killed, or the machine went down).
    Dead,
}

/// The sidecar process around the real `Machine`; its store is the disk.
struct Sidecar {
    machine: Option<Machine<MemoryStore>>,
    disk: Option<MemoryStore>,
    down_until: u64,
}

impl Sidecar {
    fn crash(&mut self, until: u64) {
        if let Some(m) = self.machine.take() {
            self.disk = Some(m.into_store());
        }
        self.down_until = self.down_until.max(until);
    }

    fn restore(&mut self) {
        if let Some(disk) = self.disk.take() {
            self.machine = Some(Machine::restore(disk).expect("a memory store always loads"));
        }
    }

    /// One request over the local socket; `None` while the sidecar is down.
    fn call(&mut self, ctx: &mut Ctx, host: usize, req: SidecarRequest) -> Option<SidecarReply> {
        let Some(machine) = self.machine.as_mut() else {
            ctx.note(|| format!("m{host} sidecar down: {}", fmt_sidecar(&req)));
            return None;
        };
        let fenced = match &req {
            SidecarRequest::Accept(g) => Some(("accept", g.epoch)),
            SidecarRequest::Intent { epoch, .. } => Some(("intent", *epoch)),
            SidecarRequest::ObserveEpoch(e) => Some(("observe", *e)),
            _ => None,
        };
        let line = if ctx.trace.enabled { fmt_sidecar(&req) } else { String::new() };
        let reply = machine.handle(req);
        if let (SidecarReply::Ok, Some((what, epoch))) = (&reply, fenced) {
            ctx.check.sidecar_ok(host, what, epoch, machine.epoch());
        }
        if ctx.trace.enabled && !matches!(reply, SidecarReply::Records { .. }) {
            let reply = format!("{reply:?}");
            ctx.note(|| format!("m{host} sidecar {line} → {}", super::clip(&reply)));
        }
        Some(reply)
    }

    fn evidence(
        &mut self,
        ctx: &mut Ctx,
        host: usize,
        r: &EvidenceRequest,
    ) -> Option<Result<RecordView, SidecarRefusal>> {
        let machine = self.machine.as_mut()?;
        let view = machine.evidence(&r.task, r.attempt, r.epoch, r.incarnation);
        if view.is_ok() {
            ctx.check.sidecar_ok(host, "answer evidence", r.epoch, machine.epoch());
        }
        Some(view)
    }
}

/// One attempt the worker process holds.
#[derive(Debug, Clone)]
struct Held {
    /// Shared: a step reads a copy of its attempt every tick.
    grant: Rc<LeaseGrant>,
    /// The epoch its reports carry (at least; the worker's newest is added).
    epoch: Epoch,
    kill: bool,
    signalled: bool,
    started_acked: bool,
    report: Option<ReqId>,
    step: Step,
}

#[derive(Debug, Clone)]
enum Step {
    Intent,
    Abandon(String),
    Spawn,
    Spawned(i32),
    Watch(i32),
    Exited(Outcome),
    Report(ReportEvent),
    Acknowledge,
}

/// A report sent for an attempt the worker does not hold (a recovered
/// `accepted` record given back): not listed in heartbeats, not killable.
#[derive(Debug, Clone)]
struct Detached {
    key: Key,
    epoch: Epoch,
    event: ReportEvent,
    report: Option<ReqId>,
}

/// The worker process's memory: lost when it crashes.
struct WorkerProc {
    incarnation: u64,
    instance: Uuid,
    /// The instance that ran on this machine before (the data directory's
    /// record of it), named in heartbeats as the real worker does.
    replaces: Option<Uuid>,
    epoch_seen: Epoch,
    /// Start-up recovery done; until then it neither heartbeats nor takes commands.
    recovered: bool,
    held: BTreeMap<Key, Held>,
    detached: Vec<Detached>,
    /// Grants refused and kills of attempts never held: a late copy of their
    /// grant is refused too (in memory, as in the real worker).
    given_back: BTreeSet<Key>,
}

pub struct Host {
    pub index: usize,
    pub id: WorkerId,
    slots: u32,
    up: bool,
    down_until: u64,
    side: Sidecar,
    procs: BTreeMap<Key, Proc>,
    worker: Option<WorkerProc>,
    worker_down_until: u64,
    next_pid: i32,
    incarnations: u64,
    /// The worker instance last started on this machine (its data directory's record).
    last_instance: Option<Uuid>,
    /// When the next heartbeat is due.
    next_beat: u64,
    bug: Bug,
}

/// What a simulated task does: `sleep <ticks>; exit <code>`.
fn behaviour(command: &str) -> (u64, Outcome) {
    let mut words = command.split([' ', ';']).filter(|w| !w.is_empty());
    let ticks = words.nth(1).and_then(|w| w.parse().ok()).unwrap_or(1);
    let code: i32 = words.nth(1).and_then(|w| w.parse().ok()).unwrap_or(0);
    let outcome = if code == 0 {
        Outcome::new(Ending::Completed, Some(0), None)
    } else {
        Outcome::new(Ending::Failed, Some(code), Some(format!("exit code: {code}")))
    };
    (ticks, outcome)
}

impl Host {
    pub fn new(index: usize, slots: u32, first_beat: u64, bug: Bug) -> Host {
        let machine = Machine::restore(MemoryStore::new()).expect("an empty memory store loads");
        Host {
            index,
            id: host_id(index),
            slots,
            up: true,
            down_until: 0,
            side: Sidecar { machine: Some(machine), disk: None, down_until: 0 },
            procs: BTreeMap::new(),
            worker: None,
            worker_down_until: 0,
            next_pid: 100,
            incarnations: 0,
            last_instance: None,
            next_beat: first_beat,
            bug,
        }
    }

    fn node(&self) -> Node {
        Node::Machine(self.index)
    }

    fn w(&mut self) -> &mut WorkerProc {
        self.worker.as_mut().expect("called only while the worker runs")
    }

    fn held(&self, key: &Key) -> Option<Held> {
        self.worker.as_ref().and_then(|w| w.held.get(key)).cloned()
    }

    fn update(&mut self, key: &Key, f: impl FnOnce(&mut Held)) {
        if let Some(h) = self.worker.as_mut().and_then(|w| w.held.get_mut(key)) {
            f(h);
        }
    }

    // ------------------------------------------------------------ faults

    pub fn crash_worker(&mut self, ctx: &mut Ctx, ticks: u64) {
        if self.up && self.worker.take().is_some() {
            self.worker_down_until = ctx.now + ticks;
            let i = self.index;
            ctx.note(|| format!("FAULT m{i} worker crashes for {ticks} ticks"));
        }
    }

    pub fn crash_sidecar(&mut self, ctx: &mut Ctx, ticks: u64) {
        if self.up && self.side.machine.is_some() {
            self.side.crash(ctx.now + ticks);
            let i = self.index;
            ctx.note(|| format!("FAULT m{i} sidecar crashes for {ticks} ticks"));
        }
    }

    /// Power loss: every process dies; records and status files stay.
    pub fn crash_machine(&mut self, ctx: &mut Ctx, ticks: u64) {
        if !self.up {
            return;
        }
        self.up = false;
        self.down_until = ctx.now + ticks;
        self.worker = None;
        self.side.crash(0);
        for p in self.procs.values_mut() {
            if matches!(p, Proc::Running { .. }) {
                *p = Proc::Dead;
            }
        }
        let i = self.index;
        ctx.note(|| format!("FAULT m{i} machine crashes for {ticks} ticks"));
    }

    /// An operator's mistake: the machine crashes and its data directory is
    /// lost — the store (a new one, another incarnation), the attempt files
    /// and the worker's record of its last instance.
    pub fn wipe_machine(&mut self, ctx: &mut Ctx, ticks: u64) {
        if !self.up {
            return;
        }
        self.crash_machine(ctx, ticks);
        self.side.disk = Some(MemoryStore::with_incarnation(Uuid::from_u128(ctx.rng.gen())));
        self.procs.clear();
        self.last_instance = None;
        let i = self.index;
        ctx.check.store_replaced(i);
        ctx.note(|| format!("FAULT m{i} data directory wiped"));
    }

    /// SIGKILL of one running monitor: its group is gone and nothing is recorded.
    pub fn kill_monitor(&mut self, ctx: &mut Ctx) {
        let running: Vec<Key> =
            self.procs.iter().filter(|(_, p)| matches!(p, Proc::Running { .. })).map(|(k, _)| k.clone()).collect();
        if running.is_empty() || !self.up {
            return;
        }
        let key = running[ctx.rng.gen_range(0..running.len())].clone();
        self.procs.insert(key.clone(), Proc::Dead);
        let i = self.index;
        ctx.note(|| format!("FAULT m{i} monitor of {}#{} killed", key.0, key.1));
    }

    pub fn heal(&mut self, now: u64) {
        self.down_until = self.down_until.min(now);
        self.worker_down_until = self.worker_down_until.min(now);
        self.side.down_until = self.side.down_until.min(now);
    }

    /// Why this machine is not settled yet, if it is not.
    pub fn busy(&self) -> Option<String> {
        let i = self.index;
        let Some(w) = self.worker.as_ref().filter(|w| w.recovered && self.up) else {
            return Some(format!("m{i}: worker not running"));
        };
        if let Some((k, h)) = w.held.iter().next() {
            return Some(format!("m{i}: holds {}#{} at {:?}", k.0, k.1, h.step));
        }
        if let Some(d) = w.detached.first() {
            return Some(format!("m{i}: still reporting {}#{} {:?}", d.key.0, d.key.1, d.event));
        }
        if let Some((k, _)) = self.procs.iter().find(|(_, p)| matches!(p, Proc::Running { .. })) {
            return Some(format!("m{i}: {}#{} still runs", k.0, k.1));
        }
        None
    }

    // ------------------------------------------------------------ time

    pub fn tick(&mut self, ctx: &mut Ctx) {
        let i = self.index;
        if !self.up {
            if ctx.now < self.down_until {
                return;
            }
            self.up = true;
            ctx.note(|| format!("m{i} machine boots"));
        }
        for (key, p) in self.procs.iter_mut() {
            if let Proc::Running { until, outcome, killed } = p {
                let ended = if *killed {
                    Some(Outcome::new(Ending::Killed, None, Some("signal 15".into())))
                } else {
                    (ctx.now >= *until).then(|| outcome.clone())
                };
                if let Some(o) = ended {
                    ctx.note(|| format!("m{i} process {}#{} exits: {:?}", key.0, key.1, o.ending));
                    *p = Proc::Exited(o);
                }
            }
        }
        if self.side.machine.is_none() && ctx.now >= self.side.down_until {
            self.side.restore();
            ctx.note(|| format!("m{i} sidecar starts"));
        }
        if self.worker.is_none() && ctx.now >= self.worker_down_until {
            self.incarnations += 1;
            let instance = Uuid::from_u128(ctx.rng.gen());
            self.worker = Some(WorkerProc {
                incarnation: self.incarnations,
                instance,
                replaces: self.last_instance.replace(instance),
                epoch_seen: Epoch(0),
                recovered: false,
                held: BTreeMap::new(),
                detached: Vec::new(),
                given_back: BTreeSet::new(),
            });
            ctx.note(|| format!("m{i} worker starts"));
        }
        if self.worker.is_none() {
            return;
        }
        if !self.w().recovered && !self.recover(ctx) {
            return;
        }
        if ctx.now >= self.next_beat {
            self.next_beat = ctx.now + HEARTBEAT_EVERY;
            self.heartbeat(ctx);
        }
        let keys: Vec<Key> = self.w().held.keys().cloned().collect();
        for key in keys {
            if ctx.rng.gen_bool(0.7) {
                self.advance(ctx, key);
            }
        }
        for d in 0..self.w().detached.len() {
            let det = self.w().detached[d].clone();
            if det.report.is_none() {
                let req = self.send_report(ctx, &det.key, det.epoch, det.event);
                self.w().detached[d].report = Some(req);
            }
        }
    }

    fn heartbeat(&mut self, ctx: &mut Ctx) {
        let w = self.worker.as_ref().expect("heartbeats come from a running worker");
        let hb = Heartbeat {
            worker: self.id.clone(),
            instance: w.instance,
            slots: self.slots,
            kinds: vec![Kind::shell()],
            sidecar: Default::default(),
            epoch_seen: w.epoch_seen,
            attempts: w
                .held
                .keys()
                .map(|(task, attempt)| HeldAttempt { task: task.clone(), attempt: *attempt })
                .collect(),
            replaces: w.replaces,
            incarnation: self.side.machine.as_ref().map(|m| m.incarnation()),
            mark: self.side.machine.as_ref().and_then(|m| m.mark()),
        };
        ctx.bus.send(&mut ctx.rng, ctx.now, self.node(), Dest::Coordinators, Msg::Heartbeat(hb));
    }

    fn send_report(&mut self, ctx: &mut Ctx, key: &Key, epoch: Epoch, event: ReportEvent) -> ReqId {
        let (node, worker) = (self.node(), self.id.clone());
        let w = self.w();
        let report = Report { worker, task: key.0.clone(), attempt: key.1, epoch: w.epoch_seen.max(epoch), event };
        let line = if ctx.trace.enabled { format!("{:?} e{}", report.event, report.epoch) } else { String::new() };
        let incarnation = w.incarnation;
        let (req, fate) = ctx.bus.request(
            &mut ctx.rng,
            ctx.now,
            node,
            incarnation,
            Dest::Leader,
            REPORT_TIMEOUT,
            Asked::Report,
            |req| Msg::Report { req, report },
        );
        let i = self.index;
        ctx.note(|| format!("m{i} report #{req} {}#{} {}: {fate}", key.0, key.1, super::clip(&line)));
        req
    }

    // ------------------------------------------------------------ recovery

    /// Start-up recovery from the sidecar's records (`attempt::recover`).
    /// Returns false while the sidecar cannot answer.
    fn recover(&mut self, ctx: &mut Ctx) -> bool {
        let i = self.index;
        let Some(SidecarReply::Records { epoch, records, .. }) = self.side.call(ctx, i, SidecarRequest::List) else {
            return false;
        };
        let w = self.w();
        w.epoch_seen = w.epoch_seen.max(epoch);
        for record in records {
            let key = (record.grant.task.clone(), record.grant.attempt);
            let mut held = Held {
                epoch: record.grant.epoch,
                grant: Rc::new(record.grant.clone()),
                kill: false,
                signalled: false,
                started_acked: true,
                report: None,
                step: Step::Intent,
            };
            held.step = match record.phase {
                Phase::Acknowledged => continue,
                Phase::Accepted => {
                    self.side.call(ctx, i, SidecarRequest::Abandon { task: key.0.clone(), attempt: key.1 });
                    let event = ReportEvent::NotStarted { reason: "worker restarted before the intent".into() };
                    let detached = Detached { key, epoch: record.grant.epoch, event, report: None };
                    self.w().detached.push(detached);
                    continue;
                }
                Phase::Exited => match record.outcome {
                    Some(o) => Step::Report(ReportEvent::Finished(o)),
                    None => continue,
                },
                Phase::Intent | Phase::Spawned => match self.procs.get(&key) {
                    Some(Proc::Exited(o)) => Step::Exited(o.clone()),
                    Some(Proc::Running { .. }) => Step::Watch(record.pid.unwrap_or(0)),
                    Some(Proc::Dead) | None => match evidence::settle(None, false, None, false, key.1) {
                        Settled::Exited(outcome) => Step::Exited(outcome),
                        Settled::Lost(hint) => Step::Report(ReportEvent::Lost(hint)),
                    },
                },
            };
            ctx.note(|| format!("m{i} recovers {}#{} at {:?}", key.0, key.1, held.step));
            self.w().held.insert(key, held);
        }
        self.w().recovered = true;
        ctx.note(|| format!("m{i} worker recovered; epoch seen e{epoch}"));
        true
    }

    // ------------------------------------------------------------ messages

    pub fn deliver(&mut self, ctx: &mut Ctx, env: Envelope) {
        let (i, node) = (self.index, self.node());
        let timer = matches!(env.msg, Msg::Timeout { .. });
        if !self.up || (!timer && ctx.bus.is_partitioned(node, ctx.now)) {
            return;
        }
        let running = self.worker.as_ref().is_some_and(|w| w.recovered);
        match env.msg {
            Msg::Command { req, command, instance } => {
                // Nobody subscribed (or only another process, on its own
                // subject): the request times out.
                if !running || self.worker.as_ref().is_some_and(|w| w.instance != instance) {
                    return;
                }
                let reply = match command {
                    WorkerCommand::Grant(g) => self.on_grant(ctx, g),
                    WorkerCommand::Kill(k) => self.on_kill(ctx, k),
                    // The model runs one process per worker id.
                    WorkerCommand::InstanceTaken { .. } => None,
                };
                let Some(reply) = reply else { return };
                let line = if ctx.trace.enabled { format!("{reply:?}") } else { String::new() };
                let fate = ctx.bus.reply(&mut ctx.rng, ctx.now, node, req, Reply::Worker(reply));
                ctx.note(|| format!("m{i} answers #{req} {}: {fate}", super::clip(&line)));
            }
            Msg::AskEvidence { req, request } => {
                let Some(answer) = self.evidence(ctx, &request) else { return };
                let line = if ctx.trace.enabled { format!("{answer:?}") } else { String::new() };
                let fate = ctx.bus.reply(&mut ctx.rng, ctx.now, node, req, Reply::Evidence(answer));
                ctx.note(|| format!("m{i} evidence #{req} {}#{}: {line}: {fate}", request.task, request.attempt));
            }
            Msg::EpochAnnounce(epoch) => {
                if running {
                    if let Some(SidecarReply::Ok) = self.side.call(ctx, i, SidecarRequest::ObserveEpoch(epoch)) {
                        let w = self.w();
                        w.epoch_seen = w.epoch_seen.max(epoch);
                    }
                }
            }
            Msg::Reply { req, reply: Reply::Ack(ack) } => {
                let Some(incarnation) = self.worker.as_ref().map(|w| w.incarnation) else { return };
                if ctx.bus.claim(req, node, incarnation).is_some() {
                    self.on_ack(ctx, req, ack);
                }
            }
            Msg::Timeout { req } => {
                let Some(incarnation) = self.worker.as_ref().map(|w| w.incarnation) else { return };
                if ctx.bus.claim(req, node, incarnation).is_some() {
                    self.on_ack(ctx, req, ReportAck::NotLeader);
                }
            }
            other => panic!("m{i}: not a worker message: {other:?}"),
        }
    }

    /// A refused grant (or a kill of an attempt never held here) tells the
    /// leader the attempt did not run and gives it back; the worker remembers
    /// it (in memory) and refuses any late copy of the grant.
    fn refuse(&mut self, key: &Key, refusal: Refusal) -> Option<WorkerReply> {
        self.w().given_back.insert(key.clone());
        Some(WorkerReply::Refused(refusal))
    }

    /// `service::on_grant`. `None`: no answer (the request times out).
    fn on_grant(&mut self, ctx: &mut Ctx, grant: LeaseGrant) -> Option<WorkerReply> {
        let key = (grant.task.clone(), grant.attempt);
        let slots = self.slots as usize;
        if self.w().held.contains_key(&key) {
            return Some(WorkerReply::Accepted);
        }
        if self.w().given_back.contains(&key) {
            return self.refuse(&key, Refusal::UnknownAttempt);
        }
        if self.w().held.len() >= slots {
            return self.refuse(&key, Refusal::NoSlot);
        }
        let i = self.index;
        match self.side.call(ctx, i, SidecarRequest::Accept(grant.clone())) {
            Some(SidecarReply::Ok) => {}
            Some(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
                let w = self.w();
                w.epoch_seen = w.epoch_seen.max(held);
                return self.refuse(&key, Refusal::StaleEpoch { held, offered });
            }
            // As the real worker: a late copy of a grant this machine already
            // acted on is answered `Accepted` and starts nothing.
            Some(SidecarReply::Refused(SidecarRefusal::WrongPhase { task, attempt, phase, .. }))
                if task == key.0 && attempt == key.1 && phase > Phase::Accepted =>
            {
                let i = self.index;
                ctx.note(|| format!("m{i}: {task}#{attempt} is already {phase:?} here: accepted, nothing started"));
                return Some(WorkerReply::Accepted);
            }
            // As the real worker: a store failure is no give-back (the store
            // may hold the attempt's intent); the leader asks its evidence.
            Some(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                return Some(WorkerReply::Refused(Refusal::SidecarStorage(reason)))
            }
            Some(other) => return self.refuse(&key, Refusal::SidecarUnavailable(format!("{other:?}"))),
            None => return self.refuse(&key, Refusal::SidecarUnavailable("sidecar down".into())),
        }
        let step = if self.bug == Bug::SkipIntent { Step::Spawn } else { Step::Intent };
        let w = self.w();
        w.epoch_seen = w.epoch_seen.max(grant.epoch);
        let held = Held {
            epoch: grant.epoch,
            grant: Rc::new(grant),
            kill: false,
            signalled: false,
            started_acked: false,
            report: None,
            step,
        };
        w.held.insert(key, held);
        Some(WorkerReply::Accepted)
    }

    /// `service::on_kill`. `None`: no answer.
    fn on_kill(&mut self, ctx: &mut Ctx, cmd: KillCommand) -> Option<WorkerReply> {
        let i = self.index;
        match self.side.call(ctx, i, SidecarRequest::ObserveEpoch(cmd.epoch)) {
            Some(SidecarReply::Ok) => {
                let w = self.w();
                w.epoch_seen = w.epoch_seen.max(cmd.epoch);
            }
            Some(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
                return Some(WorkerReply::Refused(Refusal::StaleEpoch { held, offered }))
            }
            Some(other) => return Some(WorkerReply::Refused(Refusal::SidecarUnavailable(format!("{other:?}")))),
            None => return Some(WorkerReply::Refused(Refusal::SidecarUnavailable("sidecar down".into()))),
        }
        let key = (cmd.task, cmd.attempt);
        match self.w().held.get_mut(&key) {
            Some(h) => {
                h.kill = true;
                Some(WorkerReply::Accepted)
            }
            None => self.refuse(&key, Refusal::UnknownAttempt),
        }
    }

    /// The sidecar's records judged together with the monitor's files, by
    /// the machine's one verdict (as the sidecar server does). `None`: nobody
    /// answers.
    fn evidence(&mut self, ctx: &mut Ctx, r: &EvidenceRequest) -> Option<EvidenceReply> {
        let view = self.side.evidence(ctx, self.index, r)?;
        let proc = self.procs.get(&(r.task.clone(), r.attempt));
        let files = FileFacts {
            status: match proc {
                Some(Proc::Exited(o)) => Some(o.clone()),
                _ => None,
            },
            monitor_alive: matches!(proc, Some(Proc::Running { .. })),
            // An attempt gets its directory (and grant) before its process.
            has_grant: proc.is_some(),
        };
        Some(evidence::answer(view, &files))
    }

    /// A report's answer (or its timeout, as `NotLeader`: retry).
    fn on_ack(&mut self, ctx: &mut Ctx, req: ReqId, ack: ReportAck) {
        let i = self.index;
        ctx.note(|| format!("m{i} ← #{req} {ack:?}"));
        let w = self.w();
        // `worker::attempt`: a "stale" from below the highest epoch seen is
        // not an answer.
        let retry = !ack.settles(w.epoch_seen);
        if let Some(d) = w.detached.iter().position(|d| d.report == Some(req)) {
            if retry {
                w.detached[d].report = None;
            } else {
                w.detached.remove(d);
            }
            return;
        }
        let Some((key, h)) = w.held.iter_mut().find(|(_, h)| h.report == Some(req)) else { return };
        h.report = None;
        if retry {
            return;
        }
        match &h.step {
            Step::Watch(_) => h.started_acked = true,
            Step::Report(ReportEvent::Finished(_)) => h.step = Step::Acknowledge,
            Step::Report(_) => {
                let key = key.clone();
                w.held.remove(&key);
            }
            _ => {}
        }
    }

    // ------------------------------------------------------------ attempts

    /// One step of one attempt (`attempt::run` and `attempt::finish`).
    fn advance(&mut self, ctx: &mut Ctx, key: Key) {
        let Some(h) = self.held(&key) else { return };
        let (i, task, attempt) = (self.index, key.0.clone(), key.1);
        match h.step {
            Step::Intent => {
                let epoch = h.grant.epoch.max(self.w().epoch_seen);
                match self.side.call(ctx, i, SidecarRequest::Intent { task, attempt, epoch, trace: None }) {
                    None => {}
                    Some(SidecarReply::Ok) => self.update(&key, |h| {
                        h.step = Step::Spawn;
                        h.epoch = epoch;
                    }),
                    Some(refusal) => self.update(&key, |h| h.step = Step::Abandon(format!("{refusal:?}"))),
                }
            }
            Step::Abandon(reason) => {
                if self.side.call(ctx, i, SidecarRequest::Abandon { task, attempt }).is_some() {
                    let epoch = h.grant.epoch;
                    self.update(&key, |h| {
                        h.step = Step::Report(ReportEvent::NotStarted { reason });
                        h.epoch = epoch;
                    });
                }
            }
            Step::Spawn => {
                let (ticks, outcome) = behaviour(&h.grant.spec.command);
                self.next_pid += 1;
                let pid = self.next_pid;
                let proc = Proc::Running { until: ctx.now + ticks, outcome, killed: h.kill };
                self.procs.insert(key.clone(), proc);
                ctx.note(|| format!("m{i} STARTS {task}#{attempt} pid {pid} (idempotent={})", h.grant.spec.idempotent));
                let id = self.id.clone();
                ctx.check.process_started(ctx.now, i, &id, &task, attempt, h.grant.spec.idempotent);
                self.update(&key, |h| {
                    h.signalled = h.kill;
                    h.step = Step::Spawned(pid);
                });
            }
            Step::Spawned(pid) => {
                if self.side.call(ctx, i, SidecarRequest::Spawned { task, attempt, pid }).is_some() {
                    self.update(&key, |h| h.step = Step::Watch(pid));
                }
            }
            Step::Watch(pid) => match self.procs.get_mut(&key) {
                Some(Proc::Running { killed, .. }) => {
                    if h.kill && !h.signalled {
                        *killed = true;
                        self.update(&key, |h| h.signalled = true);
                    }
                    if !h.started_acked && h.report.is_none() {
                        let req = self.send_report(ctx, &key, h.epoch, ReportEvent::Started { pid });
                        self.update(&key, |h| h.report = Some(req));
                    }
                }
                Some(Proc::Exited(o)) => {
                    let o = o.clone();
                    self.update(&key, |h| {
                        h.report = None;
                        h.step = Step::Exited(o);
                    });
                }
                Some(Proc::Dead) | None => {
                    let step = match evidence::settle(None, h.signalled || h.kill, None, false, attempt) {
                        Settled::Exited(outcome) => Step::Exited(outcome),
                        Settled::Lost(hint) => Step::Report(ReportEvent::Lost(hint)),
                    };
                    self.update(&key, |h| {
                        h.report = None;
                        h.step = step;
                    });
                }
            },
            Step::Exited(outcome) => {
                let req = SidecarRequest::Exited { task, attempt, outcome: outcome.clone() };
                if self.side.call(ctx, i, req).is_some() {
                    self.update(&key, |h| h.step = Step::Report(ReportEvent::Finished(outcome)));
                }
            }
            Step::Report(event) => {
                if h.report.is_none() {
                    let req = self.send_report(ctx, &key, h.epoch, event);
                    self.update(&key, |h| h.report = Some(req));
                }
            }
            Step::Acknowledge => {
                if self.side.call(ctx, i, SidecarRequest::Acknowledged { task, attempt }).is_some() {
                    self.w().held.remove(&key);
                }
            }
        }
    }
}

fn fmt_sidecar(req: &SidecarRequest) -> String {
    match req {
        SidecarRequest::ObserveEpoch(e) => format!("observe e{e}"),
        SidecarRequest::Accept(g) => format!("accept {}#{} e{}", g.task, g.attempt, g.epoch),
        SidecarRequest::Intent { task, attempt, epoch, .. } => format!("intent {task}#{attempt} e{epoch}"),
        SidecarRequest::Spawned { task, attempt, pid } => format!("spawned {task}#{attempt} pid {pid}"),
        SidecarRequest::Exited { task, attempt, outcome } => format!("exited {task}#{attempt} {:?}", outcome.ending),
        SidecarRequest::Acknowledged { task, attempt } => format!("acknowledged {task}#{attempt}"),
        SidecarRequest::Abandon { task, attempt } => format!("abandon {task}#{attempt}"),
        SidecarRequest::List | SidecarRequest::ListFrom { .. } => "list".into(),
        SidecarRequest::Incarnation => "incarnation".into(),
    }
}
