//! The cluster under test: the one local-cluster harness
//! ([`tenure_launch::cluster`]) — a real nats-server, coordinators, and
//! workers with their sidecars, the real `tenure` binary — with each node
//! reaching NATS through its own fault-injecting proxy, and the faults the
//! schedule names (power-loss disks, wiped machines, duplicate workers,
//! registry swaps). Every process is started by the harness, signalled by its
//! own pid, and stopped by it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tenure_machine::attempt_files;

use tenure_launch::cluster::{Cluster as Harness, Layout, Member};
use tenure_launch::daemon::machine_dir;
use tenure_launch::process::Process;

use crate::power::{self, Disk};
use crate::proxy::{Mode, Proxy};
use crate::schedule::Link;

/// A second worker process with another's id, and its data directory.
pub struct Duplicate {
    process: Process,
    data: PathBuf,
}

impl Duplicate {
    pub fn pid(&self) -> Option<i32> {
        self.process.pid()
    }

    /// Stops it and whatever it may have started (it should have started
    /// nothing: the leader never binds a live worker's id to it).
    pub fn stop(&mut self) {
        self.process.kill9();
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
    for (_, files) in attempt_files::list(&dir.join("attempts")) {
        if let Some(shim) = files.shim().filter(|m| m.alive()) {
            out.push((shim.pid, files.pgid()));
        }
    }
    out
}

pub struct Cluster {
    /// The one local-cluster harness: nats-server (member `nats`),
    /// `coordinator-cN`, `sidecar-wN`, `worker-wN`.
    harness: Harness,
    pub dir: PathBuf,
    pub nats_port: u16,
    coordinators: usize,
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
        let mut harness = Harness::new(dir, bin, "")?;
        // JetStream with `sync_interval: always`, as the shipped configurations:
        // an acknowledged write survives the nats-server SIGKILLs of the run.
        harness.start_nats(nats_bin, tenure_launch::nats::Config::new(nats_port, dir.join("nats")), "")?;
        // Each node reaches NATS through its own proxy: the URL hook of the
        // harness's layout.
        let mut links = std::collections::HashMap::new();
        let members = (1..=coordinators)
            .map(|i| format!("coordinator-c{i}"))
            .chain((1..=workers).flat_map(|i| [format!("sidecar-w{i}"), format!("worker-w{i}")]));
        for name in members {
            links.insert(name, Proxy::start(nats_port).await?);
        }
        let url = |name: &str| links.get(name).map(|p| format!("nats://127.0.0.1:{}", p.port)).unwrap_or_default();
        let flags = |f: &[&str]| f.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let window = DUPLICATE_WINDOW.as_millis().to_string();
        let mut worker_flags = flags(&["--heartbeat-ms", "300", "--kill-grace-ms", "1000"]);
        worker_flags.extend(run_as.map(|user| ["--run-as".to_owned(), user.to_owned()]).into_iter().flatten());
        let layout = Layout {
            coordinator_flags: flags(&[
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
            ]),
            worker_flags,
            ..Layout::new(coordinators as u32, workers as u32, SLOTS)
        };
        for planned in layout.coordinators(url).iter().chain(&layout.machines(dir, url)) {
            harness.spawn_planned(planned)?;
        }
        let mut take = |prefix: &str, n: usize| -> Vec<Proxy> {
            (1..=n).filter_map(|i| links.remove(&format!("{prefix}{i}"))).collect()
        };
        Ok(Cluster {
            coordinator_links: take("coordinator-c", coordinators),
            sidecar_links: take("sidecar-w", workers),
            worker_links: take("worker-w", workers),
            harness,
            dir: dir.to_path_buf(),
            nats_port,
            coordinators,
            nats_disk,
            disks,
        })
    }

    /// How many coordinators the cluster has.
    pub fn coordinator_count(&self) -> usize {
        self.coordinators
    }

    /// Coordinator `i` (from 0).
    pub fn coordinator(&mut self, i: usize) -> &mut Member {
        self.member(&format!("coordinator-c{}", i + 1))
    }

    /// The worker process of machine `i` (from 0).
    pub fn worker(&mut self, i: usize) -> &mut Member {
        self.member(&format!("worker-w{}", i + 1))
    }

    /// The sidecar of machine `i` (from 0).
    pub fn sidecar(&mut self, i: usize) -> &mut Member {
        self.member(&format!("sidecar-w{}", i + 1))
    }

    fn member(&mut self, name: &str) -> &mut Member {
        // Every name asked for is one the layout started.
        self.harness.member_mut(name).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.nats_port)
    }

    pub fn worker_dir(&self, i: usize) -> PathBuf {
        machine_dir(&self.dir, &format!("w{}", i + 1))
    }

    /// Starts every node that is down and due, nats-server first.
    pub fn supervise(&mut self) -> anyhow::Result<()> {
        for (name, started) in self.harness.supervise() {
            started.map_err(|e| anyhow::anyhow!("starting {name} again: {e}"))?;
        }
        Ok(())
    }

    pub fn kill_nats(&mut self, down: Duration) {
        self.member("nats").kill_for(down);
    }

    pub fn nats_pid(&self) -> Option<i32> {
        self.harness.pid("nats")
    }

    /// SIGTERMs nats-server (it flushes its store) and waits for it to exit;
    /// it stays down until [`Cluster::start_nats`].
    fn stop_nats(&mut self) {
        let nats = self.member("nats");
        nats.signal(Signal::SIGTERM);
        nats.wait_exit(Duration::from_secs(20));
        nats.hold();
    }

    /// Starts nats-server again and waits until it listens.
    async fn start_nats(&mut self) -> anyhow::Result<()> {
        self.member("nats").release();
        Ok(self.harness.restart_nats()?)
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
        for i in 0..self.coordinators {
            self.coordinator(i).hold();
        }
    }

    /// Lets the supervisor start the coordinators again.
    pub fn release_coordinators(&mut self) -> anyhow::Result<()> {
        for i in 0..self.coordinators {
            self.coordinator(i).release();
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
        let w = self.worker(i);
        w.kill9();
        w.next_start_env(vec![("TENURE_CRASH_AT".into(), point.into())]);
    }

    /// Restarts coordinator `i` at once with its wall clock `offset_ms` off
    /// (the test-only `TENURE_TEST_CLOCK_OFFSET_MS`), until its next restart.
    pub fn skew_coordinator(&mut self, i: usize, offset_ms: i64) {
        let c = self.coordinator(i);
        c.kill9();
        c.next_start_env(vec![("TENURE_TEST_CLOCK_OFFSET_MS".into(), offset_ms.to_string())]);
    }

    /// Live shims on machine `i`, with their task's process group.
    pub fn shims(&self, i: usize) -> Vec<(i32, Option<i32>)> {
        shims_in(&self.worker_dir(i))
    }

    /// The shim launcher of machine `i`'s worker: its child running
    /// `shim-launcher`.
    pub fn launcher(&self, i: usize) -> Option<i32> {
        let worker = self.harness.pid(&format!("worker-w{}", i + 1))?;
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
        self.kill_nats(down);
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
        let data = self.dir.join("duplicates").join(format!("w{}-{serial}", i + 1));
        let log_dir = self.dir.join("logs");
        let real = self.worker(i).process();
        let mut args: Vec<String> = real.args().to_vec();
        if let Some(at) = args.iter().position(|a| a == "--data-dir") {
            args[at + 1] = data.display().to_string();
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let name = format!("duplicate-w{}-{serial}", i + 1);
        let log = log_dir.join(format!("{name}.log"));
        let mut process = Process::new(&name, real.program(), &args, &log).env("RUST_LOG", "info");
        process.start()?;
        Ok(Duplicate { process, data })
    }

    /// A machine crash: the worker, the sidecar, every shim and task group;
    /// the machine boots again (a new boot id) after `down`.
    pub fn kill_machine(&mut self, i: usize, down: Duration) {
        let boot = uuid::Uuid::new_v4().to_string();
        for name in [format!("worker-w{}", i + 1), format!("sidecar-w{}", i + 1)] {
            let member = self.member(&name);
            member.kill_for(down);
            member.set_env("TENURE_TEST_BOOT_ID", &boot);
        }
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
        for m in self.harness.members_mut() {
            m.signal(Signal::SIGCONT);
            m.release();
            m.next_start_env(Vec::new());
        }
        self.supervise()
    }

    /// Stops every process this cluster started (SIGKILL, newest first),
    /// then removes its machines' emptied control groups, as a reboot
    /// would: a machine the run crashed or wiped leaves its attempts' groups
    /// behind (a wiped store no longer names them).
    pub fn stop(&mut self) {
        self.harness.stop_all(|_, _| {});
        for i in 0..self.worker_links.len() {
            let Ok(id) = format!("w{}", i + 1).parse::<tenure_protocol::WorkerId>() else { continue };
            let dir = self.worker_dir(i);
            for data_dir in [dir.clone(), dir.canonicalize().unwrap_or(dir)] {
                let name = tenure_machine::layout::cgroup_parent_name(&id, &data_dir);
                tenure_launch::cluster::remove_groups_named(Path::new("/sys/fs/cgroup"), &name, 5);
            }
        }
    }
}
