//! `tenure gateway` over HTTPS with client certificates, on a real cluster:
//! a certificate the client CA issued acts as the identity its subject was
//! granted (and nothing else), a bearer token still works without one, a
//! certificate of another CA never completes a handshake, plain HTTP gets no
//! answer, and a revoked grant is refused by the running gateway.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{Cluster, BIN};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};

/// A CA and what it issued, as PEM files in `dir`.
struct Pki {
    dir: PathBuf,
    ca: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Pki {
    fn new(dir: &Path, name: &str) -> Pki {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} CA"));
        let cert = params.self_signed(&key).unwrap();
        std::fs::write(dir.join(format!("{name}-ca.pem")), cert.pem()).unwrap();
        Pki { dir: dir.to_owned(), ca: rcgen::Issuer::new(params, key) }
    }

    fn ca(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}-ca.pem"))
    }

    /// A certificate for `subject` (common name; `127.0.0.1` as its address),
    /// as (cert.pem, key.pem).
    fn issue(&self, file: &str, subject: &str) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, subject);
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (c, k) = (self.dir.join(format!("{file}.pem")), self.dir.join(format!("{file}-key.pem")));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }
}

/// One HTTPS request (HTTP/1.1, `Connection: close`) trusting `server_ca`,
/// with an optional client certificate and bearer token: the status and
/// the JSON body, or why the connection failed.
fn https(
    port: u16,
    server_ca: &Path,
    client: Option<&(PathBuf, PathBuf)>,
    bearer: Option<&str>,
    request: (&str, &str, Option<Value>),
) -> Result<(u16, Value), String> {
    use rustls::pki_types::pem::PemObject;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(server_ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert).unwrap().map(Result::unwrap).collect();
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap()).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let tcp = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let (method, path, body) = request;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let auth = bearer.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).and_then(|()| tls.write_all(body.as_bytes())).map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    // A peer that closes without close_notify still gave its whole reply.
    if let Err(e) = tls.read_to_end(&mut reply) {
        if reply.is_empty() {
            return Err(e.to_string());
        }
    }
    let text = String::from_utf8_lossy(&reply);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("no HTTP reply: {text:?}"))?;
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or("no status")?;
    // Content-Length bodies only here (no chunked JSON answers).
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

fn verb(tokens: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN).arg("gateway").arg("--tokens").arg(tokens).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn client_certificates_act_as_their_granted_identity_over_https() {
    let mut c = Cluster::start(1);
    let dir = c.dir.path().join("pki");
    std::fs::create_dir_all(&dir).unwrap();
    let (pki, other) = (Pki::new(&dir, "tenure"), Pki::new(&dir, "other"));
    let server = pki.issue("server", "gateway");
    let alice = pki.issue("alice", "alice");
    let mallory = pki.issue("mallory", "mallory");
    let forged = other.issue("forged-alice", "alice");
    let tokens = c.dir.path().join("gateway-tokens.json");
    let said = verb(&tokens, &["cert", "allow", "alice", "--identity", "alice", "--label", "laptop"]);
    assert!(said.contains("act as alice"), "{said}");
    let bob = verb(&tokens, &["token", "create", "--identity", "bob"]);
    // One active grant per subject.
    let again = Command::new(BIN)
        .args(["gateway", "--tokens", tokens.to_str().unwrap(), "cert", "allow", "alice", "--identity", "bob"])
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already allowed as \"alice\""));

    let port = tenure_testkit::free_port();
    let listen = format!("127.0.0.1:{port}");
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let (cert, key, ca) = (path(&server.0), path(&server.1), path(&pki.ca("tenure")));
    let args = ["gateway", "--listen", &listen, "--tokens", &path(&tokens)];
    let tls = ["--tls-cert", &cert, "--tls-key", &key, "--tls-client-ca", &ca];
    c.spawn("gateway", &[&args[..], &tls[..]].concat());
    let server_ca = pki.ca("tenure");
    let get = |client: Option<&(PathBuf, PathBuf)>, bearer: Option<&str>, path: &str| {
        https(port, &server_ca, client, bearer, ("GET", path, None))
    };
    let up = tenure_testkit::eventually(Duration::from_secs(30), || get(None, None, "/openapi.json").ok());
    assert_eq!(up.map(|r| r.0), Some(200), "{}", c.logs());

    // The granted certificate acts as alice: it submits and reads her task.
    let (status, me) = get(Some(&alice), None, "/v1/whoami").unwrap();
    assert_eq!((status, me["identity"].as_str()), (200, Some("alice")), "{me}");
    let submit = ("POST", "/v1/tasks", Some(json!({"command": "echo over-tls"})));
    let (status, submitted) = https(port, &server_ca, Some(&alice), None, submit).unwrap();
    assert_eq!(status, 201, "{submitted}");
    let task = submitted["task"].as_str().unwrap().to_owned();
    let done = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (_, t) = get(Some(&alice), None, &format!("/v1/tasks/{task}")).ok()?;
        (t["status"] == "completed").then_some(t)
    });
    assert!(done.is_some(), "{}", c.logs());

    // A token works over HTTPS without a certificate, and is bob: alice's task is not his.
    let (status, body) = get(None, Some(&bob), &format!("/v1/tasks/{task}")).unwrap();
    assert_eq!((status, body["code"].as_str()), (404, Some("not-found")), "{body}");
    // With both, the token decides (no mixing of two credentials).
    let (_, me) = get(Some(&alice), Some(&bob), "/v1/whoami").unwrap();
    assert_eq!(me["identity"], "bob");

    // A certificate the CA issued for an ungranted subject: 401 naming it.
    let (status, body) = get(Some(&mallory), None, "/v1/whoami").unwrap();
    assert_eq!((status, body["code"].as_str()), (401, Some("unauthorized")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("\"mallory\" is not allowed"), "{body}");
    // No credential at all: 401.
    assert_eq!(get(None, None, "/v1/whoami").unwrap().0, 401);
    // "alice" from another CA never gets through the handshake.
    assert!(get(Some(&forged), None, "/v1/whoami").is_err(), "a certificate of another CA was accepted");
    // Plain HTTP on the HTTPS port gets no HTTP answer.
    let mut plain = TcpStream::connect(("127.0.0.1", port)).unwrap();
    plain.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    plain.write_all(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = plain.read_to_end(&mut reply);
    assert!(!String::from_utf8_lossy(&reply).contains("openapi"), "plain HTTP was served");

    // Revoking the grant holds from the next request on, without a restart.
    verb(&tokens, &["cert", "revoke", "alice"]);
    let listed = verb(&tokens, &["cert", "list", "--json"]);
    let grants: Value = serde_json::from_str(&listed).unwrap();
    assert!(grants[0]["revoked_at_ms"].is_u64(), "{grants}");
    let (status, _) = get(Some(&alice), None, "/v1/whoami").unwrap();
    assert_eq!(status, 401);
}

#[test]
fn unusable_tls_files_stop_the_gateway_at_start_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("t.json");
    let missing = dir.path().join("missing-cert.pem");
    let out = Command::new(BIN)
        .args(["--nats", "nats://127.0.0.1:1", "gateway", "--listen", "127.0.0.1:0", "--tokens"])
        .arg(&tokens)
        .arg("--tls-cert")
        .arg(&missing)
        .arg("--tls-key")
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing-cert.pem"), "{err}");
    // A key without a certificate is refused by the flags themselves.
    let out =
        Command::new(BIN).args(["gateway", "--tokens"]).arg(&tokens).arg("--tls-key").arg(&missing).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-cert"));
}
