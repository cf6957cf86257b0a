//! The coordinator's instruments (names, units and labels are listed in
//! `docs/operations.md`). They come from the global meter: no-ops unless the
//! process installed a meter provider (`--metrics-addr` or an OTLP endpoint).

use std::sync::OnceLock;

use opentelemetry::metrics::{Counter, Gauge, Histogram};

pub(crate) struct Metrics {
    /// Tasks in the registry by `status` (recorded every second).
    pub tasks: Gauge<u64>,
    /// Submit → running, per task (`s`).
    pub dispatch: Histogram<f64>,
    /// Registry appends, from sent to acknowledged (`s`; pipelined, so they overlap).
    pub append: Histogram<f64>,
    /// Leadership writes by `result` (`renewed`, `conflict`, `failed`).
    pub leadership_writes: Counter<u64>,
    /// Terms this process started leading.
    pub takeovers: Counter<u64>,
    /// Seconds since each `worker`'s last heartbeat (recorded every second).
    pub heartbeat_age: Gauge<f64>,
    /// Client API requests by `verb`.
    pub api_requests: Counter<u64>,
}

pub(crate) fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = opentelemetry::global::meter("tenure-coordinator");
        Metrics {
            tasks: m.u64_gauge("tenure.coordinator.tasks").with_description("Tasks by status").build(),
            dispatch: m
                .f64_histogram("tenure.coordinator.dispatch.duration")
                .with_unit("s")
                .with_description("Submit to running, per task")
                .with_boundaries(vec![0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0])
                .build(),
            append: m
                .f64_histogram("tenure.coordinator.registry.append.duration")
                .with_unit("s")
                .with_description("Registry appends, acknowledged by JetStream")
                .with_boundaries(vec![0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0])
                .build(),
            leadership_writes: m
                .u64_counter("tenure.coordinator.lease.writes")
                .with_description("Leader lease writes by result")
                .build(),
            takeovers: m
                .u64_counter("tenure.coordinator.takeovers")
                .with_description("Terms this coordinator started leading")
                .build(),
            heartbeat_age: m
                .f64_gauge("tenure.coordinator.worker.heartbeat.age")
                .with_unit("s")
                .with_description("Time since each worker's last heartbeat")
                .build(),
            api_requests: m
                .u64_counter("tenure.coordinator.api.requests")
                .with_description("Client API requests by verb")
                .build(),
        }
    })
}
