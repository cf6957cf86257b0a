//! `tenure gateway`: the HTTP gateway daemon (`tenure-gateway`) with the
//! daemons' configuration rules, and its credential verbs (`token create`,
//! `token revoke`, `token list`; `cert allow`, `cert revoke`, `cert list`),
//! which only edit the token file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use tenure_gateway::tokens::TokenFile;
use tenure_transport::NatsOptions;

use crate::config::{self, DaemonConfig, SharedFlags, Validate};

/// Default address: loopback only; serve HTTPS (`--tls-cert`) or put a
/// TLS-terminating proxy in front to expose it.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// `tenure gateway`.
#[derive(Args, Debug)]
pub struct GatewayArgs {
    #[command(flatten)]
    pub config: config::ConfigArgs,
    /// Address to serve HTTP on.
    #[arg(long, env = "TENURE_GATEWAY_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// The token file (hashes only; mode 0600), shared by every gateway of the cluster.
    #[arg(long, env = "TENURE_GATEWAY_TOKENS", value_name = "FILE", global = true)]
    pub tokens: Option<PathBuf>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, env = "TENURE_GATEWAY_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "TENURE_GATEWAY_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Take client certificates this PEM CA issued, as the identities
    /// `cert allow` grants their subjects (needs --tls-cert).
    #[arg(long, env = "TENURE_GATEWAY_TLS_CLIENT_CA", value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    #[command(subcommand)]
    pub action: Option<GatewayAction>,
}

#[derive(Subcommand, Debug)]
pub enum GatewayAction {
    /// Manage the gateway's bearer tokens.
    #[command(subcommand)]
    Token(TokenAction),
    /// Manage which client-certificate subjects act as which identity.
    #[command(subcommand)]
    Cert(CertAction),
}

#[derive(Subcommand, Debug)]
pub enum CertAction {
    /// Let client certificates with subject common name SUBJECT (issued by
    /// the gateway's --tls-client-ca) act as IDENTITY. `--nats-creds FILE`
    /// names the identity's own NATS credentials, as for `token create`.
    Allow {
        subject: String,
        #[arg(long)]
        identity: String,
        #[arg(long)]
        label: Option<String>,
    },
    /// Revoke SUBJECT's grant (refused from the next request on, by every gateway).
    Revoke { subject: String },
    /// List certificate grants.
    List {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum TokenAction {
    /// Create a token acting as IDENTITY; prints it once (only its hash is
    /// stored). `--nats-creds FILE` here names the identity's own NATS
    /// credentials (the `<user>.env` file `tenure nats-auth` wrote, or a
    /// `.creds` file): required on an authenticating cluster.
    Create {
        /// The tenure identity: the NATS user on an authenticating cluster,
        /// the session otherwise.
        #[arg(long)]
        identity: String,
        /// A note shown by `token list` (who or what uses it).
        #[arg(long)]
        label: Option<String>,
    },
    /// Revoke a token by its id (refused from the next request on, by every gateway).
    Revoke { id: String },
    /// List tokens (ids, identities, labels; never secrets).
    List {
        #[arg(long)]
        json: bool,
    },
}

/// `tenure gateway`'s configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    /// The token file (required).
    pub tokens: Option<PathBuf>,
    pub metrics_addr: Option<SocketAddr>,
    pub nats: NatsOptions,
    /// `[tls]`: serve HTTPS (`cert`, `key`) and take client certificates (`client_ca`).
    pub tls: Option<GatewayTls>,
}

/// `[tls]` of the gateway's configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    #[serde(default)]
    pub client_ca: Option<PathBuf>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: DEFAULT_LISTEN.parse().unwrap_or_else(|_| unreachable!("a valid address")),
            tokens: None,
            metrics_addr: None,
            nats: NatsOptions::default(),
            tls: None,
        }
    }
}

impl Validate for GatewayConfig {
    fn validate(&self) -> anyhow::Result<()> {
        if self.tokens.is_none() {
            anyhow::bail!("tokens is required (--tokens, TENURE_GATEWAY_TOKENS or `tokens` in the file)");
        }
        self.nats.validate().context("nats")
    }
}

impl DaemonConfig for GatewayConfig {
    fn shared(&mut self) -> (&mut Option<SocketAddr>, &mut NatsOptions) {
        (&mut self.metrics_addr, &mut self.nats)
    }
}

/// `caller_creds`: `--nats-creds` as given on the command line of `token
/// create` (the caller's credentials, not the gateway's; never read from
/// the environment there).
pub async fn run(
    args: GatewayArgs,
    caller_creds: Option<PathBuf>,
    sub: &clap::ArgMatches,
    given_global: &dyn Fn(&str) -> bool,
    shared: SharedFlags,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<ExitCode> {
    if let Some(action) = args.action {
        let file = args
            .tokens
            .or_else(|| config::load::<GatewayConfig>(args.config.config.as_deref()).ok().and_then(|c| c.tokens))
            .context("the token file is required: --tokens FILE (or TENURE_GATEWAY_TOKENS)")?;
        let caller_creds = checked_creds(caller_creds)?;
        return match action {
            GatewayAction::Token(action) => token(&file, action, caller_creds),
            GatewayAction::Cert(action) => cert(&file, action, caller_creds),
        };
    }
    let tls_given = args.tls_cert.is_some();
    let tls_flags = args.tls_cert.zip(args.tls_key).map(|(cert, key)| GatewayTls {
        cert,
        key,
        client_ca: args.tls_client_ca.clone(),
    });
    let overrides = |cfg: &mut GatewayConfig| {
        override_given!(sub, cfg, args, listen, tokens);
        if tls_given {
            cfg.tls = tls_flags.clone();
        }
    };
    let Some(cfg) = config::resolve(&args.config, given_global, shared, overrides)? else {
        return Ok(ExitCode::SUCCESS);
    };
    let _metrics = crate::metrics::start("gateway", cfg.metrics_addr).await?;
    let Some(tokens) = cfg.tokens else { unreachable!("validated") };
    let tls = cfg.tls.map(|t| tenure_gateway::tls::TlsOptions { cert: t.cert, key: t.key, client_ca: t.client_ca });
    let opts = tenure_gateway::Options { listen: cfg.listen, tokens, nats: cfg.nats, tls };
    tenure_gateway::run(opts, shutdown).await?;
    Ok(ExitCode::SUCCESS)
}

/// `--nats-creds` of a credential verb: an existing file, made absolute
/// (the gateway may run from another directory).
fn checked_creds(nats_creds: Option<PathBuf>) -> anyhow::Result<Option<PathBuf>> {
    if let Some(creds) = &nats_creds {
        anyhow::ensure!(creds.is_file(), "--nats-creds {}: no such file", creds.display());
    }
    Ok(nats_creds.map(|p| std::path::absolute(&p)).transpose()?)
}

fn cert(file: &std::path::Path, action: CertAction, nats_creds: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let mut tokens = TokenFile::load(file)?;
    match action {
        CertAction::Allow { subject, identity, label } => {
            let record = tokens.allow_certificate(&subject, &identity, nats_creds, label)?.clone();
            tokens.save(file)?;
            println!("client certificates with subject {:?} act as {}", record.subject, record.identity);
        }
        CertAction::Revoke { subject } => {
            let record = tokens.revoke_certificate(&subject)?.clone();
            tokens.save(file)?;
            println!("revoked the grant of {:?} ({})", record.subject, record.identity);
        }
        CertAction::List { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&tokens.certificates)?);
            } else {
                println!("{:<32} {:<20} {:<8} LABEL", "SUBJECT", "IDENTITY", "STATE");
                for c in &tokens.certificates {
                    let state = if c.revoked_at_ms.is_some() { "revoked" } else { "active" };
                    let subject = format!("{:?}", c.subject);
                    println!("{subject:<32} {:<20} {state:<8} {}", c.identity, c.label.as_deref().unwrap_or("-"));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn token(file: &std::path::Path, action: TokenAction, nats_creds: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let mut tokens = TokenFile::load(file)?;
    match action {
        TokenAction::Create { identity, label } => {
            let (secret, record) = tokens.create(&identity, nats_creds, label)?;
            tokens.save(file)?;
            eprintln!(
                "token {} for {} (shown once; only its hash is kept in {}):",
                record.id,
                record.identity,
                file.display()
            );
            println!("{secret}");
        }
        TokenAction::Revoke { id } => {
            let record = tokens.revoke(&id)?.clone();
            tokens.save(file)?;
            println!("revoked {} ({})", record.id, record.identity);
        }
        TokenAction::List { json } => {
            if json {
                println!("{}", serde_json::to_string_pretty(&tokens.tokens)?);
            } else {
                println!("{:<14} {:<20} {:<8} LABEL", "ID", "IDENTITY", "STATE");
                for t in &tokens.tokens {
                    let state = if t.revoked_at_ms.is_some() { "revoked" } else { "active" };
                    println!("{:<14} {:<20} {:<8} {}", t.id, t.identity, state, t.label.as_deref().unwrap_or("-"));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `--nats-creds` when it was given on the command line (at any level), not
/// taken from `TENURE_NATS_CREDS`.
pub fn creds_on_command_line(matches: &clap::ArgMatches) -> Option<PathBuf> {
    let mut m = Some(matches);
    let mut found = None;
    while let Some(level) = m {
        if level.value_source("creds") == Some(clap::parser::ValueSource::CommandLine) {
            found = level.get_one::<PathBuf>("creds").cloned();
        }
        m = level.subcommand().map(|(_, sub)| sub);
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_is_read_strictly_and_the_token_file_is_required() {
        let cfg: GatewayConfig = toml::from_str("listen = '0.0.0.0:9000'\ntokens = '/etc/tenure/t.json'").unwrap();
        assert_eq!(cfg.listen.port(), 9000);
        cfg.validate().unwrap();
        assert!(toml::from_str::<GatewayConfig>("tokenz = 'x'").unwrap_err().to_string().contains("tokenz"));
        let err = GatewayConfig::default().validate().unwrap_err().to_string();
        assert!(err.contains("tokens is required"), "{err}");
        let cfg: GatewayConfig =
            toml::from_str("tokens = 't.json'\n[tls]\ncert = 'c.pem'\nkey = 'k.pem'\nclient_ca = 'ca.pem'").unwrap();
        assert_eq!(cfg.tls.map(|t| t.client_ca), Some(Some(PathBuf::from("ca.pem"))));
        let err = toml::from_str::<GatewayConfig>("[tls]\ncert = 'c.pem'").unwrap_err().to_string();
        assert!(err.contains("key"), "{err}");
    }
}
