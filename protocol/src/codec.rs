//! The wire codec: one version byte, then a MessagePack body (rmp-serde, named
//! fields so that fields can be added without breaking old readers).
//!
//! Decoding is total: any byte string — empty, truncated, oversized, from a newer
//! peer, or plain garbage — yields a [`CodecError`], never a panic. The size limit
//! is checked before any parsing so an oversized message costs nothing.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// The wire format version this build writes and reads.
pub const WIRE_VERSION: u8 = 1;

/// Largest encoded message accepted or produced, version byte included. NATS's
/// default `max_payload` is 1 MiB; staying under it keeps every message deliverable.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024 - 4096;

/// Why a message could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("empty message")]
    Empty,
    #[error("message of {size} bytes exceeds the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
    #[error("unsupported wire version {found} (this build speaks {expected})")]
    Version { found: u8, expected: u8 },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

/// Encodes `msg` with the version byte; refuses to produce an oversized message.
///
/// Messages are written into a buffer kept per thread and copied out at
/// their exact size: one allocation per message instead of a growing
/// buffer's three or four (a task record is 0.4–0.6 KiB). A message larger
/// than 64 KiB takes the buffer with it.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, CodecError> {
    SCRATCH.with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut buf) => {
            buf.clear();
            let encoded = encode_into(&mut buf, msg);
            // A buffer grown past the limit goes with its message (or away).
            let large = (buf.capacity() > SCRATCH_KEPT).then(|| std::mem::take(&mut *buf));
            encoded.map(|()| large.unwrap_or_else(|| buf.as_slice().to_vec()))
        }
        // Only if a value's serialization encoded another message.
        Err(_) => {
            let mut buf = Vec::with_capacity(128);
            encode_into(&mut buf, msg)?;
            Ok(buf)
        }
    })
}

/// The largest message whose encoding buffer [`encode`] keeps for the next.
const SCRATCH_KEPT: usize = 64 * 1024;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn encode_into<T: Serialize>(out: &mut Vec<u8>, msg: &T) -> Result<(), CodecError> {
    out.push(WIRE_VERSION);
    rmp_serde::encode::write_named(out, msg).map_err(|e| CodecError::Encode(e.to_string()))?;
    if out.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge { size: out.len(), max: MAX_MESSAGE_BYTES });
    }
    Ok(())
}

/// Decodes a message produced by [`encode`]. Trailing bytes after the body are
/// refused: a message means exactly one value.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(CodecError::TooLarge { size: bytes.len(), max: MAX_MESSAGE_BYTES });
    }
    let (&version, body) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != WIRE_VERSION {
        return Err(CodecError::Version { found: version, expected: WIRE_VERSION });
    }
    let mut de = rmp_serde::Deserializer::new(body);
    let value = T::deserialize(&mut de).map_err(|e| CodecError::Malformed(e.to_string()))?;
    let rest = de.into_inner();
    if !rest.is_empty() {
        return Err(CodecError::Malformed(format!("{} trailing bytes", rest.len())));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{ApiRequest, Heartbeat, InputRequest, OutputRequest, Report, SidecarRequest, WorkerCommand};
    use proptest::prelude::*;

    /// The per-thread buffer never leaks one message into the next: small
    /// after large, after a refused one, and the same value twice encode
    /// alike and decode back; a large message does not stay behind.
    #[test]
    fn the_reused_buffer_holds_nothing_of_the_last_message() {
        let small = "x".repeat(10);
        let large = "y".repeat(SCRATCH_KEPT * 2);
        let too_large = "z".repeat(MAX_MESSAGE_BYTES);
        let once = encode(&small).unwrap();
        assert_eq!(decode::<String>(&encode(&large).unwrap()).unwrap(), large);
        assert_eq!(encode(&small).unwrap(), once);
        assert!(matches!(encode(&too_large), Err(CodecError::TooLarge { .. })));
        assert_eq!(encode(&small).unwrap(), once);
        assert_eq!(decode::<String>(&once).unwrap(), small);
        assert_eq!(once.capacity(), once.len(), "copied out at its size");
        SCRATCH.with(|s| assert!(s.borrow().capacity() <= SCRATCH_KEPT, "a large buffer stayed behind"));
    }

    #[test]
    fn refuses_empty_wrong_version_and_oversize() {
        assert_eq!(decode::<ApiRequest>(&[]), Err(CodecError::Empty));
        assert!(matches!(decode::<ApiRequest>(&[9, 0x80]), Err(CodecError::Version { found: 9, .. })));
        let big = vec![WIRE_VERSION; MAX_MESSAGE_BYTES + 1];
        assert!(matches!(decode::<ApiRequest>(&big), Err(CodecError::TooLarge { .. })));
        let huge = "x".repeat(MAX_MESSAGE_BYTES);
        assert!(matches!(encode(&huge), Err(CodecError::TooLarge { .. })));
    }

    #[test]
    fn refuses_trailing_bytes() {
        let mut bytes = encode(&ApiRequest::List { session: "s".parse().unwrap(), all: true }).unwrap();
        assert!(decode::<ApiRequest>(&bytes).is_ok());
        bytes.push(0xc0);
        assert!(matches!(decode::<ApiRequest>(&bytes), Err(CodecError::Malformed(_))));
    }

    #[test]
    fn input_bytes_travel_as_bin_and_round_trip() {
        let msg = InputRequest {
            session: "s".parse().unwrap(),
            task: "agent-3".parse().unwrap(),
            data: vec![0xff; crate::messages::MAX_INPUT_BYTES],
        };
        let bytes = encode(&msg).unwrap();
        // `bin`, not an array of integers (which would take up to 2 bytes each).
        assert!(bytes.len() < crate::messages::MAX_INPUT_BYTES + 100, "{}", bytes.len());
        assert_eq!(decode::<InputRequest>(&bytes).unwrap(), msg);
    }

    fn all_decoders(bytes: &[u8]) {
        let _ = decode::<ApiRequest>(bytes);
        let _ = decode::<Heartbeat>(bytes);
        let _ = decode::<Report>(bytes);
        let _ = decode::<OutputRequest>(bytes);
        let _ = decode::<InputRequest>(bytes);
        let _ = decode::<WorkerCommand>(bytes);
        let _ = decode::<SidecarRequest>(bytes);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            all_decoders(&bytes);
            let mut versioned = vec![WIRE_VERSION];
            versioned.extend_from_slice(&bytes);
            all_decoders(&versioned);
        }

        #[test]
        fn truncated_messages_are_errors(cut in 0usize..200, label in "\\PC{0,60}") {
            let msg = ApiRequest::Submit(crate::messages::SubmitRequest {
                session: "s1".parse().unwrap(),
                idempotency_key: uuid::Uuid::nil(),
                spec: crate::spec::TaskSpec::shell(label, "echo hi"),
            });
            let bytes = encode(&msg).unwrap();
            let cut = cut.min(bytes.len().saturating_sub(1));
            prop_assert!(decode::<ApiRequest>(&bytes[..cut]).is_err());
            prop_assert_eq!(decode::<ApiRequest>(&bytes).unwrap(), msg);
        }

        #[test]
        fn flipped_bytes_never_panic(pos in 0usize..200, val in any::<u8>()) {
            let msg = WorkerCommand::Kill(crate::messages::KillCommand {
                task: "shell-5".parse().unwrap(),
                attempt: crate::ids::Attempt(2),
                epoch: crate::ids::Epoch(3),
            });
            let mut bytes = encode(&msg).unwrap();
            let pos = pos % bytes.len();
            bytes[pos] = val;
            all_decoders(&bytes);
        }
    }
}
