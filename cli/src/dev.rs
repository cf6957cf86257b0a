//! `tenure dev`: a whole local cluster in one command — nats-server with
//! JetStream on loopback, coordinators `c1` … `cN` (one leads, the others stand
//! by), N workers each with its sidecar — as child processes of this one,
//! described in `DATA/cluster.json` (with every component's command line and
//! credentials file) and stopped cleanly on Ctrl-C / SIGTERM. A component that
//! exits — killed to see what happens — is started again after 2 s, and what
//! the product does meanwhile is said; only one that keeps exiting right after
//! it starts stops the cluster.
//!
//! Secure by default: it generates the NATS layout of `tenure nats-auth`
//! into `DATA/creds/` (a user per coordinator and per machine's worker and
//! sidecar, and the users `alice`, `bob` and `operator` — the coordinators'
//! operator — in the clients' account), starts nats-server with it and
//! JetStream's `sync_interval: always`, and every daemon with its own
//! credentials. `DATA/dev.env` makes a shell act as `alice`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use nix::sys::signal::Signal;
use serde::Serialize;
use tenure_launch::daemon::{machine_dir, DaemonArgs};
use tenure_launch::process::Process;

use crate::nats_auth;

pub struct DevOptions {
    pub data_dir: PathBuf,
    pub nats_port: u16,
    pub workers: u32,
    pub slots: u32,
    pub coordinators: u32,
    /// 0: no gateway; otherwise its port (a free one when this is taken).
    pub gateway_port: u16,
}

#[derive(Serialize)]
struct Component {
    name: String,
    pid: u32,
    command: Vec<String>,
    /// The credentials it runs with (`set -a; . FILE` before `command` to
    /// start it again by hand).
    env_file: Option<PathBuf>,
    log: PathBuf,
}

/// How a client acts as one of the dev cluster's users.
#[derive(Serialize)]
struct ClientIdentity {
    user: String,
    password: String,
    /// `TENURE_NATS_USER` and `TENURE_NATS_PASSWORD`, for `set -a; . FILE`.
    env_file: PathBuf,
}

#[derive(Serialize)]
struct ClusterFile<'a> {
    nats_url: &'a str,
    data_dir: &'a Path,
    /// The users of the clients' account, by name.
    identities: &'a std::collections::BTreeMap<String, ClientIdentity>,
    /// The HTTP gateway, when one runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    gateway: Option<&'a DevGateway>,
    components: &'a [Component],
}

/// The dev cluster's gateway: where it listens, and a bearer token for each
/// user (acting with that user's NATS credentials).
#[derive(Serialize)]
struct DevGateway {
    url: String,
    /// The task board, signed in as alice.
    board: String,
    tokens: std::collections::BTreeMap<String, String>,
}

/// The users of the clients' account a dev cluster starts with.
const DEV_USERS: [&str; 3] = ["alice", "bob", "operator"];

struct Running {
    name: String,
    process: Process,
    started: std::time::Instant,
    /// Exits in a row that came soon after a start (a component that cannot run).
    quick_exits: u32,
}

/// A component that exits this soon after its start, this many times in a
/// row, cannot run here: the cluster stops instead of restarting it forever.
const QUICK_EXIT: Duration = Duration::from_secs(3);
const QUICK_EXITS_TOLERATED: u32 = 5;
/// Pause before a component that exited is started again.
const RESTART_AFTER: Duration = Duration::from_secs(2);

/// What the product does while `name` is gone, for the person watching.
fn while_gone(name: &str) -> &'static str {
    match name.split('-').next().unwrap_or(name) {
        "coordinator" => {
            "a standby (if any) takes the lease once it expires and adopts the running tasks without re-running them"
        }
        "worker" => "its tasks keep running under their shims; the restarted worker re-attaches them",
        "sidecar" => "its worker starts nothing new until it is back; running tasks go on",
        "nats" => "every component reconnects when it is back; nothing acknowledged is lost (sync_interval: always)",
        "gateway" => "HTTP clients and the board get no answer until it is back; tasks go on, and followed output resumes from its offset",
        _ => "",
    }
}

pub async fn run(opts: DevOptions, shutdown: impl std::future::Future<Output = ()>) -> anyhow::Result<ExitCode> {
    // The one finder (tenure_launch): says what is missing and how to get it.
    let nats_bin = tenure_launch::nats::find(None)?;
    let exe = std::env::current_exe().context("locating the tenure binary")?;
    std::fs::create_dir_all(&opts.data_dir)?;
    let data = std::fs::canonicalize(&opts.data_dir)?;
    let logs = data.join("logs");
    std::fs::create_dir_all(&logs)?;
    let url = format!("nats://127.0.0.1:{}", opts.nats_port);
    let url_of_nats = url.clone();
    if std::net::TcpStream::connect(("127.0.0.1", opts.nats_port)).is_ok() {
        bail!("port {} is already in use; stop what runs there or pass --nats-port", opts.nats_port);
    }

    let creds = data.join("creds");
    let auth_plan = nats_auth::Plan {
        coordinators: (1..=opts.coordinators.max(1)).map(|i| format!("c{i}")).collect(),
        machines: (1..=opts.workers).map(|i| format!("w{i}").parse()).collect::<Result<_, _>>()?,
        users: DEV_USERS.iter().map(|u| u.to_string()).collect(),
        routes: Vec::new(),
        tls_hosts: Vec::new(),
    };
    let identities = nats_auth::write(&creds, &auth_plan).context("generating the cluster's credentials")?;
    let env_of = |user: &str| identities.iter().find(|i| i.user == user).map(|i| i.env_file(&creds));
    let nats_conf = data.join("nats.conf");
    let config = tenure_launch::nats::Config {
        include: Some(format!("creds/{}", nats_auth::AUTH_FILE)),
        ..tenure_launch::nats::Config::new(opts.nats_port, data.join("nats"))
    };
    std::fs::write(&nats_conf, format!("# Written by `tenure dev`.\n{}", config.render()))?;

    let mut plan: Vec<(String, Vec<String>, Option<PathBuf>)> =
        vec![("nats".into(), vec![nats_bin.display().to_string(), "-c".into(), nats_conf.display().to_string()], None)];
    // The daemons' command lines as tenure_launch writes them, after this binary.
    let tenure = |args: DaemonArgs| -> Vec<String> {
        let mut v = vec![exe.display().to_string()];
        v.extend(args.into_vec());
        v
    };
    for i in 1..=opts.coordinators.max(1) {
        let name = format!("c{i}");
        plan.push((
            format!("coordinator-{name}"),
            tenure(DaemonArgs::coordinator(&url, &name).flags(&["--operator", "operator"])),
            env_of(&format!("coordinator-{name}")),
        ));
    }
    for i in 1..=opts.workers {
        let id = format!("w{i}");
        let dir = machine_dir(&data, &id);
        plan.push((
            format!("sidecar-{id}"),
            tenure(DaemonArgs::sidecar(&url, &id, &dir)),
            env_of(&format!("sidecar-{id}")),
        ));
        plan.push((
            format!("worker-{id}"),
            tenure(DaemonArgs::worker(&url, &id, opts.slots, &dir).flags(&["--kill-tasks-on-exit"])),
            env_of(&format!("worker-{id}")),
        ));
    }

    // The gateway acts as each user with that user's own credentials: one
    // token per user, made anew at every start (the file is rewritten).
    let gateway = if opts.gateway_port == 0 {
        None
    } else {
        let port = match std::net::TcpListener::bind(("127.0.0.1", opts.gateway_port)) {
            Ok(_) => opts.gateway_port,
            Err(_) => tenure_launch::free_port()?,
        };
        let tokens_path = data.join("gateway-tokens.json");
        let mut file = tenure_gateway::tokens::TokenFile::default();
        let mut tokens = std::collections::BTreeMap::new();
        for user in DEV_USERS {
            let (token, _) = file.create(user, env_of(user), Some("tenure dev".into()))?;
            tokens.insert(user.to_owned(), token);
        }
        file.save(&tokens_path)?;
        let url = format!("http://127.0.0.1:{port}");
        let board = format!("{url}/#token={}", tokens.get("alice").map(String::as_str).unwrap_or(""));
        let mut argv = vec![exe.display().to_string(), "gateway".into(), "--nats".into(), url_of_nats.clone()];
        argv.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--tokens".into(),
            tokens_path.display().to_string(),
        ]);
        plan.push(("gateway".into(), argv, None));
        Some(DevGateway { url, board, tokens })
    };

    let mut running: Vec<Running> = Vec::new();
    let mut components = Vec::new();
    for (name, argv, env_file) in plan {
        let log = logs.join(format!("{name}.log"));
        let started = component(&name, &argv, env_file.as_deref(), &log)
            .with_context(|| format!("starting {name}"))
            .and_then(|mut p| Ok((p.start()?, p)));
        let (pid, process) = match started {
            Ok(started) => started,
            Err(e) => {
                stop_all(&mut running).await;
                return Err(e);
            }
        };
        eprintln!("started {name:<16} pid {pid:<7} log {}", log.display());
        components.push(Component { name: name.clone(), pid, command: argv, env_file, log });
        running.push(Running { name: name.clone(), process, started: std::time::Instant::now(), quick_exits: 0 });
        if name == "nats" && !wait_for_port(opts.nats_port, Duration::from_secs(20)).await {
            stop_all(&mut running).await;
            bail!(
                "nats-server did not listen on 127.0.0.1:{} within 20s; see {}",
                opts.nats_port,
                logs.join("nats.log").display()
            );
        }
    }
    let clients: std::collections::BTreeMap<String, ClientIdentity> = identities
        .iter()
        .filter(|i| DEV_USERS.contains(&i.user.as_str()))
        .map(|i| {
            let id =
                ClientIdentity { user: i.user.clone(), password: i.password.clone(), env_file: i.env_file(&creds) };
            (i.user.clone(), id)
        })
        .collect();
    // cluster.json (0600: it holds credentials and tokens), written again
    // whenever a component's pid changes.
    let cluster_path = data.join("cluster.json");
    let describe = |components: &[Component]| -> anyhow::Result<()> {
        let cluster = ClusterFile {
            nats_url: &url,
            data_dir: &data,
            identities: &clients,
            gateway: gateway.as_ref(),
            components,
        };
        nats_auth::write_private(&cluster_path, &serde_json::to_string_pretty(&cluster)?, 0o600)
    };
    describe(&components)?;
    // A shell that sources this acts as alice on this cluster.
    let alice = identities.iter().find(|i| i.user == "alice").context("alice's credentials")?;
    let dev_env = data.join("dev.env");
    let text = format!("TENURE_NATS={url}\nTENURE_NATS_USER={}\nTENURE_NATS_PASSWORD={}\n", alice.user, alice.password);
    nats_auth::write_private(&dev_env, &text, 0o600)?;
    eprintln!("cluster up: {url}; described in {}", cluster_path.display());
    eprintln!("act as alice in a shell:  set -a; . {}; set +a", dev_env.display());
    eprintln!(
        "then: tenure submit -- echo hello   (bob and operator: {}/{{bob,operator}}.env); Ctrl-C stops the cluster",
        creds.display()
    );
    if let Some(g) = &gateway {
        eprintln!("task board (as alice): {}", g.board);
        eprintln!(
            "HTTP API: curl -H \"Authorization: Bearer $(jq -r .gateway.tokens.alice {})\" {}/v1/tasks",
            cluster_path.display(),
            g.url
        );
    }

    tokio::pin!(shutdown);
    // Every component that exits is started again: killing one shows what
    // the product does meanwhile (`tenure status` in another shell), it does
    // not end the demo.
    let mut restarts: Vec<(tokio::time::Instant, usize)> = Vec::new();
    let exit = loop {
        tokio::select! {
            _ = &mut shutdown => break ExitCode::SUCCESS,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                for (i, r) in running.iter_mut().enumerate() {
                    if restarts.iter().any(|(_, j)| *j == i) {
                        continue;
                    }
                    let Some(status) = r.process.try_exit() else { continue };
                    r.quick_exits = if r.started.elapsed() < QUICK_EXIT { r.quick_exits + 1 } else { 0 };
                    eprintln!("{} exited ({status}): {}; starting it again in {} s", r.name, while_gone(&r.name), RESTART_AFTER.as_secs());
                    restarts.push((tokio::time::Instant::now() + RESTART_AFTER, i));
                }
                if let Some(r) = running.iter().find(|r| r.quick_exits >= QUICK_EXITS_TOLERATED) {
                    eprintln!("{} keeps exiting right after it starts; stopping the cluster (see logs/{}.log)", r.name, r.name);
                    break ExitCode::FAILURE;
                }
                let now = tokio::time::Instant::now();
                let due: Vec<usize> = restarts.iter().filter(|(at, _)| *at <= now).map(|(_, i)| *i).collect();
                restarts.retain(|(at, _)| *at > now);
                let restarted = !due.is_empty();
                for i in due {
                    let c = &mut components[i];
                    match running[i].process.start() {
                        Ok(pid) => {
                            c.pid = pid;
                            eprintln!("started {:<16} pid {:<7} again", c.name, c.pid);
                            running[i].started = std::time::Instant::now();
                        }
                        Err(e) => eprintln!("{} could not be started again: {e:#}", c.name),
                    }
                }
                // cluster.json keeps naming each component's pid.
                if restarted {
                    let _ = describe(&components);
                }
            }
        }
    };
    stop_all(&mut running).await;
    eprintln!("cluster stopped");
    Ok(exit)
}

/// One component as a `tenure_launch` process (started, signalled and
/// stopped by its own pid; killed if `tenure dev` itself goes away).
fn component(name: &str, argv: &[String], env_file: Option<&Path>, log: &Path) -> anyhow::Result<Process> {
    let (bin, args) = argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // Own process group: a Ctrl-C in the terminal reaches `tenure dev`, which
    // then stops the components in order.
    let mut process = Process::new(name, Path::new(bin), &args, log).own_process_group();
    // NATS connection settings of the caller's environment are meant for
    // another cluster: each component gets its own credentials, and no TLS.
    for (var, _) in std::env::vars_os() {
        if let Some(var) = var.to_str().filter(|n| n.starts_with("TENURE_NATS") && *n != "TENURE_NATS_SERVER") {
            process = process.env_remove(var);
        }
    }
    // One metrics address cannot serve every component of the cluster.
    process = process.env_remove("TENURE_METRICS_ADDR");
    if let Some(file) = env_file {
        for (k, v) in nats_auth::read_env_file(file)? {
            process.set_env(&k, &v);
        }
    }
    Ok(process)
}

async fn wait_for_port(port: u16, bound: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    while tokio::time::Instant::now() < deadline {
        if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Stops components in reverse start order: workers end their tasks first, NATS last.
async fn stop_all(running: &mut Vec<Running>) {
    while let Some(mut r) = running.pop() {
        r.process.signal(Signal::SIGTERM);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while r.process.running() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if r.process.running() {
            eprintln!("{} did not stop within 10s; killing it", r.name);
        } else {
            eprintln!("stopped {}", r.name);
        }
        r.process.kill9();
    }
}
