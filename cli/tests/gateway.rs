//! `tenure gateway` over a real cluster: the HTTP API as the caller, its
//! errors, SSE resumed from `Last-Event-ID`, the OpenAPI document against
//! the routes, identities on an authenticating cluster, and the board in a
//! real headless Chromium.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{Cluster, BIN};
use reqwest::blocking::{Client, Response};
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A gateway of the test's cluster on a free loopback port, with its token file.
struct Gateway {
    url: String,
    tokens: PathBuf,
    http: Client,
}

impl Gateway {
    fn start(c: &mut Cluster) -> Gateway {
        let port = tenure_testkit::free_port();
        let tokens = c.dir.path().join("gateway-tokens.json");
        let listen = format!("127.0.0.1:{port}");
        c.spawn("gateway", &["gateway", "--listen", &listen, "--tokens", tokens.to_str().expect("utf-8 path")]);
        let http = Client::builder().timeout(Duration::from_secs(90)).build().expect("http client");
        let url = format!("http://{listen}");
        let up = tenure_testkit::eventually(Duration::from_secs(30), || {
            http.get(format!("{url}/openapi.json")).send().ok().filter(|r| r.status().is_success())
        });
        assert!(up.is_some(), "the gateway did not come up:\n{}", c.daemon("gateway").log_text());
        Gateway { url, tokens, http }
    }

    /// `tenure gateway token ...`; its stdout.
    fn token_verb(&self, args: &[&str]) -> String {
        let out = Command::new(BIN)
            .args(["gateway", "--tokens"])
            .arg(&self.tokens)
            .arg("token")
            .args(args)
            .output()
            .expect("run tenure gateway token");
        assert!(out.status.success(), "token {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    fn token(&self, identity: &str, creds: Option<&Path>) -> String {
        let mut args = vec!["create", "--identity", identity];
        let creds = creds.map(|p| p.to_str().expect("utf-8 path").to_owned());
        if let Some(c) = &creds {
            args.extend(["--nats-creds", c]);
        }
        self.token_verb(&args)
    }

    fn req(&self, method: reqwest::Method, path: &str, token: &str) -> reqwest::blocking::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.url)).bearer_auth(token)
    }

    fn get(&self, path: &str, token: &str) -> (StatusCode, Value) {
        json_of(self.req(reqwest::Method::GET, path, token).send().expect("GET"))
    }

    fn post(&self, path: &str, token: &str, body: Value) -> (StatusCode, Value) {
        json_of(self.req(reqwest::Method::POST, path, token).json(&body).send().expect("POST"))
    }

    /// An SSE stream, read event by event.
    fn stream(&self, path: &str, token: &str, last_event_id: Option<&str>, timeout: Duration) -> SseReader {
        let mut req = self.req(reqwest::Method::GET, path, token).timeout(timeout);
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id);
        }
        let resp = req.send().expect("SSE");
        assert_eq!(resp.status(), StatusCode::OK);
        assert!(resp.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        SseReader { lines: BufReader::new(resp).lines() }
    }

    /// The events of an SSE stream until (and with) the first `end` or `error`.
    fn events(&self, path: &str, token: &str, last_event_id: Option<&str>) -> Vec<(String, String, Value)> {
        let mut reader = self.stream(path, token, last_event_id, Duration::from_secs(90));
        let mut events = Vec::new();
        while let Some(e) = reader.next_event() {
            let last = matches!(e.0.as_str(), "end" | "error");
            events.push(e);
            if last {
                break;
            }
        }
        events
    }
}

/// Events (name, id, JSON data) of one SSE response.
struct SseReader {
    lines: std::io::Lines<BufReader<Response>>,
}

impl SseReader {
    /// The next event; `None` when the stream ended or timed out.
    fn next_event(&mut self) -> Option<(String, String, Value)> {
        let (mut name, mut id, mut data) = (String::new(), String::new(), String::new());
        for line in self.lines.by_ref() {
            let Ok(line) = line else { return None };
            if line.is_empty() {
                if !data.is_empty() {
                    let value: Value = serde_json::from_str(&data).expect("event data is JSON");
                    return Some((name, id, value));
                }
                continue;
            }
            if let Some(v) = line.strip_prefix("event:") {
                name = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("id:") {
                id = v.trim().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        None
    }
}

fn json_of(r: Response) -> (StatusCode, Value) {
    let status = r.status();
    let text = r.text().expect("body");
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({status}): {e}: {text:?}"));
    (status, value)
}

#[test]
fn the_api_acts_as_the_caller_with_json_errors_and_resumable_output() {
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let alice = gw.token("alice", None);
    let bob = gw.token("bob", None);

    // Authentication: none, garbage, and a revoked token are 401 with a JSON error.
    let (status, body) = json_of(gw.http.get(format!("{}/v1/tasks", gw.url)).send().unwrap());
    assert_eq!((status, body["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (status, body) = gw.get("/v1/tasks", "tnr_nope_nope");
    assert_eq!((status, body["code"].as_str()), (StatusCode::UNAUTHORIZED, Some("unauthorized")));
    let (status, me) = gw.get("/v1/whoami", &alice);
    assert_eq!((status, me["identity"].as_str()), (StatusCode::OK, Some("alice")));

    // Submit with an idempotency key twice: one task.
    let spec = json!({"command": "printf 'hello\\nworld\\n'", "idempotency_key": "build-42"});
    let (status, first) = gw.post("/v1/tasks", &alice, spec.clone());
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let task = first["task"].as_str().unwrap().to_owned();
    let (status, again) = gw.post("/v1/tasks", &alice, spec);
    assert_eq!((status, &again["task"], &again["existing"]), (StatusCode::OK, &first["task"], &json!(true)));

    // Wait (bounded), then logs by byte offset.
    let (status, waited) = gw.get(&format!("/v1/tasks/{task}/wait?timeout_ms=30000"), &alice);
    assert_eq!(status, StatusCode::OK, "{waited}");
    assert_eq!((&waited["finished"], &waited["task"]["status"]), (&json!(true), &json!("completed")));
    assert!(waited["task"]["created_at"].as_str().unwrap().ends_with('Z'), "RFC 3339 times: {waited}");
    let (_, all) = gw.get(&format!("/v1/tasks/{task}/logs"), &alice);
    assert_eq!((all["text"].as_str(), all["next_offset"].as_u64()), (Some("hello\nworld\n"), Some(12)));
    let (_, tail) = gw.get(&format!("/v1/tasks/{task}/logs?offset=6"), &alice);
    assert_eq!(tail["text"], "world\n");

    // Wait for a start: answered while the task runs, not at its end.
    let (_, long) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 30"}));
    let long = long["task"].as_str().unwrap().to_owned();
    let (status, started) = gw.get(&format!("/v1/tasks/{long}/wait?timeout_ms=30000&until=started"), &alice);
    assert_eq!(status, StatusCode::OK, "{started}");
    assert_eq!((&started["finished"], &started["task"]["status"]), (&json!(false), &json!("running")), "{started}");
    let (status, bad) = gw.get(&format!("/v1/tasks/{long}/wait?until=soon"), &alice);
    assert_eq!((status, bad["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad-query")), "{bad}");
    let (status, _) = gw.post(&format!("/v1/tasks/{long}/kill"), &alice, json!(null));
    assert_eq!(status, StatusCode::OK);

    // Another identity's task does not exist for it.
    let (status, body) = gw.get(&format!("/v1/tasks/{task}"), &bob);
    assert_eq!((status, body["code"].as_str()), (StatusCode::NOT_FOUND, Some("not-found")));
    let (status, _) = gw.post(&format!("/v1/tasks/{task}/kill"), &bob, json!(null));
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, bobs) = gw.get("/v1/tasks?all=true", &bob);
    assert_eq!(bobs["tasks"], json!([]));
    let (_, alices) = gw.get("/v1/tasks?all=true", &alice);
    assert!(alices["tasks"].as_array().unwrap().iter().any(|t| t["id"] == task.as_str()));

    // Bad input: malformed JSON 400, unknown field 400, oversized body 413, bad id 400 — all JSON.
    let bad = gw.req(reqwest::Method::POST, "/v1/tasks", &alice).header("content-type", "application/json").body("{");
    let (status, body) = json_of(bad.send().unwrap());
    assert_eq!((status, body["code"].as_str()), (StatusCode::BAD_REQUEST, Some("malformed-json")));
    let (status, body) = gw.post("/v1/tasks", &alice, json!({"command": "true", "comand": "x"}));
    assert_eq!((status, body["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid-body")));
    let big = json!({"command": "true", "label": "x".repeat(300 * 1024)});
    let (status, body) = gw.post("/v1/tasks", &alice, big);
    assert_eq!((status, body["code"].as_str()), (StatusCode::PAYLOAD_TOO_LARGE, Some("too-large")));
    let (status, body) = gw.get("/v1/tasks/not%20an%20id", &alice);
    assert_eq!((status, body["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad-task-id")));
    let (status, body) = gw.get("/v1/no/such/route", &alice);
    assert_eq!((status, body["code"].as_str()), (StatusCode::NOT_FOUND, Some("no-route")));
    // A state conflict: archiving a running task.
    let (_, running) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 30"}));
    let running = running["task"].as_str().unwrap().to_owned();
    let (status, body) = gw.post(&format!("/v1/tasks/{running}/archive"), &alice, json!(null));
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = gw.post(&format!("/v1/tasks/{running}/input"), &alice, json!({"text": "hi"}));
    assert_eq!((status, body["code"].as_str()), (StatusCode::CONFLICT, Some("no-input")));
    let (status, body) = gw.post(&format!("/v1/tasks/{running}/kill?reason=not%20needed"), &alice, json!(null));
    assert_eq!((status, body["result"].as_str()), (StatusCode::OK, Some("requested")));
    let (_, view) = gw.get(&format!("/v1/tasks/{running}"), &alice);
    assert_eq!(view["kill_reason"], "not needed", "{view}");
    // Time limits: the shim ends the task past its timeout.
    let (_, limited) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 30", "timeout_ms": 500}));
    let limited = limited["task"].as_str().unwrap().to_owned();
    let ended = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (_, v) = gw.get(&format!("/v1/tasks/{limited}"), &alice);
        (v["status"] == "failed").then_some(v)
    });
    let ended = ended.expect("the timed-out task failed");
    assert!(ended["detail"].as_str().is_some_and(|d| d.starts_with("timed-out: ")), "{ended}");
    // Retries: refused for a task that is not idempotent; an idempotent
    // one that keeps failing shows every attempt; a delayed start says when.
    let (status, body) = gw.post("/v1/tasks", &alice, json!({"command": "false", "retries": 2}));
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body["message"].as_str().is_some_and(|m| m.contains("not idempotent")), "{body}");
    let (_, retried) = gw.post(
        "/v1/tasks",
        &alice,
        json!({"command": "exit 3", "idempotent": true, "retries": 1, "backoff_ms": 50, "retry_on": ["exit"]}),
    );
    let retried = retried["task"].as_str().unwrap().to_owned();
    let ended = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (_, v) = gw.get(&format!("/v1/tasks/{retried}"), &alice);
        (v["status"] == "failed").then_some(v)
    });
    let ended = ended.expect("the retried task failed at last");
    let attempts: Vec<(u64, bool)> = ended["attempts"]
        .as_array()
        .map(|a| a.iter().map(|a| (a["attempt"].as_u64().unwrap_or(0), a["retried"] == true)).collect())
        .unwrap_or_default();
    assert_eq!(attempts, [(1, true), (2, false)], "{ended}");
    let (_, later) = gw.post("/v1/tasks", &alice, json!({"command": "true", "not_before_in_ms": 60000}));
    let later = later["task"].as_str().unwrap().to_owned();
    let (_, view) = gw.get(&format!("/v1/tasks/{later}"), &alice);
    assert!(view["status"] == "queued" && view["not_before"].is_string(), "{view}");
    gw.post(&format!("/v1/tasks/{later}/kill"), &alice, json!(null));

    // Input to an agent task reaches its stdin, once.
    let (_, agent) =
        gw.post("/v1/tasks", &alice, json!({"kind": "agent", "command": "while read -r l; do echo \"got: $l\"; done"}));
    let agent = agent["task"].as_str().unwrap().to_owned();
    let sent = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (status, body) = gw.post(&format!("/v1/tasks/{agent}/input"), &alice, json!({"text": "hello"}));
        (status == StatusCode::OK).then_some(body)
    });
    assert_eq!(sent.expect("input accepted once the agent runs")["bytes"], 6);
    let got = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (_, out) = gw.get(&format!("/v1/tasks/{agent}/logs"), &alice);
        (out["text"] == "got: hello\n").then_some(())
    });
    assert!(got.is_some(), "the agent did not echo its input");
    let (status, _) = gw.post(&format!("/v1/tasks/{agent}/input"), &bob, json!({"text": "intruder"}));
    assert_eq!(status, StatusCode::NOT_FOUND);
    gw.post(&format!("/v1/tasks/{agent}/kill"), &alice, json!(null));

    // SSE: the whole output live, then resumed from a Last-Event-ID.
    let (_, streamed) =
        gw.post("/v1/tasks", &alice, json!({"command": "for i in 1 2 3; do echo line-$i; sleep 0.3; done"}));
    let streamed = streamed["task"].as_str().unwrap().to_owned();
    let path = format!("/v1/tasks/{streamed}/logs/stream");
    let events = gw.events(&path, &alice, None);
    let text: String = events.iter().filter(|e| e.0 == "output").map(|e| e.2["text"].as_str().unwrap()).collect();
    assert_eq!(text, "line-1\nline-2\nline-3\n");
    let end = events.last().unwrap();
    assert_eq!((end.0.as_str(), end.2["status"].as_str()), ("end", Some("completed")));
    for (name, id, data) in events.iter().filter(|e| e.0 == "output") {
        assert_eq!(id, &data["next_offset"].to_string(), "{name}: the id is the offset after the event");
    }
    let resumed = gw.events(&path, &alice, Some("7"));
    let text: String = resumed.iter().filter(|e| e.0 == "output").map(|e| e.2["text"].as_str().unwrap()).collect();
    assert_eq!(text, "line-2\nline-3\n");
    assert_eq!(resumed[0].2["offset"], 7);
    // Another identity cannot follow it.
    let (status, _) = gw.get(&path, &bob);
    assert_eq!(status, StatusCode::NOT_FOUND);

    // Archive/unarchive/delete, status.
    let (status, moved) = gw.post(&format!("/v1/tasks/{task}/archive"), &alice, json!(null));
    assert_eq!((status, moved["board"].as_str()), (StatusCode::OK, Some("archived")));
    let (_, moved) = gw.post(&format!("/v1/tasks/{task}/unarchive"), &alice, json!(null));
    assert_eq!(moved["board"], "active");
    let (status, moved) =
        json_of(gw.req(reqwest::Method::DELETE, &format!("/v1/tasks/{task}"), &alice).send().unwrap());
    assert_eq!((status, moved["board"].as_str()), (StatusCode::OK, Some("deleted")));
    let (status, cluster) = gw.get("/v1/status", &alice);
    assert_eq!(status, StatusCode::OK);
    assert_eq!(cluster["workers"].as_array().map(Vec::len), Some(1), "{cluster}");

    // Held for approval: blocked with its hint; only its owner sees it to
    // approve it; approved once (409 once it started).
    let (status, held) = gw.post("/v1/tasks", &alice, json!({"command": "true", "hold": true, "on": ["!spot"]}));
    assert_eq!(status, StatusCode::CREATED, "{held}");
    let held = held["task"].as_str().unwrap().to_owned();
    let (_, view) = gw.get(&format!("/v1/tasks/{held}"), &alice);
    assert_eq!((&view["status"], &view["hint"]["tag"]), (&json!("blocked"), &json!("awaiting-approval")), "{view}");
    assert_eq!(view["on"], json!(["!spot"]));
    let (status, _) = gw.post(&format!("/v1/tasks/{held}/approve"), &bob, json!(null));
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, approved) = gw.post(&format!("/v1/tasks/{held}/approve"), &alice, json!(null));
    assert_eq!((status, approved["hint"].is_null()), (StatusCode::OK, true), "{approved}");
    let (_, w) = gw.get(&format!("/v1/tasks/{held}/wait?timeout_ms=30000"), &alice);
    assert_eq!(w["task"]["status"], "completed");
    let (status, again) = gw.post(&format!("/v1/tasks/{held}/approve"), &alice, json!(null));
    assert_eq!((status, again["code"].as_str()), (StatusCode::CONFLICT, Some("not-awaiting-approval")));
    let (status, bad) = gw.post("/v1/tasks", &alice, json!({"command": "true", "concurrency_limit": 2}));
    assert_eq!((status, bad["code"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid-spec")), "{bad}");

    // Revoked: refused from the next request on, without a gateway restart.
    let id = gw.token_verb(&["list", "--json"]);
    let list: Value = serde_json::from_str(&id).unwrap();
    let bob_id =
        list.as_array().unwrap().iter().find(|t| t["identity"] == "bob").unwrap()["id"].as_str().unwrap().to_owned();
    assert!(!id.contains(&bob[5 + bob_id.len() + 1..]), "token list shows no secret");
    gw.token_verb(&["revoke", &bob_id]);
    let (status, _) = gw.get("/v1/whoami", &bob);
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = gw.get("/v1/whoami", &alice);
    assert_eq!(status, StatusCode::OK);
}

#[test]
fn output_resumes_on_a_restarted_gateway_and_streams_end_when_their_token_is_revoked() {
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let alice = gw.token("alice", None);
    let (_, t) =
        gw.post("/v1/tasks", &alice, json!({"command": "for i in $(seq 1 30); do echo tick-$i; sleep 0.1; done"}));
    let task = t["task"].as_str().unwrap().to_owned();
    let path = format!("/v1/tasks/{task}/logs/stream");

    // Read a few events, then the gateway dies mid-stream.
    let mut reader = gw.stream(&path, &alice, None, Duration::from_secs(60));
    let (mut text, mut last_id) = (String::new(), String::new());
    while text.lines().count() < 3 {
        let (name, id, data) = reader.next_event().expect("an output event");
        assert_eq!(name, "output");
        text.push_str(data["text"].as_str().unwrap());
        last_id = id;
    }
    drop(reader);
    c.kill9("gateway");
    let gw = Gateway::start(&mut c);
    // Another gateway (same token file) resumes at the byte after the last event.
    let rest = gw.events(&path, &alice, Some(&last_id));
    assert_eq!(rest.last().map(|e| e.0.as_str()), Some("end"), "{rest:?}");
    for e in rest.iter().filter(|e| e.0 == "output") {
        text.push_str(e.2["text"].as_str().unwrap());
    }
    let expected: String = (1..=30).map(|i| format!("tick-{i}\n")).collect();
    assert_eq!(text, expected, "nothing lost or repeated across the restart");

    // A token revoked while its stream is open ends the stream.
    let admin = gw.token("alice", None);
    let (_, t) = gw.post("/v1/tasks", &alice, json!({"command": "while true; do echo x; sleep 0.2; done"}));
    let endless = t["task"].as_str().unwrap().to_owned();
    let mut reader = gw.stream(&format!("/v1/tasks/{endless}/logs/stream"), &alice, None, Duration::from_secs(30));
    assert_eq!(reader.next_event().map(|e| e.0), Some("output".to_owned()));
    let list: Value = serde_json::from_str(&gw.token_verb(&["list", "--json"])).unwrap();
    let first = list[0]["id"].as_str().unwrap().to_owned();
    gw.token_verb(&["revoke", &first]);
    let ended = std::iter::from_fn(|| reader.next_event()).find(|e| e.0 != "output");
    let (name, _, data) = ended.expect("the stream ends with an event");
    assert_eq!((name.as_str(), data["code"].as_str()), ("error", Some("unauthorized")));
    let (status, _) = gw.post(&format!("/v1/tasks/{endless}/kill"), &admin, json!(null));
    assert_eq!(status, StatusCode::OK, "another token of alice's still works");
}

#[test]
fn notices_stream_each_unreported_end_once() {
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let alice = gw.token("alice", None);
    let bob = gw.token("bob", None);
    let (_, t) = gw.post("/v1/tasks", &alice, json!({"command": "exit 3"}));
    let task = t["task"].as_str().unwrap().to_owned();
    let failed = tenure_testkit::eventually(Duration::from_secs(30), || {
        let (_, s) = gw.get(&format!("/v1/tasks/{task}"), &alice);
        (s["status"] == "failed").then_some(s)
    });
    assert!(failed.is_some(), "the task did not fail");

    let mut reader = gw.stream("/v1/notices/stream", &alice, None, Duration::from_secs(30));
    let (name, _, data) = reader.next_event().expect("a notice");
    assert_eq!((name.as_str(), data["id"].as_str(), &data["reported"]), ("ended", Some(task.as_str()), &json!(true)));
    drop(reader);
    // Shown once: a second reader (and another identity) gets nothing of it.
    for token in [&alice, &bob] {
        let mut again = gw.stream("/v1/notices/stream", token, None, Duration::from_secs(4));
        let seen = again.next_event();
        assert!(seen.is_none(), "shown again: {seen:?}");
    }
}

/// Every documented operation is served (it answers 401 without a token,
/// never the router's `no-route`), and the document lists exactly the API.
#[test]
fn the_openapi_document_matches_the_routes() {
    let mut c = Cluster::start(0);
    let gw = Gateway::start(&mut c);
    let (status, doc) = json_of(gw.http.get(format!("{}/openapi.json", gw.url)).send().unwrap());
    assert_eq!(status, StatusCode::OK);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"), "{}", doc["openapi"]);
    let mut documented = Vec::new();
    for (path, ops) in doc["paths"].as_object().expect("paths") {
        for method in ops.as_object().unwrap().keys() {
            documented.push(format!("{} {path}", method.to_uppercase()));
            let url = format!("{}{}", gw.url, path.replace("{id}", "shell-1"));
            let r = gw.http.request(method.to_uppercase().parse().unwrap(), url).send().unwrap();
            let (status, body) = json_of(r);
            assert_eq!(
                (status, body["code"].as_str()),
                (StatusCode::UNAUTHORIZED, Some("unauthorized")),
                "{method} {path} is documented but not served as an authenticated route"
            );
        }
    }
    documented.sort();
    let mut expected = vec![
        "POST /v1/tasks",
        "POST /v1/tasks/batch",
        "GET /v1/tasks",
        "GET /v1/tasks/{id}",
        "DELETE /v1/tasks/{id}",
        "GET /v1/tasks/{id}/logs",
        "GET /v1/tasks/{id}/logs/stream",
        "POST /v1/tasks/{id}/kill",
        "POST /v1/tasks/{id}/input",
        "GET /v1/tasks/{id}/wait",
        "POST /v1/tasks/{id}/archive",
        "POST /v1/tasks/{id}/unarchive",
        "POST /v1/tasks/{id}/approve",
        "POST /v1/tasks/{id}/pause",
        "POST /v1/tasks/{id}/resume",
        "GET /v1/status",
        "GET /v1/whoami",
        "GET /v1/notices/stream",
    ];
    expected.sort();
    assert_eq!(documented, expected, "the document and the API's routes differ");
    // Undocumented methods on documented paths are not served either.
    let r = gw.http.request(reqwest::Method::PUT, format!("{}/v1/tasks", gw.url)).send().unwrap();
    let (status, body) = json_of(r);
    assert_eq!((status, body["code"].as_str()), (StatusCode::METHOD_NOT_ALLOWED, Some("method-not-allowed")));
    // The two unauthenticated routes: the document and the board.
    let board = gw.http.get(&gw.url).send().unwrap();
    assert_eq!(board.status(), StatusCode::OK);
    assert!(board.text().unwrap().contains("tenure board"));
}

/// On an authenticating cluster each token acts with its own NATS user:
/// tasks are owned by that user, another user's are 404, and a token without
/// credentials is refused rather than served as the gateway.
#[test]
fn on_an_authenticating_cluster_the_gateway_connects_as_each_caller() {
    let mut c = Cluster::secured();
    c.spawn_coordinator("c1", &[]);
    c.start_worker("w1");
    c.wait_workers(1);
    let gw = Gateway::start(&mut c);
    let creds = c.auth.as_ref().unwrap().dir.path().to_owned();
    let alice = gw.token("alice", Some(&creds.join("alice.env")));
    let bob = gw.token("bob", Some(&creds.join("bob.env")));
    let nobody = gw.token("alice", None);

    let (status, sub) = gw.post("/v1/tasks", &alice, json!({"command": "echo secured"}));
    assert_eq!(status, StatusCode::CREATED, "{sub}");
    let task = sub["task"].as_str().unwrap().to_owned();
    let (_, waited) = gw.get(&format!("/v1/tasks/{task}/wait?timeout_ms=30000"), &alice);
    assert_eq!(waited["task"]["status"], "completed", "{waited}");
    assert!(waited["task"]["owner"].as_str().unwrap().starts_with("alice"), "owned by the NATS user: {waited}");
    let (_, out) = gw.get(&format!("/v1/tasks/{task}/logs"), &alice);
    assert_eq!(out["text"], "secured\n");
    let (status, _) = gw.get(&format!("/v1/tasks/{task}"), &bob);
    assert_eq!(status, StatusCode::NOT_FOUND);
    // bob claiming alice's session label is still bob.
    let (status, _) = gw.get(&format!("/v1/tasks/{task}/logs"), &bob);
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = gw.get("/v1/tasks", &nobody);
    assert_eq!((status, body["code"].as_str()), (StatusCode::FORBIDDEN, Some("no-credentials")));
}

/// Where the test artifacts go: `target/test-artifacts/`.
fn artifacts() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).expect("artifacts dir");
    dir
}

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TENURE_CHROMIUM").filter(|p| !p.is_empty()) {
        return Some(p.into());
    }
    ["chromium", "chromium-browser", "google-chrome"].iter().find_map(|name| {
        std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(name)).find(|p| p.is_file())
    })
}

/// Every task id of `path`'s pages as `token`, following `next` with
/// `cursor` (`after` or `before`), and how many pages it took.
fn paged(gw: &Gateway, token: &str, path: &str, cursor: &str) -> (Vec<String>, usize) {
    let (mut ids, mut pages, mut from) = (Vec::new(), 0, None::<u64>);
    loop {
        let url = match from {
            Some(n) => format!("{path}&{cursor}={n}"),
            None => path.to_owned(),
        };
        let (status, page) = gw.get(&url, token);
        assert_eq!(status, StatusCode::OK, "{url}: {page}");
        pages += 1;
        assert!(pages < 100, "{path} never ended");
        ids.extend(page["tasks"].as_array().expect("tasks").iter().map(|t| t["id"].as_str().unwrap().to_owned()));
        match page["next"].as_u64() {
            Some(n) => from = Some(n),
            None => return (ids, pages),
        }
    }
}

fn number(id: &str) -> u64 {
    id.rsplit('-').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("a task id: {id}"))
}

/// `GET /v1/tasks?order=newest`: highest task number first, paged with
/// `before` to the end, only the caller's; and a task's timeline.
#[test]
fn tasks_list_newest_first_page_by_page_and_a_task_shows_its_history() {
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let (alice, bob) = (gw.token("alice", None), gw.token("bob", None));
    let mut mine = Vec::new();
    for i in 0..7 {
        if i == 3 {
            let (status, _) = gw.post("/v1/tasks", &bob, json!({"command": "true", "label": "bob's"}));
            assert_eq!(status, StatusCode::CREATED);
        }
        let (status, sub) = gw.post("/v1/tasks", &alice, json!({"command": "true", "label": format!("a{i}")}));
        assert_eq!(status, StatusCode::CREATED, "{sub}");
        mine.push(sub["task"].as_str().unwrap().to_owned());
    }
    let newest: Vec<String> = mine.iter().rev().cloned().collect();
    let (ids, pages) = paged(&gw, &alice, "/v1/tasks?all=true&order=newest&limit=3", "before");
    assert_eq!((ids.clone(), pages), (newest.clone(), 3), "newest first, three pages of at most 3");
    let (ids, _) = paged(&gw, &alice, "/v1/tasks?all=true&order=newest", "before");
    assert_eq!(ids, newest, "one page without a limit");
    // From the middle; and the old order stays the default.
    let middle = number(&newest[2]);
    let (ids, _) = paged(&gw, &alice, &format!("/v1/tasks?all=true&order=newest&before={middle}"), "before");
    assert_eq!(ids, newest[3..].to_vec());
    let (ids, _) = paged(&gw, &alice, "/v1/tasks?all=true&limit=2", "after");
    assert_eq!(ids, mine, "oldest first by default");
    // Bob sees nothing of alice's.
    let (ids, _) = paged(&gw, &bob, "/v1/tasks?all=true&order=newest&limit=2", "before");
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert!(!mine.contains(&ids[0]));
    // Mixed cursors are refused.
    let (status, body) = gw.get("/v1/tasks?before=3", &alice);
    assert_eq!((status, body["code"].as_str()), (StatusCode::BAD_REQUEST, Some("bad-query")), "{body}");
    let (status, _) = gw.get("/v1/tasks?order=newest&after=3", &alice);
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = gw.get("/v1/tasks?order=sideways", &alice);
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // The document declares the new parameters and the view's timeline.
    let (_, doc) = json_of(gw.http.get(format!("{}/openapi.json", gw.url)).send().expect("GET /openapi.json"));
    let params = doc["paths"]["/v1/tasks"]["get"]["parameters"].as_array().cloned().unwrap_or_default();
    let names: Vec<&str> = params.iter().filter_map(|p| p["name"].as_str()).collect();
    for name in ["all", "after", "order", "before", "limit"] {
        assert!(names.contains(&name), "{name} is not documented: {names:?}");
    }
    let view = &doc["components"]["schemas"]["TaskView"]["properties"];
    assert!(view["timeline"].is_object(), "TaskView.timeline is not documented: {view}");

    // The history of a finished task: submitted, its attempt, its end (it
    // runs long enough for its start to be seen).
    let (_, sub) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 2", "label": "history"}));
    let last = sub["task"].as_str().unwrap().to_owned();
    let (_, w) = gw.get(&format!("/v1/tasks/{last}/wait?timeout_ms=30000"), &alice);
    assert_eq!(w["task"]["status"], "completed", "{w}");
    let timeline = w["task"]["timeline"].as_array().cloned().unwrap_or_default();
    let whats: Vec<&str> = timeline.iter().filter_map(|e| e["what"].as_str()).collect();
    assert_eq!(whats, ["submitted", "attempt-started", "ended"], "{timeline:?}");
    assert_eq!((&timeline[1]["attempt"], &timeline[1]["worker"]), (&json!(1), &json!("w1")), "{timeline:?}");
    assert!(timeline[2]["detail"].as_str().is_some_and(|d| d.starts_with("completed")), "{timeline:?}");
    assert!(timeline.iter().all(|e| e["at"].as_str().is_some_and(|a| a.ends_with('Z'))), "{timeline:?}");
    let at: Vec<u64> = timeline.iter().filter_map(|e| e["at_ms"].as_u64()).collect();
    assert!(at.windows(2).all(|w| w[0] <= w[1]), "oldest first: {at:?}");
}

/// The browser of the board's tests; `None` (skip) only when there is none
/// and `TENURE_SKIP_BROWSER=1` says skipping is meant.
fn browser_or_skip() -> Option<PathBuf> {
    let found = chromium();
    if found.is_none() {
        assert!(
            std::env::var_os("TENURE_SKIP_BROWSER").is_some_and(|v| v == "1"),
            "no chromium on PATH (deploy/test.sh installs Debian's `chromium`; or set TENURE_CHROMIUM=/path, or TENURE_SKIP_BROWSER=1 locally)"
        );
        eprintln!("skipped: no chromium and TENURE_SKIP_BROWSER=1");
    }
    found
}

/// Runs headless Chromium on `url` with `mode` (`--dump-dom` or `--screenshot=…`); its stdout.
fn browse(browser: &Path, url: &str, mode: &str) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let out = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
        .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--window-size=1280,800", "--virtual-time-budget=5000", mode, url])
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium {mode}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_board_shows_the_callers_tasks_in_a_real_browser() {
    let Some(browser) = browser_or_skip() else { return };
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let alice = gw.token("alice", None);
    let bob = gw.token("bob", None);
    let (_, done) = gw.post("/v1/tasks", &alice, json!({"command": "echo from-the-board", "label": "board check"}));
    let done = done["task"].as_str().unwrap().to_owned();
    let (_, w) = gw.get(&format!("/v1/tasks/{done}/wait?timeout_ms=30000"), &alice);
    assert_eq!(w["task"]["status"], "completed");
    let (_, bobs) = gw.post("/v1/tasks", &bob, json!({"command": "true", "label": "not alice's"}));
    let bobs = bobs["task"].as_str().unwrap().to_owned();

    let board = format!("{}/#token={alice}", gw.url);
    let dom = browse(&browser, &board, "--dump-dom");
    let row = dom.split("<tr").find(|r| r.contains(&format!("data-task=\"{done}\""))).unwrap_or_else(|| {
        panic!("the board does not list {done}:\n{dom}");
    });
    assert!(row.contains("completed"), "the row shows the status: {row}");
    let relative = row.contains("ago") || row.contains("just now");
    assert!(row.contains("board check") && relative, "label and relative time: {row}");
    assert!(dom.contains("signed in as alice"), "{dom}");
    assert!(!dom.contains("<body data-errors"), "the page raised uncaught errors:\n{dom}");
    assert!(!dom.contains(&format!("data-task=\"{bobs}\"")), "bob's task is not on alice's board");
    assert!(!dom.contains(&alice), "the token is taken out of the page's address and markup");

    let task_page = format!("{}/#token={alice}&task={done}", gw.url);
    let dom = browse(&browser, &task_page, "--dump-dom");
    assert!(dom.contains("from-the-board"), "the task page shows its output:\n{dom}");
    assert!(!dom.contains("<body data-errors"), "the task page raised uncaught errors:\n{dom}");

    let cluster_page = format!("{}/#token={alice}&cluster", gw.url);
    let dom = browse(&browser, &cluster_page, "--dump-dom");
    let row = dom.split("<tr").find(|r| r.contains("data-worker=\"w1\"")).unwrap_or_else(|| {
        panic!("the cluster page does not list worker w1:\n{dom}");
    });
    assert!(row.contains("/ 4") && row.contains(">ok<"), "slots and sidecar health: {row}");
    assert!(!dom.contains("<body data-errors"), "the cluster page raised uncaught errors:\n{dom}");

    for (name, url) in [("board.png", &board), ("board-task.png", &task_page), ("board-cluster.png", &cluster_page)] {
        let shot = artifacts().join(name);
        let _ = std::fs::remove_file(&shot);
        browse(&browser, url, &format!("--screenshot={}", shot.display()));
        let size = std::fs::metadata(&shot).map(|m| m.len()).unwrap_or(0);
        assert!(size > 1000, "no screenshot at {}", shot.display());
    }
}

/// Headless Chromium driven over the DevTools protocol (a WebSocket): what
/// a person does on the board — waiting for a row to change, clicking a
/// button with the mouse — plus every uncaught exception and `console.error`
/// the page raised.
mod cdp {
    use std::net::TcpStream;
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use serde_json::{json, Value};
    use tungstenite::stream::MaybeTlsStream;
    use tungstenite::{Message, WebSocket};

    pub struct Browser {
        child: Child,
        ws: WebSocket<MaybeTlsStream<TcpStream>>,
        session: String,
        next: u64,
        /// Uncaught exceptions and `console.error` calls, as text.
        pub errors: Vec<String>,
        _profile: tempfile::TempDir,
    }

    impl Browser {
        /// Starts `bin` headless and opens `url` in a page of its own.
        pub fn open(bin: &Path, url: &str) -> Browser {
            let profile = tempfile::tempdir().expect("profile dir");
            let child = Command::new(bin)
                .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"])
                .args(["--disable-background-networking", "--disable-component-update", "--disable-sync"])
                .args(["--remote-debugging-port=0", "--window-size=1280,800"])
                .arg(format!("--user-data-dir={}", profile.path().display()))
                .arg("about:blank")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start chromium");
            // Chromium writes the port it took and the browser's path here.
            let file = profile.path().join("DevToolsActivePort");
            let active = tenure_testkit::eventually(Duration::from_secs(30), || {
                let text = std::fs::read_to_string(&file).ok()?;
                let mut lines = text.lines();
                Some(format!("ws://127.0.0.1:{}{}", lines.next()?, lines.next()?))
            })
            .expect("chromium's DevTools endpoint");
            let (ws, _) = tungstenite::connect(active.as_str()).expect("connect to DevTools");
            if let MaybeTlsStream::Plain(tcp) = ws.get_ref() {
                tcp.set_read_timeout(Some(Duration::from_secs(60))).expect("read timeout");
            }
            let mut b = Browser { child, ws, session: String::new(), next: 0, errors: Vec::new(), _profile: profile };
            let target = b.call("Target.createTarget", json!({"url": "about:blank"}));
            let target = target["targetId"].as_str().expect("target id").to_owned();
            let attached = b.call("Target.attachToTarget", json!({"targetId": target, "flatten": true}));
            b.session = attached["sessionId"].as_str().expect("session id").to_owned();
            b.call("Runtime.enable", json!({}));
            b.call("Page.enable", json!({}));
            b.call("Page.navigate", json!({"url": url}));
            b
        }

        /// One command (to the page once attached); its result. Events read
        /// meanwhile are kept when they are errors.
        pub fn call(&mut self, method: &str, params: Value) -> Value {
            self.next += 1;
            let mut msg = json!({"id": self.next, "method": method, "params": params});
            if !self.session.is_empty() {
                msg["sessionId"] = json!(self.session);
            }
            self.ws.send(Message::text(msg.to_string())).expect("send to DevTools");
            loop {
                let text = match self.ws.read().expect("read from DevTools") {
                    Message::Text(t) => t.to_string(),
                    _ => continue,
                };
                let v: Value = serde_json::from_str(&text).expect("DevTools JSON");
                if v["id"] == json!(self.next) {
                    assert!(v.get("error").is_none(), "{method}: {v}");
                    return v["result"].clone();
                }
                match v["method"].as_str() {
                    Some("Runtime.exceptionThrown") => self.errors.push(v["params"]["exceptionDetails"].to_string()),
                    Some("Runtime.consoleAPICalled") if v["params"]["type"] == "error" => {
                        self.errors.push(v["params"]["args"].to_string())
                    }
                    _ => {}
                }
            }
        }

        /// The value of a JavaScript expression in the page.
        pub fn eval(&mut self, expression: &str) -> Value {
            let r = self.call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            );
            r["result"]["value"].clone()
        }

        /// Waits (bounded, polling) until `expression` is truthy; its value.
        pub fn wait_for(&mut self, expression: &str, bound: Duration) -> Option<Value> {
            tenure_testkit::eventually(bound, || {
                let v = self.eval(expression);
                let truthy = !(v.is_null() || v == json!(false) || v == json!("") || v == json!(0));
                truthy.then_some(v)
            })
        }

        /// A left click with the mouse in the middle of the element `selector`.
        pub fn click(&mut self, selector: &str) {
            let at = self.eval(&format!(
                "(() => {{ const e = document.querySelector({selector:?}); if (!e) return null; \
                 e.scrollIntoView(); const r = e.getBoundingClientRect(); \
                 return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
            ));
            let (x, y) = (at[0].as_f64().expect("element on the page"), at[1].as_f64().expect("element"));
            for kind in ["mousePressed", "mouseReleased"] {
                let event = json!({"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1});
                self.call("Input.dispatchMouseEvent", event);
            }
        }

        /// A PNG of the page as it is now.
        pub fn screenshot(&mut self, to: &Path) {
            use base64::Engine as _;
            let shot = self.call("Page.captureScreenshot", json!({"format": "png"}));
            let png = base64::engine::general_purpose::STANDARD
                .decode(shot["data"].as_str().expect("screenshot data"))
                .expect("base64");
            std::fs::write(to, png).expect("write screenshot");
        }
    }

    impl Drop for Browser {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A person on the board: a task submitted elsewhere appears and moves to
/// `completed` without a reload; on a running task's page the Kill button,
/// clicked with the mouse, stops it (the page shows `killed`, and the API
/// agrees); the page raises no error on the way.
#[test]
fn on_the_board_tasks_move_live_and_a_click_on_kill_stops_one() {
    let Some(bin) = browser_or_skip() else { return };
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let alice = gw.token("alice", None);
    let mut page = cdp::Browser::open(&bin, &format!("{}/#token={alice}", gw.url));
    let bound = Duration::from_secs(60);
    assert!(page.wait_for("document.getElementById('who').textContent.includes('alice')", bound).is_some());

    // Submitted through the API while the board is open: it shows up and completes, no reload.
    let (_, sub) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 2; echo live", "label": "live row"}));
    let task = sub["task"].as_str().unwrap().to_owned();
    let row = format!("document.querySelector('tr[data-task=\"{task}\"] .status')?.textContent");
    let seen = page.wait_for(&row, bound).unwrap_or_else(|| panic!("{task} never appeared\n{}", c.logs()));
    assert!(["queued", "leased", "running"].iter().any(|s| seen.as_str().unwrap_or("").starts_with(s)), "{seen}");
    let done = page.wait_for(&format!("({row}) === 'completed'"), bound);
    assert!(done.is_some(), "{task} never showed completed: {}", page.eval(&row));
    assert_eq!(page.eval("performance.getEntriesByType('navigation').length"), json!(1), "no reload happened");

    // A running task's page: the mouse clicks Kill.
    let (_, sub) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 600", "label": "to kill"}));
    let victim = sub["task"].as_str().unwrap().to_owned();
    page.eval(&format!("location.hash = 'task={victim}'"));
    let status = "[...document.querySelectorAll('#task-fields dt')].find(d => d.textContent === 'status')?.nextSibling?.textContent";
    assert!(page.wait_for(&format!("({status}) === 'running'"), bound).is_some(), "{}", page.eval(status));
    assert!(page.wait_for("!document.getElementById('kill').disabled", bound).is_some());
    page.click("#kill");
    let killed = page.wait_for(&format!("({status} || '').startsWith('killed')"), bound);
    assert!(killed.is_some(), "the page never showed killed: {}", page.eval(status));
    assert!(page.eval("document.getElementById('kill').disabled") == json!(true), "Kill is off once it ended");
    let (_, snap) = gw.get(&format!("/v1/tasks/{victim}"), &alice);
    assert_eq!(snap["status"], "killed", "{snap}");
    page.screenshot(&artifacts().join("board-killed.png"));
    assert!(page.errors.is_empty(), "the page raised errors: {:?}", page.errors);
}

/// Many tasks on the board: the newest page first, older pages loaded as
/// the list scrolls, only the rows in view in the page, filters over what
/// is loaded, a new task on top; a task page shows its history with the
/// attempt and the end; no error on the way.
#[test]
fn the_board_pages_newest_first_loads_older_tasks_on_scroll_and_shows_a_history() {
    let Some(bin) = browser_or_skip() else { return };
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let (alice, bob) = (gw.token("alice", None), gw.token("bob", None));
    // The oldest task runs and ends; sixty more wait for an approval (cheap: they never run).
    let (_, sub) = gw.post("/v1/tasks", &alice, json!({"command": "sleep 2; echo ran", "label": "the oldest"}));
    let oldest = sub["task"].as_str().unwrap().to_owned();
    let (_, w) = gw.get(&format!("/v1/tasks/{oldest}/wait?timeout_ms=30000"), &alice);
    assert_eq!(w["task"]["status"], "completed", "{w}");
    let mut held = Vec::new();
    for i in 0..60 {
        let (status, sub) =
            gw.post("/v1/tasks", &alice, json!({"command": "true", "label": format!("held {i}"), "hold": true}));
        assert_eq!(status, StatusCode::CREATED, "{sub}");
        held.push(sub["task"].as_str().unwrap().to_owned());
    }
    let (_, theirs) = gw.post("/v1/tasks", &bob, json!({"command": "true", "label": "bob's", "hold": true}));
    let theirs = theirs["task"].as_str().unwrap().to_owned();
    let newest = held.last().unwrap().clone();

    let mut page = cdp::Browser::open(&bin, &format!("{}/#token={alice}&page-size=30", gw.url));
    let bound = Duration::from_secs(60);
    let rows = "[...document.querySelectorAll('#tasks tr.row')].map(r => r.dataset.task)";
    let first = page.wait_for(&format!("{rows}[0]"), bound);
    assert_eq!(first, Some(json!(newest)), "the newest task is on top");
    let shown: Vec<String> = serde_json::from_value(page.eval(rows)).unwrap_or_default();
    let numbers: Vec<u64> = shown.iter().map(|t| number(t)).collect();
    assert!(numbers.windows(2).all(|w| w[0] > w[1]), "newest first: {shown:?}");
    assert!(!shown.contains(&oldest), "the oldest is not loaded before a scroll: {shown:?}");
    let count = page.eval("document.getElementById('count').textContent");
    assert!(count.as_str().is_some_and(|t| t.contains("older ones load as you scroll")), "{count}");

    // Scrolling down loads older pages until the oldest task shows.
    let scroll_to_end = format!(
        "(() => {{ const s = document.getElementById('scroller'); s.scrollTop = s.scrollHeight; \
         return !!document.querySelector('tr[data-task=\"{oldest}\"]'); }})()"
    );
    assert!(
        page.wait_for(&scroll_to_end, bound).is_some(),
        "the oldest never loaded: {}",
        page.eval("document.getElementById('count').textContent")
    );
    let count = page.wait_for("document.getElementById('count').textContent.startsWith('61 tasks, newest first') && document.getElementById('count').textContent", bound);
    assert!(count.is_some(), "every task loaded once: {}", page.eval("document.getElementById('count').textContent"));
    let in_dom = page.eval("document.querySelectorAll('#tasks tr.row').length").as_u64().unwrap_or(0);
    assert!((1..=45).contains(&in_dom), "only the rows in view and a few around are in the page: {in_dom}");
    assert!(
        page.eval(&format!("!!document.querySelector('tr[data-task=\"{theirs}\"]')")) == json!(false),
        "bob's task is not on alice's board"
    );
    page.screenshot(&artifacts().join("board-paged.png"));

    // The status filter works over the loaded tasks.
    let pick = |f: &str| {
        format!("[...document.querySelectorAll('#filters button')].find(b => b.textContent.startsWith('{f} ')).click()")
    };
    page.eval(&pick("completed"));
    let only = page.wait_for(&format!("JSON.stringify({rows}) === JSON.stringify(['{oldest}'])"), bound);
    assert!(only.is_some(), "the completed filter shows only {oldest}: {}", page.eval(rows));
    page.eval(&pick("all"));

    // A task submitted while the board is open appears on top.
    let (_, sub) = gw.post("/v1/tasks", &alice, json!({"command": "true", "label": "latest", "hold": true}));
    let latest = sub["task"].as_str().unwrap().to_owned();
    page.eval("document.getElementById('scroller').scrollTop = 0");
    let top = page.wait_for(&format!("{rows}[0] === '{latest}'"), bound);
    assert!(top.is_some(), "{latest} never appeared on top: {}", page.eval(rows));
    let in_dom = page.eval("document.querySelectorAll('#tasks tr.row').length").as_u64().unwrap_or(0);
    assert!((1..=45).contains(&in_dom), "at the top too, only the rows in view and a few around: {in_dom}");

    // The oldest task's page: its history, with its attempt and its end.
    page.eval(&format!("location.hash = 'task={oldest}'"));
    let ended = page.wait_for("document.querySelector('#timeline li[data-what=\"ended\"]')?.textContent", bound);
    let ended = ended.unwrap_or_else(|| {
        panic!("no end in the history: {}", page.eval("document.getElementById('timeline').outerHTML"))
    });
    assert!(ended.as_str().is_some_and(|t| t.contains("completed") && t.contains("attempt 1")), "{ended}");
    let started = page.eval("document.querySelector('#timeline li[data-what=\"attempt-started\"]')?.textContent");
    assert!(started.as_str().is_some_and(|t| t.contains("attempt 1") && t.contains("on w1")), "{started}");
    let whats = page.eval("[...document.querySelectorAll('#timeline li')].map(l => l.dataset.what)");
    assert_eq!(whats, json!(["submitted", "attempt-started", "ended"]));
    let hover = page.eval("document.querySelector('#timeline li[data-what=\"ended\"] time').title");
    assert!(hover.as_str().is_some_and(|t| t.ends_with('Z')), "RFC 3339 on hover: {hover}");
    page.screenshot(&artifacts().join("board-history.png"));
    assert_eq!(page.eval("document.body.dataset.errors ?? null"), Value::Null);
    assert!(page.errors.is_empty(), "the page raised errors: {:?}", page.errors);
}

/// One JSON-RPC call to the gateway's `/mcp` as `token`: its HTTP status
/// and the JSON-RPC answer (`Null` when there is none, as for a
/// notification).
fn mcp(gw: &Gateway, token: &str, id: u64, method: &str, params: Value) -> (StatusCode, Value) {
    let mut body = json!({"jsonrpc": "2.0", "method": method, "params": params});
    if id > 0 {
        body["id"] = json!(id);
    }
    let r = gw
        .req(reqwest::Method::POST, "/mcp", token)
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18")
        .json(&body)
        .send()
        .expect("POST /mcp");
    let status = r.status();
    let text = r.text().unwrap_or_default();
    // A JSON body, or the `data:` line of a one-event stream.
    let json = text.lines().find_map(|l| l.strip_prefix("data:")).unwrap_or(&text).trim().to_owned();
    (status, serde_json::from_str(&json).unwrap_or(Value::Null))
}

/// The MCP tools over streamable HTTP at `/mcp`: the gateway's token names
/// who they act as; another identity's task is not found; no token, 401.
#[test]
fn mcp_over_http_acts_as_the_callers_identity() {
    let mut c = Cluster::start(1);
    let gw = Gateway::start(&mut c);
    let (alice, bob) = (gw.token("alice", None), gw.token("bob", None));
    let init =
        json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}});
    let (status, hello) = mcp(&gw, &alice, 1, "initialize", init.clone());
    assert_eq!(status, StatusCode::OK, "{hello}");
    assert_eq!(hello["result"]["serverInfo"]["name"], "tenure", "{hello}");
    let (_, tools) = mcp(&gw, &alice, 2, "tools/list", json!({}));
    let names: Vec<&str> =
        tools["result"]["tools"].as_array().map_or(vec![], |t| t.iter().filter_map(|t| t["name"].as_str()).collect());
    assert!(names.contains(&"start_task") && names.contains(&"read_output"), "{tools}");

    let call = |token: &str, name: &str, arguments: Value| {
        let (status, answer) = mcp(&gw, token, 3, "tools/call", json!({"name": name, "arguments": arguments}));
        assert_eq!(status, StatusCode::OK, "{answer}");
        answer["result"].clone()
    };
    let started = call(&alice, "start_task", json!({"command": "echo over-http", "hold": true}));
    let task = started["structuredContent"]["task"].as_str().unwrap_or_else(|| panic!("{started}")).to_owned();
    let got = call(&alice, "get_task", json!({"task": task}));
    assert_eq!(got["structuredContent"]["task"]["status"], "blocked", "{got}");
    let theirs = call(&bob, "get_task", json!({"task": task}));
    assert_eq!(theirs["isError"], true, "{theirs}");
    let (_, approved) = gw.post(&format!("/v1/tasks/{task}/approve"), &alice, json!(null));
    assert_eq!(approved["status"], "queued", "{approved}");
    let waited = call(&alice, "wait_task", json!({"task": task, "timeout_ms": 30000}));
    assert_eq!(waited["structuredContent"]["task"]["status"], "completed", "{waited}");
    let read = call(&alice, "read_output", json!({"task": task}));
    assert_eq!(read["structuredContent"]["text"], "over-http\n", "{read}");

    let r = reqwest::blocking::Client::new()
        .post(format!("{}/mcp", gw.url))
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": init}))
        .send()
        .expect("POST /mcp");
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
}
