//! The gRPC listener (`--grpc-listen`) under hostile callers, with the
//! bounds of the HTTP one: the token is checked from the request's
//! metadata before its message is read, a message is at most
//! `MAX_BODY_BYTES`, connections beyond `--max-connections` are closed at
//! once, and an idle connection is closed after `--header-timeout-ms`.

mod common;
use common::h2_tls;

use std::time::{Duration, Instant};

use bytes::Bytes;
use ratelimit_gateway::{Auth, Config, RlsOptions, Running};
use testkit::redis::Redis;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const RLS: &str =
    "domain: d\ndescriptors:\n- key: k\n  rate_limit: {unit: minute, requests_per_unit: 3}\n";

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rlgw-grpc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn gateway(redis: &Redis, name: &str, edit: impl FnOnce(&mut Config)) -> Running {
    let work = dir(name);
    std::fs::write(work.join("rls.yaml"), RLS).unwrap();
    std::fs::write(work.join("tokens"), format!("d {TOKEN}\n")).unwrap();
    // No policy: the rate limit service alone, as a drop-in for envoyproxy/ratelimit.
    let mut config = Config::single("127.0.0.1:0".parse().unwrap(), redis.url(), vec![]);
    config.redis_timeout = Duration::from_millis(500);
    config.auth = Auth::Tokens(work.join("tokens"));
    config.rls = RlsOptions {
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        config: vec![work.join("rls.yaml")],
        ..RlsOptions::default()
    };
    edit(&mut config);
    ratelimit_gateway::start(config, Duration::from_secs(10))
        .await
        .unwrap()
}

/// An HTTP/2 connection to the gRPC port.
async fn h2(gw: &Running) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(gw.grpc_addr.unwrap()).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    client
}

fn request(token: Option<&str>) -> http::Request<()> {
    let mut r = http::Request::post(format!("http://gateway{PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = token {
        r = r.header("authorization", format!("Bearer {t}"));
    }
    r.body(()).unwrap()
}

/// A gRPC frame header announcing a message of `len` bytes.
fn frame_header(len: u32) -> Bytes {
    let mut b = vec![0u8];
    b.extend_from_slice(&len.to_be_bytes());
    Bytes::from(b)
}

/// The `grpc-status` of an answer: its trailers-only headers, else its trailers.
async fn grpc_status(resp: http::Response<h2::RecvStream>) -> String {
    if let Some(s) = resp.headers().get("grpc-status") {
        return s.to_str().unwrap().to_string();
    }
    let mut body = resp.into_body();
    while body.data().await.is_some() {}
    let trailers = body.trailers().await.unwrap().unwrap();
    trailers["grpc-status"].to_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_stream_is_refused_before_its_message_arrives() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "auth-first", |_| {}).await;
    let mut client = h2(&gw).await;
    // 4 MB announced, 1 KiB sent, the rest never: the answer must not wait for it.
    let (resp, mut body) = client.send_request(request(None), false).unwrap();
    // The refusal may close the stream before these go out: that is the point.
    let _ = body.send_data(frame_header(4_000_000), false);
    let _ = body.send_data(Bytes::from(vec![0u8; 1024]), false);
    let resp = tokio::time::timeout(Duration::from_secs(2), resp)
        .await
        .expect("no answer while the message was still unsent")
        .unwrap();
    assert_eq!(grpc_status(resp).await, "16", "UNAUTHENTICATED");
    let refusals = gw
        .app
        .metrics
        .auth_failures
        .with_label_values(&["missing"])
        .get();
    assert_eq!(refusals, 1);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_body_bound_is_refused() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "size", |_| {}).await;
    let mut client = h2(&gw).await;
    let len = ratelimit_gateway::http::server::MAX_BODY_BYTES as u32 + 1;
    let (resp, mut body) = client.send_request(request(Some(TOKEN)), false).unwrap();
    body.send_data(frame_header(len), false).unwrap();
    // The header alone may get the refusal, closing the stream first.
    let _ = body.send_data(Bytes::from(vec![0u8; len as usize]), true);
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(grpc_status(resp).await, "11", "OUT_OF_RANGE");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_and_idle_ones_time_out() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "conns", |c| {
        c.bounds.max_connections = 8;
        c.bounds.header_timeout = Duration::from_millis(1500);
    })
    .await;
    let addr = gw.grpc_addr.unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // Past the cap: closed at once, read gives EOF (or a reset).
    for _ in 0..4 {
        let mut extra = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(1), extra.read(&mut buf))
            .await
            .expect("a connection past the cap was kept open");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let refused = gw
        .app
        .metrics
        .connections_refused
        .with_label_values(&["grpc"])
        .get();
    assert_eq!(refused, 4);
    // The HTTP listener still answers.
    let health = reqwest::get(format!("{}/livez", gw.url())).await.unwrap();
    assert_eq!(health.status(), 200);
    // The idle ones are closed after the header timeout.
    let started = Instant::now();
    for mut c in held {
        // The server's SETTINGS may come first; then the end.
        let mut buf = [0u8; 64];
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(n) = c.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "an idle connection outlived the timeout");
    }
    assert!(started.elapsed() >= Duration::from_millis(1000));
    // Their places are free again.
    let mut client = h2(&gw).await;
    let (resp, _) = client.send_request(request(Some("wrong")), true).unwrap();
    assert_eq!(grpc_status(resp.await.unwrap()).await, "16");
    gw.stop().await.unwrap();
}

/// The status of a call with the token and an empty message (no domain:
/// UNKNOWN, as envoyproxy/ratelimit answers), or the transport's error.
async fn empty_call(mut client: h2::client::SendRequest<Bytes>) -> Result<String, String> {
    let (resp, mut body) = client
        .send_request(request(Some(TOKEN)), false)
        .map_err(|e| e.to_string())?;
    body.send_data(frame_header(0), true)
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(grpc_status(resp).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_flags_the_grpc_port_speaks_only_mutual_tls() {
    let redis = Redis::start().unwrap();
    let pki = testkit::pki::TestPki::new(&["localhost", "127.0.0.1"]).unwrap();
    let other = testkit::pki::TestPki::new(&["localhost"]).unwrap();
    let gw = gateway(&redis, "tls", |c| {
        c.tls = Some(ratelimit_gateway::http::tls::TlsFiles {
            cert: pki.server_cert(),
            key: pki.server_key(),
            client_ca: Some(pki.ca()),
        });
    })
    .await;
    let (cert, key) = (pki.client_cert(), pki.client_key());
    let ok = h2_tls(gw.grpc_addr.unwrap(), &pki.ca(), Some((&cert, &key)))
        .await
        .unwrap();
    assert_eq!(empty_call(ok).await.unwrap(), "2", "UNKNOWN: no domain");
    // No client certificate, one of another CA, or plaintext: no gRPC answer.
    let without = match h2_tls(gw.grpc_addr.unwrap(), &pki.ca(), None).await {
        Ok(c) => empty_call(c).await,
        Err(e) => Err(e),
    };
    assert!(without.is_err(), "{without:?}");
    let (ocert, okey) = (other.client_cert(), other.client_key());
    let stranger = match h2_tls(gw.grpc_addr.unwrap(), &pki.ca(), Some((&ocert, &okey))).await {
        Ok(c) => empty_call(c).await,
        Err(e) => Err(e),
    };
    assert!(stranger.is_err(), "{stranger:?}");
    let tcp = TcpStream::connect(gw.grpc_addr.unwrap()).await.unwrap();
    let plain = match h2::client::handshake(tcp).await {
        Ok((client, conn)) => {
            tokio::spawn(conn);
            empty_call(client).await
        }
        Err(e) => Err(e.to_string()),
    };
    assert!(
        plain.is_err(),
        "a plaintext gRPC call was answered: {plain:?}"
    );
    gw.stop().await.unwrap();
}
