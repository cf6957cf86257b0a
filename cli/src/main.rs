//! `tenure`: the daemons (`coordinator`, `worker`, `sidecar`), a whole local
//! cluster (`dev`), and the client verbs. Parsing and wiring only: every daemon
//! is a library crate, every client verb a request over NATS.

mod client;
#[macro_use]
mod config;
mod dev;
mod gateway;
mod metrics;
mod nats_auth;
mod shim_launcher;
mod status;
mod telemetry;
mod text;
mod units;
mod watch;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use config::SharedFlags;
use tenure_protocol::{Kind, SessionId, TaskId, WorkerId};

#[derive(Parser, Debug)]
#[command(
    name = "tenure",
    version,
    about = "A distributed task runtime: tasks that outlive their callers and their nodes"
)]
struct Cli {
    #[command(flatten)]
    nats: NatsArgs,
    /// Session that owns the tasks you submit (default: user-$USER).
    #[arg(long, global = true, env = "TENURE_SESSION")]
    session: Option<String>,
    /// Daemons: serve Prometheus metrics at `http://ADDR/metrics` (e.g.
    /// 127.0.0.1:9464). Unset: no endpoint.
    #[arg(long, global = true, env = "TENURE_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// How the process schedules its async work. `one-thread`, the default
    /// for the coordinator, the worker and the sidecar: the daemon's event
    /// loop and its NATS connection share one thread (file and process work
    /// goes to a pool of blocking threads either way), so no message is
    /// handed between threads. `threads`, the default for everything else:
    /// one scheduler thread per core.
    #[arg(long, global = true, env = "TENURE_RUNTIME", value_enum, value_name = "SCHEDULER")]
    runtime: Option<Scheduler>,
    #[command(subcommand)]
    command: Command,
}

/// How a process schedules its async work (`--runtime`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Scheduler {
    OneThread,
    Threads,
}

/// How every tenure process reaches NATS (`tenure_transport::NatsOptions`).
#[derive(Args, Debug)]
#[command(next_help_heading = "NATS connection")]
struct NatsArgs {
    /// NATS server URLs, comma-separated: every node of the NATS cluster, so
    /// that the process fails over between them.
    #[arg(
        long = "nats",
        global = true,
        env = "TENURE_NATS",
        value_delimiter = ',',
        default_value = tenure_transport::DEFAULT_SERVER
    )]
    servers: Vec<String>,
    /// NATS user (with a password).
    #[arg(long = "nats-user", global = true, env = "TENURE_NATS_USER")]
    user: Option<String>,
    /// Password of the NATS user (prefer the environment variable: arguments
    /// show in `ps`). A token is read from TENURE_NATS_TOKEN only.
    #[arg(long = "nats-password", global = true, env = "TENURE_NATS_PASSWORD", hide_env_values = true)]
    password: Option<String>,
    /// File holding the NATS nkey user seed.
    #[arg(long = "nats-nkey", global = true, env = "TENURE_NATS_NKEY", value_name = "SEED_FILE")]
    nkey: Option<PathBuf>,
    /// NATS credentials file (user JWT and seed).
    #[arg(long = "nats-creds", global = true, env = "TENURE_NATS_CREDS", value_name = "FILE")]
    creds: Option<PathBuf>,
    /// PEM file of the CAs that sign the NATS servers' certificates.
    #[arg(long = "nats-tls-ca", global = true, env = "TENURE_NATS_TLS_CA", value_name = "PEM")]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS (with --nats-tls-key).
    #[arg(long = "nats-tls-cert", global = true, env = "TENURE_NATS_TLS_CERT", value_name = "PEM")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --nats-tls-cert.
    #[arg(long = "nats-tls-key", global = true, env = "TENURE_NATS_TLS_KEY", value_name = "PEM")]
    tls_key: Option<PathBuf>,
    /// Refuse NATS servers that do not speak TLS.
    #[arg(long = "nats-tls-required", global = true, env = "TENURE_NATS_TLS_REQUIRED")]
    tls_required: bool,
}

/// The NATS token is read from the environment only (never an argument).
const NATS_TOKEN_ENV: &str = "TENURE_NATS_TOKEN";

impl NatsArgs {
    /// The options as given, not validated yet: a daemon merges them with its
    /// file first; a client verb validates them as they are.
    fn unvalidated(self) -> anyhow::Result<tenure_transport::NatsOptions> {
        let token = match std::env::var(NATS_TOKEN_ENV) {
            Ok(t) if !t.is_empty() => Some(tenure_transport::Secret::new(t)),
            Ok(_) | Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => anyhow::bail!("{NATS_TOKEN_ENV} is not valid UTF-8"),
        };
        let opts = tenure_transport::NatsOptions {
            servers: self.servers.into_iter().map(|s| s.trim().to_owned()).collect(),
            user: self.user,
            password: self.password.map(tenure_transport::Secret::new),
            token,
            nkey: self.nkey,
            creds: self.creds,
            tls_ca: self.tls_ca,
            tls_cert: self.tls_cert,
            tls_key: self.tls_key,
            tls_required: self.tls_required,
        };
        Ok(opts)
    }
}

/// The daemons' defaults, declared once in their libraries (see `config.rs`):
/// shown by `--help`, never overriding the file (only given flags do).
use config::{COORDINATOR_DEFAULTS as C, WORKER_DEFAULTS as W};

/// `tenure coordinator`: every flag also reads a TENURE_* variable, and both
/// override the `--config` file (see `config.rs`).
#[derive(Args, Debug)]
struct CoordinatorArgs {
    #[command(flatten)]
    config: config::ConfigArgs,
    /// Name recorded in the leader lease, the epoch claims and the standby presence.
    #[arg(long, env = "TENURE_COORDINATOR_NAME", default_value_t = C.name.clone())]
    name: String,
    /// A worker silent for this long is judged lost.
    #[arg(long, env = "TENURE_WORKER_TTL_MS", default_value_t = C.worker_ttl_ms)]
    worker_ttl_ms: u64,
    /// A task queued (and free to start) this long goes before every task
    /// queued later, whatever their `--priority`: no task starves.
    #[arg(long, env = "TENURE_PRIORITY_MAX_AGE_MS", default_value_t = C.priority_max_age_ms)]
    priority_max_age_ms: u64,
    /// JetStream replicas of the registry, notices and lease bucket (3 on a 3-node NATS cluster).
    #[arg(long, env = "TENURE_REPLICAS", default_value_t = C.replicas)]
    replicas: usize,
    /// A standby takes over once the leader lease has not changed for this long (its own clock).
    #[arg(long, env = "TENURE_LEASE_TTL_MS", default_value_t = C.lease_ttl_ms)]
    lease_ttl_ms: u64,
    /// The leader renews its lease this often.
    #[arg(long, env = "TENURE_RENEW_INTERVAL_MS", default_value_t = C.renew_interval_ms)]
    renew_interval_ms: u64,
    /// The leader stops acting when no renewal succeeded for this long (below the TTL).
    #[arg(long, env = "TENURE_RENEW_DEADLINE_MS", default_value_t = C.renew_deadline_ms)]
    renew_deadline_ms: u64,
    /// An identity (authenticated NATS user) with the operator role: it may
    /// get, list and kill every identity's tasks. Repeatable.
    #[arg(long = "operator", env = "TENURE_OPERATORS", value_delimiter = ',')]
    operators: Vec<String>,
    /// A concurrency limit for a key, `KEY=N` (repeatable): it wins over
    /// the limit tasks of the key are submitted with.
    #[arg(long = "key-limit", value_name = "KEY=N", value_parser = parse_key_limit)]
    concurrency_limits: Vec<(String, u32)>,
    /// Hold submitted tasks of this kind that are not idempotent until
    /// approved (`tenure approve`); repeatable.
    #[arg(long = "approve-kind", value_name = "KIND")]
    approve_kinds: Vec<Kind>,
    /// Hold submitted tasks whose command matches this regular expression
    /// until approved; repeatable.
    #[arg(long = "approve-command", value_name = "REGEX")]
    approve_commands: Vec<String>,
    /// Who may approve a task the approval policy held: its owner (or an
    /// operator), or only an operator.
    #[arg(long, value_enum)]
    approver: Option<config::ApproverConfig>,
    /// Garbage-collect finished tasks this many seconds after they ended
    /// (files on the worker first, then the registry record); 0 keeps them.
    #[arg(long, env = "TENURE_RETENTION_SECS", default_value_t = C.retention_secs)]
    retention_secs: u64,
    /// Live (not finished) tasks one identity may hold; 0 is unlimited.
    #[arg(long, env = "TENURE_MAX_LIVE_TASKS", default_value_t = C.max_live_tasks)]
    max_live_tasks: u64,
    /// Tasks one identity may keep in the registry (finished ones until
    /// garbage-collected); 0 is unlimited.
    #[arg(long, env = "TENURE_MAX_KEPT_TASKS", default_value_t = C.max_kept_tasks)]
    max_kept_tasks: u64,
    /// Final-output bytes one identity may keep in the registry; 0 is unlimited.
    #[arg(long, env = "TENURE_MAX_OUTPUT_BYTES", default_value_t = C.max_output_bytes)]
    max_output_bytes: u64,
    /// Bytes the registry stream may hold (new tasks are refused before it is full).
    #[arg(long, env = "TENURE_REGISTRY_MAX_BYTES", default_value_t = C.registry_max_bytes)]
    registry_max_bytes: u64,
    /// How long JetStream remembers the registry's message ids (its duplicate window).
    #[arg(long, env = "TENURE_REGISTRY_DUPLICATE_WINDOW_MS", default_value_t = C.registry_duplicate_window_ms)]
    registry_duplicate_window_ms: u64,
    /// Lead a registry found behind its high-water mark (it lost acknowledged
    /// writes or was restored from an older backup), once you judged the loss;
    /// recorded with the epoch claim. Remove the flag once the cluster leads.
    #[arg(long, env = "TENURE_ACCEPT_REGISTRY_ROLLBACK")]
    accept_registry_rollback: bool,
    /// Bytes of notices kept (the oldest are dropped past it).
    #[arg(long, env = "TENURE_NOTICES_MAX_BYTES", default_value_t = C.notices_max_bytes)]
    notices_max_bytes: u64,
    /// Consumers (watching sessions) the notice stream allows.
    #[arg(long, env = "TENURE_NOTICES_MAX_CONSUMERS", default_value_t = C.notices_max_consumers)]
    notices_max_consumers: u32,
}

/// `tenure worker`.
#[derive(Args, Debug)]
struct WorkerArgs {
    #[command(flatten)]
    config: config::ConfigArgs,
    /// This machine's worker id.
    #[arg(long, env = "TENURE_WORKER_ID")]
    id: Option<WorkerId>,
    #[arg(long, env = "TENURE_SLOTS", default_value_t = W.slots)]
    slots: u32,
    /// The machine's data directory (shared with its sidecar).
    #[arg(long, env = "TENURE_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when a task is killed.
    #[arg(long, env = "TENURE_KILL_GRACE_MS", default_value_t = W.kill_grace_ms)]
    kill_grace_ms: u64,
    /// On a worker starting tasks closer together than this, a task's start
    /// is reported this much later, or with its end if it ends first (one
    /// message and one registry write for both); 0 reports every start at once.
    #[arg(long, env = "TENURE_STARTED_HOLD_MS", default_value_t = W.started_hold_ms)]
    started_hold_ms: u64,
    #[arg(long, env = "TENURE_HEARTBEAT_MS", default_value_t = W.heartbeat_ms)]
    heartbeat_ms: u64,
    /// Output bytes kept per task; past it bytes are dropped and counted.
    #[arg(long, env = "TENURE_OUTPUT_CAP", default_value_t = W.output_cap)]
    output_cap: u64,
    /// End running tasks when the worker stops (default: they keep running
    /// under their shims and a restarted worker re-attaches to them).
    #[arg(long, env = "TENURE_KILL_TASKS_ON_EXIT")]
    kill_tasks_on_exit: bool,
    /// Task kinds this worker runs and advertises, comma-separated. `agent`
    /// tasks keep their stdin open for `tenure send`; `monitor` tasks raise a
    /// notification per output line matching their pattern; `noop` (completes
    /// at once) and `sleep` (COMMAND milliseconds, killable) run inside the
    /// worker without a process; other kinds run like `shell`.
    #[arg(long, env = "TENURE_KINDS", value_delimiter = ',', default_value = config::WORKER_KINDS_DEFAULT.as_str())]
    kinds: Vec<Kind>,
    /// Where each attempt's scratch directory (its working directory and
    /// HOME) is made: default `<data-dir>.scratch`, never inside the data dir.
    #[arg(long, env = "TENURE_SCRATCH_DIR", value_name = "DIR")]
    scratch_dir: Option<PathBuf>,
    /// Run tasks (not the worker or their shims) as this unprivileged user,
    /// with its groups. The worker must run as root.
    #[arg(long, env = "TENURE_RUN_AS", value_name = "USER")]
    run_as: Option<String>,
    /// A label of this worker, `KEY=VALUE` (repeat for more): tasks placed
    /// with `--on` run only on workers whose labels satisfy them.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Run tasks without control groups (by default, where the host has a
    /// writable cgroup v2 hierarchy, each attempt runs in its own: resource
    /// limits, and a kill or pause reaches processes that left the task's
    /// process group). Without them tasks with limits are refused here.
    #[arg(long, env = "TENURE_NO_CGROUPS")]
    no_cgroups: bool,
}

fn parse_key_limit(s: &str) -> Result<(String, u32), String> {
    let (k, n) = s.split_once('=').ok_or_else(|| format!("{s:?}: write KEY=N"))?;
    let n = n.trim().parse::<u32>().map_err(|e| format!("{s:?}: {e}"))?;
    Ok((k.trim().to_owned(), n))
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    tenure_protocol::placement::parse_label(s).map_err(|e| e.to_string())
}

/// `tenure sidecar`.
#[derive(Args, Debug)]
struct SidecarArgs {
    #[command(flatten)]
    config: config::ConfigArgs,
    /// The worker id of this machine.
    #[arg(long, env = "TENURE_WORKER_ID")]
    worker: Option<WorkerId>,
    /// The machine's data directory (shared with its worker).
    #[arg(long, env = "TENURE_DATA_DIR")]
    data_dir: Option<PathBuf>,
}

/// What a task is: the options `submit` and `run` share.
#[derive(Args, Debug)]
struct SubmitArgs {
    #[arg(long, default_value = "shell")]
    kind: Kind,
    /// The task may be run again if its worker is lost.
    #[arg(long)]
    idempotent: bool,
    #[arg(long)]
    label: Option<String>,
    /// Working directory on the worker machine (absolute).
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variable for the task, NAME=VALUE (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// For `--kind monitor`: every output line matching this regular
    /// expression raises a notification (`tenure watch`).
    #[arg(long)]
    pattern: Option<String>,
    /// A workflow step, run as a `shell` task after the previous one
    /// completed (repeatable, in order). Makes the task a `workflow`.
    #[arg(long = "step", value_name = "COMMAND", conflicts_with = "command")]
    steps: Vec<String>,
    /// Final-output-only: no streaming while it runs; once it ended, `tenure
    /// logs` prints its final output (the last 64 KiB), the same every time.
    #[arg(long)]
    final_output: bool,
    /// End the task if it runs longer than this (e.g. `90s`, `10m`, `2h`):
    /// SIGTERM to its group, the grace period, SIGKILL; it fails as
    /// `timed-out`. Measured on its machine, through worker restarts and
    /// failovers.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// End the task if it writes no output for this long; it fails as
    /// `idle-timeout`.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    idle_timeout: Option<std::time::Duration>,
    /// Run an idempotent task again, up to N times, after an attempt that
    /// failed for a cause `--retry-on` lists (at most 20; refused for a
    /// task that is not `--idempotent`). Each attempt shows in `tenure get`.
    #[arg(long, value_name = "N")]
    retries: Option<u32>,
    /// The delay before the first retry, and the most any retry waits:
    /// `BASE[,MAX]` (e.g. `2s,1m`; default `1s,5m`). Each retry doubles
    /// it, with jitter (a delay drawn from the upper half).
    #[arg(long, value_name = "BASE[,MAX]", value_parser = parse_backoff, requires = "retries")]
    backoff: Option<(std::time::Duration, Option<std::time::Duration>)>,
    /// Which failures are retried: `exit` (non-zero exit, signal),
    /// `lost` (its worker or machine lost), `timeout` (`--timeout`,
    /// `--idle-timeout`). Default: all three.
    #[arg(long, value_name = "CAUSES", value_delimiter = ',', requires = "retries")]
    retry_on: Vec<tenure_protocol::retry::RetryCause>,
    /// Do not start before TIME: RFC 3339 (`2030-01-01T09:00:00Z`) or a
    /// duration from now (`90s`, `2h`); at most 30 days away. Until then the
    /// task is `queued` and `tenure get` says when it may start.
    #[arg(long, value_name = "TIME", value_parser = parse_not_before)]
    not_before: Option<tenure_protocol::retry::NotBefore>,
    /// Dispatch priority, -100 to 100 (default 0): queued tasks start
    /// higher first, in submission order within one priority; a task
    /// queued longer than the coordinators' `--priority-max-age-ms` goes
    /// first whatever its priority.
    #[arg(long, value_name = "N", allow_negative_numbers = true, default_value_t = 0)]
    priority: i32,
    /// Run only on a worker whose labels satisfy this (repeatable, all must
    /// hold): `KEY=VALUE`, `KEY!=VALUE`, `'KEY in (A,B)'`, `'KEY notin
    /// (A,B)'`, `KEY` (set) or `!KEY` (not set). While no live worker does,
    /// the task is `blocked` (`no-matching-worker`), not refused.
    #[arg(long = "on", value_name = "CONSTRAINT")]
    on: Vec<String>,
    /// Count this task against KEY: at most the key's limit of its tasks
    /// run at once, cluster-wide; the others wait `blocked`
    /// (`concurrency-limit`).
    #[arg(long, value_name = "KEY")]
    concurrency_key: Option<String>,
    /// The limit for `--concurrency-key` (a limit configured for the key on
    /// the coordinators wins, and a different one is refused; without
    /// either, the limit already in force for the key).
    #[arg(long, value_name = "N", requires = "concurrency_key")]
    concurrency_limit: Option<u32>,
    /// Hold the task for approval: it stays `blocked` (`awaiting-approval`)
    /// until `tenure approve ID`; `tenure kill ID` ends it unrun.
    #[arg(long)]
    hold: bool,
    /// Memory limit of all the task's processes together (`64M`, `1.5G`,
    /// `512K`; binary units). Past it the kernel ends one of them and the
    /// task fails as `out-of-memory`. Only workers that enforce it run it.
    #[arg(long, value_name = "SIZE", value_parser = units::parse_size)]
    memory: Option<u64>,
    /// CPU limit in CPUs (`0.5`, `2`): the task is throttled to it.
    #[arg(long, value_name = "CPUS", value_parser = units::parse_cpus)]
    cpus: Option<u32>,
    /// Most processes and threads the task may have alive at once; a fork
    /// past it fails.
    #[arg(long, value_name = "N")]
    pids: Option<u32>,
    /// For `--kind agent`: when its machine loses it (its process proven
    /// gone: the machine restarted, or its worker saw the process end),
    /// run this instead of leaving it `unknown`, e.g. `'claude --resume
    /// {session}'`. `{NAME}` takes the latest value `--capture` found in
    /// its output (shell-quoted). Input sent meanwhile is kept for it.
    #[arg(long, value_name = "CMD")]
    resume_command: Option<String>,
    /// A regular expression matched against each output line of the task;
    /// its group captures a value for `--resume-command` (repeatable):
    /// `'session: (\S+)'` captures `session`, or name groups:
    /// `'(?<session>\S+) ready'`.
    #[arg(long = "capture", value_name = "REGEX", requires = "resume_command")]
    captures: Vec<String>,
    /// Resume on any worker (its session lives on shared storage); by
    /// default only on the machine that lost it, once it returns.
    #[arg(long, requires = "resume_command")]
    resume_anywhere: bool,
    /// The command line (one argument is run as is by `sh -c`; several are quoted and joined).
    #[arg(last = true)]
    command: Vec<String>,
}

/// The exit codes of `run` and `attach` (`client/foreground.rs`).
const FOREGROUND_EXIT_CODES: &str = "Exit codes: the task's own (0 completed, 1-255 failed with that code, \
128+N ended by signal N); 121 killed; 122 failed without an exit code (could not start, time limit, machine \
shutdown); 123 unknown (the recovery hint is printed); 130 detached by Ctrl-C, the task goes on.";

/// How `run` and `attach` hold a task in the foreground.
#[derive(Args, Debug, Clone, Copy)]
struct ForegroundArgs {
    /// Ctrl-C kills the task (with a reason saying so) instead of detaching
    /// from it; a second Ctrl-C detaches.
    #[arg(long)]
    kill_on_interrupt: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a coordinator (leader of the registry).
    Coordinator(CoordinatorArgs),
    /// Run a worker (needs its sidecar running on the same data dir).
    Worker(WorkerArgs),
    /// Internal: the process a worker starts to fork each attempt's shim.
    #[command(hide = true)]
    ShimLauncher {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Run a worker machine's sidecar (its recovery store).
    Sidecar(SidecarArgs),
    /// Serve the HTTP API, its OpenAPI document and the live task board
    /// (`token create|revoke|list` manage its bearer tokens).
    Gateway(gateway::GatewayArgs),
    /// Start a whole local cluster: nats-server, coordinators (one leads, the rest stand by), workers with sidecars.
    Dev {
        #[arg(long, default_value = ".tenure-dev")]
        data_dir: PathBuf,
        #[arg(long, default_value_t = 4222)]
        nats_port: u16,
        #[arg(long, default_value_t = 2)]
        workers: u32,
        #[arg(long, default_value_t = 4)]
        slots: u32,
        /// Coordinator processes `c1` … `cN`: one leads, the others stand by.
        #[arg(long, default_value_t = 1)]
        coordinators: u32,
        /// The gateway's port on 127.0.0.1 (HTTP API and task board); a
        /// free one is taken when it is in use. 0: no gateway.
        #[arg(long, default_value_t = 8080)]
        gateway_port: u16,
    },
    /// Write the NATS users and permissions of a cluster: `DIR/auth.conf` for
    /// nats-server (included by deploy/nats/*.conf) and `DIR/<user>.env` with
    /// each identity's credentials. Existing passwords are kept.
    NatsAuth {
        /// Where to write the files (created 0700).
        #[arg(long)]
        out: PathBuf,
        /// Coordinator names (users `coordinator-<name>`), comma-separated.
        #[arg(long, value_delimiter = ',')]
        coordinators: Vec<String>,
        /// Worker machine ids (users `worker-<id>` and `sidecar-<id>`), comma-separated.
        #[arg(long, value_delimiter = ',')]
        machines: Vec<WorkerId>,
        /// Users of the clients' account (people, CI, agent harnesses; operators
        /// too), comma-separated.
        #[arg(long, value_delimiter = ',')]
        users: Vec<String>,
        /// Route addresses (`host:port`) of every node of a NATS cluster: also
        /// write `routes.conf`, so that the nodes authenticate each other.
        #[arg(long, value_delimiter = ',')]
        routes: Vec<String>,
        /// Names and IP addresses clients reach the NATS servers by: also
        /// write a CA (`ca.pem`, kept on reruns), a server certificate for them
        /// and `tls.conf` to include, and point every credentials file at the CA.
        #[arg(long, value_delimiter = ',')]
        tls_hosts: Vec<String>,
    },
    /// Submit a task; prints its id. With `--batch`, many tasks: prints
    /// their ids in order, one per line.
    Submit {
        #[command(flatten)]
        task: SubmitArgs,
        /// Submit the tasks of FILE (`-`: stdin) instead: JSON Lines, one
        /// task per line in the HTTP API's submit body format, e.g.
        /// `{"command": "make test", "idempotent": true, "idempotency_key":
        /// "build-42"}`. Every line is checked before anything is sent; the
        /// leader takes each 1000 tasks all or none. A line's
        /// `idempotency_key` makes a re-run return its task, not a second.
        #[arg(long, value_name = "FILE", conflicts_with = "SubmitArgs")]
        batch: Option<std::path::PathBuf>,
    },
    /// Submit a task and run it in the foreground: stream its output, forward
    /// this terminal's stdin to an `agent` task, and exit with the task's exit
    /// code. Ctrl-C detaches (the task goes on; `tenure attach ID` comes back).
    #[command(after_help = FOREGROUND_EXIT_CODES)]
    Run {
        #[command(flatten)]
        submit: SubmitArgs,
        #[command(flatten)]
        foreground: ForegroundArgs,
    },
    /// Bring a task of yours to the foreground: its output from where you
    /// choose, then live; stdin forwarded to an `agent` task; exits with the
    /// task's exit code. Ctrl-C detaches again.
    #[command(after_help = FOREGROUND_EXIT_CODES)]
    Attach {
        task: TaskId,
        /// Start at this byte offset of the output (default: its beginning).
        #[arg(long = "from", value_name = "OFFSET", conflicts_with = "tail")]
        from: Option<u64>,
        /// Start at the output's current end: only what comes next.
        #[arg(long)]
        tail: bool,
        #[command(flatten)]
        foreground: ForegroundArgs,
    },
    /// Show one task.
    Get {
        task: TaskId,
        #[arg(long)]
        json: bool,
    },
    /// List your tasks (active and unreported by default).
    Ls {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Print a task's output from a byte offset.
    Logs {
        task: TaskId,
        /// Keep printing until the task ends.
        #[arg(long, short)]
        follow: bool,
        #[arg(long, default_value_t = 0)]
        offset: u64,
    },
    /// Wait for a task to end; exit 0 only if it completed with exit code 0.
    /// With `--started`, wait until it started instead.
    Wait {
        task: TaskId,
        /// Give up after this many seconds (exit 124, the task is left running).
        #[arg(long)]
        timeout: Option<u64>,
        /// Wait only until the task left the queue: exit 0 once it runs (or
        /// ran: it may have ended already), 1 when it left the queue without
        /// being seen running (it ended, is being stopped, or its outcome is
        /// unknown, before its start was reported).
        #[arg(long)]
        started: bool,
        #[arg(long)]
        json: bool,
    },
    /// Ask to stop a task (SIGTERM to its process group, SIGKILL after the grace period).
    Kill {
        task: TaskId,
        /// Why, kept verbatim on the task and shown by `get` (the first
        /// kill's reason stays; at most 1 KiB).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Hold a running task stopped: SIGSTOP to its whole process group,
    /// recorded as `paused`; it stays paused through worker restarts and
    /// failovers, can be killed, and its --timeout keeps counting.
    Pause { task: TaskId },
    /// Let a paused task go on (SIGCONT to its process group).
    Resume { task: TaskId },
    /// Let a task held for approval (`submit --hold`, or the coordinators'
    /// approval policy) start: it is queued. Its owner may, or an operator;
    /// under `approval.approver = "operator"` only an operator may approve
    /// what the policy held.
    Approve { task: TaskId },
    /// Send one message to the stdin of a running agent task: the TEXT words
    /// joined by spaces, or all of stdin when no TEXT is given.
    Send {
        task: TaskId,
        /// The message (use `--` before text that starts with `-`).
        text: Vec<String>,
        /// Send the bytes as they are; by default a newline is added when the
        /// message does not end with one.
        #[arg(long)]
        raw: bool,
    },
    /// Serve the task contract as MCP tools on stdin/stdout, for an agent
    /// that launches it (start, list, get, read output, send, stop, wait,
    /// archive). Each ended task and matched monitor line reaches the agent
    /// once: as a log message when the client asks for them at `notice`,
    /// otherwise in the `unreported` and `matched` lists of the next result.
    Mcp,
    /// Show notices of your tasks that ended and were not reported elsewhere,
    /// each once; resumes where the last watch of the session stopped.
    Watch {
        /// Exit once every pending notice is shown instead of following.
        #[arg(long)]
        once: bool,
        #[arg(long)]
        json: bool,
    },
    /// Archive a finished task: hidden from `ls` (shown with `--all`); its files
    /// on the worker machine are released by a durable cleanup job.
    Archive { task: TaskId },
    /// Bring an archived task back to the board (cancels a cleanup not yet done).
    Unarchive { task: TaskId },
    /// Delete a finished task: hidden for good, its record kept for audit; its
    /// files are released like an archive's.
    Delete { task: TaskId },
    /// Cluster view: leader, epoch and lease, standbys, workers (slots, running
    /// tasks, heartbeat ages, sidecar health), tasks by status, your running
    /// tasks and the NATS connection. Refreshes every second on a terminal.
    Status {
        /// One JSON document (for scripts).
        #[arg(long)]
        json: bool,
        /// Print one view and exit (the default when not on a terminal).
        #[arg(long)]
        once: bool,
    },
}

fn session(arg: Option<String>) -> anyhow::Result<SessionId> {
    let raw = arg.unwrap_or_else(|| {
        let user = std::env::var("USER").unwrap_or_else(|_| nix::unistd::getuid().to_string());
        format!("user-{user}")
    });
    Ok(raw.parse()?)
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// `--backoff BASE[,MAX]`: one or two humantime durations.
fn parse_backoff(s: &str) -> Result<(std::time::Duration, Option<std::time::Duration>), String> {
    let (base, max) = match s.split_once(',') {
        Some((b, m)) => (b, Some(m)),
        None => (s, None),
    };
    let parse = |d: &str| humantime::parse_duration(d.trim()).map_err(|e| format!("{d:?}: {e}"));
    Ok((parse(base)?, max.map(parse).transpose()?))
}

/// `--not-before TIME`: an RFC 3339 time, or a humantime duration from now.
fn parse_not_before(s: &str) -> Result<tenure_protocol::retry::NotBefore, String> {
    use tenure_protocol::retry::NotBefore;
    if let Ok(t) = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
        let ms = u64::try_from(t.unix_timestamp_nanos() / 1_000_000).map_err(|_| format!("{s:?} is before 1970"))?;
        return Ok(NotBefore::At { unix_ms: ms });
    }
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is neither an RFC 3339 time (2030-01-01T09:00:00Z) nor a duration ({e})"))?;
    let ms = u64::try_from(d.as_millis()).map_err(|_| format!("{s:?} is too far away"))?;
    Ok(NotBefore::In { ms })
}

fn main() -> ExitCode {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if !matches!(
        cli.command,
        Command::Coordinator(_)
            | Command::Worker(_)
            | Command::Sidecar(_)
            | Command::Gateway(_)
            | Command::Dev { .. }
            | Command::ShimLauncher { .. }
            | Command::NatsAuth { .. }
    ) {
        // A client verb piped into `head` ends quietly on a closed pipe, as
        // command-line tools do, instead of panicking in `println!`.
        // SAFETY: restoring the default disposition before any thread starts.
        let _ = unsafe {
            nix::sys::signal::signal(nix::sys::signal::Signal::SIGPIPE, nix::sys::signal::SigHandler::SigDfl)
        };
    }
    // The launcher forks shims: it must stay single-threaded, so it runs
    // before (and instead of) this process's multi-threaded runtime.
    // Its shims log to the worker's stderr, which may be gone: SIGPIPE stays
    // ignored there (above), and a failed log write is dropped.
    if let Command::ShimLauncher { data_dir } = &cli.command {
        return shim_launcher::run(data_dir);
    }
    let (role, daemon) = match cli.command {
        Command::Coordinator(_) => ("coordinator", true),
        Command::Worker(_) => ("worker", true),
        Command::Sidecar(_) => ("sidecar", true),
        Command::Gateway(ref g) => ("gateway", g.action.is_none()),
        Command::Dev { .. } => ("dev", true),
        _ => ("cli", false),
    };
    let _telemetry = match telemetry::init(role, daemon) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    // A daemon is one event loop: on a thread of its own it takes its
    // messages without a hand-off between threads (measured: about a third
    // less CPU per task on 2 cores; see docs/benchmarks.md).
    let scheduler = cli.runtime.unwrap_or(match cli.command {
        Command::Coordinator(_) | Command::Worker(_) | Command::Sidecar(_) => Scheduler::OneThread,
        _ => Scheduler::Threads,
    });
    let built = match scheduler {
        Scheduler::OneThread => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        Scheduler::Threads => tokio::runtime::Builder::new_multi_thread().enable_all().build(),
    };
    let runtime = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli, &matches, role)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli, matches: &clap::ArgMatches, role: &str) -> anyhow::Result<ExitCode> {
    let sub = matches.subcommand().map(|(_, m)| m).unwrap_or(matches);
    // A daemon's value was given when its flag or variable was, wherever clap
    // recorded the (global) argument.
    let given_global = |id: &str| config::given(matches, id) || config::given(sub, id);
    let shared = SharedFlags { metrics_addr: cli.metrics_addr, nats: cli.nats.unvalidated()? };
    let printed = || Ok(ExitCode::SUCCESS);
    match cli.command {
        Command::Coordinator(args) => {
            let overrides = |cfg: &mut config::CoordinatorConfig| {
                override_given!(sub, cfg, args, name, worker_ttl_ms, replicas, lease_ttl_ms, renew_interval_ms);
                override_given!(sub, cfg, args, renew_deadline_ms, operators, retention_secs);
                override_given!(sub, cfg, args, max_live_tasks, max_kept_tasks, max_output_bytes, registry_max_bytes);
                override_given!(sub, cfg, args, notices_max_bytes, notices_max_consumers, registry_duplicate_window_ms);
                override_given!(sub, cfg, args, accept_registry_rollback, priority_max_age_ms);
                if config::given(sub, "concurrency_limits") {
                    cfg.concurrency_limits = args.concurrency_limits.iter().cloned().collect();
                }
                if config::given(sub, "approve_kinds") {
                    cfg.approval.kinds = args.approve_kinds.clone();
                }
                if config::given(sub, "approve_commands") {
                    cfg.approval.commands = args.approve_commands.clone();
                }
                if let Some(approver) = args.approver {
                    cfg.approval.approver = approver;
                }
            };
            let Some(cfg) = config::resolve(&args.config, &given_global, shared, overrides)? else { return printed() };
            let _metrics = metrics::start(role, cfg.metrics_addr).await?;
            let leadership = tenure_coordinator::LeadershipConfig {
                ttl: Duration::from_millis(cfg.lease_ttl_ms),
                renew_interval: Duration::from_millis(cfg.renew_interval_ms),
                renew_deadline: Duration::from_millis(cfg.renew_deadline_ms),
            };
            let mut opts = tenure_coordinator::Options {
                notices: cfg.notice_limits(),
                nats: cfg.nats.clone(),
                name: cfg.name.clone(),
                replicas: cfg.replicas,
                leadership,
                registry_duplicate_window: Duration::from_millis(cfg.registry_duplicate_window_ms),
                accept_registry_rollback: cfg.accept_registry_rollback,
                ..Default::default()
            };
            opts.core.limits = cfg.limits();
            opts.core.worker_ttl = Duration::from_millis(cfg.worker_ttl_ms);
            opts.core.priority_max_age = Duration::from_millis(cfg.priority_max_age_ms);
            opts.core.operators = cfg.operators;
            opts.core.concurrency_limits = cfg.concurrency_limits;
            opts.core.approval = cfg.approval.policy()?;
            opts.core.retention = (cfg.retention_secs > 0).then(|| Duration::from_secs(cfg.retention_secs));
            tenure_coordinator::run(opts, shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Worker(args) => {
            let overrides = |cfg: &mut config::WorkerConfig| {
                override_given!(sub, cfg, args, id, slots, data_dir, kill_grace_ms, heartbeat_ms, output_cap);
                override_given!(sub, cfg, args, kill_tasks_on_exit, kinds, scratch_dir, run_as, no_cgroups);
                override_given!(sub, cfg, args, started_hold_ms);
                if config::given(sub, "labels") {
                    cfg.labels = args.labels.iter().cloned().collect();
                }
            };
            let Some(cfg) = config::resolve(&args.config, &given_global, shared, overrides)? else { return printed() };
            let _metrics = metrics::start(role, cfg.metrics_addr).await?;
            let (Some(id), Some(data_dir)) = (cfg.id, cfg.data_dir) else { unreachable!("validated") };
            let mut opts = tenure_worker::Options::new(cfg.nats, id, data_dir);
            opts.kinds = cfg.kinds.into_iter().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            opts.slots = cfg.slots;
            opts.kill_grace = Duration::from_millis(cfg.kill_grace_ms);
            opts.started_hold = Duration::from_millis(cfg.started_hold_ms);
            opts.heartbeat = Duration::from_millis(cfg.heartbeat_ms);
            opts.output_cap = cfg.output_cap;
            opts.kill_tasks_on_exit = cfg.kill_tasks_on_exit;
            opts.scratch_dir = cfg.scratch_dir;
            opts.labels = cfg.labels;
            opts.run_as = cfg.run_as.as_deref().map(tenure_worker::sandbox::RunAs::resolve).transpose()?;
            opts.cgroups = !cfg.no_cgroups;
            opts.shim_program = std::env::current_exe()?;
            tenure_worker::run(opts, shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Sidecar(args) => {
            let overrides = |cfg: &mut config::SidecarConfig| override_given!(sub, cfg, args, worker, data_dir);
            let Some(cfg) = config::resolve(&args.config, &given_global, shared, overrides)? else { return printed() };
            let _metrics = metrics::start(role, cfg.metrics_addr).await?;
            let (Some(worker), Some(data_dir)) = (cfg.worker, cfg.data_dir) else { unreachable!("validated") };
            let opts =
                tenure_sidecar::Options { layout: tenure_machine::Layout::new(data_dir), worker, nats: cfg.nats };
            tenure_sidecar::run(opts, shutdown_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Gateway(args) => {
            let caller_creds = gateway::creds_on_command_line(matches);
            gateway::run(args, caller_creds, sub, &given_global, shared, shutdown_signal()).await
        }
        Command::NatsAuth { out, coordinators, machines, users, routes, tls_hosts } => {
            let plan = nats_auth::Plan { coordinators, machines, users, routes, tls_hosts };
            let identities = nats_auth::write(&out, &plan)?;
            println!("wrote {}", out.join(nats_auth::AUTH_FILE).display());
            for id in identities {
                println!("  {:<12} {:<24} {}", id.role.name(), id.user, id.env_file(&out).display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Dev { data_dir, nats_port, workers, slots, coordinators, gateway_port } => {
            let opts = dev::DevOptions { data_dir, nats_port, workers, slots, coordinators, gateway_port };
            dev::run(opts, shutdown_signal()).await
        }
        verb => {
            shared.nats.validate()?;
            let nats = shared.nats;
            let session = session(cli.session)?;
            client::run(&nats, session, verb).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every subcommand's flags are consistent (no long name used twice, as a
    /// subcommand's own flag against a global one), checked for the whole tree.
    #[test]
    fn the_command_line_is_consistent() {
        <Cli as clap::CommandFactory>::command().debug_assert();
        let caller = |args: &[&str]| {
            let m = <Cli as clap::CommandFactory>::command().try_get_matches_from(args).unwrap();
            gateway::creds_on_command_line(&m)
        };
        let create = ["tenure", "gateway", "--tokens", "t.json", "token", "create", "--identity", "alice"];
        assert_eq!(caller(&create), None);
        let with = [&create[..], &["--nats-creds", "/c/alice.env"]].concat();
        assert_eq!(caller(&with), Some(PathBuf::from("/c/alice.env")));
    }

    /// The flags' defaults are the libraries' (through the config defaults),
    /// and those are what the daemons have always defaulted to.
    #[test]
    fn flags_default_to_the_libraries_defaults() {
        let Command::Coordinator(c) = Cli::try_parse_from(["tenure", "coordinator"]).unwrap().command else {
            panic!("not a coordinator")
        };
        let d = config::CoordinatorConfig::default();
        let flags = (c.name, c.worker_ttl_ms, c.replicas, c.lease_ttl_ms, c.renew_interval_ms, c.renew_deadline_ms);
        assert_eq!(
            flags,
            (d.name, d.worker_ttl_ms, d.replicas, d.lease_ttl_ms, d.renew_interval_ms, d.renew_deadline_ms)
        );
        assert_eq!((flags.1, flags.3, flags.4, flags.5), (6000, 6000, 2000, 4000));
        let limits = (c.retention_secs, c.max_live_tasks, c.max_kept_tasks, c.max_output_bytes, c.registry_max_bytes);
        assert_eq!(
            limits,
            (d.retention_secs, d.max_live_tasks, d.max_kept_tasks, d.max_output_bytes, d.registry_max_bytes)
        );
        assert_eq!(c.retention_secs, 7 * 24 * 3600);
        let notices = (c.registry_duplicate_window_ms, c.notices_max_bytes, c.notices_max_consumers);
        assert_eq!(notices, (d.registry_duplicate_window_ms, d.notices_max_bytes, d.notices_max_consumers));
        assert_eq!(notices, (120_000, 256 << 20, 4096));
        assert_eq!(c.accept_registry_rollback, d.accept_registry_rollback);
        assert_eq!((c.priority_max_age_ms, d.priority_max_age_ms), (600_000, 600_000));

        let Command::Worker(w) = Cli::try_parse_from(["tenure", "worker"]).unwrap().command else {
            panic!("not a worker")
        };
        let d = config::WorkerConfig::default();
        let flags = (w.slots, w.kill_grace_ms, w.heartbeat_ms, w.output_cap, w.kill_tasks_on_exit, w.kinds);
        assert_eq!(flags, (d.slots, d.kill_grace_ms, d.heartbeat_ms, d.output_cap, d.kill_tasks_on_exit, d.kinds));
        assert_eq!((flags.0, flags.1, flags.2), (4, 5000, 1000));
        assert_eq!((w.started_hold_ms, d.started_hold_ms), (20, 20));
        assert_eq!(config::WORKER_KINDS_DEFAULT.as_str(), "shell,agent,monitor,noop,sleep");
        assert_eq!((w.no_cgroups, d.no_cgroups), (false, false), "cgroups are used where the host allows");
    }
}
