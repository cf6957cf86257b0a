//! The pause cells of the lifecycle table: `pause` and `resume` against every
//! status, every other event against the statuses a pause leads to, and
//! histories mixing them with everything else. Kept apart from
//! `lifecycle_tests.rs` so that each table stays readable on its own.

use super::tests::{arb_event, check_table, events, start, w};
use super::*;
use proptest::prelude::*;

/// The two pause columns (`pause`, `resume`) for every row, non-idempotent
/// task, a `|`, then idempotent. `+p`: the owner's pause wish is recorded
/// (`pause_requested`); `+k`: a kill is. Letters as in `lifecycle_tests.rs`,
/// P paused.
const PAUSE_COLUMNS: &str = "
    queued      . .  |  . .
    leased      . .  |  . .
    running     P .  |  P .
    stopping+k  . .  |  . .
    completed   . .  |  . .
    killed      . .  |  . .
    failed      . .  |  . .
    unknown     . .  |  . .
    unknown+k   . .  |  . .
    paused+p    . R  |  . R
    unknown+p   . U  |  . U
    queued+p    . Q  |  . Q
    blocked     . .  |  . .
";

/// The rows a pause leads to, against every event column of
/// `lifecycle_tests.rs` (same order, same letters).
const PAUSED_ROWS: &str = "
    paused+p   . . . . . . . C F K . S U . U . . . . . .  |  . . . . . . . C F K . S Q . U . . . . . .
    unknown+p  . . Q . . P . C F K . U . . U . . . . . .  |  . . Q . . P . C F K . U . . U . . . . . .
    queued+p   L . . . . . . . . . . K . . . . . . . . .  |  L . . . . . . . . . . K . . . . . . . . .
";

/// A row's starting lifecycle: `start` of `lifecycle_tests.rs`, with `+p`
/// (and `+kp`) setting the pause wish.
fn row(name: &str, idempotent: bool) -> Lifecycle {
    let (base, pause) = match name.strip_suffix("+p") {
        Some(base) => (base, true),
        None => (name, false),
    };
    let mut l = start(base, idempotent);
    l.pause_requested = pause;
    l
}

/// Checks every cell of `table` for the events `columns`; returns how many.
fn check(table: &str, columns: &[(&str, Event)]) -> usize {
    check_table(table, columns, row)
}

#[test]
fn pause_and_resume_match_the_table_for_every_status() {
    let columns = [("pause", Event::PauseRequested), ("resume", Event::ResumeRequested)];
    assert_eq!(check(PAUSE_COLUMNS, &columns), 13 * 2 * 2);
    // Every status has a row.
    for status in Status::ALL.into_iter().filter(|s| s.is_stored()) {
        let named = PAUSE_COLUMNS.lines().filter_map(|l| l.split_whitespace().next()).any(|n| {
            let base = n.split('+').next().unwrap_or(n);
            base == status.as_str()
        });
        assert!(named, "{status} has no row");
    }
}

#[test]
fn every_event_on_a_paused_task_matches_the_table() {
    assert_eq!(check(PAUSED_ROWS, &events()), 3 * 21 * 2);
}

#[test]
fn a_pause_holds_the_attempt_and_a_resume_lets_it_go_on() {
    let running = start("running", false);
    let Decision::Changed(paused) = apply(&running, &Event::PauseRequested) else { panic!("not paused") };
    assert_eq!((paused.status, paused.pause_requested), (Status::Paused, true));
    assert_eq!((paused.attempt, paused.epoch, &paused.worker), (running.attempt, running.epoch, &running.worker));
    assert!(paused.status.is_on_worker(), "a paused task keeps its slot");
    assert_eq!(apply(&paused, &Event::PauseRequested), Decision::Unchanged(Unchanged::Duplicate));
    let Decision::Changed(resumed) = apply(&paused, &Event::ResumeRequested) else { panic!("not resumed") };
    assert_eq!(resumed, running, "a resume undoes the pause and nothing else");
    assert_eq!(apply(&resumed, &Event::ResumeRequested), Decision::Unchanged(Unchanged::Duplicate));
}

#[test]
fn a_workflow_is_never_paused_its_steps_are() {
    let workflow = Lifecycle { worker: None, ..start("running", false) };
    assert_eq!(apply(&workflow, &Event::PauseRequested), Decision::Unchanged(Unchanged::NotApplicable));
}

#[test]
fn a_kill_ends_a_paused_task_with_its_reason() {
    let paused = row("paused+p", false);
    let Decision::Changed(stopping) = apply(&paused, &Event::KillRequested { reason: Some("stuck".into()) }) else {
        panic!("kill changed nothing")
    };
    assert_eq!((stopping.status, stopping.kill_requested), (Status::Stopping, true));
    assert_eq!(stopping.kill_reason.as_deref(), Some("stuck"));
    // A resume cannot take it back from the kill.
    assert_eq!(apply(&stopping, &Event::ResumeRequested), Decision::Unchanged(Unchanged::NotApplicable));
}

#[test]
fn evidence_of_a_paused_attempt_in_doubt_brings_it_back_paused_and_a_new_attempt_runs() {
    // Its non-idempotent worker was lost: unknown, the wish kept.
    let Decision::Changed(unknown) = apply(&row("paused+p", false), &Event::WorkerLost { worker: w("w1") }) else {
        panic!()
    };
    assert_eq!((unknown.status, unknown.pause_requested), (Status::Unknown, true));
    let started = Event::Started { attempt: Attempt(2), epoch: Epoch(5) };
    let Decision::Changed(back) = apply(&unknown, &started) else { panic!() };
    assert_eq!(back.status, Status::Paused);
    // With a kill pending too, the kill wins.
    let killed = Lifecycle { kill_requested: true, ..unknown.clone() };
    let Decision::Changed(back) = apply(&killed, &started) else { panic!() };
    assert_eq!(back.status, Status::Stopping);
    // An idempotent one is queued again with the wish; a new grant drops it.
    let Decision::Changed(queued) = apply(&row("paused+p", true), &Event::WorkerLost { worker: w("w1") }) else {
        panic!()
    };
    assert_eq!((queued.status, queued.pause_requested), (Status::Queued, true));
    let Decision::Changed(granted) = apply(&queued, &Event::Grant { worker: w("w2"), epoch: Epoch(6) }) else {
        panic!()
    };
    assert_eq!((granted.status, granted.pause_requested), (Status::Leased, false));
    let Decision::Changed(running) = apply(&granted, &Event::Started { attempt: Attempt(3), epoch: Epoch(6) }) else {
        panic!()
    };
    assert_eq!(running.status, Status::Running, "a new attempt starts running");
}

fn arb_event_with_pauses() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => arb_event(),
        1 => Just(Event::PauseRequested),
        1 => Just(Event::ResumeRequested),
    ]
}

proptest! {
    // Half the main table's histories: these add to them.
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Over any history with pauses and resumes: terminal absorbs them, a
    /// task is paused only while a started attempt on a worker is held on
    /// its owner's wish, a pause or resume never moves attempts, epochs,
    /// workers or the board, and a non-idempotent task is still queued
    /// again only on proof that its attempt never started.
    #[test]
    fn histories_with_pauses_keep_the_safety_rules(
        idempotent: bool,
        events in proptest::collection::vec(arb_event_with_pauses(), 0..40),
    ) {
        let mut l = Lifecycle::queued(idempotent);
        for e in &events {
            let before = l.clone();
            let after = apply(&before, e).resulting(&before);
            if before.status.is_terminal() {
                prop_assert_eq!(&Lifecycle { board: before.board, ..after.clone() }, &before);
            }
            if after.status == Status::Paused {
                prop_assert!(after.pause_requested && after.worker.is_some() && after.attempt.0 > 0);
            }
            if after.status == Status::Paused && before.status != Status::Paused {
                let by_owner = matches!(e, Event::PauseRequested) && before.status == Status::Running;
                let by_evidence = matches!(e, Event::Started { .. }) && before.pause_requested;
                prop_assert!(by_owner || by_evidence, "{:?} paused a {:?} task", e, before.status);
            }
            if matches!(e, Event::PauseRequested | Event::ResumeRequested) {
                prop_assert_eq!((after.attempt, after.epoch, &after.worker, after.board),
                    (before.attempt, before.epoch, &before.worker, before.board));
                prop_assert_eq!(&after.outcome, &before.outcome);
                if after.status != before.status {
                    let moved = (before.status, after.status);
                    prop_assert!(moved == (Status::Running, Status::Paused) || moved == (Status::Paused, Status::Running));
                }
            }
            prop_assert!(after.attempt >= before.attempt && after.epoch >= before.epoch);
            if !idempotent && after.status == Status::Queued && before.status != Status::Queued {
                // Only proof that nothing ran, or that the attempt's process is gone (a resume).
                prop_assert!(matches!(e, Event::Refused { .. } | Event::Resume { .. }), "{:?} requeued a non-idempotent task", e);
            }
            l = after;
        }
    }
}
