//! The gateway's deny cache (`--deny-cache-entries`) against a real `redis-server`, over
//! `/v1/check`: a bucket Redis denied costs no Redis call and writes nothing
//! until Redis's wait is over, answers as Redis did less the time gone by, and
//! the first check after the wait is Redis's again. A request with a cached
//! bucket and other buckets or quotas is a denial that charges none of them.
//! (The gRPC front end's share of the cache: `tests/rls.rs`.)

mod common;

use std::time::{Duration, Instant};

use common::*;
use ratelimit_gateway::{Running, Target};
use serde_json::Value;
use testkit::redis::Redis;

/// Redis calls of one operation so far (`check`: a charge, `peek`: a read).
fn redis_calls(gw: &Running, op: &str) -> u64 {
    gw.app
        .metrics
        .redis_latency
        .with_label_values(&[op])
        .get_sample_count()
}

fn hits(gw: &Running) -> u64 {
    gw.app.metrics.deny_cache_hits.get()
}

/// Every key but the health probes', with value and expiry.
fn dump(redis: &Redis) -> String {
    let all = redis.dump().unwrap();
    all.lines()
        .filter(|l| !l.contains("health:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn retry_ms(resp: &Value) -> u64 {
    limit(resp, 0, 0)["retry_after_ms"].as_u64().unwrap()
}

/// Spends `n` tokens of `body`'s bucket, then checks once more: that denial,
/// and when it was sent.
async fn spend_then_deny(gw: &Running, body: &Value, n: u64) -> (Value, Instant) {
    let client = reqwest::Client::new();
    for _ in 0..n {
        let (status, resp) = check(&client, &gw.url(), body).await;
        assert_eq!(
            (status, &resp["allowed"]),
            (200, &Value::Bool(true)),
            "{resp}"
        );
    }
    let sent = Instant::now();
    let (status, resp) = check(&client, &gw.url(), body).await;
    assert_eq!(
        (status, &resp["allowed"]),
        (200, &Value::Bool(false)),
        "{resp}"
    );
    (resp, sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_bucket_costs_no_redis_call_until_its_wait_then_its_first_check_passes() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    // 2 per 10 s: once spent, the next token is due in 5 s.
    let body = request(
        "deny",
        1,
        &[("dc-one/c=alice", "c=alice", &[(2, 10_000, "token_bucket")])],
    );
    let (denied, sent) = spend_then_deny(&gw, &body, 2).await;
    let wait = retry_ms(&denied);
    assert!((4_000..=5_000).contains(&wait), "{denied}");
    let calls = redis_calls(&gw, "check");
    let before = dump(&redis);
    // 30 checks in a row, then 200 from 8 connections: denied from memory.
    let mut last = wait;
    for _ in 0..30 {
        let (status, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(status, 200, "{resp}");
        assert_eq!(resp["allowed"], false, "{resp}");
        let l = limit(&resp, 0, 0);
        assert_eq!(
            (
                &l["allowed"],
                &l["remaining"],
                &l["requests"],
                &l["window_ms"]
            ),
            (
                &Value::Bool(false),
                &Value::from(0),
                &Value::from(2),
                &Value::from(10_000)
            ),
            "{resp}"
        );
        // Redis's wait less the time gone by: never longer, counting down.
        let r = retry_ms(&resp);
        assert!(r <= last && r >= 1, "{r} after {last}: {resp}");
        last = r;
    }
    assert_eq!(burst(&gw.url(), body.clone(), 8, 200).await, (0, 200, 0));
    assert_eq!(
        redis_calls(&gw, "check"),
        calls,
        "a cached denial called Redis"
    );
    assert_eq!(hits(&gw), 230);
    assert_eq!(dump(&redis), before, "a cached denial wrote to Redis");
    // The first check once the wait is over passes, and is Redis's.
    tokio::time::sleep(
        (sent + Duration::from_millis(wait + 20)).saturating_duration_since(Instant::now()),
    )
    .await;
    let (status, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(
        (status, &resp["allowed"]),
        (200, &Value::Bool(true)),
        "{resp}"
    );
    assert_eq!(redis_calls(&gw, "check"), calls + 1);
    assert_eq!(hits(&gw), 230);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_with_a_cached_bucket_charges_none_of_its_other_buckets_or_quotas() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let limits: &[L] = &[(2, 60_000, "token_bucket")];
    let alice = request("deny", 1, &[("dc-two/c=alice", "c=alice", limits)]);
    spend_then_deny(&gw, &alice, 2).await;
    let q = quota("deny", "dc-month/c=bob", "c=bob", 5, "month", 1);
    let both = with_quotas(
        request(
            "deny",
            1,
            &[
                ("dc-two/c=alice", "c=alice", limits),
                ("dc-other/c=bob", "c=bob", limits),
            ],
        ),
        std::slice::from_ref(&q),
    );
    let (calls, peeks) = (redis_calls(&gw, "check"), redis_calls(&gw, "peek"));
    let before = dump(&redis);
    let (status, resp) = check(&client, &gw.url(), &both).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 1, 0)["allowed"], true, "{resp}");
    assert_eq!(quota_of(&resp, 0)["allowed"], true, "{resp}");
    // bob's bucket and the quota were only read: one peek, no charge, nothing written.
    assert_eq!(redis_calls(&gw, "check"), calls);
    assert_eq!(redis_calls(&gw, "peek"), peeks + 1);
    assert_eq!(
        dump(&redis),
        before,
        "a cached denial charged another bucket"
    );
    assert_eq!(hits(&gw), 1);
    // bob's first own check finds both his tokens and the whole quota.
    let bob = with_quotas(
        request("deny", 1, &[("dc-other/c=bob", "c=bob", limits)]),
        &[q],
    );
    let (_, resp) = check(&client, &gw.url(), &bob).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 1, "{resp}");
    assert_eq!(quota_of(&resp, 0)["remaining"], 4, "{resp}");
    assert_eq!(hits(&gw), 1);
}
