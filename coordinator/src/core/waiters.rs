//! Waiters: clients waiting for a task's end (`tenure wait`), each until its
//! own deadline.
//!
//! A waiter is answered once: with the end (by [`Core::event`], which takes
//! the task's waiters when it becomes terminal), with a live snapshot when
//! its deadline passes, or with an error when the task's record could not be
//! stored. A wait that times out never marks the task reported.

use std::collections::BTreeMap;
use std::time::Duration;

use tenure_protocol::messages::ApiResponse;
use tenure_protocol::{SessionId, TaskId};

use super::{Core, Effect, Now};

#[derive(Debug, Clone)]
pub(super) struct Waiter {
    /// Where the answer goes.
    pub(super) to: String,
    pub(super) session: SessionId,
    pub(super) deadline: Duration,
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
