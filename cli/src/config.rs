//! The daemons' configuration: a TOML file (`--config FILE`), overridden by
//! environment variables (`TENURE_*`), overridden by command-line flags; with
//! `--print-config` the effective result is printed (secrets masked) and the
//! daemon does not start.
//!
//! Every file is read into a struct with `deny_unknown_fields`, so a misspelt
//! key fails at start naming it; then [`Validate`] checks what no type can
//! (a renew deadline below the lease TTL, a worker with slots, …). A daemon
//! never starts on a configuration it would have to guess about.
//!
//! Precedence is decided from where clap found each value: a flag or variable
//! that was given wins over the file; a clap default never does.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::parser::ValueSource;
use clap::ArgMatches;
use serde::{Deserialize, Serialize};
use tenure_coordinator::limits::Limits;
use tenure_coordinator::notices::NoticeLimits;
use tenure_protocol::{Kind, SessionId, WorkerId};
use tenure_transport::{NatsOptions, Secret};

/// What a daemon's flags share: where its file is, and whether to print the
/// effective configuration instead of running.
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// A TOML configuration file (flags and TENURE_* variables override it).
    #[arg(long, env = "TENURE_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (file, then environment, then flags;
    /// secrets masked) and exit without starting.
    #[arg(long)]
    pub print_config: bool,
}

/// `tenure coordinator`'s configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// Name in the leader lease, the epoch claims and the standby presence.
    pub name: String,
    /// A worker silent for this long is judged lost.
    pub worker_ttl_ms: u64,
    /// JetStream replicas of the registry, the notice stream and the lease
    /// bucket (3 on a 3-node NATS cluster; applied when they are created).
    pub replicas: usize,
    /// A standby takes over once the lease has not changed for this long.
    pub lease_ttl_ms: u64,
    /// The leader renews its lease this often.
    pub renew_interval_ms: u64,
    /// The leader stops acting when no renewal succeeded for this long.
    pub renew_deadline_ms: u64,
    /// Identities (authenticated NATS users) with the operator role.
    pub operators: Vec<String>,
    /// Finished tasks are garbage-collected this long after they ended; 0 keeps them.
    pub retention_secs: u64,
    /// A task queued (and free to start) this long goes before every task
    /// queued later, whatever their priorities (no starvation).
    pub priority_max_age_ms: u64,
    /// Live (not finished) tasks one identity may hold; 0 is unlimited.
    pub max_live_tasks: u64,
    /// Tasks one identity may keep in the registry, finished ones until they
    /// are garbage-collected; 0 is unlimited.
    pub max_kept_tasks: u64,
    /// Final-output bytes one identity may keep in the registry (64 KiB
    /// reserved per live final-output task, the recorded size once ended);
    /// 0 is unlimited.
    pub max_output_bytes: u64,
    /// Bytes the registry stream may hold. New tasks are refused well before
    /// it is full, so that running ones can always record their ends.
    pub registry_max_bytes: u64,
    /// How long JetStream remembers the registry's message ids (its
    /// `duplicate_window`); a retried append is recognised within it.
    pub registry_duplicate_window_ms: u64,
    /// Lead a registry found behind its high-water mark (it lost writes or
    /// was restored from an older backup), once an operator judged the loss.
    /// Recorded with the epoch claim. Remove it again once the cluster leads.
    pub accept_registry_rollback: bool,
    /// Bytes of notices kept (the oldest are dropped past it).
    pub notices_max_bytes: u64,
    /// Consumers (watching sessions) the notice stream allows.
    pub notices_max_consumers: u32,
    /// Concurrency limits by key (`[concurrency_limits]`, `llm = 3`): they
    /// win over the limits tasks are submitted with.
    pub concurrency_limits: std::collections::BTreeMap<String, u32>,
    /// Which tasks wait for approval at submit, and who may approve them.
    pub approval: ApprovalConfig,
    /// Serve Prometheus metrics at `http://ADDR/metrics`.
    pub metrics_addr: Option<SocketAddr>,
    pub nats: NatsOptions,
}

/// `[approval]`: the coordinators' approval policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApprovalConfig {
    /// Tasks of these kinds that are not idempotent are held `blocked`
    /// until approved.
    pub kinds: Vec<Kind>,
    /// Tasks whose command (or a workflow step's) matches one of these
    /// regular expressions are held until approved.
    pub commands: Vec<String>,
    /// Who may approve a task the policy held.
    pub approver: ApproverConfig,
}

/// Who may approve a task the approval policy held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ApproverConfig {
    /// Its owner, or an operator.
    #[default]
    Owner,
    /// Only an operator.
    Operator,
}

impl ApprovalConfig {
    /// The policy as the core takes it (the patterns compiled).
    pub fn policy(&self) -> anyhow::Result<tenure_coordinator::ApprovalPolicy> {
        let commands = self
            .commands
            .iter()
            .map(|p| regex::Regex::new(p).with_context(|| format!("approval.commands: {p:?}")))
            .collect::<anyhow::Result<_>>()?;
        let approver = match self.approver {
            ApproverConfig::Owner => tenure_coordinator::Approver::Owner,
            ApproverConfig::Operator => tenure_coordinator::Approver::Operator,
        };
        Ok(tenure_coordinator::ApprovalPolicy { kinds: self.kinds.clone(), commands, approver })
    }
}

/// Whole milliseconds of `d`.
fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// The defaults are the library's (`tenure_coordinator::Options`),
/// declared there once; the flags (`--help`) and the file read them from here.
impl Default for CoordinatorConfig {
    fn default() -> Self {
        let o = tenure_coordinator::Options::default();
        CoordinatorConfig {
            name: o.name,
            worker_ttl_ms: ms(o.core.worker_ttl),
            replicas: o.replicas,
            lease_ttl_ms: ms(o.leadership.ttl),
            renew_interval_ms: ms(o.leadership.renew_interval),
            renew_deadline_ms: ms(o.leadership.renew_deadline),
            operators: o.core.operators,
            retention_secs: o.core.retention.map(|d| d.as_secs()).unwrap_or(0),
            priority_max_age_ms: ms(o.core.priority_max_age),
            max_live_tasks: o.core.limits.live_tasks.unwrap_or(0),
            max_kept_tasks: o.core.limits.kept_tasks.unwrap_or(0),
            max_output_bytes: o.core.limits.output_bytes.unwrap_or(0),
            registry_max_bytes: o.core.limits.registry_bytes,
            registry_duplicate_window_ms: ms(o.registry_duplicate_window),
            accept_registry_rollback: o.accept_registry_rollback,
            notices_max_bytes: o.notices.max_bytes,
            notices_max_consumers: o.notices.max_consumers,
            concurrency_limits: o.core.concurrency_limits,
            approval: ApprovalConfig::default(),
            metrics_addr: None,
            nats: o.nats,
        }
    }
}

impl CoordinatorConfig {
    /// The quotas and registry limit as the core takes them (0 is unlimited).
    pub fn limits(&self) -> Limits {
        let limit = |v: u64| (v > 0).then_some(v);
        Limits {
            live_tasks: limit(self.max_live_tasks),
            kept_tasks: limit(self.max_kept_tasks),
            output_bytes: limit(self.max_output_bytes),
            registry_bytes: self.registry_max_bytes,
            ..Limits::default()
        }
    }

    pub fn notice_limits(&self) -> NoticeLimits {
        NoticeLimits { max_bytes: self.notices_max_bytes, max_consumers: self.notices_max_consumers }
    }
}

/// Least registry byte limit accepted: room for a few thousand tasks.
const MIN_REGISTRY_BYTES: u64 = 64 << 20;
/// Least notice stream byte limit accepted.
const MIN_NOTICES_BYTES: u64 = 1 << 20;

/// `tenure worker`'s configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// This machine's worker id (required).
    pub id: Option<WorkerId>,
    /// Attempts run at once.
    pub slots: u32,
    /// The machine's data directory, shared with its sidecar (required).
    pub data_dir: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when a task is ended.
    pub kill_grace_ms: u64,
    /// How long a `Started` report waits for its attempt's end on a worker
    /// starting attempts closer together than this (0: never).
    pub started_hold_ms: u64,
    pub heartbeat_ms: u64,
    /// Output bytes kept per task; past it bytes are dropped and counted.
    pub output_cap: u64,
    /// End running tasks when the worker stops (off: they outlive it).
    pub kill_tasks_on_exit: bool,
    /// Kinds this worker runs and advertises.
    pub kinds: Vec<Kind>,
    /// Where each attempt's scratch directory is made (default: the data
    /// directory's sibling `<data_dir>.scratch`; never inside it).
    pub scratch_dir: Option<PathBuf>,
    /// Run tasks as this unprivileged user (the worker must run as root).
    pub run_as: Option<String>,
    /// Labels tasks' placement constraints are matched against
    /// (`[labels]`, `gpu = "a100"`).
    pub labels: tenure_protocol::placement::Labels,
    /// Run tasks without control groups: no resource limits, processes
    /// that leave a task's process group not tracked.
    pub no_cgroups: bool,
    pub metrics_addr: Option<SocketAddr>,
    pub nats: NatsOptions,
}

/// The defaults are the library's (`tenure_worker::Options::new`),
/// declared there once; the flags (`--help`) and the file read them from here.
impl Default for WorkerConfig {
    fn default() -> Self {
        let o = tenure_worker::Options::new(NatsOptions::default(), placeholder_worker(), PathBuf::new());
        WorkerConfig {
            id: None,
            slots: o.slots,
            data_dir: None,
            kill_grace_ms: ms(o.kill_grace),
            started_hold_ms: ms(o.started_hold),
            heartbeat_ms: ms(o.heartbeat),
            output_cap: o.output_cap,
            kill_tasks_on_exit: o.kill_tasks_on_exit,
            kinds: o.kinds,
            scratch_dir: o.scratch_dir,
            // The library holds the resolved user (`RunAs`), none by default.
            run_as: None,
            labels: o.labels,
            no_cgroups: !o.cgroups,
            metrics_addr: None,
            nats: o.nats,
        }
    }
}

/// A worker id only to read the library's defaults with (the id has none).
fn placeholder_worker() -> WorkerId {
    "w".parse().unwrap_or_else(|_| unreachable!("`w` is a valid worker id"))
}

/// The coordinator's defaults, read once for the flags' help.
pub static COORDINATOR_DEFAULTS: std::sync::LazyLock<CoordinatorConfig> =
    std::sync::LazyLock::new(CoordinatorConfig::default);

/// The worker's default kinds as the `--kinds` flag spells them (`a,b,c`).
pub static WORKER_KINDS_DEFAULT: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| WORKER_DEFAULTS.kinds.iter().map(ToString::to_string).collect::<Vec<_>>().join(","));

/// The worker's defaults, read once for the flags' help.
pub static WORKER_DEFAULTS: std::sync::LazyLock<WorkerConfig> = std::sync::LazyLock::new(WorkerConfig::default);

/// `tenure sidecar`'s configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SidecarConfig {
    /// The worker id of this machine (required).
    pub worker: Option<WorkerId>,
    /// The machine's data directory, shared with its worker (required).
    pub data_dir: Option<PathBuf>,
    pub metrics_addr: Option<SocketAddr>,
    pub nats: NatsOptions,
}

/// The checks no type can make; the message names the key.
pub trait Validate {
    fn validate(&self) -> anyhow::Result<()>;
}

/// A daemon's configuration: what every daemon shares.
pub trait DaemonConfig: Validate + Serialize + Clone + Default + for<'de> Deserialize<'de> {
    fn shared(&mut self) -> (&mut Option<SocketAddr>, &mut NatsOptions);
}

impl DaemonConfig for CoordinatorConfig {
    fn shared(&mut self) -> (&mut Option<SocketAddr>, &mut NatsOptions) {
        (&mut self.metrics_addr, &mut self.nats)
    }
}

impl DaemonConfig for WorkerConfig {
    fn shared(&mut self) -> (&mut Option<SocketAddr>, &mut NatsOptions) {
        (&mut self.metrics_addr, &mut self.nats)
    }
}

impl DaemonConfig for SidecarConfig {
    fn shared(&mut self) -> (&mut Option<SocketAddr>, &mut NatsOptions) {
        (&mut self.metrics_addr, &mut self.nats)
    }
}

/// The flags every daemon shares, as given on the command line.
pub struct SharedFlags {
    pub metrics_addr: Option<SocketAddr>,
    pub nats: NatsOptions,
}

/// A daemon's effective configuration: its file (or the defaults), then the
/// given flags and variables (`overrides` for the daemon's own, `shared` for
/// the rest), validated. `None` when `--print-config` printed it instead.
pub fn resolve<C: DaemonConfig>(
    args: &ConfigArgs,
    given: &dyn Fn(&str) -> bool,
    shared: SharedFlags,
    overrides: impl FnOnce(&mut C),
) -> anyhow::Result<Option<C>> {
    let invalid = |e: anyhow::Error| anyhow::anyhow!("invalid configuration: {e:#}");
    let mut cfg: C = load(args.config.as_deref()).map_err(invalid)?;
    overrides(&mut cfg);
    let (metrics_addr, nats) = cfg.shared();
    if given("metrics_addr") {
        *metrics_addr = shared.metrics_addr;
    }
    override_nats(given, nats, shared.nats);
    cfg.validate().map_err(invalid)?;
    if args.print_config {
        print!("{}", print(&cfg)?);
        return Ok(None);
    }
    Ok(Some(cfg))
}

/// `Some` or the error saying how to give `key`.
fn required<T>(value: &Option<T>, key: &str, flag: &str, env: &str) -> anyhow::Result<()> {
    match value {
        Some(_) => Ok(()),
        None => bail!("{key} is required ({flag}, {env} or `{key}` in the file)"),
    }
}

impl Validate for CoordinatorConfig {
    fn validate(&self) -> anyhow::Result<()> {
        if self.name.trim().is_empty() {
            bail!("name must not be empty");
        }
        if self.worker_ttl_ms == 0 || self.lease_ttl_ms == 0 || self.renew_interval_ms == 0 {
            bail!("worker_ttl_ms, lease_ttl_ms and renew_interval_ms must be above 0");
        }
        if self.priority_max_age_ms == 0 {
            bail!("priority_max_age_ms must be above 0");
        }
        if self.renew_deadline_ms >= self.lease_ttl_ms {
            bail!(
                "renew_deadline_ms ({}) must be below lease_ttl_ms ({}): the leader must stop acting before a standby can judge its lease expired",
                self.renew_deadline_ms,
                self.lease_ttl_ms
            );
        }
        if self.renew_interval_ms >= self.renew_deadline_ms {
            bail!(
                "renew_interval_ms ({}) must be below renew_deadline_ms ({}): a leader must get to renew before it has to step down",
                self.renew_interval_ms,
                self.renew_deadline_ms
            );
        }
        if !(1..=5).contains(&self.replicas) {
            bail!("replicas ({}) must be 1 to 5", self.replicas);
        }
        for name in &self.operators {
            let label: SessionId = "x".parse()?;
            SessionId::scoped(name, &label).with_context(|| format!("operators: {name:?}"))?;
        }
        for (key, limit) in &self.concurrency_limits {
            let c = tenure_protocol::placement::Concurrency { key: key.clone(), limit: Some(*limit) };
            let placement = tenure_protocol::placement::Placement { on: Vec::new(), concurrency: Some(c) };
            placement.check().with_context(|| format!("concurrency_limits: {key:?}"))?;
        }
        self.approval.policy()?;
        let holds = !self.approval.kinds.is_empty() || !self.approval.commands.is_empty();
        if holds && self.approval.approver == ApproverConfig::Operator && self.operators.is_empty() {
            bail!(
                "approval.approver is \"operator\" but no operators are configured: nobody could approve what the \
                 policy holds; name them with `operators` (--operator)"
            );
        }
        if self.approval.kinds.contains(&Kind::workflow()) {
            bail!("approval.kinds: a workflow is held by its steps' commands (approval.commands), not by its kind");
        }
        if self.registry_max_bytes < MIN_REGISTRY_BYTES {
            bail!("registry_max_bytes ({}) must be at least {MIN_REGISTRY_BYTES} (64 MiB)", self.registry_max_bytes);
        }
        if self.notices_max_bytes < MIN_NOTICES_BYTES {
            bail!("notices_max_bytes ({}) must be at least {MIN_NOTICES_BYTES} (1 MiB)", self.notices_max_bytes);
        }
        if self.notices_max_consumers == 0 {
            bail!("notices_max_consumers must be at least 1");
        }
        if self.registry_duplicate_window_ms < 100 {
            bail!("registry_duplicate_window_ms ({}) must be at least 100", self.registry_duplicate_window_ms);
        }
        self.nats.validate().context("nats")
    }
}

impl Validate for WorkerConfig {
    fn validate(&self) -> anyhow::Result<()> {
        required(&self.id, "id", "--id", "TENURE_WORKER_ID")?;
        required(&self.data_dir, "data_dir", "--data-dir", "TENURE_DATA_DIR")?;
        if self.slots == 0 {
            bail!("slots must be at least 1");
        }
        if self.heartbeat_ms < 50 {
            bail!("heartbeat_ms ({}) must be at least 50", self.heartbeat_ms);
        }
        let most = ms(tenure_worker::reports::MAX_STARTED_HOLD);
        if self.started_hold_ms > most {
            bail!("started_hold_ms ({}) must be at most {most}", self.started_hold_ms);
        }
        if self.output_cap == 0 {
            bail!("output_cap must be above 0");
        }
        if self.kinds.is_empty() {
            bail!("kinds must name at least one kind");
        }
        if self.kinds.contains(&Kind::workflow()) {
            bail!("kinds: `workflow` is run by the coordinator, not by workers");
        }
        if let Some(user) = &self.run_as {
            tenure_worker::sandbox::RunAs::resolve(user).context("run_as")?;
        }
        tenure_protocol::placement::check_labels(&self.labels).context("labels")?;
        if let (Some(scratch), Some(data)) = (&self.scratch_dir, &self.data_dir) {
            if scratch.starts_with(data) || data.starts_with(scratch) {
                bail!(
                    "scratch_dir ({}) and data_dir ({}) must not contain one another: tasks never run in the data directory",
                    scratch.display(),
                    data.display()
                );
            }
        }
        self.nats.validate().context("nats")
    }
}

impl Validate for SidecarConfig {
    fn validate(&self) -> anyhow::Result<()> {
        required(&self.worker, "worker", "--worker", "TENURE_WORKER_ID")?;
        required(&self.data_dir, "data_dir", "--data-dir", "TENURE_DATA_DIR")?;
        self.nats.validate().context("nats")
    }
}

/// Reads `path` (or the defaults without one). Unknown keys and bad values
/// are refused with the file, the key and the position.
pub fn load<T: for<'de> Deserialize<'de> + Default>(path: Option<&Path>) -> anyhow::Result<T> {
    let Some(path) = path else { return Ok(T::default()) };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Was this argument given (flag or environment), rather than defaulted?
pub fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(m.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable))
}

/// Overrides `cfg.field` with `args.field` for each field that was given.
#[macro_export]
macro_rules! override_given {
    ($m:expr, $cfg:expr, $args:expr, $($field:ident),+ $(,)?) => {
        { $( if $crate::config::given($m, stringify!($field)) { $cfg.$field = $args.$field.clone().into(); } )+ }
    };
}

/// The NATS flags and variables that were given override the file's `[nats]`.
pub fn override_nats(given: &dyn Fn(&str) -> bool, file: &mut NatsOptions, flags: NatsOptions) {
    if given("servers") {
        file.servers = flags.servers;
    }
    if given("user") {
        file.user = flags.user;
    }
    if given("password") {
        file.password = flags.password;
    }
    if flags.token.is_some() {
        file.token = flags.token;
    }
    if given("nkey") {
        file.nkey = flags.nkey;
    }
    if given("creds") {
        file.creds = flags.creds;
    }
    if given("tls_ca") {
        file.tls_ca = flags.tls_ca;
    }
    if given("tls_cert") {
        file.tls_cert = flags.tls_cert;
    }
    if given("tls_key") {
        file.tls_key = flags.tls_key;
    }
    if given("tls_required") {
        file.tls_required = flags.tls_required;
    }
}

/// The effective configuration as TOML, with passwords and tokens masked.
pub fn print<C: DaemonConfig>(cfg: &C) -> anyhow::Result<String> {
    let mut shown = cfg.clone();
    let (_, n) = shown.shared();
    for secret in [&mut n.password, &mut n.token] {
        if secret.is_some() {
            *secret = Some(Secret::new("***".to_owned()));
        }
    }
    toml::to_string(&shown).context("the configuration cannot be shown as TOML")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse<T: for<'de> Deserialize<'de>>(text: &str) -> Result<T, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = parse::<CoordinatorConfig>("worker_tt_ms = 3").unwrap_err();
        assert!(err.contains("worker_tt_ms"), "{err}");
        let err = parse::<WorkerConfig>("[nats]\nservers = []\npasword = 'x'").unwrap_err();
        assert!(err.contains("pasword"), "{err}");
    }

    #[test]
    fn bad_values_are_refused_with_a_reason() {
        assert!(parse::<WorkerConfig>("id = 'Not An Id'").is_err());
        let c: CoordinatorConfig = parse("lease_ttl_ms = 3000\nrenew_deadline_ms = 3000").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("renew_deadline_ms"));
        let c: CoordinatorConfig = parse("[approval]\nkinds = ['agent']\napprover = 'operator'").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("no operators are configured"));
        let c: CoordinatorConfig =
            parse("operators = ['ops']\n[approval]\ncommands = ['^git push']\napprover = 'operator'").unwrap();
        c.validate().unwrap();
        let c: CoordinatorConfig = parse("[approval]\ncommands = ['(unclosed']").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("approval.commands"));
        let c: CoordinatorConfig = parse("[concurrency_limits]\nllm = 0").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("concurrency_limits"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/srv/w1'\n[labels]\n'bad key' = 'x'").unwrap();
        assert!(format!("{:#}", w.validate().unwrap_err()).contains("labels"));
        let c: CoordinatorConfig = parse("operators = ['a/b']").unwrap();
        assert!(format!("{:#}", c.validate().unwrap_err()).contains("operators"));
        let c: CoordinatorConfig = parse("registry_max_bytes = 1000").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("registry_max_bytes"));
        let c: CoordinatorConfig = parse("notices_max_consumers = 0").unwrap();
        assert!(c.validate().unwrap_err().to_string().contains("notices_max_consumers"));
        assert!(parse::<CoordinatorConfig>("max_live_tasks = -1").is_err());
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/tmp/x'\nslots = 0").unwrap();
        assert!(w.validate().unwrap_err().to_string().contains("slots"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/tmp/x'\nstarted_hold_ms = 10001").unwrap();
        assert!(w.validate().unwrap_err().to_string().contains("started_hold_ms"));
        let w: WorkerConfig = parse("data_dir = '/tmp/x'").unwrap();
        assert!(w.validate().unwrap_err().to_string().contains("id is required"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/tmp/x'\nkinds = ['workflow']").unwrap();
        assert!(w.validate().is_err());
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/srv/w1'\nscratch_dir = '/srv/w1/scratch'").unwrap();
        assert!(w.validate().unwrap_err().to_string().contains("scratch_dir"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/srv/w1'\nrun_as = 'no-such-user-tenure-test'").unwrap();
        assert!(format!("{:#}", w.validate().unwrap_err()).contains("no user named"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/srv/w1'\nrun_as = 'root'").unwrap();
        assert!(format!("{:#}", w.validate().unwrap_err()).contains("root"));
        let w: WorkerConfig = parse("id = 'w1'\ndata_dir = '/srv/w1'\nno_cgroups = true").unwrap();
        assert!(w.no_cgroups && w.validate().is_ok());
    }

    #[test]
    fn a_full_file_round_trips_and_secrets_are_masked_when_printed() {
        let text = r#"
            name = "c7"
            replicas = 3
            operators = ["ops"]
            metrics_addr = "127.0.0.1:9464"
            [nats]
            servers = ["nats://a:4222", "nats://b:4222"]
            user = "tenure-coordinator"
            password = "hunter2-hunter2"
        "#;
        let c: CoordinatorConfig = parse(text).unwrap();
        c.validate().unwrap();
        assert_eq!((c.name.as_str(), c.replicas, c.lease_ttl_ms), ("c7", 3, 6000));
        assert_eq!(c.limits().live_tasks, Some(tenure_coordinator::limits::DEFAULT_LIVE_TASKS));
        let unlimited: CoordinatorConfig = parse("max_live_tasks = 0\nmax_output_bytes = 0").unwrap();
        assert_eq!((unlimited.limits().live_tasks, unlimited.limits().output_bytes), (None, None));
        let shown = print(&c).unwrap();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("password = \"***\""), "{shown}");
        let back: CoordinatorConfig = parse(&shown).unwrap();
        assert_eq!(back.nats.servers, c.nats.servers);
    }
}
