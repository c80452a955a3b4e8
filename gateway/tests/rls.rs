//! Envoy's rate limit service protocol (`--grpc-listen`, `--rls-config`),
//! against a real Redis: over gRPC directly, and through real Envoy 1.40
//! proxies running the native `envoy.filters.http.ratelimit` filter.
//!
//! * every example of envoyproxy/ratelimit's README "Configuration" section,
//!   replayed through a native Envoy, decides as that README says;
//! * the fixed window counts as theirs (every hit `INCRBY`'d, compared after);
//! * two native Envoys share one limit exactly, and a native Envoy and a
//!   wasm-filter Envoy share one limit exactly (`rate_limit.shared`);
//! * auth refusals write nothing; Redis killed: `failure_mode_deny` true
//!   gives 500, false gives 200;
//! * `masked_remote_address` descriptors (IPv4 and IPv6 networks) and
//!   wildcard values, with and without `share_threshold`, as their users
//!   write them.

mod common;

use common::align;

use std::path::{Path, PathBuf};
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use ratelimit_gateway::{Auth, Config, RlsOptions, Running};
use testkit::redis::Redis;
use testkit::{ConnectionMode, Envoy, EnvoyOptions, Request};

/// A temporary directory holding the files of one test.
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlgw-rls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A gateway in this runtime with `--grpc-listen 127.0.0.1:0`, the rls
/// configuration `rls_yaml` (one file per element) and `policy` (plugin
/// configurations, JSON; none: no `--policy`) as its policy; `tokens` is the
/// `--auth-tokens` file.
async fn gateway(
    redis: &Redis,
    work: &Path,
    rls_yaml: &[&str],
    policy: &[&str],
    tokens: Option<&str>,
) -> Running {
    let rls_dir = work.join("rls");
    std::fs::create_dir_all(&rls_dir).unwrap();
    for (i, y) in rls_yaml.iter().enumerate() {
        std::fs::write(rls_dir.join(format!("{i}.yaml")), y).unwrap();
    }
    // No policy at all when none is given: the rate limit service alone.
    let mut policy_dirs = Vec::new();
    if !policy.is_empty() {
        let policy_dir = work.join("policy");
        std::fs::create_dir_all(&policy_dir).unwrap();
        for (i, p) in policy.iter().enumerate() {
            std::fs::write(policy_dir.join(format!("{i}.json")), p).unwrap();
        }
        policy_dirs.push(policy_dir);
    }
    let mut config = Config::single("127.0.0.1:0".parse().unwrap(), redis.url(), policy_dirs);
    config.redis_timeout = Duration::from_millis(500);
    config.rls = RlsOptions {
        grpc_listen: Some("127.0.0.1:0".parse().unwrap()),
        config: vec![rls_dir],
        ..RlsOptions::default()
    };
    if let Some(t) = tokens {
        let path = work.join("tokens");
        std::fs::write(&path, t).unwrap();
        config.auth = Auth::Tokens(path);
    }
    ratelimit_gateway::start(config, Duration::from_secs(10))
        .await
        .unwrap()
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

async fn ask(
    c: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    descriptors: Vec<RateLimitDescriptor>,
    token: Option<&str>,
) -> Result<RateLimitResponse, tonic::Status> {
    let mut req = tonic::Request::new(RateLimitRequest {
        domain: domain.to_string(),
        descriptors,
        hits_addend: 0,
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    c.should_rate_limit(req).await.map(|r| r.into_inner())
}

/// (code, limit_remaining) per descriptor, and the overall code.
fn codes(r: &RateLimitResponse) -> (Code, Vec<(Code, u32)>) {
    let overall = Code::try_from(r.overall_code).unwrap();
    let each = r
        .statuses
        .iter()
        .map(|s| (Code::try_from(s.code).unwrap(), s.limit_remaining))
        .collect();
    (overall, each)
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

const FW: &str =
    "domain: fw\ndescriptors:\n- key: user\n  rate_limit: {unit: minute, requests_per_unit: 3}\n\
- key: tb\n  rate_limit: {unit: minute, requests_per_unit: 2, algorithm: token_bucket}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fixed_window_counts_every_hit_as_envoyproxy_ratelimit_does() {
    let redis = Redis::start().unwrap();
    let work = dir("fw");
    let gw = gateway(&redis, &work, &[FW], &[], None).await;
    let mut c = client(&gw).await;
    align(60, 5_000);
    let mut seen = Vec::new();
    for hits in [2, 2, 2, 0] {
        let r = ask(
            &mut c,
            "fw",
            vec![descriptor(&[("user", "ann")], Some(hits))],
            None,
        )
        .await
        .unwrap();
        seen.push(codes(&r).1[0]);
        let s = &r.statuses[0];
        let limit = s.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (3, 2),
            "3 per MINUTE"
        );
        let reset = s.duration_until_reset.unwrap().seconds;
        assert!((1..=60).contains(&reset), "{reset}");
    }
    // Counts 2, 4, 6, 6: theirs INCRBYs even over the limit, so the client
    // stays over until the window ends; hits_addend 0 only looks.
    assert_eq!(
        seen,
        [
            (Code::Ok, 1),
            (Code::OverLimit, 0),
            (Code::OverLimit, 0),
            (Code::OverLimit, 0)
        ]
    );
    let keys = dump(&redis);
    assert_eq!(keys.lines().count(), 1, "{keys}");
    assert!(
        keys.starts_with("rl:{fw|user=ann}|fixed_window|60|") && keys.contains(" string \"6\" "),
        "{keys}"
    );
    // Another value is another counter; the token bucket extension does not
    // count a denied hit (2, then over, over: its key holds 2 hits' state).
    let r = ask(
        &mut c,
        "fw",
        vec![descriptor(&[("user", "bob")], None)],
        None,
    )
    .await
    .unwrap();
    assert_eq!(codes(&r).1, [(Code::Ok, 2)]);
    let mut tb = Vec::new();
    for _ in 0..4 {
        let r = ask(&mut c, "fw", vec![descriptor(&[("tb", "x")], None)], None)
            .await
            .unwrap();
        tb.push(codes(&r).1[0]);
    }
    assert_eq!(
        tb,
        [
            (Code::Ok, 1),
            (Code::Ok, 0),
            (Code::OverLimit, 0),
            (Code::OverLimit, 0)
        ]
    );
    let text = gw.app.metrics.render().unwrap();
    for (sample, want) in [
        (
            "ratelimit_gateway_rls_total_hits_total{descriptor=\"user\",domain=\"fw\"}",
            7.0,
        ),
        (
            "ratelimit_gateway_rls_over_limit_total{descriptor=\"user\",domain=\"fw\"}",
            3.0,
        ),
        // Near is 80 % of 3, 2: the second call (2 -> 4) passed it by 1.
        (
            "ratelimit_gateway_rls_near_limit_total{descriptor=\"user\",domain=\"fw\"}",
            1.0,
        ),
        (
            "ratelimit_gateway_rls_requests_total{code=\"over_limit\"}",
            5.0,
        ),
    ] {
        assert_eq!(
            testkit::prometheus_value(&text, sample),
            Some(want),
            "{sample}"
        );
    }
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rls_config_reloads_on_change_and_keeps_the_old_one_when_broken() {
    let redis = Redis::start().unwrap();
    let work = dir("reload");
    let one =
        "domain: r\ndescriptors:\n- key: k\n  rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let gw = gateway(&redis, &work, &[one], &[], None).await;
    let mut c = client(&gw).await;
    let d = || vec![descriptor(&[("k", "v")], None)];
    align(3600, 8_000);
    let r = ask(&mut c, "r", d(), None).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::Ok, 0)]);
    let r = ask(&mut c, "r", d(), None).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::OverLimit, 0)]);
    // 5 an hour now: the same counter (2 hits so far) has room for 3.
    let file = work.join("rls/0.yaml");
    std::fs::write(
        &file,
        one.replace("requests_per_unit: 1", "requests_per_unit: 5"),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let r = ask(&mut c, "r", d(), None).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::Ok, 2)]);
    // A broken file keeps the 5 in force.
    std::fs::write(
        &file,
        "domain: r\ndescriptors:\n- key: k\n  rate_limit: {unit: fortnight}\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let r = ask(&mut c, "r", d(), None).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::Ok, 1)]);
    let text = gw.app.metrics.render().unwrap();
    assert_eq!(
        testkit::prometheus_value(
            &text,
            "ratelimit_gateway_reload_failures_total{what=\"rls_config\"}"
        ),
        Some(1.0)
    );
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_refusals_write_nothing() {
    let redis = Redis::start().unwrap();
    let work = dir("auth");
    let gw = gateway(
        &redis,
        &work,
        &[FW],
        &[],
        Some("fw tok-fw\nother tok-other\n"),
    )
    .await;
    let mut c = client(&gw).await;
    let before = dump(&redis);
    let d = || vec![descriptor(&[("user", "ann")], None)];
    for (token, want) in [
        (None, tonic::Code::Unauthenticated),
        (Some("nope"), tonic::Code::Unauthenticated),
        (Some("tok-other"), tonic::Code::PermissionDenied),
    ] {
        let e = ask(&mut c, "fw", d(), token).await.unwrap_err();
        assert_eq!(e.code(), want, "{token:?}: {e:?}");
    }
    assert_eq!(dump(&redis), before, "a refused call wrote to Redis");
    let r = ask(&mut c, "fw", d(), Some("tok-fw")).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::Ok, 2)]);
    assert_eq!(dump(&redis).lines().count(), before.lines().count() + 1);
    gw.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_unknown_and_health_follows() {
    let mut redis = Redis::start().unwrap();
    let work = dir("down");
    let gw = gateway(&redis, &work, &[FW], &[], None).await;
    let mut c = client(&gw).await;
    let addr = gw.grpc_addr.unwrap();
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = |h: tonic_health::pb::HealthCheckResponse| h.status;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let req = || tonic_health::pb::HealthCheckRequest {
        service: "envoy.service.ratelimit.v3.RateLimitService".into(),
    };
    let up = health.check(req()).await.unwrap().into_inner();
    assert_eq!(status(up), 1, "SERVING");
    redis.kill();
    let e = ask(
        &mut c,
        "fw",
        vec![descriptor(&[("user", "ann")], None)],
        None,
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unknown, "{e:?}");
    assert_eq!(e.message(), "redis: unavailable");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let down = health.check(req()).await.unwrap().into_inner();
    assert_eq!(status(down), 2, "NOT_SERVING");
    gw.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// Through real Envoys with the native filter.

/// One route of the native Envoy: requests under `prefix` are limited in
/// `domain`, one descriptor per element of `descriptors`, each entry's value
/// from the request header `x-<key>` (`_` as `-`); a descriptor whose headers
/// are not all present is not sent. The hits come from `x-hits`.
struct Route {
    prefix: &'static str,
    domain: &'static str,
    descriptors: Vec<Vec<&'static str>>,
}

fn header_of(key: &str) -> String {
    format!("x-{}", key.replace('_', "-"))
}

/// An Envoy bootstrap template (testkit renders its ports; `GATEWAY_PORT` is
/// the gateway's gRPC port) with the native rate limit filter.
fn native_template(routes: &[Route], failure_mode_deny: bool, token: &str) -> String {
    let mut r = String::new();
    for route in routes {
        r.push_str(&format!(
            "              - match: {{ prefix: \"{}\" }}\n                route: {{ cluster: upstream }}\n                typed_per_filter_config:\n                  envoy.filters.http.ratelimit:\n                    \"@type\": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute\n                    domain: {}\n                    rate_limits:\n",
            route.prefix, route.domain
        ));
        for d in &route.descriptors {
            r.push_str("                    - actions:\n");
            for key in d {
                r.push_str(&format!(
                    "                      - request_headers: {{ header_name: {}, descriptor_key: {key} }}\n",
                    header_of(key)
                ));
            }
            r.push_str("                      hits_addend: { format: \"%REQ(x-hits)%\" }\n");
        }
    }
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: ${{ADMIN_PORT}} }} }}
static_resources:
  listeners:
  - name: ingress
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: ${{LISTEN_PORT}} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress_http
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
{r}          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: unused
              failure_mode_deny: {failure_mode_deny}
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              timeout: 2s
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{ cluster_name: ratelimit_gateway }}
                  initial_metadata: [ {{ key: authorization, value: "Bearer {token}" }} ]
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  - name: upstream
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: ${{UPSTREAM_PORT}} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: upstream
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                direct_response: {{ status: 200, body: {{ inline_string: "ok" }} }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{ "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }}
  clusters:
  - name: upstream
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: ${{UPSTREAM_PORT}} }} }} }} }} ] }} ]
  - name: ratelimit_gateway
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: ratelimit_gateway
      endpoints: [ {{ lb_endpoints: [ {{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: ${{GATEWAY_PORT}} }} }} }} }} ] }} ]
"#
    )
}

/// Envoy options for a native Envoy of `template` calling the gRPC port.
fn native_options(work: &Path, name: &str, template: &str, grpc_port: u16) -> EnvoyOptions {
    let path = work.join(format!("{name}.yaml"));
    std::fs::write(&path, template).unwrap();
    let mut o = EnvoyOptions::new("{}").gateway_port(grpc_port);
    o.template = Some(path);
    // No wasm module in this bootstrap.
    o.wasm = Some(PathBuf::from("/dev/null"));
    o.component_log_level = "grpc:info".to_string();
    o
}

/// GET `path` through `envoy` with the headers and `x-hits`; the status.
fn get(envoy: &Envoy, path: &str, headers: &[(&str, &str)], hits: u64) -> u16 {
    let mut req = Request::get(path).header("x-hits", &hits.to_string());
    for (k, v) in headers {
        req = req.header(&header_of(k), v);
    }
    envoy
        .client(ConnectionMode::KeepAlive)
        .send(&req)
        .unwrap()
        .status
}

/// The configuration of envoyproxy/ratelimit's README, "Configuration" >
/// "Examples" 1 to 9 (example 4 in its two variants, as two domains).
const README_EXAMPLES: [&str; 10] = [
    "domain: mongo_cps\ndescriptors:\n  - key: database\n    value: users\n    rate_limit:\n      unit: second\n      requests_per_unit: 500\n\n  - key: database\n    value: default\n    rate_limit:\n      unit: second\n      requests_per_unit: 500\n",
    "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit:\n          unit: day\n          requests_per_unit: 5\n  - key: to_number\n    rate_limit:\n      unit: day\n      requests_per_unit: 100\n",
    "domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: second\n      requests_per_unit: 10\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit:\n      unit: second\n      requests_per_unit: 0\n",
    "domain: example4\ndescriptors:\n  - key: key\n    value: value\n    rate_limit:\n      requests_per_unit: 300\n      unit: second\n",
    "domain: example4_nested\ndescriptors:\n  - key: key\n    value: value\n    descriptors:\n      - key: subkey\n        rate_limit:\n          requests_per_unit: 300\n          unit: second\n",
    "domain: internal\ndescriptors:\n  - key: ldap\n    rate_limit:\n      unlimited: true\n\n  - key: azure\n    rate_limit:\n      unit: minute\n      requests_per_unit: 100\n",
    "domain: example6\ndescriptors:\n  - key: service\n    descriptors:\n      - key: user\n        value: user-a\n        rate_limit:\n          requests_per_unit: 10\n          unit: second\n        shadow_mode: true\n      - key: user\n        value: user-b\n        rate_limit:\n          requests_per_unit: 20\n          unit: second\n",
    "domain: example7\ndescriptors:\n  - key: key_1\n    value: value_1\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          name: specific_limit\n          requests_per_unit: 5\n          unit: second\n  - key: key_2\n    value: value_2\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit:\n          replaces:\n            - name: specific_limit\n          requests_per_unit: 10\n          unit: second\n",
    "domain: example8\ndescriptors:\n  - key: key1\n    detailed_metric: true\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n",
    "domain: example9\ndescriptors:\n  - key: key1\n    value: value*\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n",
];

/// Hits `path` with `hits`, then once more; (first status, second status).
fn fill(envoy: &Envoy, path: &str, headers: &[(&str, &str)], hits: u64) -> (u16, u16) {
    (
        get(envoy, path, headers, hits),
        get(envoy, path, headers, 1),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_examples_through_a_native_envoy() {
    let redis = Redis::start().unwrap();
    let work = dir("readme");
    let gw = gateway(&redis, &work, &README_EXAMPLES, &[], None).await;
    let routes = vec![
        Route {
            prefix: "/ex1",
            domain: "mongo_cps",
            descriptors: vec![vec!["database"]],
        },
        Route {
            prefix: "/ex2",
            domain: "messaging",
            descriptors: vec![vec!["message_type", "to_number"], vec!["to_number"]],
        },
        Route {
            prefix: "/ex3",
            domain: "edge_proxy_per_ip",
            descriptors: vec![vec!["remote_address"]],
        },
        Route {
            prefix: "/ex4n",
            domain: "example4_nested",
            descriptors: vec![vec!["key", "subkey"]],
        },
        Route {
            prefix: "/ex4",
            domain: "example4",
            descriptors: vec![vec!["key", "subkey"]],
        },
        Route {
            prefix: "/ex5",
            domain: "internal",
            descriptors: vec![vec!["ldap"], vec!["azure"]],
        },
        Route {
            prefix: "/ex6",
            domain: "example6",
            descriptors: vec![vec!["service", "user"]],
        },
        Route {
            prefix: "/ex7",
            domain: "example7",
            descriptors: vec![
                vec!["key_1", "user"],
                vec!["key_2", "user"],
                vec!["key_1", "key_2", "user"],
            ],
        },
        Route {
            prefix: "/ex8",
            domain: "example8",
            descriptors: vec![vec!["key1"]],
        },
        Route {
            prefix: "/ex9",
            domain: "example9",
            descriptors: vec![vec!["key1"]],
        },
    ];
    let grpc = gw.grpc_addr.unwrap().port();
    let envoy = Envoy::start(native_options(
        &work,
        "readme",
        &native_template(&routes, true, "unused"),
        grpc,
    ))
    .unwrap();

    // Example 1: (database, users) and (database, default) get 500 a second
    // each; another database has no limit.
    align(1, 600);
    assert_eq!(
        fill(&envoy, "/ex1", &[("database", "users")], 500),
        (200, 429)
    );
    assert_eq!(
        fill(&envoy, "/ex1", &[("database", "default")], 500),
        (200, 429)
    );
    assert_eq!(
        fill(&envoy, "/ex1", &[("database", "other")], 100_000),
        (200, 200)
    );

    // Example 2: 5 marketing messages a day to one number, 100 a day to any
    // number; both descriptors in one request, the answer their OR.
    let marketing = [("message_type", "marketing"), ("to_number", "2061111111")];
    assert_eq!(fill(&envoy, "/ex2", &marketing, 5), (200, 429));
    let other = [("message_type", "marketing"), ("to_number", "2062222222")];
    assert_eq!(
        get(&envoy, "/ex2", &other, 1),
        200,
        "each number gets its own 5"
    );
    // The 100 a day of 2062222222 (1 used above), without message_type:
    // only the to_number descriptor is sent.
    assert_eq!(
        fill(&envoy, "/ex2", &[("to_number", "2062222222")], 99),
        (200, 429)
    );

    // Example 3: 10 a second per address; 50.0.0.5 gets 0.
    align(1, 600);
    assert_eq!(
        fill(&envoy, "/ex3", &[("remote_address", "50.0.0.1")], 10),
        (200, 429)
    );
    assert_eq!(
        get(&envoy, "/ex3", &[("remote_address", "50.0.0.5")], 1),
        429
    );

    // Example 4: a two-entry descriptor does not match a one-level
    // configuration, and matches the nested one (300 a second).
    let two = [("key", "value"), ("subkey", "subvalue")];
    assert_eq!(fill(&envoy, "/ex4/", &two, 100_000), (200, 200));
    align(1, 600);
    assert_eq!(fill(&envoy, "/ex4n", &two, 300), (200, 429));

    // Example 5: ldap is unlimited, azure 100 a minute.
    assert_eq!(
        fill(&envoy, "/ex5", &[("ldap", "x")], 1_000_000),
        (200, 200)
    );
    align(60, 2_000);
    assert_eq!(fill(&envoy, "/ex5", &[("azure", "x")], 100), (200, 429));

    // Example 6: user-a is in shadow mode (never limited, counted in
    // shadow_mode), user-b gets 20 a second.
    align(1, 600);
    let a = [("service", "auth-service"), ("user", "user-a")];
    assert_eq!(fill(&envoy, "/ex6", &a, 50), (200, 200));
    let b = [("service", "auth-service"), ("user", "user-b")];
    assert_eq!(fill(&envoy, "/ex6", &b, 20), (200, 429));
    let text = gw.app.metrics.render().unwrap();
    assert_eq!(
        testkit::prometheus_value(
            &text,
            "ratelimit_gateway_rls_shadow_mode_total{descriptor=\"service.user_user-a\",domain=\"example6\"}"
        ),
        Some(51.0)
    );

    // Example 7: (key_1, value_1), (user, bkthomps) gets 5 a second; with
    // (key_2, value_2) in the same request, its 10 a second replace the 5,
    // and the 5 are left untouched.
    align(1, 900);
    let both = [
        ("key_1", "value_1"),
        ("key_2", "value_2"),
        ("user", "bkthomps"),
    ];
    assert_eq!(fill(&envoy, "/ex7", &both, 10), (200, 429));
    let one = [("key_1", "value_1"), ("user", "bkthomps")];
    assert_eq!(fill(&envoy, "/ex7", &one, 5), (200, 429));

    // Example 8: key1 10 a minute per value, key1=value1 20 a minute.
    align(60, 2_000);
    assert_eq!(
        fill(&envoy, "/ex8", &[("key1", "unspecified_value")], 10),
        (200, 429)
    );
    assert_eq!(
        fill(&envoy, "/ex8", &[("key1", "unspecified_value2")], 10),
        (200, 429)
    );
    assert_eq!(fill(&envoy, "/ex8", &[("key1", "value1")], 20), (200, 429));

    // Example 9: value* gives every matching value its own 20 a minute.
    assert_eq!(fill(&envoy, "/ex9", &[("key1", "value_1")], 20), (200, 429));
    assert_eq!(fill(&envoy, "/ex9", &[("key1", "value_2")], 20), (200, 429));
    assert_eq!(
        fill(&envoy, "/ex9", &[("key1", "other")], 100_000),
        (200, 200)
    );

    // The DRAFT_VERSION_03 headers the native filter writes from our answer.
    let r = envoy
        .client(ConnectionMode::KeepAlive)
        .send(
            &Request::get("/ex9")
                .header("x-hits", "3")
                .header("x-key1", "value_headers"),
        )
        .unwrap();
    assert_eq!(r.header("x-ratelimit-limit"), Some("20, 20;w=60"), "{r:#?}");
    assert_eq!(r.header("x-ratelimit-remaining"), Some("17"), "{r:#?}");
    let reset: u64 = r.expect_header("x-ratelimit-reset").parse().unwrap();
    assert!((1..=60).contains(&reset), "{reset}");
    drop(envoy);
    gw.stop().await.unwrap();
}

/// The wasm filter's plugin configuration of the sharing test: one global
/// token-bucket rule keyed on the `x-user` header, 10 a minute.
const SHARED_POLICY: &str = r#"{"domain":"shop",
 "global":{"cluster":"ratelimit_gateway","timeout_ms":1000,"failure_mode":"closed"},
 "rules":[{"name":"per-user","scope":"global","key":["header:x-user"],"limits":[{"requests":10,"per":"1m"}]}]}"#;

/// The native side of the sharing test: `(user)` in domain `shop` stands
/// for the wasm rule `per-user` of policy domain `shop` (a descriptor shares
/// only a rule of its own domain); `(team)` is a plain fixed window, 10 a
/// minute, for the two native Envoys.
const SHARED_RLS: &str = "domain: shop\ndescriptors:\n- key: user\n  rate_limit:\n    shared: {rule: per-user, entries: [user]}\n- key: team\n  rate_limit: {unit: minute, requests_per_unit: 10}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_and_wasm_envoys_share_one_limit_exactly_and_redis_down_follows_failure_mode_deny() {
    let mut redis = Redis::start().unwrap();
    let work = dir("share");
    let gw = gateway(&redis, &work, &[SHARED_RLS], &[SHARED_POLICY], None).await;
    let grpc = gw.grpc_addr.unwrap().port();
    let routes = || {
        vec![Route {
            prefix: "/",
            domain: "shop",
            descriptors: vec![vec!["user"], vec!["team"]],
        }]
    };
    let deny = native_options(&work, "deny", &native_template(&routes(), true, "x"), grpc);
    let allow = native_options(
        &work,
        "allow",
        &native_template(&routes(), false, "x"),
        grpc,
    );
    let wasm = EnvoyOptions::new(SHARED_POLICY).gateway_port(gw.addr.port());
    let envoys = Envoy::start_all(&[deny, allow, wasm]).unwrap();
    let (deny, allow, wasm) = (&envoys[0], &envoys[1], &envoys[2]);

    // Two native Envoys, one fixed window of 10 a minute: 10 of 30 pass.
    align(60, 10_000);
    let mut passed = 0;
    for i in 0..30 {
        let e = if i % 2 == 0 { deny } else { allow };
        if get(e, "/", &[("team", "blue")], 1) == 200 {
            passed += 1;
        }
    }
    assert_eq!(passed, 10, "two native Envoys share the team's 10");

    // A native Envoy and a wasm-filter Envoy, one token bucket of 10 a
    // minute (the policy's rule): 10 of 30 pass, alternating.
    let mut passed = 0;
    for i in 0..30 {
        let status = if i % 2 == 0 {
            get(deny, "/", &[("user", "ann")], 1)
        } else {
            wasm.client(ConnectionMode::KeepAlive)
                .send(&Request::get("/").header("x-user", "ann"))
                .unwrap()
                .status
        };
        if status == 200 {
            passed += 1;
        }
    }
    assert_eq!(passed, 10, "native and wasm share ann's 10");
    let keys = dump(&redis);
    // Keys named per-user/ (the domain's ledger of live keys holds the name too).
    let bucket: Vec<&str> = keys
        .lines()
        .filter(|l| l.split(' ').next().is_some_and(|k| k.contains("per-user/")))
        .collect();
    assert_eq!(bucket.len(), 1, "one Redis key for both: {keys}");
    assert!(
        bucket[0].starts_with("rl:{shop|h=ann}|per-user/h=ann|0|token_bucket|10|60000 "),
        "{keys}"
    );

    // Redis killed: the gateway answers UNKNOWN; failure_mode_deny decides.
    redis.kill();
    assert_eq!(get(deny, "/", &[("team", "red")], 1), 500);
    assert_eq!(get(allow, "/", &[("team", "red")], 1), 200);
    drop(envoys);
    gw.stop().await.unwrap();
}

// ---------------------------------------------------------------------------
// The shipped native template and the compose demo's second Envoy.

/// `envoy/envoy-native.yaml` rendered for compose: the demo's ports, the
/// admin interface and the listener on `0.0.0.0`, the gateway's gRPC cluster
/// at the compose service `gateway:8091` by DNS.
fn compose_native() -> String {
    let root = testkit::workspace_root();
    let template = std::fs::read_to_string(root.join("envoy/envoy-native.yaml")).unwrap();
    let vars = testkit::TemplateVars {
        ports: testkit::Ports::DEMO,
        gateway_port: 8091,
        wasm_path: PathBuf::from("/unused"),
        plugin_config: String::new(),
        jwks: String::new(),
    };
    let text = testkit::render_template(&template, &vars).unwrap();
    let mut out = String::from(
        "# GENERATED from envoy/envoy-native.yaml by gateway/tests/rls.rs (compose):\n\
         # regenerate with UPDATE_COMPOSE_ENVOY=1 cargo test -p ratelimit-gateway --test rls compose\n",
    );
    let swaps = [
        (
            "socket_address: { address: 127.0.0.1, port_value: 9901 }",
            "socket_address: { address: 0.0.0.0, port_value: 9901 }",
        ),
        (
            "socket_address: { address: 127.0.0.1, port_value: 10000 }",
            "socket_address: { address: 0.0.0.0, port_value: 10000 }",
        ),
        (
            "socket_address: { address: 127.0.0.1, port_value: 8091 }",
            "socket_address: { address: gateway, port_value: 8091 }",
        ),
        (
            "    type: STATIC\n    typed_extension_protocol_options:",
            "    type: STRICT_DNS\n    dns_lookup_family: V4_ONLY\n    typed_extension_protocol_options:",
        ),
    ];
    let mut body = text;
    for (from, to) in swaps {
        assert_eq!(body.matches(from).count(), 1, "{from}");
        body = body.replace(from, to);
    }
    out.push_str(&body);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_native_template_and_the_compose_config_share_the_wasm_rule() {
    let root = testkit::workspace_root();
    // deploy/compose/envoy-native.yaml is the template rendered for compose.
    let generated = compose_native();
    let path = root.join("deploy/compose/envoy-native.yaml");
    if std::env::var_os("UPDATE_COMPOSE_ENVOY").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    assert_eq!(
        std::fs::read_to_string(&path).unwrap_or_default(),
        generated,
        "deploy/compose/envoy-native.yaml is stale: UPDATE_COMPOSE_ENVOY=1 cargo test -p ratelimit-gateway --test rls compose"
    );
    testkit::validate_config(&path).unwrap();
    // docker-compose.yml runs it, and gives the gateway its rls config.
    let compose: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(root.join("docker-compose.yml")).unwrap())
            .unwrap();
    let native = &compose["services"]["envoy-native"];
    assert_eq!(
        native["volumes"][0],
        "./deploy/compose/envoy-native.yaml:/etc/envoy/envoy.yaml:ro"
    );
    let gw_env = &compose["services"]["gateway"]["environment"];
    assert_eq!(gw_env["RLGW_GRPC_LISTEN"], "0.0.0.0:8091");
    assert_eq!(gw_env["RLGW_RLS_CONFIG"], "/etc/ratelimit/rls.yaml");
    assert!(compose["services"]["gateway"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v == "./deploy/compose/rls.yaml:/etc/ratelimit/rls.yaml:ro"));

    // The shipped template against a gateway with the compose files: a
    // client's /api requests count in the wasm rule api-global (20 a minute).
    let redis = Redis::start().unwrap();
    let work = dir("compose");
    let rls = std::fs::read_to_string(root.join("deploy/compose/rls.yaml")).unwrap();
    let policy = std::fs::read_to_string(root.join("deploy/compose/ratelimit.json")).unwrap();
    let tokens = std::fs::read_to_string(root.join("deploy/compose/gateway-tokens")).unwrap();
    let gw = gateway(&redis, &work, &[&rls], &[&policy], Some(&tokens)).await;
    let mut o = EnvoyOptions::new("{}").gateway_port(gw.grpc_addr.unwrap().port());
    o.template = Some(root.join("envoy/envoy-native.yaml"));
    o.wasm = Some(PathBuf::from("/dev/null"));
    o.component_log_level = "grpc:info".to_string();
    let envoy = Envoy::start(o).unwrap();
    let client = envoy.client(ConnectionMode::KeepAlive);
    let mut passed = 0;
    for _ in 0..25 {
        let r = client
            .send(&Request::get("/api/items").header("x-client-id", "alice"))
            .unwrap();
        if r.status == 200 {
            passed += 1;
        }
    }
    assert_eq!(passed, 20);
    // Outside /api: no descriptor, no limit.
    let r = client
        .send(&Request::get("/other").header("x-client-id", "alice"))
        .unwrap();
    assert_eq!(r.status, 200);
    let keys = dump(&redis);
    assert_eq!(
        keys.lines()
            .filter(
                |l| l.starts_with("rl:{demo|c=alice}|api-global/c=alice|0|token_bucket|20|60000 ")
            )
            .count(),
        1,
        "{keys}"
    );
    drop(envoy);
    gw.stop().await.unwrap();
}

/// The gateway's deny cache (`--deny-cache-entries`, `src/deny_cache.rs`) serves this
/// front end too: a token-bucket descriptor over its limit is answered
/// OVER_LIMIT from memory, with no Redis call and nothing written, until
/// Redis's wait is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_limit_descriptor_is_answered_from_the_deny_cache_without_redis() {
    let redis = Redis::start().unwrap();
    let work = dir("deny-cache");
    let gw = gateway(&redis, &work, &[FW], &[], None).await;
    let mut c = client(&gw).await;
    async fn tb(c: &mut RateLimitServiceClient<tonic::transport::Channel>) -> (Code, u32) {
        let r = ask(c, "fw", vec![descriptor(&[("tb", "dee")], None)], None)
            .await
            .unwrap();
        codes(&r).1[0]
    }
    assert_eq!(tb(&mut c).await, (Code::Ok, 1));
    assert_eq!(tb(&mut c).await, (Code::Ok, 0));
    assert_eq!(tb(&mut c).await, (Code::OverLimit, 0));
    let check_calls = || {
        gw.app
            .metrics
            .redis_latency
            .with_label_values(&["check"])
            .get_sample_count()
    };
    let (calls, before) = (check_calls(), dump(&redis));
    // 2 a minute: the next token is 30 s away, far beyond these 20 calls.
    for _ in 0..20 {
        assert_eq!(tb(&mut c).await, (Code::OverLimit, 0));
    }
    assert_eq!(
        check_calls(),
        calls,
        "an over-limit descriptor called Redis"
    );
    assert_eq!(
        dump(&redis),
        before,
        "an over-limit descriptor wrote to Redis"
    );
    assert_eq!(gw.app.metrics.deny_cache_hits.get(), 20);
    gw.stop().await.unwrap();
}

/// A fixed-window count is capped below 2^53: a caller's large
/// `hits_addend`s cannot push the stored count past what `INCRBY` holds
/// (2^63), where it used to fail and answer UNKNOWN, which a native Envoy
/// with `failure_mode_deny: false` lets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_window_count_near_the_integer_limit_stays_over_the_limit() {
    let redis = Redis::start().unwrap();
    let work = dir("fw-overflow");
    let gw = gateway(&redis, &work, &[FW], &[], None).await;
    let mut c = client(&gw).await;
    align(60, 10_000);
    let big = 1u64 << 53;
    let user = |hits| vec![descriptor(&[("user", "eve")], Some(hits))];
    let r = ask(&mut c, "fw", user(big), None).await.unwrap();
    assert_eq!(codes(&r).1, [(Code::OverLimit, 0)]);
    let key = dump(&redis).split_whitespace().next().unwrap().to_string();
    // Where 1,023 more such calls would have brought it.
    redis
        .cli(&["SET", &key, "9223372036854775000", "KEEPTTL"])
        .unwrap();
    for _ in 0..3 {
        let r = ask(&mut c, "fw", user(big), None).await.unwrap();
        assert_eq!(codes(&r), (Code::OverLimit, vec![(Code::OverLimit, 0)]));
    }
    let stored = redis.cli(&["GET", &key]).unwrap();
    assert_eq!(
        stored.trim(),
        big.to_string(),
        "the count is capped at 2^53"
    );
    gw.stop().await.unwrap();
}

/// What envoyproxy/ratelimit users write for Envoy's `masked_remote_address`
/// action (its value is the client's network, `10.1.2.0/24` or
/// `2001:db8:1:2::/64`) and for wildcard values (`/api/*`).
const MASKED_AND_WILDCARD: &str = "domain: edge
descriptors:
- key: masked_remote_address
  rate_limit: {unit: minute, requests_per_unit: 3}
- key: masked_remote_address
  value: 10.9.9.0/24
  rate_limit: {unit: minute, requests_per_unit: 1}
- key: path
  value: /api/*
  rate_limit: {unit: minute, requests_per_unit: 2}
- key: path
  value: /shared/*
  share_threshold: true
  rate_limit: {unit: minute, requests_per_unit: 2}
";

/// `--rls-config` reads a `masked_remote_address` descriptor and wildcard
/// values as envoyproxy/ratelimit does: one counter per network (an exact
/// network's own limit over the key's), one per value under a wildcard, one
/// for all of them with `share_threshold`, and no limit for a value no
/// entry covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_remote_address_and_wildcard_values_decide_as_envoyproxy_ratelimit() {
    let redis = Redis::start().unwrap();
    let work = dir("masked");
    let gw = gateway(&redis, &work, &[MASKED_AND_WILDCARD], &[], None).await;
    let mut c = client(&gw).await;
    align(60, 10_000);
    let remaining = |key: &'static str, value: &'static str, n: usize| {
        let mut c = c.clone();
        async move {
            let mut seen = Vec::new();
            for _ in 0..n {
                let r = ask(
                    &mut c,
                    "edge",
                    vec![descriptor(&[(key, value)], None)],
                    None,
                )
                .await
                .unwrap();
                seen.push(codes(&r).1[0]);
            }
            seen
        }
    };
    use Code::{Ok as Y, OverLimit as N};
    assert_eq!(
        remaining("masked_remote_address", "10.1.2.0/24", 4).await,
        [(Y, 2), (Y, 1), (Y, 0), (N, 0)]
    );
    assert_eq!(
        remaining("masked_remote_address", "2001:db8:1:2::/64", 4).await,
        [(Y, 2), (Y, 1), (Y, 0), (N, 0)]
    );
    assert_eq!(
        remaining("masked_remote_address", "10.9.9.0/24", 2).await,
        [(Y, 0), (N, 0)]
    );
    assert_eq!(
        remaining("path", "/api/a", 3).await,
        [(Y, 1), (Y, 0), (N, 0)]
    );
    assert_eq!(remaining("path", "/api/b", 1).await, [(Y, 1)]);
    assert_eq!(remaining("path", "/shared/a", 2).await, [(Y, 1), (Y, 0)]);
    assert_eq!(remaining("path", "/shared/b", 1).await, [(N, 0)]);
    // No entry covers it: OK without a limit, nothing counted.
    let r = ask(
        &mut c,
        "edge",
        vec![descriptor(&[("path", "/other")], None)],
        None,
    )
    .await
    .unwrap();
    assert_eq!(codes(&r).0, Code::Ok);
    assert!(r.statuses[0].current_limit.is_none(), "{r:?}");
    let keys = dump(&redis);
    assert_eq!(keys.lines().count(), 6, "{keys}");
    gw.stop().await.unwrap();
}
