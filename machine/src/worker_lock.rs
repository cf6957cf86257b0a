//! The worker's lock on its data directory: one live worker per machine store,
//! and the way the sidecar tells the worker from every other process.
//!
//! The worker takes an exclusive POSIX record lock (`fcntl(F_SETLK)`, not
//! `flock`) on `<data-dir>/worker.lock` at start and holds it until it exits;
//! the kernel drops it when the process dies, however it dies. A record lock
//! is what makes the holder *nameable*: `F_GETLK` reports the pid that holds
//! it, so a second worker is refused naming the first, and the sidecar checks
//! that the process at the other end of its socket is that pid.
//!
//! Record locks belong to a process, are not inherited across `fork`, and are
//! released when the process closes *any* descriptor of the file: so the
//! shim launcher and the shims (children of the worker) never hold it,
//! and the worker opens the file once, here, and never again. This module
//! never deletes the lock file and never takes the lock for anyone but the
//! caller.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::libc;

/// Why the lock could not be taken or read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another process holds the lock: a worker is already running on this
    /// data directory.
    #[error("another worker (pid {pid}) is running on this data directory (it holds {path})")]
    Held { path: PathBuf, pid: i32 },
    /// The lock is held but its holder could not be named (it let go while
    /// asked, or the kernel did not say).
    #[error("another process holds {path}; is a worker already running on this data directory?")]
    HeldByUnknown { path: PathBuf },
    /// The lock file could not be opened or locked.
    #[error("cannot lock {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// The lock, held for as long as this value lives (keep it for the worker's
/// whole life; dropping it closes the file and releases the lock).
#[derive(Debug)]
pub struct WorkerLock {
    _file: File,
    path: PathBuf,
}

impl WorkerLock {
    /// Takes the lock on `path` (created 0600 if missing, never through a
    /// symlink), or says who holds it. Does not wait.
    pub fn acquire(path: &Path) -> Result<WorkerLock, Error> {
        let io_err = |source| Error::Io { path: path.to_path_buf(), source };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(path)
            .map_err(io_err)?;
        match fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), FcntlArg::F_SETLK(&whole_file(libc::F_WRLCK))) {
            Ok(_) => Ok(WorkerLock { _file: file, path: path.to_path_buf() }),
            Err(Errno::EAGAIN | Errno::EACCES) => match holder(path) {
                Ok(Some(pid)) => Err(Error::Held { path: path.to_path_buf(), pid }),
                Ok(None) | Err(_) => Err(Error::HeldByUnknown { path: path.to_path_buf() }),
            },
            Err(errno) => Err(io_err(io::Error::from(errno))),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The pid of the process holding the lock on `path`, `None` when nobody does
/// (or the file does not exist). Asked from the holder itself, it answers
/// `None`: a process never conflicts with its own lock.
pub fn holder(path: &Path) -> io::Result<Option<i32>> {
    let file =
        match OpenOptions::new().read(true).custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits()).open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
    let mut probe = whole_file(libc::F_WRLCK);
    fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), FcntlArg::F_GETLK(&mut probe)).map_err(io::Error::from)?;
    // Closing this descriptor releases no lock of ours: this process holds none
    // on the file (the holder never calls this on its own file).
    Ok((i32::from(probe.l_type) != libc::F_UNLCK).then_some(probe.l_pid))
}

/// A lock (or a probe) of `kind` over the whole file.
fn whole_file(kind: libc::c_int) -> libc::flock {
    // SAFETY: `flock` is a plain C struct for which all-zero bytes is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = kind as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 0;
    lock
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nobody_holds_a_missing_or_free_lock() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("worker.lock");
        assert_eq!(holder(&path).unwrap(), None);
        drop(WorkerLock::acquire(&path).unwrap());
        assert_eq!(holder(&path).unwrap(), None);
        // Taken again once released.
        let lock = WorkerLock::acquire(&path).unwrap();
        assert_eq!(lock.path(), path);
    }

    #[test]
    fn a_symlinked_lock_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, tmp.path().join("worker.lock")).unwrap();
        assert!(matches!(WorkerLock::acquire(&tmp.path().join("worker.lock")), Err(Error::Io { .. })));
        assert!(!target.exists());
    }
}
