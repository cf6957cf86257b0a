//! `tenure submit --batch` over a real cluster: tasks from JSON Lines (a file
//! or stdin), ids printed in order, a line's idempotency key making a re-run
//! return its task, and every refusal naming its line with nothing stored
//! from the batch it was in.

mod common;

use std::time::Duration;

use common::{stderr, stdout, Cluster};

const BOUND: Duration = Duration::from_secs(60);

fn ids(out: &std::process::Output) -> Vec<String> {
    stdout(out).lines().map(str::to_owned).collect()
}

/// How many tasks the session has (every one, reported or not).
fn count(c: &Cluster) -> usize {
    let out = c.cli(&["ls", "--all", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice::<Vec<serde_json::Value>>(&out.stdout).expect("ls json").len()
}

/// `tenure submit --batch -` fed `input` on stdin.
fn batch_from_stdin(c: &Cluster, input: &str) -> std::process::Output {
    c.cli_with_stdin(&["submit", "--batch", "-"], input.as_bytes())
}

#[test]
fn a_batch_file_submits_its_tasks_in_order_and_a_rerun_returns_them() {
    let c = Cluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tasks.jsonl");
    std::fs::write(
        &file,
        concat!(
            r#"{"command": "echo first", "idempotency_key": "job-1"}"#,
            "\n\n",
            r#"{"command": "echo second", "label": "two", "idempotency_key": "job-2"}"#,
            "\n",
            r#"{"kind": "noop", "command": "-", "idempotent": true, "idempotency_key": "job-3"}"#,
            "\n",
        ),
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let out = c.cli(&["submit", "--batch", path]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first = ids(&out);
    assert_eq!(first.len(), 3, "{first:?}");
    assert!(first[0].starts_with("shell-") && first[2].starts_with("noop-"), "{first:?}");
    let numbers: Vec<u64> = first.iter().map(|id| id.rsplit('-').next().unwrap().parse().unwrap()).collect();
    assert!(numbers.windows(2).all(|w| w[0] < w[1]), "ids in the file's order: {first:?}");
    for id in &first {
        c.wait_status(id, "completed", BOUND);
    }
    assert_eq!(stdout(&c.cli(&["logs", &first[0]])).trim(), "first");
    assert_eq!(c.snapshot(&first[1])["label"], "two");

    // The same file again: the keys return the same tasks, none is added.
    let again = c.cli(&["submit", "--batch", path]);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(ids(&again), first);
    assert_eq!(count(&c), 3);
}

#[test]
fn a_refused_line_is_named_and_nothing_of_its_batch_is_stored() {
    let c = Cluster::start(1);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tasks.jsonl");
    let path = file.to_str().unwrap();

    // Refused by the leader (a kind no worker runs): nothing is created.
    std::fs::write(&file, "{\"command\": \"true\"}\n{\"kind\": \"gpu-job\", \"command\": \"train\"}\n").unwrap();
    let out = c.cli(&["submit", "--batch", path]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("line 2") && err.contains("gpu-job") && err.contains("nothing"), "{err}");
    assert!(stdout(&out).is_empty(), "no id printed: {}", stdout(&out));
    // Refused here (not JSON; a field the API does not know): nothing is sent.
    std::fs::write(&file, "{\"command\": \"true\"}\nnot json\n").unwrap();
    let err = stderr(&c.cli(&["submit", "--batch", path]));
    assert!(err.contains("line 2"), "{err}");
    std::fs::write(&file, "{\"command\": \"true\", \"colour\": \"red\"}\n").unwrap();
    let err = stderr(&c.cli(&["submit", "--batch", path]));
    assert!(err.contains("line 1") && err.contains("colour"), "{err}");
    // A batch with a command of its own is refused by the parser.
    let out = c.cli(&["submit", "--batch", path, "--", "echo", "hi"]);
    assert!(!out.status.success() && stderr(&out).contains("cannot be used with"), "{}", stderr(&out));
    assert_eq!(count(&c), 0, "nothing was stored");
}

#[test]
fn a_long_batch_from_stdin_goes_in_requests_of_a_thousand_each_all_or_nothing() {
    let c = Cluster::start(1);
    // Held for approval: counted, never run (the suite's debug cluster
    // would take minutes to run them all).
    let noop = "{\"kind\": \"noop\", \"command\": \"-\", \"hold\": true}\n";
    // 1 500 tasks: the leader takes the first 1 000, then refuses the
    // second request for its line 1 200.
    let mut input = noop.repeat(1199);
    input.push_str("{\"kind\": \"noop\", \"command\": \"-\", \"retries\": 2}\n");
    input.push_str(&noop.repeat(300));
    let out = batch_from_stdin(&c, &input);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("line 1200") && err.contains("nothing from line 1001 on"), "{err}");
    assert!(err.contains("the 1000 tasks of the lines before 1001 were submitted"), "{err}");
    assert_eq!(ids(&out).len(), 1000, "the first request's ids are printed");
    assert_eq!(count(&c), 1000);

    // All good: 1 500 tasks in two requests, each id once, in order.
    let out = batch_from_stdin(&c, &noop.repeat(1500));
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = ids(&out);
    let numbers: Vec<u64> = ids.iter().map(|id| id.rsplit('-').next().unwrap().parse().unwrap()).collect();
    assert_eq!(numbers.len(), 1500);
    assert!(numbers.windows(2).all(|w| w[0] < w[1]), "ids in order");
    assert_eq!(count(&c), 2500);
    assert_eq!(c.snapshot(&ids[1499])["status"], "blocked", "held, as its line asked");
}

/// `Client::run`: one request submits a task and answers with its end
/// (reported, as a wait's); run again with the same key, it answers with the
/// same task's end at once and creates nothing.
#[test]
fn run_submits_and_returns_the_end_in_one_request() {
    let c = Cluster::start(1);
    c.wait_workers(1);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let owner: tenure_protocol::SessionId = "runner".parse().expect("session");
    rt.block_on(async {
        let client = tenure_client::Client::connect(&c.nats_options("client"), "run-test", false, owner.clone())
            .await
            .expect("connect");
        let req = tenure_protocol::messages::SubmitRequest {
            session: owner.clone(),
            idempotency_key: uuid::Uuid::new_v4(),
            spec: tenure_protocol::TaskSpec::shell("ran", "echo ran"),
        };
        let end = tokio::time::timeout(BOUND, client.run(req.clone())).await.expect("in time").expect("run");
        assert_eq!((end.status, end.reported, end.exit_code), (tenure_protocol::Status::Completed, true, Some(0)));
        let again = tokio::time::timeout(BOUND, client.run(req)).await.expect("in time").expect("run again");
        assert_eq!(again.id, end.id, "the same key runs nothing new");
        assert_eq!(client.list(true).await.expect("list").len(), 1);
    });
}

/// The registry's messages on batch subjects: (subject, payload bytes).
fn batch_messages(c: &Cluster) -> Vec<(String, usize)> {
    use futures::StreamExt;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(&c.nats.url).await.expect("connect"));
        let stream = js.get_stream(tenure_protocol::subjects::REGISTRY_STREAM).await.expect("registry");
        let filter = format!("{}>", tenure_protocol::subjects::REGISTRY_BATCH_PREFIX);
        let mut subjects = stream.info_with_subjects(filter).await.expect("subjects");
        let mut out = Vec::new();
        while let Some(subject) = subjects.next().await {
            let (subject, _) = subject.expect("subject");
            let msg = stream.get_last_raw_message_by_subject(&subject).await.expect("message");
            out.push((subject, msg.payload.len()));
        }
        out
    })
}

/// A batch's tasks are stored in one registry message; a standby that takes
/// over loads every one of them from it; once each task has a later record
/// of its own, the leader compacts the message to a tombstone.
#[test]
fn a_batch_is_one_registry_message_that_a_new_leader_loads_and_that_is_retired_once_its_tasks_moved_on() {
    let mut c = Cluster::start_coordinators(2, 1, &[]);
    let held = "{\"kind\": \"noop\", \"command\": \"-\", \"hold\": true}\n";
    let out = batch_from_stdin(&c, &held.repeat(20));
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = ids(&out);
    assert_eq!(ids.len(), 20);
    let batches = batch_messages(&c);
    assert_eq!(batches.len(), 1, "one message for the batch: {batches:?}");
    assert!(batches[0].1 > 20 * 100, "it holds the 20 records: {batches:?}");

    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    assert_eq!(count(&c), 20, "the new leader loaded every task of the batch");
    assert_eq!(c.snapshot(&ids[7])["status"], "blocked");

    // Each task moves on (killed while held): its record goes on its own subject.
    for id in &ids[..19] {
        let out = c.cli(&["kill", id]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    assert!(batch_messages(&c)[0].1 > 100, "one task's latest record is still in the batch");
    let out = c.cli(&["kill", &ids[19]]);
    assert!(out.status.success(), "{}", stderr(&out));
    let retired = tenure_testkit::eventually(BOUND, || {
        let b = batch_messages(&c);
        (b.len() == 1 && b[0].1 < 64).then_some(b)
    });
    assert!(retired.is_some(), "the batch was never retired: {:?}\n{}", batch_messages(&c), c.logs());
    assert_eq!(c.snapshot(&ids[19])["status"], "killed");
    assert_eq!(count(&c), 20);
}

/// Tasks granted in one scheduling pass share registry messages: their first
/// grants go in one message of their own (`….granted`), which a standby that
/// takes over loads while the attempts have not started, and which is retired
/// once each task moved on. No task runs twice.
#[test]
fn granted_tasks_share_registry_messages_that_a_new_leader_loads_and_retires() {
    use nix::sys::signal::Signal;
    let mut c = Cluster::start_coordinators(2, 1, &[]);
    let gate = c.dir.path().join("gate");
    let runs = c.dir.path().join("runs");
    // Queued for two seconds, then due together: one pass grants all four
    // (the worker's slots).
    let command = format!("while [ ! -e {} ]; do sleep 0.05; done; echo ran >> {}", gate.display(), runs.display());
    let line = serde_json::json!({ "command": command, "not_before_in_ms": 2000 }).to_string() + "\n";
    let out = batch_from_stdin(&c, &line.repeat(4));
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = ids(&out);
    assert_eq!(ids.len(), 4);
    // The worker stops before they are due: their grants are stored, none is answered.
    c.signal("worker-w1", Signal::SIGSTOP);
    let granted =
        |c: &Cluster| batch_messages(c).into_iter().filter(|(s, _)| s.ends_with(".granted")).collect::<Vec<_>>();
    let stored = tenure_testkit::eventually(BOUND, || Some(granted(&c)).filter(|g| !g.is_empty()));
    let Some(stored) = stored else { panic!("no grant batch: {:?}\n{}", batch_messages(&c), c.logs()) };
    assert_eq!(stored.len(), 1, "one message for the four grants: {stored:?}");
    assert!(stored[0].1 > 4 * 100, "it holds the four records: {stored:?}");

    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    assert_eq!(count(&c), 4, "the new leader loaded every task");
    for id in &ids {
        let attempt = c.snapshot(id)["attempt"].as_u64();
        assert!(attempt.is_some_and(|a| a >= 1), "{id} was loaded with its grant: attempt {attempt:?}");
    }

    c.signal("worker-w1", Signal::SIGCONT);
    std::fs::write(&gate, b"").expect("open the gate");
    for id in &ids {
        c.wait_status(id, "completed", BOUND);
    }
    let ran = std::fs::read_to_string(&runs).expect("runs");
    assert_eq!(ran.lines().count(), 4, "each task ran once: {ran:?}");
    // Every task moved on: both batches are retired.
    let retired = tenure_testkit::eventually(BOUND, || {
        let b = batch_messages(&c);
        (b.len() == 2 && b.iter().all(|(_, bytes)| *bytes < 64)).then_some(b)
    });
    assert!(retired.is_some(), "not retired: {:?}\n{}", batch_messages(&c), c.logs());
}

/// Tasks that end together share a registry message (`….ended`, durability
/// note a20): a standby that takes over loads them ended, from it; each
/// task's next record (its owner receiving its end) goes on its own subject,
/// and once every one moved on, the message is retired.
#[test]
fn ended_tasks_share_a_registry_message_that_a_new_leader_loads_and_retires() {
    let mut c = Cluster::start_coordinators(2, 1, &[]);
    let noop = "{\"kind\": \"noop\", \"command\": \"-\"}\n";
    let out = batch_from_stdin(&c, &noop.repeat(40));
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = ids(&out);
    assert_eq!(ids.len(), 40);
    for id in &ids {
        c.wait_status(id, "completed", BOUND);
    }
    let ended = |c: &Cluster| {
        let live = batch_messages(c).into_iter().filter(|(s, bytes)| s.ends_with(".ended") && *bytes >= 64);
        live.collect::<Vec<_>>()
    };
    let stored = ended(&c);
    assert!(!stored.is_empty(), "no end shared a message: {:?}\n{}", batch_messages(&c), c.logs());

    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    assert_eq!(count(&c), 40, "the new leader loaded every task");
    for id in &ids {
        assert_eq!(c.snapshot(id)["status"], "completed", "{id} was loaded ended");
    }
    // Each owner receives its task's end: the ended messages go.
    for id in &ids {
        let out = c.cli(&["wait", id]);
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let retired = tenure_testkit::eventually(BOUND, || {
        let b = batch_messages(&c);
        b.iter().all(|(_, bytes)| *bytes < 64).then_some(b)
    });
    assert!(retired.is_some(), "not retired: {:?}\n{}", batch_messages(&c), c.logs());
    // The tasks the new leader creates end together again.
    let out = batch_from_stdin(&c, &noop.repeat(20));
    assert!(out.status.success(), "{}", stderr(&out));
    for id in stdout(&out).lines() {
        c.wait_status(id, "completed", BOUND);
    }
    assert!(!ended(&c).is_empty(), "{:?}", batch_messages(&c));
}
