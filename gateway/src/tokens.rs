//! The gateway's bearer tokens and client-certificate grants: created and
//! revoked by `tenure gateway token` and `tenure gateway cert`, checked on
//! every request.
//!
//! A token is `tnr_<id>_<secret>`: `id` names it in lists and revocations,
//! `secret` holds 244 random bits. Only the SHA-256 of the whole token is
//! stored (a fast hash is enough for a secret with that much entropy; a slow
//! one would only slow every request), in one file, mode 0600, rewritten
//! atomically (a temporary file renamed over it). The printed token is shown
//! once and never written anywhere.
//!
//! A running gateway reads the file again whenever it changed (size or
//! modification time), so a revocation holds for every gateway that shares
//! the file from the next request on, without a restart.
//!
//! A certificate grant maps the subject common name of a client certificate
//! (issued by the gateway's `--tls-client-ca`, see [`crate::tls`]) to an
//! identity and its NATS credentials, exactly as a token does; one active
//! grant per subject.
//!
//! This module must never store, log or return a token's secret, and never
//! accept a revoked token or grant.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Why the token file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the token file {path} is not valid: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("cannot write the token file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("identity {0:?} is not valid: 1 to 64 of A-Z a-z 0-9 _ @ -")]
    Identity(String),
    #[error("no token with id {0:?}")]
    Unknown(String),
    #[error("no certificate grant for subject {0:?}")]
    UnknownSubject(String),
    #[error("subject {subject:?} is already allowed as {identity:?}; revoke that grant first")]
    SubjectTaken { subject: String, identity: String },
    #[error("subject {0:?} is not valid: 1 to 256 printable characters")]
    Subject(String),
}

/// One token as stored: everything but its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRecord {
    /// Public id (`tnr_<id>_…`), for lists and revocation.
    pub id: String,
    /// SHA-256 of the whole token, lower-case hex.
    pub sha256: String,
    /// The tenure identity the token acts as: the NATS user on an
    /// authenticating cluster, the session label otherwise.
    pub identity: String,
    /// The caller's own NATS credentials: a `.env` file written by `tenure
    /// nats-auth` (`TENURE_NATS_USER`, `TENURE_NATS_PASSWORD`, …) or a NATS
    /// `.creds` file. Required when the gateway's cluster authenticates.
    #[serde(default)]
    pub nats_creds: Option<PathBuf>,
    #[serde(default)]
    pub label: Option<String>,
    pub created_at_ms: u64,
    /// Set by `revoke`; a revoked token is refused and kept for audit.
    #[serde(default)]
    pub revoked_at_ms: Option<u64>,
}

/// A client certificate's subject allowed to act as an identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateRecord {
    /// The certificate's subject common name, as the client CA issued it.
    pub subject: String,
    /// The tenure identity it acts as (as [`TokenRecord::identity`]).
    pub identity: String,
    /// The identity's own NATS credentials (as [`TokenRecord::nats_creds`]).
    #[serde(default)]
    pub nats_creds: Option<PathBuf>,
    #[serde(default)]
    pub label: Option<String>,
    pub created_at_ms: u64,
    /// Set by `revoke`; a revoked grant is refused and kept for audit.
    #[serde(default)]
    pub revoked_at_ms: Option<u64>,
}

/// Who a verified credential (a token or a certificate) acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub identity: String,
    pub nats_creds: Option<PathBuf>,
}

/// The token file's content.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenFile {
    pub tokens: Vec<TokenRecord>,
    /// Client-certificate grants (absent in files written before them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certificates: Vec<CertificateRecord>,
}

/// Whether an identity name can be a NATS user and a session label.
pub fn valid_identity(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'-'))
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl TokenFile {
    /// Reads `path`; an absent file holds no tokens.
    pub fn load(path: &Path) -> Result<TokenFile, Error> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| Error::Parse { path: path.into(), source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TokenFile::default()),
            Err(source) => Err(Error::Read { path: path.into(), source }),
        }
    }

    /// Writes the file atomically, mode 0600: a temporary file beside it,
    /// flushed, then renamed over it.
    pub fn save(&self, path: &Path) -> Result<(), Error> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let err = |source| Error::Write { path: path.into(), source };
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(err)?;
        let tmp =
            dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("tokens"), now_ms()));
        let text = serde_json::to_vec_pretty(self).map_err(|e| err(std::io::Error::other(e)))?;
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(err)?;
        let written = f.write_all(&text).and_then(|()| f.sync_all());
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(err(e));
        }
        Ok(())
    }

    /// Adds a token for `identity`; returns the token (shown once) and its record.
    pub fn create(
        &mut self,
        identity: &str,
        nats_creds: Option<PathBuf>,
        label: Option<String>,
    ) -> Result<(String, TokenRecord), Error> {
        if !valid_identity(identity) {
            return Err(Error::Identity(identity.to_owned()));
        }
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let secret = format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
        let token = format!("tnr_{id}_{secret}");
        let record = TokenRecord {
            id,
            sha256: sha256_hex(token.as_bytes()),
            identity: identity.to_owned(),
            nats_creds,
            label,
            created_at_ms: now_ms(),
            revoked_at_ms: None,
        };
        self.tokens.push(record.clone());
        Ok((token, record))
    }

    /// Marks the token `id` revoked (again: no change).
    pub fn revoke(&mut self, id: &str) -> Result<&TokenRecord, Error> {
        let record = self.tokens.iter_mut().find(|t| t.id == id).ok_or_else(|| Error::Unknown(id.to_owned()))?;
        record.revoked_at_ms.get_or_insert_with(now_ms);
        Ok(record)
    }

    /// The live record of `token`, if it is one.
    pub fn verify(&self, token: &str) -> Option<&TokenRecord> {
        let id = token.strip_prefix("tnr_")?.split('_').next()?;
        let hash = sha256_hex(token.as_bytes());
        self.tokens.iter().find(|t| t.id == id && t.sha256 == hash && t.revoked_at_ms.is_none())
    }

    /// Lets client certificates with `subject` act as `identity`.
    pub fn allow_certificate(
        &mut self,
        subject: &str,
        identity: &str,
        nats_creds: Option<PathBuf>,
        label: Option<String>,
    ) -> Result<&CertificateRecord, Error> {
        if subject.is_empty() || subject.len() > 256 || subject.chars().any(char::is_control) {
            return Err(Error::Subject(subject.to_owned()));
        }
        if !valid_identity(identity) {
            return Err(Error::Identity(identity.to_owned()));
        }
        if let Some(taken) = self.certificate(subject) {
            return Err(Error::SubjectTaken { subject: subject.to_owned(), identity: taken.identity.clone() });
        }
        self.certificates.push(CertificateRecord {
            subject: subject.to_owned(),
            identity: identity.to_owned(),
            nats_creds,
            label,
            created_at_ms: now_ms(),
            revoked_at_ms: None,
        });
        Ok(self.certificates.last().unwrap_or_else(|| unreachable!("just pushed")))
    }

    /// Revokes the active grant of `subject`.
    pub fn revoke_certificate(&mut self, subject: &str) -> Result<&CertificateRecord, Error> {
        let record = self
            .certificates
            .iter_mut()
            .find(|c| c.subject == subject && c.revoked_at_ms.is_none())
            .ok_or_else(|| Error::UnknownSubject(subject.to_owned()))?;
        record.revoked_at_ms = Some(now_ms());
        Ok(record)
    }

    /// The active grant of `subject`, if there is one.
    pub fn certificate(&self, subject: &str) -> Option<&CertificateRecord> {
        self.certificates.iter().find(|c| c.subject == subject && c.revoked_at_ms.is_none())
    }
}

/// The token file as a running gateway sees it: read again when it changed.
pub struct TokenStore {
    path: PathBuf,
    cached: Mutex<(Option<(SystemTime, u64)>, TokenFile)>,
}

impl TokenStore {
    /// A store over `path`, read now (so a broken file stops the gateway at start).
    pub fn open(path: PathBuf) -> Result<TokenStore, Error> {
        let store = TokenStore { path, cached: Mutex::new((None, TokenFile::default())) };
        store.current()?;
        Ok(store)
    }

    fn stamp(&self) -> Option<(SystemTime, u64)> {
        let meta = std::fs::metadata(&self.path).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    }

    fn current(&self) -> Result<TokenFile, Error> {
        let stamp = self.stamp();
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if cached.0.is_none() || cached.0 != stamp {
            cached.1 = TokenFile::load(&self.path)?;
            cached.0 = stamp;
        }
        Ok(cached.1.clone())
    }

    /// The live record of `token`. A file that became unreadable refuses
    /// every token (and says why in the log) rather than keep old ones.
    pub fn verify(&self, token: &str) -> Option<TokenRecord> {
        self.with_file(|file| file.verify(token).cloned())
    }

    /// Who a verified client certificate with `subject` acts as, if its
    /// grant is active (an unreadable file refuses, as for tokens).
    pub fn verify_certificate(&self, subject: &str) -> Option<Grant> {
        self.with_file(|file| {
            let c = file.certificate(subject)?;
            Some(Grant { identity: c.identity.clone(), nats_creds: c.nats_creds.clone() })
        })
    }

    fn with_file<T>(&self, f: impl FnOnce(&TokenFile) -> Option<T>) -> Option<T> {
        match self.current() {
            Ok(file) => f(&file),
            Err(e) => {
                tracing::error!(error = %e, "token file unreadable; refusing tokens and certificates");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_verify_until_revoked_and_only_hashes_are_stored() {
        let dir = tempfile_dir();
        let path = dir.join("tokens.json");
        let mut file = TokenFile::load(&path).unwrap();
        let (token, record) = file.create("alice", None, Some("ci".into())).unwrap();
        file.save(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains(&token[record.id.len() + 5..]), "the secret must not be stored");
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let store = TokenStore::open(path.clone()).unwrap();
        assert_eq!(store.verify(&token).map(|r| r.identity), Some("alice".into()));
        assert!(store.verify("tnr_nope_x").is_none());
        assert!(store.verify(&format!("{token}x")).is_none());
        let mut file = TokenFile::load(&path).unwrap();
        file.revoke(&record.id).unwrap();
        // A different size guarantees the change is seen even within one mtime tick.
        file.tokens[0].label = Some("ci, revoked".into());
        file.save(&path).unwrap();
        assert!(store.verify(&token).is_none(), "a revoked token is refused by a running store");
        assert!(file.create("not ok", None, None).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn certificate_grants_are_one_per_subject_until_revoked() {
        let dir = tempfile_dir();
        let path = dir.join("tokens.json");
        let mut file = TokenFile::default();
        file.allow_certificate("alice", "alice", None, None).unwrap();
        let taken = file.allow_certificate("alice", "mallory", None, None).unwrap_err();
        assert!(taken.to_string().contains("already allowed as \"alice\""), "{taken}");
        assert!(matches!(file.allow_certificate("", "alice", None, None), Err(Error::Subject(_))));
        assert!(matches!(file.allow_certificate("x\ny", "alice", None, None), Err(Error::Subject(_))));
        assert!(matches!(file.allow_certificate("bob", "not ok", None, None), Err(Error::Identity(_))));
        file.save(&path).unwrap();
        let store = TokenStore::open(path.clone()).unwrap();
        assert_eq!(store.verify_certificate("alice").map(|g| g.identity), Some("alice".into()));
        assert!(store.verify_certificate("bob").is_none());
        file.revoke_certificate("alice").unwrap();
        assert!(matches!(file.revoke_certificate("alice"), Err(Error::UnknownSubject(_))));
        file.certificates[0].label = Some("revoked".into());
        file.save(&path).unwrap();
        assert!(store.verify_certificate("alice").is_none(), "a revoked grant is refused by a running store");
        // The subject can be granted again after a revocation (the old grant stays for audit).
        file.allow_certificate("alice", "alice", None, None).unwrap();
        assert_eq!(file.certificates.len(), 2);
        // A file of tokens only, as written before certificate grants, still loads.
        std::fs::write(&path, r#"{"tokens": []}"#).unwrap();
        assert!(TokenFile::load(&path).unwrap().certificates.is_empty());
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tenure-gateway-tokens-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
