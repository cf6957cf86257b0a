//! `--priority` over a real cluster: with every slot of the one worker
//! taken, queued tasks start higher priority first, in submission order
//! within one priority, as slots free up one at a time.

mod common;

use std::time::Duration;

use common::{stderr, Cluster};

const BOUND: Duration = Duration::from_secs(40);

#[test]
fn queued_tasks_start_by_priority_under_a_full_cluster() {
    let c = Cluster::start(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display();
    // The worker's four slots, each held until its file appears.
    let blockers: Vec<String> =
        (1..=4).map(|i| c.submit(&["--", &format!("while [ ! -e {d}/go-{i} ]; do sleep 0.05; done")])).collect();
    for b in &blockers {
        c.wait_status(b, "running", BOUND);
    }
    let mut queued = Vec::new();
    for (name, priority) in [("a", "0"), ("b", "5"), ("c", "5"), ("d", "1"), ("e", "-3")] {
        let t = c.submit(&["--priority", priority, "--", &format!("echo {name} >> {d}/order")]);
        queued.push(t);
    }
    for t in &queued {
        assert_eq!(c.snapshot(t)["status"], "queued");
    }
    assert_eq!(c.snapshot(&queued[1])["priority"], 5);
    // One slot frees: the queued tasks pass through it one after another.
    std::fs::write(dir.path().join("go-1"), b"").expect("release a slot");
    for t in &queued {
        c.wait_status(t, "completed", BOUND);
    }
    let order = std::fs::read_to_string(dir.path().join("order")).expect("order");
    assert_eq!(order.split_whitespace().collect::<Vec<_>>(), ["b", "c", "d", "a", "e"]);
    // The blockers end before the test does (a task outlives its cluster).
    for i in 2..=4 {
        std::fs::write(dir.path().join(format!("go-{i}")), b"").expect("release");
    }
    for b in &blockers {
        c.wait_status(b, "completed", BOUND);
    }
    // Out of range: refused, nothing created.
    let out = c.cli(&["submit", "--priority", "101", "--", "true"]);
    assert!(!out.status.success() && stderr(&out).contains("priority 101 is out of range"), "{}", stderr(&out));
}
