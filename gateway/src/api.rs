//! The JSON API: one handler per client verb, each documented with
//! `#[utoipa::path]` and registered through `utoipa_axum::routes!`, so the
//! routes and the OpenAPI document are made from the same list.
//!
//! Handlers translate HTTP into `tenure-client` calls made as the caller and
//! tenure's answers into JSON; they decide nothing about tasks.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use serde::{Deserialize, Serialize};
use tenure_client::SendError;
use tenure_protocol::messages::{ApiRequest, ApiResponse, TaskSnapshot, WaitFor, MAX_OUTPUT_CHUNK};
use tenure_protocol::placement::Placement;
use tenure_protocol::resources::ResourceLimits;
use tenure_protocol::resume::ResumeSpec;
use tenure_protocol::retry::{NotBefore, RetryCause, RetryPolicy};
use tenure_protocol::spec::TimeLimits;
use tenure_protocol::{Kind, StepSpec, TaskId, TaskSpec};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoParams, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::{Error, ErrorBody};
use crate::{Caller, State};

/// The document's frame; paths are added by [`router`].
#[derive(OpenApi)]
#[openapi(
    info(title = "tenure gateway", description = "tenure's client verbs over HTTP. Every route needs `Authorization: Bearer <token>`; errors are `{code, message}`."),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    components(schemas(ErrorBody))
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The documented routes.
pub fn router() -> OpenApiRouter<State> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(submit, list))
        .routes(routes!(submit_batch))
        .routes(routes!(get_task, delete_task))
        .routes(routes!(logs))
        .routes(routes!(crate::stream::follow_output))
        .routes(routes!(kill))
        .routes(routes!(send))
        .routes(routes!(wait))
        .routes(routes!(archive))
        .routes(routes!(approve))
        .routes(routes!(pause))
        .routes(routes!(resume))
        .routes(routes!(unarchive))
        .routes(routes!(status))
        .routes(routes!(whoami))
        .routes(routes!(crate::stream::notices))
}

// ------------------------------------------------------------- extractors

/// A JSON body whose rejections are JSON errors (400 malformed, 413 too large).
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = Error;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Error> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Body(v)),
            Err(e) => Err(json_rejection(e)),
        }
    }
}

fn json_rejection(e: JsonRejection) -> Error {
    match &e {
        JsonRejection::JsonDataError(_) => Error::bad_request("invalid-body", e.body_text()),
        JsonRejection::JsonSyntaxError(_) => Error::bad_request("malformed-json", e.body_text()),
        JsonRejection::MissingJsonContentType(_) => {
            Error::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "content-type", e.body_text())
        }
        JsonRejection::BytesRejection(_) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Error::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-large",
            format!("the request body is larger than {} bytes", crate::MAX_BODY_BYTES),
        ),
        _ => Error::new(e.status(), "bad-body", e.body_text()),
    }
}

/// A task id from the path, refused as JSON.
pub struct TaskPath(pub TaskId);

impl<S: Send + Sync> FromRequestParts<S> for TaskPath {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Error> {
        let axum::extract::Path(raw) = axum::extract::Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e: PathRejection| Error::bad_request("bad-path", e.body_text()))?;
        let id = raw.parse::<TaskId>().map_err(|e| Error::bad_request("bad-task-id", format!("{raw:?}: {e}")))?;
        Ok(TaskPath(id))
    }
}

/// A query string, refused as JSON.
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, Error> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(v)| Query(v))
            .map_err(|e: QueryRejection| Error::bad_request("bad-query", e.body_text()))
    }
}

// ------------------------------------------------------------- views

/// A task as the API shows it: the snapshot's fields, times also as RFC 3339.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, schemars::JsonSchema)]
pub struct TaskView {
    /// `<kind>-<n>`.
    pub id: String,
    pub kind: String,
    pub label: String,
    pub owner: String,
    /// queued, blocked, leased, running, waiting (an agent reading its
    /// input), paused, stopping, completed, killed, failed, unknown.
    pub status: String,
    pub detail: Option<String>,
    pub exit_code: Option<i32>,
    pub output_dropped: u64,
    pub attempt: u32,
    pub epoch: u64,
    pub worker: Option<String>,
    pub idempotent: bool,
    pub kill_requested: bool,
    /// Why it was asked to stop, as the first kill said it.
    pub kill_reason: Option<String>,
    /// Why the outcome could not be proved (for `unknown`), or why it cannot
    /// start (for `blocked`), and what to do.
    pub hint: Option<HintView>,
    /// RFC 3339, UTC.
    pub created_at: String,
    pub created_at_ms: u64,
    pub started_at: Option<String>,
    pub started_at_ms: Option<u64>,
    pub finished_at: Option<String>,
    pub finished_at_ms: Option<u64>,
    pub reported: bool,
    /// active, archived or deleted.
    pub board: String,
    pub cleaned: bool,
    pub parent: Option<String>,
    /// A workflow's steps, as tenure reports them.
    #[schema(value_type = Vec<Object>)]
    pub steps: serde_json::Value,
    pub matches: u64,
    pub final_output: bool,
    /// Each ended attempt of a task with a retry policy, oldest first
    /// (`attempt`, `worker`, `ending`, `cause`, `exit_code`, `detail`,
    /// `started_at_ms`, `ended_at_ms`, `retried`).
    #[schema(value_type = Vec<Object>)]
    pub attempts: serde_json::Value,
    /// A queued task that may not start before this time (its `not_before`,
    /// or the backoff before its next retry), RFC 3339, UTC.
    pub not_before: Option<String>,
    pub not_before_ms: Option<u64>,
    /// Its retry policy (`retries`, `backoff_ms`, `backoff_max_ms`, `on`).
    #[schema(value_type = Option<Object>)]
    pub retry: Option<serde_json::Value>,
    pub priority: i32,
    /// Its placement constraints, as written (`gpu=a100`, `repo in (web,api)`).
    pub on: Vec<String>,
    /// Its concurrency key and the limit it was submitted with, if any.
    pub concurrency_key: Option<String>,
    pub concurrency_limit: Option<u32>,
    /// For a task that ended, is `unknown` or `paused`: whether it can go on
    /// as it is (`resume` of a paused one), and how to go on either way.
    pub resumable: Option<bool>,
    pub resume_how: Option<String>,
    /// Its resource limits (`memory_bytes`, `cpu_millis`, `pids`), when it
    /// has some.
    #[schema(value_type = Option<Object>)]
    pub resources: Option<serde_json::Value>,
    /// For an `agent` task with a resume command: the declaration
    /// (`spec`: `command`, `captures`, `anywhere`), the values captured from
    /// its output (`captured`), how often it was resumed (`resumes`), the
    /// input kept for its next attempt (`pending_input`, `dropped_input`)
    /// and the machine it resumes on (`machine`).
    #[schema(value_type = Option<Object>)]
    pub agent_resume: Option<serde_json::Value>,
    /// Its status history, oldest first, derived from the facts its record
    /// keeps: submitted, held, each attempt's start and end, the current
    /// attempt, the end. Transitions that leave no stored fact (leased,
    /// stopping, pauses, when it was approved) are not in it.
    #[serde(default)]
    pub timeline: Vec<TimelineEntry>,
}

/// One entry of a task's status history.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, schemars::JsonSchema)]
pub struct TimelineEntry {
    /// RFC 3339, UTC; absent when the fact has no stored time (a kill
    /// request, an outcome in doubt).
    pub at: Option<String>,
    pub at_ms: Option<u64>,
    /// submitted, held, attempt-started, attempt-ended, not-before,
    /// kill-requested, in-doubt or ended.
    pub what: String,
    pub attempt: Option<u32>,
    pub worker: Option<String>,
    /// How an attempt or the task ended, why it is held, the epoch of the
    /// current attempt.
    pub detail: Option<String>,
}

impl From<tenure_protocol::timeline::Entry> for TimelineEntry {
    fn from(e: tenure_protocol::timeline::Entry) -> TimelineEntry {
        TimelineEntry {
            at: e.at_ms.map(rfc3339),
            at_ms: e.at_ms,
            what: e.what.as_str().to_owned(),
            attempt: e.attempt,
            worker: e.worker.as_ref().map(ToString::to_string),
            detail: e.detail,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, schemars::JsonSchema)]
pub struct HintView {
    pub tag: String,
    pub message: String,
}

/// Epoch milliseconds as RFC 3339 (UTC, milliseconds).
pub fn rfc3339(ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    t.format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| ms.to_string())
}

impl From<&TaskSnapshot> for TaskView {
    fn from(s: &TaskSnapshot) -> TaskView {
        TaskView {
            id: s.id.to_string(),
            kind: s.kind.to_string(),
            label: s.label.clone(),
            owner: s.owner.to_string(),
            status: s.status.as_str().to_owned(),
            detail: s.detail.clone(),
            exit_code: s.exit_code,
            output_dropped: s.output_dropped,
            attempt: s.attempt.0,
            epoch: s.epoch.0,
            worker: s.worker.as_ref().map(ToString::to_string),
            idempotent: s.idempotent,
            kill_requested: s.kill_requested,
            kill_reason: s.kill_reason.clone(),
            hint: s.hint.as_ref().map(|h| HintView { tag: h.tag.as_str().to_owned(), message: h.message.clone() }),
            created_at: rfc3339(s.created_at_ms),
            created_at_ms: s.created_at_ms,
            started_at: s.started_at_ms.map(rfc3339),
            started_at_ms: s.started_at_ms,
            finished_at: s.finished_at_ms.map(rfc3339),
            finished_at_ms: s.finished_at_ms,
            reported: s.reported,
            board: s.board.as_str().to_owned(),
            cleaned: s.cleaned,
            parent: s.parent.as_ref().map(ToString::to_string),
            steps: serde_json::to_value(&s.steps).unwrap_or_default(),
            matches: s.matches,
            final_output: s.final_output,
            attempts: serde_json::to_value(&s.attempts).unwrap_or_default(),
            not_before: s.not_before_ms.map(rfc3339),
            not_before_ms: s.not_before_ms,
            retry: s.retry.as_ref().and_then(|r| serde_json::to_value(r).ok()),
            priority: s.priority,
            on: s.placement.iter().flat_map(|p| p.on.iter().map(ToString::to_string)).collect(),
            concurrency_key: s.placement.as_ref().and_then(|p| p.concurrency.as_ref()).map(|c| c.key.clone()),
            concurrency_limit: s.placement.as_ref().and_then(|p| p.concurrency.as_ref()).and_then(|c| c.limit),
            resumable: s.resume.as_ref().map(|r| r.resumable),
            resume_how: s.resume.as_ref().map(|r| r.how.clone()),
            resources: s.resources.as_ref().and_then(|r| serde_json::to_value(r).ok()),
            agent_resume: s.agent_resume.as_ref().and_then(|r| serde_json::to_value(r).ok()),
            timeline: s.timeline().into_iter().map(TimelineEntry::from).collect(),
        }
    }
}

type Reply<T> = Result<axum::Json<T>, Error>;

// ------------------------------------------------------------- submit

/// A task to submit.
#[derive(Debug, Clone, Deserialize, ToSchema, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitBody {
    /// `shell` (default): a command whose output is read later. `agent`: a
    /// program that reads follow-up messages on stdin. `monitor`: a
    /// long-running command whose output lines matching `pattern` are
    /// reported. `workflow`: give `steps` instead of a command.
    #[serde(default)]
    pub kind: Option<String>,
    /// The command line, run as `sh -c COMMAND` in the background on a
    /// worker machine (not for workflows).
    #[serde(default)]
    pub command: String,
    /// One line saying what the task is for (defaults to the command's first line).
    #[serde(default)]
    pub label: Option<String>,
    /// Working directory on the worker machine (absolute).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// True only if running it twice is harmless: tenure may then run it
    /// again when its machine is lost, and retry it. Default false.
    #[serde(default)]
    pub idempotent: bool,
    /// For `monitor`: the regular expression a line must match.
    #[serde(default)]
    pub pattern: Option<String>,
    /// Workflow steps (shell commands run in order, each a task of its own,
    /// failing fast); makes the task a workflow.
    #[serde(default)]
    pub steps: Vec<String>,
    /// Keep only the final output (read once the task ended) instead of streaming it.
    #[serde(default)]
    pub final_output: bool,
    /// End the task past this much run time (it fails as `timed-out`).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// End the task past this long without output (it fails as `idle-timeout`).
    #[serde(default)]
    pub idle_timeout_ms: Option<u64>,
    /// Run an idempotent task again, up to this many times, after an attempt
    /// that failed for a cause in `retry_on` (refused for a task that is
    /// not idempotent).
    #[serde(default)]
    pub retries: Option<u32>,
    /// The delay before the first retry (default 1000); each later one
    /// doubles, with jitter, up to `backoff_max_ms` (default 300000).
    #[serde(default)]
    pub backoff_ms: Option<u64>,
    #[serde(default)]
    pub backoff_max_ms: Option<u64>,
    /// Which failures are retried: `exit`, `lost`, `timeout` (default: all).
    #[serde(default)]
    pub retry_on: Option<Vec<String>>,
    /// Do not start before this time (RFC 3339).
    #[serde(default)]
    pub not_before: Option<String>,
    /// Do not start before this many milliseconds after the submit.
    #[serde(default)]
    pub not_before_in_ms: Option<u64>,
    /// Dispatch priority, -100 to 100 (higher first; default 0).
    #[serde(default)]
    pub priority: i32,
    /// Placement constraints on worker labels, each as `KEY=VALUE`,
    /// `KEY!=VALUE`, `KEY in (A,B)`, `KEY notin (A,B)`, `KEY` or `!KEY`.
    #[serde(default)]
    pub on: Vec<String>,
    /// Running tasks that share this key are capped cluster-wide.
    #[serde(default)]
    pub concurrency_key: Option<String>,
    /// The cap for `concurrency_key` (the coordinator's configured limit
    /// for the key wins; a different one is refused).
    #[serde(default)]
    pub concurrency_limit: Option<u32>,
    /// Hold the task until someone allowed approves it (`tenure approve`):
    /// for work that needs a person's go-ahead. It shows `blocked` until then.
    #[serde(default)]
    pub hold: bool,
    /// Memory limit of all the task's processes together (bytes).
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// CPU limit in thousandths of a CPU (`500`: half a CPU).
    #[serde(default)]
    pub cpu_millis: Option<u32>,
    /// Most processes and threads alive at once.
    #[serde(default)]
    pub pids: Option<u32>,
    /// For an `agent` task: the command that resumes it when its machine
    /// lost it (its process proven gone), instead of leaving it `unknown`;
    /// `{name}` placeholders take values captured by `captures`.
    #[serde(default)]
    pub resume_command: Option<String>,
    /// Regular expressions matched against its output lines; a named group
    /// (`(?<session>\S+)`), or the one group of a pattern that starts with
    /// a word (`session: (\S+)` captures `session`), gives a value.
    #[serde(default)]
    pub captures: Vec<String>,
    /// May resume on any machine (its session is on shared storage); by
    /// default only on the machine that lost it.
    #[serde(default)]
    pub resume_anywhere: bool,
    /// Same key, same task: a submit retried with the key it was first sent
    /// with never makes a second task. Also read from `Idempotency-Key`.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Submitted {
    pub task: String,
    /// The idempotency key was seen before: this is the task it created.
    pub existing: bool,
}

/// The idempotency key as tenure takes it: a UUID as given, any other
/// string mapped to a UUID (v5) within the caller's identity.
pub fn idempotency_key(identity: &str, key: Option<&str>) -> Result<uuid::Uuid, Error> {
    let Some(key) = key else { return Ok(uuid::Uuid::new_v4()) };
    if key.is_empty() || key.len() > 256 {
        return Err(Error::bad_request("bad-idempotency-key", "an idempotency key holds 1 to 256 characters"));
    }
    Ok(key.parse().unwrap_or_else(|_| {
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, format!("tenure-gateway:{identity}:{key}").as_bytes())
    }))
}

/// Submit a task.
#[utoipa::path(post, path = "/v1/tasks", request_body = SubmitBody,
    params(("Idempotency-Key" = Option<String>, Header, description = "retry with the same key: never a second task")),
    responses((status = 201, body = Submitted, description = "created"), (status = 200, body = Submitted, description = "the key's earlier task"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn submit(
    caller: Caller,
    headers: HeaderMap,
    Body(body): Body<SubmitBody>,
) -> Result<impl IntoResponse, Error> {
    let header_key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().map_err(|_| Error::bad_request("bad-idempotency-key", "not ASCII")));
    let header_key = header_key.transpose()?;
    let key = idempotency_key(&caller.identity, body.idempotency_key.as_deref().or(header_key))?;
    let spec = body.spec()?;
    let req = tenure_protocol::messages::SubmitRequest {
        session: caller.client.session().clone(),
        idempotency_key: key,
        spec,
    };
    let done = caller.client.submit_request(req, &tenure_client::Policy::SUBMIT).await?;
    let status = if done.existing { StatusCode::OK } else { StatusCode::CREATED };
    Ok((status, axum::Json(Submitted { task: done.task.to_string(), existing: done.existing })))
}

/// Many tasks to submit in one request.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    /// 1 to 1000 tasks, each as `POST /v1/tasks` takes it (its
    /// `idempotency_key` included).
    pub tasks: Vec<SubmitBody>,
}

/// A batch's tasks, in the order they were given.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BatchSubmitted {
    pub tasks: Vec<Submitted>,
}

/// Submit many tasks at once: all are checked before any is created, so one
/// refusal (its message names the task's place, counting from 1) creates
/// none. `201` once every task is durable; `200` when every key had been
/// seen before (a retried batch).
#[utoipa::path(post, path = "/v1/tasks/batch", request_body = BatchBody,
    responses((status = 201, body = BatchSubmitted, description = "created"), (status = 200, body = BatchSubmitted, description = "every key's earlier task"),
        (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn submit_batch(caller: Caller, Body(body): Body<BatchBody>) -> Result<impl IntoResponse, Error> {
    let max = tenure_protocol::messages::MAX_BATCH_TASKS;
    if body.tasks.is_empty() || body.tasks.len() > max {
        let why = format!("a batch holds 1 to {max} tasks, not {}", body.tasks.len());
        return Err(Error::bad_request("invalid-batch", why));
    }
    let mut tasks = Vec::with_capacity(body.tasks.len());
    for (index, task) in body.tasks.into_iter().enumerate() {
        let place = |e: Error| Error { message: format!("task {} of the batch: {}", index + 1, e.message), ..e };
        let idempotency_key = idempotency_key(&caller.identity, task.idempotency_key.as_deref()).map_err(place)?;
        let spec = task.spec().map_err(place)?;
        tasks.push(tenure_protocol::messages::BatchTask { idempotency_key, spec });
    }
    let done = caller.client.submit_batch(tasks).await?;
    let status = if done.iter().all(|d| d.existing) { StatusCode::OK } else { StatusCode::CREATED };
    let tasks = done.into_iter().map(|d| Submitted { task: d.task.to_string(), existing: d.existing }).collect();
    Ok((status, axum::Json(BatchSubmitted { tasks })))
}

impl SubmitBody {
    /// The spec it asks for (what only the leader can judge — limits,
    /// kinds, quotas — is judged there). The gateway's submit route and the
    /// MCP `start_task` tool both build it here.
    pub fn spec(self) -> Result<TaskSpec, Error> {
        let body = self;
        let workflow = !body.steps.is_empty();
        if workflow && !body.command.is_empty() {
            return Err(Error::bad_request("invalid-spec", "give either `command` or `steps`"));
        }
        if !workflow && body.command.is_empty() {
            return Err(Error::bad_request("invalid-spec", "`command` is required (or `steps` for a workflow)"));
        }
        let kind: Kind = match (&body.kind, workflow) {
            (_, true) => Kind::workflow(),
            (Some(k), false) => {
                k.parse().map_err(|e| Error::bad_request("invalid-spec", format!("kind {k:?}: {e}")))?
            }
            (None, false) => Kind::shell(),
        };
        let label = body.label.clone().unwrap_or_else(|| {
            if workflow {
                format!("workflow of {} steps", body.steps.len())
            } else {
                body.command.lines().next().unwrap_or("").chars().take(120).collect()
            }
        });
        let (retry, not_before) = retry_fields(&body)?;
        let placement = Placement::from_parts(&body.on, body.concurrency_key.clone(), body.concurrency_limit)
            .map_err(|e| Error::bad_request("invalid-spec", format!("placement: {e}")))?;
        Ok(TaskSpec {
            kind,
            label,
            command: body.command,
            cwd: body.cwd.map(Into::into),
            env: body.env,
            idempotent: body.idempotent,
            pattern: body.pattern.map(Into::into),
            steps: body.steps.into_iter().map(|command| StepSpec { kind: Kind::shell(), command }).collect(),
            final_output: body.final_output,
            limits: (body.timeout_ms.is_some() || body.idle_timeout_ms.is_some())
                .then(|| Box::new(TimeLimits { timeout_ms: body.timeout_ms, idle_timeout_ms: body.idle_timeout_ms })),
            retry,
            not_before,
            priority: body.priority,
            placement: placement.map(Box::new),
            hold: body.hold,
            resources: Some(ResourceLimits {
                memory_bytes: body.memory_bytes,
                cpu_millis: body.cpu_millis,
                pids: body.pids,
            })
            .filter(|r| !r.is_empty())
            .map(Box::new),
            resume: resume_field(body.resume_command, body.captures, body.resume_anywhere)?,
        })
    }
}

/// The resume declaration of a submit body (checked by the leader).
fn resume_field(
    command: Option<String>,
    captures: Vec<String>,
    anywhere: bool,
) -> Result<Option<Box<ResumeSpec>>, Error> {
    match command {
        Some(command) => Ok(Some(Box::new(ResumeSpec {
            command: command.into(),
            captures: captures.into_iter().map(Into::into).collect(),
            anywhere,
        }))),
        None if captures.is_empty() && !anywhere => Ok(None),
        None => Err(Error::bad_request("invalid-spec", "`captures` and `resume_anywhere` need a `resume_command`")),
    }
}

/// The retry policy and delayed start of a submit body (their bounds, and
/// that retries are only for idempotent tasks, are checked by the leader).
#[allow(clippy::type_complexity)]
fn retry_fields(body: &SubmitBody) -> Result<(Option<Box<RetryPolicy>>, Option<Box<NotBefore>>), Error> {
    let bad = |m: String| Error::bad_request("invalid-spec", m);
    let on = match &body.retry_on {
        Some(causes) => {
            Some(causes.iter().map(|c| c.parse::<RetryCause>()).collect::<Result<Vec<_>, _>>().map_err(bad)?)
        }
        None => None,
    };
    let retry = match body.retries {
        Some(n) => Some(Box::new(RetryPolicy::with_defaults(n, body.backoff_ms, body.backoff_max_ms, on))),
        None if body.backoff_ms.is_some() || body.backoff_max_ms.is_some() || on.is_some() => {
            return Err(bad("`backoff_ms`, `backoff_max_ms` and `retry_on` need `retries`".into()))
        }
        None => None,
    };
    let not_before = match (&body.not_before, body.not_before_in_ms) {
        (Some(_), Some(_)) => return Err(bad("give either `not_before` or `not_before_in_ms`".into())),
        (Some(at), None) => {
            let t = time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
                .map_err(|e| bad(format!("not_before {at:?}: {e} (RFC 3339, e.g. 2030-01-01T00:00:00Z)")))?;
            let ms = t.unix_timestamp_nanos() / 1_000_000;
            Some(Box::new(NotBefore::At { unix_ms: u64::try_from(ms).unwrap_or(0) }))
        }
        (None, Some(ms)) => Some(Box::new(NotBefore::In { ms })),
        (None, None) => None,
    };
    Ok((retry, not_before))
}

// ------------------------------------------------------------- get, list

/// One task (404 when it does not exist or is not yours).
#[utoipa::path(get, path = "/v1/tasks/{id}", params(("id" = String, Path, description = "task id, `<kind>-<n>`")),
    responses((status = 200, body = TaskView), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get_task(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    Ok(axum::Json(TaskView::from(&caller.client.get(&id).await?)))
}

#[derive(Debug, Deserialize, IntoParams)]
pub struct ListQuery {
    /// Also archived and reported tasks (default: active and unreported).
    #[serde(default)]
    pub all: bool,
    /// Continue after this task number (`next` of the previous page; oldest
    /// first only).
    pub after: Option<u64>,
    /// `oldest` (default: by task number, ascending, with `after`) or
    /// `newest` (highest number first, with `before`).
    #[serde(default)]
    #[param(inline)]
    pub order: Order,
    /// Newest first only: tasks numbered below this (`next` of the previous
    /// page; default: from the newest).
    pub before: Option<u64>,
    /// At most this many tasks in the page (1 to 1000; default: as many as
    /// fit tenure's page, bounded by size).
    pub limit: Option<u32>,
}

/// The most tasks one page may be asked for.
pub const MAX_PAGE_TASKS: u32 = 1000;

/// The order of a task listing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// Task number ascending; pages continue with `after`.
    #[default]
    Oldest,
    /// Task number descending (newest first); pages continue with `before`.
    Newest,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Page {
    pub tasks: Vec<TaskView>,
    /// Pass as `after` (oldest first) or `before` (newest first) for the
    /// next page; absent on the last.
    pub next: Option<u64>,
}

/// The caller's tasks, one page at a time.
#[utoipa::path(get, path = "/v1/tasks", params(ListQuery),
    responses((status = 200, body = Page), (status = 401, body = ErrorBody)))]
pub async fn list(caller: Caller, Query(q): Query<ListQuery>) -> Reply<Page> {
    let session = caller.client.session().clone();
    let req = match q.order {
        Order::Oldest => {
            if q.before.is_some() {
                return Err(Error::bad_request("bad-query", "`before` pages newest first: add `order=newest`"));
            }
            ApiRequest::ListPage { session, all: q.all, after: q.after, before: None }
        }
        Order::Newest => {
            if q.after.is_some() {
                return Err(Error::bad_request(
                    "bad-query",
                    "`after` pages oldest first: use `before` with `order=newest`",
                ));
            }
            ApiRequest::ListPage { session, all: q.all, after: None, before: Some(q.before.unwrap_or(u64::MAX)) }
        }
    };
    match caller.client.request(&req, &tenure_client::Policy::READ).await? {
        ApiResponse::Page { mut tasks, mut next } => {
            let limit = q.limit.unwrap_or(MAX_PAGE_TASKS).clamp(1, MAX_PAGE_TASKS) as usize;
            if tasks.len() > limit {
                // The page continues after the last task kept, in either order.
                tasks.truncate(limit);
                next = tasks.last().map(|t| t.id.number());
            }
            Ok(axum::Json(Page { tasks: tasks.iter().map(TaskView::from).collect(), next }))
        }
        other => Err(unexpected(&other)),
    }
}

fn unexpected(reply: &ApiResponse) -> Error {
    Error::new(StatusCode::BAD_GATEWAY, "cluster", format!("unexpected reply {reply:?}"))
}

// ------------------------------------------------------------- logs

#[derive(Debug, Deserialize, IntoParams)]
pub struct LogsQuery {
    /// Byte offset to read from (default 0).
    #[serde(default)]
    pub offset: u64,
    /// Most bytes to return (default and cap: one chunk, 256 KiB or the cluster's).
    pub max: Option<u32>,
}

/// A piece of a task's output.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LogChunk {
    pub offset: u64,
    /// Offset of the byte after `text`: pass it as the next `offset`.
    pub next_offset: u64,
    /// The bytes, as UTF-8 (invalid sequences replaced; a character cut at
    /// the chunk's end is left for the next read).
    pub text: String,
    /// The attempt ended and every byte is out: no more output will come.
    pub finished: bool,
}

/// Read a task's output from a byte offset (once; see `/logs/stream` to follow).
#[utoipa::path(get, path = "/v1/tasks/{id}/logs", params(("id" = String, Path), LogsQuery),
    responses((status = 200, body = LogChunk), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn logs(caller: Caller, TaskPath(id): TaskPath, Query(q): Query<LogsQuery>) -> Reply<LogChunk> {
    let snapshot = caller.client.get(&id).await?;
    let max = q.max.unwrap_or(MAX_OUTPUT_CHUNK).clamp(1, MAX_OUTPUT_CHUNK);
    Ok(axum::Json(read_chunk(&caller.client, &snapshot, q.offset, max).await?))
}

/// One read of output at `offset`; a finished read marks the task reported.
pub async fn read_chunk(
    client: &tenure_client::Client,
    s: &TaskSnapshot,
    offset: u64,
    max: u32,
) -> Result<LogChunk, Error> {
    if s.final_output {
        let req = ApiRequest::FinalOutput { session: client.session().clone(), task: s.id.clone() };
        return match client.call(&req, tenure_client::API_TIMEOUT).await? {
            ApiResponse::FinalOutput { finished, text } => {
                let bytes = text.as_bytes();
                let from = (offset as usize).min(bytes.len());
                let (text, used) = utf8_prefix(&bytes[from..]);
                Ok(LogChunk {
                    offset,
                    next_offset: (from + used) as u64,
                    finished: finished && from + used == bytes.len(),
                    text,
                })
            }
            other => Err(unexpected(&other)),
        };
    }
    if s.kind == Kind::workflow() {
        return Err(Error::bad_request(
            "workflow-output",
            "a workflow's output is its steps' outputs: read each step's task",
        ));
    }
    // Nothing yet while no machine has its attempt (queued, or leased and
    // not yet taken).
    let Some(chunk) = client.read_latest(s, offset, max).await? else {
        return Ok(LogChunk { offset, next_offset: offset, text: String::new(), finished: s.status.is_terminal() });
    };
    let (text, used) = utf8_prefix(&chunk.data);
    let finished = chunk.finished && chunk.data.is_empty();
    if finished {
        // The whole terminal output reached the owner: that reports the task.
        let _ = client.mark_reported(&s.id).await;
    }
    Ok(LogChunk { offset, next_offset: offset + used as u64, text, finished })
}

/// The bytes as text and how many were used: a UTF-8 character cut at the
/// end is left out (for the next read); invalid bytes elsewhere are replaced.
pub fn utf8_prefix(data: &[u8]) -> (String, usize) {
    match std::str::from_utf8(data) {
        Ok(s) => (s.to_owned(), data.len()),
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => {
            let used = e.valid_up_to();
            (String::from_utf8_lossy(&data[..used]).into_owned(), used)
        }
        Err(_) => (String::from_utf8_lossy(data).into_owned(), data.len()),
    }
}

// ------------------------------------------------------------- kill, send, wait, board

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Killed {
    pub task: String,
    /// `requested`, or `already-finished`.
    pub result: String,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct KillQuery {
    /// Why: kept verbatim on the task (the first kill's; at most 1 KiB).
    pub reason: Option<String>,
}

/// Ask to stop a task (SIGTERM to its process group, SIGKILL after the grace).
#[utoipa::path(post, path = "/v1/tasks/{id}/kill", params(("id" = String, Path), KillQuery),
    responses((status = 200, body = Killed), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn kill(caller: Caller, TaskPath(id): TaskPath, Query(query): Query<KillQuery>) -> Reply<Killed> {
    let req = ApiRequest::Kill { session: caller.client.session().clone(), task: id.clone(), reason: query.reason };
    match caller.client.call(&req, tenure_client::API_TIMEOUT).await? {
        ApiResponse::Kill { result, .. } => {
            Ok(axum::Json(Killed { task: id.to_string(), result: result.as_str().to_owned() }))
        }
        other => Err(unexpected(&other)),
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InputBody {
    /// The message; a newline is added unless it ends with one or `raw`.
    pub text: String,
    #[serde(default)]
    pub raw: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Sent {
    pub task: String,
    pub bytes: u64,
    /// Kept for the task's resumed attempt (its machine lost its process),
    /// not written into a running task's input.
    pub kept: bool,
}

/// Send one message to the stdin of a running agent task (never sent twice:
/// a lost answer is a 504 saying the message is in doubt).
#[utoipa::path(post, path = "/v1/tasks/{id}/input", params(("id" = String, Path)), request_body = InputBody,
    responses((status = 200, body = Sent), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 413, body = ErrorBody), (status = 504, body = ErrorBody)))]
pub async fn send(caller: Caller, TaskPath(id): TaskPath, Body(body): Body<InputBody>) -> Reply<Sent> {
    let data = tenure_client::input_message(body.text.into_bytes(), body.raw)?;
    match caller.client.send_input(&id, data).await {
        Ok(ack) => Ok(axum::Json(Sent { task: id.to_string(), bytes: ack.bytes, kept: ack.kept })),
        Err(SendError::Refused(e)) => Err(e.into()),
        Err(SendError::Client(e)) => Err(e.into()),
        Err(e @ SendError::NoSidecar { .. }) => {
            Err(Error::new(StatusCode::SERVICE_UNAVAILABLE, "sidecar-unavailable", e.to_string()))
        }
        Err(e @ (SendError::InDoubt { .. } | SendError::KeptInDoubt { .. })) => {
            Err(Error::new(StatusCode::GATEWAY_TIMEOUT, "input-in-doubt", e.to_string()))
        }
        Err(e @ SendError::Transport(_)) => Err(Error::new(StatusCode::BAD_GATEWAY, "cluster", e.to_string())),
    }
}

/// Longest wait one request may ask for.
pub const MAX_HTTP_WAIT_MS: u64 = 60_000;

#[derive(Debug, Deserialize, IntoParams)]
pub struct WaitQuery {
    /// Milliseconds to wait at most (default and cap 60000).
    pub timeout_ms: Option<u64>,
    /// `ended` (the default): until the task ends. `started`: until it left
    /// the queue for good (running, paused, stopping, unknown, or ended).
    #[param(inline)]
    pub until: Option<WaitUntil>,
}

/// What a wait waits for.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WaitUntil {
    Ended,
    Started,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Waited {
    /// Whether the task ended: false when the timeout passed first, or for
    /// `until=started` answered at the start (the task is then still live).
    pub finished: bool,
    pub task: TaskView,
}

/// Wait (bounded) for a task to end, or with `until=started` to start.
#[utoipa::path(get, path = "/v1/tasks/{id}/wait", params(("id" = String, Path), WaitQuery),
    responses((status = 200, body = Waited), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn wait(caller: Caller, TaskPath(id): TaskPath, Query(q): Query<WaitQuery>) -> Reply<Waited> {
    let ms = q.timeout_ms.unwrap_or(MAX_HTTP_WAIT_MS).min(MAX_HTTP_WAIT_MS);
    let deadline = Instant::now() + Duration::from_millis(ms);
    let until = match q.until {
        None | Some(WaitUntil::Ended) => WaitFor::End,
        Some(WaitUntil::Started) => WaitFor::Start,
    };
    let w = caller.client.wait_for(&id, until, Some(deadline)).await?;
    Ok(axum::Json(Waited { finished: w.finished, task: TaskView::from(&w.snapshot) }))
}

async fn board_move(caller: &Caller, req: ApiRequest) -> Reply<TaskView> {
    Ok(axum::Json(TaskView::from(&caller.client.snapshot_of(&req).await?)))
}

/// Archive a finished task (409 while it runs).
#[utoipa::path(post, path = "/v1/tasks/{id}/archive", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn archive(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Archive { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

/// Let a task held for approval start (403 when the approval policy does
/// not allow the caller; 409 when it is not awaiting approval). Safe to
/// send again: an approved task not yet started is answered as it is.
#[utoipa::path(post, path = "/v1/tasks/{id}/approve", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn approve(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Approve { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

/// Hold a running task's process group stopped (`paused`; 409 unless it runs).
#[utoipa::path(post, path = "/v1/tasks/{id}/pause", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn pause(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Pause { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

/// Let a paused task go on.
#[utoipa::path(post, path = "/v1/tasks/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn resume(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Resume { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

/// Bring an archived task back.
#[utoipa::path(post, path = "/v1/tasks/{id}/unarchive", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn unarchive(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Unarchive { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

/// Delete a finished task (hidden for good, its record kept for audit).
#[utoipa::path(delete, path = "/v1/tasks/{id}", params(("id" = String, Path)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete_task(caller: Caller, TaskPath(id): TaskPath) -> Reply<TaskView> {
    let req = ApiRequest::Delete { session: caller.client.session().clone(), task: id };
    board_move(&caller, req).await
}

// ------------------------------------------------------------- status, whoami

/// The cluster: leader, epoch, standbys, workers (slots, heartbeats, sidecars), tasks by status.
#[utoipa::path(get, path = "/v1/status",
    responses((status = 200, body = Object, description = "tenure's ClusterStatus"), (status = 503, body = ErrorBody)))]
pub async fn status(caller: Caller) -> Result<axum::Json<serde_json::Value>, Error> {
    let s = caller.client.status(tenure_client::API_TIMEOUT).await?;
    serde_json::to_value(&s)
        .map(axum::Json)
        .map_err(|e| Error::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct WhoAmI {
    /// The tenure identity the token acts as.
    pub identity: String,
    /// The session the gateway claims for it.
    pub session: String,
    /// The gateway's clock, epoch milliseconds (for relative times).
    pub now_ms: u64,
}

/// Who the token acts as.
#[utoipa::path(get, path = "/v1/whoami", responses((status = 200, body = WhoAmI), (status = 401, body = ErrorBody)))]
pub async fn whoami(caller: Caller) -> Reply<WhoAmI> {
    let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    Ok(axum::Json(WhoAmI { identity: caller.identity, session: caller.client.session().to_string(), now_ms }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_keeps_a_cut_character_for_the_next_read() {
        let s = "é".as_bytes();
        assert_eq!(utf8_prefix(b"abc"), ("abc".into(), 3));
        assert_eq!(utf8_prefix(&[b'a', s[0]]), ("a".into(), 1));
        assert_eq!(utf8_prefix(&[0xff, b'a']).1, 2);
    }

    #[test]
    fn idempotency_keys_are_stable_per_identity() {
        let a = idempotency_key("alice", Some("k1")).unwrap();
        assert_eq!(a, idempotency_key("alice", Some("k1")).unwrap());
        assert_ne!(a, idempotency_key("bob", Some("k1")).unwrap());
        let u = uuid::Uuid::new_v4();
        assert_eq!(idempotency_key("alice", Some(&u.to_string())).unwrap(), u);
        assert!(idempotency_key("alice", Some("")).is_err());
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(1_764_588_053_412), "2025-12-01T11:20:53.412Z");
    }
}
