//! `tenure nats-auth`: the NATS users and permissions of a tenure cluster, as a
//! nats-server configuration file (`auth.conf`, included by the shipped
//! `deploy/nats/*.conf`) and one credentials file per identity.
//!
//! The layout (see `docs/security.md`):
//!
//! - **Account `TENURE`** holds JetStream (registry, lease, notices) and the
//!   daemons. Each coordinator, each machine's worker and each machine's
//!   sidecar is its own user, allowed exactly the subjects of its role *and
//!   its machine*: worker `w1` publishes heartbeats and reports only on
//!   `….w1` subjects and reads only `tenure.worker.w1.>`; sidecar `w1`
//!   serves only `tenure.sidecar.w1.*` and publishes nothing but answers.
//!   Every user reads replies only under its own inbox prefix.
//! - **Account `CLIENTS`** holds the people and programs that use the cluster,
//!   without JetStream. It reaches the client API, output reads and agent input
//!   only through service imports shared with `share: true`, so the daemons
//!   learn from the server who called, and an answer can only ever go back to
//!   the caller's account. A client subscribes only to its own inbox prefix.
//!
//! Passwords are random (256 bits) and stored in `auth.conf` only as bcrypt
//! hashes; running the command again keeps the passwords of identities that
//! already have a credentials file, so machines can be added one by one.
//! This module renders text and writes files; it never connects to anything.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tenure_protocol::{subjects, SessionId, WorkerId};

/// The account of the daemons and JetStream.
pub const DAEMON_ACCOUNT: &str = "TENURE";
/// The account of the cluster's users.
pub const CLIENT_ACCOUNT: &str = "CLIENTS";
/// The included file the shipped server configurations expect.
pub const AUTH_FILE: &str = "auth.conf";
/// The file the `cluster { }` block of a clustered node includes.
pub const ROUTES_FILE: &str = "routes.conf";
/// The file a node includes to serve clients over TLS.
pub const TLS_FILE: &str = "tls.conf";
/// The certificate authority clients trust (`--nats-tls-ca`).
pub const CA_FILE: &str = "ca.pem";
/// The user the nodes of a NATS cluster route to each other as.
const ROUTE_USER: &str = "route";

/// bcrypt cost of the stored hashes. The passwords are 256 random bits, so the
/// hash only keeps them out of the file in clear; a low cost keeps every
/// connection (one per CLI command) cheap for the server.
const BCRYPT_COST: u32 = 4;

/// What one identity is allowed to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Coordinator,
    Worker(WorkerId),
    Sidecar(WorkerId),
    Client,
}

impl Role {
    pub fn name(&self) -> &'static str {
        match self {
            Role::Coordinator => "coordinator",
            Role::Worker(_) => "worker",
            Role::Sidecar(_) => "sidecar",
            Role::Client => "client",
        }
    }
}

/// One NATS user of the layout.
#[derive(Debug, Clone)]
pub struct Identity {
    pub user: String,
    pub role: Role,
    pub password: String,
}

impl Identity {
    /// Where its credentials file is written in `dir`.
    pub fn env_file(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.env", self.user))
    }
}

/// Whom to create users for.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Coordinator names; each gets the user `coordinator-<name>`.
    pub coordinators: Vec<String>,
    /// Worker machine ids; each gets `worker-<id>` and `sidecar-<id>`.
    pub machines: Vec<WorkerId>,
    /// Users of the clients' account (people, CI systems, agent harnesses);
    /// operators are among them (their role is the coordinators' `operators`).
    pub users: Vec<String>,
    /// The route addresses (`host:port`) of the nodes of a NATS cluster: when
    /// given, `routes.conf` makes the nodes authenticate each other.
    pub routes: Vec<String>,
    /// Names and addresses the NATS servers are reached by: when given, a CA
    /// and a server certificate for them, and `tls.conf`.
    pub tls_hosts: Vec<String>,
}

impl Plan {
    /// The users of the layout and their roles, validated: every name must be
    /// a valid identity and no two may be equal.
    pub fn roles(&self) -> anyhow::Result<Vec<(String, Role)>> {
        let mut out = Vec::new();
        for c in &self.coordinators {
            out.push((format!("coordinator-{c}"), Role::Coordinator));
        }
        for m in &self.machines {
            out.push((format!("worker-{m}"), Role::Worker(m.clone())));
            out.push((format!("sidecar-{m}"), Role::Sidecar(m.clone())));
        }
        for u in &self.users {
            out.push((u.clone(), Role::Client));
        }
        let label: SessionId = "x".parse()?;
        let mut seen = BTreeSet::new();
        for (user, _) in &out {
            SessionId::scoped(user, &label).with_context(|| format!("user name {user:?}"))?;
            if !seen.insert(user.as_str()) {
                bail!("user {user:?} appears twice (a client named like a daemon user?)");
            }
        }
        if out.is_empty() {
            bail!("nothing to generate: name coordinators, machines or users");
        }
        Ok(out)
    }
}

/// The permissions block of `role` for `user`.
fn permissions(user: &str, role: &Role) -> String {
    let inbox = format!("_INBOX_{user}.>");
    let list = |items: &[String]| items.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
    let (publish, subscribe, responses) = match role {
        Role::Coordinator => (
            list(&[
                "tenure.worker.>".into(),
                "tenure.sidecar.*.evidence".into(),
                "tenure.sidecar.*.cleanup".into(),
                subjects::EPOCH_ANNOUNCE.into(),
                subjects::COORD_PRESENCE.into(),
                subjects::REGISTRY_ALL.into(),
                subjects::NOTICES_ALL.into(),
                format!("$KV.{}.>", subjects::LEADER_BUCKET),
                "$JS.API.>".into(),
                format!("$JS.ACK.{}.>", subjects::NOTICES_STREAM),
            ]),
            list(&[
                subjects::API.into(),
                subjects::HEARTBEAT_ALL.into(),
                subjects::REPORT_ALL.into(),
                subjects::COORD_PRESENCE.into(),
                inbox,
            ]),
            true,
        ),
        Role::Worker(w) => (
            list(&[subjects::heartbeat(w), subjects::report(w)]),
            list(&[subjects::worker_all(w), subjects::EPOCH_ANNOUNCE.into(), inbox]),
            true,
        ),
        Role::Sidecar(w) => (
            String::new(),
            list(&[subjects::output(w), subjects::input(w), subjects::evidence(w), subjects::cleanup(w)]),
            true,
        ),
        Role::Client => (
            list(&[subjects::API.into(), "tenure.sidecar.*.output".into(), "tenure.sidecar.*.input".into()]),
            list(&[inbox]),
            false,
        ),
    };
    let publish = if publish.is_empty() { "deny: [\">\"]".to_owned() } else { format!("allow: [{publish}]") };
    let responses = if responses { ", allow_responses: true" } else { "" };
    format!("{{ publish: {{ {publish} }}, subscribe: {{ allow: [{subscribe}] }}{responses} }}")
}

/// The `accounts` block of the server configuration, with `hash` applied to
/// each password (pure: tests pass the identity function).
pub fn render(identities: &[Identity], hash: impl Fn(&str) -> anyhow::Result<String>) -> anyhow::Result<String> {
    let mut daemons = String::new();
    let mut clients = String::new();
    for id in identities {
        let line = format!(
            "      {{ user: \"{}\", password: \"{}\", permissions: {} }}\n",
            id.user,
            hash(&id.password)?,
            permissions(&id.user, &id.role)
        );
        match id.role {
            Role::Client => clients.push_str(&line),
            _ => daemons.push_str(&line),
        }
    }
    let services = [subjects::API, "tenure.sidecar.*.output", "tenure.sidecar.*.input"];
    let exports: String = services.iter().map(|s| format!("      {{ service: \"{s}\" }}\n")).collect();
    let imports: String = services
        .iter()
        .map(|s| format!("      {{ service: {{ account: {DAEMON_ACCOUNT}, subject: \"{s}\" }}, share: true }}\n"))
        .collect();
    Ok(format!(
        "# Generated by `tenure nats-auth`: the users and permissions of a tenure cluster.\n\
         # Every node of a NATS cluster includes the same file. Regenerate it (the\n\
         # command keeps existing passwords) to add machines or users; never edit a\n\
         # permission by hand without reading docs/security.md.\n\
         accounts {{\n  \
           {DAEMON_ACCOUNT}: {{\n    \
             jetstream: enabled\n    \
             users: [\n{daemons}    ]\n    \
             exports: [\n{exports}    ]\n  \
           }}\n  \
           {CLIENT_ACCOUNT}: {{\n    \
             users: [\n{clients}    ]\n    \
             imports: [\n{imports}    ]\n  \
           }}\n\
         }}\n"
    ))
}

/// The body of a clustered node's `cluster { }` block: who may route to it,
/// and the routes it opens with the same credentials (so this file holds the
/// route password in clear: it stays 0600, readable by nats-server only).
pub fn render_routes(
    routes: &[String],
    password: &str,
    hash: impl Fn(&str) -> anyhow::Result<String>,
) -> anyhow::Result<String> {
    let mut urls = String::new();
    for r in routes {
        let ok = r.rsplit_once(':').is_some_and(|(h, p)| {
            !h.is_empty()
                && h.bytes().all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b))
                && p.parse::<u16>().is_ok()
        });
        if !ok {
            bail!("route {r:?}: expected host:port");
        }
        urls.push_str(&format!("  \"nats-route://{ROUTE_USER}:{password}@{r}\"\n"));
    }
    Ok(format!(
        "# Generated by `tenure nats-auth`: included in the cluster {{ }} block of every\n\
         # node. The nodes authenticate each other as `{ROUTE_USER}`.\n\
         authorization {{ user: \"{ROUTE_USER}\", password: \"{}\" }}\n\
         routes: [\n{urls}]\n",
        hash(password)?
    ))
}

/// The distinguished name of the generated CA: fixed, so that a kept CA key
/// can sign again without parsing the CA certificate.
fn ca_params() -> anyhow::Result<rcgen::CertificateParams> {
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(rcgen::DnType::CommonName, "tenure NATS CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    Ok(params)
}

/// Writes a CA (kept if `ca.pem` and its key exist), a server certificate for
/// `hosts` signed by it, and `tls.conf` naming them; returns the CA's path.
fn write_tls(dir: &Path, hosts: &[String]) -> anyhow::Result<PathBuf> {
    let dir = std::fs::canonicalize(dir)?;
    let (ca_path, ca_key_path) = (dir.join(CA_FILE), dir.join("ca-key.pem"));
    let ca_key = match std::fs::read_to_string(&ca_key_path) {
        Ok(pem) if ca_path.exists() => rcgen::KeyPair::from_pem(&pem).context("reading ca-key.pem")?,
        _ => {
            let key = rcgen::KeyPair::generate()?;
            let cert = ca_params()?.self_signed(&key)?;
            write_private(&ca_key_path, &key.serialize_pem(), 0o600)?;
            write_private(&ca_path, &cert.pem(), 0o644)?;
            key
        }
    };
    let issuer = rcgen::Issuer::new(ca_params()?, ca_key);
    let mut params = rcgen::CertificateParams::new(hosts.to_vec()).context("--tls-hosts")?;
    params.distinguished_name.push(rcgen::DnType::CommonName, "tenure NATS server");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let key = rcgen::KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    let (cert_path, key_path) = (dir.join("server.pem"), dir.join("server-key.pem"));
    write_private(&key_path, &key.serialize_pem(), 0o600)?;
    write_private(&cert_path, &cert.pem(), 0o644)?;
    let conf = format!(
        "# Generated by `tenure nats-auth --tls-hosts`: clients reach this server over TLS only,\n\
         # with a certificate for {} signed by {}.\n\
         tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  timeout: 2\n}}\n",
        hosts.join(", "),
        ca_path.display(),
        cert_path.display(),
        key_path.display()
    );
    write_private(&dir.join(TLS_FILE), &conf, 0o600)?;
    Ok(ca_path)
}

/// A fresh 256-bit password, hex.
fn new_password() -> String {
    format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// The `NAME=VALUE` lines of a credentials file (comments skipped).
pub fn read_env_file(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// The password kept in an existing credentials file, if any.
fn existing_password(file: &Path) -> Option<String> {
    let vars = read_env_file(file).ok()?;
    vars.into_iter().find(|(k, _)| k == "TENURE_NATS_PASSWORD").map(|(_, v)| v).filter(|p| !p.is_empty())
}

/// Writes `dir/auth.conf` and `dir/<user>.env` (mode 0600: `TENURE_NATS_USER`
/// and `TENURE_NATS_PASSWORD`, ready for `set -a; . FILE` or a systemd
/// `EnvironmentFile=`) for every identity of `plan`, keeping the passwords of
/// identities that already have a file. Returns the identities.
pub fn write(dir: &Path, plan: &Plan) -> anyhow::Result<Vec<Identity>> {
    let roles = plan.roles()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let identities: Vec<Identity> = roles
        .into_iter()
        .map(|(user, role)| {
            let file = dir.join(format!("{user}.env"));
            let password = existing_password(&file).unwrap_or_else(new_password);
            Identity { user, role, password }
        })
        .collect();
    let tls_ca = if plan.tls_hosts.is_empty() { None } else { Some(write_tls(dir, &plan.tls_hosts)?) };
    let hash = |p: &str| bcrypt::hash(p, BCRYPT_COST).context("hashing a password");
    let conf = render(&identities, hash)?;
    write_private(&dir.join(AUTH_FILE), &conf, 0o600)?;
    if !plan.routes.is_empty() {
        let file = dir.join(format!("{ROUTE_USER}.env"));
        let password = existing_password(&file).unwrap_or_else(new_password);
        write_private(&dir.join(ROUTES_FILE), &render_routes(&plan.routes, &password, hash)?, 0o600)?;
        write_private(&file, &format!("TENURE_NATS_USER={ROUTE_USER}\nTENURE_NATS_PASSWORD={password}\n"), 0o600)?;
    }
    for id in &identities {
        let mut text = format!(
            "# tenure {} credentials: keep this file private (mode 0600).\nTENURE_NATS_USER={}\nTENURE_NATS_PASSWORD={}\n",
            id.role.name(),
            id.user,
            id.password
        );
        if let Some(ca) = &tls_ca {
            text.push_str(&format!("TENURE_NATS_TLS_CA={}\n", ca.display()));
        }
        write_private(&id.env_file(dir), &text, 0o600)?;
    }
    Ok(identities)
}

/// Writes `text` to `path` through a temporary file renamed into place, created
/// with `mode` (never readable by others, not even for a moment).
pub fn write_private(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        Plan {
            coordinators: vec!["c1".into()],
            machines: vec!["w1".parse().unwrap()],
            users: vec!["alice".into(), "bob".into()],
            routes: Vec::new(),
            tls_hosts: Vec::new(),
        }
    }

    #[test]
    fn routes_authenticate_with_one_secret_and_refuse_odd_addresses() {
        let text = render_routes(&["127.0.0.1:6222".into(), "n2.example:6223".into()], "pw", |p| Ok(format!("H({p})")))
            .unwrap();
        assert!(text.contains("password: \"H(pw)\""));
        assert!(text.contains("\"nats-route://route:pw@127.0.0.1:6222\""));
        assert!(text.contains("\"nats-route://route:pw@n2.example:6223\""));
        for bad in ["6222", "h:p", "a b:1", ":1"] {
            assert!(render_routes(&[bad.into()], "pw", |p| Ok(p.into())).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_machine_speaks_only_for_itself_and_clients_only_through_imports() {
        let ids: Vec<Identity> = plan()
            .roles()
            .unwrap()
            .into_iter()
            .map(|(user, role)| Identity { user, role, password: "pw".into() })
            .collect();
        let conf = render(&ids, |p| Ok(p.to_owned())).unwrap();
        let line = |user: &str| conf.lines().find(|l| l.contains(&format!("user: \"{user}\""))).unwrap().to_owned();
        let worker = line("worker-w1");
        assert!(worker.contains("\"tenure.coord.heartbeat.w1\"") && worker.contains("\"tenure.worker.w1.>\""));
        assert!(!worker.contains('*'), "a worker reaches only its own subjects: {worker}");
        let sidecar = line("sidecar-w1");
        assert!(sidecar.contains("deny: [\">\"]") && sidecar.contains("\"tenure.sidecar.w1.evidence\""));
        assert!(!sidecar.contains('*'), "{sidecar}");
        let alice = line("alice");
        assert!(alice.contains("\"_INBOX_alice.>\"") && !alice.contains("_INBOX.>") && !alice.contains("$JS"));
        assert!(!alice.contains("allow_responses"));
        assert_eq!(conf.matches("share: true").count(), 3);
        // Clients are in their own account, after the daemons'.
        let clients_at = conf.find(CLIENT_ACCOUNT).unwrap();
        assert!(conf.find("user: \"alice\"").unwrap() > clients_at);
        assert!(conf.find("user: \"worker-w1\"").unwrap() < clients_at);
    }

    #[test]
    fn names_must_be_identities_and_distinct() {
        let mut p = plan();
        p.users.push("worker-w1".into());
        assert!(p.roles().unwrap_err().to_string().contains("twice"));
        let mut p = plan();
        p.users.push("a.b".into());
        assert!(format!("{:#}", p.roles().unwrap_err()).contains("a.b"));
        assert!(Plan::default().roles().is_err());
    }

    #[test]
    fn files_are_private_and_passwords_are_kept_across_runs() {
        let dir = tempfile::tempdir().unwrap();
        let first = write(dir.path(), &plan()).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(dir.path()), 0o700);
        assert_eq!(mode(&dir.path().join(AUTH_FILE)), 0o600);
        let alice = first.iter().find(|i| i.user == "alice").unwrap();
        assert_eq!(mode(&alice.env_file(dir.path())), 0o600);
        let conf = std::fs::read_to_string(dir.path().join(AUTH_FILE)).unwrap();
        assert!(!conf.contains(&alice.password), "the password itself is never in the server's file");
        let mut more = plan();
        more.machines.push("w2".parse().unwrap());
        let second = write(dir.path(), &more).unwrap();
        assert_eq!(second.iter().find(|i| i.user == "alice").unwrap().password, alice.password);
        assert_eq!(second.len(), first.len() + 2);
        let hash = conf.lines().find(|l| l.contains("\"alice\"")).unwrap().split('"').nth(3).unwrap().to_owned();
        assert!(bcrypt::verify(&alice.password, &hash).unwrap());
    }
}
