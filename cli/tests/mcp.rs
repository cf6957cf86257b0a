//! `tenure mcp` as an agent's MCP client sees it: the real binary spoken to
//! in JSON-RPC over its stdin and stdout, against a real cluster. The
//! handshake, the tool list and its schemas, every tool, refusals as tool
//! errors, and each ended task listed as `unreported` exactly once.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::{Cluster, BIN};
use serde_json::{json, Value};

/// Longest one answer may take (a `wait_task` asks for at most 30 s here).
const ANSWER_BOUND: Duration = Duration::from_secs(60);

/// A `tenure mcp` process and the lines it writes on stdout.
struct Mcp {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    next_id: u64,
}

impl Mcp {
    fn start(c: &Cluster) -> Mcp {
        let mut child = Command::new(BIN)
            .args(["--nats", &c.nats.url, "--session", &c.session, "mcp"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn tenure mcp");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Mcp { child, stdin, lines, next_id: 1 }
    }

    fn write(&mut self, message: &Value) {
        writeln!(self.stdin, "{message}").expect("write to tenure mcp");
        self.stdin.flush().expect("flush");
    }

    /// A request's answer (its `result`, or the whole message when it is an error).
    fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.write(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        loop {
            let line = self.lines.recv_timeout(ANSWER_BOUND).unwrap_or_else(|_| panic!("no answer to {method}"));
            // Every line on stdout is one JSON-RPC message: logs go to stderr.
            let message: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON-RPC: {e}: {line}"));
            assert_eq!(message["jsonrpc"], "2.0", "{message}");
            if message["id"] == json!(id) {
                return message.get("result").cloned().unwrap_or(message);
            }
        }
    }

    /// `tools/call`: the structured result, and whether it is a tool error
    /// (then the text of its content).
    fn call(&mut self, tool: &str, args: Value) -> Result<Value, String> {
        let result = self.request("tools/call", json!({"name": tool, "arguments": args}));
        assert!(result.get("error").is_none(), "{tool}: a protocol error instead of a tool result: {result}");
        if result["isError"] == json!(true) {
            let text = result["content"].as_array().into_iter().flatten().filter_map(|c| c["text"].as_str()).collect();
            return Err(text);
        }
        let structured = result["structuredContent"].clone();
        assert!(structured.is_object(), "{tool}: no structured content: {result}");
        assert!(structured["unreported"].is_array(), "{tool}: every result lists `unreported`: {structured}");
        assert!(structured["matched"].is_array(), "{tool}: every result lists `matched`: {structured}");
        Ok(structured)
    }

    fn ok(&mut self, tool: &str, args: Value) -> Value {
        self.call(tool, args.clone()).unwrap_or_else(|e| panic!("{tool} {args}: {e}"))
    }
}

impl Drop for Mcp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array().into_iter().flatten().filter_map(|t| t["id"].as_str().map(str::to_owned)).collect()
}

#[test]
fn an_mcp_client_drives_tasks_through_tenure_mcp() {
    let c = Cluster::start(1);
    let mut mcp = Mcp::start(&c);

    let init = mcp.request(
        "initialize",
        json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}),
    );
    assert_eq!(init["serverInfo"]["name"], "tenure", "{init}");
    assert!(init["capabilities"]["tools"].is_object(), "{init}");
    assert!(init["capabilities"]["logging"].is_object(), "{init}");
    mcp.write(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));

    // The tools, each with object input and output schemas and a description for a model.
    let tools = mcp.request("tools/list", json!({}));
    let mut names: Vec<&str> =
        tools["tools"].as_array().expect("tools").iter().filter_map(|t| t["name"].as_str()).collect();
    names.sort_unstable();
    let expected =
        ["archive_task", "get_task", "list_tasks", "read_output", "send_input", "start_task", "stop_task", "wait_task"];
    assert_eq!(names, expected);
    for t in tools["tools"].as_array().expect("tools") {
        assert_eq!(t["inputSchema"]["type"], "object", "{t}");
        assert_eq!(t["outputSchema"]["type"], "object", "{t}");
        assert!(t["outputSchema"]["properties"]["unreported"].is_object(), "{t}");
        assert!(t["description"].as_str().is_some_and(|d| d.len() > 40), "{t}");
    }
    let start = tools["tools"].as_array().unwrap().iter().find(|t| t["name"] == "start_task").unwrap();
    // The gateway's submit body, described for a model: a command or steps.
    let props = &start["inputSchema"]["properties"];
    for field in ["command", "steps", "kind", "idempotent", "hold", "on", "retries", "idempotency_key"] {
        assert!(props[field]["description"].as_str().is_some_and(|d| !d.is_empty()), "{field}: {start}");
    }
    let empty = mcp.call("start_task", json!({"label": "nothing to run"}));
    assert!(empty.is_err_and(|e| e.contains("`command` is required")), "a start without a command is a tool error");

    // Start, wait, read by offset in bounded pieces.
    let task = mcp.ok("start_task", json!({"command": "printf 'ab\\ncd\\n'", "label": "letters"}))["task"]
        .as_str()
        .expect("task id")
        .to_owned();
    assert!(task.starts_with("shell-"), "{task}");
    let waited = mcp.ok("wait_task", json!({"task": task, "timeout_ms": 30000}));
    assert_eq!((&waited["finished"], &waited["task"]["status"]), (&json!(true), &json!("completed")), "{waited}");
    let first = mcp.ok("read_output", json!({"task": task, "max_bytes": 3}));
    assert_eq!((&first["text"], &first["next_offset"], &first["more"]), (&json!("ab\n"), &json!(3), &json!(true)));
    let rest = mcp.ok("read_output", json!({"task": task, "offset": 3}));
    assert_eq!((&rest["text"], &rest["next_offset"]), (&json!("cd\n"), &json!(6)), "{rest}");
    let end = mcp.ok("read_output", json!({"task": task, "offset": 6}));
    assert_eq!((&end["text"], &end["finished"]), (&json!(""), &json!(true)), "{end}");
    let listed = mcp.ok("list_tasks", json!({"status": "completed", "all": true}));
    assert!(ids(&listed["tasks"]).contains(&task), "{listed}");
    // A list stays short for the model: histories only in `get_task`.
    let tasks = listed["tasks"].as_array().cloned().unwrap_or_default();
    assert!(tasks.iter().all(|t| t["timeline"] == json!([])), "{listed}");
    let history = mcp.ok("get_task", json!({"task": task}))["task"]["timeline"].clone();
    assert!(history.as_array().is_some_and(|h| h.len() >= 3), "submitted, started, ended: {history}");
    assert_eq!(mcp.ok("archive_task", json!({"task": task}))["task"]["board"], "archived");

    // Input to an agent task, then stop it.
    let agent = mcp.ok("start_task", json!({"command": "while read -r l; do echo \"got: $l\"; done", "kind": "agent"}))
        ["task"]
        .as_str()
        .expect("agent id")
        .to_owned();
    let running = mcp.ok("wait_task", json!({"task": agent, "started": true, "timeout_ms": 30000}));
    assert_eq!((&running["finished"], &running["task"]["status"]), (&json!(false), &json!("running")), "{running}");
    let sent = tenure_testkit::eventually(Duration::from_secs(30), || {
        mcp.call("send_input", json!({"task": agent, "text": "hello"})).ok()
    });
    assert_eq!(sent.expect("input accepted once the agent runs")["bytes"], 6);
    let echoed = tenure_testkit::eventually(Duration::from_secs(30), || {
        let out = mcp.ok("read_output", json!({"task": agent}));
        (out["text"] == "got: hello\n").then_some(out)
    });
    assert!(echoed.is_some(), "the agent did not echo its input");
    let stopped = mcp.ok("stop_task", json!({"task": agent, "reason": "done with it"}));
    assert_eq!(stopped["result"], "requested");
    let waited = mcp.ok("wait_task", json!({"task": agent, "timeout_ms": 30000}));
    assert_eq!((&waited["task"]["status"], &waited["task"]["kill_reason"]), (&json!("killed"), &json!("done with it")));

    // Refusals are tool errors with a message, never protocol errors.
    let missing = mcp.call("get_task", json!({"task": "shell-999999"})).expect_err("an unknown task");
    assert!(missing.contains("shell-999999"), "{missing}");
    let bad = mcp.call("get_task", json!({"task": "not an id"})).expect_err("a bad id");
    assert!(bad.contains("not a task id"), "{bad}");
    let sleeper = mcp.ok("start_task", json!({"command": "sleep 30"}))["task"].as_str().unwrap().to_owned();
    assert!(mcp.call("archive_task", json!({"task": sleeper})).is_err(), "archiving a running task");
    assert!(mcp.call("send_input", json!({"task": sleeper, "text": "hi"})).is_err(), "input to a shell task");
    assert!(mcp.call("start_task", json!({"command": ""})).is_err(), "an empty command");
    mcp.ok("stop_task", json!({"task": sleeper}));

    // A task nobody read or waited on is listed as unreported in some later
    // result, once; the ones read or waited on never are.
    let started = mcp.ok("start_task", json!({"command": "echo nobody reads me"}));
    let Some(quiet) = started["task"].as_str().map(str::to_owned) else { panic!("no task id in {started}") };
    // A task this short may have ended by the time its own start's result
    // was made: that result counts too.
    let mut told = ids(&started["unreported"]);
    let seen = tenure_testkit::eventually(Duration::from_secs(30), || {
        let r = mcp.ok("get_task", json!({"task": quiet}));
        told.extend(ids(&r["unreported"]));
        told.contains(&quiet).then_some(())
    });
    assert!(seen.is_some(), "the ended task was never listed as unreported: {told:?}\n{}", c.logs());
    let again = mcp.ok("list_tasks", json!({}));
    told.extend(ids(&again["unreported"]));
    assert_eq!(told.iter().filter(|t| **t == quiet).count(), 1, "{told:?}");
    assert!(!told.contains(&task) && !told.contains(&agent), "reported tasks were listed: {told:?}");
    assert_eq!(mcp.ok("get_task", json!({"task": quiet}))["task"]["reported"], true);
}
