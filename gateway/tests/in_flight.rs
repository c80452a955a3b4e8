//! Global concurrency limits (`{"concurrent": N}` on a global rule) against
//! the real binary and a real Redis, tried as a proxy holding a valid token
//! would try to cheat them:
//!
//! * a check takes a slot under its reservation; the N+1th is denied
//!   (retry 1 s) and writes nothing; a settlement of cost 0 releases the
//!   slot, once;
//! * a retried check with the same reservation holds one slot, not two;
//! * a slot past `max_in_flight` is dropped by the next check;
//! * a check whose other limit denies takes no slot;
//! * a check without a reservation, a settlement that would keep the slot
//!   (cost 1), a lease, and another domain's token are refused.

mod common;

use common::{write, TempDir};
use serde_json::{json, Value};
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Gateway, GatewayOptions, Request};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// `streams`: 3 in flight per client, a slot held at most 1 s; `plain`: 2 a
/// day per client.
const POLICY: &str = r#"{"domain": "calls",
  "global": {"cluster": "gw", "lease": {"fraction": 0.1}},
  "rules": [
    {"name": "streams", "scope": "global", "key": ["client"], "limits": [{"concurrent": 3, "max_in_flight": "1s"}]},
    {"name": "plain", "scope": "global", "key": ["client"], "limits": [{"requests": 2, "per": "1d"}]}]}"#;

const OTHER: &str = r#"{"domain": "other", "global": {"cluster": "gw"},
  "rules": [{"name": "r", "scope": "global", "key": ["client"], "limits": [{"requests": 5, "per": "1m"}]}]}"#;

const TOKENS: &str = "calls calls-token\nother other-token\n";

fn bucket(rule: &str, cost: u64) -> Value {
    json!({"rule": rule, "key": format!("{rule}/c=alice"), "tag": "c=alice", "variant": "default", "cost": cost})
}

/// A check of a slot of `streams` (and 1 of `plain` with `plain`).
fn check(reservation: Option<&str>, plain: bool) -> Value {
    let mut buckets = vec![bucket("streams", 1)];
    if plain {
        buckets.push(bucket("plain", 1));
    }
    let mut body = json!({"version": 2, "domain": "calls", "buckets": buckets});
    if let Some(id) = reservation {
        body["reservation"] = id.into();
    }
    body
}

fn release(id: &str) -> Value {
    json!({"version": 2, "domain": "calls",
        "settlements": [{"reservation": id, "buckets": [bucket("streams", 0)]}]})
}

/// A reservation id of the form the filter sends.
fn id(n: u64) -> String {
    format!("{n:016x}")
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

/// The slot answer of a check: (allowed, remaining, reset_ms, retry_after_ms).
fn slot(gw: &Gateway, reservation: &str) -> (bool, u64, u64, u64) {
    let (status, a) = post(
        gw,
        "/v1/check",
        &check(Some(reservation), false),
        "calls-token",
    );
    assert_eq!(status, 200, "{a}");
    let l = &a["buckets"][0]["limits"][0];
    assert_eq!(l["in_flight"], true, "{a}");
    assert_eq!(
        (l["requests"].as_u64(), l["window_ms"].as_u64()),
        (Some(3), Some(1000))
    );
    (
        l["allowed"].as_bool().unwrap(),
        l["remaining"].as_u64().unwrap(),
        l["reset_ms"].as_u64().unwrap(),
        l["retry_after_ms"].as_u64().unwrap(),
    )
}

/// The members of the slot set of alice's `streams`.
fn members(redis: &Redis) -> Vec<String> {
    let keys = ok(redis.cli(&["--raw", "KEYS", "*streams*"]), "KEYS");
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert_eq!(keys.len(), 1, "one slot set: {keys:?}");
    let set = keys[0];
    assert!(set.contains("|concurrent|3|1000"), "{set}");
    let mut m: Vec<String> = ok(redis.cli(&["--raw", "ZRANGE", set, "0", "-1"]), "ZRANGE")
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| l.rsplit('|').next().unwrap_or(l).to_string())
        .collect();
    m.sort();
    m
}

#[test]
fn three_slots_the_fourth_waits_a_second_and_a_release_frees_one_once() {
    let s = start();
    assert_eq!(slot(&s.gw, &id(1)), (true, 2, 0, 0));
    assert_eq!(slot(&s.gw, &id(2)), (true, 1, 0, 0));
    assert_eq!(slot(&s.gw, &id(3)), (true, 0, 0, 0));
    assert_eq!(slot(&s.gw, &id(4)), (false, 0, 1000, 1000));
    assert_eq!(members(&s.redis), [id(1), id(2), id(3)]);

    let (status, a) = post(&s.gw, "/v1/settle", &release(&id(2)), "calls-token");
    assert_eq!((status, &a["settled"]), (200, &json!([true])), "{a}");
    assert_eq!(members(&s.redis), [id(1), id(3)]);
    // Replayed: the record is gone, nothing more is released.
    let (status, a) = post(&s.gw, "/v1/settle", &release(&id(2)), "calls-token");
    assert_eq!((status, &a["settled"]), (200, &json!([false])), "{a}");
    assert_eq!(slot(&s.gw, &id(5)), (true, 0, 0, 0));
    assert_eq!(slot(&s.gw, &id(6)), (false, 0, 1000, 1000));
    assert_eq!(members(&s.redis), [id(1), id(3), id(5)]);
    // A settlement of a denied check finds no record and releases nothing.
    let (status, a) = post(&s.gw, "/v1/settle", &release(&id(6)), "calls-token");
    assert_eq!((status, &a["settled"]), (200, &json!([false])), "{a}");
    assert_eq!(members(&s.redis), [id(1), id(3), id(5)]);
}

#[test]
fn a_retried_check_holds_one_slot_and_a_slot_past_its_deadline_is_dropped() {
    let s = start();
    assert_eq!(slot(&s.gw, &id(1)), (true, 2, 0, 0));
    assert_eq!(slot(&s.gw, &id(1)), (true, 2, 0, 0));
    assert_eq!(slot(&s.gw, &id(2)), (true, 1, 0, 0));
    assert_eq!(members(&s.redis), [id(1), id(2)]);
    // max_in_flight is 1 s: past it both slots are dropped by the next check.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    assert_eq!(slot(&s.gw, &id(3)), (true, 2, 0, 0));
    assert_eq!(members(&s.redis), [id(3)]);
}

#[test]
fn a_check_that_another_limit_denies_takes_no_slot() {
    let s = start();
    for n in 1..=2 {
        let (status, a) = post(
            &s.gw,
            "/v1/check",
            &check(Some(&id(n)), true),
            "calls-token",
        );
        assert_eq!((status, &a["allowed"]), (200, &json!(true)), "{a}");
    }
    let (status, a) = post(
        &s.gw,
        "/v1/check",
        &check(Some(&id(3)), true),
        "calls-token",
    );
    assert_eq!((status, &a["allowed"]), (200, &json!(false)), "{a}");
    assert_eq!(a["buckets"][0]["limits"][0]["allowed"], true, "{a}");
    assert_eq!(a["buckets"][1]["limits"][0]["allowed"], false, "{a}");
    assert_eq!(members(&s.redis), [id(1), id(2)]);
}

#[test]
fn what_would_keep_or_forge_a_slot_is_refused_and_writes_nothing() {
    let s = start();
    let refused = [
        (
            "/v1/check",
            check(None, false),
            "calls-token",
            400,
            "buckets[0].rule: rule `streams` is a concurrency rule: its check needs a reservation, \
             under which the slot is released",
        ),
        (
            "/v1/settle",
            json!({"version": 2, "domain": "calls",
                "settlements": [{"reservation": id(1), "buckets": [bucket("streams", 1)]}]}),
            "calls-token",
            400,
            "settlements[0].buckets[0].cost: 1 is above 0, the most rule `streams` settles",
        ),
        (
            "/v1/lease",
            json!({"version": 2, "domain": "calls", "rule": "streams", "key": "streams/c=alice",
                "tag": "c=alice", "variant": "default", "want": 1}),
            "calls-token",
            400,
            "rule: rule `streams` is a concurrency rule; leases need token_bucket",
        ),
        ("/v1/check", check(Some(&id(1)), false), "other-token", 403, ""),
        ("/v1/settle", release(&id(1)), "other-token", 403, ""),
    ];
    for (path, body, token, status, error) in refused {
        let (got, a) = post(&s.gw, path, &body, token);
        assert_eq!(got, status, "{path} {body}: {a}");
        let got = a["error"].as_str().unwrap_or_default();
        assert!(
            got.starts_with(error),
            "{path}: {got:?} should start with {error:?}"
        );
    }
    let keys = ok(s.redis.cli(&["--raw", "KEYS", "*"]), "KEYS");
    assert!(
        keys.lines()
            .all(|k| k.is_empty() || k.starts_with("rl:health:")),
        "{keys}"
    );
}
