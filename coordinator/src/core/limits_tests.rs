//! The core's limits: record size at submit, per-identity quotas, a full
//! registry, records that could not be stored, counters at their ends, and
//! epochs nobody claimed.

use super::*;
use crate::limits::{largest_size, Limits};
use tenure_protocol::{MAX_DETAIL_BYTES, MAX_FINAL_OUTPUT_BYTES};

fn with(limits: Limits) -> Harness {
    Harness::with_config(CoreConfig { limits, retention: Some(Duration::from_secs(60)), ..CoreConfig::default() })
}

fn try_submit(h: &mut Harness, session: &str, spec: TaskSpec) -> (Vec<Effect>, ApiReply) {
    let req = SubmitRequest { session: s(session), idempotency_key: Uuid::new_v4(), spec };
    let (fx, reply) = h.api(ApiRequest::Submit(req));
    (fx, reply.expect("a reply"))
}

fn persists(fx: &[Effect]) -> usize {
    fx.iter().filter(|e| matches!(e, Effect::Persist(..))).count()
}

/// The command length whose task record, at its largest, takes exactly `limit` bytes.
fn command_filling(owner: &str, limit: usize, spec: impl Fn(String) -> TaskSpec) -> usize {
    let (mut lo, mut hi) = (1usize, limit);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        match largest_size(&s(owner), &spec("x".repeat(mid)), None) {
            Ok(size) if size <= limit => lo = mid,
            _ => hi = mid - 1,
        }
    }
    lo
}

#[test]
fn a_submit_whose_record_could_not_hold_its_outcome_is_refused_and_stores_nothing() {
    let limit = 100_000;
    let mut h = with(Limits { record_bytes: limit, ..Limits::default() });
    let final_task = |command: String| TaskSpec { final_output: true, ..TaskSpec::shell("l", command) };
    let fits = command_filling("alice", limit, final_task);
    assert!(fits > 1000 && fits < limit - MAX_FINAL_OUTPUT_BYTES, "{fits}");

    // One byte over: refused with the sizes, nothing persisted, no number used.
    let (fx, reply) = try_submit(&mut h, "alice", final_task("x".repeat(fits + 1)));
    let Err(ApiError::RecordTooLarge { size, max, .. }) = &reply else { panic!("{reply:?}") };
    assert_eq!((*size, *max), (limit as u64 + 1, limit as u64));
    assert!(reply.as_ref().unwrap_err().to_string().contains("nothing was stored"));
    assert_eq!(persists(&fx), 0);

    // Just under: stored as shell-1, and its largest record is what was checked.
    let task = h.submit("alice", final_task("x".repeat(fits)));
    assert_eq!(task.to_string(), "shell-1");
    // The same command without a final output leaves room for far more.
    let streaming = command_filling("alice", limit, |c| TaskSpec::shell("l", c));
    assert!(streaming > fits + MAX_FINAL_OUTPUT_BYTES);

    // The worker's report cannot grow the record past what was checked.
    h.heartbeat("w1", 1);
    let huge = Outcome {
        output: Some("y".repeat(4 * MAX_FINAL_OUTPUT_BYTES).into()),
        ..Outcome::new(Ending::Completed, Some(0), Some("d".repeat(10 * MAX_DETAIL_BYTES)))
    };
    assert_eq!(h.report("w1", &task, 1, ReportEvent::Finished(huge)), ReportAck::Ack);
    let r = h.core.task(&task).unwrap().clone();
    let encoded = tenure_protocol::encode(&crate::record::RegistryEntry::Task(Box::new(r))).unwrap();
    assert!(encoded.len() <= limit, "{} > {limit}", encoded.len());
}

#[test]
fn a_workflow_is_refused_when_one_step_record_would_not_fit() {
    let limit = 40_000;
    let mut h = with(Limits { record_bytes: limit, ..Limits::default() });
    let step = "x".repeat(limit);
    let (fx, reply) = try_submit(&mut h, "s", TaskSpec::workflow("w", ["true".to_owned(), step]));
    let Err(ApiError::RecordTooLarge { what, .. }) = &reply else { panic!("{reply:?}") };
    // The parent's own record is over too (it holds every step): named first.
    assert!(what.contains("workflow") || what.contains("step 2"), "{what}");
    assert_eq!(persists(&fx), 0);
    let small = TaskSpec::workflow("w", ["true".to_owned(), "x".repeat(limit / 4)]);
    let (_, reply) = try_submit(&mut h, "s", small);
    assert!(matches!(reply, Ok(ApiResponse::Submitted { .. })), "{reply:?}");
}

#[test]
fn live_tasks_are_bounded_per_identity_whatever_the_session_label() {
    let mut h = with(Limits { live_tasks: Some(2), ..Limits::default() });
    let a = h.submit("alice/one", TaskSpec::shell("a", "true"));
    h.submit("alice/two", TaskSpec::shell("b", "true"));
    let (fx, reply) = try_submit(&mut h, "alice/three", TaskSpec::shell("c", "true"));
    let Err(e @ ApiError::Quota { identity, limit, current, requested, max }) = &reply else { panic!("{reply:?}") };
    assert_eq!((identity.as_str(), limit.as_str(), *current, *requested, *max), ("alice", "live-tasks", 2, 1, 2));
    assert!(e.to_string().contains("live-tasks holds 2 of 2"), "{e}");
    assert_eq!(persists(&fx), 0);
    // Another identity is not affected, an operator is not exempt.
    h.submit("bob", TaskSpec::shell("d", "true"));
    // Once a task ends there is room again.
    h.heartbeat("w1", 4);
    assert_eq!(h.report("w1", &a, 1, completed()), ReportAck::Ack);
    let t = h.submit("alice/three", TaskSpec::shell("c", "true"));
    assert_eq!(t.number(), 4, "the refused submit used no number");
    // A workflow needs room for itself and its running step.
    let mut h = with(Limits { live_tasks: Some(2), ..Limits::default() });
    h.submit("carol", TaskSpec::shell("a", "true"));
    let (_, reply) = try_submit(&mut h, "carol", TaskSpec::workflow("w", ["true".to_owned()]));
    assert!(matches!(reply, Err(ApiError::Quota { requested: 2, .. })), "{reply:?}");
}

#[test]
fn kept_tasks_are_bounded_until_garbage_collected() {
    let mut h = with(Limits { kept_tasks: Some(2), ..Limits::default() });
    h.heartbeat("w1", 4);
    let a = h.submit("alice", TaskSpec::shell("a", "true"));
    let b = h.submit("alice", TaskSpec::shell("b", "true"));
    for t in [&a, &b] {
        assert_eq!(h.report("w1", t, 1, completed()), ReportAck::Ack);
    }
    // Finished tasks still count while kept.
    let (_, reply) = try_submit(&mut h, "alice", TaskSpec::shell("c", "true"));
    assert!(matches!(&reply, Err(ApiError::Quota { limit, current: 2, .. }) if limit == "kept-tasks"), "{reply:?}");
    // Garbage collection (files first, then the record) makes room.
    h.advance(Duration::from_secs(61));
    let fx = h.input(Input::Tick);
    for e in &fx {
        if let Effect::Cleanup { worker, request } = e {
            let done: CleanupReply = Ok(tenure_protocol::messages::CleanupDone { files: 1, records: 1 });
            h.input(Input::CleanupResult { worker: worker.clone(), request: request.clone(), result: Ok(done) });
        }
    }
    h.advance(Duration::from_secs(6));
    h.input(Input::Tick);
    assert!(h.core.task(&a).is_none(), "collected");
    h.submit("alice", TaskSpec::shell("c", "true"));
}

#[test]
fn final_output_bytes_are_reserved_while_live_and_counted_as_recorded_once_ended() {
    let cap = MAX_FINAL_OUTPUT_BYTES as u64;
    let mut h = with(Limits { output_bytes: Some(2 * cap + 100), ..Limits::default() });
    let final_task = || TaskSpec { final_output: true, ..TaskSpec::shell("f", "echo hi") };
    let a = h.submit("alice", final_task());
    h.submit("alice", final_task());
    let (_, reply) = try_submit(&mut h, "alice", final_task());
    assert!(
        matches!(&reply, Err(ApiError::Quota { limit, current, .. }) if limit == "output-bytes" && *current == 2 * cap),
        "{reply:?}"
    );
    // A streaming task keeps no output in the registry: not counted.
    h.submit("alice", TaskSpec::shell("s", "true"));
    // The first ends with 3 bytes of output: its reservation is released.
    h.heartbeat("w1", 4);
    let done = Outcome { output: Some("hi\n".into()), ..Outcome::new(Ending::Completed, Some(0), None) };
    assert_eq!(h.report("w1", &a, 1, ReportEvent::Finished(done)), ReportAck::Ack);
    h.submit("alice", final_task());
}

#[test]
fn a_full_registry_refuses_new_tasks_and_lets_running_ones_finish() {
    let max = 100 << 20;
    let mut h = with(Limits { registry_bytes: max, ..Limits::default() });
    h.heartbeat("w1", 4);
    let running = h.submit("alice", TaskSpec::shell("a", "sleep 1"));
    h.report("w1", &running, 1, ReportEvent::Started { pid: 9 });
    h.input(Input::RegistryUsage { bytes: max - max / 20 });
    let (fx, reply) = try_submit(&mut h, "bob", TaskSpec::shell("b", "true"));
    let Err(e @ ApiError::RegistryFull { used, .. }) = &reply else { panic!("{reply:?}") };
    assert_eq!(*used, max - max / 20);
    assert!(e.to_string().contains("registry is full"));
    assert_eq!(persists(&fx), 0);
    assert_eq!(h.report("w1", &running, 1, completed()), ReportAck::Ack);
    assert_eq!(h.status(&running), Status::Completed);
    h.input(Input::RegistryUsage { bytes: 1 << 20 });
    h.submit("bob", TaskSpec::shell("b", "true"));
}

#[test]
fn a_record_that_could_not_be_stored_leaves_nothing_behind() {
    let mut h = with(Limits { live_tasks: Some(1), ..Limits::default() });
    let key = Uuid::new_v4();
    let submit = |key| {
        ApiRequest::Submit(SubmitRequest {
            session: s("alice"),
            idempotency_key: key,
            spec: TaskSpec::shell("a", "true"),
        })
    };
    let (_, reply) = h.api(submit(key));
    let Some(Ok(ApiResponse::Submitted { task, .. })) = reply else { panic!("{reply:?}") };
    let (_, waited) = h.api(ApiRequest::Wait {
        session: s("alice"),
        task: task.clone(),
        timeout_ms: 5000,
        until: tenure_protocol::messages::WaitFor::End,
    });
    assert!(waited.is_none());
    let fx = h.input(Input::PersistFailed { task: task.clone(), reason: "too large".into() });
    assert!(h.core.task(&task).is_none());
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Reply { reply: Err(ApiError::Unavailable(_)), .. })),
        "the waiter hears"
    );
    // Its quota is released and its key forgotten: a retry creates a new task.
    let (_, reply) = h.api(submit(key));
    assert!(matches!(reply, Some(Ok(ApiResponse::Submitted { existing: false, .. }))), "{reply:?}");
    // Nothing is ever granted for the dropped task.
    let fx = h.heartbeat("w1", 4);
    assert!(grants(&fx).iter().all(|(_, g)| g.task != task));
}

#[test]
fn counters_at_their_ends_saturate_or_refuse() {
    let mut h = with(Limits::default());
    h.core.reserve_through(u64::MAX - 2);
    let last = h.submit("alice", TaskSpec::shell("a", "true"));
    assert_eq!(last.number(), u64::MAX - 1, "the last number the allocator can step past");
    let (fx, reply) = try_submit(&mut h, "alice", TaskSpec::shell("b", "true"));
    assert!(matches!(&reply, Err(ApiError::Unavailable(m)) if m.contains("exhausted")), "{reply:?}");
    assert_eq!(persists(&fx), 0);
    // A matched line at the last offset does not wrap the offset.
    let mut h = with(Limits::default());
    h.heartbeat("w1", 4);
    let spec = TaskSpec { kind: Kind::monitor(), pattern: Some("x".into()), ..TaskSpec::shell("m", "tail -f x") };
    let fx = h.input(Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w("w1"),
        instance: Uuid::nil(),
        slots: 4,
        kinds: vec![Kind::shell(), Kind::monitor()],
        epoch_seen: Epoch(3),
        attempts: Vec::new(),
        sidecar: Default::default(),
        replaces: None,
        incarnation: Some(Uuid::from_u128(1000)),
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    }));
    assert!(grants(&fx).is_empty());
    let m = h.submit("alice", spec);
    h.heartbeat("w1", 4);
    let line = MatchedLine::new(u64::MAX, "x");
    assert_eq!(h.report("w1", &m, 1, ReportEvent::Matched(vec![line.clone()])), ReportAck::Ack);
    assert_eq!(h.core.task(&m).unwrap().matched_through, u64::MAX);
    assert_eq!(h.report("w1", &m, 1, ReportEvent::Matched(vec![line])), ReportAck::Ack);
    assert_eq!(h.core.task(&m).unwrap().matches, 1, "no wrap-around repeat");
}

fn forged(worker: &str, epoch: u64) -> Input {
    Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w(worker),
        instance: Uuid::nil(),
        slots: 8,
        kinds: vec![Kind::shell()],
        epoch_seen: Epoch(epoch),
        attempts: Vec::new(),
        sidecar: Default::default(),
        replaces: None,
        incarnation: Some(Uuid::from_u128(1000)),
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    })
}

fn checks(fx: &[Effect]) -> Vec<(Epoch, String)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::CheckEpoch { claimed, by } => Some((*claimed, by.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn an_epoch_nobody_claimed_is_checked_once_a_second_and_never_deposes_the_leader() {
    let mut h = with(Limits::default());
    let fx = h.input(forged("ghost", u64::MAX));
    assert!(!fx.iter().any(|e| matches!(e, Effect::StepDown { .. })), "{fx:?}");
    let asked = checks(&fx);
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].0, Epoch(u64::MAX));
    assert!(asked[0].1.contains("ghost"));
    // A flood of claims while a check is in flight asks nothing more.
    for _ in 0..100 {
        assert!(checks(&h.input(forged("ghost", u64::MAX))).is_empty());
    }
    // The registry's highest claim is ours: ignored, the leader goes on.
    let (claimed, by) = asked[0].clone();
    let fx = h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(3)) });
    assert!(!fx.iter().any(|e| matches!(e, Effect::StepDown { .. })), "{fx:?}");
    assert_eq!(h.core.epoch(), Epoch(3));
    // Nothing is scheduled on the worker that claims it; an honest one runs the task.
    let t = h.submit("alice", TaskSpec::shell("a", "true"));
    assert!(grants(&h.input(Input::Tick)).is_empty(), "not granted to the ghost");
    let fx = h.heartbeat("w1", 1);
    let g = grants(&fx);
    assert_eq!((g.len(), g[0].0.as_str(), &g[0].1.task), (1, "w1", &t));
    // The status view names the worker and its unproven epoch.
    let (_, reply) = h.api(ApiRequest::Status);
    let Some(Ok(ApiResponse::Status(status))) = reply else { panic!("{reply:?}") };
    let ghost = status.workers.iter().find(|x| x.id.as_str() == "ghost").unwrap();
    assert_eq!(ghost.unproven_epoch, Some(Epoch(u64::MAX)));
    assert_eq!(status.workers.iter().find(|x| x.id.as_str() == "w1").unwrap().unproven_epoch, None);
    // A claim found unfounded is read again only now and then.
    let fx = h.input(forged("ghost", u64::MAX));
    assert_eq!(checks(&fx).len() + checks(&h.input(Input::Tick)).len(), 0);
    h.advance(Duration::from_millis(1100));
    assert!(checks(&h.input(Input::Tick)).is_empty());
    h.advance(Duration::from_secs(30));
    assert_eq!(checks(&h.input(Input::Tick)).len(), 1);
    // A worker that heartbeats an epoch the registry knows is scheduled again.
    h.input(forged("ghost", 3));
    let (_, reply) = h.api(ApiRequest::Status);
    let Some(Ok(ApiResponse::Status(status))) = reply else { panic!("{reply:?}") };
    assert!(status.workers.iter().all(|x| x.unproven_epoch.is_none()));
}

#[test]
fn a_worker_that_refuses_with_an_epoch_nobody_claimed_gets_the_task_back_and_nothing_more() {
    let mut h = with(Limits::default());
    let t = h.submit("alice", TaskSpec::shell("a", "true"));
    let (_, grant) = grants(&h.heartbeat("w1", 1)).pop().unwrap();
    let fx = h.input(Input::CommandResult {
        worker: w("w1"),
        command: WorkerCommand::Grant(grant),
        result: Ok(WorkerReply::Refused(Refusal::StaleEpoch { held: Epoch(u64::MAX), offered: Epoch(3) })),
    });
    assert!(!fx.iter().any(|e| matches!(e, Effect::StepDown { .. })));
    assert_eq!(h.status(&t), Status::Queued, "the refused grant is given back");
    let (claimed, by) = checks(&fx).pop().expect("checked");
    h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(3)) });
    h.advance(Duration::from_secs(1));
    assert!(grants(&h.input(Input::Tick)).is_empty(), "not granted to w1 again while it claims the epoch");
    let g = grants(&h.heartbeat("w2", 1));
    assert_eq!((g.len(), g[0].0.as_str()), (1, "w2"));
}

#[test]
fn an_unreadable_registry_claim_is_checked_again_and_deposes_nobody() {
    let mut h = with(Limits::default());
    let (claimed, by) = checks(&h.input(forged("ghost", 9))).pop().unwrap();
    let fx = h.input(Input::EpochChecked { claimed, by, registry: Err("timeout".into()) });
    assert!(!fx.iter().any(|e| matches!(e, Effect::StepDown { .. })));
    h.advance(Duration::from_millis(1100));
    assert_eq!(checks(&h.input(Input::Tick)), vec![(Epoch(9), "worker ghost".to_owned())]);
}

#[test]
fn a_higher_claim_than_one_found_unfounded_is_checked_within_a_second() {
    let mut h = with(Limits::default());
    let (claimed, by) = checks(&h.input(forged("ghost", 9))).pop().unwrap();
    h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(3)) });
    h.advance(Duration::from_millis(1100));
    let (claimed, by) = checks(&h.input(forged("w2", 12))).pop().expect("a new, higher claim is checked");
    let fx = h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(12)) });
    assert!(fx.iter().any(|e| matches!(e, Effect::StepDown { .. })));
}

#[test]
fn a_workflow_whose_step_could_not_be_stored_fails_instead_of_creating_it_again() {
    let mut h = with(Limits::default());
    let flow = h.submit("alice", TaskSpec::workflow("w", ["true".to_owned(), "true".to_owned()]));
    let step = snapshot(&mut h, &flow).steps[0].task.clone().expect("first step created");
    let fx = h.input(Input::PersistFailed { task: step.clone(), reason: "too large".into() });
    assert!(h.core.task(&step).is_none());
    assert_eq!(h.status(&flow), Status::Failed);
    let created = fx.iter().filter(|e| matches!(e, Effect::Persist(r, _) if r.parent.is_some())).count();
    assert_eq!(created, 0, "no step is created again: {fx:?}");
    let detail = snapshot(&mut h, &flow).detail.unwrap_or_default();
    assert!(detail.contains("could not be stored"), "{detail}");
}

/// A task not granted yet reserves room for two more messages: its
/// subject's next or its end's entry in a batch (note a20), up to its
/// largest record and an entry's overhead, and its first grant's, which
/// may share one other tasks keep alive (durability note a13); once
/// granted, the first only, the other released with the next sample of the
/// stream's bytes.
#[test]
fn a_task_reserves_two_records_until_its_first_grant_and_one_until_its_end() {
    let spec = || TaskSpec::shell("a", "sleep 1");
    let bound = crate::limits::size_bound(&spec()) as u64;
    let grant = crate::limits::grant_bound(&spec()) as u64;
    // Room for the first task's record and the two it may add, not for a
    // second task's record on top (a submit costs its record's bound).
    let max = 100 << 20;
    let budget = max - max / 20;
    let mut h = with(Limits { registry_bytes: max, ..Limits::default() });
    let used = budget - 2 * bound - grant / 2;
    h.input(Input::RegistryUsage { bytes: used });
    let first = h.submit("alice", spec());
    assert_eq!(h.status(&first), Status::Queued);
    let (fx, reply) = try_submit(&mut h, "bob", spec());
    assert!(matches!(reply, Err(ApiError::RegistryFull { .. })), "room reserved for the queued one's grant: {reply:?}");
    assert_eq!(persists(&fx), 0);
    // Granted: until the next sample sees what the grant appended, the room
    // it released stays counted; then one record is reserved for it, and a
    // second task fits.
    h.heartbeat("w1", 1);
    assert_eq!(h.status(&first), Status::Leased);
    let (_, reply) = try_submit(&mut h, "bob", spec());
    assert!(matches!(reply, Err(ApiError::RegistryFull { .. })), "before the next sample: {reply:?}");
    h.input(Input::RegistryUsage { bytes: used + grant / 4 });
    let (_, reply) = try_submit(&mut h, "bob", spec());
    assert!(matches!(reply, Ok(ApiResponse::Submitted { .. })), "{reply:?}");
}
