//! The lifecycle table, tested for every (status, event) pair, plus properties over
//! random event sequences.

use super::*;
use proptest::prelude::*;

pub(super) fn w(s: &str) -> WorkerId {
    s.parse().unwrap()
}

pub(super) fn outcome(ending: Ending) -> Outcome {
    Outcome::new(ending, None, None)
}

pub(super) fn hint() -> RecoveryHint {
    RecoveryHint { tag: HintTag::MaybeRan, message: "monitor gone, no exit status".into() }
}

/// The event columns of the table, in order.
pub(super) fn events() -> Vec<(&'static str, Event)> {
    let (cur, old) = (Attempt(2), Attempt(1));
    let (e, olde) = (Epoch(5), Epoch(4));
    vec![
        ("grant", Event::Grant { worker: w("w2"), epoch: e }),
        ("grant-old-epoch", Event::Grant { worker: w("w2"), epoch: olde }),
        ("refused", Event::Refused { attempt: cur, epoch: e }),
        ("refused-old-attempt", Event::Refused { attempt: old, epoch: e }),
        ("refused-old-epoch", Event::Refused { attempt: cur, epoch: olde }),
        ("started", Event::Started { attempt: cur, epoch: e }),
        ("started-old-attempt", Event::Started { attempt: old, epoch: Epoch(9) }),
        ("finished-completed", Event::Finished { attempt: cur, epoch: e, outcome: outcome(Ending::Completed) }),
        ("finished-failed", Event::Finished { attempt: cur, epoch: Epoch(6), outcome: outcome(Ending::Failed) }),
        ("finished-killed", Event::Finished { attempt: cur, epoch: e, outcome: outcome(Ending::Killed) }),
        ("finished-old-epoch", Event::Finished { attempt: cur, epoch: olde, outcome: outcome(Ending::Completed) }),
        ("kill", Event::KillRequested { reason: Some("not needed".into()) }),
        ("lost-holder", Event::WorkerLost { worker: w("w1") }),
        ("lost-other", Event::WorkerLost { worker: w("w9") }),
        ("attempt-lost", Event::Lost { attempt: cur, epoch: e, hint: hint() }),
        ("attempt-lost-old", Event::Lost { attempt: old, epoch: e, hint: hint() }),
        ("archive", Event::Archive),
        ("unarchive", Event::Unarchive),
        ("delete", Event::Delete),
        ("steps-began", Event::StepsBegan { epoch: e }),
        ("steps-ended", Event::StepsEnded { outcome: outcome(Ending::Completed) }),
    ]
}

/// Rows: a starting status (with `+k` when a kill was already requested), then one
/// cell per event column for a non-idempotent task, a `|`, and the same for an
/// idempotent one. A cell is the resulting status letter, or `.` for "unchanged".
/// Q queued, L leased, R running, S stopping, C completed, K killed, F failed, U unknown, B blocked.
const TABLE: &str = "
    queued     L . . . . . . . . . . K . . . . . . . . .  |  L . . . . . . . . . . K . . . . . . . . .
    leased     . . Q . . R . C F K . S U . U . . . . . .  |  . . Q . . R . C F K . S Q . U . . . . . .
    running    . . . . . . . C F K . S U . U . . . . . .  |  . . . . . . . C F K . S Q . U . . . . . .
    stopping+k . . K . . . . C F K . . S . U . . . . . .  |  . . K . . . . C F K . . S . U . . . . . .
    completed  . . . . . . . . . . . . . . . . C . C . .  |  . . . . . . . . . . . . . . . . C . C . .
    killed     . . . . . . . . . . . . . . . . K . K . .  |  . . . . . . . . . . . . . . . . K . K . .
    failed     . . . . . . . . . . . . . . . . F . F . .  |  . . . . . . . . . . . . . . . . F . F . .
    unknown    . . Q . . R . C F K . U . . U . . . . . .  |  . . Q . . R . C F K . U . . U . . . . . .
    unknown+k  . . K . . S . C F K . . . . U . . . . . .  |  . . K . . S . C F K . . . . U . . . . . .
    blocked    . . . . . . . . . . . K . . . . . . . . .  |  . . . . . . . . . . . K . . . . . . . . .
";

pub(super) fn letter(s: Status) -> char {
    match s {
        Status::Queued => 'Q',
        Status::Leased => 'L',
        Status::Running => 'R',
        Status::Stopping => 'S',
        Status::Completed => 'C',
        Status::Killed => 'K',
        Status::Failed => 'F',
        Status::Unknown => 'U',
        Status::Paused => 'P',
        Status::Blocked => 'B',
        Status::Waiting => 'W',
    }
}

pub(super) fn start(row: &str, idempotent: bool) -> Lifecycle {
    let (name, kill) = match row.strip_suffix("+k") {
        Some(n) => (n, true),
        None => (row, false),
    };
    let status = Status::ALL.into_iter().find(|s| s.as_str() == name).expect("row status");
    if status == Status::Blocked {
        // Held at submit: no attempt yet.
        let held = RecoveryHint { tag: HintTag::AwaitingApproval, message: "held".into() };
        return Lifecycle {
            kill_requested: kill,
            kill_reason: kill.then(|| "first".into()),
            ..Lifecycle::held(idempotent, held)
        };
    }
    Lifecycle {
        status,
        attempt: Attempt(2),
        epoch: Epoch(5),
        worker: Some(w("w1")),
        idempotent,
        kill_requested: kill,
        kill_reason: kill.then(|| "first".into()),
        hint: None,
        outcome: None,
        board: Board::Active,
        pause_requested: false,
    }
}

/// Checks every cell of `table` (rows named as `start` reads them, one cell
/// per event of `columns`, a `|` between the non-idempotent and the
/// idempotent half); returns how many. A change must change something and
/// never the task's idempotence.
pub(super) fn check_table(table: &str, columns: &[(&str, Event)], start: impl Fn(&str, bool) -> Lifecycle) -> usize {
    let mut checked = 0;
    for line in table.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let (left, right) = line.split_once('|').expect("two halves");
        let mut left = left.split_whitespace();
        let row = left.next().expect("row name");
        for (idempotent, cells) in [(false, left.collect::<Vec<_>>()), (true, right.split_whitespace().collect())] {
            assert_eq!(cells.len(), columns.len(), "row {row}");
            for ((name, event), cell) in columns.iter().zip(cells) {
                let before = start(row, idempotent);
                let decision = apply(&before, event);
                let got = match &decision {
                    Decision::Changed(after) => {
                        assert_ne!(after, &before, "{row}/{name}: Changed must change something");
                        assert_eq!(after.idempotent, before.idempotent, "{row}/{name}");
                        letter(after.status).to_string()
                    }
                    Decision::Unchanged(_) => ".".to_string(),
                };
                assert_eq!(got, cell, "row {row} idempotent={idempotent} event {name}: got {decision:?}");
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn every_status_event_pair_matches_the_table() {
    assert_eq!(check_table(TABLE, &events(), start), 10 * 21 * 2);
}

#[test]
fn kill_of_a_stopping_task_after_a_lost_worker_keeps_the_hint() {
    let l = start("stopping+k", false);
    let Decision::Changed(after) = apply(&l, &Event::WorkerLost { worker: w("w1") }) else { panic!() };
    assert_eq!(after.status, Status::Stopping);
    assert_eq!(after.hint.as_ref().unwrap().tag, HintTag::KillPending);
    assert_eq!(apply(&after, &Event::WorkerLost { worker: w("w1") }), Decision::Unchanged(Unchanged::Duplicate));
}

#[test]
fn lost_non_idempotent_tasks_carry_a_hint() {
    for (row, tag) in [("leased", HintTag::WorkerUnreachable), ("running", HintTag::WorkerUnreachable)] {
        let Decision::Changed(after) = apply(&start(row, false), &Event::WorkerLost { worker: w("w1") }) else {
            panic!()
        };
        assert_eq!(after.status, Status::Unknown);
        assert_eq!(after.hint.unwrap().tag, tag);
    }
}

#[test]
fn grant_increments_the_attempt_and_stamps_the_epoch() {
    let l = Lifecycle::queued(false);
    let Decision::Changed(after) = apply(&l, &Event::Grant { worker: w("w3"), epoch: Epoch(7) }) else { panic!() };
    assert_eq!((after.attempt, after.epoch, after.worker), (Attempt(1), Epoch(7), Some(w("w3"))));
    // Attempt 0 never matches a report: nothing was granted yet.
    assert_eq!(
        apply(&l, &Event::Started { attempt: Attempt(0), epoch: Epoch(7) }),
        Decision::Unchanged(Unchanged::Stale)
    );
}

#[test]
fn the_last_attempt_number_is_never_granted_twice() {
    let l = Lifecycle { attempt: Attempt(u32::MAX), ..Lifecycle::queued(true) };
    assert_eq!(
        apply(&l, &Event::Grant { worker: w("w1"), epoch: Epoch(7) }),
        Decision::Unchanged(Unchanged::NotApplicable)
    );
}

#[test]
fn outcomes_and_hints_from_the_network_are_cut_to_their_limits() {
    let long = "é".repeat(MAX_DETAIL_BYTES);
    let o = Outcome {
        output: Some("x".repeat(MAX_FINAL_OUTPUT_BYTES * 3).into()),
        ..Outcome::new(Ending::Failed, None, Some(long.clone()))
    }
    .bounded();
    assert!(o.detail.as_deref().is_some_and(|d| d.len() <= MAX_DETAIL_BYTES), "detail cut");
    let out = o.output.as_deref().unwrap_or_default();
    assert!(
        out.len() <= MAX_KEPT_OUTPUT_BYTES && out.ends_with('x') && out.starts_with("[tenure:"),
        "tail kept with a note"
    );
    let h = RecoveryHint { tag: HintTag::MaybeRan, message: long }.bounded();
    assert!(h.message.len() <= MAX_HINT_BYTES);
    // Short ones are untouched.
    let small = Outcome::new(Ending::Completed, Some(0), Some("ok".into()));
    assert_eq!(small.clone().bounded(), small);
}

pub(super) fn arb_event() -> impl Strategy<Value = Event> {
    let worker = prop_oneof![Just(w("w1")), Just(w("w2"))];
    let attempt = (0u32..4).prop_map(Attempt);
    let epoch = (0u64..4).prop_map(Epoch);
    let ending = prop_oneof![Just(Ending::Completed), Just(Ending::Failed), Just(Ending::Killed)];
    prop_oneof![
        (worker.clone(), epoch.clone()).prop_map(|(worker, epoch)| Event::Grant { worker, epoch }),
        (attempt.clone(), epoch.clone()).prop_map(|(attempt, epoch)| Event::Refused { attempt, epoch }),
        (attempt.clone(), epoch.clone()).prop_map(|(attempt, epoch)| Event::Started { attempt, epoch }),
        (attempt, epoch, ending).prop_map(|(attempt, epoch, ending)| Event::Finished {
            attempt,
            epoch,
            outcome: outcome(ending)
        }),
        Just(Event::KillRequested { reason: None }),
        worker.prop_map(|worker| Event::WorkerLost { worker }),
        ((0u32..4).prop_map(Attempt), (0u64..4).prop_map(Epoch)).prop_map(|(attempt, epoch)| Event::Lost {
            attempt,
            epoch,
            hint: hint()
        }),
        Just(Event::Archive),
        Just(Event::Unarchive),
        Just(Event::Delete),
        (0u64..4).prop_map(|e| Event::StepsBegan { epoch: Epoch(e) }),
        ((0u32..4).prop_map(Attempt), (0u64..4).prop_map(Epoch))
            .prop_map(|(attempt, epoch)| Event::Retry { attempt, epoch }),
        ((0u32..4).prop_map(Attempt), (0u64..4).prop_map(Epoch))
            .prop_map(|(attempt, epoch)| Event::Resume { attempt, epoch }),
        prop_oneof![Just(w("w1")), Just(w("w2"))].prop_map(|worker| Event::WorkerLostFinal { worker }),
        prop_oneof![Just(Ending::Completed), Just(Ending::Failed), Just(Ending::Killed)]
            .prop_map(|ending| Event::StepsEnded { outcome: outcome(ending) }),
        Just(Event::Approved),
    ]
}

fn names_attempt(e: &Event) -> Option<(Attempt, Epoch)> {
    match e {
        Event::Refused { attempt, epoch }
        | Event::Started { attempt, epoch }
        | Event::Finished { attempt, epoch, .. }
        | Event::Retry { attempt, epoch }
        | Event::Resume { attempt, epoch } => Some((*attempt, *epoch)),
        _ => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Safety properties over any history: terminal absorbs, stale evidence is
    /// inert, attempts and epochs never go back, and a non-idempotent task is only
    /// queued again on proof that its attempt never started.
    #[test]
    fn histories_keep_the_safety_rules(
        idempotent: bool,
        held: bool,
        events in proptest::collection::vec(arb_event(), 0..40),
    ) {
        let mut l = match held {
            true => Lifecycle::held(idempotent, RecoveryHint { tag: HintTag::AwaitingApproval, message: "held".into() }),
            false => Lifecycle::queued(idempotent),
        };
        for e in &events {
            let before = l.clone();
            let decision = apply(&before, e);
            let after = decision.resulting(&before);
            if before.status.is_terminal() {
                // Only the board may still move.
                prop_assert_eq!(&Lifecycle { board: before.board, ..after.clone() }, &before);
            }
            if let Some((attempt, epoch)) = names_attempt(e) {
                if attempt != before.attempt || epoch < before.epoch {
                    prop_assert_eq!(&after, &before, "stale {:?}", e);
                }
            }
            prop_assert!(after.attempt >= before.attempt && after.epoch >= before.epoch);
            if !idempotent && after.status == Status::Queued && before.status != Status::Queued {
                // An approval queues a task that never had an attempt.
                let never_ran = matches!(e, Event::Approved) && after.attempt == Attempt(0);
                // A resume is the coordinator's word that the attempt's process is gone.
                let resumed = matches!(e, Event::Resume { .. });
                prop_assert!(matches!(e, Event::Refused { .. }) || never_ran || resumed, "{:?} requeued a non-idempotent task", e);
            }
            // A resume never outruns a kill.
            if matches!(e, Event::Resume { .. }) && after != before {
                prop_assert!(!before.kill_requested && after.status == Status::Queued, "{:?} resumed {:?}", e, before);
            }
            // A retry never outruns a kill, and never queues what is not idempotent.
            if matches!(e, Event::Retry { .. }) && after != before {
                prop_assert!(idempotent && !before.kill_requested, "{:?} retried {:?}", e, before);
            }
            if after.status == Status::Unknown && before.status != Status::Unknown {
                prop_assert!(after.hint.is_some());
            }
            // A held task leaves `blocked` only by its approval (queued, as
            // it was submitted) or a kill (killed, never having run), and
            // nothing else ever enters it.
            if before.status == Status::Blocked && after.status != Status::Blocked {
                let approved = matches!(e, Event::Approved) && after.status == Status::Queued;
                let killed = matches!(e, Event::KillRequested { .. }) && after.status == Status::Killed;
                prop_assert!(approved || killed, "{:?} moved a blocked task to {:?}", e, after.status);
                prop_assert_eq!((after.attempt, &after.worker), (Attempt(0), &None));
            }
            if after.status == Status::Blocked {
                prop_assert!(before.status == Status::Blocked, "{:?} blocked a {:?} task", e, before.status);
            }
            // An attempt runs on a worker, or is a workflow's steps: nothing
            // about a given-up attempt brings it back without one.
            if matches!(after.status, Status::Leased | Status::Running | Status::Stopping) && after.worker.is_none() {
                let steps = before.worker.is_none() && before.status != Status::Queued || matches!(e, Event::StepsBegan { .. });
                prop_assert!(steps, "{:?} moved {:?} to {:?} without a worker", e, before.status, after.status);
            }
            // Deleted is for good; a board move never touches the status; and
            // nothing that is not finished (or unknown) leaves the active board.
            if before.board == Board::Deleted {
                prop_assert_eq!(after.board, Board::Deleted);
            }
            if after.board != before.board {
                prop_assert_eq!(after.status, before.status);
            }
            if after.board != Board::Active {
                prop_assert!(after.status.is_terminal());
            }
            l = after;
        }
    }
}

#[test]
fn a_late_start_report_never_revives_an_attempt_its_machine_reported_lost() {
    let mut l = start("unknown", false);
    l.hint = Some(Box::new(hint()));
    assert_eq!(
        apply(&l, &Event::Started { attempt: Attempt(2), epoch: Epoch(5) }),
        Decision::Unchanged(Unchanged::NotApplicable)
    );
    l.hint = Some(Box::new(RecoveryHint { tag: HintTag::WorkerUnreachable, message: "away".into() }));
    let Decision::Changed(after) = apply(&l, &Event::Started { attempt: Attempt(2), epoch: Epoch(5) }) else {
        panic!()
    };
    assert_eq!(after.status, Status::Running);
}

#[test]
fn board_moves_only_for_finished_tasks_and_deleted_is_for_good() {
    let l = start("completed", false);
    let Decision::Changed(archived) = apply(&l, &Event::Archive) else { panic!() };
    assert_eq!((archived.board, archived.status), (Board::Archived, Status::Completed));
    let Decision::Changed(back) = apply(&archived, &Event::Unarchive) else { panic!() };
    assert_eq!(back.board, Board::Active);
    let Decision::Changed(deleted) = apply(&archived, &Event::Delete) else { panic!() };
    assert_eq!(deleted.board, Board::Deleted);
    assert_eq!(apply(&deleted, &Event::Unarchive), Decision::Unchanged(Unchanged::NotApplicable));
    // Late evidence changes nothing on a finished task, deleted or not.
    let late = Event::Started { attempt: Attempt(2), epoch: Epoch(5) };
    assert_eq!(apply(&deleted, &late), Decision::Unchanged(Unchanged::Terminal));
    // An unknown task must be settled before it leaves the board.
    assert_eq!(apply(&start("unknown", false), &Event::Delete), Decision::Unchanged(Unchanged::NotApplicable));
}

#[test]
fn a_workflow_runs_without_a_worker_and_settles_only_by_its_steps() {
    let l = Lifecycle::queued(false);
    let Decision::Changed(running) = apply(&l, &Event::StepsBegan { epoch: Epoch(3) }) else { panic!() };
    assert_eq!(
        (running.status, running.attempt, running.epoch, running.worker.clone()),
        (Status::Running, Attempt(1), Epoch(3), None)
    );
    assert_eq!(apply(&running, &Event::StepsBegan { epoch: Epoch(3) }), Decision::Unchanged(Unchanged::Duplicate));
    // No worker holds it: a lost worker or a late worker report means nothing.
    assert_eq!(apply(&running, &Event::WorkerLost { worker: w("w1") }), Decision::Unchanged(Unchanged::NotApplicable));
    let Decision::Changed(stopping) = apply(&running, &Event::KillRequested { reason: None }) else { panic!() };
    assert_eq!(stopping.status, Status::Stopping);
    let ended = Event::StepsEnded { outcome: outcome(Ending::Killed) };
    let Decision::Changed(killed) = apply(&stopping, &ended) else { panic!() };
    assert_eq!(killed.status, Status::Killed);
    assert_eq!(apply(&killed, &ended), Decision::Unchanged(Unchanged::Terminal));
    // A task on a worker never ends by steps, and a requeued one never begins them.
    assert_eq!(apply(&start("running", false), &ended), Decision::Unchanged(Unchanged::NotApplicable));
    let requeued = Lifecycle { attempt: Attempt(1), ..Lifecycle::queued(true) };
    assert_eq!(apply(&requeued, &Event::StepsBegan { epoch: Epoch(3) }), Decision::Unchanged(Unchanged::NotApplicable));
}

#[test]
fn a_kill_keeps_the_first_reason_and_a_finished_task_takes_none() {
    let kill = |reason: Option<&str>| Event::KillRequested { reason: reason.map(Into::into) };
    for (status, reason, stays) in [
        ("queued", Some("no longer needed"), "no longer needed"),
        ("running", Some("wrong branch"), "wrong branch"),
        ("leased", None, ""),
    ] {
        let l = start(status, false);
        let Decision::Changed(next) = apply(&l, &kill(reason)) else { panic!("{status}: a kill changed nothing") };
        assert_eq!(next.kill_reason.as_deref().unwrap_or(""), stays, "{status}");
        assert!(next.kill_requested);
        // A second kill, with another reason, keeps the first.
        let again = match apply(&next, &kill(Some("second thoughts"))) {
            Decision::Changed(l) => l,
            Decision::Unchanged(_) => next.clone(),
        };
        assert_eq!(again.kill_reason, next.kill_reason, "{status}");
    }
    for status in ["completed", "killed", "failed"] {
        assert!(matches!(apply(&start(status, false), &kill(Some("late"))), Decision::Unchanged(Unchanged::Terminal)));
    }
}

// ---------------------------------------------------------------- retries

/// The retry event columns, apart from the main table so that its rows keep
/// their shape.
fn retry_events() -> Vec<(&'static str, Event)> {
    vec![
        ("retry", Event::Retry { attempt: Attempt(2), epoch: Epoch(5) }),
        ("retry-old-attempt", Event::Retry { attempt: Attempt(1), epoch: Epoch(5) }),
        ("retry-old-epoch", Event::Retry { attempt: Attempt(2), epoch: Epoch(4) }),
        ("lost-final-holder", Event::WorkerLostFinal { worker: w("w1") }),
        ("lost-final-other", Event::WorkerLostFinal { worker: w("w9") }),
        ("resume", Event::Resume { attempt: Attempt(2), epoch: Epoch(5) }),
        ("resume-old-attempt", Event::Resume { attempt: Attempt(1), epoch: Epoch(5) }),
        ("resume-old-epoch", Event::Resume { attempt: Attempt(2), epoch: Epoch(4) }),
    ]
}

/// Same shape as [`TABLE`]: a retry queues again only an idempotent task's
/// current attempt, never after a kill; a final loss treats an idempotent
/// task as a non-idempotent one is treated; a resume queues again the
/// current attempt of either kind of task, never after a kill.
const RETRY_TABLE: &str = "
    queued     . . . . . . . .  |  . . . . . . . .
    leased     . . . U . Q . .  |  Q . . U . Q . .
    running    . . . U . Q . .  |  Q . . U . Q . .
    stopping+k . . . S . . . .  |  . . . S . . . .
    completed  . . . . . . . .  |  . . . . . . . .
    killed     . . . . . . . .  |  . . . . . . . .
    failed     . . . . . . . .  |  . . . . . . . .
    unknown    . . . . . Q . .  |  Q . . . . Q . .
    unknown+k  . . . . . . . .  |  . . . . . . . .
";

#[test]
fn every_status_retry_event_pair_matches_the_retry_table() {
    assert_eq!(check_table(RETRY_TABLE, &retry_events(), start), 9 * 8 * 2);
}

#[test]
fn a_retried_task_is_queued_clean_with_its_attempt_kept_and_its_next_grant_is_a_new_attempt() {
    let l = start("running", true);
    let Decision::Changed(q) = apply(&l, &Event::Retry { attempt: Attempt(2), epoch: Epoch(5) }) else { panic!() };
    assert_eq!((q.status, q.attempt, q.worker.clone(), q.outcome.clone()), (Status::Queued, Attempt(2), None, None));
    let Decision::Changed(next) = apply(&q, &Event::Grant { worker: w("w2"), epoch: Epoch(5) }) else { panic!() };
    assert_eq!(next.attempt, Attempt(3));
    // Reports of the retried attempt are stale once the next one was granted.
    let late = Event::Finished { attempt: Attempt(2), epoch: Epoch(5), outcome: outcome(Ending::Failed) };
    assert_eq!(apply(&next, &late), Decision::Unchanged(Unchanged::Stale));
}

#[test]
fn a_final_loss_of_an_idempotent_task_names_its_retry_policy() {
    let Decision::Changed(after) = apply(&start("running", true), &Event::WorkerLostFinal { worker: w("w1") }) else {
        panic!()
    };
    assert_eq!(after.status, Status::Unknown);
    let hint = after.hint.expect("hint");
    assert_eq!(hint.tag, HintTag::WorkerUnreachable);
    assert!(hint.message.contains("retry policy"), "{}", hint.message);
}

/// Approval, against every status: only a held task moves (to `queued`);
/// a second approval is a duplicate, never a second effect.
#[test]
fn an_approval_queues_a_held_task_once_and_nothing_else() {
    for status in Status::ALL.into_iter().filter(|s| s.is_stored()) {
        for idempotent in [false, true] {
            let before = start(status.as_str(), idempotent);
            let decision = apply(&before, &Event::Approved);
            match status {
                Status::Blocked => {
                    let Decision::Changed(after) = &decision else { panic!("{decision:?}") };
                    assert_eq!((after.status, after.hint.as_ref(), after.attempt), (Status::Queued, None, Attempt(0)));
                    assert_eq!(apply(after, &Event::Approved), Decision::Unchanged(Unchanged::Duplicate));
                }
                s if s.is_terminal() => assert_eq!(decision, Decision::Unchanged(Unchanged::Terminal), "{s}"),
                // The table's queued row has had an attempt: not held, not approvable.
                s => assert_eq!(decision, Decision::Unchanged(Unchanged::NotApplicable), "{s}"),
            }
        }
    }
    let held = start("blocked", false);
    let Decision::Changed(killed) = apply(&held, &Event::KillRequested { reason: Some("not now".into()) }) else {
        panic!()
    };
    assert_eq!(killed.status, Status::Killed);
    assert_eq!(killed.kill_reason.as_deref(), Some("not now"));
    assert!(killed.outcome.as_ref().and_then(|o| o.detail.as_deref()).is_some_and(|d| d.contains("never ran")));
    assert_eq!(
        apply(&held, &Event::Grant { worker: w("w1"), epoch: Epoch(1) }),
        Decision::Unchanged(Unchanged::NotApplicable)
    );
}
