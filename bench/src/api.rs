//! The bench's shorthands over `tenure_client`, the one typed client: the
//! same messages the `tenure` CLI sends, in process, without the cost of
//! starting a CLI process per call. Nothing here talks to NATS itself.

use std::time::Duration;

use anyhow::bail;
use tenure_client::{Client, Policy};
use tenure_protocol::messages::{BatchTask, ClusterStatus, SubmitRequest, WaitFor};
use tenure_protocol::{TaskId, TaskSpec};

/// Bound of one request under load (a burst of submits queues at the leader).
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// The bench's client: [`tenure_client::Client`].
pub type Api = Client;

/// Connects to the cluster at `url` as the bench's session.
pub async fn connect(url: &str) -> anyhow::Result<Api> {
    let opts = tenure_transport::NatsOptions::url(url);
    Ok(Client::connect(&opts, "tenure-bench", true, "bench-owner".parse()?).await?)
}

/// What the bench asks of the client beyond its typed requests.
pub(crate) trait BenchApi {
    /// Submits a task of `kind` running `command`; its id.
    async fn submit_command(&self, kind: &str, command: &str) -> anyhow::Result<TaskId>;
    /// Submits `n` `noop` tasks in one batch; their ids.
    async fn submit_noops(&self, n: u64) -> anyhow::Result<Vec<TaskId>>;
    /// Submits and waits (one `Run` request), and checks that the task completed.
    async fn run_to_end(&self, kind: &str, command: &str) -> anyhow::Result<()>;
    /// Submits and waits until the task runs, or ran (one `Run` request held
    /// for its start); its id.
    async fn run_to_start(&self, kind: &str, command: &str) -> anyhow::Result<TaskId>;
    /// The cluster's status within [`TIMEOUT`].
    async fn cluster_status(&self) -> anyhow::Result<ClusterStatus>;
}

impl BenchApi for Client {
    async fn submit_command(&self, kind: &str, command: &str) -> anyhow::Result<TaskId> {
        let req = submit_request(self, kind, command)?;
        // The shared retry rule, with the bench's longer bound per try.
        Ok(self.submit_request(req, &Policy { per_try: TIMEOUT, ..Policy::SUBMIT }).await?.task)
    }

    async fn submit_noops(&self, n: u64) -> anyhow::Result<Vec<TaskId>> {
        let spec = TaskSpec { kind: "noop".parse()?, ..TaskSpec::shell("", "-") };
        let task = |_| BatchTask { idempotency_key: uuid::Uuid::new_v4(), spec: spec.clone() };
        let done = self.submit_batch((0..n).map(task).collect()).await?;
        Ok(done.into_iter().map(|d| d.task).collect())
    }

    async fn run_to_end(&self, kind: &str, command: &str) -> anyhow::Result<()> {
        let req = submit_request(self, kind, command)?;
        let end = self.run(req).await?;
        if end.status != tenure_protocol::Status::Completed {
            bail!("{} ended {} ({:?})", end.id, end.status, end.detail);
        }
        Ok(())
    }

    async fn run_to_start(&self, kind: &str, command: &str) -> anyhow::Result<TaskId> {
        let req = submit_request(self, kind, command)?;
        Ok(self.run_until(req, WaitFor::Start).await?.id)
    }

    async fn cluster_status(&self) -> anyhow::Result<ClusterStatus> {
        Ok(self.status(TIMEOUT).await?)
    }
}

/// A submit of one `kind` task running `command`, with a key of its own.
fn submit_request(client: &Client, kind: &str, command: &str) -> anyhow::Result<SubmitRequest> {
    let spec = TaskSpec { kind: kind.parse()?, ..TaskSpec::shell("", command) };
    Ok(SubmitRequest { session: client.session().clone(), idempotency_key: uuid::Uuid::new_v4(), spec })
}

/// How many tasks the status counts in `status`.
pub fn count(status: &ClusterStatus, which: tenure_protocol::Status) -> u64 {
    status.tasks_by_status.iter().find(|(s, _)| *s == which).map(|(_, n)| *n).unwrap_or(0)
}
