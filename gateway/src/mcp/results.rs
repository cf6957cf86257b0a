//! What each MCP tool answers, as types: their JSON schemas are the tools'
//! declared output schemas (`outputSchema`), and a result is serialized from
//! the same type, so the two cannot drift apart.
//!
//! Every result carries [`News`]: the caller's tasks that ended and matched
//! monitor lines that nothing told it yet (each told once, here or as a
//! notification, never both). This module only shapes answers; it must
//! never ask the cluster anything.

use schemars::JsonSchema;
use serde::Serialize;

use crate::api::TaskView;

/// What every result adds: news the caller had not heard yet, each item
/// once (a later result never repeats it).
#[derive(Debug, Default, Serialize, JsonSchema)]
pub struct News {
    /// Your tasks that ended and that nothing had reported yet (a read of their
    /// whole output, a wait, a notification or an earlier result): each is
    /// listed once, and listing it reports it. At most 32 per result; the rest
    /// come in the next results.
    pub unreported: Vec<TaskView>,
    /// Output lines of your `monitor` tasks that matched their pattern since
    /// the last result (or notification) that told you of them, oldest first.
    pub matched: Vec<MatchView>,
}

/// One matched line of a `monitor` task.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct MatchView {
    /// The monitor task's id.
    pub task: String,
    /// The monitor task's label.
    pub label: String,
    /// Byte offset in the task's output where the line starts.
    pub offset: u64,
    /// The line, without its newline (at most 1 KiB).
    pub text: String,
}

/// `start_task`'s answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Started {
    /// The new task's id (`<kind>-<n>`).
    pub task: String,
    /// True when the idempotency key had already started this task: nothing new was started.
    pub existing: bool,
    #[serde(flatten)]
    pub news: News,
}

/// `list_tasks`' answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Listed {
    /// The tasks, oldest first, at most 200 (the newest are kept).
    pub tasks: Vec<TaskView>,
    /// How many more tasks matched and were left out to keep the answer short.
    pub omitted: u64,
    #[serde(flatten)]
    pub news: News,
}

/// The answer of `get_task` and `archive_task`: the task as it is now.
#[derive(Debug, Serialize, JsonSchema)]
pub struct One {
    pub task: TaskView,
    #[serde(flatten)]
    pub news: News,
}

/// `read_output`'s answer: one bounded piece of the output.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Read {
    /// The task's id.
    pub task: String,
    /// Where this piece starts (the `offset` asked for).
    pub offset: u64,
    /// Where the next read starts: pass it as `offset`.
    pub next_offset: u64,
    /// The output (UTF-8; a character cut by the bound is left for the next read).
    pub text: String,
    /// Bytes in `text`.
    pub bytes: u64,
    /// True when `max_bytes` cut this piece short: more output is already there.
    pub more: bool,
    /// True when the task ended and every byte of its output was read.
    pub finished: bool,
    /// What to do next, in words.
    pub note: String,
    #[serde(flatten)]
    pub news: News,
}

/// `send_input`'s answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Sent {
    pub task: String,
    /// Bytes written to the task's stdin (the message and its newline).
    pub bytes: u64,
    /// Kept for the task's resumed attempt instead (its machine lost its
    /// process; it declares a resume command): the resumed agent reads it
    /// first.
    pub kept: bool,
    #[serde(flatten)]
    pub news: News,
}

/// `stop_task`'s answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Stopped {
    pub task: String,
    /// `requested` (it is being stopped: wait for it) or `already-finished`.
    pub result: String,
    #[serde(flatten)]
    pub news: News,
}

/// `wait_task`'s answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Waited {
    /// True when the task ended; false when the wait's bound passed first (call again).
    pub finished: bool,
    pub task: TaskView,
    #[serde(flatten)]
    pub news: News,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every result's schema is an object (MCP wants one at the root) that
    /// lists the news, and a result serializes to what its schema says.
    #[test]
    fn every_result_is_an_object_that_carries_the_news() {
        let schemas = [
            schemars::schema_for!(Started),
            schemars::schema_for!(Listed),
            schemars::schema_for!(One),
            schemars::schema_for!(Read),
            schemars::schema_for!(Sent),
            schemars::schema_for!(Stopped),
            schemars::schema_for!(Waited),
        ];
        for schema in schemas {
            let schema = schema.as_value();
            assert_eq!(schema["type"], "object", "{schema}");
            for field in ["unreported", "matched"] {
                assert!(schema["properties"][field].is_object(), "{field}: {schema}");
                let required = schema["required"].as_array().map(|r| r.iter().any(|f| f == field));
                assert_eq!(required, Some(true), "{field} is always there: {schema}");
            }
        }
        let sent = Sent { task: "agent-3".into(), bytes: 6, kept: false, news: News::default() };
        let value = serde_json::to_value(&sent).expect("serializes");
        assert_eq!(
            value,
            serde_json::json!({"task": "agent-3", "bytes": 6, "kept": false, "unreported": [], "matched": []})
        );
    }
}
