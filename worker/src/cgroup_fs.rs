//! The control-group files: finding the host's hierarchies and making the
//! worker's parent groups at its start ([`detect`]), and one attempt's
//! groups in its shim ([`AttemptGroup`]): made with the task's limits, joined
//! by the task's first process before it runs anything, killed whole, frozen
//! for a pause, waited empty, asked whether the memory limit ended a process,
//! and removed. What goes where is decided in [`crate::cgroup`]; this module
//! only reads and writes the files it is told.
//!
//! It never moves a process other than the task's own first one (which
//! joins in the child, before `exec`), and never removes a group that still
//! has processes (the kernel refuses that anyway).

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tenure_protocol::resources::ResourceLimits;
use tenure_protocol::WorkerId;

use crate::cgroup::{self, Plan};

/// Why control groups cannot be used, or why an attempt's group could not
/// be set up (the attempt then does not start).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No unified (v2) hierarchy is mounted, or this process is in none.
    #[error("no cgroup v2 (unified) hierarchy is mounted")]
    NoUnified,
    /// The kernel's unified hierarchy has no `cgroup.kill` (before Linux 5.14).
    #[error("the cgroup v2 hierarchy has no cgroup.kill (Linux 5.14 or later is needed)")]
    NoKill,
    #[error("{what} {path}: {error}")]
    Io { what: &'static str, path: PathBuf, error: std::io::Error },
    /// A limit was asked for that this worker's plan cannot enforce.
    #[error("the {0} limit cannot be enforced on this host")]
    Unenforced(&'static str),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |error| Error::Io { what, path: path.to_path_buf(), error }
}

/// Finds the hierarchies from `/proc/self/mounts` and `/proc/self/cgroup`,
/// tries the worker's parent groups ([`cgroup::parent_name`], under its own
/// group in each) and the controllers it can enable for the attempt groups.
/// Repeated at every start: the groups of attempts still running are kept.
pub fn detect(worker: &WorkerId, data_dir: &Path) -> Result<Plan, Error> {
    let read = |p: &str| std::fs::read_to_string(p).map_err(io("cannot read", Path::new(p)));
    let mounts = cgroup::parse_mounts(&read("/proc/self/mounts")?);
    let member = cgroup::parse_membership(&read("/proc/self/cgroup")?);
    let (Some(mount), Some(own)) = (mounts.unified.as_deref(), member.unified.as_deref()) else {
        return Err(Error::NoUnified);
    };
    let own = cgroup::join(mount, own);
    let name = cgroup::parent_name(worker, data_dir);
    let parent = own.join(&name);
    make_dir(&parent)?;
    if !parent.join("cgroup.kill").exists() {
        return Err(Error::NoKill);
    }
    // A controller is enabled for the parent's children only if the
    // worker's own group can pass it down (it cannot while it has processes
    // of its own, unless it is the root): what fails is sought in v1.
    let available = std::fs::read_to_string(own.join("cgroup.controllers")).unwrap_or_default();
    let mut plan = Plan { unified: parent.clone(), ..Plan::default() };
    for controller in cgroup::controllers(&available) {
        let enable = format!("+{controller}");
        let ok = write(&own.join("cgroup.subtree_control"), &enable)
            .and_then(|()| write(&parent.join("cgroup.subtree_control"), &enable));
        match ok {
            Ok(()) => plan.v2.push(controller),
            Err(error) => tracing::debug!(%controller, %error, "controller not enabled in cgroup v2"),
        }
    }
    for controller in cgroup::CONTROLLERS {
        if plan.v2.iter().any(|c| c == controller) {
            continue;
        }
        let (Some(mount), Some(own)) = (mounts.v1.get(controller), member.v1.get(controller)) else { continue };
        let dir = cgroup::join(mount, own).join(&name);
        match make_dir(&dir) {
            Ok(()) => {
                plan.v1.insert(controller.to_owned(), dir);
            }
            Err(error) => tracing::debug!(%controller, %error, "controller not usable in cgroup v1"),
        }
    }
    // Made to find out what works; an attempt makes them again when it
    // needs them, so none is left empty behind a worker that was killed.
    remove_parents(&plan);
    Ok(plan)
}

/// Removes the worker's parent groups when no attempt group is left in
/// them (the kernel refuses to remove one that has groups left: tasks that
/// outlive the worker keep theirs). The worker calls it when it stops, a
/// shim when it exits.
pub fn remove_parents(plan: &Plan) {
    for dir in std::iter::once(&plan.unified).chain(plan.v1.values()) {
        if let Err(error) = std::fs::remove_dir(dir) {
            tracing::debug!(dir = %dir.display(), %error, "worker cgroup kept");
        }
    }
}

/// Makes an attempt's group, and its worker's parent group first when it
/// is missing (`prepare` sets the parent up). A parent removed between the
/// two by another attempt's end is made again.
fn make_child(dir: &Path, prepare: impl Fn() -> Result<(), Error>) -> Result<(), Error> {
    let parent = dir.parent().unwrap_or(dir);
    for _ in 0..3 {
        match std::fs::create_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
            // No parent (yet, or any more): made and set up, then the child again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                make_dir(parent)?;
                prepare()?;
            }
            Err(e) => return Err(io("cannot create", dir)(e)),
        }
    }
    Err(Error::Io { what: "cannot create", path: dir.to_path_buf(), error: std::io::ErrorKind::NotFound.into() })
}

fn make_dir(dir: &Path) -> Result<(), Error> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io("cannot create", dir)(e)),
    }
}

fn write(path: &Path, value: &str) -> Result<(), Error> {
    let mut file = OpenOptions::new().write(true).open(path).map_err(io("cannot open", path))?;
    file.write_all(value.as_bytes()).map_err(io("cannot write", path))
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// One attempt's groups: its group in the unified hierarchy (tracking, and
/// the limits enforced there) and one per v1 controller it needs.
#[derive(Debug)]
pub struct AttemptGroup {
    unified: PathBuf,
    /// The v1 groups, by controller.
    v1: Vec<(&'static str, PathBuf)>,
    /// The memory limit is enforced in v2 (`None`: none is set).
    memory_v2: Option<bool>,
}

impl AttemptGroup {
    /// The groups an attempt named `name` has (or had) under `plan`: found
    /// again by their name, as a restarted shim or worker does.
    pub fn find(plan: &Plan, name: &str, limits: Option<&ResourceLimits>) -> AttemptGroup {
        let mut v1 = Vec::new();
        let set = |c: &str| match (c, limits) {
            ("memory", Some(l)) => l.memory_bytes.is_some(),
            ("cpu", Some(l)) => l.cpu_millis.is_some(),
            ("pids", Some(l)) => l.pids.is_some(),
            _ => false,
        };
        for controller in cgroup::CONTROLLERS {
            if let (true, Some(parent)) = (set(controller), plan.v1.get(controller)) {
                v1.push((controller, parent.join(name)));
            }
        }
        let memory_v2 = set("memory").then(|| plan.enforces("memory") == Some(true));
        AttemptGroup { unified: plan.unified.join(name), v1, memory_v2 }
    }

    /// Makes the attempt's groups and sets its limits. A group left by an
    /// earlier try is reused. Fails when a limit cannot be set: the task
    /// must not run without it.
    pub fn create(plan: &Plan, name: &str, limits: Option<&ResourceLimits>) -> Result<AttemptGroup, Error> {
        let group = AttemptGroup::find(plan, name, limits);
        // The worker's parent groups are made again when the last attempt of
        // a stopped worker removed them (see `remove`).
        make_child(&group.unified, || {
            for controller in &plan.v2 {
                write(&plan.unified.join("cgroup.subtree_control"), &format!("+{controller}"))?;
            }
            Ok(())
        })?;
        for (_, dir) in &group.v1 {
            make_child(dir, || Ok(()))?;
        }
        let Some(limits) = limits else { return Ok(group) };
        let at = |controller: &'static str| -> Result<(bool, PathBuf), Error> {
            match plan.enforces(controller) {
                Some(true) => Ok((true, group.unified.clone())),
                Some(false) => group
                    .v1
                    .iter()
                    .find(|(c, _)| *c == controller)
                    .map(|(_, d)| (false, d.clone()))
                    .ok_or(Error::Unenforced(controller)),
                None => Err(Error::Unenforced(controller)),
            }
        };
        if let Some(bytes) = limits.memory_bytes {
            let (v2, dir) = at("memory")?;
            let (limit, swap) = if v2 { ("memory.max", "memory.swap.max") } else { ("memory.limit_in_bytes", "") };
            write(&dir.join(limit), &bytes.to_string())?;
            // No swapping past the limit where the host has swap: the limit
            // is what the task may use. Absent without swap accounting.
            if v2 && dir.join(swap).exists() {
                write(&dir.join(swap), "0")?;
            } else if !v2 && dir.join("memory.memsw.limit_in_bytes").exists() {
                write(&dir.join("memory.memsw.limit_in_bytes"), &bytes.to_string())?;
            }
        }
        if let Some(millis) = limits.cpu_millis {
            let (v2, dir) = at("cpu")?;
            if v2 {
                write(&dir.join("cpu.max"), &cgroup::cpu_max(millis))?;
            } else {
                let (quota, period) = cgroup::cpu_quota(millis);
                write(&dir.join("cpu.cfs_period_us"), &period.to_string())?;
                write(&dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        if let Some(pids) = limits.pids {
            let (_, dir) = at("pids")?;
            write(&dir.join("pids.max"), &pids.to_string())?;
        }
        group.lock_down();
        Ok(group)
    }

    /// The groups' files are the worker's: nobody else may write them
    /// (a task run as another user cannot move itself out or lift a limit).
    fn lock_down(&self) {
        for dir in self.dirs() {
            let Ok(entries) = std::fs::read_dir(dir) else { continue };
            for entry in entries.flatten() {
                let Ok(meta) = entry.metadata() else { continue };
                let mode = meta.permissions().mode();
                if mode & 0o022 != 0 {
                    let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(mode & !0o022));
                }
            }
        }
    }

    fn dirs(&self) -> impl Iterator<Item = &Path> {
        std::iter::once(self.unified.as_path()).chain(self.v1.iter().map(|(_, d)| d.as_path()))
    }

    /// The unified group's directory.
    pub fn path(&self) -> &Path {
        &self.unified
    }

    /// What the task's first process is started with: the unified group's
    /// directory, which it is made inside (or joins first thing, see
    /// [`crate::process::spawn`]), and each v1 group's `cgroup.procs`, open
    /// for writing, to which it writes `0` (in the child, before `exec`: a
    /// plain `write`, async-signal-safe) to join them.
    pub fn open_for_task(&self) -> Result<(OwnedFd, Vec<OwnedFd>), Error> {
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_CLOEXEC)
            .open(&self.unified)
            .map(OwnedFd::from)
            .map_err(io("cannot open", &self.unified))?;
        let procs = self
            .v1
            .iter()
            .map(|(_, dir)| {
                let path = dir.join("cgroup.procs");
                OpenOptions::new()
                    .write(true)
                    .custom_flags(nix::libc::O_CLOEXEC)
                    .open(&path)
                    .map(OwnedFd::from)
                    .map_err(io("cannot open", &path))
            })
            .collect::<Result<_, _>>()?;
        Ok((dir, procs))
    }

    /// Every process in the group, from `cgroup.procs`.
    pub fn pids(&self) -> Vec<i32> {
        read(&self.unified.join("cgroup.procs"))
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// SIGKILL to every process in the group, wherever its session or
    /// process group is (`cgroup.kill`; frozen ones too).
    pub fn kill(&self) {
        if let Err(error) = write(&self.unified.join("cgroup.kill"), "1") {
            tracing::warn!(%error, "cannot kill the task's cgroup");
        }
    }

    /// Freezes or thaws every process of the group (`cgroup.freeze`).
    pub fn freeze(&self, frozen: bool) {
        if let Err(error) = write(&self.unified.join("cgroup.freeze"), if frozen { "1" } else { "0" }) {
            tracing::warn!(%error, frozen, "cannot freeze or thaw the task's cgroup");
        }
    }

    /// Some process is still in the group. A group that cannot be read (it
    /// is gone) has none.
    pub fn populated(&self) -> bool {
        read(&self.unified.join("cgroup.events")).is_some_and(|t| cgroup::keyed(&t, "populated") != Some(0))
    }

    /// The kernel ended a process of the group at its memory limit.
    pub fn oom_killed(&self) -> bool {
        let count = match self.memory_v2 {
            None => return false,
            Some(true) => read(&self.unified.join("memory.events")).and_then(|t| cgroup::keyed(&t, "oom_kill")),
            Some(false) => self
                .v1
                .iter()
                .find(|(c, _)| *c == "memory")
                .and_then(|(_, d)| read(&d.join("memory.oom_control")))
                .and_then(|t| cgroup::keyed(&t, "oom_kill")),
        };
        count.is_some_and(|n| n > 0)
    }

    /// Removes the groups once they are empty; a group already gone is no
    /// error. Returns the groups left behind, with why. The worker's parent
    /// groups stay for the next attempt: the worker removes them when it
    /// stops, and a shim when it exits ([`remove_parents`]), so a worker
    /// that stopped or died leaves nothing behind once its tasks end.
    pub fn remove(&self) -> Vec<String> {
        let mut left = Vec::new();
        for dir in self.dirs() {
            match std::fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => left.push(format!("{}: {e}", dir.display())),
            }
        }
        left
    }
}
