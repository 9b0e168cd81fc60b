//! Hostile clients against `serve`'s HTTP side: half-sent heads, slow bodies, idle connections,
//! oversized heads, bodies sent without the key, more connections than the bound (idle ones
//! make room for a new client; busy ones do not), slow clients
//! at shutdown, and a flood under a 1,024-descriptor limit. Each test runs the real application
//! (in-process on port 0, or the binary where the descriptor limit is the point) against a real
//! Azurite, with short deadlines so it is quick; raw TCP streams play the hostile clients.
//!
//! Also: clients that pipeline requests and never read the answers (the write deadline), the
//! per-connection request bound, the health listener under a flood, and: `serve` refuses to listen on a non-loopback address without a key unless told so.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::Running;
use leasehold_test_support::{eventually, unique_name};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

const KEY: &str = "k3y";
const RECORD: &str = "8f9c1d2e-0000-4000-8000-000000000001";

fn settings(extra: &[(&str, &str)]) -> anyhow::Result<leasehold::Settings> {
    let mut vars = common::serve_vars(&unique_name("triggers"), &unique_name("locks"));
    vars.push(("LEASEHOLD_DEMO_SECONDS".into(), "1".into()));
    vars.push(("LEASEHOLD_API_KEY".into(), KEY.into()));
    let mut vars = common::with(vars, extra);
    vars.retain(|_, v| !v.is_empty());
    leasehold::Settings::from_vars(vars)
}

async fn build(extra: &[(&str, &str)]) -> anyhow::Result<leasehold::Application> {
    leasehold::Application::build(
        settings(extra)?,
        leasehold::Mode::Standalone {
            port: None,
            demo: true,
        },
    )
    .await
}

async fn start(extra: &[(&str, &str)]) -> Running {
    Running::run(build(extra).await.unwrap())
}

/// A head for `POST /api/start` with `key`, declaring a body of `length` bytes.
fn head(key: &str, length: usize) -> String {
    format!(
        "POST /api/start HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         x-functions-key: {key}\r\nContent-Length: {length}\r\n\r\n"
    )
}

async fn connect(port: u16) -> TcpStream {
    TcpStream::connect(("127.0.0.1", port)).await.unwrap()
}

/// Reads until the server closes the connection (EOF or reset); `None` if it is still open
/// after `limit`. Returns what the server sent.
async fn closed_within(mut stream: TcpStream, limit: Duration) -> Option<String> {
    let mut received = Vec::new();
    let read = async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok()?;
    Some(String::from_utf8_lossy(&received).into_owned())
}

/// The status line's code of a raw answer.
fn status_of(answer: &str) -> Option<u16> {
    answer.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// An honest `POST /api/start`: its status and how long the answer took.
async fn honest_post(port: u16) -> (u16, Duration) {
    let from = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/api/start"))
        .header("x-functions-key", KEY)
        .json(&json!({"scope": "account", "recordId": RECORD}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), from.elapsed())
}

/// Hostile connections of three kinds, `n` of each: half-sent heads, bodies that stop after a
/// few bytes (with the key), and connections that send nothing.
async fn open_hostile(port: u16, n: usize) -> Vec<(&'static str, TcpStream)> {
    let mut open = Vec::new();
    for _ in 0..n {
        let mut half = connect(port).await;
        half.write_all(b"POST /api/start HTTP/1.1\r\nHost: 127.0.0.1\r\nx-functi")
            .await
            .unwrap();
        open.push(("half-sent head", half));
        let mut slow = connect(port).await;
        slow.write_all(head(KEY, 400_000).as_bytes()).await.unwrap();
        slow.write_all(b"{\"recordId\": \"").await.unwrap();
        open.push(("slow body", slow));
        open.push(("idle", connect(port).await));
    }
    open
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_hostile_connections_neither_hold_start_up_nor_stay_open_past_their_deadlines() {
    let app = start(&[
        ("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", "2"),
        ("LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS", "2"),
    ])
    .await;
    let opened = Instant::now();
    let hostile = open_hostile(app.port, 150).await;
    println!(
        "[hostile] {} hostile connections opened in {:?}",
        hostile.len(),
        opened.elapsed()
    );

    let (status, took) = honest_post(app.port).await;
    println!("[hostile] honest POST among them answered {status} in {took:?}");
    assert_eq!(status, 202);
    assert!(took < Duration::from_secs(2), "honest POST took {took:?}");

    // Every hostile connection is closed by its deadline (2 s from when it was opened), with a
    // margin for 450 connections on 2 cores.
    let limit =
        Duration::from_secs(2) + Duration::from_secs(4) - opened.elapsed().min(Duration::from_secs(2));
    let mut checks = JoinSet::new();
    for (kind, stream) in hostile {
        checks.spawn(async move { (kind, closed_within(stream, limit).await) });
    }
    let mut slow_bodies_answered_408 = 0;
    while let Some(done) = checks.join_next().await {
        let (kind, answer) = done.unwrap();
        let answer = answer.unwrap_or_else(|| panic!("a {kind} connection is still open after its deadline"));
        match kind {
            "slow body" => {
                assert_eq!(status_of(&answer), Some(408), "{kind}: {answer}");
                assert!(answer.contains("did not arrive within 2 s"), "{answer}");
                slow_bodies_answered_408 += 1;
            }
            // No request was made: the connection is closed without an answer.
            _ => assert_eq!(answer, "", "{kind}"),
        }
    }
    assert_eq!(slow_bodies_answered_408, 150);
    println!(
        "[hostile] all closed {:?} after they were opened",
        opened.elapsed()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_head_is_answered_431_and_a_wrong_key_401_without_the_body_being_read() {
    let app = start(&[]).await;

    let mut big = connect(app.port).await;
    let padding = "a".repeat(leasehold::MAX_HEADER_BYTES + 1024);
    let request = format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nx-padding: {padding}\r\n\r\n");
    // The server may close before it read all of it; what it answered is what counts.
    let _ = big.write_all(request.as_bytes()).await;
    let answer = closed_within(big, Duration::from_secs(5))
        .await
        .expect("closed after 431");
    assert_eq!(status_of(&answer), Some(431), "{answer}");

    // The head says 400 KB follow; none are sent. The key is wrong: 401 at once (the body
    // deadline is 30 s, so an answer now means the body was never waited for).
    for key in ["wrong", ""] {
        let mut stream = connect(app.port).await;
        stream.write_all(head(key, 400_000).as_bytes()).await.unwrap();
        let from = Instant::now();
        let answer = closed_within(stream, Duration::from_secs(5))
            .await
            .expect("answered and closed without the body");
        assert_eq!(status_of(&answer), Some(401), "{answer}");
        assert!(answer.contains("missing or wrong key"), "{answer}");
        assert!(!answer.contains(KEY), "the key is never shown: {answer}");
        println!(
            "[hostile] wrong key with an unsent body: 401 in {:?}",
            from.elapsed()
        );
    }
    // A declared length over the limit: 413 from the head alone.
    let mut stream = connect(app.port).await;
    stream
        .write_all(head(KEY, 10 * 1024 * 1024).as_bytes())
        .await
        .unwrap();
    let answer = closed_within(stream, Duration::from_secs(5))
        .await
        .expect("answered and closed");
    assert_eq!(status_of(&answer), Some(413), "{answer}");
    app.stop().await;
}

/// Issue 35: with the bound full of idle connections, an honest POST waited for the header
/// deadline to shed them (4.1 s behind 1,500). Now a new client closes the connection that has
/// waited longest for a request head, as the health port does: with a header deadline of a
/// minute, the POST is answered at once, the oldest idle connection is closed and the other 19
/// are still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_bound_a_new_client_closes_the_connection_waiting_longest_for_a_head() {
    let app = start(&[
        ("LEASEHOLD_HTTP_MAX_CONNECTIONS", "20"),
        ("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", "60"),
    ])
    .await;
    let mut idle = Vec::new();
    for i in 0..20 {
        let mut stream = connect(app.port).await;
        if i % 2 == 1 {
            // Half of them sending a head slowly: waiting for a head too.
            stream
                .write_all(b"POST /api/start HTTP/1.1\r\nHost: 127.0.0.1\r\nx-functi")
                .await
                .unwrap();
        }
        idle.push(stream);
    }
    let (status, took) = tokio::time::timeout(Duration::from_secs(10), honest_post(app.port))
        .await
        .expect("an honest POST answered while 20 idle connections filled the bound of 20");
    println!("[hostile] honest POST with 20 idle connections at a bound of 20: {status} in {took:?}");
    assert_eq!(status, 202);
    assert!(took < Duration::from_secs(5), "{took:?}");
    // The oldest was closed for it, without an answer; the others are open still (the header
    // deadline is a minute away).
    let mut idle = idle.into_iter();
    let oldest = idle.next().unwrap();
    assert_eq!(
        closed_within(oldest, Duration::from_secs(5)).await.as_deref(),
        Some(""),
        "the oldest idle connection is closed"
    );
    let mut checks = JoinSet::new();
    for (i, stream) in idle.enumerate() {
        checks.spawn(async move { (i + 1, closed_within(stream, Duration::from_millis(500)).await) });
    }
    while let Some(done) = checks.join_next().await {
        let (i, closed) = done.unwrap();
        assert_eq!(closed, None, "idle connection {i} was closed too");
    }
    app.stop().await;
}

/// A connection whose request is being read (a body sent slowly) is never closed to make room:
/// with the bound full of them, the 21st client waits in the listen backlog until the body
/// deadline ends one (answered 408), then is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_connection_bound_of_busy_connections_clients_wait_until_one_ends() {
    let app = start(&[
        ("LEASEHOLD_HTTP_MAX_CONNECTIONS", "20"),
        ("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", "60"),
        ("LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS", "2"),
    ])
    .await;
    let opened = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut stream = connect(app.port).await;
        // With `Expect: 100-continue`, the server says "100 Continue" once Start reads the body:
        // then the request is being read, for sure.
        let head = head(KEY, 400_000).replace("\r\n\r\n", "\r\nExpect: 100-continue\r\n\r\n");
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut continued = [0u8; 25];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut continued))
            .await
            .expect("100 Continue")
            .unwrap();
        assert!(continued.starts_with(b"HTTP/1.1 100 Continue"), "{continued:?}");
        stream.write_all(b"{\"recordId\": \"").await.unwrap();
        slow.push(stream);
    }
    // The 21st connection: its request is not read while the 20 are reading theirs...
    let mut next = connect(app.port).await;
    next.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(800), next.peek(&mut first)).await;
    assert!(
        early.is_err(),
        "connection 21 was answered while 20 requests being read held every slot"
    );
    // ...and is answered once the body deadline ended them (2 s after they were opened).
    let answer = closed_within(next, Duration::from_secs(8))
        .await
        .expect("answered once a slot was free");
    let waited = opened.elapsed();
    assert_eq!(status_of(&answer), Some(200), "{answer}");
    println!("[hostile] connection 21 of a bound of 20 busy ones answered after {waited:?}");
    assert!(waited >= Duration::from_millis(1500), "{waited:?}");
    for stream in slow {
        let answer = closed_within(stream, Duration::from_secs(5)).await;
        assert_eq!(answer.as_deref().and_then(status_of), Some(408), "{answer:?}");
    }
    // With the slots free again, an honest POST goes straight through.
    let (status, took) = honest_post(app.port).await;
    assert_eq!(status, 202);
    assert!(took < Duration::from_secs(2), "{took:?}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_slow_clients_at_its_deadline() {
    // Long read deadlines, so only the shutdown deadline can end these connections.
    let app = start(&[
        ("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", "60"),
        ("LEASEHOLD_HTTP_BODY_TIMEOUT_SECONDS", "60"),
        ("LEASEHOLD_HTTP_SHUTDOWN_SECONDS", "1"),
    ])
    .await;
    let hostile = open_hostile(app.port, 5).await;
    // Let the server take them all before it is told to stop.
    let (status, _) = honest_post(app.port).await;
    assert_eq!(status, 202);
    let took = app.stop().await;
    println!("[hostile] stopped with 15 slow clients connected in {took:?}");
    // Cut at its 1 s deadline: under the 10 s default (were the setting ignored) and the 60 s
    // read deadlines, with room for the hand-back on a loaded machine.
    assert!(took < Duration::from_secs(9), "shutdown took {took:?}");
    for (kind, stream) in hostile {
        assert!(
            closed_within(stream, Duration::from_secs(1)).await.is_some(),
            "a {kind} connection outlived the shutdown"
        );
    }
}

/// The measurement: under a 1,024-descriptor limit, 1,100 half-sent requests made Start
/// stop answering and storage calls fail. Now the connection bound keeps descriptors for
/// storage: the flood is shed by the header deadline, an honest POST is answered and its record
/// runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_under_a_1024_descriptor_limit_leaves_start_and_storage_working() {
    let dir = common::scratch_dir("leasehold-hostile");
    let runs = dir.join("runs.log");
    let log = dir.join("serve.log");
    let mut child = common::command("sh", &["-c", "ulimit -n 1024 && exec \"$0\" serve", common::BIN])
        .envs(common::serve_vars(
            &unique_name("triggers"),
            &unique_name("locks"),
        ))
        .env("LEASEHOLD_API_KEY", KEY)
        .env("LEASEHOLD_HTTP_HEADER_TIMEOUT_SECONDS", "2")
        .env(
            "LEASEHOLD_LOGIC_COMMAND",
            format!("echo \"$LEASEHOLD_RECORD_ID\" >> {}", runs.display()),
        )
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    let port = common::serve_port(&log).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("max_connections=832"),
        "the bound is capped below 1,024 descriptors: {text}"
    );

    let mut flood = Vec::new();
    let flooded = Instant::now();
    for _ in 0..1100 {
        let mut s = connect(port).await;
        s.write_all(b"POST /api/start HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await
            .unwrap();
        flood.push(s);
    }
    println!("[hostile] flood opened in {:?}", flooded.elapsed());
    let (status, took) = honest_post(port).await;
    println!("[hostile] 1,100 half-sent requests under ulimit -n 1024: honest POST {status} in {took:?}");
    assert_eq!(status, 202);
    // At worst it waited for the flood to be shed by the 2 s header deadline, twice.
    assert!(took < Duration::from_secs(8), "{took:?}");
    eventually(Duration::from_secs(30), "the record's run", || async {
        std::fs::read_to_string(&runs)
            .unwrap_or_default()
            .contains(RECORD)
            .then_some(())
    })
    .await;
    drop(flood);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("Too many open files"), "{text}");
    child.start_kill().unwrap();
    let _ = child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 22: a body over Start's limit got a reset connection instead of a 413 when the client
/// wrote the whole body before reading (as curl, Python's urllib and most clients do): the
/// server answered from the head and closed with the body unread. Now it reads and throws away
/// a bounded amount first, so the client finishes writing and reads its 413; declared (a
/// `Content-Length` over the limit) or found out while reading (chunked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_an_oversized_body_before_reading_gets_its_413() {
    let app = start(&[]).await;
    let body = vec![b' '; 3 * 1024 * 1024];
    for chunked in [false, true] {
        let from = Instant::now();
        // A small send buffer, so the body cannot all sit in socket buffers before the server
        // reads it (loopback's grow to megabytes).
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(32 * 1024).unwrap();
        let stream = socket.connect(([127, 0, 0, 1], app.port).into()).await.unwrap();
        let (mut read, mut write) = stream.into_split();
        let head = if chunked {
            format!(
                "POST /api/start HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                 x-functions-key: {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
        } else {
            head(KEY, body.len())
        };
        let sent = body.clone();
        // The whole request first, as those clients do; the answer is read only after it.
        let written = tokio::spawn(async move {
            write.write_all(head.as_bytes()).await?;
            if chunked {
                for chunk in sent.chunks(64 * 1024) {
                    write
                        .write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                        .await?;
                    write.write_all(chunk).await?;
                    write.write_all(b"\r\n").await?;
                }
                write.write_all(b"0\r\n\r\n").await?;
            } else {
                write.write_all(&sent).await?;
            }
            Ok::<_, std::io::Error>(write)
        });
        let write = tokio::time::timeout(Duration::from_secs(20), written)
            .await
            .expect("the body is taken")
            .unwrap()
            .unwrap_or_else(|e| panic!("chunked={chunked}: writing the body failed: {e}"));
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut answer))
            .await
            .expect("the connection is closed after the answer")
            .unwrap_or_else(|e| panic!("chunked={chunked}: reading the answer failed: {e}"));
        let answer = String::from_utf8_lossy(&answer);
        assert_eq!(status_of(&answer), Some(413), "chunked={chunked}: {answer}");
        assert!(answer.contains("over the limit"), "{answer}");
        println!(
            "[hostile] 3 MiB body, chunked={chunked}: 413 read after {:?}",
            from.elapsed()
        );
        drop(write);
    }
    app.stop().await;
}

/// A client that pipelines `GET /admin` (the dashboard's page, tens of KiB) without end and
/// never reads an answer: a small receive buffer, and answers large enough that the server's
/// writes block long before the request bound (1,000 small answers fit in a loopback socket's
/// send buffer). Returns the half it never reads from (read it to see what the server sent, and
/// whether it closed) and the writing task.
async fn slow_reader(port: u16) -> (tokio::net::tcp::OwnedReadHalf, tokio::task::JoinHandle<()>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stream = socket.connect(([127, 0, 0, 1], port).into()).await.unwrap();
    let (read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        let request = b"GET /admin HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(100);
        // Until the server closes the connection (or the test ends).
        while write.write_all(&request).await.is_ok() {}
    });
    (read, writer)
}

/// Reads until the server closes; `None` if it is still open after `limit`. The count of
/// answers received.
async fn answers_until_closed(mut read: tokio::net::tcp::OwnedReadHalf, limit: Duration) -> Option<usize> {
    let mut received = Vec::new();
    let drained = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    drained.ok()?;
    Some(String::from_utf8_lossy(&received).matches("HTTP/1.1 200").count())
}

/// Issue 22, item 1: clients that pipelined requests and never read the answers held their
/// slots for ever, so once they held every slot Start answered nobody, and the liveness probe
/// (on the same port) failed. Now an answer the client does not take within the write deadline
/// closes its connection, and the probe has a listener of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_their_answers_are_closed_at_the_write_deadline_and_the_probe_answers_meanwhile()
 {
    let app = start(&[
        ("LEASEHOLD_HTTP_MAX_CONNECTIONS", "8"),
        ("LEASEHOLD_HTTP_WRITE_TIMEOUT_SECONDS", "2"),
        ("LEASEHOLD_HEALTH_PORT", "0"),
        // The dashboard's page is the large answer the slow readers ask for.
        ("LEASEHOLD_ADMIN_KEY", "hostile-test-admin-key-0123456789abcdef"),
    ])
    .await;
    let health = app.health_port.expect("a health listener");
    let opened = Instant::now();
    let mut readers = Vec::new();
    for _ in 0..8 {
        readers.push(slow_reader(app.port).await);
    }

    // Every slot of Start's port is held: the probe's own listener answers all the same.
    let probe = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{health}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .expect("the health listener answers while Start's slots are held");
    assert_eq!(probe.status(), 200);
    assert_eq!(
        probe.json::<serde_json::Value>().await.unwrap(),
        json!({"status": "ok"})
    );

    // An honest POST is answered once the write deadline closed a slow reader (2 s after its
    // answers stopped being taken), not never.
    let (status, took) = honest_post(app.port).await;
    println!("[hostile] honest POST among 8 slow readers holding every slot: {status} in {took:?}");
    assert_eq!(status, 202);
    assert!(took < Duration::from_secs(10), "honest POST took {took:?}");

    // Each slow reader's connection was closed by the server: reading it now finds the answers
    // the socket buffers held, then the end, far short of the 100s of requests it sent.
    for (read, writer) in readers {
        let answered = answers_until_closed(read, Duration::from_secs(10))
            .await
            .expect("a slow reader's connection is still open after its write deadline");
        assert!(
            answered < leasehold::MAX_REQUESTS_PER_CONNECTION,
            "{answered} answers: closed by the request bound, not the write deadline"
        );
        writer.abort();
    }
    println!(
        "[hostile] all 8 slow readers closed within {:?}",
        opened.elapsed()
    );
    app.stop().await;
}

/// The request bound: a connection that pipelines more requests than
/// `MAX_REQUESTS_PER_CONNECTION`, and reads every answer, gets that many answers, the last
/// saying `Connection: close`, then the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_is_closed_after_its_request_bound() {
    let app = start(&[]).await;
    let bound = leasehold::MAX_REQUESTS_PER_CONNECTION;
    let stream = connect(app.port).await;
    let (read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        let request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".repeat(bound + 50);
        let _ = write.write_all(&request).await;
        write
    });
    let mut read = read;
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), read.read_to_end(&mut received))
        .await
        .expect("closed after the bound")
        .unwrap();
    let text = String::from_utf8_lossy(&received);
    assert_eq!(text.matches("HTTP/1.1 200").count(), bound);
    assert_eq!(
        text.matches("connection: close").count(),
        1,
        "only the last answer closes"
    );
    drop(writer.await);
    app.stop().await;
}

/// The health listener keeps only its newest few connections: a client holding many open (idle,
/// or half-sent) cannot keep the probe out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_held_open_on_the_health_port_do_not_keep_the_probe_out() {
    let app = start(&[("LEASEHOLD_HEALTH_PORT", "0")]).await;
    let health = app.health_port.unwrap();
    let mut held = Vec::new();
    for i in 0..200 {
        let mut s = connect(health).await;
        if i % 2 == 0 {
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
        }
        held.push(s);
    }
    let from = Instant::now();
    let probe = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{health}/healthz"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .expect("the probe is answered");
    assert_eq!(probe.status(), 200);
    println!(
        "[hostile] probe among 200 held health connections: {:?}",
        from.elapsed()
    );
    assert!(from.elapsed() < Duration::from_secs(2), "{:?}", from.elapsed());
    // Only the health route is there.
    let other = reqwest::get(format!("http://127.0.0.1:{health}/api/start"))
        .await
        .unwrap();
    assert_eq!(other.status(), 404);
    drop(held);
    app.stop().await;
}

/// Issue 22, item 4: a logic command runs as the worker's user, and read the worker's
/// `AzureWebJobsStorage`, `LEASEHOLD_API_KEY` and `LEASEHOLD_ADMIN_KEY` from
/// `/proc/<worker>/environ`. Now the worker and the supervisor are non-dumpable: a logic that
/// tries every way we know (`tests/fixtures/spy.py`: each ancestor's environment, per thread,
/// its memory through `/proc/<pid>/mem`, its descriptors, ptrace, and every process's
/// environment) finds none of them.
///
/// It runs as the container image does: `leasehold init -- serve`, init (PID 1 there) holding
/// the whole environment. With tini as PID 1 instead, a logic read every key from
/// `/proc/1/environ`. Root holds `CAP_SYS_PTRACE`, which reads any process whatever its flags;
/// so, as the deployments do (`capabilities: drop: ["ALL"]` in deploy/keda), the binary runs
/// without capabilities when the test runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_logic_cannot_read_the_workers_secrets() {
    use std::os::unix::fs::MetadataExt;
    let dir = common::scratch_dir("leasehold-spy");
    let out = dir.join("spy.out");
    let log = dir.join("serve.log");
    let spy = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/spy.py");
    let api_key = format!("api-{}", unique_name("secret"));
    let admin_key = format!("admin-{}-0123456789abcdef", unique_name("secret"));
    let root = std::fs::metadata("/proc/self").unwrap().uid() == 0;
    let mut cmd = if root {
        common::command(
            "setpriv",
            &[
                "--inh-caps=-all",
                "--ambient-caps=-all",
                "--bounding-set=-all",
                "--",
                common::BIN,
                "init",
                "--",
                "serve",
            ],
        )
    } else {
        common::leasehold(&["init", "--", "serve"])
    };
    let mut child = cmd
        .envs(common::serve_vars(
            &unique_name("triggers"),
            &unique_name("locks"),
        ))
        .env("LEASEHOLD_API_KEY", &api_key)
        .env("LEASEHOLD_ADMIN_KEY", &admin_key)
        .env(
            "LEASEHOLD_LOGIC_COMMAND",
            format!("python3 {spy} {}", out.display()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .unwrap();
    // Should the test fail first: SIGTERM to init (forwarded to serve) before the child's
    // kill-on-drop SIGKILL, which would leave serve running.
    struct StopInit(nix::unistd::Pid);
    impl Drop for StopInit {
        fn drop(&mut self) {
            if nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGTERM).is_ok() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    let stop_init = StopInit(nix::unistd::Pid::from_raw(child.id().unwrap() as i32));
    let port = common::serve_port(&log).await;
    let (status, _) = common::post(
        &format!("http://127.0.0.1:{port}/api/start"),
        &json!({"recordId": RECORD}).to_string(),
        &[
            ("x-functions-key", &api_key),
            ("content-type", "application/json"),
        ],
    )
    .await;
    assert_eq!(status, 202);
    let text = eventually(Duration::from_secs(60), "the spy's report", || async {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        text.ends_with("done\n").then_some(text)
    })
    .await;
    // SIGTERM to init reaches serve, which stops; init exits as it did.
    let init = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(init, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(45), child.wait())
        .await
        .expect("init forwards SIGTERM and exits once serve has stopped")
        .unwrap();
    // Reaped: its pid may be anyone's now.
    std::mem::forget(stop_init);
    assert!(status.success(), "init exits as serve did: {status}");
    let log_text = std::fs::read_to_string(&log).unwrap();
    assert!(
        log_text.contains("stopped"),
        "serve stopped gracefully: {log_text}"
    );
    println!(
        "[hostile] the spy's report:\n{}",
        text.chars().take(6000).collect::<String>()
    );
    // It found the worker and tried it...
    assert!(
        text.contains("\nworker "),
        "the spy did not find the worker: {text}"
    );
    assert!(text.contains(&format!("ran {RECORD}")), "{text}");
    // ...and learned none of the secrets.
    for secret in [&api_key, &admin_key] {
        assert!(
            !text.contains(secret.as_str()),
            "a logic read a key of the worker"
        );
    }
    let (chain, _everyone) = text.split_once("== every process").unwrap();
    assert!(
        !chain.contains("AccountKey=") && !chain.contains("AzureWebJobsStorage="),
        "a logic read the worker's storage connection string"
    );
    assert!(!text.contains("ptrace attached"), "a logic traced the worker");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_non_loopback_address_without_a_key_unless_told_it_is_insecure() {
    let open = [("LEASEHOLD_BIND", "0.0.0.0"), ("LEASEHOLD_API_KEY", "")];
    let e = format!("{:#}", build(&open).await.unwrap_err());
    assert!(
        e.contains("LEASEHOLD_API_KEY") && e.contains("LEASEHOLD_INSECURE_NO_START_KEY=true"),
        "{e}"
    );

    // Told so explicitly, with a key, or on loopback: it serves.
    for extra in [
        &[
            ("LEASEHOLD_BIND", "0.0.0.0"),
            ("LEASEHOLD_API_KEY", ""),
            ("LEASEHOLD_INSECURE_NO_START_KEY", "true"),
        ][..],
        &[("LEASEHOLD_BIND", "0.0.0.0")][..],
        &[("LEASEHOLD_BIND", "127.0.0.1"), ("LEASEHOLD_API_KEY", "")][..],
    ] {
        let app = build(extra).await.unwrap_or_else(|e| panic!("{extra:?}: {e:#}"));
        let stop = tokio_util::sync::CancellationToken::new();
        stop.cancel();
        app.run_until_stopped(stop).await.unwrap();
    }

    // The binary: refused with the message and a failing exit; the flag lets it serve.
    let serve = |flag: Option<&str>| {
        let mut cmd = common::leasehold(&["serve"]);
        cmd.args(flag)
            .envs(common::storage_vars(
                &unique_name("triggers"),
                &unique_name("locks"),
            ))
            .env("LEASEHOLD_BIND", "0.0.0.0")
            .env("LEASEHOLD_PORT", "0")
            .env("LEASEHOLD_DEMO_SECONDS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd
    };
    let out = tokio::time::timeout(Duration::from_secs(30), serve(None).output())
        .await
        .expect("serve exits at once")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("refusing to serve Start on 0.0.0.0")
            && stderr.contains("LEASEHOLD_INSECURE_NO_START_KEY=true"),
        "{stderr}"
    );
    let mut child = serve(Some("--insecure-no-start-key")).spawn().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let warned = tokio::time::timeout(Duration::from_secs(30), async {
        let mut text = Vec::new();
        let mut buf = [0u8; 1024];
        while let Ok(n) = stderr.read(&mut buf).await {
            if n == 0 {
                break;
            }
            text.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&text).contains("Start is open to anyone") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        warned.ok(),
        Some(true),
        "serve --insecure-no-start-key serves, with a warning"
    );
    child.start_kill().unwrap();
    let _ = child.wait().await;
}
