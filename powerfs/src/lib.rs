//! A test-only FUSE filesystem that simulates power loss.
//!
//! Programs on the mount see an ordinary filesystem. Behind it, the filesystem keeps two images
//! of the tree: the *live* one every read sees, and the *durable* one a machine would find after
//! losing power. A **cut** stops serving and throws away everything that is not durable; mounting
//! the same backing directory again is the **reboot**, and shows exactly the durable image.
//!
//! This crate owns that simulation and nothing else; it must never be used to hold data anyone
//! wants to keep (it keeps no fsync promise towards the host's own disk, see *Limits*).
//!
//! # Rules (strict mode, the default)
//!
//! Like a strict reading of POSIX, nothing is durable until it was synced:
//!
//! 1. **File data** (content and length) becomes durable only by `fsync`/`fdatasync` of that
//!    file, through any open handle of the same inode. Each sync copies only the byte ranges
//!    written since the previous one (plus the new length), so databases that sync often stay
//!    cheap. `close` is not a sync.
//! 2. **Directory entries**: a create, `mknod` (FIFO, socket, device), `mkdir`, `symlink`,
//!    `link`, `unlink`, `rmdir` or `rename` becomes durable only by `fsync` of the directory
//!    holding the entry. A directory's `fsync` makes its *whole current list of entries*
//!    durable at once. An inode named there for the first time enters the durable image with its
//!    current attributes: a file with whatever data it had synced (empty if never), a directory
//!    with no entries until that directory is synced itself.
//! 3. **Renames across directories**: each side is a change of its own directory. Syncing only
//!    the new parent leaves the inode durable under both names (like a hard link); syncing only
//!    the old parent leaves it under neither (if nothing else names it, it is gone). A rename is
//!    fully durable once both directories were synced after it.
//! 4. A file whose data was synced but whose entry never was is gone after a cut; a file whose
//!    entry was synced but whose data never was is present, empty or with its last synced
//!    content. A directory whose own entry is not durable takes its whole subtree with it.
//! 5. **Attributes**: mode and owner of an inode whose entry is durable become durable at an
//!    `fsync` of that inode or, for a directory, of the directory itself. Times are carried
//!    along but only reach the record with its next write (any directory sync, a mode or owner
//!    change, a clean unmount), so after a cut they may be older. Sizes follow the data.
//!
//! # Journaled-metadata mode
//!
//! [`Options::journaled_metadata`] models a journaling filesystem that orders metadata like
//! ext4's `data=ordered`: every tree change (rule 2, 3 and 5) made so far becomes durable at the
//! next `fsync`/`fdatasync` of *any* file or directory on the mount. File data still needs its
//! own file's sync (rule 1): a file created and written, followed by an unrelated sync, is
//! present after a cut but empty.
//!
//! # Cut, torn writes, clean shutdown
//!
//! - [`Mounted::cut`] (or `SIGUSR1` to the binary, or the server process being killed) drops all
//!   unsynced changes. With [`CutOptions::torn`], the most recent unsynced write on the whole
//!   mount keeps a prefix — a given number of bytes, or a length drawn from a seed — written
//!   over that file's durable content; every other unsynced change is still lost, and the prefix
//!   is visible only if the file's entry is durable.
//! - [`Mounted::unmount`], dropping a [`Mounted`], and `SIGTERM`/`SIGINT` to the binary are a
//!   clean shutdown: like `sync` before power-off, everything becomes durable first.
//!
//! # Backing directory and crash safety of the simulator itself
//!
//! `live/<ino>` holds the current data of each regular file and `durable/` the durable image:
//! `durable/data/<ino>` per synced file and `durable/tree.json`, the durable tree, replaced
//! atomically (write a temporary file, rename it over). The live tree itself is kept in memory.
//! Both images are keyed by inode number rather than by path: renames, hard links and unlinked
//! open files then need no path bookkeeping, and a sync copies between two files with the same
//! name. Because every mount starts by discarding `live/` and rebuilding it from `durable/`, the
//! server may be SIGKILLed at any moment between two filesystem operations and the next mount
//! still sees a consistent durable image (the one a cut at that moment would have left).
//!
//! # Special files and locks
//!
//! FIFOs and unix sockets are inodes in the tree (their entries obey rule 2); opening a FIFO,
//! binding and connecting a unix socket are handled by the kernel and never reach the server.
//! `flock` and `fcntl` locks are likewise kept by the kernel on this mount (the server does not
//! ask to handle them), so they work between processes on this machine exactly as on a local
//! filesystem. Locks, FIFO buffers and socket bindings do not survive a cut, as after a reboot.
//!
//! # Limits
//!
//! - Writes through a shared writable `mmap` reach the server only when the kernel writes the
//!   pages back (on `msync`/`fsync`/unmount); until then they are not even live data here.
//! - Extended attributes are not supported; access times are not updated by reads.
//! - Permission checks are the kernel's (`default_permissions`); the server runs as root.
//! - The durable image survives the *server* dying, not the *host* crashing: the server does not
//!   fsync its own backing files (that would make every simulated sync a real one).
//! - Only one server may use a backing directory at a time; a second one is refused
//!   ([`Error::Busy`]) through a lock on `lock` in the backing directory.
//!
//! # Control interface of the binary
//!
//! `tenure-powerfs mount --backing DIR --mountpoint DIR [--journaled-metadata]
//! [--torn-bytes N | --torn-seed S]` serves in the foreground and prints `ready` on stdout once
//! the mount is live. `SIGTERM`/`SIGINT`: clean unmount, exit 0. `SIGUSR1`: cut (with the torn
//! write, if asked), exit 0. `tenure-powerfs cut --pid P` sends `SIGUSR1`;
//! `tenure-powerfs unmount --mountpoint DIR` detaches a mount left by a killed server (and
//! `mount` does the same on its own mountpoint before mounting).

mod engine;
mod fs;
mod mount;
pub mod namespace;
mod ranges;
mod store;

use std::path::PathBuf;

pub use mount::{unmount_stale, Mounted, PowerFs};

/// Errors of the powerfs library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation on the backing directory or the mountpoint failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The durable tree record could not be read or written.
    #[error("durable tree record {path}: {source}")]
    Record {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The durable image is not one this filesystem could have written.
    #[error("corrupt durable image: {0}")]
    Corrupt(String),
    /// Another server holds the backing directory.
    #[error("backing directory {backing} is in use by another server: {source}")]
    Busy {
        backing: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the mount.
    #[error("mounting at {mountpoint}: {source}")]
    Mount {
        mountpoint: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// How the mount decides what is durable.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Every tree change becomes durable at the next sync of anything (see the crate docs).
    pub journaled_metadata: bool,
}

/// How much of the last unsynced write survives a cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TornPrefix {
    /// Exactly this many bytes (or the whole write, if shorter).
    Bytes(u64),
    /// A length in `0..len` drawn from this seed (reproducible).
    Seeded(u64),
}

/// A torn write applied at a cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TornWrite {
    pub prefix: TornPrefix,
}

/// What a cut should do besides dropping unsynced state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutOptions {
    pub torn: Option<TornWrite>,
}

/// What a cut did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutReport {
    /// The torn write, if one was asked for and there was an unsynced write to tear.
    pub torn: Option<TornReport>,
}

/// The write that was torn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TornReport {
    /// Inode of the file written.
    pub ino: u64,
    /// Offset and length of the write.
    pub offset: u64,
    pub len: u64,
    /// Bytes of it kept in the durable image.
    pub kept: u64,
}
