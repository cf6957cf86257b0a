//! The one rule for riding out a leader change: which failed requests are
//! sent again, after how long, and until when. Pure: the caller says what
//! failed, which request it was and how long it has been trying; [`decide`]
//! answers. It reads no clock and sends nothing.
//!
//! What the rule knows:
//! - Nobody serving the API subject, a reply that did not come back, a lost
//!   connection, `NotLeader` and `Unavailable` are the signs of a takeover (a
//!   standby takes the lease after its TTL, then loads the registry): worth
//!   another try.
//! - Any other answer is the coordinator's decision and final.
//! - Only requests that are safe to repeat are repeated: reads, waits, and a
//!   submit — which carries its idempotency key on every try, so a retry of a
//!   submit whose first reply was lost returns the task the first try
//!   created, never a second one. Marking a task reported and reading
//!   notices (with their acknowledgements) are idempotent too. Kills and
//!   board moves are sent once: the caller sees the failure and decides.
//! - Every retry is bounded by an overall deadline; pauses grow from
//!   `first_pause` to `max_pause`.

use std::time::Duration;

use tenure_protocol::messages::ApiRequest;

/// What went wrong with one try, as far as the rule cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Nobody serves the API subject: no coordinator runs, or a takeover is
    /// under way (standbys answer nobody).
    NoResponders,
    /// The reply did not come back in time (a paused or dying leader, a lost
    /// reply).
    Timeout,
    /// The NATS connection failed under the request.
    Connection,
    /// The coordinator answered that it does not lead (any more).
    NotLeader,
    /// The coordinator answered that it cannot serve now (registry outage,
    /// still loading).
    Unavailable,
    /// The lease holder refuses to lead a registry behind its high-water
    /// mark: only an operator ends this, so it is retried only under a
    /// policy that says the caller is that operator (the chaos harness,
    /// which puts the registry back itself).
    RegistryBehind,
    /// Any other answer or error: final.
    Final,
}

/// Which kind of request failed: whether sending it again is safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeat {
    /// Reads, waits and submits (with their idempotency key): safe to send again.
    Safe,
    /// Kills, board moves and anything else: sent once.
    Once,
}

impl Repeat {
    /// How `req` may be repeated.
    pub fn of(req: &ApiRequest) -> Repeat {
        match req {
            ApiRequest::Submit(_)
            | ApiRequest::Run { .. }
            | ApiRequest::SubmitBatch(_)
            | ApiRequest::Get { .. }
            | ApiRequest::List { .. }
            | ApiRequest::ListPage { .. }
            | ApiRequest::Wait { .. }
            | ApiRequest::Status
            | ApiRequest::FinalOutput { .. }
            // Marking reported again marks nothing new; acknowledging a
            // notice twice acknowledges it once.
            | ApiRequest::MarkReported { .. }
            | ApiRequest::Notices { .. }
            // An approval is applied once: again, it finds the task queued.
            | ApiRequest::Approve { .. } => Repeat::Safe,
            // A pause sent again after someone's resume would undo it.
            ApiRequest::Kill { .. }
            | ApiRequest::Archive { .. }
            | ApiRequest::Unarchive { .. }
            | ApiRequest::Delete { .. }
            | ApiRequest::Pause { .. }
            | ApiRequest::Resume { .. }
            // Kept again, the message would reach the task twice.
            | ApiRequest::KeepInput { .. } => Repeat::Once,
        }
    }
}

/// How long one `Run` request waits for the task's end before the client
/// goes on with `Wait`s: short, so that a reply lost in a takeover is
/// retried soon.
pub const RUN_WAIT: Duration = Duration::from_secs(5);

/// How long to keep trying, and how fast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// No try starts once this much time passed since the first failure.
    pub overall: Duration,
    /// Pause after the first failure.
    pub first_pause: Duration,
    /// Pauses double up to this.
    pub max_pause: Duration,
    /// Bound of one try (each try also ends at the overall deadline, but
    /// gets at least [`MIN_TRY`]).
    pub per_try: Duration,
    /// Also retry [`Failure::RegistryBehind`].
    pub through_registry_behind: bool,
}

/// A try is given at least this long, even right before the deadline.
pub const MIN_TRY: Duration = Duration::from_millis(500);

impl Policy {
    /// A submit: a takeover takes about the lease TTL plus the registry
    /// load, so 20 s, pauses from 100 ms to 1 s, 5 s a try.
    pub const SUBMIT: Policy = Policy {
        overall: Duration::from_secs(20),
        first_pause: Duration::from_millis(100),
        max_pause: Duration::from_secs(1),
        per_try: Duration::from_secs(5),
        through_registry_behind: false,
    };

    /// A batch submit: as a submit, but a try may take 30 s and all of them
    /// 60 s — the leader answers once every task of the batch (up to 1 000)
    /// is durable, which on a loaded machine takes far longer than one task.
    /// Sent again with the same keys, a batch creates only what is missing.
    pub const BATCH: Policy =
        Policy { overall: Duration::from_secs(60), per_try: Duration::from_secs(30), ..Policy::SUBMIT };

    /// A submit that waits for the task's end ([`RUN_WAIT`] at most): as
    /// a submit, but a try may take the wait as well.
    pub const RUN: Policy = Policy {
        per_try: Duration::from_secs(Policy::SUBMIT.per_try.as_secs() + RUN_WAIT.as_secs()),
        ..Policy::SUBMIT
    };

    /// A read (get, list page, status): the same as a submit.
    pub const READ: Policy = Policy::SUBMIT;

    /// A wait: 30 s without an answer (longer, nobody is coming), a try every
    /// 500 ms. Each wait request carries its own long timeout.
    pub const WAIT: Policy = Policy {
        overall: Duration::from_secs(30),
        first_pause: Duration::from_millis(500),
        max_pause: Duration::from_millis(500),
        per_try: Duration::from_secs(5),
        through_registry_behind: false,
    };

    /// Sent once: no retry at all.
    pub const ONCE: Policy = Policy {
        overall: Duration::ZERO,
        first_pause: Duration::ZERO,
        max_pause: Duration::ZERO,
        per_try: Duration::from_secs(5),
        through_registry_behind: false,
    };

    /// The pause after `pause`: doubled, capped.
    pub fn next_pause(&self, pause: Duration) -> Duration {
        (pause * 2).min(self.max_pause)
    }

    /// The bound of a try started `elapsed` after the first failure (or
    /// the first try): the per-try bound, cut to what is left of the overall
    /// deadline but never below [`MIN_TRY`].
    pub fn try_timeout(&self, elapsed: Duration) -> Duration {
        if self.overall.is_zero() {
            return self.per_try;
        }
        self.per_try.min(self.overall.saturating_sub(elapsed)).max(MIN_TRY)
    }
}

/// What to do after a failed try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send the same request again (the same idempotency key) after this pause.
    Retry { after: Duration },
    /// Report the failure.
    GiveUp,
}

/// The rule. `elapsed` is the time since the first try of this request (or,
/// for a wait, since the coordinators stopped answering); `pause` the pause
/// this retry would take.
pub fn decide(failure: Failure, repeat: Repeat, elapsed: Duration, pause: Duration, policy: &Policy) -> Decision {
    let takeover = matches!(
        failure,
        Failure::NoResponders | Failure::Timeout | Failure::Connection | Failure::NotLeader | Failure::Unavailable
    );
    let operator_fixes = failure == Failure::RegistryBehind && policy.through_registry_behind;
    if !(takeover || operator_fixes) || repeat == Repeat::Once {
        return Decision::GiveUp;
    }
    // A retry that could only start after the deadline is no retry.
    if elapsed + pause >= policy.overall {
        return Decision::GiveUp;
    }
    Decision::Retry { after: pause }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::messages::SubmitRequest;
    use tenure_protocol::TaskSpec;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn decisions() {
        use Decision::*;
        use Failure::*;
        use Repeat::*;
        let p = Policy::SUBMIT;
        // (failure, repeat, elapsed ms, pause ms) -> decision
        let table: &[(Failure, Repeat, u64, u64, Decision)] = &[
            // The signs of a takeover are retried while time is left.
            (NoResponders, Safe, 0, 100, Retry { after: MS(100) }),
            (Timeout, Safe, 5_000, 800, Retry { after: MS(800) }),
            (Connection, Safe, 1_000, 200, Retry { after: MS(200) }),
            (NotLeader, Safe, 0, 100, Retry { after: MS(100) }),
            (Unavailable, Safe, 19_000, 999, Retry { after: MS(999) }),
            // The deadline is bounded: no try starts at or past it.
            (NoResponders, Safe, 19_000, 1_000, GiveUp),
            (Timeout, Safe, 20_000, 100, GiveUp),
            (Unavailable, Safe, 60_000, 100, GiveUp),
            // A coordinator's decision is final.
            (Final, Safe, 0, 100, GiveUp),
            // What is not safe to repeat is never repeated, whatever failed.
            (NoResponders, Once, 0, 100, GiveUp),
            (Timeout, Once, 0, 100, GiveUp),
            (NotLeader, Once, 0, 100, GiveUp),
            (Final, Once, 0, 100, GiveUp),
            // A registry behind its mark waits for an operator: final for a person.
            (RegistryBehind, Safe, 0, 100, GiveUp),
        ];
        for &(failure, repeat, elapsed, pause, want) in table {
            let got = decide(failure, repeat, MS(elapsed), MS(pause), &p);
            assert_eq!(got, want, "{failure:?} {repeat:?} after {elapsed} ms, pause {pause} ms");
        }
        // ... retried for a caller that restores the registry itself.
        let harness = Policy { through_registry_behind: true, ..Policy::SUBMIT };
        assert_eq!(decide(RegistryBehind, Safe, MS(0), MS(100), &harness), Retry { after: MS(100) });
        assert_eq!(decide(RegistryBehind, Once, MS(0), MS(100), &harness), GiveUp);
        assert_eq!(decide(RegistryBehind, Safe, MS(20_000), MS(100), &harness), GiveUp);
        // Sent once means once.
        assert_eq!(decide(Timeout, Safe, Duration::ZERO, Duration::ZERO, &Policy::ONCE), GiveUp);
    }

    #[test]
    fn pauses_grow_to_their_cap_and_tries_fit_the_deadline() {
        let p = Policy::SUBMIT;
        let mut pause = p.first_pause;
        let seen: Vec<u64> = (0..6)
            .map(|_| {
                let now = pause;
                pause = p.next_pause(pause);
                now.as_millis() as u64
            })
            .collect();
        assert_eq!(seen, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(p.try_timeout(Duration::ZERO), MS(5_000));
        assert_eq!(p.try_timeout(MS(17_000)), MS(3_000));
        assert_eq!(p.try_timeout(MS(19_900)), MIN_TRY, "a last try still gets a fair bound");
        assert_eq!(Policy::ONCE.try_timeout(MS(1_000_000)), MS(5_000));
    }

    #[test]
    fn which_requests_are_repeated() {
        let session: tenure_protocol::SessionId = "s".parse().unwrap();
        let task: tenure_protocol::TaskId = "shell-1".parse().unwrap();
        let submit = ApiRequest::Submit(SubmitRequest {
            session: session.clone(),
            idempotency_key: uuid::Uuid::nil(),
            spec: TaskSpec::shell("x", "true"),
        });
        let table = [
            (submit, Repeat::Safe),
            (ApiRequest::Get { session: session.clone(), task: task.clone() }, Repeat::Safe),
            (ApiRequest::ListPage { session: session.clone(), all: true, after: None, before: None }, Repeat::Safe),
            (
                ApiRequest::Wait {
                    session: session.clone(),
                    task: task.clone(),
                    timeout_ms: 1,
                    until: tenure_protocol::messages::WaitFor::End,
                },
                Repeat::Safe,
            ),
            (ApiRequest::Status, Repeat::Safe),
            (ApiRequest::MarkReported { session: session.clone(), task: task.clone() }, Repeat::Safe),
            (
                ApiRequest::Notices { session: session.clone(), acks: vec!["a".into()], max: 1, wait_ms: 0 },
                Repeat::Safe,
            ),
            (ApiRequest::Kill { session: session.clone(), task: task.clone(), reason: None }, Repeat::Once),
            (ApiRequest::Delete { session, task }, Repeat::Once),
        ];
        for (req, want) in table {
            assert_eq!(Repeat::of(&req), want, "{req:?}");
        }
    }
}
