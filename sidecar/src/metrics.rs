//! The sidecar's instruments (see `docs/operations.md`); no-ops unless the
//! process installed a meter provider.

use std::sync::OnceLock;

use opentelemetry::metrics::{Counter, Histogram};

pub(crate) struct Metrics {
    /// sled flushes, each before an acknowledgement (`s`).
    pub flush: Histogram<f64>,
    /// Requests from the worker, by `request`.
    pub requests: Counter<u64>,
}

pub(crate) fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = opentelemetry::global::meter("tenure-sidecar");
        Metrics {
            flush: m
                .f64_histogram("tenure.sidecar.flush.duration")
                .with_unit("s")
                .with_description("sled flushes before an acknowledgement")
                .with_boundaries(vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5])
                .build(),
            requests: m.u64_counter("tenure.sidecar.requests").with_description("Worker requests by kind").build(),
        }
    })
}
