//! What rules match and key on beyond path, method and headers, through a
//! real Envoy 1.40 (`--concurrency 2`, the filter built by `make build`)
//! run from the shipped template `envoy/envoy.yaml` with its route
//! configuration replaced by named routes, route metadata and two virtual
//! hosts (the variant is written to the test's work directory; the shipped
//! template itself is never changed), and `max_request_headers_kb` raised so
//! that the hostile requests reach the filter at all:
//!
//! * hosts: two virtual hosts with their own limits, `Host:
//!   API.example.com:443` and `api.example.com` one key, `*.web.example`
//!   one key per host;
//! * the route's name and its metadata, and `not`; `limits_by` giving two
//!   routes the sets their metadata names, and a route without metadata
//!   (or naming no set) the rule's own limits;
//! * `query:api_key` with `a%62c` and `abc` one key; a `cookie:session` key;
//! * 256 clients of one IPv4 /24 in one bucket under `ip/24`, and 256 of one
//!   IPv6 /64 under `ip/24/64`, their addresses in `X-Forwarded-For` behind
//!   a trusted hop;
//! * a verified JWT `org` claim as a key, and a `plan` claim as a match,
//!   through Envoy's real `jwt_authn`;
//! * a `path_regex` exemption that a crafted path must not reach;
//! * hostile requests: a 64 KiB query string, 1,000 cookies in a 60 KiB
//!   header, a path that is exponential for a backtracking regex engine:
//!   each decided, with exact counts;
//! * a global rule keyed on `host` and `query:` across two proxies, exact,
//!   with the key the gateway stores in Redis.
//!
//! Every request goes on its own connection (raw HTTP/1.1, so the `Host`
//! header and the path are sent byte for byte), so both workers take part.
//! Nothing is skipped: without Envoy, the wasm file, the gateway binary or
//! `redis-server` the tests fail and say what to build.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use testkit::config::{demo_signing_key_path, template_path, DEMO_JWT_ISSUER, DEMO_JWT_KID};
use testkit::redis::Redis;
use testkit::{Envoy, EnvoyOptions, Gateway, GatewayOptions};

/// The shipped template's route configuration, replaced below.
const SHIPPED_ROUTES: &str = r#"          route_config:
            name: ingress_routes
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: { prefix: "/" }
                route: { cluster: upstream }
"#;

/// Two virtual hosts; named routes, some with `ratelimit` route metadata:
/// `plan` for a match, `tier` for `limits_by`.
const ROUTES: &str = r#"          route_config:
            name: ingress_routes
            virtual_hosts:
            - name: api
              domains: ["api.example.com", "api.example.com:443"]
              routes:
              - name: api_all
                match: { prefix: "/" }
                route: { cluster: upstream }
            - name: all
              domains: ["*"]
              routes:
              - name: r_premium
                match: { prefix: "/r/premium" }
                route: { cluster: upstream }
                metadata:
                  filter_metadata:
                    ratelimit: { plan: premium }
              - name: r_default
                match: { prefix: "/r/" }
                route: { cluster: upstream }
              - name: b_gold
                match: { prefix: "/b/gold" }
                route: { cluster: upstream }
                metadata:
                  filter_metadata:
                    ratelimit: { tier: gold }
              - name: b_silver
                match: { prefix: "/b/silver" }
                route: { cluster: upstream }
                metadata:
                  filter_metadata:
                    ratelimit: { tier: silver }
              - name: b_typo
                match: { prefix: "/b/typo" }
                route: { cluster: upstream }
                metadata:
                  filter_metadata:
                    ratelimit: { tier: platinum }
              - match: { prefix: "/" }
                route: { cluster: upstream }
"#;

/// Where the shipped template names its two connection managers' stats
/// prefixes (the filter's listener, the built-in upstream's); the raised
/// header bound goes after each.
const STAT_PREFIXES: [&str; 2] = [
    "          stat_prefix: ingress_http\n",
    "          stat_prefix: upstream_http\n",
];

/// Envoy's request header bound (60 KiB by default) raised, so that the
/// hostile requests reach the filter and the upstream behind it.
const BIG_HEADERS: &str = "          max_request_headers_kb: 128\n";

/// Where `jwt_authn` (`payload_in_metadata: payload`) puts the claims.
const JWT: &str = "envoy.filters.http.jwt_authn/payload";

fn ok<T>(r: anyhow::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// The shipped template with [`ROUTES`] and [`BIG_HEADERS`], written to a
/// fresh directory under the system's temporary directory ([`start_all`]
/// removes it).
fn template() -> PathBuf {
    let text = std::fs::read_to_string(template_path()).expect("reading envoy/envoy.yaml");
    let mut out = text.replace(SHIPPED_ROUTES, ROUTES);
    for needle in STAT_PREFIXES.iter().chain([&SHIPPED_ROUTES]) {
        assert_eq!(
            text.matches(needle).count(),
            1,
            "the shipped template must hold {needle:?} once: update this test"
        );
    }
    for prefix in STAT_PREFIXES {
        out = out.replace(prefix, &format!("{prefix}{BIG_HEADERS}"));
    }
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("ratelimit-match-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the template's directory");
    let file = dir.join("envoy.yaml");
    std::fs::write(&file, out).expect("writing the template variant");
    file
}

fn rule(name: &str, matches: Value, key: Value, per_hour: u64) -> Value {
    json!({ "name": name, "match": matches, "key": key,
            "limits": [{ "requests": per_hour, "per": "1h" }] })
}

/// `by-route`: 2 an hour of its own, `gold` 5 and `silver` 3 by the
/// route's `ratelimit/tier` metadata.
fn by_route() -> Value {
    let mut r = rule("by-route", json!({ "path_prefix": "/b/" }), json!([]), 2);
    r["limits_by"] = json!({ "route_metadata": "ratelimit/tier", "sets": {
        "gold": [{ "requests": 5, "per": "1h" }], "silver": [{ "requests": 3, "per": "1h" }] } });
    r
}

/// One configuration for the local tests: each rule under its own path
/// prefix (or host, or route), so that the tests never share a bucket.
fn local_config() -> String {
    json!({
        "domain": "match",
        // The client's address is the entry before the one Envoy appends.
        "identity": { "trusted_proxy_hops": 2 },
        "rules": [
            rule("api-host", json!({ "path_prefix": "/h/", "host": "api.example.com" }), json!(["host"]), 3),
            rule("web-hosts", json!({ "path_prefix": "/h/", "host": "*.web.example" }), json!(["host"]), 5),
            rule("premium-route", json!({ "route_metadata": { "ratelimit/plan": "premium" } }), json!([]), 2),
            rule("named-route", json!({ "route": "r_default", "not": { "path_prefix": "/r/default/health" } }),
                json!(["route"]), 4),
            rule("api-key", json!({ "path_prefix": "/q/" }), json!(["query:api_key"]), 3),
            rule("session", json!({ "path_prefix": "/c/" }), json!(["cookie:session"]), 2),
            rule("v4-net", json!({ "path_prefix": "/n4/" }), json!(["ip/24"]), 10),
            rule("v6-net", json!({ "path_prefix": "/n6/" }), json!(["ip/24/64"]), 10),
            rule("org", json!({ "path_prefix": "/j/" }), json!([format!("metadata:{JWT}/org")]), 3),
            rule("trial", json!({ "path_prefix": "/jt/", "metadata": { format!("{JWT}/plan"): "trial" } }),
                json!([]), 1),
            rule("private", json!({ "path_prefix": "/p/", "not": { "path_regex": "/p/public/[a-z]+" } }),
                json!([]), 2),
            rule("users", json!({ "path_regex": "/v[0-9]+/users/[0-9]+" }), json!([]), 1),
            rule("hostile-query", json!({ "path_prefix": "/hq/" }), json!(["query:api_key"]), 2),
            rule("hostile-cookie", json!({ "path_prefix": "/hc/" }), json!(["cookie:session"]), 2),
            rule("hostile-regex", json!({ "path_regex": "/hr/(a+)+" }), json!([]), 1),
            by_route(),
        ]
    })
    .to_string()
}

/// Starts the Envoys of `opts`, each from the template variant, which is
/// removed once they have rendered it.
fn start_all(opts: Vec<EnvoyOptions>) -> Vec<Envoy> {
    let file = template();
    let opts: Vec<EnvoyOptions> = opts
        .into_iter()
        .map(|mut o| {
            o.template = Some(file.clone());
            o
        })
        .collect();
    let envoys = Envoy::start_all(&opts);
    if let Some(dir) = file.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    ok(envoys, "starting Envoy")
}

fn start(config: String) -> Envoy {
    start_all(vec![EnvoyOptions::new(config)]).remove(0)
}

/// The status of a raw HTTP/1.1 GET of `path` with `Host: host` and
/// `headers`, on a new connection, sent byte for byte.
fn status(port: u16, host: &str, path: &str, headers: &[(&str, &str)]) -> u16 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connecting to Envoy");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("sending the request");
    // The status line is all this needs: reading to the end would wait out
    // Envoy's delayed close (1 s) after each local reply.
    let mut answer = Vec::new();
    let mut chunk = [0u8; 1024];
    while !answer.windows(2).any(|w| w == b"\r\n") {
        match s.read(&mut chunk).expect("reading the answer") {
            0 => break,
            n => answer.extend_from_slice(chunk.get(..n).unwrap_or_default()),
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {answer:?}"))
}

/// One GET: its `Host`, its path and its other headers.
type Get = (String, String, Vec<(&'static str, String)>);

/// How many of the requests were admitted (200); every other answer must be a 429.
fn admitted(envoy: &Envoy, requests: &[Get]) -> usize {
    let port = envoy.ports().listen;
    requests
        .iter()
        .filter(|(host, path, headers)| {
            let h: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            match status(port, host, path, &h) {
                200 => true,
                429 => false,
                s => panic!(
                    "GET {} (Host {host}): status {s}\n{}",
                    path.get(..80).unwrap_or(path),
                    envoy.log_tail(20)
                ),
            }
        })
        .count()
}

/// `n` requests of `path` with `Host: host` and `headers`.
fn times(n: usize, host: &str, path: &str, headers: &[(&'static str, &str)]) -> Vec<Get> {
    let headers: Vec<(&str, String)> = headers.iter().map(|(k, v)| (*k, v.to_string())).collect();
    (0..n)
        .map(|_| (host.to_string(), path.to_string(), headers.clone()))
        .collect()
}

#[test]
fn hosts_have_their_own_limits_and_one_key_whatever_the_case_and_port() {
    let envoy = start(local_config());
    // 6 requests to api.example.com in two spellings: one bucket of 3.
    let mut api = times(3, "API.example.com:443", "/h/a", &[]);
    api.extend(times(3, "api.example.com", "/h/a", &[]));
    assert_eq!(admitted(&envoy, &api), 3);
    // Two hosts under *.web.example: a bucket of 5 each.
    assert_eq!(admitted(&envoy, &times(7, "a.web.example", "/h/a", &[])), 5);
    assert_eq!(
        admitted(&envoy, &times(7, "B.web.example:8080", "/h/a", &[])),
        5
    );
    // Neither: no rule.
    assert_eq!(admitted(&envoy, &times(8, "web.example", "/h/a", &[])), 8);
}

#[test]
fn the_route_name_and_route_metadata_pick_the_rule() {
    let envoy = start(local_config());
    // The route with `ratelimit: {plan: premium}` metadata: 2.
    assert_eq!(admitted(&envoy, &times(5, "x", "/r/premium/a", &[])), 2);
    // The route named r_default, keyed on its name: 4, its health path excepted.
    assert_eq!(admitted(&envoy, &times(6, "x", "/r/default/a", &[])), 4);
    assert_eq!(
        admitted(&envoy, &times(6, "x", "/r/default/health", &[])),
        6
    );
    // The unnamed route: neither rule.
    assert_eq!(admitted(&envoy, &times(6, "x", "/other", &[])), 6);
}

#[test]
fn each_route_gets_the_limits_its_metadata_names() {
    let envoy = start(local_config());
    // `ratelimit: {tier: gold}`: 5; `{tier: silver}`: 3; each its own bucket.
    assert_eq!(admitted(&envoy, &times(7, "x", "/b/gold/a", &[])), 5);
    assert_eq!(admitted(&envoy, &times(7, "x", "/b/silver/a", &[])), 3);
    // A route without metadata and one naming no set share the rule's own 2.
    let mut own = times(2, "x", "/b/none", &[]);
    own.extend(times(3, "x", "/b/typo", &[]));
    assert_eq!(admitted(&envoy, &own), 2);
    assert_eq!(
        ok(
            envoy.metric("ratelimit_wasm_limits_by_default"),
            "reading stats"
        ),
        Some(5.0)
    );
}

#[test]
fn query_and_cookie_keys_decode_each_spelling_to_one_key() {
    let envoy = start(local_config());
    let mut q = times(2, "x", "/q/a?api_key=abc", &[]);
    q.extend(times(2, "x", "/q/a?x=1&api_key=a%62c", &[]));
    q.extend(times(2, "x", "/q/a?api%5Fkey=%61bc&api_key=zzz", &[]));
    assert_eq!(admitted(&envoy, &q), 3, "abc, a%62c and %61bc are one key");
    assert_eq!(
        admitted(&envoy, &times(4, "x", "/q/a?api_key=other", &[])),
        3
    );
    // Without the parameter the rule does not apply.
    assert_eq!(admitted(&envoy, &times(5, "x", "/q/a?apikey=abc", &[])), 5);

    let mut c = times(2, "x", "/c/a", &[("cookie", "session=s1; theme=dark")]);
    c.extend(times(
        2,
        "x",
        "/c/a",
        &[("cookie", "theme=light; session=\"s%31\"")],
    ));
    assert_eq!(admitted(&envoy, &c), 2, "s1 and \"s%31\" are one session");
    assert_eq!(
        admitted(&envoy, &times(3, "x", "/c/a", &[("cookie", "session=s2")])),
        2
    );
    assert_eq!(
        admitted(&envoy, &times(4, "x", "/c/a", &[("cookie", "sessions=s1")])),
        4
    );
}

#[test]
fn clients_of_one_network_share_one_bucket() {
    let envoy = start(local_config());
    // 256 addresses of 10.9.8.0/24, then one of the next /24.
    let v4: Vec<_> = (0..256)
        .map(|i| {
            (
                "x".to_string(),
                "/n4/a".to_string(),
                vec![("x-forwarded-for", format!("10.9.8.{i}"))],
            )
        })
        .collect();
    assert_eq!(admitted(&envoy, &v4), 10);
    assert_eq!(
        admitted(
            &envoy,
            &times(3, "x", "/n4/a", &[("x-forwarded-for", "10.9.9.1")])
        ),
        3
    );
    // 256 addresses of 2001:db8:1:2::/64, each behind a forged entry the
    // client wrote, then one address of the next /64.
    let v6: Vec<_> = (0..256)
        .map(|i| {
            let xff = format!("2001:db8:ffff::{i:x}, 2001:db8:1:2:{i:x}:{i:x}:{i:x}:1");
            (
                "x".to_string(),
                "/n6/a".to_string(),
                vec![("x-forwarded-for", xff)],
            )
        })
        .collect();
    assert_eq!(admitted(&envoy, &v6), 10);
    let next = times(3, "x", "/n6/a", &[("x-forwarded-for", "2001:db8:1:3::1")]);
    assert_eq!(admitted(&envoy, &next), 3);
}

/// An RS256 token of the demo key with `claims` besides issuer and times.
fn token(claims: Value) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs();
    let mut all = json!({ "iss": DEMO_JWT_ISSUER, "iat": now, "exp": now + 3600 });
    for (k, v) in claims.as_object().expect("claims") {
        all[k] = v.clone();
    }
    let pem = std::fs::read(demo_signing_key_path()).expect("the demo signing key");
    let key = EncodingKey::from_rsa_pem(&pem).expect("the demo signing key");
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some(DEMO_JWT_KID.to_string());
    jsonwebtoken::encode(&header, &all, &key).expect("signing a token")
}

#[test]
fn a_verified_claim_keys_and_matches() {
    let envoy = start(local_config());
    let bearer = |claims: Value| format!("Bearer {}", token(claims));
    let (alice, bob) = (
        bearer(json!({ "sub": "alice", "org": "acme" })),
        bearer(json!({ "sub": "bob", "org": "acme" })),
    );
    let mut acme = times(3, "x", "/j/a", &[("authorization", &alice)]);
    acme.extend(times(3, "x", "/j/a", &[("authorization", &bob)]));
    assert_eq!(admitted(&envoy, &acme), 3, "one org, one bucket");
    let globex = bearer(json!({ "sub": "carol", "org": "globex" }));
    assert_eq!(
        admitted(
            &envoy,
            &times(4, "x", "/j/a", &[("authorization", &globex)])
        ),
        3
    );
    // No token: no claim, the rule does not apply.
    assert_eq!(admitted(&envoy, &times(5, "x", "/j/a", &[])), 5);
    // A forged claim header is not the verified claim.
    assert_eq!(
        admitted(&envoy, &times(4, "x", "/j/a", &[("org", "acme")])),
        4
    );

    let trial = bearer(json!({ "sub": "dan", "plan": "trial" }));
    let paid = bearer(json!({ "sub": "erin", "plan": "paid" }));
    assert_eq!(
        admitted(
            &envoy,
            &times(3, "x", "/jt/a", &[("authorization", &trial)])
        ),
        1
    );
    assert_eq!(
        admitted(&envoy, &times(3, "x", "/jt/a", &[("authorization", &paid)])),
        3
    );
}

#[test]
fn a_path_regex_matches_only_what_it_says() {
    let envoy = start(local_config());
    // Exempt: /p/public/<letters>.
    assert_eq!(admitted(&envoy, &times(5, "x", "/p/public/docs", &[])), 5);
    // Crafted to look exempt: a dot-dot back out (normalised by Envoy to
    // /p/admin), a suffix, a query that holds the exempt path.
    let mut crafted = times(1, "x", "/p/public/a/../../admin", &[]);
    crafted.extend(times(1, "x", "/p/public/docs/x", &[]));
    crafted.extend(times(1, "x", "/p/admin?/p/public/docs", &[]));
    crafted.extend(times(1, "x", "/p/public/docs1", &[]));
    assert_eq!(admitted(&envoy, &crafted), 2);
    // The pattern matches the whole path: /v1/users/42 counts, near misses do not.
    assert_eq!(admitted(&envoy, &times(3, "x", "/v1/users/42?x=1", &[])), 1);
    for miss in [
        "/v1/users/42/x",
        "/a/v1/users/42",
        "/v1/users/4x2",
        "/v/users/42",
    ] {
        assert_eq!(admitted(&envoy, &times(2, "x", miss, &[])), 2, "{miss}");
    }
}

#[test]
fn hostile_queries_cookies_and_patterns_are_decided() {
    let envoy = start(local_config());
    // A 64 KiB query string with the key last: found, and counted.
    let mut query = "/hq/a?".to_string();
    while query.len() < 64 * 1024 {
        query.push_str("pad=xxxxxxxxxxxxxxxxxxxxxxxx&");
    }
    query.push_str("api_key=k1");
    assert!(query.len() > 64 * 1024);
    assert_eq!(admitted(&envoy, &times(3, "x", &query, &[])), 2);
    // 1,000 cookies in a 60 KiB header, the session last.
    let mut cookies: String = (0..1000)
        .map(|i| format!("c{i}={}; ", "v".repeat(58)))
        .collect();
    cookies.push_str("session=s1");
    assert!(cookies.len() >= 60 * 1024, "{}", cookies.len());
    assert_eq!(
        admitted(&envoy, &times(3, "x", "/hc/a", &[("cookie", &cookies)])),
        2
    );
    // (a+)+ against 30,000 a's and a "!": 2^30000 steps for a backtracking
    // engine; not a match here, so never limited.
    let evil = format!("/hr/{}!", "a".repeat(30_000));
    assert_eq!(admitted(&envoy, &times(3, "x", &evil, &[])), 3);
    let good = format!("/hr/{}", "a".repeat(30_000));
    assert_eq!(admitted(&envoy, &times(3, "x", &good, &[])), 1);
}

#[test]
fn a_global_host_and_query_rule_is_exact_across_two_proxies() {
    const LIMIT: usize = 20;
    let config = json!({
        "domain": "match-global",
        "global": { "cluster": "ratelimit_gateway", "timeout_ms": 500, "instances": 2,
                    "failure_mode": "closed" },
        "rules": [{ "name": "per-host-key", "scope": "global", "key": ["host", "query:api_key"],
                    "limits": [{ "requests": LIMIT, "per": "1h" }] }]
    })
    .to_string();
    let redis = ok(Redis::start(), "starting redis-server");
    let gateway = ok(
        Gateway::start(
            GatewayOptions::new(redis.url())
                .policy(config.clone())
                .args(&["--redis-timeout-ms", "100"]),
        ),
        "starting ratelimit-gateway",
    );
    let opts = EnvoyOptions::new(config).gateway_port(gateway.port());
    let envoys = start_all(vec![opts.clone(), opts]);
    let spellings = [
        ("API.example.com:443", "/g?api_key=abc"),
        ("api.example.com", "/g?api_key=a%62c"),
        ("Api.Example.Com", "/g?x=&api_key=%61bc"),
    ];
    let mut admitted = 0;
    for i in 0..50 {
        let (host, path) = spellings[i % spellings.len()];
        match status(envoys[i % 2].ports().listen, host, path, &[]) {
            200 => admitted += 1,
            429 => {}
            s => panic!("request {i}: status {s}"),
        }
    }
    assert_eq!(admitted, LIMIT);
    // Another host with the same key is another bucket.
    let other = (0..5)
        .filter(|i| {
            status(
                envoys[i % 2].ports().listen,
                "web.example.com",
                "/g?api_key=abc",
                &[],
            ) == 200
        })
        .count();
    assert_eq!(other, 5);
    let keys = ok(redis.dump(), "dumping Redis");
    assert!(
        keys.contains("per-host-key/a=api.example.com/q=abc"),
        "the gateway's key holds the host and the decoded value: {keys}"
    );
}
