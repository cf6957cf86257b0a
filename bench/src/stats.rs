//! Percentiles over samples of durations, in milliseconds.

use std::time::Duration;

use serde_json::json;

#[derive(Debug, Clone, Default)]
pub struct Samples {
    ms: Vec<f64>,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.ms.push(d.as_secs_f64() * 1000.0);
    }

    pub fn len(&self) -> usize {
        self.ms.len()
    }

    /// The `q` quantile (0..=1), nearest rank; 0 when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.ms.is_empty() {
            return 0.0;
        }
        let mut v = self.ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }

    pub fn summary(&self) -> serde_json::Value {
        json!({
            "n": self.len(),
            "p50_ms": self.quantile(0.5),
            "p99_ms": self.quantile(0.99),
            "p999_ms": self.quantile(0.999),
            "max_ms": self.quantile(1.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut s = Samples::default();
        assert_eq!(s.quantile(0.5), 0.0);
        for ms in 1..=100 {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.quantile(0.5), 50.0);
        assert_eq!(s.quantile(0.99), 99.0);
        assert_eq!(s.quantile(0.999), 100.0);
        assert_eq!(s.quantile(1.0), 100.0);
    }
}
