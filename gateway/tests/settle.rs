//! `POST /v1/settle` against the real binary and a real Redis, tried as a
//! proxy holding a valid token would try to cheat it:
//!
//! * a settlement moves a reserved charge to the real cost, in the bucket
//!   and in a quota that counts cost, exactly;
//! * replayed, or for an id never reserved, it changes nothing;
//! * a response past the bucket leaves debt, and the next check waits for it;
//! * a rule that does not settle, a cost above `max`, a batch with one bad
//!   settlement, and another domain's token are refused, writing nothing;
//! * a check denied (or refunded) leaves no record to settle.

mod common;

use common::{write, TempDir};
use serde_json::{json, Value};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// `tokens`: 1,000 a day per client (a token every 86.4 s: none comes back
/// while a test runs), charged from the response (at most
/// 2,000, 100 reserved); `plain`: 10 a minute, cost 1, never settled; the
/// monthly quota counts the cost (10,000 a month).
const POLICY: &str = r#"{"domain": "llm",
  "global": {"cluster": "gw"},
  "rules": [
    {"name": "tokens", "scope": "global", "key": ["client"], "limits": [{"requests": 1000, "per": "1d"}]},
    {"name": "plain", "scope": "global", "key": ["client"], "cost": 1, "limits": [{"requests": 10, "per": "1m"}]}],
  "costs": [{"match": {"path_prefix": "/v1"}, "cost_from": {"header": "x-usage", "max": 2000, "reserve": 100}}],
  "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 10000, "count": "cost",
              "upgrade_url": "https://example.com/upgrade"}]}"#;

const OTHER: &str = r#"{"domain": "other", "global": {"cluster": "gw"},
  "rules": [{"name": "r", "scope": "global", "key": ["client"], "limits": [{"requests": 5, "per": "1m"}]}]}"#;

const TOKENS: &str = "llm llm-token\nother other-token\n";

const ID: &str = "0123456789abcdef0123456789abcdef";

fn bucket(rule: &str, cost: u64) -> Value {
    json!({"rule": rule, "key": format!("{rule}/c=alice"), "tag": "c=alice", "variant": "default", "cost": cost})
}

fn quota(amount: u64) -> Value {
    json!({"quota": "monthly", "key": "monthly/c=alice", "tag": "c=alice", "variant": "default", "amount": amount})
}

fn check(reservation: Option<&str>, tokens: u64) -> Value {
    let mut body = json!({"version": 2, "domain": "llm",
        "buckets": [bucket("tokens", tokens), bucket("plain", 1)], "quotas": [quota(tokens)]});
    if let Some(id) = reservation {
        body["reservation"] = id.into();
    }
    body
}

fn settlement(id: &str, cost: u64) -> Value {
    json!({"reservation": id, "buckets": [bucket("tokens", cost)], "quotas": [quota(cost)]})
}

fn settle(settlements: &[Value]) -> Value {
    json!({"version": 2, "domain": "llm", "settlements": settlements})
}

struct Setup {
    redis: Redis,
    gw: Gateway,
    _dir: TempDir,
}

fn start() -> Setup {
    let redis = ok(Redis::start(), "starting redis-server");
    let dir = TempDir::new();
    let tokens = write(dir.path(), "tokens", TOKENS);
    let gw = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(POLICY)
                .policy(OTHER)
                .args(&["--auth-tokens", &tokens]),
        ),
        "starting the gateway",
    );
    Setup {
        redis,
        gw,
        _dir: dir,
    }
}

fn post(gw: &Gateway, path: &str, body: &Value, token: &str) -> (u16, Value) {
    let client = Client::new(gw.url(""), ConnectionMode::NewPerRequest);
    let bearer = format!("Bearer {token}");
    let req = Request::post(path, body.to_string())
        .header("content-type", "application/json")
        .header("authorization", &bearer);
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

/// The tokens left and the quota left, read by a check that charges 1
/// (`tokens` 1 and `monthly` 1 more).
fn left(gw: &Gateway) -> (u64, u64, Value) {
    let (status, a) = post(gw, "/v1/check", &check(None, 1), "llm-token");
    assert_eq!(status, 200, "{a}");
    let tokens = a["buckets"][0]["limits"][0]["remaining"].as_u64().unwrap();
    let month = a["quotas"][0]["remaining"].as_u64().unwrap();
    (tokens, month, a)
}

#[test]
fn a_settlement_moves_the_reservation_to_the_real_cost_once() {
    let s = start();
    let (status, a) = post(&s.gw, "/v1/check", &check(Some(ID), 100), "llm-token");
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    assert_eq!(a["buckets"][0]["limits"][0]["remaining"], 900);

    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 350)]),
        "llm-token",
    );
    assert_eq!(
        (status, a.clone()),
        (200, json!({"version": 2, "settled": [true]}))
    );
    // 1,000 - 350 - 1 (the reading check itself) tokens; 10,000 - 350 - 1 of the month.
    let (tokens, month, _) = left(&s.gw);
    assert_eq!((tokens, month), (649, 9649));

    // Replayed: nothing found, nothing changed.
    let before = dump(&s.redis);
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 0)]),
        "llm-token",
    );
    assert_eq!(
        (status, a),
        (200, json!({"version": 2, "settled": [false]}))
    );
    let other_id = "ffffffffffffffffffffffffffffffff";
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(other_id, 0)]),
        "llm-token",
    );
    assert_eq!(
        (status, a),
        (200, json!({"version": 2, "settled": [false]}))
    );
    assert_eq!(dump(&s.redis), before);
    let (tokens, month, _) = left(&s.gw);
    assert_eq!((tokens, month), (648, 9648));
    assert_eq!(
        ok(
            s.gw.metric("ratelimit_gateway_checks_total{result=\"settled\"}"),
            "metrics"
        ),
        Some(1.0)
    );
    assert_eq!(
        ok(
            s.gw.metric("ratelimit_gateway_checks_total{result=\"unsettled\"}"),
            "metrics"
        ),
        Some(2.0)
    );
}

#[test]
fn a_response_past_the_bucket_leaves_debt_that_the_next_check_waits_for() {
    let s = start();
    let (status, a) = post(&s.gw, "/v1/check", &check(Some(ID), 100), "llm-token");
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 2000)]),
        "llm-token",
    );
    assert_eq!((status, a["settled"].clone()), (200, json!([true])));
    // 2,000 spent of 1,000: a request of 100 waits until 1,100 tokens came
    // back, 95,040 s at 1,000 a day (less the ms the calls took); the bucket
    // is full again after 2,000 tokens' time, 172,800 s.
    let (status, a) = post(&s.gw, "/v1/check", &check(None, 100), "llm-token");
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(false)), "{a}");
    let limit = &a["buckets"][0]["limits"][0];
    assert_eq!(limit["remaining"], 0, "{a}");
    let retry = limit["retry_after_ms"].as_u64().unwrap();
    assert!((95_030_000..=95_040_000).contains(&retry), "{a}");
    let reset = limit["reset_ms"].as_u64().unwrap();
    assert!((172_790_000..=172_800_000).contains(&reset), "{a}");
}

#[test]
fn settlements_a_proxy_may_not_make_are_refused_whole_and_write_nothing() {
    let s = start();
    let (status, _) = post(&s.gw, "/v1/check", &check(Some(ID), 100), "llm-token");
    assert_eq!(status, 200);
    let before = dump(&s.redis);
    let plain = json!({"reservation": ID, "buckets": [bucket("plain", 0)]});
    let cases = [
        (
            settle(&[plain]),
            "settlements[0].buckets[0].rule: rule `plain` is not charged from the response: nothing to settle",
        ),
        (
            settle(&[settlement(ID, 2001)]),
            "settlements[0].buckets[0].cost: 2001 is above 2000, the most rule `tokens` settles",
        ),
        (
            // The first settlement is fine; the second is not: neither is made.
            settle(&[settlement(ID, 0), json!({"reservation": ID, "quotas": [quota(2001)]})]),
            "settlements[1].quotas[0].amount: 2001 is above 2000, the most quota `monthly` settles",
        ),
        (
            json!({"version": 2, "domain": "llm", "settlements": [
                {"reservation": ID, "buckets": [{"rule": "tokens", "key": "tokens/c=alice", "tag": "c=alice",
                 "variant": "default", "cost": 0, "limits": [{"requests": 1000000}]}]}]}),
            "settlements[0].buckets[0].limits: unknown field `limits`",
        ),
        (
            json!({"version": 2, "domain": "llm", "settlements": [
                {"reservation": ID, "buckets": [{"rule": "tokens", "key": "plain/c=alice", "tag": "c=alice",
                 "variant": "default", "cost": 0}]}]}),
            "settlements[0].buckets[0].key: must start with `tokens/`",
        ),
    ];
    for (body, want) in cases {
        let (status, a) = post(&s.gw, "/v1/settle", &body, "llm-token");
        assert_eq!(status, 400, "{a}");
        let error = a["error"].as_str().unwrap_or_default();
        assert!(
            error.starts_with(want),
            "{error:?} should start with {want:?}"
        );
    }
    // Another domain's token: 403, before anything is read.
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 0)]),
        "other-token",
    );
    assert_eq!(status, 403, "{a}");
    let (status, _) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 0)]),
        "no-such-token",
    );
    assert_eq!(status, 401);
    assert_eq!(dump(&s.redis), before);
    // The reservation is still there for the proxy that made it.
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 0)]),
        "llm-token",
    );
    assert_eq!((status, a["settled"].clone()), (200, json!([true])));
    let (tokens, month, _) = left(&s.gw);
    assert_eq!((tokens, month), (999, 9999));
}

#[test]
fn a_denied_check_leaves_no_reservation_to_settle() {
    let s = start();
    // `plain` allows 10 a minute: spend them, then a reserving check is denied.
    for _ in 0..10 {
        let (status, a) = post(&s.gw, "/v1/check", &check(None, 1), "llm-token");
        assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    }
    let (status, a) = post(&s.gw, "/v1/check", &check(Some(ID), 100), "llm-token");
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(false)), "{a}");
    let (status, a) = post(
        &s.gw,
        "/v1/settle",
        &settle(&[settlement(ID, 0)]),
        "llm-token",
    );
    assert_eq!((status, a["settled"].clone()), (200, json!([false])));
    assert!(
        !dump(&s.redis).contains("|r|"),
        "no reservation record:\n{}",
        dump(&s.redis)
    );
}
