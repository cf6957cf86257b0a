//! Throughput: tasks submitted and driven to `completed` per second, end to
//! end through the durable path, with N tasks in flight (each in-flight slot
//! submits a task and waits for its end, then the next).
//!
//! - `noop` tasks vs the bare NATS + JetStream + sled program doing the same
//!   round trips, appends and flushes per task ([`crate::baseline::NOOP_TASK`]).
//! - `sh -c true` tasks vs spawning and reaping `sh -c true` from one process.
//! - A drain: many `noop` tasks submitted in batches of 1 000, timed until
//!   every one is `completed`, vs the bare per-task chain at 64 in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::api::{Api, BenchApi};
use crate::baseline::{self, Bare, NOOP_TASK};
use crate::cluster::{Cluster, CpuMeter, Spec};
use crate::report::{Better, Figure};
use crate::Ctx;

/// Drives `total` tasks with `concurrency` in flight; tasks per second.
pub async fn drive(
    api: &Api,
    kind: &'static str,
    command: &'static str,
    total: u64,
    concurrency: u64,
    pb: Option<&indicatif::ProgressBar>,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let left = Arc::new(AtomicU64::new(total));
    let mut loops = Vec::new();
    for _ in 0..concurrency {
        let (api, left, pb) = (api.clone(), left.clone(), pb.cloned());
        loops.push(tokio::spawn(async move {
            while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                api.run_to_end(kind, command).await?;
                if let Some(pb) = &pb {
                    pb.inc(1);
                }
            }
            anyhow::Ok(())
        }));
    }
    for l in loops {
        l.await??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}

pub async fn noop(ctx: &mut Ctx) -> anyhow::Result<()> {
    let levels: Vec<(u64, u64)> =
        ctx.size(vec![(1, 150), (16, 800), (64, 1500)], vec![(1, 500), (16, 4000), (64, 8000)]);
    let pb = ctx.spinner("throughput-noop: starting a cluster (1 worker, 64 slots)");
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "throughput-noop", &Spec::new(1, 64)).await?;
    let result = noop_levels(ctx, &cluster, &levels, "").await;
    pb.finish_and_clear();
    cluster.stop().await;
    result?;

    // The same at 16 in flight with JetStream fsyncing every write.
    let pb = ctx.spinner("throughput-noop: starting a cluster with sync_interval: always");
    let mut spec = Spec::new(1, 64);
    spec.sync_always = true;
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "throughput-noop-sync", &spec).await?;
    let n = ctx.size(400, 2000);
    let result = noop_levels(ctx, &cluster, &[(16, n)], ", sync always").await;
    pb.finish_and_clear();
    cluster.stop().await;
    result
}

async fn noop_levels(ctx: &mut Ctx, cluster: &Cluster, levels: &[(u64, u64)], note: &str) -> anyhow::Result<()> {
    let (bare, responder) = Bare::start(&cluster.url, &cluster.dir).await?;
    // Warm up both: connections, streams, allocator, page cache.
    drive(&cluster.api, "noop", "-", 50, 8, None).await?;
    bare.throughput(NOOP_TASK, 50, 8).await?;
    for &(concurrency, total) in levels {
        let pb = ctx.bar(total, format!("noop tasks, {concurrency} in flight{note}"));
        let cpu = CpuMeter::start(cluster);
        let tenure = drive(&cluster.api, "noop", "-", total, concurrency, Some(&pb)).await?;
        let cpu = cpu.per_item(total);
        pb.set_message(format!("bare baseline, {concurrency} in flight{note}"));
        // The bare program runs in this process against the same server: its
        // CPU is this process's and the server's (the idle daemons' too).
        let bare_cpu = CpuMeter::start(cluster);
        let bare_rate = bare.throughput(NOOP_TASK, total, concurrency).await?;
        let bare_cpu = bare_cpu.per_item(total);
        pb.finish_and_clear();
        if concurrency == 64 && note.is_empty() {
            let ms = |v: &serde_json::Value| v["total"].as_f64().unwrap_or(0.0);
            ctx.record(
                Figure::new("throughput-noop", "CPU per task, 64 in flight", "ms", ms(&cpu), Better::Lower)
                    .baseline("bare NATS+JetStream+sled ops/task", ms(&bare_cpu))
                    .value_target(0.4)
                    .details(json!({ "tenure": cpu, "bare": bare_cpu })),
            )?;
        }
        let steps = NOOP_TASK;
        ctx.record(
            Figure::new("throughput-noop", format!("{concurrency} in flight{note}"), "tasks/s", tenure, Better::Higher)
                .baseline("bare NATS+JetStream+sled ops/task", bare_rate)
                .ratio_target(1.0)
                .details(json!({
                    "tasks": total,
                    "concurrency": concurrency,
                    "jetstream_sync_always": !note.is_empty(),
                    "cpu_ms_per_task": cpu,
                    "per_task": {
                        "round_trips": baseline::count(steps, &[baseline::Step::RoundTrip]),
                        "appends": baseline::count(steps, &[baseline::Step::Append, baseline::Step::AppendBehind]),
                        "flushes": baseline::count(steps, &[baseline::Step::Flush, baseline::Step::FlushBehind]),
                    },
                })),
        )?;
    }
    responder.abort();
    Ok(())
}

/// Tasks one batch submit carries in the drain.
const DRAIN_BATCH: u64 = 1000;

/// `throughput-drain`: N `noop` tasks submitted in batches of
/// [`DRAIN_BATCH`] (one request each, back to back), timed from the first
/// submit until the cluster counts every one `completed`.
pub async fn drain(ctx: &mut Ctx) -> anyhow::Result<()> {
    let total: u64 = ctx.size(2_000, 20_000);
    let pb = ctx.spinner("throughput-drain: starting a cluster (1 worker, 64 slots)");
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "throughput-drain", &Spec::new(1, 64)).await?;
    pb.finish_and_clear();
    let result = async {
        let (bare, responder) = Bare::start(&cluster.url, &cluster.dir).await?;
        drive(&cluster.api, "noop", "-", 50, 8, None).await?;
        bare.throughput(NOOP_TASK, 50, 8).await?;
        let pb = ctx.bar(total, format!("draining {total} noop tasks submitted in batches of {DRAIN_BATCH}"));
        let cpu = CpuMeter::start(&cluster);
        let (rate, submitted_in) = drain_once(&cluster.api, total, &pb).await?;
        let cpu = cpu.per_item(total);
        pb.set_message("bare baseline, 64 in flight");
        let bare_rate = bare.throughput(NOOP_TASK, total, 64).await?;
        pb.finish_and_clear();
        responder.abort();
        ctx.record(
            Figure::new(
                "throughput-drain",
                format!("{total} tasks in batches of {DRAIN_BATCH}"),
                "tasks/s",
                rate,
                Better::Higher,
            )
            .baseline("bare NATS+JetStream+sled ops/task, 64 in flight", bare_rate)
            .value_target(8000.0)
            .details(json!({
                "tasks": total,
                "batch": DRAIN_BATCH,
                "submitted_in_ms": submitted_in.as_millis() as u64,
                "cpu_ms_per_task": cpu,
            })),
        )
    }
    .await;
    cluster.stop().await;
    result
}

/// Submits `total` noop tasks in batches and waits until the cluster counts
/// them all `completed`; tasks per second, and how long the submits took.
/// The end is awaited with a `wait` on the last task (dispatch is in
/// submission order), then confirmed by the counts: polling the counts all
/// along would cost the leader a pass over every task many times a second.
async fn drain_once(api: &Api, total: u64, pb: &indicatif::ProgressBar) -> anyhow::Result<(f64, std::time::Duration)> {
    let completed =
        || async { anyhow::Ok(crate::api::count(&api.cluster_status().await?, tenure_protocol::Status::Completed)) };
    let before = completed().await?;
    let started = Instant::now();
    let (mut left, mut last) = (total, None);
    while left > 0 {
        let n = left.min(DRAIN_BATCH);
        last = api.submit_noops(n).await?.pop();
        left -= n;
        pb.set_message(format!("draining {total} noop tasks: {} submitted", total - left));
    }
    let submitted_in = started.elapsed();
    let last = last.ok_or_else(|| anyhow::anyhow!("no task submitted"))?;
    // The bar moves twice a second; the wait is what ends the drain.
    let progress = {
        let (api, pb) = (api.clone(), pb.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                if let Ok(status) = api.cluster_status().await {
                    pb.set_position(crate::api::count(&status, tenure_protocol::Status::Completed) - before);
                }
            }
        })
    };
    let end = api.wait_end(&last).await;
    progress.abort();
    let end = end?;
    anyhow::ensure!(end.status == tenure_protocol::Status::Completed, "{last} ended {}", end.status);
    // Bounded: the tasks before the last end within moments of it.
    let deadline = Instant::now() + std::time::Duration::from_secs(60);
    while completed().await? - before < total {
        anyhow::ensure!(Instant::now() < deadline, "the drain did not complete every task");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    Ok((total as f64 / started.elapsed().as_secs_f64(), submitted_in))
}

pub async fn shell(ctx: &mut Ctx) -> anyhow::Result<()> {
    let levels: Vec<(u64, u64)> = ctx.size(vec![(1, 30), (16, 200)], vec![(1, 100), (16, 1000)]);
    let pb = ctx.spinner("throughput-shell: starting a cluster (1 worker, 16 slots)");
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "throughput-shell", &Spec::new(1, 16)).await?;
    pb.finish_and_clear();
    let result = async {
        drive(&cluster.api, "shell", "true", 20, 4, None).await?;
        spawn_rate(20, 4).await?;
        for &(concurrency, total) in &levels {
            let pb = ctx.bar(total, format!("sh -c true tasks, {concurrency} in flight"));
            let cpu = CpuMeter::start(&cluster);
            let tenure = drive(&cluster.api, "shell", "true", total, concurrency, Some(&pb)).await?;
            let cpu = cpu.per_item(total);
            pb.set_message(format!("spawning sh -c true, {concurrency} in flight"));
            let raw = spawn_rate(total, concurrency).await?;
            pb.finish_and_clear();
            ctx.record(
                Figure::new("throughput-shell", format!("{concurrency} in flight"), "tasks/s", tenure, Better::Higher)
                    .baseline("spawn+reap sh -c true", raw)
                    .ratio_target(0.30)
                    .details(json!({ "tasks": total, "concurrency": concurrency, "cpu_ms_per_task": cpu })),
            )?;
        }
        anyhow::Ok(())
    }
    .await;
    cluster.stop().await;
    result
}

/// Spawns and reaps `sh -c true` `total` times, `concurrency` at a time; per second.
async fn spawn_rate(total: u64, concurrency: u64) -> anyhow::Result<f64> {
    let started = Instant::now();
    let left = Arc::new(AtomicU64::new(total));
    let mut loops = Vec::new();
    for _ in 0..concurrency {
        let left = left.clone();
        loops.push(tokio::spawn(async move {
            while left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                let status = tokio::process::Command::new("sh")
                    .args(["-c", "true"])
                    .stdin(std::process::Stdio::null())
                    .status()
                    .await?;
                anyhow::ensure!(status.success(), "sh -c true failed: {status}");
            }
            anyhow::Ok(())
        }));
    }
    for l in loops {
        l.await??;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64())
}
