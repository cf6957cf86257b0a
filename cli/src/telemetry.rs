//! Logs and traces of every tenure process: structured `tracing` logs on
//! stderr, and — only when an OTLP endpoint is configured — spans exported
//! over OTLP/HTTP with the W3C trace-context propagator installed, so that
//! [`tenure_transport::trace`] carries one task's trace across processes.
//!
//! Configured by the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (unset: no exporter, no propagator,
//! no cost), `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, the default, or
//! `http/json`), `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_SERVICE_NAME` (default
//! `tenure-<role>`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_EXPORTER=none`.
//!
//! Spans are exported from a background thread in batches with a bounded
//! queue: a slow or dead collector drops spans, it never slows a task. At exit
//! the last batch gets a short, bounded flush.

use std::time::Duration;

use anyhow::bail;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// How long the exit flush may take with an unreachable collector.
const EXIT_FLUSH: Duration = Duration::from_secs(2);

/// Keeps the exporter alive; flushes it (bounded) when dropped.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown_with_timeout(EXIT_FLUSH) {
                eprintln!("warning: traces not flushed at exit: {error}");
            }
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Installs logging (filtered by `RUST_LOG`, default `info` for daemons and
/// `warn` for client verbs) and, when configured, trace export for `role`.
pub fn init(role: &str, daemon: bool) -> anyhow::Result<Telemetry> {
    use std::io::IsTerminal;
    let default = if daemon { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .with_filter(filter);
    let provider = tracer_provider(role)?;
    let spans = provider.as_ref().map(|p| {
        opentelemetry::global::set_text_map_propagator(opentelemetry_sdk::propagation::TraceContextPropagator::new());
        // Spans are exported at `info` whatever the log filter says: a client
        // verb logs only warnings but its `submit` span starts the trace.
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("tenure"))
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
    Ok(Telemetry { provider })
}

/// What every exported span and metric says of its process: the `OTEL_*`
/// resource variables, and `service.name` `tenure-<role>` unless set.
pub fn resource(role: &str) -> Resource {
    let mut resource = Resource::builder();
    if env("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(format!("tenure-{role}"));
    }
    resource.build()
}

/// The OTLP trace pipeline, or `None` when no endpoint is configured.
fn tracer_provider(role: &str) -> anyhow::Result<Option<SdkTracerProvider>> {
    let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
    if endpoint.is_none() || env("OTEL_TRACES_EXPORTER").as_deref() == Some("none") {
        return Ok(None);
    }
    let protocol = match env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL")) {
        None => Protocol::HttpBinary,
        Some(p) if p == "http/protobuf" => Protocol::HttpBinary,
        Some(p) if p == "http/json" => Protocol::HttpJson,
        Some(other) => bail!(
            "invalid configuration: OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported; use http/protobuf or http/json"
        ),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .build()
        .map_err(|e| anyhow::anyhow!("invalid configuration: OTLP trace exporter: {e}"))?;
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource(role)).build();
    Ok(Some(provider))
}
