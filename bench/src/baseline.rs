//! The bare baselines: the same primitive operations tenure performs for a
//! task — NATS request/reply round trips, JetStream appends with ack, sled
//! insert + flush — done by a plain program with no tenure logic, against the
//! same nats-server, in the same run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, stream};
use futures::StreamExt;

/// The primitive steps of one task, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A NATS request answered by a responder in this process.
    RoundTrip,
    /// A JetStream publish, awaited until acknowledged.
    Append,
    /// A sled insert followed by a flush to disk.
    Flush,
    /// An append not awaited by the task (tenure publishes terminal notices in
    /// the background); awaited at the end of the run.
    AppendBehind,
    /// A flush not awaited by the task (the sidecar's `acknowledged` record
    /// happens after the client saw the end); awaited at the end of the run.
    FlushBehind,
}

use Step::*;

/// A `noop` task in tenure, as the client waits for it (see docs/benchmarks.md):
/// submit, queued, leased, grant, accepted, intent, exited, finished report,
/// completed, wait reply; then the notice and the acknowledged record.
pub const NOOP_TASK: &[Step] = &[
    RoundTrip,
    Append,
    Append,
    RoundTrip,
    Flush,
    Flush,
    Flush,
    RoundTrip,
    Append,
    RoundTrip,
    AppendBehind,
    FlushBehind,
];

/// Submit → process started of a `sleep` task, as the client sees it:
/// submit, queued, leased, grant, accepted, intent, started report, running,
/// and the round trip that tells the client (a `get` that sees it, as the
/// baseline has always counted it; tenure's client holds one request instead).
pub const START_CHAIN: &[Step] = &[RoundTrip, Append, Append, RoundTrip, Flush, Flush, RoundTrip, Append, RoundTrip];

/// Submit → completion observed of a `noop` task (the critical path of `NOOP_TASK`).
pub const COMPLETE_CHAIN: &[Step] =
    &[RoundTrip, Append, Append, RoundTrip, Flush, Flush, Flush, RoundTrip, Append, RoundTrip];

pub fn count(steps: &[Step], kinds: &[Step]) -> usize {
    steps.iter().filter(|s| kinds.contains(s)).count()
}

/// A bare NATS + JetStream + sled setup.
#[derive(Clone)]
pub struct Bare {
    client: async_nats::Client,
    js: jetstream::Context,
    db: sled::Db,
    next: Arc<AtomicU64>,
    payload: bytes::Bytes,
}

const ECHO: &str = "bench.baseline.echo";

impl Bare {
    /// Connects, starts an echo responder, creates a file-backed stream shaped
    /// like the registry (one message per subject) and opens a sled database.
    pub async fn start(url: &str, dir: &std::path::Path) -> anyhow::Result<(Bare, tokio::task::JoinHandle<()>)> {
        let client = async_nats::connect(url).await?;
        let responder_conn = async_nats::connect(url).await?;
        let mut sub = responder_conn.subscribe(ECHO).await?;
        let responder = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                if let Some(to) = msg.reply {
                    let _ = responder_conn.publish(to, msg.payload).await;
                }
            }
        });
        let js = jetstream::new(client.clone());
        js.get_or_create_stream(stream::Config {
            name: "BENCH_BASELINE".into(),
            subjects: vec!["bench.baseline.log.>".into()],
            max_messages_per_subject: 1,
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .context("creating the baseline stream")?;
        let db = sled::Config::new().path(dir.join("baseline-sled")).open()?;
        // About the size of a task record on the wire.
        let payload = bytes::Bytes::from(vec![b'x'; 300]);
        Ok((Bare { client, js, db, next: Arc::new(AtomicU64::new(0)), payload }, responder))
    }

    async fn step(&self, step: Step, n: u64) -> anyhow::Result<()> {
        match step {
            RoundTrip => {
                self.client.request(ECHO, self.payload.clone()).await?;
            }
            Append | AppendBehind => {
                self.js.publish(format!("bench.baseline.log.{n}"), self.payload.clone()).await?.await?;
            }
            Flush | FlushBehind => {
                let db = self.db.clone();
                let value = self.payload.to_vec();
                tokio::task::spawn_blocking(move || -> sled::Result<()> {
                    db.insert(n.to_be_bytes(), value)?;
                    db.flush()?;
                    Ok(())
                })
                .await??;
            }
        }
        Ok(())
    }

    /// Runs one task's steps; the ones behind are returned unawaited.
    pub async fn task(&self, steps: &[Step]) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<()>>>> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut behind = Vec::new();
        for step in steps {
            if matches!(step, AppendBehind | FlushBehind) {
                let (me, step) = (self.clone(), *step);
                behind.push(tokio::spawn(async move { me.step(step, n).await }));
            } else {
                self.step(*step, n).await?;
            }
        }
        Ok(behind)
    }

    /// Tasks per second with `concurrency` tasks in flight.
    pub async fn throughput(&self, steps: &'static [Step], total: u64, concurrency: u64) -> anyhow::Result<f64> {
        let started = Instant::now();
        let left = Arc::new(AtomicU64::new(total));
        let mut loops = Vec::new();
        for _ in 0..concurrency {
            let (me, left) = (self.clone(), left.clone());
            loops.push(tokio::spawn(async move {
                let mut behind = Vec::new();
                while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                    behind.extend(me.task(steps).await?);
                }
                for b in behind {
                    b.await??;
                }
                anyhow::Ok(())
            }));
        }
        for l in loops {
            l.await??;
        }
        Ok(total as f64 / started.elapsed().as_secs_f64())
    }

    /// The latency of one chain.
    pub async fn chain(&self, steps: &[Step]) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let behind = self.task(steps).await?;
        let took = started.elapsed();
        for b in behind {
            b.await??;
        }
        Ok(took)
    }
}
