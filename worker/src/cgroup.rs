//! Where a task's control groups go, decided from what the host shows: pure
//! functions over the text of `/proc/self/mounts`, `/proc/self/cgroup` and
//! the cgroup files the worker reads, and the names of the groups. The files
//! themselves are read and written by [`crate::cgroup_fs`].
//!
//! Each attempt runs in a group of its own, named after it
//! (`<task>.<attempt>`, as its attempt's files), under one parent per
//! worker (`tenure-<worker id>-<data directory digest>`: two workers of one
//! id on one host — test clusters — never share one), so that every process a task starts is
//! tracked and attributable — also one that left the task's process group
//! with `setsid`. Tracking (a kill of the whole group, waiting until it is
//! empty, freezing it for a pause) needs the unified (v2) hierarchy, whose
//! mount may be the only one (`/sys/fs/cgroup`) or, on a hybrid host, one
//! next to the v1 controller mounts. A limit is enforced through the v2
//! controller when the parent can enable it for its children, otherwise
//! through the v1 hierarchy of that controller, in a group of the same
//! name under the worker's own v1 group.
//!
//! This module never touches the file system.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tenure_protocol::resources::ResourceSupport;
use tenure_protocol::{Attempt, TaskId};

/// The controllers a limit is enforced with, by their kernel names.
pub const CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];

/// The cgroup mounts of the host, from `/proc/self/mounts`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Mounts {
    /// The unified (v2) hierarchy's mount point.
    pub unified: Option<PathBuf>,
    /// The v1 mount point of each controller mounted (a controller mounted
    /// together with others, `cpu,cpuacct`, is listed under each).
    pub v1: BTreeMap<String, PathBuf>,
}

/// Reads `/proc/self/mounts`: cgroup2 and cgroup (v1) lines; a v1 mount
/// names its controllers in its options. Malformed lines are skipped.
pub fn parse_mounts(text: &str) -> Mounts {
    let mut mounts = Mounts::default();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, point, fstype, options, ..] = fields[..] else { continue };
        let point = PathBuf::from(unescape(point));
        match fstype {
            "cgroup2" => {
                mounts.unified.get_or_insert(point);
            }
            "cgroup" => {
                for option in options.split(',').filter(|o| CONTROLLERS.contains(o)) {
                    mounts.v1.entry(option.to_owned()).or_insert_with(|| point.clone());
                }
            }
            _ => {}
        }
    }
    mounts
}

/// `/proc/self/mounts` writes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push(d.iter().fold(0u8, |n, b| n.wrapping_mul(8).wrapping_add(b - b'0')));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where this process is, from `/proc/self/cgroup`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Its group in the unified hierarchy (`0::PATH`).
    pub unified: Option<String>,
    /// Its group in each v1 controller's hierarchy.
    pub v1: BTreeMap<String, String>,
}

/// Reads `/proc/self/cgroup` (`ID:CONTROLLERS:PATH` lines).
pub fn parse_membership(text: &str) -> Membership {
    let mut member = Membership::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if !path.starts_with('/') {
            continue;
        }
        if id == "0" && controllers.is_empty() {
            member.unified = Some(path.to_owned());
            continue;
        }
        for c in controllers.split(',').filter(|c| CONTROLLERS.contains(c)) {
            member.v1.insert(c.to_owned(), path.to_owned());
        }
    }
    member
}

/// `/sys/fs/cgroup` + `/a/b` → `/sys/fs/cgroup/a/b` (the root stays the mount).
pub fn join(mount: &Path, group: &str) -> PathBuf {
    let relative = group.trim_start_matches('/');
    if relative.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(relative)
    }
}

/// The name of a worker's parent group, in each hierarchy (named with the
/// data layout: the test harness finds a machine's groups by it too).
pub use tenure_machine::layout::cgroup_parent_name as parent_name;

/// The name of an attempt's group: the name of its attempt's files, so
/// that a group found on the host says which attempt it is.
pub fn attempt_name(task: &TaskId, attempt: Attempt) -> String {
    format!("{task}.{attempt}")
}

/// Where a worker's attempt groups go, decided at its start and handed to
/// each attempt's shim. Serialized into the launch request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The worker's parent group in the unified hierarchy: each attempt's
    /// group is made in it. Tracking needs it; no limit is set without it.
    pub unified: PathBuf,
    /// The controllers enabled for the attempt groups in the unified
    /// hierarchy.
    pub v2: Vec<String>,
    /// The worker's parent group in the v1 hierarchy of each controller
    /// not enforced in v2.
    pub v1: BTreeMap<String, PathBuf>,
}

impl Plan {
    /// Where `controller` is enforced: `Some(true)` in v2, `Some(false)` in
    /// v1, `None` nowhere.
    pub fn enforces(&self, controller: &str) -> Option<bool> {
        if self.v2.iter().any(|c| c == controller) {
            return Some(true);
        }
        self.v1.contains_key(controller).then_some(false)
    }

    /// What a worker with this plan says it enforces.
    pub fn support(&self) -> ResourceSupport {
        ResourceSupport {
            tracking: true,
            memory: self.enforces("memory").is_some(),
            cpu: self.enforces("cpu").is_some(),
            pids: self.enforces("pids").is_some(),
        }
    }
}

/// The controllers listed in a `cgroup.controllers` or
/// `cgroup.subtree_control` file that a limit needs.
pub fn controllers(text: &str) -> Vec<String> {
    text.split_whitespace().filter(|c| CONTROLLERS.contains(c)).map(str::to_owned).collect()
}

/// The value of `key` in a flat-keyed cgroup file (`cgroup.events`,
/// `memory.events`, v1 `memory.oom_control`): `key N` lines.
pub fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        (words.next() == Some(key)).then(|| words.next()?.parse().ok())?
    })
}

/// `cpu.max` for a limit in thousandths of a CPU: the quota per 100 ms period.
pub fn cpu_max(millis: u32) -> String {
    let (quota, period) = cpu_quota(millis);
    format!("{quota} {period}")
}

/// The quota and period (µs) of a limit in thousandths of a CPU; the
/// kernel's smallest quota is 1 ms.
pub fn cpu_quota(millis: u32) -> (u64, u64) {
    const PERIOD_US: u64 = 100_000;
    ((u64::from(millis) * PERIOD_US / 1000).max(1000), PERIOD_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";

    #[test]
    fn mounts_are_found_on_hybrid_pure_and_cgroup_less_hosts() {
        let m = parse_mounts(HYBRID);
        assert_eq!(m.unified, Some(PathBuf::from("/sys/fs/cgroup/unified")));
        assert_eq!(m.v1.get("cpu"), Some(&PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")));
        assert_eq!(m.v1.get("memory"), Some(&PathBuf::from("/sys/fs/cgroup/memory")));
        assert_eq!(m.v1.len(), 3, "{m:?}");
        let pure = parse_mounts("cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\nproc /proc proc rw 0 0\n");
        assert_eq!(pure, Mounts { unified: Some("/sys/fs/cgroup".into()), v1: BTreeMap::new() });
        assert_eq!(parse_mounts("proc /proc proc rw 0 0\ngarbage\n\n"), Mounts::default());
        let spaced = parse_mounts("cgroup2 /mnt/c\\040g cgroup2 rw 0 0\n");
        assert_eq!(spaced.unified, Some(PathBuf::from("/mnt/c g")));
        assert_eq!(unescape("a\\134b\\0"), "a\\b\\0");
    }

    #[test]
    fn membership_is_read_per_hierarchy() {
        let text = "9:name=systemd:/\n8:pids:/\n4:memory:/jobs/x1\n1:cpu,cpuacct:/c\n0::/\n";
        let m = parse_membership(text);
        assert_eq!(m.unified.as_deref(), Some("/"));
        assert_eq!(m.v1.get("memory").map(String::as_str), Some("/jobs/x1"));
        assert_eq!(m.v1.get("cpu").map(String::as_str), Some("/c"));
        assert_eq!(m.v1.get("pids").map(String::as_str), Some("/"));
        let pure = parse_membership("0::/system.slice/tenure.service\n");
        assert_eq!(pure.unified.as_deref(), Some("/system.slice/tenure.service"));
        assert!(pure.v1.is_empty());
        assert_eq!(parse_membership("junk\n1:memory:relative\n"), Membership::default());
    }

    #[test]
    fn groups_are_named_after_their_worker_and_attempt() {
        let mount = Path::new("/sys/fs/cgroup");
        assert_eq!(join(mount, "/"), PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(join(mount, "/a/b"), PathBuf::from("/sys/fs/cgroup/a/b"));
        let worker: tenure_protocol::WorkerId = "w-1".parse().unwrap();
        let task: TaskId = "shell-7".parse().unwrap();
        let name = parent_name(&worker, Path::new("/srv/w-1"));
        assert!(name.starts_with("tenure-w-1-") && name.len() == "tenure-w-1-".len() + 8, "{name}");
        assert_eq!(name, parent_name(&worker, Path::new("/srv/w-1")), "stable");
        assert_ne!(name, parent_name(&worker, Path::new("/srv/w-2")), "one per data directory");
        assert_eq!(attempt_name(&task, Attempt(2)), "shell-7.2");
    }

    #[test]
    fn a_plan_says_where_each_limit_is_enforced() {
        let plan = Plan {
            unified: "/u/tenure-w".into(),
            v2: vec!["pids".into()],
            v1: [("memory".to_owned(), PathBuf::from("/m/tenure-w"))].into(),
        };
        assert_eq!(plan.enforces("pids"), Some(true));
        assert_eq!(plan.enforces("memory"), Some(false));
        assert_eq!(plan.enforces("cpu"), None);
        assert_eq!(plan.support(), ResourceSupport { tracking: true, memory: true, cpu: false, pids: true });
    }

    #[test]
    fn cgroup_files_are_read_and_written() {
        assert_eq!(controllers("cpuset cpu io memory hugetlb pids rdma\n"), ["cpu", "memory", "pids"]);
        assert!(controllers("hugetlb\n").is_empty());
        let events = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed(events, "oom_kill"), Some(1));
        assert_eq!(keyed(events, "oom"), Some(1));
        assert_eq!(keyed("populated 0\nfrozen 1\n", "frozen"), Some(1));
        assert_eq!(keyed("oom_kill_disable 0\nunder_oom 0\n", "oom_kill"), None);
        assert_eq!(keyed("oom_kill x\n", "oom_kill"), None);
        assert_eq!(cpu_max(500), "50000 100000");
        assert_eq!(cpu_max(2000), "200000 100000");
        assert_eq!(cpu_quota(1), (1000, 100_000), "at least the kernel's smallest quota");
    }
}
