//! Paused requests and clock steps, in the wasmtime harness (README "Robustness"):
//! a local reply the host refuses resets the stream instead of leaving it paused, and a
//! step of the wall clock by an hour, back or forward, changes nothing: the filter keeps
//! time on the host's monotonic clock. On a host without one (`no_monotonic_clock`), it
//! runs on the wall clock and every stored deadline is bounded by its own span, so a step
//! back holds nothing longer than that span.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::shared::status::BAD_ARGUMENT;
use harness::*;
use serde_json::{json, Value};

const HOUR: i64 = 3_600 * 1_000_000_000;
const CLUSTER: &str = "ratelimit_gateway";

/// A configuration of `rules` (and `global` when given) for domain "clock", no jitter.
fn cfg(rules: Value, global: Option<Value>) -> String {
    let mut c = json!({ "domain": "clock", "response": { "retry_jitter": 0 }, "rules": rules });
    if let Some(g) = global {
        c["global"] = g;
    }
    c.to_string()
}

/// One worker running `config`, with a gateway on `CLUSTER`; on the wall clock alone
/// unless `monotonic`.
fn one_worker(config: String, monotonic: bool) -> Harness {
    let opts = Options::new(1, config).clusters(&[CLUSTER]);
    Harness::running(if monotonic {
        opts
    } else {
        opts.no_monotonic_clock()
    })
}

fn client(id: &str) -> Request {
    Request::get("/").header("x-client-id", id)
}

/// A global rule `api` (4/min), failure mode closed, breaker: 3 failures, 2 s cooldown.
fn circuit_config() -> String {
    cfg(
        json!([{ "name": "api", "scope": "global", "key": ["client"],
                 "limits": [ { "requests": 4, "per": "1m" } ] }]),
        Some(
            json!({ "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed",
                     "circuit": { "failures": 3, "cooldown_ms": 2000 } }),
        ),
    )
}

/// A graduated rule: 10/min, requests past 100% held 100 ms, denied past 120%.
fn delay_config() -> String {
    cfg(
        json!([{ "name": "grad", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ],
                 "graduated": { "warn_at": 0.8, "delay_at": 1.0, "delay_ms": 100,
                                "reject_at": 1.2, "block_at": 2.0, "block_for": "5m" } }]),
        None,
    )
}

/// A global rule `api` of `requests` per `per` in lease mode (batches of 5%), closed.
fn lease_config(requests: u64, per: &str) -> String {
    cfg(
        json!([{ "name": "api", "scope": "global", "key": ["client"],
                 "limits": [ { "requests": requests, "per": per } ] }]),
        Some(
            json!({ "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed",
                     "lease": { "fraction": 0.05, "max_wait_ms": 20, "ttl_ms": 1000 } }),
        ),
    )
}

/// The gateway's lease answer: `n` tokens granted, a token due in `retry_after_ms`.
fn granted(n: u64, retry_after_ms: u64) -> CallResponse {
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(
            json!({ "version": 2, "granted": n, "limits": [
                { "requests": 100, "window_ms": 3_600_000,
                  "remaining": 0, "reset_ms": 90_000, "retry_after_ms": retry_after_ms } ] })
            .to_string(),
        )
}

/// The gateway's check answer denying one bucket of one limit.
fn denied() -> CallResponse {
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(
            json!({ "version": 2, "allowed": false, "buckets": [ { "limits": [
                { "requests": 4, "window_ms": 60_000, "algorithm": "token_bucket",
                  "allowed": false, "remaining": 0, "reset_ms": 60_000, "retry_after_ms": 15_000 } ] } ] })
            .to_string(),
        )
}

/// Sends a request that must pause for exactly one callout; returns it and the callout.
fn paused_for_callout(h: &Harness, req: Request) -> (StreamId, HttpCall) {
    let o = h.send(0, req);
    assert!(
        o.paused && !o.completed,
        "expected a pause for the gateway: {o:?}"
    );
    assert_eq!(o.http_calls.len(), 1, "{o:?}");
    (o.stream, o.http_calls[0].clone())
}

fn retry_after(o: &Outcome) -> String {
    assert_eq!(o.status, 429, "{o:?}");
    o.expect_header("retry-after")
}

/// A stream the filter reset: finished, never forwarded, no local response.
fn assert_reset(o: &Outcome) {
    assert!(o.completed && o.reset_by_filter, "expected a reset: {o:?}");
    assert!(
        o.upstream_request.is_none(),
        "a denied request went upstream: {o:?}"
    );
    assert!(o.local_response.is_none(), "{o:?}");
}

// ---------------------------------------------------------------------------------------------
// A local reply the host refuses.

#[test]
fn a_denial_whose_reply_fails_in_a_callout_answer_resets_the_stream() {
    let h = one_worker(circuit_config(), true);
    let (id, call) = paused_for_callout(&h, client("ann"));
    h.fail_next_local_response(BAD_ARGUMENT);
    h.respond_http_call(call.worker, call.token, denied());
    assert_reset(&h.outcome(id));
    assert!(h.open_streams().is_empty(), "{:?}", h.open_streams());
    assert_eq!(
        h.logs_containing("could not send the 429 response").len(),
        1
    );
    // The next denial goes out as usual (once the deny cache's 15 s are over).
    h.advance_ms(15_000);
    let (id, call) = paused_for_callout(&h, client("ann"));
    h.respond_http_call(call.worker, call.token, denied());
    assert_eq!(retry_after(&h.outcome(id)), "15");
}

#[test]
fn a_local_denial_whose_reply_fails_resets_the_stream() {
    let h = one_worker(
        cfg(
            json!([{ "name": "one", "key": ["client"], "limits": [ { "requests": 1, "per": "1m" } ] }]),
            None,
        ),
        true,
    );
    assert_eq!(h.send(0, client("bo")).status, 200);
    h.fail_next_local_response(BAD_ARGUMENT);
    let o = h.send(0, client("bo"));
    assert_reset(&o);
    assert_eq!(retry_after(&h.send(0, client("bo"))), "60");
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 1);
}

// ---------------------------------------------------------------------------------------------
// The wall clock steps by an hour; the monotonic clock goes on.

/// Opens the breaker with three failed callouts; `step` moves the wall clock right after.
/// Returns after checking that the breaker stays open exactly the cooldown.
fn circuit_holds_its_cooldown(monotonic: bool, step: i64) {
    let h = one_worker(circuit_config(), monotonic);
    for _ in 0..3 {
        let (id, call) = paused_for_callout(&h, client("cy"));
        h.fail_http_call(call.worker, call.token);
        assert_eq!(h.outcome(id).status, 503);
    }
    h.step_wall_clock(step);
    for wait_ms in [0, 1999] {
        h.advance_ms(wait_ms);
        let o = h.send(0, client("cy"));
        assert_eq!(o.status, 503, "still open: {o:?}");
        assert!(o.http_calls.is_empty(), "a call while open: {o:?}");
    }
    h.advance_ms(1);
    let (_, probe) = paused_for_callout(&h, client("cy"));
    assert_eq!(probe.upstream, CLUSTER);
}

#[test]
fn the_circuit_probes_exactly_one_cooldown_after_opening_whatever_the_wall_clock_does() {
    circuit_holds_its_cooldown(true, -HOUR);
    circuit_holds_its_cooldown(true, HOUR);
}

/// Holds the 11th request of `delay_config` and steps the wall clock; it must be held
/// exactly 100 ms.
fn delay_holds_exactly(monotonic: bool, step: i64) {
    let h = one_worker(delay_config(), monotonic);
    for _ in 0..10 {
        assert_eq!(h.send(0, client("di")).status, 200);
    }
    let held = h.send(0, client("di"));
    assert!(held.paused && !held.completed, "{held:?}");
    h.step_wall_clock(step);
    // Envoy's timer fires every 5 ms: one sees the step at once.
    h.tick(0);
    h.advance_ms(95);
    let o = h.outcome(held.stream);
    assert!(o.paused && o.resumes == 0, "resumed before 100 ms: {o:?}");
    h.advance_ms(5);
    let o = h.outcome(held.stream);
    assert_eq!((o.status, o.resumes), (200, 1), "{o:?}");
}

#[test]
fn a_delayed_request_is_held_exactly_its_delay_whatever_the_wall_clock_does() {
    delay_holds_exactly(true, -HOUR);
    delay_holds_exactly(true, HOUR);
}

/// An empty lease grant (a token due in 36 s), then `step`: refused here with the
/// gateway's wait, counted down, then asked again.
#[test]
fn an_empty_pool_is_refused_exactly_the_gateways_wait_whatever_the_wall_clock_does() {
    for step in [-HOUR, HOUR] {
        let h = one_worker(lease_config(100, "1h"), true);
        let (id, call) = paused_for_callout(&h, client("lu"));
        h.respond_http_call(call.worker, call.token, granted(0, 36_000));
        assert_eq!(retry_after(&h.outcome(id)), "36");
        h.step_wall_clock(step);
        h.advance_ms(6_000);
        let o = h.send(0, client("lu"));
        assert_eq!(retry_after(&o), "30", "step {step}");
        assert!(o.http_calls.is_empty(), "{o:?}");
        h.advance_ms(29_999);
        assert_eq!(retry_after(&h.send(0, client("lu"))), "1", "step {step}");
        h.advance_ms(1);
        paused_for_callout(&h, client("lu"));
    }
}

/// A denial by the gateway (a token due in 15 s), then `step`: answered here from the deny
/// cache with the gateway's wait, counted down on the monotonic clock, then asked again.
#[test]
fn a_cached_denial_lasts_exactly_the_gateways_wait_whatever_the_wall_clock_does() {
    for step in [-HOUR, HOUR] {
        let h = one_worker(circuit_config(), true);
        let (id, call) = paused_for_callout(&h, client("di"));
        h.respond_http_call(call.worker, call.token, denied());
        assert_eq!(retry_after(&h.outcome(id)), "15");
        h.step_wall_clock(step);
        h.advance_ms(6_000);
        let o = h.send(0, client("di"));
        assert_eq!(retry_after(&o), "9", "step {step}");
        assert!(o.http_calls.is_empty(), "{o:?}");
        h.advance_ms(8_999);
        assert_eq!(retry_after(&h.send(0, client("di"))), "1", "step {step}");
        h.advance_ms(1);
        paused_for_callout(&h, client("di"));
        assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 2, "step {step}");
    }
}

/// 4 of 10/min spent, then `step`: the 6 left are admitted, not 0 (back) or 10 (forward).
#[test]
fn a_bucket_that_is_not_full_admits_exactly_what_it_holds_whatever_the_wall_clock_does() {
    let config = cfg(
        json!([{ "name": "ten", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ] }]),
        None,
    );
    for step in [-HOUR, HOUR] {
        let h = one_worker(config.clone(), true);
        for _ in 0..4 {
            assert_eq!(h.send(0, client("bu")).status, 200);
        }
        h.step_wall_clock(step);
        let admitted: Vec<String> = (0..7)
            .map(|_| h.send(0, client("bu")))
            .filter(|o| o.status == 200)
            .map(|o| o.expect_header("x-ratelimit-remaining"))
            .collect();
        assert_eq!(admitted, ["5", "4", "3", "2", "1", "0"], "step {step}");
    }
}

// ---------------------------------------------------------------------------------------------
// A host without a monotonic clock: the wall clock steps back an hour; deadlines are bounded.

#[test]
fn on_the_wall_clock_a_step_back_holds_the_circuit_and_a_delay_no_longer_than_their_spans() {
    circuit_holds_its_cooldown(false, -HOUR);
    delay_holds_exactly(false, -HOUR);
}

#[test]
fn on_the_wall_clock_a_step_back_leaves_a_bucket_empty_at_most_and_an_empty_pool_two_periods() {
    let h = one_worker(
        cfg(
            json!([{ "name": "ten", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ] }]),
            None,
        ),
        false,
    );
    for _ in 0..4 {
        assert_eq!(h.send(0, client("bu")).status, 200);
    }
    h.step_wall_clock(-HOUR);
    // Read as empty (never emptier): one token back 6 s after the step, all ten after 60 s.
    assert_eq!(retry_after(&h.send(0, client("bu"))), "6");
    h.advance_ms(6_000);
    assert_eq!(h.send(0, client("bu")).status, 200);
    h.advance_ms(60_000);
    let admitted = (0..11)
        .filter(|_| h.send(0, client("bu")).status == 200)
        .count();
    assert_eq!(admitted, 10);

    // An empty lease pool of a 100/min rule: refused at most two periods (the
    // gateway's clamp of a wait) after the step, not the hour on top.
    let h = one_worker(lease_config(100, "1m"), false);
    let (id, call) = paused_for_callout(&h, client("lu"));
    h.respond_http_call(call.worker, call.token, granted(0, 36_000));
    assert_eq!(retry_after(&h.outcome(id)), "36");
    h.step_wall_clock(-HOUR);
    assert_eq!(retry_after(&h.send(0, client("lu"))), "120");
    h.advance_ms(119_999);
    assert_eq!(retry_after(&h.send(0, client("lu"))), "1");
    h.advance_ms(1);
    paused_for_callout(&h, client("lu"));

    // A cached denial from before a step back is not trusted: the gateway is asked.
    let h = one_worker(circuit_config(), false);
    let (id, call) = paused_for_callout(&h, client("di"));
    h.respond_http_call(call.worker, call.token, denied());
    assert_eq!(retry_after(&h.outcome(id)), "15");
    assert_eq!(retry_after(&h.send(0, client("di"))), "15");
    h.step_wall_clock(-HOUR);
    paused_for_callout(&h, client("di"));
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 1);
}
