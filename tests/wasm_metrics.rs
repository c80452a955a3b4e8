//! The filter's counters in the compiled module, run in the wasmtime
//! harness: counted in the VM and handed to the host on the root's tick
//! (no metric host call per request), per rule and per quota with the
//! domain and the rule in the name for Envoy's stats tags, and as many
//! series for 10,000 clients as for one.
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::json;

/// `per-client`: 4 an hour per client; `watch`: 1 an hour per client on
/// `/w`, in shadow mode; near the limit at half of it.
fn config() -> String {
    json!({"domain": "metrics", "response": {"retry_jitter": 0},
        "metrics": {"near_limit": 0.5},
        "rules": [
            {"name": "per-client", "key": ["client"], "limits": [{"requests": 4, "per": "1h"}]},
            {"name": "watch", "mode": "shadow", "key": ["client"], "match": {"path_prefix": "/w"},
             "limits": [{"requests": 1, "per": "1h"}]}]})
    .to_string()
}

fn rule(rule: &str, what: &str) -> String {
    format!("ratelimit_domain=.=metrics;.;ratelimit_rule=.={rule};.;ratelimit_wasm_rule_{what}")
}

fn get(path: &str, client: &str) -> Request {
    Request::get(path).header("x-client-id", client)
}

#[test]
fn counts_wait_in_the_vm_for_the_tick_and_then_are_exact_per_rule() {
    let h = Harness::running(Options::new(2, config()));
    let statuses: Vec<u16> = (0..5)
        .map(|i| h.send(i % 2, get("/a", "ann")).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429]);
    // No request made a metric host call: the host has nothing yet.
    assert_eq!(
        h.metric_unflushed("ratelimit_wasm_requests_allowed"),
        Some(0)
    );
    assert_eq!(h.metric_unflushed(&rule("per-client", "allowed")), Some(0));
    // The tick hands the sums over.
    h.flush_metrics();
    assert_eq!(
        h.metric_unflushed("ratelimit_wasm_requests_allowed"),
        Some(4)
    );
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 1);
    assert_eq!(h.metric(&rule("per-client", "allowed")), 4);
    assert_eq!(h.metric(&rule("per-client", "denied")), 1);
    // 2, 1 and 0 left of 4 are at or past half of it.
    assert_eq!(h.metric(&rule("per-client", "near_limit")), 3);
    assert_eq!(h.metric(&rule("per-client", "shadow_denied")), 0);
    // The shadow rule: the second request past its 1 is watched, not refused.
    for _ in 0..2 {
        assert_eq!(h.send(0, get("/w", "bob")).status, 200);
    }
    assert_eq!(h.metric(&rule("watch", "shadow_denied")), 1);
    assert_eq!(h.metric(&rule("watch", "denied")), 0);
    // The first was within it (and left nothing: near it).
    assert_eq!(h.metric(&rule("watch", "allowed")), 1);
    assert_eq!(h.metric(&rule("watch", "near_limit")), 1);
    assert_eq!(h.metric(&rule("per-client", "allowed")), 6);
    assert_eq!(h.metric(&rule("per-client", "near_limit")), 4);
    // A second flush with nothing new adds nothing.
    h.flush_metrics();
    assert_eq!(h.metric(&rule("per-client", "allowed")), 6);
}

#[test]
fn ten_thousand_clients_leave_the_number_of_series_as_it_was() {
    let h = Harness::running(Options::new(2, config()));
    h.send(0, get("/a", "first"));
    let before = h.metrics().len();
    for i in 0..10_000 {
        h.send(i % 2, get("/w", &format!("client-{i}")));
    }
    let metrics = h.metrics();
    assert_eq!(metrics.len(), before);
    let per_rule: Vec<&String> = metrics
        .keys()
        .filter(|n| n.contains("ratelimit_rule=.="))
        .collect();
    // Two rules, four counters each: the configuration's, not the clients'.
    assert_eq!(per_rule.len(), 8, "{per_rule:?}");
    assert_eq!(h.metric(&rule("per-client", "allowed")), 10_001);
}

#[test]
fn a_spent_quota_is_counted_under_its_own_name() {
    let config = json!({"domain": "metrics", "response": {"retry_jitter": 0},
        "global": { "coalesce_us": 0, "cluster": "gw", "failure_mode": "closed"},
        "rules": [{"name": "per-client", "key": ["client"], "limits": [{"requests": 100, "per": "1h"}]}],
        "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 10,
                    "upgrade_url": "https://example.com/up"}]})
    .to_string();
    let h = Harness::running(Options::new(1, config).clusters(&["gw"]));
    let stream = h.begin(0, get("/a", "ann"));
    let call = h.the_pending_call("check");
    h.respond_http_call(
        call.worker,
        call.token,
        CallResponse::new(200).body(
            json!({"version": 2, "allowed": false, "buckets": [],
                   "quotas": [{"limit": 10, "period": "month", "allowed": false,
                               "remaining": 0, "reset_ms": 86_400_000}]})
            .to_string(),
        ),
    );
    assert_eq!(h.outcome(stream).status, 403);
    let quota =
        "ratelimit_domain=.=metrics;.;ratelimit_quota=.=monthly;.;ratelimit_wasm_quota_denied";
    assert_eq!(h.metric(quota), 1);
    assert_eq!(h.metric("ratelimit_wasm_quota_exhausted"), 1);
    assert_eq!(h.metric(&rule("per-client", "denied")), 0);
}
