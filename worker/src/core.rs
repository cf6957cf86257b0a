//! The worker's decisions, without IO: [`Worker`] holds what the worker
//! process knows (the attempts it holds, the attempts it gave back, the
//! highest epoch its machine has seen) and decides
//!
//! - whether a grant may be accepted ([`Worker::screen_grant`], then
//!   [`Worker::grant_recorded`] with the sidecar's answer to its accept,
//!   recorded together with its intent, [`Worker::intent_for`]), and what a
//!   refusal leaves behind (a tombstone, a remembered give-back);
//! - what a kill means ([`Worker::kill`]), and what the owner's pause wish
//!   means ([`Worker::pause`]: kept per held attempt, listed in heartbeats,
//!   restored after a restart from the attempt's files by
//!   [`Worker::restore_paused`]);
//! - each attempt's next step ([`Worker::next`]) and what a step's result
//!   leads to ([`Worker::advance`]): intent → launch → spawned → watch →
//!   buffer → report → acknowledge, with the refused intent, the unseen
//!   shim and the gone shim on their own paths;
//! - when an outcome may be forgotten (a report's answer, [`Worker::settles`]);
//! - what start-up recovery concludes from the sidecar's records and the
//!   attempts' files ([`Worker::recover`], [`unlisted`]).
//!
//! The driver (`attempt.rs`, `daemon.rs`) performs the [`Action`]s — sidecar
//! calls, the shim's launch and watch, reports — and feeds each result back
//! as a [`Done`]; the seeded simulation does the same with its modelled
//! machine, so the decisions it checks are these.
//!
//! **Invariant:** an attempt reaches [`Step::Launch`] only after the sidecar
//! answered its intent `Ok`; nothing after the intent ever gives it back.
//!
//! **Invariant:** an outcome leaves [`Step::Report`] only on an answer that
//! settles it ([`ReportAck::settles`] against the highest epoch seen); a
//! buffered completion is forgotten by the sidecar only after that.
//!
//! This module never reads the clock, never touches a file or a socket, and
//! never panics on what a message or a record says.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tenure_machine::evidence::Settled;
use tenure_protocol::messages::{
    AttemptRecord, HeldAttempt, LeaseGrant, Phase, Refusal, ReportAck, ReportEvent, SidecarRefusal, SidecarReply,
    SidecarRequest, WorkerReply,
};
use tenure_protocol::resources::ResourceSupport;
use tenure_protocol::{Attempt, Ending, Epoch, HintTag, Kind, Outcome, RecoveryHint, TaskId};

/// An attempt: a returning worker may hold an old attempt of a task next to a
/// new one.
pub type Key = (TaskId, Attempt);

/// What the worker offers: the leader's grants are screened against it.
#[derive(Debug, Clone)]
pub struct Config {
    pub slots: u32,
    pub kinds: Vec<Kind>,
    /// The resource limits it can enforce: a grant asking for others is
    /// refused.
    pub enforces: ResourceSupport,
}

/// Where one held attempt stands: the step the driver performs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Record the intent (flushed) before anything can start.
    Intent,
    /// The sidecar refused the intent: give the attempt back (a tombstone),
    /// then report what the refusal proves.
    Abandon { refusal: SidecarReply },
    /// Start it: fork its shim, or run a built-in kind in this process.
    Launch,
    /// Watch the shim until it ends, forwarding a kill to it.
    Watch,
    /// A launch went unanswered: look for the shim (bounded), watch it if
    /// it shows itself, settle from the files otherwise.
    Seek,
    /// The shim is gone: settle from the files (ending an orphaned group
    /// first). `restarted`: the machine booted since the intent.
    Settle { restarted: bool },
    /// Buffer the outcome in the sidecar before anything is reported.
    Buffer(Outcome),
    /// Report until an answer settles it.
    Report(ReportEvent),
    /// The leader has the outcome: the sidecar forgets it.
    Acknowledge,
    /// The outcome is forgotten: the attempt's files go.
    Release,
}

/// What the driver must do for an attempt now. Made one at a time and
/// carried out at once, never stored: the size of its largest variant (a
/// sidecar request with a grant) costs nothing, so it is not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// One sidecar request, re-sent until the sidecar answers.
    Sidecar(SidecarRequest),
    /// Start the attempt ([`Step::Launch`]) under `epoch` (what its reports
    /// carry); `kill` when a kill is pending. A shim that starts is reported
    /// `Started { pid }` (at once, or after the hold of a busy worker, and
    /// with the end report when it was not answered by then:
    /// [`crate::reports::StartedPace`]); nothing is recorded in the sidecar for it (the attempt's
    /// journal names the shim, and recovery settles an attempt at `intent`
    /// from it: durability note a16).
    Launch { kill: bool, epoch: Epoch },
    /// Watch the shim; `kill` when a kill is pending.
    Watch { kill: bool },
    /// Look for a shim whose launch went unanswered.
    Seek { kill: bool },
    /// Settle from the files: the shim is gone.
    Settle { restarted: bool },
    /// Send this report, carrying this epoch (the driver adds the highest
    /// epoch seen when it sends).
    Report { event: ReportEvent, epoch: Epoch },
    /// The attempt is over here: remove its directory and forget it.
    Release,
}

/// The result of an [`Action`], fed back with [`Worker::advance`].
#[derive(Debug, Clone, PartialEq)]
pub enum Done {
    /// The sidecar answered.
    Sidecar(SidecarReply),
    /// The shim was forked and answered with its pid.
    Launched(i32),
    /// The shim could not be started: nothing ran.
    NotStarted(String),
    /// The launcher ended between the request and its answer: a shim may run.
    Unseen,
    /// The attempt ended (a built-in kind's run, a watch, a seek, a settle).
    Ended(Settled),
    /// The leader answered a report (`NotLeader` stands for no answer).
    Reported(ReportAck),
    /// The attempt's files are removed.
    Released,
}

/// One attempt this worker holds.
#[derive(Debug, Clone)]
pub struct Held {
    /// The attempt's grant; `None` for an attempt settled from its directory
    /// alone whose journal had no readable grant.
    pub grant: Option<Arc<LeaseGrant>>,
    /// The epoch its reports carry (at least; the highest epoch seen is added).
    pub epoch: Epoch,
    pub step: Step,
    /// A kill was asked for.
    pub kill: bool,
    /// The owner's pause wish, as recorded in the attempt's files.
    pub paused: bool,
}

/// What to do with a grant before the sidecar is asked.
#[derive(Debug, Clone, PartialEq)]
pub enum Screened {
    /// Answer at once (already held, or refused here).
    Answer(Answer),
    /// Ask the sidecar to record the grant (`SidecarRequest::Accept`) and,
    /// in the same batch, its intent ([`Worker::intent_for`]); then pass the
    /// accept's answer to [`Worker::grant_recorded`] and the intent's to
    /// [`Worker::advance`]. Until then the grant counts against the slots.
    Record,
    /// The same attempt's grant is being recorded (a re-send that came with
    /// it): answer as that one is answered.
    Recording,
}

/// The worker's answer to a command, and what it leaves on the machine.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub reply: WorkerReply,
    /// Tombstone the attempt in the sidecar (best effort, bounded): a late
    /// copy of its grant is refused even by a restarted worker.
    pub tombstone: bool,
    /// The attempt is newly held: drive it.
    pub drive: bool,
}

impl Answer {
    fn reply(reply: WorkerReply) -> Answer {
        Answer { reply, tombstone: false, drive: false }
    }
}

/// A record, an unreadable record or an attempt's files found at start-up,
/// with what the attempt's files show.
#[derive(Debug, Clone)]
pub enum Found {
    /// A readable record.
    Record {
        record: AttemptRecord,
        /// The shim runs now (and recorded no status yet).
        shim_alive: bool,
        /// The machine booted since the intent.
        restarted: bool,
    },
    /// A record that cannot be read, or an attempt's files no record names
    /// that holds the attempt's grant: only the files can speak.
    FilesOnly {
        key: Key,
        grant: Option<LeaseGrant>,
        /// The shim recorded a status.
        status: bool,
        /// The shim runs now.
        shim_alive: bool,
        /// The record is unreadable (`None`: the directory has no record).
        corrupt: Option<String>,
    },
}

/// What recovery leaves to the driver besides the attempts it holds again.
#[derive(Debug, Clone, PartialEq)]
pub enum Recovered {
    /// Give the accepted attempt back (`SidecarRequest::Abandon`).
    Abandon(Key),
    /// Report this, until answered, for an attempt that is not held (not
    /// listed in heartbeats, not killable).
    Report { key: Key, epoch: Epoch, event: ReportEvent },
    /// Remove the attempt's files: its outcome was acknowledged.
    Remove(Key),
}

/// What to do with an attempt's files no record names (see [`unlisted`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unlisted {
    /// Its grant is readable and names it: its record was lost; settle it
    /// from its files.
    Settle,
    /// A process of it may live: keep it (and say why).
    Keep,
    /// Confirmed dead and nobody's: remove it.
    Remove,
}

/// An attempt's files no record names: settled when its journal names it,
/// removed only when confirmed dead (seed 004), kept otherwise.
pub fn unlisted(grant_names_it: bool, shim_alive: bool, group_alive: bool) -> Unlisted {
    match (grant_names_it, shim_alive || group_alive) {
        (true, _) => Unlisted::Settle,
        (false, true) => Unlisted::Keep,
        (false, false) => Unlisted::Remove,
    }
}

/// The worker process's memory (lost when it exits).
#[derive(Debug)]
pub struct Worker {
    config: Config,
    epoch_seen: Epoch,
    held: BTreeMap<Key, Held>,
    /// Attempts this worker refused, or was told to kill before their grant
    /// arrived: the leader gave them back, so a late copy of their grant is
    /// refused and a kill can never be overtaken by its own grant. (The
    /// sidecar's tombstones cover what a restart forgets.)
    given_back: BTreeSet<Key>,
    /// Grants screened [`Screened::Record`] whose sidecar answer is not in
    /// yet (several are recorded together): each holds a slot.
    recording: BTreeSet<Key>,
}

impl Worker {
    pub fn new(config: Config) -> Worker {
        Worker {
            config,
            epoch_seen: Epoch(0),
            held: BTreeMap::new(),
            given_back: BTreeSet::new(),
            recording: BTreeSet::new(),
        }
    }

    pub fn epoch_seen(&self) -> Epoch {
        self.epoch_seen
    }

    /// The machine's fence moved (the sidecar recorded `epoch`).
    pub fn observe(&mut self, epoch: Epoch) {
        self.epoch_seen = self.epoch_seen.max(epoch);
    }

    pub fn held(&self, key: &Key) -> Option<&Held> {
        self.held.get(key)
    }

    pub fn holds_any(&self) -> bool {
        !self.held.is_empty()
    }

    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// The attempts a heartbeat lists.
    pub fn attempts(&self) -> Vec<HeldAttempt> {
        self.held
            .iter()
            .map(|((task, attempt), held)| HeldAttempt {
                task: task.clone(),
                attempt: *attempt,
                paused: held.paused,
                waiting: false,
            })
            .collect()
    }

    /// Every held attempt (for a shutdown that ends them all).
    pub fn keys(&self) -> Vec<Key> {
        self.held.keys().cloned().collect()
    }

    // ------------------------------------------------------------ commands

    /// The resource limits this worker enforces, for its heartbeat.
    pub fn enforces(&self) -> ResourceSupport {
        self.config.enforces
    }

    /// A grant, before the sidecar is asked: already held (a re-send) is
    /// accepted again; a given-back attempt, another kind, resource limits
    /// it cannot enforce, or a full worker are refused. The slots are
    /// counted by [`Worker::occupied`].
    pub fn screen_grant(&mut self, grant: &LeaseGrant) -> Screened {
        let key = (grant.task.clone(), grant.attempt);
        if self.held.contains_key(&key) {
            return Screened::Answer(Answer::reply(WorkerReply::Accepted));
        }
        if self.recording.contains(&key) {
            return Screened::Recording;
        }
        if self.given_back.contains(&key) {
            return Screened::Answer(self.refuse(key, Refusal::UnknownAttempt));
        }
        if !self.config.kinds.contains(&grant.spec.kind) {
            return Screened::Answer(self.refuse(key, Refusal::UnsupportedKind(grant.spec.kind.to_string())));
        }
        if let Some(limits) = grant.spec.resources.as_deref() {
            let unmet = limits.unmet_by(&self.config.enforces);
            if !unmet.is_empty() {
                let names = unmet.into_iter().map(str::to_owned).collect();
                return Screened::Answer(self.refuse(key, Refusal::UnenforcedLimits(names)));
            }
        }
        if self.occupied() >= self.config.slots as usize {
            return Screened::Answer(self.refuse(key, Refusal::NoSlot));
        }
        self.recording.insert(key);
        Screened::Record
    }

    /// The slots in use: the grants being recorded, and every held attempt
    /// whose process may still run. One whose process has ended (its
    /// outcome being buffered, reported, forgotten, its files removed) holds
    /// none: the leader counts its slot free once it has the outcome, and a
    /// grant it sends at once must not race the worker's own bookkeeping.
    pub fn occupied(&self) -> usize {
        let ended = |h: &&Held| matches!(h.step, Step::Buffer(_) | Step::Report(_) | Step::Acknowledge | Step::Release);
        self.held.values().filter(|h| !ended(h)).count() + self.recording.len()
    }

    /// The sidecar's answer to recording `grant` (`Err`: it could not be
    /// reached, with why).
    pub fn grant_recorded(&mut self, grant: LeaseGrant, answer: Result<SidecarReply, String>) -> Answer {
        let key = (grant.task.clone(), grant.attempt);
        self.recording.remove(&key);
        match answer {
            Ok(SidecarReply::Ok) => {}
            Ok(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
                self.observe(held);
                return self.refuse(key, Refusal::StaleEpoch { held, offered });
            }
            // A late copy of a grant this machine already acted on: the
            // attempt is known here (a refusal would tell the leader it never
            // ran), and it is not started again.
            Ok(SidecarReply::Refused(SidecarRefusal::WrongPhase { task, attempt, phase, .. }))
                if task == key.0 && attempt == key.1 && phase > Phase::Accepted =>
            {
                return Answer::reply(WorkerReply::Accepted);
            }
            // The store failed: the accept may have landed, or the attempt's
            // record (with an intent) be unreadable. Not "never held", so not
            // given back: the leader asks the evidence instead.
            Ok(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                return Answer::reply(WorkerReply::Refused(Refusal::SidecarStorage(reason)))
            }
            Ok(other) => return self.refuse(key, Refusal::SidecarUnavailable(format!("{other:?}"))),
            Err(why) => return self.refuse(key, Refusal::SidecarUnavailable(why)),
        }
        self.observe(grant.epoch);
        let epoch = grant.epoch;
        self.held
            .insert(key, Held { grant: Some(Arc::new(grant)), epoch, step: Step::Intent, kill: false, paused: false });
        Answer { reply: WorkerReply::Accepted, tombstone: false, drive: true }
    }

    /// A refusal gives the attempt back: remembered here, and tombstoned in
    /// the sidecar unless the sidecar is what failed (nothing to write to) or
    /// the attempt is already given back.
    fn refuse(&mut self, key: Key, refusal: Refusal) -> Answer {
        let tombstone = !matches!(refusal, Refusal::SidecarUnavailable(_) | Refusal::UnknownAttempt);
        self.given_back.insert(key);
        Answer { reply: WorkerReply::Refused(refusal), tombstone, drive: false }
    }

    /// A kill, once the sidecar took its epoch (`fence`: its answer to
    /// `ObserveEpoch`, `Err` when unreachable). A held attempt is marked
    /// (the driver forwards it); a kill of an attempt never held gives it
    /// back, so its grant, should it come later, is refused.
    pub fn kill(&mut self, key: Key, epoch: Epoch, fence: Result<SidecarReply, String>) -> Answer {
        match fence {
            Ok(SidecarReply::Ok) => self.observe(epoch),
            Ok(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
                return Answer::reply(WorkerReply::Refused(Refusal::StaleEpoch { held, offered }))
            }
            Ok(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                return Answer::reply(WorkerReply::Refused(Refusal::SidecarStorage(reason)))
            }
            Ok(other) => return Answer::reply(WorkerReply::Refused(Refusal::SidecarUnavailable(format!("{other:?}")))),
            Err(why) => return Answer::reply(WorkerReply::Refused(Refusal::SidecarUnavailable(why))),
        }
        match self.held.get_mut(&key) {
            Some(held) => {
                held.kill = true;
                Answer::reply(WorkerReply::Accepted)
            }
            None => {
                self.given_back.insert(key);
                Answer::reply(WorkerReply::Refused(Refusal::UnknownAttempt))
            }
        }
    }

    /// The owner's pause wish for a held attempt, once the sidecar took its
    /// epoch (`fence`, as for a kill). A held attempt takes the wish (the
    /// driver then records it in the attempt's files and tells the shim; if
    /// that fails it calls [`Worker::set_paused`] back); an attempt not held
    /// is refused `UnknownAttempt` and, unlike a kill, not given back: a
    /// pause says nothing about whether its grant may still come.
    pub fn pause(&mut self, key: &Key, epoch: Epoch, fence: Result<SidecarReply, String>, paused: bool) -> Answer {
        match fence {
            Ok(SidecarReply::Ok) => self.observe(epoch),
            Ok(SidecarReply::Refused(SidecarRefusal::StaleEpoch { held, offered })) => {
                return Answer::reply(WorkerReply::Refused(Refusal::StaleEpoch { held, offered }))
            }
            Ok(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                return Answer::reply(WorkerReply::Refused(Refusal::SidecarStorage(reason)))
            }
            Ok(other) => return Answer::reply(WorkerReply::Refused(Refusal::SidecarUnavailable(format!("{other:?}")))),
            Err(why) => return Answer::reply(WorkerReply::Refused(Refusal::SidecarUnavailable(why))),
        }
        match self.set_paused(key, paused) {
            true => Answer::reply(WorkerReply::Accepted),
            false => Answer::reply(WorkerReply::Refused(Refusal::UnknownAttempt)),
        }
    }

    /// Sets the pause wish of a held attempt; false when it is not held.
    pub fn set_paused(&mut self, key: &Key, paused: bool) -> bool {
        match self.held.get_mut(key) {
            Some(held) => {
                held.paused = paused;
                true
            }
            None => false,
        }
    }

    /// After [`Worker::recover`]: an attempt held again whose files record
    /// the owner's pause wish keeps it (and its heartbeats say so).
    pub fn restore_paused(&mut self, key: &Key) {
        self.set_paused(key, true);
    }

    // ------------------------------------------------------------ attempts

    /// The intent a grant screened [`Screened::Record`] is recorded with, in
    /// the same sidecar batch as its accept (one flush): the request
    /// [`Worker::next`] makes first once the grant is recorded. Its answer
    /// is fed back with [`Worker::advance`] once [`Worker::grant_recorded`]
    /// holds the attempt; for a grant not held it changes nothing (the
    /// sidecar refuses an intent for an attempt it did not accept).
    /// `trace`: the grant's trace context, for the sidecar's span.
    pub fn intent_for(&self, grant: &LeaseGrant, trace: Option<String>) -> SidecarRequest {
        let (task, attempt) = (grant.task.clone(), grant.attempt);
        SidecarRequest::Intent { task, attempt, epoch: grant.epoch.max(self.epoch_seen), trace }
    }

    /// What the driver must do next for `key`; `None` when it is not held.
    pub fn next(&self, key: &Key) -> Option<Action> {
        let held = self.held.get(key)?;
        let (task, attempt) = (key.0.clone(), key.1);
        Some(match &held.step {
            // The intent carries the newest epoch this machine has seen, so a
            // leader change between accept and intent re-stamps the attempt
            // instead of refusing it.
            Step::Intent => {
                let epoch = held.epoch.max(self.epoch_seen);
                Action::Sidecar(SidecarRequest::Intent { task, attempt, epoch, trace: None })
            }
            Step::Abandon { .. } => Action::Sidecar(SidecarRequest::Abandon { task, attempt }),
            Step::Launch => Action::Launch { kill: held.kill, epoch: held.epoch },
            Step::Watch => Action::Watch { kill: held.kill },
            Step::Seek => Action::Seek { kill: held.kill },
            Step::Settle { restarted } => Action::Settle { restarted: *restarted },
            Step::Buffer(outcome) => {
                Action::Sidecar(SidecarRequest::Exited { task, attempt, outcome: outcome.clone() })
            }
            Step::Report(event) => Action::Report { event: event.clone(), epoch: held.epoch },
            Step::Acknowledge => Action::Sidecar(SidecarRequest::Acknowledged { task, attempt }),
            Step::Release => Action::Release,
        })
    }

    /// The result of `key`'s last action. A result that does not fit the
    /// step (a stray or repeated one) changes nothing.
    pub fn advance(&mut self, key: &Key, done: Done) {
        let highest = self.epoch_seen;
        let Some(held) = self.held.get_mut(key) else { return };
        let next = match (&held.step, done) {
            (Step::Intent, Done::Sidecar(SidecarReply::Ok)) => {
                held.epoch = held.epoch.max(highest);
                Some(Step::Launch)
            }
            (Step::Intent, Done::Sidecar(refusal)) => Some(Step::Abandon { refusal }),
            (Step::Abandon { refusal }, Done::Sidecar(abandoned)) => {
                // Reported under the grant's own epoch: the attempt never ran.
                held.epoch = held.grant.as_ref().map_or(held.epoch, |g| g.epoch);
                Some(Step::Report(intent_refused(refusal, &abandoned, key.1)))
            }
            (Step::Launch, Done::Launched(_)) => Some(Step::Watch),
            (Step::Launch, Done::NotStarted(detail)) => {
                Some(Step::Buffer(Outcome::new(Ending::Failed, None, Some(detail))))
            }
            (Step::Launch, Done::Unseen) => Some(Step::Seek),
            (Step::Launch | Step::Watch | Step::Seek | Step::Settle { .. }, Done::Ended(settled)) => {
                Some(match settled {
                    Settled::Exited(outcome) => Step::Buffer(outcome),
                    // No outcome to buffer: a restarted worker finds the same
                    // absence of evidence and reports the same thing again,
                    // `gone` when its process is proven gone too.
                    Settled::Lost { hint, gone: true } => Step::Report(ReportEvent::Gone(hint)),
                    Settled::Lost { hint, gone: false } => Step::Report(ReportEvent::Lost(hint)),
                })
            }
            (Step::Buffer(outcome), Done::Sidecar(_)) => Some(Step::Report(ReportEvent::Finished(outcome.clone()))),
            (Step::Report(event), Done::Reported(ack)) if ack.settles(highest.max(held.epoch)) => match event {
                ReportEvent::Finished(_) => Some(Step::Acknowledge),
                _ => return self.forget(key),
            },
            (Step::Acknowledge, Done::Sidecar(_)) => Some(Step::Release),
            (Step::Release, Done::Released) => return self.forget(key),
            _ => None,
        };
        if let Some(step) = next {
            held.step = step;
        }
    }

    /// The attempt is over on this worker: its slot is free.
    fn forget(&mut self, key: &Key) {
        self.held.remove(key);
    }

    /// Whether a report's answer lets the worker stop re-sending it (and drop
    /// what it buffered for it): an `Ack`, or a "stale" from a leader at or
    /// above the highest epoch seen — a deposed leader's "stale" is no answer.
    pub fn settles(&self, ack: &ReportAck, epoch: Epoch) -> bool {
        ack.settles(self.epoch_seen.max(epoch))
    }

    // ------------------------------------------------------------ recovery

    /// Start-up recovery: the sidecar's records (`epoch` is its fence) and the
    /// attempts' files, each with what they show. Attempts that may
    /// have run are held again at the step their evidence calls for; the rest
    /// is returned for the driver.
    ///
    /// | found | held at / returned |
    /// |---|---|
    /// | `acknowledged` | `Remove` its directory (confirmed done) |
    /// | `accepted` | `Abandon` it and `Report` not-started: nothing ran |
    /// | `exited` | held at `Report(Finished)`: the buffered completion again |
    /// | `intent`/`spawned`, shim alive | held at `Watch`: re-attached |
    /// | `intent`/`spawned`, shim gone | held at `Settle` (its status, or lost; `restarted` if the machine booted since) |
    /// | files only, with evidence | held at `Settle`, or `Watch` while the shim lives |
    /// | unreadable record, no evidence | `Report` lost (`sidecar-corrupt`) |
    pub fn recover(&mut self, epoch: Epoch, found: Vec<Found>) -> Vec<Recovered> {
        self.observe(epoch);
        let mut out = Vec::new();
        for f in found {
            match f {
                Found::Record { record, shim_alive, restarted } => {
                    let key = (record.grant.task.clone(), record.grant.attempt);
                    let step = match record.phase {
                        Phase::Acknowledged => {
                            out.push(Recovered::Remove(key));
                            continue;
                        }
                        Phase::Accepted => {
                            out.push(Recovered::Abandon(key.clone()));
                            let event = ReportEvent::NotStarted { reason: "worker restarted before the intent".into() };
                            out.push(Recovered::Report { key, epoch: record.grant.epoch, event });
                            continue;
                        }
                        Phase::Exited => match record.outcome {
                            Some(outcome) => Step::Report(ReportEvent::Finished(outcome)),
                            // An exited record always carries its outcome;
                            // one without is settled from the files.
                            None => Step::Settle { restarted: false },
                        },
                        Phase::Intent | Phase::Spawned if shim_alive => Step::Watch,
                        Phase::Intent | Phase::Spawned => Step::Settle { restarted },
                    };
                    let epoch = record.grant.epoch;
                    self.held.insert(
                        key,
                        Held { grant: Some(Arc::new(record.grant)), epoch, step, kill: false, paused: false },
                    );
                }
                Found::FilesOnly { key, grant, status, shim_alive, corrupt } => {
                    if let (Some(reason), false) = (&corrupt, status || shim_alive) {
                        let hint = RecoveryHint {
                            tag: HintTag::SidecarCorrupt,
                            message: format!(
                                "the worker machine's record of attempt {} is unreadable ({reason}); whether and how \
                                 it ran is lost; it will not be run again by the system",
                                key.1
                            ),
                        };
                        out.push(Recovered::Report { key, epoch: self.epoch_seen, event: ReportEvent::Lost(hint) });
                        continue;
                    }
                    let epoch = grant.as_ref().map_or(self.epoch_seen, |g| g.epoch.max(self.epoch_seen));
                    let step = if shim_alive && !status { Step::Watch } else { Step::Settle { restarted: false } };
                    self.held.insert(key, Held { grant: grant.map(Arc::new), epoch, step, kill: false, paused: false });
                }
            }
        }
        out
    }
}

/// What to report of an attempt whose intent the sidecar refused (nothing was
/// spawned by this process). A refusal that decided something (stale epoch,
/// wrong phase) proves the intent was not written: not started. A store
/// failure does not — a failed flush may have landed, or an unreadable record
/// may hold an earlier intent — unless the abandon that follows succeeds
/// (the record is then removed and tombstoned). Otherwise the attempt is
/// reported lost, `maybe-ran`, and never given back as "nothing ran".
fn intent_refused(refusal: &SidecarReply, abandoned: &SidecarReply, attempt: Attempt) -> ReportEvent {
    let storage = matches!(refusal, SidecarReply::Refused(SidecarRefusal::Storage(_)));
    if !storage || *abandoned == SidecarReply::Ok {
        return ReportEvent::NotStarted { reason: format!("{refusal:?}") };
    }
    ReportEvent::Lost(RecoveryHint {
        tag: HintTag::MaybeRan,
        message: format!(
            "the worker machine's store failed while recording the intent of attempt {attempt} ({refusal:?}) and \
             could not confirm it gave the attempt back ({abandoned:?}); this worker started nothing, but the \
             store cannot prove that no earlier intent was recorded: it is not run again by the system. Check the \
             machine's sidecar, then settle or resubmit the task"
        ),
    })
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
