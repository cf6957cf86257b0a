//! The cli tests' cluster: the one harness, `tenure_testkit::cluster`, with
//! `BIN` as cargo built it for these tests.

#![allow(dead_code, unused_imports)]

pub use tenure_testkit::cluster::*;

/// The `tenure` binary under test (the harness finds the same one).
pub const BIN: &str = env!("CARGO_BIN_EXE_tenure");
