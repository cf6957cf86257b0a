//! The one local-cluster harness: nats-server and the `tenure` daemons of
//! one cluster on this machine, each a named [`Member`] with its own log,
//! started, signalled, restarted and stopped by its own pid.
//!
//! Every launcher is this harness with its own flags around it: the tests
//! (`tenure-testkit`'s `Cluster` adds the client verbs and panicking
//! waits), the bench (CPU and memory meters), the chaos harness (a proxy per
//! node through [`Layout`]'s URL hook, power-loss disks, fault schedules)
//! and `tenure dev` (credentials per daemon, a gateway, restarts of what
//! exits). What they share is decided here once:
//!
//! - the names and command lines of a cluster's daemons ([`Layout`]:
//!   `coordinator-c1` … first, then each machine's `sidecar-wN` and
//!   `worker-wN`, its data directory `ROOT/workers/wN`);
//! - where logs go (`ROOT/logs/NAME.log`, a second member of the same name
//!   `NAME-2.log`, …);
//! - which NATS credentials a daemon runs with (the user `tenure nats-auth`
//!   generates for it, [`crate::daemon::nats_user`]);
//! - supervision ([`Cluster::note_exits`], [`Cluster::supervise`]): a
//!   member that exited or was killed for a while is started again once its
//!   down time is over, unless held;
//! - the stop order: the reverse of the start order (workers end their tasks
//!   before their sidecars, NATS last), SIGTERM and a bounded grace, then
//!   SIGKILL — also when the cluster is dropped (an error, a Ctrl-C).
//!
//! It must never signal a process it did not start, and never wait
//! unboundedly. It decides nothing about tasks.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::daemon::{machine_dir, nats_user, DaemonArgs};
use crate::process::Process;

/// Why a cluster (or one member) could not be started.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file of the cluster could not be written, or a process not spawned.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// nats-server started but did not accept connections in time.
    #[error("nats-server did not listen on 127.0.0.1:{port} within {bound:?}; its log ends:\n{log}")]
    NatsNotListening { port: u16, bound: Duration, log: String },
    /// An operation named a member the cluster does not have.
    #[error("no member {0} in this cluster")]
    NoMember(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// What a member is, read from its command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Nats,
    Coordinator,
    Sidecar,
    Worker,
    Gateway,
    Other,
}

impl Role {
    /// The role of a `tenure` command line (`[--nats URL] SUBCOMMAND …`).
    pub fn of_tenure(args: &[String]) -> Role {
        match crate::daemon::subcommand(args) {
            Some("coordinator") => Role::Coordinator,
            Some("sidecar") => Role::Sidecar,
            Some("worker") => Role::Worker,
            Some("gateway") => Role::Gateway,
            _ => Role::Other,
        }
    }
}

/// How many daemons of each role, with which flags: the plan of a cluster,
/// pure (no process is started by it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub coordinators: u32,
    pub workers: u32,
    pub slots: u32,
    pub coordinator_flags: Vec<String>,
    pub sidecar_flags: Vec<String>,
    pub worker_flags: Vec<String>,
}

/// One daemon of a [`Layout`]: its member name and command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub name: String,
    pub args: DaemonArgs,
}

impl Layout {
    /// `coordinators` coordinators, `workers` machines of `slots` slots, no extra flags.
    pub fn new(coordinators: u32, workers: u32, slots: u32) -> Layout {
        Layout {
            coordinators,
            workers,
            slots,
            coordinator_flags: Vec::new(),
            sidecar_flags: Vec::new(),
            worker_flags: Vec::new(),
        }
    }

    /// `coordinator-c1` … `coordinator-cN`, in start order; `url` gives the
    /// NATS URL of each member by name (the same for all, or a proxy each).
    pub fn coordinators(&self, url: impl Fn(&str) -> String) -> Vec<Planned> {
        (1..=self.coordinators)
            .map(|i| {
                let (id, name) = (format!("c{i}"), format!("coordinator-c{i}"));
                Planned { args: DaemonArgs::coordinator(&url(&name), &id).flags(&self.coordinator_flags), name }
            })
            .collect()
    }

    /// For each machine `w1` … `wN` under `root`: its sidecar, then its worker.
    pub fn machines(&self, root: &Path, url: impl Fn(&str) -> String) -> Vec<Planned> {
        let mut out = Vec::new();
        for i in 1..=self.workers {
            let id = format!("w{i}");
            let dir = machine_dir(root, &id);
            let sidecar = format!("sidecar-{id}");
            let args = DaemonArgs::sidecar(&url(&sidecar), &id, &dir).flags(&self.sidecar_flags);
            out.push(Planned { name: sidecar, args });
            let worker = format!("worker-{id}");
            let args = DaemonArgs::worker(&url(&worker), &id, self.slots, &dir).flags(&self.worker_flags);
            out.push(Planned { name: worker, args });
        }
        out
    }
}

/// One process of the cluster.
#[derive(Debug)]
pub struct Member {
    pub name: String,
    pub role: Role,
    process: Process,
    /// When it was last started.
    started_at: Option<Instant>,
    /// Not started again by [`Cluster::supervise`] before this instant
    /// (`Some(far future)`: held until released).
    down_until: Option<Instant>,
    /// Environment for the next start only (a crash-point hook).
    next_env: Vec<(String, String)>,
}

/// How long "held" is: longer than any run of any harness.
const HELD: Duration = Duration::from_secs(365 * 24 * 3600);

impl Member {
    /// Starts it (again) with its command line; its pid.
    pub fn start(&mut self) -> std::io::Result<u32> {
        let once = std::mem::take(&mut self.next_env);
        let pid = self.process.start_with(&once)?;
        self.started_at = Some(Instant::now());
        self.down_until = None;
        Ok(pid)
    }

    /// The pid of the running child (`None` once it was killed and reaped:
    /// the pid may be another process's by then).
    pub fn pid(&self) -> Option<i32> {
        self.process.pid()
    }

    /// The pid of the last start, also after it was reaped.
    pub fn last_pid(&self) -> Option<i32> {
        self.process.last_pid()
    }

    /// Started and not exited.
    pub fn running(&mut self) -> bool {
        self.process.running()
    }

    /// How long it has run since its last start.
    pub fn uptime(&self) -> Option<Duration> {
        self.started_at.map(|t| t.elapsed())
    }

    /// Its exit status once it exited.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        self.process.try_exit()
    }

    /// Waits (bounded) for it to exit by itself.
    pub fn wait_exit(&mut self, bound: Duration) -> Option<ExitStatus> {
        self.process.wait_exit(bound)
    }

    /// Sends `signal` while it runs.
    pub fn signal(&mut self, signal: Signal) {
        self.process.signal(signal);
    }

    /// SIGKILLs and reaps it; [`Cluster::supervise`] starts it again at once.
    pub fn kill9(&mut self) {
        self.process.kill9();
    }

    /// SIGKILLs it; [`Cluster::supervise`] starts it again after `down`.
    pub fn kill_for(&mut self, down: Duration) {
        self.process.kill9();
        self.down_until = Some(Instant::now() + down);
    }

    /// SIGKILLs it and keeps it down until [`Member::release`].
    pub fn hold(&mut self) {
        self.kill_for(HELD);
    }

    /// Lets [`Cluster::supervise`] start it again (now, if it is down).
    pub fn release(&mut self) {
        self.down_until = None;
    }

    /// SIGCONT, SIGTERM, up to `grace` to exit, then SIGKILL; reaped.
    pub fn stop(&mut self, grace: Duration) {
        if grace.is_zero() {
            self.process.signal(Signal::SIGCONT);
            self.process.kill9();
        } else {
            self.process.stop(grace);
        }
    }

    /// Sets a variable for every start from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.process.set_env(key, value);
    }

    /// Variables for the next start only.
    pub fn next_start_env(&mut self, env: Vec<(String, String)>) {
        self.next_env = env;
    }

    /// The program and arguments it runs with.
    pub fn process(&self) -> &Process {
        &self.process
    }

    pub fn log_text(&self) -> String {
        self.process.log_text()
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.process.log_tail(lines)
    }

    pub fn log_path(&self) -> &Path {
        self.process.log_path()
    }
}

/// A local cluster: its directory, the `tenure` binary it runs, the NATS URL
/// its daemons are given, and its members in start order.
#[derive(Debug)]
pub struct Cluster {
    root: PathBuf,
    tenure: PathBuf,
    url: String,
    nats_port: Option<u16>,
    members: Vec<Member>,
    env: Vec<(String, String)>,
    env_remove: Vec<String>,
    own_groups: bool,
    credentials: BTreeMap<String, Vec<(String, String)>>,
    stop_grace: Duration,
}

impl Cluster {
    /// An empty cluster under `root` running `tenure`, its daemons pointed at
    /// `nats_url` (a server of the caller's, or one [`Cluster::start_nats`]
    /// starts). Every member logs at `RUST_LOG=info` unless told otherwise;
    /// members are SIGKILLed when the cluster stops, unless a grace is set.
    pub fn new(root: &Path, tenure: &Path, nats_url: &str) -> Result<Cluster, Error> {
        std::fs::create_dir_all(root.join("logs")).map_err(io(format!("creating {}", root.display())))?;
        Ok(Cluster {
            root: root.to_path_buf(),
            tenure: tenure.to_path_buf(),
            url: nats_url.to_owned(),
            nats_port: None,
            members: Vec::new(),
            env: vec![("RUST_LOG".into(), "info".into())],
            env_remove: Vec::new(),
            own_groups: false,
            credentials: BTreeMap::new(),
            stop_grace: Duration::ZERO,
        })
    }

    /// Sets a variable for every member started from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// A variable of this process's environment members must not inherit.
    pub fn remove_env(&mut self, key: &str) {
        self.env_remove.push(key.to_owned());
    }

    /// Members start in process groups of their own: a Ctrl-C in the
    /// terminal reaches the harness only, which then stops them in order.
    pub fn own_process_groups(&mut self) {
        self.own_groups = true;
    }

    /// The environment (`TENURE_NATS_USER`, `TENURE_NATS_PASSWORD`) of each
    /// NATS user; a daemon runs with the one of [`nats_user`].
    pub fn set_credentials(&mut self, credentials: BTreeMap<String, Vec<(String, String)>>) {
        self.credentials = credentials;
    }

    /// How long a member has to exit after SIGTERM when the cluster stops
    /// (zero: SIGKILL at once).
    pub fn set_stop_grace(&mut self, grace: Duration) {
        self.stop_grace = grace;
    }

    /// Starts the member `nats`: nats-server `nats_bin` with `config`
    /// (written to `ROOT/nats.conf`, with `header` as its first line), and
    /// waits (bounded) until it listens; the daemons' URL becomes its own.
    pub fn start_nats(&mut self, nats_bin: &Path, config: crate::nats::Config, header: &str) -> Result<(), Error> {
        let conf = self.root.join("nats.conf");
        std::fs::write(&conf, format!("{header}{}", config.render()))
            .map_err(io(format!("writing {}", conf.display())))?;
        self.url = config.url();
        self.nats_port = Some(config.port);
        let conf = conf.display().to_string();
        self.spawn_program("nats", Role::Nats, nats_bin, &["-c".into(), conf])?;
        self.wait_nats(Duration::from_secs(20))
    }

    /// Starts the member `nats` again (after a kill or hold) and waits
    /// (bounded) until it listens.
    pub fn restart_nats(&mut self) -> Result<(), Error> {
        let nats = self.member_mut("nats")?;
        if !nats.running() {
            nats.start().map_err(io("starting nats-server again"))?;
        }
        self.wait_nats(Duration::from_secs(20))
    }

    fn wait_nats(&self, bound: Duration) -> Result<(), Error> {
        let Some(port) = self.nats_port else { return Ok(()) };
        if crate::wait_listening(port, bound) {
            return Ok(());
        }
        let log = self.member("nats").map(|m| m.log_tail(20)).unwrap_or_default();
        Err(Error::NatsNotListening { port, bound, log })
    }

    /// The NATS URL the daemons are given.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The `tenure` binary the members run.
    pub fn tenure(&self) -> &Path {
        &self.tenure
    }

    /// Machine `id`'s data directory (its worker's and sidecar's).
    pub fn machine_dir(&self, id: &str) -> PathBuf {
        machine_dir(&self.root, id)
    }

    /// Starts a `tenure` daemon as member `name`, with the credentials of its
    /// NATS user.
    pub fn spawn(&mut self, name: &str, args: DaemonArgs) -> Result<&mut Member, Error> {
        self.spawn_with(name, args, Vec::new())
    }

    /// Like [`Cluster::spawn`], with `env` for its first start only.
    pub fn spawn_with(
        &mut self,
        name: &str,
        args: DaemonArgs,
        env: Vec<(String, String)>,
    ) -> Result<&mut Member, Error> {
        let args = args.into_vec();
        let role = Role::of_tenure(&args);
        let tenure = self.tenure.clone();
        let mut member = self.member_of(name, role, &tenure, &args);
        let creds = nats_user(&args).and_then(|u| self.credentials.get(&u)).cloned().unwrap_or_default();
        for (k, v) in creds {
            member.set_env(&k, &v);
        }
        member.next_start_env(env);
        self.launch(member)
    }

    /// Starts a planned daemon of a [`Layout`].
    pub fn spawn_planned(&mut self, planned: &Planned) -> Result<&mut Member, Error> {
        self.spawn(&planned.name, planned.args.clone())
    }

    /// Starts another program (nats-server) as member `name`.
    pub fn spawn_program(
        &mut self,
        name: &str,
        role: Role,
        program: &Path,
        args: &[String],
    ) -> Result<&mut Member, Error> {
        let member = self.member_of(name, role, program, args);
        self.launch(member)
    }

    fn member_of(&self, name: &str, role: Role, program: &Path, args: &[String]) -> Member {
        let same = self.members.iter().filter(|m| m.name == name).count();
        let file = if same == 0 { format!("{name}.log") } else { format!("{name}-{}.log", same + 1) };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut process = Process::new(name, program, &args, &self.root.join("logs").join(file));
        for key in &self.env_remove {
            process = process.env_remove(key);
        }
        for (k, v) in &self.env {
            process.set_env(k, v);
        }
        if self.own_groups {
            process = process.own_process_group();
        }
        Member { name: name.to_owned(), role, process, started_at: None, down_until: None, next_env: Vec::new() }
    }

    fn launch(&mut self, mut member: Member) -> Result<&mut Member, Error> {
        member.start().map_err(io(format!("starting {}", member.name)))?;
        self.members.push(member);
        Ok(self.members.last_mut().expect("just pushed"))
    }

    /// The newest member called `name`.
    pub fn member(&self, name: &str) -> Option<&Member> {
        self.members.iter().rev().find(|m| m.name == name)
    }

    /// The newest member called `name`, or [`Error::NoMember`].
    pub fn member_mut(&mut self, name: &str) -> Result<&mut Member, Error> {
        self.members.iter_mut().rev().find(|m| m.name == name).ok_or_else(|| Error::NoMember(name.to_owned()))
    }

    /// Every member, in start order.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    pub fn members_mut(&mut self) -> &mut [Member] {
        &mut self.members
    }

    /// The running pid of the newest member called `name`.
    pub fn pid(&self, name: &str) -> Option<i32> {
        self.member(name).and_then(Member::pid)
    }

    /// Members that exited since the last call and are not down on purpose:
    /// each is started again by [`Cluster::supervise`] after `restart_after`.
    pub fn note_exits(&mut self, restart_after: Duration) -> Vec<(String, ExitStatus)> {
        let now = Instant::now();
        let mut exited = Vec::new();
        for m in self.members.iter_mut().filter(|m| m.down_until.is_none()) {
            if let Some(status) = m.try_exit() {
                m.down_until = Some(now + restart_after);
                exited.push((m.name.clone(), status));
            }
        }
        exited
    }

    /// Starts again, in start order, every member that is not running and
    /// whose down time is over; what was started (or could not be).
    pub fn supervise(&mut self) -> Vec<(String, std::io::Result<u32>)> {
        let now = Instant::now();
        let mut started = Vec::new();
        for m in &mut self.members {
            if !m.running() && m.down_until.is_none_or(|t| now >= t) {
                started.push((m.name.clone(), m.start()));
            }
        }
        started
    }

    /// Stops every member in reverse start order (SIGTERM and the stop
    /// grace, then SIGKILL); `on_stop` hears of each (its name, and whether
    /// it exited within the grace).
    pub fn stop_all(&mut self, mut on_stop: impl FnMut(&str, bool)) {
        let grace = self.stop_grace;
        for m in self.members.iter_mut().rev() {
            if !m.running() {
                m.kill9();
                continue;
            }
            m.stop(grace);
            let in_grace = !grace.is_zero() && m.try_exit().is_some_and(|s| s.signal() != Some(Signal::SIGKILL as i32));
            on_stop(&m.name, in_grace);
        }
    }

    /// The last `lines` lines of every member's log, for failure messages.
    pub fn logs_tail(&self, lines: usize) -> String {
        self.members.iter().map(|m| format!("---- {} ----\n{}\n", m.name, m.log_tail(lines))).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop_all(|_, _| {});
    }
}

/// Removes every (emptied) control group called `name` under `dir`, with
/// its attempt groups, looking `depth` levels down.
pub fn remove_groups_named(dir: &Path, name: &str, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if e.file_name() == name {
            for child in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                if child.file_type().is_ok_and(|t| t.is_dir()) {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
            let _ = std::fs::remove_dir(&path);
        } else if depth > 0 {
            remove_groups_named(&path, name, depth - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_plans_coordinators_then_each_machine_sidecar_first() {
        let mut layout = Layout::new(2, 2, 8);
        layout.coordinator_flags = vec!["--lease-ttl-ms".into(), "2000".into()];
        layout.worker_flags = vec!["--heartbeat-ms".into(), "300".into()];
        let url = |name: &str| format!("nats://{name}");
        let names: Vec<String> =
            layout.coordinators(url).into_iter().chain(layout.machines(Path::new("/r"), url)).map(|p| p.name).collect();
        assert_eq!(names, ["coordinator-c1", "coordinator-c2", "sidecar-w1", "worker-w1", "sidecar-w2", "worker-w2"]);
        let c2 = &layout.coordinators(url)[1];
        assert_eq!(
            c2.args.as_strs(),
            ["--nats", "nats://coordinator-c2", "coordinator", "--name", "c2", "--lease-ttl-ms", "2000"]
        );
        let w2 = &layout.machines(Path::new("/r"), url)[3];
        assert_eq!(
            w2.args.as_strs(),
            [
                "--nats",
                "nats://worker-w2",
                "worker",
                "--id",
                "w2",
                "--slots",
                "8",
                "--data-dir",
                "/r/workers/w2",
                "--heartbeat-ms",
                "300"
            ]
        );
        assert_eq!(Role::of_tenure(&w2.args.clone().into_vec()), Role::Worker);
    }

    fn sh(script: &str) -> DaemonArgs {
        DaemonArgs::from_vec(vec!["-c".into(), script.into()])
    }

    #[test]
    fn members_log_apart_restart_when_due_and_stop_in_reverse_order() {
        let d = tempfile::tempdir().unwrap();
        let mut c = Cluster::new(d.path(), Path::new("/bin/sh"), "nats://unused").unwrap();
        c.set_env("X", "x");
        c.spawn("a", sh("echo \"a $X\"; exec sleep 30")).unwrap();
        c.spawn("b", sh("echo b; exit 3")).unwrap();
        let b = c.member_mut("b").unwrap();
        assert!(b.wait_exit(Duration::from_secs(10)).is_some());
        // b exited by itself: noted once, started again only when due.
        let exited = c.note_exits(Duration::from_secs(3600));
        assert_eq!(exited.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["b"]);
        assert!(c.note_exits(Duration::ZERO).is_empty(), "noted once");
        assert!(c.supervise().is_empty(), "not due yet");
        c.member_mut("b").unwrap().release();
        let restarted = c.supervise();
        assert_eq!(restarted.len(), 1);
        assert_eq!(restarted[0].0, "b");
        // A held member stays down; one killed for no time comes back.
        let first_a = c.pid("a").unwrap();
        c.member_mut("a").unwrap().hold();
        assert!(c.pid("a").is_none());
        assert!(c.supervise().iter().all(|(n, _)| n != "a"));
        c.member_mut("a").unwrap().release();
        assert!(c.supervise().iter().any(|(n, _)| n == "a"));
        assert_ne!(c.pid("a"), Some(first_a));
        // A second member of the same name logs to a file of its own.
        c.spawn("a", sh("echo second; exec sleep 30")).unwrap();
        assert!(d.path().join("logs/a-2.log").is_file());
        let said = (0..500).find(|_| {
            std::thread::sleep(Duration::from_millis(20));
            c.member("a").unwrap().log_text().contains("second")
        });
        assert!(said.is_some());
        assert!(std::fs::read_to_string(d.path().join("logs/a.log")).unwrap().contains("a x"));
        assert!(c.member_mut("b").unwrap().wait_exit(Duration::from_secs(10)).is_some());
        let mut order = Vec::new();
        c.stop_all(|name, _| order.push(name.to_owned()));
        assert_eq!(order, ["a", "a"], "the running members, newest first");
        assert!(c.members_mut().iter_mut().all(|m| !m.running()));
        assert!(matches!(c.member_mut("nobody"), Err(Error::NoMember(_))));
    }

    #[test]
    fn a_daemon_runs_with_the_credentials_of_its_nats_user() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let fake = d.path().join("fake-tenure");
        std::fs::write(&fake, "#!/bin/sh\necho \"user=[$TENURE_NATS_USER] log=[$RUST_LOG]\"\n").unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut c = Cluster::new(d.path(), &fake, "nats://unused").unwrap();
        let env = vec![("TENURE_NATS_USER".to_owned(), "worker-w1".to_owned())];
        c.set_credentials([("worker-w1".to_owned(), env)].into_iter().collect());
        let layout = Layout::new(0, 1, 1);
        for planned in layout.machines(d.path(), |_| "nats://unused".into()) {
            c.spawn_planned(&planned).unwrap().wait_exit(Duration::from_secs(10));
        }
        assert_eq!(c.member("worker-w1").unwrap().role, Role::Worker);
        assert_eq!(c.member("worker-w1").unwrap().log_text().trim(), "user=[worker-w1] log=[info]");
        assert_eq!(
            c.member("sidecar-w1").unwrap().log_text().trim(),
            "user=[] log=[info]",
            "no credentials of its own"
        );
    }
}
