//! The shim launcher: a small single-threaded process the worker starts once
//! and asks to fork each attempt's shim (the fork-server, or zygote, idea).
//!
//! Starting a shim by `exec` of the `tenure` binary cost about 1.5 ms of CPU
//! per attempt on top of the shim's own work (dynamic loading and
//! relocation, CPU feature probing, argument parsing), as much again as the
//! task's `sh -c` itself. A fork of the launcher — already loaded, one thread,
//! a few MiB — costs a fraction of that, and the forked shim is the same
//! per-task process as before: its own session, subreaper of its task, writing
//! the same attempt files. Forking the worker itself is not an option: it is
//! multi-threaded, and after a fork only async-signal-safe code may run.
//!
//! The worker talks to the launcher over a `SOCK_SEQPACKET` socket pair (the
//! launcher's end is its stdin): one request, one reply. A request names the
//! attempt ([`ShimArgs`]); the reply carries the shim's pid and start
//! time, and the worker's end of the attempt's own channel as `SCM_RIGHTS`
//! (a socket pair made for that attempt alone; the shim holds the other
//! end while it supervises the attempt). The worker learns of the attempt's
//! end when the channel reads end-of-file — the shim closes it once the exit
//! evidence is recorded, or dies — and rings it to have the shim look at the
//! attempt's kill and pause wishes. A ring that comes after the attempt
//! ended meets a closed channel and reaches nothing.
//!
//! **A shim serves attempts one after another.** Forking a shim and ending it
//! was a third of what a short task cost the shim and its launcher (the
//! fork, the copies of the pages the shim writes, its exit). So a shim whose
//! attempt ended, with the attempt's exit evidence recorded, tells the
//! launcher it is free and waits on its own socket for the next attempt,
//! which the launcher hands it (the request and the attempt's channel)
//! instead of forking. It never takes an attempt before the previous one's
//! evidence is durable, so a recorded shim that lives while the attempt
//! has no status is still that attempt's. The launcher retires a shim after
//! [`SHIM_ATTEMPTS`] attempts or [`IDLE_RETIRE`] without one, and keeps at
//! most [`MAX_IDLE`] idle.
//!
//! The launcher reaps its shims (it is their parent). When the worker goes,
//! the launcher reads end-of-file and exits, and with it every shim's socket
//! to it closes: an idle shim exits, a busy one keeps supervising its task
//! and exits after it. So the shims a restarted worker finds never take
//! another attempt, and it may signal them by pid. When the launcher dies,
//! the worker starts another on its next request. A request whose reply
//! never came may or may not have started an attempt: the caller treats that
//! attempt as one whose shim it cannot see, never starts it again.
//!
//! The launcher runs as `tenure-shim`, a program with the launcher and the
//! shim and nothing else, when that sits beside the `tenure` binary and is
//! the same build ([`choose_program`]); otherwise as `tenure shim-launcher`.
//! The two serve alike: the smaller program only makes each shim cheaper
//! to fork, run and end, and smaller while it runs.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};
use serde::{Deserialize, Serialize};
use tenure_machine::attempt_files::ProcessId;

use crate::shim::{self, ShimArgs};

/// What `tenure-shim --version` prints. A worker runs a `tenure-shim` only
/// when it prints exactly this: the same version of tenure, speaking the
/// same launch protocol (the request and reply of this module; the number
/// goes up when either changes shape). Shims are forked from the launcher,
/// so they are its build and speak its protocol; only the launcher itself
/// must match.
pub const IDENTITY: &str = concat!("tenure-shim ", env!("CARGO_PKG_VERSION"), " (launch protocol 2)");

/// The small launcher program's file name, looked for beside `tenure`.
pub const SMALL_PROGRAM: &str = "tenure-shim";

/// How long `tenure-shim --version` may take before it is given up on.
const PROBE_BOUND: Duration = Duration::from_secs(5);

/// Largest request or reply: an attempt's paths and names, far below this.
const MAX_MESSAGE: usize = 16 * 1024;
/// How long the worker waits for the launcher's answer to one request (a fork).
const REPLY_BOUND: Duration = Duration::from_secs(10);
/// Attempts one shim serves before the launcher retires it (bounds what a
/// long-lived shim could accumulate).
pub const SHIM_ATTEMPTS: u32 = 1000;
/// Idle shims the launcher keeps; more are retired as they come free.
pub const MAX_IDLE: usize = 64;
/// How long a shim may wait for work before the launcher retires it (a
/// burst's shims do not stay around for good).
pub const IDLE_RETIRE: Duration = Duration::from_secs(60);

/// The launcher's answer to one request.
#[derive(Debug, Serialize, Deserialize)]
enum Reply {
    /// A shim supervises the attempt (forked for it, or an idle one handed
    /// it); the worker's end of the attempt's channel rides along.
    Supervised { pid: i32, start_time: u64 },
    /// No shim took the attempt.
    Failed(String),
    /// A shim was forked but cannot be identified: treated like a reply
    /// that never came.
    Unidentified(String),
}

/// The shim supervising an attempt, as the worker holds it.
#[derive(Debug)]
pub struct Launched {
    pub id: ProcessId,
    /// The worker's end of the attempt's channel: reads end-of-file once
    /// the attempt's evidence is recorded (or its shim died); a byte written
    /// to it has the shim look at the attempt's kill and pause wishes.
    pub channel: OwnedFd,
}

/// Why a shim could not be launched.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// No shim took the attempt: its task did not start.
    #[error("the task shim was not started: {0}")]
    NotStarted(String),
    /// The request reached the launcher but no answer came back: a shim may
    /// have been forked.
    #[error("the shim launcher ended while starting the task shim: {0}")]
    Unknown(String),
}

/// The worker's side: starts the launcher on first use and again after it died.
pub struct Launcher {
    /// The `tenure` binary; the launcher runs `tenure-shim` beside it when
    /// that is the same build ([`choose_program`], asked at every start).
    tenure: PathBuf,
    data_dir: PathBuf,
    conn: Mutex<Option<Conn>>,
}

struct Conn {
    sock: OwnedFd,
    child: Child,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Closing the socket ends the launcher; reap it so no zombie stays.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Launcher {
    /// A launcher run as `PROGRAM shim-launcher --data-dir DATA_DIR`, where
    /// PROGRAM is `tenure-shim` beside `tenure` or `tenure` itself, forking
    /// shims for the attempts under `data_dir`.
    pub fn new(tenure: PathBuf, data_dir: PathBuf) -> Launcher {
        Launcher { tenure, data_dir, conn: Mutex::new(None) }
    }

    /// Has a shim supervise one attempt. Blocking (a fork or a hand-over,
    /// and two socket calls): call it from a blocking thread.
    pub fn launch(&self, args: &ShimArgs) -> Result<Launched, LaunchError> {
        let request = tenure_protocol::encode(args).map_err(|e| LaunchError::NotStarted(e.to_string()))?;
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        // A launcher found dead when the request is sent never received it: one
        // fresh launcher is tried before giving up.
        for fresh in [false, true] {
            if conn.is_none() || fresh {
                // The old launcher, if any, is ended and reaped first.
                *conn = None;
                *conn = Some(self.start().map_err(LaunchError::NotStarted)?);
            }
            let Some(c) = conn.as_ref() else { continue };
            if let Err(error) =
                sendmsg(&c.sock, &[IoSlice::new(&request)], &mut SendAncillaryBuffer::default(), SendFlags::NOSIGNAL)
            {
                tracing::warn!(%error, "shim launcher gone; starting another");
                continue;
            }
            return match receive(&c.sock) {
                Ok((Reply::Supervised { pid, start_time }, Some(channel))) => {
                    Ok(Launched { id: ProcessId { pid, start_time }, channel })
                }
                Ok((Reply::Supervised { pid, .. }, None)) => {
                    Err(LaunchError::Unknown(format!("shim {pid} took the attempt but its channel did not come")))
                }
                Ok((Reply::Failed(reason), _)) => Err(LaunchError::NotStarted(reason)),
                Ok((Reply::Unidentified(reason), _)) => Err(LaunchError::Unknown(reason)),
                Err(reason) => {
                    *conn = None;
                    Err(LaunchError::Unknown(reason))
                }
            };
        }
        Err(LaunchError::NotStarted("the shim launcher does not take requests".into()))
    }

    fn start(&self) -> Result<Conn, String> {
        let flags = SocketFlags::CLOEXEC;
        let (ours, theirs) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)
            .map_err(|e| format!("cannot create the launcher socket: {e}"))?;
        // A launcher that does not answer (stopped, wedged) is given up on and
        // replaced rather than waited for forever.
        rustix::net::sockopt::set_socket_timeout(&ours, rustix::net::sockopt::Timeout::Recv, Some(REPLY_BOUND))
            .map_err(|e| format!("cannot bound the launcher's answers: {e}"))?;
        // Asked at every start, not once: binaries replaced under a running
        // worker are found out when its launcher is next started.
        let choice = choose_program(&self.tenure);
        let program = choice.program(&self.tenure);
        let child = Command::new(&program)
            .arg("shim-launcher")
            .arg("--data-dir")
            .arg(&self.data_dir)
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the shim launcher {}: {e}", program.display()))?;
        match choice {
            Choice::Small(_) => {
                tracing::info!(launcher = child.id(), "shim launcher started: shims are forked from tenure-shim")
            }
            Choice::Absent => tracing::info!(
                launcher = child.id(),
                "shim launcher started: no tenure-shim beside {}, so shims are forked from tenure itself \
                 (install tenure-shim beside it for smaller shims)",
                self.tenure.display()
            ),
            Choice::Unusable(why) => tracing::warn!(
                launcher = child.id(),
                %why,
                "shim launcher started: tenure-shim is not this worker's build, so shims are forked from tenure itself"
            ),
        }
        Ok(Conn { sock: ours, child })
    }
}

/// Which program a worker started from the `tenure` binary runs as its
/// launcher.
#[derive(Debug, PartialEq, Eq)]
pub enum Choice {
    /// `tenure-shim` beside `tenure`, of the same build.
    Small(PathBuf),
    /// No `tenure-shim` beside `tenure`: `tenure shim-launcher` serves.
    Absent,
    /// A `tenure-shim` that is another build, or did not say which (the
    /// reason): `tenure shim-launcher` serves, and the operator is told.
    Unusable(String),
}

impl Choice {
    /// The program to start, given the `tenure` binary's path.
    pub fn program(&self, tenure: &Path) -> PathBuf {
        match self {
            Choice::Small(small) => small.clone(),
            Choice::Absent | Choice::Unusable(_) => tenure.to_path_buf(),
        }
    }
}

/// Looks for `tenure-shim` beside `tenure` (the worker's own binary, its
/// real path) and asks it which build it is. Run at every launcher start:
/// an upgrade that replaced one of the two binaries and not the other falls
/// back to `tenure shim-launcher` instead of speaking a protocol the
/// launcher may not share.
pub fn choose_program(tenure: &Path) -> Choice {
    let small = tenure.with_file_name(SMALL_PROGRAM);
    if !small.exists() {
        return Choice::Absent;
    }
    match identify(&small, PROBE_BOUND) {
        Ok(said) if said == IDENTITY => Choice::Small(small),
        Ok(said) => Choice::Unusable(format!("{} is {said:?}, not {IDENTITY:?}", small.display())),
        Err(reason) => Choice::Unusable(format!("{} --version: {reason}", small.display())),
    }
}

/// The first line `PROGRAM --version` prints, within `bound`.
fn identify(program: &Path, bound: Duration) -> Result<String, String> {
    use std::io::Read;
    let mut child = Command::new(program)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let deadline = std::time::Instant::now() + bound;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {bound:?}"));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    if !status.success() {
        return Err(format!("exited with {status}"));
    }
    let mut said = String::new();
    if let Some(out) = child.stdout.take() {
        // Its whole answer is one short line; more is not a launcher's.
        out.take(1024).read_to_string(&mut said).map_err(|e| e.to_string())?;
    }
    Ok(said.lines().next().unwrap_or_default().to_owned())
}

/// One reply and the attempt's channel that may ride with it.
fn receive(sock: &OwnedFd) -> Result<(Reply, Option<OwnedFd>), String> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let (got, channel) = recv_with_fd(sock, &mut buf).map_err(|e| e.to_string())?;
    if got == 0 {
        return Err("the launcher closed its socket".into());
    }
    let reply = tenure_protocol::decode(&buf[..got]).map_err(|e| format!("malformed launcher reply: {e}"))?;
    Ok((reply, channel))
}

/// One message into `buf` and the descriptor riding with it, if any (more
/// than one is closed: no message here carries more).
fn recv_with_fd(sock: &OwnedFd, buf: &mut [u8]) -> rustix::io::Result<(usize, Option<OwnedFd>)> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(sock, &mut [IoSliceMut::new(buf)], &mut control, RecvFlags::CMSG_CLOEXEC)?;
    let fd = control
        .drain()
        .filter_map(|m| match m {
            RecvAncillaryMessage::ScmRights(fds) => Some(fds),
            _ => None,
        })
        .flatten()
        .next();
    Ok((got.bytes, fd))
}

/// One message, with `fd` riding along when given.
fn send_with_fd(sock: &OwnedFd, bytes: &[u8], fd: Option<&OwnedFd>) -> rustix::io::Result<usize> {
    let fds: Vec<_> = fd.iter().map(|fd| fd.as_fd()).collect();
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    sendmsg(sock, &[IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL)
}

/// The launcher process (`tenure shim-launcher`): serves requests on its
/// stdin until the worker closes it, for attempts under `data_dir` only (the
/// shims it forks show the same command line, so `ps` says whose they are).
/// Returns the exit code.
///
/// It must stay single-threaded (it forks): no runtime, no logging threads.
pub fn serve(data_dir: &std::path::Path) -> i32 {
    // SAFETY: the worker passed the launcher's end of the socket pair as stdin;
    // nothing else in this process uses fd 0.
    let sock = unsafe { OwnedFd::from_raw_fd(0) };
    // Wake up now and then to reap shims that ended (no signal handling
    // needed: a zombie shim already reads as exited through its pidfd).
    if let Err(error) = rustix::net::sockopt::set_socket_timeout(
        &sock,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_millis(200)),
    ) {
        tracing::warn!(%error, "shim launcher cannot set a receive timeout; shims are reaped per request");
    }
    // The CPU's features, detected once here for every shim forked from
    // this process (the journal's checksums ask for them; in a virtual
    // machine each `cpuid` traps, and each shim would ask again).
    #[cfg(target_arch = "x86_64")]
    let _ = std::arch::is_x86_feature_detected!("pclmulqdq");
    // The shims' log span, registered here once (see `shim::span`).
    drop(shim::span("-", "-"));
    // Every shim's stdin and stdout, opened once for all of them.
    let null = match std::fs::File::open("/dev/null") {
        Ok(f) => f,
        Err(error) => {
            tracing::error!(%error, "shim launcher cannot open /dev/null");
            return 1;
        }
    };
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut pool = Pool::default();
    loop {
        // Every shim that ended.
        crate::process::reap_ended_children();
        let got = match rustix::net::recv(&sock, &mut buf, RecvFlags::empty()) {
            Ok((0, _)) => return 0,
            Ok((n, _)) => n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {
                pool.settle(Instant::now());
                continue;
            }
            Err(error) => {
                tracing::error!(%error, "shim launcher cannot read requests");
                return 1;
            }
        };
        let (reply, channel) = match tenure_protocol::decode::<ShimArgs>(&buf[..got]) {
            Ok(args) if args.data_dir != data_dir => {
                (Reply::Failed(format!("{} is not this launcher's data dir", args.data_dir.display())), None)
            }
            Ok(args) => pool.supervise(&args, &buf[..got], &null),
            Err(error) => (Reply::Failed(format!("malformed launch request: {error}")), None),
        };
        let bytes = match tenure_protocol::encode(&reply) {
            Ok(b) => b,
            Err(error) => {
                tracing::error!(%error, "shim launcher cannot encode a reply");
                return 1;
            }
        };
        if let Err(error) = send_with_fd(&sock, &bytes, channel.as_ref()) {
            // The worker is gone; the shim runs on regardless.
            tracing::warn!(%error, "shim launcher cannot answer the worker");
            return 0;
        }
    }
}

/// The shims this launcher forked and still holds a socket to.
#[derive(Default)]
struct Pool {
    shims: Vec<Pooled>,
}

/// One shim: its identity, the launcher's end of its socket, since when it
/// is free (it said so since it was last handed an attempt), and how many
/// attempts it took.
struct Pooled {
    id: ProcessId,
    sock: OwnedFd,
    free_since: Option<Instant>,
    served: u32,
}

impl Pool {
    /// Has a shim supervise the attempt `args` (`request` is its encoded
    /// form): an idle one if there is one, else a new one forked for it.
    fn supervise(&mut self, args: &ShimArgs, request: &[u8], null: &std::fs::File) -> (Reply, Option<OwnedFd>) {
        self.settle(Instant::now());
        let (ours, theirs) = match socketpair(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None) {
            Ok(pair) => pair,
            Err(error) => return (Reply::Failed(format!("cannot make the attempt's channel: {error}")), None),
        };
        while let Some(i) = self.shims.iter().position(|s| s.free_since.is_some()) {
            let shim = &mut self.shims[i];
            if send_with_fd(&shim.sock, request, Some(&theirs)).is_ok() {
                shim.free_since = None;
                shim.served += 1;
                let reply = Reply::Supervised { pid: shim.id.pid, start_time: shim.id.start_time };
                return (reply, Some(ours));
            }
            // Gone since it said it was free: never handed the attempt.
            self.shims.swap_remove(i);
        }
        self.fork(args, theirs, null, ours)
    }

    /// Marks the shims that said they are free (as of `now`), forgets those
    /// that are gone, and retires those past their attempts, idle for
    /// [`IDLE_RETIRE`], or beyond [`MAX_IDLE`] (their socket closed: an idle
    /// shim exits on it).
    fn settle(&mut self, now: Instant) {
        let mut idle = 0;
        self.shims.retain_mut(|shim| {
            let since = match shim.free_since {
                Some(since) => since,
                None => {
                    let mut said = [0u8; 1];
                    match rustix::net::recv(&shim.sock, &mut said, RecvFlags::DONTWAIT) {
                        Ok((1, _)) => *shim.free_since.insert(now),
                        Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return true,
                        _ => return false,
                    }
                }
            };
            idle += 1;
            idle <= MAX_IDLE && shim.served < SHIM_ATTEMPTS && now.saturating_duration_since(since) < IDLE_RETIRE
        });
    }

    /// Forks a shim for the attempt; in the child, serves it and the
    /// attempts handed to it after, then exits. `null` is `/dev/null`, which
    /// becomes the shim's stdin and stdout.
    fn fork(
        &mut self,
        args: &ShimArgs,
        channel: OwnedFd,
        null: &std::fs::File,
        ours: OwnedFd,
    ) -> (Reply, Option<OwnedFd>) {
        let (to_shim, shims_end) =
            match socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None) {
                Ok(pair) => pair,
                Err(error) => return (Reply::Failed(format!("cannot make a shim's socket: {error}")), None),
            };
        // SAFETY: this process has one thread (it runs no runtime and starts
        // no thread), so the child may run any code, not only
        // async-signal-safe code.
        match unsafe { nix::unistd::fork() } {
            Err(error) => (Reply::Failed(format!("fork failed: {error}")), None),
            Ok(nix::unistd::ForkResult::Child) => {
                // The other shims' sockets are not this one's to hold: one held
                // here would keep an idle shim from seeing the launcher go.
                self.shims.clear();
                drop((to_shim, ours));
                // Stdin (the worker's socket) and stdout become /dev/null;
                // stderr stays the worker's log, where the shim's few lines
                // belong.
                let fd = std::os::fd::AsRawFd::as_raw_fd(null);
                let redirected = nix::unistd::dup2(fd, 0).is_ok() && nix::unistd::dup2(fd, 1).is_ok();
                // The launcher's own descriptor is not the shim's to keep (this
                // branch never returns, so nothing closes it again).
                let _ = nix::unistd::close(fd);
                let code = if redirected { serve_attempts(args.clone(), channel, &shims_end) } else { 1 };
                // Straight out: the shim holds no buffered output (its log lines
                // are written as they are made, stdout is /dev/null) and nothing
                // of the launcher's exit handlers is its to run.
                // SAFETY: `_exit` ends the process at once; nothing runs after it.
                unsafe { nix::libc::_exit(code) }
            }
            Ok(nix::unistd::ForkResult::Parent { child }) => {
                let pid = child.as_raw();
                match ProcessId::of(pid) {
                    Some(id) => {
                        self.shims.push(Pooled { id, sock: to_shim, free_since: None, served: 1 });
                        (Reply::Supervised { pid, start_time: id.start_time }, Some(ours))
                    }
                    None => (Reply::Unidentified(format!("shim {pid} forked but not found in /proc")), None),
                }
            }
        }
    }
}

/// A shim's life: supervises `first`, then each attempt the launcher hands
/// it on `launcher`, until the launcher retires it or goes (end-of-file),
/// SIGTERM comes while it is idle, or an attempt's evidence could not be
/// recorded. Only once an attempt's evidence is recorded is the launcher
/// told the shim is free, and the attempt's channel closed.
///
/// Leaving, it removes the worker's parent cgroups if no attempt is left in
/// them: after the worker stopped or died, the last shim to end cleans up.
fn serve_attempts(first: ShimArgs, channel: OwnedFd, launcher: &OwnedFd) -> i32 {
    let life = shim::Life::begin();
    let (mut args, mut channel) = (first, channel);
    let mut buf = vec![0u8; MAX_MESSAGE];
    let code = loop {
        let code = shim::run(&args, &life, &channel);
        // Free once the evidence is recorded (said before the channel closes,
        // so that the launcher knows it before the worker can ask again).
        let free = code == 0 && life.can_wait() && rustix::net::send(launcher, &[1], SendFlags::NOSIGNAL).is_ok();
        drop(channel);
        if !free || !life.idle(launcher.as_fd()) {
            break code;
        }
        let next = match recv_with_fd(launcher, &mut buf) {
            Ok((0, _)) | Err(_) => break 0,
            Ok((n, Some(fd))) => tenure_protocol::decode::<ShimArgs>(&buf[..n]).ok().map(|a| (a, fd)),
            Ok((_, None)) => None,
        };
        // The launcher only ever sends a request with its channel; anything
        // else is not a launcher's, and the shim leaves.
        let Some(next) = next else { break 1 };
        (args, channel) = next;
    };
    if let Some(plan) = &args.cgroups {
        crate::cgroup_fs::remove_parents(plan);
    }
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of `n` stand-in shims (socket pairs, no processes): the pool
    /// and the shims' ends of their sockets.
    fn pool_of(n: usize) -> (Pool, Vec<OwnedFd>) {
        let mut pool = Pool::default();
        let mut ends = Vec::new();
        for pid in 0..n as i32 {
            let (ours, theirs) =
                socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
            pool.shims.push(Pooled { id: ProcessId { pid, start_time: 0 }, sock: ours, free_since: None, served: 1 });
            ends.push(theirs);
        }
        (pool, ends)
    }

    fn free(end: &OwnedFd) {
        assert_eq!(rustix::net::send(end, &[1], SendFlags::empty()).unwrap(), 1);
    }

    /// Whether the launcher closed this shim's socket (retired or forgotten).
    fn retired(end: &OwnedFd) -> bool {
        let mut b = [0u8; 1];
        matches!(rustix::net::recv(end, &mut b, RecvFlags::DONTWAIT), Ok((0, _)))
    }

    fn pids(pool: &Pool) -> Vec<i32> {
        pool.shims.iter().map(|s| s.id.pid).collect()
    }

    #[test]
    fn a_shim_is_kept_while_busy_and_retired_once_free_after_its_attempts_or_idle_too_long() {
        let (mut pool, ends) = pool_of(4);
        let t0 = Instant::now();
        pool.shims[1].served = SHIM_ATTEMPTS;
        pool.shims[2].served = SHIM_ATTEMPTS;
        // 0, 1 and 3 say they are free; 2 is busy past its attempts.
        for i in [0, 1, 3] {
            free(&ends[i]);
        }
        pool.settle(t0);
        assert_eq!(pids(&pool), [0, 2, 3], "only the free shim past its attempts goes");
        assert!(retired(&ends[1]) && !retired(&ends[0]) && !retired(&ends[2]) && !retired(&ends[3]));
        // An idle shim stays until it waited IDLE_RETIRE; a busy one stays.
        pool.settle(t0 + IDLE_RETIRE - Duration::from_millis(1));
        assert_eq!(pids(&pool), [0, 2, 3]);
        pool.settle(t0 + IDLE_RETIRE);
        assert_eq!(pids(&pool), [2], "the busy shim stays however long");
        assert!(retired(&ends[0]) && retired(&ends[3]) && !retired(&ends[2]));
        // Free now, past its attempts: retired at once.
        free(&ends[2]);
        pool.settle(t0 + IDLE_RETIRE);
        assert!(pool.shims.is_empty() && retired(&ends[2]));
    }

    #[test]
    fn at_most_max_idle_shims_wait_and_a_gone_one_is_forgotten() {
        let (mut pool, ends) = pool_of(MAX_IDLE + 3);
        for end in &ends[..MAX_IDLE + 2] {
            free(end);
        }
        // Every shim then dies: the free ones said so first, the last died
        // busy (its socket reads end-of-file with nothing before it).
        drop(ends);
        pool.settle(Instant::now());
        assert_eq!(pool.shims.len(), MAX_IDLE);
        assert!(pool.shims.iter().all(|s| s.free_since.is_some()));
    }

    /// A directory holding a stand-in `tenure` and, if given, a
    /// `tenure-shim` that is a link to `target`.
    fn beside(target: Option<&str>) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let tenure = dir.path().join("tenure");
        std::fs::write(&tenure, b"").unwrap();
        if let Some(target) = target {
            std::os::unix::fs::symlink(target, dir.path().join(SMALL_PROGRAM)).unwrap();
        }
        (dir, tenure)
    }

    #[test]
    fn without_tenure_shim_beside_it_the_tenure_binary_serves() {
        let (_dir, tenure) = beside(None);
        let choice = choose_program(&tenure);
        assert_eq!(choice, Choice::Absent);
        assert_eq!(choice.program(&tenure), tenure);
    }

    #[test]
    fn a_tenure_shim_of_another_build_is_not_used() {
        // `echo --version` answers, but not with this build's identity.
        let (_dir, tenure) = beside(Some("/bin/echo"));
        let choice = choose_program(&tenure);
        let Choice::Unusable(why) = &choice else { panic!("used: {choice:?}") };
        assert!(why.contains(IDENTITY), "{why}");
        assert_eq!(choice.program(&tenure), tenure);
    }

    #[test]
    fn a_tenure_shim_that_fails_or_cannot_run_is_not_used() {
        for target in ["/bin/false", "/nonexistent/tenure-shim"] {
            let (_dir, tenure) = beside(Some(target));
            let choice = choose_program(&tenure);
            // A dangling link does not exist: it is as absent as no file.
            if target.starts_with("/nonexistent") {
                assert_eq!(choice, Choice::Absent);
            } else {
                assert!(matches!(&choice, Choice::Unusable(why) if why.contains("exited")), "{choice:?}");
            }
            assert_eq!(choice.program(&tenure), tenure);
        }
    }

    #[test]
    fn a_tenure_shim_that_is_not_a_program_is_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let tenure = dir.path().join("tenure");
        std::fs::create_dir(dir.path().join(SMALL_PROGRAM)).unwrap();
        let choice = choose_program(&tenure);
        assert!(matches!(&choice, Choice::Unusable(why) if why.contains("--version")), "{choice:?}");
    }
}
