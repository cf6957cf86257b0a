//! The kernel-facing adapter: turns FUSE requests into [`Engine`] calls and their results into
//! replies.
//!
//! Owns only translation (inode numbers, flags, errno values). It must never hold a rule of its
//! own about durability, and never keeps state outside the engine, so that a cut seen by the
//! engine is seen by every later request.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, BsdFileFlags, Errno as FuseErrno, FileHandle, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use nix::errno::Errno;

use crate::engine::Engine;
use crate::namespace::Stamp;

/// How long the kernel may cache names and attributes. The mount is the only writer of its
/// tree, so caching is safe; a reboot is a new mount with an empty cache.
const TTL: Duration = Duration::from_secs(1);

/// The FUSE filesystem object; shares its engine with the mount handle.
pub struct PowerFsHandler {
    engine: Arc<Mutex<Engine>>,
}

impl PowerFsHandler {
    pub fn new(engine: Arc<Mutex<Engine>>) -> Self {
        PowerFsHandler { engine }
    }

    fn engine(&self) -> MutexGuard<'_, Engine> {
        // A panic while holding the lock leaves the engine as consistent as the panic left it;
        // keep serving rather than poisoning every later request.
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn errno(e: Errno) -> FuseErrno {
    FuseErrno::from_i32(e as i32)
}

fn stamp(t: TimeOrNow) -> Stamp {
    match t {
        TimeOrNow::SpecificTime(t) => Stamp::from_system(t),
        TimeOrNow::Now => Stamp::from_system(SystemTime::now()),
    }
}

fn entry(reply: ReplyEntry, res: Result<fuser::FileAttr, Errno>) {
    match res {
        Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
        Err(e) => reply.error(errno(e)),
    }
}

fn empty(reply: ReplyEmpty, res: Result<(), Errno>) {
    match res {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

impl Filesystem for PowerFsHandler {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        entry(reply, self.engine().lookup(parent.0, name.as_bytes()));
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.engine().attr(ino.0) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let res =
            self.engine().setattr(ino.0, mode, uid, gid, size, atime.map(stamp), mtime.map(stamp), fh.map(|f| f.0));
        match res {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.engine().readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        entry(reply, self.engine().mknod(parent.0, name.as_bytes(), mode, umask, rdev, req.uid(), req.gid()));
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        entry(reply, self.engine().mkdir(parent.0, name.as_bytes(), mode, umask, req.uid(), req.gid()));
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.engine().unlink(parent.0, name.as_bytes()));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        empty(reply, self.engine().rmdir(parent.0, name.as_bytes()));
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let res =
            self.engine().symlink(parent.0, link_name.as_bytes(), target.as_os_str().as_bytes(), req.uid(), req.gid());
        entry(reply, res);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.engine().rename(parent.0, name.as_bytes(), newparent.0, newname.as_bytes(), flags.bits()));
    }

    fn link(&self, _req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        entry(reply, self.engine().link(ino.0, newparent.0, newname.as_bytes()));
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        match self.engine().open(ino.0, flags.0) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.engine().read(fh.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        match self.engine().write(fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // close(2) is not a sync.
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.engine().release(fh.0);
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.engine().fsync(ino.0));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.engine().opendir(ino.0) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        match self.engine().readdir(fh.0, offset) {
            Ok(entries) => {
                for (i, e) in entries.into_iter().enumerate() {
                    if reply.add(INodeNo(e.ino), offset + i as u64 + 1, e.kind, OsStr::from_bytes(&e.name)) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        self.engine().releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        empty(reply, self.engine().fsyncdir(ino.0));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match self.engine().statfs() {
            Ok(s) => reply.statfs(
                s.blocks(),
                s.blocks_free(),
                s.blocks_available(),
                s.files(),
                s.files_free(),
                u32::try_from(s.block_size()).unwrap_or(4096),
                255,
                u32::try_from(s.fragment_size()).unwrap_or(4096),
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Permission bits are checked by the kernel (the mount uses default_permissions).
        empty(reply, self.engine().attr(ino.0).map(|_| ()));
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let res = self.engine().create(parent.0, name.as_bytes(), mode, umask, req.uid(), req.gid());
        match res {
            Ok((attr, fh)) => reply.created(&TTL, &attr, Generation(0), FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: ReplyXattr) {
        // No extended attributes are kept: every name is absent.
        reply.error(FuseErrno::from_i32(libc::ENODATA));
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(FuseErrno::from_i32(libc::EOPNOTSUPP));
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        empty(reply, self.engine().fallocate(fh.0, offset, length, mode));
    }
}
