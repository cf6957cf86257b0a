//! The client libraries against a real cluster: nats-server, a coordinator,
//! a worker with its sidecar and `tenure gateway`, with tokens for two
//! identities. Each test runs one suite (`pytest` for `clients/python`,
//! `node --test` for `clients/typescript`, and `pytest` with the official MCP
//! Python SDK for `tenure mcp` and the gateway's `/mcp` in
//! `cli/tests/mcp_sdk`, with the example agent harness) with the gateway's
//! URL and the tokens in the environment, and fails with the suite's output
//! unless every test of it passed.
//!
//! The MCP suite asks for a worker restart through a control folder: it
//! writes `restart-worker.request`, the test SIGKILLs the worker by its pid,
//! starts it again and answers `restart-worker.done` with both pids.
//!
//! What the suites need is installed by `deploy/install-client-test-deps.sh`
//! (pytest, httpx and mcp into `.tools/python`; node is checked): when it
//! cannot, the test fails saying what to install.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Cluster, BIN};

/// The longest a library's whole suite may take before it counts as hung
/// (under nextest's 240 s, so that the suite's own output is shown).
const SUITE_BOUND: Duration = Duration::from_secs(210);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace above cli/").to_path_buf()
}

/// A cluster with one worker and a gateway, and a token per identity.
struct Setup {
    cluster: Cluster,
    url: String,
    alice: String,
    bob: String,
}

impl Setup {
    fn start() -> Setup {
        let mut cluster = Cluster::start(1);
        let port = tenure_testkit::free_port();
        let tokens = cluster.dir.path().join("gateway-tokens.json");
        let listen = format!("127.0.0.1:{port}");
        let tokens_arg = tokens.to_str().expect("utf-8 path").to_owned();
        cluster.spawn("gateway", &["gateway", "--listen", &listen, "--tokens", &tokens_arg]);
        let url = format!("http://{listen}");
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(10)).build().expect("http client");
        let up = tenure_testkit::eventually(Duration::from_secs(30), || {
            http.get(format!("{url}/openapi.json")).send().ok().filter(|r| r.status().is_success())
        });
        assert!(up.is_some(), "the gateway did not come up:\n{}", cluster.daemon("gateway").log_text());
        let token = |identity: &str| {
            let out = Command::new(BIN)
                .args(["gateway", "--tokens", &tokens_arg, "token", "create", "--identity", identity])
                .output()
                .expect("run tenure gateway token create");
            assert!(out.status.success(), "token create: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        let (alice, bob) = (token("alice"), token("bob"));
        Setup { cluster, url, alice, bob }
    }

    /// Runs a suite with the gateway in its environment; panics with its
    /// output (and the gateway's log) unless it exits successfully.
    fn run_suite(&mut self, what: &str, cmd: Command) {
        self.run_suite_serving(what, cmd, |_| {});
    }

    /// [`Setup::run_suite`], calling `serve` with the cluster while the suite runs.
    fn run_suite_serving(&mut self, what: &str, mut cmd: Command, mut serve: impl FnMut(&mut Cluster)) {
        let out_path = self.cluster.dir.path().join(format!("{what}.out"));
        let out = std::fs::File::create(&out_path).expect("suite output file");
        let err = out.try_clone().expect("suite output file");
        cmd.current_dir(root())
            .env("TENURE_URL", &self.url)
            .env("TENURE_TOKEN", &self.alice)
            .env("TENURE_TOKEN_OTHER", &self.bob)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot run the {what} suite ({cmd:?}): {e}"));
        let cluster = &mut self.cluster;
        let status = tenure_testkit::eventually(SUITE_BOUND, || {
            serve(cluster);
            child.try_wait().ok().flatten()
        });
        let output = || std::fs::read_to_string(&out_path).unwrap_or_default();
        let Some(status) = status else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the {what} suite did not finish within {SUITE_BOUND:?}:\n{}", output());
        };
        assert!(
            status.success(),
            "the {what} suite failed ({status}):\n{}\n--- gateway log ---\n{}",
            output(),
            self.cluster.daemon("gateway").log_text()
        );
        let text = output();
        println!("{text}");
        // A suite that ran nothing passes without proving anything.
        assert!(passed(&text) > 0, "the {what} suite ran no test:\n{text}");
    }
}

/// How many tests a suite's summary says passed: pytest's `N passed`, or
/// the TAP reporter's `# pass N`.
fn passed(summary: &str) -> u64 {
    summary
        .lines()
        .filter_map(|line| {
            let line = line.trim().trim_matches('=').trim();
            if let Some(n) = line.strip_prefix("# pass ") {
                return n.trim().parse().ok();
            }
            let words: Vec<&str> = line.split([' ', ',']).filter(|w| !w.is_empty()).collect();
            words.windows(2).find(|w| w[1] == "passed").and_then(|w| w[0].parse().ok())
        })
        .max()
        .unwrap_or(0)
}

/// `deploy/install-client-test-deps.sh`: installs what is missing, prints
/// the folder holding pytest and httpx.
fn client_test_deps() -> String {
    let out = Command::new(root().join("deploy/install-client-test-deps.sh"))
        .stdin(Stdio::null())
        .output()
        .expect("run deploy/install-client-test-deps.sh");
    assert!(
        out.status.success(),
        "the client libraries' tests need python3 (with pip) and node >= 18:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn summaries_are_read_for_the_number_of_passed_tests() {
    assert_eq!(passed("===== 29 passed in 74.21s (0:01:14) ====="), 29);
    assert_eq!(passed("== 1 failed, 28 passed in 3s =="), 28);
    assert_eq!(passed("# tests 13\n# pass 13\n# fail 0"), 13);
    assert_eq!(passed("# pass 0\n"), 0);
    assert_eq!(passed("no tests ran in 0.01s"), 0);
}

#[test]
fn the_python_client_passes_its_suite_against_a_real_cluster() {
    let deps = client_test_deps();
    let mut setup = Setup::start();
    let src = root().join("clients/python/src");
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "clients/python/tests"])
        .env("PYTHONPATH", format!("{}:{deps}", src.display()))
        .env("PYTHONDONTWRITEBYTECODE", "1");
    setup.run_suite("python", cmd);
}

#[test]
fn the_typescript_client_passes_its_suite_against_a_real_cluster() {
    client_test_deps();
    let mut setup = Setup::start();
    let mut cmd = Command::new("node");
    cmd.args(["--test", "--test-reporter=tap", "clients/typescript/test/"]);
    setup.run_suite("typescript", cmd);
}

/// Serves the MCP suite's requests in `control`: a worker restart (SIGKILL
/// by pid, started again), answered with both pids.
fn serve_restarts(control: &Path) -> impl FnMut(&mut Cluster) + '_ {
    move |cluster: &mut Cluster| {
        let request = control.join("restart-worker.request");
        if std::fs::remove_file(&request).is_err() {
            return;
        }
        let old_pid = cluster.daemon("worker-w1").pid();
        cluster.kill9("worker-w1");
        let new_pid = cluster.spawn_worker("w1", &[]).pid();
        let answer = serde_json::json!({ "old_pid": old_pid, "new_pid": new_pid }).to_string();
        let done = control.join("restart-worker.done");
        let partial = control.join("restart-worker.partial");
        std::fs::write(&partial, answer).expect("write the restart answer");
        std::fs::rename(&partial, &done).expect("publish the restart answer");
    }
}

#[test]
fn the_mcp_sdk_suite_and_the_agent_harness_pass_against_a_real_cluster() {
    let deps = client_test_deps();
    let mut setup = Setup::start();
    let control = setup.cluster.dir.path().join("control");
    std::fs::create_dir_all(&control).expect("control folder");
    // What `tenure dev` would write for the example harness: the cluster's
    // NATS URL and the session it acts as (an open cluster needs no credentials).
    let cluster_dir = setup.cluster.dir.path().join("example-cluster");
    std::fs::create_dir_all(&cluster_dir).expect("example cluster folder");
    let dev_env = format!("TENURE_NATS={}\nTENURE_SESSION=agent-harness\n", setup.cluster.nats.url);
    std::fs::write(cluster_dir.join("dev.env"), dev_env).expect("dev.env");
    let bin_dir = Path::new(BIN).parent().expect("the binary's folder").display().to_string();
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "cli/tests/mcp_sdk"])
        .env("PYTHONPATH", &deps)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PATH", format!("{bin_dir}:{}", std::env::var("PATH").unwrap_or_default()))
        .env("TENURE_BIN", BIN)
        .env("TENURE_NATS", &setup.cluster.nats.url)
        .env("TENURE_SESSION", "mcp-sdk")
        .env("TENURE_CONTROL", &control)
        .env("TENURE_CLUSTER_DIR", &cluster_dir);
    let serve = serve_restarts(&control);
    setup.run_suite_serving("mcp", cmd, serve);
}
