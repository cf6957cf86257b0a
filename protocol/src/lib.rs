//! The pure core of tenure: identifiers, messages, subjects, the wire codec and
//! the task lifecycle table.
//!
//! **Invariant:** this crate does no IO, reads no clock and draws no randomness.
//! It never depends on tokio, async-nats or sled. Time and ids come in as
//! arguments, so everything here is deterministic and tested exhaustively.

pub mod codec;
pub mod ids;
mod intern;
pub mod lifecycle;
pub mod messages;
pub mod placement;
pub mod resources;
pub mod resume;
pub mod retry;
pub mod spec;
pub mod subjects;
pub mod timeline;

pub use codec::{decode, encode, CodecError, MAX_MESSAGE_BYTES};
pub use ids::{Attempt, Epoch, IdError, Kind, SessionId, TaskId, WorkerId};
pub use lifecycle::{
    apply, Board, Decision, Ending, Event, HintTag, Lifecycle, Outcome, RecoveryHint, Status, Unchanged,
    MAX_DETAIL_BYTES, MAX_HINT_BYTES, MAX_KEPT_OUTPUT_BYTES,
};
pub use spec::{SpecError, StepSpec, TaskSpec, MAX_FINAL_OUTPUT_BYTES};
