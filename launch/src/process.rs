//! A child process with a log file, started and stopped by its own pid.
//!
//! Every harness (tests, bench, chaos, `tenure dev` aside, which supervises
//! under tokio) starts nats-server and the `tenure` daemons through
//! [`Process`]: the command line is kept, so a stopped or killed process can
//! be started again exactly as it was; its stdout and stderr are appended to
//! its log; `Drop` kills what is still running. Nothing here ever signals a
//! process it did not start.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// One process of a local cluster.
#[derive(Debug)]
pub struct Process {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    /// Environment of every start.
    env: Vec<(String, String)>,
    /// Variables of the caller's environment the process must not inherit.
    env_remove: Vec<String>,
    log: PathBuf,
    own_group: bool,
    child: Option<Child>,
    /// The pid of the last start, and its status once killed and reaped.
    last: Option<(u32, Option<ExitStatus>)>,
}

impl Process {
    /// Not started yet: `program` with `args`, its output appended to `log`.
    pub fn new(name: &str, program: &Path, args: &[&str], log: &Path) -> Process {
        Process {
            name: name.to_owned(),
            program: program.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            env_remove: Vec::new(),
            log: log.to_path_buf(),
            own_group: false,
            child: None,
            last: None,
        }
    }

    /// Sets a variable for every start.
    pub fn env(mut self, key: &str, value: &str) -> Process {
        self.set_env(key, value);
        self
    }

    /// Sets (or replaces) a variable for every start from now on.
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// Variables of the caller's environment not passed on.
    pub fn env_remove(mut self, key: &str) -> Process {
        self.env_remove.push(key.to_owned());
        self
    }

    /// Starts it in a process group of its own: a Ctrl-C in the terminal
    /// reaches the harness only, which then stops its processes in order.
    pub fn own_process_group(mut self) -> Process {
        self.own_group = true;
        self
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    pub fn args(&self) -> &[String] {
        &self.args
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Starts it (again) with its command line; its pid.
    pub fn start(&mut self) -> std::io::Result<u32> {
        self.start_with(&[])
    }

    /// Starts it with `extra` variables for this start only.
    pub fn start_with(&mut self, extra: &[(String, String)]) -> std::io::Result<u32> {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let mut command = Command::new(&self.program);
        for key in &self.env_remove {
            command.env_remove(key);
        }
        command
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .envs(extra.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if self.own_group {
            command.process_group(0);
        }
        let child =
            command.spawn().map_err(|e| std::io::Error::new(e.kind(), format!("starting {}: {e}", self.name)))?;
        let pid = child.id();
        self.child = Some(child);
        self.last = Some((pid, None));
        Ok(pid)
    }

    /// The pid of the child last started (it may have exited since); `None`
    /// once [`Process::kill9`] or [`Process::stop`] reaped it.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    /// The pid of the last start, also after it was killed and reaped.
    pub fn last_pid(&self) -> Option<i32> {
        self.last.map(|(pid, _)| pid as i32)
    }

    /// Started and not exited.
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Its exit status once it exited (reaped), by itself or killed.
    pub fn try_exit(&mut self) -> Option<ExitStatus> {
        match self.child.as_mut() {
            Some(c) => c.try_wait().ok().flatten(),
            None => self.last.and_then(|(_, status)| status),
        }
    }

    /// Sends `signal` to it, by its pid, while it runs (never once it was
    /// reaped: the pid may belong to another process by then).
    pub fn signal(&mut self, signal: Signal) {
        if self.running() {
            if let Some(pid) = self.pid() {
                let _ = kill(Pid::from_raw(pid), signal);
            }
        }
    }

    /// SIGKILLs it (unless it exited already) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let status = c.wait().ok();
            self.last = Some((c.id(), status));
        }
    }

    /// Waits (bounded) for it to exit by itself.
    pub fn wait_exit(&mut self, bound: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(status) = self.try_exit() {
                return Some(status);
            }
            if self.child.is_none() || Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, up to `grace` to exit, then SIGKILL; reaped either way.
    pub fn stop(&mut self, grace: Duration) {
        self.signal(Signal::SIGCONT);
        self.signal(Signal::SIGTERM);
        self.wait_exit(grace);
        self.kill9();
    }

    /// What it logged.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if self.running() {
            self.kill9();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_logs_stops_and_starts_again() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("p.log");
        let mut p = Process::new("echo", Path::new("/bin/sh"), &["-c", "echo \"hi $X\"; exec sleep 30"], &log)
            .env("X", "there");
        let first = p.start().unwrap();
        assert!(p.running());
        let said = (0..250).find_map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            p.log_text().contains("hi there").then_some(())
        });
        assert!(said.is_some(), "{}", p.log_text());
        p.stop(Duration::from_secs(5));
        assert!(!p.running());
        assert!(p.pid().is_none() && p.last_pid() == Some(first as i32));
        assert!(p.try_exit().is_some(), "its status is kept once reaped");
        assert!(kill(Pid::from_raw(first as i32), None).is_err(), "stopped and reaped");
        let second = p.start().unwrap();
        assert_ne!(first, second);
        drop(p);
        assert!(kill(Pid::from_raw(second as i32), None).is_err(), "killed on drop");
    }

    #[test]
    fn a_missing_program_is_named() {
        let d = tempfile::tempdir().unwrap();
        let mut p = Process::new("ghost", &d.path().join("nope"), &[], &d.path().join("g.log"));
        let e = p.start().unwrap_err();
        assert!(e.to_string().starts_with("starting ghost:"), "{e}");
    }
}
