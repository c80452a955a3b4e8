//! Unit tests of compiling and evaluating a plan.

use super::*;
use crate::config;
use crate::policy::request::RequestInfo;

fn plan(json: &str) -> Plan {
    Plan::compile(&config::parse(json.as_bytes()).unwrap(), [7; 16])
}

fn request(
    plan: &Plan,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    peer: &str,
) -> RequestInfo {
    let headers = plan
        .header_names
        .iter()
        .map(|n| match n.as_str() {
            ":method" => Some(method.as_bytes().to_vec()),
            ":path" => Some(path.as_bytes().to_vec()),
            n => headers
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.as_bytes().to_vec()),
        })
        .collect();
    RequestInfo {
        headers,
        source_address: Some(peer.as_bytes().to_vec()),
        ..RequestInfo::default()
    }
}

const EXAMPLE: &str = r#"{
  "domain": "demo",
  "rules": [
    { "name": "per-client", "key": ["client"], "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] },
    { "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] }, "key": ["client", "path"], "limits": [ { "requests": 5, "per": "1m" } ] },
    { "name": "tenant", "key": ["header:X-Tenant"], "limits": [ { "requests": 5, "per": "1m" } ] }
  ],
  "costs": [ { "match": { "path_prefix": "/search" }, "cost": 5 }, { "match": { "path_prefix": "/s" }, "cost": 2 } ]
}"#;

#[test]
fn reads_only_needed_headers() {
    let p = plan(EXAMPLE);
    assert_eq!(
        p.header_names,
        [
            ":method",
            ":path",
            "x-client-id",
            "x-forwarded-for",
            "x-tenant"
        ]
    );
    // X-Forwarded-For is registered but not read without trusted hops.
    assert_eq!(p.header_needed, [true, true, true, false, true]);
    assert_eq!(p.source, SourceNeed::WithoutClient);
    let only_client = plan(
        r#"{"domain":"d","rules":[{"name":"r","key":["client"],"limits":[{"requests":1,"per":1}]}]}"#,
    );
    assert_eq!(only_client.header_needed, [false, false, true, false]);
    let by_ip = plan(
        r#"{"domain":"d","identity":{"trusted_proxy_hops":1},"rules":[{"name":"r","key":["ip"],"match":{"methods":["GET"]},"limits":[{"requests":1,"per":1}]}]}"#,
    );
    assert_eq!(by_ip.header_needed, [true, false, true, true]);
    assert_eq!(by_ip.source, SourceNeed::Always);
    assert_eq!(p.table.sets, 16_384);
    assert_eq!(p.table.set_key(3), "ratelimit-wasm/set/demo/16384/3");
}

#[test]
fn matching_rules_and_first_cost_win() {
    let p = plan(EXAMPLE);
    let get = p.evaluate(&request(
        &p,
        "GET",
        "/search?q",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    assert_eq!(get.cost, 5);
    assert_eq!(
        get.buckets
            .iter()
            .map(|b| (b.rule, b.cost))
            .collect::<Vec<_>>(),
        [(0, 5)]
    );
    let up = p.evaluate(&request(
        &p,
        "POST",
        "/upload",
        &[("x-tenant", "t")],
        "1.1.1.1:1",
    ));
    assert_eq!(up.cost, 1);
    assert_eq!(
        up.buckets.iter().map(|b| b.rule).collect::<Vec<_>>(),
        [0, 1, 2]
    );
}

#[test]
fn buckets_differ_by_client_and_rule_and_are_stable() {
    let p = plan(EXAMPLE);
    let a1 = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    let a2 = p.evaluate(&request(
        &p,
        "GET",
        "/x",
        &[("x-client-id", "a")],
        "2.2.2.2:1",
    ));
    let b = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "b")],
        "1.1.1.1:1",
    ));
    assert_eq!(a1.buckets, a2.buckets);
    assert_ne!(a1.buckets[0].fingerprint, b.buckets[0].fingerprint);
    let other_seed = Plan::compile(&config::parse(EXAMPLE.as_bytes()).unwrap(), [8; 16]);
    let a3 = other_seed.evaluate(&request(
        &other_seed,
        "GET",
        "/",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    assert_ne!(a1.buckets[0].fingerprint, a3.buckets[0].fingerprint);
}

const TIERS: &str = r#"{
  "domain": "d",
  "tiers": { "free": {}, "pro": {}, "staff": { "unlimited": true } },
  "identity": { "default_tier": "free", "tier_header": "x-tier",
    "clients": { "acme": { "tier": "pro", "limits": { "api": [ { "requests": 500, "per": "1m" } ] } },
                 "root": { "unlimited": true }, "trial": { "soft": true } } },
  "rules": [
    { "name": "api", "key": ["client"], "limits": [ { "requests": 10, "per": "1m" } ],
      "tiers": { "pro": [ { "requests": 100, "per": "1m" } ] }, "cost": 3 },
    { "name": "watch", "mode": "shadow", "limits": [ { "requests": 1, "per": "1h" } ] }
  ]
}"#;

fn capacity(p: &Plan, e: &Evaluation) -> u64 {
    let b = e.buckets[0];
    p.limits(b.rule, b.variant)[0].0.capacity
}

#[test]
fn tiers_come_from_the_static_map_then_the_credential_then_the_default() {
    let p = plan(TIERS);
    let free = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "x")],
        "1.1.1.1:1",
    ));
    assert_eq!(capacity(&p, &free), 10);
    let pro = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "x"), ("x-tier", "pro")],
        "1.1.1.1:1",
    ));
    assert_eq!(capacity(&p, &pro), 100);
    assert_ne!(free.buckets[0].fingerprint, pro.buckets[0].fingerprint);
    let unknown = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "x"), ("x-tier", "gold")],
        "1.1.1.1:1",
    ));
    assert_eq!(capacity(&p, &unknown), 10);
    // acme is pro by the static map and has its own override.
    let acme = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "acme"), ("x-tier", "free")],
        "1.1.1.1:1",
    ));
    assert_eq!(capacity(&p, &acme), 500);
    assert_eq!(acme.buckets[0].cost, 3, "the rule's cost overrides");
    assert_eq!(acme.shadow.len(), 1, "shadow rules go aside");
}

#[test]
fn unlimited_and_soft_clients() {
    let p = plan(TIERS);
    let root = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "root")],
        "1.1.1.1:1",
    ));
    assert!(root.unlimited && root.buckets.is_empty() && root.shadow.is_empty());
    let staff = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-tier", "staff")],
        "1.1.1.1:1",
    ));
    assert!(staff.unlimited);
    let trial = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "trial")],
        "1.1.1.1:1",
    ));
    assert!(trial.soft && trial.buckets.is_empty());
    assert_eq!(trial.shadow.len(), 2);
}

#[test]
fn metadata_identity_ignores_headers() {
    let json = r#"{"domain":"d","tiers":{"free":{},"pro":{}},
        "identity":{"default_tier":"free","client_id_metadata":["envoy.filters.http.jwt_authn","payload","sub"],
                    "tier_metadata":["envoy.filters.http.jwt_authn","payload","tier"]},
        "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}],"tiers":{"pro":[{"requests":100,"per":"1m"}]}}]}"#;
    let p = plan(json);
    assert_eq!(
        p.client_id_property.as_deref().unwrap(),
        [
            "metadata",
            "filter_metadata",
            "envoy.filters.http.jwt_authn",
            "payload",
            "sub"
        ]
    );
    let mut forged = request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "victim"), ("x-tier", "pro")],
        "1.1.1.1:1",
    );
    let anonymous = p.evaluate(&forged);
    assert_eq!(capacity(&p, &anonymous), 10);
    let by_ip = p.evaluate(&request(&p, "GET", "/", &[], "1.1.1.1:1"));
    assert_eq!(
        anonymous.buckets, by_ip.buckets,
        "a header id is not trusted"
    );
    forged.client_metadata = Some(b"alice".to_vec());
    forged.tier_metadata = Some(b"pro".to_vec());
    let alice = p.evaluate(&forged);
    assert_eq!(capacity(&p, &alice), 100);
}

#[test]
fn a_quota_limit_applies_when_no_tiers_are_declared() {
    let json = r#"{"domain":"d","global":{"cluster":"gw"},
        "rules":[{"name":"api","key":["client"],"limits":[{"requests":10,"per":"1m"}]}],
        "quotas":[{"name":"daily","key":["client"],"period":"day","limit":7,"upgrade_url":"https://e.com/up"}]}"#;
    let p = plan(json);
    let e = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    assert_eq!(e.quotas.len(), 1);
    assert_eq!(e.quotas[0].limit, 7);
}

#[test]
fn quotas_by_tier_and_client() {
    let json = r#"{"domain":"d","tiers":{"free":{},"pro":{}},"global":{"cluster":"gw"},
        "identity":{"default_tier":"free","tier_header":"x-tier","clients":{"big":{"quotas":{"monthly":5}}}},
        "rules":[{"name":"api","key":["client"],"limits":[{"requests":100,"per":"1m"}]}],
        "costs":[{"match":{"path_prefix":"/export"},"cost":50}],
        "quotas":[{"name":"monthly","key":["client"],"period":"month","tiers":{"free":100,"pro":1000},
                   "upgrade_url":"https://example.com/upgrade","count":"cost"}]}"#;
    let p = plan(json);
    let free = p.evaluate(&request(
        &p,
        "GET",
        "/export",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    assert_eq!(
        free.quotas,
        [QuotaBucket {
            quota: 0,
            key: "monthly/c=a".into(),
            tag: "c=a".into(),
            limit: 100,
            variant: ratelimit_protocol::Variant::Tier("free".into()),
            amount: 50
        }]
    );
    let pro = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "a"), ("x-tier", "pro")],
        "1.1.1.1:1",
    ));
    assert_eq!((pro.quotas[0].limit, pro.quotas[0].amount), (1000, 1));
    let big = p.evaluate(&request(
        &p,
        "GET",
        "/",
        &[("x-client-id", "big")],
        "1.1.1.1:1",
    ));
    assert_eq!(big.quotas[0].limit, 5);
    // The gateway is told which amount applies, never the amount.
    use ratelimit_protocol::Variant;
    assert_eq!(pro.quotas[0].variant, Variant::Tier("pro".into()));
    assert_eq!(big.quotas[0].variant, Variant::Client("big".into()));
}

/// The stand-in limit of a global rule with `requests` per `per` seconds
/// shared by `instances` proxies.
fn stand_in(requests: u64, per: u64, instances: u64, algorithm: &str) -> (Limit, u64) {
    let p = plan(&format!(
        r#"{{"domain":"d","global":{{"cluster":"gw","instances":{instances}}},
            "rules":[{{"name":"g","scope":"global","algorithm":"{algorithm}",
                       "limits":[{{"requests":{requests},"per":{per}}}]}}]}}"#
    ));
    let f = p.rules[0].fallback.unwrap();
    assert!(p.rules[f].stand_in);
    p.rules[f].limits(0)[0]
}

/// Admissions of one proxy that retries the moment its stand-in allows,
/// from a full bucket at 0 until `horizon_ns` included: the most it can admit.
fn greedy_admissions(limit: &Limit, horizon_ns: u64) -> u64 {
    let (mut tat, mut now, mut admitted) = (None, 0, 0);
    while now <= horizon_ns {
        let c = limit.check(tat, now, 1);
        if c.allowed {
            tat = Some(c.new_state);
            admitted += 1;
        } else {
            now += c.retry_after_ns.max(1);
        }
    }
    admitted
}

#[test]
fn the_failure_mode_local_stand_in_keeps_the_exact_share_with_more_proxies_than_requests() {
    const SEC: u64 = 1_000_000_000;
    // 3/s over 10 proxies: one token per 10/3 s each, a bucket of one.
    let (limit, window_secs) = stand_in(3, 1, 10, "token_bucket");
    assert_eq!(
        (limit.capacity, limit.period_ns, limit.burst),
        (1, 3_333_333_334, 1)
    );
    assert_eq!(window_secs, 4, "RateLimit-Policy w: the period rounded up");
    // Over 10 s (and 1 µs for the period's rounding to a whole ns): the
    // bucket of 1 plus 3 per 10 s. The fleet: 10 × 4 = 40 = 3 × 10 + 10 × 1.
    assert_eq!(greedy_admissions(&limit, 10 * SEC + 1_000), 4);
    assert_eq!(greedy_admissions(&limit, 100 * SEC + 1_000), 31);
    // Where the share divides evenly, the period is the rule's own.
    let (limit, window_secs) = stand_in(4, 60, 2, "token_bucket");
    assert_eq!(
        (limit.capacity, limit.period_ns, window_secs),
        (2, 60 * SEC, 60)
    );
    // 7/s over 2 proxies: 3 per 6/7 s each, rounded up to the ns (never above the share).
    let (limit, _) = stand_in(7, 1, 2, "sliding_window");
    assert_eq!((limit.capacity, limit.period_ns), (3, 857_142_858));
    // The longest period the validation allows still fits: 1 per 366 d over 10^4 proxies.
    let (limit, _) = stand_in(1, 366 * 86_400, 10_000, "token_bucket");
    assert_eq!((limit.capacity, limit.period_ns), (1, u64::MAX));
}

#[test]
fn a_global_concurrency_rule_is_one_slot_per_request_on_the_gateway_without_stand_in_or_lease() {
    let p = plan(
        r#"{"domain": "d",
        "global": {"cluster": "gw", "failure_mode": "local", "instances": 2, "lease": {"fraction": 0.1}},
        "rules": [{"name": "streams", "scope": "global", "key": ["client"],
                   "limits": [{"concurrent": 3}]}],
        "costs": [{"match": {"path_prefix": "/"},
                   "cost_from": {"header": "x-usage", "max": 100, "reserve": 40}}]}"#,
    );
    // No stand-in rule follows it, and it settles (its slot is released through the gateway).
    assert_eq!(p.rules.len(), 1);
    assert!(p.settling);
    let e = p.evaluate(&request(
        &p,
        "GET",
        "/v1",
        &[("x-client-id", "a")],
        "1.1.1.1:1",
    ));
    assert!(e.in_flight.is_empty() && e.buckets.is_empty() && e.fallback.is_empty());
    let [g] = e.global.as_slice() else {
        panic!("one global bucket: {:?}", e.global);
    };
    // One slot, whatever `costs[]` reserves, and never read from the response.
    assert_eq!((g.rule, g.cost, g.key.as_str()), (0, 1, "streams/c=a"));
    assert_eq!(p.meter_of(0, e.cost_meter), None);
    assert!(e.cost_meter.is_some());
    assert_eq!(crate::global::lease::locate(&p, g), None);
}

#[test]
fn properties_and_headers_are_fetched_only_when_something_reads_them() {
    let plain = plan(
        r#"{"domain":"d","rules":[{"name":"r","key":["client"],"limits":[{"requests":1,"per":"1m"}]}]}"#,
    );
    assert!(plain.properties.is_empty());
    assert!(!plain
        .header_names
        .iter()
        .any(|n| n == ":authority" || n == "cookie"));
    let reads = plan(
        r#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":1,"per":"1m"}],
            "match":{"route":"api","host":"a.example","any":[{"route":"api"},{"cookie":{"s":true}}]},
            "key":["route","metadata:jwt/payload/org","query:k"]}]}"#,
    );
    assert_eq!(
        reads.properties,
        vec![
            ["metadata", "filter_metadata", "jwt", "payload", "org"]
                .map(String::from)
                .to_vec(),
            vec!["xds".to_string(), "route_name".to_string()],
        ]
    );
    let needed: Vec<&String> = reads
        .header_names
        .iter()
        .zip(&reads.header_needed)
        .filter_map(|(n, needed)| needed.then_some(n))
        .collect();
    assert_eq!(needed, [":path", "x-client-id", ":authority", "cookie"]);
}

const BY_PLAN: &str = r#"{
  "domain": "demo",
  "rules": [
    { "name": "plan", "key": ["ip"], "limits": [ { "requests": 3, "per": "1m" } ],
      "limits_by": { "route_metadata": "ratelimit/plan",
        "sets": { "premium": [ { "requests": 100, "per": "1m" } ], "basic": [ { "requests": 10, "per": "1m" } ] } } },
    { "name": "org", "scope": "global", "key": ["ip"], "limits": [ { "requests": 4, "per": "1m" } ],
      "limits_by": { "metadata": "envoy.filters.http.jwt_authn/payload/plan",
        "sets": { "gold": [ { "requests": 50, "per": "1m" } ] } } }
  ],
  "global": { "cluster": "gw", "authority": "gw" }
}"#;

/// The request with each property the plan reads at `path` set to `value`.
fn with_props(p: &Plan, mut r: RequestInfo, props: &[(&[&str], &str)]) -> RequestInfo {
    for (path, value) in props {
        let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        if let Some(id) = p.properties.iter().position(|q| *q == path) {
            r = r.with_property(id, value.as_bytes());
        }
    }
    r
}

#[test]
fn limits_by_picks_a_set_by_metadata_and_falls_back_to_the_rules_own() {
    let p = plan(BY_PLAN);
    // One property a rule: nothing else is read for it.
    assert_eq!(
        p.properties,
        [
            [
                "xds",
                "route_metadata",
                "filter_metadata",
                "ratelimit",
                "plan"
            ]
            .map(String::from)
            .to_vec(),
            [
                "metadata",
                "filter_metadata",
                "envoy.filters.http.jwt_authn",
                "payload",
                "plan"
            ]
            .map(String::from)
            .to_vec(),
        ]
    );
    let route: &[&str] = &[
        "xds",
        "route_metadata",
        "filter_metadata",
        "ratelimit",
        "plan",
    ];
    let jwt: &[&str] = &[
        "metadata",
        "filter_metadata",
        "envoy.filters.http.jwt_authn",
        "payload",
        "plan",
    ];
    let capacity = |props: &[(&[&str], &str)]| {
        let r = with_props(&p, request(&p, "GET", "/", &[], "10.0.0.1:5"), props);
        let e = p.evaluate(&r);
        let local = p.limits(e.buckets[0].rule, e.buckets[0].variant)[0]
            .0
            .capacity;
        let g = &e.global[0];
        let wire = p.rules[g.rule].variants[g.variant].wire.clone();
        (
            local,
            p.limits(g.rule, g.variant)[0].0.capacity,
            wire,
            e.limits_by_default,
        )
    };
    use ratelimit_protocol::Variant;
    let scale = |n: u64| p.limits(0, 0)[0].0.capacity / 3 * n;
    assert_eq!(
        capacity(&[(route, "premium"), (jwt, "gold")]),
        (scale(100), scale(50), Variant::Set("gold".into()), 0)
    );
    assert_eq!(
        capacity(&[(route, "basic")]),
        (scale(10), scale(4), Variant::Default, 1)
    );
    // A name not among the sets, and a case that differs, get the rule's own.
    assert_eq!(
        capacity(&[(route, "platinum"), (jwt, "GOLD")]),
        (scale(3), scale(4), Variant::Default, 2)
    );
    assert_eq!(capacity(&[]), (scale(3), scale(4), Variant::Default, 2));
}
