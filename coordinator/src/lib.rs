//! The coordinator: owns task identity, lifecycle state, scheduling, leases and
//! heartbeats for the cluster.
//!
//! Layers: [`core`] decides (pure, deterministic), [`registry`] stores (JetStream,
//! conditional appends), [`service`] drives (the event loop that owns the NATS
//! subscriptions, feeds the core and carries out its effects).

pub mod core;
pub mod record;
pub mod registry;
pub mod service;

pub use service::{run, Error, Options};
