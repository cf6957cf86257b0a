//! Who sent a request, and where a daemon may answer it.
//!
//! Both are decided from what the NATS server vouches for, never from what a
//! message claims (safety rule 8):
//!
//! - **The caller.** On a server that authenticates its users, clients live in
//!   an account of their own and reach the daemons' services only through
//!   service imports shared with `share: true`. The server then adds a
//!   `Nats-Request-Info` header naming the caller's account and user, and
//!   replaces any header of that name the client set itself (checked against
//!   nats-server 2.15). A request's owner is that user, scoped with the session
//!   label the client chose ([`SessionId::scoped`]). A request without the
//!   header did not come through an import and is refused. On a server without
//!   authentication the caller is whoever it claims ([`Trust::Open`]), and the
//!   daemons warn that the cluster is open.
//! - **The answer.** A daemon publishes answers with its own permissions, so an
//!   answer to a subject the requester chose could land in JetStream's API, the
//!   lease bucket or the registry. Daemons answer only reply subjects shaped
//!   like inboxes ([`is_reply_subject`]); anything else is dropped unanswered.
//!
//! This module never decides what a caller may do: it only says who it is.

use async_nats::HeaderMap;
use serde::Deserialize;
use tenure_protocol::{IdError, SessionId};

/// The header the NATS server adds to requests that crossed a shared service import.
pub const REQUEST_INFO: &str = "Nats-Request-Info";

/// Whether the server authenticates the callers of the daemons' services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// The server requires authentication: every request to a daemon's service
    /// carries the server's request info, and the caller is the user it names.
    Authenticated,
    /// The server authenticates nobody: the caller is whoever it claims to be.
    /// For local experiments only; the daemons warn about it.
    Open,
}

impl Trust {
    /// What the connected server says of itself (its INFO's `auth_required`).
    /// Read it once connected — per request, or once a term has used the
    /// connection: before the first connection (a daemon connects in the
    /// background) the client holds no INFO yet and this says `Open`.
    pub fn of(client: &async_nats::Client) -> Trust {
        if client.server_info().auth_required {
            Trust::Authenticated
        } else {
            Trust::Open
        }
    }

    /// Logs, once the client is connected, what the server's trust mode means
    /// for `daemon` (in the background; nothing if it never connects).
    pub fn announce(client: &async_nats::Client, daemon: &'static str) {
        let client = client.clone();
        tokio::spawn(async move {
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Trust::of(&client).log(daemon);
        });
    }

    fn log(self, daemon: &str) {
        match self {
            Trust::Authenticated => {
                tracing::info!(daemon, "NATS authenticates its users: callers are the users the server vouches for")
            }
            Trust::Open => tracing::warn!(
                daemon,
                "the NATS server authenticates nobody: any client can act as any session and reach every \
                 subject; use the shipped account layout (deploy/nats) for anything but a local experiment"
            ),
        }
    }
}

/// Why a request's caller could not be established; the request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The request did not cross the clients' service import.
    #[error("unauthenticated request: it did not come through the clients' account")]
    Missing,
    /// The server's request info could not be read.
    #[error("unreadable request info: {0}")]
    Unreadable(String),
    /// The authenticated user name cannot be an owner (or the scoped owner is too long).
    #[error(transparent)]
    Id(#[from] IdError),
}

/// The part of the server's request info tenure reads.
#[derive(Deserialize)]
struct RequestInfo {
    #[serde(default)]
    acc: String,
    #[serde(default)]
    user: String,
}

/// The authenticated user that sent a request, from the server's request info.
pub fn caller(headers: Option<&HeaderMap>) -> Result<String, Error> {
    let value = headers.and_then(|h| h.get(REQUEST_INFO)).ok_or(Error::Missing)?;
    let info: RequestInfo = serde_json::from_str(value.as_str()).map_err(|e| Error::Unreadable(e.to_string()))?;
    if info.acc.is_empty() || info.user.is_empty() {
        return Err(Error::Unreadable("no account or user named".into()));
    }
    Ok(info.user)
}

/// The owner a request acts as: under [`Trust::Authenticated`], the session
/// label it `claimed` scoped under the user the server names; under
/// [`Trust::Open`], the claim itself.
pub fn owner(trust: Trust, headers: Option<&HeaderMap>, claimed: &SessionId) -> Result<SessionId, Error> {
    match trust {
        Trust::Open => Ok(claimed.clone()),
        Trust::Authenticated => Ok(SessionId::scoped(&caller(headers)?, claimed)?),
    }
}

/// Whether a daemon may publish its answer to `subject`: an inbox (`_INBOX.…`,
/// or a per-user prefix `_INBOX_<user>.…`) or a service import's mapped reply
/// (`_R_.…`), with no wildcard or space. Every other subject is refused, so no
/// requester can make a daemon publish into JetStream's API, a KV bucket or the
/// registry.
pub fn is_reply_subject(subject: &str) -> bool {
    let shaped = ["_INBOX.", "_INBOX_", "_R_."].iter().any(|p| subject.starts_with(p));
    shaped
        && subject.len() <= 512
        && !subject.bytes().any(|b| matches!(b, b'*' | b'>' | b' ' | b'\t' | b'\r' | b'\n'))
        && !subject.split('.').any(str::is_empty)
}

/// The reply subject of a received request, if a daemon may answer it there;
/// a request with another reply subject is logged and left unanswered.
pub fn reply_to(msg: &async_nats::Message) -> Option<String> {
    let reply = msg.reply.as_ref()?;
    if is_reply_subject(reply) {
        Some(reply.to_string())
    } else {
        tracing::warn!(subject = %msg.subject, reply = %reply, "request with a reply subject that is not an inbox: not answered");
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(json: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_INFO, json);
        h
    }

    #[test]
    fn only_inbox_shaped_subjects_are_answered() {
        for ok in ["_INBOX.abc.1", "_INBOX_alice.x.y", "_R_.AbC.dEf"] {
            assert!(is_reply_subject(ok), "{ok}");
        }
        for bad in [
            "$JS.API.STREAM.PURGE.TENURE_REGISTRY",
            "$KV.tenure_leader.leader",
            "tenure.registry.task.shell-1",
            "tenure.api.v1",
            "_INBOX.>",
            "_INBOX.a.*",
            "_INBOX..a",
            "_INBOX.a ",
            "_INBOX",
            "",
            "_R_",
        ] {
            assert!(!is_reply_subject(bad), "{bad}");
        }
        assert!(!is_reply_subject(&format!("_INBOX.{}", "a".repeat(600))));
    }

    #[test]
    fn the_owner_is_the_authenticated_user_scoped_with_the_label() {
        let label: SessionId = "ci".parse().unwrap();
        let h = info(r#"{"acc":"CLIENTS","user":"alice","kind":"Client"}"#);
        assert_eq!(owner(Trust::Authenticated, Some(&h), &label).unwrap().as_str(), "alice/ci");
        assert_eq!(owner(Trust::Open, Some(&h), &label).unwrap().as_str(), "ci");
        assert_eq!(owner(Trust::Open, None, &label).unwrap().as_str(), "ci");
        assert_eq!(owner(Trust::Authenticated, None, &label), Err(Error::Missing));
        assert!(matches!(owner(Trust::Authenticated, Some(&info("{")), &label), Err(Error::Unreadable(_))));
        assert!(matches!(
            owner(Trust::Authenticated, Some(&info(r#"{"acc":"CLIENTS"}"#)), &label),
            Err(Error::Unreadable(_))
        ));
        let slash = info(r#"{"acc":"CLIENTS","user":"a/b"}"#);
        assert!(matches!(owner(Trust::Authenticated, Some(&slash), &label), Err(Error::Id(_))));
    }
}
