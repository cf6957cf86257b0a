//! Start-up recovery's IO: the sidecar's records (page by page), every
//! attempt's journal, and the scratch directories. What each case
//! becomes is the core's decision ([`crate::core::Worker::recover`],
//! [`crate::core::unlisted`]); this reads what it needs, does what it returns
//! and drives every attempt the core holds again.
//!
//! It never removes an attempt's files while its processes may live, and
//! never settles an attempt itself.

use std::sync::Arc;
use std::time::Duration;

use tenure_machine::attempt_files::{self, Journal};
use tenure_protocol::messages::{SidecarRefusal, SidecarReply, SidecarRequest};
use tenure_protocol::{Attempt, Epoch, TaskId};

use crate::attempt::{report_until_acked, sidecar_insist, spawn_drive, Shared};
use crate::core::{unlisted, Found, Key, Recovered, Step, Unlisted};
use crate::process;

/// Start-up recovery: reads every sidecar record (page by page) and every
/// attempt's files, hands what they show to the core
/// ([`crate::core::Worker::recover`], whose table says what each case
/// becomes), does what it returns and drives every attempt it holds again.
///
/// Attempt directories that no record names are settled from their files when
/// their journal names them, removed only when their shim and group are
/// confirmed gone, and kept otherwise, with a warning saying why
/// ([`crate::core::unlisted`]). Scratch directories are kept while their task
/// has a record here, and removed once it has none (its files were released).
pub(crate) async fn recover(shared: &Arc<Shared>) {
    let (mut epoch, mut records, mut corrupt, mut request) = (Epoch(0), Vec::new(), Vec::new(), SidecarRequest::List);
    let listed = loop {
        match shared.sidecar.call(&request).await {
            Ok(SidecarReply::Records { epoch: e, records: page, corrupt: bad, next }) => {
                epoch = epoch.max(e);
                records.extend(page);
                corrupt.extend(bad);
                match next {
                    Some((task, attempt)) => request = SidecarRequest::ListFrom { task, attempt },
                    None => break true,
                }
                continue;
            }
            // The store is unusable: the records are lost, but every attempt
            // that reached its intent has a directory, and its shim's
            // evidence is there.
            Ok(SidecarReply::Refused(SidecarRefusal::Storage(reason))) => {
                tracing::error!(%reason, "the sidecar cannot read its records; settling attempts from their directories");
                break false;
            }
            Ok(other) => tracing::error!(?other, "sidecar answered List oddly; retrying"),
            Err(error) => tracing::warn!(%error, "waiting for the sidecar"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut found = Vec::new();
    let mut known = std::collections::HashSet::new();
    let boot = tenure_machine::boot::boot_id();
    for record in records {
        let key = (record.grant.task.clone(), record.grant.attempt);
        known.insert(format!("{}.{}", key.0, key.1));
        let journal = shared.layout.attempt_files(&key.0, key.1).journal().unwrap_or_default();
        let shim_alive = journal.status.is_none() && journal.shim.is_some_and(|m| m.alive());
        let restarted = tenure_machine::boot::booted_since(&record, boot.as_deref());
        found.push(Found::Record { record, shim_alive, restarted });
    }
    for c in corrupt {
        let Some(key) = c.attempt else {
            tracing::error!(key = %c.key, reason = %c.reason, "unreadable sidecar record names no attempt");
            continue;
        };
        known.insert(format!("{}.{}", key.0, key.1));
        tracing::warn!(task = %key.0, attempt = %key.1, reason = %c.reason, "unreadable record; only the attempt's files can speak");
        found.push(files_only(shared, key, None, Some(c.reason)));
    }
    found.extend(unlisted_attempts(shared, &known, listed));
    let recovered = shared.state().core.recover(epoch, found);
    for r in recovered {
        match r {
            Recovered::Abandon((task, attempt)) => {
                tracing::info!(task = %task, attempt = %attempt, "accepted but never started: giving it back");
                let _ = sidecar_insist(shared, SidecarRequest::Abandon { task, attempt }).await;
            }
            Recovered::Report { key: (task, attempt), epoch, event } => {
                let shared = shared.clone();
                tokio::spawn(async move { report_until_acked(&shared, &task, attempt, epoch, event).await });
            }
            Recovered::Remove((task, attempt)) => {
                if let Err(error) = shared.layout.attempt_files(&task, attempt).remove() {
                    tracing::warn!(task = %task, attempt = %attempt, %error, "cannot remove the attempt's files");
                }
            }
        }
    }
    let held = shared.state().core.keys();
    // The owner's pause wish of an attempt held again is in its files.
    for key in &held {
        if shared.layout.attempt_files(&key.0, key.1).pause_requested() {
            shared.state().core.restore_paused(key);
        }
    }
    for key in held {
        let step = shared.state().core.held(&key).map(|h| h.step.clone());
        let (task, attempt) = (&key.0, key.1);
        match step {
            Some(Step::Watch) => tracing::info!(task = %task, attempt = %attempt, "re-attaching to a running attempt"),
            Some(Step::Report(_)) => {
                tracing::info!(task = %task, attempt = %attempt, "re-reporting buffered completion")
            }
            _ => {
                tracing::info!(task = %task, attempt = %attempt, "settling an attempt whose shim is gone from its files")
            }
        }
        spawn_drive(shared, key);
    }
    // Without the records nothing says which scratch directories are still
    // wanted: they are all kept.
    if listed {
        let tasks: std::collections::HashSet<&str> =
            known.iter().filter_map(|k| k.rsplit_once('.')).map(|(t, _)| t).collect();
        sweep_scratch_dirs(shared, &tasks);
    }
}

/// What an attempt's files alone show (its record is unreadable, lost,
/// or the whole store is).
fn files_only(shared: &Shared, key: Key, journal: Option<Journal>, corrupt: Option<String>) -> Found {
    let journal = journal.unwrap_or_else(|| shared.layout.attempt_files(&key.0, key.1).journal().unwrap_or_default());
    Found::FilesOnly {
        key,
        status: journal.status.is_some(),
        shim_alive: journal.shim.is_some_and(|m| m.alive()),
        grant: journal.grant,
        corrupt,
    }
}

/// Attempts on disk that no record names. With `listed` false the store
/// could not list its records, and every attempt is settled from its files.
/// Otherwise an attempt whose readable `grant` names it is one whose record
/// was lost (sled can drop damaged data silently), settled from its files
/// like any other; anything else is removed only when confirmed dead (seed
/// 004), and kept with a warning otherwise.
fn unlisted_attempts(shared: &Shared, known: &std::collections::HashSet<String>, listed: bool) -> Vec<Found> {
    let mut found = Vec::new();
    for (name, files) in attempt_files::list(&shared.layout.attempts_dir()) {
        if known.contains(&name) {
            continue;
        }
        let parsed = name.rsplit_once('.').and_then(|(t, a)| Some((t.parse::<TaskId>().ok()?, a.parse().ok()?)));
        let journal = files.journal().unwrap_or_default();
        if !listed {
            match parsed {
                Some((task, attempt)) => found.push(files_only(shared, (task, Attempt(attempt)), Some(journal), None)),
                None => tracing::warn!(name = %name, "not an attempt's files: kept"),
            }
            continue;
        }
        let names_it = journal.grant.as_ref().is_some_and(|g| name == format!("{}.{}", g.task, g.attempt));
        let shim_alive = journal.shim.is_some_and(|m| m.alive());
        let group_alive = journal.pgid.is_some_and(process::group_alive);
        match unlisted(names_it, shim_alive, group_alive) {
            Unlisted::Settle => {
                tracing::warn!(attempt = %name, "attempt files without a record: the record was lost; settling from the shim's files");
                let key = journal.grant.as_ref().map(|g| (g.task.clone(), g.attempt));
                if let Some(key) = key {
                    found.push(files_only(shared, key, Some(journal), None));
                }
            }
            Unlisted::Keep => {
                tracing::warn!(attempt = %name, shim_alive, group_alive, "attempt files without a record but with live processes: kept");
            }
            Unlisted::Remove => {
                tracing::info!(attempt = %name, "removing attempt files no record names and no process uses");
                if let Err(error) = files.remove() {
                    tracing::warn!(attempt = %name, %error, "cannot remove the attempt's files");
                }
            }
        }
    }
    found
}

/// Scratch directories whose task this machine no longer holds any record of:
/// the task's files were released (its cleanup job removes them; one that was
/// interrupted leaves them behind) and nothing can use them any more, so they
/// are removed. A directory whose task still has a record or an attempt
/// directory is kept (it is released with the task's files); a name that is
/// not `<task>.<attempt>` was not made by a worker and is left alone.
fn sweep_scratch_dirs(shared: &Shared, tasks: &std::collections::HashSet<&str>) {
    let Some(root) = shared.layout.scratch_root() else { return };
    let Ok(entries) = std::fs::read_dir(&root) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if crate::scratch::is_spare(&name) {
            continue; // what the worker's start left of the spares is meant to stay
        }
        let parsed = name.rsplit_once('.').and_then(|(t, a)| Some((t.parse::<TaskId>().ok()?, a.parse::<u32>().ok()?)));
        let Some((task, attempt)) = parsed else {
            tracing::warn!(dir = %entry.path().display(), "not a scratch directory of this worker: left alone");
            continue;
        };
        let held =
            tasks.contains(task.to_string().as_str()) || shared.layout.attempt_files(&task, Attempt(attempt)).exists();
        if held {
            continue;
        }
        tracing::info!(task = %task, attempt, dir = %entry.path().display(), "removing the scratch directory of a task whose files were released");
        if let Err(error) = std::fs::remove_dir_all(entry.path()) {
            tracing::warn!(task = %task, attempt, %error, "cannot remove a released scratch directory");
        }
    }
}
