//! Power loss, one acknowledged step at a time, with the real binaries.
//!
//! A worker machine's data directory (sled store, attempt files, FIFOs,
//! sockets, epoch mirror; and the scratch root beside it) lives on a
//! filesystem that keeps only what was synced (strict POSIX rules). The worker
//! dies at one of its named crash windows, right after the acknowledgement
//! that window follows; then every process of the machine is SIGKILLed, the
//! power is cut, the filesystem mounted again (the reboot), and the machine's
//! daemons started again. Tasks append to a ledger outside the mount, so a
//! second run is seen whatever the machine forgot.
//!
//! The same for nats-server's JetStream store: cut right after a submit was
//! acknowledged to the client, with `sync_interval: always` and with the
//! server's default.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Cluster;
use tenure_machine::Layout;
use tenure_powerfs::{CutOptions, Mounted, Options, PowerFs};
use tenure_protocol::messages::{LeaseGrant, SidecarRefusal, SidecarReply, SidecarRequest};
use tenure_protocol::{Attempt, Epoch, TaskSpec};
use tenure_sidecar::{Machine, SledStore};
use tenure_testkit::{eventually, processes_using, remove_groups_named, NatsCluster, NatsServer};

const BOUND: Duration = Duration::from_secs(60);

/// A powerfs mount in a directory of its own. Declared before the cluster in
/// each test, so it is dropped (cleanly unmounted) after the cluster's
/// processes were stopped.
struct Power {
    mounted: Option<Mounted>,
    options: Options,
    backing: PathBuf,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Power {
    fn mount(options: Options) -> Power {
        let dir = tempfile::tempdir().expect("tempdir");
        let (backing, mnt) = (dir.path().join("backing"), dir.path().join("mnt"));
        let mounted = PowerFs::mount(&backing, &mnt, options).expect("mount the power-loss filesystem");
        Power { mounted: Some(mounted), options, backing, mnt, _dir: dir }
    }

    /// Cuts the power (everything not synced is gone) and boots again.
    fn cut(&mut self) {
        let mounted = self.mounted.take().expect("mounted");
        mounted.cut(CutOptions::default()).expect("cut");
        self.mounted = Some(PowerFs::mount(&self.backing, &self.mnt, self.options).expect("remount after the cut"));
    }

    /// SIGKILLs every process that has anything open, or its working
    /// directory, on the mount (sidecar, shim launcher, shims, tasks):
    /// a machine losing power takes them all. Waits until none is left.
    fn kill_machine(&self) {
        let mnt = self.mnt.canonicalize().expect("mountpoint");
        let me = std::process::id() as i32;
        let gone = eventually(BOUND, || {
            let users = processes_using(&mnt, me);
            for pid in &users {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
            }
            users.is_empty().then_some(())
        });
        assert!(gone.is_some(), "processes on the mount survived SIGKILL: {:?}", processes_using(&mnt, me));
        // A reboot takes the machine's control groups too.
        let worker: tenure_protocol::WorkerId = "w1".parse().expect("id");
        let name = tenure_worker::cgroup::parent_name(&worker, &mnt.join("workers").join("w1"));
        remove_groups_named(Path::new("/sys/fs/cgroup"), &name, 5);
    }
}

/// Puts the cluster's machine directories (`<cluster>/workers/<id>`) on the mount.
fn machines_on(c: &Cluster, power: &Power) {
    let workers = power.mnt.join("workers");
    std::fs::create_dir(&workers).expect("workers dir on the mount");
    // Made durable like any directory the operator prepared for a machine.
    std::fs::File::open(&power.mnt).and_then(|d| d.sync_all()).expect("sync the mount's root");
    std::os::unix::fs::symlink(&workers, c.dir.path().join("workers")).expect("link the workers dir");
}

fn ledger_runs(ledger: &Path) -> usize {
    std::fs::read_to_string(ledger).unwrap_or_default().lines().count()
}

/// A task that appends one line to `ledger` each time it runs.
fn ledger_command(ledger: &Path, rest: &str) -> String {
    format!("echo run >> {}; {rest}", ledger.display())
}

/// The worker of machine `w1` dies right after `point` (its acknowledgement);
/// the machine loses power; its daemons start again. Returns the settled task.
fn cut_after(point: &str, rest: &str) -> (Power, Cluster, String, PathBuf, serde_json::Value) {
    let mut power = Power::mount(Options::default());
    let mut c = Cluster::start(0);
    machines_on(&c, &power);
    let ledger = c.dir.path().join("ledger");
    c.spawn_sidecar("w1");
    c.spawn_worker_crashing_at("w1", point);
    c.wait_workers(1);
    let task = c.submit(&["--", &ledger_command(&ledger, rest)]);
    let crashed = c.daemon("worker-w1").wait_exit(BOUND);
    assert!(crashed.is_some_and(|s| !s.success()), "the worker did not crash at {point}:\n{}", c.logs());
    let runs_before_cut = ledger_runs(&ledger);
    let instance = c
        .daemon("worker-w1")
        .log_text()
        .lines()
        .find(|l| l.contains("worker ready"))
        .and_then(|l| l.split("instance=").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no instance in the worker's log:\n{}", c.logs()));
    c.kill9("sidecar-w1");
    power.kill_machine();
    power.cut();
    let recorded = std::fs::read_to_string(c.worker_dir("w1").join("worker.instance")).unwrap_or_default();
    assert_eq!(recorded.trim(), instance, "the worker instance file was written before its heartbeats named it");
    c.spawn_sidecar("w1");
    c.spawn_worker("w1", &[]);
    let snap = c
        .wait_settled(&task, BOUND)
        .unwrap_or_else(|| panic!("{task} did not settle after a cut at {point}:\n{}", c.logs()));
    eprintln!("{point}: ran {runs_before_cut} time(s) before the cut; settled as {snap}");
    (power, c, task, ledger, snap)
}

/// After a second cut, with every daemon of the machine stopped, the store
/// holds the highest epoch the machine acknowledged and refuses a lower one.
fn the_fence_held(power: &mut Power, c: &mut Cluster, snap: &serde_json::Value) {
    let epoch = Epoch(snap["epoch"].as_u64().unwrap_or_else(|| panic!("no epoch in {snap}")));
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    power.kill_machine();
    power.cut();
    let layout = Layout::new(c.worker_dir("w1"));
    let store = eventually(BOUND, || SledStore::open(&layout.db_dir()).ok()).expect("open the store after the cut");
    let mut machine = Machine::restore(store).expect("restore the machine");
    assert!(machine.epoch() >= epoch, "the fence went back: {:?} < {epoch:?}", machine.epoch());
    let stale = Epoch(machine.epoch().0 - 1);
    let grant = LeaseGrant {
        input: Vec::new(),
        task: "shell-999".parse().expect("task id"),
        attempt: Attempt(1),
        epoch: stale,
        owner: "test-owner".parse().expect("owner"),
        spec: TaskSpec::shell("stale", "echo stale"),
        mark: None,
    };
    assert_eq!(
        machine.handle(SidecarRequest::Accept(grant)),
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: machine.epoch(), offered: stale }),
        "a deposed epoch is refused after the cut"
    );
}

/// `snap`, the task's settled snapshot, says its first attempt may have
/// run; the machine then takes new work again, the task stays `unknown`, it
/// ran `runs` times in all, and the fence held.
fn in_doubt_and_never_rerun(
    power: &mut Power,
    c: &mut Cluster,
    task: &str,
    ledger: &Path,
    snap: &serde_json::Value,
    runs: usize,
) {
    assert_eq!(
        (snap["status"].as_str(), snap["hint"]["tag"].as_str(), snap["attempt"].as_u64()),
        (Some("unknown"), Some("maybe-ran"), Some(1)),
        "{snap}\n{}",
        c.logs()
    );
    let later = c.submit(&["--", "echo later"]);
    c.wait_status(&later, "completed", BOUND);
    assert_eq!(c.snapshot(task)["status"], "unknown");
    assert_eq!(ledger_runs(ledger), runs, "the task ran before the cut or not at all, and never after it");
    the_fence_held(power, c, snap);
}

/// A task whose intent was acknowledged never starts after the cut.
#[test]
fn power_cut_after_intent_never_reruns_the_task() {
    let (mut power, mut c, task, ledger, snap) = cut_after("after-intent", "echo ran");
    in_doubt_and_never_rerun(&mut power, &mut c, &task, &ledger, &snap, 0);
}

/// A task runs when the power goes: its journal (grant, shim, group) was
/// never synced (durability note a21) and is gone after the cut, and the
/// intent the sidecar flushed before it says the attempt may have run.
#[test]
fn power_cut_while_a_task_runs_leaves_it_unknown_and_never_runs_it_again() {
    let mut power = Power::mount(Options::default());
    let mut c = Cluster::start(0);
    machines_on(&c, &power);
    let ledger = c.dir.path().join("ledger");
    c.spawn_sidecar("w1");
    c.spawn_worker("w1", &[]);
    c.wait_workers(1);
    let task = c.submit(&["--", &ledger_command(&ledger, "sleep 60")]);
    c.wait_status(&task, "running", BOUND);
    assert!(eventually(BOUND, || (ledger_runs(&ledger) == 1).then_some(())).is_some(), "the task never ran");
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    power.kill_machine();
    power.cut();
    let files = Layout::new(c.worker_dir("w1")).attempt_files(&task.parse().expect("task id"), Attempt(1));
    assert!(!files.exists(), "the running attempt's journal was synced before its status");
    c.spawn_sidecar("w1");
    c.spawn_worker("w1", &[]);
    let snap = c.wait_settled(&task, BOUND).unwrap_or_else(|| panic!("{task} did not settle:\n{}", c.logs()));
    in_doubt_and_never_rerun(&mut power, &mut c, &task, &ledger, &snap, 1);
}

#[test]
fn power_cut_after_the_outcome_was_buffered_reports_it_without_rerunning() {
    let (mut power, mut c, task, ledger, snap) = cut_after("after-exited", "echo ran; exit 4");
    assert_eq!(
        (snap["status"].as_str(), snap["exit_code"].as_i64(), snap["attempt"].as_u64()),
        (Some("failed"), Some(4), Some(1)),
        "the buffered outcome is reported: {snap}\n{}",
        c.logs()
    );
    assert_eq!(ledger_runs(&ledger), 1, "ran exactly once");
    // The shim synced the output (file and directory) before its status.
    let output = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    assert_eq!(std::fs::read_to_string(&output).unwrap_or_default(), "ran\n", "the output is kept");
    the_fence_held(&mut power, &mut c, &snap);
}

#[test]
fn power_cut_after_the_report_keeps_the_task_completed() {
    let (mut power, mut c, task, ledger, snap) = cut_after("after-report", "echo ran");
    assert_eq!((snap["status"].as_str(), snap["attempt"].as_u64()), (Some("completed"), Some(1)), "{snap}");
    // Still completed once the restarted machine went through its records.
    let later = c.submit(&["--", "echo later"]);
    c.wait_status(&later, "completed", BOUND);
    let again = c.snapshot(&task);
    assert_eq!((again["status"].as_str(), again["attempt"].as_u64()), (Some("completed"), Some(1)), "{again}");
    assert_eq!(ledger_runs(&ledger), 1, "ran exactly once");
    the_fence_held(&mut power, &mut c, &snap);
}

/// What a JetStream store on a cut filesystem kept of an acknowledged submit.
#[derive(Debug, PartialEq, Eq)]
enum AfterCut {
    /// The task is there.
    Kept,
    /// The coordinator refuses a registry behind its high-water mark.
    RefusedBehind,
}

/// Submits a task that a worker (off the mount) runs to its end, so the
/// machine holds the registry's mark; then SIGKILLs nats-server and the
/// coordinator, cuts the power of the server's store, restarts both and finds
/// out what the cluster says once it answers about the task. Never allowed: a
/// coordinator leading with the lost task's number given to another task.
fn jetstream_cut(options: Options, sync_always: bool) -> AfterCut {
    let mut power = Power::mount(options);
    let jetstream = power.mnt.join("jetstream");
    let nats = NatsServer::start_with_jetstream(&jetstream, sync_always).expect("nats-server on the mount");
    let mut c = Cluster::on(NatsCluster::single(nats), None);
    c.spawn_coordinator("c1", &[]);
    c.wait_leader("c1");
    c.start_worker("w1");
    c.wait_workers(1);
    let task = c.submit(&["--", "echo acknowledged"]);
    c.wait_status(&task, "completed", BOUND);
    c.kill9("coordinator-c1");
    c.nats.nodes[0].kill9();
    power.kill_machine();
    power.cut();
    c.nats.nodes[0].restart().expect("restart nats-server");
    c.spawn_coordinator("c1", &[]);
    // A registry that lost the task answers "unknown" until the machine's
    // first heartbeat brings its mark; the answer that counts comes after.
    let outcome = eventually(BOUND, || {
        let out = c.cli(&["get", &task, "--json"]);
        if out.status.success() {
            let snap: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            assert_eq!(snap["status"], "completed", "{snap}");
            return Some(AfterCut::Kept);
        }
        common::stderr(&out).contains("behind its high-water mark").then_some(AfterCut::RefusedBehind)
    })
    .unwrap_or_else(|| panic!("{task} neither kept nor refused after the cut:\n{}", c.logs()));
    // A new submit gets a new number, or is refused with the registry.
    let next = eventually(BOUND, || {
        let out = c.cli(&["submit", "--", "echo next"]);
        if out.status.success() {
            return Some(Ok(common::stdout(&out).trim().to_owned()));
        }
        let err = common::stderr(&out);
        err.contains("behind its high-water mark").then_some(Err(err))
    })
    .unwrap_or_else(|| panic!("no answer to a submit after the cut:\n{}", c.logs()));
    match next {
        Ok(id) => assert_ne!(id, task, "a coordinator led with a reused task number:\n{}", c.logs()),
        Err(_) => assert_eq!(outcome, AfterCut::RefusedBehind, "a submit was refused though the task was kept"),
    }
    eprintln!("jetstream {options:?} sync_always={sync_always}: {outcome:?}");
    c.daemons().iter_mut().for_each(|d| d.stop(common::STOP_GRACE));
    c.nats.nodes[0].kill9();
    outcome
}

/// `sync_interval: always` on a filesystem that orders metadata (ext4-like):
/// the acknowledged submit is there after the cut.
#[test]
fn jetstream_with_sync_always_keeps_an_acknowledged_submit_through_a_power_cut() {
    assert_eq!(jetstream_cut(Options { journaled_metadata: true }, true), AfterCut::Kept);
}

/// Under strict rules nats-server loses its new streams whole even with
/// `sync_interval: always` (measured: the server comes back with no streams,
/// as when a server syncs its files but not the directories it created):
/// the registry and the lease go back together, and only the machine's mark
/// keeps the coordinator from reusing task numbers.
#[test]
fn jetstream_under_strict_rules_loses_the_registry_and_the_machines_mark_refuses_it() {
    assert_eq!(jetstream_cut(Options::default(), true), AfterCut::RefusedBehind);
}

/// The server's default fsync (every 2 minutes): an acknowledged submit may
/// vanish. Either it is still there or the coordinator refuses the registry
/// behind its mark; never is its number given to another task.
#[test]
fn jetstream_with_the_default_sync_never_reuses_a_lost_task_number() {
    let outcome = jetstream_cut(Options { journaled_metadata: true }, false);
    eprintln!("default sync_interval, journaled metadata: {outcome:?}");
}
