//! Where a task may run and how many of a kind of work may run at once: the
//! worker's labels, a task's constraints on them, and its concurrency key.
//!
//! All of it is parsed and checked here, once, and is pure: whether a worker
//! can take a task is [`Placement::admits`] over the labels the worker sent
//! in its last heartbeat. It must never accept a label or a constraint it
//! could not print back the way it read it, nor let a malformed one match
//! anything.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest label key or value (bytes), as in Kubernetes.
pub const MAX_LABEL_PART_BYTES: usize = 63;
/// Most labels a worker may carry.
pub const MAX_WORKER_LABELS: usize = 32;
/// Most constraints a task may set.
pub const MAX_CONSTRAINTS: usize = 16;
/// Most values one `in`/`notin` constraint may list.
pub const MAX_CONSTRAINT_VALUES: usize = 16;
/// Highest concurrency limit a task may name.
pub const MAX_CONCURRENCY_LIMIT: u32 = 100_000;

/// A worker's labels, as it declared them (`--label gpu=a100`).
pub type Labels = BTreeMap<String, String>;

/// Why a label, a constraint or a concurrency key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "{what} {got:?}: use 1 to {MAX_LABEL_PART_BYTES} letters, digits, '.', '_', '-' or '/', starting with a \
         letter or digit"
    )]
    BadName { what: &'static str, got: String },
    #[error("label {0:?}: write it as KEY=VALUE")]
    BadLabel(String),
    #[error(
        "constraint {0:?}: write KEY=VALUE, KEY!=VALUE, 'KEY in (A,B)', 'KEY notin (A,B)', KEY (it is set) or !KEY \
         (it is not)"
    )]
    BadConstraint(String),
    #[error("{what}: at most {max} ({got} given)")]
    TooMany { what: &'static str, got: usize, max: usize },
    #[error("concurrency limit {0}: from 1 to {MAX_CONCURRENCY_LIMIT}")]
    BadLimit(u32),
    #[error("a concurrency limit needs its concurrency key")]
    LimitWithoutKey,
}

fn check_name(what: &'static str, s: &str) -> Result<(), PlacementError> {
    let ok = !s.is_empty()
        && s.len() <= MAX_LABEL_PART_BYTES
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
    match ok {
        true => Ok(()),
        false => Err(PlacementError::BadName { what, got: s.chars().take(80).collect() }),
    }
}

/// Parses one `KEY=VALUE` worker label.
pub fn parse_label(s: &str) -> Result<(String, String), PlacementError> {
    let (k, v) = s.split_once('=').ok_or_else(|| PlacementError::BadLabel(s.chars().take(80).collect()))?;
    let (k, v) = (k.trim(), v.trim());
    check_name("label key", k)?;
    check_name("label value", v)?;
    Ok((k.to_owned(), v.to_owned()))
}

/// Checks a worker's whole label set (as read from its options, or as
/// received in a heartbeat).
pub fn check_labels(labels: &Labels) -> Result<(), PlacementError> {
    if labels.len() > MAX_WORKER_LABELS {
        return Err(PlacementError::TooMany { what: "labels", got: labels.len(), max: MAX_WORKER_LABELS });
    }
    for (k, v) in labels {
        check_name("label key", k)?;
        check_name("label value", v)?;
    }
    Ok(())
}

/// What a constraint asks of one label.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Test {
    /// Set, to one of these values (`KEY=V`, `KEY in (A,B)`).
    In(Vec<String>),
    /// Not set, or set to none of these (`KEY!=V`, `KEY notin (A,B)`).
    NotIn(Vec<String>),
    /// Set, to anything (`KEY`).
    Exists,
    /// Not set (`!KEY`).
    Absent,
}

/// One condition on a worker's labels (`--on gpu=a100`, `--on 'repo in (web,api)'`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constraint {
    pub key: String,
    pub test: Test,
}

impl Constraint {
    /// Whether `labels` satisfy it.
    pub fn holds(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match &self.test {
            Test::In(values) => value.is_some_and(|v| values.contains(v)),
            Test::NotIn(values) => value.is_none_or(|v| !values.contains(v)),
            Test::Exists => value.is_some(),
            Test::Absent => value.is_none(),
        }
    }

    fn check(&self) -> Result<(), PlacementError> {
        check_name("constraint key", &self.key)?;
        if let Test::In(values) | Test::NotIn(values) = &self.test {
            if values.is_empty() {
                return Err(PlacementError::BadConstraint(self.to_string()));
            }
            if values.len() > MAX_CONSTRAINT_VALUES {
                return Err(PlacementError::TooMany {
                    what: "values in one constraint",
                    got: values.len(),
                    max: MAX_CONSTRAINT_VALUES,
                });
            }
            for v in values {
                check_name("constraint value", v)?;
            }
        }
        Ok(())
    }
}

impl FromStr for Constraint {
    type Err = PlacementError;

    fn from_str(s: &str) -> Result<Constraint, PlacementError> {
        let bad = || PlacementError::BadConstraint(s.chars().take(80).collect());
        let t = s.trim();
        let list = |rest: &str| -> Result<Vec<String>, PlacementError> {
            let inner = rest.trim().strip_prefix('(').and_then(|r| r.strip_suffix(')')).ok_or_else(bad)?;
            Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
        };
        let constraint = if let Some((k, v)) = t.split_once("!=") {
            Constraint { key: k.trim().into(), test: Test::NotIn(vec![v.trim().into()]) }
        } else if let Some((k, v)) = t.split_once('=') {
            Constraint { key: k.trim().into(), test: Test::In(vec![v.trim().into()]) }
        } else if let Some((k, rest)) = t.split_once(" notin ") {
            Constraint { key: k.trim().into(), test: Test::NotIn(list(rest)?) }
        } else if let Some((k, rest)) = t.split_once(" in ") {
            Constraint { key: k.trim().into(), test: Test::In(list(rest)?) }
        } else if let Some(k) = t.strip_prefix('!') {
            Constraint { key: k.trim().into(), test: Test::Absent }
        } else {
            Constraint { key: t.into(), test: Test::Exists }
        };
        constraint.check().map_err(|e| match e {
            PlacementError::BadName { .. } if constraint.key.contains([' ', '(', ')', ',']) => bad(),
            e => e,
        })?;
        Ok(constraint)
    }
}

impl fmt::Display for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = &self.key;
        match &self.test {
            Test::In(v) if v.len() == 1 => write!(f, "{k}={}", v[0]),
            Test::NotIn(v) if v.len() == 1 => write!(f, "{k}!={}", v[0]),
            Test::In(v) => write!(f, "{k} in ({})", v.join(",")),
            Test::NotIn(v) => write!(f, "{k} notin ({})", v.join(",")),
            Test::Exists => write!(f, "{k}"),
            Test::Absent => write!(f, "!{k}"),
        }
    }
}

/// A cluster-wide cap on the running tasks that share a key
/// (`--concurrency-key llm --concurrency-limit 3`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Concurrency {
    pub key: String,
    /// The task's own limit; the coordinator's configured limit for the key
    /// wins, and a task without either takes the one in force for the key.
    #[serde(default)]
    pub limit: Option<u32>,
}

/// Where a task may run ([`Placement::on`]) and which concurrency key it
/// counts against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Every constraint must hold on a worker's labels for it to be granted the task.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on: Vec<Constraint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<Concurrency>,
}

impl Placement {
    /// A placement from what a user wrote (`--on`, `--concurrency-key`,
    /// `--concurrency-limit`); none when nothing was given, an error for a
    /// limit without a key or anything malformed.
    pub fn from_parts(
        on: &[String],
        key: Option<String>,
        limit: Option<u32>,
    ) -> Result<Option<Placement>, PlacementError> {
        if key.is_none() && limit.is_some() {
            return Err(PlacementError::LimitWithoutKey);
        }
        let on = on.iter().map(|c| c.parse()).collect::<Result<Vec<Constraint>, _>>()?;
        let placement = Placement { on, concurrency: key.map(|key| Concurrency { key, limit }) };
        placement.check()?;
        Ok((placement != Placement::default()).then_some(placement))
    }

    /// Whether a worker with `labels` may run the task.
    pub fn admits(&self, labels: &Labels) -> bool {
        self.on.iter().all(|c| c.holds(labels))
    }

    /// The constraints `labels` do not satisfy.
    pub fn unmet<'a>(&'a self, labels: &'a Labels) -> impl Iterator<Item = &'a Constraint> + 'a {
        self.on.iter().filter(|c| !c.holds(labels))
    }

    pub fn check(&self) -> Result<(), PlacementError> {
        if self.on.len() > MAX_CONSTRAINTS {
            return Err(PlacementError::TooMany { what: "constraints", got: self.on.len(), max: MAX_CONSTRAINTS });
        }
        for c in &self.on {
            c.check()?;
        }
        if let Some(c) = &self.concurrency {
            check_name("concurrency key", &c.key)?;
            if let Some(limit) = c.limit {
                if limit == 0 || limit > MAX_CONCURRENCY_LIMIT {
                    return Err(PlacementError::BadLimit(limit));
                }
            }
        }
        Ok(())
    }

    /// The constraints as a user writes them, joined by `, `.
    pub fn constraints_text(&self) -> String {
        self.on.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }
}

/// Labels as `k=v, k=v` (or `none`).
pub fn labels_text(labels: &Labels) -> String {
    if labels.is_empty() {
        return "none".into();
    }
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn constraints_read_and_print_the_way_they_are_written() {
        for (text, shown) in [
            ("gpu=a100", "gpu=a100"),
            (" gpu = a100 ", "gpu=a100"),
            ("gpu!=t4", "gpu!=t4"),
            ("repo in (web,api)", "repo in (web,api)"),
            ("repo in ( web , api )", "repo in (web,api)"),
            ("repo notin (web)", "repo!=web"),
            ("repo notin (web,api)", "repo notin (web,api)"),
            ("ssd", "ssd"),
            ("!spot", "!spot"),
            ("example.com/zone=eu-1", "example.com/zone=eu-1"),
        ] {
            let c: Constraint = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(c.to_string(), shown);
            assert_eq!(shown.parse::<Constraint>().as_ref(), Ok(&c), "round trip of {shown}");
        }
    }

    #[test]
    fn malformed_constraints_and_labels_are_refused() {
        for bad in ["", "=a", "gpu=", "repo in web", "repo in ()", "repo in (a,,b)", "a b", "-x", "k=v=w", "(x)"] {
            assert!(bad.parse::<Constraint>().is_err(), "{bad:?} was accepted");
        }
        let long = "k".repeat(MAX_LABEL_PART_BYTES + 1);
        assert!(long.parse::<Constraint>().is_err());
        let many = format!("k in ({})", vec!["v"; MAX_CONSTRAINT_VALUES + 1].join(","));
        assert!(matches!(many.parse::<Constraint>(), Err(PlacementError::TooMany { .. })));
        for bad in ["gpu", "=a100", "gpu=", "gpu=a 100", "gpu=a\n100", &format!("{long}=1")] {
            assert!(parse_label(bad).is_err(), "label {bad:?} was accepted");
        }
        assert_eq!(parse_label("gpu=a100"), Ok(("gpu".into(), "a100".into())));
        let too_many: Labels = (0..=MAX_WORKER_LABELS).map(|i| (format!("k{i}"), "v".into())).collect();
        assert!(check_labels(&too_many).is_err());
        assert!(check_labels(&labels(&[("bad key", "v")])).is_err());
    }

    #[test]
    fn every_test_against_present_other_and_missing_labels() {
        // Columns: the label is gpu=a100, gpu=t4, or not set.
        let cases = [
            ("gpu=a100", [true, false, false]),
            ("gpu!=a100", [false, true, true]),
            ("gpu in (a100,h100)", [true, false, false]),
            ("gpu notin (a100,h100)", [false, true, true]),
            ("gpu", [true, true, false]),
            ("!gpu", [false, false, true]),
        ];
        let workers = [labels(&[("gpu", "a100")]), labels(&[("gpu", "t4")]), labels(&[("zone", "eu")])];
        for (text, expected) in cases {
            let c: Constraint = text.parse().unwrap_or_else(|e| panic!("{e}"));
            for (w, want) in workers.iter().zip(expected) {
                assert_eq!(c.holds(w), want, "{text} on {w:?}");
            }
        }
    }

    #[test]
    fn a_placement_admits_a_worker_only_when_every_constraint_holds() {
        let p = Placement {
            on: vec![
                "gpu=a100".parse().unwrap_or_else(|e| panic!("{e}")),
                "!spot".parse().unwrap_or_else(|e| panic!("{e}")),
            ],
            concurrency: None,
        };
        assert!(p.admits(&labels(&[("gpu", "a100")])));
        assert!(!p.admits(&labels(&[("gpu", "a100"), ("spot", "yes")])));
        let unmet: Vec<String> = p.unmet(&labels(&[("spot", "1")])).map(ToString::to_string).collect();
        assert_eq!(unmet, ["gpu=a100", "!spot"]);
        assert!(Placement::default().admits(&Labels::new()), "no constraint: any worker");
    }

    #[test]
    fn concurrency_keys_and_limits_are_bounded() {
        let with =
            |key: &str, limit| Placement { on: vec![], concurrency: Some(Concurrency { key: key.into(), limit }) };
        assert_eq!(with("llm", Some(3)).check(), Ok(()));
        assert_eq!(with("llm", None).check(), Ok(()));
        assert_eq!(with("llm", Some(0)).check(), Err(PlacementError::BadLimit(0)));
        assert!(with("llm", Some(MAX_CONCURRENCY_LIMIT + 1)).check().is_err());
        assert!(with("", Some(1)).check().is_err());
        assert!(with("l l m", Some(1)).check().is_err());
        assert_eq!(Placement::from_parts(&[], None, Some(3)), Err(PlacementError::LimitWithoutKey));
        assert_eq!(Placement::from_parts(&[], None, None), Ok(None));
        let p = Placement::from_parts(&["gpu".into()], Some("llm".into()), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(p.map(|p| p.constraints_text()), Some("gpu".into()));
        assert!(Placement::from_parts(&["gpu in x".into()], None, None).is_err());
    }
}
