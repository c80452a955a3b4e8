//! The filter's protocol over gRPC (`ratelimit_wasm.v3.Gateway` on
//! `--grpc-listen`), against a real Redis: each method answers what its
//! HTTP route answers, on the same counters, and every refusal of the route
//! is the gRPC status `ratelimit_protocol::grpc::grpc_code` gives, with the
//! route's `error` as its message; a caller without a known token is
//! refused before its message is read, counted as the route counts it.

use std::time::Duration;

use bytes::Bytes;
use http::uri::PathAndQuery;
use ratelimit_gateway::protocol::{MAX_BATCH, MAX_BATCH_BYTES};
use ratelimit_gateway::rls::wasm::JsonCodec;
use ratelimit_gateway::{Auth, Config, RlsOptions, Running};
use ratelimit_protocol::grpc::{Method, SERVICE};
use serde_json::{json, Value};
use testkit::redis::Redis;
use tonic::Code;

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const OTHER_TOKEN: &str = "fedcba9876543210fedcba9876543210";
const NOWHERE_TOKEN: &str = "00112233445566778899aabbccddeeff";

/// `three`: 3 a day per client (nothing refills while a test runs), cost 1;
/// `tokens`: 1,000 a day, charged from the response (100 reserved).
const POLICY: &str = r#"{"domain": "g",
  "global": {"cluster": "gw", "lease": {"fraction": 1.0, "ttl_ms": 3600000}},
  "rules": [
    {"name": "three", "scope": "global", "key": ["client"], "cost": 1, "limits": [{"requests": 3, "per": "1d"}]},
    {"name": "tokens", "scope": "global", "key": ["client"], "limits": [{"requests": 1000, "per": "1d"}]}],
  "costs": [{"match": {"path_prefix": "/v1"}, "cost_from": {"header": "x-usage", "max": 2000, "reserve": 100}}]}"#;

const OTHER: &str = r#"{"domain": "other", "global": {"cluster": "gw"},
  "rules": [{"name": "r", "scope": "global", "key": ["client"], "limits": [{"requests": 5, "per": "1m"}]}]}"#;

const RLS: &str =
    "domain: rls\ndescriptors:\n- key: k\n  rate_limit: {unit: minute, requests_per_unit: 3}\n";

/// A gateway with the policy above, tokens for `g`, `other` and a domain no
/// policy has, and `--grpc-listen`.
async fn gateway(redis: &Redis, name: &str) -> Running {
    let work =
        std::env::temp_dir().join(format!("rlgw-grpc-protocol-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let policy = work.join("policy");
    std::fs::create_dir_all(&policy).unwrap();
    std::fs::write(policy.join("g.json"), POLICY).unwrap();
    std::fs::write(policy.join("other.json"), OTHER).unwrap();
    std::fs::write(work.join("rls.yaml"), RLS).unwrap();
    std::fs::write(
        work.join("tokens"),
        format!("g {TOKEN}\nother {OTHER_TOKEN}\nnowhere {NOWHERE_TOKEN}\n"),
    )
    .unwrap();
    let mut config = Config::single("127.0.0.1:0".parse().unwrap(), redis.url(), vec![policy]);
    config.redis_timeout = Duration::from_millis(2000);
    config.auth = Auth::Tokens(work.join("tokens"));
    config.rls = RlsOptions {
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        config: vec![work.join("rls.yaml")],
        ..RlsOptions::default()
    };
    let gw = ratelimit_gateway::start(config, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(
        gw.app
            .limiter
            .store()
            .wait_connected(Duration::from_secs(2))
            .await
    );
    gw
}

/// A gRPC client of the gateway's `--grpc-listen`.
async fn client(gw: &Running) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", gw.grpc_addr.unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    tonic::client::Grpc::new(channel)
}

/// Calls `/<SERVICE>/<method>` with `message` as it is and `token` as the
/// bearer; the answer as JSON, or the status.
async fn call_raw(
    c: &mut tonic::client::Grpc<tonic::transport::Channel>,
    method: &str,
    message: Bytes,
    token: Option<&str>,
) -> Result<Value, tonic::Status> {
    let mut req = tonic::Request::new(message);
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    c.ready().await.unwrap();
    let path = PathAndQuery::try_from(format!("/{SERVICE}/{method}")).unwrap();
    let answer = c.unary(req, path, JsonCodec).await?;
    Ok(serde_json::from_slice(answer.get_ref()).unwrap())
}

async fn call(
    c: &mut tonic::client::Grpc<tonic::transport::Channel>,
    method: Method,
    body: &Value,
    token: Option<&str>,
) -> Result<Value, tonic::Status> {
    call_raw(c, method.name(), Bytes::from(body.to_string()), token).await
}

/// Posts `body` to the gateway's HTTP `path` with the token; status and JSON.
async fn post(gw: &Running, path: &str, body: &Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", gw.url()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

fn bucket(rule: &str, client: &str, cost: u64) -> Value {
    json!({"rule": rule, "key": format!("{rule}/c={client}"), "tag": format!("c={client}"),
           "variant": "default", "cost": cost})
}

fn check(client: &str) -> Value {
    json!({"version": 2, "domain": "g", "buckets": [bucket("three", client, 1)]})
}

fn batch(client: &str, n: usize) -> Value {
    let checks: Vec<Value> = (0..n)
        .map(|_| json!({"buckets": [bucket("three", client, 1)]}))
        .collect();
    json!({"version": 3, "domain": "g", "checks": checks})
}

/// `(allowed, remaining)` of each result of a batch answer.
fn decisions(answer: &Value) -> Vec<(bool, u64)> {
    answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["allowed"].as_bool().unwrap(),
                r["buckets"][0]["limits"][0]["remaining"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `text` with every run of 10 or more digits (a time in ms) made `T`.
fn timeless(text: &str) -> String {
    let mut out = String::new();
    let mut digits = String::new();
    for ch in text.chars().chain(std::iter::once('\0')) {
        if ch.is_ascii_digit() {
            digits.push(ch);
            continue;
        }
        if digits.len() >= 10 {
            out.push('T');
        } else {
            out.push_str(&digits);
        }
        digits.clear();
        if ch != '\0' {
            out.push(ch);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_grpc_answers_and_counts_as_v3_check() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "batch").await;
    let mut c = client(&gw).await;
    let over_grpc = call(&mut c, Method::CheckBatch, &batch("ann", 5), Some(TOKEN))
        .await
        .unwrap();
    let (status, over_http) = post(&gw, "/v3/check", &batch("bob", 5)).await;
    assert_eq!(status, 200, "{over_http}");
    let expected = vec![(true, 2), (true, 1), (true, 0), (false, 0), (false, 0)];
    assert_eq!(decisions(&over_grpc), expected, "{over_grpc}");
    assert_eq!(decisions(&over_http), expected, "{over_http}");
    assert_eq!(over_grpc["version"], 3);
    // The same answer but for the time (`reset_ms`, `retry_after_ms`).
    let fields = |v: &Value| {
        let mut keys: Vec<String> = v["results"][3]["buckets"][0]["limits"][0]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(fields(&over_grpc), fields(&over_http));
    // The same counters as the HTTP routes: ann's bucket is spent for them too.
    let (status, alone) = post(&gw, "/v1/check", &check("ann")).await;
    assert_eq!((status, &alone["allowed"]), (200, &json!(false)), "{alone}");
    // Both clients' buckets written alike (times as `T`): empty, in the live set.
    let bucket = |c: &str| format!("rl:{{g|c={c}}}|three/c={c}|0|token_bucket|3|86400000");
    assert_eq!(
        timeless(&redis.contents().unwrap()),
        format!(
            "{} string \"T:0\"\n{} string \"T:0\"\nrl:{{g|live}} zset \"{}\\nT\\n{}\\nT\"\n",
            bucket("ann"),
            bucket("bob"),
            bucket("ann"),
            bucket("bob")
        )
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_lease_and_settle_answer_as_their_routes() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "methods").await;
    let mut c = client(&gw).await;
    let answer = call(&mut c, Method::Check, &check("cy"), Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(answer["allowed"], true, "{answer}");
    assert_eq!(
        answer["buckets"][0]["limits"][0]["remaining"], 2,
        "{answer}"
    );
    // A reserved charge, settled once.
    let id = "0123456789abcdef0123456789abcdef";
    let reserve = json!({"version": 2, "domain": "g", "reservation": id,
                         "buckets": [bucket("tokens", "cy", 100)]});
    let answer = call(&mut c, Method::Check, &reserve, Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(answer["allowed"], true, "{answer}");
    assert_eq!(
        answer["buckets"][0]["limits"][0]["remaining"], 900,
        "{answer}"
    );
    let settle = json!({"version": 2, "domain": "g",
        "settlements": [{"reservation": id, "buckets": [bucket("tokens", "cy", 40)]}]});
    let answer = call(&mut c, Method::Settle, &settle, Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(answer, json!({"version": 2, "settled": [true]}));
    let answer = call(&mut c, Method::Settle, &settle, Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(
        answer,
        json!({"version": 2, "settled": [false]}),
        "once only"
    );
    // 960 left after the settlement: a lease of 4 takes 4 of them.
    let lease = json!({"version": 2, "domain": "g", "rule": "tokens", "key": "tokens/c=cy",
                       "tag": "c=cy", "variant": "default", "want": 4, "return": 0});
    let answer = call(&mut c, Method::Lease, &lease, Some(TOKEN))
        .await
        .unwrap();
    assert_eq!(answer["granted"], 4, "{answer}");
    let (status, http) = post(
        &gw,
        "/v1/check",
        &json!({"version": 2, "domain": "g",
        "buckets": [bucket("tokens", "cy", 1)]}),
    )
    .await;
    assert_eq!(status, 200, "{http}");
    assert_eq!(http["buckets"][0]["limits"][0]["remaining"], 955, "{http}");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_the_routes_statuses_and_write_nothing() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "refusals").await;
    let mut c = client(&gw).await;
    let failures = |reason: &str| {
        gw.app
            .metrics
            .auth_failures
            .with_label_values(&[reason])
            .get()
    };
    let refused = |r: Result<Value, tonic::Status>| {
        let s = r.unwrap_err();
        (s.code(), s.message().to_string())
    };
    let unauthenticated = (
        Code::Unauthenticated,
        "authorization: a known bearer token is required".to_string(),
    );
    let body = check("dee");
    assert_eq!(
        refused(call(&mut c, Method::Check, &body, None).await),
        unauthenticated
    );
    assert_eq!(failures("missing"), 1);
    assert_eq!(
        refused(call(&mut c, Method::CheckBatch, &batch("dee", 1), Some("nope")).await),
        unauthenticated
    );
    assert_eq!(failures("unknown"), 1);
    assert_eq!(
        refused(call(&mut c, Method::Check, &body, Some(OTHER_TOKEN)).await),
        (
            Code::PermissionDenied,
            "authorization: this token may not act on this domain".to_string()
        )
    );
    assert_eq!(failures("wrong_domain"), 1);
    let nowhere =
        json!({"version": 2, "domain": "nowhere", "buckets": [bucket("three", "dee", 1)]});
    assert_eq!(
        refused(call(&mut c, Method::Check, &nowhere, Some(NOWHERE_TOKEN)).await),
        (
            Code::NotFound,
            "domain: unknown domain `nowhere`: not in the gateway's policy".to_string()
        )
    );
    let garbled = json!({"version": 2, "domain": "g", "buckets": [{"rule": "three", "key": 7}]});
    assert_eq!(
        refused(call(&mut c, Method::Check, &garbled, Some(TOKEN)).await),
        (
            Code::InvalidArgument,
            "buckets[0].key: invalid type: integer `7`, expected a string".to_string()
        )
    );
    // The route's own words, exactly.
    let (status, http) = post(&gw, "/v1/check", &garbled).await;
    assert_eq!(
        (status, http),
        (
            400,
            json!({"version": 2, "error": "buckets[0].key: invalid type: integer `7`, expected a string"})
        )
    );
    // One byte over the batch route's bound: refused by its size alone.
    let oversize = Bytes::from(vec![b' '; MAX_BATCH_BYTES + 1]);
    assert_eq!(
        refused(call_raw(&mut c, "CheckBatch", oversize, Some(TOKEN)).await),
        (
            Code::ResourceExhausted,
            format!("body: length limit exceeded ({MAX_BATCH_BYTES} bytes)")
        )
    );
    assert_eq!(
        refused(
            call(
                &mut c,
                Method::CheckBatch,
                &batch("dee", MAX_BATCH + 1),
                Some(TOKEN)
            )
            .await
        ),
        (
            Code::ResourceExhausted,
            format!("checks: more than {MAX_BATCH} checks")
        )
    );
    assert_eq!(
        refused(call_raw(&mut c, "Nope", Bytes::from_static(b"{}"), Some(TOKEN)).await).0,
        Code::Unimplemented
    );
    // Counted as the routes count theirs: the two garbled bodies (gRPC and
    // HTTP), the oversized message and the batch of too many checks.
    let bad = gw
        .app
        .metrics
        .errors
        .with_label_values(&["bad_request"])
        .get();
    assert_eq!(bad, 4);
    assert_eq!(
        gw.app
            .metrics
            .errors
            .with_label_values(&["unknown_domain"])
            .get(),
        1
    );
    // Nothing got past a refusal into Redis.
    assert_eq!(redis.contents().unwrap(), "");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_call_is_refused_before_its_message_arrives() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "auth-first").await;
    let tcp = tokio::net::TcpStream::connect(gw.grpc_addr.unwrap())
        .await
        .unwrap();
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let req = http::Request::post(format!("http://gateway/{SERVICE}/CheckBatch"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut body) = client.send_request(req, false).unwrap();
    // 4 MB announced, 1 KiB sent, the rest never: the answer must not wait
    // for it. (The refusal may close the stream before these go out.)
    let mut header = vec![0u8];
    header.extend_from_slice(&4_000_000u32.to_be_bytes());
    let _ = body.send_data(Bytes::from(header), false);
    let _ = body.send_data(Bytes::from(vec![b' '; 1024]), false);
    let resp = tokio::time::timeout(Duration::from_secs(2), resp)
        .await
        .expect("no answer while the message was still unsent")
        .unwrap();
    // A refusal before any message is a trailers-only answer.
    assert_eq!(resp.headers()["grpc-status"], "16", "UNAUTHENTICATED");
    let failures = gw.app.metrics.auth_failures.with_label_values(&["missing"]);
    assert_eq!(failures.get(), 1);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_service_reports_the_protocol_service() {
    let redis = Redis::start().unwrap();
    let gw = gateway(&redis, "health").await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", gw.grpc_addr.unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let req = || tonic_health::pb::HealthCheckRequest {
        service: SERVICE.into(),
    };
    // The first probe runs as the server starts; its answer comes soon after.
    let mut status = None;
    for _ in 0..100 {
        match health.check(req()).await {
            Ok(r) => {
                status = Some(r.into_inner().status);
                break;
            }
            Err(e) => assert_eq!(e.code(), Code::NotFound, "{e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status, Some(1), "SERVING");
    gw.stop().await.unwrap();
}
