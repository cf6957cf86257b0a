//! The `agent` kind and `tenure send`, as a new user meets them: an agent task
//! whose stdin stays open, fed line by line and read back with `logs -f`;
//! input that reaches the task while its worker is dead; and every refusal.

mod common;

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::{stderr, stdout, Cluster, BIN};
use tenure_machine::attempt_files::AttemptFiles;
use tenure_protocol::messages::{ApiError, InputReply, InputRequest, MAX_INPUT_BYTES};
use tenure_protocol::{subjects, WorkerId};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

/// A shell loop that answers every line it reads: the smallest "agent".
const ECHO_AGENT: &str = r#"while read -r line; do echo "got: $line"; done"#;

/// `tenure send` with `input` on its stdin.
fn send_stdin(c: &Cluster, args: &[&str], input: &[u8]) -> Output {
    let mut full = vec!["send"];
    full.extend_from_slice(args);
    c.cli_with_stdin(&full, input)
}

fn send(c: &Cluster, task: &str, text: &str) {
    let out = c.cli(&["send", task, text]);
    assert!(out.status.success(), "send {text:?} failed: {}\n{}", stderr(&out), c.logs());
}

fn logs(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

fn wait_output(c: &Cluster, task: &str, needle: &str) {
    let seen = eventually(BOUND, || logs(c, task).contains(needle).then_some(()));
    assert!(seen.is_some(), "{needle:?} never appeared in {task}'s output: {:?}\n{}", logs(c, task), c.logs());
}

/// `tenure logs --follow` running in the background.
fn follow(c: &Cluster, task: &str) -> Child {
    Command::new(BIN)
        .args(["--nats", &c.nats.url, "--session", &c.session, "logs", "--follow", task])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run tenure logs -f")
}

/// Waits (bounded) for a follower to end by itself; returns what it printed.
fn followed(mut child: Child) -> String {
    let ended = eventually(BOUND, || child.try_wait().ok().flatten());
    if ended.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("logs --follow did not end with the task");
    }
    let mut text = String::new();
    child.stdout.take().expect("stdout").read_to_string(&mut text).expect("read follower");
    text
}

/// An input request straight to a machine's sidecar, bypassing the CLI's checks.
fn sidecar_input(c: &Cluster, worker: &str, session: &str, task: &str, data: Vec<u8>) -> InputReply {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let client = async_nats::connect(&c.nats.url).await.expect("connect");
        let worker: WorkerId = worker.parse().expect("worker id");
        let req = InputRequest { session: session.parse().expect("session"), task: task.parse().expect("task"), data };
        tenure_transport::request(&client, subjects::input(&worker), &req, Duration::from_secs(5))
            .await
            .expect("the sidecar answers")
    })
}

/// As a new user: an agent task answers three sends, in order, read back with
/// `logs -f`; a message from stdin and messages larger than `PIPE_BUF`, sent
/// concurrently, arrive whole; `kill` ends it as killed.
#[test]
fn an_agent_task_answers_what_it_is_sent_in_order() {
    let c = Cluster::start(1);
    let task = c.submit(&["--kind", "agent", "--", ECHO_AGENT]);
    assert!(task.starts_with("agent-"), "{task}");
    c.wait_status(&task, "running", BOUND);
    let follower = follow(&c, &task);

    for line in ["one", "two words", "three"] {
        send(&c, &task, line);
    }
    let out = send_stdin(&c, &[&task], b"four, from stdin\n");
    assert!(out.status.success(), "{}", stderr(&out));
    wait_output(&c, &task, "got: four, from stdin\n");

    // Larger than a pipe's atomic write, four senders at once: each line whole.
    let big: Vec<String> = (0..4).map(|i| format!("{i}{}", "x".repeat(8000))).collect();
    let senders: Vec<_> = big
        .iter()
        .map(|line| {
            let (url, session, task, line) = (c.nats.url.clone(), c.session.clone(), task.clone(), line.clone());
            std::thread::spawn(move || {
                Command::new(BIN)
                    .args(["--nats", &url, "--session", &session, "send", &task, &line])
                    .output()
                    .expect("run tenure send")
            })
        })
        .collect();
    for sender in senders {
        let out = sender.join().expect("sender thread");
        assert!(out.status.success(), "{}", stderr(&out));
    }
    for line in &big {
        wait_output(&c, &task, &format!("got: {line}\n"));
    }

    let out = c.cli(&["kill", &task]);
    assert!(out.status.success(), "{}", stderr(&out));
    c.wait_status(&task, "killed", BOUND);
    let text = followed(follower);
    let expected = "got: one\ngot: two words\ngot: three\ngot: four, from stdin\n";
    assert!(text.starts_with(expected), "{text:?}");
    let mut rest: Vec<&str> = text[expected.len()..].lines().collect();
    rest.sort_unstable();
    let mut want: Vec<String> = big.iter().map(|l| format!("got: {l}")).collect();
    want.sort_unstable();
    assert_eq!(rest, want, "each large message arrived once and whole");
    // The input pipe went with the task.
    let files = AttemptFiles::new(c.worker_dir("w1").join("attempts").join(format!("{task}.1")));
    assert!(std::fs::symlink_metadata(files.input_path()).is_err());
}

/// Input goes through the machine's sidecar to a FIFO the task's shim holds,
/// so it reaches the task while its worker is dead and after it restarted:
/// every line once, in order.
#[test]
fn input_reaches_an_agent_while_its_worker_is_dead_and_after_it_restarts() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--kind", "agent", "--", ECHO_AGENT]);
    c.wait_status(&task, "running", BOUND);
    send(&c, &task, "before");
    wait_output(&c, &task, "got: before\n");

    c.kill9("worker-w1");
    send(&c, &task, "while the worker is dead");
    wait_output(&c, &task, "got: while the worker is dead\n");

    c.spawn_worker("w1", &[]);
    let reattached = eventually(BOUND, || c.daemon("worker-w1").log_text().contains("re-attaching").then_some(()));
    assert!(reattached.is_some(), "{}", c.logs());
    send(&c, &task, "after the restart");
    wait_output(&c, &task, "got: after the restart\n");
    assert_eq!(logs(&c, &task), "got: before\ngot: while the worker is dead\ngot: after the restart\n");

    let out = c.cli(&["kill", &task]);
    assert!(out.status.success(), "{}", stderr(&out));
    let snap = c.wait_status(&task, "killed", BOUND);
    assert_eq!(snap["attempt"], 1, "the agent was never started again");
}

/// Every way to send wrongly gets a clear error and delivers nothing.
#[test]
fn sends_that_cannot_be_delivered_are_refused_clearly() {
    let c = Cluster::start(1);
    let agent = c.submit(&["--kind", "agent", "--", ECHO_AGENT]);
    let shell = c.submit(&["--", "sleep 30"]);
    let done = c.submit(&["--kind", "agent", "--", "echo finished"]);
    c.wait_status(&agent, "running", BOUND);
    c.wait_status(&shell, "running", BOUND);
    c.wait_status(&done, "completed", BOUND);
    let refused = |out: Output, needle: &str| {
        assert!(!out.status.success(), "should be refused ({needle}): {}", stdout(&out));
        assert!(stderr(&out).contains(needle), "expected {needle:?} in {:?}", stderr(&out));
    };

    // Another session's task, as the CLI sees it and straight at the sidecar.
    refused(c.cli_as("intruder", &["send", &agent, "hello"]), "not found or not yours");
    let direct = sidecar_input(&c, "w1", "intruder", &agent, b"hello\n".to_vec());
    assert_eq!(direct, Err(ApiError::NotFound(agent.clone())));
    // A task that is not an agent.
    refused(c.cli(&["send", &shell, "hello"]), "is a shell task and takes no input");
    let direct = sidecar_input(&c, "w1", &c.session, &shell, b"hello\n".to_vec());
    assert!(matches!(direct, Err(ApiError::NoInput { .. })), "{direct:?}");
    // A finished agent.
    refused(c.cli(&["send", &done, "hello"]), "is not running (it is completed)");
    let direct = sidecar_input(&c, "w1", &c.session, &done, b"hello\n".to_vec());
    assert!(matches!(direct, Err(ApiError::NotRunning { .. })), "{direct:?}");
    // No such task.
    refused(c.cli(&["send", "agent-999", "hello"]), "task agent-999 not found or not yours");
    // Too large, from the command line, from stdin, and straight at the sidecar.
    let huge = "x".repeat(MAX_INPUT_BYTES + 1);
    refused(c.cli(&["send", &agent, &huge]), "one message holds 1 to 65536 bytes");
    refused(send_stdin(&c, &[&agent], huge.as_bytes()), "larger than 65536 bytes");
    let direct = sidecar_input(&c, "w1", &c.session, &agent, huge.into_bytes());
    assert!(matches!(direct, Err(ApiError::InputSize { .. })), "{direct:?}");
    refused(c.cli(&["send", &agent, "--raw", ""]), "input of 0 bytes refused");

    // None of it reached the agent; a proper send still does.
    send(&c, &agent, "welcome");
    wait_output(&c, &agent, "got: welcome\n");
    assert_eq!(logs(&c, &agent), "got: welcome\n");
    for task in [&agent, &shell] {
        assert!(c.cli(&["kill", task]).status.success());
    }
}

/// Kinds are an open namespace: a worker runs what it advertises, and a kind no
/// worker advertises is refused at submit.
#[test]
fn an_agent_task_is_refused_while_no_worker_runs_agents() {
    let c = Cluster::start_with_worker(&["--kinds", "shell"]);
    let out = c.cli(&["submit", "--kind", "agent", "--", ECHO_AGENT]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(r#"unknown kind "agent": no worker runs it (kinds known: shell, workflow)"#),
        "{}",
        stderr(&out)
    );
    let status = stdout(&c.cli(&["status"]));
    assert!(status.lines().any(|l| l.starts_with("w1") && l.ends_with(" shell")), "{status}");
    let task = c.submit(&["--", "echo fine"]);
    c.wait_status(&task, "completed", BOUND);
}

/// An agent blocked reading its input shows `waiting` (in `get` and `ls`),
/// `running` again while it works on what it was sent, `waiting` at its
/// next read; an agent that reads nothing never shows it.
#[test]
fn an_agent_reading_its_input_shows_waiting_and_running_once_it_has_some() {
    let c = Cluster::start(1);
    let task = c.submit(&["--kind", "agent", "--", r#"read -r a; echo "got $a"; sleep 5; read -r b; echo "then $b""#]);
    let busy = c.submit(&["--kind", "agent", "--", "sleep 60"]);
    let is = |t: &str, status: &str| eventually(BOUND, || c.try_snapshot(t).filter(|s| s["status"] == status));
    assert!(is(&task, "waiting").is_some(), "never waiting: {:?}", c.try_snapshot(&task));
    let listed = stdout(&c.cli(&["ls"]));
    assert!(listed.lines().any(|l| l.contains(&task) && l.contains("waiting")), "{listed}");

    send(&c, &task, "one");
    wait_output(&c, &task, "got one\n");
    assert!(is(&task, "running").is_some(), "still waiting while it works: {:?}", c.try_snapshot(&task));
    assert!(is(&task, "waiting").is_some(), "its second read");
    send(&c, &task, "two");
    c.wait_status(&task, "completed", BOUND);
    assert_eq!(logs(&c, &task), "got one\nthen two\n");

    // Reading nothing is not waiting: by now `busy` has run through the
    // many heartbeats the reader above took (a five-second sleep among them).
    for _ in 0..5 {
        assert_eq!(c.snapshot(&busy)["status"], "running");
    }
    assert!(c.cli(&["kill", &busy]).status.success());
}
