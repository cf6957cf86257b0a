//! The task contract as Model Context Protocol tools: served over stdio to
//! the agent that launched `tenure mcp` (JSON-RPC on stdin/stdout; logs go
//! to stderr only), and over streamable HTTP at the gateway's `/mcp`, where
//! each request acts as the caller its token or certificate names.
//!
//! Each tool is one or two `tenure-client` requests made as the caller's
//! session, exactly as the CLI verbs and the gateway make them: start, list,
//! get, read output by offset (bounded, with the next offset), send input to
//! an agent task, stop, wait (bounded) and archive. Every refusal is a tool
//! error (`isError`) with tenure's message, never a protocol error.
//!
//! Each tool declares its input and output schemas (the types of
//! [`results`]); its structured result is serialized from that type.
//!
//! The seed's `reported` rule reaches the model once per ending ([`notices`]):
//! as a `notifications/message` log message where the client asked for them
//! (per request in its `_meta` on MCP 2026-07-28, over stdio or HTTP; with
//! `logging/setLevel` on a handshake-era stdio session, pushed as they
//! happen), and otherwise in the `unreported`
//! list of every tool result (listing reports the task); the matched lines
//! of the caller's monitors likewise, as messages or in `matched`. Reading a
//! task's output to its end or waiting on it reports it too. Output handed
//! to a model is bounded, and says what was left out.
//!
//! This module decides nothing about tasks; it must never write to stdout
//! except through the MCP transport, nor act over HTTP as anyone but the
//! authenticated caller of that very request.

pub mod notices;
pub mod results;

use std::sync::Arc;
use std::time::{Duration, Instant};

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::{Json, Parameters};
use rmcp::model::{Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde::Deserialize;
use tenure_client::Client;
use tenure_protocol::messages::{ApiRequest, ApiResponse, SubmitRequest, WaitFor};
use tenure_protocol::TaskId;

use crate::api::{SubmitBody, TaskView};
use notices::Reporter;
use results::{Listed, News, One, Read, Sent, Started, Stopped, Waited};

/// Bytes of output one `read_output` returns unless asked for fewer.
const DEFAULT_READ: u32 = 16 * 1024;
/// Most bytes of output one `read_output` returns.
const MAX_READ: u32 = 64 * 1024;
/// Most tasks one `list_tasks` returns (the newest are kept).
const MAX_LISTED: usize = 200;
/// Longest one `wait` may block.
const MAX_WAIT: Duration = Duration::from_secs(60);

/// Serves MCP on stdin/stdout, as `api`'s session, until the client closes it.
pub async fn serve_stdio(api: Client) -> Result<(), std::io::Error> {
    let tools = Tools::new(Some(api), Arc::new(Reporter::default()));
    let service = tools.serve(rmcp::transport::stdio()).await.map_err(std::io::Error::other)?;
    service.waiting().await.map_err(std::io::Error::other)?;
    Ok(())
}

/// The tools: acting as one session (stdio), or as each HTTP request's
/// authenticated caller (the client the gateway put in the request's
/// extensions).
#[derive(Clone)]
pub struct Tools {
    api: Option<Client>,
    reporter: Arc<Reporter>,
    tool_router: ToolRouter<Tools>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskArgs {
    /// The task id, `<kind>-<n>` as `start_task` returned it (e.g. `shell-12`).
    pub task: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArgs {
    /// Only tasks in this status: queued, blocked, leased, running, waiting, paused, stopping,
    /// completed, killed, failed, unknown.
    #[serde(default)]
    pub status: Option<String>,
    /// Also archived and already reported tasks (default: only active, unreported ones).
    #[serde(default)]
    pub all: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadArgs {
    /// The task id, `<kind>-<n>`.
    pub task: String,
    /// Byte offset to read from: 0 first, then the `next_offset` of the previous read.
    #[serde(default)]
    pub offset: u64,
    /// Most bytes to return (default 16384, at most 65536).
    #[serde(default)]
    pub max_bytes: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendArgs {
    /// The id of a running `agent` task.
    pub task: String,
    /// The message; a newline is added unless it ends with one.
    pub text: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopArgs {
    /// The task id, `<kind>-<n>`.
    pub task: String,
    /// Why (kept on the task).
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WaitArgs {
    /// The task id, `<kind>-<n>`.
    pub task: String,
    /// Milliseconds to wait at most (default and cap 60000); the answer says whether it ended.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Wait only until the task runs (or left the queue otherwise), not until it ends.
    #[serde(default)]
    pub started: bool,
}

fn task_id(raw: &str) -> Result<TaskId, String> {
    raw.parse::<TaskId>().map_err(|e| format!("{raw:?} is not a task id (`<kind>-<n>`, e.g. `shell-12`): {e}"))
}

/// A tool's arguments as the model sent them, parsed in the tool: an
/// argument of the wrong type or name is then a tool error the model reads
/// and corrects, never a protocol error. Its schema is `T`'s.
pub struct Args<T>(Result<T, String>);

impl<T> Args<T> {
    fn get(self) -> Result<T, String> {
        self.0
    }
}

impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for Args<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        Ok(Args(serde_json::from_value(value).map_err(|e| format!("bad arguments: {e} (see the tool's input schema)"))))
    }
}

impl<T: JsonSchema> JsonSchema for Args<T> {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        T::schema_name()
    }

    fn inline_schema() -> bool {
        T::inline_schema()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        T::json_schema(generator)
    }
}

fn refusal(e: impl std::fmt::Display) -> String {
    format!("{e:#}")
}

#[tool_router]
impl Tools {
    /// Tools acting as `api`'s session, or (`None`) as each HTTP request's
    /// caller, telling ends and matches once through `reporter`.
    pub fn new(api: Option<Client>, reporter: Arc<Reporter>) -> Tools {
        Tools { api, reporter, tool_router: Self::tool_router() }
    }

    /// Who a call acts as: the stdio session, or the HTTP request's caller.
    fn caller(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, String> {
        if let Some(api) = &self.api {
            return Ok(api.clone());
        }
        ctx.extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Client>())
            .cloned()
            .ok_or_else(|| "unauthenticated: no caller for this request".to_owned())
    }

    /// The news every result carries (see [`notices`]), or, for a request
    /// that opted in to log messages, sent as messages before the result.
    #[allow(deprecated)] // Per-request logging is 2026-07-28's (SEP-2577 deprecates it).
    async fn news(&self, api: &Client, ctx: &RequestContext<RoleServer>) -> News {
        let news = self.reporter.news(api).await;
        self.reporter.tell(&ctx.peer, ctx.meta.log_level(), news).await
    }

    #[tool(description = "Start a task in the background on the tenure cluster and return its id \
        (`<kind>-<n>`, e.g. `shell-12`) at once. Use it for anything long: builds, test runs, servers, \
        coding agents. Read its output later with `read_output`, wait for it with `wait_task`.")]
    async fn start_task(
        &self,
        Parameters(a): Parameters<Args<SubmitBody>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Started>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let key = crate::api::idempotency_key(api.session().identity(), a.idempotency_key.as_deref())
            .map_err(|e| e.message)?;
        let spec = a.spec().map_err(|e| e.message)?;
        let req = SubmitRequest { session: api.session().clone(), idempotency_key: key, spec };
        let done = api.submit_request(req, &tenure_client::Policy::SUBMIT).await.map_err(refusal)?;
        Ok(Json(Started { task: done.task.to_string(), existing: done.existing, news: self.news(&api, &ctx).await }))
    }

    #[tool(description = "List your tasks (newest last, at most 200: `omitted` says how many older \
        ones were left out), optionally only those in one status. By default only active tasks that were \
        not reported yet; `all` adds archived and reported ones. Each task's `timeline` is left empty \
        here; `get_task` shows it.")]
    async fn list_tasks(
        &self,
        Parameters(a): Parameters<Args<ListArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Listed>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let mut tasks = Vec::new();
        let mut after = None;
        loop {
            let req = ApiRequest::ListPage { session: api.session().clone(), all: a.all, after, before: None };
            match api.request(&req, &tenure_client::Policy::READ).await.map_err(refusal)? {
                ApiResponse::Page { tasks: page, next } => {
                    tasks.extend(
                        page.into_iter().filter(|t| a.status.as_deref().is_none_or(|s| t.status.as_str() == s)),
                    );
                    match next {
                        Some(n) => after = Some(n),
                        None => break,
                    }
                }
                other => return Err(format!("unexpected answer from the cluster: {other:?}")),
            }
        }
        let omitted = tasks.len().saturating_sub(MAX_LISTED);
        // A list leaves each task's history out (`get_task` has it): up to
        // 200 tasks stay a few lines each for the model.
        let tasks = tasks[omitted..].iter().map(|t| TaskView { timeline: Vec::new(), ..TaskView::from(t) }).collect();
        Ok(Json(Listed { tasks, omitted: omitted as u64, news: self.news(&api, &ctx).await }))
    }

    #[tool(description = "One task's snapshot: status (queued, blocked, leased, running, waiting — an \
        agent reading its input —, paused, stopping, completed, killed, failed, unknown), exit code, \
        times, a hint for `blocked` and `unknown` saying why and what to do, and for an ended task \
        whether it can be resumed and how to run it again.")]
    async fn get_task(
        &self,
        Parameters(a): Parameters<Args<TaskArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<One>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let s = api.get(&task_id(&a.task)?).await.map_err(refusal)?;
        Ok(Json(One { task: TaskView::from(&s), news: self.news(&api, &ctx).await }))
    }

    #[tool(description = "Read a task's output from a byte offset, at most `max_bytes` (default 16 KiB, \
        at most 64 KiB). Returns `text`, `next_offset` (pass it as `offset` next time), `more` (the bound \
        cut it short: more output is already there) and `finished` (the task ended and every byte was \
        read). Reading a finished task to its end reports it.")]
    async fn read_output(
        &self,
        Parameters(a): Parameters<Args<ReadArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Read>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let s = api.get(&task_id(&a.task)?).await.map_err(refusal)?;
        let max = a.max_bytes.unwrap_or(DEFAULT_READ).clamp(1, MAX_READ);
        let chunk =
            crate::api::read_chunk(&api, &s, a.offset, max).await.map_err(|e| format!("{}: {}", e.code, e.message))?;
        let bytes = chunk.next_offset - chunk.offset;
        let more = !chunk.finished && bytes >= u64::from(max);
        let note = if more {
            format!("returned {bytes} bytes; more output follows: read again from offset {}", chunk.next_offset)
        } else if chunk.finished {
            "the task ended and this is the end of its output".to_owned()
        } else {
            "no more output yet; the task is still going".to_owned()
        };
        Ok(Json(Read {
            task: s.id.to_string(),
            offset: chunk.offset,
            next_offset: chunk.next_offset,
            text: chunk.text,
            bytes,
            more,
            finished: chunk.finished,
            note,
            news: self.news(&api, &ctx).await,
        }))
    }

    #[tool(description = "Send one message (a line on stdin) to a running `agent` task. \
        Never sent twice: if the answer is lost the error says the message may or may not have arrived.")]
    async fn send_input(
        &self,
        Parameters(a): Parameters<Args<SendArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Sent>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let task = task_id(&a.task)?;
        let data = tenure_client::input_message(a.text.into_bytes(), false).map_err(refusal)?;
        let ack = api.send_input(&task, data).await.map_err(refusal)?;
        Ok(Json(Sent { task: task.to_string(), bytes: ack.bytes, kept: ack.kept, news: self.news(&api, &ctx).await }))
    }

    #[tool(description = "Stop a task: SIGTERM to its processes, SIGKILL after a grace period. \
        `result` is `requested` or `already-finished`.")]
    async fn stop_task(
        &self,
        Parameters(a): Parameters<Args<StopArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Stopped>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let task = task_id(&a.task)?;
        let req = ApiRequest::Kill { session: api.session().clone(), task: task.clone(), reason: a.reason };
        match api.call(&req, tenure_client::API_TIMEOUT).await.map_err(refusal)? {
            ApiResponse::Kill { result, .. } => Ok(Json(Stopped {
                task: task.to_string(),
                result: result.as_str().to_owned(),
                news: self.news(&api, &ctx).await,
            })),
            other => Err(format!("unexpected answer from the cluster: {other:?}")),
        }
    }

    #[tool(description = "Wait for a task to end, at most `timeout_ms` (default and cap 60000); \
        with `started`, only until it runs (e.g. before sending an agent input). Returns `finished` \
        (false: it still runs) and the task's snapshot. Waiting on an ended task reports it.")]
    async fn wait_task(
        &self,
        Parameters(a): Parameters<Args<WaitArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<Waited>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let task = task_id(&a.task)?;
        let bound = a.timeout_ms.map_or(MAX_WAIT, Duration::from_millis).min(MAX_WAIT);
        let until = if a.started { WaitFor::Start } else { WaitFor::End };
        let w = api.wait_for(&task, until, Some(Instant::now() + bound)).await.map_err(refusal)?;
        Ok(Json(Waited { finished: w.finished, task: TaskView::from(&w.snapshot), news: self.news(&api, &ctx).await }))
    }

    #[tool(description = "Archive a finished task: hidden from `list_tasks` unless `all`; its files on \
        the worker are released. Refused while the task runs.")]
    async fn archive_task(
        &self,
        Parameters(a): Parameters<Args<TaskArgs>>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<Json<One>, String> {
        let api = self.caller(&ctx)?;
        let a = a.get()?;
        let req = ApiRequest::Archive { session: api.session().clone(), task: task_id(&a.task)? };
        let s = api.snapshot_of(&req).await.map_err(refusal)?;
        Ok(Json(One { task: TaskView::from(&s), news: self.news(&api, &ctx).await }))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    #[allow(deprecated)] // Logging is what handshake-era clients have (SEP-2577 deprecates it).
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_logging().build())
            .with_server_info(Implementation::new("tenure", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "tenure runs long work in the background on a cluster: start a task, keep working, \
                 read its output by offset, wait on it, stop it. Task ids look like `shell-12`. \
                 Every result lists `unreported`: tasks of yours that ended since you last heard \
                 (each is listed once), and `matched`: new matched lines of your `monitor` tasks. \
                 A client that asks for log messages at `notice` or below (per request, or with \
                 logging/setLevel over stdio) gets each of these once as a log message instead.",
            )
    }

    /// `logging/setLevel`: on a stdio session, ends and matches are pushed
    /// as log messages from now on while the level lets `notice` through.
    /// Over HTTP (stateless: no session outlives a request) it changes
    /// nothing, and every result keeps carrying the news.
    #[allow(deprecated)] // Logging is what handshake-era clients have.
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        if let Some(api) = &self.api {
            self.reporter.set_level(request.level, api, ctx.peer.clone());
        }
        Ok(())
    }
}
