//! The task registry in JetStream: one stream, one subject per task holding its
//! latest record (`max_messages_per_subject = 1`), plus leadership claims.
//!
//! **Fencing in storage.** Every append is conditional on the stream's last
//! sequence (`Nats-Expected-Last-Sequence`). The leader is the only writer, so it
//! knows that sequence; a new leader's claim moves it, after which every append
//! of a deposed leader fails with [`Error::Fenced`] — whatever the deposed leader
//! believes about its lease. The leader lease (`lease.rs`) decides who *should*
//! write; this fence is what makes a stale writer *unable* to. Retries of one append reuse its `Nats-Msg-Id` (a
//! per-process nonce and the expected sequence), so a write whose ack was lost is
//! deduplicated instead of being mistaken for fencing; JetStream checks ids before
//! sequences, which is why ids must never collide across coordinators.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, context::PublishErrorKind, stream};
use futures::StreamExt;
use tenure_protocol::{subjects, Epoch, TaskId};

use crate::record::{EpochClaim, RegistryEntry, TaskRecord};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another coordinator wrote to the registry: this one is no longer leader.
    #[error("registry fenced: another coordinator wrote after sequence {expected}")]
    Fenced { expected: u64 },
    #[error("registry unavailable: {0}")]
    Unavailable(String),
    #[error("cannot encode registry entry: {0}")]
    Encode(String),
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
}

pub struct Registry {
    js: jetstream::Context,
    last_seq: u64,
    epoch: Epoch,
    /// Unique per process: message ids of two coordinators never collide, so
    /// deduplication can only ever match this process's own retries.
    nonce: uuid::Uuid,
}

/// How long one append keeps retrying through a NATS outage before giving up.
const APPEND_RETRY_FOR: Duration = Duration::from_secs(30);

impl Registry {
    /// Creates the stream if needed and loads every record.
    pub async fn open(js: jetstream::Context, replicas: usize) -> Result<(Registry, Loaded), Error> {
        let unavailable = |e: &dyn std::fmt::Display| Error::Unavailable(e.to_string());
        let mut stream = js
            .get_or_create_stream(stream::Config {
                name: subjects::REGISTRY_STREAM.to_owned(),
                subjects: vec![subjects::REGISTRY_ALL.to_owned()],
                max_messages_per_subject: 1,
                storage: stream::StorageType::File,
                num_replicas: replicas.max(1),
                discard: stream::DiscardPolicy::Old,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&e))?;
        let state = stream.info().await.map_err(|e| unavailable(&e))?.state.clone();
        let mut loaded = Loaded::default();
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
                load_one(&mut loaded, msg.subject.as_str(), &msg.payload);
                if seq >= state.last_sequence {
                    break;
                }
            }
        }
        let epoch = loaded.last_claim.as_ref().map(|c| c.epoch).unwrap_or_default();
        Ok((Registry { js, last_seq: state.last_sequence, epoch, nonce: uuid::Uuid::new_v4() }, loaded))
    }

    /// Claims the next epoch, and at least `at_least` (the epoch of the leader
    /// lease just won, so that lease and registry agree): appends a claim
    /// conditional on the sequence this coordinator loaded. Fails with
    /// [`Error::Fenced`] if anyone wrote since; the caller loads again.
    pub async fn claim(&mut self, by: &str, at_least: Epoch, now_ms: u64) -> Result<Epoch, Error> {
        let epoch = self.epoch.next().max(at_least);
        let claim = EpochClaim { epoch, by: by.to_owned(), at_ms: now_ms };
        self.append(subjects::REGISTRY_EPOCH.to_owned(), &RegistryEntry::Epoch(claim)).await?;
        self.epoch = epoch;
        Ok(epoch)
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Durably stores the latest version of a task.
    pub async fn put_task(&mut self, record: &TaskRecord) -> Result<(), Error> {
        let entry = RegistryEntry::Task(Box::new(record.clone()));
        self.append(subjects::registry_task(&record.id), &entry).await
    }

    /// Compacts a garbage-collected task's record to a tombstone (conditional,
    /// like every append: a deposed leader cannot forget anything).
    pub async fn forget(&mut self, id: &TaskId, at_ms: u64) -> Result<(), Error> {
        let entry = RegistryEntry::Forgotten { id: id.clone(), at_ms };
        self.append(subjects::registry_task(id), &entry).await
    }

    async fn append(&mut self, subject: String, entry: &RegistryEntry) -> Result<(), Error> {
        let payload: bytes::Bytes = tenure_protocol::encode(entry).map_err(|e| Error::Encode(e.to_string()))?.into();
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
        Ok(())
    }
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

fn load_one(loaded: &mut Loaded, subject: &str, payload: &[u8]) {
    if let Some(id) = subject.strip_prefix("tenure.registry.task.") {
        if let Ok(id) = id.parse::<TaskId>() {
            loaded.highest_n = loaded.highest_n.max(id.number());
        }
    }
    match tenure_protocol::decode::<RegistryEntry>(payload) {
        Ok(RegistryEntry::Task(record)) => {
            loaded.highest_n = loaded.highest_n.max(record.id.number());
            loaded.records.push(*record);
        }
        Ok(RegistryEntry::Forgotten { id, .. }) => {
            loaded.highest_n = loaded.highest_n.max(id.number());
        }
        Ok(RegistryEntry::Epoch(claim)) => {
            if loaded.last_claim.as_ref().is_none_or(|c| c.epoch < claim.epoch) {
                loaded.last_claim = Some(claim);
            }
        }
        Err(e) => {
            tracing::error!(%subject, error = %e, "corrupt registry record kept aside");
            loaded.corrupt.push((subject.to_owned(), e.to_string()));
        }
    }
}
