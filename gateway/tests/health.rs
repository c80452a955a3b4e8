//! `/healthz` and `/readyz` answer from one Redis write probe per interval
//! (`ratelimit_gateway::http::health::EVERY`), shared by every caller: a flood of
//! unauthenticated health checks costs Redis one write a second, not one a
//! call, and the answer still follows Redis within that interval.

mod common;

use std::time::{Duration, Instant};

use common::{gateway, get, redis};
use ratelimit_gateway::Target;

/// `cmdstat_set:calls=N` of Redis's `INFO commandstats`.
fn set_calls(redis: &testkit::redis::Redis) -> u64 {
    let info = redis.cli(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_set:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_check_flood_writes_to_redis_once_an_interval_and_follows_redis() {
    let mut redis = redis();
    let gw = gateway(Target::Single(redis.url()), 2000).await;
    let client = reqwest::Client::new();
    let url = gw.url();
    assert_eq!(get(&client, &url, "/healthz").await.0, 200);
    redis.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let started = Instant::now();
    for round in 0..50 {
        let path = if round % 2 == 0 {
            "/healthz"
        } else {
            "/readyz"
        };
        let calls: Vec<_> = (0..10).map(|_| get(&client, &url, path)).collect();
        for (status, _) in futures_util::future::join_all(calls).await {
            assert_eq!(status, 200);
        }
    }
    let intervals = started.elapsed().as_millis() as u64 / 1000 + 1;
    let writes = set_calls(&redis);
    assert!(
        writes <= intervals,
        "500 health checks in {intervals} interval(s) made {writes} Redis writes"
    );
    redis.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, body) = get(&client, &gw.url(), "/healthz").await;
        if status == 503 {
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(body["redis"], "down", "{body}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still {status} 5 s after Redis died"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gw.stop().await.unwrap();
}
