//! The leadership driver: one task per coordinator process that reads and writes the
//! leader key in JetStream KV on behalf of the pure [`Leadership`] machine, and tells
//! the service whether this process leads.
//!
//! It owns the KV bucket handle, the machine, the monotonic clock reading for
//! it, and the standby's presence messages. Every decision — when to take over,
//! renew or give up — is the machine's; this module only carries writes out
//! (compare-and-set on the revision, bounded by a timeout), reads the key
//! regularly, and publishes a [`LeadershipView`] the service checks before every
//! write and command. It must never write the key except as the machine says,
//! and never extend the view's `valid_until` past what the machine computed.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use tenure_protocol::messages::{CoordinatorPresence, RegistryMark};
use tenure_protocol::{subjects, Epoch};
use tokio::sync::{mpsc, oneshot, watch};

use crate::leadership::{ms, Decision, KeyState, Leadership, LeadershipConfig, LeadershipRecord, Observation, Write};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("leader lease bucket {bucket} unavailable: {reason}")]
    Bucket { bucket: &'static str, reason: String },
}

/// This process's monotonic clock, as durations since the process started.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock { base: Instant::now() }
    }

    pub fn now(&self) -> Duration {
        self.base.elapsed()
    }

    /// The instant at which `now()` will read `at`.
    pub fn instant(&self, at: Duration) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.base + at)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// One leadership term of this process, as the machine sees it right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Term {
    /// Counts the terms of this process: a new takeover is a new id.
    pub id: u64,
    pub epoch: Epoch,
    /// The leader may act while `Clock::now() < valid_until`.
    pub valid_until: Duration,
    /// When the last successful leadership write was sent.
    pub renewed_at: Duration,
    pub renewals: u64,
    /// When this process judged the previous holder's leadership expired.
    pub takeover_started: Duration,
    /// The registry's high-water mark in the leadership this term holds: at the
    /// takeover, the one the previous holder left.
    pub mark: Option<RegistryMark>,
}

/// Whether this process leads, published after every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeadershipView {
    Standby,
    Leader(Term),
}

impl LeadershipView {
    pub fn term(&self) -> Option<&Term> {
        match self {
            LeadershipView::Leader(t) => Some(t),
            LeadershipView::Standby => None,
        }
    }
}

enum Command {
    AdoptEpoch(Epoch),
    /// The service stopped acting in this term.
    StepDown(u64),
    Shutdown(oneshot::Sender<()>),
}

/// The service's handle on the leadership task.
pub struct Elector {
    commands: mpsc::Sender<Command>,
    view: watch::Receiver<LeadershipView>,
    clock: Clock,
    holder: String,
    mark: watch::Sender<Option<RegistryMark>>,
}

struct Driver {
    leadership: Leadership,
    store: kv::Store,
    client: async_nats::Client,
    clock: Clock,
    name: String,
    view: watch::Sender<LeadershipView>,
    term_id: u64,
    /// The holder and epoch last logged, so that a change is logged once.
    last_logged: Option<(String, Epoch)>,
    io_timeout: Duration,
    /// The registry's mark as the service last noted it.
    mark: watch::Receiver<Option<RegistryMark>>,
}

impl Elector {
    /// Opens (or creates) the leadership bucket and starts the leadership task as a standby.
    pub async fn start(
        client: async_nats::Client,
        replicas: usize,
        name: &str,
        holder: String,
        cfg: LeadershipConfig,
        clock: Clock,
    ) -> Result<Elector, Error> {
        let js = jetstream::new(client.clone());
        let store = open_bucket(&js, replicas).await?;
        let (view_tx, view_rx) = watch::channel(LeadershipView::Standby);
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let (mark_tx, mark_rx) = watch::channel(None);
        let driver = Driver {
            leadership: Leadership::new(cfg, holder.clone()),
            store,
            client,
            clock,
            name: name.to_owned(),
            view: view_tx,
            term_id: 0,
            last_logged: None,
            io_timeout: cfg.renew_interval.clamp(Duration::from_millis(100), Duration::from_secs(2)),
            mark: mark_rx,
        };
        tokio::spawn(driver.run(cmd_rx));
        Ok(Elector { commands: cmd_tx, view: view_rx, clock, holder, mark: mark_tx })
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// A receiver of the view, for the leader loop.
    pub fn view(&self) -> watch::Receiver<LeadershipView> {
        self.view.clone()
    }

    /// Waits until this process leads a term newer than `after`. `None` if the
    /// leadership task is gone.
    pub async fn wait_leader(&self, after: u64) -> Option<Term> {
        let mut view = self.view.clone();
        loop {
            if let Some(t) = view.borrow_and_update().term().filter(|t| t.id > after) {
                return Some(t.clone());
            }
            view.changed().await.ok()?;
        }
    }

    /// The leader claimed `epoch` in the registry: write it back to the leadership.
    pub async fn adopt_epoch(&self, epoch: Epoch) {
        let _ = self.commands.send(Command::AdoptEpoch(epoch)).await;
    }

    /// The registry's high-water mark moved: the leadership's next write carries
    /// it (renewals are not hurried for it). Never blocks.
    pub fn note_mark(&self, mark: RegistryMark) {
        self.mark.send_if_modified(|current| {
            let changed = *current != Some(mark);
            *current = Some(mark);
            changed
        });
    }

    /// The leader stopped acting in term `term`: release the leadership and become a standby.
    pub async fn step_down(&self, term: u64) {
        let _ = self.commands.send(Command::StepDown(term)).await;
    }

    /// Releases the leadership if held and stops the leadership task.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Shutdown(tx)).await.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), rx).await;
        }
    }
}

/// Largest leadership record the bucket takes (a [`LeadershipRecord`] is ≈ 100 bytes).
const LEASE_MAX_VALUE: i32 = 4096;
/// Bytes the leadership bucket may hold.
const LEASE_MAX_BYTES: i64 = 1 << 20;

/// Gets the bucket, creating it when absent (two coordinators creating it at
/// once is fine: the second create finds the same configuration).
async fn open_bucket(js: &jetstream::Context, replicas: usize) -> Result<kv::Store, Error> {
    if let Ok(store) = js.get_key_value(subjects::LEADER_BUCKET).await {
        return Ok(store);
    }
    let created = js
        .create_key_value(kv::Config {
            bucket: subjects::LEADER_BUCKET.to_owned(),
            description: "tenure coordinators' leader lease".to_owned(),
            history: 1,
            // One small key: bounded so that nothing can grow the bucket.
            max_value_size: LEASE_MAX_VALUE,
            max_bytes: LEASE_MAX_BYTES,
            storage: jetstream::stream::StorageType::File,
            num_replicas: replicas.max(1),
            ..Default::default()
        })
        .await;
    match created {
        Ok(store) => Ok(store),
        Err(e) => js
            .get_key_value(subjects::LEADER_BUCKET)
            .await
            .map_err(|_| Error::Bucket { bucket: subjects::LEADER_BUCKET, reason: e.to_string() }),
    }
}

impl Driver {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        let mut tick = tokio::time::interval(self.leadership.tick_period());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let poll_every = (self.leadership.config().renew_interval / 2).min(Duration::from_millis(250));
        let mut poll = tokio::time::interval(poll_every);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut presence = tokio::time::interval(Duration::from_secs(1));
        presence.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(holder = %self.leadership.holder(), "standby: watching the leader lease");
        loop {
            let obs = tokio::select! {
                _ = tick.tick() => Observation::Tick,
                _ = poll.tick() => match self.read().await {
                    Some(obs) => obs,
                    None => continue,
                },
                _ = presence.tick() => {
                    if self.leadership.held().is_none() {
                        self.announce().await;
                    }
                    continue;
                }
                command = commands.recv() => match command {
                    Some(Command::AdoptEpoch(epoch)) => {
                        self.leadership.adopt_epoch(epoch, self.clock.now());
                        Observation::Tick
                    }
                    Some(Command::StepDown(term)) => {
                        // A term that already ended (lost by the leadership itself) is not ended again.
                        if term == self.term_id {
                            self.step_down().await;
                        }
                        continue;
                    }
                    Some(Command::Shutdown(done)) => {
                        self.step_down().await;
                        let _ = done.send(());
                        return;
                    }
                    None => {
                        self.step_down().await;
                        return;
                    }
                },
            };
            self.adopt_noted_mark();
            self.step(obs).await;
        }
    }

    /// Feeds one observation, carries out what the machine decides, and feeds
    /// the answer of each write back until it has nothing more to do. After a
    /// refused or unanswered write the machine waits for a read, which the next
    /// poll brings (so a lagging replica cannot make it spin).
    async fn step(&mut self, mut obs: Observation) {
        loop {
            let decision = self.leadership.handle(obs, self.clock.now());
            obs = match decision {
                Decision::None => break,
                Decision::Acquire(w) => {
                    tracing::info!(
                        revision = w.expected,
                        epoch = %w.value.epoch,
                        "leader lease expired or free in our eyes; taking over"
                    );
                    self.write(&w).await
                }
                Decision::Renew(w) => self.write(&w).await,
                Decision::Lead { epoch, takeover_started } => {
                    self.term_id += 1;
                    tracing::info!(
                        %epoch,
                        term = self.term_id,
                        since_judged_expired_ms = ms(self.clock.now().saturating_sub(takeover_started)),
                        "leader lease acquired"
                    );
                    break;
                }
                Decision::StepDown(reason) => {
                    tracing::warn!(%reason, "leader lease lost");
                    break;
                }
            };
        }
        self.publish();
    }

    fn publish(&mut self) {
        let view = match (self.leadership.held(), self.leadership.valid_until()) {
            (Some(h), Some(valid_until)) => LeadershipView::Leader(Term {
                id: self.term_id,
                epoch: h.value.epoch,
                valid_until,
                renewed_at: h.renewed_at,
                renewals: h.value.renewals,
                takeover_started: h.takeover_started,
                mark: h.value.mark,
            }),
            _ => LeadershipView::Standby,
        };
        self.view.send_if_modified(|current| {
            let changed = *current != view;
            *current = view;
            changed
        });
    }

    /// Takes the registry mark the service noted last into the leadership record.
    fn adopt_noted_mark(&mut self) {
        if self.mark.has_changed().unwrap_or(false) {
            if let Some(mark) = *self.mark.borrow_and_update() {
                self.leadership.adopt_mark(mark);
            }
        }
    }

    async fn step_down(&mut self) {
        // The releadership write carries the latest mark: one noted just before a
        // shutdown (a machine's mark that caught the registry behind) must
        // not be lost with this process.
        self.adopt_noted_mark();
        let Some(release) = self.leadership.step_down(self.clock.now()) else {
            self.publish();
            return;
        };
        // Publish first: nothing may act on the leadership once it is being released.
        self.publish();
        match self.cas(&release).await {
            Ok(Ok(_)) => tracing::info!(epoch = %release.value.epoch, "leader lease released"),
            Ok(Err(())) => tracing::info!("leader lease not released: the key moved on"),
            Err(reason) => tracing::warn!(%reason, "leader lease not released; it expires after its ttl"),
        }
    }

    async fn announce(&self) {
        let presence = CoordinatorPresence { name: self.name.clone(), holder: self.leadership.holder().to_owned() };
        match tenure_protocol::encode(&presence) {
            Ok(bytes) => {
                if let Err(error) = self.client.publish(subjects::COORD_PRESENCE, bytes.into()).await {
                    tracing::debug!(%error, "presence not published");
                }
            }
            Err(error) => tracing::error!(%error, "presence could not be encoded"),
        }
    }

    /// Reads the key. `None` when it could not be read (nothing is concluded).
    async fn read(&mut self) -> Option<Observation> {
        let entry = match tokio::time::timeout(self.io_timeout, self.store.entry(subjects::LEADER_KEY)).await {
            Ok(Ok(entry)) => entry,
            Ok(Err(error)) => {
                tracing::debug!(%error, "leader lease not readable");
                return None;
            }
            Err(_) => {
                tracing::debug!("leader lease read timed out");
                return None;
            }
        };
        let (revision, state) = match entry {
            None => (0, KeyState::Absent),
            Some(e) if e.operation != kv::Operation::Put => (e.revision, KeyState::Absent),
            Some(e) => match tenure_protocol::decode::<LeadershipRecord>(&e.value) {
                Ok(v) => (e.revision, KeyState::Held(v)),
                Err(error) => {
                    tracing::warn!(revision = e.revision, %error, "leader lease value unreadable");
                    (e.revision, KeyState::Unreadable)
                }
            },
        };
        if let KeyState::Held(v) = &state {
            let logged = Some((v.holder.clone(), v.epoch));
            if v.holder != self.leadership.holder() && self.last_logged != logged {
                tracing::info!(leader = %v.holder, epoch = %v.epoch, released = v.is_released(), "leader lease seen");
                self.last_logged = logged;
            }
        }
        Some(Observation::Key { revision, state })
    }

    async fn write(&self, w: &Write) -> Observation {
        let (observation, result) = match self.cas(w).await {
            Ok(Ok(revision)) => (Observation::Written { revision }, "written"),
            Ok(Err(())) => (Observation::Conflict, "conflict"),
            Err(reason) => {
                tracing::warn!(%reason, revision = w.expected, "leader lease write unanswered");
                (Observation::WriteFailed, "failed")
            }
        };
        crate::metrics::get().leadership_writes.add(1, &[opentelemetry::KeyValue::new("result", result)]);
        observation
    }

    /// One compare-and-set: `Ok(Ok(revision))` landed, `Ok(Err(()))` refused
    /// because the key moved, `Err` no answer (it may have landed).
    async fn cas(&self, w: &Write) -> Result<Result<u64, ()>, String> {
        let payload: bytes::Bytes = tenure_protocol::encode(&w.value).map_err(|e| e.to_string())?.into();
        let key = subjects::LEADER_KEY;
        let result = tokio::time::timeout(self.io_timeout, async {
            if w.expected == 0 {
                match self.store.create(key, payload).await {
                    Ok(revision) => Ok(Ok(revision)),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(Err(())),
                    Err(e) => Err(e.to_string()),
                }
            } else {
                match self.store.update(key, payload, w.expected).await {
                    Ok(revision) => Ok(Ok(revision)),
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(Err(())),
                    Err(e) => Err(e.to_string()),
                }
            }
        })
        .await;
        result.unwrap_or_else(|_| Err(format!("no answer within {} ms", ms(self.io_timeout))))
    }
}
