//! Disks that can lose power: each worker machine's data directory and
//! nats-server's store directory are mounts of the test-only power-loss
//! filesystem (`tenure-powerfs`, one process per disk), so a `power-loss`
//! fault drops everything that was not synced, as a machine that lost power
//! would find it on reboot — not only what a process kill loses.
//!
//! This module starts, cuts and stops those filesystem processes, each by its
//! own pid; it never touches the nodes that use the disks (the caller kills
//! them first: a power cut takes every process of the machine).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Whether this harness can mount power-loss filesystems (root and
/// `/dev/fuse`), and the filesystem's binary.
#[derive(Debug, Clone)]
pub enum Mode {
    /// Data directories are mounts of this binary.
    On(PathBuf),
    /// Plain directories: `power-loss` faults are skipped.
    Off(String),
}

impl Mode {
    /// Looks for `tenure-powerfs` beside `tenure`, and for what mounting needs.
    pub fn detect(tenure: &Path) -> Mode {
        if !nix::unistd::geteuid().is_root() {
            return Mode::Off("not root: FUSE mounts need it here".into());
        }
        if !Path::new("/dev/fuse").exists() {
            return Mode::Off("no /dev/fuse".into());
        }
        match tenure.parent().map(|d| d.join("tenure-powerfs")).filter(|p| p.is_file()) {
            Some(bin) => Mode::On(bin),
            None => Mode::Off("no tenure-powerfs binary beside tenure (cargo build -p tenure-powerfs)".into()),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Mode::On(_) => "data directories and the NATS store on power-loss filesystems".into(),
            Mode::Off(why) => format!("plain directories, power-loss faults skipped ({why})"),
        }
    }
}

/// One disk: a backing directory, served at a mountpoint by its own process.
pub struct Disk {
    bin: PathBuf,
    backing: PathBuf,
    pub mountpoint: PathBuf,
    /// ext4-like rules (metadata durable at the next sync of anything)
    /// instead of strict POSIX ones (a new file needs its directory synced).
    journaled: bool,
    child: Option<Child>,
}

/// How long a mount may take to come up, or a cut to finish.
const BOUND: Duration = Duration::from_secs(20);

impl Disk {
    /// Mounts a new disk (empty, or whatever `backing` holds durably).
    pub fn mount(bin: &Path, backing: &Path, mountpoint: &Path, journaled: bool) -> anyhow::Result<Disk> {
        let mut disk = Disk {
            bin: bin.to_path_buf(),
            backing: backing.into(),
            mountpoint: mountpoint.into(),
            journaled,
            child: None,
        };
        disk.start()?;
        Ok(disk)
    }

    fn start(&mut self) -> anyhow::Result<()> {
        let mut child = Command::new(&self.bin)
            .arg("mount")
            .arg("--backing")
            .arg(&self.backing)
            .arg("--mountpoint")
            .arg(&self.mountpoint)
            .args(self.journaled.then_some("--journaled-metadata"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let stdout = child.stdout.take().context("the filesystem's stdout")?;
        // The first line says the mount is live; read it on a thread so a
        // filesystem that never says it cannot hang the harness.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        self.child = Some(child);
        match rx.recv_timeout(BOUND) {
            Ok(line) if line.trim() == "ready" => Ok(()),
            Ok(line) => bail!("{} did not mount: {line:?}", self.mountpoint.display()),
            Err(_) => bail!("{} did not mount within {BOUND:?}", self.mountpoint.display()),
        }
    }

    fn signal_and_wait(&mut self, signal: Signal) -> bool {
        let Some(mut child) = self.child.take() else { return true };
        let _ = kill(Pid::from_raw(child.id() as i32), signal);
        let deadline = Instant::now() + BOUND;
        while Instant::now() < deadline {
            if !matches!(child.try_wait(), Ok(None)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        let _ = Command::new(&self.bin).arg("unmount").arg("--mountpoint").arg(&self.mountpoint).status();
        false
    }

    /// Cuts the power: everything not synced is gone; then the disk comes
    /// back with what was durable (the machine's reboot). The processes
    /// using it must have been killed first.
    pub fn power_cycle(&mut self) -> anyhow::Result<()> {
        if !self.signal_and_wait(Signal::SIGUSR1) {
            bail!("the power cut of {} did not finish; the mount was detached", self.mountpoint.display());
        }
        self.start()
    }

    /// A clean shutdown: everything becomes durable, the mount goes away.
    pub fn unmount(&mut self) {
        self.signal_and_wait(Signal::SIGTERM);
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Makes a tree the harness wrote (a restored registry) durable, as an
/// operator's copy followed by `sync` would be: every file and directory in
/// it, and the directory holding it.
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            sync_tree(&entry.path())?;
        } else {
            std::fs::File::open(entry.path())?.sync_all()?;
        }
    }
    std::fs::File::open(dir)?.sync_all()?;
    if let Some(parent) = dir.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// Empties a directory that may be a mountpoint (which itself cannot be
/// removed), durably: a wiped disk stays wiped across a later power cut.
pub fn wipe(dir: &Path) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() && !path.is_symlink() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    std::fs::File::open(dir)?.sync_all()
}
