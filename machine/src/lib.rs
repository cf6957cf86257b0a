//! The worker machine's files and local protocol, shared by the worker and
//! the sidecar (worker → machine ← sidecar): what is on the machine's disk
//! and how the two daemons on it speak, without either daemon's logic.
//!
//! Code map: [`layout`] (the data directory's paths and symlink-safe output
//! files), [`attempt_files`] (one attempt's journal, input FIFO and matched
//! lines), [`process`] (a process's identity: pid plus start time),
//! [`worker_lock`] (the worker's lock on the data directory, which names the
//! one process the sidecar answers), [`client`] (the worker's side of the
//! sidecar's socket, and [`frame_codec`], its framing), [`boot`] (which boot
//! of the machine this is) and [`evidence`] (the one verdict of what the
//! machine's records and files say about an attempt).
//!
//! **Invariant:** nothing here decides an attempt's lifecycle or talks to
//! NATS; [`evidence`] is pure and every other module only reads and writes
//! this machine's files and socket.

pub mod attempt_files;
pub mod boot;
pub mod client;
pub mod evidence;
pub mod gather;
pub mod layout;
pub mod process;
pub mod worker_lock;

pub use client::{Error as ClientError, SidecarClient, DEFAULT_CALL_TIMEOUT};
pub use layout::{open_output_for_append, open_output_for_read, Layout};

use tokio_util::codec::LengthDelimitedCodec;

/// The framing of the worker ↔ sidecar socket: a 4-byte big-endian length, then
/// one message encoded with [`tenure_protocol::encode`]. Frames longer than
/// [`tenure_protocol::MAX_MESSAGE_BYTES`] are refused by both ends.
pub fn frame_codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder()
        .length_field_length(4)
        .big_endian()
        .max_frame_length(tenure_protocol::MAX_MESSAGE_BYTES)
        .new_codec()
}
