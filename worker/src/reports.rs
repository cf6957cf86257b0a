//! The worker's reports to the leader, gathered ([`tenure_machine::gather`]):
//! reports made while others are in flight leave together as one
//! [`Reports`] request on the worker's report subject, answered by one
//! [`ReportAck`] each. A report made while none is in flight goes at once
//! and alone, as a plain [`Report`].
//!
//! A `Started` report is paced ([`StartedPace`]): on a worker that starts
//! attempts less often than every [`STARTED_HOLD`] it leaves at once; on a
//! busier one it is held that long first, and an attempt that ends within
//! the hold has its `Started` sent with its end report instead, in one
//! message: the leader judges the two in order as one input and stores the
//! task's record once (note a2 of the durability doc). A short task then
//! costs the leader one report message and one registry append instead of
//! two of each, and it is still seen to start.
//!
//! A traced report goes alone, with its trace context in the headers, or
//! with its task's held `Started` in a batch that carries them. A
//! batch that no leader answered is sent again one by one, once: a leader
//! too old to read a batch does not answer it, and one that cannot hear
//! anybody answers neither. Nothing here retries beyond that; the attempt's
//! driver re-sends until a leader settles the report.

use std::time::{Duration, Instant};

use bytes::Bytes;
use tenure_machine::gather::{Exchange, Gather, Sent};
use tenure_protocol::messages::{Report, ReportAck, Reports, MAX_REPORTS};
use tenure_protocol::{subjects, WorkerId, MAX_MESSAGE_BYTES};

/// How long one exchange with the leader may take.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// The leader, as the worker's reports reach it.
pub(crate) struct Leader {
    client: async_nats::Client,
    worker: WorkerId,
    subject: String,
}

/// How long a `Started` report waits for its attempt's end on a busy worker,
/// unless configured otherwise (`started_hold_ms`).
/// A `sh -c true` under load ends within it most of the time (measured on a
/// 2-core machine at 16 in flight: half within 7 ms, nine in ten within
/// 23 ms); a person or a `wait --started` never notices it.
pub(crate) const STARTED_HOLD: Duration = Duration::from_millis(20);

/// Most a `Started` report may be held (`started_hold_ms`).
pub const MAX_STARTED_HOLD: Duration = Duration::from_secs(10);

/// When each `Started` report leaves: held `hold` when another was made less
/// than that before it (the worker is starting attempts faster than it could
/// tell one from the next), at once otherwise.
#[derive(Debug)]
pub(crate) struct StartedPace {
    hold: Duration,
    last: Option<Instant>,
}

impl StartedPace {
    pub(crate) fn new(hold: Duration) -> StartedPace {
        StartedPace { hold, last: None }
    }

    /// The hold of a `Started` report made at `now`.
    pub(crate) fn hold(&mut self, now: Instant) -> Duration {
        let busy = self.last.is_some_and(|last| now.saturating_duration_since(last) < self.hold);
        self.last = Some(self.last.map_or(now, |last| last.max(now)));
        if busy {
            self.hold
        } else {
            Duration::ZERO
        }
    }
}

/// One report on its way: encoded (sent as it is when it goes alone), and
/// the caller's trace context when it is traced.
pub(crate) struct Outgoing {
    report: Report,
    frame: Bytes,
    trace: Option<async_nats::HeaderMap>,
}

pub(crate) type Reporter = Gather<Leader>;

pub(crate) fn reporter(client: async_nats::Client, worker: WorkerId) -> Reporter {
    let subject = subjects::report(&worker);
    Gather::new(Leader { client, worker, subject })
}

/// Sends `reports` together, in their order (alone or with others), and
/// waits for the leader's answers: the last one's, `None` when none came.
pub(crate) async fn send(reporter: &Reporter, reports: Vec<Report>) -> Option<ReportAck> {
    let trace = tenure_transport::trace::current_headers();
    let outgoing = reports
        .into_iter()
        .map(|report| {
            let frame = Bytes::from(tenure_protocol::encode(&report).ok()?);
            Some(Outgoing { report, frame, trace: trace.clone() })
        })
        .collect::<Option<Vec<_>>>()?;
    reporter.call_together(outgoing, REPORT_TIMEOUT * 2).await.pop().flatten().flatten()
}

impl Exchange for Leader {
    type Item = Outgoing;
    type Answer = Option<ReportAck>;
    const MAX_ITEMS: usize = MAX_REPORTS;
    /// Well within a message, whatever the batch's own encoding adds.
    const MAX_BYTES: usize = MAX_MESSAGE_BYTES / 2;

    fn batches(&self, item: &Outgoing) -> bool {
        item.trace.is_none()
    }

    fn size(&self, item: &Outgoing) -> usize {
        item.frame.len()
    }

    async fn send(&self, mut items: Vec<Outgoing>) -> Sent<Outgoing, Option<ReportAck>> {
        let count = items.len();
        if count == 1 {
            let Some(one) = items.pop() else { return Sent::Answered(Vec::new()) };
            let ack = tenure_transport::request_encoded(
                &self.client,
                self.subject.clone(),
                one.frame,
                one.trace,
                REPORT_TIMEOUT,
            )
            .await
            .ok();
            return Sent::Answered(vec![ack]);
        }
        // A batch holds traced reports only when they are one caller's, sent
        // together on an idle exchange (a start told with its end): the
        // batch carries their trace. Gathered batches hold none.
        let trace = items.first().and_then(|o| o.trace.clone());
        let (reports, frames): (Vec<_>, Vec<_>) = items.into_iter().map(|o| (o.report, o.frame)).unzip();
        let batch = Reports { worker: self.worker.clone(), reports };
        let Ok(payload) = tenure_protocol::encode(&batch) else { return Sent::Answered(vec![None; count]) };
        let answer = tenure_transport::request_encoded::<Vec<ReportAck>>(
            &self.client,
            self.subject.clone(),
            payload.into(),
            trace,
            REPORT_TIMEOUT,
        )
        .await;
        match answer {
            Ok(acks) if acks.len() == count => Sent::Answered(acks.into_iter().map(Some).collect()),
            // Not one answer per report: none is believed, all are sent again later.
            Ok(_) => Sent::Answered(vec![None; count]),
            Err(error) => {
                tracing::debug!(%error, count, "a batch of reports went unanswered; sending them one by one");
                let again = batch.reports.into_iter().zip(frames);
                Sent::Unread(again.map(|(report, frame)| Outgoing { report, frame, trace: None }).collect())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_report_is_held_only_when_another_came_within_the_hold() {
        let t0 = Instant::now();
        let mut pace = StartedPace::new(STARTED_HOLD);
        // The first one, and one after a quiet spell, leave at once.
        assert_eq!(pace.hold(t0), Duration::ZERO);
        assert_eq!(pace.hold(t0 + STARTED_HOLD), Duration::ZERO);
        // Starts closer together than the hold are held, each measured from
        // the one before it.
        let busy = t0 + STARTED_HOLD + Duration::from_millis(5);
        assert_eq!(pace.hold(busy), STARTED_HOLD);
        assert_eq!(pace.hold(busy + STARTED_HOLD - Duration::from_millis(1)), STARTED_HOLD);
        // Times that arrive out of order (two drivers racing for the lock)
        // never move the last start back.
        assert_eq!(pace.hold(busy), STARTED_HOLD);
        assert_eq!(pace.hold(busy + STARTED_HOLD * 2), Duration::ZERO);
        // A hold of zero reports every start at once.
        let mut pace = StartedPace::new(Duration::ZERO);
        assert_eq!((pace.hold(t0), pace.hold(t0)), (Duration::ZERO, Duration::ZERO));
    }
}
