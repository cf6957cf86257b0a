//! The recovery store's commit log: what makes a write durable between two
//! flushes of the sled database (durability note a8).
//!
//! Every write goes to sled as before, but is acknowledged once its
//! *operation* (put or remove of a key in one of the store's trees) is in
//! this log and the log is synced: one `pwrite` and one `fdatasync`, from
//! the thread that asked. A sled flush hands its write to sled's own IO
//! threads and ends in `sync_file_range`, and sled still needs tenure's
//! `fdatasync` after it (see `SledFiles` in [`crate::store`]): it is now
//! paid once per log's worth of operations ([`DEFAULT_CAPACITY`]: a
//! *checkpoint*), not once per acknowledgement.
//!
//! **Layout.** A file of fixed size, written with zeros and synced (with its
//! directory) when created, so that a sync never has to record a new length
//! or new blocks. It holds one *generation* of frames from offset 0:
//!
//! ```text
//! frame  = magic "TNCL" | generation u64 | seq u64 | len u32 | crc32 u32 | payload (len bytes)
//! crc32  = over generation, seq, len (big-endian, as stored) and the payload
//! seq 0  = the generation's start: payload = the store's incarnation (16 bytes)
//! seq k  = the operations of the k-th commit since the start, in order
//! op     = 1 | tree u8 | key len u32 | key | value len u32 | value   (put)
//!        | 2 | tree u8 | key len u32 | key                           (remove)
//! ```
//!
//! **Reading.** Frames are taken from the start while each is whole (magic,
//! checksum), of the start's generation and the next sequence number; the
//! first that is not ends the log. A frame is synced before the next one is
//! written, so only the last can be torn by a crash or a power cut, and it was
//! never acknowledged. Generations are random: a frame left from an earlier
//! generation further in the file never continues a later one. A start for
//! another incarnation (the database was replaced beside a kept log) is
//! ignored whole. A whole frame whose operations do not decode is not
//! damage a crash can make: it is refused ([`Error::Corrupt`]), never skipped.
//!
//! **Checkpoint.** The store replays the log into sled at open, and whenever
//! a commit would not fit it flushes and syncs sled first; only then does it
//! start a new generation ([`CommitLog::start`]), which makes every earlier
//! frame unreachable. A crash between the two replays operations sled already
//! holds: each is an absolute put or remove applied in the original order,
//! so the result is the same.
//!
//! This module owns the file's format and its IO; it never touches sled.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The log's size unless configured otherwise: about 3 000 `noop` task
/// records between two sled flushes.
pub const DEFAULT_CAPACITY: u64 = 2 * 1024 * 1024;

const MAGIC: &[u8; 4] = b"TNCL";
const HEADER: usize = 4 + 8 + 8 + 4 + 4;
const PUT: u8 = 1;
const REMOVE: u8 = 2;

/// Why the log cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("commit log {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    /// A whole, checksummed frame holds operations that do not decode.
    #[error("commit log {path}: frame {seq} is whole but unreadable: {reason}")]
    Corrupt { path: PathBuf, seq: u64, reason: String },
}

/// Which tree of the store an operation is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tree {
    Meta = 0,
    Attempts = 1,
    Revoked = 2,
}

impl Tree {
    fn from_byte(b: u8) -> Option<Tree> {
        [Tree::Meta, Tree::Attempts, Tree::Revoked].into_iter().find(|t| *t as u8 == b)
    }
}

/// One write of the store, as replayed into sled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put { tree: Tree, key: Vec<u8>, value: Vec<u8> },
    Remove { tree: Tree, key: Vec<u8> },
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// The pending operations are durable in the log (or there were none).
    Synced,
    /// They do not fit in what is left of it: the caller checkpoints
    /// instead (flushes sled, then [`CommitLog::start`]).
    Full,
}

/// The open log: where the next frame goes and the operations not yet in it.
pub struct CommitLog {
    file: File,
    path: PathBuf,
    capacity: u64,
    incarnation: [u8; 16],
    generation: u64,
    next_seq: u64,
    offset: u64,
    /// Encoded operations of the writes since the last commit.
    pending: Vec<u8>,
}

impl CommitLog {
    /// Opens the log at `path` (created, zero-filled and synced with its
    /// directory when absent) and reads the operations of its current
    /// generation, when that generation is `incarnation`'s. The log is not
    /// written until [`CommitLog::start`]: the caller replays first.
    pub fn open(path: &Path, capacity: u64, incarnation: [u8; 16]) -> Result<(CommitLog, Vec<Op>), Error> {
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let capacity = capacity.max(4096);
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => create(path, capacity).map_err(io)?,
            Err(e) => return Err(io(e)),
        };
        let mut bytes = Vec::new();
        (&file).read_to_end(&mut bytes).map_err(io)?;
        // A log of another size (a changed setting) is read whole, then
        // used at the size it has, at least the one asked for.
        let capacity = capacity.max(bytes.len() as u64);
        let log = CommitLog {
            file,
            path: path.to_path_buf(),
            capacity,
            incarnation,
            generation: 0,
            next_seq: 0,
            offset: 0,
            pending: Vec::new(),
        };
        let ops = log.read(&bytes)?;
        if (bytes.len() as u64) < capacity {
            log.file.set_len(capacity).map_err(io)?;
            log.file.sync_all().map_err(io)?;
        }
        Ok((log, ops))
    }

    fn read(&self, bytes: &[u8]) -> Result<Vec<Op>, Error> {
        let mut frames = Frames { bytes, at: 0, generation: None, seq: 0 };
        let Some(start) = frames.next() else { return Ok(Vec::new()) };
        if start != self.incarnation {
            return Ok(Vec::new());
        }
        let mut ops = Vec::new();
        while let Some(payload) = frames.next() {
            decode_ops(payload, &mut ops).map_err(|reason| Error::Corrupt {
                path: self.path.clone(),
                seq: frames.seq - 1,
                reason,
            })?;
        }
        Ok(ops)
    }

    /// The share of the log not written yet, 0 to 1 (operations pending for
    /// the next commit count as written).
    pub fn room(&self) -> f64 {
        let used = self.offset + self.pending.len() as u64;
        1.0 - (used.min(self.capacity) as f64 / self.capacity as f64)
    }

    /// Begins a new generation at the start of the file, durably. Every
    /// frame before is unreachable from then on: call it only once what
    /// they hold is durable elsewhere (replayed and flushed, or checkpointed).
    pub fn start(&mut self) -> Result<(), Error> {
        let generation = loop {
            let g = uuid::Uuid::new_v4().as_u64_pair().0;
            if g != self.generation {
                break g;
            }
        };
        let frame = frame(generation, 0, &self.incarnation);
        self.write_synced(&frame, 0)?;
        self.generation = generation;
        self.next_seq = 1;
        self.offset = frame.len() as u64;
        self.pending.clear();
        Ok(())
    }

    /// Records a put for the next commit.
    pub fn put(&mut self, tree: Tree, key: &[u8], value: &[u8]) {
        self.pending.push(PUT);
        self.pending.push(tree as u8);
        push_bytes(&mut self.pending, key);
        push_bytes(&mut self.pending, value);
    }

    /// Records a remove for the next commit.
    pub fn remove(&mut self, tree: Tree, key: &[u8]) {
        self.pending.push(REMOVE);
        self.pending.push(tree as u8);
        push_bytes(&mut self.pending, key);
    }

    /// Makes the operations recorded since the last commit durable: one
    /// frame, written and synced. On an error nothing is known of the frame;
    /// the operations stay pending and the next commit writes them again in
    /// its place.
    pub fn commit(&mut self) -> Result<Commit, Error> {
        if self.pending.is_empty() {
            return Ok(Commit::Synced);
        }
        if self.offset + (HEADER + self.pending.len()) as u64 > self.capacity {
            return Ok(Commit::Full);
        }
        let frame = frame(self.generation, self.next_seq, &self.pending);
        self.write_synced(&frame, self.offset)?;
        self.next_seq += 1;
        self.offset += frame.len() as u64;
        self.pending.clear();
        Ok(Commit::Synced)
    }

    fn write_synced(&self, frame: &[u8], offset: u64) -> Result<(), Error> {
        let io = |source| Error::Io { path: self.path.clone(), source };
        self.file.write_all_at(frame, offset).map_err(io)?;
        self.file.sync_data().map_err(io)
    }
}

/// Creates the log file full of zeros and makes it and its name durable.
fn create(path: &Path, capacity: u64) -> io::Result<File> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&tmp)?;
    let zeros = vec![0u8; 64 * 1024];
    let mut left = capacity;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        file.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    tenure_machine::layout::sync_dir(crate::store::parent_dir(path))?;
    Ok(file)
}

fn push_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    out.extend_from_slice(bytes);
}

fn frame(generation: u64, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&generation.to_be_bytes());
    out.extend_from_slice(&seq.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[4..]);
    crc.update(payload);
    out.extend_from_slice(&crc.finalize().to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The whole frames of one generation, in order.
struct Frames<'a> {
    bytes: &'a [u8],
    at: usize,
    generation: Option<u64>,
    seq: u64,
}

impl<'a> Iterator for Frames<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let header = self.bytes.get(self.at..self.at.checked_add(HEADER)?)?;
        let (magic, rest) = header.split_at(4);
        let generation = u64::from_be_bytes(rest[..8].try_into().ok()?);
        let seq = u64::from_be_bytes(rest[8..16].try_into().ok()?);
        let len = u32::from_be_bytes(rest[16..20].try_into().ok()?) as usize;
        let crc = u32::from_be_bytes(rest[20..24].try_into().ok()?);
        let start = self.at + HEADER;
        let payload = self.bytes.get(start..start.checked_add(len)?)?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&rest[..20]);
        hasher.update(payload);
        let whole = magic == MAGIC && hasher.finalize() == crc;
        if !whole || seq != self.seq || self.generation.is_some_and(|g| g != generation) {
            return None;
        }
        self.generation = Some(generation);
        self.seq += 1;
        self.at = start + len;
        Some(payload)
    }
}

fn decode_ops(mut payload: &[u8], ops: &mut Vec<Op>) -> Result<(), String> {
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], String> {
        if bytes.len() < n {
            return Err(format!("an operation runs {} bytes past the frame", n - bytes.len()));
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    fn take_bytes(bytes: &mut &[u8]) -> Result<Vec<u8>, String> {
        let len = u32::from_be_bytes(take(bytes, 4)?.try_into().map_err(|_| "length".to_string())?) as usize;
        Ok(take(bytes, len)?.to_vec())
    }
    while !payload.is_empty() {
        let head = take(&mut payload, 2)?;
        let tree = Tree::from_byte(head[1]).ok_or_else(|| format!("unknown tree {}", head[1]))?;
        let key = take_bytes(&mut payload)?;
        ops.push(match head[0] {
            PUT => Op::Put { tree, key, value: take_bytes(&mut payload)? },
            REMOVE => Op::Remove { tree, key },
            other => return Err(format!("unknown operation {other}")),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: [u8; 16] = [7; 16];

    fn put(key: &str, value: &str) -> Op {
        Op::Put { tree: Tree::Attempts, key: key.into(), value: value.into() }
    }

    /// A new log in `dir` with its first generation started.
    fn started(dir: &tempfile::TempDir, capacity: u64) -> (CommitLog, PathBuf) {
        let path = dir.path().join("store.commits");
        let (mut log, ops) = CommitLog::open(&path, capacity, ME).unwrap();
        assert!(ops.is_empty());
        log.start().unwrap();
        (log, path)
    }

    fn record(log: &mut CommitLog, op: &Op) {
        match op {
            Op::Put { tree, key, value } => log.put(*tree, key, value),
            Op::Remove { tree, key } => log.remove(*tree, key),
        }
    }

    #[test]
    fn commits_are_read_back_in_order_and_a_new_generation_hides_them() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, path) = started(&dir, 64 * 1024);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 64 * 1024, "created at its full size");
        let written = [put("a", "1"), Op::Remove { tree: Tree::Revoked, key: b"b".to_vec() }, put("a", "2")];
        record(&mut log, &written[0]);
        assert_eq!(log.commit().unwrap(), Commit::Synced);
        record(&mut log, &written[1]);
        record(&mut log, &written[2]);
        assert_eq!(log.commit().unwrap(), Commit::Synced);
        assert_eq!(log.commit().unwrap(), Commit::Synced, "nothing pending writes nothing");
        drop(log);

        let (mut log, ops) = CommitLog::open(&path, 64 * 1024, ME).unwrap();
        assert_eq!(ops, written);
        log.start().unwrap();
        record(&mut log, &put("c", "3"));
        log.commit().unwrap();
        drop(log);
        let (_, ops) = CommitLog::open(&path, 64 * 1024, ME).unwrap();
        assert_eq!(ops, [put("c", "3")], "the earlier generation's frames are not read");

        let (_, ops) = CommitLog::open(&path, 64 * 1024, [8; 16]).unwrap();
        assert!(ops.is_empty(), "another incarnation's log is ignored");
    }

    #[test]
    fn a_torn_or_damaged_frame_ends_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, path) = started(&dir, 64 * 1024);
        let mut ends = Vec::new();
        for i in 0..3 {
            record(&mut log, &put(&format!("k{i}"), "v"));
            log.commit().unwrap();
            ends.push(log.offset);
        }
        drop(log);
        let bytes = std::fs::read(&path).unwrap();
        // Every cut inside the last frame, and a flipped byte in the second.
        for cut in ends[1] + 1..ends[2] {
            let mut torn = bytes.clone();
            torn[cut as usize..ends[2] as usize].fill(0);
            std::fs::write(&path, &torn).unwrap();
            let (_, ops) = CommitLog::open(&path, 64 * 1024, ME).unwrap();
            assert_eq!(ops, [put("k0", "v"), put("k1", "v")], "cut at {cut}");
        }
        let mut flipped = bytes.clone();
        flipped[ends[0] as usize + HEADER] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let (_, ops) = CommitLog::open(&path, 64 * 1024, ME).unwrap();
        assert_eq!(ops, [put("k0", "v")]);
    }

    #[test]
    fn a_whole_frame_that_does_not_decode_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, path) = started(&dir, 64 * 1024);
        log.pending = vec![9, 1, 0, 0, 0, 0];
        log.commit().unwrap();
        drop(log);
        match CommitLog::open(&path, 64 * 1024, ME) {
            Err(Error::Corrupt { seq, reason, .. }) => assert_eq!((seq, reason.as_str()), (1, "unknown operation 9")),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("an undecodable frame was accepted"),
        }
    }

    #[test]
    fn a_commit_that_does_not_fit_is_left_to_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, path) = started(&dir, 4096);
        log.put(Tree::Attempts, b"big", &[1; 5000]);
        assert_eq!(log.commit().unwrap(), Commit::Full);
        log.start().unwrap();
        assert!(log.pending.is_empty(), "a new generation starts with nothing pending");
        drop(log);
        let (_, ops) = CommitLog::open(&path, 4096, ME).unwrap();
        assert!(ops.is_empty());
    }
}
