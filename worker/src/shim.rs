//! The per-task shim: a small process that supervises one attempt at a time
//! and owns its task's process group, so that the task outlives the worker
//! (the containerd-shim / Nomad executor idea). The worker's shim launcher
//! forks it ([`crate::launcher`]), and hands it further attempts once it is
//! free; while it supervises an attempt it depends on neither.
//!
//! It detaches into its own session, becomes the child subreaper of everything
//! the task forks, spawns `sh -c COMMAND` as the leader of a new process group
//! — with a cleared environment, in the attempt's scratch directory (or the
//! spec's `cwd`), as the `--run-as` user when one is set ([`crate::sandbox`]) —
//! pumps the group's stdout and stderr (one pipe, so their order is kept) into
//! the task's output file up to a cap, and when the leader exits — or SIGTERM
//! asks it to stop the task — ends the whole group and records the exit evidence
//! in the attempt's journal. Then it closes the attempt's channel, which tells
//! the worker the attempt is over, and waits for the next attempt or exits
//! ([`crate::launcher`]).
//!
//! For an `agent` task it first creates the attempt's input FIFO, gives its read
//! end to the task as stdin and holds it open read-write until the group is
//! gone, then removes it (before the status, so nobody can write to an ended
//! task). The sidecar writes `tenure send` input into it; the worker is not
//! involved, so input reaches the task while the worker is down.
//!
//! A pause is the owner's wish recorded in the attempt's `pause-requested`
//! file by the worker, which then sends the shim `SIGUSR1` (or rings the
//! attempt's channel, which is the same to the shim): the shim stops the
//! whole group (`SIGSTOP`) or lets it go on (`SIGCONT`) as the file says, and
//! stops it again at every `SIGUSR1` while the wish stands — a restarted
//! worker re-attaching to it sends one, so the stop is re-applied after a
//! re-attach. Ending the group continues it after its SIGTERM, so that a
//! paused task can handle the signal.
//!
//! Where the worker uses cgroups ([`crate::cgroup`]), the shim makes the
//! attempt's own cgroup with the task's resource limits before the task
//! exists, and the task's first process joins it before `exec` (the shim
//! itself stays outside): ending the task then also reaches every process of
//! the cgroup (SIGTERM, then `cgroup.kill`), the attempt is over only once
//! the cgroup is empty, a pause also freezes it, and a process the memory
//! limit ended makes the task fail as `out-of-memory`. The shim removes the
//! cgroup once it is empty.
//!
//! For a `monitor` task it also scans every output line (those past the cap
//! too) against the task's pattern and appends the matching ones to the
//! attempt's `matches` file, which the worker forwards to the leader.
//!
//! It never talks to NATS or the sidecar: the worker reads what it leaves
//! behind, whether it is the worker that launched it or a restarted one that
//! re-attaches to it.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use serde::{Deserialize, Serialize};
use tenure_machine::Layout;
use tenure_protocol::messages::LeaseGrant;
use tenure_protocol::resources::OUT_OF_MEMORY;
use tenure_protocol::{Attempt, Ending, Kind, Outcome, TaskId};

use crate::capture::{LineMatcher, OutputFile, Pump};
use crate::cgroup::{self, Plan};
use crate::cgroup_fs::AttemptGroup;
use crate::limits::Deadlines;
use crate::process;
use crate::sandbox::{self, RunAs};
use tenure_machine::attempt_files::{AttemptFiles, InputFifo, ProcessId, ShimJournal, ShimStatus};

/// Default output cap per task.
pub const DEFAULT_OUTPUT_CAP: u64 = 64 * 1024 * 1024;

/// What the shim is told: which attempt, and the worker's settings for it
/// (the rest — what to run — it reads from the attempt's `grant` file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShimArgs {
    pub data_dir: PathBuf,
    pub task: TaskId,
    pub attempt: Attempt,
    pub output_cap: u64,
    pub kill_grace: Duration,
    /// The attempt's scratch directory, made by the worker: the task's `HOME`
    /// and, without a spec `cwd`, its working directory.
    pub scratch: PathBuf,
    /// The user the task runs as (the shim itself stays the worker's user).
    pub run_as: Option<RunAs>,
    /// The NATS servers as the task sees them (no credentials).
    pub nats: String,
    /// Where the attempt's control groups go ([`crate::cgroup`]); `None`:
    /// the task runs without them.
    #[serde(default)]
    pub cgroups: Option<Plan>,
}

/// Runs the shim to completion. Returns the process exit code: 0 when the
/// exit evidence was recorded, 1 when it could not be (the worker then treats
/// the attempt as having no evidence).
///
/// It is one thread and no runtime: a `poll` over the output pipe, the
/// attempt's `channel` and the shim's signalfd (SIGCHLD, SIGTERM, SIGUSR1)
/// drives everything.
pub fn run(args: &ShimArgs, life: &Life, channel: &OwnedFd) -> i32 {
    let _span = span(&args.task, args.attempt).entered();
    let layout = Layout::new(&args.data_dir);
    let files = layout.attempt_files(&args.task, args.attempt);
    // The journal is opened once: read for the grant, then appended to.
    let opened = files.open_for_shim();
    let recorded = opened.and_then(|(mut journal, facts)| {
        let me = life.me.as_ref().map_err(|e| std::io::Error::new(e.kind(), e.to_string()))?;
        journal.write_shim(*me).map(|()| (journal, facts))
    });
    let (mut journal, facts) = match recorded {
        Ok(opened) => opened,
        Err(error) => {
            tracing::error!(files = %files.base().display(), %error, "shim cannot record itself; not starting the task");
            return 1;
        }
    };
    let status = supervise(args, &layout, &files, facts.grant, &mut journal, life, channel);
    match journal.write_status(&status) {
        Ok(()) => 0,
        Err(error) => {
            tracing::error!(%error, "shim cannot record the exit status");
            1
        }
    }
}

/// What a shim holds for its whole life, whatever attempt it supervises.
pub struct Life {
    /// This process, as every attempt's journal records it (read once).
    me: std::io::Result<ProcessId>,
    /// SIGCHLD, SIGTERM and SIGUSR1, blocked from the shim's start on and
    /// read here (the task itself starts with none blocked). `Err`: the
    /// shim cannot watch signals, and fails the attempt saying so.
    signals: Result<SignalFd, Errno>,
}

impl Life {
    /// Once per shim, before its first attempt: its own session (the
    /// worker's death, its terminal, or a signal to its process group never
    /// reaches it), the reaper of every orphaned process of its tasks, and
    /// its signals blocked — so that none is missed, in an attempt or between
    /// two.
    pub fn begin() -> Life {
        let _ = nix::unistd::setsid();
        process::become_subreaper();
        let mut signals = SigSet::empty();
        signals.add(Signal::SIGCHLD);
        signals.add(Signal::SIGTERM);
        signals.add(Signal::SIGUSR1);
        let signals = signals
            .thread_block()
            .and_then(|()| SignalFd::with_flags(&signals, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC));
        Life { me: ProcessId::current(), signals }
    }

    /// Whether it can wait for another attempt: only with its signals watched.
    pub fn can_wait(&self) -> bool {
        self.signals.is_ok()
    }

    /// Waits, between two attempts, until `next` is readable: true. SIGTERM
    /// while nothing is there ends the wait and the shim: false. A request
    /// and SIGTERM together: the request is taken, and the signal stays for
    /// the attempt to read (as the machine stopping it). Other signals are
    /// read and let go, leftover children reaped.
    pub fn idle(&self, next: std::os::fd::BorrowedFd<'_>) -> bool {
        let Ok(signalfd) = &self.signals else { return false };
        loop {
            let mut fds = [PollFd::new(next, PollFlags::POLLIN), PollFd::new(signalfd.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return false,
            }
            if fds[0].revents().is_some_and(|r| !r.is_empty()) {
                return true;
            }
            while let Ok(Some(info)) = signalfd.read_signal() {
                if info.ssi_signo == Signal::SIGTERM as u32 {
                    return false;
                }
            }
            process::reap_ended_children();
        }
    }
}

/// The span every line of a shim is logged in. The launcher makes one before
/// it forks any shim ([`crate::launcher::serve`]), so that each shim finds
/// its place registered with the log subscriber instead of registering it
/// again after its fork (in every page it touches, a copy).
pub fn span(task: impl std::fmt::Display, attempt: impl std::fmt::Display) -> tracing::Span {
    tracing::info_span!("shim", task = %task, attempt = %attempt)
}

/// An agent's input pipe while its task may read it: held open (so the task
/// never reads end-of-file and a sender finds a reader), and removed before
/// it is let go, on every way out of [`supervise`] — a sender then finds no
/// pipe and is told the task ended.
struct HeldInput<'a> {
    files: &'a AttemptFiles,
    _keeper: std::fs::File,
}

impl Drop for HeldInput<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.files.remove_input() {
            tracing::warn!(%error, "shim cannot remove the input pipe");
        }
    }
}

fn supervise(
    args: &ShimArgs,
    layout: &Layout,
    files: &AttemptFiles,
    grant: Option<LeaseGrant>,
    journal: &mut ShimJournal,
    life: &Life,
    channel: &OwnedFd,
) -> ShimStatus {
    let failed =
        |detail: String| ShimStatus { outcome: Outcome::new(Ending::Failed, None, Some(detail)), output_written: 0 };
    let Some(LeaseGrant { spec, owner, input: kept, .. }) = grant else {
        return failed("cannot read the task's grant: no readable grant in the attempt's journal".into());
    };
    // An agent's input: created before the task exists, held until it is
    // gone. Input kept for a resumed attempt is in it before the task reads.
    let (input, stdin) = if spec.kind == Kind::agent() {
        match files.create_input() {
            Ok(InputFifo { mut keeper, stdin }) => {
                let write = write_kept_input(&mut keeper, &kept);
                let input = HeldInput { files, _keeper: keeper };
                if let Err(e) = write {
                    return failed(format!("cannot write the input kept for the task: {e}"));
                }
                (Some(input), Some(OwnedFd::from(stdin)))
            }
            Err(e) => return failed(format!("cannot create the input pipe: {e}")),
        }
    } else {
        (None, None)
    };
    let output_path = layout.output_path(&args.task);
    let output = match OutputFile::prepare(&output_path) {
        Ok(o) => o,
        Err(e) => return failed(format!("cannot open output file {}: {e}", output_path.display())),
    };
    let (reader, writer) = match std::io::pipe() {
        Ok(p) => p,
        Err(e) => return failed(format!("cannot create the output pipe: {e}")),
    };
    let signalfd = match &life.signals {
        Ok(fd) => fd,
        Err(e) => return failed(format!("cannot watch signals: {e}")),
    };
    // Rung by the worker to have the wishes looked at; watched while open.
    let mut channel = Some(channel.as_fd());
    // A cleared environment in which every process of the task can say which
    // task and attempt it belongs to; its own directory, never the data dir.
    let who = sandbox::Identity { task: &args.task, attempt: args.attempt, session: &owner };
    let env = sandbox::task_env(&spec.env, who, &args.nats, &args.scratch);
    let cwd = spec.cwd.as_deref().map(Path::new).unwrap_or(&args.scratch);
    // The attempt's own control groups, with its limits, made before the
    // task exists; its first process joins them before it runs anything.
    let limits = spec.resources.as_deref();
    let cgroup = match (&args.cgroups, limits) {
        (Some(plan), _) => {
            let name = cgroup::attempt_name(&args.task, args.attempt);
            match AttemptGroup::create(plan, &name, limits) {
                Ok(group) => Some(group),
                Err(e) => return failed(format!("cannot set up the task's cgroup: {e}")),
            }
        }
        (None, Some(_)) => {
            return failed("resource limits cannot be enforced: this worker runs without cgroups".into())
        }
        (None, None) => None,
    };
    let (group_dir, join) = match cgroup.as_ref().map(AttemptGroup::open_for_task).transpose() {
        Ok(Some((dir, join))) => (Some(dir), join),
        Ok(None) => (None, Vec::new()),
        Err(e) => {
            remove_cgroup(cgroup.as_ref());
            return failed(format!("cannot set up the task's cgroup: {e}"));
        }
    };
    let run_as = args.run_as.as_ref();
    let launch =
        process::Launch { command: &spec.command, env: &env, cwd, run_as, cgroup: group_dir.as_ref(), join: &join };
    let leader = match process::spawn(&launch, stdin, writer) {
        Ok(pid) => pid,
        Err(e) => {
            remove_cgroup(cgroup.as_ref());
            let user = args.run_as.as_ref().map(|r| format!(" as user {}", r.user)).unwrap_or_default();
            return failed(format!("the task could not start{user} in {}: {e}", cwd.display()));
        }
    };
    drop((group_dir, join));
    if let Err(error) = journal.write_pgid(leader) {
        tracing::warn!(%error, "shim cannot record the process group");
    }
    let matcher = match spec.line_pattern().map(|p| LineMatcher::new(&p, files)) {
        None => None,
        Some(Ok(m)) => Some(m),
        // Validated at submit; a failure here is the matches file.
        Some(Err(e)) => {
            tracing::warn!(error = %e, "shim cannot record matched lines");
            None
        }
    };
    let mut pump = Pump::new(reader, output, args.output_cap, matcher);
    let memory = limits.and_then(|l| l.memory_bytes);
    let mut group = Group::new(leader, args.kill_grace, cgroup, memory);
    let mut clock = Deadlines::new(spec.limits.as_deref(), Instant::now());
    // A pause recorded before the group was (the worker signals only a shim
    // that recorded its group: before that, SIGUSR1 was not blocked yet).
    if files.pause_requested() && group.hold(true) == Some(true) {
        clock.pause(Instant::now());
    }
    while !group.done(pump.reader.is_none()) {
        let timeout = match clock.next_in(Instant::now()).filter(|_| group.running()) {
            // Rounded up, so the limit has passed when poll returns.
            Some(due) => PollTimeout::try_from(due + Duration::from_millis(1)).unwrap_or(PollTimeout::MAX),
            None => group.wake_in(),
        };
        // The signalfd, the channel and the pipe, the last two while open
        // (a closed one's slot watches the signalfd again).
        let pipe = pump.reader.as_ref().map(|r| r.as_fd());
        let mut fds = [
            PollFd::new(signalfd.as_fd(), PollFlags::POLLIN),
            PollFd::new(channel.unwrap_or(signalfd.as_fd()), PollFlags::POLLIN),
            PollFd::new(pipe.unwrap_or(signalfd.as_fd()), PollFlags::POLLIN),
        ];
        match poll(&mut fds, timeout) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(e) => {
                tracing::error!(error = %e, "shim cannot wait; ending the task");
                group.abort(format!("the shim could not wait for the task: {e}"));
                std::thread::sleep(ENDING_CHECK);
            }
        }
        let ready = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
        let (rung, output_ready) = (channel.filter(|_| ready(1)), pipe.is_some() && ready(2));
        if output_ready {
            pump.step();
            clock.output(Instant::now());
        }
        if group.running() {
            if let Some(reason) = clock.passed(Instant::now()) {
                tracing::info!(%reason, "ending the task: a time limit passed");
                group.abort(reason);
            }
        }
        if let Some(rung) = rung {
            let mut bell = [0u8; 64];
            match rustix::net::recv(rung, &mut bell, rustix::net::RecvFlags::DONTWAIT) {
                // The worker let go of the attempt (it ended or restarted):
                // nothing will ring again.
                Ok((0, _)) => channel = None,
                Ok(_) => {
                    if files.kill_requested() {
                        group.kill_requested();
                    }
                    look_at_the_pause_wish(&mut group, &mut clock, files);
                }
                Err(_) => {}
            }
        }
        while let Ok(Some(info)) = signalfd.read_signal() {
            if info.ssi_signo == Signal::SIGUSR1 as u32 {
                look_at_the_pause_wish(&mut group, &mut clock, files);
            }
            if info.ssi_signo == Signal::SIGTERM as u32 {
                // The worker marks a kill before it signals (a restarted
                // worker's way to ask; the launching one rings); any other SIGTERM
                // is the machine (or an operator's `kill`) stopping processes.
                match files.kill_requested() {
                    true => group.kill_requested(),
                    false => group.shutdown(info.ssi_pid),
                }
            }
        }
        group.reap();
        group.advance();
    }
    // Nobody reads the input any more: a sender now finds no pipe and is told
    // the task ended.
    drop(input);
    let (written, dropped, file_exists) = pump.finish();
    // The output file's data was synced by `finish`; its entry (created by
    // this attempt or an earlier one) needs the directory synced too. A
    // task that never wrote a byte has no file, and nothing to sync.
    if file_exists {
        if let Err(error) = tenure_machine::layout::sync_dir(&layout.output_dir()) {
            tracing::warn!(%error, "shim cannot sync the output directory");
        }
    }
    let mut outcome = group.outcome();
    outcome.output_dropped = dropped;
    remove_cgroup(group.cgroup.as_ref());
    ShimStatus { outcome, output_written: written }
}

/// Looks at the owner's pause wish again (and re-applies a stop).
fn look_at_the_pause_wish(group: &mut Group, clock: &mut Deadlines, files: &AttemptFiles) {
    match group.hold(files.pause_requested()) {
        Some(true) => clock.pause(Instant::now()),
        Some(false) => clock.resume(Instant::now()),
        None => {}
    }
}

/// Removes an attempt's control groups once nothing is left in them.
fn remove_cgroup(cgroup: Option<&AttemptGroup>) {
    let Some(cgroup) = cgroup else { return };
    // A process's exit reaches its group a moment after it was reaped: the
    // kernel refuses the removal (busy) until then.
    let mut left = Vec::new();
    for _ in 0..100 {
        left = cgroup.remove();
        if left.is_empty() {
            return;
        }
        std::thread::sleep(ENDING_CHECK);
    }
    for left in left {
        tracing::warn!(%left, "shim cannot remove the task's cgroup");
    }
}

/// The tag that opens the detail of a task ended because its machine was
/// stopping (SIGTERM to its shim that no kill request explains).
pub const MACHINE_SHUTDOWN: &str = "machine-shutdown";

/// How long the output pipe may stay open after the task's group is gone: a
/// process that left the group (setsid) may still hold it; it is not waited
/// for forever.
const PIPE_AFTER_GROUP: Duration = Duration::from_secs(5);
/// How often a group being ended is looked at again.
const ENDING_CHECK: Duration = Duration::from_millis(10);

/// The task's process group — and, with cgroups, its control group — from
/// spawn to empty.
///
/// **Invariant:** [`Group::done`] is not true while any process of the group
/// lives, nor, with cgroups, any process of the task's control group (one
/// that left the process group with `setsid` too): the leader's exit is
/// only the beginning of the end. Ending it is SIGTERM to the group (and to
/// every process of the control group), the grace period, then SIGKILL (and
/// `cgroup.kill`) — on a kill request at once, otherwise once the leader has
/// exited and others remain.
struct Group {
    pgid: i32,
    /// The attempt's control groups, when the worker uses them.
    cgroup: Option<AttemptGroup>,
    /// The memory limit, for the detail of an out-of-memory ending.
    memory: Option<u64>,
    grace: Duration,
    leader: Option<WaitStatus>,
    killed: bool,
    /// SIGTERM without a kill request (machine shutdown), from this pid.
    shutdown: Option<u32>,
    /// Why the shim itself ended the task, if it had to.
    aborted: Option<String>,
    /// When SIGTERM went to the group.
    terminated_at: Option<Instant>,
    /// When the group was found empty.
    gone_at: Option<Instant>,
    /// Held stopped on the owner's wish.
    paused: bool,
}

impl Group {
    fn new(pgid: i32, grace: Duration, cgroup: Option<AttemptGroup>, memory: Option<u64>) -> Group {
        Group {
            pgid,
            cgroup,
            memory,
            grace,
            leader: None,
            killed: false,
            shutdown: None,
            aborted: None,
            terminated_at: None,
            gone_at: None,
            paused: false,
        }
    }

    /// Applies the owner's pause wish to the running group: `SIGSTOP` while
    /// it stands (sent again each time, so a process continued behind the
    /// shim's back is stopped anew), `SIGCONT` once it is withdrawn. Nothing
    /// once the group is being ended. Returns the new state when it changed.
    fn hold(&mut self, wish: bool) -> Option<bool> {
        if !self.running() {
            return None;
        }
        // The control group is frozen too, so that processes that left the
        // process group are held as well (and thawed before the SIGCONT).
        match (wish, self.paused) {
            (true, _) => {
                process::signal_group(self.pgid, Signal::SIGSTOP);
                self.freeze(true);
            }
            (false, true) => {
                self.freeze(false);
                process::signal_group(self.pgid, Signal::SIGCONT);
            }
            (false, false) => return None,
        }
        tracing::info!(pgid = self.pgid, paused = wish, "the task's group is held as its owner asked");
        let changed = wish != self.paused;
        self.paused = wish;
        changed.then_some(wish)
    }

    fn freeze(&self, frozen: bool) {
        if let Some(cgroup) = &self.cgroup {
            cgroup.freeze(frozen);
        }
    }

    /// Any process of the task is left: in its process group, or in its
    /// control group.
    fn alive(&self) -> bool {
        process::group_alive(self.pgid) || self.cgroup.as_ref().is_some_and(AttemptGroup::populated)
    }

    /// `signal` to the process group and to every process of the control
    /// group (SIGKILL there is `cgroup.kill`, which misses none).
    fn signal(&self, signal: Signal) {
        process::signal_group(self.pgid, signal);
        let Some(cgroup) = &self.cgroup else { return };
        if signal == Signal::SIGKILL {
            return cgroup.kill();
        }
        for pid in cgroup.pids() {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
        }
    }

    fn kill_requested(&mut self) {
        self.killed = true;
    }

    /// The shim was told to stop by someone other than the worker (the
    /// machine shutting down): the group is ended as for a kill, but the
    /// task did not end by request — it fails, saying so.
    fn shutdown(&mut self, from_pid: u32) {
        self.shutdown.get_or_insert(from_pid);
    }

    /// Ends the task for a reason of the shim's own: it fails with it.
    fn abort(&mut self, reason: String) {
        self.aborted.get_or_insert(reason);
    }

    /// Its leader runs and nothing has begun to end it.
    fn running(&self) -> bool {
        self.leader.is_none() && self.terminated_at.is_none() && !self.killed && self.shutdown.is_none()
    }

    /// Reaps every child that ended (the leader, and descendants re-parented
    /// to this subreaper), keeping the leader's status.
    fn reap(&mut self) {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) if status.pid() == Some(Pid::from_raw(self.pgid)) => self.leader = Some(status),
                Ok(_) => {}
            }
        }
    }

    /// Moves the ending along: SIGTERM when it is time, SIGKILL after grace.
    fn advance(&mut self) {
        if self.gone_at.is_some() {
            return;
        }
        if self.leader.is_some() && !self.alive() {
            self.gone_at = Some(Instant::now());
            return;
        }
        let start_ending = self.killed || self.shutdown.is_some() || self.aborted.is_some() || self.leader.is_some();
        match self.terminated_at {
            None if start_ending => {
                self.signal(Signal::SIGTERM);
                // A stopped (paused) process handles SIGTERM only once continued.
                if std::mem::take(&mut self.paused) {
                    self.freeze(false);
                    self.signal(Signal::SIGCONT);
                }
                self.terminated_at = Some(Instant::now());
            }
            Some(at) if at.elapsed() >= self.grace => self.signal(Signal::SIGKILL),
            _ => {}
        }
    }

    fn done(&self, pipe_closed: bool) -> bool {
        self.gone_at.is_some_and(|at| pipe_closed || at.elapsed() >= PIPE_AFTER_GROUP)
    }

    /// How long `poll` may sleep: until the next event while the task runs,
    /// briefly while its group is being ended, until the pipe's bound after.
    fn wake_in(&self) -> PollTimeout {
        let wait = match (self.gone_at, self.terminated_at) {
            (Some(at), _) => PIPE_AFTER_GROUP.saturating_sub(at.elapsed()),
            (None, Some(_)) => ENDING_CHECK,
            (None, None) => return PollTimeout::NONE,
        };
        PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)
    }

    fn outcome(&self) -> Outcome {
        if let Some(reason) = &self.aborted {
            return Outcome::new(Ending::Failed, None, Some(reason.clone()));
        }
        // The memory limit ended a process and the task did not complete:
        // it failed for that, whatever its leader's status says (a kill
        // that was asked for stays a kill).
        let completed = matches!(self.leader, Some(WaitStatus::Exited(_, 0)));
        if !self.killed && !completed && self.cgroup.as_ref().is_some_and(AttemptGroup::oom_killed) {
            let (code, status) = match self.leader {
                Some(WaitStatus::Exited(_, code)) => (Some(code), format!("exit code: {code}")),
                Some(WaitStatus::Signaled(_, signal, _)) => (None, format!("signal {}", signal as i32)),
                _ => (None, "no exit status".to_owned()),
            };
            let limit = self.memory.map(|b| format!(" of {}", size(b))).unwrap_or_default();
            return Outcome::new(
                Ending::Failed,
                code,
                Some(format!(
                    "{OUT_OF_MEMORY}: the kernel ended a process of the task at its memory limit{limit} ({status})"
                )),
            );
        }
        // A kill that was asked for stays a kill; an ending only the stopping
        // machine asked for is a failure that says so (the leader decides
        // nothing from it: it is the attempt's truthful evidence).
        if let (false, Some(pid), Some(WaitStatus::Signaled(..)) | Some(WaitStatus::Exited(..))) =
            (self.killed, self.shutdown, self.leader)
        {
            let status = match self.leader {
                Some(WaitStatus::Exited(_, code)) => format!("exit code: {code}"),
                Some(WaitStatus::Signaled(_, signal, _)) => format!("signal {}", signal as i32),
                _ => String::new(),
            };
            let code = match self.leader {
                Some(WaitStatus::Exited(_, code)) => Some(code),
                _ => None,
            };
            return Outcome::new(
                Ending::Failed,
                code,
                Some(format!(
                    "{MACHINE_SHUTDOWN}: the task's shim was sent SIGTERM by pid {pid}, not by a kill request \
                     (the machine or its service manager stopping processes), and ended the task ({status}); \
                     resubmit it if it should run"
                )),
            );
        }
        match (self.leader, self.killed) {
            (Some(WaitStatus::Exited(_, 0)), false) => Outcome::new(Ending::Completed, Some(0), None),
            (Some(WaitStatus::Exited(_, code)), false) => {
                Outcome::new(Ending::Failed, Some(code), Some(format!("exit code: {code}")))
            }
            (Some(WaitStatus::Exited(_, code)), true) => {
                Outcome::new(Ending::Killed, Some(code), Some(format!("exit code: {code}")))
            }
            (Some(WaitStatus::Signaled(_, signal, _)), killed) => {
                let ending = if killed { Ending::Killed } else { Ending::Failed };
                Outcome::new(ending, None, Some(format!("signal {}", signal as i32)))
            }
            (other, _) => Outcome::new(Ending::Failed, None, Some(format!("unexpected wait status: {other:?}"))),
        }
    }
}

/// `64 MiB`, `1.5 GiB`, `512 KiB`, `100 bytes`: a memory limit as a person reads it.
fn size(bytes: u64) -> String {
    for (unit, scale) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= scale {
            let whole = bytes / scale;
            let tenths = (bytes % scale) * 10 / scale;
            return match tenths {
                0 => format!("{whole} {unit}"),
                t => format!("{whole}.{t} {unit}"),
            };
        }
    }
    format!("{bytes} bytes")
}

/// Writes the input kept for a resumed attempt into its fresh input pipe,
/// each message whole (at most a few KiB in all, under the pipe's capacity:
/// see `tenure_protocol::resume`), before the task exists to read it. A
/// message that could not be written whole fails the attempt before its
/// task starts: nothing is delivered twice, or in part.
fn write_kept_input(pipe: &mut std::fs::File, kept: &[String]) -> std::io::Result<()> {
    for message in kept {
        pipe.write_all(message.as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory limit ended a process (its cgroup's `oom_kill`): the task
    /// fails as `out-of-memory`, unless it completed anyway or was killed.
    #[test]
    fn an_out_of_memory_ending_fails_the_task_saying_so() {
        use tenure_protocol::resources::ResourceLimits;
        let dir = tempfile::tempdir().unwrap();
        let plan = Plan { unified: dir.path().to_path_buf(), v2: vec!["memory".into()], ..Plan::default() };
        let limits = ResourceLimits { memory_bytes: Some(32 << 20), ..Default::default() };
        std::fs::create_dir(dir.path().join("t.1")).unwrap();
        let events = dir.path().join("t.1/memory.events");
        let ended = |oom_kills: u32, leader: WaitStatus, killed: bool| {
            std::fs::write(&events, format!("low 0\nmax 3\noom 1\noom_kill {oom_kills}\n")).unwrap();
            let cgroup = AttemptGroup::find(&plan, "t.1", Some(&limits));
            let mut group = Group::new(1, Duration::ZERO, Some(cgroup), limits.memory_bytes);
            group.leader = Some(leader);
            group.killed = killed;
            group.outcome()
        };
        let pid = Pid::from_raw(1);
        let oom = ended(1, WaitStatus::Exited(pid, 137), false);
        assert_eq!((oom.ending, oom.exit_code), (Ending::Failed, Some(137)));
        let detail = oom.detail.unwrap_or_default();
        assert!(detail.starts_with("out-of-memory: ") && detail.contains("32 MiB"), "{detail}");
        let signaled = ended(1, WaitStatus::Signaled(pid, Signal::SIGKILL, false), false);
        assert!(signaled.detail.is_some_and(|d| d.starts_with("out-of-memory: ") && d.contains("signal 9")));
        assert_eq!(ended(1, WaitStatus::Exited(pid, 0), false).ending, Ending::Completed);
        assert_eq!(ended(1, WaitStatus::Exited(pid, 137), true).ending, Ending::Killed);
        let plain = ended(0, WaitStatus::Exited(pid, 3), false);
        assert_eq!(plain.detail.as_deref(), Some("exit code: 3"));
    }

    #[test]
    fn memory_limits_are_shown_as_people_write_them() {
        let cases = [(64 << 20, "64 MiB"), (3 << 29, "1.5 GiB"), (512 << 10, "512 KiB"), (100, "100 bytes")];
        for (bytes, text) in cases {
            assert_eq!(size(bytes), text);
        }
    }
}
