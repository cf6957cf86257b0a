//! The `tenure-powerfs` command: serve a power-loss simulating mount in the foreground, cut it
//! from outside, or clear a mount left by a killed server.
//!
//! Owns only argument parsing and signal handling; every rule lives in the library. It must
//! never print anything but `ready` on stdout, so a harness can wait for that one line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::unistd::Pid;
use tenure_powerfs::{unmount_stale, CutOptions, Options, PowerFs, TornPrefix, TornWrite};

#[derive(Debug, Parser)]
#[command(name = "tenure-powerfs", about = "A FUSE filesystem that simulates power loss (for tests)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve until SIGTERM/SIGINT (clean unmount) or SIGUSR1 (power cut).
    Mount {
        /// Directory holding the live and durable images (created if missing).
        #[arg(long)]
        backing: PathBuf,
        /// Where to mount (created if missing; a stale mount there is detached first).
        #[arg(long)]
        mountpoint: PathBuf,
        /// Any sync makes every earlier tree change durable (ext4 data=ordered-like).
        #[arg(long)]
        journaled_metadata: bool,
        /// On a cut, keep this many bytes of the last unsynced write.
        #[arg(long, conflicts_with = "torn_seed")]
        torn_bytes: Option<u64>,
        /// On a cut, keep a seeded random prefix of the last unsynced write.
        #[arg(long)]
        torn_seed: Option<u64>,
    },
    /// Cut the power of a running server (sends it SIGUSR1).
    Cut {
        #[arg(long)]
        pid: i32,
    },
    /// Detach the mount a killed server left behind.
    Unmount {
        #[arg(long)]
        mountpoint: PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fuser=error")),
        )
        .init();
    match Cli::parse().command {
        Command::Mount { backing, mountpoint, journaled_metadata, torn_bytes, torn_seed } => {
            // Block the control signals before any thread exists, so every thread inherits the
            // mask and only the `wait` below ever receives them.
            let mut signals = SigSet::empty();
            for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGUSR1] {
                signals.add(s);
            }
            signals.thread_block().context("blocking signals")?;
            let mounted = PowerFs::mount(&backing, &mountpoint, Options { journaled_metadata })
                .with_context(|| format!("mounting {}", mountpoint.display()))?;
            let mut out = std::io::stdout();
            writeln!(out, "ready").context("writing to stdout")?;
            out.flush().context("flushing stdout")?;
            let signal = signals.wait().context("waiting for a signal")?;
            if signal == Signal::SIGUSR1 {
                let prefix = torn_bytes.map(TornPrefix::Bytes).or(torn_seed.map(TornPrefix::Seeded));
                let report = mounted.cut(CutOptions { torn: prefix.map(|prefix| TornWrite { prefix }) })?;
                eprintln!("power cut: {report:?}");
            } else {
                mounted.unmount()?;
                eprintln!("clean unmount after {signal}");
            }
            Ok(())
        }
        Command::Cut { pid } => {
            kill(Pid::from_raw(pid), Signal::SIGUSR1).with_context(|| format!("signalling {pid}"))?;
            Ok(())
        }
        Command::Unmount { mountpoint } => {
            let n = unmount_stale(&mountpoint)?;
            eprintln!("detached {n} mount(s) at {}", mountpoint.display());
            Ok(())
        }
    }
}
