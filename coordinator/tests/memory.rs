//! The coordinator core's heap per finished task, counted by a counting
//! allocator while the core runs many `noop` tasks from submit to a client's
//! wait, with no NATS and no clock. The bench (`tenure-bench --only scale`)
//! measures the whole process's RSS; this catches a record or an index that
//! grows without anyone noticing, deterministically.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tenure_coordinator::core::{Core, CoreConfig, Effect, Input, Now};
use tenure_protocol::messages::{ApiRequest, Heartbeat, Report, ReportEvent, SubmitRequest, WaitFor, WorkerCommand};
use tenure_protocol::{Ending, Epoch, Kind, Outcome, SessionId, TaskSpec, WorkerId};
use uuid::Uuid;

/// Bytes asked of the allocator and not yet given back (this test binary
/// runs one test, so nothing else moves it while it measures).
static LIVE: AtomicI64 = AtomicI64::new(0);

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Runs `n` noop tasks through `core`: submit, grant, finished, the owner's wait.
fn run(core: &mut Core, now: &mut Now, n: usize) {
    let session: SessionId = "bench-0123456789abcdef".parse().unwrap();
    let worker: WorkerId = "w1".parse().unwrap();
    let noop: Kind = "noop".parse().unwrap();
    for _ in 0..n {
        now.mono += Duration::from_millis(1);
        now.wall_ms += 1;
        let spec = TaskSpec { kind: noop.clone(), ..TaskSpec::shell("", "-") };
        let submit = SubmitRequest { session: session.clone(), idempotency_key: Uuid::new_v4(), spec };
        let request = ApiRequest::Submit(submit);
        let fx = core.handle(Input::Api { reply_to: Some("r".into()), request, trace: None }, *now);
        let grant = fx
            .into_iter()
            .find_map(|e| match e {
                Effect::Command { command: WorkerCommand::Grant(g), .. } => Some(g),
                _ => None,
            })
            .expect("a grant");
        let event = ReportEvent::Finished(Outcome::new(Ending::Completed, Some(0), None));
        let report = Report {
            worker: worker.clone(),
            task: grant.task.clone(),
            attempt: grant.attempt,
            epoch: grant.epoch,
            event,
        };
        core.handle(Input::Report { reply_to: Some("a".into()), report }, *now);
        let request =
            ApiRequest::Wait { session: session.clone(), task: grant.task, timeout_ms: 1000, until: WaitFor::End };
        core.handle(Input::Api { reply_to: Some("r".into()), request, trace: None }, *now);
        core.take_dispatch_latencies();
    }
}

#[test]
fn a_finished_noop_task_costs_the_core_little_heap() {
    let mut now = Now { mono: Duration::from_secs(100), wall_ms: 1_000_000 };
    let mut core = Core::new(CoreConfig::default(), Epoch(3), Vec::new(), now);
    let heartbeat = Heartbeat {
        boot: None,
        worker: "w1".parse().unwrap(),
        instance: Uuid::nil(),
        slots: 64,
        kinds: vec!["noop".parse().unwrap()],
        epoch_seen: Epoch(3),
        attempts: Vec::new(),
        sidecar: Default::default(),
        replaces: None,
        incarnation: Some(Uuid::from_u128(1)),
        mark: None,
        labels: Default::default(),
        enforces: Default::default(),
    };
    core.handle(Input::Heartbeat(heartbeat), now);
    run(&mut core, &mut now, 100);
    let before = LIVE.load(Ordering::Relaxed);
    let n = 20_000;
    run(&mut core, &mut now, n);
    let per_task = (LIVE.load(Ordering::Relaxed) - before) / n as i64;
    // 400 bytes of record, 1 of command, the number-keyed map and the
    // idempotency key (kept for ten minutes after the end): 502 when this
    // was first written; 606 with the record at 504 bytes (every rare spec
    // field is a boxed pointer: time limits, retries, delayed start,
    // placement, resources, resume). Not a cap on RSS: the allocator's own
    // overhead comes on top, under the 1 KiB per finished task of the
    // design's targets.
    assert!(per_task <= 640, "the core keeps {per_task} bytes per finished noop task");
}
