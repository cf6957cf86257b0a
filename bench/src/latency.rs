//! Latency, as the client sees it: submit → process started (a `sleep` task,
//! submitted by a `Run` held until it is `running`) and submit → completion
//! observed (a `noop` task, submitted by a `Run` held until its end), on an
//! idle cluster and under a background load of `noop` tasks 16 in flight.
//! Baseline: the bare chain of NATS round trips, JetStream appends and sled
//! flushes the same path needs
//! ([`crate::baseline::START_CHAIN`], [`crate::baseline::COMPLETE_CHAIN`]),
//! idle and under the bare baseline's own load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use crate::api::{Api, BenchApi};
use crate::baseline::{Bare, COMPLETE_CHAIN, NOOP_TASK, START_CHAIN};
use crate::cluster::{Cluster, Spec};
use crate::report::{Better, Figure};
use crate::stats::Samples;
use crate::Ctx;

const LOAD: u64 = 16;

struct Measured {
    started: Samples,
    completed: Samples,
}

async fn measure_tenure(api: &Api, n: usize, pb: &indicatif::ProgressBar) -> anyhow::Result<Measured> {
    let mut m = Measured { started: Samples::default(), completed: Samples::default() };
    for _ in 0..n {
        let t0 = Instant::now();
        let task = api.run_to_start("sleep", "20").await?;
        m.started.push(t0.elapsed());
        api.wait_end(&task).await?;
        let t0 = Instant::now();
        api.run_to_end("noop", "-").await?;
        m.completed.push(t0.elapsed());
        pb.inc(1);
    }
    Ok(m)
}

async fn measure_bare(bare: &Bare, n: usize) -> anyhow::Result<Measured> {
    let mut m = Measured { started: Samples::default(), completed: Samples::default() };
    for _ in 0..n {
        m.started.push(bare.chain(START_CHAIN).await?);
        m.completed.push(bare.chain(COMPLETE_CHAIN).await?);
    }
    Ok(m)
}

pub async fn run(ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = ctx.size(60, 400);
    let pb = ctx.spinner("latency: starting a cluster (1 worker, 64 slots)");
    let cluster = Cluster::start(&ctx.tools, &ctx.root, "latency", &Spec::new(1, 64)).await?;
    pb.finish_and_clear();
    let result = measure(ctx, &cluster, n).await;
    cluster.stop().await;
    result
}

async fn measure(ctx: &mut Ctx, cluster: &Cluster, n: usize) -> anyhow::Result<()> {
    let (bare, responder) = Bare::start(&cluster.url, &cluster.dir).await?;
    crate::throughput::drive(&cluster.api, "noop", "-", 30, 4, None).await?;
    bare.throughput(NOOP_TASK, 30, 4).await?;
    for loaded in [false, true] {
        let load = if loaded { format!("under load ({LOAD} noop in flight)") } else { "idle".to_owned() };
        let pb = ctx.bar(n as u64, format!("latency samples, {load}"));
        let stop = Arc::new(AtomicBool::new(false));
        let background = loaded.then(|| tenure_load(&cluster.api, stop.clone()));
        let tenure = measure_tenure(&cluster.api, n, &pb).await;
        stop.store(true, Ordering::Relaxed);
        if let Some(b) = background {
            for h in b {
                h.await??;
            }
        }
        let tenure = tenure?;
        pb.set_message(format!("bare chains, {load}"));
        let stop = Arc::new(AtomicBool::new(false));
        let background = loaded.then(|| bare_load(&bare, stop.clone()));
        let bare_m = measure_bare(&bare, n).await;
        stop.store(true, Ordering::Relaxed);
        if let Some(b) = background {
            for h in b {
                h.await??;
            }
        }
        let bare_m = bare_m?;
        pb.finish_and_clear();
        for (what, t, b, chain) in [
            ("submit->started", &tenure.started, &bare_m.started, START_CHAIN),
            ("submit->completed", &tenure.completed, &bare_m.completed, COMPLETE_CHAIN),
        ] {
            for (q, label) in [(0.5, "p50"), (0.99, "p99"), (0.999, "p99.9")] {
                let mut f =
                    Figure::new("latency", format!("{what} {label} {load}"), "ms", t.quantile(q), Better::Lower)
                        .baseline("bare chain of the same steps", b.quantile(q))
                        .details(json!({
                            "tenure": t.summary(),
                            "baseline": b.summary(),
                            "chain": format!("{chain:?}"),
                        }));
                // The targets are on the idle start latency: at most Celery's
                // (measured beside it on this kind of machine: 1.7 ms p50,
                // 2.9 ms p99), with a little margin.
                if !loaded && what == "submit->started" {
                    match label {
                        "p50" => f = f.value_target(1.5),
                        "p99" => f = f.value_target(3.0),
                        _ => {}
                    }
                }
                ctx.record(f)?;
            }
        }
    }
    responder.abort();
    Ok(())
}

fn tenure_load(api: &Api, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    (0..LOAD)
        .map(|_| {
            let (api, stop) = (api.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    api.run_to_end("noop", "-").await?;
                }
                Ok(())
            })
        })
        .collect()
}

fn bare_load(bare: &Bare, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    (0..LOAD)
        .map(|_| {
            let (bare, stop) = (bare.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    for b in bare.task(NOOP_TASK).await? {
                        b.await??;
                    }
                }
                Ok(())
            })
        })
        .collect()
}
