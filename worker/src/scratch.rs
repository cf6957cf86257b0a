//! The attempts' scratch directories: made, given back when an attempt left
//! one empty, and handed to a later attempt instead of a new one.
//!
//! Each attempt of a task that runs in a shim works in
//! `<scratch-root>/<task>.<attempt>` (its working directory and `HOME`, see
//! [`crate::sandbox`]), kept after the attempt for its owner until the task's
//! cleanup job. A directory the attempt left empty holds nothing for anyone:
//! at the attempt's release the worker takes it back as a spare,
//! `<scratch-root>/.spare.<n>`, and the next attempt gets a spare renamed to
//! its name instead of a new directory. On a file system that allocates
//! inodes slowly after many removals (ext4 without a journal scans past every
//! inode freed in the last minutes), a directory made and later removed for
//! each short task is the largest part of the worker's work for it; a rename
//! allocates and frees nothing.
//!
//! What a spare may carry from one attempt to the next is nothing: it is
//! taken back only when it has no entry and no extended attribute (so no
//! ACL), and with `--run-as` it first becomes the daemons' user's (mode
//! 0700), so that no process of the task's user can add an entry between the
//! check and the rename; it is checked again after that change. It is given
//! to the next attempt's user and mode 0700 again, through a descriptor,
//! after the rename. Without `--run-as` tasks run as the daemons' user and can
//! reach each other's directories anyway (docs/security.md).
//!
//! Spares live only in this process's memory. A starting worker removes the
//! spares an earlier run left (empty: nothing lost); one that is not empty
//! (a power cut can undo a rename that named a task's directory) is left for
//! the operator with a warning. This module never removes a task's
//! directory: that is the task's cleanup job's, or a starting worker's sweep
//! of released tasks ([`crate::recovery`]).

use std::ffi::OsStr;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::fs::{Mode, OFlags, RenameFlags, CWD};
use rustix::io::Errno;

use tenure_protocol::{Attempt, TaskId};

use crate::sandbox::RunAs;

/// The prefix of a spare's name: a task id never starts with a dot.
pub const SPARE_PREFIX: &str = ".spare.";

/// At most this many spares wait; a directory given back beyond them stays
/// where it is, for the task's cleanup job.
pub const MAX_SPARES: usize = 64;

/// One worker's scratch directories.
#[derive(Debug)]
pub struct ScratchDirs {
    root: PathBuf,
    /// The user each attempt's directory is given to (`--run-as`).
    owner: Option<(u32, u32)>,
    spares: Mutex<Spares>,
}

#[derive(Debug, Default)]
struct Spares {
    waiting: Vec<u64>,
    /// The next spare's number.
    next: u64,
}

impl ScratchDirs {
    /// The scratch directories under `root` (already prepared), given to
    /// `owner`'s user when set. Removes the spares an earlier run left.
    pub fn open(root: &Path, owner: Option<&RunAs>) -> ScratchDirs {
        let dirs = ScratchDirs {
            root: root.to_path_buf(),
            owner: owner.map(|u| (u.uid, u.gid)),
            spares: Mutex::new(Spares::default()),
        };
        dirs.remove_old_spares();
        dirs
    }

    fn spares(&self) -> std::sync::MutexGuard<'_, Spares> {
        self.spares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the directory `name` is (made or not).
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// How many spares wait.
    pub fn spare_count(&self) -> usize {
        self.spares().waiting.len()
    }

    /// The directory `name` (`<task>.<attempt>`): a spare renamed to it when
    /// one waits, a new one otherwise; an existing one (a retried start) is
    /// kept as it is. Either way it is made the attempt's user's, mode 0700,
    /// through a descriptor opened without following links.
    pub fn make(&self, name: &str) -> io::Result<PathBuf> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.starts_with('.') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not a directory name")));
        }
        let root = open_dir(CWD, self.root.as_os_str())?;
        if !self.rename_a_spare(&root, name) {
            match rustix::fs::mkdirat(&root, name, Mode::from_bits_truncate(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(errno) => return Err(errno.into()),
            }
        }
        let dir = open_dir(&root, OsStr::new(name))?;
        if let Some((uid, gid)) = self.owner {
            chown(&dir, uid, gid)?;
        }
        rustix::fs::fchmod(&dir, Mode::from_bits_truncate(0o700))?;
        Ok(self.path(name))
    }

    /// Renames a waiting spare to `name`; false when none waits or the
    /// rename failed (a directory of that name exists: the spare waits on).
    fn rename_a_spare(&self, root: &OwnedFd, name: &str) -> bool {
        let Some(n) = self.spares().waiting.pop() else { return false };
        match rustix::fs::renameat_with(root, spare_name(n), root, name, RenameFlags::NOREPLACE) {
            Ok(()) => true,
            Err(Errno::EXIST) => {
                self.spares().waiting.push(n);
                false
            }
            Err(error) => {
                tracing::warn!(spare = n, %error, "a spare scratch directory cannot be used; forgetting it");
                false
            }
        }
    }

    /// Takes `name` (`<task>.<attempt>`, whose processes are gone) back as a
    /// spare when the attempt left it empty and without extended
    /// attributes, and fewer than [`MAX_SPARES`] wait. True when taken;
    /// false leaves it as it was: what is in it is the task's, for its
    /// owner, until the task's cleanup job.
    pub fn give_back(&self, name: &str) -> bool {
        if name.starts_with('.') || name.contains('/') || self.spare_count() >= MAX_SPARES {
            return false;
        }
        match self.take_back(name) {
            Ok(taken) => taken,
            Err(error) => {
                tracing::debug!(dir = name, %error, "a scratch directory not taken back");
                false
            }
        }
    }

    fn take_back(&self, name: &str) -> io::Result<bool> {
        let root = open_dir(CWD, self.root.as_os_str())?;
        let dir = match open_dir(&root, OsStr::new(name)) {
            Ok(dir) => dir,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        if !is_bare(&dir)? {
            return Ok(false);
        }
        if let Some((uid, gid)) = self.owner {
            // Nobody but the daemons' user may add an entry from here on; what
            // the task's user added before this point is seen by the second look.
            chown(&dir, rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw())?;
            rustix::fs::fchmod(&dir, Mode::from_bits_truncate(0o700))?;
            if !is_bare(&dir)? {
                chown(&dir, uid, gid)?;
                return Ok(false);
            }
        }
        let n = {
            let mut spares = self.spares();
            spares.next += 1;
            spares.next
        };
        match rustix::fs::renameat_with(&root, name, &root, spare_name(n), RenameFlags::NOREPLACE) {
            Ok(()) => {
                self.spares().waiting.push(n);
                Ok(true)
            }
            Err(errno) => {
                if let Some((uid, gid)) = self.owner {
                    chown(&dir, uid, gid)?;
                }
                Err(errno.into())
            }
        }
    }

    /// Removes the spares an earlier run of the worker left; a spare that
    /// is not empty is left, with a warning.
    fn remove_old_spares(&self) {
        let Ok(entries) = std::fs::read_dir(&self.root) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            if !name.as_bytes().starts_with(SPARE_PREFIX.as_bytes()) {
                continue;
            }
            match std::fs::remove_dir(entry.path()) {
                Ok(()) => {}
                Err(error) => tracing::warn!(
                    dir = %entry.path().display(), %error,
                    "a spare scratch directory from an earlier run cannot be removed: left for the operator"
                ),
            }
        }
    }
}

/// The scratch directory's name of `task`'s attempt `attempt`:
/// `<task>.<attempt>`, as [`crate::recovery`]'s sweep reads it back.
pub fn name(task: &TaskId, attempt: Attempt) -> String {
    format!("{task}.{attempt}")
}

/// Whether `name` is a spare's.
pub fn is_spare(name: &str) -> bool {
    name.starts_with(SPARE_PREFIX)
}

fn spare_name(n: u64) -> String {
    format!("{SPARE_PREFIX}{n}")
}

/// Opens the directory `path` relative to `at` without following a link.
fn open_dir(at: impl rustix::fd::AsFd, path: &OsStr) -> io::Result<OwnedFd> {
    let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::RDONLY;
    Ok(rustix::fs::openat(at, path.as_bytes(), flags, Mode::empty())?)
}

fn chown(dir: &OwnedFd, uid: u32, gid: u32) -> io::Result<()> {
    let (uid, gid) = (rustix::fs::Uid::from_raw(uid), rustix::fs::Gid::from_raw(gid));
    Ok(rustix::fs::fchown(dir, Some(uid), Some(gid))?)
}

/// Whether `dir` has no entry but `.` and `..` and no extended attribute.
fn is_bare(dir: &OwnedFd) -> io::Result<bool> {
    if rustix::fs::flistxattr_query(dir)? != 0 {
        return Ok(false);
    }
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        if !matches!(entry.file_name().to_bytes(), b"." | b"..") {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A scratch root of its own, without `--run-as`.
    fn scratch() -> (tempfile::TempDir, ScratchDirs) {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = ScratchDirs::open(tmp.path(), None);
        (tmp, dirs)
    }

    fn inode(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().ino()
    }

    #[test]
    fn scratch_dirs_are_private_reusable_and_never_follow_links() {
        let (tmp, dirs) = scratch();
        let root = tmp.path();
        let dir = dirs.make("shell-1.1").unwrap();
        assert_eq!(dir, root.join("shell-1.1"));
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::write(dir.join("kept"), b"x").unwrap();
        assert_eq!(dirs.make("shell-1.1").unwrap(), dir);
        assert!(dir.join("kept").exists());
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        std::os::unix::fs::symlink(&target, root.join("shell-2.1")).unwrap();
        assert!(dirs.make("shell-2.1").is_err());
        for bad in ["", "..", "a/b", ".spare.1"] {
            assert!(dirs.make(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_linked_root_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = tmp.path().join("w1.scratch");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(ScratchDirs::open(&link, None).make("shell-1.1").is_err());
        assert!(!elsewhere.join("shell-1.1").exists());
    }

    #[test]
    fn an_empty_directory_is_taken_back_and_handed_to_the_next_attempt() {
        let (_tmp, dirs) = scratch();
        let first = dirs.make("shell-1.1").unwrap();
        let ino = inode(&first);
        std::fs::set_permissions(&first, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(dirs.give_back("shell-1.1"));
        assert!(!first.exists());
        assert_eq!(dirs.spare_count(), 1);
        let next = dirs.make("shell-2.1").unwrap();
        assert_eq!(inode(&next), ino, "the spare, renamed");
        assert_eq!(std::fs::metadata(&next).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(dirs.spare_count(), 0);
        // Given back twice, or never made: nothing happens.
        assert!(dirs.give_back("shell-2.1"));
        assert!(!dirs.give_back("shell-2.1"));
        assert!(!dirs.give_back("shell-9.1"));
        assert_eq!(dirs.spare_count(), 1);
    }

    #[test]
    fn a_directory_with_anything_in_it_stays_the_tasks() {
        let (tmp, dirs) = scratch();
        let root = tmp.path();
        let with_file = dirs.make("shell-1.1").unwrap();
        std::fs::write(with_file.join(".bash_history"), b"x").unwrap();
        let with_dir = dirs.make("shell-2.1").unwrap();
        std::fs::create_dir(with_dir.join("out")).unwrap();
        let with_link = dirs.make("shell-3.1").unwrap();
        std::os::unix::fs::symlink("/etc", with_link.join("l")).unwrap();
        for name in ["shell-1.1", "shell-2.1", "shell-3.1"] {
            assert!(!dirs.give_back(name), "{name}");
            assert!(root.join(name).is_dir());
        }
        let with_xattr = dirs.make("shell-4.1").unwrap();
        match rustix::fs::setxattr(&with_xattr, "user.planted", b"x", rustix::fs::XattrFlags::empty()) {
            Ok(()) => {
                assert!(!dirs.give_back("shell-4.1"));
                assert!(with_xattr.is_dir());
            }
            // A file system without user attributes: nothing to plant.
            Err(errno) => assert_eq!(errno, Errno::OPNOTSUPP),
        }
        assert_eq!(dirs.spare_count(), 0);
        // Neither a spare's name nor a link is taken.
        std::os::unix::fs::symlink(tmp.path(), root.join("shell-5.1")).unwrap();
        assert!(!dirs.give_back("shell-5.1"));
        assert!(!dirs.give_back(".spare.1"));
    }

    #[test]
    fn at_most_max_spares_wait_and_a_retried_start_keeps_its_directory() {
        let (tmp, dirs) = scratch();
        let root = tmp.path();
        for i in 0..=MAX_SPARES {
            dirs.make(&format!("shell-{i}.1")).unwrap();
        }
        for i in 0..=MAX_SPARES {
            assert_eq!(dirs.give_back(&format!("shell-{i}.1")), i < MAX_SPARES, "{i}");
        }
        assert_eq!(dirs.spare_count(), MAX_SPARES);
        assert!(root.join(format!("shell-{MAX_SPARES}.1")).is_dir());
        // The name exists: it is used as it is and the spare waits on.
        std::fs::write(root.join(format!("shell-{MAX_SPARES}.1/kept")), b"x").unwrap();
        dirs.make(&format!("shell-{MAX_SPARES}.1")).unwrap();
        assert!(root.join(format!("shell-{MAX_SPARES}.1/kept")).exists());
        assert_eq!(dirs.spare_count(), MAX_SPARES);
        // A spare gone from under the worker is forgotten; a new directory is made.
        let names: Vec<_> = std::fs::read_dir(root)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_spare(n))
            .collect();
        assert_eq!(names.len(), MAX_SPARES);
        for name in &names {
            std::fs::remove_dir(root.join(name)).unwrap();
        }
        assert!(dirs.make("shell-100.1").unwrap().is_dir());
        assert!(dirs.spare_count() < MAX_SPARES);
    }

    #[test]
    fn a_starting_worker_removes_empty_spares_and_leaves_the_others() {
        let (tmp, dirs) = scratch();
        let root = tmp.path();
        dirs.make("shell-1.1").unwrap();
        dirs.make("shell-2.1").unwrap();
        assert!(dirs.give_back("shell-1.1") && dirs.give_back("shell-2.1"));
        let spares: Vec<_> = std::fs::read_dir(root).unwrap().flatten().map(|e| e.path()).collect();
        assert_eq!(spares.len(), 2);
        // As a power cut can leave it: a task's files under a spare's name.
        std::fs::write(spares[0].join("result"), b"x").unwrap();
        let again = ScratchDirs::open(root, None);
        assert_eq!(again.spare_count(), 0);
        assert!(spares[0].join("result").exists(), "not empty: left");
        assert!(!spares[1].exists(), "empty: removed");
    }

    #[test]
    fn under_run_as_a_spare_is_the_daemons_until_handed_out() {
        let Ok(user) = RunAs::resolve("nobody") else { return };
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).unwrap();
        let dirs = ScratchDirs::open(root, Some(&user));
        let dir = dirs.make("shell-1.1").unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), user.uid);
        assert!(dirs.give_back("shell-1.1"));
        let spare = std::fs::read_dir(root).unwrap().flatten().next().unwrap().path();
        let meta = std::fs::metadata(&spare).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (rustix::process::geteuid().as_raw(), 0o700));
        let next = dirs.make("shell-2.1").unwrap();
        let meta = std::fs::metadata(&next).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (user.uid, user.gid, 0o700));
    }
}
