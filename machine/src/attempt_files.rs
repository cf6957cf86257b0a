//! The files one attempt's shim shares with the worker, side by side in the
//! machine's `attempts/` directory, each named `<task>.<attempt>.<file>`
//! (durability note a15). An attempt begun by an earlier version keeps its
//! files inside a directory of its own, `attempts/<task>.<attempt>/<file>`:
//! it is read, watched and removed in that shape.
//!
//! | file      | written by | when | meaning |
//! |-----------|------------|------|---------|
//! | `journal` | worker, then shim | see below | the attempt's facts, one checksummed entry each |
//! | `input`   | shim    | before spawning an `agent` task; removed when its group is gone | the task's stdin, a FIFO (mode 0600) |
//! | `matches` | shim    | as a `monitor` task's output lines match its pattern | one JSON [`MatchedLine`] per line, append-only |
//! | `pause-requested` | worker | on the leader's pause; removed on its resume (both fsynced with the directory) | the owner wants the task's group held stopped: the shim stops it on `SIGUSR1` and re-applies it whenever told to look again |
//!
//! The `journal` is append-only; each entry is its length, its CRC-32 and the
//! encoded [`Entry`], written with one `write`. In order:
//!
//! | entry     | written by | when                        | durable |
//! |-----------|------------|-----------------------------|---------|
//! | `Grant`   | worker     | before the shim exists   | with the `Status` (not synced when written) |
//! | `Shim` | shim    | first thing it does         | no |
//! | `Pgid`    | shim    | right after spawning        | no |
//! | `Status`  | shim    | after the group is gone     | yes: the journal's data, then the directory naming it, fsynced before the shim exits |
//!
//! Until its `Status` nothing in the journal needs to outlive the machine
//! (durability note a21): the sidecar's intent, flushed before the journal
//! is written, is what says the attempt may have run; a power cut ends the
//! processes the journal names; and a grant or a journal lost with the power
//! reads as "no process, no status", which the intent turns into "may have
//! run". So the grant is written without a sync, and the status syncs what
//! its reader needs after a power cut: every byte of the journal (the grant
//! before it too) and the journal's name in its directory. The shim's
//! identity and its task's process group name live processes, which matter
//! only while the machine runs (a worker or sidecar crash leaves the page
//! cache intact). A reader takes the entries up to the first incomplete or
//! damaged one (a write cut short, a torn tail after power loss): a missing
//! or unreadable fact is "no evidence", never an outcome. A failed append is
//! cut off again, so nothing written later hides behind it.
//!
//! One file instead of one per fact, and no directory: creating files is the
//! costly part of an attempt's bookkeeping (each is a new inode, which some
//! file systems allocate slowly after many removals), so a shell attempt
//! creates its journal and its output file, and nothing else. The journal is
//! removed last, so an attempt whose removal was interrupted is still found.
//!
//! `input` is a FIFO the shim holds open read-write for the attempt's whole
//! life, so the task never reads end-of-file while nobody writes and a writer
//! (the sidecar, for `tenure send`) always finds a reader while the task runs —
//! whatever happens to the worker. Every open of it is symlink-safe
//! (`O_NOFOLLOW`, then the opened file must be a FIFO) and a writer's open
//! never blocks (`O_NONBLOCK`); nothing here ever follows, truncates or removes
//! something else planted at that path.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::{LeaseGrant, MatchedLine};
use tenure_protocol::Outcome;

pub use crate::process::{group_in_session, ProcessId};

/// The exit evidence a shim leaves behind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimStatus {
    pub outcome: Outcome,
    /// Bytes written to the output file by this attempt.
    pub output_written: u64,
}

/// The files of one attempt.
#[derive(Debug, Clone)]
pub struct AttemptFiles {
    /// `attempts/<task>.<attempt>`: the prefix of the files' names, or the
    /// directory holding them.
    base: PathBuf,
    shape: Shape,
}

/// Where an attempt's files are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `<base>.<file>`, beside every other attempt's.
    Flat,
    /// `<base>/<file>`: an attempt begun by an earlier version.
    Dir,
}

impl AttemptFiles {
    /// The attempt named by `base` (`attempts/<task>.<attempt>`): inside the
    /// directory of that name when there is one (an earlier version made
    /// it), flat beside it otherwise.
    pub fn new(base: PathBuf) -> AttemptFiles {
        let shape = match fs::symlink_metadata(&base) {
            Ok(meta) if meta.is_dir() => Shape::Dir,
            _ => Shape::Flat,
        };
        AttemptFiles { base, shape }
    }

    /// `attempts/<task>.<attempt>`, as messages name the attempt's files.
    pub fn base(&self) -> &Path {
        &self.base
    }

    /// Where the attempt's file `what` is.
    fn path(&self, what: &str) -> PathBuf {
        match self.shape {
            Shape::Dir => self.base.join(what),
            Shape::Flat => {
                let mut name = self.base.clone().into_os_string();
                name.push(".");
                name.push(what);
                name.into()
            }
        }
    }

    /// The directory whose entries name the attempt's files.
    fn names_dir(&self) -> &Path {
        match self.shape {
            Shape::Dir => &self.base,
            Shape::Flat => self.base.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")),
        }
    }

    /// Whether the attempt has anything on disk: its journal (removed last)
    /// or, for an earlier version's attempt, its directory.
    pub fn exists(&self) -> bool {
        let what = match self.shape {
            Shape::Dir => self.base.clone(),
            Shape::Flat => self.journal_path(),
        };
        fs::symlink_metadata(what).is_ok()
    }

    /// Removes every file of the attempt (for an earlier version's attempt:
    /// its directory, without following a link inside). The journal goes
    /// last, so a removal cut short leaves the attempt findable, and removed
    /// again. Absent files are fine. Without a journal only the pause wish
    /// can be there (the worker records it for any held attempt; the other
    /// files are the shim's, which starts after the journal is written), so
    /// an attempt that never had a shim — a built-in kind's — costs two
    /// calls, not one per file.
    pub fn remove(&self) -> io::Result<()> {
        let gone = |result: io::Result<()>| match result {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        match self.shape {
            Shape::Dir => gone(fs::remove_dir_all(&self.base)),
            Shape::Flat if !self.exists() => gone(fs::remove_file(self.path(PAUSE_REQUESTED))),
            Shape::Flat => FILES.iter().try_for_each(|what| gone(fs::remove_file(self.path(what)))),
        }
    }

    /// Starts the journal with the grant. Not synced: the status syncs the
    /// journal and its name (see the module's table).
    pub fn write_grant(&self, grant: &LeaseGrant) -> io::Result<()> {
        let mut file = self.open_journal(false)?;
        let before = file.metadata()?.len();
        write_entry(&mut file, before, &Entry::Grant(Box::new(grant.clone())))?;
        Ok(())
    }

    pub fn read_grant(&self) -> io::Result<LeaseGrant> {
        self.journal()?
            .grant
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no readable grant in the attempt's journal"))
    }

    /// [`ShimJournal::write_shim`] in one call, for a writer that is not
    /// the attempt's shim (which holds its journal open): tests and tools.
    pub fn write_shim(&self, id: ProcessId) -> io::Result<()> {
        self.open_for_shim()?.0.write_shim(id)
    }

    /// The recorded shim, if its entry exists and is readable.
    pub fn shim(&self) -> Option<ProcessId> {
        self.journal().ok()?.shim
    }

    /// [`ShimJournal::write_pgid`] in one call (see [`AttemptFiles::write_shim`]).
    pub fn write_pgid(&self, pgid: i32) -> io::Result<()> {
        self.open_for_shim()?.0.write_pgid(pgid)
    }

    pub fn pgid(&self) -> Option<i32> {
        self.journal().ok()?.pgid
    }

    /// Marks that the leader asked for the task to be killed: written by the
    /// worker before it signals the shim, so the shim can tell that
    /// SIGTERM (a kill) from the one a stopping machine sends every process
    /// (not a kill: the task did not end by anyone's request).
    pub fn mark_kill_requested(&self) -> io::Result<()> {
        std::fs::write(self.path(KILL_REQUESTED), b"")
    }

    /// Whether [`AttemptFiles::mark_kill_requested`] was called.
    pub fn kill_requested(&self) -> bool {
        self.path(KILL_REQUESTED).exists()
    }

    /// Records (`true`) or withdraws the owner's wish that the group be held
    /// stopped, durably (the file and the directory fsynced), so that it
    /// outlives a worker, shim launcher or machine-store restart. Repeating
    /// either is harmless.
    pub fn set_pause_requested(&self, paused: bool) -> io::Result<()> {
        let path = self.path(PAUSE_REQUESTED);
        match paused {
            true => {
                let file = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .mode(0o600)
                    .custom_flags(OFlag::O_NOFOLLOW.bits())
                    .open(&path)?;
                file.sync_all()?;
            }
            false => match fs::remove_file(&path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            },
        }
        crate::layout::sync_dir(self.names_dir())
    }

    /// Whether the owner's wish to hold the group stopped is recorded.
    pub fn pause_requested(&self) -> bool {
        self.path(PAUSE_REQUESTED).exists()
    }

    /// [`ShimJournal::write_status`] in one call (see [`AttemptFiles::write_shim`]).
    pub fn write_status(&self, status: &ShimStatus) -> io::Result<()> {
        self.open_for_shim()?.0.write_status(status)
    }

    /// The exit evidence, if complete and readable.
    pub fn status(&self) -> Option<ShimStatus> {
        self.journal().ok()?.status
    }

    /// Every fact of the attempt, from one read of its journal: for a caller
    /// that needs more than one. An absent journal is an error (`NotFound`).
    pub fn journal(&self) -> io::Result<Journal> {
        Ok(Journal::of(self.entries()?))
    }

    fn journal_path(&self) -> PathBuf {
        self.path(JOURNAL)
    }

    fn open_journal(&self, read: bool) -> io::Result<File> {
        OpenOptions::new()
            .read(read)
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(self.journal_path())
    }

    /// The journal for the attempt's shim, which appends every entry after
    /// the grant: opened once, read once (what it says is returned with
    /// it), and appended to without being opened again. A missing journal
    /// is created, as by any append (the shim then finds no grant in it).
    pub fn open_for_shim(&self) -> io::Result<(ShimJournal, Journal)> {
        let mut file = self.open_journal(true)?;
        let mut bytes = Vec::new();
        io::Read::read_to_end(&mut file, &mut bytes)?;
        let len = bytes.len() as u64;
        let names_dir = self.names_dir().to_path_buf();
        Ok((ShimJournal { file, len, names_dir }, Journal::of(parse_entries(&bytes))))
    }

    /// Every complete, intact entry, in order, up to the first that is not.
    fn entries(&self) -> io::Result<Vec<Entry>> {
        match fs::read(self.journal_path()) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => self.legacy_entries(),
            read => Ok(parse_entries(&read?)),
        }
    }

    /// The facts of an attempt started by an earlier version (one file each:
    /// `grant`, `monitor.pid`, `pgid`, `status`), so that a worker upgraded
    /// while tasks run re-attaches to them and reads their evidence.
    fn legacy_entries(&self) -> io::Result<Vec<Entry>> {
        if self.shape == Shape::Flat {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no attempt journal"));
        }
        let read = |name: &str| fs::read(self.base.join(name)).ok();
        let text = |name: &str| read(name).and_then(|b| String::from_utf8(b).ok());
        let grant = read(LEGACY_GRANT).ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no attempt journal"))?;
        let mut entries: Vec<Entry> =
            tenure_protocol::decode(&grant).ok().map(|g| Entry::Grant(Box::new(g))).into_iter().collect();
        let shim = text("monitor.pid").and_then(|t| {
            let mut parts = t.split_whitespace();
            Some(Entry::Shim { pid: parts.next()?.parse().ok()?, start_time: parts.next()?.parse().ok()? })
        });
        entries.extend(shim);
        entries.extend(text("pgid").and_then(|t| t.trim().parse().ok()).map(Entry::Pgid));
        entries.extend(read("status").and_then(|b| tenure_protocol::decode(&b).ok()).map(Entry::Status));
        Ok(entries)
    }

    /// Where an `agent` attempt's input FIFO lives.
    pub fn input_path(&self) -> PathBuf {
        self.path(INPUT)
    }

    /// For the shim, before it spawns the task: creates the input FIFO
    /// (mode 0600) and opens both of its ends. Anything already at the path —
    /// a FIFO included, since a shim runs once per attempt — is refused and
    /// left alone.
    pub fn create_input(&self) -> Result<InputFifo, InputError> {
        let path = self.input_path();
        let io = |source: io::Error| InputError::Io { path: path.clone(), source };
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)
            .map_err(|e| io(e.into()))?;
        let opened = (|| {
            // Read-write never blocks on a FIFO (Linux) and makes the shim both a
            // reader and a writer of it for as long as it holds `keeper`.
            let keeper = open_fifo(&path, OpenOptions::new().read(true).write(true), false)?;
            let stdin = open_fifo(&path, OpenOptions::new().read(true), true)?;
            let (k, s) = (keeper.metadata().map_err(io)?, stdin.metadata().map_err(io)?);
            if (k.dev(), k.ino()) != (s.dev(), s.ino()) {
                return Err(InputError::NotAFifo(path.clone()));
            }
            // The task reads with ordinary blocking reads.
            fcntl(stdin.as_raw_fd(), FcntlArg::F_SETFL(OFlag::empty())).map_err(|e| io(e.into()))?;
            Ok(InputFifo { keeper, stdin })
        })();
        // The FIFO made here is not left behind when it cannot be used.
        if opened.is_err() {
            let _ = fs::remove_file(&path);
        }
        opened
    }

    /// For one delivery of input: opens the FIFO write-only without blocking.
    /// Refused when it is absent, when nobody holds it open for reading, or
    /// when anything but a FIFO (a symlink, a file) sits at the path.
    pub fn open_input_for_write(&self) -> Result<File, InputError> {
        open_fifo(&self.input_path(), OpenOptions::new().write(true), true)
    }

    /// For the shim: opens the matched-lines file for appending (created
    /// if absent, never through a symlink).
    pub fn open_matches_for_append(&self) -> io::Result<File> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(self.path(MATCHES))
    }

    /// Matched lines recorded past byte `from` of the matches file, and the
    /// position after the last complete one. A line being written (no newline
    /// yet) is left for the next read; an unreadable line is skipped.
    pub fn read_matches(&self, from: u64, max: usize) -> io::Result<(Vec<MatchedLine>, u64)> {
        use std::io::{BufRead, BufReader, Seek, SeekFrom};
        let file = match File::open(self.path(MATCHES)) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), from)),
            Err(e) => return Err(e),
        };
        let mut reader = BufReader::new(file);
        reader.seek(SeekFrom::Start(from))?;
        let (mut lines, mut pos, mut buf) = (Vec::new(), from, Vec::new());
        while lines.len() < max {
            buf.clear();
            let n = reader.read_until(b'\n', &mut buf)?;
            if n == 0 || buf.last() != Some(&b'\n') {
                break;
            }
            pos += n as u64;
            if let Ok(line) = serde_json::from_slice::<MatchedLine>(&buf) {
                lines.push(line);
            }
        }
        Ok((lines, pos))
    }

    /// Removes the input FIFO once the task's group is gone. Absent is fine;
    /// anything but a FIFO at the path is not ours and is left alone.
    pub fn remove_input(&self) -> io::Result<()> {
        let path = self.input_path();
        match fs::symlink_metadata(&path) {
            Ok(meta) if meta.file_type().is_fifo() => fs::remove_file(&path),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// What an attempt's journal says, each fact as last recorded; a fact not
/// (readably) recorded is `None`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    pub grant: Option<LeaseGrant>,
    pub shim: Option<ProcessId>,
    /// The task's process group (never 0 or 1).
    pub pgid: Option<i32>,
    pub status: Option<ShimStatus>,
}

impl Journal {
    /// The facts of `entries`, each as last recorded.
    fn of(entries: Vec<Entry>) -> Journal {
        let mut journal = Journal::default();
        for entry in entries {
            match entry {
                Entry::Grant(g) => journal.grant = Some(*g),
                Entry::Shim { pid, start_time } => journal.shim = Some(ProcessId { pid, start_time }),
                Entry::Pgid(p) if p > 1 => journal.pgid = Some(p),
                Entry::Pgid(_) => {}
                Entry::Status(s) => journal.status = Some(s),
            }
        }
        journal
    }
}

/// An attempt's journal held open by its shim ([`AttemptFiles::open_for_shim`]):
/// the one writer after the grant, so it keeps the length itself.
#[derive(Debug)]
pub struct ShimJournal {
    file: File,
    len: u64,
    /// The directory whose entry names the journal, synced with the status.
    names_dir: PathBuf,
}

impl ShimJournal {
    pub fn write_shim(&mut self, id: ProcessId) -> io::Result<()> {
        self.append(&Entry::Shim { pid: id.pid, start_time: id.start_time })
    }

    pub fn write_pgid(&mut self, pgid: i32) -> io::Result<()> {
        self.append(&Entry::Pgid(pgid))
    }

    /// Records the exit evidence, durably: the journal's data is synced (the
    /// grant's with it), then the directory that names the journal, so
    /// that a reader finds the status after a power cut even where a new
    /// name is durable only once its directory is synced (strict POSIX,
    /// ext4 without a journal).
    pub fn write_status(&mut self, status: &ShimStatus) -> io::Result<()> {
        self.append(&Entry::Status(status.clone()))?;
        self.file.sync_data()?;
        crate::layout::sync_dir(&self.names_dir)
    }

    fn append(&mut self, entry: &Entry) -> io::Result<()> {
        self.len = write_entry(&mut self.file, self.len, entry)?;
        Ok(())
    }
}

/// Appends one entry to a journal of `before` bytes opened for appending,
/// with a single write; on failure the journal is cut back to `before`, so
/// a torn entry never hides a later one. Returns the journal's new length.
fn write_entry(file: &mut File, before: u64, entry: &Entry) -> io::Result<u64> {
    let payload = tenure_protocol::encode(entry).map_err(io::Error::other)?;
    let len = u32::try_from(payload.len()).map_err(|_| io::Error::other("journal entry too large"))?;
    let mut bytes = Vec::with_capacity(ENTRY_HEADER + payload.len());
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    if let Err(error) = file.write_all(&bytes) {
        let _ = file.set_len(before);
        return Err(error);
    }
    Ok(before + bytes.len() as u64)
}

/// Every complete, intact entry of a journal's bytes, in order, up to the
/// first that is not.
fn parse_entries(bytes: &[u8]) -> Vec<Entry> {
    let mut rest = bytes;
    let mut entries = Vec::new();
    while rest.len() >= ENTRY_HEADER {
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        let Some(payload) = rest.get(ENTRY_HEADER..ENTRY_HEADER + len) else { break };
        if crc32fast::hash(payload) != crc {
            break;
        }
        let Ok(entry) = tenure_protocol::decode(payload) else { break };
        entries.push(entry);
        rest = &rest[ENTRY_HEADER + len..];
    }
    entries
}

/// One fact in an attempt's journal.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Entry {
    /// Boxed: the grant is most of the journal's bytes but one entry of many
    /// (the same on disk).
    Grant(Box<LeaseGrant>),
    /// Named `Monitor` on disk, as journals written before the shim had its
    /// name spell it.
    #[serde(rename = "Monitor")]
    Shim {
        pid: i32,
        start_time: u64,
    },
    Pgid(i32),
    Status(ShimStatus),
}

/// Length and CRC-32 before each journal entry.
const ENTRY_HEADER: usize = 8;
/// File name of an attempt's journal.
const JOURNAL: &str = "journal";
/// The grant's own file, before the journal: an attempt directory of an
/// earlier version has it.
const LEGACY_GRANT: &str = "grant";
/// The input FIFO.
const INPUT: &str = "input";
/// File name of a `monitor` task's matched lines.
const MATCHES: &str = "matches";
/// Present once the leader asked for the attempt to be killed.
const KILL_REQUESTED: &str = "kill-requested";
/// Present while the owner wants the attempt's group held stopped.
const PAUSE_REQUESTED: &str = "pause-requested";
/// Every file an attempt may have, in the order they are removed: the
/// journal last.
const FILES: [&str; 5] = [INPUT, MATCHES, KILL_REQUESTED, PAUSE_REQUESTED, JOURNAL];

/// Every attempt in `attempts_dir` (a machine's `attempts/`), each with its
/// name, `<task>.<attempt>`: each directory (an earlier version's attempt)
/// and each name that has flat files, once. A file whose name ends in none
/// of the attempt files' names is not an attempt's and is left out. An
/// unreadable directory lists nothing.
pub fn list(attempts_dir: &Path) -> Vec<(String, AttemptFiles)> {
    // The listing already says each attempt's shape: no second look at the disk.
    let mut attempts = std::collections::BTreeMap::new();
    for entry in fs::read_dir(attempts_dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let attempt = match entry.file_type().is_ok_and(|t| t.is_dir()) {
            true => Some((name, Shape::Dir)),
            false => FILES
                .iter()
                .find_map(|what| name.strip_suffix(what)?.strip_suffix('.'))
                .map(|name| (name.to_owned(), Shape::Flat)),
        };
        if let Some((name, shape)) = attempt {
            attempts.entry(name).or_insert(shape);
        }
    }
    attempts
        .into_iter()
        .map(|(name, shape)| {
            let base = attempts_dir.join(&name);
            (name, AttemptFiles { base, shape })
        })
        .collect()
}

/// The two ends of an `agent` attempt's input FIFO, as its shim holds them.
#[derive(Debug)]
pub struct InputFifo {
    /// Read-write, held by the shim until the task's group is gone: while it
    /// is open the task never reads end-of-file and writers find a reader.
    pub keeper: File,
    /// Read-only and blocking: becomes the task's stdin. Read-only, so the
    /// task's processes cannot write into their own input.
    pub stdin: File,
}

/// Why an attempt's input FIFO cannot be created or written.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// No FIFO: the task has not been spawned yet, or its group is gone.
    #[error("the task has no input pipe (not started yet, or ended)")]
    Absent,
    /// The FIFO exists but nobody reads it: the task's shim is gone.
    #[error("nobody reads the task's input pipe (its shim is gone)")]
    NoReader,
    /// A symlink or anything else than a FIFO sits at the path; it is refused
    /// and left untouched.
    #[error("{0} is not a FIFO (symlinks and other files are refused)")]
    NotAFifo(PathBuf),
    #[error("input pipe {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Opens the FIFO at `path` with `options` (access mode only) plus
/// `O_NOFOLLOW`, and `O_NONBLOCK` when `nonblock`; then checks that what was
/// opened is a FIFO. Without `O_NONBLOCK` only a read-write open is safe: it is
/// the one open of a FIFO that never waits for the other end.
fn open_fifo(path: &Path, options: &mut OpenOptions, nonblock: bool) -> Result<File, InputError> {
    let mut flags = OFlag::O_NOFOLLOW;
    if nonblock {
        flags |= OFlag::O_NONBLOCK;
    }
    let file = match options.custom_flags(flags.bits()).open(path) {
        Ok(file) => file,
        Err(e) => {
            return Err(match e.raw_os_error().map(Errno::from_raw) {
                Some(Errno::ENOENT) => InputError::Absent,
                Some(Errno::ENXIO) => InputError::NoReader,
                Some(Errno::ELOOP | Errno::EISDIR) => InputError::NotAFifo(path.to_path_buf()),
                _ => InputError::Io { path: path.to_path_buf(), source: e },
            })
        }
    };
    let meta = file.metadata().map_err(|source| InputError::Io { path: path.to_path_buf(), source })?;
    if !meta.file_type().is_fifo() {
        return Err(InputError::NotAFifo(path.to_path_buf()));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure_protocol::Ending;

    fn shell_attempt() -> (tempfile::TempDir, AttemptFiles) {
        let dir = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(dir.path().join("shell-1.1"));
        (dir, files)
    }

    /// An attempt in the directory an earlier version made for it.
    fn earlier_attempt_dir(attempts: &Path, name: &str) -> AttemptFiles {
        std::fs::create_dir(attempts.join(name)).unwrap();
        let files = AttemptFiles::new(attempts.join(name));
        assert_eq!(files.shape, Shape::Dir);
        files
    }

    fn grant() -> LeaseGrant {
        LeaseGrant {
            input: Vec::new(),
            task: "shell-1".parse().unwrap(),
            attempt: tenure_protocol::Attempt(1),
            epoch: tenure_protocol::Epoch(2),
            owner: "o".parse().unwrap(),
            spec: tenure_protocol::TaskSpec::shell("l", "echo hi"),
            mark: None,
        }
    }

    #[test]
    fn files_round_trip_and_absent_means_no_evidence() {
        let (_dir, files) = shell_attempt();
        assert!(files.status().is_none() && files.shim().is_none() && files.pgid().is_none());
        let grant = grant();
        files.write_grant(&grant).unwrap();
        assert_eq!(files.read_grant().unwrap(), grant);
        let me = ProcessId::current().unwrap();
        files.write_shim(me).unwrap();
        assert_eq!(files.shim(), Some(me));
        assert!(me.alive());
        assert!(!ProcessId { start_time: me.start_time + 1, ..me }.alive(), "a recycled pid is not the shim");
        files.write_pgid(4242).unwrap();
        assert_eq!(files.pgid(), Some(4242));
        let status = ShimStatus { outcome: Outcome::new(Ending::Completed, Some(0), None), output_written: 3 };
        files.write_status(&status).unwrap();
        assert_eq!(files.status(), Some(status));
    }

    #[test]
    fn the_shims_journal_held_open_reads_the_grant_and_appends_what_others_read() {
        let (_dir, files) = shell_attempt();
        let grant = grant();
        files.write_grant(&grant).unwrap();
        let (mut journal, facts) = files.open_for_shim().unwrap();
        assert_eq!(facts, Journal { grant: Some(grant.clone()), ..Journal::default() });
        let me = ProcessId::current().unwrap();
        journal.write_shim(me).unwrap();
        journal.write_pgid(4242).unwrap();
        // A reader (the worker) sees each entry as it is appended.
        assert_eq!((files.shim(), files.pgid(), files.status()), (Some(me), Some(4242), None));
        let status = ShimStatus { outcome: Outcome::new(Ending::Failed, Some(3), None), output_written: 0 };
        journal.write_status(&status).unwrap();
        let read = files.journal().unwrap();
        assert_eq!(read, Journal { grant: Some(grant), shim: Some(me), pgid: Some(4242), status: Some(status) });

        // A journal that is not there is made, with no grant in it: the
        // shim records itself and then the failure to find what to run.
        let (_dir, missing) = shell_attempt();
        let (mut journal, facts) = missing.open_for_shim().unwrap();
        assert_eq!(facts, Journal::default());
        journal.write_shim(me).unwrap();
        assert_eq!(missing.journal().unwrap().shim, Some(me));
    }

    #[test]
    fn a_pause_wish_is_recorded_withdrawn_and_repeated_harmlessly() {
        let (dir, files) = shell_attempt();
        assert!(!files.pause_requested());
        files.set_pause_requested(false).unwrap();
        assert!(!files.pause_requested(), "withdrawing an absent wish is nothing");
        files.set_pause_requested(true).unwrap();
        files.set_pause_requested(true).unwrap();
        assert!(files.pause_requested());
        files.set_pause_requested(false).unwrap();
        assert!(!files.pause_requested());
        // A symlink planted at its path is not followed.
        let target = dir.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, files.path(PAUSE_REQUESTED)).unwrap();
        assert!(files.set_pause_requested(true).is_err());
        assert!(!target.exists());
    }

    #[test]
    fn an_attempt_of_the_earlier_one_file_per_fact_layout_is_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let files = earlier_attempt_dir(dir.path(), "shell-1.1");
        assert!(files.read_grant().is_err() && files.shim().is_none());
        let grant = grant();
        let status = ShimStatus { outcome: Outcome::new(Ending::Failed, Some(3), None), output_written: 9 };
        std::fs::write(files.base.join(LEGACY_GRANT), tenure_protocol::encode(&grant).unwrap()).unwrap();
        std::fs::write(files.base.join("monitor.pid"), "4321 99\n").unwrap();
        std::fs::write(files.base.join("pgid"), "4322\n").unwrap();
        assert_eq!(files.read_grant().unwrap(), grant);
        assert_eq!(files.shim(), Some(ProcessId { pid: 4321, start_time: 99 }));
        assert_eq!((files.pgid(), files.status()), (Some(4322), None));
        std::fs::write(files.base.join("status"), tenure_protocol::encode(&status).unwrap()).unwrap();
        assert_eq!(files.status(), Some(status));
    }

    #[test]
    fn a_torn_or_damaged_entry_hides_itself_and_what_follows_never_what_precedes() {
        let (_dir, files) = shell_attempt();
        let me = ProcessId::current().unwrap();
        files.write_shim(me).unwrap();
        files.write_pgid(4242).unwrap();
        let status = ShimStatus { outcome: Outcome::new(Ending::Completed, Some(0), None), output_written: 3 };
        files.write_status(&status).unwrap();
        let whole = std::fs::read(files.journal_path()).unwrap();
        // Every cut of the status entry (a crash mid-write) reads as no status.
        let status_at =
            whole.len() - (ENTRY_HEADER + tenure_protocol::encode(&Entry::Status(status.clone())).unwrap().len());
        for cut in status_at..whole.len() {
            std::fs::write(files.journal_path(), &whole[..cut]).unwrap();
            assert_eq!(files.status(), None, "cut at {cut}");
            assert_eq!((files.shim(), files.pgid()), (Some(me), Some(4242)));
        }
        // A flipped bit in the pgid entry hides it and the status after it.
        let mut flipped = whole.clone();
        flipped[status_at - 1] ^= 0x40;
        std::fs::write(files.journal_path(), &flipped).unwrap();
        assert_eq!((files.shim(), files.pgid(), files.status()), (Some(me), None, None));
        // Garbage is no evidence, and no panic.
        std::fs::write(files.journal_path(), b"\xff\xff\xff\xff\x01garbage").unwrap();
        assert!(files.status().is_none() && files.shim().is_none() && files.read_grant().is_err());
    }

    fn agent_attempt() -> (tempfile::TempDir, AttemptFiles) {
        let tmp = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(tmp.path().join("agent-1.1"));
        (tmp, files)
    }

    #[test]
    fn flat_and_directory_attempts_are_listed_read_and_removed_alike() {
        let tmp = tempfile::tempdir().unwrap();
        let attempts = tmp.path();
        let flat = AttemptFiles::new(attempts.join("shell-1.1"));
        let earlier = earlier_attempt_dir(attempts, "shell-2.1");
        for files in [&flat, &earlier] {
            assert!(!files.exists() || files.shape == Shape::Dir);
            files.write_grant(&grant()).unwrap();
            files.set_pause_requested(true).unwrap();
            files.mark_kill_requested().unwrap();
            files.open_matches_for_append().unwrap().write_all(b"{}\n").unwrap();
            assert!(files.exists() && files.pause_requested() && files.kill_requested());
            assert_eq!(files.read_grant().unwrap(), grant());
        }
        // The flat files sit beside each other, named after the attempt.
        assert!(attempts.join("shell-1.1.journal").is_file() && attempts.join("shell-1.1.pause-requested").is_file());
        assert!(attempts.join("shell-2.1").join("journal").is_file());
        // Neither a stray file nor a file of another kind is an attempt; a stray directory is listed (and kept by
        // its caller, which cannot parse its name).
        std::fs::write(attempts.join("notes.txt"), b"operator's").unwrap();
        std::fs::create_dir(attempts.join("stray")).unwrap();
        let names = |listed: Vec<(String, AttemptFiles)>| listed.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(names(list(attempts)), ["shell-1.1", "shell-2.1", "stray"]);
        let listed = list(attempts);
        assert_eq!(listed[0].1.read_grant().unwrap(), grant());
        assert_eq!(listed[1].1.read_grant().unwrap(), grant());
        // A built-in kind's attempt has no journal, but may have a pause wish.
        let builtin = AttemptFiles::new(attempts.join("sleep-4.1"));
        builtin.set_pause_requested(true).unwrap();
        assert!(!builtin.exists());
        assert_eq!(names(list(attempts)), ["shell-1.1", "shell-2.1", "sleep-4.1", "stray"]);
        for files in [&flat, &earlier, &builtin] {
            files.remove().unwrap();
            files.remove().unwrap();
            assert!(!files.exists() && !files.pause_requested());
        }
        assert_eq!(names(list(attempts)), ["stray"]);
        assert_eq!(std::fs::read(attempts.join("notes.txt")).unwrap(), b"operator's");
    }

    #[test]
    fn an_interrupted_removal_leaves_the_journal_to_be_found_again() {
        let tmp = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(tmp.path().join("monitor-3.2"));
        files.write_grant(&grant()).unwrap();
        files.mark_kill_requested().unwrap();
        // Something the removal cannot take, between the first file and the journal.
        std::fs::create_dir(files.path(MATCHES)).unwrap();
        std::fs::write(files.path(MATCHES).join("inside"), b"").unwrap();
        assert!(files.remove().is_err());
        assert!(files.exists(), "the journal goes last");
        assert!(list(tmp.path()).iter().any(|(name, _)| name == "monitor-3.2"), "so the attempt is found again");
        std::fs::remove_dir_all(files.path(MATCHES)).unwrap();
        files.remove().unwrap();
        assert!(list(tmp.path()).is_empty() && !files.exists());
    }

    #[test]
    fn input_fifo_carries_writes_and_never_reads_eof_while_held() {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let (_tmp, files) = agent_attempt();
        assert!(matches!(files.open_input_for_write(), Err(InputError::Absent)));
        let InputFifo { keeper, mut stdin } = files.create_input().unwrap();
        let meta = std::fs::symlink_metadata(files.input_path()).unwrap();
        assert!(meta.file_type().is_fifo());
        assert_eq!(meta.permissions().mode() & 0o077, 0, "only the owner may use the pipe");
        let mut w = files.open_input_for_write().unwrap();
        w.write_all(b"hello\n").unwrap();
        drop(w);
        let mut buf = [0u8; 16];
        assert_eq!(stdin.read(&mut buf).unwrap(), 6);
        assert_eq!(&buf[..6], b"hello\n");
        // No writer left but the keeper: a read finds no data, not end-of-file.
        fcntl(stdin.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
        assert_eq!(stdin.read(&mut buf).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        // A second shim for the same attempt is refused.
        assert!(matches!(files.create_input(), Err(InputError::Io { .. })));
        // Once the shim lets go, a writer finds no reader instead of blocking.
        drop((keeper, stdin));
        assert!(matches!(files.open_input_for_write(), Err(InputError::NoReader)));
        files.remove_input().unwrap();
        files.remove_input().unwrap();
        assert!(matches!(files.open_input_for_write(), Err(InputError::Absent)));
    }

    #[test]
    fn a_symlink_at_the_input_path_is_refused_and_its_target_untouched() {
        let (tmp, files) = agent_attempt();
        // A link to a live FIFO (a writer would otherwise reach it) ...
        let real = tmp.path().join("real-fifo");
        nix::unistd::mkfifo(&real, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let _reader = OpenOptions::new().read(true).write(true).open(&real).unwrap();
        std::os::unix::fs::symlink(&real, files.input_path()).unwrap();
        assert!(matches!(files.open_input_for_write(), Err(InputError::NotAFifo(_))));
        assert!(files.create_input().is_err(), "the shim does not create through a link");
        files.remove_input().unwrap();
        assert!(std::fs::symlink_metadata(files.input_path()).is_ok(), "a link is not ours to remove");
        // ... and a link to a regular file.
        std::fs::remove_file(files.input_path()).unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, files.input_path()).unwrap();
        assert!(matches!(files.open_input_for_write(), Err(InputError::NotAFifo(_))));
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    }

    #[test]
    fn a_non_fifo_at_the_input_path_is_refused_and_left_alone() {
        let (_tmp, files) = agent_attempt();
        std::fs::write(files.input_path(), b"plain file").unwrap();
        assert!(matches!(files.open_input_for_write(), Err(InputError::NotAFifo(_))));
        assert!(files.create_input().is_err());
        files.remove_input().unwrap();
        assert_eq!(std::fs::read(files.input_path()).unwrap(), b"plain file");
        std::fs::remove_file(files.input_path()).unwrap();
        std::fs::create_dir(files.input_path()).unwrap();
        assert!(matches!(files.open_input_for_write(), Err(InputError::NotAFifo(_))));
        files.remove_input().unwrap();
        assert!(files.input_path().is_dir());
    }
}
