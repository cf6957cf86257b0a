//! [`SidecarClient`]: the worker's side of the local socket. One request, one
//! reply, in order, over lazily (re)connected unix streams — one per call in
//! flight, so that concurrent calls reach the sidecar together.
//!
//! It never retries by itself: every failure is reported as [`Error::Unavailable`]
//! and the caller decides (requests are idempotent, so retrying is safe). An
//! `Unavailable` after the request was sent means "unknown whether it landed".
//! It never decodes anything the sidecar did not send as a whole frame.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tenure_protocol::messages::{SidecarReply, SidecarRequest};
use tenure_protocol::{decode, encode, CodecError};
use tokio::net::UnixStream;
use tokio::sync::Semaphore;
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use crate::frame_codec;

/// How long one call may take (connect, send, reply) unless set otherwise.
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

/// Most calls in flight at once, each on its own connection. Concurrent calls
/// let the sidecar commit them with one flush (it replies to each only after
/// that flush); a call beyond this waits for a free connection.
pub const MAX_CONNECTIONS: usize = 16;

/// Connections to the machine's sidecar, shared by the worker's tasks. Each
/// call has a connection to itself for its whole exchange (one request, one
/// reply); up to [`MAX_CONNECTIONS`] calls are in flight at once.
#[derive(Debug)]
pub struct SidecarClient {
    path: PathBuf,
    timeout: Duration,
    /// Connections not in use by a call.
    idle: std::sync::Mutex<Vec<Connection>>,
    slots: Semaphore,
}

impl SidecarClient {
    /// A client for the socket at `socket_path`; nothing is connected until the
    /// first call.
    pub fn new(socket_path: impl Into<PathBuf>) -> SidecarClient {
        SidecarClient {
            path: socket_path.into(),
            timeout: DEFAULT_CALL_TIMEOUT,
            idle: std::sync::Mutex::new(Vec::new()),
            slots: Semaphore::new(MAX_CONNECTIONS),
        }
    }

    /// Sets the bound on one call (connect, send and reply together).
    pub fn with_timeout(mut self, timeout: Duration) -> SidecarClient {
        self.timeout = timeout;
        self
    }

    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// Sends `req` and waits for its reply.
    ///
    /// The connection is taken out of the client for the duration of the call and
    /// put back only after a complete exchange, so a call that fails, times out or
    /// is cancelled by its caller can never leave a late reply behind for the
    /// next call to mistake for its own.
    pub async fn call(&self, req: &SidecarRequest) -> Result<SidecarReply, Error> {
        let frame = Bytes::from(encode(req).map_err(Error::Encode)?);
        let _slot = self.slots.acquire().await.map_err(|e| Error::Unavailable(e.to_string()))?;
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
            Ok(Err(e)) => Err(e),
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
}
