//! How to reach NATS: server URLs, credentials and TLS, as one plain struct that
//! the command line fills today and a `[nats]` table of a configuration file
//! can fill later.
//!
//! It owns validation: a combination that cannot work (a certificate without
//! its key, two kinds of credentials, an unreadable file) is refused before any
//! connection is attempted, naming the option. It never prints a secret:
//! passwords and tokens are [`Secret`]s, whose `Debug` is `***`.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The server tried when no URL is configured.
pub const DEFAULT_SERVER: &str = "nats://127.0.0.1:4222";

/// Connection options shared by every tenure process.
///
/// All fields are optional; the default connects to [`DEFAULT_SERVER`] without
/// credentials and uses TLS only if the server asks for it. At most one kind of
/// credentials may be set: `user` + `password`, `token`, `nkey` or `creds`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsOptions {
    /// Server URLs (`nats://host:port`, `tls://host:port`), all nodes of one
    /// NATS cluster. The client connects to one of them and fails over to the
    /// others (and to the nodes the server announces) when it goes away; listing
    /// every node lets a process start while any one of them is down.
    /// Empty means [`DEFAULT_SERVER`]. CLI: `--nats URL[,URL…]`, `TENURE_NATS`.
    pub servers: Vec<String>,
    /// User name, with `password`. CLI: `--nats-user`, `TENURE_NATS_USER`.
    pub user: Option<String>,
    /// Password of `user`. CLI: `--nats-password`, `TENURE_NATS_PASSWORD`
    /// (prefer the environment: arguments are visible in `ps`).
    pub password: Option<Secret>,
    /// Authentication token. CLI: environment only, `TENURE_NATS_TOKEN`.
    pub token: Option<Secret>,
    /// File holding an nkey user seed (`SU…`), mode 0600. CLI: `--nats-nkey`,
    /// `TENURE_NATS_NKEY`.
    pub nkey: Option<PathBuf>,
    /// A `.creds` file (user JWT and nkey seed, decentralized authentication).
    /// CLI: `--nats-creds`, `TENURE_NATS_CREDS`.
    pub creds: Option<PathBuf>,
    /// PEM file of the certificate authorities that sign the servers'
    /// certificates (instead of the system roots). CLI: `--nats-tls-ca`,
    /// `TENURE_NATS_TLS_CA`.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS, with `tls_key`. CLI:
    /// `--nats-tls-cert`, `TENURE_NATS_TLS_CERT`.
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`. CLI: `--nats-tls-key`, `TENURE_NATS_TLS_KEY`.
    pub tls_key: Option<PathBuf>,
    /// Refuse to talk to a server without TLS. CLI: `--nats-tls-required`,
    /// `TENURE_NATS_TLS_REQUIRED=true`.
    pub tls_required: bool,
}

/// A password or token: its `Debug` and `Display` print `***`.
///
/// Serialization writes the value itself (a configuration written back must
/// keep it); never serialize options into logs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value, for handing to the NATS client only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Secret {
        Secret(value)
    }
}

/// One invalid option: which one (its field and command-line flag) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid NATS option {flag} (nats.{field}): {reason}")]
pub struct InvalidOption {
    /// The field of [`NatsOptions`].
    pub field: &'static str,
    /// The command-line flag (or environment variable) that sets it.
    pub flag: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, flag: &'static str, reason: impl Into<String>) -> InvalidOption {
    InvalidOption { field, flag, reason: reason.into() }
}

impl NatsOptions {
    /// Options for one server without credentials (tests, development).
    pub fn url(url: impl Into<String>) -> NatsOptions {
        NatsOptions { servers: vec![url.into()], ..Default::default() }
    }

    /// The URLs to try: the configured ones, or [`DEFAULT_SERVER`].
    pub fn server_list(&self) -> Vec<String> {
        if self.servers.is_empty() {
            vec![DEFAULT_SERVER.to_owned()]
        } else {
            self.servers.clone()
        }
    }

    /// The prefix of this connection's reply subjects: `_INBOX_<user>` for a
    /// named user (the shipped account layout lets each user subscribe to its
    /// own prefix only, so no one reads another's replies), NATS's `_INBOX`
    /// otherwise. A user name that is not one subject token keeps `_INBOX`.
    pub fn inbox_prefix(&self) -> String {
        match &self.user {
            Some(u)
                if !u.is_empty() && u.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'-')) =>
            {
                format!("_INBOX_{u}")
            }
            _ => "_INBOX".to_owned(),
        }
    }

    /// The servers as one string for messages (`a,b,c`).
    pub fn servers_display(&self) -> String {
        self.server_list().join(",")
    }

    /// Checks that the options can work: URLs parse, credentials are of one
    /// kind and complete, every named file is readable, a client certificate
    /// comes with its key. Reads the files (small) but connects to nothing.
    pub fn validate(&self) -> Result<(), InvalidOption> {
        for url in &self.servers {
            let url = url.trim();
            if url.is_empty() {
                return Err(invalid("servers", "--nats", "empty server URL in the list"));
            }
            url.parse::<async_nats::ServerAddr>()
                .map_err(|e| invalid("servers", "--nats", format!("{url:?} is not a NATS URL: {e}")))?;
        }
        match (&self.user, &self.password) {
            (Some(_), None) => return Err(invalid("password", "--nats-password", "--nats-user needs a password")),
            (None, Some(_)) => return Err(invalid("user", "--nats-user", "--nats-password needs a user")),
            (Some(u), Some(_)) if u.is_empty() => return Err(invalid("user", "--nats-user", "empty user name")),
            _ => {}
        }
        let kinds = [
            ("--nats-user/--nats-password", self.user.is_some()),
            ("TENURE_NATS_TOKEN", self.token.is_some()),
            ("--nats-nkey", self.nkey.is_some()),
            ("--nats-creds", self.creds.is_some()),
        ];
        let set: Vec<&str> = kinds.iter().filter(|(_, on)| *on).map(|(name, _)| *name).collect();
        if set.len() > 1 {
            return Err(invalid(
                "creds",
                "--nats-creds",
                format!("use one kind of NATS credentials, not {}", set.join(" and ")),
            ));
        }
        if self.token.as_ref().is_some_and(|t| t.expose().is_empty()) {
            return Err(invalid("token", "TENURE_NATS_TOKEN", "empty token"));
        }
        if let Some(path) = &self.nkey {
            let seed = read_text("nkey", "--nats-nkey", path)?;
            if !seed.trim().starts_with("SU") {
                return Err(invalid(
                    "nkey",
                    "--nats-nkey",
                    format!("{} does not hold an nkey user seed (a line starting with SU)", path.display()),
                ));
            }
        }
        if let Some(path) = &self.creds {
            let creds = read_text("creds", "--nats-creds", path)?;
            if !creds.contains("BEGIN NATS USER JWT") || !creds.contains("BEGIN USER NKEY SEED") {
                return Err(invalid(
                    "creds",
                    "--nats-creds",
                    format!("{} is not a NATS credentials file (user JWT and nkey seed)", path.display()),
                ));
            }
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return Err(invalid("tls_key", "--nats-tls-key", "--nats-tls-cert needs its private key"))
            }
            (None, Some(_)) => {
                return Err(invalid("tls_cert", "--nats-tls-cert", "--nats-tls-key needs its certificate"))
            }
            _ => {}
        }
        for (field, flag, path) in [
            ("tls_ca", "--nats-tls-ca", &self.tls_ca),
            ("tls_cert", "--nats-tls-cert", &self.tls_cert),
            ("tls_key", "--nats-tls-key", &self.tls_key),
        ] {
            if let Some(path) = path {
                let pem = read_text(field, flag, path)?;
                if !pem.contains("-----BEGIN ") {
                    return Err(invalid(field, flag, format!("{} is not a PEM file", path.display())));
                }
            }
        }
        Ok(())
    }

    /// The first server URL with any user:password part removed, for logs.
    pub fn redacted_servers(&self) -> String {
        self.server_list()
            .iter()
            .map(|u| match (u.find("://"), u.rfind('@')) {
                (Some(scheme), Some(at)) if at > scheme => format!("{}***@{}", &u[..scheme + 3], &u[at + 1..]),
                _ => u.clone(),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn read_text(field: &'static str, flag: &'static str, path: &Path) -> Result<String, InvalidOption> {
    std::fs::read_to_string(path).map_err(|e| invalid(field, flag, format!("cannot read {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &tempfile::TempDir, name: &str, text: &str) -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn named_users_get_their_own_inbox_prefix() {
        let mut o = NatsOptions::default();
        assert_eq!(o.inbox_prefix(), "_INBOX");
        o.user = Some("alice".into());
        assert_eq!(o.inbox_prefix(), "_INBOX_alice");
        o.user = Some("a.b".into());
        assert_eq!(o.inbox_prefix(), "_INBOX");
    }

    #[test]
    fn secrets_never_show_in_debug() {
        let o = NatsOptions {
            user: Some("tenure-client".into()),
            password: Some(Secret::new("hunter2-password")),
            token: Some(Secret::new("tok-secret")),
            ..Default::default()
        };
        let shown = format!("{o:?} {o:#?}");
        assert!(!shown.contains("hunter2") && !shown.contains("tok-secret"), "{shown}");
        assert!(shown.contains("***"));
    }

    #[test]
    fn default_connects_to_the_local_server() {
        let o = NatsOptions::default();
        assert_eq!(o.server_list(), vec![DEFAULT_SERVER.to_owned()]);
        assert_eq!(o.validate(), Ok(()));
    }

    #[test]
    fn deserializes_as_a_table_and_refuses_unknown_fields() {
        let o: NatsOptions = serde_json::from_str(
            r#"{"servers":["nats://a:4222","nats://b:4222"],"user":"u","password":"p","tls_required":true}"#,
        )
        .unwrap();
        assert_eq!(o.servers.len(), 2);
        assert_eq!(o.password.as_ref().map(Secret::expose), Some("p"));
        assert!(o.tls_required);
        assert!(serde_json::from_str::<NatsOptions>(r#"{"pasword":"p"}"#).is_err());
    }

    #[test]
    fn invalid_combinations_name_the_option() {
        let dir = tempfile::tempdir().unwrap();
        let pem = file(&dir, "c.pem", "-----BEGIN CERTIFICATE-----\n");
        let cases: Vec<(NatsOptions, &str)> = vec![
            (NatsOptions { tls_cert: Some(pem.clone()), ..Default::default() }, "--nats-tls-key"),
            (NatsOptions { tls_key: Some(pem.clone()), ..Default::default() }, "--nats-tls-cert"),
            (NatsOptions { tls_ca: Some(dir.path().join("absent.pem")), ..Default::default() }, "--nats-tls-ca"),
            (NatsOptions { user: Some("u".into()), ..Default::default() }, "--nats-password"),
            (NatsOptions { password: Some(Secret::new("p")), ..Default::default() }, "--nats-user"),
            (NatsOptions { nkey: Some(file(&dir, "seed", "not a seed")), ..Default::default() }, "--nats-nkey"),
            (NatsOptions { creds: Some(dir.path().join("absent.creds")), ..Default::default() }, "--nats-creds"),
            (NatsOptions { servers: vec!["nats://a:1".into(), " ".into()], ..Default::default() }, "--nats"),
            (
                NatsOptions {
                    token: Some(Secret::new("t")),
                    creds: Some(file(&dir, "x.creds", "")),
                    ..Default::default()
                },
                "not TENURE_NATS_TOKEN and --nats-creds",
            ),
        ];
        for (o, expected) in cases {
            let e = o.validate().expect_err(expected).to_string();
            assert!(e.contains(expected), "{e:?} should name {expected}");
        }
        let ok = NatsOptions {
            tls_ca: Some(pem.clone()),
            tls_cert: Some(pem.clone()),
            tls_key: Some(pem),
            nkey: Some(file(&dir, "ok.seed", "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4\n")),
            ..Default::default()
        };
        assert_eq!(ok.validate(), Ok(()));
    }

    #[test]
    fn urls_with_credentials_are_redacted_for_logs() {
        let o = NatsOptions::url("nats://u:p@host:4222");
        assert_eq!(o.redacted_servers(), "nats://***@host:4222");
    }
}
