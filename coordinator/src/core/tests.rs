//! Deterministic tests of the coordinator core with a fake clock: no NATS, no
//! registry, just inputs and the effects they produce. This file holds the
//! harness and the client API's tests; `workers_tests.rs` (workers, dispatch,
//! liveness), `workflow_tests.rs` (board, cleanups, workflows) and
//! `limits_tests.rs` (limits, epoch claims) use it.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::record::TaskRecord;
use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, ApiResponse, CleanupReply, ClusterStatus, CoordinatorPresence, EvidenceReply,
    Heartbeat, KillCommand, KillResult, LeaseGrant, MatchedLine, Notice, Refusal, Report, ReportAck, ReportEvent,
    SubmitRequest, TaskSnapshot, WorkerCommand, WorkerReply, MAX_GRANTS, MAX_KILL_REASON_BYTES,
};
use tenure_protocol::messages::{AttemptEvidence, EvidenceRequest, HeldAttempt, SidecarRefusal, WaitFor};
use tenure_protocol::{Attempt, Ending, HintTag, Outcome, RecoveryHint, TaskSpec};
use tenure_protocol::{Board, Epoch, Kind, SessionId, Status, TaskId, WorkerId};
use uuid::Uuid;

struct Harness {
    core: Core,
    now: Now,
}

fn s(x: &str) -> SessionId {
    x.parse().unwrap()
}

fn w(x: &str) -> WorkerId {
    x.parse().unwrap()
}

impl Harness {
    /// A leader that has led for longer than the worker TTL (past the grace
    /// in which an unknown kind is "not known yet").
    fn new() -> Harness {
        Harness::with_config(CoreConfig::default())
    }

    /// As `new`, with `cfg`.
    fn with_config(cfg: CoreConfig) -> Harness {
        let start = Now { mono: Duration::from_secs(100), wall_ms: 1_000_000 };
        let ttl = cfg.worker_ttl;
        let core = Core::new(cfg, Epoch(3), Vec::new(), start);
        let mut h = Harness { core, now: start };
        h.advance(ttl);
        h
    }

    fn advance(&mut self, d: Duration) {
        self.now.mono += d;
        self.now.wall_ms += d.as_millis() as u64;
    }

    fn input(&mut self, input: Input) -> Vec<Effect> {
        self.core.handle(input, self.now)
    }

    fn api(&mut self, request: ApiRequest) -> (Vec<Effect>, Option<ApiReply>) {
        let fx = self.input(Input::Api { reply_to: Some("r".into()), request, trace: None });
        let reply = fx.iter().find_map(|e| match e {
            Effect::Reply { to, reply } if to == "r" => Some(reply.clone()),
            _ => None,
        });
        (fx, reply)
    }

    fn submit(&mut self, session: &str, spec: TaskSpec) -> TaskId {
        let (_, reply) =
            self.api(ApiRequest::Submit(SubmitRequest { session: s(session), idempotency_key: Uuid::new_v4(), spec }));
        match reply {
            Some(Ok(ApiResponse::Submitted { task, .. })) => task,
            other => panic!("submit failed: {other:?}"),
        }
    }

    fn heartbeat(&mut self, worker: &str, slots: u32) -> Vec<Effect> {
        self.input(beat(worker, 0, slots, None))
    }

    /// `worker` answers `grant` with `refusal`.
    fn refuse(&mut self, worker: &str, grant: LeaseGrant, refusal: Refusal) -> Vec<Effect> {
        self.input(Input::CommandResult {
            worker: w(worker),
            command: WorkerCommand::Grant(grant),
            result: Ok(WorkerReply::Refused(refusal)),
        })
    }

    fn report(&mut self, worker: &str, task: &TaskId, attempt: u32, event: ReportEvent) -> ReportAck {
        let fx = self.report_effects(worker, task, attempt, event);
        fx.into_iter()
            .find_map(|e| match e {
                Effect::Ack { ack, .. } => Some(ack),
                _ => None,
            })
            .expect("an ack")
    }

    fn report_effects(&mut self, worker: &str, task: &TaskId, attempt: u32, event: ReportEvent) -> Vec<Effect> {
        self.input(Input::Report { reply_to: Some("ack".into()), report: report_of(worker, task, attempt, event) })
    }

    fn status(&self, task: &TaskId) -> Status {
        self.core.task(task).unwrap().life.status
    }
}

/// Every grant of `fx`, alone or sent together, in the order they leave.
/// `worker`'s report of `event` for `attempt` of `task`, under epoch 3.
fn report_of(worker: &str, task: &TaskId, attempt: u32, event: ReportEvent) -> Report {
    Report { worker: w(worker), task: task.clone(), attempt: Attempt(attempt), epoch: Epoch(3), event }
}

fn grants(fx: &[Effect]) -> Vec<(WorkerId, LeaseGrant)> {
    fx.iter()
        .flat_map(|e| match e {
            Effect::Command { worker, command: WorkerCommand::Grant(g), .. } => vec![(worker.clone(), g.clone())],
            Effect::Grants { worker, grants, .. } => grants.iter().map(|g| (worker.clone(), g.clone())).collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn completed() -> ReportEvent {
    ReportEvent::Finished(Outcome::new(Ending::Completed, Some(0), None))
}

#[test]
fn a_task_runs_from_submit_to_completed_and_every_change_is_persisted_first() {
    let mut h = Harness::new();
    let (fx, reply) = h.api(ApiRequest::Submit(SubmitRequest {
        session: s("alice"),
        idempotency_key: Uuid::new_v4(),
        spec: TaskSpec::shell("hi", "echo hi"),
    }));
    let Some(Ok(ApiResponse::Submitted { task, existing: false })) = reply else { panic!("{reply:?}") };
    assert_eq!(task.to_string(), "shell-1");
    assert!(matches!(fx[0], Effect::Persist(..)), "persist before reply: {fx:?}");

    let fx = h.heartbeat("w1", 2);
    let g = grants(&fx);
    assert_eq!(g.len(), 1);
    assert_eq!((g[0].0.as_str(), g[0].1.attempt, g[0].1.epoch), ("w1", Attempt(1), Epoch(3)));
    let persist_at = fx.iter().position(|e| matches!(e, Effect::Persist(..))).unwrap();
    let grant_at = fx.iter().position(|e| matches!(e, Effect::Command { .. })).unwrap();
    assert!(persist_at < grant_at);
    assert_eq!(h.status(&task), Status::Leased);

    assert_eq!(h.report("w1", &task, 1, ReportEvent::Started { pid: 42 }), ReportAck::Ack);
    assert_eq!(h.status(&task), Status::Running);
    let (_, reply) =
        h.api(ApiRequest::Wait { session: s("alice"), task: task.clone(), timeout_ms: 5000, until: WaitFor::End });
    assert!(reply.is_none(), "wait is held until the task ends");

    let fx = h.input(Input::Report {
        reply_to: Some("ack".into()),
        report: Report {
            worker: w("w1"),
            task: task.clone(),
            attempt: Attempt(1),
            epoch: Epoch(3),
            event: completed(),
        },
    });
    let waited = fx.iter().find_map(|e| match e {
        Effect::Reply { to, reply: Ok(ApiResponse::Waited { finished, snapshot }) } if to == "r" => {
            Some((*finished, snapshot.clone()))
        }
        _ => None,
    });
    let (finished, snap) = waited.expect("waiter answered");
    assert!(finished && snap.reported && snap.status == Status::Completed && snap.exit_code == Some(0));
    // A retried report is acknowledged and changes nothing.
    assert_eq!(h.report("w1", &task, 1, completed()), ReportAck::Ack);
    assert_eq!(h.status(&task), Status::Completed);
}

#[test]
fn ids_are_monotonic_across_kinds_and_restarts() {
    let mut h = Harness::new();
    let a = h.submit("s", TaskSpec::shell("a", "true"));
    let b = h.submit("s", TaskSpec::shell("b", "true"));
    assert_eq!((a.number(), b.number()), (1, 2));
    let records: Vec<TaskRecord> = [a, b].iter().map(|t| h.core.task(t).unwrap().clone()).collect();
    let mut again = Core::new(CoreConfig::default(), Epoch(4), records, h.now);
    let fx = again.handle(
        Input::Api {
            reply_to: Some("r".into()),
            request: ApiRequest::Submit(SubmitRequest {
                session: s("s"),
                idempotency_key: Uuid::new_v4(),
                spec: TaskSpec::shell("c", "true"),
            }),
            trace: None,
        },
        h.now,
    );
    assert!(fx.iter().any(
        |e| matches!(e, Effect::Reply { reply: Ok(ApiResponse::Submitted { task, .. }), .. } if task.number() == 3)
    ));
}

#[test]
fn a_retried_submit_returns_the_same_task() {
    let mut h = Harness::new();
    let req = SubmitRequest { session: s("s"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("a", "true") };
    let (_, first) = h.api(ApiRequest::Submit(req.clone()));
    let (fx, second) = h.api(ApiRequest::Submit(req));
    let (
        Some(Ok(ApiResponse::Submitted { task: t1, existing: false })),
        Some(Ok(ApiResponse::Submitted { task: t2, existing: true })),
    ) = (first, second)
    else {
        panic!()
    };
    assert_eq!(t1, t2);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
}

#[test]
fn bad_submits_are_refused_and_change_nothing() {
    let mut h = Harness::new();
    let cases = [
        (TaskSpec::shell("x", "   "), "InvalidSpec"),
        (TaskSpec { kind: "nosuch".parse().unwrap(), ..TaskSpec::shell("x", "true") }, "UnknownKind"),
        (TaskSpec::shell("x", "y".repeat(70_000)), "InvalidSpec"),
    ];
    for (spec, want) in cases {
        let (fx, reply) =
            h.api(ApiRequest::Submit(SubmitRequest { session: s("s"), idempotency_key: Uuid::new_v4(), spec }));
        let err = reply.unwrap().unwrap_err();
        assert!(format!("{err:?}").starts_with(want), "{err:?}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    }
    let (_, reply) = h.api(ApiRequest::List { session: s("s"), all: true });
    assert_eq!(reply, Some(Ok(ApiResponse::List(vec![]))));
}

#[test]
fn other_sessions_see_not_found() {
    let mut h = Harness::new();
    let t = h.submit("alice", TaskSpec::shell("a", "true"));
    for req in [
        ApiRequest::Get { session: s("bob"), task: t.clone() },
        ApiRequest::Kill { session: s("bob"), task: t.clone(), reason: None },
        ApiRequest::Wait { session: s("bob"), task: t.clone(), timeout_ms: 10, until: WaitFor::End },
        ApiRequest::Get { session: s("alice"), task: "shell-99".parse().unwrap() },
    ] {
        let (fx, reply) = h.api(req);
        assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))), "{reply:?}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    }
    assert_eq!(h.status(&t), Status::Queued);
}

/// Lets `w1` go silent while `w2` keeps heartbeating; returns the evidence
/// queries the leader sent about w1's attempts.
fn lose_w1(h: &mut Harness) -> Vec<EvidenceRequest> {
    let mut asked = Vec::new();
    for _ in 0..8 {
        h.advance(Duration::from_secs(1));
        h.heartbeat("w2", 4);
        for e in h.input(Input::Tick) {
            if let Effect::AskEvidence { worker, request } = e {
                assert_eq!(worker.as_str(), "w1");
                asked.push(request);
            }
        }
    }
    asked
}

fn answer(h: &mut Harness, request: &EvidenceRequest, result: Result<EvidenceReply, String>) -> Vec<Effect> {
    h.input(Input::Evidence { worker: w("w1"), request: request.clone(), result })
}

#[test]
fn a_kill_reason_is_stored_with_the_kill_and_kept_verbatim() {
    let mut h = Harness::new();
    h.heartbeat("w1", 1);
    let t = h.submit("s", TaskSpec::shell("r", "sleep 9"));
    h.heartbeat("w1", 1);
    h.report("w1", &t, 1, ReportEvent::Started { pid: 7 });
    // Too long, or with a NUL: refused, nothing changes.
    for bad in ["x".repeat(MAX_KILL_REASON_BYTES + 1), "a\0b".to_owned()] {
        let (fx, reply) = h.api(ApiRequest::Kill { session: s("s"), task: t.clone(), reason: Some(bad) });
        assert!(matches!(reply, Some(Err(ApiError::InvalidRequest(_)))), "{reply:?}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
        assert_eq!(h.status(&t), Status::Running);
    }
    let why = "superseded by shell-9 — «retry» with\ttabs";
    let (fx, reply) = h.api(ApiRequest::Kill { session: s("s"), task: t.clone(), reason: Some(why.into()) });
    let Some(Ok(ApiResponse::Kill { snapshot, .. })) = reply else { panic!("{reply:?}") };
    assert_eq!(snapshot.kill_reason.as_deref(), Some(why));
    // Persisted with the kill itself: a new leader reads it from the registry.
    let persisted = fx.iter().find_map(|e| match e {
        Effect::Persist(r, _) => Some(r.life.kill_reason.clone()),
        _ => None,
    });
    assert_eq!(persisted, Some(Some(why.into())));
    let (_, reply) = h.api(ApiRequest::Kill { session: s("s"), task: t.clone(), reason: Some("later".into()) });
    let Some(Ok(ApiResponse::Kill { snapshot, .. })) = reply else { panic!("{reply:?}") };
    assert_eq!(snapshot.kill_reason.as_deref(), Some(why), "the first reason stays");
}

#[test]
fn kill_paths() {
    let mut h = Harness::new();
    let queued = h.submit("s", TaskSpec::shell("q", "sleep 9"));
    let (_, reply) = h.api(ApiRequest::Kill { session: s("s"), task: queued.clone(), reason: None });
    let Some(Ok(ApiResponse::Kill { result: KillResult::Requested, snapshot })) = reply else { panic!("{reply:?}") };
    assert_eq!((snapshot.status, snapshot.reported), (Status::Killed, true));

    h.heartbeat("w1", 1);
    let running = h.submit("s", TaskSpec::shell("r", "sleep 9"));
    h.heartbeat("w1", 1);
    h.report("w1", &running, 1, ReportEvent::Started { pid: 7 });
    let (fx, reply) = h.api(ApiRequest::Kill { session: s("s"), task: running.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::Requested, .. }))));
    assert!(fx.iter().any(|e| matches!(e, Effect::Command { command: WorkerCommand::Kill(_), .. })));
    assert_eq!(h.status(&running), Status::Stopping);
    // Repeated kill is idempotent.
    let (_, reply) = h.api(ApiRequest::Kill { session: s("s"), task: running.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::Requested, .. }))));
    // Unanswered kills are re-sent.
    h.advance(Duration::from_secs(3));
    let fx = h.input(Input::Tick);
    assert!(fx.iter().any(|e| matches!(e, Effect::Command { command: WorkerCommand::Kill(_), .. })));
    let killed = ReportEvent::Finished(Outcome::new(Ending::Killed, None, Some("signal 15".into())));
    assert_eq!(h.report("w1", &running, 1, killed), ReportAck::Ack);
    assert_eq!(h.status(&running), Status::Killed);
    let (_, reply) = h.api(ApiRequest::Kill { session: s("s"), task: running.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::AlreadyFinished, .. }))));
}

/// `Run` is a submit and a wait in one request: the task is stored before
/// anything else, the reply is held until its end (marked reported, as a
/// wait's), or until the wait's time with its snapshot so far; a retry with
/// the same key waits on the same task; a refused spec creates nothing.
#[test]
fn run_submits_and_answers_with_the_end() {
    let mut h = Harness::new();
    h.heartbeat("w1", 2);
    let key = Uuid::new_v4();
    let run = |spec: TaskSpec, timeout_ms| ApiRequest::Run {
        submit: SubmitRequest { session: s("alice"), idempotency_key: key, spec },
        timeout_ms,
        until: WaitFor::End,
    };
    let (fx, reply) = h.api(run(TaskSpec::shell("a", "true"), 5000));
    assert!(reply.is_none(), "held until the end: {fx:?}");
    assert!(matches!(fx[0], Effect::Persist(..)), "the task is stored first: {fx:?}");
    let task = h.core.tasks.values().next().map(|r| r.id.clone()).expect("the task was created");
    assert_eq!(h.status(&task), Status::Leased);
    let fx = h.report_effects("w1", &task, 1, completed());
    let waited = fx.iter().find_map(|e| match e {
        Effect::Reply { to, reply: Ok(ApiResponse::Waited { finished, snapshot }) } if to == "r" => {
            Some((*finished, snapshot.clone()))
        }
        _ => None,
    });
    let (finished, snap) = waited.expect("the run is answered with the end");
    assert!(finished && snap.reported && snap.id == task && snap.status == Status::Completed, "{snap:?}");
    let appended = fx.iter().position(|e| matches!(e, Effect::Persist(r, _) if r.id == task));
    let replied = fx.iter().position(|e| matches!(e, Effect::Reply { to, .. } if to == "r"));
    assert!(appended < replied, "the end is stored before the run is answered: {fx:?}");

    // The same key again: the same task, ended, answered at once.
    let (_, reply) = h.api(run(TaskSpec::shell("a", "true"), 5000));
    let Some(Ok(ApiResponse::Waited { finished: true, snapshot })) = reply else { panic!("{reply:?}") };
    assert_eq!(snapshot.id, task);
    assert_eq!(h.core.tasks.values().count(), 1);

    // A spec the leader refuses: refused at once, nothing created.
    let bad = ApiRequest::Run {
        submit: SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("b", "") },
        timeout_ms: 5000,
        until: WaitFor::End,
    };
    let (fx, reply) = h.api(bad);
    assert!(matches!(reply, Some(Err(_))), "{reply:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "{fx:?}");
    assert_eq!(h.core.tasks.values().count(), 1);

    // A task that does not end in time: its snapshot so far, not reported.
    let (_, reply) = h.api(ApiRequest::Run {
        submit: SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("c", "x") },
        timeout_ms: 1000,
        until: WaitFor::End,
    });
    assert!(reply.is_none());
    h.advance(Duration::from_millis(1500));
    let fx = h.input(Input::Tick);
    let reply = fx.iter().find_map(|e| match e {
        Effect::Reply { to, reply } if to == "r" => Some(reply.clone()),
        _ => None,
    });
    let Some(Ok(ApiResponse::Waited { finished: false, snapshot })) = reply else { panic!("{reply:?}") };
    assert!(!snapshot.reported && !snapshot.status.is_terminal(), "{snapshot:?}");
}

/// The waits answered by `fx` to the client `r`, as (finished, status, reported).
fn waited(fx: &[Effect]) -> Vec<(bool, Status, bool)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Reply { to, reply: Ok(ApiResponse::Waited { finished, snapshot }) } if to == "r" => {
                Some((*finished, snapshot.status, snapshot.reported))
            }
            _ => None,
        })
        .collect()
}

/// A start wait is held until the task runs and answered right after the
/// `running` record it reports (the end's waiters keep waiting); it marks
/// nothing reported. Asked again once the task runs, it is answered at once.
#[test]
fn a_start_wait_is_answered_after_the_running_record_and_marks_nothing_reported() {
    let mut h = Harness::new();
    let task = h.submit("alice", TaskSpec::shell("a", "sleep 9"));
    let wait = |until| ApiRequest::Wait { session: s("alice"), task: task.clone(), timeout_ms: 5000, until };
    let (_, reply) = h.api(wait(WaitFor::Start));
    assert!(reply.is_none(), "a queued task has not started");
    h.input(Input::Api { reply_to: Some("end".into()), request: wait(WaitFor::End), trace: None });
    h.heartbeat("w1", 1);
    assert_eq!(h.status(&task), Status::Leased);
    let fx = h.report_effects("w1", &task, 1, ReportEvent::Started { pid: 42 });
    assert_eq!(waited(&fx), vec![(false, Status::Running, false)], "{fx:?}");
    let stored =
        fx.iter().position(|e| matches!(e, Effect::Persist(r, _) if r.id == task && r.life.status == Status::Running));
    let replied = fx.iter().position(|e| matches!(e, Effect::Reply { to, .. } if to == "r"));
    assert!(stored.is_some() && stored < replied, "the start is stored before it is answered: {fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Reply { to, .. } if to == "end")), "the end's waiter waits on");
    assert!(!h.core.task(&task).unwrap().reported);

    let (_, reply) = h.api(wait(WaitFor::Start));
    let Some(Ok(ApiResponse::Waited { finished: false, snapshot })) = reply else { panic!("{reply:?}") };
    assert_eq!(snapshot.status, Status::Running);
    let fx = h.report_effects("w1", &task, 1, completed());
    assert!(waited(&fx).is_empty(), "the start was answered once: {fx:?}");
    assert!(fx.iter().any(
        |e| matches!(e, Effect::Reply { to, reply: Ok(ApiResponse::Waited { finished: true, .. }) } if to == "end")
    ));
}

/// A task that ends before its start was seen (a short task, or one that
/// could not start) answers its start waits with the end, like an end wait;
/// a start wait for another owner's task is refused like any wait.
#[test]
fn a_start_wait_is_answered_by_an_end_without_a_start_and_only_for_the_owner() {
    let mut h = Harness::new();
    let task = h.submit("alice", TaskSpec::shell("a", "true"));
    let wait = |who| ApiRequest::Wait { session: s(who), task: task.clone(), timeout_ms: 5000, until: WaitFor::Start };
    let (_, reply) = h.api(wait("bob"));
    assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))), "{reply:?}");
    let (_, reply) = h.api(wait("alice"));
    assert!(reply.is_none());
    h.heartbeat("w1", 1);
    let fx = h.report_effects("w1", &task, 1, completed());
    assert_eq!(waited(&fx), vec![(true, Status::Completed, true)], "{fx:?}");
}

/// `Run` with a start wait: submitted, then answered once the task runs.
#[test]
fn a_run_for_the_start_is_answered_when_the_task_runs() {
    let mut h = Harness::new();
    h.heartbeat("w1", 1);
    let submit =
        SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("a", "x") };
    let (fx, reply) = h.api(ApiRequest::Run { submit, timeout_ms: 5000, until: WaitFor::Start });
    assert!(reply.is_none(), "held until the start: {fx:?}");
    let task = h.core.tasks.values().next().map(|r| r.id.clone()).expect("the task was created");
    let fx = h.report_effects("w1", &task, 1, ReportEvent::Started { pid: 7 });
    assert_eq!(waited(&fx), vec![(false, Status::Running, false)], "{fx:?}");
}

#[test]
fn wait_times_out_with_a_live_snapshot_and_does_not_mark_reported() {
    let mut h = Harness::new();
    let t = h.submit("s", TaskSpec::shell("a", "true"));
    let (_, reply) =
        h.api(ApiRequest::Wait { session: s("s"), task: t.clone(), timeout_ms: 1000, until: WaitFor::End });
    assert!(reply.is_none());
    h.advance(Duration::from_millis(1500));
    let fx = h.input(Input::Tick);
    let reply = fx.iter().find_map(|e| match e {
        Effect::Reply { reply, .. } => Some(reply.clone()),
        _ => None,
    });
    let Some(Ok(ApiResponse::Waited { finished: false, snapshot })) = reply else { panic!("{reply:?}") };
    assert!(!snapshot.reported);
    assert_eq!(snapshot.status, Status::Queued);
}

#[test]
fn an_operator_sees_and_kills_every_sessions_tasks_but_never_reports_them() {
    let op: SessionId = "ops/console".parse().unwrap();
    let cfg = CoreConfig { operators: vec!["ops".into()], ..CoreConfig::default() };
    let now = Now { mono: Duration::from_secs(1), wall_ms: 1 };
    let mut h = Harness { core: Core::new(cfg, Epoch(3), Vec::new(), now), now };
    let t = h.submit("alice", TaskSpec::shell("a", "sleep 9"));
    let (_, reply) = h.api(ApiRequest::List { session: op.clone(), all: true });
    assert!(matches!(reply, Some(Ok(ApiResponse::List(l))) if l.len() == 1));
    let (_, reply) = h.api(ApiRequest::Get { session: op.clone(), task: t.clone() });
    assert!(matches!(reply, Some(Ok(ApiResponse::Snapshot(_)))));
    let (_, reply) = h.api(ApiRequest::Kill { session: op.clone(), task: t.clone(), reason: None });
    let Some(Ok(ApiResponse::Kill { snapshot, .. })) = reply else { panic!("{reply:?}") };
    assert_eq!((snapshot.status, snapshot.reported), (Status::Killed, false), "the owner was not told");
    // Waiting and reporting stay the owner's.
    let (_, reply) = h.api(ApiRequest::MarkReported { session: op.clone(), task: t.clone() });
    assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))));
    // Others still see nothing.
    let (_, reply) = h.api(ApiRequest::Get { session: s("bob"), task: t });
    assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))));
}

fn cleanups(fx: &[Effect]) -> usize {
    fx.iter().filter(|e| matches!(e, Effect::Cleanup { .. })).count()
}

fn notices(fx: &[Effect]) -> Vec<Notice> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Notify(n) => Some((**n).clone()),
            _ => None,
        })
        .collect()
}

fn finish(h: &mut Harness, worker: &str, g: &LeaseGrant, ending: Ending) -> Vec<Effect> {
    assert_eq!(h.report(worker, &g.task, g.attempt.0, ReportEvent::Started { pid: 7 }), ReportAck::Ack);
    let fx = h.input(Input::Report {
        reply_to: None,
        report: Report {
            worker: w(worker),
            task: g.task.clone(),
            attempt: g.attempt,
            epoch: Epoch(3),
            event: ReportEvent::Finished(Outcome::new(ending, None, Some(format!("{ending:?}")))),
        },
    });
    fx
}

/// Submits a workflow; its first step is granted in the same turn.
fn start_flow(h: &mut Harness, spec: TaskSpec) -> (TaskId, Vec<(WorkerId, LeaseGrant)>) {
    let (fx, reply) =
        h.api(ApiRequest::Submit(SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec }));
    match reply {
        Some(Ok(ApiResponse::Submitted { task, .. })) => (task, grants(&fx)),
        other => panic!("submit failed: {other:?}"),
    }
}

fn snapshot(h: &mut Harness, task: &TaskId) -> TaskSnapshot {
    match h.api(ApiRequest::Get { session: s("alice"), task: task.clone() }).1 {
        Some(Ok(ApiResponse::Snapshot(s))) => s,
        other => panic!("{other:?}"),
    }
}

#[test]
fn matched_lines_are_notified_once_each_and_repeats_change_nothing() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let spec = TaskSpec { kind: Kind::monitor(), pattern: Some("ERR".into()), ..TaskSpec::shell("m", "tail -f log") };
    let (_, reply) = h.api(ApiRequest::Submit(SubmitRequest {
        session: s("alice"),
        idempotency_key: Uuid::new_v4(),
        spec: spec.clone(),
    }));
    assert!(matches!(reply, Some(Err(ApiError::UnknownKind { .. }))), "no worker advertised monitor: {reply:?}");
    h.input(Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w("w1"),
        instance: Uuid::nil(),
        slots: 4,
        kinds: vec![Kind::shell(), Kind::monitor()],
        epoch_seen: Epoch(3),
        attempts: Vec::new(),
        sidecar: Default::default(),
        replaces: None,
        incarnation: None,
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    }));
    let (fx, reply) =
        h.api(ApiRequest::Submit(SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec }));
    let Some(Ok(ApiResponse::Submitted { task, .. })) = reply else { panic!("{reply:?}") };
    assert_eq!(grants(&fx).len(), 1);
    let line = |offset: u64| MatchedLine { offset, text: format!("ERR at {offset}") };
    let report = |h: &mut Harness, lines: Vec<MatchedLine>| {
        h.input(Input::Report {
            reply_to: Some("ack".into()),
            report: Report {
                worker: w("w1"),
                task: task.clone(),
                attempt: Attempt(1),
                epoch: Epoch(3),
                event: ReportEvent::Matched(lines),
            },
        })
    };
    let fx = report(&mut h, vec![line(0), line(40)]);
    assert_eq!(notices(&fx).len(), 2);
    assert!(matches!(fx[0], Effect::Persist(ref r, _) if r.matched_through == 41 && r.matches == 2), "{fx:?}");
    // A retry after a lost ack, and a restarted worker re-reading from the start.
    let fx = report(&mut h, vec![line(40), line(0), line(90)]);
    let n = notices(&fx);
    assert!(matches!(&n[..], [Notice::Matched(m)] if m.line.offset == 90), "{n:?}");
    assert_eq!(snapshot(&mut h, &task).matches, 3);
    let fx = report(&mut h, vec![line(90)]);
    assert!(notices(&fx).is_empty() && !fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    assert!(fx.iter().any(|e| matches!(e, Effect::Ack { ack: ReportAck::Ack, .. })));
    // Another worker's report is stale.
    let stale = h.input(Input::Report {
        reply_to: Some("ack".into()),
        report: Report {
            worker: w("w9"),
            task: task.clone(),
            attempt: Attempt(1),
            epoch: Epoch(3),
            event: ReportEvent::Matched(vec![line(200)]),
        },
    });
    assert!(stale.iter().any(|e| matches!(e, Effect::Ack { ack: ReportAck::StaleAt { epoch: Epoch(3) }, .. })));
}

#[test]
fn right_after_a_takeover_an_unknown_kind_is_not_known_yet_rather_than_refused() {
    let now = Now { mono: Duration::from_secs(100), wall_ms: 1_000_000 };
    let mut h = Harness { core: Core::new(CoreConfig::default(), Epoch(3), Vec::new(), now), now };
    let spec = TaskSpec { kind: Kind::agent(), ..TaskSpec::shell("a", "cat") };
    let submit = |h: &mut Harness| {
        h.api(ApiRequest::Submit(SubmitRequest {
            session: s("s"),
            idempotency_key: Uuid::new_v4(),
            spec: spec.clone(),
        }))
    };
    let (fx, reply) = submit(&mut h);
    assert!(matches!(reply, Some(Err(ApiError::Unavailable(_)))), "{reply:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    h.advance(CoreConfig::default().worker_ttl);
    let (_, reply) = submit(&mut h);
    assert!(matches!(reply, Some(Err(ApiError::UnknownKind { .. }))), "{reply:?}");
}

#[test]
fn a_final_output_is_empty_while_live_then_the_same_every_read_and_reads_report_the_task() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let task = h.submit("alice", TaskSpec { final_output: true, ..TaskSpec::shell("f", "echo 42") });
    let read = |h: &mut Harness, t: &TaskId| h.api(ApiRequest::FinalOutput { session: s("alice"), task: t.clone() }).1;
    assert!(
        matches!(read(&mut h, &task), Some(Ok(ApiResponse::FinalOutput { finished: false, ref text })) if text.is_empty())
    );
    let mut outcome = Outcome::new(Ending::Completed, Some(0), None);
    outcome.output = Some("42\n".into());
    h.report("w1", &task, 1, ReportEvent::Finished(outcome));
    for _ in 0..2 {
        let reply = read(&mut h, &task);
        assert!(
            matches!(reply, Some(Ok(ApiResponse::FinalOutput { finished: true, ref text })) if text == "42\n"),
            "{reply:?}"
        );
    }
    assert!(h.core.task(&task).unwrap().reported);
    assert!(matches!(
        h.api(ApiRequest::FinalOutput { session: s("bob"), task: task.clone() }).1,
        Some(Err(ApiError::NotFound(_)))
    ));
    let streamed = h.submit("alice", TaskSpec::shell("s", "echo"));
    assert!(matches!(read(&mut h, &streamed), Some(Err(ApiError::InvalidRequest(_)))));
}

#[test]
fn list_pages_cover_every_task_once_each_page_within_the_message_limit() {
    let mut h = Harness::new();
    let n = 3000u64;
    for i in 0..n {
        h.submit("s", TaskSpec::shell(format!("{i}-{}", "l".repeat(300)), "true"));
    }
    let (mut seen, mut after, mut pages) = (Vec::new(), None, 0);
    loop {
        let (_, reply) = h.api(ApiRequest::ListPage { session: s("s"), all: true, after, before: None });
        let reply = reply.expect("a reply");
        let bytes = tenure_protocol::encode(&reply).expect("a page always fits a message").len();
        assert!(bytes <= tenure_protocol::MAX_MESSAGE_BYTES);
        let Ok(ApiResponse::Page { tasks, next }) = reply else { panic!("{reply:?}") };
        pages += 1;
        seen.extend(tasks.iter().map(|t| t.id.number()));
        match next {
            Some(last) => after = Some(last),
            None => break,
        }
    }
    assert!(pages > 2, "{pages} pages");
    assert_eq!(seen, (1..=n).collect::<Vec<_>>());
    // Another session's pages are empty.
    let (_, reply) = h.api(ApiRequest::ListPage { session: s("other"), all: true, after: None, before: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Page { ref tasks, next: None })) if tasks.is_empty()));
}

/// Every task a session's newest-first pages show, in order, and how many pages.
fn newest_first(h: &mut Harness, session: &SessionId, before: u64) -> (Vec<u64>, usize) {
    let (mut seen, mut before, mut pages) = (Vec::new(), before, 0);
    loop {
        let req = ApiRequest::ListPage { session: session.clone(), all: true, after: None, before: Some(before) };
        let reply = h.api(req).1.expect("a reply");
        let bytes = tenure_protocol::encode(&reply).expect("a page always fits a message").len();
        assert!(bytes <= tenure_protocol::MAX_MESSAGE_BYTES);
        let Ok(ApiResponse::Page { tasks, next }) = reply else { panic!("{reply:?}") };
        pages += 1;
        seen.extend(tasks.iter().map(|t| t.id.number()));
        match next {
            Some(lowest) => {
                assert_eq!(Some(lowest), seen.last().copied(), "next is the lowest number shown");
                before = lowest;
            }
            None => return (seen, pages),
        }
    }
}

#[test]
fn newest_first_pages_cover_a_sessions_tasks_once_highest_first_and_an_operator_sees_all() {
    let cfg = CoreConfig { operators: vec!["ops".into()], ..CoreConfig::default() };
    let mut h = Harness::with_config(cfg);
    let n = 3000u64;
    for i in 0..n {
        let owner = if i % 3 == 0 { "bob" } else { "alice" };
        h.submit(owner, TaskSpec::shell(format!("{i}-{}", "l".repeat(300)), "true"));
    }
    let alice: Vec<u64> = (1..=n).rev().filter(|k| (k - 1) % 3 != 0).collect();
    let (seen, pages) = newest_first(&mut h, &s("alice"), u64::MAX);
    assert!(pages > 2, "{pages} pages");
    assert_eq!(seen, alice, "alice's, highest number first, each once");
    // From the middle: only lower numbers.
    let (seen, _) = newest_first(&mut h, &s("alice"), 1000);
    assert_eq!(seen, alice.iter().copied().filter(|k| *k < 1000).collect::<Vec<_>>());
    // Bob sees none of alice's; an operator sees everyone's.
    let (seen, _) = newest_first(&mut h, &s("bob"), u64::MAX);
    assert_eq!(seen, (1..=n).rev().filter(|k| (k - 1) % 3 == 0).collect::<Vec<_>>());
    let op: SessionId = "ops/console".parse().unwrap();
    let (seen, _) = newest_first(&mut h, &op, u64::MAX);
    assert_eq!(seen, (1..=n).rev().collect::<Vec<_>>());
    // Nothing below the first task; a stranger's first page is empty.
    assert_eq!(newest_first(&mut h, &s("alice"), 1), (Vec::new(), 1));
    assert_eq!(newest_first(&mut h, &s("carol"), u64::MAX), (Vec::new(), 1));
}

#[test]
fn an_idempotency_key_is_remembered_while_its_task_runs_and_for_a_while_after() {
    let mut h = Harness::new();
    h.heartbeat("w1", 1);
    let key = Uuid::new_v4();
    let submit = |h: &mut Harness| {
        let req = SubmitRequest { session: s("s"), idempotency_key: key, spec: TaskSpec::shell("k", "true") };
        match h.api(ApiRequest::Submit(req)).1 {
            Some(Ok(ApiResponse::Submitted { task, existing })) => (task, existing),
            other => panic!("{other:?}"),
        }
    };
    let (task, existing) = submit(&mut h);
    assert!(!existing);
    h.report("w1", &task, 1, completed());
    h.advance(Duration::from_secs(60));
    h.input(Input::Tick);
    assert_eq!(submit(&mut h), (task.clone(), true), "a retry a minute after the end is the same task");
    h.advance(super::board::KEEP_KEYS);
    h.input(Input::Tick);
    let (again, existing) = submit(&mut h);
    assert!(!existing && again != task, "the key was forgotten after KEEP_KEYS");
}

#[test]
fn a_new_leader_republishes_the_notices_of_recent_unreported_ends_only() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let old = h.submit("s", TaskSpec::shell("old", "true"));
    h.report("w1", &old, 1, completed());
    h.advance(Duration::from_secs(3600));
    let recent = h.submit("s", TaskSpec::shell("recent", "true"));
    h.report("w1", &recent, 1, completed());
    let records: Vec<TaskRecord> = [&old, &recent].iter().map(|t| h.core.task(t).unwrap().clone()).collect();
    let next = Core::new(CoreConfig::default(), Epoch(4), records, h.now);
    // Plain notices, each an end's whole snapshot: the driver only publishes them.
    let ids = |notices: Vec<Notice>| -> Vec<String> {
        notices
            .into_iter()
            .map(|n| match n {
                Notice::Ended(s) => {
                    assert_eq!((s.status, s.reported), (Status::Completed, false), "{s:?}");
                    s.id.to_string()
                }
                Notice::Matched(m) => panic!("only ends are republished: {m:?}"),
            })
            .collect()
    };
    // The old end lies an hour of registry time before the last write.
    assert_eq!(ids(next.pending_notices(Some(Duration::from_secs(600)))), [recent.to_string()]);
    assert_eq!(ids(next.pending_notices(None)), [old.to_string(), recent.to_string()]);
}

/// A heartbeat of `worker` from process `instance` (0: the nil one), naming the
/// process it replaces, on a machine whose store is incarnation 1000.
fn beat(worker: &str, instance: u128, slots: u32, replaces: Option<u128>) -> Input {
    Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w(worker),
        instance: Uuid::from_u128(instance),
        slots,
        kinds: vec![Kind::shell()],
        epoch_seen: Epoch(3),
        attempts: Vec::<HeldAttempt>::new(),
        sidecar: Default::default(),
        replaces: replaces.map(Uuid::from_u128),
        incarnation: Some(Uuid::from_u128(1000)),
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    })
}

fn beat_from(h: &mut Harness, worker: &str, instance: u128, replaces: Option<u128>) -> Vec<Effect> {
    h.input(beat(worker, instance, 4, replaces))
}

fn taken(fx: &[Effect]) -> Option<(Uuid, Uuid)> {
    fx.iter().find_map(|e| match e {
        Effect::InstanceTaken { instance, holder, .. } => Some((*instance, *holder)),
        _ => None,
    })
}

// ------------------------------------------------- clocks of two leaders

/// The latest persisted version of each record in the effects, as the
/// registry would hold them for the next leader.
fn persisted(fx: &[Effect], into: &mut BTreeMap<TaskId, TaskRecord>) {
    for e in fx {
        if let Effect::Persist(r, _) = e {
            into.insert(r.id.clone(), (**r).clone());
        }
    }
}

/// A leader whose wall clock reads `skew_ms` away from the old one's takes
/// over the registry the old one wrote.
fn take_over(records: &BTreeMap<TaskId, TaskRecord>, cfg: CoreConfig, wall_ms: u64) -> Harness {
    let now = Now { mono: Duration::from_secs(5), wall_ms };
    let core = Core::new(cfg, Epoch(4), records.values().cloned().collect(), now);
    let mut h = Harness { core, now };
    h.advance(CoreConfig::default().worker_ttl);
    h
}

#[test]
fn a_new_leader_with_a_clock_minutes_ahead_still_knows_a_retried_submits_key() {
    let mut old = Harness::new();
    let mut registry = BTreeMap::new();
    let fx = old.heartbeat("w1", 1);
    persisted(&fx, &mut registry);
    let key = Uuid::new_v4();
    let req = SubmitRequest { session: s("s"), idempotency_key: key, spec: TaskSpec::shell("k", "true") };
    let (fx, _) = old.api(ApiRequest::Submit(req.clone()));
    persisted(&fx, &mut registry);
    let task = registry.keys().next().cloned().unwrap();
    let fx = old.input(Input::Tick);
    persisted(&fx, &mut registry);
    let fx = old.input(Input::Report {
        reply_to: None,
        report: Report {
            worker: w("w1"),
            task: task.clone(),
            attempt: Attempt(1),
            epoch: Epoch(3),
            event: completed(),
        },
    });
    persisted(&fx, &mut registry);
    assert!(registry[&task].life.status.is_terminal());
    // The old leader dies; the next one's wall clock is 20 minutes ahead
    // (more than the time a key is remembered).
    for skew in [20 * 60_000, 3 * 24 * 3_600_000] {
        let mut new = take_over(&registry, CoreConfig::default(), old.now.wall_ms + skew);
        new.heartbeat("w1", 1);
        new.input(Input::Tick);
        match new.api(ApiRequest::Submit(req.clone())).1 {
            Some(Ok(ApiResponse::Submitted { task: again, existing })) => {
                assert_eq!((again, existing), (task.clone(), true), "the retried submit made a second task")
            }
            other => panic!("{other:?}"),
        }
        // And it is forgotten once this leader has itself seen the time pass.
        new.advance(super::board::KEEP_KEYS);
        new.input(Input::Tick);
        let Some(Ok(ApiResponse::Submitted { existing, .. })) = new.api(ApiRequest::Submit(req.clone())).1 else {
            panic!("submit refused")
        };
        assert!(!existing, "the key is forgotten after KEEP_KEYS of this leader's time");
    }
}

#[test]
fn a_new_leader_with_a_clock_days_ahead_does_not_collect_fresh_tasks() {
    let cfg = CoreConfig { retention: Some(Duration::from_secs(3600)), ..CoreConfig::default() };
    let start = Now { mono: Duration::from_secs(1), wall_ms: 1_000_000 };
    let mut old = Harness { core: Core::new(cfg.clone(), Epoch(3), Vec::new(), start), now: start };
    let mut registry = BTreeMap::new();
    let task = old.submit("s", TaskSpec::shell("b", "sleep 9"));
    let (fx, _) = old.api(ApiRequest::Kill { session: s("s"), task: task.clone(), reason: None });
    persisted(&fx, &mut registry);
    // Half the retention passes on the old leader, and it writes on.
    old.advance(Duration::from_secs(1800));
    let other = old.submit("s", TaskSpec::shell("c", "sleep 9"));
    let (fx, _) = old.api(ApiRequest::Kill { session: s("s"), task: other.clone(), reason: None });
    persisted(&fx, &mut registry);
    assert!(registry[&task].life.status.is_terminal());
    for wall_ms in [old.now.wall_ms + 5 * 24 * 3_600_000, old.now.wall_ms.saturating_sub(5 * 24 * 3_600_000)] {
        let mut new = take_over(&registry, cfg.clone(), wall_ms);
        let forgets = |fx: &[Effect]| {
            fx.iter()
                .filter_map(|e| match e {
                    Effect::Forget { task, .. } => Some(task.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        let fx = new.input(Input::Tick);
        assert!(forgets(&fx).is_empty(), "fresh tasks collected by a skewed leader: {fx:?}");
        // The rest of the first task's retention passes on the new leader:
        // only it is collected.
        new.advance(Duration::from_secs(1800));
        let fx = new.input(Input::Tick);
        assert_eq!(forgets(&fx), vec![task.clone()]);
        new.advance(Duration::from_secs(1800));
        let fx = new.input(Input::Tick);
        assert_eq!(forgets(&fx), vec![other.clone()]);
    }
}

fn leader(renewed_at: Duration) -> Input {
    Input::Leader(Leader {
        name: "c1".into(),
        holder: "c1:aa".into(),
        renewed_at,
        renewals: 7,
        ttl_ms: 6000,
        adopted_in_ms: 42,
    })
}

fn cluster_status(h: &mut Harness) -> ClusterStatus {
    match h.api(ApiRequest::Status).1 {
        Some(Ok(ApiResponse::Status(status))) => status,
        other => panic!("{other:?}"),
    }
}

/// The core answers `Status` whole — its own term and the standbys lately
/// heard from — so the driver only sends the reply.
#[test]
fn the_status_names_this_leaders_term_and_the_standbys_lately_heard_from() {
    let mut h = Harness::new();
    let status = cluster_status(&mut h);
    assert!(status.leader.is_none() && status.standbys.is_empty(), "told nothing yet: {status:?}");
    h.input(leader(h.now.mono));
    let presence =
        |name: &str, holder: &str| Input::Presence(CoordinatorPresence { name: name.into(), holder: holder.into() });
    h.input(presence("c3", "c3:cc"));
    h.input(presence("c1", "c1:aa")); // this process's own presence
    h.advance(Duration::from_secs(3));
    h.input(presence("c2", "c2:bb"));
    h.advance(Duration::from_millis(500));
    let status = cluster_status(&mut h);
    let l = status.leader.expect("the leader");
    assert_eq!((l.name.as_str(), l.holder.as_str(), l.epoch), ("c1", "c1:aa", Epoch(3)));
    assert_eq!((l.lease_age_ms, l.renewals, l.lease_ttl_ms, l.adopted_in_ms), (3500, 7, 6000, 42));
    let standbys: Vec<(&str, u64)> = status.standbys.iter().map(|s| (s.name.as_str(), s.last_seen_ms)).collect();
    assert_eq!(standbys, [("c2", 500), ("c3", 3500)]);
    // A renewal resets the age; a standby not heard from for 5 s is gone.
    h.advance(Duration::from_secs(2));
    h.input(leader(h.now.mono));
    let status = cluster_status(&mut h);
    assert_eq!(status.leader.map(|l| l.lease_age_ms), Some(0));
    let standbys: Vec<&str> = status.standbys.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(standbys, ["c2"]);
}

#[test]
fn a_task_leased_at_its_submit_is_stored_once_before_its_reply_and_grant() {
    let mut h = Harness::new();
    h.heartbeat("w1", 2);
    let (fx, reply) = h.api(ApiRequest::Submit(SubmitRequest {
        session: s("alice"),
        idempotency_key: Uuid::new_v4(),
        spec: TaskSpec::shell("hi", "echo hi"),
    }));
    let Some(Ok(ApiResponse::Submitted { task, .. })) = reply else { panic!("{reply:?}") };
    let persisted: Vec<&TaskRecord> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Persist(r, _) => Some(&**r),
            _ => None,
        })
        .collect();
    assert_eq!(persisted.len(), 1, "queued and leased are one append: {fx:?}");
    assert_eq!(persisted[0].life.status, Status::Leased, "the append holds the latest version");
    assert!(matches!(fx[0], Effect::Persist(..)), "the append comes before the reply and the grant: {fx:?}");
    assert_eq!(grants(&fx).len(), 1);
    assert_eq!(h.status(&task), Status::Leased);
}

#[test]
fn coalescing_keeps_the_last_version_of_each_task_in_the_place_of_its_first() {
    let record = |n: u64, label: &str| {
        let id = TaskId::new(Kind::shell(), n).unwrap();
        Box::new(TaskRecord::new(id, s("a"), Uuid::nil(), TaskSpec::shell(label, "true"), 0))
    };
    let label = |e: &Effect| match e {
        Effect::Persist(r, _) => format!("{}:{}", r.id.number(), r.spec.label),
        Effect::Reply { to, .. } => format!("reply {to}"),
        Effect::Forget { task, .. } => format!("forget {}", task.number()),
        other => format!("{other:?}"),
    };
    let reply = |to: &str| Effect::Reply { to: to.into(), reply: Err(ApiError::NotLeader) };
    let mut fx = vec![
        Effect::Persist(record(1, "a"), Version::Later),
        reply("r1"),
        Effect::Persist(record(2, "x"), Version::Later),
        Effect::Persist(record(1, "b"), Version::Later),
        reply("r2"),
        Effect::Persist(record(1, "c"), Version::Later),
        Effect::Persist(record(3, "y"), Version::Later),
        Effect::Forget { task: TaskId::new(Kind::shell(), 3).unwrap(), at_ms: 0 },
        Effect::Persist(record(3, "z"), Version::Later),
    ];
    coalesce_persists(&mut fx);
    let got: Vec<String> = fx.iter().map(label).collect();
    assert_eq!(got, ["1:c", "reply r1", "2:x", "reply r2", "3:y", "forget 3", "3:z"]);
}

#[test]
fn grants_to_one_worker_process_go_together_in_the_place_of_the_last() {
    let grant = |n: u64| LeaseGrant {
        input: Vec::new(),
        task: TaskId::new(Kind::shell(), n).unwrap(),
        attempt: Attempt(1),
        epoch: Epoch(3),
        owner: s("a"),
        spec: TaskSpec::shell("l", "true"),
        mark: None,
    };
    let (one, two) = (Uuid::from_u128(1), Uuid::from_u128(2));
    let command = |worker: &str, instance: Uuid, command: WorkerCommand, traced: bool| Effect::Command {
        worker: w(worker),
        instance,
        command,
        trace: traced.then(|| "00-trace".to_owned()),
    };
    let g = |worker: &str, instance: Uuid, n: u64| command(worker, instance, WorkerCommand::Grant(grant(n)), false);
    let kill = |n: u64| {
        let kill = KillCommand { task: TaskId::new(Kind::shell(), n).unwrap(), attempt: Attempt(1), epoch: Epoch(3) };
        command("w1", one, WorkerCommand::Kill(kill), false)
    };
    let label = |e: &Effect| match e {
        Effect::Command { worker, command: WorkerCommand::Grant(g), trace, .. } => {
            format!("{worker}:{}{}", g.task.number(), if trace.is_some() { " traced" } else { "" })
        }
        Effect::Command { command: WorkerCommand::Kill(k), .. } => format!("kill {}", k.task.number()),
        Effect::Grants { worker, grants, .. } => {
            let numbers: Vec<String> = grants.iter().map(|g| g.task.number().to_string()).collect();
            format!("{worker}:[{}]", numbers.join(","))
        }
        Effect::Reply { to, .. } => format!("reply {to}"),
        other => format!("{other:?}"),
    };
    let mut fx = vec![
        g("w1", one, 1),
        Effect::Reply { to: "r".into(), reply: Err(ApiError::NotLeader) },
        g("w2", one, 2),
        g("w1", one, 3),
        g("w1", two, 4),
        kill(9),
        g("w1", one, 5),
        command("w1", one, WorkerCommand::Grant(grant(6)), true),
        g("w1", one, 7),
    ];
    group_grants(&mut fx);
    let got: Vec<String> = fx.iter().map(label).collect();
    // w1's first run ends at its kill; w2 and w1's other process get theirs
    // alone; a traced grant stays alone and ends nothing.
    assert_eq!(got, ["reply r", "w2:2", "w1:[1,3]", "w1:4", "kill 9", "w1:6 traced", "w1:[5,7]"]);

    // At most MAX_GRANTS together.
    let mut fx: Vec<Effect> = (1..=MAX_GRANTS as u64 + 1).map(|n| g("w1", one, n)).collect();
    group_grants(&mut fx);
    let sizes: Vec<usize> = fx
        .iter()
        .map(|e| match e {
            Effect::Grants { grants, .. } => grants.len(),
            _ => 1,
        })
        .collect();
    assert_eq!(sizes, [MAX_GRANTS, 1]);
}

#[test]
fn an_end_handed_to_a_waiter_is_not_noticed_and_an_end_nobody_saw_is() {
    let mut h = Harness::new();
    h.heartbeat("w1", 2);
    let waited = h.submit("alice", TaskSpec::shell("w", "true"));
    let unseen = h.submit("alice", TaskSpec::shell("u", "true"));
    let (_, reply) =
        h.api(ApiRequest::Wait { session: s("alice"), task: waited.clone(), timeout_ms: 10_000, until: WaitFor::End });
    assert!(reply.is_none(), "the wait is held until the end");
    for task in [&waited, &unseen] {
        h.report("w1", task, 1, ReportEvent::Started { pid: 1 });
    }
    let fx = h.report_effects("w1", &waited, 1, completed());
    let ended: Vec<&Effect> = fx.iter().filter(|e| matches!(e, Effect::Reply { .. } | Effect::Notify(_))).collect();
    assert!(matches!(&ended[..], [Effect::Reply { reply: Ok(ApiResponse::Waited { finished: true, .. }), .. }]));
    assert!(h.core.task(&waited).unwrap().reported);
    let fx = h.report_effects("w1", &unseen, 1, completed());
    let n = notices(&fx);
    assert!(matches!(&n[..], [Notice::Ended(s)] if s.id == unseen && !s.reported), "{n:?}");
}

#[path = "batch_tests.rs"]
mod batch;
#[path = "flow_tests.rs"]
mod flow;
#[path = "limits_tests.rs"]
mod limits;
#[path = "resume_tests.rs"]
mod resume;
#[path = "retry_tests.rs"]
mod retry;
#[path = "workers_tests.rs"]
mod workers;
#[path = "workflow_tests.rs"]
mod workflow;

/// The pause wishes a list of effects sends, as (paused, attempt, epoch).
fn pause_commands(fx: &[Effect]) -> Vec<(bool, Attempt, Epoch)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Command { command: WorkerCommand::Pause(p), .. } => Some((p.paused, p.attempt, p.epoch)),
            _ => None,
        })
        .collect()
}

/// A heartbeat of `w1` listing `task`'s attempt 1 with the machine's wish.
fn beat_holding(h: &mut Harness, task: &TaskId, paused: bool) -> Vec<Effect> {
    let Input::Heartbeat(mut hb) = beat("w1", 0, 4, None) else { unreachable!() };
    hb.attempts = vec![HeldAttempt { task: task.clone(), attempt: Attempt(1), paused, waiting: false }];
    h.input(Input::Heartbeat(hb))
}

/// Pause and resume: only a running task of the caller, recorded before the
/// worker is told; carried again while heartbeats contradict the registry (at
/// most once a second), also by a new leader that sent nothing itself; a
/// paused task is still killed.
#[test]
fn pause_and_resume_are_recorded_then_carried_until_the_worker_shows_them() {
    let mut h = Harness::new();
    let queued = h.submit("s", TaskSpec::shell("q", "sleep 9"));
    let (fx, reply) = h.api(ApiRequest::Pause { session: s("s"), task: queued.clone() });
    assert!(matches!(reply, Some(Err(ApiError::NotRunning { .. }))), "{reply:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))) && pause_commands(&fx).is_empty());

    h.heartbeat("w1", 4);
    h.report("w1", &queued, 1, ReportEvent::Started { pid: 7 });
    let t = queued;
    let (fx, reply) = h.api(ApiRequest::Pause { session: s("bob"), task: t.clone() });
    assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))), "{reply:?}");
    assert!(fx.is_empty() || pause_commands(&fx).is_empty());
    assert_eq!(h.status(&t), Status::Running);

    let (fx, reply) = h.api(ApiRequest::Pause { session: s("s"), task: t.clone() });
    let Some(Ok(ApiResponse::Snapshot(snapshot))) = reply else { panic!("{reply:?}") };
    assert_eq!(snapshot.status, Status::Paused);
    let persisted = fx.iter().position(|e| matches!(e, Effect::Persist(r, _) if r.life.pause_requested));
    let told = fx.iter().position(|e| matches!(e, Effect::Command { command: WorkerCommand::Pause(_), .. }));
    assert!(matches!((persisted, told), (Some(p), Some(c)) if p < c), "recorded before the worker is told: {fx:?}");
    assert_eq!(pause_commands(&fx), [(true, Attempt(1), Epoch(3))]);

    // The machine has not taken it: carried again, at most once a second.
    assert!(pause_commands(&beat_holding(&mut h, &t, false)).is_empty(), "just sent");
    h.advance(Duration::from_secs(1));
    assert_eq!(pause_commands(&beat_holding(&mut h, &t, false)), [(true, Attempt(1), Epoch(3))]);
    assert!(pause_commands(&beat_holding(&mut h, &t, false)).is_empty());
    h.advance(Duration::from_secs(1));
    assert_eq!(pause_commands(&beat_holding(&mut h, &t, false)).len(), 1);
    h.advance(Duration::from_secs(1));
    assert!(pause_commands(&beat_holding(&mut h, &t, true)).is_empty(), "taken: nothing more");

    // A new leader, from the registry alone: the heartbeat tells it.
    let records: Vec<TaskRecord> = h.core.task(&t).cloned().into_iter().collect();
    let mut next = Harness { core: Core::new(CoreConfig::default(), Epoch(4), records, h.now), now: h.now };
    next.advance(CoreConfig::default().worker_ttl);
    assert_eq!(next.status(&t), Status::Paused);
    assert!(pause_commands(&beat_holding(&mut next, &t, true)).is_empty());
    next.advance(Duration::from_secs(1));
    assert_eq!(pause_commands(&beat_holding(&mut next, &t, false)), [(true, Attempt(1), Epoch(4))]);

    // Resume: running again, and the machine is told.
    let (fx, reply) = next.api(ApiRequest::Resume { session: s("s"), task: t.clone() });
    assert!(matches!(reply, Some(Ok(ApiResponse::Snapshot(ref s))) if s.status == Status::Running), "{reply:?}");
    assert_eq!(pause_commands(&fx), [(false, Attempt(1), Epoch(4))]);
    next.advance(Duration::from_secs(1));
    assert_eq!(pause_commands(&beat_holding(&mut next, &t, true)), [(false, Attempt(1), Epoch(4))]);

    // Paused again, then killed: the kill wins, and no wish is carried any more.
    next.api(ApiRequest::Pause { session: s("s"), task: t.clone() });
    let (_, reply) = next.api(ApiRequest::Kill { session: s("s"), task: t.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { .. }))), "{reply:?}");
    assert_eq!(next.status(&t), Status::Stopping);
    next.advance(Duration::from_secs(1));
    assert!(pause_commands(&beat_holding(&mut next, &t, false)).is_empty());
    let (_, reply) = next.api(ApiRequest::Resume { session: s("s"), task: t.clone() });
    assert!(matches!(reply, Some(Err(ApiError::NotRunning { .. }))), "{reply:?}");
}

/// A worker's reports sent together are judged exactly as if sent one by
/// one, and answered once, in order, after every append they caused.
#[test]
fn reports_sent_together_are_judged_one_by_one_and_answered_after_their_appends() {
    let setup = || {
        let mut h = Harness::new();
        let tasks: Vec<TaskId> = (0..3).map(|i| h.submit("alice", TaskSpec::shell("t", format!("echo {i}")))).collect();
        assert_eq!(grants(&h.heartbeat("w1", 3)).len(), 3);
        (h, tasks)
    };
    let report = |task: &TaskId, attempt: u32, event: ReportEvent| report_of("w1", task, attempt, event);
    let (mut alone, tasks) = setup();
    let reports = vec![
        report(&tasks[0], 1, ReportEvent::Started { pid: 42 }),
        report(&tasks[0], 1, completed()),
        report(&tasks[1], 1, completed()),
        report(&tasks[2], 9, completed()),
        report(&tasks[1], 1, completed()),
    ];
    let one_by_one: Vec<ReportAck> =
        reports.iter().map(|r| alone.report("w1", &r.task, r.attempt.0, r.event.clone())).collect();
    assert_eq!(
        one_by_one,
        [ReportAck::Ack, ReportAck::Ack, ReportAck::Ack, ReportAck::StaleAt { epoch: Epoch(3) }, ReportAck::Ack]
    );

    let (mut together, tasks) = setup();
    let fx = together.input(Input::Reports { reply_to: Some("acks".into()), reports });
    let answers: Vec<(usize, &Vec<ReportAck>)> = fx
        .iter()
        .enumerate()
        .filter_map(|(i, e)| match e {
            Effect::Acks { to, acks } if to == "acks" => Some((i, acks)),
            _ => None,
        })
        .collect();
    let [(at, acks)] = answers[..] else { panic!("one answer: {fx:?}") };
    assert_eq!(*acks, one_by_one);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Ack { .. })), "{fx:?}");
    let last_append = fx.iter().rposition(|e| matches!(e, Effect::Persist(..))).expect("appends");
    assert!(last_append < at, "the answer leaves after every append: {fx:?}");
    // One append per task: shell-1 went from leased to completed in one.
    let appended: Vec<(TaskId, Status)> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Persist(r, _) => Some((r.id.clone(), r.life.status)),
            _ => None,
        })
        .collect();
    assert_eq!(appended, [(tasks[0].clone(), Status::Completed), (tasks[1].clone(), Status::Completed)]);
    for task in &tasks {
        assert_eq!(together.status(task), alone.status(task), "{task}");
    }
}
