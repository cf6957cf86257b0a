//! What one input's effects become before they leave the core: one append
//! per task ([`coalesce_persists`]), the grants to one worker process
//! together ([`group_grants`]), and the notices after everything else
//! ([`notices_last`]). Each only merges and moves effects later in the
//! input; none adds, drops or reorders what a worker or a client could tell
//! apart. It also keeps which tasks' ends may share a registry message
//! ([`SharedOnly`]), from the appends that leave.

use std::collections::{HashMap, HashSet};

use tenure_protocol::messages::{WorkerCommand, MAX_GRANTS};
use tenure_protocol::WorkerId;
use uuid::Uuid;

use super::{Effect, Version};
use crate::record::TaskRecord;

/// One append per task per input: when one input's effects persist a task
/// more than once (a submit whose task is leased at once: `queued`, then
/// `leased`), its last version takes the place of its first and the others
/// go. The registry keeps only a task's latest record, so nothing that was
/// durable is lost; every effect that followed the first append waits for
/// this one, which holds everything it reflected (an effect never needs a
/// version *not* to be durable yet). A task also forgotten by the input keeps
/// every append, in order. The merged append keeps the earliest
/// [`Version`](super::Version) of those it replaces (a first record leased at once is still
/// the task's first record).
pub(super) fn coalesce_persists(fx: &mut Vec<Effect>) {
    if fx.iter().filter(|e| matches!(e, Effect::Persist(..))).count() < 2 {
        return;
    }
    let forgotten: HashSet<u64> = fx
        .iter()
        .filter_map(|e| match e {
            Effect::Forget { task, .. } => Some(task.number()),
            _ => None,
        })
        .collect();
    let mut first: HashMap<u64, usize> = HashMap::new();
    let mut superseded = vec![false; fx.len()];
    for i in 0..fx.len() {
        let Effect::Persist(r, version) = &fx[i] else { continue };
        let n = r.id.number();
        if forgotten.contains(&n) {
            continue;
        }
        match first.get(&n) {
            None => {
                first.insert(n, i);
            }
            Some(&j) => {
                // The merged append is every version it stands for: the
                // task's first record if one of them was, else its first
                // grant if one of them was (each happens once per task).
                let merged = match &fx[j] {
                    Effect::Persist(_, first) => (*first).min(*version),
                    _ => *version,
                };
                fx.swap(i, j);
                superseded[i] = true;
                if let Effect::Persist(_, kept) = &mut fx[j] {
                    *kept = merged;
                }
            }
        }
    }
    let mut index = 0;
    fx.retain(|_| {
        let keep = !superseded[index];
        index += 1;
        keep
    });
}

/// Grants to one worker process go together: the untraced grants of this
/// input to the same worker process, up to [`MAX_GRANTS`] at a time, become
/// one [`Effect::Grants`] in the place of the last of them. Moving a grant
/// later in the input only delays it: it still follows its own append, and
/// every append before it (note a). A kill or a pause to the same worker
/// process ends the run, so no command overtakes another to the same
/// worker. A traced grant (sent alone, with its trace context) and a lone
/// grant stay plain commands.
pub(super) fn group_grants(fx: &mut Vec<Effect>) {
    let mut runs: HashMap<(WorkerId, Uuid), Vec<usize>> = HashMap::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, e) in fx.iter().enumerate() {
        let Effect::Command { worker, instance, command, trace } = e else { continue };
        let to = (worker.clone(), *instance);
        match command {
            WorkerCommand::Grant(_) if trace.is_none() => {
                let run = runs.entry(to).or_default();
                run.push(i);
                if run.len() == MAX_GRANTS {
                    groups.push(std::mem::take(run));
                }
            }
            WorkerCommand::Grant(_) => {}
            _ => groups.extend(runs.remove(&to)),
        }
    }
    groups.extend(runs.into_values());
    groups.retain(|g| g.len() > 1);
    if groups.is_empty() {
        return;
    }
    let mut slots: Vec<Option<Effect>> = fx.drain(..).map(Some).collect();
    for group in groups {
        let mut grants = Vec::with_capacity(group.len());
        let mut to = None;
        for &i in &group {
            if let Some(Effect::Command { worker, instance, command: WorkerCommand::Grant(g), .. }) = slots[i].take() {
                grants.push(g);
                to = Some((worker, instance));
            }
        }
        if let (Some((worker, instance)), Some(&last)) = (to, group.last()) {
            slots[last] = Some(Effect::Grants { worker, instance, grants });
        }
    }
    fx.extend(slots.into_iter().flatten());
}

/// An input's notices go after its other effects, in their order. A notice
/// is held until every append before it is durable either way (it tells of
/// a durable end or match), so moving it later only delays it, and nothing
/// orders notices against replies, grants or acks. What it changes is what
/// shares a registry message: the ends of a batch of reports stand in a row
/// in the effects, not each between two notices (durability note a20). A
/// record of the input that cannot be stored (an encoding failure, which
/// the record limits make all but impossible) drops every effect after it
/// but replies (the driver's `unwind`): now all of the input's notices, not
/// only those after it. Those ends stay unreported and are read with `get`
/// or `ls`, as such an end's notice was before.
pub(crate) fn notices_last(fx: &mut Vec<Effect>) {
    let notice = |e: &Effect| matches!(e, Effect::Notify(_));
    let Some(first) = fx.iter().position(notice) else { return };
    if fx[first..].iter().all(notice) {
        return;
    }
    let (notices, rest): (Vec<Effect>, Vec<Effect>) = fx.drain(first..).partition(notice);
    fx.extend(rest);
    fx.extend(notices);
}

/// The live tasks every record of which so far was a first record or a first
/// grant ([`Version`]): none of their records went on their own subject as
/// a `Later` one, so their end may share a message ([`Version::End`]). An
/// end that shares a message leaves the task's subject as it was, which is
/// what the registry's room counts on: a task either ends in a batch and
/// never wrote to its subject after its creation and grant, or ends on its
/// subject, replacing what it wrote there (durability note a20).
///
/// Kept from the appends the core hands out, after merging (a `Later`
/// record merged into its task's end goes nowhere but in the end). Only in
/// this leader's memory: a task loaded by a new leader ends on its subject.
/// A task leaves it with its end, or any later record; one dropped before
/// it ended (its first record could not be stored) stays, harmlessly: task
/// numbers are never given again.
#[derive(Debug, Default)]
pub(crate) struct SharedOnly(HashSet<u64>);

impl SharedOnly {
    /// `record` leaves the core as an append of `version`.
    pub(crate) fn persisted(&mut self, record: &TaskRecord, version: Version) {
        let n = record.id.number();
        match version {
            Version::First if !record.life.status.is_terminal() && crate::limits::end_may_share(&record.spec) => {
                self.0.insert(n);
            }
            Version::FirstGrant if !record.life.status.is_terminal() => {}
            _ => {
                self.0.remove(&n);
            }
        }
    }

    pub(crate) fn contains(&self, n: &u64) -> bool {
        self.0.contains(n)
    }
}
