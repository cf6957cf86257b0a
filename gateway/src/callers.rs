//! Who the gateway acts as for a request: the caller, never itself.
//!
//! On an authenticating NATS cluster the owner of a request is the NATS user
//! the server vouches for, so the gateway keeps one NATS connection per
//! caller, made with the caller's own credentials (the file named by the
//! caller's token), connected on first use and reused. On a cluster without
//! authentication (`tenure dev`, tests) every caller shares the gateway's
//! connection and claims its identity as its session, as the CLI does.
//!
//! It must never send a caller's request over another caller's connection,
//! nor over the gateway's own connection on an authenticating cluster.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tenure_client::Client;
use tenure_protocol::SessionId;
use tenure_transport::{NatsOptions, Secret};
use tokio::sync::Mutex;

use crate::tokens::Grant;

/// Why no client could be had for a caller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The cluster authenticates and the token names no credentials of the caller.
    #[error("this token or certificate grant names no NATS credentials and the cluster authenticates: create it with --nats-creds")]
    NoCredentials,
    #[error("the caller's NATS credentials {path} cannot be read: {reason}")]
    Credentials { path: PathBuf, reason: String },
    #[error("identity {0:?} cannot be a session")]
    Session(String),
    #[error(transparent)]
    Client(#[from] tenure_client::Error),
}

/// The connections of the callers.
pub struct Callers {
    base: NatsOptions,
    /// The gateway's own options name credentials: the cluster authenticates.
    authenticating: bool,
    shared: Mutex<Option<Client>>,
    own: Mutex<HashMap<PathBuf, Client>>,
}

impl Callers {
    /// `base` is how the gateway reaches NATS (servers, TLS, and on an
    /// authenticating cluster its own credentials, used for nothing but to
    /// say that callers need theirs).
    pub fn new(base: NatsOptions) -> Callers {
        let authenticating = base.user.is_some() || base.token.is_some() || base.nkey.is_some() || base.creds.is_some();
        Callers { base, authenticating, shared: Mutex::new(None), own: Mutex::new(HashMap::new()) }
    }

    /// The client acting as the grant's identity.
    pub async fn client(&self, token: &Grant) -> Result<Client, Error> {
        let session: SessionId = token.identity.parse().map_err(|_| Error::Session(token.identity.clone()))?;
        if let Some(path) = &token.nats_creds {
            let mut own = self.own.lock().await;
            if let Some(c) = own.get(path) {
                return Ok(c.with_session(session));
            }
            let opts = caller_options(&self.base, path)?;
            let client = Client::connect(&opts, &format!("tenure-gateway/{}", token.identity), false, session).await?;
            own.insert(path.clone(), client.clone());
            return Ok(client);
        }
        if self.authenticating {
            return Err(Error::NoCredentials);
        }
        let mut shared = self.shared.lock().await;
        if let Some(c) = shared.as_ref() {
            return Ok(c.with_session(session));
        }
        let client = Client::connect(&self.base, "tenure-gateway", false, session).await?;
        *shared = Some(client.clone());
        Ok(client)
    }
}

/// The gateway's options with the caller's credentials instead of its own.
fn caller_options(base: &NatsOptions, path: &Path) -> Result<NatsOptions, Error> {
    let bad = |reason: String| Error::Credentials { path: path.to_owned(), reason };
    let mut opts = NatsOptions { user: None, password: None, token: None, nkey: None, creds: None, ..base.clone() };
    if path.extension().is_some_and(|e| e == "creds") {
        opts.creds = Some(path.to_owned());
        return Ok(opts);
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let Some((key, value)) = line.split_once('=') else { return Err(bad(format!("not KEY=VALUE: {line:?}"))) };
        let value = value.trim().to_owned();
        match key.trim() {
            "TENURE_NATS_USER" => opts.user = Some(value),
            "TENURE_NATS_PASSWORD" => opts.password = Some(Secret::new(value)),
            "TENURE_NATS_TOKEN" => opts.token = Some(Secret::new(value)),
            "TENURE_NATS_NKEY" => opts.nkey = Some(value.into()),
            "TENURE_NATS_CREDS" => opts.creds = Some(value.into()),
            "TENURE_NATS_TLS_CA" => opts.tls_ca = Some(value.into()),
            "TENURE_NATS_TLS_CERT" => opts.tls_cert = Some(value.into()),
            "TENURE_NATS_TLS_KEY" => opts.tls_key = Some(value.into()),
            other => return Err(bad(format!("unknown key {other}"))),
        }
    }
    opts.validate().map_err(|e| bad(e.to_string()))?;
    Ok(opts)
}
