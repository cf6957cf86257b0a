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
//! It decides order only: whether a task may start at all (its delay, a
//! refusal's hold-back, a worker for its kind) is decided by the scheduler.
//! It must never read a clock (the age is measured on the `now` passed in)
//! nor reorder tasks of one priority that are equally old.

use std::cmp::Reverse;
use std::time::Duration;

use tenure_protocol::TaskId;

use super::{Core, Now};

impl Core {
    /// The queued tasks in the order they are offered to workers.
    pub(super) fn dispatch_order(&self, now: Now) -> Vec<TaskId> {
        let queued = self.dispatch.queued();
        let max_age = self.cfg.priority_max_age;
        let registry_now = self.registry_ms(now);
        let mut plain = true;
        let mut keyed: Vec<(bool, i32, TaskId)> = queued
            .into_iter()
            .map(|t| {
                let r = self.tasks.get(&t);
                let priority = r.map_or(0, |r| r.spec.priority);
                let queued_for = self.dispatch.queued_since(&t).map_or(Duration::ZERO, |s| now.mono.saturating_sub(s));
                let ready = r.and_then(|r| r.attempts.as_ref()).map_or(0, |a| a.ready_clock_ms);
                let ready_for = Duration::from_millis(registry_now.saturating_sub(ready));
                let aged = ready <= registry_now && queued_for.min(ready_for) >= max_age;
                plain &= priority == 0 && !aged;
                (aged, priority, t)
            })
            .collect();
        if !plain {
            // Stable: submission order within each class.
            keyed.sort_by_key(|(aged, priority, _)| (!aged, Reverse(if *aged { 0 } else { *priority })));
        }
        keyed.into_iter().map(|(_, _, t)| t).collect()
    }
}
