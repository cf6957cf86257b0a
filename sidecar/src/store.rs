//! The durable recovery store: the highest epoch this machine has seen and one
//! [`AttemptRecord`] per attempt, behind the narrow [`RecoveryStore`] trait.
//!
//! Three implementations: [`SledStore`] (the real one), [`MemoryStore`] (for
//! deterministic tests of the decision logic) and [`FailingStore`] (every write
//! fails, to prove a storage failure changes nothing).
//!
//! This module stores and loads; it never decides. Whether a write is allowed is
//! [`crate::core`]'s business. A write that returns `Ok` is durable: its
//! operation is synced in the store's commit log ([`crate::commit_log`]), and
//! sled is given the last operation of each key later — while the store is
//! idle ([`RecoveryStore::tidy`]) or at the next checkpoint, where it is
//! flushed and synced (sled's own flush is not a sync, see [`SledFiles`];
//! durability note a14). Loading never panics and never gives up because of one bad record:
//! unreadable records are reported in [`Loaded::corrupt`], apart from fatal
//! failures (an unreadable epoch, a schema from a newer build, sled errors).
//!
//! On-disk format (schema 2: schema 1 and the commit log `<path>.commits`;
//! a schema-1 store is upgraded when opened, before its log is used, and a
//! build that reads only schema 1 refuses it rather than miss the log):
//!
//! ```text
//! tree "meta":     "schema" -> u32 big-endian (2)
//!                  "epoch"  -> u64 big-endian
//!                  "incarnation" -> 16 bytes, a UUID created with the store
//!                  "mark"   -> crc32 ++ tenure_protocol::encode(&RegistryMark):
//!                              the highest registry mark of a record since
//!                              removed (records carry their grant's mark)
//! tree "attempts": "<task-id>/<attempt, 10 digits zero-padded>"
//!                  -> crc32(payload) as u32 big-endian ++ payload
//!                     payload = tenure_protocol::encode(&AttemptRecord)
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};

use tenure_protocol::messages::{AttemptRecord, RegistryMark};
use tenure_protocol::{decode, encode, Attempt, CodecError, Epoch, TaskId};

use crate::commit_log::{self, Commit, CommitLog, Op, Tree};

/// The schema this build writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 2;

const META_TREE: &str = "meta";
const ATTEMPTS_TREE: &str = "attempts";
/// Tombstones of revoked attempts: key only (an attempt key), empty value.
const REVOKED_TREE: &str = "revoked";
const SCHEMA_KEY: &str = "schema";
const EPOCH_KEY: &str = "epoch";
const INCARNATION_KEY: &str = "incarnation";
const MARK_KEY: &str = "mark";

/// Fatal store failures. Per-record corruption is not an error: see [`CorruptRecord`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database could not be opened (missing permissions, held by another
    /// process, unreadable files).
    #[error("cannot open the recovery store at {path}: {source}")]
    Open { path: PathBuf, source: sled::Error },
    /// A read, write or flush failed.
    #[error("recovery store failure: {0}")]
    Sled(#[from] sled::Error),
    /// The database was written by a newer build. Refused rather than guessed at:
    /// misreading recovery state could run a task twice.
    #[error("recovery store schema {found} is newer than this build supports ({supported}); run a newer tenure")]
    NewerSchema { found: u32, supported: u32 },
    /// A metadata value (schema or epoch) is unreadable. Fatal: without the epoch
    /// the machine cannot fence stale coordinators.
    #[error("recovery store metadata {key:?} is unreadable: {reason}")]
    CorruptMeta { key: &'static str, reason: String },
    /// A record could not be encoded (it exceeds the message size limit).
    #[error("cannot encode attempt record: {0}")]
    Encode(CodecError),
    /// Syncing one of the store's files or directories failed: what was
    /// written may not be durable, so the write is not acknowledged.
    #[error("cannot sync {path} of the recovery store: {source}")]
    Sync { path: PathBuf, source: std::io::Error },
    /// The store's commit log is gone: the writes acknowledged since its
    /// last checkpoint may be only there. Refused rather than opened
    /// without them (see the operations guide).
    #[error("the recovery store's commit log {path} is missing: the latest acknowledged writes may be lost; restore the file, or treat the machine as replaced (remove the whole store)")]
    CommitLogMissing { path: PathBuf },
    /// The commit log cannot be read or written.
    #[error("recovery store failure: {0}")]
    Log(#[from] commit_log::Error),
    /// A write refused on purpose by [`FailingStore`].
    #[error("injected storage failure")]
    Injected,
}

/// A stored record that could not be read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptRecord {
    /// The record's key, lossily decoded as UTF-8.
    pub key: String,
    /// Which check failed (checksum, decode, key mismatch).
    pub reason: String,
    /// The attempt the key names, when the key itself is readable. The value may
    /// have said anything, so the service refuses to touch this attempt.
    pub attempt: Option<(TaskId, Attempt)>,
}

/// Everything a store holds, as loaded at startup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// This store's identity, created with it: a machine whose data directory
    /// was wiped or replaced has another one, so its "never heard of this
    /// attempt" is never taken for "never started".
    pub incarnation: uuid::Uuid,
    pub epoch: Epoch,
    pub records: Vec<AttemptRecord>,
    pub corrupt: Vec<CorruptRecord>,
    /// Attempts the leader revoked: they must never be accepted here.
    pub revoked: Vec<(TaskId, Attempt)>,
    /// The registry mark kept for records since removed (see
    /// [`RecoveryStore::put_mark`]); the records' own grants carry theirs.
    /// An unreadable value loads as `None` with a warning: it only weakens
    /// the check of a registry that went back, never the fence.
    pub mark: Option<RegistryMark>,
}

/// Durable state of one worker machine. Each mutating call is durable when it
/// returns `Ok`; on `Err` the caller must assume nothing about whether it landed
/// and must not change its own view (see [`crate::core::Machine`]).
pub trait RecoveryStore {
    /// Reads the epoch and every record.
    fn load(&self) -> Result<Loaded, Error>;
    /// Stores the highest epoch seen.
    fn put_epoch(&mut self, epoch: Epoch) -> Result<(), Error>;
    /// Inserts or replaces the record of `(record.grant.task, record.grant.attempt)`.
    fn put(&mut self, record: &AttemptRecord) -> Result<(), Error>;
    /// Removes a record; removing an absent record is `Ok`.
    fn remove(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error>;
    /// Remembers for good that an attempt was revoked (a tombstone).
    fn put_revoked(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error>;
    /// Keeps the machine's registry mark apart from the records, written
    /// before a record carrying a higher one is removed.
    fn put_mark(&mut self, mark: RegistryMark) -> Result<(), Error>;
    /// While on, writes are not made durable one by one: a later
    /// [`RecoveryStore::flush`] commits them together (group commit). A store
    /// whose every write is durable at once ignores it.
    fn defer_flush(&mut self, _on: bool) {}
    /// Makes every write so far durable.
    fn flush(&self) -> Result<(), Error> {
        Ok(())
    }
    /// Work no answer waits for, done while nothing is asked (a store's
    /// housekeeping between checkpoints); whether more is left. Changes
    /// nothing a load or a crash could tell.
    fn tidy(&self) -> bool {
        false
    }
}

/// The key of an attempt in the `attempts` tree: `<task-id>/<attempt:010>`.
/// Task ids never contain `/`, so the key parses back unambiguously.
pub fn attempt_key(task: &TaskId, attempt: Attempt) -> String {
    format!("{task}/{:010}", attempt.0)
}

/// Parses an [`attempt_key`]; `None` for anything else.
pub fn parse_attempt_key(key: &str) -> Option<(TaskId, Attempt)> {
    let (task, attempt) = key.split_once('/')?;
    if attempt.len() != 10 || !attempt.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((task.parse().ok()?, Attempt(attempt.parse().ok()?)))
}

/// `crc32(payload) ++ payload`.
fn seal<T: serde::Serialize>(record: &T) -> Result<Vec<u8>, Error> {
    let payload = encode(record).map_err(Error::Encode)?;
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&crc32fast::hash(&payload).to_be_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Checks and decodes one stored record; the error is the corruption reason.
/// Checks and decodes a [`seal`]ed value.
fn unseal_value<T: serde::de::DeserializeOwned>(value: &[u8]) -> Result<T, String> {
    let (crc, payload) = value.split_first_chunk::<4>().ok_or_else(|| format!("value of {} bytes", value.len()))?;
    let (stored, actual) = (u32::from_be_bytes(*crc), crc32fast::hash(payload));
    if stored != actual {
        return Err(format!("checksum mismatch (stored {stored:08x}, computed {actual:08x})"));
    }
    decode(payload).map_err(|e| format!("undecodable record: {e}"))
}

fn unseal(key: &str, value: &[u8]) -> Result<AttemptRecord, String> {
    let record: AttemptRecord = unseal_value(value)?;
    let expected = attempt_key(&record.grant.task, record.grant.attempt);
    if expected != key {
        return Err(format!("record names {expected}"));
    }
    Ok(record)
}

// ------------------------------------------------------------------ sled

/// The real store: a sled database, each write's operation synced in the
/// commit log, sled given the writes later and flushed and synced at
/// checkpoints.
pub struct SledStore {
    db: sled::Db,
    /// The syncs sled 0.34 leaves out.
    files: std::sync::Mutex<SledFiles>,
    /// What makes writes durable between checkpoints, and the writes since
    /// the last one that sled has not been given (locked together: a
    /// checkpoint applies the one and retires the other).
    log: std::sync::Mutex<Logged>,
    meta: sled::Tree,
    attempts: sled::Tree,
    revoked: sled::Tree,
    /// `<db path>.epoch`: a second copy of the highest epoch seen.
    epoch_mirror: PathBuf,
    /// Record writes leave the flush to the caller ([`SledStore::defer_flush`]).
    deferred: bool,
}

impl SledStore {
    /// Opens (creating if needed) the database at `path`, writes the schema
    /// version on a fresh database, upgrades a schema-1 one and refuses one
    /// from a newer build, then replays the commit log into it.
    pub fn open(path: &Path) -> Result<SledStore, Error> {
        SledStore::open_with(path, commit_log::DEFAULT_CAPACITY)
    }

    /// [`SledStore::open`] with a commit log of `log_capacity` bytes (tests
    /// use small ones to reach checkpoints).
    pub fn open_with(path: &Path, log_capacity: u64) -> Result<SledStore, Error> {
        let open_err = |source| Error::Open { path: path.to_path_buf(), source };
        let db = sled::Config::new().path(path).open().map_err(open_err)?;
        let meta = db.open_tree(META_TREE).map_err(open_err)?;
        let attempts = db.open_tree(ATTEMPTS_TREE).map_err(open_err)?;
        let revoked = db.open_tree(REVOKED_TREE).map_err(open_err)?;
        let incarnation = match meta.get(INCARNATION_KEY)? {
            Some(v) => <[u8; 16]>::try_from(v.as_ref()).map_err(|_| Error::CorruptMeta {
                key: INCARNATION_KEY,
                reason: format!("value of {} bytes", v.len()),
            })?,
            None => {
                let fresh = *uuid::Uuid::new_v4().as_bytes();
                meta.insert(INCARNATION_KEY, &fresh)?;
                db.flush()?;
                fresh
            }
        };
        let found =
            match meta.get(SCHEMA_KEY)? {
                None => None,
                Some(v) => Some(<[u8; 4]>::try_from(v.as_ref()).map(u32::from_be_bytes).map_err(|_| {
                    Error::CorruptMeta { key: SCHEMA_KEY, reason: format!("value of {} bytes", v.len()) }
                })?),
            };
        match found {
            Some(found) if found > SCHEMA_VERSION => {
                return Err(Error::NewerSchema { found, supported: SCHEMA_VERSION })
            }
            Some(0) => return Err(Error::CorruptMeta { key: SCHEMA_KEY, reason: "version 0".to_owned() }),
            _ => {}
        }
        // A store of this schema had its log from its first open: without
        // it, acknowledged writes since the last checkpoint are gone. The
        // log is created before the schema that needs it is written.
        let log_path = path.with_extension("commits");
        if found == Some(SCHEMA_VERSION) && !log_path.exists() {
            return Err(Error::CommitLogMissing { path: log_path });
        }
        let (log, replay) = CommitLog::open(&log_path, log_capacity, incarnation)?;
        let log = Logged { log, unapplied: HashMap::new(), order: VecDeque::new() };
        if found != Some(SCHEMA_VERSION) {
            meta.insert(SCHEMA_KEY, &SCHEMA_VERSION.to_be_bytes())?;
        }
        db.flush()?;
        let files = SledFiles::open(path)?;
        let store = SledStore {
            db,
            files: std::sync::Mutex::new(files),
            log: std::sync::Mutex::new(log),
            meta,
            attempts,
            revoked,
            epoch_mirror: path.with_extension("epoch"),
            deferred: false,
        };
        let replayed = replay.len();
        for op in replay {
            match op {
                Op::Put { tree, key, value } => store.tree(tree).insert(key, value)?,
                Op::Remove { tree, key } => store.tree(tree).remove(key)?,
            };
        }
        // sled now holds what the log held: durable, and a new generation.
        store.checkpoint()?;
        if replayed > 0 {
            tracing::info!(operations = replayed, "recovery store: the commit log was replayed into the database");
        }
        Ok(store)
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Logged> {
        self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The log, for recording an operation (the store is being written).
    fn log_mut(&mut self) -> &mut Logged {
        self.log.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Inserts or replaces many records with one flush: durable together when it
    /// returns `Ok`. For bulk loads (the benchmarks fill a store with it); the
    /// sidecar itself writes one record per request.
    pub fn put_many(&mut self, records: &[AttemptRecord]) -> Result<(), Error> {
        for record in records {
            self.insert(Tree::Attempts, attempt_key(&record.grant.task, record.grant.attempt), seal(record)?);
        }
        self.flush()
    }

    /// Group commit: while on, writes of attempt records and revocations are
    /// not flushed by themselves, and are durable only once [`SledStore::flush`]
    /// returns `Ok` — the caller must not acknowledge them before. Epoch writes
    /// are always flushed at once (with their mirror).
    pub fn defer_flush(&mut self, on: bool) {
        self.deferred = on;
    }

    fn flush_unless_deferred(&self) -> Result<(), Error> {
        if !self.deferred {
            self.flush()?;
        }
        Ok(())
    }

    /// Makes every write so far durable: what deferred writes wait for, and
    /// shutdown (timed: the flush is the cost of every acknowledgement the
    /// sidecar gives). Their operations go to the commit log in one synced
    /// frame; when they do not fit, the store checkpoints instead.
    pub fn flush(&self) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let mut log = self.log();
        if log.log.commit()? == Commit::Full {
            self.checkpoint_with(&mut log)?;
        }
        crate::metrics::get().flush.record(started.elapsed().as_secs_f64(), &[]);
        Ok(())
    }

    /// Gives sled every write since the last checkpoint, flushes and syncs
    /// it, then starts the commit log over: everything written so far is
    /// durable in sled itself, also what was written to its trees directly
    /// (tests).
    pub fn checkpoint(&self) -> Result<(), Error> {
        self.checkpoint_with(&mut self.log())
    }

    /// a8's order: sled holds and has synced every operation of the log's
    /// generation before a new one begins. A failure on the way keeps the
    /// writes sled was not given and the log as they were.
    fn checkpoint_with(&self, log: &mut Logged) -> Result<(), Error> {
        self.apply(log)?;
        self.db.flush()?;
        self.files.lock().unwrap_or_else(std::sync::PoisonError::into_inner).sync()?;
        log.log.start()?;
        Ok(())
    }

    /// Gives sled every write it was not given yet.
    fn apply(&self, log: &mut Logged) -> Result<(), Error> {
        self.apply_oldest(log, log.order.len())
    }

    /// Gives sled the `n` writes first made since they were last given (the
    /// coldest keys), one atomic batch per tree, without flushing it: sled
    /// may hold a write before a checkpoint (a8 gave it every write at
    /// once), and a crash before the checkpoint's sync replays the log over
    /// whatever sled kept. On failure nothing is taken from the map.
    fn apply_oldest(&self, log: &mut Logged, n: usize) -> Result<(), Error> {
        let n = n.min(log.order.len());
        if n == 0 {
            return Ok(());
        }
        let mut batches: [sled::Batch; 3] = Default::default();
        for entry in log.order.range(..n) {
            let (tree, key) = entry;
            match log.unapplied.get(entry) {
                Some(Some(value)) => batches[*tree as usize].insert(key.as_slice(), value.as_slice()),
                Some(None) => batches[*tree as usize].remove(key.as_slice()),
                None => {}
            }
        }
        for (tree, batch) in [Tree::Meta, Tree::Attempts, Tree::Revoked].into_iter().zip(batches) {
            self.tree(tree).apply_batch(batch)?;
        }
        for entry in log.order.drain(..n) {
            log.unapplied.remove(&entry);
        }
        Ok(())
    }

    /// Records a put of `value` under `key` in `tree` for the next commit
    /// (and for sled, later).
    fn insert(&mut self, tree: Tree, key: impl Into<Vec<u8>>, value: Vec<u8>) {
        self.log_mut().put(tree, key.into(), value);
    }

    /// Records a remove of `key` from `tree` for the next commit.
    fn delete(&mut self, tree: Tree, key: impl Into<Vec<u8>>) {
        self.log_mut().remove(tree, key.into());
    }

    fn tree(&self, tree: Tree) -> &sled::Tree {
        match tree {
            Tree::Meta => &self.meta,
            Tree::Attempts => &self.attempts,
            Tree::Revoked => &self.revoked,
        }
    }
}

/// Keys written since they were last given to sled that stay in memory
/// while the store is idle ([`RecoveryStore::tidy`]) and the log has half
/// its room left; fewer as it fills, in proportion, so that a checkpoint
/// finds little left to apply (applying 2 000 keys at once pauses the store
/// thread for tens of milliseconds). A short task's key is written three to
/// four times, its last (`acknowledged`) after the leader's answer, which
/// under load comes a thousand or more other keys later: at 512 a drain's
/// sidecar spent a fifth more CPU than at 2 048.
const KEEP_UNAPPLIED: usize = 2048;
/// Keys given to sled per [`RecoveryStore::tidy`]: a request arriving
/// meanwhile waits for no more than this.
const TIDY_CHUNK: usize = 32;

/// The commit log and the writes since the last checkpoint that sled has
/// not been given: the last operation of each key (`None`: a remove), and
/// the keys in the order they were first written since they were last
/// given to sled (each key once, exactly the map's). Every entry's
/// operation is in the log too (committed, or pending for the next commit),
/// so the map is bounded by the log's capacity.
struct Logged {
    log: CommitLog,
    unapplied: HashMap<Entry, Option<Vec<u8>>>,
    order: VecDeque<Entry>,
}

type Entry = (Tree, Vec<u8>);

impl Logged {
    fn put(&mut self, tree: Tree, key: Vec<u8>, value: Vec<u8>) {
        self.log.put(tree, &key, &value);
        self.note((tree, key), Some(value));
    }

    fn remove(&mut self, tree: Tree, key: Vec<u8>) {
        self.log.remove(tree, &key);
        self.note((tree, key), None);
    }

    fn note(&mut self, entry: Entry, value: Option<Vec<u8>>) {
        match self.unapplied.get_mut(&entry) {
            Some(last) => *last = value,
            None => {
                self.order.push_back(entry.clone());
                self.unapplied.insert(entry, value);
            }
        }
    }
}

impl RecoveryStore for SledStore {
    fn defer_flush(&mut self, on: bool) {
        SledStore::defer_flush(self, on)
    }

    fn flush(&self) -> Result<(), Error> {
        SledStore::flush(self)
    }

    fn tidy(&self) -> bool {
        let mut log = self.log();
        let keep = (KEEP_UNAPPLIED as f64 * (2.0 * log.log.room()).min(1.0)) as usize;
        let n = log.order.len().saturating_sub(keep).min(TIDY_CHUNK);
        if n == 0 {
            return false;
        }
        if let Err(error) = self.apply_oldest(&mut log, n) {
            // The checkpoint gives them again, and fails the request that needs it.
            tracing::warn!(%error, "recovery store: giving sled its writes ahead of the checkpoint failed");
            return false;
        }
        log.order.len() > keep
    }

    fn load(&self) -> Result<Loaded, Error> {
        // Reads see every write: sled is given those it has not been yet.
        self.apply(&mut self.log())?;
        let epoch = match self.meta.get(EPOCH_KEY)? {
            None => Epoch(0),
            Some(v) => <[u8; 8]>::try_from(v.as_ref())
                .map(|b| Epoch(u64::from_be_bytes(b)))
                .map_err(|_| Error::CorruptMeta { key: EPOCH_KEY, reason: format!("value of {} bytes", v.len()) })?,
        };
        // sled can silently drop damaged data on recovery; the mirror keeps the
        // fence from moving backwards even then.
        let epoch = epoch.max(read_epoch_mirror(&self.epoch_mirror));
        let incarnation = match self.meta.get(INCARNATION_KEY)? {
            Some(v) => uuid::Uuid::from_slice(&v).map_err(|_| Error::CorruptMeta {
                key: INCARNATION_KEY,
                reason: format!("value of {} bytes", v.len()),
            })?,
            None => return Err(Error::CorruptMeta { key: INCARNATION_KEY, reason: "absent".to_owned() }),
        };
        let mark = self.meta.get(MARK_KEY)?.and_then(|v| match unseal_value::<RegistryMark>(&v) {
            Ok(mark) => Some(mark),
            Err(reason) => {
                tracing::warn!(%reason, "the stored registry mark is unreadable; the records' marks still count");
                None
            }
        });
        let mut loaded = Loaded { epoch, incarnation, mark, ..Loaded::default() };
        for entry in self.attempts.iter() {
            let (k, v) = entry?;
            let key = String::from_utf8_lossy(&k).into_owned();
            match unseal(&key, &v) {
                Ok(record) => loaded.records.push(record),
                Err(reason) => {
                    let attempt = parse_attempt_key(&key);
                    loaded.corrupt.push(CorruptRecord { key, reason, attempt });
                }
            }
        }
        for entry in self.revoked.iter() {
            let (k, _) = entry?;
            if let Some(attempt) = parse_attempt_key(&String::from_utf8_lossy(&k)) {
                loaded.revoked.push(attempt);
            }
        }
        Ok(loaded)
    }

    fn put_epoch(&mut self, epoch: Epoch) -> Result<(), Error> {
        self.insert(Tree::Meta, EPOCH_KEY, epoch.0.to_be_bytes().to_vec());
        self.flush()?;
        write_epoch_mirror(&self.epoch_mirror, epoch)?;
        Ok(())
    }

    fn put(&mut self, record: &AttemptRecord) -> Result<(), Error> {
        let value = seal(record)?;
        self.insert(Tree::Attempts, attempt_key(&record.grant.task, record.grant.attempt), value);
        self.flush_unless_deferred()
    }

    fn remove(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
        self.delete(Tree::Attempts, attempt_key(task, attempt));
        self.flush_unless_deferred()
    }

    fn put_revoked(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
        self.insert(Tree::Revoked, attempt_key(task, attempt), Vec::new());
        self.flush_unless_deferred()
    }

    fn put_mark(&mut self, mark: RegistryMark) -> Result<(), Error> {
        self.insert(Tree::Meta, MARK_KEY, seal(&mark)?);
        self.flush_unless_deferred()
    }
}

/// The syncs sled 0.34 leaves out, so that a flushed write survives power
/// loss and not only a process crash.
///
/// sled's `Db::flush` writes its log with `pwrite` and ends in
/// `sync_file_range`, which syncs neither the file's size and metadata nor the
/// drive's cache; only its periodic flusher calls `fsync`, it never syncs a
/// directory or its `conf`, and it never syncs its blob files
/// (`blobs/<lsn>`, one per value too large for the log). So after each
/// `Db::flush` this syncs, in order: every blob file not synced yet and then
/// the `blobs` directory (only when a new one appeared), then the log `db`
/// with `fdatasync` through a descriptor of its own (a sync of any descriptor
/// of an inode syncs the inode). At open it syncs `conf`, the log, `blobs`,
/// the database directory and the directory holding it, so the store's files
/// themselves exist after a power cut. Snapshots (`snap.*`) need nothing
/// more: sled syncs each before renaming it into place, and a snapshot lost
/// with its directory entry is rebuilt from the log.
///
/// Cost per flush: one `fdatasync` of the log plus one listing of `blobs`;
/// blob-sized values add a sync each and one of the directory.
struct SledFiles {
    log: std::fs::File,
    log_path: PathBuf,
    blobs: PathBuf,
    /// Blob files already synced (names are sled's LSNs). Rebuilt from each
    /// listing, so blobs sled removed are forgotten.
    synced_blobs: std::collections::BTreeSet<std::ffi::OsString>,
}

impl SledFiles {
    fn open(path: &Path) -> Result<SledFiles, Error> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Sync { path, source }
        };
        let log_path = path.join("db");
        let log = std::fs::File::open(&log_path).map_err(err(&log_path))?;
        let conf = path.join("conf");
        std::fs::File::open(&conf).and_then(|f| f.sync_all()).map_err(err(&conf))?;
        log.sync_all().map_err(err(&log_path))?;
        let mut files =
            SledFiles { log, log_path, blobs: path.join("blobs"), synced_blobs: std::collections::BTreeSet::new() };
        files.sync_blobs(true)?;
        sync_dir(path)?;
        sync_dir(parent_dir(path))?;
        Ok(files)
    }

    /// Makes what sled flushed durable: new blobs (and their directory)
    /// before the log that points at them.
    fn sync(&mut self) -> Result<(), Error> {
        self.sync_blobs(false)?;
        self.log.sync_data().map_err(|source| Error::Sync { path: self.log_path.clone(), source })
    }

    fn sync_blobs(&mut self, sync_dir_anyway: bool) -> Result<(), Error> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Sync { path, source }
        };
        let entries = match std::fs::read_dir(&self.blobs) {
            // sled creates the directory at open; without it there is nothing to sync.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            entries => entries.map_err(err(&self.blobs))?,
        };
        let mut present = std::collections::BTreeSet::new();
        let mut new = false;
        for entry in entries {
            let name = entry.map_err(err(&self.blobs))?.file_name();
            if !self.synced_blobs.contains(&name) {
                let blob = self.blobs.join(&name);
                match std::fs::File::open(&blob) {
                    // Removed by sled since the listing: nothing left to keep.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    file => file.and_then(|f| f.sync_data()).map_err(err(&blob))?,
                }
                new = true;
            }
            present.insert(name);
        }
        if new || sync_dir_anyway {
            sync_dir(&self.blobs)?;
        }
        self.synced_blobs = present;
        Ok(())
    }
}

/// The directory holding `path` (`.` for a bare name).
pub(crate) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `fsync` of a directory: makes its entries durable.
fn sync_dir(dir: &Path) -> Result<(), Error> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| Error::Sync { path: dir.to_path_buf(), source })
}

// ---------------------------------------------------------------- memory

/// The epoch mirror: the highest epoch seen, as text in a small file beside the
/// database, written atomically (temporary file, fsync, rename, fsync of the
/// directory). sled recovers a damaged log by dropping its tail without an
/// error; without a second copy the machine could forget its fence.
fn write_epoch_mirror(path: &Path, epoch: Epoch) -> Result<(), Error> {
    let io = |e: std::io::Error| Error::Sled(sled::Error::Io(e));
    let dir = parent_dir(path);
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        std::io::Write::write_all(&mut f, format!("{}\n", epoch.0).as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)
}

/// The mirrored epoch; 0 when the file is absent or unreadable.
fn read_epoch_mirror(path: &Path) -> Epoch {
    std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse().ok()).map(Epoch).unwrap_or_default()
}

/// An in-memory store for tests: same contract, no disk. Records go through the
/// same encode/decode as [`SledStore`] so a record that cannot be encoded fails
/// the same way.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    incarnation: uuid::Uuid,
    epoch: Epoch,
    records: BTreeMap<String, Vec<u8>>,
    revoked: std::collections::BTreeSet<(TaskId, Attempt)>,
    mark: Option<RegistryMark>,
    writes: u64,
}

impl MemoryStore {
    /// An empty store with an incarnation of its own.
    pub fn new() -> MemoryStore {
        MemoryStore::with_incarnation(uuid::Uuid::new_v4())
    }

    /// An empty store with the given incarnation (a seeded simulation draws it).
    pub fn with_incarnation(incarnation: uuid::Uuid) -> MemoryStore {
        MemoryStore { incarnation, ..MemoryStore::default() }
    }

    /// How many successful writes happened (to prove a no-op wrote nothing).
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Stores raw bytes under a raw key, bypassing encoding: simulates corruption.
    pub fn put_raw(&mut self, key: impl Into<String>, value: Vec<u8>) {
        self.records.insert(key.into(), value);
    }
}

impl RecoveryStore for MemoryStore {
    fn load(&self) -> Result<Loaded, Error> {
        let mut loaded =
            Loaded { epoch: self.epoch, incarnation: self.incarnation, mark: self.mark, ..Loaded::default() };
        for (key, value) in &self.records {
            match unseal(key, value) {
                Ok(record) => loaded.records.push(record),
                Err(reason) => {
                    loaded.corrupt.push(CorruptRecord { key: key.clone(), reason, attempt: parse_attempt_key(key) })
                }
            }
        }
        loaded.revoked = self.revoked.iter().cloned().collect();
        Ok(loaded)
    }

    fn put_epoch(&mut self, epoch: Epoch) -> Result<(), Error> {
        self.epoch = epoch;
        self.writes += 1;
        Ok(())
    }

    fn put(&mut self, record: &AttemptRecord) -> Result<(), Error> {
        let value = seal(record)?;
        self.records.insert(attempt_key(&record.grant.task, record.grant.attempt), value);
        self.writes += 1;
        Ok(())
    }

    fn remove(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
        self.records.remove(&attempt_key(task, attempt));
        self.writes += 1;
        Ok(())
    }

    fn put_revoked(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
        self.revoked.insert((task.clone(), attempt));
        self.writes += 1;
        Ok(())
    }

    fn put_mark(&mut self, mark: RegistryMark) -> Result<(), Error> {
        self.mark = Some(mark);
        self.writes += 1;
        Ok(())
    }
}

// --------------------------------------------------------------- failing

/// Loads what its inner [`MemoryStore`] holds, refuses every write with
/// [`Error::Injected`] (like Nomad's `ErrDB`).
#[derive(Debug, Clone, Default)]
pub struct FailingStore {
    inner: MemoryStore,
}

impl FailingStore {
    pub fn new(inner: MemoryStore) -> FailingStore {
        FailingStore { inner }
    }

    /// The untouched contents.
    pub fn inner(&self) -> &MemoryStore {
        &self.inner
    }
}

impl RecoveryStore for FailingStore {
    fn load(&self) -> Result<Loaded, Error> {
        self.inner.load()
    }

    fn put_epoch(&mut self, _: Epoch) -> Result<(), Error> {
        Err(Error::Injected)
    }

    fn put(&mut self, _: &AttemptRecord) -> Result<(), Error> {
        Err(Error::Injected)
    }

    fn remove(&mut self, _: &TaskId, _: Attempt) -> Result<(), Error> {
        Err(Error::Injected)
    }

    fn put_revoked(&mut self, _: &TaskId, _: Attempt) -> Result<(), Error> {
        Err(Error::Injected)
    }

    fn put_mark(&mut self, _: RegistryMark) -> Result<(), Error> {
        Err(Error::Injected)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Instant;
    use tenure_protocol::messages::{LeaseGrant, Phase};
    use tenure_protocol::{Ending, Outcome, TaskSpec};

    pub(crate) fn record(task: &str, attempt: u32, phase: Phase) -> AttemptRecord {
        AttemptRecord {
            grant: LeaseGrant {
                input: Vec::new(),
                task: task.parse().unwrap(),
                attempt: Attempt(attempt),
                epoch: Epoch(3),
                owner: "alice".parse().unwrap(),
                spec: TaskSpec::shell("label", "echo hi"),
                mark: None,
            },
            phase,
            pid: (phase >= Phase::Spawned).then_some(4242),
            outcome: (phase >= Phase::Exited).then_some(Outcome::new(Ending::Completed, Some(0), None)),
            boot: None,
        }
    }

    fn sorted(mut records: Vec<AttemptRecord>) -> Vec<AttemptRecord> {
        records.sort_by(|a, b| (&a.grant.task, a.grant.attempt).cmp(&(&b.grant.task, b.grant.attempt)));
        records
    }

    #[test]
    fn keys_round_trip_and_reject_garbage() {
        let t: TaskId = "my-kind-12".parse().unwrap();
        assert_eq!(attempt_key(&t, Attempt(7)), "my-kind-12/0000000007");
        assert_eq!(parse_attempt_key("my-kind-12/0000000007"), Some((t, Attempt(7))));
        assert_eq!(attempt_key(&"a-1".parse().unwrap(), Attempt(u32::MAX)), "a-1/4294967295");
        for bad in ["", "a-1", "a-1/7", "a-1/00000000x7", "a-0/0000000001", "a-1/9999999999", "/0000000001"] {
            assert_eq!(parse_attempt_key(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_epoch_survives_a_database_that_silently_lost_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sidecar-db");
        {
            let mut store = SledStore::open(&path).unwrap();
            store.put_epoch(Epoch(7)).unwrap();
        }
        // What sled's recovery may do to a damaged log: start over, empty.
        std::fs::remove_dir_all(&path).unwrap();
        let store = reopen(&path);
        assert_eq!(store.load().unwrap().epoch, Epoch(7));
    }

    /// Opens a database just closed in this process: sled's background
    /// flusher may hold the file lock for a moment after the last handle drops.
    fn open_again(path: &Path) -> Result<SledStore, Error> {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match SledStore::open(path) {
                Err(e) if Instant::now() < deadline && e.to_string().contains("could not acquire lock") => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                opened => return opened,
            }
        }
    }

    pub(crate) fn reopen(path: &Path) -> SledStore {
        open_again(path).unwrap_or_else(|e| panic!("reopen: {e}"))
    }

    #[test]
    fn sled_round_trip_and_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let a = record("shell-1", 1, Phase::Accepted);
        let b = record("shell-2", 4, Phase::Exited);
        let c = record("shell-3", 1, Phase::Intent);
        let incarnation = {
            let mut s = SledStore::open(&tmp.path().join("db")).unwrap();
            let fresh = s.load().unwrap();
            assert_eq!(fresh, Loaded { incarnation: fresh.incarnation, ..Loaded::default() });
            assert!(!fresh.incarnation.is_nil());
            s.put_epoch(Epoch(9)).unwrap();
            s.put(&a).unwrap();
            s.put(&b).unwrap();
            s.put(&c).unwrap();
            s.remove(&c.grant.task, c.grant.attempt).unwrap();
            s.remove(&c.grant.task, Attempt(99)).unwrap();
            let loaded = s.load().unwrap();
            assert_eq!(loaded.epoch, Epoch(9));
            assert_eq!(sorted(loaded.records), vec![a.clone(), b.clone()]);
            fresh.incarnation
        };
        let s = reopen(&tmp.path().join("db"));
        let loaded = s.load().unwrap();
        assert_eq!(loaded.epoch, Epoch(9));
        assert_eq!(sorted(loaded.records), vec![a, b]);
        assert!(loaded.corrupt.is_empty());
        assert_eq!(loaded.incarnation, incarnation, "a store keeps its incarnation");
        let other = tempfile::tempdir().unwrap();
        assert_ne!(SledStore::open(&other.path().join("db")).unwrap().load().unwrap().incarnation, incarnation);
    }

    #[test]
    fn sled_keeps_the_registry_mark_and_loads_an_unreadable_one_as_absent() {
        let tmp = tempfile::tempdir().unwrap();
        let mark = RegistryMark { last_seq: 77, highest_task: 12, epoch: Epoch(4) };
        {
            let mut s = SledStore::open(&tmp.path().join("db")).unwrap();
            assert_eq!(s.load().unwrap().mark, None);
            s.put_mark(mark).unwrap();
        }
        let s = reopen(&tmp.path().join("db"));
        assert_eq!(s.load().unwrap().mark, Some(mark));
        let mut v = s.meta.get(MARK_KEY).unwrap().unwrap().to_vec();
        let last = v.len() - 1;
        v[last] ^= 0xff;
        s.meta.insert(MARK_KEY, v).unwrap();
        let loaded = s.load().expect("an unreadable mark is not fatal");
        assert_eq!(loaded.mark, None);
        assert_eq!(loaded.epoch, Epoch(0), "the rest loads as before");
    }

    #[test]
    fn sled_reports_corrupt_records_and_loads_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let good = record("shell-1", 1, Phase::Spawned);
        {
            let mut s = SledStore::open(&tmp.path().join("db")).unwrap();
            s.put(&good).unwrap();
            s.put(&record("shell-2", 1, Phase::Intent)).unwrap();
            // sled holds the records from the next checkpoint on.
            s.checkpoint().unwrap();
            // Flip a payload byte of shell-2: the checksum must catch it.
            let key = attempt_key(&"shell-2".parse().unwrap(), Attempt(1));
            let mut v = s.attempts.get(&key).unwrap().unwrap().to_vec();
            let last = v.len() - 1;
            v[last] ^= 0xff;
            s.attempts.insert(key.as_bytes(), v).unwrap();
            // Plain garbage, a too-short value, a checksummed non-record, a bad key.
            s.attempts.insert("shell-3/0000000001", b"garbage bytes".to_vec()).unwrap();
            s.attempts.insert("shell-4/0000000001", vec![1, 2]).unwrap();
            let junk = vec![1u8, 0x90];
            let mut sealed = crc32fast::hash(&junk).to_be_bytes().to_vec();
            sealed.extend_from_slice(&junk);
            s.attempts.insert("shell-5/0000000001", sealed).unwrap();
            s.attempts.insert(b"\xff\xfe", seal(&good).unwrap()).unwrap();
            // A valid record stored under another attempt's key.
            s.attempts.insert("shell-6/0000000002", seal(&record("shell-6", 1, Phase::Accepted)).unwrap()).unwrap();
            s.checkpoint().unwrap();
        }
        let s = reopen(&tmp.path().join("db"));
        let loaded = s.load().unwrap();
        assert_eq!(loaded.records, vec![good]);
        let keys: Vec<_> = loaded.corrupt.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "shell-2/0000000001",
                "shell-3/0000000001",
                "shell-4/0000000001",
                "shell-5/0000000001",
                "shell-6/0000000002",
                "\u{fffd}\u{fffd}"
            ]
        );
        assert!(loaded.corrupt[0].reason.contains("checksum"), "{:?}", loaded.corrupt[0]);
        assert!(loaded.corrupt[3].reason.contains("undecodable"), "{:?}", loaded.corrupt[3]);
        assert!(loaded.corrupt[4].reason.contains("shell-6/0000000001"), "{:?}", loaded.corrupt[4]);
        assert_eq!(loaded.corrupt[1].attempt, Some(("shell-3".parse().unwrap(), Attempt(1))));
        assert_eq!(loaded.corrupt[5].attempt, None);
    }

    #[test]
    fn sled_refuses_a_newer_schema_and_a_corrupt_epoch() {
        let tmp = tempfile::tempdir().unwrap();
        {
            let s = SledStore::open(&tmp.path().join("db")).unwrap();
            s.meta.insert(SCHEMA_KEY, &(SCHEMA_VERSION + 1).to_be_bytes()).unwrap();
            s.checkpoint().unwrap();
        }
        match open_again(&tmp.path().join("db")) {
            Err(Error::NewerSchema { found, supported }) => assert_eq!((found, supported), (3, 2)),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a newer schema was accepted"),
        }

        let tmp = tempfile::tempdir().unwrap();
        {
            let s = SledStore::open(&tmp.path().join("db")).unwrap();
            s.meta.insert(EPOCH_KEY, b"xyz".to_vec()).unwrap();
            s.checkpoint().unwrap();
        }
        let s = reopen(&tmp.path().join("db"));
        assert!(matches!(s.load(), Err(Error::CorruptMeta { key: EPOCH_KEY, .. })));
    }

    #[test]
    fn sled_second_open_of_a_held_database_fails() {
        let tmp = tempfile::tempdir().unwrap();
        let _first = SledStore::open(&tmp.path().join("db")).unwrap();
        assert!(matches!(SledStore::open(&tmp.path().join("db")), Err(Error::Open { .. })));
    }

    #[test]
    fn sled_loads_ten_thousand_records() {
        let tmp = tempfile::tempdir().unwrap();
        let n = 10_000u32;
        {
            let s = SledStore::open(&tmp.path().join("db")).unwrap();
            // One flush for the whole batch: the load is what is measured here.
            let mut batch = sled::Batch::default();
            for i in 1..=n {
                let r = record(&format!("shell-{i}"), 1, Phase::Exited);
                batch.insert(attempt_key(&r.grant.task, r.grant.attempt).as_bytes(), seal(&r).unwrap());
            }
            s.attempts.apply_batch(batch).unwrap();
            s.checkpoint().unwrap();
        }
        let opened = Instant::now();
        let s = reopen(&tmp.path().join("db"));
        let loading = Instant::now();
        let loaded = s.load().unwrap();
        let done = Instant::now();
        assert_eq!(loaded.records.len(), n as usize);
        assert!(loaded.corrupt.is_empty());
        eprintln!(
            "sled: opened in {:?}, loaded {} records in {:?}",
            loading - opened,
            loaded.records.len(),
            done - loading
        );
    }

    /// A store never idle gives sled its writes at checkpoints only, the last
    /// of each key; until then the commit log alone holds them, and a store dropped
    /// before one (what a crash leaves: sled without them) loads them all.
    #[test]
    fn writes_reach_sled_at_checkpoints_and_a_crash_before_one_loses_none() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("db");
        let key = |r: &AttemptRecord| attempt_key(&r.grant.task, r.grant.attempt);
        let (first, last) = (record("shell-1", 1, Phase::Accepted), record("shell-1", 1, Phase::Exited));
        let (gone, later) = (record("shell-2", 1, Phase::Intent), record("shell-3", 1, Phase::Spawned));
        {
            let mut s = SledStore::open(&path).unwrap();
            s.defer_flush(true);
            s.put(&first).unwrap();
            s.put(&record("shell-1", 1, Phase::Intent)).unwrap();
            s.put(&last).unwrap();
            s.put(&gone).unwrap();
            s.remove(&gone.grant.task, gone.grant.attempt).unwrap();
            s.put_revoked(&gone.grant.task, Attempt(2)).unwrap();
            s.flush().unwrap();
            s.put_epoch(Epoch(3)).unwrap();
            assert_eq!(s.attempts.get(key(&last)).unwrap(), None, "sled was given a write before a checkpoint");
            assert_eq!(s.meta.get(EPOCH_KEY).unwrap(), None);
        }
        {
            let mut s = reopen(&path);
            let loaded = s.load().unwrap();
            assert_eq!((loaded.records, loaded.epoch), (vec![last.clone()], Epoch(3)));
            assert_eq!(loaded.revoked, vec![(gone.grant.task.clone(), Attempt(2))]);
            // A checkpoint gives sled the last version of each key.
            s.put(&gone).unwrap();
            s.remove(&gone.grant.task, gone.grant.attempt).unwrap();
            s.checkpoint().unwrap();
            assert_eq!(unseal(&key(&last), &s.attempts.get(key(&last)).unwrap().unwrap()), Ok(last.clone()));
            assert_eq!(s.attempts.get(key(&gone)).unwrap(), None);
            // Written after it: in the new generation of the log only.
            s.put(&later).unwrap();
            assert_eq!(s.attempts.get(key(&later)).unwrap(), None);
        }
        let loaded = reopen(&path).load().unwrap();
        assert_eq!(sorted(loaded.records), vec![last.clone(), later]);
        assert_eq!(loaded.epoch, Epoch(3));

        // A store's own reads see every write.
        let other = tempfile::tempdir().unwrap();
        let mut s = SledStore::open(&other.path().join("db")).unwrap();
        s.put(&first).unwrap();
        s.put(&last).unwrap();
        assert_eq!(s.load().unwrap().records, vec![last]);
    }

    /// While idle the store gives sled its coldest writes ahead of the
    /// checkpoint, a chunk at a time, keeping the newest in memory; what it
    /// gave and what it kept load alike, also after a crash.
    #[test]
    fn an_idle_store_gives_sled_its_oldest_writes_and_keeps_the_newest() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("db");
        let n = KEEP_UNAPPLIED as u32 + 3 * TIDY_CHUNK as u32 + 5;
        let records: Vec<_> = (1..=n).map(|i| record(&format!("shell-{i}"), 1, Phase::Accepted)).collect();
        let in_sled = |s: &SledStore, r: &AttemptRecord| {
            s.attempts.get(attempt_key(&r.grant.task, r.grant.attempt)).unwrap().is_some()
        };
        {
            // A log with more than half its room left after the writes.
            let mut s = SledStore::open_with(&path, 16 << 20).unwrap();
            s.defer_flush(true);
            for r in &records {
                s.put(r).unwrap();
            }
            s.flush().unwrap();
            let mut tidied = 1;
            while s.tidy() {
                tidied += 1;
            }
            assert_eq!(tidied, 4, "{n} keys take four chunks down to {KEEP_UNAPPLIED}");
            assert!(!s.tidy(), "nothing left to do");
            let given = records.iter().filter(|r| in_sled(&s, r)).count();
            assert_eq!(given, n as usize - KEEP_UNAPPLIED);
            assert!(in_sled(&s, &records[0]) && !in_sled(&s, &records[n as usize - 1]), "the oldest go first");
            // A key given to sled and written again is kept as a new one.
            s.put(&record("shell-1", 1, Phase::Exited)).unwrap();
            s.flush().unwrap();
        }
        let loaded = reopen(&path).load().unwrap();
        assert_eq!(loaded.records.len(), n as usize);
        assert!(loaded.records.contains(&record("shell-1", 1, Phase::Exited)));

        // A fuller log keeps fewer, in proportion to the room it has left.
        let other = tempfile::tempdir().unwrap();
        let mut s = SledStore::open_with(&other.path().join("db"), 768 << 10).unwrap();
        s.defer_flush(true);
        for r in &records {
            s.put(r).unwrap();
        }
        s.flush().unwrap();
        let room = s.log().log.room();
        assert!(room > 0.0 && room < 0.5, "the writes fill more than half the log: {room}");
        while s.tidy() {}
        let kept = s.log().order.len();
        assert_eq!(kept, (KEEP_UNAPPLIED as f64 * 2.0 * room) as usize);
        assert_eq!(records.iter().filter(|r| in_sled(&s, r)).count(), n as usize - kept);
    }

    /// Writes through a commit log so small that most flushes checkpoint,
    /// removes and revocations among them, and reads the same back after a
    /// reopen; then the same store with its default log.
    #[test]
    fn sled_writes_through_a_full_commit_log_are_checkpointed() {
        let tmp = tempfile::tempdir().unwrap();
        let (kept, removed) = (record("shell-1", 1, Phase::Exited), record("shell-2", 1, Phase::Intent));
        {
            let mut s = SledStore::open_with(&tmp.path().join("db"), 4096).unwrap();
            s.defer_flush(true);
            for i in 0..40 {
                s.put(&record("shell-3", i, Phase::Accepted)).unwrap();
            }
            s.flush().unwrap();
            s.defer_flush(false);
            s.put(&kept).unwrap();
            s.put(&removed).unwrap();
            s.remove(&removed.grant.task, removed.grant.attempt).unwrap();
            s.put_revoked(&removed.grant.task, Attempt(2)).unwrap();
            s.put_epoch(Epoch(5)).unwrap();
        }
        let s = reopen(&tmp.path().join("db"));
        let loaded = s.load().unwrap();
        assert_eq!(loaded.records.len(), 41);
        assert!(loaded.records.contains(&kept) && !loaded.records.contains(&removed));
        assert_eq!(loaded.revoked, vec![(removed.grant.task.clone(), Attempt(2))]);
        assert_eq!(loaded.epoch, Epoch(5));
    }

    /// A store written by a build before the commit log (schema 1) opens,
    /// keeps its records and is marked schema 2, so that such a build
    /// refuses it from then on rather than miss the log; and a schema-2
    /// store whose log was deleted is refused.
    #[test]
    fn sled_upgrades_a_schema_one_store() {
        let tmp = tempfile::tempdir().unwrap();
        let a = record("shell-1", 1, Phase::Spawned);
        {
            let mut s = SledStore::open(&tmp.path().join("db")).unwrap();
            s.put(&a).unwrap();
            s.meta.insert(SCHEMA_KEY, &1u32.to_be_bytes()).unwrap();
            s.checkpoint().unwrap();
        }
        std::fs::remove_file(tmp.path().join("db.commits")).unwrap();
        let s = reopen(&tmp.path().join("db"));
        assert_eq!(s.load().unwrap().records, vec![a]);
        assert_eq!(s.meta.get(SCHEMA_KEY).unwrap().unwrap().as_ref(), SCHEMA_VERSION.to_be_bytes());
        assert!(tmp.path().join("db.commits").exists(), "the log is created");
        drop(s);
        // From now on the log belongs to the store: without it, refused.
        std::fs::remove_file(tmp.path().join("db.commits")).unwrap();
        let refused = open_again(&tmp.path().join("db"));
        assert!(matches!(refused, Err(Error::CommitLogMissing { .. })), "{:?}", refused.err());
        assert!(!tmp.path().join("db.commits").exists(), "and nothing was created in its place");
    }

    #[test]
    fn memory_store_matches_the_contract() {
        let mut s = MemoryStore::new();
        let a = record("shell-1", 2, Phase::Intent);
        s.put_epoch(Epoch(4)).unwrap();
        s.put(&a).unwrap();
        s.put_raw("shell-9/0000000001", b"junk".to_vec());
        let loaded = s.load().unwrap();
        assert_eq!((loaded.epoch, loaded.records), (Epoch(4), vec![a.clone()]));
        assert_eq!(loaded.corrupt.len(), 1);
        s.remove(&a.grant.task, a.grant.attempt).unwrap();
        assert!(s.load().unwrap().records.is_empty());
        assert_eq!(s.writes(), 3);
    }

    #[test]
    fn failing_store_loads_but_never_writes() {
        let mut inner = MemoryStore::new();
        let a = record("shell-1", 1, Phase::Accepted);
        inner.put(&a).unwrap();
        let mut s = FailingStore::new(inner);
        assert!(matches!(s.put_epoch(Epoch(1)), Err(Error::Injected)));
        assert!(matches!(s.put(&record("shell-2", 1, Phase::Accepted)), Err(Error::Injected)));
        assert!(matches!(s.remove(&a.grant.task, a.grant.attempt), Err(Error::Injected)));
        assert_eq!(s.load().unwrap().records, vec![a]);
    }
}
