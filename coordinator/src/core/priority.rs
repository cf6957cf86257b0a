//! Dispatch order: which queued task is offered a free slot first.
//!
//! Higher `priority` first, in submission order (task number) within one
//! priority; and a task that has waited, free to start, for the configured
//! `priority_max_age` goes before every task that has not, whatever their
//! priorities, in submission order — so a steady stream of high-priority work
//! delays a low-priority task by at most that age (plus the wait for a
//! slot). The age counts from when the task entered the queue on this
//! leader (a new leader counts from its takeover) or from the end of its
//! delayed start or backoff, whichever is later: its own delay never makes
//! it old.
//!
//! The order is kept as tasks enter and leave the queue ([`QueueOrder`]),
//! not computed per scheduling pass: a leader with 100 000 queued tasks
//! offers one free slot without looking at the others. A task ages once
//! (both of its ages only grow while it is queued), so each queued task is
//! moved between the order's parts at most twice.
//!
//! It decides order only: whether a task may start at all (its delay, a
//! refusal's hold-back, a worker for its kind) is decided by the scheduler.
//! It must never read a clock (the age is measured on the `now` passed in)
//! nor reorder tasks of one priority that are equally old.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound::{Excluded, Unbounded};
use std::time::Duration;

use tenure_protocol::TaskId;

use super::{Core, Now};

/// Where a queued task stands in its ageing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Age {
    /// Queued for less than the age on this leader.
    Young,
    /// Queued long enough, but free to start for less: aged once the
    /// registry clock reaches this.
    UntilReady(u64),
    /// Goes before every task that is not.
    Aged,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    since: Duration,
    priority: i32,
    age: Age,
}

/// The queued tasks in dispatch order, kept up to date as they enter and
/// leave the queue.
#[derive(Debug, Default)]
pub(super) struct QueueOrder {
    entries: HashMap<u64, Entry>,
    /// Tasks not aged, by priority (highest first), then number.
    ranked: BTreeMap<(Reverse<i32>, u64), TaskId>,
    /// Young tasks by when they entered the queue.
    young: BTreeMap<(Duration, u64), TaskId>,
    /// Tasks old enough in the queue, by when they are free to start long enough.
    until_ready: BTreeMap<(u64, u64), TaskId>,
    /// Aged tasks, by number.
    aged: BTreeMap<u64, TaskId>,
}

/// Where a walk through the order stands: in the aged part, or in the
/// ranked part, after the key given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cursor {
    Aged(Option<u64>),
    Ranked(Option<(Reverse<i32>, u64)>),
    End,
}

impl Cursor {
    pub(super) const START: Cursor = Cursor::Aged(None);
}

impl QueueOrder {
    /// `task` entered the queue at `since` (this leader's clock).
    pub(super) fn insert(&mut self, task: &TaskId, priority: i32, since: Duration) {
        let n = task.number();
        self.remove(task);
        self.entries.insert(n, Entry { since, priority, age: Age::Young });
        self.ranked.insert((Reverse(priority), n), task.clone());
        self.young.insert((since, n), task.clone());
    }

    /// `task` left the queue (or was never in it).
    pub(super) fn remove(&mut self, task: &TaskId) {
        let n = task.number();
        let Some(e) = self.entries.remove(&n) else { return };
        match e.age {
            Age::Young => {
                self.young.remove(&(e.since, n));
                self.ranked.remove(&(Reverse(e.priority), n));
            }
            Age::UntilReady(at) => {
                self.until_ready.remove(&(at, n));
                self.ranked.remove(&(Reverse(e.priority), n));
            }
            Age::Aged => {
                self.aged.remove(&n);
            }
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Moves the tasks that aged by `now` (this leader's clock) and
    /// `registry_now` (the registry clock, against `ready_ms`: when each task
    /// became free to start) ahead of the rest.
    pub(super) fn age(
        &mut self,
        now: Duration,
        registry_now: u64,
        max_age: Duration,
        ready_ms: impl Fn(&TaskId) -> u64,
    ) {
        let max_ms = max_age.as_millis() as u64;
        while let Some((&(since, n), _)) = self.young.first_key_value() {
            if now.saturating_sub(since) < max_age {
                break;
            }
            let Some(task) = self.young.remove(&(since, n)) else { break };
            let at = ready_ms(&task).saturating_add(max_ms);
            let age = if at <= registry_now { Age::Aged } else { Age::UntilReady(at) };
            self.set_age(n, task, age);
        }
        while let Some((&(at, n), _)) = self.until_ready.first_key_value() {
            if at > registry_now {
                break;
            }
            let Some(task) = self.until_ready.remove(&(at, n)) else { break };
            self.set_age(n, task, Age::Aged);
        }
    }

    fn set_age(&mut self, n: u64, task: TaskId, age: Age) {
        let Some(e) = self.entries.get_mut(&n) else { return };
        e.age = age;
        match age {
            Age::Young => {}
            Age::UntilReady(at) => {
                self.until_ready.insert((at, n), task);
            }
            Age::Aged => {
                self.ranked.remove(&(Reverse(e.priority), n));
                self.aged.insert(n, task);
            }
        }
    }

    /// Up to `max` queued tasks in dispatch order after `cursor`, which is
    /// moved past them.
    pub(super) fn next(&self, cursor: &mut Cursor, max: usize) -> Vec<TaskId> {
        let mut out = Vec::new();
        if let Cursor::Aged(after) = *cursor {
            let from = after.map_or(Unbounded, Excluded);
            for (n, task) in self.aged.range((from, Unbounded)).take(max) {
                out.push(task.clone());
                *cursor = Cursor::Aged(Some(*n));
            }
            if out.len() == max {
                return out;
            }
            *cursor = Cursor::Ranked(None);
        }
        if let Cursor::Ranked(after) = *cursor {
            let from = after.map_or(Unbounded, Excluded);
            for (key, task) in self.ranked.range((from, Unbounded)).take(max - out.len()) {
                out.push(task.clone());
                *cursor = Cursor::Ranked(Some(*key));
            }
            if out.len() < max {
                *cursor = Cursor::End;
            }
        }
        out
    }
}

impl Core {
    /// Brings the dispatch order up to `now` (tasks that aged go first).
    pub(super) fn age_queue(&mut self, now: Now) {
        let registry_now = self.registry_ms(now);
        let tasks = &self.tasks;
        let ready = |t: &TaskId| tasks.get(t).and_then(|r| r.attempts.as_ref()).map_or(0, |a| a.ready_clock_ms);
        self.dispatch.order.age(now.mono, registry_now, self.cfg.priority_max_age, ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::Kind;

    fn t(n: u64) -> TaskId {
        TaskId::new(Kind::shell(), n).unwrap()
    }

    fn all(order: &QueueOrder, step: usize) -> Vec<u64> {
        let (mut cursor, mut out) = (Cursor::START, Vec::new());
        loop {
            let chunk = order.next(&mut cursor, step);
            if chunk.is_empty() {
                return out;
            }
            out.extend(chunk.iter().map(TaskId::number));
        }
    }

    #[test]
    fn the_order_is_aged_first_then_priority_then_number_in_any_chunk_size() {
        let mut q = QueueOrder::default();
        let secs = Duration::from_secs;
        for (n, priority, since) in [(1, 0, 0), (2, 5, 10), (3, 5, 20), (4, -3, 0), (5, 0, 30), (6, 1, 50)] {
            q.insert(&t(n), priority, secs(since));
        }
        // Nothing aged: by priority, then number.
        for step in [1, 2, 4, 100] {
            assert_eq!(all(&q, step), [2, 3, 6, 1, 5, 4], "chunks of {step}");
        }
        // At 60 s with an age of 40 s, tasks in since 20 s or earlier aged;
        // task 3 was delayed until registry time 15 000 ms.
        let ready = |task: &TaskId| if task.number() == 3 { 15_000 } else { 0 };
        q.age(secs(60), 40_000, secs(40), ready);
        for step in [1, 3, 100] {
            assert_eq!(all(&q, step), [1, 2, 4, 3, 6, 5], "chunks of {step}");
        }
        // Task 3 ages once free to start for 40 s in registry time.
        q.age(secs(60), 55_000, secs(40), ready);
        assert_eq!(all(&q, 2), [1, 2, 3, 4, 6, 5]);
        // Leaving from any part leaves the order whole.
        for n in [2, 6, 4] {
            q.remove(&t(n));
        }
        q.insert(&t(7), 9, secs(61));
        assert_eq!(all(&q, 1), [1, 3, 7, 5]);
        q.remove(&t(99));
        for n in [1, 3, 7, 5] {
            q.remove(&t(n));
        }
        assert!(q.is_empty() && q.ranked.is_empty() && q.young.is_empty() && q.aged.is_empty());
    }

    #[test]
    fn a_task_queued_again_is_young_again() {
        let mut q = QueueOrder::default();
        q.insert(&t(1), 0, Duration::ZERO);
        q.insert(&t(2), 0, Duration::ZERO);
        q.age(Duration::from_secs(100), 100_000, Duration::from_secs(10), |_| 0);
        q.insert(&t(1), 0, Duration::from_secs(100));
        assert_eq!(all(&q, 10), [2, 1]);
        assert_eq!(q.entries.len(), 2);
    }
}
