//! `tenure watch`: terminal notices of one session's tasks that no other
//! surface reported, each shown once, and the matched lines of its `monitor`
//! tasks, resuming where the last watch stopped.
//!
//! It reads the JetStream notice stream through a durable consumer named after
//! the session (so a restarted watch, or one after a coordinator failover,
//! continues from its last acknowledged notice). Before showing a notice it asks
//! the leader whether the task was reported meanwhile (by `wait`, `kill`, a
//! finished `logs`, or another watch); if not, it marks it reported, shows it and
//! acknowledges. A task is therefore shown at most once per session; it can be
//! missed only if the watch dies between marking and printing.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use tenure_protocol::messages::{ApiError, ApiReply, ApiRequest, ApiResponse, MatchNotice, Notice, TaskSnapshot};
use tenure_protocol::{subjects, SessionId};

/// The durable consumer of a session: stable across versions and machines, and
/// a valid consumer name whatever characters the session holds.
pub fn consumer_name(session: &SessionId) -> String {
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, session.as_str().as_bytes());
    format!("watch-{}", id.simple())
}

pub async fn watch(client: async_nats::Client, session: SessionId, once: bool, json: bool) -> anyhow::Result<ExitCode> {
    let js = jetstream::new(client.clone());
    let stream = loop {
        match js.get_stream(subjects::NOTICES_STREAM).await {
            Ok(s) => break s,
            Err(_) if !once => tokio::time::sleep(Duration::from_secs(1)).await,
            Err(e) => return Err(e).context("the notice stream does not exist yet (no coordinator has led)"),
        }
    };
    let name = consumer_name(&session);
    let consumer: consumer::PullConsumer = stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: subjects::notices(&session),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .await
        .context("opening this session's notice consumer")?;
    loop {
        let mut batch = consumer
            .fetch()
            .max_messages(64)
            .expires(Duration::from_secs(1))
            .messages()
            .await
            .context("reading notices")?;
        let mut any = false;
        while let Some(msg) = batch.next().await {
            let msg = msg.map_err(|e| anyhow::anyhow!("reading a notice: {e}"))?;
            any = true;
            match tenure_protocol::decode::<Notice>(&msg.payload) {
                Ok(Notice::Ended(notice)) => {
                    if let Some(snapshot) = claim(&client, &session, &notice).await? {
                        show(&snapshot, json)?;
                    }
                }
                // A matched line is shown once per session: the durable
                // consumer's acknowledgement is what remembers it.
                Ok(Notice::Matched(m)) => show_match(&m, json)?,
                Err(error) => tracing::warn!(%error, "malformed notice skipped"),
            }
            msg.ack().await.map_err(|e| anyhow::anyhow!("acknowledging a notice: {e}"))?;
        }
        if once && !any {
            return Ok(ExitCode::SUCCESS);
        }
    }
}

/// Marks the task reported unless something else reported it first; returns
/// the snapshot to show, or `None` to skip the notice.
async fn claim(
    client: &async_nats::Client,
    session: &SessionId,
    notice: &TaskSnapshot,
) -> anyhow::Result<Option<TaskSnapshot>> {
    let get = ApiRequest::Get { session: session.clone(), task: notice.id.clone() };
    let current = match call(client, &get).await? {
        Ok(ApiResponse::Snapshot(s)) => s,
        // Deleted or garbage-collected meanwhile: nothing to show.
        Err(ApiError::NotFound(_)) => return Ok(None),
        other => anyhow::bail!("unexpected reply {other:?}"),
    };
    if current.reported {
        return Ok(None);
    }
    let mark = ApiRequest::MarkReported { session: session.clone(), task: notice.id.clone() };
    match call(client, &mark).await? {
        Ok(ApiResponse::Snapshot(s)) => Ok(Some(s)),
        Err(ApiError::NotFound(_)) => Ok(None),
        other => anyhow::bail!("unexpected reply {other:?}"),
    }
}

/// One API call, riding through a leader change for a while.
async fn call(client: &async_nats::Client, req: &ApiRequest) -> anyhow::Result<ApiReply> {
    let mut last = None;
    for _ in 0..40 {
        match tenure_transport::request(client, subjects::API.to_owned(), req, Duration::from_secs(5)).await {
            Ok(reply) => return Ok(reply),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(last.map(anyhow::Error::from).unwrap_or_else(|| anyhow::anyhow!("no coordinator answered")))
}

fn show(s: &TaskSnapshot, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
    } else {
        let exit = s.exit_code.map(|c| format!(" exit {c}")).unwrap_or_default();
        let detail = s.detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default();
        println!("{} {}{exit}{detail}  {}", s.id, s.status, s.label);
    }
    Ok(())
}

fn show_match(m: &MatchNotice, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&Notice::Matched(m.clone()))?);
    } else {
        println!("{} matched at {}: {}", m.task, m.line.offset, m.line.text);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_are_valid_and_distinct() {
        let a = consumer_name(&"alice".parse().unwrap());
        let b = consumer_name(&"a.b*>c".parse().unwrap());
        assert_ne!(a, b);
        for n in [&a, &b] {
            assert!(n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'), "{n}");
        }
        assert_eq!(a, consumer_name(&"alice".parse().unwrap()));
    }
}
