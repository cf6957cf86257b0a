//! The driver of one attempt, from intent to acknowledged outcome: it asks the
//! core ([`crate::core::Worker::next`]) what to do, does it, and feeds the
//! result back ([`crate::core::Worker::advance`]); it decides nothing. Also
//! what every attempt's driver shares ([`Shared`], [`State`]).
//!
//! The worker never runs a task itself: it records the intent, has its
//! launcher hand the attempt to a shim ([`crate::launcher`],
//! [`crate::shim`]), and watches it — through the attempt's channel the
//! launcher handed over, or, after a restart, a pidfd opened for the shim's
//! recorded identity. The
//! status the shim records in the attempt's journal is the only exit
//! evidence; a shim gone without it means the outcome is lost, and that is
//! reported as such, never guessed.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use rustix::net::SendFlags;
use tenure_machine::{ClientError, Layout, SidecarClient};
use tenure_protocol::messages::{
    LeaseGrant, ReportAck, ReportEvent, SidecarRefusal, SidecarReply, SidecarRequest, MAX_MATCHES_PER_REPORT,
};
use tenure_protocol::{Attempt, Ending, Epoch, Outcome, TaskId};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;
use tracing::Instrument;

use crate::builtin::Builtin;
use crate::core::{Action, Config, Done, Key, Worker};
use crate::launcher::{LaunchError, Launched, Launcher};
use crate::options::Options;
use crate::process;
use crate::reports::StartedPace;
use crate::shim::ShimArgs;
use tenure_machine::attempt_files::{group_in_session, AttemptFiles, ProcessId, ShimStatus};
use tenure_machine::evidence::{settle, Settled as Evidence};

/// The worker's memory: the pure core, and the kill handle of each attempt
/// being driven. One lock, so that a kill the core accepts always finds the
/// handle of the attempt it names.
pub(crate) struct State {
    pub core: Worker,
    kills: HashMap<Key, Arc<Notify>>,
    /// When the next `Started` report leaves.
    started: StartedPace,
}

impl State {
    pub fn new(config: Config, started_hold: Duration) -> State {
        State { core: Worker::new(config), kills: HashMap::new(), started: StartedPace::new(started_hold) }
    }

    /// The kill handle of an attempt being driven.
    pub fn kill_handle(&self, key: &Key) -> Option<&Arc<Notify>> {
        self.kills.get(key)
    }

    /// Every attempt's kill handle (for a shutdown that ends them all).
    pub fn kill_handles(&self) -> Vec<Arc<Notify>> {
        self.kills.values().cloned().collect()
    }

    /// `key`'s next action, with its grant.
    pub fn next(&self, key: &Key) -> Option<(Action, Option<Arc<LeaseGrant>>)> {
        let action = self.core.next(key)?;
        Some((action, self.core.held(key)?.grant.clone()))
    }

    /// Feeds `key`'s result to the core; false once the attempt is over here.
    pub fn advance(&mut self, key: &Key, done: Done) -> bool {
        self.core.advance(key, done);
        let held = self.core.held(key).is_some();
        if !held {
            self.kills.remove(key);
        }
        held
    }
}

pub(crate) struct Shared {
    pub opts: Options,
    pub launcher: Launcher,
    pub layout: Layout,
    /// The attempts' scratch directories, and the spares among them.
    pub scratch: crate::scratch::ScratchDirs,
    pub client: async_nats::Client,
    pub sidecar: SidecarClient,
    /// The worker's reports to the leader, gathered.
    pub reports: crate::reports::Reporter,
    /// The NATS servers as tasks see them (no credentials).
    pub task_nats: String,
    /// Where the attempts' control groups go; `None` without them.
    pub cgroups: Option<crate::cgroup::Plan>,
    pub state: Mutex<State>,
}

impl Shared {
    pub fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts driving a held attempt ([`drive`]) in its own task, with a
/// kill handle the event loop can reach.
/// The attempt's span is a child of the current one (a traced grant's).
pub(crate) fn spawn_drive(shared: &Arc<Shared>, key: Key) {
    let kill = Arc::new(Notify::new());
    shared.state().kills.insert(key.clone(), kill.clone());
    let epoch = shared.state().core.held(&key).map(|h| h.epoch).unwrap_or_default();
    let span =
        tracing::info_span!("attempt", task = %key.0, attempt = %key.1, epoch = %epoch, worker = %shared.opts.id);
    tokio::spawn(drive(shared.clone(), key, kill).instrument(span));
}

/// Calls the sidecar until it answers (it may be restarting), for steps that
/// must not be skipped: intent, spawned, exited, acknowledged.
pub(crate) async fn sidecar_insist(shared: &Shared, req: SidecarRequest) -> SidecarReply {
    let mut delay = Duration::from_millis(20);
    loop {
        match shared.sidecar.call(&req).await {
            Ok(reply) => return reply,
            Err(ClientError::Unavailable(error)) => {
                tracing::warn!(%error, "sidecar unavailable; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            // A request that cannot be encoded, or a reply that cannot be read,
            // will not get better by repeating it.
            Err(error) => return SidecarReply::Refused(SidecarRefusal::Malformed(error.to_string())),
        }
    }
}

/// Test hook for the named crash windows: when `TENURE_CRASH_AT` names this
/// point, the worker dies on the spot (SIGABRT), exactly as a SIGKILL there
/// would leave things. Points: `before-record` (grants screened, nothing
/// recorded), `after-intent` (a grant's accept and intent recorded together,
/// or an intent recorded alone), `after-exited`, `after-report`. Unset in
/// production; it changes nothing else.
pub(crate) fn crash_point(point: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT.get_or_init(|| std::env::var("TENURE_CRASH_AT").ok()).as_deref() == Some(point) {
        tracing::error!(point, "TENURE_CRASH_AT: crashing on purpose");
        std::process::abort();
    }
}

/// How the worker observes the shim supervising an attempt: by its identity
/// (pid and start time, never a recycled pid) and a descriptor that becomes
/// readable when the attempt is over.
///
/// The shim this worker's launcher handed the attempt is watched through the
/// attempt's channel ([`crate::launcher`]): it reads end-of-file once the
/// exit evidence is recorded (or the shim died), and a kill request rings
/// it — never a signal, which could reach the next attempt the shim took.
/// A shim found at start-up is watched through its pidfd, where the kernel
/// has them: its launcher went with the previous worker, so it takes no
/// attempt after this one and a signal to it reaches this attempt only.
struct Shim {
    id: ProcessId,
    end: Option<AsyncFd<OwnedFd>>,
    /// `end` is the attempt's channel (rung for kills), not a pidfd.
    channel: bool,
}

impl Shim {
    /// The shim of an attempt just handed to it. Must be called within the
    /// runtime (the channel is registered with it).
    fn launched(launched: Launched) -> Shim {
        Shim::new(launched.id, Some(launched.channel), true)
    }

    fn new(id: ProcessId, end: Option<OwnedFd>, channel: bool) -> Shim {
        // SAFETY: an `OwnedFd` is open, owned, and always the same descriptor
        // until the `AsyncFd` that owns it drops it.
        let end = end.and_then(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok());
        Shim { id, end, channel }
    }

    /// A shim found at start-up, if it still runs. Its pidfd is opened
    /// first and the identity checked second: a recorded process alive after
    /// the open had the pid before it, so the pidfd names it.
    fn attach(id: ProcessId) -> Option<Shim> {
        let pidfd = rustix::process::Pid::from_raw(id.pid)
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        id.alive().then(|| Shim::new(id, pidfd, false))
    }

    /// Asks the shim to end the task; never signals a recycled pid, nor a
    /// shim that may have moved on to another attempt.
    fn request_kill(&self) {
        match &self.end {
            // Refused once the attempt is over: the ring then reaches nothing.
            Some(fd) if self.channel => {
                let _ = rustix::net::send(fd.get_ref(), &[1], SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
            }
            Some(fd) => {
                let _ = rustix::process::pidfd_send_signal(fd.get_ref(), rustix::process::Signal::TERM);
            }
            // A channel that could not be watched is not signalled around.
            None if self.channel => tracing::warn!(shim = self.id.pid, "cannot ring the attempt's channel"),
            None if self.id.alive() && self.id.pid > 1 => {
                let _ = kill(Pid::from_raw(self.id.pid), Signal::SIGTERM);
            }
            None => {}
        }
    }

    async fn exited(&self, files: &AttemptFiles) {
        let over = match &self.end {
            Some(fd) if self.channel => fd.readable().await.is_ok(),
            // A found shim exits after its attempt; the recorded status ends
            // the wait too, should its exit be held up.
            Some(fd) => tokio::select! {
                ready = fd.readable() => ready.is_ok(),
                () = self.settled(files, Duration::from_secs(1)) => true,
            },
            None => false,
        };
        if !over {
            // Nothing to wait on: the recorded status ends the wait as soon as
            // it exists, even if the shim lingers.
            self.settled(files, Duration::from_millis(100)).await;
        }
    }

    /// Returns once the shim is gone or the attempt's status is recorded,
    /// looking every `every`.
    async fn settled(&self, files: &AttemptFiles, every: Duration) {
        while self.id.alive() && files.status().is_none() {
            tokio::time::sleep(every).await;
        }
    }
}

/// Drives one held attempt: asks the core for its next action, performs it,
/// feeds the result back, until the core no longer holds it. Every decision
/// is the core's ([`crate::core::Worker::advance`]); this only does IO.
pub(crate) async fn drive(shared: Arc<Shared>, key: Key, kill: Arc<Notify>) {
    let mut local = Local::default();
    loop {
        let Some((action, grant)) = shared.state().next(&key) else { break };
        let done = perform(&shared, &key, grant.as_deref(), action, &mut local, &kill).await;
        match &done {
            Done::Ended(settled) => ended(&key, settled),
            Done::NotStarted(detail) => {
                ended(&key, &Evidence::Exited(Outcome::new(Ending::Failed, None, Some(detail.clone()))))
            }
            _ => {}
        }
        if !shared.state().advance(&key, done) {
            break;
        }
    }
    local.attempt_ended();
}

/// What the driver keeps for one attempt between actions: the things that
/// are not facts (a pidfd, a task, a retry delay).
#[derive(Default)]
struct Local {
    /// The shim this process launched (with its pidfd).
    shim: Option<Shim>,
    /// The `Started` report, held or sent from the launch until the attempt
    /// ends ([`report_started`]).
    started: Option<StartReport>,
    /// The pid of a start the leader has not acknowledged when the attempt
    /// ended: its `Started` goes with the end report, just before it.
    untold_start: Option<i32>,
    /// Set after a report went unanswered: wait this long before re-sending.
    report_delay: Option<Duration>,
}

/// An attempt's `Started` report on its way, in a task of its own.
struct StartReport {
    pid: i32,
    task: tokio::task::JoinHandle<ReportAck>,
}

impl Local {
    /// The attempt ended: a `Started` report still held, or sent and not
    /// acknowledged, stops, and the start is told with the end instead (a
    /// leader that already has it acknowledges it again, as any repeat).
    fn attempt_ended(&mut self) {
        if let Some(started) = self.started.take() {
            if !started.task.is_finished() {
                self.untold_start = Some(started.pid);
            }
            started.task.abort();
        }
    }
}

async fn perform(
    shared: &Arc<Shared>,
    key: &Key,
    grant: Option<&LeaseGrant>,
    action: Action,
    local: &mut Local,
    kill: &Notify,
) -> Done {
    let (task, attempt) = (&key.0, key.1);
    // Looked up by the actions that use them (a built-in kind's attempt has none).
    let files = || shared.layout.attempt_files(task, attempt);
    match action {
        Action::Sidecar(mut req) => {
            if let SidecarRequest::Intent { trace, .. } = &mut req {
                *trace = tenure_transport::trace::current_traceparent();
            }
            let point = match &req {
                SidecarRequest::Intent { .. } => Some("after-intent"),
                SidecarRequest::Exited { .. } => Some("after-exited"),
                _ => None,
            };
            let reply = sidecar_insist(shared, req).await;
            if reply == SidecarReply::Ok {
                point.map(crash_point);
            } else {
                tracing::warn!(task = %task, attempt = %attempt, ?reply, "sidecar refused a step");
            }
            Done::Sidecar(reply)
        }
        Action::Launch { epoch, .. } => {
            let Some(grant) = grant else { return Done::NotStarted("the attempt's grant is unknown".into()) };
            if let Some(builtin) = Builtin::of(&grant.spec.kind) {
                return Done::Ended(Evidence::Exited(run_builtin(shared, builtin, grant, epoch, kill, local).await));
            }
            match start_shim(shared, grant, &files()).await {
                Ok(launched) => {
                    let pid = launched.id.pid;
                    tracing::debug!(task = %task, attempt = %attempt, shim = pid, "shim started");
                    local.shim = Some(Shim::launched(launched));
                    local.started = Some(report_started(shared, task, attempt, epoch, pid));
                    Done::Launched(pid)
                }
                Err(LaunchError::NotStarted(detail)) => Done::NotStarted(detail),
                Err(LaunchError::Unknown(detail)) => {
                    tracing::warn!(task = %task, attempt = %attempt, %detail, "no word whether the shim started; looking for it");
                    Done::Unseen
                }
            }
        }
        Action::Watch { .. } => {
            // Ours since the launch, or found again by its recorded identity.
            let files = files();
            let shim = local.shim.take().or_else(|| {
                let journal = files.journal().unwrap_or_default();
                journal.shim.filter(|_| journal.status.is_none()).and_then(Shim::attach)
            });
            let settled = match shim {
                Some(shim) => watch(shared, grant, &files, shim, kill).await,
                None => evidence(shared, &files, false, None).await,
            };
            // Nothing waits on the network before the outcome is buffered; a
            // start not acknowledged yet is told with the end.
            local.attempt_ended();
            Done::Ended(settled)
        }
        Action::Seek { .. } => Done::Ended(unseen_shim(shared, grant, &files(), kill).await),
        Action::Settle { restarted } => {
            Done::Ended(evidence(shared, &files(), false, restarted.then_some(attempt)).await)
        }
        Action::Report { event, epoch } => {
            if let Some(delay) = local.report_delay {
                tokio::time::sleep(delay).await;
            }
            let finished = matches!(event, ReportEvent::Finished(_));
            let (ack, settles) = report_judged(shared, task, attempt, epoch, local.untold_start, event).await;
            local.report_delay = (!settles).then(|| next_report_delay(local.report_delay));
            if settles {
                local.untold_start = None;
            }
            if settles && finished {
                crash_point("after-report");
            }
            Done::Reported(ack)
        }
        Action::Release => {
            // The outcome is acknowledged, so the attempt's group is gone: a
            // scratch directory it left bare goes back for the next attempt,
            // on a blocking thread with the attempt's files (renames, and
            // removals that free blocks, which wait for the device on a file
            // system mounted with `discard`). A built-in kind's attempt has
            // neither scratch directory nor journal: at most a pause wish.
            let removed = match grant.and_then(|g| Builtin::of(&g.spec.kind)) {
                Some(_) => files().remove(),
                None => {
                    let (shared, name, files) = (shared.clone(), crate::scratch::name(task, attempt), files());
                    tokio::task::spawn_blocking(move || {
                        shared.scratch.give_back(&name);
                        files.remove()
                    })
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
                }
            };
            if let Err(error) = removed {
                tracing::warn!(task = %task, attempt = %attempt, %error, "cannot remove the attempt's files");
            }
            Done::Released
        }
    }
}

/// Logs and counts how an attempt ended.
fn ended(key: &Key, settled: &Evidence) {
    tracing::debug!(task = %key.0, attempt = %key.1, ?settled, "attempt ended");
    let outcome = match settled {
        Evidence::Exited(o) => match o.ending {
            Ending::Completed => "completed",
            Ending::Failed => "failed",
            Ending::Killed => "killed",
        },
        Evidence::Lost { .. } => "lost",
    };
    crate::metrics::get().attempts.add(1, &[opentelemetry::KeyValue::new("outcome", outcome)]);
}

/// A built-in attempt after its intent: it runs in this process, without a
/// shim, then its outcome goes the way of any other (buffered, reported,
/// acknowledged). A `sleep` reports started while it runs, naming the
/// worker's own pid (the process it runs in); a `noop` is over before there
/// is anything to report but its end (leased → completed).
async fn run_builtin(
    shared: &Arc<Shared>,
    builtin: Builtin,
    grant: &LeaseGrant,
    epoch: Epoch,
    kill: &Notify,
    local: &mut Local,
) -> Outcome {
    if builtin != Builtin::Noop {
        let pid = i32::try_from(std::process::id()).unwrap_or(0);
        local.started = Some(report_started(shared, &grant.task, grant.attempt, epoch, pid));
    }
    let outcome = builtin.run(&grant.spec, kill).await;
    local.attempt_ended();
    outcome
}

/// Writes the attempt's `grant`, makes its scratch directory and has the
/// launcher start its shim (file writes and a request the launcher answers
/// once its shim runs: on a blocking thread).
async fn start_shim(shared: &Arc<Shared>, grant: &LeaseGrant, files: &AttemptFiles) -> Result<Launched, LaunchError> {
    let (shared, grant, files) = (shared.clone(), grant.clone(), files.clone());
    let started = tokio::task::spawn_blocking(move || {
        let not_started = LaunchError::NotStarted;
        files.write_grant(&grant).map_err(|e| not_started(format!("cannot write the task's grant: {e}")))?;
        let name = crate::scratch::name(&grant.task, grant.attempt);
        let scratch = shared.scratch.make(&name).map_err(|e| {
            let dir = shared.scratch.path(&name);
            not_started(format!("cannot create the task's scratch directory {}: {e}", dir.display()))
        })?;
        shared.launcher.launch(&ShimArgs {
            data_dir: shared.layout.root().to_path_buf(),
            task: grant.task.clone(),
            attempt: grant.attempt,
            output_cap: shared.opts.output_cap,
            kill_grace: shared.opts.kill_grace,
            scratch,
            run_as: shared.opts.run_as.clone(),
            nats: shared.task_nats.clone(),
            cgroups: shared.cgroups.clone(),
        })
    });
    started.await.unwrap_or_else(|e| Err(LaunchError::NotStarted(format!("the shim start was interrupted: {e}"))))
}

/// How long a shim whose launch went unanswered is looked for.
const UNSEEN_SHIM_BOUND: Duration = Duration::from_secs(2);

/// The launcher ended between a request and its answer: a shim may run.
/// It is watched if it shows itself (its identity or its status in the journal) in
/// time; otherwise the attempt is settled as one whose shim is gone.
async fn unseen_shim(shared: &Shared, grant: Option<&LeaseGrant>, files: &AttemptFiles, kill: &Notify) -> Evidence {
    let deadline = tokio::time::Instant::now() + UNSEEN_SHIM_BOUND;
    while tokio::time::Instant::now() < deadline {
        let journal = files.journal().unwrap_or_default();
        if journal.status.is_some() {
            break;
        }
        if let Some(shim) = journal.shim.and_then(Shim::attach) {
            return watch(shared, grant, files, shim, kill).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    evidence(shared, files, false, None).await
}

/// Tells an attempt's shim to look at the owner's pause wish again (and to
/// re-apply a stop). Only a shim that recorded its task's group is signalled:
/// it blocked `SIGUSR1` before spawning the task, while an earlier signal
/// would end it; one that has not yet reads the wish itself after recording
/// the group, and the wish was written before this looked. Never signals a
/// recycled pid (the shim's start time is checked).
pub(crate) fn tell_shim_to_look(files: &AttemptFiles) {
    if files.pgid().is_none() {
        return;
    }
    if let Some(id) = files.shim().filter(|id| id.pid > 1 && id.alive()) {
        if let Err(error) = kill(Pid::from_raw(id.pid), Signal::SIGUSR1) {
            tracing::warn!(pid = id.pid, %error, "cannot tell the shim to look at the pause wish");
        }
    }
}

/// Waits for the shim to end (forwarding kills to it) and reads its evidence.
/// A `monitor` attempt's matched lines are forwarded this often.
const FORWARD_MATCHES_EVERY: Duration = Duration::from_millis(250);

/// `grant` is the attempt's, when known (a `monitor` attempt's matched lines
/// are forwarded only with it).
async fn watch(
    shared: &Shared,
    grant: Option<&LeaseGrant>,
    files: &AttemptFiles,
    shim: Shim,
    kill_req: &Notify,
) -> Evidence {
    let mut killed = false;
    // A re-attached shim holds its group as the wish says, again.
    if files.pause_requested() {
        tell_shim_to_look(files);
    }
    let mut matches = grant.filter(|g| g.spec.line_pattern().is_some()).cloned().map(MatchForwarder::new);
    let mut tick = tokio::time::interval(FORWARD_MATCHES_EVERY);
    loop {
        tokio::select! {
            _ = shim.exited(files) => break,
            _ = kill_req.notified(), if !killed => {
                killed = true;
                // Marked first: the shim tells a kill from a machine's
                // shutdown by it. Should the mark fail, the task still ends
                // (as a `machine-shutdown` failure rather than `killed`).
                if let Err(error) = files.mark_kill_requested() {
                    tracing::warn!(files = %files.base().display(), %error, "cannot mark the kill request");
                }
                // The shim ends the group (SIGTERM, grace, SIGKILL) and records it.
                shim.request_kill();
            }
            _ = tick.tick(), if matches.is_some() => {
                if let Some(m) = matches.as_mut() {
                    m.forward(shared, files, false).await;
                }
            }
        }
    }
    // Every matched line reaches the leader before the attempt's end does.
    if let Some(m) = matches.as_mut() {
        m.forward(shared, files, true).await;
    }
    evidence(shared, files, killed, None).await
}

/// Sends a `monitor` attempt's matched lines (from its `matches` file) to the
/// leader, advancing past a batch only once the leader acknowledged it. It
/// starts from the beginning after a worker restart: the leader drops lines
/// it already notified.
struct MatchForwarder {
    grant: LeaseGrant,
    pos: u64,
    /// The leader said the attempt is no longer current: nothing to forward.
    stale: bool,
}

impl MatchForwarder {
    fn new(grant: LeaseGrant) -> MatchForwarder {
        MatchForwarder { grant, pos: 0, stale: false }
    }

    /// Forwards what is recorded; with `insist`, retries until acknowledged,
    /// otherwise leaves a failed batch for the next call.
    async fn forward(&mut self, shared: &Shared, files: &AttemptFiles, insist: bool) {
        while !self.stale {
            let (lines, next) = match files.read_matches(self.pos, MAX_MATCHES_PER_REPORT) {
                Ok(read) => read,
                Err(error) => return tracing::warn!(task = %self.grant.task, %error, "cannot read matched lines"),
            };
            if lines.is_empty() {
                self.pos = next;
                return;
            }
            let (task, attempt, epoch) = (&self.grant.task, self.grant.attempt, self.grant.epoch);
            let event = ReportEvent::Matched(lines);
            let ack = match insist {
                true => Some(report_until_acked(shared, task, attempt, epoch, event).await),
                false => report_once(shared, task, attempt, epoch, None, event).await,
            };
            match ack {
                Some(ReportAck::Ack) => self.pos = next,
                Some(ack) if ack.is_stale() && shared.state().core.settles(&ack, epoch) => self.stale = true,
                // Not a leader, no answer, or a deposed leader's "stale".
                Some(_) | None => return,
            }
        }
    }
}

/// What the attempt's files prove once its shim is gone (the verdict is
/// [`settle`]'s). A group that outlived its shim is ended first: it is ours
/// by the recorded pgid. `restarted`: the attempt, when the machine booted
/// since its intent.
async fn evidence(shared: &Shared, files: &AttemptFiles, killed: bool, restarted: Option<Attempt>) -> Evidence {
    let journal = files.journal().unwrap_or_default();
    if let Some(status) = journal.status.clone() {
        // It recorded its end, but may have died before removing its group.
        end_attempt_cgroup(shared, &journal).await;
        return exited(shared, journal.grant.as_ref(), status);
    }
    // The shim is gone without evidence (it was killed, or the machine lost
    // it). A surviving group is ended only when confirmed ours: its processes
    // sit in the shim's session. A stranger reusing the number is left alone.
    let group = journal.pgid;
    if let Some(pgid) = group.filter(|p| process::group_alive(*p)) {
        let ours = journal.shim.is_some_and(|m| group_in_session(pgid, m.pid));
        if ours {
            tracing::warn!(pgid, files = %files.base().display(), "shim gone; ending its orphaned process group");
            process::end_group(Pid::from_raw(pgid), shared.opts.kill_grace).await;
        } else {
            tracing::warn!(pgid, files = %files.base().display(), "process group exists but is not in the shim's session: not ours, left alone");
        }
    }
    let contained = end_attempt_cgroup(shared, &journal).await;
    settle(None, killed, group, restarted.is_some(), contained, restarted.unwrap_or_default())
}

/// The control group of an attempt whose shim is gone, found again by its
/// name: what is left in it is the task's (also processes that left its
/// process group), ended; then the group is removed.
/// Whether the attempt ran in a control group that is empty now.
async fn end_attempt_cgroup(shared: &Shared, journal: &tenure_machine::attempt_files::Journal) -> bool {
    let (Some(plan), Some(grant)) = (&shared.cgroups, journal.grant.as_ref()) else { return false };
    let name = crate::cgroup::attempt_name(&grant.task, grant.attempt);
    let cgroup = crate::cgroup_fs::AttemptGroup::find(plan, &name, grant.spec.resources.as_deref());
    end_cgroup(&cgroup).await
}

/// Kills what is left in an attempt's control group whose shim is gone,
/// waits (bounded) until it is empty and removes it; whether it is empty.
async fn end_cgroup(cgroup: &crate::cgroup_fs::AttemptGroup) -> bool {
    if cgroup.populated() {
        tracing::warn!(cgroup = %cgroup.path().display(), "shim gone; killing what is left in its cgroup");
        cgroup.kill();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while cgroup.populated() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let emptied = !cgroup.populated();
    let mut left = Vec::new();
    for _ in 0..50 {
        left = cgroup.remove();
        if left.is_empty() {
            return emptied;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for left in left {
        tracing::warn!(%left, "cannot remove an ended attempt's cgroup");
    }
    emptied
}

/// The outcome the shim recorded, completed with what only the worker adds
/// (a final-output-only task's final output), and counted. Every path that
/// settles an attempt from its recorded status goes through here; `grant` is
/// the attempt's, when known.
fn exited(shared: &Shared, grant: Option<&LeaseGrant>, status: ShimStatus) -> Evidence {
    let m = crate::metrics::get();
    m.output_bytes.add(status.output_written, &[]);
    m.output_dropped.add(status.outcome.output_dropped, &[]);
    let mut outcome = status.outcome;
    if let Some(grant) = grant.filter(|g| g.spec.final_output) {
        outcome.output = Some(final_output(&shared.layout.output_path(&grant.task)).into());
    }
    Evidence::Exited(outcome)
}

/// The final output of a final-output-only task: the tail of its output
/// file, at most `MAX_FINAL_OUTPUT_BYTES`, as text (invalid UTF-8 replaced),
/// with a note when earlier bytes were left out.
fn final_output(path: &std::path::Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let max = tenure_protocol::MAX_FINAL_OUTPUT_BYTES as u64;
    let Ok(mut file) = std::fs::File::open(path) else { return String::new() };
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let skip = size.saturating_sub(max);
    let mut tail = Vec::new();
    if file.seek(SeekFrom::Start(skip)).is_err() || file.take(max).read_to_end(&mut tail).is_err() {
        return format!("[tenure: the output of this task could not be read from {}]", path.display());
    }
    let text = String::from_utf8_lossy(&tail);
    match skip {
        0 => text.into_owned(),
        n => format!("[tenure: {n} earlier bytes of output left out]\n{text}"),
    }
}

/// Sends a report until the leader acknowledges it (or says it is stale);
/// returns which of the two it was.
pub(crate) async fn report_until_acked(
    shared: &Shared,
    task: &TaskId,
    attempt: Attempt,
    epoch: Epoch,
    event: ReportEvent,
) -> ReportAck {
    let mut delay = None;
    loop {
        let (ack, settles) = report_judged(shared, task, attempt, epoch, None, event.clone()).await;
        if settles {
            return ack;
        }
        let next = next_report_delay(delay);
        tokio::time::sleep(next).await;
        delay = Some(next);
    }
}

/// Reports an attempt's start until the leader settles it, in a task of its
/// own that the attempt's end stops ([`Local::attempt_ended`]): after the
/// hold [`StartedPace`] gives it, so that an attempt ending within the hold
/// has its start told with its end, in one message.
fn report_started(shared: &Arc<Shared>, task: &TaskId, attempt: Attempt, epoch: Epoch, pid: i32) -> StartReport {
    let hold = shared.state().started.hold(std::time::Instant::now());
    let (shared, task) = (shared.clone(), task.clone());
    let task = tokio::spawn(async move {
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        report_until_acked(&shared, &task, attempt, epoch, ReportEvent::Started { pid }).await
    });
    StartReport { pid, task }
}

/// The pause before a report is sent again: 50 ms, doubling up to 1 s.
fn next_report_delay(last: Option<Duration>) -> Duration {
    last.map_or(Duration::from_millis(50), |d| (d * 2).min(Duration::from_secs(1)))
}

/// Sends a report once (after the `Started` of `start`, when given, in the
/// same message) and judges its answer: whether it settles the report (no
/// answer counts as `NotLeader`: retry), saying so for a stale one.
async fn report_judged(
    shared: &Shared,
    task: &TaskId,
    attempt: Attempt,
    epoch: Epoch,
    start: Option<i32>,
    event: ReportEvent,
) -> (ReportAck, bool) {
    let ack = report_once(shared, task, attempt, epoch, start, event).await.unwrap_or(ReportAck::NotLeader);
    let settles = shared.state().core.settles(&ack, epoch);
    match ack {
        ReportAck::Stale | ReportAck::StaleAt { .. } if settles => {
            tracing::info!(task = %task, attempt = %attempt, "report is stale; the leader settled it otherwise");
        }
        ReportAck::StaleAt { epoch: said } => tracing::warn!(
            task = %task, attempt = %attempt, %said,
            "a leader below the highest epoch seen calls the report stale; kept, re-sent later"
        ),
        _ => {}
    }
    (ack, settles)
}

/// Sends a report once, after the `Started` of `start` when given (in one
/// message); `None` when no leader answered `event`'s.
async fn report_once(
    shared: &Shared,
    task: &TaskId,
    attempt: Attempt,
    epoch: Epoch,
    start: Option<i32>,
    event: ReportEvent,
) -> Option<ReportAck> {
    let epoch = shared.state().core.epoch_seen().max(epoch);
    let report = |event| tenure_protocol::messages::Report {
        worker: shared.opts.id.clone(),
        task: task.clone(),
        attempt,
        epoch,
        event,
    };
    let started = start.map(|pid| report(ReportEvent::Started { pid }));
    crate::reports::send(&shared.reports, started.into_iter().chain([report(event)]).collect()).await
}
