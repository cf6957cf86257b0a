//! `tenure dev`: a whole local cluster in one command — nats-server with
//! JetStream on loopback, coordinators `c1` … `cN` (one leads, the others stand
//! by), N workers each with its sidecar, a gateway — as child processes of
//! this one, started by the one local-cluster harness ([`tenure_launch::cluster`]),
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

use anyhow::{bail, Context};
use serde::Serialize;
use tenure_launch::cluster::{Cluster, Layout};
use tenure_launch::daemon::{nats_user, DaemonArgs};

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

    // The one local-cluster harness: every daemon with its own credentials,
    // in a process group of its own (a Ctrl-C in the terminal reaches
    // `tenure dev`, which then stops them in order).
    let mut cluster = Cluster::new(&data, &exe, "")?;
    cluster.own_process_groups();
    cluster.set_stop_grace(Duration::from_secs(10));
    // NATS connection settings of the caller's environment are meant for
    // another cluster: each component gets its own credentials, and no TLS.
    for (var, _) in std::env::vars_os() {
        if let Some(var) = var.to_str().filter(|n| n.starts_with("TENURE_NATS") && *n != "TENURE_NATS_SERVER") {
            cluster.remove_env(var);
        }
    }
    // One metrics address cannot serve every component of the cluster.
    cluster.remove_env("TENURE_METRICS_ADDR");
    // The caller's log filter, when set, is every component's.
    if let Some(filter) = std::env::var("RUST_LOG").ok().filter(|f| !f.is_empty()) {
        cluster.set_env("RUST_LOG", &filter);
    }
    let mut credentials = std::collections::BTreeMap::new();
    for identity in &identities {
        credentials.insert(identity.user.clone(), nats_auth::read_env_file(&identity.env_file(&creds))?);
    }
    cluster.set_credentials(credentials);

    let config = tenure_launch::nats::Config {
        include: Some(format!("creds/{}", nats_auth::AUTH_FILE)),
        ..tenure_launch::nats::Config::new(opts.nats_port, data.join("nats"))
    };
    cluster.start_nats(&nats_bin, config, "# Written by `tenure dev`.\n")?;
    let url = cluster.url().to_owned();
    let layout = Layout {
        coordinator_flags: vec!["--operator".into(), "operator".into()],
        worker_flags: vec!["--kill-tasks-on-exit".into()],
        ..Layout::new(opts.coordinators.max(1), opts.workers, opts.slots)
    };
    for planned in layout.coordinators(|_| url.clone()).iter().chain(&layout.machines(&data, |_| url.clone())) {
        cluster.spawn_planned(planned)?;
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
        let gateway_url = format!("http://127.0.0.1:{port}");
        let board = format!("{gateway_url}/#token={}", tokens.get("alice").map(String::as_str).unwrap_or(""));
        let args = vec![
            "gateway".into(),
            "--nats".into(),
            url.clone(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--tokens".into(),
            tokens_path.display().to_string(),
        ];
        cluster.spawn("gateway", DaemonArgs::from_vec(args))?;
        Some(DevGateway { url: gateway_url, board, tokens })
    };
    for m in cluster.members() {
        eprintln!("started {:<16} pid {:<7} log {}", m.name, m.last_pid().unwrap_or(0), m.log_path().display());
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
    let describe = |cluster: &Cluster| -> anyhow::Result<()> {
        let components: Vec<Component> = cluster
            .members()
            .iter()
            .map(|m| {
                let process = m.process();
                let mut command = vec![process.program().display().to_string()];
                command.extend(process.args().iter().cloned());
                let env_file = nats_user(process.args()).and_then(|u| env_of(&u));
                let pid = m.last_pid().unwrap_or(0) as u32;
                Component { name: m.name.clone(), pid, command, env_file, log: m.log_path().to_path_buf() }
            })
            .collect();
        let file = ClusterFile {
            nats_url: &url,
            data_dir: &data,
            identities: &clients,
            gateway: gateway.as_ref(),
            components: &components,
        };
        nats_auth::write_private(&cluster_path, &serde_json::to_string_pretty(&file)?, 0o600)
    };
    describe(&cluster)?;
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
    let mut quick_exits: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    let exit = loop {
        tokio::select! {
            _ = &mut shutdown => break ExitCode::SUCCESS,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                for (name, status) in cluster.note_exits(RESTART_AFTER) {
                    let quick = cluster.member(&name).and_then(|m| m.uptime()).is_some_and(|up| up < QUICK_EXIT);
                    let n = quick_exits.entry(name.clone()).or_default();
                    *n = if quick { *n + 1 } else { 0 };
                    eprintln!("{name} exited ({status}): {}; starting it again in {} s", while_gone(&name), RESTART_AFTER.as_secs());
                }
                if let Some((name, _)) = quick_exits.iter().find(|(_, n)| **n >= QUICK_EXITS_TOLERATED) {
                    eprintln!("{name} keeps exiting right after it starts; stopping the cluster (see logs/{name}.log)");
                    break ExitCode::FAILURE;
                }
                let restarted = cluster.supervise();
                for (name, started) in &restarted {
                    match started {
                        Ok(pid) => eprintln!("started {name:<16} pid {pid:<7} again"),
                        Err(e) => eprintln!("{name} could not be started again: {e}"),
                    }
                }
                // cluster.json keeps naming each component's pid.
                if !restarted.is_empty() {
                    let _ = describe(&cluster);
                }
            }
        }
    };
    cluster.stop_all(|name, in_grace| {
        if in_grace {
            eprintln!("stopped {name}");
        } else {
            eprintln!("{name} did not stop within 10s; killed it");
        }
    });
    eprintln!("cluster stopped");
    Ok(exit)
}
