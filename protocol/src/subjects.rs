//! Every NATS subject, stream and bucket name tenure uses, built here and nowhere
//! else. Tokens that come from ids are already validated by [`crate::ids`] (no
//! `.`, `*`, `>` or whitespace), so a subject can never be widened by an id.

use crate::ids::{SessionId, TaskId, WorkerId};

/// Client API requests to the leader coordinator.
pub const API: &str = "tenure.api.v1";
/// Every machine's heartbeats (the leader's subscription).
pub const HEARTBEAT_ALL: &str = "tenure.coord.heartbeat.*";
/// Every machine's reports (the leader's subscription).
pub const REPORT_ALL: &str = "tenure.coord.report.*";
/// Standby coordinators announce themselves here every second (publish); the
/// leader lists the ones it heard from recently in the cluster status.
pub const COORD_PRESENCE: &str = "tenure.coord.presence";
/// A new leader publishes its epoch here right after claiming it, so that
/// workers learn of it before its first command reaches them (publish).
pub const EPOCH_ANNOUNCE: &str = "tenure.workers.epoch";

/// The JetStream stream of terminal notices: one message per task that ended,
/// with its snapshot, deduplicated by task id (`Nats-Msg-Id`).
pub const NOTICES_STREAM: &str = "TENURE_NOTICES";
/// All notice subjects (the stream's filter).
pub const NOTICES_ALL: &str = "tenure.notices.>";

/// The notice subject of one session. Sessions may hold any printable
/// character, so the token is the session's bytes in hex: no session can widen
/// or reach another session's subject.
pub fn notices(session: &SessionId) -> String {
    const PREFIX: &str = "tenure.notices.";
    const HEX: &[u8; 16] = b"0123456789abcdef";
    // Built once per notice on the leader's path: no string per byte.
    let mut subject = String::with_capacity(PREFIX.len() + 2 * session.as_str().len());
    subject.push_str(PREFIX);
    for b in session.as_str().bytes() {
        subject.push(char::from(HEX[usize::from(b >> 4)]));
        subject.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    subject
}

/// The durable consumer of the notice stream that the leader keeps for one
/// owner: a valid consumer name whatever characters the owner holds, stable
/// across versions, leaders and machines.
pub fn notice_consumer(owner: &SessionId) -> String {
    let id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, owner.as_str().as_bytes());
    format!("watch-{}", id.simple())
}

/// The prefix of every acknowledgement subject of `consumer`'s deliveries.
pub fn notice_ack_prefix(consumer: &str) -> String {
    format!("$JS.ACK.{NOTICES_STREAM}.{consumer}.")
}

/// The JetStream stream holding the task registry: the last record of every task
/// plus epoch claims. Every write to it is conditional on its last sequence.
pub const REGISTRY_STREAM: &str = "TENURE_REGISTRY";
/// All registry subjects (the stream's filter).
pub const REGISTRY_ALL: &str = "tenure.registry.>";
/// Leadership claims: one record per epoch.
pub const REGISTRY_EPOCH: &str = "tenure.registry.epoch";

/// The JetStream KV bucket holding the coordinators' leader lease. Every write
/// to it is a compare-and-set on the key's revision.
pub const LEADER_BUCKET: &str = "tenure_leader";
/// The one key of [`LEADER_BUCKET`]: who leads, under which epoch.
pub const LEADER_KEY: &str = "leader";

/// The registry subject holding the latest record of `task`.
pub fn registry_task(task: &TaskId) -> String {
    format!("tenure.registry.task.{task}")
}

/// The prefix of the registry subjects that hold a batch of records.
pub const REGISTRY_BATCH_PREFIX: &str = "tenure.registry.batch.";

/// The registry subject of a batch whose first record is the first record of
/// task number `first` (each batch has its own, so a later message on it
/// replaces that batch alone; a task number is created once, and its first
/// record is in one batch at most, so no two batches share one — not even
/// after the stream was restored and renumbered).
pub fn registry_batch(first: u64) -> String {
    format!("{REGISTRY_BATCH_PREFIX}{first}")
}

/// The registry subject of a batch whose first record is the first grant of
/// task number `first` (a task is granted its first attempt once, so again
/// no two batches share one).
pub fn registry_grant_batch(first: u64) -> String {
    format!("{REGISTRY_BATCH_PREFIX}{first}.granted")
}

/// The registry subject of a batch whose first record is the end of task
/// number `first` (a task ends once: terminal statuses are absorbing).
pub fn registry_end_batch(first: u64) -> String {
    format!("{REGISTRY_BATCH_PREFIX}{first}.ended")
}

/// Whether `subject` is one [`registry_batch`], [`registry_grant_batch`] or
/// [`registry_end_batch`] makes.
pub fn is_registry_batch(subject: &str) -> bool {
    let Some(name) = subject.strip_prefix(REGISTRY_BATCH_PREFIX) else { return false };
    let number = name.strip_suffix(".granted").or_else(|| name.strip_suffix(".ended")).unwrap_or(name);
    // Digits only (`u64` parsing also takes a leading `+`), within range.
    number.bytes().all(|b| b.is_ascii_digit()) && number.parse::<u64>().is_ok()
}

/// The heartbeats of one worker (publish). The subject names the machine, so
/// that NATS can refuse a machine's credential that speaks for another, and
/// the leader drops a heartbeat whose body names another worker.
pub fn heartbeat(worker: &WorkerId) -> String {
    format!("tenure.coord.heartbeat.{worker}")
}

/// The reports of one worker about its attempts (request/reply); machine-named
/// like [`heartbeat`].
pub fn report(worker: &WorkerId) -> String {
    format!("tenure.coord.report.{worker}")
}

/// The worker a machine-named subject ([`heartbeat`], [`report`]) was published
/// on: its last token, if it is a valid worker id.
pub fn machine_of(subject: &str) -> Option<WorkerId> {
    subject.rsplit('.').next()?.parse().ok()
}

/// The shared subject of a worker id: every process running with that id
/// listens here; the leader publishes `InstanceTaken` here.
pub fn worker_commands(worker: &WorkerId) -> String {
    format!("tenure.worker.{worker}.cmd")
}

/// Commands from the leader to one worker process, the instance the leader
/// bound the id to (request/reply): a second process with the same id never
/// receives them, so it can neither run a grant nor answer for the first.
pub fn instance_commands(worker: &WorkerId, instance: &uuid::Uuid) -> String {
    format!("tenure.worker.{worker}.{}.cmd", instance.simple())
}

/// Every command subject of one worker id (a worker's subscription permission).
pub fn worker_all(worker: &WorkerId) -> String {
    format!("tenure.worker.{worker}.>")
}

/// Output reads served by a worker machine's sidecar (request/reply).
pub fn output(worker: &WorkerId) -> String {
    format!("tenure.sidecar.{worker}.output")
}

/// Input for the running agent tasks of a worker machine, delivered by its
/// sidecar (request/reply).
pub fn input(worker: &WorkerId) -> String {
    format!("tenure.sidecar.{worker}.input")
}

/// The leader's cleanup jobs for a worker machine's sidecar (request/reply).
pub fn cleanup(worker: &WorkerId) -> String {
    format!("tenure.sidecar.{worker}.cleanup")
}

/// The leader's evidence queries to a worker machine's sidecar (request/reply).
pub fn evidence(worker: &WorkerId) -> String {
    format!("tenure.sidecar.{worker}.evidence")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_built_from_validated_tokens() {
        let t: TaskId = "shell-12".parse().unwrap();
        let w: WorkerId = "w-1".parse().unwrap();
        assert_eq!(registry_task(&t), "tenure.registry.task.shell-12");
        assert_eq!(worker_commands(&w), "tenure.worker.w-1.cmd");
        assert_eq!(output(&w), "tenure.sidecar.w-1.output");
        assert_eq!(input(&w), "tenure.sidecar.w-1.input");
        assert_eq!(heartbeat(&w), "tenure.coord.heartbeat.w-1");
        assert_eq!(machine_of(&heartbeat(&w)), Some(w.clone()));
        assert_eq!(machine_of(&report(&w)), Some(w.clone()));
        assert_eq!(machine_of("tenure.coord.report.W*"), None);
        assert!(registry_task(&t).starts_with(REGISTRY_ALL.trim_end_matches('>')));
        assert!(REGISTRY_EPOCH.starts_with(REGISTRY_ALL.trim_end_matches('>')));
        assert_eq!(registry_batch(42), "tenure.registry.batch.42");
        assert_eq!(registry_grant_batch(42), "tenure.registry.batch.42.granted");
        assert_eq!(registry_end_batch(42), "tenure.registry.batch.42.ended");
        assert!(is_registry_batch(&registry_batch(42)) && is_registry_batch(&registry_grant_batch(u64::MAX)));
        assert!(is_registry_batch(&registry_end_batch(7)));
        for other in [
            "tenure.registry.batch.42.granted.ended",
            "tenure.registry.batch..ended",
            "tenure.registry.batch.",
            "tenure.registry.batch.4x",
            "tenure.registry.batch.42.other",
            "tenure.registry.batch.99999999999999999999",
            "tenure.registry.task.shell-1",
            "tenure.registry.batch.+1",
        ] {
            assert!(!is_registry_batch(other), "{other}");
        }
        assert!(registry_batch(42).starts_with(REGISTRY_ALL.trim_end_matches('>')));
        let tricky: SessionId = "a.b*>c".parse().unwrap();
        assert_eq!(notices(&tricky), "tenure.notices.612e622a3e63");
        let accented: SessionId = "é~".parse().unwrap();
        assert_eq!(notices(&accented), "tenure.notices.c3a97e", "each byte as two lowercase hex digits");
        assert!(notices(&tricky).starts_with(NOTICES_ALL.trim_end_matches('>')));
        let a = notice_consumer(&"alice/x".parse().unwrap());
        let b = notice_consumer(&tricky);
        assert_ne!(a, b);
        for n in [&a, &b] {
            assert!(n.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-'), "{n}");
        }
        assert_eq!(a, notice_consumer(&"alice/x".parse().unwrap()));
        // KV bucket and key names: letters, digits, `_` and `-` only.
        for name in [LEADER_BUCKET, LEADER_KEY] {
            assert!(name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'), "{name}");
        }
    }
}
