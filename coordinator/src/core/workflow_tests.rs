//! The core's board moves, cleanup jobs, garbage collection and workflows.

use super::*;

#[test]
fn a_cleanup_job_is_persisted_first_retried_with_backoff_and_cancelled_by_unarchive() {
    let mut h = Harness::new();
    h.heartbeat("w1", 1);
    let t = h.submit("s", TaskSpec::shell("a", "true"));
    h.heartbeat("w1", 1);
    h.report("w1", &t, 1, completed());
    let (fx, reply) = h.api(ApiRequest::Archive { session: s("s"), task: t.clone() });
    assert!(matches!(reply, Some(Ok(ApiResponse::Snapshot(_)))));
    let persist_at =
        fx.iter().rposition(|e| matches!(e, Effect::Persist(r, _) if r.cleanup.is_some())).expect("job persisted");
    let send_at = fx.iter().position(|e| matches!(e, Effect::Cleanup { .. })).expect("job sent");
    assert!(persist_at < send_at, "the job is durable before it is sent");
    // Unanswered: re-sent after 2 s, then after 4 s (backoff), not before.
    h.advance(Duration::from_millis(1500));
    assert_eq!(cleanups(&h.input(Input::Tick)), 0);
    h.advance(Duration::from_millis(600));
    assert_eq!(cleanups(&h.input(Input::Tick)), 1);
    h.advance(Duration::from_secs(3));
    assert_eq!(cleanups(&h.input(Input::Tick)), 0);
    h.advance(Duration::from_secs(2));
    assert_eq!(cleanups(&h.input(Input::Tick)), 1);
    // A repeated archive reuses the pending job.
    let (fx, _) = h.api(ApiRequest::Archive { session: s("s"), task: t.clone() });
    assert_eq!(cleanups(&fx), 0);
    // Unarchive cancels it and asks the machine what is left; once it answers
    // that the files are there, nothing is sent again.
    let (fx, _) = h.api(ApiRequest::Unarchive { session: s("s"), task: t.clone() });
    let probe = fx
        .iter()
        .find_map(|e| match e {
            Effect::Cleanup { request, .. } if request.cancel => Some(request.clone()),
            _ => None,
        })
        .expect("the cancellation is sent");
    assert_eq!(probe.job, 1);
    h.input(Input::CleanupResult {
        worker: w("w1"),
        request: probe.clone(),
        result: Ok(Ok(tenure_protocol::messages::CleanupDone { files: 1, records: 1 })),
    });
    h.advance(Duration::from_secs(120));
    assert_eq!(cleanups(&h.input(Input::Tick)), 0);
    let after = h.core.task(&t).unwrap().snapshot();
    assert!(!after.cleaned && after.board == Board::Active, "{after:?}");
    // Delete starts job 2, which completes.
    let (fx, _) = h.api(ApiRequest::Delete { session: s("s"), task: t.clone() });
    let Some(Effect::Cleanup { request, .. }) = fx.into_iter().find(|e| matches!(e, Effect::Cleanup { .. })) else {
        panic!("no job")
    };
    assert_eq!(request.job, 2);
    h.input(Input::CleanupResult {
        worker: w("w1"),
        request,
        result: Ok(Ok(tenure_protocol::messages::CleanupDone { files: 0, records: 1 })),
    });
    assert!(h.core.task(&t).unwrap().snapshot().cleaned);
    // A cancellation that finds the files gone (a copy of the job ran first)
    // records them released.
    let u = h.submit("s", TaskSpec::shell("b", "true"));
    h.heartbeat("w1", 1);
    h.report("w1", &u, 1, completed());
    h.api(ApiRequest::Archive { session: s("s"), task: u.clone() });
    let (fx, _) = h.api(ApiRequest::Unarchive { session: s("s"), task: u.clone() });
    let Some(Effect::Cleanup { request, .. }) = fx.into_iter().find(|e| matches!(e, Effect::Cleanup { .. })) else {
        panic!("no cancellation")
    };
    h.input(Input::CleanupResult {
        worker: w("w1"),
        request,
        result: Ok(Ok(tenure_protocol::messages::CleanupDone { files: 0, records: 0 })),
    });
    assert!(h.core.task(&u).unwrap().snapshot().cleaned);
}

#[test]
fn finished_tasks_are_collected_after_their_retention_files_first() {
    let cfg = CoreConfig { retention: Some(Duration::from_secs(60)), ..CoreConfig::default() };
    let now = Now { mono: Duration::from_secs(1), wall_ms: 1_000_000 };
    let mut h = Harness { core: Core::new(cfg, Epoch(3), Vec::new(), now), now };
    // Killed while queued, before any worker: it never ran anywhere.
    let never = h.submit("s", TaskSpec::shell("b", "sleep 9"));
    h.api(ApiRequest::Kill { session: s("s"), task: never.clone(), reason: None });
    h.heartbeat("w1", 2);
    let ran = h.submit("s", TaskSpec::shell("a", "true"));
    h.heartbeat("w1", 2);
    h.report("w1", &ran, 1, completed());
    let live = h.submit("s", TaskSpec::shell("c", "sleep 999"));
    // Not before the retention.
    h.advance(Duration::from_secs(30));
    assert!(!h.input(Input::Tick).iter().any(|e| matches!(e, Effect::Forget { .. } | Effect::Cleanup { .. })));
    h.advance(Duration::from_secs(40));
    let fx = h.input(Input::Tick);
    // A task that never ran anywhere is forgotten at once; one that ran first
    // has its files released.
    assert!(fx.iter().any(|e| matches!(e, Effect::Forget { task, .. } if *task == never)));
    let Some(Effect::Cleanup { request, .. }) = fx.iter().find(|e| matches!(e, Effect::Cleanup { .. })).cloned() else {
        panic!("no cleanup job: {fx:?}")
    };
    assert_eq!(request.task, ran);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Forget { task, .. } if *task == ran)));
    h.input(Input::CleanupResult {
        worker: w("w1"),
        request,
        result: Ok(Ok(tenure_protocol::messages::CleanupDone { files: 2, records: 1 })),
    });
    h.advance(Duration::from_secs(6));
    let fx = h.input(Input::Tick);
    assert!(fx.iter().any(|e| matches!(e, Effect::Forget { task, .. } if *task == ran)));
    let (_, reply) = h.api(ApiRequest::Get { session: s("s"), task: ran.clone() });
    assert!(matches!(reply, Some(Err(ApiError::NotFound(_)))));
    // Live tasks are never touched, and numbers are never reused.
    assert!(h.core.task(&live).is_some());
    let next = h.submit("s", TaskSpec::shell("d", "true"));
    assert!(next.number() > live.number());
}

#[test]
fn a_workflow_runs_its_steps_in_order_as_child_tasks_and_reports_once() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("build", ["make".to_owned(), "make test".to_owned()]));
    assert_eq!(flow.to_string(), "workflow-1");
    assert_eq!(h.status(&flow), Status::Running);
    assert_eq!(g.len(), 1, "only the first step runs: {g:?}");
    assert_eq!((g[0].1.task.to_string(), g[0].1.spec.command.as_str()), ("shell-2".to_owned(), "make"));
    // The workflow holds no worker slot of its own.
    assert_eq!(h.core.load().get(&w("w1")), Some(&1));

    let fx = finish(&mut h, "w1", &g[0].1.clone(), Ending::Completed);
    assert!(notices(&fx).is_empty(), "a step's end raises no notice: {fx:?}");
    let g2 = grants(&fx);
    assert_eq!(g2.len(), 1, "the second step is created and granted at once");
    assert_eq!(g2[0].1.task.to_string(), "shell-3");
    let view = snapshot(&mut h, &flow);
    let steps: Vec<_> = view.steps.iter().map(|s| (s.task.clone().map(|t| t.to_string()), s.status)).collect();
    assert_eq!(
        steps,
        [(Some("shell-2".into()), Some(Status::Completed)), (Some("shell-3".into()), Some(Status::Leased))]
    );
    assert!(h.core.task(&g[0].1.task).unwrap().reported, "the workflow reports for its steps");
    assert_eq!(snapshot(&mut h, &g[0].1.task).parent, Some(flow.clone()));

    let fx = finish(&mut h, "w1", &g2[0].1.clone(), Ending::Completed);
    assert_eq!(h.status(&flow), Status::Completed);
    let n = notices(&fx);
    assert!(matches!(&n[..], [Notice::Ended(s)] if s.id == flow && s.steps.len() == 2), "{n:?}");
}

#[test]
fn a_workflow_fails_fast_and_later_steps_never_begin() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("f", ["false".to_owned(), "echo never".to_owned()]));
    let fx = finish(&mut h, "w1", &g[0].1.clone(), Ending::Failed);
    assert!(grants(&fx).is_empty());
    assert_eq!(h.status(&flow), Status::Failed);
    let view = snapshot(&mut h, &flow);
    assert!(view.detail.as_deref().is_some_and(|d| d.contains("step 1 of 2 (shell-2) failed")), "{view:?}");
    assert_eq!((view.steps[1].task.clone(), view.steps[1].status), (None, None));
}

#[test]
fn killing_a_workflow_stops_its_current_step_and_completion_can_still_win() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("k", ["sleep 100".to_owned(), "echo never".to_owned()]));
    let step = g[0].1.task.clone();
    assert_eq!(h.report("w1", &step, 1, ReportEvent::Started { pid: 7 }), ReportAck::Ack);
    let (fx, reply) = h.api(ApiRequest::Kill { session: s("alice"), task: flow.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::Requested, .. }))), "{reply:?}");
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Command { command: WorkerCommand::Kill(k), .. } if k.task == step)),
        "the current step is killed: {fx:?}"
    );
    assert_eq!((h.status(&flow), h.status(&step)), (Status::Stopping, Status::Stopping));
    let fx = finish(&mut h, "w1", &g[0].1.clone(), Ending::Killed);
    assert!(grants(&fx).is_empty(), "no later step begins");
    assert_eq!(h.status(&flow), Status::Killed);
    let (_, reply) = h.api(ApiRequest::Kill { session: s("alice"), task: flow.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::AlreadyFinished, .. }))), "{reply:?}");

    // The last step completing before the kill lands: the workflow completed.
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("k2", ["true".to_owned()]));
    finish(&mut h, "w1", &g[0].1.clone(), Ending::Completed);
    let (_, reply) = h.api(ApiRequest::Kill { session: s("alice"), task: flow.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { result: KillResult::AlreadyFinished, .. }))), "{reply:?}");
    assert_eq!(h.status(&flow), Status::Completed);
}

#[test]
fn a_new_leader_resumes_a_workflow_from_its_children_alone() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("r", ["true".to_owned(), "true".to_owned()]));
    // The leader dies right after persisting the end of step 1, before creating step 2.
    let mut durable: Vec<TaskRecord> = h.core.tasks.values().cloned().collect();
    let step1 = durable.iter_mut().find(|r| r.id == g[0].1.task).unwrap();
    step1.life.status = Status::Completed;
    step1.life.outcome = Some(Outcome::new(Ending::Completed, Some(0), None));
    let mut next = Core::new(CoreConfig::default(), Epoch(4), durable, h.now);
    let fx = next.handle(Input::Tick, h.now);
    let created: Vec<_> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Persist(r, _) if r.parent.is_some() => Some((r.id.to_string(), r.life.status)),
            _ => None,
        })
        .collect();
    assert_eq!(created, [("shell-3".to_owned(), Status::Queued)]);
    // A second advance creates nothing more.
    let fx = next.handle(Input::Tick, h.now);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(r, _) if r.parent.is_some())), "{fx:?}");
    assert_eq!(next.task(&flow).unwrap().life.status, Status::Running);
}

#[test]
fn a_workflow_naming_an_unknown_step_kind_is_refused_and_creates_nothing() {
    let mut h = Harness::new();
    let mut spec = TaskSpec::workflow("x", ["true".to_owned()]);
    spec.steps[0].kind = "nosuch".parse().unwrap();
    let (fx, reply) =
        h.api(ApiRequest::Submit(SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec }));
    assert!(matches!(reply, Some(Err(ApiError::UnknownKind { ref kind, .. })) if kind == "nosuch"), "{reply:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
}

#[test]
fn archiving_a_workflow_archives_its_steps() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("a", ["true".to_owned()]));
    finish(&mut h, "w1", &g[0].1.clone(), Ending::Completed);
    let (fx, reply) = h.api(ApiRequest::Archive { session: s("alice"), task: flow.clone() });
    assert!(matches!(reply, Some(Ok(_))), "{reply:?}");
    assert_eq!(h.core.task(&g[0].1.task).unwrap().life.board, Board::Archived);
    assert!(fx.iter().any(|e| matches!(e, Effect::Cleanup { request, .. } if request.task == g[0].1.task)));
}

#[test]
fn a_workflow_waiting_on_an_unknown_step_says_so_and_goes_on_when_the_step_settles() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, TaskSpec::workflow("u", ["true".to_owned(), "true".to_owned()]));
    let step = g[0].1.task.clone();
    h.report("w1", &step, 1, ReportEvent::Started { pid: 1 });
    for request in lose_w1(&mut h) {
        answer(&mut h, &request, Err("no responders".into()));
    }
    assert_eq!(h.status(&step), Status::Unknown);
    let view = snapshot(&mut h, &flow);
    assert_eq!(view.status, Status::Running);
    let hint = view.hint.expect("the workflow says what it waits on");
    assert_eq!(hint.tag, HintTag::WorkerUnreachable);
    assert!(hint.message.contains(&format!("step 1 ({step})")), "{}", hint.message);
    // Late evidence settles the step; the workflow goes on.
    assert_eq!(h.report("w1", &step, 1, completed()), ReportAck::Ack);
    let view = snapshot(&mut h, &flow);
    assert!(view.hint.is_none() && view.steps[1].task.is_some(), "{view:?}");
}

fn timed_flow(timeout_ms: u64) -> TaskSpec {
    TaskSpec {
        limits: Some(Box::new(tenure_protocol::spec::TimeLimits {
            timeout_ms: Some(timeout_ms),
            idle_timeout_ms: None,
        })),
        ..TaskSpec::workflow("t", ["make".to_owned(), "make test".to_owned()])
    }
}

fn step_timeout(g: &LeaseGrant) -> Option<u64> {
    g.spec.limits.as_ref().and_then(|l| l.timeout_ms)
}

/// A workflow's timeout covers its steps: each step gets what is left of it
/// as its own timeout; past the deadline the running step is stopped, no
/// later step begins, and the workflow fails `timed-out`.
#[test]
fn a_workflows_timeout_covers_its_steps() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (flow, g) = start_flow(&mut h, timed_flow(10_000));
    assert_eq!(step_timeout(&g[0].1), Some(10_000), "the first step has the whole timeout");
    h.advance(Duration::from_secs(6));
    let g2 = grants(&finish(&mut h, "w1", &g[0].1.clone(), Ending::Completed));
    let left = step_timeout(&g2[0].1).expect("the second step has what is left");
    assert!((3_000..=4_000).contains(&left), "{left}");
    let step = g2[0].1.task.clone();
    h.report("w1", &step, 1, ReportEvent::Started { pid: 8 });
    // Not yet.
    h.advance(Duration::from_secs(3));
    h.input(Input::Tick);
    assert_eq!(h.status(&step), Status::Running);
    // Past the deadline: the step is stopped for the workflow's reason.
    h.advance(Duration::from_secs(2));
    let fx = h.input(Input::Tick);
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Command { command: WorkerCommand::Kill(k), .. } if k.task == step)),
        "the running step is killed: {fx:?}"
    );
    assert_eq!(h.status(&step), Status::Stopping);
    let reason = h.core.task(&step).unwrap().life.kill_reason.clone();
    assert!(reason.as_deref().is_some_and(|r| r.starts_with("timed-out:")), "{reason:?}");
    h.input(Input::Report {
        reply_to: None,
        report: Report {
            worker: w("w1"),
            task: step.clone(),
            attempt: Attempt(1),
            epoch: Epoch(3),
            event: ReportEvent::Finished(Outcome::new(Ending::Killed, None, Some("killed".into()))),
        },
    });
    let view = snapshot(&mut h, &flow);
    assert_eq!(view.status, Status::Failed);
    let detail = view.detail.unwrap_or_default();
    assert!(detail.starts_with("timed-out: the workflow ran longer than its timeout of 10s"), "{detail}");
    assert!(detail.contains("step 2 of 2"), "{detail}");
}

/// The deadline holds for a step that never started (no worker), and across
/// a takeover: the new leader reads it from the registry.
#[test]
fn a_workflows_deadline_outlives_its_leader_and_ends_a_step_that_never_ran() {
    let mut h = Harness::new();
    let (flow, g) = start_flow(&mut h, timed_flow(5_000));
    assert!(g.is_empty(), "no worker: the step waits");
    let durable: Vec<TaskRecord> = h.core.tasks.values().cloned().collect();
    assert!(durable.iter().any(|r| r.attempts.as_ref().is_some_and(|a| a.deadline_clock_ms > 0)));
    let mut next =
        take_over(&durable.into_iter().map(|r| (r.id.clone(), r)).collect(), CoreConfig::default(), h.now.wall_ms);
    next.advance(Duration::from_secs(6));
    next.input(Input::Tick);
    let view = snapshot(&mut next, &flow);
    assert_eq!(view.status, Status::Failed, "{view:?}");
    assert!(view.detail.as_deref().is_some_and(|d| d.starts_with("timed-out:")), "{view:?}");
    assert_eq!(view.steps[0].status, Some(Status::Killed), "{view:?}");
}
