//! A fault-injecting TCP proxy: one per link between a node and NATS, owned by
//! the harness. Its mode can be switched at any time:
//!
//! - `Pass` — bytes flow both ways;
//! - `Drop` — every connection is closed and new ones are refused (a cut link
//!   the peer notices at once);
//! - `Blackhole` — connections stay open but no byte moves either way (a cut
//!   link the peer only notices by timeouts);
//! - `Delay(ms)` — bytes flow, each chunk held back `ms` first;
//! - `OneWay(dir)` — only one direction flows; the other is swallowed.
//!
//! Loopback only. It never parses what it carries.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Node → NATS only.
    Upstream,
    /// NATS → node only.
    Downstream,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Pass,
    Drop,
    Blackhole,
    Delay(u64),
    OneWay(Direction),
}

/// A running proxy; dropping it stops accepting (existing links end with the runtime).
pub struct Proxy {
    pub port: u16,
    mode: watch::Sender<Mode>,
    generation: Arc<Mutex<u64>>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:target`.
    pub async fn start(target: u16) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, rx) = watch::channel(Mode::Pass);
        let generation = Arc::new(Mutex::new(0u64));
        let gen = generation.clone();
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { continue };
                let rx = rx.clone();
                if *rx.borrow() == Mode::Drop {
                    drop(client);
                    continue;
                }
                let born = *gen.lock().unwrap_or_else(|p| p.into_inner());
                let gen = gen.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else { return };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = pump(cr, sw, rx.clone(), Direction::Upstream, gen.clone(), born);
                    let down = pump(sr, cw, rx, Direction::Downstream, gen, born);
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                    }
                });
            }
        });
        Ok(Proxy { port, mode, generation })
    }

    pub fn set(&self, mode: Mode) {
        if mode == Mode::Drop {
            // Existing connections notice the generation change and close.
            *self.generation.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        }
        let _ = self.mode.send(mode);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    dir: Direction,
    generation: Arc<Mutex<u64>>,
    born: u64,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let current = *mode.borrow();
        let dropped = *generation.lock().unwrap_or_else(|p| p.into_inner()) != born;
        if dropped || current == Mode::Drop {
            return;
        }
        let flowing = match current {
            Mode::Blackhole => false,
            Mode::OneWay(d) => d == dir,
            _ => true,
        };
        if !flowing {
            // Hold everything until the mode changes; bytes stay unread in the
            // kernel, so nothing is lost — the link is only silent.
            if mode.changed().await.is_err() {
                return;
            }
            continue;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            changed = mode.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        let delay = match *mode.borrow() {
            Mode::Delay(ms) => Some(ms),
            _ => None,
        };
        if let Some(ms) = delay {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut b = [0u8; 1024];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    async fn round_trip(port: u16) -> Option<Vec<u8>> {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        s.write_all(b"ping").await.ok()?;
        let mut b = [0u8; 4];
        tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut b)).await.ok()?.ok()?;
        Some(b.to_vec())
    }

    #[tokio::test]
    async fn modes_cut_and_restore_the_link() {
        let target = echo_server().await;
        let proxy = Proxy::start(target).await.unwrap();
        assert_eq!(round_trip(proxy.port).await.as_deref(), Some(&b"ping"[..]));
        proxy.set(Mode::Blackhole);
        assert_eq!(round_trip(proxy.port).await, None);
        proxy.set(Mode::OneWay(Direction::Upstream));
        assert_eq!(round_trip(proxy.port).await, None, "replies are swallowed");
        proxy.set(Mode::Drop);
        assert_eq!(round_trip(proxy.port).await, None);
        proxy.set(Mode::Delay(20));
        assert_eq!(round_trip(proxy.port).await.as_deref(), Some(&b"ping"[..]));
        proxy.set(Mode::Pass);
        assert_eq!(round_trip(proxy.port).await.as_deref(), Some(&b"ping"[..]));
    }
}
