//! The core's flow control: concurrency keys (never past the limit, across
//! a takeover, conflicting limits refused), placement on worker labels,
//! and approvals (held, approved once by someone allowed, killed unrun,
//! kept by a new leader) — and the `blocked` view of each.

use super::*;
use tenure_protocol::placement::{Concurrency, Labels, Placement};

/// A heartbeat of `worker` with `slots`, running `kinds`, labelled `labels`.
fn beat_with(h: &mut Harness, worker: &str, slots: u32, kinds: &[Kind], labels: &[(&str, &str)]) -> Vec<Effect> {
    let Input::Heartbeat(mut hb) = beat(worker, 0, slots, None) else { unreachable!() };
    hb.kinds = kinds.to_vec();
    hb.labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Labels>();
    h.input(Input::Heartbeat(hb))
}

fn keyed(key: &str, limit: Option<u32>) -> TaskSpec {
    let placement = Placement { on: Vec::new(), concurrency: Some(Concurrency { key: key.into(), limit }) };
    TaskSpec { placement: Some(Box::new(placement)), ..TaskSpec::shell("llm", "call-llm") }
}

fn on(constraint: &str) -> TaskSpec {
    let placement = Placement { on: vec![constraint.parse().unwrap()], concurrency: None };
    TaskSpec { placement: Some(Box::new(placement)), ..TaskSpec::shell("gpu", "train") }
}

fn try_submit(h: &mut Harness, session: &str, spec: TaskSpec) -> (Vec<Effect>, ApiReply) {
    let req = SubmitRequest { session: s(session), idempotency_key: Uuid::new_v4(), spec };
    let (fx, reply) = h.api(ApiRequest::Submit(req));
    (fx, reply.expect("a reply"))
}

fn approve(h: &mut Harness, session: &str, task: &TaskId) -> (Vec<Effect>, ApiReply) {
    let (fx, reply) = h.api(ApiRequest::Approve { session: s(session), task: task.clone() });
    (fx, reply.expect("a reply"))
}

fn persists(fx: &[Effect]) -> usize {
    fx.iter().filter(|e| matches!(e, Effect::Persist(..))).count()
}

fn hint_of(h: &mut Harness, task: &TaskId) -> (Status, Option<HintTag>, String) {
    let snap = snapshot(h, task);
    let message = snap.hint.as_ref().map(|h| h.message.clone()).unwrap_or_default();
    (snap.status, snap.hint.map(|h| h.tag), message)
}

/// Twelve tasks on a key with limit 3: three hold a worker, the others show
/// `blocked` naming the holders; each end lets exactly one more start, and
/// an `unknown` holder still counts (its process may run).
#[test]
fn a_key_never_holds_more_than_its_limit_and_the_next_starts_when_one_ends() {
    let mut h = Harness::new();
    h.heartbeat("w1", 20);
    let mut tasks = Vec::new();
    let mut granted = Vec::new();
    for _ in 0..12 {
        let (fx, reply) = try_submit(&mut h, "alice", keyed("llm", Some(3)));
        let Ok(ApiResponse::Submitted { task, .. }) = reply else { panic!("{reply:?}") };
        tasks.push(task);
        granted.extend(grants(&fx));
    }
    assert_eq!(granted.len(), 3, "only the limit is granted");
    assert_eq!(granted.iter().map(|(_, g)| g.task.clone()).collect::<Vec<_>>(), tasks[..3]);
    let (status, tag, message) = hint_of(&mut h, &tasks[3]);
    assert_eq!((status, tag), (Status::Blocked, Some(HintTag::ConcurrencyLimit)));
    assert!(message.contains("\"llm\"") && message.contains(&tasks[0].to_string()), "{message}");
    // A tick or a heartbeat grants nothing more.
    assert!(grants(&h.input(Input::Tick)).is_empty());
    assert!(grants(&h.heartbeat("w1", 20)).is_empty());

    // One ends: exactly one more starts, the next in line.
    let fx = finish(&mut h, "w1", &granted[0].1, Ending::Completed);
    assert_eq!(grants(&fx).iter().map(|(_, g)| g.task.clone()).collect::<Vec<_>>(), [tasks[3].clone()]);
    assert_eq!(snapshot(&mut h, &tasks[3]).status, Status::Leased);

    // One becomes unknown (its machine says the process is gone without an
    // exit status): it may still hold its slot as far as anyone knows.
    let g = &granted[1].1;
    h.report("w1", &g.task, g.attempt.0, ReportEvent::Started { pid: 7 });
    let hint = RecoveryHint { tag: HintTag::MaybeRan, message: "no exit status".into() };
    h.report("w1", &g.task, g.attempt.0, ReportEvent::Lost(hint));
    assert_eq!(h.status(&g.task), Status::Unknown);
    assert!(grants(&h.heartbeat("w1", 20)).is_empty(), "an unknown task still counts against its key");

    // A kill settles it: its place goes to the next.
    h.api(ApiRequest::Kill { session: s("alice"), task: g.task.clone(), reason: None });
    let refusal = LeaseGrant { mark: None, ..g.clone() };
    h.refuse("w1", refusal, Refusal::UnknownAttempt);
    let holding = [Status::Leased, Status::Running, Status::Stopping, Status::Unknown, Status::Paused];
    let held = tasks.iter().filter(|t| holding.contains(&h.status(t))).count();
    assert!(held <= 3, "{held} hold the key");
}

/// A new leader counts the key's holders from the registry: it grants
/// nothing past the limit.
#[test]
fn a_new_leader_counts_the_keys_holders_from_the_registry() {
    let mut old = Harness::new();
    let mut registry = BTreeMap::new();
    persisted(&old.heartbeat("w1", 20), &mut registry);
    for _ in 0..5 {
        let (fx, _) = try_submit(&mut old, "alice", keyed("llm", Some(2)));
        persisted(&fx, &mut registry);
    }
    let running: Vec<TaskId> =
        registry.values().filter(|r| r.life.status == Status::Leased).map(|r| r.id.clone()).collect();
    assert_eq!(running.len(), 2);
    let mut new = take_over(&registry, CoreConfig::default(), 1_000_000);
    let mut fx = new.heartbeat("w1", 20);
    fx.extend(new.input(Input::Tick));
    // The leased ones' grants are sent again; nothing else is granted.
    let fresh: Vec<TaskId> = grants(&fx).into_iter().map(|(_, g)| g.task).filter(|t| !running.contains(t)).collect();
    assert!(fresh.is_empty(), "{fresh:?}");
    let queued: Vec<TaskId> =
        registry.values().filter(|r| r.life.status == Status::Queued).map(|r| r.id.clone()).collect();
    assert_eq!(hint_of(&mut new, &queued[0]).1, Some(HintTag::ConcurrencyLimit));
}

/// The configured limit wins and a different one is refused, as is a
/// limit other than the one the key's live tasks set, or a key with no
/// limit anywhere; a refused submit stores nothing.
#[test]
fn a_conflicting_or_missing_limit_is_refused_and_nothing_is_stored() {
    let cfg = CoreConfig { concurrency_limits: [("llm".to_owned(), 2)].into(), ..CoreConfig::default() };
    let mut h = Harness::with_config(cfg);
    h.heartbeat("w1", 8);
    let (fx, reply) = try_submit(&mut h, "alice", keyed("llm", Some(3)));
    let Err(ApiError::ConcurrencyLimitConflict { in_force: 2, asked: 3, from, .. }) = &reply else {
        panic!("{reply:?}")
    };
    assert!(from.contains("configured"), "{from}");
    assert_eq!(persists(&fx), 0);
    for limit in [None, Some(2)] {
        assert!(try_submit(&mut h, "alice", keyed("llm", limit)).1.is_ok());
    }

    assert!(try_submit(&mut h, "alice", keyed("db", Some(1))).1.is_ok());
    let (fx, reply) = try_submit(&mut h, "bob", keyed("db", Some(4)));
    assert!(matches!(&reply, Err(ApiError::ConcurrencyLimitConflict { in_force: 1, .. })), "{reply:?}");
    assert_eq!(persists(&fx), 0);
    assert!(try_submit(&mut h, "bob", keyed("db", None)).1.is_ok(), "takes the limit in force");

    let (fx, reply) = try_submit(&mut h, "alice", keyed("fresh", None));
    assert!(matches!(&reply, Err(ApiError::InvalidSpec(m)) if m.contains("no limit")), "{reply:?}");
    assert_eq!(persists(&fx), 0);
}

/// A task constrained to labels no live worker has waits `blocked`
/// (naming the constraint and the live workers), and goes to the first
/// worker that joins with them; other tasks still go anywhere.
#[test]
fn a_constrained_task_waits_blocked_for_a_matching_worker() {
    let mut h = Harness::new();
    beat_with(&mut h, "w1", 4, &[Kind::shell()], &[("gpu", "t4")]);
    let (fx, reply) = try_submit(&mut h, "alice", on("gpu=a100"));
    let Ok(ApiResponse::Submitted { task, .. }) = reply else { panic!("{reply:?}") };
    assert!(grants(&fx).is_empty());
    let (status, tag, message) = hint_of(&mut h, &task);
    assert_eq!((status, tag), (Status::Blocked, Some(HintTag::NoMatchingWorker)));
    assert!(message.contains("gpu=a100") && message.contains("w1 (labels gpu=t4; enforces nothing)"), "{message}");
    assert_eq!(h.core.task(&task).map(|r| r.life.status), Some(Status::Queued), "shown, never stored");

    let (fx, _) = try_submit(&mut h, "alice", TaskSpec::shell("any", "true"));
    assert_eq!(grants(&fx).len(), 1, "an unconstrained task goes to w1");

    let fx = beat_with(&mut h, "w2", 4, &[Kind::shell()], &[("gpu", "a100"), ("zone", "eu")]);
    let granted = grants(&fx);
    assert_eq!(granted.len(), 1);
    assert_eq!((granted[0].0.as_str(), &granted[0].1.task), ("w2", &task));
}

/// Held at submit: `blocked` in the registry, never granted; another
/// identity cannot see it to approve it; its owner's approval queues it
/// (persisted) and it starts; a second approval changes nothing.
#[test]
fn a_held_task_starts_only_once_approved_and_an_approval_applies_once() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let (fx, reply) = try_submit(&mut h, "alice", TaskSpec { hold: true, ..TaskSpec::shell("h", "deploy") });
    let Ok(ApiResponse::Submitted { task, .. }) = reply else { panic!("{reply:?}") };
    assert!(grants(&fx).is_empty());
    assert_eq!(h.status(&task), Status::Blocked);
    let (_, tag, message) = hint_of(&mut h, &task);
    assert_eq!(tag, Some(HintTag::AwaitingApproval));
    assert!(message.contains(&format!("tenure approve {task}")) && message.contains("--hold"), "{message}");
    assert!(grants(&h.input(Input::Tick)).is_empty());

    let (fx, reply) = approve(&mut h, "bob", &task);
    assert!(matches!(reply, Err(ApiError::NotFound(_))), "{reply:?}");
    assert_eq!(persists(&fx), 0);

    let (fx, reply) = approve(&mut h, "alice", &task);
    assert!(matches!(&reply, Ok(ApiResponse::Snapshot(s)) if s.status == Status::Queued), "{reply:?}");
    // Approved and leased at once: one append holds both, before the grant.
    let persisted = fx.iter().position(|e| matches!(e, Effect::Persist(r, _) if r.life.status == Status::Leased));
    let granted = fx.iter().position(|e| matches!(e, Effect::Command { command: WorkerCommand::Grant(_), .. }));
    assert!(matches!((persisted, granted), (Some(p), Some(g)) if p < g), "approval stored before the grant: {fx:?}");

    let (fx, reply) = approve(&mut h, "alice", &task);
    assert!(matches!(reply, Err(ApiError::NotAwaitingApproval { .. })), "granted already: {reply:?}");
    assert_eq!(persists(&fx), 0);
    let plain = h.submit("alice", TaskSpec::shell("p", "true"));
    assert!(matches!(approve(&mut h, "alice", &plain).1, Err(ApiError::NotAwaitingApproval { .. })));
}

/// The policy holds non-idempotent tasks of its kinds and commands matching
/// its patterns; under `approver = operator` the owner's approval is
/// refused with the policy and the way on, and an operator's is taken.
#[test]
fn the_policy_holds_what_it_names_and_under_operator_only_an_operator_approves() {
    let approval = ApprovalPolicy {
        kinds: vec![Kind::agent()],
        commands: vec![regex::Regex::new("^git push").unwrap()],
        approver: Approver::Operator,
    };
    let cfg = CoreConfig { approval, operators: vec!["ops".into()], ..CoreConfig::default() };
    let mut h = Harness::with_config(cfg);
    beat_with(&mut h, "w1", 8, &[Kind::shell(), Kind::agent()], &[]);
    let agent = h.submit("alice", TaskSpec { kind: Kind::agent(), ..TaskSpec::shell("a", "claude") });
    let safe = h.submit("alice", TaskSpec { kind: Kind::agent(), idempotent: true, ..TaskSpec::shell("a", "lint") });
    let push = h.submit("alice", TaskSpec::shell("p", "git push origin main"));
    let other = h.submit("alice", TaskSpec::shell("o", "git status"));
    assert_eq!([agent.clone(), push.clone()].map(|t| h.status(&t)), [Status::Blocked; 2]);
    assert!([safe, other].iter().all(|t| h.status(t) == Status::Leased));
    let (_, _, message) = hint_of(&mut h, &push);
    assert!(message.contains("^git push") && message.contains("Only an operator (ops)"), "{message}");

    let (fx, reply) = approve(&mut h, "alice", &agent);
    let Err(ApiError::ApprovalRefused { reason, .. }) = &reply else { panic!("{reply:?}") };
    assert!(reason.contains("agent tasks that are not idempotent") && reason.contains("tenure kill"), "{reason}");
    assert_eq!((persists(&fx), h.status(&agent)), (0, Status::Blocked));

    let (fx, reply) = approve(&mut h, "ops/on-call", &agent);
    assert!(matches!(&reply, Ok(ApiResponse::Snapshot(s)) if s.status == Status::Queued), "{reply:?}");
    assert_eq!(grants(&fx).len(), 1);
}

/// A held task killed ends without ever being granted; one still held is
/// held by a new leader too; a held workflow begins its steps only once
/// approved.
#[test]
fn held_tasks_are_killed_unrun_kept_held_by_a_new_leader_and_workflows_wait() {
    let mut old = Harness::new();
    let mut registry = BTreeMap::new();
    persisted(&old.heartbeat("w1", 4), &mut registry);
    let held = |label: &str| TaskSpec { hold: true, ..TaskSpec::shell(label, "deploy") };
    let doomed = old.submit("alice", held("doomed"));
    let kept = old.submit("alice", held("kept"));
    let (fx, reply) =
        old.api(ApiRequest::Kill { session: s("alice"), task: doomed.clone(), reason: Some("wrong branch".into()) });
    persisted(&fx, &mut registry);
    let Some(Ok(ApiResponse::Kill { snapshot, .. })) = reply else { panic!("{reply:?}") };
    assert_eq!((snapshot.status, snapshot.attempt), (Status::Killed, Attempt(0)));
    assert!(snapshot.detail.as_deref().is_some_and(|d| d.contains("never ran")));
    assert_eq!(snapshot.kill_reason.as_deref(), Some("wrong branch"));
    registry.insert(kept.clone(), old.core.task(&kept).unwrap().clone());

    let mut new = take_over(&registry, CoreConfig::default(), 1_000_000);
    let mut fx = new.heartbeat("w1", 4);
    fx.extend(new.input(Input::Tick));
    assert!(grants(&fx).is_empty());
    assert_eq!(new.status(&kept), Status::Blocked);
    let (_, reply) = approve(&mut new, "alice", &kept);
    assert!(reply.is_ok(), "{reply:?}");

    let flow = TaskSpec { hold: true, ..TaskSpec::workflow("wf", ["make".to_string(), "make test".to_string()]) };
    let (workflow, granted) = start_flow(&mut new, flow);
    assert!(granted.is_empty(), "no step before the approval");
    assert_eq!(new.status(&workflow), Status::Blocked);
    let (fx, reply) = approve(&mut new, "alice", &workflow);
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(new.status(&workflow), Status::Running);
    assert_eq!(grants(&fx).len(), 1, "its first step starts");

    // A held workflow killed ends with none of its steps ever created.
    let flow = TaskSpec { hold: true, ..TaskSpec::workflow("wf2", ["make".to_string()]) };
    let (doomed, _) = start_flow(&mut new, flow);
    let (fx, reply) = new.api(ApiRequest::Kill { session: s("alice"), task: doomed.clone(), reason: None });
    assert!(matches!(reply, Some(Ok(ApiResponse::Kill { .. }))), "{reply:?}");
    assert_eq!(new.status(&doomed), Status::Killed);
    assert!(grants(&fx).is_empty());
    let mut fx = new.input(Input::Tick);
    fx.extend(new.heartbeat("w1", 4));
    assert!(!fx
        .iter()
        .any(|e| matches!(e, Effect::Persist(r, _) if r.parent.as_ref().is_some_and(|p| p.workflow == doomed))));
    assert_eq!(super::snapshot(&mut new, &doomed).steps.iter().filter(|st| st.task.is_some()).count(), 0);
}

/// A running task its worker says waits for input shows `waiting` (never
/// stored) and `running` again once the worker says it reads no more; the
/// same claim about another attempt, from another worker, or of a task not
/// running is not believed.
#[test]
fn a_running_task_shows_waiting_while_its_worker_says_so_and_only_then() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let task = h.submit("alice", TaskSpec::shell("a", "read x"));
    let beat_waiting = |h: &mut Harness, worker: &str, attempt: u32, waiting: bool| {
        let Input::Heartbeat(mut hb) = beat(worker, 0, 4, None) else { unreachable!() };
        hb.attempts = vec![HeldAttempt { task: task.clone(), attempt: Attempt(attempt), paused: false, waiting }];
        h.input(Input::Heartbeat(hb))
    };
    beat_waiting(&mut h, "w1", 1, true);
    assert_eq!(snapshot(&mut h, &task).status, Status::Leased, "not running yet: not waiting");
    h.report("w1", &task, 1, ReportEvent::Started { pid: 7 });
    for (worker, attempt) in [("w2", 1), ("w1", 2)] {
        beat_waiting(&mut h, worker, attempt, true);
        assert_eq!(snapshot(&mut h, &task).status, Status::Running, "{worker} attempt {attempt}");
    }
    let fx = beat_waiting(&mut h, "w1", 1, true);
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "shown, never stored");
    assert_eq!(snapshot(&mut h, &task).status, Status::Waiting);
    assert_eq!(h.status(&task), Status::Running);
    beat_waiting(&mut h, "w1", 1, false);
    assert_eq!(snapshot(&mut h, &task).status, Status::Running);
    beat_waiting(&mut h, "w1", 1, true);
    h.api(ApiRequest::Kill { session: s("alice"), task: task.clone(), reason: None });
    assert_eq!(snapshot(&mut h, &task).status, Status::Stopping, "a kill ends the wait");
}

/// A task with resource limits goes only to a worker that enforces them;
/// while none of the live ones does, it shows `blocked` naming the limits.
#[test]
fn a_task_with_limits_waits_for_a_worker_that_enforces_them() {
    use tenure_protocol::resources::{ResourceLimits, ResourceSupport};
    let mut h = Harness::new();
    beat_with(&mut h, "w1", 4, &[Kind::shell()], &[]);
    let limits = ResourceLimits { memory_bytes: Some(64 << 20), cpu_millis: None, pids: Some(10) };
    let spec = TaskSpec { resources: Some(Box::new(limits)), ..TaskSpec::shell("m", "build") };
    let (fx, reply) = try_submit(&mut h, "alice", spec);
    let Ok(ApiResponse::Submitted { task, .. }) = reply else { panic!("{reply:?}") };
    assert!(grants(&fx).is_empty(), "w1 enforces nothing");
    let (status, tag, message) = hint_of(&mut h, &task);
    assert_eq!((status, tag), (Status::Blocked, Some(HintTag::NoMatchingWorker)));
    assert!(message.contains("enforces its memory, pids limit") && message.contains("enforces nothing"), "{message}");

    let Input::Heartbeat(mut hb) = beat("w2", 0, 4, None) else { unreachable!() };
    hb.enforces = ResourceSupport { tracking: true, memory: true, cpu: false, pids: true };
    let granted = grants(&h.input(Input::Heartbeat(hb)));
    assert_eq!(granted.iter().map(|(w, g)| (w.as_str(), &g.task)).collect::<Vec<_>>(), [("w2", &task)]);
}
