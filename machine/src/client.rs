//! [`SidecarClient`]: the worker's side of the local socket. One request, one
//! reply, over lazily (re)connected unix streams.
//!
//! **Batching.** Calls made while others are in flight wait in one queue;
//! at most [`MAX_EXCHANGES`] exchanges run at once, and each takes every
//! waiting request it can into one [`SidecarRequest::Many`] (up to
//! [`MAX_SIDECAR_MANY`]), so that under load many attempts' records cost
//! one frame each way and one pass of the sidecar's group commit. An idle
//! client sends a call at once and alone. Each caller still gets its own
//! reply, only after the flush that made its own request durable: batching
//! changes what travels, not what a reply means. A sidecar too old to read
//! a batch refuses it as malformed; the client then sends everything alone.
//!
//! It never retries by itself: every failure is reported as [`Error::Unavailable`]
//! and the caller decides (requests are idempotent, so retrying is safe). An
//! `Unavailable` after the request was sent means "unknown whether it landed".
//! A request whose caller gave up before it was sent is not sent. It never
//! decodes anything the sidecar did not send as a whole frame.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tenure_protocol::messages::{SidecarRefusal, SidecarReply, SidecarRequest, MAX_SIDECAR_MANY};
use tenure_protocol::{decode, encode, CodecError, MAX_MESSAGE_BYTES};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::frame_codec;

/// How long one exchange may take (connect, send, reply) unless set
/// otherwise; a call waits at most as long again for its turn.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a call did not produce a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The sidecar could not be reached, closed the connection, or did not answer
    /// in time. The connection is dropped; the next call reconnects.
    #[error("sidecar unavailable: {0}")]
    Unavailable(String),
    /// The request cannot be encoded (it exceeds the message size limit). Nothing
    /// was sent.
    #[error("cannot encode sidecar request: {0}")]
    Encode(CodecError),
    /// The sidecar answered with something this build cannot decode (a version
    /// mismatch). The connection is dropped.
    #[error("malformed reply from the sidecar: {0}")]
    MalformedReply(CodecError),
}

type Connection = Framed<UnixStream, LengthDelimitedCodec>;

/// Most exchanges in flight at once, each on its own connection: one being
/// committed by the sidecar while the next gathers the calls made meanwhile
/// (the sidecar's group commit takes both in one flush when they meet).
pub const MAX_EXCHANGES: usize = 2;

/// Most encoded bytes of requests gathered into one batch: well within a
/// frame, whatever the batch's own framing adds.
const BATCH_BYTES: usize = MAX_MESSAGE_BYTES / 2;

/// Connections to the machine's sidecar, shared by the worker's tasks.
#[derive(Debug)]
pub struct SidecarClient {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    timeout: Duration,
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    /// Calls not yet sent, in the order they were made.
    waiting: VecDeque<Waiter>,
    /// Exchanges running (each a task that sends until the queue is empty).
    exchanges: usize,
    /// Connections not in use by an exchange.
    idle: Vec<Connection>,
    /// Set once the sidecar refused a batch as unreadable: everything goes
    /// alone from then on.
    alone: bool,
}

#[derive(Debug)]
struct Waiter {
    req: SidecarRequest,
    /// `req`, encoded: sent as it is when it goes alone.
    frame: Bytes,
    reply: oneshot::Sender<Result<SidecarReply, Error>>,
}

impl SidecarClient {
    /// A client for the socket at `socket_path`; nothing is connected until the
    /// first call.
    pub fn new(socket_path: impl Into<PathBuf>) -> SidecarClient {
        SidecarClient::build(socket_path.into(), DEFAULT_CALL_TIMEOUT)
    }

    fn build(path: PathBuf, timeout: Duration) -> SidecarClient {
        SidecarClient { inner: Arc::new(Inner { path, timeout, queue: Mutex::new(Queue::default()) }) }
    }

    /// The same socket with another bound on one call; the connections
    /// already open are not taken over.
    pub fn with_timeout(self, timeout: Duration) -> SidecarClient {
        SidecarClient::build(self.inner.path.clone(), timeout)
    }

    pub fn socket_path(&self) -> &Path {
        &self.inner.path
    }

    /// Sends `req` (alone, or in a batch with others made meanwhile) and waits
    /// for its reply.
    ///
    /// A connection is used by one exchange at a time and put back only after
    /// a complete exchange, so an exchange that fails or times out can never
    /// leave a late reply behind for the next one to mistake for its own.
    /// A call cancelled before its request was sent sends nothing.
    pub async fn call(&self, req: &SidecarRequest) -> Result<SidecarReply, Error> {
        let frame = Bytes::from(encode(req).map_err(Error::Encode)?);
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut q = self.inner.queue();
            q.waiting.push_back(Waiter { req: req.clone(), frame, reply });
            let start = q.exchanges < MAX_EXCHANGES;
            q.exchanges += usize::from(start);
            start
        };
        if start {
            tokio::spawn(exchanges(self.inner.clone()));
        }
        // Its exchange is bounded by the timeout too: this bounds the wait
        // for its turn.
        match tokio::time::timeout(self.inner.timeout * 2, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Error::Unavailable("the exchange ended without an answer".to_owned())),
            Err(_) => Err(Error::Unavailable(format!("no answer within {:?}", self.inner.timeout * 2))),
        }
    }
}

impl Inner {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Queue {
    /// The next calls to send together (none: the queue is empty), skipping
    /// those whose caller is gone.
    fn next_batch(&mut self) -> Vec<Waiter> {
        self.waiting.retain(|w| !w.reply.is_closed());
        let Some(first) = self.waiting.pop_front() else { return Vec::new() };
        let mut bytes = first.frame.len();
        let batches = !self.alone && first.req.batches();
        let mut batch = vec![first];
        while batches && batch.len() < MAX_SIDECAR_MANY {
            let fits = self.waiting.front().is_some_and(|w| w.req.batches() && bytes + w.frame.len() <= BATCH_BYTES);
            match self.waiting.pop_front() {
                Some(next) if fits => {
                    bytes += next.frame.len();
                    batch.push(next);
                }
                Some(next) => {
                    self.waiting.push_front(next);
                    break;
                }
                None => break,
            }
        }
        batch
    }
}

/// One exchange's loop: sends what waits until nothing does.
async fn exchanges(inner: Arc<Inner>) {
    loop {
        let (batch, idle) = {
            let mut q = inner.queue();
            let batch = q.next_batch();
            if batch.is_empty() {
                q.exchanges -= 1;
                return;
            }
            (batch, q.idle.pop())
        };
        let (requests, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|w| ((w.req, w.frame), w.reply)).unzip();
        let outcome = send(&inner, idle, requests).await;
        match outcome {
            Sent::Answered(conn, answers) => {
                inner.queue().idle.push(conn);
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(Ok(answer));
                }
            }
            Sent::Unread(conn, requests) => {
                tracing::warn!("the sidecar cannot read a batch (older than this worker): sending requests alone");
                let mut q = inner.queue();
                q.alone = true;
                q.idle.push(conn);
                for ((req, frame), reply) in requests.into_iter().zip(replies).rev() {
                    q.waiting.push_front(Waiter { req, frame, reply });
                }
            }
            Sent::Failed(error) => {
                for reply in replies {
                    let _ = reply.send(Err(error.clone()));
                }
            }
        }
    }
}

/// What became of one exchange.
enum Sent {
    /// One answer per request, in order; the connection may be used again.
    Answered(Connection, Vec<SidecarReply>),
    /// The sidecar refused the batch as unreadable: nothing of it was applied.
    Unread(Connection, Vec<(SidecarRequest, Bytes)>),
    Failed(Error),
}

/// Sends the requests (alone when one, as a batch otherwise) on `idle` or a
/// new connection, bounded by the client's timeout.
async fn send(inner: &Inner, idle: Option<Connection>, mut requests: Vec<(SidecarRequest, Bytes)>) -> Sent {
    let count = requests.len();
    let (frame, batch) = match requests.as_slice() {
        [(_, frame)] => (frame.clone(), None),
        _ => {
            let batch = SidecarRequest::Many(requests.drain(..).map(|(req, _)| req).collect());
            match encode(&batch) {
                Ok(bytes) => (Bytes::from(bytes), Some(batch)),
                Err(error) => return Sent::Failed(Error::Encode(error)),
            }
        }
    };
    let exchange = async {
        let mut conn = match idle {
            Some(conn) => conn,
            None => {
                let stream = UnixStream::connect(&inner.path)
                    .await
                    .map_err(|e| Error::Unavailable(format!("connecting to {}: {e}", inner.path.display())))?;
                Framed::new(stream, frame_codec())
            }
        };
        conn.send(frame).await.map_err(|e| Error::Unavailable(format!("sending: {e}")))?;
        let reply = match conn.next().await {
            Some(Ok(reply)) => reply,
            Some(Err(e)) => return Err(Error::Unavailable(format!("reading the reply: {e}"))),
            None => return Err(Error::Unavailable("the sidecar closed the connection".to_owned())),
        };
        let reply = decode::<SidecarReply>(&reply).map_err(Error::MalformedReply)?;
        Ok((conn, reply))
    };
    let (conn, reply) = match tokio::time::timeout(inner.timeout, exchange).await {
        Ok(Ok(answered)) => answered,
        Ok(Err(error)) => return Sent::Failed(error),
        Err(_) => return Sent::Failed(Error::Unavailable(format!("no reply within {:?}", inner.timeout))),
    };
    let Some(SidecarRequest::Many(sent)) = batch else { return Sent::Answered(conn, vec![reply]) };
    match reply {
        SidecarReply::Many(answers) if answers.len() == count => Sent::Answered(conn, answers),
        SidecarReply::Many(answers) => Sent::Failed(Error::Unavailable(format!(
            "the sidecar answered {} of a batch of {count} requests",
            answers.len()
        ))),
        SidecarReply::Refused(SidecarRefusal::Malformed(_)) => {
            let frames = sent.into_iter().map(|req| encode(&req).map(|b| (req, Bytes::from(b))));
            match frames.collect::<Result<Vec<_>, _>>() {
                Ok(requests) => Sent::Unread(conn, requests),
                Err(error) => Sent::Failed(Error::Encode(error)),
            }
        }
        // A refusal of the whole batch (the store failed) answers each request.
        other => Sent::Answered(conn, vec![other; count]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use tokio::net::UnixListener;

    async fn reply(conn: &mut Connection, reply: &SidecarReply) -> io::Result<()> {
        conn.send(Bytes::from(encode(reply).unwrap())).await
    }

    #[tokio::test]
    async fn a_late_reply_is_never_taken_for_the_next_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = SidecarClient::new(&path).with_timeout(Duration::from_millis(200));

        // First connection: the request arrives but the answer comes too late.
        let first = client.call(&SidecarRequest::List).await;
        assert!(matches!(first, Err(Error::Unavailable(_))), "{first:?}");
        let (stream, _) = listener.accept().await.unwrap();
        let mut slow = Framed::new(stream, frame_codec());
        assert!(slow.next().await.is_some());
        // The client dropped that connection when it gave up: the late reply has nowhere to go.
        let late = SidecarReply::Refused(tenure_protocol::messages::SidecarRefusal::Malformed("late".into()));
        assert!(reply(&mut slow, &late).await.is_err());

        // The next call opens a new connection and gets its own answer.
        let server = async {
            let (stream, _) = listener.accept().await.unwrap();
            let mut conn = Framed::new(stream, frame_codec());
            let req: SidecarRequest = decode(&conn.next().await.unwrap().unwrap()).unwrap();
            assert_eq!(req, SidecarRequest::ObserveEpoch(tenure_protocol::Epoch(1)));
            reply(&mut conn, &SidecarReply::Ok).await.unwrap();
            conn
        };
        let client = client.with_timeout(DEFAULT_CALL_TIMEOUT);
        let (second, _conn) =
            tokio::join!(client.call(&SidecarRequest::ObserveEpoch(tenure_protocol::Epoch(1))), server);
        assert_eq!(second, Ok(SidecarReply::Ok));
    }

    #[tokio::test]
    async fn concurrent_calls_reach_the_sidecar_together() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = SidecarClient::new(&path).with_timeout(Duration::from_secs(5));
        // The server answers only once both requests are in: with one request
        // in flight at a time, the second would never arrive.
        let server = async {
            let mut conns = Vec::new();
            for _ in 0..2 {
                let (stream, _) = listener.accept().await.unwrap();
                let mut conn = Framed::new(stream, frame_codec());
                let req: SidecarRequest = decode(&conn.next().await.unwrap().unwrap()).unwrap();
                conns.push((conn, req));
            }
            for (conn, req) in &mut conns {
                let answer = match req {
                    SidecarRequest::ObserveEpoch(_) => SidecarReply::Ok,
                    _ => SidecarReply::Refused(tenure_protocol::messages::SidecarRefusal::Malformed("list".into())),
                };
                reply(conn, &answer).await.unwrap();
            }
            conns
        };
        let epoch = SidecarRequest::ObserveEpoch(tenure_protocol::Epoch(1));
        let (a, b, _conns) = tokio::join!(client.call(&epoch), client.call(&SidecarRequest::List), server);
        // Each got its own answer.
        assert_eq!(a, Ok(SidecarReply::Ok));
        assert!(matches!(b, Ok(SidecarReply::Refused(_))), "{b:?}");
    }

    #[tokio::test]
    async fn no_sidecar_is_unavailable_and_oversized_requests_are_not_sent() {
        let tmp = tempfile::tempdir().unwrap();
        let client = SidecarClient::new(tmp.path().join("none.sock"));
        assert!(matches!(client.call(&SidecarRequest::List).await, Err(Error::Unavailable(_))));
        let mut grant = tenure_protocol::messages::LeaseGrant {
            input: Vec::new(),
            task: "shell-1".parse().unwrap(),
            attempt: tenure_protocol::Attempt(1),
            epoch: tenure_protocol::Epoch(1),
            owner: "a".parse().unwrap(),
            spec: tenure_protocol::TaskSpec::shell("l", "x"),
            mark: None,
        };
        grant.spec.command = "x".repeat(tenure_protocol::MAX_MESSAGE_BYTES);
        assert!(matches!(client.call(&SidecarRequest::Accept(grant)).await, Err(Error::Encode(_))));
    }

    fn ack(task: &str) -> SidecarRequest {
        SidecarRequest::Acknowledged { task: task.parse().unwrap(), attempt: tenure_protocol::Attempt(1) }
    }

    async fn ack_call(client: &SidecarClient, task: &str) -> Result<SidecarReply, Error> {
        client.call(&ack(task)).await
    }

    fn unknown(req: &SidecarRequest) -> SidecarReply {
        let SidecarRequest::Acknowledged { task, attempt } = req else { panic!("{req:?}") };
        SidecarReply::Refused(SidecarRefusal::UnknownAttempt { task: task.clone(), attempt: *attempt })
    }

    async fn accept(listener: &UnixListener) -> Connection {
        Framed::new(listener.accept().await.unwrap().0, frame_codec())
    }

    async fn read(conn: &mut Connection) -> SidecarRequest {
        decode(&conn.next().await.unwrap().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn calls_made_together_travel_as_one_batch_and_each_gets_its_own_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = SidecarClient::new(&path);
        let server = async {
            let mut conn = accept(&listener).await;
            let SidecarRequest::Many(reqs) = read(&mut conn).await else { panic!("not a batch") };
            assert_eq!(reqs, [ack("shell-1"), ack("shell-2"), ack("shell-3")]);
            // Each answer names its own request: a mix-up would show.
            reply(&mut conn, &SidecarReply::Many(reqs.iter().map(unknown).collect())).await.unwrap();
            conn
        };
        let (a, b, c, _conn) =
            tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), ack_call(&client, "shell-3"), server);
        assert_eq!(a, Ok(unknown(&ack("shell-1"))));
        assert_eq!(b, Ok(unknown(&ack("shell-2"))));
        assert_eq!(c, Ok(unknown(&ack("shell-3"))));
    }

    #[tokio::test]
    async fn a_batch_refused_as_a_whole_answers_each_and_one_unread_is_sent_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = SidecarClient::new(&path);
        let storage = SidecarReply::Refused(SidecarRefusal::Storage("disk".into()));
        let server = async {
            let mut conn = accept(&listener).await;
            assert!(matches!(read(&mut conn).await, SidecarRequest::Many(_)));
            reply(&mut conn, &storage).await.unwrap();
            conn
        };
        let (a, b, mut conn) = tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), server);
        assert_eq!((a, b), (Ok(storage.clone()), Ok(storage)));

        // A sidecar that cannot read a batch: it is sent again one by one,
        // and so is everything after it.
        // (on the same connection: the exchange went well)
        let server = async {
            assert!(matches!(read(&mut conn).await, SidecarRequest::Many(_)));
            reply(&mut conn, &SidecarReply::Refused(SidecarRefusal::Malformed("unknown variant".into()))).await.unwrap();
            for _ in 0..2 {
                let req = read(&mut conn).await;
                reply(&mut conn, &unknown(&req)).await.unwrap();
            }
            conn
        };
        let (a, b, _conn) = tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), server);
        assert_eq!((a, b), (Ok(unknown(&ack("shell-1"))), Ok(unknown(&ack("shell-2")))));
        assert!(client.inner.queue().alone, "later calls go alone too");
    }

    #[tokio::test]
    async fn a_call_given_up_before_it_was_sent_is_never_sent() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let client = SidecarClient::new(&path);
        // Two exchanges in flight, each held by the server.
        let first = tokio::spawn({
            let client = SidecarClient { inner: client.inner.clone() };
            async move { ack_call(&client, "shell-1").await }
        });
        let mut one = accept(&listener).await;
        assert_eq!(read(&mut one).await, ack("shell-1"));
        let second = tokio::spawn({
            let client = SidecarClient { inner: client.inner.clone() };
            async move { ack_call(&client, "shell-2").await }
        });
        let mut two = accept(&listener).await;
        assert_eq!(read(&mut two).await, ack("shell-2"));
        // A third call waits its turn, and its caller gives up.
        let given_up = tokio::time::timeout(Duration::from_millis(50), ack_call(&client, "shell-3")).await;
        assert!(given_up.is_err());
        reply(&mut one, &unknown(&ack("shell-1"))).await.unwrap();
        reply(&mut two, &unknown(&ack("shell-2"))).await.unwrap();
        assert_eq!(first.await.unwrap(), Ok(unknown(&ack("shell-1"))));
        assert_eq!(second.await.unwrap(), Ok(unknown(&ack("shell-2"))));
        // The next request to arrive (on either connection) is the next
        // call's, alone.
        let server = async {
            let conn = tokio::select! {
                Some(frame) = one.next() => (&mut one, frame),
                Some(frame) = two.next() => (&mut two, frame),
            };
            let req: SidecarRequest = decode(&conn.1.unwrap()).unwrap();
            reply(conn.0, &unknown(&req)).await.unwrap();
            req
        };
        let (d, seen) = tokio::join!(ack_call(&client, "shell-4"), server);
        assert_eq!(d, Ok(unknown(&ack("shell-4"))));
        assert_eq!(seen, ack("shell-4"));
    }
}
