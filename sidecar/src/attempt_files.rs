//! The files one attempt's monitor shares with the worker, in the attempt's
//! directory (`<data>/attempts/<task>.<attempt>/`):
//!
//! | file          | written by | when                        | meaning |
//! |---------------|------------|-----------------------------|---------|
//! | `grant`       | worker     | before spawning the monitor | the lease: what to run, owner, epoch |
//! | `monitor.pid` | monitor    | first thing it does         | the monitor's pid and start time |
//! | `pgid`        | monitor    | right after spawning        | the task's process group |
//! | `status`      | monitor    | after the group is gone     | the exit evidence ([`MonitorStatus`]) |
//!
//! `status` is written to a temporary file, fsynced, renamed into place and the
//! directory fsynced: it is either absent or complete. Readers treat a missing
//! or unreadable file as "no evidence", never as an outcome.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::LeaseGrant;
use tenure_protocol::Outcome;

/// The exit evidence a monitor leaves behind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MonitorStatus {
    pub outcome: Outcome,
    /// Bytes written to the output file by this attempt.
    pub output_written: u64,
}

/// A monitor's identity: pid plus the kernel's start time of that pid, so that a
/// recycled pid is never mistaken for the monitor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcessId {
    /// This process.
    pub fn current() -> io::Result<ProcessId> {
        let pid = std::process::id() as i32;
        let start_time = start_time(pid)?.ok_or_else(|| io::Error::other("own /proc entry missing"))?;
        Ok(ProcessId { pid, start_time })
    }

    /// True while this very process exists and has not exited (zombies count as gone).
    pub fn alive(&self) -> bool {
        matches!(proc_stat(self.pid), Ok(Some((state, start))) if start == self.start_time && state != 'Z' && state != 'X')
    }
}

/// `(state, start time)` of `pid` from `/proc/<pid>/stat`; `None` if no such process.
fn proc_stat(pid: i32) -> io::Result<Option<(char, u64)>> {
    let text = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // The command name is in parentheses and may contain spaces: parse after it.
    let rest = text.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| io::Error::other("bad /proc stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first().and_then(|s| s.chars().next()).ok_or_else(|| io::Error::other("bad /proc stat"))?;
    // Field 22 of stat is starttime; `fields` starts at field 3.
    let start = fields.get(19).and_then(|s| s.parse().ok()).ok_or_else(|| io::Error::other("bad /proc stat"))?;
    Ok(Some((state, start)))
}

/// True when some live process is in process group `pgid` *and* in session
/// `sid`. A monitor starts its own session (sid = its pid) and its task's group
/// inside it, so this confirms a group is the task's and not a stranger that
/// reuses the number.
pub fn group_in_session(pgid: i32, sid: i32) -> bool {
    let Ok(entries) = fs::read_dir("/proc") else { return false };
    entries.flatten().any(|e| {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { return false };
        let Ok(text) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
        let Some((_, rest)) = text.rsplit_once(')') else { return false };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let state_live = fields.first().is_some_and(|s| *s != "Z" && *s != "X");
        let num = |i: usize| fields.get(i).and_then(|f| f.parse::<i32>().ok());
        state_live && num(2) == Some(pgid) && num(3) == Some(sid)
    })
}

fn start_time(pid: i32) -> io::Result<Option<u64>> {
    Ok(proc_stat(pid)?.map(|(_, t)| t))
}

/// The files of one attempt.
#[derive(Debug, Clone)]
pub struct AttemptFiles {
    dir: PathBuf,
}

impl AttemptFiles {
    pub fn new(dir: PathBuf) -> AttemptFiles {
        AttemptFiles { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn create(&self) -> io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)
    }

    pub fn write_grant(&self, grant: &LeaseGrant) -> io::Result<()> {
        let bytes = tenure_protocol::encode(grant).map_err(io::Error::other)?;
        write_atomic(&self.dir, "grant", &bytes)
    }

    pub fn read_grant(&self) -> io::Result<LeaseGrant> {
        tenure_protocol::decode(&fs::read(self.dir.join("grant"))?).map_err(io::Error::other)
    }

    pub fn write_monitor(&self, id: ProcessId) -> io::Result<()> {
        write_atomic(&self.dir, "monitor.pid", format!("{} {}\n", id.pid, id.start_time).as_bytes())
    }

    /// The recorded monitor, if its file exists and is readable.
    pub fn monitor(&self) -> Option<ProcessId> {
        let text = fs::read_to_string(self.dir.join("monitor.pid")).ok()?;
        let mut parts = text.split_whitespace();
        Some(ProcessId { pid: parts.next()?.parse().ok()?, start_time: parts.next()?.parse().ok()? })
    }

    pub fn write_pgid(&self, pgid: i32) -> io::Result<()> {
        write_atomic(&self.dir, "pgid", format!("{pgid}\n").as_bytes())
    }

    pub fn pgid(&self) -> Option<i32> {
        fs::read_to_string(self.dir.join("pgid")).ok()?.trim().parse().ok().filter(|p: &i32| *p > 1)
    }

    pub fn write_status(&self, status: &MonitorStatus) -> io::Result<()> {
        let bytes = tenure_protocol::encode(status).map_err(io::Error::other)?;
        write_atomic(&self.dir, "status", &bytes)
    }

    /// The exit evidence, if complete and readable.
    pub fn status(&self) -> Option<MonitorStatus> {
        tenure_protocol::decode(&fs::read(self.dir.join("status")).ok()?).ok()
    }
}

/// Writes `name` in `dir` so that it is either absent or complete, even across a
/// power loss: temporary file, fsync, rename, fsync of the directory.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, dir.join(name))?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::Ending;

    #[test]
    fn files_round_trip_and_absent_means_no_evidence() {
        let dir = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(dir.path().join("shell-1.1"));
        files.create().unwrap();
        assert!(files.status().is_none() && files.monitor().is_none() && files.pgid().is_none());
        let grant = LeaseGrant {
            task: "shell-1".parse().unwrap(),
            attempt: tenure_protocol::Attempt(1),
            epoch: tenure_protocol::Epoch(2),
            owner: "o".parse().unwrap(),
            spec: tenure_protocol::TaskSpec::shell("l", "echo hi"),
        };
        files.write_grant(&grant).unwrap();
        assert_eq!(files.read_grant().unwrap(), grant);
        let me = ProcessId::current().unwrap();
        files.write_monitor(me).unwrap();
        assert_eq!(files.monitor(), Some(me));
        assert!(me.alive());
        assert!(!ProcessId { start_time: me.start_time + 1, ..me }.alive(), "a recycled pid is not the monitor");
        files.write_pgid(4242).unwrap();
        assert_eq!(files.pgid(), Some(4242));
        let status = MonitorStatus { outcome: Outcome::new(Ending::Completed, Some(0), None), output_written: 3 };
        files.write_status(&status).unwrap();
        assert_eq!(files.status(), Some(status));
        std::fs::write(files.dir().join("status"), b"\x01garbage").unwrap();
        assert!(files.status().is_none(), "a damaged status is no evidence");
    }
}
