//! The worker core as tables: every (step × result) cell of an attempt, every
//! answer to a grant and a kill, and every row of start-up recovery.

use super::*;
use tenure_protocol::spec::TaskSpec;

fn task() -> TaskId {
    "shell-1".parse().unwrap()
}

fn key() -> Key {
    (task(), Attempt(1))
}

fn grant(epoch: u64) -> LeaseGrant {
    LeaseGrant {
        input: Vec::new(),
        task: task(),
        attempt: Attempt(1),
        epoch: Epoch(epoch),
        owner: "alice".parse().unwrap(),
        spec: TaskSpec::shell("l", "echo hi"),
        mark: None,
    }
}

fn worker(slots: u32) -> Worker {
    Worker::new(Config { slots, kinds: vec![Kind::shell()], enforces: Default::default() })
}

fn done_ok() -> Outcome {
    Outcome::new(Ending::Completed, Some(0), None)
}

fn hint() -> RecoveryHint {
    RecoveryHint { tag: HintTag::MaybeRan, message: "gone".into() }
}

fn storage() -> SidecarReply {
    SidecarReply::Refused(SidecarRefusal::Storage("flush failed".into()))
}

fn stale() -> SidecarReply {
    SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(9), offered: Epoch(3) })
}

/// A worker holding `key()` at `step`, its grant of epoch 3, having seen epoch 5.
fn holding(step: Step) -> Worker {
    let mut w = worker(4);
    w.observe(Epoch(5));
    let held = Held { grant: Some(Arc::new(grant(3))), epoch: Epoch(3), step, kill: false, paused: false };
    w.held.insert(key(), held);
    w
}

fn step_name(w: &Worker) -> String {
    match w.held(&key()).map(|h| &h.step) {
        None => "gone".into(),
        Some(Step::Intent) => "intent".into(),
        Some(Step::Abandon { refusal: SidecarReply::Ok }) => "abandon(ok)".into(),
        Some(Step::Abandon { .. }) => "abandon".into(),
        Some(Step::Launch) => "launch".into(),
        Some(Step::Watch) => "watch".into(),
        Some(Step::Seek) => "seek".into(),
        Some(Step::Settle { .. }) => "settle".into(),
        Some(Step::Buffer(o)) => format!("buffer({:?})", o.ending).to_lowercase(),
        Some(Step::Report(e)) => format!("report({})", e.name()),
        Some(Step::Acknowledge) => "ack".into(),
        Some(Step::Release) => "release".into(),
    }
}

/// Every step an attempt can be at (the `Abandon` ones after a stale refusal
/// and after a store failure).
fn steps() -> Vec<(&'static str, Step)> {
    vec![
        ("intent", Step::Intent),
        ("abandon-stale", Step::Abandon { refusal: stale() }),
        ("abandon-storage", Step::Abandon { refusal: storage() }),
        ("launch", Step::Launch),
        ("watch", Step::Watch),
        ("seek", Step::Seek),
        ("settle", Step::Settle { restarted: false }),
        ("buffer", Step::Buffer(done_ok())),
        ("report-finished", Step::Report(ReportEvent::Finished(done_ok()))),
        ("report-lost", Step::Report(ReportEvent::Lost(hint()))),
        ("report-gone", Step::Report(ReportEvent::Gone(hint()))),
        ("ack", Step::Acknowledge),
        ("release", Step::Release),
    ]
}

/// Every result an action can have.
fn results() -> Vec<Done> {
    vec![
        Done::Sidecar(SidecarReply::Ok),
        Done::Sidecar(stale()),
        Done::Sidecar(storage()),
        Done::Launched(40),
        Done::NotStarted("no such program".into()),
        Done::Unseen,
        Done::Ended(Settled::Exited(done_ok())),
        Done::Ended(Settled::Lost { hint: hint(), gone: true }),
        Done::Ended(Settled::Lost { hint: hint(), gone: false }),
        Done::Reported(ReportAck::Ack),
        Done::Reported(ReportAck::NotLeader),
        Done::Reported(ReportAck::StaleAt { epoch: Epoch(4) }),
        Done::Reported(ReportAck::StaleAt { epoch: Epoch(5) }),
        Done::Released,
    ]
}

/// Rows: steps. Columns: the sidecar's answer (ok, stale epoch, storage
/// failure), the launch's (launched, not started, unseen), an end (exited,
/// lost with its process proven gone, lost without that proof), the
/// leader's answer to a report (ack, not leader, stale from below the
/// highest epoch seen — 4 < 5 —, stale at it), the directory released.
/// `.`: unchanged; `gone`: the attempt is over here.
const TABLE: &str = "
| step           | ok                   stale                storage              launched  not-started     unseen  exited             gone          unproven      ack   not-leader  stale<seen  stale=seen  released
intent           | launch               abandon              abandon              .         .               .       .                  .             .             .     .           .           .           .
abandon-stale    | report(not-started)  report(not-started)  report(not-started)  .         .               .       .                  .             .             .     .           .           .           .
abandon-storage  | report(not-started)  report(lost)         report(lost)         .         .               .       .                  .             .             .     .           .           .           .
launch           | .                    .                    .                    watch     buffer(failed)  seek    buffer(completed)  report(gone)  report(lost)  .     .           .           .           .
watch            | .                    .                    .                    .         .               .       buffer(completed)  report(gone)  report(lost)  .     .           .           .           .
seek             | .                    .                    .                    .         .               .       buffer(completed)  report(gone)  report(lost)  .     .           .           .           .
settle           | .                    .                    .                    .         .               .       buffer(completed)  report(gone)  report(lost)  .     .           .           .           .
buffer           | report(finished)     report(finished)     report(finished)     .         .               .       .                  .             .             .     .           .           .           .
report-finished  | .                    .                    .                    .         .               .       .                  .             .             ack   .           .           ack         .
report-lost      | .                    .                    .                    .         .               .       .                  .             .             gone  .           .           gone        .
report-gone      | .                    .                    .                    .         .               .       .                  .             .             gone  .           .           gone        .
ack              | release              release              release              .         .               .       .                  .             .             .     .           .           .           .
release          | .                    .                    .                    .         .               .       .                  .             .             .     .           .           .           gone
";

#[test]
fn every_step_against_every_result() {
    let expected: BTreeMap<&str, Vec<&str>> = TABLE
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('|'))
        .map(|l| {
            let (row, cells) = l.split_once('|').unwrap();
            (row.trim(), cells.split_whitespace().collect())
        })
        .collect();
    let mut checked = 0;
    for (name, step) in steps() {
        let row = expected.get(name).unwrap_or_else(|| panic!("no row for {name}"));
        assert_eq!(row.len(), results().len(), "row {name} has {} cells", row.len());
        for (want, done) in row.iter().zip(results()) {
            let mut w = holding(step.clone());
            w.advance(&key(), done.clone());
            let got = step_name(&w);
            let want = if *want == "." { step_name(&holding(step.clone())) } else { want.to_string() };
            assert_eq!(got, want, "{name} × {done:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, 13 * 14);
}

#[test]
fn each_step_asks_for_its_action() {
    let (t, a) = (task(), Attempt(1));
    let cases = [
        // The intent carries the highest epoch seen (5), not the grant's (3).
        (
            Step::Intent,
            Action::Sidecar(SidecarRequest::Intent { task: t.clone(), attempt: a, epoch: Epoch(5), trace: None }),
        ),
        (Step::Abandon { refusal: stale() }, Action::Sidecar(SidecarRequest::Abandon { task: t.clone(), attempt: a })),
        (Step::Launch, Action::Launch { kill: false, epoch: Epoch(3) }),
        (Step::Watch, Action::Watch { kill: false }),
        (Step::Seek, Action::Seek { kill: false }),
        (Step::Settle { restarted: true }, Action::Settle { restarted: true }),
        (
            Step::Buffer(done_ok()),
            Action::Sidecar(SidecarRequest::Exited { task: t.clone(), attempt: a, outcome: done_ok() }),
        ),
        (
            Step::Report(ReportEvent::Finished(done_ok())),
            Action::Report { event: ReportEvent::Finished(done_ok()), epoch: Epoch(3) },
        ),
        (Step::Acknowledge, Action::Sidecar(SidecarRequest::Acknowledged { task: t.clone(), attempt: a })),
        (Step::Release, Action::Release),
    ];
    for (step, action) in cases {
        assert_eq!(holding(step.clone()).next(&key()), Some(action), "{step:?}");
    }
    assert_eq!(worker(1).next(&key()), None);
}

#[test]
fn an_intent_taken_re_stamps_the_attempt_and_a_refused_one_reports_under_the_grants_epoch() {
    let mut w = holding(Step::Intent);
    w.advance(&key(), Done::Sidecar(SidecarReply::Ok));
    assert_eq!(w.held(&key()).unwrap().epoch, Epoch(5));
    let mut w = holding(Step::Abandon { refusal: stale() });
    w.held.get_mut(&key()).unwrap().epoch = Epoch(5);
    w.advance(&key(), Done::Sidecar(SidecarReply::Ok));
    assert_eq!(w.held(&key()).unwrap().epoch, Epoch(3));
}

#[test]
fn a_kill_asked_before_the_launch_reaches_the_launch_and_the_watch() {
    let mut w = holding(Step::Launch);
    let answer = w.kill(key(), Epoch(5), Ok(SidecarReply::Ok));
    assert_eq!(answer.reply, WorkerReply::Accepted);
    assert_eq!(w.next(&key()), Some(Action::Launch { kill: true, epoch: Epoch(3) }));
    w.advance(&key(), Done::Launched(40));
    w.advance(&key(), Done::Sidecar(SidecarReply::Ok));
    assert_eq!(w.next(&key()), Some(Action::Watch { kill: true }));
}

#[test]
fn an_intent_refused_by_a_failing_store_is_maybe_ran_unless_the_abandon_lands() {
    // A refusal that decided something proves the intent was not written.
    assert!(matches!(intent_refused(&stale(), &storage(), Attempt(1)), ReportEvent::NotStarted { .. }));
    // A store failure, then a confirmed abandon: the record is gone.
    assert!(matches!(intent_refused(&storage(), &SidecarReply::Ok, Attempt(1)), ReportEvent::NotStarted { .. }));
    // A store failure that nothing disproves: lost, maybe-ran.
    for abandoned in [storage(), stale()] {
        match intent_refused(&storage(), &abandoned, Attempt(1)) {
            ReportEvent::Lost(hint) => assert_eq!(hint.tag, HintTag::MaybeRan),
            other => panic!("given back as not started: {other:?}"),
        }
    }
}

// ---------------------------------------------------------------- grants

#[test]
fn grants_are_screened_before_the_sidecar_is_asked() {
    let mut w = worker(1);
    assert_eq!(w.screen_grant(&grant(3)), Screened::Record);
    // Another kind: refused and tombstoned.
    let mut other = grant(3);
    other.task = "shell-2".parse().unwrap();
    other.spec.kind = "gpu".parse().unwrap();
    match w.screen_grant(&other) {
        Screened::Answer(a) => {
            assert!(matches!(a.reply, WorkerReply::Refused(Refusal::UnsupportedKind(_))));
            assert!(a.tombstone && !a.drive);
        }
        other => panic!("{other:?}"),
    }
    // It was given back: a late copy of it is refused, with no second tombstone.
    match w.screen_grant(&other) {
        Screened::Answer(a) => {
            assert_eq!((a.reply, a.tombstone), (WorkerReply::Refused(Refusal::UnknownAttempt), false))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_full_worker_refuses_and_a_held_attempt_is_accepted_again() {
    let mut w = worker(1);
    let a = w.grant_recorded(grant(3), Ok(SidecarReply::Ok));
    assert_eq!((a.reply, a.tombstone, a.drive), (WorkerReply::Accepted, false, true));
    assert_eq!(w.epoch_seen(), Epoch(3));
    // A re-send of the held grant: accepted, not driven twice.
    assert_eq!(w.screen_grant(&grant(3)), Screened::Answer(Answer::reply(WorkerReply::Accepted)));
    let mut second = grant(3);
    second.task = "shell-2".parse().unwrap();
    match w.screen_grant(&second) {
        Screened::Answer(a) => assert_eq!((a.reply, a.tombstone), (WorkerReply::Refused(Refusal::NoSlot), true)),
        other => panic!("{other:?}"),
    }
}

/// A grant is recorded with its intent: the intent carries the highest
/// epoch seen, and once both are answered `Ok` the attempt's first step is
/// its launch; a refused intent gives it back as a refused intent does
/// when sent alone.
#[test]
fn a_grant_recorded_with_its_intent_starts_at_its_launch() {
    for (intent_reply, first) in [
        (SidecarReply::Ok, Action::Launch { kill: false, epoch: Epoch(7) }),
        (storage(), Action::Sidecar(SidecarRequest::Abandon { task: grant(3).task, attempt: grant(3).attempt })),
    ] {
        let mut w = worker(1);
        w.observe(Epoch(7));
        let key = (grant(3).task, grant(3).attempt);
        assert_eq!(w.screen_grant(&grant(3)), Screened::Record);
        let intent = w.intent_for(&grant(3), None);
        assert_eq!(
            intent,
            SidecarRequest::Intent { task: key.0.clone(), attempt: key.1, epoch: Epoch(7), trace: None },
            "the intent carries the highest epoch seen, as the drive's would"
        );
        let a = w.grant_recorded(grant(3), Ok(SidecarReply::Ok));
        assert_eq!((a.reply, a.drive), (WorkerReply::Accepted, true));
        w.advance(&key, Done::Sidecar(intent_reply));
        assert_eq!(w.next(&key), Some(first));
    }
    // Without an answer to its intent, the drive sends it itself.
    let mut w = worker(1);
    let key = (grant(3).task, grant(3).attempt);
    w.screen_grant(&grant(3));
    w.grant_recorded(grant(3), Ok(SidecarReply::Ok));
    assert!(matches!(w.next(&key), Some(Action::Sidecar(SidecarRequest::Intent { .. }))));
}

#[test]
fn grants_being_recorded_together_hold_their_slots_and_a_resend_waits_for_the_first() {
    let mut w = worker(2);
    let numbered = |n: u32| {
        let mut g = grant(3);
        g.task = format!("shell-{n}").parse().unwrap();
        g
    };
    // Screened together, before any sidecar answer: two slots, two records.
    assert_eq!(w.screen_grant(&numbered(1)), Screened::Record);
    assert_eq!(w.screen_grant(&numbered(2)), Screened::Record);
    // The same grant again, while it is being recorded: neither a second
    // record nor an answer of its own.
    assert_eq!(w.screen_grant(&numbered(1)), Screened::Recording);
    // A third: the two being recorded fill the worker.
    match w.screen_grant(&numbered(3)) {
        Screened::Answer(a) => assert_eq!(a.reply, WorkerReply::Refused(Refusal::NoSlot)),
        other => panic!("{other:?}"),
    }
    // One is refused by the sidecar: its slot is free again, and it is given back.
    let a = w.grant_recorded(numbered(1), Ok(stale()));
    assert!(matches!(a.reply, WorkerReply::Refused(Refusal::StaleEpoch { .. })), "{a:?}");
    let a = w.grant_recorded(numbered(2), Ok(SidecarReply::Ok));
    assert_eq!((a.reply, a.drive), (WorkerReply::Accepted, true));
    assert_eq!(w.screen_grant(&numbered(4)), Screened::Record);
    match w.screen_grant(&numbered(1)) {
        Screened::Answer(a) => assert_eq!(a.reply, WorkerReply::Refused(Refusal::UnknownAttempt)),
        other => panic!("{other:?}"),
    }
    assert_eq!(w.screen_grant(&numbered(2)), Screened::Answer(Answer::reply(WorkerReply::Accepted)));
}

#[test]
fn an_attempt_whose_process_ended_holds_no_slot() {
    let mut second = grant(3);
    second.task = "shell-2".parse().unwrap();
    for (step, free) in [
        (Step::Intent, false),
        (Step::Launch, false),
        (Step::Watch, false),
        (Step::Seek, false),
        (Step::Settle { restarted: false }, false),
        (Step::Buffer(done_ok()), true),
        (Step::Report(ReportEvent::Finished(done_ok())), true),
        (Step::Acknowledge, true),
        (Step::Release, true),
    ] {
        let mut w = holding(step.clone());
        w.config.slots = 1;
        let screened = w.screen_grant(&second);
        assert_eq!(screened == Screened::Record, free, "{step:?}: {screened:?}");
    }
}

/// One row: the sidecar's answer to `Accept`, the reply, whether the
/// attempt is tombstoned, driven, and remembered as given back.
type GrantRow = (Result<SidecarReply, String>, WorkerReply, bool, bool, bool);

/// Every answer the sidecar can give to `Accept`.
#[test]
fn every_sidecar_answer_to_a_grant() {
    let wrong = |phase| {
        SidecarReply::Refused(SidecarRefusal::WrongPhase {
            task: task(),
            attempt: Attempt(1),
            phase,
            action: "accept".into(),
        })
    };
    let cases: Vec<GrantRow> = vec![
        (Ok(SidecarReply::Ok), WorkerReply::Accepted, false, true, false),
        (
            Ok(stale()),
            WorkerReply::Refused(Refusal::StaleEpoch { held: Epoch(9), offered: Epoch(3) }),
            true,
            false,
            true,
        ),
        // A late copy of a grant already acted on: accepted, nothing started.
        (Ok(wrong(Phase::Spawned)), WorkerReply::Accepted, false, false, false),
        // The store failed: not given back (the leader asks the evidence).
        (Ok(storage()), WorkerReply::Refused(Refusal::SidecarStorage("flush failed".into())), false, false, false),
        (
            Err("connection refused".into()),
            WorkerReply::Refused(Refusal::SidecarUnavailable("connection refused".into())),
            false,
            false,
            true,
        ),
    ];
    for (answer, reply, tombstone, drive, given_back) in cases {
        let mut w = worker(4);
        let a = w.grant_recorded(grant(3), answer.clone());
        assert_eq!((&a.reply, a.tombstone, a.drive), (&reply, tombstone, drive), "{answer:?}");
        assert_eq!(w.held(&key()).is_some(), drive, "{answer:?}");
        assert_eq!(w.given_back.contains(&key()), given_back, "{answer:?}");
    }
    // An `accepted` record's wrong phase is not "already acted on".
    let mut w = worker(4);
    let a = w.grant_recorded(grant(3), Ok(wrong(Phase::Accepted)));
    assert!(matches!(a.reply, WorkerReply::Refused(Refusal::SidecarUnavailable(_))), "{a:?}");
    // A stale refusal moves the fence up.
    let mut w = worker(4);
    w.grant_recorded(grant(3), Ok(stale()));
    assert_eq!(w.epoch_seen(), Epoch(9));
}

#[test]
fn a_kill_of_an_attempt_never_held_gives_it_back_so_its_late_grant_is_refused() {
    let mut w = worker(4);
    let a = w.kill(key(), Epoch(4), Ok(SidecarReply::Ok));
    assert_eq!(a.reply, WorkerReply::Refused(Refusal::UnknownAttempt));
    assert_eq!(w.epoch_seen(), Epoch(4));
    assert!(matches!(
        w.screen_grant(&grant(3)),
        Screened::Answer(Answer { reply: WorkerReply::Refused(Refusal::UnknownAttempt), .. })
    ));
    // A kill under a stale epoch, or without a sidecar, changes nothing.
    let mut w = holding(Step::Watch);
    assert!(matches!(w.kill(key(), Epoch(2), Ok(stale())).reply, WorkerReply::Refused(Refusal::StaleEpoch { .. })));
    assert!(matches!(w.kill(key(), Epoch(6), Ok(storage())).reply, WorkerReply::Refused(Refusal::SidecarStorage(_))));
    assert!(matches!(
        w.kill(key(), Epoch(6), Err("down".into())).reply,
        WorkerReply::Refused(Refusal::SidecarUnavailable(_))
    ));
    assert!(!w.held(&key()).unwrap().kill);
    assert_eq!(w.epoch_seen(), Epoch(5));
}

/// The owner's pause wish, for every sidecar answer to its epoch and for a
/// held and an unknown attempt: only a fenced wish for a held attempt is
/// taken; it is listed in heartbeats, withdrawn by a resume, restored after a
/// restart, and an attempt never held is refused without being given back.
#[test]
fn a_pause_wish_is_taken_only_fenced_and_for_a_held_attempt() {
    let paused = |w: &Worker| w.attempts().iter().find(|a| (a.task.clone(), a.attempt) == key()).map(|a| a.paused);
    let cases: [(&str, Result<SidecarReply, String>, WorkerReply); 4] = [
        ("ok", Ok(SidecarReply::Ok), WorkerReply::Accepted),
        ("stale", Ok(stale()), WorkerReply::Refused(Refusal::StaleEpoch { held: Epoch(9), offered: Epoch(3) })),
        ("storage", Ok(storage()), WorkerReply::Refused(Refusal::SidecarStorage("flush failed".into()))),
        ("down", Err("down".into()), WorkerReply::Refused(Refusal::SidecarUnavailable("down".into()))),
    ];
    for (name, fence, reply) in cases {
        let mut w = holding(Step::Watch);
        let taken = reply == WorkerReply::Accepted;
        assert_eq!(w.pause(&key(), Epoch(6), fence, true).reply, reply, "{name}");
        assert_eq!(paused(&w), Some(taken), "{name}: listed as the wish taken");
        assert_eq!(w.epoch_seen(), if taken { Epoch(6) } else { Epoch(5) }, "{name}");
        assert_eq!(w.held(&key()).map(|h| h.step.clone()), Some(Step::Watch), "{name}: the attempt goes on");
    }
    // A resume withdraws it; a repeat changes nothing.
    let mut w = holding(Step::Watch);
    for wish in [true, true, false, false] {
        assert_eq!(w.pause(&key(), Epoch(5), Ok(SidecarReply::Ok), wish).reply, WorkerReply::Accepted);
        assert_eq!(paused(&w), Some(wish));
    }
    // Not held: refused, and its grant is still accepted later.
    let mut w = worker(4);
    let a = w.pause(&key(), Epoch(4), Ok(SidecarReply::Ok), true);
    assert_eq!(a.reply, WorkerReply::Refused(Refusal::UnknownAttempt));
    assert_eq!(w.screen_grant(&grant(4)), Screened::Record);
    // After a restart the files say it: restored for a held attempt only.
    let mut w = holding(Step::Watch);
    w.restore_paused(&key());
    assert_eq!(paused(&w), Some(true));
    let mut w = worker(4);
    w.restore_paused(&key());
    assert!(w.attempts().is_empty());
}

#[test]
fn a_deposed_leaders_stale_answer_does_not_settle_a_report() {
    let w = holding(Step::Report(ReportEvent::Finished(done_ok())));
    assert!(!w.settles(&ReportAck::StaleAt { epoch: Epoch(4) }, Epoch(3)));
    assert!(w.settles(&ReportAck::StaleAt { epoch: Epoch(5) }, Epoch(3)));
    // The report's own epoch counts too.
    assert!(!w.settles(&ReportAck::StaleAt { epoch: Epoch(5) }, Epoch(6)));
    assert!(w.settles(&ReportAck::Ack, Epoch(6)));
}

// ---------------------------------------------------------------- recovery

fn record(phase: Phase, outcome: Option<Outcome>) -> AttemptRecord {
    AttemptRecord { grant: grant(3), phase, pid: Some(40), outcome, boot: None }
}

/// Every row of start-up recovery: what is held again, at which step, and
/// what is left to the driver.
#[test]
fn every_recovery_row() {
    let found =
        |phase, outcome, shim_alive, restarted| Found::Record { record: record(phase, outcome), shim_alive, restarted };
    let files = |status, shim_alive, corrupt: Option<&str>| Found::FilesOnly {
        key: key(),
        grant: Some(grant(3)),
        status,
        shim_alive,
        corrupt: corrupt.map(String::from),
    };
    let not_started = ReportEvent::NotStarted { reason: "worker restarted before the intent".into() };
    let cases: Vec<(Found, Option<Step>, Vec<Recovered>)> = vec![
        (found(Phase::Acknowledged, Some(done_ok()), false, false), None, vec![Recovered::Remove(key())]),
        (
            found(Phase::Accepted, None, false, false),
            None,
            vec![Recovered::Abandon(key()), Recovered::Report { key: key(), epoch: Epoch(3), event: not_started }],
        ),
        (
            found(Phase::Exited, Some(done_ok()), false, false),
            Some(Step::Report(ReportEvent::Finished(done_ok()))),
            vec![],
        ),
        (found(Phase::Exited, None, false, false), Some(Step::Settle { restarted: false }), vec![]),
        (found(Phase::Intent, None, true, false), Some(Step::Watch), vec![]),
        (found(Phase::Spawned, None, true, true), Some(Step::Watch), vec![]),
        (found(Phase::Intent, None, false, false), Some(Step::Settle { restarted: false }), vec![]),
        (found(Phase::Spawned, None, false, true), Some(Step::Settle { restarted: true }), vec![]),
        (files(true, false, None), Some(Step::Settle { restarted: false }), vec![]),
        (files(false, true, None), Some(Step::Watch), vec![]),
        (files(false, false, None), Some(Step::Settle { restarted: false }), vec![]),
        (files(true, false, Some("bad crc")), Some(Step::Settle { restarted: false }), vec![]),
        (files(true, true, Some("bad crc")), Some(Step::Settle { restarted: false }), vec![]),
        (files(false, true, Some("bad crc")), Some(Step::Watch), vec![]),
    ];
    for (f, step, out) in cases {
        let mut w = worker(4);
        let line = format!("{f:?}");
        assert_eq!(w.recover(Epoch(7), vec![f]), out, "{line}");
        assert_eq!(w.held(&key()).map(|h| h.step.clone()), step, "{line}");
        assert_eq!(w.epoch_seen(), Epoch(7));
    }
    // An unreadable record whose files prove nothing: lost, sidecar-corrupt,
    // reported without holding it.
    let mut w = worker(4);
    let out = w.recover(Epoch(7), vec![files(false, false, Some("bad crc"))]);
    match out.as_slice() {
        [Recovered::Report { event: ReportEvent::Lost(hint), epoch: Epoch(7), .. }] => {
            assert_eq!(hint.tag, HintTag::SidecarCorrupt);
            assert!(hint.message.contains("bad crc"));
        }
        other => panic!("{other:?}"),
    }
    assert!(!w.holds_any());
}

#[test]
fn an_unlisted_directory_is_removed_only_when_confirmed_dead() {
    assert_eq!(unlisted(true, false, false), Unlisted::Settle);
    assert_eq!(unlisted(true, true, true), Unlisted::Settle);
    assert_eq!(unlisted(false, true, false), Unlisted::Keep);
    assert_eq!(unlisted(false, false, true), Unlisted::Keep);
    assert_eq!(unlisted(false, false, false), Unlisted::Remove);
}

/// A grant whose resource limits this worker cannot enforce is refused,
/// naming them, and given back; one it can enforce is taken.
#[test]
fn limits_a_worker_cannot_enforce_are_refused_by_name() {
    use tenure_protocol::resources::{ResourceLimits, ResourceSupport};
    let limited = |n: u64| {
        let mut g = grant(3);
        g.task = format!("shell-{n}").parse().unwrap();
        g.spec.resources =
            Some(Box::new(ResourceLimits { memory_bytes: Some(64 << 20), pids: Some(20), cpu_millis: None }));
        g
    };
    let mut bare = worker(4);
    match bare.screen_grant(&limited(1)) {
        Screened::Answer(a) => {
            let names = vec!["memory".to_owned(), "pids".to_owned()];
            assert_eq!(a.reply, WorkerReply::Refused(Refusal::UnenforcedLimits(names)));
            assert!(a.tombstone && !a.drive);
        }
        other => panic!("{other:?}"),
    }
    let support = ResourceSupport { tracking: true, memory: true, cpu: false, pids: true };
    let mut able = Worker::new(Config { slots: 4, kinds: vec![Kind::shell()], enforces: support });
    assert_eq!(able.enforces(), support);
    assert!(matches!(able.screen_grant(&limited(2)), Screened::Record));
    let mut cpu = limited(3);
    cpu.spec.resources = Some(Box::new(ResourceLimits { cpu_millis: Some(500), ..Default::default() }));
    match able.screen_grant(&cpu) {
        Screened::Answer(a) => assert_eq!(a.reply, WorkerReply::Refused(Refusal::UnenforcedLimits(vec!["cpu".into()]))),
        other => panic!("{other:?}"),
    }
}
