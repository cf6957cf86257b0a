//! The task contract over a real cluster: reported and notices, kill racing
//! completion, wait racing completion, independent readers.

mod common;

use std::time::Duration;

use common::{stdout, Cluster};
use nix::sys::signal::Signal;

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

/// The output file of `task` on worker `w1`.
fn output_file(c: &Cluster, task: &str) -> std::path::PathBuf {
    c.worker_dir("w1").join("output").join(format!("{task}.out"))
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Machine {
    /// The sidecar answers at once: the job most likely runs before unarchive.
    Live,
    /// The sidecar is paused: the job is on its way when unarchive cancels it.
    Paused,
    /// The sidecar is down: nothing is on its way when unarchive cancels it.
    Down,
}

#[test]
fn unarchive_racing_the_cleanup_job_leaves_a_record_that_tells_the_truth() {
    let mut c = Cluster::start(1);
    let races = [Machine::Down, Machine::Paused, Machine::Live, Machine::Down, Machine::Paused, Machine::Live];
    let tasks: Vec<String> = (0..races.len()).map(|i| c.submit(&["--", &format!("echo {i}")])).collect();
    for t in &tasks {
        assert!(c.cli(&["wait", t]).status.success());
    }
    for (t, machine) in tasks.iter().zip(races) {
        match machine {
            Machine::Paused => c.signal("sidecar-w1", Signal::SIGSTOP),
            Machine::Down => c.kill9("sidecar-w1"),
            Machine::Live => {}
        }
        assert!(c.cli(&["archive", t]).status.success());
        assert!(c.cli(&["unarchive", t]).status.success());
        match machine {
            Machine::Paused => c.signal("sidecar-w1", Signal::SIGCONT),
            Machine::Down => {
                c.spawn_sidecar("w1");
            }
            Machine::Live => {}
        }
        // The race settles once the machine answered the cancellation: the
        // record says `cleaned` exactly when the files are gone.
        let settled = tenure_testkit::eventually(BOUND, || {
            let s = c.snapshot(t);
            let settled = s["cleanup"] == "cancelled" || s["cleanup"] == "done";
            (settled && s["board"] == "active").then(|| s["cleaned"].as_bool()).flatten()
        });
        let cleaned = settled.unwrap_or_else(|| panic!("{t} never settled: {}\n{}", c.snapshot(t), c.logs()));
        assert_eq!(cleaned, !output_file(&c, t).exists(), "{t} ({machine:?}): the record lies about its files");
        match machine {
            // Nothing was on its way: the cancellation won, the files stay.
            Machine::Down => assert!(!cleaned, "{t}: a cancelled job removed files"),
            // The copy in the paused sidecar's queue runs before the
            // cancellation behind it, which then finds the files gone.
            Machine::Paused => assert!(cleaned, "{t}: {}", c.snapshot(t)),
            Machine::Live => {}
        }
    }
}

#[test]
fn garbage_collection_during_a_worker_outage_keeps_the_record_until_the_files_are_released() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo kept"]);
    assert!(c.cli(&["wait", &task]).status.success());
    // The machine goes away; the coordinator restarts with a 1 s retention.
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    c.kill9("coordinator");
    c.spawn("coordinator", &["coordinator", "--name", "gc", "--worker-ttl-ms", "3000", "--retention-secs", "1"]);
    // The collector tries (its cleanup job is pending) but nothing is lost:
    // the record stays while the files cannot be released.
    let tried = tenure_testkit::eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["cleanup"] == "pending"));
    assert!(tried.is_some(), "the collector never started releasing the files\n{}", c.logs());
    let retried = tenure_testkit::eventually(BOUND, || c.logs().contains("cleanup job not answered").then_some(()));
    assert!(retried.is_some(), "{}", c.logs());
    for _ in 0..3 {
        let s = c.try_snapshot(&task).unwrap_or_else(|| panic!("{task} vanished during the outage\n{}", c.logs()));
        assert_eq!(s["status"], "completed");
        assert!(output_file(&c, &task).exists());
    }
    // The machine returns: files released first, then the record compacted.
    c.start_worker("w1");
    let gone = tenure_testkit::eventually(BOUND, || {
        let get = c.cli(&["get", &task]);
        (!get.status.success() && common::stderr(&get).contains("not found")).then_some(())
    });
    assert!(gone.is_some(), "never collected:\n{}", c.logs());
    assert!(!output_file(&c, &task).exists(), "the output was released before the record was compacted");
}
