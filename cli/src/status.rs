//! `tenure status`: the cluster view. On a terminal it refreshes every second
//! until Ctrl-C (a leader change shows as "no coordinator answering" until the
//! next one leads); piped, with `--once` or `--json`, it prints one view.
//!
//! The view: the leader and its epoch and lease, standbys, workers (slots,
//! running, sidecar health, heartbeat age, what its cgroups enforce), tasks
//! by status, the caller's own running tasks (ownership holds here too:
//! other sessions' tasks are only counted), and this client's NATS
//! connection.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write as _};
use std::process::ExitCode;
use std::time::Duration;

use tenure_protocol::messages::{ApiError, ClusterStatus, SidecarHealth, TaskSnapshot};
use tenure_protocol::placement::labels_text;
use tenure_protocol::Status;

use crate::text::printable;
use tenure_client::{Client as Api, API_TIMEOUT};

const REFRESH: Duration = Duration::from_secs(1);

pub async fn status(api: &Api, json: bool, once: bool) -> anyhow::Result<ExitCode> {
    let live = !json && !once && std::io::stdout().is_terminal();
    if !live {
        let status = fetch(api).await?;
        if json {
            println!("{}", serde_json::to_string_pretty(&status)?);
        } else {
            let mine = own_running(api).await.unwrap_or_default();
            print!("{}", render(&status, &mine, &nats_line(api)));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut stdout = std::io::stdout();
    loop {
        let frame = match fetch(api).await {
            Ok(status) => {
                let mine = own_running(api).await.unwrap_or_default();
                render(&status, &mine, &nats_line(api))
            }
            // A coordinator that refuses to lead says why and how to recover.
            Err(e)
                if matches!(
                    e.downcast_ref::<tenure_client::Error>().and_then(tenure_client::Error::api),
                    Some(ApiError::RegistryBehind { .. })
                ) =>
            {
                format!("{e:#}\n\n{}\n", nats_line(api))
            }
            Err(e) => format!(
                "no coordinator answering: {e:#}\n(retrying; a standby takes over after the lease TTL)\n\n{}\n",
                nats_line(api)
            ),
        };
        // Home, clear, frame: one write, so the view does not flicker.
        write!(stdout, "\x1b[H\x1b[2J{frame}\n(refreshing every second; Ctrl-C to quit)\n")?;
        stdout.flush()?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
            _ = tokio::time::sleep(REFRESH) => {}
        }
    }
}

async fn fetch(api: &Api) -> anyhow::Result<ClusterStatus> {
    Ok(api.status(API_TIMEOUT).await?)
}

async fn own_running(api: &Api) -> anyhow::Result<Vec<TaskSnapshot>> {
    let list = api.list(false).await?;
    Ok(list
        .into_iter()
        .filter(|t| {
            matches!(t.status, Status::Leased | Status::Running | Status::Waiting | Status::Paused | Status::Stopping)
        })
        .collect())
}

fn nats_line(api: &Api) -> String {
    let info = api.nats().server_info();
    let trust = if info.auth_required {
        String::new()
    } else {
        "\nWARNING: this NATS server authenticates nobody: anyone can act as any owner; see docs/security.md".to_owned()
    };
    let line = format!(
        "nats: {:?} to {} ({} {}, {}:{})",
        api.nats().connection_state(),
        if info.server_name.is_empty() { "?" } else { &info.server_name },
        if info.cluster.as_deref().unwrap_or("").is_empty() {
            "single node".to_owned()
        } else {
            format!("cluster {}", info.cluster.as_deref().unwrap_or(""))
        },
        info.version,
        info.host,
        info.port
    )
    .to_lowercase();
    line + &trust
}

/// One view of the cluster, as text.
pub fn render(s: &ClusterStatus, mine: &[TaskSnapshot], nats: &str) -> String {
    let mut out = String::new();
    match &s.leader {
        Some(l) => {
            let _ = writeln!(
                out,
                "leader    {} — epoch {}, lease renewed {} ms ago (ttl {} ms, {} renewals), adopted in {} ms",
                printable(&l.name),
                l.epoch,
                l.lease_age_ms,
                l.lease_ttl_ms,
                l.renewals,
                l.adopted_in_ms
            );
        }
        None => {
            let _ = writeln!(out, "leader    epoch {}", s.leader_epoch);
        }
    }
    let standbys: Vec<String> =
        s.standbys.iter().map(|b| format!("{} (seen {} ms ago)", printable(&b.name), b.last_seen_ms)).collect();
    let _ = writeln!(out, "standbys  {}", if standbys.is_empty() { "none".to_owned() } else { standbys.join(", ") });
    let _ = writeln!(out, "{nats}\n");
    let _ = writeln!(
        out,
        "{:<14} {:<6} {:<9} {:>5} {:>7} {:>10}  {:<26} KINDS",
        "WORKER", "ALIVE", "SIDECAR", "SLOTS", "RUNNING", "HEARTBEAT", "ENFORCES"
    );
    for w in &s.workers {
        let kinds: Vec<&str> = w.kinds.iter().map(|k| k.as_str()).collect();
        let sidecar = match w.sidecar {
            SidecarHealth::Ok => "ok",
            SidecarHealth::Degraded => "degraded",
            SidecarHealth::Down => "down",
        };
        // What its cgroups give it: tracking of every process of a task,
        // and the limits it enforces ("none": no cgroups, no limits).
        let enforces = match w.enforces.names() {
            names if names.is_empty() => "none".to_owned(),
            names => names.join(","),
        };
        let _ = writeln!(
            out,
            "{:<14} {:<6} {:<9} {:>5} {:>7} {:>8}ms  {:<26} {}",
            w.id.as_str(),
            if w.alive { "yes" } else { "NO" },
            sidecar,
            w.slots,
            w.running,
            w.last_seen_ms,
            enforces,
            kinds.join(",")
        );
        if !w.labels.is_empty() {
            let _ = writeln!(out, "{:<14} labels {}", "", printable(&labels_text(&w.labels)));
        }
    }
    if s.workers.is_empty() {
        let _ = writeln!(out, "(no worker has sent a heartbeat to this leader)");
    }
    for w in &s.workers {
        if let Some(epoch) = w.unproven_epoch {
            let _ = writeln!(
                out,
                "{}: claims epoch {epoch}, which no coordinator claimed; nothing is scheduled on it (see operations.md, \"A worker that claims an unknown epoch\")",
                w.id
            );
        }
    }
    let counts: Vec<String> = s.tasks_by_status.iter().map(|(st, n)| format!("{st}={n}")).collect();
    let _ = writeln!(out, "\ntasks     {}", if counts.is_empty() { "none".to_owned() } else { counts.join(" ") });
    if s.unconfirmed > 0 {
        let _ = writeln!(out, "          {} on workers not yet confirmed by a heartbeat to this leader", s.unconfirmed);
    }
    if !mine.is_empty() {
        let _ = writeln!(out, "\n{:<16} {:<9} {:<10} {:>7}  LABEL", "YOUR TASK", "STATUS", "WORKER", "ATTEMPT");
        for t in mine.iter().take(20) {
            let worker = t.worker.as_ref().map(|w| w.as_str().to_owned()).unwrap_or_else(|| "-".into());
            let label: String = printable(&t.label).chars().take(60).collect();
            let _ = writeln!(
                out,
                "{:<16} {:<9} {:<10} {:>7}  {label}",
                t.id.to_string(),
                t.status.as_str(),
                worker,
                t.attempt.0
            );
        }
        if mine.len() > 20 {
            let _ = writeln!(out, "… and {} more (tenure ls)", mine.len() - 20);
        }
    }
    out
}
