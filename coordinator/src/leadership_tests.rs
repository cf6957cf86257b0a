//! Tests of the pure lease machine with a manual clock: scripted schedules for
//! each rule, then random schedules of several coordinators sharing one
//! simulated key (reads delivered late, writes landing late or unanswered,
//! processes paused), checking that at most one may act at any time, that
//! epochs strictly increase, and that a calm cluster ends with one leader.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;

const MS: Duration = Duration::from_millis(1);

fn cfg() -> LeadershipConfig {
    LeadershipConfig::default()
}

fn held(holder: &str, epoch: u64, renewals: u64) -> KeyState {
    KeyState::Held(LeadershipRecord { holder: holder.into(), epoch: Epoch(epoch), renewals, ttl_ms: 6000, mark: None })
}

fn key(revision: u64, state: KeyState) -> Observation {
    Observation::Key { revision, state }
}

/// Drives one machine with a manual clock.
struct Clocked {
    leadership: Leadership,
    now: Duration,
}

impl Clocked {
    fn new(holder: &str) -> Clocked {
        Clocked { leadership: Leadership::new(cfg(), holder), now: Duration::from_secs(100) }
    }

    fn at(&mut self, obs: Observation) -> Decision {
        self.leadership.handle(obs, self.now)
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    /// Ticks every 50 ms for `d`, returning the first decision that is not `None`.
    fn tick_for(&mut self, d: Duration) -> Option<(Duration, Decision)> {
        let end = self.now + d;
        while self.now < end {
            self.advance(50 * MS);
            let d = self.at(Observation::Tick);
            if d != Decision::None {
                return Some((self.now, d));
            }
        }
        None
    }

    /// Takes the leadership from an absent key and returns the leader's epoch.
    fn lead(&mut self) -> Epoch {
        let Decision::Acquire(w) = self.at(key(0, KeyState::Absent)) else { panic!("no acquire on an absent key") };
        match self.at(Observation::Written { revision: 1 }) {
            Decision::Lead { epoch, .. } => {
                assert_eq!(epoch, w.value.epoch);
                epoch
            }
            other => panic!("expected lead, got {other:?}"),
        }
    }
}

#[test]
fn timing_must_be_ordered() {
    assert_eq!(cfg().validate(), Ok(()));
    let bad = |interval, deadline, ttl| LeadershipConfig {
        ttl: Duration::from_millis(ttl),
        renew_interval: Duration::from_millis(interval),
        renew_deadline: Duration::from_millis(deadline),
    };
    for (i, d, t) in [(2000, 6000, 6000), (4000, 4000, 6000), (5000, 4000, 6000), (0, 4000, 6000), (2000, 7000, 6000)] {
        let err = bad(i, d, t).validate().unwrap_err();
        assert!(err.to_string().contains("renew interval"), "{err}");
    }
    assert_eq!(bad(300, 900, 1500).validate(), Ok(()));
}

#[test]
fn renewals_seen_mean_no_takeover() {
    let mut c = Clocked::new("b");
    assert_eq!(c.at(key(7, held("a", 3, 0))), Decision::None);
    // The holder renews every 2 s for a minute: the revision keeps changing.
    for i in 1..=30u64 {
        assert_eq!(c.tick_for(Duration::from_secs(2)), None, "takeover while renewals were seen");
        assert_eq!(c.at(key(7 + i, held("a", 3, i))), Decision::None);
    }
    // The same revision read again and again is not a renewal.
    let (at, d) = c.tick_for(Duration::from_secs(10)).expect("takeover after silence");
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!(w.expected, 37);
    assert_eq!(at, c.now);
}

#[test]
fn silence_for_the_ttl_leads_to_one_takeover_attempt_on_the_revision_seen() {
    let mut c = Clocked::new("b");
    let t0 = c.now;
    c.at(key(4, held("a", 5, 9)));
    // Re-reading the unchanged revision does not restart the count.
    for _ in 0..5 {
        c.advance(Duration::from_millis(1000));
        assert_eq!(c.at(key(4, held("a", 5, 9))), Decision::None);
    }
    let (at, d) = c.tick_for(Duration::from_secs(2)).expect("takeover");
    assert!(at - t0 >= cfg().ttl, "took over after {:?}", at - t0);
    assert!(at - t0 < cfg().ttl + 100 * MS);
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!(w.expected, 4);
    assert_eq!(
        w.value,
        LeadershipRecord { holder: "b".into(), epoch: Epoch(6), renewals: 0, ttl_ms: 6000, mark: None }
    );
    // No second write while the first is unanswered.
    assert_eq!(c.tick_for(Duration::from_secs(1)), None);
    c.advance(10 * MS);
    assert_eq!(c.at(Observation::Written { revision: 5 }), Decision::Lead { epoch: Epoch(6), takeover_started: at });
    assert!(c.leadership.may_act(c.now));
}

#[test]
fn a_refused_takeover_waits_for_a_read_and_restarts_the_count_on_a_new_revision() {
    let mut c = Clocked::new("b");
    c.at(key(4, held("a", 5, 9)));
    let (_, d) = c.tick_for(Duration::from_secs(7)).expect("takeover");
    assert!(matches!(d, Decision::Acquire(_)));
    // Another standby won.
    assert_eq!(c.at(Observation::Conflict), Decision::None);
    assert_eq!(c.tick_for(Duration::from_secs(10)), None, "no retry before a read");
    assert_eq!(c.at(key(5, held("c", 6, 0))), Decision::None);
    assert_eq!(c.tick_for(Duration::from_millis(5900)), None);
    let (_, d) = c.tick_for(Duration::from_millis(200)).expect("takeover of c's lease");
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!((w.expected, w.value.epoch), (5, Epoch(7)));
}

#[test]
fn the_holders_longer_ttl_is_respected() {
    let mut c = Clocked::new("b");
    let long = KeyState::Held(LeadershipRecord {
        holder: "a".into(),
        epoch: Epoch(1),
        renewals: 0,
        ttl_ms: 10_000,
        mark: None,
    });
    c.at(key(2, long));
    assert_eq!(c.tick_for(Duration::from_millis(9_900)), None);
    assert!(matches!(c.tick_for(Duration::from_millis(200)), Some((_, Decision::Acquire(_)))));
}

#[test]
fn an_absent_or_released_key_is_taken_at_once() {
    let mut c = Clocked::new("b");
    assert_eq!(c.tick_for(Duration::from_secs(10)), None, "nothing is judged before the key was read");
    let Decision::Acquire(w) = c.at(key(0, KeyState::Absent)) else { panic!() };
    assert_eq!((w.expected, w.value.epoch), (0, Epoch(1)));

    let mut c = Clocked::new("b");
    let released =
        KeyState::Held(LeadershipRecord { holder: "a".into(), epoch: Epoch(4), renewals: 8, ttl_ms: 0, mark: None });
    let Decision::Acquire(w) = c.at(key(9, released)) else { panic!() };
    assert_eq!((w.expected, w.value.epoch), (9, Epoch(5)));

    // A deleted key keeps its revision; the epoch continues from what was seen before.
    let mut c = Clocked::new("b");
    c.at(key(3, held("a", 8, 0)));
    let Decision::Acquire(w) = c.at(key(4, KeyState::Absent)) else { panic!() };
    assert_eq!((w.expected, w.value.epoch), (4, Epoch(9)));
}

#[test]
fn the_leader_renews_every_interval_with_a_cas_on_its_revision() {
    let mut c = Clocked::new("a");
    c.lead();
    for i in 1..=10u64 {
        let (at, d) = c.tick_for(Duration::from_secs(3)).expect("renewal");
        let Decision::Renew(w) = d else { panic!("{d:?}") };
        // The leadership landed at revision 1; renewal i expects revision i.
        assert_eq!((w.expected, w.value.renewals), (i, i));
        assert!(at >= Duration::from_secs(100) + cfg().renew_interval * i as u32);
        assert_eq!(c.at(Observation::Written { revision: i + 1 }), Decision::None);
        assert!(c.leadership.may_act(c.now));
    }
}

#[test]
fn a_leader_that_misses_its_renew_deadline_steps_down_before_anyone_can_take_over() {
    let mut leader = Clocked::new("a");
    let mut standby = Clocked::new("b");
    standby.now = leader.now;
    leader.lead();
    let (sent, d) = leader.tick_for(Duration::from_secs(3)).expect("renewal");
    let Decision::Renew(w) = d else { panic!() };
    // The renewal lands; the standby sees it a little later.
    leader.advance(5 * MS);
    leader.at(Observation::Written { revision: 2 });
    standby.now = leader.now + 20 * MS;
    standby.at(key(2, KeyState::Held(w.value.clone())));
    // From now on nothing the leader writes gets an answer.
    let mut stepped = None;
    while stepped.is_none() {
        leader.advance(50 * MS);
        match leader.at(Observation::Tick) {
            Decision::Renew(_) => assert_eq!(leader.at(Observation::WriteFailed), Decision::None),
            Decision::StepDown(r) => stepped = Some((leader.now, r)),
            Decision::None => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(leader.leadership.may_act(leader.now), stepped.is_none());
    }
    let (stopped_at, reason) = stepped.unwrap();
    assert!(matches!(reason, StepDownReason::DeadlineMissed { .. }), "{reason:?}");
    assert!(stopped_at - sent >= cfg().renew_deadline && stopped_at - sent < cfg().renew_deadline + 100 * MS);
    let (takeover_at, d) = standby.tick_for(Duration::from_secs(10)).expect("takeover");
    assert!(matches!(d, Decision::Acquire(_)));
    assert!(takeover_at > stopped_at, "standby acted at {takeover_at:?}, leader stopped at {stopped_at:?}");
}

#[test]
fn a_refused_renewal_or_a_newer_holder_means_stepping_down() {
    let mut c = Clocked::new("a");
    c.lead();
    let (_, d) = c.tick_for(Duration::from_secs(3)).unwrap();
    assert!(matches!(d, Decision::Renew(_)));
    assert!(matches!(c.at(Observation::Conflict), Decision::StepDown(StepDownReason::Lost { .. })));
    assert!(!c.leadership.may_act(c.now));

    let mut c = Clocked::new("a");
    c.lead();
    // An older copy from a lagging replica changes nothing; a newer revision does.
    assert_eq!(c.at(key(1, held("a", 1, 0))), Decision::None);
    match c.at(key(2, held("b", 2, 0))) {
        Decision::StepDown(StepDownReason::Lost { holder, revision }) => {
            assert_eq!((holder.as_deref(), revision), (Some("b"), Some(2)))
        }
        other => panic!("{other:?}"),
    }
    // Back to standby: it waits a full ttl before competing, even for a released key.
    let released =
        KeyState::Held(LeadershipRecord { holder: "b".into(), epoch: Epoch(2), renewals: 1, ttl_ms: 0, mark: None });
    assert_eq!(c.at(key(3, released)), Decision::None);
    assert_eq!(c.tick_for(Duration::from_millis(5900)), None);
    assert!(matches!(c.tick_for(Duration::from_millis(200)), Some((_, Decision::Acquire(_)))));
}

#[test]
fn an_unanswered_write_is_resolved_by_reading_the_key() {
    // The renewal landed although its answer was lost.
    let mut c = Clocked::new("a");
    c.lead();
    let (_, d) = c.tick_for(Duration::from_secs(3)).unwrap();
    let Decision::Renew(w) = d else { panic!() };
    assert_eq!(c.at(Observation::WriteFailed), Decision::None);
    assert_eq!(c.tick_for(Duration::from_secs(1)), None, "no second write before a read");
    assert_eq!(c.at(key(2, KeyState::Held(w.value.clone()))), Decision::None);
    assert_eq!(c.leadership.held().map(|h| (h.revision, h.value.renewals)), Some((2, 1)));

    // It did not land: the next renewal is tried on the old revision.
    let (_, d) = c.tick_for(Duration::from_secs(3)).unwrap();
    assert!(matches!(d, Decision::Renew(_)));
    c.at(Observation::WriteFailed);
    assert_eq!(c.at(key(2, KeyState::Held(w.value))), Decision::None);
    let (_, d) = c.tick_for(Duration::from_secs(1)).unwrap();
    let Decision::Renew(w) = d else { panic!("{d:?}") };
    // Every write carries a new count, the one that did not land included.
    assert_eq!((w.expected, w.value.renewals), (2, 3));

    // A takeover that landed without an answer: the read makes us leader.
    let mut c = Clocked::new("b");
    let Decision::Acquire(w) = c.at(key(0, KeyState::Absent)) else { panic!() };
    c.at(Observation::WriteFailed);
    assert!(matches!(c.at(key(1, KeyState::Held(w.value))), Decision::Lead { .. }));
}

#[test]
fn an_older_write_of_ours_landing_late_is_not_taken_for_the_pending_one() {
    let mut c = Clocked::new("b");
    c.at(key(4, held("a", 5, 9)));
    let (_, d) = c.tick_for(Duration::from_secs(7)).expect("takeover");
    let Decision::Acquire(first) = d else { panic!("{d:?}") };
    c.at(Observation::WriteFailed);
    // The read shows nothing new: the first try is given up, a second one is sent.
    assert!(matches!(c.at(key(4, held("a", 5, 9))), Decision::Acquire(_)));
    c.at(Observation::WriteFailed);
    // The *first* try landed late. It is not the pending write: no lead, and the
    // lease it made is judged like anyone's (it expires unless renewed).
    assert_eq!(c.at(key(5, KeyState::Held(first.value.clone()))), Decision::None);
    assert!(!c.leadership.may_act(c.now));
    assert_eq!(c.tick_for(Duration::from_millis(5900)), None);
    let (_, d) = c.tick_for(Duration::from_millis(200)).expect("takeover of the orphan");
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!((w.expected, w.value.epoch), (5, Epoch(7)));
    assert!(w.value.renewals > first.value.renewals);
}

#[test]
fn an_adopted_epoch_is_written_back_at_once() {
    let mut c = Clocked::new("a");
    assert_eq!(c.lead(), Epoch(1));
    c.advance(10 * MS);
    c.leadership.adopt_epoch(Epoch(7), c.now);
    let Decision::Renew(w) = c.at(Observation::Tick) else { panic!() };
    assert_eq!((w.value.epoch, w.value.renewals), (Epoch(7), 1));
    // A lower epoch changes nothing.
    c.at(Observation::Written { revision: 2 });
    c.leadership.adopt_epoch(Epoch(3), c.now);
    assert_eq!(c.at(Observation::Tick), Decision::None);
}

#[test]
fn stepping_down_releases_the_key_and_late_answers_never_lead() {
    let mut c = Clocked::new("a");
    c.lead();
    let release = c.leadership.step_down(c.now).expect("a release write");
    assert_eq!((release.expected, release.value.ttl_ms, release.value.holder.as_str()), (1, 0, "a"));
    assert!(!c.leadership.may_act(c.now));
    assert_eq!(c.leadership.step_down(c.now), None);

    // A takeover answered after the renew deadline does not lead.
    let mut c = Clocked::new("b");
    let Decision::Acquire(_) = c.at(key(0, KeyState::Absent)) else { panic!() };
    c.advance(cfg().renew_deadline);
    assert!(matches!(c.at(Observation::Written { revision: 1 }), Decision::StepDown(_)));
    assert!(!c.leadership.may_act(c.now));
}

// ------------------------------------------------------ random schedules

/// One simulated coordinator process. Like the real driver, it waits for the
/// answer to a write before it handles anything else; a write whose answer was
/// lost may still land later ("orphan").
struct Node {
    leadership: Leadership,
    paused: bool,
    /// Reads on their way to the process.
    inbox: VecDeque<Observation>,
    /// The write sent and not answered yet: the process waits for it.
    in_flight: Option<Write>,
    /// The answer to that write, delivered when the process runs next.
    answer: Option<Observation>,
    /// Writes given up on (no answer expected) that may still land, and releases.
    orphans: Vec<Write>,
}

impl Node {
    fn busy(&self) -> bool {
        self.paused || self.in_flight.is_some()
    }
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Advance(u16),
    Tick(usize),
    Read(usize),
    Deliver(usize),
    /// Land the write in flight (and any orphans); `bool`: its answer is lost.
    Land(usize, bool),
    /// The write in flight gets no answer and may land later.
    Drop(usize),
    TogglePause(usize),
    /// The leader steps down on its own account (fenced, shutdown).
    Resign(usize),
}

struct Sim {
    nodes: Vec<Node>,
    now: Duration,
    revision: u64,
    key: Option<(u64, LeadershipRecord)>,
    /// Epochs in the order leaders were elected (from the key), and claimed (registry).
    lead_epochs: Vec<Epoch>,
    claims: Vec<Epoch>,
    trace: Vec<String>,
}

impl Sim {
    fn new(n: usize, cfg: LeadershipConfig) -> Sim {
        let nodes = (0..n)
            .map(|i| Node {
                leadership: Leadership::new(cfg, format!("n{i}")),
                paused: false,
                inbox: VecDeque::new(),
                in_flight: None,
                answer: None,
                orphans: vec![],
            })
            .collect();
        Sim {
            nodes,
            now: Duration::from_secs(1),
            revision: 0,
            key: None,
            lead_epochs: vec![],
            claims: vec![],
            trace: vec![],
        }
    }

    fn cas(&mut self, w: &Write) -> Option<u64> {
        let current = self.key.as_ref().map_or(0, |(r, _)| *r);
        if current != w.expected {
            return None;
        }
        self.revision += 1;
        self.key = Some((self.revision, w.value.clone()));
        Some(self.revision)
    }

    fn feed(&mut self, i: usize, obs: Observation) {
        let now = self.now;
        let d = self.nodes[i].leadership.handle(obs.clone(), now);
        self.trace.push(format!("{:>7}ms n{i} <- {obs:?} -> {d:?}", now.as_millis()));
        match d {
            Decision::None => {}
            Decision::Acquire(w) | Decision::Renew(w) => {
                assert!(self.nodes[i].in_flight.is_none() && self.nodes[i].answer.is_none());
                self.nodes[i].in_flight = Some(w);
            }
            Decision::Lead { epoch, .. } => {
                if let Some(last) = self.lead_epochs.last() {
                    assert!(epoch > *last, "lease epoch {epoch} after {last}\n{}", self.trace.join("\n"));
                }
                self.lead_epochs.push(epoch);
                // The registry claim: max(lease epoch, last claim + 1), written back.
                let claim = epoch.max(self.claims.last().map_or(Epoch(1), |e| e.next()));
                self.claims.push(claim);
                self.nodes[i].leadership.adopt_epoch(claim, now);
            }
            Decision::StepDown(_) => {}
        }
    }

    /// Runs node `i` if it can: first the answer it waits for, then `obs`.
    fn run(&mut self, i: usize, obs: Option<Observation>) {
        if self.nodes[i].paused {
            return;
        }
        if let Some(answer) = self.nodes[i].answer.take() {
            self.feed(i, answer);
        }
        if let (Some(obs), false) = (obs, self.nodes[i].busy()) {
            self.feed(i, obs);
        }
    }

    fn step(&mut self, step: Step) {
        let n = self.nodes.len();
        match step {
            Step::Advance(ms) => self.now += Duration::from_millis(u64::from(ms)),
            Step::Tick(i) => self.run(i % n, Some(Observation::Tick)),
            Step::Read(i) => {
                let obs = match &self.key {
                    None => key(0, KeyState::Absent),
                    Some((r, v)) => key(*r, KeyState::Held(v.clone())),
                };
                self.nodes[i % n].inbox.push_back(obs);
            }
            Step::Deliver(i) => {
                let i = i % n;
                if !self.nodes[i].busy() || self.nodes[i].answer.is_some() {
                    let obs = if self.nodes[i].answer.is_some() { None } else { self.nodes[i].inbox.pop_front() };
                    self.run(i, obs);
                }
            }
            Step::Land(i, lost) => {
                let i = i % n;
                for w in std::mem::take(&mut self.nodes[i].orphans) {
                    self.cas(&w);
                }
                if let Some(w) = self.nodes[i].in_flight.take() {
                    let answer = match self.cas(&w) {
                        _ if lost => Observation::WriteFailed,
                        Some(revision) => Observation::Written { revision },
                        None => Observation::Conflict,
                    };
                    self.nodes[i].answer = Some(answer);
                }
            }
            Step::Drop(i) => {
                let node = &mut self.nodes[i % n];
                if let Some(w) = node.in_flight.take() {
                    node.orphans.push(w);
                    node.answer = Some(Observation::WriteFailed);
                }
            }
            Step::TogglePause(i) => self.nodes[i % n].paused ^= true,
            Step::Resign(i) => {
                let i = i % n;
                let node = &mut self.nodes[i];
                if !node.busy() && node.answer.is_none() {
                    if let Some(w) = node.leadership.step_down(self.now) {
                        self.trace.push(format!("{:>7}ms n{i} resigns", self.now.as_millis()));
                        node.orphans.push(w);
                    }
                }
            }
        }
        self.check_one_actor();
    }

    fn check_one_actor(&self) {
        let acting: Vec<usize> =
            (0..self.nodes.len()).filter(|i| self.nodes[*i].leadership.may_act(self.now)).collect();
        assert!(acting.len() <= 1, "nodes {acting:?} may all act at {:?}\n{}", self.now, self.trace.join("\n"));
    }

    /// No faults: every process runs, every write lands and is answered, the key
    /// is read often. The cluster must settle on exactly one leader.
    fn calm(&mut self, rounds: usize) {
        for node in &mut self.nodes {
            node.paused = false;
        }
        for _ in 0..rounds {
            self.step(Step::Advance(50));
            for i in 0..self.nodes.len() {
                self.step(Step::Land(i, false));
                self.step(Step::Read(i));
                while !self.nodes[i].inbox.is_empty() || self.nodes[i].answer.is_some() {
                    self.step(Step::Deliver(i));
                    self.step(Step::Land(i, false));
                }
                self.step(Step::Tick(i));
                self.step(Step::Land(i, false));
                self.step(Step::Deliver(i));
            }
        }
    }
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1u16..400).prop_map(Step::Advance),
        4 => (0usize..3).prop_map(Step::Tick),
        3 => (0usize..3).prop_map(Step::Read),
        4 => (0usize..3).prop_map(Step::Deliver),
        3 => ((0usize..3), proptest::bool::weighted(0.2)).prop_map(|(i, lost)| Step::Land(i, lost)),
        1 => (0usize..3).prop_map(Step::Drop),
        1 => (0usize..3).prop_map(Step::TogglePause),
        1 => (0usize..3).prop_map(Step::Resign),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Whatever the schedule: at most one process may act at any moment, lease
    /// epochs and registry claims strictly increase, and once faults stop the
    /// cluster settles on exactly one leader.
    #[test]
    fn random_schedules_keep_one_leader_and_growing_epochs(
        steps in proptest::collection::vec(step_strategy(), 0..600),
        timing in 0usize..3,
    ) {
        let cfg = [
            LeadershipConfig::default(),
            LeadershipConfig { ttl: 1500 * MS, renew_interval: 300 * MS, renew_deadline: 900 * MS },
            LeadershipConfig { ttl: 1000 * MS, renew_interval: 100 * MS, renew_deadline: 950 * MS },
        ][timing];
        let mut sim = Sim::new(3, cfg);
        for step in steps {
            sim.step(step);
        }
        let rounds = (cfg.ttl * 4).as_millis() as usize / 50;
        sim.calm(rounds);
        let leaders: Vec<usize> = (0..3).filter(|i| sim.nodes[*i].leadership.may_act(sim.now)).collect();
        prop_assert_eq!(leaders.len(), 1, "no single leader after a calm period\n{}", sim.trace.join("\n"));
        for pair in sim.claims.windows(2) {
            prop_assert!(pair[0] < pair[1]);
        }
        let leader = &sim.nodes[leaders[0]].leadership;
        let claimed = sim.claims.last().copied();
        prop_assert_eq!(leader.held().map(|h| h.value.epoch), claimed);
        prop_assert_eq!(sim.key.as_ref().map(|(_, v)| v.epoch), claimed, "the claimed epoch is written back");
    }
}

fn mark(last_seq: u64, highest_task: u64, epoch: u64) -> RegistryMark {
    RegistryMark { last_seq, highest_task, epoch: Epoch(epoch) }
}

#[test]
fn renewals_carry_the_latest_mark_the_leader_adopted() {
    let mut c = Clocked::new("a");
    c.lead();
    c.leadership.adopt_mark(mark(10, 3, 1));
    let (_, d) = c.tick_for(Duration::from_secs(3)).expect("renewal");
    let Decision::Renew(w) = d else { panic!("{d:?}") };
    assert_eq!(w.value.mark, Some(mark(10, 3, 1)));
    // A mark adopted while that renewal is in flight is not overwritten by it.
    c.leadership.adopt_mark(mark(12, 4, 1));
    c.advance(10 * MS);
    assert_eq!(c.at(Observation::Written { revision: 2 }), Decision::None);
    let (_, d) = c.tick_for(Duration::from_secs(3)).expect("renewal");
    let Decision::Renew(w) = d else { panic!("{d:?}") };
    assert_eq!(w.value.mark, Some(mark(12, 4, 1)));
    // Releasing the leadership keeps the mark for whoever comes next.
    c.advance(10 * MS);
    c.at(Observation::Written { revision: 3 });
    let release = c.leadership.step_down(c.now).expect("release");
    assert_eq!(release.value.mark, Some(mark(12, 4, 1)));
}

#[test]
fn a_takeover_carries_the_mark_of_the_value_it_replaces() {
    let mut c = Clocked::new("b");
    let old =
        LeadershipRecord { holder: "a".into(), epoch: Epoch(5), renewals: 9, ttl_ms: 6000, mark: Some(mark(40, 7, 5)) };
    c.at(key(4, KeyState::Held(old)));
    let (_, d) = c.tick_for(Duration::from_secs(7)).expect("takeover");
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!(w.value.mark, Some(mark(40, 7, 5)), "the mark outlives the term");
    // Even when the key is gone afterwards (the bucket was recreated), the
    // mark this process read is written on.
    let mut c = Clocked::new("b");
    let old =
        LeadershipRecord { holder: "a".into(), epoch: Epoch(5), renewals: 9, ttl_ms: 0, mark: Some(mark(40, 7, 5)) };
    let first = c.at(key(4, KeyState::Held(old)));
    assert!(matches!(first, Decision::Acquire(_)), "a released lease is taken at once: {first:?}");
    c.at(Observation::Conflict);
    let d = c.at(key(0, KeyState::Absent));
    let Decision::Acquire(w) = d else { panic!("{d:?}") };
    assert_eq!(w.value.mark, Some(mark(40, 7, 5)));
}

#[test]
fn a_lease_value_written_before_the_mark_existed_still_decodes() {
    #[derive(serde::Serialize)]
    struct Old {
        holder: String,
        epoch: Epoch,
        renewals: u64,
        ttl_ms: u64,
    }
    let bytes =
        tenure_protocol::encode(&Old { holder: "a".into(), epoch: Epoch(3), renewals: 1, ttl_ms: 6000 }).unwrap();
    let value: LeadershipRecord = tenure_protocol::decode(&bytes).unwrap();
    assert_eq!(value.mark, None);
    assert_eq!(value.epoch, Epoch(3));
}
