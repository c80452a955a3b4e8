//! The gateway against one real `redis-server`.

mod common;

use std::time::Duration;

use common::*;
use ratelimit_gateway::Target;
use serde_json::json;

const HOUR: u64 = 3_600_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_counts_then_denied_with_retry_after() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    for alg in ["token_bucket", "sliding_window"] {
        // A rule per algorithm: a policy rule counts one way.
        let key = format!("per-client-{alg}/c=alice");
        let body = request("demo", 1, &[(&key, "c=alice", &[(5, HOUR, alg)])]);
        for left in (0..5).rev() {
            let (status, resp) = check(&client, &gw.url(), &body).await;
            assert_eq!(status, 200, "{resp}");
            assert_eq!(resp["allowed"], true, "{alg}: {resp}");
            assert_eq!(limit(&resp, 0, 0)["remaining"], left, "{alg}: {resp}");
            assert_eq!(limit(&resp, 0, 0)["retry_after_ms"], 0);
        }
        let (status, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(status, 200);
        assert_eq!(resp["version"], 2);
        assert_eq!(resp["allowed"], false, "{alg}: {resp}");
        // The limit the policy enforced, in the answer.
        assert_eq!(
            (
                limit(&resp, 0, 0)["requests"].as_u64(),
                limit(&resp, 0, 0)["window_ms"].as_u64()
            ),
            (Some(5), Some(HOUR))
        );
        let l = limit(&resp, 0, 0);
        assert_eq!(l["allowed"], false);
        assert_eq!(l["remaining"], 0);
        let retry = l["retry_after_ms"].as_u64().unwrap();
        assert!(retry > 0, "{alg}: {resp}");
        if alg == "token_bucket" {
            // One token per hour / 5, give or take the ms elapsed since the burst.
            assert!((HOUR / 5 - 1000..=HOUR / 5).contains(&retry), "{resp}");
            assert!(l["reset_ms"].as_u64().unwrap() <= HOUR);
        } else {
            // 5 in this window: they must fade to 4 in the next one, 1/5 into it.
            assert!(retry > HOUR / 5 && retry <= HOUR + HOUR / 5, "{resp}");
        }
        assert_eq!(
            metric(
                &client,
                &gw.url(),
                "ratelimit_gateway_denials_total{algorithm=\"token_bucket\"}"
            )
            .await,
            1.0
        );
    }
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_checks_total{result=\"allowed\"}"
        )
        .await,
        10.0
    );
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_checks_total{result=\"denied\"}"
        )
        .await,
        2.0
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bucket_refills() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let body = request(
        "demo",
        1,
        &[("refill", "c=bob", &[(2, 1000, "token_bucket")])],
    );
    for _ in 0..2 {
        assert_eq!(check(&client, &gw.url(), &body).await.1["allowed"], true);
    }
    let (_, denied) = check(&client, &gw.url(), &body).await;
    assert_eq!(denied["allowed"], false);
    let retry = limit(&denied, 0, 0)["retry_after_ms"].as_u64().unwrap();
    assert!((400..=500).contains(&retry), "{denied}");
    tokio::time::sleep(Duration::from_millis(1050)).await;
    let (_, again) = check(&client, &gw.url(), &body).await;
    assert_eq!(again["allowed"], true, "{again}");
    assert_eq!(limit(&again, 0, 0)["remaining"], 1, "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_or_nothing_across_buckets() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    for alg in ["token_bucket", "sliding_window"] {
        let domain = format!("aon-{alg}");
        // One algorithm per rule (the policy's rules have one).
        let wide: &[L] = &[(10, HOUR, alg), (100, HOUR, alg)];
        let narrow: &[L] = &[(1, HOUR, alg)];
        let both = request(
            &domain,
            1,
            &[("wide", "c=x", wide), ("narrow", "c=x", narrow)],
        );
        let only_wide = request(&domain, 1, &[("wide", "c=x", wide)]);

        let (_, first) = check(&client, &gw.url(), &both).await;
        assert_eq!(first["allowed"], true, "{first}");
        assert_eq!(limit(&first, 0, 0)["remaining"], 9);

        let (_, second) = check(&client, &gw.url(), &both).await;
        assert_eq!(second["allowed"], false, "{second}");
        // The wide bucket alone would pass: it reports what it would have left.
        assert_eq!(limit(&second, 0, 0)["allowed"], true, "{second}");
        assert_eq!(limit(&second, 0, 0)["remaining"], 8, "{second}");
        assert_eq!(limit(&second, 1, 0)["allowed"], false, "{second}");

        // Only the first request was charged in the wide bucket.
        let (_, third) = check(&client, &gw.url(), &only_wide).await;
        assert_eq!(third["allowed"], true);
        assert_eq!(limit(&third, 0, 0)["remaining"], 8, "{alg}: {third}");
        assert_eq!(limit(&third, 0, 1)["remaining"], 98, "{alg}: {third}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_get_exactly_the_limit() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    for alg in ["token_bucket", "sliding_window"] {
        let body = request("burst", 1, &[(alg, "c=many", &[(100, HOUR, alg)])]);
        let (allowed, denied, other) = burst(&gw.url(), body, 64, 300).await;
        eprintln!("{alg}: 64 clients, 300 requests, limit 100: {allowed} allowed, {denied} denied, {other} errors");
        assert_eq!((allowed, denied, other), (100, 200, 0), "{alg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_expire_when_full_again_and_denials_write_nothing() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let body = request(
        "ttl",
        1,
        &[
            ("k", "c=t", &[(5, HOUR, "token_bucket")]),
            ("ksw", "c=t", &[(10, 60_000, "sliding_window")]),
        ],
    );
    let sent = std::time::Instant::now();
    let (_, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(resp["allowed"], true);
    let tb = redis
        .cli(&["pttl", "rl:{ttl|c=t}|k/c=t|0|token_bucket|5|3600000"])
        .unwrap();
    let tb: i64 = tb.parse().unwrap();
    // The TTL is the time to refill, less only the time since the check (at
    // most the time since it was sent, plus 1 ms of rounding; measured, since
    // a busy machine takes tens of ms to start a redis-cli): a key expiring
    // earlier would forget a charge (over-admit), a later one would only
    // keep memory. Token bucket: one token, HOUR / 5.
    let since_ms = || sent.elapsed().as_millis() as i64 + 1;
    let tb_reset = limit(&resp, 0, 0)["reset_ms"].as_i64().unwrap();
    assert_eq!(tb_reset, (HOUR / 5) as i64);
    let since = since_ms();
    assert!(
        (tb_reset - since..=tb_reset).contains(&tb),
        "token bucket PTTL {tb}, refill {tb_reset}, {since} ms since the check was sent"
    );
    // Sliding window: until the charged window has faded, reset_ms (W to 2W).
    let sw: i64 = redis
        .cli(&["pttl", "rl:{ttl|c=t}|ksw/c=t|0|sliding_window|10|60000"])
        .unwrap()
        .parse()
        .unwrap();
    let sw_reset = limit(&resp, 1, 0)["reset_ms"].as_i64().unwrap();
    assert!(
        (60_001..=120_000).contains(&sw_reset),
        "sliding window reset {sw_reset}"
    );
    let since = since_ms();
    assert!(
        (sw_reset - since..=sw_reset).contains(&sw),
        "sliding window PTTL {sw}, reset {sw_reset}, {since} ms since the check was sent"
    );

    // A cost above the capacity is denied and creates nothing.
    let big = request("ttl", 6, &[("fresh", "c=t", &[(5, HOUR, "token_bucket")])]);
    let (_, resp) = check(&client, &gw.url(), &big).await;
    assert_eq!(resp["allowed"], false);
    assert_eq!(limit(&resp, 0, 0)["retry_after_ms"], HOUR);
    assert_eq!(limit(&resp, 0, 0)["remaining"], 5);
    assert_eq!(
        redis
            .cli(&["exists", "rl:{ttl|c=t}|fresh/c=t|0|token_bucket|5|3600000"])
            .unwrap(),
        "0"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noscript_after_script_flush_reloads() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let body = request("ns", 1, &[("k", "c=n", &[(10, HOUR, "token_bucket")])]);
    assert_eq!(check(&client, &gw.url(), &body).await.1["allowed"], true);
    let reloads = "ratelimit_gateway_script_reloads_total";
    assert_eq!(metric(&client, &gw.url(), reloads).await, 0.0);
    assert_eq!(redis.cli(&["script", "flush"]).unwrap(), "OK");
    let (status, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(limit(&resp, 0, 0)["remaining"], 8);
    assert_eq!(metric(&client, &gw.url(), reloads).await, 1.0);
    assert_eq!(check(&client, &gw.url(), &body).await.0, 200);
    assert_eq!(metric(&client, &gw.url(), reloads).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_400_with_the_field_path() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let good = request("bad", 1, &[("k", "t", &[(10, 1000, "token_bucket")])]);
    let mut cases = Vec::new();
    let mut v = good.clone();
    v["version"] = json!(1);
    cases.push((v, "version: unsupported version 1, expected 2"));
    let mut v = good.clone();
    v["buckets"][0]["cost"] = json!(0);
    cases.push((v, "buckets[0].cost: must be between 1 and 2^53, got 0"));
    let mut v = good.clone();
    v["buckets"][0]["variant"] = json!("gold");
    cases.push((v, "buckets[0].variant: unknown variant `gold`"));
    let mut v = good.clone();
    v["buckets"][0]["limits"] =
        json!([{"requests": 10, "window_ms": 1000, "algorithm": "token_bucket"}]);
    cases.push((v, "buckets[0].limits: unknown field `limits`"));
    let mut v = good.clone();
    v["buckets"][0]["rule"] = json!("nope");
    v["buckets"][0]["key"] = json!("nope");
    cases.push((v, "buckets[0].rule: unknown rule `nope`"));
    let mut v = good.clone();
    v["buckets"][0]["color"] = json!("red");
    cases.push((v, "buckets[0].color: unknown field `color`"));
    let mut v = good.clone();
    v["buckets"][0]["tag"] = json!("t".repeat(513));
    cases.push((v, "buckets[0].tag: must be at most 512 bytes, got 513"));
    let mut v = good.clone();
    v["buckets"] = json!(vec![good["buckets"][0].clone(); 65]);
    cases.push((v, "buckets: must hold 1 to 64 buckets, got 65"));
    let mut v = good.clone();
    v["buckets"] = json!(vec![good["buckets"][0].clone(); 2]);
    cases.push((
        v,
        "buckets: domain `bad` has 1 global rules, so at most 1 buckets, got 2",
    ));
    for (body, want) in cases {
        let (status, resp) = check(&client, &gw.url(), &body).await;
        assert_eq!(status, 400, "{resp}");
        assert_eq!(resp["version"], 2);
        let err = resp["error"].as_str().unwrap();
        assert!(err.starts_with(want), "{err:?} should start with {want:?}");
    }
    let (status, resp) = check_raw(&client, &gw.url(), "<html>").await;
    assert_eq!(status, 400);
    assert!(
        resp["error"]
            .as_str()
            .unwrap()
            .starts_with("body: expected value"),
        "{resp}"
    );
    // Nothing reached Redis.
    assert_eq!(redis.cli(&["dbsize"]).unwrap(), "0");
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_errors_total{kind=\"bad_request\"}"
        )
        .await,
        10.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_and_503_when_redis_dies() {
    let mut redis = redis();
    let gw = gateway(Target::Single(redis.url()), 200).await;
    let client = reqwest::Client::new();
    let (status, body) = get(&client, &gw.url(), "/healthz").await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        json!({ "status": "ok", "redis": "up" })
    );
    let req = request("h", 1, &[("k", "t", &[(10, 1000, "token_bucket")])]);
    assert_eq!(check(&client, &gw.url(), &req).await.0, 200);

    redis.kill();
    let started = std::time::Instant::now();
    let (status, resp) = check(&client, &gw.url(), &req).await;
    assert_eq!(status, 503, "{resp}");
    assert_eq!(resp["version"], 2);
    assert!(
        resp["error"].as_str().unwrap().starts_with("redis: "),
        "{resp}"
    );
    // Health answers from one Redis probe a second (gateway/src/http/health.rs).
    let (status, body) = loop {
        let (status, body) = get(&client, &gw.url(), "/healthz").await;
        if status != 200 || started.elapsed() > Duration::from_secs(2) {
            break (status, body);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status, 503);
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["redis"], "down");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_exported() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let req = request("m", 1, &[("k", "t", &[(10, 1000, "token_bucket")])]);
    check(&client, &gw.url(), &req).await;
    let (status, text) = get(&client, &gw.url(), "/metrics").await;
    assert_eq!(status, 200);
    for name in [
        "ratelimit_gateway_checks_total{result=\"allowed\"} 1",
        "ratelimit_gateway_checks_total{result=\"error\"} 0",
        "ratelimit_gateway_denials_total{algorithm=\"sliding_window\"} 0",
        "ratelimit_gateway_quota_denials_total{period=\"month\"} 0",
        "ratelimit_gateway_redis_duration_seconds_count{op=\"check\"} 1",
        "ratelimit_gateway_errors_total{kind=\"timeout\"} 0",
        "ratelimit_gateway_script_reloads_total 0",
        "ratelimit_gateway_refunds_total 0",
    ] {
        assert!(text.contains(name), "{name} missing in\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_bucket_is_charged_its_own_cost() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    // The policy: g (10/min, 2/s) and search (12/min, sliding, cost up to 5).
    request(
        "cost",
        1,
        &[(
            "g/c=alice",
            "c=alice",
            &[(10, 60_000, "token_bucket"), (2, 1000, "token_bucket")],
        )],
    );
    request(
        "cost",
        5,
        &[(
            "search/c=alice",
            "c=alice",
            &[(12, 60_000, "sliding_window")],
        )],
    );
    // The body the filter sends (src/global/callout.rs): every bucket carries its cost.
    let body = json!({"version":2,"domain":"cost","buckets":[
        {"rule":"g","key":"g/c=alice","tag":"c=alice","variant":"default","cost":1},
        {"rule":"search","key":"search/c=alice","tag":"c=alice","variant":"default","cost":5}]});
    let (status, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["allowed"], true);
    assert_eq!(limit(&resp, 0, 0)["remaining"], 9);
    assert_eq!(limit(&resp, 0, 1)["remaining"], 1);
    assert_eq!(limit(&resp, 1, 0)["remaining"], 7);
    let (_, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(resp["allowed"], true, "{resp}");
    assert_eq!(limit(&resp, 1, 0)["remaining"], 2);
    // 5 more do not fit in the 2 left: denied, and the first bucket is not charged.
    let (_, resp) = check(&client, &gw.url(), &body).await;
    assert_eq!(resp["allowed"], false, "{resp}");
    assert_eq!(limit(&resp, 1, 0)["remaining"], 2);
    assert_eq!(limit(&resp, 0, 0)["remaining"], 7, "{resp}");
}

// ---------------------------------------------------------------------------
// The `ratelimit-gateway` process itself (its log, its exit), through
// `testkit::Gateway`, in plain threads: the process must be started and kept
// by one thread (it gets SIGTERM when that thread ends).

/// A log line a caller would like to forge.
const FORGED: &str = "2026-01-01T00:00:00Z INFO ratelimit_gateway: forged admin login ok";

/// Starts the `ratelimit-gateway` binary in front of `redis` with `args`;
/// its policy is what this process's requests named so far (build them first).
fn gateway_process(redis: &testkit::redis::Redis, args: &[&str]) -> testkit::Gateway {
    let dir = policy_dir().display().to_string();
    let mut all = vec!["--policy", &dir];
    all.extend_from_slice(args);
    testkit::Gateway::start(testkit::GatewayOptions::new(redis.url()).args(&all))
        .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Posts `body` to `path` on its own connection; the status and the body text.
fn post_text(gw: &testkit::Gateway, path: &str, body: &[u8]) -> (u16, String) {
    let client = testkit::Client::new(gw.url(""), testkit::ConnectionMode::NewPerRequest);
    let req =
        testkit::Request::post(path, body.to_vec()).header("content-type", "application/json");
    let r = client.send(&req).unwrap_or_else(|e| panic!("{e:#}"));
    (r.status, r.body)
}

/// Makes `key` a Redis hash, so that the scripts' `GET` on it fails with a
/// script error (WRONGTYPE, the script's SHA and line).
fn make_wrong_type(redis: &testkit::redis::Redis, key: &str) {
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    let added: i64 = redis::cmd("HSET")
        .arg(key)
        .arg("f")
        .arg("v")
        .query(&mut conn)
        .unwrap();
    assert_eq!(added, 1, "{key:?}");
}

#[test]
fn caller_values_are_escaped_in_the_log_and_503_bodies_are_generic() {
    use ratelimit_gateway::redis::{keys, script};
    let redis = redis();
    let limits: &[L] = &[(10, HOUR, "token_bucket")];
    // A domain of the policy whose keys make the scripts fail (WRONGTYPE).
    let body = request("esc", 1, &[("k", "t", limits)]);
    make_wrong_type(&redis, &keys::limit_keys("rl:", &resolve(&body))[0].key);
    let lease = lease_request("esc", "lk", "t", limits, 1, 0);
    make_wrong_type(&redis, &keys::lease_keys("rl:", &resolve_lease(&lease))[0]);
    let gw = gateway_process(&redis, &["--redis-timeout-ms", "2000"]);
    for (path, body) in [("/v1/check", &body), ("/v1/lease", &lease)] {
        let (status, text) = post_text(&gw, path, &serde_json::to_vec(body).unwrap());
        // The caller learns that the store failed, nothing about the script.
        assert_eq!(status, 503, "{path}: {text}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
            json!({ "version": 2, "error": "redis: unavailable" }),
            "{path}"
        );
    }
    // A domain with a forged line in it is not in any policy: a 404 whose
    // message (the caller's words) is logged escaped.
    let mut forged_bodies = Vec::new();
    for sep in ["\n", "\r", "\r\n"] {
        let mut b = body.clone();
        b["domain"] = json!(format!("x{sep}{FORGED}"));
        forged_bodies.push(b);
    }
    for b in &forged_bodies {
        let (status, text) = post_text(&gw, "/v1/check", &serde_json::to_vec(b).unwrap());
        assert_eq!(status, 404, "{text}");
    }
    let log = gw.log();
    // No caller value started a line of its own or moved the cursor back.
    assert!(!log.contains('\r'), "a raw CR in the log:\n{log}");
    let forged: Vec<&str> = log.lines().filter(|l| l.starts_with(FORGED)).collect();
    assert_eq!(forged, Vec::<&str>::new(), "forged lines in:\n{log}");
    for sep in ["\\n", "\\r", "\\r\\n"] {
        let domain = format!("x{sep}{FORGED}");
        assert!(
            log.lines()
                .any(|l| l.contains(": unknown domain error=") && l.contains(&domain)),
            "no unknown domain line with {domain} in:\n{log}"
        );
    }
    // The detail the caller did not get is in the log.
    for (what, sha) in [
        ("check failed", &script::check().sha),
        ("lease failed", &script::lease().sha),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains(what) && l.contains("domain=\"esc\""))
            .unwrap_or_else(|| panic!("no {what:?} line in:\n{log}"));
        assert!(
            line.contains("WRONGTYPE") && line.contains(sha.as_str()),
            "{line}"
        );
    }
}

/// `(lines, suppressed)` of the log's warnings with `message`: how many
/// lines there are and the sum of their `suppressed=K` fields (how many
/// similar warnings were left out before each).
fn warnings(log: &str, message: &str) -> (u64, u64) {
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains(message))
        .collect();
    let suppressed = lines
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("suppressed=")? + "suppressed=".len()..];
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum();
    (lines.len() as u64, suppressed)
}

#[test]
fn warnings_caused_by_callers_are_rate_limited_with_a_suppressed_count() {
    use ratelimit_gateway::logging::{WARNINGS_PER_SECOND, WARNING_WINDOW};
    let redis = redis();
    let mut bad = request("demo", 1, &[("k", "t", &[(10, HOUR, "token_bucket")])]);
    let gw = gateway_process(&redis, &[]);
    let client = testkit::Client::new(gw.url(""), testkit::ConnectionMode::KeepAlive);
    let send = |body: Vec<u8>| {
        let req =
            testkit::Request::post("/v1/check", body).header("content-type", "application/json");
        let r = client.send(&req).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(r.status, 400, "{}", r.body);
    };
    // The first one, logged for sure, names a field with a forged line in it.
    bad["buckets"][0][format!("color\n{FORGED}")] = json!(1);
    let started = std::time::Instant::now();
    send(serde_json::to_vec(&bad).unwrap());
    bad["version"] = json!(3);
    let bad = serde_json::to_vec(&bad).unwrap();
    for _ in 1..1000 {
        send(bad.clone());
    }
    let elapsed = started.elapsed();
    let (lines, _) = warnings(&gw.log(), "bad request");
    // At most WARNINGS_PER_SECOND in each window the burst touched.
    let windows = elapsed.as_nanos() / WARNING_WINDOW.as_nanos() + 2;
    let bound = WARNINGS_PER_SECOND * windows as u64;
    assert!(
        (1..=bound).contains(&lines),
        "{lines} warning lines for 1000 bad requests in {elapsed:?} (bound {bound})"
    );
    // Every bad request is either a line or counted, at once, as suppressed.
    let sample = "ratelimit_gateway_log_suppressed_total{kind=\"bad_request\"}";
    assert_eq!(gw.metric(sample).unwrap(), Some((1000 - lines) as f64));
    // The next warning after the window says how many were left out since
    // the last one written: the suppressed=K fields add up to the count.
    std::thread::sleep(WARNING_WINDOW + Duration::from_millis(100));
    send(bad.clone());
    let log = gw.log();
    let (after, suppressed) = warnings(&log, "bad request");
    assert_eq!(after, lines + 1, "{log}");
    assert_eq!(after + suppressed, 1001, "{log}");
    assert_eq!(gw.metric(sample).unwrap(), Some(suppressed as f64));
    // Escaped: the forged text is inside the first warning, not a line.
    assert!(!log.lines().any(|l| l.starts_with(FORGED)), "{log}");
    assert!(log.contains(&format!("color\\n{FORGED}")), "{log}");
}

#[test]
fn sigterm_finishes_the_requests_in_flight_then_exits() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const IN_FLIGHT: usize = 6;
    let redis = redis();
    let body = serde_json::to_vec(&request(
        "drain",
        1,
        &[("k", "t", &[(10, HOUR, "token_bucket")])],
    ))
    .unwrap();
    let mut gw = gateway_process(&redis, &["--redis-timeout-ms", "10000"]);
    // Redis holds every command for 5 s: the checks wait in the gateway.
    assert_eq!(
        redis.cli(&["client", "pause", "5000", "all"]).unwrap(),
        "OK"
    );
    let answered = Arc::new(AtomicUsize::new(0));
    let senders: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (url, body, answered) = (gw.url(""), body.clone(), Arc::clone(&answered));
            std::thread::spawn(move || {
                let client = testkit::Client::new(url, testkit::ConnectionMode::NewPerRequest);
                let req = testkit::Request::post("/v1/check", body)
                    .header("content-type", "application/json");
                let r = client.send(&req);
                answered.fetch_add(1, Ordering::SeqCst);
                r
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(answered.load(Ordering::SeqCst), 0, "Redis is paused");
    let pid = gw.pid().unwrap().to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success());
    // It stops accepting at once, but lives while the requests are in flight.
    std::thread::sleep(Duration::from_millis(300));
    let port = gw.port();
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "still accepting after SIGTERM"
    );
    assert!(gw.is_running(), "exited with requests in flight");
    assert_eq!(answered.load(Ordering::SeqCst), 0);
    // Each in-flight request gets its real answer: 6 of a bucket of 10.
    let mut remaining: Vec<u64> = senders
        .into_iter()
        .map(|h| {
            let r = h.join().unwrap().unwrap_or_else(|e| panic!("{e:#}"));
            assert_eq!(r.status, 200, "{}", r.body);
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["allowed"], true, "{v}");
            limit(&v, 0, 0)["remaining"].as_u64().unwrap()
        })
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, vec![4, 5, 6, 7, 8, 9]);
    // Then it exits by itself, successfully (well before stop()'s SIGKILL).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let status = loop {
        if let Some(s) = gw.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running:\n{}",
            gw.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}\n{}", gw.log());
    let log = gw.log();
    assert!(log.contains("SIGTERM: shutting down"), "{log}");
    assert!(log.contains("ratelimit-gateway stopped"), "{log}");
}
