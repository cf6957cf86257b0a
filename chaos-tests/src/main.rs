//! `tenure-chaos`: kills, pauses and cuts real tenure nodes on a seeded
//! schedule while a load of tasks runs, then judges the outcome from outside:
//! no task lost, none anonymous, no non-idempotent task run twice, no terminal
//! task resurrected, no process orphaned.

mod checker;
mod cluster;
mod hostile;
mod power;
mod proxy;
mod schedule;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use nix::sys::signal::Signal;
use rand::{Rng, SeedableRng};
use tenure_client::{Client, Policy};
use tenure_protocol::messages::{ApiError, ApiRequest, ApiResponse, BatchTask, SubmitBatch, SubmitRequest};
use tenure_protocol::{subjects, SessionId, TaskSpec};

use checker::{Final, Proc, Submitted};
use cluster::Cluster;
use schedule::{Fault, Link, PowerNode};

#[derive(Parser)]
#[command(name = "tenure-chaos", about = "Chaos runs against real tenure binaries, judged from an outside ledger")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// One chaos run.
    Run {
        /// Seed of the fault schedule and the load (random when absent; always printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Seconds of faults and load (then the cluster heals and is judged).
        #[arg(long, default_value_t = 60)]
        duration: u64,
        #[arg(long, default_value_t = 2)]
        coordinators: usize,
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// Tasks submitted per second.
        #[arg(long, default_value_t = 3.0)]
        rate: f64,
        /// Mean milliseconds between two faults (drawn from 4/7 to 10/7 of
        /// it). The default, one every 2–5 s, lets most faults heal before
        /// the next; a few hundred makes a dense campaign.
        #[arg(long, default_value_t = schedule::DEFAULT_GAP_MS)]
        fault_every_ms: u64,
        /// Fault families left out of the plan (comma-separated kinds, as the
        /// report names them: `nats-restart,registry-rollback` leaves out the
        /// two that pause the load for seconds each, for a dense campaign).
        #[arg(long, value_delimiter = ',')]
        without: Vec<String>,
        /// Write the report as JSON here too.
        #[arg(long)]
        json: Option<PathBuf>,
        /// The tenure binary (default: `tenure` next to this one).
        #[arg(long, env = "TENURE_BIN")]
        tenure_bin: Option<PathBuf>,
        /// The nats-server binary (default: TENURE_NATS_SERVER, then PATH, then
        /// .tools/nats/bin; at least 2.11).
        #[arg(long)]
        nats_server: Option<PathBuf>,
        /// Plant a double execution (a task that appends twice) to prove the checker catches it.
        #[arg(long)]
        plant_double: bool,
        /// Keep the run's directory (logs, ledger, data) instead of deleting it.
        #[arg(long)]
        keep: bool,
    },
}

struct Run {
    started: Instant,
}

impl Run {
    fn trace(&self, line: impl AsRef<str>) {
        println!("[{:>8.3}s] {}", self.started.elapsed().as_secs_f64(), line.as_ref());
    }
}

fn main() -> ExitCode {
    let Cmd::Run {
        seed,
        duration,
        coordinators,
        workers,
        rate,
        fault_every_ms,
        without,
        json,
        tenure_bin,
        nats_server,
        plant_double,
        keep,
    } = Cli::parse().command;
    let seed = seed.unwrap_or_else(|| rand::rngs::StdRng::from_entropy().gen());
    println!("seed {seed}");
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let opts = Opts { seed, duration, coordinators, workers, rate, fault_every_ms, without, json, plant_double, keep };
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let outcome = rt.block_on(async {
        tokio::select! {
            r = run(opts, tenure_bin, nats_server, run_id.clone()) => r,
            _ = interrupted() => Err(anyhow::anyhow!("interrupted")),
        }
    });
    // Whatever happened, no process of this run outlives it: the cluster's nodes
    // stop when it drops; tasks and shims carry the run's marker.
    for p in scan_procs(&run_id) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL);
    }
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

struct Opts {
    seed: u64,
    duration: u64,
    coordinators: usize,
    workers: usize,
    rate: f64,
    fault_every_ms: u64,
    without: Vec<String>,
    json: Option<PathBuf>,
    plant_double: bool,
    keep: bool,
}

fn find_tenure(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p);
    }
    let me = std::env::current_exe()?;
    let sibling = me.parent().map(|d| d.join("tenure"));
    let up = me.parent().and_then(Path::parent).map(|d| d.join("tenure"));
    [sibling, up].into_iter().flatten().find(|p| p.is_file()).context("tenure binary not found; pass --tenure-bin")
}

const SESSION: &str = "chaos";

/// One try of `req`; `None` for any failure (the harness polls).
async fn api(client: &Client, req: &ApiRequest, timeout: Duration) -> Option<ApiResponse> {
    client.call(req, timeout).await.ok()
}

/// The load's submits: the shared retry rule, kept up for 300 s, 3 s a try,
/// and through a registry behind its mark (the harness puts it back itself).
const LOAD_SUBMIT: Policy = Policy {
    overall: Duration::from_secs(300),
    first_pause: Duration::from_millis(300),
    max_pause: Duration::from_millis(300),
    per_try: Duration::from_secs(3),
    through_registry_behind: true,
};

/// Resolves on SIGINT or SIGTERM.
async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        },
        _ => std::future::pending().await,
    }
}

/// One run in a directory of its own, kept when asked, when the judge found
/// violations, or when the run failed (its logs say why).
async fn run(
    o: Opts,
    tenure_bin: Option<PathBuf>,
    nats_server: Option<PathBuf>,
    run_id: String,
) -> anyhow::Result<bool> {
    let tmp = tempfile::Builder::new().prefix("tenure-chaos-").tempdir()?;
    let keep = o.keep;
    let result = run_in(o, tenure_bin, nats_server, run_id, tmp.path().to_path_buf()).await;
    if keep || !matches!(result, Ok(true)) {
        println!("run directory kept: {}", tmp.keep().display());
    }
    result
}

async fn run_in(
    o: Opts,
    tenure_bin: Option<PathBuf>,
    nats_server: Option<PathBuf>,
    run_id: String,
    dir: PathBuf,
) -> anyhow::Result<bool> {
    let bin = find_tenure(tenure_bin)?;
    let nats_bin = tenure_launch::nats::find(nats_server)?;
    let ledger = dir.join("ledger");
    std::fs::write(&ledger, b"")?;
    let r = Run { started: Instant::now() };
    r.trace(format!(
        "dir {} · {} coordinators · {} workers · {} s",
        dir.display(),
        o.coordinators,
        o.workers,
        o.duration
    ));

    // Tasks run as `nobody` when this harness can make it so: then the hostile
    // task may do its worst (see `hostile.rs`).
    let mode = hostile::Mode::detect();
    if mode.run_as().is_some() {
        hostile::open_up(&dir, &ledger)?;
    }
    r.trace(format!("hostile tasks: {}", mode.describe()));
    let power = power::Mode::detect(&bin);
    r.trace(format!("disks: {}", power.describe()));
    let mut cluster = Cluster::start(&bin, &nats_bin, &dir, o.coordinators, o.workers, mode.run_as(), &power).await?;
    let nats = tenure_transport::NatsOptions::url(cluster.nats_url());
    let client = Client::connect(&nats, "tenure-chaos", true, SESSION.parse()?).await?;
    let up = wait_until(Duration::from_secs(60), || async {
        let Some(ApiResponse::Status(s)) = api(&client, &ApiRequest::Status, Duration::from_secs(2)).await else {
            return false;
        };
        s.workers.iter().filter(|w| w.alive).count() == o.workers
    })
    .await;
    anyhow::ensure!(up, "the cluster did not come up; see {}/logs", dir.display());
    r.trace("cluster up; load and faults start");

    let mut plan = schedule::plan(o.seed, o.duration * 1000, o.coordinators, o.workers, o.fault_every_ms);
    plan.retain(|p| !o.without.iter().any(|k| k == p.fault.kind()));
    let submitted: Arc<Mutex<Vec<Submitted>>> = Arc::default();
    let stop = Arc::new(tokio::sync::Notify::new());
    let quiet = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = tokio::spawn(load(
        client.clone(),
        quiet.clone(),
        o.seed,
        o.rate,
        run_id.clone(),
        ledger.clone(),
        o.plant_double,
        submitted.clone(),
        stop.clone(),
    ));
    let history: Arc<Mutex<History>> = Arc::default();
    let poller = tokio::spawn(poll_history(client.clone(), history.clone(), stop.clone()));

    let mut faults: BTreeMap<&'static str, u64> = BTreeMap::new();
    let (mut machine_faults, mut restarts) = (0u64, 0u64);
    // Registry rollbacks led although behind what they replaced (violations).
    let (mut rollbacks, mut unrefused) = (0u32, Vec::<String>::new());
    // The faults that touched the NATS store, latest last, with their time:
    // what a registry found behind its mark at the end is to be read against.
    let mut store_faults: Vec<String> = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(o.seed ^ 0x5eed);
    let mut pending: Vec<(Instant, Pending)> = Vec::new();
    let load_start = Instant::now();
    let end = load_start + Duration::from_secs(o.duration);
    let mut next = plan.into_iter().peekable();
    while Instant::now() < end {
        while let Some(p) = next.peek() {
            if load_start + Duration::from_millis(p.at_ms) > Instant::now() {
                break;
            }
            let fault = next.next().map(|p| p.fault).expect("peeked");
            let line = match fault {
                Fault::HostileTask => submit_hostile(&client, mode, &run_id, &ledger, &submitted),
                Fault::NatsRestart => nats_restart(&mut cluster, &client, &quiet, &submitted, &mut pending).await,
                Fault::RegistryRollback => {
                    let (line, led_behind) = registry_rollback(&mut cluster, &client, rollbacks, &mut pending).await;
                    rollbacks += 1;
                    if led_behind {
                        unrefused.push(line.clone());
                    }
                    line
                }
                _ => inject(&mut cluster, &client, &fault, &mut rng, &mut pending).await,
            };
            r.trace(&line);
            // Faults fall due back to back once the slow ones put the plan
            // behind; the earlier ones still end on time, and nodes due to
            // start again start.
            apply_due(&cluster, &mut pending);
            cluster.supervise()?;
            if fault.touches_nats_store() {
                store_faults.push(format!("[{:.3}s] {line}", r.started.elapsed().as_secs_f64()));
            }
            if matches!(fault, Fault::PowerLoss { .. }) && !cluster.has_disks() {
                continue;
            }
            *faults.entry(fault.kind()).or_default() += 1;
            if fault.strikes_machine() {
                machine_faults += 1;
            }
            if fault.restarts_machine() {
                restarts += 1;
            }
        }
        apply_due(&cluster, &mut pending);
        cluster.supervise()?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.notify_waiters();
    let _ = load.await;
    for (_, action) in pending.iter_mut() {
        if let Pending::Stop(dup) = action {
            dup.stop();
        }
    }
    r.trace("faults stop; healing");
    cluster.heal()?;

    let quiet = wait_until(Duration::from_secs(120), || async { settled(&client, &submitted).await }).await;
    r.trace(if quiet { "quiescent" } else { "not quiescent within 120 s; judging anyway" });
    stop.notify_waiters();
    poller.abort();

    let finals: Vec<Final> =
        match api(&client, &ApiRequest::List { session: SESSION.parse()?, all: true }, Duration::from_secs(10)).await {
            Some(ApiResponse::List(list)) => list
                .into_iter()
                .map(|s| Final {
                    workflow: !s.steps.is_empty(),
                    id: s.id.to_string(),
                    label: s.label,
                    status: s.status.as_str().to_owned(),
                    hint: s.hint.map(|h| h.tag.as_str().to_owned()),
                    parent: s.parent.map(|p| p.to_string()),
                    idempotent: s.idempotent,
                    detail: s.detail.map(|d| d.to_string()),
                })
                .collect(),
            _ => {
                // The coordinators rightly refusing a registry behind its
                // high-water mark is an outcome of its own: the registry lost
                // acknowledged writes during the run.
                if let Some(outcome) = registry_behind(&client, &store_faults).await {
                    println!("summary: seed {} · {outcome}", o.seed);
                    if let Some(path) = &o.json {
                        let report = serde_json::json!({
                            "seed": o.seed,
                            "outcome": "registry-behind-mark",
                            "detail": outcome,
                            "faults_injected": faults,
                        });
                        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
                    }
                    anyhow::bail!("{outcome}");
                }
                anyhow::bail!("cannot list the registry at the end of the run")
            }
        };
    let ledger_lines: Vec<(String, u32)> = std::fs::read_to_string(&ledger)?
        .lines()
        .filter_map(|l| {
            let (t, a) = l.split_once(' ')?;
            Some((t.to_owned(), a.trim().parse().ok()?))
        })
        .collect();
    let leader_epoch = match api(&client, &ApiRequest::Status, Duration::from_secs(5)).await {
        Some(ApiResponse::Status(s)) => s.leader_epoch.0,
        _ => anyhow::bail!("cannot read the cluster status at the end of the run"),
    };
    let procs = scan_procs(&run_id);
    let resurrections = history.lock().map(|h| h.1.clone()).unwrap_or_default();
    let submitted = submitted.lock().map(|s| s.clone()).unwrap_or_default();
    cluster.stop();
    for p in &procs {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid), Signal::SIGKILL);
    }
    // Each machine's epoch fence, read from its store once its sidecar stopped.
    let mut epochs = checker::Epochs { leader: leader_epoch, workers: Vec::new() };
    for i in 0..o.workers {
        let db = cluster.worker_dir(i).join("sidecar-db");
        let fence = tenure_sidecar::SledStore::open(&db)
            .and_then(tenure_sidecar::Machine::restore)
            .map(|m| m.epoch().0)
            .with_context(|| format!("reading the epoch fence of w{}", i + 1))?;
        epochs.workers.push((format!("w{}", i + 1), fence));
    }

    let explanations = checker::Explanations {
        machine_faults,
        wipes: faults.get("wipe-machine").copied().unwrap_or(0),
        restarts,
        slots: u64::from(cluster::SLOTS),
    };
    let context = checker::Context { epochs, explanations };
    let (counts, mut violations) = checker::check(&submitted, &finals, &ledger_lines, &resurrections, &procs, &context);
    for line in unrefused {
        violations.push(checker::Violation {
            kind: "registry-rollback-led".into(),
            task: "registry".into(),
            evidence: format!("a registry behind its high-water mark was not refused: {line}"),
        });
    }
    for v in &violations {
        r.trace(format!("VIOLATION {} {}: {}", v.kind, v.task, v.evidence));
    }
    let report = serde_json::json!({
        "seed": o.seed,
        "duration_s": o.duration,
        "coordinators": o.coordinators,
        "workers": o.workers,
        "tasks_submitted": counts.tasks_submitted,
        "completed": counts.completed,
        "failed": counts.failed,
        "killed": counts.killed,
        "unknown": counts.unknown,
        "lost": counts.lost,
        "double_executed": counts.double_executed,
        "anonymous": counts.anonymous,
        "resurrected": counts.resurrected,
        "orphans": counts.orphans,
        "fence_raised": counts.fence_raised,
        "hostile_tasks": counts.hostile,
        "hostile_task_mode": mode.describe(),
        "disks": power.describe(),
        "faults_injected": faults,
        "fault_every_ms": o.fault_every_ms,
        "without": o.without,
        "machine_faults": machine_faults,
        "violations": violations,
    });
    println!(
        "summary: seed {} · {} tasks · completed {} failed {} killed {} unknown {} · lost {} double {} anonymous {} resurrected {} orphans {} · {} faults · {} violations",
        o.seed, counts.tasks_submitted, counts.completed, counts.failed, counts.killed, counts.unknown, counts.lost,
        counts.double_executed, counts.anonymous, counts.resurrected, counts.orphans, faults.values().sum::<u64>(), violations.len()
    );
    println!("{report}");
    if let Some(path) = o.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
    }
    Ok(violations.is_empty())
}

/// When the coordinators refuse the registry as behind its high-water mark
/// (`ApiError::RegistryBehind`), the run's outcome `registry-behind-mark`:
/// what the mark says, what the registry holds, and the last faults that
/// touched the NATS store before the end. The refusal itself is right (the
/// coordinators never lead a registry that lost acknowledged writes); the
/// loss is what the run found.
async fn registry_behind(client: &Client, store_faults: &[String]) -> Option<String> {
    let reply = client.call(&ApiRequest::Status, Duration::from_secs(5)).await;
    let Err(tenure_client::Error::Api(ApiError::RegistryBehind { coordinator, expected, found, witness })) = reply
    else {
        return None;
    };
    let last = &store_faults[store_faults.len().saturating_sub(3)..];
    Some(format!(
        "registry-behind-mark: {coordinator} rightly refuses to lead a registry that lost acknowledged writes \
         (mark {expected} from {}; registry {found}); last faults on the NATS store: {}",
        witness.as_deref().unwrap_or("an unnamed witness"),
        if last.is_empty() { "none".to_owned() } else { last.join(" | ") }
    ))
}

/// The last status seen of every task, and every terminal → active change seen.
type History = (HashMap<String, String>, Vec<(String, String, String)>);

enum Pending {
    Cont(i32),
    Pass(Link),
    /// Stop a duplicate worker process (it stops by itself once refused for long).
    Stop(Box<cluster::Duplicate>),
}

/// Carries out the pending ends of faults that are due: a paused process
/// continues, a cut link passes, a duplicate worker stops.
fn apply_due(c: &Cluster, pending: &mut Vec<(Instant, Pending)>) {
    let now = Instant::now();
    for (_, action) in pending.iter_mut().filter(|(at, _)| *at <= now) {
        match action {
            Pending::Cont(pid) => {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGCONT);
            }
            Pending::Pass(link) => c.link(*link).set(proxy::Mode::Pass),
            Pending::Stop(node) => node.stop(),
        }
    }
    pending.retain(|(at, _)| *at > now);
}

/// Waits `bound`, or until `done` says so, while the faults already injected
/// end on time and the nodes whose down time is over start again: the slow
/// faults (`nats-restart`, `registry-rollback`) take seconds to tens of
/// seconds, and a 5 s cut or pause must not last as long as they do (an
/// earlier harness stretched them so, as its loop was waiting here).
/// Returns whether `done` said so.
async fn wait_applying<F, Fut>(
    c: &mut Cluster,
    pending: &mut Vec<(Instant, Pending)>,
    bound: Duration,
    mut done: F,
) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    let mut next_check = Instant::now();
    loop {
        apply_due(c, pending);
        let _ = c.supervise();
        let now = Instant::now();
        if now >= next_check {
            if done().await {
                return true;
            }
            next_check = Instant::now() + Duration::from_millis(500);
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_until<F, Fut>(bound: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    false
}

/// The leader's index, from the cluster's own status.
async fn leader(client: &Client) -> Option<usize> {
    let Some(ApiResponse::Status(s)) = api(client, &ApiRequest::Status, Duration::from_secs(2)).await else {
        return None;
    };
    let name = s.leader?.name;
    name.strip_prefix('c')?.parse::<usize>().ok()?.checked_sub(1)
}

async fn inject(
    c: &mut Cluster,
    client: &Client,
    fault: &Fault,
    rng: &mut rand::rngs::StdRng,
    pending: &mut Vec<(Instant, Pending)>,
) -> String {
    let ms = Duration::from_millis;
    match fault {
        Fault::KillLeader { down_ms } | Fault::KillStandby { down_ms } => {
            let lead = leader(client).await;
            let n = c.coordinator_count();
            let target = match (fault, lead) {
                (Fault::KillLeader { .. }, Some(l)) => l,
                (Fault::KillStandby { .. }, Some(l)) if n > 1 => (l + 1 + rng.gen_range(0..n - 1)) % n,
                _ => rng.gen_range(0..n),
            };
            let node = c.coordinator(target);
            let pid = node.pid();
            node.kill_for(ms(*down_ms));
            format!("{} {} (pid {pid:?}) SIGKILL, restart in {down_ms} ms", fault.kind(), node.name)
        }
        Fault::PauseLeader { ms: pause } => {
            let Some(l) = leader(client).await else { return "pause-leader: no leader to pause".into() };
            let node = c.coordinator(l);
            node.signal(Signal::SIGSTOP);
            if let Some(pid) = node.pid() {
                pending.push((Instant::now() + ms(*pause), Pending::Cont(pid)));
            }
            format!("pause-leader {} (pid {:?}) SIGSTOP for {pause} ms", node.name, node.pid())
        }
        Fault::KillWorker { worker, down_ms } => {
            let pid = c.worker(*worker).pid();
            c.worker(*worker).kill_for(ms(*down_ms));
            format!("kill-worker w{} (pid {pid:?}) SIGKILL, restart in {down_ms} ms", worker + 1)
        }
        Fault::KillSidecar { worker, down_ms } => {
            let pid = c.sidecar(*worker).pid();
            c.sidecar(*worker).kill_for(ms(*down_ms));
            format!("kill-sidecar w{} (pid {pid:?}) SIGKILL, restart in {down_ms} ms", worker + 1)
        }
        Fault::KillShim { worker } => {
            let shims = c.shims(*worker);
            if shims.is_empty() {
                return format!("kill-shim w{}: no task running there", worker + 1);
            }
            let (pid, _) = shims[rng.gen_range(0..shims.len())];
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            format!("kill-shim w{} shim pid {pid} SIGKILL", worker + 1)
        }
        Fault::KillLauncher { worker } => match c.launcher(*worker) {
            None => format!("kill-launcher w{}: no launcher running", worker + 1),
            Some(pid) => {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
                format!("kill-launcher w{} launcher pid {pid} SIGKILL", worker + 1)
            }
        },
        Fault::KillMachine { worker, down_ms } => {
            let tasks = c.shims(*worker).len();
            c.kill_machine(*worker, ms(*down_ms));
            format!(
                "kill-machine w{} (worker, sidecar, {tasks} shims and their groups), back in {down_ms} ms",
                worker + 1
            )
        }
        Fault::PauseWorker { worker, ms: pause } => {
            let node = c.worker(*worker);
            node.signal(Signal::SIGSTOP);
            if let Some(pid) = node.pid() {
                pending.push((Instant::now() + ms(*pause), Pending::Cont(pid)));
            }
            format!("pause-worker w{} (pid {:?}) SIGSTOP for {pause} ms", worker + 1, node.pid())
        }
        Fault::KillNats { down_ms } => {
            c.kill_nats(ms(*down_ms));
            format!("kill-nats SIGKILL, restart in {down_ms} ms")
        }
        Fault::Cut { link, mode, ms: cut } => {
            c.link(*link).set(*mode);
            pending.push((Instant::now() + ms(*cut), Pending::Pass(*link)));
            format!("{} {link:?} {mode:?} for {cut} ms", fault.kind())
        }
        Fault::PowerLoss { node, down_ms } if c.has_disks() => {
            let what = match node {
                PowerNode::Machine(i) => {
                    let tasks = c.shims(*i).len();
                    let cut = c.power_loss_machine(*i, ms(*down_ms));
                    format!("machine w{} ({tasks} shims and their groups): {cut:?}", i + 1)
                }
                PowerNode::Nats => format!("the NATS node: {:?}", c.power_loss_nats(ms(*down_ms))),
            };
            format!("power-loss of {what}; unsynced writes dropped, back in {down_ms} ms")
        }
        Fault::PowerLoss { .. } => "power-loss: skipped, no power-loss filesystem in this run".into(),
        Fault::WipeMachine { worker, down_ms } => {
            let tasks = c.shims(*worker).len();
            let wiped = c.wipe_machine(*worker, ms(*down_ms));
            format!(
                "wipe-machine w{}: machine down ({tasks} shims), data directory deleted ({wiped:?}), back in {down_ms} ms",
                worker + 1
            )
        }
        Fault::DuplicateWorker { worker, ms: alive } => {
            let serial = pending.len() + rng.gen_range(0..1_000_000);
            match c.duplicate_worker(*worker, serial) {
                Ok(dup) => {
                    let pid = dup.pid();
                    pending.push((Instant::now() + ms(*alive), Pending::Stop(Box::new(dup))));
                    format!("duplicate-worker w{} second process pid {pid:?} for {alive} ms", worker + 1)
                }
                Err(e) => format!("duplicate-worker w{} not started: {e:#}", worker + 1),
            }
        }
        Fault::ClockSkew { offset_ms } => {
            // The leader, so that the next leader takes over a registry
            // written under another clock; any coordinator without one.
            let target = leader(client).await.unwrap_or_else(|| rng.gen_range(0..c.coordinator_count()));
            let pid = c.coordinator(target).pid();
            c.skew_coordinator(target, *offset_ms);
            format!(
                "clock-skew {} (pid {pid:?}) restarted with its clock {offset_ms} ms off",
                c.coordinator(target).name
            )
        }
        Fault::CrashWindow { worker, point } => {
            c.crash_worker_at(*worker, point);
            format!("crash-window w{} restarted to die {point} its next attempt", worker + 1)
        }
        // Carried out by the run loop, which holds the load's list.
        Fault::HostileTask => "hostile-task".into(),
        Fault::NatsRestart => "nats-restart".into(),
        Fault::RegistryRollback => "registry-rollback".into(),
    }
}

/// `nats-restart`: the load pauses until every task settled (bounded), the
/// registry stays quiet for longer than its duplicate window, then
/// nats-server is SIGKILLed and started again on its store at once.
async fn nats_restart(
    c: &mut Cluster,
    client: &Client,
    quiet: &std::sync::atomic::AtomicBool,
    submitted: &Arc<Mutex<Vec<Submitted>>>,
    pending: &mut Vec<(Instant, Pending)>,
) -> String {
    quiet.store(true, std::sync::atomic::Ordering::Relaxed);
    // Nodes whose down time ends meanwhile come back (nats-server too, if an
    // earlier kill or power cut took it down), and cuts and pauses end on
    // time: the tasks can only settle, and the restart only restart a
    // running server, with them up.
    let settled =
        wait_applying(c, pending, Duration::from_secs(15), || async { settled(client, submitted).await }).await;
    let quiet_for = cluster::DUPLICATE_WINDOW + Duration::from_millis(1500);
    wait_applying(c, pending, quiet_for, || async { false }).await;
    let pid = c.nats_pid();
    c.kill_nats(Duration::ZERO);
    let restarted = c.supervise();
    quiet.store(false, std::sync::atomic::Ordering::Relaxed);
    format!(
        "nats-restart (pid {pid:?}) SIGKILL after {} quiet, started again on its store ({restarted:?})",
        if settled { "a settled and" } else { "an unsettled but" }
    )
}

/// The registry stream's last sequence, as the server answers it now
/// (retried for a while: the server may have just restarted).
async fn registry_last_seq(client: &Client) -> Option<u64> {
    let js = async_nats::jetstream::new(client.nats().clone());
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Ok(mut stream) = js.get_stream(subjects::REGISTRY_STREAM).await {
            if let Ok(info) = stream.info().await {
                return Some(info.state.last_sequence);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Restores the registry to a snapshot taken 3 s earlier, with the
/// coordinators down, and waits for the refusal. Returns the line to trace
/// and whether a registry behind what it replaced was led (a violation).
///
/// A snapshot that holds everything the registry held (nothing was written
/// in those 3 s: the cluster was busy with other faults) is no rollback at
/// all; leading it is right, and it is kept — it may have been written to
/// since. A refused one is replaced by the good registry again; one led
/// although behind is kept too (putting the good one back would lose what
/// was written to it meanwhile), and reported.
/// The last sequence the registry's high-water mark in the leader lease
/// names, as the server holds it now (only the `mark` of the lease value is
/// read; `None` while there is none or the lease cannot be read).
async fn lease_mark(client: &Client) -> Option<u64> {
    #[derive(serde::Deserialize)]
    struct Leader {
        #[serde(default)]
        mark: Option<tenure_protocol::messages::RegistryMark>,
    }
    let js = async_nats::jetstream::new(client.nats().clone());
    let kv = js.get_key_value(subjects::LEADER_BUCKET).await.ok()?;
    let value = kv.get(subjects::LEADER_KEY).await.ok()??;
    let leader: Leader = tenure_protocol::decode(&value).ok()?;
    leader.mark.map(|m| m.last_seq)
}

/// `registry-rollback`: snapshots the registry stream (nats-server stopped
/// for the copy), lets the run move past it, stops every coordinator, puts
/// the snapshot in place and starts them: they must refuse to lead and say so
/// to clients (`ApiError::RegistryBehind`). Then the good registry goes back
/// and the run continues. Returns the trace line and whether it was refused.
///
/// A rollback is judged only once the mark in the lease has passed
/// everything the snapshot can hold: appends newer than the last mark the
/// leader wrote (every renewal carries it) are not covered by it, and going
/// back over only those is not what the mark can see.
async fn registry_rollback(
    c: &mut Cluster,
    client: &Client,
    n: u32,
    pending: &mut Vec<(Instant, Pending)>,
) -> (String, bool) {
    let old = c.dir.join(format!("registry-snapshot-{n}"));
    if let Err(e) = c.snapshot_registry(&old).await {
        return (format!("registry-rollback: no snapshot taken: {e:#}"), false);
    }
    // At most this much is in the snapshot.
    let snapshot_seq = registry_last_seq(client).await;
    // The registry and the mark in the lease move past the snapshot.
    wait_applying(c, pending, Duration::from_secs(3), || async { false }).await;
    let covered = wait_applying(c, pending, Duration::from_secs(10), || async {
        matches!((lease_mark(client).await, snapshot_seq), (Some(mark), Some(snap)) if mark > snap)
    })
    .await;
    c.hold_coordinators();
    let good_seq = registry_last_seq(client).await;
    let good = c.dir.join(format!("registry-good-{n}"));
    if let Err(e) = c.swap_registry(&old, &good).await {
        let _ = c.release_coordinators();
        return (format!("registry-rollback: not restored: {e:#}"), false);
    }
    let old_seq = registry_last_seq(client).await;
    let _ = c.release_coordinators();
    let behind = match (old_seq, good_seq) {
        (Some(old), Some(good)) => old < good,
        // Unknown: judged as a rollback.
        _ => true,
    };
    // Behind, but not behind the mark: leading it is all the mark allows.
    let judged = behind && covered;
    let refused = wait_applying(c, pending, Duration::from_secs(30), || async {
        let reply = client.call(&ApiRequest::Status, Duration::from_secs(2)).await;
        matches!(reply, Err(tenure_client::Error::Api(ApiError::RegistryBehind { .. })))
    })
    .await;
    let seqs = format!("sequence {old_seq:?} restored over {good_seq:?}");
    if !refused {
        let what = match (behind, covered) {
            (true, true) => "NOT REFUSED though behind its mark",
            (true, false) => "led: the mark in the lease had not passed the snapshot, so it cannot see this rollback",
            (false, _) => "nothing was written since: led, as it should be",
        };
        return (format!("registry-rollback: snapshot restored with coordinators down ({seqs}); {what}; kept"), judged);
    }
    // Put the good registry back (the refusing coordinator loads it again).
    let back = c.dir.join(format!("registry-rolled-back-{n}"));
    let restored = c.swap_registry(&good, &back).await;
    let line = format!(
        "registry-rollback: snapshot restored with coordinators down ({seqs}); refused to lead, reported to clients; good registry back ({restored:?})"
    );
    (line, false)
}

/// Submits tasks at `rate` until stopped. Each submission retries with its own
/// idempotency key until answered, so a failover never makes one task two.
#[allow(clippy::too_many_arguments)]
async fn load(
    client: Client,
    quiet: Arc<std::sync::atomic::AtomicBool>,
    seed: u64,
    rate: f64,
    run_id: String,
    ledger: PathBuf,
    plant_double: bool,
    submitted: Arc<Mutex<Vec<Submitted>>>,
    stop: Arc<tokio::sync::Notify>,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x10ad);
    let every = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let session: SessionId = SESSION.parse().expect("valid session");
    let mut n = 0u64;
    // Registered once, before the loop: `notify_waiters` reaches a waiter only
    // while it is registered, and this task spends most of its time outside
    // the `select!` (submitting). A stop sent then was lost, and the run hung
    // waiting for the load to end.
    let stopped = stop.notified();
    tokio::pin!(stopped);
    stopped.as_mut().enable();
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = tokio::time::sleep(every) => {}
        }
        if quiet.load(std::sync::atomic::Ordering::Relaxed) {
            continue;
        }
        n += 1;
        let idempotent = rng.gen_bool(0.25);
        let sleep_ms: u64 = rng.gen_range(0..3000);
        let label = format!("chaos-{n}");
        let append = ledger_append(&ledger);
        let planted = plant_double && n == 3;
        let sleeping = |ms: u64| format!("{append}; sleep {}.{:03}", ms / 1000, ms % 1000);
        // Every task of the load: tagged with the run, idempotent or not.
        let of_run = |mut spec: TaskSpec, idempotent: bool| {
            spec.idempotent = idempotent;
            spec.env.insert("TENURE_CHAOS_RUN".into(), run_id.clone());
            spec
        };
        let command = if planted { format!("{append}; {append}") } else { sleeping(sleep_ms) };
        // One submission in ten is a batch of three such tasks, in one request.
        if !planted && rng.gen_bool(0.1) {
            let tasks = (0..3)
                .map(|i| {
                    let spec = TaskSpec::shell(format!("{label}.{i}"), sleeping((sleep_ms + i * 700) % 3000));
                    BatchTask { idempotency_key: uuid::Uuid::new_v4(), spec: of_run(spec, idempotent) }
                })
                .collect::<Vec<_>>();
            let first = {
                let mut s = submitted.lock().expect("submitted list");
                for t in &tasks {
                    s.push(Submitted { label: t.spec.label.clone(), id: None, idempotent, hostile: false });
                }
                s.len() - tasks.len()
            };
            submit_batch_until_answered(&client, SubmitBatch { session: session.clone(), tasks }, &submitted, first);
            continue;
        }
        // One submission in ten is a workflow of two or three such steps.
        let spec = if !planted && rng.gen_bool(0.1) {
            let steps =
                (0..rng.gen_range(2..=3)).map(|i| format!("{append}; sleep 0.{}", (sleep_ms / 3 + i * 100) % 1000));
            TaskSpec::workflow(label.clone(), steps.collect::<Vec<_>>())
        } else {
            TaskSpec::shell(label.clone(), command)
        };
        let spec = of_run(spec, idempotent && !planted);
        let req = SubmitRequest { session: session.clone(), idempotency_key: uuid::Uuid::new_v4(), spec };
        let index = {
            let mut s = submitted.lock().expect("submitted list");
            s.push(Submitted { label, id: None, idempotent: idempotent && !planted, hostile: false });
            s.len() - 1
        };
        submit_until_answered(&client, req, &submitted, index);
    }
}

/// Sends `req` (a submit with its own idempotency key, kept on every try) in
/// the background until answered, under [`LOAD_SUBMIT`], and records the
/// task's id at `index`.
fn submit_until_answered(client: &Client, req: SubmitRequest, submitted: &Arc<Mutex<Vec<Submitted>>>, index: usize) {
    let (client, submitted) = (client.clone(), submitted.clone());
    tokio::spawn(async move {
        if let Ok(answer) = client.submit_request(req, &LOAD_SUBMIT).await {
            if let Ok(mut s) = submitted.lock() {
                s[index].id = Some(answer.task.to_string());
            }
        }
    });
}

/// [`submit_until_answered`] for a batch: every task's id is recorded, from
/// `first` on, in the batch's order.
fn submit_batch_until_answered(
    client: &Client,
    batch: SubmitBatch,
    submitted: &Arc<Mutex<Vec<Submitted>>>,
    first: usize,
) {
    let (client, submitted) = (client.clone(), submitted.clone());
    tokio::spawn(async move {
        let request = ApiRequest::SubmitBatch(batch);
        if let Ok(ApiResponse::SubmittedBatch(done)) = client.request(&request, &LOAD_SUBMIT).await {
            if let Ok(mut s) = submitted.lock() {
                for (i, answer) in done.into_iter().enumerate() {
                    s[first + i].id = Some(answer.task.to_string());
                }
            }
        }
    });
}

/// The effect every task of the load starts with: its id and attempt,
/// appended to the ledger (one `write`, fsynced).
fn ledger_append(ledger: &Path) -> String {
    format!(
        "printf '%s %s\\n' \"$TENURE_TASK_ID\" \"$TENURE_ATTEMPT\" | dd of={} oflag=append conv=notrunc,fsync status=none",
        ledger.display()
    )
}

/// Submits one hostile task (retried with its own idempotency key until
/// answered, like the load's) and returns the trace line.
fn submit_hostile(
    client: &Client,
    mode: hostile::Mode,
    run_id: &str,
    ledger: &Path,
    submitted: &Arc<Mutex<Vec<Submitted>>>,
) -> String {
    let label = format!("hostile-{}", uuid::Uuid::new_v4().simple());
    let mut spec = TaskSpec::shell(label.clone(), hostile::command(mode, &ledger_append(ledger)));
    spec.env.insert("TENURE_CHAOS_RUN".into(), run_id.to_owned());
    spec.env.insert("FRAME".into(), hostile::max_epoch_frame());
    let Ok(session) = SESSION.parse::<SessionId>() else { return "hostile-task: bad session".into() };
    let req = SubmitRequest { session, idempotency_key: uuid::Uuid::new_v4(), spec };
    let index = match submitted.lock() {
        Ok(mut s) => {
            s.push(Submitted { label: label.clone(), id: None, idempotent: false, hostile: true });
            s.len() - 1
        }
        Err(_) => return "hostile-task: submission list unusable".into(),
    };
    submit_until_answered(client, req, submitted, index);
    format!("hostile-task {label} submitted ({})", if mode.run_as().is_some() { "run as nobody" } else { "same uid" })
}

/// Polls every snapshot and records any terminal task seen active again.
async fn poll_history(client: Client, history: Arc<Mutex<History>>, _stop: Arc<tokio::sync::Notify>) {
    let Ok(session) = SESSION.parse::<SessionId>() else { return };
    loop {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let Some(ApiResponse::List(list)) =
            api(&client, &ApiRequest::List { session: session.clone(), all: true }, Duration::from_secs(3)).await
        else {
            continue;
        };
        let Ok(mut h) = history.lock() else { return };
        let (seen, resurrected) = &mut *h;
        for s in list {
            let id = s.id.to_string();
            let now = s.status.as_str().to_owned();
            if let Some(before) = seen.get(&id) {
                let was_terminal = ["completed", "failed", "killed"].contains(&before.as_str());
                if was_terminal && before != &now {
                    resurrected.push((id.clone(), before.clone(), now.clone()));
                }
            }
            seen.insert(id, now);
        }
    }
}

/// Every submission answered, and every task terminal or unknown.
async fn settled(client: &Client, submitted: &Arc<Mutex<Vec<Submitted>>>) -> bool {
    let all_answered = submitted.lock().map(|s| s.iter().all(|x| x.id.is_some())).unwrap_or(false);
    let Ok(session) = SESSION.parse::<SessionId>() else { return false };
    let Some(ApiResponse::List(list)) =
        api(client, &ApiRequest::List { session, all: true }, Duration::from_secs(3)).await
    else {
        return false;
    };
    // A workflow waiting on an unknown step is as settled as that step.
    let settled = |s: &tenure_protocol::messages::TaskSnapshot| {
        s.status.is_terminal()
            || s.status == tenure_protocol::Status::Unknown
            || (!s.steps.is_empty() && s.hint.is_some())
    };
    all_answered && list.iter().all(settled)
}

/// Live processes carrying this run's marker, with their task and parent.
fn scan_procs(run_id: &str) -> Vec<Proc> {
    let marker = format!("TENURE_CHAOS_RUN={run_id}");
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|b| *b == 0).collect();
        if !vars.contains(&marker.as_bytes()) {
            continue;
        }
        let task = vars
            .iter()
            .find_map(|v| v.strip_prefix(b"TENURE_TASK_ID="))
            .map(|t| String::from_utf8_lossy(t).into_owned());
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first() == Some(&"Z") {
            continue;
        }
        let ppid = f.get(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        out.push(Proc { pid, ppid, task: task.unwrap_or_default() });
    }
    out
}
