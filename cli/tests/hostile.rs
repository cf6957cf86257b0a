//! Tasks cannot reach the daemons (design rule 8): a task starts with nothing
//! of the worker's environment, in a scratch directory of its own rather than
//! the machine's data directory, cannot talk to the sidecar's socket, and —
//! run as an unprivileged user — cannot harm the machine's recovery state or
//! daemons however hard it tries. One worker per data directory.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{stdout, Cluster, Daemon};
use tenure_protocol::messages::SidecarRequest;
use tenure_protocol::Epoch;
use tenure_testkit::{eventually, NatsCluster, NatsServer};

const BOUND: Duration = Duration::from_secs(30);

/// Held by every test that runs tasks as `nobody`: a hostile task's
/// `kill -9 -1` reaches every process of that user, so such tests run one at
/// a time (across test binaries, `.config/nextest.toml` groups them).
static RUN_AS_NOBODY: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// A value that must never reach a task (a stand-in for the daemons' NATS password).
const SECRET: &str = "daemon-secret-3f9c1e";

/// A cluster whose worker runs with secrets in its environment, as a systemd
/// unit with an `EnvironmentFile` would; `extra` are more worker flags.
fn cluster_with_secret_env(extra: &[&str], before: impl FnOnce(&Path)) -> Cluster {
    let nats = NatsCluster::single(NatsServer::start().expect("nats-server"));
    let mut c = Cluster::on(nats, None);
    before(c.dir.path());
    c.spawn_coordinator("c1", &[]);
    c.spawn_sidecar("w1");
    let data = c.worker_dir("w1").display().to_string();
    let mut args =
        vec!["worker", "--id", "w1", "--data-dir", &data, "--heartbeat-ms", "300", "--kill-grace-ms", "1000"];
    // A NATS user and password (the server has no users and ignores them):
    // exactly what a worker of a secured cluster holds.
    args.extend_from_slice(&["--nats-user", "tenure-worker"]);
    args.extend_from_slice(extra);
    let env = [("TENURE_NATS_PASSWORD", SECRET), ("TENURE_TEST_MARKER", SECRET), ("OTEL_SERVICE_NAME", SECRET)];
    c.spawn_env("worker-w1", &args, &env);
    c.wait_workers(1);
    c
}

fn scratch_root(c: &Cluster) -> PathBuf {
    std::fs::canonicalize(c.dir.path()).expect("tempdir").join("workers").join("w1.scratch")
}

fn logs(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

/// Window: none — the task's start. (a) The environment is cleared, the
/// working directory is the attempt's scratch directory, the task's names are
/// set and cannot be overridden by its spec.
#[test]
fn a_task_sees_nothing_of_the_daemons_environment_and_runs_in_its_own_scratch_dir() {
    let c = cluster_with_secret_env(&[], |_| {});
    // It leaves a file in its directory, so that the directory is kept for it.
    let script =
        "echo \"PWD=$(pwd)\"; echo ---env; env | sort; echo ---ls; ls -a; echo ---fd; ls /proc/self/fd; touch left";
    let task = c.submit(&["--env", "GREETING=hi", "--env", "TENURE_TASK_ID=shell-999", "--", script]);
    c.wait_status(&task, "completed", BOUND);
    let out = logs(&c, &task);
    let scratch = scratch_root(&c).join(format!("{task}.1"));
    let section = |name: &str| -> Vec<String> {
        out.split(&format!("---{name}\n"))
            .nth(1)
            .map(|s| s.split("\n---").next().unwrap_or("").lines().map(str::to_owned).collect())
            .unwrap_or_default()
    };

    assert!(!out.contains(SECRET), "a daemon secret reached the task:\n{out}");
    assert!(out.starts_with(&format!("PWD={}\n", scratch.display())), "{out}");
    let env = section("env");
    let names: Vec<&str> = env.iter().filter_map(|l| l.split_once('=')).map(|(k, _)| k).collect();
    // What the task gets, plus what its shell sets for itself.
    let allowed = [
        "GREETING",
        "HOME",
        "LANG",
        "PATH",
        "TENURE_ATTEMPT",
        "TENURE_NATS",
        "TENURE_NATS_URL",
        "TENURE_SESSION",
        "TENURE_TASK_ID",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
    ];
    assert!(names.iter().all(|n| allowed.contains(n)), "unexpected variables in {names:?}");
    for expected in [
        format!("TENURE_TASK_ID={task}"),
        "TENURE_ATTEMPT=1".into(),
        "TENURE_SESSION=test-owner".into(),
        format!("HOME={}", scratch.display()),
        "PATH=/usr/local/bin:/usr/bin:/bin".into(),
        "GREETING=hi".into(),
        format!("TENURE_NATS={}", c.nats.url),
    ] {
        assert!(env.contains(&expected), "{expected} missing from {env:?}");
    }
    // The data directory is nowhere in sight.
    let ls = section("ls");
    for private in ["sidecar-db", "sidecar.sock", "attempts", "output", "worker.lock"] {
        assert!(!ls.iter().any(|l| l == private), "{private} visible to the task: {ls:?}");
    }
    // Only stdin, stdout, stderr (and `ls`'s own directory) are open: no
    // descriptor of the shim leaks into the task.
    let fds = section("fd");
    assert!(fds.iter().all(|f| f.parse::<u32>().is_ok_and(|n| n <= 3)), "leaked descriptors: {fds:?}");

    // The scratch directory is the daemons' to release: kept until the
    // task's files are released, then removed with them.
    assert!(scratch.join("left").is_file());
    let root_mode = std::fs::metadata(scratch_root(&c)).expect("scratch root").mode() & 0o777;
    assert_eq!(root_mode, 0o711);
    let data_mode = std::fs::metadata(c.worker_dir("w1")).expect("data dir").mode() & 0o777;
    assert_eq!(data_mode, 0o700);
    let deleted = c.cli(&["delete", &task]);
    assert!(deleted.status.success(), "{}", common::stderr(&deleted));
    let gone = eventually(BOUND, || (!scratch.exists()).then_some(()));
    assert!(gone.is_some(), "the scratch dir outlived the task's files\n{}", c.logs());
}

/// Start-up reconciliation: a scratch directory whose task this machine holds
/// no record of any more (its files were released) is removed; one whose task
/// still has records is kept; a directory that is not named after an attempt
/// is not the worker's to judge and is left alone.
#[test]
fn a_restarted_worker_removes_only_released_scratch_dirs() {
    let mut c = cluster_with_secret_env(&[], |_| {});
    let task = c.submit(&["--", "echo kept > here"]);
    c.wait_status(&task, "completed", BOUND);
    let root = scratch_root(&c);
    let (kept, released, stranger) = (root.join(format!("{task}.1")), root.join("shell-9999.1"), root.join("not-ours"));
    assert!(kept.join("here").is_file());
    std::fs::create_dir(&released).expect("mkdir");
    std::fs::create_dir(&stranger).expect("mkdir");
    // Spares an earlier run left: an empty one goes; one holding a file (a
    // power cut can undo the rename that made it a task's) stays.
    let (spare, full_spare) = (root.join(".spare.7"), root.join(".spare.8"));
    std::fs::create_dir(&spare).expect("mkdir");
    std::fs::create_dir(&full_spare).expect("mkdir");
    std::fs::write(full_spare.join("result"), b"x").expect("write");
    c.stop("worker-w1");
    let data = c.worker_dir("w1").display().to_string();
    c.spawn("worker-w1", &["worker", "--id", "w1", "--data-dir", &data, "--heartbeat-ms", "300"]);
    let swept = eventually(BOUND, || (!released.exists()).then_some(()));
    assert!(
        swept.is_some(),
        "a released scratch dir survived the restart
{}",
        c.logs()
    );
    assert!(kept.join("here").is_file(), "a held task's scratch dir was removed");
    assert!(stranger.is_dir(), "a directory the worker did not make was removed");
    assert!(!spare.exists(), "an empty spare survived the restart");
    assert!(full_spare.join("result").is_file(), "a spare holding a file was removed");
    let log = c.daemon("worker-w1").log_text();
    assert!(log.contains("removing the scratch directory") && log.contains("shell-9999"), "{log}");
    assert!(log.contains("left for the operator") && log.contains(".spare.8"), "{log}");
}

/// A spec `cwd` is where the task runs; its HOME is still its scratch dir.
#[test]
fn a_spec_cwd_is_honoured_and_home_stays_the_scratch_dir() {
    let c = cluster_with_secret_env(&[], |_| {});
    let cwd = std::fs::canonicalize(c.dir.path()).expect("tempdir").display().to_string();
    let task = c.submit(&["--cwd", &cwd, "--", "pwd; echo \"$HOME\""]);
    c.wait_status(&task, "completed", BOUND);
    let scratch = scratch_root(&c).join(format!("{task}.1"));
    assert_eq!(logs(&c, &task), format!("{cwd}\n{}\n", scratch.display()));
}

/// A scratch directory its task left empty goes back to the worker once the
/// task's outcome is acknowledged, and the next task gets it (the same
/// directory, renamed and given to it); one its task left anything in stays
/// the task's until its files are released.
#[test]
fn an_empty_scratch_dir_goes_to_the_next_task_and_a_used_one_stays() {
    let c = cluster_with_secret_env(&[], |_| {});
    let root = scratch_root(&c);
    let spares = || -> Vec<(String, u64)> {
        let entries = std::fs::read_dir(&root).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
        entries
            .iter()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().map(|m| m.ino()).unwrap_or(0)))
            .filter(|(name, _)| name.starts_with(".spare."))
            .collect()
    };
    let empty = c.submit(&["--", "true"]);
    c.wait_status(&empty, "completed", BOUND);
    let spare = eventually(BOUND, || spares().pop());
    let Some((_, ino)) = spare else { panic!("no spare after an empty directory's release\n{}", c.logs()) };
    assert!(!root.join(format!("{empty}.1")).exists());

    let next = c.submit(&["--", "pwd; stat -c %i .; ls -A; touch used"]);
    c.wait_status(&next, "completed", BOUND);
    let dir = root.join(format!("{next}.1"));
    assert_eq!(logs(&c, &next), format!("{}\n{ino}\n", dir.display()), "not the spare, or not empty");
    assert!(spares().is_empty(), "{:?}", spares());
    // It holds a file: it stays after the release (the attempt's journal goes
    // after the directory is looked at), until the task's files go.
    let journal = c.worker_dir("w1").join("attempts").join(format!("{next}.1.journal"));
    let released = eventually(BOUND, || (!journal.exists()).then_some(()));
    assert!(released.is_some(), "{}", c.logs());
    assert!(dir.join("used").is_file(), "a directory with a file was taken back");
    let deleted = c.cli(&["delete", &next]);
    assert!(deleted.status.success(), "{}", common::stderr(&deleted));
    let gone = eventually(BOUND, || (!dir.exists()).then_some(()));
    assert!(gone.is_some(), "{}", c.logs());
}

/// The bytes of a well-formed request a hostile task would send to raise the
/// machine's epoch fence to the maximum (every leader would step down).
fn observe_max_epoch_frame() -> String {
    let body = tenure_protocol::encode(&SidecarRequest::ObserveEpoch(Epoch(u64::MAX))).expect("encode");
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame.iter().map(|b| format!("{b:02x}")).collect()
}

/// A task's attempt to talk to the sidecar: connect, send FRAME (hex), and
/// say what came back.
const PROBE: &str = r#"
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(os.environ["SOCK"])
except OSError as e:
    print("CONNECT-FAILED", e.strerror); sys.exit(0)
try:
    s.sendall(bytes.fromhex(os.environ["FRAME"]))
    s.settimeout(10)
    got = s.recv(64)
    print(("REPLY %d" % len(got)) if got else "CLOSED")
except OSError as e:
    print("CLOSED", e.strerror)
"#;

fn python() -> Option<&'static str> {
    ["/usr/bin/python3", "/usr/local/bin/python3"].into_iter().find(|p| Path::new(p).is_file())
}

/// The machine's recorded epoch fence, read from its store (sidecar stopped).
fn stored_epoch(c: &Cluster) -> Epoch {
    let store = tenure_sidecar::SledStore::open(&c.worker_dir("w1").join("sidecar-db")).expect("open the store");
    tenure_sidecar::Machine::restore(store).expect("restore").epoch()
}

/// (b) A task of the daemons' own user that connects to `sidecar.sock` and
/// sends a well-formed request is cut off before anything is read, and the
/// machine's epoch fence does not move.
#[test]
fn a_task_cannot_talk_to_the_sidecar_even_as_the_same_user() {
    let Some(python) = python() else {
        println!("skipped: no python3 to play the hostile peer");
        return;
    };
    let mut c = cluster_with_secret_env(&[], |_| {});
    let sock = c.worker_dir("w1").join("sidecar.sock").display().to_string();
    let frame = observe_max_epoch_frame();
    let (sock_env, frame_env) = (format!("SOCK={sock}"), format!("FRAME={frame}"));
    let command = format!("{python} -c '{PROBE}'");
    let task = c.submit(&["--env", &sock_env, "--env", &frame_env, "--", &command]);
    c.wait_status(&task, "completed", BOUND);
    let out = logs(&c, &task);
    assert!(out.starts_with("CLOSED"), "the sidecar answered a task: {out:?}\n{}", c.logs());
    let sidecar_log = c.daemon("sidecar-w1").log_text();
    assert!(sidecar_log.contains("refused: not the worker"), "{sidecar_log}");

    // The cluster still works: the machine's fence did not move to the top.
    let after = c.submit(&["--", "echo fine"]);
    c.wait_status(&after, "completed", BOUND);
    c.stop("worker-w1");
    c.stop("sidecar-w1");
    let epoch = stored_epoch(&c);
    assert!(epoch < Epoch(1000), "the hostile request was persisted: epoch {epoch:?}");
}

/// (d) A second worker on the same data directory exits at once, naming the
/// process that holds it; the first one goes on.
#[test]
fn a_second_worker_on_the_same_data_dir_is_refused_naming_the_first() {
    let mut c = Cluster::start(1);
    let first = c.daemon("worker-w1").last_pid().expect("started");
    let data = c.worker_dir("w1").display().to_string();
    let second = c.spawn("worker-w1-again", &["worker", "--id", "w1", "--data-dir", &data]);
    let status = second.wait_exit(BOUND).expect("the second worker exits by itself");
    assert!(!status.success());
    let log = second.log_text();
    assert!(log.contains(&format!("another worker (pid {first}) is running on this data directory")), "{log}");
    let task = c.submit(&["--", "echo still-served"]);
    c.wait_status(&task, "completed", BOUND);
    assert!(c.daemon("worker-w1").running());
}

/// Processes of `uid` on this machine, other than those in `ours`.
fn processes_of(uid: u32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| std::fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == uid))
        .collect()
}

fn alive(d: &mut Daemon) -> bool {
    d.running()
}

/// (c) Under `--run-as nobody`, a task that deletes everything it can reach
/// and kills every process it may signal leaves the machine's data directory
/// and daemons intact, and every task is settled truthfully.
#[test]
fn a_hostile_task_run_as_nobody_harms_neither_the_data_dir_nor_the_daemons() {
    if !nix::unistd::geteuid().is_root() {
        println!("skipped: --run-as needs the worker to run as root, and these tests do not");
        return;
    }
    let Ok(Some(nobody)) = nix::unistd::User::from_name("nobody") else {
        println!("skipped: this machine has no user `nobody`");
        return;
    };
    let _alone = RUN_AS_NOBODY.lock().unwrap_or_else(|p| p.into_inner());
    let uid = nobody.uid.as_raw();
    // `kill -9 -1` as nobody reaches every process of nobody on the machine:
    // with strangers among them, the task kills only its own kind.
    let strangers = processes_of(uid);
    let kill_all = if strangers.is_empty() { "1" } else { "0" };
    if !strangers.is_empty() {
        println!("note: processes {strangers:?} already run as nobody; the hostile task will not `kill -9 -1`");
    }
    // The run-as user must be able to pass the test's directory to reach its
    // scratch root (a tempdir is 0700).
    let mut c = cluster_with_secret_env(&["--run-as", "nobody", "--slots", "4"], |dir| {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
    });
    let data = c.worker_dir("w1");
    let kept = c.submit(&["--", "echo precious-output"]);
    c.wait_status(&kept, "completed", BOUND);
    let output_file = data.join("output").join(format!("{kept}.out"));
    assert_eq!(std::fs::read_to_string(&output_file).ok().as_deref(), Some("precious-output\n"));

    // Running next to the hostile one: a task of the same user (it may be
    // killed, and must then be settled as what happened to it), and a
    // built-in inside the worker (it must complete).
    let victim = c.submit(&["--", "echo started; sleep 20; echo finished"]);
    let inside = c.submit(&["--kind", "sleep", "--", "3000"]);
    c.wait_status(&victim, "running", BOUND);
    eventually(BOUND, || logs(&c, &victim).contains("started").then_some(())).expect("victim started");

    let python = python().unwrap_or("python3");
    let hostile = format!(
        r#"[ "$(id -u)" != 0 ] || {{ echo "REFUSING: running as root"; exit 99; }}
echo "uid=$(id -u) home=$HOME"
rm -rf ./* ~/* /tmp/* 2>/dev/null
rm -rf "$DATA"/* 2>&1 | head -n 3
ls "$DATA" 2>&1 | head -n 1
SOCK="$DATA/sidecar.sock" {python} -c '{PROBE}' 2>&1 | tail -n 1
if [ "$KILL_ALL" = 1 ]; then kill -9 -1; fi
echo "still here"
"#
    );
    let (data_env, frame_env, kill_env) = (
        format!("DATA={}", data.display()),
        format!("FRAME={}", observe_max_epoch_frame()),
        format!("KILL_ALL={kill_all}"),
    );
    let task = c.submit(&["--env", &data_env, "--env", &frame_env, "--env", &kill_env, "--", &hostile]);
    let snap = eventually(BOUND, || {
        c.try_snapshot(&task).filter(|s| ["completed", "failed"].contains(&s["status"].as_str().unwrap_or("")))
    })
    .unwrap_or_else(|| panic!("the hostile task never ended\n{}", c.logs()));
    let out = logs(&c, &task);
    println!("the hostile task ({}) said:\n{out}", snap["status"]);
    assert!(!out.contains("REFUSING"), "the task ran as root: {out}");
    assert!(out.contains(&format!("uid={uid} ")), "{out}");
    assert!(out.contains("Permission denied"), "the data dir was reachable: {out}");
    assert!(
        out.contains("CONNECT-FAILED") || out.contains("CLOSED"),
        "the sidecar socket answered: {out}\n{}",
        c.logs()
    );
    assert!(out.contains("still here"), "{out} ({snap})");

    // The daemons live, the data directory and its files are whole.
    for name in ["coordinator-c1", "sidecar-w1", "worker-w1"] {
        assert!(alive(c.daemon(name)), "{name} died\n{}", c.logs());
    }
    for entry in ["sidecar-db", "sidecar.sock", "attempts", "output", "worker.lock"] {
        assert!(data.join(entry).exists(), "{entry} is gone from the data dir");
    }
    assert_eq!(std::fs::read_to_string(&output_file).ok().as_deref(), Some("precious-output\n"));
    assert_eq!(logs(&c, &kept), "precious-output\n");

    // Every task settled for what happened to it.
    c.wait_status(&inside, "completed", BOUND);
    let victim_end = eventually(BOUND, || {
        c.try_snapshot(&victim).filter(|s| ["completed", "failed"].contains(&s["status"].as_str().unwrap_or("")))
    })
    .unwrap_or_else(|| panic!("the victim never settled\n{}", c.logs()));
    if kill_all == "1" {
        // Killed by the hostile task's signal: failed, and says so.
        assert_eq!(victim_end["status"], "failed", "{victim_end}");
        assert!(victim_end["detail"].as_str().unwrap_or("").contains("signal 9"), "{victim_end}");
        assert!(!logs(&c, &victim).contains("finished"));
    }
    // The machine still takes and runs work, under a sane epoch.
    let after = c.submit(&["--", "echo fine"]);
    c.wait_status(&after, "completed", BOUND);
    assert_eq!(logs(&c, &after), "fine\n");
    c.stop("worker-w1");
    c.stop("sidecar-w1");
    assert!(stored_epoch(&c) < Epoch(1000));
}

/// Under `--run-as`, a spec `cwd` the user cannot enter fails the task with a
/// clear reason; the worker goes on.
#[test]
fn under_run_as_a_cwd_the_user_cannot_enter_fails_the_task_not_the_worker() {
    if !nix::unistd::geteuid().is_root() {
        println!("skipped: --run-as needs the worker to run as root, and these tests do not");
        return;
    }
    if !matches!(nix::unistd::User::from_name("nobody"), Ok(Some(_))) {
        println!("skipped: this machine has no user `nobody`");
        return;
    }
    let _alone = RUN_AS_NOBODY.lock().unwrap_or_else(|p| p.into_inner());
    let mut c = cluster_with_secret_env(&["--run-as", "nobody"], |dir| {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
    });
    let closed = c.dir.path().join("closed");
    std::fs::create_dir(&closed).expect("mkdir");
    std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let task = c.submit(&["--cwd", &closed.display().to_string(), "--", "echo should-not-run"]);
    let snap = c.wait_status(&task, "failed", BOUND);
    let detail = snap["detail"].as_str().unwrap_or("");
    assert!(detail.contains("as user nobody") && detail.contains("Permission denied"), "{snap}");
    assert!(!logs(&c, &task).contains("should-not-run"));
    // A task's scratch dir belongs to its user (this one leaves a file in it,
    // so that it is kept).
    let ok = c.submit(&["--", "id -u; touch mine"]);
    c.wait_status(&ok, "completed", BOUND);
    let scratch = scratch_root(&c).join(format!("{ok}.1"));
    let owner = std::fs::metadata(&scratch).expect("scratch dir").uid();
    assert_eq!(Some(owner), nix::unistd::User::from_name("nobody").ok().flatten().map(|u| u.uid.as_raw()));
    assert_eq!(std::fs::metadata(scratch.join("mine")).expect("its file").uid(), owner);
    assert!(alive(c.daemon("worker-w1")));
}
