//! `tenure pause` and `tenure resume` on a real cluster: a task printing a
//! counter is stopped as a whole process group (every process in state `T`,
//! no output while paused), stays paused through a worker SIGKILL — its shim
//! stopping it again after the re-attach, even after something continued it
//! (and thawed its cgroup) behind the shim's back — and a leader SIGKILL, goes on after `resume`, and
//! is still killed while paused.

mod common;

use std::time::Duration;

use common::{group_members, stderr, stdout, Cluster, FAST_LEASE};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

/// Prints its process group, then a counter, forever.
const COUNTER: &str = r#"echo "pgid=$$"; i=0; while :; do i=$((i+1)); echo "n=$i"; sleep 0.05; done"#;

fn logs(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

/// The state letter (`R`, `S`, `T`, …) of every live process of group `pgid`.
fn states(pgid: i32) -> Vec<char> {
    group_members(pgid)
        .into_iter()
        .filter_map(|(pid, _)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            stat.rsplit_once(')')?.1.split_whitespace().next()?.chars().next()
        })
        .collect()
}

/// Every process of the group stopped — or, where the worker runs the task
/// in a cgroup, that cgroup frozen (a process frozen before it handled its
/// SIGSTOP shows as sleeping, and is held all the same).
fn all_stopped(pgid: i32) -> bool {
    let s = states(pgid);
    !s.is_empty()
        && (s.iter().all(|c| *c == 'T')
            || cgroup_file(pgid, "cgroup.events").is_some_and(|events| {
                tenure_worker::cgroup::keyed(&std::fs::read_to_string(events).unwrap_or_default(), "frozen") == Some(1)
            }))
}

/// A file of the task's cgroup, where the worker runs it in one.
fn cgroup_file(pid: i32, name: &str) -> Option<std::path::PathBuf> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let mounts = tenure_worker::cgroup::parse_mounts(&read("/proc/self/mounts"));
    let member = tenure_worker::cgroup::parse_membership(&read(&format!("/proc/{pid}/cgroup")));
    let group = member.unified.filter(|g| g.contains("/tenure-"))?;
    Some(tenure_worker::cgroup::join(&mounts.unified?, &group).join(name))
}

/// Waits until every process of the group is stopped and the output stands
/// still (what the pipe held before the stop is written out); its length.
fn wait_held(c: &Cluster, task: &str, pgid: i32) -> usize {
    let stopped = eventually(BOUND, || all_stopped(pgid).then_some(()));
    assert!(stopped.is_some(), "group {pgid} not stopped: {:?}\n{}", states(pgid), c.logs());
    let mut last = logs(c, task).len();
    let still = eventually(BOUND, || {
        let now = logs(c, task).len();
        let same = now == last;
        last = now;
        same.then_some(now)
    });
    still.expect("the output stood still")
}

/// Thaws the task's cgroup, where the worker runs it in one (a pause also
/// freezes it), as something acting behind the shim's back would.
fn thaw(pid: i32) {
    if let Some(freeze) = cgroup_file(pid, "cgroup.freeze") {
        std::fs::write(&freeze, "0").unwrap_or_else(|e| panic!("thaw {}: {e}", freeze.display()));
    }
}

fn cli_ok(c: &Cluster, args: &[&str]) -> String {
    let out = c.cli(args);
    assert!(out.status.success(), "{args:?}: {}\n{}", stderr(&out), c.logs());
    stdout(&out)
}

#[test]
fn a_paused_counter_stays_stopped_through_a_worker_and_a_leader_kill_and_goes_on_when_resumed() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let task = c.submit(&["--", COUNTER]);
    c.wait_status(&task, "running", BOUND);
    let counted = eventually(BOUND, || logs(&c, &task).contains("n=3").then_some(()));
    assert!(counted.is_some(), "{}", c.logs());
    let text = logs(&c, &task);
    let pgid: i32 = text
        .lines()
        .find_map(|l| l.strip_prefix("pgid="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pgid in {text:?}"));
    assert!(!all_stopped(pgid), "running: {:?}", states(pgid));

    // Paused: the whole group stopped, recorded, and no output comes.
    assert_eq!(cli_ok(&c, &["pause", &task]).trim(), format!("{task} paused"));
    let held = wait_held(&c, &task, pgid);
    let paused = c.snapshot(&task);
    assert_eq!((&paused["status"], &paused["resume"]["resumable"]), (&"paused".into(), &true.into()), "{paused}");
    let how = paused["resume"]["how"].as_str().unwrap_or_default();
    assert!(how.contains(&format!("tenure resume {task}")), "{how}");

    // The worker dies; something continues the group behind the shim's back
    // (the count goes on); the restarted worker re-attaches and the shim
    // stops the group again, as the recorded wish says.
    c.kill9("worker-w1");
    killpg(Pid::from_raw(pgid), Signal::SIGCONT).expect("continue the group");
    thaw(pgid);
    let grew = eventually(BOUND, || (logs(&c, &task).len() > held).then_some(()));
    assert!(grew.is_some(), "a continued group counts again");
    c.spawn_worker("w1", &[]);
    let reattached = eventually(BOUND, || c.daemon("worker-w1").log_text().contains("re-attaching").then_some(()));
    assert!(reattached.is_some(), "{}", c.logs());
    let held = wait_held(&c, &task, pgid);
    assert_eq!(c.snapshot(&task)["status"], "paused");

    // The leader dies; the standby takes over and keeps it paused.
    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    assert_eq!(c.snapshot(&task)["status"], "paused");
    // A few heartbeats under the new leader: nothing lets the group go.
    let mut beats = 0;
    let calm = eventually(BOUND, || {
        beats += 1;
        (all_stopped(pgid) && logs(&c, &task).len() == held && beats >= 20).then_some(())
    });
    assert!(calm.is_some(), "paused group moved: {:?}, {} bytes (held {held})", states(pgid), logs(&c, &task).len());

    // Resumed: the count goes on from where it stopped.
    assert_eq!(cli_ok(&c, &["resume", &task]).trim(), format!("{task} running"));
    let goes_on = eventually(BOUND, || (logs(&c, &task).len() > held && !all_stopped(pgid)).then_some(()));
    assert!(goes_on.is_some(), "{:?}\n{}", states(pgid), c.logs());
    let text = logs(&c, &task);
    let counts: Vec<u64> = text.lines().filter_map(|l| l.strip_prefix("n=")?.parse().ok()).collect();
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "one count, never restarted: {counts:?}");

    // Paused again, then killed: the kill ends the stopped group.
    cli_ok(&c, &["pause", &task]);
    wait_held(&c, &task, pgid);
    cli_ok(&c, &["kill", &task, "--reason", "enough"]);
    let snapshot = c.wait_status(&task, "killed", BOUND);
    assert_eq!(snapshot["attempt"], 1, "never started again");
    assert!(group_members(pgid).is_empty(), "the group is gone");
}

/// Only a running task of the caller is paused; the refusals say why and
/// change nothing.
#[test]
fn pauses_that_cannot_apply_are_refused_clearly() {
    let c = Cluster::start(1);
    let done = c.submit(&["--", "echo done"]);
    c.wait_status(&done, "completed", BOUND);
    let live = c.submit(&["--", "sleep 600"]);
    c.wait_status(&live, "running", BOUND);
    let refused = |args: &[&str], session: &str, needle: &str| {
        let out = c.cli_as(session, args);
        assert!(!out.status.success(), "{args:?} should be refused");
        assert!(stderr(&out).contains(needle), "{args:?}: expected {needle:?} in {:?}", stderr(&out));
    };
    refused(&["pause", &done], &c.session, "is not running (it is completed)");
    refused(&["pause", &live], "intruder", "not found or not yours");
    refused(&["resume", &live], "intruder", "not found or not yours");
    refused(&["pause", "shell-999"], &c.session, "not found or not yours");
    assert_eq!(c.snapshot(&live)["status"], "running");
    // Resuming a running task is no error: it runs.
    assert_eq!(cli_ok(&c, &["resume", &live]).trim(), format!("{live} running"));
    cli_ok(&c, &["kill", &live]);
}
