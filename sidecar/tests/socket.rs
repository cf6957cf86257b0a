//! The socket survives bad input: a malformed request is refused and the
//! connection goes on; an oversized frame closes only that connection. The
//! socket serves the worker even when NATS is unreachable.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{Running, BOUND};
use tenure_machine::SidecarClient;
use tenure_protocol::messages::{SidecarRefusal, SidecarReply, SidecarRequest};
use tenure_protocol::{decode, encode};
use tenure_testkit::{free_port, NatsServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

async fn send_frame(stream: &mut UnixStream, body: &[u8]) -> anyhow::Result<()> {
    stream.write_all(&(body.len() as u32).to_be_bytes()).await?;
    stream.write_all(body).await?;
    Ok(())
}

async fn read_reply(stream: &mut UnixStream) -> anyhow::Result<SidecarReply> {
    let read = async {
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await?;
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        stream.read_exact(&mut body).await?;
        anyhow::Ok(decode::<SidecarReply>(&body)?)
    };
    tokio::time::timeout(BOUND, read).await?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_refused_and_the_connection_goes_on() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    let socket = sidecar.layout.socket_path();
    assert_eq!(std::fs::metadata(&socket)?.permissions().mode() & 0o777, 0o600);

    let mut stream = UnixStream::connect(&socket).await?;
    for garbage in [&b"\x01\x02\x03\x04\x05"[..], b"", b"\x01\xc1", b"\x09\x80"] {
        send_frame(&mut stream, garbage).await?;
        let reply = read_reply(&mut stream).await?;
        assert!(matches!(reply, SidecarReply::Refused(SidecarRefusal::Malformed(_))), "{garbage:?}: {reply:?}");
    }
    send_frame(&mut stream, &encode(&SidecarRequest::List)?).await?;
    assert!(matches!(read_reply(&mut stream).await?, SidecarReply::Records { .. }));

    // An oversized length closes that connection, and only that one.
    let mut big = UnixStream::connect(&socket).await?;
    big.write_all(&u32::MAX.to_be_bytes()).await?;
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(BOUND, big.read(&mut buf)).await??;
    assert_eq!(n, 0, "the connection should be closed");

    // A connection dropped mid-frame harms nobody.
    let mut partial = UnixStream::connect(&socket).await?;
    partial.write_all(&[0, 0, 0, 50, 1, 2]).await?;
    drop(partial);

    send_frame(&mut stream, &encode(&SidecarRequest::List)?).await?;
    assert!(matches!(read_reply(&mut stream).await?, SidecarReply::Records { .. }));
    let client = SidecarClient::new(&socket);
    assert!(matches!(client.call(&SidecarRequest::List).await?, SidecarReply::Records { .. }));
    sidecar.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_serves_while_nats_is_down() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Nothing listens on this port.
    let url = format!("nats://127.0.0.1:{}", free_port());
    let sidecar = Running::start(dir.path(), "w1", &url).await?;
    let client = SidecarClient::new(sidecar.layout.socket_path());
    common::ok(&client, SidecarRequest::Accept(common::grant("shell-1", 1, 1, "alice"))).await;
    assert!(matches!(client.call(&SidecarRequest::List).await?, SidecarReply::Records { .. }));
    sidecar.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_socket_file_is_replaced_and_a_foreign_file_is_not() -> anyhow::Result<()> {
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("sidecar.sock");
    // A socket nobody listens on, as left by a crashed sidecar.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    sidecar.stop().await?;

    std::fs::write(&socket, b"not a socket")?;
    let error = format!("{:#}", Running::start(dir.path(), "w1", &nats.url).await.err().expect("started"));
    assert!(error.contains("not a socket"), "{error}");
    assert_eq!(std::fs::read(&socket)?, b"not a socket");
    Ok(())
}

/// Connects to the socket from a separate process — optionally after taking
/// the worker's lock as that process — sends a well-formed `List` and says
/// what came back: `ANSWERED` or `CLOSED`.
fn peer_process(python: &str, socket: &std::path::Path, lock: Option<&std::path::Path>) -> String {
    let script = r#"
import fcntl, os, socket, sys
lock = os.environ.get("LOCK")
if lock:
    f = open(lock, "a+")
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["SOCK"])
s.settimeout(10)
try:
    s.sendall(bytes.fromhex(os.environ["FRAME"]))
    got = s.recv(64)
except OSError:
    got = b""
print("ANSWERED" if got else "CLOSED")
"#;
    let body = encode(&SidecarRequest::List).unwrap();
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    let hex: String = frame.iter().map(|b| format!("{b:02x}")).collect();
    let mut cmd = std::process::Command::new(python);
    cmd.args(["-c", script]).env("SOCK", socket).env("FRAME", hex);
    if let Some(lock) = lock {
        cmd.env("LOCK", lock);
    }
    let out = cmd.output().expect("run the peer");
    String::from_utf8_lossy(&out.stdout).trim().to_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_holder_of_the_worker_lock_is_answered() -> anyhow::Result<()> {
    let Some(python) =
        ["/usr/bin/python3", "/usr/local/bin/python3"].into_iter().find(|p| std::path::Path::new(p).is_file())
    else {
        println!("skipped: no python3 to play the other process");
        return Ok(());
    };
    let nats = NatsServer::start()?;
    let dir = tempfile::tempdir()?;
    let sidecar = Running::start(dir.path(), "w1", &nats.url).await?;
    let (socket, lock) = (sidecar.layout.socket_path(), sidecar.layout.lock_path());

    // A process of the same user that is not the worker: cut off, whether or
    // not a worker holds the lock meanwhile.
    let peer = tokio::task::spawn_blocking({
        let (python, socket) = (python.to_owned(), socket.clone());
        move || peer_process(&python, &socket, None)
    });
    assert_eq!(peer.await?, "CLOSED");
    let held = tenure_machine::worker_lock::WorkerLock::acquire(&lock)?;
    let peer = tokio::task::spawn_blocking({
        let (python, socket) = (python.to_owned(), socket.clone());
        move || peer_process(&python, &socket, None)
    });
    assert_eq!(peer.await?, "CLOSED");
    drop(held);

    // The process holding the lock — what the worker does — is answered.
    let peer = tokio::task::spawn_blocking({
        let (python, socket, lock) = (python.to_owned(), socket.clone(), lock.clone());
        move || peer_process(&python, &socket, Some(&lock))
    });
    assert_eq!(peer.await?, "ANSWERED");
    // This process itself (the sidecar runs in it) still is.
    let client = SidecarClient::new(&socket);
    assert!(matches!(client.call(&SidecarRequest::List).await?, SidecarReply::Records { .. }));
    sidecar.stop().await
}
