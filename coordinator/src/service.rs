//! The coordinator's event loop: owns the NATS subscriptions and the registry,
//! feeds every input to [`Core`] with the time, and carries out the effects in
//! order.
//!
//! It must never decide anything itself: what to grant, when a worker is lost or
//! what a kill means is the core's business. A failed persist stops the loop
//! before any later effect (reply, grant, kill) of the same batch leaves.

use std::future::Future;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use tenure_protocol::messages::{ApiError, ApiReply, ApiRequest, Heartbeat, Report, WorkerCommand};
use tenure_protocol::{subjects, WorkerId};
use tokio::sync::mpsc;

use crate::core::{Core, CoreConfig, Effect, Input, Now};
use crate::registry::{self, Registry};

/// How the coordinator is run.
#[derive(Debug, Clone)]
pub struct Options {
    pub nats_url: String,
    /// Human name of this coordinator (recorded in its epoch claim).
    pub name: String,
    pub core: CoreConfig,
    /// JetStream replicas of the registry stream (3 on a 3-node NATS cluster).
    pub replicas: usize,
    /// How long a worker command waits for its answer.
    pub command_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            nats_url: "nats://127.0.0.1:4222".into(),
            name: "coordinator".into(),
            core: CoreConfig::default(),
            replicas: 1,
            command_timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Transport(#[from] tenure_transport::Error),
    #[error(transparent)]
    Registry(#[from] registry::Error),
    #[error("NATS subscription failed: {0}")]
    Subscribe(String),
    /// A newer leader exists; this coordinator stopped writing.
    #[error("deposed: {0}")]
    Deposed(String),
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Runs the coordinator until `shutdown` resolves or it is deposed.
pub async fn run(opts: Options, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
    let client = tenure_transport::connect(&opts.nats_url, &format!("tenure-coordinator-{}", opts.name), true).await?;
    let js = async_nats::jetstream::new(client.clone());
    let started = Instant::now();
    let now = || Now { mono: started.elapsed(), wall_ms: wall_ms() };

    let load_started = Instant::now();
    let (mut registry, loaded) = Registry::open(js, opts.replicas).await?;
    let epoch = registry.claim(&opts.name, wall_ms()).await?;
    tracing::info!(
        %epoch,
        tasks = loaded.records.len(),
        corrupt = loaded.corrupt.len(),
        load_ms = load_started.elapsed().as_millis() as u64,
        "registry loaded; leading"
    );
    let mut core = Core::new(opts.core.clone(), epoch, loaded.records, now());
    core.reserve_through(loaded.highest_n);

    let sub = |s: &'static str| {
        let client = client.clone();
        async move { client.subscribe(s).await.map_err(|e| Error::Subscribe(e.to_string())) }
    };
    let mut api = sub(subjects::API).await?;
    let mut heartbeats = sub(subjects::HEARTBEAT).await?;
    let mut reports = sub(subjects::REPORT).await?;
    let (results_tx, mut results) = mpsc::channel::<Input>(4096);
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);

    loop {
        let input = tokio::select! {
            _ = &mut shutdown => break,
            Some(msg) = api.next() => {
                let reply_to = msg.reply.as_ref().map(|r| r.to_string());
                match tenure_protocol::decode::<ApiRequest>(&msg.payload) {
                    Ok(request) => Input::Api { reply_to, request },
                    Err(error) => {
                        tracing::warn!(%error, "malformed API request refused");
                        if let Some(to) = reply_to {
                            let reply: ApiReply = Err(ApiError::InvalidRequest(error.to_string()));
                            tenure_transport::reply(&client, to, &reply).await;
                        }
                        continue;
                    }
                }
            }
            Some(msg) = heartbeats.next() => match tenure_protocol::decode::<Heartbeat>(&msg.payload) {
                Ok(hb) => Input::Heartbeat(hb),
                Err(error) => {
                    tracing::warn!(%error, "malformed heartbeat ignored");
                    continue;
                }
            },
            Some(msg) = reports.next() => {
                let reply_to = msg.reply.as_ref().map(|r| r.to_string());
                match tenure_protocol::decode::<Report>(&msg.payload) {
                    Ok(report) => Input::Report { reply_to, report },
                    Err(error) => {
                        tracing::warn!(%error, "malformed report ignored");
                        continue;
                    }
                }
            }
            Some(result) = results.recv() => result,
            _ = tick.tick() => Input::Tick,
        };
        for effect in core.handle(input, now()) {
            execute(effect, &client, &mut registry, &results_tx, &opts).await?;
        }
    }
    tracing::info!("coordinator stopping");
    Ok(())
}

async fn execute(
    effect: Effect,
    client: &async_nats::Client,
    registry: &mut Registry,
    results: &mpsc::Sender<Input>,
    opts: &Options,
) -> Result<(), Error> {
    match effect {
        Effect::Persist(record) => match registry.put_task(&record).await {
            Ok(()) => Ok(()),
            Err(registry::Error::Fenced { expected }) => {
                Err(Error::Deposed(format!("registry moved past sequence {expected}: another coordinator leads")))
            }
            Err(e) => Err(e.into()),
        },
        Effect::Command { worker, command } => {
            send_command(client.clone(), worker, command, results.clone(), opts.command_timeout);
            Ok(())
        }
        Effect::Reply { to, reply } => {
            let reply = match tenure_protocol::encode(&reply) {
                Ok(_) => reply,
                Err(e) => Err(ApiError::Unavailable(format!("reply too large: {e}"))),
            };
            tenure_transport::reply(client, to, &reply).await;
            Ok(())
        }
        Effect::Ack { to, ack } => {
            tenure_transport::reply(client, to, &ack).await;
            Ok(())
        }
        Effect::StepDown { reason } => Err(Error::Deposed(reason)),
    }
}

/// Sends a command without blocking the loop; its answer re-enters as an input.
fn send_command(
    client: async_nats::Client,
    worker: WorkerId,
    command: WorkerCommand,
    results: mpsc::Sender<Input>,
    timeout: Duration,
) {
    tokio::spawn(async move {
        let subject = subjects::worker_commands(&worker);
        let result = tenure_transport::request(&client, subject, &command, timeout).await.map_err(|e| e.to_string());
        let _ = results.send(Input::CommandResult { worker, command, result }).await;
    });
}
