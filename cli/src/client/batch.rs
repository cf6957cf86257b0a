//! `tenure submit --batch FILE|-`: many tasks from JSON Lines, one task per
//! line in the body format of the HTTP API's `POST /v1/tasks` (blank lines
//! are skipped). Every line is parsed and checked here before anything is
//! sent; the leader then judges each batch of at most
//! [`MAX_BATCH_TASKS`] tasks as a whole (all created, or none).
//!
//! A line's `idempotency_key` makes a re-run of the same file return the
//! tasks it created instead of creating them again; lines without one get
//! a fresh key (still sent again, unchanged, on a retry within this run).

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context};
use tenure_client::Error as ClientError;
use tenure_gateway::api::SubmitBody;
use tenure_protocol::messages::{ApiError, BatchTask, MAX_BATCH_TASKS};
use tenure_protocol::MAX_MESSAGE_BYTES;

use super::Api;

/// Encoded bytes of the tasks one request carries at most: half a message,
/// leaving room for the envelope on servers with a smaller `max_payload`.
const BATCH_BYTES: usize = MAX_MESSAGE_BYTES / 2;

/// One request's tasks, with the file line each came from.
struct Chunk {
    tasks: Vec<BatchTask>,
    lines: Vec<usize>,
    bytes: usize,
}

pub(crate) async fn submit(api: &Api, source: &Path) -> anyhow::Result<ExitCode> {
    let text = read(source)?;
    let chunks = chunks(api, &text)?;
    let total: usize = chunks.iter().map(|c| c.tasks.len()).sum();
    if total == 0 {
        bail!("{}: no task in it (one JSON object per line)", source.display());
    }
    let progress = indicatif::ProgressBar::new(total as u64).with_style(
        indicatif::ProgressStyle::with_template("{spinner} submitting {pos}/{len} tasks [{bar:30}] {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut sent = 0usize;
    for chunk in chunks {
        let first_line = chunk.lines[0];
        let done = match api.submit_batch(chunk.tasks).await {
            Ok(done) => done,
            Err(e) => {
                progress.abandon();
                let before = if sent > 0 {
                    format!("; the {sent} tasks of the lines before {first_line} were submitted (their ids are printed above)")
                } else {
                    String::new()
                };
                return Err(match e {
                    ClientError::Api(ApiError::InBatch { index, error }) => {
                        let line = chunk.lines.get(index as usize).copied().unwrap_or(first_line);
                        anyhow!("line {line}: {error}; nothing from line {first_line} on was submitted{before}")
                    }
                    other => anyhow!(other).context(format!("submitting from line {first_line} on{before}")),
                });
            }
        };
        for submitted in &done {
            if submitted.existing {
                tracing::debug!(task = %submitted.task, "idempotency key seen before: its earlier task");
            }
            println!("{}", submitted.task);
        }
        sent += done.len();
        progress.inc(done.len() as u64);
    }
    progress.finish_and_clear();
    Ok(ExitCode::SUCCESS)
}

/// The file's text (`-`: stdin).
fn read(source: &Path) -> anyhow::Result<String> {
    if source == Path::new("-") {
        let mut text = String::new();
        std::io::stdin().lock().read_to_string(&mut text).context("reading tasks from stdin")?;
        return Ok(text);
    }
    std::fs::read_to_string(source).with_context(|| format!("reading {}", source.display()))
}

/// Every line parsed and checked, split into requests of at most
/// [`MAX_BATCH_TASKS`] tasks and [`BATCH_BYTES`].
fn chunks(api: &Api, text: &str) -> anyhow::Result<Vec<Chunk>> {
    let identity = api.session().identity();
    let mut chunks: Vec<Chunk> = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let body: SubmitBody = serde_json::from_str(line).with_context(|| format!("line {number}"))?;
        let key = tenure_gateway::api::idempotency_key(identity, body.idempotency_key.as_deref())
            .map_err(|e| anyhow!("line {number}: {}", e.message))?;
        let spec = body.spec().map_err(|e| anyhow!("line {number}: {}", e.message))?;
        let task = BatchTask { idempotency_key: key, spec };
        let bytes = tenure_protocol::encode(&task).map_err(|e| anyhow!("line {number}: {e}"))?.len();
        if bytes > BATCH_BYTES {
            bail!("line {number}: the task takes {bytes} bytes; one task of a batch holds at most {BATCH_BYTES}");
        }
        match chunks.last_mut() {
            Some(c) if c.tasks.len() < MAX_BATCH_TASKS && c.bytes + bytes <= BATCH_BYTES => {
                c.tasks.push(task);
                c.lines.push(number);
                c.bytes += bytes;
            }
            _ => chunks.push(Chunk { tasks: vec![task], lines: vec![number], bytes }),
        }
    }
    Ok(chunks)
}
