//! A real cluster for integration tests: a nats-server of the test's own (free
//! loopback port, own store) — or several, from the shipped configurations, with
//! per-role users — and the real `tenure` binary as coordinator, sidecar and
//! worker processes. Every process is started here and stopped here, by its own
//! handle, when the cluster drops.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use tenure_testkit::{eventually, NatsCluster, NatsServer};

pub const BIN: &str = env!("CARGO_BIN_EXE_tenure");

pub struct Daemon {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) for the process to exit by itself.
    pub fn wait_exit(&mut self, bound: Duration) -> Option<std::process::ExitStatus> {
        eventually(bound, || self.child.try_wait().ok().flatten())
    }

    pub fn stop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::Signal::SIGTERM);
        if self.wait_exit(Duration::from_secs(15)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub struct Cluster {
    /// The NATS node(s); `nats.url` is what `--nats` gets.
    pub nats: NatsCluster,
    pub dir: tempfile::TempDir,
    pub daemons: Vec<Daemon>,
    pub session: String,
    /// Per-role NATS users, when the servers run with `deploy/nats/auth.conf`.
    pub auth: Option<RoleAuth>,
}

/// The roles of `deploy/nats/auth.conf`, each with its user `tenure-<role>`.
pub const ROLES: [&str; 4] = ["coordinator", "worker", "sidecar", "client"];

/// One fresh password per role, for servers started from the shipped configs.
#[derive(Clone, Debug)]
pub struct RoleAuth {
    passwords: Vec<(&'static str, String)>,
}

impl RoleAuth {
    pub fn generate() -> RoleAuth {
        RoleAuth { passwords: ROLES.iter().map(|r| (*r, format!("{r}-{}", uuid::Uuid::new_v4().simple()))).collect() }
    }

    pub fn password(&self, role: &str) -> &str {
        self.passwords.iter().find(|(r, _)| *r == role).map(|(_, p)| p.as_str()).expect("known role")
    }

    /// nats-server's environment: the passwords `auth.conf` reads.
    pub fn server_env(&self) -> Vec<(String, String)> {
        self.passwords
            .iter()
            .map(|(role, pw)| (format!("TENURE_NATS_{}_PASSWORD", role.to_uppercase()), pw.clone()))
            .collect()
    }

    /// A tenure process's environment for `role`.
    pub fn process_env(&self, role: &str) -> Vec<(String, String)> {
        vec![
            ("TENURE_NATS_USER".to_owned(), format!("tenure-{role}")),
            ("TENURE_NATS_PASSWORD".to_owned(), self.password(role).to_owned()),
        ]
    }
}

/// The shipped NATS configurations (`deploy/nats/NAME`).
pub fn deploy_config(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nats").join(name)
}

/// The role a tenure command line runs as.
fn role_of(args: &[&str]) -> &'static str {
    match args.first() {
        Some(&"coordinator") => "coordinator",
        Some(&"worker") => "worker",
        Some(&"sidecar") => "sidecar",
        _ => "client",
    }
}

impl Cluster {
    /// An empty cluster on `nats`: start its daemons with the `spawn_*` methods.
    pub fn on(nats: NatsCluster, auth: Option<RoleAuth>) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        Cluster { nats, dir, daemons: Vec::new(), session: "test-owner".into(), auth }
    }

    /// A single nats-server from `deploy/nats/single.conf` (users and
    /// permissions of `auth.conf`, one fresh password per role) and nothing else.
    pub fn secured() -> Cluster {
        let auth = RoleAuth::generate();
        let env = auth.server_env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let server = NatsServer::start_from_config(&deploy_config("single.conf"), &env).expect("nats-server");
        Cluster::on(NatsCluster::single(server), Some(auth))
    }

    /// NATS options for an in-test connection as `role` (no credentials when
    /// the servers run without users).
    pub fn nats_options(&self, role: &str) -> tenure_transport::NatsOptions {
        let mut o = tenure_transport::NatsOptions {
            servers: self.nats.url.split(',').map(str::to_owned).collect(),
            ..Default::default()
        };
        if let Some(auth) = &self.auth {
            o.user = Some(format!("tenure-{role}"));
            o.password = Some(tenure_transport::Secret::new(auth.password(role)));
        }
        o
    }

    /// nats-server, one coordinator, and `workers` workers with their sidecars.
    pub fn start(workers: usize) -> Cluster {
        let nats = NatsCluster::single(NatsServer::start().expect("nats-server"));
        let mut c = Cluster::on(nats, None);
        c.spawn("coordinator", &["coordinator", "--name", "c1", "--worker-ttl-ms", "3000"]);
        for i in 1..=workers {
            c.start_worker(&format!("w{i}"));
        }
        c.wait_workers(workers);
        c
    }

    pub fn worker_dir(&self, id: &str) -> PathBuf {
        self.dir.path().join("workers").join(id)
    }

    pub fn start_worker(&mut self, id: &str) {
        self.spawn_sidecar(id);
        self.spawn_worker(id, &[]);
    }

    /// Starts (or restarts) the sidecar of worker `id`.
    pub fn spawn_sidecar(&mut self, id: &str) -> &mut Daemon {
        let d = self.worker_dir(id).display().to_string();
        self.spawn(&format!("sidecar-{id}"), &["sidecar", "--worker", id, "--data-dir", &d])
    }

    /// Starts (or restarts) the worker process `id`, with extra flags.
    pub fn spawn_worker(&mut self, id: &str, extra: &[&str]) -> &mut Daemon {
        let d = self.worker_dir(id).display().to_string();
        let mut args = vec!["worker", "--id", id, "--slots", "4", "--data-dir", &d];
        args.extend_from_slice(&["--kill-grace-ms", "2000", "--heartbeat-ms", "300"]);
        args.extend_from_slice(extra);
        self.spawn(&format!("worker-{id}"), &args)
    }

    /// Starts the worker process `id` set to crash at a named point (`TENURE_CRASH_AT`).
    pub fn spawn_worker_crashing_at(&mut self, id: &str, point: &str) -> &mut Daemon {
        let d = self.worker_dir(id).display().to_string();
        let args = ["worker", "--id", id, "--slots", "4", "--data-dir", &d, "--heartbeat-ms", "300"];
        self.spawn_env(&format!("worker-{id}"), &args, &[("TENURE_CRASH_AT", point)])
    }

    /// SIGKILLs the newest daemon called `name` and reaps it.
    pub fn kill9(&mut self, name: &str) {
        let d = self.daemon(name);
        let _ = d.child.kill();
        let _ = d.child.wait();
    }

    pub fn spawn(&mut self, name: &str, args: &[&str]) -> &mut Daemon {
        self.spawn_env(name, args, &[])
    }

    pub fn spawn_env(&mut self, name: &str, args: &[&str], env: &[(&str, &str)]) -> &mut Daemon {
        let log = self.dir.path().join(format!("{name}-{}.log", self.daemons.len()));
        let file = std::fs::File::create(&log).expect("log file");
        let role_env = self.auth.as_ref().map(|a| a.process_env(role_of(args))).unwrap_or_default();
        let child = Command::new(BIN)
            .arg("--nats")
            .arg(&self.nats.url)
            .args(args)
            .env("RUST_LOG", "info")
            .envs(role_env)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup"))
            .stderr(file)
            .spawn()
            .expect("spawn tenure daemon");
        self.daemons.push(Daemon { name: name.into(), child, log });
        self.daemons.last_mut().expect("just pushed")
    }

    pub fn daemon(&mut self, name: &str) -> &mut Daemon {
        self.daemons.iter_mut().rev().find(|d| d.name == name).expect("daemon by name")
    }

    /// Runs a client verb as this cluster's test session.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli_as(&self.session, args)
    }

    pub fn cli_as(&self, session: &str, args: &[&str]) -> Output {
        let role_env = self.auth.as_ref().map(|a| a.process_env("client")).unwrap_or_default();
        Command::new(BIN)
            .arg("--nats")
            .arg(&self.nats.url)
            .arg("--session")
            .arg(session)
            .args(args)
            .envs(role_env)
            .stdin(Stdio::null())
            .output()
            .expect("run tenure")
    }

    /// `submit` that must succeed; returns the task id.
    pub fn submit(&self, args: &[&str]) -> String {
        let mut full = vec!["submit"];
        full.extend_from_slice(args);
        let out = self.cli(&full);
        assert!(out.status.success(), "submit failed: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    pub fn snapshot(&self, task: &str) -> serde_json::Value {
        let out = self.cli(&["get", task, "--json"]);
        assert!(out.status.success(), "get failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("snapshot json")
    }

    /// The snapshot, or `None` while no coordinator answers (e.g. during a restart).
    pub fn try_snapshot(&self, task: &str) -> Option<serde_json::Value> {
        let out = self.cli(&["get", task, "--json"]);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    pub fn wait_status(&self, task: &str, status: &str, bound: Duration) -> serde_json::Value {
        eventually(bound, || self.try_snapshot(task).filter(|s| s["status"] == status))
            .unwrap_or_else(|| panic!("{task} never reached {status}: {:?}\n{}", self.try_snapshot(task), self.logs()))
    }

    pub fn wait_workers(&self, n: usize) {
        let ok = eventually(Duration::from_secs(30), || {
            let out = self.cli(&["status", "--json"]);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            let alive = v["workers"].as_array()?.iter().filter(|w| w["alive"] == true).count();
            (alive >= n).then_some(())
        });
        assert!(ok.is_some(), "workers did not join:\n{}", self.logs());
    }

    /// Every daemon's log, for failure messages.
    pub fn logs(&self) -> String {
        let daemons: String = self.daemons.iter().map(|d| format!("---- {} ----\n{}", d.name, d.log_text())).collect();
        let nats: String = self
            .nats
            .nodes
            .iter()
            .map(|n| n.log())
            .filter(|l| !l.is_empty())
            .map(|l| format!("---- nats ----\n{l}"))
            .collect();
        daemons + &nats
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn group_alive(pgid: i32) -> bool {
    !matches!(nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), None), Err(nix::errno::Errno::ESRCH))
}

pub fn path_exists(p: &Path) -> bool {
    p.exists()
}

/// Live processes in process group `pgid`, as (pid, ppid).
pub fn group_members(pgid: i32) -> Vec<(i32, i32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        let Some((_, rest)) = text.rsplit_once(')') else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first().is_some_and(|s| *s != "Z") && f.get(2).and_then(|p| p.parse().ok()) == Some(pgid) {
            out.push((pid, f.get(1).and_then(|p| p.parse().ok()).unwrap_or(0)));
        }
    }
    out
}

// ------------------------------------------------------- coordinator failover

/// Short lease timings for failover tests (defaults: 6000 / 2000 / 4000).
pub const FAST_LEASE: [&str; 6] =
    ["--lease-ttl-ms", "1500", "--renew-interval-ms", "300", "--renew-deadline-ms", "900"];

impl Cluster {
    /// nats-server, coordinators `c1` … `cK` (daemons `coordinator-c1` …, each
    /// with `extra` flags), and `workers` workers with their sidecars. `c1` is
    /// started alone and leads before the others start as standbys.
    pub fn start_coordinators(coordinators: usize, workers: usize, extra: &[&str]) -> Cluster {
        let nats = NatsCluster::single(NatsServer::start().expect("nats-server"));
        let mut c = Cluster::on(nats, None);
        c.spawn_coordinator("c1", extra);
        c.wait_leader("c1");
        for i in 2..=coordinators {
            c.spawn_coordinator(&format!("c{i}"), extra);
        }
        for i in 1..=workers {
            c.start_worker(&format!("w{i}"));
        }
        c.wait_workers(workers);
        c
    }

    /// Starts coordinator `name` (daemon `coordinator-<name>`) with a 3 s worker TTL and `extra` flags.
    pub fn spawn_coordinator(&mut self, name: &str, extra: &[&str]) -> &mut Daemon {
        let mut args = vec!["coordinator", "--name", name, "--worker-ttl-ms", "3000"];
        args.extend_from_slice(extra);
        self.spawn(&format!("coordinator-{name}"), &args)
    }

    /// `tenure status --json`, or `None` while no coordinator answers.
    pub fn status(&self) -> Option<serde_json::Value> {
        let out = self.cli(&["status", "--json"]);
        out.status.success().then(|| serde_json::from_slice(&out.stdout).ok()).flatten()
    }

    /// Waits (bounded) until coordinator `name` answers as the leader; returns the status.
    pub fn wait_leader(&self, name: &str) -> serde_json::Value {
        eventually(Duration::from_secs(30), || self.status().filter(|s| s["leader"]["name"] == name))
            .unwrap_or_else(|| panic!("{name} never led: {:?}\n{}", self.status(), self.logs()))
    }

    /// Sends `signal` to the newest daemon called `name`.
    pub fn signal(&mut self, name: &str, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.daemon(name).pid());
        nix::sys::signal::kill(pid, signal).expect("signal daemon");
    }

    /// How many processes answer one request on the client API subject
    /// (replies collected for a second).
    pub fn api_responders(&self) -> usize {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let client =
                tenure_transport::connect(&self.nats_options("client"), "tenure-test", false).await.expect("connect");
            let inbox = client.new_inbox();
            let mut replies = client.subscribe(inbox.clone()).await.expect("subscribe");
            let request = tenure_protocol::encode(&tenure_protocol::messages::ApiRequest::Status).expect("encode");
            client.publish_with_reply(tenure_protocol::subjects::API, inbox, request.into()).await.expect("publish");
            client.flush().await.expect("flush");
            let mut n = 0;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            while let Ok(Some(_)) = tokio::time::timeout_at(deadline, futures::StreamExt::next(&mut replies)).await {
                n += 1;
            }
            n
        })
    }
}
