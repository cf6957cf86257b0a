//! The `workflow` and `monitor` kinds over a real cluster: steps run once each
//! and in order through a leader failover, fail fast and stop on a kill; a
//! shim's matched lines are notified once each across a worker restart.

mod common;

use std::time::Duration;

use common::{stdout, Cluster, FAST_LEASE};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);

/// The status of step `i` (0-based) of a workflow snapshot, and its task id.
fn step(s: &serde_json::Value, i: usize) -> (Option<String>, Option<String>) {
    let st = &s["steps"][i];
    (st["status"].as_str().map(str::to_owned), st["task"].as_str().map(str::to_owned))
}

#[test]
fn a_workflow_runs_each_step_once_and_in_order_through_a_leader_failover() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let ledger = c.dir.path().join("ledger");
    let step_cmd = |n: u32| format!("echo {n} >> {}; sleep 1; echo step {n}", ledger.display());
    let flow = c.submit(&["--step", &step_cmd(1), "--step", &step_cmd(2), "--step", &step_cmd(3)]);
    assert!(flow.starts_with("workflow-"), "{flow}");
    eventually(BOUND, || c.try_snapshot(&flow).filter(|s| step(s, 0).0.as_deref() == Some("running")))
        .unwrap_or_else(|| panic!("step 1 never ran: {:?}\n{}", c.try_snapshot(&flow), c.logs()));
    c.kill9("coordinator-c1");
    c.wait_leader("c2");

    let s = c.wait_status(&flow, "completed", BOUND);
    assert_eq!(std::fs::read_to_string(&ledger).unwrap(), "1\n2\n3\n", "a step ran twice or out of order");
    let ids: Vec<String> = (0..3)
        .map(|i| match step(&s, i) {
            (Some(status), Some(id)) if status == "completed" => id,
            other => panic!("step {i}: {other:?} in {s}"),
        })
        .collect();
    assert!(ids.windows(2).all(|w| w[0] != w[1]), "{ids:?}");
    assert_eq!(c.snapshot(&ids[1])["parent"], flow.as_str());

    // Its output is its steps' outputs, in order; it is reported by that read
    // and its steps never raise notices of their own.
    let logs = stdout(&c.cli(&["logs", &flow]));
    let shown: Vec<&str> = logs.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(shown, ["step 1", "step 2", "step 3"], "{logs}");
    assert_eq!(c.snapshot(&flow)["reported"], true);
    let watch = c.cli(&["watch", "--once"]);
    assert!(stdout(&watch).trim().is_empty(), "unexpected notices: {}", stdout(&watch));
}

#[test]
fn a_workflow_fails_fast_and_a_kill_stops_its_running_step() {
    let c = Cluster::start(1);
    let never = c.dir.path().join("never");
    let touch = format!("touch {}", never.display());
    let flow = c.submit(&["--step", "echo a", "--step", "exit 3", "--step", &touch]);
    let s = c.wait_status(&flow, "failed", BOUND);
    assert!(s["detail"].as_str().is_some_and(|d| d.contains("step 2 of 3")), "{s}");
    assert_eq!(step(&s, 1).0.as_deref(), Some("failed"));
    assert_eq!(step(&s, 2), (None, None), "a step after the failure began");
    assert!(!c.cli(&["wait", &flow]).status.success());

    let flow = c.submit(&["--step", "sleep 60", "--step", &touch]);
    let s = eventually(BOUND, || c.try_snapshot(&flow).filter(|s| step(s, 0).0.as_deref() == Some("running")))
        .unwrap_or_else(|| panic!("step 1 never ran\n{}", c.logs()));
    let running = step(&s, 0).1.unwrap();
    assert_eq!(stdout(&c.cli(&["kill", &flow])).trim(), "requested");
    let s = c.wait_status(&flow, "killed", BOUND);
    assert_eq!(step(&s, 0).0.as_deref(), Some("killed"));
    assert_eq!(step(&s, 1), (None, None));
    assert_eq!(c.snapshot(&running)["status"], "killed");
    assert!(!never.exists(), "a step after the kill ran");
    // Repeated kills are idempotent.
    assert_eq!(stdout(&c.cli(&["kill", &flow])).trim(), "already-finished");
}

#[test]
fn a_shims_matched_lines_are_notified_once_each_across_a_worker_restart() {
    let mut c = Cluster::start(1);
    let gate = c.dir.path().join("gate");
    let script = format!(
        "for i in 1 2 3; do echo fine; echo ERR $i; done; while [ ! -e {g} ]; do sleep 0.1; done; \
         echo ERR 4; echo fine; echo ERR 5; sleep 60",
        g = gate.display()
    );
    let m = c.submit(&["--kind", "monitor", "--pattern", "^ERR [0-9]$", "--", &script]);
    let matches = |c: &Cluster, n: u64| eventually(BOUND, || c.try_snapshot(&m).filter(|s| s["matches"] == n));
    assert!(matches(&c, 3).is_some(), "{:?}\n{}", c.try_snapshot(&m), c.logs());

    // The worker dies; the task runs on and prints more while it is away.
    c.kill9("worker-w1");
    std::fs::write(&gate, b"").unwrap();
    c.spawn_worker("w1", &[]);
    assert!(matches(&c, 5).is_some(), "{:?}\n{}", c.try_snapshot(&m), c.logs());

    let watch = stdout(&c.cli(&["watch", "--once", "--json"]));
    let mut seen: Vec<(u64, String)> = watch
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let n = &v["Matched"];
            (n["task"] == m.as_str()).then(|| (n["line"]["offset"].as_u64().unwrap(), n["line"]["text"].to_string()))
        })
        .collect();
    seen.sort();
    let texts: Vec<&str> = seen.iter().map(|(_, t)| t.trim_matches('"')).collect();
    assert_eq!(texts, ["ERR 1", "ERR 2", "ERR 3", "ERR 4", "ERR 5"], "{watch}");
    // Nothing is shown twice.
    let again = stdout(&c.cli(&["watch", "--once", "--json"]));
    assert!(!again.contains("Matched"), "{again}");
    assert_eq!(stdout(&c.cli(&["kill", &m])).trim(), "requested");
    c.wait_status(&m, "killed", BOUND);
}

#[test]
fn a_final_output_only_task_shows_nothing_while_it_runs_and_its_final_output_every_time_after() {
    let c = Cluster::start(1);
    let gate = c.dir.path().join("final-gate");
    let script = format!("echo working; while [ ! -e {} ]; do sleep 0.1; done; echo the answer is 42", gate.display());
    let task = c.submit(&["--final-output", "--", &script]);
    c.wait_status(&task, "running", BOUND);
    let live = c.cli(&["logs", &task]);
    assert!(live.status.success(), "{}", common::stderr(&live));
    assert_eq!(stdout(&live), "", "a final-output-only task streamed while running");
    assert_eq!(c.snapshot(&task)["reported"], false);
    std::fs::write(&gate, b"").unwrap();
    // A follower waits for the end and prints the final output once.
    let followed = c.cli(&["logs", "--follow", &task]);
    assert_eq!(stdout(&followed), "working\nthe answer is 42\n");
    assert_eq!(c.snapshot(&task)["reported"], true, "reading the final output reports the task");
    // Idempotent: never consumed.
    assert_eq!(stdout(&c.cli(&["logs", &task])), "working\nthe answer is 42\n");
    // Refused where it makes no sense.
    let refused = c.cli(&["submit", "--kind", "agent", "--final-output", "--", "cat"]);
    assert!(common::stderr(&refused).contains("cannot be final-output-only"), "{}", common::stderr(&refused));
}
