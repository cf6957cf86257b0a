//! The `tenure-powerfs` binary as a harness drives it: wait for `ready`, cut with SIGUSR1 (or
//! the `cut` subcommand), shut down with SIGTERM, survive being SIGKILLed.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use common::{fsync_dir, read, write_file};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const BIN: &str = env!("CARGO_BIN_EXE_tenure-powerfs");

/// A running server; killed and its mount detached on drop, whatever the test did.
struct Server {
    child: Child,
    mountpoint: PathBuf,
}

impl Server {
    fn start(backing: &Path, mountpoint: &Path, extra: &[&str]) -> Result<Server> {
        let mut child = Command::new(BIN)
            .arg("mount")
            .arg("--backing")
            .arg(backing)
            .arg("--mountpoint")
            .arg(mountpoint)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().context("server stdout")?;
        let server = Server { child, mountpoint: mountpoint.to_path_buf() };
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            bail!("server said {line:?} instead of ready");
        }
        Ok(server)
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX))
    }

    fn signal(&self, signal: Signal) -> Result<()> {
        kill(self.pid(), signal)?;
        Ok(())
    }

    /// Waits (bounded) for the server to exit.
    fn wait(&mut self) -> Result<ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("server did not exit");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = tenure_powerfs::unmount_stale(&self.mountpoint);
    }
}

fn fuse_mounted(mountpoint: &Path) -> Result<bool> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let wanted = mountpoint.to_string_lossy();
    Ok(info.lines().any(|l| l.split(' ').nth(4) == Some(wanted.as_ref()) && l.contains(" - fuse")))
}

#[test]
fn sigkilled_server_remounts_with_a_consistent_durable_image() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (backing, mnt) = (dir.path().join("b"), dir.path().join("m"));
    let mut server = Server::start(&backing, &mnt, &[])?;
    write_file(&mnt.join("synced"), b"kept", true)?;
    fsync_dir(&mnt)?;
    write_file(&mnt.join("synced"), b"overwritten, never synced", false)?;
    write_file(&mnt.join("unsynced"), b"lost", true)?;
    server.signal(Signal::SIGKILL)?;
    server.wait()?;
    assert!(std::fs::metadata(mnt.join("synced")).is_err(), "a killed server's mount no longer answers");
    assert!(fuse_mounted(&mnt)?, "the kernel mount lingers after SIGKILL");
    // `mount` clears the stale mount itself.
    let mut server = Server::start(&backing, &mnt, &[])?;
    assert_eq!(read(&mnt.join("synced"))?.as_deref(), Some(&b"kept"[..]));
    assert_eq!(read(&mnt.join("unsynced"))?, None);
    server.signal(Signal::SIGTERM)?;
    assert!(server.wait()?.success());
    assert!(!fuse_mounted(&mnt)?, "SIGTERM unmounts");
    Ok(())
}

#[test]
fn sigusr1_cuts_with_a_torn_write_and_sigterm_unmounts_cleanly() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (backing, mnt) = (dir.path().join("b"), dir.path().join("m"));
    let mut server = Server::start(&backing, &mnt, &["--torn-bytes", "3"])?;
    write_file(&mnt.join("f"), b"aaaaaa", true)?;
    fsync_dir(&mnt)?;
    let f = std::fs::OpenOptions::new().write(true).open(mnt.join("f"))?;
    std::os::unix::fs::FileExt::write_all_at(&f, b"bbbbbb", 0)?;
    drop(f);
    let cut = Command::new(BIN).args(["cut", "--pid", &server.child.id().to_string()]).status()?;
    assert!(cut.success());
    assert!(server.wait()?.success(), "a cut is a normal exit");
    assert!(!fuse_mounted(&mnt)?, "a cut leaves no mount behind");
    let mut server = Server::start(&backing, &mnt, &["--journaled-metadata"])?;
    assert_eq!(read(&mnt.join("f"))?.as_deref(), Some(&b"bbbaaa"[..]));
    write_file(&mnt.join("clean"), b"made durable by the shutdown", false)?;
    server.signal(Signal::SIGTERM)?;
    assert!(server.wait()?.success());
    let _server = Server::start(&backing, &mnt, &[])?;
    assert_eq!(read(&mnt.join("clean"))?.as_deref(), Some(&b"made durable by the shutdown"[..]));
    Ok(())
}

#[test]
fn unmount_subcommand_detaches_a_killed_servers_mount() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (backing, mnt) = (dir.path().join("b"), dir.path().join("m"));
    let mut server = Server::start(&backing, &mnt, &[])?;
    server.signal(Signal::SIGKILL)?;
    server.wait()?;
    assert!(fuse_mounted(&mnt)?);
    let status = Command::new(BIN).arg("unmount").arg("--mountpoint").arg(&mnt).status()?;
    assert!(status.success());
    assert!(!fuse_mounted(&mnt)?);
    Ok(())
}

#[test]
fn journaled_metadata_flag_reaches_the_filesystem() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (backing, mnt) = (dir.path().join("b"), dir.path().join("m"));
    for journaled in [false, true] {
        let args: &[&str] = if journaled { &["--journaled-metadata"] } else { &[] };
        let mut server = Server::start(&backing, &mnt, args)?;
        let name = format!("created-{journaled}");
        write_file(&mnt.join(&name), b"", false)?;
        write_file(&mnt.join(format!("unrelated-{journaled}")), b"", true)?;
        server.signal(Signal::SIGUSR1)?;
        assert!(server.wait()?.success());
        let mut server = Server::start(&backing, &mnt, &[])?;
        assert_eq!(read(&mnt.join(&name))?.is_some(), journaled, "{name} after the cut");
        server.signal(Signal::SIGTERM)?;
        server.wait()?;
    }
    Ok(())
}
