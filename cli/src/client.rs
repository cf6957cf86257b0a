//! The client verbs: one request to the leader (or to a worker machine's
//! sidecar for output) each, rendered for humans or as JSON.

use std::cell::Cell;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail};
use tenure_protocol::messages::{ApiRequest, ApiResponse, KillResult, TaskSnapshot, WaitFor, MAX_WAIT_MS};
use tenure_protocol::resources::ResourceLimits;
use tenure_protocol::{Kind, SessionId, Status, StepSpec, TaskId, TaskSpec};
use tracing::Instrument;

use crate::text::printable;
use crate::{Command, SubmitArgs};

mod batch;
mod foreground;
pub(crate) mod send;

pub(crate) use tenure_client::API_TIMEOUT;

/// Exit code of `wait` when it timed out (as timeout(1)).
const EXIT_TIMEOUT: u8 = 124;

/// The verbs' client: `tenure_client` acting for the caller's session.
pub(crate) type Api = tenure_client::Client;

pub async fn run(nats: &tenure_transport::NatsOptions, session: SessionId, verb: Command) -> anyhow::Result<ExitCode> {
    let api = Api::connect(nats, "tenure-cli", false, session).await?;
    match verb {
        Command::Submit { batch: Some(file), .. } => batch::submit(&api, &file).await,
        Command::Submit { task: args, batch: None } => {
            let task = submit(&api, spec_of(args)?).await?;
            println!("{task}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Run { submit: args, foreground: how } => {
            // Listening before the submit: a Ctrl-C from now on detaches
            // (once the id is known) instead of ending this process unheard.
            let mut interrupts = foreground::Interrupts::listen()?;
            let task = submit(&api, spec_of(args)?).await?;
            eprintln!("tenure: {task} submitted (Ctrl-C detaches; `tenure attach {task}` comes back)");
            foreground::hold(&api, task, foreground::Start::Offset(0), how, &mut interrupts).await
        }
        Command::Attach { task, from, tail, foreground: how } => {
            let mut interrupts = foreground::Interrupts::listen()?;
            let start = if tail { foreground::Start::Tail } else { foreground::Start::Offset(from.unwrap_or(0)) };
            foreground::hold(&api, task, start, how, &mut interrupts).await
        }
        Command::Get { task, json } => {
            let s = api.get(&task).await?;
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
            let s = api.get(&task).await?;
            if s.final_output {
                final_output(&api, &task, follow).await?;
            } else {
                logs(&api, s, follow, &Cell::new(offset)).await?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Wait { task, timeout, started, json } => {
            let deadline = timeout.map(|t| Instant::now() + Duration::from_secs(t));
            let until = if started { WaitFor::Start } else { WaitFor::End };
            // A takeover or a NATS hiccup is ridden out by the client's rule.
            let tenure_client::Waited { snapshot, .. } = api.wait_for(&task, until, deadline).await?;
            print_snapshot(&snapshot, json)?;
            let succeeded = match until {
                WaitFor::Start => snapshot.started_at_ms.is_some(),
                WaitFor::End => snapshot.status == Status::Completed && snapshot.exit_code == Some(0),
            };
            Ok(match (until.reached(snapshot.status), succeeded) {
                (false, _) => ExitCode::from(EXIT_TIMEOUT),
                (true, true) => ExitCode::SUCCESS,
                (true, false) => ExitCode::FAILURE,
            })
        }
        Command::Kill { task, reason } => {
            println!("{}", kill(&api, task, reason).await?.as_str());
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { json, once } => crate::status::status(&api, json, once).await,
        Command::Pause { task } => {
            let s = api.snapshot_of(&ApiRequest::Pause { session: api.session().clone(), task }).await?;
            println!("{} {}", s.id, s.status);
            Ok(ExitCode::SUCCESS)
        }
        Command::Resume { task } => {
            let s = api.snapshot_of(&ApiRequest::Resume { session: api.session().clone(), task }).await?;
            println!("{} {}", s.id, s.status);
            Ok(ExitCode::SUCCESS)
        }
        Command::Approve { task } => {
            let s = api.snapshot_of(&ApiRequest::Approve { session: api.session().clone(), task }).await?;
            println!("{} {}", s.id, s.status);
            Ok(ExitCode::SUCCESS)
        }
        Command::Send { task, text, raw } => send::send(&api, task, text, raw).await,
        Command::Archive { task } => board(&api, ApiRequest::Archive { session: api.session().clone(), task }).await,
        Command::Unarchive { task } => {
            board(&api, ApiRequest::Unarchive { session: api.session().clone(), task }).await
        }
        Command::Delete { task } => board(&api, ApiRequest::Delete { session: api.session().clone(), task }).await,
        Command::Watch { once, json } => crate::watch::watch(&api, once, json).await,
        Command::Mcp => tenure_gateway::mcp::serve_stdio(api).await.map(|()| ExitCode::SUCCESS).map_err(Into::into),
        Command::Coordinator { .. }
        | Command::Worker { .. }
        | Command::Sidecar { .. }
        | Command::Gateway(_)
        | Command::Dev { .. }
        | Command::ShimLauncher { .. }
        | Command::NatsAuth { .. } => bail!("not a client verb"),
    }
}

/// Asks the leader to stop `task` (once: a kill is never sent again).
async fn kill(api: &Api, task: TaskId, reason: Option<String>) -> anyhow::Result<KillResult> {
    match api.call(&ApiRequest::Kill { session: api.session().clone(), task, reason }, API_TIMEOUT).await? {
        ApiResponse::Kill { result, .. } => Ok(result),
        other => bail!("unexpected reply to kill: {other:?}"),
    }
}

/// Submits `spec` (retried through a takeover under one idempotency key, by
/// `tenure_client`) as the root span of the task's trace; the task's id.
async fn submit(api: &Api, spec: TaskSpec) -> anyhow::Result<TaskId> {
    // The root span of the task's trace (exported only when configured).
    let span = tracing::info_span!("submit", kind = %spec.kind, task = tracing::field::Empty);
    let task = api.submit(spec).instrument(span.clone()).await?.task;
    span.record("task", tracing::field::display(&task));
    Ok(task)
}

/// The spec `submit` and `run` send.
fn spec_of(args: SubmitArgs) -> anyhow::Result<TaskSpec> {
    let SubmitArgs {
        kind,
        idempotent,
        label,
        cwd,
        env,
        pattern,
        steps,
        final_output,
        timeout,
        idle_timeout,
        retries,
        backoff,
        retry_on,
        not_before,
        priority,
        on,
        concurrency_key,
        concurrency_limit,
        hold,
        memory,
        cpus,
        pids,
        resume_command,
        captures,
        resume_anywhere,
        command,
    } = args;
    let resume = resume_command.map(|command| {
        Box::new(tenure_protocol::resume::ResumeSpec {
            command: command.into(),
            captures: captures.into_iter().map(Into::into).collect(),
            anywhere: resume_anywhere,
        })
    });
    let resources = ResourceLimits { memory_bytes: memory, cpu_millis: cpus, pids };
    if command.is_empty() && steps.is_empty() {
        bail!("give the command to run after `--` (e.g. `tenure submit -- make test`), or workflow steps with --step");
    }
    let line = command_line(&command);
    let kind = if steps.is_empty() { kind } else { Kind::workflow() };
    let label = label.or_else(|| (!steps.is_empty()).then(|| format!("workflow of {} steps", steps.len())));
    let steps = steps.into_iter().map(|command| StepSpec { kind: Kind::shell(), command }).collect();
    let mut env_map = std::collections::BTreeMap::new();
    for kv in env {
        let (k, v) = kv.split_once('=').ok_or_else(|| anyhow!("--env expects NAME=VALUE, got {kv:?}"))?;
        env_map.insert(k.to_owned(), v.to_owned());
    }
    Ok(TaskSpec {
        resume,
        kind,
        label: label.unwrap_or_else(|| line.lines().next().unwrap_or("").chars().take(120).collect()),
        command: line,
        cwd: cwd.map(Into::into),
        env: env_map,
        idempotent,
        pattern: pattern.map(Into::into),
        steps,
        final_output,
        limits: time_limits(timeout, idle_timeout)?,
        retry: retry_policy(retries, backoff, retry_on)?,
        not_before: not_before.map(Box::new),
        priority,
        placement: tenure_protocol::placement::Placement::from_parts(&on, concurrency_key, concurrency_limit)?
            .map(Box::new),
        hold,
        resources: (!resources.is_empty()).then(|| Box::new(resources)),
    })
}

/// A board move; prints the task's id, status and board.
async fn board(api: &Api, req: ApiRequest) -> anyhow::Result<ExitCode> {
    let s = api.snapshot_of(&req).await?;
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

/// A wall-clock time as people read it: RFC 3339 in UTC to the millisecond,
/// and how long ago (`2026-12-01T11:20:53.412Z (3m ago)`). Epoch milliseconds
/// that are out of range print as they are.
fn when(at_ms: u64, now_ms: u64) -> String {
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(at_ms) * 1_000_000) else {
        return at_ms.to_string();
    };
    let ago = match now_ms.checked_sub(at_ms) {
        Some(d) => format!("{} ago", age(d)),
        None => "in the future by this machine's clock".to_owned(),
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z ({ago})",
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
    if let Some(reason) = &s.kill_reason {
        println!("kill reason: {}", printable(reason));
    }
    println!("exit code:  {}", opt(s.exit_code.map(|c| c.to_string())));
    if s.output_dropped > 0 {
        println!("dropped:    {} output bytes past the cap", s.output_dropped);
    }
    println!("attempt:    {} (epoch {})", s.attempt, s.epoch);
    println!("worker:     {}", opt(s.worker.as_ref().map(ToString::to_string)));
    println!("idempotent: {}", s.idempotent);
    if s.priority != 0 {
        println!("priority:   {}", s.priority);
    }
    if let Some(p) = &s.placement {
        if !p.on.is_empty() {
            println!("runs on:    {}", p.constraints_text());
        }
        if let Some(c) = &p.concurrency {
            let limit = c.limit.map(|l| format!(" (limit {l})")).unwrap_or_default();
            println!("concurrency key: {}{limit}", c.key);
        }
    }
    if let Some(r) = &s.resources {
        println!("resources:  {}", crate::units::resources(r));
    }
    let now = now_ms();
    println!("created:    {}", when(s.created_at_ms, now));
    println!("started:    {}", opt(s.started_at_ms.map(|t| when(t, now))));
    println!("finished:   {}", opt(s.finished_at_ms.map(|t| when(t, now))));
    println!("reported:   {}", s.reported);
    print_retries(s, now);
    if let Some(r) = &s.agent_resume {
        let anywhere = if r.spec.anywhere { " (anywhere)" } else { "" };
        println!("resumes with: {}{anywhere}", printable(&r.spec.command));
        let captured = if r.captured.is_empty() { "nothing yet".to_owned() } else { values_text(&r.captured) };
        println!("captured:   {captured}; resumed {} times", r.resumes);
        if r.pending_input > 0 {
            println!("kept input: {} messages for the resumed attempt", r.pending_input);
        }
        if r.dropped_input > 0 {
            println!("dropped input: {} kept messages (the attempt they were kept for came back)", r.dropped_input);
        }
        if let Some(m) = &r.machine {
            println!("resumes on: {m} (the machine that lost it)");
        }
    }
    if let Some(h) = &s.hint {
        println!("hint:       [{}] {}", h.tag.as_str(), printable(&h.message));
    }
    if let Some(r) = &s.resume {
        println!("resumable:  {} — {}", if r.resumable { "yes" } else { "no" }, printable(&r.how));
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
        let req = ApiRequest::FinalOutput { session: api.session().clone(), task: task.clone() };
        match api.call(&req, API_TIMEOUT).await? {
            ApiResponse::FinalOutput { finished: true, text } => {
                print!("{text}");
                return Ok(());
            }
            ApiResponse::FinalOutput { finished: false, .. } if follow => {
                let wait = ApiRequest::Wait {
                    session: api.session().clone(),
                    task: task.clone(),
                    timeout_ms: MAX_WAIT_MS,
                    until: WaitFor::End,
                };
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
        let s = api.get(task).await?;
        while let Some((step, child)) = s.steps.get(shown).and_then(|st| Some((st, st.task.clone()?))) {
            println!("== step {} of {}: {} ({child}) ==", step.index, s.steps.len(), printable(&step.command));
            logs(api, api.get(&child).await?, follow, &Cell::new(0)).await?;
            shown += 1;
        }
        if s.status.is_terminal() {
            let mark = ApiRequest::MarkReported { session: api.session().clone(), task: task.clone() };
            api.call(&mark, API_TIMEOUT).await?;
            return Ok(());
        }
        if !follow {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads output by offset from the sidecar of the task's worker machine, from
/// the offset in `reached`, which follows every byte written to stdout (so
/// that a detach can say where it stopped); with `follow`, keeps reading
/// until the attempt has ended and every byte is out.
async fn logs(api: &Api, snapshot: TaskSnapshot, follow: bool, reached: &Cell<u64>) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    api.follow_output(snapshot, follow, reached.get(), |bytes| {
        stdout.write_all(bytes)?;
        stdout.flush()?;
        reached.set(reached.get() + bytes.len() as u64);
        Ok(())
    })
    .await?;
    Ok(())
}

/// The spec's time limits from `--timeout` and `--idle-timeout` (whole
/// milliseconds; the range is checked where the spec is validated).
fn time_limits(
    timeout: Option<std::time::Duration>,
    idle: Option<std::time::Duration>,
) -> anyhow::Result<Option<Box<tenure_protocol::spec::TimeLimits>>> {
    let ms = |d: Option<std::time::Duration>, flag: &str| {
        d.map(|d| u64::try_from(d.as_millis()).map_err(|_| anyhow!("{flag} is too long"))).transpose()
    };
    let limits = tenure_protocol::spec::TimeLimits {
        timeout_ms: ms(timeout, "--timeout")?,
        idle_timeout_ms: ms(idle, "--idle-timeout")?,
    };
    Ok((limits != Default::default()).then(|| Box::new(limits)))
}

/// The spec's retry policy from `--retries`, `--backoff` and `--retry-on`
/// (bounds and idempotence are checked where the spec is validated).
fn retry_policy(
    retries: Option<u32>,
    backoff: Option<(Duration, Option<Duration>)>,
    on: Vec<tenure_protocol::retry::RetryCause>,
) -> anyhow::Result<Option<Box<tenure_protocol::retry::RetryPolicy>>> {
    let Some(retries) = retries else { return Ok(None) };
    let ms = |d: Duration| u64::try_from(d.as_millis()).map_err(|_| anyhow!("--backoff is too long"));
    let (base, max) = match backoff {
        Some((base, max)) => (Some(ms(base)?), max.map(ms).transpose()?),
        None => (None, None),
    };
    let on = (!on.is_empty()).then_some(on);
    Ok(Some(Box::new(tenure_protocol::retry::RetryPolicy::with_defaults(retries, base, max, on))))
}

/// A task's retry policy, attempt history and delayed start, as `get` shows them.
fn print_retries(s: &TaskSnapshot, now: u64) {
    if let Some(at) = s.not_before_ms {
        let why = if s.attempts.is_empty() { "its --not-before" } else { "the backoff before its next retry" };
        let until = match at.checked_sub(now) {
            Some(d) => format!("in {}", age(d)),
            None => "now: waiting for a worker".to_owned(),
        };
        println!("waiting:    not before {} ({until}; {why})", rfc3339(at));
    }
    if let Some(p) = &s.retry {
        let on: Vec<&str> = p.on.iter().map(|c| c.as_str()).collect();
        let used = s.attempts.iter().filter(|a| a.retried).count();
        println!(
            "retries:    {used} of {} used (backoff {}ms up to {}ms, on {})",
            p.retries,
            p.backoff_ms,
            p.backoff_max_ms,
            on.join(",")
        );
    }
    for a in &s.attempts {
        let ending = match (a.ending, a.cause) {
            (Some(e), _) => format!("{e:?}").to_lowercase(),
            (None, _) => "lost".to_owned(),
        };
        let code = a.exit_code.map(|c| format!(" exit {c}")).unwrap_or_default();
        let detail = a.detail.as_deref().map(|d| format!(" ({})", printable(d))).unwrap_or_default();
        let then = match &a.resumed {
            Some(values) => format!(", resumed with {}", values_text(values)),
            None if a.retried => ", retried".to_owned(),
            None => String::new(),
        };
        let started = a.started_at_ms.map(rfc3339).unwrap_or_else(|| "-".to_owned());
        println!(
            "attempt {}:  {ending}{code} on {}{then}; started {started}, ended {}{detail}",
            a.attempt,
            a.worker.as_ref().map(|w| w.as_str()).unwrap_or("-"),
            rfc3339(a.ended_at_ms),
        );
    }
}

/// Captured values as `name=value` pairs, printable.
fn values_text(values: &std::collections::BTreeMap<String, String>) -> String {
    values.iter().map(|(k, v)| format!("{k}={}", printable(v))).collect::<Vec<_>>().join(" ")
}

/// Epoch milliseconds as RFC 3339 (UTC, to the millisecond), without an age.
fn rfc3339(at_ms: u64) -> String {
    match when(at_ms, at_ms).split_once(' ') {
        Some((t, _)) => t.to_owned(),
        None => at_ms.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_read_as_dates_and_ages() {
        let at = 1_764_588_053_412; // 2025-12-01 11:20:53.412 UTC
        assert_eq!(when(at, at + 180_000), "2025-12-01T11:20:53.412Z (3m ago)");
        assert_eq!(when(at, at + 5_000), "2025-12-01T11:20:53.412Z (5s ago)");
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
