//! The in-memory bus: every message between simulated nodes, delivered after a
//! random delay, sometimes very late, sometimes never, and never across a
//! partition. Messages on different subjects (or from different senders)
//! arrive in any order; one sender's messages on one subject keep their order,
//! as NATS keeps them for a subscription (a schedule may turn that off too).
//! It owns request bookkeeping as well: a request's
//! reply reaches its requester only while it still waits, and a timeout is a
//! message of its own, queued when the request is sent — so a lost request or
//! a lost reply looks to the requester exactly like NATS's timeout error.
//!
//! Every random choice comes from the schedule's rng, in the order the
//! simulation makes its calls, so a seed replays the same deliveries.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::Rng;
use tenure_protocol::messages::{
    ApiReply, ApiRequest, EvidenceReply, EvidenceRequest, Heartbeat, Report, ReportAck, WorkerCommand, WorkerReply,
};
use tenure_protocol::Epoch;

/// A simulated process's address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Node {
    Coord(usize),
    Machine(usize),
    Client,
}

/// Where a message goes. Subjects the coordinators subscribe to are resolved
/// at delivery time: whoever leads (or believes it leads) then gets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dest {
    Node(Node),
    /// Requests only the leader answers (API, reports).
    Leader,
    /// Publications every acting coordinator hears (heartbeats).
    Coordinators,
}

pub type ReqId = u64;

/// A message in flight. Not boxed: the simulation holds a few hundred at
/// most, and its grants (a whole spec) are most of them.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Msg {
    Command {
        req: ReqId,
        command: WorkerCommand,
        /// The worker process it is addressed to (its own subject): another
        /// process of the same id never receives it.
        instance: uuid::Uuid,
    },
    AskEvidence {
        req: ReqId,
        request: EvidenceRequest,
    },
    EpochAnnounce(Epoch),
    Heartbeat(Heartbeat),
    Report {
        req: ReqId,
        report: Report,
    },
    Api {
        req: ReqId,
        request: ApiRequest,
    },
    Reply {
        req: ReqId,
        reply: Reply,
    },
    /// The requester's own timer: never lost, never partitioned away.
    Timeout {
        req: ReqId,
    },
}

impl Msg {
    /// The subject (subscription) a message travels on, for FIFO links.
    fn subject(&self) -> u8 {
        match self {
            Msg::Command { .. } => 0,
            Msg::AskEvidence { .. } => 1,
            Msg::EpochAnnounce(_) => 2,
            Msg::Heartbeat(_) => 3,
            Msg::Report { .. } => 4,
            Msg::Api { .. } => 5,
            Msg::Reply { .. } => 6,
            Msg::Timeout { .. } => 7,
        }
    }
}

// Replies live for a tick or two in a test's queue: size does not matter here.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Reply {
    Worker(WorkerReply),
    Evidence(EvidenceReply),
    Ack(ReportAck),
    Api(ApiReply),
}

#[derive(Debug, Clone)]
pub struct Envelope {
    pub to: Dest,
    pub msg: Msg,
}

/// What a requester remembers about a request it waits on.
#[derive(Debug, Clone)]
pub enum Asked {
    /// Boxed: a grant carries its task's whole spec.
    Command {
        worker: usize,
        command: Box<WorkerCommand>,
    },
    Evidence {
        worker: usize,
        request: EvidenceRequest,
    },
    Report,
    Api,
}

#[derive(Debug, Clone)]
pub struct Waiting {
    pub owner: Node,
    /// The requester's incarnation (a coordinator term, a worker process): a
    /// restarted process never receives its predecessor's replies.
    pub incarnation: u64,
    pub asked: Asked,
}

/// The network's misbehaviour, per message.
#[derive(Debug, Clone)]
pub struct Weather {
    pub loss: f64,
    pub max_delay: u64,
    /// Chance of a long delay (a publish buffered by a client during an outage).
    pub late: f64,
    pub late_max: u64,
    /// Chance that a partitioned sender's message is buffered and delivered
    /// after the partition heals, rather than lost.
    pub buffered: f64,
    /// Messages from one sender to one destination on one subject arrive in
    /// the order sent: NATS keeps the order of one connection's publishes for
    /// a subscription, while the processes read their subscriptions (commands,
    /// replies, heartbeats, reports) independently of each other. Off: every
    /// message is reordered freely.
    pub fifo: bool,
}

impl Weather {
    pub fn calm() -> Weather {
        Weather { loss: 0.0, max_delay: 1, late: 0.0, late_max: 0, buffered: 0.0, fifo: true }
    }
}

pub struct Bus {
    /// (deliver at tick, random order, sequence) → message.
    queue: BTreeMap<(u64, u32, u64), Envelope>,
    waiting: BTreeMap<ReqId, Waiting>,
    seq: u64,
    partitioned_until: BTreeMap<Node, u64>,
    /// The queue key of the last message on each link (sender, destination,
    /// subject), for FIFO links.
    links: BTreeMap<(Node, Dest, u8), (u64, u32, u64)>,
    pub weather: Weather,
}

impl Bus {
    pub fn new(weather: Weather) -> Bus {
        Bus {
            queue: BTreeMap::new(),
            waiting: BTreeMap::new(),
            seq: 0,
            partitioned_until: BTreeMap::new(),
            links: BTreeMap::new(),
            weather,
        }
    }

    pub fn partition(&mut self, node: Node, until: u64) {
        self.partitioned_until.insert(node, until);
    }

    pub fn heal_all(&mut self) {
        self.partitioned_until.clear();
    }

    pub fn is_partitioned(&self, node: Node, now: u64) -> bool {
        self.partitioned_until.get(&node).is_some_and(|until| now < *until)
    }

    /// Sends one message across the network. Returns what became of it, for the trace.
    ///
    /// Two draws decide everything about a message (loss, delay, lateness,
    /// order among same-tick deliveries): the rng is the simulation's most
    /// expensive part in unoptimized builds.
    pub fn send(&mut self, rng: &mut StdRng, now: u64, from: Node, to: Dest, msg: Msg) -> &'static str {
        let w = &self.weather;
        let (a, b): (u64, u64) = (rng.gen(), rng.gen());
        let below = |bits: u64, p: f64| ((bits & 0xffff) as f64) < p * 65536.0;
        let mut at = now + (a >> 48 & 0xff) % (w.max_delay + 1);
        if let Some(until) = self.partitioned_until.get(&from).copied().filter(|u| now < *u) {
            if !below(a >> 32, w.buffered) {
                return "lost (sender cut off)";
            }
            at = at.max(until) + (a >> 56) % (w.max_delay + 1);
        } else if below(a, w.loss) {
            return "lost";
        }
        let late = below(a >> 16, w.late);
        if late {
            at += 1 + (b >> 32 & 0xffff) % w.late_max.max(1);
        }
        self.seq += 1;
        let mut key = (at, b as u32, self.seq);
        if w.fifo {
            let last = self.links.entry((from, to, msg.subject())).or_insert((0, 0, 0));
            if key < *last {
                key = (last.0, last.1, self.seq);
            }
            *last = key;
        }
        self.queue.insert(key, Envelope { to, msg });
        if late {
            "late"
        } else {
            "sent"
        }
    }

    /// Sends a request and arms its timeout; `make` builds the message from the request id.
    #[allow(clippy::too_many_arguments)]
    pub fn request(
        &mut self,
        rng: &mut StdRng,
        now: u64,
        from: Node,
        incarnation: u64,
        to: Dest,
        timeout: u64,
        asked: Asked,
        make: impl FnOnce(ReqId) -> Msg,
    ) -> (ReqId, &'static str) {
        self.seq += 1;
        let req = self.seq;
        self.waiting.insert(req, Waiting { owner: from, incarnation, asked });
        let fate = self.send(rng, now, from, to, make(req));
        // A local timer: after the same tick's deliveries, drawn from nothing.
        self.seq += 1;
        let timer = Envelope { to: Dest::Node(from), msg: Msg::Timeout { req } };
        self.queue.insert((now + timeout, u32::MAX, self.seq), timer);
        (req, fate)
    }

    /// Answers a request, if its requester still waits for it.
    pub fn reply(&mut self, rng: &mut StdRng, now: u64, from: Node, req: ReqId, reply: Reply) -> &'static str {
        let Some(owner) = self.waiting.get(&req).map(|w| w.owner) else {
            return "unwanted (requester gave up)";
        };
        self.send(rng, now, from, Dest::Node(owner), Msg::Reply { req, reply })
    }

    /// Takes a request out of the waiting set when its reply or timeout reaches
    /// the requester. `None`: it was already answered or timed out, or the
    /// requester is not the incarnation that asked.
    pub fn claim(&mut self, req: ReqId, owner: Node, incarnation: u64) -> Option<Waiting> {
        match self.waiting.get(&req) {
            Some(w) if w.owner == owner && w.incarnation == incarnation => self.waiting.remove(&req),
            Some(w) if w.owner == owner => {
                // A dead incarnation's request: nobody will ever want it.
                self.waiting.remove(&req);
                None
            }
            _ => None,
        }
    }

    /// The next message due at or before `now`.
    pub fn pop_due(&mut self, now: u64) -> Option<Envelope> {
        let key = *self.queue.keys().next()?;
        if key.0 > now {
            return None;
        }
        self.queue.remove(&key)
    }
}
