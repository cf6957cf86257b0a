//! The cluster under measurement: the one local-cluster harness
//! ([`tenure_launch::cluster`]) with the bench's timings — a nats-server on
//! a free loopback port with its own store, coordinators, and workers with
//! their sidecars, the real `tenure` binary, each a child process of the
//! bench in a process group of its own. The harness stops them by their own
//! pids in reverse start order (workers end their tasks first) when the
//! cluster stops or is dropped (a failed benchmark, a Ctrl-C).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;
use tenure_launch::cluster::{Cluster as Harness, Layout, Member};

use crate::api::{Api, BenchApi};

/// The programs the bench runs.
#[derive(Debug, Clone)]
pub struct Tools {
    pub tenure: PathBuf,
    pub nats_server: PathBuf,
}

impl Tools {
    /// `tenure` beside this binary (same build) unless given; nats-server as
    /// `tenure_launch::nats::find` finds it (`TENURE_NATS_SERVER`, `PATH`,
    /// `.tools/nats/bin`; at least 2.11).
    pub fn find(tenure: Option<PathBuf>, nats: Option<PathBuf>) -> anyhow::Result<Tools> {
        let tenure = match tenure {
            Some(p) => p,
            None => std::env::current_exe()?.with_file_name("tenure"),
        };
        if !tenure.is_file() {
            bail!("{} not found; build it (cargo build --release -p tenure-cli) or pass --tenure", tenure.display());
        }
        let nats_server = tenure_launch::nats::find(nats)?;
        Ok(Tools { tenure, nats_server })
    }
}

/// How the cluster is laid out.
#[derive(Debug, Clone)]
pub struct Spec {
    pub coordinators: u32,
    pub workers: u32,
    pub slots: u32,
    /// Written to the nats-server config as `jetstream.sync_interval` ("always");
    /// `None` keeps the server's default (fsync every 2 minutes).
    pub sync_always: bool,
    pub worker_extra: Vec<String>,
}

impl Spec {
    pub fn new(workers: u32, slots: u32) -> Spec {
        Spec { coordinators: 1, workers, slots, sync_always: false, worker_extra: Vec::new() }
    }

    /// The harness's layout: the bench's lease timings and heartbeat.
    fn layout(&self) -> Layout {
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let hb = HEARTBEAT_MS.to_string();
        let mut worker_flags = flags(&["--heartbeat-ms", &hb, "--kill-grace-ms", "1000", "--kill-tasks-on-exit"]);
        worker_flags.extend(self.worker_extra.iter().cloned());
        Layout {
            coordinator_flags: flags(&LEASE_FLAGS),
            worker_flags,
            ..Layout::new(self.coordinators, self.workers, self.slots)
        }
    }
}

/// Lease timings of the bench's coordinators (the defaults are 6000/2000/4000).
pub const LEASE_TTL_MS: u64 = 2000;
const LEASE_FLAGS: [&str; 6] = ["--lease-ttl-ms", "2000", "--renew-interval-ms", "500", "--renew-deadline-ms", "1500"];
/// Worker heartbeat of the bench (default 1000 ms).
pub const HEARTBEAT_MS: u64 = 250;

pub struct Cluster {
    pub dir: PathBuf,
    pub url: String,
    pub api: Api,
    harness: Harness,
}

impl Cluster {
    /// Starts nats-server, the coordinators (`c1` first, leading before the
    /// others start) and the workers with their sidecars; returns once every
    /// worker is alive in the leader's view.
    pub async fn start(tools: &Tools, root: &Path, name: &str, spec: &Spec) -> anyhow::Result<Cluster> {
        let dir = root.join(name);
        let mut harness = Harness::new(&dir, &tools.tenure, "")?;
        harness.own_process_groups();
        harness.set_stop_grace(Duration::from_secs(10));
        let config = tenure_launch::nats::Config::new(tenure_launch::free_port()?, dir.join("nats"));
        harness.start_nats(
            &tools.nats_server,
            tenure_launch::nats::Config { sync_always: spec.sync_always, ..config },
            "",
        )?;
        let url = harness.url().to_owned();
        let api = crate::api::connect(&url).await?;
        let layout = spec.layout();
        let coordinators = layout.coordinators(|_| url.clone());
        let mut c = Cluster { dir, url, api, harness };
        for (i, planned) in coordinators.iter().enumerate() {
            c.harness.spawn_planned(planned)?;
            if i == 0 {
                c.wait_leader(Duration::from_secs(30)).await?;
            }
        }
        for planned in layout.machines(&c.dir, |_| c.url.clone()) {
            c.harness.spawn_planned(&planned)?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let alive = match c.api.cluster_status().await {
                Ok(s) => s.workers.iter().filter(|w| w.alive).count() as u32,
                Err(_) => 0,
            };
            if alive >= spec.workers {
                break;
            }
            if Instant::now() > deadline {
                bail!("workers did not join within 30 s:\n{}", c.logs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(c)
    }

    /// The member called `name` (`coordinator-c1`, `worker-w1`, …).
    pub fn member(&mut self, name: &str) -> anyhow::Result<&mut Member> {
        Ok(self.harness.member_mut(name)?)
    }

    pub fn pid(&self, name: &str) -> Option<i32> {
        self.harness.pid(name)
    }

    /// Starts a stopped member again with the same command line.
    pub fn restart(&mut self, name: &str) -> anyhow::Result<()> {
        self.member(name)?.start()?;
        Ok(())
    }

    /// Waits until some coordinator answers as the leader; its name.
    pub async fn wait_leader(&self, bound: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + bound;
        loop {
            if let Ok(s) = self.api.status(Duration::from_millis(500)).await {
                if let Some(l) = s.leader {
                    return Ok(l.name);
                }
            }
            if Instant::now() > deadline {
                bail!("no leader within {bound:?}:\n{}", self.logs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn worker_dir(&self, id: &str) -> PathBuf {
        self.harness.machine_dir(id)
    }

    /// The last lines of every log, for failure messages.
    pub fn logs(&self) -> String {
        self.harness.logs_tail(15)
    }

    /// Stops everything in reverse start order (workers end their tasks first,
    /// NATS last) and removes the cluster's files.
    pub async fn stop(mut self) {
        self.harness.stop_all(|_, _| {});
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Resident set size of a process, in bytes (0 when it is gone).
pub fn rss(pid: i32) -> u64 {
    status_field(pid, "VmRSS:")
}

fn status_field(pid: i32, field: &str) -> u64 {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return 0 };
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .unwrap_or(0)
}

/// Processes whose command line contains `needle` (the task shims of one
/// cluster name its data directory).
pub fn pids_with_arg(needle: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        if String::from_utf8_lossy(&cmd).contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// CPU time a process used, and what its reaped children used, in milliseconds
/// (`utime + stime`, `cutime + cstime` of `/proc/PID/stat`); zeros when gone.
pub fn cpu_ms(pid: i32) -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return (0.0, 0.0) };
    let Some((_, rest)) = stat.rsplit_once(')') else { return (0.0, 0.0) };
    // Fields after the command: state is field 3; utime is field 14.
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(4).filter_map(|v| v.parse().ok()).collect();
    if f.len() < 4 {
        return (0.0, 0.0);
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) }.max(1) as f64;
    (((f[0] + f[1]) as f64) * 1000.0 / hz, ((f[2] + f[3]) as f64) * 1000.0 / hz)
}

/// `cpu_ms(pid)`, with the CPU of its live descendants (and of what they
/// reaped) counted among its children's: a worker's shim launcher lives as
/// long as the worker, and the shims it forks are its children, each serving
/// many attempts before it is reaped.
fn cpu_ms_with_live_children(pid: i32) -> (f64, f64) {
    let (own, reaped) = cpu_ms(pid);
    (own, reaped + live_descendants_cpu_ms(pid, 3))
}

/// The CPU of `pid`'s live descendants down to `depth` generations, with
/// what each reaped.
fn live_descendants_cpu_ms(pid: i32, depth: u32) -> f64 {
    if depth == 0 {
        return 0.0;
    }
    // Children are listed under the thread that started them.
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    let listed: String =
        threads.filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok()).collect::<Vec<_>>().join(" ");
    let children = listed.split_whitespace().filter_map(|c| c.parse::<i32>().ok());
    children
        .map(|child| {
            let (c_own, c_reaped) = cpu_ms(child);
            c_own + c_reaped + live_descendants_cpu_ms(child, depth - 1)
        })
        .sum()
}

/// CPU use of a cluster's daemons (and of this process) over a stretch of work.
pub struct CpuMeter {
    start: Vec<(String, i32, (f64, f64))>,
}

impl CpuMeter {
    pub fn start(cluster: &Cluster) -> CpuMeter {
        let me = std::process::id() as i32;
        let mut start: Vec<_> = cluster
            .harness
            .members()
            .iter()
            .filter_map(|p| p.pid().map(|pid| (p.name.clone(), pid, cpu_ms_with_live_children(pid))))
            .collect();
        // The bench's own children are the daemons, counted above.
        start.push(("bench".into(), me, cpu_ms(me)));
        CpuMeter { start }
    }

    /// Milliseconds of CPU per item since `start`, by process (children, such
    /// as a worker's task shims, under `<name> children`), and their `total`.
    pub fn per_item(&self, items: u64) -> serde_json::Value {
        let mut out = serde_json::Map::new();
        let n = items.max(1) as f64;
        let me = std::process::id() as i32;
        let per = |ms: f64| serde_json::Value::from((ms / n * 1000.0).round() / 1000.0);
        let mut total = 0.0;
        for (name, pid, (own, children)) in &self.start {
            let (own2, children2) = if *pid == me { cpu_ms(me) } else { cpu_ms_with_live_children(*pid) };
            out.insert(name.clone(), per(own2 - own));
            total += own2 - own;
            if children2 > *children {
                out.insert(format!("{name} children"), per(children2 - children));
                total += children2 - children;
            }
        }
        out.insert("total".into(), per(total));
        serde_json::Value::Object(out)
    }
}
