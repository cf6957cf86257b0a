//! `--timeout` and `--idle-timeout` over a real cluster: the attempt's shim
//! ends the task on its own clock, with the normal kill sequence, and the task
//! fails saying which limit passed — also while its worker is dead, and while
//! its coordinator fails over. A workflow's timeout covers its steps.

mod common;

use std::time::Duration;

use common::{group_alive, stderr, stdout, Cluster, FAST_LEASE};

const BOUND: Duration = Duration::from_secs(30);

fn detail(snap: &serde_json::Value) -> &str {
    snap["detail"].as_str().unwrap_or("")
}

#[test]
fn a_task_past_its_timeout_or_silent_past_its_idle_timeout_fails_saying_which() {
    let c = Cluster::start(1);
    // Each prints its process group id (the shell leads its group).
    let slow = c.submit(&["--timeout", "1s", "--", "echo $$; sleep 60 & sleep 61; wait"]);
    let silent = c.submit(&["--idle-timeout", "1s", "--timeout", "1h", "--", "echo once; sleep 60"]);
    // Output every 200 ms keeps an idle timeout of 1 s from passing.
    let chatty =
        c.submit(&["--idle-timeout", "1s", "--", "for i in 1 2 3 4 5 6 7 8 9 10; do echo $i; sleep 0.2; done"]);
    let within = c.submit(&["--timeout", "1h", "--", "echo quick"]);

    let snap = c.wait_status(&slow, "failed", BOUND);
    assert!(detail(&snap).starts_with("timed-out: ran longer than its timeout of 1s"), "{snap}");
    let pgid: i32 = stdout(&c.cli(&["logs", &slow])).trim().parse().expect("pgid printed");
    let snap = c.wait_status(&silent, "failed", BOUND);
    assert!(detail(&snap).starts_with("idle-timeout: wrote no output for its idle timeout of 1s"), "{snap}");
    c.wait_status(&chatty, "completed", BOUND);
    c.wait_status(&within, "completed", BOUND);
    // Ended as a kill is: the whole group, its background child too.
    assert!(!group_alive(pgid), "the timed-out task's group {pgid} still runs");
}

#[test]
fn the_timeout_holds_while_the_worker_is_dead() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--timeout", "3s", "--", "echo $$; sleep 60"]);
    c.wait_status(&task, "running", BOUND);
    let pgid: i32 = tenure_testkit::eventually(BOUND, || stdout(&c.cli(&["logs", &task])).trim().parse().ok())
        .expect("pgid printed");
    c.kill9("worker-w1");
    // Nobody but the shim is there to end it.
    let ended = tenure_testkit::eventually(BOUND, || (!group_alive(pgid)).then_some(()));
    assert!(ended.is_some(), "the shim did not end the task on time without its worker");
    c.spawn_worker("w1", &[]);
    let snap = c.wait_status(&task, "failed", BOUND);
    assert!(detail(&snap).starts_with("timed-out: "), "{snap}");
    assert_eq!(snap["attempt"], 1, "ended by its limit, never run again");
}

/// The pgid a task printed first (`echo $$`), once it did.
fn printed_pgid(c: &Cluster, task: &str) -> i32 {
    tenure_testkit::eventually(BOUND, || stdout(&c.cli(&["logs", task])).trim().parse().ok())
        .unwrap_or_else(|| panic!("{task} printed no pgid:\n{}", c.logs()))
}

#[test]
fn a_hung_task_is_ended_at_its_timeout_while_its_coordinator_fails_over() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let task = c.submit(&["--timeout", "4s", "--", "echo $$; sleep 600"]);
    c.wait_status(&task, "running", BOUND);
    let pgid = printed_pgid(&c, &task);
    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    let snap = c.wait_status(&task, "failed", BOUND);
    assert!(detail(&snap).starts_with("timed-out: ran longer than its timeout of 4s"), "{snap}");
    assert_eq!(snap["attempt"], 1, "{snap}");
    assert!(!group_alive(pgid), "the timed-out task's group {pgid} still runs");
}

#[test]
fn a_workflows_timeout_covers_its_steps() {
    let c = Cluster::start(1);
    let flow = c.submit(&["--timeout", "3s", "--step", "true", "--step", "echo $$; sleep 600", "--step", "echo never"]);
    let snap = c.wait_status(&flow, "failed", BOUND);
    assert!(detail(&snap).starts_with("timed-out: the workflow ran longer than its timeout of 3s"), "{snap}");
    let steps = snap["steps"].as_array().cloned().unwrap_or_default();
    assert_eq!(steps[0]["status"], "completed", "{snap}");
    assert!(steps[2]["task"].is_null(), "no step begins after the deadline: {snap}");
    let step = steps[1]["task"].as_str().expect("step 2 ran").to_owned();
    let pgid = printed_pgid(&c, &step);
    assert!(!group_alive(pgid), "step 2's group {pgid} still runs");
}

#[test]
fn bad_limits_are_refused_at_submit_and_change_nothing() {
    let c = Cluster::start(1);
    for args in [
        &["submit", "--timeout", "0s", "--", "true"][..],
        &["submit", "--idle-timeout", "31days", "--", "true"],
        &["submit", "--timeout", "soon", "--", "true"],
        &["submit", "--idle-timeout", "1m", "--step", "true"],
    ] {
        let out = c.cli(args);
        assert!(!out.status.success(), "{args:?} accepted");
        let err = stderr(&out);
        assert!(err.contains("time limit") || err.contains("invalid value"), "{args:?}: {err}");
    }
    let ls: serde_json::Value = serde_json::from_slice(&c.cli(&["ls", "--all", "--json"]).stdout).expect("json");
    assert_eq!(ls.as_array().map(Vec::len), Some(0), "a refused submit left a task behind: {ls}");
}
