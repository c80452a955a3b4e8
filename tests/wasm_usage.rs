//! Charging from the response in the compiled filter, run in the wasmtime
//! harness: a reservation when the request arrives, settled to the cost the
//! response reports (a header, the JSON body, the events of a stream) at
//! most `max`, debt and the `Retry-After` that covers it, `charge_on`
//! refunds, and bodies that say nothing usable.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};
use std::time::Duration;

/// `rules` for domain "usage", without jitter.
fn cfg(rules: Value) -> String {
    json!({"domain": "usage", "response": {"retry_jitter": 0}, "rules": rules}).to_string()
}

fn harness(config: &str) -> Harness {
    Harness::running(Options::new(2, config))
}

fn client(id: &str) -> Request {
    Request::get("/v1/chat/completions").header("x-client-id", id)
}

/// A request of `id` whose upstream answers `upstream`.
fn call(h: &Harness, w: usize, id: &str, upstream: Upstream) -> Outcome {
    h.send(w, client(id).upstream(upstream))
}

/// 1,000 tokens a minute per client, each response's cost in `x-usage-tokens`.
fn tokens_per_minute() -> String {
    cfg(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1m"}],
        "cost_from": {"header": "x-usage-tokens", "max": 4000, "reserve": 100}
    }]))
}

fn used(tokens: u64) -> Upstream {
    Upstream::new(200, "{}").header("x-usage-tokens", tokens.to_string())
}

#[test]
fn responses_of_300_300_and_500_tokens_put_the_client_in_debt_until_the_refill_covers_it() {
    let h = harness(&tokens_per_minute());
    // The headers show the state after the reservation of 100.
    let o = call(&h, 0, "ann", used(300));
    assert_eq!(
        (o.status, o.header("x-ratelimit-remaining").as_deref()),
        (200, Some("900"))
    );
    let o = call(&h, 1, "ann", used(300));
    // 300 settled, then 100 reserved: 600 left.
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("600"));
    let o = call(&h, 0, "ann", used(500));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("300"));
    // 1,100 spent of 1,000: 100 in debt, and the next reservation needs 100
    // more: 200 tokens at 60 ms each.
    let o = call(&h, 1, "ann", used(1));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.header("retry-after").as_deref(), Some("12"));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("0"));
    h.advance(Duration::from_millis(11_999));
    assert_eq!(call(&h, 0, "ann", used(1)).status, 429);
    h.advance(Duration::from_millis(1));
    // 900 spent after the refill, 100 reserved: nothing left, exactly.
    let o = call(&h, 0, "ann", used(100));
    assert_eq!(
        (o.status, o.header("x-ratelimit-remaining").as_deref()),
        (200, Some("0"))
    );
    assert_eq!(call(&h, 1, "ann", used(1)).status, 429);
    // Another client's bucket is its own.
    assert_eq!(call(&h, 1, "bob", used(1)).status, 200);
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 5);
}

#[test]
fn a_response_under_its_reservation_gives_the_rest_back() {
    let h = harness(&tokens_per_minute());
    for _ in 0..30 {
        assert_eq!(call(&h, 0, "ann", used(10)).status, 200);
    }
    // 300 spent: 700 left before the next reservation.
    let o = call(&h, 1, "ann", used(10));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("600"));
}

#[test]
fn a_header_cost_above_max_charges_max_and_a_missing_one_keeps_the_reservation() {
    let h = harness(&cfg(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1h"}],
        "cost_from": {"header": "x-usage-tokens", "max": 400, "reserve": 50}
    }])));
    let o = call(&h, 0, "ann", used(1_000_000_000_000));
    assert_eq!(o.status, 200);
    // 400 charged: 550 left before the next reservation of 50.
    let o = call(&h, 0, "ann", Upstream::new(200, "{}"));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("550"));
    let o = call(
        &h,
        0,
        "ann",
        Upstream::new(200, "{}").header("x-usage-tokens", "12 tokens"),
    );
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("500"));
    let o = call(&h, 1, "ann", used(0));
    assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("450"));
    assert_eq!(h.metric("ratelimit_wasm_usage_capped"), 1);
    assert_eq!(h.metric("ratelimit_wasm_usage_missing"), 2);
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 2);
}

#[test]
fn charge_on_2xx_refunds_404s_and_503s_and_a_stream_reset_before_its_response() {
    let h = harness(&cfg(json!([{
        "name": "calls", "key": ["client"],
        "limits": [{"requests": 3, "per": "1h"}],
        "charge_on": ["2xx"]
    }])));
    for i in 0..10 {
        let status = if i % 2 == 0 { 404 } else { 503 };
        let o = call(&h, i % 2, "ann", Upstream::new(status, "no"));
        assert_eq!(o.status, status, "request {i}: {o:?}");
        // The headers show the charge; the refund follows the response.
        assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some("2"));
    }
    // The client leaves before the upstream answers: nothing charged.
    let id = h.begin(0, client("ann").hold_upstream());
    let o = h.cancel(id);
    assert!(o.completed && o.cancelled, "{o:?}");
    for i in 0..3 {
        assert_eq!(call(&h, i % 2, "ann", Upstream::new(200, "ok")).status, 200);
    }
    assert_eq!(call(&h, 0, "ann", Upstream::new(200, "ok")).status, 429);
    assert_eq!(h.metric("ratelimit_wasm_charge_refunded"), 11);
}

#[test]
fn charge_on_holds_codes_as_well_as_classes() {
    let h = harness(&cfg(json!([{
        "name": "calls", "key": ["client"],
        "limits": [{"requests": 2, "per": "1h"}],
        "charge_on": ["2xx", "304"]
    }])));
    assert_eq!(call(&h, 0, "ann", Upstream::new(304, "")).status, 304);
    assert_eq!(call(&h, 0, "ann", Upstream::new(302, "")).status, 302);
    assert_eq!(call(&h, 0, "ann", Upstream::new(201, "")).status, 201);
    assert_eq!(call(&h, 0, "ann", Upstream::new(200, "")).status, 429);
}

/// Requests in flight together each hold only their reservation; when their
/// responses all report more, each overruns by at most `max − reserve`, and
/// the next request waits for the whole debt (docs/llm.md, "The bound").
#[test]
fn concurrent_requests_overrun_by_at_most_max_minus_reserve_each() {
    let h = harness(&cfg(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1h"}],
        "cost_from": {"header": "x-usage-tokens", "max": 400, "reserve": 100}
    }])));
    // Ten reservations of 100 fill the bucket; the eleventh is refused.
    let held: Vec<_> = (0..10)
        .map(|i| h.begin(i % 2, client("ann").hold_upstream()))
        .collect();
    assert_eq!(call(&h, 0, "ann", used(1)).status, 429);
    for id in held {
        let o = h.respond_upstream(id, used(1_000_000));
        assert_eq!(o.status, 200, "{o:?}");
    }
    assert_eq!(h.metric("ratelimit_wasm_usage_capped"), 10);
    // 10 × (400 − 100) = 3,000 in debt; the next reservation needs 3,100
    // tokens at 3.6 s each.
    let o = call(&h, 1, "ann", used(1));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.header("retry-after").as_deref(), Some("11160"));
}

/// The debt a settlement may leave is bounded at `DEBT_OVERRUNS` (1,024)
/// responses of `max`, however many requests overran together.
#[test]
fn the_debt_is_capped_at_1024_responses_of_max() {
    let h = harness(&cfg(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 10, "per": "10s"}],
        "cost_from": {"header": "x-usage-tokens", "max": 2, "reserve": 0}
    }])));
    // A reservation of 0 admits any number at once: 2,000 in flight.
    let held: Vec<_> = (0..2000)
        .map(|i| h.begin(i % 2, client("ann").hold_upstream()))
        .collect();
    for id in held {
        assert_eq!(h.respond_upstream(id, used(2)).status, 200);
    }
    // 4,000 reported past an empty bucket of 10; the debt kept is 1,024 × 2
    // = 2,048 tokens, which refill at 1 a second.
    let o = call(&h, 1, "ann", used(0));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.header("retry-after").as_deref(), Some("2048"));
}

/// What the filter does today with a shadow rule charged from the
/// response: its bucket is watched at the reservation and never settled or
/// refunded (only enforced charges are held for settlement). `ratelimit
/// explain` says so (cli/src/charging.rs); change both together.
#[test]
fn a_shadow_rule_is_settled_and_refunded_as_an_enforced_one() {
    let h = harness(&cfg(json!([{
        "name": "tokens", "key": ["client"], "mode": "shadow",
        "limits": [{"requests": 1000, "per": "1h"}],
        "cost_from": {"header": "x-usage-tokens", "max": 4000, "reserve": 100},
        "charge_on": ["2xx"]
    }])));
    // Each shows its reservation; the next shows the settlement of 400 before it.
    for left in ["900", "500", "100"] {
        let o = call(&h, 0, "ann", used(400));
        assert_eq!(o.status, 200);
        assert_eq!(o.header("x-ratelimit-remaining").as_deref(), Some(left));
    }
    // 1,200 spent: a shadow rule never rejects, but it counts the debt.
    let o = call(&h, 0, "ann", Upstream::new(500, "{}"));
    assert_eq!(o.status, 500);
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 1);
    // The 500 found no room, so it was never charged and nothing settles.
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 3);
}

/// A body of `parts`, each repeated `times`, cut into Envoy-sized chunks.
fn hostile(parts: &[(&[u8], usize)], content_type: &str) -> Upstream {
    let mut body = Vec::new();
    for (part, times) in parts {
        for _ in 0..*times {
            body.extend_from_slice(part);
        }
    }
    Upstream::new(200, body)
        .header("content-type", content_type)
        .chunked(16 * 1024)
}

#[test]
fn hostile_bodies_keep_the_reservation_without_a_trap_or_memory_growth() {
    let h = harness(&cfg(json!([{
        "name": "tokens", "key": ["client"],
        "limits": [{"requests": 1000000, "per": "1h"}],
        "cost_from": {"preset": "openai_chat", "max": 4000, "reserve": 100,
            "scan_limit": 67108864}
    }])));
    // Warm both workers on a plain response, then note their memory.
    for w in 0..2 {
        call(
            &h,
            w,
            "warm",
            Upstream::new(
                200,
                r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
            ),
        );
    }
    let before: Vec<usize> = (0..2).map(|w| h.memory_bytes(w)).collect();
    let mib_line: &[u8] = &[b'a'; 1024];
    let bodies = [
        // An SSE line of 1 MiB, then a usage event that must still count.
        hostile(&[(b"data: {\"x\":\"", 1), (mib_line, 1024), (b"\"}\n\n", 1),
            (b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n", 1)], "text/event-stream"),
        // 10^5 events.
        hostile(&[(b"data: {\"usage\":null,\"choices\":[]}\n\n", 100_000)], "text/event-stream"),
        // A nesting depth of 10^4.
        hostile(&[(b"[", 10_000), (b"]", 10_000)], "application/json"),
        hostile(&[(b"{\"a\":", 10_000), (b"1", 1), (b"}", 10_000)], "application/json"),
        // Invalid UTF-8 around the usage.
        hostile(&[(b"{\"\xff\xfe\":\"\xc3\x28\",\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":6}}", 1)], "application/json"),
    ];
    for (i, body) in bodies.into_iter().enumerate() {
        let o = call(&h, i % 2, "ann", body);
        assert_eq!(o.status, 200, "body {i}: {o:?}");
    }
    for (w, before) in before.iter().enumerate() {
        let grown = h.memory_bytes(w).saturating_sub(*before);
        // The 1 MiB chunks pass through the VM one at a time (16 KiB); the
        // scan state is a few KiB. Nothing near a body's size stays.
        println!("worker {w}: linear memory grew by {grown} bytes");
        assert!(grown <= 256 * 1024, "worker {w} grew by {grown} bytes");
    }
    // Settled: the two warm-ups, the stream after the 1 MiB line (7) and the
    // body with invalid UTF-8 around its usage (11); the 10^5 events without
    // usage and the two deep documents keep their reservation.
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 4);
    assert_eq!(h.metric("ratelimit_wasm_usage_missing"), 3);
}

/// A global rule of 1,000 tokens a minute, each response's cost in `x-usage-tokens`.
fn global_tokens(charge_on: Option<Value>) -> String {
    let mut rule = json!({
        "name": "tokens", "scope": "global", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1m"}],
        "cost_from": {"header": "x-usage-tokens", "max": 4000, "reserve": 100}
    });
    if let Some(on) = charge_on {
        rule["charge_on"] = on;
    }
    json!({"domain": "usage", "response": {"retry_jitter": 0},
           "global": { "coalesce_us": 0, "cluster": "gw", "failure_mode": "closed"}, "rules": [rule]})
    .to_string()
}

/// The gateway's answer allowing one token-bucket limit of 1,000 a minute.
fn allowed(remaining: u64) -> CallResponse {
    CallResponse::new(200).body(
        json!({"version": 2, "allowed": true, "buckets": [{"limits": [{
            "requests": 1000, "window_ms": 60000, "algorithm": "token_bucket", "allowed": true,
            "remaining": remaining, "reset_ms": 6000, "retry_after_ms": 0}]}]})
        .to_string(),
    )
}

/// Runs one request of `id` through its check (allowed) and its response
/// `upstream`; the reservation id its check named.
fn through_the_gateway(h: &Harness, w: usize, id: &str, upstream: Upstream) -> (Outcome, String) {
    let stream = h.begin(w, client(id).upstream(upstream));
    let check = h.the_pending_call("check");
    assert_eq!(check.header(":path").as_deref(), Some("/v1/check"));
    let body: Value = serde_json::from_slice(&check.body).unwrap();
    assert_eq!(body["buckets"][0]["cost"], 100, "{body}");
    let reservation = body["reservation"].as_str().unwrap().to_string();
    assert_eq!(reservation.len(), 16, "{body}");
    h.respond_http_call(check.worker, check.token, allowed(900));
    (h.outcome(stream), reservation)
}

#[test]
fn a_global_rule_reserves_on_the_gateway_and_settles_there_once_the_response_is_known() {
    let h = Harness::running(Options::new(2, global_tokens(None)).clusters(&["gw"]));
    let (o, reservation) = through_the_gateway(&h, 0, "ann", used(350));
    assert_eq!((o.status, o.completed), (200, true), "{o:?}");
    // Nothing leaves before the root's tick: the stream's context is gone.
    assert!(h.pending_http_calls().is_empty());
    h.tick(0);
    let settle = h.the_pending_call("settle call");
    assert_eq!(settle.header(":path").as_deref(), Some("/v1/settle"));
    assert_eq!(settle.timeout_ms, 1000);
    let body: Value = serde_json::from_slice(&settle.body).unwrap();
    assert_eq!(
        body,
        json!({"version": 2, "domain": "usage", "settlements": [{"reservation": reservation,
            "buckets": [{"rule": "tokens", "key": "tokens/c=ann", "tag": "c=ann",
                         "variant": "default", "cost": 350}]}]})
    );
    h.respond_http_call(
        settle.worker,
        settle.token,
        CallResponse::new(200).body(r#"{"version":2,"settled":[true]}"#),
    );
    assert_eq!(h.metric("ratelimit_wasm_global_settled"), 1);
    assert_eq!(h.metric("ratelimit_wasm_global_settle_failed"), 0);

    // A response that cost its reservation settles too, changing nothing
    // but the record, which the gateway then deletes instead of keeping it
    // for an hour. Every check reserves under an id of its own, without
    // retry_jitter too; one call carries the worker's settlements.
    let (o, other) = through_the_gateway(&h, 1, "bob", used(100));
    assert_eq!(o.status, 200);
    assert_ne!(other, reservation);
    let (_, third) = through_the_gateway(&h, 1, "bob", used(100));
    assert!(third != other && third != reservation, "{third}");
    h.tick_all();
    let settle = h.the_pending_call("settle call of worker 1");
    let body: Value = serde_json::from_slice(&settle.body).unwrap();
    let bucket = json!([{"rule": "tokens", "key": "tokens/c=bob", "tag": "c=bob",
                         "variant": "default", "cost": 100}]);
    assert_eq!(
        body["settlements"],
        json!([{"reservation": other, "buckets": bucket},
               {"reservation": third, "buckets": bucket}])
    );
}

#[test]
fn settlements_that_cannot_be_delivered_are_retried_three_times_then_given_up() {
    let h = Harness::running(Options::new(1, global_tokens(None)).clusters(&["gw"]));
    let (_, reservation) = through_the_gateway(&h, 0, "ann", used(0));
    for attempt in 1..=3 {
        h.tick(0);
        let settle = h.the_pending_call(&format!("settle call at attempt {attempt}"));
        let body: Value = serde_json::from_slice(&settle.body).unwrap();
        assert_eq!(body["settlements"][0]["reservation"], reservation.as_str());
        assert_eq!(body["settlements"][0]["buckets"][0]["cost"], 0);
        h.respond_http_call(
            settle.worker,
            settle.token,
            CallResponse::new(503).body("{}"),
        );
    }
    h.tick(0);
    assert!(h.pending_http_calls().is_empty());
    assert_eq!(h.metric("ratelimit_wasm_global_settle_failed"), 1);
    assert_eq!(h.metric("ratelimit_wasm_global_settled"), 0);
}

#[test]
fn a_global_rule_charged_on_2xx_gives_a_503_its_whole_reservation_back() {
    let h =
        Harness::running(Options::new(1, global_tokens(Some(json!(["2xx"])))).clusters(&["gw"]));
    let (o, reservation) = through_the_gateway(&h, 0, "ann", Upstream::new(503, "{}"));
    assert_eq!(o.status, 503);
    h.tick(0);
    let settle = h.the_pending_call("settle call");
    let body: Value = serde_json::from_slice(&settle.body).unwrap();
    assert_eq!(body["settlements"][0]["reservation"], reservation.as_str());
    assert_eq!(body["settlements"][0]["buckets"][0]["cost"], 0);
    h.respond_http_call(
        settle.worker,
        settle.token,
        CallResponse::new(200).body(r#"{"version":2,"settled":[false]}"#),
    );
    assert_eq!(h.metric("ratelimit_wasm_global_settle_unmatched"), 1);
}
