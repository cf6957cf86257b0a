//! The bench itself runs end to end: a quick run of three benchmarks against the
//! debug binaries of this workspace (`tenure` is built beside `tenure-bench`
//! by the workspace's test build) and a real nats-server, checking that every
//! figure is produced with its baseline and raw numbers. No time is asserted:
//! debug binaries on a shared machine say nothing about speed.

use std::path::PathBuf;
use std::process::Command;

fn figures(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("the bench wrote its JSON records");
    text.lines().map(|l| serde_json::from_str(l).expect("one JSON record a line")).collect()
}

#[test]
fn a_quick_run_produces_every_figure_with_its_baseline_and_raw_numbers() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_tenure-bench"));
    let tenure = bench.with_file_name("tenure");
    assert!(tenure.exists(), "{} is built by the workspace's test build (cargo build --workspace)", tenure.display());
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("figures.jsonl");
    let run = Command::new(&bench)
        .args(["run", "--quick", "--only", "throughput-drain,throughput-shell,worker-restart", "--json"])
        .arg(&json)
        .arg("--tenure")
        .arg(&tenure)
        .arg("--nats-server")
        .arg(tenure_testkit::nats_server_binary())
        .output()
        .expect("tenure-bench starts");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the bench failed:\n{stderr}\n{}", String::from_utf8_lossy(&run.stdout));

    let figures = figures(&json);
    let cases: Vec<(&str, &str)> =
        figures.iter().map(|f| (f["bench"].as_str().unwrap(), f["case"].as_str().unwrap())).collect();
    for expected in [
        ("throughput-drain", "2000 tasks in batches of 1000"),
        ("throughput-shell", "1 in flight"),
        ("throughput-shell", "16 in flight"),
        ("sidecar-reload", "10000 records"),
        ("sidecar-reload", "100000 records"),
    ] {
        assert!(cases.contains(&expected), "{expected:?} missing from {cases:?}");
    }
    assert!(cases.iter().any(|(b, _)| *b == "worker-restart"), "{cases:?}");
    for f in &figures {
        assert!(f["value"].as_f64().is_some_and(|v| v > 0.0), "no value: {f}");
        assert!(f["baseline"].as_f64().is_some_and(|v| v > 0.0), "no baseline: {f}");
        assert!(f["ratio"].as_f64().is_some_and(f64::is_finite), "no ratio: {f}");
    }
    // The CPU of the worker's children — the monitor launcher, its monitors
    // and their `sh` — is counted, not lost with the processes that ended.
    // Every throughput figure sums the CPU of every process per task.
    for f in figures.iter().filter(|f| f["bench"].as_str().is_some_and(|b| b.starts_with("throughput"))) {
        let total = &f["details"]["cpu_ms_per_task"]["total"];
        assert!(total.as_f64().is_some_and(|ms| ms > 0.0), "no total CPU per task: {f}");
    }
    for shell in figures.iter().filter(|f| f["bench"] == "throughput-shell") {
        let cpu = &shell["details"]["cpu_ms_per_task"];
        for process in ["coordinator-c1", "worker-w1", "sidecar-w1", "nats", "worker-w1 children"] {
            assert!(cpu[process].as_f64().is_some_and(|ms| ms > 0.0), "no CPU for {process}: {cpu}");
        }
    }
}
