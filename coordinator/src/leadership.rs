//! The coordinators' leadership as a pure state machine: when to take it,
//! when to renew it, when to stop leading.
//!
//! Leadership is held like a lease — for a TTL, renewed by its holder — and
//! the logs, flags and config keys call it the *leader lease* (`leader lease
//! acquired`, `--lease-ttl-ms`); in code "lease" means only a task's lease (a
//! worker's time-bounded right to run one attempt), so this is `Leadership`.
//!
//! The leadership is one key ([`tenure_protocol::subjects::LEADER_KEY`]) in a
//! JetStream KV bucket; its value is a [`LeadershipRecord`] and every write to it is a
//! compare-and-set on the revision the writer last saw. [`Leadership::handle`] takes
//! what the driver observed (the key as read, the answer to a write, or just the
//! passing of time) and this process's monotonic time, and returns one
//! [`Decision`]. It does no IO and reads no clock; `elector.rs` reads the key,
//! carries out the writes and feeds the answers back.
//!
//! The rules (design safety rule 3, "expiry is measured locally"):
//!
//! - **A standby judges expiry on its own clock.** It notes when it first saw
//!   the key's current revision; only when the revision has not changed for the
//!   TTL (the longer of its own and the one the holder wrote) does it try to take
//!   over, with a compare-and-set on that very revision. If the holder renewed
//!   meanwhile the write fails. Wall clocks of two machines are never compared.
//! - **The holder stops before anyone can take over.** A renewal counts from
//!   when it was *sent*; a standby can only see it after it landed, which is
//!   later. The holder stops acting `renew_deadline` after its last successful
//!   renewal was sent, and `renew_deadline < ttl`: the margin absorbs clock rate
//!   differences and the time the holder needs to notice.
//! - **Epochs only grow.** A takeover writes the epoch of the value it replaces
//!   plus one; the leader later writes back the epoch it claimed in the registry
//!   ([`Leadership::adopt_epoch`]), which is at least that.
//!
//! - **Every write is distinct.** `renewals` counts all of a holder's writes,
//!   so a read that shows exactly the value of our unanswered write proves that
//!   very write landed (and when it was sent), never an earlier identical try.
//!
//! It must never: propose a takeover on a revision it has not seen unchanged for
//! the TTL (except an absent or released key), report the leadership as held past
//! the renew deadline, or issue a second write before the first was answered.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::RegistryMark;
use tenure_protocol::Epoch;

/// Leadership timing. All durations are measured on the observer's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeadershipConfig {
    /// A standby takes over once the key's revision has not changed for this long.
    pub ttl: Duration,
    /// The leader renews this often.
    pub renew_interval: Duration,
    /// The leader stops acting when its last successful renewal was sent this
    /// long ago. Must be below `ttl`; the difference is the safety margin.
    pub renew_deadline: Duration,
}

impl Default for LeadershipConfig {
    fn default() -> Self {
        LeadershipConfig {
            ttl: Duration::from_millis(6000),
            renew_interval: Duration::from_millis(2000),
            renew_deadline: Duration::from_millis(4000),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The timing cannot be safe: a leader could still act after a standby
    /// judged its leadership expired, or it could not renew in time.
    #[error(
        "lease timing must satisfy 0 < renew interval ({interval_ms} ms) < renew deadline ({deadline_ms} ms) \
         < lease ttl ({ttl_ms} ms)"
    )]
    Timing { interval_ms: u64, deadline_ms: u64, ttl_ms: u64 },
}

impl LeadershipConfig {
    /// Checks `0 < renew_interval < renew_deadline < ttl`.
    pub fn validate(&self) -> Result<(), Error> {
        let ok = !self.renew_interval.is_zero()
            && self.renew_interval < self.renew_deadline
            && self.renew_deadline < self.ttl;
        if ok {
            Ok(())
        } else {
            Err(Error::Timing {
                interval_ms: ms(self.renew_interval),
                deadline_ms: ms(self.renew_deadline),
                ttl_ms: ms(self.ttl),
            })
        }
    }

    /// How long the leader waits after a renewal that got no answer before it
    /// tries again (the key is read in between).
    pub fn retry(&self) -> Duration {
        (self.renew_interval / 4).max(Duration::from_millis(10))
    }
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The value of the leadership key (encoded with `tenure_protocol::encode`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeadershipRecord {
    /// Coordinator name and per-process nonce: unique to one process.
    pub holder: String,
    /// The leadership term; raised to the epoch claimed in the registry.
    pub epoch: Epoch,
    /// This holder's count of leadership writes (takeover, renewals, release). It
    /// grows with every write, tried or landed, so no two writes of a holder
    /// carry the same value: a read showing exactly the value of our unanswered
    /// write proves *that* write landed, not an earlier identical one.
    pub renewals: u64,
    /// The TTL the holder counts on. Standbys wait at least this long. `0`
    /// means the holder released the leadership after it stopped acting.
    pub ttl_ms: u64,
    /// The registry's high-water mark as the holder last knew it durable
    /// (renewals carry the latest; a takeover carries the one it replaces).
    /// Absent in values written before the mark existed.
    #[serde(default)]
    pub mark: Option<RegistryMark>,
}

impl LeadershipRecord {
    pub fn is_released(&self) -> bool {
        self.ttl_ms == 0
    }
}

/// What the key held when it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// Never written, deleted or purged.
    Absent,
    Held(LeadershipRecord),
    /// A value that does not decode. Treated as held by someone unknown.
    Unreadable,
}

/// What the driver observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// Time passed; nothing else happened.
    Tick,
    /// The key as read. `revision` is 0 when the key never existed.
    Key { revision: u64, state: KeyState },
    /// The write last decided landed at `revision`.
    Written { revision: u64 },
    /// The write last decided was refused: the key is no longer at the expected revision.
    Conflict,
    /// The write last decided got no answer: it may or may not have landed. The
    /// driver reads the key next; until a read resolves it, nothing else is written.
    WriteFailed,
}

/// A compare-and-set the driver must carry out now, then report with
/// `Written`, `Conflict` or `WriteFailed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The revision the key must still have; 0 means it must not exist.
    pub expected: u64,
    pub value: LeadershipRecord,
}

/// Why the leader stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepDownReason {
    /// No renewal succeeded within the renew deadline.
    DeadlineMissed { since_renewal: Duration },
    /// Someone else wrote the key.
    Lost { holder: Option<String>, revision: Option<u64> },
}

impl std::fmt::Display for StepDownReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepDownReason::DeadlineMissed { since_renewal } => {
                write!(f, "no lease renewal succeeded for {} ms (renew deadline)", ms(*since_renewal))
            }
            StepDownReason::Lost { holder: Some(h), .. } => write!(f, "lease taken by {h}"),
            StepDownReason::Lost { holder: None, .. } => write!(f, "lease key changed under us"),
        }
    }
}

/// What the machine wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    None,
    /// Try to take the leadership (it expired in our eyes, was released, or is absent).
    Acquire(Write),
    /// Renew the leadership we hold.
    Renew(Write),
    /// Our takeover landed: lead under `epoch`. `takeover_started` is when this
    /// process judged the previous holder's leadership expired.
    Lead {
        epoch: Epoch,
        takeover_started: Duration,
    },
    /// Stop every write and every command now.
    StepDown(StepDownReason),
}

#[derive(Debug, Clone)]
struct Pending {
    write: Write,
    sent_at: Duration,
    /// `WriteFailed` came back: only a read can tell whether it landed.
    unanswered: bool,
}

#[derive(Debug, Clone)]
struct Seen {
    revision: u64,
    state: KeyState,
    /// Our clock when we first saw this revision.
    since: Duration,
}

#[derive(Debug, Clone)]
struct Standby {
    seen: Option<Seen>,
    /// A write was refused or unanswered: judge nothing before the next read.
    needs_read: bool,
    /// No takeover before this time (set when this process steps down).
    not_before: Duration,
    takeover_started: Option<Duration>,
}

/// The leadership as its holder sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub revision: u64,
    pub value: LeadershipRecord,
    /// When the last successful write was sent.
    pub renewed_at: Duration,
    pub takeover_started: Duration,
    next_renew_at: Duration,
}

#[derive(Debug, Clone)]
enum Role {
    Standby(Standby),
    Leader(Held),
}

/// One coordinator's side of the leadership.
#[derive(Debug, Clone)]
pub struct Leadership {
    cfg: LeadershipConfig,
    holder: String,
    role: Role,
    pending: Option<Pending>,
    /// Highest epoch seen in the key or held by us.
    highest: Epoch,
    /// The `renewals` value of our next write.
    next_write: u64,
    /// The registry's high-water mark: the latest one read in the key or
    /// adopted by us. A takeover writes it on, so that it outlives terms
    /// that refused to lead.
    mark: Option<RegistryMark>,
}

impl Leadership {
    /// A standby that has not read the key yet. `holder` must be unique to this process.
    pub fn new(cfg: LeadershipConfig, holder: impl Into<String>) -> Leadership {
        Leadership {
            cfg,
            holder: holder.into(),
            role: Role::Standby(Standby {
                seen: None,
                needs_read: false,
                not_before: Duration::ZERO,
                takeover_started: None,
            }),
            pending: None,
            highest: Epoch(0),
            next_write: 0,
            mark: None,
        }
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    pub fn config(&self) -> &LeadershipConfig {
        &self.cfg
    }

    /// The leadership we hold, if we lead.
    pub fn held(&self) -> Option<&Held> {
        match &self.role {
            Role::Leader(h) => Some(h),
            Role::Standby(_) => None,
        }
    }

    /// Until when the leader may act (exclusive): its last successful renewal
    /// plus the renew deadline. `None` when not leading.
    pub fn valid_until(&self) -> Option<Duration> {
        self.held().map(|h| h.renewed_at + self.cfg.renew_deadline)
    }

    /// Whether this process may write and command at `now`.
    pub fn may_act(&self, now: Duration) -> bool {
        self.valid_until().is_some_and(|until| now < until)
    }

    /// The value last seen in the key by a standby.
    pub fn seen(&self) -> Option<(u64, &KeyState)> {
        match &self.role {
            Role::Standby(Standby { seen: Some(s), .. }) => Some((s.revision, &s.state)),
            _ => None,
        }
    }

    pub fn handle(&mut self, obs: Observation, now: Duration) -> Decision {
        let decided = match obs {
            Observation::Tick => None,
            Observation::Key { revision, state } => self.observe_key(revision, state, now),
            Observation::Written { revision } => self.written(revision, now),
            Observation::Conflict => self.conflict(now),
            Observation::WriteFailed => self.write_failed(now),
        };
        match decided {
            Some(d) => d,
            None => self.poll(now),
        }
    }

    /// The leader claimed `epoch` in the registry: write it back to the key at
    /// the next renewal, which is due at once.
    pub fn adopt_epoch(&mut self, epoch: Epoch, now: Duration) {
        self.highest = self.highest.max(epoch);
        if let Role::Leader(h) = &mut self.role {
            if epoch > h.value.epoch {
                h.value.epoch = epoch;
                h.next_renew_at = now;
            }
        }
    }

    /// The registry's high-water mark moved (the leader's appends became
    /// durable, or an operator accepted a registry that went back): the next
    /// write carries it. No write is hurried for it.
    pub fn adopt_mark(&mut self, mark: RegistryMark) {
        self.mark = Some(mark);
        if let Role::Leader(h) = &mut self.role {
            h.value.mark = Some(mark);
        }
    }

    /// The leader stopped acting on its own account (fenced by the registry, a
    /// newer epoch seen, shutting down). Returns the write that releases the key
    /// so that a standby can take over at once, when one can be made (no write
    /// of ours is unresolved). This process itself waits a full TTL before it
    /// competes again.
    pub fn step_down(&mut self, now: Duration) -> Option<Write> {
        let Role::Leader(h) = &self.role else {
            return None;
        };
        let renewals = self.next_write;
        let release = self.pending.is_none().then(|| Write {
            expected: h.revision,
            value: LeadershipRecord { renewals, ttl_ms: 0, ..h.value.clone() },
        });
        self.next_write += 1;
        self.become_standby(now);
        release
    }

    fn become_standby(&mut self, now: Duration) {
        self.pending = None;
        self.role = Role::Standby(Standby {
            seen: None,
            needs_read: true,
            not_before: now + self.cfg.ttl,
            takeover_started: None,
        });
    }

    fn lose(&mut self, reason: StepDownReason, now: Duration) -> Decision {
        self.become_standby(now);
        Decision::StepDown(reason)
    }

    fn observe_key(&mut self, revision: u64, state: KeyState, now: Duration) -> Option<Decision> {
        if let KeyState::Held(v) = &state {
            self.highest = self.highest.max(v.epoch);
            if v.mark.is_some() && !matches!(self.role, Role::Leader(_)) {
                self.mark = v.mark;
            }
        }
        if let Some(p) = &self.pending {
            let ours = matches!(&state, KeyState::Held(v) if *v == p.write.value);
            if ours && revision > p.write.expected {
                return self.written(revision, now);
            }
            if p.unanswered {
                // The read shows something else: that write did not land. (Should
                // it land later, nobody renews it and it expires like any other.)
                self.pending = None;
            }
        }
        match &mut self.role {
            Role::Leader(h) => {
                if revision <= h.revision {
                    // Our own current write, or an older copy from a lagging replica.
                    return None;
                }
                let holder = match &state {
                    KeyState::Held(v) => Some(v.holder.clone()),
                    _ => None,
                };
                Some(self.lose(StepDownReason::Lost { holder, revision: Some(revision) }, now))
            }
            Role::Standby(s) => {
                s.needs_read = false;
                if s.seen.as_ref().is_none_or(|seen| seen.revision != revision) {
                    s.seen = Some(Seen { revision, state, since: now });
                    s.takeover_started = None;
                }
                None
            }
        }
    }

    fn written(&mut self, revision: u64, now: Duration) -> Option<Decision> {
        let p = self.pending.take()?;
        let deadline = self.cfg.renew_deadline;
        match &mut self.role {
            Role::Standby(s) => {
                let takeover_started = s.takeover_started.unwrap_or(p.sent_at);
                self.highest = self.highest.max(p.write.value.epoch);
                let epoch = p.write.value.epoch;
                self.role = Role::Leader(Held {
                    revision,
                    value: p.write.value,
                    renewed_at: p.sent_at,
                    takeover_started,
                    next_renew_at: p.sent_at + self.cfg.renew_interval,
                });
                // Answered so late that the leadership may already be judged expired:
                // the poll that follows steps down instead of leading.
                (now < p.sent_at + deadline).then_some(Decision::Lead { epoch, takeover_started })
            }
            Role::Leader(h) => {
                let adopted = h.value.epoch;
                // A mark adopted while this write was in flight is newer than its.
                let mark = h.value.mark;
                h.revision = revision;
                h.value = p.write.value;
                h.value.mark = mark;
                h.renewed_at = h.renewed_at.max(p.sent_at);
                h.next_renew_at = p.sent_at + self.cfg.renew_interval;
                if adopted > h.value.epoch {
                    // An epoch adopted while this write was in flight: write it back now.
                    h.value.epoch = adopted;
                    h.next_renew_at = now;
                }
                None
            }
        }
    }

    fn conflict(&mut self, now: Duration) -> Option<Decision> {
        self.pending.take()?;
        match &mut self.role {
            Role::Standby(s) => {
                s.needs_read = true;
                None
            }
            Role::Leader(_) => Some(self.lose(StepDownReason::Lost { holder: None, revision: None }, now)),
        }
    }

    fn write_failed(&mut self, now: Duration) -> Option<Decision> {
        let retry = self.cfg.retry();
        let p = self.pending.as_mut()?;
        p.unanswered = true;
        match &mut self.role {
            Role::Standby(s) => s.needs_read = true,
            Role::Leader(h) => h.next_renew_at = now + retry,
        }
        None
    }

    /// What time alone calls for.
    fn poll(&mut self, now: Duration) -> Decision {
        let cfg = self.cfg;
        match &mut self.role {
            Role::Leader(h) => {
                let since_renewal = now.saturating_sub(h.renewed_at);
                if since_renewal >= cfg.renew_deadline {
                    return self.lose(StepDownReason::DeadlineMissed { since_renewal }, now);
                }
                if self.pending.is_some() || now < h.next_renew_at {
                    return Decision::None;
                }
                let write = Write {
                    expected: h.revision,
                    value: LeadershipRecord { renewals: self.next_write, ttl_ms: ms(cfg.ttl), ..h.value.clone() },
                };
                self.next_write += 1;
                h.next_renew_at = now + cfg.retry();
                self.pending = Some(Pending { write: write.clone(), sent_at: now, unanswered: false });
                Decision::Renew(write)
            }
            Role::Standby(s) => {
                if self.pending.is_some() || s.needs_read || now < s.not_before {
                    return Decision::None;
                }
                let Some(seen) = &s.seen else {
                    return Decision::None;
                };
                let silent = now.saturating_sub(seen.since);
                let (expired, base) = match &seen.state {
                    KeyState::Absent => (true, self.highest),
                    KeyState::Held(v) if v.is_released() => (true, self.highest.max(v.epoch)),
                    KeyState::Held(v) => {
                        let ttl = cfg.ttl.max(Duration::from_millis(v.ttl_ms));
                        (silent >= ttl, self.highest.max(v.epoch))
                    }
                    KeyState::Unreadable => (silent >= cfg.ttl, self.highest),
                };
                if !expired {
                    return Decision::None;
                }
                s.takeover_started.get_or_insert(now);
                let write = Write {
                    expected: seen.revision,
                    value: LeadershipRecord {
                        holder: self.holder.clone(),
                        epoch: base.next(),
                        renewals: self.next_write,
                        ttl_ms: ms(cfg.ttl),
                        mark: self.mark,
                    },
                };
                self.next_write += 1;
                self.pending = Some(Pending { write: write.clone(), sent_at: now, unanswered: false });
                Decision::Acquire(write)
            }
        }
    }

    /// When the next decision may be due without any new observation: the
    /// driver ticks at least this often.
    pub fn tick_period(&self) -> Duration {
        (self.cfg.renew_interval / 4).clamp(Duration::from_millis(10), Duration::from_millis(100))
    }
}

#[cfg(test)]
#[path = "leadership_tests.rs"]
mod tests;
