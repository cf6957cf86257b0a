//! Output streaming: one task writes as fast as it can (`head -c SIZE
//! /dev/zero`) while `tenure logs --follow` reads it, from submit until the
//! follower exits with every byte; next to `head -c SIZE /dev/zero | cat >
//! FILE`. The peak RSS of every tenure process is sampled meanwhile: memory
//! must not grow with the output.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use tokio::io::AsyncReadExt;

use crate::api::BenchApi;
use crate::cluster::{pids_with_arg, rss, Cluster, Spec};
use crate::report::{Better, Figure};
use crate::Ctx;

const MIB: f64 = 1024.0 * 1024.0;

pub async fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let size: u64 = ctx.size(256, 1024) * 1024 * 1024;
    let pb = ctx.spinner("output: starting a cluster");
    let mut spec = Spec::new(1, 4);
    spec.worker_extra = vec!["--output-cap".into(), (size * 2).to_string()];
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "output", &spec).await?;
    pb.set_message(format!("output: streaming {} MiB through logs -f", size >> 20));
    let result = stream(ctx, &cluster, size).await;
    pb.finish_and_clear();
    if result.is_err() {
        ctx.say(cluster.logs());
    }
    cluster.stop().await;
    result
}

async fn stream(ctx: &mut Ctx, cluster: &Cluster, size: u64) -> anyhow::Result<()> {
    let roles = ["coordinator-c1", "worker-w1", "sidecar-w1", "nats"];
    let idle: BTreeMap<String, u64> =
        roles.iter().filter_map(|r| Some((r.to_string(), rss(cluster.pid(r)?)))).collect();
    let peaks: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let fixed: Vec<(String, i32)> = roles.iter().filter_map(|r| Some((r.to_string(), cluster.pid(r)?))).collect();
    let worker_pid = cluster.pid("worker-w1").unwrap_or(0);
    let sidecar_pid = cluster.pid("sidecar-w1").unwrap_or(0);
    let worker_dir = cluster.worker_dir("w1").display().to_string();
    let follower: Arc<Mutex<Option<i32>>> = Arc::default();
    let sampler = {
        let (peaks, done, follower) = (peaks.clone(), done.clone(), follower.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                let mut seen: Vec<(String, i32)> = fixed.clone();
                for pid in pids_with_arg(&worker_dir) {
                    if pid != worker_pid && pid != sidecar_pid {
                        seen.push(("shim".into(), pid));
                    }
                }
                if let Some(pid) = *follower.lock().unwrap_or_else(|p| p.into_inner()) {
                    seen.push(("logs -f client".into(), pid));
                }
                {
                    let mut peaks = peaks.lock().unwrap_or_else(|p| p.into_inner());
                    for (role, pid) in seen {
                        let r = rss(pid);
                        let peak = peaks.entry(role).or_insert(0);
                        *peak = (*peak).max(r);
                    }
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        })
    };

    let started = Instant::now();
    let task = cluster.api.submit_command("shell", &format!("head -c {size} /dev/zero")).await?;
    let mut logs = tokio::process::Command::new(&ctx.tools.tenure)
        .args([
            "--nats",
            &cluster.url,
            "--session",
            cluster.api.session().as_str(),
            "logs",
            "--follow",
            &task.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting tenure logs --follow")?;
    *follower.lock().unwrap_or_else(|p| p.into_inner()) = logs.id().map(|p| p as i32);
    let mut out = logs.stdout.take().context("no stdout")?;
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0u64;
    loop {
        let n = out.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        got += n as u64;
    }
    let status = logs.wait().await?;
    let took = started.elapsed();
    done.store(true, Ordering::Relaxed);
    sampler.await?;
    if !status.success() || got != size {
        let mut err = String::new();
        if let Some(mut e) = logs.stderr.take() {
            let _ = e.read_to_string(&mut err).await;
        }
        bail!("logs -f read {got} of {size} bytes ({status}): {err}");
    }

    let file = cluster.dir.join("baseline-output");
    let t0 = Instant::now();
    let baseline = tokio::process::Command::new("sh")
        .args(["-c", &format!("head -c {size} /dev/zero | cat > '{}'", file.display())])
        .status()
        .await?;
    let bare = t0.elapsed();
    let _ = std::fs::remove_file(&file);
    anyhow::ensure!(baseline.success(), "baseline pipeline failed: {baseline}");

    let mbps = size as f64 / MIB / took.as_secs_f64();
    let bare_mbps = size as f64 / MIB / bare.as_secs_f64();
    let peaks = peaks.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let peak_mib: BTreeMap<&String, f64> = peaks.iter().map(|(k, v)| (k, *v as f64 / MIB)).collect();
    ctx.record(
        Figure::new("output", format!("logs -f of {} MiB", size >> 20), "MiB/s", mbps, Better::Higher)
            .baseline("head | cat > file", bare_mbps)
            .value_target(100.0)
            .details(json!({ "bytes": size, "seconds": took.as_secs_f64(), "peak_rss_mib": peak_mib })),
    )?;
    for (role, peak) in &peaks {
        let mut f = Figure::new("output", format!("peak RSS {role}"), "MiB", *peak as f64 / MIB, Better::Lower);
        if let Some(before) = idle.get(role) {
            f = f.baseline("RSS before streaming", *before as f64 / MIB);
        }
        ctx.record(f.details(json!({ "bytes_streamed": size })))?;
    }
    Ok(())
}
