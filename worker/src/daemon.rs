//! The worker's event loop: heartbeats, grant and kill commands; each accepted
//! attempt is driven by [`crate::attempt`].
//!
//! Order of an attempt, each step durable in the sidecar before the next:
//! accept and intent (the grant recorded with its intent, one flush; the
//! intent alone again when it could not travel with it) → shim spawned → spawned (pid)
//! → exit recorded by the shim → exited (outcome buffered) → report until
//! acknowledged → acknowledged. Without a sidecar nothing new starts; a grant is
//! refused rather than run without its intent.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tenure_machine::attempt_files::AttemptFiles;
use tenure_machine::worker_lock::WorkerLock;
use tenure_machine::{Layout, SidecarClient};
use tenure_protocol::messages::{
    Grants, KillCommand, LeaseGrant, PauseCommand, Refusal, SidecarHealth, SidecarRefusal, SidecarReply,
    SidecarRequest, WorkerCommand, WorkerReply, MAX_GRANTS, MAX_SIDECAR_MANY,
};
use tenure_protocol::{subjects, Epoch, Kind};
use uuid::Uuid;

use crate::attempt::{self, spawn_drive, Shared, State};
use crate::core::{Config, Key, Screened};
use crate::launcher::Launcher;
use crate::options::{Error, Options};

/// Finds where the attempts' control groups go, saying once what this
/// worker cannot do without them.
fn cgroups(opts: &Options) -> Option<crate::cgroup::Plan> {
    if !opts.cgroups {
        tracing::warn!(
            "cgroups turned off (--no-cgroups): tasks run without resource limits, and processes that leave a \
             task's process group are not tracked"
        );
        return None;
    }
    // The same directory however it was named, so a restart finds its groups.
    let data_dir = std::fs::canonicalize(&opts.data_dir).unwrap_or_else(|_| opts.data_dir.clone());
    match crate::cgroup_fs::detect(&opts.id, &data_dir) {
        Ok(plan) => {
            let support = plan.support();
            let missing: Vec<&str> =
                ["memory", "cpu", "pids"].into_iter().filter(|c| plan.enforces(c).is_none()).collect();
            tracing::info!(
                cgroup = %plan.unified.display(), v2 = ?plan.v2, v1 = ?plan.v1.keys().collect::<Vec<_>>(),
                enforces = ?support.names(), "each attempt runs in its own cgroup"
            );
            if !missing.is_empty() {
                tracing::warn!(
                    ?missing,
                    "no cgroup controller for these limits here: tasks asking for them are refused"
                );
            }
            Some(plan)
        }
        Err(error) => {
            tracing::warn!(
                %error,
                "no usable cgroup v2 hierarchy (the worker needs root or a delegated cgroup): tasks run without \
                 resource limits (tasks asking for them are refused), and processes that leave a task's process \
                 group are not tracked"
            );
            None
        }
    }
}

/// Runs the worker until `shutdown` resolves. Running tasks keep running under
/// their shims unless `kill_tasks_on_exit` is set.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    let layout = Layout::new(&opts.data_dir);
    layout.create_dirs().map_err(|e| Error::Layout(e.to_string()))?;
    // One worker per data directory, for this process's whole life: the lock is
    // also what the sidecar checks to answer this process and no other.
    let _lock = WorkerLock::acquire(&layout.lock_path())?;
    if let Some(user) = &opts.run_as {
        let me = nix::unistd::geteuid();
        if !me.is_root() {
            return Err(crate::sandbox::Error::NotRoot { user: user.user.clone(), uid: me.as_raw() }.into());
        }
    }
    let scratch = crate::sandbox::scratch_root(opts.scratch_dir.as_deref(), layout.root())?;
    crate::sandbox::prepare_scratch_root(&scratch, layout.root(), opts.run_as.as_ref())?;
    layout
        .record_scratch_root(&scratch)
        .map_err(|e| Error::Layout(format!("cannot record the scratch directory: {e}")))?;
    let layout = layout.with_scratch_root(&scratch);
    tracing::info!(scratch = %scratch.display(), run_as = opts.run_as.as_ref().map(|r| r.user.as_str()), "tasks run in their own scratch directories");
    let client = tenure_transport::connect(&opts.nats, &format!("tenure-worker-{}", opts.id), true).await?;
    tenure_transport::identity::Trust::announce(&client, "worker");
    let sidecar = SidecarClient::new(layout.socket_path());
    let cgroups = cgroups(&opts);
    let enforces = cgroups.as_ref().map(crate::cgroup::Plan::support).unwrap_or_default();
    let scratch = crate::scratch::ScratchDirs::open(&scratch, opts.run_as.as_ref());
    let shared = Arc::new(Shared {
        scratch,
        launcher: Launcher::new(opts.shim_program.clone(), layout.root().to_path_buf()),
        layout,
        client: client.clone(),
        sidecar,
        reports: crate::reports::reporter(client.clone(), opts.id.clone()),
        task_nats: crate::sandbox::servers_for_tasks(&opts.nats.servers),
        cgroups,
        state: Mutex::new(State::new(
            Config { slots: opts.slots, kinds: opts.kinds.clone(), enforces },
            opts.started_hold,
        )),
        opts,
    });
    crate::recovery::recover(&shared).await;

    let instance = Uuid::new_v4();
    let replaces = take_instance(&shared.layout, instance)?;
    // Commands come on this process's own subject; the id's shared subject
    // carries only the leader's word that the id is taken.
    let subscribe = |subject: String| {
        let client = client.clone();
        async move { client.subscribe(subject).await.map_err(|e| Error::Subscribe(e.to_string())) }
    };
    let mut commands = futures::stream::select(
        subscribe(subjects::instance_commands(&shared.opts.id, &instance)).await?,
        subscribe(subjects::worker_commands(&shared.opts.id)).await?,
    );
    let mut epochs = client.subscribe(subjects::EPOCH_ANNOUNCE).await.map_err(|e| Error::Subscribe(e.to_string()))?;
    // Heartbeats run apart from command handling, so a slow sidecar call never
    // makes a live worker look lost.
    let beats = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut beat = tokio::time::interval(shared.opts.heartbeat);
            let mut was_waiting = HashSet::new();
            loop {
                beat.tick().await;
                heartbeat(&shared, instance, replaces, &mut was_waiting).await;
            }
        })
    };
    tracing::info!(worker = %shared.opts.id, slots = shared.opts.slots, %instance, "worker ready");
    tokio::pin!(shutdown);
    // Set while the leader says another live process holds this id (since,
    // last said, holder): this one runs nothing new. A predecessor that died
    // without a trace here (a wiped data directory) stops being "live" at the
    // leader after its worker TTL, and the refusals stop; a second process
    // that is really alive keeps being refused, finishes reporting what it
    // holds, and stops.
    let mut taken: Option<(tokio::time::Instant, tokio::time::Instant, Uuid)> = None;
    let mut drain = tokio::time::interval(Duration::from_millis(250));
    loop {
        if let Some((since, last, holder)) = taken {
            let now = tokio::time::Instant::now();
            if now.saturating_duration_since(last) > shared.opts.heartbeat * 3 {
                tracing::info!(worker = %shared.opts.id, %instance, "no longer refused: this process holds the worker id");
                taken = None;
            } else if now.saturating_duration_since(since) >= ID_TAKEN_PATIENCE && !shared.state().core.holds_any() {
                beats.abort();
                return Err(Error::IdTaken { worker: shared.opts.id.clone(), instance, holder });
            }
        }
        tokio::select! {
            _ = &mut shutdown => break,
            _ = drain.tick(), if taken.is_some() => continue,
            Some(msg) = epochs.next() => match tenure_protocol::decode::<Epoch>(&msg.payload) {
                // A new leader announced itself: the machine's fence moves up at
                // once, before any command of the old leader can arrive late.
                Ok(epoch) => match shared.sidecar.call(&SidecarRequest::ObserveEpoch(epoch)).await {
                    Ok(SidecarReply::Ok) => {
                        tracing::info!(%epoch, "new leader epoch observed");
                        shared.state().core.observe(epoch);
                    }
                    other => tracing::debug!(%epoch, ?other, "epoch announcement not recorded"),
                },
                Err(error) => tracing::warn!(%error, "malformed epoch announcement ignored"),
            },
            Some(msg) = commands.next() => {
                // Commands that arrived together are taken together, so that
                // the grants among them are recorded in one batch.
                let mut msgs = vec![msg];
                while msgs.len() < MAX_SIDECAR_MANY {
                    match commands.next().now_or_never() {
                        Some(Some(msg)) => msgs.push(msg),
                        _ => break,
                    }
                }
                let mut grants = GrantGroup::default();
                for msg in msgs {
                    // A traced grant continues its task's trace; the attempt span
                    // (and everything it reports) is a child of this one.
                    let parent = tenure_transport::trace::from_headers(msg.headers.as_ref());
                    let command = tenure_protocol::decode::<WorkerCommand>(&msg.payload);
                    // Grants the leader sent together join the group, answered together.
                    if command.is_err() {
                        if let Ok(batch) = tenure_protocol::decode::<Grants>(&msg.payload) {
                            if let Some(refused) = grants.push_batch(batch, msg.reply.clone()) {
                                if let Some(to) = msg.reply {
                                    tenure_transport::reply(&client, to.to_string(), &refused).await;
                                }
                            }
                            continue;
                        }
                    }
                    // Any other command is handled after the grants before it.
                    if !matches!(command, Ok(WorkerCommand::Grant(_))) {
                        answer_grants(&shared, &client, std::mem::take(&mut grants)).await;
                    }
                    let reply = match command {
                        Ok(WorkerCommand::Grant(grant)) => {
                            let span = if tenure_transport::trace::is_remote(&parent) {
                                let span = tracing::info_span!("grant", task = %grant.task, attempt = %grant.attempt, epoch = %grant.epoch, worker = %shared.opts.id);
                                tenure_transport::trace::continue_from(&span, parent);
                                span
                            } else {
                                tracing::Span::none()
                            };
                            grants.push(grant, span, msg.reply);
                            continue;
                        }
                        Ok(WorkerCommand::Kill(kill)) => on_kill(&shared, kill).await,
                        Ok(WorkerCommand::Pause(pause)) => on_pause(&shared, pause).await,
                        Ok(WorkerCommand::InstanceTaken { instance: refused, holder }) => {
                            if refused == instance {
                                let now = tokio::time::Instant::now();
                                let (since, _, _) = taken.get_or_insert_with(|| {
                                    tracing::error!(
                                        worker = %shared.opts.id, %instance, %holder, running = shared.state().core.held_count(),
                                        "the leader says another live process holds this worker id: no new work comes here"
                                    );
                                    (now, now, holder)
                                });
                                taken = Some((*since, now, holder));
                            }
                            continue;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "malformed command refused");
                            WorkerReply::Refused(Refusal::Malformed(error.to_string()))
                        }
                    };
                    if let Some(to) = msg.reply {
                        tenure_transport::reply(&client, to.to_string(), &reply).await;
                    }
                }
                answer_grants(&shared, &client, grants).await;
            }
        }
    }
    beats.abort();
    if shared.opts.kill_tasks_on_exit {
        stop_running(&shared).await;
    } else {
        tracing::info!(worker = %shared.opts.id, running = shared.state().core.held_count(), "worker stopping; tasks keep running under their shims");
    }
    if let Some(plan) = &shared.cgroups {
        crate::cgroup_fs::remove_parents(plan);
    }
    Ok(())
}

/// How long a process is refused its worker id before it concludes that another
/// live process really holds it (well above a leader's worker TTL, after which
/// a dead holder's id is given to the next process).
const ID_TAKEN_PATIENCE: Duration = Duration::from_secs(20);

/// Records `instance` as the process running on this data directory and
/// returns the one recorded before it (flushed before any heartbeat names it).
fn take_instance(layout: &Layout, instance: Uuid) -> Result<Option<Uuid>, Error> {
    let path = layout.instance_path();
    let previous = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok());
    let write = || -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, instance.to_string().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(layout.root())?.sync_all()
    };
    write().map_err(|e| Error::Layout(format!("cannot record the worker instance in {}: {e}", path.display())))?;
    Ok(previous)
}

/// One heartbeat. `was_waiting` holds the `agent` attempts seen waiting for
/// input at the last one: an attempt is reported waiting once seen so twice
/// in a row (a read that returns at once is no wait).
async fn heartbeat(shared: &Shared, instance: Uuid, replaces: Option<Uuid>, was_waiting: &mut HashSet<Key>) {
    let (mut attempts, epoch_seen, enforces) = {
        let state = shared.state();
        (state.core.attempts(), state.core.epoch_seen(), state.core.enforces())
    };
    let agents: Vec<(Key, AttemptFiles)> = attempts
        .iter()
        .filter(|a| *a.task.kind() == Kind::agent())
        .map(|a| ((a.task.clone(), a.attempt), shared.layout.attempt_files(&a.task, a.attempt)))
        .collect();
    // Reads of /proc, off the runtime's threads.
    let now_waiting: HashSet<Key> = match agents.is_empty() {
        true => HashSet::new(),
        false => tokio::task::spawn_blocking(move || {
            crate::waiting::waiting_among(agents.iter().map(|(key, files)| (key.clone(), files)))
        })
        .await
        .unwrap_or_default(),
    };
    for a in &mut attempts {
        let key = (a.task.clone(), a.attempt);
        a.waiting = now_waiting.contains(&key) && was_waiting.contains(&key);
    }
    *was_waiting = now_waiting;
    // A probe that changes nothing: the sidecar answers with its store's
    // incarnation unless it is down. Bounded well under a heartbeat, so a hung
    // sidecar never delays one.
    let probe = shared.sidecar.call(&SidecarRequest::Incarnation);
    let (sidecar, incarnation, mark) = match tokio::time::timeout(shared.opts.heartbeat / 3, probe).await {
        Ok(Ok(SidecarReply::Refused(SidecarRefusal::Storage(_)))) => (SidecarHealth::Degraded, None, None),
        Ok(Ok(SidecarReply::Identity { incarnation, mark })) => (SidecarHealth::Ok, Some(incarnation), mark),
        Ok(Ok(SidecarReply::Incarnation(incarnation))) => (SidecarHealth::Ok, Some(incarnation), None),
        Ok(Ok(_)) => (SidecarHealth::Ok, None, None),
        Ok(Err(_)) | Err(_) => (SidecarHealth::Down, None, None),
    };
    let hb = tenure_protocol::messages::Heartbeat {
        worker: shared.opts.id.clone(),
        instance,
        slots: shared.opts.slots,
        kinds: shared.opts.kinds.clone(),
        epoch_seen,
        attempts,
        sidecar,
        replaces,
        incarnation,
        mark,
        labels: shared.opts.labels.clone(),
        enforces,
        boot: tenure_machine::boot::boot_id().map(Into::into),
    };
    match tenure_protocol::encode(&hb) {
        Ok(bytes) => {
            if let Err(error) = shared.client.publish(subjects::heartbeat(&shared.opts.id), bytes.into()).await {
                tracing::warn!(%error, "heartbeat not sent");
            }
        }
        Err(error) => tracing::error!(%error, "heartbeat too large"),
    }
}

/// Grants that arrived together, alone or in [`Grants`] batches: each with
/// its span and where its answer goes.
#[derive(Default)]
struct GrantGroup {
    grants: Vec<(LeaseGrant, tracing::Span, AnswerTo)>,
    /// Where each batch's answers go.
    batches: Vec<Option<async_nats::Subject>>,
}

/// Where one grant's answer goes.
enum AnswerTo {
    Alone(Option<async_nats::Subject>),
    /// The batch with this index, in the grant's place.
    Batch(usize),
}

impl GrantGroup {
    fn push(&mut self, grant: LeaseGrant, span: tracing::Span, reply: Option<async_nats::Subject>) {
        self.grants.push((grant, span, AnswerTo::Alone(reply)));
    }

    /// A batch's grants join the group; one too large is refused whole (the
    /// refusal is returned, to be answered at once).
    fn push_batch(&mut self, batch: Grants, reply: Option<async_nats::Subject>) -> Option<WorkerReply> {
        if batch.grants.len() > MAX_GRANTS {
            let why = format!("a batch of {} grants (at most {MAX_GRANTS})", batch.grants.len());
            tracing::warn!(%why, "malformed command refused");
            return Some(WorkerReply::Refused(Refusal::Malformed(why)));
        }
        let index = self.batches.len();
        self.batches.push(reply);
        let grants = batch.grants.into_iter().map(|g| (g, tracing::Span::none(), AnswerTo::Batch(index)));
        self.grants.extend(grants);
        None
    }
}

/// Grants that arrived together: screened in order, recorded by the sidecar
/// together (concurrent calls travel as one batch and are committed by one
/// flush), then answered, each only after its own accept is durable — a
/// grant that came alone by itself, a batch by one list in order.
async fn answer_grants(shared: &Arc<Shared>, client: &async_nats::Client, group: GrantGroup) {
    let GrantGroup { grants, batches } = group;
    if grants.is_empty() {
        return;
    }
    let (grants, answer_to): (Vec<_>, Vec<_>) = grants.into_iter().map(|(g, span, to)| ((g, span), to)).unzip();
    let replies = on_grants(shared, grants).await;
    let mut batched: Vec<Vec<Option<WorkerReply>>> = vec![Vec::new(); batches.len()];
    for (reply, to) in replies.into_iter().zip(answer_to) {
        match to {
            AnswerTo::Alone(Some(to)) => {
                if let Some(reply) = reply {
                    tenure_transport::reply(client, to.to_string(), &reply).await;
                }
            }
            AnswerTo::Alone(None) => {}
            AnswerTo::Batch(index) => batched[index].push(reply),
        }
    }
    for (to, replies) in batches.into_iter().zip(batched) {
        if let Some(to) = to {
            tenure_transport::reply(client, to.to_string(), &replies).await;
        }
    }
}

/// The answers to grants that arrived together (see [`answer_grants`]):
/// each screened by the core, recorded by the sidecar with its intent
/// ([`record_grants`]), decided by the core again with the sidecar's answers;
/// an accepted attempt is driven in its own task, from its launch when its
/// intent is recorded. A refusal the core says to tombstone is tombstoned
/// in the sidecar (best effort, bounded), so that a late copy of the grant
/// is refused even by a restarted worker. `None` for a re-send of a grant
/// being recorded by an earlier command (the leader sends it again).
async fn on_grants(shared: &Arc<Shared>, grants: Vec<(LeaseGrant, tracing::Span)>) -> Vec<Option<WorkerReply>> {
    let (screened, records): (Vec<Screened>, Vec<Option<Recording>>) = {
        let mut state = shared.state();
        grants
            .iter()
            .map(|(grant, span)| {
                let screened = state.core.screen_grant(grant);
                let record = matches!(screened, Screened::Record).then(|| {
                    let trace = span.in_scope(tenure_transport::trace::current_traceparent);
                    Recording {
                        accept: SidecarRequest::Accept(grant.clone()),
                        intent: state.core.intent_for(grant, trace),
                    }
                });
                (screened, record)
            })
            .unzip()
    };
    if records.iter().any(Option::is_some) {
        attempt::crash_point("before-record");
    }
    let recorded = record_grants(&shared.sidecar, &records).await;
    if recorded.iter().flatten().any(|(_, intent)| intent == &Some(SidecarReply::Ok)) {
        attempt::crash_point("after-intent");
    }
    let mut replies = Vec::with_capacity(grants.len());
    let mut answered: HashMap<Key, WorkerReply> = HashMap::new();
    let mut tombstones = Vec::new();
    for (((grant, span), screened), recorded) in grants.into_iter().zip(screened).zip(recorded) {
        let key = (grant.task.clone(), grant.attempt);
        let answer = match (screened, recorded) {
            (Screened::Answer(answer), _) => answer,
            (Screened::Record, Some((accepted, intent))) => {
                let mut state = shared.state();
                let answer = state.core.grant_recorded(grant, accepted);
                if let (true, Some(intent)) = (answer.drive, intent) {
                    state.advance(&key, crate::core::Done::Sidecar(intent));
                }
                answer
            }
            // Answered as the same attempt's grant before it was.
            (Screened::Recording | Screened::Record, _) => {
                replies.push(answered.get(&key).cloned());
                continue;
            }
        };
        count_refusal(&key, &answer.reply);
        if answer.tombstone {
            tombstones.push(SidecarRequest::Abandon { task: key.0.clone(), attempt: key.1 });
        }
        if answer.drive {
            let epoch = shared.state().core.held(&key).map(|h| h.epoch).unwrap_or_default();
            tracing::debug!(task = %key.0, attempt = %key.1, epoch = %epoch, "grant accepted");
            span.in_scope(|| spawn_drive(shared, key.clone()));
        }
        answered.insert(key, answer.reply.clone());
        replies.push(Some(answer.reply));
    }
    let tombstones =
        tombstones.iter().map(|abandon| tokio::time::timeout(Duration::from_secs(1), shared.sidecar.call(abandon)));
    futures::future::join_all(tombstones).await;
    replies
}

/// A grant's accept and the intent it is recorded with.
struct Recording {
    accept: SidecarRequest,
    intent: SidecarRequest,
}

/// The sidecar's answer to a grant's accept (`Err`: unreachable, with why),
/// and to its intent when the sidecar judged it.
type Recorded = (Result<SidecarReply, String>, Option<SidecarReply>);

/// Records grants with their intents: each accept followed by its intent
/// in one [`SidecarRequest::Many`] (up to half its bound of grants each), so
/// that one flush makes both durable and the attempt starts without another
/// call. The sidecar judges the pair exactly as if sent one after the
/// other; the intent of a grant it refused is refused too and changes
/// nothing. An intent it could not read in a batch (`Malformed`: a sidecar
/// older than this) is left to the attempt's driver, which sends it alone;
/// a batch it could not read at all, or one too large to encode, is sent
/// again as accepts alone. `None` for a grant not to record.
async fn record_grants(sidecar: &SidecarClient, records: &[Option<Recording>]) -> Vec<Option<Recorded>> {
    let pairs: Vec<&Recording> = records.iter().flatten().collect();
    let chunks = pairs.chunks(MAX_SIDECAR_MANY / 2).map(|chunk| async move {
        let many = chunk.iter().flat_map(|r| [r.accept.clone(), r.intent.clone()]).collect();
        match sidecar.call(&SidecarRequest::Many(many)).await {
            Ok(SidecarReply::Many(replies)) if replies.len() == 2 * chunk.len() => {
                let unread = |r: &SidecarReply| matches!(r, SidecarReply::Refused(SidecarRefusal::Malformed(_)));
                let mut replies = replies.into_iter();
                let mut out = Vec::with_capacity(chunk.len());
                while let (Some(accepted), Some(intent)) = (replies.next(), replies.next()) {
                    out.push((Ok(accepted), (!unread(&intent)).then_some(intent)));
                }
                out
            }
            Ok(SidecarReply::Refused(SidecarRefusal::Malformed(_))) | Err(tenure_machine::ClientError::Encode(_)) => {
                let alone = chunk
                    .iter()
                    .map(|r| async move { (sidecar.call(&r.accept).await.map_err(|e| e.to_string()), None) });
                futures::future::join_all(alone).await
            }
            Ok(other) => vec![(Ok(other), None); chunk.len()],
            Err(error) => vec![(Err(error.to_string()), None); chunk.len()],
        }
    });
    let mut answers = futures::future::join_all(chunks).await.into_iter().flatten();
    records.iter().map(|r| r.as_ref().and_then(|_| answers.next())).collect()
}

/// Counts a refused grant by its reason.
fn count_refusal(key: &Key, reply: &WorkerReply) {
    let WorkerReply::Refused(refusal) = reply else { return };
    let reason = match refusal {
        Refusal::StaleEpoch { .. } => "stale-epoch",
        Refusal::NoSlot => "no-slot",
        Refusal::UnsupportedKind(_) => "unsupported-kind",
        Refusal::UnknownAttempt => "unknown-attempt",
        Refusal::SidecarUnavailable(_) => "sidecar-unavailable",
        Refusal::Malformed(_) => "malformed",
        Refusal::SidecarStorage(_) => "sidecar-storage",
        Refusal::UnenforcedLimits(_) => {
            tracing::info!(task = %key.0, attempt = %key.1, %refusal, "grant refused");
            "unenforced-limits"
        }
    };
    crate::metrics::get().refusals.add(1, &[opentelemetry::KeyValue::new("reason", reason)]);
}

/// A kill: the machine's fence takes its epoch first, then the core decides;
/// a held attempt's driver is told.
async fn on_kill(shared: &Shared, cmd: KillCommand) -> WorkerReply {
    let fence = shared.sidecar.call(&SidecarRequest::ObserveEpoch(cmd.epoch)).await.map_err(|e| e.to_string());
    let key = (cmd.task, cmd.attempt);
    let mut state = shared.state();
    let answer = state.core.kill(key.clone(), cmd.epoch, fence);
    if answer.reply == WorkerReply::Accepted {
        tracing::info!(task = %key.0, attempt = %key.1, epoch = %cmd.epoch, "kill requested");
        if let Some(kill) = state.kill_handle(&key) {
            kill.notify_one();
        }
    }
    answer.reply
}

/// The owner's pause wish for a held attempt: the core takes it (after the
/// epoch fence), then it is recorded in the attempt's files, durably, and
/// the shim is told to look; a wish that cannot be recorded is taken back
/// and refused, so the leader sends it again.
async fn on_pause(shared: &Shared, cmd: PauseCommand) -> WorkerReply {
    let fence = shared.sidecar.call(&SidecarRequest::ObserveEpoch(cmd.epoch)).await.map_err(|e| e.to_string());
    let key = (cmd.task, cmd.attempt);
    let before = {
        let mut state = shared.state();
        let before = state.core.held(&key).map(|h| h.paused);
        let answer = state.core.pause(&key, cmd.epoch, fence, cmd.paused);
        if answer.reply != WorkerReply::Accepted {
            return answer.reply;
        }
        before.unwrap_or(false)
    };
    let files = shared.layout.attempt_files(&key.0, key.1);
    let record = files.clone();
    let recorded = tokio::task::spawn_blocking(move || record.set_pause_requested(cmd.paused)).await;
    let failure = match recorded {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(error) = failure {
        tracing::error!(task = %key.0, attempt = %key.1, %error, "cannot record the pause wish");
        shared.state().core.set_paused(&key, before);
        return WorkerReply::Refused(Refusal::SidecarUnavailable(format!("cannot record the pause wish: {error}")));
    }
    attempt::tell_shim_to_look(&files);
    tracing::info!(task = %key.0, attempt = %key.1, epoch = %cmd.epoch, paused = cmd.paused, "pause wish recorded");
    WorkerReply::Accepted
}

/// Ends every running task (through its shim) and gives the outcomes a
/// bounded time to be buffered and reported; what is not reported by then stays
/// buffered in the sidecar for the next start.
async fn stop_running(shared: &Shared) {
    let kills = shared.state().kill_handles();
    tracing::info!(worker = %shared.opts.id, running = kills.len(), "worker stopping; ending running tasks");
    for kill in kills {
        kill.notify_one();
    }
    let deadline = tokio::time::Instant::now() + shared.opts.kill_grace + Duration::from_secs(3);
    while shared.state().core.holds_any() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::SinkExt;
    use tenure_protocol::{decode, encode, Attempt, TaskSpec};
    use tokio::net::UnixListener;
    use tokio_util::codec::Framed;

    fn recording(n: u64) -> Option<Recording> {
        let grant = LeaseGrant {
            input: Vec::new(),
            task: format!("shell-{n}").parse().unwrap(),
            attempt: Attempt(1),
            epoch: Epoch(2),
            owner: "a".parse().unwrap(),
            spec: TaskSpec::shell("l", "true"),
            mark: None,
        };
        let intent =
            SidecarRequest::Intent { task: grant.task.clone(), attempt: Attempt(1), epoch: Epoch(2), trace: None };
        Some(Recording { accept: SidecarRequest::Accept(grant), intent })
    }

    /// A sidecar on `path` that answers each request with `answer` and keeps
    /// every request it read.
    fn fake_sidecar(
        path: &std::path::Path,
        answer: fn(&SidecarRequest) -> SidecarReply,
    ) -> Arc<Mutex<Vec<SidecarRequest>>> {
        let listener = UnixListener::bind(path).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = kept.clone();
                tokio::spawn(async move {
                    let mut conn = Framed::new(stream, tenure_machine::frame_codec());
                    while let Some(Ok(frame)) = conn.next().await {
                        let req: SidecarRequest = decode(&frame).unwrap();
                        let reply = answer(&req);
                        seen.lock().unwrap().push(req);
                        conn.send(bytes::Bytes::from(encode(&reply).unwrap())).await.unwrap();
                    }
                });
            }
        });
        seen
    }

    /// This sidecar: a batch is answered request by request; the second
    /// grant is refused, and so is its intent.
    fn current(req: &SidecarRequest) -> SidecarReply {
        each(req, |r| match r {
            SidecarRequest::Accept(g) if g.task.number() == 2 => {
                SidecarReply::Refused(SidecarRefusal::Storage("disk".into()))
            }
            SidecarRequest::Intent { task, .. } if task.number() == 2 => {
                SidecarReply::Refused(SidecarRefusal::Storage("disk".into()))
            }
            _ => SidecarReply::Ok,
        })
    }

    /// `one`'s answer to a request, or to each of a batch's.
    fn each(req: &SidecarRequest, one: fn(&SidecarRequest) -> SidecarReply) -> SidecarReply {
        match req {
            SidecarRequest::Many(reqs) => SidecarReply::Many(reqs.iter().map(one).collect()),
            other => one(other),
        }
    }

    /// A sidecar that predates batches: a batch is malformed.
    fn before_batches(req: &SidecarRequest) -> SidecarReply {
        match req {
            SidecarRequest::Many(_) => SidecarReply::Refused(SidecarRefusal::Malformed("unknown variant".into())),
            _ => SidecarReply::Ok,
        }
    }

    /// A sidecar that takes batches but not an intent in one.
    fn intents_alone(req: &SidecarRequest) -> SidecarReply {
        each(req, |r| match r {
            SidecarRequest::Intent { .. } => SidecarReply::Refused(SidecarRefusal::Malformed("alone".into())),
            _ => SidecarReply::Ok,
        })
    }

    #[tokio::test]
    async fn grants_are_recorded_with_their_intents_and_alone_by_an_older_sidecar() {
        let tmp = tempfile::tempdir().unwrap();
        let records = vec![recording(1), None, recording(2)];

        // One batch of accept, intent pairs; each grant gets its own two answers.
        let seen = fake_sidecar(&tmp.path().join("a.sock"), current);
        let recorded = record_grants(&SidecarClient::new(tmp.path().join("a.sock")), &records).await;
        let storage = || SidecarReply::Refused(SidecarRefusal::Storage("disk".into()));
        assert_eq!(
            recorded,
            vec![Some((Ok(SidecarReply::Ok), Some(SidecarReply::Ok))), None, Some((Ok(storage()), Some(storage())))]
        );
        let seen = seen.lock().unwrap().clone();
        let pairs: Vec<SidecarRequest> = [&records[0], &records[2]]
            .into_iter()
            .flatten()
            .flat_map(|r| [r.accept.clone(), r.intent.clone()])
            .collect();
        assert_eq!(seen, vec![SidecarRequest::Many(pairs)], "one exchange, accept then intent per grant");

        // An older sidecar: each accept again alone, the intents left to the drive.
        let seen = fake_sidecar(&tmp.path().join("b.sock"), before_batches);
        let recorded = record_grants(&SidecarClient::new(tmp.path().join("b.sock")), &records).await;
        assert_eq!(recorded, vec![Some((Ok(SidecarReply::Ok), None)), None, Some((Ok(SidecarReply::Ok), None))]);
        let accepts = seen.lock().unwrap().iter().filter(|r| matches!(r, SidecarRequest::Accept(_))).count();
        assert_eq!(accepts, 2, "{:?}", seen.lock().unwrap());

        // One that does not take an intent in a batch: the accept stands, the intent goes alone later.
        fake_sidecar(&tmp.path().join("c.sock"), intents_alone);
        let recorded = record_grants(&SidecarClient::new(tmp.path().join("c.sock")), &records).await;
        assert_eq!(recorded, vec![Some((Ok(SidecarReply::Ok), None)), None, Some((Ok(SidecarReply::Ok), None))]);
    }
}
