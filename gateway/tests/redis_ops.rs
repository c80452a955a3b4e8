//! Production Redis, against real processes: TLS with a password
//! and a wrong CA, an ACL user with only `ACL_COMMANDS`, a Redis turned
//! replica (`REPLICAOF`), a full Redis under `noeviction`, a Sentinel
//! failover, a Cluster failover, and the password in no `--help`, log or
//! error body.

mod common;

use std::time::{Duration, Instant};

use ratelimit_gateway::redis::url::{RedisOptions, RedisTls, Secret};
use ratelimit_gateway::{Config, Running, Target};
use serde_json::{json, Value};
use testkit::pki::TestPki;
use testkit::redis::{Redis, RedisCluster, RedisSentinels};

use common::*;

const PASSWORD: &str = "s3cretpw-9f1c";

/// The limits these tests use, `n<N>` = N per day (no refill to speak of
/// within a test, so counts are exact), a monthly quota of 2, and a domain
/// in lease mode; written once per process.
fn policy() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("rlgw-redis-ops-policy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let global = json!({ "cluster": "gw", "failure_mode": "closed" });
        let rules: Vec<Value> = [1, 2, 3, 4, 5, 30]
            .iter()
            .map(|n| {
                json!({ "name": format!("n{n}"), "scope": "global", "key": ["client"],
                            "limits": [ { "requests": n, "per": "1d" } ] })
            })
            .collect();
        let ops = json!({ "domain": "ops", "global": global, "rules": rules,
            "quotas": [ { "name": "q2", "key": ["client"], "period": "month", "limit": 2,
                          "upgrade_url": "https://example.com/upgrade" } ] });
        let mut leased = global.clone();
        leased["lease"] = json!({ "fraction": 0.5 });
        let lease = json!({ "domain": "opslease", "global": leased,
            "rules": [ { "name": "l10", "scope": "global", "key": ["client"],
                         "limits": [ { "requests": 10, "per": "1m" } ] } ] });
        std::fs::write(dir.join("ops.json"), ops.to_string()).unwrap();
        std::fs::write(dir.join("opslease.json"), lease.to_string()).unwrap();
        dir
    })
    .clone()
}

/// An in-process gateway in front of `target` with `redis` options and [`policy`].
async fn gateway_with(target: Target, redis: RedisOptions, timeout_ms: u64) -> Running {
    let config = Config {
        target,
        redis,
        redis_timeout: Duration::from_millis(timeout_ms),
        ..Config::single(
            "127.0.0.1:0".parse().unwrap(),
            String::new(),
            vec![policy()],
        )
    };
    ratelimit_gateway::start(config, Duration::from_secs(10))
        .await
        .unwrap()
}

/// [`gateway_with`], asserting that it reaches Redis within 5 s.
async fn connected_gateway(target: Target, redis: RedisOptions, timeout_ms: u64) -> Running {
    let gw = gateway_with(target, redis, timeout_ms).await;
    assert!(connects(&gw, Duration::from_secs(5)).await);
    gw
}

/// Whether `gw` reaches Redis `within`.
async fn connects(gw: &Running, within: Duration) -> bool {
    gw.app.limiter.store().wait_connected(within).await
}

/// A check of cost 1 on rule `n<n>` (n per day) for client `who`, hash tag `tag`.
fn daily(who: &str, tag: &str, n: u64) -> Value {
    json!({ "version": 2, "domain": "ops", "buckets": [ { "rule": format!("n{n}"),
        "key": format!("n{n}/{who}"), "tag": tag, "variant": "default", "cost": 1 } ] })
}

/// Sends `n` checks one after the other: (allowed, denied, other statuses).
async fn checks(client: &reqwest::Client, base: &str, body: &Value, n: usize) -> (u64, u64, u64) {
    let (mut a, mut d, mut o) = (0, 0, 0);
    for _ in 0..n {
        match check(client, base, body).await {
            (200, v) if v["allowed"] == true => a += 1,
            (200, _) => d += 1,
            _ => o += 1,
        }
    }
    (a, d, o)
}

/// Polls `ok` every 10 ms until true; the time it took, or a panic after `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut ok: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if ok().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn tls_options(pki: &TestPki) -> RedisOptions {
    RedisOptions {
        tls: RedisTls {
            ca: Some(pki.ca()),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_over_tls_with_a_password_mutual_tls_and_a_wrong_ca_refused() {
    let pki = TestPki::new(&["127.0.0.1", "localhost"]).unwrap();
    let redis = Redis::start_tls(&pki.server_cert(), &pki.server_key(), &pki.ca()).unwrap();
    redis
        .cli(&["CONFIG", "SET", "requirepass", PASSWORD])
        .unwrap();
    let auth = ["-a", PASSWORD, "--no-auth-warning"];
    let url = redis
        .tls_url()
        .unwrap()
        .replace("rediss://", &format!("rediss://:{PASSWORD}@"));
    let client = reqwest::Client::new();
    let body = daily("k", "t", 3);

    let gw = connected_gateway(Target::Single(url.clone()), tls_options(&pki), 2000).await;
    assert_eq!(checks(&client, &gw.url(), &body, 5).await, (3, 2, 0));
    assert_eq!(get(&client, &gw.url(), "/healthz").await.0, 200);
    // The state is on the TLS server: one bucket key, the domain's ledger
    // of live keys and the health key.
    let keys = redis.cli(&[&auth[..], &["KEYS", "rl:*"]].concat()).unwrap();
    assert_eq!(keys.lines().count(), 3, "{keys}");
    gw.stop().await.unwrap();

    // Mutual TLS: once the server demands a client certificate, only a
    // gateway with --redis-tls-cert/--redis-tls-key gets in.
    redis
        .cli(&[&auth[..], &["CONFIG", "SET", "tls-auth-clients", "yes"]].concat())
        .unwrap();
    let mut mtls = tls_options(&pki);
    mtls.tls.cert = Some(pki.client_cert());
    mtls.tls.key = Some(pki.client_key());
    let gw = connected_gateway(Target::Single(url.clone()), mtls, 2000).await;
    assert_eq!(
        checks(&client, &gw.url(), &daily("m", "t", 2), 3).await,
        (2, 1, 0)
    );
    gw.stop().await.unwrap();
    let gw = gateway_with(Target::Single(url.clone()), tls_options(&pki), 2000).await;
    assert!(!connects(&gw, Duration::from_millis(1500)).await);
    assert_eq!(check(&client, &gw.url(), &body).await.0, 503);
    gw.stop().await.unwrap();

    // A CA the server's certificate does not chain to: refused, and said so.
    let other = TestPki::new(&["127.0.0.1"]).unwrap();
    let mut wrong = tls_options(&other);
    wrong.tls.cert = Some(pki.client_cert());
    wrong.tls.key = Some(pki.client_key());
    let gw = gateway_with(Target::Single(url), wrong, 2000).await;
    assert!(!connects(&gw, Duration::from_millis(1500)).await);
    let (status, text) = get(&client, &gw.url(), "/healthz").await;
    assert_eq!(status, 503, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        serde_json::json!({"status": "unavailable", "redis": "down"})
    );
    let (status, answer) = check(&client, &gw.url(), &body).await;
    assert_eq!(
        (status, answer["error"].as_str()),
        (503, Some("redis: unavailable"))
    );
    let why = gw.app.limiter.store().last_error().unwrap_or_default();
    assert!(
        why.contains("invalid peer certificate") && why.contains("not trusted"),
        "{why}"
    );
    assert!(!why.contains(PASSWORD), "{why}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_with_only_the_acl_commands_checks_leases_and_answers_health() {
    let redis = redis();
    let mut setuser = vec![
        "ACL",
        "SETUSER",
        "ratelimit",
        "on",
        ">acl-pw-77",
        "resetkeys",
        "~rl:*",
        "resetchannels",
        "-@all",
    ];
    let grants: Vec<String> = ratelimit_gateway::redis::store::ACL_COMMANDS
        .iter()
        .map(|c| format!("+{c}"))
        .collect();
    setuser.extend(grants.iter().map(String::as_str));
    assert_eq!(redis.cli(&setuser).unwrap(), "OK");
    // The user can do nothing else: a key outside the prefix is refused.
    let refused = redis.cli(&[
        "--user",
        "ratelimit",
        "--pass",
        "acl-pw-77",
        "--no-auth-warning",
        "SET",
        "other",
        "1",
    ]);
    assert!(format!("{refused:?}").contains("NOPERM"), "{refused:?}");

    let opts = RedisOptions {
        username: Some("ratelimit".into()),
        password: Some(Secret::new("acl-pw-77")),
        ..Default::default()
    };
    let gw = connected_gateway(Target::Single(redis.url()), opts, 2000).await;
    let client = reqwest::Client::new();
    assert_eq!(get(&client, &gw.url(), "/healthz").await.0, 200);
    assert_eq!(
        checks(&client, &gw.url(), &daily("k", "t", 4), 6).await,
        (4, 2, 0)
    );
    let quota = json!({ "version": 2, "domain": "ops", "quotas": [ { "quota": "q2",
        "key": "q2/a", "tag": "t", "variant": "default", "amount": 1 } ] });
    assert_eq!(checks(&client, &gw.url(), &quota, 3).await, (2, 1, 0));
    let want = json!({ "version": 2, "domain": "opslease", "rule": "l10", "key": "l10/a",
        "tag": "t", "variant": "default", "want": 4 });
    let (status, answer) = lease(&client, &gw.url(), &want).await;
    assert_eq!(
        (status, answer["granted"].as_u64()),
        (200, Some(4)),
        "{answer}"
    ); // Scripts were loaded by this user (SCRIPT LOAD), and NOSCRIPT recovers.
    redis.cli(&["SCRIPT", "FLUSH"]).unwrap();
    assert_eq!(
        checks(&client, &gw.url(), &daily("k2", "t", 1), 2).await,
        (1, 1, 0)
    );
    assert_eq!(
        metric(&client, &gw.url(), "ratelimit_gateway_script_reloads_total").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_turned_replica_fails_health_within_2s_and_checks_fast() {
    let other = redis();
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), RedisOptions::default(), 200).await;
    let client = reqwest::Client::new();
    let body = daily("k", "t", 5);
    assert_eq!(checks(&client, &gw.url(), &body, 2).await, (2, 0, 0));
    assert_eq!(get(&client, &gw.url(), "/healthz").await.0, 200);

    // As a failover does to the old master.
    let port = other.port().to_string();
    redis.cli(&["REPLICAOF", "127.0.0.1", &port]).unwrap();
    let took = until("/healthz 503", Duration::from_secs(2), || async {
        get(&client, &gw.url(), "/healthz").await.0 == 503
    })
    .await;
    let (_, health) = get(&client, &gw.url(), "/healthz").await;
    assert_eq!(
        serde_json::from_str::<Value>(&health).unwrap(),
        serde_json::json!({"status": "unavailable", "redis": "readonly"})
    );
    eprintln!("/healthz said 503 {took:?} after REPLICAOF");
    for _ in 0..10 {
        let started = Instant::now();
        let (status, answer) = check(&client, &gw.url(), &body).await;
        assert_eq!(
            (status, answer["error"].as_str()),
            (503, Some("redis: unavailable"))
        );
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "{:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_errors_total{kind=\"readonly\"}"
        )
        .await,
        10.0
    );
    assert_eq!(get(&client, &gw.url(), "/livez").await.0, 200);

    // Promoted again: checks and health come back (its data is the other
    // server's now: an empty bucket of 5).
    redis.cli(&["REPLICAOF", "NO", "ONE"]).unwrap();
    let took = until("a check answered 200", Duration::from_secs(2), || async {
        check(&client, &gw.url(), &daily("k2", "t", 5)).await.0 == 200
    })
    .await;
    eprintln!("checks answered 200 again {took:?} after REPLICAOF NO ONE");
    // Health answers from one probe a second (gateway/src/http/health.rs).
    until("/healthz 200", Duration::from_secs(2), || async {
        get(&client, &gw.url(), "/healthz").await.0 == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_under_noeviction_answers_503_counted_as_oom() {
    let redis = redis();
    let gw = gateway_with(Target::Single(redis.url()), RedisOptions::default(), 2000).await;
    let client = reqwest::Client::new();
    let body = daily("k", "t", 5);
    assert_eq!(checks(&client, &gw.url(), &body, 2).await, (2, 0, 0));
    // The shipped policy, and a Redis already over its (tiny) maxmemory.
    redis
        .cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    assert_eq!(checks(&client, &gw.url(), &body, 3).await, (0, 0, 3));
    assert_eq!(
        metric(
            &client,
            &gw.url(),
            "ratelimit_gateway_errors_total{kind=\"oom\"}"
        )
        .await,
        3.0
    );
    let (status, health) = get(&client, &gw.url(), "/healthz").await;
    assert_eq!(
        (status, health.as_str()),
        (503, r#"{"status":"unavailable","redis":"oom"}"#)
    );
    // Nothing was forgotten: with memory back, the bucket holds 3 of 5.
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    assert_eq!(checks(&client, &gw.url(), &body, 4).await, (3, 1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_failover_checks_recover_within_a_second_of_the_sentinels_failover() {
    let mut set = RedisSentinels::start("rlmaster", 500, 2000).unwrap();
    let target = Target::Sentinel {
        sentinels: set.addrs(),
        master: set.name().to_string(),
    };
    let gw = connected_gateway(target, RedisOptions::default(), 200).await;
    let client = reqwest::Client::new();
    let limit = 30;
    let body = daily("k", "t", limit);
    assert_eq!(checks(&client, &gw.url(), &body, 20).await, (20, 0, 0));
    // Every write reached the replica before the master dies.
    assert_eq!(set.master.cli(&["WAIT", "1", "2000"]).unwrap(), "1");

    let old = set.master.port();
    let killed = Instant::now();
    set.master.kill();
    // When the replica becomes master (its own ROLE), and when the
    // Sentinels name it (the end of their failover), polled every 5 ms.
    let replica = set.replica.port();
    let sentinel = set.sentinels.first().map(Redis::port).unwrap();
    let name = set.name().to_string();
    let promotion = tokio::task::spawn_blocking(move || {
        let (mut promoted, mut announced) = (None, None);
        let ask = |port, cmd: &str| {
            testkit::redis::raw_command(port, cmd, Duration::from_millis(200)).unwrap_or_default()
        };
        while promoted.is_none() || announced.is_none() {
            if promoted.is_none() && ask(replica, "ROLE").contains("master") {
                promoted = Some(killed.elapsed());
            }
            let named = ask(
                sentinel,
                &format!("SENTINEL get-master-addr-by-name {name}"),
            );
            if announced.is_none() && named.contains(&replica.to_string()) {
                announced = Some(killed.elapsed());
            }
            assert!(
                killed.elapsed() < Duration::from_secs(15),
                "no failover within 15 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        (promoted.unwrap_or_default(), announced.unwrap_or_default())
    });
    // Checks during the switch: 503, fast; the first 200 ends the outage.
    let mut during = 0u64;
    let mut slowest = Duration::ZERO;
    let recovered = loop {
        let started = Instant::now();
        let (status, answer) = check(&client, &gw.url(), &body).await;
        slowest = slowest.max(started.elapsed());
        if status == 200 {
            assert_eq!(answer["allowed"], true, "{answer}");
            break killed.elapsed();
        }
        assert_eq!(status, 503);
        during += 1;
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "no recovery within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (promoted, announced) = promotion.await.unwrap();
    let promoted_port = set.master_port().unwrap();
    assert_eq!(promoted_port, set.replica.port());
    assert_ne!(promoted_port, old);
    let after = checks(&client, &gw.url(), &body, 15).await;
    eprintln!(
        "sentinel failover: replica promoted {promoted:?} after the kill, named by the \
         Sentinels at {announced:?}, first 200 at {recovered:?}; {during} checks answered 503 \
         meanwhile (slowest {slowest:?}); after: {after:?}"
    );
    // 20 before + 1 (the first 200) + 9 after = the limit of 30; the rest denied.
    assert_eq!(after, (limit - 21, 15 - (limit - 21), 0));
    assert!(
        slowest < Duration::from_millis(500),
        "a check took {slowest:?}"
    );
    // Within 1 s of the end of the Sentinels' failover (down-after 500 ms,
    // the vote, the promotion, the announcement).
    assert!(
        recovered < announced + Duration::from_secs(1),
        "Sentinels named the new master at {announced:?}, first 200 at {recovered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_failover_checks_recover_and_counts_hold() {
    let cluster = RedisCluster::start_with_replicas(1).unwrap();
    let gw = gateway_with(
        Target::Cluster(cluster.seeds()),
        RedisOptions::default(),
        1000,
    )
    .await;
    let client = reqwest::Client::new();
    let limit = 30;
    let body = daily("k", "t", limit);
    assert_eq!(checks(&client, &gw.url(), &body, 20).await, (20, 0, 0));

    // The master of the bucket's slot and its replica: the gateway derives
    // the hash tag from the key's first part (`n30/k`: "ops|k").
    let master = cluster.master_for_key("{ops|k}").unwrap();
    let replica = cluster
        .roles(master)
        .unwrap()
        .into_iter()
        .find(|(_, role, of)| role == "slave" && *of == master)
        .map(|(port, _, _)| port)
        .expect("the master has a replica");
    let started = Instant::now();
    cluster
        .node(replica)
        .unwrap()
        .cli(&["CLUSTER", "FAILOVER"])
        .unwrap();
    let mut errors = 0u64;
    let recovered = loop {
        let (status, answer) = check(&client, &gw.url(), &body).await;
        if status == 200 {
            assert_eq!(answer["allowed"], true, "{answer}");
            break started.elapsed();
        }
        errors += 1;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no recovery within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    until(
        "the replica became master",
        Duration::from_secs(5),
        || async {
            cluster
                .node(replica)
                .unwrap()
                .cli(&["ROLE"])
                .map(|r| r.starts_with("master"))
                .unwrap_or(false)
        },
    )
    .await;
    // The next checks go to the new master: exact counts.
    assert_eq!(checks(&client, &gw.url(), &body, 12).await, (9, 3, 0));
    // The first node, asked, hears of the new master by gossip: wait for it.
    until(
        "the first node names the replica as the slot's master",
        Duration::from_secs(5),
        || async { cluster.master_for_key("{ops|k}").ok() == Some(replica) },
    )
    .await;
    eprintln!(
        "cluster failover: first 200 {recovered:?} after CLUSTER FAILOVER, {errors} 503s before"
    );
}

/// The gateway binary with `args` and `env`; its stdout and stderr.
fn run_binary(args: &[&str], env: &[(&str, &str)]) -> String {
    let bin = testkit::paths::gateway_bin().unwrap();
    let out = std::process::Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_password_shows_nowhere() {
    let secret_url = format!("redis://:{PASSWORD}@127.0.0.1:1");
    // --help with the URL in the environment.
    let help = run_binary(&["--help"], &[("RLGW_REDIS", &secret_url)]);
    assert!(help.contains("--redis <REDIS>"), "{help}");
    assert!(!help.contains(PASSWORD), "{help}");
    // A bad flag beside it: clap's error.
    let bad = run_binary(&["--redis", &secret_url, "--redis-timeout-ms", "x"], &[]);
    assert!(bad.contains("--redis-timeout-ms"), "{bad}");
    assert!(!bad.contains(PASSWORD), "{bad}");

    // RUST_LOG=trace: a failed connect and its retries (Redis not up yet),
    // a connect, a failure (Redis killed) and a reconnect.
    let mut redis = Redis::start_with(&["--requirepass", PASSWORD]).unwrap();
    redis.kill();
    let url = format!("redis://:{PASSWORD}@127.0.0.1:{}", redis.port());
    let port = testkit::free_port().unwrap();
    let log_path = std::env::temp_dir().join(format!("rlgw-trace-{port}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = std::process::Command::new(testkit::paths::gateway_bin().unwrap())
        .args([
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--insecure-no-auth",
        ])
        .arg("--policy")
        .arg(policy())
        .env("RLGW_REDIS", &url)
        .env("RUST_LOG", "trace")
        .env("NO_COLOR", "1")
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let client = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let healthy = || async {
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .map(|r| r.status() == 200)
            .unwrap_or(false)
    };
    let logged = |what: &'static str| {
        let path = log_path.clone();
        move || {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            async move { text.contains(what) }
        }
    };
    until(
        "a failed connect logged",
        Duration::from_secs(10),
        logged("cannot connect to Redis; retrying"),
    )
    .await;
    redis.restart().unwrap();
    until("healthy", Duration::from_secs(10), healthy).await;
    let body = daily("k", "t", 5);
    assert_eq!(check(&client, &base, &body).await.0, 200);
    redis.kill();
    // Health answers from one probe a second (gateway/src/http/health.rs).
    until("/healthz 503", Duration::from_secs(2), || async {
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
            == 503
    })
    .await;
    let mut bodies = Vec::new();
    for path in ["/v1/check", "/healthz"] {
        let resp = if path == "/healthz" {
            client.get(format!("{base}{path}")).send().await.unwrap()
        } else {
            client
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await
                .unwrap()
        };
        assert_eq!(resp.status().as_u16(), 503);
        bodies.push(resp.text().await.unwrap());
    }
    redis.restart().unwrap();
    until("healthy again", Duration::from_secs(10), healthy).await;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log_path).unwrap();
    let _ = std::fs::remove_file(&log_path);
    for b in &bodies {
        assert!(!b.contains(PASSWORD), "{b}");
    }
    assert!(text.contains("TRACE"), "not a trace log");
    assert!(
        text.contains("cannot connect to Redis; retrying"),
        "no retry logged"
    );
    assert!(
        text.contains(&format!("redis://:***@127.0.0.1:{}", redis.port())),
        "the redacted URL is not logged"
    );
    let lines = text.lines().filter(|l| l.contains(PASSWORD)).count();
    assert_eq!(
        lines,
        0,
        "the password is in {lines} log lines of {}",
        text.lines().count()
    );
}
