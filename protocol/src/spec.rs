//! What a client asks to run ([`TaskSpec`]) and the limits it must respect.
//!
//! Validation happens once, at submit, in [`TaskSpec::validate`]; a spec that
//! passes is safe to store, to send to a worker and to hand to `sh -c`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::Kind;

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

/// A unit of work as submitted. Immutable once the task exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSpec {
    pub kind: Kind,
    /// One-line human label; defaults to the command line.
    pub label: String,
    /// For `shell`: a command line run as `sh -c COMMAND`.
    pub command: String,
    /// Working directory on the worker machine; the worker's data dir when absent.
    pub cwd: Option<String>,
    /// Variables added to the worker's environment for this task.
    pub env: BTreeMap<String, String>,
    /// May the system run this task again if its worker is lost? Default false.
    pub idempotent: bool,
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
        }
    }

    /// Checks every limit and shape rule; the first violation is returned.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.command.trim().is_empty() {
            return Err(SpecError::EmptyCommand);
        }
        if self.command.contains('\0') {
            return Err(SpecError::NulByte("command"));
        }
        too_large("command", self.command.len(), MAX_COMMAND_BYTES)?;
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_plain_command() {
        assert_eq!(TaskSpec::shell("l", "echo hi").validate(), Ok(()));
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
        for (spec, check) in cases {
            let err = spec.validate().unwrap_err();
            assert!(check(&err), "unexpected {err:?}");
        }
    }
}
