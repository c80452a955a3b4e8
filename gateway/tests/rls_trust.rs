//! What a caller of the rate limit service (`--grpc-listen`) cannot do with
//! the bytes it sends, against a real Redis:
//!
//! * descriptors with their own `limit` and long, distinct keys add no
//!   metrics series (the label is one fixed value); with
//!   `--rls-allow-overrides false` the `limit` is ignored and the
//!   configuration's applies;
//! * a `shared` descriptor charges the client its own entry names, whatever
//!   separators another entry's value holds;
//! * a `shared` descriptor with more hits than the rule may cost one
//!   request answers `OVER_LIMIT` (not `UNKNOWN`, which fails open);
//! * a configuration that shares a rule of another domain does not load.

mod common;

use common::align;

use std::path::{Path, PathBuf};
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratelimit_gateway::{Config, RlsOptions, Running};
use testkit::redis::Redis;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlgw-rls-trust-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A gateway (no authentication) with `--grpc-listen`, `rls_yaml` as its
/// `--rls-config` and `policy` as its policy (`None`: no `--policy`).
async fn gateway(
    redis: &Redis,
    work: &Path,
    rls_yaml: &str,
    policy: Option<&str>,
    allow_overrides: bool,
) -> anyhow::Result<Running> {
    let rls_dir = work.join("rls");
    std::fs::create_dir_all(&rls_dir).unwrap();
    std::fs::write(rls_dir.join("0.yaml"), rls_yaml).unwrap();
    let mut policy_dirs = Vec::new();
    if let Some(policy) = policy {
        let policy_dir = work.join("policy");
        std::fs::create_dir_all(&policy_dir).unwrap();
        std::fs::write(policy_dir.join("0.json"), policy).unwrap();
        policy_dirs.push(policy_dir);
    }
    let mut config = Config::single("127.0.0.1:0".parse().unwrap(), redis.url(), policy_dirs);
    config.redis_timeout = Duration::from_millis(500);
    config.rls = RlsOptions {
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        config: vec![rls_dir],
        allow_overrides,
        ..RlsOptions::default()
    };
    ratelimit_gateway::start(config, Duration::from_secs(10)).await
}

async fn client(gw: &Running) -> RateLimitServiceClient<tonic::transport::Channel> {
    let addr = gw.grpc_addr.unwrap();
    RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

fn descriptor(entries: &[(&str, &str)], hits: Option<u64>) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        hits_addend: hits.map(|h| envoy_types::pb::google::protobuf::UInt64Value { value: h }),
        ..Default::default()
    }
}

/// `d` with its own limit of `requests` a minute.
fn with_limit(mut d: RateLimitDescriptor, requests: u32) -> RateLimitDescriptor {
    d.limit = Some(RateLimitOverride {
        requests_per_unit: requests,
        unit: 2, // MINUTE
    });
    d
}

async fn ask(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
) -> Result<RateLimitResponse, tonic::Status> {
    let req = tonic::Request::new(RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    });
    c.should_rate_limit(req).await.map(|r| r.into_inner())
}

/// (overall code, per descriptor (code, limit_remaining, requests_per_unit)).
fn codes(r: &RateLimitResponse) -> (Code, Vec<(Code, u32, u32)>) {
    let overall = Code::try_from(r.overall_code).unwrap();
    let each = r
        .statuses
        .iter()
        .map(|s| {
            (
                Code::try_from(s.code).unwrap(),
                s.limit_remaining,
                s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit),
            )
        })
        .collect();
    (overall, each)
}

fn dump(redis: &Redis) -> String {
    redis
        .dump()
        .unwrap()
        .lines()
        .filter(|l| !l.contains("health:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

async fn metrics(gw: &Running) -> String {
    reqwest::get(format!("http://{}/metrics", gw.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The samples of the rate limit service's per-descriptor metrics.
fn rls_series(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            l.starts_with("ratelimit_gateway_rls_")
                && !l.starts_with("ratelimit_gateway_rls_requests_total")
        })
        .map(str::to_string)
        .collect()
}

const OV: &str =
    "domain: ov\ndescriptors:\n- key: user\n  rate_limit: {unit: minute, requests_per_unit: 3}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_with_long_distinct_keys_add_no_metrics_series() {
    let redis = Redis::start().unwrap();
    let work = dir("labels");
    let gw = gateway(&redis, &work, OV, None, true).await.unwrap();
    let mut c = client(&gw).await;
    let first = with_limit(descriptor(&[("k0", "v")], None), 1000);
    let r = ask(&mut c, "ov", vec![first]).await.unwrap();
    assert_eq!(codes(&r), (Code::Ok, vec![(Code::Ok, 999, 1000)]));
    let before = rls_series(&metrics(&gw).await);
    assert_eq!(
        before,
        [
            "ratelimit_gateway_rls_total_hits_total{descriptor=\"(override)\",domain=\"ov\"} 1",
            "ratelimit_gateway_rls_within_limit_total{descriptor=\"(override)\",domain=\"ov\"} 1",
        ]
    );
    // 20 calls of 10 descriptors, each with a distinct 4 KiB key (the old
    // gateway made a series per key set: 400 series, megabytes of /metrics).
    for call in 0..20 {
        let ds = (0..10)
            .map(|i| {
                let key = format!("{call}-{i}-{}", "k".repeat(4096));
                with_limit(descriptor(&[(key.as_str(), "v")], None), 1000)
            })
            .collect();
        let r = ask(&mut c, "ov", ds).await.unwrap();
        assert_eq!(codes(&r).0, Code::Ok);
    }
    let after = metrics(&gw).await;
    assert_eq!(
        rls_series(&after),
        [
            "ratelimit_gateway_rls_total_hits_total{descriptor=\"(override)\",domain=\"ov\"} 201",
            "ratelimit_gateway_rls_within_limit_total{descriptor=\"(override)\",domain=\"ov\"} 201",
        ]
    );
    assert!(!after.contains("kkkk"), "a request's key in /metrics");
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_allow_overrides_the_configured_limit_applies() {
    let redis = Redis::start().unwrap();
    let work = dir("nooverride");
    let gw = gateway(&redis, &work, OV, None, false).await.unwrap();
    let mut c = client(&gw).await;
    align(60, 5_000);
    let mut seen = Vec::new();
    for _ in 0..5 {
        let d = with_limit(descriptor(&[("user", "ann")], None), 1000);
        let r = ask(&mut c, "ov", vec![d]).await.unwrap();
        seen.push(codes(&r).1[0]);
    }
    // The configuration's 3 a minute (the old gateway: the descriptor's
    // 1000, five times OK).
    assert_eq!(
        seen,
        [
            (Code::Ok, 2, 3),
            (Code::Ok, 1, 3),
            (Code::Ok, 0, 3),
            (Code::OverLimit, 0, 3),
            (Code::OverLimit, 0, 3)
        ]
    );
    let m = metrics(&gw).await;
    assert!(
        m.contains("ratelimit_gateway_rls_total_hits_total{descriptor=\"user\",domain=\"ov\"} 5"),
        "{m}"
    );
    gw.stop().await.unwrap();
}

const SHARE_POLICY: &str = r#"{"domain":"sh",
 "global":{"cluster":"gw"},
 "rules":[{"name":"per-client","scope":"global","key":["client"],"limits":[{"requests":5,"per":"1m"}]}]}"#;

/// `(t, client_id)` counts in the policy's per-client bucket of the client
/// `client_id` names.
const SHARE_RLS: &str = "domain: sh\ndescriptors:\n- key: t\n  descriptors:\n  - key: client_id\n    rate_limit:\n      shared: {rule: per-client, entries: [client_id]}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_descriptor_charges_the_client_of_its_own_entry() {
    let redis = Redis::start().unwrap();
    let work = dir("split");
    let gw = gateway(&redis, &work, SHARE_RLS, Some(SHARE_POLICY), true)
        .await
        .unwrap();
    let mut c = client(&gw).await;
    let d = descriptor(
        &[
            ("t", "x\u{1f}client_id\u{1e}victim"),
            ("client_id", "attacker"),
        ],
        None,
    );
    let r = ask(&mut c, "sh", vec![d]).await.unwrap();
    assert_eq!(codes(&r), (Code::Ok, vec![(Code::Ok, 4, 5)]));
    // The old gateway split the joined entries again and charged `victim`.
    // One bucket key, then the domain's ledger of live keys naming it.
    let keys = dump(&redis);
    assert_eq!(keys.lines().count(), 2, "{keys}");
    assert!(
        keys.lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("rl:{sh|live} zset ")),
        "{keys}"
    );
    assert!(
        keys.starts_with("rl:{sh|c=attacker}|per-client/c=attacker|0|token_bucket|5|60000 "),
        "{keys}"
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_descriptor_costing_more_than_the_rule_allows_is_over_the_limit() {
    let redis = Redis::start().unwrap();
    let work = dir("cost");
    let gw = gateway(&redis, &work, SHARE_RLS, Some(SHARE_POLICY), true)
        .await
        .unwrap();
    let mut c = client(&gw).await;
    let before = dump(&redis);
    // The rule's largest cost is 1: two hits can never pass. The old gateway
    // answered UNKNOWN, which Envoy's failure_mode_deny: false lets through.
    let d = descriptor(&[("t", "x"), ("client_id", "ann")], Some(2));
    let r = ask(&mut c, "sh", vec![d]).await.unwrap();
    assert_eq!(codes(&r), (Code::OverLimit, vec![(Code::OverLimit, 0, 5)]));
    assert_eq!(dump(&redis), before, "nothing counted");
    // Beside another descriptor, the same answer for it.
    let ds = vec![
        descriptor(&[("t", "x"), ("client_id", "ann")], Some(2)),
        descriptor(&[("t", "x"), ("client_id", "bob")], Some(1)),
    ];
    let r = ask(&mut c, "sh", ds).await.unwrap();
    assert_eq!(
        codes(&r),
        (
            Code::OverLimit,
            vec![(Code::OverLimit, 0, 5), (Code::Ok, 4, 5)]
        )
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_a_rule_of_another_domain_does_not_load() {
    let redis = Redis::start().unwrap();
    let work = dir("cross");
    // Domain `other` of the rls configuration names the policy's domain `sh`:
    // a token of `other` would charge `sh`'s buckets.
    let cross = "domain: other\ndescriptors:\n- key: client_id\n  rate_limit:\n    shared: {domain: sh, rule: per-client, entries: [client_id]}\n";
    let e = gateway(&redis, &work, cross, Some(SHARE_POLICY), true)
        .await
        .err()
        .expect("the gateway refuses the configuration");
    let e = format!("{e:#}");
    assert!(
        e.contains(
            "descriptors[0].rate_limit.shared.domain: `sh` is not this file's domain `other`"
        ),
        "{e}"
    );
}
