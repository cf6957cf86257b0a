//! The rule book: what the mount shows now, and what becomes durable when.
//!
//! Owns the live tree, the durable tree, the dirty byte ranges of each file since its last sync
//! and the open handles. Every filesystem operation lands here as a plain method call; the
//! durability rules (see the crate docs) are applied in `fsync`, `fsyncdir`, `sync_all` and
//! `cut` and nowhere else. It must never speak the kernel protocol (that is `fs`) and never lets
//! an operation other than those four change the durable image (the last release of an unlinked
//! inode only deletes durable data that the durable tree does not name).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::SystemTime;

use fuser::{FileAttr, FileType, INodeNo};
use nix::errno::Errno;

use crate::namespace::{Kind, Namespace, Node, Stamp};
use crate::ranges::RangeSet;
use crate::store::Store;
use crate::{CutReport, Error, Options, TornPrefix, TornReport, TornWrite};

/// Unsynced changes of one regular file.
#[derive(Debug)]
struct Dirty {
    ranges: RangeSet,
    /// Smallest length the file had since its last sync.
    min_len: u64,
    /// The most recent write: (sequence number, offset, length).
    last_write: Option<(u64, u64, u64)>,
}

/// An open file or directory.
#[derive(Debug)]
enum Handle {
    File { ino: u64, file: File },
    Dir { entries: Vec<(u64, FileType, Vec<u8>)> },
}

/// One entry for a directory listing.
pub struct Listed {
    pub ino: u64,
    pub kind: FileType,
    pub name: Vec<u8>,
}

/// The state behind one mount.
#[derive(Debug)]
pub struct Engine {
    store: Store,
    backing: PathBuf,
    options: Options,
    live: Namespace,
    durable: Namespace,
    dirty: HashMap<u64, Dirty>,
    /// Set by any namespace or attribute change since the last full tree commit.
    tree_changed: bool,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    opens: HashMap<u64, u32>,
    write_seq: u64,
    /// After a cut (or a clean unmount) nothing more is served and nothing more is made durable.
    frozen: bool,
}

impl From<Error> for Errno {
    fn from(e: Error) -> Errno {
        tracing::warn!(error = %e, "backing store operation failed");
        match e {
            Error::Io { source, .. } => source.raw_os_error().map(Errno::from_raw).unwrap_or(Errno::EIO),
            _ => Errno::EIO,
        }
    }
}

fn now() -> Stamp {
    Stamp::from_system(SystemTime::now())
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDev => FileType::CharDevice,
        Kind::BlockDev => FileType::BlockDevice,
    }
}

fn kind_of_mode(mode: u32) -> Result<Kind, Errno> {
    match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => Ok(Kind::File),
        libc::S_IFIFO => Ok(Kind::Fifo),
        libc::S_IFSOCK => Ok(Kind::Socket),
        libc::S_IFCHR => Ok(Kind::CharDev),
        libc::S_IFBLK => Ok(Kind::BlockDev),
        libc::S_IFDIR => Ok(Kind::Dir),
        _ => Err(Errno::EINVAL),
    }
}

fn perm_bits(mode: u32, umask: u32) -> u16 {
    u16::try_from(mode & !umask & 0o7777).unwrap_or(0o600)
}

/// A SplitMix64 step: enough randomness for a reproducible torn length.
fn splitmix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Engine {
    /// Boots from the backing directory (see [`Store::boot`]).
    pub fn boot(backing: PathBuf, options: Options) -> Result<Engine, Error> {
        let (store, durable) = Store::boot(&backing, now())?;
        let mut live = durable.clone();
        live.relink();
        Ok(Engine {
            store,
            backing,
            options,
            live,
            durable,
            dirty: HashMap::new(),
            tree_changed: false,
            handles: HashMap::new(),
            next_fh: 1,
            opens: HashMap::new(),
            write_seq: 0,
            frozen: false,
        })
    }

    fn check(&self) -> Result<(), Errno> {
        if self.frozen {
            return Err(Errno::EIO);
        }
        Ok(())
    }

    /// The attributes the kernel sees for `ino`.
    pub fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let n = self.live.node(ino)?;
        let (size, nlink) = match n.kind {
            Kind::Dir => (4096, 2 + self.live.subdirs(ino)),
            Kind::File => (n.size, n.nlink),
            Kind::Symlink => (n.target.len() as u64, n.nlink),
            _ => (0, n.nlink),
        };
        Ok(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: n.atime.to_system(),
            mtime: n.mtime.to_system(),
            ctime: n.ctime.to_system(),
            crtime: n.ctime.to_system(),
            kind: file_type(n.kind),
            perm: n.perm,
            nlink,
            uid: n.uid,
            gid: n.gid,
            rdev: n.rdev,
            blksize: 4096,
            flags: 0,
        })
    }

    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<FileAttr, Errno> {
        self.check()?;
        let ino = self.live.lookup(parent, name)?;
        self.attr(ino)
    }

    fn touch_dir(&mut self, dir: u64) {
        let t = now();
        if let Ok(n) = self.live.node_mut(dir) {
            n.mtime = t;
            n.ctime = t;
        }
        self.tree_changed = true;
    }

    fn dirty_of(&mut self, ino: u64, size: u64) -> &mut Dirty {
        self.dirty.entry(ino).or_insert_with(|| Dirty { ranges: RangeSet::new(), min_len: size, last_write: None })
    }

    fn file_of(&self, fh: Option<u64>, ino: u64) -> Result<Option<&File>, Errno> {
        match fh.and_then(|fh| self.handles.get(&fh)) {
            Some(Handle::File { ino: h, file }) if *h == ino => Ok(Some(file)),
            _ => Ok(None),
        }
    }

    /// Changes attributes; a size change truncates or zero-extends the live file.
    #[allow(clippy::too_many_arguments)]
    pub fn setattr(
        &mut self,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<Stamp>,
        mtime: Option<Stamp>,
        fh: Option<u64>,
    ) -> Result<FileAttr, Errno> {
        self.check()?;
        let kind = self.live.node(ino)?.kind;
        if let Some(size) = size {
            if kind == Kind::Dir {
                return Err(Errno::EISDIR);
            }
            if kind != Kind::File {
                return Err(Errno::EINVAL);
            }
            match self.file_of(fh, ino)? {
                Some(f) => f.set_len(size).map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?,
                None => {
                    let f = self.store.open_live(ino)?;
                    f.set_len(size).map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
                }
            }
            let old = self.live.node(ino)?.size;
            let d = self.dirty_of(ino, old);
            d.min_len = d.min_len.min(size);
            let t = now();
            let n = self.live.node_mut(ino)?;
            n.size = size;
            n.mtime = t;
            n.ctime = t;
        }
        let t = now();
        let n = self.live.node_mut(ino)?;
        let changed = mode.is_some() || uid.is_some() || gid.is_some() || atime.is_some() || mtime.is_some();
        if let Some(mode) = mode {
            n.perm = u16::try_from(mode & 0o7777).unwrap_or(n.perm);
        }
        n.uid = uid.unwrap_or(n.uid);
        n.gid = gid.unwrap_or(n.gid);
        n.atime = atime.unwrap_or(n.atime);
        n.mtime = mtime.unwrap_or(n.mtime);
        if changed {
            n.ctime = t;
            self.tree_changed = true;
        }
        self.attr(ino)
    }

    pub fn readlink(&self, ino: u64) -> Result<Vec<u8>, Errno> {
        self.check()?;
        let n = self.live.node(ino)?;
        if n.kind != Kind::Symlink {
            return Err(Errno::EINVAL);
        }
        Ok(n.target.clone())
    }

    fn add_node(&mut self, parent: u64, name: &[u8], node: Node) -> Result<u64, Errno> {
        let kind = node.kind;
        let ino = self.live.create(parent, name, node)?;
        if kind == Kind::File {
            if let Err(e) = self.store.create_live(ino) {
                self.live.unlink(parent, name).ok();
                self.live.nodes.remove(&ino);
                return Err(e.into());
            }
        }
        self.touch_dir(parent);
        Ok(ino)
    }

    /// Creates a regular file, FIFO, socket or device node.
    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr, Errno> {
        self.check()?;
        let kind = kind_of_mode(mode)?;
        if kind == Kind::Dir {
            return Err(Errno::EINVAL);
        }
        let mut node = Node::new(kind, perm_bits(mode, umask), uid, gid, now());
        node.rdev = rdev;
        let ino = self.add_node(parent, name, node)?;
        self.attr(ino)
    }

    pub fn mkdir(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr, Errno> {
        self.check()?;
        let ino = self.add_node(parent, name, Node::new(Kind::Dir, perm_bits(mode, umask), uid, gid, now()))?;
        self.attr(ino)
    }

    pub fn symlink(&mut self, parent: u64, name: &[u8], target: &[u8], uid: u32, gid: u32) -> Result<FileAttr, Errno> {
        self.check()?;
        let mut node = Node::new(Kind::Symlink, 0o777, uid, gid, now());
        node.target = target.to_vec();
        let ino = self.add_node(parent, name, node)?;
        self.attr(ino)
    }

    /// Creates and opens a regular file.
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        &mut self,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        uid: u32,
        gid: u32,
    ) -> Result<(FileAttr, u64), Errno> {
        self.check()?;
        let node = Node::new(Kind::File, perm_bits(mode, umask), uid, gid, now());
        let ino = self.add_node(parent, name, node)?;
        let fh = self.open(ino, 0)?;
        Ok((self.attr(ino)?, fh))
    }

    pub fn link(&mut self, ino: u64, newparent: u64, newname: &[u8]) -> Result<FileAttr, Errno> {
        self.check()?;
        self.live.link(ino, newparent, newname)?;
        self.live.node_mut(ino)?.ctime = now();
        self.touch_dir(newparent);
        self.attr(ino)
    }

    pub fn unlink(&mut self, parent: u64, name: &[u8]) -> Result<(), Errno> {
        self.check()?;
        let (ino, nlink) = self.live.unlink(parent, name)?;
        self.touch_dir(parent);
        self.release_if_gone(ino, nlink);
        Ok(())
    }

    pub fn rmdir(&mut self, parent: u64, name: &[u8]) -> Result<(), Errno> {
        self.check()?;
        self.live.rmdir(parent, name)?;
        self.touch_dir(parent);
        Ok(())
    }

    pub fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<(), Errno> {
        self.check()?;
        if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0 {
            return Err(Errno::EINVAL);
        }
        let noreplace = flags & libc::RENAME_NOREPLACE != 0;
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        let released = self.live.rename(parent, name, newparent, newname, noreplace, exchange)?;
        self.touch_dir(parent);
        self.touch_dir(newparent);
        if let Some((ino, nlink)) = released {
            self.release_if_gone(ino, nlink);
        }
        Ok(())
    }

    /// Drops a live inode once no name and no open handle refers to it.
    fn release_if_gone(&mut self, ino: u64, nlink: u32) {
        if nlink > 0 || self.opens.get(&ino).copied().unwrap_or(0) > 0 {
            return;
        }
        let Some(node) = self.live.nodes.remove(&ino) else { return };
        if node.kind != Kind::File {
            return;
        }
        self.dirty.remove(&ino);
        if let Err(e) = self.store.remove_live(ino) {
            tracing::warn!(ino, error = %e, "could not remove live data");
        }
        if !self.durable.nodes.contains_key(&ino) {
            if let Err(e) = self.store.remove_durable(ino) {
                tracing::warn!(ino, error = %e, "could not remove durable data");
            }
        }
    }

    /// Opens a regular file; `O_TRUNC` truncates it.
    pub fn open(&mut self, ino: u64, flags: i32) -> Result<u64, Errno> {
        self.check()?;
        match self.live.node(ino)?.kind {
            Kind::File => {}
            Kind::Dir => return Err(Errno::EISDIR),
            _ => return Err(Errno::ENXIO),
        }
        let file = self.store.open_live(ino)?;
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle::File { ino, file });
        *self.opens.entry(ino).or_insert(0) += 1;
        if flags & libc::O_TRUNC != 0 && flags & libc::O_ACCMODE != libc::O_RDONLY {
            self.setattr(ino, None, None, None, Some(0), None, None, Some(fh))?;
        }
        Ok(fh)
    }

    fn handle_file(&self, fh: u64) -> Result<(u64, &File), Errno> {
        match self.handles.get(&fh) {
            Some(Handle::File { ino, file }) => Ok((*ino, file)),
            _ => Err(Errno::EBADF),
        }
    }

    pub fn read(&self, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        self.check()?;
        let (_, file) = self.handle_file(fh)?;
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match file.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))),
            }
        }
        buf.truncate(filled);
        Ok(buf)
    }

    pub fn write(&mut self, fh: u64, offset: u64, data: &[u8]) -> Result<u32, Errno> {
        self.check()?;
        let (ino, file) = self.handle_file(fh)?;
        file.write_all_at(data, offset).map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
        let end = offset + data.len() as u64;
        let old = self.live.node(ino)?.size;
        self.write_seq += 1;
        let seq = self.write_seq;
        let d = self.dirty_of(ino, old);
        d.ranges.insert(offset, end);
        d.last_write = Some((seq, offset, data.len() as u64));
        let t = now();
        let n = self.live.node_mut(ino)?;
        n.size = n.size.max(end);
        n.mtime = t;
        n.ctime = t;
        u32::try_from(data.len()).map_err(|_| Errno::EINVAL)
    }

    /// Allocates, or with `FALLOC_FL_PUNCH_HOLE`/`ZERO_RANGE` zeroes, a range of a file.
    pub fn fallocate(&mut self, fh: u64, offset: u64, length: u64, mode: i32) -> Result<(), Errno> {
        self.check()?;
        let (ino, file) = self.handle_file(fh)?;
        let off = i64::try_from(offset).map_err(|_| Errno::EINVAL)?;
        let len = i64::try_from(length).map_err(|_| Errno::EINVAL)?;
        nix::fcntl::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(file),
            nix::fcntl::FallocateFlags::from_bits_truncate(mode),
            off,
            len,
        )?;
        let end = offset.saturating_add(length);
        let old = self.live.node(ino)?.size;
        let d = self.dirty_of(ino, old);
        d.ranges.insert(offset, end);
        if mode & libc::FALLOC_FL_KEEP_SIZE == 0 {
            let n = self.live.node_mut(ino)?;
            n.size = n.size.max(end);
        }
        Ok(())
    }

    pub fn release(&mut self, fh: u64) {
        if let Some(Handle::File { ino, .. }) = self.handles.remove(&fh) {
            let left = self.opens.get(&ino).copied().unwrap_or(1).saturating_sub(1);
            if left == 0 {
                self.opens.remove(&ino);
            } else {
                self.opens.insert(ino, left);
            }
            let nlink = self.live.nodes.get(&ino).map_or(1, |n| n.nlink);
            self.release_if_gone(ino, nlink);
        }
    }

    pub fn opendir(&mut self, ino: u64) -> Result<u64, Errno> {
        self.check()?;
        let n = self.live.node(ino)?;
        if n.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        let mut entries =
            vec![(ino, FileType::Directory, b".".to_vec()), (n.parent, FileType::Directory, b"..".to_vec())];
        for (name, &child) in &n.entries {
            if let Some(c) = self.live.nodes.get(&child) {
                entries.push((child, file_type(c.kind), name.clone()));
            }
        }
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle::Dir { entries });
        Ok(fh)
    }

    /// Entries of an open directory from position `offset` on (each entry's position is its
    /// index plus one, which the kernel passes back to continue).
    pub fn readdir(&self, fh: u64, offset: u64) -> Result<Vec<Listed>, Errno> {
        self.check()?;
        match self.handles.get(&fh) {
            Some(Handle::Dir { entries }) => Ok(entries
                .iter()
                .skip(usize::try_from(offset).unwrap_or(usize::MAX))
                .map(|(ino, kind, name)| Listed { ino: *ino, kind: *kind, name: name.clone() })
                .collect()),
            _ => Err(Errno::EBADF),
        }
    }

    pub fn releasedir(&mut self, fh: u64) {
        self.handles.remove(&fh);
    }

    pub fn statfs(&self) -> Result<nix::sys::statvfs::Statvfs, Errno> {
        self.check()?;
        nix::sys::statvfs::statvfs(&self.backing)
    }

    /// `fsync`/`fdatasync` of a file: its data (and, if its entry is durable, its attributes)
    /// become durable. In journaled-metadata mode the whole tree is committed too.
    pub fn fsync(&mut self, ino: u64) -> Result<(), Errno> {
        self.check()?;
        self.sync_data(ino)?;
        if self.options.journaled_metadata {
            return self.commit_tree();
        }
        let live = self.live.node(ino)?.clone();
        if let Some(d) = self.durable.nodes.get_mut(&ino) {
            // Times follow along in memory and reach the record with its next write; only a
            // change of mode or owner is worth rewriting the record on every data sync.
            let owner_or_mode_changed = (d.perm, d.uid, d.gid) != (live.perm, live.uid, live.gid);
            d.perm = live.perm;
            d.uid = live.uid;
            d.gid = live.gid;
            d.atime = live.atime;
            d.mtime = live.mtime;
            d.ctime = live.ctime;
            if owner_or_mode_changed {
                self.store.save(&self.durable)?;
            }
        }
        Ok(())
    }

    fn sync_data(&mut self, ino: u64) -> Result<(), Errno> {
        let node = self.live.node(ino)?;
        if node.kind != Kind::File {
            return Ok(());
        }
        let size = node.size;
        if let Some(d) = self.dirty.remove(&ino) {
            if let Err(e) = self.store.sync_data(ino, &d.ranges, d.min_len, size) {
                self.dirty.insert(ino, d);
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// `fsync` of a directory: its current entries become durable, and each inode they name
    /// that was not durable yet enters the durable tree (a file with whatever data it has
    /// synced, a directory with no entries until it is synced itself).
    pub fn fsyncdir(&mut self, ino: u64) -> Result<(), Errno> {
        self.check()?;
        if self.options.journaled_metadata {
            return self.commit_tree();
        }
        let live = self.live.node(ino)?.clone();
        if live.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        for &child in live.entries.values() {
            if self.durable.nodes.contains_key(&child) {
                continue;
            }
            let mut node = self.live.node(child)?.clone();
            node.entries.clear();
            self.durable.nodes.insert(child, node);
        }
        let mut mine = live;
        if let Some(old) = self.durable.nodes.get(&ino) {
            mine.size = old.size;
        }
        self.durable.nodes.insert(ino, mine);
        self.durable.next_ino = self.live.next_ino;
        self.collect_durable()?;
        self.store.save(&self.durable).map_err(Errno::from)
    }

    /// Journaled-metadata commit: the durable tree becomes the live tree.
    fn commit_tree(&mut self) -> Result<(), Errno> {
        if !self.tree_changed {
            return Ok(());
        }
        self.durable = self.live.clone();
        self.collect_durable()?;
        self.store.save(&self.durable)?;
        self.tree_changed = false;
        Ok(())
    }

    /// Drops durable inodes that no durable entry names and that are gone from the live tree.
    fn collect_durable(&mut self) -> Result<(), Errno> {
        let live = &self.live;
        let dropped = self.durable.retain_referenced(|i| live.nodes.contains_key(&i));
        for ino in dropped {
            self.store.remove_durable(ino)?;
        }
        Ok(())
    }

    /// A clean shutdown: every file's data and the whole tree become durable.
    pub fn sync_all(&mut self) -> Result<(), Error> {
        if self.frozen {
            return Ok(());
        }
        let dirty: Vec<u64> = self.dirty.keys().copied().collect();
        for ino in dirty {
            self.sync_data(ino).map_err(|e| Error::Io { context: format!("syncing inode {ino}"), source: e.into() })?;
        }
        self.tree_changed = true;
        self.commit_tree().map_err(|e| Error::Io { context: "committing the tree".into(), source: e.into() })?;
        self.frozen = true;
        Ok(())
    }

    /// Releases the backing directory for the next server (the engine is frozen by then).
    pub fn unlock(&mut self) {
        self.frozen = true;
        self.store.unlock();
    }

    /// Power loss: stops serving; nothing unsynced survives except, if asked, a prefix of the
    /// most recent unsynced write to any file.
    pub fn cut(&mut self, torn: Option<TornWrite>) -> Result<CutReport, Error> {
        if self.frozen {
            return Ok(CutReport { torn: None });
        }
        self.frozen = true;
        let Some(torn) = torn else { return Ok(CutReport { torn: None }) };
        let last =
            self.dirty.iter().filter_map(|(&ino, d)| d.last_write.map(|(seq, off, len)| (seq, ino, off, len))).max();
        let Some((_, ino, offset, len)) = last else { return Ok(CutReport { torn: None }) };
        let wanted = match torn.prefix {
            TornPrefix::Bytes(n) => n.min(len),
            TornPrefix::Seeded(seed) if len > 0 => splitmix64(seed) % len,
            TornPrefix::Seeded(_) => 0,
        };
        let kept = self.store.tear(ino, offset, wanted)?;
        Ok(CutReport { torn: Some(TornReport { ino, offset, len, kept }) })
    }
}
