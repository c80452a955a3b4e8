//! `POST /v3/check`, the batched check, against a real Redis: each check of a
//! batch answered and charged exactly as the same check alone through
//! `/v1/check` (a seeded differential at a fixed clock, answers and Redis
//! contents), exact counts under concurrent batches on a single Redis and on
//! a 3-master cluster, one `batch.lua` call per batch, a check's own errors
//! (the key budget) leaving the others decided, and hostile batches (another
//! domain's rule, oversized, unauthenticated) refused whole, writing nothing.

mod common;
use common::*;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ratelimit_gateway::clock::FixedClock;
use ratelimit_gateway::flags::Auth;
use ratelimit_gateway::{Config, Running, Target};
use serde_json::{json, Value};

fn dbsize(redis: &testkit::redis::Redis) -> String {
    redis.cli(&["DBSIZE"]).unwrap().trim().to_string()
}

/// The count of Redis round trips of operation `op` so far.
async fn redis_calls(client: &reqwest::Client, base: &str, op: &str) -> f64 {
    let sample = format!("ratelimit_gateway_redis_duration_seconds_count{{op=\"{op}\"}}");
    metric(client, base, &sample).await
}

/// `items` in a seeded random order.
fn shuffled<T>(mut items: Vec<T>, rng: &mut Rng) -> Vec<T> {
    for i in (1..items.len()).rev() {
        let j = rng.range(0, i as u64) as usize;
        items.swap(i, j);
    }
    items
}

/// Posts `checks` (pairs of a name to count under and a `/v1/check` body)
/// in batches of `size` from `clients` concurrent connections; the checks
/// allowed per name.
async fn allowed_per_name(
    base: &str,
    domain: &str,
    checks: Vec<(String, Value)>,
    size: usize,
    clients: usize,
) -> HashMap<String, u64> {
    sync_policy();
    let batches: Vec<Vec<(String, Value)>> = checks.chunks(size).map(<[_]>::to_vec).collect();
    let queue = Arc::new(std::sync::Mutex::new(batches));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (base, domain, queue) = (base.to_string(), domain.to_string(), queue.clone());
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut allowed: HashMap<String, u64> = HashMap::new();
            loop {
                let Some(lot) = queue.lock().unwrap().pop() else {
                    break;
                };
                let body = batch_request(&domain, lot.iter().map(|(_, c)| as_check(c)).collect());
                let (status, answer) = batch(&client, &base, &body).await;
                assert_eq!(status, 200, "{answer}");
                let results = answer["results"].as_array().unwrap();
                assert_eq!(results.len(), lot.len());
                for ((name, _), r) in lot.iter().zip(results) {
                    assert!(r.get("error").is_none(), "{r}");
                    if r["allowed"] == true {
                        *allowed.entry(name.clone()).or_default() += 1;
                    }
                }
            }
            allowed
        }));
    }
    let mut total: HashMap<String, u64> = HashMap::new();
    for t in tasks {
        for (name, n) in t.await.unwrap() {
            *total.entry(name).or_default() += n;
        }
    }
    total
}

/// 1,000 keys at 3 a day, each checked 5 times, and one hot key at 500 a
/// day checked 600 times, shuffled; a day's window, so that nothing refills
/// while the test runs.
fn keys_and_a_hot_key(domain: &str, rng: &mut Rng) -> Vec<(String, Value)> {
    let three: &[L] = &[(3, 86_400_000, "token_bucket")];
    let hot: &[L] = &[(500, 86_400_000, "token_bucket")];
    let mut checks = Vec::new();
    for k in 0..1000 {
        let tag = format!("c{k}");
        for _ in 0..5 {
            checks.push((tag.clone(), request(domain, 1, &[("three", &tag, three)])));
        }
    }
    for _ in 0..600 {
        checks.push(("hot".to_string(), request(domain, 1, &[("hot", "h", hot)])));
    }
    shuffled(checks, rng)
}

/// Asserts exactly 3 allowed per key and 500 for the hot key.
fn assert_exact(allowed: &HashMap<String, u64>) {
    assert_eq!(allowed.get("hot"), Some(&500), "the hot key");
    for k in 0..1000 {
        assert_eq!(allowed.get(&format!("c{k}")), Some(&3), "key c{k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_answer_and_write_as_the_same_checks_one_by_one() {
    let (redis_a, redis_b) = (redis(), redis());
    let batched = gateway(Target::Single(redis_a.url()), 5000).await;
    let alone = gateway(Target::Single(redis_b.url()), 5000).await;
    let domain = "batch-diff";
    let tb: &[L] = &[(5, 10_000, "token_bucket"), (12, 60_000, "token_bucket")];
    let sw: &[L] = &[(4, 6_000, "sliding_window")];
    let seed = std::env::var("RLGW_BATCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(34);
    let mut rng = Rng::new(seed);
    let mut t: u64 = 1_800_000_000_000;
    let (mut reservations, mut allowed, mut denied) = (0, 0, 0);
    for round in 0..80 {
        let mut checks = Vec::new();
        for _ in 0..rng.range(1, 24) {
            let client = format!("c{}", rng.range(0, 3));
            let cost = rng.range(1, 3);
            let mut buckets: Vec<(&str, &str, &[L])> = Vec::new();
            let shape = rng.range(0, 4);
            if shape != 1 {
                buckets.push(("tb", &client, tb));
            }
            if shape >= 1 {
                buckets.push(("sw", &client, sw));
            }
            let mut body = request(domain, cost, &buckets);
            if rng.range(0, 2) == 0 {
                let q = quota(domain, "q", &client, 40, "hour", cost);
                body = with_quotas(body, &[q]);
            }
            if rng.range(0, 3) == 0 {
                reservations += 1;
                body["reservation"] = json!(format!("reservation-{reservations:06}"));
            }
            checks.push(body);
        }
        sync_policy();
        let body = batch_request(domain, checks.iter().map(as_check).collect());
        let parsed =
            ratelimit_gateway::protocol::parse_batch(&serde_json::to_vec(&body).unwrap()).unwrap();
        let resolved = current_policy().resolve_batch(&parsed).unwrap();
        let clock = Arc::new(FixedClock(t));
        let answers = batched
            .app
            .limiter
            .with_clock(clock.clone())
            .check_batch(&resolved)
            .await;
        let one_by_one = alone.app.limiter.with_clock(clock);
        assert_eq!(answers.len(), resolved.len());
        for (i, (req, answer)) in resolved.iter().zip(answers).enumerate() {
            let answer = answer.unwrap();
            let expected = one_by_one.check(req).await.unwrap();
            assert_eq!(
                serde_json::to_value(&answer).unwrap(),
                serde_json::to_value(&expected).unwrap(),
                "seed {seed}, round {round}, check {i}"
            );
            if answer.allowed {
                allowed += 1;
            } else {
                denied += 1;
            }
        }
        t += rng.range(0, 2500);
        if round % 20 == 19 {
            assert_eq!(
                redis_a.contents().unwrap(),
                redis_b.contents().unwrap(),
                "seed {seed}, round {round}"
            );
        }
    }
    println!("differential: {allowed} allowed, {denied} denied, {reservations} reservations");
    assert!(
        allowed > 100 && denied > 100,
        "{allowed} allowed, {denied} denied"
    );
    assert!(!redis_a.contents().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_check_of_a_batch_gets_its_own_quota_answer() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    let client = reqwest::Client::new();
    let domain = "batch-quota";
    let of = |who: &str, amount| {
        as_check(&quota_request(
            domain,
            &[quota(domain, "q", who, 2, "day", amount)],
        ))
    };
    let body = batch_request(
        domain,
        vec![of("alice", 2), of("bob", 1), of("alice", 1), of("bob", 1)],
    );
    let (status, answer) = batch(&client, &gw.url(), &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["version"], 3);
    let seen: Vec<(bool, bool, u64)> = answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let q = &r["quotas"][0];
            (
                r["allowed"].as_bool().unwrap(),
                q["allowed"].as_bool().unwrap(),
                q["remaining"].as_u64().unwrap(),
            )
        })
        .collect();
    // alice spends her quota, bob keeps his; alice's second check is denied
    // with what she had left (0), bob's passes.
    assert_eq!(
        seen,
        [
            (true, true, 0),
            (true, true, 1),
            (false, false, 0),
            (true, true, 0)
        ]
    );
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_checks_total{result=\"allowed\"}"
        )
        .await,
        3.0
    );
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_quota_denials_total{period=\"day\"}"
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&client, &gw.url(), "ratelimit_gateway_batch_checks_count").await,
        1.0
    );
    assert_eq!(
        metric(&client, &gw.url(), "ratelimit_gateway_batch_checks_sum").await,
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_are_exact_in_one_redis_call_each() {
    let redis = redis();
    let gw = gateway(Target::Single(redis.url()), 5000).await;
    let domain = "batch-exact";
    let mut rng = Rng::new(7);
    let checks = keys_and_a_hot_key(domain, &mut rng);
    let batches = checks.len().div_ceil(64) as f64;
    let allowed = allowed_per_name(&gw.url(), domain, checks, 64, 4).await;
    assert_exact(&allowed);
    let client = reqwest::Client::new();
    let base = gw.url();
    // One batch.lua call per batch at most (fewer when the deny cache
    // answered every check of one), and no check alone.
    let calls = redis_calls(&client, &base, "batch").await;
    assert!(
        calls >= 1.0 && calls <= batches,
        "{calls} calls for {batches} batches"
    );
    assert_eq!(redis_calls(&client, &base, "check").await, 0.0);
    assert_eq!(redis_calls(&client, &base, "peek").await, 0.0);
    assert_eq!(
        metric(&client, &base, "ratelimit_gateway_batch_checks_count").await,
        batches
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_batches_are_exact_per_slot_and_across_slots() {
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 5000).await;
    let domain = "batch-cluster";
    let mut rng = Rng::new(11);
    let mut checks = keys_and_a_hot_key(domain, &mut rng);
    // Checks whose two buckets hash to different slots: the per-check path.
    let three: &[L] = &[(3, 86_400_000, "token_bucket")];
    for p in 0..50 {
        let (left, right) = (format!("l{p}"), format!("r{p}"));
        for _ in 0..5 {
            let body = request(
                domain,
                1,
                &[("left", &left, three), ("right", &right, three)],
            );
            checks.push((format!("pair{p}"), body));
        }
    }
    let checks = shuffled(checks, &mut rng);
    let allowed = allowed_per_name(&gw.url(), domain, checks, 64, 4).await;
    assert_exact(&allowed);
    for p in 0..50 {
        assert_eq!(allowed.get(&format!("pair{p}")), Some(&3), "pair {p}");
    }
    let client = reqwest::Client::new();
    assert!(redis_calls(&client, &gw.url(), "batch").await >= 1.0);
    // Pairs in one slot are batched too; the others are checked alone.
    assert!(redis_calls(&client, &gw.url(), "check").await >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_over_the_key_budget_gets_its_error_and_the_others_are_decided() {
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 5000, |c| Config {
        key_budget: 2,
        ..c
    })
    .await;
    let client = reqwest::Client::new();
    let domain = "batch-budget";
    let limits: &[L] = &[(1, 60_000, "token_bucket")];
    let of = |who: &str| as_check(&request(domain, 1, &[("k", who, limits)]));
    let body = batch_request(domain, vec![of("a"), of("b"), of("c"), of("a"), of("b")]);
    let (status, answer) = batch(&client, &gw.url(), &body).await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().unwrap();
    let seen: Vec<(bool, Option<&str>)> = results
        .iter()
        .map(|r| (r["allowed"].as_bool().unwrap(), r["error"].as_str()))
        .collect();
    assert_eq!(
        seen,
        [
            (true, None),
            (true, None),
            (false, Some("key_budget")),
            (false, None),
            (false, None)
        ]
    );
    assert!(results[2].get("buckets").is_none(), "{answer}");
    assert_eq!(results[3]["buckets"][0]["limits"][0]["remaining"], 0);
    let refused = format!("ratelimit_gateway_key_budget_refusals_total{{domain=\"{domain}\"}}");
    assert_eq!(metric(&client, &gw.url(), &refused).await, 1.0);
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_errors_total{kind=\"key_budget\"}"
        )
        .await,
        1.0
    );
}

/// A gateway with tokens: `batch-a` may use domain `batch-a` only.
async fn with_tokens(redis: &testkit::redis::Redis, dir: &TempDir) -> Running {
    let tokens = write(
        dir.path(),
        "tokens",
        "batch-a token-of-batch-a-0123456789\n",
    );
    gateway_with(Target::Single(redis.url()), 5000, move |c| Config {
        auth: Auth::Tokens(tokens.into()),
        ..c
    })
    .await
}

const TOKEN_A: &str = "Bearer token-of-batch-a-0123456789";

/// Sends `head` (a request without its body) on a new connection and reads
/// the answer's status line.
fn status_without_body(port: u16, head: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(2).any(|w| w == b"\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    text.lines().next().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_batches_are_refused_whole_and_write_nothing() {
    let redis = redis();
    let dir = TempDir::new();
    let gw = with_tokens(&redis, &dir).await;
    let base = gw.url();
    let client = reqwest::Client::new();
    let limits: &[L] = &[(10, 60_000, "token_bucket")];
    let good = |k: u64| as_check(&request("batch-a", 1, &[("ra", &format!("c{k}"), limits)]));
    // Domain batch-b's rule, which batch-a's token may not name.
    let theirs = as_check(&request("batch-b", 1, &[("rb", "c1", limits)]));
    let post = |body: Value, token: Option<&'static str>| {
        let client = client.clone();
        let url = format!("{base}/v3/check");
        async move {
            sync_policy();
            let mut req = client.post(url).json(&body);
            if let Some(t) = token {
                req = req.header("authorization", t);
            }
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let batch_of = |bad: Value| {
        let mut checks: Vec<Value> = (0..64).map(good).collect();
        checks[37] = bad;
        batch_request("batch-a", checks)
    };
    // Something written first: "nothing written" is then a dump unchanged.
    let (status, answer) = post(batch_request("batch-a", vec![good(0)]), Some(TOKEN_A)).await;
    assert_eq!(status, 200, "{answer}");
    let before = redis.contents().unwrap();
    let size = dbsize(&redis);

    let (status, answer) = post(batch_of(theirs.clone()), Some(TOKEN_A)).await;
    assert_eq!(status, 400, "{answer}");
    let error = answer["error"].as_str().unwrap();
    assert!(error.starts_with("checks[37].buckets[0].rule: "), "{error}");

    let mut unknown = good(1);
    unknown["buckets"][0]["rule"] = json!("no-such-rule");
    let (status, answer) = post(batch_of(unknown), Some(TOKEN_A)).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .starts_with("checks[37].buckets[0].rule: "));

    let mut variant = good(1);
    variant["buckets"][0]["variant"] = json!("tier:no-such-tier");
    let (status, answer) = post(batch_of(variant), Some(TOKEN_A)).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .starts_with("checks[37].buckets[0].variant: "));

    // Domain batch-b with batch-a's token.
    let (status, answer) = post(
        batch_request("batch-b", vec![theirs.clone()]),
        Some(TOKEN_A),
    )
    .await;
    assert_eq!(status, 403, "{answer}");
    let (status, answer) = post(batch_request("batch-a", vec![good(2)]), None).await;
    assert_eq!(status, 401, "{answer}");

    let mut wrong = batch_request("batch-a", vec![good(2)]);
    wrong["version"] = json!(2);
    let (status, answer) = post(wrong, Some(TOKEN_A)).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(
        answer["error"],
        "version: unsupported version 2, expected 3"
    );

    // MAX_BATCH + 1 checks: 413.
    let n = ratelimit_gateway::protocol::MAX_BATCH + 1;
    let (status, answer) = post(batch_request("batch-a", vec![good(3); n]), Some(TOKEN_A)).await;
    assert_eq!(status, 413, "{answer}");
    assert_eq!(answer["error"], "checks: more than 256 checks");
    assert_eq!(redis.contents().unwrap(), before);
    assert_eq!(dbsize(&redis), size);

    // 10^5 checks, past the byte bound: 413 from the declared length, the
    // body unread (none is sent: a server waiting for it would answer 408).
    let huge = batch_request("batch-a", vec![good(3); 100_000])
        .to_string()
        .len();
    assert!(huge > ratelimit_gateway::protocol::MAX_BATCH_BYTES);
    let port = gw.addr.port();
    let line = tokio::task::spawn_blocking(move || {
        let head = format!(
            "POST /v3/check HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
             authorization: {TOKEN_A}\r\ncontent-length: {huge}\r\n\r\n"
        );
        status_without_body(port, &head)
    })
    .await
    .unwrap();
    assert_eq!(line, "HTTP/1.1 413 Payload Too Large");
    // Without a token: 401 before the body.
    let small = "POST /v3/check HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
                 content-length: 1000\r\n\r\n";
    let line = tokio::task::spawn_blocking(move || status_without_body(port, small))
        .await
        .unwrap();
    assert_eq!(line, "HTTP/1.1 401 Unauthorized");
    assert_eq!(redis.contents().unwrap(), before);
    // 400s and 413s counted as bad requests: three 400s of the policy, one
    // of the version, two 413s.
    assert_eq!(
        metric(
            &client,
            &base,
            "ratelimit_gateway_errors_total{kind=\"bad_request\"}"
        )
        .await,
        6.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_stopped_a_batch_is_503_and_resent_charges_once() {
    let mut redis = redis();
    let gw = gateway(Target::Single(redis.url()), 500).await;
    let client = reqwest::Client::new();
    let domain = "batch-down";
    let limits: &[L] = &[(3, 86_400_000, "token_bucket")];
    let checks: Vec<Value> = (0..10)
        .map(|i| {
            as_check(&request(
                domain,
                1,
                &[("k", &format!("c{}", i % 5), limits)],
            ))
        })
        .collect();
    let body = batch_request(domain, checks);
    redis.kill();
    let (status, answer) = batch(&client, &gw.url(), &body).await;
    assert_eq!(status, 503, "{answer}");
    assert_eq!(answer["error"], "redis: unavailable");

    redis.restart().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        let (status, answer) = batch(&client, &gw.url(), &body).await;
        if status == 200 {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 10 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Each key checked twice in the batch: 2 then 1 left, each allowed once
    // per check of the send that succeeded.
    for (i, r) in answer["results"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["allowed"], true, "{r}");
        let left = if i < 5 { 2 } else { 1 };
        assert_eq!(
            r["buckets"][0]["limits"][0]["remaining"], left,
            "check {i}: {r}"
        );
    }
    // What Redis holds: two charges per key, so one more check leaves 0.
    for k in 0..5 {
        let one = request(domain, 1, &[("k", &format!("c{k}"), limits)]);
        let (status, answer) = check(&client, &gw.url(), &one).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(limit(&answer, 0, 0)["remaining"], 0, "key c{k}: {answer}");
    }
}
