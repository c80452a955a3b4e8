//! The gateway against a real 3-master Redis Cluster.

mod common;

use common::*;
use ratelimit_gateway::redis::keys::{group_by_slot, limit_keys, quota_keys};
use ratelimit_gateway::Target;

const HOUR: u64 = 3_600_000;

fn groups(body: &serde_json::Value) -> usize {
    let req = resolve(body);
    group_by_slot(limit_keys("rl:", &req), quota_keys("rl:", &req)).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_exact_counts_and_cross_slot_all_or_nothing() {
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 2000).await;
    let client = reqwest::Client::new();

    // Exact counts, both algorithms, tags whose slots are on the three masters.
    for alg in ["token_bucket", "sliding_window"] {
        for tag in ["c=alice", "c=frank", "t=a"] {
            // A rule per algorithm: a policy rule counts one way.
            let rule = format!("per-client-{alg}");
            let body = request("demo", 1, &[(&rule, tag, &[(5, HOUR, alg)])]);
            for left in (0..5).rev() {
                let (status, resp) = check(&client, &gw.url(), &body).await;
                assert_eq!(status, 200, "{resp}");
                assert_eq!(resp["allowed"], true, "{alg} {tag}: {resp}");
                assert_eq!(limit(&resp, 0, 0)["remaining"], left);
            }
            let (_, resp) = check(&client, &gw.url(), &body).await;
            assert_eq!(resp["allowed"], false, "{alg} {tag}: {resp}");
            assert!(limit(&resp, 0, 0)["retry_after_ms"].as_u64().unwrap() > 0);
        }
    }
    // The keys live on more than one master.
    let sizes: Vec<String> = cluster.cli_each(&["dbsize"]).unwrap();
    let nonempty = sizes.iter().filter(|s| s.as_str() != "0").count();
    assert_eq!(nonempty, 3, "keys on {sizes:?}");

    // Different tags: different slots; a later slot that denies refunds the earlier one.
    for alg in ["token_bucket", "sliding_window"] {
        let domain = format!("x-{alg}");
        let wide: &[L] = &[(10, HOUR, alg)];
        let narrow: &[L] = &[(1, HOUR, alg)];
        let both = request(
            &domain,
            1,
            &[("wide", "t=a", wide), ("narrow", "t=b", narrow)],
        );
        assert_eq!(
            groups(&both),
            2,
            "the two tags must hash to different slots"
        );
        let (_, first) = check(&client, &gw.url(), &both).await;
        assert_eq!(first["allowed"], true, "{first}");
        let refunds_before = metric(&client, &gw.url(), "ratelimit_gateway_refunds_total").await;
        let (_, second) = check(&client, &gw.url(), &both).await;
        assert_eq!(second["allowed"], false, "{second}");
        assert_eq!(limit(&second, 0, 0)["allowed"], true, "{second}");
        assert_eq!(limit(&second, 0, 0)["remaining"], 8, "{second}");
        assert_eq!(limit(&second, 1, 0)["allowed"], false, "{second}");
        assert_eq!(
            metric(&client, &gw.url(), "ratelimit_gateway_refunds_total").await,
            refunds_before + 1.0
        );
        // The denying group first: nothing charged, the later group only peeked.
        let reversed = request(
            &domain,
            1,
            &[("narrow", "t=b", narrow), ("wide", "t=a", wide)],
        );
        let (_, third) = check(&client, &gw.url(), &reversed).await;
        assert_eq!(third["allowed"], false, "{third}");
        assert_eq!(limit(&third, 1, 0)["remaining"], 8, "{third}");
        // Only the first request was charged in the wide bucket.
        let only_wide = request(&domain, 1, &[("wide", "t=a", wide)]);
        let (_, fourth) = check(&client, &gw.url(), &only_wide).await;
        assert_eq!(fourth["allowed"], true);
        assert_eq!(limit(&fourth, 0, 0)["remaining"], 8, "{alg}: {fourth}");
    }

    // NOSCRIPT on every master: the next cross-slot check loads the scripts again.
    let reloads = "ratelimit_gateway_script_reloads_total";
    assert_eq!(metric(&client, &gw.url(), reloads).await, 0.0);
    for out in cluster.cli_each(&["script", "flush"]).unwrap() {
        assert_eq!(out, "OK");
    }
    let both = request(
        "ns",
        1,
        &[
            ("a", "t=a", &[(3, HOUR, "token_bucket")]),
            ("b", "t=b", &[(3, HOUR, "sliding_window")]),
        ],
    );
    let (status, resp) = check(&client, &gw.url(), &both).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["allowed"], true, "{resp}");
    assert!(metric(&client, &gw.url(), reloads).await >= 1.0);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_concurrent_cross_slot_refunds_are_exact() {
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 5000).await;
    let client = reqwest::Client::new();
    for alg in ["token_bucket", "sliding_window"] {
        let domain = format!("cc-{alg}");
        // Windows long enough that nothing refills during the test.
        let wide: &[L] = &[(10_000, 1000 * HOUR, alg)];
        let narrow: &[L] = &[(100, 1000 * HOUR, alg)];
        let both = request(
            &domain,
            1,
            &[("wide", "t=a", wide), ("narrow", "t=b", narrow)],
        );
        assert_eq!(groups(&both), 2);
        let (allowed, denied, other) = burst(&gw.url(), both, 64, 300).await;
        eprintln!("cluster {alg}: 64 clients, 300 cross-slot requests, limit 100: {allowed} allowed, {denied} denied, {other} errors");
        assert_eq!((allowed, denied, other), (100, 200, 0));
        // Every denied request was refunded in the wide bucket.
        let only_wide = request(&domain, 1, &[("wide", "t=a", wide)]);
        let (_, resp) = check(&client, &gw.url(), &only_wide).await;
        assert_eq!(
            limit(&resp, 0, 0)["remaining"],
            10_000 - 101,
            "{alg}: {resp}"
        );
    }
}
