//! The task registry in JetStream: one stream, one subject per task holding its
//! latest record (`max_messages_per_subject = 1`), plus leadership claims.
//!
//! **Fencing in storage.** Every append is conditional on the stream's last
//! sequence (`Nats-Expected-Last-Sequence`). The leader is the only writer, so it
//! knows that sequence; a new leader's claim moves it, after which every append
//! of a deposed leader fails with [`Error::Fenced`] — whatever the deposed leader
//! believes about its leadership. The leadership (`leadership.rs`) decides who *should*
//! write; this fence is what makes a stale writer *unable* to. Retries of one append reuse its `Nats-Msg-Id` (a
//! per-process nonce and the expected sequence), so a write whose ack was lost is
//! deduplicated instead of being mistaken for fencing; JetStream checks ids before
//! sequences, which is why ids must never collide across coordinators.
//!
//! **Pipelining.** The leader's appends are pipelined ([`Registry::start_put_task`],
//! [`Registry::settle`]): append *k* after the last durable one is sent expecting
//! the stream's last sequence to be `last + k - 1`, without waiting for the acks
//! before it. This holds because the leader is the only writer and its appends
//! travel in order on one connection. The fence is unchanged: an append is
//! judged fenced only when it fails its expected sequence while every append
//! before it was already durable (a failure behind an append that did not land
//! is repaired by sending it again, with the same message id, once it is the
//! oldest). Appends become durable in order; the caller releases what depends
//! on an append only once [`Registry::settle`] has counted it.
//!
//! An expected sequence alone is not a fence for append *k > 1*: another
//! writer appending exactly *k − 1* messages (a new leader's claim, while our
//! earlier appends were lost in a disconnect) would make a late copy of ours
//! land after its claim. So every append also expects the stream's last
//! message to be our own previous one (`Nats-Expected-Last-Msg-Id`: the append
//! before it in the pipeline, or our last durable one, our epoch claim first).
//!
//! **Bounded.** The stream has a byte limit and refuses new messages past it
//! (`discard: new`: the oldest records are never dropped to make room), a
//! largest message (the server's `max_payload`, of which a record may take
//! all but [`HEADER_ALLOWANCE`]) and a few consumers (loading takes one).
//! The leader refuses submits well before the byte limit (`limits.rs`), so
//! the tasks it admitted can always record their ends. Limits are applied
//! to an existing stream when it is opened, so raising them is a
//! configuration change and a restart.
//!
//! An append that cannot be encoded ([`Error::Encode`]) fails that one
//! record: nothing was sent, nothing else in flight is touched.
//!
//! **Batches.** The first records of tasks created by one input (a batch
//! submit), the first grants of tasks granted by one input, and the ends of
//! tasks that never wrote to their own subject, may share one message
//! ([`Registry::start_put_shared`]), on a subject of its own
//! (`tenure.registry.batch.<its first task's number>`, `….granted` when that
//! record is a first grant, `….ended` when it is an end). Every other record
//! of a task goes on the task's own subject, so a batch only ever loses
//! records: loading takes each task's record from its latest message, batch
//! or subject, and a batch none of whose records is the latest any more is
//! compacted to a tombstone ([`Registry::start_retire`], a conditional append
//! like any other). A task's own subject therefore holds at most one message,
//! and a task has at most three entries in batches in its life: a live task
//! adds at most its first grant's entry and either its end's entry or its
//! subject's next message, each up to its largest record (`limits.rs`
//! reserves them); a task whose end is the latest record in a batch may still
//! add its subject's next message, a little larger than its end at most,
//! which this module counts ([`Registry::open_ends`]); a batch's bytes are
//! freed when it is retired.

use std::collections::{HashMap, VecDeque};
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;

use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use tenure_protocol::messages::RegistryMark;
use tenure_protocol::{subjects, Epoch, TaskId};

use crate::core::Version;
use crate::limits::POST_END_GROWTH;
use crate::record::{Batched, EpochClaim, RegistryEntry, TaskEntry, TaskRecord};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another coordinator wrote to the registry: this one is no longer leader.
    #[error("registry fenced: another coordinator wrote after sequence {expected}")]
    Fenced { expected: u64 },
    #[error("registry unavailable: {0}")]
    Unavailable(String),
    /// This record cannot be stored (it does not encode, or it is larger than
    /// a registry message): nothing of it was sent.
    #[error("cannot encode registry entry: {0}")]
    Encode(String),
    /// The server refused an append already in flight as too large: the
    /// records behind it were sent expecting it, so the term ends (nothing of
    /// it was stored; the leader refuses such records before they are sent).
    #[error("registry append refused: {0}")]
    Refused(String),
    /// The registry's last epoch claim is above every epoch that can follow.
    #[error("epochs are exhausted: the registry's last claim is {0}")]
    EpochsExhausted(Epoch),
}

/// The registry stream's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Bytes the stream may hold; past them new messages are refused.
    pub max_bytes: u64,
    /// Largest message (payload and headers).
    pub max_message: usize,
    /// How long the server remembers message ids for deduplication
    /// (JetStream's `duplicate_window`): a retried append is recognised
    /// within it. Shortened only by tests and chaos runs.
    pub duplicate_window: Duration,
}

/// The registry's duplicate window unless configured otherwise.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Room in a message for the headers of an append (message id, expected
/// sequence, expected last message id) and the subject.
pub const HEADER_ALLOWANCE: usize = 1024;

/// Consumers the registry stream allows: a leader's load takes one (ordered,
/// removed when done); tools reading the registry take a few.
pub const MAX_CONSUMERS: i32 = 64;

/// The largest task record a registry message holds, on a server whose
/// `max_payload` is `max_payload`: all but the header allowance, and never
/// above the codec's limit.
pub fn record_limit(max_payload: usize) -> usize {
    max_payload.saturating_sub(HEADER_ALLOWANCE).min(tenure_protocol::MAX_MESSAGE_BYTES)
}

impl StreamLimits {
    /// The limits for a registry of `max_bytes` on a server whose largest
    /// message is `max_payload`.
    pub fn new(max_bytes: u64, max_payload: usize) -> StreamLimits {
        StreamLimits {
            max_bytes,
            max_message: record_limit(max_payload) + HEADER_ALLOWANCE,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
        }
    }
}

/// What loading the registry found.
#[derive(Debug, Default)]
pub struct Loaded {
    pub records: Vec<TaskRecord>,
    pub last_claim: Option<EpochClaim>,
    /// Highest task number seen in any subject, readable or not: ids above it are free.
    pub highest_n: u64,
    /// Subjects whose record could not be decoded (reported, never dropped).
    pub corrupt: Vec<(String, String)>,
    /// The stream's bytes when loaded.
    pub bytes: u64,
    /// The stream's byte limit in force (the configured one, unless the
    /// stream could not be updated to it).
    pub max_bytes: u64,
    /// Which batches still hold some task's latest record
    /// (handed on to the [`Registry`]).
    batches: Batches,
}

/// Which batches still hold some task's latest record, kept from the load on
/// as appends become durable. A batch is named by its subject
/// ([`batch_subject`]).
#[derive(Debug, Default)]
struct Batches {
    /// Batch → how many of its records are still the latest.
    live: HashMap<Arc<str>, u32>,
    /// Task number → the batch holding its latest record (only such tasks),
    /// and what the task may still add when that record is its end (see
    /// [`Batches::open`]; 0 otherwise).
    home: HashMap<u64, (Arc<str>, u32)>,
    /// Batches none of whose records is the latest any more: to be retired.
    dead: Vec<Arc<str>>,
    /// The registry bytes the tasks whose latest record is their end in a
    /// batch may still add: each its subject's next message (a `reported`
    /// mark, a board move, a cleanup job, a tombstone), which does not
    /// replace the end's entry. That message is the end's record with what
    /// may change after an end, so it is bounded by the entry's size and
    /// [`POST_END_GROWTH`].
    open: u64,
}

/// One task's latest record in a batch: its number, and what it may still
/// add (an end's; see [`Batches::open`]).
type Entry = (u64, u32);

/// What a task whose end's entry of `entry_bytes` is its latest record may
/// still add to the registry ([`Batches::open`]).
fn open_end(entry_bytes: usize) -> u32 {
    u32::try_from(entry_bytes + POST_END_GROWTH).unwrap_or(u32::MAX)
}

impl Batches {
    /// Batch `batch`, holding the latest records of `tasks` (each once), is
    /// durable: a record it holds is later than one its task had in another
    /// batch (a first grant after a first record, an end after either).
    fn stored(&mut self, batch: Arc<str>, tasks: &[Entry]) {
        for (n, _) in tasks {
            self.superseded(*n);
        }
        if tasks.is_empty() {
            return self.dead.push(batch);
        }
        self.live.insert(batch.clone(), tasks.len() as u32);
        for &(n, open) in tasks {
            self.open += u64::from(open);
            self.home.insert(n, (batch.clone(), open));
        }
    }

    /// Task `n` has a later durable record than the one in its batch, if any.
    fn superseded(&mut self, n: u64) {
        let Some((batch, open)) = self.home.remove(&n) else { return };
        self.open = self.open.saturating_sub(u64::from(open));
        if let Some(live) = self.live.get_mut(&batch) {
            *live -= 1;
            if *live == 0 {
                self.live.remove(&batch);
                self.dead.push(batch);
            }
        }
    }
}

pub struct Registry {
    js: jetstream::Context,
    /// The stream's last sequence as of the last durable append.
    last_seq: u64,
    epoch: Epoch,
    /// Unique per process: message ids of two coordinators never collide, so
    /// deduplication can only ever match this process's own retries.
    nonce: uuid::Uuid,
    /// Pipelined appends not yet acknowledged, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Appends started since the registry was opened (tickets are 1, 2, …).
    started: u64,
    /// Appends acknowledged, in order: tickets up to this one are durable.
    durable: u64,
    /// The message id of this process's last durable append (its epoch claim
    /// first): the next append expects it as the stream's last message.
    last_msg_id: Option<String>,
    /// The highest task number durable in the registry (or reserved by the
    /// mark): part of the high-water mark.
    highest_task: u64,
    /// Every registry rollback an operator accepted, merged (carried on by
    /// each epoch claim).
    accepted_floor: Option<RegistryMark>,
    /// Batches still holding some task's latest record.
    batches: Batches,
    /// Largest payload of one message (see [`record_limit`]).
    record_limit: usize,
}

/// What an append stores, for the bookkeeping once it is durable.
enum Stored {
    /// A record (or tombstone) of this task on its own subject.
    Task(u64),
    /// Records of these tasks, in one batch (its subject).
    Batch(Arc<str>, Vec<Entry>),
    /// A retired batch's tombstone.
    Retired,
}

type AckFuture = Pin<Box<dyn Future<Output = Result<PublishAck, PublishError>> + Send>>;

/// One pipelined append.
struct InFlight {
    subject: String,
    payload: bytes::Bytes,
    /// The stream's last sequence this append expects: it lands at `expected + 1`.
    expected: u64,
    /// Same for every send of this append, so a retry is deduplicated.
    msg_id: String,
    /// The message id of the append before it (ours): it lands only right
    /// after that one, never after another writer's message that happens to
    /// sit at the expected sequence.
    after_msg_id: Option<String>,
    /// The ack of the last send; `None` when it must be sent (again).
    ack: Option<AckFuture>,
    /// Sent while every append before it was durable: a wrong-sequence answer
    /// to that send means another writer moved the registry (fenced).
    sent_as_oldest: bool,
    /// What the append stores.
    stored: Stored,
    /// A transient failure's pause before the next send.
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
    delay: Duration,
    first_sent: tokio::time::Instant,
}

/// Most appends in flight at once; the leader waits for the oldest past it.
pub const MAX_IN_FLIGHT: usize = 256;

/// How long one append keeps retrying through a NATS outage before giving up.
const APPEND_RETRY_FOR: Duration = Duration::from_secs(30);

impl Registry {
    /// Creates the stream if needed (applying `limits` to an existing one)
    /// and loads every record.
    pub async fn open(
        js: jetstream::Context,
        replicas: usize,
        limits: StreamLimits,
    ) -> Result<(Registry, Loaded), Error> {
        let unavailable = |e: &dyn std::fmt::Display| Error::Unavailable(e.to_string());
        let bounded = |mut config: stream::Config| {
            config.max_bytes = i64::try_from(limits.max_bytes).unwrap_or(i64::MAX);
            config.max_message_size = i32::try_from(limits.max_message).unwrap_or(i32::MAX);
            config.max_consumers = MAX_CONSUMERS;
            config.discard = stream::DiscardPolicy::New;
            config.duplicate_window = limits.duplicate_window;
            config
        };
        let mut stream = js
            .get_or_create_stream(bounded(stream::Config {
                name: subjects::REGISTRY_STREAM.to_owned(),
                subjects: vec![subjects::REGISTRY_ALL.to_owned()],
                max_messages_per_subject: 1,
                storage: stream::StorageType::File,
                num_replicas: replicas.max(1),
                ..Default::default()
            }))
            .await
            .map_err(|e| unavailable(&e))?;
        let info = stream.info().await.map_err(|e| unavailable(&e))?.clone();
        let mut config = info.config.clone();
        if bounded(config.clone()) != config {
            match js.update_stream(bounded(config.clone())).await {
                Ok(updated) => config = updated.config,
                Err(error) => tracing::warn!(%error, "the registry's limits could not be applied; keeping its own"),
            }
        }
        let state = info.state.clone();
        let mut loaded = Loaded {
            bytes: state.bytes,
            max_bytes: u64::try_from(config.max_bytes).ok().filter(|b| *b > 0).unwrap_or(limits.max_bytes),
            ..Loaded::default()
        };
        let mut found = Found::default();
        if state.messages > 0 {
            let consumer = stream
                .create_consumer(consumer::pull::OrderedConfig {
                    deliver_policy: consumer::DeliverPolicy::All,
                    ..Default::default()
                })
                .await
                .map_err(|e| unavailable(&e))?;
            let mut messages = consumer.messages().await.map_err(|e| unavailable(&e))?;
            while let Some(msg) = messages.next().await {
                let msg = msg.map_err(|e| unavailable(&e))?;
                let seq = msg.info().map(|i| i.stream_sequence).map_err(|e| unavailable(&e))?;
                found.message(seq, msg.subject.as_str(), &msg.payload);
                if seq >= state.last_sequence {
                    break;
                }
            }
        }
        found.into_loaded(&mut loaded);
        let epoch = loaded.last_claim.as_ref().map(|c| c.epoch).unwrap_or_default();
        let accepted_floor = loaded.last_claim.as_ref().and_then(|c| c.accepted_floor);
        let batches = std::mem::take(&mut loaded.batches);
        let registry = Registry {
            js,
            last_seq: state.last_sequence,
            epoch,
            nonce: uuid::Uuid::new_v4(),
            in_flight: VecDeque::new(),
            started: 0,
            durable: 0,
            last_msg_id: None,
            highest_task: loaded.highest_n,
            accepted_floor,
            batches,
            record_limit: limits.max_message.saturating_sub(HEADER_ALLOWANCE),
        };
        Ok((registry, loaded))
    }

    /// Claims the next epoch, and at least `at_least` (the epoch of the
    /// leadership just won, so that leadership and registry agree): appends a claim
    /// conditional on the sequence this coordinator loaded. Fails with
    /// [`Error::Fenced`] if anyone wrote since; the caller loads again.
    /// `accepted_rollback` records, with the claim, an operator's acceptance
    /// of a registry found behind its high-water mark.
    pub async fn claim(
        &mut self,
        by: &str,
        at_least: Epoch,
        now_ms: u64,
        accepted_rollback: Option<crate::mark::Behind>,
    ) -> Result<Epoch, Error> {
        let epoch = self.epoch.checked_next().ok_or(Error::EpochsExhausted(self.epoch))?.max(at_least);
        let accepted_floor = RegistryMark::merged(self.accepted_floor, accepted_rollback.as_ref().map(|b| b.expected));
        let claim = EpochClaim { epoch, by: by.to_owned(), at_ms: now_ms, accepted_rollback, accepted_floor };
        self.append(subjects::REGISTRY_EPOCH.to_owned(), &RegistryEntry::Epoch(claim)).await?;
        self.epoch = epoch;
        self.accepted_floor = accepted_floor;
        Ok(epoch)
    }

    /// Every registry rollback an operator accepted, merged: machine marks
    /// at or below it are no news.
    pub fn accepted_floor(&self) -> Option<RegistryMark> {
        self.accepted_floor
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The stream's last sequence as of the last durable append (or the load).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Task numbers up to `n` count as used (the mark says they were), so
    /// the mark never goes below them.
    pub fn reserve_through(&mut self, n: u64) {
        self.highest_task = self.highest_task.max(n);
    }

    /// The high-water mark of what is durable in the registry now.
    pub fn mark(&self) -> RegistryMark {
        RegistryMark { last_seq: self.last_seq, highest_task: self.highest_task, epoch: self.epoch }
    }

    /// Starts storing the latest version of a task (pipelined); its ticket.
    /// It is durable once [`Registry::settle`] has counted the ticket.
    pub async fn start_put_task(&mut self, record: &TaskRecord) -> Result<u64, Error> {
        let payload = encode_task(record)?.into();
        self.start_append(subjects::registry_task(&record.id), Stored::Task(record.id.number()), payload).await
    }

    /// Starts storing records of several tasks changed by one input — each
    /// its task's first record, first grant or end ([`Version::may_share`])
    /// — in as few messages as the record limit allows (a batch of one is
    /// stored on its task's subject); the ticket of the last. Every other
    /// record goes on its task's subject ([`Registry::start_put_task`]), so
    /// a task has at most three records in batches in its life, and a batch
    /// only ever loses records: it is retired once none of them is the
    /// latest. An end's entry counts in [`Registry::open_ends`] until its
    /// task has a later record.
    ///
    /// Fails with the index of the first record not sent when one cannot be
    /// encoded: the records before it were started, it and those after it
    /// were not.
    pub async fn start_put_shared(&mut self, records: &[(&TaskRecord, Version)]) -> Result<u64, (usize, Error)> {
        let mut chunk: Vec<(Batched, Version)> = Vec::new();
        let (mut chunk_start, mut chunk_bytes) = (0, 0);
        for (i, (record, version)) in records.iter().enumerate() {
            let entry = match encode_task(record) {
                Ok(entry) => entry,
                Err(e) => {
                    // The records before it go as they would have alone.
                    if !chunk.is_empty() {
                        self.start_batch(chunk).await.map_err(|e| (chunk_start, e))?;
                    }
                    return Err((i, e));
                }
            };
            let bytes = entry.len() + BATCHED_OVERHEAD;
            if !chunk.is_empty() && BATCH_OVERHEAD + chunk_bytes + bytes > self.record_limit {
                let full = std::mem::take(&mut chunk);
                self.start_batch(full).await.map_err(|e| (chunk_start, e))?;
                (chunk_start, chunk_bytes) = (i, 0);
            }
            chunk.push((Batched { id: record.id.clone(), entry }, *version));
            chunk_bytes += bytes;
        }
        if !chunk.is_empty() {
            self.start_batch(chunk).await.map_err(|e| (chunk_start, e))?;
        }
        Ok(self.started)
    }

    /// One message of records that may share one: on the task's subject when
    /// it holds one, on a batch subject of its own otherwise. A chunk holding
    /// a record that may not share one ([`Version::Later`], never sent here)
    /// goes record by record, each on its subject.
    async fn start_batch(&mut self, chunk: Vec<(Batched, Version)>) -> Result<u64, Error> {
        let subject = match chunk.as_slice() {
            [(first, version), _, ..] => batch_subject(first.id.number(), *version),
            _ => None,
        };
        let Some(subject) = subject.filter(|_| chunk.iter().all(|(_, v)| *v != Version::Later)) else {
            for (Batched { id, entry }, _) in chunk {
                self.start_append(subjects::registry_task(&id), Stored::Task(id.number()), entry.into()).await?;
            }
            return Ok(self.started);
        };
        let tasks: Vec<Entry> = chunk
            .iter()
            .map(|(b, v)| (b.id.number(), if *v == Version::End { open_end(b.entry.len()) } else { 0 }))
            .collect();
        let payload = encode(&RegistryEntry::Batch(chunk.into_iter().map(|(b, _)| b).collect()))?;
        let subject: Arc<str> = subject.into();
        self.start_append(subject.to_string(), Stored::Batch(subject, tasks), payload).await
    }

    /// Starts compacting a batch none of whose records is the latest any
    /// more to a tombstone (conditional, like every append); its ticket, or
    /// `None` when no batch waits for it.
    pub async fn start_retire(&mut self, at_ms: u64) -> Result<Option<u64>, Error> {
        let Some(batch) = self.batches.dead.pop() else { return Ok(None) };
        let payload = encode(&RegistryEntry::Retired { at_ms })?;
        self.start_append(batch.to_string(), Stored::Retired, payload).await.map(Some)
    }

    /// Batches waiting to be retired.
    pub fn retirable(&self) -> usize {
        self.batches.dead.len()
    }

    /// The registry bytes that tasks whose latest record is their end in a
    /// batch may still add (each its subject's next message, which does not
    /// replace the end's entry; durability note a20). The leader's budget
    /// counts them with the stream's bytes.
    pub fn open_ends(&self) -> u64 {
        self.batches.open
    }

    /// Starts compacting a garbage-collected task's record to a tombstone
    /// (conditional, like every append: a deposed leader cannot forget
    /// anything); its ticket, as [`Registry::start_put_task`].
    pub async fn start_forget(&mut self, id: &TaskId, at_ms: u64) -> Result<u64, Error> {
        let payload = encode(&RegistryEntry::Forgotten { id: id.clone(), at_ms })?;
        self.start_append(subjects::registry_task(id), Stored::Task(id.number()), payload).await
    }

    /// Appends started and not yet durable.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The ticket of the newest append started (0 before any).
    pub fn last_ticket(&self) -> u64 {
        self.started
    }

    /// The stream's last sequence the next append will expect.
    fn next_expected(&self) -> u64 {
        self.last_seq + self.in_flight.len() as u64
    }

    async fn start_append(&mut self, subject: String, stored: Stored, payload: bytes::Bytes) -> Result<u64, Error> {
        let expected = self.next_expected();
        let after_msg_id = self.in_flight.back().map(|a| a.msg_id.clone()).or_else(|| self.last_msg_id.clone());
        let mut append = InFlight {
            subject,
            payload,
            expected,
            msg_id: format!("{}:{}", self.nonce, expected),
            after_msg_id,
            ack: None,
            sent_as_oldest: self.in_flight.is_empty(),
            stored,
            pause: None,
            delay: Duration::from_millis(50),
            first_sent: tokio::time::Instant::now(),
        };
        // A send that fails here is sent again once the append is the oldest.
        match send(&self.js, &append).await {
            Ok(ack) => append.ack = Some(ack),
            Err(error) => tracing::warn!(%error, "registry append not sent; retrying"),
        }
        self.in_flight.push_back(append);
        self.started += 1;
        Ok(self.started)
    }

    /// Drives the oldest append in flight until it is durable; returns the
    /// ticket it had (every ticket up to it is durable). Retries a transient
    /// failure for up to 30 s with the same message id; fails with
    /// [`Error::Fenced`] when another writer moved the registry.
    ///
    /// Cancel-safe: the state of the oldest append lives in the registry, so a
    /// call dropped mid-way resumes where it stopped. With nothing in flight it
    /// never returns.
    pub async fn settle(&mut self) -> Result<u64, Error> {
        loop {
            let Some(oldest) = self.in_flight.front_mut() else {
                return std::future::pending().await;
            };
            if let Some(pause) = oldest.pause.as_mut() {
                pause.await;
                oldest.pause = None;
            }
            let Some(ack) = oldest.ack.as_mut() else {
                // Everything before it is durable: this send's answer is final.
                oldest.sent_as_oldest = true;
                match send(&self.js, oldest).await {
                    Ok(ack) => oldest.ack = Some(ack),
                    Err(e) => transient(oldest, e)?,
                }
                continue;
            };
            let result = ack.await;
            oldest.ack = None;
            match result {
                Ok(ack) => {
                    // A duplicate is our own earlier send whose ack was lost; it
                    // must have landed exactly where we expected.
                    if ack.duplicate && ack.sequence != oldest.expected + 1 {
                        return Err(Error::Fenced { expected: oldest.expected });
                    }
                    self.last_seq = ack.sequence;
                    self.last_msg_id = Some(oldest.msg_id.clone());
                    match &oldest.stored {
                        Stored::Task(n) => {
                            self.highest_task = self.highest_task.max(*n);
                            self.batches.superseded(*n);
                        }
                        Stored::Batch(batch, tasks) => {
                            self.highest_task = self.highest_task.max(tasks.iter().map(|t| t.0).max().unwrap_or(0));
                            self.batches.stored(batch.clone(), tasks);
                        }
                        Stored::Retired => {}
                    }
                    crate::metrics::get().append.record(oldest.first_sent.elapsed().as_secs_f64(), &[]);
                    self.in_flight.pop_front();
                    self.durable += 1;
                    return Ok(self.durable);
                }
                Err(e) => match e.kind() {
                    PublishErrorKind::WrongLastMessageId if oldest.sent_as_oldest => {
                        // The server may have forgotten the id of our last
                        // message (restarted after its duplicate window of
                        // quiet): go on only if the stream still ends with it.
                        let (seq, id) = last_message(&self.js).await?;
                        if !forgot_our_id(oldest.expected, oldest.after_msg_id.as_deref(), seq, id.as_deref()) {
                            return Err(Error::Fenced { expected: oldest.expected });
                        }
                        tracing::warn!(
                            sequence = seq,
                            "the server forgot the id of our last registry message; it is still the last: going on"
                        );
                        oldest.after_msg_id = None;
                    }
                    PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId
                        if oldest.sent_as_oldest =>
                    {
                        return Err(Error::Fenced { expected: oldest.expected })
                    }
                    // Sent behind an append that had not landed: send it again now.
                    PublishErrorKind::WrongLastSequence | PublishErrorKind::WrongLastMessageId => {}
                    PublishErrorKind::MaxPayloadExceeded => return Err(Error::Refused(e.to_string())),
                    _ => transient(oldest, e)?,
                },
            }
        }
    }

    /// One append, acknowledged before it returns (the epoch claim; nothing
    /// may be in flight).
    async fn append(&mut self, subject: String, entry: &RegistryEntry) -> Result<(), Error> {
        let payload = encode(entry)?;
        let expected = self.last_seq;
        let msg_id = format!("{}:{}", self.nonce, expected);
        let policy = backoff::ExponentialBackoff {
            initial_interval: Duration::from_millis(50),
            max_interval: Duration::from_secs(1),
            max_elapsed_time: Some(APPEND_RETRY_FOR),
            ..Default::default()
        };
        let seq = backoff::future::retry(policy, || async {
            let publish = jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .expected_last_sequence(expected)
                .message_id(&msg_id);
            let ack = self.js.send_publish(subject.clone(), publish).await.map_err(|e| classify(e, expected))?;
            let ack = ack.await.map_err(|e| classify(e, expected))?;
            // A duplicate is our own earlier try whose ack was lost; it must have
            // landed exactly where we expected, or someone else wrote in between.
            if ack.duplicate && ack.sequence != expected + 1 {
                return Err(backoff::Error::permanent(Error::Fenced { expected }));
            }
            Ok(ack.sequence)
        })
        .await?;
        self.last_seq = seq;
        self.last_msg_id = Some(msg_id);
        Ok(())
    }
}

async fn send(js: &jetstream::Context, append: &InFlight) -> Result<AckFuture, PublishError> {
    let mut publish = jetstream::message::PublishMessage::build()
        .payload(append.payload.clone())
        .expected_last_sequence(append.expected)
        .message_id(&append.msg_id);
    if let Some(after) = &append.after_msg_id {
        publish = publish.expected_last_message_id(after);
    }
    Ok(js.send_publish(append.subject.clone(), publish).await?.into_future())
}

/// Whether an append refused for its expected last message id may be sent
/// again without it: the stream's last message is still at the sequence the
/// append expects and carries the id of our own previous append — so the
/// server forgot that id (it keeps ids only for its duplicate window, and a
/// restart after a longer quiet period loses them), and nobody else wrote.
/// The resend still expects the last sequence, which fences any writer that
/// comes in between. Anything else is another writer: fenced.
fn forgot_our_id(expected: u64, after: Option<&str>, found_seq: u64, found_id: Option<&str>) -> bool {
    found_seq == expected && after.is_some() && found_id == after
}

/// The stream's last sequence and the message id of the message there.
async fn last_message(js: &jetstream::Context) -> Result<(u64, Option<String>), Error> {
    let unavailable = |e: &dyn std::fmt::Display| Error::Unavailable(e.to_string());
    let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.map_err(|e| unavailable(&e))?;
    let seq = stream.info().await.map_err(|e| unavailable(&e))?.state.last_sequence;
    let msg = stream.get_raw_message(seq).await.map_err(|e| unavailable(&e))?;
    let id = msg.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned());
    Ok((seq, id))
}

/// Schedules the next send of an append after a transient failure, or gives up
/// once it has been failing for [`APPEND_RETRY_FOR`].
fn transient(append: &mut InFlight, e: PublishError) -> Result<(), Error> {
    if append.first_sent.elapsed() > APPEND_RETRY_FOR {
        return Err(Error::Unavailable(e.to_string()));
    }
    tracing::warn!(error = %e, "registry append failed; retrying");
    append.pause = Some(Box::pin(tokio::time::sleep(append.delay)));
    append.delay = (append.delay * 2).min(Duration::from_secs(1));
    Ok(())
}

fn classify(e: async_nats::jetstream::context::PublishError, expected: u64) -> backoff::Error<Error> {
    match e.kind() {
        PublishErrorKind::WrongLastSequence => backoff::Error::permanent(Error::Fenced { expected }),
        PublishErrorKind::MaxPayloadExceeded => backoff::Error::permanent(Error::Encode(e.to_string())),
        _ => {
            tracing::warn!(error = %e, "registry append failed; retrying");
            backoff::Error::transient(Error::Unavailable(e.to_string()))
        }
    }
}

/// The registry's last epoch claim (epoch 0 when none was made): what a
/// leader reads before it believes a higher epoch someone reported.
pub async fn last_claim(js: &jetstream::Context) -> Result<Epoch, Error> {
    let unavailable = |e: &dyn std::fmt::Display| Error::Unavailable(e.to_string());
    let stream = js.get_stream_no_info(subjects::REGISTRY_STREAM).await.map_err(|e| unavailable(&e))?;
    match stream.get_last_raw_message_by_subject(subjects::REGISTRY_EPOCH).await {
        Ok(msg) => match tenure_protocol::decode::<RegistryEntry>(&msg.payload) {
            Ok(RegistryEntry::Epoch(claim)) => Ok(claim.epoch),
            Ok(_) => Err(Error::Unavailable("the epoch subject holds no claim".into())),
            Err(e) => Err(Error::Unavailable(format!("the last epoch claim is unreadable: {e}"))),
        },
        Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(Epoch(0)),
        Err(e) => Err(unavailable(&e)),
    }
}

/// The registry stream's bytes, as the server counts them.
pub async fn bytes_used(js: &jetstream::Context) -> Result<u64, Error> {
    let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.map_err(|e| Error::Unavailable(e.to_string()))?;
    let info = stream.info().await.map_err(|e| Error::Unavailable(e.to_string()))?;
    Ok(info.state.bytes)
}

/// Bytes a record takes in a batch beyond its own encoding: its id at its
/// longest (a kind, a dash, a number), field markers and length prefixes.
pub(crate) const BATCHED_OVERHEAD: usize = tenure_protocol::ids::MAX_KIND_LEN + 48;
/// Bytes of a batch beyond its records: the entry's tag and the list's length.
const BATCH_OVERHEAD: usize = 32;

/// The subject of a batch whose first record is `version` of task `first`:
/// `batch.<n>` for first records, `batch.<n>.granted` for first grants,
/// `batch.<n>.ended` for ends. A task has one record of each in its life, in
/// one batch at most, so no two batches share a subject — not even after the
/// stream was restored and renumbered. `None` for any other record, which
/// never starts a batch.
fn batch_subject(first: u64, version: Version) -> Option<String> {
    match version {
        Version::First => Some(subjects::registry_batch(first)),
        Version::FirstGrant => Some(subjects::registry_grant_batch(first)),
        Version::End => Some(subjects::registry_end_batch(first)),
        Version::Later => None,
    }
}

fn encode(entry: &RegistryEntry) -> Result<bytes::Bytes, Error> {
    tenure_protocol::encode(entry).map(Into::into).map_err(|e| Error::Encode(e.to_string()))
}

/// A task's record as a [`RegistryEntry::Task`], encoded without a copy of it.
fn encode_task(record: &TaskRecord) -> Result<Vec<u8>, Error> {
    tenure_protocol::encode(&TaskEntry::Task(record)).map_err(|e| Error::Encode(e.to_string()))
}

/// What the registry's messages say, read in stream order: each task's
/// latest message wins, whether on its subject or in a batch.
#[derive(Default)]
struct Found {
    /// Task number → the sequence of its latest message and what it says.
    latest: HashMap<u64, (u64, Latest)>,
    /// Batches (not retired): the sequence of their message, their subject
    /// when it is one this registry writes batches on, their tasks (with
    /// what an end there may still add).
    batches: Vec<(u64, Option<Arc<str>>, Vec<Entry>)>,
    /// Unreadable messages that name no task.
    corrupt: Vec<(String, String)>,
    last_claim: Option<EpochClaim>,
    highest_n: u64,
}

enum Latest {
    Record(Box<TaskRecord>),
    Forgotten,
    /// Unreadable (the subject, or the batch and the task, and why): the
    /// task is not loaded, and an older version of it never is either.
    Corrupt(String, String),
}

impl Found {
    fn message(&mut self, seq: u64, subject: &str, payload: &[u8]) {
        let named =
            subject.strip_prefix(TASK_SUBJECT_PREFIX).and_then(|id| id.parse::<TaskId>().ok()).map(|id| id.number());
        let entry = tenure_protocol::decode::<RegistryEntry>(payload);
        if let Err(e) = &entry {
            tracing::error!(%subject, error = %e, "corrupt registry record kept aside");
        }
        match (entry, named) {
            (Ok(RegistryEntry::Task(record)), _) => self.task(seq, record.id.number(), Latest::Record(record)),
            (Ok(RegistryEntry::Forgotten { id, .. }), _) => self.task(seq, id.number(), Latest::Forgotten),
            (Ok(RegistryEntry::Batch(batch)), _) => {
                let mut tasks = Vec::with_capacity(batch.len());
                for Batched { id, entry } in batch {
                    let mut open = 0;
                    let latest = match tenure_protocol::decode::<RegistryEntry>(&entry) {
                        Ok(RegistryEntry::Task(record)) if record.id == id => {
                            if record.life.status.is_terminal() {
                                open = open_end(entry.len());
                            }
                            Latest::Record(record)
                        }
                        other => {
                            let why = match other {
                                Err(e) => e.to_string(),
                                Ok(_) => format!("the batch's record of {id} is not a record of {id}"),
                            };
                            tracing::error!(%subject, task = %id, error = %why, "corrupt registry record kept aside");
                            Latest::Corrupt(format!("{subject} ({id})"), why)
                        }
                    };
                    tasks.push((id.number(), open));
                    self.task(seq, id.number(), latest);
                }
                let name = subjects::is_registry_batch(subject).then(|| Arc::from(subject));
                self.batches.push((seq, name, tasks));
            }
            (Ok(RegistryEntry::Retired { .. }), _) => {}
            (Ok(RegistryEntry::Epoch(claim)), _) => {
                if self.last_claim.as_ref().is_none_or(|c| c.epoch < claim.epoch) {
                    self.last_claim = Some(claim);
                }
            }
            (Err(e), Some(n)) => self.task(seq, n, Latest::Corrupt(subject.to_owned(), e.to_string())),
            (Err(e), None) => self.corrupt.push((subject.to_owned(), e.to_string())),
        }
    }

    fn task(&mut self, seq: u64, n: u64, latest: Latest) {
        self.highest_n = self.highest_n.max(n);
        self.latest.insert(n, (seq, latest));
    }

    /// Every task's latest record (in the order of the messages holding
    /// them, a batch's by task number), the unreadable ones, and which
    /// batches still hold a latest record: those that hold none are to be
    /// retired.
    fn into_loaded(self, loaded: &mut Loaded) {
        let mut batches = Batches::default();
        for (seq, name, mut tasks) in self.batches {
            tasks.sort_unstable();
            tasks.dedup_by_key(|t| t.0);
            let live: Vec<Entry> =
                tasks.into_iter().filter(|(n, _)| self.latest.get(n).is_some_and(|l| l.0 == seq)).collect();
            match name {
                Some(name) => batches.stored(name, &live),
                // Not a subject this registry writes batches on: its records
                // count, but it is never retired (nothing else is written there).
                None => tracing::warn!(sequence = seq, "a batch on an unexpected subject is kept as it is"),
            }
        }
        // In stream order, a batch's tasks by number.
        let mut latest: Vec<(u64, u64, Latest)> = self.latest.into_iter().map(|(n, (seq, l))| (seq, n, l)).collect();
        latest.sort_unstable_by_key(|(seq, n, _)| (*seq, *n));
        loaded.corrupt = self.corrupt;
        for (_, _, l) in latest {
            match l {
                Latest::Record(record) => loaded.records.push(*record),
                Latest::Corrupt(subject, why) => loaded.corrupt.push((subject, why)),
                Latest::Forgotten => {}
            }
        }
        loaded.last_claim = self.last_claim;
        loaded.highest_n = self.highest_n;
        loaded.batches = batches;
    }
}

/// The prefix of a task's own registry subject.
const TASK_SUBJECT_PREFIX: &str = "tenure.registry.task.";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::TaskRecord;
    use tenure_protocol::TaskSpec;

    fn limits() -> StreamLimits {
        StreamLimits::new(1 << 30, 1 << 20)
    }

    fn record(n: u64) -> TaskRecord {
        let id = TaskId::new(tenure_protocol::Kind::shell(), n).unwrap();
        TaskRecord::new(id, "s".parse().unwrap(), uuid::Uuid::new_v4(), TaskSpec::shell("t", "true"), 0)
    }

    /// `r` moved to `status` in attempt `attempt`.
    fn moved(r: &TaskRecord, status: tenure_protocol::Status, attempt: u32) -> TaskRecord {
        let mut r = r.clone();
        r.life.status = status;
        r.life.attempt = tenure_protocol::Attempt(attempt);
        r
    }

    /// A deposed leader's append *k* whose predecessors were lost must not
    /// land after a new leader's claim that happens to sit at the sequence it
    /// expects.
    #[test]
    fn a_pipelined_append_never_lands_after_another_writers_message_at_its_expected_sequence() {
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let client = async_nats::connect(&nats.url).await.unwrap();
            let js = jetstream::new(client);
            let (mut old, _) = Registry::open(js.clone(), 1, limits()).await.unwrap();
            old.claim("old", Epoch(1), 0, None).await.unwrap();
            old.start_put_task(&record(1)).await.unwrap();
            old.settle().await.unwrap();
            // Append 1 of the next batch is lost (never reaches the server)…
            let lost = RegistryEntry::Task(Box::new(record(2)));
            let payload: bytes::Bytes = tenure_protocol::encode(&lost).unwrap().into();
            old.in_flight.push_back(InFlight {
                subject: subjects::registry_task(&record(2).id),
                payload,
                expected: old.last_seq,
                msg_id: format!("{}:{}", old.nonce, old.last_seq),
                after_msg_id: old.last_msg_id.clone(),
                ack: None,
                sent_as_oldest: true,
                stored: Stored::Task(2),
                pause: None,
                delay: Duration::from_millis(50),
                first_sent: tokio::time::Instant::now(),
            });
            old.started += 1;
            // …a new leader loads and claims: exactly one message lands…
            let (mut new, _) = Registry::open(js.clone(), 1, limits()).await.unwrap();
            new.claim("new", Epoch(2), 0, None).await.unwrap();
            // …and the old leader's append 2 expects exactly that sequence.
            old.start_put_task(&record(3)).await.unwrap();
            let verdict = old.settle().await;
            assert!(matches!(verdict, Err(Error::Fenced { .. })), "{verdict:?}");
            let stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let landed = stream.get_last_raw_message_by_subject(&subjects::registry_task(&record(3).id)).await;
            assert!(landed.is_err(), "the deposed leader's append landed after the new claim");
            // The new leader goes on writing.
            new.start_put_task(&record(4)).await.unwrap();
            new.settle().await.unwrap();
        });
    }

    /// The repair of a forgotten message id goes on only when the stream
    /// still ends, at the expected sequence, with our own previous message.
    /// A nats-server of the test's own, a runtime, and a JetStream context on it.
    fn nats_and_js() -> (tenure_testkit::NatsServer, tokio::runtime::Runtime, jetstream::Context) {
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let js = rt.block_on(async { jetstream::new(async_nats::connect(&nats.url).await.unwrap()) });
        (nats, rt, js)
    }

    /// Appends until everything in flight is durable.
    async fn settled(registry: &mut Registry) {
        while registry.in_flight() > 0 {
            registry.settle().await.unwrap();
        }
    }

    /// A fresh registry on `nats` with its first claim made.
    async fn claimed(js: &jetstream::Context, limits: StreamLimits) -> Registry {
        let (mut registry, _) = Registry::open(js.clone(), 1, limits).await.unwrap();
        registry.claim("test", Epoch(1), 0, None).await.unwrap();
        registry
    }

    /// The entry `subject` holds now.
    async fn entry_on(js: &jetstream::Context, subject: &str) -> RegistryEntry {
        let stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
        let msg = stream.get_last_raw_message_by_subject(subject).await.unwrap();
        tenure_protocol::decode(&msg.payload).unwrap()
    }

    /// Each task's number and status as a new leader loads them, in stream
    /// order of their latest messages.
    async fn statuses(js: &jetstream::Context) -> Vec<(u64, tenure_protocol::Status)> {
        let (_, loaded) = Registry::open(js.clone(), 1, limits()).await.unwrap();
        loaded.records.iter().map(|r| (r.id.number(), r.life.status)).collect()
    }

    /// Records as first records.
    fn firsts<'a>(records: &[&'a TaskRecord]) -> Vec<(&'a TaskRecord, Version)> {
        records.iter().map(|r| (*r, Version::First)).collect()
    }

    /// Loads the registry as a new leader would: the records' numbers and
    /// whether each is `reported`, how many batches wait to be retired.
    async fn load(js: &jetstream::Context) -> (Vec<(u64, bool)>, usize, Vec<String>) {
        let (registry, loaded) = Registry::open(js.clone(), 1, limits()).await.unwrap();
        let mut records: Vec<(u64, bool)> = loaded.records.iter().map(|r| (r.id.number(), r.reported)).collect();
        records.sort_unstable();
        (records, registry.retirable(), loaded.corrupt.into_iter().map(|(s, _)| s).collect())
    }

    /// The first records of tasks created together are one message; each
    /// task's later record supersedes its place in it; once none of its
    /// records is the latest, the batch is retired — by the leader that saw
    /// it happen, or by the next one from what it loads.
    #[test]
    fn a_batch_of_first_records_is_one_message_superseded_task_by_task_then_retired() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let mut registry = claimed(&js, limits()).await;
            let (r1, r2, r3) = (record(1), record(2), record(3));
            registry.start_put_shared(&firsts(&[&r1, &r2, &r3])).await.unwrap();
            settled(&mut registry).await;
            let batch_seq = registry.last_seq();
            assert_eq!(batch_seq, 2, "the claim, then one message for three tasks");
            let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let msg = stream.get_raw_message(batch_seq).await.unwrap();
            assert_eq!(msg.subject.as_str(), subjects::registry_batch(1), "named by its first task");
            assert_eq!(registry.mark().highest_task, 3);
            assert_eq!(load(&js).await, (vec![(1, false), (2, false), (3, false)], 0, vec![]));

            // Two tasks move on: the batch still holds the third's latest record.
            let reported = |mut r: TaskRecord| {
                r.reported = true;
                r
            };
            registry.start_put_task(&reported(r2.clone())).await.unwrap();
            registry.start_forget(&r1.id, 5).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.retirable(), 0);
            assert_eq!(load(&js).await, (vec![(2, true), (3, false)], 0, vec![]));

            // The last one moves on: the batch is dead. A leader that died
            // before retiring it leaves it to the next, which finds it dead.
            registry.start_put_task(&reported(r3.clone())).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.retirable(), 1);
            assert_eq!(load(&js).await, (vec![(2, true), (3, true)], 1, vec![]));

            let bytes_before = stream.info().await.unwrap().state.bytes;
            assert_eq!(registry.start_retire(9).await.unwrap(), Some(registry.last_ticket()));
            assert_eq!(registry.start_retire(9).await.unwrap(), None, "one batch, retired once");
            settled(&mut registry).await;
            assert_eq!(entry_on(&js, &subjects::registry_batch(1)).await, RegistryEntry::Retired { at_ms: 9 });
            assert!(stream.info().await.unwrap().state.bytes < bytes_before, "the batch's bytes are freed");
            assert_eq!(load(&js).await, (vec![(2, true), (3, true)], 0, vec![]));
        });
    }

    /// Ends share a message too, named by its first task and `ended`, with
    /// whatever else of the input may share one (a first grant here). An end
    /// there is not replaced by its task's next record on its subject, so the
    /// registry counts what that record may add, from the entry's size, until
    /// it is written — a new leader counts the same from what it loads — and
    /// the stream grows by less than that when it is.
    #[test]
    fn ends_share_a_message_and_count_what_their_next_record_may_add_until_it_is_written() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let mut registry = claimed(&js, limits()).await;
            let (r1, r2, r3) = (record(1), record(2), record(3));
            registry.start_put_shared(&firsts(&[&r1, &r2, &r3])).await.unwrap();
            use tenure_protocol::Status::{Completed, Failed, Leased};
            let (e1, e2, g3) = (moved(&r1, Completed, 1), moved(&r2, Failed, 1), moved(&r3, Leased, 1));
            let run = [(&e1, Version::End), (&e2, Version::End), (&g3, Version::FirstGrant)];
            registry.start_put_shared(&run).await.unwrap();
            settled(&mut registry).await;
            let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let msg = stream.get_raw_message(registry.last_seq()).await.unwrap();
            assert_eq!(msg.subject.as_str(), subjects::registry_end_batch(1), "named by its first task, ended");
            assert_eq!(registry.retirable(), 1, "every first record is superseded");
            let open = |r: &TaskRecord| u64::from(open_end(encode_task(r).unwrap().len()));
            assert_eq!(registry.open_ends(), open(&e1) + open(&e2), "the ends count, the grant does not");
            let reopened = |js: &jetstream::Context| {
                let js = js.clone();
                async move { Registry::open(js, 1, limits()).await.unwrap().0.open_ends() }
            };
            assert_eq!(reopened(&js).await, registry.open_ends(), "a new leader counts the same");
            assert_eq!(statuses(&js).await, [(1, Completed), (2, Failed), (3, Leased)]);

            // Task 1 is reported: its subject's next message, within what was counted.
            let before = stream.info().await.unwrap().state.bytes;
            let mut reported = e1.clone();
            reported.reported = true;
            reported.life.board = tenure_protocol::Board::Deleted;
            registry.start_put_task(&reported).await.unwrap();
            settled(&mut registry).await;
            let grew = stream.info().await.unwrap().state.bytes - before;
            assert!(grew <= open(&e1), "the stream grew by {grew}, more than the {} counted", open(&e1));
            assert_eq!(registry.open_ends(), open(&e2));
            // Task 2 is forgotten, task 3 ends on its subject: the batch is dead.
            registry.start_forget(&e2.id, 7).await.unwrap();
            registry.start_put_task(&moved(&r3, Completed, 1)).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.open_ends(), 0);
            assert_eq!(registry.retirable(), 2, "the first batch and the end batch");
            assert_eq!(reopened(&js).await, 0);
            while registry.start_retire(8).await.unwrap().is_some() {}
            settled(&mut registry).await;
            let retired = RegistryEntry::Retired { at_ms: 8 };
            assert_eq!(entry_on(&js, &subjects::registry_end_batch(1)).await, retired);
            assert_eq!(load(&js).await, (vec![(1, true), (3, false)], 0, vec![]));
        });
    }

    /// First grants share a message of their own, named by its first task
    /// and `granted`: it takes the place of their tasks' first records in
    /// the first batch, which is retired once its last task is granted; the
    /// grant batch is retired once each of its tasks has a later record.
    #[test]
    fn first_grants_share_a_message_that_supersedes_the_first_records_and_is_retired_in_turn() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let mut registry = claimed(&js, limits()).await;
            let (r1, r2, r3) = (record(1), record(2), record(3));
            registry.start_put_shared(&firsts(&[&r1, &r2, &r3])).await.unwrap();
            let granted = |r: &TaskRecord| moved(r, tenure_protocol::Status::Leased, 1);
            let (g2, g3) = (granted(&r2), granted(&r3));
            registry.start_put_shared(&[(&g2, Version::FirstGrant), (&g3, Version::FirstGrant)]).await.unwrap();
            settled(&mut registry).await;
            let stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let msg = stream.get_raw_message(registry.last_seq()).await.unwrap();
            assert_eq!(msg.subject.as_str(), subjects::registry_grant_batch(2), "named by its first task, granted");
            assert_eq!(registry.retirable(), 0, "task 1's first record is still the latest");
            use tenure_protocol::Status::{Leased, Queued};
            assert_eq!(statuses(&js).await, [(1, Queued), (2, Leased), (3, Leased)], "each task's latest");

            // Task 1's grant alone goes on its subject: the first batch is dead.
            registry.start_put_shared(&[(&granted(&r1), Version::FirstGrant)]).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.retirable(), 1);
            assert_eq!(load(&js).await.1, 1, "a new leader finds the same");
            registry.start_retire(3).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(entry_on(&js, &subjects::registry_batch(1)).await, RegistryEntry::Retired { at_ms: 3 });

            // Each granted task moves on; the grant batch goes in turn.
            let done = |mut r: TaskRecord| {
                r.life.status = tenure_protocol::Status::Completed;
                r
            };
            registry.start_put_task(&done(g2)).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.retirable(), 0);
            registry.start_put_task(&done(g3)).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.retirable(), 1);
            registry.start_retire(4).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(entry_on(&js, &subjects::registry_grant_batch(2)).await, RegistryEntry::Retired { at_ms: 4 });
            assert_eq!(load(&js).await, (vec![(1, false), (2, false), (3, false)], 0, vec![]));
            use tenure_protocol::Status::Completed;
            assert_eq!(statuses(&js).await, [(1, Leased), (2, Completed), (3, Completed)]);
        });
    }

    /// A batch is named by its first task, not by where it landed: a
    /// registry restored from a backup (its messages published again, so
    /// renumbered) still retires the right batch, and a new batch never
    /// lands on an old one's subject.
    #[test]
    fn a_restored_and_renumbered_registry_retires_the_right_batch() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let mut registry = claimed(&js, limits()).await;
            let r1 = record(1);
            registry.start_put_task(&r1).await.unwrap();
            registry.start_put_task(&TaskRecord { reported: true, ..r1 }).await.unwrap();
            let (r2, r3) = (record(2), record(3));
            registry.start_put_shared(&firsts(&[&r2, &r3])).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.last_seq(), 4, "claim, (task 1's first record, replaced), task 1, the batch");

            // Backed up, deleted and published again: the sequences close up.
            let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let config = stream.info().await.unwrap().config.clone();
            let mut backup = Vec::new();
            for seq in [1, 3, 4] {
                let msg = stream.get_raw_message(seq).await.unwrap();
                backup.push((msg.subject.to_string(), msg.payload));
            }
            js.delete_stream(subjects::REGISTRY_STREAM).await.unwrap();
            js.create_stream(config).await.unwrap();
            for (subject, payload) in backup {
                js.publish(subject, payload).await.unwrap().await.unwrap();
            }

            let (mut registry, loaded) = Registry::open(js.clone(), 1, limits()).await.unwrap();
            assert_eq!(loaded.records.len(), 3);
            registry.claim("test", Epoch(2), 0, None).await.unwrap();
            let (r4, r5) = (record(4), record(5));
            registry.start_put_shared(&firsts(&[&r4, &r5])).await.unwrap();
            registry.start_put_task(&TaskRecord { reported: true, ..r2 }).await.unwrap();
            registry.start_put_task(&TaskRecord { reported: true, ..r3 }).await.unwrap();
            settled(&mut registry).await;
            assert_eq!(registry.start_retire(7).await.unwrap(), Some(registry.last_ticket()));
            settled(&mut registry).await;
            assert_eq!(entry_on(&js, &subjects::registry_batch(2)).await, RegistryEntry::Retired { at_ms: 7 });
            let (loaded, retirable, corrupt) = load(&js).await;
            assert_eq!(loaded, vec![(1, true), (2, true), (3, true), (4, false), (5, false)]);
            assert_eq!((retirable, corrupt.len()), (0, 0), "the new batch is whole and alive");
        });
    }

    /// A batch larger than one message goes in several, each within the
    /// record limit; a record alone in its message goes on its subject.
    #[test]
    fn a_batch_is_cut_into_messages_within_the_record_limit() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let small = StreamLimits::new(1 << 30, 4096 + HEADER_ALLOWANCE);
            let mut registry = claimed(&js, small).await;
            let records: Vec<TaskRecord> = (1..=41).map(record).collect();
            let refs: Vec<&TaskRecord> = records.iter().collect();
            registry.start_put_shared(&firsts(&refs)).await.unwrap();
            settled(&mut registry).await;
            let stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let messages = registry.last_seq() - 1;
            assert!(messages > 2 && messages < 41, "{messages} messages for 41 records of ~300 bytes in 4 KiB");
            for seq in 2..=registry.last_seq() {
                let msg = stream.get_raw_message(seq).await.unwrap();
                assert!(msg.payload.len() <= 4096, "message {seq} is {} bytes", msg.payload.len());
            }
            let (loaded, retirable, corrupt) = load(&js).await;
            assert_eq!(loaded, (1..=41).map(|n| (n, false)).collect::<Vec<_>>());
            assert_eq!((retirable, corrupt.len()), (0, 0));
            // One record alone: on its own subject.
            let one = record(42);
            registry.start_put_shared(&firsts(&[&one])).await.unwrap();
            settled(&mut registry).await;
            let last = stream.get_raw_message(registry.last_seq()).await.unwrap();
            assert_eq!(last.subject.as_str(), subjects::registry_task(&one.id));
        });
    }

    /// An unreadable record in a batch is reported under its task and never
    /// stands in for the task; the batch's other records load; a later
    /// record of that task on its subject is its truth.
    #[test]
    fn an_unreadable_record_in_a_batch_is_reported_and_a_later_one_supersedes_it() {
        let (_nats, rt, js) = nats_and_js();
        rt.block_on(async {
            let registry = claimed(&js, limits()).await;
            let good = |n: u64| Batched {
                id: record(n).id,
                entry: tenure_protocol::encode(&RegistryEntry::Task(Box::new(record(n)))).unwrap(),
            };
            let batch = RegistryEntry::Batch(vec![
                good(1),
                Batched { id: record(2).id, entry: b"not a record".to_vec() },
                Batched { id: record(3).id, entry: good(4).entry },
            ]);
            let seq = registry.last_seq() + 1;
            let payload = tenure_protocol::encode(&batch).unwrap();
            js.publish(subjects::registry_batch(seq), payload.into()).await.unwrap().await.unwrap();
            let (loaded, _, corrupt) = load(&js).await;
            assert_eq!(loaded, vec![(1, false)], "only the readable record of its own task");
            assert_eq!(corrupt.len(), 2, "{corrupt:?}");
            assert!(corrupt.iter().all(|s| s.starts_with(&subjects::registry_batch(seq))), "{corrupt:?}");
            let (mut registry, _) = Registry::open(js.clone(), 1, limits()).await.unwrap();
            registry.claim("test", Epoch(2), 0, None).await.unwrap();
            registry.start_put_task(&record(2)).await.unwrap();
            settled(&mut registry).await;
            let (loaded, _, corrupt) = load(&js).await;
            assert_eq!(loaded, vec![(1, false), (2, false)]);
            assert_eq!(corrupt.len(), 1, "task 3's record is still unreadable: {corrupt:?}");
        });
    }

    #[test]
    fn a_forgotten_message_id_is_repaired_only_when_the_last_message_is_ours() {
        assert!(forgot_our_id(7, Some("me:6"), 7, Some("me:6")));
        assert!(!forgot_our_id(7, Some("me:6"), 8, Some("other:7")), "another writer appended");
        assert!(!forgot_our_id(7, Some("me:6"), 7, Some("other:6")), "another writer's message sits there");
        assert!(!forgot_our_id(7, Some("me:6"), 7, None));
        assert!(!forgot_our_id(7, None, 7, None), "nothing was expected: the refusal is someone else's");
        assert!(!forgot_our_id(7, Some("me:6"), 6, Some("me:6")), "the stream went back");
    }

    /// A registry stream created before it was bounded gets its limits when
    /// opened; the byte limit in force is reported.
    #[test]
    fn an_existing_stream_is_bounded_when_opened() {
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let client = async_nats::connect(&nats.url).await.unwrap();
            let js = jetstream::new(client);
            js.create_stream(stream::Config {
                name: subjects::REGISTRY_STREAM.to_owned(),
                subjects: vec![subjects::REGISTRY_ALL.to_owned()],
                max_messages_per_subject: 1,
                discard: stream::DiscardPolicy::Old,
                ..Default::default()
            })
            .await
            .unwrap();
            let (_, loaded) = Registry::open(js.clone(), 1, StreamLimits::new(100 << 20, 1 << 20)).await.unwrap();
            assert_eq!(loaded.max_bytes, 100 << 20);
            let mut stream = js.get_stream(subjects::REGISTRY_STREAM).await.unwrap();
            let config = stream.info().await.unwrap().config.clone();
            assert_eq!(config.max_bytes, 100 << 20);
            assert_eq!(config.discard, stream::DiscardPolicy::New, "old records are never dropped to make room");
            assert_eq!(config.max_consumers, MAX_CONSUMERS);
            assert_eq!(config.max_message_size, (tenure_protocol::MAX_MESSAGE_BYTES + HEADER_ALLOWANCE) as i32);
            assert_eq!(record_limit(1 << 20), tenure_protocol::MAX_MESSAGE_BYTES);
            assert_eq!(record_limit(64 << 10), (64 << 10) - HEADER_ALLOWANCE);
        });
    }
}
