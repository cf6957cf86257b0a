//! W3C trace context across process boundaries, so that one task is one trace
//! from `tenure submit` to its finalize on the leader.
//!
//! Context travels in NATS message headers (`traceparent`, `tracestate`), in
//! the registry record of a task (its submit's `traceparent`, so a leader
//! that grants the task later — or after a failover — continues the same
//! trace), and in the worker's intent request to its sidecar.
//!
//! With no exporter configured the global propagator is the no-op one: no
//! header is written, nothing is parsed, and every function here is a few
//! pointer reads. Nothing here ever fails a message: a missing or malformed
//! context only starts a new trace.

use std::collections::HashMap;

use async_nats::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// NATS headers carrying the current span's context; `None` when there is
/// nothing to carry (tracing off, or no span).
pub fn current_headers() -> Option<HeaderMap> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut headers = HeaderMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut HeaderInjector(&mut headers)));
    headers.iter().next().is_some().then_some(headers)
}

/// The context a message's headers carry (empty when they carry none).
pub fn from_headers(headers: Option<&HeaderMap>) -> Context {
    match headers {
        Some(h) => opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(h))),
        None => Context::new(),
    }
}

/// The current span's `traceparent`, to store or to send outside NATS.
pub fn current_traceparent() -> Option<String> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove("traceparent")
}

/// The context a stored `traceparent` names (empty for `None` or garbage).
pub fn from_traceparent(traceparent: Option<&str>) -> Context {
    let Some(tp) = traceparent else { return Context::new() };
    let carrier: HashMap<String, String> = [("traceparent".to_owned(), tp.to_owned())].into();
    opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier))
}

/// Whether `cx` names a span of another process (a context was carried).
pub fn is_remote(cx: &Context) -> bool {
    cx.span().span_context().is_valid()
}

/// Makes `cx` the parent of `span` when it names a remote span; otherwise the
/// span keeps its local parent.
pub fn continue_from(span: &tracing::Span, cx: Context) {
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}
