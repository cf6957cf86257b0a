//! One attempt's life on the worker, from intent to acknowledged outcome, and
//! the start-up recovery that picks attempts up again after a worker restart.
//!
//! The worker never runs a task itself: it records the intent, has its
//! launcher fork the attempt's monitor ([`crate::launcher`],
//! [`crate::monitor`]), and watches it — through the pidfd the launcher
//! handed over, or, after a restart, one opened for its recorded identity. The
//! status the monitor records in the attempt's journal is the only exit
//! evidence; a monitor gone without it means the outcome is lost, and that is
//! reported as such, never guessed.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tenure_protocol::messages::{
    LeaseGrant, Phase, ReportAck, ReportEvent, SidecarRefusal, SidecarReply, SidecarRequest, MAX_MATCHES_PER_REPORT,
};
use tenure_protocol::{subjects, Attempt, Ending, Epoch, HintTag, Outcome, RecoveryHint, TaskId};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

use crate::builtin::Builtin;
use crate::launcher::{LaunchError, Launched};
use crate::monitor::MonitorArgs;
use crate::process;
use crate::service::{sidecar_insist, Held, Shared};
use tenure_machine::attempt_files::{group_in_session, AttemptFiles, MonitorStatus, ProcessId};
use tenure_machine::evidence::{settle, Settled as Evidence};

/// Test hook for the named crash windows: when `TENURE_CRASH_AT` names this
/// point, the worker dies on the spot (SIGABRT), exactly as a SIGKILL there
/// would leave things. Points: `after-accept`, `after-intent`, `after-exited`,
/// `after-report`. Unset in production; it changes nothing else.
pub(crate) fn crash_point(point: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT.get_or_init(|| std::env::var("TENURE_CRASH_AT").ok()).as_deref() == Some(point) {
        tracing::error!(point, "TENURE_CRASH_AT: crashing on purpose");
        std::process::abort();
    }
}

/// How the worker observes a monitor: by its identity (pid and start time,
/// never a recycled pid) and, where the kernel has them, through a pidfd that
/// becomes readable the moment the monitor exits.
struct Monitor {
    id: ProcessId,
    pidfd: Option<AsyncFd<OwnedFd>>,
}

impl Monitor {
    /// Must be called within the runtime (the pidfd is registered with it).
    fn new(id: ProcessId, pidfd: Option<OwnedFd>) -> Monitor {
        // SAFETY: an `OwnedFd` is open, owned, and always the same descriptor
        // until the `AsyncFd` that owns it drops it.
        let pidfd = pidfd.and_then(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.ok());
        Monitor { id, pidfd }
    }

    /// A monitor found at start-up, if it still runs. Its pidfd is opened
    /// first and the identity checked second: a recorded process alive after
    /// the open had the pid before it, so the pidfd names it.
    fn attach(id: ProcessId) -> Option<Monitor> {
        let pidfd = rustix::process::Pid::from_raw(id.pid)
            .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        id.alive().then(|| Monitor::new(id, pidfd))
    }

    /// Asks the monitor to end the task; never signals a recycled pid.
    fn request_kill(&self) {
        match &self.pidfd {
            Some(fd) => {
                let _ = rustix::process::pidfd_send_signal(fd.get_ref(), rustix::process::Signal::TERM);
            }
            None if self.id.alive() && self.id.pid > 1 => {
                let _ = kill(Pid::from_raw(self.id.pid), Signal::SIGTERM);
            }
            None => {}
        }
    }

    async fn exited(&self, files: &AttemptFiles) {
        if let Some(fd) = &self.pidfd {
            if fd.readable().await.is_ok() {
                return;
            }
        }
        // No pidfd (or it failed): poll. The recorded status ends the wait as
        // soon as it exists, even if the monitor lingers as a zombie.
        while self.id.alive() && files.status().is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Drives a freshly granted attempt: intent, monitor, watch, outcome.
pub(crate) async fn run(shared: Arc<Shared>, grant: LeaseGrant, kill: Arc<Notify>) {
    let (task, attempt) = (grant.task.clone(), grant.attempt);
    // The intent carries the newest epoch this machine has seen, so a leader
    // change between accept and intent re-stamps the attempt instead of refusing it.
    let epoch = grant.epoch.max(shared.epoch_seen());
    let trace = tenure_transport::trace::current_traceparent();
    match sidecar_insist(&shared, SidecarRequest::Intent { task: task.clone(), attempt, epoch, trace }).await {
        SidecarReply::Ok => {}
        refusal => {
            tracing::warn!(task = %task, attempt = %attempt, ?refusal, "intent refused; not starting");
            let abandoned = sidecar_insist(&shared, SidecarRequest::Abandon { task: task.clone(), attempt }).await;
            let event = intent_refused(&refusal, &abandoned, attempt);
            report_until_acked(&shared, &task, attempt, grant.epoch, event).await;
            shared.held().remove(&(task.clone(), attempt));
            return;
        }
    }
    crash_point("after-intent");
    // From here on the attempt may have run: it is never given back.
    if let Some(builtin) = Builtin::of(&grant.spec.kind) {
        return run_builtin(&shared, builtin, &grant, epoch, &kill).await;
    }
    let files = AttemptFiles::new(shared.layout.attempt_dir(&task, attempt));
    let evidence = match start_monitor(&shared, &grant, &files).await {
        Err(LaunchError::NotStarted(detail)) => Evidence::Exited(Outcome::new(Ending::Failed, None, Some(detail))),
        Err(LaunchError::Unknown(detail)) => {
            tracing::warn!(task = %task, attempt = %attempt, %detail, "no word whether the monitor started; looking for it");
            unseen_monitor(&shared, &grant, &files, &kill).await
        }
        Ok(launched) => {
            let pid = launched.id.pid;
            tracing::info!(task = %task, attempt = %attempt, monitor = pid, "monitor started");
            // The started report does not wait for the `spawned` record: recovery
            // treats an attempt with its intent alike with or without it.
            let reporter = {
                let (shared, task) = (shared.clone(), task.clone());
                tokio::spawn(async move {
                    report_until_acked(&shared, &task, attempt, epoch, ReportEvent::Started { pid }).await
                })
            };
            let _ = sidecar_insist(&shared, SidecarRequest::Spawned { task: task.clone(), attempt, pid }).await;
            let monitor = Monitor::new(launched.id, launched.pidfd);
            let evidence = watch(&shared, Some(&grant), &files, monitor, &kill).await;
            // Nothing waits on the network before the outcome is buffered; the
            // final report supersedes a started report still being retried.
            reporter.abort();
            evidence
        }
    };
    finish(&shared, &task, attempt, epoch, evidence).await;
}

/// A built-in attempt after its intent: it runs in this process, then its
/// outcome goes the way of any other (buffered, reported, acknowledged). There
/// is no monitor and no pid to record (`spawned` is skipped, as for an attempt
/// whose monitor could not start). A `sleep` reports started while it runs,
/// naming the worker's own pid (the process it runs in); a `noop` is over
/// before there is anything to report but its end (leased → completed).
async fn run_builtin(shared: &Arc<Shared>, builtin: Builtin, grant: &LeaseGrant, epoch: Epoch, kill: &Notify) {
    let (task, attempt) = (grant.task.clone(), grant.attempt);
    let reporter = (builtin != Builtin::Noop).then(|| {
        let pid = i32::try_from(std::process::id()).unwrap_or(0);
        let (shared, task) = (shared.clone(), task.clone());
        tokio::spawn(
            async move { report_until_acked(&shared, &task, attempt, epoch, ReportEvent::Started { pid }).await },
        )
    });
    let outcome = builtin.run(&grant.spec.command, kill).await;
    if let Some(reporter) = reporter {
        reporter.abort();
    }
    finish(shared, &task, attempt, epoch, Evidence::Exited(outcome)).await;
}

/// Writes the attempt's `grant`, makes its scratch directory and has the
/// launcher fork its monitor (file writes, fsyncs and a fork: on a blocking
/// thread).
async fn start_monitor(
    shared: &Arc<Shared>,
    grant: &LeaseGrant,
    files: &AttemptFiles,
) -> Result<Launched, LaunchError> {
    let (shared, grant, files) = (shared.clone(), grant.clone(), files.clone());
    let started = tokio::task::spawn_blocking(move || {
        let not_started = LaunchError::NotStarted;
        files.create().map_err(|e| not_started(format!("cannot create {}: {e}", files.dir().display())))?;
        files.write_grant(&grant).map_err(|e| not_started(format!("cannot write the task's grant: {e}")))?;
        let root = shared.layout.scratch_root().ok_or_else(|| not_started("no scratch directory is set".into()))?;
        let name = format!("{}.{}", grant.task, grant.attempt);
        let scratch = crate::sandbox::create_scratch_dir(&root, &name, shared.opts.run_as.as_ref()).map_err(|e| {
            not_started(format!("cannot create the task's scratch directory {}: {e}", root.join(&name).display()))
        })?;
        shared.launcher.launch(&MonitorArgs {
            data_dir: shared.layout.root().to_path_buf(),
            task: grant.task.clone(),
            attempt: grant.attempt,
            output_cap: shared.opts.output_cap,
            kill_grace: shared.opts.kill_grace,
            scratch,
            run_as: shared.opts.run_as.clone(),
            nats: shared.task_nats.clone(),
        })
    });
    started.await.unwrap_or_else(|e| Err(LaunchError::NotStarted(format!("the monitor start was interrupted: {e}"))))
}

/// How long a monitor whose launch went unanswered is looked for.
const UNSEEN_MONITOR_BOUND: Duration = Duration::from_secs(2);

/// The launcher ended between a request and its answer: a monitor may run.
/// It is watched if it shows itself (its identity or its status in the journal) in
/// time; otherwise the attempt is settled as one whose monitor is gone.
async fn unseen_monitor(shared: &Shared, grant: &LeaseGrant, files: &AttemptFiles, kill: &Notify) -> Evidence {
    let deadline = tokio::time::Instant::now() + UNSEEN_MONITOR_BOUND;
    while tokio::time::Instant::now() < deadline {
        let journal = files.journal().unwrap_or_default();
        if journal.status.is_some() {
            break;
        }
        if let Some(monitor) = journal.monitor.and_then(Monitor::attach) {
            return watch(shared, Some(grant), files, monitor, kill).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    evidence(shared, files, false, None).await
}

/// Waits for the monitor to end (forwarding kills to it) and reads its evidence.
/// A `monitor` attempt's matched lines are forwarded this often.
const FORWARD_MATCHES_EVERY: Duration = Duration::from_millis(250);

/// `grant` is the attempt's, when known (a `monitor` attempt's matched lines
/// are forwarded only with it).
async fn watch(
    shared: &Shared,
    grant: Option<&LeaseGrant>,
    files: &AttemptFiles,
    monitor: Monitor,
    kill_req: &Notify,
) -> Evidence {
    let mut killed = false;
    let mut matches = grant.filter(|g| g.spec.pattern.is_some()).cloned().map(MatchForwarder::new);
    let mut tick = tokio::time::interval(FORWARD_MATCHES_EVERY);
    loop {
        tokio::select! {
            _ = monitor.exited(files) => break,
            _ = kill_req.notified(), if !killed => {
                killed = true;
                // Marked first: the monitor tells a kill from a machine's
                // shutdown by it. Should the mark fail, the task still ends
                // (as a `machine-shutdown` failure rather than `killed`).
                if let Err(error) = files.mark_kill_requested() {
                    tracing::warn!(dir = %files.dir().display(), %error, "cannot mark the kill request");
                }
                // The monitor ends the group (SIGTERM, grace, SIGKILL) and records it.
                monitor.request_kill();
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
                false => report_once(shared, task, attempt, epoch, event).await,
            };
            let highest = shared.epoch_seen().max(epoch);
            match ack {
                Some(ReportAck::Ack) => self.pos = next,
                Some(ack) if ack.is_stale() && ack.settles(highest) => self.stale = true,
                // Not a leader, no answer, or a deposed leader's "stale".
                Some(_) | None => return,
            }
        }
    }
}

/// What the attempt's files prove once its monitor is gone (the verdict is
/// [`settle`]'s). A group that outlived its monitor is ended first: it is ours
/// by the recorded pgid. `restarted`: the attempt, when the machine booted
/// since its intent.
async fn evidence(shared: &Shared, files: &AttemptFiles, killed: bool, restarted: Option<Attempt>) -> Evidence {
    let journal = files.journal().unwrap_or_default();
    if let Some(status) = journal.status {
        return exited(shared, journal.grant.as_ref(), status);
    }
    // The monitor is gone without evidence (it was killed, or the machine lost
    // it). A surviving group is ended only when confirmed ours: its processes
    // sit in the monitor's session. A stranger reusing the number is left alone.
    let group = journal.pgid;
    if let Some(pgid) = group.filter(|p| process::group_alive(*p)) {
        let ours = journal.monitor.is_some_and(|m| group_in_session(pgid, m.pid));
        if ours {
            tracing::warn!(pgid, dir = %files.dir().display(), "monitor gone; ending its orphaned process group");
            process::end_group(Pid::from_raw(pgid), shared.opts.kill_grace).await;
        } else {
            tracing::warn!(pgid, dir = %files.dir().display(), "process group exists but is not in the monitor's session: not ours, left alone");
        }
    }
    settle(None, killed, group, restarted.is_some(), restarted.unwrap_or_default())
}

/// The outcome the monitor recorded, completed with what only the worker adds
/// (a final-output-only task's final output), and counted. Every path that
/// settles an attempt from its recorded status goes through here; `grant` is
/// the attempt's, when known.
fn exited(shared: &Shared, grant: Option<&LeaseGrant>, status: MonitorStatus) -> Evidence {
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

/// Buffers the evidence in the sidecar, reports it until acknowledged, frees the slot.
async fn finish(shared: &Shared, task: &TaskId, attempt: Attempt, epoch: Epoch, evidence: Evidence) {
    tracing::info!(task = %task, attempt = %attempt, ?evidence, "attempt ended");
    let outcome = match &evidence {
        Evidence::Exited(o) => match o.ending {
            Ending::Completed => "completed",
            Ending::Failed => "failed",
            Ending::Killed => "killed",
        },
        Evidence::Lost(_) => "lost",
    };
    crate::metrics::get().attempts.add(1, &[opentelemetry::KeyValue::new("outcome", outcome)]);
    match evidence {
        Evidence::Exited(outcome) => {
            let exited = SidecarRequest::Exited { task: task.clone(), attempt, outcome: outcome.clone() };
            let _ = sidecar_insist(shared, exited).await;
            crash_point("after-exited");
            report_until_acked(shared, task, attempt, epoch, ReportEvent::Finished(outcome)).await;
            crash_point("after-report");
            let _ = sidecar_insist(shared, SidecarRequest::Acknowledged { task: task.clone(), attempt }).await;
            let _ = std::fs::remove_dir_all(shared.layout.attempt_dir(task, attempt));
        }
        // No outcome to buffer: a restarted worker finds the same absence of
        // evidence and reports the same thing again.
        Evidence::Lost(hint) => {
            report_until_acked(shared, task, attempt, epoch, ReportEvent::Lost(hint)).await;
        }
    }
    shared.held().remove(&(task.clone(), attempt));
}

/// What to report of an attempt whose intent the sidecar refused (nothing was
/// spawned by this process). A refusal that decided something (stale epoch,
/// wrong phase) proves the intent was not written: not started. A store
/// failure does not — a failed flush may have landed, or an unreadable record
/// may hold an earlier intent — unless the abandon that follows succeeds
/// (the record is then removed and tombstoned). Otherwise the attempt is
/// reported lost, `maybe-ran`, and never given back as "nothing ran".
fn intent_refused(refusal: &SidecarReply, abandoned: &SidecarReply, attempt: Attempt) -> ReportEvent {
    let storage = matches!(refusal, SidecarReply::Refused(SidecarRefusal::Storage(_)));
    if !storage || *abandoned == SidecarReply::Ok {
        return ReportEvent::NotStarted { reason: format!("{refusal:?}") };
    }
    ReportEvent::Lost(RecoveryHint {
        tag: HintTag::MaybeRan,
        message: format!(
            "the worker machine's store failed while recording the intent of attempt {attempt} ({refusal:?}) and \
             could not confirm it gave the attempt back ({abandoned:?}); this worker started nothing, but the \
             store cannot prove that no earlier intent was recorded: it is not run again by the system. Check the \
             machine's sidecar, then settle or resubmit the task"
        ),
    })
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
    let mut delay = Duration::from_millis(50);
    loop {
        // The highest epoch this machine has seen, as the report carries it.
        let highest = shared.epoch_seen().max(epoch);
        match report_once(shared, task, attempt, epoch, event.clone()).await {
            Some(ReportAck::Ack) => return ReportAck::Ack,
            Some(ack) if ack.is_stale() && ack.settles(highest) => {
                tracing::info!(task = %task, attempt = %attempt, "report is stale; the leader settled it otherwise");
                return ack;
            }
            answer => {
                if let Some(ReportAck::StaleAt { epoch: said }) = answer {
                    tracing::warn!(
                        task = %task, attempt = %attempt, %said, %highest,
                        "a leader below the highest epoch seen calls the report stale; kept, re-sent later"
                    );
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Sends a report once; `None` when no leader answered.
async fn report_once(
    shared: &Shared,
    task: &TaskId,
    attempt: Attempt,
    epoch: Epoch,
    event: ReportEvent,
) -> Option<ReportAck> {
    let report = tenure_protocol::messages::Report {
        worker: shared.opts.id.clone(),
        task: task.clone(),
        attempt,
        epoch: shared.epoch_seen().max(epoch),
        event,
    };
    tenure_transport::request(&shared.client, subjects::report(&shared.opts.id), &report, Duration::from_secs(2))
        .await
        .ok()
}

/// Start-up recovery from the sidecar's records and the attempts' files.
///
/// | record      | found on the machine                 | done |
/// |-------------|--------------------------------------|------|
/// | accepted    | —                                    | nothing ran: abandon, report not-started |
/// | intent/spawned | a status in the journal            | the monitor's evidence: buffer and report it |
/// | intent/spawned | monitor alive                     | re-attach: watch it as if it were ours |
/// | intent/spawned | neither                           | end any orphaned group; report lost (`maybe-ran`) |
/// | exited      | —                                    | buffered completion: report it again |
/// | acknowledged| attempt directory                    | remove the directory (confirmed done) |
/// | unreadable  | —                                    | report lost (`sidecar-corrupt`) |
///
/// Attempt directories that no record names are removed only when their monitor
/// and group are confirmed gone; otherwise kept, with a warning saying why.
/// Scratch directories are kept while their task has a record here, and
/// removed once it has none (its files were released).
pub(crate) async fn recover(shared: &Arc<Shared>) {
    // Every record, page by page (a machine can hold more than one message).
    let (mut epoch, mut records, mut corrupt, mut request) = (Epoch(0), Vec::new(), Vec::new(), SidecarRequest::List);
    loop {
        match shared.sidecar.call(&request).await {
            Ok(SidecarReply::Records { epoch: e, records: page, corrupt: bad, next }) => {
                epoch = epoch.max(e);
                records.extend(page);
                corrupt.extend(bad);
                match next {
                    Some((task, attempt)) => request = SidecarRequest::ListFrom { task, attempt },
                    None => break,
                }
                continue;
            }
            Ok(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                return recover_without_records(shared, &reason);
            }
            Ok(other) => tracing::error!(?other, "sidecar answered List oddly; retrying"),
            Err(error) => tracing::warn!(%error, "waiting for the sidecar"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shared.observe_epoch(epoch);
    let mut known = std::collections::HashSet::new();
    let boot = tenure_machine::boot::boot_id();
    for record in records {
        let grant = record.grant.clone();
        let (task, attempt) = (grant.task.clone(), grant.attempt);
        known.insert(format!("{task}.{attempt}"));
        let files = AttemptFiles::new(shared.layout.attempt_dir(&task, attempt));
        match record.phase {
            Phase::Acknowledged => {
                let _ = std::fs::remove_dir_all(files.dir());
            }
            Phase::Accepted => {
                tracing::info!(task = %task, attempt = %attempt, "accepted but never started: giving it back");
                let _ = sidecar_insist(shared, SidecarRequest::Abandon { task: task.clone(), attempt }).await;
                let shared = shared.clone();
                let event = ReportEvent::NotStarted { reason: "worker restarted before the intent".into() };
                tokio::spawn(async move { report_until_acked(&shared, &task, attempt, grant.epoch, event).await });
            }
            Phase::Exited => {
                let Some(outcome) = record.outcome.clone() else { continue };
                tracing::info!(task = %task, attempt = %attempt, "re-reporting buffered completion");
                adopt(shared, &grant, |_, _| async move { Evidence::Exited(outcome) });
            }
            Phase::Intent | Phase::Spawned => {
                let journal = files.journal().unwrap_or_default();
                if let Some(status) = journal.status {
                    tracing::info!(task = %task, attempt = %attempt, "attempt ended while the worker was down");
                    let known = grant.clone();
                    adopt(shared, &grant, move |shared, _| async move { exited(&shared, Some(&known), status) });
                } else if let Some(monitor) = journal.monitor.and_then(Monitor::attach) {
                    tracing::info!(task = %task, attempt = %attempt, monitor = monitor.id.pid, "re-attaching to a running attempt");
                    let known = grant.clone();
                    adopt(shared, &grant, move |shared, kill| async move {
                        watch(&shared, Some(&known), &files, monitor, &kill).await
                    });
                } else {
                    tracing::warn!(task = %task, attempt = %attempt, "attempt's monitor is gone without evidence");
                    let restarted = tenure_machine::boot::booted_since(&record, boot.as_deref()).then_some(attempt);
                    adopt(
                        shared,
                        &grant,
                        move |shared, _| async move { evidence(&shared, &files, false, restarted).await },
                    );
                }
            }
        }
    }
    for c in corrupt {
        let Some((task, attempt)) = c.attempt else {
            tracing::error!(key = %c.key, reason = %c.reason, "unreadable sidecar record names no attempt");
            continue;
        };
        known.insert(format!("{task}.{attempt}"));
        // The record is lost, but the monitor's own files may still prove what happened.
        let files = AttemptFiles::new(shared.layout.attempt_dir(&task, attempt));
        let journal = files.journal().unwrap_or_default();
        if journal.status.is_some() || journal.monitor.is_some_and(|m| m.alive()) {
            tracing::warn!(task = %task, attempt = %attempt, reason = %c.reason, "unreadable record; settling from the monitor's evidence");
            settle_from_files(shared, task, attempt, files);
            continue;
        }
        let hint = RecoveryHint {
            tag: HintTag::SidecarCorrupt,
            message: format!(
                "the worker machine's record of attempt {attempt} is unreadable ({}); whether and how it ran is \
                 lost; it will not be run again by the system",
                c.reason
            ),
        };
        let (shared, epoch) = (shared.clone(), shared.epoch_seen());
        tokio::spawn(async move { report_until_acked(&shared, &task, attempt, epoch, ReportEvent::Lost(hint)).await });
    }
    sweep_unknown_attempt_dirs(shared, &known).await;
    let tasks: std::collections::HashSet<&str> =
        known.iter().filter_map(|k| k.rsplit_once('.')).map(|(t, _)| t).collect();
    sweep_scratch_dirs(shared, &tasks);
}

/// Scratch directories whose task this machine no longer holds any record of:
/// the task's files were released (its cleanup job removes them; one that was
/// interrupted leaves them behind) and nothing can use them any more, so they
/// are removed. A directory whose task still has a record or an attempt
/// directory is kept (it is released with the task's files); a name that is
/// not `<task>.<attempt>` was not made by a worker and is left alone.
fn sweep_scratch_dirs(shared: &Shared, tasks: &std::collections::HashSet<&str>) {
    let Some(root) = shared.layout.scratch_root() else { return };
    let Ok(entries) = std::fs::read_dir(&root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let parsed = name.rsplit_once('.').and_then(|(t, a)| Some((t.parse::<TaskId>().ok()?, a.parse::<u32>().ok()?)));
        let Some((task, attempt)) = parsed else {
            tracing::warn!(dir = %entry.path().display(), "not a scratch directory of this worker: left alone");
            continue;
        };
        let held =
            tasks.contains(task.to_string().as_str()) || shared.layout.attempt_dir(&task, Attempt(attempt)).exists();
        if held {
            continue;
        }
        tracing::info!(task = %task, attempt, dir = %entry.path().display(), "removing the scratch directory of a task whose files were released");
        if let Err(error) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(task = %task, attempt, %error, "cannot remove a released scratch directory");
        }
    }
}

/// Recovery when the machine's recovery store is unusable: the records are lost,
/// but every attempt that reached its intent has a directory, and its monitor's
/// evidence is there. Each is re-attached or settled from it; attempts that
/// never reached their intent have no directory and nothing ran for them.
fn recover_without_records(shared: &Arc<Shared>, reason: &str) {
    tracing::error!(reason, "the sidecar cannot read its records; settling attempts from their directories");
    let Ok(entries) = std::fs::read_dir(shared.layout.attempts_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let parsed = name.rsplit_once('.').and_then(|(t, a)| Some((t.parse::<TaskId>().ok()?, a.parse().ok()?)));
        let Some((task, attempt)) = parsed else {
            tracing::warn!(dir = %name, "not an attempt directory: kept");
            continue;
        };
        settle_from_files(shared, task, Attempt(attempt), AttemptFiles::new(entry.path()));
    }
}

/// Holds the attempt again and settles it from its directory alone: re-attached
/// while its monitor lives, else from the monitor's evidence (or its absence).
fn settle_from_files(shared: &Arc<Shared>, task: TaskId, attempt: Attempt, files: AttemptFiles) {
    let kill = Arc::new(Notify::new());
    shared.held().insert((task.clone(), attempt), Held { kill: kill.clone() });
    let shared = shared.clone();
    tokio::spawn(async move {
        let journal = files.journal().unwrap_or_default();
        let grant = journal.grant.as_ref();
        let evidence = match journal.monitor.filter(|_| journal.status.is_none()).and_then(Monitor::attach) {
            Some(monitor) => watch(&shared, grant, &files, monitor, &kill).await,
            None => evidence(&shared, &files, false, None).await,
        };
        let epoch = grant.map(|g| g.epoch).unwrap_or_default().max(shared.epoch_seen());
        finish(&shared, &task, attempt, epoch, evidence).await;
    });
}

/// Holds `grant`'s attempt again and settles it with the evidence `get` finds.
fn adopt<F, Fut>(shared: &Arc<Shared>, grant: &LeaseGrant, get: F)
where
    F: FnOnce(Arc<Shared>, Arc<Notify>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Evidence> + Send,
{
    let kill = Arc::new(Notify::new());
    shared.held().insert((grant.task.clone(), grant.attempt), Held { kill: kill.clone() });
    let (shared, task, attempt, epoch) = (shared.clone(), grant.task.clone(), grant.attempt, grant.epoch);
    tokio::spawn(async move {
        let evidence = get(shared.clone(), kill).await;
        finish(&shared, &task, attempt, epoch, evidence).await;
    });
}

/// Attempt directories no record names. A directory with a readable `grant` is
/// an attempt whose record was lost (sled can drop damaged data silently): it is
/// settled from its files like any other. Anything else is removed only when
/// confirmed dead (seed 004), and kept with a warning otherwise.
async fn sweep_unknown_attempt_dirs(shared: &Arc<Shared>, known: &std::collections::HashSet<String>) {
    let Ok(entries) = std::fs::read_dir(shared.layout.attempts_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if known.contains(&name) {
            continue;
        }
        let files = AttemptFiles::new(entry.path());
        let journal = files.journal().unwrap_or_default();
        if let Some(grant) = journal.grant.filter(|g| name == format!("{}.{}", g.task, g.attempt)) {
            tracing::warn!(dir = %name, "attempt directory without a record: the record was lost; settling from the monitor's files");
            settle_from_files(shared, grant.task, grant.attempt, files);
            continue;
        }
        let monitor_alive = journal.monitor.is_some_and(|m| m.alive());
        let group_alive = journal.pgid.is_some_and(process::group_alive);
        if monitor_alive || group_alive {
            tracing::warn!(dir = %name, monitor_alive, group_alive, "attempt directory without a record but with live processes: kept");
        } else {
            tracing::info!(dir = %name, "removing an attempt directory no record names and no process uses");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> SidecarReply {
        SidecarReply::Refused(SidecarRefusal::Storage("flush failed".into()))
    }

    #[test]
    fn an_intent_refused_by_a_failing_store_is_maybe_ran_unless_the_abandon_lands() {
        let stale = SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(4), offered: Epoch(3) });
        // A refusal that decided something proves the intent was not written.
        assert!(matches!(intent_refused(&stale, &storage(), Attempt(1)), ReportEvent::NotStarted { .. }));
        // A store failure, then a confirmed abandon: the record is gone.
        assert!(matches!(intent_refused(&storage(), &SidecarReply::Ok, Attempt(1)), ReportEvent::NotStarted { .. }));
        // A store failure that nothing disproves: lost, maybe-ran.
        for abandoned in [storage(), stale] {
            match intent_refused(&storage(), &abandoned, Attempt(1)) {
                ReportEvent::Lost(hint) => assert_eq!(hint.tag, HintTag::MaybeRan),
                other => panic!("given back as not started: {other:?}"),
            }
        }
    }
}
