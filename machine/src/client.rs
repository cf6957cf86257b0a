//! [`SidecarClient`]: the worker's side of the local socket. One request, one
//! reply, over lazily (re)connected unix streams.
//!
//! Calls made while others are in flight are gathered ([`crate::gather`])
//! into one [`SidecarRequest::Many`], so that under load many attempts'
//! records cost one frame each way and one pass of the sidecar's group
//! commit; an idle client sends a call at once and alone. Each caller still
//! gets its own reply, only after the flush that made its own request
//! durable: batching changes what travels, not what a reply means. A
//! sidecar too old to read a batch refuses it as malformed, and its
//! requests are sent again one by one.
//!
//! It never retries by itself: every failure is reported as [`Error::Unavailable`]
//! and the caller decides (requests are idempotent, so retrying is safe). An
//! `Unavailable` after the request was sent means "unknown whether it landed".
//! A request whose caller gave up before it was sent is not sent. It never
//! decodes anything the sidecar did not send as a whole frame.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tenure_protocol::messages::{SidecarRefusal, SidecarReply, SidecarRequest, MAX_SIDECAR_MANY};
use tenure_protocol::{decode, encode, CodecError, MAX_MESSAGE_BYTES};
use tokio::net::UnixStream;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::frame_codec;
use crate::gather::{Exchange, Gather, Sent};

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

/// Connections to the machine's sidecar, shared by the worker's tasks.
pub struct SidecarClient {
    gather: Gather<Socket>,
}

impl std::fmt::Debug for SidecarClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SidecarClient").field("path", &self.gather.sender().path).finish_non_exhaustive()
    }
}

/// The socket, and its connections not in use by an exchange (at most one
/// exchange uses a connection at a time).
struct Socket {
    path: PathBuf,
    timeout: Duration,
    idle: Mutex<Vec<Connection>>,
}

impl SidecarClient {
    /// A client for the socket at `socket_path`; nothing is connected until the
    /// first call.
    pub fn new(socket_path: impl Into<PathBuf>) -> SidecarClient {
        SidecarClient::build(socket_path.into(), DEFAULT_CALL_TIMEOUT)
    }

    fn build(path: PathBuf, timeout: Duration) -> SidecarClient {
        SidecarClient { gather: Gather::new(Socket { path, timeout, idle: Mutex::new(Vec::new()) }) }
    }

    /// The same socket with another bound on one exchange; the connections
    /// already open are not taken over.
    pub fn with_timeout(self, timeout: Duration) -> SidecarClient {
        SidecarClient::build(self.gather.sender().path.clone(), timeout)
    }

    pub fn socket_path(&self) -> &Path {
        &self.gather.sender().path
    }

    /// Sends `req` (alone, or in a batch with others made meanwhile) and waits
    /// for its reply.
    ///
    /// A connection is used by one exchange at a time and put back only after
    /// a complete exchange, so an exchange that fails or times out can never
    /// leave a late reply behind for the next one to mistake for its own.
    pub async fn call(&self, req: &SidecarRequest) -> Result<SidecarReply, Error> {
        let frame = Bytes::from(encode(req).map_err(Error::Encode)?);
        let wait = self.gather.sender().timeout * 2;
        match self.gather.call((req.clone(), frame), wait).await {
            Some(answer) => answer,
            None => Err(Error::Unavailable(format!("no answer within {wait:?}"))),
        }
    }
}

impl Exchange for Socket {
    /// A request, and its encoding (sent as it is when it goes alone).
    type Item = (SidecarRequest, Bytes);
    type Answer = Result<SidecarReply, Error>;
    const MAX_ITEMS: usize = MAX_SIDECAR_MANY;
    /// Well within a frame, whatever the batch's own framing adds.
    const MAX_BYTES: usize = MAX_MESSAGE_BYTES / 2;

    fn batches(&self, (req, _): &Self::Item) -> bool {
        req.batches()
    }

    fn size(&self, (_, frame): &Self::Item) -> usize {
        frame.len()
    }

    /// Sends the requests (alone when one, as a batch otherwise) on an idle
    /// or a new connection, bounded by the client's timeout.
    async fn send(&self, items: Vec<Self::Item>) -> Sent<Self::Item, Self::Answer> {
        if let [(_, frame)] = items.as_slice() {
            return Sent::Answered(vec![self.exchange(frame.clone()).await]);
        }
        let count = items.len();
        let (requests, frames): (Vec<_>, Vec<_>) = items.into_iter().unzip();
        let many = SidecarRequest::Many(requests);
        let answer = match encode(&many) {
            Ok(frame) => self.exchange(Bytes::from(frame)).await,
            Err(error) => Err(Error::Encode(error)),
        };
        match answer {
            Ok(SidecarReply::Many(answers)) if answers.len() == count => {
                Sent::Answered(answers.into_iter().map(Ok).collect())
            }
            Ok(SidecarReply::Many(answers)) => {
                let why = format!("the sidecar answered {} of a batch of {count} requests", answers.len());
                Sent::Answered(vec![Err(Error::Unavailable(why)); count])
            }
            Ok(SidecarReply::Refused(SidecarRefusal::Malformed(why))) => match many {
                SidecarRequest::Many(requests) => Sent::Unread(requests.into_iter().zip(frames).collect()),
                _ => Sent::Answered(vec![Err(Error::Unavailable(why)); count]),
            },
            // A refusal of the whole batch (the store failed) answers each request.
            answer => Sent::Answered(vec![answer; count]),
        }
    }
}

impl Socket {
    /// One frame out, one frame back.
    async fn exchange(&self, frame: Bytes) -> Result<SidecarReply, Error> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let exchange = async {
            let mut conn = match idle {
                Some(conn) => conn,
                None => {
                    let stream = UnixStream::connect(&self.path)
                        .await
                        .map_err(|e| Error::Unavailable(format!("connecting to {}: {e}", self.path.display())))?;
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
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(Ok((conn, reply))) => {
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
                Ok(reply)
            }
            Ok(Err(error)) => Err(error),
            Err(_) => Err(Error::Unavailable(format!("no reply within {:?}", self.timeout))),
        }
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

    /// A sidecar that answers every connection with `answer` and keeps what
    /// it was sent.
    fn fake_sidecar(
        listener: UnixListener,
        answer: fn(&SidecarRequest) -> SidecarReply,
    ) -> std::sync::Arc<std::sync::Mutex<Vec<SidecarRequest>>> {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = seen.clone();
        tokio::spawn(async move {
            loop {
                let mut conn = accept(&listener).await;
                let seen = kept.clone();
                tokio::spawn(async move {
                    while let Some(Ok(frame)) = conn.next().await {
                        let req: SidecarRequest = decode(&frame).unwrap();
                        let answered = answer(&req);
                        seen.lock().unwrap().push(req);
                        reply(&mut conn, &answered).await.unwrap();
                    }
                });
            }
        });
        seen
    }

    fn each_unknown(req: &SidecarRequest) -> SidecarReply {
        match req {
            SidecarRequest::Many(reqs) => SidecarReply::Many(reqs.iter().map(unknown).collect()),
            req => unknown(req),
        }
    }

    #[tokio::test]
    async fn calls_made_together_travel_as_one_batch_and_each_gets_its_own_answer() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let seen = fake_sidecar(UnixListener::bind(&path).unwrap(), each_unknown);
        let client = SidecarClient::new(&path);
        let (a, b, c) =
            tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), ack_call(&client, "shell-3"));
        // Each answer names its own request: a mix-up would show.
        assert_eq!(a, Ok(unknown(&ack("shell-1"))));
        assert_eq!(b, Ok(unknown(&ack("shell-2"))));
        assert_eq!(c, Ok(unknown(&ack("shell-3"))));
        // The first went at once, alone; the others, made meanwhile, together.
        let seen = seen.lock().unwrap().clone();
        assert!(seen.contains(&ack("shell-1")), "{seen:?}");
        assert!(seen.contains(&SidecarRequest::Many(vec![ack("shell-2"), ack("shell-3")])), "{seen:?}");
        assert_eq!(seen.len(), 2, "{seen:?}");
    }

    #[tokio::test]
    async fn a_batch_refused_as_a_whole_answers_each() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        fake_sidecar(UnixListener::bind(&path).unwrap(), |req| match req {
            SidecarRequest::Many(_) => SidecarReply::Refused(SidecarRefusal::Storage("disk".into())),
            req => unknown(req),
        });
        let client = SidecarClient::new(&path);
        let (a, b, c) =
            tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), ack_call(&client, "shell-3"));
        let storage = SidecarReply::Refused(SidecarRefusal::Storage("disk".into()));
        assert_eq!((a, b, c), (Ok(unknown(&ack("shell-1"))), Ok(storage.clone()), Ok(storage)));
    }

    #[tokio::test]
    async fn a_batch_an_older_sidecar_cannot_read_is_sent_again_one_by_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.sock");
        let seen = fake_sidecar(UnixListener::bind(&path).unwrap(), |req| match req {
            SidecarRequest::Many(_) => SidecarReply::Refused(SidecarRefusal::Malformed("unknown variant".into())),
            req => unknown(req),
        });
        let client = SidecarClient::new(&path);
        let (a, b, c) =
            tokio::join!(ack_call(&client, "shell-1"), ack_call(&client, "shell-2"), ack_call(&client, "shell-3"));
        assert_eq!(
            (a, b, c),
            (Ok(unknown(&ack("shell-1"))), Ok(unknown(&ack("shell-2"))), Ok(unknown(&ack("shell-3"))))
        );
        let seen = seen.lock().unwrap().clone();
        let many = seen.iter().position(|r| matches!(r, SidecarRequest::Many(_))).expect("a batch was tried");
        assert_eq!(seen[many + 1..], [ack("shell-2"), ack("shell-3")], "{seen:?}");
    }
}
