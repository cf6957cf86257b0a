//! Running one shell task as its own process group, and ending that group.
//!
//! The task is `sh -c COMMAND` as the leader of a new process group, with the
//! environment, directory and user [`crate::sandbox`] decided, stdout and
//! stderr appended to one output file (the same open file description, so their
//! order is the order they were written), stdin from `/dev/null` or, for an
//! `agent` task, from its input FIFO. Its shim ([`crate::shim`]) is a
//! child subreaper, so descendants that double-fork inside the group are
//! re-parented to the shim, never to PID 1, and are reaped there.

use std::collections::BTreeMap;
use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::sandbox::RunAs;

/// Makes this process the reaper of orphaned descendants (Linux), so that the
/// processes of a task never end up under PID 1.
pub fn become_subreaper() {
    if let Err(error) = nix::sys::prctl::set_child_subreaper(true) {
        tracing::warn!(%error, "cannot become child subreaper; orphaned task processes go to PID 1");
    }
}

/// How one task's process starts: what it runs, with exactly which
/// environment, where, and as whom (see [`crate::sandbox`]).
#[derive(Debug)]
pub struct Launch<'a> {
    pub command: &'a str,
    /// The whole environment: nothing else is inherited.
    pub env: &'a BTreeMap<OsString, OsString>,
    pub cwd: &'a Path,
    /// Switch to this user (groups, group, user) before entering `cwd`, so a
    /// directory the user may not enter fails the start.
    pub run_as: Option<&'a RunAs>,
    /// The `cgroup.procs` files of the attempt's control groups, open for
    /// writing: the process joins each before anything else, so nothing of
    /// the task ever runs outside them ([`crate::cgroup_fs`]).
    pub join: &'a [OwnedFd],
}

/// Spawns `sh -c COMMAND` as the leader of a new process group, with a
/// cleared environment set to `launch.env`, as `launch.run_as` when set,
/// stdout and stderr both going to `output` (a file or a pipe), stdin from
/// `stdin` (`/dev/null` when `None`). Returns the leader's pid, which is also
/// the group's id; the caller reaps it.
pub fn spawn(launch: &Launch<'_>, stdin: Option<OwnedFd>, output: impl Into<OwnedFd>) -> std::io::Result<i32> {
    let output: OwnedFd = output.into();
    let err = output.try_clone()?;
    let stdin = stdin.map(Stdio::from).unwrap_or_else(Stdio::null);
    // Prepared before the fork: the child only makes system calls.
    let cwd = CString::new(launch.cwd.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "the working directory contains NUL"))?;
    let ids = launch.run_as.map(RunAs::ids);
    let join: Vec<i32> = launch.join.iter().map(AsRawFd::as_raw_fd).collect();
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(launch.command)
        .env_clear()
        .envs(launch.env)
        .stdin(stdin)
        .stdout(Stdio::from(output))
        .stderr(Stdio::from(err))
        .process_group(0);
    // SAFETY: runs in the child between fork and exec; it makes plain system
    // calls (write, fcntl or close_range, setgroups, setgid, setuid, chdir)
    // and does not allocate.
    unsafe {
        command.pre_exec(move || {
            // Joined first, still as the worker's user: the groups' files
            // are not the task user's to write.
            for fd in &join {
                join_cgroup(*fd)?;
            }
            close_inherited_on_exec();
            if let Some(ids) = &ids {
                ids.switch()?;
            }
            nix::unistd::chdir(cwd.as_c_str())?;
            Ok(())
        })
    };
    let child = command.spawn()?;
    i32::try_from(child.id()).map_err(|_| std::io::Error::other("spawned process has no valid pid"))
}

/// Moves the calling process into the group whose `cgroup.procs` is open
/// as `fd` (`0` is the writer itself). Async-signal-safe.
fn join_cgroup(fd: i32) -> std::io::Result<()> {
    // SAFETY: writes one byte from a static buffer to a descriptor this
    // process holds open.
    let written = unsafe { nix::libc::write(fd, b"0".as_ptr().cast(), 1) };
    match written {
        1 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Marks every descriptor above stderr close-on-exec, so that the task gets
/// stdin, stdout and stderr and nothing else — not even a descriptor the
/// worker's own parent left open and the launcher and shim inherited.
/// (Closing them outright would also close the pipe through which the
/// standard library reports a failed `exec`.) Async-signal-safe.
fn close_inherited_on_exec() {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on
    // descriptors of this process; it takes no pointers.
    let marked =
        unsafe { nix::libc::syscall(nix::libc::SYS_close_range, 3u32, u32::MAX, nix::libc::CLOSE_RANGE_CLOEXEC) };
    if marked == 0 {
        return;
    }
    // Kernels before 5.11: one descriptor at a time, up to the usual limit.
    for fd in 3..4096 {
        // SAFETY: fcntl on a descriptor number that may not be open only fails.
        unsafe {
            nix::libc::fcntl(fd, nix::libc::F_SETFD, nix::libc::FD_CLOEXEC);
        }
    }
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
