//! Observability over a real cluster. One trace per task across processes: a
//! small OTLP/HTTP (JSON) receiver on loopback collects the spans, and those of
//! the client, the coordinator, the worker and the sidecar must share one trace
//! id with the right parent links. Metrics: each daemon's Prometheus endpoint
//! shows what the task did.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Cluster;
use serde_json::Value;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(40);

/// One exported span.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attributes: HashMap<String, String>,
}

/// Accepts OTLP/HTTP JSON exports (`POST /v1/traces`) and keeps every span.
fn receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = spans.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let kept = kept.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut stream = stream;
                // Keep-alive: several requests per connection.
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let l = line.trim_end();
                        if l.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = l.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                length = v.trim().parse().unwrap_or(0);
                            }
                        }
                    }
                    let mut body = vec![0u8; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                        kept.lock().unwrap().extend(parse(&v));
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if stream.write_all(ok.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (endpoint, spans)
}

fn string_value(v: &Value) -> String {
    let v = &v["value"];
    v["stringValue"].as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())
}

fn parse(export: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in export["resourceSpans"].as_array().into_iter().flatten() {
        let service = rs["resource"]["attributes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|a| a["key"] == "service.name")
            .map(string_value)
            .unwrap_or_default();
        for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
            for s in ss["spans"].as_array().into_iter().flatten() {
                let text = |k: &str| s[k].as_str().unwrap_or("").to_owned();
                let attributes = s["attributes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| (a["key"].as_str().unwrap_or("").to_owned(), string_value(a)))
                    .collect();
                out.push(Span {
                    service: service.clone(),
                    name: text("name"),
                    trace: text("traceId"),
                    id: text("spanId"),
                    parent: text("parentSpanId"),
                    attributes,
                });
            }
        }
    }
    out
}

/// Held by the tests that point this process's environment (inherited by every
/// process they start) at a collector: one at a time, or one's daemons export
/// to the other's collector.
static OTEL_ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A receiver that every process this test starts exports its spans to
/// (they inherit the exporter configuration); call with `OTEL_ENV` held.
fn exporting_here() -> Arc<Mutex<Vec<Span>>> {
    let (endpoint, spans) = receiver();
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
    std::env::set_var("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json");
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "200");
    std::env::remove_var("OTEL_SERVICE_NAME");
    spans
}

/// `service`'s span `name` of `task`, with the attribute `extra` when given.
fn find(all: &[Span], service: &str, name: &str, task: &str, extra: Option<(&str, &str)>) -> Option<Span> {
    all.iter()
        .find(|s| {
            s.service == service
                && s.name == name
                && s.attributes.get("task").is_some_and(|t| t == task)
                && extra.is_none_or(|(k, v)| s.attributes.get(k).is_some_and(|x| x == v))
        })
        .cloned()
}

/// Every span received, one line each, for a failure's message.
fn seen(spans: &Mutex<Vec<Span>>) -> Vec<String> {
    let all = spans.lock().unwrap().clone();
    all.iter().map(|s| format!("{}:{} {:?}", s.service, s.name, s.attributes)).collect()
}

#[test]
fn a_task_is_one_trace_across_client_coordinator_worker_and_sidecar() {
    let _env = OTEL_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let spans = exporting_here();
    let c = Cluster::start(1);
    let task = c.submit(&["--", "echo traced"]);
    c.wait_status(&task, "completed", BOUND);

    let chain = eventually(BOUND, || {
        let all = spans.lock().unwrap().clone();
        let submit = find(&all, "tenure-cli", "submit", &task, None)?;
        let api = all.iter().find(|s| {
            s.service == "tenure-coordinator"
                && s.name == "api"
                && s.trace == submit.trace
                && s.attributes.get("verb").is_some_and(|v| v == "submit")
        });
        Some((
            submit.clone(),
            api.cloned()?,
            find(&all, "tenure-coordinator", "lease", &task, None)?,
            find(&all, "tenure-worker", "grant", &task, None)?,
            find(&all, "tenure-worker", "attempt", &task, None)?,
            find(&all, "tenure-sidecar", "intent", &task, None)?,
            find(&all, "tenure-coordinator", "report", &task, Some(("event", "finished")))?,
        ))
    });
    let Some((submit, api, lease, grant, attempt, intent, finalize)) = chain else {
        panic!("the task's spans never all arrived; seen: {:#?}\n{}", seen(&spans), c.logs());
    };
    for s in [&submit, &api, &lease, &grant, &attempt, &intent, &finalize] {
        eprintln!("{}:{} trace {} span {} parent {}", s.service, s.name, s.trace, s.id, s.parent);
    }
    for s in [&api, &lease, &grant, &attempt, &intent, &finalize] {
        assert_eq!(s.trace, submit.trace, "{}:{} is in another trace", s.service, s.name);
    }
    assert!(submit.parent.is_empty(), "the client's submit is the root: {submit:?}");
    assert_eq!(api.parent, submit.id, "coordinator api ← client submit");
    assert_eq!(lease.parent, api.id, "lease ← the submit's api span (kept in the record)");
    assert_eq!(grant.parent, lease.id, "worker grant ← coordinator lease");
    assert_eq!(attempt.parent, grant.id, "attempt ← grant");
    assert_eq!(intent.parent, grant.id, "sidecar intent ← worker grant (recorded with the accept)");
    assert_eq!(finalize.parent, attempt.id, "coordinator finalize ← worker attempt");
}

/// A busy worker tells a short task's start with its end, in one batch of
/// reports: the batch carries the attempt's trace, so the leader's `report`
/// span of the end is in the task's trace, under the worker's attempt.
#[test]
fn a_start_told_with_its_end_stays_in_the_tasks_trace() {
    let _env = OTEL_ENV.lock().unwrap_or_else(|e| e.into_inner());
    let spans = exporting_here();
    // Every start within 10 s of the one before is held that long: the
    // second task ends first, and its start goes with its end.
    let c = Cluster::start_with_worker(&["--started-hold-ms", "10000"]);
    let first = c.submit(&["--", "sleep 3"]);
    c.wait_status(&first, "running", BOUND);
    let second = c.submit(&["--", "echo second"]);
    c.wait_status(&second, "completed", BOUND);
    let found = eventually(BOUND, || {
        let all = spans.lock().unwrap().clone();
        Some((
            find(&all, "tenure-cli", "submit", &second, None)?,
            find(&all, "tenure-worker", "attempt", &second, None)?,
            find(&all, "tenure-coordinator", "report", &second, Some(("event", "finished")))?,
        ))
    });
    let Some((submit, attempt, end)) = found else {
        panic!("the second task's end report has no span; seen: {:#?}\n{}", seen(&spans), c.logs());
    };
    assert_eq!((&attempt.trace, &end.trace), (&submit.trace, &submit.trace), "one trace");
    assert_eq!(end.parent, attempt.id, "the end's report ← the worker's attempt");
}

#[test]
fn a_dead_collector_never_holds_up_a_task() {
    let _env = OTEL_ENV.lock().unwrap_or_else(|e| e.into_inner());
    // An endpoint nobody listens on: exports fail in the background.
    let port = tenure_testkit::free_port();
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}"));
    std::env::set_var("OTEL_BSP_SCHEDULE_DELAY", "100");
    let c = Cluster::start(1);
    let tasks: Vec<String> = (0..5).map(|i| c.submit(&["--", &format!("echo {i}")])).collect();
    for t in &tasks {
        assert!(c.cli(&["wait", t, "--timeout", "30"]).status.success(), "{t}\n{}", c.logs());
    }
}

/// `GET /metrics` from a daemon's endpoint (`None` until it answers).
fn scrape(addr: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nhost: tenure\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.starts_with("HTTP/1.1 200").then_some(text)
}

/// The value of the sample line `name` (exactly, labels included).
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn each_daemon_serves_its_metrics_in_the_prometheus_format() {
    let mut c = Cluster::start(0);
    let addr = |_: &str| format!("127.0.0.1:{}", tenure_testkit::free_port());
    let (coord, sidecar, worker) = (addr("c"), addr("s"), addr("w"));
    c.kill9("coordinator");
    c.spawn_env(
        "coordinator",
        &["coordinator", "--name", "m", "--worker-ttl-ms", "3000"],
        &[("TENURE_METRICS_ADDR", &coord)],
    );
    let d = c.worker_dir("w1").display().to_string();
    c.spawn_env("sidecar-w1", &["sidecar", "--worker", "w1", "--data-dir", &d], &[("TENURE_METRICS_ADDR", &sidecar)]);
    let args = ["worker", "--id", "w1", "--data-dir", &d, "--heartbeat-ms", "300"];
    c.spawn_env("worker-w1", &args, &[("TENURE_METRICS_ADDR", &worker)]);
    c.wait_workers(1);
    let task = c.submit(&["--", "head -c 3000 /dev/zero"]);
    assert!(c.cli(&["wait", &task]).status.success());

    let shows = |addr: &str, line: &str, at_least: f64| {
        eventually(BOUND, || scrape(addr).filter(|t| sample(t, line).is_some_and(|v| v >= at_least))).unwrap_or_else(
            || panic!("{addr} never showed {line} >= {at_least}:\n{}", scrape(addr).unwrap_or_default()),
        )
    };
    let text = shows(&coord, "tenure_coordinator_tasks{status=\"completed\"}", 1.0);
    assert!(text.contains("# TYPE tenure_coordinator_dispatch_duration_seconds histogram"), "{text}");
    shows(&coord, "tenure_coordinator_dispatch_duration_seconds_count", 1.0);
    shows(&coord, "tenure_coordinator_api_requests_total{verb=\"submit\"}", 1.0);
    shows(&coord, "tenure_coordinator_takeovers_total", 1.0);
    shows(&coord, "tenure_coordinator_worker_heartbeat_age_seconds{worker=\"w1\"}", 0.0);
    shows(&worker, "tenure_worker_attempts_total{outcome=\"completed\"}", 1.0);
    shows(&worker, "tenure_worker_output_bytes_total", 3000.0);
    shows(&sidecar, "tenure_sidecar_flush_duration_seconds_count", 4.0);
    shows(&sidecar, "tenure_sidecar_requests_total{request=\"intent\"}", 1.0);
}

#[test]
fn metrics_off_loopback_need_a_token_and_a_token_is_enforced() {
    let mut c = Cluster::start(0);
    let d = c.worker_dir("w1").display().to_string();
    let open = c.spawn_env(
        "sidecar-open",
        &["sidecar", "--worker", "w1", "--data-dir", &d],
        &[("TENURE_METRICS_ADDR", "0.0.0.0:9")],
    );
    let status = open.wait_exit(BOUND).expect("a sidecar serving metrics to the network without a token exited");
    assert!(!status.success());
    assert!(open.log_text().contains("TENURE_METRICS_TOKEN"), "{}", open.log_text());

    let addr = format!("127.0.0.1:{}", tenure_testkit::free_port());
    c.spawn_env(
        "sidecar-w1",
        &["sidecar", "--worker", "w1", "--data-dir", &d],
        &[("TENURE_METRICS_ADDR", &addr), ("TENURE_METRICS_TOKEN", "tok-123")],
    );
    let get = |auth: &str| {
        let mut stream = std::net::TcpStream::connect(&addr).ok()?;
        stream.write_all(format!("GET /metrics HTTP/1.1\r\nhost: tenure\r\n{auth}\r\n").as_bytes()).ok()?;
        let mut text = String::new();
        stream.read_to_string(&mut text).ok()?;
        Some(text)
    };
    let refused = eventually(BOUND, || get("").filter(|t| t.starts_with("HTTP/1.1 401")));
    assert!(refused.is_some(), "no 401 without a token: {:?}", get(""));
    assert!(get("authorization: Bearer wrong\r\n").is_some_and(|t| t.starts_with("HTTP/1.1 401")));
    let ok = get("authorization: Bearer tok-123\r\n").unwrap_or_default();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}
