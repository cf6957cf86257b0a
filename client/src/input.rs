//! Input to an `agent` task: one message, through the sidecar of the machine
//! its attempt runs on, never sent twice.
//!
//! The coordinator says where the task runs (and answers only its owner);
//! the sidecar checks the owner again and writes the message into the task's
//! input pipe, whole or not at all. When the sidecar's answer is lost the
//! message is in doubt ([`SendError::InDoubt`]): it is not sent again.

use tenure_protocol::messages::{ApiError, InputAck, InputReply, InputRequest, MAX_INPUT_BYTES};
use tenure_protocol::{subjects, Kind, Status, TaskId, WorkerId};

use crate::{Client, Error, API_TIMEOUT};

/// Why a message did not reach the task. Only [`SendError::InDoubt`] may
/// have delivered it; every other case delivered nothing.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
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
    Client(#[from] Error),
    #[error(transparent)]
    Transport(tenure_transport::Error),
}

/// `data` as one message: a newline added unless `raw` or it ends with one;
/// empty or larger than [`MAX_INPUT_BYTES`] is refused.
pub fn message(mut data: Vec<u8>, raw: bool) -> Result<Vec<u8>, ApiError> {
    if !raw && data.last() != Some(&b'\n') {
        data.push(b'\n');
    }
    if data.is_empty() || data.len() > MAX_INPUT_BYTES {
        return Err(ApiError::InputSize { size: data.len() as u64, max: MAX_INPUT_BYTES as u64 });
    }
    Ok(data)
}

impl Client {
    /// The worker whose sidecar takes input for `task` now. The sidecar
    /// decides; these checks only spare a round trip and say it in terms of
    /// the task's status, which the sidecar does not know.
    pub async fn input_target(&self, task: &TaskId) -> Result<WorkerId, SendError> {
        let snapshot = self.get(task).await?;
        if snapshot.kind != Kind::agent() {
            return Err(ApiError::NoInput { task: task.to_string(), kind: snapshot.kind.to_string() }.into());
        }
        let not_running = |status: String| ApiError::NotRunning { task: task.to_string(), status };
        if snapshot.status.is_terminal() {
            return Err(not_running(format!("it is {}", snapshot.status)).into());
        }
        // A queued task may still name the worker of an attempt that was
        // given back; a leased one's machine may not have taken it yet (its
        // sidecar would answer not-found).
        match snapshot.worker {
            Some(worker) if !matches!(snapshot.status, Status::Queued | Status::Blocked | Status::Leased) => Ok(worker),
            _ => Err(not_running(format!("it is {}: its process has not started yet", snapshot.status)).into()),
        }
    }

    /// Sends one message to `task` through the sidecar of `worker`, once: a
    /// message is never sent again, so an unanswered request is in doubt.
    pub async fn deliver_input(&self, worker: &WorkerId, task: &TaskId, data: Vec<u8>) -> Result<InputAck, SendError> {
        let req = InputRequest { session: self.session().clone(), task: task.clone(), data };
        let reply: Result<InputReply, _> =
            tenure_transport::request(self.nats(), subjects::input(worker), &req, API_TIMEOUT).await;
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

    /// [`Client::input_target`], then [`Client::deliver_input`].
    pub async fn send_input(&self, task: &TaskId, data: Vec<u8>) -> Result<InputAck, SendError> {
        let worker = self.input_target(task).await?;
        self.deliver_input(&worker, task, data).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_ends_with_one_newline_unless_raw_and_is_bounded() {
        assert_eq!(message(b"hello".to_vec(), false).unwrap(), b"hello\n");
        assert_eq!(message(b"hello\n".to_vec(), false).unwrap(), b"hello\n");
        assert_eq!(message(b"raw".to_vec(), true).unwrap(), b"raw");
        assert_eq!(message(Vec::new(), false).unwrap(), b"\n", "an empty line is a message");
        assert!(matches!(message(Vec::new(), true), Err(ApiError::InputSize { size: 0, .. })));
        assert_eq!(message(vec![b'x'; MAX_INPUT_BYTES - 1], false).unwrap().len(), MAX_INPUT_BYTES);
        assert!(matches!(message(vec![b'x'; MAX_INPUT_BYTES], false), Err(ApiError::InputSize { .. })));
    }
}
