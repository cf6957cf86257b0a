//! Notices: one message per task that ended, carrying its snapshot, and one
//! per matched output line of a `monitor` task, on the JetStream stream
//! `TENURE_NOTICES` under the owner's subject, so a `tenure watch` of that
//! session can resume where it stopped, across watcher restarts and
//! coordinator failovers.
//!
//! Publishing is best effort and never blocks the leader's loop; every notice
//! carries `Nats-Msg-Id = <task id>` (`<task id>@<offset>` for a match), so repeats (a retry, a new leader
//! republishing unreported tasks) are dropped by the stream within its
//! duplicate window, and watchers skip tasks already `reported` beyond it.
//!
//! Clients never touch the stream: the leader reads it for them
//! ([`Notices::serve`]) through one durable consumer per owner that only it
//! defines, so no client can create consumers, read or acknowledge another
//! owner's notices, or reach JetStream at all.
//! **Bounded.** The stream keeps notices for a week, at most
//! [`NoticeLimits::max_bytes`] of them (the oldest are dropped first: a
//! notice is a convenience, the registry is the truth), no message above the
//! codec's limit, and at most [`NoticeLimits::max_consumers`] consumers (one
//! durable consumer per watching session): past it a new watcher is refused
//! by the server instead of the stream growing without bound. Limits are
//! applied to an existing stream when it is opened.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use tenure_protocol::messages::{
    ApiError, ApiReply, ApiResponse, Notice, NoticeItem, MAX_NOTICES, MAX_NOTICE_ACKS, MAX_NOTICE_WAIT_MS,
};
use tenure_protocol::{subjects, SessionId};

/// How long the stream remembers message ids for deduplication.
const DEDUPE_WINDOW: Duration = Duration::from_secs(3600);
/// How long a notice waits for a watcher before the stream drops it.
const KEEP_NOTICES: Duration = Duration::from_secs(7 * 24 * 3600);

/// The notice stream's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoticeLimits {
    /// Bytes of notices kept; past them the oldest are dropped.
    pub max_bytes: u64,
    /// Consumers (watching sessions) the stream allows.
    pub max_consumers: u32,
}

impl Default for NoticeLimits {
    fn default() -> Self {
        NoticeLimits { max_bytes: 256 << 20, max_consumers: 4096 }
    }
}

#[derive(Clone)]
pub struct Notices {
    js: jetstream::Context,
}

impl Notices {
    /// Creates the stream if needed, applying `limits` to an existing one.
    pub async fn open(js: jetstream::Context, replicas: usize, limits: NoticeLimits) -> Result<Notices, String> {
        let bounded = |mut config: stream::Config| {
            config.max_bytes = i64::try_from(limits.max_bytes).unwrap_or(i64::MAX);
            config.max_consumers = i32::try_from(limits.max_consumers).unwrap_or(i32::MAX);
            config.max_message_size = i32::try_from(tenure_protocol::MAX_MESSAGE_BYTES).unwrap_or(i32::MAX);
            config.discard = stream::DiscardPolicy::Old;
            config
        };
        let mut stream = js
            .get_or_create_stream(bounded(stream::Config {
                name: subjects::NOTICES_STREAM.to_owned(),
                subjects: vec![subjects::NOTICES_ALL.to_owned()],
                storage: stream::StorageType::File,
                num_replicas: replicas.max(1),
                duplicate_window: DEDUPE_WINDOW,
                max_age: KEEP_NOTICES,
                ..Default::default()
            }))
            .await
            .map_err(|e| e.to_string())?;
        let config = stream.info().await.map_err(|e| e.to_string())?.config.clone();
        if bounded(config.clone()) != config {
            if let Err(error) = js.update_stream(bounded(config)).await {
                tracing::warn!(%error, "the notice stream's limits could not be applied; keeping its own");
            }
        }
        Ok(Notices { js })
    }

    /// Publishes in the background, retrying for a while through an outage.
    pub fn publish(&self, notice: Notice) {
        let js = self.js.clone();
        tokio::spawn(async move {
            let id = notice.dedupe_id();
            let payload: bytes::Bytes = match tenure_protocol::encode(&notice) {
                Ok(b) => b.into(),
                Err(error) => return tracing::error!(notice = %id, %error, "notice cannot be encoded"),
            };
            let subject = subjects::notices(notice.owner());
            let mut delay = Duration::from_millis(100);
            for _ in 0..8 {
                let publish =
                    jetstream::message::PublishMessage::build().payload(payload.clone()).message_id(id.clone());
                let acked = match js.send_publish(subject.clone(), publish).await {
                    Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                match acked {
                    Ok(()) => return,
                    Err(error) => tracing::warn!(notice = %id, %error, "notice not published yet; retrying"),
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            tracing::error!(notice = %id, "notice not published; the next leader republishes an end notice if still unreported");
        });
    }
}

/// How long a delivered notice waits for its acknowledgement before the
/// stream delivers it again.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// Notices delivered and not yet acknowledged, per owner.
const MAX_ACK_PENDING: i64 = 1024;

impl Notices {
    /// Serves one `Notices` request of `owner` (already authenticated by the
    /// driver): acknowledges the tokens of `owner`'s own consumer (any other
    /// token is refused, so no one acknowledges — and hides — another owner's
    /// notices), then reads up to `max` notices from the durable consumer the
    /// leader keeps for `owner`, waiting at most `wait` for the first.
    pub async fn serve(&self, owner: &SessionId, acks: &[String], max: u32, wait: Duration) -> ApiReply {
        let name = subjects::notice_consumer(owner);
        if acks.len() > MAX_NOTICE_ACKS {
            return Err(ApiError::InvalidRequest(format!("at most {MAX_NOTICE_ACKS} acknowledgements per request")));
        }
        let prefix = subjects::notice_ack_prefix(&name);
        if let Some(bad) = acks.iter().find(|a| !is_ack_of(a, &prefix)) {
            return Err(ApiError::InvalidRequest(format!(
                "{:?} is not an acknowledgement of one of your notices",
                bad.chars().take(80).collect::<String>()
            )));
        }
        let unavailable = |what: &str, e: &dyn std::fmt::Display| ApiError::Unavailable(format!("{what}: {e}"));
        let client = self.js.client();
        for ack in acks {
            client.publish(ack.clone(), "+ACK".into()).await.map_err(|e| unavailable("acknowledging", &e))?;
        }
        if max == 0 {
            // Acknowledgements only: make sure they reached the server first.
            client.flush().await.map_err(|e| unavailable("acknowledging", &e))?;
            return Ok(ApiResponse::Notices(Vec::new()));
        }
        let stream =
            self.js.get_stream(subjects::NOTICES_STREAM).await.map_err(|e| unavailable("notice stream", &e))?;
        let consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                &name,
                consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    filter_subject: subjects::notices(owner),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: ACK_WAIT,
                    max_ack_pending: MAX_ACK_PENDING,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable("notice consumer", &e))?;
        let max = max.min(MAX_NOTICES) as usize;
        let batch = if wait.is_zero() {
            consumer.fetch().max_messages(max).messages().await
        } else {
            consumer.batch().max_messages(max).expires(wait.min(MAX_WAIT)).messages().await
        };
        let mut batch = batch.map_err(|e| unavailable("reading notices", &e))?;
        let mut items = Vec::new();
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| unavailable("reading notices", &e))?;
            let Some(ack) = msg.reply.as_ref().map(|r| r.to_string()) else { continue };
            match tenure_protocol::decode::<Notice>(&msg.payload) {
                Ok(notice) if notice.owner() == owner => items.push(NoticeItem { ack, notice }),
                // Not this owner's (it cannot be, by the filter) or unreadable:
                // acknowledged so it never blocks the consumer, and logged.
                other => {
                    tracing::warn!(consumer = %name, ok = other.is_ok(), "notice skipped: unreadable or not this owner's");
                    let _ = client.publish(ack, "+ACK".into()).await;
                }
            }
        }
        Ok(ApiResponse::Notices(items))
    }
}

/// Longest a `Notices` request waits.
const MAX_WAIT: Duration = Duration::from_millis(MAX_NOTICE_WAIT_MS);

/// Whether `token` acknowledges a delivery of the consumer whose prefix is
/// `prefix`: that prefix, then the delivery's tokens (no wildcard, no space).
fn is_ack_of(token: &str, prefix: &str) -> bool {
    token.len() <= 256
        && token.strip_prefix(prefix).is_some_and(|rest| {
            !rest.is_empty() && rest.split('.').all(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_acknowledgements_of_the_owners_consumer_are_taken() {
        let alice = subjects::notice_ack_prefix(&subjects::notice_consumer(&"alice/s".parse().unwrap()));
        let bob = subjects::notice_ack_prefix(&subjects::notice_consumer(&"bob/s".parse().unwrap()));
        let token = format!("{alice}1.7.3.1764587000000000000.0");
        assert!(is_ack_of(&token, &alice));
        assert!(!is_ack_of(&token, &bob));
        for bad in
            [alice.clone(), format!("{alice}>"), format!("{alice}1.*"), format!("{alice}1..2"), format!("{alice}1 2")]
        {
            assert!(!is_ack_of(&bad, &alice), "{bad}");
        }
        assert!(!is_ack_of("$JS.API.STREAM.PURGE.TENURE_REGISTRY", &alice));
    }

    /// The notice stream is bounded in bytes and consumers, also when it
    /// existed before it was bounded.
    #[test]
    fn the_notice_stream_is_bounded_in_bytes_and_consumers() {
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let js = jetstream::new(async_nats::connect(&nats.url).await.unwrap());
            js.create_stream(stream::Config {
                name: subjects::NOTICES_STREAM.to_owned(),
                subjects: vec![subjects::NOTICES_ALL.to_owned()],
                ..Default::default()
            })
            .await
            .unwrap();
            let limits = NoticeLimits { max_bytes: 8 << 20, max_consumers: 2 };
            Notices::open(js.clone(), 1, limits).await.unwrap();
            let mut stream = js.get_stream(subjects::NOTICES_STREAM).await.unwrap();
            let config = stream.info().await.unwrap().config.clone();
            assert_eq!((config.max_bytes, config.max_consumers), (8 << 20, 2));
            // Past the consumer limit a new watcher is refused by the server.
            for name in ["a", "b"] {
                let durable = async_nats::jetstream::consumer::pull::Config {
                    durable_name: Some(name.into()),
                    ..Default::default()
                };
                stream.create_consumer(durable).await.unwrap();
            }
            let third =
                async_nats::jetstream::consumer::pull::Config { durable_name: Some("c".into()), ..Default::default() };
            assert!(stream.create_consumer(third).await.is_err());
        });
    }
}
