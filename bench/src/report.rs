//! What a benchmark produces: one [`Figure`] per measured quantity, printed as a
//! human line and appended to the JSON Lines file as a record with the raw
//! numbers, the baseline measured in the same run, their ratio and the target.
//!
//! A missed target is reported, never an error: only a failed run is.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

/// Which way a figure is better.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Better {
    Higher,
    Lower,
}

/// One measured quantity next to its baseline.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub bench: String,
    pub case: String,
    pub unit: String,
    pub value: f64,
    /// What the baseline measured, in `unit` (absent when the target is absolute).
    pub baseline: Option<f64>,
    pub baseline_what: String,
    /// `value / baseline`.
    pub ratio: Option<f64>,
    pub better: Better,
    /// The target in words (`ratio >= 0.30`, `value <= 3000 ms`, …).
    pub target: String,
    /// Whether the target was met; absent when the figure has no target.
    pub target_met: Option<bool>,
    /// Raw numbers: sample counts, percentiles, sizes, settings.
    pub details: Value,
}

impl Figure {
    pub fn new(bench: &str, case: impl Into<String>, unit: &str, value: f64, better: Better) -> Figure {
        Figure {
            bench: bench.into(),
            case: case.into(),
            unit: unit.into(),
            value,
            baseline: None,
            baseline_what: String::new(),
            ratio: None,
            better,
            target: String::new(),
            target_met: None,
            details: Value::Null,
        }
    }

    /// Sets the baseline and the ratio.
    pub fn baseline(mut self, what: impl Into<String>, baseline: f64) -> Figure {
        self.baseline_what = what.into();
        self.baseline = Some(baseline);
        self.ratio = (baseline > 0.0).then(|| self.value / baseline);
        self
    }

    /// A target on the ratio: at least (`Higher`) or at most (`Lower`) `bound`.
    pub fn ratio_target(mut self, bound: f64) -> Figure {
        let (sign, met) = match self.better {
            Better::Higher => (">=", self.ratio.map(|r| r >= bound)),
            Better::Lower => ("<=", self.ratio.map(|r| r <= bound)),
        };
        self.target = format!("ratio {sign} {bound}");
        self.target_met = met;
        self
    }

    /// A target on the value itself, in `unit`.
    pub fn value_target(mut self, bound: f64) -> Figure {
        let (sign, met) = match self.better {
            Better::Higher => (">=", self.value >= bound),
            Better::Lower => ("<=", self.value <= bound),
        };
        self.target = format!("{sign} {} {}", fmt_num(bound), self.unit);
        self.target_met = Some(met);
        self
    }

    pub fn details(mut self, details: Value) -> Figure {
        self.details = details;
        self
    }

    /// The human line.
    pub fn line(&self) -> String {
        let mut s = format!("{:<16} {:<34} {:>12} {:<8}", self.bench, self.case, fmt_num(self.value), self.unit);
        if let Some(b) = self.baseline {
            s.push_str(&format!(" baseline {:>10} ({})", fmt_num(b), self.baseline_what));
        }
        if let Some(r) = self.ratio {
            s.push_str(&format!(" ratio {r:.2}"));
        }
        if !self.target.is_empty() {
            let verdict = match self.target_met {
                Some(true) => "met",
                Some(false) => "MISSED",
                None => "n/a",
            };
            s.push_str(&format!("  target {} [{verdict}]", self.target));
        }
        s
    }
}

/// Numbers for humans: no more precision than they carry.
pub fn fmt_num(v: f64) -> String {
    if v.abs() >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Where the records go: the JSON Lines file, if any.
pub struct Sink {
    path: Option<PathBuf>,
    pub figures: Vec<Figure>,
    mode: &'static str,
}

impl Sink {
    pub fn new(path: Option<&Path>, mode: &'static str) -> Sink {
        Sink { path: path.map(Path::to_path_buf), figures: Vec::new(), mode }
    }

    /// Records a figure: appended to the file at once, so an interrupted run
    /// keeps what it measured.
    pub fn record(&mut self, figure: Figure) -> anyhow::Result<String> {
        let line = figure.line();
        if let Some(path) = &self.path {
            let mut value = serde_json::to_value(&figure)?;
            if let Value::Object(map) = &mut value {
                map.insert("mode".into(), Value::from(self.mode));
                map.insert("unix_ms".into(), Value::from(crate::unix_ms()));
            }
            let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
            writeln!(file, "{}", serde_json::to_string(&value)?)?;
        }
        self.figures.push(figure);
        Ok(line)
    }
}
