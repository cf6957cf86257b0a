//! Mounting and unmounting: the handle a test (or the binary) holds while the filesystem is
//! served.
//!
//! Owns the kernel mount's lifetime: clearing a stale mount left by a killed process, serving on
//! a background thread, and the two ways to stop (a clean unmount that syncs everything, a cut
//! that syncs nothing). It must never leave a mount behind when a [`Mounted`] is dropped, and
//! never blocks forever on processes that still hold files open on the mount.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fuser::{BackgroundSession, MountOption, SessionACL};
use nix::mount::{umount2, MntFlags};

use crate::engine::Engine;
use crate::fs::PowerFsHandler;
use crate::{CutOptions, CutReport, Error, Options};

/// How long a stop waits for the serving thread before giving up on it.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Entry point of the library API.
#[derive(Debug)]
pub struct PowerFs;

impl PowerFs {
    /// Boots the backing directory (discarding everything that was not durable) and mounts it
    /// at `mountpoint`, creating both directories if needed. A stale mount at `mountpoint`
    /// (left by a killed process) is detached first. Returns once the mount is live.
    pub fn mount(backing: &Path, mountpoint: &Path, options: Options) -> Result<Mounted, Error> {
        let mountpoint = resolve(mountpoint)?;
        unmount_stale(&mountpoint)?;
        fs::create_dir_all(backing)
            .map_err(|source| Error::Io { context: format!("creating {}", backing.display()), source })?;
        fs::create_dir_all(&mountpoint)
            .map_err(|source| Error::Io { context: format!("creating {}", mountpoint.display()), source })?;
        let engine = Arc::new(Mutex::new(Engine::boot(backing.to_path_buf(), options)?));
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::FSName("tenure-powerfs".into()),
            MountOption::Subtype("powerfs".into()),
            MountOption::DefaultPermissions,
        ];
        config.acl = SessionACL::All;
        let session = fuser::Session::new(PowerFsHandler::new(engine.clone()), &mountpoint, &config)
            .map_err(|source| Error::Mount { mountpoint: mountpoint.clone(), source })?;
        let session = session.spawn().map_err(|source| Error::Mount { mountpoint: mountpoint.clone(), source })?;
        // The connection's device number names it under the fuse control filesystem, which is
        // how a cut aborts a connection that open files would otherwise keep alive.
        let device = fs::metadata(&mountpoint).map(|m| m.dev()).ok();
        Ok(Mounted { mountpoint, engine, session: Some(session), device })
    }
}

/// A live mount. Dropping it unmounts cleanly (everything becomes durable), as a shutdown would.
#[derive(Debug)]
pub struct Mounted {
    mountpoint: PathBuf,
    engine: Arc<Mutex<Engine>>,
    session: Option<BackgroundSession>,
    device: Option<u64>,
}

impl Mounted {
    /// Where the filesystem is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    fn engine(&self) -> std::sync::MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Power loss: drops every unsynced change (except an optional torn prefix of the last
    /// unsynced write) and detaches the mount. Processes still using the mount get `EIO` from
    /// then on; they do not delay the cut. Mount the same backing directory again to "reboot".
    pub fn cut(mut self, options: CutOptions) -> Result<CutReport, Error> {
        let report = self.engine().cut(options.torn)?;
        self.stop(true);
        Ok(report)
    }

    /// Clean shutdown: every file's data and the whole tree become durable, then the mount goes.
    pub fn unmount(mut self) -> Result<(), Error> {
        let synced = self.engine().sync_all();
        self.stop(false);
        synced
    }

    /// Detaches the mount and waits (bounded) for the serving thread to end.
    fn stop(&mut self, lazy: bool) {
        let Some(session) = self.session.take() else { return };
        self.engine().unlock();
        if lazy || nix::mount::umount(&self.mountpoint).is_err() {
            if let Err(e) = umount2(&self.mountpoint, MntFlags::MNT_DETACH) {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e, "lazy unmount failed");
            }
        }
        // Without open files the connection ends as soon as the mount is gone; give it a moment,
        // then abort it so that files still open cannot keep the serving thread alive.
        if !wait_finished(&session, Duration::from_millis(200)) {
            if let Some(dev) = self.device {
                abort_connection(dev);
            }
            if !wait_finished(&session, STOP_WAIT) {
                tracing::warn!(mountpoint = %self.mountpoint.display(), "serving thread still busy; leaving it");
                std::mem::forget(session);
                return;
            }
        }
        if let Err(e) = session.join() {
            tracing::warn!(error = %e, "serving thread ended with an error");
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if self.session.is_some() {
            if let Err(e) = self.engine().sync_all() {
                tracing::warn!(error = %e, "sync at unmount failed");
            }
            self.stop(false);
        }
    }
}

/// Waits up to `wait` for the serving thread to end.
fn wait_finished(session: &BackgroundSession, wait: Duration) -> bool {
    let deadline = Instant::now() + wait;
    while !session.guard.is_finished() {
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Aborts the FUSE connection with device number `dev`, so that reads of files still open on a
/// detached mount fail instead of keeping it alive. Mounts the fuse control filesystem if it is
/// not mounted yet; failure only means the connection lingers until its files are closed.
fn abort_connection(dev: u64) {
    let control = Path::new("/sys/fs/fuse/connections");
    let abort = control.join(libc::minor(dev).to_string()).join("abort");
    if !abort.exists() {
        let _ =
            nix::mount::mount(Some("fusectl"), control, Some("fusectl"), nix::mount::MsFlags::empty(), None::<&str>);
    }
    if let Err(e) = fs::write(&abort, "1") {
        tracing::debug!(path = %abort.display(), error = %e, "could not abort the connection");
    }
}

/// Detaches every FUSE mount stacked at `mountpoint` (left behind by a killed server). Returns
/// how many were detached; a path with no FUSE mount is left alone.
pub fn unmount_stale(mountpoint: &Path) -> Result<usize, Error> {
    let mountpoint = resolve(mountpoint)?;
    let mut detached = 0;
    while fuse_mounted_at(&mountpoint)? {
        umount2(&mountpoint, MntFlags::MNT_DETACH).map_err(|e| Error::Io {
            context: format!("detaching the stale mount at {}", mountpoint.display()),
            source: e.into(),
        })?;
        detached += 1;
    }
    Ok(detached)
}

/// The path the mount table will show for `mountpoint`: absolute, with the parent's symlinks
/// resolved. The mountpoint itself is not resolved: on a stale mount that fails (`ENOTCONN`).
fn resolve(mountpoint: &Path) -> Result<PathBuf, Error> {
    let absolute = std::path::absolute(mountpoint)
        .map_err(|source| Error::Io { context: format!("resolving {}", mountpoint.display()), source })?;
    match (absolute.parent().map(fs::canonicalize), absolute.file_name()) {
        (Some(Ok(parent)), Some(name)) => Ok(parent.join(name)),
        _ => Ok(absolute),
    }
}

/// Whether `/proc/self/mountinfo` lists a FUSE mount at `mountpoint`.
fn fuse_mounted_at(mountpoint: &Path) -> Result<bool, Error> {
    let info = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|source| Error::Io { context: "reading the mount table".into(), source })?;
    let wanted = mountpoint.to_string_lossy();
    Ok(info.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let point = fields.get(4).map(|p| unescape_mount_path(p));
        let fstype = line.split(" - ").nth(1).and_then(|rest| rest.split(' ').next()).unwrap_or("");
        point.as_deref() == Some(wanted.as_ref()) && fstype.starts_with("fuse")
    }))
}

/// Undoes the octal escapes (`\040` for a space, ...) of the mount table.
fn unescape_mount_path(raw: &str) -> String {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let v = u32::from(bytes[i + 1] - b'0') * 64
                + u32::from(bytes[i + 2] - b'0') * 8
                + u32::from(bytes[i + 3] - b'0');
            out.push(u8::try_from(v).unwrap_or(b'?'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::unescape_mount_path;

    #[test]
    fn mount_table_escapes_are_undone() {
        assert_eq!(unescape_mount_path(r"/tmp/a\040b"), "/tmp/a b");
        assert_eq!(unescape_mount_path("/plain"), "/plain");
    }
}
