//! The gateway enforces its own policy, not what a request says, on the real
//! binary in front of a real Redis, as an attacker inside the mesh would try
//! it:
//!
//! * drain: a lease of 20 on alice's bucket gets the policy's `lease.fraction`
//!   of it, and her next check passes;
//! * refill: `return: 1000000` gives back at most what the caller holds (its
//!   ledger), so it writes nothing for a caller holding nothing;
//! * quota burn, huge windows: a request cannot name a quota amount or a
//!   window (400), nor a cost or amount above what the policy can give;
//! * huge requests: more buckets than the domain has global rules is a 400;
//! * a version-1 body is told its version;
//! * a domain the policy does not have is a 404 on every route;
//!
//! each refused request with a Redis key dump identical before and after.
//! And the policy reloads: a changed limit applies to the next request, a
//! broken file keeps the old policy and is counted.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// alice's per-client bucket: 20 a minute, leases of a quarter at most; a
/// monthly quota of 10,000 requests.
fn api_policy(requests: u64) -> String {
    json!({"domain": "api",
        "global": {"cluster": "gw", "lease": {"fraction": 0.25, "ttl_ms": 60_000}},
        "rules": [{"name": "per-client", "scope": "global", "key": ["client"],
                   "limits": [{"requests": requests, "per": "1m"}]}],
        "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 10_000,
                    "upgrade_url": "https://example.com/upgrade"}]})
    .to_string()
}

fn start(redis: &Redis) -> Gateway {
    ok(
        Gateway::start(GatewayOptions::new(redis.url()).policy(api_policy(20))),
        "starting the gateway",
    )
}

fn post(gw: &Gateway, path: &str, body: &Value) -> (u16, Value) {
    let client = Client::new(gw.url(""), ConnectionMode::NewPerRequest);
    let req = Request::post(path, body.to_string()).header("content-type", "application/json");
    let r = ok(client.send(&req), "posting to the gateway");
    let v = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, v)
}

/// Every key but the health check's, with value and absolute expiry.
fn dump(redis: &Redis) -> String {
    ok(redis.dump(), "dumping Redis")
        .lines()
        .filter(|l| !l.starts_with("rl:health:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn alice_check() -> Value {
    json!({"version": 2, "domain": "api", "buckets": [{"rule": "per-client",
        "key": "per-client/c=alice", "tag": "c=alice", "variant": "default", "cost": 1}]})
}

fn lease(want: u64, give_back: u64) -> Value {
    json!({"version": 2, "domain": "api", "rule": "per-client", "key": "per-client/c=alice",
           "tag": "c=alice", "variant": "default", "want": want, "return": give_back})
}

/// Posts `body`, which must be refused 400 with `error`, and checks that Redis is unchanged.
fn refused(gw: &Gateway, redis: &Redis, path: &str, body: &Value, error: &str) {
    refused_with(gw, redis, path, body, 400, error);
}

/// [`refused`] with `status`.
fn refused_with(gw: &Gateway, redis: &Redis, path: &str, body: &Value, status: u16, error: &str) {
    let before = dump(redis);
    let (got, answer) = post(gw, path, body);
    assert_eq!(
        (got, answer["error"].as_str()),
        (status, Some(error)),
        "{answer}"
    );
    assert_eq!(dump(redis), before, "a refused request wrote to Redis");
}

#[test]
fn drain_a_lease_gets_the_policy_fraction_and_alice_still_passes() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    // The attacker asks for all 20 of alice's tokens (the old gateway granted 20).
    let (status, a) = post(&gw, "/v1/lease", &lease(20, 0));
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["granted"], 5, "a quarter of 20: {a}");
    assert_eq!(a["limits"][0]["requests"], 20);
    // alice's next check passes, with 20 - 5 - 1 left.
    let (status, c) = post(&gw, "/v1/check", &alice_check());
    assert_eq!((status, c["allowed"].as_bool()), (200, Some(true)), "{c}");
    assert_eq!(c["buckets"][0]["limits"][0]["remaining"], 14, "{c}");
    // The ledger says what this caller holds, for the lease's life twice over.
    let ledger = "rl:{api|c=alice}|per-client/c=alice|0|token_bucket|20|60000|held|anonymous";
    assert_eq!(ok(redis.cli(&["GET", ledger]), "GET"), "5");
    let pttl: u64 = ok(redis.cli(&["PTTL", ledger]), "PTTL").parse().unwrap();
    assert!((110_000..=120_000).contains(&pttl), "{pttl}");
}

#[test]
fn refill_gives_back_at_most_what_the_caller_holds() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    // alice spends her 20 herself.
    for i in 0..20 {
        let (_, c) = post(&gw, "/v1/check", &alice_check());
        assert_eq!(c["allowed"], true, "check {i}: {c}");
    }
    let (_, c) = post(&gw, "/v1/check", &alice_check());
    assert_eq!(c["allowed"], false, "{c}");
    // A caller holding nothing gives back a million (the old gateway put
    // alice back to 19): nothing is taken back, nothing granted, nothing written.
    let before = dump(&redis);
    let (status, a) = post(&gw, "/v1/lease", &lease(1, 1_000_000));
    assert_eq!((status, a["granted"].as_u64()), (200, Some(0)), "{a}");
    assert_eq!(dump(&redis), before, "the refill wrote to Redis");
    let (_, c) = post(&gw, "/v1/check", &alice_check());
    assert_eq!(c["allowed"], false, "alice was refilled: {c}");
}

#[test]
fn a_caller_gives_back_what_it_holds_and_no_more() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let (_, a) = post(&gw, "/v1/lease", &lease(5, 0));
    assert_eq!(a["granted"], 5);
    assert_eq!(a["limits"][0]["remaining"], 15);
    // It gives its 5 back (asking for 1): 19 left, and it holds 1.
    let (_, a) = post(&gw, "/v1/lease", &lease(1, 1_000_000));
    assert_eq!(
        (a["granted"].as_u64(), a["limits"][0]["remaining"].as_u64()),
        (Some(1), Some(19)),
        "{a}"
    );
    // Again: only the 1 it holds comes back.
    let (_, a) = post(&gw, "/v1/lease", &lease(1, 1_000_000));
    assert_eq!(a["limits"][0]["remaining"], 19, "{a}");
}

#[test]
fn a_quota_amount_or_limit_cannot_be_named() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let bob = |amount: u64| {
        json!({"version": 2, "domain": "api", "quotas": [{"quota": "monthly", "key": "monthly/c=bob",
               "tag": "c=bob", "variant": "default", "amount": amount}]})
    };
    // bob's quota exists: one real request.
    let (_, c) = post(&gw, "/v1/check", &bob(1));
    assert_eq!(c["quotas"][0]["remaining"], 9999, "{c}");
    let mut burn = bob(1);
    burn["quotas"][0]["limit"] = json!(1_000_000_000_000u64);
    refused(&gw, &redis, "/v1/check", &burn, "quotas[0].limit: unknown field `limit`, expected one of `quota`, `key`, `tag`, `variant`, `amount`");
    refused(
        &gw,
        &redis,
        "/v1/check",
        &bob(999_999_999_999),
        "quotas[0].amount: 999999999999 is above 1, the most quota `monthly` counts for one request",
    );
    let mut other = bob(1);
    other["quotas"][0]["variant"] = json!("tier:enterprise");
    refused(
        &gw,
        &redis,
        "/v1/check",
        &other,
        "quotas[0].variant: not a variant this key may use",
    );
    let (_, c) = post(&gw, "/v1/check", &bob(1));
    assert_eq!(c["quotas"][0]["remaining"], 9998, "bob lost his month: {c}");
    assert_eq!(c["quotas"][0]["limit"], 10_000, "{c}");
}

#[test]
fn a_window_or_a_limit_cannot_be_named_and_ttls_come_from_the_policy() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let mut huge = alice_check();
    huge["buckets"][0]["limits"] =
        json!([{"requests": 1, "window_ms": 1u64 << 53, "algorithm": "token_bucket"}]);
    refused(&gw, &redis, "/v1/check", &huge, "buckets[0].limits: unknown field `limits`, expected one of `rule`, `key`, `tag`, `variant`, `cost`");
    let mut costly = alice_check();
    costly["buckets"][0]["cost"] = json!(1_000_000);
    refused(
        &gw,
        &redis,
        "/v1/check",
        &costly,
        "buckets[0].cost: 1000000 is above 1, the largest cost the policy gives rule `per-client`",
    );
    let mut other = alice_check();
    other["buckets"][0]["rule"] = json!("admin");
    other["buckets"][0]["key"] = json!("admin/c=alice");
    refused(
        &gw,
        &redis,
        "/v1/check",
        &other,
        "buckets[0].rule: unknown rule `admin`: not a global rule of domain `api`",
    );
    // A domain the policy does not have: 404 on every route, before any
    // rule or quota it names is looked up.
    let mut elsewhere = alice_check();
    elsewhere["domain"] = json!("web");
    let mut elsewhere_lease = lease(1, 0);
    elsewhere_lease["domain"] = json!("web");
    let elsewhere_settle = json!({"version": 2, "domain": "web", "settlements": [
        {"reservation": "9f86d081884c7d65", "buckets": alice_check()["buckets"]}]});
    for (path, body) in [
        ("/v1/check", &elsewhere),
        ("/v1/lease", &elsewhere_lease),
        ("/v1/settle", &elsewhere_settle),
    ] {
        refused_with(
            &gw,
            &redis,
            path,
            body,
            404,
            "domain: unknown domain `web`: not in the gateway's policy",
        );
    }
    assert_eq!(
        ok(
            gw.metric("ratelimit_gateway_errors_total{kind=\"unknown_domain\"}"),
            "/metrics"
        ),
        Some(3.0)
    );
    // The one key a real check writes expires within the policy's minute
    // (the old gateway wrote a TTL of 2^53 ms, 285,000 years).
    let (_, c) = post(&gw, "/v1/check", &alice_check());
    assert_eq!(c["allowed"], true);
    // Beside the domain's ledger of live keys (`rl:{api|live}`).
    let keys = ok(redis.cli(&["--raw", "KEYS", "rl:{api|c=*"]), "KEYS");
    assert_eq!(
        keys,
        "rl:{api|c=alice}|per-client/c=alice|0|token_bucket|20|60000"
    );
    let pttl: u64 = ok(redis.cli(&["PTTL", &keys]), "PTTL").parse().unwrap();
    assert!((1..=3000).contains(&pttl), "one token's refill, {pttl} ms");
}

#[test]
fn more_buckets_than_the_policy_has_rules_is_refused() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    // 64 buckets (the old gateway wrote 512 keys for 64 x 8 limits).
    let bucket = |i: usize| {
        json!({"rule": "per-client", "key": format!("per-client/c={i}"), "tag": format!("c={i}"),
               "variant": "default", "cost": 1})
    };
    let huge =
        json!({"version": 2, "domain": "api", "buckets": (0..64).map(bucket).collect::<Vec<_>>()});
    refused(
        &gw,
        &redis,
        "/v1/check",
        &huge,
        "buckets: domain `api` has 1 global rules, so at most 1 buckets, got 64",
    );
    let twice = json!({"version": 2, "domain": "api", "buckets": [bucket(1), bucket(2)]});
    refused(
        &gw,
        &redis,
        "/v1/check",
        &twice,
        "buckets: domain `api` has 1 global rules, so at most 1 buckets, got 2",
    );
    let too_many =
        json!({"version": 2, "domain": "api", "buckets": (0..65).map(bucket).collect::<Vec<_>>()});
    refused(
        &gw,
        &redis,
        "/v1/check",
        &too_many,
        "buckets: must hold 1 to 64 buckets, got 65",
    );
    assert_eq!(dump(&redis), "", "nothing was ever written");
}

#[test]
fn a_version_1_request_is_told_its_version() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let v1 = json!({"version": 1, "domain": "api", "cost": 1, "buckets": [{"key": "per-client/c=alice",
        "tag": "c=alice", "limits": [{"requests": 20, "window_ms": 60_000, "algorithm": "token_bucket"}]}]});
    refused(
        &gw,
        &redis,
        "/v1/check",
        &v1,
        "version: unsupported version 1, expected 2",
    );
    let v1_lease = json!({"version": 1, "domain": "api", "key": "per-client/c=alice", "tag": "c=alice",
        "limits": [{"requests": 20, "window_ms": 60_000, "algorithm": "token_bucket"}], "want": 20});
    refused(
        &gw,
        &redis,
        "/v1/lease",
        &v1_lease,
        "version: unsupported version 1, expected 2",
    );
}

fn metric(gw: &Gateway, sample: &str) -> f64 {
    ok(gw.metric(sample), "reading /metrics").unwrap_or_else(|| panic!("no sample {sample}"))
}

/// Waits until `sample` reads `want` (the reload task polls every second).
fn wait_metric(gw: &Gateway, sample: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(gw, sample) != want {
        assert!(Instant::now() < deadline, "{sample} never reached {want}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_changed_policy_applies_to_the_next_request_and_a_broken_one_keeps_the_old() {
    let redis = ok(Redis::start(), "starting redis-server");
    let mut gw = start(&redis);
    let enforced = |gw: &Gateway| {
        let (status, c) = post(gw, "/v1/check", &alice_check());
        assert_eq!(status, 200, "{c}");
        c["buckets"][0]["limits"][0]["requests"].as_u64().unwrap()
    };
    assert_eq!(enforced(&gw), 20);
    let ok_sample = "ratelimit_gateway_reloads_total{what=\"policy\"}";
    let failed_sample = "ratelimit_gateway_reload_failures_total{what=\"policy\"}";
    assert_eq!(
        (metric(&gw, ok_sample), metric(&gw, failed_sample)),
        (0.0, 0.0)
    );

    // A changed file: picked up by the poll, no signal.
    std::fs::write(gw.policy_path(0), api_policy(30)).unwrap();
    wait_metric(&gw, ok_sample, 1.0);
    assert_eq!(enforced(&gw), 30);

    // A broken file (a limit of 0): refused, counted, logged with its field; 30 stays.
    std::fs::write(gw.policy_path(0), api_policy(0)).unwrap();
    wait_metric(&gw, failed_sample, 1.0);
    assert_eq!(enforced(&gw), 30);
    assert!(
        gw.log()
            .contains("rules[0].limits[0].requests: must be between 1 and 1000000000"),
        "{}",
        gw.log_tail(20)
    );

    // SIGHUP reads it again, whatever changed: still broken, counted again.
    let pid = gw.pid().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    wait_metric(&gw, failed_sample, 2.0);
    assert!(gw.is_running(), "SIGHUP must not stop the gateway");
    std::fs::write(gw.policy_path(0), api_policy(10)).unwrap();
    wait_metric(&gw, ok_sample, 2.0);
    assert_eq!(enforced(&gw), 10);
}
