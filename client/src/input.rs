//! Input to an `agent` task: one message, through the sidecar of the machine
//! its attempt runs on, never sent twice.
//!
//! The coordinator says where the task runs (and answers only its owner);
//! the sidecar checks the owner again and writes the message into the task's
//! input pipe, whole or not at all. When the sidecar's answer is lost the
//! message is in doubt ([`SendError::InDoubt`]): it is not sent again.
//!
//! An agent that declares a resume command and whose machine lost it has no
//! process to write to: the coordinator keeps the message for the resumed
//! attempt ([`InputTarget::Kept`]), whose shim writes it before the task
//! starts.

use tenure_protocol::messages::{ApiError, ApiRequest, InputAck, InputReply, InputRequest, MAX_INPUT_BYTES};
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
    #[error("no answer from the coordinator: the message may or may not be kept for {task}'s resumed attempt")]
    KeptInDoubt { task: TaskId },
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

/// Where a message for a task goes now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputTarget {
    /// The sidecar of the machine its attempt runs on.
    Worker(WorkerId),
    /// The coordinator, which keeps it for the task's resumed attempt (an
    /// agent with a resume command whose machine lost it).
    Kept,
}

impl Client {
    /// Where input for `task` goes now: the worker whose sidecar takes it,
    /// or the coordinator that keeps it for a resumed attempt. The sidecar
    /// (or the coordinator) decides; these checks only spare a round trip
    /// and say it in terms of the task's status, which the sidecar does not
    /// know.
    pub async fn input_target(&self, task: &TaskId) -> Result<InputTarget, SendError> {
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
        if snapshot.agent_resume.is_some() && matches!(snapshot.status, Status::Unknown | Status::Queued) {
            return Ok(InputTarget::Kept);
        }
        match snapshot.worker {
            Some(worker) if !matches!(snapshot.status, Status::Queued | Status::Blocked | Status::Leased) => {
                Ok(InputTarget::Worker(worker))
            }
            _ => Err(not_running(format!("it is {}: its process has not started yet", snapshot.status)).into()),
        }
    }

    /// Sends one message to `task` where `target` says, once: a message is
    /// never sent again, so an unanswered request is in doubt.
    pub async fn deliver_input(
        &self,
        target: &InputTarget,
        task: &TaskId,
        data: Vec<u8>,
    ) -> Result<InputAck, SendError> {
        let worker = match target {
            InputTarget::Worker(worker) => worker,
            InputTarget::Kept => return self.keep_input(task, data).await,
        };
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
        let target = self.input_target(task).await?;
        self.deliver_input(&target, task, data).await
    }

    /// Asks the coordinator to keep one message for `task`'s resumed
    /// attempt (text only: it is kept in the registry).
    async fn keep_input(&self, task: &TaskId, data: Vec<u8>) -> Result<InputAck, SendError> {
        let bytes = data.len() as u64;
        let message = String::from_utf8(data)
            .map_err(|_| ApiError::InvalidRequest("input kept for a resumed attempt must be UTF-8 text".into()))?;
        let req = ApiRequest::KeepInput { session: self.session().clone(), task: task.clone(), message };
        match self.snapshot_of(&req).await {
            Ok(snapshot) => Ok(InputAck { attempt: snapshot.attempt, bytes, kept: true }),
            Err(e) if e.api().is_some() => Err(e.into()),
            // Sent once: an unanswered request may have been kept.
            Err(_) => Err(SendError::KeptInDoubt { task: task.clone() }),
        }
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
