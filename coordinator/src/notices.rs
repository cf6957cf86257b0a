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
//! One task sends a term's notices, in the order the leader made them (a
//! `monitor`'s matched line before its end), each without waiting for the
//! one before it to be acknowledged; only a notice that had to be sent again
//! after a failure may land out of that order.
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
    /// To the task that publishes them in order ([`publish_in_order`]); it
    /// ends once every `Notices` of the term is gone and what it sent is
    /// acknowledged or given up.
    outbox: tokio::sync::mpsc::UnboundedSender<Notice>,
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
        let (outbox, queue) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(publish_in_order(js.clone(), queue));
        Ok(Notices { js, outbox })
    }

    /// Publishes in the background, after the notices handed over before it,
    /// retrying for a while through an outage.
    pub fn publish(&self, notice: Notice) {
        if self.outbox.send(notice).is_err() {
            tracing::error!("the notice publisher is gone; the next leader republishes unreported ends");
        }
    }
}

/// Sends each notice of `queue` as it comes, in order, and waits for the
/// acknowledgements beside the next sends. A notice not acknowledged is
/// sent again (same message id) a few times, with a growing pause.
async fn publish_in_order(js: jetstream::Context, mut queue: tokio::sync::mpsc::UnboundedReceiver<Notice>) {
    let mut pending = futures::stream::FuturesUnordered::new();
    loop {
        tokio::select! {
            notice = queue.recv() => match notice {
                Some(notice) => {
                    if let Some(first) = send(&js, notice).await {
                        pending.push(acknowledged(js.clone(), first));
                    }
                }
                None => break,
            },
            Some(()) = pending.next(), if !pending.is_empty() => {}
        }
    }
    while pending.next().await.is_some() {}
}

/// One notice on its way: what it is, and its first send.
struct Sent {
    notice: Encoded,
    first: Result<jetstream::context::PublishAckFuture, String>,
}

/// A notice as it is published: its dedupe id, subject and bytes.
struct Encoded {
    id: String,
    subject: String,
    payload: bytes::Bytes,
}

impl Encoded {
    /// Sends it once (a resend carries the same message id).
    async fn send(&self, js: &jetstream::Context) -> Result<jetstream::context::PublishAckFuture, String> {
        let publish =
            jetstream::message::PublishMessage::build().payload(self.payload.clone()).message_id(self.id.clone());
        js.send_publish(self.subject.clone(), publish).await.map_err(|e| e.to_string())
    }
}

/// Encodes and sends `notice` once; `None` if it cannot be encoded.
async fn send(js: &jetstream::Context, notice: Notice) -> Option<Sent> {
    let id = notice.dedupe_id();
    let payload: bytes::Bytes = match tenure_protocol::encode(&notice) {
        Ok(b) => b.into(),
        Err(error) => {
            tracing::error!(notice = %id, %error, "notice cannot be encoded");
            return None;
        }
    };
    let notice = Encoded { id, subject: subjects::notices(notice.owner()), payload };
    let first = notice.send(js).await;
    Some(Sent { notice, first })
}

/// Waits for a sent notice's acknowledgement, sending it again after a
/// failure, up to 8 tries in all.
async fn acknowledged(js: jetstream::Context, sent: Sent) {
    let Sent { notice, first } = sent;
    let id = &notice.id;
    let mut attempt = Some(first);
    let mut delay = Duration::from_millis(100);
    for _ in 0..8 {
        let sent = match attempt.take() {
            Some(first) => first,
            None => notice.send(&js).await,
        };
        let acked = match sent {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e),
        };
        match acked {
            Ok(()) => return,
            Err(error) => tracing::warn!(notice = %id, %error, "notice not published yet; retrying"),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
    tracing::error!(notice = %id, "notice not published; the next leader republishes an end notice if still unreported");
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

    /// Notices land in the stream in the order the leader handed them over,
    /// each sent without waiting for the one before it.
    #[test]
    fn notices_land_in_the_order_they_were_made() {
        use tenure_protocol::messages::{MatchNotice, MatchedLine};
        let nats = tenure_testkit::NatsServer::start().expect("nats-server");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let js = jetstream::new(async_nats::connect(&nats.url).await.unwrap());
            let notices = Notices::open(js.clone(), 1, NoticeLimits::default()).await.unwrap();
            let owner: SessionId = "alice/s1".parse().unwrap();
            let task: tenure_protocol::TaskId = "monitor-7".parse().unwrap();
            let count = 300u64;
            for offset in 0..count {
                let line = MatchedLine::new(offset, "ERROR");
                let notice =
                    MatchNotice { task: task.clone(), owner: owner.clone(), label: "m".into(), line, at_ms: 0 };
                notices.publish(Notice::Matched(notice));
            }
            let mut stream = js.get_stream(subjects::NOTICES_STREAM).await.unwrap();
            let mut stored = 0;
            for _ in 0..200 {
                stored = stream.info().await.unwrap().state.messages;
                if stored == count {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(stored, count, "every notice stored once");
            for seq in 1..=count {
                let msg = stream.get_raw_message(seq).await.unwrap();
                let Ok(Notice::Matched(m)) = tenure_protocol::decode::<Notice>(&msg.payload) else { panic!("{seq}") };
                assert_eq!(m.line.offset, seq - 1, "stored in the order made");
            }
        });
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
