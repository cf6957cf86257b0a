//! A seeded deterministic simulation of a whole tenure cluster: coordinators
//! running the real `Core`, worker machines running the real sidecar `Machine`
//! under a model of the worker protocol, a client, and an in-memory bus with a
//! manual clock — all faults drawn from one `StdRng::seed_from_u64(seed)`.
//!
//! A schedule has two phases. **Chaos**: the client submits and kills tasks
//! while messages are delayed, reordered (across subjects) and lost, nodes
//! are partitioned, coordinators crash, pause and lose their lease, and
//! workers, sidecars, shims and whole machines crash. **Heal**: no more faults, every node up,
//! the network calm; the run goes on until the cluster is quiet (bounded).
//! The checker ([`check`]) judges every step and the quiet end.
//!
//! Module map: [`bus`] (network and requests), [`coord`] (coordinators,
//! registry, lease), [`worker`] (worker machines), [`client`], [`check`]
//! (ledger, invariants, trace). Time is a tick of [`TICK_MS`]; nothing reads a
//! real clock, and iteration orders are those of ordered maps, so a seed
//! replays exactly — which is how a failure's trace is produced: the failing
//! seed is run again with the trace switched on.

pub mod bus;
pub mod check;
pub mod client;
pub mod coord;
pub mod machine;

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tenure_coordinator::core::{CoreConfig, Input};
use tenure_protocol::messages::{Report, WorkerCommand};
use tenure_protocol::Status;

use bus::{Bus, Dest, Node, Weather};
use check::{Checker, Trace};
use client::Client;
use coord::Cluster;
use machine::Host;

/// Simulated milliseconds per tick.
pub const TICK_MS: u64 = 100;
pub const COMMAND_TIMEOUT: u64 = 5;
pub const REPORT_TIMEOUT: u64 = 5;
pub const API_TIMEOUT: u64 = 5;
pub const HEARTBEAT_EVERY: u64 = 2;
/// Standbys take over after this long without a renewal.
pub const LEASE_TTL: u64 = 12;
/// A leader acts only until its last renewal plus this (< `LEASE_TTL`).
pub const RENEW_DEADLINE: u64 = 8;

/// A defect planted on purpose, to prove the checker catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    None,
    /// The worker spawns right after accepting, without recording the intent.
    SkipIntent,
    /// The registry accepts appends from deposed leaders (no fencing).
    UnfencedRegistry,
    /// The worker says a process gone while it still runs (its shim died
    /// without it): a resume would run the agent twice at once.
    ResumeUnproven,
    /// The leader lets every grant share a registry message, not only a
    /// task's first: a task's dead entries in batches would be unbounded.
    ShareEveryGrant,
    /// The leader lets every end share a registry message, not only that of a
    /// task that never wrote to its own subject: an end would leave a record
    /// there that no reserve counted on.
    ShareEveryEnd,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub bug: Bug,
    pub chaos_ticks: u64,
    /// Most ticks the healed cluster gets to become quiet.
    pub heal_ticks: u64,
    /// Deposed leaders still acting answer reports and API requests, as an
    /// old leader does after a lease glitch (it is still subscribed); off,
    /// they only hear heartbeats and the answers to their own requests.
    pub zombie_answers: bool,
    /// Keep each link's messages in order, as NATS does on one connection.
    pub fifo_links: bool,
    /// Longest a term may act past its renew deadline (drawn per schedule up
    /// to this; half the schedules get 0, a lease guard that works).
    pub zombie_max: u64,
    pub trace: bool,
    /// The client also pauses and resumes tasks (off by default, so that
    /// the seeds of the defects above keep their schedules).
    pub pauses: bool,
    /// The client submits a fifth of its tasks held, approves them at
    /// random times, and every one still held once the cluster heals (off by
    /// default, as `pauses`).
    pub approvals: bool,
    /// Half the client's non-idempotent tasks are `agent` tasks with a
    /// resume command, a random half of them resumable anywhere (off by
    /// default, as `pauses`).
    pub resumes: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            bug: Bug::None,
            chaos_ticks: 250,
            heal_ticks: 1500,
            zombie_answers: true,
            fifo_links: true,
            zombie_max: 12,
            trace: false,
            pauses: false,
            approvals: false,
            resumes: false,
        }
    }
}

/// Everything the simulated nodes share: the clock, the rng, the network and the judge.
pub struct Ctx {
    pub now: u64,
    pub rng: StdRng,
    pub bus: Bus,
    pub check: Checker,
    pub trace: Trace,
}

impl Ctx {
    pub fn note(&mut self, line: impl FnOnce() -> String) {
        self.trace.push(self.now, line);
    }
}

/// Something the schedule does to the cluster in one tick.
#[derive(Debug, Clone, Copy)]
enum Event {
    Submit,
    Kill,
    CoordCrash,
    LeaderCrash,
    LeaderPause,
    CoordPartition,
    LeaseGlitch,
    RegistryOutage,
    WorkerCrash(usize),
    SidecarCrash(usize),
    MachineCrash(usize),
    /// A machine crash, and its data directory lost with it: it comes back
    /// under the same id on an empty store (another incarnation).
    MachineWipe(usize),
    MachinePartition(usize),
    ShimKill(usize),
}

/// Per-tick chances of each event, drawn per schedule (some calm, some
/// stormy). At most one event happens per tick, chosen by a single draw.
struct Rates(Vec<(f64, Event)>);

impl Rates {
    fn draw(rng: &mut StdRng, machines: usize) -> Rates {
        let storm: f64 = rng.gen_range(0.2..2.5);
        let mut table = vec![(rng.gen_range(0.05..0.3), Event::Submit), (rng.gen_range(0.0..0.04), Event::Kill)];
        let mut add = |base: f64, event: Event| table.push((base * storm * rng.gen_range(0.0..2.0), event));
        add(0.003, Event::CoordCrash);
        add(0.004, Event::LeaderCrash);
        add(0.004, Event::LeaderPause);
        add(0.004, Event::CoordPartition);
        add(0.003, Event::LeaseGlitch);
        add(0.002, Event::RegistryOutage);
        for m in 0..machines {
            add(0.004, Event::WorkerCrash(m));
            add(0.003, Event::SidecarCrash(m));
            add(0.002, Event::MachineCrash(m));
            add(0.001, Event::MachineWipe(m));
            add(0.004, Event::MachinePartition(m));
            add(0.002, Event::ShimKill(m));
        }
        let total: f64 = table.iter().map(|(p, _)| p).sum();
        if total > 1.0 {
            table.iter_mut().for_each(|(p, _)| *p /= total);
        }
        Rates(table)
    }

    fn pick(&self, rng: &mut StdRng) -> Option<Event> {
        let mut u: f64 = rng.gen();
        for (p, event) in &self.0 {
            if u < *p {
                return Some(*event);
            }
            u -= p;
        }
        None
    }
}

/// What a schedule did, and how it ended.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub failure: Option<String>,
    pub trace: Vec<String>,
    pub ticks: u64,
    pub tasks: usize,
    pub starts: usize,
    pub takeovers: u64,
    /// Client requests a deposed leader answered from its stale view.
    pub stale_answers: usize,
    pub by_status: Vec<(Status, usize)>,
    /// Attempts the leaders retried under a task's policy (in the registry's
    /// attempt histories).
    pub retries: usize,
    /// Attempts the leaders resumed (in the registry's resume states).
    pub resumes: usize,
    /// Ends appended as records that may share a registry message.
    pub shared_ends: usize,
}

struct Sim {
    ctx: Ctx,
    cluster: Cluster,
    hosts: Vec<Host>,
    client: Client,
    rates: Rates,
    opts: Options,
    max_tasks: usize,
}

/// Runs one schedule.
pub fn run(seed: u64, opts: &Options) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let coordinators = rng.gen_range(2..=3);
    let machines = rng.gen_range(2..=4);
    let weather = Weather {
        loss: rng.gen_range(0.0..0.15),
        max_delay: rng.gen_range(0..=3),
        late: rng.gen_range(0.0..0.05),
        late_max: 40,
        buffered: 0.5,
        fifo: opts.fifo_links,
    };
    let zombie_max = if rng.gen_bool(0.5) { 0 } else { rng.gen_range(1..=opts.zombie_max.max(1)) };
    let rates = Rates::draw(&mut rng, machines);
    let cfg = CoreConfig {
        worker_ttl: Duration::from_millis(15 * TICK_MS),
        grant_retry: Duration::from_millis(5 * TICK_MS),
        kill_retry: Duration::from_millis(10 * TICK_MS),
        ..CoreConfig::default()
    };
    let hosts = (0..machines)
        .map(|i| Host::new(i, rng.gen_range(1..=3), rng.gen_range(0..HEARTBEAT_EVERY), opts.bug))
        .collect();
    let max_tasks = rng.gen_range(4..=14);
    let ctx = Ctx {
        now: 0,
        rng,
        bus: Bus::new(weather),
        check: Checker::default(),
        trace: Trace { enabled: opts.trace, lines: Vec::new() },
    };
    let mut sim = Sim {
        ctx,
        cluster: Cluster::new(coordinators, cfg, zombie_max, opts.bug),
        hosts,
        client: Client::new(),
        rates,
        opts: opts.clone(),
        max_tasks,
    };
    sim.ctx.note(|| {
        format!("seed {seed}: {coordinators} coordinators, {machines} machines, zombies up to {zombie_max} ticks")
    });
    let ticks = sim.run();
    let records = &sim.cluster.registry.records;
    let mut by_status: Vec<(Status, usize)> = Status::ALL
        .iter()
        .map(|s| (*s, records.values().filter(|r| r.life.status == *s).count()))
        .filter(|(_, n)| *n > 0)
        .collect();
    by_status.sort();
    Outcome {
        seed,
        failure: sim.ctx.check.failure().map(str::to_owned),
        trace: std::mem::take(&mut sim.ctx.trace.lines),
        ticks,
        tasks: records.len(),
        starts: sim.ctx.check.total_starts(),
        takeovers: sim.cluster.takeovers,
        stale_answers: sim.ctx.check.stale_answers(),
        by_status,
        retries: records.values().filter_map(|r| r.attempts.as_ref()).map(|a| a.retried() as usize).sum(),
        resumes: records.values().filter_map(|r| r.resume()).map(|s| s.resumes as usize).sum(),
        shared_ends: sim.ctx.check.shared_ends(),
    }
}

impl Sim {
    /// The tick loop; returns how many ticks ran.
    fn run(&mut self) -> u64 {
        let end = self.opts.chaos_ticks + self.opts.heal_ticks;
        for tick in 0..=end {
            self.ctx.now = tick;
            let chaos = tick < self.opts.chaos_ticks;
            if tick == self.opts.chaos_ticks {
                self.heal();
            }
            if chaos {
                self.faults();
                if self.opts.pauses && self.ctx.rng.gen_bool(0.05) {
                    self.client.pause_one(&mut self.ctx);
                }
                if self.opts.approvals && self.ctx.rng.gen_bool(0.04) {
                    self.client.approve(&mut self.ctx, false);
                }
            }
            self.cluster.restarts(&mut self.ctx);
            self.cluster.lease_step(&mut self.ctx, self.hosts.len());
            self.cluster.resume(&mut self.ctx);
            self.deliver_due();
            for host in &mut self.hosts {
                host.tick(&mut self.ctx);
            }
            let running: Vec<(usize, (tenure_protocol::TaskId, tenure_protocol::Attempt))> =
                self.hosts.iter().flat_map(|h| h.running().map(|k| (h.index, k.clone()))).collect();
            self.ctx.check.alive(&running);
            self.cluster.tick_all(&mut self.ctx);
            self.client.tick(&mut self.ctx);
            if self.ctx.check.failure().is_some() {
                return tick;
            }
            if !chaos && self.busy().is_none() {
                self.ctx.check.settled(&self.cluster.registry.records);
                return tick;
            }
        }
        let why = self.busy().unwrap_or_default();
        self.ctx.check.settled(&self.cluster.registry.records);
        let stuck = format!("rule 3: not quiet {} ticks after healing: {why}", self.opts.heal_ticks);
        self.ctx.check.fail(stuck);
        end
    }

    fn heal(&mut self) {
        let now = self.ctx.now;
        self.ctx.note(|| "HEAL: no more faults; every node comes back".into());
        self.ctx.bus.heal_all();
        self.ctx.bus.weather = Weather::calm();
        self.cluster.heal(now);
        for h in &mut self.hosts {
            h.heal(now);
        }
        if self.opts.approvals {
            self.client.approve(&mut self.ctx, true);
        }
    }

    /// Why the cluster is not quiet yet, if it is not.
    fn busy(&self) -> Option<String> {
        if let Some(why) = self.client.busy() {
            return Some(why);
        }
        if self.cluster.leader().is_none() {
            return Some("no leader".into());
        }
        let records = &self.cluster.registry.records;
        if let Some(r) = records.values().find(|r| !r.life.status.is_terminal() && r.life.status != Status::Unknown) {
            return Some(format!("{} is {} (attempt {} on {:?})", r.id, r.life.status, r.life.attempt, r.life.worker));
        }
        if let Some(id) = self.client.known_ids().find(|id| !records.contains_key(*id)) {
            return Some(format!("{id} was returned to the client but is not in the registry"));
        }
        self.hosts.iter().find_map(Host::busy)
    }

    fn faults(&mut self) {
        let ctx = &mut self.ctx;
        let coords = self.cluster.slots.len();
        let Some(event) = self.rates.pick(&mut ctx.rng) else { return };
        if let Event::WorkerCrash(m)
        | Event::SidecarCrash(m)
        | Event::MachineCrash(m)
        | Event::MachineWipe(m)
        | Event::MachinePartition(m)
        | Event::ShimKill(m) = event
        {
            ctx.check.machine_struck(&coord::host_id(m));
        }
        match event {
            Event::Submit if self.client.submitted() < self.max_tasks => {
                let held = self.opts.approvals && ctx.rng.gen_bool(0.2);
                let resumable = self.opts.resumes;
                self.client.submit_new(ctx, held, resumable)
            }
            Event::Submit => {}
            Event::Kill => self.client.kill_one(ctx),
            Event::CoordCrash => {
                let (s, d) = (ctx.rng.gen_range(0..coords), ctx.rng.gen_range(1..=40));
                self.cluster.crash(ctx, s, d);
            }
            Event::LeaderCrash | Event::LeaderPause => {
                let Some(h) = self.cluster.holder() else { return };
                let d = ctx.rng.gen_range(1..=40);
                if let Event::LeaderCrash = event {
                    self.cluster.crash(ctx, h, d);
                } else {
                    self.cluster.pause(ctx, h, d);
                }
            }
            Event::CoordPartition => {
                let (s, d) = (ctx.rng.gen_range(0..coords), ctx.rng.gen_range(1..=40));
                ctx.bus.partition(Node::Coord(s), ctx.now + d);
                ctx.note(|| format!("FAULT c{s} cut off for {d} ticks"));
            }
            Event::LeaseGlitch => self.cluster.lease_glitch(ctx),
            Event::RegistryOutage => {
                let d = ctx.rng.gen_range(1..=20);
                self.cluster.registry_outage(ctx, d);
            }
            Event::WorkerCrash(m) => {
                let d = ctx.rng.gen_range(0..=30);
                self.hosts[m].crash_worker(ctx, d);
            }
            Event::SidecarCrash(m) => {
                let d = ctx.rng.gen_range(0..=15);
                self.hosts[m].crash_sidecar(ctx, d);
            }
            Event::MachineCrash(m) => {
                let d = ctx.rng.gen_range(1..=40);
                self.hosts[m].crash_machine(ctx, d);
            }
            Event::MachineWipe(m) => {
                let d = ctx.rng.gen_range(1..=40);
                self.hosts[m].wipe_machine(ctx, d);
            }
            Event::MachinePartition(m) => {
                let d = ctx.rng.gen_range(1..=40);
                ctx.bus.partition(Node::Machine(m), ctx.now + d);
                ctx.note(|| format!("FAULT m{m} cut off for {d} ticks"));
            }
            Event::ShimKill(m) => self.hosts[m].kill_shim(ctx),
        }
    }

    fn deliver_due(&mut self) {
        let mut budget = 100_000;
        while let Some(env) = self.ctx.bus.pop_due(self.ctx.now) {
            budget -= 1;
            if budget == 0 {
                self.ctx.check.fail(format!("livelock: over 100000 deliveries in tick {}", self.ctx.now));
                return;
            }
            match env.to {
                Dest::Node(Node::Coord(s)) => self.cluster.deliver(&mut self.ctx, s, env),
                Dest::Node(Node::Machine(m)) => self.hosts[m].deliver(&mut self.ctx, env),
                Dest::Node(Node::Client) => self.client.deliver(&mut self.ctx, env),
                Dest::Leader | Dest::Coordinators => {
                    for s in self.cluster.receivers(env.to, self.opts.zombie_answers) {
                        self.cluster.deliver(&mut self.ctx, s, env.clone());
                    }
                }
            }
            if self.ctx.check.failure().is_some() {
                return;
            }
        }
    }
}

// ---------------------------------------------------------------- trace text

pub fn clip(s: &str) -> String {
    if s.len() <= 160 {
        return s.to_owned();
    }
    let mut end = 160;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

pub fn fmt_command(c: &WorkerCommand) -> String {
    match c {
        WorkerCommand::Grant(g) => format!("grant {}#{} e{}", g.task, g.attempt, g.epoch),
        WorkerCommand::Kill(k) => format!("kill {}#{} e{}", k.task, k.attempt, k.epoch),
        WorkerCommand::InstanceTaken { instance, .. } => format!("taken {instance}"),
        WorkerCommand::Pause(p) => format!("pause={} {}#{} e{}", p.paused, p.task, p.attempt, p.epoch),
    }
}

fn fmt_report(report: &Report) -> String {
    let event = clip(&format!("{:?}", report.event));
    format!("report {} {}#{} e{} {event}", report.worker, report.task, report.attempt, report.epoch)
}

pub fn fmt_input(input: &Input) -> String {
    match input {
        Input::Api { request, .. } => clip(&format!("api {request:?}")),
        Input::Heartbeat(hb) => format!("heartbeat {}", hb.worker),
        Input::Report { report, .. } => fmt_report(report),
        Input::Reports { reports, .. } => {
            format!("reports [{}]", reports.iter().map(fmt_report).collect::<Vec<_>>().join(", "))
        }
        Input::CommandResult { worker, command, result } => {
            format!("{worker} answered {}: {}", fmt_command(command), clip(&format!("{result:?}")))
        }
        Input::CleanupResult { worker, request, result } => {
            format!("{worker} cleanup {}#{}: {}", request.task, request.job, clip(&format!("{result:?}")))
        }
        Input::Evidence { worker, request, result } => {
            format!("{worker} evidence {}#{}: {}", request.task, request.attempt, clip(&format!("{result:?}")))
        }
        Input::EpochChecked { claimed, by, registry } => {
            format!("epoch {claimed} claimed by {by}: registry {registry:?}")
        }
        Input::RegistryUsage { bytes } => format!("registry holds {bytes} bytes"),
        Input::PersistFailed { task, reason } => format!("{task} not stored: {reason}"),
        Input::Leader(leader) => format!("leading as {} ({} renewals)", leader.holder, leader.renewals),
        Input::Presence(p) => format!("standby {} present", p.holder),
        Input::Tick => "tick".into(),
    }
}
