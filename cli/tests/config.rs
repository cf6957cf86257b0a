//! Daemon configuration files: unknown keys refused by name, invalid values
//! refused at start, file < environment < flags, `--print-config` showing the
//! result with secrets masked, a real coordinator started from a file, and
//! daemons on either scheduler (`--runtime`).

mod common;

use std::process::{Command, Output};

use common::{stderr, stdout, Cluster, BIN};

fn tenure(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    // Only what this test sets: no TENURE_* from the environment running it.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("TENURE_")) {
        cmd.env_remove(k);
    }
    cmd.args(args).envs(env.iter().copied()).output().expect("run tenure")
}

fn write(dir: &tempfile::TempDir, name: &str, text: &str) -> String {
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn the_file_is_overridden_by_the_environment_then_by_flags_and_secrets_are_masked() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        &dir,
        "coordinator.toml",
        r#"
name = "from-file"
worker_ttl_ms = 1234
renew_interval_ms = 1000
lease_ttl_ms = 5000
operators = ["ops"]
[nats]
servers = ["nats://127.0.0.1:4999"]
user = "tenure-coordinator"
password = "file-password-secret"
"#,
    );
    let env = [("TENURE_RENEW_INTERVAL_MS", "1500"), ("TENURE_WORKER_TTL_MS", "2222")];
    let out = tenure(&["coordinator", "--config", &file, "--print-config", "--worker-ttl-ms", "3333"], &env);
    assert!(out.status.success(), "{}", stderr(&out));
    let shown: toml::Table = toml::from_str(&stdout(&out)).expect("the printed configuration is TOML");
    assert_eq!(shown["name"].as_str(), Some("from-file"), "file");
    assert_eq!(shown["lease_ttl_ms"].as_integer(), Some(5000), "file");
    assert_eq!(shown["renew_interval_ms"].as_integer(), Some(1500), "environment over file");
    assert_eq!(shown["worker_ttl_ms"].as_integer(), Some(3333), "flag over environment and file");
    assert_eq!(shown["renew_deadline_ms"].as_integer(), Some(4000), "default");
    assert_eq!(shown["nats"]["user"].as_str(), Some("tenure-coordinator"));
    assert_eq!(shown["nats"]["password"].as_str(), Some("***"));
    assert!(!stdout(&out).contains("file-password-secret"), "a secret was printed");
    let out = tenure(&["coordinator", "--config", &file, "--print-config", "--nats", "nats://127.0.0.1:4111"], &[]);
    assert!(stdout(&out).contains("nats://127.0.0.1:4111") && !stdout(&out).contains("4999"), "{}", stdout(&out));
}

#[test]
fn bad_configuration_fails_at_start_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("coordinator", "worker_tt_ms = 3\n", "unknown field `worker_tt_ms`"),
        ("coordinator", "[nats]\npasword = 'x'\n", "unknown field `pasword`"),
        (
            "coordinator",
            "lease_ttl_ms = 3000\nrenew_deadline_ms = 3000\n",
            "renew_deadline_ms (3000) must be below lease_ttl_ms",
        ),
        ("coordinator", "replicas = 'three'\n", "replicas"),
        ("worker", "slots = 0\nid = 'w1'\ndata_dir = '/tmp'\n", "slots must be at least 1"),
        ("worker", "data_dir = '/tmp'\n", "id is required"),
        ("worker", "id = 'Not Valid'\n", "id"),
        ("sidecar", "worker = 'w1'\n", "data_dir is required"),
    ];
    for (i, (daemon, text, expected)) in cases.iter().enumerate() {
        let file = write(&dir, &format!("{i}.toml"), text);
        let out = tenure(&[daemon, "--config", &file, "--print-config"], &[]);
        assert!(!out.status.success(), "{daemon} accepted {text:?}");
        let err = stderr(&out);
        assert!(err.contains("invalid configuration") && err.contains(expected), "{daemon} {text:?}: {err}");
    }
    let out = tenure(&["coordinator", "--config", "/nonexistent/tenure.toml"], &[]);
    assert!(stderr(&out).contains("cannot read /nonexistent/tenure.toml"), "{}", stderr(&out));
}

#[test]
fn a_coordinator_runs_from_its_file() {
    let mut c = Cluster::start(1);
    let file = c.dir.path().join("coordinator.toml");
    std::fs::write(&file, "name = \"from-file\"\nworker_ttl_ms = 3000\n").unwrap();
    c.kill9("coordinator");
    c.spawn("coordinator", &["coordinator", "--config", &file.display().to_string()]);
    c.wait_leader("from-file");
    let task = c.submit(&["--", "echo configured"]);
    c.wait_status(&task, "completed", std::time::Duration::from_secs(40));
}

/// The scheduler is the process's (`--runtime`): daemons on the old
/// many-thread one run tasks with the others on their default one thread,
/// and a value that names neither is refused before anything starts.
#[test]
fn daemons_run_on_either_scheduler_and_a_bad_one_is_refused() {
    let mut c = Cluster::start(0);
    c.kill9("coordinator");
    c.spawn("coordinator", &["--runtime", "threads", "coordinator", "--name", "c1"]);
    c.wait_leader("c1");
    c.spawn_sidecar("w1");
    c.spawn_worker("w1", &["--runtime", "threads"]);
    c.wait_workers(1);
    let task = c.submit(&["--", "echo scheduled"]);
    c.wait_status(&task, "completed", std::time::Duration::from_secs(40));
    assert_eq!(stdout(&c.cli(&["logs", &task])), "scheduled\n");
    let flag = tenure(&["--runtime", "one", "sidecar", "--worker", "w9", "--data-dir", "/nonexistent"], &[]);
    let variable = tenure(&["worker", "--id", "w9", "--data-dir", "/nonexistent"], &[("TENURE_RUNTIME", "fast")]);
    for out in [flag, variable] {
        assert!(!out.status.success(), "a bad scheduler was taken");
        let err = stderr(&out);
        assert!(err.contains("invalid value") && err.contains("one-thread, threads"), "{err}");
    }
}

#[test]
fn the_shipped_example_files_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config");
    for (daemon, extra) in [
        ("coordinator", vec!["--name", "host-1"]),
        ("worker", vec!["--id", "w1", "--data-dir", "/var/lib/tenure/w1"]),
        ("sidecar", vec!["--worker", "w1", "--data-dir", "/var/lib/tenure/w1"]),
    ] {
        let file = dir.join(format!("{daemon}.toml")).display().to_string();
        let mut args = vec![daemon, "--config", &file, "--print-config"];
        args.extend(extra);
        let env = [("TENURE_NATS_USER", "from-the-env-file"), ("TENURE_NATS_PASSWORD", "from-the-env-file")];
        let out = tenure(&args, &env);
        assert!(out.status.success(), "{daemon}: {}", stderr(&out));
        let shown: toml::Table = toml::from_str(&stdout(&out)).unwrap();
        assert_eq!(shown["nats"]["servers"].as_array().map(Vec::len), Some(3), "{daemon}");
        assert_eq!(shown["nats"]["password"].as_str(), Some("***"), "{daemon}");
    }
}
