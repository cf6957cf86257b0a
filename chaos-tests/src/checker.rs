//! The judge: pure checks over what the harness collected from outside the
//! system — the ledger every task appends to, the registry's final snapshots,
//! the status history polled during the run, and the processes left on the
//! machine. It never asks tenure whether tenure behaved.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// A task the load submitted (its id, once known) and whether it may run twice.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub label: String,
    pub id: Option<String>,
    pub idempotent: bool,
    /// A `hostile-task` fault: judged like every task (its ledger line comes
    /// first), counted apart.
    pub hostile: bool,
}

/// The final state of one task in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Final {
    pub id: String,
    pub label: String,
    pub status: String,
    pub hint: Option<String>,
    /// A workflow step: its workflow's id (steps are judged like tasks).
    pub parent: Option<String>,
    pub idempotent: bool,
    /// A workflow: it has no effect of its own, its steps do.
    pub workflow: bool,
    /// The outcome's detail (`exit code: 3`, `signal 9`, …).
    pub detail: Option<String>,
}

/// A task of the load that ended `failed` or `killed` without its ledger
/// line: the load never kills and every command exits 0 once it runs, so only
/// a signal from outside (a hostile task's `kill -9 -1`) explains it.
fn ended_without_start(f: &Final, runs: usize) -> Option<String> {
    let ended = matches!(f.status.as_str(), "failed" | "killed");
    let by_signal = f.detail.as_deref().is_some_and(|d| d.contains("signal"));
    (ended && runs == 0 && !f.workflow && !by_signal)
        .then(|| format!("{} ({:?}) but never appended to the ledger", f.status, f.detail))
}

/// A live process that carries this run's marker.
#[derive(Debug, Clone)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    pub task: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Violation {
    pub kind: String,
    pub task: String,
    pub evidence: String,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Counts {
    pub tasks_submitted: usize,
    pub completed: usize,
    pub failed: usize,
    pub killed: usize,
    pub unknown: usize,
    pub lost: usize,
    pub double_executed: usize,
    pub anonymous: usize,
    pub resurrected: usize,
    pub orphans: usize,
    /// Hostile tasks submitted (also counted in `tasks_submitted`).
    pub hostile: usize,
    /// Machines whose epoch fence stands above every epoch a leader claimed.
    pub fence_raised: usize,
}

const TERMINAL: [&str; 3] = ["completed", "failed", "killed"];

/// What the cluster's own status said about the epochs at the end: the
/// leader's, and each worker's highest seen (a machine's fence).
#[derive(Debug, Clone, Default)]
pub struct Epochs {
    pub leader: u64,
    pub workers: Vec<(String, u64)>,
}

/// The faults that can explain a task whose outcome could not be proved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Explanations {
    /// Faults that struck a worker machine (see `Fault::strikes_machine`).
    pub machine_faults: u64,
    /// Of them, machines whose data directory was wiped.
    pub wipes: u64,
    /// Of them, machines that went down whole and booted again (killed,
    /// lost power, wiped).
    pub restarts: u64,
    /// Tasks one machine runs at once: one fault can leave at most these
    /// unproved.
    pub slots: u64,
}

/// What the run had to explain its outcomes with: what each run passes to
/// [`check`] beside what it collected.
#[derive(Debug, Clone, Default)]
pub struct Context {
    pub epochs: Epochs,
    pub explanations: Explanations,
}

/// Checks every safety rule; returns the counts and each violation with its evidence.
pub fn check(
    submitted: &[Submitted],
    finals: &[Final],
    ledger: &[(String, u32)],
    resurrections: &[(String, String, String)],
    procs: &[Proc],
    context: &Context,
) -> (Counts, Vec<Violation>) {
    let epochs = &context.epochs;
    let explanations = context.explanations;
    let mut v = Vec::new();
    let mut c = Counts {
        tasks_submitted: submitted.len(),
        hostile: submitted.iter().filter(|s| s.hostile).count(),
        ..Counts::default()
    };
    let mut violation =
        |kind: &str, task: &str, evidence: String| v.push(Violation { kind: kind.into(), task: task.into(), evidence });

    let by_label: HashMap<&str, Vec<&Final>> = finals.iter().fold(HashMap::new(), |mut m, f| {
        m.entry(f.label.as_str()).or_default().push(f);
        m
    });
    let by_id: HashMap<&str, &Final> = finals.iter().map(|f| (f.id.as_str(), f)).collect();
    let mut runs: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (task, attempt) in ledger {
        runs.entry(task.as_str()).or_default().push(*attempt);
    }

    for s in submitted {
        let found = by_label.get(s.label.as_str()).cloned().unwrap_or_default();
        if found.len() > 1 {
            let ids: Vec<&str> = found.iter().map(|f| f.id.as_str()).collect();
            violation("duplicate-task", &s.label, format!("one submission became {ids:?}"));
        }
        let Some(f) = found.first() else {
            c.lost += 1;
            violation("lost", &s.label, format!("submitted (id {:?}) but absent from the registry", s.id));
            continue;
        };
        if let Some(id) = &s.id {
            if id != &f.id {
                violation("lost", id, format!("the submit answered {id} but the registry holds {}", f.id));
            }
        }
        let count = runs.get(f.id.as_str()).map(Vec::len).unwrap_or(0);
        match f.status.as_str() {
            "completed" => c.completed += 1,
            "failed" => c.failed += 1,
            "killed" => c.killed += 1,
            "unknown" => c.unknown += 1,
            // A workflow waiting on an unknown step (its hint says which).
            "running" | "stopping" if f.workflow && f.hint.is_some() => c.unknown += 1,
            other => {
                c.lost += 1;
                violation("unsettled", &f.id, format!("still {other} after quiescence"));
            }
        }
        if !s.idempotent && count > 1 {
            c.double_executed += 1;
            violation("double-executed", &f.id, format!("ran {count} times: attempts {:?}", runs[f.id.as_str()]));
        }
        if f.status == "completed" && count == 0 && !f.workflow {
            violation("completed-without-effect", &f.id, "completed but never appended to the ledger".into());
        }
        if let Some(evidence) = ended_without_start(f, count) {
            violation("ended-without-start", &f.id, evidence);
        }
        if f.status == "unknown" {
            if f.hint.is_none() {
                violation("unknown-without-hint", &f.id, "unknown with no recovery hint".into());
            }
            if !s.idempotent && count > 1 {
                violation("untruthful-hint", &f.id, format!("unknown ({:?}) but ran {count} times", f.hint));
            }
            if f.hint.as_deref() == Some("machine-replaced") && explanations.wipes == 0 {
                violation("untruthful-hint", &f.id, "machine-replaced, but no machine's data was wiped".into());
            }
            if f.hint.as_deref() == Some("machine-restarted") && explanations.restarts == 0 {
                violation("untruthful-hint", &f.id, "machine-restarted, but no machine went down".into());
            }
        }
    }
    // Workflow steps: each is a task of its own, created by the leader.
    for f in finals.iter().filter(|f| f.parent.is_some()) {
        let count = runs.get(f.id.as_str()).map(Vec::len).unwrap_or(0);
        if !f.idempotent && count > 1 {
            c.double_executed += 1;
            violation(
                "double-executed",
                &f.id,
                format!("workflow step ran {count} times: attempts {:?}", runs[f.id.as_str()]),
            );
        }
        if f.status == "completed" && count == 0 {
            violation(
                "completed-without-effect",
                &f.id,
                "workflow step completed but never appended to the ledger".into(),
            );
        }
        if let Some(evidence) = ended_without_start(f, count) {
            violation("ended-without-start", &f.id, format!("workflow step {evidence}"));
        }
        let parent = f.parent.as_deref().and_then(|p| by_id.get(p));
        if parent.is_some_and(|p| p.status == "completed") && f.status != "completed" {
            violation("workflow", &f.id, format!("its workflow completed while the step is {}", f.status));
        }
    }
    // Only a fault on a worker machine leaves an outcome unprovable, and one
    // such fault at most the tasks that machine was running.
    let bound = explanations.machine_faults.saturating_mul(explanations.slots);
    if c.unknown as u64 > bound {
        violation(
            "unexplained-unknown",
            "run",
            format!(
                "{} tasks unknown; {} faults struck machines of {} slots, which explain at most {bound}",
                c.unknown, explanations.machine_faults, explanations.slots
            ),
        );
    }
    for task in runs.keys() {
        if !by_id.contains_key(task) {
            c.anonymous += 1;
            violation("anonymous", task, "an effect in the ledger that no task in the registry owns".into());
        }
    }
    // No machine's fence may stand above every epoch a leader ever claimed: only
    // a request that did not come from a leader (a task writing to the
    // sidecar's socket) could have put it there.
    for (worker, seen) in &epochs.workers {
        if *seen > epochs.leader {
            c.fence_raised += 1;
            violation("fence-raised", worker, format!("epoch fence {seen} above the leader's epoch {}", epochs.leader));
        }
    }
    for (task, from, to) in resurrections {
        c.resurrected += 1;
        violation("resurrected", task, format!("went from {from} back to {to}"));
    }
    for p in procs {
        let status = by_id.get(p.task.as_str()).map(|f| f.status.as_str());
        if p.ppid == 1 {
            c.orphans += 1;
            violation("orphan", &p.task, format!("pid {} re-parented to PID 1", p.pid));
        } else if status.is_some_and(|s| TERMINAL.contains(&s)) {
            c.orphans += 1;
            violation("orphan", &p.task, format!("pid {} outlives its task ({})", p.pid, status.unwrap_or("?")));
        }
    }
    (c, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(label: &str, id: &str, idempotent: bool) -> Submitted {
        Submitted { label: label.into(), id: Some(id.into()), idempotent, hostile: false }
    }

    /// A run whose faults explain a few unknown tasks.
    fn context() -> Context {
        Context {
            epochs: Epochs::default(),
            explanations: Explanations { machine_faults: 2, wipes: 0, restarts: 0, slots: 4 },
        }
    }

    fn fin(id: &str, label: &str, status: &str) -> Final {
        let hint = (status == "unknown").then(|| "maybe-ran".to_string());
        Final {
            id: id.into(),
            label: label.into(),
            status: status.into(),
            hint,
            parent: None,
            idempotent: false,
            workflow: false,
            detail: None,
        }
    }

    #[test]
    fn workflow_steps_are_judged_like_tasks() {
        let submitted = vec![sub("w", "workflow-1", false)];
        let step = |id: &str, status: &str| Final { parent: Some("workflow-1".into()), ..fin(id, "step", status) };
        let clean = vec![
            Final { workflow: true, ..fin("workflow-1", "w", "completed") },
            step("shell-2", "completed"),
            step("shell-3", "completed"),
        ];
        let ledger = vec![("shell-2".into(), 1), ("shell-3".into(), 1)];
        let (_, v) = check(&submitted, &clean, &ledger, &[], &[], &context());
        assert!(v.is_empty(), "{v:?}");
        let twice = vec![("shell-2".into(), 1), ("shell-2".into(), 2), ("shell-3".into(), 1)];
        let (c, v) = check(&submitted, &clean, &twice, &[], &[], &context());
        assert_eq!(c.double_executed, 1, "{v:?}");
        let mut unfinished = clean.clone();
        unfinished[2].status = "failed".into();
        let (_, v) = check(&submitted, &unfinished, &ledger, &[], &[], &context());
        assert!(v.iter().any(|x| x.kind == "workflow"), "{v:?}");
    }

    #[test]
    fn a_clean_run_has_no_violation() {
        let submitted = vec![sub("a", "shell-1", false), sub("b", "shell-2", true), sub("c", "shell-3", false)];
        let finals =
            vec![fin("shell-1", "a", "completed"), fin("shell-2", "b", "completed"), fin("shell-3", "c", "unknown")];
        let ledger = vec![("shell-1".into(), 1), ("shell-2".into(), 1), ("shell-2".into(), 2), ("shell-3".into(), 1)];
        let (c, v) = check(&submitted, &finals, &ledger, &[], &[], &context());
        assert!(v.is_empty(), "{v:?}");
        assert_eq!((c.completed, c.unknown, c.double_executed), (2, 1, 0));
    }

    #[test]
    fn a_hostile_task_is_judged_like_any_other_and_counted() {
        let hostile = |id: &str, label: &str| Submitted { hostile: true, ..sub(label, id, false) };
        let submitted = vec![hostile("shell-1", "h1"), hostile("shell-2", "h2"), sub("a", "shell-3", false)];
        // One completed after its ledger line; one killed by another's `kill -9 -1`
        // before it: both truthful. The ordinary task was killed by it too.
        let by_kill = |f: Final| Final { detail: Some("signal 9".into()), ..f };
        let finals = vec![
            fin("shell-1", "h1", "completed"),
            by_kill(fin("shell-2", "h2", "failed")),
            by_kill(fin("shell-3", "a", "failed")),
        ];
        let ledger = vec![("shell-1".into(), 1), ("shell-3".into(), 1)];
        let context = Context { epochs: Epochs { leader: 3, workers: vec![("w1".into(), 3)] }, ..context() };
        let (c, v) = check(&submitted, &finals, &ledger, &[], &[], &context);
        assert!(v.is_empty(), "{v:?}");
        assert_eq!((c.hostile, c.failed, c.completed), (2, 2, 1));
        // A hostile task that ran twice is a double execution like any other.
        let twice = vec![("shell-1".into(), 1), ("shell-1".into(), 2)];
        let (_, v) = check(&submitted, &finals, &twice, &[], &[], &context);
        assert!(v.iter().any(|x| x.kind == "double-executed"), "{v:?}");
    }

    #[test]
    fn unknown_tasks_need_faults_on_machines_and_a_replaced_machine_needs_a_wipe() {
        let submitted = vec![sub("a", "shell-1", false), sub("b", "shell-2", false)];
        let finals = vec![fin("shell-1", "a", "unknown"), fin("shell-2", "b", "unknown")];
        let ledger = vec![("shell-1".into(), 1), ("shell-2".into(), 1)];
        let judged = |machine_faults, wipes, finals: &[Final]| {
            let explanations = Explanations { machine_faults, wipes, restarts: wipes, slots: 1 };
            let context = Context { epochs: Epochs::default(), explanations };
            check(&submitted, finals, &ledger, &[], &[], &context).1
        };
        assert!(judged(2, 0, &finals).is_empty());
        let v = judged(1, 0, &finals);
        assert!(v.iter().any(|x| x.kind == "unexplained-unknown"), "{v:?}");
        let v = judged(0, 0, &finals);
        assert!(v.iter().any(|x| x.kind == "unexplained-unknown"), "no fault on a machine, yet unknown: {v:?}");
        let replaced: Vec<Final> =
            finals.iter().map(|f| Final { hint: Some("machine-replaced".into()), ..f.clone() }).collect();
        assert!(judged(2, 1, &replaced).is_empty());
        let v = judged(2, 0, &replaced);
        assert!(v.iter().any(|x| x.kind == "untruthful-hint"), "{v:?}");
        let restarted: Vec<Final> =
            finals.iter().map(|f| Final { hint: Some("machine-restarted".into()), ..f.clone() }).collect();
        assert!(judged(2, 1, &restarted).is_empty());
        let v = judged(2, 0, &restarted);
        assert!(v.iter().any(|x| x.kind == "untruthful-hint"), "{v:?}");
    }

    #[test]
    fn every_planted_violation_is_caught() {
        let submitted = vec![
            sub("double", "shell-1", false),
            sub("lost", "shell-2", false),
            sub("stuck", "shell-3", false),
            sub("silent", "shell-4", false),
            sub("twin", "shell-5", false),
            sub("no-effect", "shell-7", false),
            sub("liar", "shell-8", false),
            sub("never-ran", "shell-10", false),
        ];
        let finals = vec![
            fin("shell-1", "double", "completed"),
            fin("shell-3", "stuck", "running"),
            Final { hint: None, ..fin("shell-4", "silent", "unknown") },
            fin("shell-9", "killed-one", "killed"),
            fin("shell-5", "twin", "completed"),
            fin("shell-6", "twin", "completed"),
            fin("shell-7", "no-effect", "completed"),
            fin("shell-8", "liar", "unknown"),
            Final { detail: Some("cannot create the input pipe".into()), ..fin("shell-10", "never-ran", "failed") },
        ];
        let ledger = vec![
            ("shell-1".into(), 1),
            ("shell-1".into(), 2),
            ("shell-77".into(), 1),
            ("shell-5".into(), 1),
            ("shell-6".into(), 1),
            ("shell-8".into(), 1),
            ("shell-8".into(), 2),
        ];
        let resurrections = vec![("shell-9".into(), "killed".into(), "running".into())];
        let procs =
            vec![Proc { pid: 5, ppid: 1, task: "shell-3".into() }, Proc { pid: 6, ppid: 9, task: "shell-9".into() }];
        let context = Context {
            epochs: Epochs { leader: 4, workers: vec![("w1".into(), 4), ("w2".into(), u64::MAX)] },
            // Two unknown tasks, one fault on a machine of one slot.
            explanations: Explanations { machine_faults: 1, wipes: 0, restarts: 0, slots: 1 },
        };
        let (c, v) = check(&submitted, &finals, &ledger, &resurrections, &procs, &context);
        let kinds: Vec<&str> = v.iter().map(|x| x.kind.as_str()).collect();
        for k in [
            "double-executed",
            "lost",
            "unsettled",
            "unknown-without-hint",
            "anonymous",
            "resurrected",
            "orphan",
            "fence-raised",
            "duplicate-task",
            "completed-without-effect",
            "untruthful-hint",
            "ended-without-start",
            "unexplained-unknown",
        ] {
            assert!(kinds.contains(&k), "{k} not caught: {kinds:?}");
        }
        assert_eq!((c.double_executed, c.anonymous, c.resurrected, c.orphans, c.fence_raised), (2, 1, 1, 2, 1));
    }
}
