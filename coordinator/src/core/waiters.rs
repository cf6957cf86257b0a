//! Waiters: clients waiting for a task's end (`tenure wait`) or its start
//! (`tenure wait --started`), each until its own deadline.
//!
//! A waiter is answered once: by [`Core::event`], which takes the task's
//! waiters whose [`WaitFor`] the new status reaches (every one when the task
//! ends: the end is answered, and marks the task reported), with a live
//! snapshot when its deadline passes, or with an error when the task's
//! record could not be stored. The answer follows the record it reports
//! (the same effects, in order), so a client never hears of a start or an
//! end that is not durable. A wait that times out, and a start, never mark
//! the task reported.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure_protocol::messages::{ApiResponse, WaitFor};
use tenure_protocol::{SessionId, Status, TaskId};

use super::{Core, Effect, Now};

#[derive(Debug, Clone)]
pub(super) struct Waiter {
    /// Where the answer goes.
    pub(super) to: String,
    pub(super) session: SessionId,
    pub(super) deadline: Duration,
    pub(super) until: WaitFor,
}

/// The waiters of each task.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    by_task: BTreeMap<TaskId, Vec<Waiter>>,
}

impl Waiters {
    pub(super) fn add(&mut self, task: TaskId, waiter: Waiter) {
        self.by_task.entry(task).or_default().push(waiter);
    }

    /// Every waiter of `task`, no longer kept.
    pub(super) fn take(&mut self, task: &TaskId) -> Vec<Waiter> {
        self.by_task.remove(task).unwrap_or_default()
    }

    /// The waiters of `task` that `status` answers, no longer kept.
    pub(super) fn take_reached(&mut self, task: &TaskId, status: Status) -> Vec<Waiter> {
        let Some(list) = self.by_task.get_mut(task) else { return Vec::new() };
        let (reached, waiting) = std::mem::take(list).into_iter().partition(|w| w.until.reached(status));
        *list = waiting;
        if list.is_empty() {
            self.by_task.remove(task);
        }
        reached
    }

    /// The waiters whose deadline has passed, no longer kept.
    fn expired(&mut self, now: Now) -> Vec<(TaskId, Waiter)> {
        let tasks: Vec<TaskId> = self
            .by_task
            .iter()
            .filter(|(_, ws)| ws.iter().any(|w| w.deadline <= now.mono))
            .map(|(t, _)| t.clone())
            .collect();
        let mut expired = Vec::new();
        for task in tasks {
            let Some(list) = self.by_task.remove(&task) else { continue };
            let (due, keep): (Vec<Waiter>, Vec<Waiter>) = list.into_iter().partition(|w| w.deadline <= now.mono);
            if !keep.is_empty() {
                self.by_task.insert(task.clone(), keep);
            }
            expired.extend(due.into_iter().map(|w| (task.clone(), w)));
        }
        expired
    }
}

impl Core {
    /// Answers the waiters whose deadline passed with a live snapshot.
    pub(super) fn expire_waits(&mut self, now: Now, fx: &mut Vec<Effect>) {
        for (task, w) in self.waiters.expired(now) {
            let reply = self
                .owned(&w.session, &task)
                .map(|r| ApiResponse::Waited { finished: false, snapshot: self.snapshot_of(r) });
            fx.push(Effect::Reply { to: w.to, reply });
        }
    }
}
