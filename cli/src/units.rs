//! Sizes and CPU amounts as people write them on the command line
//! (`--memory 64M`, `--cpus 0.5`) and as `tenure get` shows them back. Pure
//! parsing and formatting; the bounds are the spec's, checked at submit.

use tenure_protocol::resources::ResourceLimits;

/// A size in bytes: a number (a fraction allowed) and an optional binary
/// unit `K`, `M`, `G` or `T` (`KiB`, `MB`… read the same), case ignored.
/// `64M`, `1.5G`, `512k`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a size (e.g. 64M, 1.5G, 512K)");
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.strip_suffix("ib").or_else(|| unit.strip_suffix('b')).unwrap_or(&unit);
    let scale: u64 = match unit {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => return Err(bad()),
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(bad());
    }
    let whole: u64 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| bad())? };
    let mut bytes = whole.checked_mul(scale).ok_or_else(|| format!("{s:?} is too large"))?;
    if !fraction.is_empty() {
        let digits: u32 = u32::try_from(fraction.len()).map_err(|_| bad())?;
        let denominator = 10u128.checked_pow(digits).ok_or_else(bad)?;
        let numerator: u128 = fraction.parse().map_err(|_| bad())?;
        let part = u64::try_from(numerator * u128::from(scale) / denominator).map_err(|_| bad())?;
        bytes = bytes.checked_add(part).ok_or_else(|| format!("{s:?} is too large"))?;
    }
    Ok(bytes)
}

/// CPUs (`0.5`, `2`, `1.25`) as thousandths of a CPU; more than three
/// decimals are refused rather than rounded away.
pub fn parse_cpus(s: &str) -> Result<u32, String> {
    let bad = || format!("{s:?} is not a number of CPUs (e.g. 0.5, 2)");
    let t = s.trim();
    let (whole, fraction) = t.split_once('.').unwrap_or((t, ""));
    let digits_only = |p: &str| p.bytes().all(|b| b.is_ascii_digit());
    if (whole.is_empty() && fraction.is_empty()) || !digits_only(whole) || !digits_only(fraction) {
        return Err(bad());
    }
    if fraction.len() > 3 {
        return Err(format!("{s:?}: at most three decimals (thousandths of a CPU)"));
    }
    let whole: u32 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| bad())? };
    let fraction: u32 = format!("{fraction:0<3}").parse().map_err(|_| bad())?;
    let millis = whole.checked_mul(1000).and_then(|m| m.checked_add(fraction)).ok_or_else(bad)?;
    match millis {
        0 => Err("--cpus must be above zero".into()),
        m => Ok(m),
    }
}

/// `memory 64M, cpus 0.5, pids 100`.
pub fn resources(r: &ResourceLimits) -> String {
    let mut parts = Vec::new();
    if let Some(bytes) = r.memory_bytes {
        parts.push(format!("memory {}", size(bytes)));
    }
    if let Some(millis) = r.cpu_millis {
        let cpus = format!("{}.{:03}", millis / 1000, millis % 1000);
        parts.push(format!("cpus {}", cpus.trim_end_matches('0').trim_end_matches('.')));
    }
    if let Some(pids) = r.pids {
        parts.push(format!("pids {pids}"));
    }
    parts.join(", ")
}

/// A size in the largest binary unit that writes it whole (`64M`,
/// `1536K`), or in bytes.
fn size(bytes: u64) -> String {
    for (unit, scale) in [("T", 1u64 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)] {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{}{unit}", bytes / scale);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_as_people_write_them() {
        let cases = [
            ("64M", 64 << 20),
            ("64m", 64 << 20),
            ("64MiB", 64 << 20),
            ("64MB", 64 << 20),
            ("1G", 1 << 30),
            ("1.5G", 3 << 29),
            ("512K", 512 << 10),
            ("1048576", 1 << 20),
            (".5M", 1 << 19),
            ("2T", 2 << 40),
        ];
        for (text, bytes) in cases {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in ["", "M", "64X", "-1M", "1.2.3M", "64 MM", "99999999999999999999T", "1e6"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn cpus_are_read_in_thousandths() {
        for (text, millis) in [("0.5", 500), ("2", 2000), ("1.25", 1250), (".1", 100), ("0.001", 1)] {
            assert_eq!(parse_cpus(text), Ok(millis), "{text}");
        }
        for bad in ["0", "0.0", "", ".", "-1", "0.0001", "abc", "1,5", "99999999"] {
            assert!(parse_cpus(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn limits_are_shown_back_as_written() {
        let r = ResourceLimits { memory_bytes: Some(64 << 20), cpu_millis: Some(500), pids: Some(100) };
        assert_eq!(resources(&r), "memory 64M, cpus 0.5, pids 100");
        let r = ResourceLimits { memory_bytes: Some(1536 << 10), cpu_millis: Some(2000), pids: None };
        assert_eq!(resources(&r), "memory 1536K, cpus 2");
        assert_eq!(size(1000), "1000");
    }
}
