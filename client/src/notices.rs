//! The caller's notices and their once-only rule, shared by every surface
//! that shows them (`tenure watch`, the gateway's SSE notices, the MCP
//! tools and their notifications): one read of the durable consumer the
//! leader keeps for the caller's owner ([`Client::notices`]), and the claim
//! of an end notice ([`Client::claim_ended`]): shown only if nothing else
//! reported the task, and then marked reported.
//!
//! It must never show (return) an end whose task was already reported, nor
//! acknowledge a notice its caller did not hand back: what is acknowledged
//! is the caller's decision, made after it showed the notice.

use std::time::Duration;

use tenure_protocol::messages::{ApiError, ApiRequest, ApiResponse, NoticeItem, TaskSnapshot};
use tenure_protocol::TaskId;

use crate::{unexpected, Client, Error, Policy};

/// Notice reads and claims ride out a leader change as `tenure watch` does:
/// for 30 s, a try every 500 ms.
pub const NOTICES: Policy = Policy {
    overall: Duration::from_secs(30),
    first_pause: Duration::from_millis(500),
    max_pause: Duration::from_millis(500),
    per_try: Duration::from_secs(5),
    through_registry_behind: false,
};

impl Client {
    /// Acknowledges `acks` (tokens of notices already shown), then returns
    /// up to `max` notices of the caller's owner, oldest first, waiting at
    /// most `wait_ms` for the first. `max == 0` only acknowledges.
    pub async fn notices(
        &self,
        acks: Vec<String>,
        max: u32,
        wait_ms: u64,
        policy: &Policy,
    ) -> Result<Vec<NoticeItem>, Error> {
        let req = ApiRequest::Notices { session: self.session().clone(), acks, max, wait_ms };
        match self.request(&req, policy).await? {
            ApiResponse::Notices(items) => Ok(items),
            other => Err(unexpected("notices", other)),
        }
    }

    /// Marks `task` reported unless something reported it first: the
    /// snapshot to show, or `None` to skip its end notice (reported by
    /// another surface, or deleted and gone meanwhile).
    ///
    /// Two claims of one task racing each other from two processes can both
    /// win (the leader's mark is idempotent, not compare-and-set): a caller
    /// that shows notices from several tasks of its own serializes its
    /// claims.
    pub async fn claim_ended(&self, task: &TaskId, policy: &Policy) -> Result<Option<TaskSnapshot>, Error> {
        let get = ApiRequest::Get { session: self.session().clone(), task: task.clone() };
        let current = match self.request(&get, policy).await {
            Ok(ApiResponse::Snapshot(s)) => s,
            Err(Error::Api(ApiError::NotFound(_))) => return Ok(None),
            Ok(other) => return Err(unexpected("get", other)),
            Err(e) => return Err(e),
        };
        if current.reported || !current.status.is_terminal() {
            return Ok(None);
        }
        let mark = ApiRequest::MarkReported { session: self.session().clone(), task: task.clone() };
        match self.request(&mark, policy).await {
            Ok(ApiResponse::Snapshot(s)) => Ok(Some(s)),
            Err(Error::Api(ApiError::NotFound(_))) => Ok(None),
            Ok(other) => Err(unexpected("mark-reported", other)),
            Err(e) => Err(e),
        }
    }
}
