//! `tenure dev` as a new user meets it: a secured local cluster whose
//! `dev.env` makes a shell act as alice, whose `cluster.json` names the users
//! and every component, and which keeps running when one of its components is
//! killed — the killed worker is started again and its task finishes.

mod common;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{stderr, stdout, BIN};
use tenure_testkit::{eventually, free_port};

const BOUND: Duration = Duration::from_secs(60);

/// The `tenure dev` process, stopped (SIGTERM, then SIGKILL) when dropped.
struct Dev(Child);

impl Drop for Dev {
    fn drop(&mut self) {
        let _ =
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0.id() as i32), nix::sys::signal::Signal::SIGTERM);
        if eventually(Duration::from_secs(30), || self.0.try_wait().ok().flatten()).is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `NAME=VALUE` lines of an env file.
fn env_file(path: &std::path::Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn tenure(env: &[(String, String)], args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env_remove("TENURE_NATS")
        .env_remove("TENURE_NATS_USER")
        .env_remove("TENURE_NATS_PASSWORD")
        .envs(env.iter().cloned())
        .stdin(Stdio::null())
        .output()
        .expect("run tenure")
}

#[test]
fn the_dev_cluster_is_secured_and_outlives_a_killed_worker() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("dev");
    let port = free_port().to_string();
    let child = Command::new(BIN)
        .args(["dev", "--workers", "1", "--nats-port", &port, "--gateway-port", &free_port().to_string(), "--data-dir"])
        .arg(&data)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start tenure dev");
    let mut dev = Dev(child);
    let alice_env = data.join("dev.env");
    let ready = eventually(BOUND, || {
        let env = env_file(&alice_env);
        (!env.is_empty() && stdout(&tenure(&env, &["status"])).contains(" yes ")).then_some(env)
    });
    let Some(alice) = ready else { panic!("the dev cluster never came up") };

    // cluster.json names the users and how to act as them.
    let cluster: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.join("cluster.json")).expect("cluster.json")).expect("json");
    for user in ["alice", "bob", "operator"] {
        assert_eq!(cluster["identities"][user]["user"], user, "{cluster}");
    }
    let bob_file = cluster["identities"]["bob"]["env_file"].as_str().expect("bob's env file").to_owned();
    let url = cluster["nats_url"].as_str().expect("url").to_owned();
    let bob: Vec<(String, String)> = env_file(std::path::Path::new(&bob_file))
        .into_iter()
        .chain([("TENURE_NATS".to_owned(), url.clone())])
        .collect();
    // Without credentials nothing works: the cluster is not open.
    assert!(!tenure(&[("TENURE_NATS".into(), url.clone())], &["status"]).status.success());

    let out = tenure(&alice, &["submit", "--", "sleep 3; echo survived"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let task = stdout(&out).trim().to_owned();
    let snapshot = |env: &[(String, String)]| tenure(env, &["get", &task, "--json"]);
    let running = eventually(BOUND, || {
        let s: serde_json::Value = serde_json::from_slice(&snapshot(&alice).stdout).ok()?;
        (s["status"] == "running").then_some(s)
    })
    .expect("running");
    assert_eq!(running["owner"].as_str().map(|o| o.starts_with("alice/")), Some(true), "{running}");
    assert!(!snapshot(&bob).status.success(), "bob read alice's task");

    // The dev cluster's gateway acts as each user with a token of their own.
    let gateway = cluster["gateway"]["url"].as_str().expect("gateway url").to_owned();
    assert!(cluster["gateway"]["board"].as_str().is_some_and(|b| b.starts_with(&gateway)), "{cluster}");
    let http = reqwest::blocking::Client::new();
    let token = |user: &str| cluster["gateway"]["tokens"][user].as_str().expect("token").to_owned();
    let submitted = eventually(BOUND, || {
        let r = http
            .post(format!("{gateway}/v1/tasks"))
            .bearer_auth(token("alice"))
            .json(&serde_json::json!({"command": "echo via the gateway"}))
            .send()
            .ok()?;
        (r.status().as_u16() == 201).then(|| r.json::<serde_json::Value>().ok()).flatten()
    })
    .expect("alice submits through the gateway");
    let via = submitted["task"].as_str().expect("task id").to_owned();
    let status_as = |user: &str| {
        let r = http.get(format!("{gateway}/v1/tasks/{via}")).bearer_auth(token(user)).send().expect("GET");
        r.status().as_u16()
    };
    assert_eq!(status_as("alice"), 200);
    assert_eq!(status_as("bob"), 404, "bob read alice's task through the gateway");

    // Kill the worker: the demo goes on, the worker comes back, the task ends.
    let worker = cluster["components"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "worker-w1"))
        .and_then(|c| c["pid"].as_i64())
        .expect("worker pid") as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker), nix::sys::signal::Signal::SIGKILL).expect("kill");
    let done = eventually(BOUND, || {
        let s: serde_json::Value = serde_json::from_slice(&snapshot(&alice).stdout).ok()?;
        (s["status"] == "completed").then_some(s)
    });
    assert!(done.is_some(), "the task did not finish after its worker was killed");
    assert_eq!(stdout(&tenure(&alice, &["logs", &task])), "survived\n");
    assert!(matches!(dev.0.try_wait(), Ok(None)), "tenure dev stopped when a component was killed");
    let mut err = dev.0.stderr.take().expect("stderr");
    drop(dev);
    let mut said = String::new();
    let _ = err.read_to_string(&mut said);
    assert!(said.contains("worker-w1 exited") && said.contains("re-attaches"), "{said}");
    assert!(said.contains("started worker-w1") && said.contains("again"), "{said}");
}
