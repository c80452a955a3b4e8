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

/// A reservation spanning two slots keeps a record in each: a settlement
/// naming the buckets of one slot settles that slot and leaves the other's
/// record for its own settlement; each applies once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_settlements_find_the_record_of_their_slot() {
    add_policy(
        r#"{"domain": "settle-cluster", "global": {"cluster": "gw"},
          "rules": [
            {"name": "by-client", "scope": "global", "key": ["client"], "limits": [{"requests": 1000, "per": "1d"}]},
            {"name": "by-method", "scope": "global", "key": ["method"], "limits": [{"requests": 1000, "per": "1d"}]}],
          "costs": [{"match": {"path_prefix": "/"}, "cost_from": {"header": "x-usage", "max": 2000, "reserve": 100}}],
          "quotas": [{"name": "monthly", "key": ["client"], "period": "month", "limit": 100000,
                      "count": "cost", "upgrade_url": "https://example.com/up"}]}"#,
    );
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 2000).await;
    let client = reqwest::Client::new();
    let bucket = |rule: &str, tag: &str, cost: u64| {
        serde_json::json!({"rule": rule, "key": format!("{rule}/{tag}"), "tag": tag,
                           "variant": "default", "cost": cost})
    };
    let quota = |amount: u64| {
        serde_json::json!({"quota": "monthly", "key": "monthly/c=alice", "tag": "c=alice",
                           "variant": "default", "amount": amount})
    };
    let check_body = |cost: u64, id: Option<&str>| {
        let mut b = serde_json::json!({"version": 2, "domain": "settle-cluster",
            "buckets": [bucket("by-client", "c=alice", cost), bucket("by-method", "m=GET", cost)],
            "quotas": [quota(cost)]});
        if let Some(id) = id {
            b["reservation"] = id.into();
        }
        b
    };
    let id = "cluster0000000001";
    assert_eq!(groups(&check_body(100, None)), 2, "two slots");
    let (status, a) = check(&client, &gw.url(), &check_body(100, Some(id))).await;
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    let batch = |settlement: serde_json::Value| serde_json::json!({"version": 2, "domain": "settle-cluster", "settlements": [settlement]});
    // The method's slot only: 400 of it.
    let only_method = batch(serde_json::json!({"reservation": id,
        "buckets": [bucket("by-method", "m=GET", 400)]}));
    let (_, r) = settle(&client, &gw.url(), &only_method).await;
    assert_eq!(r["settled"], serde_json::json!([true]), "{r}");
    // The client's slot (its bucket and the quota): 250, once.
    let client_slot = batch(serde_json::json!({"reservation": id,
        "buckets": [bucket("by-client", "c=alice", 250)], "quotas": [quota(250)]}));
    for want in [true, false] {
        let (_, r) = settle(&client, &gw.url(), &client_slot).await;
        assert_eq!(r["settled"], serde_json::json!([want]), "{r}");
    }
    let (_, r) = settle(&client, &gw.url(), &only_method).await;
    assert_eq!(r["settled"], serde_json::json!([false]), "replayed: {r}");
    // A check of 1 reads what is left: 1000 - 250 - 1 and 1000 - 400 - 1.
    let (_, a) = check(&client, &gw.url(), &check_body(1, None)).await;
    assert_eq!(limit(&a, 0, 0)["remaining"], 749, "{a}");
    assert_eq!(limit(&a, 1, 0)["remaining"], 599, "{a}");
    assert_eq!(a["quotas"][0]["remaining"], 100_000 - 251, "{a}");
    gw.stop().await.unwrap();
}

/// A concurrency slot in one cluster slot and a limit in another: when the
/// other limit denies, the concurrency slot the check took is given back
/// (refund.lua, under the check's record), so the set holds only the
/// requests really in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_concurrency_slots_are_given_back_when_another_slot_denies() {
    add_policy(
        r#"{"domain": "inflight-cluster", "global": {"cluster": "gw"},
          "rules": [
            {"name": "streams", "scope": "global", "key": ["client"], "limits": [{"concurrent": 2}]},
            {"name": "by-method", "scope": "global", "key": ["method"], "limits": [{"requests": 1, "per": "1d"}]}]}"#,
    );
    let cluster = redis_cluster();
    let gw = gateway(Target::Cluster(cluster.seeds()), 2000).await;
    let client = reqwest::Client::new();
    let bucket = |rule: &str, tag: &str| {
        serde_json::json!({"rule": rule, "key": format!("{rule}/{tag}"), "tag": tag,
                           "variant": "default", "cost": 1})
    };
    let body = |id: &str, method: bool| {
        let mut buckets = vec![bucket("streams", "c=alice")];
        if method {
            buckets.push(bucket("by-method", "m=GET"));
        }
        serde_json::json!({"version": 2, "domain": "inflight-cluster", "buckets": buckets,
                           "reservation": id})
    };
    assert_eq!(groups(&body("inflight00000001", true)), 2, "two slots");
    let (status, a) = check(&client, &gw.url(), &body("inflight00000001", true)).await;
    assert_eq!((status, a["allowed"].as_bool()), (200, Some(true)), "{a}");
    assert_eq!(limit(&a, 0, 0)["remaining"], 1, "{a}");
    // by-method is spent: denied, and the slot of streams it may have taken is given back.
    let (_, a) = check(&client, &gw.url(), &body("inflight00000002", true)).await;
    assert_eq!(a["allowed"].as_bool(), Some(false), "{a}");
    // One slot held (the first check's): one more fits, then none.
    let (_, a) = check(&client, &gw.url(), &body("inflight00000003", false)).await;
    assert_eq!(
        (a["allowed"].as_bool(), &limit(&a, 0, 0)["remaining"]),
        (Some(true), &serde_json::json!(0)),
        "{a}"
    );
    let (_, a) = check(&client, &gw.url(), &body("inflight00000004", false)).await;
    assert_eq!(a["allowed"].as_bool(), Some(false), "{a}");
    gw.stop().await.unwrap();
}
