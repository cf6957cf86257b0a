//! Scale and memory: many terminal `noop` tasks, then many live `sleep`
//! tasks; the RSS the coordinator, the worker and the sidecar gain per task,
//! next to the bytes one registry record takes in JetStream; and how long
//! `tenure ls` takes (a CLI process, as a user runs it), next to `tenure
//! status` (the same process start and one small request).

use std::time::{Duration, Instant};

use serde_json::json;
use tenure_protocol::Status;

use crate::api::{count, BenchApi};
use crate::cluster::{rss, Cluster, Spec};
use crate::report::{Better, Figure};
use crate::Ctx;

pub async fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let terminal: u64 = ctx.size(3000, 100_000);
    let live: u64 = ctx.size(1000, 10_000);
    let pb = ctx.spinner(format!("scale: starting a worker with {} slots", live + 16));
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "scale", &Spec::new(1, live as u32 + 16)).await?;
    pb.finish_and_clear();
    let result = measure(ctx, &cluster, terminal, live).await;
    if result.is_err() {
        ctx.say(cluster.logs());
    }
    cluster.stop().await;
    result
}

fn rss_of(cluster: &Cluster) -> [u64; 3] {
    ["coordinator-c1", "worker-w1", "sidecar-w1"].map(|r| cluster.pid(r).map(rss).unwrap_or(0))
}

/// Runs `tenure ARGS` as the bench session; (seconds, success, stdout bytes).
async fn cli(ctx: &Ctx, cluster: &Cluster, args: &[&str]) -> anyhow::Result<(f64, bool, usize, String)> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new(&ctx.tools.tenure)
        .args(["--nats", &cluster.url, "--session", cluster.api.session().as_str()])
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let err = String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or("").to_owned();
    Ok((t0.elapsed().as_secs_f64() * 1000.0, out.status.success(), out.stdout.len(), err))
}

async fn registry_bytes_per_record(cluster: &Cluster) -> anyhow::Result<f64> {
    let js = async_nats::jetstream::new(cluster.api.nats().clone());
    let mut stream = js.get_stream(tenure_protocol::subjects::REGISTRY_STREAM).await?;
    let state = stream.info().await?.state.clone();
    Ok(state.bytes as f64 / state.messages.max(1) as f64)
}

async fn ls_figures(ctx: &mut Ctx, cluster: &Cluster, listed: u64, what: &str, args: &[&str]) -> anyhow::Result<()> {
    let (base_ms, base_ok, _, _) = cli(ctx, cluster, &["status"]).await?;
    let (ms, ok, bytes, err) = cli(ctx, cluster, args).await?;
    anyhow::ensure!(base_ok, "tenure status failed");
    ctx.record(
        Figure::new("scale", format!("`tenure {}` {what}", args.join(" ")), "ms", ms, Better::Lower)
            .baseline("`tenure status`", base_ms)
            .details(json!({ "tasks_listed": listed, "succeeded": ok, "stdout_bytes": bytes, "error": err })),
    )?;
    if !ok {
        ctx.say(format!("   note: `tenure {}` failed with {listed} tasks to list: {err}", args.join(" ")));
    }
    Ok(())
}

async fn measure(ctx: &mut Ctx, cluster: &Cluster, terminal: u64, live: u64) -> anyhow::Result<()> {
    // Warm up, then the starting point.
    crate::throughput::drive(&cluster.api, "noop", "-", 100, 16, None).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_of(cluster);

    let pb = ctx.bar(terminal, "scale: terminal noop tasks, 64 in flight");
    crate::throughput::drive(&cluster.api, "noop", "-", terminal, 64, Some(&pb)).await?;
    pb.finish_and_clear();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_terminal = rss_of(cluster);
    let record_bytes = registry_bytes_per_record(cluster).await?;
    let per = |a: u64, b: u64, n: u64| (a as f64 - b as f64) / n as f64;
    let names = ["coordinator", "worker", "sidecar"];
    for (i, name) in names.iter().enumerate() {
        let mut f = Figure::new(
            "scale",
            format!("{name} RSS per terminal task"),
            "bytes",
            per(after_terminal[i], before[i], terminal),
            Better::Lower,
        )
        .baseline("registry bytes per record", record_bytes)
        .details(json!({ "tasks": terminal, "rss_before": before[i], "rss_after": after_terminal[i] }));
        if i == 0 {
            f = f.value_target(1024.0);
        }
        ctx.record(f)?;
    }
    ls_figures(ctx, cluster, 0, format!("with {terminal} terminal tasks (reported)").as_str(), &["ls"]).await?;
    ls_figures(ctx, cluster, terminal, format!("with {terminal} terminal tasks").as_str(), &["ls", "--all"]).await?;

    let pb = ctx.bar(live, "scale: live sleep tasks");
    let mut submitted = 0;
    let api = cluster.api.clone();
    let mut pending = futures::StreamExt::buffer_unordered(
        futures::stream::iter((0..live).map(|_| api.submit_command("sleep", "3600000"))),
        64,
    );
    while let Some(id) = futures::StreamExt::next(&mut pending).await {
        id?;
        submitted += 1;
        pb.set_position(submitted);
    }
    pb.set_message("scale: waiting until every live task runs");
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let s = cluster.api.cluster_status().await?;
        if count(&s, Status::Running) == live && s.unconfirmed == 0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "live tasks not all running: {:?}", s.tasks_by_status);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    pb.finish_and_clear();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after_live = rss_of(cluster);
    for (i, name) in names.iter().enumerate() {
        let mut f = Figure::new(
            "scale",
            format!("{name} RSS per live task"),
            "bytes",
            per(after_live[i], after_terminal[i], live),
            Better::Lower,
        )
        .baseline("registry bytes per record", record_bytes)
        .details(json!({ "tasks": live, "rss_before": after_terminal[i], "rss_after": after_live[i] }));
        if i == 0 {
            f = f.value_target(4096.0);
        }
        ctx.record(f)?;
    }
    ls_figures(ctx, cluster, live, format!("with {live} live tasks").as_str(), &["ls"]).await?;
    Ok(())
}
