//! The gateway's bearer tokens: created and revoked by `tenure gateway token`,
//! checked on every request.
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
//! This module must never store, log or return a token's secret, and never
//! accept a revoked token.

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

/// The token file's content.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenFile {
    pub tokens: Vec<TokenRecord>,
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
        match self.current() {
            Ok(file) => file.verify(token).cloned(),
            Err(e) => {
                tracing::error!(error = %e, "token file unreadable; refusing tokens");
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

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tenure-gateway-tokens-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
