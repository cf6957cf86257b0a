//! Test support shared by the integration tests: a real `nats-server` with
//! JetStream on a free loopback port and its own store directory, stopped (by its
//! pid, which this kit started) when the handle drops; plus `eventually`, the
//! bounded condition wait every test uses instead of sleeping.
//!
//! Never used by the daemons themselves.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// A running nats-server owned by one test.
pub struct NatsServer {
    child: Child,
    pub port: u16,
    pub url: String,
    _store: tempfile::TempDir,
}

/// Finds the nats-server binary: `TENURE_NATS_SERVER`, then the project's own
/// install under `.tools/nats/bin`, then `PATH`.
pub fn nats_server_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("TENURE_NATS_SERVER") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("."));
    let local = root.join(".tools/nats/bin/nats-server");
    if local.exists() {
        return local;
    }
    PathBuf::from("nats-server")
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

impl NatsServer {
    /// Starts nats-server with JetStream and waits until it accepts connections.
    pub fn start() -> anyhow::Result<NatsServer> {
        Self::start_on(free_port())
    }

    /// Starts on a given port (to restart a server where clients expect it).
    pub fn start_on(port: u16) -> anyhow::Result<NatsServer> {
        let store = tempfile::tempdir()?;
        let child = Command::new(nats_server_binary())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server (run deploy/install-nats.sh or put nats-server >= 2.11 on PATH)")?;
        let server = NatsServer { child, port, url: format!("nats://127.0.0.1:{port}"), _store: store };
        let ready = eventually(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok().then_some(())
        });
        if ready.is_none() {
            bail!("nats-server did not listen on port {port} within 20s");
        }
        Ok(server)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 20 ms until it returns `Some` or `bound` elapses.
pub fn eventually<T>(bound: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
