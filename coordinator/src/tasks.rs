//! The leader's copy of the registry: every kept task record, by task number.
//!
//! It owns only storage and lookup; what happens to a task is decided in
//! `core.rs`. Most of a kept task's memory is its record, so the map holds
//! records boxed — a node then carries 16 bytes per task, not a whole record —
//! and keys them by number alone: numbers are unique cluster-wide, so the
//! kind in a `TaskId` key would be a second copy of what the record holds.
//!
//! A lookup by `TaskId` still checks the kind: `shell-7` never finds `noop-7`,
//! exactly as when the whole id was the key.

use std::collections::BTreeMap;

use tenure_protocol::TaskId;

use crate::record::TaskRecord;

#[derive(Debug, Default)]
pub(crate) struct Tasks {
    by_number: BTreeMap<u64, Box<TaskRecord>>,
}

impl Tasks {
    pub(crate) fn get(&self, id: &TaskId) -> Option<&TaskRecord> {
        self.by_number.get(&id.number()).map(|r| &**r).filter(|r| r.id == *id)
    }

    pub(crate) fn get_mut(&mut self, id: &TaskId) -> Option<&mut TaskRecord> {
        self.by_number.get_mut(&id.number()).map(|r| &mut **r).filter(|r| r.id == *id)
    }

    /// The task numbered `n`, whatever its kind.
    pub(crate) fn by_number(&self, n: u64) -> Option<&TaskRecord> {
        self.by_number.get(&n).map(|r| &**r)
    }

    /// Keeps `record`, replacing any record of the same number.
    pub(crate) fn insert(&mut self, record: TaskRecord) {
        self.by_number.insert(record.id.number(), Box::new(record));
    }

    pub(crate) fn remove(&mut self, id: &TaskId) -> Option<TaskRecord> {
        self.get(id)?;
        self.by_number.remove(&id.number()).map(|r| *r)
    }

    /// Every record, in task number order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &TaskRecord> {
        self.by_number.values().map(|r| &**r)
    }

    /// The records numbered above `n`, in order.
    pub(crate) fn after(&self, n: u64) -> impl Iterator<Item = &TaskRecord> {
        self.by_number.range(n.saturating_add(1)..).map(|(_, r)| &**r)
    }

    /// The records numbered below `n`, highest first.
    pub(crate) fn before(&self, n: u64) -> impl Iterator<Item = &TaskRecord> {
        self.by_number.range(..n).rev().map(|(_, r)| &**r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::TaskSpec;
    use uuid::Uuid;

    fn record(id: &str) -> TaskRecord {
        let owner = "alice".parse().unwrap();
        TaskRecord::new(id.parse().unwrap(), owner, Uuid::nil(), TaskSpec::shell("l", "true"), 0)
    }

    #[test]
    fn a_lookup_needs_the_kind_and_the_number() {
        let mut tasks = Tasks::default();
        tasks.insert(record("noop-7"));
        tasks.insert(record("shell-3"));
        assert!(tasks.get(&"noop-7".parse().unwrap()).is_some());
        assert!(tasks.get(&"shell-7".parse().unwrap()).is_none());
        assert!(tasks.get_mut(&"shell-7".parse().unwrap()).is_none());
        assert!(tasks.remove(&"shell-7".parse().unwrap()).is_none());
        assert_eq!(tasks.by_number(7).map(|r| r.id.to_string()), Some("noop-7".into()));
        let order: Vec<u64> = tasks.values().map(|r| r.id.number()).collect();
        assert_eq!(order, [3, 7]);
        assert_eq!(tasks.after(3).count(), 1);
        assert!(tasks.remove(&"noop-7".parse().unwrap()).is_some());
        assert!(tasks.by_number(7).is_none());
    }

    /// Every kept task pays for its record's size: a field that grows it
    /// should be boxed or justified (432 bytes at the time of writing: 400,
    /// the boxed store incarnation a grant is fenced by, the two registry
    /// times that age is measured by without comparing leaders' clocks, and
    /// the spec's boxed time limits; 448 since the first kill's reason, a
    /// 16-byte `Option<Box<str>>` kept in the lifecycle; 472 with the spec's
    /// boxed retry policy and delayed start and the record's boxed attempt
    /// log, 8 bytes each: absent for most tasks, which pay only the pointers;
    /// 480 with the owner's pause wish, a `bool` that took the lifecycle's
    /// small fields past one 8-byte word; 488 with the spec's boxed
    /// placement, absent for most tasks; 496 with the spec's boxed resource
    /// limits; 504 with the spec's boxed resume declaration — its state
    /// lives in the attempt log, not in a field of its own).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_record_stays_small() {
        let size = std::mem::size_of::<TaskRecord>();
        assert!(size <= 504, "TaskRecord is {size} bytes");
    }
}
