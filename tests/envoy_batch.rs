//! Coalesced global checks end to end: two real Envoys (`--concurrency 2`,
//! the filter's default `global.coalesce_us`), the `ratelimit-gateway`
//! binary and a real `redis-server` (one, or a Cluster of three masters).
//! Under load from 64 keep-alive connections spread over both proxies, a
//! worker's checks go in batches (`POST /v3/check`), and the limits still
//! hold to the request.
//!
//! Nothing is skipped: without Envoy, the wasm file, the gateway binary or
//! `redis-server`, the tests fail and say what to build or install.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};
use testkit::redis::{Redis, RedisCluster};
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions, Request};

/// Connections, over both proxies: each thread keeps one.
const CONNECTIONS: usize = 64;

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// One global rule `per-key` of `limit` an hour on the `x-key` header.
fn config(domain: &str, limit: u64) -> String {
    json!({
        "domain": domain,
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "global": { "cluster": "ratelimit_gateway", "timeout_ms": 2000, "failure_mode": "closed",
                    "instances": 2 },
        "rules": [{ "name": "per-key", "scope": "global", "key": ["header:x-key"],
                    "limits": [{ "requests": limit, "per": "1h" }] }]
    })
    .to_string()
}

/// A gateway filed with `policy` on `opts`' Redis, and two Envoys calling it.
fn rig(opts: GatewayOptions, policy: &str) -> (Gateway, Vec<Envoy>) {
    rig_on(opts, policy, None)
}

/// As [`rig`], with `global.transport: grpc`: the gateway also serves its
/// gRPC listener, and the Envoys' `ratelimit_gateway` cluster speaks HTTP/2
/// to it.
fn rig_grpc(opts: GatewayOptions, policy: &str) -> (Gateway, Vec<Envoy>) {
    let mut policy: Value = serde_json::from_str(policy).unwrap();
    policy["global"]["transport"] = json!("grpc");
    let grpc = ok(testkit::free_port().map_err(Into::into), "picking a port");
    rig_on(opts, &policy.to_string(), Some(grpc))
}

/// [`rig`]'s gateway and Envoys; with `grpc`, the gateway also listens for
/// gRPC on that port, and the Envoys call it there over HTTP/2.
fn rig_on(opts: GatewayOptions, policy: &str, grpc: Option<u16>) -> (Gateway, Vec<Envoy>) {
    // A debug gateway on a busy 2-core machine: Redis may take more than 20 ms.
    let mut opts = opts
        .policy(policy.to_string())
        .args(&["--redis-timeout-ms", "500"]);
    if let Some(port) = grpc {
        opts = opts.args(&["--grpc-listen", &format!("127.0.0.1:{port}")]);
    }
    let gateway = ok(Gateway::start(opts), "starting ratelimit-gateway");
    let envoy = EnvoyOptions::new(policy.to_string());
    let envoy = match grpc {
        Some(port) => envoy.gateway_port(port).gateway_http2(),
        None => envoy.gateway_port(gateway.port()),
    };
    let envoys = ok(
        Envoy::start_all(&[envoy.clone(), envoy]),
        "starting two Envoys",
    );
    (gateway, envoys)
}

/// Sends one request per entry of `keys` (in that order) from
/// [`CONNECTIONS`] threads, each on its own keep-alive connection to proxy
/// `thread % 2`; counts the answers per key and status.
fn load(envoys: &[Envoy], keys: &[String]) -> BTreeMap<String, BTreeMap<u16, usize>> {
    let next = AtomicUsize::new(0);
    let counts: Mutex<BTreeMap<String, BTreeMap<u16, usize>>> = Mutex::default();
    std::thread::scope(|s| {
        for t in 0..CONNECTIONS {
            let (next, counts) = (&next, &counts);
            let url = envoys[t % envoys.len()].url("");
            s.spawn(move || {
                let client = Client::new(url, ConnectionMode::KeepAlive);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(key) = keys.get(i) else { break };
                    let req = Request::get("/").header("x-key", key);
                    let r = client
                        .send(&req)
                        .unwrap_or_else(|e| panic!("request {i} ({key}): {e:#}"));
                    let mut c = counts.lock().unwrap();
                    *c.entry(key.clone())
                        .or_default()
                        .entry(r.status)
                        .or_default() += 1;
                }
            });
        }
    });
    counts.into_inner().unwrap()
}

/// The filter's counter `name`, summed over the proxies.
fn summed(envoys: &[Envoy], name: &str) -> u64 {
    ok(Envoy::summed(envoys, name), "reading /stats/prometheus")
}

/// Prints and returns the batch calls per request of a run of `requests`.
fn callouts_per_request(envoys: &[Envoy], requests: usize, what: &str) -> f64 {
    let batches = summed(envoys, "ratelimit_wasm_global_batches");
    let checks = summed(envoys, "ratelimit_wasm_global_calls");
    let per = batches as f64 / requests as f64;
    println!(
        "{what}: {requests} requests, {checks} checks to the gateway in {batches} batch calls: \
         {per:.3} callouts per request, {:.1} checks per call",
        checks as f64 / batches.max(1) as f64
    );
    per
}

/// `per_key` requests for each of `n` keys, interleaved so that the keys'
/// requests arrive together.
fn interleaved(n: usize, per_key: usize) -> Vec<String> {
    let mut keys = Vec::new();
    for _ in 0..per_key {
        keys.extend((0..n).map(|k| format!("key-{k:04}")));
    }
    keys
}

/// Every key admitted exactly `limit` times and denied the rest, nothing else.
fn assert_exact(counts: &BTreeMap<String, BTreeMap<u16, usize>>, limit: usize, per_key: usize) {
    for (key, statuses) in counts {
        let expected: BTreeMap<u16, usize> = [(200, limit), (429, per_key - limit)]
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect();
        assert_eq!(statuses, &expected, "{key}");
    }
}

#[test]
fn one_hot_key_from_64_connections_over_two_proxies_admits_exactly_500() {
    let redis = ok(Redis::start(), "starting redis-server");
    let policy = config("batch-hot", 500);
    let (gateway, envoys) = rig(GatewayOptions::new(redis.url()), &policy);
    hot_key_admits_exactly_500(&gateway, &envoys, "one hot key");
}

/// 1,200 requests of one key at 500 an hour: exactly 500 admitted, by the
/// proxies and by the gateway's count, in fewer calls than checks.
fn hot_key_admits_exactly_500(gateway: &Gateway, envoys: &[Envoy], what: &str) {
    let keys = vec!["hot".to_string(); 1200];
    let counts = load(envoys, &keys);
    assert_exact(&counts, 500, 1200);
    callouts_per_request(envoys, keys.len(), what);
    assert!(
        summed(envoys, "ratelimit_wasm_global_batches")
            < summed(envoys, "ratelimit_wasm_global_calls")
    );
    let allowed = ok(
        gateway.metric("ratelimit_gateway_checks_total{result=\"allowed\"}"),
        "reading the gateway's /metrics",
    );
    assert_eq!(allowed, Some(500.0));
}

#[test]
fn over_grpc_one_hot_key_admits_exactly_500_and_a_gateway_gone_fails_closed() {
    let redis = ok(Redis::start(), "starting redis-server");
    let policy = config("batch-grpc", 500);
    let (mut gateway, envoys) = rig_grpc(GatewayOptions::new(redis.url()), &policy);
    hot_key_admits_exactly_500(&gateway, &envoys, "one hot key over gRPC");
    // Nothing listens: Envoy closes the call UNAVAILABLE, a failure (closed: 503).
    gateway.kill();
    let client = Client::new(envoys[0].url(""), ConnectionMode::NewPerRequest);
    let r = ok(
        client.send(&Request::get("/").header("x-key", "other")),
        "with the gateway gone",
    );
    assert_eq!(r.status, 503, "{r:#?}");
    assert_eq!(summed(&envoys, "ratelimit_wasm_global_failures"), 1);
}

/// A gRPC callout to a cluster Envoy does not have: the call fails to start
/// or fails at once, each request takes the failure mode (closed: 503), and
/// the filter goes on (a trap would fail every later request instead).
#[test]
fn over_grpc_an_unknown_cluster_fails_each_request_closed_and_the_filter_lives() {
    let mut policy: Value = serde_json::from_str(&config("batch-grpc-nowhere", 5)).unwrap();
    policy["global"]["transport"] = json!("grpc");
    policy["global"]["cluster"] = json!("no_such_cluster");
    let policy = policy.to_string();
    let envoy = ok(Envoy::start(EnvoyOptions::new(policy)), "starting Envoy");
    let client = Client::new(envoy.url(""), ConnectionMode::KeepAlive);
    for i in 0..3 {
        let r = ok(
            client.send(&Request::get("/").header("x-key", "k")),
            "a request",
        );
        assert_eq!(r.status, 503, "request {i}: {r:#?}");
    }
    assert!(
        !envoy.log_tail(200).contains("panicked"),
        "{}",
        envoy.log_tail(60)
    );
}

#[test]
fn a_thousand_keys_at_three_each_admit_exactly_three_per_key_in_few_calls() {
    let redis = ok(Redis::start(), "starting redis-server");
    // The tests' debug gateway answers in 1 to 3 ms on a busy 2-core machine:
    // with the default 500 µs, a check that waited that long would go in a
    // call of its own. The bench measures the default on a release build.
    let mut policy: Value = serde_json::from_str(&config("batch-keys", 3)).unwrap();
    policy["global"]["coalesce_us"] = json!(20000);
    let policy = policy.to_string();
    let (_gateway, envoys) = rig(GatewayOptions::new(redis.url()), &policy);
    let keys = interleaved(1000, 4);
    let counts = load(&envoys, &keys);
    assert_eq!(counts.len(), 1000);
    assert_exact(&counts, 3, 4);
    let per = callouts_per_request(&envoys, keys.len(), "1,000 keys");
    assert!(per < 0.2, "{per:.3} callouts per request");
}

#[test]
fn on_a_three_master_cluster_each_key_admits_exactly_its_limit() {
    let cluster = ok(RedisCluster::start(), "starting a Redis Cluster");
    let policy = config("batch-cluster", 3);
    let (gateway, envoys) = rig(GatewayOptions::cluster(&cluster.seeds()), &policy);
    let keys = interleaved(600, 4);
    let counts = load(&envoys, &keys);
    assert_eq!(counts.len(), 600);
    if counts.values().any(|c| c.contains_key(&503)) {
        println!("gateway log:\n{}", gateway.log_tail(40));
    }
    assert_exact(&counts, 3, 4);
    callouts_per_request(&envoys, keys.len(), "600 keys on a Cluster");
    // The keys are spread over the masters.
    let sizes: Vec<String> = ok(cluster.cli_each(&["dbsize"]), "dbsize");
    let holding = sizes
        .iter()
        .filter(|s| s.trim().parse::<u64>().unwrap_or(0) > 0)
        .count();
    assert_eq!(holding, 3, "{sizes:?}");
}

#[test]
fn checks_of_a_spent_quota_and_an_open_one_in_one_batch_get_their_own_answers() {
    let redis = ok(Redis::start(), "starting redis-server");
    let mut policy: Value = serde_json::from_str(&config("batch-quota", 1_000)).unwrap();
    policy["quotas"] = json!([{ "name": "monthly", "key": ["header:x-key"], "period": "month",
                                "limit": 2, "upgrade_url": "https://example.com/upgrade" }]);
    let policy = policy.to_string();
    let (_gateway, envoys) = rig(GatewayOptions::new(redis.url()), &policy);
    // "spent" uses its quota of 2 first; then it and 40 fresh keys arrive together.
    let first = load(&envoys, &vec!["spent".to_string(); 2]);
    assert_eq!(first["spent"], BTreeMap::from([(200, 2)]));
    let mut keys = Vec::new();
    for k in 0..40 {
        keys.push(format!("fresh-{k:02}"));
        if k % 5 < 3 {
            keys.push("spent".to_string());
        }
    }
    let counts = load(&envoys, &keys);
    assert_eq!(counts["spent"], BTreeMap::from([(403, 24)]));
    for k in 0..40 {
        assert_eq!(counts[&format!("fresh-{k:02}")], BTreeMap::from([(200, 1)]));
    }
    assert!(summed(&envoys, "ratelimit_wasm_global_batches") < 66);
}

/// The gateway killed while batches are in flight: each check takes the
/// failure mode (closed: 503) and nothing is charged twice. After a restart
/// on the same Redis, the bucket holds exactly what the admitted requests
/// took, plus at most the checks of the batches that were in flight when
/// it died (one per connection): those ran in Redis, but their answers were
/// lost, and the filter never sends a check again.
#[test]
fn the_gateway_killed_mid_batch_fails_each_check_closed_and_charges_nothing_twice() {
    const LIMIT: u64 = 100_000;
    let redis = ok(Redis::start(), "starting redis-server");
    let mut policy: Value = serde_json::from_str(&config("batch-kill", LIMIT)).unwrap();
    policy["global"]["circuit"] = json!({ "failures": 3, "cooldown_ms": 300 });
    // Under a token a minute refills: what the bucket holds is what was charged.
    policy["rules"][0]["limits"][0]["per"] = json!("366d");
    let policy = policy.to_string();
    let (mut gateway, envoys) = rig(GatewayOptions::new(redis.url()), &policy);
    let keys = vec!["hot".to_string(); 3000];
    let counts = std::thread::scope(|s| {
        let loaded = s.spawn(|| load(&envoys, &keys));
        // Kill it once the load is well under way.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while summed(&envoys, "ratelimit_wasm_global_calls") < 500 {
            assert!(
                std::time::Instant::now() < deadline,
                "the load did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        gateway.kill();
        loaded.join().unwrap()
    });
    let statuses = &counts["hot"];
    let admitted = statuses.get(&200).copied().unwrap_or(0) as u64;
    let failed = statuses.get(&503).copied().unwrap_or(0);
    assert_eq!(admitted as usize + failed, 3000, "{statuses:?}");
    assert!(admitted >= 500 && failed > 0, "{statuses:?}");
    ok(gateway.restart(), "restarting the gateway");
    std::thread::sleep(std::time::Duration::from_millis(400));
    // The next admission shows what the bucket holds.
    let client = Client::new(envoys[0].url(""), ConnectionMode::NewPerRequest);
    let r = ok(
        client.send(&Request::get("/").header("x-key", "hot")),
        "after the restart",
    );
    assert_eq!(r.status, 200, "{r:#?}");
    let charged = LIMIT - 1 - r.int_header("x-ratelimit-remaining");
    println!(
        "gateway killed: {admitted} admitted, {failed} failed closed, {charged} charged in Redis"
    );
    assert!(
        (admitted..=admitted + CONNECTIONS as u64).contains(&charged),
        "{charged} charged for {admitted} admitted"
    );
}
