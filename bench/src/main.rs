//! `tenure-bench`: measures what users of tenure care about — throughput,
//! latency, failover, worker restart, output streaming, memory at scale — each
//! figure next to a baseline measured in the same run on the same machine, so
//! the ratio holds on a noisy machine. See docs/benchmarks.md.
//!
//! Every server it starts listens on loopback only and is stopped at the end of
//! its benchmark, and on Ctrl-C. The bench fails (non-zero exit) only when a run
//! fails, never because a target is missed. No timing is asserted anywhere.

mod api;
mod baseline;
mod cluster;
mod report;
mod stats;

mod latency;
mod output;
mod recovery;
mod scale;
mod throughput;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use crate::cluster::Tools;
use crate::report::{Figure, Sink};

#[derive(Parser, Debug)]
#[command(name = "tenure-bench", version, about = "Benchmarks of tenure against same-run baselines")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the benchmarks.
    Run {
        /// Smaller sizes: the whole run fits in about two minutes on 2 cores.
        #[arg(long)]
        quick: bool,
        /// Append one JSON record per figure to this file (JSON Lines).
        #[arg(long)]
        json: Option<PathBuf>,
        /// Only these benchmarks (comma-separated): throughput-drain, throughput-noop,
        /// throughput-shell, latency, failover, worker-restart, output, scale.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// The `tenure` binary (default: beside this one).
        #[arg(long)]
        tenure: Option<PathBuf>,
        /// The nats-server binary (default: TENURE_NATS_SERVER, then PATH).
        #[arg(long)]
        nats_server: Option<PathBuf>,
    },
}

pub const BENCHES: [&str; 8] = [
    "throughput-drain",
    "throughput-noop",
    "throughput-shell",
    "latency",
    "failover",
    "worker-restart",
    "output",
    "scale",
];

/// What every benchmark gets.
pub struct Ctx {
    pub tools: Tools,
    /// Where clusters keep their files (removed at the end).
    pub root: PathBuf,
    pub quick: bool,
    sink: Sink,
    pub progress: MultiProgress,
}

impl Ctx {
    /// Picks the quick or the full size.
    pub fn size<T>(&self, quick: T, full: T) -> T {
        if self.quick {
            quick
        } else {
            full
        }
    }

    /// Records a figure and prints its line above the progress bars.
    pub fn record(&mut self, figure: Figure) -> anyhow::Result<()> {
        let line = self.sink.record(figure)?;
        self.progress.suspend(|| println!("{line}"));
        Ok(())
    }

    /// Progress notes and failures, on stderr above the bars.
    pub fn say(&self, text: impl AsRef<str>) {
        self.progress.suspend(|| eprintln!("{}", text.as_ref()));
    }

    /// A spinner for one step of a benchmark.
    pub fn spinner(&self, msg: impl Into<String>) -> ProgressBar {
        let pb = self.progress.add(ProgressBar::new_spinner());
        pb.set_style(ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}").expect("static template"));
        pb.enable_steady_tick(Duration::from_millis(120));
        pb.set_message(msg.into());
        pb
    }

    /// A bar counting `total` items.
    pub fn bar(&self, total: u64, msg: impl Into<String>) -> ProgressBar {
        let pb = self.progress.add(ProgressBar::new(total));
        pb.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} [{bar:30}] {pos}/{len} {per_sec:>12} {msg}")
                .expect("static template")
                .progress_chars("=> "),
        );
        pb.enable_steady_tick(Duration::from_millis(120));
        pb.set_message(msg.into());
        pb
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn main() -> ExitCode {
    let Cmd::Run { quick, json, only, tenure, nats_server } = Cli::parse().command;
    if let Some(bad) = only.iter().find(|o| !BENCHES.contains(&o.as_str())) {
        eprintln!("error: unknown benchmark {bad:?}; known: {}", BENCHES.join(", "));
        return ExitCode::from(2);
    }
    let tools = match Tools::find(tenure, nats_server) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let root = match tempfile::Builder::new().prefix("tenure-bench-").tempdir() {
        Ok(d) => d.keep(),
        Err(e) => {
            eprintln!("error: cannot create a scratch directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mode = if quick { "quick" } else { "full" };
    let ctx = Ctx {
        tools,
        root: root.clone(),
        quick,
        sink: Sink::new(json.as_deref(), mode),
        progress: MultiProgress::new(),
    };
    let selected: Vec<&str> =
        BENCHES.iter().copied().filter(|b| only.is_empty() || only.iter().any(|o| o == b)).collect();
    let code = runtime.block_on(async move {
        tokio::select! {
            code = run_all(ctx, &selected) => code,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("interrupted: stopping every process the bench started");
                ExitCode::from(130)
            }
        }
    });
    // Whatever still ran (an interrupted benchmark) was stopped when its
    // cluster was dropped with the benchmark's future; in-process work still
    // writing to the scratch directory (a store being filled) ends with the
    // runtime, before the directory goes.
    runtime.shutdown_timeout(Duration::from_secs(10));
    let _ = std::fs::remove_dir_all(&root);
    code
}

async fn run_all(mut ctx: Ctx, selected: &[&str]) -> ExitCode {
    let started = Instant::now();
    ctx.say(format!(
        "tenure-bench ({} mode, {} cores) with {} and {}",
        if ctx.quick { "quick" } else { "full" },
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        ctx.tools.tenure.display(),
        ctx.tools.nats_server.display()
    ));
    let mut failed = Vec::new();
    for name in selected {
        let t = Instant::now();
        let result = match *name {
            "throughput-drain" => throughput::drain(&mut ctx).await,
            "throughput-noop" => throughput::noop(&mut ctx).await,
            "throughput-shell" => throughput::shell(&mut ctx).await,
            "latency" => latency::run(&mut ctx).await,
            "failover" => recovery::failover(&mut ctx).await,
            "worker-restart" => recovery::worker_restart(&mut ctx).await,
            "output" => output::run(&mut ctx).await,
            "scale" => scale::run(&mut ctx).await,
            _ => unreachable!("checked against BENCHES"),
        };
        match result {
            Ok(()) => ctx.say(format!("-- {name} done in {:.1} s", t.elapsed().as_secs_f64())),
            Err(e) => {
                ctx.say(format!("-- {name} FAILED: {e:#}"));
                // Its cluster was stopped when the benchmark returned.
                failed.push(*name);
            }
        }
    }
    let met = ctx.sink.figures.iter().filter(|f| f.target_met == Some(true)).count();
    let missed = ctx.sink.figures.iter().filter(|f| f.target_met == Some(false)).count();
    ctx.say(format!(
        "{} figures, targets met {met}, missed {missed}; {:.0} s in all{}",
        ctx.sink.figures.len(),
        started.elapsed().as_secs_f64(),
        if failed.is_empty() { String::new() } else { format!("; FAILED: {}", failed.join(", ")) }
    ));
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
