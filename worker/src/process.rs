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
use std::ffi::{c_char, c_int, c_void, CString, OsString};
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use nix::libc;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustix::fs::{Mode, OFlags};

use crate::sandbox::RunAs;

/// Reaps every child of this process that has ended, without waiting.
pub fn reap_ended_children() {
    while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
        if status == WaitStatus::StillAlive {
            return;
        }
    }
}

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
    /// The attempt's cgroup v2 group, its directory open: the process is
    /// made inside it (`clone3` with `CLONE_INTO_CGROUP`) or, where the
    /// kernel cannot do that, joins it before anything else by its
    /// `cgroup.procs` ([`crate::cgroup_fs`]).
    pub cgroup: Option<&'a OwnedFd>,
    /// The `cgroup.procs` files of the attempt's v1 groups, open for
    /// writing: the process joins each before anything else. So nothing of
    /// the task ever runs outside its groups.
    pub join: &'a [OwnedFd],
}

/// Spawns `sh -c COMMAND` as the leader of a new process group, with a
/// cleared environment set to `launch.env`, as `launch.run_as` when set,
/// stdout and stderr both going to `output` (a file or a pipe), stdin from
/// `stdin` (`/dev/null` when `None`). Returns the leader's pid, which is also
/// the group's id; the caller reaps it.
///
/// The child shares the shim's memory until its `exec` (`CLONE_VM` and
/// `CLONE_VFORK`, as `posix_spawn` does), so nothing of the shim is copied:
/// a fork copied its page tables and then every page either side wrote, about
/// a fifth of a shell task's CPU in the shim. `posix_spawn` itself cannot
/// join a cgroup or switch users before the `exec`, which is why the child
/// is this module's own.
///
/// The child is made inside its cgroup v2 group where the kernel can
/// (`clone3` with `CLONE_INTO_CGROUP`, Linux 5.7, on x86_64): moving a
/// process into a group instead takes the kernel's cgroup lock and the
/// write side of the lock every `fork` reads, and, after a quiet spell, an
/// RCU grace period with both held — milliseconds during which every other
/// attempt's group could be neither made nor removed. Where `clone3` is
/// refused (an older kernel, a seccomp filter), the child writes the
/// group's `cgroup.procs` first thing instead, as it writes the v1 groups'.
pub fn spawn(launch: &Launch<'_>, stdin: Option<OwnedFd>, output: impl Into<OwnedFd>) -> std::io::Result<i32> {
    spawn_as(launch, stdin, output.into(), Inside::Allowed)
}

/// Whether [`spawn`] may make the child inside its group (tests force the
/// other way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inside {
    Allowed,
    #[cfg(test)]
    Never,
}

/// `clone3` with `CLONE_INTO_CGROUP` was refused as unknown on this
/// machine: every later child joins by writing `cgroup.procs`.
static NO_CLONE_INTO_CGROUP: AtomicBool = AtomicBool::new(false);

fn spawn_as(launch: &Launch<'_>, stdin: Option<OwnedFd>, output: OwnedFd, into: Inside) -> std::io::Result<i32> {
    let stdin = match stdin {
        Some(fd) => fd,
        None => std::fs::File::open("/dev/null")?.into(),
    };
    let (stdin, output) = (above_stderr(stdin)?, above_stderr(output)?);
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what} contains NUL"));
    let sh = c"/bin/sh";
    let command = CString::new(launch.command).map_err(|_| invalid("the command"))?;
    let env = launch
        .env
        .iter()
        .map(|(name, value)| {
            let mut pair = Vec::with_capacity(name.len() + value.len() + 1);
            pair.extend_from_slice(name.as_bytes());
            pair.push(b'=');
            pair.extend_from_slice(value.as_bytes());
            CString::new(pair).map_err(|_| invalid("the environment"))
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut envp: Vec<*const c_char> = env.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut child = Child {
        argv: [sh.as_ptr(), c"-c".as_ptr(), command.as_ptr(), std::ptr::null()],
        envp,
        cwd: CString::new(launch.cwd.as_os_str().as_bytes()).map_err(|_| invalid("the working directory"))?,
        stdio: [stdin.as_raw_fd(), output.as_raw_fd(), output.as_raw_fd()],
        join: launch.join.iter().map(AsRawFd::as_raw_fd).collect(),
        run_as: launch.run_as,
        errno: AtomicI32::new(0),
    };
    // The child's stack: only the pages it uses are ever touched.
    let mut stack: Vec<u8> = Vec::with_capacity(CHILD_STACK);
    // SAFETY: one past the end of the allocation, not dereferenced here; the
    // stack grows down from it (aligned as the ABI wants).
    let top = unsafe { stack.as_mut_ptr().add(CHILD_STACK) };
    let top = top.wrapping_sub(top as usize % 16);
    // No handler of the shim may run in the child while it shares the shim's
    // memory: every signal is blocked around the clone (the child unblocks
    // them in its last step before `exec`).
    let mut blocked = MaybeUninit::<libc::sigset_t>::uninit();
    let mut before = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises the set; pthread_sigmask reads it and
    // writes the previous mask into `before`.
    unsafe {
        libc::sigfillset(blocked.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, blocked.as_ptr(), before.as_mut_ptr());
    }
    let made_inside = match launch.cgroup {
        Some(group) if into == Inside::Allowed && !NO_CLONE_INTO_CGROUP.load(Ordering::Relaxed) => {
            let base = stack.as_mut_ptr();
            // SAFETY: `base..top` is the child's stack, `top` aligned; the
            // call returns only once the child has exec'd or exited.
            let made = unsafe { clone_into_cgroup(group, base, top as usize - base as usize, &child) };
            if let Err(Errno::ENOSYS | Errno::EINVAL | Errno::E2BIG) = made {
                NO_CLONE_INTO_CGROUP.store(true, Ordering::Relaxed);
            }
            made.ok()
        }
        _ => None,
    };
    let pid = match made_inside {
        Some(pid) => Ok(pid),
        None => clone_then_join(launch.cgroup, &mut child, top),
    };
    restore_signals(&before);
    let pid = pid?;
    match child.errno.load(Ordering::Acquire) {
        0 => Ok(pid),
        errno => {
            // It exited without running anything; reaped here, not left to
            // the caller's wait.
            let _ = waitpid(Pid::from_raw(pid), None);
            Err(std::io::Error::from_raw_os_error(errno))
        }
    }
}

/// The child's stack (it makes a dozen system calls; `posix_spawn` uses less).
const CHILD_STACK: usize = 64 * 1024;

/// The child made where the shim is, joining its v2 `group` (when it has
/// one) first thing, before its v1 groups; `top` is its stack's aligned end.
fn clone_then_join(group: Option<&OwnedFd>, child: &mut Child<'_>, top: *mut u8) -> std::io::Result<i32> {
    let procs = group
        .map(|group| rustix::fs::openat(group, "cgroup.procs", OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty()))
        .transpose()?;
    if let Some(procs) = &procs {
        child.join.insert(0, procs.as_raw_fd());
    }
    // SAFETY: `child_main` runs on the stack below `top` with `child`
    // borrowed; with CLONE_VFORK this call returns only once the child has
    // exec'd or exited, so both (and `procs`) outlive every use the child
    // makes of them, and the child makes only system calls (see `child_main`).
    let pid = unsafe {
        libc::clone(
            child_main,
            top.cast(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            std::ptr::from_mut(child).cast(),
        )
    };
    match pid {
        pid if pid > 0 => Ok(pid),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Puts back the signal mask [`spawn_as`] saved before the clone.
fn restore_signals(before: &MaybeUninit<libc::sigset_t>) {
    // SAFETY: `before` was written by the pthread_sigmask that blocked
    // every signal around the clone.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, before.as_ptr(), std::ptr::null_mut()) };
}

/// `struct clone_args` of `clone3(2)`, up to `cgroup` (its version 2).
#[repr(C)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// `clone3` with `CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP`: the child is
/// made inside `group` and runs [`child_main`] on the given stack, exiting
/// with what it returns; this returns once the child has exec'd or exited,
/// with its pid. An error means no child was made.
///
/// # Safety
/// As for `libc::clone` with the same flags: `stack` must be writable for
/// `stack_size` bytes and end 16-byte aligned, and `child` must stay valid
/// until this returns.
#[cfg(target_arch = "x86_64")]
unsafe fn clone_into_cgroup(
    group: &OwnedFd,
    stack: *mut u8,
    stack_size: usize,
    child: &Child<'_>,
) -> Result<i32, Errno> {
    let args = CloneArgs {
        flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP,
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack as u64,
        stack_size: stack_size as u64,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: group.as_raw_fd() as u64,
    };
    let main: extern "C" fn(*mut c_void) -> c_int = child_main;
    let arg: *const Child<'_> = child;
    let ret: i64;
    // SAFETY: the parent comes back from the `syscall` with the child's pid
    // (or an error) and only rax, rcx and r11 changed. The child comes back
    // with 0 on its own stack (the kernel sets its stack pointer to the
    // stack's end), calls `child_main(child)` — on an aligned stack, as the
    // ABI wants at a call — and exits with its return value: it never
    // returns into this function, whose frame is the suspended parent's.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r13",
            "call r12",
            "mov edi, eax",
            "mov eax, {exit}",
            "syscall",
            "ud2",
            "2:",
            exit = const libc::SYS_exit,
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") &raw const args,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") main,
            in("r13") arg,
            lateout("rcx") _,
            lateout("r11") _,
        );
    }
    match ret {
        pid if pid > 0 => Ok(pid as i32),
        error => Err(Errno::from_raw(-error as i32)),
    }
}

/// Other architectures join their group by `cgroup.procs` (no child is made
/// here).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone_into_cgroup(_: &OwnedFd, _: *mut u8, _: usize, _: &Child<'_>) -> Result<i32, Errno> {
    Err(Errno::ENOSYS)
}

/// `CLONE_INTO_CGROUP` (Linux 5.7).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Everything the child needs, prepared before the clone.
struct Child<'a> {
    argv: [*const c_char; 4],
    envp: Vec<*const c_char>,
    cwd: CString,
    /// What becomes stdin, stdout and stderr (all above stderr, see
    /// [`above_stderr`], so no `dup2` overwrites another's source).
    stdio: [i32; 3],
    /// The `cgroup.procs` files to write (the v2 group's too, when the
    /// child could not be made inside it).
    join: Vec<i32>,
    run_as: Option<&'a RunAs>,
    /// Set by the child when a step failed (it then exits with 127).
    errno: AtomicI32,
}

/// A descriptor numbered above stderr: the child moves its three
/// descriptors into place one by one.
fn above_stderr(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    if fd.as_raw_fd() > 2 {
        return Ok(fd);
    }
    Ok(nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3)).map(|raw| {
        // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that nothing else owns.
        unsafe { OwnedFd::from_raw_fd(raw) }
    })?)
}

/// The child, between the clone and the `exec`. It shares the shim's memory
/// and runs on its own stack: it only makes system calls on what [`Child`]
/// holds (no allocation, no lock, no unwinding), and on a failure records the
/// error and exits without running anything of the shim's.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `spawn` passes a `Child` that outlives the child's use of it.
    let child = unsafe { &*arg.cast::<Child<'_>>() };
    // SAFETY: each call is a plain system call on descriptors, strings and
    // ids prepared by `spawn`; none allocates or takes a lock.
    unsafe {
        for (target, &fd) in child.stdio.iter().enumerate() {
            if libc::dup2(fd, target as c_int) < 0 {
                fail(child);
            }
        }
        if libc::setpgid(0, 0) < 0 {
            fail(child);
        }
        // Joined first, still as the worker's user: the groups' files are not
        // the task user's to write.
        for &fd in &child.join {
            if join_cgroup(fd).is_err() {
                fail(child);
            }
        }
        close_inherited_on_exec();
        if child.run_as.is_some_and(|user| user.switch().is_err()) {
            fail(child);
        }
        if libc::chdir(child.cwd.as_ptr()) < 0 {
            fail(child);
        }
        // The task starts with the default disposition of SIGPIPE (the shim
        // ignores it, and an ignored signal stays ignored across `exec`) and
        // with no signal blocked.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let mut none = MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(none.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, none.as_ptr(), std::ptr::null_mut());
        libc::execve(child.argv[0], child.argv.as_ptr(), child.envp.as_ptr());
        fail(child)
    }
}

/// Records the last error for the parent and exits (no handler, no flush:
/// nothing of the shim's may run here).
fn fail(child: &Child<'_>) -> ! {
    child.errno.store(Errno::last_raw(), Ordering::Release);
    // SAFETY: _exit ends this process at once.
    unsafe { libc::_exit(127) }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Runs `command` through `spawn` in `cwd`; its output and exit code.
    fn run(command: &str, cwd: &Path, env: &[(&str, &str)]) -> std::io::Result<(String, i32)> {
        run_in(command, cwd, env, None, Inside::Allowed)
    }

    /// [`run`], in `cgroup` when given, made inside it as `into` allows.
    fn run_in(
        command: &str,
        cwd: &Path,
        env: &[(&str, &str)],
        cgroup: Option<&OwnedFd>,
        into: Inside,
    ) -> std::io::Result<(String, i32)> {
        let env: BTreeMap<OsString, OsString> = env.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
        let launch = Launch { command, env: &env, cwd, run_as: None, cgroup, join: &[] };
        let (mut reader, writer) = std::io::pipe()?;
        let pid = spawn_as(&launch, None, writer.into(), into)?;
        let mut out = String::new();
        reader.read_to_string(&mut out)?;
        let code = match waitpid(Pid::from_raw(pid), None)? {
            WaitStatus::Exited(_, code) => code,
            other => panic!("unexpected wait status {other:?}"),
        };
        Ok((out, code))
    }

    /// The tests that spawn, one at a time: one checks that a failed start
    /// left this process no child at all.
    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static SPAWNING: std::sync::Mutex<()> = std::sync::Mutex::new(());
        SPAWNING.lock().unwrap_or_else(|p| p.into_inner())
    }

    #[test]
    fn the_task_gets_its_environment_directory_group_and_streams_and_nothing_more() {
        let _one = one_at_a_time();
        let dir = tempfile::tempdir().unwrap();
        // A descriptor this process leaves open across exec: the task must not get it.
        let null = std::fs::File::open("/dev/null").unwrap();
        let leaked = nix::fcntl::fcntl(null.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD(200)).unwrap();
        let script = r#"echo "env=$(env | grep -v '^PWD=' | sort | tr '\n' ' ')"; echo "cwd=$(pwd)"
            echo "group=$(($(ps -o pgid= -p $$) == $$))"; test -e /proc/$$/fd/200 && echo leaked
            echo err >&2; exec grep -E '^Sig(Blk|Ign)' /proc/self/status"#;
        let (out, code) = run(script, dir.path(), &[("ONLY", "this")]).unwrap();
        // SAFETY: the descriptor was opened above and is closed once.
        drop(unsafe { OwnedFd::from_raw_fd(leaked) });
        assert_eq!(code, 0, "{out}");
        let line =
            |key: &str| out.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("{key} in {out}"));
        assert_eq!(line("env=").trim(), "ONLY=this");
        assert_eq!(Path::new(line("cwd=")), dir.path().canonicalize().unwrap());
        assert_eq!(line("group="), "1", "the task leads its own process group");
        assert!(!out.contains("leaked"), "a descriptor above stderr reached the task: {out}");
        assert!(out.contains("err\n"), "stderr goes where stdout goes: {out}");
        // This test process ignores SIGPIPE (the Rust runtime does) and the
        // shim blocks signals for its signalfd: the task starts with neither.
        assert_eq!(line("SigBlk:").trim(), "0000000000000000");
        let ignored = u64::from_str_radix(line("SigIgn:").trim(), 16).unwrap();
        assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "SIGPIPE is ignored in the task: {out}");
    }

    #[test]
    fn a_step_that_fails_before_exec_is_an_error_and_leaves_no_child() {
        let _one = one_at_a_time();
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        let error = run("echo ran", &missing, &[]).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::ENOENT), "{error}");
        // The failed child was reaped by `spawn` itself.
        assert_eq!(waitpid(None, Some(WaitPidFlag::WNOHANG)), Err(Errno::ECHILD));
        let nul = run("echo \0", dir.path(), &[]).unwrap_err();
        assert_eq!(nul.kind(), std::io::ErrorKind::InvalidInput);
    }

    /// A group of this test process's own in a writable cgroup v2
    /// hierarchy, removed when dropped; `None` (said why) where there is
    /// none.
    struct TestGroup(std::path::PathBuf);

    impl TestGroup {
        fn make(name: &str) -> Option<TestGroup> {
            let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
            let mounts = crate::cgroup::parse_mounts(&read("/proc/self/mounts"));
            let member = crate::cgroup::parse_membership(&read("/proc/self/cgroup"));
            let (Some(mount), Some(own)) = (mounts.unified, member.unified) else {
                eprintln!("skipped: no cgroup v2 hierarchy is mounted");
                return None;
            };
            let dir = crate::cgroup::join(&mount, &own).join(format!("tenure-spawn-{name}-{}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Ok(()) => Some(TestGroup(dir)),
                Err(error) => {
                    eprintln!("skipped: cannot create a cgroup at {}: {error}", dir.display());
                    None
                }
            }
        }
    }

    impl Drop for TestGroup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    /// Whether this kernel has `CLONE_INTO_CGROUP` (5.7).
    fn kernel_has_clone_into_cgroup() -> bool {
        let release =
            nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
        let mut parts = release.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (5, 7)
    }

    #[test]
    fn the_task_runs_in_its_cgroup_made_inside_it_or_joined_first_thing() {
        let _one = one_at_a_time();
        for (name, into) in [("inside", Inside::Allowed), ("joined", Inside::Never)] {
            let Some(group) = TestGroup::make(name) else { return };
            let dir = std::fs::File::open(&group.0).map(OwnedFd::from).unwrap();
            let tmp = tempfile::tempdir().unwrap();
            let (out, code) = run_in("cat /proc/self/cgroup", tmp.path(), &[], Some(&dir), into)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(code, 0, "{name}: {out}");
            let unified = out.lines().find_map(|l| l.strip_prefix("0::")).unwrap_or_else(|| panic!("{name}: {out}"));
            let leaf = group.0.file_name().unwrap().to_str().unwrap();
            assert!(unified.ends_with(&format!("/{leaf}")), "{name}: the task ran in {unified}, not in {leaf}");
            assert_eq!(
                std::fs::read_to_string(group.0.join("cgroup.procs")).unwrap(),
                "",
                "{name}: the group is empty again"
            );
        }
        if kernel_has_clone_into_cgroup() {
            assert!(!NO_CLONE_INTO_CGROUP.load(Ordering::Relaxed), "this kernel makes a child inside its group");
        }
    }

    #[test]
    fn a_group_that_cannot_be_joined_fails_the_start_and_leaves_no_child() {
        let _one = one_at_a_time();
        let tmp = tempfile::tempdir().unwrap();
        // Not a cgroup: neither made inside it nor joined by its `cgroup.procs`.
        let not_a_group = std::fs::File::open(tmp.path()).map(OwnedFd::from).unwrap();
        for into in [Inside::Allowed, Inside::Never] {
            let error = run_in("echo ran", tmp.path(), &[], Some(&not_a_group), into).unwrap_err();
            assert!(error.raw_os_error().is_some(), "{into:?}: {error}");
            assert_eq!(waitpid(None, Some(WaitPidFlag::WNOHANG)), Err(Errno::ECHILD), "{into:?}");
        }
    }
}
