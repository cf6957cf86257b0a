//! Batch submits: every task judged before any is created (a refusal names
//! its place and stores nothing), quotas and concurrency limits counted
//! across the batch, keys per task (a retried batch creates only what is
//! missing), ids in order, and the one reply after every append.

use super::*;
use crate::limits::Limits;
use tenure_protocol::messages::{BatchTask, SubmitBatch, Submitted, MAX_BATCH_TASKS};
use tenure_protocol::placement::{Concurrency, Placement};
use tenure_protocol::StepSpec;

fn task(spec: TaskSpec) -> BatchTask {
    BatchTask { idempotency_key: Uuid::new_v4(), spec }
}

fn noops(n: usize) -> Vec<BatchTask> {
    (0..n).map(|i| task(TaskSpec::shell(format!("t{i}"), "true"))).collect()
}

fn batch(h: &mut Harness, session: &str, tasks: Vec<BatchTask>) -> (Vec<Effect>, ApiReply) {
    let (fx, reply) = h.api(ApiRequest::SubmitBatch(SubmitBatch { session: s(session), tasks }));
    (fx, reply.expect("a reply"))
}

fn created(reply: ApiReply) -> Vec<Submitted> {
    match reply {
        Ok(ApiResponse::SubmittedBatch(done)) => done,
        other => panic!("batch refused: {other:?}"),
    }
}

/// The refusal's place and inner error, after checking nothing was created.
fn refused(h: &Harness, fx: &[Effect], reply: ApiReply) -> (u32, ApiError) {
    refused_after(h, fx, reply, 0)
}

fn keyed(key: &str, limit: Option<u32>) -> TaskSpec {
    let placement = Placement { on: Vec::new(), concurrency: Some(Concurrency { key: key.into(), limit }) };
    TaskSpec { placement: Some(Box::new(placement)), ..TaskSpec::shell("llm", "call-llm") }
}

#[test]
fn a_batch_creates_its_tasks_in_order_and_replies_after_every_append() {
    let mut h = Harness::new();
    h.submit("alice", TaskSpec::shell("before", "true"));
    let (fx, reply) = batch(&mut h, "alice", noops(3));
    let done = created(reply);
    let numbers: Vec<u64> = done.iter().map(|d| d.task.number()).collect();
    assert_eq!(numbers, [2, 3, 4]);
    assert!(done.iter().all(|d| !d.existing));
    let reply_at = fx.iter().position(|e| matches!(e, Effect::Reply { .. })).expect("a reply");
    let persisted: Vec<u64> = fx[..reply_at]
        .iter()
        .filter_map(|e| match e {
            Effect::Persist(r, _) => Some(r.id.number()),
            _ => None,
        })
        .collect();
    assert_eq!(persisted, [2, 3, 4], "every task's append comes before the one reply: {fx:?}");
    assert!(done.iter().all(|d| h.status(&d.task) == Status::Queued));
}

#[test]
fn one_invalid_task_refuses_the_whole_batch_and_names_its_place() {
    let mut h = Harness::new();
    let mut tasks = noops(4);
    tasks[2].spec.kind = "no-such-kind".parse().unwrap();
    let (fx, reply) = batch(&mut h, "alice", tasks);
    let (index, error) = refused(&h, &fx, reply);
    assert_eq!(index, 2);
    assert!(matches!(error, ApiError::UnknownKind { .. }), "{error:?}");

    // Nothing was numbered either: the next task is number 1.
    assert_eq!(h.submit("alice", TaskSpec::shell("a", "true")).number(), 1);
}

#[test]
fn quotas_count_the_tasks_before_it_in_the_batch() {
    let cfg = CoreConfig { limits: Limits { live_tasks: Some(3), ..Limits::default() }, ..CoreConfig::default() };
    let mut h = Harness::with_config(cfg);
    h.submit("alice", TaskSpec::shell("a", "sleep 9"));
    let (fx, reply) = batch(&mut h, "alice", noops(3));
    let (index, error) = refused_after(&h, &fx, reply, 1);
    assert_eq!(index, 2, "alice holds 1, the batch's first two fit, its third does not");
    assert!(matches!(error, ApiError::Quota { ref limit, current: 3, .. } if limit == "live-tasks"), "{error:?}");
    // Another identity's quota is its own.
    assert_eq!(created(batch(&mut h, "bob", noops(3)).1).len(), 3);
}

/// [`refused`] when `before` tasks existed already.
fn refused_after(h: &Harness, fx: &[Effect], reply: ApiReply, before: u64) -> (u32, ApiError) {
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "a refused batch stores nothing: {fx:?}");
    assert_eq!(h.core.counts().values().sum::<u64>(), before);
    match reply {
        Err(ApiError::InBatch { index, error }) => (index, *error),
        other => panic!("expected a refusal in the batch: {other:?}"),
    }
}

#[test]
fn a_concurrency_limit_set_earlier_in_the_batch_is_in_force_for_its_later_tasks() {
    let mut h = Harness::new();
    // The first task sets the key's limit; a second without one takes it.
    let ok = vec![task(keyed("llm", Some(2))), task(keyed("llm", None))];
    assert_eq!(created(batch(&mut h, "alice", ok).1).len(), 2);

    let mut h = Harness::new();
    let conflicting = vec![task(keyed("gpu", Some(2))), task(keyed("gpu", Some(5)))];
    let (fx, reply) = batch(&mut h, "alice", conflicting);
    let (index, error) = refused(&h, &fx, reply);
    assert_eq!(index, 1);
    assert!(matches!(error, ApiError::ConcurrencyLimitConflict { in_force: 2, asked: 5, .. }), "{error:?}");

    let mut h = Harness::new();
    let (fx, reply) = batch(&mut h, "alice", vec![task(keyed("none", None))]);
    assert!(matches!(refused(&h, &fx, reply), (0, ApiError::InvalidSpec(_))));
}

#[test]
fn a_retried_batch_creates_only_the_tasks_it_has_not_created() {
    let mut h = Harness::new();
    let tasks = noops(3);
    // A leader stored the first two of the batch before the reply was lost:
    // here, they were submitted alone with the same keys.
    for t in &tasks[..2] {
        let req = SubmitRequest { session: s("alice"), idempotency_key: t.idempotency_key, spec: t.spec.clone() };
        h.api(ApiRequest::Submit(req));
    }
    let (fx, reply) = batch(&mut h, "alice", tasks.clone());
    let done = created(reply);
    let existing: Vec<bool> = done.iter().map(|d| d.existing).collect();
    assert_eq!(existing, [true, true, false]);
    assert_eq!(fx.iter().filter(|e| matches!(e, Effect::Persist(..))).count(), 1);

    // Sent once more: every task is its earlier one, nothing is stored.
    let (fx, again) = batch(&mut h, "alice", tasks);
    assert_eq!(created(again), done.iter().map(|d| Submitted { existing: true, ..d.clone() }).collect::<Vec<_>>());
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    // Keys are per owner: bob's batch with alice's keys is bob's own.
    let bobs = batch(&mut h, "bob", noops(1)).1;
    assert!(created(bobs).iter().all(|d| !d.existing));
}

#[test]
fn a_batch_that_is_empty_too_large_or_repeats_a_key_is_refused() {
    let mut h = Harness::new();
    let (_, reply) = batch(&mut h, "alice", Vec::new());
    assert!(matches!(reply, Err(ApiError::InvalidRequest(_))), "{reply:?}");
    let (_, reply) = batch(&mut h, "alice", noops(MAX_BATCH_TASKS + 1));
    assert!(matches!(reply, Err(ApiError::InvalidRequest(_))), "{reply:?}");

    let mut tasks = noops(3);
    tasks[2].idempotency_key = tasks[0].idempotency_key;
    let (fx, reply) = batch(&mut h, "alice", tasks);
    assert!(matches!(refused(&h, &fx, reply), (2, ApiError::InvalidRequest(_))));

    // The largest batch is taken.
    assert_eq!(created(batch(&mut h, "alice", noops(MAX_BATCH_TASKS)).1).len(), MAX_BATCH_TASKS);
}

#[test]
fn a_workflow_in_a_batch_begins_its_steps() {
    let mut h = Harness::new();
    let flow = TaskSpec {
        kind: Kind::workflow(),
        steps: vec![StepSpec { kind: Kind::shell(), command: "true".into() }],
        ..TaskSpec::shell("flow", "")
    };
    let done = created(batch(&mut h, "alice", vec![task(flow), task(TaskSpec::shell("b", "true"))]).1);
    assert_eq!(h.status(&done[0].task), Status::Running, "the workflow runs its steps");
    assert_eq!(done[1].task.number(), 3, "its first step took number 2");
}

/// Every append of `fx` as (task number, status, version), in order.
fn versions(fx: &[Effect]) -> Vec<(u64, Status, Version)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Persist(r, v) => Some((r.id.number(), r.life.status, *v)),
            _ => None,
        })
        .collect()
}

/// Only two versions of a task may share a registry message (durability
/// notes a12, a13): its first record and its first grant, once each. A
/// second grant, a start, an end, a task's record leased at once (still its
/// first record) are told apart, and the first grants of one scheduling
/// pass stand one after the other, before the grants that follow them.
#[test]
fn first_records_and_first_grants_are_told_from_every_other_version() {
    use Status::{Leased, Queued};
    use Version::{First, FirstGrant, Later};
    let mut h = Harness::new();
    let (fx, reply) = batch(&mut h, "alice", noops(3));
    let ids: Vec<TaskId> = created(reply).into_iter().map(|d| d.task).collect();
    assert_eq!(versions(&fx), [(1, Queued, First), (2, Queued, First), (3, Queued, First)]);

    let fx = h.heartbeat("w1", 2);
    assert_eq!(versions(&fx), [(1, Leased, FirstGrant), (2, Leased, FirstGrant)]);
    let last_append = fx.iter().rposition(|e| matches!(e, Effect::Persist(..))).expect("appends");
    let first_grant = fx.iter().position(|e| matches!(e, Effect::Grants { .. } | Effect::Command { .. }));
    assert!(first_grant.is_some_and(|g| g > last_append), "the appends stand together: {fx:?}");

    // Refused: queued again (not a first grant), then granted as attempt 2.
    let grant = grants(&fx).into_iter().find(|(_, g)| g.task.number() == 1).expect("a grant").1;
    let fx = h.refuse("w1", grant, Refusal::NoSlot);
    assert_eq!(versions(&fx), [(1, Queued, Later)]);
    h.advance(Duration::from_millis(600));
    let fx = h.heartbeat("w1", 3);
    assert_eq!(versions(&fx), [(1, Leased, Later), (3, Leased, FirstGrant)], "attempt 2 is not a first grant");

    // A start and an end are later versions; a task leased at its submit
    // is one append, its first record.
    let started = h.report_effects("w1", &ids[1], 1, ReportEvent::Started { pid: 7 });
    assert_eq!(versions(&started), [(2, Status::Running, Later)]);
    let end = versions(&h.report_effects("w1", &ids[1], 1, completed()));
    assert_eq!(end[0], (2, Status::Completed, Later));
    assert!(end[1..].iter().all(|v| v.2 == Later), "{end:?}");
    let (fx, _) = h.api(ApiRequest::Submit(SubmitRequest {
        session: s("alice"),
        idempotency_key: Uuid::new_v4(),
        spec: TaskSpec::shell("now", "true"),
    }));
    assert_eq!(versions(&fx), [(4, Leased, First)]);
}

/// An end shares a registry message (durability note a20) only when none of
/// its task's records went on its subject as a later version: the ends of
/// one batch of reports stand in a row, with their notices after every
/// append of the input. A task that started (a `Later` record), a monitor
/// (its record may grow after its end), a task loaded by a new leader, and
/// every record after an end, go on their subjects.
#[test]
fn an_end_shares_a_message_only_when_nothing_of_its_task_went_on_its_subject() {
    use Status::Completed;
    use Version::{End, Later};
    let mut h = Harness::new();
    let ids: Vec<TaskId> = created(batch(&mut h, "alice", noops(3)).1).into_iter().map(|d| d.task).collect();
    h.heartbeat("w1", 3);
    let report = |task: &TaskId, event| report_of("w1", task, 1, event);
    let reports = vec![report(&ids[0], completed()), report(&ids[1], completed())];
    let fx = h.input(Input::Reports { reply_to: Some("acks".into()), reports });
    assert_eq!(versions(&fx), [(1, Completed, End), (2, Completed, End)]);
    let last_append = fx.iter().rposition(|e| matches!(e, Effect::Persist(..))).expect("appends");
    let notices: Vec<usize> =
        fx.iter().enumerate().filter(|(_, e)| matches!(e, Effect::Notify(_))).map(|(i, _)| i).collect();
    assert_eq!(notices.len(), 2, "{fx:?}");
    assert!(notices.iter().all(|&i| i > last_append), "the notices follow every append: {fx:?}");
    let told: Vec<u64> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Notify(n) => match &**n {
                Notice::Ended(s) => Some(s.id.number()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert_eq!(told, [1, 2], "in their order");
    assert!(fx.iter().any(|e| matches!(e, Effect::Acks { .. })), "the reports are answered: {fx:?}");

    // Started first: its end goes on its subject, over its start.
    h.report_effects("w1", &ids[2], 1, ReportEvent::Started { pid: 7 });
    assert_eq!(versions(&h.report_effects("w1", &ids[2], 1, completed())), [(3, Completed, Later)]);
    // After an end, every record goes on the subject.
    let (fx, _) = h.api(ApiRequest::MarkReported { session: s("alice"), task: ids[0].clone() });
    assert_eq!(versions(&fx), [(1, Completed, Later)], "reported by its owner");

    // A started and ended task in one input: one append, its end, shared.
    let alone = h.submit("alice", TaskSpec::shell("alone", "true"));
    h.heartbeat("w1", 1);
    let reports = vec![report(&alone, ReportEvent::Started { pid: 8 }), report(&alone, completed())];
    let fx = h.input(Input::Reports { reply_to: Some("acks".into()), reports });
    assert_eq!(versions(&fx), [(alone.number(), Completed, End)]);

    // A monitor's record may grow after its end: never shared.
    let Input::Heartbeat(mut both) = beat("w1", 0, 1, None) else { unreachable!() };
    both.kinds.push(Kind::monitor());
    h.input(Input::Heartbeat(both));
    let spec = TaskSpec { kind: Kind::monitor(), pattern: Some("x".into()), ..TaskSpec::shell("m", "true") };
    let monitor = h.submit("alice", spec);
    assert_eq!(versions(&h.report_effects("w1", &monitor, 1, completed())), [(monitor.number(), Completed, Later)]);

    // A new leader knows nothing of where a loaded task's records went.
    let loaded = h.submit("alice", TaskSpec::shell("loaded", "true"));
    h.heartbeat("w1", 1);
    let records: Vec<TaskRecord> = h.core.tasks.values().cloned().collect();
    let mut next = Harness { core: Core::new(CoreConfig::default(), Epoch(3), records, h.now), now: h.now };
    next.advance(CoreConfig::default().worker_ttl);
    next.heartbeat("w1", 1);
    assert_eq!(versions(&next.report_effects("w1", &loaded, 1, completed())), [(loaded.number(), Completed, Later)]);
}
