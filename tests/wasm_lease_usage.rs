//! Charging from the response in lease mode, in the compiled filter run in
//! the wasmtime harness: a request spends its reservation from the proxy's
//! batch, and its response settles against the batch's slot in shared data
//! (docs/llm.md, "Lease mode settles against the batch"): a dearer response takes the difference from
//! the unspent tokens and owes the rest, which the next grant pays first and
//! which refuses the bucket's requests until the refill covers it; a cheaper
//! one, or a status `charge_on` leaves out, gives back to the batch while it
//! lives. The gateway's lease answers are the harness's.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use ratelimit_wasm::global::lease::Slot;
use serde_json::{json, Value};

/// A global rule `tokens` of 1,000 a minute (60 ms a token) per client in
/// lease mode, batches of 100 spent for `ttl_ms`, each response's cost in
/// `x-usage-tokens` (at most 400, 20 reserved); the fields of `rule` go
/// into the rule and those of `lease` into `global.lease`.
fn config(ttl_ms: u64, rule: Value, lease: Value) -> String {
    let mut r = json!({
        "name": "tokens", "scope": "global", "key": ["client"],
        "limits": [{"requests": 1000, "per": "1m"}],
        "cost_from": {"header": "x-usage-tokens", "max": 400, "reserve": 20}
    });
    for (k, v) in rule.as_object().into_iter().flatten() {
        r[k] = v.clone();
    }
    let mut l = json!({"fraction": 0.1, "max_wait_ms": 20, "ttl_ms": ttl_ms});
    for (k, v) in lease.as_object().into_iter().flatten() {
        l[k] = v.clone();
    }
    json!({"domain": "usage", "response": {"retry_jitter": 0},
           "global": { "coalesce_us": 0, "cluster": "gw", "failure_mode": "closed", "lease": l},
           "rules": [r]})
    .to_string()
}

fn harness(config: &str) -> Harness {
    Harness::running(Options::new(2, config).clusters(&["gw"]))
}

fn client(id: &str) -> Request {
    Request::get("/v1/chat/completions").header("x-client-id", id)
}

fn used(tokens: u64) -> Upstream {
    Upstream::new(200, "{}").header("x-usage-tokens", tokens.to_string())
}

/// The gateway's lease answer: `n` granted, `remaining` left in the pool.
fn granted(n: u64, remaining: u64) -> CallResponse {
    CallResponse::new(200).body(
        json!({"version": 2, "granted": n, "limits": [{"requests": 1000, "window_ms": 60000,
               "remaining": remaining, "reset_ms": 6000, "retry_after_ms": 0}]})
        .to_string(),
    )
}

/// A request of `id` whose lease callout asks for `want` and gives back
/// `returned`; answered with `answer`, it then meets `upstream`.
fn fetching(
    h: &Harness,
    w: usize,
    id: &str,
    (want, returned): (u64, u64),
    answer: CallResponse,
    upstream: Upstream,
) -> Outcome {
    let stream = h.begin(w, client(id).upstream(upstream));
    let call = h.the_pending_call("lease callout");
    assert_eq!(call.header(":path").as_deref(), Some("/v1/lease"));
    let body: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(
        (body["want"].as_u64(), body["return"].as_u64()),
        (Some(want), Some(returned)),
        "{body}"
    );
    h.respond_http_call(call.worker, call.token, answer);
    h.outcome(stream)
}

/// The one lease slot in shared data: (unspent tokens, debt).
fn slot(h: &Harness) -> (u64, u64) {
    let keys: Vec<String> = h
        .shared_keys()
        .into_iter()
        .filter(|k| k.starts_with("ratelimit-wasm/lease/"))
        .collect();
    let [key] = keys.as_slice() else {
        panic!("one lease slot expected: {keys:?}");
    };
    let (bytes, _) = h.shared_get(key).expect("the slot");
    let s = Slot::decode(&bytes).expect("a slot");
    (s.tokens, s.debt)
}

fn remaining(o: &Outcome) -> Option<String> {
    o.header("x-ratelimit-remaining")
}

#[test]
fn a_dearer_response_owes_the_batch_until_the_refill_covers_it_and_a_cheaper_one_gives_back() {
    let h = harness(&config(60_000, json!({}), json!({})));
    // A batch of 100: the first request spends its 20 from it, and its
    // response of 50 takes 30 more.
    let o = fetching(&h, 0, "ann", (100, 0), granted(100, 900), used(50));
    assert_eq!((o.status, remaining(&o).as_deref()), (200, Some("980")));
    assert_eq!(slot(&h), (50, 0));
    // Served from the batch on the other worker (no callout); a response of
    // 5 gives 15 of its 20 back.
    let o = h.send(1, client("ann").upstream(used(5)));
    assert!(o.http_calls.is_empty(), "{o:?}");
    assert_eq!((o.status, remaining(&o).as_deref()), (200, Some("930")));
    assert_eq!(slot(&h), (45, 0));
    // 175 on a reservation of 20: the 25 left after it, then 130 owed.
    let o = h.send(0, client("ann").upstream(used(175)));
    assert_eq!(o.status, 200, "{o:?}");
    assert_eq!(slot(&h), (0, 130));
    assert_eq!(h.metric("ratelimit_wasm_usage_settled"), 3);
    // The next reservation waits for 130 + 20 tokens at 60 ms: 9 s, refused
    // here on either worker without a callout.
    for w in [1, 0] {
        let o = h.send(w, client("ann").upstream(used(1)));
        assert_eq!(o.status, 429, "{o:?}");
        assert_eq!(o.header("retry-after").as_deref(), Some("9"));
        assert_eq!(remaining(&o).as_deref(), Some("0"));
        assert!(o.http_calls.is_empty(), "{o:?}");
    }
    h.advance_ms(8_999);
    let o = h.send(1, client("ann").upstream(used(1)));
    assert_eq!(o.header("retry-after").as_deref(), Some("1"), "{o:?}");
    h.advance_ms(1);
    // The first request after the wait fetches a batch and the debt: the
    // gateway grants one batch, which pays 100 of it. The 30 still owed and
    // the reservation take 3 s more.
    let o = fetching(&h, 0, "ann", (230, 0), granted(100, 0), used(1));
    assert_eq!(o.status, 429, "{o:?}");
    assert_eq!(o.header("retry-after").as_deref(), Some("3"));
    assert_eq!(slot(&h), (0, 30));
    h.advance_ms(3_000);
    // The next grant pays the last 30 before the request spends its 20; its
    // response of 20 cost what it reserved.
    let o = fetching(&h, 1, "ann", (130, 0), granted(100, 0), used(20));
    assert_eq!((o.status, remaining(&o).as_deref()), (200, Some("50")));
    assert_eq!(slot(&h), (50, 0));
    assert_eq!(h.metric("ratelimit_wasm_lease_fetches"), 3);
    assert_eq!(h.metric("ratelimit_wasm_lease_unreturned"), 0);
    assert_eq!(h.metric("ratelimit_wasm_lease_debt_dropped"), 0);
    assert!(
        h.pending_http_calls().is_empty(),
        "nothing to settle on the gateway"
    );
}

#[test]
fn a_status_charge_on_leaves_out_gives_the_reservation_back_while_the_batch_lives() {
    let h = harness(&config(1_000, json!({"charge_on": ["2xx"]}), json!({})));
    let o = fetching(
        &h,
        0,
        "ann",
        (100, 0),
        granted(100, 900),
        Upstream::new(503, "{}"),
    );
    assert_eq!(o.status, 503);
    assert_eq!(slot(&h), (100, 0));
    assert_eq!(h.metric("ratelimit_wasm_charge_refunded"), 1);
    // A stream whose batch expired before its response: its 20 are not
    // given back (Redis charged them; its refill returns them).
    let held = h.begin(1, client("ann").hold_upstream());
    assert_eq!(slot(&h), (80, 0));
    h.advance_ms(1_000);
    assert_eq!(
        h.respond_upstream(held, Upstream::new(404, "{}")).status,
        404
    );
    assert_eq!(slot(&h), (80, 0));
    assert_eq!(h.metric("ratelimit_wasm_charge_refunded"), 2);
    assert_eq!(h.metric("ratelimit_wasm_lease_unreturned"), 20);
    // The expired batch's 80 unspent go back with the next fetch.
    let o = fetching(&h, 0, "ann", (100, 80), granted(100, 900), used(20));
    assert_eq!(o.status, 200);
    assert_eq!(slot(&h), (80, 0));
}

#[test]
fn a_request_checked_on_its_own_in_lease_mode_settles_on_the_gateway() {
    let h = harness(&config(60_000, json!({}), json!({})));
    // While one request fetches the batch, another is checked on its own
    // under a reservation id, and settles on the gateway.
    let fetch = h.begin(0, client("ann").upstream(used(50)));
    let lease = h.the_pending_call("lease callout");
    let checked = h.begin(1, client("ann").upstream(used(350)));
    let calls = h.pending_http_calls();
    let check = calls
        .iter()
        .find(|c| c.header(":path").as_deref() == Some("/v1/check"))
        .unwrap_or_else(|| panic!("a check expected: {calls:?}"))
        .clone();
    let body: Value = serde_json::from_slice(&check.body).unwrap();
    let reservation = body["reservation"]
        .as_str()
        .expect("a reservation")
        .to_string();
    h.respond_http_call(
        check.worker,
        check.token,
        CallResponse::new(200).body(
            json!({"version": 2, "allowed": true, "buckets": [{"limits": [{
                "requests": 1000, "window_ms": 60000, "algorithm": "token_bucket", "allowed": true,
                "remaining": 880, "reset_ms": 6000, "retry_after_ms": 0}]}]})
            .to_string(),
        ),
    );
    assert_eq!(h.outcome(checked).status, 200);
    h.respond_http_call(lease.worker, lease.token, granted(100, 880));
    assert_eq!(h.outcome(fetch).status, 200);
    // The batch settled the leased request (20 reserved, 50 used); the
    // checked one goes to the gateway at the next tick.
    assert_eq!(slot(&h), (50, 0));
    h.tick(1);
    let settle = h.the_pending_call("settle call");
    assert_eq!(settle.header(":path").as_deref(), Some("/v1/settle"));
    let body: Value = serde_json::from_slice(&settle.body).unwrap();
    assert_eq!(
        body,
        json!({"version": 2, "domain": "usage", "settlements": [{"reservation": reservation,
            "buckets": [{"rule": "tokens", "key": "tokens/c=ann", "tag": "c=ann",
                         "variant": "default", "cost": 350}]}]})
    );
}

#[test]
fn a_slot_in_debt_taken_over_by_another_bucket_drops_the_debt_and_counts_it() {
    // One slot for every bucket.
    let h = harness(&config(1_000, json!({}), json!({"max_leases": 1})));
    let o = fetching(&h, 0, "ann", (100, 0), granted(100, 900), used(400));
    assert_eq!(o.status, 200);
    // 400 on 20: the 80 left, then 300 owed: 320 × 60 ms = 19.2 s for ann.
    assert_eq!(slot(&h), (0, 300));
    let o = h.send(1, client("ann"));
    assert_eq!(o.header("retry-after").as_deref(), Some("20"), "{o:?}");
    // While ann's debt waits, its batch expired, bob is checked on its own
    // rather than take the slot.
    h.advance_ms(1_000);
    let bob = h.begin(0, client("bob").upstream(used(20)));
    let call = h.the_pending_call("check");
    assert_eq!(call.header(":path").as_deref(), Some("/v1/check"));
    h.fail_http_call(call.worker, call.token);
    assert_eq!(h.outcome(bob).status, 503);
    // Once it is over (and ann's batch expired), bob takes the slot, and the
    // 300 ann owed are dropped.
    h.advance_ms(17_000);
    let o = fetching(&h, 1, "bob", (100, 0), granted(100, 900), used(20));
    assert_eq!(o.status, 200);
    assert_eq!(slot(&h), (80, 0));
    assert_eq!(h.metric("ratelimit_wasm_lease_debt_dropped"), 300);
}
