//! Helpers shared by the gateway's integration tests: an in-process gateway
//! on a free port in front of a real Redis, requests and metrics.
#![allow(dead_code)]

use std::time::Duration;

use ratelimit_gateway::{Config, Running, Target};
use serde_json::{json, Value};

/// Starts a gateway in this runtime in front of `target`, with a generous
/// Redis timeout (debug builds on 2 cores under 64 concurrent clients).
pub async fn gateway(target: Target, timeout_ms: u64) -> Running {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        target,
        redis_timeout: Duration::from_millis(timeout_ms),
        key_prefix: "rl:".to_string(),
    };
    let running = ratelimit_gateway::start(config, Duration::from_secs(15))
        .await
        .unwrap();
    assert!(
        running
            .app
            .limiter
            .store()
            .wait_connected(Duration::from_secs(1))
            .await,
        "the gateway did not connect to Redis"
    );
    running
}

/// A limit: (requests, window_ms, algorithm).
pub type L = (u64, u64, &'static str);

/// A check request body with one or more buckets (key, tag, limits).
pub fn request(domain: &str, cost: u64, buckets: &[(&str, &str, &[L])]) -> Value {
    let buckets: Vec<Value> = buckets
        .iter()
        .map(|(key, tag, limits)| {
            let limits: Vec<Value> = limits
                .iter()
                .map(|(r, w, a)| json!({ "requests": r, "window_ms": w, "algorithm": a }))
                .collect();
            json!({ "key": key, "tag": tag, "limits": limits })
        })
        .collect();
    json!({ "version": 1, "domain": domain, "cost": cost, "buckets": buckets })
}

/// A lease request body for one bucket (key, tag, limits).
pub fn lease_request(
    domain: &str,
    key: &str,
    tag: &str,
    limits: &[L],
    want: u64,
    give_back: u64,
) -> Value {
    let limits: Vec<Value> = limits
        .iter()
        .map(|(r, w, a)| json!({ "requests": r, "window_ms": w, "algorithm": a }))
        .collect();
    json!({ "version": 1, "domain": domain, "key": key, "tag": tag,
            "limits": limits, "want": want, "return": give_back })
}

/// Posts to `/v1/lease`; the status and the JSON body.
pub async fn lease(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v1/lease"), body).await
}

/// Posts `body` as JSON to `url`; the status and the JSON answer.
async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let resp = client.post(url).json(body).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// A quota: `{key, tag, limit, period, amount}`.
pub fn quota(key: &str, tag: &str, limit: u64, period: &str, amount: u64) -> Value {
    json!({ "key": key, "tag": tag, "limit": limit, "period": period, "amount": amount })
}

/// `body` with `quotas` set.
pub fn with_quotas(mut body: Value, quotas: &[Value]) -> Value {
    body["quotas"] = Value::Array(quotas.to_vec());
    body
}

/// A request with only quotas (no bucket).
pub fn quota_request(domain: &str, quotas: &[Value]) -> Value {
    with_quotas(request(domain, 1, &[]), quotas)
}

/// `body.quotas[q]`.
pub fn quota_of(body: &Value, q: usize) -> &Value {
    &body["quotas"][q]
}

/// Posts to `/v1/check`; the status and the JSON body.
pub async fn check(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    post(client, &format!("{base}/v1/check"), body).await
}

/// Posts raw bytes to `/v1/check`.
pub async fn check_raw(client: &reqwest::Client, base: &str, body: &'static str) -> (u16, Value) {
    let resp = client
        .post(format!("{base}/v1/check"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap())
}

/// `GET path`: status and body text.
pub async fn get(client: &reqwest::Client, base: &str, path: &str) -> (u16, String) {
    let resp = client.get(format!("{base}{path}")).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// The value of one sample line of `/metrics` (name with labels, exactly as printed).
pub async fn metric(client: &reqwest::Client, base: &str, sample: &str) -> f64 {
    let (status, text) = get(client, base, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {sample} in\n{text}"))
}

/// `body.buckets[b].limits[l]`.
pub fn limit(body: &Value, b: usize, l: usize) -> &Value {
    &body["buckets"][b]["limits"][l]
}

/// Starts a single Redis, with the `make deps` hint on failure.
pub fn redis() -> testkit::redis::Redis {
    testkit::redis::Redis::start().unwrap_or_else(|e| panic!("{e:#}"))
}

/// Starts a 3-master Redis Cluster, with the `make deps` hint on failure.
pub fn redis_cluster() -> testkit::redis::RedisCluster {
    testkit::redis::RedisCluster::start().unwrap_or_else(|e| panic!("{e:#}"))
}

/// Sends `total` one-request tasks, at most `clients` at a time, each its own
/// HTTP request on its own connection; counts (allowed, denied, other).
pub async fn burst(base: &str, body: Value, clients: usize, total: usize) -> (u64, u64, u64) {
    let body = std::sync::Arc::new(body);
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let base = base.to_string();
        let body = body.clone();
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            let (mut a, mut d, mut o) = (0, 0, 0);
            while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < total {
                let (status, resp) = check(&client, &base, &body).await;
                match (status, resp["allowed"].as_bool()) {
                    (200, Some(true)) => a += 1,
                    (200, Some(false)) => d += 1,
                    _ => {
                        eprintln!("unexpected answer {status}: {resp}");
                        o += 1
                    }
                }
            }
            (a, d, o)
        }));
    }
    let mut sum = (0, 0, 0);
    for t in tasks {
        let (a, d, o) = t.await.unwrap();
        sum = (sum.0 + a, sum.1 + d, sum.2 + o);
    }
    sum
}

/// splitmix64: seeded, reproducible test input.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next() % items.len() as u64) as usize]
    }
}
