//! How the MCP tools tell the caller, once, of its tasks that ended and of
//! its monitors' matched lines: as `notifications/message` log messages
//! where the client asked for them, and otherwise in the [`News`] of every
//! tool result.
//!
//! **With a call** ([`Reporter::tell`]): a request that opts in to log
//! messages at `notice` or below (the `io.modelcontextprotocol/logLevel` of
//! its `_meta`, MCP 2026-07-28's per-request logging, over stdio or HTTP)
//! gets its news as log messages sent before its result, whose lists are
//! then empty. **Pushed** ([`Reporter::start_pushing`]): on a handshake-era
//! session that lives as long as its connection (stdio) and whose client
//! sent `logging/setLevel` at `notice` or below, one task reads the caller's
//! notices from the durable consumer the leader keeps for its owner (as
//! `tenure watch` does, through `tenure_client::notices`), claims each end
//! (shown only if nothing reported the task, which it then is) and sends
//! it, and sends each matched line; the notices are acknowledged with the
//! next read. **In results** ([`Reporter::news`]): every result lists the
//! ended tasks nothing reported (listing reports them) and, while nothing
//! pushes, the matched lines read from the same consumer.
//!
//! Once only: every claim of an end made by this process — the pushing
//! task's and the results' — is taken under one lock, so an end told one way
//! is never told the other. A pushed end whose message could not be written
//! (the client went away) is lost, as a `tenure watch` killed after claiming
//! loses it: at most once, never twice.
//!
//! This module must never claim an end it is not about to tell, nor tell a
//! caller anything of another owner's tasks: it acts as the caller's client
//! only.

#![allow(deprecated)] // MCP logging is deprecated in 2026-07-28 (SEP-2577); it is what handshake-era clients get.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rmcp::model::{LoggingLevel, LoggingMessageNotificationParam};
use rmcp::{Peer, RoleServer};
use serde_json::json;
use tenure_client::notices::NOTICES;
use tenure_client::Client;
use tenure_protocol::messages::{MatchNotice, Notice, TaskSnapshot};
use tokio::sync::Mutex;

use super::results::{MatchView, News};
use crate::api::TaskView;

/// Most ended tasks one result lists; the rest wait for the next results.
const MAX_UNREPORTED: usize = 32;
/// Most matched lines one result carries; the rest stay in the consumer.
const MAX_MATCHED: u32 = 64;
/// The level at which ends and matches are pushed: a client that asked for
/// this level or a lower one gets them.
const PUSH_LEVEL: LoggingLevel = LoggingLevel::Notice;

/// The once-only state of one MCP server: shared by its tools and its
/// pushing task.
#[derive(Default)]
pub struct Reporter {
    /// Held across every claim of an end (a get and a mark).
    claims: Mutex<()>,
    /// Whether ends and matches are pushed now (the client's level allows it).
    pushing: AtomicBool,
    /// The pushing task runs (started once).
    started: AtomicBool,
}

fn rank(level: LoggingLevel) -> u8 {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

/// The log message of an end: a line for a model to read, and the task.
pub fn ended_message(t: &TaskView) -> serde_json::Value {
    let exit = t.exit_code.map(|c| format!(" with exit code {c}")).unwrap_or_default();
    let detail = t.detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default();
    json!({
        "event": "ended",
        "message": format!("{} {}{exit}{detail}: {}", t.id, t.status, t.label),
        "task": t,
    })
}

/// The log message of a matched line.
pub fn matched_message(m: &MatchView) -> serde_json::Value {
    json!({
        "event": "matched",
        "message": format!("{} matched at byte {}: {}", m.task, m.offset, m.text),
        "match": m,
    })
}

/// Sends one log message at [`PUSH_LEVEL`]; false when it could not be
/// written (the client went away).
async fn send(peer: &Peer<RoleServer>, data: serde_json::Value) -> bool {
    let message = LoggingMessageNotificationParam::new(PUSH_LEVEL, data).with_logger("tenure");
    match peer.notify_logging_message(message).await {
        Ok(()) => true,
        Err(error) => {
            tracing::debug!(%error, "log message not sent; the client went away");
            false
        }
    }
}

impl From<&MatchNotice> for MatchView {
    fn from(m: &MatchNotice) -> MatchView {
        MatchView { task: m.task.to_string(), label: m.label.clone(), offset: m.line.offset, text: m.line.text.clone() }
    }
}

impl Reporter {
    /// Claims `task`'s end under the lock: its snapshot when this caller is
    /// the one to tell it.
    async fn claim(&self, api: &Client, task: &tenure_protocol::TaskId) -> Option<TaskSnapshot> {
        let _held = self.claims.lock().await;
        match api.claim_ended(task, &NOTICES).await {
            Ok(claimed) => claimed,
            Err(error) => {
                tracing::warn!(%task, %error, "end not claimed; it stays unreported");
                None
            }
        }
    }

    /// The news for one tool result: ended tasks nothing reported (each
    /// claimed, so listed once), and, while nothing pushes, the matched
    /// lines waiting in the caller's consumer. A cluster that does not
    /// answer leaves the news empty, never the result failed.
    pub async fn news(&self, api: &Client) -> News {
        let mut news = News::default();
        if !self.pushing.load(Ordering::SeqCst) {
            match api.notices(Vec::new(), MAX_MATCHED, 0, &NOTICES).await {
                Ok(items) => {
                    let mut acks = Vec::with_capacity(items.len());
                    for item in items {
                        // Ends are found in the task list below (the truth):
                        // their notices are only acknowledged here.
                        if let Notice::Matched(m) = &item.notice {
                            news.matched.push(MatchView::from(m));
                        }
                        acks.push(item.ack);
                    }
                    if !acks.is_empty() {
                        if let Err(error) = api.notices(acks, 0, 0, &NOTICES).await {
                            tracing::warn!(%error, "notices not acknowledged; they come again");
                        }
                    }
                }
                Err(error) => tracing::debug!(%error, "no notices read for this result"),
            }
        }
        let Ok(tasks) = api.list(false).await else { return news };
        for t in tasks.iter().filter(|t| t.status.is_terminal() && !t.reported) {
            if news.unreported.len() >= MAX_UNREPORTED {
                break;
            }
            if let Some(s) = self.claim(api, &t.id).await {
                news.unreported.push(TaskView::from(&s));
            }
        }
        news
    }

    /// Sends `news` as log messages on `peer` when `level` (the request's
    /// opt-in) lets [`PUSH_LEVEL`] through: what remains for the result
    /// (everything without an opt-in; after a send that failed, the rest).
    pub async fn tell(&self, peer: &Peer<RoleServer>, level: Option<LoggingLevel>, news: News) -> News {
        if level.is_none_or(|l| rank(l) > rank(PUSH_LEVEL)) {
            return news;
        }
        let mut left = News::default();
        for task in news.unreported {
            if !left.unreported.is_empty() || !send(peer, ended_message(&task)).await {
                left.unreported.push(task);
            }
        }
        for m in news.matched {
            let failed = !left.unreported.is_empty() || !left.matched.is_empty();
            if failed || !send(peer, matched_message(&m)).await {
                left.matched.push(m);
            }
        }
        left
    }

    /// The client set its level: pushing goes on while the level lets
    /// [`PUSH_LEVEL`] through, and the pushing task starts the first time.
    pub fn set_level(self: &Arc<Self>, level: LoggingLevel, api: &Client, peer: Peer<RoleServer>) {
        let push = rank(level) <= rank(PUSH_LEVEL);
        self.pushing.store(push, Ordering::SeqCst);
        if push && !self.started.swap(true, Ordering::SeqCst) {
            tokio::spawn(Arc::clone(self).start_pushing(api.clone(), peer));
        }
    }

    /// The pushing task: reads the caller's notices while pushing is on and
    /// the client is connected, tells each once, acknowledges it with the
    /// next read.
    async fn start_pushing(self: Arc<Self>, api: Client, peer: Peer<RoleServer>) {
        let mut acks: Vec<String> = Vec::new();
        while !peer.is_transport_closed() {
            if !self.pushing.load(Ordering::SeqCst) {
                if !acks.is_empty() {
                    let _ = api.notices(std::mem::take(&mut acks), 0, 0, &NOTICES).await;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                continue;
            }
            let items = match api.notices(std::mem::take(&mut acks), 16, 2_000, &NOTICES).await {
                Ok(items) => items,
                Err(error) => {
                    tracing::warn!(%error, "reading notices; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            for item in items {
                let data = match &item.notice {
                    Notice::Ended(notice) => {
                        self.claim(&api, &notice.id).await.map(|s| ended_message(&TaskView::from(&s)))
                    }
                    Notice::Matched(m) => Some(matched_message(&MatchView::from(m))),
                };
                // The client is gone when a message cannot be written: this
                // notice and the rest of the batch stay unacknowledged (an
                // end already claimed is lost).
                if let Some(data) = data {
                    if !send(&peer, data).await {
                        return;
                    }
                }
                acks.push(item.ack);
            }
        }
        if !acks.is_empty() {
            let _ = api.notices(acks, 0, 0, &NOTICES).await;
        }
    }
}
