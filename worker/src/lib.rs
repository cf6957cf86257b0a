//! The worker: runs the attempts it is granted, one process group each, with
//! every step recorded by the machine's sidecar before the next one happens.
//!
//! **Invariant:** no process is spawned before the sidecar has flushed the
//! attempt's intent; no completion is reported before it is buffered in the
//! sidecar. The worker decides nothing about a task's lifecycle: it reports
//! facts and the leader's lifecycle table decides.

mod attempt;
pub mod builtin;
mod capture;
pub mod cgroup;
pub mod cgroup_fs;
pub mod core;
mod daemon;
pub mod launcher;
mod limits;
mod metrics;
mod options;
pub mod process;
mod recovery;
pub mod reports;
pub mod sandbox;
pub mod scratch;
pub mod shim;
mod waiting;

pub use daemon::run;
pub use options::{Error, Options};
