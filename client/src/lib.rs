//! `tenure-client`: the one typed client of tenure's API, used by the CLI's
//! verbs, the bench, the chaos harness and the tests.
//!
//! It owns: connecting (through `tenure_transport::connect`, so credentials,
//! TLS and reconnects are the daemons'), one request to the leader
//! ([`Client::call`]), the one rule for riding out a leader change
//! ([`retry`], applied by [`Client::request`]), submit with its idempotency
//! key, paging of the task list, waiting for a task's end, reading a
//! task's output by byte offset from its machine's sidecar (once, or followed
//! until the attempt ended), and the caller's notices with the once-only
//! claim of an end ([`notices`]).
//!
//! It must never: send a submit again under a new idempotency key (a retry
//! that could duplicate a task), repeat a request the rule does not call safe
//! (kills, board moves, input to an agent), retry without a bound, or
//! decide anything about tasks — what the coordinator answers is returned as
//! it is ([`Error::Api`]). It prints nothing: rendering is the caller's.

pub mod input;
pub mod notices;
pub mod retry;

use std::time::{Duration, Instant};

use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, ApiResponse, BatchTask, ClusterStatus, OutputChunk, OutputReply, OutputRequest,
    SubmitBatch, SubmitRequest, TaskSnapshot, WaitFor, MAX_OUTPUT_CHUNK, MAX_WAIT_MS,
};
use tenure_protocol::{subjects, SessionId, Status, TaskId, TaskSpec, WorkerId};

pub use input::{message as input_message, InputTarget, SendError};
pub use retry::{decide, Decision, Failure, Policy, Repeat, RUN_WAIT};

/// How long one plain request waits for its answer.
pub const API_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a follower rides through a machine whose sidecar does not
/// answer before it gives up with the error (the task goes on; its output
/// is read again once the machine answers).
pub const SIDECAR_PATIENCE: Duration = Duration::from_secs(120);
/// Longest one wait of [`Client::wait_started`] is held.
pub const START_LOOK: Duration = Duration::from_secs(2);

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Nobody serves the API subject: no coordinator runs, or standbys are
    /// taking over from a leader that died.
    #[error("no coordinator is answering (is the cluster running? try `tenure dev`)")]
    NoCoordinator,
    /// The coordinator (or a sidecar) answered with a refusal.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The request could not be sent or its reply did not come back.
    #[error(transparent)]
    Transport(tenure_transport::Error),
    /// An answer that does not fit the request (a protocol mismatch).
    #[error("unexpected reply to {verb}: {reply}")]
    UnexpectedReply { verb: &'static str, reply: String },
    /// Reading a task's output from its machine's sidecar failed.
    #[error("reading output of {task} from {worker}")]
    Output {
        task: TaskId,
        worker: WorkerId,
        #[source]
        source: Box<Error>,
    },
    /// The caller's sink refused the output bytes.
    #[error("writing output: {0}")]
    Sink(#[source] std::io::Error),
}

impl From<tenure_transport::Error> for Error {
    fn from(e: tenure_transport::Error) -> Error {
        match e {
            tenure_transport::Error::NoResponders { .. } => Error::NoCoordinator,
            e => Error::Transport(e),
        }
    }
}

impl Error {
    /// The failure as the retry rule sees it.
    pub fn failure(&self) -> Failure {
        match self {
            Error::NoCoordinator => Failure::NoResponders,
            Error::Transport(tenure_transport::Error::Timeout { .. }) => Failure::Timeout,
            Error::Transport(tenure_transport::Error::Nats { .. }) => Failure::Connection,
            Error::Api(ApiError::NotLeader) => Failure::NotLeader,
            Error::Api(ApiError::Unavailable(_)) => Failure::Unavailable,
            Error::Api(ApiError::RegistryBehind { .. }) => Failure::RegistryBehind,
            _ => Failure::Final,
        }
    }

    /// The coordinator's refusal, when this is one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            Error::Api(e) => Some(e),
            _ => None,
        }
    }
}

fn unexpected(verb: &'static str, reply: ApiResponse) -> Error {
    Error::UnexpectedReply { verb, reply: format!("{reply:?}") }
}

/// A submit's answer: the task, and whether its key was seen before (the
/// task an earlier try created).
pub use tenure_protocol::messages::Submitted;

/// A wait's answer: `finished` is whether the task ended (false when the
/// caller's deadline passed first, or for a start wait answered at the
/// start: the snapshot is then live).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waited {
    pub finished: bool,
    pub snapshot: TaskSnapshot,
}

/// A connection to the cluster, acting for one session.
#[derive(Clone)]
pub struct Client {
    nats: async_nats::Client,
    session: SessionId,
}

impl Client {
    /// Connects as `name` (the NATS client name); `wait_for_server` retries
    /// the initial connect (for harnesses that start the server alongside).
    pub async fn connect(
        opts: &tenure_transport::NatsOptions,
        name: &str,
        wait_for_server: bool,
        session: SessionId,
    ) -> Result<Client, Error> {
        let nats = tenure_transport::connect(opts, name, wait_for_server).await.map_err(Error::Transport)?;
        Ok(Client { nats, session })
    }

    /// A client over an existing connection.
    pub fn new(nats: async_nats::Client, session: SessionId) -> Client {
        Client { nats, session }
    }

    /// The NATS connection (for subjects this client does not cover: notices,
    /// input to agents, raw probes).
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    pub fn session(&self) -> &SessionId {
        &self.session
    }

    /// The same connection acting for another session.
    pub fn with_session(&self, session: SessionId) -> Client {
        Client { nats: self.nats.clone(), session }
    }

    /// One request to the leader, one try.
    pub async fn call(&self, req: &ApiRequest, timeout: Duration) -> Result<ApiResponse, Error> {
        let reply: ApiReply = tenure_transport::request(&self.nats, subjects::API.to_owned(), req, timeout).await?;
        Ok(reply?)
    }

    /// One request to the leader under the retry rule: sent again — the same
    /// request, so a submit keeps its idempotency key — while the rule says
    /// so, and at most until `policy.overall` after the first try.
    pub async fn request(&self, req: &ApiRequest, policy: &Policy) -> Result<ApiResponse, Error> {
        let start = Instant::now();
        let repeat = Repeat::of(req);
        let mut pause = policy.first_pause;
        loop {
            let err = match self.call(req, policy.try_timeout(start.elapsed())).await {
                Ok(reply) => return Ok(reply),
                Err(e) => e,
            };
            match decide(err.failure(), repeat, start.elapsed(), pause, policy) {
                Decision::Retry { after } => {
                    tracing::warn!(error = %err, verb = req.verb(), "request not answered; retrying");
                    tokio::time::sleep(after).await;
                    pause = policy.next_pause(pause);
                }
                Decision::GiveUp => return Err(err),
            }
        }
    }

    /// Submits `spec` under a fresh idempotency key, retried (with that key)
    /// through a takeover under [`Policy::SUBMIT`].
    pub async fn submit(&self, spec: TaskSpec) -> Result<Submitted, Error> {
        let req = SubmitRequest { session: self.session.clone(), idempotency_key: uuid::Uuid::new_v4(), spec };
        self.submit_request(req, &Policy::SUBMIT).await
    }

    /// Submits `req` as it is (its key included) under `policy`.
    pub async fn submit_request(&self, req: SubmitRequest, policy: &Policy) -> Result<Submitted, Error> {
        match self.request(&ApiRequest::Submit(req), policy).await? {
            ApiResponse::Submitted { task, existing } => Ok(Submitted { task, existing }),
            other => Err(unexpected("submit", other)),
        }
    }

    /// Submits `req` and waits for the task's end: [`Client::run_until`]
    /// the end.
    pub async fn run(&self, req: SubmitRequest) -> Result<TaskSnapshot, Error> {
        self.run_until(req, WaitFor::End).await
    }

    /// Submits `req` and waits until the task reached `until`: one request
    /// (`Run`, under [`Policy::RUN`], retried with the request's key) that
    /// holds its reply until then or [`RUN_WAIT`], then `Wait`s as
    /// [`Client::wait_for`] (without a deadline). A coordinator that cannot
    /// read `Run` (older than it) refuses it as `InvalidRequest`: then a
    /// submit and a wait, in two requests (a spec it refuses is refused again
    /// by the submit).
    pub async fn run_until(&self, req: SubmitRequest, until: WaitFor) -> Result<TaskSnapshot, Error> {
        let run = ApiRequest::Run { submit: req.clone(), timeout_ms: RUN_WAIT.as_millis() as u64, until };
        let task = match self.request(&run, &Policy::RUN).await {
            Ok(ApiResponse::Waited { snapshot, .. }) if until.reached(snapshot.status) => return Ok(snapshot),
            Ok(ApiResponse::Waited { snapshot, .. }) => snapshot.id,
            Ok(other) => return Err(unexpected("run", other)),
            Err(Error::Api(ApiError::InvalidRequest(_))) => self.submit_request(req, &Policy::SUBMIT).await?.task,
            Err(e) => return Err(e),
        };
        Ok(self.wait_for(&task, until, None).await?.snapshot)
    }

    /// Submits `tasks` in one request, each with its own key, retried (with
    /// those keys) through a takeover under [`Policy::BATCH`]: all created,
    /// or none when one is refused (`ApiError::InBatch` says which). The
    /// answers come in the order given.
    pub async fn submit_batch(&self, tasks: Vec<BatchTask>) -> Result<Vec<Submitted>, Error> {
        let req = ApiRequest::SubmitBatch(SubmitBatch { session: self.session.clone(), tasks });
        match self.request(&req, &Policy::BATCH).await? {
            ApiResponse::SubmittedBatch(done) => Ok(done),
            other => Err(unexpected("submit-batch", other)),
        }
    }

    /// The task's snapshot (one try).
    pub async fn get(&self, task: &TaskId) -> Result<TaskSnapshot, Error> {
        match self.call(&ApiRequest::Get { session: self.session.clone(), task: task.clone() }, API_TIMEOUT).await? {
            ApiResponse::Snapshot(s) => Ok(s),
            other => Err(unexpected("get", other)),
        }
    }

    /// Every task of the session (`all`: archived and reported ones too),
    /// page by page (each page one try).
    pub async fn list(&self, all: bool) -> Result<Vec<TaskSnapshot>, Error> {
        let (mut list, mut after) = (Vec::new(), None);
        loop {
            let req = ApiRequest::ListPage { session: self.session.clone(), all, after, before: None };
            match self.call(&req, API_TIMEOUT).await? {
                ApiResponse::Page { tasks, next } => {
                    list.extend(tasks);
                    match next {
                        Some(n) => after = Some(n),
                        None => return Ok(list),
                    }
                }
                other => return Err(unexpected("list", other)),
            }
        }
    }

    /// The cluster's status (one try within `timeout`).
    pub async fn status(&self, timeout: Duration) -> Result<ClusterStatus, Error> {
        match self.call(&ApiRequest::Status, timeout).await? {
            ApiResponse::Status(s) => Ok(s),
            other => Err(unexpected("status", other)),
        }
    }

    /// Sends a request that is answered with a snapshot (a board move), once.
    pub async fn snapshot_of(&self, req: &ApiRequest) -> Result<TaskSnapshot, Error> {
        match self.call(req, API_TIMEOUT).await? {
            ApiResponse::Snapshot(s) => Ok(s),
            other => Err(unexpected(req.verb(), other)),
        }
    }

    /// Waits until `task` is terminal or `deadline` passes: [`Client::wait_for`]
    /// the end.
    pub async fn wait(&self, task: &TaskId, deadline: Option<Instant>) -> Result<Waited, Error> {
        self.wait_for(task, WaitFor::End, deadline).await
    }

    /// Waits until `task` reached `until` or `deadline` passes (none:
    /// forever), in waits of at most [`MAX_WAIT_MS`] each; whether it was
    /// reached is `until.reached(snapshot.status)`. A takeover or a NATS
    /// hiccup is not the task's end: the wait goes on under [`Policy::WAIT`]
    /// (its bound counts from the first unanswered wait and starts again at
    /// every answer), but never past `deadline`. A leader older than start
    /// waits answers a start wait at the end, which reaches it too.
    pub async fn wait_for(&self, task: &TaskId, until: WaitFor, deadline: Option<Instant>) -> Result<Waited, Error> {
        let policy = Policy::WAIT;
        let mut unanswered_since: Option<Instant> = None;
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let wait_ms = left.map(|l| l.as_millis() as u64).unwrap_or(MAX_WAIT_MS).min(MAX_WAIT_MS);
            let req =
                ApiRequest::Wait { session: self.session.clone(), task: task.clone(), timeout_ms: wait_ms, until };
            let reply = match self.call(&req, Duration::from_millis(wait_ms) + API_TIMEOUT).await {
                Ok(reply) => reply,
                Err(e) => {
                    let since = *unanswered_since.get_or_insert_with(Instant::now);
                    let past_deadline = deadline.is_some_and(|d| Instant::now() >= d);
                    match decide(e.failure(), Repeat::Safe, since.elapsed(), policy.first_pause, &policy) {
                        Decision::Retry { after } if !past_deadline => {
                            tracing::warn!(error = %e, "wait interrupted; retrying");
                            tokio::time::sleep(after).await;
                            continue;
                        }
                        _ => return Err(e),
                    }
                }
            };
            unanswered_since = None;
            let ApiResponse::Waited { finished, snapshot } = reply else {
                return Err(unexpected("wait", reply));
            };
            if until.reached(snapshot.status)
                || left.is_some_and(|l| l.is_zero())
                || deadline.is_some_and(|d| Instant::now() >= d)
            {
                return Ok(Waited { finished, snapshot });
            }
        }
    }

    /// Waits (without a deadline) until `task` has left the queue for good
    /// ([`WaitFor::Start`]); its snapshot. Each wait is held for at most
    /// [`START_LOOK`]: a leader older than start waits holds one until the
    /// task's end, and this way answers within that bound instead.
    pub async fn wait_started(&self, task: &TaskId) -> Result<TaskSnapshot, Error> {
        loop {
            let waited = self.wait_for(task, WaitFor::Start, Some(Instant::now() + START_LOOK)).await?;
            if WaitFor::Start.reached(waited.snapshot.status) {
                return Ok(waited.snapshot);
            }
        }
    }

    /// Waits (without a deadline) until `task` is terminal; its snapshot.
    pub async fn wait_end(&self, task: &TaskId) -> Result<TaskSnapshot, Error> {
        Ok(self.wait(task, None).await?.snapshot)
    }

    /// Marks a terminal task reported (its whole output reached its owner), once.
    pub async fn mark_reported(&self, task: &TaskId) -> Result<(), Error> {
        self.call(&ApiRequest::MarkReported { session: self.session.clone(), task: task.clone() }, API_TIMEOUT)
            .await
            .map(|_| ())
    }

    /// One read of `task`'s output from byte `offset`, at most `max` bytes,
    /// from the sidecar of `worker` (one try).
    pub async fn read_output(
        &self,
        worker: &WorkerId,
        task: &TaskId,
        offset: u64,
        max: u32,
    ) -> Result<OutputChunk, Error> {
        let req = OutputRequest { session: self.session.clone(), task: task.clone(), offset, max };
        let reply: Result<OutputReply, _> =
            tenure_transport::request(&self.nats, subjects::output(worker), &req, API_TIMEOUT).await;
        match reply {
            Ok(r) => Ok(r?),
            // A sidecar that does not serve is no coordinator missing.
            Err(e) => Err(Error::Transport(e)),
        }
    }

    /// One read of the output of `snapshot`'s latest attempt from its
    /// machine's sidecar; `None` while no machine has it yet: the task is
    /// queued or blocked, or leased and its sidecar has not taken the grant
    /// (it answers not-found then, as for a task that is not the caller's;
    /// the leader already said it is).
    pub async fn read_latest(
        &self,
        snapshot: &TaskSnapshot,
        offset: u64,
        max: u32,
    ) -> Result<Option<OutputChunk>, Error> {
        let Some(worker) = &snapshot.worker else { return Ok(None) };
        let not_taken = matches!(snapshot.status, Status::Queued | Status::Blocked | Status::Leased);
        match self.read_output(worker, &snapshot.id, offset, max).await {
            Err(Error::Api(ApiError::NotFound(_))) if not_taken => Ok(None),
            other => other.map(Some),
        }
    }

    /// Reads `task`'s output from byte `offset` into `sink`, from the sidecar
    /// of the machine its latest attempt ran on (`snapshot` is the task's
    /// snapshot when the read starts, refreshed when the task is quiet).
    /// Without `follow`, returns once everything written so far is out; with
    /// it, keeps reading until the attempt ended and every byte is out,
    /// riding through a sidecar that does not answer yet (for
    /// [`SIDECAR_PATIENCE`], and not once the task is `unknown`). Once the whole
    /// terminal output is out the task is marked reported. Returns the offset
    /// reached.
    pub async fn follow_output(
        &self,
        mut snapshot: TaskSnapshot,
        follow: bool,
        mut offset: u64,
        mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u64, Error> {
        const IDLE_MAX: Duration = Duration::from_millis(250);
        let task = &snapshot.id.clone(); // `snapshot` is refreshed below
        let mut idle = Duration::from_millis(20);
        // Since when the machine has not answered (`None` while it does).
        let mut unanswered: Option<Instant> = None;
        loop {
            let chunk = match self.read_latest(&snapshot, offset, MAX_OUTPUT_CHUNK).await {
                Ok(Some(chunk)) => chunk,
                // No machine has its attempt yet: told by a start wait
                // while it has not started, looked at again after a pause
                // otherwise.
                Ok(None) => {
                    if !follow || snapshot.status.is_terminal() {
                        return Ok(offset);
                    }
                    if WaitFor::Start.reached(snapshot.status) {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        snapshot = self.get(task).await?;
                    } else {
                        snapshot = self.wait_started(task).await?;
                    }
                    continue;
                }
                Err(e @ Error::Api(_)) => return Err(e),
                Err(e) => {
                    // The machine does not answer: ridden through while following,
                    // for a while — not for a task whose machine is judged lost,
                    // nor past `SIDECAR_PATIENCE` of silence.
                    let since = *unanswered.get_or_insert_with(Instant::now);
                    let patient = follow && since.elapsed() < SIDECAR_PATIENCE;
                    if patient {
                        snapshot = self.get(task).await?;
                    }
                    let worker = snapshot.worker.clone();
                    match (patient && snapshot.status != Status::Unknown, worker) {
                        (true, _) | (false, None) => {
                            tracing::debug!(error = %e, "output not readable yet; retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                            continue;
                        }
                        (false, Some(worker)) => {
                            return Err(Error::Output { task: task.clone(), worker, source: Box::new(e) })
                        }
                    }
                }
            };
            unanswered = None;
            if !chunk.data.is_empty() {
                sink(&chunk.data).map_err(Error::Sink)?;
                offset = chunk.next_offset;
                idle = Duration::from_millis(20);
                continue;
            }
            // Everything written so far is out. Done unless following a live attempt.
            if chunk.finished {
                // The whole terminal output reached the owner: that reports the task.
                for _ in 0..if follow { 20 } else { 1 } {
                    match self.mark_reported(task).await {
                        Ok(()) => break,
                        // The registry may not have the end yet; a follower waits for it.
                        Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                    }
                }
                return Ok(offset);
            }
            if !follow || snapshot.status.is_terminal() {
                return Ok(offset);
            }
            tokio::time::sleep(idle).await;
            idle = (idle * 2).min(IDLE_MAX);
            if idle == IDLE_MAX {
                // A quiet task: check whether it ended or moved to another worker.
                snapshot = self.get(task).await?;
            }
        }
    }
}
