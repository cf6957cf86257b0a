//! The client side, in process: typed requests to the leader over NATS, the
//! same messages the `tenure` CLI sends (`tenure_protocol::messages`), without
//! the cost of starting a CLI process per call.

use std::time::Duration;

use anyhow::{anyhow, bail};
use tenure_protocol::messages::{ApiReply, ApiRequest, ApiResponse, ClusterStatus, SubmitRequest, TaskSnapshot};
use tenure_protocol::{subjects, SessionId, TaskId, TaskSpec};

const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct Api {
    pub client: async_nats::Client,
    pub session: SessionId,
}

impl Api {
    pub async fn connect(url: &str) -> anyhow::Result<Api> {
        let client = tenure_transport::connect(&tenure_transport::NatsOptions::url(url), "tenure-bench", true).await?;
        Ok(Api { client, session: "bench-owner".parse()? })
    }

    pub async fn call(&self, req: &ApiRequest, timeout: Duration) -> anyhow::Result<ApiResponse> {
        let reply: ApiReply = tenure_transport::request(&self.client, subjects::API.to_owned(), req, timeout).await?;
        Ok(reply?)
    }

    /// Submits a task of `kind` running `command`; its id.
    pub async fn submit(&self, kind: &str, command: &str) -> anyhow::Result<TaskId> {
        let spec = TaskSpec { kind: kind.parse()?, ..TaskSpec::shell("", command) };
        let req = ApiRequest::Submit(SubmitRequest {
            session: self.session.clone(),
            idempotency_key: uuid::Uuid::new_v4(),
            spec,
        });
        match self.call(&req, TIMEOUT).await? {
            ApiResponse::Submitted { task, .. } => Ok(task),
            other => bail!("unexpected reply to submit: {other:?}"),
        }
    }

    /// Waits until the task is terminal; its final snapshot.
    pub async fn wait(&self, task: &TaskId) -> anyhow::Result<TaskSnapshot> {
        loop {
            let req = ApiRequest::Wait { session: self.session.clone(), task: task.clone(), timeout_ms: 20_000 };
            match self.call(&req, Duration::from_secs(25)).await? {
                ApiResponse::Waited { finished: true, snapshot } => return Ok(snapshot),
                ApiResponse::Waited { finished: false, .. } => continue,
                other => bail!("unexpected reply to wait: {other:?}"),
            }
        }
    }

    /// Submits, waits, and checks that the task completed.
    pub async fn run(&self, kind: &str, command: &str) -> anyhow::Result<()> {
        let task = self.submit(kind, command).await?;
        let end = self.wait(&task).await?;
        if end.status != tenure_protocol::Status::Completed {
            bail!("{task} ended {} ({:?})", end.status, end.detail);
        }
        Ok(())
    }

    pub async fn get(&self, task: &TaskId) -> anyhow::Result<TaskSnapshot> {
        let req = ApiRequest::Get { session: self.session.clone(), task: task.clone() };
        match self.call(&req, TIMEOUT).await? {
            ApiResponse::Snapshot(s) => Ok(s),
            other => bail!("unexpected reply to get: {other:?}"),
        }
    }

    pub async fn status_within(&self, timeout: Duration) -> anyhow::Result<ClusterStatus> {
        match self.call(&ApiRequest::Status, timeout).await? {
            ApiResponse::Status(s) => Ok(s),
            other => Err(anyhow!("unexpected reply to status: {other:?}")),
        }
    }

    pub async fn status(&self) -> anyhow::Result<ClusterStatus> {
        self.status_within(TIMEOUT).await
    }
}

/// How many tasks the status counts in `status`.
pub fn count(status: &ClusterStatus, which: tenure_protocol::Status) -> u64 {
    status.tasks_by_status.iter().find(|(s, _)| *s == which).map(|(_, n)| *n).unwrap_or(0)
}
