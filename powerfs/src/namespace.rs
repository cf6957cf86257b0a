//! The directory tree as data: inodes, their attributes and directory entries.
//!
//! Owns the shape of one image of the tree (the live one the mount serves, or the durable one a
//! reboot would find) and the POSIX checks of each namespace change (`EEXIST`, `ENOTEMPTY`,
//! moving a directory into itself, ...). It is pure: it never touches a file, never reads the
//! clock (callers pass `now`), and knows nothing of syncing; the engine decides which changes of
//! the live image are copied into the durable one.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use serde::{Deserialize, Serialize};

/// The inode number of the root directory (fixed by the kernel protocol).
pub const ROOT: u64 = 1;

/// A directory entry's name, as raw bytes (names need not be UTF-8).
pub type Name = Vec<u8>;

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    File,
    Dir,
    Symlink,
    Fifo,
    Socket,
    CharDev,
    BlockDev,
}

/// A point in time with nanoseconds, stored as seconds and nanoseconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Stamp {
    pub secs: i64,
    pub nanos: u32,
}

impl Stamp {
    /// Converts a wall-clock time; times before the epoch are clamped to it.
    pub fn from_system(t: SystemTime) -> Self {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        Stamp { secs: i64::try_from(d.as_secs()).unwrap_or(i64::MAX), nanos: d.subsec_nanos() }
    }

    /// Back to a wall-clock time.
    pub fn to_system(self) -> SystemTime {
        UNIX_EPOCH + Duration::new(u64::try_from(self.secs).unwrap_or(0), self.nanos)
    }
}

/// One inode. Fields marked "live only" are not part of the durable record: the size of a
/// durable file is the length of its durable data, and link counts and parents are derived
/// from the entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub kind: Kind,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    /// Device number of a character or block device.
    #[serde(default)]
    pub rdev: u32,
    /// Target of a symlink.
    #[serde(default, with = "name_bytes")]
    pub target: Vec<u8>,
    /// Entries of a directory, by name.
    #[serde(default, with = "entry_map")]
    pub entries: BTreeMap<Name, u64>,
    pub atime: Stamp,
    pub mtime: Stamp,
    pub ctime: Stamp,
    /// Live only: size of a regular file.
    #[serde(skip)]
    pub size: u64,
    /// Live only: number of entries naming this inode (directories: entries naming it, 1).
    #[serde(skip)]
    pub nlink: u32,
    /// Live only: the directory holding a directory (the root is its own parent).
    #[serde(skip)]
    pub parent: u64,
}

impl Node {
    /// A fresh inode of `kind` with every time set to `now`.
    pub fn new(kind: Kind, perm: u16, uid: u32, gid: u32, now: Stamp) -> Self {
        Node {
            kind,
            perm,
            uid,
            gid,
            rdev: 0,
            target: Vec::new(),
            entries: BTreeMap::new(),
            atime: now,
            mtime: now,
            ctime: now,
            size: 0,
            nlink: 0,
            parent: 0,
        }
    }
}

/// One image of the tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    /// Never reused within a backing directory's lifetime, so a data file named by an inode
    /// number always belongs to that inode.
    pub next_ino: u64,
    pub nodes: BTreeMap<u64, Node>,
}

impl Namespace {
    /// A tree holding only an empty root directory.
    pub fn empty(now: Stamp) -> Self {
        let mut root = Node::new(Kind::Dir, 0o755, 0, 0, now);
        root.nlink = 1;
        root.parent = ROOT;
        let mut nodes = BTreeMap::new();
        nodes.insert(ROOT, root);
        Namespace { next_ino: ROOT + 1, nodes }
    }

    /// The inode, or `ENOENT`.
    pub fn node(&self, ino: u64) -> Result<&Node, Errno> {
        self.nodes.get(&ino).ok_or(Errno::ENOENT)
    }

    /// The inode for changing, or `ENOENT`.
    pub fn node_mut(&mut self, ino: u64) -> Result<&mut Node, Errno> {
        self.nodes.get_mut(&ino).ok_or(Errno::ENOENT)
    }

    fn dir(&self, ino: u64) -> Result<&Node, Errno> {
        let n = self.node(ino)?;
        if n.kind != Kind::Dir {
            return Err(Errno::ENOTDIR);
        }
        Ok(n)
    }

    /// The inode named `name` in directory `parent`.
    pub fn lookup(&self, parent: u64, name: &[u8]) -> Result<u64, Errno> {
        self.dir(parent)?.entries.get(name).copied().ok_or(Errno::ENOENT)
    }

    /// Number of subdirectories of a directory (for its link count).
    pub fn subdirs(&self, ino: u64) -> u32 {
        let Some(n) = self.nodes.get(&ino) else { return 0 };
        let count = n.entries.values().filter(|c| self.nodes.get(c).is_some_and(|c| c.kind == Kind::Dir)).count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    /// Adds a new inode named `name` in `parent` and returns its number.
    pub fn create(&mut self, parent: u64, name: &[u8], mut node: Node) -> Result<u64, Errno> {
        check_name(name)?;
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        node.nlink = 1;
        node.parent = parent;
        self.nodes.insert(ino, node);
        self.node_mut(parent)?.entries.insert(name.to_vec(), ino);
        Ok(ino)
    }

    /// Adds a second name for a non-directory inode.
    pub fn link(&mut self, ino: u64, parent: u64, name: &[u8]) -> Result<(), Errno> {
        check_name(name)?;
        if self.node(ino)?.kind == Kind::Dir {
            return Err(Errno::EPERM);
        }
        if self.dir(parent)?.entries.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        self.node_mut(parent)?.entries.insert(name.to_vec(), ino);
        self.node_mut(ino)?.nlink += 1;
        Ok(())
    }

    /// Removes a non-directory's name; returns the inode and its remaining link count.
    pub fn unlink(&mut self, parent: u64, name: &[u8]) -> Result<(u64, u32), Errno> {
        let ino = self.lookup(parent, name)?;
        if self.node(ino)?.kind == Kind::Dir {
            return Err(Errno::EISDIR);
        }
        self.node_mut(parent)?.entries.remove(name);
        let node = self.node_mut(ino)?;
        node.nlink = node.nlink.saturating_sub(1);
        Ok((ino, node.nlink))
    }

    /// Removes an empty directory (the inode goes with it); returns its number.
    pub fn rmdir(&mut self, parent: u64, name: &[u8]) -> Result<u64, Errno> {
        let ino = self.lookup(parent, name)?;
        let node = self.dir(ino)?;
        if !node.entries.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        self.node_mut(parent)?.entries.remove(name);
        self.nodes.remove(&ino);
        Ok(ino)
    }

    /// Whether `ancestor` is `ino` or one of the directories above it.
    fn is_ancestor(&self, ancestor: u64, mut ino: u64) -> bool {
        for _ in 0..=self.nodes.len() {
            if ino == ancestor {
                return true;
            }
            match self.nodes.get(&ino) {
                Some(n) if ino != ROOT => ino = n.parent,
                _ => return false,
            }
        }
        false
    }

    /// Renames `parent/name` to `newparent/newname` with `rename(2)` semantics; `noreplace`
    /// refuses an existing target, `exchange` swaps two existing names. Returns a replaced
    /// non-directory target with its remaining link count, for the caller to release.
    pub fn rename(
        &mut self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        noreplace: bool,
        exchange: bool,
    ) -> Result<Option<(u64, u32)>, Errno> {
        check_name(newname)?;
        let ino = self.lookup(parent, name)?;
        self.dir(newparent)?;
        let target = self.node(newparent)?.entries.get(newname).copied();
        let is_dir = self.node(ino)?.kind == Kind::Dir;
        if is_dir && self.is_ancestor(ino, newparent) {
            return Err(Errno::EINVAL);
        }
        if exchange {
            let other = target.ok_or(Errno::ENOENT)?;
            if self.node(other)?.kind == Kind::Dir && self.is_ancestor(other, parent) {
                return Err(Errno::EINVAL);
            }
            self.node_mut(parent)?.entries.insert(name.to_vec(), other);
            self.node_mut(newparent)?.entries.insert(newname.to_vec(), ino);
            self.set_parent_if_dir(ino, newparent);
            self.set_parent_if_dir(other, parent);
            return Ok(None);
        }
        let mut released = None;
        if let Some(other) = target {
            if noreplace {
                return Err(Errno::EEXIST);
            }
            if other == ino {
                return Ok(None);
            }
            let other_node = self.node(other)?;
            match (is_dir, other_node.kind == Kind::Dir) {
                (true, false) => return Err(Errno::ENOTDIR),
                (false, true) => return Err(Errno::EISDIR),
                (true, true) if !other_node.entries.is_empty() => return Err(Errno::ENOTEMPTY),
                (true, true) => {
                    self.nodes.remove(&other);
                }
                (false, false) => {
                    let n = self.node_mut(other)?;
                    n.nlink = n.nlink.saturating_sub(1);
                    released = Some((other, n.nlink));
                }
            }
        }
        self.node_mut(parent)?.entries.remove(name);
        self.node_mut(newparent)?.entries.insert(newname.to_vec(), ino);
        self.set_parent_if_dir(ino, newparent);
        Ok(released)
    }

    fn set_parent_if_dir(&mut self, ino: u64, parent: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            if n.kind == Kind::Dir {
                n.parent = parent;
            }
        }
    }

    /// Rebuilds the live-only link counts and parents from the entries, dropping entries that
    /// name a missing inode.
    pub fn relink(&mut self) {
        let known: std::collections::BTreeSet<u64> = self.nodes.keys().copied().collect();
        let mut counts: BTreeMap<u64, (u32, u64)> = BTreeMap::new();
        for (&dir, node) in self.nodes.iter_mut() {
            node.entries.retain(|_, child| known.contains(child));
            for &child in node.entries.values() {
                let c = counts.entry(child).or_insert((0, dir));
                c.0 += 1;
            }
        }
        for (&ino, node) in self.nodes.iter_mut() {
            let (count, parent) = counts.get(&ino).copied().unwrap_or((0, ROOT));
            node.nlink = if ino == ROOT { 1 } else { count };
            node.parent = if ino == ROOT { ROOT } else { parent };
        }
    }

    /// Drops every inode that cannot be reached from the root; returns the dropped numbers.
    pub fn retain_reachable(&mut self) -> Vec<u64> {
        let mut seen = std::collections::BTreeSet::new();
        let mut stack = vec![ROOT];
        while let Some(ino) = stack.pop() {
            if !seen.insert(ino) {
                continue;
            }
            if let Some(n) = self.nodes.get(&ino) {
                stack.extend(n.entries.values().copied());
            }
        }
        let dropped: Vec<u64> = self.nodes.keys().copied().filter(|i| !seen.contains(i)).collect();
        for ino in &dropped {
            self.nodes.remove(ino);
        }
        self.relink();
        dropped
    }

    /// Drops, until none is left, every inode other than the root that no entry names and for
    /// which `keep` says no; returns the dropped numbers.
    pub fn retain_referenced(&mut self, keep: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut dropped = Vec::new();
        loop {
            let named: std::collections::BTreeSet<u64> =
                self.nodes.values().flat_map(|n| n.entries.values().copied()).collect();
            let gone: Vec<u64> =
                self.nodes.keys().copied().filter(|&i| i != ROOT && !named.contains(&i) && !keep(i)).collect();
            if gone.is_empty() {
                return dropped;
            }
            for ino in gone {
                self.nodes.remove(&ino);
                dropped.push(ino);
            }
        }
    }
}

fn check_name(name: &[u8]) -> Result<(), Errno> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    if name.len() > 255 {
        return Err(Errno::ENAMETOOLONG);
    }
    Ok(())
}

/// Percent-encoding of raw names, so the record stays readable JSON for any byte string.
mod name_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn encode(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len());
        for &b in bytes {
            if b.is_ascii_graphic() && b != b'%' || b == b' ' {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02x}"));
            }
        }
        out
    }

    pub fn decode(s: &str) -> Result<Vec<u8>, String> {
        let raw = s.as_bytes();
        let mut out = Vec::with_capacity(raw.len());
        let mut i = 0;
        while i < raw.len() {
            if raw[i] == b'%' {
                let hex = s.get(i + 1..i + 3).ok_or_else(|| format!("truncated escape in {s:?}"))?;
                out.push(u8::from_str_radix(hex, 16).map_err(|e| format!("bad escape in {s:?}: {e}"))?);
                i += 3;
            } else {
                out.push(raw[i]);
                i += 1;
            }
        }
        Ok(out)
    }

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        decode(&s).map_err(serde::de::Error::custom)
    }
}

/// Directory entries keyed by encoded name.
mod entry_map {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::name_bytes::{decode, encode};

    pub fn serialize<S: Serializer>(map: &BTreeMap<Vec<u8>, u64>, s: S) -> Result<S::Ok, S::Error> {
        let encoded: BTreeMap<String, u64> = map.iter().map(|(k, v)| (encode(k), *v)).collect();
        encoded.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<Vec<u8>, u64>, D::Error> {
        let encoded = BTreeMap::<String, u64>::deserialize(d)?;
        encoded.into_iter().map(|(k, v)| Ok((decode(&k).map_err(serde::de::Error::custom)?, v))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Node {
        Node::new(Kind::File, 0o644, 0, 0, Stamp::default())
    }

    fn dir() -> Node {
        Node::new(Kind::Dir, 0o755, 0, 0, Stamp::default())
    }

    #[test]
    fn create_refuses_existing_name() {
        let mut ns = Namespace::empty(Stamp::default());
        ns.create(ROOT, b"a", file()).unwrap();
        assert_eq!(ns.create(ROOT, b"a", file()), Err(Errno::EEXIST));
    }

    #[test]
    fn rename_replaces_file_and_releases_target() {
        let mut ns = Namespace::empty(Stamp::default());
        let a = ns.create(ROOT, b"a", file()).unwrap();
        let b = ns.create(ROOT, b"b", file()).unwrap();
        assert_eq!(ns.rename(ROOT, b"a", ROOT, b"b", false, false), Ok(Some((b, 0))));
        assert_eq!(ns.lookup(ROOT, b"b"), Ok(a));
        assert_eq!(ns.lookup(ROOT, b"a"), Err(Errno::ENOENT));
    }

    #[test]
    fn rename_noreplace_and_exchange() {
        let mut ns = Namespace::empty(Stamp::default());
        let a = ns.create(ROOT, b"a", file()).unwrap();
        let b = ns.create(ROOT, b"b", file()).unwrap();
        assert_eq!(ns.rename(ROOT, b"a", ROOT, b"b", true, false), Err(Errno::EEXIST));
        ns.rename(ROOT, b"a", ROOT, b"b", false, true).unwrap();
        assert_eq!((ns.lookup(ROOT, b"a"), ns.lookup(ROOT, b"b")), (Ok(b), Ok(a)));
    }

    #[test]
    fn directory_cannot_move_into_itself() {
        let mut ns = Namespace::empty(Stamp::default());
        let d = ns.create(ROOT, b"d", dir()).unwrap();
        ns.create(d, b"e", dir()).unwrap();
        let e = ns.lookup(d, b"e").unwrap();
        assert_eq!(ns.rename(ROOT, b"d", e, b"x", false, false), Err(Errno::EINVAL));
    }

    #[test]
    fn rmdir_refuses_non_empty() {
        let mut ns = Namespace::empty(Stamp::default());
        let d = ns.create(ROOT, b"d", dir()).unwrap();
        ns.create(d, b"f", file()).unwrap();
        assert_eq!(ns.rmdir(ROOT, b"d"), Err(Errno::ENOTEMPTY));
    }

    #[test]
    fn unreachable_inodes_are_dropped() {
        let mut ns = Namespace::empty(Stamp::default());
        let d = ns.create(ROOT, b"d", dir()).unwrap();
        let f = ns.create(d, b"f", file()).unwrap();
        ns.node_mut(ROOT).unwrap().entries.clear();
        let mut dropped = ns.retain_reachable();
        dropped.sort();
        assert_eq!(dropped, vec![d, f]);
    }

    #[test]
    fn record_round_trips_odd_names() {
        let mut ns = Namespace::empty(Stamp::default());
        ns.create(ROOT, b"we%ird\xff name", file()).unwrap();
        let json = serde_json::to_string(&ns).unwrap();
        let mut back: Namespace = serde_json::from_str(&json).unwrap();
        back.relink();
        assert!(back.lookup(ROOT, b"we%ird\xff name").is_ok());
    }
}
