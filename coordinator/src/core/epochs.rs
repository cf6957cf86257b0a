//! Epochs reported by others: a leader believes a higher epoch only when a
//! coordinator claimed it in the registry.
//!
//! A worker's heartbeat (`epoch_seen`), a worker's `StaleEpoch` refusal and a
//! sidecar's say that their machine has seen an epoch above the leader's.
//! That is what a newer leader looks like — and also what a confused or
//! forged machine looks like: one heartbeat claiming `u64::MAX` must not make
//! every leader step down. So a claim above the leader's epoch is only
//! *checked*: the driver reads the registry's last epoch claim
//! ([`Effect::CheckEpoch`], answered by [`Input::EpochChecked`]) and the
//! leader steps down only if that claim is above its own. Otherwise it logs
//! who made the claim, ignores it, and schedules nothing on that worker while
//! its heartbeats carry the claim (its sidecar would refuse every grant), and
//! the status view shows the worker with the unproven epoch.
//!
//! One check is in flight at a time and checks are at least
//! [`CHECK_EVERY`] apart; claims seen meanwhile are folded into the next one
//! (the highest is kept), so a flood of forged heartbeats costs one registry
//! read a second. A claim the registry already showed unfounded (a machine
//! that keeps reporting it) is read again only every [`RECHECK_REFUTED`] and
//! logged once. The registry fence and the lease stay the real guards: a
//! deposed leader is stopped by them whatever any worker says.

use std::time::Duration;

use super::{Core, Effect, Now};
use tenure_protocol::Epoch;

/// Least time between two checks of the registry's epoch claim.
pub(super) const CHECK_EVERY: Duration = Duration::from_secs(1);
/// Least time between two checks of a claim already found unfounded.
pub(super) const RECHECK_REFUTED: Duration = Duration::from_secs(30);

/// Claims of a higher epoch waiting to be checked.
#[derive(Debug, Default)]
pub(super) struct Claims {
    /// The highest claim not yet checked, and who made it.
    pending: Option<(Epoch, String)>,
    in_flight: bool,
    last_check: Option<Duration>,
    /// The highest claim the registry showed unfounded.
    refuted: Epoch,
}

impl Core {
    /// Someone (`by`, for the logs) says an epoch above ours exists.
    pub(super) fn epoch_claimed(&mut self, claimed: Epoch, by: String, now: Now, fx: &mut Vec<Effect>) {
        if claimed <= self.epoch {
            return;
        }
        let claims = &mut self.claims;
        if claims.pending.as_ref().is_none_or(|(e, _)| claimed > *e) {
            claims.pending = Some((claimed, by));
        }
        self.check_claims(now, fx);
    }

    /// Whether a claim of `epoch` was checked and found unfounded.
    pub(super) fn refuted(&self, epoch: Epoch) -> bool {
        epoch <= self.claims.refuted
    }

    /// Sends the pending claim to be checked, unless one check is in flight or
    /// the last one was too recent (then a tick sends it).
    pub(super) fn check_claims(&mut self, now: Now, fx: &mut Vec<Effect>) {
        let claims = &mut self.claims;
        let Some((pending, _)) = &claims.pending else { return };
        let every = if *pending <= claims.refuted { RECHECK_REFUTED } else { CHECK_EVERY };
        let due = claims.last_check.is_none_or(|at| now.mono.saturating_sub(at) >= every);
        if claims.in_flight || !due {
            return;
        }
        if let Some((claimed, by)) = claims.pending.take() {
            claims.in_flight = true;
            claims.last_check = Some(now.mono);
            fx.push(Effect::CheckEpoch { claimed, by });
        }
    }

    /// The registry's highest epoch claim, read for a claim of `by`.
    pub(super) fn epoch_checked(
        &mut self,
        claimed: Epoch,
        by: String,
        registry: Result<Epoch, String>,
        now: Now,
        fx: &mut Vec<Effect>,
    ) {
        self.claims.in_flight = false;
        match registry {
            Ok(highest) if highest > self.epoch => {
                fx.push(Effect::StepDown {
                    reason: format!(
                        "the registry holds epoch {highest}, claimed by another coordinator, above ours {} \
                         (noticed through {by})",
                        self.epoch
                    ),
                });
                return;
            }
            Ok(highest) if claimed <= self.claims.refuted => {
                tracing::debug!(claimed = %claimed, registry = %highest, "{by} still claims an unfounded epoch");
            }
            Ok(highest) => {
                self.claims.refuted = self.claims.refuted.max(claimed);
                tracing::warn!(
                claimed = %claimed,
                registry = %highest,
                epoch = %self.epoch,
                "{by} claims epoch {claimed}, which no coordinator claimed (the registry's highest claim is \
                 {highest}): ignored; nothing is scheduled on a worker while it claims it"
                )
            }
            Err(error) => {
                tracing::warn!(claimed = %claimed, %error, "the registry's epoch claim could not be read; checking again");
                if self.claims.pending.as_ref().is_none_or(|(e, _)| claimed > *e) {
                    self.claims.pending = Some((claimed, by));
                }
            }
        }
        self.check_claims(now, fx);
    }
}
