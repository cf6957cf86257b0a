//! The worker machine's data directory, shared by the worker and the sidecar:
//! where the recovery database, the sidecar's socket and task output live, and
//! the only functions that open output files.
//!
//! The data directory is the daemons' alone: created (or tightened to) 0700,
//! and refused when another user owns it. Tasks never run in it: each attempt
//! gets a scratch directory under a *scratch root* outside it (by default the
//! sibling `<data-dir>.scratch`), which this module names too. Task processes
//! that run as the daemons' own user could still write into the data
//! directory, so every open of an output file is symlink-safe: the last path
//! component is opened with `O_NOFOLLOW` and the opened file must be a regular
//! file. This module never deletes anything and never follows a link planted
//! in place of an output file.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::attempt_files::AttemptFiles;
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
    /// The data directory belongs to another user: whoever owns it could
    /// swap what the daemons read and write. Nothing is changed.
    #[error("{path} is owned by uid {owner}, not by this daemon's uid {me}; refusing to use it")]
    NotOurs { path: PathBuf, owner: u32, me: u32 },
    /// A directory of the layout could not be made durable (fsync).
    #[error("cannot sync directory {path}: {source}")]
    Sync { path: PathBuf, source: io::Error },
    /// The data directory's mode could not be tightened to 0700.
    #[error("cannot make {path} private (0700): {source}")]
    Private { path: PathBuf, source: io::Error },
}

/// Paths under one worker machine's data directory.
///
/// ```text
/// <root>/sidecar-db/     sled database (recovery records, epoch)
/// <root>/sidecar-db.commits  its commit log; sidecar-db.epoch: the epoch's mirror
/// <root>/sidecar.sock    unix socket the worker talks to (only the holder
///                        of worker.lock is answered)
/// <root>/worker.lock     the worker's lock: held (fcntl) for its whole life
/// <root>/scratch-root    where the worker keeps its tasks' scratch dirs
/// <root>/output/<task>.out
/// <root>/attempts/<task>.<attempt>/   the per-task shim's files: journal,
///                                     an agent's input FIFO, matches
///
/// <scratch-root>/<task>.<attempt>/    the attempt's working directory and
///                                     HOME (outside the data directory)
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: PathBuf,
    /// Set by the worker; otherwise found through [`Layout::scratch_root`].
    scratch: Option<PathBuf>,
}

/// The file in the data directory that records the worker's scratch root.
const SCRATCH_RECORD: &str = "scratch-root";

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Layout {
        Layout { root: root.into(), scratch: None }
    }

    /// The same layout with its scratch root given (the worker's setting).
    pub fn with_scratch_root(mut self, scratch: impl Into<PathBuf>) -> Layout {
        self.scratch = Some(scratch.into());
        self
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The scratch root when none is configured: the data directory's sibling
    /// `<data-dir>.scratch` — on the same file system, named after its
    /// machine, never inside the data directory (whose 0700 a task's user
    /// must not need to pass) and not in a world-writable `/tmp`. `None` when
    /// the path has no last component to name it after (`/`, `..`).
    pub fn default_scratch_root(root: &Path) -> Option<PathBuf> {
        let name = root.file_name()?;
        let mut sibling = name.to_os_string();
        sibling.push(".scratch");
        Some(root.with_file_name(sibling))
    }

    /// The scratch root: the configured one; else the one the worker recorded
    /// in the data directory (what the sidecar uses, so the two never
    /// disagree); else the default.
    pub fn scratch_root(&self) -> Option<PathBuf> {
        if let Some(s) = &self.scratch {
            return Some(s.clone());
        }
        match read_small(&self.root.join(SCRATCH_RECORD)) {
            Ok(bytes) if !bytes.is_empty() => Some(PathBuf::from(std::ffi::OsStr::from_bytes(&bytes))),
            _ => Self::default_scratch_root(&self.root),
        }
    }

    /// Records the scratch root in the data directory for the sidecar
    /// (written to a temporary file, fsynced, renamed into place, the data
    /// directory fsynced).
    pub fn record_scratch_root(&self, scratch: &Path) -> io::Result<()> {
        let tmp = self.root.join(format!("{SCRATCH_RECORD}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(OFlag::O_NOFOLLOW.bits())
            .open(&tmp)?;
        file.write_all(scratch.as_os_str().as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, self.root.join(SCRATCH_RECORD))?;
        sync_dir(&self.root)
    }

    /// The scratch directory of one attempt (`<scratch-root>/<task>.<attempt>`),
    /// named like its attempt's files so that it is traceable to its task.
    pub fn scratch_dir(&self, task: &TaskId, attempt: tenure_protocol::Attempt) -> Option<PathBuf> {
        Some(self.scratch_root()?.join(format!("{task}.{attempt}")))
    }

    /// The worker's lock file: a worker holds an fcntl write lock on it for
    /// its whole life, which is how the sidecar knows which process is the
    /// worker (see [`crate::worker_lock`]).
    pub fn lock_path(&self) -> PathBuf {
        self.root.join("worker.lock")
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

    /// Directory holding the files of every attempt that reached its intent
    /// (`<task>.<attempt>.journal` and the others beside it; see
    /// [`crate::attempt_files`]).
    pub fn attempts_dir(&self) -> PathBuf {
        self.root.join("attempts")
    }

    /// The files of one attempt (`attempts/<task>.<attempt>…`).
    pub fn attempt_files(&self, task: &TaskId, attempt: tenure_protocol::Attempt) -> AttemptFiles {
        AttemptFiles::new(self.attempts_dir().join(format!("{task}.{attempt}")))
    }

    /// Creates the root, database, output and attempts directories with mode
    /// 0700 when they are missing. The root must belong to this process's
    /// user; an existing root or subdirectory open to others is tightened to
    /// 0700 (with a warning: nothing but the daemons has business there). A
    /// non-directory (or a symlink) in place of any of them is refused.
    ///
    /// Every directory this creates is made durable (the directory holding
    /// it is fsynced), and so is the root's own list of entries: files the
    /// daemons later make durable with an fsync of their own and of the
    /// directory naming them are then reachable after a power loss. The
    /// entry of a root that already existed is the operator's; it is synced
    /// too, when its parent can be opened.
    pub fn create_dirs(&self) -> Result<(), Error> {
        let dirs = [self.root.clone(), self.db_dir(), self.output_dir(), self.attempts_dir()];
        // The directories about to be created, outermost first, with the root's missing ancestors.
        let mut missing: Vec<PathBuf> =
            self.root.ancestors().filter(|a| !a.as_os_str().is_empty() && !a.exists()).map(Path::to_path_buf).collect();
        missing.reverse();
        missing.extend(dirs[1..].iter().filter(|d| !d.exists()).cloned());
        // Parents the operator did not create get the usual mode: a task's
        // user may have to pass them to reach the sibling scratch root.
        if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
            DirBuilder::new()
                .recursive(true)
                .create(parent)
                .map_err(|source| Error::CreateDir { path: parent.to_path_buf(), source })?;
        }
        let mut builder = DirBuilder::new();
        builder.recursive(true).mode(0o700);
        for dir in &dirs {
            builder.create(dir).map_err(|source| Error::CreateDir { path: dir.clone(), source })?;
        }
        let me = nix::unistd::geteuid().as_raw();
        for dir in dirs {
            let meta =
                std::fs::symlink_metadata(&dir).map_err(|source| Error::CreateDir { path: dir.clone(), source })?;
            if !meta.file_type().is_dir() {
                return Err(Error::NotADirectory { path: dir });
            }
            if meta.uid() != me {
                return Err(Error::NotOurs { path: dir, owner: meta.uid(), me });
            }
            if meta.mode() & 0o077 != 0 {
                tracing::warn!(dir = %dir.display(), mode = format!("{:o}", meta.mode() & 0o777), "data directory open to others: tightening it to 0700");
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                    .map_err(|source| Error::Private { path: dir.clone(), source })?;
            }
        }
        let mut synced = std::collections::BTreeSet::new();
        for dir in &missing {
            let parent = match dir.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if synced.insert(parent.clone()) {
                sync_dir(&parent).map_err(|source| Error::Sync { path: parent.clone(), source })?;
            }
        }
        if synced.insert(self.root.clone()) {
            sync_dir(&self.root).map_err(|source| Error::Sync { path: self.root.clone(), source })?;
        }
        if let Some(parent) = self.root.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !synced.contains(parent) {
                if let Err(error) = sync_dir(parent) {
                    tracing::warn!(dir = %parent.display(), %error, "cannot sync the directory holding the data directory");
                }
            }
        }
        Ok(())
    }
}

/// `fsync` of a directory: makes its list of entries durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Reads a small file of the data directory without following a symlink.
fn read_small(path: &Path) -> io::Result<Vec<u8>> {
    let file = OpenOptions::new().read(true).custom_flags((OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK).bits()).open(path)?;
    ensure_regular(&file, path)?;
    let mut bytes = Vec::new();
    file.take(4096).read_to_end(&mut bytes)?;
    Ok(bytes)
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

/// The name of a worker's parent group, in each hierarchy: its id and a
/// digest of its data directory's path (stable across restarts, so a
/// restarted worker finds its attempts' groups again).
pub fn cgroup_parent_name(worker: &tenure_protocol::WorkerId, data_dir: &Path) -> String {
    // FNV-1a: stable across builds and platforms, unlike the std hasher.
    let digest = data_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    format!("tenure-{worker}-{:08x}", digest as u32 ^ (digest >> 32) as u32)
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
        assert_eq!(l.lock_path(), Path::new("/data/worker.lock"));
        assert_eq!(l.scratch_dir(&t, tenure_protocol::Attempt(2)).unwrap(), Path::new("/data.scratch/shell-7.2"));
        let set = Layout::new("/data").with_scratch_root("/srv/scratch");
        assert_eq!(set.scratch_dir(&t, tenure_protocol::Attempt(1)).unwrap(), Path::new("/srv/scratch/shell-7.1"));
    }

    #[test]
    fn the_default_scratch_root_is_a_sibling_never_inside() {
        let d = |p: &str| Layout::default_scratch_root(Path::new(p));
        assert_eq!(d("/var/lib/tenure"), Some(PathBuf::from("/var/lib/tenure.scratch")));
        assert_eq!(d("/var/lib/tenure/"), Some(PathBuf::from("/var/lib/tenure.scratch")));
        assert_eq!(d("data"), Some(PathBuf::from("data.scratch")));
        assert_eq!(d("/"), None);
        assert_eq!(d("a/.."), None);
    }

    #[test]
    fn the_recorded_scratch_root_is_what_the_sidecar_finds() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path().join("data"));
        l.create_dirs().unwrap();
        assert_eq!(l.scratch_root(), Layout::default_scratch_root(l.root()));
        l.record_scratch_root(Path::new("/srv/elsewhere")).unwrap();
        l.record_scratch_root(Path::new("/srv/scratch")).unwrap();
        assert_eq!(Layout::new(l.root()).scratch_root(), Some(PathBuf::from("/srv/scratch")));
    }

    #[test]
    fn an_open_data_dir_is_tightened() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path().join("data"));
        std::fs::create_dir_all(l.output_dir()).unwrap();
        for d in [l.root().to_path_buf(), l.output_dir()] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        l.create_dirs().unwrap();
        for d in [l.root().to_path_buf(), l.output_dir(), l.attempts_dir()] {
            assert_eq!(std::fs::metadata(&d).unwrap().permissions().mode() & 0o777, 0o700, "{}", d.display());
        }
    }

    #[test]
    fn create_dirs_is_private_and_repeatable() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path().join("data"));
        l.create_dirs().unwrap();
        l.create_dirs().unwrap();
        for d in [l.root().to_path_buf(), l.db_dir(), l.output_dir(), l.attempts_dir()] {
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
