//! `global.transport: grpc` on the wasmtime host harness: the callouts go
//! by `proxy_grpc_call` to the gateway's `ratelimit_wasm.v3.Gateway`
//! methods, with the same JSON messages as the HTTP routes, and a call's
//! gRPC status reads as the HTTP status it stands for. The real Envoy and
//! gateway side is `tests/envoy_batch.rs`.

mod harness;

use harness::{Harness, HttpCall, Options, Request, StreamId};
use serde_json::{json, Value};

const CLUSTER: &str = "ratelimit_gateway_grpc";

/// `api`: global, 2 a minute per client, failing closed; the circuit opens
/// after one failure.
fn config(coalesce_us: u64) -> String {
    json!({
        "domain": "grpc",
        "response": { "retry_jitter": 0 },
        "global": { "cluster": CLUSTER, "transport": "grpc", "token": "s3cret",
                    "timeout_ms": 50, "failure_mode": "closed",
                    "coalesce_us": coalesce_us, "max_batch": 3,
                    "circuit": { "failures": 1, "cooldown_ms": 60_000 } },
        "rules": [
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [{ "requests": 2, "per": "1m" }] }
        ]
    })
    .to_string()
}

fn harness(coalesce_us: u64) -> Harness {
    let h = Harness::running(Options::new(1, config(coalesce_us)).clusters(&[CLUSTER]));
    assert_eq!(h.configure_results(), vec![true]);
    h
}

fn client(id: &str) -> Request {
    Request::get("/").header("x-client-id", id)
}

fn status(h: &Harness, id: StreamId) -> Option<u16> {
    let o = h.outcome(id);
    o.completed.then_some(o.status)
}

/// One check's result, as the gateway writes it.
fn result(allowed: bool) -> Value {
    json!({ "allowed": allowed, "buckets": [ { "limits": [
        { "requests": 2, "window_ms": 60_000, "algorithm": "token_bucket",
          "allowed": allowed, "remaining": if allowed { 1 } else { 0 }, "reset_ms": 30_000,
          "retry_after_ms": if allowed { 0 } else { 30_000 } } ] } ] })
}

/// The one gRPC call pending: its method, and its message's JSON.
fn pending(h: &Harness) -> (HttpCall, String, Value) {
    let call = h.the_pending_call("gRPC call");
    let (service, method) = call.grpc.clone().expect("a gRPC call");
    assert_eq!(service, "ratelimit_wasm.v3.Gateway");
    // The upstream is the serialized GrpcService naming cluster and authority.
    let mut upstream = vec![0x0a, (2 + CLUSTER.len() + 2 + 17) as u8, 0x0a];
    upstream.push(CLUSTER.len() as u8);
    upstream.extend_from_slice(CLUSTER.as_bytes());
    upstream.extend_from_slice(b"\x12\x11ratelimit-gateway");
    assert_eq!(call.upstream.as_bytes(), upstream.as_slice());
    assert_eq!(
        call.header("authorization").as_deref(),
        Some("Bearer s3cret")
    );
    assert_eq!(call.timeout_ms, 50);
    let body = serde_json::from_slice(&call.body).unwrap();
    (call, method, body)
}

#[test]
fn coalesced_checks_go_by_check_batch_each_with_its_own_answer() {
    let h = harness(500);
    let a = h.begin(0, client("a"));
    let (first, method, body) = pending(&h);
    assert_eq!(method, "CheckBatch");
    assert_eq!(
        (body["version"].clone(), body["domain"].clone()),
        (json!(3), json!("grpc"))
    );
    let (b, c) = (h.begin(0, client("b")), h.begin(0, client("c")));
    assert_eq!(
        h.pending_http_calls().len(),
        1,
        "b and c wait for the call in flight"
    );
    let answer = |results: Vec<Value>| json!({ "version": 3, "results": results }).to_string();
    h.respond_grpc_call(
        first.worker,
        first.token,
        0,
        answer(vec![result(true)]).as_bytes(),
    );
    assert_eq!(status(&h, a), Some(200));
    let (second, method, body) = pending(&h);
    assert_eq!(method, "CheckBatch");
    assert_eq!(body["checks"].as_array().unwrap().len(), 2);
    h.respond_grpc_call(
        second.worker,
        second.token,
        0,
        answer(vec![result(true), result(false)]).as_bytes(),
    );
    assert_eq!(status(&h, b), Some(200));
    assert_eq!(status(&h, c), Some(429));
    assert_eq!(h.outcome(c).header("retry-after").as_deref(), Some("30"));
    h.flush_metrics();
    assert_eq!(h.metric("ratelimit_wasm_global_batches"), 2);
}

#[test]
fn one_call_per_request_goes_by_check() {
    let h = harness(0);
    let a = h.begin(0, client("a"));
    let (call, method, body) = pending(&h);
    assert_eq!(method, "Check");
    assert_eq!(body["version"], 2);
    let answer =
        json!({ "version": 2, "allowed": false, "buckets": [result(false)["buckets"][0]] });
    h.respond_grpc_call(call.worker, call.token, 0, answer.to_string().as_bytes());
    assert_eq!(status(&h, a), Some(429));
}

#[test]
fn a_refusal_is_an_answer_but_unavailable_and_a_timeout_are_failures() {
    let h = harness(0);
    // INVALID_ARGUMENT (the gateway's 400): the check fails closed, and the
    // gateway, which answered, keeps the circuit closed (one failure opens it).
    let a = h.begin(0, client("a"));
    let (call, _, _) = pending(&h);
    h.respond_grpc_call(call.worker, call.token, 3, b"");
    assert_eq!(status(&h, a), Some(503));
    let b = h.begin(0, client("b"));
    let (call, _, _) = pending(&h);
    // UNAVAILABLE (Envoy cannot reach the gateway, or Redis failed): a failure.
    h.respond_grpc_call(call.worker, call.token, 14, b"");
    assert_eq!(status(&h, b), Some(503));
    // The circuit is open: the next request fails closed without a call.
    let c = h.begin(0, client("c"));
    assert_eq!(status(&h, c), Some(503));
    assert!(h.pending_http_calls().is_empty());
}

#[test]
fn a_grpc_call_past_its_timeout_fails_by_the_failure_mode() {
    let h = harness(0);
    let a = h.begin(0, client("a"));
    pending(&h);
    h.advance_ms(60);
    assert_eq!(status(&h, a), Some(503));
    // DEADLINE_EXCEEDED is no answer: it counts against the circuit.
    let b = h.begin(0, client("b"));
    assert_eq!(status(&h, b), Some(503));
    assert!(h.pending_http_calls().is_empty());
}
