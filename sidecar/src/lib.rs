//! The sidecar: the worker machine's memory.
//!
//! One sidecar runs beside the worker on every worker machine and keeps, in a
//! local sled database, what the worker must not forget across its own crashes:
//! the highest coordinator epoch the machine has seen and one record per attempt
//! (accepted → intent → spawned → exited → acknowledged). The worker talks to it
//! over a unix socket ([`SidecarClient`]); clients read task output from it over
//! NATS, and send input to running `agent` tasks through it.
//!
//! - **Every mutating request is flushed to disk and synced before the sidecar
//!   replies.** An `Ok` means durable, power loss included; a storage failure is a refusal that changed nothing.
//!   Requests that arrive together share one flush (group commit).
//! - **It refuses lower epochs.** The highest epoch seen is persisted, and any
//!   request carrying a lower one is refused with `StaleEpoch`.
//! - **It never starts or kills processes.** It records what the worker did and
//!   decides only what may be recorded; the worker acts.
//! - **An attempt whose intent is recorded is never given back**, because it may
//!   have run.
//! - **It answers only its worker.** The socket refuses every peer but the
//!   process holding the worker's lock: a task cannot reach it.
//!
//! Code map: [`layout`] (paths and symlink-safe output files), [`store`] (the
//! durable records behind the [`RecoveryStore`] trait), [`service`] (the pure
//! decision logic, [`Machine`]), [`server`] (socket and NATS IO around it),
//! [`input`] (delivering `tenure send` input into agent tasks' FIFOs),
//! [`client`] (what the worker uses), [`worker_lock`] (the worker's lock on
//! the data directory, which names the one process the socket answers).

pub mod attempt_files;
pub mod client;
pub mod input;
pub mod layout;
mod metrics;
pub mod server;
pub mod service;
pub mod store;
pub mod worker_lock;

pub use client::{Error as ClientError, SidecarClient, DEFAULT_CALL_TIMEOUT};

/// The machine's current boot: the kernel's boot id, which changes at every
/// boot (so after a power loss). `TENURE_TEST_BOOT_ID` stands in for it in
/// tests that simulate a power loss without rebooting; `None` when neither
/// can be read.
pub fn boot_id() -> Option<String> {
    if let Some(id) = std::env::var("TENURE_TEST_BOOT_ID").ok().filter(|v| !v.is_empty()) {
        return Some(id);
    }
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|id| !id.is_empty())
}

/// Whether the machine booted since `record`'s intent: both boots known, and
/// different (an unknown boot claims nothing).
pub fn booted_since(record: &tenure_protocol::messages::AttemptRecord, now: Option<&str>) -> bool {
    matches!((record.boot.as_deref(), now), (Some(then), Some(now)) if then != now)
}
pub use layout::{open_output_for_append, open_output_for_read, Layout};
pub use server::{run, Options};
pub use service::Machine;
pub use store::{CorruptRecord, FailingStore, Loaded, MemoryStore, RecoveryStore, SledStore};

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
