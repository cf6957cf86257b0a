//! Which boot of the machine this is: the kernel's boot id changes at every
//! boot (so after a power loss), and an attempt whose intent was recorded in
//! an earlier boot died with the machine if nothing recorded its end.
//!
//! Reads one `/proc` file; never writes anything.

use tenure_protocol::messages::AttemptRecord;

/// The machine's current boot. `TENURE_TEST_BOOT_ID` stands in for it in
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
pub fn booted_since(record: &AttemptRecord, now: Option<&str>) -> bool {
    matches!((record.boot.as_deref(), now), (Some(then), Some(now)) if then != now)
}
