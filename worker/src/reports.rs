//! The worker's reports to the leader, gathered ([`tenure_machine::gather`]):
//! reports made while others are in flight leave together as one
//! [`Reports`] request on the worker's report subject, answered by one
//! [`ReportAck`] each. A report made while none is in flight goes at once
//! and alone, as a plain [`Report`].
//!
//! A traced report goes alone, with its trace context in the headers. A
//! batch that no leader answered is sent again one by one, once: a leader
//! too old to read a batch does not answer it, and one that cannot hear
//! anybody answers neither. Nothing here retries beyond that; the attempt's
//! driver re-sends until a leader settles the report.

use std::time::Duration;

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

/// Sends `report` (alone or with others) and waits for the leader's answer;
/// `None` when none came.
pub(crate) async fn send(reporter: &Reporter, report: Report) -> Option<ReportAck> {
    let frame = Bytes::from(tenure_protocol::encode(&report).ok()?);
    let trace = tenure_transport::trace::current_headers();
    reporter.call(Outgoing { report, frame, trace }, REPORT_TIMEOUT * 2).await.flatten()
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
        let (reports, frames): (Vec<_>, Vec<_>) = items.into_iter().map(|o| (o.report, o.frame)).unzip();
        let batch = Reports { worker: self.worker.clone(), reports };
        let Ok(payload) = tenure_protocol::encode(&batch) else { return Sent::Answered(vec![None; count]) };
        let answer = tenure_transport::request_encoded::<Vec<ReportAck>>(
            &self.client,
            self.subject.clone(),
            payload.into(),
            None,
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
