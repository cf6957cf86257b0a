//! The core's retries and delayed starts: retry or final for each cause and
//! policy (a table), backoff kept in the record and continued by a new
//! leader, late reports of a retried attempt, and `--not-before`.

use super::*;
use tenure_protocol::retry::{NotBefore, RetryCause, RetryPolicy};

fn policy(retries: u32, on: &[RetryCause]) -> RetryPolicy {
    RetryPolicy { retries, backoff_ms: 1000, backoff_max_ms: 4000, on: on.to_vec() }
}

fn flaky(retries: u32, on: &[RetryCause]) -> TaskSpec {
    TaskSpec { idempotent: true, retry: Some(Box::new(policy(retries, on))), ..TaskSpec::shell("flaky", "./flaky") }
}

fn failed(detail: &str) -> ReportEvent {
    ReportEvent::Finished(Outcome::new(Ending::Failed, Some(1), Some(detail.into())))
}

/// Ticks until `task` is granted again (or `bound` passes); the time waited.
fn until_granted(h: &mut Harness, task: &TaskId, bound: Duration) -> Option<Duration> {
    let start = h.now.mono;
    while h.now.mono - start <= bound {
        let mut fx = h.input(Input::Tick);
        fx.extend(h.heartbeat("w1", 4));
        if grants(&fx).iter().any(|(_, g)| g.task == *task) {
            return Some(h.now.mono - start);
        }
        h.advance(Duration::from_millis(100));
    }
    None
}

#[test]
fn a_flaky_idempotent_task_completes_on_its_third_attempt_with_its_history() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("alice", flaky(3, &RetryCause::ALL));
    for attempt in 1..=2 {
        h.report("w1", &t, attempt, ReportEvent::Started { pid: 1 });
        assert_eq!(h.report("w1", &t, attempt, failed("exit code: 1")), ReportAck::Ack);
        assert_eq!(h.status(&t), Status::Queued, "attempt {attempt} retried");
        // Backoff with jitter: at least half the exponential delay, at most all of it.
        let exp = Duration::from_millis(1000 << (attempt - 1));
        let waited = until_granted(&mut h, &t, exp * 2).expect("granted again after the backoff");
        assert!(waited >= exp / 2 && waited <= exp + Duration::from_millis(300), "attempt {attempt}: {waited:?}");
    }
    h.report("w1", &t, 3, ReportEvent::Started { pid: 1 });
    h.report("w1", &t, 3, completed());
    let snap = snapshot(&mut h, &t);
    assert_eq!((snap.status, snap.attempt), (Status::Completed, Attempt(3)));
    let history: Vec<(u32, bool, Option<Ending>, Option<RetryCause>)> =
        snap.attempts.iter().map(|a| (a.attempt.0, a.retried, a.ending, a.cause)).collect();
    assert_eq!(
        history,
        [
            (1, true, Some(Ending::Failed), Some(RetryCause::Exit)),
            (2, true, Some(Ending::Failed), Some(RetryCause::Exit)),
            (3, false, Some(Ending::Completed), None),
        ]
    );
    assert!(snap.attempts.iter().all(|a| a.worker.as_ref().map(|w| w.as_str()) == Some("w1")));
    assert!(snap.attempts.iter().all(|a| a.started_at_ms.is_some_and(|s| s <= a.ended_at_ms)));
    assert_eq!(snap.not_before_ms, None, "a finished task waits for nothing");
}

/// Retry or final, row by row: the policy's causes and retries, what ended
/// the attempt, and the status it leaves.
#[test]
fn retry_or_final_for_each_cause_and_policy() {
    use RetryCause::*;
    enum End {
        Report(ReportEvent),
        /// The worker and its sidecar are unreachable: no evidence.
        Unreachable,
        /// The machine says the process is gone without a status.
        NoEvidence,
        KillThenFail,
    }
    let rows: Vec<(&str, Option<RetryPolicy>, End, Status)> = vec![
        ("exit retried", Some(policy(1, &[Exit])), End::Report(failed("exit code: 3")), Status::Queued),
        ("signal is an exit", Some(policy(1, &[Exit])), End::Report(failed("signal 9")), Status::Queued),
        ("timeout not listed", Some(policy(1, &[Exit])), End::Report(failed("timed-out: ran long")), Status::Failed),
        ("timeout listed", Some(policy(1, &[Timeout])), End::Report(failed("idle-timeout: quiet")), Status::Queued),
        ("exit not listed", Some(policy(1, &[Timeout, Lost])), End::Report(failed("exit code: 1")), Status::Failed),
        ("shutdown is lost", Some(policy(1, &[Lost])), End::Report(failed("machine-shutdown: stop")), Status::Queued),
        ("success", Some(policy(1, &RetryCause::ALL)), End::Report(completed()), Status::Completed),
        ("kill wins", Some(policy(3, &RetryCause::ALL)), End::KillThenFail, Status::Failed),
        ("lost retried", Some(policy(1, &[Lost])), End::Unreachable, Status::Queued),
        ("lost not listed", Some(policy(1, &[Exit])), End::Unreachable, Status::Unknown),
        ("no evidence retried", Some(policy(1, &[Lost])), End::NoEvidence, Status::Queued),
        ("no evidence, not listed", Some(policy(1, &[Exit])), End::NoEvidence, Status::Unknown),
        ("no policy: failure final", None, End::Report(failed("exit code: 1")), Status::Failed),
        // Today's rule without a policy: an idempotent task is queued again
        // at once when its worker is lost (and granted to w2 right away).
        ("no policy: lost requeued", None, End::Unreachable, Status::Leased),
    ];
    for (name, retry, end, want) in rows {
        let mut h = Harness::new();
        h.heartbeat("w1", 4);
        let spec = TaskSpec { idempotent: true, retry: retry.map(Box::new), ..TaskSpec::shell("r", "x") };
        let t = h.submit("alice", spec);
        h.report("w1", &t, 1, ReportEvent::Started { pid: 1 });
        match end {
            End::Report(event) => {
                h.report("w1", &t, 1, event);
            }
            End::KillThenFail => {
                h.api(ApiRequest::Kill { session: s("alice"), task: t.clone(), reason: None });
                h.report("w1", &t, 1, failed("exit code: 1"));
            }
            End::Unreachable | End::NoEvidence => {
                let asked = lose_w1(&mut h);
                let result = match end {
                    End::Unreachable => Err("timed out".into()),
                    _ => Ok(Ok(AttemptEvidence::NoEvidence)),
                };
                answer(&mut h, &asked[0], result);
            }
        }
        assert_eq!(h.status(&t), want, "{name}");
        let history = h.core.task(&t).unwrap().attempts.as_ref().map_or(0, |a| a.history.len());
        let want_history = match want {
            Status::Queued => 1,
            Status::Completed | Status::Failed | Status::Killed if h.core.task(&t).unwrap().spec.retry.is_some() => 1,
            _ => 0,
        };
        assert_eq!(history, want_history, "{name}: history");
    }
}

#[test]
fn retries_are_used_up_and_the_last_failure_stands() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("alice", flaky(1, &[RetryCause::Exit]));
    h.report("w1", &t, 1, failed("exit code: 1"));
    until_granted(&mut h, &t, Duration::from_secs(5)).expect("retried once");
    h.report("w1", &t, 2, failed("exit code: 2"));
    let snap = snapshot(&mut h, &t);
    assert_eq!((snap.status, snap.exit_code, snap.attempt), (Status::Failed, Some(1), Attempt(2)));
    assert_eq!(snap.attempts.iter().map(|a| a.retried).collect::<Vec<_>>(), [true, false]);
}

#[test]
fn a_late_or_repeated_report_of_a_retried_attempt_changes_nothing() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("alice", flaky(3, &[RetryCause::Exit]));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 1 });
    h.report("w1", &t, 1, failed("exit code: 1"));
    let before = h.core.task(&t).unwrap().clone();
    for late in [ReportEvent::Started { pid: 1 }, failed("exit code: 1"), completed()] {
        let fx = h.input(Input::Report {
            reply_to: Some("ack".into()),
            report: Report { worker: w("w1"), task: t.clone(), attempt: Attempt(1), epoch: Epoch(3), event: late },
        });
        assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "{fx:?}");
    }
    assert_eq!(h.core.task(&t).unwrap(), &before, "retried once, and only once");
}

/// The backoff is in the record: a new leader built from the registry waits
/// out the rest of it (never less), then grants the next attempt once.
#[test]
fn a_new_leader_continues_the_backoff_and_grants_the_retry_exactly_once() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit(
        "alice",
        TaskSpec {
            retry: Some(Box::new(RetryPolicy {
                backoff_ms: 8000,
                backoff_max_ms: 8000,
                ..policy(2, &[RetryCause::Exit])
            })),
            ..flaky(2, &[])
        },
    );
    let fx = h.report_effects("w1", &t, 1, failed("exit code: 1"));
    let persisted: Vec<TaskRecord> = fx
        .into_iter()
        .filter_map(|e| match e {
            Effect::Persist(r, _) => Some(*r),
            _ => None,
        })
        .collect();
    let record = persisted.last().expect("the retry is persisted").clone();
    assert_eq!(record.life.status, Status::Queued);
    let ready = record.attempts.as_ref().map(|a| a.ready_clock_ms).unwrap_or(0);
    assert!(ready >= record.clock_ms + 4000, "at least half the backoff ahead: {ready} vs {}", record.clock_ms);
    // The old leader dies; a new one loads the record 2 s (of its own clock) later.
    let later = Now { mono: Duration::from_secs(5), wall_ms: h.now.wall_ms + 2000 };
    let mut h2 = Harness { core: Core::new(CoreConfig::default(), Epoch(4), vec![record.clone()], later), now: later };
    let mut grants_seen = Vec::new();
    for _ in 0..200 {
        h2.advance(Duration::from_millis(100));
        let mut fx = h2.heartbeat("w1", 4);
        fx.extend(h2.input(Input::Tick));
        for (_, g) in grants(&fx) {
            grants_seen.push((h2.core.registry_ms(h2.now), g.attempt));
        }
    }
    let first = grants_seen.first().expect("granted after the backoff");
    assert!(first.0 >= ready, "granted at registry time {} before its ready time {ready}", first.0);
    assert_eq!(first.1, Attempt(2));
    // Re-sends of the same grant are the one attempt, never a new one.
    assert!(grants_seen.iter().all(|(_, a)| *a == Attempt(2)), "{grants_seen:?}");
    assert_eq!(h2.core.task(&t).unwrap().life.attempt, Attempt(2));
}

#[test]
fn a_task_with_a_delayed_start_waits_for_its_time_and_says_so() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let at = h.now.wall_ms + 3000;
    let spec = |nb| TaskSpec { not_before: Some(Box::new(nb)), ..TaskSpec::shell("later", "x") };
    let relative = h.submit("alice", spec(NotBefore::In { ms: 2000 }));
    let absolute = h.submit("alice", spec(NotBefore::At { unix_ms: at }));
    let past = h.submit("alice", spec(NotBefore::At { unix_ms: 1 }));
    assert_eq!(h.status(&past), Status::Leased, "a time in the past is no delay");
    let snap = snapshot(&mut h, &relative);
    assert_eq!((snap.status, snap.not_before_ms), (Status::Queued, Some(h.now.wall_ms + 2000)));
    assert_eq!(snapshot(&mut h, &absolute).not_before_ms, Some(at));
    let waited = until_granted(&mut h, &relative, Duration::from_secs(5)).expect("granted");
    assert!(waited >= Duration::from_millis(2000), "{waited:?}");
    assert_eq!(h.status(&absolute), Status::Queued);
    until_granted(&mut h, &absolute, Duration::from_secs(5)).expect("granted");
    assert!(h.now.wall_ms >= at);
    // Too far away: refused, nothing created.
    let (fx, reply) = h.api(ApiRequest::Submit(SubmitRequest {
        session: s("alice"),
        idempotency_key: Uuid::new_v4(),
        spec: spec(NotBefore::At { unix_ms: h.now.wall_ms + 31 * 24 * 3600 * 1000 }),
    }));
    assert!(matches!(reply, Some(Err(ApiError::InvalidSpec(m))) if m.contains("30 days")), "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
}

#[test]
fn retries_of_a_task_that_is_not_idempotent_are_refused_and_nothing_is_stored() {
    let mut h = Harness::new();
    let spec = TaskSpec { idempotent: false, ..flaky(3, &[RetryCause::Exit]) };
    let (fx, reply) =
        h.api(ApiRequest::Submit(SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec }));
    assert!(matches!(&reply, Some(Err(ApiError::InvalidSpec(m))) if m.contains("not idempotent")), "{reply:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
}

// ---------------------------------------------------------------- priority

/// Submits `specs` while the one slot is held, frees it, and returns the
/// order in which the queued tasks were granted, one at a time.
fn grant_order(h: &mut Harness, specs: Vec<TaskSpec>) -> Vec<TaskId> {
    h.heartbeat("w1", 1);
    let blocker = h.submit("alice", TaskSpec::shell("blocker", "x"));
    h.report("w1", &blocker, 1, ReportEvent::Started { pid: 1 });
    let ids: Vec<TaskId> = specs.into_iter().map(|s| h.submit("alice", s)).collect();
    let mut order = Vec::new();
    let mut running = blocker;
    for _ in 0..ids.len() {
        let fx = h.report_effects("w1", &running, 1, completed());
        let g = grants(&fx);
        assert_eq!(g.len(), 1, "one slot, one grant: {g:?}");
        running = g[0].1.task.clone();
        h.report("w1", &running, 1, ReportEvent::Started { pid: 2 });
        order.push(running.clone());
    }
    order
}

#[test]
fn queued_tasks_start_by_priority_and_in_submission_order_within_one() {
    let mut h = Harness::new();
    let p = |priority| TaskSpec { priority, ..TaskSpec::shell("p", "x") };
    let order = grant_order(&mut h, vec![p(0), p(5), p(5), p(1), p(-3), p(0)]);
    let numbers: Vec<u64> = order.iter().map(|t| t.number()).collect();
    // shell-1 is the blocker; 2..7 were submitted with 0, 5, 5, 1, -3, 0.
    assert_eq!(numbers, [3, 4, 5, 2, 7, 6]);
}

#[test]
fn a_task_queued_past_the_priority_age_goes_first_whatever_its_priority() {
    let mut h = Harness::new();
    h.core.cfg.priority_max_age = Duration::from_secs(60);
    h.heartbeat("w1", 1);
    let blocker = h.submit("alice", TaskSpec::shell("blocker", "x"));
    h.report("w1", &blocker, 1, ReportEvent::Started { pid: 1 });
    let low = h.submit("alice", TaskSpec { priority: -100, ..TaskSpec::shell("low", "x") });
    // Delayed by its own --not-before: its wait does not age it.
    let delayed = h.submit(
        "alice",
        TaskSpec {
            priority: -100,
            not_before: Some(Box::new(NotBefore::In { ms: 50_000 })),
            ..TaskSpec::shell("d", "x")
        },
    );
    for _ in 0..61 {
        h.advance(Duration::from_secs(1));
        h.heartbeat("w1", 1);
    }
    let high = h.submit("alice", TaskSpec { priority: 100, ..TaskSpec::shell("high", "x") });
    let fx = h.report_effects("w1", &blocker, 1, completed());
    let g = grants(&fx);
    assert_eq!(
        g.iter().map(|(_, g)| g.task.clone()).collect::<Vec<_>>(),
        std::slice::from_ref(&low),
        "the old one first"
    );
    h.report("w1", &low, 1, ReportEvent::Started { pid: 2 });
    let fx = h.report_effects("w1", &low, 1, completed());
    assert_eq!(grants(&fx).iter().map(|(_, g)| g.task.clone()).collect::<Vec<_>>(), [high], "then by priority");
    assert_eq!(h.status(&delayed), Status::Queued);
}
