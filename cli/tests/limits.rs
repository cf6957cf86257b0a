//! Limits on a real cluster: a workflow just over and just under what one
//! registry message holds, per-identity quotas refused with a clear error,
//! and a forged heartbeat claiming the last epoch, which deposes nobody.

mod common;

use std::time::Duration;

use common::{stderr, stdout, Cluster};
use tenure_protocol::messages::{ApiError, ApiReply, ApiRequest, ApiResponse, Heartbeat, SubmitRequest};
use tenure_protocol::{subjects, Epoch, Kind, SessionId, StepSpec, TaskSpec};
use tenure_testkit::eventually;

const STEP: usize = 64 * 1024;

/// A workflow of 15 full steps (`: xxx…`, 64 KiB each) and a last one of `last` bytes.
fn big_workflow(last: usize) -> TaskSpec {
    let step = |len: usize| StepSpec { kind: Kind::shell(), command: format!(": {}", "x".repeat(len - 2)) };
    let mut steps: Vec<StepSpec> = (0..15).map(|_| step(STEP)).collect();
    steps.push(step(last));
    TaskSpec { kind: Kind::workflow(), steps, ..TaskSpec::shell("big", "") }
}

/// One submit as `session` (one try): the coordinator's answer.
async fn submit(client: &async_nats::Client, session: &SessionId, spec: TaskSpec) -> ApiReply {
    let client = tenure_client::Client::new(client.clone(), session.clone());
    let req =
        ApiRequest::Submit(SubmitRequest { session: session.clone(), idempotency_key: uuid::Uuid::new_v4(), spec });
    match client.call(&req, Duration::from_secs(10)).await {
        Ok(reply) => Ok(reply),
        Err(tenure_client::Error::Api(refusal)) => Err(refusal),
        Err(e) => panic!("no answer: {e}"),
    }
}

#[test]
fn records_at_the_registry_message_limit_and_quotas_per_identity() {
    let nats = tenure_testkit::NatsCluster::single(tenure_testkit::NatsServer::start().expect("nats-server"));
    let mut c = Cluster::on(nats, None);
    c.spawn_coordinator("c1", &["--max-live-tasks", "3"]);
    c.wait_leader("c1");
    c.start_worker("w1");
    c.wait_workers(1);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let owner: SessionId = "big".parse().expect("session");
    let (first, over, under) = rt.block_on(async {
        let client = tenure_transport::connect(&c.nats_options("client"), "limits-test", false).await.expect("connect");
        // What the leader computes: one message on this server, less room for headers.
        let limit = tenure_coordinator::registry::record_limit(client.server_info().max_payload);
        // The largest record, or `None` past what the codec encodes at all.
        let size = |last| tenure_coordinator::limits::largest_size(&owner, &big_workflow(last), None).ok();
        let fits = |last| size(last).is_some_and(|s| s <= limit);
        let (mut lo, mut hi) = (2, STEP);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(mid) {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        assert!(fits(lo) && !fits(lo + 1), "{:?} {:?} {limit}", size(lo), size(lo + 1));

        let first = submit(&client, &owner, TaskSpec::shell("first", "true")).await;
        let over = submit(&client, &owner, big_workflow(lo + 1)).await;
        if let Err(ApiError::RecordTooLarge { size, max, .. }) = &over {
            assert_eq!(*max, limit as u64);
            assert!(*size > *max);
        }
        let under = submit(&client, &owner, big_workflow(lo)).await;
        (first, over, under)
    });
    let Ok(ApiResponse::Submitted { task: first, .. }) = first else { panic!("{first:?}") };
    let Err(refusal @ ApiError::RecordTooLarge { .. }) = &over else { panic!("refused as too large: {over:?}") };
    let message = refusal.to_string();
    assert!(message.contains("registry message holds") && message.contains("nothing was stored"), "{message}");
    let Ok(ApiResponse::Submitted { task: under, .. }) = under else { panic!("{under:?}\n{}", c.logs()) };
    assert_eq!(under.number(), first.number() + 1, "the refused submit used no task number");
    let get = |session: &str, task: &str| -> Option<serde_json::Value> {
        serde_json::from_slice(&c.cli_as(session, &["get", task, "--json"]).stdout).ok()
    };
    let done =
        eventually(Duration::from_secs(120), || get("big", &under.to_string()).filter(|v| v["status"] == "completed"));
    let done = done.unwrap_or_else(|| panic!("{:?}\n{}", get("big", &under.to_string()), c.logs()));
    assert_eq!(done["steps"].as_array().map(Vec::len), Some(16));
    let listed = stdout(&c.cli_as("big", &["ls", "--all", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("ls json");
    assert_eq!(listed.as_array().map(Vec::len), Some(2 + 16), "the workflow, its steps and `first`; nothing else");

    // Live tasks per identity: `q/one` and `q/two` are one identity.
    let mut live = Vec::new();
    for session in ["q/one", "q/two", "q/one"] {
        let out = c.cli_as(session, &["submit", "--", "sleep 60"]);
        assert!(out.status.success(), "{}", stderr(&out));
        live.push((session, stdout(&out).trim().to_owned()));
    }
    let refused = c.cli_as("q/two", &["submit", "--", "sleep 60"]);
    assert!(!refused.status.success());
    let why = stderr(&refused);
    assert!(why.contains("quota exceeded for \"q\"") && why.contains("live-tasks holds 3 of 3"), "{why}");
    // Another identity is not held back.
    assert!(c.cli_as("r", &["submit", "--", "true"]).status.success());
    // Once one ends there is room again.
    let (session, task) = &live[0];
    assert!(c.cli_as(session, &["kill", task]).status.success());
    let ended = eventually(Duration::from_secs(30), || get(session, task).filter(|v| v["status"] == "killed"));
    assert!(ended.is_some(), "{}", c.logs());
    let again = c.cli_as("q/two", &["submit", "--", "sleep 60"]);
    assert!(again.status.success(), "{}", stderr(&again));
    for (session, task) in live.iter().skip(1) {
        c.cli_as(session, &["kill", task]);
    }
    assert!(!c.logs().contains("panicked"), "{}", c.logs());
}

#[test]
fn a_forged_heartbeat_claiming_the_last_epoch_deposes_nobody() {
    let c = Cluster::start(1);
    let before = c.status().expect("status");
    let epoch = before["leader_epoch"].as_u64().expect("epoch");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let client = tenure_transport::connect(&c.nats_options("worker"), "forger", false).await.expect("connect");
        for worker in ["ghost", "w1"] {
            let worker: tenure_protocol::WorkerId = worker.parse().expect("worker id");
            let hb = Heartbeat {
                boot: None,
                worker: worker.clone(),
                instance: uuid::Uuid::new_v4(),
                slots: 4,
                kinds: vec![Kind::shell()],
                epoch_seen: Epoch(u64::MAX),
                attempts: Vec::new(),
                sidecar: Default::default(),
                replaces: None,
                incarnation: None,
                mark: None,
                labels: Default::default(),
                enforces: Default::default(),
            };
            let bytes = tenure_protocol::encode(&hb).expect("encode");
            client.publish(subjects::heartbeat(&worker), bytes.into()).await.expect("publish");
        }
        client.flush().await.expect("flush");
    });
    // The leader checked the claim against the registry and ignored it.
    let leader_log = || c.log_of("coordinator");
    let checked = eventually(Duration::from_secs(20), || {
        leader_log().contains("claims epoch 18446744073709551615, which no coordinator claimed").then_some(())
    });
    assert!(checked.is_some(), "{}", c.logs());
    assert!(!leader_log().contains("stepping down"), "{}", leader_log());
    let after = c.status().expect("status");
    assert_eq!(after["leader_epoch"].as_u64(), Some(epoch));
    let ghost = after["workers"].as_array().and_then(|ws| ws.iter().find(|w| w["id"] == "ghost").cloned());
    assert_eq!(ghost.map(|g| g["unproven_epoch"].clone()), Some(serde_json::json!(u64::MAX)));
    let text = stdout(&c.cli(&["status", "--once"]));
    assert!(text.contains("ghost: claims epoch 18446744073709551615"), "{text}");
    // A new task runs, on the real worker, under the same epoch.
    let task = c.submit(&["--", "echo ok"]);
    let done = c.wait_status(&task, "completed", Duration::from_secs(30));
    assert_eq!((done["worker"].as_str(), done["epoch"].as_u64()), (Some("w1"), Some(epoch)));
}

#[test]
fn quota_and_stream_limits_are_in_the_printed_configuration() {
    let out = std::process::Command::new(common::BIN)
        .args(["coordinator", "--max-live-tasks", "7", "--registry-max-bytes", "104857600", "--print-config"])
        .env("TENURE_MAX_KEPT_TASKS", "0")
        .output()
        .expect("run tenure");
    assert!(out.status.success(), "{}", stderr(&out));
    let shown = stdout(&out);
    for line in
        ["max_live_tasks = 7", "max_kept_tasks = 0", "registry_max_bytes = 104857600", "notices_max_consumers = 4096"]
    {
        assert!(shown.contains(line), "{line} missing from:\n{shown}");
    }
    let bad = std::process::Command::new(common::BIN)
        .args(["coordinator", "--registry-max-bytes", "1000", "--print-config"])
        .output()
        .expect("run tenure");
    assert!(!bad.status.success() && stderr(&bad).contains("registry_max_bytes"), "{}", stderr(&bad));
}

/// A registry near its byte limit refuses new tasks with a clear error, and
/// the task already running records its end.
#[test]
fn a_full_registry_refuses_new_tasks_and_the_running_one_finishes() {
    let nats = tenure_testkit::NatsCluster::single(tenure_testkit::NatsServer::start().expect("nats-server"));
    let mut c = Cluster::on(nats, None);
    c.spawn_coordinator("c1", &["--registry-max-bytes", "67108864"]);
    c.wait_leader("c1");
    c.start_worker("w1");
    c.wait_workers(1);
    let gate = c.dir.path().join("gate");
    let hold = format!("while [ ! -e {} ]; do sleep 0.05; done; echo released", gate.display());
    // Each task keeps a large environment and a final output: ≈ 130 KiB of
    // registry at its largest, counted while it is live.
    let spec = |command: &str| TaskSpec {
        final_output: true,
        env: [("PAD".to_owned(), "x".repeat(60_000))].into(),
        ..TaskSpec::shell("fill", command)
    };
    let owner: SessionId = "filler".parse().expect("session");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let (first, refusal, accepted) = rt.block_on(async {
        let client = tenure_transport::connect(&c.nats_options("client"), "limits-test", false).await.expect("connect");
        let first = submit(&client, &owner, spec(&hold)).await;
        let mut accepted = 1;
        let refusal = loop {
            match submit(&client, &owner, spec("true")).await {
                Ok(_) => accepted += 1,
                Err(e) => break e,
            }
            assert!(accepted < 2000, "never refused");
        };
        (first, refusal, accepted)
    });
    let Ok(ApiResponse::Submitted { task: first, .. }) = first else { panic!("{first:?}") };
    assert!(matches!(refusal, ApiError::RegistryFull { max: 67108864, .. }), "{refusal:?} after {accepted}");
    assert!(refusal.to_string().contains("the registry is full"), "{refusal}");
    assert!(accepted > 100, "refused after only {accepted} tasks");
    // The task that was running (and those queued) still record their ends.
    std::fs::write(&gate, b"").expect("open the gate");
    let get = |task: &str| -> Option<serde_json::Value> {
        serde_json::from_slice(&c.cli_as("filler", &["get", task, "--json"]).stdout).ok()
    };
    let done = eventually(Duration::from_secs(60), || get(&first.to_string()).filter(|v| v["status"] == "completed"));
    assert!(done.is_some(), "{:?}\n{}", get(&first.to_string()), c.logs());
    let output = c.cli_as("filler", &["logs", &first.to_string()]);
    assert_eq!(stdout(&output).trim(), "released", "{}", stderr(&output));
}

/// Tasks that end together share registry messages (durability note a20),
/// and each one's next record goes on its own subject without replacing
/// its end there: a registry filled with such ended tasks refuses new
/// tasks before their next records could find it full. Every third one is
/// then reported (an append each, and no end message is emptied, so none is
/// retired to make room), and the leader stays.
#[test]
fn a_registry_full_of_tasks_that_ended_together_still_records_their_reports() {
    use tenure_protocol::messages::{BatchTask, SubmitBatch};
    let nats = tenure_testkit::NatsCluster::single(tenure_testkit::NatsServer::start().expect("nats-server"));
    let mut c = Cluster::on(nats, None);
    c.spawn_coordinator("c1", &["--registry-max-bytes", "67108864"]);
    c.wait_leader("c1");
    // A busy worker: its reports go together, and so do their ends.
    c.spawn_sidecar("w1");
    c.spawn_worker_with_slots("w1", 64, &[]);
    c.wait_workers(1);
    let epoch = c.status().map(|s| s["leader"]["epoch"].clone()).expect("status");
    // ≈ 30 KiB records: about thirty ends to a message.
    let spec = || TaskSpec {
        kind: "noop".parse().expect("kind"),
        env: [("PAD".to_owned(), "x".repeat(30_000))].into(),
        ..TaskSpec::shell("fill", "-")
    };
    let owner: SessionId = "filler".parse().expect("session");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let nc = tenure_transport::connect(&c.nats_options("client"), "limits-test", false).await.expect("connect");
        let api = tenure_client::Client::new(nc.clone(), owner.clone());
        let call = |request: ApiRequest| {
            let api = api.clone();
            async move { api.call(&request, Duration::from_secs(20)).await }
        };
        // Filled until refused twice with a sample of the stream between
        // (the leader samples it every 5 s): what a finished task released
        // of its reserve is counted until the next sample.
        let mut ids = Vec::new();
        let mut refused = Vec::new();
        while refused.len() < 2 {
            let tasks = (0..25).map(|_| BatchTask { idempotency_key: uuid::Uuid::new_v4(), spec: spec() }).collect();
            match call(ApiRequest::SubmitBatch(SubmitBatch { session: owner.clone(), tasks })).await {
                Ok(ApiResponse::SubmittedBatch(done)) => {
                    ids.extend(done.into_iter().map(|d| d.task));
                    refused.clear();
                }
                Err(tenure_client::Error::Api(refusal)) => {
                    refused.push(refusal);
                    tokio::time::sleep(Duration::from_secs(6)).await;
                }
                other => panic!("{other:?}"),
            }
            assert!(ids.len() < 10_000, "never refused");
        }
        let refusal = refused.pop().expect("refused");
        assert!(refusal.to_string().contains("the registry is full"), "{refusal}");
        assert!(ids.len() > 500, "refused after only {} tasks", ids.len());
        for id in &ids {
            let get = || call(ApiRequest::Get { session: owner.clone(), task: id.clone() });
            let mut status = None;
            for _ in 0..600 {
                let Ok(ApiResponse::Snapshot(s)) = get().await else { panic!("{id}: no snapshot") };
                status = Some(s.status);
                if s.status.is_terminal() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert_eq!(status, Some(tenure_protocol::Status::Completed), "{id}\n{}", c.logs());
        }
        let js = async_nats::jetstream::new(nc.clone());
        let stream = js.get_stream(subjects::REGISTRY_STREAM).await.expect("registry");
        let mut names =
            stream.info_with_subjects(format!("{}>", subjects::REGISTRY_BATCH_PREFIX)).await.expect("subjects");
        let mut ended = 0;
        while let Some(Ok((subject, _))) = futures::StreamExt::next(&mut names).await {
            ended += usize::from(subject.ends_with(".ended"));
        }
        assert!(ended * 10 > ids.len() / 30, "{ended} end messages for {} tasks", ids.len());
        for id in ids.iter().step_by(3) {
            let marked = call(ApiRequest::MarkReported { session: owner.clone(), task: id.clone() }).await;
            let Ok(ApiResponse::Snapshot(s)) = marked else { panic!("{id}: {marked:?}\n{}", c.logs()) };
            assert!(s.reported, "{id}");
        }
    });
    let leader = c.status().map(|s| (s["leader"]["name"].clone(), s["leader"]["epoch"].clone()));
    assert_eq!(leader, Some(("c1".into(), epoch)), "the leader stayed\n{}", c.logs());
}
