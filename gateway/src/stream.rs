//! Server-Sent Events: a task's output followed from a byte offset, and the
//! caller's notices.
//!
//! Output events carry the byte offset after their text as their `id`, so a
//! client that reconnects with `Last-Event-ID` (browsers do it by
//! themselves) continues exactly where it stopped, from any gateway. The
//! notices follow `tenure watch`'s rules with the same requests
//! (`tenure_client::notices`): read from the durable consumer the leader
//! keeps for the caller, each end notice shown only if nothing else reported
//! the task (and then marked reported), acknowledged with the next request
//! once sent.
//!
//! Each stream is one task of the gateway feeding a small bounded channel:
//! a slow reader slows the reads down, memory does not grow with the output,
//! and a reader that went away ends the task at its next event. A stream
//! whose token is revoked ends within a second.

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::extract::State as AxState;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::IntoResponse as _;
use futures::Stream;
use serde::{Deserialize, Serialize};
use tenure_client::notices::NOTICES;
use tenure_protocol::messages::{Notice, TaskSnapshot, MAX_OUTPUT_CHUNK};
use tenure_protocol::{Kind, TaskId};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt as _;
use utoipa::{IntoParams, ToSchema};

use crate::api::{read_chunk, Query, TaskPath, TaskView};
use crate::error::{Error, ErrorBody};
use crate::{Caller, State};

type Events = axum::response::Response;

fn sse(rx: mpsc::Receiver<Event>) -> Events {
    let stream: std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>> =
        Box::pin(ReceiverStream::new(rx).map(Ok));
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

fn event<T: Serialize>(name: &str, data: &T) -> Event {
    Event::default().event(name).json_data(data).unwrap_or_else(|_| Event::default().event(name))
}

/// Whether the caller's token or certificate grant still holds (checked at
/// most once a second).
struct StillValid {
    state: State,
    credential: crate::Credential,
    checked: Instant,
}

impl StillValid {
    fn holds(&mut self) -> bool {
        if self.checked.elapsed() < Duration::from_secs(1) {
            return true;
        }
        self.checked = Instant::now();
        self.credential.grant(&self.state.inner.tokens).is_some()
    }
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct FollowQuery {
    /// Byte offset to start from (default 0); `Last-Event-ID` overrides it.
    #[serde(default)]
    pub offset: u64,
}

/// The data of an `output` event; its `id` is `next_offset`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct OutputEvent {
    pub offset: u64,
    pub next_offset: u64,
    pub text: String,
}

/// Follow a task's output live (SSE). Events: `output` (`OutputEvent`, id =
/// the byte offset after it: reconnect with `Last-Event-ID` to resume), then
/// `end` (the task's `TaskView`) once the attempt ended and every byte is
/// out, or `error` (`ErrorBody`).
#[utoipa::path(get, path = "/v1/tasks/{id}/logs/stream",
    params(("id" = String, Path), FollowQuery, ("Last-Event-ID" = Option<u64>, Header, description = "resume after this byte offset")),
    responses((status = 200, content_type = "text/event-stream", body = OutputEvent), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn follow_output(
    caller: Caller,
    AxState(state): AxState<State>,
    TaskPath(id): TaskPath,
    headers: HeaderMap,
    Query(q): Query<FollowQuery>,
) -> Result<Events, Error> {
    let resume = match headers.get("last-event-id") {
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| Error::bad_request("bad-last-event-id", "Last-Event-ID is a byte offset"))?,
        ),
        None => None,
    };
    let offset = resume.unwrap_or(q.offset);
    // Asked before the stream starts, so that not-yours is a plain 404.
    let snapshot = caller.client.get(&id).await?;
    if snapshot.kind == Kind::workflow() {
        return Err(Error::bad_request(
            "workflow-output",
            "a workflow's output is its steps' outputs: follow each step's task",
        ));
    }
    let (tx, rx) = mpsc::channel(4);
    let valid = StillValid { state, credential: caller.credential.clone(), checked: Instant::now() };
    tokio::spawn(pump_output(caller.client, snapshot, offset, tx, valid));
    Ok(sse(rx))
}

async fn pump_output(
    client: tenure_client::Client,
    mut snapshot: TaskSnapshot,
    mut offset: u64,
    tx: mpsc::Sender<Event>,
    mut valid: StillValid,
) {
    const IDLE_MAX: Duration = Duration::from_millis(250);
    let id: TaskId = snapshot.id.clone();
    let mut idle = Duration::from_millis(20);
    loop {
        if !valid.holds() {
            let _ = tx.send(event("error", &Error::unauthorized("token revoked").body())).await;
            return;
        }
        if snapshot.final_output && !snapshot.status.is_terminal() {
            // Nothing streams before a final-output task ends.
            match client.wait(&id, Some(Instant::now() + Duration::from_secs(5))).await {
                Ok(w) => snapshot = w.snapshot,
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
            if tx.is_closed() {
                return;
            }
            continue;
        }
        match read_chunk(&client, &snapshot, offset, MAX_OUTPUT_CHUNK).await {
            Ok(chunk) if chunk.next_offset > offset => {
                let next = chunk.next_offset;
                let data = crate::stream::OutputEvent { offset, next_offset: next, text: chunk.text };
                if tx.send(event("output", &data).id(next.to_string())).await.is_err() {
                    return;
                }
                offset = next;
                idle = Duration::from_millis(20);
            }
            Ok(chunk) if chunk.finished => {
                let end = client.get(&id).await.unwrap_or(snapshot);
                let _ = tx.send(event("end", &TaskView::from(&end)).id(offset.to_string())).await;
                return;
            }
            Ok(_) => {
                if tx.is_closed() {
                    return;
                }
                if snapshot.status.is_terminal() && idle == IDLE_MAX {
                    // Ended in the registry and its machine has had nothing more for a while.
                    let _ = tx.send(event("end", &TaskView::from(&snapshot)).id(offset.to_string())).await;
                    return;
                }
                tokio::time::sleep(idle).await;
                idle = (idle * 2).min(IDLE_MAX);
                if idle == IDLE_MAX || snapshot.worker.is_none() {
                    // A quiet task: has it ended, or moved to another worker?
                    if let Ok(s) = client.get(&id).await {
                        snapshot = s;
                    }
                }
            }
            Err(e) if e.code == "not-found" || e.status.is_client_error() => {
                let _ = tx.send(event("error", &e.body())).await;
                return;
            }
            Err(e) => {
                tracing::debug!(task = %id, error = %e.message, "output not readable yet; retrying");
                if tx.is_closed() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The data of a `matched` event: a monitor's output line that matched.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct MatchEvent {
    pub task: String,
    pub offset: u64,
    pub text: String,
}

/// The caller's notices (SSE), as `tenure watch` shows them: `ended`
/// (`TaskView`, once per task and only if nothing else reported it) and
/// `matched` (`MatchEvent`), resuming after the last acknowledged notice.
#[utoipa::path(get, path = "/v1/notices/stream",
    responses((status = 200, content_type = "text/event-stream", body = TaskView), (status = 401, body = ErrorBody)))]
pub async fn notices(caller: Caller, AxState(state): AxState<State>) -> Result<Events, Error> {
    let (tx, rx) = mpsc::channel(4);
    let valid = StillValid { state, credential: caller.credential.clone(), checked: Instant::now() };
    tokio::spawn(pump_notices(caller.client, tx, valid));
    Ok(sse(rx))
}

async fn pump_notices(client: tenure_client::Client, tx: mpsc::Sender<Event>, mut valid: StillValid) {
    let mut acks: Vec<String> = Vec::new();
    'reading: while valid.holds() && !tx.is_closed() {
        let items = match client.notices(std::mem::take(&mut acks), 16, 2_000, &NOTICES).await {
            Ok(items) => items,
            Err(e) => {
                let _ = tx.send(event("error", &Error::from(e).body())).await;
                return;
            }
        };
        for item in items {
            let shown = match &item.notice {
                // Room in the channel first: claiming marks the task reported,
                // so a reader that left must be found out before, not after
                // (its notice then stays unacknowledged and comes again).
                Notice::Ended(notice) => match tx.reserve().await {
                    Err(_) => false,
                    Ok(permit) => match client.claim_ended(&notice.id, &NOTICES).await {
                        Ok(Some(s)) => {
                            permit.send(event("ended", &TaskView::from(&s)));
                            true
                        }
                        Ok(None) => true,
                        Err(e) => {
                            permit.send(event("error", &Error::from(e).body()));
                            return;
                        }
                    },
                },
                Notice::Matched(m) => {
                    let data =
                        MatchEvent { task: m.task.to_string(), offset: m.line.offset, text: m.line.text.clone() };
                    tx.send(event("matched", &data)).await.is_ok()
                }
            };
            if !shown {
                // The reader left: this notice stays unacknowledged and comes again.
                break 'reading;
            }
            acks.push(item.ack);
        }
    }
    if !acks.is_empty() {
        // The reader left (or its token was revoked): acknowledge what it was sent.
        let _ = client.notices(acks, 0, 0, &NOTICES).await;
    }
}
