//! The sidecar's records survive a restart of the sidecar, and a second sidecar
//! cannot open a data directory that is in use.

mod common;

use common::{grant, ok, Running, BOUND};
use tenure_machine::{Layout, SidecarClient};
use tenure_protocol::messages::{Phase, SidecarRefusal, SidecarReply, SidecarRequest};
use tenure_protocol::{Attempt, Ending, Epoch, Outcome, TaskId};
use tenure_sidecar::{daemon, Options};
use tenure_testkit::NatsServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_durable_across_a_restart() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    let client = SidecarClient::new(sidecar.layout.socket_path());

    let task: TaskId = "shell-1".parse()?;
    let attempt = Attempt(1);
    let outcome = Outcome::new(Ending::Completed, Some(0), None);
    ok(&client, SidecarRequest::ObserveEpoch(Epoch(3))).await;
    ok(&client, SidecarRequest::Accept(grant("shell-1", 1, 3, "alice"))).await;
    ok(&client, SidecarRequest::Intent { task: task.clone(), attempt, epoch: Epoch(3), trace: None }).await;
    ok(&client, SidecarRequest::Spawned { task: task.clone(), attempt, pid: 4321 }).await;
    ok(&client, SidecarRequest::Exited { task: task.clone(), attempt, outcome: outcome.clone() }).await;
    let before = client.call(&SidecarRequest::List).await?;
    let SidecarReply::Records { epoch, records, .. } = &before else { panic!("{before:?}") };
    assert_eq!(*epoch, Epoch(3));
    assert_eq!(records.len(), 1);
    assert_eq!((records[0].phase, records[0].pid, &records[0].outcome), (Phase::Exited, Some(4321), &Some(outcome)));

    sidecar.stop().await?;
    assert!(!dir.path().join("sidecar.sock").exists(), "socket file left behind");
    // The old connection is gone: the client reports it instead of hanging.
    assert!(client.call(&SidecarRequest::List).await.is_err());

    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    assert_eq!(client.call(&SidecarRequest::List).await?, before);
    // The fence survived too.
    assert_eq!(
        client.call(&SidecarRequest::ObserveEpoch(Epoch(2))).await?,
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(3), offered: Epoch(2) })
    );
    ok(&client, SidecarRequest::Acknowledged { task, attempt }).await;
    sidecar.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sidecar_on_the_same_directory_is_refused() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let first = Running::start(dir.path(), "w1", &nats.url).await?;
    // `run` itself must fail (a readiness probe would reach the first sidecar).
    let opts = Options {
        layout: Layout::new(dir.path()),
        worker: "w1".parse()?,
        nats: tenure_transport::NatsOptions::url(nats.url.clone()),
    };
    let second = tokio::time::timeout(BOUND, tenure_sidecar::run(opts, std::future::pending())).await?;
    match second {
        Err(daemon::Error::Store(e)) => assert!(e.to_string().contains("cannot open"), "{e}"),
        other => panic!("a second sidecar on a held directory: {other:?}"),
    }
    // The first one is unharmed.
    let client = SidecarClient::new(first.layout.socket_path());
    assert!(matches!(client.call(&SidecarRequest::List).await?, SidecarReply::Records { .. }));
    first.stop().await
}
