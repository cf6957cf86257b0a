//! Operator mistakes, over real processes: a worker id configured on two
//! machines at once must neither run a task twice nor take over the running
//! worker's id; a worker restarted on its own data directory takes its place
//! back at once; a machine whose data directory was wiped never runs its
//! tasks again and says so; a standby whose wall clock runs minutes ahead
//! takes over without forgetting the keys of submits retried across the
//! failover. The ledger the tasks append to is the judge.

mod common;

use std::time::Duration;

use common::{group_alive, Cluster, FAST_LEASE};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
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
    assert!(c.daemon("worker-w1").running(), "the first worker stopped\n{}", c.logs());
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

/// Three tasks run on w1; the machine's processes die and its data directory
/// is deleted; worker and sidecar start again with the same id on an empty one.
/// Every task ends `unknown` with `machine-replaced`, none runs again, and the
/// machine takes new work.
#[test]
fn a_wiped_machine_never_runs_its_tasks_again_and_says_its_store_was_replaced() {
    let mut c = Cluster::start(1);
    let ledger = c.dir.path().join("ledger");
    let line = |i: usize| format!("echo run-{i} >> {}; sleep 60", ledger.display());
    let tasks: Vec<String> = (0..3).map(|i| c.submit(&["--", &line(i)])).collect();
    for t in &tasks {
        c.wait_status(t, "running", BOUND);
    }
    eventually(BOUND, || (std::fs::read_to_string(&ledger).unwrap_or_default().lines().count() == 3).then_some(()))
        .expect("all three ran once");
    // The machine goes down with everything on it: daemons, shims, tasks.
    // A shim records its task's group just after spawning it, so a task
    // can write its ledger line first: wait (bounded) for all three.
    // The shims go too: a shim that outlived its task would write the
    // task's ending into the directory being wiped.
    let recorded = || {
        let attempts: Vec<(i32, tenure_machine::process::ProcessId)> =
            tenure_machine::attempt_files::list(&c.worker_dir("w1").join("attempts"))
                .into_iter()
                .filter_map(|(_, files)| Some((files.pgid()?, files.shim()?)))
                .collect();
        (attempts.len() == 3).then_some(attempts)
    };
    let attempts = eventually(BOUND, recorded).expect("three shims and task groups recorded");
    c.kill9("worker-w1");
    c.kill9("sidecar-w1");
    for (group, shim) in &attempts {
        if shim.alive() {
            let _ = kill(Pid::from_raw(shim.pid), Signal::SIGKILL);
        }
        let _ = killpg(Pid::from_raw(*group), Signal::SIGKILL);
    }
    for (group, shim) in &attempts {
        eventually(BOUND, || (!group_alive(*group) && !shim.alive()).then_some(())).expect("shim and task group gone");
    }
    std::fs::remove_dir_all(c.worker_dir("w1")).expect("wipe the data directory");
    c.start_worker("w1");

    for t in &tasks {
        let snap = c.wait_status(t, "unknown", Duration::from_secs(60));
        assert_eq!(snap["hint"]["tag"], "machine-replaced", "{snap}\n{}", c.logs());
        assert_eq!(snap["attempt"], 1, "{snap}");
    }
    let next = c.submit(&["--", "echo fresh"]);
    c.wait_status(&next, "completed", Duration::from_secs(60));
    let text = std::fs::read_to_string(&ledger).expect("ledger");
    assert_eq!(text.lines().count(), 3, "a task ran again on the new store:\n{text}");
    for t in &tasks {
        assert_eq!(c.snapshot(t)["status"], "unknown", "late evidence changed nothing");
    }
}

/// Submits with `key` until a coordinator answers (through a takeover);
/// returns the task and whether it already existed.
fn submit_with_key(c: &Cluster, rt: &tokio::runtime::Runtime, key: uuid::Uuid, label: &str) -> (String, bool) {
    use tenure_protocol::messages::SubmitRequest;
    rt.block_on(async {
        let session: tenure_protocol::SessionId = "skew@test".parse().expect("session");
        let client = tenure_client::Client::connect(&c.nats_options("client"), "tenure-test", false, session.clone())
            .await
            .expect("connect");
        let req =
            SubmitRequest { session, idempotency_key: key, spec: tenure_protocol::TaskSpec::shell(label, "true") };
        // Bounded: about 20 tries of up to 2 s, with a short pause.
        let policy = tenure_client::Policy {
            overall: Duration::from_secs(44),
            first_pause: Duration::from_millis(200),
            max_pause: Duration::from_millis(200),
            per_try: Duration::from_secs(2),
            through_registry_behind: false,
        };
        let answer = client.submit_request(req, &policy).await.expect("a coordinator answered the submit");
        (answer.task.to_string(), answer.existing)
    })
}

/// Clock skew between coordinators: the standby's wall clock runs 20 minutes
/// ahead (more than the time a submit's key is remembered after its task
/// ended). Submits are retried with their keys across the failover, while and
/// after the new leader garbage-collects: each retry returns the first task,
/// and no task is created twice.
#[test]
fn a_retried_submit_across_a_failover_to_a_leader_minutes_ahead_creates_no_second_task() {
    let mut c = Cluster::start_coordinators(1, 1, &FAST_LEASE);
    let ahead = (20 * 60_000).to_string();
    let mut args = vec!["coordinator", "--name", "c2", "--worker-ttl-ms", "3000"];
    args.extend_from_slice(&FAST_LEASE);
    c.spawn_env("coordinator-c2", &args, &[("TENURE_TEST_CLOCK_OFFSET_MS", ahead.as_str())]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let keys: Vec<uuid::Uuid> = (0..10).map(|_| uuid::Uuid::new_v4()).collect();
    let first: Vec<String> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let (task, existing) = submit_with_key(&c, &rt, *k, &format!("skew-{i}"));
            assert!(!existing);
            task
        })
        .collect();
    for t in &first {
        let done = eventually(BOUND, || {
            let out = c.cli_as("skew@test", &["get", t, "--json"]);
            let snap: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            (snap["status"] == "completed").then_some(())
        });
        assert!(done.is_some(), "{t} never completed\n{}", c.logs());
    }
    eventually(BOUND, || c.status().filter(|s| s["standbys"].as_array().is_some_and(|a| !a.is_empty())))
        .unwrap_or_else(|| panic!("c2 never stood by\n{}", c.logs()));
    c.kill9("coordinator-c1");
    // Retries while the takeover happens, and after the new leader has run
    // (its garbage collector among the rest) long enough to finish new work.
    for round in 0..3 {
        for (k, t) in keys.iter().zip(&first) {
            let (again, existing) = submit_with_key(&c, &rt, *k, "retry");
            assert_eq!(
                (&again, existing),
                (t, true),
                "round {round}: a retried submit made a second task\n{}",
                c.logs()
            );
        }
        c.wait_leader("c2");
        let fresh = c.submit(&["--", "true"]);
        c.wait_status(&fresh, "completed", BOUND);
    }
    let ls: serde_json::Value =
        serde_json::from_slice(&c.cli_as("skew@test", &["ls", "--all", "--json"]).stdout).expect("ls --json");
    assert_eq!(ls.as_array().map(Vec::len), Some(keys.len()), "a task was created twice: {ls}");
}

/// nats-server is SIGKILLed and started again on its store after a quiet
/// period longer than the registry's duplicate window (shortened to 1 s), so
/// it no longer remembers the id of the leader's last append. The leader's
/// next append must still land: it is not fenced, it keeps its epoch, and the
/// task runs.
#[test]
fn a_nats_restart_after_the_duplicate_window_deposes_no_healthy_leader() {
    let mut c =
        Cluster::on(tenure_testkit::NatsCluster::single(tenure_testkit::NatsServer::start().expect("nats")), None);
    c.spawn_coordinator("c1", &["--registry-duplicate-window-ms", "1000"]);
    c.wait_leader("c1");
    c.start_worker("w1");
    c.wait_workers(1);
    let first = c.submit(&["--", "echo before"]);
    let before = c.wait_status(&first, "completed", BOUND);
    assert_eq!(before["epoch"], 1);
    // Quiet for longer than the window: nothing is appended meanwhile.
    std::thread::sleep(Duration::from_millis(2500));
    c.nats.nodes[0].restart().expect("nats-server restarted on its store");
    let second = c.submit(&["--", "echo after"]);
    let after = c.wait_status(&second, "completed", BOUND);
    assert_eq!(after["epoch"], 1, "the leader was deposed:\n{}", c.logs());
    let log = c.daemon("coordinator-c1").log_text();
    assert!(!log.contains("stepping down"), "a healthy leader stepped down:\n{log}");
}

/// The registry stream's messages (subject, payload), oldest first: a backup.
fn registry_backup(url: &str) -> Vec<(String, bytes::Bytes)> {
    use futures::StreamExt;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.expect("connect"));
        let mut stream = js.get_stream(tenure_protocol::subjects::REGISTRY_STREAM).await.expect("registry");
        let last = stream.info().await.expect("info").state.last_sequence;
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut out = Vec::new();
        while let Some(Ok(msg)) = messages.next().await {
            let seq = msg.info().expect("info").stream_sequence;
            out.push((msg.subject.to_string(), msg.payload.clone()));
            if seq >= last {
                break;
            }
        }
        out
    })
}

/// Replaces the registry stream with a backup: deleted, created again with the
/// same configuration, the backup's messages published in order.
fn registry_restore(url: &str, backup: &[(String, bytes::Bytes)]) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.expect("connect"));
        let name = tenure_protocol::subjects::REGISTRY_STREAM;
        let config = js.get_stream(name).await.expect("registry").info().await.expect("info").config.clone();
        js.delete_stream(name).await.expect("delete");
        js.create_stream(config).await.expect("create");
        for (subject, payload) in backup {
            js.publish(subject.clone(), payload.clone()).await.expect("publish").await.expect("ack");
        }
    })
}

/// The high-water mark in the leader lease, once it names task `n`.
fn wait_mark_through(url: &str, n: u64) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let seen = eventually(BOUND, || {
        rt.block_on(async {
            let js = async_nats::jetstream::new(async_nats::connect(url).await.ok()?);
            let kv = js.get_key_value(tenure_protocol::subjects::LEADER_BUCKET).await.ok()?;
            let value = kv.get(tenure_protocol::subjects::LEADER_KEY).await.ok()??;
            let lease: tenure_coordinator::leadership::LeadershipRecord = tenure_protocol::decode(&value).ok()?;
            (lease.mark?.highest_task >= n).then_some(())
        })
    });
    assert!(seen.is_some(), "the lease never carried task number {n} in its mark");
}

fn number(task: &str) -> u64 {
    task.rsplit('-').next().and_then(|n| n.parse().ok()).expect("task number")
}

/// A cluster of one coordinator and one worker that ran a first task, then
/// two more after a registry backup was taken: the backup, the two lost
/// tasks, the ledger and the command that appends `run-<i>` to it.
struct Lost {
    c: Cluster,
    ledger: std::path::PathBuf,
    backup: Vec<(String, bytes::Bytes)>,
    lost: Vec<String>,
}

impl Lost {
    fn run(&self, i: &str) -> String {
        format!("echo run-{i} >> {}", self.ledger.display())
    }

    fn start() -> Lost {
        let c = Cluster::start_coordinators(1, 1, &common::FAST_LEASE);
        let ledger = c.dir.path().join("ledger");
        let mut l = Lost { c, ledger, backup: Vec::new(), lost: Vec::new() };
        let first = l.c.submit(&["--", &l.run("first")]);
        l.c.wait_status(&first, "completed", BOUND);
        l.backup = registry_backup(&l.c.nats.url);
        l.lost = ["a", "b"].iter().map(|i| l.c.submit(&["--", &l.run(i)])).collect();
        for t in &l.lost {
            l.c.wait_status(t, "completed", BOUND);
        }
        l
    }

    /// `tenure status`'s error once the coordinator refuses to lead.
    fn refusal(&self) -> String {
        eventually(BOUND, || {
            let out = self.c.cli(&["status"]);
            let err = common::stderr(&out);
            (!out.status.success() && err.contains("refuses to lead")).then_some(err)
        })
        .unwrap_or_else(|| panic!("status never showed the refusal:\n{}", self.c.logs()))
    }

    /// The operator accepts the loss: a task submitted then completes under
    /// a number none of the lost tasks had, and each lost task ran once.
    fn accept(&mut self) {
        self.c.stop("coordinator-c1");
        let mut accept = common::FAST_LEASE.to_vec();
        accept.push("--accept-registry-rollback");
        self.c.spawn_coordinator("c1", &accept);
        let next = self.c.submit(&["--", &self.run("next")]);
        self.c.wait_status(&next, "completed", BOUND);
        assert!(number(&next) > number(&self.lost[1]), "task number {next} reused after {}", self.lost[1]);
        let log = self.c.daemon("coordinator-c1").log_text();
        assert!(log.contains("recording the acceptance"), "{log}");
        let text = std::fs::read_to_string(&self.ledger).expect("ledger");
        assert_eq!(text.lines().filter(|l| l.starts_with("run-a") || l.starts_with("run-b")).count(), 2, "{text}");
        assert!(!text.contains("run-refused"), "{text}");
    }
}

/// The registry is restored from a backup older than what was acknowledged
/// while the coordinator was down. The coordinator refuses to lead it — no
/// epoch claimed, nothing run — and says so to every client (`status`,
/// `submit`) and in its log, naming the mark and what it found. Started
/// again with `--accept-registry-rollback`, it leads, records the
/// acceptance, and never reuses a task number the lost tasks had.
#[test]
fn a_registry_restored_from_an_older_backup_is_not_led_until_the_operator_accepts_it() {
    let mut l = Lost::start();
    wait_mark_through(&l.c.nats.url, number(&l.lost[1]));
    l.c.stop("coordinator-c1");

    registry_restore(&l.c.nats.url, &l.backup);
    l.c.spawn_coordinator("c1", &common::FAST_LEASE);
    let refused = l.refusal();
    assert!(refused.contains("expected at least") && refused.contains("accept-registry-rollback"), "{refused}");
    let out = l.c.cli(&["submit", "--", &l.run("refused")]);
    assert!(!out.status.success(), "a submit was taken by a coordinator that refuses to lead");
    assert!(common::stderr(&out).contains("behind its high-water mark"), "{}", common::stderr(&out));
    let log = l.c.daemon("coordinator-c1").log_text();
    assert!(log.contains("refusing to lead"), "{log}");
    assert!(!log.contains("leading"), "it led a registry behind its mark:\n{log}");
    // Nothing was claimed: the restored registry is exactly the backup.
    assert_eq!(registry_backup(&l.c.nats.url).len(), l.backup.len(), "the refusing coordinator wrote to the registry");

    l.accept();
    assert!(l.c.try_snapshot(&l.lost[0]).is_none(), "the lost task is gone with the rolled-back registry");
}

/// The lease bucket recreated: the leader lease, and the mark it carried, gone.
fn lease_lost(url: &str) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.expect("connect"));
        let kv = js.get_key_value(tenure_protocol::subjects::LEADER_BUCKET).await.expect("lease bucket");
        kv.purge(tenure_protocol::subjects::LEADER_KEY).await.expect("purge");
    })
}

/// The registry and the leader lease go back together (one JetStream store
/// restored from a backup, its lease bucket lost): the lease holds no mark
/// to judge the registry by, so only the machines can tell. The
/// worker machine's store was given the lost tasks' marks with their grants;
/// its heartbeat stops the leader, which refuses from then on and names the
/// machine. Only an operator's acceptance ends the refusal, and then no task
/// number the lost tasks had is used again.
#[test]
fn a_registry_gone_back_with_its_lease_is_caught_by_a_machines_mark() {
    let mut l = Lost::start();
    l.c.stop("coordinator-c1");

    registry_restore(&l.c.nats.url, &l.backup);
    lease_lost(&l.c.nats.url);
    l.c.spawn_coordinator("c1", &common::FAST_LEASE);
    let refused = l.refusal();
    assert!(refused.contains("kept by worker") && refused.contains("accept-registry-rollback"), "{refused}");
    let log = l.c.daemon("coordinator-c1").log_text();
    assert!(log.contains("no longer leading it"), "{log}");
    let out = l.c.cli(&["submit", "--", &l.run("refused")]);
    assert!(!out.status.success(), "a submit was taken by a coordinator that refuses to lead");

    // A restart does not forget it: the lease carries the machine's mark.
    l.c.stop("coordinator-c1");
    l.c.spawn_coordinator("c1", &common::FAST_LEASE);
    let again = eventually(BOUND, || {
        let out = l.c.cli(&["submit", "--", &l.run("refused")]);
        let err = common::stderr(&out);
        (!out.status.success() && err.contains("behind its high-water mark")).then_some(())
    });
    assert!(again.is_some(), "a restarted coordinator led the caught registry:\n{}", l.c.logs());

    l.accept();
    // The machine's mark from before the acceptance is no news now.
    let later = l.c.submit(&["--", &l.run("later")]);
    l.c.wait_status(&later, "completed", BOUND);
}
