//! The one verdict of what a worker machine's evidence says about an attempt:
//! its recovery store's record (as a [`RecordView`]) together with the facts
//! the attempt's own files prove ([`FileFacts`]).
//!
//! Two questions are answered here and nowhere else:
//! - [`answer`]: the leader asks "what happened to this attempt?" (an
//!   evidence query, answered by the sidecar);
//! - [`settle`]: the worker holds an attempt whose shim is gone and must
//!   say how it ended (after a watch, and in start-up recovery).
//!
//! Both are pure: the callers read the store and the files, and act on the
//! verdict (the sidecar replies, the worker buffers and reports). The seeded
//! simulation calls the same two functions with its modelled files.
//!
//! **Invariant:** "never started" is said only when no intent was recorded and
//! no file of the attempt exists; a missing or unreadable fact is never an
//! outcome, only "no evidence".

use tenure_protocol::messages::{AttemptEvidence, EvidenceReply, Phase, SidecarRefusal};
use tenure_protocol::{Attempt, Ending, HintTag, Outcome, RecoveryHint};

use crate::attempt_files::{AttemptFiles, Journal};

/// What the records say about one attempt, for an evidence query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordView {
    /// No record (or an `accepted` one, now revoked): no intent was recorded here.
    Absent,
    /// The intent is recorded; the outcome is not (yet).
    Started(Phase),
    /// The outcome is recorded.
    Ended(Outcome),
    /// The record is unreadable.
    Corrupt(String),
    /// This machine's store is not the one the attempt was granted to.
    Replaced(uuid::Uuid),
    /// The intent is recorded, the outcome is not, and the machine booted
    /// since the intent: whatever ran died with the machine.
    Restarted(Phase),
}

/// What an attempt's files prove, read once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileFacts {
    /// The exit status its shim recorded (durable: fsynced before the
    /// shim exits).
    pub status: Option<Outcome>,
    /// Its shim runs now (by pid and start time, never a recycled pid).
    pub shim_alive: bool,
    /// The journal holds the attempt's grant: the worker wrote it after
    /// the intent and before the shim could exist, so the attempt got past
    /// its intent here. Its absence proves nothing after a power cut: the
    /// grant is synced with the status (durability note a21).
    pub has_grant: bool,
}

impl FileFacts {
    /// The facts of `journal` (an unreadable journal is an empty one).
    pub fn of(journal: &Journal) -> FileFacts {
        FileFacts {
            status: journal.status.as_ref().map(|s| s.outcome.clone()),
            shim_alive: journal.shim.is_some_and(|m| m.alive()),
            has_grant: journal.grant.is_some(),
        }
    }

    /// Reads the attempt's journal (checks its shim in `/proc`).
    pub fn read(files: &AttemptFiles) -> FileFacts {
        FileFacts::of(&files.journal().unwrap_or_default())
    }

    /// What the files prove, or `unproven` when they prove nothing.
    fn or(&self, unproven: AttemptEvidence) -> AttemptEvidence {
        match (&self.status, self.shim_alive) {
            (Some(outcome), _) => AttemptEvidence::Exited(outcome.clone()),
            (None, true) => AttemptEvidence::Running,
            (None, false) => unproven,
        }
    }
}

/// The answer to the leader's evidence query: the records' view judged
/// together with the files. A recorded outcome is final; otherwise the files
/// speak first (an exit status, a live shim), and only when they prove
/// nothing does the record's absence or damage decide.
pub fn answer(view: Result<RecordView, SidecarRefusal>, files: &FileFacts) -> EvidenceReply {
    Ok(match view {
        Ok(RecordView::Ended(outcome)) => AttemptEvidence::Exited(outcome),
        Ok(RecordView::Started(_)) => files.or(AttemptEvidence::NoEvidence),
        Ok(RecordView::Restarted(_)) => files.or(AttemptEvidence::MachineRestarted),
        // A record that vanished (sled can drop data) but whose directory exists.
        Ok(RecordView::Absent) if files.has_grant => files.or(AttemptEvidence::NoEvidence),
        Ok(RecordView::Absent) => AttemptEvidence::NeverStarted,
        Ok(RecordView::Corrupt(reason)) => files.or(AttemptEvidence::Unreadable(reason)),
        // Another store than the grant's: only files that survived can speak.
        Ok(RecordView::Replaced(incarnation)) => files.or(AttemptEvidence::Replaced { incarnation }),
        // A degraded store: only the files can speak.
        Err(SidecarRefusal::Storage(reason)) => files.or(AttemptEvidence::Unreadable(reason)),
        Err(refusal) => return Err(refusal),
    })
}

/// How an attempt the worker holds ended, once its shim is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// The shim recorded how it ended (or it was ended on request).
    Exited(Outcome),
    /// Nothing recorded how it ended. `gone`: its process is proven gone
    /// too — the machine booted since, or what was left of its recorded
    /// process group or control group was ended — and cannot run on
    /// unseen (what a resume needs, `tenure_protocol::resume`).
    Lost { hint: RecoveryHint, gone: bool },
}

/// What the files of an attempt whose shim is gone prove: the recorded
/// status if there is one; a kill the worker asked for ended it (`killed`);
/// otherwise the outcome is lost — and said to have died with the machine
/// when the machine booted since the intent (`restarted`). `group` is the
/// task's process group, when one was recorded; `contained`: the attempt's
/// control group was found empty, or emptied (with `group`, what makes a
/// loss on a machine that did not restart `gone`: a task whose shim died
/// before recording its group, outside any control group, may still run).
pub fn settle(
    status: Option<Outcome>,
    killed: bool,
    group: Option<i32>,
    restarted: bool,
    contained: bool,
    attempt: Attempt,
) -> Settled {
    if let Some(outcome) = status {
        return Settled::Exited(outcome);
    }
    if killed {
        let detail = "killed; the shim ended before recording the exit status";
        return Settled::Exited(Outcome::new(Ending::Killed, None, Some(detail.into())));
    }
    if restarted {
        let hint = RecoveryHint {
            tag: HintTag::MachineRestarted,
            message: format!(
                "the machine restarted (a power loss or a reboot) while attempt {attempt} ran: its process died \
                 with the machine and no exit status survived; the task may have run"
            ),
        };
        return Settled::Lost { hint, gone: true };
    }
    let hint = RecoveryHint {
        tag: HintTag::MaybeRan,
        message: match group {
            Some(pgid) => format!(
                "the task's shim died without recording an exit status; process group {pgid} is gone; \
                 the task ran but its outcome is lost"
            ),
            None => "the intent was recorded but no process or exit status was found; the task may or may not \
                     have run"
                .into(),
        },
    };
    Settled::Lost { hint, gone: group.is_some() || contained }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn done() -> Outcome {
        Outcome::new(Ending::Completed, Some(0), None)
    }

    /// The files, from proving nothing to proving the most.
    fn files() -> [FileFacts; 4] {
        let f = |status: Option<Outcome>, shim_alive, has_grant| FileFacts { status, shim_alive, has_grant };
        [f(None, false, false), f(None, false, true), f(None, true, true), f(Some(done()), false, true)]
    }

    /// Every (record view × file facts) cell of the evidence query.
    #[test]
    fn every_record_view_against_every_file_fact() {
        let corrupt = || AttemptEvidence::Unreadable("bad crc".into());
        let id = Uuid::from_u128(7);
        let views: Vec<(Result<RecordView, SidecarRefusal>, [AttemptEvidence; 4])> = vec![
            (Ok(RecordView::Absent), {
                use AttemptEvidence::*;
                [NeverStarted, NoEvidence, Running, Exited(done())]
            }),
            (Ok(RecordView::Started(Phase::Intent)), {
                use AttemptEvidence::*;
                [NoEvidence, NoEvidence, Running, Exited(done())]
            }),
            (Ok(RecordView::Restarted(Phase::Spawned)), {
                use AttemptEvidence::*;
                [MachineRestarted, MachineRestarted, Running, Exited(done())]
            }),
            (Ok(RecordView::Corrupt("bad crc".into())), {
                use AttemptEvidence::*;
                [corrupt(), corrupt(), Running, Exited(done())]
            }),
            (Ok(RecordView::Replaced(id)), {
                use AttemptEvidence::*;
                let r = || Replaced { incarnation: id };
                [r(), r(), Running, Exited(done())]
            }),
            (Err(SidecarRefusal::Storage("bad crc".into())), {
                use AttemptEvidence::*;
                [corrupt(), corrupt(), Running, Exited(done())]
            }),
        ];
        for (view, expected) in views {
            for (facts, want) in files().iter().zip(expected) {
                assert_eq!(answer(view.clone(), facts), Ok(want), "{view:?} × {facts:?}");
            }
        }
        // A recorded outcome is final, whatever the files say.
        let failed = Outcome::new(Ending::Failed, Some(3), None);
        for facts in files() {
            assert_eq!(
                answer(Ok(RecordView::Ended(failed.clone())), &facts),
                Ok(AttemptEvidence::Exited(failed.clone()))
            );
        }
        // A refusal that is not a storage failure is passed on.
        let stale = SidecarRefusal::StaleEpoch { held: tenure_protocol::Epoch(5), offered: tenure_protocol::Epoch(4) };
        for facts in files() {
            assert_eq!(answer(Err(stale.clone()), &facts), Err(stale.clone()));
        }
    }

    #[test]
    fn a_gone_shim_settles_from_its_status_then_the_kill_then_as_lost() {
        let a = Attempt(2);
        for (killed, restarted) in [(false, false), (true, false), (false, true), (true, true)] {
            assert_eq!(settle(Some(done()), killed, Some(40), restarted, true, a), Settled::Exited(done()));
        }
        for restarted in [false, true] {
            match settle(None, true, None, restarted, false, a) {
                Settled::Exited(o) => assert_eq!(o.ending, Ending::Killed),
                other => panic!("{other:?}"),
            }
        }
        let lost = |group, restarted| match settle(None, false, group, restarted, false, a) {
            Settled::Lost { hint, .. } => hint,
            other => panic!("{other:?}"),
        };
        assert_eq!(lost(None, true).tag, HintTag::MachineRestarted);
        assert!(lost(None, true).message.contains("attempt 2"));
        assert_eq!(lost(Some(40), false).tag, HintTag::MaybeRan);
        assert!(lost(Some(40), false).message.contains("process group 40"));
        assert!(lost(None, false).message.contains("may or may not"));
        // Gone: after a reboot, or once its group or control group was ended;
        // a shim that died before recording its group, outside a control
        // group, may have left its task running.
        let gone = |group, restarted, contained| match settle(None, false, group, restarted, contained, a) {
            Settled::Lost { gone, .. } => gone,
            other => panic!("{other:?}"),
        };
        assert!(gone(None, true, false) && gone(Some(40), false, false) && gone(None, false, true));
        assert!(!gone(None, false, false));
    }
}
