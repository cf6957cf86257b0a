//! Identifiers: task ids `<kind>-N`, kinds, workers, sessions, epochs and attempts.
//!
//! Every identifier that arrives from the network or a user is parsed here and
//! nowhere else, so a malformed one is refused with an [`IdError`] before it can
//! reach a subject, a file name or a store key. Ids are not secrets: access is
//! decided by comparing owner sessions, never by guessing ids.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::intern::Interner;

static KINDS: Interner = Interner::new();
static WORKERS: Interner = Interner::new();
static SESSIONS: Interner = Interner::new();

/// Longest kind name accepted (`shell`, `agent`, …).
pub const MAX_KIND_LEN: usize = 32;
/// Longest worker id accepted; worker ids appear in NATS subjects and file names.
pub const MAX_WORKER_ID_LEN: usize = 64;
/// Longest session id accepted.
pub const MAX_SESSION_LEN: usize = 128;
/// Longest authenticated identity accepted.
pub const MAX_IDENTITY_LEN: usize = 64;
/// Separates the authenticated identity from the session label its caller
/// chose, in an owner: `alice/ci-7`.
pub const IDENTITY_SEPARATOR: char = '/';

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The kind is empty, too long, or has a character outside `[a-z][a-z0-9_-]*`.
    #[error(
        "invalid kind {0:?}: expected a lowercase ascii letter then letters, digits, '_' or '-', at most 32 chars"
    )]
    Kind(String),
    /// The task id is not `<kind>-<N>` with N ≥ 1.
    #[error("invalid task id {0:?}: expected <kind>-<N> with N >= 1, e.g. shell-7")]
    Task(String),
    /// The worker id is empty, too long, or has a character outside `[a-z0-9_-]`.
    #[error("invalid worker id {0:?}: expected 1-64 chars of lowercase letters, digits, '_' or '-'")]
    Worker(String),
    /// The session id is empty, too long, or holds whitespace or control characters.
    #[error("invalid session id {0:?}: expected 1-128 printable non-space chars")]
    Session(String),
    /// The authenticated identity (a NATS user name) is empty, longer than 64
    /// bytes, or has a character outside `[A-Za-z0-9_@-]` (no `.`: an identity
    /// is also an inbox prefix, `_INBOX_<identity>`, and must be one token).
    #[error("invalid identity {0:?}: expected 1-64 chars of letters, digits, '_', '@' or '-'")]
    Identity(String),
}

fn shorten(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A producer namespace (`shell`, `agent`, …). Opaque to the registry; it is also
/// the task id prefix. Interned: every `noop` in the process shares one
/// allocation, and a clone (of a `TaskId` too) allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Kind(Arc<str>);

impl Kind {
    /// The kind of plain command lines run with `sh -c`.
    pub fn shell() -> Kind {
        Kind(KINDS.intern("shell"))
    }

    /// The kind of long-running interactive processes (CLI coding agents): run
    /// like `shell`, with a stdin that stays open for `tenure send`.
    pub fn agent() -> Kind {
        Kind(KINDS.intern("agent"))
    }

    /// The kind of never-ending watchers: run like `shell`; every output line
    /// matching the task's pattern raises a notification.
    pub fn monitor() -> Kind {
        Kind(KINDS.intern("monitor"))
    }

    /// The kind of ordered step lists run by the coordinator itself, each step a
    /// child task with its own id. No worker runs a workflow.
    pub fn workflow() -> Kind {
        Kind(KINDS.intern("workflow"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Kind {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let mut chars = s.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
        let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        if first_ok && rest_ok && s.len() <= MAX_KIND_LEN {
            Ok(Kind(KINDS.intern(s)))
        } else {
            Err(IdError::Kind(shorten(s)))
        }
    }
}

/// A task's stable identity `<kind>-N`. N is cluster-wide, monotonic and never reused,
/// so N alone is unique; the kind prefix is for humans and routing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TaskId {
    kind: Kind,
    n: u64,
}

impl TaskId {
    /// Builds an id; `n` must be at least 1.
    pub fn new(kind: Kind, n: u64) -> Result<TaskId, IdError> {
        if n == 0 {
            return Err(IdError::Task(format!("{kind}-0")));
        }
        Ok(TaskId { kind, n })
    }

    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    pub fn number(&self) -> u64 {
        self.n
    }
}

impl FromStr for TaskId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let bad = || IdError::Task(shorten(s));
        let (kind, n) = s.rsplit_once('-').ok_or_else(bad)?;
        // Reject signs, leading zeros and anything u64 parsing would tolerate but a
        // canonical printer would never produce, so that parse(print(id)) == id and
        // one task has exactly one spelling.
        if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || n.starts_with('0') {
            return Err(bad());
        }
        let n: u64 = n.parse().map_err(|_| bad())?;
        let kind: Kind = kind.parse().map_err(|_| bad())?;
        TaskId::new(kind, n).map_err(|_| bad())
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.kind, self.n)
    }
}

/// A worker machine's name. Used verbatim in NATS subjects and directory names,
/// hence the narrow alphabet (no `.`, `*`, `>`, `/` or whitespace). Interned,
/// like [`Kind`]: every task record names its worker.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct WorkerId(Arc<str>);

impl WorkerId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for WorkerId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let ok = !s.is_empty()
            && s.len() <= MAX_WORKER_ID_LEN
            && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if ok {
            Ok(WorkerId(WORKERS.intern(s)))
        } else {
            Err(IdError::Worker(shorten(s)))
        }
    }
}

/// The session that owns a task. Authorization compares sessions for equality
/// (of the strings; interning only shares their memory between the records,
/// keys and requests of one session).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SessionId(Arc<str>);

impl SessionId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The owner of what `identity` — a name the transport authenticated, never
    /// one a message claims — does under the session label it chose:
    /// `identity/label`. The label may hold `/` itself; the identity never does,
    /// so no label can reach another identity's owners.
    pub fn scoped(identity: &str, label: &SessionId) -> Result<SessionId, IdError> {
        let valid = !identity.is_empty()
            && identity.len() <= MAX_IDENTITY_LEN
            && identity.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'-'));
        if !valid {
            return Err(IdError::Identity(shorten(identity)));
        }
        format!("{identity}{IDENTITY_SEPARATOR}{}", label.as_str()).parse()
    }

    /// Who this owner is: the identity before the first `/`. On a cluster
    /// without authentication a session is whatever its client claimed, and one
    /// without `/` is its own identity.
    pub fn identity(&self) -> &str {
        self.0.split(IDENTITY_SEPARATOR).next().unwrap_or(&self.0)
    }
}

impl FromStr for SessionId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let ok =
            !s.is_empty() && s.len() <= MAX_SESSION_LEN && s.chars().all(|c| !c.is_whitespace() && !c.is_control());
        if ok {
            Ok(SessionId(SESSIONS.intern(s)))
        } else {
            Err(IdError::Session(shorten(s)))
        }
    }
}

/// The serde plumbing shared by the string-shaped ids: they travel as strings and
/// are validated by `FromStr` on the way in. With `newtype`, also `Display` of
/// the wrapped string.
macro_rules! string_id {
    ($t:ty) => {
        impl TryFrom<String> for $t {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.to_string()
            }
        }
    };
    ($t:ty, newtype) => {
        string_id!($t);

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(Kind, newtype);
string_id!(TaskId);
string_id!(WorkerId, newtype);
string_id!(SessionId, newtype);

/// Fencing token of a coordinator's leadership term. Strictly increases at each
/// takeover; anything carrying a lower epoch than one already seen is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch after this one, saturating: a term at `u64::MAX` has no
    /// successor, and the registry refuses to claim an epoch that is not
    /// above the last claim ([`Epoch::checked_next`]), so nothing ever wraps
    /// back to 0.
    pub fn next(self) -> Epoch {
        Epoch(self.0.saturating_add(1))
    }

    /// The epoch after this one; `None` once epochs are exhausted.
    pub fn checked_next(self) -> Option<Epoch> {
        self.0.checked_add(1).map(Epoch)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One execution try of a task. Attempt 0 means "never leased"; each grant
/// increments it, so a report naming an older attempt is stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
pub struct Attempt(pub u32);

impl Attempt {
    pub fn next(self) -> Attempt {
        Attempt(self.0.saturating_add(1))
    }
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn owners_are_scoped_under_their_identity() {
        let label: SessionId = "ci/7".parse().unwrap();
        let owner = SessionId::scoped("alice", &label).unwrap();
        assert_eq!(owner.as_str(), "alice/ci/7");
        assert_eq!(owner.identity(), "alice");
        assert_eq!("bob".parse::<SessionId>().unwrap().identity(), "bob");
        for bad in ["", "a/b", "a b", "a*", "a.b", &"x".repeat(65)] {
            assert!(matches!(SessionId::scoped(bad, &label), Err(IdError::Identity(_))), "{bad:?}");
        }
        let long: SessionId = "s".repeat(MAX_SESSION_LEN).parse().unwrap();
        assert!(matches!(SessionId::scoped("alice", &long), Err(IdError::Session(_))));
    }

    #[test]
    fn task_ids_round_trip() {
        for s in ["shell-1", "agent-42", "my-kind-7", "a_b-18446744073709551615", "x9-3"] {
            let id: TaskId = s.parse().unwrap();
            assert_eq!(id.to_string(), s);
        }
        let id: TaskId = "my-kind-7".parse().unwrap();
        assert_eq!(id.kind().as_str(), "my-kind");
        assert_eq!(id.number(), 7);
    }

    #[test]
    fn task_ids_reject_everything_else() {
        for s in [
            "",
            "shell",
            "shell-",
            "-1",
            "shell-0",
            "shell-01",
            "shell-+1",
            "Shell-1",
            "1shell-1",
            "she ll-1",
            "shell-1 ",
            "shell.x-1",
            "shell-18446744073709551616",
            "shell-1a",
            "abcdefghijabcdefghijabcdefghijabc-1",
            "shell-١",
        ] {
            assert!(s.parse::<TaskId>().is_err(), "{s:?} should be rejected");
        }
    }

    #[test]
    fn counters_saturate_instead_of_wrapping() {
        assert_eq!(Epoch(u64::MAX).next(), Epoch(u64::MAX));
        assert_eq!(Epoch(u64::MAX).checked_next(), None);
        assert_eq!(Epoch(7).checked_next(), Some(Epoch(8)));
        assert_eq!(Attempt(u32::MAX).next(), Attempt(u32::MAX));
    }

    #[test]
    fn kind_length_limit_is_inclusive() {
        assert!("a".repeat(32).parse::<Kind>().is_ok());
        assert!("a".repeat(33).parse::<Kind>().is_err());
    }

    #[test]
    fn worker_and_session_ids() {
        assert!("w1".parse::<WorkerId>().is_ok());
        for s in ["", "W1", "w.1", "w*", "w>", "w 1", "a/b"] {
            assert!(s.parse::<WorkerId>().is_err(), "{s:?}");
        }
        assert!("alice@host".parse::<SessionId>().is_ok());
        for s in ["", "a b", "a\nb"] {
            assert!(s.parse::<SessionId>().is_err(), "{s:?}");
        }
    }

    #[test]
    fn serde_validates_on_the_way_in() {
        let bytes = rmp_serde::to_vec("shell-0").unwrap();
        assert!(rmp_serde::from_slice::<TaskId>(&bytes).is_err());
        let bytes = rmp_serde::to_vec("shell-3").unwrap();
        assert_eq!(rmp_serde::from_slice::<TaskId>(&bytes).unwrap().number(), 3);
    }

    #[test]
    fn interned_ids_travel_as_plain_strings_and_share_memory() {
        let id: TaskId = "noop-1".parse().unwrap();
        let bytes = rmp_serde::to_vec(&id).unwrap();
        assert_eq!(bytes, rmp_serde::to_vec("noop-1").unwrap(), "the wire shape is a string");
        let back: TaskId = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back, id);
        assert!(std::ptr::eq(back.kind().as_str(), id.kind().as_str()), "one allocation per kind");
        let clone = back.clone();
        assert!(std::ptr::eq(clone.kind().as_str(), id.kind().as_str()), "a clone allocates nothing");

        let kind: Kind = rmp_serde::from_slice(&rmp_serde::to_vec("shell").unwrap()).unwrap();
        assert_eq!(kind, Kind::shell());
        assert!(std::ptr::eq(kind.as_str(), Kind::shell().as_str()));
        assert!(rmp_serde::from_slice::<Kind>(&rmp_serde::to_vec("Shell").unwrap()).is_err());

        let session: SessionId = rmp_serde::from_slice(&rmp_serde::to_vec("alice@host").unwrap()).unwrap();
        assert_eq!(session.as_str(), "alice@host");
        assert!(std::ptr::eq(session.as_str(), "alice@host".parse::<SessionId>().unwrap().as_str()));
        assert_ne!(session, "bob@host".parse().unwrap());
        let worker: WorkerId = rmp_serde::from_slice(&rmp_serde::to_vec("w1").unwrap()).unwrap();
        assert!(std::ptr::eq(worker.as_str(), "w1".parse::<WorkerId>().unwrap().as_str()));
        assert_eq!(worker.to_string(), "w1");
    }

    proptest! {
        #[test]
        fn parse_never_panics_and_round_trips(s in "\\PC{0,40}") {
            if let Ok(id) = s.parse::<TaskId>() {
                prop_assert_eq!(id.to_string(), s);
            }
        }

        #[test]
        fn valid_ids_round_trip(kind in "[a-z][a-z0-9_-]{0,31}", n in 1u64..) {
            let id = TaskId::new(kind.parse().unwrap(), n).unwrap();
            prop_assert_eq!(id.to_string().parse::<TaskId>().unwrap(), id);
        }
    }
}
