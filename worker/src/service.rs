//! The worker's event loop: heartbeats, grant and kill commands, and one
//! supervising task per running attempt.
//!
//! Order of an attempt, each step durable in the sidecar before the next:
//! accept (grant recorded) → intent (flushed) → spawn → spawned (pid) →
//! exit → exited (outcome buffered) → report until acknowledged → acknowledged.
//! Without a sidecar nothing new starts; a grant is refused rather than run
//! without its intent.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tenure_protocol::messages::{
    HeldAttempt, KillCommand, LeaseGrant, Phase, Refusal, Report, ReportAck, ReportEvent, SidecarRefusal, SidecarReply,
    SidecarRequest, WorkerCommand, WorkerReply,
};
use tenure_protocol::{subjects, Attempt, Ending, Epoch, Kind, Outcome, TaskId, WorkerId};
use tenure_sidecar::{ClientError, Layout, SidecarClient};
use tokio::sync::Notify;
use tracing::Instrument;
use uuid::Uuid;

use crate::process;

#[derive(Debug, Clone)]
pub struct Options {
    pub nats_url: String,
    pub id: WorkerId,
    pub slots: u32,
    pub data_dir: PathBuf,
    pub kinds: Vec<Kind>,
    pub heartbeat: Duration,
    /// Time between SIGTERM and SIGKILL when a task's group is ended.
    pub kill_grace: Duration,
}

impl Options {
    pub fn new(nats_url: String, id: WorkerId, data_dir: PathBuf) -> Options {
        Options {
            nats_url,
            id,
            slots: 4,
            data_dir,
            kinds: vec![Kind::shell()],
            heartbeat: Duration::from_millis(1000),
            kill_grace: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] tenure_transport::Error),
    #[error("NATS subscription failed: {0}")]
    Subscribe(String),
    #[error("data dir: {0}")]
    Layout(String),
}

/// One attempt this worker holds.
struct Held {
    attempt: Attempt,
    kill: Arc<Notify>,
}

struct Shared {
    opts: Options,
    layout: Layout,
    client: async_nats::Client,
    sidecar: SidecarClient,
    held: Mutex<HashMap<TaskId, Held>>,
    /// Kills that arrived for attempts never granted here: a late grant for one
    /// of them is refused, so a kill can never be overtaken by its own grant.
    killed_unknown: Mutex<HashSet<(TaskId, Attempt)>>,
    epoch_seen: Mutex<Epoch>,
}

impl Shared {
    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<TaskId, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn observe_epoch(&self, epoch: Epoch) {
        let mut seen = self.epoch_seen.lock().unwrap_or_else(|p| p.into_inner());
        *seen = (*seen).max(epoch);
    }

    fn epoch_seen(&self) -> Epoch {
        *self.epoch_seen.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs the worker until `shutdown` resolves, then ends its running tasks.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    process::become_subreaper();
    let layout = Layout::new(&opts.data_dir);
    layout.create_dirs().map_err(|e| Error::Layout(e.to_string()))?;
    let client = tenure_transport::connect(&opts.nats_url, &format!("tenure-worker-{}", opts.id), true).await?;
    let sidecar = SidecarClient::new(layout.socket_path());
    let shared = Arc::new(Shared {
        layout,
        client: client.clone(),
        sidecar,
        held: Mutex::new(HashMap::new()),
        killed_unknown: Mutex::new(HashSet::new()),
        epoch_seen: Mutex::new(Epoch(0)),
        opts,
    });
    recover(&shared).await;

    let mut commands = client
        .subscribe(subjects::worker_commands(&shared.opts.id))
        .await
        .map_err(|e| Error::Subscribe(e.to_string()))?;
    let instance = Uuid::new_v4();
    // Heartbeats run apart from command handling, so a slow sidecar call never
    // makes a live worker look lost.
    let beats = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(shared.opts.heartbeat);
            loop {
                beat.tick().await;
                heartbeat(&shared, instance).await;
            }
        })
    };
    tracing::info!(worker = %shared.opts.id, slots = shared.opts.slots, %instance, "worker ready");
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(msg) = commands.next() => {
                let reply = match tenure_protocol::decode::<WorkerCommand>(&msg.payload) {
                    Ok(WorkerCommand::Grant(grant)) => on_grant(&shared, grant).await,
                    Ok(WorkerCommand::Kill(kill)) => on_kill(&shared, kill).await,
                    Err(error) => {
                        tracing::warn!(%error, "malformed command refused");
                        WorkerReply::Refused(Refusal::Malformed(error.to_string()))
                    }
                };
                if let Some(to) = msg.reply {
                    tenure_transport::reply(&client, to.to_string(), &reply).await;
                }
            }
        }
    }
    stop_running(&shared).await;
    beats.abort();
    Ok(())
}

async fn heartbeat(shared: &Shared, instance: Uuid) {
    let attempts =
        shared.held().iter().map(|(task, h)| HeldAttempt { task: task.clone(), attempt: h.attempt }).collect();
    let hb = tenure_protocol::messages::Heartbeat {
        worker: shared.opts.id.clone(),
        instance,
        slots: shared.opts.slots,
        kinds: shared.opts.kinds.clone(),
        epoch_seen: shared.epoch_seen(),
        attempts,
    };
    match tenure_protocol::encode(&hb) {
        Ok(bytes) => {
            if let Err(error) = shared.client.publish(subjects::HEARTBEAT, bytes.into()).await {
                tracing::warn!(%error, "heartbeat not sent");
            }
        }
        Err(error) => tracing::error!(%error, "heartbeat too large"),
    }
}

/// Calls the sidecar until it answers (it may be restarting), for steps that
/// must not be skipped: intent, spawned, exited, acknowledged.
async fn sidecar_insist(shared: &Shared, req: SidecarRequest) -> SidecarReply {
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

async fn on_grant(shared: &Arc<Shared>, grant: LeaseGrant) -> WorkerReply {
    let key = (grant.task.clone(), grant.attempt);
    if let Some(h) = shared.held().get(&grant.task) {
        if h.attempt == grant.attempt {
            return WorkerReply::Accepted;
        }
    }
    if shared.killed_unknown.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
        return WorkerReply::Refused(Refusal::UnknownAttempt);
    }
    if !shared.opts.kinds.contains(&grant.spec.kind) {
        return WorkerReply::Refused(Refusal::UnsupportedKind(grant.spec.kind.to_string()));
    }
    if shared.held().len() >= shared.opts.slots as usize {
        return WorkerReply::Refused(Refusal::NoSlot);
    }
    match shared.sidecar.call(&SidecarRequest::Accept(grant.clone())).await {
        Ok(SidecarReply::Ok) => {}
        Ok(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
            shared.observe_epoch(held);
            return WorkerReply::Refused(Refusal::StaleEpoch { held, offered });
        }
        Ok(other) => return WorkerReply::Refused(Refusal::SidecarUnavailable(format!("{other:?}"))),
        Err(e) => return WorkerReply::Refused(Refusal::SidecarUnavailable(e.to_string())),
    }
    shared.observe_epoch(grant.epoch);
    let kill = Arc::new(Notify::new());
    shared.held().insert(grant.task.clone(), Held { attempt: grant.attempt, kill: kill.clone() });
    tracing::info!(task = %grant.task, attempt = %grant.attempt, epoch = %grant.epoch, "grant accepted");
    let span = tracing::info_span!("attempt", task = %grant.task, attempt = %grant.attempt, epoch = %grant.epoch);
    tokio::spawn(supervise(shared.clone(), grant, kill).instrument(span));
    WorkerReply::Accepted
}

async fn on_kill(shared: &Shared, cmd: KillCommand) -> WorkerReply {
    match shared.sidecar.call(&SidecarRequest::ObserveEpoch(cmd.epoch)).await {
        Ok(SidecarReply::Ok) => shared.observe_epoch(cmd.epoch),
        Ok(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
            return WorkerReply::Refused(Refusal::StaleEpoch { held, offered })
        }
        Ok(other) => return WorkerReply::Refused(Refusal::SidecarUnavailable(format!("{other:?}"))),
        Err(e) => return WorkerReply::Refused(Refusal::SidecarUnavailable(e.to_string())),
    }
    let held = shared.held().get(&cmd.task).filter(|h| h.attempt == cmd.attempt).map(|h| h.kill.clone());
    match held {
        Some(kill) => {
            tracing::info!(task = %cmd.task, attempt = %cmd.attempt, epoch = %cmd.epoch, "kill requested");
            kill.notify_one();
            WorkerReply::Accepted
        }
        None => {
            shared.killed_unknown.lock().unwrap_or_else(|p| p.into_inner()).insert((cmd.task, cmd.attempt));
            WorkerReply::Refused(Refusal::UnknownAttempt)
        }
    }
}

/// Drives one attempt from intent to acknowledged completion.
async fn supervise(shared: Arc<Shared>, grant: LeaseGrant, kill: Arc<Notify>) {
    let (task, attempt, epoch) = (grant.task.clone(), grant.attempt, grant.epoch);
    // Intent before effect: the process is spawned only after this is durable.
    // The intent carries the newest epoch this machine has seen, so a leader
    // change between accept and intent re-stamps the attempt instead of refusing it.
    let epoch = epoch.max(shared.epoch_seen());
    match sidecar_insist(&shared, SidecarRequest::Intent { task: task.clone(), attempt, epoch }).await {
        SidecarReply::Ok => {}
        refusal => {
            tracing::warn!(task = %task, attempt = %attempt, ?refusal, "intent refused; not starting");
            let _ = sidecar_insist(&shared, SidecarRequest::Abandon { task: task.clone(), attempt }).await;
            report_until_acked(&shared, &grant, ReportEvent::NotStarted { reason: format!("{refusal:?}") }).await;
            shared.held().remove(&task);
            return;
        }
    }
    let outcome = match open_and_spawn(&shared, &grant) {
        Err(detail) => Outcome { ending: Ending::Failed, exit_code: None, detail: Some(detail) },
        Ok(running) => {
            let pid = running.pid;
            tracing::info!(task = %task, attempt = %attempt, pid, "process started");
            let _ = sidecar_insist(&shared, SidecarRequest::Spawned { task: task.clone(), attempt, pid }).await;
            let reporter = {
                let (shared, grant) = (shared.clone(), grant.clone());
                tokio::spawn(async move { report_until_acked(&shared, &grant, ReportEvent::Started { pid }).await })
            };
            let outcome = running.finish(kill.notified(), shared.opts.kill_grace).await;
            // Nothing waits on the network before the outcome is buffered (in
            // `finalize`); the finished report supersedes a started report that
            // is still being retried.
            reporter.abort();
            outcome
        }
    };
    tracing::info!(task = %task, attempt = %attempt, ending = ?outcome.ending, detail = ?outcome.detail, "attempt ended");
    finalize(&shared, &grant, outcome).await;
}

/// Buffers the outcome in the sidecar, reports it until acknowledged, then marks
/// it acknowledged and frees the slot.
async fn finalize(shared: &Shared, grant: &LeaseGrant, outcome: Outcome) {
    let (task, attempt) = (grant.task.clone(), grant.attempt);
    let _ =
        sidecar_insist(shared, SidecarRequest::Exited { task: task.clone(), attempt, outcome: outcome.clone() }).await;
    report_until_acked(shared, grant, ReportEvent::Finished(outcome)).await;
    let _ = sidecar_insist(shared, SidecarRequest::Acknowledged { task: task.clone(), attempt }).await;
    shared.held().remove(&task);
}

fn open_and_spawn(shared: &Shared, grant: &LeaseGrant) -> Result<process::Running, String> {
    let path = shared.layout.output_path(&grant.task);
    let file = tenure_sidecar::layout::open_output_for_append(&path)
        .map_err(|e| format!("cannot open output file {}: {e}", path.display()))?;
    process::spawn(&grant.spec, file, shared.layout.root()).map_err(|e| format!("spawn failed: {e}"))
}

/// Sends a report until the leader acknowledges it (or says it is stale).
async fn report_until_acked(shared: &Shared, grant: &LeaseGrant, event: ReportEvent) {
    let report = Report {
        worker: shared.opts.id.clone(),
        task: grant.task.clone(),
        attempt: grant.attempt,
        epoch: shared.epoch_seen().max(grant.epoch),
        event,
    };
    let mut delay = Duration::from_millis(50);
    loop {
        let result: Result<ReportAck, _> =
            tenure_transport::request(&shared.client, subjects::REPORT.to_owned(), &report, Duration::from_secs(2))
                .await;
        match result {
            Ok(ReportAck::Ack) => return,
            Ok(ReportAck::Stale) => {
                tracing::info!(task = %report.task, attempt = %report.attempt, "report is stale; the leader settled it");
                return;
            }
            Ok(ReportAck::NotLeader) | Err(_) => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Start-up recovery from the sidecar's records.
///
/// - accepted, no intent: nothing ran; give the attempt back.
/// - exited, not acknowledged: a buffered completion; report it again.
/// - intent or spawned: the process may still run, but this worker is not its
///   parent and cannot learn its exit status; it stays held (listed in every
///   heartbeat) until re-attachment through per-task monitors takes it over.
async fn recover(shared: &Arc<Shared>) {
    let (epoch, records) = loop {
        match shared.sidecar.call(&SidecarRequest::List).await {
            Ok(SidecarReply::Records { epoch, records }) => break (epoch, records),
            Ok(other) => tracing::error!(?other, "sidecar answered List oddly; retrying"),
            Err(error) => tracing::warn!(%error, "waiting for the sidecar"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    shared.observe_epoch(epoch);
    for record in records {
        let grant = record.grant.clone();
        let (task, attempt) = (grant.task.clone(), grant.attempt);
        match record.phase {
            Phase::Acknowledged => {}
            Phase::Accepted => {
                tracing::info!(task = %task, attempt = %attempt, "accepted before restart, never started: giving back");
                let _ = sidecar_insist(shared, SidecarRequest::Abandon { task, attempt }).await;
                let shared = shared.clone();
                tokio::spawn(async move {
                    report_until_acked(&shared, &grant, ReportEvent::NotStarted { reason: "worker restarted".into() })
                        .await
                });
            }
            Phase::Exited => {
                let Some(outcome) = record.outcome.clone() else { continue };
                tracing::info!(task = %task, attempt = %attempt, "re-reporting buffered completion");
                shared.held().insert(task, Held { attempt, kill: Arc::new(Notify::new()) });
                let shared = shared.clone();
                tokio::spawn(async move {
                    report_until_acked(&shared, &grant, ReportEvent::Finished(outcome.clone())).await;
                    let _ = sidecar_insist(
                        &shared,
                        SidecarRequest::Acknowledged { task: grant.task.clone(), attempt: grant.attempt },
                    )
                    .await;
                    shared.held().remove(&grant.task);
                });
            }
            Phase::Intent | Phase::Spawned => {
                tracing::warn!(task = %task, attempt = %attempt, pid = ?record.pid, "attempt started before this worker restarted; holding it without re-running");
                shared.held().insert(task, Held { attempt, kill: Arc::new(Notify::new()) });
            }
        }
    }
}

/// Graceful shutdown: ends every running task's group and gives the supervisors a
/// bounded time to buffer (and report) the outcomes. Until per-task monitors can
/// re-attach a restarted worker to live processes, a worker that stops must not
/// leave unsupervised processes behind; outcomes not yet reported stay buffered
/// in the sidecar and are re-reported at the next start.
async fn stop_running(shared: &Shared) {
    let kills: Vec<Arc<Notify>> = shared.held().values().map(|h| h.kill.clone()).collect();
    tracing::info!(worker = %shared.opts.id, running = kills.len(), "worker stopping; ending running tasks");
    for kill in kills {
        kill.notify_one();
    }
    let deadline = tokio::time::Instant::now() + shared.opts.kill_grace + Duration::from_secs(3);
    while !shared.held().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
