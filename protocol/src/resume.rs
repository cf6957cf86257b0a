//! Resuming an agent instead of losing it: what an `agent` task declares
//! ([`ResumeSpec`]: a resume command with placeholders, the output patterns
//! that capture their values, where it may resume), and the pure rules the
//! coordinator applies with it — which values an output line gives
//! ([`ResumeSpec::capture`]), the command a resumed attempt runs
//! ([`ResumeSpec::fill`]), and whether a lost attempt may be resumed at all
//! ([`proves_gone`], [`decide`]).
//!
//! Most coding agents keep their session on disk and can pick it up again
//! (`claude --resume ID`, `codex resume ID`). A task that declares how is
//! started again with that command when — and only when — its previous
//! attempt's process is proven gone: its shim died and the worker ended what
//! was left of its group and control group, or the machine booted since the
//! attempt started. A machine that merely stopped answering proves nothing
//! (its process may run on), so the task waits `unknown` as any other.
//!
//! **Invariant:** a resumed attempt never overlaps the one it resumes: the
//! only inputs that say "resume" are proofs that the earlier process cannot
//! run any more ([`proves_gone`]).
//!
//! Captured values come from the task's own output, the least trusted input
//! there is: they are bounded, refused when they hold control characters, and
//! always shell-quoted into the command, so a value can never become a
//! second command.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::WorkerId;
use crate::lifecycle::HintTag;
use crate::spec::{MAX_COMMAND_BYTES, MAX_PATTERN_BYTES};

/// Most capture patterns a task may declare.
pub const MAX_CAPTURES: usize = 8;
/// Longest captured value kept (bytes); a longer match is cut.
pub const MAX_CAPTURE_VALUE_BYTES: usize = 256;
/// Longest capture name (bytes).
pub const MAX_CAPTURE_NAME_BYTES: usize = 64;
/// Most times one task is resumed; past it, a lost attempt leaves the task
/// `unknown` as it would without a resume command (an agent that loses its
/// machine again and again needs a person).
pub const MAX_RESUMES: u32 = 10;
/// Most messages kept for a task's next attempt while none runs.
pub const MAX_PENDING_INPUT: usize = 16;
/// Largest total of the messages kept for a task's next attempt (bytes):
/// under a pipe's capacity, so the shim writes them all before the task
/// reads a byte, without blocking.
pub const MAX_PENDING_INPUT_BYTES: usize = 16 * 1024;
/// Longest kept message (bytes): one atomic write into a pipe (`PIPE_BUF`).
pub const MAX_PENDING_MESSAGE_BYTES: usize = 4096;

/// How an `agent` task is resumed after its machine lost it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeSpec {
    /// The command a resumed attempt runs (`sh -c`), with `{name}`
    /// placeholders for captured values, e.g. `agent --resume {session}`.
    pub command: Box<str>,
    /// Regular expressions matched against each output line; their groups
    /// capture values (see [`capture_names`] for how a group is named). The
    /// latest value of each name is kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub captures: Vec<Box<str>>,
    /// May resume on any machine that can run it (the session lives on
    /// shared storage); by default only on the machine that lost it, once it
    /// returns.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub anywhere: bool,
}

/// What the registry keeps of a task that declares a resume command.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeState {
    /// The latest value of each capture name, as its output gave it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub captured: BTreeMap<String, String>,
    /// How many times the task was resumed.
    #[serde(default)]
    pub resumes: u32,
    /// Input kept for the next attempt, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending_input: Vec<String>,
    /// Kept input handed to the current attempt's grant: its shim writes
    /// it before the task starts. Cleared once the attempt started (or was
    /// lost: never handed to a second attempt); back to `pending_input`
    /// when the grant is given back with nothing run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub granted_input: Vec<String>,
    /// Kept messages that reached no attempt: the attempt they were kept
    /// for proved alive after all (its machine came back running it), and
    /// input is never sent twice.
    #[serde(default)]
    pub dropped_input: u32,
    /// The machine a resumed attempt must run on (the one that lost it),
    /// unless the task may resume anywhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<WorkerId>,
    /// The boot id the machine heartbeated with when the current attempt
    /// was granted (see [`proves_gone`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted_boot: Option<Box<str>>,
}

impl ResumeState {
    /// Room for one more kept message of `len` bytes (counting the input
    /// already handed to a grant).
    pub fn room_for(&self, len: usize) -> Result<(), String> {
        if len == 0 || len > MAX_PENDING_MESSAGE_BYTES {
            return Err(format!("a kept message holds 1 to {MAX_PENDING_MESSAGE_BYTES} bytes, not {len}"));
        }
        let kept = || self.pending_input.iter().chain(&self.granted_input);
        let (count, total) = (kept().count(), kept().map(String::len).sum::<usize>());
        if count >= MAX_PENDING_INPUT || total + len > MAX_PENDING_INPUT_BYTES {
            return Err(format!(
                "{count} messages ({total} bytes) are kept already, at most {MAX_PENDING_INPUT} \
                 ({MAX_PENDING_INPUT_BYTES} bytes) are"
            ));
        }
        Ok(())
    }
}

/// What a task's snapshot shows of its resume declaration and state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeView {
    pub spec: ResumeSpec,
    #[serde(default)]
    pub captured: BTreeMap<String, String>,
    #[serde(default)]
    pub resumes: u32,
    /// How many messages are kept for the next attempt.
    #[serde(default)]
    pub pending_input: u32,
    #[serde(default)]
    pub dropped_input: u32,
    /// The machine it resumes on, while it waits to.
    #[serde(default)]
    pub machine: Option<WorkerId>,
}

impl ResumeView {
    pub fn of(spec: &ResumeSpec, state: Option<&ResumeState>) -> ResumeView {
        let state = state.cloned().unwrap_or_default();
        ResumeView {
            spec: spec.clone(),
            captured: state.captured,
            resumes: state.resumes,
            pending_input: (state.pending_input.len() + state.granted_input.len()) as u32,
            dropped_input: state.dropped_input,
            machine: state.machine,
        }
    }
}

/// Why a resume declaration was refused at submit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResumeError {
    #[error("only an agent task can be resumed (this one is a {0} task)")]
    NotAgent(String),
    #[error("an idempotent task is run again from the start when it is lost; a resume command is for tasks that must not be")]
    Idempotent,
    #[error("the resume command is empty")]
    EmptyCommand,
    #[error("the resume command contains a NUL byte")]
    NulByte,
    #[error("the resume command is {0} bytes, the limit is {MAX_COMMAND_BYTES}")]
    TooLong(usize),
    #[error("at most {MAX_CAPTURES} capture patterns")]
    TooManyCaptures,
    #[error("capture pattern {pattern:?}: {reason}")]
    Capture { pattern: String, reason: String },
    #[error("the capture name {0:?} is given twice")]
    DuplicateName(String),
    #[error("the resume command uses {{{0}}}, which no capture pattern names")]
    UnknownPlaceholder(String),
    #[error("captures without a resume command capture for nothing")]
    CapturesWithoutCommand,
}

impl ResumeSpec {
    /// Checks the command, the patterns and that every placeholder is named
    /// by a pattern. `kind_is_agent` and `idempotent` are the task's.
    pub fn validate(&self, kind: &str, idempotent: bool) -> Result<(), ResumeError> {
        if kind != "agent" {
            return Err(ResumeError::NotAgent(kind.to_owned()));
        }
        if idempotent {
            return Err(ResumeError::Idempotent);
        }
        if self.command.trim().is_empty() {
            return Err(ResumeError::EmptyCommand);
        }
        if self.command.contains('\0') {
            return Err(ResumeError::NulByte);
        }
        if self.command.len() > MAX_COMMAND_BYTES {
            return Err(ResumeError::TooLong(self.command.len()));
        }
        let names = self.names()?;
        for p in placeholders(&self.command) {
            if !names.iter().any(|n| n == p) {
                return Err(ResumeError::UnknownPlaceholder(p.to_owned()));
            }
        }
        Ok(())
    }

    /// Every capture name, in pattern order; refused when a pattern is bad
    /// or a name repeats.
    pub fn names(&self) -> Result<Vec<String>, ResumeError> {
        if self.captures.len() > MAX_CAPTURES {
            return Err(ResumeError::TooManyCaptures);
        }
        let mut names: Vec<String> = Vec::new();
        for pattern in &self.captures {
            let refuse = |reason: String| ResumeError::Capture { pattern: pattern.to_string(), reason };
            if pattern.len() > MAX_PATTERN_BYTES {
                return Err(refuse(format!("longer than {MAX_PATTERN_BYTES} bytes")));
            }
            for name in capture_names(pattern).map_err(refuse)? {
                if name.len() > MAX_CAPTURE_NAME_BYTES {
                    return Err(refuse(format!("the name {name:?} is longer than {MAX_CAPTURE_NAME_BYTES} bytes")));
                }
                if names.contains(&name) {
                    return Err(ResumeError::DuplicateName(name));
                }
                names.push(name);
            }
        }
        Ok(names)
    }

    /// The one pattern the worker matches output lines against: any line
    /// that one of the captures may take a value from. `None` without
    /// captures.
    pub fn line_pattern(&self) -> Option<String> {
        (!self.captures.is_empty())
            .then(|| self.captures.iter().map(|p| format!("(?:{p})")).collect::<Vec<_>>().join("|"))
    }

    /// The capture patterns compiled once, to take values from many lines
    /// (a pattern that does not compile or names nothing — refused at
    /// submit — takes none).
    pub fn capturer(&self) -> Capturer {
        let patterns = self
            .captures
            .iter()
            .filter_map(|p| {
                let regex = regex::Regex::new(p).ok()?;
                let named = regex.capture_names().flatten().next().is_some();
                Some((capture_names(p).ok()?, named, regex))
            })
            .collect();
        Capturer { patterns }
    }

    /// The values `line` gives, by name (see [`Capturer::capture`]).
    pub fn capture(&self, line: &str) -> Vec<(String, String)> {
        self.capturer().capture(line)
    }

    /// The command a resumed attempt runs: every placeholder replaced by its
    /// value, shell-quoted. `Err` names the placeholders with no value yet.
    pub fn fill(&self, values: &BTreeMap<String, String>) -> Result<String, Vec<String>> {
        let missing: Vec<String> =
            placeholders(&self.command).filter(|p| !values.contains_key(*p)).map(str::to_owned).collect();
        if !missing.is_empty() {
            return Err(missing);
        }
        let mut out = String::with_capacity(self.command.len());
        let mut rest: &str = &self.command;
        while let Some((before, name, after)) = next_placeholder(rest) {
            out.push_str(before);
            out.push_str(&shell_quote(&values[name]));
            rest = after;
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// A resume declaration's capture patterns, compiled: each with its names
/// and whether they are named groups (or the one group a leading word names).
pub struct Capturer {
    patterns: Vec<(Vec<String>, bool, regex::Regex)>,
}

impl Capturer {
    /// The values `line` gives, by name (a pattern that does not match gives
    /// none; a value with a control character is not taken).
    pub fn capture(&self, line: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (names, named, regex) in &self.patterns {
            let Some(caps) = regex.captures(line) else { continue };
            let groups: Vec<Option<regex::Match>> = match named {
                true => names.iter().map(|n| caps.name(n)).collect(),
                false => vec![caps.get(1)],
            };
            for (name, m) in names.iter().zip(groups) {
                let Some(value) = m.map(|m| head(m.as_str(), MAX_CAPTURE_VALUE_BYTES)) else { continue };
                if !value.is_empty() && !value.chars().any(char::is_control) {
                    out.push((name.clone(), value.to_owned()));
                }
            }
        }
        out
    }
}

/// The names a capture pattern gives values to: its named groups
/// (`(?<session>\S+)`), or — for a pattern with one unnamed group and no
/// named one — the word it starts with (`session: (\S+)` captures
/// `session`). Anything else is refused with what to write instead.
pub fn capture_names(pattern: &str) -> Result<Vec<String>, String> {
    let regex = regex::Regex::new(pattern).map_err(|e| e.to_string())?;
    let named: Vec<String> = regex.capture_names().flatten().map(str::to_owned).collect();
    if !named.is_empty() {
        if regex.captures_len() - 1 != named.len() {
            return Err("mixes named and unnamed groups: name every group, or use (?:…) for the others".into());
        }
        return Ok(named);
    }
    if regex.captures_len() != 2 {
        return Err("needs exactly one group to capture, or named groups: (?<name>…)".into());
    }
    let word: String = pattern.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
    let follows = pattern[word.len()..].chars().next();
    if word.is_empty() || word.starts_with(|c: char| c.is_ascii_digit()) || follows.is_none_or(|c| c == '(') {
        return Err("does not start with a word to name its value: name the group, (?<name>…)".into());
    }
    Ok(vec![word])
}

/// The `{name}` placeholders of a command, in order (a `{` not followed by
/// a name and `}` is an ordinary character).
fn placeholders(command: &str) -> impl Iterator<Item = &str> {
    let mut rest = command;
    std::iter::from_fn(move || {
        let (_, name, after) = next_placeholder(rest)?;
        rest = after;
        Some(name)
    })
}

/// The text before the next placeholder, its name, and the text after it.
fn next_placeholder(s: &str) -> Option<(&str, &str, &str)> {
    let mut from = 0;
    while let Some(open) = s[from..].find('{').map(|i| i + from) {
        let body = &s[open + 1..];
        let len = body.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(body.len());
        if len > 0 && body[len..].starts_with('}') {
            return Some((&s[..open], &body[..len], &body[len + 1..]));
        }
        from = open + 1;
    }
    None
}

/// `value` as one shell word, in single quotes.
pub fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

fn head(s: &str, max: usize) -> &str {
    let mut cut = s.len().min(max);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    &s[..cut]
}

/// Who said an attempt's process is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossWitness {
    /// The worker that held it: its shim died, and the worker ended what
    /// was left of the group and the control group before reporting.
    Worker,
    /// The machine's sidecar, answering the leader's evidence query about an
    /// attempt of a worker that stopped answering.
    Sidecar,
}

/// Whether a loss proves the attempt's process can no longer run: the
/// worker saw it end (it ended the rest itself), or the machine booted
/// since the attempt started — said by the machine's records
/// (`machine-restarted`), or, for a machine whose store was replaced, by
/// its boot now differing from the boot it heartbeated with when the
/// attempt was granted (`boot_then`, `boot_now`; an unknown boot proves
/// nothing). A sidecar without the process and without its exit status, an
/// unreadable record, or a replaced store on the same boot prove nothing:
/// the process may run on, unseen.
pub fn proves_gone(witness: LossWitness, tag: HintTag, boot_then: Option<&str>, boot_now: Option<&str>) -> bool {
    match (witness, tag) {
        (LossWitness::Worker, HintTag::MaybeRan | HintTag::MachineRestarted) => true,
        (_, HintTag::MachineRestarted) => true,
        (LossWitness::Sidecar, HintTag::MachineReplaced) => {
            matches!((boot_then, boot_now), (Some(then), Some(now)) if then != now)
        }
        _ => false,
    }
}

/// What the coordinator does with a lost attempt of a task that declares a
/// resume command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeVerdict {
    /// Start the resume command as the next attempt.
    Resume,
    /// The loss stands (`unknown`), for the reason given (shown in the hint).
    Stays(String),
}

/// Whether a lost attempt is resumed: only when its process is proven gone
/// (`gone`), nobody asked to kill the task, the task was resumed fewer than
/// [`MAX_RESUMES`] times, and every placeholder has a captured value.
pub fn decide(
    spec: &ResumeSpec,
    gone: bool,
    kill_requested: bool,
    resumes: u32,
    values: &BTreeMap<String, String>,
) -> ResumeVerdict {
    if kill_requested {
        return ResumeVerdict::Stays("a kill was requested".into());
    }
    if !gone {
        return ResumeVerdict::Stays(
            "its process is not proven gone (the machine may still run it), so it is not resumed; it is resumed \
             once its machine proves the process gone"
                .into(),
        );
    }
    if resumes >= MAX_RESUMES {
        return ResumeVerdict::Stays(format!("it was resumed {resumes} times already, the most allowed"));
    }
    match spec.fill(values) {
        Ok(_) => ResumeVerdict::Resume,
        Err(missing) => ResumeVerdict::Stays(format!(
            "its resume command needs {}, which its output never gave",
            missing.iter().map(|m| format!("{{{m}}}")).collect::<Vec<_>>().join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(command: &str, captures: &[&str]) -> ResumeSpec {
        ResumeSpec {
            command: command.into(),
            captures: captures.iter().map(|c| (*c).into()).collect(),
            anywhere: false,
        }
    }

    fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn names_come_from_named_groups_or_the_leading_word() {
        assert_eq!(capture_names(r"session: (\S+)"), Ok(vec!["session".into()]));
        assert_eq!(capture_names(r"id=(\w+)"), Ok(vec!["id".into()]));
        assert_eq!(capture_names(r"(?<session>\S+) at (?P<dir>\S+)"), Ok(vec!["session".into(), "dir".into()]));
        for bad in [r"(\S+)", r"session: \S+", r"a (\S+) (\S+)", r"(?<x>\S+) (\S+)", r"1st: (\S+)", "sess(ion)", "("] {
            assert!(capture_names(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_resume_declaration_is_checked_whole() {
        let ok = spec("agent --resume {session}", &[r"session: (\S+)"]);
        assert_eq!(ok.validate("agent", false), Ok(()));
        assert_eq!(spec("agent --continue", &[]).validate("agent", false), Ok(()));
        // `{` that is no placeholder is an ordinary character.
        assert_eq!(spec("echo '{' { x} {}", &[]).validate("agent", false), Ok(()));
        type Case<'a> = (ResumeSpec, &'a str, bool, fn(&ResumeError) -> bool);
        let cases: Vec<Case> = vec![
            (ok.clone(), "shell", false, |e| matches!(e, ResumeError::NotAgent(_))),
            (ok.clone(), "agent", true, |e| matches!(e, ResumeError::Idempotent)),
            (spec(" ", &[]), "agent", false, |e| matches!(e, ResumeError::EmptyCommand)),
            (spec("a\0b", &[]), "agent", false, |e| matches!(e, ResumeError::NulByte)),
            (spec(&"x".repeat(MAX_COMMAND_BYTES + 1), &[]), "agent", false, |e| matches!(e, ResumeError::TooLong(_))),
            (
                spec("a {sesion}", &[r"session: (\S+)"]),
                "agent",
                false,
                |e| matches!(e, ResumeError::UnknownPlaceholder(p) if p == "sesion"),
            ),
            (
                spec("a {x}", &[r"x: (\S+)", r"(?<x>\d+)"]),
                "agent",
                false,
                |e| matches!(e, ResumeError::DuplicateName(n) if n == "x"),
            ),
            (spec("a", &["x: (["]), "agent", false, |e| matches!(e, ResumeError::Capture { .. })),
            (spec("a", &[r"x: (\S+)"; MAX_CAPTURES + 1]), "agent", false, |e| {
                matches!(e, ResumeError::TooManyCaptures)
            }),
        ];
        for (s, kind, idempotent, check) in cases {
            let got = s.validate(kind, idempotent);
            assert!(got.as_ref().is_err_and(check), "{s:?} as {kind}: {got:?}");
        }
    }

    #[test]
    fn lines_give_values_bounded_and_without_control_characters() {
        let s = spec("a {session} {dir}", &[r"session: (\S+)", r"cwd=(?<dir>/\S*)"]);
        assert_eq!(s.capture("session: abc-123 ready"), vec![("session".into(), "abc-123".into())]);
        assert_eq!(s.capture("cwd=/repo"), vec![("dir".into(), "/repo".into())]);
        assert_eq!(s.capture("nothing here"), vec![]);
        let long = format!("session: {}", "é".repeat(MAX_CAPTURE_VALUE_BYTES));
        let got = s.capture(&long);
        assert!(got[0].1.len() <= MAX_CAPTURE_VALUE_BYTES && got[0].1.chars().all(|c| c == 'é'));
        assert_eq!(s.capture("session: a\u{1b}[2Jb"), vec![]);
        let pattern = s.line_pattern().expect("captures give a pattern");
        let re = regex::Regex::new(&pattern).expect("the union compiles");
        assert!(re.is_match("session: x") && re.is_match("cwd=/") && !re.is_match("other"));
        assert_eq!(spec("a", &[]).line_pattern(), None);
    }

    #[test]
    fn values_are_shell_quoted_into_the_command() {
        let s = spec("agent --resume {session} --in {dir}", &[r"session: (\S+)", r"(?<dir>/\S*)"]);
        let hostile = values(&[("session", "x'; rm -rf ~; echo '"), ("dir", "/a b")]);
        let cmd = s.fill(&hostile).expect("all values given");
        assert_eq!(cmd, r#"agent --resume 'x'\''; rm -rf ~; echo '\''' --in '/a b'"#);
        assert_eq!(s.fill(&values(&[("dir", "/")])), Err(vec!["session".to_owned()]));
        assert_eq!(spec("agent --continue", &[]).fill(&BTreeMap::new()), Ok("agent --continue".into()));
    }

    /// Only a worker that saw the end, or a machine that booted since, proves
    /// the process gone.
    #[test]
    fn what_proves_a_process_gone_as_a_table() {
        use HintTag::*;
        use LossWitness::*;
        type Row<'a> = (LossWitness, HintTag, Option<&'a str>, Option<&'a str>, bool);
        let rows: &[Row] = &[
            (Worker, MaybeRan, None, None, true),
            (Worker, MachineRestarted, None, None, true),
            (Worker, SidecarCorrupt, None, None, false),
            (Sidecar, MachineRestarted, None, None, true),
            (Sidecar, MaybeRan, None, None, false),
            (Sidecar, SidecarCorrupt, None, None, false),
            (Sidecar, MachineReplaced, Some("b1"), Some("b2"), true),
            (Sidecar, MachineReplaced, Some("b1"), Some("b1"), false),
            (Sidecar, MachineReplaced, None, Some("b2"), false),
            (Sidecar, MachineReplaced, Some("b1"), None, false),
            (Sidecar, WorkerUnreachable, Some("b1"), Some("b2"), false),
        ];
        for (i, (w, tag, then, now, want)) in rows.iter().enumerate() {
            assert_eq!(proves_gone(*w, *tag, *then, *now), *want, "row {i}");
        }
    }

    #[test]
    fn a_loss_resumes_only_when_proven_unkilled_within_bounds_and_filled() {
        let s = spec("agent --resume {session}", &[r"session: (\S+)"]);
        let v = values(&[("session", "abc")]);
        assert_eq!(decide(&s, true, false, 0, &v), ResumeVerdict::Resume);
        assert_eq!(decide(&s, true, false, MAX_RESUMES - 1, &v), ResumeVerdict::Resume);
        for (gone, kill, resumes, values) in [
            (false, false, 0, v.clone()),
            (true, true, 0, v.clone()),
            (true, false, MAX_RESUMES, v),
            (true, false, 0, BTreeMap::new()),
        ] {
            assert!(matches!(decide(&s, gone, kill, resumes, &values), ResumeVerdict::Stays(_)));
        }
    }
}
