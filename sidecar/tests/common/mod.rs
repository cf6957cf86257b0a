//! Shared by the sidecar's integration tests: run a real sidecar on a temporary
//! data directory, wait for it with a bound, stop it through its shutdown future.

#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use tenure_machine::{Layout, SidecarClient};
use tenure_protocol::messages::{LeaseGrant, SidecarReply, SidecarRequest};
use tenure_protocol::{Attempt, Epoch, TaskSpec};
use tenure_sidecar::Options;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound on every wait in these tests.
pub const BOUND: Duration = Duration::from_secs(20);

/// A sidecar running in this test's runtime.
pub struct Running {
    pub layout: Layout,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), tenure_sidecar::daemon::Error>>,
}

impl Running {
    /// Starts a sidecar on `root` and waits until its socket answers.
    pub async fn start(root: &Path, worker: &str, nats_url: &str) -> anyhow::Result<Running> {
        let layout = Layout::new(root);
        let opts = Options {
            layout: layout.clone(),
            worker: worker.parse()?,
            nats: tenure_transport::NatsOptions::url(nats_url),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tenure_sidecar::run(opts, async move {
            let _ = stopped.await;
        }));
        let running = Running { layout, stop, task };
        let client = SidecarClient::new(running.layout.socket_path());
        let ready = tokio::time::timeout(BOUND, async {
            loop {
                if running.task.is_finished() {
                    return false;
                }
                if let Ok(SidecarReply::Records { .. }) = client.call(&SidecarRequest::List).await {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        match ready {
            Ok(true) => Ok(running),
            Ok(false) => match running.task.await? {
                Err(e) => Err(anyhow!(e).context("sidecar failed to start")),
                Ok(()) => bail!("sidecar returned before serving"),
            },
            Err(_) => bail!("sidecar socket not answering within {BOUND:?}"),
        }
    }

    /// Completes the shutdown future and waits (bounded) for `run` to return.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        tokio::time::timeout(BOUND, self.task).await.context("sidecar did not stop in time")??.context("run failed")
    }
}

pub fn grant(task: &str, attempt: u32, epoch: u64, owner: &str) -> LeaseGrant {
    LeaseGrant {
        input: Vec::new(),
        task: task.parse().unwrap(),
        attempt: Attempt(attempt),
        epoch: Epoch(epoch),
        owner: owner.parse().unwrap(),
        spec: TaskSpec::shell("test", "echo hi"),
        mark: None,
    }
}

/// A call that must be answered `Ok`.
pub async fn ok(client: &SidecarClient, req: SidecarRequest) {
    let reply = client.call(&req).await;
    assert_eq!(reply, Ok(SidecarReply::Ok), "{req:?}");
}
