//! A task's resource limits (`--memory`, `--cpus`, `--pids`) and what a
//! worker says it can enforce ([`ResourceSupport`], in its heartbeat).
//!
//! Pure: the bounds checked at submit, the names of the limits a worker
//! cannot enforce, the detail tag of a task its memory limit ended. How a
//! worker enforces them (control groups) is the worker's business; this
//! module never names a path or a kernel interface.

use serde::{Deserialize, Serialize};

/// The smallest memory limit accepted: below it a shell cannot start.
pub const MIN_MEMORY_BYTES: u64 = 1024 * 1024;
/// The largest memory limit accepted (1 PiB: any larger is no limit).
pub const MAX_MEMORY_BYTES: u64 = 1 << 50;
/// The largest CPU limit accepted, in thousandths of a CPU (1024 CPUs).
pub const MAX_CPU_MILLIS: u32 = 1024 * 1000;
/// The largest process limit accepted.
pub const MAX_PIDS: u32 = 4 * 1024 * 1024;

/// The detail tag of a task whose memory limit was reached: the kernel's
/// out-of-memory killer ended one of its processes. The task fails (its
/// retry cause is `exit`: the process failed, its machine did not).
pub const OUT_OF_MEMORY: &str = "out-of-memory";

/// What a task may use on its machine. Each limit is enforced by the
/// worker in the attempt's own control group, for every process of the
/// task (also those that left its process group); a worker that cannot
/// enforce one refuses the grant ([`ResourceLimits::unmet_by`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceLimits {
    /// Memory of all its processes together (bytes, at least
    /// [`MIN_MEMORY_BYTES`]); past it the kernel ends one of them and the
    /// task fails as [`OUT_OF_MEMORY`].
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// CPU time per wall-clock time, in thousandths of a CPU (`500`: half a
    /// CPU, `2000`: two CPUs); the task is throttled, never ended.
    #[serde(default)]
    pub cpu_millis: Option<u32>,
    /// Most processes and threads alive at once; a fork past it fails.
    #[serde(default)]
    pub pids: Option<u32>,
}

/// Which limits a worker enforces, as its heartbeat says. All false by
/// default: an older worker, or one on a host without control groups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceSupport {
    /// Every process of a task is tracked in the attempt's control group:
    /// a kill ends those that left its process group too, and a pause
    /// freezes them.
    #[serde(default)]
    pub tracking: bool,
    #[serde(default)]
    pub memory: bool,
    #[serde(default)]
    pub cpu: bool,
    #[serde(default)]
    pub pids: bool,
}

impl ResourceSupport {
    /// The names of what is enforced (`tracking`, `memory`, `cpu`, `pids`),
    /// for `tenure status` and logs.
    pub fn names(&self) -> Vec<&'static str> {
        [("tracking", self.tracking), ("memory", self.memory), ("cpu", self.cpu), ("pids", self.pids)]
            .into_iter()
            .filter_map(|(name, on)| on.then_some(name))
            .collect()
    }
}

impl ResourceLimits {
    /// No limit set: stored as no limits at all.
    pub fn is_empty(&self) -> bool {
        self.memory_bytes.is_none() && self.cpu_millis.is_none() && self.pids.is_none()
    }

    /// The names of the limits set here that a worker with `support` cannot
    /// enforce (`memory`, `cpu`, `pids`), in that order; empty when it can
    /// enforce them all. A limit is enforced in a tracked group, so none is
    /// met without tracking.
    pub fn unmet_by(&self, support: &ResourceSupport) -> Vec<&'static str> {
        [
            ("memory", self.memory_bytes.is_some(), support.memory),
            ("cpu", self.cpu_millis.is_some(), support.cpu),
            ("pids", self.pids.is_some(), support.pids),
        ]
        .into_iter()
        .filter(|(_, asked, can)| *asked && !(*can && support.tracking))
        .map(|(name, _, _)| name)
        .collect()
    }

    /// The bounds checked at submit.
    pub fn validate(&self) -> Result<(), ResourceError> {
        if self.is_empty() {
            return Err(ResourceError::Empty);
        }
        if let Some(bytes) = self.memory_bytes {
            if !(MIN_MEMORY_BYTES..=MAX_MEMORY_BYTES).contains(&bytes) {
                return Err(ResourceError::Memory(bytes));
            }
        }
        if let Some(millis) = self.cpu_millis {
            if !(1..=MAX_CPU_MILLIS).contains(&millis) {
                return Err(ResourceError::Cpu(millis));
            }
        }
        if let Some(pids) = self.pids {
            if !(1..=MAX_PIDS).contains(&pids) {
                return Err(ResourceError::Pids(pids));
            }
        }
        Ok(())
    }
}

/// Why a task's resource limits were refused at submit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// Limits given with none set: leave them out instead.
    #[error("resource limits with no limit set")]
    Empty,
    /// A workflow's steps are tasks of their own and do not inherit them.
    #[error("a workflow task takes no resource limits")]
    Workflow,
    #[error("a memory limit of {0} bytes is out of range (1 MiB to 1 PiB)")]
    Memory(u64),
    #[error("a CPU limit of {0} thousandths of a CPU is out of range (1 to {MAX_CPU_MILLIS})")]
    Cpu(u32),
    #[error("a process limit of {0} is out of range (1 to {MAX_PIDS})")]
    Pids(u32),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_are_bounded() {
        let memory = |b| ResourceLimits { memory_bytes: Some(b), ..Default::default() };
        let cpu = |m| ResourceLimits { cpu_millis: Some(m), ..Default::default() };
        let pids = |n| ResourceLimits { pids: Some(n), ..Default::default() };
        for ok in [memory(MIN_MEMORY_BYTES), memory(MAX_MEMORY_BYTES), cpu(1), cpu(MAX_CPU_MILLIS), pids(1)] {
            assert_eq!(ok.validate(), Ok(()), "{ok:?}");
        }
        let cases = [
            (memory(MIN_MEMORY_BYTES - 1), ResourceError::Memory(MIN_MEMORY_BYTES - 1)),
            (memory(MAX_MEMORY_BYTES + 1), ResourceError::Memory(MAX_MEMORY_BYTES + 1)),
            (cpu(0), ResourceError::Cpu(0)),
            (cpu(MAX_CPU_MILLIS + 1), ResourceError::Cpu(MAX_CPU_MILLIS + 1)),
            (pids(0), ResourceError::Pids(0)),
            (pids(MAX_PIDS + 1), ResourceError::Pids(MAX_PIDS + 1)),
            (ResourceLimits::default(), ResourceError::Empty),
        ];
        for (limits, error) in cases {
            assert_eq!(limits.validate(), Err(error), "{limits:?}");
        }
    }

    #[test]
    fn unmet_limits_are_named_and_nothing_is_met_without_tracking() {
        let all = ResourceLimits { memory_bytes: Some(1 << 26), cpu_millis: Some(500), pids: Some(20) };
        let full = ResourceSupport { tracking: true, memory: true, cpu: true, pids: true };
        assert!(all.unmet_by(&full).is_empty());
        assert_eq!(all.unmet_by(&ResourceSupport::default()), ["memory", "cpu", "pids"]);
        assert_eq!(all.unmet_by(&ResourceSupport { tracking: false, ..full }), ["memory", "cpu", "pids"]);
        assert_eq!(all.unmet_by(&ResourceSupport { cpu: false, ..full }), ["cpu"]);
        let memory_only = ResourceLimits { memory_bytes: Some(1 << 26), ..Default::default() };
        assert!(memory_only.unmet_by(&ResourceSupport { cpu: false, pids: false, ..full }).is_empty());
        assert_eq!(full.names(), ["tracking", "memory", "cpu", "pids"]);
        assert!(ResourceSupport::default().names().is_empty());
    }

    #[test]
    fn support_from_an_older_worker_is_none() {
        #[derive(Serialize)]
        struct Old {
            tracking: bool,
        }
        let decoded: ResourceSupport = crate::decode(&crate::encode(&Old { tracking: true }).unwrap()).unwrap();
        assert_eq!(decoded, ResourceSupport { tracking: true, ..Default::default() });
    }
}
