//! Power loss under the sidecar's durable writes: each write the sidecar (or
//! the worker, through this crate's files) acknowledges is made in a child
//! process on a filesystem that keeps only what was synced; the child is
//! SIGKILLed, the power cut, and what was acknowledged must be there after the
//! reboot.
//!
//! The child is this same test binary running the ignored `child` test with
//! the scenario's name in its environment: a crashed daemon and a lost machine
//! leave exactly what the filesystem made durable, nothing of the process.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tenure_machine::attempt_files::{Journal, ShimStatus};
use tenure_machine::evidence::FileFacts;
use tenure_machine::Layout;
use tenure_powerfs::{CutOptions, Mounted, Options, PowerFs};
use tenure_protocol::messages::{AttemptRecord, LeaseGrant, Phase, RegistryMark, SidecarRefusal};
use tenure_protocol::messages::{SidecarReply, SidecarRequest};
use tenure_protocol::{Attempt, Ending, Epoch, Outcome, TaskId, TaskSpec};
use tenure_sidecar::{Machine, RecoveryStore, SledStore};

const SCENARIO: &str = "TENURE_POWER_LOSS_SCENARIO";
const DATA: &str = "TENURE_POWER_LOSS_DATA";
/// Printed by the child once every write of its scenario was acknowledged.
const DONE: &str = "ACKNOWLEDGED";
/// A command long enough that sled keeps the record in a blob file of its own.
const BLOB_COMMAND_BYTES: usize = 300 * 1024;

/// A powerfs mount that can be cut and booted again; unmounted cleanly on drop.
struct Rig {
    mounted: Option<Mounted>,
    options: Options,
    backing: PathBuf,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Rig {
    fn new(options: Options) -> Result<Rig> {
        let dir = tempfile::tempdir()?;
        let (backing, mnt) = (dir.path().join("backing"), dir.path().join("mnt"));
        let mounted = PowerFs::mount(&backing, &mnt, options)?;
        Ok(Rig { mounted: Some(mounted), options, backing, mnt, _dir: dir })
    }

    /// The machine's data directory: one level below the mount's root, as a
    /// real one would be (its own entry must be made durable too).
    fn data(&self) -> PathBuf {
        self.mnt.join("var").join("data")
    }

    fn cut(&mut self) -> Result<()> {
        let mounted = self.mounted.take().context("not mounted")?;
        mounted.cut(CutOptions::default())?;
        self.mounted = Some(PowerFs::mount(&self.backing, &self.mnt, self.options)?);
        Ok(())
    }
}

/// Kills the child on every exit path.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `scenario` in a child on `data`, waits for its acknowledgements, then
/// SIGKILLs it (the crash) before the caller cuts the power.
fn run_child(scenario: &str, data: &Path) -> Result<()> {
    let child = Command::new(std::env::current_exe()?)
        .args(["--exact", "child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env(DATA, data)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().context("child stdout")?;
    let mut acknowledged = false;
    for line in BufReader::new(stdout).lines() {
        // The harness prints `test child ... ` before the line, without a newline.
        if line?.trim_end().ends_with(DONE) {
            acknowledged = true;
            break;
        }
    }
    if !acknowledged {
        bail!("the {scenario} child ended before acknowledging its writes");
    }
    child.0.kill()?;
    child.0.wait()?;
    Ok(())
}

fn task(n: u32) -> TaskId {
    format!("shell-{n}").parse().expect("a valid task id")
}

fn grant(n: u32, epoch: u64, command: String) -> LeaseGrant {
    LeaseGrant {
        input: Vec::new(),
        task: task(n),
        attempt: Attempt(1),
        epoch: Epoch(epoch),
        owner: "alice".parse().expect("a valid owner"),
        spec: TaskSpec::shell("power", command),
        mark: Some(RegistryMark { last_seq: 10 + u64::from(n), highest_task: u64::from(n), epoch: Epoch(epoch) }),
    }
}

fn record(n: u32, phase: Phase, command: String) -> AttemptRecord {
    AttemptRecord {
        grant: grant(n, 3, command),
        phase,
        pid: (phase >= Phase::Spawned).then_some(4242),
        outcome: (phase >= Phase::Exited).then(|| Outcome::new(Ending::Completed, Some(0), None)),
        boot: None,
    }
}

fn big_command() -> String {
    format!("echo {}", "x".repeat(BLOB_COMMAND_BYTES))
}

/// Opens the store after a reboot. A SIGKILLed holder's lock is gone with
/// its process, so one open is enough; the retry only covers a slow release.
fn reopen(layout: &Layout) -> Result<SledStore> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match SledStore::open(&layout.db_dir()) {
            Ok(store) => return Ok(store),
            Err(e) if Instant::now() < deadline && e.to_string().contains("could not acquire lock") => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => return Err(e).context("reopening the store after the cut"),
        }
    }
}

#[test]
#[ignore = "run as a child process by the tests below"]
fn child() -> Result<()> {
    let (Ok(scenario), Ok(data)) = (std::env::var(SCENARIO), std::env::var(DATA)) else {
        // Run directly (e.g. with --include-ignored): only a child's body, nothing to do.
        return Ok(());
    };
    let layout = Layout::new(PathBuf::from(data));
    layout.create_dirs()?;
    match scenario.as_str() {
        "store" => {
            let mut store = SledStore::open(&layout.db_dir())?;
            store.put_epoch(Epoch(7))?;
            store.put(&record(1, Phase::Accepted, "echo one".into()))?;
            store.put(&record(2, Phase::Exited, big_command()))?;
            store.put(&record(3, Phase::Intent, "echo three".into()))?;
            store.remove(&task(3), Attempt(1))?;
            store.put_revoked(&task(4), Attempt(2))?;
            store.put_mark(RegistryMark { last_seq: 99, highest_task: 40, epoch: Epoch(6) })?;
            // Group commit: two writes, one flush, as the sidecar's loop does.
            store.defer_flush(true);
            store.put(&record(5, Phase::Spawned, "echo five".into()))?;
            store.put(&record(6, Phase::Intent, big_command()))?;
            store.defer_flush(false);
            store.flush()?;
        }
        "machine" => {
            let mut machine = Machine::restore(SledStore::open(&layout.db_dir())?)?;
            let ok = |reply: SidecarReply| -> Result<()> {
                match reply {
                    SidecarReply::Ok => Ok(()),
                    other => bail!("refused: {other:?}"),
                }
            };
            ok(machine.handle(SidecarRequest::ObserveEpoch(Epoch(5))))?;
            ok(machine.handle(SidecarRequest::Accept(grant(1, 5, "echo one".into()))))?;
            ok(machine.handle(SidecarRequest::Intent {
                task: task(1),
                attempt: Attempt(1),
                epoch: Epoch(5),
                trace: None,
            }))?;
            // The same through group commit, as the sidecar's loop answers.
            machine.store_mut().defer_flush(true);
            ok(machine.handle(SidecarRequest::Accept(grant(2, 5, "echo two".into()))))?;
            ok(machine.handle(SidecarRequest::Intent {
                task: task(2),
                attempt: Attempt(1),
                epoch: Epoch(5),
                trace: None,
            }))?;
            machine.store_mut().defer_flush(false);
            machine.store().flush()?;
        }
        "files" => {
            // shell-1 ends; shell-2 was granted before that end, shell-3
            // after it: neither has a status, so neither journal was synced.
            let files = layout.attempt_files(&task(1), Attempt(1));
            files.write_grant(&grant(1, 5, "echo one".into()))?;
            layout.attempt_files(&task(2), Attempt(1)).write_grant(&grant(2, 5, "echo two".into()))?;
            files.write_status(&ShimStatus {
                outcome: Outcome::new(Ending::Completed, Some(0), None),
                output_written: 12,
            })?;
            layout.attempt_files(&task(3), Attempt(1)).write_grant(&grant(3, 5, "echo three".into()))?;
            layout.record_scratch_root(Path::new("/srv/scratch"))?;
        }
        other => bail!("unknown scenario {other}"),
    }
    println!("{DONE}");
    std::thread::sleep(Duration::from_secs(600));
    bail!("the parent should have killed this process")
}

fn sorted(mut records: Vec<AttemptRecord>) -> Vec<AttemptRecord> {
    records.sort_by(|a, b| (&a.grant.task, a.grant.attempt).cmp(&(&b.grant.task, b.grant.attempt)));
    records
}

fn store_writes_survive(options: Options) -> Result<()> {
    let mut rig = Rig::new(options)?;
    let layout = Layout::new(rig.data());
    run_child("store", layout.root())?;
    rig.cut()?;
    let store = reopen(&layout)?;
    let loaded = store.load()?;
    assert_eq!(loaded.epoch, Epoch(7), "the acknowledged epoch is back");
    assert_eq!(
        sorted(loaded.records),
        vec![
            record(1, Phase::Accepted, "echo one".into()),
            record(2, Phase::Exited, big_command()),
            record(5, Phase::Spawned, "echo five".into()),
            record(6, Phase::Intent, big_command()),
        ],
        "every acknowledged record (blob-sized ones too) is back, the removed one is not"
    );
    assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
    assert_eq!(loaded.revoked, vec![(task(4), Attempt(2))], "the revoke tombstone is back");
    assert_eq!(loaded.mark, Some(RegistryMark { last_seq: 99, highest_task: 40, epoch: Epoch(6) }));
    let mirror = std::fs::read_to_string(layout.root().join("sidecar-db.epoch")).context("the epoch mirror")?;
    assert_eq!(mirror.trim(), "7", "the epoch mirror is back");
    Ok(())
}

/// Every write `SledStore` acknowledged (epoch, records inline and in sled's
/// blob files, a removal, a revoke tombstone, the registry mark, a group
/// commit) is there after a kill and a power cut under strict POSIX rules.
#[test]
fn acknowledged_store_writes_survive_a_power_cut() -> Result<()> {
    store_writes_survive(Options { journaled_metadata: false })
}

/// The same on a filesystem that orders metadata (like ext4).
#[test]
fn acknowledged_store_writes_survive_a_power_cut_with_journaled_metadata() -> Result<()> {
    store_writes_survive(Options { journaled_metadata: true })
}

/// The sidecar's decision logic over the real store: an accepted grant and
/// its intent, acknowledged, are there after the cut, and the machine's
/// epoch fence did not go back (a lower epoch is refused).
#[test]
fn an_acknowledged_intent_and_the_epoch_fence_survive_a_power_cut() -> Result<()> {
    let mut rig = Rig::new(Options::default())?;
    let layout = Layout::new(rig.data());
    run_child("machine", layout.root())?;
    rig.cut()?;
    let mut machine = Machine::restore(reopen(&layout)?)?;
    assert_eq!(machine.epoch(), Epoch(5));
    for n in [1, 2] {
        let r = machine.record(&task(n), Attempt(1)).with_context(|| format!("the record of shell-{n}"))?;
        assert_eq!(r.phase, Phase::Intent, "shell-{n}: the acknowledged intent is back");
    }
    assert_eq!(
        machine.handle(SidecarRequest::Accept(grant(9, 4, "echo stale".into()))),
        SidecarReply::Refused(SidecarRefusal::StaleEpoch { held: Epoch(5), offered: Epoch(4) }),
        "a deposed epoch is refused after the cut"
    );
    // An attempt whose intent is recorded is never given back.
    assert!(matches!(
        machine.handle(SidecarRequest::Abandon { task: task(1), attempt: Attempt(1) }),
        SidecarReply::Refused(SidecarRefusal::WrongPhase { .. })
    ));
    Ok(())
}

/// The attempt journal's grant and exit status, and the recorded scratch
/// root, are there after the cut: the status synced the journal (the grant
/// with it) and then the directory naming it (durability note a21), and
/// every directory above them on the way to the data directory was synced.
#[test]
fn attempt_files_and_the_scratch_record_survive_a_power_cut() -> Result<()> {
    let mut rig = Rig::new(Options::default())?;
    let layout = Layout::new(rig.data());
    run_child("files", layout.root())?;
    rig.cut()?;
    let files = layout.attempt_files(&task(1), Attempt(1));
    let journal = files.journal().context("the attempt's journal after the cut")?;
    assert_eq!(journal.grant, Some(grant(1, 5, "echo one".into())));
    let status = journal.status.context("the exit status after the cut")?;
    assert_eq!(status.outcome, Outcome::new(Ending::Completed, Some(0), None));
    assert_eq!(Layout::new(layout.root()).scratch_root(), Some(PathBuf::from("/srv/scratch")));
    Ok(())
}

/// A grant is written without a sync (durability note a21): cut before its
/// attempt's status, the journal is gone, or named with nothing readable
/// in it (the directory was synced by another attempt's status, the
/// journal's data was not), and read as no grant and no status — never a
/// part of one, never another attempt's fact.
#[test]
fn a_grant_cut_before_its_status_is_there_whole_or_not_at_all() -> Result<()> {
    let mut rig = Rig::new(Options::default())?;
    let layout = Layout::new(rig.data());
    run_child("files", layout.root())?;
    rig.cut()?;
    let named = layout.attempt_files(&task(2), Attempt(1));
    assert!(named.exists(), "shell-2's journal was named when shell-1's status synced the directory");
    assert_eq!(named.journal()?, Journal::default(), "a journal whose data was not synced reads as no facts");
    let unnamed = layout.attempt_files(&task(3), Attempt(1));
    assert!(!unnamed.exists(), "shell-3's journal was created after the last sync of its directory");
    assert_eq!(unnamed.journal().map_err(|e| e.kind()), Err(std::io::ErrorKind::NotFound));
    assert_eq!((FileFacts::read(&named), FileFacts::read(&unnamed)), (FileFacts::default(), FileFacts::default()));
    Ok(())
}
