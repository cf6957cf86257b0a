//! The sidecar's rules, tested for every (phase, request) pair against a
//! [`MemoryStore`], then again against a [`FailingStore`] to prove that a failed
//! write answers `Storage` and changes nothing.

use super::*;
use crate::store::{attempt_key, FailingStore, MemoryStore};
use tenure_protocol::{Ending, TaskSpec};

const PID: i32 = 100;

fn task() -> TaskId {
    "shell-1".parse().unwrap()
}

fn grant(attempt: u32, epoch: u64) -> LeaseGrant {
    LeaseGrant {
        input: Vec::new(),
        task: task(),
        attempt: Attempt(attempt),
        epoch: Epoch(epoch),
        owner: "alice".parse().unwrap(),
        spec: TaskSpec::shell("l", "echo hi"),
        mark: None,
    }
}

fn o1() -> Outcome {
    Outcome::new(Ending::Completed, Some(0), None)
}

fn o2() -> Outcome {
    Outcome::new(Ending::Failed, Some(3), Some("exit code: 3".into()))
}

fn intent(epoch: u64) -> SidecarRequest {
    SidecarRequest::Intent { task: task(), attempt: Attempt(2), epoch: Epoch(epoch), trace: None }
}

fn spawned(pid: i32) -> SidecarRequest {
    SidecarRequest::Spawned { task: task(), attempt: Attempt(2), pid }
}

fn exited(outcome: Outcome) -> SidecarRequest {
    SidecarRequest::Exited { task: task(), attempt: Attempt(2), outcome }
}

fn ack() -> SidecarRequest {
    SidecarRequest::Acknowledged { task: task(), attempt: Attempt(2) }
}

fn abandon() -> SidecarRequest {
    SidecarRequest::Abandon { task: task(), attempt: Attempt(2) }
}

/// The request columns of the table, in order. Every request names attempt 2
/// of `shell-1`; the row's record (if any) is that attempt, granted at epoch 5.
fn requests() -> Vec<(&'static str, SidecarRequest)> {
    let mut other_owner = grant(2, 5);
    other_owner.owner = "mallory".parse().unwrap();
    vec![
        ("accept", SidecarRequest::Accept(grant(2, 5))),
        ("accept-other-owner", SidecarRequest::Accept(other_owner)),
        ("accept-old-epoch", SidecarRequest::Accept(grant(2, 4))),
        ("intent", intent(5)),
        ("intent-old-epoch", intent(4)),
        ("spawned", spawned(PID)),
        ("spawned-other-pid", spawned(200)),
        ("exited", exited(o1())),
        ("exited-other-outcome", exited(o2())),
        ("ack", ack()),
        ("abandon", abandon()),
    ]
}

/// Rows: the record's starting phase, then one cell per request column.
/// `.` Ok and nothing changed; `A I S E K` Ok and the record is now Accepted,
/// Intent, Spawned, Exited, Acknowledged; `-` Ok and the record is gone;
/// `u` UnknownAttempt; `w` WrongPhase; `e` StaleEpoch; `t` Ok and the attempt
/// tombstoned (it can never be accepted).
const TABLE: &str = "
    absent        A A e u e u u u u u t
    accepted      . w e I e w w w w w -
    intent        w w e . e S S E E w w
    spawned       w w e . e . w E E w w
    exited        w w e . e . w . . K w
    exited-no-pid w w e . e w w . . K w
    acknowledged  w w e . e . w . . . w
";

/// A machine at held epoch 5 whose attempt 2 of shell-1 is in `row`'s phase,
/// reached through the real requests.
fn machine_in(row: &str) -> Machine<MemoryStore> {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    assert_eq!(m.handle(SidecarRequest::ObserveEpoch(Epoch(5))), SidecarReply::Ok);
    let steps: Vec<SidecarRequest> = match row {
        "absent" => vec![],
        "accepted" => vec![SidecarRequest::Accept(grant(2, 5))],
        "intent" => vec![SidecarRequest::Accept(grant(2, 5)), intent(5)],
        "spawned" => vec![SidecarRequest::Accept(grant(2, 5)), intent(5), spawned(PID)],
        "exited" => vec![SidecarRequest::Accept(grant(2, 5)), intent(5), spawned(PID), exited(o1())],
        "exited-no-pid" => vec![SidecarRequest::Accept(grant(2, 5)), intent(5), exited(o1())],
        "acknowledged" => vec![SidecarRequest::Accept(grant(2, 5)), intent(5), spawned(PID), exited(o1()), ack()],
        other => panic!("unknown row {other}"),
    };
    for step in steps {
        assert_eq!(m.handle(step), SidecarReply::Ok, "setting up {row}");
    }
    m
}

fn phase_letter(p: Phase) -> char {
    match p {
        Phase::Accepted => 'A',
        Phase::Intent => 'I',
        Phase::Spawned => 'S',
        Phase::Exited => 'E',
        Phase::Acknowledged => 'K',
    }
}

/// Everything observable about a machine.
fn state<S: RecoveryStore>(m: &Machine<S>) -> (Epoch, Vec<AttemptRecord>, bool) {
    (m.epoch(), m.records().cloned().collect(), m.is_revoked(&task(), Attempt(2)))
}

fn target<S: RecoveryStore>(m: &Machine<S>) -> Option<AttemptRecord> {
    m.record(&task(), Attempt(2)).cloned()
}

/// The letter describing what `req` did, checking on the way that the store
/// mirrors memory and that a refusal or a no-op wrote nothing.
fn apply(m: &mut Machine<MemoryStore>, req: SidecarRequest) -> char {
    let before = state(m);
    let target_before = target(m);
    let writes_before = m.store().writes();
    let reply = m.handle(req);
    let after = state(m);
    let restored = Machine::restore(m.store().clone()).unwrap();
    assert_eq!(state(&restored), after, "store does not mirror memory");
    let letter = match reply {
        SidecarReply::Ok if after == before => '.',
        SidecarReply::Ok if after.2 && !before.2 && after.1 == before.1 => 't',
        SidecarReply::Ok => match target(m) {
            None => '-',
            Some(r) => phase_letter(r.phase),
        },
        SidecarReply::Refused(SidecarRefusal::UnknownAttempt { .. }) => 'u',
        SidecarReply::Refused(SidecarRefusal::WrongPhase { .. }) => 'w',
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { .. }) => 'e',
        other => panic!("unexpected reply {other:?}"),
    };
    if matches!(letter, '.' | 'u' | 'w' | 'e') {
        assert_eq!(after, before, "refusal or no-op changed state");
        assert_eq!(m.store().writes(), writes_before, "refusal or no-op wrote");
    } else if letter != 't' && target_before.as_ref().map(|r| r.phase) == target(m).map(|r| r.phase) {
        panic!("a change letter without a phase change");
    }
    letter
}

fn table() -> Vec<(&'static str, Vec<char>)> {
    TABLE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut words = line.split_whitespace();
            let row = words.next().unwrap();
            let cells: Vec<char> = words.map(|w| w.chars().next().unwrap()).collect();
            assert_eq!(cells.len(), requests().len(), "row {row}");
            (row, cells)
        })
        .collect()
}

#[test]
fn every_phase_and_request() {
    let mut failures = Vec::new();
    for (row, cells) in table() {
        for ((name, req), want) in requests().into_iter().zip(cells) {
            let mut m = machine_in(row);
            let got = apply(&mut m, req);
            if got != want {
                failures.push(format!("{row} + {name}: want {want}, got {got}"));
            }
        }
    }
    assert!(failures.is_empty(), "table mismatches:\n{}", failures.join("\n"));
}

#[test]
fn every_change_fails_cleanly_when_the_store_fails() {
    for (row, cells) in table() {
        for ((name, req), want) in requests().into_iter().zip(cells) {
            let mut m = Machine::restore(FailingStore::new(machine_in(row).into_store())).unwrap();
            let before = state(&m);
            let reply = m.handle(req);
            assert_eq!(state(&m), before, "{row} + {name} changed state with a failing store");
            let refused_storage = matches!(reply, SidecarReply::Refused(SidecarRefusal::Storage(_)));
            let is_change = !matches!(want, '.' | 'u' | 'w' | 'e');
            assert_eq!(refused_storage, is_change, "{row} + {name}: {reply:?}");
        }
    }
}

#[test]
fn the_details_the_table_does_not_show() {
    // Spawned records the pid; exited keeps it and records the first outcome.
    let mut m = machine_in("intent");
    assert_eq!(m.handle(spawned(200)), SidecarReply::Ok);
    assert_eq!(m.handle(exited(o2())), SidecarReply::Ok);
    assert_eq!(m.handle(exited(o1())), SidecarReply::Ok);
    let r = target(&m).unwrap();
    assert_eq!((r.phase, r.pid, r.outcome), (Phase::Exited, Some(200), Some(o2())));

    // An outcome straight from intent (spawn failed): no pid.
    let mut m = machine_in("intent");
    assert_eq!(m.handle(exited(o2())), SidecarReply::Ok);
    assert_eq!(target(&m).unwrap().pid, None);
}

#[test]
fn refusals_say_what_and_why() {
    let mut m = machine_in("accepted");
    assert_eq!(
        m.handle(spawned(PID)),
        SidecarReply::Refused(SidecarRefusal::WrongPhase {
            task: task(),
            attempt: Attempt(2),
            phase: Phase::Accepted,
            action: "record a process before its intent".into(),
        })
    );
    assert_eq!(
        m.handle(intent(4)),
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(5), offered: Epoch(4) })
    );
    assert_eq!(
        m.handle(SidecarRequest::Exited { task: task(), attempt: Attempt(9), outcome: o1() }),
        SidecarReply::Refused(SidecarRefusal::UnknownAttempt { task: task(), attempt: Attempt(9) })
    );
    let mut m = machine_in("intent");
    match m.handle(abandon()) {
        SidecarReply::Refused(SidecarRefusal::WrongPhase { phase: Phase::Intent, action, .. }) => {
            assert!(action.contains("may have run"), "{action}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn observe_epoch_fences_and_persists() {
    let mut m = machine_in("absent");
    assert_eq!(m.handle(SidecarRequest::ObserveEpoch(Epoch(5))), SidecarReply::Ok);
    assert_eq!(
        m.handle(SidecarRequest::ObserveEpoch(Epoch(4))),
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(5), offered: Epoch(4) })
    );
    let writes = m.store().writes();
    assert_eq!(m.handle(SidecarRequest::ObserveEpoch(Epoch(5))), SidecarReply::Ok);
    assert_eq!(m.store().writes(), writes, "an equal epoch is not rewritten");
    assert_eq!(m.handle(SidecarRequest::ObserveEpoch(Epoch(8))), SidecarReply::Ok);
    assert_eq!(Machine::restore(m.into_store()).unwrap().epoch(), Epoch(8));

    let mut m = Machine::restore(FailingStore::new(machine_in("absent").into_store())).unwrap();
    assert!(matches!(
        m.handle(SidecarRequest::ObserveEpoch(Epoch(6))),
        SidecarReply::Refused(SidecarRefusal::Storage(_))
    ));
    assert_eq!(m.epoch(), Epoch(5));
}

#[test]
fn a_higher_epoch_is_observed_before_the_request_is_decided() {
    // Accept under a newer leader raises the fence and records the grant.
    let mut m = machine_in("absent");
    assert_eq!(m.handle(SidecarRequest::Accept(grant(2, 7))), SidecarReply::Ok);
    assert_eq!(m.epoch(), Epoch(7));
    assert_eq!(target(&m).unwrap().grant.epoch, Epoch(7));

    // Intent under a newer leader moves the grant to that epoch.
    let mut m = machine_in("accepted");
    assert_eq!(m.handle(intent(6)), SidecarReply::Ok);
    assert_eq!((m.epoch(), target(&m).unwrap().grant.epoch), (Epoch(6), Epoch(6)));
    assert_eq!(m.handle(intent(7)), SidecarReply::Ok);
    assert_eq!((m.epoch(), target(&m).unwrap().grant.epoch), (Epoch(7), Epoch(7)));
    // A re-sent grant under a newer leader does the same.
    let mut m = machine_in("accepted");
    assert_eq!(m.handle(SidecarRequest::Accept(grant(2, 9))), SidecarReply::Ok);
    assert_eq!(
        (m.epoch(), target(&m).unwrap().phase, target(&m).unwrap().grant.epoch),
        (Epoch(9), Phase::Accepted, Epoch(9))
    );

    // Once spawned, the grant's epoch stays; the fence still rises.
    let mut m = machine_in("spawned");
    assert_eq!(m.handle(intent(8)), SidecarReply::Ok);
    assert_eq!((m.epoch(), target(&m).unwrap().grant.epoch), (Epoch(8), Epoch(5)));

    // Even an intent for an unknown attempt raises the fence: the epoch was seen.
    let mut m = machine_in("absent");
    assert!(matches!(m.handle(intent(6)), SidecarReply::Refused(SidecarRefusal::UnknownAttempt { .. })));
    assert_eq!(m.epoch(), Epoch(6));
}

#[test]
fn an_older_attempt_than_one_held_is_refused() {
    let mut m = machine_in("accepted");
    assert_eq!(m.handle(SidecarRequest::Accept(grant(3, 5))), SidecarReply::Ok);
    match m.handle(SidecarRequest::Accept(grant(1, 5))) {
        SidecarReply::Refused(SidecarRefusal::WrongPhase { attempt, phase, .. }) => {
            assert_eq!((attempt, phase), (Attempt(3), Phase::Accepted))
        }
        other => panic!("{other:?}"),
    }
    // The repeated grant of attempt 2 is also older than attempt 3 now.
    assert!(matches!(
        m.handle(SidecarRequest::Accept(grant(2, 5))),
        SidecarReply::Refused(SidecarRefusal::WrongPhase { .. })
    ));
    // Nor may the superseded attempt start.
    match m.handle(intent(5)) {
        SidecarReply::Refused(SidecarRefusal::WrongPhase { attempt, action, .. }) => {
            assert_eq!(attempt, Attempt(3));
            assert!(action.contains("older"), "{action}");
        }
        other => panic!("{other:?}"),
    }
    // Both attempts are kept; the output belongs to the latest.
    assert_eq!(m.records().count(), 2);
    assert_eq!(m.record_for_output(&task()).unwrap().grant.attempt, Attempt(3));
    assert!(m.record_for_output(&"shell-2".parse().unwrap()).is_none());
}

#[test]
fn record_for_output_ignores_other_tasks() {
    let mut m = machine_in("accepted");
    let mut g = grant(1, 5);
    g.task = "shell-10".parse().unwrap();
    assert_eq!(m.handle(SidecarRequest::Accept(g)), SidecarReply::Ok);
    let mut g = grant(7, 5);
    g.task = "other-1".parse().unwrap();
    assert_eq!(m.handle(SidecarRequest::Accept(g)), SidecarReply::Ok);
    assert_eq!(m.record_for_output(&task()).unwrap().grant.attempt, Attempt(2));
    assert_eq!(m.record_for_output(&"shell-10".parse().unwrap()).unwrap().grant.attempt, Attempt(1));
}

#[test]
fn list_returns_epoch_and_every_record() {
    let mut m = machine_in("spawned");
    let mut g = grant(1, 5);
    g.task = "shell-9".parse().unwrap();
    assert_eq!(m.handle(SidecarRequest::Accept(g)), SidecarReply::Ok);
    match m.handle(SidecarRequest::List) {
        SidecarReply::Records { epoch, records, .. } => {
            assert_eq!(epoch, Epoch(5));
            let names: Vec<_> = records.iter().map(|r| (r.grant.task.to_string(), r.phase)).collect();
            assert_eq!(names, [("shell-1".to_owned(), Phase::Spawned), ("shell-9".to_owned(), Phase::Accepted)]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn corrupt_records_are_refused_not_forgotten() {
    let mut store = machine_in("accepted").into_store();
    store.put_raw(attempt_key(&task(), Attempt(3)), b"garbage".to_vec());
    let mut m = Machine::restore(store).unwrap();
    assert_eq!(m.corrupt().len(), 1);
    let storage = |r: SidecarReply| matches!(r, SidecarReply::Refused(SidecarRefusal::Storage(_)));
    let three = |req: fn(TaskId, Attempt) -> SidecarRequest| req(task(), Attempt(3));
    // Abandoning it could give back an attempt that ran; a new grant of it or of
    // an older attempt could hide it.
    assert!(storage(m.handle(three(|task, attempt| SidecarRequest::Abandon { task, attempt }))));
    assert!(storage(m.handle(three(|task, attempt| SidecarRequest::Intent {
        task,
        attempt,
        epoch: Epoch(5),
        trace: None
    }))));
    assert!(storage(m.handle(three(|task, attempt| SidecarRequest::Acknowledged { task, attempt }))));
    assert!(storage(m.handle(SidecarRequest::Accept(grant(3, 5)))));
    assert!(storage(m.handle(SidecarRequest::Accept(grant(2, 5)))));
    // Attempt 2 itself is readable and still usable; a newer grant is accepted.
    assert_eq!(m.handle(intent(5)), SidecarReply::Ok);
    assert_eq!(m.handle(SidecarRequest::Accept(grant(4, 5))), SidecarReply::Ok);
}

#[test]
fn restore_takes_the_highest_epoch_it_can_see() {
    let mut store = MemoryStore::new();
    store
        .put(&AttemptRecord { grant: grant(1, 11), phase: Phase::Accepted, pid: None, outcome: None, boot: None })
        .unwrap();
    store.put_epoch(Epoch(3)).unwrap();
    assert_eq!(Machine::restore(store).unwrap().epoch(), Epoch(11));
}

#[test]
fn an_evidence_query_revokes_an_accepted_attempt_and_describes_the_others() {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    assert_eq!(m.handle(SidecarRequest::Accept(grant(2, 5))), SidecarReply::Ok);
    // Accepted only: revoked, and from now on the worker cannot record its intent.
    assert_eq!(m.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Absent));
    assert!(matches!(m.handle(intent(5)), SidecarReply::Refused(SidecarRefusal::Revoked { .. })));
    // Never seen at all.
    assert_eq!(m.evidence(&task(), Attempt(7), Epoch(5), None), Ok(RecordView::Absent));
    // Past its intent: never revoked.
    assert_eq!(m.handle(SidecarRequest::Accept(grant(3, 5))), SidecarReply::Ok);
    let intent3 = SidecarRequest::Intent { task: task(), attempt: Attempt(3), epoch: Epoch(5), trace: None };
    assert_eq!(m.handle(intent3), SidecarReply::Ok);
    assert_eq!(m.evidence(&task(), Attempt(3), Epoch(5), None), Ok(RecordView::Started(Phase::Intent)));
    let exited3 = SidecarRequest::Exited { task: task(), attempt: Attempt(3), outcome: o2() };
    assert_eq!(m.handle(exited3), SidecarReply::Ok);
    assert_eq!(m.evidence(&task(), Attempt(3), Epoch(6), None), Ok(RecordView::Ended(o2())));
    // The query is fenced like any command: a lower epoch is refused, a higher one kept.
    assert_eq!(m.epoch(), Epoch(6));
    assert_eq!(
        m.evidence(&task(), Attempt(3), Epoch(4), None),
        Err(SidecarRefusal::StaleEpoch { held: Epoch(6), offered: Epoch(4) })
    );
}

#[test]
fn an_attempt_revoked_before_it_arrived_is_never_accepted() {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    // The leader asks about an attempt whose grant is still on its way.
    assert_eq!(m.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Absent));
    // The slow grant arrives: refused, so the task can never run twice.
    assert_eq!(
        m.handle(SidecarRequest::Accept(grant(2, 5))),
        SidecarReply::Refused(SidecarRefusal::Revoked { task: task(), attempt: Attempt(2) })
    );
    // The tombstone is durable.
    let mut m = Machine::restore(m.into_store()).unwrap();
    assert!(matches!(
        m.handle(SidecarRequest::Accept(grant(2, 5))),
        SidecarReply::Refused(SidecarRefusal::Revoked { .. })
    ));
    // Other attempts are unaffected.
    assert_eq!(m.handle(SidecarRequest::Accept(grant(3, 5))), SidecarReply::Ok);
}

#[test]
fn an_abandoned_attempt_is_never_accepted_again() {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    assert_eq!(m.handle(SidecarRequest::Accept(grant(2, 5))), SidecarReply::Ok);
    assert_eq!(m.handle(abandon()), SidecarReply::Ok);
    // A late copy of the same grant (a re-send that crossed the worker's report).
    assert!(matches!(
        m.handle(SidecarRequest::Accept(grant(2, 5))),
        SidecarReply::Refused(SidecarRefusal::Revoked { .. })
    ));
    assert!(matches!(m.handle(intent(5)), SidecarReply::Refused(SidecarRefusal::Revoked { .. })));
}

#[test]
fn list_pages_through_any_number_of_records_each_page_within_the_message_limit() {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    let big = "x".repeat(20 * 1024);
    let n = 200;
    for i in 1..=n {
        let mut g = grant(1, 5);
        g.task = format!("shell-{i}").parse().unwrap();
        g.spec = TaskSpec::shell("l", big.clone());
        assert_eq!(m.handle(SidecarRequest::Accept(g)), SidecarReply::Ok);
    }
    let (mut seen, mut request, mut pages) = (Vec::new(), SidecarRequest::List, 0);
    loop {
        let reply = m.handle(request.clone());
        let bytes = tenure_protocol::encode(&reply).expect("a page always fits a message").len();
        assert!(bytes <= tenure_protocol::MAX_MESSAGE_BYTES, "page of {bytes} bytes");
        let SidecarReply::Records { records, next, .. } = reply else { panic!("{reply:?}") };
        pages += 1;
        seen.extend(records.into_iter().map(|r| r.grant.task.to_string()));
        match next {
            Some((task, attempt)) => request = SidecarRequest::ListFrom { task, attempt },
            None => break,
        }
    }
    assert!(pages > 1, "{n} records of 20 KiB fit one page?");
    let expected: Vec<String> = (1..=n).map(|i| format!("shell-{i}")).collect();
    assert_eq!(seen, expected, "every record exactly once, in task order");
}

fn identity(m: &mut Machine<MemoryStore>) -> Option<RegistryMark> {
    match m.handle(SidecarRequest::Incarnation) {
        SidecarReply::Identity { incarnation, mark } => {
            assert_eq!(incarnation, m.incarnation());
            mark
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_registry_mark_of_every_grant_is_kept_through_removal_and_restart() {
    let mark = |last_seq, highest_task, epoch| RegistryMark { last_seq, highest_task, epoch: Epoch(epoch) };
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    assert_eq!(identity(&mut m), None, "a fresh store was given no mark");
    let mut first = grant(2, 5);
    first.mark = Some(mark(40, 9, 5));
    assert_eq!(m.handle(SidecarRequest::Accept(first)), SidecarReply::Ok);
    let mut other = grant(1, 5);
    other.task = "shell-7".parse().unwrap();
    other.mark = Some(mark(30, 12, 4));
    assert_eq!(m.handle(SidecarRequest::Accept(other)), SidecarReply::Ok);
    assert_eq!(identity(&mut m), Some(mark(40, 12, 5)), "the highest of each part");

    // A refused grant changes nothing.
    let mut refused = grant(1, 3);
    refused.task = "shell-8".parse().unwrap(); // a deposed leader's epoch
    refused.mark = Some(mark(99, 99, 3));
    assert!(matches!(m.handle(SidecarRequest::Accept(refused)), SidecarReply::Refused(_)));
    assert_eq!(identity(&mut m), Some(mark(40, 12, 5)));

    // Records carrying the mark are removed (given back, cleaned up): the
    // store keeps its own copy first.
    let writes = m.store.writes();
    assert_eq!(m.handle(abandon()), SidecarReply::Ok);
    assert_eq!(m.cleanup(&"shell-7".parse().unwrap(), Epoch(5)), Ok(1));
    assert!(m.store.writes() > writes);
    assert_eq!(m.records().count(), 0);
    let mut m = Machine::restore(m.store.clone()).unwrap();
    assert_eq!(identity(&mut m), Some(mark(40, 12, 5)), "a restart reads it back");
}

#[test]
fn a_store_that_cannot_keep_the_mark_refuses_the_removal() {
    let mut m = Machine::restore(MemoryStore::new()).unwrap();
    let mut g = grant(2, 5);
    g.mark = Some(RegistryMark { last_seq: 4, highest_task: 1, epoch: Epoch(5) });
    assert_eq!(m.handle(SidecarRequest::Accept(g)), SidecarReply::Ok);
    let mut failing = Machine::restore(FailingStore::new(m.store.clone())).unwrap();
    assert!(matches!(failing.handle(abandon()), SidecarReply::Refused(SidecarRefusal::Storage(_))));
    assert_eq!(failing.records().count(), 1, "nothing changed");
}

#[test]
fn an_attempt_started_before_the_machine_booted_again_is_said_to_have_died_with_it() {
    let boot = |id: &str| Some(id.to_owned());
    let mut m = Machine::restore(MemoryStore::new()).unwrap().with_boot(boot("first"));
    assert_eq!(m.handle(SidecarRequest::Accept(grant(2, 5))), SidecarReply::Ok);
    assert_eq!(m.handle(intent(5)), SidecarReply::Ok);
    assert_eq!(m.record(&task(), Attempt(2)).and_then(|r| r.boot.clone()), boot("first"));
    // The same boot (a sidecar restart): only "started".
    let mut same = Machine::restore(m.store.clone()).unwrap().with_boot(boot("first"));
    assert_eq!(same.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Started(Phase::Intent)));
    // Another boot: the process died with the machine.
    let mut rebooted = Machine::restore(m.store.clone()).unwrap().with_boot(boot("second"));
    assert_eq!(rebooted.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Restarted(Phase::Intent)));
    // An unknown boot claims nothing.
    let mut unknown = Machine::restore(m.store.clone()).unwrap();
    assert_eq!(unknown.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Started(Phase::Intent)));
    // An outcome recorded before the reboot still stands.
    assert_eq!(m.handle(spawned(PID)), SidecarReply::Ok);
    assert_eq!(m.handle(exited(o1())), SidecarReply::Ok);
    let mut rebooted = Machine::restore(m.store.clone()).unwrap().with_boot(boot("second"));
    assert_eq!(rebooted.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Ended(o1())));
}

/// Tombstones are kept on disk: a sled store reopened after the leader's
/// evidence query revoked an attempt (absent, or only accepted) and after a
/// worker's abandon still refuses a late grant and a late intent of it.
#[test]
fn revocation_tombstones_survive_a_real_sled_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let revoked = |m: &mut Machine<crate::store::SledStore>, attempt: u32| {
        assert!(
            matches!(
                m.handle(SidecarRequest::Accept(grant(attempt, 5))),
                SidecarReply::Refused(SidecarRefusal::Revoked { .. })
            ),
            "attempt {attempt} accepted again"
        );
        let intent = SidecarRequest::Intent { task: task(), attempt: Attempt(attempt), epoch: Epoch(5), trace: None };
        assert!(matches!(m.handle(intent), SidecarReply::Refused(_)), "attempt {attempt} got an intent");
    };
    {
        let mut m = Machine::restore(crate::store::SledStore::open(&tmp.path().join("db")).unwrap()).unwrap();
        // Asked before its grant arrived: absent, and tombstoned.
        assert_eq!(m.evidence(&task(), Attempt(2), Epoch(5), None), Ok(RecordView::Absent));
        // Accepted, then asked: revoked and abandoned.
        assert_eq!(m.handle(SidecarRequest::Accept(grant(3, 5))), SidecarReply::Ok);
        assert_eq!(m.evidence(&task(), Attempt(3), Epoch(5), None), Ok(RecordView::Absent));
        // Accepted, then given back by the worker.
        assert_eq!(m.handle(SidecarRequest::Accept(grant(4, 5))), SidecarReply::Ok);
        assert_eq!(m.handle(SidecarRequest::Abandon { task: task(), attempt: Attempt(4) }), SidecarReply::Ok);
        for attempt in [2, 3, 4] {
            revoked(&mut m, attempt);
        }
    }
    let mut m = Machine::restore(crate::store::tests::reopen(&tmp.path().join("db"))).unwrap();
    for attempt in [2, 3, 4] {
        revoked(&mut m, attempt);
    }
    // A later attempt of the task is not caught by them.
    assert_eq!(m.handle(SidecarRequest::Accept(grant(5, 5))), SidecarReply::Ok);
}

/// A batch answers exactly as its requests would one by one: for every
/// starting phase and every ordered pair of requests, the replies, the
/// records and what the store holds are the same.
#[test]
fn a_batch_is_its_requests_one_by_one() {
    for (row, _) in table() {
        for (first, a) in requests() {
            for (second, b) in requests() {
                let mut alone = machine_in(row);
                let replies = vec![alone.handle(a.clone()), alone.handle(b.clone())];
                let mut batched = machine_in(row);
                let reply = batched.handle(SidecarRequest::Many(vec![a.clone(), b.clone()]));
                assert_eq!(reply, SidecarReply::Many(replies), "{row} + [{first}, {second}]");
                assert_eq!(state(&batched), state(&alone), "{row} + [{first}, {second}]");
                let restored = Machine::restore(batched.store().clone()).unwrap();
                assert_eq!(state(&restored), state(&alone), "{row} + [{first}, {second}]: store");
            }
        }
    }
}

#[test]
fn what_may_not_travel_in_a_batch_is_refused_in_its_place() {
    let mut m = machine_in("absent");
    let traced = SidecarRequest::Intent { task: task(), attempt: Attempt(2), epoch: Epoch(5), trace: Some("t".into()) };
    let reply = m.handle(SidecarRequest::Many(vec![
        SidecarRequest::List,
        SidecarRequest::Accept(grant(2, 5)),
        SidecarRequest::Many(vec![intent(5)]),
        SidecarRequest::Incarnation,
        traced,
        intent(5),
    ]));
    let SidecarReply::Many(replies) = reply else { panic!("{reply:?}") };
    let malformed = |r: &SidecarReply| matches!(r, SidecarReply::Refused(SidecarRefusal::Malformed(_)));
    let shape: Vec<bool> = replies.iter().map(malformed).collect();
    // A traced intent travels (the sidecar's span for it wraps the batch).
    assert_eq!(shape, [true, false, true, true, false, false], "{replies:?}");
    assert_eq!(replies[1..2], [SidecarReply::Ok]);
    assert_eq!(replies[4..], [SidecarReply::Ok, SidecarReply::Ok]);
    assert_eq!(target(&m).map(|r| r.phase), Some(Phase::Intent));
}

/// A grant's accept and its intent in one batch (how a worker records a
/// grant) leave what the two leave one after the other, from every phase
/// and with every answer the accept can get; the intent of a refused
/// grant changes nothing.
#[test]
fn an_accept_with_its_intent_is_the_two_one_after_the_other() {
    for (row, _) in table() {
        for epoch in [4, 5, 6] {
            let pair = [SidecarRequest::Accept(grant(2, epoch)), intent(epoch)];
            let mut alone = machine_in(row);
            let replies: Vec<SidecarReply> = pair.iter().map(|r| alone.handle(r.clone())).collect();
            let mut batched = machine_in(row);
            let before = state(&batched);
            let reply = batched.handle(SidecarRequest::Many(pair.to_vec()));
            assert_eq!(reply, SidecarReply::Many(replies.clone()), "{row}, epoch {epoch}");
            assert_eq!(state(&batched), state(&alone), "{row}, epoch {epoch}");
            if replies[0] != SidecarReply::Ok && row == "absent" {
                assert_eq!(state(&batched), before, "{row}, epoch {epoch}: a refused grant left something");
            }
        }
    }
}

#[test]
fn an_oversized_batch_is_refused_whole_and_changes_nothing() {
    let mut m = machine_in("absent");
    let before = state(&m);
    let writes = m.store().writes();
    let reqs = vec![SidecarRequest::Accept(grant(2, 5)); MAX_SIDECAR_MANY + 1];
    assert!(matches!(m.handle(SidecarRequest::Many(reqs)), SidecarReply::Refused(SidecarRefusal::Malformed(_))));
    assert_eq!(state(&m), before);
    assert_eq!(m.store().writes(), writes);
    let reqs = vec![SidecarRequest::Accept(grant(2, 5)); MAX_SIDECAR_MANY];
    let SidecarReply::Many(replies) = m.handle(SidecarRequest::Many(reqs)) else { panic!() };
    assert!(replies.iter().all(|r| *r == SidecarReply::Ok), "{replies:?}");
}
