//! Concurrency limits (`{"concurrent": N}`) in the compiled filter, run in
//! the wasmtime harness over two workers: at most N requests of a key in
//! flight, a 429 with `Retry-After: 1` past it, the slot given back however
//! the stream ends, and a slot never given back reclaimed at its deadline.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};
use std::time::Duration;

fn cfg(rules: Value) -> String {
    json!({"domain": "inflight", "response": {"retry_jitter": 0.5}, "rules": rules,
        "identity": {"clients": {"soft-sam": {"soft": true}}}})
    .to_string()
}

fn harness(config: &str) -> Harness {
    Harness::running(Options::new(2, config))
}

fn client(id: &str) -> Request {
    Request::get("/slow").header("x-client-id", id)
}

/// Three in flight per client, slots held at most a minute.
fn three() -> String {
    cfg(json!([{
        "name": "streams", "key": ["client"],
        "limits": [{"concurrent": 3, "max_in_flight": "1m"}]
    }]))
}

#[test]
fn three_in_flight_then_429_with_retry_after_1_until_one_ends() {
    let h = harness(&three());
    let held: Vec<StreamId> = (0..3)
        .map(|i| h.begin(i % 2, client("ann").hold_upstream()))
        .collect();
    for (i, id) in held.iter().enumerate() {
        let o = h.outcome(*id);
        assert_eq!(o.phase, StreamPhase::AwaitingUpstream, "request {i}: {o:?}");
    }
    let o = h.send(1, client("ann"));
    assert_eq!(o.status, 429, "{o:?}");
    // No spread on a slot's wait, whatever retry_jitter says.
    assert_eq!(o.header("retry-after").as_deref(), Some("1"));
    assert_eq!(
        o.header("ratelimit-policy").as_deref(),
        Some("\"streams\";q=3;qu=\"concurrent-requests\"")
    );
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(o.body_json()["violated-policies"], json!(["streams"]));
    // Another client has its own three.
    assert_eq!(h.send(0, client("bob")).status, 200);
    // One ends: one more fits, and the response it gets says so.
    let done = h.respond_upstream(held[0], Upstream::new(200, "done"));
    assert!(done.completed, "{done:?}");
    // Its headers say what was left when it was admitted, first of three.
    assert_eq!(done.header("x-ratelimit-remaining").as_deref(), Some("2"));
    let id = h.begin(0, client("ann").hold_upstream());
    assert_eq!(h.outcome(id).phase, StreamPhase::AwaitingUpstream);
    assert_eq!(h.send(0, client("ann")).status, 429);
    // A client leaving while its request is upstream gives its slot back too.
    assert!(h.cancel(held[1]).cancelled);
    let o = h.send(1, client("ann"));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("0"));
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 2);
}

#[test]
fn the_headers_show_the_slots_left() {
    let h = harness(&three());
    let first = h.begin(0, client("ann").hold_upstream());
    let o = h.send(1, client("ann"));
    // One in flight and this one: one left while it ran.
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("1"));
    assert_eq!(o.header("x-ratelimit-limit").as_deref(), Some("3"));
    let o = h.respond_upstream(first, Upstream::new(200, ""));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("2"));
}

#[test]
fn a_slot_never_given_back_is_reclaimed_at_its_deadline() {
    let h = harness(&three());
    // Three requests whose streams never end (a VM that died holding them
    // looks the same to the others).
    for i in 0..3 {
        h.begin(i % 2, client("ann").hold_upstream());
    }
    h.advance(Duration::from_millis(59_999));
    assert_eq!(h.send(0, client("ann")).status, 429);
    h.advance(Duration::from_millis(1));
    assert_eq!(h.send(1, client("ann")).status, 200);
}

#[test]
fn a_soft_client_goes_on_without_a_slot_and_is_counted() {
    let h = harness(&three());
    for i in 0..3 {
        h.begin(i % 2, client("soft-sam").hold_upstream());
    }
    let o = h.send(0, client("soft-sam"));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 1);
}

#[test]
fn a_rate_limit_refused_request_holds_no_slot_and_a_full_key_refunds_the_rate_charge() {
    let h = harness(&cfg(json!([
        {"name": "rate", "key": ["client"], "limits": [{"requests": 2, "per": "1h"}]},
        {"name": "streams", "key": ["client"], "limits": [{"concurrent": 1}]}
    ])));
    let held = h.begin(0, client("ann").hold_upstream());
    // Refused by the slot: the rate charge is given back.
    for _ in 0..5 {
        assert_eq!(h.send(1, client("ann")).status, 429);
    }
    h.respond_upstream(held, Upstream::new(200, ""));
    // One of two rate tokens was spent: one more passes, then the rate denies.
    assert_eq!(h.send(0, client("ann")).status, 200);
    let o = h.send(1, client("ann"));
    assert_eq!(o.status, 429);
    assert_eq!(o.body_json()["violated-policies"], json!(["rate"]));
}

/// Three in flight per client on the gateway (`scope: global`).
fn global_three() -> String {
    json!({"domain": "inflight", "response": {"retry_jitter": 0},
        "global": { "coalesce_us": 0, "cluster": "gw", "failure_mode": "closed"},
        "rules": [{"name": "streams", "scope": "global", "key": ["client"],
                   "limits": [{"concurrent": 3, "max_in_flight": "1m"}]}]})
    .to_string()
}

/// The gateway's answer to a check of one slot.
fn slot_answer(allowed: bool, remaining: u64) -> CallResponse {
    let wait = if allowed { 0 } else { 1000 };
    CallResponse::new(200).body(
        json!({"version": 2, "allowed": allowed, "buckets": [{"limits": [{
            "requests": 3, "window_ms": 60000, "algorithm": "token_bucket", "in_flight": true,
            "allowed": allowed, "remaining": remaining, "reset_ms": wait, "retry_after_ms": wait}]}]})
        .to_string(),
    )
}

/// The one callout waiting for its answer, and its JSON body.
fn the_pending_call(h: &Harness, what: &str) -> (HttpCall, Value) {
    let call = h.the_pending_call(what);
    let body = serde_json::from_slice(&call.body).unwrap_or(Value::Null);
    (call, body)
}

/// The settlement that releases `reservation`'s slot of ann's `streams`.
fn release_of(reservation: &str) -> Value {
    json!({"version": 2, "domain": "inflight", "settlements": [{"reservation": reservation,
        "buckets": [{"rule": "streams", "key": "streams/c=ann", "tag": "c=ann",
                     "variant": "default", "cost": 0}]}]})
}

#[test]
fn a_global_slot_is_taken_under_a_reservation_and_released_on_the_gateway_when_the_stream_ends() {
    let h = Harness::running(Options::new(2, global_three()).clusters(&["gw"]));
    let stream = h.begin(0, client("ann").hold_upstream());
    let (check, body) = the_pending_call(&h, "check");
    assert_eq!(body["buckets"][0]["cost"], 1, "{body}");
    let reservation = body["reservation"].as_str().unwrap().to_string();
    h.respond_http_call(check.worker, check.token, slot_answer(true, 2));
    // In flight: the slot is held, nothing is settled yet, whatever the tick.
    h.tick_all();
    assert!(h.pending_http_calls().is_empty());
    let o = h.respond_upstream(stream, Upstream::new(200, "{}"));
    assert_eq!(o.status, 200);
    assert_eq!(
        o.header("ratelimit-policy").as_deref(),
        Some("\"streams\";q=3;qu=\"concurrent-requests\"")
    );
    h.tick(0);
    let (settle, body) = the_pending_call(&h, "settle call");
    assert_eq!(settle.header(":path").as_deref(), Some("/v1/settle"));
    assert_eq!(body, release_of(&reservation));
    h.respond_http_call(
        settle.worker,
        settle.token,
        CallResponse::new(200).body(r#"{"version":2,"settled":[true]}"#),
    );
    assert_eq!(h.metric("ratelimit_wasm_global_settled"), 1);
}

#[test]
fn a_full_global_key_is_429_with_retry_after_1_and_is_never_answered_from_the_deny_cache() {
    let h = Harness::running(Options::new(1, global_three()).clusters(&["gw"]));
    for round in 0..2 {
        let stream = h.begin(0, client("ann"));
        let (check, _) = the_pending_call(&h, &format!("check {round}"));
        h.respond_http_call(check.worker, check.token, slot_answer(false, 0));
        let o = h.outcome(stream);
        assert_eq!(o.status, 429, "{o:?}");
        assert_eq!(o.header("retry-after").as_deref(), Some("1"));
    }
    // A denied check took no slot: nothing to release.
    h.tick(0);
    assert!(h.pending_http_calls().is_empty());
}

#[test]
fn a_client_that_leaves_while_its_check_is_on_its_way_releases_the_slot_it_may_hold() {
    let h = Harness::running(Options::new(1, global_three()).clusters(&["gw"]));
    let stream = h.begin(0, client("ann"));
    let (_, body) = the_pending_call(&h, "check");
    let reservation = body["reservation"].as_str().unwrap().to_string();
    h.cancel(stream);
    h.tick(0);
    let settles: Vec<HttpCall> = h
        .pending_http_calls()
        .into_iter()
        .filter(|c| c.header(":path").as_deref() == Some("/v1/settle"))
        .collect();
    let [settle] = settles.as_slice() else {
        panic!("one settle call expected: {settles:?}");
    };
    let body: Value = serde_json::from_slice(&settle.body).unwrap();
    assert_eq!(body, release_of(&reservation));
}

#[test]
fn under_failure_mode_local_a_failed_check_goes_on_without_a_slot_and_releases_what_it_may_hold() {
    let config = global_three().replace("\"closed\"", "\"local\"");
    let h = Harness::running(Options::new(1, config).clusters(&["gw"]));
    let mut reservations = Vec::new();
    for n in 0..5 {
        let stream = h.begin(0, client("ann").hold_upstream());
        let (check, body) = the_pending_call(&h, &format!("check {n}"));
        reservations.push(body["reservation"].as_str().unwrap().to_string());
        // A timeout may come after the gateway took the slot.
        h.timeout_http_call(check.worker, check.token);
        assert!(
            h.open_streams().contains(&stream),
            "request {n} goes upstream"
        );
    }
    // No stand-in holds a slot here, and each slot the gateway may hold is released.
    h.tick(0);
    let (_, body) = the_pending_call(&h, "settle call");
    let released: Vec<&str> = body["settlements"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["reservation"].as_str().unwrap())
        .collect();
    assert_eq!(released, reservations);
}
