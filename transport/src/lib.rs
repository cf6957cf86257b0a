//! The NATS seam shared by every tenure process: how to connect, and typed
//! request/reply over the [`tenure_protocol::codec`].
//!
//! It owns connection policy (server list, credentials, TLS, names, reconnect
//! delays; [`NatsOptions`]) so that every daemon and client authenticates and
//! behaves the same during an outage. It never decides anything about tasks.

use std::time::Duration;

pub mod identity;
pub mod trace;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tenure_protocol::CodecError;

mod options;

pub use options::{InvalidOption, NatsOptions, Secret, DEFAULT_SERVER};

/// Longest pause between reconnect attempts. async-nats grows its default delay
/// to 4 s; a task runtime wants to notice a returning server sooner.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options cannot work; nothing was attempted.
    #[error(transparent)]
    Config(#[from] InvalidOption),
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

/// The async-nats options for `opts` with tenure's policy (name, timeouts,
/// reconnect delays, credentials, TLS), without an event callback. For callers
/// that need their own callback (tests); everyone else uses [`connect`].
pub async fn connect_options(
    opts: &NatsOptions,
    name: &str,
    wait_for_server: bool,
) -> Result<async_nats::ConnectOptions, Error> {
    opts.validate()?;
    let mut o = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .custom_inbox_prefix(opts.inbox_prefix())
        .reconnect_delay_callback(reconnect_delay);
    if wait_for_server {
        o = o.retry_on_initial_connect();
    }
    if let (Some(user), Some(password)) = (&opts.user, &opts.password) {
        o = o.user_and_password(user.clone(), password.expose().to_owned());
    }
    if let Some(token) = &opts.token {
        o = o.token(token.expose().to_owned());
    }
    if let Some(path) = &opts.nkey {
        let seed = std::fs::read_to_string(path).map_err(|e| InvalidOption {
            field: "nkey",
            flag: "--nats-nkey",
            reason: format!("cannot read {}: {e}", path.display()),
        })?;
        o = o.nkey(seed.trim().to_owned());
    }
    if let Some(path) = &opts.creds {
        o = o.credentials_file(path).await.map_err(|e| InvalidOption {
            field: "creds",
            flag: "--nats-creds",
            reason: format!("cannot use {}: {e}", path.display()),
        })?;
    }
    if let Some(ca) = &opts.tls_ca {
        o = o.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&opts.tls_cert, &opts.tls_key) {
        o = o.add_client_certificate(cert.clone(), key.clone());
    }
    if opts.tls_required {
        o = o.require_tls(true);
    }
    Ok(o)
}

/// Connects with tenure's policy (see [`connect_options`]) to any of the
/// configured servers. With `wait_for_server`, servers that are not up yet are
/// retried instead of failing at once (daemons); clients fail fast. Invalid
/// options fail at once either way. Connection events — including the
/// server's refusals such as permission violations — are logged.
pub async fn connect(opts: &NatsOptions, name: &str, wait_for_server: bool) -> Result<async_nats::Client, Error> {
    let servers = opts.server_list();
    let o = connect_options(opts, name, wait_for_server).await?.event_callback(|event| async move {
        let kind = match &event {
            async_nats::Event::Connected => "connected",
            async_nats::Event::Disconnected => "disconnected",
            async_nats::Event::LameDuckMode => "lame-duck",
            async_nats::Event::Draining => "draining",
            async_nats::Event::Closed => "closed",
            async_nats::Event::SlowConsumer(_) => "slow-consumer",
            async_nats::Event::ServerError(_) => "server-error",
            async_nats::Event::ClientError(_) => "client-error",
        };
        connection_events().add(1, &[opentelemetry::KeyValue::new("event", kind)]);
        match event {
            async_nats::Event::Connected => tracing::info!(%event, "nats"),
            async_nats::Event::Draining | async_nats::Event::Closed => tracing::debug!(%event, "nats"),
            _ => tracing::warn!(%event, "nats"),
        }
    });
    o.connect(servers.as_slice())
        .await
        .map_err(|e| Error::Connect { url: opts.redacted_servers(), reason: e.to_string() })
}

/// `tenure.nats.connection.events` by `event` (`connected` after a
/// `disconnected` is a reconnect); a no-op unless a meter provider is installed.
fn connection_events() -> &'static opentelemetry::metrics::Counter<u64> {
    static EVENTS: std::sync::OnceLock<opentelemetry::metrics::Counter<u64>> = std::sync::OnceLock::new();
    EVENTS.get_or_init(|| {
        opentelemetry::global::meter("tenure-nats")
            .u64_counter("tenure.nats.connection.events")
            .with_description("NATS connection events by kind")
            .build()
    })
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

/// Sends `req` and decodes the reply, within `timeout`. A traced caller's
/// context travels in the headers.
pub async fn request<Req: Serialize, Rep: DeserializeOwned>(
    client: &async_nats::Client,
    subject: String,
    req: &Req,
    timeout: Duration,
) -> Result<Rep, Error> {
    let payload = tenure_protocol::encode(req).map_err(|source| Error::Codec { subject: subject.clone(), source })?;
    request_encoded(client, subject, payload.into(), trace::current_headers(), timeout).await
}

/// Sends an encoded request with `headers` and decodes the reply, within
/// `timeout`.
pub async fn request_encoded<Rep: DeserializeOwned>(
    client: &async_nats::Client,
    subject: String,
    payload: bytes::Bytes,
    headers: Option<async_nats::HeaderMap>,
    timeout: Duration,
) -> Result<Rep, Error> {
    let mut request = async_nats::Request::new().payload(payload);
    if let Some(headers) = headers {
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

/// Publishes an encoded reply; encoding failures are logged, never panics. A
/// subject that is not an inbox ([`identity::is_reply_subject`]) is never
/// published to.
pub async fn reply<T: Serialize>(client: &async_nats::Client, to: String, msg: &T) {
    if !identity::is_reply_subject(&to) {
        tracing::warn!(reply = %to, "refused to answer on a subject that is not an inbox");
        return;
    }
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
