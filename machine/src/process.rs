//! Process identity on this machine: a pid together with the kernel's start
//! time of that pid, so that a recycled pid is never taken for the process
//! that had it, and the check that a process group is a shim's own.
//!
//! Read from `/proc` only; nothing here signals, waits for or starts a
//! process.

use std::fs;
use std::io;

/// A shim's identity: pid plus the kernel's start time of that pid, so that a
/// recycled pid is never mistaken for the shim.
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

    /// The process that has `pid` now, zombies included; `None` if there is none
    /// (or `/proc` cannot say).
    pub fn of(pid: i32) -> Option<ProcessId> {
        Some(ProcessId { pid, start_time: start_time(pid).ok()?? })
    }

    /// True while this very process exists and has not exited (zombies count as gone).
    pub fn alive(&self) -> bool {
        matches!(proc_stat(self.pid), Ok(Some((state, start))) if start == self.start_time && state != 'Z' && state != 'X')
    }
}

/// `(state, start time)` of `pid` from `/proc/<pid>/stat`; `None` if no such process.
fn proc_stat(pid: i32) -> io::Result<Option<(char, u64)>> {
    let text = match read_stat(pid) {
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
/// `sid`. A shim starts its own session (sid = its pid) and its task's group
/// inside it, so this confirms a group is the task's and not a stranger that
/// reuses the number.
pub fn group_in_session(pgid: i32, sid: i32) -> bool {
    let Ok(entries) = fs::read_dir("/proc") else { return false };
    entries.flatten().any(|e| {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { return false };
        let Ok(text) = read_stat(pid) else { return false };
        let Some((_, rest)) = text.rsplit_once(')') else { return false };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let state_live = fields.first().is_some_and(|s| *s != "Z" && *s != "X");
        let num = |i: usize| fields.get(i).and_then(|f| f.parse::<i32>().ok());
        state_live && num(2) == Some(pgid) && num(3) == Some(sid)
    })
}

/// `/proc/<pid>/stat`, in one or two reads: a `/proc` file says its size
/// is 0, so a plain read of the whole file first asks its size and then
/// reads it in growing pieces — a dozen calls where two do, and every shim
/// reads its own (and the launcher each shim's).
fn read_stat(pid: i32) -> io::Result<String> {
    let file = fs::File::open(format!("/proc/{pid}/stat"))?;
    let mut bytes = Vec::with_capacity(2048);
    io::Read::read_to_end(&mut io::Read::take(file, 64 * 1024), &mut bytes)?;
    String::from_utf8(bytes).map_err(|_| io::Error::other("bad /proc stat"))
}

fn start_time(pid: i32) -> io::Result<Option<u64>> {
    Ok(proc_stat(pid)?.map(|(_, t)| t))
}
