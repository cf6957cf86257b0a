//! The sidecar's decisions: which [`SidecarRequest`] may change which
//! [`AttemptRecord`], and the epoch fence. Pure over a [`RecoveryStore`]: no
//! sockets, no clock, no tasks, so every rule is tested with [`MemoryStore`] and
//! [`FailingStore`].
//!
//! **Invariant:** the in-memory view mirrors the store. Each change is written
//! (and flushed) first and applied in memory only when the write succeeded; a
//! failed write is answered with [`SidecarRefusal::Storage`] and changes nothing.
//!
//! **Invariant:** an attempt whose intent is recorded is never forgotten or given
//! back: only an `Accepted` record can be abandoned, and phases only advance.
//!
//! This module never starts or kills processes and never talks to the network.
//!
//! [`MemoryStore`]: crate::store::MemoryStore
//! [`FailingStore`]: crate::store::FailingStore

use std::collections::BTreeMap;

use tenure_protocol::messages::{
    AttemptRecord, CorruptAttempt, LeaseGrant, Phase, RegistryMark, SidecarRefusal, SidecarReply, SidecarRequest,
    MAX_LIST_PAGE_BYTES, MAX_SIDECAR_MANY,
};
use tenure_protocol::{Attempt, Epoch, Outcome, TaskId};
use tracing::{debug, info, warn};

pub use tenure_machine::evidence::RecordView;

use crate::store::{self, CorruptRecord, RecoveryStore};

/// One worker machine's recovery state: the highest epoch seen and every
/// attempt record, backed by a [`RecoveryStore`].
#[derive(Debug)]
pub struct Machine<S> {
    store: S,
    /// The store's identity (see [`crate::store::Loaded::incarnation`]).
    incarnation: uuid::Uuid,
    epoch: Epoch,
    records: BTreeMap<(TaskId, Attempt), AttemptRecord>,
    corrupt: Vec<CorruptRecord>,
    /// Attempts the leader revoked by an evidence query: never accepted again.
    revoked: std::collections::BTreeSet<(TaskId, Attempt)>,
    /// The highest registry mark of every grant accepted here (durable: in
    /// the records' grants, or in the store's own copy for removed records).
    mark: Option<RegistryMark>,
    /// The store's own copy of the mark, as last written.
    stored_mark: Option<RegistryMark>,
    /// The machine's current boot ([`tenure_machine::boot::boot_id`]), recorded with each
    /// intent; `None` when unknown (then no restart is ever claimed).
    boot: Option<String>,
}

type Decision = Result<(), SidecarRefusal>;

impl<S: RecoveryStore> Machine<S> {
    /// Loads everything `store` holds. Corrupt records are kept aside (see
    /// [`Machine::corrupt`]): the attempts they name are refused with
    /// [`SidecarRefusal::Storage`] rather than treated as absent, since the lost
    /// record may have held an intent.
    pub fn restore(store: S) -> Result<Machine<S>, store::Error> {
        let loaded = store.load()?;
        // The epoch is always written before a record carrying it; taking the
        // maximum anyway can only make the fence stricter.
        let epoch = loaded.records.iter().map(|r| r.grant.epoch).fold(loaded.epoch, Epoch::max);
        let stored_mark = loaded.mark;
        let mark = loaded.records.iter().fold(stored_mark, |m, r| RegistryMark::merged(m, r.grant.mark));
        let records = loaded.records.into_iter().map(|r| ((r.grant.task.clone(), r.grant.attempt), r)).collect();
        let revoked = loaded.revoked.into_iter().collect();
        Ok(Machine {
            store,
            incarnation: loaded.incarnation,
            epoch,
            records,
            corrupt: loaded.corrupt,
            revoked,
            mark,
            stored_mark,
            boot: None,
        })
    }

    /// The machine's current boot, recorded with each intent from now on.
    pub fn with_boot(mut self, boot: Option<String>) -> Machine<S> {
        self.boot = boot;
        self
    }

    /// Decides one request. Mutations are durable before this returns `Ok`.
    pub fn handle(&mut self, req: SidecarRequest) -> SidecarReply {
        let decision = match req {
            SidecarRequest::ObserveEpoch(epoch) => self.observe(epoch),
            SidecarRequest::Accept(grant) => self.accept(grant),
            SidecarRequest::Intent { task, attempt, epoch, .. } => self.intent(&task, attempt, epoch),
            SidecarRequest::Spawned { task, attempt, pid } => self.spawned(&task, attempt, pid),
            SidecarRequest::Exited { task, attempt, outcome } => self.exited(&task, attempt, outcome),
            SidecarRequest::Acknowledged { task, attempt } => self.acknowledged(&task, attempt),
            SidecarRequest::Abandon { task, attempt } => self.abandon(&task, attempt),
            SidecarRequest::Incarnation => {
                return SidecarReply::Identity { incarnation: self.incarnation, mark: self.mark }
            }
            SidecarRequest::List => return self.page(None),
            SidecarRequest::ListFrom { task, attempt } => return self.page(Some((task, attempt))),
            SidecarRequest::Many(reqs) => return self.many(reqs),
        };
        match decision {
            Ok(()) => SidecarReply::Ok,
            Err(refusal) => SidecarReply::Refused(refusal),
        }
    }

    /// A batch: each request judged alone, in order; one that may not be
    /// batched is refused in its place, and an oversized batch as a whole.
    fn many(&mut self, reqs: Vec<SidecarRequest>) -> SidecarReply {
        if reqs.len() > MAX_SIDECAR_MANY {
            let why = format!("a batch of {} requests (at most {MAX_SIDECAR_MANY})", reqs.len());
            return SidecarReply::Refused(SidecarRefusal::Malformed(why));
        }
        let alone = || SidecarReply::Refused(SidecarRefusal::Malformed("this request cannot travel in a batch".into()));
        SidecarReply::Many(reqs.into_iter().map(|req| if req.batches() { self.handle(req) } else { alone() }).collect())
    }

    /// The identity of this machine's store.
    pub fn incarnation(&self) -> uuid::Uuid {
        self.incarnation
    }

    /// The highest registry mark this machine was given with a grant.
    pub fn mark(&self) -> Option<RegistryMark> {
        self.mark
    }

    /// The highest epoch this machine has seen.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// Every record, ordered by task then attempt.
    pub fn records(&self) -> impl Iterator<Item = &AttemptRecord> {
        self.records.values()
    }

    pub fn record(&self, task: &TaskId, attempt: Attempt) -> Option<&AttemptRecord> {
        self.records.get(&(task.clone(), attempt))
    }

    /// The record of the latest attempt of `task` held here: the one whose owner
    /// may read the task's output, and whose phase says if the output is final.
    pub fn record_for_output(&self, task: &TaskId) -> Option<&AttemptRecord> {
        self.latest(task)
    }

    /// One page of records after `after` (from the start with `None`), within
    /// `MAX_LIST_PAGE_BYTES` of encoded records (at least one record, which
    /// fits a message by the spec limits); the unreadable ones with the first.
    fn page(&self, after: Option<(TaskId, Attempt)>) -> SidecarReply {
        use std::ops::Bound;
        let from = match &after {
            Some(key) => Bound::Excluded(key.clone()),
            None => Bound::Unbounded,
        };
        let (mut records, mut bytes, mut next) = (Vec::new(), 0usize, None);
        for record in self.records.range((from, Bound::Unbounded)).map(|(_, r)| r) {
            let size = tenure_protocol::encode(record).map(|b| b.len()).unwrap_or(usize::MAX);
            if !records.is_empty() && bytes.saturating_add(size) > MAX_LIST_PAGE_BYTES {
                next = records.last().map(|r: &AttemptRecord| (r.grant.task.clone(), r.grant.attempt));
                break;
            }
            bytes = bytes.saturating_add(size);
            records.push(record.clone());
        }
        let corrupt = match after {
            Some(_) => Vec::new(),
            None => self
                .corrupt
                .iter()
                .map(|c| CorruptAttempt { key: c.key.clone(), attempt: c.attempt.clone(), reason: c.reason.clone() })
                .collect(),
        };
        SidecarReply::Records { epoch: self.epoch, records, corrupt, next }
    }

    /// Whether `(task, attempt)` is tombstoned: it can never be accepted here.
    pub fn is_revoked(&self, task: &TaskId, attempt: Attempt) -> bool {
        self.revoked.contains(&(task.clone(), attempt))
    }

    /// Records that could not be read at load time.
    pub fn corrupt(&self) -> &[CorruptRecord] {
        &self.corrupt
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The store, to switch its flush mode (group commit in the server).
    pub fn store_mut(&mut self) -> &mut S {
        &mut self.store
    }

    pub fn into_store(self) -> S {
        self.store
    }

    // ------------------------------------------------------------ rules

    /// The fence: lower epochs are refused, a higher one is persisted.
    fn observe(&mut self, offered: Epoch) -> Decision {
        if offered < self.epoch {
            debug!(epoch = %offered, held = %self.epoch, "refused stale epoch");
            return Err(SidecarRefusal::StaleEpoch { held: self.epoch, offered });
        }
        if offered > self.epoch {
            self.store.put_epoch(offered).map_err(storage)?;
            info!(epoch = %offered, previous = %self.epoch, "observed a higher epoch");
            self.epoch = offered;
        }
        Ok(())
    }

    /// Records a grant. Repeating the same grant is `Ok` (a retried command); a
    /// grant older than an attempt already held, or one that differs from the
    /// grant recorded for the same attempt, is refused.
    fn accept(&mut self, grant: LeaseGrant) -> Decision {
        self.observe(grant.epoch)?;
        let (task, attempt) = (grant.task.clone(), grant.attempt);
        if self.revoked.contains(&(task.clone(), attempt)) {
            return Err(SidecarRefusal::Revoked { task, attempt });
        }
        self.refuse_corrupt(&task, |a| a >= attempt)?;
        if let Some(newer) = self.latest(&task).filter(|r| r.grant.attempt > attempt) {
            return Err(wrong_phase(newer, format!("accept attempt {attempt}, older than the one held")));
        }
        match self.records.get(&(task.clone(), attempt)) {
            None => {
                let mark = grant.mark;
                let record = AttemptRecord { grant, phase: Phase::Accepted, pid: None, outcome: None, boot: None };
                self.commit(record)?;
                self.mark = RegistryMark::merged(self.mark, mark);
                debug!(task = %task, attempt = %attempt, epoch = %self.epoch, "accepted");
                Ok(())
            }
            // A copy of a grant already acted on (a re-send that crossed the
            // attempt's reports): refused, so that nothing starts it again. The
            // worker answers such a copy `Accepted` — the attempt is known here.
            Some(held) if same_grant(&held.grant, &grant) && held.phase > Phase::Accepted => {
                Err(wrong_phase(held, "accept it again: its intent is recorded"))
            }
            Some(held) if same_grant(&held.grant, &grant) => {
                let held = held.clone();
                self.raise_record_epoch(held, grant.epoch)
            }
            Some(held) => Err(wrong_phase(held, "accept a different grant for the same attempt")),
        }
    }

    /// Records the intent: from here on the attempt may have run.
    fn intent(&mut self, task: &TaskId, attempt: Attempt, epoch: Epoch) -> Decision {
        self.observe(epoch)?;
        if self.revoked.contains(&(task.clone(), attempt)) {
            return Err(SidecarRefusal::Revoked { task: task.clone(), attempt });
        }
        let held = self.existing(task, attempt)?.clone();
        if held.phase == Phase::Accepted {
            // The gate to side effects: a newer grant of the task means this one
            // was given up by the coordinator, and starting it could run the task twice.
            if let Some(newer) = self.latest(task).filter(|r| r.grant.attempt > attempt) {
                return Err(wrong_phase(
                    newer,
                    format!("record intent for attempt {attempt}, older than the one held"),
                ));
            }
            let mut next = held;
            next.phase = Phase::Intent;
            next.grant.epoch = next.grant.epoch.max(epoch);
            next.boot = self.boot.clone();
            self.commit(next)?;
            debug!(task = %task, attempt = %attempt, epoch = %epoch, "intent recorded");
            Ok(())
        } else {
            self.raise_record_epoch(held, epoch)
        }
    }

    fn spawned(&mut self, task: &TaskId, attempt: Attempt, pid: i32) -> Decision {
        let held = self.existing(task, attempt)?;
        match held.phase {
            Phase::Accepted => Err(wrong_phase(held, "record a process before its intent")),
            Phase::Intent => {
                let mut next = held.clone();
                next.phase = Phase::Spawned;
                next.pid = Some(pid);
                self.commit(next)?;
                debug!(task = %task, attempt = %attempt, pid, "spawned");
                Ok(())
            }
            _ if held.pid == Some(pid) => Ok(()),
            _ => Err(wrong_phase(held, format!("record pid {pid}: pid {:?} is recorded", held.pid))),
        }
    }

    /// Buffers the outcome. The first outcome wins; a repeat changes nothing.
    fn exited(&mut self, task: &TaskId, attempt: Attempt, outcome: Outcome) -> Decision {
        let held = self.existing(task, attempt)?;
        match held.phase {
            Phase::Accepted => Err(wrong_phase(held, "record an outcome before its intent")),
            Phase::Intent | Phase::Spawned => {
                let mut next = held.clone();
                next.phase = Phase::Exited;
                next.outcome = Some(outcome);
                self.commit(next)?;
                debug!(task = %task, attempt = %attempt, "outcome buffered");
                Ok(())
            }
            Phase::Exited | Phase::Acknowledged => Ok(()),
        }
    }

    fn acknowledged(&mut self, task: &TaskId, attempt: Attempt) -> Decision {
        let held = self.existing(task, attempt)?;
        match held.phase {
            Phase::Exited => {
                let mut next = held.clone();
                next.phase = Phase::Acknowledged;
                self.commit(next)?;
                debug!(task = %task, attempt = %attempt, "outcome acknowledged");
                Ok(())
            }
            Phase::Acknowledged => Ok(()),
            _ => Err(wrong_phase(held, "acknowledge an outcome not yet recorded")),
        }
    }

    /// Gives an attempt back before its intent. Absent is `Ok` (a retried
    /// abandon); an attempt with a recorded intent may have run and is refused.
    fn abandon(&mut self, task: &TaskId, attempt: Attempt) -> Decision {
        self.refuse_corrupt(task, |a| a == attempt)?;
        let Some(held) = self.records.get(&(task.clone(), attempt)) else {
            // An attempt given back before it was recorded (the worker refused
            // its grant): tombstoned, so a late copy of the grant is refused
            // here even after the worker restarts and forgets it refused.
            return self.revoke(task, attempt);
        };
        if held.phase != Phase::Accepted {
            return Err(wrong_phase(held, "abandon it: its intent is recorded, it may have run"));
        }
        // Given back for good: a late copy of its grant must not be accepted again
        // (the leader re-grants the task as a new attempt on the report of it).
        self.revoke(task, attempt)?;
        self.forget(task, attempt)?;
        info!(task = %task, attempt = %attempt, "abandoned before intent");
        Ok(())
    }

    /// Answers the leader's evidence query about an attempt (after fencing on
    /// its epoch). An attempt still only `accepted` is abandoned first, so that
    /// "it never started" stays true: a worker that is merely cut off will find
    /// its intent refused.
    ///
    /// A query naming another store incarnation than this one's (the machine's
    /// data was wiped or replaced since the grant) is answered `Replaced`: this
    /// store cannot know, and a late copy of the grant is refused here for good.
    pub fn evidence(
        &mut self,
        task: &TaskId,
        attempt: Attempt,
        epoch: Epoch,
        incarnation: Option<uuid::Uuid>,
    ) -> Result<RecordView, SidecarRefusal> {
        self.observe(epoch)?;
        if incarnation.is_some_and(|i| i != self.incarnation) && !self.records.contains_key(&(task.clone(), attempt)) {
            self.revoke(task, attempt)?;
            return Ok(RecordView::Replaced(self.incarnation));
        }
        if let Some(c) = self.corrupt.iter().find(|c| c.attempt.as_ref() == Some(&(task.clone(), attempt))) {
            return Ok(RecordView::Corrupt(c.reason.clone()));
        }
        let Some(record) = self.records.get(&(task.clone(), attempt)) else {
            // Not here (yet): the grant may still be on its way to a worker
            // that is only slow. The tombstone makes "never started" stay true.
            self.revoke(task, attempt)?;
            return Ok(RecordView::Absent);
        };
        match (record.phase, record.outcome.clone()) {
            (Phase::Accepted, _) => {
                self.revoke(task, attempt)?;
                self.abandon(task, attempt)?;
                info!(task = %task, attempt = %attempt, epoch = %epoch, "revoked on the leader's evidence query");
                Ok(RecordView::Absent)
            }
            (Phase::Exited | Phase::Acknowledged, Some(outcome)) => Ok(RecordView::Ended(outcome)),
            (phase, _) if tenure_machine::boot::booted_since(record, self.boot.as_deref()) => {
                Ok(RecordView::Restarted(phase))
            }
            (phase, _) => Ok(RecordView::Started(phase)),
        }
    }

    /// The fence every cleanup request passes before anything is touched: its
    /// epoch must not be lower than the machine's (a deposed leader's job
    /// removes nothing). Returns how many records of `task` are held.
    pub fn cleanup_fence(&mut self, task: &TaskId, epoch: Epoch) -> Result<u32, SidecarRefusal> {
        self.observe(epoch)?;
        Ok(self.records.keys().filter(|(t, _)| t == task).count() as u32)
    }

    /// A cleanup job: forgets every record of `task` (each attempt tombstoned, so
    /// nothing of it can be accepted again). The caller removed the task's files
    /// first, so a crash in between leaves records that a retry finds again,
    /// never files that nothing names.
    pub fn cleanup(&mut self, task: &TaskId, epoch: Epoch) -> Result<u32, SidecarRefusal> {
        self.observe(epoch)?;
        let attempts: Vec<Attempt> = self.records.keys().filter(|(t, _)| t == task).map(|(_, a)| *a).collect();
        for attempt in &attempts {
            self.revoke(task, *attempt)?;
            self.forget(task, *attempt)?;
        }
        info!(task = %task, records = attempts.len(), "cleaned up");
        Ok(attempts.len() as u32)
    }

    /// Removes an attempt's record. The registry mark its grant carried is
    /// kept: written to the store's own copy first when nothing else holds it.
    fn forget(&mut self, task: &TaskId, attempt: Attempt) -> Decision {
        let carried = self.records.get(&(task.clone(), attempt)).and_then(|r| r.grant.mark);
        if let (Some(carried), Some(mark)) = (carried, self.mark) {
            if self.stored_mark.is_none_or(|stored| carried.is_ahead_of(&stored)) {
                self.store.put_mark(mark).map_err(storage)?;
                self.stored_mark = Some(mark);
            }
        }
        self.store.remove(task, attempt).map_err(storage)?;
        self.records.remove(&(task.clone(), attempt));
        Ok(())
    }

    /// Persists the tombstone of a revoked attempt (idempotent).
    fn revoke(&mut self, task: &TaskId, attempt: Attempt) -> Decision {
        if self.revoked.contains(&(task.clone(), attempt)) {
            return Ok(());
        }
        self.store.put_revoked(task, attempt).map_err(storage)?;
        self.revoked.insert((task.clone(), attempt));
        Ok(())
    }

    // ---------------------------------------------------------- helpers

    fn latest(&self, task: &TaskId) -> Option<&AttemptRecord> {
        self.records.range((task.clone(), Attempt(0))..=(task.clone(), Attempt(u32::MAX))).next_back().map(|(_, r)| r)
    }

    fn existing(&self, task: &TaskId, attempt: Attempt) -> Result<&AttemptRecord, SidecarRefusal> {
        self.refuse_corrupt(task, |a| a == attempt)?;
        self.records
            .get(&(task.clone(), attempt))
            .ok_or_else(|| SidecarRefusal::UnknownAttempt { task: task.clone(), attempt })
    }

    /// Refuses to act on an attempt of `task` whose stored record is unreadable.
    fn refuse_corrupt(&self, task: &TaskId, matches: impl Fn(Attempt) -> bool) -> Decision {
        let hit = self.corrupt.iter().find(|c| c.attempt.as_ref().is_some_and(|(t, a)| t == task && matches(*a)));
        match hit {
            Some(c) => Err(SidecarRefusal::Storage(format!("the record {} is unreadable: {}", c.key, c.reason))),
            None => Ok(()),
        }
    }

    /// A repeated `Accept` or `Intent` under a newer epoch moves the record's
    /// grant to that epoch while the attempt has not started its process, so
    /// that later reports carry the current leader's epoch. Otherwise a no-op.
    fn raise_record_epoch(&mut self, held: AttemptRecord, epoch: Epoch) -> Decision {
        if epoch <= held.grant.epoch || held.phase > Phase::Intent {
            return Ok(());
        }
        let mut next = held;
        next.grant.epoch = epoch;
        self.commit(next)
    }

    /// Writes `record` durably, then applies it in memory.
    fn commit(&mut self, record: AttemptRecord) -> Decision {
        self.store.put(&record).map_err(storage)?;
        debug!(
            task = %record.grant.task,
            attempt = %record.grant.attempt,
            epoch = %record.grant.epoch,
            phase = ?record.phase,
            "record written"
        );
        self.records.insert((record.grant.task.clone(), record.grant.attempt), record);
        Ok(())
    }
}

/// Two grants for the same attempt are the same grant if only the epoch differs
/// (a new leader re-sending what the old one granted).
fn same_grant(a: &LeaseGrant, b: &LeaseGrant) -> bool {
    a.task == b.task && a.attempt == b.attempt && a.owner == b.owner && a.spec == b.spec
}

fn wrong_phase(held: &AttemptRecord, action: impl Into<String>) -> SidecarRefusal {
    SidecarRefusal::WrongPhase {
        task: held.grant.task.clone(),
        attempt: held.grant.attempt,
        phase: held.phase,
        action: action.into(),
    }
}

fn storage(error: store::Error) -> SidecarRefusal {
    warn!(%error, "recovery store write failed; nothing changed");
    SidecarRefusal::Storage(error.to_string())
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
