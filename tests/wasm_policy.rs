//! Policy features of the compiled filter, run in the wasmtime harness: tiers (from Envoy
//! metadata, a header, or the static client map), client overrides and unlimited clients,
//! shadow rules and soft clients, the graduated response (warn, delay, reject, block), the
//! jitter of `Retry-After` and of block ends, global rules through gateway callouts (the
//! failure modes and the circuit breaker), quotas, and late callout answers.
//!
//! Every expectation is README's contract ("Tiers, overrides and soft limits", "Graduated
//! response", "Global limits", "Quotas", "What clients see", "Metrics").
//!
//! Build the filter first: `cargo build --release --target wasm32-wasip1 -p ratelimit-wasm`.

mod harness;

use harness::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const JWT: &str = "envoy.filters.http.jwt_authn";
const CLUSTER: &str = "ratelimit_gateway";
const UPGRADE: &str = "https://example.com/upgrade";

// ---------------------------------------------------------------------------------------------
// Helpers.

/// `config` with `domain` "policy" and `response.retry_jitter` 0 unless it sets them.
fn cfg(mut config: Value) -> String {
    if config.get("domain").is_none() {
        config["domain"] = json!("policy");
    }
    if config.get("response").is_none() {
        config["response"] = json!({});
    }
    if config["response"].get("retry_jitter").is_none() {
        config["response"]["retry_jitter"] = json!(0);
    }
    config.to_string()
}

/// A harness whose workers all accepted `opts`' configuration.
fn harness_with(opts: Options) -> Harness {
    let config = String::from_utf8_lossy(&opts.plugin_config).into_owned();
    let h = Harness::with_options(opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        h.configure_results().iter().all(|c| *c),
        "the filter refused the configuration {config}:\n{}",
        h.log_text()
    );
    h
}

fn harness(workers: usize, config: &str) -> Harness {
    harness_with(Options::new(workers, config))
}

/// A harness for a configuration with a gateway on `CLUSTER`.
fn gateway_harness(workers: usize, config: &str) -> Harness {
    harness_with(Options::new(workers, config).clusters(&[CLUSTER]))
}

fn client(id: &str) -> Request {
    Request::get("/").header("x-client-id", id)
}

/// A request whose `jwt_authn` payload says `sub` and `tier` (each only when given), as
/// Envoy's dynamic metadata: the property `metadata.filter_metadata.<filter>.payload.<field>`.
fn jwt(sub: Option<&str>, tier: Option<&str>) -> Request {
    let mut r = Request::get("/");
    if let Some(sub) = sub {
        r = r.property(&["metadata", "filter_metadata", JWT, "payload", "sub"], sub);
    }
    if let Some(tier) = tier {
        r = r.property(
            &["metadata", "filter_metadata", JWT, "payload", "tier"],
            tier,
        );
    }
    r
}

fn num(o: &Outcome, name: &str) -> u64 {
    let v = o.expect_header(name);
    v.parse()
        .unwrap_or_else(|e| panic!("{name}: {v:?} is not a number ({e}): {o:?}"))
}

fn assert_allowed(o: &Outcome) {
    assert_eq!(o.status, 200, "expected the request through: {o:?}");
    assert!(o.local_response.is_none(), "{o:?}");
    assert!(o.completed, "{o:?}");
    assert!(o.upstream_request.is_some(), "not forwarded: {o:?}");
}

/// The 429 of the contract: problem+json body naming `policies`, whole-second Retry-After.
fn assert_problem(o: &Outcome, retry_after: u64, policies: &[&str]) {
    assert_eq!(o.status, 429, "expected a 429: {o:?}");
    assert!(o.completed, "{o:?}");
    assert!(
        o.upstream_request.is_none(),
        "a denied request went upstream: {o:?}"
    );
    assert_eq!(
        o.header_values("retry-after"),
        vec![retry_after.to_string()],
        "{o:?}"
    );
    assert_eq!(
        o.header_values("content-type"),
        vec!["application/problem+json".to_string()],
        "{o:?}"
    );
    let body = o.body_json();
    assert_eq!(
        body,
        json!({
            "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "title": "Too Many Requests",
            "status": 429,
            "detail": format!("Rate limit exceeded. Retry after {retry_after} seconds."),
            "violated-policies": policies,
        }),
        "{o:?}"
    );
}

/// The headers of the limit closest to its end, as docs/configuration.md's
/// "What clients see" has them: the legacy lines are its own, and its items
/// are among those of every limit in the IETF lists (exactly, item by item).
fn assert_shows(o: &Outcome, policy: &str, quota: u64, window: u64, remaining: u64) {
    assert_eq!(
        o.header_values("x-ratelimit-limit"),
        vec![quota.to_string()],
        "{o:?}"
    );
    assert_eq!(
        o.header_values("x-ratelimit-remaining"),
        vec![remaining.to_string()],
        "{o:?}"
    );
    let policies = o.header_values("ratelimit-policy");
    assert_eq!(policies.len(), 1, "{o:?}");
    let item = format!("\"{policy}\";q={quota};w={window}");
    assert!(
        policies[0].split(", ").any(|i| i == item),
        "ratelimit-policy {:?} has no {item}; {o:?}",
        policies[0]
    );
    let rl = o.expect_header("ratelimit");
    let state = format!("\"{policy}\";r={remaining};t=");
    assert!(
        rl.split(", ").any(|i| i.starts_with(&state)),
        "ratelimit: {rl} has no {state}…; {o:?}"
    );
}

/// No rate-limit header at all: the client got the upstream's response untouched.
fn assert_untouched(o: &Outcome) {
    assert_allowed(o);
    assert_eq!(
        o.headers,
        vec![(":status".to_string(), b"200".to_vec())],
        "{o:?}"
    );
}

/// Sends `limit` requests made by `mk` (all admitted, `remaining` counting down, the limit
/// shown as `rule`'s `limit` per `per_secs`), then one more: 429 with the wait for one token.
fn expect_limit(
    h: &Harness,
    what: &str,
    rule: &str,
    limit: u64,
    per_secs: u64,
    mk: impl Fn() -> Request,
) {
    for i in 0..limit {
        let o = h.send_rr(i as usize, mk());
        assert_eq!(o.status, 200, "{what}: request {} of {limit}: {o:?}", i + 1);
        assert_shows(&o, rule, limit, per_secs, limit - 1 - i);
    }
    let o = h.send_rr(limit as usize, mk());
    assert_problem(&o, per_secs.div_ceil(limit), &[rule]);
    assert_eq!(
        o.header_values("x-ratelimit-limit"),
        vec![limit.to_string()],
        "{what}: {o:?}"
    );
}

/// Every metric value (a snapshot to compare).
fn metric_values(h: &Harness) -> Vec<(String, i64)> {
    h.metrics().into_iter().map(|(k, m)| (k, m.value)).collect()
}

// ---------------------------------------------------------------------------------------------
// 1. Tier resolution.

/// `free` (3/h, the default) and `pro` (6/h); client and tier from `jwt_authn` metadata;
/// `acme` is pro by the static map.
fn metadata_tiers_config() -> String {
    cfg(json!({
        "tiers": { "free": {}, "pro": {} },
        "identity": {
            "client_id_metadata": [JWT, "payload", "sub"],
            "tier_metadata": [JWT, "payload", "tier"],
            "default_tier": "free",
            "clients": { "acme": { "tier": "pro" } }
        },
        "rules": [{ "name": "per-client", "key": ["client"],
                    "limits": [ { "requests": 3, "per": "1h" } ],
                    "tiers": { "pro": [ { "requests": 6, "per": "1h" } ] } }]
    }))
}

#[test]
fn tier_from_jwt_metadata_gives_each_tier_its_own_limit() {
    let h = harness(2, &metadata_tiers_config());
    expect_limit(&h, "alice (pro)", "per-client", 6, 3600, || {
        jwt(Some("alice"), Some("pro"))
    });
    expect_limit(&h, "bob (free)", "per-client", 3, 3600, || {
        jwt(Some("bob"), Some("free"))
    });
    // No tier claim: the default tier.
    expect_limit(&h, "carol (no tier)", "per-client", 3, 3600, || {
        jwt(Some("carol"), None)
    });
    // A claimed tier that is not declared counts as unknown: the default applies.
    expect_limit(&h, "dave (gold)", "per-client", 3, 3600, || {
        jwt(Some("dave"), Some("gold"))
    });
    // The static map's tier wins over the credential's claim.
    expect_limit(
        &h,
        "acme (claims free, pro by the map)",
        "per-client",
        6,
        3600,
        || jwt(Some("acme"), Some("free")),
    );
    // Buckets are per (rule, limits): bob, moved to pro, starts a fresh bucket.
    expect_limit(&h, "bob moved to pro", "per-client", 6, 3600, || {
        jwt(Some("bob"), Some("pro"))
    });
    assert_eq!(
        h.metric("ratelimit_wasm_requests_allowed"),
        6 + 3 + 3 + 3 + 6 + 6
    );
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 6);
}

#[test]
fn forged_identity_headers_change_nothing_when_metadata_is_configured() {
    let h = harness(2, &metadata_tiers_config());
    // No metadata (unauthenticated), forged client id and tier headers: keyed by the peer
    // IP, default tier. Three different forged ids from one IP share one bucket of 3.
    let forged = |id: &str| {
        Request::get("/")
            .source("198.51.100.1:4000")
            .header("x-client-id", id)
            .header("x-tier", "pro")
    };
    for (i, id) in ["alice", "acme", "zed"].into_iter().enumerate() {
        let o = h.send_rr(i, forged(id));
        assert_eq!(o.status, 200, "{o:?}");
        assert_shows(&o, "per-client", 3, 3600, 2 - i as u64);
    }
    let o = h.send(0, forged("alice"));
    assert_problem(&o, 1200, &["per-client"]);
    assert_eq!(o.header_values("x-ratelimit-limit"), vec!["3"], "{o:?}");
    // Another IP is another bucket.
    let o = h.send(1, forged("alice").source("198.51.100.2:4000"));
    assert_shows(&o, "per-client", 3, 3600, 2);
    // The real alice (from metadata) was not touched by the forged requests.
    let o = h.send(
        0,
        jwt(Some("alice"), Some("pro")).header("x-client-id", "zed"),
    );
    assert_eq!(o.status, 200, "{o:?}");
    assert_shows(&o, "per-client", 6, 3600, 5);
    // A forged tier header does not lift bob (free by his credential) to pro, and a forged
    // client id does not move him to another bucket.
    expect_limit(&h, "bob with forged headers", "per-client", 3, 3600, || {
        jwt(Some("bob"), Some("free"))
            .header("x-tier", "pro")
            .header("x-client-id", "alice")
    });
    let o = h.send(1, jwt(Some("alice"), Some("pro")));
    assert_shows(&o, "per-client", 6, 3600, 4);
}

#[test]
fn tier_from_a_header_and_from_the_static_map() {
    let h = harness(
        2,
        &cfg(json!({
            "tiers": { "free": {}, "pro": {} },
            "identity": {
                "client_id_header": "x-client-id",
                "tier_header": "x-tier",
                "default_tier": "free",
                "clients": { "acme": { "tier": "pro" } }
            },
            "rules": [{ "name": "per-client", "key": ["client"],
                        "limits": [ { "requests": 3, "per": "1h" } ],
                        "tiers": { "pro": [ { "requests": 6, "per": "1h" } ] } }]
        })),
    );
    expect_limit(&h, "alice (pro)", "per-client", 6, 3600, || {
        client("alice").header("x-tier", "pro")
    });
    expect_limit(&h, "bob (free)", "per-client", 3, 3600, || {
        client("bob").header("x-tier", "free")
    });
    expect_limit(&h, "carol (no tier)", "per-client", 3, 3600, || {
        client("carol")
    });
    expect_limit(&h, "dave (gold)", "per-client", 3, 3600, || {
        client("dave").header("x-tier", "gold")
    });
    expect_limit(
        &h,
        "acme (header free, map pro)",
        "per-client",
        6,
        3600,
        || client("acme").header("x-tier", "free"),
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Overrides and unlimited.

#[test]
fn client_overrides_supersede_the_tier_and_unlimited_is_never_limited() {
    let h = harness(
        2,
        &cfg(json!({
            "tiers": { "free": {}, "pro": {}, "internal": { "unlimited": true } },
            "identity": {
                "client_id_metadata": [JWT, "payload", "sub"],
                "tier_metadata": [JWT, "payload", "tier"],
                "default_tier": "free",
                "clients": {
                    "acme": { "tier": "pro", "limits": { "per-client": [ { "requests": 2, "per": "1h" } ] } },
                    "partner": { "limits": { "per-client": [ { "requests": 4, "per": "1h" } ] } },
                    "ops": { "unlimited": true }
                }
            },
            "rules": [{ "name": "per-client", "key": ["client"],
                        "limits": [ { "requests": 3, "per": "1h" } ],
                        "tiers": { "pro": [ { "requests": 6, "per": "1h" } ] } }]
        })),
    );
    // acme's own limit (2) over its tier's (pro: 6).
    expect_limit(&h, "acme override", "per-client", 2, 3600, || {
        jwt(Some("acme"), Some("pro"))
    });
    // partner's own limit (4) over the default tier's (3).
    expect_limit(&h, "partner override", "per-client", 4, 3600, || {
        jwt(Some("partner"), None)
    });
    // An unlimited client (claiming a limited tier) and a client of an unlimited tier.
    for i in 0..20 {
        assert_untouched(&h.send_rr(i, jwt(Some("ops"), Some("free"))));
        assert_untouched(&h.send_rr(i + 1, jwt(Some("zed"), Some("internal"))));
    }
    assert_eq!(h.metric("ratelimit_wasm_unlimited"), 40);
    // Others are still limited.
    expect_limit(&h, "plain free client", "per-client", 3, 3600, || {
        jwt(Some("yan"), Some("free"))
    });
    assert_eq!(h.metric("ratelimit_wasm_unlimited"), 40);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 3);
}

// ---------------------------------------------------------------------------------------------
// 3. Shadow rules and soft clients.

#[test]
fn a_shadow_rule_never_rejects_but_counts_logs_and_shows_its_headers() {
    let h = harness(
        1,
        &cfg(json!({
            "rules": [
                { "name": "watch", "mode": "shadow", "key": ["client"],
                  "limits": [ { "requests": 2, "per": "1h" } ] },
                { "name": "per-client", "key": ["client"],
                  "limits": [ { "requests": 10, "per": "1h" } ] }
            ]
        })),
    );
    let shadow_lines = |h: &Harness| {
        h.logs()
            .into_iter()
            .filter(|l| l.message.contains("shadow"))
            .collect::<Vec<_>>()
    };
    for i in 0..3u64 {
        let o = h.send(0, client("sam"));
        assert_allowed(&o);
        // The shadow rule is the tightest (2 vs 10): its headers are shown.
        assert_shows(&o, "watch", 2, 3600, 1u64.saturating_sub(i));
    }
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 1);
    let lines = shadow_lines(&h);
    assert_eq!(lines.len(), 1, "{}", h.log_text());
    assert!(
        lines[0].message.contains("\"watch\""),
        "the log line must name the rule: {}",
        lines[0]
    );
    assert!(lines[0].level >= LogLevel::Info, "{}", lines[0]);
    // More would-be denials in the same second: counted exactly; the next line (a second
    // later) says how many were not logged.
    for _ in 0..4 {
        let o = h.send(0, client("sam"));
        assert_allowed(&o);
        assert_shows(&o, "watch", 2, 3600, 0);
    }
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 5);
    h.advance(Duration::from_secs(1));
    let o = h.send(0, client("sam"));
    assert_allowed(&o);
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 6);
    let lines = shadow_lines(&h);
    assert_eq!(lines.len(), 2, "{}", h.log_text());
    assert!(
        lines[1].message.contains("\"watch\"") && lines[1].message.contains("+4 not logged"),
        "{}",
        lines[1]
    );
    // The enforced rule still rejects at its limit (8 admitted so far), and the shadow rule
    // is not among the violated policies.
    assert_allowed(&h.send(0, client("sam")));
    assert_allowed(&h.send(0, client("sam")));
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 8);
    // 10 tokens of 360 s each were taken, 7 of them a second earlier: 359 s to the next.
    let o = h.send(0, client("sam"));
    assert_problem(&o, 359, &["per-client"]);
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 8);
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 10);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 1);
}

#[test]
fn a_soft_client_is_never_rejected() {
    let h = harness(
        2,
        &cfg(json!({
            "identity": { "clients": { "trial": { "soft": true } } },
            "rules": [{ "name": "per-client", "key": ["client"],
                        "limits": [ { "requests": 3, "per": "1h" } ] }]
        })),
    );
    for i in 0..8u64 {
        let o = h.send_rr(i as usize, client("trial"));
        assert_allowed(&o);
        assert_shows(&o, "per-client", 3, 3600, 2u64.saturating_sub(i));
    }
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 5);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 0);
    let lines = h.logs_containing("shadow");
    assert!(
        !lines.is_empty() && lines.iter().all(|l| l.message.contains("\"per-client\"")),
        "{}",
        h.log_text()
    );
    // Any other client is limited.
    expect_limit(
        &h,
        "a client that is not soft",
        "per-client",
        3,
        3600,
        || client("other"),
    );
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 5);
}

// ---------------------------------------------------------------------------------------------
// 4. Graduated response.

fn graduated_config(jitter: Option<f64>) -> String {
    let mut c = json!({
        "rules": [{ "name": "grad", "key": ["client"],
                    "limits": [ { "requests": 10, "per": "1m" } ],
                    "graduated": { "warn_at": 0.8, "delay_at": 1.0, "delay_ms": 100,
                                   "reject_at": 1.2, "block_at": 2.0, "block_for": "5m" } }]
    });
    if let Some(j) = jitter {
        c["response"] = json!({ "retry_jitter": j });
    }
    cfg(c)
}

#[test]
fn graduated_warns_delays_rejects_then_blocks() {
    let h = harness(2, &graduated_config(None));
    assert_eq!([h.tick_period_ms(0), h.tick_period_ms(1)], [5, 5]);
    let t0 = h.now_ns();
    // 1-7: plain.
    for i in 0..7u64 {
        let o = h.send_rr(i as usize, client("gus"));
        assert_allowed(&o);
        assert_shows(&o, "grad", 10, 60, 9 - i);
        assert_eq!(
            o.header("x-ratelimit-warning"),
            None,
            "request {}: {o:?}",
            i + 1
        );
    }
    // 8-10: warned.
    for (i, used) in [(7u64, 80), (8, 90), (9, 100)] {
        let o = h.send_rr(i as usize, client("gus"));
        assert_allowed(&o);
        assert_shows(&o, "grad", 10, 60, 9 - i);
        assert_eq!(
            o.header_values("x-ratelimit-warning"),
            vec![format!("\"grad\";used={used}")],
            "request {}: {o:?}",
            i + 1
        );
    }
    // 11, 12: held (paused, no local response, nothing sent anywhere yet).
    let delayed: Vec<StreamId> = (10..12)
        .map(|i| {
            let o = h.send_rr(i, client("gus"));
            assert!(o.paused && !o.completed, "request {}: {o:?}", i + 1);
            assert_eq!(o.request_action, Some(Action::Pause), "{o:?}");
            assert!(
                o.local_response.is_none() && o.http_calls.is_empty(),
                "{o:?}"
            );
            assert!(o.upstream_request.is_none(), "{o:?}");
            o.stream
        })
        .collect();
    // 13-19: rejected; one token comes back in 6 s.
    for i in 12..19 {
        let o = h.send_rr(i, client("gus"));
        assert_problem(&o, 6, &["grad"]);
        assert_eq!(o.header_values("x-ratelimit-remaining"), vec!["0"], "{o:?}");
    }
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 0);
    // 20: the demand (denied requests included) reaches 200%: blocked for 5 minutes.
    let o = h.send_rr(19, client("gus"));
    assert_problem(&o, 300, &["grad"]);
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 1);
    // The delayed requests are resumed by the root context's tick after 100 ms, not before.
    h.advance_ms(95);
    for id in &delayed {
        let o = h.outcome(*id);
        assert!(
            o.paused && !o.completed && o.resumes == 0,
            "at +95 ms: {o:?}"
        );
    }
    h.advance_ms(5);
    for (id, used) in delayed.iter().zip([110, 120]) {
        let o = h.outcome(*id);
        assert_allowed(&o);
        assert_eq!(o.resumes, 1, "{o:?}");
        assert_shows(&o, "grad", 10, 60, 0);
        assert_eq!(
            o.header_values("x-ratelimit-warning"),
            vec![format!("\"grad\";used={used}")],
            "{o:?}"
        );
    }
    assert!(h.notes().is_empty(), "{:?}", h.notes());
    assert_eq!(h.metric("ratelimit_wasm_delayed"), 2);
    assert_eq!(h.metric("ratelimit_wasm_warned"), 5);
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 1);
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 12);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 8);
    // Still blocked at +299 s and just before +300 s (the bucket itself refilled long ago).
    h.set_time_ns(t0 + 299 * SEC);
    assert_problem(&h.send(0, client("gus")), 1, &["grad"]);
    h.set_time_ns(t0 + 300 * SEC - MS);
    assert_problem(&h.send(1, client("gus")), 1, &["grad"]);
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 3);
    // Released at +300 s, with a full bucket.
    h.set_time_ns(t0 + 300 * SEC);
    let o = h.send(0, client("gus"));
    assert_allowed(&o);
    assert_shows(&o, "grad", 10, 60, 9);
    assert_eq!(o.header("x-ratelimit-warning"), None, "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 3);
    // Another client was never affected.
    let o = h.send(1, client("other"));
    assert_shows(&o, "grad", 10, 60, 9);
}

#[test]
fn a_delayed_request_cancelled_before_its_resume_is_never_resumed() {
    let h = harness(1, &graduated_config(None));
    for _ in 0..10 {
        assert_allowed(&h.send(0, client("cat")));
    }
    let gone = h.send(0, client("cat"));
    assert!(gone.paused && !gone.completed, "{gone:?}");
    h.advance_ms(50);
    let o = h.cancel(gone.stream);
    assert!(o.completed && o.cancelled && o.resumes == 0, "{o:?}");
    // A later request on the same worker, alive (waiting for its upstream) while the
    // cancelled one's resume time passes.
    let later = h.begin(0, client("dog").hold_upstream());
    assert_eq!(h.outcome(later).phase, StreamPhase::AwaitingUpstream);
    h.advance_ms(200);
    let o = h.outcome(gone.stream);
    assert!(o.completed && o.resumes == 0 && o.status == 0, "{o:?}");
    let o = h.outcome(later);
    assert_eq!(
        o.resumes, 0,
        "a request that was never held was resumed: {o:?}"
    );
    assert!(o.notes.is_empty(), "{o:?}");
    assert!(h.notes().is_empty(), "{:?}", h.notes());
    // A new delayed request on the same worker is resumed once, after its own 100 ms.
    let next = h.send(0, client("cat"));
    assert!(next.paused && !next.completed, "{next:?}");
    h.advance_ms(99);
    assert_eq!(h.outcome(next.stream).resumes, 0);
    h.advance_ms(1);
    let o = h.outcome(next.stream);
    assert_allowed(&o);
    assert_eq!(o.resumes, 1, "{o:?}");
    let o = h.respond_upstream(later, Upstream::default());
    assert_allowed(&o);
    assert_eq!(o.resumes, 0, "{o:?}");
    assert!(h.notes().is_empty(), "{:?}", h.notes());
    assert!(h.open_streams().is_empty(), "{:?}", h.open_streams());
    assert_eq!(h.metric("ratelimit_wasm_delayed"), 2);
}

// ---------------------------------------------------------------------------------------------
// 5. Jitter bounds (default `retry_jitter`, 0.1).

fn seeded(workers: usize, config: &str, seed: u64) -> Harness {
    let mut opts = Options::new(workers, config);
    opts.random_seed = Some(seed);
    harness_with(opts)
}

/// `Retry-After` and the number in the problem's `detail` (they must agree).
fn retry_after(o: &Outcome) -> u64 {
    assert_eq!(o.status, 429, "{o:?}");
    let secs = num(o, "retry-after");
    assert_eq!(
        o.body_json()["detail"],
        format!("Rate limit exceeded. Retry after {secs} seconds."),
        "{o:?}"
    );
    secs
}

/// ceil(1.1 × `unjittered`), in integers (1.1 has no exact binary form).
fn jitter_bound(unjittered: u64) -> u64 {
    (unjittered * 11).div_ceil(10)
}

#[test]
fn default_jitter_spreads_retry_after_upwards_by_at_most_ten_percent() {
    let config = json!({ "domain": "policy", "rules": [{ "name": "per-client", "key": ["client"],
        "limits": [ { "requests": 10, "per": "1h" } ] }] })
    .to_string();
    let mut seen = Vec::new();
    for seed in 0..40u64 {
        let h = seeded(2, &config, seed.wrapping_mul(0x9e37_79b9) + 1);
        for c in 0..3 {
            let who = format!("c{c}");
            for i in 0..10 {
                assert_allowed(&h.send_rr(i, client(&who)));
            }
            for i in 0..3 {
                // One token takes 360 s.
                let secs = retry_after(&h.send_rr(i, client(&who)));
                assert!(
                    (360..=jitter_bound(360)).contains(&secs),
                    "seed {seed}: Retry-After {secs} outside [360, 396]"
                );
                seen.push(secs);
            }
        }
    }
    let distinct: BTreeSet<u64> = seen.iter().copied().collect();
    assert!(
        distinct.len() >= 15
            && *distinct.first().unwrap() <= 365
            && *distinct.last().unwrap() >= 391,
        "the spread must cover [360, 396]: {distinct:?}"
    );
}

#[test]
fn block_ends_and_graduated_retry_after_stay_within_ten_percent() {
    let config = graduated_config(Some(0.1));
    let mut ends = Vec::new();
    for seed in 0..30u64 {
        let h = seeded(1, &config, seed.wrapping_mul(0x2545_f491) + 7);
        let t0 = h.now_ns();
        for _ in 0..10 {
            assert_allowed(&h.send(0, client("jay")));
        }
        for _ in 0..2 {
            assert!(h.send(0, client("jay")).paused);
        }
        for _ in 12..19 {
            let secs = retry_after(&h.send(0, client("jay")));
            assert!(
                (6..=jitter_bound(6)).contains(&secs),
                "seed {seed}: Retry-After {secs} outside [6, 7]"
            );
        }
        let block = retry_after(&h.send(0, client("jay")));
        // Find when the block ends, second by second (a blocked request changes nothing).
        let mut end = None;
        let mut waits = Vec::new();
        for s in 299..=331u64 {
            h.set_time_ns(t0 + s * SEC);
            let o = h.send(0, client("jay"));
            if o.status == 200 {
                end = Some(s);
                break;
            }
            waits.push((s, retry_after(&o)));
        }
        let end = end.unwrap_or_else(|| panic!("seed {seed}: still blocked at +331 s"));
        // The block lasts block_for plus up to 10% of it: it ends in (end - 1, end] seconds.
        assert!(
            (300..=330).contains(&end),
            "seed {seed}: the block ended at +{end} s, outside [300, 330]"
        );
        // Each Retry-After is the block's rest rounded up (end - now), spread upwards <= 10%.
        assert!(
            (end..=jitter_bound(end)).contains(&block),
            "seed {seed}: Retry-After {block} at the block, which ends at +{end} s"
        );
        for (s, secs) in waits {
            let rest = end - s;
            assert!(
                (rest..=jitter_bound(rest)).contains(&secs),
                "seed {seed}: Retry-After {secs} at +{s} s, block ends at +{end} s"
            );
        }
        ends.push(end);
    }
    let distinct: BTreeSet<u64> = ends.iter().copied().collect();
    assert!(
        distinct.len() >= 8
            && *distinct.first().unwrap() <= 306
            && *distinct.last().unwrap() >= 324,
        "block ends must spread over [300, 330]: {ends:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Global rules through gateway callouts.

/// A local rule (5/h) and a global rule `api` (4/min); a gateway per the brief.
fn global_config(mode: &str) -> String {
    cfg(json!({
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": mode, "instances": 2,
                    "circuit": { "failures": 3, "cooldown_ms": 2000 } },
        "rules": [
            { "name": "local", "key": ["client"], "limits": [ { "requests": 5, "per": "1h" } ] },
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [ { "requests": 4, "per": "1m" } ] }
        ]
    }))
}

/// A gateway answer for one bucket with one limit: `api`'s 4 per minute enforced.
fn gw(allowed: bool, remaining: Value, reset_ms: Value, retry_after_ms: u64) -> CallResponse {
    gw_enforcing((4, 60_000), allowed, remaining, reset_ms, retry_after_ms)
}

/// A gateway answer for one bucket with one limit, `enforced` (requests, window_ms).
fn gw_enforcing(
    enforced: (u64, u64),
    allowed: bool,
    remaining: Value,
    reset_ms: Value,
    retry_after_ms: u64,
) -> CallResponse {
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(
            json!({ "version": 2, "allowed": allowed, "buckets": [ { "limits": [
                { "requests": enforced.0, "window_ms": enforced.1, "algorithm": "token_bucket",
                  "allowed": allowed, "remaining": remaining, "reset_ms": reset_ms,
                  "retry_after_ms": retry_after_ms } ] } ] })
            .to_string(),
        )
}

fn gw_allow(remaining: i64) -> CallResponse {
    gw(true, json!(remaining), json!(15_000), 0)
}

fn gw_deny(retry_after_ms: u64) -> CallResponse {
    gw(false, json!(0), json!(60_000), retry_after_ms)
}

/// Starts a request that must pause for exactly one callout; returns it and the callout.
fn paused_for_callout(h: &Harness, w: usize, req: Request) -> (StreamId, HttpCall) {
    let o = h.send(w, req);
    assert!(
        o.paused && !o.completed,
        "expected a pause for the gateway: {o:?}"
    );
    assert_eq!(o.request_action, Some(Action::Pause), "{o:?}");
    assert_eq!(o.http_calls.len(), 1, "{o:?}");
    (o.stream, o.http_calls[0].clone())
}

#[derive(Clone, Copy, Debug)]
enum Failure {
    Garbage,
    Status503,
    Timeout,
    Reset,
}

const FAILURES: [Failure; 4] = [
    Failure::Garbage,
    Failure::Status503,
    Failure::Timeout,
    Failure::Reset,
];

fn fail(h: &Harness, call: &HttpCall, how: Failure) {
    match how {
        Failure::Garbage => h.respond_http_call(
            call.worker,
            call.token,
            CallResponse::new(200).body("<html>not json</html>"),
        ),
        Failure::Status503 => h.respond_http_call(
            call.worker,
            call.token,
            CallResponse::new(503).body(r#"{"version":2,"error":"redis: down"}"#),
        ),
        Failure::Timeout => {
            h.advance_ms(49);
            assert_eq!(
                h.pending_http_calls().len(),
                1,
                "timed out too early: {:?}",
                h.pending_http_calls()
            );
            h.advance_ms(1);
        }
        Failure::Reset => h.fail_http_call(call.worker, call.token),
    }
    let state = h
        .http_calls()
        .into_iter()
        .find(|c| c.worker == call.worker && c.token == call.token)
        .unwrap()
        .state;
    assert_ne!(state, CallState::Pending, "{how:?}");
}

#[test]
fn a_global_rule_pauses_for_a_callout_and_an_allowed_answer_resumes_with_headers() {
    let h = gateway_harness(2, &global_config("local"));
    let (id, call) = paused_for_callout(&h, 0, client("alice"));
    assert_eq!(call.upstream, CLUSTER);
    assert_eq!(call.header(":method").as_deref(), Some("POST"), "{call:?}");
    assert_eq!(
        call.header(":path").as_deref(),
        Some("/v1/check"),
        "{call:?}"
    );
    assert_eq!(
        call.header(":authority").as_deref(),
        Some("ratelimit-gateway"),
        "{call:?}"
    );
    assert_eq!(call.timeout_ms, 50);
    let body: Value = serde_json::from_slice(&call.body)
        .unwrap_or_else(|e| panic!("callout body is not JSON ({e}): {call:?}"));
    assert_eq!(
        body,
        json!({ "version": 2, "domain": "policy", "buckets": [
            { "rule": "api", "key": "api/c=alice", "tag": "c=alice", "variant": "default", "cost": 1 } ] }),
        "{call:?}"
    );
    assert_eq!(h.outcome(id).resumes, 0);
    h.respond_http_call(call.worker, call.token, gw_allow(3));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_eq!(o.resumes, 1, "{o:?}");
    // The global limit (3 left of 4) is tighter than the local one (4 left
    // of 5): the legacy lines are its; the IETF ones list both, local first.
    assert_shows(&o, "api", 4, 60, 3);
    assert_eq!(o.header_values("x-ratelimit-reset"), vec!["15"], "{o:?}");
    assert_eq!(
        o.header_values("ratelimit-policy"),
        vec!["\"local\";q=5;w=3600, \"api\";q=4;w=60"],
        "{o:?}"
    );
    assert_eq!(
        o.header_values("ratelimit"),
        vec!["\"local\";r=4;t=720, \"api\";r=3;t=15"],
        "{o:?}"
    );
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 1);
    assert_eq!(h.metric("ratelimit_wasm_global_failures"), 0);
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 1);
    assert!(h.notes().is_empty(), "{:?}", h.notes());
}

#[test]
fn a_global_denial_is_a_429_and_refunds_the_local_charge() {
    let h = gateway_harness(2, &global_config("local"));
    let (id, call) = paused_for_callout(&h, 0, client("bea"));
    h.respond_http_call(call.worker, call.token, gw_allow(3));
    assert_allowed(&h.outcome(id));
    // The gateway denies: 429 with its wait; the local bucket's charge is given back.
    let (id, call) = paused_for_callout(&h, 1, client("bea"));
    h.respond_http_call(call.worker, call.token, gw_deny(15_000));
    let o = h.outcome(id);
    assert_problem(&o, 15, &["api"]);
    assert_shows(&o, "api", 4, 60, 0);
    assert_eq!(o.resumes, 0, "{o:?}");
    // The deny cache answers bea until the gateway's 15 s are over (section 10).
    h.advance_ms(15_000);
    // Local: 5 - 1 admitted = 4 before this request, 3 after (2 had the denial kept its charge).
    let (id, call) = paused_for_callout(&h, 0, client("bea"));
    h.respond_http_call(call.worker, call.token, gw_allow(4));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "local", 5, 3600, 3);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 1);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 3);
    // A local denial skips the callout.
    for _ in 0..3 {
        let (id, call) = paused_for_callout(&h, 1, client("bea"));
        h.respond_http_call(call.worker, call.token, gw_allow(4));
        assert_allowed(&h.outcome(id));
    }
    let calls = h.http_calls().len();
    let o = h.send(0, client("bea"));
    // One token per 720 s, and the 15 s waited gave 15/720 of one: 705 s to go.
    assert_problem(&o, 705, &["local"]);
    assert_eq!(
        h.http_calls().len(),
        calls,
        "a callout after a local denial"
    );
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 6);
}

/// A global rule `api` of 10 a minute with `extra` fields (its mode, its
/// stages), on a gateway.
fn global_rule_config(extra: Value) -> String {
    let mut rule = json!({ "name": "api", "scope": "global", "key": ["client"],
                           "limits": [ { "requests": 10, "per": "1m" } ] });
    for (k, v) in extra.as_object().unwrap() {
        rule[k] = v.clone();
    }
    cfg(json!({
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed" },
        "rules": [rule]
    }))
}

/// A gateway answer for `api`'s one bucket (10 a minute): its limit's verdict,
/// and `apart`'s fields (`watch`, `stage`) on the bucket.
fn gw_apart(allowed: bool, remaining: u64, retry_after_ms: u64, apart: Value) -> CallResponse {
    let mut bucket = json!({ "limits": [
        { "requests": 10, "window_ms": 60_000, "algorithm": "token_bucket", "allowed": allowed,
          "remaining": remaining, "reset_ms": 60_000, "retry_after_ms": retry_after_ms } ] });
    for (k, v) in apart.as_object().unwrap() {
        bucket[k] = v.clone();
    }
    let watched = bucket.get("watch").is_some();
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(
            json!({ "version": 2, "allowed": allowed || watched, "buckets": [bucket] }).to_string(),
        )
}

fn api_metric(what: &str) -> String {
    format!("ratelimit_domain=.=policy;.;ratelimit_rule=.=api;.;ratelimit_wasm_rule_{what}")
}

#[test]
fn a_gateway_watched_denial_passes_is_counted_and_never_cached() {
    let h = gateway_harness(2, &global_rule_config(json!({ "mode": "shadow" })));
    // The gateway's shadow rule would have denied: the request passes, counted.
    for (i, watch) in ["shadow", "soft"].into_iter().enumerate() {
        let (id, call) = paused_for_callout(&h, i, client("alice"));
        let answer = gw_apart(false, 0, 15_000, json!({ "watch": watch }));
        h.respond_http_call(call.worker, call.token, answer);
        let o = h.outcome(id);
        assert_allowed(&o);
        assert_shows(&o, "api", 10, 60, 0);
    }
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 2);
    assert_eq!(h.metric(&api_metric("shadow_denied")), 2);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 0);
    // Never remembered as a denial: the next request asks the gateway again,
    // which enforces the rule after all (its policy, not this filter's mode).
    let (id, call) = paused_for_callout(&h, 0, client("alice"));
    h.respond_http_call(
        call.worker,
        call.token,
        gw_apart(false, 0, 15_000, json!({})),
    );
    assert_problem(&h.outcome(id), 15, &["api"]);
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 0);
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 2);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 1);
}

#[test]
fn a_gateway_stage_warns_delays_and_blocks_as_the_gateway_says() {
    let stages = json!({ "graduated": { "warn_at": 0.5, "delay_at": 0.8, "delay_ms": 100,
                                         "reject_at": 1.2, "block_at": 1.5, "block_for": "30s" } });
    let h = gateway_harness(2, &global_rule_config(stages));
    // Warned: 6 of 10 in use.
    let (id, call) = paused_for_callout(&h, 0, client("gus"));
    let stage = json!({ "stage": { "used": 6, "warn": true, "delay_ms": 0 } });
    h.respond_http_call(call.worker, call.token, gw_apart(true, 4, 0, stage));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_eq!(
        o.header_values("x-ratelimit-warning"),
        vec!["\"api\";used=60"],
        "{o:?}"
    );
    // Delayed, as long as the gateway says (a lie past a minute is clamped).
    let (id, call) = paused_for_callout(&h, 1, client("gus"));
    let stage = json!({ "stage": { "used": 11, "warn": true, "delay_ms": 100 } });
    h.respond_http_call(call.worker, call.token, gw_apart(true, 0, 0, stage));
    let (late, late_call) = paused_for_callout(&h, 0, client("gus"));
    let stage = json!({ "stage": { "used": 11, "warn": true, "delay_ms": 1e12 } });
    h.respond_http_call(
        late_call.worker,
        late_call.token,
        gw_apart(true, 0, 0, stage),
    );
    h.advance_ms(99);
    assert!(
        h.outcome(id).paused && !h.outcome(id).completed,
        "{:?}",
        h.outcome(id)
    );
    h.advance_ms(1);
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_eq!(
        o.header_values("x-ratelimit-warning"),
        vec!["\"api\";used=110"],
        "{o:?}"
    );
    assert_eq!(h.metric("ratelimit_wasm_gateway_answer_clamped"), 1);
    h.advance_ms(59_899);
    assert!(!h.outcome(late).completed, "{:?}", h.outcome(late));
    h.advance_ms(1);
    assert_allowed(&h.outcome(late));
    // Blocked: 429 until the block's end, and the block is the gateway's to
    // keep: the next request asks it again.
    for w in 0..2 {
        let (id, call) = paused_for_callout(&h, w, client("gus"));
        let blocked = json!({ "stage": { "used": 0, "blocked": true, "delay_ms": 0 } });
        h.respond_http_call(call.worker, call.token, gw_apart(false, 0, 30_000, blocked));
        assert_problem(&h.outcome(id), 30, &["api"]);
    }
    assert_eq!(h.metric("ratelimit_wasm_warned"), 3);
    assert_eq!(h.metric("ratelimit_wasm_delayed"), 2);
    assert_eq!(h.metric("ratelimit_wasm_blocked"), 2);
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 0);
}

/// A shadow rule's local stand-in watches too: with the gateway failing
/// under `failure_mode: local`, a share of 2 (4 a minute over 2 instances)
/// lets every request through and counts the ones past it.
#[test]
fn a_shadow_rules_local_stand_in_never_denies() {
    let config = cfg(json!({
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "local", "instances": 2,
                    "circuit": { "failures": 100, "cooldown_ms": 2000 } },
        "rules": [{ "name": "api", "scope": "global", "mode": "shadow", "key": ["client"],
                    "limits": [ { "requests": 4, "per": "1m" } ] }]
    }));
    let h = gateway_harness(2, &config);
    for i in 0..5 {
        let (id, call) = paused_for_callout(&h, i % 2, client("sol"));
        fail(&h, &call, Failure::Status503);
        assert_allowed(&h.outcome(id));
    }
    assert_eq!(h.metric("ratelimit_wasm_failure_mode_local"), 5);
    assert_eq!(h.metric("ratelimit_wasm_shadow_denied"), 3);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 0);
}

#[test]
fn failure_mode_open_allows_every_failure_and_counts_it() {
    let h = gateway_harness(2, &global_config("open"));
    for (n, how) in FAILURES.into_iter().enumerate() {
        let n = n as u64;
        let (id, call) = paused_for_callout(&h, n as usize % 2, client("opa"));
        fail(&h, &call, how);
        let o = h.outcome(id);
        assert_allowed(&o);
        assert_eq!(o.resumes, 1, "{how:?}: {o:?}");
        // Only the local rule's figures are known: 5 - (n + 1) left.
        assert_shows(&o, "local", 5, 3600, 4 - n);
        assert_eq!(
            h.metric("ratelimit_wasm_failure_mode_open"),
            n + 1,
            "{how:?}"
        );
        assert_eq!(h.metric("ratelimit_wasm_global_failures"), n + 1, "{how:?}");
        // A success in between keeps the circuit closed (failures must be consecutive).
        let (id, call) = paused_for_callout(&h, 1, client(&format!("ok{n}")));
        h.respond_http_call(call.worker, call.token, gw_allow(3));
        assert_allowed(&h.outcome(id));
    }
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 0);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 0);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 0);
    assert!(
        !h.logs_containing("gateway failed").is_empty(),
        "{}",
        h.log_text()
    );
}

#[test]
fn failure_mode_closed_answers_503_and_refunds() {
    let h = gateway_harness(2, &global_config("closed"));
    for (n, how) in FAILURES.into_iter().enumerate() {
        let n = n as u64;
        let (id, call) = paused_for_callout(&h, n as usize % 2, client("cle"));
        fail(&h, &call, how);
        let o = h.outcome(id);
        assert_eq!(o.status, 503, "{how:?}: {o:?}");
        assert!(
            o.completed && o.upstream_request.is_none(),
            "{how:?}: {o:?}"
        );
        assert_eq!(o.header_values("retry-after"), vec!["2"], "{how:?}: {o:?}");
        assert_eq!(
            o.header_values("content-type"),
            vec!["application/problem+json"],
            "{how:?}: {o:?}"
        );
        assert_eq!(
            o.body_json(),
            json!({ "type": "about:blank", "title": "Service Unavailable", "status": 503,
                    "detail": "Rate limit service unavailable. Retry after 2 seconds." }),
            "{how:?}"
        );
        assert_eq!(h.metric("ratelimit_wasm_failure_mode_closed"), n + 1);
        assert_eq!(h.metric("ratelimit_wasm_requests_denied"), n + 1);
        // The 503 consumed nothing: the local bucket still has all 5.
        let (id, call) = paused_for_callout(&h, 1, client(&format!("ok{n}")));
        h.respond_http_call(call.worker, call.token, gw_allow(4));
        assert_allowed(&h.outcome(id));
    }
    let (id, call) = paused_for_callout(&h, 0, client("cle"));
    h.respond_http_call(call.worker, call.token, gw_allow(4));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "local", 5, 3600, 4);
    // Three failures in a row open the circuit: then 503 without a callout.
    for how in [Failure::Reset, Failure::Garbage, Failure::Reset] {
        let (id, call) = paused_for_callout(&h, 0, client("cle"));
        fail(&h, &call, how);
        assert_eq!(h.outcome(id).status, 503);
    }
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
    let calls = h.http_calls().len();
    let o = h.send(1, client("cle"));
    assert_eq!(o.status, 503, "{o:?}");
    assert!(o.completed && o.http_calls.is_empty(), "{o:?}");
    assert_eq!(o.header_values("retry-after"), vec!["2"], "{o:?}");
    assert_eq!(h.http_calls().len(), calls);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 1);
    assert_eq!(h.metric("ratelimit_wasm_failure_mode_closed"), 8);
}

#[test]
fn failure_mode_local_admits_exactly_the_limit_divided_by_instances() {
    let h = gateway_harness(2, &global_config("local"));
    // api: 4 per minute over 2 instances = 2 for this proxy while the gateway fails.
    let mut admitted = 0;
    for (n, how) in [Failure::Garbage, Failure::Timeout, Failure::Reset]
        .into_iter()
        .enumerate()
    {
        let (id, call) = paused_for_callout(&h, n % 2, client("lou"));
        fail(&h, &call, how);
        let o = h.outcome(id);
        match n {
            0 | 1 => {
                assert_allowed(&o);
                assert_shows(&o, "api", 2, 60, 1 - n as u64);
                admitted += 1;
            }
            _ => assert_problem(&o, 30, &["api"]),
        }
    }
    // The third failure opened the circuit: no more callouts, still decided locally.
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
    let calls = h.http_calls().len();
    for i in 0..4 {
        let o = h.send_rr(i, client("lou"));
        assert!(o.http_calls.is_empty(), "{o:?}");
        assert_problem(&o, 30, &["api"]);
    }
    // Another client gets its own share of 2, without callouts.
    for i in 0..4 {
        let o = h.send_rr(i, client("max"));
        assert!(o.completed && o.http_calls.is_empty(), "{o:?}");
        if o.status == 200 {
            admitted += 1;
        } else {
            assert_problem(&o, 30, &["api"]);
        }
    }
    assert_eq!(admitted, 4, "2 per client");
    assert_eq!(h.http_calls().len(), calls);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 8);
    assert_eq!(h.metric("ratelimit_wasm_failure_mode_local"), 3 + 8);
    assert_eq!(h.metric("ratelimit_wasm_global_failures"), 3);
    // The local rule's charge was refunded for every denial: lou has 5 - 2 left.
    let calls_before = h.http_calls().len();
    h.advance(Duration::from_secs(2));
    let (id, call) = paused_for_callout(&h, 0, client("lou"));
    assert_eq!(h.http_calls().len(), calls_before + 1);
    h.respond_http_call(call.worker, call.token, gw_allow(4));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "local", 5, 3600, 2);
}

#[test]
fn the_circuit_opens_after_three_failures_and_one_probe_closes_it() {
    let h = gateway_harness(2, &global_config("open"));
    for (n, how) in [Failure::Reset, Failure::Garbage, Failure::Timeout]
        .into_iter()
        .enumerate()
    {
        let (id, call) = paused_for_callout(&h, n % 2, client(&format!("c{n}")));
        fail(&h, &call, how);
        assert_allowed(&h.outcome(id));
    }
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
    assert_eq!(
        h.logs_containing("circuit to the gateway opened").len(),
        1,
        "{}",
        h.log_text()
    );
    let opened_at = h.now_ns();
    let calls = h.http_calls().len();
    assert_eq!(calls, 3);
    // Open: no callout, the failure mode decides (open: allowed, counted).
    for w in 0..2 {
        let o = h.send(w, client("skip"));
        assert_allowed(&o);
        assert!(o.http_calls.is_empty(), "{o:?}");
    }
    assert_eq!(h.http_calls().len(), calls);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 2);
    assert_eq!(h.metric("ratelimit_wasm_failure_mode_open"), 5);
    h.advance_ms(1999);
    assert_allowed(&h.send(0, client("skip")));
    assert_eq!(h.http_calls().len(), calls);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 3);
    // After the cooldown, exactly one request probes; the others still skip meanwhile.
    h.advance_ms(1);
    assert_eq!(h.now_ns() - opened_at, 2000 * MS);
    let (probe, call) = paused_for_callout(&h, 1, client("probe"));
    for w in 0..2 {
        let o = h.send(w, client("skip"));
        assert_allowed(&o);
        assert!(o.http_calls.is_empty(), "a second probe: {o:?}");
    }
    assert_eq!(h.http_calls().len(), calls + 1);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 5);
    // The probe succeeds: the circuit closes and requests call the gateway again.
    h.respond_http_call(call.worker, call.token, gw_allow(3));
    let o = h.outcome(probe);
    assert_allowed(&o);
    assert_shows(&o, "api", 4, 60, 3);
    assert_eq!(
        h.logs_containing("circuit to the gateway closed").len(),
        1,
        "{}",
        h.log_text()
    );
    for w in 0..2 {
        let (id, call) = paused_for_callout(&h, w, client("after"));
        h.respond_http_call(call.worker, call.token, gw_allow(3 - w as i64));
        assert_allowed(&h.outcome(id));
    }
    assert_eq!(h.http_calls().len(), calls + 3);
    assert_eq!(h.metric("ratelimit_wasm_circuit_open_skips"), 5);
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 6);
    assert_eq!(h.metric("ratelimit_wasm_global_failures"), 3);
    assert_eq!(h.metric("ratelimit_wasm_failure_mode_open"), 3 + 5);
}

#[test]
fn out_of_range_gateway_figures_are_clamped() {
    let h = gateway_harness(
        2,
        &cfg(json!({
            "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed", "instances": 2,
                        "circuit": { "failures": 3, "cooldown_ms": 2000 } },
            "rules": [{ "name": "api", "scope": "global", "key": ["client"],
                        "limits": [ { "requests": 4, "per": "1m" } ] }]
        })),
    );
    let ask = |w: usize, answer: CallResponse| {
        let (id, call) = paused_for_callout(&h, w, client("cla"));
        h.respond_http_call(call.worker, call.token, answer);
        let o = h.outcome(id);
        assert_allowed(&o);
        o
    };
    // Remaining above the limit: shown as the limit.
    let o = ask(0, gw(true, json!(99), json!(15_000), 0));
    assert_shows(&o, "api", 4, 60, 4);
    assert_eq!(h.metric("ratelimit_wasm_gateway_answer_clamped"), 1);
    // Negative remaining: 0.
    let o = ask(1, gw(true, json!(-3), json!(15_000), 0));
    assert_shows(&o, "api", 4, 60, 0);
    assert_eq!(h.metric("ratelimit_wasm_gateway_answer_clamped"), 2);
    // A reset far beyond two windows: two windows (120 s).
    let o = ask(0, gw(true, json!(2), json!(1e12), 0));
    assert_shows(&o, "api", 4, 60, 2);
    assert_eq!(o.header_values("x-ratelimit-reset"), vec!["120"], "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_gateway_answer_clamped"), 3);
    // In range: nothing clamped.
    let o = ask(1, gw(true, json!(1), json!(15_000), 0));
    assert_shows(&o, "api", 4, 60, 1);
    assert_eq!(h.metric("ratelimit_wasm_gateway_answer_clamped"), 3);
    assert_eq!(h.metric("ratelimit_wasm_global_failures"), 0);
}

// ---------------------------------------------------------------------------------------------
// 7. Quotas.

fn quota_config(with_global_rule: bool) -> String {
    let mut rules = vec![json!({ "name": "burst", "key": ["client"],
                                 "limits": [ { "requests": 5, "per": "1h" } ] })];
    if with_global_rule {
        rules.push(json!({ "name": "api", "scope": "global", "key": ["client"],
                           "limits": [ { "requests": 4, "per": "1m" } ] }));
    }
    cfg(json!({
        "tiers": { "free": {}, "pro": {} },
        "identity": { "default_tier": "free" },
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed", "instances": 2,
                    "circuit": { "failures": 3, "cooldown_ms": 2000 } },
        "rules": rules,
        "quotas": [{ "name": "monthly", "key": ["client"], "period": "month",
                     "tiers": { "free": 3 }, "upgrade_url": UPGRADE }]
    }))
}

fn quota_answer(buckets: Value, quota_allowed: bool, remaining: u64) -> CallResponse {
    let rate_allowed = buckets
        .as_array()
        .unwrap()
        .iter()
        .all(|b| b["limits"][0]["allowed"] == json!(true));
    CallResponse::new(200).body(
        json!({ "version": 2, "allowed": rate_allowed && quota_allowed, "buckets": buckets,
                "quotas": [ { "limit": 3, "period": "month", "allowed": quota_allowed,
                              "remaining": remaining, "reset_ms": 86_400_000 } ] })
        .to_string(),
    )
}

#[test]
fn an_exhausted_quota_is_a_403_with_the_upgrade_link_and_no_retry_after() {
    let h = gateway_harness(2, &quota_config(false));
    let (id, call) = paused_for_callout(&h, 0, client("qui"));
    let body: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(
        body,
        json!({ "version": 2, "domain": "policy",
                "quotas": [ { "quota": "monthly", "key": "monthly/c=qui", "tag": "c=qui",
                              "variant": "tier:free", "amount": 1 } ] }),
        "{call:?}"
    );
    h.respond_http_call(call.worker, call.token, quota_answer(json!([]), true, 2));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "burst", 5, 3600, 4);
    // Quota spent.
    let (id, call) = paused_for_callout(&h, 1, client("qui"));
    h.respond_http_call(call.worker, call.token, quota_answer(json!([]), false, 0));
    let o = h.outcome(id);
    assert_eq!(o.status, 403, "{o:?}");
    assert!(o.completed && o.upstream_request.is_none(), "{o:?}");
    assert_eq!(
        o.header_values("content-type"),
        vec!["application/problem+json"],
        "{o:?}"
    );
    assert_eq!(
        o.header_values("link"),
        vec![format!("<{UPGRADE}>; rel=\"payment\"")],
        "{o:?}"
    );
    assert!(o.header("retry-after").is_none(), "{o:?}");
    let problem = o.body_json();
    assert_eq!(
        problem["type"], "tag:ratelimit-wasm,2026:quota-exhausted",
        "{problem}"
    );
    assert_eq!(problem["title"], "Quota Exhausted", "{problem}");
    assert_eq!(problem["status"], 403, "{problem}");
    assert_eq!(
        problem["violated-policies"],
        json!(["monthly"]),
        "{problem}"
    );
    assert_eq!(problem["upgrade_url"], UPGRADE, "{problem}");
    assert_eq!(h.metric("ratelimit_wasm_quota_exhausted"), 1);
    // Neither is charged: the local burst bucket got its token back (5 - 1 - 1 = 3 left).
    let (id, call) = paused_for_callout(&h, 0, client("qui"));
    h.respond_http_call(call.worker, call.token, quota_answer(json!([]), true, 1));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "burst", 5, 3600, 3);
    // A pro client has no quota (none configured for pro, no `limit`): no callout at all.
    let h2 = gateway_harness(
        1,
        &quota_config(false).replace(r#""default_tier":"free""#, r#""default_tier":"pro""#),
    );
    let o = h2.send(0, client("pro-client"));
    assert_allowed(&o);
    assert!(o.http_calls.is_empty(), "{o:?}");
}

/// README *Quotas*: when the gateway fails, quotas are not enforced in
/// `failure_mode` `open` and `local` (they cannot be decided locally), and the
/// request gets 503 in `closed`.
#[test]
fn a_failed_gateway_skips_quotas_in_open_and_local_and_is_a_503_in_closed() {
    for mode in ["open", "local", "closed"] {
        // A breaker that stays closed, so every failure is a callout's.
        let config = quota_config(false)
            .replace(
                r#""failure_mode":"closed""#,
                &format!(r#""failure_mode":"{mode}""#),
            )
            .replace(r#""failures":3"#, r#""failures":100"#);
        assert!(
            config.contains(&format!(r#""failure_mode":"{mode}""#))
                && config.contains(r#""failures":100"#),
            "{config}"
        );
        let h = gateway_harness(2, &config);
        for how in FAILURES {
            let (id, call) = paused_for_callout(&h, 0, client("fay"));
            fail(&h, &call, how);
            let o = h.outcome(id);
            if mode == "closed" {
                assert_eq!(o.status, 503, "{mode} {how:?}: {o:?}");
                assert!(o.upstream_request.is_none(), "{mode} {how:?}: {o:?}");
            } else {
                assert_allowed(&o);
            }
        }
        assert_eq!(h.metric("ratelimit_wasm_quota_exhausted"), 0, "{mode}");
    }
}

#[test]
fn a_rate_limit_denial_beats_an_exhausted_quota_in_the_same_answer() {
    let h = gateway_harness(2, &quota_config(true));
    let (id, call) = paused_for_callout(&h, 0, client("rae"));
    let body: Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(
        body,
        json!({ "version": 2, "domain": "policy",
                "buckets": [ { "rule": "api", "key": "api/c=rae", "tag": "c=rae", "variant": "default",
                               "cost": 1 } ],
                "quotas": [ { "quota": "monthly", "key": "monthly/c=rae", "tag": "c=rae",
                              "variant": "tier:free", "amount": 1 } ] }),
        "{call:?}"
    );
    let denied = json!([ { "limits": [ { "requests": 4, "window_ms": 60_000, "algorithm": "token_bucket",
                                        "allowed": false, "remaining": 0, "reset_ms": 60_000,
                                        "retry_after_ms": 15_000 } ] } ]);
    h.respond_http_call(call.worker, call.token, quota_answer(denied, false, 0));
    let o = h.outcome(id);
    assert_problem(&o, 15, &["api"]);
    assert_eq!(h.metric("ratelimit_wasm_quota_exhausted"), 0);
    // Once the deny cache's 15 s are over (section 10), only the quota spent: 403.
    h.advance_ms(15_000);
    let (id, call) = paused_for_callout(&h, 1, client("rae"));
    let allowed = json!([ { "limits": [ { "requests": 4, "window_ms": 60_000, "algorithm": "token_bucket",
                                         "allowed": true, "remaining": 3, "reset_ms": 15_000,
                                         "retry_after_ms": 0 } ] } ]);
    h.respond_http_call(call.worker, call.token, quota_answer(allowed, false, 0));
    assert_eq!(h.outcome(id).status, 403);
    assert_eq!(h.metric("ratelimit_wasm_quota_exhausted"), 1);
}

// ---------------------------------------------------------------------------------------------
// 8. A request cancelled while it waits for the gateway.

#[test]
fn a_late_answer_after_the_client_left_changes_nothing() {
    let h = gateway_harness(2, &global_config("closed"));
    // Three clients leave while their request waits; the answers arrive afterwards: a
    // denial, an allowance, and a timeout.
    let mut gone = Vec::new();
    for w in 0..3 {
        let (id, call) = paused_for_callout(&h, w % 2, client("lee"));
        let o = h.cancel(id);
        assert!(o.completed && o.cancelled && o.status == 0, "{o:?}");
        gone.push((id, call));
    }
    let before = metric_values(&h);
    h.respond_http_call(gone[0].1.worker, gone[0].1.token, gw_deny(15_000));
    h.respond_http_call(gone[1].1.worker, gone[1].1.token, gw_allow(2));
    h.advance_ms(50);
    assert!(
        h.pending_http_calls().is_empty(),
        "{:?}",
        h.pending_http_calls()
    );
    for (id, _) in &gone {
        let o = h.outcome(*id);
        assert!(o.completed && o.cancelled, "{o:?}");
        assert_eq!((o.status, o.resumes), (0, 0), "{o:?}");
        assert!(
            o.local_response.is_none() && o.upstream_request.is_none(),
            "{o:?}"
        );
        assert!(o.notes.is_empty(), "{o:?}");
    }
    assert!(h.notes().is_empty(), "{:?}", h.notes());
    assert_eq!(
        metric_values(&h),
        before,
        "a late answer changed the counters"
    );
    assert!(
        h.logs_at_least(LogLevel::Critical).is_empty(),
        "{}",
        h.log_text()
    );
    // Both workers still work, and the three cancelled requests gave their local charge
    // back (README, Global limits): 5 - 1 = 4 left of the local 5/h.
    let (id, call) = paused_for_callout(&h, 0, client("lee"));
    h.respond_http_call(call.worker, call.token, gw_allow(4));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_eq!(o.resumes, 1);
    assert_shows(&o, "local", 5, 3600, 4);
    let (id, call) = paused_for_callout(&h, 1, client("other"));
    h.respond_http_call(call.worker, call.token, gw_deny(15_000));
    assert_problem(&h.outcome(id), 15, &["api"]);
    assert!(h.open_streams().is_empty(), "{:?}", h.open_streams());
}

// ---------------------------------------------------------------------------------------------
// 9. Lease mode: batches of a global bucket spent locally.

/// A global rule `api` (100/h) in lease mode: batches of 5, spent for 1 s.
fn lease_config(mode: &str) -> String {
    cfg(json!({
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": mode,
                    "circuit": { "failures": 3, "cooldown_ms": 2000 },
                    "lease": { "fraction": 0.05, "max_wait_ms": 20, "ttl_ms": 1000 } },
        "rules": [
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [ { "requests": 100, "per": "1h" } ] }
        ]
    }))
}

/// The gateway's answer to a lease.
fn granted(n: u64, remaining: u64, retry_after_ms: u64) -> CallResponse {
    CallResponse::new(200)
        .header("content-type", "application/json")
        .body(
            json!({ "version": 2, "granted": n, "limits": [
                { "requests": 100, "window_ms": 3_600_000,
                  "remaining": remaining, "reset_ms": 90_000, "retry_after_ms": retry_after_ms } ] })
            .to_string(),
        )
}

fn call_json(call: &HttpCall) -> Value {
    serde_json::from_slice(&call.body).unwrap_or_else(|e| panic!("not JSON ({e}): {call:?}"))
}

fn lease_body(want: u64, returned: u64) -> Value {
    json!({ "version": 2, "domain": "policy", "rule": "api", "key": "api/c=ann", "tag": "c=ann",
            "variant": "default", "want": want, "return": returned })
}

#[test]
fn a_lease_serves_both_workers_without_callouts_until_it_is_spent() {
    let h = gateway_harness(2, &lease_config("closed"));
    let (id, call) = paused_for_callout(&h, 0, client("ann"));
    assert_eq!(
        call.header(":path").as_deref(),
        Some("/v1/lease"),
        "{call:?}"
    );
    assert_eq!(
        call.timeout_ms, 20,
        "max_wait_ms is the lease callout's timeout"
    );
    assert_eq!(call_json(&call), lease_body(5, 0));
    h.respond_http_call(call.worker, call.token, granted(5, 90, 0));
    let o = h.outcome(id);
    assert_allowed(&o);
    // remaining: 90 in the pool + 4 left in this proxy's batch.
    assert_shows(&o, "api", 100, 3600, 94);
    // The other 4 tokens serve either worker with no callout.
    for (i, left) in [(1, 93), (0, 92), (1, 91), (0, 90)] {
        let o = h.send(i, client("ann"));
        assert_allowed(&o);
        assert!(o.http_calls.is_empty(), "{o:?}");
        assert_shows(&o, "api", 100, 3600, left);
    }
    // (Counters are read at the end: reading them runs the workers' tick,
    // whose lease top-up would fetch the next batch before the requests do.)
    // Spent: the next request fetches the next batch; one arriving meanwhile is
    // checked on its own rather than waiting or fetching twice.
    let (id, call) = paused_for_callout(&h, 1, client("ann"));
    assert_eq!(call_json(&call), lease_body(5, 0));
    let (id2, call2) = paused_for_callout(&h, 0, client("ann"));
    assert_eq!(
        call2.header(":path").as_deref(),
        Some("/v1/check"),
        "{call2:?}"
    );
    h.respond_http_call(
        call2.worker,
        call2.token,
        gw_enforcing((100, 3_600_000), true, json!(84), json!(60_000), 0),
    );
    assert_allowed(&h.outcome(id2));
    h.respond_http_call(call.worker, call.token, granted(5, 85, 0));
    assert_allowed(&h.outcome(id));
    assert_eq!(h.metric("ratelimit_wasm_lease_served"), 4);
    assert_eq!(h.metric("ratelimit_wasm_lease_fetches"), 2);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 3);
    assert_eq!(h.metric("ratelimit_wasm_requests_allowed"), 7);
    assert!(h.notes().is_empty(), "{:?}", h.notes());
}

#[test]
fn an_empty_lease_grant_is_a_429_here_until_a_token_is_due_and_leftovers_go_back_after_the_ttl() {
    let h = gateway_harness(2, &lease_config("closed"));
    let (id, call) = paused_for_callout(&h, 0, client("ann"));
    h.respond_http_call(call.worker, call.token, granted(0, 0, 36_000));
    assert_problem(&h.outcome(id), 36, &["api"]);
    // Until a token is due, both workers refuse without asking the gateway again.
    h.advance_ms(6_000);
    let o = h.send(1, client("ann"));
    assert_problem(&o, 30, &["api"]);
    assert!(o.http_calls.is_empty(), "{o:?}");
    assert_eq!(h.metric("ratelimit_wasm_lease_fetches"), 1);
    h.advance_ms(30_000);
    let (_, call) = paused_for_callout(&h, 1, client("ann"));
    assert_eq!(call_json(&call), lease_body(5, 0));
    h.respond_http_call(call.worker, call.token, granted(0, 0, 36_000));
    // Another client: 4 of 5 left, unspent after the 1 s ttl, go back with the next batch.
    let (id, call) = paused_for_callout(&h, 0, client("bob"));
    h.respond_http_call(call.worker, call.token, granted(5, 50, 0));
    assert_allowed(&h.outcome(id));
    h.advance_ms(1001);
    let (id, call) = paused_for_callout(&h, 1, client("bob"));
    let mut want = lease_body(5, 4);
    want["key"] = json!("api/c=bob");
    want["tag"] = json!("c=bob");
    assert_eq!(call_json(&call), want);
    h.respond_http_call(call.worker, call.token, granted(5, 50, 0));
    assert_allowed(&h.outcome(id));
}

#[test]
fn the_timer_tops_up_a_batch_at_half_without_holding_more_than_one_lease() {
    let h = gateway_harness(2, &lease_config("closed"));
    let (id, call) = paused_for_callout(&h, 0, client("ann"));
    h.respond_http_call(call.worker, call.token, granted(5, 90, 0));
    assert_allowed(&h.outcome(id));
    // 4 left: above half, no refresh.
    h.advance_ms(50);
    assert!(
        h.pending_http_calls().is_empty(),
        "{:?}",
        h.pending_http_calls()
    );
    assert_allowed(&h.send(1, client("ann")));
    assert_allowed(&h.send(1, client("ann")));
    // 2 left of 5: a timer asks for the 3 missing, once across both workers.
    h.advance_ms(25);
    let calls = h.pending_http_calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(call_json(&calls[0]), lease_body(3, 0));
    h.respond_http_call(calls[0].worker, calls[0].token, granted(3, 87, 0));
    for _ in 0..5 {
        let o = h.send(0, client("ann"));
        assert_allowed(&o);
        assert!(o.http_calls.is_empty(), "{o:?}");
    }
    assert_eq!(h.metric("ratelimit_wasm_lease_fetches"), 2);
    assert_eq!(h.metric("ratelimit_wasm_lease_served"), 7);
}

#[test]
fn a_failed_lease_takes_the_failure_mode_and_the_next_request_tries_again() {
    for how in FAILURES {
        let h = gateway_harness(2, &lease_config("open"));
        let (id, call) = paused_for_callout(&h, 0, client("ann"));
        if let Failure::Timeout = how {
            // A lease waits max_wait_ms (20), not timeout_ms.
            h.advance_ms(19);
            assert_eq!(h.pending_http_calls().len(), 1, "timed out too early");
            h.advance_ms(1);
        } else {
            fail(&h, &call, how);
        }
        let o = h.outcome(id);
        assert_allowed(&o);
        assert_eq!(h.metric("ratelimit_wasm_failure_mode_open"), 1, "{how:?}");
        assert_eq!(h.metric("ratelimit_wasm_global_failures"), 1, "{how:?}");
        let (id, call) = paused_for_callout(&h, 1, client("ann"));
        assert_eq!(
            call.header(":path").as_deref(),
            Some("/v1/lease"),
            "{how:?}"
        );
        h.respond_http_call(call.worker, call.token, granted(5, 90, 0));
        assert_allowed(&h.outcome(id));
    }
    // Closed: a 503, and after 3 failures the circuit opens; a batch in hand is still spent.
    let h = gateway_harness(2, &lease_config("closed"));
    let (id, call) = paused_for_callout(&h, 0, client("ann"));
    h.respond_http_call(call.worker, call.token, granted(5, 90, 0));
    assert_allowed(&h.outcome(id));
    for n in 0..3 {
        let (id, call) = paused_for_callout(&h, n % 2, client(&format!("x{n}")));
        fail(&h, &call, Failure::Status503);
        assert_eq!(h.outcome(id).status, 503);
    }
    assert_eq!(h.metric("ratelimit_wasm_circuit_opened"), 1);
    let o = h.send(0, client("nobody"));
    assert_eq!(o.status, 503, "{o:?}");
    assert!(o.http_calls.is_empty(), "{o:?}");
    for _ in 0..4 {
        assert_allowed(&h.send(1, client("ann")));
    }
    assert_eq!(h.send(1, client("ann")).status, 503);
}

// ---------------------------------------------------------------------------------------------
// 10. The deny cache: a gateway denial remembered by every worker of the proxy until the
// gateway's wait is over (docs/global.md, "The deny cache").

/// `api` (global, 4/min, 8/min for the `pro` tier, from `x-tier`), `route` (global, 2/min,
/// only under `/r`), `local` (5/h); `/export` costs 3. `deny_cache` is set when given.
fn deny_cache_config(deny_cache: Option<u64>) -> String {
    let mut global = json!({ "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "closed",
                             "circuit": { "failures": 3, "cooldown_ms": 2000 } });
    if let Some(n) = deny_cache {
        global["deny_cache"] = json!(n);
    }
    cfg(json!({
        "tiers": { "free": {}, "pro": {} },
        "identity": { "tier_header": "x-tier", "default_tier": "free" },
        "global": global,
        "costs": [ { "match": { "path_prefix": "/export" }, "cost": 3 } ],
        "rules": [
            { "name": "local", "key": ["client"], "limits": [ { "requests": 5, "per": "1h" } ] },
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [ { "requests": 4, "per": "1m" } ],
              "tiers": { "pro": [ { "requests": 8, "per": "1m" } ] } },
            { "name": "route", "scope": "global", "key": ["client"], "match": { "path_prefix": "/r" },
              "limits": [ { "requests": 2, "per": "1m" } ] }
        ]
    }))
}

/// A gateway answer with one bucket per `(allowed, retry_after_ms)`, each one limit of
/// 4 per minute.
fn gw_buckets(buckets: &[(bool, u64)]) -> CallResponse {
    let all = buckets.iter().all(|(a, _)| *a);
    let buckets: Vec<Value> = buckets
        .iter()
        .map(|(allowed, retry)| {
            json!({ "limits": [ { "requests": 4, "window_ms": 60_000, "algorithm": "token_bucket",
                                  "allowed": allowed, "remaining": if *allowed { 2 } else { 0 },
                                  "reset_ms": 60_000, "retry_after_ms": retry } ] })
        })
        .collect();
    CallResponse::new(200)
        .body(json!({ "version": 2, "allowed": all, "buckets": buckets }).to_string())
}

/// The request answered 429 here, without a callout.
fn assert_cached_denial(o: &Outcome, retry_after: u64, policies: &[&str]) {
    assert!(
        o.http_calls.is_empty(),
        "a callout for a cached denial: {o:?}"
    );
    assert_problem(o, retry_after, policies);
}

#[test]
fn a_denial_is_remembered_by_both_workers_until_the_gateways_wait_counted_from_the_callout() {
    let h = gateway_harness(2, &deny_cache_config(None));
    let (id, call) = paused_for_callout(&h, 0, client("bea"));
    // The answer takes 30 ms: the wait counts from the callout, when Redis can have
    // answered at the earliest, so that the cache never outlasts the gateway's wait.
    h.advance_ms(30);
    h.respond_http_call(call.worker, call.token, gw_deny(15_000));
    assert_problem(&h.outcome(id), 15, &["api"]);
    // 14 s after the callout: the other worker answers 429 itself, Retry-After the 1 s left.
    h.advance_ms(13_970);
    let o = h.send(1, client("bea"));
    assert_cached_denial(&o, 1, &["api"]);
    // The gateway's figures, less the time gone by: reset 60 s - 14 s.
    assert_shows(&o, "api", 4, 60, 0);
    assert_eq!(o.header_values("x-ratelimit-reset"), vec!["46"], "{o:?}");
    h.advance_ms(999);
    assert_cached_denial(&h.send(0, client("bea")), 1, &["api"]);
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 2);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 1);
    assert_eq!(h.metric("ratelimit_wasm_requests_denied"), 3);
    // 15 s after the callout the gateway is asked again, and a cached denial charged
    // nothing locally: 4 of the local 5/h left after this one.
    h.advance_ms(1);
    let (id, call) = paused_for_callout(&h, 1, client("bea"));
    h.respond_http_call(call.worker, call.token, gw_allow(4));
    let o = h.outcome(id);
    assert_allowed(&o);
    assert_shows(&o, "local", 5, 3600, 4);
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 2);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 2);
    assert!(h.notes().is_empty(), "{:?}", h.notes());
}

#[test]
fn a_cached_denial_spares_no_other_bucket_variant_or_smaller_cost_even_on_its_slot() {
    // One slot: every bucket lands on the one the denial holds.
    let h = gateway_harness(2, &deny_cache_config(Some(1)));
    let (id, call) = paused_for_callout(&h, 0, client("bea").path("/export"));
    h.respond_http_call(call.worker, call.token, gw_deny(15_000));
    assert_problem(&h.outcome(id), 15, &["api"]);
    assert_cached_denial(&h.send(1, client("bea").path("/export")), 15, &["api"]);
    // Another client, the same client in another tier (another variant of the same key),
    // a cost of 1 where 3 was denied: each asks the gateway.
    for req in [
        client("cid"),
        client("bea").header("x-tier", "pro"),
        client("bea"),
    ] {
        let (id, call) = paused_for_callout(&h, 1, req);
        h.respond_http_call(call.worker, call.token, gw_allow(2));
        assert_allowed(&h.outcome(id));
    }
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 1);
    // Two buckets (`api` and `route`), the gateway denies `route` only: a request with both
    // is answered here, one with `api` alone asks the gateway.
    let (id, call) = paused_for_callout(&h, 0, client("dan").path("/r"));
    h.respond_http_call(
        call.worker,
        call.token,
        gw_buckets(&[(true, 0), (false, 20_000)]),
    );
    assert_problem(&h.outcome(id), 20, &["route"]);
    assert_cached_denial(&h.send(1, client("dan").path("/r")), 20, &["route"]);
    let (id, call) = paused_for_callout(&h, 1, client("dan"));
    h.respond_http_call(call.worker, call.token, gw_allow(1));
    assert_allowed(&h.outcome(id));
    // The slot now holds dan's `route`: bea's denial was replaced, and is asked again.
    let (id, call) = paused_for_callout(&h, 0, client("bea").path("/export"));
    h.respond_http_call(call.worker, call.token, gw_deny(15_000));
    assert_problem(&h.outcome(id), 15, &["api"]);
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 2);
    assert_eq!(h.metric("ratelimit_wasm_global_calls"), 7);
}

#[test]
fn deny_cache_zero_asks_the_gateway_every_time_and_a_bad_size_is_refused() {
    let h = gateway_harness(2, &deny_cache_config(Some(0)));
    for w in 0..2 {
        let (id, call) = paused_for_callout(&h, w, client("bea"));
        h.respond_http_call(call.worker, call.token, gw_deny(15_000));
        assert_problem(&h.outcome(id), 15, &["api"]);
    }
    assert_eq!(h.metric("ratelimit_wasm_deny_cache_hits"), 0);
    assert!(
        h.shared_keys().iter().all(|k| !k.contains("/deny/")),
        "{:?}",
        h.shared_keys()
    );
    let h = Harness::with_options(
        Options::new(1, deny_cache_config(Some((1 << 20) + 1))).clusters(&[CLUSTER]),
    )
    .unwrap();
    assert_eq!(h.configure_results(), vec![false]);
    assert!(
        h.log_text().contains("global.deny_cache"),
        "{}",
        h.log_text()
    );
}

/// Route name, route metadata and dynamic metadata, as Envoy's properties,
/// matched and keyed on by the compiled filter: a route-keyed rule counts
/// per route, a request without the route's name or the claim is not
/// limited by the rules that read them.
#[test]
fn route_and_metadata_conditions_and_keys_read_their_properties() {
    let config = cfg(json!({
        "rules": [
            { "name": "premium", "match": { "route_metadata": { "ratelimit/plan": "premium" } },
              "key": ["route"], "limits": [{ "requests": 2, "per": "1h" }] },
            { "name": "org", "match": { "path_prefix": "/org" },
              "key": [format!("metadata:{JWT}/payload/org")], "limits": [{ "requests": 1, "per": "1h" }] }
        ]
    }));
    let h = harness(2, &config);
    let routed = |name: &str, plan: &str| on_plan(plan).property(&["xds", "route_name"], name);
    let statuses = |reqs: Vec<Request>| statuses(&h, reqs);
    assert_eq!(
        statuses(vec![
            routed("a", "premium"),
            routed("a", "premium"),
            routed("a", "premium")
        ]),
        vec![200, 200, 429]
    );
    // Another route with the same plan: its own bucket; another plan: no rule.
    assert_eq!(
        statuses(vec![
            routed("b", "premium"),
            routed("c", "basic"),
            routed("c", "basic")
        ]),
        vec![200, 200, 200]
    );
    let org = |o: &str| {
        Request::get("/org").property(&["metadata", "filter_metadata", JWT, "payload", "org"], o)
    };
    assert_eq!(
        statuses(vec![
            org("acme"),
            org("acme"),
            org("globex"),
            Request::get("/org"),
            Request::get("/org")
        ]),
        vec![200, 429, 200, 200, 200]
    );
}

/// The statuses of `reqs`, sent in turn to the workers.
fn statuses(h: &Harness, reqs: Vec<Request>) -> Vec<u32> {
    reqs.into_iter()
        .enumerate()
        .map(|(i, r)| u32::from(h.send_rr(i, r).status))
        .collect()
}

/// The request on a route whose `filter_metadata.ratelimit.plan` is `plan`.
fn on_plan(plan: &str) -> Request {
    Request::get("/").property(
        &[
            "xds",
            "route_metadata",
            "filter_metadata",
            "ratelimit",
            "plan",
        ],
        plan,
    )
}

/// `limits_by` in the compiled filter: each route's metadata picks its set
/// (each a bucket of its own), a route without it or naming no set gets
/// the rule's own limits and is counted; `RateLimit-Policy` shows the set
/// the request met.
#[test]
fn limits_by_gives_each_route_the_set_its_metadata_names() {
    let config = cfg(json!({
        "rules": [
            { "name": "plan", "limits": [{ "requests": 1, "per": "1h" }],
              "limits_by": { "route_metadata": "ratelimit/plan", "sets": {
                  "premium": [{ "requests": 3, "per": "1h" }],
                  "basic": [{ "requests": 2, "per": "1h" }] } } }
        ]
    }));
    let h = harness(2, &config);
    let statuses = |reqs: Vec<Request>| statuses(&h, reqs);
    assert_eq!(
        statuses((0..4).map(|_| on_plan("premium")).collect()),
        vec![200, 200, 200, 429]
    );
    assert_eq!(
        statuses((0..3).map(|_| on_plan("basic")).collect()),
        vec![200, 200, 429]
    );
    let o = h.send_rr(0, on_plan("basic"));
    assert_eq!(
        o.header_values("ratelimit-policy"),
        vec!["\"plan\";q=2;w=3600"],
        "{o:?}"
    );
    assert_eq!(h.metric("ratelimit_wasm_limits_by_default"), 0);
    // No metadata, an unknown name, another case: the rule's own 1, one bucket.
    assert_eq!(
        statuses(vec![Request::get("/"), on_plan("gold"), on_plan("Premium"),]),
        vec![200, 429, 429]
    );
    assert_eq!(h.metric("ratelimit_wasm_limits_by_default"), 3);
}

/// A global `limits_by` rule names its set to the gateway as `set:<name>`,
/// and the rule's own limits as `default`; a name from a JWT claim is read
/// from the request's dynamic metadata.
#[test]
fn a_global_limits_by_rule_names_its_set_to_the_gateway() {
    let config = cfg(json!({
        "global": { "coalesce_us": 0, "cluster": CLUSTER, "timeout_ms": 50, "failure_mode": "open" },
        "rules": [
            { "name": "api", "scope": "global", "key": ["client"],
              "limits": [{ "requests": 4, "per": "1m" }],
              "limits_by": { "metadata": format!("{JWT}/payload/plan"), "sets": {
                  "gold": [{ "requests": 40, "per": "1m" }] } } }
        ]
    }));
    let h = gateway_harness(1, &config);
    let variant = |plan: Option<&str>| {
        let mut r = client("alice");
        if let Some(p) = plan {
            r = r.property(&["metadata", "filter_metadata", JWT, "payload", "plan"], p);
        }
        let (_, call) = paused_for_callout(&h, 0, r);
        let body: Value = serde_json::from_slice(&call.body).unwrap();
        h.respond_http_call(call.worker, call.token, CallResponse::new(500));
        body["buckets"][0]["variant"].clone()
    };
    assert_eq!(variant(Some("gold")), json!("set:gold"));
    assert_eq!(variant(Some("silver")), json!("default"));
    assert_eq!(variant(None), json!("default"));
}
