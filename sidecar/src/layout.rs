//! The worker machine's data directory, shared by the worker and the sidecar:
//! where the recovery database, the sidecar's socket and task output live, and
//! the only functions that open output files.
//!
//! Output files sit in a directory that task processes may be able to write to
//! (they run as the same user), so every open here is symlink-safe: the last
//! path component is opened with `O_NOFOLLOW` and the opened file must be a
//! regular file. This module never deletes anything and never follows a link
//! planted in place of an output file.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use tenure_protocol::TaskId;

/// Why the data directory could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A directory could not be created or inspected.
    #[error("cannot create directory {path}: {source}")]
    CreateDir { path: PathBuf, source: io::Error },
    /// Something other than a directory (a file, or a symlink) sits where a
    /// directory of the layout belongs. Nothing is removed: the operator decides.
    #[error("{path} exists and is not a directory (symlinks are refused)")]
    NotADirectory { path: PathBuf },
}

/// Paths under one worker machine's data directory.
///
/// ```text
/// <root>/sidecar-db/     sled database (recovery records, epoch)
/// <root>/sidecar.sock    unix socket the worker talks to
/// <root>/output/<task>.out
/// <root>/attempts/<task>.<attempt>/   the per-task monitor's files: grant,
///                                     monitor.pid, pgid, status, and an
///                                     agent's input FIFO
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Layout {
        Layout { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The sidecar's sled database directory.
    pub fn db_dir(&self) -> PathBuf {
        self.root.join("sidecar-db")
    }

    /// The id of the worker process that last ran on this directory: a
    /// restarted worker names its predecessor in its heartbeats, so the leader
    /// binds the worker id to it at once instead of taking it for a second
    /// process with the same id.
    pub fn instance_path(&self) -> PathBuf {
        self.root.join("worker.instance")
    }

    /// The unix socket the sidecar listens on.
    pub fn socket_path(&self) -> PathBuf {
        self.root.join("sidecar.sock")
    }

    /// Directory holding one output file per task.
    pub fn output_dir(&self) -> PathBuf {
        self.root.join("output")
    }

    /// The output file of `task` (stdout and stderr of every attempt, appended).
    /// Task ids contain no `/` or `.` sequences that could escape the directory:
    /// they are validated by [`TaskId`]'s parser.
    pub fn output_path(&self, task: &TaskId) -> PathBuf {
        self.output_dir().join(format!("{task}.out"))
    }

    /// Directory holding one directory per attempt that reached its intent.
    pub fn attempts_dir(&self) -> PathBuf {
        self.root.join("attempts")
    }

    /// The directory of one attempt's monitor (`<task>.<attempt>`).
    pub fn attempt_dir(&self, task: &TaskId, attempt: tenure_protocol::Attempt) -> PathBuf {
        self.attempts_dir().join(format!("{task}.{attempt}"))
    }

    /// Creates the root, database and output directories with mode 0700 when they
    /// are missing. Existing directories keep their mode; a non-directory (or a
    /// symlink) in place of the database or output directory is refused.
    pub fn create_dirs(&self) -> Result<(), Error> {
        let mut builder = DirBuilder::new();
        builder.recursive(true).mode(0o700);
        for dir in [self.root.clone(), self.db_dir(), self.output_dir(), self.attempts_dir()] {
            builder.create(&dir).map_err(|source| Error::CreateDir { path: dir.clone(), source })?;
        }
        for dir in [self.db_dir(), self.output_dir(), self.attempts_dir()] {
            let meta =
                std::fs::symlink_metadata(&dir).map_err(|source| Error::CreateDir { path: dir.clone(), source })?;
            if !meta.file_type().is_dir() {
                return Err(Error::NotADirectory { path: dir });
            }
        }
        Ok(())
    }
}

/// Opens (creating it with mode 0600 if needed) an output file for appending.
///
/// Refused with an error when `path` is a symlink (`ELOOP` from `O_NOFOLLOW`) or
/// anything but a regular file. `O_NONBLOCK` is used while opening so a FIFO
/// planted at `path` cannot block the caller, then cleared again because the
/// descriptor is meant to become a child process's stdout.
pub fn open_output_for_append(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits())
        .open(path)?;
    ensure_regular(&file, path)?;
    fcntl(file.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_APPEND)).map_err(io::Error::from)?;
    Ok(file)
}

/// Opens an existing output file for reading, with the same symlink and
/// regular-file checks as [`open_output_for_append`]. A missing file is an
/// `io::ErrorKind::NotFound` error, which callers usually treat as "no output yet".
pub fn open_output_for_read(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new().read(true).custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits()).open(path)?;
    ensure_regular(&file, path)?;
    Ok(file)
}

fn ensure_regular(file: &File, path: &Path) -> io::Result<()> {
    if file.metadata()?.file_type().is_file() {
        Ok(())
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{} is not a regular file", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::{symlink, PermissionsExt};

    #[test]
    fn paths() {
        let l = Layout::new("/data");
        let t: TaskId = "shell-7".parse().unwrap();
        assert_eq!(l.db_dir(), Path::new("/data/sidecar-db"));
        assert_eq!(l.socket_path(), Path::new("/data/sidecar.sock"));
        assert_eq!(l.output_dir(), Path::new("/data/output"));
        assert_eq!(l.output_path(&t), Path::new("/data/output/shell-7.out"));
    }

    #[test]
    fn create_dirs_is_private_and_repeatable() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path().join("data"));
        l.create_dirs().unwrap();
        l.create_dirs().unwrap();
        for d in [l.root().to_path_buf(), l.db_dir(), l.output_dir()] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
    }

    #[test]
    fn create_dirs_refuses_a_symlinked_output_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path());
        let elsewhere = tempfile::tempdir().unwrap();
        symlink(elsewhere.path(), l.output_dir()).unwrap();
        assert!(matches!(l.create_dirs(), Err(Error::NotADirectory { .. })));
    }

    #[test]
    fn append_creates_0600_and_appends() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("a.out");
        open_output_for_append(&p).unwrap().write_all(b"one ").unwrap();
        open_output_for_append(&p).unwrap().write_all(b"two").unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        let mut s = String::new();
        open_output_for_read(&p).unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(s, "one two");
    }

    #[test]
    fn symlinks_are_refused_and_their_target_untouched() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("secret");
        std::fs::write(&target, b"keep").unwrap();
        let link = tmp.path().join("t.out");
        symlink(&target, &link).unwrap();
        assert!(open_output_for_append(&link).is_err());
        assert!(open_output_for_read(&link).is_err());
        // A dangling link must not create its target either.
        let dangling = tmp.path().join("d.out");
        symlink(tmp.path().join("nowhere"), &dangling).unwrap();
        assert!(open_output_for_append(&dangling).is_err());
        assert!(!tmp.path().join("nowhere").exists());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    }

    #[test]
    fn non_regular_files_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("dir.out");
        std::fs::create_dir(&dir).unwrap();
        assert!(open_output_for_read(&dir).is_err());
        assert!(open_output_for_append(&dir).is_err());
        let fifo = tmp.path().join("fifo.out");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Would block forever without O_NONBLOCK.
        assert!(open_output_for_read(&fifo).is_err());
        assert!(open_output_for_append(&fifo).is_err());
    }

    #[test]
    fn missing_file_reads_as_not_found() {
        let tmp = tempfile::tempdir().unwrap();
        let err = open_output_for_read(&tmp.path().join("none.out")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
