//! The core's resumes: values captured from matched lines, a lost attempt
//! resumed only on proof that its process is gone (the worker saw it end,
//! the machine restarted, a replaced store on a new boot), on the machine
//! that lost it unless the task may resume anywhere, with its resume command
//! and the input kept meanwhile — handed to one attempt only.

use super::*;
use tenure_protocol::messages::MatchedLine;
use tenure_protocol::resume::{ResumeSpec, MAX_PENDING_MESSAGE_BYTES};

fn agent(anywhere: bool) -> TaskSpec {
    TaskSpec {
        kind: Kind::agent(),
        resume: Some(Box::new(ResumeSpec {
            command: "agent --resume {session}".into(),
            captures: vec![r"session: (\S+)".into()],
            anywhere,
        })),
        ..TaskSpec::shell("a", "agent --new")
    }
}

/// A heartbeat of an agent worker on boot `boot`, with store `incarnation`.
fn agent_beat(h: &mut Harness, worker: &str, boot: &str, incarnation: u128) -> Vec<Effect> {
    // w2 always has the most free slots: it is the first choice of any task
    // that may run there.
    let slots = if worker == "w2" { 16 } else { 4 };
    let Input::Heartbeat(mut hb) = beat(worker, 0, slots, None) else { unreachable!() };
    hb.kinds = vec![Kind::agent()];
    hb.boot = Some(boot.into());
    hb.incarnation = Some(Uuid::from_u128(incarnation));
    h.input(Input::Heartbeat(hb))
}

fn keep(h: &mut Harness, who: &str, task: &TaskId, message: &str) -> (Vec<Effect>, Option<ApiReply>) {
    h.api(ApiRequest::KeepInput { session: s(who), task: task.clone(), message: message.into() })
}

/// Submitted, granted to w1, started, and its session captured.
fn running_agent(h: &mut Harness, anywhere: bool) -> TaskId {
    agent_beat(h, "w1", "b1", 1000);
    let t = h.submit("alice", agent(anywhere));
    assert_eq!(h.core.task(&t).unwrap().life.worker.as_ref().map(|w| w.as_str()), Some("w1"));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 7 });
    let lines = vec![MatchedLine::new(0, "starting"), MatchedLine::new(9, "session: abc-1")];
    assert_eq!(h.report("w1", &t, 1, ReportEvent::Matched(lines)), ReportAck::Ack);
    t
}

fn gone() -> RecoveryHint {
    RecoveryHint { tag: HintTag::MaybeRan, message: "the task's shim died; process group 7 is gone".into() }
}

fn resume_of(snap: &TaskSnapshot) -> &tenure_protocol::resume::ResumeView {
    snap.agent_resume.as_ref().expect("an agent with a resume command shows it")
}

#[test]
fn a_gone_attempt_resumes_with_its_captured_values_on_the_machine_that_lost_it() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    let snap = snapshot(&mut h, &t);
    assert_eq!(resume_of(&snap).captured.get("session").map(String::as_str), Some("abc-1"));
    // A repeated batch changes nothing; a later line replaces the value.
    h.report("w1", &t, 1, ReportEvent::Matched(vec![MatchedLine::new(9, "session: stale")]));
    assert_eq!(resume_of(&snapshot(&mut h, &t)).captured["session"], "abc-1");

    // The worker saw the shim die and ended what was left: proof. w2 has
    // the most room, but the session lives on w1: resumed there at once.
    agent_beat(&mut h, "w2", "b9", 2000);
    let fx = h.report_effects("w1", &t, 1, ReportEvent::Gone(gone()));
    let g = grants(&fx);
    assert_eq!(g.len(), 1, "{fx:?}");
    assert_eq!((g[0].0.as_str(), g[0].1.attempt), ("w1", Attempt(2)));
    assert_eq!(g[0].1.spec.command, "agent --resume 'abc-1'");
    assert!(g[0].1.input.is_empty());
    let snap = snapshot(&mut h, &t);
    assert_eq!((snap.status, snap.attempt), (Status::Leased, Attempt(2)));
    let r = resume_of(&snap);
    assert_eq!((r.resumes, r.machine.as_ref().map(|m| m.as_str())), (1, Some("w1")));
    let ended = snap.attempts.last().expect("the lost attempt is in the history");
    assert_eq!(ended.attempt, Attempt(1));
    assert_eq!(ended.resumed.as_ref().and_then(|v| v.get("session")).map(String::as_str), Some("abc-1"));
    assert!(!ended.retried);
    // Late reports of the resumed attempt change nothing.
    h.report("w1", &t, 2, ReportEvent::Started { pid: 8 });
    assert_eq!(h.report("w1", &t, 1, completed()), ReportAck::StaleAt { epoch: Epoch(3) });
    assert_eq!(h.status(&t), Status::Running);
}

#[test]
fn a_queued_resume_whose_machine_is_gone_shows_blocked_on_its_machine() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    let asked = lose_w1(&mut h);
    answer(&mut h, &asked[0], Ok(Ok(AttemptEvidence::MachineRestarted)));
    let snap = snapshot(&mut h, &t);
    assert_eq!(snap.status, Status::Blocked);
    let hint = snap.hint.expect("says why");
    assert_eq!(hint.tag, HintTag::NoMatchingWorker);
    assert!(hint.message.contains("only on w1"), "{}", hint.message);
}

/// Unreachable is no proof: `unknown`, and input is kept; the machine's
/// word that it restarted resumes it, and the kept input goes with the
/// next grant only.
#[test]
fn input_kept_while_unknown_reaches_the_resumed_attempt_once() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    // Not while it runs: input then goes to its sidecar.
    let (_, reply) = keep(&mut h, "alice", &t, "early\n");
    assert!(matches!(reply, Some(Err(ApiError::NotRunning { .. }))), "{reply:?}");
    let asked = lose_w1(&mut h);
    answer(&mut h, &asked[0], Err("timed out".into()));
    let snap = snapshot(&mut h, &t);
    assert_eq!(snap.status, Status::Unknown);
    let how = snap.resume.as_ref().expect("says how it goes on");
    assert!(how.resumable && how.how.contains("resumed by itself"), "{how:?}");

    let (fx, reply) = keep(&mut h, "alice", &t, "hello\n");
    assert!(matches!(reply, Some(Ok(ApiResponse::Snapshot(ref s))) if resume_of(s).pending_input == 1), "{reply:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Persist(..))), "kept durably before the answer");
    // Another owner's task, an oversized message: refused, nothing kept.
    for (who, message) in [("bob", "x\n".to_owned()), ("alice", "y".repeat(MAX_PENDING_MESSAGE_BYTES + 1))] {
        let (fx, reply) = keep(&mut h, who, &t, &message);
        assert!(matches!(reply, Some(Err(_))), "{who}: {reply:?}");
        assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))));
    }
    assert_eq!(resume_of(&snapshot(&mut h, &t)).pending_input, 1);

    // The machine answers at last: it restarted, so the process is gone.
    let mut asked = Vec::new();
    for _ in 0..20 {
        h.advance(Duration::from_secs(1));
        h.heartbeat("w2", 4);
        asked.extend(h.input(Input::Tick).into_iter().filter_map(|e| match e {
            Effect::AskEvidence { request, .. } => Some(request),
            _ => None,
        }));
        if !asked.is_empty() {
            break;
        }
    }
    answer(&mut h, &asked[0], Ok(Ok(AttemptEvidence::MachineRestarted)));
    assert_eq!(h.status(&t), Status::Queued);
    let fx = agent_beat(&mut h, "w1", "b2", 1000);
    let g = grants(&fx);
    assert_eq!(g.len(), 1, "{fx:?}");
    assert_eq!(g[0].1.input, vec!["hello\n".to_owned()]);
    assert_eq!(g[0].1.spec.command, "agent --resume 'abc-1'");
    // Leased: its input goes to it once it runs.
    let (_, reply) = keep(&mut h, "alice", &t, "later\n");
    assert!(matches!(reply, Some(Err(ApiError::NotRunning { .. }))), "{reply:?}");
    h.report("w1", &t, 2, ReportEvent::Started { pid: 9 });
    let r = resume_of(&snapshot(&mut h, &t)).clone();
    assert_eq!((r.pending_input, r.dropped_input, r.machine), (0, 0, None));
    let record = h.core.task(&t).unwrap();
    assert!(record.resume().is_some_and(|s| s.granted_input.is_empty()), "handed to one attempt only");
}

/// Kept input for an attempt that turns out alive is dropped (and counted),
/// never delivered twice.
#[test]
fn input_kept_for_an_attempt_that_proves_alive_is_dropped() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    let asked = lose_w1(&mut h);
    answer(&mut h, &asked[0], Err("timed out".into()));
    keep(&mut h, "alice", &t, "hello\n");
    h.report("w1", &t, 1, ReportEvent::Started { pid: 7 });
    let snap = snapshot(&mut h, &t);
    assert_eq!(snap.status, Status::Running);
    assert_eq!((resume_of(&snap).pending_input, resume_of(&snap).dropped_input), (0, 1));
}

/// What proves a process gone, end to end: a replaced store proves it only
/// on a new boot, and a task that may resume anywhere goes to another
/// machine.
#[test]
fn a_replaced_store_on_a_new_boot_resumes_anywhere_and_on_the_same_boot_stays_unknown() {
    for (boot, resumed) in [("b2", true), ("b1", false)] {
        let mut h = Harness::new();
        let t = running_agent(&mut h, true);
        agent_beat(&mut h, "w2", "b7", 2000);
        // w1 comes back with another store: its evidence is asked for.
        let fx = agent_beat(&mut h, "w1", boot, 1001);
        let asked: Vec<EvidenceRequest> = fx
            .into_iter()
            .filter_map(|e| match e {
                Effect::AskEvidence { request, .. } => Some(request),
                _ => None,
            })
            .collect();
        assert_eq!(asked.len(), 1, "boot {boot}");
        answer(&mut h, &asked[0], Ok(Ok(AttemptEvidence::Replaced { incarnation: Uuid::from_u128(1001) })));
        let snap = snapshot(&mut h, &t);
        if resumed {
            assert!(matches!(snap.status, Status::Queued | Status::Leased), "{:?}", snap.status);
            assert_eq!(resume_of(&snap).machine, None, "anywhere: not pinned");
            let fx = agent_beat(&mut h, "w2", "b7", 2000);
            let on_w2 = grants(&fx).iter().any(|(w, g)| w.as_str() == "w2" && g.attempt == Attempt(2));
            assert!(on_w2 || h.core.task(&t).unwrap().life.attempt == Attempt(2), "{fx:?}");
        } else {
            assert_eq!(snap.status, Status::Unknown);
            let hint = snap.hint.expect("hint");
            assert_eq!(hint.tag, HintTag::MachineReplaced);
            assert!(hint.message.contains("not proven gone"), "{}", hint.message);
        }
    }
}

/// The evidence requests a core sends in `fx`.
fn asked_in(fx: Vec<Effect>) -> Vec<EvidenceRequest> {
    fx.into_iter()
        .filter_map(|e| match e {
            Effect::AskEvidence { request, .. } => Some(request),
            _ => None,
        })
        .collect()
}

/// A rebuilt machine's sidecar can answer "replaced" before its worker
/// heartbeats the new boot: the resumable task is not settled unproven on
/// that answer, and the next one, after the new boot was heard, resumes it.
#[test]
fn a_replaced_store_heard_before_the_new_boot_waits_for_the_boot() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, true);
    let mut asked = Vec::new();
    for _ in 0..20 {
        h.advance(Duration::from_secs(1));
        agent_beat(&mut h, "w2", "b7", 2000);
        asked.extend(asked_in(h.input(Input::Tick)));
        if !asked.is_empty() {
            break;
        }
    }
    assert_eq!(asked.len(), 1, "w1 lost: its evidence is asked for");
    let replaced = || Ok(Ok(AttemptEvidence::Replaced { incarnation: Uuid::from_u128(1001) }));
    let fx = answer(&mut h, &asked[0], replaced());
    assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "not settled before the boot is heard: {fx:?}");
    assert_ne!(h.status(&t), Status::Unknown);

    // The worker comes back on the new boot with the new store; the task is
    // asked about again within a TTL.
    let mut asked = asked_in(agent_beat(&mut h, "w1", "b2", 1001));
    for _ in 0..20 {
        if !asked.is_empty() {
            break;
        }
        h.advance(Duration::from_secs(1));
        asked.extend(asked_in(agent_beat(&mut h, "w1", "b2", 1001)));
        asked.extend(asked_in(h.input(Input::Tick)));
    }
    assert_eq!(asked.len(), 1, "asked again once the new boot was heard");
    answer(&mut h, &asked[0], replaced());
    let snap = snapshot(&mut h, &t);
    assert!(matches!(snap.status, Status::Queued | Status::Leased), "resumed: {:?} {:?}", snap.status, snap.hint);
    assert_eq!(resume_of(&snap).resumes, 1);
}

#[test]
fn a_loss_without_its_values_or_after_a_kill_is_not_resumed() {
    // Nothing captured yet.
    let mut h = Harness::new();
    agent_beat(&mut h, "w1", "b1", 1000);
    let t = h.submit("alice", agent(false));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 7 });
    h.report("w1", &t, 1, ReportEvent::Gone(gone()));
    let snap = snapshot(&mut h, &t);
    assert_eq!(snap.status, Status::Unknown);
    assert!(snap.hint.as_ref().is_some_and(|h| h.message.contains("{session}")), "{:?}", snap.hint);

    // A kill requested: the kill wins.
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    h.api(ApiRequest::Kill { session: s("alice"), task: t.clone(), reason: None });
    h.report("w1", &t, 1, ReportEvent::Gone(gone()));
    assert_ne!(h.status(&t), Status::Queued);
    assert_eq!(resume_of(&snapshot(&mut h, &t)).resumes, 0);
}

/// Every resume counts; past the most allowed, the loss stands.
#[test]
fn resumes_are_bounded() {
    let mut h = Harness::new();
    let t = running_agent(&mut h, false);
    for attempt in 1..=tenure_protocol::resume::MAX_RESUMES + 1 {
        h.report("w1", &t, attempt, ReportEvent::Gone(gone()));
        if attempt > tenure_protocol::resume::MAX_RESUMES {
            assert_eq!(h.status(&t), Status::Unknown, "attempt {attempt}");
            break;
        }
        // Resumed on w1 at once.
        assert_eq!(h.status(&t), Status::Leased, "attempt {attempt}");
        h.report("w1", &t, attempt + 1, ReportEvent::Started { pid: 7 });
    }
    assert_eq!(resume_of(&snapshot(&mut h, &t)).resumes, tenure_protocol::resume::MAX_RESUMES);
}

/// A new leader continues from the registry: captured values, the pin,
/// the kept input.
#[test]
fn a_new_leader_continues_a_resume_from_the_registry() {
    let mut h = Harness::new();
    let mut records = BTreeMap::new();
    agent_beat(&mut h, "w1", "b1", 1000);
    let t = h.submit("alice", agent(false));
    let mut fx = h.report_effects("w1", &t, 1, ReportEvent::Started { pid: 7 });
    fx.extend(h.report_effects("w1", &t, 1, ReportEvent::Matched(vec![MatchedLine::new(0, "session: s-9")])));
    persisted(&fx, &mut records);
    // The machine stops answering, then says it restarted: resumed, while w1 is away.
    let asked = lose_w1(&mut h);
    persisted(&answer(&mut h, &asked[0], Ok(Ok(AttemptEvidence::MachineRestarted))), &mut records);
    persisted(&keep(&mut h, "alice", &t, "go on\n").0, &mut records);
    assert_eq!(records[&t].life.status, Status::Queued);
    let mut next = take_over(&records, CoreConfig::default(), h.now.wall_ms);
    let fx = agent_beat(&mut next, "w2", "b7", 2000);
    assert!(grants(&fx).is_empty(), "pinned to w1 across the takeover: {fx:?}");
    let fx = agent_beat(&mut next, "w1", "b2", 1000);
    let g = grants(&fx);
    assert_eq!(g.len(), 1, "{fx:?}");
    assert_eq!(g[0].1.spec.command, "agent --resume 's-9'");
    assert_eq!(g[0].1.input, vec!["go on\n".to_owned()]);
}
