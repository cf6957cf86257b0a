//! Worker-machine durability over real processes: SIGKILL of the worker, the
//! sidecar, a task's shim and all of them, at named points of a task's life.
//! Each test names the crash window it covers (see docs/durability.md).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{group_alive, stdout, Cluster};
use tenure_machine::attempt_files::{AttemptFiles, ProcessId, ShimStatus};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

fn output_file(c: &Cluster, task: &str) -> PathBuf {
    c.worker_dir("w1").join("output").join(format!("{task}.out"))
}

fn read(p: &PathBuf) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

fn attempt_dir(c: &Cluster, task: &str) -> PathBuf {
    c.worker_dir("w1").join("attempts").join(format!("{task}.1"))
}

fn attempt_files(c: &Cluster, task: &str) -> AttemptFiles {
    AttemptFiles::new(attempt_dir(c, task))
}

fn shim_pid(c: &Cluster, task: &str) -> i32 {
    shim_of(c, task).pid
}

/// The shim the task's attempt recorded, by its identity.
fn shim_of(c: &Cluster, task: &str) -> ProcessId {
    eventually(BOUND, || attempt_files(c, task).shim()).expect("shim recorded")
}

fn task_pgid(c: &Cluster, task: &str) -> i32 {
    eventually(BOUND, || attempt_files(c, task).pgid()).expect("pgid recorded")
}

/// Window: mid-run. The worker dies; the task keeps running and writing under
/// its shim; the restarted worker re-attaches and reports it exactly once.
#[test]
fn a_task_outlives_a_sigkilled_worker_and_is_reported_once() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "for i in $(seq 1 20); do echo tick-$i; sleep 0.1; done"]);
    c.wait_status(&task, "running", BOUND);
    let out = output_file(&c, &task);
    eventually(BOUND, || read(&out).contains("tick-2").then_some(())).expect("output starts");
    let pgid = task_pgid(&c, &task);
    let shim = shim_of(&c, &task);

    c.kill9("worker-w1");
    // Still running and still captured without any worker.
    let grew = eventually(BOUND, || read(&out).contains("tick-8").then_some(()));
    assert!(grew.is_some(), "output stopped with the worker: {:?}", read(&out));
    assert!(group_alive(pgid) || read(&out).contains("tick-20"));
    // Output stays readable through the sidecar while the worker is down.
    assert!(stdout(&c.cli(&["logs", &task])).starts_with("tick-1\ntick-2\n"));

    c.spawn_worker("w1", &[]);
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), snap["exit_code"].as_i64()), (Some(1), Some(0)));
    let expected: String = (1..=20).map(|i| format!("tick-{i}\n")).collect();
    assert_eq!(read(&out), expected, "every line exactly once: the task was not started again");
    assert_eq!(stdout(&c.cli(&["logs", &task])), expected);
    assert!(c.daemon("worker-w1").log_text().contains("re-attaching"), "{}", c.logs());
    // Its launcher went with the worker: the shim takes no other attempt.
    assert!(eventually(BOUND, || (!shim.alive()).then_some(())).is_some(), "shim {shim:?} outlived its attempt");
}

/// Window: exit → report, with the worker down. The shim records the exit
/// status; the restarted worker reports it from that evidence.
#[test]
fn a_task_that_finished_while_the_worker_was_down_is_reported_from_its_status() {
    let mut c = Cluster::start(1);
    let (task, _) = finish_while_the_worker_is_down(&mut c);
    restart_the_worker_and_see_it_reported(&mut c, &task);
}

/// A task that prints `bye` and exits 7 while its worker is SIGKILLed; its
/// id and the exit status its shim recorded.
fn finish_while_the_worker_is_down(c: &mut Cluster) -> (String, ShimStatus) {
    let task = c.submit(&["--", "sleep 1; echo bye; exit 7"]);
    c.wait_status(&task, "running", BOUND);
    let files = attempt_files(c, &task);
    c.kill9("worker-w1");
    let status = eventually(BOUND, || files.status()).expect("shim recorded the exit");
    (task, status)
}

/// Starts the worker again and waits for the task of
/// [`finish_while_the_worker_is_down`] to be reported from its evidence.
fn restart_the_worker_and_see_it_reported(c: &mut Cluster, task: &str) {
    c.spawn_worker("w1", &[]);
    let snap = c.wait_status(task, "failed", BOUND);
    assert_eq!((snap["exit_code"].as_i64(), snap["attempt"].as_u64()), (Some(7), Some(1)));
    assert_eq!(read(&output_file(c, task)), "bye\n");
}

/// An attempt begun by an earlier version keeps its files in a directory of
/// its own (`attempts/<task>.<attempt>/journal`): a worker of this version,
/// started on it, reads it, reports its outcome and removes it in that shape.
/// The earlier layout is made here from this version's flat files while the
/// worker is down (its shim had finished), as an earlier shim would have left it.
#[test]
fn an_attempt_in_an_earlier_versions_directory_is_reported_and_removed_in_that_shape() {
    let mut c = Cluster::start(1);
    let (task, status) = finish_while_the_worker_is_down(&mut c);
    let dir = attempt_dir(&c, &task);
    let flat = c.worker_dir("w1").join("attempts").join(format!("{task}.1.journal"));
    assert!(flat.is_file(), "this version's journal is flat: {}", flat.display());
    std::fs::create_dir(&dir).unwrap();
    std::fs::rename(&flat, dir.join("journal")).unwrap();
    assert_eq!(attempt_files(&c, &task).status(), Some(status), "read in the earlier shape");
    restart_the_worker_and_see_it_reported(&mut c, &task);
    eventually(BOUND, || (!dir.exists()).then_some(())).expect("the directory removed once reported");
}

/// Window: mid-run, whole machine lost (every tenure process and the task die).
/// No exit evidence exists: the task is `unknown` with `maybe-ran`, never re-run.
#[test]
fn after_a_simulated_reboot_a_started_task_is_unknown_not_rerun() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo started; sleep 30"]);
    c.wait_status(&task, "running", BOUND);
    let out = output_file(&c, &task);
    eventually(BOUND, || read(&out).contains("started").then_some(())).expect("task started");
    let (shim, pgid) = (shim_pid(&c, &task), task_pgid(&c, &task));
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), nix::sys::signal::Signal::SIGKILL);
    eventually(BOUND, || (!group_alive(pgid)).then_some(())).expect("group gone");

    c.start_worker("w1");
    let snap = c.wait_status(&task, "unknown", BOUND);
    assert_eq!(snap["hint"]["tag"], "maybe-ran", "{snap}");
    assert_eq!(snap["attempt"], 1);
    // The machine takes new work again, and still the task is not run again.
    let later = c.submit(&["--", "echo later"]);
    c.wait_status(&later, "completed", BOUND);
    let snap = c.snapshot(&task);
    assert_eq!((snap["status"].as_str(), snap["attempt"].as_u64()), (Some("unknown"), Some(1)));
    assert_eq!(read(&out), "started\n");
}

/// Window: mid-run, the shim alone is killed. The worker ends the orphaned
/// group (no process survives) and reports the outcome as lost.
#[test]
fn a_killed_shim_leaves_no_process_and_an_honest_hint() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "echo up; sleep 60 & sleep 61; wait"]);
    c.wait_status(&task, "running", BOUND);
    let (shim, pgid) = (shim_pid(&c, &task), task_pgid(&c, &task));
    assert!(group_alive(pgid));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGKILL).unwrap();
    let snap = c.wait_status(&task, "unknown", BOUND);
    assert_eq!(snap["hint"]["tag"], "maybe-ran");
    assert!(!group_alive(pgid), "the task's processes outlived their shim");
}

/// Windows: before intent (sidecar down: nothing starts) and mid-run (sidecar
/// down: running tasks go on, their completion waits for the sidecar).
#[test]
fn without_its_sidecar_a_worker_starts_nothing_but_keeps_running_tasks() {
    let mut c = Cluster::start(1);
    let running = c.submit(&["--", "sleep 1.5; echo done-while-sidecar-down"]);
    c.wait_status(&running, "running", BOUND);
    c.kill9("sidecar-w1");
    let queued = c.submit(&["--", "echo should-wait"]);
    // The running task finishes; its output is complete even with no sidecar.
    let out = output_file(&c, &running);
    eventually(BOUND, || read(&out).contains("done-while-sidecar-down").then_some(())).expect("task finished");
    // The new task did not start: the leader skips a machine whose heartbeat
    // says its sidecar is down, and a grant sent before that is refused while
    // no intent can be recorded.
    let held_back = eventually(BOUND, || {
        let refused = c.daemon("coordinator").log_text().contains("sidecar unavailable");
        let down = c
            .status()
            .and_then(|s| s["workers"].as_array().cloned())
            .is_some_and(|ws| ws.iter().any(|w| w["id"] == "w1" && w["sidecar"] == "down"));
        (refused || down).then_some(())
    });
    assert!(held_back.is_some(), "{}", c.logs());
    assert!(!output_file(&c, &queued).exists(), "a task started without its intent");
    assert_ne!(c.snapshot(&queued)["status"], "running");

    c.spawn_sidecar("w1");
    c.wait_status(&running, "completed", BOUND);
    c.wait_status(&queued, "completed", BOUND);
    assert_eq!(read(&output_file(&c, &queued)), "should-wait\n");
}

/// Output storage: the cap drops bytes (the task does not block) and says so;
/// a symlink planted at the output path is refused, its target untouched.
#[test]
fn output_is_capped_and_symlinks_are_refused() {
    let c = Cluster::start_with_worker(&["--output-cap", "1000"]);
    let task = c.submit(&["--", "head -c 50000 /dev/zero | tr '\\0' x; echo"]);
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["output_dropped"].as_u64(), Some(50001 - 1000));
    let text = read(&output_file(&c, &task));
    assert!(text.starts_with(&"x".repeat(1000)));
    assert!(text.contains("output cap of 1000 bytes reached"), "{text}");
    assert!(text.len() < 1200);

    // The next task id is predictable (ids are not secrets): plant a link there.
    let victim = c.dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let next_n: u64 = task.rsplit_once('-').unwrap().1.parse::<u64>().unwrap() + 1;
    let planted = c.worker_dir("w1").join("output").join(format!("shell-{next_n}.out"));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let t2 = c.submit(&["--", "echo overwrite"]);
    assert_eq!(t2, format!("shell-{next_n}"));
    let snap = c.wait_status(&t2, "failed", BOUND);
    assert!(snap["detail"].as_str().unwrap_or("").contains("cannot open output file"), "{snap}");
    assert_eq!(read(&victim), "precious\n");
}

/// A task that writes nothing leaves no output file (note a10): it reads as
/// empty output, also as a final output, and a later attempt or task that
/// writes gets its file as before.
#[test]
fn a_silent_task_leaves_no_output_file_and_reads_as_empty() {
    let c = Cluster::start(1);
    let silent = c.submit(&["--", "true"]);
    let last = c.submit(&["--final-output", "--", "exit 3"]);
    let loud = c.submit(&["--", "echo loud"]);
    c.wait_status(&silent, "completed", BOUND);
    let snap = c.wait_status(&last, "failed", BOUND);
    assert_eq!(snap["exit_code"], 3, "{snap}");
    c.wait_status(&loud, "completed", BOUND);
    for task in [&silent, &last] {
        assert!(!output_file(&c, task).exists(), "{task} wrote nothing and has no file");
        let out = c.cli(&["logs", task]);
        assert!(out.status.success(), "{}", common::stderr(&out));
        assert_eq!(stdout(&out), "", "{task}");
    }
    assert_eq!(c.snapshot(&last)["output_dropped"].as_u64().unwrap_or(0), 0);
    assert_eq!(read(&output_file(&c, &loud)), "loud\n");
    assert_eq!(stdout(&c.cli(&["logs", &loud])), "loud\n");
}

/// Corruption with machine loss: a flipped record in the real sled store and no
/// shim evidence surface the task as `unknown` with a `sidecar-corrupt` hint;
/// the sidecar and the rest of the machine keep working.
#[test]
fn a_corrupt_sidecar_record_surfaces_as_a_hint_not_a_crash() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo a; sleep 30"]);
    c.wait_status(&task, "running", BOUND);
    let (shim, pgid) = (shim_pid(&c, &task), task_pgid(&c, &task));
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), nix::sys::signal::Signal::SIGKILL);
    corrupt_first_record(&c);
    c.start_worker("w1");
    // The leader may judge the worker lost (`worker-unreachable`) before the
    // restarted worker reports what its store says: wait for the latter.
    let corrupt = eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["hint"]["tag"] == "sidecar-corrupt"));
    let snap = corrupt.unwrap_or_else(|| panic!("{:?}\n{}", c.try_snapshot(&task), c.logs()));
    assert_eq!(snap["status"], "unknown", "{snap}");
    // The machine goes on working.
    let next = c.submit(&["--", "echo fine"]);
    c.wait_status(&next, "completed", BOUND);
    assert!(c.daemon("sidecar-w1").running());
}

/// Corruption with the task alive: the record is unreadable but the shim's
/// files are not, so the task is re-attached and settled truthfully.
#[test]
fn a_corrupt_record_of_a_live_task_is_settled_from_the_shims_evidence() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo a; sleep 2; echo b"]);
    c.wait_status(&task, "running", BOUND);
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    corrupt_first_record(&c);
    c.start_worker("w1");
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["attempt"], 1);
    assert_eq!(read(&output_file(&c, &task)), "a\nb\n");
}

/// An unopenable store: the sidecar serves degraded instead of crash-looping;
/// the worker starts nothing new there and settles the running task from its
/// shim's evidence.
#[test]
fn an_unopenable_store_degrades_the_sidecar_instead_of_crashing_it() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo a; sleep 2; echo b"]);
    c.wait_status(&task, "running", BOUND);
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    // Make the store unreadable: its schema key now claims a future version.
    {
        let db = sled::open(c.worker_dir("w1").join("sidecar-db")).unwrap();
        db.open_tree("meta").unwrap().insert("schema", &99u32.to_be_bytes()).unwrap();
        db.flush().unwrap();
    }
    c.start_worker("w1");
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["attempt"], 1);
    let sidecar = c.daemon("sidecar-w1");
    assert!(sidecar.running(), "the sidecar exited");
    assert!(sidecar.log_text().contains("serving degraded"), "{}", sidecar.log_text());
    // No new work goes to a machine that cannot record intents: the leader
    // sees the degraded sidecar in the worker's heartbeats and skips it.
    let degraded = eventually(BOUND, || {
        let status = c.status()?;
        let workers = status["workers"].as_array()?.clone();
        workers.iter().any(|w| w["id"] == "w1" && w["sidecar"] == "degraded").then_some(())
    });
    assert!(degraded.is_some(), "the leader never saw the degraded sidecar\n{}", c.logs());
    let next = c.submit(&["--", "echo never-here"]);
    let waited = c.cli(&["wait", &next, "--timeout", "3"]);
    assert!(!waited.status.success());
    assert_eq!(c.snapshot(&next)["status"], "queued", "{}", c.logs());
    assert!(!output_file(&c, &next).exists());
}

fn corrupt_first_record(c: &Cluster) {
    let dir = c.worker_dir("w1").join("sidecar-db");
    // The killed sidecar's latest writes may be only in the store's commit
    // log: opening the store replays them into the database first.
    drop(eventually(BOUND, || tenure_sidecar::SledStore::open(&dir).ok()).expect("open the store"));
    let db = eventually(BOUND, || sled::open(&dir).ok()).expect("open the database");
    let tree = db.open_tree("attempts").unwrap();
    let (key, value) = tree.iter().next().expect("a record").unwrap();
    let mut bytes = value.to_vec();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    tree.insert(key, bytes).unwrap();
    db.flush().unwrap();
}

/// The named crash windows: the worker dies exactly at each point, restarts,
/// and the task ends as the window allows — never run twice.
fn crash_at(point: &str, command: &str) -> (Cluster, String, serde_json::Value) {
    let mut c = Cluster::start(0);
    c.spawn_sidecar("w1");
    c.spawn_worker_crashing_at("w1", point);
    c.wait_workers(1);
    let task = c.submit(&["--", command]);
    let crashed = c.daemon("worker-w1").wait_exit(BOUND);
    assert!(crashed.is_some_and(|s| !s.success()), "the worker did not crash at {point}:\n{}", c.logs());
    c.spawn_worker("w1", &[]);
    let snap = c
        .wait_settled(&task, BOUND)
        .unwrap_or_else(|| panic!("{task} did not settle after a crash at {point}:\n{}", c.logs()));
    (c, task, snap)
}

/// A grant's accept and intent are one record: a worker that dies before it
/// leaves nothing, and the grant re-sent to the restarted worker runs once.
#[test]
fn crash_before_the_grant_is_recorded_runs_the_task_once() {
    let (c, task, snap) = crash_at("before-record", "echo ran");
    assert_eq!(snap["status"], "completed", "{snap}");
    assert_eq!(read(&output_file(&c, &task)), "ran\n");
}

#[test]
fn crash_after_intent_before_spawn_is_unknown_maybe_ran() {
    let (c, task, snap) = crash_at("after-intent", "echo ran");
    assert_eq!((snap["status"].as_str(), snap["hint"]["tag"].as_str()), (Some("unknown"), Some("maybe-ran")));
    assert_eq!(snap["attempt"], 1);
    assert_eq!(read(&output_file(&c, &task)), "", "nothing started, and nothing was started again");
}

#[test]
fn crash_after_exit_recorded_before_report_reports_it_once() {
    let (c, task, snap) = crash_at("after-exited", "echo ran; exit 4");
    assert_eq!((snap["status"].as_str(), snap["exit_code"].as_i64()), (Some("failed"), Some(4)));
    assert_eq!(snap["attempt"], 1);
    assert_eq!(read(&output_file(&c, &task)), "ran\n");
}

#[test]
fn crash_after_report_before_acknowledged_is_idempotent() {
    let (mut c, task, snap) = crash_at("after-report", "echo ran");
    assert_eq!((snap["status"].as_str(), snap["attempt"].as_u64()), (Some("completed"), Some(1)));
    assert_eq!(read(&output_file(&c, &task)), "ran\n");
    // The restarted worker re-reported the buffered completion and got it acknowledged.
    let acked = eventually(BOUND, || c.daemon("worker-w1").log_text().contains("re-reporting").then_some(()));
    assert!(acked.is_some(), "{}", c.logs());
}

/// Raw damage: bytes flipped in the sled files themselves. Whatever sled makes
/// of it, the sidecar stays up and the running task is settled from its
/// shim's evidence or marked unknown — never run again.
#[test]
fn flipped_bytes_in_the_sled_files_never_crash_the_sidecar_or_rerun_a_task() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "echo a; sleep 2; echo b"]);
    c.wait_status(&task, "running", BOUND);
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    let db = c.worker_dir("w1").join("sidecar-db");
    let mut flipped = 0;
    for entry in walk(&db) {
        let mut bytes = std::fs::read(&entry).unwrap();
        if bytes.len() < 64 {
            continue;
        }
        for i in (16..bytes.len()).step_by(97) {
            bytes[i] ^= 0x5a;
        }
        std::fs::write(&entry, bytes).unwrap();
        flipped += 1;
    }
    assert!(flipped > 0, "no sled file to damage");
    c.start_worker("w1");
    let snap = eventually(BOUND, || {
        let s = c.try_snapshot(&task)?;
        matches!(s["status"].as_str(), Some("completed" | "unknown")).then_some(s)
    })
    .unwrap_or_else(|| panic!("{task} not settled:\n{}", c.logs()));
    assert_eq!(snap["attempt"], 1, "{snap}");
    if snap["status"] == "unknown" {
        assert!(snap["hint"]["tag"].is_string(), "{snap}");
    }
    assert!(c.daemon("sidecar-w1").running(), "sidecar died:\n{}", c.logs());
    assert_eq!(read(&output_file(&c, &task)), "a\nb\n");
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// `tenure status` shows each worker's sidecar as its worker last saw it.
#[test]
fn status_shows_sidecar_health() {
    let mut c = Cluster::start(1);
    let health = |c: &Cluster| -> Option<String> {
        let out = c.cli(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        v["workers"][0]["sidecar"].as_str().map(str::to_owned)
    };
    assert_eq!(health(&c).as_deref(), Some("ok"));
    c.kill9("sidecar-w1");
    assert!(eventually(BOUND, || (health(&c).as_deref() == Some("down")).then_some(())).is_some());
    c.spawn_sidecar("w1");
    assert!(eventually(BOUND, || (health(&c).as_deref() == Some("ok")).then_some(())).is_some());
}

/// The worker's child that forks the shims (its shim launcher) of `worker`, if any.
fn shim_launcher(worker: i32) -> Option<i32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let ppid: i32 = stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == worker && cmdline.split(|b| *b == 0).any(|a| a == b"shim-launcher")).then_some(pid)
    })
}

/// A cluster of one worker running `command` as a task, once it runs: the
/// cluster, the task, the worker's pid and its shim launcher's.
fn running_under_a_launcher(command: &str) -> (Cluster, String, i32, i32) {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", command]);
    c.wait_status(&task, "running", BOUND);
    let worker = c.daemon("worker-w1").last_pid().expect("started");
    let launcher = eventually(BOUND, || shim_launcher(worker)).expect("the worker runs a shim launcher");
    (c, task, worker, launcher)
}

/// Mid-run, the process that forks shims is killed. Running tasks never
/// depended on it: they finish under their shims and are reported once; the
/// worker starts another launcher for the next task.
#[test]
fn a_killed_shim_launcher_is_replaced_and_running_tasks_go_on() {
    let (c, task, worker, launcher) =
        running_under_a_launcher("for i in $(seq 1 10); do echo tick-$i; sleep 0.1; done");
    let shim = shim_of(&c, &task);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(launcher), nix::sys::signal::Signal::SIGKILL).unwrap();

    let snap = c.wait_status(&task, "completed", BOUND);
    // Its launcher gone, the shim exits after its attempt instead of waiting
    // for another.
    assert!(eventually(BOUND, || (!shim.alive()).then_some(())).is_some(), "shim {shim:?} outlived its attempt");
    assert_eq!((snap["attempt"].as_u64(), snap["exit_code"].as_i64()), (Some(1), Some(0)));
    let expected: String = (1..=10).map(|i| format!("tick-{i}\n")).collect();
    assert_eq!(read(&output_file(&c, &task)), expected);

    let next = c.submit(&["--", "echo after"]);
    c.wait_status(&next, "completed", BOUND);
    assert_eq!(stdout(&c.cli(&["logs", &next])), "after\n");
    let again = shim_launcher(worker).expect("a new launcher");
    assert_ne!(again, launcher);
}

/// The launcher and every shim it forks run `tenure-shim`, the small program
/// built beside `tenure`, and say so in the worker's log; the task runs
/// under it like under `tenure shim-launcher`.
#[test]
fn shims_are_forked_from_the_small_program_beside_tenure() {
    let (mut c, task, _, launcher) = running_under_a_launcher("sleep 60");
    let exe = |pid: i32| std::fs::read_link(format!("/proc/{pid}/exe")).expect("a live process");
    for pid in [launcher, shim_pid(&c, &task)] {
        assert_eq!(exe(pid).file_name().and_then(|n| n.to_str()), Some("tenure-shim"), "process {pid}");
    }
    assert!(c.daemon("worker-w1").log_text().contains("shims are forked from tenure-shim"), "{}", c.logs());
    assert!(c.cli(&["kill", &task]).status.success());
    c.wait_status(&task, "killed", BOUND);
}

/// A shim serves one attempt after another: a task submitted after the one
/// before ended runs under that one's shim, also after that one was
/// killed (the kill reached its attempt alone). SIGTERM to a shim waiting
/// for work ends it, and the next task gets a new one.
#[test]
fn a_shim_serves_attempts_one_after_another() {
    let c = Cluster::start(1);
    let killed = c.submit(&["--", "echo $PPID; sleep 60"]);
    c.wait_status(&killed, "running", BOUND);
    let shim = shim_of(&c, &killed);
    assert!(c.cli(&["kill", &killed]).status.success());
    c.wait_status(&killed, "killed", BOUND);

    let output = |task: &str| -> String {
        c.wait_status(task, "completed", BOUND);
        stdout(&c.cli(&["logs", task]))
    };
    // The task's parent, as it printed it.
    let parent_of = |task: &str| -> Option<i32> { output(task).lines().next().and_then(|l| l.parse().ok()) };
    let next = c.submit(&["--", "echo $PPID"]);
    assert_eq!(parent_of(&next), Some(shim.pid), "the next attempt went to another shim");
    // Nothing of the attempts before reaches a task: it has stdin, stdout
    // and stderr open, and what `ls` opens to list them.
    let third = c.submit(&["--", "echo $PPID; ls /proc/self/fd"]);
    assert_eq!(parent_of(&third), Some(shim.pid));
    let fds: Vec<String> = output(&third).lines().skip(1).map(str::to_owned).collect();
    assert!(fds.iter().all(|f| f.parse::<u32>().is_ok_and(|n| n <= 3)), "leaked descriptors: {fds:?}");

    // Idle, it leaves at SIGTERM (as at a machine's shutdown).
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim.pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(eventually(BOUND, || (!shim.alive()).then_some(())).is_some(), "idle shim {shim:?} ignored SIGTERM");
    let after = c.submit(&["--", "echo $PPID"]);
    let new = parent_of(&after);
    assert_ne!(new, Some(shim.pid));
    let new = new.and_then(ProcessId::of);
    assert!(new.is_some_and(|p| p.alive()), "the new shim waits for the next attempt: {new:?}");
}

/// Machine shutdown: the service manager sends SIGTERM to every process,
/// shims included. The task is ended, but nobody asked for it: it fails,
/// tagged `machine-shutdown` — it is not recorded as a kill. A kill the user
/// asked for stays `killed`.
#[test]
fn sigterm_to_a_shim_at_machine_shutdown_is_not_recorded_as_a_user_kill() {
    let c = Cluster::start(1);
    let stopped = c.submit(&["--", "sleep 60"]);
    let asked = c.submit(&["--", "sleep 60"]);
    c.wait_status(&stopped, "running", BOUND);
    c.wait_status(&asked, "running", BOUND);
    let shim = shim_pid(&c, &stopped);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(shim), nix::sys::signal::Signal::SIGTERM)
        .expect("signal the shim");
    let snap = c.wait_status(&stopped, "failed", BOUND);
    let detail = snap["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.starts_with("machine-shutdown"), "{snap}\n{}", c.logs());
    assert!(!snap["kill_requested"].as_bool().unwrap_or(true), "{snap}");

    assert!(c.cli(&["kill", &asked]).status.success());
    let snap = c.wait_status(&asked, "killed", BOUND);
    assert!(!snap["detail"].as_str().unwrap_or_default().contains("machine-shutdown"), "{snap}");
}
