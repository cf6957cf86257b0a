//! What a client asks to run ([`TaskSpec`]) and the limits it must respect.
//!
//! Validation happens once, at submit, in [`TaskSpec::validate`]; a spec that
//! passes is safe to store, to send to a worker and to hand to `sh -c`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::Kind;
use crate::placement::{Placement, PlacementError};
use crate::resources::{ResourceError, ResourceLimits};
use crate::resume::{ResumeError, ResumeSpec};
use crate::retry::{NotBefore, RetryPolicy, MAX_NOT_BEFORE_MS};

/// Longest label kept (bytes).
pub const MAX_LABEL_BYTES: usize = 512;
/// Longest command line (bytes).
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Most environment variables a spec may set.
pub const MAX_ENV_VARS: usize = 256;
/// Largest total size of a spec's environment (names plus values, bytes).
pub const MAX_ENV_BYTES: usize = 64 * 1024;
/// Longest working directory path (bytes).
pub const MAX_CWD_BYTES: usize = 4096;
/// Most steps a workflow may list.
pub const MAX_STEPS: usize = 64;
/// Longest `monitor` pattern (bytes). Patterns are regular expressions with
/// linear-time matching (no backtracking), so a hostile one cannot stall a worker.
pub const MAX_PATTERN_BYTES: usize = 1024;

/// A unit of work as submitted. Immutable once the task exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub kind: Kind,
    /// One-line human label; defaults to the command line.
    pub label: String,
    /// For `shell`: a command line run as `sh -c COMMAND`.
    pub command: String,
    /// Working directory on the worker machine; the attempt's own scratch
    /// directory when absent (never the worker's data directory).
    /// `Box<str>` for this and `pattern`: the same on the wire, 8 bytes less in
    /// every task the coordinator keeps, with or without them.
    pub cwd: Option<Box<str>>,
    /// The task's variables, on top of the few the worker sets (`PATH`,
    /// `HOME`, `LANG`, `TENURE_SESSION`, `TENURE_NATS`; never the worker's own
    /// environment). `TENURE_TASK_ID` and `TENURE_ATTEMPT` cannot be set.
    pub env: BTreeMap<String, String>,
    /// May the system run this task again if its worker is lost? Default false.
    pub idempotent: bool,
    /// For `monitor`: the regular expression an output line must match to raise
    /// a notification. Required for `monitor`, refused for every other kind.
    #[serde(default)]
    pub pattern: Option<Box<str>>,
    /// For `workflow`: the steps, run in order, each as a child task. Required
    /// (1 to [`MAX_STEPS`]) for `workflow`, refused for every other kind.
    #[serde(default)]
    pub steps: Vec<StepSpec>,
    /// A final-output-only task: its output is not streamed to readers while
    /// it runs; when it ends, the last [`MAX_FINAL_OUTPUT_BYTES`] of it become
    /// its final output, kept in the registry and read (idempotently) from the
    /// coordinator. Not for `agent`, `monitor` or `workflow` tasks.
    #[serde(default)]
    pub final_output: bool,
    /// Time limits, enforced on the worker machine by the attempt's shim on
    /// its own monotonic clock (so through worker restarts, coordinator
    /// failovers and while the coordinator is unreachable). Boxed: 8 bytes in
    /// every task the coordinator keeps, with or without them; left out of
    /// the encoding when absent, so records without them keep their bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<Box<TimeLimits>>,
    /// Retries of an idempotent task whose attempt failed (see
    /// [`crate::retry`]). Refused for a task that is not idempotent and for a
    /// workflow. Boxed and left out of the encoding when absent, like `limits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<Box<RetryPolicy>>,
    /// The earliest start, measured by the leader from the submit (refused for
    /// a workflow). Boxed and left out of the encoding when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<Box<NotBefore>>,
    /// Dispatch order among queued tasks: higher first, in submission order
    /// within one priority ([`MIN_PRIORITY`] … [`MAX_PRIORITY`], default 0);
    /// a task left queued longer than the leader's priority age goes first
    /// whatever its priority, so none starves. A workflow's steps take the
    /// workflow's. Left out of the encoding when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
    /// Where it may run (constraints on worker labels) and the concurrency
    /// key it counts against (see [`crate::placement`]). A workflow's steps
    /// take the workflow's. Boxed and left out of the encoding when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Box<Placement>>,
    /// Held for approval at submit (`--hold`): `blocked`, awaiting
    /// approval, until `tenure approve`. Left out of the encoding when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub hold: bool,
    /// Memory, CPU and process limits, enforced on the worker machine in the
    /// attempt's own control group ([`crate::resources`]); a worker that
    /// cannot enforce them refuses the grant. Refused for a workflow (its
    /// steps are tasks of their own). Boxed and left out of the encoding
    /// when absent, like `limits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Box<ResourceLimits>>,
    /// For `agent`: how to resume it after its machine lost it, instead of
    /// leaving it `unknown` ([`crate::resume`]). Refused for other kinds and
    /// for idempotent tasks. Boxed and left out of the encoding when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Box<ResumeSpec>>,
}

/// The lowest priority a task may ask for.
pub const MIN_PRIORITY: i32 = -100;
/// The highest priority a task may ask for.
pub const MAX_PRIORITY: i32 = 100;

fn is_zero(n: &i32) -> bool {
    *n == 0
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A task's time limits. Reaching one ends the task with the normal kill
/// sequence (SIGTERM to its group, the grace period, SIGKILL); it fails, its
/// detail starting with [`TIMED_OUT`] or [`IDLE_TIMEOUT`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeLimits {
    /// Wall-clock run time, from the process's start.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Longest time without a byte of output.
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
}

/// The detail tag of a task ended for running longer than its timeout.
pub const TIMED_OUT: &str = "timed-out";
/// The detail tag of a task ended for staying silent longer than its idle timeout.
pub const IDLE_TIMEOUT: &str = "idle-timeout";
/// `1h 30m`, `90s`, `250ms`: a limit of `ms` milliseconds the way it was
/// probably written (in details that say why a task ended).
pub fn duration_text(ms: u64) -> String {
    if !ms.is_multiple_of(1000) {
        return format!("{ms}ms");
    }
    let mut secs = ms / 1000;
    let mut parts = Vec::new();
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if secs >= size {
            parts.push(format!("{}{unit}", secs / size));
            secs %= size;
        }
    }
    match parts.is_empty() {
        true => "0s".to_owned(),
        false => parts.join(" "),
    }
}

/// The longest time limit accepted (30 days).
pub const MAX_TIME_LIMIT_MS: u64 = 30 * 24 * 3600 * 1000;

/// Most bytes of a final-output-only task's output kept as its final output
/// (the tail; a note says how much came before).
pub const MAX_FINAL_OUTPUT_BYTES: usize = 64 * 1024;

/// One step of a workflow. It runs as a child task of its own kind, with the
/// workflow's cwd, env, idempotence, priority and placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSpec {
    pub kind: Kind,
    pub command: String,
}

impl TaskSpec {
    /// A non-idempotent shell task with no cwd or env.
    pub fn shell(label: impl Into<String>, command: impl Into<String>) -> TaskSpec {
        TaskSpec {
            kind: Kind::shell(),
            label: label.into(),
            command: command.into(),
            cwd: None,
            env: BTreeMap::new(),
            idempotent: false,
            pattern: None,
            steps: Vec::new(),
            final_output: false,
            limits: None,
            retry: None,
            not_before: None,
            priority: 0,
            placement: None,
            hold: false,
            resources: None,
            resume: None,
        }
    }

    /// The pattern the worker matches this task's output lines against: a
    /// `monitor`'s own, or the union of an `agent`'s capture patterns.
    pub fn line_pattern(&self) -> Option<std::borrow::Cow<'_, str>> {
        match (&self.pattern, &self.resume) {
            (Some(p), _) => Some(std::borrow::Cow::Borrowed(p)),
            (None, Some(r)) => r.line_pattern().map(std::borrow::Cow::Owned),
            (None, None) => None,
        }
    }

    /// A workflow of `steps`, each a shell command.
    pub fn workflow(label: impl Into<String>, steps: impl IntoIterator<Item = String>) -> TaskSpec {
        let steps: Vec<StepSpec> = steps.into_iter().map(|command| StepSpec { kind: Kind::shell(), command }).collect();
        TaskSpec { kind: Kind::workflow(), steps, ..TaskSpec::shell(label, "") }
    }

    /// The spec of step `index` of this workflow: its own kind and command, the
    /// workflow's cwd, env, idempotence, priority and placement.
    pub fn step(&self, index: usize) -> Option<TaskSpec> {
        let step = self.steps.get(index)?;
        Some(TaskSpec {
            kind: step.kind.clone(),
            label: format!("step {} of {}: {}", index + 1, self.steps.len(), first_line(&step.command)),
            command: step.command.clone(),
            cwd: self.cwd.clone(),
            env: self.env.clone(),
            idempotent: self.idempotent,
            pattern: None,
            steps: Vec::new(),
            final_output: false,
            limits: None,
            retry: None,
            not_before: None,
            priority: self.priority,
            placement: self.placement.clone(),
            hold: false,
            resources: None,
            resume: None,
        })
    }

    /// Checks every limit and shape rule; the first violation is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.validate_kind_fields()?;
        if self.kind == Kind::workflow() {
            // The command of a workflow is unused; its steps carry the work.
            for i in 0..self.steps.len() {
                let step = self.step(i).ok_or(SpecError::Steps("missing step"))?;
                step.validate().map_err(|e| SpecError::Step { index: i + 1, error: Box::new(e) })?;
            }
            return self.validate_common();
        }
        if self.command.trim().is_empty() {
            return Err(SpecError::EmptyCommand);
        }
        if self.command.contains('\0') {
            return Err(SpecError::NulByte("command"));
        }
        too_large("command", self.command.len(), MAX_COMMAND_BYTES)?;
        self.validate_common()
    }

    /// The rules tied to a kind: a `monitor` needs a valid pattern, a
    /// `workflow` its steps (none of them a workflow), and no other kind has either.
    fn validate_kind_fields(&self) -> Result<(), SpecError> {
        let streams = [Kind::agent(), Kind::monitor(), Kind::workflow()];
        if self.final_output && streams.contains(&self.kind) {
            return Err(SpecError::FinalOutput(self.kind.to_string()));
        }
        let monitor = self.kind == Kind::monitor();
        match &self.pattern {
            None if monitor => return Err(SpecError::Pattern("a monitor task needs a pattern".into())),
            Some(_) if !monitor => return Err(SpecError::Pattern(format!("a {} task takes no pattern", self.kind))),
            Some(p) => {
                too_large("pattern", p.len(), MAX_PATTERN_BYTES)?;
                regex::Regex::new(p).map_err(|e| SpecError::Pattern(e.to_string()))?;
            }
            None => {}
        }
        if self.kind != Kind::workflow() {
            return match self.steps.is_empty() {
                true => Ok(()),
                false => Err(SpecError::Steps("only a workflow task has steps")),
            };
        }
        if self.steps.is_empty() {
            return Err(SpecError::Steps("a workflow needs at least one step"));
        }
        too_large("steps", self.steps.len(), MAX_STEPS)?;
        if self.steps.iter().any(|s| s.kind == Kind::workflow()) {
            return Err(SpecError::Steps("a workflow step cannot be a workflow"));
        }
        Ok(())
    }

    fn validate_common(&self) -> Result<(), SpecError> {
        self.validate_retry()?;
        if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&self.priority) {
            return Err(SpecError::Priority(self.priority));
        }
        if let Some(p) = &self.placement {
            p.check()?;
        }
        if let Some(limits) = &self.limits {
            // A workflow's timeout covers its steps (each step gets what is
            // left of it); it writes no output of its own to be idle in.
            if self.kind == Kind::workflow() && limits.idle_timeout_ms.is_some() {
                return Err(SpecError::TimeLimit(format!(
                    "a {} task takes no idle timeout (its steps' output is their own)",
                    self.kind
                )));
            }
            for (name, ms) in [("timeout", limits.timeout_ms), ("idle timeout", limits.idle_timeout_ms)] {
                match ms {
                    Some(0) => return Err(SpecError::TimeLimit(format!("the {name} must be above zero"))),
                    Some(ms) if ms > MAX_TIME_LIMIT_MS => {
                        return Err(SpecError::TimeLimit(format!("the {name} is above the 30-day limit")))
                    }
                    _ => {}
                }
            }
        }
        if let Some(resources) = &self.resources {
            if self.kind == Kind::workflow() {
                return Err(SpecError::Resources(ResourceError::Workflow));
            }
            resources.validate().map_err(SpecError::Resources)?;
        }
        if let Some(resume) = &self.resume {
            resume.validate(self.kind.as_str(), self.idempotent)?;
        }
        too_large("label", self.label.len(), MAX_LABEL_BYTES)?;
        if self.label.contains('\n') || self.label.contains('\0') {
            return Err(SpecError::NulByte("label"));
        }
        if let Some(cwd) = &self.cwd {
            too_large("cwd", cwd.len(), MAX_CWD_BYTES)?;
            if !cwd.starts_with('/') || cwd.contains('\0') {
                return Err(SpecError::RelativeCwd(cwd.chars().take(80).collect()));
            }
        }
        too_large("env entries", self.env.len(), MAX_ENV_VARS)?;
        let env_bytes: usize = self.env.iter().map(|(k, v)| k.len() + v.len()).sum();
        too_large("env", env_bytes, MAX_ENV_BYTES)?;
        for (k, v) in &self.env {
            let name_ok = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !name_ok || v.contains('\0') {
                return Err(SpecError::EnvName(k.chars().take(80).collect()));
            }
        }
        Ok(())
    }
}

impl TaskSpec {
    /// The retry policy and delayed start: bounded, a retry only for an
    /// idempotent task, neither for a workflow (its steps are tasks of their
    /// own and do not inherit them).
    fn validate_retry(&self) -> Result<(), SpecError> {
        if let Some(policy) = &self.retry {
            if !self.idempotent {
                return Err(SpecError::RetryNotIdempotent);
            }
            if self.kind == Kind::workflow() {
                return Err(SpecError::Retry(format!("a {} task takes no retries", self.kind)));
            }
            policy.validate().map_err(SpecError::Retry)?;
        }
        if let Some(at) = self.not_before.as_deref() {
            if self.kind == Kind::workflow() {
                return Err(SpecError::Retry(format!("a {} task takes no delayed start", self.kind)));
            }
            if let NotBefore::In { ms } = *at {
                if ms > MAX_NOT_BEFORE_MS {
                    return Err(SpecError::Retry("a delayed start is at most 30 days away".into()));
                }
            }
        }
        Ok(())
    }
}

fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or("");
    match line.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_owned(),
    }
}

fn too_large(field: &'static str, size: usize, max: usize) -> Result<(), SpecError> {
    if size > max {
        Err(SpecError::TooLarge { field, size, max })
    } else {
        Ok(())
    }
}

/// Why a spec was refused at submit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("empty command")]
    EmptyCommand,
    #[error("{field} is {size} bytes, the limit is {max}")]
    TooLarge { field: &'static str, size: usize, max: usize },
    #[error("{0} contains a NUL byte or newline")]
    NulByte(&'static str),
    #[error("working directory {0:?} must be an absolute path")]
    RelativeCwd(String),
    #[error("invalid environment variable name {0:?}")]
    EnvName(String),
    #[error("pattern: {0}")]
    Pattern(String),
    #[error("steps: {0}")]
    Steps(&'static str),
    #[error("step {index}: {error}")]
    Step { index: usize, error: Box<SpecError> },
    #[error("a {0} task streams its output; it cannot be final-output-only")]
    FinalOutput(String),
    #[error("time limit: {0}")]
    TimeLimit(String),
    #[error(
        "retries: the task is not idempotent, so it is never run again automatically; declare it idempotent \
         (--idempotent) if running it twice is safe"
    )]
    RetryNotIdempotent,
    #[error("retries: {0}")]
    Retry(String),
    #[error("priority {0} is out of range ({MIN_PRIORITY} to {MAX_PRIORITY})")]
    Priority(i32),
    #[error("placement: {0}")]
    Placement(#[from] PlacementError),
    /// A memory, CPU or process limit out of bounds, or given to a workflow.
    #[error("resource limits: {0}")]
    Resources(ResourceError),
    /// A resume command or capture pattern that cannot be used.
    #[error("resume: {0}")]
    Resume(#[from] ResumeError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_shown_as_written() {
        let cases = [(90_000, "1m 30s"), (250, "250ms"), (7_200_000, "2h"), (86_400_000 + 1_000, "1d 1s"), (0, "0s")];
        for (ms, text) in cases {
            assert_eq!(duration_text(ms), text);
        }
    }

    #[test]
    fn accepts_a_plain_command() {
        assert_eq!(TaskSpec::shell("l", "echo hi").validate(), Ok(()));
    }

    #[test]
    fn time_limits_are_above_zero_at_most_thirty_days_and_not_for_workflows() {
        let with = |timeout_ms, idle_timeout_ms| TaskSpec {
            limits: Some(Box::new(TimeLimits { timeout_ms, idle_timeout_ms })),
            ..TaskSpec::shell("l", "sleep 9")
        };
        assert_eq!(with(Some(1), None).validate(), Ok(()));
        assert_eq!(with(None, Some(MAX_TIME_LIMIT_MS)).validate(), Ok(()));
        for bad in [with(Some(0), None), with(None, Some(0)), with(Some(MAX_TIME_LIMIT_MS + 1), None)] {
            assert!(matches!(bad.validate(), Err(SpecError::TimeLimit(_))), "{bad:?}");
        }
        // A workflow's timeout covers its steps; an idle timeout it cannot have.
        let workflow = |timeout, idle| TaskSpec {
            kind: Kind::workflow(),
            steps: vec![StepSpec { kind: Kind::shell(), command: "true".into() }],
            ..with(timeout, idle)
        };
        assert_eq!(workflow(Some(1000), None).validate(), Ok(()));
        assert!(
            matches!(workflow(None, Some(1000)).validate(), Err(SpecError::TimeLimit(m)) if m.contains("workflow"))
        );
        // A spec without limits round-trips as one without.
        let old = TaskSpec::shell("l", "echo hi");
        let decoded: TaskSpec = crate::decode(&crate::encode(&old).unwrap()).unwrap();
        assert_eq!(decoded.limits, None);
    }

    #[test]
    fn retries_only_for_idempotent_tasks_and_neither_retries_nor_delays_for_workflows() {
        use crate::retry::{RetryCause, RetryPolicy};
        let policy = RetryPolicy { retries: 3, backoff_ms: 100, backoff_max_ms: 1000, on: vec![RetryCause::Exit] };
        let with =
            |idempotent| TaskSpec { idempotent, retry: Some(Box::new(policy.clone())), ..TaskSpec::shell("l", "x") };
        assert_eq!(with(true).validate(), Ok(()));
        assert_eq!(with(false).validate(), Err(SpecError::RetryNotIdempotent));
        assert!(with(false).validate().unwrap_err().to_string().contains("not idempotent"));
        let zero = TaskSpec { retry: Some(Box::new(RetryPolicy { retries: 0, ..policy.clone() })), ..with(true) };
        assert!(matches!(zero.validate(), Err(SpecError::Retry(_))));
        let workflow = TaskSpec::workflow("w", ["true".to_string()]);
        let retried = TaskSpec { idempotent: true, retry: Some(Box::new(policy)), ..workflow.clone() };
        assert!(matches!(retried.validate(), Err(SpecError::Retry(m)) if m.contains("workflow")));
        let delayed = TaskSpec { not_before: Some(Box::new(NotBefore::In { ms: 10 })), ..workflow };
        assert!(matches!(delayed.validate(), Err(SpecError::Retry(m)) if m.contains("workflow")));
        let far = TaskSpec {
            not_before: Some(Box::new(NotBefore::In { ms: MAX_NOT_BEFORE_MS + 1 })),
            ..TaskSpec::shell("l", "x")
        };
        assert!(matches!(far.validate(), Err(SpecError::Retry(_))));
        // A spec without either round-trips as one without.
        let decoded: TaskSpec = crate::decode(&crate::encode(&TaskSpec::shell("l", "x")).unwrap()).unwrap();
        assert_eq!((decoded.retry, decoded.not_before), (None, None));
    }

    #[test]
    fn resource_limits_are_checked_refused_for_workflows_and_left_out_when_absent() {
        let with = |r: ResourceLimits| TaskSpec { resources: Some(Box::new(r)), ..TaskSpec::shell("l", "x") };
        let memory = ResourceLimits { memory_bytes: Some(64 << 20), ..Default::default() };
        assert_eq!(with(memory.clone()).validate(), Ok(()));
        let zero = ResourceLimits { pids: Some(0), ..Default::default() };
        assert_eq!(with(zero).validate(), Err(SpecError::Resources(ResourceError::Pids(0))));
        let workflow =
            TaskSpec { resources: Some(Box::new(memory.clone())), ..TaskSpec::workflow("w", ["true".into()]) };
        assert_eq!(workflow.validate(), Err(SpecError::Resources(ResourceError::Workflow)));
        assert_eq!(workflow.step(0).and_then(|s| s.resources), None);
        let plain = crate::encode(&TaskSpec::shell("l", "x")).unwrap();
        assert!(!plain.windows(9).any(|w| w == b"resources"));
        let limited = with(memory);
        let back: TaskSpec = crate::decode(&crate::encode(&limited).unwrap()).unwrap();
        assert_eq!(back, limited);
    }

    #[test]
    fn priorities_are_bounded_and_steps_take_their_workflows() {
        let with = |priority| TaskSpec { priority, ..TaskSpec::shell("l", "x") };
        assert_eq!(with(MAX_PRIORITY).validate(), Ok(()));
        assert_eq!(with(MIN_PRIORITY).validate(), Ok(()));
        assert_eq!(with(MAX_PRIORITY + 1).validate(), Err(SpecError::Priority(MAX_PRIORITY + 1)));
        assert_eq!(with(i32::MIN).validate(), Err(SpecError::Priority(i32::MIN)));
        let workflow = TaskSpec { priority: 7, ..TaskSpec::workflow("w", ["true".to_string()]) };
        assert_eq!(workflow.step(0).map(|s| s.priority), Some(7));
        // Priority 0 is left out of the encoding.
        let plain = crate::encode(&TaskSpec::shell("l", "x")).unwrap();
        assert!(!plain.windows(8).any(|w| w == b"priority"));
    }

    #[test]
    fn refuses_each_bad_field() {
        let base = TaskSpec::shell("l", "echo hi");
        type Check = fn(&SpecError) -> bool;
        let cases: Vec<(TaskSpec, Check)> = vec![
            (TaskSpec { command: "  ".into(), ..base.clone() }, |e| *e == SpecError::EmptyCommand),
            (TaskSpec { command: "a\0b".into(), ..base.clone() }, |e| matches!(e, SpecError::NulByte(_))),
            (TaskSpec { command: "x".repeat(MAX_COMMAND_BYTES + 1), ..base.clone() }, |e| {
                matches!(e, SpecError::TooLarge { field: "command", .. })
            }),
            (TaskSpec { label: "x".repeat(MAX_LABEL_BYTES + 1), ..base.clone() }, |e| {
                matches!(e, SpecError::TooLarge { field: "label", .. })
            }),
            (TaskSpec { cwd: Some("rel/dir".into()), ..base.clone() }, |e| matches!(e, SpecError::RelativeCwd(_))),
            (TaskSpec { env: [("1A".to_owned(), "v".to_owned())].into(), ..base.clone() }, |e| {
                matches!(e, SpecError::EnvName(_))
            }),
            (TaskSpec { env: [("A=B".to_owned(), "v".to_owned())].into(), ..base.clone() }, |e| {
                matches!(e, SpecError::EnvName(_))
            }),
        ];
        let monitor = TaskSpec { kind: Kind::monitor(), pattern: Some("ERROR".into()), ..base.clone() };
        assert_eq!(monitor.validate(), Ok(()));
        let flow = TaskSpec::workflow("w", ["echo a".to_owned(), "echo b".to_owned()]);
        assert_eq!(flow.validate(), Ok(()));
        assert_eq!(flow.step(1).map(|s| s.command), Some("echo b".to_owned()));
        let cases: Vec<(TaskSpec, Check)> = cases
            .into_iter()
            .chain([
                (TaskSpec { pattern: None, ..monitor.clone() }, (|e| matches!(e, SpecError::Pattern(_))) as Check),
                (TaskSpec { pattern: Some("(".into()), ..monitor.clone() }, |e| matches!(e, SpecError::Pattern(_))),
                (TaskSpec { pattern: Some("x".into()), ..base.clone() }, |e| matches!(e, SpecError::Pattern(_))),
                (TaskSpec { steps: flow.steps.clone(), ..base.clone() }, |e| matches!(e, SpecError::Steps(_))),
                (TaskSpec { steps: vec![], ..flow.clone() }, |e| matches!(e, SpecError::Steps(_))),
                (TaskSpec { final_output: true, ..monitor.clone() }, |e| matches!(e, SpecError::FinalOutput(_))),
                (TaskSpec { final_output: true, ..flow.clone() }, |e| matches!(e, SpecError::FinalOutput(_))),
                (TaskSpec::workflow("w", (0..=MAX_STEPS).map(|_| "true".to_owned())), |e| {
                    matches!(e, SpecError::TooLarge { field: "steps", .. })
                }),
                (TaskSpec::workflow("w", ["true".to_owned(), " ".to_owned()]), |e| {
                    matches!(e, SpecError::Step { index: 2, .. })
                }),
                (
                    TaskSpec { steps: vec![StepSpec { kind: Kind::workflow(), command: "x".into() }], ..flow.clone() },
                    |e| matches!(e, SpecError::Steps(_)),
                ),
            ])
            .collect();
        for (spec, check) in cases {
            let err = spec.validate().unwrap_err();
            assert!(check(&err), "unexpected {err:?}");
        }
    }
}
