//! Who leads and who stands by, for the status view: this leader's own term
//! as the leadership task last published it, and the standby coordinators
//! heard from lately.
//!
//! The driver only reports what it observed ([`super::Input::Leader`] after every
//! change of its term, [`super::Input::Presence`] for every standby's presence
//! message); the core keeps it and answers `Status` whole. Nothing here
//! decides anything about tasks, and it must never be taken as a right to
//! act: the driver's guard is that.

use std::collections::HashMap;
use std::time::Duration;

use tenure_protocol::messages::{ClusterStatus, CoordinatorPresence, LeaderStatus, StandbyStatus};

/// Standby coordinators are listed while heard from within this long.
const STANDBY_FRESH: Duration = Duration::from_secs(5);

/// This process's leadership term, as the leadership task last published it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    /// Human name of this coordinator.
    pub name: String,
    /// Name and per-process nonce: unique to one coordinator process.
    pub holder: String,
    /// When the last successful leadership write was sent, on the same
    /// monotonic clock as [`super::Now::mono`].
    pub renewed_at: Duration,
    /// The holder's count of leadership writes.
    pub renewals: u64,
    /// The leadership TTL this holder counts on.
    pub ttl_ms: u64,
    /// From judging the previous leader gone to registry loaded and epoch claimed.
    pub adopted_in_ms: u64,
}

#[derive(Debug, Default)]
pub(super) struct Presence {
    leader: Option<Leader>,
    /// Standbys by holder: name, and when their presence last arrived.
    standbys: HashMap<String, (String, Duration)>,
}

impl Presence {
    pub(super) fn leader(&mut self, leader: Leader) {
        self.standbys.remove(&leader.holder);
        self.leader = Some(leader);
    }

    /// A standby's presence message; this process's own is not a standby.
    /// Standbys gone quiet are forgotten here, so the map stays small.
    pub(super) fn seen(&mut self, presence: CoordinatorPresence, now: Duration) {
        self.standbys.retain(|_, (_, at)| now.saturating_sub(*at) < STANDBY_FRESH);
        if self.leader.as_ref().is_none_or(|l| l.holder != presence.holder) {
            self.standbys.insert(presence.holder, (presence.name, now));
        }
    }

    /// Fills the leader and standby parts of `status`: standbys heard from
    /// lately, by name.
    pub(super) fn fill(&self, status: &mut ClusterStatus, now: Duration) {
        let mut standbys: Vec<StandbyStatus> = self
            .standbys
            .iter()
            .filter(|(_, (_, at))| now.saturating_sub(*at) < STANDBY_FRESH)
            .map(|(holder, (name, at))| StandbyStatus {
                name: name.clone(),
                holder: holder.clone(),
                last_seen_ms: ms(now.saturating_sub(*at)),
            })
            .collect();
        standbys.sort_by(|a, b| a.name.cmp(&b.name).then(a.holder.cmp(&b.holder)));
        status.standbys = standbys;
        status.leader = self.leader.as_ref().map(|l| LeaderStatus {
            name: l.name.clone(),
            holder: l.holder.clone(),
            epoch: status.leader_epoch,
            lease_age_ms: ms(now.saturating_sub(l.renewed_at)),
            renewals: l.renewals,
            lease_ttl_ms: l.ttl_ms,
            adopted_in_ms: l.adopted_in_ms,
        });
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
