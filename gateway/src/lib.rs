//! `tenure-gateway`: tenure over HTTP — a JSON API for every client verb,
//! Server-Sent Events for a task's output and the caller's notices, an
//! OpenAPI 3.1 document generated from the handlers (`/openapi.json`), and a
//! live task board at `/`.
//!
//! The gateway is a client like the CLI, not a privileged party: every
//! request goes through `tenure-client` (its retry rule included), acting as
//! the caller its bearer token or client certificate names ([`callers`]), and
//! it keeps no state of its own besides connections, so any number of
//! gateways can serve one cluster. Tokens are checked against a file of
//! hashes, certificates' subjects against the grants in the same file
//! ([`tokens`]); HTTPS and client certificates are [`tls`].
//!
//! It must never talk to JetStream, act for anyone but the authenticated
//! caller, or answer an error that is not JSON.

pub mod api;
pub mod callers;
pub mod error;
pub mod mcp;
pub mod stream;
pub mod tls;
pub mod tokens;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use axum::Router;
use tenure_client::Client;

pub use error::{Error, ErrorBody};

/// Most bytes a request body may hold (a task spec with its environment,
/// one input message); larger bodies are refused with 413.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// What a gateway needs to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub listen: SocketAddr,
    /// The file of token hashes (`tenure gateway token create`).
    pub tokens: PathBuf,
    /// How to reach NATS. On an authenticating cluster callers connect with
    /// their own credentials; these only say that the cluster authenticates.
    pub nats: tenure_transport::NatsOptions,
    /// Serve HTTPS (and take client certificates) instead of plain HTTP.
    pub tls: Option<tls::TlsOptions>,
}

/// What every handler shares.
#[derive(Clone)]
pub struct State {
    inner: Arc<Inner>,
}

struct Inner {
    tokens: tokens::TokenStore,
    callers: callers::Callers,
}

impl State {
    pub fn new(tokens: tokens::TokenStore, nats: tenure_transport::NatsOptions) -> State {
        State { inner: Arc::new(Inner { tokens, callers: callers::Callers::new(nats) }) }
    }
}

/// The authenticated caller of a request: its identity and a client acting as it.
pub struct Caller {
    pub identity: String,
    pub client: Client,
    /// What authenticated it, to check again during long streams.
    credential: Credential,
}

/// What a caller authenticated with.
#[derive(Clone)]
enum Credential {
    /// A bearer token (never logged).
    Token(String),
    /// A verified client certificate's subject.
    Certificate(String),
}

impl Credential {
    /// Who it acts as now: `None` once revoked.
    fn grant(&self, tokens: &tokens::TokenStore) -> Option<tokens::Grant> {
        match self {
            Credential::Token(token) => {
                tokens.verify(token).map(|r| tokens::Grant { identity: r.identity, nats_creds: r.nats_creds })
            }
            Credential::Certificate(subject) => tokens.verify_certificate(subject),
        }
    }
}

impl<S> FromRequestParts<S> for Caller
where
    State: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Caller, Error> {
        let state = State::from_ref(state);
        // A token, when one is given, decides: a request never mixes two credentials.
        let credential = match parts.headers.get(axum::http::header::AUTHORIZATION) {
            Some(header) => {
                let token = header
                    .to_str()
                    .ok()
                    .and_then(|h| h.strip_prefix("Bearer ").or_else(|| h.strip_prefix("bearer ")))
                    .map(str::trim)
                    .ok_or_else(|| Error::unauthorized("the Authorization header is not `Bearer <token>`"))?;
                Credential::Token(token.to_owned())
            }
            None => match parts.extensions.get::<tls::PeerSubject>() {
                Some(tls::PeerSubject(subject)) => Credential::Certificate(subject.clone()),
                None => {
                    return Err(Error::unauthorized(
                        "missing Authorization: Bearer <token> (create one with `tenure gateway token create`) \
                         or a client certificate (`tenure gateway cert allow`)",
                    ))
                }
            },
        };
        let grant = credential.grant(&state.inner.tokens).ok_or_else(|| match &credential {
            Credential::Token(_) => Error::unauthorized("unknown or revoked token"),
            Credential::Certificate(subject) => Error::unauthorized(format!(
                "the client certificate's subject {subject:?} is not allowed (or was revoked): \
                 `tenure gateway cert allow {subject} --identity …`"
            )),
        })?;
        let client = state.inner.callers.client(&grant).await?;
        Ok(Caller { identity: grant.identity, client, credential })
    }
}

/// The whole application: the API (documented), the document, the board.
pub fn app(state: State) -> Router {
    let (api, doc) = api::router().split_for_parts();
    let doc = Arc::new(doc);
    // One reporter for every request: claims of ends made by this gateway
    // are serialized, so two concurrent calls of one caller never both list one.
    let reporter = Arc::new(mcp::notices::Reporter::default());
    let mcp = rmcp::transport::streamable_http_server::StreamableHttpService::new(
        move || Ok(mcp::Tools::new(None, reporter.clone())),
        Arc::new(rmcp::transport::streamable_http_server::session::local::LocalSessionManager::default()),
        // Stateless, JSON answers; any Host: every request is authenticated.
        // No sessions (they are gone from MCP 2026-07-28, and the gateway
        // keeps no state but connections): the news rides in every result.
        rmcp::transport::streamable_http_server::StreamableHttpServerConfig::default()
            .disable_allowed_hosts()
            .with_legacy_session_mode(false)
            .with_json_response(true),
    );
    Router::new()
        .merge(api)
        .route("/openapi.json", get(move || async move { axum::Json((*doc).clone()) }))
        .route("/", get(board))
        .nest_service(
            "/mcp",
            tower::ServiceBuilder::new()
                .layer(axum::middleware::from_fn_with_state(state.clone(), mcp_caller))
                .service(mcp),
        )
        .fallback(|| async {
            Error::new(axum::http::StatusCode::NOT_FOUND, "no-route", "no such route; see /openapi.json")
        })
        .method_not_allowed_fallback(|| async {
            Error::new(axum::http::StatusCode::METHOD_NOT_ALLOWED, "method-not-allowed", "see /openapi.json")
        })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// In front of `/mcp`: the caller authenticated as for every route (401
/// otherwise), its client put in the request for the tools to act as.
async fn mcp_caller(
    axum::extract::State(state): axum::extract::State<State>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let (mut parts, body) = request.into_parts();
    match Caller::from_request_parts(&mut parts, &state).await {
        Ok(caller) => {
            parts.extensions.insert(caller.client);
            next.run(axum::extract::Request::from_parts(parts, body)).await
        }
        Err(e) => e.into_response(),
    }
}

/// The board: one static page, its script inline, no build step.
async fn board() -> impl IntoResponse {
    (
        [
            ("content-security-policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"),
            ("x-frame-options", "DENY"),
            ("referrer-policy", "no-referrer"),
        ],
        Html(include_str!("board.html")),
    )
}

/// Serves until `shutdown` resolves.
pub async fn run(
    opts: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let tokens = tokens::TokenStore::open(opts.tokens.clone()).map_err(RunError::Tokens)?;
    let tls = opts.tls.as_ref().map(tls::server_config).transpose().map_err(RunError::Tls)?;
    let listener = tokio::net::TcpListener::bind(opts.listen).await.map_err(|e| RunError::Listen(opts.listen, e))?;
    let local = listener.local_addr().map_err(|e| RunError::Listen(opts.listen, e))?;
    let client_certificates = opts.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
    tracing::info!(listen = %local, tokens = %opts.tokens.display(), https = tls.is_some(), client_certificates, "gateway serving");
    let app = app(State::new(tokens, opts.nats));
    match tls {
        Some(config) => {
            tls::serve(listener, config, app, shutdown).await;
            Ok(())
        }
        None => axum::serve(listener, app).with_graceful_shutdown(shutdown).await.map_err(RunError::Serve),
    }
}

/// Why the gateway could not serve.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Tokens(tokens::Error),
    #[error(transparent)]
    Tls(tls::Error),
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    #[error("serving: {0}")]
    Serve(std::io::Error),
}
