//! The worker's instruments (see `docs/operations.md`); no-ops unless the
//! process installed a meter provider.

use std::sync::OnceLock;

use opentelemetry::metrics::Counter;

pub(crate) struct Metrics {
    /// Attempts that ended here, by `outcome` (`completed`, `failed`,
    /// `killed`, `lost`).
    pub attempts: Counter<u64>,
    /// Output bytes written to tasks' output files.
    pub output_bytes: Counter<u64>,
    /// Output bytes dropped past the per-task cap.
    pub output_dropped: Counter<u64>,
    /// Grants refused, by `reason`.
    pub refusals: Counter<u64>,
}

pub(crate) fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let m = opentelemetry::global::meter("tenure-worker");
        Metrics {
            attempts: m.u64_counter("tenure.worker.attempts").with_description("Attempts ended, by outcome").build(),
            output_bytes: m
                .u64_counter("tenure.worker.output")
                .with_unit("By")
                .with_description("Output bytes kept")
                .build(),
            output_dropped: m
                .u64_counter("tenure.worker.output.dropped")
                .with_unit("By")
                .with_description("Output bytes dropped past the cap")
                .build(),
            refusals: m
                .u64_counter("tenure.worker.grant.refusals")
                .with_description("Grants refused, by reason")
                .build(),
        }
    })
}
