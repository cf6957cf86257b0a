//! The registry's high-water mark, judged: may a registry that was just
//! loaded be led?
//!
//! The mark ([`RegistryMark`]: last sequence, highest task number, highest
//! epoch claimed) is kept outside the registry, in the leadership, and
//! carried on by every renewal and takeover. A registry found behind it lost
//! acknowledged writes (JetStream's periodic fsync and a power loss) or was
//! deleted, recreated or restored from an older backup: leading it would let
//! submitted tasks vanish, completed ones run again and task numbers be
//! reused. So a coordinator refuses to lead it — it claims no epoch and
//! writes nothing — unless an operator accepted the loss
//! (`--accept-registry-rollback`), which is then recorded with the claim.
//!
//! The leadership can go back with the registry (one JetStream store that lost
//! acknowledged writes, or both restored from one backup). Every grant
//! therefore carries the registry's mark to the machine, whose store keeps
//! the highest it was given and whose heartbeats carry it: a leader that
//! hears of a mark its registry does not reach ([`witnessed`]) stops leading
//! and refuses, as at a takeover.
//!
//! Pure: no IO, no clock. It must never let a registry behind its mark be led
//! without the operator's acceptance, and never let a task number or an
//! epoch below the mark be used again, accepted or not.

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::RegistryMark;
use tenure_protocol::Epoch;

/// A registry found behind its mark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Behind {
    /// The mark kept outside the registry.
    pub expected: RegistryMark,
    /// What the registry holds.
    pub found: RegistryMark,
    /// Who kept the mark, when it was not the leadership (a machine's store).
    #[serde(default)]
    pub witness: Option<String>,
}

/// What to do with a registry just loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// At or past the mark (or no mark is known yet): lead.
    Lead,
    /// Behind the mark: refuse to lead, report it.
    Refuse(Behind),
    /// Behind the mark, and the operator accepted the loss: lead, and record it.
    Accept(Behind),
}

/// Judges a registry found at `found` against the mark `expected` (none when
/// the leadership carries none: a new cluster, or a leadership written before marks).
pub fn judge(expected: Option<RegistryMark>, found: RegistryMark, accept_rollback: bool) -> Verdict {
    match expected {
        Some(expected) if expected.is_ahead_of(&found) => {
            let behind = Behind { expected, found, witness: None };
            if accept_rollback {
                Verdict::Accept(behind)
            } else {
                Verdict::Refuse(behind)
            }
        }
        _ => Verdict::Lead,
    }
}

/// Whether a machine's mark `claim` shows the registry went back: it is
/// ahead of the registry's durable mark `current` (every grant carries a mark
/// the registry had already reached when it was sent) and of a mark the
/// operator accepted. Returns the mark to refuse the registry against: the
/// claim, and one sequence past `current` — the registry was led, and
/// written to, before it was caught, and the leader stops writing now, so a
/// reload of the same registry stays refused; only another registry ahead of
/// both (the good one restored) or an operator's acceptance ends it.
pub fn witnessed(
    claim: Option<RegistryMark>,
    current: RegistryMark,
    accepted: Option<RegistryMark>,
) -> Option<RegistryMark> {
    let claim = claim?;
    let floor = RegistryMark::merged(Some(current), accepted).unwrap_or(current);
    let past = RegistryMark { last_seq: current.last_seq.saturating_add(1), ..current };
    claim.is_ahead_of(&floor).then(|| claim.merge(past))
}

/// The least epoch the next claim may take: past every epoch the mark says
/// was claimed (sidecars may have seen it) and at least the leadership's.
pub fn least_epoch(expected: Option<RegistryMark>, leadership_epoch: Epoch) -> Epoch {
    let past_mark = expected.map(|m| m.epoch.checked_next().unwrap_or(m.epoch)).unwrap_or_default();
    leadership_epoch.max(past_mark)
}

/// The highest task number already used: the next task takes the one after
/// it, so numbers are never reused even in a registry that went back.
pub fn highest_task(expected: Option<RegistryMark>, found: RegistryMark) -> u64 {
    expected.map(|m| m.highest_task).unwrap_or(0).max(found.highest_task)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mark(last_seq: u64, highest_task: u64, epoch: u64) -> RegistryMark {
        RegistryMark { last_seq, highest_task, epoch: Epoch(epoch) }
    }

    #[test]
    fn a_registry_at_or_past_its_mark_is_led() {
        assert_eq!(judge(None, mark(0, 0, 0), false), Verdict::Lead, "a new cluster has no mark");
        assert_eq!(judge(Some(mark(10, 3, 2)), mark(10, 3, 2), false), Verdict::Lead);
        assert_eq!(judge(Some(mark(10, 3, 2)), mark(14, 5, 2), false), Verdict::Lead, "the mark lags renewals");
    }

    #[test]
    fn a_registry_behind_its_mark_in_any_part_is_refused_unless_accepted() {
        for found in [mark(9, 3, 2), mark(10, 2, 2), mark(10, 3, 1), mark(1, 0, 0)] {
            let behind = Behind { expected: mark(10, 3, 2), found, witness: None };
            assert_eq!(judge(Some(mark(10, 3, 2)), found, false), Verdict::Refuse(behind.clone()), "{found}");
            assert_eq!(judge(Some(mark(10, 3, 2)), found, true), Verdict::Accept(behind), "{found}");
        }
    }

    #[test]
    fn neither_epochs_nor_task_numbers_below_the_mark_are_used_again() {
        assert_eq!(least_epoch(Some(mark(10, 3, 7)), Epoch(4)), Epoch(8));
        assert_eq!(least_epoch(Some(mark(10, 3, 2)), Epoch(4)), Epoch(4));
        assert_eq!(least_epoch(None, Epoch(4)), Epoch(4));
        assert_eq!(least_epoch(Some(mark(1, 1, u64::MAX)), Epoch(4)), Epoch(u64::MAX));
        assert_eq!(highest_task(Some(mark(10, 30, 2)), mark(3, 5, 1)), 30);
        assert_eq!(highest_task(Some(mark(10, 3, 2)), mark(30, 50, 2)), 50);
        assert_eq!(highest_task(None, mark(3, 5, 1)), 5);
    }

    #[test]
    fn a_machine_mark_beyond_the_registry_is_caught_and_holds_until_accepted() {
        let current = mark(20, 8, 3);
        // Grants carry marks the registry had reached: nothing to see.
        assert_eq!(witnessed(None, current, None), None);
        assert_eq!(witnessed(Some(mark(20, 8, 3)), current, None), None);
        assert_eq!(witnessed(Some(mark(12, 5, 2)), current, None), None);
        // Ahead in any part: the registry went back.
        for claim in [mark(21, 8, 3), mark(20, 9, 3), mark(20, 8, 4), mark(90, 40, 9)] {
            let expected = witnessed(Some(claim), current, None).expect("caught");
            assert!(expected.is_ahead_of(&current), "{claim}");
            assert!(!claim.is_ahead_of(&expected), "{claim}: the refusal keeps the whole claim");
            // A reload of the registry that was caught (its leader stopped
            // writing) still falls short; the good registry restored, ahead
            // of both, is led.
            assert_eq!(
                judge(Some(expected), current, false),
                Verdict::Refuse(Behind { expected, found: current, witness: None })
            );
            let restored = claim.merge(RegistryMark { last_seq: current.last_seq + 1, ..current });
            assert_eq!(judge(Some(expected), restored, false), Verdict::Lead);
            // Accepted, it leads past the claim's numbers and epoch.
            assert!(highest_task(Some(expected), current) >= claim.highest_task);
            assert!(least_epoch(Some(expected), Epoch(1)) > claim.epoch);
            // And the same claim, heard again after acceptance, is not news.
            assert_eq!(witnessed(Some(claim), current, Some(expected)), None);
        }
    }
}
