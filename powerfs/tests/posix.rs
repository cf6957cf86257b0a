//! The mount behaves like a local filesystem for what our programs do on it: plain file calls,
//! FIFOs, unix sockets and `flock`.

mod common;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{ensure, Context, Result};
use common::{fsync_dir, names, read, write_file, Rig};

fn cstr(p: &Path) -> Result<CString> {
    Ok(CString::new(p.as_os_str().as_bytes())?)
}

/// `renameat2` with flags; returns the errno on failure.
fn rename2(from: &Path, to: &Path, flags: libc::c_uint) -> Result<Result<(), i32>> {
    let (from, to) = (cstr(from)?, cstr(to)?);
    // SAFETY: both paths are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), flags) };
    Ok(if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)) })
}

#[test]
fn file_calls_behave_like_a_local_filesystem() -> Result<()> {
    let rig = Rig::new()?;
    let f = rig.path("f");
    // O_EXCL
    File::create_new(&f)?;
    assert_eq!(File::create_new(&f).map_err(|e| e.kind()).err(), Some(ErrorKind::AlreadyExists));
    // pwrite / pread, and a hole reads as zeros
    let h = OpenOptions::new().read(true).write(true).open(&f)?;
    h.write_all_at(b"abc", 0)?;
    h.write_all_at(b"xyz", 10)?;
    let mut buf = [0u8; 13];
    h.read_exact_at(&mut buf, 0)?;
    assert_eq!(&buf, b"abc\0\0\0\0\0\0\0xyz");
    // O_APPEND writes at the end whatever the offset
    let mut a = OpenOptions::new().append(true).open(&f)?;
    a.write_all(b"!")?;
    assert_eq!(fs::metadata(&f)?.len(), 14);
    // O_TRUNC
    OpenOptions::new().write(true).truncate(true).open(&f)?;
    assert_eq!(fs::metadata(&f)?.len(), 0);
    // ftruncate extends with zeros; fallocate extends the size
    h.set_len(5)?;
    assert_eq!(read(&f)?.as_deref(), Some(&[0u8; 5][..]));
    // SAFETY: a valid open descriptor and in-range arguments.
    let rc = unsafe { libc::fallocate(h.as_raw_fd(), 0, 0, 4096) };
    ensure!(rc == 0, "fallocate: {}", std::io::Error::last_os_error());
    assert_eq!(fs::metadata(&f)?.len(), 4096);
    // chmod and utimens
    fs::set_permissions(&f, fs::Permissions::from_mode(0o600))?;
    assert_eq!(fs::metadata(&f)?.permissions().mode() & 0o777, 0o600);
    let when = UNIX_EPOCH + Duration::from_secs(1_000_000_000);
    File::options().write(true).open(&f)?.set_modified(when)?;
    assert_eq!(fs::metadata(&f)?.modified()?, when);
    // renameat2: NOREPLACE refuses, EXCHANGE swaps
    write_file(&rig.path("g"), b"g", false)?;
    assert_eq!(rename2(&f, &rig.path("g"), libc::RENAME_NOREPLACE)?, Err(libc::EEXIST));
    write_file(&rig.path("h"), b"h", false)?;
    rename2(&rig.path("g"), &rig.path("h"), libc::RENAME_EXCHANGE)?.map_err(|e| anyhow::anyhow!("errno {e}"))?;
    assert_eq!(read(&rig.path("g"))?.as_deref(), Some(&b"h"[..]));
    // directories: rmdir of a non-empty one fails, readdir lists, unlinked open file stays readable
    fs::create_dir(rig.path("d"))?;
    write_file(&rig.path("d/x"), b"x", false)?;
    assert!(fs::remove_dir(rig.path("d")).is_err());
    assert_eq!(names(&rig.mnt)?, vec!["d", "f", "g", "h"]);
    let mut open = File::open(rig.path("d/x"))?;
    fs::remove_file(rig.path("d/x"))?;
    let mut s = String::new();
    open.read_to_string(&mut s)?;
    assert_eq!(s, "x");
    fs::remove_dir(rig.path("d"))?;
    // statfs answers
    let st = nix::sys::statvfs::statvfs(&rig.mnt)?;
    assert!(st.blocks() > 0);
    Ok(())
}

#[test]
fn fifo_can_be_opened_written_and_read_and_its_entry_obeys_the_rules() -> Result<()> {
    let mut rig = Rig::new()?;
    let fifo = rig.path("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    assert!(fs::metadata(&fifo)?.file_type().is_fifo());
    let reader_path = fifo.clone();
    let reader = thread::spawn(move || -> std::io::Result<String> {
        let mut s = String::new();
        File::open(reader_path)?.read_to_string(&mut s)?;
        Ok(s)
    });
    OpenOptions::new().write(true).open(&fifo)?.write_all(b"through the pipe")?;
    let got = reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))??;
    assert_eq!(got, "through the pipe");
    fsync_dir(&rig.mnt)?;
    rig.cut()?;
    assert!(fs::metadata(&fifo)?.file_type().is_fifo(), "synced FIFO entry survives as a FIFO");
    Ok(())
}

#[test]
fn unix_socket_binds_and_connects_on_the_mount() -> Result<()> {
    let mut rig = Rig::new()?;
    let path = rig.path("daemon.sock");
    let listener = UnixListener::bind(&path)?;
    assert!(fs::metadata(&path)?.file_type().is_socket());
    let server = thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut conn, _) = listener.accept()?;
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf)?;
        conn.write_all(b"pong")?;
        Ok(buf.to_vec())
    });
    let mut client = UnixStream::connect(&path)?;
    client.write_all(b"ping")?;
    let mut answer = [0u8; 4];
    client.read_exact(&mut answer)?;
    assert_eq!(&answer, b"pong");
    assert_eq!(server.join().map_err(|_| anyhow::anyhow!("server panicked"))??, b"ping");
    fsync_dir(&rig.mnt)?;
    rig.cut()?;
    // After a reboot the socket file is there but nobody listens, as on a real machine.
    assert!(fs::metadata(&path)?.file_type().is_socket());
    assert_eq!(UnixStream::connect(&path).map_err(|e| e.kind()).err(), Some(ErrorKind::ConnectionRefused));
    Ok(())
}

fn flock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a valid open descriptor.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn flock_exclusive_refuses_a_second_locker() -> Result<()> {
    let rig = Rig::new()?;
    let path = rig.path("db.lock");
    write_file(&path, b"", false)?;
    let first = File::open(&path)?;
    let second = File::open(&path)?;
    flock(&first, libc::LOCK_EX | libc::LOCK_NB).context("first lock")?;
    let refused = flock(&second, libc::LOCK_EX | libc::LOCK_NB);
    assert_eq!(refused.map_err(|e| e.raw_os_error()), Err(Some(libc::EWOULDBLOCK)));
    // Another process is refused too.
    let status =
        std::process::Command::new("sh").arg("-c").arg(format!("exec 9<'{}'; flock -n -x 9", path.display())).status();
    if let Ok(status) = status {
        if status.code() != Some(127) {
            assert!(!status.success(), "a second process got the exclusive lock");
        }
    }
    drop(first);
    flock(&second, libc::LOCK_EX | libc::LOCK_NB).context("lock after the holder closed")?;
    Ok(())
}

#[test]
fn writes_through_an_o_dsync_handle_are_synced() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("s"), b"", false)?;
    fsync_dir(&rig.mnt)?;
    let mut f = OpenOptions::new().write(true).custom_flags(libc::O_DSYNC).open(rig.path("s"))?;
    f.write_all(b"dsync")?;
    drop(f);
    rig.cut()?;
    assert_eq!(read(&rig.path("s"))?.as_deref(), Some(&b"dsync"[..]));
    Ok(())
}
