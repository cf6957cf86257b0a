//! Coordinator failover over a real nats-server and the real binaries: a
//! standby takes over from a killed leader without re-running anything, and a
//! paused leader that resumes after the takeover changes nothing and stands by.
//!
//! Lease timings are shortened (`FAST_LEASE`); nothing here asserts how long a
//! takeover took — every wait is a bounded condition.

mod common;

use std::time::Duration;

use common::{stdout, Cluster, FAST_LEASE};
use nix::sys::signal::Signal;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);

fn output_of(c: &Cluster, task: &str) -> String {
    std::fs::read_to_string(c.worker_dir("w1").join("output").join(format!("{task}.out"))).unwrap_or_default()
}

fn epoch(status: &serde_json::Value) -> u64 {
    status["leader"]["epoch"].as_u64().unwrap_or_else(|| panic!("no leader epoch in {status}"))
}

fn standby_names(status: &serde_json::Value) -> Vec<String> {
    let list = status["standbys"].as_array().cloned().unwrap_or_default();
    list.iter().filter_map(|s| s["name"].as_str().map(str::to_owned)).collect()
}

#[test]
fn a_standby_takes_over_from_a_killed_leader_and_running_work_completes_once() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let before = eventually(BOUND, || c.status().filter(|s| standby_names(s) == ["c2"]))
        .unwrap_or_else(|| panic!("c2 never stood by: {:?}\n{}", c.status(), c.logs()));
    assert_eq!(before["leader"]["name"], "c1");
    assert_eq!(c.api_responders(), 1, "a standby answers the client API");

    let task = c.submit(&["--", "sleep 3; echo done"]);
    c.wait_status(&task, "running", BOUND);
    c.kill9("coordinator-c1");

    // A submit issued during the takeover is retried until the new leader answers.
    let during = c.submit(&["--", "echo during"]);
    let after = c.wait_leader("c2");
    assert!(epoch(&after) > epoch(&before), "epoch did not grow: {before} -> {after}");
    assert!(after["leader"]["adopted_in_ms"].is_u64(), "{after}");
    eprintln!("takeover: adopted in {} ms (lease ttl 1500 ms)", after["leader"]["adopted_in_ms"]);

    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), snap["exit_code"].as_i64()), (Some(1), Some(0)), "{snap}");
    assert_eq!(output_of(&c, &task), "done\n", "the running task ran more than once");
    let snap = c.wait_status(&during, "completed", BOUND);
    assert_eq!(snap["epoch"].as_u64(), Some(epoch(&after)));
    let later = c.submit(&["--", "echo later"]);
    c.wait_status(&later, "completed", BOUND);
    assert_eq!(output_of(&c, &later), "later\n");

    // Exactly the three tasks exist: the retried submit created one task.
    let ls: serde_json::Value = serde_json::from_slice(&c.cli(&["ls", "--all", "--json"]).stdout).unwrap();
    assert_eq!(ls.as_array().map(Vec::len), Some(3), "{ls}");
    let log = c.daemon("coordinator-c2").log_text();
    assert!(log.contains("adopted in"), "{log}");
    assert_eq!(c.api_responders(), 1);
}

#[test]
fn a_paused_leader_resumes_after_the_takeover_changes_nothing_and_stands_by() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let before = eventually(BOUND, || c.status().filter(|s| standby_names(s) == ["c2"])).expect("c2 stands by");
    let first = c.submit(&["--", "echo first"]);
    c.wait_status(&first, "completed", BOUND);

    c.signal("coordinator-c1", Signal::SIGSTOP);
    let after = c.wait_leader("c2");
    assert!(epoch(&after) > epoch(&before));
    let task = c.submit(&["--", "sleep 2; echo once"]);
    c.wait_status(&task, "running", BOUND);

    // c1 wakes up still believing it leads: it must notice before acting.
    c.signal("coordinator-c1", Signal::SIGCONT);
    let stepped = eventually(BOUND, || c.daemon("coordinator-c1").log_text().contains("stepping down").then_some(()));
    assert!(stepped.is_some(), "c1 did not step down:\n{}", c.logs());
    let status = eventually(BOUND, || c.status().filter(|s| standby_names(s) == ["c1"]))
        .unwrap_or_else(|| panic!("c1 is not a standby again: {:?}\n{}", c.status(), c.logs()));
    assert_eq!(status["leader"]["name"], "c2");
    assert!(c.daemon("coordinator-c1").running(), "c1 exited instead of standing by");
    assert_eq!(c.api_responders(), 1);

    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), snap["epoch"].as_u64()), (Some(1), Some(epoch(&after))), "{snap}");
    assert_eq!(output_of(&c, &task), "once\n");
    assert_eq!(c.snapshot(&first)["status"], "completed");
    let ls: serde_json::Value = serde_json::from_slice(&c.cli(&["ls", "--all", "--json"]).stdout).unwrap();
    assert_eq!(ls.as_array().map(Vec::len), Some(2), "{ls}");
    // It stopped on its own clock, before any write reached the registry's fence.
    let c1 = c.daemon("coordinator-c1").log_text();
    assert!(!c1.contains("fenced"), "c1 tried to write after the takeover:\n{c1}");

    // The cluster keeps working under c2; c1 can take over again later.
    let later = c.submit(&["--", "echo later"]);
    c.wait_status(&later, "completed", BOUND);
    c.kill9("coordinator-c2");
    let again = c.wait_leader("c1");
    assert!(epoch(&again) > epoch(&after));
    assert_eq!(stdout(&c.cli(&["logs", &later])), "later\n");
}
