//! The coordinators: two or three processes, each able to run a term of the
//! real [`Core`]; the durable registry they share; and a simple model of the
//! leader lease around them.
//!
//! - **Registry.** The latest record per task and the last epoch claim. An
//!   append is accepted only from the term holding the latest claim (the real
//!   registry's conditional append); any other append is refused and its term
//!   ends there, dropping every later effect of the batch (the real driver's
//!   step-down at the first failed persist).
//! - **Lease.** The holder renews while it is up, running and reachable; when
//!   it stops renewing for the lease TTL (or released it by stepping down), a
//!   reachable standby takes over: it claims the next epoch and builds a new
//!   `Core` from the registry alone. A term acts only until its last renewal
//!   plus the renew deadline — except that a schedule may let it run longer
//!   (a *zombie*: a paused or cut-off leader whose guard failed, or the old
//!   leader after a lease glitch), in which case only fencing protects the
//!   cluster from it.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::Rng;
use tenure_coordinator::core::{Core, CoreConfig, Effect, Input, Now, Version};
use tenure_coordinator::record::TaskRecord;
use tenure_protocol::messages::{Notice, WorkerCommand};
use tenure_protocol::{Epoch, Status, TaskId, WorkerId};

use super::bus::{Asked, Dest, Envelope, Msg, Node, Reply};
use super::{fmt_command, Bug, Ctx, COMMAND_TIMEOUT, LEASE_TTL, RENEW_DEADLINE, TICK_MS};

/// How far each coordinator process's wall clock is off: minutes apart, ahead
/// and behind.
const WALL_SKEW_MS: [i64; 3] = [0, 7 * 60_000, -11 * 60_000];

/// The registry as JetStream holds it: what a new leader loads.
#[derive(Default)]
pub struct Registry {
    pub epoch: Epoch,
    pub records: BTreeMap<TaskId, TaskRecord>,
    pub highest_n: u64,
}

/// One leadership term of one coordinator process.
pub struct Term {
    /// Unique across the run: replies to an older term never reach a newer one.
    pub id: u64,
    pub epoch: Epoch,
    pub core: Core,
    /// Last tick this term renewed the lease (as it believes).
    renewed_at: u64,
    /// Set when the term outlives its renew deadline: it acts until then.
    zombie_until: Option<u64>,
}

pub struct Slot {
    up: bool,
    /// Tick the process started: its monotonic clock counts from here.
    boot: u64,
    down_until: u64,
    paused_until: u64,
    /// What reached the process while it was paused, in arrival order.
    inbox: Vec<Envelope>,
    pub term: Option<Term>,
}

pub struct Cluster {
    pub slots: Vec<Slot>,
    pub registry: Registry,
    cfg: CoreConfig,
    /// The lease holder; `None` when released (a takeover may happen at once).
    holder: Option<usize>,
    lease_renewed: u64,
    /// A standby misjudged the lease expired: it takes over at the next chance.
    glitch: bool,
    registry_down_until: u64,
    next_term: u64,
    pub takeovers: u64,
    /// How many ticks a term may act past its renew deadline (0 = the guard works).
    zombie_max: u64,
    bug: Bug,
}

pub fn worker_index(worker: &WorkerId) -> usize {
    worker.as_str().trim_start_matches('w').parse().expect("simulated worker ids are w<index>")
}

impl Cluster {
    pub fn new(size: usize, cfg: CoreConfig, zombie_max: u64, bug: Bug) -> Cluster {
        let slots = (0..size)
            .map(|_| Slot { up: true, boot: 0, down_until: 0, paused_until: 0, inbox: Vec::new(), term: None })
            .collect();
        Cluster {
            slots,
            registry: Registry::default(),
            cfg,
            holder: None,
            lease_renewed: 0,
            glitch: false,
            registry_down_until: 0,
            next_term: 0,
            takeovers: 0,
            zombie_max,
            bug,
        }
    }

    fn now_for(&self, s: usize, tick: u64) -> Now {
        let since_boot = tick.saturating_sub(self.slots[s].boot) * TICK_MS;
        // Each process's wall clock is minutes off the others' (the real
        // driver's test-only offset): no decision may depend on it.
        let wall_ms = (1_700_000_000_000 + tick * TICK_MS).saturating_add_signed(WALL_SKEW_MS[s % WALL_SKEW_MS.len()]);
        Now { mono: Duration::from_millis(5_000 + since_boot), wall_ms }
    }

    fn paused(&self, s: usize, now: u64) -> bool {
        now < self.slots[s].paused_until
    }

    fn reachable(&self, ctx: &Ctx, s: usize) -> bool {
        self.slots[s].up && !self.paused(s, ctx.now) && !ctx.bus.is_partitioned(Node::Coord(s), ctx.now)
    }

    /// The slot whose term holds the latest claim, if it runs.
    pub fn leader(&self) -> Option<usize> {
        (0..self.slots.len()).find(|s| self.slots[*s].term.as_ref().is_some_and(|t| t.epoch == self.registry.epoch))
    }

    // ------------------------------------------------------------ lease

    /// Renewals, renew deadlines (and zombies), takeovers. Run once per tick.
    pub fn lease_step(&mut self, ctx: &mut Ctx, hosts: usize) {
        if let Some(h) = self.holder.filter(|_| !self.glitch) {
            if self.reachable(ctx, h) {
                if let Some(term) = self.slots[h].term.as_mut().filter(|t| t.epoch == self.registry.epoch) {
                    term.renewed_at = ctx.now;
                    self.lease_renewed = ctx.now;
                }
            }
        }
        for s in 0..self.slots.len() {
            if self.paused(s, ctx.now) {
                continue; // judged when it resumes, before it acts
            }
            let Some(term) = self.slots[s].term.as_mut() else { continue };
            if ctx.now <= term.renewed_at + RENEW_DEADLINE {
                continue;
            }
            let end = match term.zombie_until {
                Some(until) => ctx.now >= until,
                None => {
                    let extra = ctx.rng.gen_range(0..=self.zombie_max);
                    term.zombie_until = Some(ctx.now + extra);
                    if extra > 0 {
                        let epoch = term.epoch;
                        ctx.note(|| format!("c{s} e{epoch} passes its renew deadline and acts on for {extra} ticks"));
                    }
                    extra == 0
                }
            };
            if end {
                self.end_term(ctx, s, "renew deadline passed");
            }
        }
        let expired = self.glitch || self.holder.is_none() || ctx.now >= self.lease_renewed + LEASE_TTL;
        // Claiming the epoch is a registry append: impossible while it is down.
        if expired && ctx.now >= self.registry_down_until {
            let candidates: Vec<usize> =
                (0..self.slots.len()).filter(|s| self.reachable(ctx, *s) && self.slots[*s].term.is_none()).collect();
            if !candidates.is_empty() {
                let s = candidates[ctx.rng.gen_range(0..candidates.len())];
                self.take_over(ctx, s, hosts);
            }
        }
    }

    /// `s` claims the next epoch and adopts the registry.
    fn take_over(&mut self, ctx: &mut Ctx, s: usize, hosts: usize) {
        let epoch = self.registry.epoch.next();
        self.registry.epoch = epoch;
        let records: Vec<TaskRecord> = self.registry.records.values().cloned().collect();
        let n = records.len();
        let mut core = Core::new(self.cfg.clone(), epoch, records, self.now_for(s, ctx.now));
        core.reserve_through(self.registry.highest_n);
        self.next_term += 1;
        self.slots[s].term = Some(Term { id: self.next_term, epoch, core, renewed_at: ctx.now, zombie_until: None });
        self.holder = Some(s);
        self.lease_renewed = ctx.now;
        self.glitch = false;
        self.takeovers += 1;
        ctx.note(|| format!("c{s} takes over: claims e{epoch}, loads {n} records"));
        for m in 0..hosts {
            let fate = ctx.bus.send(
                &mut ctx.rng,
                ctx.now,
                Node::Coord(s),
                Dest::Node(Node::Machine(m)),
                Msg::EpochAnnounce(epoch),
            );
            ctx.note(|| format!("c{s} announce e{epoch} → m{m}: {fate}"));
        }
    }

    fn end_term(&mut self, ctx: &mut Ctx, s: usize, reason: &str) {
        let Some(term) = self.slots[s].term.take() else { return };
        ctx.note(|| format!("c{s} e{} steps down: {reason}", term.epoch));
        if self.holder == Some(s) && self.reachable(ctx, s) {
            self.holder = None; // released: a standby may take over at once
        }
    }

    // ------------------------------------------------------------ faults

    pub fn crash(&mut self, ctx: &mut Ctx, s: usize, ticks: u64) {
        let slot = &mut self.slots[s];
        if !slot.up {
            return;
        }
        slot.up = false;
        slot.down_until = ctx.now + ticks;
        slot.term = None;
        slot.inbox.clear();
        ctx.note(|| format!("FAULT c{s} crashes for {ticks} ticks"));
    }

    pub fn pause(&mut self, ctx: &mut Ctx, s: usize, ticks: u64) {
        if self.slots[s].up && !self.paused(s, ctx.now) {
            self.slots[s].paused_until = ctx.now + ticks;
            ctx.note(|| format!("FAULT c{s} paused for {ticks} ticks"));
        }
    }

    /// A standby misjudges the lease expired (a clock running fast) and takes
    /// over while the leader, unaware, goes on acting until its own deadline.
    pub fn lease_glitch(&mut self, ctx: &mut Ctx) {
        self.glitch = true;
        ctx.note(|| "FAULT lease glitch: the lease looks expired to standbys".into());
    }

    pub fn registry_outage(&mut self, ctx: &mut Ctx, ticks: u64) {
        self.registry_down_until = ctx.now + ticks;
        ctx.note(|| format!("FAULT registry unavailable for {ticks} ticks"));
    }

    pub fn holder(&self) -> Option<usize> {
        self.holder
    }

    /// Restarts what is down; a resumed process reads what waited for it.
    pub fn restarts(&mut self, ctx: &mut Ctx) {
        for s in 0..self.slots.len() {
            let slot = &mut self.slots[s];
            if !slot.up && ctx.now >= slot.down_until {
                slot.up = true;
                slot.boot = ctx.now;
                ctx.note(|| format!("c{s} restarts as a standby"));
            }
        }
    }

    /// Delivers what waited for resumed processes. Run after `lease_step`, so
    /// that a resumed term past its deadline is judged before it acts.
    pub fn resume(&mut self, ctx: &mut Ctx) {
        for s in 0..self.slots.len() {
            if self.paused(s, ctx.now) || self.slots[s].inbox.is_empty() {
                continue;
            }
            for env in std::mem::take(&mut self.slots[s].inbox) {
                self.deliver(ctx, s, env);
            }
        }
    }

    pub fn heal(&mut self, now: u64) {
        self.registry_down_until = now;
        self.glitch = false;
        for slot in &mut self.slots {
            slot.down_until = slot.down_until.min(now);
            slot.paused_until = slot.paused_until.min(now);
        }
    }

    // ------------------------------------------------------------ driving

    pub fn tick_all(&mut self, ctx: &mut Ctx) {
        for s in 0..self.slots.len() {
            if self.slots[s].up && !self.paused(s, ctx.now) && self.slots[s].term.is_some() {
                self.handle(ctx, s, Input::Tick);
            }
        }
    }

    /// Who receives a message sent to the coordinators' subjects now.
    pub fn receivers(&self, dest: Dest, zombie_answers: bool) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|s| match &self.slots[*s].term {
                None => false,
                Some(t) => dest == Dest::Coordinators || zombie_answers || t.epoch == self.registry.epoch,
            })
            .collect()
    }

    pub fn deliver(&mut self, ctx: &mut Ctx, s: usize, env: Envelope) {
        let slot = &self.slots[s];
        if !slot.up {
            return;
        }
        if self.paused(s, ctx.now) {
            // It waits in this process's socket, whoever leads meanwhile.
            self.slots[s].inbox.push(env);
            return;
        }
        let timer = matches!(env.msg, Msg::Timeout { .. });
        if !timer && ctx.bus.is_partitioned(Node::Coord(s), ctx.now) {
            return;
        }
        let Some(term_id) = slot.term.as_ref().map(|t| t.id) else { return };
        let input = match env.msg {
            Msg::Heartbeat(hb) => Input::Heartbeat(hb),
            Msg::Report { req, report } => Input::Report { reply_to: Some(req.to_string()), report },
            Msg::Api { req, request } => Input::Api { reply_to: Some(req.to_string()), request, trace: None },
            Msg::Reply { req, reply } => {
                let Some(waiting) = ctx.bus.claim(req, Node::Coord(s), term_id) else { return };
                match (waiting.asked, reply) {
                    (Asked::Command { worker, command }, Reply::Worker(r)) => {
                        Input::CommandResult { worker: host_id(worker), command: *command, result: Ok(r) }
                    }
                    (Asked::Evidence { worker, request }, Reply::Evidence(r)) => {
                        Input::Evidence { worker: host_id(worker), request, result: Ok(r) }
                    }
                    (asked, reply) => panic!("c{s}: reply {reply:?} does not answer {asked:?}"),
                }
            }
            Msg::Timeout { req } => {
                let Some(waiting) = ctx.bus.claim(req, Node::Coord(s), term_id) else { return };
                let error = "request timed out".to_owned();
                match waiting.asked {
                    Asked::Command { worker, command } => {
                        Input::CommandResult { worker: host_id(worker), command: *command, result: Err(error) }
                    }
                    Asked::Evidence { worker, request } => {
                        Input::Evidence { worker: host_id(worker), request, result: Err(error) }
                    }
                    other => panic!("c{s}: timeout of a request it never sends: {other:?}"),
                }
            }
            other => panic!("c{s}: not a coordinator message: {other:?}"),
        };
        self.handle(ctx, s, input);
    }

    fn handle(&mut self, ctx: &mut Ctx, s: usize, input: Input) {
        let now = self.now_for(s, ctx.now);
        let Some(term) = self.slots[s].term.as_mut() else { return };
        let epoch = term.epoch;
        if ctx.trace.enabled && !matches!(input, Input::Tick | Input::Heartbeat(_)) {
            let line = super::fmt_input(&input);
            ctx.note(|| format!("c{s} e{epoch} ← {line}"));
        }
        let fx = term.core.handle(input, now);
        self.execute(ctx, s, fx);
    }

    /// Carries out effects in order, stopping at the first refused append.
    fn execute(&mut self, ctx: &mut Ctx, s: usize, fx: Vec<Effect>) {
        let mut checks = Vec::new();
        for effect in fx {
            let Some(term) = self.slots[s].term.as_ref() else { return };
            let (epoch, term_id) = (term.epoch, term.id);
            match effect {
                Effect::Persist(record, version) => {
                    let version = match self.bug {
                        Bug::ShareEveryGrant if record.life.status == Status::Leased => Version::FirstGrant,
                        Bug::ShareEveryEnd if record.life.status.is_terminal() => Version::End,
                        _ => version,
                    };
                    let cut_off = ctx.bus.is_partitioned(Node::Coord(s), ctx.now);
                    let outage = ctx.now < self.registry_down_until;
                    let fenced = epoch < self.registry.epoch && self.bug != Bug::UnfencedRegistry;
                    if fenced {
                        self.end_term(ctx, s, "fenced: the registry moved on (append refused)");
                        return;
                    }
                    if cut_off || outage {
                        // An append that timed out may still have landed.
                        if outage && ctx.rng.gen_bool(0.5) {
                            self.append(ctx, s, epoch, *record, version);
                        }
                        self.end_term(ctx, s, "registry unavailable");
                        return;
                    }
                    self.append(ctx, s, epoch, *record, version);
                }
                Effect::Command { worker, command, instance, .. } => {
                    let w = worker_index(&worker);
                    let line = if ctx.trace.enabled { fmt_command(&command) } else { String::new() };
                    let asked = Asked::Command { worker: w, command: Box::new(command.clone()) };
                    ask_machine(ctx, s, term_id, epoch, w, line, asked, |req| Msg::Command { req, command, instance });
                }
                // Modelled as one message per grant (each with its own fate).
                Effect::Grants { worker, instance, grants } => {
                    let w = worker_index(&worker);
                    for grant in grants {
                        let command = WorkerCommand::Grant(grant);
                        let line = if ctx.trace.enabled { fmt_command(&command) } else { String::new() };
                        let asked = Asked::Command { worker: w, command: Box::new(command.clone()) };
                        let send = |req| Msg::Command { req, command, instance };
                        ask_machine(ctx, s, term_id, epoch, w, line, asked, send);
                    }
                }
                // The model runs one process per worker id: never sent.
                Effect::InstanceTaken { worker, .. } => ctx.note(|| format!("c{s} refuses a second {worker}")),
                // Retention is days; a schedule lasts minutes: nothing is collected.
                Effect::Forget { task, .. } => {
                    ctx.note(|| format!("c{s} forgets {task} (not modelled)"));
                }
                // The model's clients never archive or delete: no cleanup jobs.
                Effect::Cleanup { worker, request } => {
                    ctx.note(|| format!("c{s} cleanup {}#{} for {worker} (not modelled)", request.task, request.job));
                }
                Effect::AskEvidence { worker, request } => {
                    let w = worker_index(&worker);
                    let line = format!("evidence? {}#{} e{}", request.task, request.attempt, request.epoch);
                    let asked = Asked::Evidence { worker: w, request: request.clone() };
                    ask_machine(ctx, s, term_id, epoch, w, line, asked, |req| Msg::AskEvidence { req, request });
                }
                Effect::Reply { to, reply } => {
                    let req = to.parse().expect("the simulation's reply subjects are request ids");
                    let line = if ctx.trace.enabled { format!("{reply:?}") } else { String::new() };
                    let fate = ctx.bus.reply(&mut ctx.rng, ctx.now, Node::Coord(s), req, Reply::Api(reply));
                    ctx.note(|| format!("c{s} e{epoch} reply #{req} {}: {fate}", super::clip(&line)));
                }
                Effect::Ack { to, ack } => {
                    let req = to.parse().expect("the simulation's reply subjects are request ids");
                    let fate = ctx.bus.reply(&mut ctx.rng, ctx.now, Node::Coord(s), req, Reply::Ack(ack.clone()));
                    ctx.note(|| format!("c{s} e{epoch} ack #{req} {ack:?}: {fate}"));
                }
                Effect::Acks { .. } => unreachable!("the simulated workers send their reports one at a time"),
                Effect::Notify(notice) => {
                    if let Notice::Ended(snapshot) = *notice {
                        ctx.check.notified(&snapshot, self.registry.records.get(&snapshot.id));
                        ctx.note(|| format!("c{s} e{epoch} notice {} {}", snapshot.id, snapshot.status));
                    }
                }
                Effect::StepDown { reason } => {
                    self.end_term(ctx, s, &reason);
                    return;
                }
                // The registry's highest claim, read after this batch.
                Effect::CheckEpoch { claimed, by } => checks.push((claimed, by)),
            }
        }
        for (claimed, by) in checks {
            let registry = Ok(self.registry.epoch);
            self.handle(ctx, s, Input::EpochChecked { claimed, by, registry });
        }
    }

    fn append(&mut self, ctx: &mut Ctx, s: usize, epoch: Epoch, record: TaskRecord, version: Version) {
        ctx.check.appended(self.registry.records.get(&record.id), &record, version);
        let l = &record.life;
        ctx.note(|| {
            format!(
                "c{s} e{epoch} APPEND {} {} #{} e{} on {:?} kill={} hint={:?}",
                record.id,
                l.status,
                l.attempt,
                l.epoch,
                l.worker.as_ref().map(|w| w.as_str()),
                l.kill_requested,
                l.hint.as_ref().map(|h| h.tag)
            )
        });
        self.registry.highest_n = self.registry.highest_n.max(record.id.number());
        self.registry.records.insert(record.id.clone(), record);
    }
}

pub fn host_id(index: usize) -> WorkerId {
    format!("w{index}").parse().expect("w<index> is a valid worker id")
}

/// Sends a coordinator's request to machine `w` over the bus and traces its fate.
#[allow(clippy::too_many_arguments)]
fn ask_machine(
    ctx: &mut Ctx,
    s: usize,
    term_id: u64,
    epoch: Epoch,
    w: usize,
    line: String,
    asked: Asked,
    make: impl FnOnce(super::bus::ReqId) -> Msg,
) {
    let (req, fate) = ctx.bus.request(
        &mut ctx.rng,
        ctx.now,
        Node::Coord(s),
        term_id,
        Dest::Node(Node::Machine(w)),
        COMMAND_TIMEOUT,
        asked,
        make,
    );
    ctx.note(|| format!("c{s} e{epoch} → m{w} #{req} {line}: {fate}"));
}
