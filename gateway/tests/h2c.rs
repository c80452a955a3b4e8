//! The HTTP listener speaks HTTP/2 cleartext (prior knowledge) beside
//! HTTP/1.1, with the same bounds: checks and batches answered over h2c,
//! at most `MAX_STREAMS_PER_CONNECTION` streams served at once per
//! connection (announced, and the one past them waits), a header list over
//! `MAX_HEAD_BYTES` refused before any handler, a body that stalls answered
//! 408 at `--body-timeout-ms`; over TLS, `h2` chosen in ALPN.

mod common;
use common::*;

use std::time::Duration;

use bytes::Bytes;
use ratelimit_gateway::http::server::{MAX_HEAD_BYTES, MAX_STREAMS_PER_CONNECTION};
use ratelimit_gateway::{Config, Running, Target};
use serde_json::Value;

/// An HTTP/2 connection with prior knowledge to the HTTP listener.
async fn h2c(gw: &Running) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

fn post(path: &str) -> http::request::Builder {
    http::Request::post(format!("http://gateway{path}")).header("content-type", "application/json")
}

/// Sends `req` with `body` whole; the status and the JSON answer.
async fn send(
    client: &mut h2::client::SendRequest<Bytes>,
    req: http::Request<()>,
    body: &Value,
) -> (u16, Value) {
    sync_policy();
    let (resp, mut stream) = client.send_request(req, false).unwrap();
    stream
        .send_data(Bytes::from(body.to_string()), true)
        .unwrap();
    answer(resp.await.unwrap()).await
}

/// The status and the JSON body of an answer.
async fn answer(resp: http::Response<h2::RecvStream>) -> (u16, Value) {
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_and_a_batch_are_answered_over_h2c_beside_http1() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    let limits: &[L] = &[(2, 60_000, "token_bucket")];
    let one = request("h2c", 1, &[("k", "alice", limits)]);
    let mut client = h2c(&gw).await;
    let (status, answer) = send(&mut client, post("/v1/check").body(()).unwrap(), &one).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(limit(&answer, 0, 0)["remaining"], 1, "{answer}");
    let batch = batch_request("h2c", vec![as_check(&one), as_check(&one)]);
    let (status, answer) = send(&mut client, post("/v3/check").body(()).unwrap(), &batch).await;
    assert_eq!(status, 200, "{answer}");
    let allowed: Vec<&Value> = answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["allowed"])
        .collect();
    assert_eq!(allowed, [true, false]);
    // The same listener still speaks HTTP/1.1.
    let (status, answer) = check(&reqwest::Client::new(), &gw.url(), &one).await;
    assert_eq!(status, 200);
    assert_eq!(answer["allowed"], false);
    // The streams cap is announced in the server's settings.
    assert_eq!(
        client.current_max_send_streams(),
        MAX_STREAMS_PER_CONNECTION as usize
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bounds_hold_over_h2c() {
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 5000, |mut c: Config| {
        c.bounds.body_timeout = Duration::from_millis(1500);
        c
    })
    .await;
    let limits: &[L] = &[(1000, 60_000, "token_bucket")];
    let one = request("h2c-bounds", 1, &[("k", "bob", limits)]);
    sync_policy();
    let mut client = h2c(&gw).await;
    // A header list past the bound: refused before any handler.
    let big = "x".repeat(MAX_HEAD_BYTES + 1);
    let req = post("/v1/check").header("x-big", big).body(()).unwrap();
    let (resp, mut stream) = client.send_request(req, false).unwrap();
    let _ = stream.send_data(Bytes::from(one.to_string()), true);
    // HTTP/2's answer to a header list over the announced size: 431.
    assert_eq!(resp.await.unwrap().status().as_u16(), 431);
    let checks =
        |gw: &Running, result: &str| gw.app.metrics.checks.with_label_values(&[result]).get();
    assert_eq!(checks(&gw, "allowed") + checks(&gw, "error"), 0);

    // Every stream the cap allows holds a body that stalls; one more whole
    // request either waits for a place (a client that read the server's
    // settings first), so it is answered after a 408, or is refused
    // (`REFUSED_STREAM`: sent before the settings arrived).
    let mut client = h2c(&gw).await;
    type Outcome = Result<u16, Option<h2::Reason>>;
    let (done, mut order) = tokio::sync::mpsc::unbounded_channel::<(usize, Outcome)>();
    let outcome = |r: Result<http::Response<h2::RecvStream>, h2::Error>| -> Outcome {
        r.map(|r| r.status().as_u16()).map_err(|e| e.reason())
    };
    let mut stalled = Vec::new();
    for i in 0..MAX_STREAMS_PER_CONNECTION as usize {
        let req = post("/v1/check").body(()).unwrap();
        let (resp, mut stream) = client.send_request(req, false).unwrap();
        stream
            .send_data(Bytes::from_static(b"{\"version\""), false)
            .unwrap();
        let done = done.clone();
        stalled.push(stream);
        tokio::spawn(async move {
            let _ = done.send((i, outcome(resp.await)));
        });
    }
    let last = MAX_STREAMS_PER_CONNECTION as usize;
    let req = post("/v1/check").body(()).unwrap();
    let (resp, mut stream) = client.send_request(req, false).unwrap();
    let _ = stream.send_data(Bytes::from(one.to_string()), true);
    tokio::spawn(async move {
        let _ = done.send((last, outcome(resp.await)));
    });
    let mut seen = Vec::new();
    let all = async {
        while let Some(next) = order.recv().await {
            seen.push(next);
            if seen.len() == last + 1 {
                break;
            }
        }
    };
    // A bound, not a measure: a stream that never ends fails here.
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("every stream answered");
    let stalled_ones: Vec<&Outcome> = seen
        .iter()
        .filter(|(i, _)| *i < last)
        .map(|(_, o)| o)
        .collect();
    assert!(stalled_ones.iter().all(|o| **o == Ok(408)), "{seen:?}");
    let at = seen.iter().position(|(i, _)| *i == last).unwrap();
    match &seen[at].1 {
        Ok(200) => assert!(
            at > 0,
            "the stream past the cap was served at once: {seen:?}"
        ),
        refused => assert_eq!(*refused, Err(Some(h2::Reason::REFUSED_STREAM)), "{seen:?}"),
    }
    println!(
        "the stream past the cap: {:?} after {at} answers",
        seen[at].1
    );
    assert_eq!(
        gw.app
            .metrics
            .read_timeouts
            .with_label_values(&["body"])
            .get(),
        MAX_STREAMS_PER_CONNECTION as u64
    );
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_alpn_chooses_h2() {
    let redis = redis();
    let pki = testkit::pki::TestPki::new(&["localhost", "127.0.0.1"]).unwrap();
    let gw = gateway_with(Target::Single(redis.url()), 5000, |mut c: Config| {
        c.tls = Some(ratelimit_gateway::http::tls::TlsFiles {
            cert: pki.server_cert(),
            key: pki.server_key(),
            client_ca: None,
        });
        c
    })
    .await;
    let limits: &[L] = &[(2, 60_000, "token_bucket")];
    let one = request("h2-tls", 1, &[("k", "carol", limits)]);
    let mut client = h2_tls(gw.addr, &pki.ca(), None).await.unwrap();
    let (status, answer) = send(&mut client, post("/v1/check").body(()).unwrap(), &one).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(limit(&answer, 0, 0)["remaining"], 1, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stalls_in_the_preface_is_closed_at_the_header_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 5000, |mut c: Config| {
        c.bounds.header_timeout = Duration::from_millis(1000);
        c
    })
    .await;
    let mut tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    // Two bytes of HTTP/2's preface, then nothing: neither protocol yet.
    tcp.write_all(b"PR").await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(30), tcp.read(&mut buf))
        .await
        .expect("the connection was closed");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let timeouts = gw.app.metrics.read_timeouts.with_label_values(&["header"]);
    assert_eq!(timeouts.get(), 1);
}
