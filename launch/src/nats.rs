//! The one nats-server finder, and the configuration of a loopback server.
//!
//! [`find`] looks, in order, at the path the caller was given (a flag), at
//! `TENURE_NATS_SERVER`, at every `nats-server` on `PATH`, and at the
//! project's own install `.tools/nats/bin/nats-server` (under the current
//! directory and under the source tree this was built from), and takes the
//! first one at least [`MIN_VERSION`]. A path given explicitly (flag or
//! variable) is taken or refused, never skipped. When nothing fits, the
//! error says what was found, what is missing and how to get it.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Oldest nats-server accepted: older ones miss the JetStream features tenure
/// relies on (Debian's 2.9 cannot even serve current clients' KV requests).
pub const MIN_VERSION: (u32, u32) = (2, 11);

/// The variable naming the nats-server binary to use.
pub const ENV: &str = "TENURE_NATS_SERVER";

/// How to get a recent nats-server, for every message that needs one.
pub const INSTALL_HINT: &str = "run deploy/install-nats.sh, which installs nats-server 2.15.1 into .tools/nats/bin, \
or put nats-server >= 2.11 on PATH, or set TENURE_NATS_SERVER=/path/to/nats-server";

/// Why no nats-server can be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No candidate exists at all.
    #[error("no nats-server >= {}.{} found (looked in {looked}); {INSTALL_HINT}", MIN_VERSION.0, MIN_VERSION.1)]
    Missing { looked: String },
    /// Candidates exist, none recent enough (or readable).
    #[error("no nats-server >= {}.{} found: {found}; {INSTALL_HINT}", MIN_VERSION.0, MIN_VERSION.1)]
    TooOld { found: String },
    /// The path given explicitly cannot be used.
    #[error("nats-server {path} ({from}) {why}; {INSTALL_HINT}")]
    Given { path: PathBuf, from: &'static str, why: String },
}

/// Where to look, as read from the environment (so tests can pass their own).
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// A path given on the command line.
    pub explicit: Option<PathBuf>,
    /// `TENURE_NATS_SERVER`.
    pub env: Option<PathBuf>,
    /// `PATH`.
    pub path: Option<std::ffi::OsString>,
    /// Directories that may hold `.tools/nats/bin` (the current directory,
    /// the source tree).
    pub roots: Vec<PathBuf>,
}

impl Search {
    /// This process's environment, with `explicit` from a flag.
    pub fn from_env(explicit: Option<PathBuf>) -> Search {
        let mut roots: Vec<PathBuf> = std::env::current_dir().into_iter().collect();
        // The source tree this was built from (absent on an installed binary: harmless).
        if let Some(tree) = Path::new(env!("CARGO_MANIFEST_DIR")).parent() {
            roots.push(tree.to_path_buf());
        }
        Search {
            explicit,
            env: std::env::var_os(ENV).filter(|v| !v.is_empty()).map(PathBuf::from),
            path: std::env::var_os("PATH"),
            roots,
        }
    }
}

/// Finds a nats-server >= [`MIN_VERSION`] as [`Search::from_env`] says,
/// remembering the answer for the rest of the process (it is asked once
/// per test server).
pub fn find(explicit: Option<PathBuf>) -> Result<PathBuf, Error> {
    static FOUND: Mutex<Option<(Option<PathBuf>, PathBuf)>> = Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((asked, path)) = found.as_ref() {
        if *asked == explicit {
            return Ok(path.clone());
        }
    }
    let path = find_in(&Search::from_env(explicit.clone()), version_of)?;
    *found = Some((explicit, path.clone()));
    Ok(path)
}

/// The finder itself: `version` reads a binary's version (`None`: not a
/// nats-server that answers `--version`).
pub fn find_in(search: &Search, version: impl Fn(&Path) -> Option<(u32, u32)>) -> Result<PathBuf, Error> {
    let check = |path: &Path, from: &'static str| -> Result<PathBuf, Error> {
        let given = |why: String| Error::Given { path: path.to_path_buf(), from, why };
        if !path.is_file() {
            return Err(given("does not exist".into()));
        }
        match version(path) {
            Some(v) if v >= MIN_VERSION => Ok(path.to_path_buf()),
            Some((major, minor)) => Err(given(format!("is version {major}.{minor}, too old"))),
            None => Err(given("does not say its version (`--version`)".into())),
        }
    };
    if let Some(p) = &search.explicit {
        return check(p, "given on the command line");
    }
    if let Some(p) = &search.env {
        return check(p, "from TENURE_NATS_SERVER");
    }
    let on_path = search.path.iter().flat_map(std::env::split_paths).map(|d| d.join("nats-server"));
    let tools = search.roots.iter().map(|r| r.join(".tools/nats/bin/nats-server"));
    let mut too_old = Vec::new();
    for candidate in on_path.chain(tools) {
        if !candidate.is_file() {
            continue;
        }
        match version(&candidate) {
            Some(v) if v >= MIN_VERSION => return Ok(candidate),
            Some((major, minor)) => too_old.push(format!("{} is {major}.{minor}", candidate.display())),
            None => too_old.push(format!("{} does not say its version", candidate.display())),
        }
    }
    if too_old.is_empty() {
        let mut looked = vec!["PATH".to_owned()];
        looked.extend(search.roots.iter().map(|r| r.join(".tools/nats/bin").display().to_string()));
        return Err(Error::Missing { looked: looked.join(", ") });
    }
    Err(Error::TooOld { found: too_old.join(", ") })
}

/// `nats-server --version`, read.
pub fn version_of(path: &Path) -> Option<(u32, u32)> {
    let out = std::process::Command::new(path).arg("--version").output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// `nats-server: v2.15.1` → `(2, 15)`.
pub fn parse_version(text: &str) -> Option<(u32, u32)> {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The configuration of a single loopback nats-server with JetStream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub port: u16,
    /// JetStream's `store_dir`.
    pub store_dir: PathBuf,
    /// `sync_interval: always` (an acknowledged write is on disk, as in the
    /// shipped configurations); false keeps the server's default.
    pub sync_always: bool,
    /// A file to `include` (e.g. the `auth.conf` of `tenure nats-auth`),
    /// relative to the configuration file.
    pub include: Option<String>,
}

impl Config {
    /// On `port`, JetStream in `store_dir`, `sync_interval: always`, no include.
    pub fn new(port: u16, store_dir: impl Into<PathBuf>) -> Config {
        Config { port, store_dir: store_dir.into(), sync_always: true, include: None }
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The configuration file's text.
    pub fn render(&self) -> String {
        let mut text = format!("listen: \"127.0.0.1:{}\"\n", self.port);
        if let Some(include) = &self.include {
            text.push_str(&format!("include \"{include}\"\n"));
        }
        let sync = if self.sync_always { "  sync_interval: always\n" } else { "" };
        text.push_str(&format!("jetstream {{\n  store_dir: {:?}\n{sync}}}\n", self.store_dir.display().to_string()));
        text
    }

    /// Writes the configuration to `file`.
    pub fn write(&self, file: &Path) -> std::io::Result<()> {
        std::fs::write(file, self.render())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, "").unwrap();
        p
    }

    #[test]
    fn reads_nats_server_versions() {
        assert_eq!(parse_version("nats-server: v2.15.1\n"), Some((2, 15)));
        assert_eq!(parse_version("nats-server: v2.9.10"), Some((2, 9)));
        assert!(parse_version("garbage").is_none());
        assert!(parse_version("nats-server: v2.9.10") < Some(MIN_VERSION));
    }

    #[test]
    fn with_nothing_found_the_message_says_what_is_missing_and_how_to_get_it() {
        let empty = Search { path: Some("".into()), ..Search::default() };
        let e = find_in(&empty, |_| Some((2, 15))).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("no nats-server >= 2.11 found"), "{text}");
        assert!(text.contains("deploy/install-nats.sh"), "{text}");
        assert!(text.contains("2.15.1 into .tools/nats/bin"), "{text}");
        assert!(text.contains("PATH"), "{text}");
    }

    #[test]
    fn takes_the_first_recent_enough_and_skips_old_ones() {
        let d = tempfile::tempdir().unwrap();
        let old = fake(d.path(), "old/nats-server");
        let new = fake(d.path(), "new/nats-server");
        let tools = fake(d.path(), "root/.tools/nats/bin/nats-server");
        let version = |p: &Path| Some(if p.starts_with(d.path().join("old")) { (2, 9) } else { (2, 15) });
        let path = std::env::join_paths([d.path().join("old"), d.path().join("new")]).unwrap();
        let s = Search { path: Some(path), roots: vec![d.path().join("root")], ..Search::default() };
        assert_eq!(find_in(&s, version).unwrap(), new);
        // Only an old one on PATH: the project's install is next.
        let s = Search { path: Some(d.path().join("old").into()), roots: vec![d.path().join("root")], ..s };
        assert_eq!(find_in(&s, version).unwrap(), tools);
        // Only old ones: the message names them.
        let s = Search { roots: Vec::new(), ..s };
        let e = find_in(&s, version).unwrap_err();
        assert!(
            matches!(e, Error::TooOld { .. }) && e.to_string().contains(&format!("{} is 2.9", old.display())),
            "{e}"
        );
    }

    #[test]
    fn a_path_given_explicitly_is_taken_or_refused_never_skipped() {
        let d = tempfile::tempdir().unwrap();
        let given = fake(d.path(), "given/nats-server");
        let other = fake(d.path(), "other/nats-server");
        let s = Search { env: Some(given.clone()), path: Some(other.parent().unwrap().into()), ..Search::default() };
        assert_eq!(find_in(&s, |_| Some((2, 11))).unwrap(), given);
        let e = find_in(&s, |p: &Path| Some(if p == given { (2, 10) } else { (2, 15) })).unwrap_err();
        assert!(e.to_string().contains("from TENURE_NATS_SERVER) is version 2.10, too old"), "{e}");
        let flag = Search { explicit: Some(d.path().join("nowhere")), ..s };
        let e = find_in(&flag, |_| Some((2, 15))).unwrap_err();
        assert!(e.to_string().contains("(given on the command line) does not exist"), "{e}");
    }

    #[test]
    fn configurations_render_as_the_servers_expect() {
        let mut c = Config::new(4222, "/tmp/store");
        assert_eq!(
            c.render(),
            "listen: \"127.0.0.1:4222\"\njetstream {\n  store_dir: \"/tmp/store\"\n  sync_interval: always\n}\n"
        );
        c.sync_always = false;
        c.include = Some("creds/auth.conf".into());
        assert_eq!(
            c.render(),
            "listen: \"127.0.0.1:4222\"\ninclude \"creds/auth.conf\"\njetstream {\n  store_dir: \"/tmp/store\"\n}\n"
        );
        assert_eq!(c.url(), "nats://127.0.0.1:4222");
    }
}
