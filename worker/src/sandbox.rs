//! What a task gets from its machine, and nothing more: its environment, its
//! working directory, and the user it runs as.
//!
//! A task is the least trusted party on the machine (design rule 8). It starts
//! with a cleared environment — a default `PATH`, `HOME`, `LANG`, the
//! variables that name it (`TENURE_TASK_ID`, `TENURE_ATTEMPT`) and those it
//! needs to call tenure as its own session (`TENURE_SESSION`, `TENURE_NATS`
//! and `TENURE_NATS_URL`: server addresses, never a credential) — then its
//! spec's `env` on top. Nothing of the daemons' environment reaches it: not
//! their NATS credentials, not `OTEL_*`, not `RUST_LOG`.
//!
//! It runs in a scratch directory of its own, `<scratch-root>/<task>.<attempt>`
//! (also its `HOME`), or in its spec's `cwd`; never in the data directory. The
//! scratch root lies outside the data directory, belongs to the daemons' user
//! and is not writable by anyone else, so a task can neither replace its own
//! directory with a link nor reach the daemons' files from it. With
//! `--run-as USER` the task (and only the task: not its shim) runs as that
//! user, with its groups, and its scratch directory belongs to it.
//!
//! This module never runs a task and never removes anything: it decides what
//! a task gets ([`task_env`]), prepares the scratch root, and switches a child
//! to its user ([`RunAs::switch`]) right before `exec`. The attempts' own
//! directories are [`crate::scratch`]'s.

use std::collections::BTreeMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::DirBuilder;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::errno::Errno;
use nix::unistd::Gid;
use serde::{Deserialize, Serialize};
use tenure_protocol::{Attempt, SessionId, TaskId};

/// `PATH` of every task unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Variables a spec cannot set: they name the task's processes, and the
/// machine (its judge, its operator, `ps e`) relies on them to say whose a
/// process is. A spec's value for them is dropped.
pub const RESERVED: [&str; 2] = ["TENURE_TASK_ID", "TENURE_ATTEMPT"];

/// Why a task's sandbox could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `--run-as` names no user of this machine.
    #[error("--run-as: no user named {0:?} on this machine")]
    NoSuchUser(String),
    /// `--run-as` names root: that runs tasks with every privilege there is.
    #[error("--run-as: {0:?} is root (uid 0); name an unprivileged user")]
    RootUser(String),
    /// Only root can start processes as another user.
    #[error("--run-as {user}: the worker must run as root to start tasks as another user (it runs as uid {uid})")]
    NotRoot { user: String, uid: u32 },
    /// The user database could not be read.
    #[error("--run-as {user}: {source}")]
    Lookup { user: String, source: Errno },
    /// The scratch root could not be derived from the data directory.
    #[error("no scratch directory can be derived from the data directory {0}; set --scratch-dir")]
    NoDefaultScratch(PathBuf),
    /// The scratch root and the data directory overlap.
    #[error("the scratch directory {scratch} and the data directory {data} must not contain one another")]
    Overlap { scratch: PathBuf, data: PathBuf },
    /// Something other than a directory of the daemons' user sits there.
    #[error("scratch directory {path}: {reason}")]
    BadRoot { path: PathBuf, reason: String },
    /// The run-as user cannot enter the scratch root.
    #[error(
        "--run-as {user} cannot enter the scratch directory {path} ({detail}); every directory above it must be \
         searchable (x) by that user: choose --scratch-dir elsewhere or fix the modes"
    )]
    Unreachable { user: String, path: PathBuf, detail: String },
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: io::Error },
}

/// The unprivileged user tasks run as (`--run-as`), resolved once at start.
/// A change to the user database takes effect at the worker's next start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunAs {
    pub user: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (as `initgroups` would set them), primary included.
    pub groups: Vec<u32>,
}

impl RunAs {
    /// Looks `user` up. Refused when it does not exist, is root, or when this
    /// process is not root (nothing else may switch a child's user).
    pub fn resolve(user: &str) -> Result<RunAs, Error> {
        let found = nix::unistd::User::from_name(user)
            .map_err(|source| Error::Lookup { user: user.to_owned(), source })?
            .ok_or_else(|| Error::NoSuchUser(user.to_owned()))?;
        if found.uid.is_root() {
            return Err(Error::RootUser(user.to_owned()));
        }
        let me = nix::unistd::geteuid();
        if !me.is_root() {
            return Err(Error::NotRoot { user: user.to_owned(), uid: me.as_raw() });
        }
        let name = CString::new(user).map_err(|_| Error::NoSuchUser(user.to_owned()))?;
        let groups = nix::unistd::getgrouplist(&name, found.gid)
            .map_err(|source| Error::Lookup { user: user.to_owned(), source })?;
        Ok(RunAs {
            user: user.to_owned(),
            uid: found.uid.as_raw(),
            gid: found.gid.as_raw(),
            groups: groups.into_iter().map(Gid::as_raw).collect(),
        })
    }

    /// In a child before its `exec`: groups, then group, then user (the
    /// order that leaves no privilege behind). Raw system calls: they change
    /// the calling process only (libc's wrappers would coordinate the threads
    /// of the process whose memory a spawned child shares), allocate nothing
    /// and are async-signal-safe.
    pub fn switch(&self) -> io::Result<()> {
        use nix::libc::{syscall, SYS_setgroups, SYS_setresgid, SYS_setresuid};
        let (gid, uid) = (self.gid, self.uid);
        // SAFETY: plain system calls; `groups` is a live slice of `gid_t`s
        // (`u32`) of the length passed.
        let failed = unsafe {
            syscall(SYS_setgroups, self.groups.len(), self.groups.as_ptr()) < 0
                || syscall(SYS_setresgid, gid, gid, gid) < 0
                || syscall(SYS_setresuid, uid, uid, uid) < 0
        };
        match failed {
            true => Err(io::Error::last_os_error()),
            false => Ok(()),
        }
    }
}

/// The NATS servers as a task may see them: credentials written into a URL
/// (`nats://user:password@host`, `nats://token@host`) are cut out.
pub fn servers_for_tasks(servers: &[String]) -> String {
    servers
        .iter()
        .map(|s| {
            let (scheme, rest) = match s.split_once("://") {
                Some((scheme, rest)) => (Some(scheme), rest),
                None => (None, s.as_str()),
            };
            let end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(end);
            let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
            match scheme {
                Some(scheme) => format!("{scheme}://{host}{path}"),
                None => format!("{host}{path}"),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Who a task is, for its environment.
#[derive(Debug, Clone, Copy)]
pub struct Identity<'a> {
    pub task: &'a TaskId,
    pub attempt: Attempt,
    pub session: &'a SessionId,
}

/// The whole environment of a task's process: the defaults, then the spec's
/// `env` (it wins: a task may set its own `PATH` or `HOME`), then the
/// variables that name it (they win over the spec). `nats` is the server list
/// from [`servers_for_tasks`]; `home` the task's scratch directory.
pub fn task_env(
    spec_env: &BTreeMap<String, String>,
    who: Identity<'_>,
    nats: &str,
    home: &Path,
) -> BTreeMap<OsString, OsString> {
    let mut env: BTreeMap<OsString, OsString> = BTreeMap::new();
    let mut set = |k: &str, v: &OsStr| {
        env.insert(k.into(), v.to_owned());
    };
    set("PATH", OsStr::new(DEFAULT_PATH));
    set("HOME", home.as_os_str());
    set("LANG", OsStr::new("C.UTF-8"));
    set("TENURE_SESSION", OsStr::new(who.session.as_str()));
    // `TENURE_NATS` is what the `tenure` CLI reads; `TENURE_NATS_URL` the
    // same list for any other program.
    set("TENURE_NATS", OsStr::new(nats));
    set("TENURE_NATS_URL", OsStr::new(nats));
    for (k, v) in spec_env.iter().filter(|(k, _)| !RESERVED.contains(&k.as_str())) {
        set(k, OsStr::new(v));
    }
    set("TENURE_TASK_ID", OsStr::new(&who.task.to_string()));
    set("TENURE_ATTEMPT", OsStr::new(&who.attempt.0.to_string()));
    env
}

/// The scratch root to use: `configured`, or the sibling of the data
/// directory (`data_dir` made absolute first, so `.` has a name).
pub fn scratch_root(configured: Option<&Path>, data_dir: &Path) -> Result<PathBuf, Error> {
    if let Some(dir) = configured {
        return Ok(dir.to_path_buf());
    }
    let absolute = std::fs::canonicalize(data_dir).map_err(|source| Error::Io {
        what: "cannot resolve the data directory",
        path: data_dir.into(),
        source,
    })?;
    tenure_machine::Layout::default_scratch_root(&absolute).ok_or(Error::NoDefaultScratch(absolute))
}

/// Creates the scratch root if missing (mode 0711: a task's user may pass it
/// to reach its own directory, but not list or change it) and checks it: a
/// real directory (not a link), of this process's user, writable by nobody
/// else (tightened if it is), apart from the data directory, and — with
/// `run_as` — enterable by that user.
pub fn prepare_scratch_root(root: &Path, data_dir: &Path, run_as: Option<&RunAs>) -> Result<(), Error> {
    let bad = |reason: String| Error::BadRoot { path: root.to_path_buf(), reason };
    if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
        DirBuilder::new().recursive(true).create(parent).map_err(|source| Error::Io {
            what: "cannot create",
            path: parent.into(),
            source,
        })?;
    }
    match DirBuilder::new().mode(0o711).create(root) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => return Err(Error::Io { what: "cannot create", path: root.into(), source }),
    }
    let meta = std::fs::symlink_metadata(root).map_err(|source| Error::Io {
        what: "cannot inspect",
        path: root.into(),
        source,
    })?;
    if !meta.file_type().is_dir() {
        return Err(bad("exists and is not a directory (symlinks are refused)".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(bad(format!("owned by uid {}, not by this daemon's uid {me}", meta.uid())));
    }
    if meta.mode() & 0o022 != 0 {
        tracing::warn!(dir = %root.display(), mode = format!("{:o}", meta.mode() & 0o777), "scratch directory writable by others: tightening it to 0711");
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).map_err(|source| Error::Io {
            what: "cannot tighten",
            path: root.into(),
            source,
        })?;
    }
    let canonical = |p: &Path| {
        std::fs::canonicalize(p).map_err(|source| Error::Io { what: "cannot resolve", path: p.into(), source })
    };
    let (scratch, data) = (canonical(root)?, canonical(data_dir)?);
    if scratch.starts_with(&data) || data.starts_with(&scratch) {
        return Err(Error::Overlap { scratch, data });
    }
    match run_as {
        Some(user) => check_enterable(user, &scratch),
        None => Ok(()),
    }
}

/// Proves that `user` can enter `dir` by having a child, switched to that
/// user, enter it: the kernel's answer, ACLs and all, rather than a guess
/// from mode bits.
fn check_enterable(user: &RunAs, dir: &Path) -> Result<(), Error> {
    let unreachable = |detail: String| Error::Unreachable { user: user.user.clone(), path: dir.into(), detail };
    let switch = user.clone();
    let mut probe = Command::new("/bin/sh");
    probe.args(["-c", "cd -- \"$1\"", "sh"]).arg(dir).env_clear().stdin(Stdio::null()).stdout(Stdio::null());
    probe.stderr(Stdio::piped());
    // SAFETY: the closure makes plain system calls and does not allocate.
    unsafe { probe.pre_exec(move || switch.switch()) };
    let out = probe.output().map_err(|e| unreachable(format!("the check could not run: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(unreachable(String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(spec: &[(&str, &str)]) -> BTreeMap<String, String> {
        let task: TaskId = "shell-12".parse().unwrap();
        let session: SessionId = "alice".parse().unwrap();
        let spec: BTreeMap<String, String> = spec.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let who = Identity { task: &task, attempt: Attempt(3), session: &session };
        task_env(&spec, who, "nats://a:4222", Path::new("/srv/scratch/shell-12.3"))
            .into_iter()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect()
    }

    #[test]
    fn a_task_gets_the_defaults_and_its_names_and_nothing_else() {
        let env = env_of(&[]);
        let keys: Vec<&str> = env.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "HOME",
                "LANG",
                "PATH",
                "TENURE_ATTEMPT",
                "TENURE_NATS",
                "TENURE_NATS_URL",
                "TENURE_SESSION",
                "TENURE_TASK_ID"
            ]
        );
        assert_eq!(env["PATH"], DEFAULT_PATH);
        assert_eq!(env["HOME"], "/srv/scratch/shell-12.3");
        assert_eq!(env["TENURE_TASK_ID"], "shell-12");
        assert_eq!(env["TENURE_ATTEMPT"], "3");
        assert_eq!(env["TENURE_SESSION"], "alice");
        assert_eq!(env["TENURE_NATS"], "nats://a:4222");
    }

    #[test]
    fn the_spec_wins_except_over_the_task_names() {
        let env = env_of(&[
            ("PATH", "/opt/bin"),
            ("GREETING", "hi"),
            ("TENURE_TASK_ID", "shell-1"),
            ("TENURE_ATTEMPT", "9"),
            ("HOME", "/home/x"),
        ]);
        assert_eq!(
            (env["PATH"].as_str(), env["GREETING"].as_str(), env["HOME"].as_str()),
            ("/opt/bin", "hi", "/home/x")
        );
        assert_eq!((env["TENURE_TASK_ID"].as_str(), env["TENURE_ATTEMPT"].as_str()), ("shell-12", "3"));
    }

    #[test]
    fn credentials_never_reach_a_task_through_server_urls() {
        let servers = [
            "nats://user:secret@n1:4222".to_owned(),
            "tls://token@n2:4222/".to_owned(),
            "n3:4222".to_owned(),
            "a:b@n4:4222".to_owned(),
            "nats://n5".to_owned(),
        ];
        let shown = servers_for_tasks(&servers);
        assert_eq!(shown, "nats://n1:4222,tls://n2:4222/,n3:4222,n4:4222,nats://n5");
        assert!(!shown.contains("secret") && !shown.contains("token"));
    }

    #[test]
    fn the_default_scratch_root_is_the_data_dirs_sibling() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("w1");
        std::fs::create_dir(&data).unwrap();
        let root = scratch_root(None, &data).unwrap();
        assert_eq!(root, std::fs::canonicalize(tmp.path()).unwrap().join("w1.scratch"));
        assert_eq!(scratch_root(Some(Path::new("/srv/s")), &data).unwrap(), Path::new("/srv/s"));
    }

    #[test]
    fn a_scratch_root_inside_the_data_dir_or_around_it_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("w1");
        std::fs::create_dir(&data).unwrap();
        assert!(matches!(prepare_scratch_root(&data.join("scratch"), &data, None), Err(Error::Overlap { .. })));
        assert!(matches!(prepare_scratch_root(tmp.path(), &data, None), Err(Error::Overlap { .. })));
        let good = tmp.path().join("w1.scratch");
        prepare_scratch_root(&good, &data, None).unwrap();
        assert_eq!(std::fs::metadata(&good).unwrap().permissions().mode() & 0o777, 0o711);
    }

    #[test]
    fn a_linked_scratch_root_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("w1");
        std::fs::create_dir(&data).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = tmp.path().join("w1.scratch");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(matches!(prepare_scratch_root(&link, &data, None), Err(Error::BadRoot { .. })));
    }

    #[test]
    fn run_as_refuses_unknown_users_and_root() {
        assert!(matches!(RunAs::resolve("no-such-user-tenure-test"), Err(Error::NoSuchUser(_))));
        assert!(matches!(RunAs::resolve("root"), Err(Error::RootUser(_))));
        match RunAs::resolve("nobody") {
            Ok(user) => {
                assert!(nix::unistd::geteuid().is_root());
                assert!(user.uid != 0 && user.groups.contains(&user.gid), "{user:?}");
            }
            Err(Error::NotRoot { .. }) => assert!(!nix::unistd::geteuid().is_root()),
            // A machine without `nobody`.
            Err(Error::NoSuchUser(_)) => {}
            Err(other) => panic!("{other}"),
        }
    }
}
