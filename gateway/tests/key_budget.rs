//! The key budget (`--key-budget`): a domain that would create more live
//! Redis keys than its budget is refused (503) for that domain only; its
//! existing keys keep working and other domains are unaffected. The attack:
//! one token creating fresh monthly quota keys until a `noeviction` Redis is
//! full, after which every domain got 503.

mod common;

use common::*;
use ratelimit_gateway::Target;
use serde_json::Value;

/// The limit and quota keys of `domain` in Redis (not its ledger), sorted.
fn keys_of(redis: &testkit::redis::Redis, domain: &str) -> Vec<String> {
    let listed = redis
        .cli(&["--raw", "KEYS", &format!("rl:{{{domain}|*")])
        .unwrap();
    let mut keys: Vec<String> = listed
        .lines()
        .filter(|k| !k.is_empty() && !k.ends_with("|live}"))
        .map(str::to_string)
        .collect();
    keys.sort_unstable();
    keys
}

fn month_quota(domain: &str, client: &str) -> Value {
    let c = format!("c={client}");
    quota_request(
        domain,
        &[quota(domain, &format!("m/{c}"), &c, 100, "month", 1)],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_at_its_key_budget_is_refused_and_others_are_not() {
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 2000, |mut c| {
        c.key_budget = 3;
        c
    })
    .await;
    let client = reqwest::Client::new();
    let base = gw.url();

    // Three fresh clients fill kb-a's budget.
    for c in ["1", "2", "3"] {
        let (status, body) = check(&client, &base, &month_quota("kb-a", c)).await;
        assert_eq!(
            (status, &body["allowed"]),
            (200, &Value::Bool(true)),
            "{body}"
        );
    }
    let before = redis.dump().unwrap();
    // A fourth would create a key past it: refused, nothing written.
    let (status, body) = check(&client, &base, &month_quota("kb-a", "4")).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(redis.dump().unwrap(), before, "a refused check wrote");
    // An existing client of kb-a keeps counting.
    let (status, body) = check(&client, &base, &month_quota("kb-a", "1")).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );
    // Another domain is unaffected.
    let (status, body) = check(&client, &base, &month_quota("kb-b", "4")).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );

    let a = keys_of(&redis, "kb-a");
    let names: Vec<&str> = a
        .iter()
        .map(|k| k.rsplit_once('|').map_or(k.as_str(), |(head, _)| head))
        .collect();
    assert_eq!(
        names,
        [
            "rl:{kb-a|c=1}|q|m/c=1|month",
            "rl:{kb-a|c=2}|q|m/c=2|month",
            "rl:{kb-a|c=3}|q|m/c=3|month",
        ]
    );
    assert_eq!(redis.cli(&["GET", &a[0]]).unwrap(), "2");
    // The ledgers: exactly the live keys, scored by their expiry.
    let ledger = redis
        .cli(&["--raw", "ZRANGE", "rl:{kb-a|live}", "0", "-1"])
        .unwrap();
    assert_eq!(ledger.lines().collect::<Vec<_>>(), a);
    let expiry = redis.cli(&["PEXPIRETIME", &a[0]]).unwrap();
    assert_eq!(
        redis.cli(&["ZSCORE", "rl:{kb-a|live}", &a[0]]).unwrap(),
        expiry
    );
    assert_eq!(
        redis.cli(&["PEXPIRETIME", "rl:{kb-a|live}"]).unwrap(),
        expiry
    );
    assert_eq!(redis.cli(&["ZCARD", "rl:{kb-b|live}"]).unwrap(), "1");

    let refused = "ratelimit_gateway_key_budget_refusals_total";
    assert_eq!(
        metric(&client, &base, &format!("{refused}{{domain=\"kb-a\"}}")).await,
        1.0
    );
    let text = get(&client, &base, "/metrics").await.1;
    assert!(
        !text.contains(&format!("{refused}{{domain=\"kb-b\"}}")),
        "{text}"
    );
    assert_eq!(
        metric(
            &client,
            &base,
            "ratelimit_gateway_errors_total{kind=\"key_budget\"}"
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_leave_the_budget() {
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 2000, |mut c| {
        c.key_budget = 1;
        c
    })
    .await;
    let client = reqwest::Client::new();
    let base = gw.url();
    let (status, _) = check(&client, &base, &month_quota("kb-e", "1")).await;
    assert_eq!(status, 200);
    let (status, _) = check(&client, &base, &month_quota("kb-e", "2")).await;
    assert_eq!(status, 503);
    // The first key expires (as Redis would at its period's end): its
    // ledger entry is trimmed by score, so a new client fits again.
    let first = keys_of(&redis, "kb-e").remove(0);
    redis.cli(&["ZADD", "rl:{kb-e|live}", "1", &first]).unwrap();
    redis.cli(&["DEL", &first]).unwrap();
    let (status, body) = check(&client, &base, &month_quota("kb-e", "2")).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );
    assert_eq!(redis.cli(&["ZCARD", "rl:{kb-e|live}"]).unwrap(), "1");
}

/// On a Redis Cluster the ledger is one per domain and slot, in that slot:
/// with `--key-budget 1` a slot holds 4 keys of a domain. One client's five
/// monthly quotas (one slot, its hash tag) fill it; another slot and another
/// domain are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_the_budget_is_per_domain_and_slot() {
    use ratelimit_gateway::redis::keys::LiveLedgers;
    use redis::cluster_routing::Slot;

    let cluster = redis_cluster();
    let gw = gateway_with(Target::Cluster(cluster.seeds()), 2000, |mut c| {
        c.key_budget = 1;
        c
    })
    .await;
    let client = reqwest::Client::new();
    let base = gw.url();
    let quotas = |domain: &str, names: &[&str]| {
        let qs: Vec<Value> = names
            .iter()
            .map(|n| quota(domain, &format!("{n}/c=x"), "c=x", 100, "month", 1))
            .collect();
        quota_request(domain, &qs)
    };
    let (status, body) = check(&client, &base, &quotas("kbc", &["m1", "m2", "m3", "m4"])).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );
    let (status, body) = check(&client, &base, &quotas("kbc", &["m5"])).await;
    assert_eq!(status, 503, "{body}");
    let (status, body) = check(&client, &base, &quotas("kbc", &["m1"])).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );
    let (status, body) = check(&client, &base, &quotas("kbc2", &["m5"])).await;
    assert_eq!(
        (status, &body["allowed"]),
        (200, &Value::Bool(true)),
        "{body}"
    );

    let slot = Slot::for_key("{kbc|c=x}");
    let ledger = LiveLedgers::new("rl:", "kbc").in_slot(slot);
    let members = cluster
        .cli(&["--raw", "ZRANGE", &ledger, "0", "-1"])
        .unwrap();
    let names: Vec<&str> = members
        .lines()
        .map(|k| k.rsplit_once('|').map_or(k, |(head, _)| head))
        .collect();
    assert_eq!(
        names,
        [
            "rl:{kbc|c=x}|q|m1/c=x|month",
            "rl:{kbc|c=x}|q|m2/c=x|month",
            "rl:{kbc|c=x}|q|m3/c=x|month",
            "rl:{kbc|c=x}|q|m4/c=x|month",
        ]
    );
    let refused = "ratelimit_gateway_key_budget_refusals_total{domain=\"kbc\"}";
    assert_eq!(metric(&client, &base, refused).await, 1.0);
}

/// A settlement that writes a key the ledger no longer holds (a bucket that
/// expired meanwhile, a quota's new period) puts it back in the ledger, so
/// the budget counts every live key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_settlement_creates_is_counted_in_the_budget() {
    add_policy(
        r#"{"domain": "kb-settle", "global": {"cluster": "gw"},
          "rules": [{"name": "tokens", "scope": "global", "key": ["client"],
                     "limits": [{"requests": 1000, "per": "1d"}]}],
          "costs": [{"match": {"path_prefix": "/"},
                     "cost_from": {"header": "x-usage", "max": 2000, "reserve": 100}}]}"#,
    );
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), 2000, |mut c| {
        c.key_budget = 10;
        c
    })
    .await;
    let client = reqwest::Client::new();
    let bucket = |cost: u64| {
        serde_json::json!({"rule": "tokens", "key": "tokens/c=ann", "tag": "c=ann",
                           "variant": "default", "cost": cost})
    };
    let id = "kbsettle00000001";
    let body = serde_json::json!({"version": 2, "domain": "kb-settle", "buckets": [bucket(100)],
                                  "reservation": id});
    let (status, a) = check(&client, &gw.url(), &body).await;
    assert_eq!((status, &a["allowed"]), (200, &Value::Bool(true)), "{a}");
    let keys: Vec<String> = keys_of(&redis, "kb-settle")
        .into_iter()
        .filter(|k| !k.contains("|r|"))
        .collect();
    let [key] = keys.as_slice() else {
        panic!("one bucket key besides the record: {keys:?}")
    };
    let ledger = "rl:{kb-settle|live}";
    // The bucket expires and the ledger forgets it.
    redis.cli(&["DEL", key]).unwrap();
    redis.cli(&["ZREM", ledger, key]).unwrap();
    let settlement = serde_json::json!({"version": 2, "domain": "kb-settle",
        "settlements": [{"reservation": id, "buckets": [bucket(500)]}]});
    let (status, r) = settle(&client, &gw.url(), &settlement).await;
    assert_eq!(
        (status, &r["settled"]),
        (200, &serde_json::json!([true])),
        "{r}"
    );
    assert!(
        redis.cli(&["--raw", "GET", key]).unwrap().contains(':'),
        "the settlement wrote it"
    );
    let score = redis.cli(&["--raw", "ZSCORE", ledger, key]).unwrap();
    assert!(!score.trim().is_empty(), "the ledger counts {key} again");
    gw.stop().await.unwrap();
}
