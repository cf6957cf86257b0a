//! `tenure send`: one message to the stdin of a running `agent` task, from
//! its words or from stdin, delivered by `tenure_client::input` (never sent
//! twice: an unanswered message is in doubt).

use std::io::Read;
use std::process::ExitCode;

use anyhow::anyhow;
use tenure_client::input_message;
use tenure_protocol::messages::{ApiError, MAX_INPUT_BYTES};
use tenure_protocol::TaskId;

use super::Api;

pub(crate) async fn send(api: &Api, task: TaskId, text: Vec<String>, raw: bool) -> anyhow::Result<ExitCode> {
    let from_args = if text.is_empty() { None } else { Some(message(&text, raw)?) };
    let target = api.input_target(&task).await?;
    // Stdin is read only now, so that a wrong task is reported before anyone types.
    let data = match from_args {
        Some(data) => data,
        None => tokio::task::spawn_blocking(move || message_from(std::io::stdin().lock(), raw)).await??,
    };
    let ack = api.deliver_input(&target, &task, data).await?;
    tracing::debug!(task = %task, attempt = %ack.attempt, bytes = ack.bytes, kept = ack.kept, "input delivered");
    if ack.kept {
        eprintln!("tenure: {task}'s machine lost its process; the message is kept for its resumed attempt");
    }
    Ok(ExitCode::SUCCESS)
}

/// The message made of TEXT words: joined by spaces, a newline added unless `raw`.
fn message(text: &[String], raw: bool) -> Result<Vec<u8>, ApiError> {
    input_message(text.join(" ").into_bytes(), raw)
}

/// The message read from `input` until its end; more than the limit is refused
/// without reading the rest.
fn message_from(input: impl Read, raw: bool) -> anyhow::Result<Vec<u8>> {
    let mut data = Vec::new();
    input.take(MAX_INPUT_BYTES as u64 + 1).read_to_end(&mut data)?;
    if data.len() > MAX_INPUT_BYTES {
        return Err(anyhow!(
            "input from stdin is larger than {MAX_INPUT_BYTES} bytes, the most one message holds; split it over several sends"
        ));
    }
    Ok(input_message(data, raw)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_end_with_one_newline_unless_raw() {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(message(&words(&["hello", "there"]), false).unwrap(), b"hello there\n");
        assert_eq!(message(&words(&["hello\n"]), false).unwrap(), b"hello\n");
        assert_eq!(message(&words(&["no", "newline"]), true).unwrap(), b"no newline");
        assert_eq!(message(&words(&[""]), false).unwrap(), b"\n", "an empty line is a message");
        assert!(matches!(message(&words(&[""]), true), Err(ApiError::InputSize { size: 0, .. })));
        assert_eq!(message_from(&b"from stdin\n"[..], false).unwrap(), b"from stdin\n");
        assert_eq!(message_from(&b"two\nlines"[..], false).unwrap(), b"two\nlines\n");
    }

    #[test]
    fn oversized_messages_are_refused() {
        let at_limit = "x".repeat(MAX_INPUT_BYTES - 1);
        assert_eq!(message(std::slice::from_ref(&at_limit), false).unwrap().len(), MAX_INPUT_BYTES);
        assert!(matches!(message(&[at_limit + "x"], false), Err(ApiError::InputSize { .. })));
        let big = vec![b'y'; MAX_INPUT_BYTES * 3];
        assert!(message_from(&big[..], true).is_err());
        assert_eq!(message_from(&big[..MAX_INPUT_BYTES], true).unwrap().len(), MAX_INPUT_BYTES);
    }
}
