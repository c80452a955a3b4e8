//! The gateway's listener against hostile or careless callers, on the real
//! binary in front of a real Redis:
//!
//! * callers without a known token get 401, a token of another domain 403,
//!   and neither writes anything to Redis (key dump before and after);
//! * the binary refuses to start without `--auth-tokens` or
//!   `--insecure-no-auth`; the token file reloads, a broken one is refused;
//! * partial headers and a trickled body are closed by their timeouts;
//! * nearly complete 1 MB bodies cannot grow memory past the in-flight bound;
//! * SIGTERM with a half-open connection exits within `--drain-timeout`;
//! * TLS with a required client certificate.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{lease_request, request, write, TempDir};
use testkit::pki::TestPki;
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// A token file in `dir`: `api` and `web` callers.
const TOKENS: &str = "# callers of the gateway\napi api-token-1\n\nweb web-token-2\n";

/// A child process killed when dropped (a failed assertion included).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The policy of every gateway here: domain `api`, one global rule `rule`
/// of 20 a minute per client.
const POLICY: &str = r#"{"domain": "api", "global": {"cluster": "gw"},
  "rules": [{"name": "rule", "scope": "global", "key": ["client"],
             "limits": [{"requests": 20, "per": "1m"}]}]}"#;

fn options(redis: &Redis) -> GatewayOptions {
    GatewayOptions::new(redis.url()).policy(POLICY)
}

/// Every key but the health check's (`<prefix>health:<instance>`, written
/// by `/healthz`), with value and expiry.
fn dump(redis: &Redis) -> String {
    let all = ok(redis.dump(), "dumping Redis");
    all.lines()
        .filter(|l| !l.starts_with("rl:health:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn metric(gw: &Gateway, sample: &str) -> f64 {
    ok(gw.metric(sample), "reading /metrics").unwrap_or_else(|| panic!("no sample {sample}"))
}

/// Waits up to 5 s for `sample` to reach 1, failing with `what` if it does not.
fn wait_for_metric(gw: &Gateway, sample: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while metric(gw, sample) < 1.0 {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn post(
    gw: &Gateway,
    path: &str,
    body: &serde_json::Value,
    token: Option<&str>,
) -> testkit::Response {
    let client = Client::new(gw.url(""), ConnectionMode::NewPerRequest);
    let mut req = Request::post(path, body.to_string()).header("content-type", "application/json");
    let bearer;
    if let Some(t) = token {
        bearer = format!("Bearer {t}");
        req = req.header("authorization", &bearer);
    }
    ok(client.send(&req), "posting to the gateway")
}

#[test]
fn callers_without_a_token_of_the_domain_are_refused_and_write_nothing() {
    let redis = ok(Redis::start(), "starting redis-server");
    let dir = TempDir::new();
    let tokens = write(dir.path(), "tokens", TOKENS);
    let gw = ok(
        Gateway::start(options(&redis).args(&["--auth-tokens", &tokens])),
        "starting the gateway",
    );
    let limits: &[common::L] = &[(20, 60_000, "token_bucket")];
    let check = request("api", 1, &[("rule/c=alice", "c=alice", limits)]);

    // alice's bucket exists: one real check by the api proxy.
    let r = post(&gw, "/v1/check", &check, Some("api-token-1"));
    assert_eq!(r.status, 200, "{r:#?}");
    let before = dump(&redis);
    assert!(!before.is_empty());

    // Drain and refill attempts, by nobody, by a stranger and by another domain.
    let drain = lease_request("api", "rule/c=alice", "c=alice", limits, 20, 0);
    let refill = lease_request("api", "rule/c=alice", "c=alice", limits, 1, 1_000_000);
    let mut answers = Vec::new();
    for body in [&check, &drain, &refill] {
        let path = if body.get("want").is_some() {
            "/v1/lease"
        } else {
            "/v1/check"
        };
        for token in [None, Some("api-token-0"), Some("web-token-2")] {
            let r = post(&gw, path, body, token);
            answers.push((r.status, r.header("www-authenticate").map(str::to_string)));
        }
    }
    let bearer = Some("Bearer".to_string());
    assert_eq!(
        answers,
        [
            (401, bearer.clone()),
            (401, bearer.clone()),
            (403, None),
            (401, bearer.clone()),
            (401, bearer.clone()),
            (403, None),
            (401, bearer.clone()),
            (401, bearer),
            (403, None),
        ]
    );
    // Malformed: another scheme.
    let client = Client::new(gw.url(""), ConnectionMode::NewPerRequest);
    let r = ok(
        client.send(
            &Request::post("/v1/check", check.to_string())
                .header("authorization", "Basic YXBpOmFwaS10b2tlbi0x"),
        ),
        "posting",
    );
    assert_eq!(r.status, 401);
    assert_eq!(dump(&redis), before, "a refused call wrote to Redis");
    let failures = |reason: &str| {
        metric(
            &gw,
            &format!("ratelimit_gateway_auth_failures_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        (
            failures("missing"),
            failures("unknown"),
            failures("wrong_domain"),
            failures("malformed")
        ),
        (3.0, 3.0, 3.0, 1.0)
    );
    // Health and metrics stay open.
    assert_eq!(ok(client.get("/healthz", &[]), "healthz").status, 200);
    // The right token still works, and alice had 19 left.
    let r = post(&gw, "/v1/check", &check, Some("api-token-1"));
    assert_eq!(r.status, 200, "{r:#?}");
    let answer: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        answer["buckets"][0]["limits"][0]["remaining"], 18,
        "{answer}"
    );
}

#[test]
fn the_token_file_reloads_and_a_broken_one_keeps_the_old_tokens() {
    let redis = ok(Redis::start(), "starting redis-server");
    let dir = TempDir::new();
    let tokens = write(dir.path(), "tokens", "api old-token\n");
    let gw = ok(
        Gateway::start(options(&redis).args(&["--auth-tokens", &tokens])),
        "starting the gateway",
    );
    // The rule of POLICY: 20 a minute.
    let check = request(
        "api",
        1,
        &[("rule/c=bob", "c=bob", &[(20, 60_000, "token_bucket")])],
    );
    assert_eq!(
        post(&gw, "/v1/check", &check, Some("old-token")).status,
        200
    );
    write(dir.path(), "tokens", "api new-token\n");
    let reloaded = "ratelimit_gateway_reloads_total{what=\"auth_tokens\"}";
    wait_for_metric(&gw, reloaded, "the token file was not reloaded in 5 s");
    assert_eq!(
        post(&gw, "/v1/check", &check, Some("old-token")).status,
        401
    );
    assert_eq!(
        post(&gw, "/v1/check", &check, Some("new-token")).status,
        200
    );
    // A duplicate token: refused, the new tokens stay in force.
    write(dir.path(), "tokens", "api new-token\nweb new-token\n");
    let failed = "ratelimit_gateway_reload_failures_total{what=\"auth_tokens\"}";
    wait_for_metric(&gw, failed, "the broken file was not read in 5 s");
    assert_eq!(
        post(&gw, "/v1/check", &check, Some("new-token")).status,
        200
    );
    assert!(
        gw.log().contains("line 2: the same token as"),
        "{}",
        gw.log_tail(10)
    );
    assert!(!gw.log().contains("new-token"), "the log shows a token");
}

#[test]
fn the_binary_refuses_to_start_without_tokens_unless_told_it_is_insecure() {
    let bin = ok(testkit::gateway_bin(), "finding the gateway binary");
    let out = Command::new(&bin)
        .args(["--redis", "redis://127.0.0.1:1", "--listen", "127.0.0.1:0"])
        .env_remove("RLGW_AUTH_TOKENS_FILE")
        .env_remove("RLGW_INSECURE_NO_AUTH")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refusing to serve /v1/* to anyone: give --auth-tokens FILE"),
        "{stderr}"
    );
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(Gateway::start(options(&redis)), "starting the gateway");
    assert!(
        gw.log()
            .contains("--insecure-no-auth: /v1/* answers anyone"),
        "{}",
        gw.log_tail(10)
    );
}

/// Reads from `s` until the peer closes; how long that took, or `None` if
/// it stayed open `limit`. What was read goes into `got`.
fn time_to_close(s: &mut TcpStream, limit: Duration, got: &mut Vec<u8>) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while start.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

#[test]
fn partial_headers_are_closed_within_the_header_timeout() {
    let redis = ok(Redis::start(), "starting redis-server");
    // The default --header-timeout-ms: 5000.
    let gw = ok(Gateway::start(options(&redis)), "starting the gateway");
    let mut s = TcpStream::connect(("127.0.0.1", gw.port())).unwrap();
    s.write_all(b"POST /v1/check HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n")
        .unwrap();
    let mut got = Vec::new();
    let closed = time_to_close(&mut s, Duration::from_secs(10), &mut got);
    println!("partial headers: closed after {closed:?}");
    let closed = closed.expect("a connection with partial headers stayed open 10 s");
    assert!(
        closed >= Duration::from_millis(4800) && closed <= Duration::from_millis(6500),
        "closed after {closed:?}, not within the 5 s header timeout"
    );
    assert_eq!(
        metric(
            &gw,
            "ratelimit_gateway_read_timeouts_total{phase=\"header\"}"
        ),
        1.0
    );
}

#[test]
fn a_trickled_body_is_answered_408_and_closed_within_the_body_timeout() {
    let redis = ok(Redis::start(), "starting redis-server");
    // The default --body-timeout-ms: 5000.
    let gw = ok(Gateway::start(options(&redis)), "starting the gateway");
    let mut s = TcpStream::connect(("127.0.0.1", gw.port())).unwrap();
    s.write_all(
        b"POST /v1/check HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n",
    )
    .unwrap();
    let start = Instant::now();
    let mut got = Vec::new();
    s.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut buf = [0u8; 4096];
    // One byte every 200 ms: each arrives well within any per-read timeout.
    let closed = loop {
        if start.elapsed() > Duration::from_secs(10) {
            break None;
        }
        let _ = s.write_all(b" ");
        match s.read(&mut buf) {
            Ok(0) => break Some(start.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break Some(start.elapsed()),
        }
    };
    let text = String::from_utf8_lossy(&got);
    println!("trickled body: closed after {closed:?}, got {text:?}");
    let closed = closed.expect("a trickled body kept the connection open 10 s");
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        closed >= Duration::from_millis(4800) && closed <= Duration::from_millis(6500),
        "closed after {closed:?}, not within the 5 s body timeout"
    );
    assert_eq!(
        metric(&gw, "ratelimit_gateway_read_timeouts_total{phase=\"body\"}"),
        1.0
    );
    assert_eq!(dump(&redis), "", "a refused call wrote to Redis");
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// 40 connections each send all of a 1 MiB body but its last byte. With
/// `--max-in-flight 8`, at most 8 bodies are read at once (the others are
/// answered 503 after their headers): RSS grows by at most 8 × 2 MiB (a
/// body and its copy) + 8 MiB of slack = 24 MiB. Before the bound, every
/// body was held: 40 bodies took RSS from 12 MB to 55 MB.
#[test]
fn nearly_complete_large_bodies_cannot_grow_memory_past_the_in_flight_bound() {
    const BODY: usize = 1 << 20;
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(
        Gateway::start(options(&redis).args(&["--max-in-flight", "8"])),
        "starting the gateway",
    );
    let pid = gw.pid().unwrap();
    let base = rss_kib(pid);
    let port = gw.port();
    let head = format!(
        "POST /v1/check HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {BODY}\r\n\r\n"
    );
    let body = Arc::new(vec![b' '; BODY - 1]);
    let conns: Vec<_> = (0..40)
        .map(|_| {
            let head = head.clone();
            let body = Arc::clone(&body);
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let _ = s.write_all(head.as_bytes());
                // The gateway may answer 503 and close before all of it is sent.
                let _ = s.write_all(&body);
                s
            })
        })
        .collect();
    let mut streams: Vec<TcpStream> = conns.into_iter().map(|t| t.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let peak = rss_kib(pid);
    let growth_mib = (peak.saturating_sub(base)) as f64 / 1024.0;
    println!("40 nearly complete 1 MiB bodies: RSS {base} kB -> {peak} kB (+{growth_mib:.1} MiB)");
    assert!(
        growth_mib <= 24.0,
        "RSS grew by {growth_mib:.1} MiB, more than 24"
    );
    let shed = metric(&gw, "ratelimit_gateway_shed_total");
    assert_eq!(shed, 32.0, "8 bodies read at once, 32 shed");
    // The 8 held bodies end with 408 within the body timeout; the others got 503.
    let mut statuses = std::collections::BTreeMap::new();
    for s in &mut streams {
        let mut got = Vec::new();
        time_to_close(s, Duration::from_secs(8), &mut got);
        let status = String::from_utf8_lossy(&got)
            .get(9..12)
            .unwrap_or("none")
            .to_string();
        *statuses.entry(status).or_insert(0) += 1;
    }
    println!("answers: {statuses:?}");
    assert_eq!(statuses.get("408"), Some(&8), "{statuses:?}");
    assert_eq!(dump(&redis), "", "a refused call wrote to Redis");
}

#[test]
fn sigterm_with_a_half_open_connection_exits_within_the_drain_timeout() {
    let redis = ok(Redis::start(), "starting redis-server");
    // Headers may take a minute here: only the drain deadline can end it.
    let mut gw = ok(
        Gateway::start(options(&redis).args(&[
            "--drain-timeout",
            "2s",
            "--header-timeout-ms",
            "60000",
        ])),
        "starting the gateway",
    );
    let mut s = TcpStream::connect(("127.0.0.1", gw.port())).unwrap();
    s.write_all(b"POST /v1/check HTTP/1.1\r\nhost: gw\r\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    // SIGTERM, then SIGKILL after 5 s (which would not be a success).
    let status = ok(gw.stop(), "stopping the gateway").expect("it ran");
    let took = start.elapsed();
    println!("SIGTERM with a half-open connection: exited after {took:?} with {status:?}");
    assert!(
        status.success(),
        "{status:?} after {took:?}: killed, not exited"
    );
    assert!(
        took >= Duration::from_millis(1900) && took <= Duration::from_millis(3000),
        "exited after {took:?}, not at the 2 s drain deadline"
    );
    assert!(
        gw.log().contains("drain deadline passed"),
        "{}",
        gw.log_tail(10)
    );
}

/// A TLS client of `port` with `ca` as its root and, optionally, a client
/// certificate; `GET /healthz` over it. `Err` when the handshake or the
/// request fails.
fn tls_get(port: u16, ca: &Path, client: Option<(&Path, &Path)>) -> Result<String, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_file(cert).unwrap()],
                PrivateKeyDer::from_pem_file(key).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let name = ServerName::try_from("localhost").unwrap();
    let mut conn =
        rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let mut sock = TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    tls.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    tls.read_to_end(&mut out).map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[test]
fn mutual_tls_requires_a_client_certificate_of_the_ca() {
    let redis = ok(Redis::start(), "starting redis-server");
    let pki = ok(
        TestPki::new(&["localhost", "127.0.0.1"]),
        "making certificates",
    );
    let other = ok(TestPki::new(&["localhost"]), "making another CA");
    let (cert, key, ca) = (
        pki.server_cert().display().to_string(),
        pki.server_key().display().to_string(),
        pki.ca().display().to_string(),
    );
    let port = testkit::free_port().expect("a free port");
    let dir = TempDir::new();
    let policy = write(dir.path(), "policy.json", POLICY);
    // The testkit helper polls /healthz over plain HTTP: start it by hand.
    let bin = ok(testkit::gateway_bin(), "finding the gateway binary");
    let _child = Killed(
        Command::new(bin)
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--redis",
                &redis.url(),
            ])
            .args([
                "--policy",
                &policy,
                "--insecure-no-auth",
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
                "--client-ca",
                &ca,
            ])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let client = Some((pki.client_cert(), pki.client_key()));
    let client = client.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        match tls_get(port, &pki.ca(), client) {
            Ok(a) if a.starts_with("HTTP/1.1 200") => break a,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "no 200 over mTLS in 10 s: {other:?}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    assert!(answer.contains("\"redis\":\"up\""), "{answer}");
    // No client certificate, or one of another CA: no HTTP at all.
    let without = tls_get(port, &pki.ca(), None);
    assert!(without.is_err(), "{without:?}");
    let stranger = Some((other.client_cert(), other.client_key()));
    let stranger = stranger.as_ref().map(|(c, k)| (c.as_path(), k.as_path()));
    let wrong = tls_get(port, &pki.ca(), stranger);
    assert!(wrong.is_err(), "{wrong:?}");
    // Plain HTTP gets no answer either.
    let plain = Client::with_timeout(
        format!("http://127.0.0.1:{port}"),
        ConnectionMode::NewPerRequest,
        Duration::from_secs(2),
    )
    .get("/healthz", &[]);
    assert!(
        plain.is_err() || plain.as_ref().is_ok_and(|r| r.status != 200),
        "{plain:?}"
    );
}

/// Redis, a gateway whose Redis round trips time out after `timeout_ms`, and
/// a check of one token from a bucket of 20 a minute for client `who`.
fn charge_rig(timeout_ms: &str, who: &str) -> (Redis, Gateway, serde_json::Value) {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(
        Gateway::start(options(&redis).args(&["--redis-timeout-ms", timeout_ms])),
        "starting the gateway",
    );
    let rule = format!("rule/c={who}");
    let key = format!("c={who}");
    let check = request("api", 1, &[(&rule, &key, &[(20, 60_000, "token_bucket")])]);
    (redis, gw, check)
}

/// Redis holds every command for 600 ms.
fn pause_redis(redis: &Redis) {
    assert_eq!(
        ok(
            redis.cli(&["CLIENT", "PAUSE", "600", "ALL"]),
            "CLIENT PAUSE"
        ),
        "OK"
    );
}

/// A 503 may follow a committed charge: Redis answers after the gateway's
/// round-trip timeout, having run the script. The gateway counts it
/// (`charged_then_failed_total{reason="timeout"}`), and the charge stands:
/// the next check finds one token fewer (erring strict, never refunded).
#[test]
fn a_503_after_a_charge_that_committed_is_counted_and_the_charge_stands() {
    let (redis, gw, check) = charge_rig("100", "carol");
    // Redis holds every command for 600 ms: the check's script runs only
    // after the gateway gave up on it.
    pause_redis(&redis);
    let r = post(&gw, "/v1/check", &check, None);
    assert_eq!(r.status, 503, "{r:#?}");
    std::thread::sleep(Duration::from_millis(700));
    let sample = "ratelimit_gateway_charged_then_failed_total{reason=\"timeout\"}";
    assert_eq!(metric(&gw, sample), 1.0);
    let deadline = Instant::now() + Duration::from_secs(5);
    let answer = loop {
        let r = post(&gw, "/v1/check", &check, None);
        if r.status == 200 {
            break serde_json::from_str::<serde_json::Value>(&r.body).unwrap();
        }
        assert!(Instant::now() < deadline, "no 200 after Redis woke: {r:#?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    // 20 − the charge behind the 503 − this one.
    assert_eq!(
        answer["buckets"][0]["limits"][0]["remaining"], 18,
        "{answer}"
    );
}

/// The caller leaves (as Envoy does at its callout timeout) while the
/// gateway waits on Redis: the script still runs and charges, nobody reads
/// the answer, and the gateway counts it as `client_gone`.
#[test]
fn a_caller_that_leaves_during_the_charge_is_counted() {
    let (redis, gw, check) = charge_rig("3000", "dave");
    pause_redis(&redis);
    let impatient = Client::with_timeout(
        gw.url(""),
        ConnectionMode::NewPerRequest,
        Duration::from_millis(100),
    );
    let r = impatient.send(
        &Request::post("/v1/check", check.to_string()).header("content-type", "application/json"),
    );
    assert!(
        r.is_err(),
        "answered within 100 ms although Redis is paused: {r:?}"
    );
    std::thread::sleep(Duration::from_millis(700));
    let sample = "ratelimit_gateway_charged_then_failed_total{reason=\"client_gone\"}";
    assert_eq!(metric(&gw, sample), 1.0);
    let r = post(&gw, "/v1/check", &check, None);
    let answer: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(
        answer["buckets"][0]["limits"][0]["remaining"], 18,
        "{answer}"
    );
}
