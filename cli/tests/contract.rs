//! The task contract over a real cluster: reported and notices, kill racing
//! completion, wait racing completion, independent readers.

mod common;

use std::time::Duration;

use common::{stdout, Cluster};

const BOUND: Duration = Duration::from_secs(30);

fn watch_once(c: &Cluster) -> Vec<String> {
    let out = c.cli(&["watch", "--once"]);
    assert!(out.status.success(), "watch: {}", common::stderr(&out));
    stdout(&out).lines().map(|l| l.split_whitespace().next().unwrap_or("").to_owned()).collect()
}

#[test]
fn watch_shows_each_unreported_end_once_and_resumes_across_a_failover() {
    let mut c = Cluster::start(1);
    let waited = c.submit(&["--", "echo a"]);
    assert!(c.cli(&["wait", &waited]).status.success());
    let unread = c.submit(&["--", "echo b; exit 3"]);
    c.wait_status(&unread, "failed", BOUND);
    let read = c.submit(&["--", "echo c"]);
    c.wait_status(&read, "completed", BOUND);
    assert_eq!(stdout(&c.cli(&["logs", &read])), "c\n");
    assert_eq!(c.snapshot(&read)["reported"], true, "reading the whole terminal output reports the task");

    // Only the task no surface reported is noticed, and only once.
    assert_eq!(watch_once(&c), vec![unread.clone()]);
    assert_eq!(c.snapshot(&unread)["reported"], true);
    assert!(watch_once(&c).is_empty(), "a second watch resumes after the first");

    // A task that ends around a coordinator restart is noticed exactly once.
    let around = c.submit(&["--", "sleep 1; echo d"]);
    c.wait_status(&around, "running", BOUND);
    c.kill9("coordinator");
    c.spawn("coordinator", &["coordinator", "--name", "c2", "--worker-ttl-ms", "3000"]);
    c.wait_status(&around, "completed", BOUND);
    assert_eq!(watch_once(&c), vec![around.clone()]);
    assert!(watch_once(&c).is_empty());
    // Another session sees none of it.
    let other = c.cli_as("someone-else", &["watch", "--once"]);
    assert_eq!(stdout(&other), "");
}

#[test]
fn kill_racing_natural_exit_settles_exactly_one_consistent_end() {
    let c = Cluster::start(1);
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..12u64 {
        let task = c.submit(&["--", &format!("sleep 0.{}", 1 + i % 5)]);
        std::thread::sleep(Duration::from_millis(50 * (i % 7)));
        let kill = stdout(&c.cli(&["kill", &task])).trim().to_owned();
        let wait = c.cli(&["wait", &task, "--json"]);
        let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).expect("snapshot");
        let status = snap["status"].as_str().unwrap_or("?").to_owned();
        match kill.as_str() {
            "already-finished" => assert_eq!(status, "completed", "{task}: kill said finished, task is {status}"),
            "requested" => assert!(status == "killed" || status == "completed", "{task}: {status}"),
            other => panic!("{task}: kill answered {other:?}"),
        }
        // The end never changes afterwards.
        assert_eq!(c.snapshot(&task)["status"], status.as_str());
        assert_eq!(stdout(&c.cli(&["kill", &task])).trim(), "already-finished");
        *seen.entry((kill, status)).or_insert(0) += 1;
    }
    eprintln!("kill/exit race outcomes: {seen:?}");
}

#[test]
fn wait_racing_completion_and_independent_readers() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "for i in 1 2 3 4; do echo line-$i; sleep 0.1; done"]);
    let wait = c.cli(&["wait", &task]);
    assert!(wait.status.success(), "{}", common::stderr(&wait));
    // Two readers, each with its own offset, get their own deltas.
    let first = stdout(&c.cli(&["logs", &task, "--offset", "0"]));
    let second = stdout(&c.cli(&["logs", &task, "--offset", "14"]));
    assert_eq!(first, "line-1\nline-2\nline-3\nline-4\n");
    assert_eq!(second, "line-3\nline-4\n");
    // A read past the end is empty, not an error.
    let past = c.cli(&["logs", &task, "--offset", "1000"]);
    assert!(past.status.success());
    assert_eq!(stdout(&past), "");
}

#[test]
fn archive_unarchive_and_delete_move_the_board_and_release_the_files() {
    let c = Cluster::start(1);
    let out = |task: &str| c.worker_dir("w1").join("output").join(format!("{task}.out"));
    let listed = |c: &Cluster, all: bool| -> Vec<String> {
        let args: &[&str] = if all { &["ls", "--all", "--json"] } else { &["ls", "--json"] };
        let v: serde_json::Value = serde_json::from_slice(&c.cli(args).stdout).unwrap();
        v.as_array().unwrap().iter().map(|s| s["id"].as_str().unwrap().to_owned()).collect()
    };

    // Only a finished task leaves the board.
    let running = c.submit(&["--", "sleep 30"]);
    c.wait_status(&running, "running", BOUND);
    let refused = c.cli(&["archive", &running]);
    assert!(!refused.status.success());
    assert!(common::stderr(&refused).contains("only a finished task"), "{}", common::stderr(&refused));
    c.cli(&["kill", &running]);

    // Archive: hidden from ls, shown with --all, its output released on the worker.
    let a = c.submit(&["--", "echo archived"]);
    assert!(c.cli(&["wait", &a]).status.success());
    assert!(out(&a).exists());
    assert_eq!(stdout(&c.cli(&["archive", &a])).trim(), format!("{a} completed archived"));
    assert!(tenure_testkit::eventually(BOUND, || c.snapshot(&a)["cleaned"].as_bool().filter(|c| *c)).is_some());
    assert!(!out(&a).exists(), "the cleanup job released the output file");
    assert!(!listed(&c, false).contains(&a));
    assert!(listed(&c, true).contains(&a));
    // Repeated archive reuses the job; unarchive brings it back (the files are gone).
    assert!(c.cli(&["archive", &a]).status.success());
    assert_eq!(stdout(&c.cli(&["unarchive", &a])).trim(), format!("{a} completed active"));
    assert!(listed(&c, true).contains(&a));

    // Delete: hidden for good, the record still readable for audit.
    let d = c.submit(&["--", "echo deleted"]);
    assert!(c.cli(&["wait", &d]).status.success());
    assert_eq!(stdout(&c.cli(&["delete", &d])).trim(), format!("{d} completed deleted"));
    assert!(!listed(&c, true).contains(&d));
    assert_eq!(c.snapshot(&d)["board"], "deleted");
    let again = c.cli(&["unarchive", &d]);
    assert!(!again.status.success(), "a deleted task never comes back");
    assert!(tenure_testkit::eventually(BOUND, || c.snapshot(&d)["cleaned"].as_bool().filter(|c| *c)).is_some());
    assert!(!out(&d).exists());
    // Another session can do none of it.
    assert!(!c.cli_as("someone-else", &["archive", &d]).status.success());
}

#[test]
fn finished_tasks_are_garbage_collected_after_the_retention() {
    let mut c = Cluster::start(1);
    c.kill9("coordinator");
    c.spawn("coordinator", &["coordinator", "--name", "gc", "--worker-ttl-ms", "3000", "--retention-secs", "1"]);
    c.wait_workers(1);
    let task = eventually_submit(&c, "echo collected");
    assert!(c.cli(&["wait", &task]).status.success());
    let out = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    assert!(out.exists());
    let gone = tenure_testkit::eventually(BOUND, || {
        let get = c.cli(&["get", &task]);
        (!get.status.success() && common::stderr(&get).contains("not found")).then_some(())
    });
    assert!(gone.is_some(), "never collected:\n{}", c.logs());
    assert!(!out.exists(), "the output was released before the record was compacted");
    // Its number is never reused, even by a coordinator that loads the registry afresh.
    c.kill9("coordinator");
    c.spawn("coordinator", &["coordinator", "--name", "after", "--worker-ttl-ms", "3000"]);
    let next = eventually_submit(&c, "echo next");
    let n = |id: &str| id.rsplit_once('-').unwrap().1.parse::<u64>().unwrap();
    assert!(n(&next) > n(&task), "{next} reuses the number of {task}");
}

fn eventually_submit(c: &Cluster, command: &str) -> String {
    tenure_testkit::eventually(BOUND, || {
        let out = c.cli(&["submit", "--", command]);
        out.status.success().then(|| stdout(&out).trim().to_owned())
    })
    .expect("submit")
}
