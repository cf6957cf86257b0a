//! Whether an `agent` attempt waits for input: a process of its group is
//! blocked in a read of the attempt's input FIFO. Read from `/proc`: each
//! process's group (`stat`), the system call it is blocked in (`syscall`)
//! and what that call's file descriptor is (`fd/N`, compared by device and
//! inode with the FIFO).
//!
//! A process blocked in `read` on a pipe has nothing to read: the pipe is
//! empty at that moment. So the answer is never "waiting" while input is
//! pending; it can miss a wait (a task that polls its stdin with `epoll`,
//! or `/proc` that cannot be read), and then the task shows `running`, as
//! before. This module must never report waiting without that evidence.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use nix::libc;
use tenure_machine::attempt_files::AttemptFiles;

/// The system calls that read a file descriptor given as their first argument.
const READS: [libc::c_long; 3] = [libc::SYS_read, libc::SYS_readv, libc::SYS_pread64];

/// Whether a process of the attempt's group is blocked reading its input FIFO.
#[cfg(test)]
pub fn waiting(files: &AttemptFiles) -> bool {
    !waiting_among([((), files)]).is_empty()
}

/// Of `attempts`, those with a process of their group blocked reading their
/// input FIFO. `/proc` is scanned once for all of them.
pub fn waiting_among<'a, K: Eq + Hash>(attempts: impl IntoIterator<Item = (K, &'a AttemptFiles)>) -> HashSet<K> {
    // Each attempt's group and FIFO (by device and inode), when it has both.
    let wanted: Vec<(K, i32, (u64, u64))> = attempts
        .into_iter()
        .filter_map(|(key, files)| {
            let pgid = files.pgid()?;
            let meta = std::fs::symlink_metadata(files.input_path()).ok()?;
            meta.file_type().is_fifo().then_some((key, pgid, (meta.dev(), meta.ino())))
        })
        .collect();
    if wanted.is_empty() {
        return HashSet::new();
    }
    let groups: HashSet<i32> = wanted.iter().map(|(_, pgid, _)| *pgid).collect();
    let mut members: HashMap<i32, Vec<u32>> = HashMap::new();
    if let Ok(procs) = std::fs::read_dir("/proc") {
        for pid in procs.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()) {
            let group = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok().and_then(|s| group_of(&s));
            if let Some(g) = group.filter(|g| groups.contains(g)) {
                members.entry(g).or_default().push(pid);
            }
        }
    }
    wanted
        .into_iter()
        .filter(|(_, pgid, fifo)| {
            members
                .get(pgid)
                .is_some_and(|pids| pids.iter().any(|pid| reads(Path::new(&format!("/proc/{pid}")), *fifo)))
        })
        .map(|(key, _, _)| key)
        .collect()
}

/// Whether the process at `proc_dir` is blocked in a read of the file `fifo`.
fn reads(proc_dir: &Path, fifo: (u64, u64)) -> bool {
    let Ok(text) = std::fs::read_to_string(proc_dir.join("syscall")) else { return false };
    let Some((nr, fd)) = blocked_in(&text) else { return false };
    if !READS.contains(&nr) {
        return false;
    }
    // `metadata` follows the link: the open file itself.
    std::fs::metadata(proc_dir.join("fd").join(fd.to_string())).is_ok_and(|m| (m.dev(), m.ino()) == fifo)
}

/// The process group of a `/proc/PID/stat` line: its fifth field, counted
/// after the command name's closing parenthesis (the name may hold spaces
/// and parentheses of its own).
fn group_of(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// The system call number and first argument of a `/proc/PID/syscall` line
/// of a process blocked in a call (`running`, and `-1 …` outside a call,
/// are none).
fn blocked_in(text: &str) -> Option<(libc::c_long, u64)> {
    let mut words = text.split_whitespace();
    let nr: libc::c_long = words.next()?.parse().ok()?;
    let arg = words.next()?.strip_prefix("0x")?;
    (nr >= 0).then_some(())?;
    Some((nr, u64::from_str_radix(arg, 16).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_is_read_after_the_command_name() {
        assert_eq!(group_of("4242 (sh) S 4200 4242 4242 0 -1 4194560 …"), Some(4242));
        assert_eq!(group_of("77 (a) b (c)) R 1 80 80 0"), Some(80), "a name with parentheses and spaces");
        assert_eq!(group_of("77 (trunc"), None);
        assert_eq!(group_of(""), None);
    }

    #[test]
    fn only_a_process_inside_a_call_is_blocked_in_one() {
        let read = format!("{} 0x0 0x55d0c0a0 0x2000 0x0 0x0 0x0 0x7ffd 0x7f12", libc::SYS_read);
        assert_eq!(blocked_in(&read), Some((libc::SYS_read, 0)));
        let on_fd_5 = format!("{} 0x5 0x1 0x1", libc::SYS_read);
        assert_eq!(blocked_in(&on_fd_5), Some((libc::SYS_read, 5)));
        for none in ["running", "-1 0x7ffd 0x55d0", "", "x 0x0", "0 12"] {
            assert_eq!(blocked_in(none), None, "{none:?}");
        }
    }

    /// A real process blocked reading a FIFO is seen waiting; one sleeping
    /// is not; and nothing is when the FIFO is gone.
    #[test]
    fn a_process_blocked_reading_the_fifo_is_waiting_and_a_sleeping_one_is_not() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let files = AttemptFiles::new(dir.path().join("a"));
        let fifo = files.create_input().expect("fifo");
        let spawn = |cmd: &str, stdin: std::process::Stdio| {
            std::process::Command::new("sh")
                .args(["-c", cmd])
                .stdin(stdin)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .process_group(0)
                .spawn()
                .expect("sh")
        };
        let mut sleeper = spawn("exec sleep 30", std::process::Stdio::null());
        files.write_pgid(sleeper.id() as i32).expect("pgid");
        // Once it is blocked in its call (`sleep`, not a read), it is no wait.
        let syscall = format!("/proc/{}/syscall", sleeper.id());
        let asleep = (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            std::fs::read_to_string(&syscall)
                .ok()
                .and_then(|t| blocked_in(&t))
                .is_some_and(|(nr, _)| !READS.contains(&nr))
        });
        assert!(asleep, "the sleeper never blocked");
        assert!(!waiting(&files), "a sleeping group is not waiting for input");
        let _ = sleeper.kill();
        let _ = sleeper.wait();

        let mut reader = spawn("read line; echo $line", fifo.stdin.into());
        files.write_pgid(reader.id() as i32).expect("pgid");
        let seen = (0..200).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            waiting(&files)
        });
        assert!(seen, "a group blocked reading its FIFO is waiting");
        std::fs::remove_file(files.input_path()).expect("remove fifo");
        assert!(!waiting(&files), "no FIFO, no wait");
        let _ = reader.kill();
        let _ = reader.wait();
        drop(fifo.keeper);
    }
}
