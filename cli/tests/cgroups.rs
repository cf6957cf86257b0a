//! Control groups on a real cluster: a task that allocates past its
//! `--memory` fails as `out-of-memory`; a process that left the task's
//! process group with `setsid` is tracked in the attempt's cgroup, gone
//! after `tenure kill` (also after a worker restart, and after its shim was
//! killed), and frozen with the task by `tenure pause`; a fork loop stops at
//! its `--pids`. Each test is skipped, saying why, on a host
//! without a writable cgroup v2 hierarchy (or without the controller it
//! needs).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{stderr, stdout, Cluster};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use tenure_machine::attempt_files::AttemptFiles;
use tenure_testkit::eventually;
use tenure_worker::cgroup;

const BOUND: Duration = Duration::from_secs(30);

/// This process's group in a writable unified hierarchy with `cgroup.kill`,
/// where the workers of these tests make theirs; `None` says why not.
fn unified_here() -> Result<PathBuf, String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
    let member = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
    let (mounts, member) = (cgroup::parse_mounts(&mounts), cgroup::parse_membership(&member));
    let (Some(mount), Some(own)) = (mounts.unified, member.unified) else {
        return Err("no cgroup v2 hierarchy is mounted".into());
    };
    let own = cgroup::join(&mount, &own);
    let probe = own.join(format!("tenure-probe-{}", std::process::id()));
    std::fs::create_dir(&probe).map_err(|e| format!("cannot create a cgroup in {}: {e}", own.display()))?;
    let kill = probe.join("cgroup.kill").exists();
    let _ = std::fs::remove_dir(&probe);
    match kill {
        true => Ok(own),
        false => Err("the cgroup v2 hierarchy has no cgroup.kill".into()),
    }
}

/// The worker's parent groups in every hierarchy, removed when the test
/// ends however it ends (after its cluster stopped: the worker removes them
/// itself when it stops with no attempt left, but not when a test fails).
struct Parents(Vec<PathBuf>);

impl Parents {
    fn of(name: &str) -> Parents {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let (mounts, member) =
            (cgroup::parse_mounts(&read("/proc/self/mounts")), cgroup::parse_membership(&read("/proc/self/cgroup")));
        let mut dirs = Vec::new();
        if let (Some(mount), Some(own)) = (&mounts.unified, &member.unified) {
            dirs.push(cgroup::join(mount, own).join(name));
        }
        for (controller, mount) in &mounts.v1 {
            if let Some(own) = member.v1.get(controller) {
                dirs.push(cgroup::join(mount, own).join(name));
            }
        }
        Parents(dirs)
    }
}

impl Drop for Parents {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A one-worker cluster on a host with cgroups, and the unified group its
/// worker's attempt groups go in; `None` (the reason printed) elsewhere or
/// when the worker does not enforce `needs`. The cluster is dropped before
/// the guard that removes the worker's groups.
fn cluster(needs: Option<&str>) -> Option<(Cluster, PathBuf, Parents)> {
    let own = match unified_here() {
        Ok(own) => own,
        Err(why) => {
            eprintln!("skipped: {why}");
            return None;
        }
    };
    let c = Cluster::start(1);
    let data_dir = std::fs::canonicalize(c.worker_dir("w1")).expect("worker dir");
    let name = cgroup::parent_name(&"w1".parse().expect("id"), &data_dir);
    let parent = own.join(&name);
    let guard = Parents::of(&name);
    let status = c.cli(&["status", "--json"]);
    let status: Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
    let enforces = &status["workers"][0]["enforces"];
    assert_eq!(enforces["tracking"], true, "a host with cgroup v2: the worker tracks\n{status}\n{}", c.logs());
    assert!(c.log_of("worker-w1").contains("each attempt runs in its own cgroup"), "{}", c.logs());
    if let Some(controller) = needs.filter(|n| enforces[*n] != true) {
        eprintln!("skipped: no {controller} controller usable here ({enforces})");
        return None;
    }
    Some((c, parent, guard))
}

fn logs(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

fn cli_ok(c: &Cluster, args: &[&str]) -> String {
    let out = c.cli(args);
    assert!(out.status.success(), "{args:?}: {}\n{}", stderr(&out), c.logs());
    stdout(&out)
}

/// The `escapee=PID` the task printed.
fn escapee(c: &Cluster, task: &str) -> i32 {
    let found = eventually(BOUND, || logs(c, task).lines().find_map(|l| l.strip_prefix("escapee=")?.parse().ok()));
    found.unwrap_or_else(|| panic!("no escapee pid in {:?}\n{}", logs(c, task), c.logs()))
}

/// The session of a live process (field 6 of `/proc/PID/stat`).
fn session(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(3)?.parse().ok()
}

/// The process's group in the unified hierarchy.
fn unified_group(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::")).map(str::to_owned)
}

fn gone(path: &Path) -> bool {
    !path.exists()
}

/// The worker's parent group is removed when it stops with none of its
/// attempts left.
fn stop(mut c: Cluster, parent: &Path) {
    c.stop("worker-w1");
    assert!(gone(parent), "{} left behind by the stopped worker", parent.display());
}

#[test]
fn a_task_allocating_past_its_memory_limit_fails_as_out_of_memory() {
    let Some((c, parent, _guard)) = cluster(Some("memory")) else { return };
    // `tail` keeps a line until its end: 200 MiB without a newline, past 32 MiB.
    let hog = c.submit(&["--memory", "32M", "--", "head -c 200M /dev/zero | tail >/dev/null && echo survived"]);
    let snapshot = c.wait_status(&hog, "failed", BOUND);
    let detail = snapshot["detail"].as_str().unwrap_or_default();
    assert!(detail.starts_with("out-of-memory: "), "{snapshot}\n{}", c.logs());
    assert!(detail.contains("32 MiB"), "{detail}");
    assert!(!logs(&c, &hog).contains("survived"));
    let get = cli_ok(&c, &["get", &hog]);
    assert!(get.contains("resources:  memory 32M"), "{get}");
    // The same allocation under a roomy limit completes: the limit, not the
    // command, ended the first one.
    let roomy = c.submit(&["--memory", "1G", "--", "head -c 200M /dev/zero | tail >/dev/null"]);
    c.wait_status(&roomy, "completed", BOUND);
    assert!(gone(&parent.join(format!("{hog}.1"))), "the attempt's cgroup is removed");
    stop(c, &parent);
}

#[test]
fn a_setsid_escapee_is_tracked_and_gone_after_a_kill() {
    let Some((c, parent, _guard)) = cluster(None) else { return };
    let task = c.submit(&["--", ESCAPEE]);
    c.wait_status(&task, "running", BOUND);
    let pid = escapee(&c, &task);
    let group = parent.join(format!("{task}.1"));
    // It left the task's session and process group, not its cgroup.
    assert_eq!(session(pid), Some(pid), "the escapee leads a session of its own");
    let member = unified_group(pid).unwrap_or_default();
    assert!(member.ends_with(&format!("/{task}.1")), "escapee {pid} in {member:?}");
    assert!(group.is_dir(), "{}", group.display());

    cli_ok(&c, &["kill", &task, "--reason", "escapee test"]);
    c.wait_status(&task, "killed", BOUND);
    let dead = eventually(BOUND, || session(pid).is_none().then_some(()));
    assert!(dead.is_some(), "escapee {pid} outlived the kill\n{}", c.logs());
    let removed = eventually(BOUND, || gone(&group).then_some(()));
    assert!(removed.is_some(), "{} left behind", group.display());
    stop(c, &parent);
}

#[test]
fn a_pause_freezes_a_setsid_escapee_too() {
    let Some((c, parent, _guard)) = cluster(None) else { return };
    let task = c
        .submit(&["--", "setsid sh -c 'echo escapee=$$; while :; do sleep 0.05; done' & while :; do sleep 0.05; done"]);
    c.wait_status(&task, "running", BOUND);
    let pid = escapee(&c, &task);
    let events = parent.join(format!("{task}.1")).join("cgroup.events");
    let frozen = |want: u64| {
        eventually(BOUND, || {
            let text = std::fs::read_to_string(&events).ok()?;
            (cgroup::keyed(&text, "frozen") == Some(want)).then_some(())
        })
    };
    cli_ok(&c, &["pause", &task]);
    assert!(frozen(1).is_some(), "not frozen: {:?}\n{}", std::fs::read_to_string(&events), c.logs());
    let member = unified_group(pid).unwrap_or_default();
    assert!(member.ends_with(&format!("/{task}.1")), "the frozen group holds escapee {pid}: {member:?}");
    cli_ok(&c, &["resume", &task]);
    assert!(frozen(0).is_some(), "not thawed\n{}", c.logs());
    cli_ok(&c, &["kill", &task]);
    c.wait_status(&task, "killed", BOUND);
    let dead = eventually(BOUND, || session(pid).is_none().then_some(()));
    assert!(dead.is_some(), "escapee {pid} outlived the kill");
    stop(c, &parent);
}

#[test]
fn a_fork_loop_stops_at_its_process_limit() {
    let Some((c, parent, _guard)) = cluster(Some("pids")) else { return };
    let task =
        c.submit(&["--pids", "20", "--", "i=0; while [ $i -lt 100 ]; do sleep 300 & i=$((i+1)); done; echo all"]);
    let snapshot = c.wait_status(&task, "failed", BOUND);
    let text = logs(&c, &task);
    assert!(text.to_lowercase().contains("fork") && !text.contains("all"), "{text:?} {snapshot}\n{}", c.logs());
    // The sleeps that did start are ended with the task's group.
    assert!(eventually(BOUND, || gone(&parent.join(format!("{task}.1"))).then_some(())).is_some());
    stop(c, &parent);
}

#[test]
fn a_worker_without_cgroups_says_so_and_refuses_limits() {
    if let Err(why) = unified_here() {
        eprintln!("skipped: {why}");
        return;
    }
    let c = Cluster::start_with_worker(&["--no-cgroups"]);
    let status = cli_ok(&c, &["status", "--once"]);
    let row = status.lines().find(|l| l.starts_with("w1 ")).unwrap_or_default();
    assert!(row.contains(" none "), "{status}");
    assert!(c.log_of("worker-w1").contains("cgroups turned off"), "{}", c.logs());
    // A task without limits runs as before.
    let plain = c.submit(&["--", "echo plain"]);
    c.wait_status(&plain, "completed", BOUND);
    // One with limits is not granted here (the worker would refuse it too):
    // it waits `blocked`, saying which limit no live worker enforces.
    let limited = c.submit(&["--memory", "64M", "--", "echo limited"]);
    let blocked = eventually(BOUND, || c.try_snapshot(&limited).filter(|s| s["status"] == "blocked"));
    let blocked = blocked.unwrap_or_else(|| panic!("{:?}\n{}", c.try_snapshot(&limited), c.logs()));
    assert_eq!(blocked["hint"]["tag"], "no-matching-worker", "{blocked}");
    assert!(blocked["hint"]["message"].as_str().unwrap_or_default().contains("memory limit"), "{blocked}");
    assert_eq!(c.snapshot(&limited)["attempt"], 0, "never granted");
    cli_ok(&c, &["kill", &limited]);
}

const ESCAPEE: &str = "setsid sh -c 'echo escapee=$$; exec sleep 300' & echo started; sleep 600";

/// The shim outlives a SIGKILLed worker with the attempt's cgroup; the
/// restarted worker re-attaches, and a kill still reaches the escapee.
#[test]
fn after_a_worker_restart_a_kill_still_reaches_the_escapee() {
    let Some((mut c, parent, _guard)) = cluster(None) else { return };
    let task = c.submit(&["--", ESCAPEE]);
    c.wait_status(&task, "running", BOUND);
    let pid = escapee(&c, &task);
    c.kill9("worker-w1");
    c.spawn_worker("w1", &[]);
    let reattached = eventually(BOUND, || c.daemon("worker-w1").log_text().contains("re-attaching").then_some(()));
    assert!(reattached.is_some(), "{}", c.logs());
    assert!(session(pid).is_some(), "the escapee runs on through the worker's restart");
    cli_ok(&c, &["kill", &task]);
    c.wait_status(&task, "killed", BOUND);
    assert!(eventually(BOUND, || session(pid).is_none().then_some(())).is_some(), "escapee {pid} outlived the kill");
    assert!(eventually(BOUND, || gone(&parent.join(format!("{task}.1"))).then_some(())).is_some());
    stop(c, &parent);
}

/// Many short tasks at once: every attempt makes its group under the
/// worker's parent group and removes it. The parent stays while the worker
/// runs — no attempt removes it under another's feet — and goes when the
/// worker stops.
#[test]
fn many_short_tasks_at_once_each_get_a_group_and_leave_none() {
    let Some((c, parent, _guard)) = cluster(None) else { return };
    let input: String = (0..200).map(|_| "{\"command\": \"true\"}\n").collect();
    let ids = cli_ok_with_stdin(&c, &["submit", "--batch", "-"], input.as_bytes());
    let ids: Vec<&str> = ids.split_whitespace().collect();
    assert_eq!(ids.len(), 200);
    for task in &ids {
        let snap = c.wait_status(task, "completed", BOUND);
        assert_eq!(snap["exit_code"], 0, "{task}: {snap}");
    }
    assert!(parent.exists(), "the worker's parent group went while the worker runs");
    let children = || std::fs::read_dir(&parent).into_iter().flatten().flatten().filter(|e| e.path().is_dir()).count();
    assert!(
        eventually(BOUND, || (children() == 0).then_some(())).is_some(),
        "attempt groups left in {}",
        parent.display()
    );
    stop(c, &parent);
}

fn cli_ok_with_stdin(c: &Cluster, args: &[&str], input: &[u8]) -> String {
    let out = c.cli_with_stdin(args, input);
    assert!(out.status.success(), "{args:?}: {}\n{}", stderr(&out), c.logs());
    stdout(&out)
}

/// A shim SIGKILLed with its task running: the worker finds the attempt's
/// cgroup by its name and kills what is left in it, the escapee too.
#[test]
fn a_killed_shims_cgroup_is_emptied_by_the_worker() {
    let Some((c, parent, _guard)) = cluster(None) else { return };
    let task = c.submit(&["--", ESCAPEE]);
    c.wait_status(&task, "running", BOUND);
    let pid = escapee(&c, &task);
    let attempt = c.worker_dir("w1").join("attempts").join(format!("{task}.1"));
    let shim = eventually(BOUND, || AttemptFiles::new(attempt.clone()).shim()).expect("shim recorded").pid;
    kill(Pid::from_raw(shim), Signal::SIGKILL).expect("kill the shim");
    let snapshot = c.wait_status(&task, "unknown", BOUND);
    assert_eq!(snapshot["hint"]["tag"], "maybe-ran");
    assert!(eventually(BOUND, || session(pid).is_none().then_some(())).is_some(), "escapee {pid} outlived its shim");
    assert!(eventually(BOUND, || gone(&parent.join(format!("{task}.1"))).then_some(())).is_some());
    stop(c, &parent);
}

/// A task run as another user cannot leave its cgroup, lift its limit or
/// thaw itself: the group's files are the daemons'.
#[test]
fn a_task_run_as_another_user_cannot_leave_its_cgroup_or_lift_its_limits() {
    let Ok(own) = unified_here() else {
        eprintln!("skipped: no writable cgroup v2 hierarchy");
        return;
    };
    let Ok(Some(_)) = nix::unistd::User::from_name("nobody") else {
        eprintln!("skipped: this machine has no user `nobody`");
        return;
    };
    let mut c = Cluster::start(0);
    // The run-as user must pass the test's directory to reach its scratch root.
    std::fs::set_permissions(c.dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    c.spawn_sidecar("w1");
    c.spawn_worker("w1", &["--run-as", "nobody"]);
    c.wait_workers(1);
    let data_dir = std::fs::canonicalize(c.worker_dir("w1")).expect("worker dir");
    let name = cgroup::parent_name(&"w1".parse().expect("id"), &data_dir);
    let _guard = Parents::of(&name);
    let parent = own.join(&name);
    // Each attempt says so when it succeeds; none may.
    let script = format!(
        "g=$(sed -n 's/^0:://p' /proc/self/cgroup); echo \"in=$g\"; \
         echo $$ > {own}/cgroup.procs && echo left-to-own; \
         echo $$ > {parent}/cgroup.procs && echo left-to-parent; \
         echo max > {parent}/$TENURE_TASK_ID.1/pids.max && echo lifted; \
         echo 0 > {parent}/$TENURE_TASK_ID.1/cgroup.freeze && echo thawed; \
         echo 1 > {parent}/$TENURE_TASK_ID.1/cgroup.kill && echo killed-own-group; \
         g=$(sed -n 's/^0:://p' /proc/self/cgroup); echo \"still=$g\"",
        own = own.display(),
        parent = parent.display()
    );
    let task = c.submit(&["--pids", "50", "--", &script]);
    c.wait_status(&task, "completed", BOUND);
    let text = logs(&c, &task);
    let suffix = format!("/{task}.1");
    let line = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_default().to_owned();
    assert!(line("in=").ends_with(&suffix), "{text}");
    assert!(line("still=").ends_with(&suffix), "{text}");
    for done in ["left-to-own", "left-to-parent", "lifted", "thawed", "killed-own-group"] {
        assert!(!text.contains(done), "{done}: {text}");
    }
}
