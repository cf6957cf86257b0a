//! Resuming an agent instead of losing it, with the real binaries: an
//! `agent` task that prints its session id and declares how to resume it
//! (`--resume-command`, `--capture`) loses its machine; input sent during
//! the outage is kept; once the machine proves the process gone (it comes
//! back on another boot), the task is resumed with its captured session —
//! on the same machine, or, with `--resume-anywhere`, on another — and the
//! kept input arrives once.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{stderr, stdout, Cluster};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(60);

/// A stand-in for a coding agent: a new session prints its id; `--resume
/// ID` picks that session up again. It echoes each line it reads and ends
/// at `bye`.
const AGENT: &str = r#"if [ "$1" = --resume ]; then echo "resumed $2"; else echo "session: abc123"; fi
while read -r line; do
  echo "got: $line"
  [ "$line" = bye ] && exit 0
done
"#;

fn write_agent(c: &Cluster) -> String {
    let path = c.dir.path().join("agent.sh");
    std::fs::write(&path, AGENT).expect("write the agent script");
    path.display().to_string()
}

fn submit_agent(c: &Cluster, script: &str, extra: &[&str]) -> String {
    let resume = format!("sh {script} --resume {{session}}");
    let mut args = vec!["--kind", "agent", "--resume-command", &resume, "--capture", r"session: (\S+)"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", script]);
    c.submit(&args)
}

fn logs(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

/// A cluster whose machine w1 (on boot `boot-1`) runs the agent, which
/// printed its session and had it captured; w2, another machine that runs
/// agents, has joined since.
fn agent_on_w1(extra: &[&str]) -> (Cluster, String) {
    let mut c = Cluster::start(0);
    let script = write_agent(&c);
    c.start_machine_on_boot("w1", "boot-1", &["--no-cgroups"]);
    c.wait_workers(1);
    let task = submit_agent(&c, &script, extra);
    wait_output(&c, &task, "session: abc123");
    wait_captured(&c, &task);
    c.start_worker("w2");
    c.wait_workers(2);
    (c, task)
}

/// Waits until the leader recorded the captured session.
fn wait_captured(c: &Cluster, task: &str) {
    let captured = eventually(BOUND, || {
        let s = c.try_snapshot(task)?;
        (s["agent_resume"]["captured"]["session"] == "abc123").then_some(())
    });
    assert!(captured.is_some(), "{task} never captured its session: {}\n{}", c.snapshot(task), c.logs());
}

/// Sends `text` to `task`, which must succeed.
fn send(c: &Cluster, task: &str, text: &str) -> String {
    let out = c.cli(&["send", task, text]);
    assert!(out.status.success(), "send {text:?} failed: {}", stderr(&out));
    stderr(&out)
}

/// Waits until attempt 2 of `task` runs; its snapshot.
fn wait_resumed(c: &Cluster, task: &str) -> serde_json::Value {
    eventually(BOUND, || {
        let s = c.try_snapshot(task)?;
        let running = ["running", "waiting"].contains(&s["status"].as_str()?);
        (running && s["attempt"] == 2).then_some(s)
    })
    .unwrap_or_else(|| panic!("{task} was not resumed: {}\n{}", c.snapshot(task), c.logs()))
}

fn wait_output(c: &Cluster, task: &str, text: &str) -> String {
    eventually(BOUND, || Some(logs(c, task)).filter(|l| l.contains(text)))
        .unwrap_or_else(|| panic!("{task}'s output never showed {text:?}: {}\n{}", logs(c, task), c.logs()))
}

/// The machine lost power and stays down: its task is `unknown`, a message
/// sent now is kept for the resumed attempt, and nothing resumes without
/// the machine's proof.
fn lose_machine_and_keep_input(c: &mut Cluster, task: &str) {
    c.kill_machine("w1");
    c.wait_status(task, "unknown", BOUND);
    let said = send(c, task, "hello");
    assert!(said.contains("kept for its resumed attempt"), "{said}");
    let s = c.snapshot(task);
    assert_eq!(s["agent_resume"]["pending_input"], 1, "{s}");
    assert_eq!((s["status"].as_str(), s["attempt"].as_u64()), (Some("unknown"), Some(1)), "not resumed on no proof");
}

/// Ends the task with `bye`, and checks its history and that the kept
/// message arrived once.
fn finish(c: &Cluster, task: &str, resumed_on: &str) {
    send(c, task, "bye");
    let done = c.wait_status(task, "completed", BOUND);
    let out = logs(c, task);
    assert_eq!(out.matches("got: hello").count(), 1, "the kept message arrives once: {out}");
    assert!(out.contains("resumed abc123"), "{out}");
    let first = &done["attempts"][0];
    assert_eq!(first["attempt"], 1, "{done}");
    assert_eq!(first["worker"], "w1", "{done}");
    assert_eq!(first["resumed"]["session"], "abc123", "{done}");
    assert_eq!(done["worker"], resumed_on, "{done}");
    assert_eq!(done["agent_resume"]["resumes"], 1, "{done}");
    assert_eq!(done["agent_resume"]["pending_input"], 0, "{done}");
    let text = stdout(&c.cli(&["get", task]));
    assert!(text.contains("resumed with session=abc123"), "{text}");
}

#[test]
fn an_agent_whose_machine_restarts_resumes_there_with_its_session_and_the_kept_input() {
    // w2 has room, but the session lives on w1: it waits for w1.
    let (mut c, task) = agent_on_w1(&[]);
    lose_machine_and_keep_input(&mut c, &task);

    // The machine comes back after a reboot: its records prove the process
    // died with it.
    c.start_machine_on_boot("w1", "boot-2", &["--no-cgroups"]);
    let s = wait_resumed(&c, &task);
    assert_eq!(s["worker"], "w1", "resumed where its session lives: {s}");
    wait_output(&c, &task, "got: hello");
    finish(&c, &task, "w1");
}

#[test]
fn an_agent_whose_machine_is_wiped_resumes_on_another_worker_with_resume_anywhere() {
    let (mut c, task) = agent_on_w1(&["--resume-anywhere"]);
    lose_machine_and_keep_input(&mut c, &task);

    // The machine is rebuilt: a new boot and an empty data directory. It
    // runs shell tasks only now, so the resume goes elsewhere.
    remove_dir(&c.worker_dir("w1"));
    c.start_machine_on_boot("w1", "boot-2", &["--no-cgroups", "--kinds", "shell"]);
    let s = wait_resumed(&c, &task);
    assert_eq!(s["worker"], "w2", "{s}");
    wait_output(&c, &task, "got: hello");
    finish(&c, &task, "w2");
}

/// A machine that returns on the same boot with its store wiped proves
/// nothing (its process could still run): the task stays `unknown`, and
/// the hint says why it was not resumed.
#[test]
fn a_wiped_store_on_the_same_boot_is_no_proof() {
    let (mut c, task) = agent_on_w1(&["--resume-anywhere"]);
    c.kill_machine("w1");
    remove_dir(&c.worker_dir("w1"));
    c.start_machine_on_boot("w1", "boot-1", &["--no-cgroups"]);
    let s = eventually(BOUND, || {
        let s = c.try_snapshot(&task)?;
        (s["hint"]["tag"] == "machine-replaced").then_some(s)
    })
    .unwrap_or_else(|| panic!("no machine-replaced verdict: {}\n{}", c.snapshot(&task), c.logs()));
    assert_eq!((s["status"].as_str(), s["attempt"].as_u64()), (Some("unknown"), Some(1)), "{s}");
    assert!(s["hint"]["message"].as_str().is_some_and(|m| m.contains("not proven gone")), "{s}");
    let out = c.cli(&["kill", &task]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// Refusals at submit change nothing.
#[test]
fn bad_resume_declarations_are_refused_at_submit() {
    let c = Cluster::start(1);
    for (args, says) in [
        (vec!["--resume-command", "a {session}", "--capture", r"session: (\S+)", "--", "a"], "agent"),
        (
            vec!["--kind", "agent", "--resume-command", "a {sesion}", "--capture", r"session: (\S+)", "--", "a"],
            "sesion",
        ),
        (vec!["--kind", "agent", "--resume-command", "a", "--capture", r"(\S+)", "--", "a"], "name"),
        (vec!["--kind", "agent", "--idempotent", "--resume-command", "a", "--", "a"], "idempotent"),
    ] {
        let mut full = vec!["submit"];
        full.extend_from_slice(&args);
        let out = c.cli(&full);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
    }
    let out = c.cli(&["ls", "--json"]);
    assert_eq!(stdout(&out).trim(), "[]", "nothing was stored");
}

fn remove_dir(dir: &Path) {
    std::fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("wipe {}: {e}", dir.display()));
}
