//! `tenure-launch`: starting tenure's processes on this machine, for the
//! local clusters of `tenure dev`, the tests (through `tenure-testkit`), the
//! bench and the chaos harness.
//!
//! It owns the one local-cluster harness ([`cluster::Cluster`]: members,
//! logs, credentials, supervision, stop order) and what it is built from:
//! finding a nats-server recent enough and saying what is missing
//! and how to get it ([`nats::find`]); the configuration of a loopback
//! nats-server with JetStream and its own store ([`nats::Config`]); free
//! loopback ports and waiting for a port to listen; how each daemon is
//! invoked and where a machine's data directory lies ([`daemon`]); and child
//! processes with a log file, stopped by their own pid ([`process::Process`]).
//!
//! It is an ordinary dependency (not test support) because `tenure dev`, a
//! command users run, needs the same finder and server configuration as the
//! tests. It must never: signal a process it did not start (everything is
//! stopped by the pid of its own child, never by name), pick a nats-server
//! older than [`nats::MIN_VERSION`], or decide anything about tasks.

pub mod cluster;
pub mod daemon;
pub mod nats;
pub mod process;

use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound and released: another process may
/// take it before it is used; good enough on one machine).
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits (polling every 20 ms) until something accepts connections on
/// 127.0.0.1:`port`, at most `bound`; whether it did.
pub fn wait_listening(port: u16, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
