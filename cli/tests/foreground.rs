//! `tenure run` and `tenure attach`, as a new user meets them: a command run
//! in the foreground that streams and exits with the task's code; Ctrl-C that
//! detaches while the task finishes in the background, and `attach` that
//! shows the rest; an agent fed from `run`'s stdin in order, with a second
//! attached reader; and another identity refused as if the task did not exist.

mod common;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{stderr, stdout, Cluster, BIN};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

/// Exit codes of `run` and `attach` (documented in docs/operations.md).
const EXIT_KILLED: i32 = 121;
const EXIT_DETACHED: i32 = 130;

/// A shell loop that answers every line it reads: the smallest "agent".
const ECHO_AGENT: &str = r#"while read -r line; do echo "got: $line"; done"#;

/// A `tenure run` or `tenure attach` running as a child process, its stdout
/// and stderr collected as they come.
struct Foreground {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<Vec<u8>>>,
    err: Arc<Mutex<Vec<u8>>>,
}

impl Foreground {
    /// `tenure ARGS` as `session` of the cluster's client identity, stdin piped.
    fn start(c: &Cluster, session: &str, args: &[&str]) -> Foreground {
        let role_env = c.auth.as_ref().map(|a| a.env(common::CLIENT)).unwrap_or_default();
        let mut child = Command::new(BIN)
            .args(["--nats", &c.nats.url, "--session", session])
            .args(args)
            .envs(role_env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run tenure");
        let collect = |mut from: Box<dyn Read + Send>| {
            let into = Arc::new(Mutex::new(Vec::new()));
            let sink = into.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = from.read(&mut buf) {
                    sink.lock().expect("buffer").extend_from_slice(&buf[..n]);
                }
            });
            into
        };
        let out = collect(Box::new(child.stdout.take().expect("stdout")));
        let err = collect(Box::new(child.stderr.take().expect("stderr")));
        let stdin = child.stdin.take();
        Foreground { child, stdin, out, err }
    }

    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().expect("buffer")).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.err.lock().expect("buffer")).into_owned()
    }

    fn wait_stdout(&self, needle: &str) {
        let seen = eventually(BOUND, || self.stdout().contains(needle).then_some(()));
        assert!(seen.is_some(), "{needle:?} never came: stdout {:?}, stderr {:?}", self.stdout(), self.stderr());
    }

    /// The task's id, from the line `run` prints on stderr once it submitted.
    fn task(&self) -> String {
        let id = eventually(BOUND, || {
            let err = self.stderr();
            let line = err.lines().find(|l| l.contains(" submitted"))?;
            Some(line.strip_prefix("tenure: ")?.split_whitespace().next()?.to_owned())
        });
        id.unwrap_or_else(|| panic!("run never said its task: {:?}", self.stderr()))
    }

    fn type_line(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(format!("{line}\n").as_bytes()).expect("write stdin");
        stdin.flush().expect("flush stdin");
    }

    fn interrupt(&self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT).expect("SIGINT");
    }

    /// Waits (bounded) for the process to exit by itself.
    fn exit(&mut self) -> ExitStatus {
        let status = eventually(BOUND, || self.child.try_wait().ok().flatten());
        let Some(status) = status else {
            let _ = self.child.kill();
            let _ = self.child.wait();
            panic!("tenure did not exit: stdout {:?}, stderr {:?}", self.stdout(), self.stderr());
        };
        // Its pipes close with it; let the collectors take the last bytes.
        let _ = eventually(Duration::from_secs(5), || (Arc::strong_count(&self.out) == 1).then_some(()));
        let _ = eventually(Duration::from_secs(5), || (Arc::strong_count(&self.err) == 1).then_some(()));
        status
    }
}

impl Drop for Foreground {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `tenure run` is a drop-in for running the command: its output, then its
/// exit code — 0, a failure's own code, 128 + a signal's number.
#[test]
fn run_streams_the_output_and_exits_with_the_tasks_code() {
    let c = Cluster::start(1);
    let run = |command: &str| {
        let mut fg = Foreground::start(&c, &c.session, &["run", "--", command]);
        let status = fg.exit();
        (fg.stdout(), status.code(), fg.stderr())
    };
    let (out, code, err) = run("echo one; echo two");
    assert_eq!((out.as_str(), code), ("one\ntwo\n", Some(0)), "{err}");
    let (out, code, err) = run("echo partial; exit 3");
    assert_eq!((out.as_str(), code), ("partial\n", Some(3)), "{err}");
    let (out, code, err) = run("echo bye; kill -9 $$");
    assert_eq!((out.as_str(), code), ("bye\n", Some(137)), "{err}");
    // Several words are quoted and joined, as `submit` does.
    let mut fg = Foreground::start(&c, &c.session, &["run", "--", "printf", "%s|", "a b", "c"]);
    assert_eq!(fg.exit().code(), Some(0), "{}", fg.stderr());
    assert_eq!(fg.stdout(), "a b|c|");
    // A workflow streams its steps in order and ends with the first failure.
    let mut fg = Foreground::start(&c, &c.session, &["run", "--step", "echo a", "--step", "echo b; exit 5"]);
    assert_eq!(fg.exit().code(), Some(5), "{}", fg.stderr());
    let shown: Vec<String> = fg.stdout().lines().filter(|l| !l.starts_with("== step")).map(str::to_owned).collect();
    assert_eq!(shown, ["a", "b"], "{}", fg.stdout());
    // A built-in kind without a process, and a final-output-only task.
    let mut fg = Foreground::start(&c, &c.session, &["run", "--kind", "noop", "--", "-"]);
    assert_eq!((fg.exit().code(), fg.stdout()), (Some(0), String::new()), "{}", fg.stderr());
    let mut fg = Foreground::start(&c, &c.session, &["run", "--final-output", "--", "echo at the end"]);
    assert_eq!((fg.exit().code(), fg.stdout()), (Some(0), "at the end\n".to_owned()), "{}", fg.stderr());
    // Every byte reached its owner: the tasks are reported.
    let listed = stdout(&c.cli(&["ls", "--json"]));
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("ls json");
    assert_eq!(listed.as_array().map(Vec::len), Some(0), "unreported tasks left: {listed}");
}

/// Ctrl-C detaches: `run` says how to come back and exits 130 while the task
/// goes on and finishes by itself; `attach` then shows its whole output (or
/// from an offset, or from its end) and exits with its code.
#[test]
fn ctrl_c_detaches_and_attach_shows_the_rest() {
    let c = Cluster::start(1);
    let gate = c.dir.path().join("gate");
    let command = format!("echo first; while [ ! -e '{}' ]; do sleep 0.05; done; echo second; exit 4", gate.display());
    let mut fg = Foreground::start(&c, &c.session, &["run", "--", &command]);
    let task = fg.task();
    fg.wait_stdout("first\n");
    fg.interrupt();
    assert_eq!(fg.exit().code(), Some(EXIT_DETACHED), "{}", fg.stderr());
    let said = fg.stderr();
    assert!(said.contains(&format!("detached from {task}")), "{said}");
    assert!(said.contains(&format!("tenure attach {task}")), "{said}");
    assert!(said.contains(&format!("tenure attach {task} --from 6")), "{said}");
    assert_eq!(fg.stdout(), "first\n");
    // The detach left the task as it was.
    let snapshot = c.snapshot(&task);
    assert_eq!(snapshot["status"], "running", "{snapshot}");
    assert_eq!(snapshot["kill_requested"], false);

    // Back in the foreground while it still runs: from where the detach stopped.
    let mut back = Foreground::start(&c, &c.session, &["attach", &task, "--from", "6"]);
    std::fs::write(&gate, b"").expect("open the gate");
    back.wait_stdout("second\n");
    assert_eq!(back.exit().code(), Some(4), "{}", back.stderr());
    assert_eq!(back.stdout(), "second\n");
    let snapshot = c.wait_status(&task, "failed", BOUND);
    assert_eq!(snapshot["exit_code"], 4);
    assert_eq!(snapshot["attempt"], 1, "the task was never started again");

    // A finished task: its output, and its code.
    let out = c.cli(&["attach", &task]);
    assert_eq!((stdout(&out).as_str(), out.status.code()), ("first\nsecond\n", Some(4)), "{}", stderr(&out));
    let out = c.cli(&["attach", "--tail", &task]);
    assert_eq!((stdout(&out).as_str(), out.status.code()), ("", Some(4)), "{}", stderr(&out));
}

/// `--kill-on-interrupt` keeps Ctrl-C's old meaning: the task is killed, with
/// a reason saying why, and `run` exits with the killed code once it ended.
#[test]
fn kill_on_interrupt_kills_the_task_with_a_reason() {
    let c = Cluster::start(1);
    let mut fg = Foreground::start(&c, &c.session, &["run", "--kill-on-interrupt", "--", "echo up; sleep 600"]);
    let task = fg.task();
    fg.wait_stdout("up\n");
    fg.interrupt();
    assert_eq!(fg.exit().code(), Some(EXIT_KILLED), "{}", fg.stderr());
    let snapshot = c.wait_status(&task, "killed", BOUND);
    assert!(snapshot["kill_reason"].as_str().is_some_and(|r| r.contains("--kill-on-interrupt")), "{snapshot}");
}

/// An agent run in the foreground gets the terminal's lines in order — also
/// those typed before it started; a second reader attached to it sees the
/// same output and its input lands after the first's; a kill ends both.
#[test]
fn an_agent_gets_stdin_lines_from_run_in_order() {
    let c = Cluster::start(1);
    let mut fg = Foreground::start(&c, &c.session, &["run", "--kind", "agent", "--", ECHO_AGENT]);
    let lines: Vec<String> = (1..=20).map(|i| format!("line {i}")).collect();
    for line in &lines {
        fg.type_line(line);
    }
    let task = fg.task();
    fg.wait_stdout("got: line 20\n");
    let expected: String = lines.iter().map(|l| format!("got: {l}\n")).collect();
    assert_eq!(fg.stdout(), expected);

    let mut second = Foreground::start(&c, &c.session, &["attach", &task]);
    second.wait_stdout("got: line 20\n");
    second.type_line("from the second reader");
    fg.type_line("from the first again");
    for reader in [&fg, &second] {
        reader.wait_stdout("got: from the second reader\n");
        reader.wait_stdout("got: from the first again\n");
    }
    assert!(fg.stdout().starts_with(&expected), "{}", fg.stdout());

    let out = c.cli(&["kill", &task]);
    assert!(out.status.success(), "{}", stderr(&out));
    for reader in [&mut fg, &mut second] {
        assert_eq!(reader.exit().code(), Some(EXIT_KILLED), "{}", reader.stderr());
        assert_eq!(reader.stdout(), fg_output_of(&c, &task));
    }
    let snapshot = c.snapshot(&task);
    assert_eq!(snapshot["attempt"], 1);
}

/// The whole output of `task`, as `logs` reads it.
fn fg_output_of(c: &Cluster, task: &str) -> String {
    stdout(&c.cli(&["logs", task]))
}

/// On an authenticating cluster, bob cannot attach to alice's task even
/// under her session label: it is `not found or not yours`, as for any verb.
#[test]
fn attach_to_another_identitys_task_is_refused_as_not_found() {
    let mut c = Cluster::secured();
    c.spawn_coordinator("c1", &[]);
    c.start_worker("w1");
    c.wait_workers(1);
    let task = c.submit(&["--", "echo mine"]);
    c.wait_status(&task, "completed", BOUND);

    let out = c.cli_identity("bob", &c.session, &["attach", &task]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert_eq!(stdout(&out), "", "nothing of alice's output reached bob");
    assert!(stderr(&out).contains(&format!("task {task} not found or not yours")), "{}", stderr(&out));

    let out = c.cli(&["attach", &task]);
    assert_eq!((stdout(&out).as_str(), out.status.code()), ("mine\n", Some(0)), "{}", stderr(&out));
}
