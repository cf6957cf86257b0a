//! Flow control over a real cluster: a concurrency key caps its running
//! tasks across a leader SIGKILL (an outside ledger of start and end times
//! is the judge), a constrained task waits `blocked` until a worker with
//! its labels joins, and a held task starts only once approved — by whom
//! the policy allows, once, through a failover — while a killed one never
//! runs.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{stderr, stdout, Cluster};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(60);

/// The most intervals of the ledger open at once. Each line is
/// `start|end TASK NANOS`.
fn max_overlap(ledger: &str) -> (usize, usize) {
    let mut events: Vec<(u128, i32)> = ledger
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let edge = match words.next()? {
                "start" => 1,
                "end" => -1,
                _ => return None,
            };
            let at = words.nth(1)?.parse().ok()?;
            Some((at, edge))
        })
        .collect();
    let ends = events.iter().filter(|(_, e)| *e < 0).count();
    // An end and a start at the same instant: the end first.
    events.sort();
    let (mut open, mut most) = (0i32, 0i32);
    for (_, edge) in events {
        open += edge;
        most = most.max(open);
    }
    (most as usize, ends)
}

fn ledger_task(ledger: &Path, name: &str) -> String {
    let l = ledger.display();
    format!("echo start {name} $(date +%s%N) >> {l}; sleep 0.4; echo end {name} $(date +%s%N) >> {l}")
}

#[test]
fn twelve_tasks_on_a_key_with_limit_three_never_overlap_more_than_three_across_a_leader_kill() {
    let mut c = Cluster::start_coordinators(2, 2, &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = dir.path().join("ledger");
    let tasks: Vec<String> = (0..12)
        .map(|i| {
            let key = ["--concurrency-key", "llm", "--concurrency-limit", "3"];
            let cmd = ledger_task(&ledger, &format!("t{i}"));
            c.submit(&[&key[..], &["--", &cmd]].concat())
        })
        .collect();
    // The last one waits for the key, and says so.
    let last = c.snapshot(&tasks[11]);
    assert_eq!((&last["status"], &last["hint"]["tag"]), (&"blocked".into(), &"concurrency-limit".into()), "{last}");
    let text = stdout(&c.cli(&["get", &tasks[11]]));
    assert!(text.contains("concurrency key: llm (limit 3)") && text.contains("is full"), "{text}");
    // A different limit for the key is refused, naming the one in force.
    let out = c.cli(&["submit", "--concurrency-key", "llm", "--concurrency-limit", "5", "--", "true"]);
    assert!(!out.status.success() && stderr(&out).contains("limit 3 in force"), "{}", stderr(&out));

    // The leader dies while the key is busy; the standby goes on counting.
    eventually(BOUND, || std::fs::read_to_string(&ledger).ok().filter(|l| l.matches("end ").count() >= 3))
        .expect("a first round ended");
    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    for t in &tasks {
        c.wait_status(t, "completed", BOUND);
    }
    let ledger = std::fs::read_to_string(&ledger).expect("ledger");
    let (most, ends) = max_overlap(&ledger);
    assert_eq!(ends, 12, "each ran once: {ledger}");
    assert!(most <= 3, "{most} ran at once:\n{ledger}");
    assert!(most >= 2, "the key let tasks run side by side: {most}\n{ledger}");
}

#[test]
fn a_constrained_task_waits_blocked_until_a_worker_with_its_labels_joins() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--on", "gpu=a100", "--on", "!spot", "--", "echo trained"]);
    let snap = eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["status"] == "blocked")).expect("blocked");
    assert_eq!(snap["hint"]["tag"], "no-matching-worker", "{snap}");
    let message = snap["hint"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("gpu=a100, !spot") && message.contains("w1 (labels none;"), "{message}");
    let listed = stdout(&c.cli(&["ls"]));
    assert!(listed.lines().any(|l| l.contains(&task) && l.contains("blocked")), "{listed}");

    // A worker with the labels joins: the task runs there.
    c.spawn_sidecar("w2");
    c.spawn_worker("w2", &["--label", "gpu=a100", "--label", "zone=eu"]);
    let done = c.wait_status(&task, "completed", BOUND);
    assert_eq!(done["worker"], "w2", "{done}");
    let status = stdout(&c.cli(&["status"]));
    assert!(status.contains("labels gpu=a100, zone=eu"), "{status}");

    // Malformed constraints and labels are refused before anything runs.
    let out = c.cli(&["submit", "--on", "gpu in a100", "--", "true"]);
    assert!(!out.status.success() && stderr(&out).contains("constraint"), "{}", stderr(&out));
    let out = c.cli(&["worker", "--id", "w9", "--data-dir", "/nonexistent", "--label", "gpu"]);
    assert!(!out.status.success() && stderr(&out).contains("KEY=VALUE"), "{}", stderr(&out));
}

#[test]
fn a_held_task_runs_only_once_approved_through_a_failover_and_a_killed_one_never_runs() {
    let extra = ["--approve-command", "^touch .*/deploy", "--approver", "operator", "--operator", "ops"];
    let mut c = Cluster::start_coordinators(2, 1, &extra);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display();
    let held = c.submit(&["--hold", "--", &format!("touch {d}/held")]);
    let deploy = c.submit(&["--", &format!("touch {d}/deploy")]);
    let doomed = c.submit(&["--hold", "--", &format!("touch {d}/doomed")]);
    for t in [&held, &deploy, &doomed] {
        let s = c.snapshot(t);
        assert_eq!((&s["status"], &s["hint"]["tag"]), (&"blocked".into(), &"awaiting-approval".into()), "{s}");
    }
    let hint = c.snapshot(&deploy)["hint"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(hint.contains("^touch .*/deploy") && hint.contains("Only an operator (ops)"), "{hint}");

    // Nobody else sees them; the owner may not approve what the policy held.
    let out = c.cli_as("mallory", &["approve", &held]);
    assert!(!out.status.success() && stderr(&out).contains("not found"), "{}", stderr(&out));
    let out = c.cli(&["approve", &deploy]);
    assert!(!out.status.success() && stderr(&out).contains("only an operator"), "{}", stderr(&out));

    // The approval waits through a leader SIGKILL: still held, nothing ran.
    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    assert_eq!(c.snapshot(&held)["status"], "blocked");
    assert!(!dir.path().join("held").exists());

    // The owner approves the one held with --hold, an operator the other.
    let out = c.cli(&["approve", &held]);
    assert!(out.status.success(), "{}", stderr(&out));
    let out = c.cli_as("ops/on-call", &["approve", &deploy]);
    assert!(out.status.success(), "{}", stderr(&out));
    for t in [&held, &deploy] {
        c.wait_status(t, "completed", BOUND);
    }
    let again = c.cli(&["approve", &held]);
    assert!(!again.status.success() && stderr(&again).contains("not awaiting approval"), "{}", stderr(&again));

    // A held task killed ends without ever running, with its reason.
    let out = c.cli(&["kill", &doomed, "--reason", "wrong branch"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s = c.wait_status(&doomed, "killed", BOUND);
    assert_eq!((&s["attempt"], &s["kill_reason"]), (&0.into(), &"wrong branch".into()), "{s}");
    assert!(s["detail"].as_str().unwrap_or_default().contains("never ran"), "{s}");
    assert_eq!(s["resume"]["resumable"], false, "{s}");
    let how = s["resume"]["how"].as_str().unwrap_or_default();
    assert!(how.contains(&format!("tenure submit -- 'touch {d}/doomed'")), "{how}");
    let shown = stdout(&c.cli(&["get", &doomed]));
    assert!(shown.contains("kill reason: wrong branch") && shown.contains("resumable:  no"), "{shown}");
    assert!(!dir.path().join("doomed").exists());
    assert!(dir.path().join("held").exists() && dir.path().join("deploy").exists());
}
