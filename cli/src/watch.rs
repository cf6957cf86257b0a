//! `tenure watch`: terminal notices of one session's tasks that no other
//! surface reported, each shown once, and the matched lines of its `monitor`
//! tasks, resuming where the last watch stopped.
//!
//! The leader reads the notice stream for it (`ApiRequest::Notices`) through
//! the durable consumer it keeps for the caller's owner, so a restarted watch,
//! or one after a coordinator failover, continues from its last acknowledged
//! notice, and a client never touches JetStream. Before showing an end notice
//! it asks the leader whether the task was reported meanwhile (by `wait`,
//! `kill`, a finished `logs`, or another watch); if not, it marks it reported
//! and shows it. The notices of a batch are acknowledged with the next request,
//! sent as soon as the batch is shown: a task is shown at most once per
//! session, and a matched line is shown again only if the watch dies between
//! showing it and that request.

use std::process::ExitCode;
use std::time::Duration;

use tenure_client::{Client, Policy};
use tenure_protocol::messages::{ApiError, ApiReply, ApiRequest, ApiResponse, MatchNotice, Notice, TaskSnapshot};
use tenure_protocol::SessionId;

use crate::text::printable;

/// How long one request waits for a first notice.
const WAIT_MS: u64 = 2_000;

/// The watch's requests ride out a leader change under the client's rule:
/// for 30 s, a try every 500 ms.
const WATCH: Policy = Policy {
    overall: Duration::from_secs(30),
    first_pause: Duration::from_millis(500),
    max_pause: Duration::from_millis(500),
    per_try: Duration::from_secs(5),
    through_registry_behind: false,
};

pub async fn watch(client: &Client, once: bool, json: bool) -> anyhow::Result<ExitCode> {
    let session = client.session().clone();
    let mut acks: Vec<String> = Vec::new();
    loop {
        let wait_ms = if once { 0 } else { WAIT_MS };
        let req = ApiRequest::Notices { session: session.clone(), acks: std::mem::take(&mut acks), max: 64, wait_ms };
        let items = match call(client, &req).await? {
            Ok(ApiResponse::Notices(items)) => items,
            Err(e) => anyhow::bail!("reading notices: {e}"),
            Ok(other) => anyhow::bail!("unexpected reply {other:?}"),
        };
        if once && items.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
        for item in items {
            match &item.notice {
                Notice::Ended(notice) => {
                    if let Some(snapshot) = claim(client, &session, notice).await? {
                        show(&snapshot, json)?;
                    }
                }
                // A matched line is shown once per session: the durable
                // consumer's acknowledgement is what remembers it.
                Notice::Matched(m) => show_match(m, json)?,
            }
            acks.push(item.ack);
        }
    }
}

/// Marks the task reported unless something else reported it first; returns
/// the snapshot to show, or `None` to skip the notice.
async fn claim(client: &Client, session: &SessionId, notice: &TaskSnapshot) -> anyhow::Result<Option<TaskSnapshot>> {
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

/// One API call under [`WATCH`]; a coordinator's refusal is returned as the reply.
async fn call(client: &Client, req: &ApiRequest) -> anyhow::Result<ApiReply> {
    match client.request(req, &WATCH).await {
        Ok(reply) => Ok(Ok(reply)),
        Err(tenure_client::Error::Api(refusal)) => Ok(Err(refusal)),
        Err(e) => Err(e.into()),
    }
}

fn show(s: &TaskSnapshot, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
    } else {
        let exit = s.exit_code.map(|c| format!(" exit {c}")).unwrap_or_default();
        let detail = s.detail.as_deref().map(|d| format!(" ({})", printable(d))).unwrap_or_default();
        let reason = s.kill_reason.as_deref().map(|r| format!(" [kill reason: {}]", printable(r))).unwrap_or_default();
        println!("{} {}{exit}{detail}{reason}  {}", s.id, s.status, printable(&s.label));
    }
    Ok(())
}

fn show_match(m: &MatchNotice, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&Notice::Matched(m.clone()))?);
    } else {
        println!("{} matched at {}: {}", m.task, m.line.offset, printable(&m.line.text));
    }
    Ok(())
}
