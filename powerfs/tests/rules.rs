//! One test per durability rule, on a real mount: do something, cut the power (or shut down
//! cleanly), boot again and look at what a program would find.

mod common;

use std::fs::{self, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};

use anyhow::Result;
use common::{append, fsync, fsync_dir, names, read, write_file, Rig};
use tenure_powerfs::{CutOptions, Options, TornPrefix, TornWrite};

#[test]
fn written_but_unsynced_content_is_gone_after_cut() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("a"), b"", false)?;
    fsync_dir(&rig.mnt)?;
    write_file(&rig.path("a"), b"hello", false)?;
    write_file(&rig.path("never"), b"nothing synced", false)?;
    assert_eq!(read(&rig.path("a"))?.as_deref(), Some(&b"hello"[..]), "live view before the cut");
    rig.cut()?;
    assert_eq!(read(&rig.path("a"))?.as_deref(), Some(&b""[..]), "entry durable, data never synced");
    assert_eq!(read(&rig.path("never"))?, None);
    Ok(())
}

#[test]
fn synced_file_whose_directory_was_never_synced_is_gone() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("orphan"), b"data", true)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("orphan"))?, None);
    assert!(names(&rig.mnt)?.is_empty());
    Ok(())
}

#[test]
fn synced_file_and_directory_survive_with_exact_content() -> Result<()> {
    let mut rig = Rig::new()?;
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    write_file(&rig.path("f"), &data, true)?;
    fsync_dir(&rig.mnt)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("f"))?, Some(data));
    Ok(())
}

#[test]
fn appended_unsynced_tail_is_dropped_and_synced_prefix_stays() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("log"), b"one\n", true)?;
    fsync_dir(&rig.mnt)?;
    append(&rig.path("log"), b"two\n", true)?;
    append(&rig.path("log"), b"three\n", false)?;
    assert_eq!(read(&rig.path("log"))?.as_deref(), Some(&b"one\ntwo\nthree\n"[..]));
    rig.cut()?;
    assert_eq!(read(&rig.path("log"))?.as_deref(), Some(&b"one\ntwo\n"[..]));
    Ok(())
}

#[test]
fn unsynced_truncate_is_undone_and_synced_truncate_stays() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("t"), b"abcdef", true)?;
    write_file(&rig.path("u"), b"abcdef", true)?;
    fsync_dir(&rig.mnt)?;
    OpenOptions::new().write(true).open(rig.path("t"))?.set_len(2)?;
    let u = OpenOptions::new().write(true).open(rig.path("u"))?;
    u.set_len(2)?;
    u.write_all_at(b"Z", 4)?; // past the cut-down end: bytes 2..4 must read as zeros
    u.sync_all()?;
    drop(u);
    rig.cut()?;
    assert_eq!(read(&rig.path("t"))?.as_deref(), Some(&b"abcdef"[..]));
    assert_eq!(read(&rig.path("u"))?.as_deref(), Some(&b"ab\0\0Z"[..]));
    Ok(())
}

#[test]
fn write_temp_fsync_rename_fsync_dir_survives() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("state"), b"v1", true)?;
    fsync_dir(&rig.mnt)?;
    write_file(&rig.path("state.tmp"), b"v2", true)?;
    fs::rename(rig.path("state.tmp"), rig.path("state"))?;
    fsync_dir(&rig.mnt)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("state"))?.as_deref(), Some(&b"v2"[..]));
    assert_eq!(names(&rig.mnt)?, vec!["state"]);
    Ok(())
}

#[test]
fn rename_without_directory_fsync_reverts_to_the_old_file() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("state"), b"v1", true)?;
    fsync_dir(&rig.mnt)?;
    write_file(&rig.path("state.tmp"), b"v2", true)?;
    fs::rename(rig.path("state.tmp"), rig.path("state"))?;
    rig.cut()?;
    assert_eq!(read(&rig.path("state"))?.as_deref(), Some(&b"v1"[..]));
    assert_eq!(names(&rig.mnt)?, vec!["state"], "the temp file's entry was never durable");
    Ok(())
}

#[test]
fn rename_across_directories_is_durable_per_directory() -> Result<()> {
    let mut rig = Rig::new()?;
    fs::create_dir(rig.path("src"))?;
    fs::create_dir(rig.path("dst"))?;
    write_file(&rig.path("src/f"), b"moved", true)?;
    fsync_dir(&rig.path("src"))?;
    fsync_dir(&rig.mnt)?;
    fs::rename(rig.path("src/f"), rig.path("dst/f"))?;
    fsync_dir(&rig.path("dst"))?;
    rig.cut()?;
    // Only the new parent was synced: the inode is durable under both names.
    assert_eq!(read(&rig.path("src/f"))?.as_deref(), Some(&b"moved"[..]));
    assert_eq!(read(&rig.path("dst/f"))?.as_deref(), Some(&b"moved"[..]));
    fs::rename(rig.path("src/f"), rig.path("dst/g"))?;
    fsync_dir(&rig.path("src"))?;
    fsync_dir(&rig.path("dst"))?;
    rig.cut()?;
    assert!(names(&rig.path("src"))?.is_empty());
    assert_eq!(names(&rig.path("dst"))?, vec!["f", "g"]);
    Ok(())
}

#[test]
fn unsynced_unlink_brings_the_file_back() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("keep"), b"k", true)?;
    write_file(&rig.path("gone"), b"g", true)?;
    fsync_dir(&rig.mnt)?;
    fs::remove_file(rig.path("keep"))?;
    rig.cut()?;
    assert_eq!(read(&rig.path("keep"))?.as_deref(), Some(&b"k"[..]));
    fs::remove_file(rig.path("gone"))?;
    fsync_dir(&rig.mnt)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("gone"))?, None);
    assert_eq!(read(&rig.path("keep"))?.as_deref(), Some(&b"k"[..]));
    Ok(())
}

#[test]
fn unsynced_mkdir_is_gone_and_synced_mkdir_stays() -> Result<()> {
    let mut rig = Rig::new()?;
    fs::create_dir(rig.path("kept"))?;
    fsync_dir(&rig.mnt)?;
    fs::create_dir(rig.path("lost"))?;
    write_file(&rig.path("lost/inner"), b"x", true)?;
    fsync_dir(&rig.path("lost"))?;
    rig.cut()?;
    assert_eq!(names(&rig.mnt)?, vec!["kept"]);
    assert!(rig.path("kept").is_dir());
    Ok(())
}

#[test]
fn unsynced_links_and_symlinks_are_gone_synced_ones_stay() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("f"), b"data", true)?;
    fs::hard_link(rig.path("f"), rig.path("hard"))?;
    std::os::unix::fs::symlink("f", rig.path("soft"))?;
    fsync_dir(&rig.mnt)?;
    fs::hard_link(rig.path("f"), rig.path("hard2"))?;
    std::os::unix::fs::symlink("f", rig.path("soft2"))?;
    rig.cut()?;
    assert_eq!(names(&rig.mnt)?, vec!["f", "hard", "soft"]);
    assert_eq!(read(&rig.path("hard"))?.as_deref(), Some(&b"data"[..]));
    assert_eq!(fs::read_link(rig.path("soft"))?, std::path::PathBuf::from("f"));
    use std::os::unix::fs::MetadataExt;
    assert_eq!(fs::metadata(rig.path("f"))?.nlink(), 2);
    Ok(())
}

#[test]
fn fsync_through_another_handle_of_the_same_inode_makes_data_durable() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("f"), b"", true)?;
    fsync_dir(&rig.mnt)?;
    let writer = OpenOptions::new().write(true).open(rig.path("f"))?;
    writer.write_all_at(b"through handle one", 0)?;
    fsync(&rig.path("f"))?;
    drop(writer);
    rig.cut()?;
    assert_eq!(read(&rig.path("f"))?.as_deref(), Some(&b"through handle one"[..]));
    Ok(())
}

#[test]
fn torn_write_keeps_only_the_given_prefix() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("f"), b"AAAAAAAAAA", true)?;
    fsync_dir(&rig.mnt)?;
    let f = OpenOptions::new().write(true).open(rig.path("f"))?;
    f.write_all_at(b"BBBBBBBBBBBB", 0)?;
    drop(f);
    let report = rig.cut_with(CutOptions { torn: Some(TornWrite { prefix: TornPrefix::Bytes(4) }) })?;
    let torn = report.torn.expect("a write to tear");
    assert_eq!((torn.offset, torn.len, torn.kept), (0, 12, 4));
    assert_eq!(read(&rig.path("f"))?.as_deref(), Some(&b"BBBBAAAAAA"[..]));
    Ok(())
}

#[test]
fn seeded_torn_write_is_a_reproducible_strict_prefix() -> Result<()> {
    let mut kept = Vec::new();
    for _ in 0..2 {
        let mut rig = Rig::new()?;
        write_file(&rig.path("f"), b"", true)?;
        fsync_dir(&rig.mnt)?;
        append(&rig.path("f"), b"first write, synced\n", true)?;
        append(&rig.path("f"), &[b'x'; 1000], false)?;
        let report = rig.cut_with(CutOptions { torn: Some(TornWrite { prefix: TornPrefix::Seeded(7) }) })?;
        let torn = report.torn.expect("a write to tear");
        assert!(torn.kept < 1000, "a torn write keeps less than the whole write");
        let content = read(&rig.path("f"))?.unwrap_or_default();
        assert_eq!(content.len() as u64, 20 + torn.kept);
        assert!(content.starts_with(b"first write, synced\n"));
        kept.push(torn.kept);
    }
    assert_eq!(kept[0], kept[1], "same seed, same prefix");
    Ok(())
}

#[test]
fn journaled_metadata_makes_a_create_durable_on_an_unrelated_fsync() -> Result<()> {
    for journaled in [false, true] {
        let mut rig = Rig::with(Options { journaled_metadata: journaled })?;
        write_file(&rig.path("unrelated"), b"u", true)?;
        fs::create_dir(rig.path("d"))?;
        write_file(&rig.path("d/created"), b"data never synced", false)?;
        fsync(&rig.path("unrelated"))?;
        rig.cut()?;
        if journaled {
            assert_eq!(read(&rig.path("unrelated"))?.as_deref(), Some(&b"u"[..]));
            assert_eq!(read(&rig.path("d/created"))?.as_deref(), Some(&b""[..]), "entry durable, data not");
        } else {
            assert!(names(&rig.mnt)?.is_empty(), "strict mode: no directory was synced");
        }
    }
    Ok(())
}

#[test]
fn clean_unmount_keeps_everything() -> Result<()> {
    let mut rig = Rig::new()?;
    fs::create_dir_all(rig.path("a/b"))?;
    write_file(&rig.path("a/b/f"), b"never synced", false)?;
    fs::set_permissions(rig.path("a/b/f"), fs::Permissions::from_mode(0o640))?;
    std::os::unix::fs::symlink("b/f", rig.path("a/link"))?;
    rig.reboot_clean()?;
    assert_eq!(read(&rig.path("a/b/f"))?.as_deref(), Some(&b"never synced"[..]));
    assert_eq!(fs::metadata(rig.path("a/b/f"))?.permissions().mode() & 0o777, 0o640);
    assert_eq!(read(&rig.path("a/link"))?.as_deref(), Some(&b"never synced"[..]));
    // And a cut right after the clean boot changes nothing.
    rig.cut()?;
    assert_eq!(read(&rig.path("a/b/f"))?.as_deref(), Some(&b"never synced"[..]));
    Ok(())
}

#[test]
fn two_cuts_in_a_row() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("f"), b"1", true)?;
    fsync_dir(&rig.mnt)?;
    write_file(&rig.path("f"), b"2", false)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("f"))?.as_deref(), Some(&b"1"[..]));
    write_file(&rig.path("f"), b"3", true)?;
    write_file(&rig.path("g"), b"g", true)?;
    rig.cut()?;
    assert_eq!(read(&rig.path("f"))?.as_deref(), Some(&b"3"[..]));
    assert_eq!(read(&rig.path("g"))?, None);
    rig.cut()?;
    assert_eq!(read(&rig.path("f"))?.as_deref(), Some(&b"3"[..]));
    Ok(())
}

#[test]
fn cut_does_not_wait_for_processes_holding_files_open() -> Result<()> {
    let mut rig = Rig::new()?;
    write_file(&rig.path("held"), b"synced", true)?;
    fsync_dir(&rig.mnt)?;
    let mut holder =
        std::process::Command::new("sh").arg("-c").arg("exec 3<held; exec sleep 60").current_dir(&rig.mnt).spawn()?;
    let mine = fs::File::open(rig.path("held"))?;
    let started = std::time::Instant::now();
    let cut = rig.cut();
    let elapsed = started.elapsed();
    let _ = holder.kill();
    let _ = holder.wait();
    cut?;
    // The cut's own waits are bounded; what shows it did not wait for the holders is that their
    // connection was aborted: the file they hold is dead.
    eprintln!("cut with files held open took {elapsed:?}");
    let mut buf = [0u8; 6];
    assert!(mine.read_at(&mut buf, 0).is_err(), "a file open across the cut is dead");
    assert_eq!(read(&rig.path("held"))?.as_deref(), Some(&b"synced"[..]));
    Ok(())
}

#[test]
fn a_second_server_on_the_same_backing_directory_is_refused() -> Result<()> {
    let rig = Rig::new()?;
    let other = rig.backing.parent().map(|p| p.join("other-mnt")).unwrap_or_default();
    let second = tenure_powerfs::PowerFs::mount(&rig.backing, &other, Options::default());
    assert!(matches!(second, Err(tenure_powerfs::Error::Busy { .. })), "got {second:?}");
    Ok(())
}

/// xorshift64*: a tiny reproducible generator for the model test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn seeded_writes_truncates_and_syncs_match_a_model_across_cuts() -> Result<()> {
    for seed in [1u64, 42, 4242] {
        let mut rig = Rig::new()?;
        let path = rig.path("db");
        write_file(&path, b"", true)?;
        fsync_dir(&rig.mnt)?;
        let mut rng = Rng(seed);
        let mut live: Vec<u8> = Vec::new();
        let mut durable: Vec<u8> = Vec::new();
        for cycle in 0..3 {
            let f = OpenOptions::new().read(true).write(true).open(&path)?;
            for _ in 0..200 {
                match rng.below(10) {
                    0..=5 => {
                        let off = rng.below(48 * 1024) as usize;
                        let len = 1 + rng.below(4096) as usize;
                        let byte = (rng.below(255) + 1) as u8;
                        f.write_all_at(&vec![byte; len], off as u64)?;
                        if live.len() < off + len {
                            live.resize(off + len, 0);
                        }
                        live[off..off + len].fill(byte);
                    }
                    6 => {
                        let len = rng.below(64 * 1024) as usize;
                        f.set_len(len as u64)?;
                        live.resize(len, 0);
                    }
                    _ => {
                        if rng.below(2) == 0 {
                            f.sync_all()?;
                        } else {
                            f.sync_data()?;
                        }
                        durable = live.clone();
                    }
                }
            }
            drop(f);
            assert_eq!(read(&path)?.unwrap_or_default(), live, "seed {seed} cycle {cycle}: live view");
            rig.cut()?;
            let after = read(&path)?.unwrap_or_default();
            assert!(after == durable, "seed {seed} cycle {cycle}: durable image differs from the model");
            live = durable.clone();
        }
    }
    Ok(())
}
