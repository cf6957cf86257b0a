//! Running one shell task as its own process group, and ending that group.
//!
//! The task is `sh -c COMMAND` as the leader of a new process group, stdout and
//! stderr appended to one output file (the same open file description, so their
//! order is the order they were written), stdin from `/dev/null` or, for an
//! `agent` task, from its input FIFO. Its monitor ([`crate::monitor`]) is a
//! child subreaper, so descendants that double-fork inside the group are
//! re-parented to the monitor, never to PID 1, and are reaped there.

use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tenure_protocol::TaskSpec;

/// Makes this process the reaper of orphaned descendants (Linux), so that the
/// processes of a task never end up under PID 1.
pub fn become_subreaper() {
    if let Err(error) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::warn!(%error, "cannot become child subreaper; orphaned task processes go to PID 1");
    }
}

/// Spawns `sh -c spec.command` as the leader of a new process group, stdout
/// and stderr both going to `output` (a file or a pipe), stdin from `stdin`
/// (`/dev/null` when `None`). `identity` adds variables that name the task to
/// its processes (they override the spec's own). Returns the leader's pid,
/// which is also the group's id; the caller reaps it.
pub fn spawn(
    spec: &TaskSpec,
    identity: &[(&str, String)],
    stdin: Option<OwnedFd>,
    output: impl Into<OwnedFd>,
    default_cwd: &Path,
) -> std::io::Result<i32> {
    let output: OwnedFd = output.into();
    let err = output.try_clone()?;
    let stdin = stdin.map(Stdio::from).unwrap_or_else(Stdio::null);
    let child = Command::new("/bin/sh")
        .arg("-c")
        .arg(&spec.command)
        .current_dir(spec.cwd.as_deref().map(Path::new).unwrap_or(default_cwd))
        .envs(&spec.env)
        .envs(identity.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(stdin)
        .stdout(Stdio::from(output))
        .stderr(Stdio::from(err))
        .process_group(0)
        .spawn()?;
    i32::try_from(child.id()).map_err(|_| std::io::Error::other("spawned process has no valid pid"))
}

/// Signals every process of group `pgid`; an empty group is not an error.
pub fn signal_group(pgid: i32, signal: Signal) {
    match killpg(Pid::from_raw(pgid), signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(error) => tracing::warn!(pgid, %error, ?signal, "cannot signal process group"),
    }
}

/// Reaps members of the group that were re-parented to us (we are a subreaper).
fn reap_group(pgid: Pid) {
    loop {
        match waitpid(Pid::from_raw(-pgid.as_raw()), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => continue,
        }
    }
}

/// True while any process (zombies included) is in the group.
pub fn group_alive(pgid: i32) -> bool {
    !matches!(killpg(Pid::from_raw(pgid), None), Err(Errno::ESRCH))
}

/// Ends every remaining member of the group: SIGTERM, then SIGKILL after
/// `grace`, reaping as they die. Returns once the group is empty.
pub async fn end_group(pgid: Pid, grace: Duration) {
    reap_group(pgid);
    if !group_alive(pgid.as_raw()) {
        return;
    }
    signal_group(pgid.as_raw(), Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    let mut step = Duration::from_millis(5);
    loop {
        reap_group(pgid);
        if !group_alive(pgid.as_raw()) {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            signal_group(pgid.as_raw(), Signal::SIGKILL);
        }
        tokio::time::sleep(step).await;
        step = (step * 2).min(Duration::from_millis(100));
    }
}
