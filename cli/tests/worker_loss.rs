//! Worker loss decided on evidence, over real processes: the leader asks a lost
//! worker's sidecar before deciding anything, and only an unreachable machine
//! makes a task `unknown` (or, when idempotent, re-run elsewhere).

mod common;

use std::time::Duration;

use common::{group_alive, Cluster};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);

fn signal(c: &mut Cluster, name: &str, sig: Signal) {
    let pid = c.daemon(name).last_pid().expect("started");
    kill(Pid::from_raw(pid), sig).unwrap();
}

/// The worker process dies for good, its machine does not: the sidecar answers
/// "running" while the shim runs, then the recorded outcome, and the task
/// completes without its worker ever coming back.
#[test]
fn a_task_completes_on_its_sidecars_evidence_when_its_worker_never_returns() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "sleep 4; echo done"]);
    c.wait_status(&task, "running", BOUND);
    c.kill9("worker-w1");
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), snap["exit_code"].as_i64()), (Some(1), Some(0)));
    assert!(c.daemon("coordinator").log_text().contains("evidence from the lost worker's sidecar"), "{}", c.logs());
}

/// The whole machine is unreachable: a non-idempotent task becomes `unknown`
/// (`worker-unreachable`) and is never run again; when the machine returns, its
/// late evidence settles the task truthfully.
#[test]
fn an_unreachable_machine_leaves_a_task_unknown_until_its_evidence_returns() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "sleep 2; echo done"]);
    c.wait_status(&task, "running", BOUND);
    signal(&mut c, "worker-w1", Signal::SIGSTOP);
    signal(&mut c, "sidecar-w1", Signal::SIGSTOP);
    let snap = c.wait_status(&task, "unknown", BOUND);
    assert_eq!(snap["hint"]["tag"], "worker-unreachable", "{snap}");
    assert_eq!(snap["attempt"], 1);
    signal(&mut c, "sidecar-w1", Signal::SIGCONT);
    signal(&mut c, "worker-w1", Signal::SIGCONT);
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["attempt"], 1, "settled by late evidence, not by a second run");
    let out = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    assert_eq!(std::fs::read_to_string(out).unwrap(), "done\n");
}

/// An idempotent task of an unreachable machine runs again elsewhere; when the
/// old machine comes back, its lease is gone and its copy is stopped.
#[test]
fn an_idempotent_task_moves_and_the_returning_worker_stops_its_copy() {
    let mut c = Cluster::start(0);
    c.start_worker("w1");
    c.wait_workers(1);
    let task = c.submit(&["--idempotent", "--", "echo $$; sleep 60"]);
    c.wait_status(&task, "running", BOUND);
    let out1 = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    let pgid: i32 = eventually(BOUND, || std::fs::read_to_string(&out1).ok()?.trim().parse().ok()).expect("pgid");
    c.start_worker("w2");
    c.wait_workers(2);
    signal(&mut c, "worker-w1", Signal::SIGSTOP);
    signal(&mut c, "sidecar-w1", Signal::SIGSTOP);
    let moved = eventually(BOUND, || {
        let s = c.try_snapshot(&task)?;
        (s["worker"] == "w2" && s["status"] == "running").then_some(s)
    })
    .unwrap_or_else(|| panic!("task did not move:\n{}", c.logs()));
    assert_eq!(moved["attempt"], 2);
    assert!(group_alive(pgid), "the first copy is frozen, not gone, while its machine is away");
    signal(&mut c, "sidecar-w1", Signal::SIGCONT);
    signal(&mut c, "worker-w1", Signal::SIGCONT);
    let stopped = eventually(BOUND, || (!group_alive(pgid)).then_some(()));
    assert!(stopped.is_some(), "the stale copy on w1 kept running:\n{}", c.logs());
    let snap = c.snapshot(&task);
    assert_eq!(
        (snap["status"].as_str(), snap["worker"].as_str(), snap["attempt"].as_u64()),
        (Some("running"), Some("w2"), Some(2))
    );
    c.cli(&["kill", &task]);
}

/// A kill of a task whose machine cannot be reached is remembered: the task
/// stays `stopping` (`kill-pending`) — never called killed while its process
/// may live — and the kill is carried out when the machine returns.
#[test]
fn a_kill_waits_as_kill_pending_until_the_unreachable_machine_returns() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo $$; sleep 60"]);
    c.wait_status(&task, "running", BOUND);
    let out = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    let pgid: i32 = eventually(BOUND, || std::fs::read_to_string(&out).ok()?.trim().parse().ok()).expect("pgid");
    signal(&mut c, "worker-w1", Signal::SIGSTOP);
    signal(&mut c, "sidecar-w1", Signal::SIGSTOP);
    assert_eq!(common::stdout(&c.cli(&["kill", &task])).trim(), "requested");
    let snap = eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["hint"]["tag"] == "kill-pending"))
        .unwrap_or_else(|| panic!("no kill-pending hint: {:?}\n{}", c.try_snapshot(&task), c.logs()));
    assert_eq!(snap["status"], "stopping", "{snap}");
    assert!(group_alive(pgid), "the task runs on while its machine is unreachable");
    // Repeated kills change nothing.
    assert_eq!(common::stdout(&c.cli(&["kill", &task])).trim(), "requested");
    signal(&mut c, "sidecar-w1", Signal::SIGCONT);
    signal(&mut c, "worker-w1", Signal::SIGCONT);
    let snap = c.wait_status(&task, "killed", BOUND);
    assert!(snap["hint"].is_null(), "{snap}");
    assert!(!group_alive(pgid), "reported killed while its process group lives");
}
