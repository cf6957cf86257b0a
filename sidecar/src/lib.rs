//! The sidecar: the worker machine's memory.
//!
//! One sidecar runs beside the worker on every worker machine and keeps, in a
//! local sled database, what the worker must not forget across its own crashes:
//! the highest coordinator epoch the machine has seen and one record per attempt
//! (accepted → intent → spawned → exited → acknowledged). The worker talks to it
//! over a unix socket (`tenure_machine::SidecarClient`); clients read task output from it over
//! NATS, and send input to running `agent` tasks through it.
//!
//! - **Every mutating request is synced before the sidecar replies** (its
//!   operation in the store's commit log), but `spawned` and `acknowledged`,
//!   which become durable with the next flush (durability notes a9, a7). An
//!   `Ok` means durable, power loss included; a storage failure is a refusal
//!   that changed nothing. Requests that arrive together share one flush
//!   (group commit).
//! - **It refuses lower epochs.** The highest epoch seen is persisted, and any
//!   request carrying a lower one is refused with `StaleEpoch`.
//! - **It never starts or kills processes.** It records what the worker did and
//!   decides only what may be recorded; the worker acts.
//! - **An attempt whose intent is recorded is never given back**, because it may
//!   have run.
//! - **It answers only its worker.** The socket refuses every peer but the
//!   process holding the worker's lock: a task cannot reach it.
//!
//! Code map: [`store`] (the durable records behind the [`RecoveryStore`]
//! trait), [`commit_log`] (what makes a write durable between two flushes of
//! sled), [`core`] (the pure decision logic, [`Machine`]), `store_thread`
//! (the one thread that owns the machine, with group commit), [`daemon`]
//! (socket and NATS IO around it), [`input`] (delivering `tenure send` input
//! into agent tasks' FIFOs). The machine's files, the socket's framing and
//! client, the worker's lock and the evidence verdict are `tenure-machine`'s,
//! shared with the worker.

pub mod commit_log;
pub mod core;
pub mod daemon;
pub mod input;
mod metrics;
pub mod store;
mod store_thread;

pub use core::Machine;
pub use daemon::{run, Options};
pub use store::{CorruptRecord, FailingStore, Loaded, MemoryStore, RecoveryStore, SledStore};
