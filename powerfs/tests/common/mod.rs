//! Shared rig for the powerfs tests: a mount in its own temporary directory, reboots on demand,
//! and small file helpers that make each sync explicit.
//!
//! The rig never leaves a mount behind: the [`Mounted`] it holds is dropped (clean unmount)
//! before the temporary directory, even when an assertion fails.

#![allow(dead_code)]

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tenure_powerfs::{CutOptions, CutReport, Mounted, Options, PowerFs};

pub struct Rig {
    // Declared first so it is dropped (unmounted) before the directory below is removed.
    mounted: Option<Mounted>,
    options: Options,
    pub backing: PathBuf,
    pub mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Rig {
    pub fn new() -> Result<Rig> {
        Rig::with(Options::default())
    }

    pub fn with(options: Options) -> Result<Rig> {
        let dir = tempfile::tempdir()?;
        let backing = dir.path().join("backing");
        let mnt = dir.path().join("mnt");
        let mounted = PowerFs::mount(&backing, &mnt, options)?;
        Ok(Rig { mounted: Some(mounted), options, backing, mnt, _dir: dir })
    }

    /// A path on the mount.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// Cuts the power and boots again.
    pub fn cut(&mut self) -> Result<CutReport> {
        self.cut_with(CutOptions::default())
    }

    pub fn cut_with(&mut self, options: CutOptions) -> Result<CutReport> {
        let mounted = self.mounted.take().context("not mounted")?;
        let report = mounted.cut(options)?;
        self.mounted = Some(PowerFs::mount(&self.backing, &self.mnt, self.options)?);
        Ok(report)
    }

    /// Shuts down cleanly and boots again.
    pub fn reboot_clean(&mut self) -> Result<()> {
        let mounted = self.mounted.take().context("not mounted")?;
        mounted.unmount()?;
        self.mounted = Some(PowerFs::mount(&self.backing, &self.mnt, self.options)?);
        Ok(())
    }
}

/// Writes `data` to a new (or truncated) file, with `fsync` of the file if `sync`.
pub fn write_file(path: &Path, data: &[u8], sync: bool) -> Result<()> {
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(data)?;
    if sync {
        f.sync_all()?;
    }
    Ok(())
}

/// Appends `data`, with `fsync` if `sync`.
pub fn append(path: &Path, data: &[u8], sync: bool) -> Result<()> {
    let mut f = OpenOptions::new().append(true).open(path)?;
    f.write_all(data)?;
    if sync {
        f.sync_data()?;
    }
    Ok(())
}

/// `fsync` of a file that already exists.
pub fn fsync(path: &Path) -> Result<()> {
    File::open(path)?.sync_all()?;
    Ok(())
}

/// `fsync` of a directory.
pub fn fsync_dir(path: &Path) -> Result<()> {
    File::open(path).with_context(|| format!("opening {}", path.display()))?.sync_all()?;
    Ok(())
}

/// The file's content, or `None` if it does not exist.
pub fn read(path: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Sorted names in a directory.
pub fn names(dir: &Path) -> Result<Vec<String>> {
    let mut v: Vec<String> =
        fs::read_dir(dir)?.map(|e| Ok(e?.file_name().to_string_lossy().into_owned())).collect::<Result<_>>()?;
    v.sort();
    Ok(v)
}
