//! Secured transport, against a real nats-server started from the shipped
//! `deploy/nats/single.conf` (which includes `auth.conf`: one user per role,
//! per-role subject permissions): a whole cluster does its work with role
//! credentials and no permission violation, while a client credential cannot
//! command a worker, write the registry or delete a stream; invalid connection
//! options are refused at start, naming the flag.

mod common;

use std::time::Duration;

use common::{stderr, stdout, Cluster, BIN};
use futures::StreamExt;
use tenure_testkit::eventually;

const BOUND: Duration = Duration::from_secs(30);

/// The server's refusals (`-ERR`) seen by one connection.
struct Refusals(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Refusals {
    fn has(&self, needle: &str) -> bool {
        self.0.lock().expect("lock").iter().any(|e| e.contains(needle))
    }
}

/// Connects as `role` through the transport's options, recording server errors.
async fn connect_recording(c: &Cluster, role: &str) -> (async_nats::Client, Refusals) {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let client = tenure_transport::connect_options(&c.nats_options(role), &format!("test-{role}"), false)
        .await
        .expect("options")
        .event_callback(move |event| {
            let sink = sink.clone();
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    sink.lock().expect("lock").push(e.to_string());
                }
            }
        })
        .connect(c.nats.url.as_str())
        .await
        .expect("connect");
    (client, Refusals(seen))
}

#[test]
fn role_credentials_run_the_cluster_and_a_client_cannot_reach_workers_or_the_registry() {
    let mut c = Cluster::secured();
    c.spawn_coordinator("c1", &[]);
    c.start_worker("w1");
    c.wait_workers(1);

    // Every client path: submit, wait, get, logs (sidecar output), send (sidecar
    // input), watch (the notices stream), archive (a cleanup job to the sidecar), status.
    let task = c.submit(&["--", "echo secured-output"]);
    c.wait_status(&task, "completed", BOUND);
    // Before `logs`, which reports the task (watch shows unreported ends only).
    let watched = c.cli(&["watch", "--once"]);
    assert!(watched.status.success(), "watch: {}\n{}", stderr(&watched), c.logs());
    assert!(stdout(&watched).contains(&task), "watch showed {:?}\n{}", stdout(&watched), c.logs());
    let out = c.cli(&["logs", &task]);
    assert_eq!(stdout(&out), "secured-output\n", "{}", stderr(&out));
    let agent = c.submit(&["--kind", "agent", "--", "head -n 1"]);
    let sent = eventually(BOUND, || c.cli(&["send", &agent, "hello-agent"]).status.success().then_some(()));
    assert!(sent.is_some(), "send never succeeded\n{}", c.logs());
    c.wait_status(&agent, "completed", BOUND);
    assert_eq!(stdout(&c.cli(&["logs", &agent])), "hello-agent\n");
    let archived = c.cli(&["archive", &task]);
    assert!(archived.status.success(), "archive: {}", stderr(&archived));
    let released = eventually(BOUND, || c.snapshot(&task)["cleaned"].as_bool().filter(|b| *b).map(|_| ()));
    assert!(released.is_some(), "the cleanup job never landed: {}\n{}", c.snapshot(&task), c.logs());
    assert!(c.cli(&["status"]).status.success());

    // Nobody stepped outside its role's permissions while doing all that.
    let log = c.nats.nodes[0].log();
    assert!(!log.contains("Violation"), "a tenure process hit a permission violation:\n{log}");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let (client, refusals) = connect_recording(&c, "client").await;
        let (worker, worker_refusals) = connect_recording(&c, "worker").await;
        let (coordinator, coordinator_refusals) = connect_recording(&c, "coordinator").await;
        let mut commands = worker.subscribe("tenure.worker.*.cmd").await.expect("subscribe");
        worker.flush().await.expect("flush");

        // The client tries to command worker w1 and to overwrite a registry record.
        client.publish("tenure.worker.w1.cmd", "forged grant".into()).await.expect("publish");
        client.publish("tenure.registry.task.shell-1", "forged record".into()).await.expect("publish");
        client.flush().await.expect("flush");
        // A control message that is allowed, sent after both: the server handled
        // the client's messages first, so had they passed, one would arrive first.
        // Repeated until one arrives: async-nats' `flush` only flushes the
        // socket (it does not wait for the server's PONG), so the server may see
        // the first control before the subscription. Only the first message
        // delivered matters.
        let control = coordinator.clone();
        let repeat = tokio::spawn(async move {
            loop {
                let _ = control.publish("tenure.worker.w9.cmd", "control".into()).await;
                let _ = control.flush().await;
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
        });
        let first = tokio::time::timeout(BOUND, commands.next()).await.unwrap_or_else(|_| {
            panic!(
                "control not delivered; worker saw {:?}, coordinator saw {:?}, client saw {:?}\n{}",
                worker_refusals.0,
                coordinator_refusals.0,
                refusals.0,
                c.logs()
            )
        });
        repeat.abort();
        let first = first.expect("message");
        assert_eq!(first.subject.as_str(), "tenure.worker.w9.cmd", "a client reached a worker subject");

        // Waited for asynchronously: the client's event callback runs on this
        // runtime, so a blocking wait here would starve it.
        let reported = tokio::time::timeout(BOUND, async {
            while !(refusals.has("tenure.worker.w1.cmd") && refusals.has("tenure.registry.task.shell-1")) {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(reported.is_ok(), "no permission violation reported to the client: {:?}", refusals.0);
        assert!(refusals.has("Permissions Violation"), "{:?}", refusals.0);

        // The registry record is the coordinator's, not the forgery.
        let js = async_nats::jetstream::new(coordinator.clone());
        let registry = js.get_stream("TENURE_REGISTRY").await.expect("registry stream");
        let last = registry.get_last_raw_message_by_subject("tenure.registry.task.shell-1").await.expect("record");
        assert_ne!(&last.payload[..], b"forged record");

        // Nor can a client delete a stream.
        let client_js = async_nats::jetstream::new(client.clone());
        assert!(client_js.delete_stream("TENURE_REGISTRY").await.is_err());
        assert!(js.get_stream("TENURE_REGISTRY").await.is_ok(), "the registry stream is gone");
    });
    let log = c.nats.nodes[0].log();
    assert!(log.contains("Violation"), "the server did not log the refused publishes:\n{log}");
    c.wait_status(&task, "completed", BOUND);
}

#[test]
fn wrong_or_incomplete_nats_options_fail_at_start_naming_the_flag() {
    let c = Cluster::secured();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        std::process::Command::new(BIN)
            .args(["--nats", &c.nats.url])
            .args(args)
            .env_remove("TENURE_NATS_USER")
            .env_remove("TENURE_NATS_PASSWORD")
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run tenure")
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pem = dir.path().join("client.pem");
    std::fs::write(&pem, "-----BEGIN CERTIFICATE-----\n").expect("write");
    let pem = pem.display().to_string();
    let absent = dir.path().join("absent").display().to_string();
    /// Arguments, environment, what the error must name.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (vec!["--nats-tls-cert", &pem, "status"], vec![], "--nats-tls-key"),
        (vec!["--nats-tls-ca", &absent, "status"], vec![], "--nats-tls-ca"),
        (vec!["--nats-creds", &absent, "sidecar", "--worker", "w1", "--data-dir", &absent], vec![], "--nats-creds"),
        (vec!["--nats-user", "tenure-client", "status"], vec![], "--nats-password"),
        (
            vec!["--nats-user", "tenure-client", "status"],
            vec![("TENURE_NATS_PASSWORD", "x"), ("TENURE_NATS_TOKEN", "t")],
            "one kind of NATS credentials",
        ),
        (vec!["--nats", "nats://127.0.0.1:1,", "status"], vec![], "--nats"),
    ];
    for (args, env, expected) in cases {
        let out = run(&args, &env);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr(&out).contains(expected), "{args:?}: {:?} should name {expected}", stderr(&out));
    }
    // Good options but a wrong password: refused by the server, said plainly.
    let out = run(&["status"], &[("TENURE_NATS_USER", "tenure-client"), ("TENURE_NATS_PASSWORD", "wrong")]);
    assert!(!out.status.success());
    assert!(stderr(&out).to_lowercase().contains("authorization"), "{}", stderr(&out));
    // No credentials at all: refused too.
    let out = run(&["status"], &[]);
    assert!(!out.status.success());
}
