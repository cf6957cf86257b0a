//! `tenure send`: one message to the stdin of a running `agent` task.
//!
//! The coordinator says where the task runs (and answers only its owner); the
//! sidecar of that machine checks the owner again and writes the message into
//! the task's input pipe, whole or not at all. A message is never sent twice:
//! when the sidecar's answer is lost the client says the message is in doubt
//! instead of retrying it.

use std::io::Read;
use std::process::ExitCode;

use anyhow::anyhow;
use tenure_protocol::messages::{ApiError, InputAck, InputReply, InputRequest, MAX_INPUT_BYTES};
use tenure_protocol::{subjects, Kind, Status, TaskId, WorkerId};

use super::{Api, API_TIMEOUT};

/// Why a message did not reach the task. Only [`SendError::InDoubt`] may
/// have delivered it; every other case delivered nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    /// Refused before anything was written, by the snapshot's checks or by
    /// the sidecar (not yours, not an agent, not running, input full, size).
    #[error(transparent)]
    Refused(#[from] ApiError),
    #[error("the sidecar of worker {worker} is not answering; nothing was sent to {task}")]
    NoSidecar { worker: WorkerId, task: TaskId },
    #[error("no answer from the sidecar of worker {worker}: the message may or may not have reached {task}")]
    InDoubt { worker: WorkerId, task: TaskId },
    /// The coordinator could not be asked where the task runs.
    #[error(transparent)]
    Client(#[from] tenure_client::Error),
    #[error(transparent)]
    Transport(tenure_transport::Error),
}

pub(crate) async fn send(api: &Api, task: TaskId, text: Vec<String>, raw: bool) -> anyhow::Result<ExitCode> {
    let from_args = if text.is_empty() { None } else { Some(message(&text, raw)?) };
    let worker = target(api, &task).await?;
    // Stdin is read only now, so that a wrong task is reported before anyone types.
    let data = match from_args {
        Some(data) => data,
        None => tokio::task::spawn_blocking(move || message_from(std::io::stdin().lock(), raw)).await??,
    };
    let ack = deliver(api, &worker, &task, data).await?;
    tracing::debug!(task = %task, attempt = %ack.attempt, bytes = ack.bytes, "input delivered");
    Ok(ExitCode::SUCCESS)
}

/// The worker whose sidecar takes input for `task` now. The sidecar decides;
/// these checks only spare a round trip and say it in terms of the task's
/// status, which the sidecar does not know.
pub(crate) async fn target(api: &Api, task: &TaskId) -> Result<WorkerId, SendError> {
    let snapshot = api.get(task).await?;
    if snapshot.kind != Kind::agent() {
        return Err(ApiError::NoInput { task: task.to_string(), kind: snapshot.kind.to_string() }.into());
    }
    let not_running = |status: String| ApiError::NotRunning { task: task.to_string(), status };
    if snapshot.status.is_terminal() {
        return Err(not_running(format!("it is {}", snapshot.status)).into());
    }
    // A queued task may still name the worker of an attempt that was given back.
    match snapshot.worker {
        Some(worker) if snapshot.status != Status::Queued => Ok(worker),
        _ => Err(not_running("it is queued: no worker has started it yet".into()).into()),
    }
}

/// Sends one message to `task` through the sidecar of `worker`, once: a
/// message is never sent again, so an unanswered request is in doubt.
pub(crate) async fn deliver(api: &Api, worker: &WorkerId, task: &TaskId, data: Vec<u8>) -> Result<InputAck, SendError> {
    let req = InputRequest { session: api.session().clone(), task: task.clone(), data };
    let reply: Result<InputReply, _> =
        tenure_transport::request(api.nats(), subjects::input(worker), &req, API_TIMEOUT).await;
    match reply {
        Ok(reply) => Ok(reply?),
        Err(tenure_transport::Error::NoResponders { .. }) => {
            Err(SendError::NoSidecar { worker: worker.clone(), task: task.clone() })
        }
        Err(tenure_transport::Error::Timeout { .. }) => {
            Err(SendError::InDoubt { worker: worker.clone(), task: task.clone() })
        }
        Err(e) => Err(SendError::Transport(e)),
    }
}

/// The message made of TEXT words: joined by spaces, a newline added unless `raw`.
fn message(text: &[String], raw: bool) -> Result<Vec<u8>, ApiError> {
    finish(text.join(" ").into_bytes(), raw)
}

/// The message read from `input` until its end; more than the limit is refused
/// without reading the rest.
fn message_from(input: impl Read, raw: bool) -> anyhow::Result<Vec<u8>> {
    let mut data = Vec::new();
    input.take(MAX_INPUT_BYTES as u64 + 1).read_to_end(&mut data)?;
    if data.len() > MAX_INPUT_BYTES {
        return Err(anyhow!(
            "input from stdin is larger than {MAX_INPUT_BYTES} bytes, the most one message holds; split it over several sends"
        ));
    }
    Ok(finish(data, raw)?)
}

pub(crate) fn finish(mut data: Vec<u8>, raw: bool) -> Result<Vec<u8>, ApiError> {
    if !raw && data.last() != Some(&b'\n') {
        data.push(b'\n');
    }
    if data.is_empty() || data.len() > MAX_INPUT_BYTES {
        return Err(ApiError::InputSize { size: data.len() as u64, max: MAX_INPUT_BYTES as u64 });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_end_with_one_newline_unless_raw() {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(message(&words(&["hello", "there"]), false).unwrap(), b"hello there\n");
        assert_eq!(message(&words(&["hello\n"]), false).unwrap(), b"hello\n");
        assert_eq!(message(&words(&["no", "newline"]), true).unwrap(), b"no newline");
        assert_eq!(message(&words(&[""]), false).unwrap(), b"\n", "an empty line is a message");
        assert!(matches!(message(&words(&[""]), true), Err(ApiError::InputSize { size: 0, .. })));
        assert_eq!(message_from(&b"from stdin\n"[..], false).unwrap(), b"from stdin\n");
        assert_eq!(message_from(&b"two\nlines"[..], false).unwrap(), b"two\nlines\n");
    }

    #[test]
    fn oversized_messages_are_refused() {
        let at_limit = "x".repeat(MAX_INPUT_BYTES - 1);
        assert_eq!(message(std::slice::from_ref(&at_limit), false).unwrap().len(), MAX_INPUT_BYTES);
        assert!(matches!(message(&[at_limit + "x"], false), Err(ApiError::InputSize { .. })));
        let big = vec![b'y'; MAX_INPUT_BYTES * 3];
        assert!(message_from(&big[..], true).is_err());
        assert_eq!(message_from(&big[..MAX_INPUT_BYTES], true).unwrap().len(), MAX_INPUT_BYTES);
    }
}
