//! HTTPS for the gateway, and who a client certificate says the caller is.
//!
//! With `--tls-cert`/`--tls-key` the gateway serves HTTPS only (rustls, the
//! `ring` provider, TLS 1.2 and 1.3). With `--tls-client-ca` too, a client
//! may present a certificate: the handshake fails unless that CA issued it,
//! and its subject's common name ([`PeerSubject`]) is put on each request of
//! the connection. A subject is not an identity by itself: the token file
//! maps allowed subjects to identities (`tenure gateway cert allow`), so a
//! certificate the CA issued for anything else is refused with 401, and an
//! allowed subject can be revoked without re-issuing the CA. A client
//! without a certificate still authenticates with a bearer token.
//!
//! It must never accept a client certificate the configured CA did not
//! issue, never take a subject from anything but the verified certificate
//! (no header can claim one), and never serve plain HTTP on a TLS listener.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;

/// Where the gateway's certificate, key and (optionally) client CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsOptions {
    /// PEM certificate chain the gateway presents.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM CA whose certificates clients may present instead of a token.
    pub client_ca: Option<PathBuf>,
}

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {reason}")]
    Pem { path: PathBuf, reason: String },
    #[error("{path} holds no {what}")]
    Empty { path: PathBuf, what: &'static str },
    #[error("the TLS configuration is not usable: {0}")]
    Config(String),
}

/// The verified client certificate's subject common name, on every request
/// of a connection that presented one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSubject(pub String);

/// How long a client has to finish the TLS handshake.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(10);

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = |reason: String| Error::Pem { path: path.to_owned(), reason };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(Error::Empty { path: path.to_owned(), what: "PEM certificate" });
    }
    Ok(certs)
}

/// The server's rustls configuration; every file is read and checked here,
/// so a bad one stops the gateway at start with its path named.
pub fn server_config(opts: &TlsOptions) -> Result<Arc<rustls::ServerConfig>, Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(&opts.cert)?;
    let key = PrivateKeyDer::from_pem_file(&opts.key)
        .map_err(|e| Error::Pem { path: opts.key.clone(), reason: e.to_string() })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(e.to_string()))?;
    let builder = match &opts.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in certificates(ca)? {
                roots.add(cert).map_err(|e| Error::Pem { path: ca.clone(), reason: e.to_string() })?;
            }
            // A client may come with a token instead; one that presents a
            // certificate must present one the CA issued.
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| Error::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| Error::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The subject common name of a DER certificate (`None`: unreadable or
/// without one, or not valid UTF-8).
pub fn subject_of(cert: &[u8]) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let cn = parsed.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

/// Serves `app` over TLS on `listener` until `shutdown` resolves. Each
/// connection's handshake is bounded; a failed one is logged and dropped.
pub async fn serve(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors and the like: wait a little, go on.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => return,
        };
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_BOUND, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            let subject = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(|c| subject_of(c));
            let app = tower::ServiceExt::map_request(app, move |mut req: axum::http::Request<_>| {
                if let Some(subject) = &subject {
                    req.extensions_mut().insert(PeerSubject(subject.clone()));
                }
                req
            });
            let served = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(tls), TowerToHyperService::new(app))
                .await;
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn a_usable_configuration_and_the_subject_of_a_certificate() {
        let d = tempfile::tempdir().unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name.push(rcgen::DnType::CommonName, "test CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut server = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        server.distinguished_name.push(rcgen::DnType::CommonName, "alice");
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let cert = server.signed_by(&key, &issuer).unwrap();
        assert_eq!(subject_of(cert.der()).as_deref(), Some("alice"));
        assert_eq!(subject_of(b"not a certificate"), None);
        let opts = TlsOptions {
            cert: write(d.path(), "cert.pem", &cert.pem()),
            key: write(d.path(), "key.pem", &key.serialize_pem()),
            client_ca: Some(write(d.path(), "ca.pem", &ca_cert.pem())),
        };
        server_config(&opts).unwrap();
        // Each unusable file is named.
        let empty = write(d.path(), "empty.pem", "");
        let e = server_config(&TlsOptions { client_ca: Some(empty.clone()), ..opts.clone() }).unwrap_err();
        assert!(e.to_string().contains("empty.pem holds no PEM certificate"), "{e}");
        let e = server_config(&TlsOptions { key: empty, ..opts.clone() }).unwrap_err();
        assert!(e.to_string().contains("empty.pem"), "{e}");
        let e = server_config(&TlsOptions { cert: d.path().join("nope.pem"), ..opts }).unwrap_err();
        assert!(e.to_string().contains("nope.pem"), "{e}");
    }
}
