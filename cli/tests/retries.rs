//! Retries and delayed starts over a real cluster: a flaky idempotent task
//! completes on its third attempt with every attempt in `tenure get`; a
//! retry waiting for its backoff survives a SIGKILL of the leader and is run
//! once by the next; retries of a task that is not idempotent are refused at
//! submit; a `--not-before` task waits, saying so, and starts no earlier.
//!
//! Every wait is a bounded condition; no duration is asserted. The one time
//! compared is a lower bound on one machine's clock (a delayed task's start
//! against the time it was told not to start before).

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{stderr, stdout, Cluster, FAST_LEASE};
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);

/// A script that counts its runs in `dir/count`, appends a line per run to
/// `dir/ledger` and its start time (epoch ms) to `dir/starts`, and fails (exit 7) until its `succeed_on`-th run.
fn flaky(dir: &std::path::Path, succeed_on: u32) -> String {
    let d = dir.display();
    format!(
        "n=$(cat {d}/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > {d}/count; echo run $n >> {d}/ledger; \
         date +%s%3N >> {d}/starts; \
         echo attempt $n; [ $n -ge {succeed_on} ] || exit 7"
    )
}

fn ledger(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("ledger")).unwrap_or_default().lines().map(str::to_owned).collect()
}

fn history(snap: &serde_json::Value) -> Vec<(u64, bool, Option<i64>)> {
    let list = snap["attempts"].as_array().cloned().unwrap_or_default();
    list.iter().map(|a| (a["attempt"].as_u64().unwrap_or(0), a["retried"] == true, a["exit_code"].as_i64())).collect()
}

#[test]
fn a_flaky_idempotent_task_completes_on_its_third_attempt_with_its_history_in_get() {
    let c = Cluster::start(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let task = c.submit(&["--idempotent", "--retries", "3", "--backoff", "100ms,1s", "--", &flaky(dir.path(), 3)]);
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["attempt"], 3, "{snap}");
    assert_eq!(history(&snap), [(1, true, Some(7)), (2, true, Some(7)), (3, false, Some(0))], "{snap}");
    assert!(snap["attempts"].as_array().is_some_and(|a| a.iter().all(|a| a["worker"] == "w1")), "{snap}");
    assert_eq!(ledger(dir.path()), ["run 1", "run 2", "run 3"], "ran exactly three times");
    assert_eq!(snap["retry"]["retries"], 3);
    // The text view names each attempt and its outcome.
    let text = stdout(&c.cli(&["get", &task]));
    for line in ["attempt 1:  failed exit 7 on w1, retried", "attempt 2:  failed exit 7 on w1, retried"] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
    assert!(text.contains("attempt 3:  completed exit 0 on w1;"), "{text}");
    assert!(text.contains("retries:    2 of 3 used"), "{text}");

    // Out of retries: the last failure stands, every attempt still shown.
    let dir2 = tempfile::tempdir().expect("tempdir");
    let task = c.submit(&["--idempotent", "--retries", "1", "--backoff", "100ms", "--", &flaky(dir2.path(), 9)]);
    let snap = c.wait_status(&task, "failed", BOUND);
    assert_eq!(history(&snap), [(1, true, Some(7)), (2, false, Some(7))], "{snap}");
    assert_eq!(ledger(dir2.path()).len(), 2);

    // A cause the policy does not list is final at once.
    let dir3 = tempfile::tempdir().expect("tempdir");
    let task = c.submit(&["--idempotent", "--retries", "3", "--retry-on", "timeout", "--", &flaky(dir3.path(), 9)]);
    let snap = c.wait_status(&task, "failed", BOUND);
    assert_eq!((snap["attempt"].as_u64(), history(&snap).len()), (Some(1), 1), "{snap}");
}

#[test]
fn a_retry_waiting_for_its_backoff_survives_a_leader_sigkill_and_runs_once() {
    let mut c = Cluster::start_coordinators(2, 1, &FAST_LEASE);
    let dir = tempfile::tempdir().expect("tempdir");
    // A backoff of 10 s (drawn between 5 and 10 s): the leader dies while it waits.
    let task = c.submit(&["--idempotent", "--retries", "2", "--backoff", "10s,10s", "--", &flaky(dir.path(), 2)]);
    let waiting =
        eventually(BOUND, || c.try_snapshot(&task).filter(|s| s["status"] == "queued" && s["not_before_ms"].is_u64()))
            .unwrap_or_else(|| panic!("never waited for a retry: {:?}\n{}", c.try_snapshot(&task), c.logs()));
    assert_eq!(history(&waiting), [(1, true, Some(7))], "{waiting}");
    assert_eq!(ledger(dir.path()), ["run 1"]);
    c.kill9("coordinator-c1");
    c.wait_leader("c2");
    // The new leader still knows the retry and its time.
    let s = c.snapshot(&task);
    if s["status"] == "queued" {
        assert_eq!(s["not_before_ms"], waiting["not_before_ms"], "{s}");
    }
    let snap = c.wait_status(&task, "completed", BOUND);
    assert_eq!(snap["attempt"], 2, "retried once, by one leader: {snap}");
    assert_eq!(history(&snap), [(1, true, Some(7)), (2, false, Some(0))], "{snap}");
    assert_eq!(ledger(dir.path()), ["run 1", "run 2"], "the retry ran exactly once");
    // Not before its backoff, although the leader that set it died: a lower
    // bound on this machine's clock (the new leader can only wait longer).
    let starts = std::fs::read_to_string(dir.path().join("starts")).unwrap_or_default();
    let retry_started: u64 = starts.lines().nth(1).and_then(|l| l.trim().parse().ok()).expect("a second start");
    let ready = waiting["not_before_ms"].as_u64().unwrap_or(u64::MAX);
    assert!(retry_started >= ready, "the retry started at {retry_started}, before its backoff ended at {ready}");
    let log = c.daemon("coordinator-c1").log_text();
    assert!(log.contains("retrying after a backoff"), "{log}");
}

#[test]
fn retries_of_a_task_that_is_not_idempotent_and_bad_policies_are_refused_and_change_nothing() {
    let c = Cluster::start(1);
    let out = c.cli(&["submit", "--retries", "3", "--", "true"]);
    assert!(!out.status.success(), "a non-idempotent task with retries was accepted");
    let err = stderr(&out);
    assert!(err.contains("not idempotent") && err.contains("--idempotent"), "{err}");
    for args in [
        &["submit", "--idempotent", "--retries", "0", "--", "true"][..],
        &["submit", "--idempotent", "--retries", "21", "--", "true"],
        &["submit", "--idempotent", "--retries", "2", "--backoff", "2d", "--", "true"],
        &["submit", "--idempotent", "--retries", "2", "--backoff", "10s,1s", "--", "true"],
        &["submit", "--idempotent", "--retries", "2", "--retry-on", "exit,sometimes", "--", "true"],
        &["submit", "--idempotent", "--backoff", "1s", "--", "true"],
        &["submit", "--idempotent", "--retries", "2", "--step", "true"],
        &["submit", "--not-before", "31days", "--", "true"],
        &["submit", "--not-before", "tomorrowish", "--", "true"],
    ] {
        let out = c.cli(args);
        assert!(!out.status.success(), "{args:?} accepted");
        let err = stderr(&out);
        assert!(
            err.contains("retries") || err.contains("invalid value") || err.contains("required"),
            "{args:?}: {err}"
        );
    }
    let ls: serde_json::Value = serde_json::from_slice(&c.cli(&["ls", "--all", "--json"]).stdout).expect("json");
    assert_eq!(ls.as_array().map(Vec::len), Some(0), "a refused submit left a task behind: {ls}");
}

#[test]
fn a_not_before_task_waits_saying_so_and_starts_no_earlier() {
    let c = Cluster::start(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as u64;
    let at = now_ms + 5000;
    let rfc = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(at) * 1_000_000)
        .expect("time")
        .format(&time::format_description::well_known::Rfc3339)
        .expect("rfc 3339");
    let started = dir.path().join("started");
    let script = format!("date +%s%3N > {}", started.display());
    let absolute = c.submit(&["--not-before", &rfc, "--", &script]);
    let relative = c.submit(&["--not-before", "2s", "--", "echo later"]);
    // Queued, and `get` says until when.
    let snap = c.snapshot(&absolute);
    assert_eq!((&snap["status"], &snap["not_before_ms"]), (&"queued".into(), &at.into()), "{snap}");
    let text = stdout(&c.cli(&["get", &absolute]));
    assert!(text.contains("waiting:    not before") && text.contains("its --not-before"), "{text}");
    c.wait_status(&relative, "completed", BOUND);
    c.wait_status(&absolute, "completed", BOUND);
    let ran_at: u64 = std::fs::read_to_string(&started).expect("the task ran").trim().parse().expect("a time");
    assert!(ran_at >= at, "started at {ran_at}, before its --not-before {at}");
}
