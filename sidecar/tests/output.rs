//! Output reads over NATS: only the owner of the task's latest attempt reads,
//! by offset; everyone else, and every unknown task, gets the same NotFound.

mod common;

use std::time::Duration;

use anyhow::bail;
use common::{grant, ok, Running, BOUND};
use tenure_machine::SidecarClient;
use tenure_protocol::messages::{ApiError, OutputChunk, OutputReply, OutputRequest, SidecarRequest};
use tenure_protocol::{decode, encode, subjects, Attempt, Ending, Epoch, Outcome, TaskId};
use tenure_testkit::NatsServer;

/// One request/reply on the output subject, retried (bounded) only while the
/// sidecar's subscription is not yet in place.
async fn ask(nc: &async_nats::Client, payload: Vec<u8>) -> anyhow::Result<OutputReply> {
    let subject = subjects::output(&"w1".parse()?);
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        match nc.request(subject.clone(), payload.clone().into()).await {
            Ok(msg) => return Ok(decode(&msg.payload)?),
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                if tokio::time::Instant::now() >= deadline {
                    bail!("no output responder within {BOUND:?}");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn read(session: &str, task: &str, offset: u64, max: u32) -> Vec<u8> {
    let req = OutputRequest { session: session.parse().unwrap(), task: task.parse().unwrap(), offset, max };
    encode(&req).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_reads_by_offset_for_the_owner_only() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    let client = SidecarClient::new(sidecar.layout.socket_path());
    let nc = async_nats::connect(&nats.url).await?;

    let task: TaskId = "shell-5".parse()?;
    ok(&client, SidecarRequest::Accept(grant("shell-5", 1, 1, "alice"))).await;
    ok(&client, SidecarRequest::Intent { task: task.clone(), attempt: Attempt(1), epoch: Epoch(1), trace: None }).await;
    std::fs::write(sidecar.layout.output_path(&task), b"hello world")?;

    let chunk =
        |data: &[u8], next_offset, finished| Ok(OutputChunk { data: data.to_vec(), next_offset, size: 11, finished });
    assert_eq!(ask(&nc, read("alice", "shell-5", 6, 100)).await?, chunk(b"world", 11, false));
    assert_eq!(ask(&nc, read("alice", "shell-5", 0, 5)).await?, chunk(b"hello", 5, false));
    assert_eq!(ask(&nc, read("alice", "shell-5", 11, u32::MAX)).await?, chunk(b"", 11, false));

    let not_found = Err(ApiError::NotFound("shell-5".into()));
    assert_eq!(ask(&nc, read("bob", "shell-5", 0, 100)).await?, not_found);
    assert_eq!(ask(&nc, read("alice", "shell-99", 0, 100)).await?, Err(ApiError::NotFound("shell-99".into())));
    assert!(matches!(ask(&nc, b"\x01garbage".to_vec()).await?, Err(ApiError::InvalidRequest(_))));
    assert!(matches!(ask(&nc, Vec::new()).await?, Err(ApiError::InvalidRequest(_))));

    // Once the outcome is buffered the output is final.
    let outcome = Outcome::new(Ending::Completed, Some(0), None);
    ok(&client, SidecarRequest::Exited { task: task.clone(), attempt: Attempt(1), outcome }).await;
    assert_eq!(ask(&nc, read("alice", "shell-5", 6, 100)).await?, chunk(b"world", 11, true));

    // A newer attempt for another owner takes the output over.
    ok(&client, SidecarRequest::Accept(grant("shell-5", 2, 1, "carol"))).await;
    assert_eq!(ask(&nc, read("alice", "shell-5", 0, 100)).await?, not_found);
    assert_eq!(ask(&nc, read("carol", "shell-5", 0, 5)).await?, chunk(b"hello", 5, false));

    // No output file yet: empty output so far.
    ok(&client, SidecarRequest::Accept(grant("shell-6", 1, 1, "alice"))).await;
    assert_eq!(
        ask(&nc, read("alice", "shell-6", 0, 100)).await?,
        Ok(OutputChunk { data: vec![], next_offset: 0, size: 0, finished: false })
    );
    sidecar.stop().await
}
