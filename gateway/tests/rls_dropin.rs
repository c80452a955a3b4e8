//! The gateway as a drop-in for envoyproxy/ratelimit: the real binary
//! started as theirs is, with their YAML alone (`--rls-config`, no
//! `--policy`), in front of a real Redis.
//!
//! * their example configuration (`tests/data/envoyproxy-ratelimit-example.yaml`,
//!   vendored from their `examples/`) answers `ShouldRateLimit` with the
//!   exact OK / OVER_LIMIT and remaining counts its limits give;
//! * the `--auth-tokens` file names a domain of that YAML only, and gRPC
//!   callers are held to it;
//! * `/v1/check`, `/v1/lease` and `/v1/settle` answer 404 for the domain no
//!   policy names (after the token: 401 and 403 come first), writing nothing;
//! * SIGHUP and a changed file reload the YAML, with no policy to reload;
//! * a start with neither `--policy` nor `--rls-config` fails, naming both.

mod common;

use common::align;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use testkit::redis::Redis;
use testkit::{free_port, Client, ConnectionMode, Gateway, GatewayOptions, Request};

/// The token of domain `rl`, the example's (32 hex characters: no entropy warning).
const TOKEN: &str = "5f0c8a3e91d24b7c8e6a1f3d2b9c4e70";

/// The vendored example configuration.
fn example() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/envoyproxy-ratelimit-example.yaml"
    );
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// A fresh temporary directory for one test's files.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlgw-dropin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The binary with `--grpc-listen`, `--rls-config <work>/rls` (the example,
/// as `config.yaml`) and `--auth-tokens` naming only domain `rl`; no
/// `--policy`. Returns the gateway and its gRPC address.
fn start(redis: &Redis, work: &Path) -> (Gateway, String) {
    let rls = work.join("rls");
    std::fs::create_dir_all(&rls).unwrap();
    std::fs::write(rls.join("config.yaml"), example()).unwrap();
    let tokens = work.join("tokens");
    std::fs::write(&tokens, format!("rl {TOKEN}\n")).unwrap();
    let grpc = format!("127.0.0.1:{}", free_port().unwrap());
    let gw = Gateway::start(GatewayOptions::new(redis.url()).args(&[
        "--grpc-listen",
        &grpc,
        "--rls-config",
        rls.to_str().unwrap(),
        "--auth-tokens",
        tokens.to_str().unwrap(),
        "--redis-timeout-ms",
        "500",
    ]))
    .unwrap_or_else(|e| panic!("starting the gateway without --policy: {e:#}"));
    (gw, grpc)
}

async fn client(grpc: &str) -> RateLimitServiceClient<tonic::transport::Channel> {
    RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .unwrap()
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

async fn ask(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    descriptors: &[&[(&str, &str)]],
    token: Option<&str>,
) -> Result<RateLimitResponse, tonic::Status> {
    let mut req = tonic::Request::new(RateLimitRequest {
        domain: domain.to_string(),
        descriptors: descriptors.iter().map(|d| descriptor(d)).collect(),
        hits_addend: 0,
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    c.should_rate_limit(req).await.map(|r| r.into_inner())
}

/// The overall code and (code, limit_remaining) per descriptor of a call of
/// domain `rl` with its token.
async fn answer(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    descriptors: &[&[(&str, &str)]],
) -> (Code, Vec<(Code, u32)>) {
    let r = ask(c, "rl", descriptors, Some(TOKEN))
        .await
        .unwrap_or_else(|e| panic!("{descriptors:?}: {e:?}"));
    let each = r
        .statuses
        .iter()
        .map(|s| (Code::try_from(s.code).unwrap(), s.limit_remaining))
        .collect();
    (Code::try_from(r.overall_code).unwrap(), each)
}

/// Every key but the health probes', with value and expiry.
fn dump(redis: &Redis) -> String {
    redis
        .dump()
        .unwrap()
        .lines()
        .filter(|l| !l.contains("health:"))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// (status, body) of a POST of `body` to `path`, with `token` as bearer.
fn post(gw: &Gateway, path: &str, body: &str, token: Option<&str>) -> (u16, String) {
    let client = Client::new(gw.url(""), ConnectionMode::NewPerRequest);
    let mut req = Request::post(path, body).header("content-type", "application/json");
    if let Some(t) = token {
        req = req.header("authorization", &format!("Bearer {t}"));
    }
    let r = client.send(&req).unwrap();
    (r.status, r.body)
}

fn metric(gw: &Gateway, sample: &str) -> f64 {
    gw.metric(sample)
        .unwrap()
        .unwrap_or_else(|| panic!("no sample {sample}"))
}

/// Waits up to 5 s for `sample` to read `want`.
fn wait_metric(gw: &Gateway, sample: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = metric(gw, sample);
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "{sample}: {got}, want {want}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

const UNLIMITED: u32 = u32::MAX;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drop_in_gateway_started_with_the_envoyproxy_ratelimit_example_config_only() {
    let redis = Redis::start().unwrap();
    let work = dir("example");
    let (gw, grpc) = start(&redis, &work);
    let mut c = client(&grpc).await;

    // Every minute window of the sequence below in one minute.
    align(60, 20_000);
    // source_cluster=proxy, destination_cluster=mock: 1 a minute.
    let mock: &[(&str, &str)] = &[("source_cluster", "proxy"), ("destination_cluster", "mock")];
    assert_eq!(
        answer(&mut c, &[mock]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    assert_eq!(
        answer(&mut c, &[mock]).await,
        (Code::OverLimit, vec![(Code::OverLimit, 0)])
    );
    // foo: 2 a minute, one counter per value.
    let foo_a: &[(&str, &str)] = &[("foo", "a")];
    let first = ask(&mut c, "rl", &[foo_a], Some(TOKEN)).await.unwrap();
    let limit = first.statuses[0].current_limit.as_ref().unwrap();
    // 2 per MINUTE (the enum's 2).
    assert_eq!((limit.requests_per_unit, limit.unit), (2, 2));
    assert_eq!(first.statuses[0].limit_remaining, 1);
    assert_eq!(
        answer(&mut c, &[foo_a]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    assert_eq!(
        answer(&mut c, &[foo_a]).await,
        (Code::OverLimit, vec![(Code::OverLimit, 0)])
    );
    assert_eq!(
        answer(&mut c, &[&[("foo", "b")]]).await,
        (Code::Ok, vec![(Code::Ok, 1)])
    );
    // foo, bar: 3 a minute, whatever foo's own count.
    let bar: &[(&str, &str)] = &[("foo", "a"), ("bar", "x")];
    for remaining in [2, 1, 0] {
        assert_eq!(
            answer(&mut c, &[bar]).await,
            (Code::Ok, vec![(Code::Ok, remaining)])
        );
    }
    assert_eq!(
        answer(&mut c, &[bar]).await,
        (Code::OverLimit, vec![(Code::OverLimit, 0)])
    );
    // bar=banned: 0 a minute, over from the first hit.
    assert_eq!(
        answer(&mut c, &[&[("foo", "a"), ("bar", "banned")]]).await,
        (Code::OverLimit, vec![(Code::OverLimit, 0)])
    );
    // bay and qux: unlimited.
    for unlimited in [&[("foo", "a"), ("bay", "x")][..], &[("qux", "x")][..]] {
        for _ in 0..3 {
            assert_eq!(
                answer(&mut c, &[unlimited]).await,
                (Code::Ok, vec![(Code::Ok, UNLIMITED)])
            );
        }
    }
    // baz=shady: 1 a minute in shadow mode, so over is still OK.
    let shady: &[(&str, &str)] = &[("foo", "a"), ("baz", "shady")];
    assert_eq!(
        answer(&mut c, &[shady]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    assert_eq!(
        answer(&mut c, &[shady]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    // Any other baz: 1 a second.
    let baz: &[(&str, &str)] = &[("foo", "a"), ("baz", "other")];
    align(1, 700);
    assert_eq!(
        answer(&mut c, &[baz]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    assert_eq!(
        answer(&mut c, &[baz]).await,
        (Code::OverLimit, vec![(Code::OverLimit, 0)])
    );
    // A descriptor the example does not name: OK, nothing counted.
    assert_eq!(
        answer(&mut c, &[&[("nope", "x")]]).await,
        (Code::Ok, vec![(Code::Ok, 0)])
    );
    // Each descriptor decided on its own; one over makes the call over.
    assert_eq!(
        answer(
            &mut c,
            &[&[("foo", "c")], &[("foo", "c"), ("bar", "banned")]]
        )
        .await,
        (Code::OverLimit, vec![(Code::Ok, 1), (Code::OverLimit, 0)])
    );

    // The token file names domain `rl`, which only the YAML has.
    let before = dump(&redis);
    let e = ask(&mut c, "rl", &[foo_a], None).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    let e = ask(&mut c, "shop", &[foo_a], Some(TOKEN))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");

    // No policy names `rl`: the HTTP API has nothing to enforce for it.
    let check = r#"{"version":2,"domain":"rl","buckets":[{"rule":"r","key":"r/c=ann","tag":"c=ann","variant":"default","cost":1}]}"#;
    let lease = r#"{"version":2,"domain":"rl","rule":"r","key":"r/c=ann","tag":"c=ann","variant":"default","want":1}"#;
    let settle = r#"{"version":2,"domain":"rl","settlements":[{"reservation":"9f86d081884c7d65","buckets":[{"rule":"r","key":"r/c=ann","tag":"c=ann","variant":"default","cost":1}]}]}"#;
    assert_eq!(
        post(&gw, "/v1/check", check, None),
        (
            401,
            r#"{"version":2,"error":"authorization: a known bearer token is required"}"#.into()
        )
    );
    let unknown =
        r#"{"version":2,"error":"domain: unknown domain `rl`: not in the gateway's policy"}"#;
    for (path, body) in [
        ("/v1/check", check),
        ("/v1/lease", lease),
        ("/v1/settle", settle),
    ] {
        assert_eq!(
            post(&gw, path, body, Some(TOKEN)),
            (404, unknown.to_string()),
            "{path}"
        );
    }
    // Another domain than the token's: 403 before the domain is looked up,
    // so a token holder cannot learn which domains the policy has.
    assert_eq!(
        post(
            &gw,
            "/v1/check",
            &check.replace("\"rl\"", "\"shop\""),
            Some(TOKEN)
        ),
        (
            403,
            r#"{"version":2,"error":"authorization: this token may not act on this domain"}"#
                .into()
        )
    );
    assert_eq!(dump(&redis), before, "a refused call wrote to Redis");

    for (sample, want) in [
        (
            "ratelimit_gateway_errors_total{kind=\"unknown_domain\"}",
            3.0,
        ),
        ("ratelimit_gateway_errors_total{kind=\"bad_request\"}", 0.0),
        ("ratelimit_gateway_checks_total{result=\"error\"}", 3.0),
        (
            "ratelimit_gateway_auth_failures_total{reason=\"missing\"}",
            2.0,
        ),
        (
            "ratelimit_gateway_auth_failures_total{reason=\"wrong_domain\"}",
            2.0,
        ),
        ("ratelimit_gateway_reloads_total{what=\"policy\"}", 0.0),
    ] {
        assert_eq!(metric(&gw, sample), want, "{sample}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_policy_sighup_and_a_changed_file_reload_the_rls_config() {
    let redis = Redis::start().unwrap();
    let work = dir("reload");
    let (mut gw, grpc) = start(&redis, &work);
    let mut c = client(&grpc).await;

    let pid = gw.pid().unwrap().to_string();
    let sent = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    assert!(sent.success());
    wait_metric(
        &gw,
        "ratelimit_gateway_reloads_total{what=\"rls_config\"}",
        1.0,
    );
    wait_metric(
        &gw,
        "ratelimit_gateway_reloads_total{what=\"auth_tokens\"}",
        1.0,
    );
    assert!(gw.is_running(), "SIGHUP must not stop the gateway");
    for sample in [
        "ratelimit_gateway_reloads_total{what=\"policy\"}",
        "ratelimit_gateway_reload_failures_total{what=\"policy\"}",
        "ratelimit_gateway_reload_failures_total{what=\"rls_config\"}",
    ] {
        assert_eq!(metric(&gw, sample), 0.0, "{sample}");
    }

    // foo from 2 to 5 a minute: picked up by the poll, no signal.
    let raised = example().replacen("requests_per_unit: 2", "requests_per_unit: 5", 1);
    std::fs::write(work.join("rls/config.yaml"), raised).unwrap();
    wait_metric(
        &gw,
        "ratelimit_gateway_reloads_total{what=\"rls_config\"}",
        2.0,
    );
    assert_eq!(
        answer(&mut c, &[&[("foo", "z")]]).await,
        (Code::Ok, vec![(Code::Ok, 4)])
    );
}

#[test]
fn a_start_with_neither_policy_nor_rls_config_fails_naming_both() {
    let bin = testkit::gateway_bin().unwrap();
    let out = Command::new(&bin)
        .args([
            "--redis",
            "redis://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
            "--insecure-no-auth",
        ])
        .env_remove("RLGW_POLICY")
        .env_remove("RLGW_RLS_CONFIG")
        .env_remove("RLGW_GRPC_LISTEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "ratelimit-gateway: nothing to enforce: give --policy (the plugin configurations \
         /v1/* enforces), --rls-config with --grpc-listen (envoyproxy/ratelimit's YAML), \
         or both\n"
    );
}
