//! Seeded deterministic simulation of the cluster (the "also deterministic"
//! half of the chaos suite): the real coordinator `Core` and the real sidecar
//! `Machine`, a model of the worker protocol, and an in-memory bus with a
//! manual clock; thousands of fault schedules, each judged against the safety
//! rules (listed in `simulation/check.rs`) at every step and once the healed
//! cluster is quiet.
//!
//! Environment:
//!
//! - `TENURE_SIM_SEEDS=N` runs N schedules instead of the default;
//!   `TENURE_SIM_SEED=S` runs one.
//! - `TENURE_SIM_OPTS=a,b,…` changes the options: `no-fifo` (reorder messages within a link too), `quiet-zombies`
//!   (deposed leaders still acting hear only heartbeats, not reports and API
//!   requests), `long-zombies` (they act up to 80 ticks past their renew
//!   deadline).
//! - `TENURE_SIM_TRACE_LINES=N`: how much of a failing schedule's trace to print.
//!
//! A failure prints its seed, the broken rule and the end of the schedule's
//! trace, one line per event (the seed replayed with the trace on).
//!
//! Defects it found in production code, now fixed, each kept as a regression
//! test with the seeds that showed it: A and C (a non-idempotent task ran
//! twice) and D (a task stuck `running` when a subject's messages are
//! reordered). Deposed
//! leaders that still act can answer client requests from a stale view (a
//! `NotFound` for a task created after them): counted as `stale_answers`.

#[path = "simulation/mod.rs"]
mod sim;

use std::time::Instant;

use sim::{Bug, Options};

const DEFAULT_SEEDS: u64 = 2000;
const FIRST_SEED: u64 = 0x7e5e_0000;
/// How many trace lines a failure prints (the end of the schedule).
const TRACE_TAIL: usize = 600;

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("TENURE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![seed];
    }
    let n = std::env::var("TENURE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SEEDS);
    (0..n).map(|i| FIRST_SEED + i).collect()
}

/// The default options, changed by `TENURE_SIM_OPTS`.
fn options() -> Options {
    let mut opts = Options::default();
    for word in std::env::var("TENURE_SIM_OPTS").unwrap_or_default().split(',').filter(|w| !w.is_empty()) {
        match word {
            "no-fifo" => opts.fifo_links = false,
            "quiet-zombies" => opts.zombie_answers = false,
            "long-zombies" => opts.zombie_max = 80,
            other => panic!("unknown TENURE_SIM_OPTS word {other:?}"),
        }
    }
    opts
}

#[derive(Debug, Default)]
struct Summary {
    schedules: usize,
    ticks: u64,
    tasks: usize,
    starts: usize,
    takeovers: u64,
    stale_answers: usize,
    by_status: std::collections::BTreeMap<String, usize>,
    retries: usize,
    /// Ends appended as records that may share a registry message.
    shared_ends: usize,
    elapsed_ms: u128,
}

/// Runs `seeds` on two threads; returns the failed schedules and a summary.
fn run_all(seeds: &[u64], opts: &Options) -> (Vec<sim::Outcome>, Summary) {
    let started = Instant::now();
    let halves: Vec<&[u64]> = seeds.chunks(seeds.len().div_ceil(2).max(1)).collect();
    let results: Vec<Vec<sim::Outcome>> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            halves.iter().map(|part| scope.spawn(move || part.iter().map(|s| sim::run(*s, opts)).collect())).collect();
        handles.into_iter().map(|h| h.join().expect("a simulation thread panicked")).collect()
    });
    let mut summary = Summary::default();
    let mut failures = Vec::new();
    for o in results.into_iter().flatten() {
        summary.schedules += 1;
        summary.ticks += o.ticks;
        summary.tasks += o.tasks;
        summary.starts += o.starts;
        summary.takeovers += o.takeovers;
        summary.stale_answers += o.stale_answers;
        summary.retries += o.retries;
        summary.shared_ends += o.shared_ends;
        for (status, n) in &o.by_status {
            *summary.by_status.entry(status.to_string()).or_default() += n;
        }
        if o.failure.is_some() {
            failures.push(o);
        }
    }
    summary.elapsed_ms = started.elapsed().as_millis();
    (failures, summary)
}

/// Replays a failing seed with the trace on and renders it.
fn explain(failure: &sim::Outcome, opts: &Options) -> String {
    let replay = sim::run(failure.seed, &Options { trace: true, ..opts.clone() });
    let same = replay.failure == failure.failure;
    let tail = std::env::var("TENURE_SIM_TRACE_LINES").ok().and_then(|s| s.parse().ok()).unwrap_or(TRACE_TAIL);
    let skip = replay.trace.len().saturating_sub(tail);
    format!(
        "seed {} failed: {}\n(replay {}; rerun with TENURE_SIM_SEED={})\n--- trace (last {} of {} lines) ---\n{}",
        failure.seed,
        failure.failure.as_deref().unwrap_or_default(),
        if same { "reproduced it" } else { "DID NOT reproduce it: the simulation is not deterministic" },
        failure.seed,
        replay.trace.len() - skip,
        replay.trace.len(),
        replay.trace[skip..].join("\n"),
    )
}

/// Runs the seeds and fails with the first failure's explanation.
fn assert_all_pass(seeds: &[u64], opts: &Options) -> Summary {
    let (failures, summary) = run_all(seeds, opts);
    eprintln!("{summary:?}");
    if let Some(first) = failures.first() {
        let seeds: Vec<u64> = failures.iter().map(|f| f.seed).collect();
        let (n, of) = (failures.len(), summary.schedules);
        panic!("{n} of {of} schedules failed (seeds {seeds:?})\n{}", explain(first, opts));
    }
    assert!(summary.starts > summary.schedules, "the schedules hardly ran anything: {summary:?}");
    // Over many schedules (a few pinned seeds need not retry at all).
    let many = summary.schedules >= 20;
    assert!(!many || summary.retries > summary.schedules / 10, "the schedules hardly retried anything: {summary:?}");
    summary
}

#[test]
fn seeded_schedules_keep_the_safety_rules() {
    let summary = assert_all_pass(&seeds(), &options());
    // Some ends shared a registry message (rule 14 judged them).
    assert!(summary.shared_ends > 0, "no end shared a registry message: {summary:?}");
}

/// The same with the client pausing and resuming tasks at random: a pause
/// changes no outcome, starts nothing and settles nothing by itself.
#[test]
fn seeded_schedules_with_pauses_keep_the_safety_rules() {
    let n = seeds().len().min(500);
    assert_all_pass(&seeds()[..n], &Options { pauses: true, ..options() });
    // The schedules did carry pauses and resumes to workers.
    let traced = Options { pauses: true, trace: true, ..Options::default() };
    let carried = |wish: &str| {
        (0..50).any(|i| sim::run(FIRST_SEED + i, &traced).trace.iter().any(|l| l.contains(&format!("pause={wish}"))))
    };
    assert!(carried("true") && carried("false"), "no pause or resume reached a worker");
}

/// The same with a fifth of the tasks submitted held and approved at random
/// times (each retried until answered, through faults): no held task starts
/// before it was asked to be approved, and every one settles.
#[test]
fn seeded_schedules_with_approvals_keep_the_safety_rules() {
    let n = seeds().len().min(500);
    let opts = Options { approvals: true, ..options() };
    assert_all_pass(&seeds()[..n], &opts);
    // The schedules did hold tasks and approve them.
    let traced = Options { trace: true, ..opts };
    let approved = (0..50).any(|i| {
        let run = sim::run(FIRST_SEED + i, &traced);
        run.trace.iter().any(|l| l.contains("held=true")) && run.trace.iter().any(|l| l.contains("approval of task"))
    });
    assert!(approved, "no schedule held and approved a task");
}

/// The same with half the non-idempotent tasks `agent` tasks that declare a
/// resume command: a lost attempt is resumed only on proof that its process
/// is gone, so no such task ever runs two attempts at once (rule 13), and
/// every one settles.
#[test]
fn seeded_schedules_with_resumes_keep_the_safety_rules() {
    let n = seeds().len().min(500);
    let opts = Options { resumes: true, ..options() };
    assert_all_pass(&seeds()[..n], &opts);
    // The schedules did resume tasks.
    let resumed: usize = (0..100).map(|i| sim::run(FIRST_SEED + i, &opts).resumes).sum();
    assert!(resumed > 0, "no schedule resumed a task");
    eprintln!("{resumed} resumes in the first 100 schedules");
}

#[test]
fn a_seed_replays_exactly() {
    let opts = Options { trace: true, ..Options::default() };
    let (a, b) = (sim::run(FIRST_SEED + 7, &opts), sim::run(FIRST_SEED + 7, &opts));
    assert!(a.trace.len() > 100, "a schedule does something: {} events", a.trace.len());
    assert_eq!(a.trace, b.trace);
}

/// The checker must be able to fail: each planted defect is caught, as the
/// rule it breaks, within a few hundred schedules.
#[test]
fn the_checker_catches_planted_bugs() {
    for (bug, rule) in [
        (Bug::SkipIntent, "rule 1:"),
        (Bug::UnfencedRegistry, "rule 2:"),
        (Bug::ResumeUnproven, "rule 13:"),
        (Bug::ShareEveryGrant, "rule 14:"),
        (Bug::ShareEveryEnd, "rule 14:"),
    ] {
        let opts = Options { bug, resumes: bug == Bug::ResumeUnproven, ..Options::default() };
        let caught = (0..400).map(|i| sim::run(0xb0_0000 + i, &opts)).find_map(|o| {
            let failure = o.failure?;
            failure.starts_with(rule).then_some((o.seed, failure))
        });
        let Some((seed, failure)) = caught else { panic!("{bug:?} was never caught as {rule}") };
        eprintln!("{bug:?} caught by seed {seed}: {failure}");
    }
}

// ------------------------------------------- defects found, now fixed

/// Defect A — a re-sent grant ran a finished attempt again. While no `Started` report has come in, the
/// leader re-sends a `leased` task's grant; a copy processed by the worker
/// after the attempt is over and forgotten (its outcome acknowledged, or
/// reported `Lost`) is accepted by the sidecar — `Machine::accept` is `Ok` for
/// a repeated grant in any phase and `Machine::intent` is `Ok` on a record past
/// `Intent` — and the non-idempotent task ran a second time. Seed 2120089680
/// needs no crash at all: one lost `Started` report, a re-sent grant processed
/// two ticks later, after the `Finished` ack. About one schedule in 20 showed
/// it. Fixed: the sidecar refuses a copy of a grant past its intent and the
/// worker answers it `Accepted` without starting anything.
#[test]
fn defect_a_a_late_grant_reruns_a_finished_attempt() {
    let opts = Options::default();
    assert_all_pass(&[2120089680, 2120089601], &opts);
    assert_all_pass(&(0..400).map(|i| FIRST_SEED + i).collect::<Vec<_>>(), &opts);
}

/// Defect C — a refusal of a late copy of a grant requeued a task whose
/// attempt ran. `Core::command_result` turned
/// any refused grant into `Event::Refused` ("nothing ran"), and the lifecycle
/// table applies it to an `unknown` task (queued again; with a kill pending,
/// `stopping` and `unknown` become `killed`). Seed 2120121803: attempt 1 runs,
/// its monitor is killed, the worker reports `Lost` (task `unknown`,
/// maybe-ran) and forgets it; a late copy of the grant then meets the sidecar
/// down and is refused `SidecarUnavailable`; the task is queued and runs again.
/// About one schedule in 20 000 showed it. Fixed: a grant refusal counts only
/// while the task is still `leased` with that attempt and never reported started.
/// These seeds may stop reaching the case as the harness changes; the core
/// test `a_refused_late_grant_leaves_an_unknown_task_unknown` pins it without one.
#[test]
fn defect_c_a_refused_late_grant_requeues_a_task_that_ran() {
    let opts = Options::default();
    assert_all_pass(&[2120121803, 2120129053], &opts);
}

/// Defect D — a late `Started` report revives a task its worker already
/// reported `Lost`: the lifecycle table moves `unknown` back to `running` on
/// `Started` for the current attempt, and nothing settles it again (the
/// worker no longer holds the attempt and keeps heartbeating). NATS keeps one
/// connection's reports in order, so this needs reordering within a subject
/// (`fifo_links: false`); it shows the table leans on transport order.
/// Seed 2120090105. Fixed: after `Lost`, a start report no longer revives the
/// task (only an `unknown` of an unreachable machine returns to `running`).
#[test]
fn defect_d_a_late_started_report_revives_a_lost_attempt() {
    let opts = Options { fifo_links: false, ..Options::default() };
    assert_all_pass(&[2120090105, 2120089907], &opts);
}

/// Defect E — a wiped machine ran a task again. Seed 2120089697: a grant sent
/// before the wipe reached the new store late and was accepted (the worker
/// model answered commands for any process of its id; on NATS they go to the
/// bound process's own subject). Seed 2120089950: after the wipe the leader
/// re-sent a grant to the new worker process while its store was still
/// unknown (it kept the old process's incarnation), the new process refused
/// it with its sidecar down, and the task was queued again although the old
/// store had run it. Fixed: a grant is re-sent only to the store it was
/// granted to, as the bound process's latest heartbeat names it, and new work
/// goes only to processes whose store the leader knows.
#[test]
fn defect_e_a_wiped_machine_runs_a_task_again() {
    assert_all_pass(&[2120089697, 2120089950, 2120090606], &Options::default());
}
