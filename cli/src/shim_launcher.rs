//! The shim launcher's entry point, shared by `tenure shim-launcher` and the
//! small `tenure-shim` program (`src/bin/tenure-shim.rs`), so that both run
//! the same launcher with the same logging.
//!
//! It must run before any thread is started: the launcher forks, and a
//! forked child of a multi-threaded process may run only async-signal-safe
//! code.

use std::path::Path;
use std::process::ExitCode;

/// Serves launch requests on stdin until the worker closes it
/// ([`tenure_worker::launcher::serve`]). The launcher and its shims log to
/// the worker's stderr at `info` (or `RUST_LOG`); that stderr may be gone
/// while a shim runs, and a failed log write is dropped (SIGPIPE stays
/// ignored, as the Rust runtime leaves it).
pub fn run(data_dir: &Path) -> ExitCode {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    ExitCode::from(tenure_worker::launcher::serve(data_dir) as u8)
}
