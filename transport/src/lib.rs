//! The NATS seam shared by every tenure process: how to connect, and typed
//! request/reply over the [`tenure_protocol::codec`].
//!
//! It owns connection policy (names, reconnect delays) so that every daemon and
//! client behaves the same during an outage. It never decides anything about
//! tasks.

use std::time::Duration;

pub mod trace;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tenure_protocol::CodecError;

/// Longest pause between reconnect attempts. async-nats grows its default delay
/// to 4 s; a task runtime wants to notice a returning server sooner.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to NATS at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("no reply from {subject} within {timeout:?}")]
    Timeout { subject: String, timeout: Duration },
    #[error("nobody serves {subject} (is the daemon running?)")]
    NoResponders { subject: String },
    #[error("bad message on {subject}: {source}")]
    Codec { subject: String, source: CodecError },
    #[error("NATS error on {subject}: {reason}")]
    Nats { subject: String, reason: String },
}

/// Connects with tenure's reconnect policy. With `wait_for_server`, a server that
/// is not up yet is retried instead of failing at once (daemons); clients fail fast.
pub async fn connect(url: &str, name: &str, wait_for_server: bool) -> Result<async_nats::Client, Error> {
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .reconnect_delay_callback(reconnect_delay);
    if wait_for_server {
        opts = opts.retry_on_initial_connect();
    }
    opts.connect(url).await.map_err(|e| Error::Connect { url: url.to_owned(), reason: e.to_string() })
}

/// The pause before connection attempt number `attempts` (counted from 1).
/// async-nats asks for a delay before every attempt, the very first connect of
/// a process included: that one, and the first retry after a lost connection,
/// go at once; later ones back off from 100 ms up to [`MAX_RECONNECT_DELAY`].
fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let ms = 50u64.saturating_mul(1 << (attempts - 1).min(5) as u64);
    Duration::from_millis(ms).min(MAX_RECONNECT_DELAY)
}

/// Sends `req` and decodes the reply, within `timeout`.
pub async fn request<Req: Serialize, Rep: DeserializeOwned>(
    client: &async_nats::Client,
    subject: String,
    req: &Req,
    timeout: Duration,
) -> Result<Rep, Error> {
    let payload = tenure_protocol::encode(req).map_err(|source| Error::Codec { subject: subject.clone(), source })?;
    let mut request = async_nats::Request::new().payload(payload.into());
    if let Some(headers) = trace::current_headers() {
        request = request.headers(headers);
    }
    let fut = client.send_request(subject.clone(), request);
    let msg = match tokio::time::timeout(timeout, fut).await {
        Err(_) => return Err(Error::Timeout { subject, timeout }),
        Ok(Err(e)) => {
            return Err(match e.kind() {
                async_nats::RequestErrorKind::NoResponders => Error::NoResponders { subject },
                async_nats::RequestErrorKind::TimedOut => Error::Timeout { subject, timeout },
                _ => Error::Nats { subject, reason: e.to_string() },
            })
        }
        Ok(Ok(msg)) => msg,
    };
    tenure_protocol::decode(&msg.payload).map_err(|source| Error::Codec { subject, source })
}

/// Publishes an encoded reply; encoding failures are logged, never panics.
pub async fn reply<T: Serialize>(client: &async_nats::Client, to: String, msg: &T) {
    match tenure_protocol::encode(msg) {
        Ok(bytes) => {
            if let Err(error) = client.publish(to, bytes.into()).await {
                tracing::warn!(%error, "reply not sent");
            }
        }
        Err(error) => tracing::error!(%error, "reply could not be encoded"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_connect_is_not_delayed_and_retries_back_off() {
        assert_eq!(reconnect_delay(0), Duration::ZERO);
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), Duration::from_millis(100));
        assert_eq!(reconnect_delay(3), Duration::from_millis(200));
        assert_eq!(reconnect_delay(50), MAX_RECONNECT_DELAY);
    }
}
