//! Metrics of a daemon: OpenTelemetry instruments (each crate creates its own
//! from the global meter) read two ways — exported over OTLP when an endpoint
//! is configured, and rendered in the Prometheus text format at `GET /metrics`
//! on the daemon's `--metrics-addr`.
//!
//! With neither configured no meter provider is installed: the instruments
//! are the no-op ones and recording costs nothing.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The Prometheus reader, shared between the meter provider and the endpoint.
#[derive(Clone, Debug)]
struct Shared(Arc<ManualReader>);

impl MetricReader for Shared {
    fn register_pipeline(&self, pipeline: Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

/// Keeps the meter provider alive; shuts it down (bounded) when dropped.
pub struct Metrics {
    provider: Option<SdkMeterProvider>,
}

impl Drop for Metrics {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown_with_timeout(Duration::from_secs(2));
        }
    }
}

/// Installs the global meter provider when `addr` is set or an OTLP endpoint
/// is configured, and serves `GET /metrics` on `addr`. Must run inside the
/// runtime (the endpoint is a task of it).
///
/// Metrics name tasks, workers and rates: an endpoint on anything but
/// loopback requires a bearer token, read from `TENURE_METRICS_TOKEN` (the
/// environment only: a secret never goes in a flag or a file), and refuses
/// to start without one.
pub async fn start(role: &str, addr: Option<SocketAddr>) -> anyhow::Result<Metrics> {
    let token = std::env::var("TENURE_METRICS_TOKEN").ok().filter(|t| !t.is_empty());
    if let Some(addr) = addr {
        if !addr.ip().is_loopback() && token.is_none() {
            anyhow::bail!(
                "invalid configuration: metrics on {addr}, off loopback, need a bearer token: set TENURE_METRICS_TOKEN"
            );
        }
    }
    let otlp = ["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
        && std::env::var("OTEL_METRICS_EXPORTER").as_deref() != Ok("none");
    if addr.is_none() && !otlp {
        return Ok(Metrics { provider: None });
    }
    let mut builder = SdkMeterProvider::builder().with_resource(crate::telemetry::resource(role));
    if otlp {
        let exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .build()
            .map_err(|e| anyhow::anyhow!("invalid configuration: OTLP metrics exporter: {e}"))?;
        builder = builder.with_periodic_exporter(exporter);
    }
    let reader = Shared(Arc::new(ManualReader::builder().build()));
    if let Some(addr) = addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("invalid configuration: cannot listen for metrics on {addr}"))?;
        tracing::info!(addr = %listener.local_addr().unwrap_or(addr), "metrics served at /metrics");
        builder = builder.with_reader(reader.clone());
        tokio::spawn(serve(listener, reader, token.map(Arc::<str>::from)));
    }
    let provider = builder.build();
    opentelemetry::global::set_meter_provider(provider.clone());
    Ok(Metrics { provider: Some(provider) })
}

/// Whether the request head carries `Authorization: Bearer <token>`
/// (compared in constant time).
fn authorized(head: &str, token: &str) -> bool {
    let given = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim().eq_ignore_ascii_case("authorization").then(|| value.trim())
    });
    let Some(given) = given.and_then(|v| v.strip_prefix("Bearer ")) else { return false };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn serve(listener: tokio::net::TcpListener, reader: Shared, token: Option<Arc<str>>) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else { continue };
        let (reader, token) = (reader.clone(), token.clone());
        tokio::spawn(async move {
            // One small request: the request line is all that matters.
            let mut buf = vec![0u8; 4096];
            let n = match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let head = String::from_utf8_lossy(&buf[..n]);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if token.as_deref().is_some_and(|t| !authorized(&head, t)) {
                ("401 Unauthorized", "a bearer token is required\n".to_owned())
            } else if head.starts_with("GET ") && (path == "/metrics" || path.starts_with("/metrics?")) {
                let mut rm = ResourceMetrics::default();
                match reader.collect(&mut rm) {
                    Ok(()) => ("200 OK", render(&rm)),
                    Err(e) => ("500 Internal Server Error", format!("collect failed: {e}\n")),
                }
            } else {
                ("404 Not Found", "only GET /metrics is served\n".to_owned())
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

/// A Prometheus metric name: `tenure.worker.output` (unit `By`) →
/// `tenure_worker_output_bytes`; seconds get `_seconds`, counters `_total`.
fn prom_name(name: &str, unit: &str, counter: bool) -> String {
    let mut n: String = name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    for (u, suffix) in [("s", "_seconds"), ("By", "_bytes")] {
        if unit == u && !n.ends_with(suffix) {
            n.push_str(suffix);
        }
    }
    if counter && !n.ends_with("_total") {
        n.push_str("_total");
    }
    n
}

fn labels<'a>(attrs: impl Iterator<Item = &'a KeyValue>, extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = attrs
        .map(|kv| {
            let key: String =
                kv.key.as_str().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
            let value = kv.value.to_string().replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            format!("{key}=\"{value}\"")
        })
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

/// The Prometheus text exposition of everything collected.
pub fn render(rm: &ResourceMetrics) -> String {
    let mut out = String::new();
    for scope in rm.scope_metrics() {
        for m in scope.metrics() {
            match m.data() {
                AggregatedMetrics::U64(d) => write_metric(&mut out, m.name(), m.description(), m.unit(), d),
                AggregatedMetrics::I64(d) => write_metric(&mut out, m.name(), m.description(), m.unit(), d),
                AggregatedMetrics::F64(d) => write_metric(&mut out, m.name(), m.description(), m.unit(), d),
            }
        }
    }
    out
}

fn write_metric<T: Copy + std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    unit: &str,
    data: &MetricData<T>,
) {
    match data {
        MetricData::Gauge(g) => {
            let n = prom_name(name, unit, false);
            let _ = writeln!(out, "# HELP {n} {help}\n# TYPE {n} gauge");
            for p in g.data_points() {
                let _ = writeln!(out, "{n}{} {}", labels(p.attributes(), None), p.value());
            }
        }
        MetricData::Sum(s) => {
            let n = prom_name(name, unit, s.is_monotonic());
            let kind = if s.is_monotonic() { "counter" } else { "gauge" };
            let _ = writeln!(out, "# HELP {n} {help}\n# TYPE {n} {kind}");
            for p in s.data_points() {
                let _ = writeln!(out, "{n}{} {}", labels(p.attributes(), None), p.value());
            }
        }
        MetricData::Histogram(h) => {
            let n = prom_name(name, unit, false);
            let _ = writeln!(out, "# HELP {n} {help}\n# TYPE {n} histogram");
            for p in h.data_points() {
                let mut cumulative = 0u64;
                let counts: Vec<u64> = p.bucket_counts().collect();
                for (i, bound) in p.bounds().enumerate() {
                    cumulative += counts.get(i).copied().unwrap_or(0);
                    let _ = writeln!(
                        out,
                        "{n}_bucket{} {cumulative}",
                        labels(p.attributes(), Some(("le", bound.to_string())))
                    );
                }
                let _ =
                    writeln!(out, "{n}_bucket{} {}", labels(p.attributes(), Some(("le", "+Inf".into()))), p.count());
                let _ = writeln!(out, "{n}_sum{} {}", labels(p.attributes(), None), p.sum());
                let _ = writeln!(out, "{n}_count{} {}", labels(p.attributes(), None), p.count());
            }
        }
        MetricData::ExponentialHistogram(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::metrics::MeterProvider as _;

    #[test]
    fn only_the_right_bearer_token_is_authorized() {
        let head = |auth: &str| format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n\r\n");
        assert!(authorized(&head("Authorization: Bearer s3cret"), "s3cret"));
        assert!(authorized(&head("authorization:   Bearer s3cret  "), "s3cret"));
        for bad in ["Authorization: Bearer s3cre", "Authorization: Bearer s3cret2", "Authorization: s3cret", ""] {
            assert!(!authorized(&head(bad), "s3cret"), "{bad}");
        }
    }

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let reader = Shared(Arc::new(ManualReader::builder().build()));
        let provider = SdkMeterProvider::builder().with_reader(reader.clone()).build();
        let meter = provider.meter("t");
        meter.u64_counter("tenure.worker.output.bytes").with_unit("By").build().add(5, &[KeyValue::new("a", "x")]);
        meter.u64_gauge("tenure.coordinator.tasks").build().record(3, &[KeyValue::new("status", "running")]);
        let h = meter.f64_histogram("tenure.sidecar.flush.duration").with_unit("s").build();
        h.record(0.002, &[]);
        h.record(0.5, &[]);
        let mut rm = ResourceMetrics::default();
        reader.collect(&mut rm).unwrap();
        let text = render(&rm);
        assert!(text.contains("# TYPE tenure_worker_output_bytes_total counter"), "{text}");
        assert!(text.contains("tenure_worker_output_bytes_total{a=\"x\"} 5"), "{text}");
        assert!(text.contains("tenure_coordinator_tasks{status=\"running\"} 3"), "{text}");
        assert!(text.contains("tenure_sidecar_flush_duration_seconds_count 2"), "{text}");
        assert!(text.contains("tenure_sidecar_flush_duration_seconds_bucket{le=\"+Inf\"} 2"), "{text}");
    }
}
