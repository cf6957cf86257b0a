//! The coordinator: owns task identity, lifecycle state, scheduling, task
//! leases and heartbeats for the cluster, and the leadership among
//! coordinators (held like a lease, which logs and flags call the leader lease).
//!
//! Layers: [`core`] decides about tasks and [`leadership`] about leadership (both
//! pure, deterministic, driven by a fake clock in tests), [`registry`] stores
//! (JetStream, conditional appends), [`elector`] drives the leadership (JetStream KV,
//! compare-and-set), and [`daemon`] drives the rest: a standby until the leadership
//! is held, then the event loop that owns the NATS subscriptions, feeds the core
//! and carries out its effects. [`limits`] decides what a submit may cost
//! (record size, per-identity quotas, room in the registry); [`mark`] whether
//! a loaded registry is behind the high-water mark kept outside it.

pub mod core;
pub mod daemon;
pub mod elector;
pub mod leadership;
pub mod limits;
pub mod mark;
mod metrics;
pub mod notices;
pub mod record;
pub mod registry;
mod tasks;

pub use core::{ApprovalPolicy, Approver};
pub use daemon::{run, Error, Options};
pub use leadership::LeadershipConfig;
pub use limits::Limits;
