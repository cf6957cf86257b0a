//! The coordinator's driver. A process is a standby until the leadership task
//! ([`crate::elector`]) says it holds the leadership; then it loads the
//! registry, claims an epoch, and runs the leader's event loop — owns the NATS
//! subscriptions and the registry, feeds every input to [`Core`] with the time,
//! and carries out the effects in order — until the leadership is lost or its renew
//! deadline passes, the registry fences it, or a newer epoch appears. Then it
//! logs "stepping down", drops everything the term built and is a standby again;
//! the next term rebuilds its state from the registry.
//!
//! It must never decide anything about tasks itself: what to grant, when a
//! worker is lost or what a kill means is the core's business. It must never
//! append, reply or command unless the leadership view says this process may act at
//! that moment, and a failed persist stops the loop before any later effect
//! (reply, grant, kill) of the same batch leaves.
//!
//! A registry found behind the high-water mark the leadership carries (see
//! [`crate::mark`]) is not led: the process keeps the leadership, claims nothing,
//! writes nothing, answers every client request with
//! `ApiError::RegistryBehind`, and loads the registry again every few seconds
//! until it is restored (or an operator accepted the loss at start).
//!
//! No input can end the process: fencing, outages and a newer epoch end the
//! term; a record that cannot be stored (it does not encode) fails only the
//! change it belonged to — nothing of it is sent, the rest of its batch is
//! dropped (a reply becomes an error), and the core drops the task from
//! memory (`Input::PersistFailed`).

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, CoordinatorPresence, Grants, Heartbeat, LeaseGrant, RegistryMark, Report, Reports,
    WorkerCommand, WorkerReply,
};
use tenure_protocol::{subjects, Epoch, WorkerId};
use tenure_transport::identity::{self, Trust};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use opentelemetry::KeyValue;

use crate::core::{Core, CoreConfig, Effect, Input, Leader, Now, Version};
use crate::elector::{self, Clock, Elector, LeadershipView, Term};
use crate::leadership::{self, ms, LeadershipConfig};
use crate::mark;
use crate::metrics;
use crate::notices::{NoticeLimits, Notices};
use crate::registry::{self, Loaded, Registry, StreamLimits};

/// How the coordinator is run.
#[derive(Debug, Clone)]
pub struct Options {
    /// How to reach NATS (servers, credentials, TLS).
    pub nats: tenure_transport::NatsOptions,
    /// Human name of this coordinator (in its leadership, epoch claims and presence).
    pub name: String,
    pub core: CoreConfig,
    /// JetStream replicas of the registry stream and the leadership bucket (3 on a
    /// 3-node NATS cluster).
    pub replicas: usize,
    /// How long a worker command waits for its answer.
    pub command_timeout: Duration,
    pub leadership: LeadershipConfig,
    /// Limits of the notice stream (the registry's are in `core.limits`).
    pub notices: NoticeLimits,
    /// The registry stream's duplicate window (JetStream forgets message ids
    /// older than it; shortened by tests and chaos runs).
    pub registry_duplicate_window: Duration,
    /// Lead a registry found behind its high-water mark (the operator judged
    /// the loss); the acceptance is recorded with the epoch claim.
    pub accept_registry_rollback: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nats: tenure_transport::NatsOptions::default(),
            name: "coordinator".into(),
            core: CoreConfig::default(),
            replicas: 1,
            command_timeout: Duration::from_secs(2),
            leadership: LeadershipConfig::default(),
            notices: NoticeLimits::default(),
            registry_duplicate_window: registry::DEFAULT_DUPLICATE_WINDOW,
            accept_registry_rollback: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] tenure_transport::Error),
    /// A registry failure at start. Once leading, registry failures end the
    /// term or fail one record; they never end the process.
    #[error(transparent)]
    Registry(#[from] registry::Error),
    #[error(transparent)]
    Leadership(#[from] elector::Error),
    #[error("invalid configuration")]
    Config(#[from] leadership::Error),
    #[error("the leadership task stopped unexpectedly")]
    LeadershipTask,
}

/// The wall clock, only ever stamped on records for humans. Test-only:
/// `TENURE_TEST_CLOCK_OFFSET_MS` (signed milliseconds, read once) shifts it, to
/// run coordinators whose clocks disagree; no decision may depend on it.
fn wall_ms() -> u64 {
    static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    let offset = *OFFSET.get_or_init(|| {
        std::env::var("TENURE_TEST_CLOCK_OFFSET_MS").ok().and_then(|v| v.trim().parse::<i64>().ok()).unwrap_or(0)
    });
    let ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    ms.saturating_add_signed(offset)
}

/// Runs the coordinator — standby, leader, standby again as the leadership goes —
/// until `shutdown` resolves (the leadership is then released) or a fatal error.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    opts.leadership.validate()?;
    let client = tenure_transport::connect(&opts.nats, &format!("tenure-coordinator-{}", opts.name), true).await?;
    Trust::announce(&client, "coordinator");
    let clock = Clock::new();
    let holder = format!("{}:{}", opts.name, uuid::Uuid::new_v4().simple());
    let elector = Elector::start(client.clone(), opts.replicas, &opts.name, holder, opts.leadership, clock).await?;
    tokio::pin!(shutdown);
    let mut last_term = 0;
    loop {
        let term = tokio::select! {
            _ = &mut shutdown => {
                elector.shutdown().await;
                tracing::info!("coordinator stopping");
                return Ok(());
            }
            term = elector.wait_leader(last_term) => term.ok_or(Error::LeadershipTask)?,
        };
        last_term = term.id;
        let (mut term, mut witness) = (term, None);
        loop {
            match lead(&opts, &client, &elector, term.clone(), witness.take(), shutdown.as_mut()).await {
                // A machine kept a mark the registry does not reach: the
                // leadership went back with it. The leadership carries the mark from
                // now on, and this term refuses the registry as at a takeover.
                Ok(Ended::Behind { expected, by }) => {
                    elector.note_mark(expected);
                    term.mark = Some(expected);
                    witness = Some(by);
                }
                Ok(Ended::Shutdown { epoch }) => {
                    elector.shutdown().await;
                    tracing::info!(%epoch, "coordinator stopping");
                    return Ok(());
                }
                Ok(Ended::SteppedDown { epoch, reason }) => {
                    tracing::warn!(%epoch, %reason, "stepping down; back to standby");
                    elector.step_down(term.id).await;
                    break;
                }
                Err(e) => {
                    elector.shutdown().await;
                    return Err(e);
                }
            }
        }
    }
}

/// How a leadership term ended.
enum Ended {
    Shutdown {
        epoch: Epoch,
    },
    SteppedDown {
        epoch: Epoch,
        reason: String,
    },
    /// A machine's heartbeat (`by`) carried a registry mark the registry does
    /// not reach: stop leading, and refuse it against `expected`.
    Behind {
        expected: RegistryMark,
        by: String,
    },
}

/// Why the leader loop stops carrying out a batch of effects: the term ends,
/// or one task's record could not be stored (that change fails, the term goes on).
#[derive(Debug)]
enum Stop {
    StepDown(String),
    Record { task: tenure_protocol::TaskId, reason: String },
}

impl From<registry::Error> for Stop {
    fn from(e: registry::Error) -> Stop {
        match e {
            registry::Error::Fenced { expected } => Stop::StepDown(format!(
                "fenced: the registry moved past sequence {expected} (another coordinator wrote)"
            )),
            registry::Error::Unavailable(reason) => Stop::StepDown(format!("registry unavailable: {reason}")),
            e @ (registry::Error::Encode(_) | registry::Error::Refused(_) | registry::Error::EpochsExhausted(_)) => {
                Stop::StepDown(e.to_string())
            }
        }
    }
}

/// Whether this process may act in one term, from the leadership task's view.
struct Guard {
    view: watch::Receiver<LeadershipView>,
    term: u64,
    clock: Clock,
}

impl Guard {
    fn valid_until(&self) -> Option<Duration> {
        self.view.borrow().term().filter(|t| t.id == self.term).map(|t| t.valid_until)
    }

    fn current(&self) -> Option<Term> {
        self.view.borrow().term().filter(|t| t.id == self.term).cloned()
    }

    /// `Err(reason)` once this process may no longer act in its term.
    fn check(&self) -> Result<(), String> {
        match self.valid_until() {
            None => Err("leader lease lost".to_owned()),
            Some(until) if self.clock.now() >= until => Err("renew deadline passed without a lease renewal".to_owned()),
            Some(_) => Ok(()),
        }
    }

    /// Resolves when this process may no longer act in its term.
    async fn lost(&mut self) -> String {
        loop {
            let Some(until) = self.valid_until() else {
                return "leader lease lost".to_owned();
            };
            tokio::select! {
                _ = tokio::time::sleep_until(self.clock.instant(until)) => {
                    if let Err(reason) = self.check() {
                        return reason;
                    }
                }
                changed = self.view.changed() => {
                    if changed.is_err() {
                        return "the leadership task stopped".to_owned();
                    }
                }
            }
        }
    }
}

/// What loading the registry at a takeover came to.
enum Adoption {
    /// Loaded and an epoch claimed: lead.
    Led(Box<(Registry, Loaded, Epoch)>),
    /// Behind its high-water mark: nothing was claimed or written.
    Behind(mark::Behind),
}

/// Loads the registry, judges it against the high-water mark the leadership
/// carries, and claims an epoch of at least the leadership's (and past the mark's);
/// loads again when another writer moved the registry in between (a deposed
/// leader's last append landing late).
async fn adopt(
    js: &async_nats::jetstream::Context,
    opts: &Options,
    limits: StreamLimits,
    term: &Term,
    witness: Option<&str>,
) -> Result<Adoption, Stop> {
    let mut tries = 0;
    loop {
        tries += 1;
        let (mut registry, loaded) = Registry::open(js.clone(), opts.replicas, limits).await?;
        let found = registry.mark();
        let witnessed = |mut behind: mark::Behind| {
            behind.witness = witness.map(str::to_owned);
            behind
        };
        let accepted = match mark::judge(term.mark, found, opts.accept_registry_rollback) {
            mark::Verdict::Lead => None,
            mark::Verdict::Refuse(behind) => return Ok(Adoption::Behind(witnessed(behind))),
            mark::Verdict::Accept(behind) => {
                let behind = witnessed(behind);
                tracing::warn!(
                    expected = %behind.expected,
                    found = %behind.found,
                    "the registry is behind its high-water mark and --accept-registry-rollback is set: \
                     leading it, recording the acceptance with the epoch claim; task numbers and epochs \
                     below the mark are not used again"
                );
                Some(behind)
            }
        };
        registry.reserve_through(mark::highest_task(term.mark, found));
        let at_least = mark::least_epoch(term.mark, term.epoch);
        match registry.claim(&opts.name, at_least, wall_ms(), accepted).await {
            Ok(epoch) => return Ok(Adoption::Led(Box::new((registry, loaded, epoch)))),
            Err(registry::Error::Fenced { expected }) if tries < 3 => {
                tracing::warn!(expected, "the registry moved while it was loaded; loading it again");
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// How often a coordinator that refuses to lead loads the registry again
/// (an operator may have restored it).
const BEHIND_RECHECK: Duration = Duration::from_secs(3);

/// Holds the leadership over a registry behind its high-water mark without
/// leading it: claims nothing, writes nothing, commands nobody; answers every
/// client request with [`ApiError::RegistryBehind`] (so `tenure status` and
/// every verb show the refusal); returns `None` to load the registry again
/// after [`BEHIND_RECHECK`], or how the term ended.
async fn refuse<F: Future<Output = ()>>(
    opts: &Options,
    client: &async_nats::Client,
    guard: &mut Guard,
    shutdown: &mut Pin<&mut F>,
    behind: mark::Behind,
    epoch: Epoch,
) -> Option<Ended> {
    let mut api = match client.subscribe(subjects::API).await {
        Ok(sub) => sub,
        Err(e) => return Some(Ended::SteppedDown { epoch, reason: format!("NATS subscription failed: {e}") }),
    };
    let refusal = ApiError::RegistryBehind {
        coordinator: opts.name.clone(),
        expected: behind.expected,
        found: behind.found,
        witness: behind.witness,
    };
    let recheck = tokio::time::sleep(BEHIND_RECHECK);
    tokio::pin!(recheck);
    loop {
        tokio::select! {
            _ = shutdown.as_mut() => return Some(Ended::Shutdown { epoch }),
            reason = guard.lost() => return Some(Ended::SteppedDown { epoch, reason }),
            _ = &mut recheck => return None,
            Some(msg) = api.next() => {
                if let Some(to) = tenure_transport::identity::reply_to(&msg) {
                    tenure_transport::reply(client, to, &ApiReply::Err(refusal.clone())).await;
                }
            }
        }
    }
}

/// One leadership term: adopt the registry, then serve until the term ends.
async fn lead<F: Future<Output = ()>>(
    opts: &Options,
    client: &async_nats::Client,
    elector: &Elector,
    term: Term,
    witness: Option<String>,
    mut shutdown: Pin<&mut F>,
) -> Result<Ended, Error> {
    let clock = elector.clock();
    let mut guard = Guard { view: elector.view(), term: term.id, clock };
    let mut epoch = term.epoch;
    let js = async_nats::jetstream::new(client.clone());
    let load_started = clock.now();
    let max_payload = client.server_info().max_payload;
    let mut limits = StreamLimits::new(opts.core.limits.registry_bytes, max_payload);
    limits.duplicate_window = opts.registry_duplicate_window;
    let mut refusing = false;
    let (mut registry, loaded) = loop {
        let adopted = tokio::select! {
            _ = &mut shutdown => return Ok(Ended::Shutdown { epoch }),
            reason = guard.lost() => return Ok(Ended::SteppedDown { epoch, reason }),
            adopted = adopt(&js, opts, limits, &term, witness.as_deref()) => adopted,
        };
        match adopted {
            Ok(Adoption::Led(led)) => {
                let (registry, loaded, claimed) = *led;
                epoch = claimed;
                if refusing {
                    tracing::info!("the registry is back at its high-water mark; leading");
                }
                break (registry, loaded);
            }
            Ok(Adoption::Behind(behind)) => {
                if !refusing {
                    tracing::error!(
                        expected = %behind.expected,
                        found = %behind.found,
                        witness = behind.witness.as_deref().unwrap_or("the leader lease"),
                        "refusing to lead: the registry is behind its high-water mark (expected at least {}, \
                         found {}). It lost acknowledged writes or was deleted, recreated or restored from an \
                         older backup. Recover: restore the registry stream from a backup that holds the mark \
                         (this coordinator loads it again every few seconds), or, once the loss is judged, \
                         stop every coordinator and start one with --accept-registry-rollback",
                        behind.expected,
                        behind.found,
                    );
                    refusing = true;
                }
                if let Some(ended) = refuse(opts, client, &mut guard, &mut shutdown, behind, epoch).await {
                    return Ok(ended);
                }
            }
            Err(Stop::StepDown(reason)) => return Ok(Ended::SteppedDown { epoch, reason }),
            Err(Stop::Record { reason, .. }) => return Ok(Ended::SteppedDown { epoch, reason }),
        }
    };
    elector.note_mark(registry.mark());
    elector.adopt_epoch(epoch).await;
    announce_epoch(client, epoch).await;
    let adopted_in_ms = ms(clock.now().saturating_sub(term.takeover_started));
    tracing::info!(
        %epoch,
        lease_epoch = %term.epoch,
        tasks = loaded.records.len(),
        corrupt = loaded.corrupt.len(),
        load_ms = ms(clock.now().saturating_sub(load_started)),
        adopted_ms = adopted_in_ms,
        "adopted in {adopted_in_ms} ms: registry loaded, epoch claimed; leading"
    );
    metrics::get().takeovers.add(1, &[]);
    let now = || Now { mono: clock.now(), wall_ms: wall_ms() };
    // A record may take one registry message, less room for headers, on the
    // server this process is connected to.
    let mut cfg = opts.core.clone();
    cfg.limits.record_bytes = registry::record_limit(max_payload);
    cfg.limits.registry_bytes = loaded.max_bytes;
    let mut core = Core::new(cfg, epoch, loaded.records, now());
    // Task numbers below the high-water mark are never used again.
    core.reserve_through(registry.mark().highest_task);
    let notices = match Notices::open(js.clone(), opts.replicas, opts.notices).await {
        Ok(n) => n,
        Err(reason) => return Ok(Ended::SteppedDown { epoch, reason: format!("notice stream unavailable: {reason}") }),
    };
    // Ends near the previous leader's last write may lack their notice;
    // earlier ones were published in their time.
    let window = loaded.last_claim.as_ref().map(|_| NOTICE_WINDOW);
    for notice in core.pending_notices(window) {
        notices.publish(notice);
    }
    // The core answers `Status` whole: it is told this term as the leadership task
    // publishes it, now and after every change, and every standby's presence.
    let leader = |term: &Term| Leader {
        name: opts.name.clone(),
        holder: elector.holder().to_owned(),
        renewed_at: term.renewed_at,
        renewals: term.renewals,
        ttl_ms: ms(opts.leadership.ttl),
        adopted_in_ms,
    };
    let mut renewals = elector.view();
    // The term's first inputs, handled before anything is taken from NATS and
    // carried out like every other input's effects: the registry's size, and
    // this term. (Their effects are real: the first input advances every
    // workflow the previous leader left mid-step.)
    let mut first = std::collections::VecDeque::from([Input::RegistryUsage { bytes: loaded.bytes }]);
    if let Some(term) = guard.current() {
        first.push_back(Input::Leader(leader(&term)));
    }

    // Read once per term, not per request: the leader is connected by now (it
    // loaded the registry), and every node of a NATS cluster shares one
    // configuration.
    let trust = Trust::of(client);
    let subscribe = |s: &'static str| {
        let client = client.clone();
        async move { client.subscribe(s).await }
    };
    let subscribed = async {
        Ok::<_, async_nats::SubscribeError>((
            subscribe(subjects::API).await?,
            subscribe(subjects::HEARTBEAT_ALL).await?,
            subscribe(subjects::REPORT_ALL).await?,
            subscribe(subjects::COORD_PRESENCE).await?,
        ))
    };
    let (mut api, mut heartbeats, mut reports, mut presence) = match subscribed.await {
        Ok(subs) => subs,
        Err(e) => return Ok(Ended::SteppedDown { epoch, reason: format!("NATS subscription failed: {e}") }),
    };
    let (results_tx, mut results) = mpsc::channel::<Input>(4096);
    let outbox = Outbox { client, js: &js, notices: &notices, results: &results_tx, opts };
    let mut pipeline = Pipeline::default();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let mut ticks: u64 = 0;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        // The span an input is handled in: a traced client request or worker
        // report continues its trace here.
        let mut span = tracing::Span::none();
        let input = if let Some(input) = first.pop_front() {
            input
        } else {
            tokio::select! {
                _ = &mut shutdown => return Ok(Ended::Shutdown { epoch }),
                reason = guard.lost() => return Ok(Ended::SteppedDown { epoch, reason }),
                Some(msg) = api.next() => {
                    let reply_to = tenure_transport::identity::reply_to(&msg);
                    let request = tenure_protocol::decode::<ApiRequest>(&msg.payload)
                        .map_err(|error| ApiError::InvalidRequest(error.to_string()))
                        .and_then(|request| authenticate(trust, msg.headers.as_ref(), request));
                    match request {
                        Ok(ApiRequest::Notices { session, acks, max, wait_ms }) => {
                            // Read from the stream, not the core: served beside the loop.
                            let (client, notices) = (client.clone(), notices.clone());
                            tokio::spawn(async move {
                                let reply = notices.serve(&session, &acks, max, Duration::from_millis(wait_ms)).await;
                                if let Some(to) = reply_to {
                                    tenure_transport::reply(&client, to, &reply).await;
                                }
                            });
                            continue;
                        }
                        Ok(request) => {
                            metrics::get().api_requests.add(1, &[KeyValue::new("verb", request.verb())]);
                            span = traced(msg.headers.as_ref(), || {
                                tracing::info_span!("api", verb = request.verb(), epoch = %epoch)
                            });
                            let trace = span.in_scope(tenure_transport::trace::current_traceparent);
                            Input::Api { reply_to, request, trace }
                        }
                        Err(error) => {
                            tracing::warn!(%error, "API request refused");
                            if let (Some(to), Ok(())) = (reply_to, guard.check()) {
                                tenure_transport::reply(client, to, &ApiReply::Err(error)).await;
                            }
                            continue;
                        }
                    }
                }
                Some(msg) = heartbeats.next() => match tenure_protocol::decode::<Heartbeat>(&msg.payload) {
                    Ok(hb) if speaks_for_itself(&msg.subject, &hb.worker) => {
                        if let Some(expected) = mark::witnessed(hb.mark, registry.mark(), registry.accepted_floor()) {
                            tracing::error!(
                                worker = %hb.worker,
                                kept = ?hb.mark,
                                registry = %registry.mark(),
                                "worker {}'s store was given a registry mark this registry does not reach: the \
                                 registry and the lease went back together; no longer leading it",
                                hb.worker,
                            );
                            return Ok(Ended::Behind { expected, by: format!("worker {}'s store", hb.worker) });
                        }
                        Input::Heartbeat(hb)
                    }
                    Ok(_) => continue,
                    Err(error) => {
                        tracing::warn!(%error, "malformed heartbeat ignored");
                        continue;
                    }
                },
                Some(msg) = reports.next() => {
                    let reply_to = tenure_transport::identity::reply_to(&msg);
                    // Several reports together, or one.
                    if let Ok(batch) = tenure_protocol::decode::<Reports>(&msg.payload) {
                        if !(batch.is_well_formed() && speaks_for_itself(&msg.subject, &batch.worker)) {
                            tracing::warn!(subject = %msg.subject, "malformed batch of reports ignored");
                            continue;
                        }
                        // Traced only when it is one task's start told with
                        // its end: the batch continues that task's trace.
                        if let Some(last) = batch.reports.last() {
                            span = report_span(msg.headers.as_ref(), last);
                        }
                        Input::Reports { reply_to, reports: batch.reports }
                    } else {
                        match tenure_protocol::decode::<Report>(&msg.payload) {
                            Ok(report) if speaks_for_itself(&msg.subject, &report.worker) => {
                                span = report_span(msg.headers.as_ref(), &report);
                                Input::Report { reply_to, report }
                            }
                            Ok(_) => continue,
                            Err(error) => {
                                tracing::warn!(%error, "malformed report ignored");
                                continue;
                            }
                        }
                    }
                }
                Some(msg) = presence.next() => match tenure_protocol::decode::<CoordinatorPresence>(&msg.payload) {
                    Ok(p) => Input::Presence(p),
                    Err(error) => {
                        tracing::debug!(%error, "malformed coordinator presence ignored");
                        continue;
                    }
                },
                Ok(()) = renewals.changed() => {
                    // Another term's view (or none) is the guard's business.
                    let Some(term) = renewals.borrow_and_update().term().filter(|t| t.id == guard.term).cloned() else {
                        continue;
                    };
                    Input::Leader(leader(&term))
                }
                Some(result) = results.recv() => result,
                _ = tick.tick() => {
                    ticks += 1;
                    if ticks.is_multiple_of(5) {
                        record_gauges(&core, now());
                    }
                    if ticks.is_multiple_of(REGISTRY_SAMPLE_TICKS) {
                        outbox.sample_registry();
                    }
                    // Appends settled while making room are noted here.
                    elector.note_mark(registry.mark());
                    Input::Tick
                }
                // An append may still be retrying when the renew deadline passes: the
                // term ends by `guard.lost()`; should it land anyway, it landed
                // conditionally on our sequence, which the next claim includes or fences.
                durable = registry.settle(), if registry.in_flight() > 0 => {
                    let released = match durable {
                        Ok(durable) => {
                            elector.note_mark(registry.mark());
                            pipeline.release(durable, registry.mark(), &outbox, &mut guard).await
                        }
                        Err(e) => Err(Stop::from(e)),
                    };
                    match released {
                        Ok(()) => continue,
                        Err(Stop::StepDown(reason) | Stop::Record { reason, .. }) => {
                            return Ok(Ended::SteppedDown { epoch, reason })
                        }
                    }
                }
            }
        };
        // A process resumed after a pause may hold inputs it must no longer act on.
        if let Err(reason) = guard.check() {
            return Ok(Ended::SteppedDown { epoch, reason });
        }
        // What ends in batches may still add counts as used (note a20).
        let input = match input {
            Input::RegistryUsage { bytes } => {
                Input::RegistryUsage { bytes: bytes.saturating_add(registry.open_ends()) }
            }
            input => input,
        };
        let mut effects = span.in_scope(|| core.handle(input, now()));
        for ms in core.take_dispatch_latencies() {
            metrics::get().dispatch.record(ms as f64 / 1000.0, &[]);
        }
        // Effects of one input, then what the core makes of records that
        // could not be stored, until nothing failed (each round drops tasks
        // and creates none; the bound is a guard against a core that would).
        let mut rounds = 0;
        while !effects.is_empty() {
            rounds += 1;
            if rounds > MAX_UNWIND_ROUNDS {
                let reason = "records kept failing to be stored while unwinding one input".to_owned();
                return Ok(Ended::SteppedDown { epoch, reason });
            }
            let mut failed: Vec<(tenure_protocol::TaskId, String)> = Vec::new();
            for step in runs_of_shared(effects) {
                if let Err(reason) = guard.check() {
                    return Ok(Ended::SteppedDown { epoch, reason });
                }
                let effect = match step {
                    Step::Shared(records) if failed.is_empty() => {
                        match pipeline.shared(records, &mut failed, &outbox, &mut registry, &mut guard).await {
                            Ok(()) => continue,
                            Err(Stop::StepDown(reason) | Stop::Record { reason, .. }) => {
                                return Ok(Ended::SteppedDown { epoch, reason })
                            }
                        }
                    }
                    Step::Shared(records) => {
                        records
                            .into_iter()
                            .for_each(|(r, v)| drop(unwind(Effect::Persist(Box::new(r), v), &mut failed)));
                        continue;
                    }
                    Step::One(effect) => effect,
                };
                let Some(effect) = unwind(effect, &mut failed) else { continue };
                let span = effect_span(&effect, epoch).unwrap_or_else(|| span.clone());
                let step = pipeline.effect(effect, span, &outbox, &mut registry, &mut guard).await;
                match step {
                    Ok(()) => {}
                    Err(Stop::StepDown(reason)) => return Ok(Ended::SteppedDown { epoch, reason }),
                    Err(Stop::Record { task, reason }) => {
                        tracing::error!(task = %task, %reason, "a task record cannot be stored; that change fails");
                        failed.push((task, reason));
                    }
                }
            }
            effects = failed
                .into_iter()
                .flat_map(|(task, reason)| core.handle(Input::PersistFailed { task, reason }, now()))
                .collect();
        }
        if registry.retirable() > 0 {
            if let Err(Stop::StepDown(reason) | Stop::Record { reason, .. }) =
                pipeline.retire(&outbox, &mut registry, &mut guard).await
            {
                return Ok(Ended::SteppedDown { epoch, reason });
            }
        }
    }
}

/// Replaces the owner a request claims with the one the transport vouches for
/// (see [`tenure_transport::identity`]); refused when there is none.
fn authenticate(
    trust: Trust,
    headers: Option<&async_nats::HeaderMap>,
    mut request: ApiRequest,
) -> Result<ApiRequest, ApiError> {
    if let Some(session) = request.session_mut() {
        *session = identity::owner(trust, headers, session).map_err(|e| ApiError::Unauthenticated(e.to_string()))?;
    }
    Ok(request)
}

/// Whether a message on a machine-named subject speaks for the machine the
/// subject names. NATS lets each machine's credential publish only on its own
/// subjects; a body that names another worker is a forgery (or a
/// misconfigured machine) and is dropped.
fn speaks_for_itself(subject: &str, worker: &tenure_protocol::WorkerId) -> bool {
    let ok = subjects::machine_of(subject).as_ref() == Some(worker);
    if !ok {
        tracing::warn!(subject, claimed = %worker, "message from one machine speaking for another dropped");
    }
    ok
}

/// Rounds of `Input::PersistFailed` one input may lead to before the term ends.
const MAX_UNWIND_ROUNDS: u32 = 16;

/// What becomes of an effect that follows a record that could not be stored
/// in the same batch (`failed` is not empty): it must not leave, since it may
/// reflect that record. A later record of the batch fails too, a reply
/// becomes an error, anything else (grant, kill, notice, ack) is dropped —
/// the core re-sends what it still wants and workers re-send their reports.
fn unwind(effect: Effect, failed: &mut Vec<(tenure_protocol::TaskId, String)>) -> Option<Effect> {
    let Some((first, reason)) = failed.first().cloned() else { return Some(effect) };
    match effect {
        Effect::Persist(record, _) => {
            failed.push((record.id.clone(), format!("it changed with {first}, whose record was not stored")));
            None
        }
        Effect::Reply { to, .. } => Some(Effect::Reply {
            to,
            reply: Err(ApiError::Unavailable(format!(
                "the record of {first} could not be stored ({reason}); nothing of this request was kept from it on \
                 (a batch's tasks before it may be stored: send the batch again with the same keys)"
            ))),
        }),
        e @ (Effect::StepDown { .. } | Effect::CheckEpoch { .. }) => Some(e),
        Effect::Forget { .. }
        | Effect::Command { .. }
        | Effect::InstanceTaken { .. }
        | Effect::Cleanup { .. }
        | Effect::AskEvidence { .. }
        | Effect::Ack { .. }
        | Effect::Acks { .. }
        | Effect::Grants { .. }
        | Effect::Notify(_) => None,
    }
}

/// One step of carrying out an input's effects (steps live for one input
/// and are moved once: an effect is not boxed for them).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Step {
    /// Records that may share a message ([`Version::may_share`]), one after
    /// the other in the input's effects: stored together
    /// ([`Registry::start_put_shared`]).
    Shared(Vec<(crate::record::TaskRecord, Version)>),
    One(Effect),
}

/// An input's effects as steps: each run of persists that may share a
/// message (first records of the tasks it created, first grants, ends) becomes
/// one [`Step::Shared`]; nothing is moved across another effect.
fn runs_of_shared(effects: Vec<Effect>) -> Vec<Step> {
    let mut steps = Vec::with_capacity(effects.len());
    for effect in effects {
        match (effect, steps.last_mut()) {
            (Effect::Persist(r, v), Some(Step::Shared(run))) if v.may_share(&r) => run.push((*r, v)),
            (Effect::Persist(r, v), _) if v.may_share(&r) => steps.push(Step::Shared(vec![(*r, v)])),
            (other, _) => steps.push(Step::One(other)),
        }
    }
    steps
}

/// Orders a term's effects around its pipelined registry appends: a persist is
/// sent at once, without waiting for the ones before it; every other effect
/// (reply, grant, kill, notice, ack) is held until every append started before
/// it is durable, so nothing that leaves the leader reflects state that is not
/// durable — the same guarantee as awaiting each append, without the wait.
#[derive(Default)]
struct Pipeline {
    /// Effects waiting for the registry, with the ticket they wait for and
    /// the span they are carried out in.
    held: std::collections::VecDeque<(u64, Effect, tracing::Span)>,
}

impl Pipeline {
    async fn effect(
        &mut self,
        effect: Effect,
        span: tracing::Span,
        out: &Outbox<'_>,
        registry: &mut Registry,
        guard: &mut Guard,
    ) -> Result<(), Stop> {
        match effect {
            Effect::Persist(record, _) => {
                self.make_room(out, registry, guard).await?;
                match registry.start_put_task(&record).await {
                    Ok(_) => Ok(()),
                    // Nothing was sent: only this record's change fails.
                    Err(registry::Error::Encode(reason)) => Err(Stop::Record { task: record.id.clone(), reason }),
                    Err(e) => Err(e.into()),
                }
            }
            Effect::Forget { task, at_ms } => {
                self.make_room(out, registry, guard).await?;
                registry.start_forget(&task, at_ms).await?;
                Ok(())
            }
            Effect::StepDown { reason } => Err(Stop::StepDown(reason)),
            other if registry.in_flight() == 0 => execute(other, registry.mark(), out).instrument(span).await,
            other => {
                self.held.push_back((registry.last_ticket(), other, span));
                Ok(())
            }
        }
    }

    /// Records that may share a message, as few appends as the record limit
    /// allows ([`Registry::start_put_shared`]). A record that cannot be
    /// encoded fails with every record after it (`failed`), as one after the
    /// other would; those before it are on their way.
    async fn shared(
        &mut self,
        records: Vec<(crate::record::TaskRecord, Version)>,
        failed: &mut Vec<(tenure_protocol::TaskId, String)>,
        out: &Outbox<'_>,
        registry: &mut Registry,
        guard: &mut Guard,
    ) -> Result<(), Stop> {
        self.make_room(out, registry, guard).await?;
        let refs: Vec<(&crate::record::TaskRecord, Version)> = records.iter().map(|(r, v)| (r, *v)).collect();
        match registry.start_put_shared(&refs).await {
            Ok(_) => Ok(()),
            Err((i, registry::Error::Encode(reason))) => {
                let first = &records[i].0.id;
                tracing::error!(task = %first, %reason, "a task record cannot be stored; that change fails");
                failed.push((first.clone(), reason));
                for (r, _) in &records[i + 1..] {
                    failed.push((r.id.clone(), format!("it changed with {first}, whose record was not stored")));
                }
                Ok(())
            }
            Err((_, e)) => Err(e.into()),
        }
    }

    /// Retires every batch none of whose records is the
    /// latest any more (see `registry.rs`).
    async fn retire(&mut self, out: &Outbox<'_>, registry: &mut Registry, guard: &mut Guard) -> Result<(), Stop> {
        while registry.retirable() > 0 {
            self.make_room(out, registry, guard).await?;
            registry.start_retire(wall_ms()).await?;
        }
        Ok(())
    }

    /// Waits while [`registry::MAX_IN_FLIGHT`] appends are in flight.
    async fn make_room(&mut self, out: &Outbox<'_>, registry: &mut Registry, guard: &mut Guard) -> Result<(), Stop> {
        while registry.in_flight() >= registry::MAX_IN_FLIGHT {
            self.settle(out, registry, guard).await?;
        }
        Ok(())
    }

    /// Waits until the oldest append is durable (or the term ends), then
    /// carries out the effects that waited for it.
    async fn settle(&mut self, out: &Outbox<'_>, registry: &mut Registry, guard: &mut Guard) -> Result<(), Stop> {
        let durable = tokio::select! {
            durable = registry.settle() => durable?,
            reason = guard.lost() => return Err(Stop::StepDown(reason)),
        };
        self.release(durable, registry.mark(), out, guard).await
    }

    async fn release(
        &mut self,
        durable: u64,
        mark: RegistryMark,
        out: &Outbox<'_>,
        guard: &mut Guard,
    ) -> Result<(), Stop> {
        while self.held.front().is_some_and(|(ticket, _, _)| *ticket <= durable) {
            let Some((_, effect, span)) = self.held.pop_front() else { break };
            guard.check().map_err(Stop::StepDown)?;
            execute(effect, mark, out).instrument(span).await?;
        }
        Ok(())
    }
}

/// How much registry time before the previous leader's last write unreported
/// ends are still republished at a takeover (registry time, not a wall clock:
/// see `Core::registry_ms`).
const NOTICE_WINDOW: Duration = Duration::from_secs(600);

/// The gauges sampled once a second: tasks by status, heartbeat ages.
fn record_gauges(core: &Core, now: Now) {
    let m = metrics::get();
    let counts = core.counts();
    for status in tenure_protocol::Status::ALL {
        let n = counts.get(&status).copied().unwrap_or(0);
        m.tasks.record(n, &[KeyValue::new("status", status.as_str())]);
    }
    for (worker, age) in core.heartbeat_ages(now) {
        m.heartbeat_age.record(age.as_secs_f64(), &[KeyValue::new("worker", worker.to_string())]);
    }
}

/// A span for one input when its message carries a trace context; none
/// otherwise (untraced traffic costs nothing).
fn traced(headers: Option<&async_nats::HeaderMap>, make: impl FnOnce() -> tracing::Span) -> tracing::Span {
    let cx = tenure_transport::trace::from_headers(headers);
    if !tenure_transport::trace::is_remote(&cx) {
        return tracing::Span::none();
    }
    let span = make();
    tenure_transport::trace::continue_from(&span, cx);
    span
}

/// The span a traced report (or a traced batch, named by its last report)
/// is judged in.
fn report_span(headers: Option<&async_nats::HeaderMap>, report: &Report) -> tracing::Span {
    traced(
        headers,
        || tracing::info_span!("report", task = %report.task, attempt = %report.attempt, epoch = %report.epoch, worker = %report.worker, event = report.event.name()),
    )
}

/// The span a command to a worker is sent in: a grant continues the trace the
/// core gave it (its task's submit).
fn effect_span(effect: &Effect, epoch: Epoch) -> Option<tracing::Span> {
    let Effect::Command { worker, command: WorkerCommand::Grant(g), trace: Some(trace), .. } = effect else {
        return None;
    };
    let span = tracing::info_span!("lease", task = %g.task, attempt = %g.attempt, epoch = %epoch, worker = %worker);
    tenure_transport::trace::continue_from(&span, tenure_transport::trace::from_traceparent(Some(trace.as_str())));
    Some(span)
}

/// Tells workers the new epoch at once, so their sidecars refuse the old
/// leader's commands before its first one arrives. Best effort: commands carry
/// the epoch anyway.
async fn announce_epoch(client: &async_nats::Client, epoch: Epoch) {
    match tenure_protocol::encode(&epoch) {
        Ok(bytes) => {
            if let Err(error) = client.publish(subjects::EPOCH_ANNOUNCE, bytes.into()).await {
                tracing::warn!(%epoch, %error, "epoch not announced to workers");
            }
        }
        Err(error) => tracing::error!(%epoch, %error, "epoch could not be encoded"),
    }
}

/// The fire-and-forget outputs of one term: answers come back through `results`.
struct Outbox<'a> {
    client: &'a async_nats::Client,
    js: &'a async_nats::jetstream::Context,
    notices: &'a Notices,
    results: &'a mpsc::Sender<Input>,
    opts: &'a Options,
}

/// Carries out an effect that changes no durable state (the registry's are
/// [`Pipeline::effect`]'s).
///
/// `mark` is the registry's durable mark now: every effect carried out has
/// what it reflects durable, so a grant may carry it to its machine, whose
/// store keeps the highest it was given (a registry that later goes back is
/// caught by the machine's heartbeats).
async fn execute(mut effect: Effect, mark: RegistryMark, out: &Outbox<'_>) -> Result<(), Stop> {
    match &mut effect {
        Effect::Command { command: WorkerCommand::Grant(grant), .. } => grant.mark = Some(mark),
        Effect::Grants { grants, .. } => grants.iter_mut().for_each(|grant| grant.mark = Some(mark)),
        _ => {}
    }
    let Outbox { client, notices, .. } = *out;
    match effect {
        Effect::Notify(notice) => {
            notices.publish(*notice);
            Ok(())
        }
        // Never reached: the pipeline sends appends. Were one to arrive here,
        // acting without it durable is not an option; ending the term is safe.
        Effect::Persist(..) | Effect::Forget { .. } => {
            Err(Stop::StepDown("a registry append bypassed the pipeline".to_owned()))
        }
        Effect::Command { worker, instance, command, trace: _ } => {
            let subject = subjects::instance_commands(&worker, &instance);
            out.in_background(subject, command, |command, result| Input::CommandResult { worker, command, result });
            Ok(())
        }
        Effect::Grants { worker, instance, grants } => {
            out.send_grants(worker, instance, grants);
            Ok(())
        }
        Effect::InstanceTaken { worker, instance, holder } => {
            let taken = WorkerCommand::InstanceTaken { instance, holder };
            match tenure_protocol::encode(&taken) {
                Ok(bytes) => {
                    if let Err(error) = client.publish(subjects::worker_commands(&worker), bytes.into()).await {
                        tracing::warn!(%worker, %error, "could not tell a second process that its worker id is taken");
                    }
                }
                Err(error) => tracing::error!(%error, "instance notice could not be encoded"),
            }
            Ok(())
        }
        Effect::Cleanup { worker, request } => {
            let subject = subjects::cleanup(&worker);
            out.in_background(subject, request, |request, result| Input::CleanupResult { worker, request, result });
            Ok(())
        }
        Effect::AskEvidence { worker, request } => {
            let subject = subjects::evidence(&worker);
            out.in_background(subject, request, |request, result| Input::Evidence { worker, request, result });
            Ok(())
        }
        Effect::Reply { to, reply } => {
            let reply = match tenure_protocol::encode(&reply) {
                Ok(_) => reply,
                Err(e) => Err(ApiError::Unavailable(format!("reply too large: {e}"))),
            };
            tenure_transport::reply(client, to, &reply).await;
            Ok(())
        }
        Effect::Ack { to, ack } => {
            tenure_transport::reply(client, to, &ack).await;
            Ok(())
        }
        Effect::Acks { to, acks } => {
            tenure_transport::reply(client, to, &acks).await;
            Ok(())
        }
        Effect::CheckEpoch { claimed, by } => {
            out.check_epoch(claimed, by);
            Ok(())
        }
        Effect::StepDown { reason } => Err(Stop::StepDown(reason)),
    }
}

/// The registry's bytes are sampled every this many ticks (5 s).
const REGISTRY_SAMPLE_TICKS: u64 = 25;

impl Outbox<'_> {
    /// Reads the registry's last epoch claim in the background; the answer
    /// comes back as `Input::EpochChecked`.
    fn check_epoch(&self, claimed: Epoch, by: String) {
        let (js, results, timeout) = (self.js.clone(), self.results.clone(), self.opts.command_timeout);
        tokio::spawn(
            async move {
                let registry = match tokio::time::timeout(timeout, registry::last_claim(&js)).await {
                    Ok(read) => read.map_err(|e| e.to_string()),
                    Err(_) => Err("no answer from the registry".to_owned()),
                };
                let _ = results.send(Input::EpochChecked { claimed, by, registry }).await;
            }
            .in_current_span(),
        );
    }

    /// Samples the registry's bytes in the background (`Input::RegistryUsage`).
    fn sample_registry(&self) {
        let (js, results, timeout) = (self.js.clone(), self.results.clone(), self.opts.command_timeout);
        tokio::spawn(async move {
            match tokio::time::timeout(timeout, registry::bytes_used(&js)).await {
                Ok(Ok(bytes)) => {
                    let _ = results.send(Input::RegistryUsage { bytes }).await;
                }
                Ok(Err(error)) => tracing::debug!(%error, "registry usage not sampled"),
                Err(_) => tracing::debug!("registry usage not sampled: no answer"),
            }
        });
    }

    /// Sends grants together without blocking the loop; each answer (or the
    /// transport failure) re-enters the loop as the grant's own
    /// `CommandResult`. A worker too old to read `Grants` answers with one
    /// refusal, not a list: it is sent the grants one by one.
    fn send_grants(&self, worker: WorkerId, instance: uuid::Uuid, grants: Vec<LeaseGrant>) {
        let (client, results, timeout) = (self.client.clone(), self.results.clone(), self.opts.command_timeout);
        let subject = subjects::instance_commands(&worker, &instance);
        tokio::spawn(
            async move {
                let batch = Grants { grants };
                let count = batch.grants.len();
                let answer =
                    tenure_transport::request::<_, Vec<Option<WorkerReply>>>(&client, subject.clone(), &batch, timeout);
                let answers: Vec<Result<WorkerReply, String>> = match answer.await {
                    Ok(replies) if replies.len() == count => replies
                        .into_iter()
                        .map(|r| r.ok_or_else(|| "not answered: a copy of the grant was being recorded".to_owned()))
                        .collect(),
                    Ok(replies) => vec![Err(format!("{} answers to {count} grants", replies.len())); count],
                    Err(tenure_transport::Error::Codec { .. }) => {
                        let one = |grant: &LeaseGrant| {
                            let command = WorkerCommand::Grant(grant.clone());
                            let (client, subject) = (&client, subject.clone());
                            async move {
                                tenure_transport::request::<_, WorkerReply>(client, subject, &command, timeout)
                                    .await
                                    .map_err(|e| e.to_string())
                            }
                        };
                        futures::future::join_all(batch.grants.iter().map(one)).await
                    }
                    Err(error) => vec![Err(error.to_string()); count],
                };
                for (grant, result) in batch.grants.into_iter().zip(answers) {
                    let worker = worker.clone();
                    let _ = results
                        .send(Input::CommandResult { worker, command: WorkerCommand::Grant(grant), result })
                        .await;
                }
            }
            .in_current_span(),
        );
    }

    /// Sends a request without blocking the loop; its answer, or the transport
    /// failure, re-enters the loop as the input `back` builds from it.
    fn in_background<Req, Rep>(
        &self,
        subject: String,
        request: Req,
        back: impl FnOnce(Req, Result<Rep, String>) -> Input + Send + 'static,
    ) where
        Req: serde::Serialize + Send + Sync + 'static,
        Rep: serde::de::DeserializeOwned + Send + 'static,
    {
        let (client, results, timeout) = (self.client.clone(), self.results.clone(), self.opts.command_timeout);
        tokio::spawn(
            async move {
                let result =
                    tenure_transport::request(&client, subject, &request, timeout).await.map_err(|e| e.to_string());
                let _ = results.send(back(request, result)).await;
            }
            .in_current_span(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::TaskRecord;
    use tenure_protocol::messages::ApiResponse;
    use tenure_protocol::{TaskId, TaskSpec};

    fn record(n: u64, label: String) -> TaskRecord {
        let id = TaskId::new(tenure_protocol::Kind::shell(), n).unwrap();
        TaskRecord::new(id, "s".parse().unwrap(), uuid::Uuid::new_v4(), TaskSpec::shell(label, "true"), 0)
    }

    /// The driver's path for a record that cannot be encoded: that change
    /// fails (nothing sent, nothing left in flight), the rest of its batch is
    /// unwound, and the next record lands as if nothing happened.
    #[test]
    fn a_record_that_cannot_be_encoded_fails_its_change_and_the_term_goes_on() {
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let client = async_nats::connect(&nats.url).await.unwrap();
            let js = async_nats::jetstream::new(client.clone());
            let (mut registry, _) = Registry::open(js.clone(), 1, StreamLimits::new(1 << 30, 1 << 20)).await.unwrap();
            registry.claim("test", Epoch(1), 0, None).await.unwrap();
            let notices = Notices::open(js.clone(), 1, NoticeLimits::default()).await.unwrap();
            let (results, _answers) = mpsc::channel(16);
            let opts = Options::default();
            let out = Outbox { client: &client, js: &js, notices: &notices, results: &results, opts: &opts };
            let clock = Clock::new();
            let term = Term {
                id: 1,
                epoch: Epoch(1),
                valid_until: clock.now() + Duration::from_secs(3600),
                renewed_at: clock.now(),
                renewals: 0,
                takeover_started: clock.now(),
                mark: None,
            };
            let (_leadership, view) = watch::channel(LeadershipView::Leader(term));
            let mut guard = Guard { view, term: 1, clock };
            let mut pipeline = Pipeline::default();

            let persist = |r| Effect::Persist(Box::new(r), Version::Later);
            let huge = record(1, "x".repeat(tenure_protocol::MAX_MESSAGE_BYTES));
            let step = pipeline.effect(persist(huge), tracing::Span::none(), &out, &mut registry, &mut guard).await;
            let Err(Stop::Record { task, reason }) = step else { panic!("{step:?}") };
            assert_eq!(task.to_string(), "shell-1");
            assert!(reason.contains("exceeds"), "{reason}");
            assert_eq!(registry.in_flight(), 0, "nothing of it was sent");

            // What followed it in its batch is unwound.
            let mut failed = vec![(task, reason)];
            let reply = Effect::Reply {
                to: "r".into(),
                reply: Ok(ApiResponse::Submitted { task: record(1, String::new()).id, existing: false }),
            };
            let Some(Effect::Reply { reply: Err(ApiError::Unavailable(why)), .. }) = unwind(reply, &mut failed) else {
                panic!("a reply becomes an error")
            };
            assert!(why.contains("shell-1") && why.contains("nothing of this request was kept"), "{why}");
            assert!(unwind(persist(record(3, "l".into())), &mut failed).is_none());
            assert_eq!(failed.len(), 2, "a later record of the batch fails too");
            assert!(unwind(
                Effect::Notify(Box::new(tenure_protocol::messages::Notice::Ended(Box::new(
                    record(1, String::new()).snapshot()
                )))),
                &mut failed
            )
            .is_none());
            assert!(unwind(Effect::StepDown { reason: "x".into() }, &mut Vec::new()).is_some());

            // The term goes on: the next record lands, unfenced.
            let small = record(2, "fine".into());
            pipeline.effect(persist(small), tracing::Span::none(), &out, &mut registry, &mut guard).await.unwrap();
            assert_eq!(registry.settle().await.unwrap(), 1);

            // First records stored together: one that cannot be encoded
            // fails with those after it; those before it are sent.
            let mut failed = Vec::new();
            let huge = record(5, "x".repeat(tenure_protocol::MAX_MESSAGE_BYTES));
            let firsts = [record(4, "a".into()), huge, record(6, "b".into())].map(|r| (r, Version::First)).to_vec();
            pipeline.shared(firsts, &mut failed, &out, &mut registry, &mut guard).await.unwrap();
            let failed: Vec<String> = failed.iter().map(|(task, _)| task.to_string()).collect();
            assert_eq!(failed, ["shell-5", "shell-6"]);
            assert_eq!(registry.in_flight(), 1, "shell-4 alone, on its subject");
            assert_eq!(registry.settle().await.unwrap(), 2);
        });
    }

    /// Runs of records that may share a message (first records, first
    /// grants, of tasks that did not end) are grouped where they stand: any
    /// other record or effect ends a run, and nothing moves.
    #[test]
    fn records_that_may_share_a_message_are_grouped_in_runs_and_nothing_moves() {
        let persist = |n: u64, version| Effect::Persist(Box::new(record(n, String::new())), version);
        let ended = |n: u64| {
            let mut r = record(n, String::new());
            r.life.status = tenure_protocol::Status::Completed;
            Effect::Persist(Box::new(r), Version::First)
        };
        let stop = || Effect::StepDown { reason: String::new() };
        let (first, grant, later) = (Version::First, Version::FirstGrant, Version::Later);
        let effects = vec![
            persist(3, later),
            persist(10, first),
            persist(1, grant),
            persist(11, first),
            persist(4, later),
            persist(12, first),
            ended(14),
            persist(2, grant),
            stop(),
            persist(13, grant),
        ];
        let shape: Vec<String> = runs_of_shared(effects)
            .into_iter()
            .map(|step| match step {
                Step::Shared(run) => format!("{:?}", run.iter().map(|(r, _)| r.id.number()).collect::<Vec<_>>()),
                Step::One(Effect::Persist(r, _)) => r.id.number().to_string(),
                Step::One(_) => "other".into(),
            })
            .collect();
        assert_eq!(shape, ["3", "[10, 1, 11]", "4", "[12]", "14", "[2]", "other", "[13]"]);
    }
}
