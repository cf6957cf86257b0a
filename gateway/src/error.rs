//! Every refusal of the HTTP API as one JSON body, `{ "code", "message" }`,
//! with a stable `code` and the HTTP status that fits it.
//!
//! tenure's own refusals ([`ApiError`]) are mapped by one `match` without a
//! wildcard, so a new refusal does not compile until it has a status here.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tenure_protocol::messages::ApiError;
use utoipa::ToSchema;

/// The body of every error answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// Stable, machine-readable: `not-found`, `unauthorized`, `too-large`, …
    pub code: String,
    /// For people; may change between versions.
    pub message: String,
}

/// A refusal of the HTTP API.
#[derive(Debug)]
pub struct Error {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl Error {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Error {
        Error { status, code, message: message.into() }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Error {
        Error::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Error {
        Error::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody { code: self.code.to_owned(), message: self.message.clone() }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The status and code of each of tenure's refusals.
pub fn api_status(e: &ApiError) -> (StatusCode, &'static str) {
    use StatusCode as S;
    match e {
        ApiError::NotFound(_) => (S::NOT_FOUND, "not-found"),
        ApiError::InvalidRequest(_) => (S::CONFLICT, "invalid-request"),
        ApiError::InvalidSpec(_) => (S::BAD_REQUEST, "invalid-spec"),
        ApiError::UnknownKind { .. } => (S::BAD_REQUEST, "unknown-kind"),
        ApiError::NotLeader => (S::SERVICE_UNAVAILABLE, "no-leader"),
        ApiError::Unavailable(_) => (S::SERVICE_UNAVAILABLE, "unavailable"),
        ApiError::NotRunning { .. } => (S::CONFLICT, "not-running"),
        ApiError::NoInput { .. } => (S::CONFLICT, "no-input"),
        ApiError::InputSize { .. } => (S::PAYLOAD_TOO_LARGE, "input-size"),
        ApiError::InputFull { .. } => (S::TOO_MANY_REQUESTS, "input-full"),
        ApiError::Unauthenticated(_) => (S::FORBIDDEN, "unauthenticated"),
        ApiError::Quota { .. } => (S::TOO_MANY_REQUESTS, "quota"),
        ApiError::RecordTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, "record-too-large"),
        ApiError::RegistryFull { .. } => (S::SERVICE_UNAVAILABLE, "registry-full"),
        ApiError::RegistryBehind { .. } => (S::SERVICE_UNAVAILABLE, "registry-behind"),
        ApiError::ConcurrencyLimitConflict { .. } => (S::CONFLICT, "concurrency-limit-conflict"),
        ApiError::ApprovalRefused { .. } => (S::FORBIDDEN, "approval-refused"),
        ApiError::NotAwaitingApproval { .. } => (S::CONFLICT, "not-awaiting-approval"),
        // The batch task's own refusal, whose place the message names.
        ApiError::InBatch { error, .. } => api_status(error),
    }
}

impl From<ApiError> for Error {
    fn from(e: ApiError) -> Error {
        let (status, code) = api_status(&e);
        Error::new(status, code, e.to_string())
    }
}

impl From<tenure_client::Error> for Error {
    fn from(e: tenure_client::Error) -> Error {
        use tenure_client::Error as C;
        match e {
            C::Api(api) => api.into(),
            C::NoCoordinator => Error::new(StatusCode::SERVICE_UNAVAILABLE, "no-leader", e.to_string()),
            C::Transport(tenure_transport::Error::Timeout { .. }) => {
                Error::new(StatusCode::GATEWAY_TIMEOUT, "timeout", e.to_string())
            }
            C::Transport(_) | C::UnexpectedReply { .. } | C::Output { .. } => {
                Error::new(StatusCode::BAD_GATEWAY, "cluster", format!("{e:#}"))
            }
            C::Sink(_) => Error::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()),
        }
    }
}

impl From<crate::callers::Error> for Error {
    fn from(e: crate::callers::Error) -> Error {
        use crate::callers::Error as C;
        match e {
            C::Client(c) => c.into(),
            C::NoCredentials | C::Session(_) => Error::new(StatusCode::FORBIDDEN, "no-credentials", e.to_string()),
            C::Credentials { .. } => {
                tracing::error!(error = %e, "caller's NATS credentials unusable");
                Error::new(StatusCode::FORBIDDEN, "no-credentials", "the token's NATS credentials cannot be used")
            }
        }
    }
}
