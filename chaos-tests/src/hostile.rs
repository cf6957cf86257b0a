//! The `hostile-task` fault: a task that tries to harm the machine it runs on
//! — deletes whatever it can reach, goes for the data directory it can guess
//! from its own scratch directory's name, writes a well-formed request that
//! would raise the machine's epoch fence to the top into the sidecar's socket,
//! and kills every process it may signal. The promise must hold anyway.
//!
//! Its first act is its ledger line, like every task of the load: from then
//! on it is judged like any other (never run twice, settled, and `completed`
//! only with its effect in the ledger); ending `failed` is as truthful as
//! `completed` for it.
//!
//! How destructive it may be depends on who it runs as. With the workers run
//! as root and `--run-as nobody` (the harness runs as root), it does
//! everything. Otherwise it runs as the user of the daemons *and of this
//! harness*: deleting their files or `kill -9 -1` would only show that a user
//! can harm itself, so it deletes its own directory and probes the socket,
//! and the report says so.

use std::path::Path;

/// Who the hostile task runs as, and so what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Workers run tasks as this unprivileged user: everything.
    RunAs(&'static str),
    /// Tasks run as the daemons' (and the harness's) own user.
    SameUser,
}

impl Mode {
    /// `RunAs("nobody")` when this process is root and `nobody` exists.
    pub fn detect() -> Mode {
        let root = nix::unistd::geteuid().is_root();
        if root && matches!(nix::unistd::User::from_name("nobody"), Ok(Some(_))) {
            Mode::RunAs("nobody")
        } else {
            Mode::SameUser
        }
    }

    /// The `--run-as` user of the workers, if any.
    pub fn run_as(self) -> Option<&'static str> {
        match self {
            Mode::RunAs(user) => Some(user),
            Mode::SameUser => None,
        }
    }

    /// One line for the report: what the hostile task does in this run.
    pub fn describe(self) -> String {
        match self {
            Mode::RunAs(user) => format!(
                "run as {user}: deletes its cwd, HOME, /tmp and the data dir it guesses, writes an epoch request \
                 to sidecar.sock, kill -9 -1"
            ),
            Mode::SameUser => "same uid as the daemons and the harness (not root): deletes its cwd and HOME, writes \
                               an epoch request to sidecar.sock; skips /tmp, the data dir and kill -9 -1, which \
                               would hit this user's own daemons and harness"
                .into(),
        }
    }
}

/// Connects to `$SOCK`, sends `$FRAME` (hex) and says what came back.
const PROBE: &str = r#"
import os, socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(os.environ["SOCK"])
except OSError as e:
    print("hostile: sidecar unreachable:", e.strerror)
    raise SystemExit(0)
try:
    s.settimeout(5)
    s.sendall(bytes.fromhex(os.environ["FRAME"]))
    got = s.recv(64)
except OSError:
    got = b""
print("hostile: sidecar answered" if got else "hostile: sidecar closed the connection")
"#;

/// The frame of `ObserveEpoch(u64::MAX)` as the worker would send it, in hex.
pub fn max_epoch_frame() -> String {
    let request = tenure_protocol::messages::SidecarRequest::ObserveEpoch(tenure_protocol::Epoch(u64::MAX));
    let body = tenure_protocol::encode(&request).unwrap_or_default();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    frame.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hostile task's command line. `append` is the ledger append every task
/// of the load starts with.
pub fn command(mode: Mode, append: &str) -> String {
    // The data directory, guessed from the scratch directory's name
    // (`<data-dir>.scratch/<task>.<attempt>`).
    let guess = r#"D="${PWD%.scratch/*}""#;
    let probe = format!(
        r#"if command -v python3 >/dev/null; then SOCK="$D/sidecar.sock" FRAME="$FRAME" python3 -c '{PROBE}' 2>&1; else echo "hostile: no python3, socket not probed"; fi"#
    );
    match mode {
        Mode::RunAs(_) => format!(
            r#"{append}
[ "$(id -u)" != 0 ] || {{ echo "hostile: running as root, refusing"; exit 99; }}
{guess}
rm -rf ./* ~/* /tmp/* 2>/dev/null
rm -rf "$D"/* "$D" 2>&1 | head -n 2
{probe}
kill -9 -1
echo "hostile: done"
true"#
        ),
        Mode::SameUser => format!(
            r#"{append}
{guess}
rm -rf ./* ~/* 2>/dev/null
{probe}
echo "hostile: done"
true"#
        ),
    }
}

/// Makes the run's directory passable and its ledger appendable for the
/// run-as user, and nothing more: the directory stays the harness's, so the
/// ledger cannot be deleted by a task (its entries can be appended, not
/// removed).
pub fn open_up(dir: &Path, ledger: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))?;
    std::fs::set_permissions(ledger, std::fs::Permissions::from_mode(0o622))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_run_as_task_deletes_beyond_itself_or_kills() {
        let append = "printf x >> /ledger";
        let same = command(Mode::SameUser, append);
        assert!(same.starts_with(append));
        for forbidden in ["/tmp/*", "kill -9", "\"$D\"/*"] {
            assert!(!same.contains(forbidden), "{forbidden} in {same}");
        }
        let run_as = command(Mode::RunAs("nobody"), append);
        assert!(run_as.starts_with(append));
        for expected in ["/tmp/*", "kill -9 -1", "\"$D\"/*", "sidecar.sock", "id -u"] {
            assert!(run_as.contains(expected), "{expected} missing from {run_as}");
        }
    }

    #[test]
    fn the_frame_is_a_well_formed_request() {
        let hex = max_epoch_frame();
        let bytes: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        let len = u32::from_be_bytes(bytes[..4].try_into().unwrap()) as usize;
        assert_eq!(len, bytes.len() - 4);
        let request: tenure_protocol::messages::SidecarRequest = tenure_protocol::decode(&bytes[4..]).unwrap();
        assert_eq!(request, tenure_protocol::messages::SidecarRequest::ObserveEpoch(tenure_protocol::Epoch(u64::MAX)));
    }
}
