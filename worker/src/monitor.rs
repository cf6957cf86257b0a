//! The per-task monitor: a small process, one per attempt, that owns the task's
//! process group so that the task outlives the worker (the containerd-shim /
//! Nomad executor idea).
//!
//! It detaches into its own session, becomes the child subreaper of everything
//! the task forks, spawns `sh -c COMMAND` as the leader of a new process group,
//! pumps the group's stdout and stderr (one pipe, so their order is kept) into
//! the task's output file up to a cap, and when the leader exits — or SIGTERM
//! asks it to stop the task — ends the whole group and records the exit evidence
//! in the attempt's `status` file. Then it exits.
//!
//! For an `agent` task it first creates the attempt's input FIFO, gives its read
//! end to the task as stdin and holds it open read-write until the group is
//! gone, then removes it (before `status`, so nobody can write to an ended
//! task). The sidecar writes `tenure send` input into it; the worker is not
//! involved, so input reaches the task while the worker is down.
//!
//! For a `monitor` task it also scans every output line (those past the cap
//! too) against the task's pattern and appends the matching ones to the
//! attempt's `matches` file, which the worker forwards to the leader.
//!
//! It never talks to NATS or the sidecar: the worker reads what it leaves behind,
//! whether the worker is the monitor's parent or a restarted worker that
//! re-attaches to it.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tenure_protocol::messages::{MatchedLine, MAX_MATCH_LINE_BYTES};
use tenure_protocol::{Attempt, Ending, Kind, Outcome, TaskId};
use tenure_sidecar::Layout;

use crate::process;
use tenure_sidecar::attempt_files::{AttemptFiles, InputFifo, MonitorStatus, ProcessId};

/// Default output cap per task.
pub const DEFAULT_OUTPUT_CAP: u64 = 64 * 1024 * 1024;

/// What the monitor is told: which attempt, and the worker's settings for it
/// (the rest — what to run — it reads from the attempt's `grant` file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MonitorArgs {
    pub data_dir: PathBuf,
    pub task: TaskId,
    pub attempt: Attempt,
    pub output_cap: u64,
    pub kill_grace: Duration,
}

/// Runs the monitor to completion. Returns the process exit code: 0 when the
/// exit evidence was recorded, 1 when it could not be (the worker then treats
/// the attempt as having no evidence).
pub fn run(args: &MonitorArgs) -> i32 {
    let _span = tracing::info_span!("monitor", task = %args.task, attempt = %args.attempt).entered();
    // A new session: the worker's death, its terminal, or a signal to its
    // process group never reaches the monitor.
    let _ = nix::unistd::setsid();
    process::become_subreaper();
    let layout = Layout::new(&args.data_dir);
    let files = AttemptFiles::new(layout.attempt_dir(&args.task, args.attempt));
    let recorded = ProcessId::current().and_then(|me| files.write_monitor(me));
    if let Err(error) = recorded {
        tracing::error!(dir = %files.dir().display(), %error, "monitor cannot record itself; not starting the task");
        return 1;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(error) => {
            tracing::error!(%error, "monitor cannot start a runtime; not starting the task");
            return 1;
        }
    };
    let status = runtime.block_on(supervise(args, &layout, &files));
    // Also when the task could not be spawned after its FIFO was created.
    if let Err(error) = files.remove_input() {
        tracing::warn!(%error, "monitor cannot remove the input pipe");
    }
    match files.write_status(&status) {
        Ok(()) => 0,
        Err(error) => {
            tracing::error!(%error, "monitor cannot record the exit status");
            1
        }
    }
}

async fn supervise(args: &MonitorArgs, layout: &Layout, files: &AttemptFiles) -> MonitorStatus {
    let failed =
        |detail: String| MonitorStatus { outcome: Outcome::new(Ending::Failed, None, Some(detail)), output_written: 0 };
    let spec = match files.read_grant() {
        Ok(grant) => grant.spec,
        Err(e) => return failed(format!("cannot read the task's grant: {e}")),
    };
    // An agent's input: created before the task exists, held until it is gone.
    let (_keeper, stdin) = if spec.kind == Kind::agent() {
        match files.create_input() {
            Ok(InputFifo { keeper, stdin }) => (Some(keeper), Some(OwnedFd::from(stdin))),
            Err(e) => return failed(format!("cannot create the input pipe: {e}")),
        }
    } else {
        (None, None)
    };
    let output_path = layout.output_path(&args.task);
    let output = match tenure_sidecar::open_output_for_append(&output_path) {
        Ok(f) => f,
        Err(e) => return failed(format!("cannot open output file {}: {e}", output_path.display())),
    };
    let (reader, writer) = match std::io::pipe() {
        Ok(p) => p,
        Err(e) => return failed(format!("cannot create the output pipe: {e}")),
    };
    // Every process of the task can say which task and attempt it belongs to.
    let identity = [("TENURE_TASK_ID", args.task.to_string()), ("TENURE_ATTEMPT", args.attempt.0.to_string())];
    let running = match process::spawn(&spec, &identity, stdin, writer, layout.root()) {
        Ok(r) => r,
        Err(e) => return failed(format!("spawn failed: {e}")),
    };
    if let Err(error) = files.write_pgid(running.pid) {
        tracing::warn!(%error, "monitor cannot record the process group");
    }
    let cap = args.output_cap;
    let matcher = match spec.pattern.as_deref().map(|p| LineMatcher::new(p, files)) {
        None => None,
        Some(Ok(m)) => Some(m),
        // Validated at submit; a failure here is the matches file.
        Some(Err(e)) => {
            tracing::warn!(error = %e, "monitor cannot record matched lines");
            None
        }
    };
    // The pump's result comes back on a channel, so the monitor learns the
    // moment it ends (a bounded wait below, without polling).
    let (pumped_tx, pumped) = std::sync::mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let _ = pumped_tx.send(pump(reader, output, cap, matcher));
    });

    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => Some(s),
        Err(error) => {
            tracing::warn!(%error, "monitor cannot watch SIGTERM; kills will escalate through the worker");
            None
        }
    };
    let kill = async move {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending().await,
        }
    };
    let mut outcome = running.finish(kill, args.kill_grace).await;
    // Nobody reads the input any more: a sender now finds no pipe and is told
    // the task ended (the FIFO goes before its keeper is let go).
    if let Err(error) = files.remove_input() {
        tracing::warn!(%error, "monitor cannot remove the input pipe");
    }
    // Every writer of the pipe is gone with the group; the pump sees its end.
    // A process that left the group (setsid) may still hold the pipe: do not
    // wait for it forever.
    let (written, dropped) = pumped.recv_timeout(Duration::from_secs(5)).unwrap_or((0, 0));
    outcome.output_dropped = dropped;
    MonitorStatus { outcome, output_written: written }
}

/// Copies the pipe into the output file until the pipe ends. Past `cap` bytes
/// the pipe keeps draining (the task never blocks on output) but bytes are
/// dropped, counted, and one notice is appended.
fn pump(
    mut reader: std::io::PipeReader,
    mut output: std::fs::File,
    cap: u64,
    mut matcher: Option<LineMatcher>,
) -> (u64, u64) {
    let mut buf = vec![0u8; 64 * 1024];
    let (mut written, mut dropped) = (0u64, 0u64);
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if let Some(m) = matcher.as_mut() {
            m.feed(&buf[..n]);
        }
        let room = cap.saturating_sub(written).min(n as u64) as usize;
        if room > 0 {
            if output.write_all(&buf[..room]).is_err() {
                dropped += room as u64;
            } else {
                written += room as u64;
            }
        }
        let over = (n - room) as u64;
        if over > 0 {
            if dropped == 0 {
                let notice = format!("\n[tenure: output cap of {cap} bytes reached; further output is dropped]\n");
                let _ = output.write_all(notice.as_bytes());
            }
            dropped += over;
        }
    }
    if let Some(m) = matcher.as_mut() {
        m.end();
    }
    let _ = output.sync_data();
    (written, dropped)
}

/// Bytes of one line kept for matching; the rest of a longer line is ignored.
const MAX_LINE_SCAN: usize = 64 * 1024;
/// Matched lines recorded per attempt; later ones are counted, not recorded.
const MAX_RECORDED_MATCHES: u64 = 100_000;

/// Finds the output lines of a `monitor` task that match its pattern and
/// appends each to the attempt's `matches` file (one JSON line, with the
/// line's offset in the output stream, so the leader can deduplicate).
struct LineMatcher {
    regex: regex::Regex,
    out: std::fs::File,
    line: Vec<u8>,
    line_start: u64,
    seen: u64,
    recorded: u64,
}

impl LineMatcher {
    fn new(pattern: &str, files: &AttemptFiles) -> Result<LineMatcher, String> {
        let regex = regex::Regex::new(pattern).map_err(|e| e.to_string())?;
        let out = files.open_matches_for_append().map_err(|e| format!("cannot open the matches file: {e}"))?;
        Ok(LineMatcher { regex, out, line: Vec::new(), line_start: 0, seen: 0, recorded: 0 })
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (part, newline) = match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => (&bytes[..i], true),
                None => (bytes, false),
            };
            let room = MAX_LINE_SCAN.saturating_sub(self.line.len()).min(part.len());
            self.line.extend_from_slice(&part[..room]);
            self.seen += part.len() as u64;
            bytes = &bytes[part.len()..];
            if newline {
                self.seen += 1;
                bytes = &bytes[1..];
                self.end();
            }
        }
    }

    /// Ends the current line (at a newline, or at the end of the output).
    fn end(&mut self) {
        let text = String::from_utf8_lossy(&self.line);
        let text = text.strip_suffix('\r').unwrap_or(&text);
        if !self.line.is_empty() && self.regex.is_match(text) && self.recorded < MAX_RECORDED_MATCHES {
            let mut cut = text.len().min(MAX_MATCH_LINE_BYTES);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            let matched = MatchedLine { offset: self.line_start, text: text[..cut].to_owned() };
            if let Ok(mut json) = serde_json::to_vec(&matched) {
                json.push(b'\n');
                // One write per line: a reader never sees half of one.
                if self.out.write_all(&json).is_ok() {
                    self.recorded += 1;
                }
            }
        }
        self.line.clear();
        self.line_start = self.seen;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matched(pattern: &str, chunks: &[&[u8]]) -> Vec<MatchedLine> {
        let dir = tempfile::tempdir().unwrap();
        let files = AttemptFiles::new(dir.path().to_path_buf());
        let mut m = LineMatcher::new(pattern, &files).unwrap();
        for c in chunks {
            m.feed(c);
        }
        m.end();
        files.read_matches(0, 1000).unwrap().0
    }

    #[test]
    fn lines_match_across_reads_with_their_stream_offsets() {
        let got = matched("ERR", &[b"ok\nERR one", b"\nfine\r\nan ERR\r\n", b"last ERR"]);
        let got: Vec<(u64, &str)> = got.iter().map(|l| (l.offset, l.text.as_str())).collect();
        assert_eq!(got, [(3, "ERR one"), (17, "an ERR"), (25, "last ERR")]);
    }

    #[test]
    fn long_lines_are_cut_and_binary_is_tolerated() {
        let long = format!("{}ERR", "x".repeat(MAX_MATCH_LINE_BYTES * 2));
        let got = matched("^x+ERR$", &[long.as_bytes(), b"\n\xff\xfeERR\n"]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].text.len(), MAX_MATCH_LINE_BYTES);
        assert_eq!(matched("ERR$", &[b"\xffERR\n"]).len(), 1);
        assert!(matched("nothing", &[b"a\nb\n"]).is_empty());
    }
}
