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
