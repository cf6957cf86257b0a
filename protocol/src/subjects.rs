//! Every NATS subject, stream and bucket name tenure uses, built here and nowhere
//! else. Tokens that come from ids are already validated by [`crate::ids`] (no
//! `.`, `*`, `>` or whitespace), so a subject can never be widened by an id.

use crate::ids::{SessionId, TaskId, WorkerId};

/// Client API requests to the leader coordinator.
pub const API: &str = "tenure.api.v1";
/// Worker heartbeats (publish).
pub const HEARTBEAT: &str = "tenure.coord.heartbeat";
/// Worker reports about attempts (request/reply).
pub const REPORT: &str = "tenure.coord.report";
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
    let hex: String = session.as_str().bytes().map(|b| format!("{b:02x}")).collect();
    format!("tenure.notices.{hex}")
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

/// Commands from the leader to one worker (request/reply).
pub fn worker_commands(worker: &WorkerId) -> String {
    format!("tenure.worker.{worker}.cmd")
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
        assert!(registry_task(&t).starts_with(REGISTRY_ALL.trim_end_matches('>')));
        assert!(REGISTRY_EPOCH.starts_with(REGISTRY_ALL.trim_end_matches('>')));
        let tricky: SessionId = "a.b*>c".parse().unwrap();
        assert_eq!(notices(&tricky), "tenure.notices.612e622a3e63");
        assert!(notices(&tricky).starts_with(NOTICES_ALL.trim_end_matches('>')));
        // KV bucket and key names: letters, digits, `_` and `-` only.
        for name in [LEADER_BUCKET, LEADER_KEY] {
            assert!(name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'), "{name}");
        }
    }
}
