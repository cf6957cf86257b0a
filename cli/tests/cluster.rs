//! End-to-end tests over a real nats-server and the real `tenure` binaries.

mod common;

use std::time::Duration;

use common::{group_alive, stderr, stdout, Cluster};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

#[test]
fn a_shell_task_streams_its_output_and_completes() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "sh", "-c", "for i in 1 2 3; do echo line-$i; sleep 0.2; done; echo err >&2"]);
    assert!(task.starts_with("shell-"), "{task}");

    let logs = c.cli(&["logs", &task, "--follow"]);
    assert!(logs.status.success(), "{}", stderr(&logs));
    assert_eq!(stdout(&logs), "line-1\nline-2\nline-3\nerr\n");

    let wait = c.cli(&["wait", &task, "--json"]);
    assert!(wait.status.success(), "wait: {}", stderr(&wait));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_eq!(snap["status"], "completed");
    assert_eq!(snap["exit_code"], 0);
    assert_eq!(snap["attempt"], 1);
    assert_eq!(snap["reported"], true);
    assert_eq!(snap["owner"], "test-owner");

    // Reading from an offset returns the rest only.
    let tail = c.cli(&["logs", &task, "--offset", "7"]);
    assert_eq!(stdout(&tail), "line-2\nline-3\nerr\n");

    // Working directory and environment come from the spec.
    let cwd = c.dir.path().display().to_string();
    let t2 = c.submit(&["--cwd", &cwd, "--env", "GREETING=hello", "--", "echo $GREETING; pwd"]);
    c.wait_status(&t2, "completed", BOUND);
    assert_eq!(stdout(&c.cli(&["logs", &t2])), format!("hello\n{cwd}\n"));
}

/// `logs -f` on a task that is leased but not yet taken by its machine (its
/// worker is stopped, so the grant waits): the follower waits for the
/// output instead of answering not-found, and prints it all once the worker
/// goes on.
#[test]
fn logs_follow_of_a_leased_task_not_yet_taken_waits_for_its_output() {
    use nix::sys::signal::Signal;
    let mut c = Cluster::start(1);
    c.signal("worker-w1", Signal::SIGSTOP);
    let task = c.submit(&["--", "echo taken"]);
    let leased = eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["status"] == "leased"));
    assert!(leased.is_some(), "{:?}", c.try_snapshot(&task));
    let follower = std::process::Command::new(common::BIN)
        .args(["--nats", &c.nats.url, "--session", &c.session, "logs", &task, "--follow"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("logs -f");
    // Held well under the worker TTL: the worker is not judged lost.
    std::thread::sleep(Duration::from_millis(800));
    c.signal("worker-w1", Signal::SIGCONT);
    let out = follower.wait_with_output().expect("logs -f ends");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "taken\n");
}

#[test]
fn failures_report_their_exit_code_and_wait_exits_non_zero() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "echo failing; exit 3"]);
    let wait = c.cli(&["wait", &task, "--json"]);
    assert_eq!(wait.status.code(), Some(1));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_eq!((snap["status"].as_str(), snap["exit_code"].as_i64()), (Some("failed"), Some(3)));
    assert_eq!(snap["detail"], "exit code: 3");

    // A bounded wait on a long task times out with the live snapshot.
    let long = c.submit(&["--", "sleep 30"]);
    let wait = c.cli(&["wait", &long, "--timeout", "1", "--json"]);
    assert_eq!(wait.status.code(), Some(124), "{}", stderr(&wait));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_ne!(snap["status"], "completed");
    assert_eq!(snap["reported"], false);
    assert_eq!(stdout(&c.cli(&["kill", &long])).trim(), "requested");
}

/// `wait --started` returns once the task runs (not at its end), times out
/// (124) while its machine has not started it, and fails (1) when the task
/// it waits on ends without running.
#[test]
fn wait_started_returns_once_the_task_runs_and_fails_for_one_that_never_ran() {
    use nix::sys::signal::Signal;
    let mut c = Cluster::start(1);
    c.signal("worker-w1", Signal::SIGSTOP);
    let task = c.submit(&["--", "sleep 30"]);
    let wait = c.cli(&["wait", &task, "--started", "--timeout", "1", "--json"]);
    assert_eq!(wait.status.code(), Some(124), "{}", stderr(&wait));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert!(snap["status"] == "leased" || snap["status"] == "queued", "{snap}");
    c.signal("worker-w1", Signal::SIGCONT);
    let wait = c.cli(&["wait", &task, "--started", "--json"]);
    assert!(wait.status.success(), "{}", stderr(&wait));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_eq!((snap["status"].as_str(), snap["reported"].as_bool()), (Some("running"), Some(false)), "{snap}");
    assert!(snap["started_at_ms"].is_u64(), "{snap}");
    assert_eq!(stdout(&c.cli(&["kill", &task])).trim(), "requested");

    // Held for approval, then killed: it ends, never having run.
    let never = c.submit(&["--hold", "--", "true"]);
    assert_eq!(stdout(&c.cli(&["kill", &never])).trim(), "requested");
    let wait = c.cli(&["wait", &never, "--started", "--json"]);
    assert_eq!(wait.status.code(), Some(1), "{}", stderr(&wait));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_eq!(snap["status"], "killed", "{snap}");
    assert!(snap["started_at_ms"].is_null(), "{snap}");
}

#[test]
fn kill_ends_the_whole_process_group_including_double_forked_children() {
    let c = Cluster::start(1);
    // The task prints its process group id, then leaves children and a
    // double-forked grandchild in the group.
    let task = c.submit(&["--", "echo $$; sleep 60 & (sleep 61 &) ; trap '' TERM; sleep 62; wait"]);
    c.wait_status(&task, "running", BOUND);
    let pgid: i32 = eventually(BOUND, || stdout(&c.cli(&["logs", &task])).trim().parse().ok()).expect("pgid printed");
    assert!(group_alive(pgid));
    // The double-forked grandchild is re-parented to the task's shim, not PID 1.
    let members = eventually(BOUND, || Some(common::group_members(pgid)).filter(|m| m.len() >= 4)).expect("members");
    assert!(members.iter().all(|(_, ppid)| *ppid != 1), "re-parented to PID 1: {members:?}");

    let kill = c.cli(&["kill", &task]);
    assert_eq!(stdout(&kill).trim(), "requested", "{}", stderr(&kill));
    let snap = c.wait_status(&task, "killed", BOUND);
    // The kill answered "requested", which is not the terminal state: not reported yet.
    assert_eq!(snap["reported"], false);
    // Killed is only reported once every process of the group is gone.
    assert!(!group_alive(pgid), "process group {pgid} survived its task");

    assert_eq!(stdout(&c.cli(&["kill", &task])).trim(), "already-finished");
    let wait = c.cli(&["wait", &task, "--json"]);
    assert_eq!(wait.status.code(), Some(1));
    let snap: serde_json::Value = serde_json::from_slice(&wait.stdout).unwrap();
    assert_eq!((snap["status"].as_str(), snap["reported"].as_bool()), (Some("killed"), Some(true)));
}

/// The shim blocks SIGCHLD and SIGTERM for itself (it reads them from a
/// signalfd); the task must start with no signal blocked or ignored, or it
/// would not die of a kill's SIGTERM.
#[test]
fn a_task_starts_with_no_signal_blocked_or_ignored_and_a_plain_kill_ends_it() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "grep -E '^Sig(Blk|Ign)' /proc/self/status"]);
    c.wait_status(&task, "completed", BOUND);
    let masks = stdout(&c.cli(&["logs", &task]));
    let mask = |name: &str| {
        let line = masks.lines().find_map(|l| l.strip_prefix(name)).expect("mask printed");
        u64::from_str_radix(line.trim(), 16).expect("hex mask")
    };
    assert_eq!(mask("SigBlk:"), 0, "{masks}");
    // Of the standard signals none is ignored (glibc's posix_spawn leaves its
    // own two internal real-time signals, 32 and 33, ignored).
    assert_eq!(mask("SigIgn:") & 0x7fff_ffff, 0, "{masks}");

    let task = c.submit(&["--", "echo up; sleep 60"]);
    c.wait_status(&task, "running", BOUND);
    eventually(BOUND, || (stdout(&c.cli(&["logs", &task])) == "up\n").then_some(())).expect("started");
    assert_eq!(stdout(&c.cli(&["kill", &task])).trim(), "requested");
    let snap = c.wait_status(&task, "killed", BOUND);
    assert_eq!(snap["detail"], "signal 15", "ended by the SIGTERM, not the SIGKILL after the grace period");
}

#[test]
fn only_the_owner_sees_a_task_and_bad_input_changes_nothing() {
    let c = Cluster::start(1);
    let task = c.submit(&["--", "sleep 20"]);
    for verb in [vec!["get", &task], vec!["kill", &task], vec!["wait", &task, "--timeout", "1"], vec!["logs", &task]] {
        let out = c.cli_as("someone-else", &verb);
        assert!(!out.status.success(), "{verb:?} by another session succeeded");
        assert!(stderr(&out).contains("not found or not yours"), "{verb:?}: {}", stderr(&out));
    }
    c.wait_status(&task, "running", BOUND);

    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["get".into(), "shell-999".into()], "not found or not yours"),
        (vec!["get".into(), "Shell-1".into()], "invalid task id"),
        (vec!["get".into(), "shell-0".into()], "invalid task id"),
        (vec!["submit".into(), "--kind".into(), "nosuch".into(), "--".into(), "true".into()], "unknown kind"),
        (vec!["submit".into(), "--kind".into(), "Bad.Kind".into(), "--".into(), "true".into()], "invalid kind"),
        (vec!["submit".into(), "--".into(), "  ".into()], "empty command"),
        (vec!["submit".into(), "--".into(), "x".repeat(70_000)], "command is 70000 bytes"),
        (vec!["submit".into(), "--cwd".into(), "relative".into(), "--".into(), "true".into()], "absolute path"),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = c.cli(&args);
        assert!(!out.status.success(), "{:?} succeeded", &args[..2]);
        assert!(stderr(&out).contains(want), "{:?}: expected {want:?} in {}", &args[..2], stderr(&out));
    }
    // Nothing was created by the refused submits: only the one task exists.
    let ls: serde_json::Value = serde_json::from_slice(&c.cli(&["ls", "--all", "--json"]).stdout).unwrap();
    assert_eq!(ls.as_array().map(Vec::len), Some(1), "{ls}");
    assert_eq!(ls[0]["id"], task.as_str());
    c.cli(&["kill", &task]);
}

#[test]
fn garbage_on_every_subject_gets_a_typed_error_and_breaks_nothing() {
    let mut c = Cluster::start(1);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client = async_nats::connect(&c.nats.url).await.unwrap();
        let garbage: Vec<bytes::Bytes> = vec![
            bytes::Bytes::new(),
            bytes::Bytes::from_static(b"\x01\xff\xfe garbage"),
            bytes::Bytes::from_static(b"\x07v9"),
        ];
        let w1: tenure_protocol::WorkerId = "w1".parse().unwrap();
        for payload in garbage {
            // Request/reply subjects answer with a typed refusal.
            let reply = client.request(tenure_protocol::subjects::API, payload.clone()).await.unwrap();
            let api: tenure_protocol::messages::ApiReply = tenure_protocol::decode(&reply.payload).unwrap();
            assert!(matches!(api, Err(tenure_protocol::messages::ApiError::InvalidRequest(_))), "{api:?}");

            let reply = client.request(tenure_protocol::subjects::worker_commands(&w1), payload.clone()).await.unwrap();
            let cmd: tenure_protocol::messages::WorkerReply = tenure_protocol::decode(&reply.payload).unwrap();
            assert!(
                matches!(
                    cmd,
                    tenure_protocol::messages::WorkerReply::Refused(tenure_protocol::messages::Refusal::Malformed(_))
                ),
                "{cmd:?}"
            );

            let reply = client.request(tenure_protocol::subjects::output(&w1), payload.clone()).await.unwrap();
            let out: tenure_protocol::messages::OutputReply = tenure_protocol::decode(&reply.payload).unwrap();
            assert!(matches!(out, Err(tenure_protocol::messages::ApiError::InvalidRequest(_))), "{out:?}");

            let reply = client.request(tenure_protocol::subjects::input(&w1), payload.clone()).await.unwrap();
            let input: tenure_protocol::messages::InputReply = tenure_protocol::decode(&reply.payload).unwrap();
            assert!(matches!(input, Err(tenure_protocol::messages::ApiError::InvalidRequest(_))), "{input:?}");

            // Fire-and-forget subjects log and drop it.
            client.publish(tenure_protocol::subjects::heartbeat(&w1), payload.clone()).await.unwrap();
            client.publish(tenure_protocol::subjects::report(&w1), payload.clone()).await.unwrap();
        }
        client.flush().await.unwrap();
    });
    // Every daemon is still up and the cluster still runs tasks.
    let task = c.submit(&["--", "echo still-fine"]);
    c.wait_status(&task, "completed", BOUND);
    assert_eq!(stdout(&c.cli(&["logs", &task])), "still-fine\n");
    for name in ["coordinator", "sidecar-w1", "worker-w1"] {
        assert!(c.daemon(name).running(), "{name} died:\n{}", c.logs());
    }
    assert!(c.daemon("coordinator").log_text().contains("malformed"));
}

#[test]
fn ids_survive_a_coordinator_restart_and_a_later_coordinator_stands_by() {
    let mut c = Cluster::start(1);
    let first = c.submit(&["--", "echo one"]);
    c.wait_status(&first, "completed", BOUND);

    // A graceful stop releases the leader lease: the next coordinator takes it at once.
    c.stop("coordinator");
    c.spawn("coordinator", &["coordinator", "--name", "c2", "--worker-ttl-ms", "3000"]);
    c.wait_workers(1);
    let second = eventually(BOUND, || {
        let out = c.cli(&["submit", "--", "echo two"]);
        out.status.success().then(|| stdout(&out).trim().to_owned())
    })
    .expect("submit after restart");
    let n = |id: &str| id.rsplit_once('-').unwrap().1.parse::<u64>().unwrap();
    assert!(n(&second) > n(&first), "{second} reuses an id after {first}");
    assert_eq!(c.snapshot(&first)["status"], "completed");
    let snap = c.wait_status(&second, "completed", BOUND);
    assert_eq!(snap["epoch"], 2, "the restarted coordinator leads under a new epoch");

    // A third coordinator started while c2 leads stands by: c2 keeps leading.
    c.spawn("coordinator", &["coordinator", "--name", "c3", "--worker-ttl-ms", "3000"]);
    let listed =
        eventually(BOUND, || c.status().filter(|s| s["leader"]["name"] == "c2" && s["standbys"][0]["name"] == "c3"));
    assert!(listed.is_some(), "c3 is not listed as a standby of c2: {:?}\n{}", c.status(), c.logs());
    let third = c.submit(&["--", "echo three"]);
    assert_eq!(c.wait_status(&third, "completed", BOUND)["epoch"], 2);

    // c2 stops: c3 takes over under epoch 3 and continues the numbering.
    let c2 = c.daemons().iter_mut().filter(|d| d.name == "coordinator").nth(1).expect("c2");
    c2.stop(common::STOP_GRACE);
    assert!(c2.try_exit().is_some_and(|s| s.success()), "{}", c2.log_text());
    let fourth = c.submit(&["--", "echo four"]);
    assert!(n(&fourth) > n(&third));
    let snap = c.wait_status(&fourth, "completed", BOUND);
    assert_eq!(snap["epoch"], 3);
    assert_eq!(c.status().map(|s| s["leader"]["name"].clone()), Some("c3".into()));
}

#[test]
fn a_completion_buffered_while_the_coordinator_is_down_is_delivered_once_after_restarts() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "sleep 1; echo finished-once"]);
    c.wait_status(&task, "running", BOUND);
    // The leader dies; the task finishes while nobody can acknowledge it.
    let coordinator = c.daemon("coordinator");
    coordinator.kill9();
    let output = c.worker_dir("w1").join("output").join(format!("{task}.out"));
    let finished = eventually(BOUND, || std::fs::read_to_string(&output).ok().filter(|s| s.contains("finished-once")));
    assert!(finished.is_some(), "task did not finish:\n{}", c.logs());
    // The worker goes too: the outcome now lives only in the sidecar.
    c.stop("worker-w1");

    c.spawn("coordinator", &["coordinator", "--name", "c2", "--worker-ttl-ms", "3000"]);
    c.spawn_worker("w1", &[]);
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), snap["exit_code"].as_i64()), (Some(1), Some(0)));
    assert_eq!(std::fs::read_to_string(&output).unwrap(), "finished-once\n", "the task ran more than once");
}

/// `tenure kill --reason`: the reason is kept verbatim with the kill, shown by
/// `get`, and read back from the registry by the next leader.
#[test]
fn a_kill_reason_is_kept_verbatim_and_outlives_the_leader() {
    let mut c = Cluster::start(1);
    let task = c.submit(&["--", "sleep 60"]);
    c.wait_status(&task, "running", BOUND);
    let why = "superseded by a newer run — keep «this» text\tas is";
    assert_eq!(stdout(&c.cli(&["kill", &task, "--reason", why])).trim(), "requested");
    // A second kill's reason does not replace the first.
    c.cli(&["kill", &task, "--reason", "another"]);
    let snap = c.wait_status(&task, "killed", BOUND);
    assert_eq!(snap["kill_reason"], why, "{snap}");
    assert!(stdout(&c.cli(&["get", &task])).contains("kill reason: superseded by a newer run"));
    let too_long = "x".repeat(2000);
    let out = c.cli(&["kill", &task, "--reason", &too_long]);
    assert!(!out.status.success() && stderr(&out).contains("kill reason"), "{}", stderr(&out));
    // The next leader reads the reason from the registry.
    c.kill9("coordinator");
    c.spawn_coordinator("c2", &[]);
    c.wait_leader("c2");
    let snap: serde_json::Value = serde_json::from_slice(&c.cli(&["get", &task, "--json"]).stdout).expect("json");
    assert_eq!(snap["kill_reason"], why, "{snap}");
}

/// Every report message w1 sends while `during` runs, each as the reports it
/// carries (one alone, or a batch's in order).
fn reports_of_w1(c: &Cluster, during: impl FnOnce()) -> Vec<Vec<tenure_protocol::messages::Report>> {
    use futures::StreamExt;
    use tenure_protocol::messages::{Report, Reports};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let w1: tenure_protocol::WorkerId = "w1".parse().unwrap();
    let (client, mut sub) = rt.block_on(async {
        let client = async_nats::connect(&c.nats.url).await.unwrap();
        let sub = client.subscribe(tenure_protocol::subjects::report(&w1)).await.unwrap();
        client.flush().await.unwrap();
        (client, sub)
    });
    during();
    let mut messages = Vec::new();
    rt.block_on(async {
        while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
            let reports = match tenure_protocol::decode::<Reports>(&msg.payload) {
                Ok(batch) => Ok(batch.reports),
                Err(_) => tenure_protocol::decode::<Report>(&msg.payload).map(|r| vec![r]),
            };
            assert!(reports.is_ok(), "w1 sent a report no leader could read: {:?}", msg.payload);
            messages.extend(reports);
        }
    });
    drop(client);
    messages
}

/// On a worker starting tasks close together, a start is held: a task that
/// ends within the hold has its `Started` told just before its end, in the
/// same message (so it is still seen to start), and one that runs on is seen
/// running once its hold passed, told alone.
#[test]
fn a_start_close_to_another_is_told_with_its_end_or_alone_once_its_hold_passed() {
    use tenure_protocol::messages::ReportEvent;
    let c = Cluster::start_with_worker(&["--started-hold-ms", "10000"]);
    let (mut first, mut short, mut long) = (String::new(), String::new(), String::new());
    let messages = reports_of_w1(&c, || {
        // The worker's first start: nothing to wait for.
        first = c.submit(&["--", "sleep 60"]);
        c.wait_status(&first, "running", BOUND);
        // Within the hold of the first: held, and over long before it passes.
        short = c.submit(&["--", "true"]);
        c.wait_status(&short, "completed", BOUND);
        // Within the hold of the second: held, then told alone while it runs.
        long = c.submit(&["--", "sleep 60"]);
        c.wait_status(&long, "running", BOUND);
    });
    let of = |task: &str, started: bool| {
        messages
            .iter()
            .position(|m| {
                m.iter()
                    .any(|r| r.task.to_string() == task && matches!(r.event, ReportEvent::Started { .. }) == started)
            })
            .unwrap_or_else(|| panic!("no report of {task} (started: {started}) in {messages:?}"))
    };
    let events = |i: usize| messages[i].iter().map(|r| (r.task.to_string(), r.event.name())).collect::<Vec<_>>();
    // The short task's start and end travel together, in that order.
    let together = of(&short, true);
    assert_eq!(of(&short, false), together, "{messages:?}");
    let pair = events(together);
    let after_start = pair.iter().position(|e| *e == (short.clone(), "started")).and_then(|at| pair.get(at + 1));
    assert_eq!(after_start, Some(&(short.clone(), "finished")), "{pair:?}");
    // The others' starts went without an end of theirs, the first before
    // the short task's, the long one's after it.
    assert!(of(&first, true) < together && together < of(&long, true), "{messages:?}");
    for task in [&first, &long] {
        assert!(events(of(task, true)).iter().all(|(t, e)| t != task || *e == "started"), "{messages:?}");
    }
    // Seen to start: it has a start time, and `wait --started` says so.
    let snap = c.snapshot(&short);
    assert!(snap["started_at_ms"].as_u64().is_some(), "{snap}");
    assert!(c.cli(&["wait", "--started", &short]).status.success());
    for task in [&first, &long] {
        assert!(c.cli(&["kill", task]).status.success());
    }
}
