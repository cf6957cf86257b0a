//! `tenure run` and `tenure attach`: one task held in the foreground.
//!
//! It owns: streaming the task's output to stdout from a chosen offset (through
//! the `logs` verb's code, that is [`tenure_client::Client::follow_output`]),
//! forwarding this terminal's stdin to an `agent` task (through `send`'s
//! [`input_target`](tenure_client::Client::input_target) and [`deliver_input`](tenure_client::Client::deliver_input), one
//! message at a time so that lines keep their order), Ctrl-C (detach, or kill
//! with `--kill-on-interrupt`), and the exit code that says how the task ended
//! ([`exit_code`]).
//!
//! It must never: change the task when it detaches (a detach sends nothing),
//! send a message again once a request for it went unanswered, read stdin for
//! a task that takes no input, or judge the task's end from anything but the
//! coordinator's snapshot.

use std::cell::Cell;
use std::io::{BufRead, Read};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use tenure_client::Failure;
use tenure_protocol::messages::{ApiError, TaskSnapshot, WaitFor, MAX_INPUT_BYTES};
use tenure_protocol::{Kind, Status, TaskId};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;

use super::{final_output, kill, logs, workflow_logs, Api};
use crate::text::printable;
use crate::ForegroundArgs;
use tenure_client::SendError;

/// Exit code when the task was killed (`tenure kill`, `--kill-on-interrupt`).
pub(crate) const EXIT_KILLED: u8 = 121;
/// Exit code when the task failed without an exit status of its own or a
/// signal: it could not start, hit a time limit, or its machine shut down.
pub(crate) const EXIT_FAILED: u8 = 122;
/// Exit code when the task's outcome cannot be proved (`unknown`, with a
/// recovery hint printed on stderr).
pub(crate) const EXIT_UNKNOWN: u8 = 123;
/// Exit code of a detach (Ctrl-C): the task goes on running. 128 + SIGINT, as
/// a shell reports an interrupted command.
pub(crate) const EXIT_DETACHED: u8 = 130;

/// How long a task may stay `unknown` with no output coming before the
/// foreground gives up on it (late evidence may still settle it later).
const UNKNOWN_PATIENCE: Duration = Duration::from_secs(5);
/// How often the foreground looks at the task's status while output streams.
const STATUS_EVERY: Duration = Duration::from_secs(2);

/// Where the output starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// At this byte offset (0: the whole output).
    Offset(u64),
    /// At the output's end when the task is attached to: only what comes next.
    Tail,
}

/// SIGINT, listened to from before the task is submitted: a Ctrl-C that
/// comes early is kept, not lost, and detaches once the task's id is known.
pub(super) struct Interrupts(Signal);

impl Interrupts {
    pub(super) fn listen() -> anyhow::Result<Interrupts> {
        Ok(Interrupts(signal(SignalKind::interrupt())?))
    }

    async fn next(&mut self) {
        if self.0.recv().await.is_none() {
            // The signal stream cannot end while the runtime runs; never
            // report an interrupt that did not happen.
            std::future::pending::<()>().await;
        }
    }
}

/// Holds `task` in the foreground until it ends (its exit code) or Ctrl-C
/// detaches ([`EXIT_DETACHED`]).
pub(super) async fn hold(
    api: &Api,
    task: TaskId,
    start: Start,
    how: ForegroundArgs,
    interrupts: &mut Interrupts,
) -> anyhow::Result<ExitCode> {
    // Another owner's task is `not found or not yours`, here as everywhere.
    let snapshot = api.get(&task).await?;
    let reached = Cell::new(0);
    let by_offset = !(snapshot.kind == Kind::workflow() || snapshot.final_output);
    if !by_offset && start != Start::Offset(0) {
        bail!("{task} has no output by offset (a workflow's is its steps', a final-output task's comes at its end)");
    }
    let takes_input = snapshot.kind == Kind::agent() && !snapshot.status.is_terminal();
    let input = takes_input.then(|| tokio::spawn(forward_input(api.clone(), task.clone(), stdin_messages())));
    let _input = AbortOnDrop(input);

    let output = async {
        if snapshot.kind == Kind::workflow() {
            workflow_logs(api, &task, true).await
        } else if snapshot.final_output {
            final_output(api, &task, true).await
        } else {
            stream(api, snapshot, start, &reached).await
        }
    };
    tokio::pin!(output);
    let mut killed = false;
    let mut watch = StatusWatch::default();
    let mut tick = tokio::time::interval(STATUS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let detach = |reached: u64| detach(&task, by_offset.then_some(reached));
    loop {
        tokio::select! {
            done = &mut output => { done?; break; }
            () = interrupts.next() => {
                if how.kill_on_interrupt && !killed {
                    killed = true;
                    interrupt_kill(api, &task).await;
                    continue;
                }
                return Ok(detach(reached.get()));
            }
            _ = tick.tick() => {
                if let Some(lost) = watch.look(api, &task, reached.get()).await {
                    return Ok(ended(api, &lost).await);
                }
            }
        }
    }
    // Every byte is out; the end comes from the leader, which may record it
    // a moment after the attempt's last byte.
    loop {
        let deadline = Instant::now() + Duration::from_secs(5);
        tokio::select! {
            waited = api.wait(&task, Some(deadline)) => {
                let waited = waited?;
                if waited.finished || waited.snapshot.status == Status::Unknown {
                    return Ok(ended(api, &waited.snapshot).await);
                }
            }
            () = interrupts.next() => {
                if how.kill_on_interrupt && !killed {
                    killed = true;
                    interrupt_kill(api, &task).await;
                    continue;
                }
                return Ok(detach(reached.get()));
            }
        }
    }
}

/// The output of a task read by offset, followed until its attempt ended.
/// Read once the task runs (a leased task's machine may not know it yet):
/// a start wait held by the leader says when, at once.
async fn stream(api: &Api, mut snapshot: TaskSnapshot, start: Start, reached: &Cell<u64>) -> anyhow::Result<()> {
    if !WaitFor::Start.reached(snapshot.status) {
        snapshot = api.wait_started(&snapshot.id).await?;
    }
    let offset = match (start, &snapshot.worker) {
        (Start::Offset(offset), _) => offset,
        (Start::Tail, Some(worker)) => api.read_output(worker, &snapshot.id, 0, 0).await?.size,
        (Start::Tail, None) => 0,
    };
    reached.set(offset);
    logs(api, snapshot, true, reached).await
}

/// Watches the task's status while its output streams, for the one end the
/// output cannot show: a task `unknown` whose machine does not answer.
#[derive(Default)]
struct StatusWatch {
    /// Since when the task is `unknown`, and the output offset reached then.
    unknown_since: Option<(Instant, u64)>,
}

impl StatusWatch {
    /// The snapshot once the task has been `unknown` for [`UNKNOWN_PATIENCE`]
    /// with no output byte coming.
    async fn look(&mut self, api: &Api, task: &TaskId, reached: u64) -> Option<TaskSnapshot> {
        // A failed look is no news: the output (or the next look) tells.
        let snapshot = api.get(task).await.ok()?;
        if snapshot.status != Status::Unknown {
            self.unknown_since = None;
            return None;
        }
        match self.unknown_since {
            Some((since, at)) if at == reached && since.elapsed() >= UNKNOWN_PATIENCE => Some(snapshot),
            Some((_, at)) if at == reached => None,
            _ => {
                self.unknown_since = Some((Instant::now(), reached));
                None
            }
        }
    }
}

/// `--kill-on-interrupt`: the first Ctrl-C kills the task (once), and the
/// foreground stays until it ended; a failed kill is said and changes nothing.
async fn interrupt_kill(api: &Api, task: &TaskId) {
    let reason = Some("interrupted in the foreground (--kill-on-interrupt)".to_owned());
    match kill(api, task.clone(), reason).await {
        Ok(result) => eprintln!("\ntenure: kill {task}: {} (Ctrl-C again detaches)", result.as_str()),
        Err(e) => eprintln!("\ntenure: could not kill {task}: {e:#} (Ctrl-C again detaches)"),
    }
}

/// Leaves the task as it is and says how to come back to it.
fn detach(task: &TaskId, reached: Option<u64>) -> ExitCode {
    eprintln!("\ntenure: detached from {task}, which goes on (`tenure kill {task}` stops it)");
    match reached {
        Some(at) if at > 0 => eprintln!(
            "tenure: come back with `tenure attach {task}` (or `tenure attach {task} --from {at}` to go on from here)"
        ),
        _ => eprintln!("tenure: come back with `tenure attach {task}`"),
    }
    ExitCode::from(EXIT_DETACHED)
}

/// The exit code of an ended (or `unknown`) task, with a line on stderr for
/// ends that have no exit status of their own. A workflow fails with its
/// first failed step, whose end gives the code.
async fn ended(api: &Api, s: &TaskSnapshot) -> ExitCode {
    let failed_step = match (s.kind == Kind::workflow(), s.status) {
        (true, Status::Failed) => {
            s.steps.iter().find(|st| st.status == Some(Status::Failed)).and_then(|st| st.task.clone())
        }
        _ => None,
    };
    let code = match failed_step {
        // Not readable (collected, a hiccup): the workflow's own reading.
        Some(step) => api.get(&step).await.map(|step| exit_code(&step)).unwrap_or_else(|_| exit_code(s)),
        None => exit_code(s),
    };
    let detail = s.detail.as_deref().map(|d| format!(" ({})", printable(d))).unwrap_or_default();
    match s.status {
        Status::Killed => {
            let why = s.kill_reason.as_deref().map(|r| format!(": {}", printable(r))).unwrap_or_default();
            eprintln!("tenure: {} was killed{why}", s.id);
        }
        Status::Unknown => match &s.hint {
            Some(h) => eprintln!("tenure: {} is unknown [{}] {}", s.id, h.tag.as_str(), printable(&h.message)),
            None => eprintln!("tenure: {} is unknown", s.id),
        },
        Status::Failed if code == EXIT_FAILED => eprintln!("tenure: {} failed{detail}", s.id),
        _ => {}
    }
    ExitCode::from(code)
}

/// How a task's end reads as an exit code (see `docs/operations.md`):
/// its own exit status when it exited (`completed` 0, `failed` 1–255),
/// 128 + N when a signal N ended it, and tenure's own codes for the rest.
pub(crate) fn exit_code(s: &TaskSnapshot) -> u8 {
    match s.status {
        Status::Completed => 0,
        Status::Failed => {
            // Exit statuses are one byte; a machine-shutdown may record 0.
            let own = s.exit_code.map(|c| (c & 0xff) as u8).filter(|&c| c != 0);
            let signal = s
                .detail
                .as_deref()
                .and_then(|d| d.strip_prefix("signal "))
                .and_then(|n| n.parse::<u8>().ok())
                .filter(|n| (1..=127).contains(n));
            own.or(signal.map(|n| 128 + n)).unwrap_or(EXIT_FAILED)
        }
        Status::Killed => EXIT_KILLED,
        Status::Unknown
        | Status::Queued
        | Status::Leased
        | Status::Running
        | Status::Stopping
        | Status::Paused
        | Status::Blocked
        | Status::Waiting => EXIT_UNKNOWN,
    }
}

/// This process's stdin in messages: each a line, or [`MAX_INPUT_BYTES`] of
/// a longer one, read on a thread of its own (a read cannot be cancelled;
/// the thread ends with the process). The channel closes at end of input.
fn stdin_messages() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(16);
    let reader = move || {
        let mut input = std::io::stdin().lock();
        loop {
            let mut message = Vec::new();
            match (&mut input).take(MAX_INPUT_BYTES as u64).read_until(b'\n', &mut message) {
                Ok(0) => return,
                Ok(_) => {
                    if tx.blocking_send(message).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    eprintln!("tenure: reading stdin failed ({e}); no more input is forwarded");
                    return;
                }
            }
        }
    };
    if let Err(e) = std::thread::Builder::new().name("stdin".into()).spawn(reader) {
        eprintln!("tenure: cannot read stdin ({e}); no input is forwarded");
    }
    rx
}

/// Delivers `messages` to the agent `task` in their order, each once, until
/// stdin ends or the task takes no more input.
async fn forward_input(api: Api, task: TaskId, mut messages: mpsc::Receiver<Vec<u8>>) {
    while let Some(message) = messages.recv().await {
        if !deliver_one(&api, &task, message).await {
            return;
        }
    }
}

/// Delivers one message, waiting while the task cannot take it yet: every
/// such refusal delivered nothing, so trying again cannot duplicate it. A
/// request that went unanswered is never sent again (it is said on stderr).
/// False once the task takes no more input.
async fn deliver_one(api: &Api, task: &TaskId, message: Vec<u8>) -> bool {
    let mut pause = Duration::from_millis(50);
    loop {
        let sent = match api.input_target(task).await {
            Ok(target) => api.deliver_input(&target, task, message.clone()).await.map(|_| ()),
            Err(e) => Err(e),
        };
        let not_yet = match &sent {
            Ok(()) => return true,
            Err(e @ (SendError::InDoubt { .. } | SendError::KeptInDoubt { .. })) => {
                eprintln!("tenure: {e}");
                return true;
            }
            // Not started yet, or ended: the task's status says which.
            Err(SendError::Refused(ApiError::NotRunning { .. })) => match api.get(task).await {
                Ok(s) => !s.status.is_terminal() && s.status != Status::Unknown,
                Err(e) => e.failure() != Failure::Final,
            },
            // The task has not read what it was sent; this waits its turn.
            Err(SendError::Refused(ApiError::InputFull { .. })) => true,
            // Its sidecar (or the leader) is restarting: nothing was sent.
            Err(SendError::NoSidecar { .. }) => true,
            Err(SendError::Client(e)) => e.failure() != Failure::Final,
            Err(SendError::Refused(_) | SendError::Transport(_)) => false,
        };
        if !not_yet {
            if let Err(e) = sent {
                if !matches!(e, SendError::Refused(ApiError::NotRunning { .. })) {
                    eprintln!("tenure: input not forwarded to {task}: {e}");
                }
            }
            return false;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Aborts the input forwarder when the foreground ends, however it ends.
struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = &self.0 {
            handle.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended_as(status: Status, exit: Option<i32>, detail: Option<&str>) -> u8 {
        let mut s: TaskSnapshot = serde_json::from_value(serde_json::json!({
            "id": "shell-1", "kind": "shell", "label": "", "owner": "s", "status": "completed",
            "detail": null, "exit_code": null, "output_dropped": 0, "attempt": 1, "epoch": 1,
            "worker": null, "idempotent": false, "kill_requested": false, "hint": null,
            "created_at_ms": 0, "started_at_ms": null, "finished_at_ms": null, "reported": false
        }))
        .expect("a snapshot");
        s.status = status;
        s.exit_code = exit;
        s.detail = detail.map(str::to_owned);
        exit_code(&s)
    }

    /// Every end has its code, and tenure's own codes are apart from one
    /// another and from a detach.
    #[test]
    fn each_end_reads_as_its_exit_code() {
        assert_eq!(ended_as(Status::Completed, Some(0), None), 0);
        assert_eq!(ended_as(Status::Completed, None, None), 0, "builtin kinds have no exit status");
        assert_eq!(ended_as(Status::Failed, Some(3), Some("exit code: 3")), 3);
        assert_eq!(ended_as(Status::Failed, Some(255), None), 255);
        assert_eq!(ended_as(Status::Failed, Some(256), None), EXIT_FAILED, "a status that reads as 0 is no success");
        assert_eq!(ended_as(Status::Failed, None, Some("signal 9")), 137);
        assert_eq!(ended_as(Status::Failed, None, Some("signal 15")), 143);
        assert_eq!(ended_as(Status::Failed, None, Some("signal 999")), EXIT_FAILED);
        assert_eq!(ended_as(Status::Failed, None, Some("timed-out: ran longer than 1s")), EXIT_FAILED);
        assert_eq!(ended_as(Status::Failed, Some(0), Some("machine-shutdown: …")), EXIT_FAILED);
        assert_eq!(ended_as(Status::Killed, Some(0), None), EXIT_KILLED);
        assert_eq!(ended_as(Status::Killed, None, Some("signal 15")), EXIT_KILLED);
        assert_eq!(ended_as(Status::Unknown, None, None), EXIT_UNKNOWN);
        let own = [EXIT_KILLED, EXIT_FAILED, EXIT_UNKNOWN, EXIT_DETACHED];
        for (i, a) in own.iter().enumerate() {
            assert!(*a != 0 && own[i + 1..].iter().all(|b| b != a), "{own:?}");
        }
    }
}
