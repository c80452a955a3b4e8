//! `POST /v1/lease` against a real `redis-server` (and a 3-master Redis
//! Cluster): exact grants, `return`, one bucket shared with `/v1/check`,
//! concurrency, the HTTP route, and a lease/check twin test.
//!
//! Tests that need exact numbers go through the gateway's limiter on a
//! `FixedClock` (the scripts then take that time instead of Redis `TIME`;
//! keys still expire, relative to it); the others use Redis time over HTTP
//! with windows long enough that nothing refills during the test.

mod common;

use std::sync::Arc;

use common::*;
use ratelimit_gateway::clock::FixedClock;
use ratelimit_gateway::redis::keys::lease_keys;
use ratelimit_gateway::{Running, Target};
use redis::cluster_routing::Slot;
use serde_json::{json, Value};

const MINUTE: u64 = 60_000;
const HOUR: u64 = 3_600_000;
/// 2026-01-01 00:00 UTC: a fixed time for the `FixedClock`.
const T0: u64 = 1_767_225_600_000;

const TEN_PER_MINUTE: &[L] = &[(10, MINUTE, "token_bucket")];

/// The caller of the leases through [`lease_at`] (its ledger's name).
const CALLER: &str = "test";

/// One lease at time `t` (ms), through the gateway's limiter on a `FixedClock`.
async fn lease_at(gw: &Running, body: &Value, t: u64) -> Value {
    sync_policy();
    let answer = gw
        .app
        .limiter
        .with_clock(Arc::new(FixedClock(t)))
        .lease(&resolve_lease(body), CALLER)
        .await
        .unwrap();
    serde_json::to_value(answer).unwrap()
}

/// One check of a [`direct_check`] at time `t` (ms), on a `FixedClock`.
async fn direct_check_at(gw: &Running, req: &ratelimit_gateway::policy::Resolved, t: u64) -> Value {
    let limiter = gw.app.limiter.with_clock(Arc::new(FixedClock(t)));
    serde_json::to_value(limiter.check(req).await.unwrap()).unwrap()
}

/// `(granted, [(remaining, reset_ms, retry_after_ms)])` of a lease answer,
/// checked for exactly these fields and the enforced `requests`, `window_ms`.
fn grant(v: &Value) -> (u64, Vec<(u64, u64, u64)>) {
    assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{v}");
    assert_eq!(v["version"], 2, "{v}");
    let limits = v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            assert_eq!(l.as_object().map(|o| o.len()), Some(5), "{v}");
            (
                l["remaining"].as_u64().unwrap(),
                l["reset_ms"].as_u64().unwrap(),
                l["retry_after_ms"].as_u64().unwrap(),
            )
        })
        .collect();
    (v["granted"].as_u64().unwrap(), limits)
}

/// The Redis key of limit `index` of a lease body's bucket.
fn key_of(body: &Value, index: usize) -> String {
    lease_keys("rl:", &resolve_lease(body)).swap_remove(index)
}

/// `GET key` through the gateway's own connection.
async fn get_key(gw: &Running, key: &str) -> Option<String> {
    gw.app
        .limiter
        .store()
        .query(redis::cmd("GET").arg(key), "get")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_grants_what_is_free_then_zero_with_retry_after() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let want4 = lease_request("d", "rule/client=abc", "client=abc", TEN_PER_MINUTE, 4, 0);
    // 10 per minute: one token per 6000 ms.
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0).await),
        (4, vec![(6, 24_000, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0).await),
        (4, vec![(2, 48_000, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0).await),
        (2, vec![(0, MINUTE, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0).await),
        (0, vec![(0, MINUTE, 6000)])
    );
    // The bucket key, exactly as a check names it, holds TAT = T0 + 60 s.
    let key = key_of(&want4, 0);
    assert_eq!(
        key,
        "rl:{d|client=abc}|rule/client=abc|0|token_bucket|10|60000"
    );
    assert_eq!(get_key(&gw, &key).await, Some(format!("{}:0", T0 + MINUTE)));
    // A granted 0 writes nothing; 1 ms before the next token it is still 0.
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0 + 5999).await),
        (0, vec![(0, MINUTE - 5999, 1)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &want4, T0 + 6000).await),
        (1, vec![(0, MINUTE, 0)])
    );

    // Several limits: want is capped at the smallest requests, the grant is the
    // smallest number of whole tokens free, charged in every limit.
    let two = lease_request(
        "d",
        "two",
        "client=abc",
        &[(10, MINUTE, "token_bucket"), (3, 1000, "token_bucket")],
        5,
        0,
    );
    assert_eq!(
        grant(&lease_at(&gw, &two, T0).await),
        (3, vec![(7, 18_000, 0), (0, 1000, 0)])
    );
    // Nothing free in the second limit: 1000/3 ms until its next token.
    assert_eq!(
        grant(&lease_at(&gw, &two, T0).await),
        (0, vec![(7, 18_000, 0), (0, 1000, 334)])
    );
    // 334 ms later one token of the second is free: exactly one is granted.
    assert_eq!(
        grant(&lease_at(&gw, &two, T0 + 334).await),
        (1, vec![(6, 23_666, 0), (0, 1000, 0)])
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn return_gives_tokens_back_before_granting() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let body = |want, give_back| lease_request("ret", "k", "c=r", TEN_PER_MINUTE, want, give_back);
    assert_eq!(
        grant(&lease_at(&gw, &body(10, 0), T0).await),
        (10, vec![(0, MINUTE, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &body(3, 0), T0).await),
        (0, vec![(0, MINUTE, 6000)])
    );
    // Drained: the 3 given back are granted again.
    assert_eq!(
        grant(&lease_at(&gw, &body(3, 3), T0).await),
        (3, vec![(0, MINUTE, 0)])
    );
    // 5 back, 3 out: 2 left, TAT = T0 + 48 s.
    assert_eq!(
        grant(&lease_at(&gw, &body(3, 5), T0).await),
        (3, vec![(2, 48_000, 0)])
    );
    // Giving back more than was taken only fills the bucket (TAT floored at
    // now); want is capped at the capacity.
    assert_eq!(
        grant(&lease_at(&gw, &body(20, 100), T0).await),
        (10, vec![(0, MINUTE, 0)])
    );
    let max = 1u64 << 53;
    assert_eq!(
        grant(&lease_at(&gw, &body(max, max), T0).await),
        (10, vec![(0, MINUTE, 0)])
    );
    // Thirds of a ms: one token of 3 per second is 333⅓ ms, given back exactly.
    let third = |want, give_back| {
        lease_request(
            "ret",
            "third",
            "c=r",
            &[(3, 1000, "token_bucket")],
            want,
            give_back,
        )
    };
    assert_eq!(
        grant(&lease_at(&gw, &third(3, 0), T0).await),
        (3, vec![(0, 1000, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &third(1, 1), T0).await),
        (1, vec![(0, 1000, 0)])
    );
    assert_eq!(
        grant(&lease_at(&gw, &third(3, 1), T0 + 1).await),
        (1, vec![(0, 999, 0)])
    );
    // A return on a bucket full already changes nothing.
    let fresh = lease_request("ret", "fresh", "c=r", TEN_PER_MINUTE, 1, 7);
    assert_eq!(
        grant(&lease_at(&gw, &fresh, T0).await),
        (1, vec![(9, 6000, 0)])
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_is_written_even_when_nothing_is_granted() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    // A: 10 per minute, shared by two buckets (same key: index 0, same limit);
    // B: 1 per hour, only in the second.
    let a: L = (10, MINUTE, "token_bucket");
    let b: L = (1, HOUR, "token_bucket");
    let only_a = lease_request("back", "k", "c=b", &[a], 10, 0);
    let both = |give_back| lease_request("back", "k", "c=b", &[a, b], 1, give_back);
    assert_eq!(
        grant(&lease_at(&gw, &both(0), T0).await),
        (1, vec![(9, 6000, 0), (0, HOUR, 0)])
    );
    // A drained twice ahead of time: its TAT is T0 + 3 minutes.
    assert_eq!(grant(&lease_at(&gw, &only_a, T0 + MINUTE).await).0, 10);
    assert_eq!(grant(&lease_at(&gw, &only_a, T0 + 2 * MINUTE).await).0, 10);
    // Back at T0 (Redis time stepped back), 1 returned: A gets 6 s back, 174 s
    // ahead, which reads as an empty bucket (never emptier: one token in 6 s),
    // B is full again. Nothing is granted, yet A's bound is written and B's
    // key is gone (full).
    assert_eq!(
        grant(&lease_at(&gw, &both(1), T0).await),
        (0, vec![(0, 60_000, 6_000), (1, 0, 0)])
    );
    assert_eq!(
        get_key(&gw, &key_of(&both(0), 0)).await,
        Some(format!("{}:0", T0 + 60_000))
    );
    assert_eq!(get_key(&gw, &key_of(&both(0), 1)).await, None);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_checks_share_one_bucket() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let (domain, key, tag) = ("d", "rule/client=abc", "client=abc");

    // Exact, at a fixed time: lease 7 of 10, then checks of cost 1 pass 3 times.
    let lease7 = lease_request(domain, key, tag, TEN_PER_MINUTE, 7, 0);
    let check1 = request(domain, 1, &[(key, tag, TEN_PER_MINUTE)]);
    assert_eq!(
        grant(&lease_at(&gw, &lease7, T0).await),
        (7, vec![(3, 42_000, 0)])
    );
    for left in [2, 1, 0] {
        let resp = check_at(&gw, &check1, T0).await;
        assert_eq!(resp["allowed"], true, "{resp}");
        assert_eq!(limit(&resp, 0, 0)["remaining"], left, "{resp}");
    }
    let resp = check_at(&gw, &check1, T0).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["retry_after_ms"], 6000, "{resp}");
    // And the other way round: the checks drained what a lease can get.
    assert_eq!(
        grant(&lease_at(&gw, &lease7, T0).await),
        (0, vec![(0, MINUTE, 6000)])
    );
    // One bucket, one key (and the caller's ledger of its lease, and the
    // domain's ledger of live keys).
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "3");

    // Over HTTP with Redis time (10 per hour: no refill during the test).
    let per_hour: &[L] = &[(10, HOUR, "token_bucket")];
    let lease7 = lease_request("http", key, tag, per_hour, 7, 0);
    let check1 = request("http", 1, &[(key, tag, per_hour)]);
    let (status, resp) = lease(&client, &gw.url(), &lease7).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["granted"], 7, "{resp}");
    for left in [2, 1, 0] {
        let (_, resp) = check(&client, &gw.url(), &check1).await;
        assert_eq!(resp["allowed"], true, "{resp}");
        assert_eq!(limit(&resp, 0, 0)["remaining"], left, "{resp}");
    }
    let (_, resp) = check(&client, &gw.url(), &check1).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let (_, resp) = lease(&client, &gw.url(), &lease7).await;
    assert_eq!(resp["granted"], 0, "{resp}");
    // Each domain: its bucket, the lease ledger and its ledger of live keys.
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "6");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_leases_hand_out_exactly_the_capacity() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    let body = std::sync::Arc::new(lease_request(
        "many",
        "k",
        "c=many",
        &[(100, HOUR, "token_bucket")],
        3,
        0,
    ));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let base = gw.url();
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let (mut got, mut calls) = (0u64, 0u64);
            loop {
                let (status, resp) = lease(&client, &base, &body).await;
                assert_eq!(status, 200, "{resp}");
                calls += 1;
                let g = resp["granted"].as_u64().unwrap();
                assert!(g <= 3, "{resp}");
                if g == 0 {
                    return (got, calls);
                }
                got += g;
            }
        }));
    }
    let (mut granted, mut calls) = (0, 0);
    for t in tasks {
        let (g, c) = t.await.unwrap();
        granted += g;
        calls += c;
    }
    eprintln!("32 tasks leasing 3 at a time from 100: {granted} granted in {calls} leases");
    assert_eq!(granted, 100);
    let client = reqwest::Client::new();
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_checks_total{result=\"lease\"}"
        )
        .await,
        calls as f64
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_route_answers_the_documented_json() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let body = lease_request(
        "doc",
        "rule/client=abc",
        "client=abc",
        &[(100, 60_000, "token_bucket")],
        5,
        0,
    );
    assert_eq!(
        body,
        json!({"version": 2, "domain": "doc", "rule": "rule", "key": "rule/client=abc",
               "tag": "client=abc", "variant": "default", "want": 5, "return": 0})
    );
    let (status, resp) = lease(&client, &gw.url(), &body).await;
    assert_eq!(status, 200, "{resp}");
    // 600 ms per token: 5 tokens are 3000 ms of the bucket, whatever the time.
    let answer = json!({"version": 2, "granted": 5,
        "limits": [{"requests": 100, "window_ms": 60000, "remaining": 95, "reset_ms": 3000,
                    "retry_after_ms": 0}]});
    assert_eq!(resp, answer);
    // The key expires when the bucket is full again, as after a check.
    let pttl: i64 = redis
        .cli(&[
            "pttl",
            "rl:{doc|client=abc}|rule/client=abc|0|token_bucket|100|60000",
        ])
        .unwrap()
        .parse()
        .unwrap();
    assert!(pttl > 0 && pttl <= 3000, "PTTL {pttl}");
    // The 5 given back (this caller holds them) cover the 5 taken again: the same answer.
    let mut again = body.clone();
    again["return"] = json!(5);
    assert_eq!(lease(&client, &gw.url(), &again).await, (200, answer));

    let sliding = lease_request(
        "doc",
        "sw/client=abc",
        "client=abc",
        &[(10, 1000, "sliding_window")],
        1,
        0,
    );
    let mut cases = vec![(
        sliding,
        "rule: rule `sw` is a sliding_window; leases need token_bucket",
    )];
    let mut v = body.clone();
    v["want"] = json!(0);
    cases.push((v, "want: must be between 1 and 2^53, got 0"));
    let mut v = body.clone();
    v["limits"] = json!([{"requests": 100, "window_ms": 60000, "algorithm": "token_bucket"}]);
    cases.push((v, "limits: unknown field `limits`, expected one of `version`, `domain`, `rule`, `key`, `tag`, `variant`, `want`, `return`"));
    let mut v = body.clone();
    v["version"] = json!(1);
    cases.push((v, "version: unsupported version 1, expected 2"));
    for (bad, error) in cases {
        let (status, resp) = lease(&client, &gw.url(), &bad).await;
        assert_eq!(status, 400, "{resp}");
        assert_eq!(resp, json!({"version": 2, "error": error}));
    }
    let (status, text) = get(&client, &gw.url(), "/metrics").await;
    assert_eq!(status, 200);
    for sample in [
        "ratelimit_gateway_checks_total{result=\"lease\"} 2",
        "ratelimit_gateway_checks_total{result=\"error\"} 4",
        "ratelimit_gateway_errors_total{kind=\"bad_request\"} 4",
        "ratelimit_gateway_redis_duration_seconds_count{op=\"lease\"} 2",
    ] {
        assert!(text.contains(sample), "{sample} missing in\n{text}");
    }
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_answers_503_when_redis_dies_and_reloads_on_noscript() {
    let mut redis = redis();
    let gw = gateway(Target::Single(redis.url()), 200).await;
    let client = reqwest::Client::new();
    let body = lease_request("dead", "k", "c=x", &[(10, HOUR, "token_bucket")], 2, 0);
    assert_eq!(lease(&client, &gw.url(), &body).await.0, 200);
    assert_eq!(redis.cli(&["script", "flush"]).unwrap(), "OK");
    let (status, resp) = lease(&client, &gw.url(), &body).await;
    assert_eq!((status, &resp["granted"]), (200, &json!(2)), "{resp}");
    assert_eq!(
        metric(&client, &gw.url(), "ratelimit_gateway_script_reloads_total").await,
        1.0
    );
    redis.kill();
    let (status, resp) = lease(&client, &gw.url(), &body).await;
    assert_eq!(status, 503, "{resp}");
    assert_eq!(resp["version"], 2);
    assert!(
        resp["error"].as_str().unwrap().starts_with("redis: "),
        "{resp}"
    );
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_checks_total{result=\"error\"}"
        )
        .await,
        1.0
    );
    gw.stop().await.unwrap();
}

/// A lease of g tokens is a check of cost g: on twin buckets (same limits,
/// another domain) at the same generated times, a lease granting g ≥ 1 and a
/// check of cost g give the same remaining and reset and leave the same
/// state; a check of cost g + 1 is denied whenever the lease granted less
/// than it could have asked for; a lease granting 0 reports what a check of
/// cost 1 reports for the limits that deny it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_of_g_tokens_is_a_check_of_cost_g() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let mut rng = Rng(0x1EA5E);
    let mut granted_some = 0;
    let mut granted_none = 0;
    for case in 0..40 {
        let n = rng.range(1, 3) as usize;
        let limits: Vec<L> = (0..n)
            .map(|_| match rng.range(0, 3) {
                0 => {
                    // requests × window_ms = 2^53 exactly.
                    let k = rng.range(11, 40);
                    (1u64 << k, 1u64 << (53 - k), "token_bucket")
                }
                _ => (rng.range(1, 20), rng.range(1, 3000), "token_bucket"),
            })
            .collect();
        let smallest = limits.iter().map(|l| l.0).min().unwrap();
        let lease_domain = format!("lease{case}");
        let check_domain = format!("check{case}");
        let mut t = T0;
        for _ in 0..25 {
            // Mostly forwards, sometimes Redis time steps back.
            let span = limits.iter().map(|l| l.1).max().unwrap();
            t = match rng.range(0, 9) {
                0 => t.saturating_sub(rng.range(0, span)),
                1 => t,
                _ => t + rng.range(0, span / 2 + 1),
            };
            let want = match rng.range(0, 5) {
                0 => rng.range(1, 1 << 53),
                _ => rng.range(1, smallest.min(20) + 1),
            };
            // Windows in ms and products up to 2^53: the Limiter's own input,
            // beyond what a policy (whole seconds) can say.
            let body = direct_lease(&lease_domain, "k", "t", &limits, want, 0);
            let answer = gw
                .app
                .limiter
                .with_clock(Arc::new(FixedClock(t)))
                .lease(&body, CALLER)
                .await
                .unwrap();
            let (g, answers) = grant(&serde_json::to_value(answer).unwrap());
            assert_eq!(answers.len(), n);
            let ctx = format!("case {case} limits {limits:?} t {t} want {want}: granted {g}");
            if g < want.min(smallest) {
                let more = direct_check(&check_domain, g + 1, &[("k", "t", &limits)]);
                let resp = direct_check_at(&gw, &more, t).await;
                assert_eq!(resp["allowed"], false, "{ctx}: {resp}");
            }
            if g >= 1 {
                granted_some += 1;
                let same = direct_check(&check_domain, g, &[("k", "t", &limits)]);
                let resp = direct_check_at(&gw, &same, t).await;
                assert_eq!(resp["allowed"], true, "{ctx}: {resp}");
                for (l, (remaining, reset, retry)) in answers.iter().enumerate() {
                    let c = limit(&resp, 0, l);
                    assert_eq!(c["remaining"], *remaining, "{ctx} limit {l}: {resp}");
                    assert_eq!(c["reset_ms"], *reset, "{ctx} limit {l}: {resp}");
                    assert_eq!(*retry, 0, "{ctx}");
                }
            } else {
                granted_none += 1;
                let one = direct_check(&check_domain, 1, &[("k", "t", &limits)]);
                let resp = direct_check_at(&gw, &one, t).await;
                assert_eq!(resp["allowed"], false, "{ctx}: {resp}");
                for (l, (remaining, reset, retry)) in answers.iter().enumerate() {
                    let c = limit(&resp, 0, l);
                    if c["allowed"] == false {
                        assert_eq!(c["remaining"], *remaining, "{ctx} limit {l}: {resp}");
                        assert_eq!(c["reset_ms"], *reset, "{ctx} limit {l}: {resp}");
                        assert_eq!(c["retry_after_ms"], *retry, "{ctx} limit {l}: {resp}");
                    } else {
                        // Allowed alone: reported after a charge of 1.
                        assert_eq!(c["remaining"], *remaining - 1, "{ctx} limit {l}: {resp}");
                        assert_eq!(*retry, 0, "{ctx}");
                    }
                }
            }
            for l in 0..n {
                let lease_key = lease_keys("rl:", &body).swap_remove(l);
                let check_key = lease_key.replacen(&lease_domain, &check_domain, 1);
                assert_eq!(
                    get_key(&gw, &lease_key).await,
                    get_key(&gw, &check_key).await,
                    "{ctx} limit {l}"
                );
            }
        }
    }
    eprintln!("twin buckets: {granted_some} leases granted tokens, {granted_none} granted none");
    assert!(
        granted_some > 100 && granted_none > 50,
        "{granted_some} {granted_none}"
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_two_tags_lease_their_own_buckets() {
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 2000).await;
    let client = reqwest::Client::new();
    let five: &[L] = &[(5, HOUR, "token_bucket"), (100, HOUR, "token_bucket")];
    let a = |want, give_back| lease_request("cl", "rule/t=a", "t=a", five, want, give_back);
    let b = |want, give_back| lease_request("cl", "rule/t=b", "t=b", five, want, give_back);
    let slot = |body: &Value| {
        let slots: Vec<Slot> = lease_keys("rl:", &resolve_lease(body))
            .iter()
            .map(|k| Slot::for_key(k.as_bytes()))
            .collect();
        assert!(
            slots.windows(2).all(|w| w[0] == w[1]),
            "one bucket, one slot"
        );
        slots[0]
    };
    // Slots 1486 and 13741: on the first and the third master.
    assert_ne!(
        slot(&a(1, 0)),
        slot(&b(1, 0)),
        "the tags must hash to different slots"
    );
    let mut got = Vec::new();
    for body in [a(3, 0), b(4, 0), a(3, 0), b(4, 0), a(3, 0), b(4, 0)] {
        let (status, resp) = lease(&client, &gw.url(), &body).await;
        assert_eq!(status, 200, "{resp}");
        got.push(resp["granted"].as_u64().unwrap());
    }
    assert_eq!(got, [3, 4, 2, 1, 0, 0]);
    // The second limit was charged the same: 95 left in both.
    let (_, resp) = lease(&client, &gw.url(), &a(1, 1)).await;
    assert_eq!(resp["granted"], 1, "{resp}");
    assert_eq!(resp["limits"][1]["remaining"], 95, "{resp}");
    // A check of tag a's bucket sees it drained; tag b's keys are elsewhere.
    let check_a = request("cl", 1, &[("rule/t=a", "t=a", five)]);
    let (_, resp) = check(&client, &gw.url(), &check_a).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let sizes = cluster.cli_each(&["dbsize"]).unwrap();
    assert_eq!(
        sizes.iter().filter(|s| s.as_str() != "0").count(),
        2,
        "keys on {sizes:?}"
    );
    // NOSCRIPT on every master: the lease loads its script again.
    for out in cluster.cli_each(&["script", "flush"]).unwrap() {
        assert_eq!(out, "OK");
    }
    let (status, resp) = lease(&client, &gw.url(), &b(1, 1)).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["granted"], 1, "{resp}");
    assert!(metric(&client, &gw.url(), "ratelimit_gateway_script_reloads_total").await >= 1.0);
    gw.stop().await.unwrap();
}

/// README, *Lease mode*: "Tokens held by a proxy that died are not given
/// back; they are part of the token bucket's use, so they come back through
/// its refill within `fraction × per` at most." A proxy leases and dies (it
/// never sends its `return`); the gateway keeps no state per caller, so the
/// bucket alone must give the tokens back, exactly on time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_a_dead_lease_holder_come_back_through_refill() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;

    // The whole bucket (fraction 1): 10 per minute leased at T0, never returned.
    let whole = lease_request("dead", "rule/c=a", "c=a", TEN_PER_MINUTE, 10, 0);
    assert_eq!(
        grant(&lease_at(&gw, &whole, T0).await),
        (10, vec![(0, MINUTE, 0)])
    );
    let check1 = request("dead", 1, &[("rule/c=a", "c=a", TEN_PER_MINUTE)]);
    let check10 = request("dead", 10, &[("rule/c=a", "c=a", TEN_PER_MINUTE)]);
    assert_eq!(check_at(&gw, &check1, T0).await["allowed"], false);
    // 1 ms before `per` has passed, 9 tokens are back, not 10.
    let resp = check_at(&gw, &check10, T0 + MINUTE - 1).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 9, "{resp}");
    // After `per`: the full capacity, exactly, to anyone.
    for left in (0..10).rev() {
        let resp = check_at(&gw, &check1, T0 + MINUTE).await;
        assert_eq!(resp["allowed"], true, "{resp}");
        assert_eq!(limit(&resp, 0, 0)["remaining"], left, "{resp}");
    }
    assert_eq!(check_at(&gw, &check1, T0 + MINUTE).await["allowed"], false);

    // A batch of fraction 0.3 (3 of 10) from a full bucket: full again after
    // 0.3 × per = 18 s, not 1 ms before.
    let batch = lease_request("dead", "rule/c=b", "c=b", TEN_PER_MINUTE, 3, 0);
    assert_eq!(
        grant(&lease_at(&gw, &batch, T0).await),
        (3, vec![(7, 18_000, 0)])
    );
    let check10 = request("dead", 10, &[("rule/c=b", "c=b", TEN_PER_MINUTE)]);
    let resp = check_at(&gw, &check10, T0 + 17_999).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 9, "{resp}");
    let resp = check_at(&gw, &check10, T0 + 18_000).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 0, "{resp}");

    // With Redis time over HTTP: the key of a dead holder's lease expires
    // when the bucket is full again, and then the whole capacity passes.
    let client = reqwest::Client::new();
    let two_s: &[L] = &[(10, 2000, "token_bucket")];
    let whole = lease_request("real", "rule/c=a", "c=a", two_s, 10, 0);
    let (status, resp) = lease(&client, &gw.url(), &whole).await;
    assert_eq!((status, &resp["granted"]), (200, &json!(10)), "{resp}");
    let check10 = request("real", 10, &[("rule/c=a", "c=a", two_s)]);
    let (_, resp) = check(&client, &gw.url(), &check10).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    let key = key_of(&whole, 0);
    assert!(get_key(&gw, &key).await.is_some());
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    assert_eq!(get_key(&gw, &key).await, None, "expired when full again");
    let (_, resp) = check(&client, &gw.url(), &check10).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 0, "{resp}");
    gw.stop().await.unwrap();
}

/// `PTTL key` through the gateway's own connection (-1: no expiry, -2: no key).
async fn pttl(gw: &Running, key: &str) -> i64 {
    gw.app
        .limiter
        .store()
        .query(redis::cmd("PTTL").arg(key), "pttl")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_written_at_a_given_time_still_expire() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let (domain, key, tag) = ("d", "rule/client=ttl", "client=ttl");
    let lease7 = lease_request(domain, key, tag, TEN_PER_MINUTE, 7, 0);
    let check1 = request(domain, 1, &[(key, tag, TEN_PER_MINUTE)]);
    assert_eq!(grant(&lease_at(&gw, &lease7, T0).await).0, 7);
    let resp = check_at(&gw, &check1, T0).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    let bucket = key_of(&lease7, 0);
    let held = ratelimit_gateway::redis::keys::ledger_key("rl:", &resolve_lease(&lease7), CALLER);
    let live = ratelimit_gateway::redis::keys::live_ledger("rl:", domain);
    // At a given time each key lives a day of Redis time (its own expiry,
    // at most two hours of the script's time, is on a clock Redis does not
    // follow): it expires, and not during the test.
    for k in [&bucket, &held, &live] {
        let ttl = pttl(&gw, k).await;
        assert!(
            ttl > 2 * HOUR as i64 && ttl <= 24 * HOUR as i64,
            "{k}: PTTL {ttl}"
        );
    }
    gw.stop().await.unwrap();
}
