//! Running one shell task as its own process group, and ending that group.
//!
//! The task is `sh -c COMMAND` as the leader of a new process group, stdout and
//! stderr appended to one output file (the same open file description, so their
//! order is the order they were written), stdin from `/dev/null` or, for an
//! `agent` task, from its input FIFO. The worker is a child subreaper, so
//! descendants that double-fork inside the group are re-parented to the worker,
//! never to PID 1, and are reaped here.
//!
//! **Invariant:** [`Running::finish`] does not return while any process of the
//! group lives: the leader's exit is only the beginning of the end.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tenure_protocol::{Ending, Outcome, TaskSpec};
use tokio::process::{Child, Command};

/// Makes this process the reaper of orphaned descendants (Linux), so that the
/// processes of a task never end up under PID 1.
pub fn become_subreaper() {
    if let Err(error) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::warn!(%error, "cannot become child subreaper; orphaned task processes go to PID 1");
    }
}

/// A spawned task process group.
pub struct Running {
    child: Child,
    pub pid: i32,
}

/// Spawns `sh -c spec.command` in a new process group, stdout and stderr both
/// going to `output` (a file or a pipe), stdin from `stdin` (`/dev/null` when
/// `None`). `identity` adds variables that name the task to its processes (they
/// override the spec's own).
pub fn spawn(
    spec: &TaskSpec,
    identity: &[(&str, String)],
    stdin: Option<OwnedFd>,
    output: impl Into<OwnedFd>,
    default_cwd: &Path,
) -> std::io::Result<Running> {
    let output: OwnedFd = output.into();
    let err = output.try_clone()?;
    let stdin = stdin.map(Stdio::from).unwrap_or_else(Stdio::null);
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(&spec.command)
        .current_dir(spec.cwd.as_deref().map(Path::new).unwrap_or(default_cwd))
        .envs(&spec.env)
        .envs(identity.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(stdin)
        .stdout(Stdio::from(output))
        .stderr(Stdio::from(err))
        .process_group(0)
        .kill_on_drop(false);
    let child = cmd.spawn()?;
    let pid = child
        .id()
        .and_then(|p| i32::try_from(p).ok())
        .ok_or_else(|| std::io::Error::other("spawned process has no pid"))?;
    Ok(Running { child, pid })
}

impl Running {
    /// Waits for the leader to exit, or for `kill` to fire; then ends the whole
    /// group (SIGTERM, `grace`, SIGKILL) and returns the outcome.
    pub async fn finish(mut self, kill: impl std::future::Future<Output = ()>, grace: Duration) -> Outcome {
        let pgid = Pid::from_raw(self.pid);
        let mut killed = false;
        let status = tokio::select! {
            status = self.child.wait() => status,
            _ = kill => {
                killed = true;
                signal_group(pgid, Signal::SIGTERM);
                match tokio::time::timeout(grace, self.child.wait()).await {
                    Ok(status) => status,
                    Err(_) => {
                        signal_group(pgid, Signal::SIGKILL);
                        self.child.wait().await
                    }
                }
            }
        };
        // The leader is gone; make sure nothing else of the group survives it.
        end_group(pgid, grace).await;
        outcome(status, killed)
    }
}

fn outcome(status: std::io::Result<std::process::ExitStatus>, killed: bool) -> Outcome {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Err(e) => Outcome::new(Ending::Failed, None, Some(format!("wait failed: {e}"))),
        Ok(s) => match (s.code(), s.signal()) {
            (Some(0), _) if !killed => Outcome::new(Ending::Completed, Some(0), None),
            (Some(code), _) if !killed => Outcome::new(Ending::Failed, Some(code), Some(format!("exit code: {code}"))),
            (code, signal) => {
                let detail = match signal {
                    Some(sig) => format!("signal {sig}"),
                    None => format!("exit code: {}", code.unwrap_or(-1)),
                };
                let ending = if killed { Ending::Killed } else { Ending::Failed };
                Outcome::new(ending, code, Some(detail))
            }
        },
    }
}

fn signal_group(pgid: Pid, signal: Signal) {
    match killpg(pgid, signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(error) => tracing::warn!(pgid = pgid.as_raw(), %error, ?signal, "cannot signal process group"),
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
    signal_group(pgid, Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    let mut step = Duration::from_millis(5);
    loop {
        reap_group(pgid);
        if !group_alive(pgid.as_raw()) {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            signal_group(pgid, Signal::SIGKILL);
        }
        tokio::time::sleep(step).await;
        step = (step * 2).min(Duration::from_millis(100));
    }
}
