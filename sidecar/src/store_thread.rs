//! The store thread: the one thread that owns the sidecar's [`Machine`] and
//! its sled database, and [`StoreHandle`], the cheap handle every connection
//! and NATS task uses to reach it. Requests are applied one at a time; those
//! waiting together are committed by one flush and answered only after it
//! (group commit), so sled's fsyncs never stall the async runtime. While no
//! command waits, the store does its housekeeping a chunk at a time
//! ([`RecoveryStore::tidy`]: giving sled the writes it was not given yet).
//!
//! It never reads a socket or a NATS message and never touches task files.

use tenure_protocol::messages::{
    ApiError, AttemptRecord, CleanupRequest, EvidenceRequest, Phase, SidecarRefusal, SidecarReply, SidecarRequest,
};
use tenure_protocol::{SessionId, TaskId};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::core::{Machine, RecordView};
use crate::store::RecoveryStore;

enum Command {
    /// Boxed: a request carries a whole grant (and its task's spec), far
    /// larger than the other commands.
    Handle(Box<SidecarRequest>, oneshot::Sender<SidecarReply>),
    /// Owner and phase of the latest attempt of a task, for output reads.
    OutputOwner(TaskId, oneshot::Sender<Option<(SessionId, Phase, bool)>>),
    /// A cleanup job (after the task's files were removed).
    Cleanup(CleanupRequest, oneshot::Sender<Result<u32, SidecarRefusal>>),
    /// The epoch fence of a cleanup request, before anything is removed.
    CleanupFence(CleanupRequest, oneshot::Sender<Result<u32, SidecarRefusal>>),
    /// The leader's evidence query (which may revoke an accepted attempt).
    Evidence(EvidenceRequest, oneshot::Sender<Result<RecordView, SidecarRefusal>>),
    /// The record of the latest attempt of a task, for input deliveries.
    Latest(TaskId, oneshot::Sender<Option<AttemptRecord>>),
}

/// A cheap, cloneable way to reach the store thread.
#[derive(Clone)]
pub(crate) struct StoreHandle {
    tx: mpsc::Sender<Command>,
}

impl StoreHandle {
    /// Commands waiting for the store thread (for tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Starts the store thread with `machine` (or the reason the store is
    /// unusable): the handle, and the thread, which ends once every handle
    /// is dropped and the store is flushed.
    pub(crate) fn start<S: RecoveryStore + Send + 'static>(
        machine: Result<Machine<S>, String>,
    ) -> (StoreHandle, tokio::task::JoinHandle<()>) {
        let (tx, commands) = mpsc::channel(64);
        (StoreHandle { tx }, tokio::task::spawn_blocking(move || own_machine(machine, commands)))
    }

    pub(crate) async fn handle(&self, req: SidecarRequest) -> SidecarReply {
        let (tx, rx) = oneshot::channel();
        let gone = || SidecarReply::Refused(SidecarRefusal::Storage("the sidecar is shutting down".to_owned()));
        if self.tx.send(Command::Handle(Box::new(req), tx)).await.is_err() {
            return gone();
        }
        rx.await.unwrap_or_else(|_| gone())
    }

    pub(crate) async fn cleanup(&self, req: CleanupRequest, fence_only: bool) -> Result<u32, SidecarRefusal> {
        let (tx, rx) = oneshot::channel();
        let gone = || SidecarRefusal::Storage("the sidecar is shutting down".to_owned());
        let command = if fence_only { Command::CleanupFence(req, tx) } else { Command::Cleanup(req, tx) };
        self.tx.send(command).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    pub(crate) async fn evidence(&self, req: EvidenceRequest) -> Result<RecordView, SidecarRefusal> {
        let (tx, rx) = oneshot::channel();
        let gone = || SidecarRefusal::Storage("the sidecar is shutting down".to_owned());
        self.tx.send(Command::Evidence(req, tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// The latest attempt of `task` held here (`None` also when the store is
    /// unusable: like an output read, input then finds no task).
    pub(crate) async fn latest(&self, task: TaskId) -> Result<Option<AttemptRecord>, ApiError> {
        let (tx, rx) = oneshot::channel();
        let gone = || ApiError::Unavailable("the sidecar is shutting down".to_owned());
        self.tx.send(Command::Latest(task, tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }

    /// Owner, phase, and whether the task is final-output-only.
    pub(crate) async fn output_owner(&self, task: TaskId) -> Result<Option<(SessionId, Phase, bool)>, ApiError> {
        let (tx, rx) = oneshot::channel();
        let gone = || ApiError::Unavailable("the sidecar is shutting down".to_owned());
        self.tx.send(Command::OutputOwner(task, tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())
    }
}

/// Most requests committed by one flush.
const MAX_BATCH: usize = 64;

fn request_name(req: &SidecarRequest) -> &'static str {
    match req {
        SidecarRequest::ObserveEpoch(_) => "observe-epoch",
        SidecarRequest::Accept(_) => "accept",
        SidecarRequest::Intent { .. } => "intent",
        SidecarRequest::Spawned { .. } => "spawned",
        SidecarRequest::Exited { .. } => "exited",
        SidecarRequest::Acknowledged { .. } => "acknowledged",
        SidecarRequest::Abandon { .. } => "abandon",
        SidecarRequest::List | SidecarRequest::ListFrom { .. } => "list",
        SidecarRequest::Many(_) => "many",
        SidecarRequest::Incarnation => "incarnation",
    }
}

/// Owns the machine: applies commands one at a time until every handle is gone,
/// then flushes. The machine (and with it the sled database) is dropped when
/// this returns.
///
/// **Group commit.** Every command waiting in the channel is taken at once (up
/// to [`MAX_BATCH`]), applied in order with the store's flush deferred, then
/// one flush commits them all, and only then is any of them answered: an `Ok`
/// still means durable. Should that flush fail, nothing of the batch is known
/// to be durable: every command of it is refused, and the sidecar serves
/// degraded (refusing everything) until it is restarted and reloads its store.
///
/// A batch of nothing but reads, `Spawned` and `Acknowledged` records is
/// answered without a flush of its own ([`waits_for_a_flush`]): the records
/// become durable with the next batch's flush (or a checkpoint). An
/// `Acknowledged` lost in a crash only makes the worker report the outcome
/// again, which the leader acknowledges as a repeat (durability note a7); a
/// `Spawned` lost leaves the attempt at `intent`, which every decision
/// treats exactly as `spawned` (note a9). Their flushes no longer sit in
/// front of the next attempt's accept.
fn own_machine<S: RecoveryStore>(mut machine: Result<Machine<S>, String>, mut commands: mpsc::Receiver<Command>) {
    loop {
        let first = match commands.try_recv() {
            Ok(command) => command,
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            // Idle: the store's housekeeping, a little at a time.
            Err(mpsc::error::TryRecvError::Empty) if machine.as_ref().is_ok_and(|m| m.store().tidy()) => continue,
            Err(mpsc::error::TryRecvError::Empty) => match commands.blocking_recv() {
                Some(command) => command,
                None => break,
            },
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match commands.try_recv() {
                Ok(command) => batch.push(command),
                Err(_) => break,
            }
        }
        if let Ok(m) = &mut machine {
            m.store_mut().defer_flush(true);
        }
        let flush = batch.iter().any(waits_for_a_flush);
        let answers: Vec<Answer> = batch.into_iter().map(|c| apply(c, &mut machine)).collect();
        let flushed = match &mut machine {
            Ok(m) => {
                m.store_mut().defer_flush(false);
                if flush {
                    m.store().flush().map_err(|e| format!("flushing the recovery store failed: {e}"))
                } else {
                    Ok(())
                }
            }
            Err(_) => Ok(()),
        };
        match flushed {
            Ok(()) => answers.into_iter().for_each(Answer::send),
            Err(reason) => {
                error!(%reason, "serving degraded until restarted");
                for answer in answers {
                    answer.refuse(&reason);
                }
                machine = Err(reason);
            }
        }
    }
    if let Ok(machine) = &machine {
        if let Err(error) = machine.store().flush() {
            warn!(%error, "final flush of the recovery store failed");
        }
    }
}

/// Whether a command's answer must wait for its batch's flush: everything
/// that may write, except the `Acknowledged` record of an outcome the leader
/// already has and the `Spawned` record of a shim's pid (see
/// [`own_machine`]); reads never wait for one.
fn waits_for_a_flush(command: &Command) -> bool {
    fn request(req: &SidecarRequest) -> bool {
        match req {
            SidecarRequest::Acknowledged { .. }
            | SidecarRequest::Spawned { .. }
            | SidecarRequest::List
            | SidecarRequest::ListFrom { .. }
            | SidecarRequest::Incarnation => false,
            SidecarRequest::Many(reqs) => reqs.iter().any(request),
            SidecarRequest::ObserveEpoch(_)
            | SidecarRequest::Accept(_)
            | SidecarRequest::Intent { .. }
            | SidecarRequest::Exited { .. }
            | SidecarRequest::Abandon { .. } => true,
        }
    }
    match command {
        Command::Handle(req, _) => request(req),
        Command::OutputOwner(..) | Command::Latest(..) => false,
        Command::Cleanup(..) | Command::CleanupFence(..) | Command::Evidence(..) => true,
    }
}

/// A command's answer, held until its batch is flushed.
enum Answer {
    Handle(SidecarReply, oneshot::Sender<SidecarReply>),
    OutputOwner(Option<(SessionId, Phase, bool)>, oneshot::Sender<Option<(SessionId, Phase, bool)>>),
    Cleanup(Result<u32, SidecarRefusal>, oneshot::Sender<Result<u32, SidecarRefusal>>),
    Evidence(Result<RecordView, SidecarRefusal>, oneshot::Sender<Result<RecordView, SidecarRefusal>>),
    /// Boxed: a record is much larger than every other answer.
    Latest(Option<Box<AttemptRecord>>, oneshot::Sender<Option<AttemptRecord>>),
}

impl Answer {
    fn send(self) {
        let _ = match self {
            Answer::Handle(v, tx) => tx.send(v).map_err(drop),
            Answer::OutputOwner(v, tx) => tx.send(v).map_err(drop),
            Answer::Cleanup(v, tx) => tx.send(v).map_err(drop),
            Answer::Evidence(v, tx) => tx.send(v).map_err(drop),
            Answer::Latest(v, tx) => tx.send(v.map(|r| *r)).map_err(drop),
        };
    }

    /// The answer when the batch's flush failed: a refusal, or nothing known.
    fn refuse(self, reason: &str) {
        let storage = || SidecarRefusal::Storage(reason.to_owned());
        let _ = match self {
            Answer::Handle(_, tx) => tx.send(SidecarReply::Refused(storage())).map_err(drop),
            Answer::OutputOwner(_, tx) => tx.send(None).map_err(drop),
            Answer::Cleanup(_, tx) => tx.send(Err(storage())).map_err(drop),
            Answer::Evidence(_, tx) => tx.send(Err(storage())).map_err(drop),
            Answer::Latest(_, tx) => tx.send(None).map_err(drop),
        };
    }
}

/// Counts a request by name, and each of a batch's by its own.
fn count(req: &SidecarRequest) {
    match req {
        SidecarRequest::Many(reqs) => reqs.iter().for_each(count),
        req => crate::metrics::get().requests.add(1, &[opentelemetry::KeyValue::new("request", request_name(req))]),
    }
}

/// Applies one command to the machine (or refuses it when the store is unusable).
fn apply<S: RecoveryStore>(command: Command, machine: &mut Result<Machine<S>, String>) -> Answer {
    match (command, machine) {
        (Command::Handle(req, reply), Ok(machine)) => {
            count(&req);
            Answer::Handle(machine.handle(*req), reply)
        }
        (Command::Handle(_, reply), Err(reason)) => {
            Answer::Handle(SidecarReply::Refused(SidecarRefusal::Storage(reason.clone())), reply)
        }
        (Command::OutputOwner(task, reply), Ok(machine)) => {
            let owner =
                machine.record_for_output(&task).map(|r| (r.grant.owner.clone(), r.phase, r.grant.spec.final_output));
            Answer::OutputOwner(owner, reply)
        }
        (Command::OutputOwner(_, reply), Err(_)) => Answer::OutputOwner(None, reply),
        (Command::Evidence(req, reply), Ok(machine)) => {
            Answer::Evidence(machine.evidence(&req.task, req.attempt, req.epoch, req.incarnation), reply)
        }
        (Command::Evidence(_, reply), Err(reason)) => {
            Answer::Evidence(Err(SidecarRefusal::Storage(reason.clone())), reply)
        }
        (Command::Cleanup(req, reply), Ok(machine)) => Answer::Cleanup(machine.cleanup(&req.task, req.epoch), reply),
        (Command::CleanupFence(req, reply), Ok(machine)) => {
            Answer::Cleanup(machine.cleanup_fence(&req.task, req.epoch), reply)
        }
        (Command::Cleanup(_, reply) | Command::CleanupFence(_, reply), Err(reason)) => {
            Answer::Cleanup(Err(SidecarRefusal::Storage(reason.clone())), reply)
        }
        (Command::Latest(task, reply), Ok(machine)) => {
            Answer::Latest(machine.record_for_output(&task).cloned().map(Box::new), reply)
        }
        (Command::Latest(_, reply), Err(_)) => Answer::Latest(None, reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Error, Loaded, MemoryStore};
    use std::sync::mpsc as sync_mpsc;
    use std::time::Duration;
    use tenure_protocol::messages::RegistryMark;
    use tenure_protocol::{Attempt, Epoch};

    /// A memory store whose every flush says it began, then waits for the
    /// test's word: `true` commits, `false` fails.
    struct GatedStore {
        inner: MemoryStore,
        began: sync_mpsc::Sender<()>,
        gate: sync_mpsc::Receiver<bool>,
    }

    impl RecoveryStore for GatedStore {
        fn load(&self) -> Result<Loaded, Error> {
            self.inner.load()
        }
        fn put_epoch(&mut self, epoch: Epoch) -> Result<(), Error> {
            self.inner.put_epoch(epoch)
        }
        fn put(&mut self, record: &AttemptRecord) -> Result<(), Error> {
            self.inner.put(record)
        }
        fn remove(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
            self.inner.remove(task, attempt)
        }
        fn put_revoked(&mut self, task: &TaskId, attempt: Attempt) -> Result<(), Error> {
            self.inner.put_revoked(task, attempt)
        }
        fn put_mark(&mut self, mark: RegistryMark) -> Result<(), Error> {
            self.inner.put_mark(mark)
        }
        fn flush(&self) -> Result<(), Error> {
            let _ = self.began.send(());
            match self.gate.recv() {
                Ok(true) => Ok(()),
                _ => Err(Error::Injected),
            }
        }
    }

    fn storage(reply: &SidecarReply) -> bool {
        matches!(reply, SidecarReply::Refused(SidecarRefusal::Storage(_)))
    }

    /// Group commit: an answer leaves only after the flush that made its
    /// request durable; a failed flush refuses every request of its batch,
    /// and the sidecar then refuses everything until it is restarted.
    // Two runtime threads: the test blocks on the flush's signal while the
    // requests' tasks run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answers_wait_for_their_flush_and_a_failed_flush_refuses_the_whole_batch() {
        let (open, gate) = sync_mpsc::channel();
        let (began_tx, began) = sync_mpsc::channel();
        let store = GatedStore { inner: MemoryStore::new(), began: began_tx, gate };
        let machine = Machine::restore(store).expect("restore");
        let (handle, thread) = StoreHandle::start(Ok(machine));
        let ask = |epoch| {
            let handle = handle.clone();
            tokio::spawn(async move { handle.handle(SidecarRequest::ObserveEpoch(Epoch(epoch))).await })
        };
        let flushing = || began.recv_timeout(Duration::from_secs(10)).expect("a flush began");
        // The first request waits in its flush; two more queue behind it.
        let first = ask(3);
        flushing();
        let (second, third) = (ask(4), ask(5));
        let queued = tokio::time::timeout(Duration::from_secs(10), async {
            while handle.queued() < 2 {
                tokio::task::yield_now().await;
            }
        });
        queued.await.expect("both requests queued");
        assert!(!first.is_finished(), "answered before its flush");
        open.send(true).expect("gate");
        assert_eq!(first.await.expect("join"), SidecarReply::Ok);
        // The other two were applied together; their one flush fails.
        flushing();
        assert!(!second.is_finished() && !third.is_finished(), "answered before their flush");
        open.send(false).expect("gate");
        assert!(storage(&second.await.expect("join")));
        assert!(storage(&third.await.expect("join")));
        // Degraded from then on: refused without a flush.
        assert!(storage(&ask(6).await.expect("join")));
        assert!(began.try_recv().is_err(), "a degraded store flushed");
        drop(handle);
        thread.await.expect("the store thread ends once every handle is gone");
    }

    /// An `Acknowledged` record, and a read, are answered without a flush
    /// of their own; every other write still waits for one, which also
    /// makes the acknowledged record durable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn spawned_and_acknowledged_records_wait_for_no_flush_of_their_own() {
        let (open, gate) = sync_mpsc::channel();
        let (began_tx, began) = sync_mpsc::channel();
        let store = GatedStore { inner: MemoryStore::new(), began: began_tx, gate };
        let (handle, thread) = StoreHandle::start(Ok(Machine::restore(store).expect("restore")));
        let (task, attempt): (TaskId, Attempt) = ("shell-1".parse().unwrap(), Attempt(1));
        let grant = tenure_protocol::messages::LeaseGrant {
            input: Vec::new(),
            task: task.clone(),
            attempt,
            epoch: Epoch(2),
            owner: "a".parse().unwrap(),
            spec: tenure_protocol::TaskSpec::shell("l", "true"),
            mark: None,
        };
        let outcome = tenure_protocol::Outcome::new(tenure_protocol::Ending::Completed, Some(0), None);
        let flushed = |req: SidecarRequest| {
            let handle = handle.clone();
            let answer = tokio::spawn(async move { handle.handle(req).await });
            began.recv_timeout(Duration::from_secs(10)).expect("a flush began");
            open.send(true).expect("gate");
            answer
        };
        for req in [
            SidecarRequest::Accept(grant),
            SidecarRequest::Intent { task: task.clone(), attempt, epoch: Epoch(2), trace: None },
        ] {
            assert_eq!(flushed(req).await.expect("join"), SidecarReply::Ok);
        }
        let spawned = SidecarRequest::Spawned { task: task.clone(), attempt, pid: 4242 };
        let answered = tokio::time::timeout(Duration::from_secs(10), handle.handle(spawned)).await;
        assert_eq!(answered.expect("answered without waiting for a flush"), SidecarReply::Ok);
        assert!(began.try_recv().is_err(), "a spawned record waited for a flush");
        let exited = SidecarRequest::Exited { task: task.clone(), attempt, outcome };
        assert_eq!(flushed(exited).await.expect("join"), SidecarReply::Ok);
        let acknowledged = SidecarRequest::Acknowledged { task: task.clone(), attempt };
        assert_eq!(handle.handle(acknowledged).await, SidecarReply::Ok);
        assert!(matches!(handle.handle(SidecarRequest::List).await, SidecarReply::Records { .. }));
        assert!(began.try_recv().is_err(), "an acknowledged record or a read waited for a flush");
        assert_eq!(flushed(SidecarRequest::ObserveEpoch(Epoch(3))).await.expect("join"), SidecarReply::Ok);
        drop((handle, open));
        thread.await.expect("the store thread ends once every handle is gone");
    }
}
