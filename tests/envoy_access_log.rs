//! The filter's decision in a real Envoy's access log: the shipped template
//! (`envoy/envoy.yaml`) logs `%FILTER_STATE(wasm.ratelimit:PLAIN)%` after
//! `ratelimit: `, and each outcome reads as `docs/operations.md` ("The
//! access log") says, with the rule, remaining, cost and source. Envoy at
//! `--concurrency 2`, its access log written to a file (the template's
//! format); the gateway and Redis behind the global rule and the quota.

use std::time::{Duration, Instant};

use serde_json::json;
use testkit::redis::Redis;
use testkit::{Client, ConnectionMode, Envoy, EnvoyOptions, Gateway, GatewayOptions};

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// One rule per outcome, each on its own path, a global rule and a quota
/// through the gateway (`failure_mode: open`).
fn config() -> String {
    json!({
        "domain": "access-log",
        "identity": { "client_id_header": "x-client-id" },
        "rules": [
            { "name": "per-client", "match": { "path_prefix": "/deny" }, "key": ["client"],
              "limits": [ { "requests": 1, "per": "1h" } ] },
            { "name": "watch", "mode": "shadow", "match": { "path_prefix": "/shadow" },
              "key": ["client"], "limits": [ { "requests": 1, "per": "1h" } ] },
            { "name": "slow", "match": { "path_prefix": "/slow" }, "key": ["client"],
              "limits": [ { "requests": 2, "per": "1h" } ],
              "graduated": { "delay_at": 1.0, "delay_ms": 50, "reject_at": 2.0 } },
            { "name": "shared", "scope": "global", "match": { "path_prefix": "/global" },
              "key": ["client"], "limits": [ { "requests": 100, "per": "1h" } ] }
        ],
        "quotas": [
            { "name": "monthly", "match": { "path_prefix": "/quota" }, "key": ["client"],
              "period": "month", "limit": 1, "upgrade_url": "https://example.com/upgrade" }
        ],
        "global": { "cluster": "ratelimit_gateway", "timeout_ms": 200, "failure_mode": "open",
                    "circuit": { "failures": 5, "cooldown_ms": 1000 } },
        "response": { "retry_jitter": 0 }
    })
    .to_string()
}

/// The `ratelimit: ` part of the access log's line for `path`, waiting
/// for Envoy to flush its log (every second by default).
fn decision(envoy: &Envoy, path: &str) -> String {
    let needle = format!(" {path} HTTP/1.1\"");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = envoy.access_log();
        if let Some(line) = text.lines().find(|l| l.contains(&needle)) {
            return line
                .split_once(" ratelimit: ")
                .map(|(_, d)| d.to_string())
                .unwrap_or_else(|| panic!("no `ratelimit: ` in {line:?}"));
        }
        assert!(
            Instant::now() < deadline,
            "no access log line for {path}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn get(c: &Client, path: &str) -> u16 {
    c.must_get(path, &[("x-client-id", "ann")]).status
}

#[test]
fn every_outcome_has_its_line_in_the_access_log() {
    let config = config();
    let redis = ok(Redis::start(), "starting redis-server");
    let mut gateway = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(&config)
                .args(&["--redis-timeout-ms", "100"]),
        ),
        "starting ratelimit-gateway",
    );
    let envoy = ok(
        Envoy::start(
            EnvoyOptions::new(&config)
                .gateway_port(gateway.port())
                .access_log_file(),
        ),
        "starting Envoy",
    );
    let c = envoy.client(ConnectionMode::NewPerRequest);

    // Local: the rule's last token, then its refusal (remaining before the
    // request, the cost it asked).
    assert_eq!(get(&c, "/deny?n=1"), 200);
    assert_eq!(get(&c, "/deny?n=2"), 429);
    // A shadow rule past its limit lets the request through.
    assert_eq!(get(&c, "/shadow?n=1"), 200);
    assert_eq!(get(&c, "/shadow?n=2"), 200);
    // Graduated: the third request is past `delay_at` (150% of 2).
    assert_eq!(get(&c, "/slow?n=1"), 200);
    assert_eq!(get(&c, "/slow?n=2"), 200);
    assert_eq!(get(&c, "/slow?n=3"), 200);
    // Through the gateway: a global rule, then a quota of one spent.
    assert_eq!(get(&c, "/global?n=1"), 200);
    assert_eq!(get(&c, "/quota?n=1"), 200);
    assert_eq!(get(&c, "/quota?n=2"), 403);
    // No rule applies: the filter sets nothing.
    assert_eq!(get(&c, "/other"), 200);
    // The gateway down: failure_mode open lets the global rule's request by.
    gateway.kill();
    assert_eq!(get(&c, "/global?n=2"), 200);

    let want = [
        (
            "/deny?n=1",
            "outcome=allowed rule=per-client remaining=0 cost=1 source=local",
        ),
        (
            "/deny?n=2",
            "outcome=denied rule=per-client remaining=0 cost=1 source=local",
        ),
        (
            "/shadow?n=1",
            "outcome=allowed rule=watch remaining=0 cost=1 source=local",
        ),
        (
            "/shadow?n=2",
            "outcome=shadow_denied rule=watch remaining=0 cost=1 source=local",
        ),
        (
            "/slow?n=2",
            "outcome=allowed rule=slow remaining=0 cost=1 source=local",
        ),
        (
            "/slow?n=3",
            "outcome=delayed rule=slow remaining=0 cost=1 source=local",
        ),
        (
            "/global?n=1",
            "outcome=allowed rule=shared remaining=99 cost=1 source=gateway",
        ),
        (
            "/quota?n=1",
            "outcome=allowed rule=- remaining=- cost=- source=gateway",
        ),
        (
            "/quota?n=2",
            "outcome=quota_exhausted rule=monthly remaining=0 cost=1 source=gateway",
        ),
        ("/other", "-"),
        (
            "/global?n=2",
            "outcome=allowed rule=- remaining=- cost=- source=failure_open",
        ),
    ];
    let got: Vec<(&str, String)> = want
        .iter()
        .map(|(p, _)| (*p, decision(&envoy, p)))
        .collect();
    let want: Vec<(&str, String)> = want.iter().map(|(p, w)| (*p, w.to_string())).collect();
    assert_eq!(got, want, "access log:\n{}", envoy.access_log());
}
