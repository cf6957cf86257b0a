//! How a tenure daemon is invoked, written once: `tenure --nats URL
//! coordinator --name NAME …`, `… sidecar --worker ID --data-dir DIR`,
//! `… worker --id ID --slots N --data-dir DIR …`, and where a machine's data
//! directory lies in a local cluster (`ROOT/workers/ID`). Each harness adds
//! its own flags (lease timings, heartbeats, `--run-as`) and its own NATS URL
//! per daemon (the chaos harness gives each node its own proxy).

use std::path::{Path, PathBuf};

/// A machine's data directory (shared by its worker and sidecar) in a local
/// cluster under `root`.
pub fn machine_dir(root: &Path, id: &str) -> PathBuf {
    root.join("workers").join(id)
}

/// One daemon's command line (after the program), built role by role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonArgs(Vec<String>);

impl DaemonArgs {
    /// `--nats URL coordinator --name NAME`.
    pub fn coordinator(nats_url: &str, name: &str) -> DaemonArgs {
        DaemonArgs::of(nats_url, &["coordinator", "--name", name])
    }

    /// `--nats URL sidecar --worker ID --data-dir DIR`.
    pub fn sidecar(nats_url: &str, id: &str, data_dir: &Path) -> DaemonArgs {
        DaemonArgs::of(nats_url, &["sidecar", "--worker", id, "--data-dir", &data_dir.display().to_string()])
    }

    /// `--nats URL worker --id ID --slots N --data-dir DIR`.
    pub fn worker(nats_url: &str, id: &str, slots: u32, data_dir: &Path) -> DaemonArgs {
        let (slots, dir) = (slots.to_string(), data_dir.display().to_string());
        DaemonArgs::of(nats_url, &["worker", "--id", id, "--slots", &slots, "--data-dir", &dir])
    }

    /// A command line as it is (the chaos harness edits one it copied).
    pub fn from_vec(args: Vec<String>) -> DaemonArgs {
        DaemonArgs(args)
    }

    fn of(nats_url: &str, args: &[&str]) -> DaemonArgs {
        let mut all = vec!["--nats".to_owned(), nats_url.to_owned()];
        all.extend(args.iter().map(|a| a.to_string()));
        DaemonArgs(all)
    }

    /// More flags, appended.
    pub fn flags<S: AsRef<str>>(mut self, flags: &[S]) -> DaemonArgs {
        self.0.extend(flags.iter().map(|f| f.as_ref().to_owned()));
        self
    }

    /// The arguments, in order.
    pub fn as_strs(&self) -> Vec<&str> {
        self.0.iter().map(String::as_str).collect()
    }

    /// The arguments, borrowed.
    pub fn as_slice(&self) -> &[String] {
        &self.0
    }

    pub fn into_vec(self) -> Vec<String> {
        self.0
    }
}

/// The subcommand of a `tenure` command line (`[--nats URL] SUBCOMMAND …`).
pub fn subcommand(args: &[String]) -> Option<&str> {
    let mut rest = args.iter().map(String::as_str);
    loop {
        match rest.next()? {
            "--nats" => {
                rest.next()?;
            }
            sub => return Some(sub),
        }
    }
}

/// The NATS user `tenure nats-auth` generates for the daemon of a `tenure`
/// command line: `coordinator-NAME`, `sidecar-ID`, `worker-ID`; `None` for
/// anything else (clients, the gateway, which acts as each caller).
pub fn nats_user(args: &[String]) -> Option<String> {
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
    match subcommand(args)? {
        "coordinator" => Some(format!("coordinator-{}", flag("--name").map_or("c1", String::as_str))),
        "sidecar" => flag("--worker").map(|id| format!("sidecar-{id}")),
        "worker" => flag("--id").map(|id| format!("worker-{id}")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_are_as_the_cli_parses_them() {
        let d = machine_dir(Path::new("/c"), "w1");
        assert_eq!(d, Path::new("/c/workers/w1"));
        let url = "nats://127.0.0.1:1";
        assert_eq!(
            DaemonArgs::coordinator(url, "c1").flags(&["--lease-ttl-ms", "2000"]).as_strs(),
            ["--nats", url, "coordinator", "--name", "c1", "--lease-ttl-ms", "2000"]
        );
        assert_eq!(
            DaemonArgs::sidecar(url, "w1", &d).as_strs(),
            ["--nats", url, "sidecar", "--worker", "w1", "--data-dir", "/c/workers/w1"]
        );
        assert_eq!(
            DaemonArgs::worker(url, "w1", 4, &d).flags(&["--heartbeat-ms".to_owned(), "300".to_owned()]).into_vec(),
            [
                "--nats",
                url,
                "worker",
                "--id",
                "w1",
                "--slots",
                "4",
                "--data-dir",
                "/c/workers/w1",
                "--heartbeat-ms",
                "300"
            ]
        );
    }

    #[test]
    fn each_daemon_has_its_nats_user() {
        let d = Path::new("/c/workers/w2");
        let url = "nats://127.0.0.1:1";
        let user = |a: DaemonArgs| nats_user(&a.into_vec());
        assert_eq!(user(DaemonArgs::coordinator(url, "c2")).as_deref(), Some("coordinator-c2"));
        assert_eq!(user(DaemonArgs::sidecar(url, "w2", d)).as_deref(), Some("sidecar-w2"));
        assert_eq!(user(DaemonArgs::worker(url, "w2", 1, d)).as_deref(), Some("worker-w2"));
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(nats_user(&args(&["coordinator"])).as_deref(), Some("coordinator-c1"), "the default name");
        assert_eq!(nats_user(&args(&["--nats", url, "gateway", "--listen", "x"])), None);
        assert_eq!(nats_user(&args(&["--nats"])), None);
        assert_eq!(subcommand(&args(&["--nats", url, "worker"])), Some("worker"));
    }
}
