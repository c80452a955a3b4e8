//! A token holder does not pick the limit set: `/v1/check` and `/v1/lease`
//! against the real binary and a real Redis, as an attacker holding a valid
//! token would try them.
//!
//! * a drained client cannot name `client:<id>` of another client (a fresh
//!   bucket with that client's limits): 400, nothing written;
//! * a lease naming another client's override is refused the same way;
//! * a quota's amount cannot be raised by naming another client's override;
//! * the request's `tag` is not used: the gateway derives it from the key,
//!   so a drained client's key stays in its own bucket;
//! * every refused variant gets the same words, naming nothing that
//!   exists, and counts as a bad request;
//! * a client override on the client's own key still applies, and a tier
//!   claim is taken as the caller states it (`docs/security.md`);
//! * a `limits_by` set (`set:<name>`) is one the rule declares: another
//!   name, another rule's set or a set on a quota is refused the same way.

use serde_json::{json, Value};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// alice and everyone else: 3 a minute; tier gold: 1000; client vip's
/// override: 100,000. The monthly quota: 100; vip's: 1,000,000.
const POLICY: &str = r#"{"domain": "api",
  "global": {"cluster": "gw", "lease": {"fraction": 0.5, "ttl_ms": 60000}},
  "tiers": {"free": {}, "gold": {}},
  "identity": {"default_tier": "free", "clients": {
    "vip": {"limits": {"per-client": [{"requests": 100000, "per": "1m"}]}, "quotas": {"monthly": 1000000}}}},
  "rules": [{"name": "per-client", "scope": "global", "key": ["client"],
             "limits": [{"requests": 3, "per": "1m"}],
             "tiers": {"gold": [{"requests": 1000, "per": "1m"}]}}],
  "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 100,
              "upgrade_url": "https://example.com/upgrade"}]}"#;

fn start(redis: &Redis) -> Gateway {
    ok(
        Gateway::start(GatewayOptions::new(redis.url()).policy(POLICY)),
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

/// The limit keys of domain `api` (not its ledger of live keys), sorted.
fn keys(redis: &Redis) -> String {
    let mut k: Vec<String> = ok(redis.cli(&["--raw", "KEYS", "rl:{api|c=*"]), "KEYS")
        .lines()
        .map(str::to_string)
        .collect();
    k.sort();
    k.join("\n")
}

fn check(client: &str, tag: &str, variant: &str) -> Value {
    json!({"version": 2, "domain": "api", "buckets": [{"rule": "per-client",
        "key": format!("per-client/c={client}"), "tag": tag, "variant": variant, "cost": 1}]})
}

fn quota_check(client: &str, variant: &str) -> Value {
    json!({"version": 2, "domain": "api", "quotas": [{"quota": "monthly",
        "key": format!("monthly/c={client}"), "tag": format!("c={client}"), "variant": variant, "amount": 1}]})
}

fn lease(client: &str, variant: &str, want: u64) -> Value {
    json!({"version": 2, "domain": "api", "rule": "per-client", "key": format!("per-client/c={client}"),
           "tag": format!("c={client}"), "variant": variant, "want": want, "return": 0})
}

/// alice spends her 3 and is denied the 4th.
fn drain_alice(gw: &Gateway) {
    for i in 0..3 {
        let (s, c) = post(gw, "/v1/check", &check("alice", "c=alice", "default"));
        assert_eq!(
            (s, c["allowed"].as_bool()),
            (200, Some(true)),
            "check {i}: {c}"
        );
    }
    let (s, c) = post(gw, "/v1/check", &check("alice", "c=alice", "default"));
    assert_eq!((s, c["allowed"].as_bool()), (200, Some(false)), "{c}");
}

/// `body` is refused 400 with `error`, and Redis is unchanged.
fn refused(gw: &Gateway, redis: &Redis, path: &str, body: &Value, error: &str) {
    let before = dump(redis);
    let (status, answer) = post(gw, path, body);
    assert_eq!(
        (status, answer["error"].as_str()),
        (400, Some(error)),
        "{answer}"
    );
    assert_eq!(dump(redis), before, "a refused request wrote to Redis");
}

#[test]
fn a_drained_client_cannot_take_another_clients_override() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    drain_alice(&gw);
    // The old gateway: 200, allowed, 99,999 left of vip's 100,000 in a fresh
    // bucket `...|per-client/c=alice|0|token_bucket|100000|60000`.
    refused(
        &gw,
        &redis,
        "/v1/check",
        &check("alice", "c=alice", "client:vip"),
        "buckets[0].variant: not a variant this key may use",
    );
    assert_eq!(
        keys(&redis),
        "rl:{api|c=alice}|per-client/c=alice|0|token_bucket|3|60000"
    );
    // vip on its own key: its override.
    let (s, c) = post(&gw, "/v1/check", &check("vip", "c=vip", "client:vip"));
    assert_eq!((s, c["allowed"].as_bool()), (200, Some(true)), "{c}");
    assert_eq!(c["buckets"][0]["limits"][0]["requests"], 100_000, "{c}");
    assert_eq!(c["buckets"][0]["limits"][0]["remaining"], 99_999, "{c}");
    // A tier is the caller's claim, not checkable here (docs/security.md):
    // gold's 1000 in gold's bucket.
    let (s, c) = post(&gw, "/v1/check", &check("alice", "c=alice", "tier:gold"));
    assert_eq!((s, c["allowed"].as_bool()), (200, Some(true)), "{c}");
    assert_eq!(c["buckets"][0]["limits"][0]["requests"], 1000, "{c}");
}

#[test]
fn the_tag_is_derived_from_the_key_so_a_drained_client_stays_drained() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    drain_alice(&gw);
    // The old gateway: allowed, 2 left, in a fresh `rl:{api|fresh}|...` key.
    for tag in ["fresh", "c=alice2", ""] {
        let (s, c) = post(&gw, "/v1/check", &check("alice", tag, "default"));
        assert_eq!(
            (s, c["allowed"].as_bool()),
            (200, Some(false)),
            "{tag}: {c}"
        );
    }
    assert_eq!(
        keys(&redis),
        "rl:{api|c=alice}|per-client/c=alice|0|token_bucket|3|60000"
    );
}

#[test]
fn a_lease_cannot_name_another_clients_override() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    // The old gateway granted 50,000 (half of vip's 100,000) on alice's key.
    refused(
        &gw,
        &redis,
        "/v1/lease",
        &lease("alice", "client:vip", 1_000_000),
        "variant: not a variant this key may use",
    );
    assert_eq!(keys(&redis), "");
    // alice's own lease: half of her 3, one token.
    let (s, a) = post(&gw, "/v1/lease", &lease("alice", "default", 1_000_000));
    assert_eq!((s, a["granted"].as_u64()), (200, Some(1)), "{a}");
    // A tag sent with it is not used either.
    let mut tagged = lease("alice", "default", 1);
    tagged["tag"] = json!("elsewhere");
    let (s, a) = post(&gw, "/v1/lease", &tagged);
    assert_eq!((s, a["granted"].as_u64()), (200, Some(1)), "{a}");
    let k = keys(&redis);
    assert!(k.lines().all(|l| l.starts_with("rl:{api|c=alice}|")), "{k}");
}

#[test]
fn a_quotas_amount_cannot_be_raised_by_naming_another_client() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let (s, c) = post(&gw, "/v1/check", &quota_check("alice", "default"));
    assert_eq!(
        (s, c["quotas"][0]["limit"].as_u64()),
        (200, Some(100)),
        "{c}"
    );
    assert_eq!(c["quotas"][0]["remaining"], 99, "{c}");
    // The old gateway: 200, limit 1,000,000 on alice's own counter.
    refused(
        &gw,
        &redis,
        "/v1/check",
        &quota_check("alice", "client:vip"),
        "quotas[0].variant: not a variant this key may use",
    );
    let (s, c) = post(&gw, "/v1/check", &quota_check("vip", "client:vip"));
    assert_eq!(
        (s, c["quotas"][0]["limit"].as_u64()),
        (200, Some(1_000_000)),
        "{c}"
    );
}

#[test]
fn every_refused_variant_gets_the_same_words_and_is_counted() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = start(&redis);
    let metric = |g: &Gateway| {
        ok(
            g.metric("ratelimit_gateway_errors_total{kind=\"bad_request\"}"),
            "reading /metrics",
        )
        .unwrap_or(0.0)
    };
    let before = metric(&gw);
    // The old gateway named what exists: "client `bob` has no override of
    // rule `per-client`", "rule `per-client` has no limits for tier `silver`".
    let words = "buckets[0].variant: not a variant this key may use";
    for (client, variant) in [
        ("bob", "client:bob"),
        ("bob", "client:vip"),
        ("vip", "client:bob"),
        ("bob", "tier:silver"),
        ("bob", "tier:free"),
    ] {
        refused(&gw, &redis, "/v1/check", &check(client, "", variant), words);
    }
    // A hashed key shows no client part: an override cannot be checked on it.
    let mut hashed = check("vip", "", "client:vip");
    hashed["buckets"][0]["key"] = json!(format!("per-client#{}", "0".repeat(32)));
    refused(&gw, &redis, "/v1/check", &hashed, words);
    // A key with a part more than the rule has is not vip's.
    let mut longer = check("vip", "", "client:vip");
    longer["buckets"][0]["key"] = json!("per-client/c=vip/x=1");
    refused(&gw, &redis, "/v1/check", &longer, words);
    assert_eq!(metric(&gw) - before, 7.0);
}

#[test]
fn an_override_of_a_rule_not_keyed_on_client_is_refused_at_load() {
    let policy = POLICY.replace(
        r#""key": ["client"],
             "limits""#,
        r#""key": ["ip"],
             "limits""#,
    );
    assert_ne!(policy, POLICY);
    let e = ratelimit_gateway::policy::parse(&[ratelimit_gateway::reload::Source {
        path: "api.json".into(),
        bytes: policy.into_bytes(),
    }])
    .unwrap_err();
    assert_eq!(
        e,
        "api.json: identity.clients.vip.limits.per-client: global rule `per-client` has no \
         `client` in its key, so the gateway cannot check whose key a `client:<id>` variant \
         names; key it on `client`, or use a tier"
    );
}

/// `per-plan`: 3 a minute of its own, `premium` 100 an hour and `basic` 10
/// a minute by `limits_by` (each refills one token in seconds, so no key
/// expires while the test compares Redis); `per-client` has no sets.
const BY_POLICY: &str = r#"{"domain": "api",
  "global": {"cluster": "gw"},
  "rules": [{"name": "per-plan", "scope": "global", "key": ["client"],
             "limits": [{"requests": 3, "per": "1m"}],
             "limits_by": {"route_metadata": "ratelimit/plan", "sets": {
               "premium": [{"requests": 100, "per": "1h"}], "basic": [{"requests": 10, "per": "1m"}]}}},
            {"name": "per-client", "scope": "global", "key": ["client"],
             "limits": [{"requests": 3, "per": "1m"}]}],
  "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 100,
              "upgrade_url": "https://example.com/upgrade"}]}"#;

fn plan_check(rule: &str, variant: &str) -> Value {
    json!({"version": 2, "domain": "api", "buckets": [{"rule": rule,
        "key": format!("{rule}/c=alice"), "tag": "c=alice", "variant": variant, "cost": 1}]})
}

#[test]
fn a_limits_by_set_is_the_rules_and_an_unknown_one_is_refused() {
    let redis = ok(Redis::start(), "starting redis-server");
    let gw = ok(
        Gateway::start(GatewayOptions::new(redis.url()).policy(BY_POLICY)),
        "starting the gateway",
    );
    for (variant, requests) in [("set:premium", 100), ("set:basic", 10), ("default", 3)] {
        let (s, c) = post(&gw, "/v1/check", &plan_check("per-plan", variant));
        assert_eq!((s, c["allowed"].as_bool()), (200, Some(true)), "{c}");
        assert_eq!(
            c["buckets"][0]["limits"][0]["requests"], requests,
            "{variant}: {c}"
        );
    }
    assert_eq!(
        keys(&redis),
        "rl:{api|c=alice}|per-plan/c=alice|0|token_bucket|100|3600000\n\
         rl:{api|c=alice}|per-plan/c=alice|0|token_bucket|10|60000\n\
         rl:{api|c=alice}|per-plan/c=alice|0|token_bucket|3|60000"
    );
    let words = "buckets[0].variant: not a variant this key may use";
    // A set the rule lacks, a set's name in another case, a set of another
    // rule, and a quota (which has none): 400, nothing written.
    for (rule, variant) in [
        ("per-plan", "set:gold"),
        ("per-plan", "set:Premium"),
        ("per-client", "set:premium"),
    ] {
        refused(&gw, &redis, "/v1/check", &plan_check(rule, variant), words);
    }
    refused(
        &gw,
        &redis,
        "/v1/check",
        &quota_check("alice", "set:premium"),
        "quotas[0].variant: not a variant this key may use",
    );
    refused(
        &gw,
        &redis,
        "/v1/check",
        &plan_check("per-plan", "set:"),
        "buckets[0].variant: `set:` names no tier, client or set",
    );
}
