//! Operator mistakes, over real processes: a worker id configured on two
//! machines at once must neither run a task twice nor take over the running
//! worker's id; a worker restarted on its own data directory takes its place
//! back at once. The ledger the tasks append to is the judge.

mod common;

use std::time::Duration;

use common::Cluster;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);
const TASKS: usize = 30;

#[test]
fn a_second_worker_with_a_running_workers_id_runs_nothing_and_stops_naming_the_holder() {
    let mut c = Cluster::start(1);
    let ledger = c.dir.path().join("ledger");
    // The same id on a second "machine": its own data directory and sidecar.
    let other = c.dir.path().join("other-machine").display().to_string();
    c.spawn("sidecar-dup", &["sidecar", "--worker", "w1", "--data-dir", &other]);
    c.spawn("worker-dup", &["worker", "--id", "w1", "--slots", "4", "--data-dir", &other, "--heartbeat-ms", "300"]);
    // Work arrives while both processes live.
    let tasks: Vec<String> =
        (0..TASKS).map(|i| c.submit(&["--", &format!("sleep 0.1; echo tok-{i} >> {}", ledger.display())])).collect();
    for t in &tasks {
        c.wait_status(t, "completed", BOUND);
    }
    let text = std::fs::read_to_string(&ledger).expect("ledger");
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), TASKS, "a task ran twice or not at all:\n{text}\n{}", c.logs());
    lines.sort();
    lines.dedup();
    assert_eq!(lines.len(), TASKS, "a task ran twice:\n{text}");

    let dup = c.daemon("worker-dup");
    let status = dup.wait_exit(BOUND).expect("the second process stopped");
    assert!(!status.success());
    let log = dup.log_text();
    assert!(log.contains("worker id w1 is taken"), "no clear error from the second process:\n{log}");
    assert!(c.daemon("coordinator").log_text().contains("a second live process claims this worker id"));
    assert!(matches!(c.daemon("worker-w1").child.try_wait(), Ok(None)), "the first worker stopped\n{}", c.logs());
}

#[test]
fn a_worker_restarted_on_its_own_data_directory_takes_its_id_back_at_once() {
    let mut c = Cluster::start(1);
    let running = c.submit(&["--", "sleep 3; echo survived"]);
    c.wait_status(&running, "running", BOUND);
    c.kill9("worker-w1");
    c.spawn_worker("w1", &[]);
    // New work reaches the restarted process well before the worker TTL would
    // have freed the id: it named its predecessor.
    let next = c.submit(&["--", "echo after-restart"]);
    c.wait_status(&next, "completed", BOUND);
    c.wait_status(&running, "completed", BOUND);
    let log = c.daemon("coordinator").log_text();
    assert!(log.contains("worker id bound to a new process"), "{log}");
    assert!(!log.contains("a second live process claims"), "the restart was taken for a second process:\n{log}");
    assert!(eventually(BOUND, || c.daemon("worker-w1").log_text().contains("worker ready").then_some(())).is_some());
}
