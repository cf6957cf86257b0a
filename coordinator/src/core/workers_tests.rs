//! The core's workers, dispatch and liveness: lost workers settled on their
//! machine's evidence, refusals, re-sent grants, one live process per worker
//! id, replaced stores, and what a grant carries.

use super::*;

#[test]
fn a_lost_worker_changes_nothing_until_its_sidecar_has_answered() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("s", TaskSpec::shell("once", "true"));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 1 });
    let asked = lose_w1(&mut h);
    assert_eq!(asked.len(), 1, "asked once per worker ttl: {asked:?}");
    assert_eq!((asked[0].task.clone(), asked[0].attempt, asked[0].epoch), (t.clone(), Attempt(1), Epoch(3)));
    assert_eq!(h.status(&t), Status::Running, "no decision before the evidence");
}

#[test]
fn evidence_from_a_lost_workers_sidecar_settles_each_case() {
    let cases: Vec<(AttemptEvidence, Status, Option<HintTag>)> = vec![
        (AttemptEvidence::NeverStarted, Status::Leased, None), // queued again, granted to w2 at once
        (AttemptEvidence::Running, Status::Running, None),
        (AttemptEvidence::Exited(Outcome::new(Ending::Failed, Some(2), None)), Status::Failed, None),
        (AttemptEvidence::NoEvidence, Status::Unknown, Some(HintTag::MaybeRan)),
        (AttemptEvidence::Unreadable("crc".into()), Status::Unknown, Some(HintTag::SidecarCorrupt)),
    ];
    for (evidence, want, hint) in cases {
        let mut h = Harness::new();
        h.heartbeat("w1", 4);
        let t = h.submit("s", TaskSpec::shell("once", "true"));
        if evidence != AttemptEvidence::NeverStarted {
            h.report("w1", &t, 1, ReportEvent::Started { pid: 1 });
        }
        let asked = lose_w1(&mut h);
        answer(&mut h, &asked[0], Ok(Ok(evidence.clone())));
        let r = h.core.task(&t).unwrap();
        assert_eq!(r.life.status, want, "{evidence:?}");
        assert_eq!(r.life.hint.as_ref().map(|h| h.tag), hint, "{evidence:?}");
        if want == Status::Leased {
            assert_eq!((r.life.attempt, r.life.worker.clone()), (Attempt(2), Some(w("w2"))));
        }
    }
}

/// A task made unknown because its machine could not be reached is asked
/// about again, every worker TTL, until an answer comes: the answer of the
/// first query may have been lost after the sidecar revoked the attempt, and
/// then no report of it will ever come (found by the simulation's judge).
#[test]
fn an_unknown_task_whose_machine_was_unreachable_is_asked_about_again_until_settled() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("s", TaskSpec::shell("once", "true"));
    let first = lose_w1(&mut h);
    answer(&mut h, &first[0], Err("request timed out".into()));
    assert_eq!(h.core.task(&t).unwrap().life.hint.as_ref().map(|h| h.tag), Some(HintTag::WorkerUnreachable));
    // w1 is back and heartbeats; it does not hold the attempt.
    let mut again = Vec::new();
    for _ in 0..12 {
        h.advance(Duration::from_secs(1));
        h.heartbeat("w1", 4);
        h.heartbeat("w2", 4);
        again.extend(h.input(Input::Tick).into_iter().filter_map(|e| match e {
            Effect::AskEvidence { request, .. } => Some(request),
            _ => None,
        }));
    }
    assert!(!again.is_empty() && again.len() <= 4, "asked again, once per worker TTL: {again:?}");
    assert!(again.iter().all(|r| r.task == t && r.attempt == Attempt(1)));
    // Another lost answer changes nothing.
    answer(&mut h, &again[0], Err("request timed out".into()));
    assert_eq!(h.status(&t), Status::Unknown);
    // The machine's answer settles it: it never started, so it runs.
    answer(&mut h, &again[0], Ok(Ok(AttemptEvidence::NeverStarted)));
    let r = h.core.task(&t).unwrap();
    assert_eq!((r.life.status, r.life.attempt, r.life.hint.clone()), (Status::Leased, Attempt(2), None));
}

#[test]
fn an_unreachable_machine_makes_non_idempotent_tasks_unknown_and_idempotent_ones_run_elsewhere() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let once = h.submit("s", TaskSpec::shell("once", "true"));
    let again = h.submit("s", TaskSpec { idempotent: true, ..TaskSpec::shell("again", "true") });
    h.report("w1", &once, 1, ReportEvent::Started { pid: 1 });
    h.report("w1", &again, 1, ReportEvent::Started { pid: 2 });
    for request in lose_w1(&mut h) {
        answer(&mut h, &request, Err("no responders".into()));
    }
    let once_rec = h.core.task(&once).unwrap();
    assert_eq!(once_rec.life.status, Status::Unknown);
    assert_eq!(once_rec.life.hint.as_ref().unwrap().tag, HintTag::WorkerUnreachable);
    let again_rec = h.core.task(&again).unwrap();
    assert_eq!((again_rec.life.status, again_rec.life.attempt), (Status::Leased, Attempt(2)));
    assert_eq!(again_rec.life.worker, Some(w("w2")));
    // Late evidence from w1 settles the unknown task; a stale report of the
    // re-run task's first attempt is refused.
    assert_eq!(h.report("w1", &once, 1, completed()), ReportAck::Ack);
    assert_eq!(h.status(&once), Status::Completed);
    assert_eq!(h.report("w1", &again, 1, completed()), ReportAck::StaleAt { epoch: Epoch(3) });
    assert_eq!(h.status(&again), Status::Leased);
    // When w1 returns still holding the re-run task's first attempt, it is told to stop it.
    let fx = h.input(Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w("w1"),
        instance: Uuid::nil(),
        slots: 4,
        kinds: vec![Kind::shell()],
        epoch_seen: Epoch(3),
        attempts: vec![HeldAttempt { task: again.clone(), attempt: Attempt(1), paused: false, waiting: false }],
        sidecar: Default::default(),
        replaces: None,
        incarnation: None,
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    }));
    let kills: Vec<&KillCommand> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Command { command: WorkerCommand::Kill(k), .. } => Some(k),
            _ => None,
        })
        .collect();
    assert_eq!(kills.len(), 1);
    assert_eq!((&kills[0].task, kills[0].attempt), (&again, Attempt(1)));
}

/// A newer epoch a sidecar reports is checked against the registry's claim
/// first; a claim the registry holds deposes the leader, nothing settled.
#[test]
fn a_newer_epoch_in_a_sidecar_refusal_deposes_the_leader_once_the_registry_shows_it() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("s", TaskSpec::shell("once", "true"));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 1 });
    let asked = lose_w1(&mut h);
    let fx = answer(&mut h, &asked[0], Ok(Err(SidecarRefusal::StaleEpoch { held: Epoch(9), offered: Epoch(3) })));
    assert!(!fx.iter().any(|e| matches!(e, Effect::StepDown { .. })), "a claim alone deposes nobody: {fx:?}");
    let Some((claimed, by)) = fx.iter().find_map(|e| match e {
        Effect::CheckEpoch { claimed, by } => Some((*claimed, by.clone())),
        _ => None,
    }) else {
        panic!("the claim is checked: {fx:?}")
    };
    assert_eq!(h.status(&t), Status::Running);
    let fx = h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(9)) });
    assert!(fx.iter().any(|e| matches!(e, Effect::StepDown { .. })));
    assert_eq!(h.status(&t), Status::Running);
}

#[test]
fn refused_grants_requeue_and_a_newer_epoch_deposes_the_leader() {
    let mut h = Harness::new();
    let t = h.submit("s", TaskSpec::shell("a", "true"));
    let fx = h.heartbeat("w1", 1);
    let (_, grant) = grants(&fx).pop().unwrap();
    let fx = h.refuse("w1", grant.clone(), Refusal::NoSlot);
    // Requeued, and held back a moment before it is granted again as attempt 2.
    assert!(grants(&fx).is_empty());
    assert_eq!(h.status(&t), Status::Queued);
    h.advance(Duration::from_millis(600));
    let fx = h.input(Input::Tick);
    assert_eq!(grants(&fx).pop().unwrap().1.attempt, Attempt(2));
    assert_eq!(h.status(&t), Status::Leased);
    let fx = h.refuse("w1", grant, Refusal::StaleEpoch { held: Epoch(9), offered: Epoch(3) });
    let check = fx.iter().find_map(|e| match e {
        Effect::CheckEpoch { claimed, by } => Some((*claimed, by.clone())),
        _ => None,
    });
    let Some((claimed, by)) = check else { panic!("the claim is checked first: {fx:?}") };
    let fx = h.input(Input::EpochChecked { claimed, by, registry: Ok(Epoch(9)) });
    assert!(fx.iter().any(|e| matches!(e, Effect::StepDown { .. })));
}

#[test]
fn unanswered_grants_are_resent_until_answered() {
    let mut h = Harness::new();
    h.submit("s", TaskSpec::shell("a", "true"));
    assert_eq!(grants(&h.heartbeat("w1", 1)).len(), 1);
    h.advance(Duration::from_millis(500));
    assert_eq!(grants(&h.input(Input::Tick)).len(), 0);
    h.advance(Duration::from_millis(600));
    h.heartbeat("w1", 1);
    let g = grants(&h.input(Input::Tick));
    assert_eq!(g.len(), 1);
    assert_eq!(g[0].1.attempt, Attempt(1), "a resend is the same attempt");
}

#[test]
fn a_worker_id_is_bound_to_one_live_process_and_commands_go_to_it_alone() {
    let mut h = Harness::new();
    assert!(taken(&beat_from(&mut h, "w1", 1, None)).is_none());
    // A second live process with the same id (another host): refused, named,
    // and it receives nothing.
    let fx = beat_from(&mut h, "w1", 2, None);
    assert_eq!(taken(&fx), Some((Uuid::from_u128(2), Uuid::from_u128(1))));
    let fx = beat_from(&mut h, "w1", 2, Some(77));
    assert!(taken(&fx).is_some(), "naming a process other than the holder proves nothing");
    let submit =
        SubmitRequest { session: s("alice"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("t", "true") };
    let (fx, reply) = h.api(ApiRequest::Submit(submit));
    let Some(Ok(ApiResponse::Submitted { task: t, .. })) = reply else { panic!("{reply:?}") };
    let sent: Vec<Uuid> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Command { instance, .. } => Some(*instance),
            _ => None,
        })
        .collect();
    assert!(!sent.is_empty() && sent.iter().all(|i| *i == Uuid::from_u128(1)), "{fx:?}");
    assert_eq!(h.status(&t), Status::Leased);

    // A restarted process names its predecessor: bound at once.
    let fx = beat_from(&mut h, "w1", 3, Some(1));
    assert!(taken(&fx).is_none(), "{fx:?}");
    assert!(taken(&beat_from(&mut h, "w1", 1, None)).is_some(), "the old process is now the second one");

    // A holder silent for the worker TTL gives the id up to whoever comes next.
    h.advance(CoreConfig::default().worker_ttl);
    assert!(taken(&beat_from(&mut h, "w1", 4, None)).is_none());
    assert!(taken(&beat_from(&mut h, "w1", 3, None)).is_some());
}

#[test]
fn a_machine_whose_store_was_replaced_never_runs_its_tasks_again_and_says_why() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let running = h.submit("alice", TaskSpec::shell("r", "sleep 9"));
    let leased = h.submit("alice", TaskSpec::shell("l", "sleep 9"));
    assert_eq!(
        h.core.task(&running).unwrap().incarnation.as_deref(),
        Some(&Uuid::from_u128(1000)),
        "recorded with the grant"
    );
    h.report("w1", &running, 1, ReportEvent::Started { pid: 7 });
    // The machine is wiped and its worker started again on an empty store.
    h.advance(CoreConfig::default().worker_ttl);
    let fx = h.input(Input::Heartbeat(Heartbeat {
        boot: None,
        worker: w("w1"),
        instance: Uuid::from_u128(9),
        slots: 4,
        kinds: vec![Kind::shell()],
        epoch_seen: Epoch(3),
        attempts: Vec::new(),
        sidecar: Default::default(),
        replaces: None,
        incarnation: Some(Uuid::from_u128(2000)),
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    }));
    assert!(grants(&fx).is_empty(), "a grant went to the new store: {fx:?}");
    let asked: Vec<EvidenceRequest> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::AskEvidence { request, .. } => Some(request.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(asked.len(), 2, "{fx:?}");
    for request in asked {
        assert_eq!(request.incarnation, Some(Uuid::from_u128(1000)));
        let answer = Ok(Ok(AttemptEvidence::Replaced { incarnation: Uuid::from_u128(2000) }));
        h.input(Input::Evidence { worker: w("w1"), request, result: answer });
    }
    for t in [&running, &leased] {
        let r = h.core.task(t).unwrap();
        assert_eq!(r.life.status, Status::Unknown, "{t}");
        assert_eq!(r.life.hint.as_ref().map(|h| h.tag), Some(HintTag::MachineReplaced));
    }
    // Nothing is granted again, ever.
    for _ in 0..5 {
        h.advance(Duration::from_secs(1));
        assert!(grants(&h.input(Input::Tick)).is_empty());
    }
}

#[test]
fn a_started_attempt_a_live_worker_stops_listing_is_settled_from_evidence() {
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let t = h.submit("alice", TaskSpec::shell("r", "sleep 9"));
    h.report("w1", &t, 1, ReportEvent::Started { pid: 7 });
    let mut asked = None;
    for _ in 0..3 {
        h.advance(Duration::from_secs(1));
        let fx = h.heartbeat("w1", 4);
        asked = asked.or(fx.iter().find_map(|e| match e {
            Effect::AskEvidence { request, .. } => Some(request.clone()),
            _ => None,
        }));
    }
    let request = asked.expect("asked after three heartbeats without it");
    let outcome = Outcome::new(Ending::Completed, Some(0), None);
    h.input(Input::Evidence { worker: w("w1"), request, result: Ok(Ok(AttemptEvidence::Exited(outcome))) });
    assert_eq!(h.status(&t), Status::Completed);
}

#[test]
fn a_grant_refused_because_the_sidecars_store_failed_is_not_taken_for_nothing_ran() {
    let mut h = Harness::new();
    let t = h.submit("s", TaskSpec::shell("a", "true"));
    let fx = h.heartbeat("w1", 1);
    let (_, grant) = grants(&fx).pop().unwrap();
    // The store may hold the attempt's intent (a failed flush may have
    // landed, or its record is unreadable): not requeued, asked about.
    let fx = h.refuse("w1", grant.clone(), Refusal::SidecarStorage("flush failed".into()));
    assert_eq!(h.status(&t), Status::Leased, "requeued as if nothing ran: {fx:?}");
    let asked = fx.iter().find_map(|e| match e {
        Effect::AskEvidence { request, .. } => Some(request.clone()),
        _ => None,
    });
    let Some(request) = asked else { panic!("its evidence is not asked for: {fx:?}") };
    assert_eq!((request.task.clone(), request.attempt), (t.clone(), grant.attempt));
    // Nothing readable there: unknown, with a truthful hint, never re-run.
    h.input(Input::Evidence {
        worker: w("w1"),
        request,
        result: Ok(Ok(AttemptEvidence::Unreadable("io error".into()))),
    });
    let r = h.core.task(&t).unwrap();
    assert_eq!(r.life.status, Status::Unknown);
    assert_eq!(r.life.hint.as_ref().map(|h| h.tag), Some(HintTag::SidecarCorrupt));
    h.advance(Duration::from_secs(2));
    assert!(grants(&h.input(Input::Tick)).is_empty());
}

#[test]
fn a_deposed_leaders_stale_answer_does_not_settle_a_report_the_new_leader_acknowledges() {
    let mut old = Harness::new();
    let mut registry = BTreeMap::new();
    persisted(&old.heartbeat("w1", 2), &mut registry);
    let key = Uuid::new_v4();
    let req = SubmitRequest { session: s("s"), idempotency_key: key, spec: TaskSpec::shell("a", "sleep 1") };
    persisted(&old.api(ApiRequest::Submit(req)).0, &mut registry);
    // The old leader is paused; the next one (epoch 4) takes over and starts
    // a task the old one never heard of on the same worker.
    let mut new = take_over(&registry, CoreConfig::default(), old.now.wall_ms);
    let hb = |epoch| {
        Input::Heartbeat(Heartbeat {
            boot: None,
            worker: w("w1"),
            instance: Uuid::nil(),
            slots: 2,
            kinds: vec![Kind::shell()],
            epoch_seen: epoch,
            attempts: Vec::new(),
            sidecar: Default::default(),
            replaces: None,
            incarnation: Some(Uuid::from_u128(1000)),
            mark: None,
            labels: Default::default(),
            enforces: Default::default(),
        })
    };
    new.input(hb(Epoch(3)));
    let req = SubmitRequest { session: s("s"), idempotency_key: Uuid::new_v4(), spec: TaskSpec::shell("b", "true") };
    let (mut fx, _) = new.api(ApiRequest::Submit(req));
    fx.extend(new.input(hb(Epoch(4))));
    let fresh = registry.keys().next().map(|t| t.number() + 1).unwrap();
    let Some((_, grant)) = grants(&fx).into_iter().find(|(_, g)| g.task.number() == fresh) else {
        panic!("the new task is not granted: {fx:?}")
    };
    let fresh = grant.task.clone();
    assert_eq!(grant.epoch, Epoch(4));
    // The worker buffered the outcome and reports it under the highest epoch
    // its machine has seen; the zombie answers first, from its old view.
    let report = Report {
        worker: w("w1"),
        task: fresh.clone(),
        attempt: grant.attempt,
        epoch: Epoch(4),
        event: ReportEvent::Finished(Outcome::new(Ending::Completed, Some(0), None)),
    };
    let answer = |h: &mut Harness| {
        h.input(Input::Report { reply_to: Some("ack".into()), report: report.clone() })
            .into_iter()
            .find_map(|e| match e {
                Effect::Ack { ack, .. } => Some(ack),
                _ => None,
            })
            .unwrap()
    };
    let zombie = answer(&mut old);
    assert_eq!(zombie, ReportAck::StaleAt { epoch: Epoch(3) });
    assert!(!zombie.settles(report.epoch), "the worker would drop its outcome on a deposed leader's word");
    // Kept and re-sent: the leader of the current epoch records it.
    let current = answer(&mut new);
    assert_eq!(current, ReportAck::Ack);
    assert!(current.settles(report.epoch));
    assert_eq!(new.status(&fresh), Status::Completed);
}

/// Defect C of the simulation, pinned without a seed: a refusal of a late
/// copy of a grant proves nothing once the attempt ran. Attempt 1 starts, its
/// worker reports it `Lost` (the task is `unknown`, maybe ran), and then a
/// copy of the grant is refused (the sidecar is down). The lifecycle table
/// would queue an `unknown` task again on `Refused` ("it never started"), and
/// with a kill pending end it `killed`: the core must not turn this refusal
/// into that event, so the task stays `unknown` and nothing is granted.
#[test]
fn a_refused_late_grant_leaves_an_unknown_task_unknown() {
    for kill_pending in [false, true] {
        let mut h = Harness::new();
        h.heartbeat("w1", 4);
        let key = Uuid::new_v4();
        let (fx, _) = h.api(ApiRequest::Submit(SubmitRequest {
            session: s("s"),
            idempotency_key: key,
            spec: TaskSpec::shell("once", "true"),
        }));
        let (_, grant) = grants(&fx).pop().expect("granted at submit");
        let t = grant.task.clone();
        assert_eq!(h.report("w1", &t, 1, ReportEvent::Started { pid: 1 }), ReportAck::Ack);
        if kill_pending {
            h.api(ApiRequest::Kill { session: s("s"), task: t.clone(), reason: None });
            assert_eq!(h.status(&t), Status::Stopping);
        }
        let hint = RecoveryHint { tag: HintTag::MaybeRan, message: "its shim was killed".into() };
        assert_eq!(h.report("w1", &t, 1, ReportEvent::Lost(hint)), ReportAck::Ack);
        assert_eq!(h.status(&t), Status::Unknown);
        for refusal in [Refusal::SidecarUnavailable("down".into()), Refusal::NoSlot, Refusal::UnknownAttempt] {
            let fx = h.refuse("w1", grant.clone(), refusal.clone());
            assert!(grants(&fx).is_empty(), "{refusal:?}: {fx:?}");
            assert!(!fx.iter().any(|e| matches!(e, Effect::Persist(..))), "{refusal:?} changed the task: {fx:?}");
            let r = h.core.task(&t).unwrap();
            assert_eq!((r.life.status, r.life.attempt), (Status::Unknown, Attempt(1)), "{refusal:?}");
        }
    }
}

/// A grant carries the trace of its task's submit, so the driver sends it in
/// that trace without reading the core back; a re-sent grant and a new
/// leader's grant carry it too; a kill carries none.
#[test]
fn a_grant_carries_its_tasks_trace_and_a_kill_none() {
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned();
    let mut h = Harness::new();
    h.heartbeat("w1", 4);
    let request = ApiRequest::Submit(SubmitRequest {
        session: s("s"),
        idempotency_key: Uuid::new_v4(),
        spec: TaskSpec::shell("traced", "true"),
    });
    let fx = h.input(Input::Api { reply_to: Some("r".into()), request, trace: Some(traceparent.clone()) });
    let traces = |fx: &[Effect]| -> Vec<(bool, Option<String>)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Command { command, trace, .. } => {
                    Some((matches!(command, WorkerCommand::Grant(_)), trace.clone()))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(traces(&fx), [(true, Some(traceparent.clone()))]);
    let task = grants(&fx)[0].1.task.clone();
    // Unanswered: re-sent, in the same trace.
    h.advance(Duration::from_secs(2));
    assert_eq!(traces(&h.input(Input::Tick)), [(true, Some(traceparent.clone()))]);
    // A new leader re-sends it from the record, in the same trace.
    let record = h.core.task(&task).unwrap().clone();
    let mut next = take_over(&BTreeMap::from([(task.clone(), record)]), CoreConfig::default(), h.now.wall_ms);
    next.heartbeat("w1", 4);
    next.advance(Duration::from_secs(2));
    assert_eq!(traces(&next.input(Input::Tick)), [(true, Some(traceparent))]);
    // An untraced task's grant, and every kill, carry none.
    let untraced = h.submit("s", TaskSpec::shell("plain", "true"));
    h.report("w1", &untraced, 1, ReportEvent::Started { pid: 1 });
    let (fx, _) = h.api(ApiRequest::Kill { session: s("s"), task: untraced, reason: None });
    assert_eq!(traces(&fx), [(false, None)]);
}
