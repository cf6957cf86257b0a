//! The backing directory on disk: the live data files the mount serves and the durable image a
//! reboot finds.
//!
//! Layout under the backing directory:
//! - `live/<ino>`: the current content of each regular file, keyed by inode number;
//! - `durable/data/<ino>`: the durable content of each regular file that was ever synced;
//! - `durable/tree.json`: the durable tree (a [`Namespace`]), replaced atomically (temporary
//!   file, then rename) so the process may be killed between any two filesystem operations and
//!   the next mount still finds either the old or the new record, never half of one.
//!
//! This module owns file I/O on that layout. It must never decide *what* becomes durable (that
//! is the engine's rule book) and never writes `durable/` except when told to.

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::namespace::{Kind, Namespace, Stamp};
use crate::ranges::RangeSet;
use crate::Error;

const RECORD: &str = "tree.json";
const COPY_CHUNK: usize = 1 << 20;

/// Paths of one backing directory, and the lock that keeps a second server away from it.
#[derive(Debug)]
pub struct Store {
    live: PathBuf,
    durable: PathBuf,
    data: PathBuf,
    /// Held while this store serves; released on drop or by [`Store::unlock`].
    lock: Option<Flock<File>>,
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

impl Store {
    /// Boots from `backing` as a machine would after a reboot: reads the durable tree (an empty
    /// one the first time), drops what the root cannot reach, discards `live/` and rebuilds it
    /// from the durable data. Returns the store and the durable tree, with file sizes filled in.
    pub fn boot(backing: &Path, now: Stamp) -> Result<(Store, Namespace), Error> {
        let data = backing.join("durable").join("data");
        fs::create_dir_all(&data).map_err(io_err(format!("creating {}", data.display())))?;
        let lock_path = backing.join("lock");
        let lock_file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_err(format!("opening {}", lock_path.display())))?;
        let lock = Flock::lock(lock_file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, errno)| Error::Busy { backing: backing.to_path_buf(), source: errno.into() })?;
        let store = Store { live: backing.join("live"), durable: backing.join("durable"), data, lock: Some(lock) };
        let record = store.durable.join(RECORD);
        let mut tree = match fs::read(&record) {
            Ok(bytes) => serde_json::from_slice::<Namespace>(&bytes)
                .map_err(|source| Error::Record { path: record.clone(), source })?,
            Err(e) if e.kind() == ErrorKind::NotFound => Namespace::empty(now),
            Err(e) => return Err(io_err(format!("reading {}", record.display()))(e)),
        };
        if tree.nodes.get(&crate::namespace::ROOT).map(|n| n.kind) != Some(Kind::Dir) {
            return Err(Error::Corrupt(format!("{} has no root directory", record.display())));
        }
        tree.retain_reachable();
        // Data files of inodes the tree does not name are leftovers of syncs whose entries never
        // became durable: they are gone after a reboot.
        for entry in fs::read_dir(&store.data).map_err(io_err(format!("listing {}", store.data.display())))? {
            let entry = entry.map_err(io_err("listing durable data"))?;
            let keep = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|ino| tree.nodes.get(&ino).is_some_and(|n| n.kind == Kind::File));
            if !keep {
                remove_if_present(&entry.path())?;
            }
        }
        match fs::remove_dir_all(&store.live) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(format!("discarding {}", store.live.display()))(e)),
        }
        fs::create_dir_all(&store.live).map_err(io_err(format!("creating {}", store.live.display())))?;
        for (&ino, node) in tree.nodes.iter_mut() {
            if node.kind != Kind::File {
                continue;
            }
            let durable = store.durable_path(ino);
            let live = store.live_path(ino);
            match fs::copy(&durable, &live) {
                Ok(len) => node.size = len,
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    File::create(&live).map_err(io_err(format!("creating {}", live.display())))?;
                    node.size = 0;
                }
                Err(e) => return Err(io_err(format!("restoring {}", live.display()))(e)),
            }
        }
        store.save(&tree)?;
        Ok((store, tree))
    }

    /// Lets another server use the backing directory (after a cut or a clean unmount, even if
    /// this one's serving thread lingers on files still open).
    pub fn unlock(&mut self) {
        self.lock = None;
    }

    /// Where the live content of `ino` lives.
    pub fn live_path(&self, ino: u64) -> PathBuf {
        self.live.join(ino.to_string())
    }

    /// Where the durable content of `ino` lives.
    pub fn durable_path(&self, ino: u64) -> PathBuf {
        self.data.join(ino.to_string())
    }

    /// Creates an empty live file for a new inode.
    pub fn create_live(&self, ino: u64) -> Result<File, Error> {
        let path = self.live_path(ino);
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io_err(format!("creating {}", path.display())))
    }

    /// Opens the live file of `ino` for reading and writing. Handles always open read-write and
    /// never with `O_APPEND`: the kernel hands every write its offset.
    pub fn open_live(&self, ino: u64) -> Result<File, Error> {
        let path = self.live_path(ino);
        OpenOptions::new().read(true).write(true).open(&path).map_err(io_err(format!("opening {}", path.display())))
    }

    /// Forgets an inode's live content.
    pub fn remove_live(&self, ino: u64) -> Result<(), Error> {
        remove_if_present(&self.live_path(ino))
    }

    /// Forgets an inode's durable content.
    pub fn remove_durable(&self, ino: u64) -> Result<(), Error> {
        remove_if_present(&self.durable_path(ino))
    }

    /// Makes the durable content of `ino` equal to its live content, copying only `dirty`
    /// (clipped to `live_len`) and the length. `min_len` is the smallest length the file had since
    /// its last sync: bytes past it that were not rewritten are zeros now.
    ///
    /// Relies on the invariant that after the previous sync (or boot) durable == live.
    pub fn sync_data(&self, ino: u64, dirty: &RangeSet, min_len: u64, live_len: u64) -> Result<(), Error> {
        let durable_path = self.durable_path(ino);
        let durable = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&durable_path)
            .map_err(io_err(format!("opening {}", durable_path.display())))?;
        let durable_len = durable.metadata().map_err(io_err("stat durable data"))?.len();
        let keep = durable_len.min(min_len);
        if keep < durable_len {
            durable.set_len(keep).map_err(io_err("truncating durable data"))?;
        }
        if live_len != keep {
            durable.set_len(live_len).map_err(io_err("sizing durable data"))?;
        }
        let ranges = dirty.clipped(live_len);
        if ranges.is_empty() {
            return Ok(());
        }
        let live = File::open(self.live_path(ino)).map_err(io_err("opening live data"))?;
        let mut buf = vec![0u8; COPY_CHUNK];
        for (start, end) in ranges {
            let mut pos = start;
            while pos < end {
                let want = usize::try_from((end - pos).min(COPY_CHUNK as u64)).unwrap_or(COPY_CHUNK);
                let got = live.read_at(&mut buf[..want], pos).map_err(io_err("reading live data"))?;
                if got == 0 {
                    break;
                }
                durable.write_all_at(&buf[..got], pos).map_err(io_err("writing durable data"))?;
                pos += got as u64;
            }
        }
        Ok(())
    }

    /// Writes `live[offset .. offset+len)` of `ino` over its durable content (a torn write: the
    /// rest of that write, and every other unsynced change, stays lost).
    pub fn tear(&self, ino: u64, offset: u64, len: u64) -> Result<u64, Error> {
        if len == 0 {
            return Ok(0);
        }
        let live = File::open(self.live_path(ino)).map_err(io_err("opening live data"))?;
        let mut buf = vec![0u8; usize::try_from(len).map_err(|_| Error::Corrupt("torn length".into()))?];
        let got = live.read_at(&mut buf, offset).map_err(io_err("reading live data"))?;
        let path = self.durable_path(ino);
        let durable = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_err(format!("opening {}", path.display())))?;
        durable.write_all_at(&buf[..got], offset).map_err(io_err("writing torn data"))?;
        Ok(got as u64)
    }

    /// Replaces the durable tree record atomically.
    pub fn save(&self, tree: &Namespace) -> Result<(), Error> {
        let bytes = serde_json::to_vec(tree).map_err(|source| Error::Record { path: self.record(), source })?;
        let tmp = self.durable.join(format!("{RECORD}.tmp"));
        fs::write(&tmp, bytes).map_err(io_err(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, self.record()).map_err(io_err("replacing the durable tree record"))
    }

    fn record(&self) -> PathBuf {
        self.durable.join(RECORD)
    }
}

fn remove_if_present(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(format!("removing {}", path.display()))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_copies_only_dirty_ranges_and_the_length() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::boot(dir.path(), Stamp::default()).unwrap();
        fs::write(store.live_path(9), vec![b'L'; 1000]).unwrap();
        // Bytes outside the dirty ranges are trusted to be equal already; making them differ
        // shows they are not copied.
        fs::write(store.durable_path(9), vec![b'D'; 1200]).unwrap();
        let mut dirty = RangeSet::new();
        dirty.insert(10, 20);
        store.sync_data(9, &dirty, 1000, 1000).unwrap();
        let durable = fs::read(store.durable_path(9)).unwrap();
        assert_eq!(durable.len(), 1000);
        assert_eq!(&durable[..10], &[b'D'; 10]);
        assert_eq!(&durable[10..20], &[b'L'; 10]);
        assert_eq!(&durable[20..], &[b'D'; 980][..]);
    }

    #[test]
    fn bytes_past_a_shrink_since_the_last_sync_read_as_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = Store::boot(dir.path(), Stamp::default()).unwrap();
        fs::write(store.live_path(3), b"ab\0\0Z").unwrap();
        fs::write(store.durable_path(3), b"abcdef").unwrap();
        let mut dirty = RangeSet::new();
        dirty.insert(4, 5);
        store.sync_data(3, &dirty, 2, 5).unwrap();
        assert_eq!(fs::read(store.durable_path(3)).unwrap(), b"ab\0\0Z");
    }

    #[test]
    fn a_second_boot_is_refused_while_the_first_holds_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (mut first, _) = Store::boot(dir.path(), Stamp::default()).unwrap();
        assert!(matches!(Store::boot(dir.path(), Stamp::default()), Err(Error::Busy { .. })));
        first.unlock();
        assert!(Store::boot(dir.path(), Stamp::default()).is_ok());
    }
}
