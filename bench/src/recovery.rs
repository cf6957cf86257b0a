//! Recovery: how long the cluster needs to be whole again after a node dies.
//!
//! - failover: the leader coordinator SIGKILLed with N running `sleep` tasks;
//!   time until a standby leads and has adopted all of them (`status` shows
//!   them running and `unconfirmed == 0`: each worker listed each attempt in a
//!   heartbeat to the new leader), next to the lease TTL.
//! - worker restart: the worker SIGKILLed with N running shell tasks and
//!   started again at once; time until its first heartbeat holds every attempt
//!   again (re-attached to the shims), next to the same restart with no task.
//! - sidecar reload: opening and loading a sidecar store of 10 000 and 100 000
//!   records, next to bare sled opening and iterating the same tree.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use serde_json::json;
use tenure_protocol::messages::{AttemptRecord, Heartbeat, LeaseGrant, Phase};
use tenure_protocol::{Attempt, Ending, Epoch, Outcome, Status, TaskId, TaskSpec};
use tenure_sidecar::{RecoveryStore, SledStore};

use crate::api::{count, Api, BenchApi};
use crate::cluster::{Cluster, Spec, LEASE_TTL_MS};
use crate::report::{Better, Figure};
use crate::stats::Samples;
use crate::Ctx;

/// Submits `n` tasks, 64 at a time; their ids.
async fn submit_many(api: &Api, kind: &str, command: &str, n: usize) -> anyhow::Result<Vec<TaskId>> {
    let mut ids = Vec::with_capacity(n);
    let mut pending = futures::stream::iter((0..n).map(|_| api.submit_command(kind, command))).buffer_unordered(64);
    while let Some(id) = pending.next().await {
        ids.push(id?);
    }
    Ok(ids)
}

/// Waits until `n` tasks run and every one is confirmed by its worker.
async fn wait_running(api: &Api, n: u64, bound: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + bound;
    loop {
        if let Ok(s) = api.cluster_status().await {
            if count(&s, Status::Running) == n && s.unconfirmed == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{n} tasks not all running within {bound:?}: {:?}", s.tasks_by_status);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn failover(ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = ctx.size(200, 1000);
    let rounds = ctx.size(3, 8);
    let pb = ctx.spinner(format!("failover: starting 2 coordinators and a worker with {n} slots"));
    let mut spec = Spec::new(1, n as u32 + 8);
    spec.coordinators = 2;
    let mut cluster = Cluster::start(&ctx.tools, &ctx.root, "failover", &spec).await?;
    let result = failover_rounds(ctx, &mut cluster, &pb, n, rounds).await;
    pb.finish_and_clear();
    if result.is_err() {
        ctx.say(cluster.logs());
    }
    cluster.stop().await;
    result
}

async fn failover_rounds(
    ctx: &mut Ctx,
    cluster: &mut Cluster,
    pb: &indicatif::ProgressBar,
    n: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    pb.set_message(format!("failover: submitting {n} sleep tasks"));
    submit_many(&cluster.api, "sleep", "3600000", n).await?;
    wait_running(&cluster.api, n as u64, Duration::from_secs(120)).await?;
    let mut samples = Samples::default();
    let mut adopted_in = Vec::new();
    for round in 1..=rounds {
        pb.set_message(format!("failover: round {round}/{rounds}, waiting for a standby"));
        let deadline = Instant::now() + Duration::from_secs(30);
        let (old, epoch) = loop {
            let s = cluster.api.cluster_status().await?;
            if let (Some(l), false) = (&s.leader, s.standbys.is_empty()) {
                break (l.name.clone(), s.leader_epoch);
            }
            if Instant::now() > deadline {
                bail!("no standby joined within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        pb.set_message(format!("failover: round {round}/{rounds}, leader {old} SIGKILLed"));
        cluster.member(&format!("coordinator-{old}"))?.kill9();
        let killed = Instant::now();
        let deadline = killed + Duration::from_secs(60);
        loop {
            if let Ok(s) = cluster.api.status(Duration::from_millis(300)).await {
                let new_leader = s.leader.as_ref().filter(|l| l.name != old && s.leader_epoch > epoch);
                if let Some(l) = new_leader {
                    if count(&s, Status::Running) == n as u64 && s.unconfirmed == 0 {
                        samples.push(killed.elapsed());
                        adopted_in.push(l.adopted_in_ms);
                        break;
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("running tasks not adopted within 60 s of the leader's death");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        cluster.restart(&format!("coordinator-{old}"))?;
    }
    let s = cluster.api.cluster_status().await?;
    let interrupted = n as u64 - count(&s, Status::Running);
    let details = json!({
        "running_tasks": n,
        "rounds": rounds,
        "lease_ttl_ms": LEASE_TTL_MS,
        "kill_to_adopted": samples.summary(),
        "leader_adopted_in_ms": adopted_in,
        "tasks_not_running_after": interrupted,
        "tasks_by_status": s.tasks_by_status,
    });
    let ttl = LEASE_TTL_MS as f64;
    for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
        let mut f = Figure::new(
            "failover",
            format!("{n} running, kill->adopted {label}"),
            "ms",
            samples.quantile(q),
            Better::Lower,
        )
        .baseline("lease TTL", ttl)
        .details(details.clone());
        if label == "p99" {
            f = f.value_target(ttl + 1000.0);
        }
        ctx.record(f)?;
    }
    if interrupted > 0 {
        bail!("{interrupted} of {n} tasks no longer running after the failovers: {:?}", s.tasks_by_status);
    }
    Ok(())
}

pub async fn worker_restart(ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = ctx.size(20, 200);
    let rounds = ctx.size(2, 5);
    let pb = ctx.spinner(format!("worker-restart: starting a worker with {n} slots"));
    let mut cluster = Cluster::start(&ctx.tools, &ctx.root, "worker-restart", &Spec::new(1, n as u32 + 4)).await?;
    let result = restart_rounds(ctx, &mut cluster, &pb, n, rounds).await;
    pb.finish_and_clear();
    if result.is_err() {
        ctx.say(cluster.logs());
    }
    cluster.stop().await;
    result?;
    sidecar_reload(ctx).await
}

/// SIGKILLs the worker, starts it again, and times until a heartbeat of the new
/// instance holds `n` attempts.
async fn restart_once(cluster: &mut Cluster, n: usize) -> anyhow::Result<Duration> {
    let mut beats = cluster.api.nats().subscribe(tenure_protocol::subjects::HEARTBEAT_ALL).await?;
    let old = loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), beats.next()).await?.context("heartbeats ended")?;
        let hb: Heartbeat = tenure_protocol::decode(&msg.payload)?;
        if hb.worker.as_str() == "w1" {
            break hb.instance;
        }
    };
    cluster.member("worker-w1")?.kill9();
    let killed = Instant::now();
    cluster.restart("worker-w1")?;
    let deadline = killed + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let msg = tokio::time::timeout(left, beats.next()).await.context("no heartbeat holding every attempt")?;
        let hb: Heartbeat = tenure_protocol::decode(&msg.context("heartbeats ended")?.payload)?;
        if hb.worker.as_str() == "w1" && hb.instance != old && hb.attempts.len() >= n {
            return Ok(killed.elapsed());
        }
    }
}

async fn restart_rounds(
    ctx: &mut Ctx,
    cluster: &mut Cluster,
    pb: &indicatif::ProgressBar,
    n: usize,
    rounds: usize,
) -> anyhow::Result<()> {
    let mut empty = Samples::default();
    let mut full = Samples::default();
    for round in 1..=rounds {
        pb.set_message(format!("worker-restart: idle worker, round {round}/{rounds}"));
        empty.push(restart_once(cluster, 0).await?);
    }
    pb.set_message(format!("worker-restart: submitting {n} shell tasks (sleep 3600)"));
    let ids = submit_many(&cluster.api, "shell", "sleep 3600", n).await?;
    wait_running(&cluster.api, n as u64, Duration::from_secs(120)).await?;
    for round in 1..=rounds {
        pb.set_message(format!("worker-restart: {n} running, round {round}/{rounds}"));
        full.push(restart_once(cluster, n).await?);
    }
    // None restarted: every task still runs its first attempt.
    let mut restarted = HashSet::new();
    for id in &ids {
        let s = cluster.api.get(id).await?;
        if s.status != Status::Running || s.attempt != Attempt(1) {
            restarted.insert((id.to_string(), s.status, s.attempt.0));
        }
    }
    for (q, label) in [(0.5, "p50"), (1.0, "max")] {
        ctx.record(
            Figure::new(
                "worker-restart",
                format!("{n} running, kill->re-attached {label}"),
                "ms",
                full.quantile(q),
                Better::Lower,
            )
            .baseline("same restart, no task", empty.quantile(q))
            .details(json!({
                "running_tasks": n,
                "rounds": rounds,
                "with_tasks": full.summary(),
                "without_tasks": empty.summary(),
                "not_running_first_attempt": restarted.len(),
            })),
        )?;
    }
    if !restarted.is_empty() {
        bail!("tasks restarted or lost by a worker restart: {restarted:?}");
    }
    Ok(())
}

fn record_of(i: u64) -> anyhow::Result<AttemptRecord> {
    Ok(AttemptRecord {
        grant: LeaseGrant {
            task: TaskId::new("shell".parse()?, i)?,
            attempt: Attempt(1),
            epoch: Epoch(1),
            owner: "bench-owner".parse()?,
            spec: TaskSpec::shell("sleep 3600", "sleep 3600"),
            mark: None,
            input: Vec::new(),
        },
        phase: Phase::Exited,
        pid: Some(4242),
        outcome: Some(Outcome::new(Ending::Completed, Some(0), None)),
        boot: None,
    })
}

/// Opens a database this process just closed, and when the successful attempt
/// began: sled's background flusher may hold the file lock for a moment after
/// the last handle drops (longest on a loaded machine), so a refused lock is
/// tried again, for up to 10 s, and only the attempt that opened it is timed.
fn reopen<T, E: std::error::Error + Send + Sync + 'static>(
    mut open: impl FnMut() -> Result<T, E>,
) -> anyhow::Result<(Instant, T)> {
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let started = Instant::now();
        match open() {
            Ok(db) => return Ok((started, db)),
            Err(e) if Instant::now() < deadline && e.to_string().contains("could not acquire lock") => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn sidecar_reload(ctx: &mut Ctx) -> anyhow::Result<()> {
    for n in [10_000u64, 100_000] {
        let pb = ctx.spinner(format!("sidecar reload: writing {n} records"));
        let path = ctx.root.join(format!("reload-{n}"));
        let p = path.clone();
        let (tenure, bare, records) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            {
                let mut store = SledStore::open(&p)?;
                let mut batch = Vec::with_capacity(10_000);
                for i in 1..=n {
                    batch.push(record_of(i)?);
                    if batch.len() == 10_000 {
                        store.put_many(&batch)?;
                        batch.clear();
                    }
                }
                store.put_many(&batch)?;
            }
            // What the sidecar does at start-up: open the store, load every record.
            let (t0, store) = reopen(|| SledStore::open(&p))?;
            let loaded = store.load()?;
            let tenure = t0.elapsed();
            drop(store);
            // Bare sled: open and read every value of the same tree.
            let (t0, db) = reopen(|| sled::open(&p))?;
            let tree = db.open_tree("attempts")?;
            let mut bytes = 0usize;
            for entry in tree.iter() {
                bytes += entry?.1.len();
            }
            let bare = t0.elapsed();
            anyhow::ensure!(bytes > 0, "nothing read back");
            Ok((tenure, bare, loaded.records.len()))
        })
        .await??;
        pb.finish_and_clear();
        let _ = std::fs::remove_dir_all(&path);
        anyhow::ensure!(records as u64 == n, "loaded {records} of {n} records");
        let mut f =
            Figure::new("sidecar-reload", format!("{n} records"), "ms", tenure.as_secs_f64() * 1000.0, Better::Lower)
                .baseline("bare sled open+iterate", bare.as_secs_f64() * 1000.0)
                .details(json!({ "records": n }));
        if n == 10_000 {
            f = f.value_target(1000.0);
        }
        ctx.record(f)?;
    }
    Ok(())
}
