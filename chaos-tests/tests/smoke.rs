//! The chaos smoke run CI does on every change: a fixed seed, a short run on 2
//! cores, real binaries, real faults. And proof that the judge is not blind: a
//! planted double execution must be caught.

use std::process::Command;

fn chaos(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tenure-chaos"))
        .args(args)
        .env("TENURE_NATS_SERVER", tenure_testkit::nats_server_binary())
        .output()
        .expect("run tenure-chaos")
}

fn summary(out: &std::process::Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("summary:"), "no summary:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn a_fixed_seed_run_finds_no_violation() {
    let out = chaos(&["run", "--seed", "20261129", "--duration", "45", "--coordinators", "2", "--workers", "2"]);
    let text = summary(&out);
    assert!(out.status.success(), "violations found:\n{text}");
    let json = text.lines().find(|l| l.starts_with('{')).expect("json report");
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    assert!(report["tasks_submitted"].as_u64().unwrap_or(0) > 20, "{report}");
    let faults: u64 = report["faults_injected"].as_object().unwrap().values().filter_map(|v| v.as_u64()).sum();
    assert!(faults >= 5, "too few faults: {report}");
    for key in ["lost", "double_executed", "anonymous", "resurrected", "orphans"] {
        assert_eq!(report[key], 0, "{key}: {report}");
    }
    // The load never kills and every command exits 0: most tasks complete,
    // and the judge bounded `unknown` by the faults that struck machines.
    let (submitted, completed) = (report["tasks_submitted"].as_u64(), report["completed"].as_u64());
    assert!(completed.unwrap_or(0) * 4 >= submitted.unwrap_or(0) * 3, "too few completed: {report}");
    let unknown = report["unknown"].as_u64().unwrap_or(u64::MAX);
    assert!(unknown <= report["machine_faults"].as_u64().unwrap_or(0) * 4, "unknown unexplained: {report}");
}

#[test]
fn a_planted_double_execution_is_caught() {
    let out =
        chaos(&["run", "--seed", "5", "--duration", "8", "--workers", "1", "--coordinators", "1", "--plant-double"]);
    let text = summary(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("VIOLATION double-executed"), "{text}");
}

/// Seed 2 cuts a worker machine's power twice in 30 s (its data directory on
/// the power-loss filesystem). Before the sidecar synced sled's files and
/// directories itself, each cut lost the whole store — acknowledged intents
/// and outcomes, the epoch fence, the incarnation — and the judge caught the
/// tasks that then said `machine-replaced` with no machine wiped. Kept as the
/// regression run.
#[test]
fn a_machine_that_loses_power_keeps_everything_it_acknowledged() {
    let out = chaos(&[
        "run",
        "--seed",
        "2",
        "--duration",
        "30",
        "--coordinators",
        "2",
        "--workers",
        "2",
        "--fault-every-ms",
        "1500",
    ]);
    let text = summary(&out);
    assert!(out.status.success(), "violations found:\n{text}");
    let json = text.lines().find(|l| l.starts_with('{')).expect("json report");
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    assert!(report["faults_injected"]["power-loss"].as_u64().unwrap_or(0) >= 2, "{report}");
    assert!(
        report["disks"].as_str().is_some_and(|d| d.starts_with("data directories")),
        "the run had no power-loss filesystems: {report}"
    );
}

/// Without a usable nats-server the run ends at once saying what is missing
/// and how to get it (it used to end with only "starting nats: No such file
/// or directory").
#[test]
fn without_nats_server_the_run_says_how_to_get_one() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nats-server");
    let out = Command::new(env!("CARGO_BIN_EXE_tenure-chaos"))
        .args(["run", "--seed", "1", "--duration", "1"])
        .env("TENURE_NATS_SERVER", &missing)
        .env("PATH", "")
        .output()
        .expect("run tenure-chaos");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("nats-server {} (from TENURE_NATS_SERVER) does not exist", missing.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains("run deploy/install-nats.sh, which installs nats-server 2.15.1 into .tools/nats/bin"),
        "{stderr}"
    );
    assert!(!stderr.contains("No such file or directory"), "{stderr}");
}
