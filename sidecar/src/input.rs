//! Input for running `agent` tasks (`tenure send`): the sidecar's side of
//! `tenure.sidecar.<worker>.input`, and the only code that writes into an
//! attempt's input FIFO.
//!
//! The sidecar, not the worker, delivers input, so input reaches a task while
//! its worker is down or restarting: the FIFO is held open by the task's
//! shim ([`tenure_machine::attempt_files`]), which outlives the worker.
//!
//! A request is checked like an output read — only the owner of the task's
//! latest attempt on this machine is answered, anyone else gets `NotFound` —
//! then against that attempt: an `agent` task (`NoInput` otherwise) whose
//! process may run (phase `intent` or `spawned`; `NotRunning` otherwise). The
//! FIFO then has the last word: absent, or open by nobody, means the task is
//! not running any more.
//!
//! **Invariant:** a message is delivered whole or not at all, and never
//! interleaved with another. Deliveries to one FIFO hold its lock for the
//! whole write, and the sidecar is the FIFO's only writer (the task holds the
//! read end only). A message of at most `PIPE_BUF` (4096) bytes is one atomic
//! write; a larger one is written only once the pipe is empty, when one write
//! takes it whole (see `write_whole`). A task that does not read leaves its
//! pipe full: after [`PATIENCE`] the message is refused as `InputFull`, with
//! nothing of it written.
//!
//! This module never blocks the sidecar on a task (every wait is bounded by
//! [`PATIENCE`] from the request's arrival, so the answer comes before the
//! client gives up), never creates or removes a FIFO, and writes only to a FIFO
//! opened with `O_NOFOLLOW | O_NONBLOCK`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use nix::fcntl::{fcntl, FcntlArg};
use tenure_protocol::messages::{ApiError, AttemptRecord, InputAck, InputReply, InputRequest, Phase, MAX_INPUT_BYTES};
use tenure_protocol::{decode, encode, Attempt, Kind, TaskId};
use tenure_transport::identity::{owner, reply_to, Trust};
use tokio::sync::{OwnedMutexGuard, Semaphore};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::store_thread::StoreHandle;
use tenure_machine::attempt_files::{AttemptFiles, InputError};
use tenure_machine::layout::Layout;

/// How long one delivery may wait, from its arrival, for its turn at the FIFO
/// and for room in the pipe. Well under the client's 5 s request timeout, so
/// that a refused message is answered as refused, not left in doubt.
pub const PATIENCE: Duration = Duration::from_secs(2);

/// Deliveries handled at once (each waits at most [`PATIENCE`]).
const CONCURRENT: usize = 64;

/// Answers input requests until aborted; each is handled in its own task so a
/// task that does not read its input never delays input for another.
pub(crate) async fn serve(client: async_nats::Client, subject: String, store: StoreHandle, layout: Layout) {
    let mut requests = match client.subscribe(subject.clone()).await {
        Ok(sub) => sub,
        Err(error) => {
            error!(%error, subject, "cannot subscribe to agent input; it will not be delivered");
            return;
        }
    };
    let locks = Arc::new(FifoLocks::default());
    let slots = Arc::new(Semaphore::new(CONCURRENT));
    while let Some(msg) = requests.next().await {
        let arrived = Instant::now();
        let Some(reply_to) = reply_to(&msg) else {
            debug!("input request without an inbox to answer");
            continue;
        };
        let trust = Trust::of(&client);
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let (client, store, layout, locks) = (client.clone(), store.clone(), layout.clone(), locks.clone());
        tokio::spawn(async move {
            let reply = deliver(&store, &layout, &locks, &msg, trust, arrived + PATIENCE).await;
            match encode(&reply) {
                Ok(bytes) => {
                    if let Err(error) = client.publish(reply_to, bytes.into()).await {
                        warn!(%error, "cannot send an input reply");
                    }
                }
                Err(error) => warn!(%error, "input reply cannot be encoded"),
            }
            drop(slot);
        });
    }
    warn!(subject, "the input subscription ended; agent input is no longer delivered");
}

/// Checks one request and writes its message into the task's FIFO.
async fn deliver(
    store: &StoreHandle,
    layout: &Layout,
    locks: &Arc<FifoLocks>,
    msg: &async_nats::Message,
    trust: Trust,
    deadline: Instant,
) -> InputReply {
    let req: InputRequest = decode(&msg.payload).map_err(|e| ApiError::InvalidRequest(e.to_string()))?;
    let caller =
        owner(trust, msg.headers.as_ref(), &req.session).map_err(|e| ApiError::Unauthenticated(e.to_string()))?;
    let size = req.data.len();
    if size == 0 || size > MAX_INPUT_BYTES {
        return Err(ApiError::InputSize { size: size as u64, max: MAX_INPUT_BYTES as u64 });
    }
    let not_found = || ApiError::NotFound(req.task.to_string());
    let record = store.latest(req.task.clone()).await?.ok_or_else(not_found)?;
    if record.grant.owner != caller {
        return Err(not_found());
    }
    let attempt = check_target(&record)?;
    let task = &req.task;
    let files = layout.attempt_files(task, attempt);
    let Ok(_turn) = tokio::time::timeout_at(deadline, locks.hold((task.clone(), attempt))).await else {
        info!(task = %task, attempt = %attempt, bytes = size, "input refused: earlier input still waiting");
        return Err(ApiError::InputFull { task: task.to_string() });
    };
    let not_running = |status: &str| ApiError::NotRunning { task: task.to_string(), status: status.to_owned() };
    let fifo = match open_when_ready(&files, deadline).await {
        Ok(fifo) => fifo,
        Err(InputError::Absent) => return Err(not_running("its process has not started or has ended")),
        Err(InputError::NoReader) => return Err(not_running("it has ended or its shim is gone")),
        Err(error) => {
            warn!(task = %task, attempt = %attempt, %error, "input pipe refused");
            return Err(ApiError::Unavailable(format!("cannot deliver input to {task}: {error}")));
        }
    };
    match write_whole(&fifo, &req.data, deadline).await {
        Ok(()) => {
            info!(task = %task, attempt = %attempt, bytes = size, "input delivered");
            Ok(InputAck { attempt, bytes: size as u64, kept: false })
        }
        Err(WriteError::Full) => {
            info!(task = %task, attempt = %attempt, bytes = size, "input refused: the task's pipe is full");
            Err(ApiError::InputFull { task: task.to_string() })
        }
        Err(WriteError::Ended { written: 0 }) => Err(not_running("it ended")),
        Err(error) => {
            warn!(task = %task, attempt = %attempt, bytes = size, %error, "input delivery failed");
            Err(ApiError::Unavailable(format!("input to {task}: {error}")))
        }
    }
}

/// Opens the attempt's FIFO for one delivery. An attempt is `running` as soon
/// as its shim started, a moment before the shim has made the FIFO: an
/// absent FIFO is waited for (bounded by `deadline`) while the shim is not
/// known to be gone.
async fn open_when_ready(files: &AttemptFiles, deadline: Instant) -> Result<File, InputError> {
    loop {
        match files.open_input_for_write() {
            Err(InputError::Absent) if Instant::now() < deadline => {
                let gone = files.journal().ok().and_then(|j| j.shim).is_some_and(|m| !m.alive());
                if gone {
                    return Err(InputError::Absent);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// The attempt that may take input, or why none does.
fn check_target(record: &AttemptRecord) -> Result<Attempt, ApiError> {
    let task = record.grant.task.to_string();
    let kind = &record.grant.spec.kind;
    if *kind != Kind::agent() {
        return Err(ApiError::NoInput { task, kind: kind.to_string() });
    }
    let status = match record.phase {
        // The worker may hold an attempt at `intent` for its whole life (it
        // re-attached to the shim before recording `spawned`): the FIFO decides.
        Phase::Intent | Phase::Spawned => return Ok(record.grant.attempt),
        Phase::Accepted => "it has not started yet",
        Phase::Exited | Phase::Acknowledged => "it ended",
    };
    Err(ApiError::NotRunning { task, status: status.to_owned() })
}

/// Why a message could not be written.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    /// The pipe had no room for the whole message before the deadline; nothing
    /// was written.
    #[error("the input pipe is full")]
    Full,
    /// The message is larger than the pipe can be made, and the task stopped
    /// reading part-way through it.
    #[error("the task stopped reading after {written} of {size} bytes")]
    Stalled { written: usize, size: usize },
    /// Nobody reads the pipe any more: the task ended meanwhile.
    #[error("the task ended after {written} bytes of the message were written")]
    Ended { written: usize },
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Writes all of `data` or, when the task leaves no room before `deadline`,
/// nothing. The FIFO is non-blocking, so no call here waits on the task;
/// waiting is done by polling until `deadline`.
///
/// A pipe's room is counted in pages, not bytes, so it cannot be predicted
/// from the bytes queued. Hence two paths: a message of at most `PIPE_BUF`
/// bytes is one write, which POSIX makes atomic (all of it, or `EAGAIN` and
/// none of it); a larger one starts only when the pipe is empty (the task has
/// read everything sent before), when one write takes it whole.
async fn write_whole(fifo: &File, data: &[u8], deadline: Instant) -> Result<(), WriteError> {
    let mut pause = Duration::from_millis(2);
    let wait = |pause: &mut Duration| {
        let (now, step) = (Instant::now(), *pause);
        *pause = (step * 2).min(Duration::from_millis(50));
        (now + step <= deadline).then(|| tokio::time::sleep(step))
    };
    let mut writer = fifo;
    if data.len() <= PIPE_BUF {
        loop {
            match writer.write(data) {
                Ok(n) if n == data.len() => return Ok(()),
                Ok(n) => return Err(WriteError::Stalled { written: n, size: data.len() }),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match wait(&mut pause) {
                    Some(sleep) => sleep.await,
                    None => return Err(WriteError::Full),
                },
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(WriteError::Ended { written: 0 }),
                Err(e) => return Err(e.into()),
            }
        }
    }
    if pipe_capacity(fifo)? < data.len() {
        // Grow the pipe to hold the message (unprivileged users may, up to the
        // system's pipe-max-size); failing that, the message is streamed.
        let _ = fcntl(fifo.as_raw_fd(), FcntlArg::F_SETPIPE_SZ(data.len() as nix::libc::c_int));
    }
    while pipe_queued(fifo)? > 0 {
        match wait(&mut pause) {
            Some(sleep) => sleep.await,
            None => return Err(WriteError::Full),
        }
    }
    let mut written = 0;
    while written < data.len() {
        match writer.write(&data[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Only when the pipe could not be made as large as the message.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(WriteError::Stalled { written, size: data.len() });
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(WriteError::Ended { written }),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes of at most this many bytes to a pipe are atomic (POSIX; 4096 on Linux).
const PIPE_BUF: usize = nix::libc::PIPE_BUF;

/// The pipe's capacity in bytes.
fn pipe_capacity(fifo: &File) -> io::Result<usize> {
    let size = fcntl(fifo.as_raw_fd(), FcntlArg::F_GETPIPE_SZ).map_err(io::Error::from)?;
    Ok(usize::try_from(size).unwrap_or(0))
}

/// Bytes written to the pipe and not read yet.
fn pipe_queued(fifo: &File) -> io::Result<usize> {
    let mut queued: nix::libc::c_int = 0;
    // SAFETY: FIONREAD stores one `c_int` through the pointer, which points to
    // a live local; the descriptor belongs to `fifo`, open for the whole call.
    let rc = unsafe { nix::libc::ioctl(fifo.as_raw_fd(), nix::libc::FIONREAD, &mut queued) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(queued).unwrap_or(0))
}

/// One async lock per input FIFO, so that two deliveries to one task never
/// interleave. Entries live only while someone holds or awaits them.
#[derive(Default)]
struct FifoLocks {
    locks: Mutex<LockMap>,
}

/// One FIFO per attempt: its lock, by task and attempt.
type LockMap = HashMap<(TaskId, Attempt), Arc<tokio::sync::Mutex<()>>>;

impl FifoLocks {
    /// Waits for the turn at `key`'s FIFO (first come, first served).
    async fn hold(self: &Arc<Self>, key: (TaskId, Attempt)) -> Turn {
        let lock = self.map().entry(key.clone()).or_default().clone();
        let guard = lock.clone().lock_owned().await;
        Turn { locks: self.clone(), key, lock, guard: Some(guard) }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, LockMap> {
        self.locks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A held turn at one FIFO; releasing it forgets the lock when nobody waits.
struct Turn {
    locks: Arc<FifoLocks>,
    key: (TaskId, Attempt),
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.guard = None;
        let mut map = self.locks.map();
        // The map's reference and ours: nobody else holds or awaits it. New
        // references are only taken under the map's lock, held here.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use tenure_machine::attempt_files::InputFifo;
    use tenure_protocol::messages::LeaseGrant;
    use tenure_protocol::{Epoch, TaskSpec};

    fn fifo() -> (tempfile::TempDir, AttemptFiles, InputFifo) {
        let tmp = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(tmp.path().join("agent-1.1"));
        let ends = files.create_input().unwrap();
        (tmp, files, ends)
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(300)
    }

    #[tokio::test]
    async fn a_message_larger_than_pipe_buf_arrives_whole() {
        let (_tmp, files, InputFifo { keeper: _keeper, mut stdin }) = fifo();
        let data: Vec<u8> = (0..MAX_INPUT_BYTES).map(|i| (i % 251) as u8).collect();
        let w = files.open_input_for_write().unwrap();
        write_whole(&w, &data, soon()).await.unwrap();
        let mut got = vec![0u8; data.len()];
        stdin.read_exact(&mut got).unwrap();
        assert_eq!(got, data);
    }

    /// Fills the pipe with 11-byte messages until one is refused; returns the bytes queued.
    async fn fill(w: &File) -> usize {
        let mut sent = 0;
        let quick = Instant::now() + Duration::from_millis(20);
        while write_whole(w, &[b'a'; 11], quick).await.is_ok() {
            sent += 11;
        }
        sent
    }

    #[tokio::test]
    async fn a_full_pipe_refuses_the_message_and_writes_nothing_of_it() {
        let (_tmp, files, InputFifo { keeper: _keeper, mut stdin }) = fifo();
        let w = files.open_input_for_write().unwrap();
        let queued = fill(&w).await;
        assert!(queued > 0 && pipe_queued(&w).unwrap() == queued);
        assert!(matches!(write_whole(&w, &[b'b'; 11], soon()).await, Err(WriteError::Full)));
        assert_eq!(pipe_queued(&w).unwrap(), queued, "nothing of the refused message was written");
        // Room again once the task reads (a page's worth).
        let mut buf = vec![0u8; 8192];
        stdin.read_exact(&mut buf).unwrap();
        write_whole(&w, &[b'b'; 11], soon()).await.unwrap();
        assert_eq!(pipe_queued(&w).unwrap(), queued - 8192 + 11);
    }

    #[tokio::test]
    async fn a_large_message_waits_for_the_task_to_read_what_came_before() {
        let (_tmp, files, InputFifo { keeper: _keeper, mut stdin }) = fifo();
        let w = files.open_input_for_write().unwrap();
        write_whole(&w, b"first\n", soon()).await.unwrap();
        let big = vec![b'x'; PIPE_BUF + 1];
        assert!(matches!(write_whole(&w, &big, soon()).await, Err(WriteError::Full)));
        assert_eq!(pipe_queued(&w).unwrap(), 6, "nothing of the refused message was written");
        // The task reads while the delivery waits: it goes through, whole.
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let mut got = vec![0u8; 6 + PIPE_BUF + 1];
            stdin.read_exact(&mut got).unwrap();
            got
        });
        write_whole(&w, &big, soon()).await.unwrap();
        let got = reader.join().unwrap();
        assert_eq!(&got[..6], b"first\n");
        assert_eq!(&got[6..], &big[..]);
    }

    #[tokio::test]
    async fn concurrent_deliveries_take_turns() {
        let locks = Arc::new(FifoLocks::default());
        let key: (TaskId, Attempt) = ("agent-1".parse().unwrap(), Attempt(1));
        let first = locks.hold(key.clone()).await;
        let waiting = tokio::time::timeout(Duration::from_millis(50), locks.hold(key.clone())).await;
        assert!(waiting.is_err(), "a second delivery waits for the first");
        drop(first);
        let second = locks.hold(key.clone()).await;
        drop(second);
        assert!(locks.map().is_empty(), "released locks are forgotten");
    }

    #[test]
    fn only_running_agent_attempts_take_input() {
        let grant = |kind: &str| LeaseGrant {
            input: Vec::new(),
            task: format!("{kind}-4").parse().unwrap(),
            attempt: Attempt(2),
            epoch: Epoch(1),
            owner: "o".parse().unwrap(),
            spec: TaskSpec { kind: kind.parse().unwrap(), ..TaskSpec::shell("l", "cat") },
            mark: None,
        };
        let record =
            |kind: &str, phase| AttemptRecord { grant: grant(kind), phase, pid: None, outcome: None, boot: None };
        assert_eq!(check_target(&record("agent", Phase::Spawned)), Ok(Attempt(2)));
        assert_eq!(check_target(&record("agent", Phase::Intent)), Ok(Attempt(2)));
        for phase in [Phase::Accepted, Phase::Exited, Phase::Acknowledged] {
            assert!(matches!(check_target(&record("agent", phase)), Err(ApiError::NotRunning { .. })), "{phase:?}");
        }
        assert!(matches!(check_target(&record("shell", Phase::Spawned)), Err(ApiError::NoInput { .. })));
    }
}
