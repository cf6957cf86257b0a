//! The coordinator: owns task identity, lifecycle state, scheduling, leases and
//! heartbeats for the cluster, and the leader lease among coordinators.
//!
//! Layers: [`core`] decides about tasks and [`lease`] about leadership (both
//! pure, deterministic, driven by a fake clock in tests), [`registry`] stores
//! (JetStream, conditional appends), [`elector`] drives the lease (JetStream KV,
//! compare-and-set), and [`service`] drives the rest: a standby until the lease
//! is held, then the event loop that owns the NATS subscriptions, feeds the core
//! and carries out its effects. [`limits`] decides what a submit may cost
//! (record size, per-identity quotas, room in the registry); [`mark`] whether
//! a loaded registry is behind the high-water mark kept outside it.

pub mod core;
pub mod daemon;
pub mod elector;
pub mod lease;
pub mod limits;
pub mod mark;
mod metrics;
pub mod notices;
pub mod record;
pub mod registry;
mod tasks;

pub use daemon::{run, Error, Options};
pub use lease::LeaseConfig;
pub use limits::Limits;
