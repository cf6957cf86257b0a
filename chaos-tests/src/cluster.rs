//! The cluster under test: a real nats-server, coordinators, and workers with
//! their sidecars — the real `tenure` binary — each node reaching NATS through
//! its own fault-injecting proxy. Every process is started here, signalled by
//! its own pid, and stopped here.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::bail;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tenure_machine::attempt_files::AttemptFiles;

use tenure_launch::daemon::{machine_dir, DaemonArgs};
use tenure_launch::process::Process;

use crate::power::{self, Disk};
use crate::proxy::{Mode, Proxy};
use crate::schedule::Link;

/// One supervised process: restarted by [`Cluster::supervise`] whenever it is
/// not running and its down time is over.
pub struct Node {
    pub name: String,
    process: Process,
    down_until: Option<Instant>,
    /// Environment for the next start only (a crash-window hook).
    next_env: Vec<(String, String)>,
}

impl Node {
    fn new(name: &str, program: &Path, args: &[&str], logs: &Path) -> Node {
        let process = Process::new(name, program, args, &logs.join(format!("{name}.log"))).env("RUST_LOG", "info");
        Node { name: name.into(), process, down_until: None, next_env: Vec::new() }
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let once = std::mem::take(&mut self.next_env);
        self.process.start_with(&once)?;
        Ok(())
    }

    pub fn pid(&self) -> Option<i32> {
        self.process.pid()
    }

    fn running(&mut self) -> bool {
        self.process.running()
    }

    /// SIGKILL now; restarted after `down`.
    pub fn kill9(&mut self, down: Duration) {
        self.process.kill9();
        self.down_until = Some(Instant::now() + down);
    }

    pub fn signal(&mut self, sig: Signal) {
        self.process.signal(sig);
    }

    fn stop(&mut self) {
        self.process.signal(Signal::SIGCONT);
        self.process.kill9();
    }
}

/// A second worker process with another's id, and its data directory.
pub struct Duplicate {
    node: Node,
    data: PathBuf,
}

impl Duplicate {
    pub fn pid(&self) -> Option<i32> {
        self.node.pid()
    }

    /// Stops it and whatever it may have started (it should have started
    /// nothing: the leader never binds a live worker's id to it).
    pub fn stop(&mut self) {
        self.node.stop();
        for (shim, pgid) in shims_in(&self.data) {
            let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
            if let Some(g) = pgid.filter(|g| *g > 1) {
                let _ = killpg(Pid::from_raw(g), Signal::SIGKILL);
            }
        }
    }
}

/// Live shims under the data directory `dir`, with their task's process group.
fn shims_in(dir: &Path) -> Vec<(i32, Option<i32>)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir.join("attempts")) else { return out };
    for e in entries.flatten() {
        let files = AttemptFiles::new(e.path());
        if let Some(shim) = files.shim().filter(|m| m.alive()) {
            out.push((shim.pid, files.pgid()));
        }
    }
    out
}

pub struct Cluster {
    pub dir: PathBuf,
    pub nats_port: u16,
    nats: Node,
    pub coordinators: Vec<Node>,
    pub workers: Vec<Node>,
    pub sidecars: Vec<Node>,
    coordinator_links: Vec<Proxy>,
    worker_links: Vec<Proxy>,
    sidecar_links: Vec<Proxy>,
    /// nats-server's store, when on a power-loss filesystem.
    nats_disk: Option<Disk>,
    /// Each worker machine's data directory, when on power-loss filesystems.
    disks: Vec<Disk>,
}

/// Tasks each worker runs at once.
pub const SLOTS: u32 = 4;

/// The registry's duplicate window in the chaos cluster (shortened from 2 min).
pub const DUPLICATE_WINDOW: Duration = Duration::from_millis(1000);

/// Copies a directory tree (regular files and directories only).
fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            copy_dir(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

impl Cluster {
    pub async fn start(
        bin: &Path,
        nats_bin: &Path,
        dir: &Path,
        coordinators: usize,
        workers: usize,
        run_as: Option<&str>,
        power: &power::Mode,
    ) -> anyhow::Result<Cluster> {
        let logs = dir.join("logs");
        let disk = |name: &str, at: PathBuf, journaled| match power {
            power::Mode::On(bin) => Disk::mount(bin, &dir.join("disks").join(name), &at, journaled).map(Some),
            power::Mode::Off(_) => Ok(None),
        };
        // nats-server relies on ext4-like metadata journaling (it does not
        // sync the directories of the files it creates: under strict POSIX
        // rules a power cut loses acknowledged writes even with
        // `sync_interval: always`; see durability.md). tenure's own machines
        // are held to the strict rules.
        let nats_disk = disk("nats", dir.join("nats"), true)?;
        let mut disks = Vec::new();
        for i in 1..=workers {
            disks.extend(disk(&format!("w{i}"), machine_dir(dir, &format!("w{i}")), false)?);
        }
        std::fs::create_dir_all(&logs)?;
        // The run's directory may be passable for the tasks' user; the logs are not theirs.
        std::fs::set_permissions(&logs, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        let nats_port = tenure_launch::free_port()?;
        // JetStream with `sync_interval: always`, as the shipped configurations:
        // an acknowledged write survives the nats-server SIGKILLs of the run.
        let conf = dir.join("nats.conf");
        tenure_launch::nats::Config::new(nats_port, dir.join("nats")).write(&conf)?;
        let conf = conf.display().to_string();
        let mut nats = Node::new("nats", nats_bin, &["-c", &conf], &logs);
        nats.start()?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", nats_port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server did not start");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let url = |p: &Proxy| format!("nats://127.0.0.1:{}", p.port);
        let mut c = Cluster {
            dir: dir.to_path_buf(),
            nats_port,
            nats,
            coordinators: Vec::new(),
            workers: Vec::new(),
            sidecars: Vec::new(),
            coordinator_links: Vec::new(),
            worker_links: Vec::new(),
            sidecar_links: Vec::new(),
            nats_disk,
            disks,
        };
        // Each node reaches NATS through its own proxy: the URL hook of the
        // daemons' command lines.
        let window = DUPLICATE_WINDOW.as_millis().to_string();
        for i in 1..=coordinators {
            let p = Proxy::start(nats_port).await?;
            let args = DaemonArgs::coordinator(&url(&p), &format!("c{i}")).flags(&[
                "--worker-ttl-ms",
                "3000",
                "--lease-ttl-ms",
                "2000",
                "--renew-interval-ms",
                "400",
                "--renew-deadline-ms",
                "1200",
                // Short, so that `nats-restart` can outwait it.
                "--registry-duplicate-window-ms",
                &window,
            ]);
            c.coordinators.push(Node::new(&format!("c{i}"), bin, &args.as_strs(), &logs));
            c.coordinator_links.push(p);
        }
        for i in 1..=workers {
            let id = format!("w{i}");
            let data = machine_dir(dir, &id);
            let ps = Proxy::start(nats_port).await?;
            let args = DaemonArgs::sidecar(&url(&ps), &id, &data);
            c.sidecars.push(Node::new(&format!("sidecar-{id}"), bin, &args.as_strs(), &logs));
            c.sidecar_links.push(ps);
            let pw = Proxy::start(nats_port).await?;
            let mut args = DaemonArgs::worker(&url(&pw), &id, SLOTS, &data).flags(&[
                "--heartbeat-ms",
                "300",
                "--kill-grace-ms",
                "1000",
            ]);
            if let Some(user) = run_as {
                args = args.flags(&["--run-as", user]);
            }
            c.workers.push(Node::new(&format!("worker-{id}"), bin, &args.as_strs(), &logs));
            c.worker_links.push(pw);
        }
        c.supervise()?;
        Ok(c)
    }

    pub fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.nats_port)
    }

    pub fn worker_dir(&self, i: usize) -> PathBuf {
        machine_dir(&self.dir, &format!("w{}", i + 1))
    }

    /// Starts every node that is down and due, nats-server first.
    pub fn supervise(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        let nodes = std::iter::once(&mut self.nats)
            .chain(self.coordinators.iter_mut())
            .chain(self.sidecars.iter_mut())
            .chain(self.workers.iter_mut());
        for n in nodes {
            if !n.running() && n.down_until.is_none_or(|t| now >= t) {
                n.start()?;
            }
        }
        Ok(())
    }

    pub fn kill_nats(&mut self, down: Duration) {
        self.nats.kill9(down);
    }

    pub fn nats_pid(&self) -> Option<i32> {
        self.nats.pid()
    }

    /// SIGTERMs nats-server (it flushes its store) and waits for it to exit;
    /// it stays down until [`Cluster::start_nats`].
    fn stop_nats(&mut self) {
        if let Some(pid) = self.nats.pid() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        self.nats.process.wait_exit(Duration::from_secs(20));
        self.nats.kill9(Duration::from_secs(24 * 3600));
    }

    /// Starts nats-server again and waits until it listens.
    async fn start_nats(&mut self) -> anyhow::Result<()> {
        self.nats.down_until = None;
        if !self.nats.running() {
            self.nats.start()?;
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.nats_port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server did not start again");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The registry stream's directory in nats-server's store.
    fn registry_dir(&self) -> anyhow::Result<PathBuf> {
        let streams = self.dir.join("nats").join("jetstream").join("$G").join("streams");
        let dir = streams.join(tenure_protocol::subjects::REGISTRY_STREAM);
        anyhow::ensure!(dir.is_dir(), "no registry stream in {}", streams.display());
        Ok(dir)
    }

    /// Copies the registry stream's files to `to`, nats-server stopped for
    /// the copy (so the files are whole) and started again.
    pub async fn snapshot_registry(&mut self, to: &Path) -> anyhow::Result<()> {
        self.stop_nats();
        let copied = self.registry_dir().and_then(|dir| copy_dir(&dir, to));
        self.start_nats().await?;
        copied
    }

    /// Puts the registry files of `from` in place of the current ones, which
    /// are moved to `keep`; nats-server is stopped meanwhile.
    pub async fn swap_registry(&mut self, from: &Path, keep: &Path) -> anyhow::Result<()> {
        self.stop_nats();
        // Copied, not renamed: the store may be a mount of its own. Synced
        // as an operator's restore would be, so that a later power cut of
        // the store does not undo the harness's work.
        let swapped = self.registry_dir().and_then(|dir| {
            copy_dir(&dir, keep)?;
            std::fs::remove_dir_all(&dir)?;
            copy_dir(from, &dir)?;
            Ok(power::sync_tree(&dir)?)
        });
        self.start_nats().await?;
        swapped
    }

    /// Stops every coordinator until [`Cluster::release_coordinators`].
    pub fn hold_coordinators(&mut self) {
        for c in &mut self.coordinators {
            c.kill9(Duration::from_secs(24 * 3600));
        }
    }

    /// Lets the supervisor start the coordinators again.
    pub fn release_coordinators(&mut self) -> anyhow::Result<()> {
        for c in &mut self.coordinators {
            c.down_until = None;
        }
        self.supervise()
    }

    pub fn link(&self, link: Link) -> &Proxy {
        match link {
            Link::Coordinator(i) => &self.coordinator_links[i],
            Link::Worker(i) => &self.worker_links[i],
            Link::Sidecar(i) => &self.sidecar_links[i],
        }
    }

    /// Restarts worker `i` so that it crashes at `point` of its next attempt.
    pub fn crash_worker_at(&mut self, i: usize, point: &str) {
        let w = &mut self.workers[i];
        w.kill9(Duration::ZERO);
        w.next_env = vec![("TENURE_CRASH_AT".into(), point.into())];
    }

    /// Restarts coordinator `i` at once with its wall clock `offset_ms` off
    /// (the test-only `TENURE_TEST_CLOCK_OFFSET_MS`), until its next restart.
    pub fn skew_coordinator(&mut self, i: usize, offset_ms: i64) {
        let c = &mut self.coordinators[i];
        c.kill9(Duration::ZERO);
        c.next_env = vec![("TENURE_TEST_CLOCK_OFFSET_MS".into(), offset_ms.to_string())];
    }

    /// Live shims on machine `i`, with their task's process group.
    pub fn shims(&self, i: usize) -> Vec<(i32, Option<i32>)> {
        shims_in(&self.worker_dir(i))
    }

    /// The shim launcher of machine `i`'s worker: its child running
    /// `shim-launcher`.
    pub fn launcher(&self, i: usize) -> Option<i32> {
        let worker = self.workers[i].pid()?;
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let ppid: i32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            (ppid == worker && cmdline.split(|b| *b == 0).any(|a| a == b"shim-launcher")).then_some(pid)
        })
    }

    /// A machine crash, and its data directory deleted before it comes back
    /// under the same id (a disk swap, a re-provisioned host).
    pub fn wipe_machine(&mut self, i: usize, down: Duration) -> std::io::Result<()> {
        self.kill_machine(i, down);
        power::wipe(&self.worker_dir(i))
    }

    /// Whether disks can lose power in this run.
    pub fn has_disks(&self) -> bool {
        self.nats_disk.is_some()
    }

    /// A power loss of machine `i`: every process of it killed, its data
    /// directory back to what was synced; it boots again after `down`.
    pub fn power_loss_machine(&mut self, i: usize, down: Duration) -> anyhow::Result<()> {
        self.kill_machine(i, down);
        match self.disks.get_mut(i) {
            Some(disk) => disk.power_cycle(),
            None => bail!("machine w{} has no power-loss disk", i + 1),
        }
    }

    /// A power loss of the NATS node: nats-server killed, its store back to
    /// what was synced; it boots again after `down`.
    pub fn power_loss_nats(&mut self, down: Duration) -> anyhow::Result<()> {
        self.nats.kill9(down);
        match self.nats_disk.as_mut() {
            Some(disk) => disk.power_cycle(),
            None => bail!("the NATS node has no power-loss disk"),
        }
    }

    /// Starts a second worker process with worker `i`'s id on a data
    /// directory of its own (as the same id configured on another host),
    /// through the same link and with the same flags; stop it with
    /// [`Duplicate::stop`].
    pub fn duplicate_worker(&mut self, i: usize, serial: usize) -> anyhow::Result<Duplicate> {
        let real = &self.workers[i];
        let data = self.dir.join("duplicates").join(format!("w{}-{serial}", i + 1));
        let mut args: Vec<String> = real.process.args().to_vec();
        if let Some(at) = args.iter().position(|a| a == "--data-dir") {
            args[at + 1] = data.display().to_string();
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let logs = self.dir.join("logs");
        let mut node = Node::new(&format!("duplicate-w{}-{serial}", i + 1), real.process.program(), &args, &logs);
        node.start()?;
        Ok(Duplicate { node, data })
    }

    /// A machine crash: the worker, the sidecar, every shim and task group;
    /// the machine boots again (a new boot id) after `down`.
    pub fn kill_machine(&mut self, i: usize, down: Duration) {
        self.workers[i].kill9(down);
        self.sidecars[i].kill9(down);
        let boot = uuid::Uuid::new_v4().to_string();
        self.workers[i].process.set_env("TENURE_TEST_BOOT_ID", &boot);
        self.sidecars[i].process.set_env("TENURE_TEST_BOOT_ID", &boot);
        for (shim, pgid) in self.shims(i) {
            let _ = kill(Pid::from_raw(shim), Signal::SIGKILL);
            if let Some(g) = pgid.filter(|g| *g > 1) {
                let _ = killpg(Pid::from_raw(g), Signal::SIGKILL);
            }
        }
    }

    /// Ends every fault: links pass, paused processes continue, nodes restart.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        for p in self.coordinator_links.iter().chain(&self.worker_links).chain(&self.sidecar_links) {
            p.set(Mode::Pass);
        }
        for n in self
            .coordinators
            .iter_mut()
            .chain(self.sidecars.iter_mut())
            .chain(self.workers.iter_mut())
            .chain(std::iter::once(&mut self.nats))
        {
            n.signal(Signal::SIGCONT);
            n.down_until = None;
            n.next_env.clear();
        }
        self.supervise()
    }

    /// Stops every process this cluster started.
    pub fn stop(&mut self) {
        for n in self.workers.iter_mut().chain(self.sidecars.iter_mut()).chain(self.coordinators.iter_mut()) {
            n.stop();
        }
        self.nats.stop();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}
