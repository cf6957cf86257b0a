//! The client: one session that submits tasks (idempotent or not, each with a
//! fresh idempotency key, retried with the same key until answered, as the CLI
//! does) and kills some of them; with approvals on, it submits some held and
//! approves each one later (retried until answered, as for kills). It also
//! checks what a client can see: a key always names the same task, and no
//! two keys share one.

use std::collections::BTreeMap;

use rand::Rng;
use tenure_protocol::messages::{ApiError, ApiRequest, ApiResponse, SubmitRequest};
use tenure_protocol::resume::ResumeSpec;
use tenure_protocol::retry::RetryPolicy;
use tenure_protocol::{Kind, SessionId, TaskId, TaskSpec};
use uuid::Uuid;

use super::bus::{Asked, Dest, Envelope, Msg, Node, Reply, ReqId};
use super::{Ctx, API_TIMEOUT};

/// Where a kill (or an approval) the client wants stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kill {
    No,
    Wanted,
    Sent(ReqId),
    Done,
}

struct Submitted {
    key: Uuid,
    spec: TaskSpec,
    id: Option<TaskId>,
    req: Option<ReqId>,
    kill: Kill,
    /// For a task submitted held: its approval.
    approve: Kill,
}

pub struct Client {
    session: SessionId,
    tasks: Vec<Submitted>,
    by_id: BTreeMap<TaskId, usize>,
}

impl Client {
    pub fn new() -> Client {
        Client { session: "sim".parse().expect("a valid session id"), tasks: Vec::new(), by_id: BTreeMap::new() }
    }

    pub fn submitted(&self) -> usize {
        self.tasks.len()
    }

    /// A new task: `sleep <ticks>; exit <code>`, idempotent or not; a third
    /// of the idempotent ones flaky (`; ok-from <attempt>`) with a retry
    /// policy of a few retries and a backoff of a few ticks.
    pub fn submit_new(&mut self, ctx: &mut Ctx, held: bool, resumable: bool) {
        let ticks = ctx.rng.gen_range(1..=40);
        let code = if ctx.rng.gen_bool(0.8) { 0 } else { ctx.rng.gen_range(1..=3) };
        let idempotent = ctx.rng.gen_bool(0.4);
        let n = self.tasks.len();
        let mut spec =
            TaskSpec { idempotent, ..TaskSpec::shell(format!("t{n}"), format!("sleep {ticks}; exit {code}")) };
        if idempotent && ctx.rng.gen_bool(0.33) {
            let retries = ctx.rng.gen_range(1..=3);
            let code = ctx.rng.gen_range(1..=3);
            let ok_from = ctx.rng.gen_range(1..=retries + 2);
            spec.command = format!("sleep {ticks}; exit {code}; ok-from {ok_from}");
            let backoff_ms = ctx.rng.gen_range(1..=5) * super::TICK_MS;
            spec.retry =
                Some(Box::new(RetryPolicy::with_defaults(retries, Some(backoff_ms), Some(4 * backoff_ms), None)));
        }
        // An agent that resumes (`sleep` again, then exits 0) when its
        // process is proven gone.
        if resumable && !idempotent && ctx.rng.gen_bool(0.5) {
            spec.kind = Kind::agent();
            spec.resume = Some(Box::new(ResumeSpec {
                command: format!("sleep {}; exit 0", ctx.rng.gen_range(1..=20)).into(),
                captures: Vec::new(),
                anywhere: ctx.rng.gen_bool(0.5),
            }));
        }
        spec.hold = held;
        let resume = spec.resume.as_ref().map(|r| r.command.to_string());
        ctx.note(|| {
            format!("client wants task {n}: {:?} idempotent={idempotent} held={held} resume={resume:?}", spec.command)
        });
        let key = Uuid::from_u128(ctx.rng.gen());
        self.tasks.push(Submitted { key, spec, id: None, req: None, kill: Kill::No, approve: Kill::No });
    }

    /// Approves a random held task not approved yet (or every one, `all`,
    /// so that a healed run can settle).
    pub fn approve(&mut self, ctx: &mut Ctx, all: bool) {
        let held: Vec<usize> =
            (0..self.tasks.len()).filter(|i| self.tasks[*i].spec.hold && self.tasks[*i].approve == Kill::No).collect();
        let chosen = match all {
            true => held,
            false => held.get(ctx.rng.gen_range(0..held.len().max(1))).copied().into_iter().collect(),
        };
        for i in chosen {
            self.tasks[i].approve = Kill::Wanted;
            ctx.note(|| format!("client wants task {i} approved"));
        }
    }

    /// Asks to kill a random task the client knows.
    pub fn kill_one(&mut self, ctx: &mut Ctx) {
        let known: Vec<usize> = (0..self.tasks.len()).filter(|i| self.tasks[*i].kill == Kill::No).collect();
        if let Some(i) = (!known.is_empty()).then(|| known[ctx.rng.gen_range(0..known.len())]) {
            self.tasks[i].kill = Kill::Wanted;
            ctx.note(|| format!("client wants task {i} killed"));
        }
    }

    /// Pauses or resumes a random task whose id is known, once: the answer
    /// is not waited for (a refusal — not running, a deposed leader — is
    /// fine); the judge's rules must hold whatever the wishes were.
    pub fn pause_one(&mut self, ctx: &mut Ctx) {
        let known: Vec<TaskId> = self.tasks.iter().filter_map(|t| t.id.clone()).collect();
        if known.is_empty() {
            return;
        }
        let task = known[ctx.rng.gen_range(0..known.len())].clone();
        let session = self.session.clone();
        let request = match ctx.rng.gen_bool(0.6) {
            true => ApiRequest::Pause { session, task: task.clone() },
            false => ApiRequest::Resume { session, task: task.clone() },
        };
        let verb = request.verb();
        let (req, fate) =
            ctx.bus.request(&mut ctx.rng, ctx.now, Node::Client, 0, Dest::Leader, API_TIMEOUT, Asked::Api, |req| {
                Msg::Api { req, request }
            });
        ctx.note(|| format!("client #{req} {verb} {task}: {fate}"));
    }

    /// Sends what is unanswered: submits, and kills of tasks whose id is known.
    pub fn tick(&mut self, ctx: &mut Ctx) {
        for i in 0..self.tasks.len() {
            let t = &self.tasks[i];
            let request = match (&t.id, t.req, t.kill) {
                (None, None, _) => ApiRequest::Submit(SubmitRequest {
                    session: self.session.clone(),
                    idempotency_key: t.key,
                    spec: t.spec.clone(),
                }),
                (Some(id), _, Kill::Wanted) => {
                    ApiRequest::Kill { session: self.session.clone(), task: id.clone(), reason: None }
                }
                (Some(id), _, _) if t.approve == Kill::Wanted => {
                    ApiRequest::Approve { session: self.session.clone(), task: id.clone() }
                }
                _ => continue,
            };
            match &request {
                ApiRequest::Kill { task, .. } => ctx.check.kill_asked(task),
                ApiRequest::Approve { task, .. } => ctx.check.approval_asked(task),
                _ => {}
            }
            let verb = request.verb();
            let sent = request.clone();
            let (req, fate) =
                ctx.bus.request(&mut ctx.rng, ctx.now, Node::Client, 0, Dest::Leader, API_TIMEOUT, Asked::Api, |req| {
                    Msg::Api { req, request }
                });
            ctx.note(|| format!("client #{req} {verb} task {i}: {fate}"));
            let t = &mut self.tasks[i];
            match sent {
                ApiRequest::Kill { .. } => t.kill = Kill::Sent(req),
                ApiRequest::Approve { .. } => t.approve = Kill::Sent(req),
                _ => t.req = Some(req),
            }
        }
    }

    pub fn deliver(&mut self, ctx: &mut Ctx, env: Envelope) {
        let (req, reply) = match env.msg {
            Msg::Reply { req, reply: Reply::Api(reply) } => (req, Some(reply)),
            Msg::Timeout { req } => (req, None),
            other => panic!("client: unexpected {other:?}"),
        };
        if ctx.bus.claim(req, Node::Client, 0).is_none() {
            return;
        }
        if let Some(i) = self.tasks.iter().position(|t| t.req == Some(req)) {
            self.tasks[i].req = None;
            match reply {
                None => {}
                Some(Ok(ApiResponse::Submitted { task, existing })) => {
                    ctx.note(|| format!("client: task {i} is {task} (existing={existing})"));
                    if self.tasks[i].id.as_ref().is_some_and(|known| *known != task) {
                        ctx.check.fail(format!("rule 8: submit key of task {i} now names {task}"));
                    }
                    if let Some(other) = self.by_id.get(&task).filter(|o| **o != i) {
                        ctx.check.fail(format!("rule 8: {task} was returned for two submit keys ({other} and {i})"));
                    }
                    self.by_id.insert(task.clone(), i);
                    self.tasks[i].id = Some(task);
                }
                // A new leader does not know a kind before its workers
                // heartbeat: the real client retries this answer too (the
                // submit keeps its key).
                Some(Err(ApiError::Unavailable(why))) => {
                    ctx.note(|| format!("client: submit of task {i} unavailable: {why}"));
                }
                // No live worker runs the kind now (every machine that does is
                // down): a person would submit again later; so does the client.
                Some(Err(ApiError::UnknownKind { kind, .. })) => {
                    ctx.note(|| format!("client: submit of task {i}: kind {kind} unknown for now"));
                }
                Some(other) => ctx.check.fail(format!("client: submit of task {i} answered {other:?}")),
            }
        } else if let Some(i) = self.tasks.iter().position(|t| t.kill == Kill::Sent(req)) {
            match reply {
                None => self.tasks[i].kill = Kill::Wanted,
                Some(Ok(ApiResponse::Kill { result, snapshot })) => {
                    ctx.note(|| format!("client: kill of task {i}: {result:?}, now {}", snapshot.status));
                    self.tasks[i].kill = Kill::Done;
                }
                // A deposed leader still acting answers from its stale view: a
                // task created after it was deposed is unknown to it. Not a
                // safety rule, but counted; the client asks again.
                Some(Err(ApiError::NotFound(_))) if self.tasks[i].id.is_some() => {
                    ctx.note(|| format!("client: kill of task {i} answered NotFound (a stale answer)"));
                    ctx.check.stale_answer();
                    self.tasks[i].kill = Kill::Wanted;
                }
                Some(other) => ctx.check.fail(format!("client: kill of task {i} answered {other:?}")),
            }
        } else if let Some(i) = self.tasks.iter().position(|t| t.approve == Kill::Sent(req)) {
            match reply {
                None => self.tasks[i].approve = Kill::Wanted,
                Some(Ok(ApiResponse::Snapshot(s))) => {
                    ctx.note(|| format!("client: approval of task {i}: now {}", s.status));
                    self.tasks[i].approve = Kill::Done;
                }
                // Approved already (an earlier approval whose answer was
                // lost), or killed meanwhile.
                Some(Err(ApiError::NotAwaitingApproval { status, .. })) => {
                    ctx.note(|| format!("client: approval of task {i}: not awaiting approval ({status})"));
                    self.tasks[i].approve = Kill::Done;
                }
                Some(Err(ApiError::NotFound(_))) => {
                    ctx.check.stale_answer();
                    self.tasks[i].approve = Kill::Wanted;
                }
                Some(other) => ctx.check.fail(format!("client: approval of task {i} answered {other:?}")),
            }
        }
    }

    /// Why the client is not done yet, if it is not.
    pub fn busy(&self) -> Option<String> {
        let i = self.tasks.iter().position(|t| {
            t.id.is_none()
                || matches!(t.kill, Kill::Wanted | Kill::Sent(_))
                || matches!(t.approve, Kill::Wanted | Kill::Sent(_))
        })?;
        Some(format!("client: task {i} not answered yet"))
    }

    /// Every task the client was told about exists in the registry.
    pub fn known_ids(&self) -> impl Iterator<Item = &TaskId> {
        self.by_id.keys()
    }
}
