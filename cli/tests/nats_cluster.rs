//! The production shape, tried: a 3-node NATS JetStream cluster started from the
//! shipped `deploy/nats/cluster-{1,2,3}.conf` (ports moved to free loopback
//! ones, users and permissions of `auth.conf`), two coordinators with
//! `--replicas 3` and two workers with their sidecars, every process given all
//! three URLs. Losing the NATS node that leads the registry and the leader
//! coordinator at once loses no task and runs none twice.

mod common;

use std::time::Duration;

use common::{deploy_config, Cluster, Creds};
use tenure_testkit::{eventually, NatsCluster};

const BOUND: Duration = Duration::from_secs(45);
const TASKS: usize = 10;
/// Lease timings between the failover tests' fast ones and the defaults: a
/// replicated bucket needs a moment to elect a new leader after a node loss.
const LEASE: [&str; 6] = ["--lease-ttl-ms", "3000", "--renew-interval-ms", "600", "--renew-deadline-ms", "1800"];

/// (configured replicas, cluster leader, live replicas besides the leader) of a stream.
async fn replication(js: &async_nats::jetstream::Context, stream: &str) -> Option<(usize, String, usize)> {
    let mut s = js.get_stream(stream).await.ok()?;
    let info = s.info().await.ok()?;
    let cluster = info.cluster.clone()?;
    let current = cluster.replicas.iter().filter(|r| r.current && !r.offline).count();
    Some((info.config.num_replicas, cluster.leader.unwrap_or_default(), current))
}

#[test]
fn three_node_nats_loses_a_node_and_the_leader_coordinator_without_losing_or_repeating_a_task() {
    let auth = Creds::generate();
    let configs: Vec<_> = (1..=3).map(|i| deploy_config(&format!("cluster-{i}.conf"))).collect();
    let nats = NatsCluster::start_from_configs(&configs, auth.dir.path(), &[]).expect("3-node NATS cluster");
    assert_eq!(nats.url.split(',').count(), 3);
    let mut c = Cluster::on(nats, Some(auth));
    let mut flags = vec!["--replicas", "3"];
    flags.extend_from_slice(&LEASE);
    c.spawn_coordinator("c1", &flags);
    c.wait_leader("c1");
    c.spawn_coordinator("c2", &flags);
    c.start_worker("w1");
    c.start_worker("w2");
    c.wait_workers(2);

    // Every tenure stream and bucket is replicated on all three nodes.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let registry_leader = rt.block_on(async {
        let client = tenure_transport::connect(&c.nats_options("coordinator-c1"), "tenure-test", false)
            .await
            .expect("connect as coordinator");
        let js = async_nats::jetstream::new(client);
        let mut leader = String::new();
        for stream in ["TENURE_REGISTRY", "TENURE_NOTICES", "KV_tenure_leader"] {
            let deadline = tokio::time::Instant::now() + BOUND;
            let (replicas, stream_leader, current) = loop {
                let r = replication(&js, stream).await;
                // Followers catch up right after creation: wait (bounded) for both.
                match r {
                    Some(r) if r.2 == 2 || tokio::time::Instant::now() > deadline => break r,
                    None if tokio::time::Instant::now() > deadline => {
                        panic!("{stream} has no cluster info\n{}", c.logs())
                    }
                    _ => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            };
            assert_eq!(replicas, 3, "{stream} is not R3");
            assert_eq!(current, 2, "{stream}: both followers should be current");
            if stream == "TENURE_REGISTRY" {
                leader = stream_leader;
            }
        }
        leader
    });

    let ledger = c.dir.path().join("ledger");
    let tasks: Vec<String> =
        (0..TASKS).map(|i| c.submit(&["--", &format!("sleep 2; echo run-{i} >> {}", ledger.display())])).collect();
    let running = eventually(BOUND, || {
        let n = tasks.iter().filter(|t| c.try_snapshot(t).is_some_and(|s| s["status"] == "running")).count();
        (n >= 4).then_some(())
    });
    assert!(running.is_some(), "tasks never ran\n{}", c.logs());

    // Kill the NATS node leading the registry stream, then the leader coordinator.
    let node: usize = registry_leader
        .strip_prefix("tenure-nats-")
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("unexpected registry leader {registry_leader:?}"));
    c.nats.nodes[node - 1].kill9();
    c.kill9("coordinator-c1");
    c.wait_leader("c2");

    for t in &tasks {
        let s = c.wait_status(t, "completed", BOUND);
        assert_eq!(s["exit_code"], 0, "{t}: {s}");
    }
    let text = std::fs::read_to_string(&ledger).expect("ledger");
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort_unstable();
    let mut expected: Vec<String> = (0..TASKS).map(|i| format!("run-{i}")).collect();
    expected.sort_unstable();
    assert_eq!(lines, expected, "every task ran exactly once\n{}", c.logs());
}
