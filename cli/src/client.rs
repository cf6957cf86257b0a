//! The client verbs: one request to the leader (or to a worker machine's
//! sidecar for output) each, rendered for humans or as JSON.

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use tenure_protocol::messages::{
    ApiError, ApiReply, ApiRequest, ApiResponse, OutputChunk, OutputReply, OutputRequest, SubmitRequest, TaskSnapshot,
    MAX_OUTPUT_CHUNK, MAX_WAIT_MS,
};
use tenure_protocol::{subjects, Kind, SessionId, Status, StepSpec, TaskId, TaskSpec};
use tracing::Instrument;

use crate::text::printable;
use crate::Command;

mod send;

pub(crate) const API_TIMEOUT: Duration = Duration::from_secs(5);

/// How long `wait` rides through a cluster with no coordinator answering.
const NO_LEADER_PATIENCE: Duration = Duration::from_secs(30);

/// Exit code of `wait` when it timed out (as timeout(1)).
const EXIT_TIMEOUT: u8 = 124;

/// How long `submit` keeps retrying while no coordinator answers (a takeover
/// takes about the lease TTL plus the registry load).
const SUBMIT_RETRY_FOR: Duration = Duration::from_secs(20);

pub(crate) struct Api {
    pub(crate) client: async_nats::Client,
    pub(crate) session: SessionId,
}

/// Nobody serves the API subject: no coordinator runs, or standbys are taking
/// over from a leader that died.
#[derive(Debug)]
struct NoCoordinator;

impl std::fmt::Display for NoCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no coordinator is answering (is the cluster running? try `tenure dev`)")
    }
}

impl std::error::Error for NoCoordinator {}

/// Whether a failed request may be sent again: nobody answered (a takeover), or
/// the reply did not come back (a paused or dying leader, a lost reply).
fn submit_retryable(e: &anyhow::Error) -> bool {
    e.is::<NoCoordinator>()
        || matches!(e.downcast_ref::<ApiError>(), Some(ApiError::Unavailable(_)))
        || matches!(
            e.downcast_ref::<tenure_transport::Error>(),
            Some(tenure_transport::Error::Timeout { .. } | tenure_transport::Error::Nats { .. })
        )
}

impl Api {
    /// Every task `ls` shows (or `ls --all`), page by page.
    pub(crate) async fn list(&self, all: bool) -> anyhow::Result<Vec<TaskSnapshot>> {
        let (mut list, mut after) = (Vec::new(), None);
        loop {
            let req = ApiRequest::ListPage { session: self.session.clone(), all, after };
            match self.call(&req, API_TIMEOUT).await? {
                ApiResponse::Page { tasks, next } => {
                    list.extend(tasks);
                    match next {
                        Some(n) => after = Some(n),
                        None => return Ok(list),
                    }
                }
                other => bail!("unexpected reply {other:?}"),
            }
        }
    }

    pub(crate) async fn call(&self, req: &ApiRequest, timeout: Duration) -> anyhow::Result<ApiResponse> {
        let reply: ApiReply = tenure_transport::request(&self.client, subjects::API.to_owned(), req, timeout)
            .await
            .map_err(|e| match e {
                tenure_transport::Error::NoResponders { .. } => anyhow::Error::new(NoCoordinator),
                e => e.into(),
            })?;
        Ok(reply?)
    }

    async fn snapshot(&self, task: &TaskId) -> anyhow::Result<TaskSnapshot> {
        match self.call(&ApiRequest::Get { session: self.session.clone(), task: task.clone() }, API_TIMEOUT).await? {
            ApiResponse::Snapshot(s) => Ok(s),
            other => bail!("unexpected reply {other:?}"),
        }
    }
}

pub async fn run(nats: &tenure_transport::NatsOptions, session: SessionId, verb: Command) -> anyhow::Result<ExitCode> {
    let client = tenure_transport::connect(nats, "tenure-cli", false).await?;
    let api = Api { client, session };
    match verb {
        Command::Submit { kind, idempotent, label, cwd, env, pattern, steps, final_output, command } => {
            let line = command_line(&command);
            let kind = if steps.is_empty() { kind } else { Kind::workflow() };
            let label = label.or_else(|| (!steps.is_empty()).then(|| format!("workflow of {} steps", steps.len())));
            let steps = steps.into_iter().map(|command| StepSpec { kind: Kind::shell(), command }).collect();
            let mut env_map = std::collections::BTreeMap::new();
            for kv in env {
                let (k, v) = kv.split_once('=').ok_or_else(|| anyhow!("--env expects NAME=VALUE, got {kv:?}"))?;
                env_map.insert(k.to_owned(), v.to_owned());
            }
            let spec = TaskSpec {
                kind,
                label: label.unwrap_or_else(|| line.lines().next().unwrap_or("").chars().take(120).collect()),
                command: line,
                cwd: cwd.map(Into::into),
                env: env_map,
                idempotent,
                pattern: pattern.map(Into::into),
                steps,
                final_output,
            };
            // The root span of the task's trace (exported only when configured).
            let span = tracing::info_span!("submit", kind = %spec.kind, task = tracing::field::Empty);
            let req = ApiRequest::Submit(SubmitRequest {
                session: api.session.clone(),
                idempotency_key: uuid::Uuid::new_v4(),
                spec,
            });
            let task = submit(&api, &req).instrument(span.clone()).await?;
            span.record("task", tracing::field::display(&task));
            println!("{task}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Get { task, json } => {
            let s = api.snapshot(&task).await?;
            print_snapshot(&s, json)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Ls { all, json } => {
            let list = api.list(all).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<16} {:<10} {:>7} {:<12} {:>8} {:<18}  LABEL",
                    "ID", "STATUS", "ATTEMPT", "WORKER", "AGE", "HINT"
                );
                let now = now_ms();
                for s in list {
                    println!(
                        "{:<16} {:<10} {:>7} {:<12} {:>8} {:<18}  {}",
                        s.id.to_string(),
                        s.status.as_str(),
                        s.attempt.0,
                        s.worker.as_ref().map(|w| w.as_str()).unwrap_or("-"),
                        age(now.saturating_sub(s.created_at_ms)),
                        s.hint.as_ref().map(|h| h.tag.as_str()).unwrap_or("-"),
                        printable(&s.label)
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Logs { task, follow, offset } if *task.kind() == Kind::workflow() => {
            if offset != 0 {
                bail!("a workflow's output is its steps' outputs: read one step with `tenure logs STEP --offset N`");
            }
            workflow_logs(&api, &task, follow).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Logs { task, follow, offset } => {
            let s = api.snapshot(&task).await?;
            if s.final_output {
                final_output(&api, &task, follow).await?;
            } else {
                logs(&api, s, follow, offset).await?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Wait { task, timeout, json } => {
            let deadline = timeout.map(|t| Instant::now() + Duration::from_secs(t));
            // A takeover leaves no coordinator answering for up to a lease TTL;
            // longer than this, nobody is coming and the wait gives up.
            let mut unanswered_since: Option<Instant> = None;
            loop {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                let wait_ms = left.map(|l| l.as_millis() as u64).unwrap_or(MAX_WAIT_MS).min(MAX_WAIT_MS);
                let req = ApiRequest::Wait { session: api.session.clone(), task: task.clone(), timeout_ms: wait_ms };
                let reply = match api.call(&req, Duration::from_millis(wait_ms) + API_TIMEOUT).await {
                    // A failover or a NATS hiccup is not the task's end: keep waiting.
                    Err(e) if submit_retryable(&e) => {
                        let since = *unanswered_since.get_or_insert_with(Instant::now);
                        if deadline.is_some_and(|d| Instant::now() >= d) || since.elapsed() > NO_LEADER_PATIENCE {
                            return Err(e);
                        }
                        tracing::warn!(error = %e, "wait interrupted; retrying");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                    other => other?,
                };
                unanswered_since = None;
                let ApiResponse::Waited { finished, snapshot } = reply else {
                    bail!("unexpected reply");
                };
                if finished || left.is_some_and(|l| l.is_zero()) || deadline.is_some_and(|d| Instant::now() >= d) {
                    print_snapshot(&snapshot, json)?;
                    return Ok(if !finished {
                        ExitCode::from(EXIT_TIMEOUT)
                    } else if snapshot.status == Status::Completed && snapshot.exit_code == Some(0) {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    });
                }
            }
        }
        Command::Kill { task } => {
            let ApiResponse::Kill { result, .. } =
                api.call(&ApiRequest::Kill { session: api.session.clone(), task }, API_TIMEOUT).await?
            else {
                bail!("unexpected reply");
            };
            println!("{}", result.as_str());
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { json, once } => crate::status::status(&api, json, once).await,
        Command::Send { task, text, raw } => send::send(&api, task, text, raw).await,
        Command::Archive { task } => board(&api, ApiRequest::Archive { session: api.session.clone(), task }).await,
        Command::Unarchive { task } => board(&api, ApiRequest::Unarchive { session: api.session.clone(), task }).await,
        Command::Delete { task } => board(&api, ApiRequest::Delete { session: api.session.clone(), task }).await,
        Command::Watch { once, json } => crate::watch::watch(api.client.clone(), api.session.clone(), once, json).await,
        Command::Coordinator { .. }
        | Command::Worker { .. }
        | Command::Sidecar { .. }
        | Command::Dev { .. }
        | Command::ShimLauncher { .. }
        | Command::NatsAuth { .. } => bail!("not a client verb"),
    }
}

/// A board move; prints the task's id, status and board.
async fn board(api: &Api, req: ApiRequest) -> anyhow::Result<ExitCode> {
    let ApiResponse::Snapshot(s) = api.call(&req, API_TIMEOUT).await? else {
        bail!("unexpected reply");
    };
    println!("{} {} {}", s.id, s.status, s.board.as_str());
    Ok(ExitCode::SUCCESS)
}

/// One argument is a command line already; several are quoted and joined so
/// that `sh -c` sees exactly those words.
fn command_line(words: &[String]) -> String {
    if let [one] = words {
        return one.clone();
    }
    words.iter().map(|w| shell_quote(w)).collect::<Vec<_>>().join(" ")
}

fn shell_quote(w: &str) -> String {
    if !w.is_empty() && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b)) {
        w.to_owned()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A wall-clock time as people read it: UTC to the millisecond, and how long
/// ago (`2026-12-01 11:20:53.412 UTC (3m ago)`). Epoch milliseconds that are
/// out of range print as they are.
fn when(at_ms: u64, now_ms: u64) -> String {
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(at_ms) * 1_000_000) else {
        return at_ms.to_string();
    };
    let ago = match now_ms.checked_sub(at_ms) {
        Some(d) => format!("{} ago", age(d)),
        None => "in the future by this machine's clock".to_owned(),
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}.{:03} UTC ({ago})",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

fn age(ms: u64) -> String {
    match ms / 1000 {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h", s / 3600),
    }
}

/// Submits, retrying with the same idempotency key through a lost reply and
/// through a coordinator takeover (the key makes a retry return the task the
/// first try created) — bounded, with a short backoff.
async fn submit(api: &Api, req: &ApiRequest) -> anyhow::Result<TaskId> {
    let deadline = Instant::now() + SUBMIT_RETRY_FOR;
    let mut pause = Duration::from_millis(100);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match api.call(req, API_TIMEOUT.min(left).max(Duration::from_millis(500))).await {
            Ok(ApiResponse::Submitted { task, .. }) => return Ok(task),
            Ok(other) => bail!("unexpected reply {other:?}"),
            Err(e) if submit_retryable(&e) && Instant::now() + pause < deadline => {
                tracing::warn!(error = %e, "submit not answered; retrying with the same idempotency key");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e),
        }
    }
}

fn print_snapshot(s: &TaskSnapshot, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(s)?);
        return Ok(());
    }
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    println!("id:         {}", s.id);
    println!("kind:       {}", s.kind);
    println!("label:      {}", printable(&s.label));
    println!("owner:      {}", printable(s.owner.as_str()));
    println!("status:     {}", s.status);
    println!("detail:     {}", opt(s.detail.as_deref().map(|d| printable(d).into_owned())));
    println!("exit code:  {}", opt(s.exit_code.map(|c| c.to_string())));
    if s.output_dropped > 0 {
        println!("dropped:    {} output bytes past the cap", s.output_dropped);
    }
    println!("attempt:    {} (epoch {})", s.attempt, s.epoch);
    println!("worker:     {}", opt(s.worker.as_ref().map(ToString::to_string)));
    println!("idempotent: {}", s.idempotent);
    let now = now_ms();
    println!("created:    {}", when(s.created_at_ms, now));
    println!("started:    {}", opt(s.started_at_ms.map(|t| when(t, now))));
    println!("finished:   {}", opt(s.finished_at_ms.map(|t| when(t, now))));
    println!("reported:   {}", s.reported);
    if let Some(h) = &s.hint {
        println!("hint:       [{}] {}", h.tag.as_str(), printable(&h.message));
    }
    if let Some(p) = &s.parent {
        println!("workflow:   {p}");
    }
    if s.kind == Kind::monitor() {
        println!("matches:    {}", s.matches);
    }
    for step in &s.steps {
        let task = opt(step.task.as_ref().map(ToString::to_string));
        let status =
            step.status.map(|st| st.as_str()).unwrap_or(if s.status.is_terminal() { "skipped" } else { "pending" });
        let why = step.detail.as_deref().map(|d| format!(" ({})", printable(d))).unwrap_or_default();
        println!("step {}:     {status:<9} {task:<12} {}{why}", step.index, printable(&step.command));
        if let Some(h) = &step.hint {
            println!("            hint [{}] {}", h.tag.as_str(), printable(&h.message));
        }
    }
    Ok(())
}

/// A final-output-only task's output: nothing while it runs (with `follow`,
/// waits for its end), its final output once it ended — the same every time.
async fn final_output(api: &Api, task: &TaskId, follow: bool) -> anyhow::Result<()> {
    loop {
        let req = ApiRequest::FinalOutput { session: api.session.clone(), task: task.clone() };
        match api.call(&req, API_TIMEOUT).await? {
            ApiResponse::FinalOutput { finished: true, text } => {
                print!("{text}");
                return Ok(());
            }
            ApiResponse::FinalOutput { finished: false, .. } if follow => {
                let wait =
                    ApiRequest::Wait { session: api.session.clone(), task: task.clone(), timeout_ms: MAX_WAIT_MS };
                api.call(&wait, Duration::from_millis(MAX_WAIT_MS) + API_TIMEOUT).await?;
            }
            ApiResponse::FinalOutput { finished: false, .. } => return Ok(()),
            other => bail!("unexpected reply {other:?}"),
        }
    }
}

/// A workflow's output: each step's output in order, under a header, marked
/// reported once the workflow ended and every step's output is out.
async fn workflow_logs(api: &Api, task: &TaskId, follow: bool) -> anyhow::Result<()> {
    let mut shown = 0;
    loop {
        let s = api.snapshot(task).await?;
        while let Some((step, child)) = s.steps.get(shown).and_then(|st| Some((st, st.task.clone()?))) {
            println!("== step {} of {}: {} ({child}) ==", step.index, s.steps.len(), printable(&step.command));
            logs(api, api.snapshot(&child).await?, follow, 0).await?;
            shown += 1;
        }
        if s.status.is_terminal() {
            let mark = ApiRequest::MarkReported { session: api.session.clone(), task: task.clone() };
            api.call(&mark, API_TIMEOUT).await?;
            return Ok(());
        }
        if !follow {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads output by offset from the sidecar of the task's worker machine; with
/// `follow`, keeps reading until the attempt has ended and every byte is out.
async fn logs(api: &Api, mut snapshot: TaskSnapshot, follow: bool, mut offset: u64) -> anyhow::Result<()> {
    const IDLE_MAX: Duration = Duration::from_millis(250);
    let task = &snapshot.id.clone(); // `snapshot` is refreshed below
    let mut stdout = std::io::stdout().lock();
    let mut idle = Duration::from_millis(20);
    loop {
        let Some(worker) = snapshot.worker.clone() else {
            if !follow || snapshot.status.is_terminal() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            snapshot = api.snapshot(task).await?;
            continue;
        };
        let req = OutputRequest { session: api.session.clone(), task: task.clone(), offset, max: MAX_OUTPUT_CHUNK };
        let reply: Result<OutputReply, _> =
            tenure_transport::request(&api.client, subjects::output(&worker), &req, API_TIMEOUT).await;
        let chunk: OutputChunk = match reply {
            Ok(r) => r?,
            Err(e) if follow => {
                tracing::warn!(error = %e, "output not readable yet; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
            Err(e) => return Err(e).context(format!("reading output of {task} from {worker}")),
        };
        if !chunk.data.is_empty() {
            stdout.write_all(&chunk.data)?;
            stdout.flush()?;
            offset = chunk.next_offset;
            idle = Duration::from_millis(20);
            continue;
        }
        // Everything written so far is out. Done unless following a live attempt.
        if chunk.finished {
            // The whole terminal output reached the owner: that reports the task.
            let mark = ApiRequest::MarkReported { session: api.session.clone(), task: task.clone() };
            for _ in 0..if follow { 20 } else { 1 } {
                match api.call(&mark, API_TIMEOUT).await {
                    Ok(_) => break,
                    // The registry may not have the end yet; a follower waits for it.
                    Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            }
            return Ok(());
        }
        if !follow || snapshot.status.is_terminal() {
            return Ok(());
        }
        tokio::time::sleep(idle).await;
        idle = (idle * 2).min(IDLE_MAX);
        if idle == IDLE_MAX {
            // A quiet task: check whether it ended or moved to another worker.
            snapshot = api.snapshot(task).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_read_as_dates_and_ages() {
        let at = 1_764_588_053_412; // 2025-12-01 11:20:53.412 UTC
        assert_eq!(when(at, at + 180_000), "2025-12-01 11:20:53.412 UTC (3m ago)");
        assert_eq!(when(at, at + 5_000), "2025-12-01 11:20:53.412 UTC (5s ago)");
        assert!(when(at, at - 1).ends_with("(in the future by this machine's clock)"));
        assert_eq!(when(u64::MAX, 0), u64::MAX.to_string());
    }

    use super::*;

    #[test]
    fn command_lines_keep_words_intact() {
        assert_eq!(command_line(&["echo hi; ls".into()]), "echo hi; ls");
        assert_eq!(
            command_line(&["sh".into(), "-c".into(), "for i in 1 2; do echo $i; done".into()]),
            "sh -c 'for i in 1 2; do echo $i; done'"
        );
        assert_eq!(command_line(&["echo".into(), "it's".into(), "".into()]), r"echo 'it'\''s' ''");
    }
}
