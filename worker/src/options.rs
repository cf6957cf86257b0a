//! The worker's configuration ([`Options`], its defaults in [`Options::new`])
//! and the errors that stop it ([`Error`]).

use std::path::PathBuf;
use std::time::Duration;

use tenure_protocol::placement::Labels;
use tenure_protocol::{Kind, WorkerId};
use uuid::Uuid;

use crate::sandbox::RunAs;

#[derive(Debug, Clone)]
pub struct Options {
    /// How to reach NATS (servers, credentials, TLS).
    pub nats: tenure_transport::NatsOptions,
    pub id: WorkerId,
    pub slots: u32,
    pub data_dir: PathBuf,
    /// Kinds this worker runs and advertises; grants of others are refused.
    /// `agent` tasks get an input FIFO as stdin; `monitor` tasks have their
    /// output lines matched against their pattern; `noop` and `sleep` run
    /// inside the worker ([`crate::builtin`]); every other kind runs its
    /// command like `shell` (`sh -c`, stdin from `/dev/null` unless `agent`).
    pub kinds: Vec<Kind>,
    pub heartbeat: Duration,
    /// Time between SIGTERM and SIGKILL when a task's group is ended.
    pub kill_grace: Duration,
    /// How long a `Started` report waits for its attempt's end on a worker
    /// starting attempts closer together than this ([`crate::reports`]);
    /// zero reports every start at once.
    pub started_hold: Duration,
    /// The `tenure` binary: its `shim-launcher`, or the same build's
    /// `tenure-shim` beside it, forks each attempt's shim
    /// ([`crate::launcher`]).
    pub shim_program: PathBuf,
    /// Output bytes kept per task; the rest is dropped and counted.
    pub output_cap: u64,
    /// End running tasks when the worker stops (for `tenure dev`). Off by default:
    /// tasks outlive their worker and a restarted worker re-attaches to them.
    pub kill_tasks_on_exit: bool,
    /// Where each attempt's scratch directory is made; `None`: the data
    /// directory's sibling `<data-dir>.scratch` ([`crate::sandbox`]).
    pub scratch_dir: Option<PathBuf>,
    /// Run tasks as this unprivileged user (the worker must be root).
    pub run_as: Option<RunAs>,
    /// Labels sent with every heartbeat, matched against tasks' placement
    /// constraints (`--on`) by the leader.
    pub labels: Labels,
    /// Run each attempt in control groups of its own (tracking and resource
    /// limits) where the host allows it ([`crate::cgroup`]). On by default;
    /// off, tasks run without limits and as they did before.
    pub cgroups: bool,
}

impl Options {
    pub fn new(nats: tenure_transport::NatsOptions, id: WorkerId, data_dir: PathBuf) -> Options {
        Options {
            nats,
            id,
            slots: 4,
            data_dir,
            kinds: ["shell", "agent", "monitor", "noop", "sleep"].iter().filter_map(|k| k.parse().ok()).collect(),
            heartbeat: Duration::from_millis(1000),
            kill_grace: Duration::from_secs(5),
            started_hold: crate::reports::STARTED_HOLD,
            shim_program: PathBuf::from("tenure"),
            output_cap: crate::shim::DEFAULT_OUTPUT_CAP,
            kill_tasks_on_exit: false,
            scratch_dir: None,
            run_as: None,
            labels: Labels::new(),
            cgroups: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] tenure_transport::Error),
    #[error("NATS subscription failed: {0}")]
    Subscribe(String),
    #[error("data dir: {0}")]
    Layout(String),
    /// The leader bound this worker id to another live process: the same id
    /// runs on another host (or another data directory). Nothing was run.
    #[error(
        "worker id {worker} is taken: the leader bound it to another live process (instance {holder}); \
         this process (instance {instance}) stops. Give each machine its own id"
    )]
    IdTaken { worker: WorkerId, instance: Uuid, holder: Uuid },
    /// Another worker runs on this data directory (or the lock is unusable).
    #[error(transparent)]
    Lock(#[from] tenure_machine::worker_lock::Error),
    /// The tasks' scratch directory or user cannot be set up.
    #[error(transparent)]
    Sandbox(#[from] crate::sandbox::Error),
}
