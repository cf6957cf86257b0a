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

use tenure_client::notices::NOTICES as WATCH;
use tenure_client::Client;
use tenure_protocol::messages::{MatchNotice, Notice, TaskSnapshot};

use crate::text::printable;

/// How long one request waits for a first notice.
const WAIT_MS: u64 = 2_000;

pub async fn watch(client: &Client, once: bool, json: bool) -> anyhow::Result<ExitCode> {
    let mut acks: Vec<String> = Vec::new();
    loop {
        let wait_ms = if once { 0 } else { WAIT_MS };
        let items = client
            .notices(std::mem::take(&mut acks), 64, wait_ms, &WATCH)
            .await
            .map_err(|e| anyhow::anyhow!("reading notices: {e}"))?;
        if once && items.is_empty() {
            return Ok(ExitCode::SUCCESS);
        }
        for item in items {
            match &item.notice {
                // Shown only if nothing else reported the task, which it then is.
                Notice::Ended(notice) => {
                    if let Some(snapshot) = client.claim_ended(&notice.id, &WATCH).await? {
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
