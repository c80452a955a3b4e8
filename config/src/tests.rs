//! Unit tests of parsing, defaults and validation.

use super::duration::Seconds;
use super::*;
use serde_json::json;

fn err(v: serde_json::Value) -> String {
    parse(v.to_string().as_bytes()).unwrap_err().to_string()
}

fn base() -> serde_json::Value {
    json!({
        "domain": "demo",
        "rules": [{ "name": "r", "key": ["client"], "limits": [{ "requests": 5, "per": "1m" }] }]
    })
}

#[test]
fn the_issue_example_parses_with_defaults() {
    let c = parse(
        br#"{
          "domain": "demo",
          "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
          "rules": [
            { "name": "per-client", "key": ["client"],
              "limits": [ { "requests": 60, "per": "1m" }, { "requests": 10, "per": "1s" } ] },
            { "name": "uploads", "match": { "path_prefix": "/upload", "methods": ["POST"] },
              "key": ["client", "path"], "limits": [ { "requests": 5, "per": "1m" } ] },
            { "name": "per-ip", "key": ["ip"], "limits": [ { "requests": 50, "per": "1s" } ] }
          ],
          "costs": [ { "match": { "path_prefix": "/search" }, "cost": 5 },
                     { "match": { "path_prefix": "/export" }, "cost": 10 } ],
          "response": { "headers": "both", "problem_type": "https://iana.org/assignments/http-problem-types#quota-exceeded" }
        }"#,
    )
    .unwrap();
    assert_eq!(c.rules.len(), 3);
    assert_eq!(c.rules[0].limits[1].per, Seconds(1));
    assert_eq!(c.max_buckets, DEFAULT_BUCKETS);
    assert_eq!(c.on_error, OnError::Allow);
    let d = parse(base().to_string().as_bytes()).unwrap();
    assert_eq!(d.identity.client_id_header, "x-client-id");
    assert_eq!(d.response.headers, HeaderStyle::Both);
    assert_eq!(d.response.problem_type, DEFAULT_PROBLEM_TYPE);
}

#[test]
fn bad_duration_names_its_path() {
    let mut v = base();
    v["rules"][0]["limits"][0]["per"] = json!("10x");
    assert_eq!(err(v), r#"rules[0].limits[0].per: "10x" is not a duration"#);
}

#[test]
fn unknown_fields_are_refused_with_their_path() {
    let mut v = base();
    v["rules"][0]["limitz"] = json!([]);
    let e = err(v);
    assert!(
        e.starts_with("rules[0].limitz: unknown field `limitz`"),
        "{e}"
    );
    let mut top = base();
    top["extra"] = json!(1);
    assert!(err(top).contains("unknown field `extra`"));
}

#[test]
fn semantic_errors_name_their_path() {
    let cases = [
        ("/rules/0/limits/0/requests", json!(0), "rules[0].limits[0].requests: must be between 1 and 1000000000"),
        ("/rules/0/key/0", json!("cookie"), r#"rules[0].key[0]: "cookie" is not a key part (client, ip, method, path, host, route, ip/<len>, header:<name>, query:<name>, cookie:<name> or metadata:<filter>/<key>)"#),
        ("/rules/0/name", json!("has space"), r#"rules[0].name: "has space" must be 1-64 characters of A-Z a-z 0-9 - _ . :"#),
        ("/max_buckets", json!(1), "max_buckets: must be between 64 and 16777216"),
        ("/response/headers", json!("all"), "response.headers: unknown variant `all`, expected one of `both`, `legacy`, `ietf`, `none`"),
        ("/rules/0/limits", json!([]), "rules[0].limits: must hold 1 to 8 limits"),
        ("/identity", json!({"trusted_proxy_hops": 99}), "identity.trusted_proxy_hops: must be at most 16"),
    ];
    for (ptr, value, want) in cases {
        let mut v = base();
        let mut slot = &mut v;
        for seg in ptr.split('/').skip(1) {
            slot = match seg.parse::<usize>() {
                Ok(i) if slot.is_array() => &mut slot[i],
                _ => &mut slot[seg],
            };
        }
        *slot = value;
        assert_eq!(err(v), want, "{ptr}");
    }
}

#[test]
fn duplicate_rule_names_and_bad_matches_are_refused() {
    let mut v = base();
    let r = v["rules"][0].clone();
    v["rules"].as_array_mut().unwrap().push(r);
    assert_eq!(err(v), r#"rules[1].name: "r" is used by an earlier rule"#);
    let mut m = base();
    m["rules"][0]["match"] = json!({"path_prefix": "api"});
    assert_eq!(
        err(m),
        r#"rules[0].match.path_prefix: "api" must start with /"#
    );
    let mut c = base();
    c["costs"] = json!([{"match": {"path_prefix": "/x"}, "cost": 0}]);
    assert_eq!(err(c), "costs[0].cost: must be between 1 and 1000000");
}

#[test]
fn too_many_rules_names_the_limit() {
    let mut v = base();
    let rules: Vec<_> = (0..=MAX_RULES)
        .map(|i| json!({"name": format!("r{i}"), "limits": [{"requests": 1, "per": 1}]}))
        .collect();
    v["rules"] = json!(rules);
    assert_eq!(err(v), "rules: 1025 rules exceed the maximum of 1024");
}

#[test]
fn too_many_quotas_names_the_limit() {
    let mut v = base();
    v["global"] = json!({"cluster": "gw"});
    let quotas: Vec<_> = (0..=MAX_QUOTAS)
        .map(|i| json!({"name": format!("q{i}"), "period": "month", "limit": 5, "upgrade_url": "https://x"}))
        .collect();
    v["quotas"] = json!(quotas);
    assert_eq!(err(v.clone()), "quotas: 65 quotas exceed the maximum of 64");
    v["quotas"].as_array_mut().unwrap().pop();
    assert!(parse(v.to_string().as_bytes()).is_ok());
}

#[test]
fn not_json_and_wrong_types() {
    assert!(parse(b"{")
        .unwrap_err()
        .to_string()
        .starts_with("configuration is not valid JSON"));
    assert_eq!(
        err(json!({"domain": "d", "rules": "x"})),
        "rules: invalid type: string \"x\", expected a sequence"
    );
    assert_eq!(
        err(json!({"rules": []})),
        "configuration: missing field `domain`"
    );
}

#[test]
fn policy_fields_are_checked_with_their_paths() {
    let cases = [
        (json!({"tiers": {"free": {}}}), "identity.default_tier: required when tiers are declared"),
        (
            json!({"tiers": {"free": {}}, "identity": {"default_tier": "gold"}}),
            r#"identity.default_tier: "gold" is not a tier declared in tiers"#,
        ),
        (
            json!({"identity": {"clients": {"a": {"limits": {"nope": []}}}}}),
            r#"identity.clients.a.limits: "nope" is not a rule name"#,
        ),
        (
            json!({"quotas": [{"name": "q", "period": "month", "upgrade_url": "https://x"}]}),
            "quotas: need global: the gateway keeps quotas",
        ),
        (
            json!({"quotas": [{"name": "q", "period": "week", "upgrade_url": "https://x"}], "global": {"cluster": "gw"}}),
            "quotas[0].period: unknown variant `week`, expected one of `minute`, `hour`, `day`, `month`",
        ),
        (json!({"response": {"retry_jitter": 0.9}}), "response.retry_jitter: must be between 0 and 0.5"),
    ];
    for (extra, want) in cases {
        let mut v = base();
        for (k, val) in extra.as_object().unwrap() {
            v[k] = val.clone();
        }
        assert_eq!(err(v), want);
    }
}

#[test]
fn graduated_and_shadow_constraints() {
    let mut v = base();
    v["rules"][0]["graduated"] = json!({"delay_at": 1.0});
    assert_eq!(
        err(v),
        "rules[0].graduated.delay_ms: required with delay_at"
    );
    let mut v = base();
    v["rules"][0]["graduated"] = json!({"reject_at": 1.2, "block_at": 1.1, "block_for": "1m"});
    assert_eq!(
        err(v),
        "rules[0].graduated.block_at: must not be below reject_at"
    );
    let mut v = base();
    v["rules"][0]["limits"] = json!([{"requests": 1, "per": 1}, {"requests": 2, "per": 2}]);
    v["rules"][0]["graduated"] = json!({"warn_at": 0.5});
    assert_eq!(
        err(v),
        "rules[0].limits: needs exactly one limit: the rule is graduated, its stages are shares of it"
    );
    let mut v = base();
    v["rules"][0]["algorithm"] = json!("sliding_window");
    v["rules"][0]["graduated"] = json!({"warn_at": 0.5});
    assert_eq!(
        err(v),
        r#"rules[0].graduated: needs "algorithm": "token_bucket""#
    );
    // Shadow and graduated global rules are the gateway's to enforce.
    let mut v = base();
    v["global"] = json!({"cluster": "gw"});
    v["rules"][0]["scope"] = json!("global");
    v["rules"][0]["mode"] = json!("shadow");
    v["rules"][0]["graduated"] = json!({"warn_at": 0.5, "block_at": 2.0, "block_for": "1m"});
    assert!(crate::parse(v.to_string().as_bytes()).is_ok());
    // A graduated global rule's largest share counts in the 2^53 bound.
    let mut v = base();
    v["global"] = json!({"cluster": "gw"});
    v["rules"][0]["scope"] = json!("global");
    v["rules"][0]["limits"] = json!([{"requests": 100_000_000u64, "per": "1d"}]);
    assert!(crate::parse(v.to_string().as_bytes()).is_ok());
    v["rules"][0]["graduated"] = json!({"reject_at": 1.2});
    assert_eq!(
        err(v),
        "rules[0].limits[0].per: requests × per × the largest graduated share (reject_at, \
         block_at) must stay under 2^53 milliseconds for a global rule"
    );
    let mut v = base();
    v["rules"][0]["scope"] = json!("global");
    assert_eq!(
        err(v),
        r#"global: required because rules[0] has "scope": "global""#
    );
    let mut v = base();
    v["global"] = json!({"cluster": "gw", "timeout_ms": 0});
    assert_eq!(
        err(v),
        "global.timeout_ms: must be between 1 and 60000 (Envoy treats 0 as no timeout)"
    );
}

#[test]
fn coalescing_settings_are_checked_with_their_paths() {
    let cases = [
        (
            json!({"coalesce_us": 1_000_001}),
            "global.coalesce_us: must be between 0 (off) and 1000000",
        ),
        (
            json!({"max_batch": 0}),
            "global.max_batch: must be between 1 and 256",
        ),
        (
            json!({"max_batch": 257}),
            "global.max_batch: must be between 1 and 256",
        ),
        (
            json!({"batch_path": "v3"}),
            "global.batch_path: \"v3\" is not an absolute path of RFC 3986 characters",
        ),
    ];
    for (fields, message) in cases {
        let mut v = base();
        v["global"] = json!({"cluster": "gw"});
        for (k, f) in fields.as_object().unwrap() {
            v["global"][k] = f.clone();
        }
        assert_eq!(err(v), message);
    }
    let mut v = base();
    v["global"] = json!({"cluster": "gw", "coalesce_us": 0, "max_batch": 256});
    assert!(crate::parse(v.to_string().as_bytes()).is_ok());
}

#[test]
fn lease_settings_are_checked_with_their_paths() {
    let cases = [
        (json!({"fraction": 0}), "global.lease.fraction: 0 must be above 0 and at most 1"),
        (json!({"fraction": 1.5}), "global.lease.fraction: 1.5 must be above 0 and at most 1"),
        (
            json!({"fraction": 0.1, "max_wait_ms": 0}),
            "global.lease.max_wait_ms: must be between 1 and 60000 (Envoy treats 0 as no timeout)",
        ),
        (json!({"fraction": 0.1, "ttl_ms": 5}), "global.lease.ttl_ms: must be between 10 and 3600000"),
        (json!({"fraction": 0.1, "path": "x"}), r#"global.lease.path: "x" is not an absolute path of RFC 3986 characters"#),
        (json!({"fraction": 0.1, "max_leases": 0}), "global.lease.max_leases: must be between 1 and 1048576"),
        (json!({"fraction": 0.1, "size": 3}), "global.lease.size: unknown field `size`, expected one of `fraction`, `max_wait_ms`, `ttl_ms`, `path`, `max_leases`"),
    ];
    for (lease, want) in cases {
        let mut v = base();
        v["global"] = json!({"cluster": "gw", "lease": lease});
        assert_eq!(err(v), want);
    }
    let mut v = base();
    v["global"] = json!({"cluster": "gw", "lease": {"fraction": 0.05}});
    let c = parse(v.to_string().as_bytes()).unwrap();
    let l = c.global.unwrap().lease.unwrap();
    assert_eq!(
        (l.max_wait_ms, l.ttl_ms, l.path.as_str(), l.max_leases),
        (20, 2000, "/v1/lease", 4096)
    );
}

#[test]
fn tiers_may_replace_the_rule_limits() {
    let mut v = base();
    v["tiers"] = json!({"free": {}, "pro": {}});
    v["identity"] = json!({"default_tier": "free"});
    v["rules"][0]["limits"] = json!([]);
    v["rules"][0]["tiers"] = json!({"free": [{"requests": 1, "per": 1}]});
    assert_eq!(err(v.clone()), "rules[0].limits: must hold 1 to 8 limits");
    v["rules"][0]["tiers"]["pro"] = json!([{"requests": 5, "per": 1}]);
    assert!(parse(v.to_string().as_bytes()).is_ok());
}

/// 10^6 per 366 d is 3.2 × 10^16 ms, past 2^53: the gateway would answer
/// 400 to every request and each would take the failure mode.
fn year() -> serde_json::Value {
    json!([{"requests": 1_000_000, "per": "366d"}])
}

fn two_global_rules() -> serde_json::Value {
    let mut v = base();
    v["global"] = json!({"cluster": "gw"});
    v["rules"] = json!([
        {"name": "l", "limits": [{"requests": 1, "per": 1}]},
        {"name": "g", "scope": "global", "key": ["client"], "limits": [{"requests": 5, "per": "1m"}]}
    ]);
    v
}

#[test]
fn the_global_exactness_bound_holds_in_every_limit_set() {
    let reason = "requests × per must stay under 2^53 milliseconds for a global rule";
    let mut own = two_global_rules();
    own["rules"][1]["limits"] = year();
    assert_eq!(err(own), format!("rules[1].limits[0].per: {reason}"));
    let mut tier = two_global_rules();
    tier["tiers"] = json!({"free": {}, "gold": {}});
    tier["identity"] = json!({"default_tier": "free"});
    tier["rules"][1]["tiers"] = json!({"gold": year()});
    assert_eq!(err(tier), format!("rules[1].tiers.gold[0].per: {reason}"));
    let mut client = two_global_rules();
    client["identity"] = json!({"clients": {"acme": {"limits": {"g": year()}}}});
    assert_eq!(
        err(client),
        format!("identity.clients.acme.limits.g[0].per: {reason}")
    );
    // A local rule never reaches the gateway: the same figure is fine there.
    let mut local = two_global_rules();
    local["identity"] = json!({"clients": {"acme": {"limits": {"l": year()}}}});
    local["rules"][0]["limits"] = year();
    assert!(parse(local.to_string().as_bytes()).is_ok());
    // Each limit set is held to the same count and range checks.
    let mut zero = two_global_rules();
    zero["identity"] = json!({"clients": {"acme": {"limits": {"g": [{"requests": 0, "per": 1}]}}}});
    assert_eq!(
        err(zero),
        "identity.clients.acme.limits.g[0].requests: must be between 1 and 1000000000"
    );
}

#[test]
fn strings_that_reach_a_header_or_a_body_are_checked_as_what_they_are() {
    let quota = |url: &str| {
        let mut v = base();
        v["global"] = json!({"cluster": "gw"});
        v["quotas"] = json!([{"name": "q", "period": "month", "limit": 5, "upgrade_url": url}]);
        v
    };
    let url_reason = "is not an absolute http(s) URL of RFC 3986 characters";
    for bad in [
        "https://x/\r\nSet-Cookie:session=evil\r\nX-A:\u{1}",
        "https://x/a b",
        "https://x/<a>",
        "javascript:alert(1)",
        "/upgrade",
        "https://",
        "https://x/%zz",
        "https://x/\u{e9}",
    ] {
        assert_eq!(
            err(quota(bad)),
            format!("quotas[0].upgrade_url: {bad:?} {url_reason}")
        );
    }
    for good in [
        "https://example.com/upgrade",
        "HTTP://e.com:8080/up?plan=pro&from=a%20b#top",
        "https://[::1]/x",
    ] {
        assert!(parse(quota(good).to_string().as_bytes()).is_ok(), "{good}");
    }
    let uri_reason = "is not an absolute URI of RFC 3986 characters";
    for (field, bad) in [
        ("problem_type", "https://e.com/p\n"),
        ("problem_type", "no-scheme"),
        ("problem_type", "1x:y"),
        ("quota_problem_type", "tag:a b"),
        ("quota_problem_type", ""),
    ] {
        let mut v = base();
        v["response"] = json!({ field: bad });
        assert_eq!(err(v), format!("response.{field}: {bad:?} {uri_reason}"));
    }
    let mut v = base();
    v["response"] =
        json!({"problem_type": "about:blank", "quota_problem_type": "urn:example:quota"});
    assert!(parse(v.to_string().as_bytes()).is_ok());
    // The callout's :authority and :path headers.
    let global = |g: serde_json::Value| {
        let mut v = base();
        v["global"] = g;
        err(v)
    };
    assert_eq!(
        global(json!({"cluster": "gw", "authority": "gw\r\nx-a: 1"})),
        r#"global.authority: "gw\r\nx-a: 1" is not a host with an optional port"#
    );
    assert_eq!(
        global(json!({"cluster": "gw", "path": "/v1/check\n"})),
        r#"global.path: "/v1/check\n" is not an absolute path of RFC 3986 characters"#
    );
    assert_eq!(
        global(json!({"cluster": "gw", "lease": {"fraction": 0.1, "path": "/v1/lease x"}})),
        r#"global.lease.path: "/v1/lease x" is not an absolute path of RFC 3986 characters"#
    );
    assert_eq!(
        global(json!({"cluster": "gw\n"})),
        r#"global.cluster: "gw\n" must name an Envoy cluster in visible ASCII"#
    );
    let mut v = base();
    v["global"] = json!({"cluster": "outbound|8080||gw.ns.svc.cluster.local",
        "authority": "gw.ns.svc.cluster.local:8080", "path": "/v1/check?x=1"});
    assert!(parse(v.to_string().as_bytes()).is_ok());
}

#[test]
fn the_gateway_token_is_a_b64token_from_the_config_or_the_environment() {
    let global = |g: serde_json::Value| {
        let mut v = base();
        v["global"] = g;
        parse(v.to_string().as_bytes())
    };
    let err = |g| global(g).unwrap_err().to_string();
    assert_eq!(
        err(json!({"cluster": "gw", "token": "a b"})),
        "global.token: not an RFC 6750 b64token of at most 4096 bytes"
    );
    assert_eq!(
        err(json!({"cluster": "gw", "token": "x\r\nevil: 1"})),
        "global.token: not an RFC 6750 b64token of at most 4096 bytes"
    );
    assert_eq!(
        err(json!({"cluster": "gw", "token": "abc", "token_env": "T"})),
        "global.token: give token or token_env, not both"
    );
    assert_eq!(
        err(json!({"cluster": "gw", "token_env": "1T"})),
        r#"global.token_env: "1T" is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"#
    );
    let inline = global(json!({"cluster": "gw", "token": "s3cr3t.A/b+c=="})).unwrap();
    let g = inline.global.unwrap();
    assert_eq!(
        g.bearer(|_| None).unwrap().as_deref(),
        Some("Bearer s3cr3t.A/b+c==")
    );
    assert!(
        !format!("{g:?}").contains("s3cr3t"),
        "Debug shows the token"
    );
    let from_env = global(json!({"cluster": "gw", "token_env": "RL_TOKEN"})).unwrap();
    let g = from_env.global.unwrap();
    let env = |v: &'static str| move |n: &str| (n == "RL_TOKEN").then(|| v.to_string());
    assert_eq!(
        g.bearer(env("tok-1")).unwrap().as_deref(),
        Some("Bearer tok-1")
    );
    let bad = g.bearer(env("tok 1")).unwrap_err().to_string();
    assert_eq!(
        bad,
        r#"global.token_env: the value of "RL_TOKEN" is not an RFC 6750 b64token of at most 4096 bytes"#
    );
    assert_eq!(
        g.bearer(|_| None).unwrap_err().to_string(),
        r#"global.token_env: the VM has no environment variable "RL_TOKEN" (Envoy: vm_config.environment_variables; Istio: WasmPlugin vmConfig.env)"#
    );
    let none = global(json!({"cluster": "gw"})).unwrap().global.unwrap();
    assert_eq!(none.bearer(|_| Some("x".into())).unwrap(), None);
}

#[test]
fn the_host_header_is_refused_where_a_header_name_is_read() {
    let why = "never reaches the filter as a header: Envoy keeps the host as :authority; match \
               on it with match.host or match.host_regex, and key on it with the key part host";
    for name in ["host", "Host", "HOST"] {
        let mut k = base();
        k["rules"][0]["key"] = json!([format!("header:{name}")]);
        assert_eq!(err(k), format!("rules[0].key[0]: {name:?} {why}"));
        let mut m = base();
        m["rules"][0]["match"] = json!({"headers": {name: "api.example.com"}});
        assert_eq!(err(m), format!("rules[0].match.headers: {name:?} {why}"));
        let mut c = base();
        c["identity"] = json!({"client_id_header": name});
        assert_eq!(err(c), format!("identity.client_id_header: {name:?} {why}"));
    }
    let mut other = base();
    other["rules"][0]["key"] = json!(["header:x-host"]);
    assert!(parse(other.to_string().as_bytes()).is_ok());
}

#[test]
fn more_global_rules_than_one_gateway_check_carries_are_refused() {
    // One check carries a bucket per global rule a request matches, at most
    // the protocol's MAX_BUCKETS; a 65th global rule would make every
    // request matching all of them a 400 at the gateway.
    let mut v = base();
    v["global"] = json!({"cluster": "gw"});
    let rules: Vec<_> = (0..70)
        .map(|i| json!({"name": format!("g{i}"), "scope": "global", "limits": [{"requests": 1, "per": 1}]}))
        .collect();
    v["rules"] = json!(rules);
    assert_eq!(
        err(v.clone()),
        "rules[64].scope: a 65th global rule; one gateway check carries at most 64 buckets, one per global rule"
    );
    v["rules"].as_array_mut().unwrap().truncate(64);
    // Local rules beside them do not count.
    v["rules"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "local", "limits": [{"requests": 1, "per": 1}]}));
    assert!(parse(v.to_string().as_bytes()).is_ok());
}

#[test]
fn a_cost_above_the_capacity_of_a_rule_it_can_match_is_refused() {
    let shipped = json!({"domain": "d",
        "rules": [
            {"name": "per-client", "key": ["client"],
             "limits": [{"requests": 60, "per": "1m"}, {"requests": 10, "per": "1s"}]},
            {"name": "uploads", "match": {"path_prefix": "/upload"}, "limits": [{"requests": 5, "per": "1m"}]}],
        "costs": [{"match": {"path_prefix": "/search"}, "cost": 5},
                  {"match": {"path_prefix": "/export"}, "cost": 50}]});
    assert_eq!(
        err(shipped.clone()),
        r#"costs[1].cost: 50 is above rules[0].limits[1].requests (10), the capacity of rule "per-client", which it can match: such a request could never pass"#
    );
    // /upload's rule never meets /export or /search's costs; 10 fits per-client.
    let mut fits = shipped.clone();
    fits["costs"][1]["cost"] = json!(10);
    assert!(parse(fits.to_string().as_bytes()).is_ok());
    // A rule's own cost is held to its own limits.
    let mut own = fits.clone();
    own["rules"][1]["cost"] = json!(6);
    assert_eq!(
        err(own),
        r#"rules[1].cost: 6 is above rules[1].limits[0].requests (5), the capacity of rule "uploads", which it can match: such a request could never pass"#
    );
    // A shadow rule never denies.
    let mut shadow = shipped;
    shadow["rules"][0]["mode"] = json!("shadow");
    assert!(parse(shadow.to_string().as_bytes()).is_ok());
}

#[test]
fn charging_from_the_response_is_checked_with_its_paths() {
    let with = |from: serde_json::Value| {
        let mut c = base();
        c["rules"][0]["cost_from"] = from;
        c
    };
    let ok = parse(
        with(json!({"preset": "openai_chat", "max": 4, "reserve": 2}))
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    let from = ok.rules[0].cost_from.as_ref().unwrap();
    assert_eq!(
        (from.max, &from.reserve, from.scan_limit),
        (4, &Reserve::Fixed(2), 1 << 20)
    );
    assert_eq!(
        (from.request_body_limit, from.ensure_stream_usage),
        (64 << 10, false)
    );
    let defaults = parse(
        with(json!({"header": "x-usage", "max": 4}))
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(
        defaults.rules[0].cost_from.as_ref().unwrap().reserve,
        Reserve::Fixed(1)
    );
    for (from, expected) in [
        (json!({"max": 4}), "rules[0].cost_from: give exactly one of header, json and preset"),
        (
            json!({"header": "x-u", "preset": "openai_chat", "max": 4}),
            "rules[0].cost_from: give exactly one of header, json and preset",
        ),
        (json!({"header": "x-u"}), "rules[0].cost_from: missing field `max`"),
        (json!({"header": "x-u", "max": 0}), "rules[0].cost_from.max: must be between 1 and 1000000000"),
        (json!({"header": "x-u", "max": 4, "reserve": 5}), "rules[0].cost_from.reserve: 5 is above max (4)"),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": {"pointer": "/max_tokens", "default": 5}}),
            "rules[0].cost_from.reserve.default: 5 is above max (4)",
        ),
        (
            json!({"preset": "openai_chat", "max": 40, "reserve": {"pointer": "/max_tokens", "default": 6}}),
            "rules[0].cost_from.reserve.default: 6 is above rules[0].limits[0].requests (5), the capacity of rule \"r\", which it can match: such a request could never pass",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": {"pointer": "max_tokens"}}),
            "rules[0].cost_from.reserve.pointer: \"max_tokens\" is not a JSON Pointer: it must start with /",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": {"default": 2}}),
            "rules[0].cost_from.reserve: missing field `pointer`",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": {"pointer": "/m", "dflt": 2}}),
            "rules[0].cost_from.reserve.dflt: unknown field `dflt`, expected `pointer` or `default`",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": "/max_tokens"}),
            "rules[0].cost_from.reserve: invalid type: string \"/max_tokens\", expected a number of tokens or an object with pointer and default",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "reserve": -1}),
            "rules[0].cost_from.reserve: invalid type: integer `-1`, expected a number of tokens or an object with pointer and default",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "request_body_limit": 1023}),
            "rules[0].cost_from.request_body_limit: must be between 1024 and 1048576 bytes",
        ),
        (
            json!({"preset": "openai_chat", "max": 4, "request_body_limit": 1048577}),
            "rules[0].cost_from.request_body_limit: must be between 1024 and 1048576 bytes",
        ),
        (
            json!({"header": "x-u", "max": 4, "ensure_stream_usage": true}),
            "rules[0].cost_from.ensure_stream_usage: needs a json or preset source: the usage it asks for is read from the body",
        ),
        (
            json!({"header": "x-u", "max": 40, "reserve": 6}),
            "rules[0].cost_from.reserve: 6 is above rules[0].limits[0].requests (5), the capacity of rule \"r\", which it can match: such a request could never pass",
        ),
        (json!({"header": "x u", "max": 4}), "rules[0].cost_from.header: \"x u\" is not a header name"),
        (
            json!({"json": [{"pointer": "usage"}], "max": 4}),
            "rules[0].cost_from.json[0].pointer: \"usage\" is not a JSON Pointer: it must start with /",
        ),
        (
            json!({"json": [{"pointer": "/a~2"}], "max": 4}),
            "rules[0].cost_from.json[0].pointer: \"/a~2\" is not a JSON Pointer: ~ must be followed by 0 or 1",
        ),
        (json!({"json": [], "max": 4}), "rules[0].cost_from.json: must hold 1 to 8 terms"),
        (
            json!({"json": [{"pointer": "/a", "weight": 0}], "max": 4}),
            "rules[0].cost_from.json: every weight is 0: nothing would ever be charged",
        ),
        (
            json!({"json": [{"pointer": "/a", "weight": 1000001}], "max": 4}),
            "rules[0].cost_from.json[0].weight: must be at most 1000000",
        ),
        (
            json!({"preset": "openai", "max": 4}),
            "rules[0].cost_from.preset: unknown variant `openai`, expected one of `openai_chat`, `openai_responses`, `anthropic_messages`",
        ),
        (
            json!({"header": "x-u", "max": 4, "scan_limit": 10}),
            "rules[0].cost_from.scan_limit: must be between 1024 and 67108864 bytes",
        ),
    ] {
        let got = err(with(from.clone()));
        assert_eq!(got, expected, "{from}");
    }
    let mut both = with(json!({"header": "x-u", "max": 4}));
    both["rules"][0]["cost"] = json!(1);
    assert_eq!(
        err(both),
        "rules[0].cost_from: give cost or cost_from, not both"
    );
    // A global rule settles on the gateway, or against its lease's batch.
    let mut global = with(json!({"header": "x-u", "max": 4}));
    global["rules"][0]["scope"] = json!("global");
    global["global"] = json!({"cluster": "gw"});
    assert!(parse(global.to_string().as_bytes()).is_ok());
    global["global"]["lease"] = json!({"fraction": 0.1});
    let leased = parse(global.to_string().as_bytes()).unwrap();
    assert_eq!(leased.rules[0].cost_from.as_ref().map(|f| f.max), Some(4));
}

#[test]
fn charge_on_takes_classes_and_codes_on_local_rules() {
    let mut c = base();
    c["rules"][0]["charge_on"] = json!(["2xx", "304"]);
    let ok = parse(c.to_string().as_bytes()).unwrap();
    assert_eq!(
        ok.rules[0].charge_on,
        Some(vec![StatusMatch::Class(2), StatusMatch::Code(304)])
    );
    c["rules"][0]["charge_on"] = json!(["2XX"]);
    assert_eq!(
        err(c.clone()),
        "rules[0].charge_on[0]: \"2XX\" is not a status class (1xx to 5xx) or a status code (100 to 599)"
    );
    c["rules"][0]["charge_on"] = json!([]);
    assert_eq!(
        err(c.clone()),
        "rules[0].charge_on: must list at least one status or class"
    );
    c["rules"][0]["charge_on"] = json!(["2xx"]);
    c["rules"][0]["scope"] = json!("global");
    c["global"] = json!({"cluster": "gw"});
    assert!(parse(c.to_string().as_bytes()).is_ok());
    c["global"]["lease"] = json!({"fraction": 0.1});
    let leased = parse(c.to_string().as_bytes()).unwrap();
    assert_eq!(leased.rules[0].charge_on, Some(vec![StatusMatch::Class(2)]));
}

#[test]
fn a_response_cost_entry_meets_a_global_rule_with_or_without_leases() {
    let mut c = base();
    c["global"] = json!({"cluster": "gw"});
    c["rules"][0]["scope"] = json!("global");
    c["costs"] = json!([{"match": {"path_prefix": "/v1/chat"}, "cost_from": {"preset": "openai_chat", "max": 5}}]);
    assert!(parse(c.to_string().as_bytes()).is_ok());
    c["global"]["lease"] = json!({"fraction": 0.1});
    let leased = parse(c.to_string().as_bytes()).unwrap();
    assert_eq!(leased.costs[0].cost_from.as_ref().map(|f| f.max), Some(5));
    c["rules"][0]["cost"] = json!(1);
    assert!(parse(c.to_string().as_bytes()).is_ok());
    c["costs"][0]["cost"] = json!(1);
    assert_eq!(
        err(c.clone()),
        "costs[0]: give exactly one of cost and cost_from"
    );
    c["costs"] = json!([{"match": {"path_prefix": "/a"}}]);
    assert_eq!(err(c), "costs[0]: give exactly one of cost and cost_from");
}

/// A request counting against a quota is never served from a lease: it is
/// checked on the gateway, and settles there, in lease mode too.
#[test]
fn a_response_cost_entry_meets_a_quota_counting_cost_with_or_without_leases() {
    let mut c = base();
    c["global"] = json!({"cluster": "gw"});
    c["quotas"] = json!([{"name": "month", "period": "month", "limit": 100,
        "upgrade_url": "https://example.com/buy", "count": "cost"}]);
    c["costs"] = json!([{"match": {"path_prefix": "/v1/chat"}, "cost_from": {"preset": "openai_chat", "max": 5}}]);
    assert!(parse(c.to_string().as_bytes()).is_ok());
    c["global"]["lease"] = json!({"fraction": 0.1});
    let leased = parse(c.to_string().as_bytes()).unwrap();
    assert_eq!(leased.quotas[0].count, QuotaCount::Cost);
}

#[test]
fn a_concurrency_limit_is_held_on_the_gateway_with_scope_global_even_in_lease_mode() {
    let mut c = base();
    c["global"] = json!({"cluster": "gw", "lease": {"fraction": 0.1}});
    c["rules"][0]["scope"] = json!("global");
    c["rules"][0]["limits"] = json!([{"concurrent": 3, "max_in_flight": "1m"}]);
    let ok = parse(c.to_string().as_bytes()).unwrap();
    assert!(ok.rules[0].is_concurrent());
    assert_eq!(ok.rules[0].scope, Scope::Global);
    c["rules"][0]["cost_from"] = json!({"header": "x-usage", "max": 10});
    assert_eq!(
        err(c),
        "rules[0].cost_from: does not apply to a concurrency rule: each request holds one slot"
    );
}

#[test]
fn a_concurrency_limit_stands_alone_on_a_local_rule() {
    let mut c = base();
    c["rules"][0]["limits"] = json!([{"concurrent": 3}]);
    let ok = parse(c.to_string().as_bytes()).unwrap();
    assert_eq!(ok.rules[0].limits[0].concurrent, Some(3));
    assert_eq!(ok.rules[0].limits[0].max_in_flight_secs(), 300);
    assert!(ok.rules[0].is_concurrent());
    for (limits, expected) in [
        (json!([{"concurrent": 0}]), "rules[0].limits[0].concurrent: must be between 1 and 1024"),
        (json!([{"concurrent": 1025}]), "rules[0].limits[0].concurrent: must be between 1 and 1024"),
        (
            json!([{"concurrent": 3, "requests": 5, "per": "1m"}]),
            "rules[0].limits[0]: give concurrent, or requests and per, not both",
        ),
        (
            json!([{"concurrent": 3}, {"requests": 5, "per": "1m"}]),
            "rules[0].limits: a concurrency rule's every limit set is exactly one {\"concurrent\": N}",
        ),
        (
            json!([{"requests": 5, "per": "1m"}, {"concurrent": 3}]),
            "rules[0].limits: a concurrency rule's every limit set is exactly one {\"concurrent\": N}",
        ),
        (json!([{"requests": 5}]), "rules[0].limits[0].per: required for a rate limit (or give concurrent)"),
        (
            json!([{"per": "1m"}]),
            "rules[0].limits[0].requests: must be between 1 and 1000000000",
        ),
        (
            json!([{"concurrent": 3, "max_in_flight": "2d"}]),
            "rules[0].limits[0].max_in_flight: must be at most 1d",
        ),
    ] {
        let mut c = base();
        c["rules"][0]["limits"] = limits.clone();
        assert_eq!(err(c), expected, "{limits}");
    }
    for (field, value, expected) in [
        ("cost", json!(2), "rules[0].cost: does not apply to a concurrency rule: each request holds one slot"),
        ("mode", json!("shadow"), "rules[0].mode: shadow is not supported for a concurrency rule"),
        ("charge_on", json!(["2xx"]), "rules[0].charge_on: does not apply to a concurrency rule: a slot is held until the stream ends"),
    ] {
        let mut c = base();
        c["rules"][0]["limits"] = json!([{"concurrent": 3}]);
        c["rules"][0][field] = value;
        assert_eq!(err(c), expected, "{field}");
    }
    let mut tiered = base();
    tiered["tiers"] = json!({"free": {}, "pro": {}});
    tiered["identity"] = json!({"default_tier": "free"});
    tiered["rules"][0]["limits"] = json!([{"concurrent": 2}]);
    tiered["rules"][0]["tiers"] = json!({"pro": [{"requests": 5, "per": "1m"}]});
    assert_eq!(
        err(tiered.clone()),
        "rules[0].tiers.pro[0]: a concurrency rule's every limit set is exactly one {\"concurrent\": N}"
    );
    tiered["rules"][0]["tiers"] = json!({"pro": [{"concurrent": 8}]});
    assert!(parse(tiered.to_string().as_bytes()).is_ok());
}

#[test]
fn a_reserve_read_from_the_body_keeps_its_default_and_names_its_path_in_costs() {
    let mut c = base();
    c["costs"] = json!([{"match": {"path_prefix": "/v1/chat"}, "cost_from": {"preset": "openai_chat",
        "max": 100, "reserve": {"pointer": "/max_tokens", "default": 6}}}]);
    assert_eq!(
        err(c.clone()),
        "costs[0].cost_from.reserve.default: 6 is above rules[0].limits[0].requests (5), the capacity of rule \"r\", which it can match: such a request could never pass"
    );
    c["costs"][0]["cost_from"]["reserve"] = json!({"pointer": "/max_tokens"});
    let config = parse(c.to_string().as_bytes()).unwrap();
    let from = config.costs[0].cost_from.as_ref().unwrap();
    assert_eq!(
        from.reserve,
        Reserve::FromBody(ReserveFrom {
            pointer: JsonPointer::parse("/max_tokens").unwrap(),
            default: 1
        })
    );
    assert_eq!(config.costs[0].upfront(), 1);
    assert_eq!(from.reserve.to_string(), "/max_tokens (default 1)");
}

#[test]
fn bad_conditions_are_refused_with_their_path() {
    let cases = [
        (
            json!({"path_regex": "(a"}),
            "rules[0].match.path_regex: \"(a\" is not a regular expression",
        ),
        (
            json!({"host_regex": "a{2,1}"}),
            "rules[0].match.host_regex: \"a{2,1}\" is not a regular expression",
        ),
        (
            json!({"path_regex": "a".repeat(1025)}),
            "rules[0].match.path_regex: must be at most 1024 bytes",
        ),
        (
            json!({"host": "api.example.com:443"}),
            "rules[0].match.host: \"api.example.com:443\" is not a host name",
        ),
        (
            json!({"route": ""}),
            "rules[0].match.route: \"\" is not a route name",
        ),
        (
            json!({"route_metadata": {"plan": "p"}}),
            "rules[0].match.route_metadata: \"plan\" is not a metadata path",
        ),
        (
            json!({"metadata": {"a//b": "p"}}),
            "rules[0].match.metadata: \"a//b\" is not a metadata path",
        ),
        (
            json!({"query": {"": true}}),
            "rules[0].match.query: \"\" is not a query parameter name",
        ),
        (
            json!({"cookie": {"s": false}}),
            "rules[0].match.cookie.s: invalid value: boolean `false`, expected a string or true",
        ),
        (
            json!({"cookie": {"s": 1}}),
            "rules[0].match.cookie.s: invalid type: integer `1`, expected a string or true",
        ),
        (
            json!({"any": []}),
            "rules[0].match.any: must hold 1 to 16 matches",
        ),
        (
            json!({"not": {"path_regex": "("}}),
            "rules[0].match.not.path_regex: \"(\" is not a regular expression",
        ),
        (
            json!({"any": [{"host": "a"}, {"path_prefix": "x"}]}),
            "rules[0].match.any[1].path_prefix: \"x\" must start with /",
        ),
        (
            json!({"not": {"not": {"not": {"not": {"not": {"route": "r"}}}}}}),
            "rules[0].match.not.not.not.not: not and any nest at most 4 deep",
        ),
    ];
    for (m, want) in cases {
        let mut v = base();
        v["rules"][0]["match"] = m.clone();
        let e = err(v);
        assert!(e.starts_with(want), "{m}: {e}");
    }
    let mut ok = base();
    ok["rules"][0]["match"] = json!({"host": "*.Example.com", "host_regex": "(a|b)[.]x",
        "path_regex": "/v[0-9]+/.*", "route": "api", "route_metadata": {"ratelimit/plan": "p"},
        "metadata": {"envoy.filters.http.jwt_authn/payload/org": "acme"},
        "query": {"api_key": true, "v": "2"}, "cookie": {"session": true},
        "not": {"path_prefix": "/health"}, "any": [{"route": "a"}, {"route": "b"}]});
    ok["rules"][0]["key"] = json!([
        "host",
        "route",
        "ip/24/64",
        "query:api_key",
        "cookie:session",
        "metadata:envoy.filters.http.jwt_authn/payload/org"
    ]);
    assert!(parse(ok.to_string().as_bytes()).is_ok());
}

#[test]
fn patterns_are_bounded_in_number() {
    let mut v = base();
    let rule = v["rules"][0].clone();
    let rules: Vec<serde_json::Value> = (0..33)
        .map(|i| {
            let mut r = rule.clone();
            r["name"] = json!(format!("r{i}"));
            r["match"] = json!({"path_regex": "/a", "host_regex": "b"});
            r
        })
        .collect();
    v["rules"] = json!(rules);
    assert_eq!(
        err(v),
        "rules[32].match: at most 64 path_regex and host_regex patterns in all"
    );
}

#[test]
fn limits_by_is_read_and_bad_ones_are_refused_with_their_path() {
    let set = json!([{"requests": 5, "per": "1m"}]);
    let mut ok = base();
    ok["rules"][0]["limits_by"] =
        json!({"route_metadata": "ratelimit/plan", "sets": {"premium": set, "basic": set}});
    let config = parse(ok.to_string().as_bytes()).unwrap();
    let by = config.rules[0].limits_by.as_ref().unwrap();
    assert_eq!(
        by.source(),
        Some((LimitsSource::RouteMetadata, "ratelimit/plan"))
    );
    assert_eq!(by.sets.keys().collect::<Vec<_>>(), ["basic", "premium"]);

    let cases = [
        (
            json!({"sets": {"a": set}}),
            "rules[0].limits_by: give exactly one of route_metadata and metadata",
        ),
        (
            json!({"route_metadata": "a/b", "metadata": "c/d", "sets": {"a": set}}),
            "rules[0].limits_by: give exactly one of route_metadata and metadata",
        ),
        (
            json!({"metadata": "plan", "sets": {"a": set}}),
            "rules[0].limits_by.metadata: \"plan\" is not a metadata path",
        ),
        (
            json!({"route_metadata": "ratelimit/plan", "sets": {}}),
            "rules[0].limits_by.sets: must hold 1 to 64 sets",
        ),
        (
            json!({"route_metadata": "ratelimit/plan", "sets": {"a b": set}}),
            "rules[0].limits_by.sets: \"a b\" must be 1-64 characters",
        ),
        (
            json!({"route_metadata": "ratelimit/plan", "sets": {"a": []}}),
            "rules[0].limits_by.sets.a: must hold 1 to",
        ),
        (
            json!({"route_metadata": "ratelimit/plan", "sets": {"a": [{"requests": 1, "per": "x"}]}}),
            "rules[0].limits_by.sets.a[0].per:",
        ),
        (
            json!({"route_metadata": "ratelimit/plan"}),
            "rules[0].limits_by: missing field `sets`",
        ),
    ];
    for (by, want) in cases {
        let mut v = base();
        v["rules"][0]["limits_by"] = by.clone();
        let e = err(v);
        assert!(e.starts_with(want), "{by}: {e}");
    }
}

#[test]
fn the_transport_is_http_or_grpc_and_grpc_names_fit_one_byte_lengths() {
    let global = |fields: serde_json::Value| {
        let mut v = base();
        v["global"] = json!({"cluster": "gw"});
        for (k, f) in fields.as_object().unwrap() {
            v["global"][k] = f.clone();
        }
        v
    };
    let transport = |v: serde_json::Value| {
        crate::parse(v.to_string().as_bytes()).map(|c| c.global.unwrap().transport)
    };
    assert_eq!(transport(global(json!({}))).unwrap(), Transport::Http);
    assert_eq!(
        transport(global(json!({"transport": "grpc"}))).unwrap(),
        Transport::Grpc
    );
    assert!(err(global(json!({"transport": "h2"})))
        .starts_with("global.transport: unknown variant `h2`"));
    // 123 bytes of names is the most a one-byte length holds with its tags.
    let cluster = "c".repeat(123 - "ratelimit-gateway".len());
    assert!(transport(global(json!({"transport": "grpc", "cluster": cluster}))).is_ok());
    let long = format!("{cluster}x");
    assert_eq!(
        err(global(json!({"transport": "grpc", "cluster": long}))),
        "global.cluster: with \"transport\": \"grpc\", cluster and authority must be at most 123 bytes together (124)"
    );
    assert!(
        transport(global(json!({"cluster": long}))).is_ok(),
        "http has no such bound"
    );
}

#[test]
fn the_grpc_service_is_the_envoy_grpc_message() {
    let mut v = base();
    v["global"] = json!({"cluster": "gw", "transport": "grpc"});
    let g = crate::parse(v.to_string().as_bytes())
        .unwrap()
        .global
        .unwrap();
    let mut want = vec![0x0a, 23, 0x0a, 2];
    want.extend_from_slice(b"gw");
    want.extend_from_slice(&[0x12, 17]);
    want.extend_from_slice(b"ratelimit-gateway");
    assert_eq!(g.grpc_service().as_bytes(), want.as_slice());
    // At the bound, every length still fits one byte below 128.
    let mut v = base();
    let cluster = format!(
        "outbound|8081||{}",
        "g".repeat(MAX_GRPC_SERVICE_NAMES - 15 - 17)
    );
    v["global"] = json!({"cluster": cluster, "transport": "grpc"});
    let g = crate::parse(v.to_string().as_bytes())
        .unwrap()
        .global
        .unwrap();
    let s = g.grpc_service();
    assert!(s.is_ascii());
    assert_eq!(s.len(), 2 + 127);
    assert_eq!(s.as_bytes()[1], 127);
}
