//! A real database on the mount: sled in a child process is killed mid-work, the power is cut,
//! and the database must reopen with every key it had flushed.
//!
//! The child is this same test binary running the ignored `sled_child_workload` test, so the
//! database lives in another process that can be SIGKILLed exactly like a crashed daemon.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use common::Rig;

const CHILD_DIR: &str = "POWERFS_SLED_CHILD_DIR";
const CHILD_ROUND: &str = "POWERFS_SLED_CHILD_ROUND";
const CHILD_FLUSH_EVERY: &str = "POWERFS_SLED_CHILD_FLUSH_EVERY_MS";
const KEYS: u32 = 200;

fn open(path: &Path, flush_every_ms: Option<u64>) -> sled::Result<sled::Db> {
    sled::Config::new().path(path).flush_every_ms(flush_every_ms).open()
}

fn key(kind: &str, round: u32, i: u32) -> String {
    format!("{kind}-{round}-{i:04}")
}

/// Kills the child on every exit path, so a failing assertion never leaves it running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
#[ignore = "run as a child process by the tests below"]
fn sled_child_workload() -> Result<()> {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        // Run directly (e.g. with --include-ignored): it is only a child's body, nothing to do.
        return Ok(());
    };
    let round: u32 = std::env::var(CHILD_ROUND)?.parse()?;
    let flush_every: Option<u64> = std::env::var(CHILD_FLUSH_EVERY).ok().and_then(|v| v.parse().ok());
    let db = open(Path::new(&dir), flush_every)?;
    for i in 0..KEYS {
        db.insert(key("flushed", round, i), vec![b'v'; 100 + i as usize])?;
    }
    db.flush()?;
    if let Some(ms) = flush_every {
        // Let the periodic flusher run (it is the only caller of fsync on the log).
        std::thread::sleep(Duration::from_millis(3 * ms));
    }
    println!("FLUSHED");
    for i in 0..KEYS {
        db.insert(key("unflushed", round, i), vec![b'u'; 100])?;
    }
    println!("INSERTED");
    std::thread::sleep(Duration::from_secs(120));
    bail!("the parent should have killed this process")
}

fn run_child(db_dir: &Path, round: u32, flush_every: Option<u64>) -> Result<()> {
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .args(["--exact", "sled_child_workload", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, db_dir)
        .env(CHILD_ROUND, round.to_string())
        .env(CHILD_FLUSH_EVERY, flush_every.map(|m| m.to_string()).unwrap_or_default())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().context("child stdout")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if line.trim() == "INSERTED" {
            break;
        }
        if Instant::now() > deadline {
            bail!("child did not reach INSERTED in time");
        }
    }
    // Crash the process first, then the machine.
    child.0.kill()?;
    child.0.wait()?;
    Ok(())
}

/// Runs `rounds` of child workload, kill, cut, reopen; returns how many flushed keys of each
/// round were found after its cut.
fn rounds(journaled: bool, flush_every: Option<u64>, rounds: u32) -> Result<Vec<usize>> {
    let mut rig = Rig::with(tenure_powerfs::Options { journaled_metadata: journaled })?;
    let db_dir = rig.path("sled");
    let mut found = Vec::new();
    for round in 0..rounds {
        run_child(&db_dir, round, flush_every)?;
        rig.cut()?;
        let db = open(&db_dir, None).with_context(|| format!("reopening sled after cut {round}"))?;
        let flushed = (0..KEYS)
            .filter(|&i| db.get(key("flushed", round, i)).ok().flatten().is_some_and(|v| v.len() == 100 + i as usize))
            .count();
        let unflushed = (0..KEYS).filter(|&i| matches!(db.get(key("unflushed", round, i)), Ok(Some(_)))).count();
        eprintln!("journaled={journaled} flush_every={flush_every:?} round {round}: {flushed}/{KEYS} flushed, {unflushed}/{KEYS} unflushed keys found");
        found.push(flushed);
        drop(db);
    }
    Ok(found)
}

#[test]
fn sled_flushed_keys_survive_kill_and_cut_once_sled_has_fsynced() -> Result<()> {
    // Journaled metadata (as on ext4) and sled's periodic flusher, which is what calls fsync.
    let found = rounds(true, Some(100), 3)?;
    assert_eq!(found, vec![KEYS as usize; 3], "every flushed key of every round is back after its cut");
    Ok(())
}

/// sled 0.34's `flush()` ends in `sync_file_range` on Linux, which is not a sync: it never
/// reaches the filesystem, and gives no power-loss guarantee on a real disk either (no metadata,
/// no cache flush). Only its periodic flusher calls fsync. Should a sled upgrade make `flush()`
/// durable, this test fails and should become a survival test.
#[test]
fn sled_flush_alone_is_not_a_sync() -> Result<()> {
    let found = rounds(true, None, 1)?;
    assert_eq!(found, vec![0], "flushed keys survived without any fsync from sled");
    Ok(())
}

/// sled never fsyncs a directory, so under strict rules its files' entries are never durable.
#[test]
fn sled_files_are_lost_under_strict_rules_because_sled_never_syncs_a_directory() -> Result<()> {
    let found = rounds(false, Some(100), 1)?;
    assert_eq!(found, vec![0], "sled's files survived though no directory was synced");
    Ok(())
}
