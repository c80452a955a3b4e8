//! Coalesced global checks (`global.coalesce_us`, protocol version 3) on the
//! wasmtime host harness: while a batch is in flight, a worker's next checks
//! wait and go together in one `POST /v3/check`, posted by the root context;
//! each request gets its own part of the answer. The real Envoy and gateway
//! side is `tests/envoy_batch.rs`.

mod harness;

use harness::{CallResponse, Harness, HttpCall, Options, Request, StreamId};
use serde_json::{json, Value};

const CLUSTER: &str = "ratelimit_gateway";

/// `api`: global, 2 a minute per client; `local`: 1 a minute per client on
/// `/once`. Batches of at most 3, failing closed.
fn config(circuit_failures: u32) -> String {
    json!({
        "domain": "batch",
        "response": { "retry_jitter": 0 },
        "global": { "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed",
                    "coalesce_us": 500, "max_batch": 3,
                    "circuit": { "failures": circuit_failures, "cooldown_ms": 60_000 } },
        "rules": [
            { "name": "local", "key": ["client"], "match": { "path_prefix": "/once" },
              "limits": [{ "requests": 1, "per": "1m" }] },
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [{ "requests": 2, "per": "1m" }] }
        ]
    })
    .to_string()
}

fn harness(circuit_failures: u32) -> Harness {
    let h = Harness::running(Options::new(1, config(circuit_failures)).clusters(&[CLUSTER]));
    assert_eq!(h.configure_results(), vec![true]);
    h
}

fn client(id: &str) -> Request {
    Request::get("/").header("x-client-id", id)
}

/// One check's result, as the gateway writes it.
fn result(allowed: bool) -> Value {
    json!({ "allowed": allowed, "buckets": [ { "limits": [
        { "requests": 2, "window_ms": 60_000, "algorithm": "token_bucket",
          "allowed": allowed, "remaining": if allowed { 1 } else { 0 }, "reset_ms": 30_000,
          "retry_after_ms": if allowed { 0 } else { 30_000 } } ] } ] })
}

fn batch_answer(results: Vec<Value>) -> CallResponse {
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(json!({ "version": 3, "results": results }).to_string())
}

/// The one batch call pending, and the client keys of its checks in order.
fn pending_batch(h: &Harness) -> (HttpCall, Vec<String>) {
    let call = h.the_pending_call("batch call");
    assert_eq!(call.header(":path").as_deref(), Some("/v3/check"));
    let body: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(body["version"], 3);
    assert_eq!(body["domain"], "batch");
    let keys = body["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["buckets"][0]["key"].as_str().unwrap().to_string())
        .collect();
    (call, keys)
}

fn status(h: &Harness, id: StreamId) -> Option<u16> {
    let o = h.outcome(id);
    o.completed.then_some(o.status)
}

#[test]
fn checks_wait_for_the_batch_in_flight_then_go_together_each_with_its_own_answer() {
    let h = harness(5);
    let a = h.begin(0, client("a"));
    let (first, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 1);
    // While it is in flight, the next checks wait: no second call.
    let (b, c) = (h.begin(0, client("b")), h.begin(0, client("c")));
    assert_eq!(h.pending_http_calls().len(), 1);
    assert_eq!(status(&h, b), None);
    h.respond_http_call(first.worker, first.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, a), Some(200));
    // The answer let the queue go: one call with both checks, in arrival order.
    let (second, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 2);
    assert!(keys[0].contains('b') && keys[1].contains('c'), "{keys:?}");
    // A whole batch (max_batch 3) does not wait for the call in flight.
    let waiting: Vec<StreamId> = ["d", "e"].iter().map(|k| h.begin(0, client(k))).collect();
    assert_eq!(h.pending_http_calls().len(), 1);
    let f = h.begin(0, client("f"));
    assert_eq!(h.pending_http_calls().len(), 2);
    h.respond_http_call(
        second.worker,
        second.token,
        batch_answer(vec![result(true), result(false)]),
    );
    assert_eq!(status(&h, b), Some(200));
    assert_eq!(status(&h, c), Some(429));
    assert_eq!(h.outcome(c).header("retry-after").as_deref(), Some("30"));
    let (third, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 3);
    let refused = json!({ "allowed": false, "error": "key_budget" });
    h.respond_http_call(
        third.worker,
        third.token,
        batch_answer(vec![result(true), result(false), refused]),
    );
    assert_eq!(status(&h, waiting[0]), Some(200));
    assert_eq!(status(&h, waiting[1]), Some(429));
    // A check the gateway could not decide takes the failure mode (closed).
    assert_eq!(status(&h, f), Some(503));
    assert!(h.pending_http_calls().is_empty());
    h.flush_metrics();
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 6);
    assert_eq!(h.metric("ratelimit_wasm_global_batches"), 3);
}

#[test]
fn a_batch_holds_at_most_max_batch_checks() {
    let h = harness(5);
    let first = h.begin(0, client("first"));
    let (call, _) = pending_batch(&h);
    let waiting: Vec<StreamId> = (0..7)
        .map(|i| h.begin(0, client(&format!("w{i}"))))
        .collect();
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, first), Some(200));
    let sizes: Vec<usize> = h
        .pending_http_calls()
        .iter()
        .map(|c| {
            serde_json::from_slice::<Value>(&c.body).unwrap()["checks"]
                .as_array()
                .unwrap()
                .len()
        })
        .collect();
    assert_eq!(sizes, vec![3, 3, 1]);
    for c in h.pending_http_calls() {
        let n = serde_json::from_slice::<Value>(&c.body).unwrap()["checks"]
            .as_array()
            .unwrap()
            .len();
        h.respond_http_call(c.worker, c.token, batch_answer(vec![result(true); n]));
    }
    for id in waiting {
        assert_eq!(status(&h, id), Some(200));
    }
}

#[test]
fn a_failed_batch_fails_each_check_by_its_mode_and_counts_once_in_the_circuit() {
    let h = harness(2);
    let opener = h.begin(0, client("o"));
    let (call, _) = pending_batch(&h);
    let queued: Vec<StreamId> = ["x", "y", "z"]
        .iter()
        .map(|c| h.begin(0, client(c)))
        .collect();
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, opener), Some(200));
    let (call, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 3);
    h.fail_http_call(call.worker, call.token);
    for id in queued {
        assert_eq!(status(&h, id), Some(503));
    }
    h.flush_metrics();
    assert_eq!(h.metric("ratelimit_wasm_global_failures"), 3);
    // Three checks, one failed call: the circuit (2 failures) is still closed.
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 0);
    let next = h.begin(0, client("n"));
    let (call, _) = pending_batch(&h);
    h.fail_http_call(call.worker, call.token);
    assert_eq!(status(&h, next), Some(503));
    h.flush_metrics();
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
}

#[test]
fn an_answer_of_the_wrong_shape_fails_each_check() {
    let h = harness(5);
    let a = h.begin(0, client("a"));
    let (call, _) = pending_batch(&h);
    let b = h.begin(0, client("b"));
    let c = h.begin(0, client("c"));
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, a), Some(200));
    let (call, _) = pending_batch(&h);
    // One result for two checks: whose is it? Neither.
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, b), Some(503));
    assert_eq!(status(&h, c), Some(503));
    // Version 2's single answer is not a batch answer either.
    let d = h.begin(0, client("d"));
    let (call, _) = pending_batch(&h);
    let v2 = CallResponse::new(200)
        .body(json!({ "version": 2, "allowed": true, "buckets": [] }).to_string());
    h.respond_http_call(call.worker, call.token, v2);
    assert_eq!(status(&h, d), Some(503));
}

#[test]
fn a_request_that_leaves_while_queued_is_dropped_and_gives_its_local_charge_back() {
    let h = harness(5);
    let a = h.begin(0, client("a"));
    let (call, _) = pending_batch(&h);
    // `local` allows one /once a minute per client: this one takes it, then leaves.
    let leaving = h.begin(0, client("x").path("/once"));
    let staying = h.begin(0, client("y"));
    h.cancel(leaving);
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, a), Some(200));
    let (call, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 1, "only the request that stayed: {keys:?}");
    assert!(keys[0].contains('y'));
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, staying), Some(200));
    // Its local charge came back: client x's next /once passes the local rule.
    let again = h.begin(0, client("x").path("/once"));
    let (call, _) = pending_batch(&h);
    h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
    assert_eq!(status(&h, again), Some(200));
}

#[test]
fn a_request_that_leaves_while_its_batch_is_in_flight_gets_nothing_and_the_others_do() {
    let h = harness(5);
    let a = h.begin(0, client("a"));
    let b = h.begin(0, client("b"));
    let (call, _) = pending_batch(&h);
    let (call2, keys) = {
        h.respond_http_call(call.worker, call.token, batch_answer(vec![result(true)]));
        pending_batch(&h)
    };
    assert_eq!(status(&h, a), Some(200));
    assert_eq!(keys.len(), 1);
    let c = h.begin(0, client("c"));
    h.cancel(b);
    h.respond_http_call(call2.worker, call2.token, batch_answer(vec![result(true)]));
    assert!(h.outcome(b).cancelled);
    let (call3, keys) = pending_batch(&h);
    assert_eq!(keys.len(), 1);
    h.respond_http_call(call3.worker, call3.token, batch_answer(vec![result(false)]));
    assert_eq!(status(&h, c), Some(429));
}
