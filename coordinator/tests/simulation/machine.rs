//! One worker machine: the real sidecar decision logic (`Machine<MemoryStore>`),
//! the real worker core (`tenure_worker::core::Worker`: every grant, kill,
//! step, report answer and recovery decision), the machine's one evidence
//! verdict (`tenure_machine::evidence`), and around them a model of what the
//! real drivers do with the core's actions: sidecar calls, the shims and
//! their processes, reports over the bus.
//!
//! What survives what, as on a real machine:
//!
//! | crash   | worker memory | sidecar records | processes (shims) | exit status files |
//! |---------|---------------|-----------------|----------------------|-------------------|
//! | worker  | lost          | kept            | keep running         | kept              |
//! | sidecar | kept          | kept (flushed)  | keep running         | kept              |
//! | machine | lost          | kept (flushed)  | die, no status       | kept              |
//!
//! Each held attempt advances at most one step per tick, and only sometimes,
//! so crashes land between any two steps. Every process start is reported to
//! the checker's ledger.

use std::collections::BTreeMap;

use rand::Rng;
use tenure_machine::evidence::{self, FileFacts, RecordView, Settled};
use tenure_protocol::messages::{
    EvidenceReply, EvidenceRequest, Heartbeat, KillCommand, LeaseGrant, PauseCommand, Report, ReportAck, ReportEvent,
    SidecarRefusal, SidecarReply, SidecarRequest, WorkerCommand, WorkerReply,
};
use tenure_protocol::{Ending, Epoch, Kind, Outcome, WorkerId};
use tenure_sidecar::{Machine, MemoryStore};
use tenure_worker::core::{Action, Config, Done, Found, Key, Recovered, Screened, Worker};
use uuid::Uuid;

use super::bus::{Asked, Dest, Envelope, Msg, Node, Reply, ReqId};
use super::coord::host_id;
use super::{Bug, Ctx, HEARTBEAT_EVERY, REPORT_TIMEOUT};

/// An attempt's shim and process group, as the machine sees it.
#[derive(Debug, Clone)]
enum Proc {
    Running {
        until: u64,
        outcome: Outcome,
        killed: bool,
    },
    /// The shim recorded the exit status (a file: it survives everything).
    Exited(Outcome),
    /// The shim died without recording anything (killed, or the machine went down).
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

/// What the driver keeps for one held attempt besides the core's facts.
#[derive(Debug, Clone, Default)]
struct Local {
    /// The shim's pid, once launched (or recorded).
    pid: i32,
    /// The `Started` report was answered (or need not be sent: recovered).
    started_acked: bool,
    /// The kill was passed on to the process.
    signalled: bool,
    /// The report in flight.
    report: Option<ReqId>,
}

/// A report sent for an attempt the worker does not hold (recovery gave it
/// back, or its record is unreadable): not listed in heartbeats, not killable.
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
    /// Start-up recovery done; until then it neither heartbeats nor takes commands.
    recovered: bool,
    core: Worker,
    local: BTreeMap<Key, Local>,
    detached: Vec<Detached>,
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
    /// Boots of the machine so far (a power loss boots it again): its
    /// heartbeats name the boot, which proves what died with the last one.
    boots: u64,
}

/// What a simulated task does: `sleep <ticks>; exit <code>`, or, for a
/// flaky task, `sleep <ticks>; exit <code>; ok-from <attempt>`: attempts
/// before that one exit with the code, that one and later ones succeed.
fn behaviour(command: &str, attempt: u32) -> (u64, Outcome) {
    let mut words = command.split([' ', ';']).filter(|w| !w.is_empty());
    let ticks = words.nth(1).and_then(|w| w.parse().ok()).unwrap_or(1);
    let code: i32 = words.nth(1).and_then(|w| w.parse().ok()).unwrap_or(0);
    let ok_from: Option<u32> = words.nth(1).and_then(|w| w.parse().ok());
    let code = if ok_from.is_some_and(|from| attempt >= from) { 0 } else { code };
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
            boots: 0,
        }
    }

    fn node(&self) -> Node {
        Node::Machine(self.index)
    }

    fn w(&mut self) -> &mut WorkerProc {
        self.worker.as_mut().expect("called only while the worker runs")
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

    /// Power loss: every process dies; records and status files stay. The
    /// journal of an attempt that had no status yet was never synced
    /// (durability note a21): it comes back or not.
    pub fn crash_machine(&mut self, ctx: &mut Ctx, ticks: u64) {
        if !self.up {
            return;
        }
        self.up = false;
        self.down_until = ctx.now + ticks;
        self.boots += 1;
        self.worker = None;
        self.side.crash(0);
        let rng = &mut ctx.rng;
        self.procs.retain(|_, p| match p {
            Proc::Running { .. } if rng.gen_bool(0.5) => false,
            Proc::Running { .. } => {
                *p = Proc::Dead;
                true
            }
            _ => true,
        });
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

    /// SIGKILL of one running shim: its group is gone and nothing is recorded.
    pub fn kill_shim(&mut self, ctx: &mut Ctx) {
        let running: Vec<Key> =
            self.procs.iter().filter(|(_, p)| matches!(p, Proc::Running { .. })).map(|(k, _)| k.clone()).collect();
        if running.is_empty() || !self.up {
            return;
        }
        let key = running[ctx.rng.gen_range(0..running.len())].clone();
        self.procs.insert(key.clone(), Proc::Dead);
        let i = self.index;
        ctx.note(|| format!("FAULT m{i} shim of {}#{} killed", key.0, key.1));
    }

    /// The attempts whose modelled process runs now (rule 13).
    pub fn running(&self) -> impl Iterator<Item = &Key> {
        self.procs.iter().filter(|(_, p)| matches!(p, Proc::Running { .. })).map(|(k, _)| k)
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
        if let Some((k, h)) = w.core.keys().first().and_then(|k| Some((k, w.core.held(k)?))) {
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
                recovered: false,
                core: Worker::new(Config {
                    slots: self.slots,
                    kinds: vec![Kind::shell(), Kind::agent()],
                    enforces: Default::default(),
                }),
                local: BTreeMap::new(),
                detached: Vec::new(),
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
        let keys: Vec<Key> = self.w().core.keys();
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
            boot: Some(format!("m{}-boot{}", self.index, self.boots).into()),
            worker: self.id.clone(),
            instance: w.instance,
            slots: self.slots,
            kinds: vec![Kind::shell(), Kind::agent()],
            sidecar: Default::default(),
            epoch_seen: w.core.epoch_seen(),
            attempts: w.core.attempts(),
            replaces: w.replaces,
            incarnation: self.side.machine.as_ref().map(|m| m.incarnation()),
            mark: self.side.machine.as_ref().and_then(|m| m.mark()),
            labels: Default::default(),
            enforces: Default::default(),
        };
        ctx.bus.send(&mut ctx.rng, ctx.now, self.node(), Dest::Coordinators, Msg::Heartbeat(hb));
    }

    fn send_report(&mut self, ctx: &mut Ctx, key: &Key, epoch: Epoch, event: ReportEvent) -> ReqId {
        let (node, worker) = (self.node(), self.id.clone());
        let w = self.w();
        let report =
            Report { worker, task: key.0.clone(), attempt: key.1, epoch: w.core.epoch_seen().max(epoch), event };
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

    /// Start-up recovery (`attempt::recover`): the sidecar's records and the
    /// processes' state, decided by the core. Returns false while the
    /// sidecar cannot answer.
    fn recover(&mut self, ctx: &mut Ctx) -> bool {
        let i = self.index;
        let Some(SidecarReply::Records { epoch, records, .. }) = self.side.call(ctx, i, SidecarRequest::List) else {
            return false;
        };
        let found = records
            .into_iter()
            .map(|record| {
                let key = (record.grant.task.clone(), record.grant.attempt);
                let shim_alive = matches!(self.procs.get(&key), Some(Proc::Running { .. }));
                Found::Record { record, shim_alive, restarted: false }
            })
            .collect();
        let recovered = self.w().core.recover(epoch, found);
        for r in recovered {
            match r {
                Recovered::Abandon((task, attempt)) => {
                    self.side.call(ctx, i, SidecarRequest::Abandon { task, attempt });
                }
                Recovered::Report { key, epoch, event } => {
                    self.w().detached.push(Detached { key, epoch, event, report: None });
                }
                Recovered::Remove(_) => {}
            }
        }
        for key in self.w().core.keys() {
            let step = self.w().core.held(&key).map(|h| h.step.clone());
            ctx.note(|| format!("m{i} recovers {}#{} at {step:?}", key.0, key.1));
            // A re-attached attempt's started report is not sent again.
            self.w().local.insert(key, Local { started_acked: true, ..Local::default() });
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
                    WorkerCommand::Pause(p) => self.on_pause(ctx, p),
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
                        self.w().core.observe(epoch);
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

    /// `daemon::on_grants`: screened by the core, recorded by the sidecar
    /// with its intent (one batch: no crash between them), decided by the
    /// core. `None`: no answer (the request times out).
    fn on_grant(&mut self, ctx: &mut Ctx, grant: LeaseGrant) -> Option<WorkerReply> {
        let (i, key) = (self.index, (grant.task.clone(), grant.attempt));
        let answer = match self.w().core.screen_grant(&grant) {
            Screened::Answer(answer) => answer,
            Screened::Record => {
                let intent = self.w().core.intent_for(&grant, None);
                let recorded = self.side.call(ctx, i, SidecarRequest::Accept(grant.clone()));
                if let Some(SidecarReply::Refused(SidecarRefusal::WrongPhase { phase, .. })) = &recorded {
                    ctx.note(|| format!("m{i}: {}#{} is already {phase:?} here", key.0, key.1));
                }
                let intended = match self.bug {
                    // The planted bug: the intent is never recorded, yet taken as done.
                    Bug::SkipIntent => Some(SidecarReply::Ok),
                    _ => recorded.as_ref().and_then(|_| self.side.call(ctx, i, intent)),
                };
                let answer = self.w().core.grant_recorded(grant, recorded.ok_or_else(|| "sidecar down".to_string()));
                if let (true, Some(intended)) = (answer.drive, intended) {
                    self.w().core.advance(&key, Done::Sidecar(intended));
                }
                answer
            }
            // Only when grants are recorded together, which the model does not do.
            Screened::Recording => return None,
        };
        if answer.tombstone {
            self.side.call(ctx, i, SidecarRequest::Abandon { task: key.0.clone(), attempt: key.1 });
        }
        if answer.drive {
            self.w().local.insert(key, Local::default());
        }
        Some(answer.reply)
    }

    /// `daemon::on_kill`: the fence takes the epoch, then the core decides.
    fn on_kill(&mut self, ctx: &mut Ctx, cmd: KillCommand) -> Option<WorkerReply> {
        let i = self.index;
        let fence = self.side.call(ctx, i, SidecarRequest::ObserveEpoch(cmd.epoch));
        let answer = self.w().core.kill((cmd.task, cmd.attempt), cmd.epoch, fence.ok_or_else(|| "sidecar down".into()));
        Some(answer.reply)
    }

    /// The owner's pause wish, through the worker's core (the model's
    /// processes keep running: a pause changes no outcome the judge checks).
    fn on_pause(&mut self, ctx: &mut Ctx, cmd: PauseCommand) -> Option<WorkerReply> {
        let i = self.index;
        let fence = self.side.call(ctx, i, SidecarRequest::ObserveEpoch(cmd.epoch));
        let key = (cmd.task, cmd.attempt);
        let answer = self.w().core.pause(&key, cmd.epoch, fence.ok_or_else(|| "sidecar down".into()), cmd.paused);
        Some(answer.reply)
    }

    /// The sidecar's records judged together with the shim's files, by
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
            shim_alive: matches!(proc, Some(Proc::Running { .. })),
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
        if let Some(d) = w.detached.iter().position(|d| d.report == Some(req)) {
            if w.core.settles(&ack, w.detached[d].epoch) {
                w.detached.remove(d);
            } else {
                w.detached[d].report = None;
            }
            return;
        }
        let Some(key) = w.local.iter().find(|(_, l)| l.report == Some(req)).map(|(k, _)| k.clone()) else { return };
        let epoch = w.core.held(&key).map(|h| h.epoch).unwrap_or_default();
        let local = w.local.get_mut(&key).expect("found just above");
        local.report = None;
        match w.core.next(&key) {
            // The started report, sent while the process is watched.
            Some(Action::Watch { .. }) => local.started_acked |= w.core.settles(&ack, epoch),
            Some(Action::Report { .. }) => {
                w.core.advance(&key, Done::Reported(ack));
                self.forget_if_done(&key);
            }
            _ => {}
        }
    }

    /// Drops the driver's notes of an attempt the core no longer holds.
    fn forget_if_done(&mut self, key: &Key) {
        let w = self.w();
        if w.core.held(key).is_none() {
            w.local.remove(key);
        }
    }

    // ------------------------------------------------------------ attempts

    /// One step of one attempt: the core's next action, performed on the
    /// modelled machine (`attempt::perform`), its result fed back.
    fn advance(&mut self, ctx: &mut Ctx, key: Key) {
        let Some(action) = self.w().core.next(&key) else { return };
        let (i, task, attempt) = (self.index, key.0.clone(), key.1);
        let local = self.w().local.get(&key).cloned().unwrap_or_default();
        let done = match action {
            Action::Sidecar(req) => self.side.call(ctx, i, req).map(Done::Sidecar),
            Action::Launch { kill, .. } => {
                let Some(grant) = self.w().core.held(&key).and_then(|h| h.grant.clone()) else { return };
                let (ticks, outcome) = behaviour(&grant.spec.command, grant.attempt.0);
                self.next_pid += 1;
                let pid = self.next_pid;
                self.procs.insert(key.clone(), Proc::Running { until: ctx.now + ticks, outcome, killed: kill });
                ctx.note(|| format!("m{i} STARTS {task}#{attempt} pid {pid} (idempotent={})", grant.spec.idempotent));
                let id = self.id.clone();
                ctx.check.process_started(ctx.now, i, &id, &task, attempt, &grant.spec);
                self.w().local.insert(key.clone(), Local { pid, signalled: kill, ..local.clone() });
                Some(Done::Launched(pid))
            }
            // The planted bug: now and then a running process is said gone.
            Action::Watch { kill: false } | Action::Seek { kill: false }
                if self.bug == Bug::ResumeUnproven
                    && matches!(self.procs.get(&key), Some(Proc::Running { .. }))
                    && ctx.rng.gen_bool(0.05) =>
            {
                Some(Done::Ended(evidence::settle(None, false, None, false, true, attempt)))
            }
            Action::Watch { kill } | Action::Seek { kill } => match self.procs.get_mut(&key) {
                Some(Proc::Running { killed, .. }) => {
                    let mut local = local;
                    if kill && !local.signalled {
                        *killed = true;
                        local.signalled = true;
                    }
                    if !local.started_acked && local.report.is_none() {
                        let epoch = self.w().core.held(&key).map(|h| h.epoch).unwrap_or_default();
                        let event = ReportEvent::Started { pid: local.pid };
                        local.report = Some(self.send_report(ctx, &key, epoch, event));
                    }
                    self.w().local.insert(key.clone(), local);
                    None
                }
                Some(Proc::Exited(o)) => Some(Done::Ended(Settled::Exited(o.clone()))),
                // The modelled process died with its shim: gone.
                Some(Proc::Dead) | None => {
                    Some(Done::Ended(evidence::settle(None, local.signalled || kill, None, false, true, attempt)))
                }
            },
            Action::Settle { restarted } => Some(Done::Ended(match self.procs.get(&key) {
                Some(Proc::Exited(o)) => Settled::Exited(o.clone()),
                // Gone unless the modelled process still runs (its shim died
                // without it): the real driver would have ended its group.
                Some(Proc::Running { .. }) => evidence::settle(None, false, None, restarted, false, attempt),
                _ => evidence::settle(None, false, None, restarted, true, attempt),
            })),
            Action::Report { event, epoch } => {
                if local.report.is_none() {
                    let req = self.send_report(ctx, &key, epoch, event);
                    if let Some(l) = self.w().local.get_mut(&key) {
                        l.report = Some(req);
                    }
                }
                None
            }
            Action::Release => Some(Done::Released),
        };
        let Some(done) = done else { return };
        if matches!(done, Done::Ended(_)) {
            // A started report still in flight is superseded by the outcome.
            if let Some(l) = self.w().local.get_mut(&key) {
                l.report = None;
            }
        }
        self.w().core.advance(&key, done);
        self.forget_if_done(&key);
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
        SidecarRequest::Many(reqs) => format!("many [{}]", reqs.iter().map(fmt_sidecar).collect::<Vec<_>>().join(", ")),
    }
}
