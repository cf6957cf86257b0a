//! nats-server's JetStream store on a power-loss filesystem with ext4-like
//! metadata journaling and `sync_interval: always`: a power cut taken soon
//! (0–1 s) after a restart of the server keeps every acknowledged append.
//!
//! The chaos harness's NATS node sees exactly this sequence: a `nats-restart`
//! (SIGKILL, started again on its store at once) or a stop for a registry
//! copy (SIGTERM), the load going on, and a `power-loss` of the node moments
//! later. A process kill leaves the server's unsynced writes in the
//! filesystem's volatile layer, where a later cut drops them; so if the
//! server, after restarting, rebuilt or rewrote its message blocks or index
//! files without syncing them, acknowledged appends made before the restart
//! would be lost at the cut. This test pins that it does not.
//!
//! The stream is shaped like the registry: one message per subject
//! (updating a subject deletes its previous message), discard-new limits, a
//! short duplicate window, every append conditional on the stream's last
//! sequence (`Nats-Expected-Last-Sequence`) and each round a mix of new
//! subjects and updates of old ones.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use tenure_powerfs::{CutOptions, Mounted, Options, PowerFs};
use tenure_testkit::NatsServer;

/// What the client was told was stored: per subject its last acknowledged
/// append (sequence and payload), and the highest acknowledged sequence.
#[derive(Default, Clone)]
struct Acked {
    last: BTreeMap<String, (u64, String)>,
    max_seq: u64,
    count: u64,
}

/// A journaled power-loss mount in a directory of its own.
struct Power {
    mounted: Option<Mounted>,
    backing: PathBuf,
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

const JOURNALED: Options = Options { journaled_metadata: true };

impl Power {
    fn mount() -> Power {
        let dir = tempfile::tempdir().expect("tempdir");
        let (backing, mnt) = (dir.path().join("backing"), dir.path().join("mnt"));
        let mounted = PowerFs::mount(&backing, &mnt, JOURNALED).expect("mount the power-loss filesystem");
        Power { mounted: Some(mounted), backing, mnt, _dir: dir }
    }

    /// Cuts the power (everything not synced is gone) and boots again.
    fn cut(&mut self) {
        let mounted = self.mounted.take().expect("mounted");
        mounted.cut(CutOptions::default()).expect("cut");
        self.mounted = Some(PowerFs::mount(&self.backing, &self.mnt, JOURNALED).expect("remount after the cut"));
    }
}

/// How the server is stopped before it is started again on its store.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// SIGKILL: the chaos harness's `nats-restart` and `kill-nats`.
    Kill,
    /// SIGTERM, waiting for the exit: the harness's stop for a registry copy.
    Term,
}

/// SIGTERMs the server and waits until it exited (a zombie: the kit reaps it).
fn terminate(nats: &NatsServer) {
    let pid = nats.pid() as i32;
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.rsplit_once(')').is_none_or(|(_, rest)| rest.trim_start().starts_with('Z')) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("nats-server did not exit on SIGTERM");
}

/// The load: registry-like appends, one at a time, each expecting the last
/// sequence the writer knows; after an error (the server restarting or cut)
/// the writer reads the stream's last sequence again and goes on from there
/// (an append whose acknowledgement was lost is not counted as acknowledged).
async fn load(js: jetstream::Context, acked: Arc<Mutex<Acked>>, stop: Arc<std::sync::atomic::AtomicBool>) {
    let mut expected = acked.lock().unwrap().max_seq;
    let mut n = 0u64;
    let mut subjects = acked.lock().unwrap().last.len() as u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        n += 1;
        // Two of three appends update an existing subject (a task's new
        // state), one names a new one (a new task).
        let subject = if subjects == 0 || n.is_multiple_of(3) {
            subjects += 1;
            format!("reg.t{subjects}")
        } else {
            format!("reg.t{}", 1 + (n * 7919) % subjects)
        };
        let payload = format!("{subject}@{expected}+{n}:{}", "x".repeat(200));
        let publish = jetstream::message::PublishMessage::build()
            .payload(payload.clone().into())
            .expected_last_sequence(expected);
        let sent = tokio::time::timeout(Duration::from_secs(2), async {
            js.send_publish(subject.clone(), publish).await?.await.map_err(anyhow::Error::from)
        })
        .await;
        match sent {
            Ok(Ok(ack)) => {
                let mut a = acked.lock().unwrap();
                a.last.insert(subject, (ack.sequence, payload));
                a.max_seq = a.max_seq.max(ack.sequence);
                a.count += 1;
                expected = ack.sequence;
            }
            _ => {
                tokio::time::sleep(Duration::from_millis(30)).await;
                if let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_secs(2), js.get_stream("REG")).await {
                    if let Ok(Ok(info)) = tokio::time::timeout(Duration::from_secs(2), s.info()).await {
                        expected = info.state.last_sequence;
                    }
                }
            }
        }
    }
}

/// Every acknowledged append is there: the stream reaches the highest
/// acknowledged sequence, and each subject's last message is its last
/// acknowledged append (or a later, unacknowledged one).
async fn check(js: &jetstream::Context, acked: &Acked, round: usize, nats: &NatsServer) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        if let Ok(Ok(mut s)) = tokio::time::timeout(Duration::from_secs(2), js.get_stream("REG")).await {
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), s.info()).await {
                break s;
            }
        }
        assert!(Instant::now() < deadline, "round {round}: the stream is not back:\n{}", nats.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let last = s.info().await.expect("stream info").state.last_sequence;
    let mut lost = Vec::new();
    for (subject, (seq, payload)) in &acked.last {
        match s.get_last_raw_message_by_subject(subject).await {
            Ok(m) if m.sequence > *seq => {}
            Ok(m) if m.sequence == *seq && m.payload.as_ref() == payload.as_bytes() => {}
            Ok(m) => lost.push(format!("{subject}: acknowledged at {seq}, found at {}", m.sequence)),
            Err(e) => lost.push(format!("{subject}: acknowledged at {seq}, found none ({e})")),
        }
    }
    assert!(
        last >= acked.max_seq && lost.is_empty(),
        "round {round}: acknowledged appends lost (stream last sequence {last}, highest acknowledged {}; {} of {} \
         subjects behind: {:?}):\n{}",
        acked.max_seq,
        lost.len(),
        acked.last.len(),
        &lost[..lost.len().min(10)],
        nats.log()
    );
}

/// Rounds of: load for a while; the server stopped (SIGKILL or SIGTERM, once
/// or twice 300 ms apart) in the middle of it and started again on its
/// store; the load goes on; after 0–1 s the server is SIGKILLed and the
/// power cut; the server
/// starts on what the disk kept, and every acknowledged append must be there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_keeps_acknowledged_appends_through_a_power_cut_soon_after_a_restart() {
    let mut power = Power::mount();
    let jetstream_dir = power.mnt.join("jetstream");
    let mut nats = NatsServer::start_with_jetstream(&jetstream_dir, true).expect("nats-server on the mount");
    let client =
        async_nats::ConnectOptions::new().retry_on_initial_connect().connect(nats.url.clone()).await.expect("connect");
    let js = jetstream::new(client);
    js.get_or_create_stream(stream::Config {
        name: "REG".into(),
        subjects: vec!["reg.>".into()],
        max_messages_per_subject: 1,
        storage: stream::StorageType::File,
        discard: stream::DiscardPolicy::New,
        max_bytes: 64 << 20,
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await
    .expect("create the stream");

    let acked = Arc::new(Mutex::new(Acked::default()));
    // Delays from the restart to the cut; 360 ms is the chaos run's.
    let delays = [0u64, 360, 120, 800, 40, 600, 250, 1000, 360, 500];
    for (round, delay) in delays.into_iter().enumerate() {
        // One restart or two: a SIGTERM writes the server's stream state
        // (`index.db`) without syncing it, so a cut after it leaves that file
        // empty; a SIGKILL after it leaves it stale (the process kill keeps
        // its content), and the next start rebuilds the state from the blocks.
        let stops: &[Stop] = match round % 4 {
            0 => &[Stop::Kill],
            1 => &[Stop::Term],
            2 => &[Stop::Term, Stop::Kill],
            _ => &[Stop::Kill, Stop::Term],
        };
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = tokio::spawn(load(js.clone(), acked.clone(), stop.clone()));
        tokio::time::sleep(Duration::from_millis(400 + 60 * round as u64)).await;
        // The restarts, in the middle of the load.
        for (i, stop_how) in stops.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            match stop_how {
                Stop::Kill => nats.kill9(),
                Stop::Term => terminate(&nats),
            }
            nats.restart().expect("restart nats-server");
        }
        tokio::time::sleep(Duration::from_millis(delay)).await;
        // The power cut: the server dies with the machine.
        nats.kill9();
        let before = acked.lock().unwrap().count;
        power.cut();
        nats.restart().expect("start nats-server after the cut");
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(10), writer).await;
        let a = acked.lock().unwrap().clone();
        eprintln!(
            "round {round}: {stops:?}, cut {delay} ms after the last restart; {} appends acknowledged ({before} before \
             the cut), highest sequence {}, {} subjects",
            a.count,
            a.max_seq,
            a.last.len()
        );
        check(&js, &a, round, &nats).await;
    }
    let total = acked.lock().unwrap().count;
    assert!(total >= 200, "too little load to judge: {total} appends acknowledged");
    // What the server did at its starts (it rebuilds its stream state from
    // the blocks when its index is stale, as after a kill or a cut).
    let log = nats.log();
    let mut warnings = BTreeMap::<&str, usize>::new();
    for line in log.lines().filter_map(|l| l.split_once("[WRN] ").map(|(_, w)| w)) {
        *warnings.entry(line).or_default() += 1;
    }
    eprintln!(
        "{total} appends acknowledged; nats-server started {} times; its warnings: {warnings:#?}",
        log.matches("Starting nats-server").count()
    );
    nats.kill9();
}
