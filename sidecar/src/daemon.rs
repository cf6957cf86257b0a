//! The sidecar daemon: IO around [`Machine`]. It owns the unix socket the
//! worker talks to, the NATS subscriptions that serve output reads, evidence
//! queries and input for agent tasks ([`crate::input`]), and the one thread
//! that holds the machine and its sled database.
//!
//! Layering: connection tasks and the output task only parse, forward and
//! encode; every decision is [`Machine::handle`]'s. The machine lives on a
//! dedicated blocking thread fed by a channel (the "store thread"), so sled's
//! fsyncs never stall the async runtime, requests from all connections are
//! applied one at a time (those waiting together are committed by one flush,
//! and each is answered only after it), and shutdown is deterministic: once
//! the thread has returned, the database is flushed and closed.
//!
//! NATS is optional at runtime: the client connects (and reconnects) in the
//! background, and the socket keeps serving the worker while NATS is down.
//!
//! The socket answers the worker and nobody else: every accepted connection's
//! peer credentials (`SO_PEERCRED`) must name the daemons' user (or root) and
//! the process holding the worker's lock ([`tenure_machine::worker_lock`]); anything
//! else — a task, even one running as the daemons' own user — has its
//! connection closed before a byte is read.
//!
//! This module never panics on input, never starts or kills processes and never
//! writes task output or input.

use std::future::Future;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tenure_protocol::messages::{
    ApiError, CleanupDone, CleanupReply, CleanupRequest, EvidenceReply, EvidenceRequest, OutputChunk, OutputReply,
    OutputRequest, Phase, SidecarRefusal, SidecarReply, SidecarRequest, MAX_OUTPUT_CHUNK,
};
use tenure_protocol::{decode, encode, subjects, TaskId, WorkerId};
use tenure_transport::identity::{owner, reply_to, Trust};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;
use tokio_util::codec::{Framed, LengthDelimitedCodecError};
use tracing::{debug, error, info, warn};

use crate::core::Machine;
use crate::store::{self, SledStore};
use crate::store_thread::StoreHandle;
use tenure_machine::attempt_files::{self, AttemptFiles};
use tenure_machine::evidence::{self, FileFacts};
use tenure_machine::frame_codec;
use tenure_machine::layout::{self, open_output_for_read, Layout};

/// What the sidecar needs to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The machine's data directory (database, socket, output files).
    pub layout: Layout,
    /// This machine's worker id: names the output subject.
    pub worker: WorkerId,
    /// How to reach NATS for output reads, input, evidence and cleanup jobs.
    pub nats: tenure_transport::NatsOptions,
}

/// Why the sidecar could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The data directory could not be prepared.
    #[error(transparent)]
    Layout(#[from] layout::Error),
    /// The recovery store could not be opened or loaded.
    #[error(transparent)]
    Store(#[from] store::Error),
    /// A live sidecar already answers on the socket.
    #[error("another sidecar is serving {0}")]
    SocketInUse(PathBuf),
    /// Something that is not a socket sits at the socket path; it is left alone.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// The socket could not be created.
    #[error("cannot listen on {path}: {source}")]
    Listen { path: PathBuf, source: io::Error },
    /// The NATS options are invalid (connection failures are retried instead).
    #[error(transparent)]
    Nats(#[from] tenure_transport::Error),
    /// The store thread ended before shutdown (it panicked).
    #[error("the sidecar's store thread stopped unexpectedly: {0}")]
    StoreThread(String),
}

/// Runs the sidecar until `shutdown` completes: loads the recovery state,
/// serves the worker's socket and output reads, then stops accepting, flushes,
/// closes the database and removes the socket file.
///
/// Dropping the returned future instead of completing `shutdown` also stops
/// everything, but leaves the socket file for the next run to replace.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    let Options { layout, worker, nats } = opts;
    layout.create_dirs()?;

    let db_dir = layout.db_dir();
    let started = Instant::now();
    let boot = tenure_machine::boot::boot_id();
    let loaded = tokio::task::spawn_blocking(move || {
        Ok::<_, crate::store::Error>(Machine::restore(SledStore::open(&db_dir)?)?.with_boot(boot))
    })
    .await;
    let machine = match loaded {
        Ok(Ok(machine)) => {
            for c in machine.corrupt() {
                warn!(key = %c.key, reason = %c.reason, "unreadable recovery record: its attempt will be refused");
            }
            info!(
                worker = %worker,
                epoch = %machine.epoch(),
                records = machine.records().count(),
                corrupt = machine.corrupt().len(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "recovery state loaded"
            );
            Ok(machine)
        }
        // Another sidecar holds the database: this one must not serve at all.
        Ok(Err(e)) if e.to_string().contains("could not acquire lock") => return Err(e.into()),
        // An unusable store does not crash the sidecar into a restart loop: it
        // serves, refusing every request with the reason, so the worker starts
        // nothing new and settles what runs from its shims' own evidence.
        Ok(Err(e)) => {
            error!(worker = %worker, error = %e, "recovery store unusable; serving degraded (refusing every request)");
            Err(format!("recovery store unusable: {e}"))
        }
        // sled may panic on damaged files rather than return an error.
        Err(panic) => {
            error!(worker = %worker, error = %panic, "recovery store crashed while loading; serving degraded");
            Err(format!("recovery store unusable: it crashed while loading ({panic})"))
        }
    };

    let (handle, mut store_task) = StoreHandle::start(machine);

    let socket = layout.socket_path();
    let listener = match listen(&socket) {
        Ok(listener) => listener,
        Err(e) => {
            drop(handle);
            let _ = store_task.await;
            return Err(e);
        }
    };
    let nats = match tenure_transport::connect(&nats, &format!("tenure-sidecar-{worker}"), true).await {
        Ok(nats) => nats,
        Err(e) => {
            drop((handle, listener));
            let _ = store_task.await;
            remove_socket(&socket);
            return Err(e.into());
        }
    };
    Trust::announce(&nats, "sidecar");
    let output_task =
        tokio::spawn(serve_output(nats.clone(), subjects::output(&worker), handle.clone(), layout.clone()));
    let evidence_task = {
        let (store, layout, client, subject) =
            (handle.clone(), layout.clone(), nats.clone(), subjects::evidence(&worker));
        tokio::spawn(async move {
            serve_leader(client, subject, "evidence queries", |req| evidence(req, &store, &layout)).await
        })
    };
    let cleanup_task = {
        let (store, layout, client, subject) =
            (handle.clone(), layout.clone(), nats.clone(), subjects::cleanup(&worker));
        tokio::spawn(
            async move { serve_leader(client, subject, "cleanup jobs", |req| cleanup(req, &store, &layout)).await },
        )
    };
    let input_task = tokio::spawn(crate::input::serve(nats, subjects::input(&worker), handle.clone(), layout.clone()));
    info!(worker = %worker, socket = %socket.display(), "sidecar serving");

    let mut shutdown = std::pin::pin!(shutdown);
    let mut connections = JoinSet::new();
    let mut outcome = Ok(());
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            ended = &mut store_task => {
                let reason = match ended {
                    Ok(()) => "it returned".to_owned(),
                    Err(e) => e.to_string(),
                };
                error!(%reason, "store thread stopped; shutting down");
                outcome = Err(Error::StoreThread(reason));
                break;
            }
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => match peer_of(&stream, &layout.lock_path()) {
                    Ok(()) => {
                        connections.spawn(serve_connection(stream, handle.clone()));
                    }
                    Err(refusal) => {
                        warn!(peer_pid = ?refusal.pid, peer_uid = ?refusal.uid, reason = %refusal.reason, "connection to the sidecar socket refused: not the worker");
                        drop(stream);
                    }
                },
                Err(error) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(joined) = connections.join_next(), if !connections.is_empty() => {
                if let Err(e) = joined {
                    error!(error = %e, "a connection task failed");
                }
            }
        }
    }

    // Stop accepting, end every user of the store thread, then let it flush and
    // close the database.
    drop(listener);
    connections.shutdown().await;
    output_task.abort();
    evidence_task.abort();
    input_task.abort();
    cleanup_task.abort();
    let _ = cleanup_task.await;
    let _ = output_task.await;
    let _ = evidence_task.await;
    let _ = input_task.await;
    drop(handle);
    if outcome.is_ok() {
        if let Err(e) = store_task.await {
            outcome = Err(Error::StoreThread(e.to_string()));
        }
    }
    remove_socket(&socket);
    info!(worker = %worker, "sidecar stopped");
    outcome
}

// ------------------------------------------------------------------ socket

/// A peer the socket does not answer, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerRefusal {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub reason: String,
}

/// Who may talk on the socket, decided from facts only: the peer's uid and
/// pid (as the kernel recorded them at `connect`), this process's euid and
/// pid, and the pid holding the worker's lock.
///
/// Admitted: a peer of the daemons' user (or root) that is the lock's holder
/// — the worker — or this very process (a sidecar run in-process, as the
/// sidecar's own tests do; a task is never this process).
pub(crate) fn admit(
    peer_uid: u32,
    peer_pid: Option<i32>,
    me: (u32, i32),
    holder: Option<i32>,
) -> Result<(), PeerRefusal> {
    let (euid, my_pid) = me;
    let refuse = |reason: String| Err(PeerRefusal { pid: peer_pid, uid: Some(peer_uid), reason });
    if peer_uid != euid && peer_uid != 0 {
        return refuse(format!("uid {peer_uid} is neither the daemons' user ({euid}) nor root"));
    }
    let Some(pid) = peer_pid.filter(|p| *p > 0) else {
        return refuse("the kernel did not name the peer's process".into());
    };
    if pid == my_pid || Some(pid) == holder {
        return Ok(());
    }
    match holder {
        Some(h) => refuse(format!("pid {pid} is not the worker (the worker's lock is held by pid {h})")),
        None => refuse(format!("pid {pid} is not the worker (no worker holds the lock)")),
    }
}

/// Checks one accepted connection's peer (see [`admit`]).
fn peer_of(stream: &UnixStream, lock: &Path) -> Result<(), PeerRefusal> {
    let cred = stream.peer_cred().map_err(|e| PeerRefusal {
        pid: None,
        uid: None,
        reason: format!("cannot read the peer's credentials: {e}"),
    })?;
    let holder = tenure_machine::worker_lock::holder(lock).map_err(|e| PeerRefusal {
        pid: cred.pid(),
        uid: Some(cred.uid()),
        reason: format!("cannot read the worker's lock {}: {e}", lock.display()),
    })?;
    let me = (nix::unistd::geteuid().as_raw(), std::process::id() as i32);
    admit(cred.uid(), cred.pid(), me, holder)
}

/// Binds the socket (mode 0600). A socket file left by a dead sidecar is
/// replaced; a live one, or a non-socket at that path, is refused.
fn listen(path: &Path) -> Result<UnixListener, Error> {
    let listen_err = |source| Error::Listen { path: path.to_path_buf(), source };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(listen_err(e)),
        Ok(meta) if !meta.file_type().is_socket() => return Err(Error::NotASocket(path.to_path_buf())),
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(Error::SocketInUse(path.to_path_buf()));
            }
            info!(socket = %path.display(), "removing a stale socket file");
            std::fs::remove_file(path).map_err(listen_err)?;
        }
    }
    let listener = UnixListener::bind(path).map_err(listen_err)?;
    // The data directory is 0700 as well, which covers the instant between bind
    // and chmod.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(listen_err)?;
    Ok(listener)
}

fn remove_socket(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(error) => warn!(%error, socket = %path.display(), "cannot remove the socket file"),
    }
}

/// A traced attempt's intent is a span of the task's trace: the flush that
/// makes the attempt "may have run" is worth seeing. The spans of a
/// request's traced intents (itself, or those of its batch), each lasting
/// until the request is answered, that is durable.
fn intent_spans(req: &SidecarRequest) -> Vec<tracing::Span> {
    match req {
        SidecarRequest::Intent { task, attempt, epoch, trace: Some(trace) } => {
            let span = tracing::info_span!("intent", task = %task, attempt = %attempt, epoch = %epoch);
            tenure_transport::trace::continue_from(&span, tenure_transport::trace::from_traceparent(Some(trace)));
            vec![span]
        }
        SidecarRequest::Many(reqs) => reqs.iter().flat_map(intent_spans).collect(),
        _ => Vec::new(),
    }
}

/// Serves one worker connection: requests are answered in order. A malformed
/// request is refused and the connection continues; an oversized or broken
/// frame ends the connection (the stream cannot be resynchronized).
async fn serve_connection(stream: UnixStream, store: StoreHandle) {
    let mut framed = Framed::new(stream, frame_codec());
    loop {
        let frame = match framed.next().await {
            None => return,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => {
                if error.get_ref().is_some_and(|inner| inner.is::<LengthDelimitedCodecError>()) {
                    warn!(%error, "oversized frame on the sidecar socket; closing the connection");
                } else {
                    debug!(%error, "sidecar connection ended");
                }
                return;
            }
        };
        let reply = match decode::<SidecarRequest>(&frame) {
            Ok(req) => {
                let spans = intent_spans(&req);
                let reply = store.handle(req).await;
                drop(spans);
                reply
            }
            Err(error) => {
                warn!(%error, "malformed request on the sidecar socket");
                SidecarReply::Refused(SidecarRefusal::Malformed(error.to_string()))
            }
        };
        let bytes = encode(&reply).or_else(|error| {
            // Only a `Records` reply can outgrow the message limit.
            warn!(%error, "reply too large to encode");
            encode(&SidecarReply::Refused(SidecarRefusal::Storage(format!("the reply cannot be encoded: {error}"))))
        });
        let Ok(bytes) = bytes else { return };
        if let Err(error) = framed.send(Bytes::from(bytes)).await {
            debug!(%error, "sidecar connection ended while replying");
            return;
        }
    }
}

// ------------------------------------------------------------ output reads

/// Answers output reads until aborted. Each request is decoded, checked against
/// the owner of the task's latest attempt, and answered from the output file.
async fn serve_output(client: async_nats::Client, subject: String, store: StoreHandle, layout: Layout) {
    let mut requests = match client.subscribe(subject.clone()).await {
        Ok(sub) => sub,
        Err(error) => {
            error!(%error, subject, "cannot subscribe to output reads; they will not be served");
            return;
        }
    };
    while let Some(msg) = requests.next().await {
        let Some(reply_to) = reply_to(&msg) else {
            debug!("output request without an inbox to answer");
            continue;
        };
        let reply = read_output(&store, &layout, &msg, Trust::of(&client)).await;
        let bytes = encode(&reply).or_else(|error| {
            warn!(%error, "output reply too large to encode");
            encode(&OutputReply::Err(ApiError::Unavailable(format!("cannot encode the reply: {error}"))))
        });
        let Ok(bytes) = bytes else { continue };
        if let Err(error) = client.publish(reply_to, bytes.into()).await {
            warn!(%error, "cannot send an output reply");
        }
    }
    warn!(subject, "the output subscription ended; output reads are no longer served");
}

async fn read_output(store: &StoreHandle, layout: &Layout, msg: &async_nats::Message, trust: Trust) -> OutputReply {
    let req: OutputRequest = decode(&msg.payload).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let caller =
        owner(trust, msg.headers.as_ref(), &req.session).map_err(|e| ApiError::Unauthenticated(e.to_string()))?;
    let not_found = || ApiError::NotFound(req.task.to_string());
    // The phase is read before the file: if the attempt had exited by then, every
    // byte it wrote is already in the file, so `finished` never hides a tail.
    let Some((owner, phase, final_output)) = store.output_owner(req.task.clone()).await? else {
        return Err(not_found());
    };
    if owner != caller {
        return Err(not_found());
    }
    if final_output {
        return Err(ApiError::InvalidRequest(format!(
            "{} is final-output-only: its output is read from the coordinator once it ended",
            req.task
        )));
    }
    let path = layout.output_path(&req.task);
    let (offset, want) = (req.offset, req.max.min(MAX_OUTPUT_CHUNK) as usize);
    let read = tokio::task::spawn_blocking(move || read_chunk(&path, offset, want))
        .await
        .map_err(|e| ApiError::Unavailable(format!("output read failed: {e}")))?;
    let (data, size) = read.map_err(|error| {
        warn!(task = %req.task, %error, "cannot read output");
        ApiError::Unavailable(format!("cannot read the output of {}: {error}", req.task))
    })?;
    Ok(OutputChunk { next_offset: offset + data.len() as u64, data, size, finished: phase >= Phase::Exited })
}

/// Answers the leader's requests on `subject`, one at a time, until aborted:
/// each is decoded (a malformed one is refused `Malformed`), answered by
/// `answer`, and the reply sent back encoded.
async fn serve_leader<Req, Rep, F, Fut>(client: async_nats::Client, subject: String, what: &'static str, answer: F)
where
    Req: serde::de::DeserializeOwned,
    Rep: serde::Serialize,
    F: Fn(Req) -> Fut,
    Fut: Future<Output = Result<Rep, SidecarRefusal>>,
{
    let mut requests = match client.subscribe(subject.clone()).await {
        Ok(sub) => sub,
        Err(error) => {
            error!(%error, subject, what, "cannot subscribe; these requests will not be answered");
            return;
        }
    };
    while let Some(msg) = requests.next().await {
        let Some(reply_to) = reply_to(&msg) else { continue };
        let reply = match decode::<Req>(&msg.payload) {
            Err(e) => Err(SidecarRefusal::Malformed(e.to_string())),
            Ok(req) => answer(req).await,
        };
        match encode(&reply) {
            Ok(bytes) => {
                if let Err(error) = client.publish(reply_to, bytes.into()).await {
                    warn!(%error, what, "cannot send a reply");
                }
            }
            Err(error) => warn!(%error, what, "reply cannot be encoded"),
        }
    }
}

/// Carries out one cleanup job: the epoch fence first (a deposed leader's job
/// removes nothing), then files (output, scratch directories and attempts' files), then records;
/// refused while any attempt of the task still has a live shim here. A
/// cancellation passes the fence and counts what is here instead.
async fn cleanup(req: CleanupRequest, store: &StoreHandle, layout: &Layout) -> CleanupReply {
    let records = store.cleanup(req.clone(), true).await?;
    let (layout, task, cancel) = (layout.clone(), req.task.clone(), req.cancel);
    let files = tokio::task::spawn_blocking(move || {
        let found = task_files(&layout, &task)?;
        match cancel {
            true => Ok(found.count()),
            false => found.remove(&task),
        }
    })
    .await;
    match files {
        Ok(Ok(files)) if cancel => Ok(CleanupDone { files, records }),
        Ok(Ok(files)) => store.cleanup(req, false).await.map(|records| CleanupDone { files, records }),
        Ok(Err(refusal)) => Err(refusal),
        Err(e) => Err(SidecarRefusal::Storage(e.to_string())),
    }
}

/// The files of one task on this machine.
struct TaskFiles {
    output: Option<PathBuf>,
    attempts: Vec<AttemptFiles>,
    /// Its attempts' scratch directories (working directory and HOME).
    scratch_dirs: Vec<PathBuf>,
}

impl TaskFiles {
    fn count(&self) -> u32 {
        (self.output.is_some() as u32) + self.attempts.len() as u32 + self.scratch_dirs.len() as u32
    }

    fn remove(self, task: &TaskId) -> Result<u32, SidecarRefusal> {
        if self.attempts.iter().any(|files| files.shim().is_some_and(|m| m.alive())) {
            return Err(SidecarRefusal::StillRunning { task: task.clone() });
        }
        let mut removed = 0;
        if let Some(output) = &self.output {
            match std::fs::remove_file(output) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SidecarRefusal::Storage(format!("cannot remove the output of {task}: {e}"))),
            }
        }
        // The scratch directories first: the attempts' files are what says a
        // shim may still run there. `remove_dir_all` never follows a link a
        // task left inside its directory.
        for dir in self.scratch_dirs {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SidecarRefusal::Storage(format!("cannot remove {}: {e}", dir.display()))),
            }
        }
        for files in self.attempts {
            files.remove().map_err(|e| {
                SidecarRefusal::Storage(format!("cannot remove the files of {}: {e}", files.base().display()))
            })?;
            removed += 1;
        }
        Ok(removed)
    }
}

/// A finished task's output file, attempts' files and scratch directories
/// (each attempt named `<task>.<attempt>` in the attempts directory and in
/// the worker's scratch root).
fn task_files(layout: &Layout, task: &TaskId) -> Result<TaskFiles, SidecarRefusal> {
    let prefix = format!("{task}.");
    let of_task = |name: &str| name.strip_prefix(&prefix).is_some_and(|a| a.parse::<u32>().is_ok());
    let attempts = attempt_files::list(&layout.attempts_dir())
        .into_iter()
        .filter(|(name, _)| of_task(name))
        .map(|(_, files)| files)
        .collect();
    let scratch_dirs = layout
        .scratch_root()
        .map(|root| {
            std::fs::read_dir(root)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_str().is_some_and(of_task))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    let output = layout.output_path(task);
    let output = match std::fs::symlink_metadata(&output) {
        Ok(_) => Some(output),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(SidecarRefusal::Storage(format!("cannot look at the output of {task}: {e}"))),
    };
    Ok(TaskFiles { output, attempts, scratch_dirs })
}

/// Answers one evidence query from the records and the attempt's own files.
async fn evidence(req: EvidenceRequest, store: &StoreHandle, layout: &Layout) -> EvidenceReply {
    let files = layout.attempt_files(&req.task, req.attempt);
    let view = store.evidence(req.clone()).await;
    let answer = tokio::task::spawn_blocking(move || evidence::answer(view, &FileFacts::read(&files))).await;
    let answer = answer.unwrap_or_else(|e| Err(SidecarRefusal::Storage(e.to_string())));
    info!(task = %req.task, attempt = %req.attempt, epoch = %req.epoch, ?answer, "answered an evidence query");
    answer
}

/// Reads up to `want` bytes at `offset`; returns them and the file size. A
/// missing file is empty output so far.
fn read_chunk(path: &Path, offset: u64, want: usize) -> io::Result<(Vec<u8>, u64)> {
    let file = match open_output_for_read(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let size = file.metadata()?.len();
    let len = size.saturating_sub(offset).min(want as u64) as usize;
    let mut data = vec![0; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut data[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    data.truncate(filled);
    Ok((data, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_worker_or_this_process_is_admitted() {
        let me = (1000, 50);
        // The worker: our user, holding the lock.
        assert!(admit(1000, Some(70), me, Some(70)).is_ok());
        // Root holding the lock (daemons run as another user, worker as root).
        assert!(admit(0, Some(70), me, Some(70)).is_ok());
        // This process itself.
        assert!(admit(1000, Some(50), me, None).is_ok());
        // A task of our own user that is not the lock holder.
        let e = admit(1000, Some(71), me, Some(70)).unwrap_err();
        assert!(e.reason.contains("held by pid 70"), "{e:?}");
        assert!(admit(1000, Some(71), me, None).unwrap_err().reason.contains("no worker"));
        // Another user, even one that somehow names the holder's pid.
        assert!(admit(65534, Some(70), me, Some(70)).unwrap_err().reason.contains("uid 65534"));
        // No pid from the kernel.
        assert!(admit(1000, None, me, Some(70)).is_err());
        assert!(admit(1000, Some(0), me, Some(0)).is_err());
    }

    #[test]
    fn read_chunk_edges() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.out");
        assert_eq!(read_chunk(&path, 0, 10).unwrap(), (vec![], 0));
        std::fs::write(&path, b"hello world").unwrap();
        assert_eq!(read_chunk(&path, 0, 5).unwrap(), (b"hello".to_vec(), 11));
        assert_eq!(read_chunk(&path, 6, 100).unwrap(), (b"world".to_vec(), 11));
        assert_eq!(read_chunk(&path, 11, 100).unwrap(), (vec![], 11));
        assert_eq!(read_chunk(&path, 500, 100).unwrap(), (vec![], 11));
        assert_eq!(read_chunk(&path, 0, 0).unwrap(), (vec![], 11));
        std::os::unix::fs::symlink(&path, tmp.path().join("link.out")).unwrap();
        assert!(read_chunk(&tmp.path().join("link.out"), 0, 5).is_err());
    }
}
