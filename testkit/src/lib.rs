//! Test support shared by the integration tests: a real `nats-server` with
//! JetStream on a free loopback port and its own store directory, stopped (by its
//! pid, which this kit started) when the handle drops; the same from a shipped
//! configuration file (users, permissions), or a whole 3-node cluster from the
//! shipped cluster configurations, every port moved to a free loopback one;
//! plus `eventually`, the bounded condition wait every test uses instead of
//! sleeping.
//!
//! Never used by the daemons themselves.
//!
//! [`cluster`] is the one local-cluster harness of the tests: these servers
//! and the real `tenure` daemons, started and stopped by their pids through
//! `tenure-launch` (which `tenure dev`, the bench and the chaos harness use
//! too).

pub mod cluster;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tenure_launch::process::Process;

use anyhow::{bail, Context};

/// A running nats-server owned by one test.
pub struct NatsServer {
    process: Process,
    pub port: u16,
    pub url: String,
    /// The HTTP monitoring port, when the configuration has one.
    pub http_port: Option<u16>,
    store: tempfile::TempDir,
    /// Started by [`NatsServer::start`] (its configuration is the kit's own).
    plain: bool,
}

/// The nats-server the tests run: [`tenure_launch::nats::find`] (the one
/// finder: `TENURE_NATS_SERVER`, `PATH`, the project's `.tools/nats/bin`,
/// at least 2.11). Panics with what is missing and how to get it.
pub fn nats_server_binary() -> PathBuf {
    tenure_launch::nats::find(None).unwrap_or_else(|e| panic!("{e}"))
}

/// A free TCP port on 127.0.0.1 (bound and released; good enough for tests).
pub fn free_port() -> u16 {
    tenure_launch::free_port().expect("free port")
}

impl NatsServer {
    /// Starts nats-server with JetStream and waits until it accepts connections.
    pub fn start() -> anyhow::Result<NatsServer> {
        Self::start_on(free_port())
    }

    /// Starts on a given port (to restart a server where clients expect it).
    pub fn start_on(port: u16) -> anyhow::Result<NatsServer> {
        let store = tempfile::tempdir()?;
        let process = Self::spawn_plain(port, store.path(), None)?;
        let url = format!("nats://127.0.0.1:{port}");
        let server = NatsServer { process, port, url, http_port: None, store, plain: true };
        server.wait_listening()?;
        Ok(server)
    }

    /// Like [`NatsServer::start`], with the JetStream data in `jetstream`
    /// (e.g. on a filesystem a test can cut the power of) and, when
    /// `sync_always` is false, the server's default `sync_interval` instead
    /// of `always`. [`NatsServer::restart`] keeps both.
    pub fn start_with_jetstream(jetstream: &Path, sync_always: bool) -> anyhow::Result<NatsServer> {
        let port = free_port();
        let store = tempfile::tempdir()?;
        let process = Self::spawn_plain(port, store.path(), Some((jetstream.to_path_buf(), sync_always)))?;
        let url = format!("nats://127.0.0.1:{port}");
        let server = NatsServer { process, port, url, http_port: None, store, plain: true };
        server.wait_listening()?;
        Ok(server)
    }

    /// JetStream with `sync_interval: always`, as the shipped configurations
    /// and `tenure dev` run it: an acknowledged write is on disk, so a test
    /// that kills the server loses nothing it was told was stored.
    fn spawn_plain(port: u16, store: &Path, jetstream: Option<(PathBuf, bool)>) -> anyhow::Result<Process> {
        let conf = store.join("nats.conf");
        let (dir, always) = jetstream.unwrap_or_else(|| (store.join("jetstream"), true));
        tenure_launch::nats::Config { sync_always: always, ..tenure_launch::nats::Config::new(port, dir) }
            .write(&conf)?;
        Self::spawn(&conf, store, &[])
    }

    /// nats-server with `conf`, its output in `STORE/nats.log`.
    fn spawn(conf: &Path, store: &Path, env: &[(&str, &str)]) -> anyhow::Result<Process> {
        let conf = conf.display().to_string();
        let mut process =
            Process::new("nats", &tenure_launch::nats::find(None)?, &["-c", &conf], &store.join("nats.log"));
        for (k, v) in env {
            process.set_env(k, v);
        }
        process.start()?;
        Ok(process)
    }

    /// SIGKILLs the server and starts it again on the same port and store
    /// (only for servers started by [`NatsServer::start`]); waits until it
    /// accepts connections.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        if !self.plain {
            bail!("only a server started by NatsServer::start can be restarted by the kit");
        }
        self.kill9();
        self.process.start()?;
        self.wait_listening()
    }

    /// The server's store directory (JetStream data under `jetstream/`).
    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// Starts nats-server from a shipped configuration file: every
    /// `127.0.0.1:PORT` in it moved to a free port, `store_dir` to a directory
    /// of its own, the files it includes copied next to it from `includes`
    /// (e.g. the `auth.conf` that `tenure nats-auth` generated), `env` set, its
    /// log in [`NatsServer::log`]. Waits until it accepts connections.
    pub fn start_from_config(config: &Path, includes: &Path, env: &[(&str, &str)]) -> anyhow::Result<NatsServer> {
        let mut ports = PortMap::default();
        Self::spawn_config(config, includes, &mut ports, env)?.wait_listening_then()
    }

    fn spawn_config(
        config: &Path,
        includes: &Path,
        ports: &mut PortMap,
        env: &[(&str, &str)],
    ) -> anyhow::Result<NatsServer> {
        let text = std::fs::read_to_string(config).with_context(|| format!("reading {}", config.display()))?;
        let store = tempfile::tempdir()?;
        let (text, listen, http) = rewrite_config(&text, ports, &store.path().join("jetstream"));
        for line in text.lines() {
            if let Some(name) = line.trim().strip_prefix("include ") {
                let name = name.trim().trim_matches('"');
                // Ports in it (e.g. the routes of `routes.conf`) move with the rest.
                let included =
                    std::fs::read_to_string(includes.join(name)).with_context(|| format!("reading included {name}"))?;
                let (included, _, _) = rewrite_config(&included, ports, &store.path().join("jetstream"));
                std::fs::write(store.path().join(name), included)
                    .with_context(|| format!("copying included {name}"))?;
            }
        }
        let conf = store.path().join("nats.conf");
        std::fs::write(&conf, text)?;
        let port = listen.with_context(|| format!("{} has no listen address", config.display()))?;
        let process = Self::spawn(&conf, store.path(), env)?;
        Ok(NatsServer { process, port, url: format!("nats://127.0.0.1:{port}"), http_port: http, store, plain: false })
    }

    fn wait_listening_then(self) -> anyhow::Result<NatsServer> {
        self.wait_listening()?;
        Ok(self)
    }

    fn wait_listening(&self) -> anyhow::Result<()> {
        let port = self.port;
        let ready = eventually(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok().then_some(())
        });
        if ready.is_none() {
            bail!("nats-server did not listen on port {port} within 20s:\n{}", self.log());
        }
        Ok(())
    }

    /// The server's pid (this kit started it).
    pub fn pid(&self) -> u32 {
        self.process.last_pid().unwrap_or_default() as u32
    }

    /// SIGKILLs the server and reaps it; its store stays.
    pub fn kill9(&mut self) {
        self.process.kill9();
    }

    /// What the server logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.store.path().join("nats.log")).unwrap_or_default()
    }

    /// `GET /healthz` on the HTTP monitoring port answered 200: the server is up and
    /// its JetStream is current (in a cluster: it follows a meta leader).
    pub fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Some(port) = self.http_port else { return false };
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_err() {
            return false;
        }
        let mut reply = String::new();
        let _ = s.read_to_string(&mut reply);
        reply.starts_with("HTTP/1.0 200") || reply.starts_with("HTTP/1.1 200")
    }
}

/// Several nats-server nodes forming one cluster (or a single node), with the
/// URL list a tenure process is given (`--nats a,b,c`).
pub struct NatsCluster {
    pub nodes: Vec<NatsServer>,
    /// Every node's client URL, comma-separated.
    pub url: String,
}

impl NatsCluster {
    /// One node as a "cluster" of one.
    pub fn single(server: NatsServer) -> NatsCluster {
        let url = server.url.clone();
        NatsCluster { nodes: vec![server], url }
    }

    /// Starts one node per shipped configuration (e.g. `deploy/nats/cluster-{1,2,3}.conf`),
    /// with every loopback port moved to a free one consistently across the
    /// files (so the routes still name each other), and waits until every node
    /// reports JetStream healthy.
    pub fn start_from_configs(
        configs: &[PathBuf],
        includes: &Path,
        env: &[(&str, &str)],
    ) -> anyhow::Result<NatsCluster> {
        let mut ports = PortMap::default();
        let mut nodes = Vec::new();
        for config in configs {
            nodes.push(NatsServer::spawn_config(config, includes, &mut ports, env)?);
        }
        for node in &nodes {
            node.wait_listening()?;
        }
        let healthy = eventually(Duration::from_secs(30), || nodes.iter().all(NatsServer::healthy).then_some(()));
        if healthy.is_none() {
            let logs: String = nodes.iter().map(|n| format!("---- nats {} ----\n{}", n.port, n.log())).collect();
            bail!("the NATS cluster did not become healthy within 30s:\n{logs}");
        }
        let url = nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>().join(",");
        Ok(NatsCluster { nodes, url })
    }

    /// Every node's log, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes.iter().map(|n| format!("---- nats {} ----\n{}", n.port, n.log())).collect()
    }
}

/// Original port → free port, shared by the files of one cluster. Each
/// original gets a port of its own: the kernel may hand out the same free
/// port twice when nothing holds it between two asks (two nodes then
/// fought over one port, and the cluster never formed).
#[derive(Default)]
struct PortMap(std::collections::HashMap<u16, u16>);

impl PortMap {
    fn get(&mut self, original: u16) -> u16 {
        if let Some(&port) = self.0.get(&original) {
            return port;
        }
        let port = std::iter::repeat_with(free_port)
            .find(|p| !self.0.values().any(|taken| taken == p))
            .expect("an endless supply of free ports");
        self.0.insert(original, port);
        port
    }
}

/// Moves every `127.0.0.1:PORT` to a free port and `store_dir` to `store`;
/// returns the text, the client port (`listen`) and the HTTP monitoring port (`http`).
fn rewrite_config(text: &str, ports: &mut PortMap, store: &Path) -> (String, Option<u16>, Option<u16>) {
    const HOST: &str = "127.0.0.1:";
    let (mut listen, mut http) = (None, None);
    let mut out = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("store_dir") {
            out.push_str(&format!("  store_dir: \"{}\"\n", store.display()));
            continue;
        }
        let mut rest = line;
        let mut new = String::new();
        while let Some(i) = rest.find(HOST) {
            let after = &rest[i + HOST.len()..];
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            new.push_str(&rest[..i + HOST.len()]);
            match after[..digits].parse::<u16>() {
                Ok(original) => {
                    let port = ports.get(original);
                    if trimmed.starts_with("listen") && !line.starts_with(' ') && !line.starts_with('\t') {
                        listen = Some(port);
                    }
                    if trimmed.starts_with("http") {
                        http = Some(port);
                    }
                    new.push_str(&port.to_string());
                }
                Err(_) => new.push_str(&after[..digits]),
            }
            rest = &after[digits..];
        }
        new.push_str(rest);
        out.push_str(&new);
        out.push('\n');
    }
    (out, listen, http)
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

/// Live (non-zombie) processes, other than `me`, whose working directory or an
/// open file lies under `dir`.
pub fn processes_using(dir: &Path, me: i32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if pid == me {
            continue;
        }
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|t| t.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
            .unwrap_or(true);
        if zombie {
            continue;
        }
        let under = |p: PathBuf| p.starts_with(dir);
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(under);
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(under));
        if cwd || fds {
            found.push(pid);
        }
    }
    found
}

pub use tenure_launch::cluster::remove_groups_named;
