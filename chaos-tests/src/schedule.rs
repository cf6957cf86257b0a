//! The fault schedule: a pure function of the seed and the run's shape, so the
//! same seed always plans the same faults at the same offsets.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::proxy::{Direction, Mode};

/// One link between a node and NATS, each behind its own proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link {
    Coordinator(usize),
    Worker(usize),
    Sidecar(usize),
}

/// The named crash windows a worker can be made to die in (`TENURE_CRASH_AT`).
/// A grant's accept and its intent are recorded together, so there is no
/// window between them to die in.
pub const CRASH_WINDOWS: [&str; 4] = ["before-record", "after-intent", "after-exited", "after-report"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL the coordinator currently leading; restarted after `down_ms`.
    KillLeader {
        down_ms: u64,
    },
    /// SIGKILL a coordinator that is not leading.
    KillStandby {
        down_ms: u64,
    },
    /// SIGSTOP the leader for `ms` (long enough to lose its lease), then SIGCONT.
    PauseLeader {
        ms: u64,
    },
    KillWorker {
        worker: usize,
        down_ms: u64,
    },
    KillSidecar {
        worker: usize,
        down_ms: u64,
    },
    /// SIGKILL one running task's shim on that machine.
    KillShim {
        worker: usize,
    },
    /// SIGKILL the worker's shim launcher (the process that forks shims).
    KillLauncher {
        worker: usize,
    },
    /// Worker, sidecar, every shim and task process of the machine: a reboot.
    KillMachine {
        worker: usize,
        down_ms: u64,
    },
    PauseWorker {
        worker: usize,
        ms: u64,
    },
    /// nats-server itself, restarted on the same port and store.
    KillNats {
        down_ms: u64,
    },
    Cut {
        link: Link,
        mode: Mode,
        ms: u64,
    },
    /// Restart the worker so that it dies at a named point of its next attempt.
    CrashWindow {
        worker: usize,
        point: &'static str,
    },
    /// Submit a task that deletes and kills what it can (see `hostile.rs`).
    HostileTask,
    /// An operator's mistake: the machine goes down as in `KillMachine`, its
    /// data directory is deleted, and it comes back under the same id.
    WipeMachine {
        worker: usize,
        down_ms: u64,
    },
    /// An operator's mistake: a second worker process with a running worker's
    /// id (on its own data directory, as on another host) runs for `ms`.
    DuplicateWorker {
        worker: usize,
        ms: u64,
    },
    /// An operator's mistake: a coordinator is restarted with its wall clock
    /// `offset_ms` off the others' (minutes, ahead or behind), through the
    /// test-only `TENURE_TEST_CLOCK_OFFSET_MS`; it keeps it until its next
    /// restart. Nothing may depend on coordinators' clocks agreeing.
    ClockSkew {
        offset_ms: i64,
    },
    /// nats-server SIGKILLed and started again on its store after the
    /// registry was quiet for longer than its (shortened) duplicate window:
    /// the leader must go on, not step down as if fenced.
    NatsRestart,
    /// An operator's mistake: the registry stream is restored from a snapshot
    /// taken earlier in the run while the coordinators are down. The expected
    /// result is a refusal to lead, reported to clients; then the harness puts
    /// the good registry back and the run goes on.
    RegistryRollback,
    /// The power of one node fails: every process of it dies and its disk
    /// keeps only what was synced (a power-loss filesystem); it boots again
    /// after `down_ms`.
    PowerLoss {
        node: PowerNode,
        down_ms: u64,
    },
}

/// Whose power a [`Fault::PowerLoss`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PowerNode {
    /// A worker machine: worker, sidecar, shims, tasks, and its data directory.
    Machine(usize),
    /// The NATS node: nats-server and its JetStream store.
    Nats,
}

impl Fault {
    /// Whether the fault strikes a worker machine (its processes, its store,
    /// its links, its tasks): only such a fault can leave a task's outcome
    /// unprovable, so the judge bounds `unknown` tasks by them.
    pub fn strikes_machine(&self) -> bool {
        match self {
            Fault::KillWorker { .. }
            | Fault::KillSidecar { .. }
            | Fault::KillShim { .. }
            | Fault::KillLauncher { .. }
            | Fault::KillMachine { .. }
            | Fault::PauseWorker { .. }
            | Fault::CrashWindow { .. }
            | Fault::HostileTask
            | Fault::WipeMachine { .. }
            | Fault::DuplicateWorker { .. } => true,
            Fault::Cut { link, .. } => matches!(link, Link::Worker(_) | Link::Sidecar(_)),
            Fault::PowerLoss { node, .. } => matches!(node, PowerNode::Machine(_)),
            Fault::KillLeader { .. }
            | Fault::KillStandby { .. }
            | Fault::PauseLeader { .. }
            | Fault::KillNats { .. }
            | Fault::ClockSkew { .. }
            | Fault::NatsRestart
            | Fault::RegistryRollback => false,
        }
    }

    /// Whether the fault takes a whole worker machine down and boots it
    /// again (the only faults after which `machine-restarted` is truthful).
    pub fn restarts_machine(&self) -> bool {
        matches!(
            self,
            Fault::KillMachine { .. }
                | Fault::WipeMachine { .. }
                | Fault::PowerLoss { node: PowerNode::Machine(_), .. }
        )
    }

    /// Whether the fault stops nats-server or changes its store (a kill, a
    /// restart, a power cut of the NATS node, a registry swap): the faults a
    /// registry that lost acknowledged writes is to be read against.
    pub fn touches_nats_store(&self) -> bool {
        matches!(
            self,
            Fault::KillNats { .. }
                | Fault::NatsRestart
                | Fault::RegistryRollback
                | Fault::PowerLoss { node: PowerNode::Nats, .. }
        )
    }

    /// The fault's type, for counting.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillLeader { .. } => "kill-leader",
            Fault::KillStandby { .. } => "kill-standby",
            Fault::PauseLeader { .. } => "pause-leader",
            Fault::KillWorker { .. } => "kill-worker",
            Fault::KillSidecar { .. } => "kill-sidecar",
            Fault::KillShim { .. } => "kill-shim",
            Fault::KillLauncher { .. } => "kill-launcher",
            Fault::KillMachine { .. } => "kill-machine",
            Fault::PauseWorker { .. } => "pause-worker",
            Fault::KillNats { .. } => "kill-nats",
            Fault::Cut { mode: Mode::Drop, .. } => "cut-drop",
            Fault::Cut { mode: Mode::Blackhole, .. } => "cut-blackhole",
            Fault::Cut { mode: Mode::Delay(_), .. } => "cut-delay",
            Fault::Cut { mode: Mode::OneWay(_), .. } => "cut-one-way",
            Fault::Cut { mode: Mode::Pass, .. } => "cut-none",
            Fault::CrashWindow { .. } => "crash-window",
            Fault::HostileTask => "hostile-task",
            Fault::WipeMachine { .. } => "wipe-machine",
            Fault::DuplicateWorker { .. } => "duplicate-worker",
            Fault::ClockSkew { .. } => "clock-skew",
            Fault::NatsRestart => "nats-restart",
            Fault::RegistryRollback => "registry-rollback",
            Fault::PowerLoss { .. } => "power-loss",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// Milliseconds after the load started.
    pub at_ms: u64,
    pub fault: Fault,
}

/// The default mean gap between two faults: one every 2–5 s.
pub const DEFAULT_GAP_MS: u64 = 3500;

/// Plans faults over `duration_ms`, one every `gap_ms` on average (drawn
/// from 4/7 to 10/7 of it: 2–5 s for the default), none in the last 3 s.
pub fn plan(seed: u64, duration_ms: u64, coordinators: usize, workers: usize, gap_ms: u64) -> Vec<Planned> {
    let gap_ms = gap_ms.max(100);
    let gaps = gap_ms * 4 / 7..gap_ms * 10 / 7;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut at = 1500 + rng.gen_range(0..1000);
    while at + 3000 < duration_ms {
        let w = rng.gen_range(0..workers.max(1));
        let down = rng.gen_range(300..2500);
        let fault = match rng.gen_range(0..23) {
            0 | 1 => Fault::KillLeader { down_ms: down },
            2 if coordinators > 1 => Fault::KillStandby { down_ms: down },
            3 if coordinators > 1 => Fault::PauseLeader { ms: rng.gen_range(3000..6000) },
            4 => Fault::KillWorker { worker: w, down_ms: down },
            5 => Fault::KillSidecar { worker: w, down_ms: down },
            6 => Fault::KillShim { worker: w },
            12 => Fault::KillLauncher { worker: w },
            7 => Fault::KillMachine { worker: w, down_ms: down },
            8 => Fault::PauseWorker { worker: w, ms: rng.gen_range(500..5000) },
            9 => Fault::KillNats { down_ms: rng.gen_range(300..1500) },
            10 | 11 => {
                let link = match rng.gen_range(0..3) {
                    0 => Link::Coordinator(rng.gen_range(0..coordinators.max(1))),
                    1 => Link::Worker(w),
                    _ => Link::Sidecar(w),
                };
                let mode = match rng.gen_range(0..4) {
                    0 => Mode::Drop,
                    1 => Mode::Blackhole,
                    2 => Mode::Delay(rng.gen_range(20..400)),
                    _ => Mode::OneWay(if rng.gen_bool(0.5) { Direction::Upstream } else { Direction::Downstream }),
                };
                Fault::Cut { link, mode, ms: rng.gen_range(500..6000) }
            }
            15 => Fault::HostileTask,
            16 => Fault::WipeMachine { worker: w, down_ms: down },
            17 => Fault::DuplicateWorker { worker: w, ms: rng.gen_range(2000..8000) },
            18 => {
                let minutes = rng.gen_range(60_000..1_800_000);
                Fault::ClockSkew { offset_ms: if rng.gen_bool(0.5) { minutes } else { -minutes } }
            }
            19 => Fault::NatsRestart,
            20 => Fault::RegistryRollback,
            21 => Fault::PowerLoss { node: PowerNode::Machine(w), down_ms: down },
            22 => Fault::PowerLoss { node: PowerNode::Nats, down_ms: rng.gen_range(300..1500) },
            _ => Fault::CrashWindow { worker: w, point: CRASH_WINDOWS[rng.gen_range(0..CRASH_WINDOWS.len())] },
        };
        out.push(Planned { at_ms: at, fault });
        at += rng.gen_range(gaps.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_plans_the_same_faults() {
        let a = plan(42, 120_000, 2, 3, DEFAULT_GAP_MS);
        assert_eq!(a, plan(42, 120_000, 2, 3, DEFAULT_GAP_MS));
        assert_ne!(a, plan(43, 120_000, 2, 3, DEFAULT_GAP_MS));
        assert!(a.len() > 20);
        assert!(a.windows(2).all(|w| w[0].at_ms < w[1].at_ms));
        assert!(a.iter().all(|p| p.at_ms + 3000 < 120_000));
    }

    #[test]
    fn a_denser_schedule_plans_more_faults_with_the_same_families() {
        let usual = plan(11, 600_000, 3, 3, DEFAULT_GAP_MS);
        let dense = plan(11, 600_000, 3, 3, 700);
        assert!(dense.len() > usual.len() * 4, "{} vs {}", dense.len(), usual.len());
        assert!(dense.windows(2).all(|w| w[1].at_ms - w[0].at_ms >= 400 && w[1].at_ms - w[0].at_ms < 1000));
        let kinds = |p: &[Planned]| p.iter().map(|p| p.fault.kind()).collect::<std::collections::BTreeSet<_>>();
        assert_eq!(kinds(&dense), kinds(&plan(7, 3_600_000, 3, 3, DEFAULT_GAP_MS)));
    }

    #[test]
    fn a_short_dense_run_can_cut_a_machines_power() {
        let machine = |p: &Planned| matches!(p.fault, Fault::PowerLoss { node: PowerNode::Machine(_), .. });
        let seed = (0..200u64).find(|s| plan(*s, 30_000, 2, 2, 1500).iter().filter(|p| machine(p)).count() >= 2);
        eprintln!("first seed whose dense 30 s plan cuts a machine's power twice: {seed:?}");
        assert!(seed.is_some());
    }

    #[test]
    fn a_short_run_can_skew_a_coordinators_clock() {
        let seed =
            (0..200u64).find(|s| plan(*s, 45_000, 2, 2, DEFAULT_GAP_MS).iter().any(|p| p.fault.kind() == "clock-skew"));
        eprintln!("first seed whose 45 s plan skews a clock: {seed:?}");
        assert!(seed.is_some());
        let skews = plan(7, 3_600_000, 3, 3, DEFAULT_GAP_MS).into_iter().filter_map(|p| match p.fault {
            Fault::ClockSkew { offset_ms } => Some(offset_ms),
            _ => None,
        });
        // Minutes, ahead and behind.
        let skews: Vec<i64> = skews.collect();
        assert!(skews.iter().all(|o| o.unsigned_abs() >= 60_000));
        assert!(skews.iter().any(|o| *o > 0) && skews.iter().any(|o| *o < 0));
    }

    #[test]
    fn the_faults_on_the_nats_store_are_the_kills_restarts_cuts_and_swaps_of_the_nats_node() {
        let touching: std::collections::BTreeSet<&str> = plan(7, 3_600_000, 3, 3, DEFAULT_GAP_MS)
            .iter()
            .filter(|p| p.fault.touches_nats_store())
            .map(|p| p.fault.kind())
            .collect();
        assert_eq!(touching, ["kill-nats", "nats-restart", "power-loss", "registry-rollback"].into());
        assert!(!Fault::PowerLoss { node: PowerNode::Machine(0), down_ms: 500 }.touches_nats_store());
        assert!(Fault::PowerLoss { node: PowerNode::Nats, down_ms: 500 }.touches_nats_store());
    }

    #[test]
    fn a_long_plan_uses_every_kind_of_fault() {
        let kinds: std::collections::BTreeSet<&str> =
            plan(7, 3_600_000, 3, 3, DEFAULT_GAP_MS).iter().map(|p| p.fault.kind()).collect();
        for k in [
            "kill-leader",
            "kill-standby",
            "pause-leader",
            "kill-worker",
            "kill-sidecar",
            "kill-shim",
            "kill-launcher",
            "kill-machine",
            "pause-worker",
            "kill-nats",
            "cut-drop",
            "cut-blackhole",
            "cut-delay",
            "cut-one-way",
            "crash-window",
            "hostile-task",
            "wipe-machine",
            "duplicate-worker",
            "clock-skew",
            "nats-restart",
            "registry-rollback",
            "power-loss",
        ] {
            assert!(kinds.contains(k), "{k} never planned");
        }
    }
}
