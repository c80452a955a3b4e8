//! The docs' reference tables say what the code does: the metrics table
//! (`docs/operations.md`) lists exactly the filter's metrics, and the
//! configuration reference (`docs/configuration.md`) lists exactly the fields
//! the parser accepts, with the defaults it really applies.

use std::path::PathBuf;

fn read(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The lines of the section `## <heading>` of the Markdown file `file`.
fn section(file: &str, heading: &str) -> String {
    let text = read(file);
    let rest = text
        .split(&format!("\n## {heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("{file} has no section {heading}"));
    rest.split("\n## ").next().unwrap_or(rest).to_string()
}

/// Where every configuration field is documented.
const CONFIGURATION: &str = "docs/configuration.md";

/// The cells of a Markdown table row, split on `|` that are not escaped.
fn cells(row: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cell = String::new();
    let mut escaped = false;
    for c in row.trim().trim_start_matches('|').chars() {
        match c {
            '\\' if !escaped => escaped = true,
            '|' if !escaped => out.push(std::mem::take(&mut cell).trim().to_string()),
            _ => {
                if escaped && c != '|' {
                    cell.push('\\');
                }
                escaped = false;
                cell.push(c);
            }
        }
    }
    out
}

/// The first backticked value of a cell, without JSON quotes.
fn first_code(cell: &str) -> Option<String> {
    let start = cell.find('`')? + 1;
    let len = cell.get(start..)?.find('`')?;
    let code = cell.get(start..start + len)?;
    Some(code.trim_matches('"').to_string())
}

/// `SlidingWindow` → `sliding_window`: the serde name of an enum variant.
fn snake(debug: String) -> String {
    let mut out = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn the_metrics_table_lists_exactly_the_filters_metrics() {
    let documented: Vec<String> = section("docs/operations.md", "Metrics")
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .collect();
    let code: Vec<String> = ratelimit_wasm::metrics::all_names()
        .map(str::to_string)
        .collect();
    assert_eq!(
        documented, code,
        "docs/operations.md Metrics table vs src/metrics.rs"
    );
}

#[test]
fn the_configuration_reference_gives_the_defaults_the_parser_applies() {
    // Every optional field that has a default is left out here.
    let config = ratelimit_wasm::config::parse(
        br#"{"domain":"d",
             "rules":[{"name":"r","key":["client"],"limits":[{"requests":10,"per":"1m"}],
                       "graduated":{"warn_at":0.5}},
                      {"name":"t","limits":[{"requests":10,"per":"1m"}],
                       "cost_from":{"json":[{"pointer":"/u"}],"max":5}},
                      {"name":"c","limits":[{"concurrent":2}]},
                      {"name":"b","limits":[{"requests":10,"per":"1m"}],
                       "cost_from":{"json":[{"pointer":"/u"}],"max":5,
                                    "reserve":{"pointer":"/max_tokens"}}}],
             "quotas":[{"name":"q","key":["client"],"period":"day","limit":5,
                        "upgrade_url":"https://example.com/up"}],
             "global":{"cluster":"gw","lease":{"fraction":0.1}}}"#,
    )
    .unwrap_or_else(|e| panic!("the minimal config does not parse: {e}"));
    let global = config.global.as_ref().expect("global");
    let lease = global.lease.as_ref().expect("lease");
    let rule = config.rules.first().expect("a rule");
    let quota = config.quotas.first().expect("a quota");
    let graduated = rule.graduated.as_ref().expect("graduated");
    let from = config.rules[1].cost_from.as_ref().expect("cost_from");
    let term = from.json.as_ref().and_then(|j| j.first()).expect("a term");
    let from_body = match &config.rules[3]
        .cost_from
        .as_ref()
        .expect("cost_from")
        .reserve
    {
        ratelimit_wasm::config::Reserve::FromBody(r) => r.clone(),
        other => panic!("reserve read as {other:?}"),
    };
    let actual: Vec<(&str, String)> = vec![
        (
            "identity.client_id_header",
            config.identity.client_id_header.clone(),
        ),
        (
            "identity.trusted_proxy_hops",
            config.identity.trusted_proxy_hops.to_string(),
        ),
        ("rules[].mode", snake(format!("{:?}", rule.mode))),
        ("rules[].algorithm", snake(format!("{:?}", rule.algorithm))),
        ("rules[].scope", snake(format!("{:?}", rule.scope))),
        (
            "response.headers",
            snake(format!("{:?}", config.response.headers)),
        ),
        (
            "response.problem_type",
            config.response.problem_type.clone(),
        ),
        (
            "response.quota_problem_type",
            config.response.quota_problem_type.clone(),
        ),
        (
            "response.retry_jitter",
            config.response.retry_jitter.to_string(),
        ),
        ("metrics.near_limit", config.metrics.near_limit.to_string()),
        (
            "access_log.filter_state",
            config.access_log.filter_state.to_string(),
        ),
        ("quotas[].count", snake(format!("{:?}", quota.count))),
        ("rules[].cost_from.reserve", from.reserve.to_string()),
        (
            "rules[].limits[].max_in_flight",
            config.rules[2].limits[0].max_in_flight_secs().to_string(),
        ),
        ("rules[].cost_from.scan_limit", from.scan_limit.to_string()),
        (
            "rules[].cost_from.reserve.default",
            from_body.default.to_string(),
        ),
        (
            "rules[].cost_from.request_body_limit",
            from.request_body_limit.to_string(),
        ),
        (
            "rules[].cost_from.ensure_stream_usage",
            from.ensure_stream_usage.to_string(),
        ),
        ("rules[].cost_from.json[].weight", term.weight.to_string()),
        ("max_buckets", config.max_buckets.to_string()),
        ("on_error", snake(format!("{:?}", config.on_error))),
        ("global.authority", global.authority.clone()),
        ("global.transport", snake(format!("{:?}", global.transport))),
        ("global.path", global.path.clone()),
        ("global.settle_path", global.settle_path.clone()),
        ("global.timeout_ms", global.timeout_ms.to_string()),
        ("global.coalesce_us", global.coalesce_us.to_string()),
        ("global.max_batch", global.max_batch.to_string()),
        ("global.batch_path", global.batch_path.clone()),
        (
            "global.failure_mode",
            snake(format!("{:?}", global.failure_mode)),
        ),
        ("global.instances", global.instances.to_string()),
        (
            "global.circuit.failures",
            global.circuit.failures.to_string(),
        ),
        (
            "global.circuit.latency_ms",
            global.circuit.latency_ms.to_string(),
        ),
        (
            "global.circuit.cooldown_ms",
            global.circuit.cooldown_ms.to_string(),
        ),
        ("global.lease.max_wait_ms", lease.max_wait_ms.to_string()),
        ("global.lease.ttl_ms", lease.ttl_ms.to_string()),
        ("global.lease.path", lease.path.clone()),
        ("global.lease.max_leases", lease.max_leases.to_string()),
    ];
    assert_eq!(graduated.reject_at, 1.0);
    assert!(
        section(CONFIGURATION, "Graduated response").contains("`reject_at` (default 1.0)"),
        "docs/configuration.md Graduated response does not give reject_at's default"
    );
    let table = section(CONFIGURATION, "Configuration reference");
    for (field, value) in actual {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| `{field}` |")))
            .unwrap_or_else(|| panic!("{CONFIGURATION} has no row for {field}"));
        let cells = cells(row);
        let default = cells
            .get(2)
            .and_then(|c| first_code(c))
            .unwrap_or_else(|| panic!("no default in the row of {field}: {row}"));
        assert_eq!(default, value, "{CONFIGURATION}: the default of {field}");
    }
}

/// A configuration that sets every field the parser accepts (twice: `global.token`
/// and `global.token_env` exclude each other). A field added to the parser
/// must be added here, which `every_object_of_the_example_refuses_an_unknown_field`
/// cannot see, but the parser's `deny_unknown_fields` on every object keeps
/// the reverse honest: nothing here is accepted by accident.
fn maximal_configs() -> Vec<serde_json::Value> {
    let config = serde_json::json!({
        "domain": "d",
        "identity": {
            "client_id_header": "x-client-id",
            "client_id_metadata": ["envoy.filters.http.jwt_authn", "payload", "sub"],
            "tier_metadata": ["envoy.filters.http.jwt_authn", "payload", "tier"],
            "tier_header": "x-tier",
            "default_tier": "free",
            "trusted_proxy_hops": 1,
            "clients": { "acme": {
                "tier": "pro", "unlimited": false, "soft": true,
                "limits": { "local": [{ "requests": 5, "per": "1s" }] },
                "quotas": { "monthly": 7 }
            } }
        },
        "tiers": { "free": {}, "pro": { "unlimited": false } },
        "rules": [
            { "name": "local",
              "match": { "path_prefix": "/a", "path_exact": "/a/b", "methods": ["GET"],
                         "headers": { "x-k": "v" }, "host": "*.example.com",
                         "host_regex": "(api|www)[.]example[.]com", "path_regex": "/a/[0-9]+",
                         "route": "api", "route_metadata": { "ratelimit/plan": "premium" },
                         "metadata": { "envoy.filters.http.jwt_authn/payload/org": "acme" },
                         "query": { "api_key": true, "v": "2" }, "cookie": { "session": true },
                         "not": { "path_prefix": "/a/health" },
                         "any": [{ "methods": ["GET"] }, { "query": { "debug": true } }] },
              "key": ["client", "ip", "method", "path", "header:x-k", "host", "route", "ip/24/64"],
              "limits": [{ "requests": 10, "per": "1m" }],
              "tiers": { "pro": [{ "requests": 20, "per": "1m" }] },
              "algorithm": "token_bucket", "scope": "local", "mode": "enforce", "cost": 2,
              "graduated": { "warn_at": 0.8, "delay_at": 1.0, "delay_ms": 100,
                             "reject_at": 1.2, "block_at": 2.0, "block_for": "5m" } },
            { "name": "global", "scope": "global", "key": ["client"],
              "limits": [{ "requests": 100, "per": "1m" }] },
            { "name": "tokens", "key": ["client"], "limits": [{ "requests": 1000, "per": "1m" }],
              "cost_from": { "json": [{ "pointer": "/usage/total_tokens", "weight": 1 }],
                             "max": 4000, "reserve": 100, "scan_limit": 65536 },
              "charge_on": ["2xx", "304"] },
            { "name": "by-header", "limits": [{ "requests": 1000, "per": "1m" }],
              "cost_from": { "header": "x-usage-tokens", "max": 10 } },
            { "name": "by-preset", "limits": [{ "requests": 1000, "per": "1m" }],
              "cost_from": { "preset": "anthropic_messages", "max": 10,
                             "reserve": { "pointer": "/max_tokens", "default": 5 },
                             "request_body_limit": 65536, "ensure_stream_usage": true } },
            { "name": "streams", "key": ["client"],
              "limits": [{ "concurrent": 3, "max_in_flight": "10m" }] }
        ],
        "costs": [{ "match": { "path_prefix": "/s" }, "cost": 5 }],
        "response": { "headers": "both", "problem_type": "https://example.com/p",
                      "quota_problem_type": "https://example.com/q", "retry_jitter": 0.1 },
        "metrics": { "near_limit": 0.8 },
        "access_log": { "filter_state": true },
        "quotas": [{ "name": "monthly", "match": { "path_prefix": "/" }, "key": ["client"],
                     "period": "month", "tiers": { "free": 10 }, "limit": 5,
                     "upgrade_url": "https://example.com/up", "count": "cost" }],
        "max_buckets": 1024,
        "on_error": "deny",
        "global": {
            "cluster": "gw", "authority": "ratelimit-gateway", "transport": "http", "path": "/v1/check", "settle_path": "/v1/settle",
            "timeout_ms": 50, "failure_mode": "local", "instances": 2, "deny_cache": 4096,
            "coalesce_us": 500, "max_batch": 64, "batch_path": "/v3/check",
            "circuit": { "failures": 5, "latency_ms": 5, "cooldown_ms": 2000 },
            "lease": { "fraction": 0.1, "max_wait_ms": 20, "ttl_ms": 2000,
                       "path": "/v1/lease", "max_leases": 64 },
            "token": "abc"
        }
    });
    let mut with_env = config.clone();
    if let Some(global) = with_env["global"].as_object_mut() {
        global.remove("token");
        global.insert("token_env".into(), "RATELIMIT_GATEWAY_TOKEN".into());
    }
    // A `costs` entry read from the response may meet no global rule
    // without its own cost and no quota counting cost.
    let mut response_costs = config.clone();
    response_costs["costs"] = serde_json::json!([{ "match": { "path_prefix": "/v1" },
        "cost_from": { "preset": "openai_chat", "max": 10 } }]);
    response_costs["rules"][1]["cost"] = serde_json::json!(1);
    response_costs["quotas"][0]["count"] = serde_json::json!("requests");
    // `limits_by` reads one of its two sources, on a rule without tiers.
    let by = |source: &str, path: &str| {
        let mut c = config.clone();
        c["rules"][1]["limits_by"] = serde_json::json!({ source: path,
            "sets": { "premium": [{ "requests": 100, "per": "1m" }] } });
        c
    };
    vec![
        by("route_metadata", "ratelimit/plan"),
        by("metadata", "envoy.filters.http.jwt_authn/payload/plan"),
        config,
        with_env,
        response_costs,
    ]
}

/// Maps whose keys the user names: the placeholder the reference writes for a key.
const NAMED_KEYS: [(&str, &str); 2] = [("identity.clients", "<id>"), ("tiers", "<tier>")];

/// Maps and lists documented as one field (their entries are described in
/// the field's row, or are limits as in `rules[].limits`).
const WHOLE: [&str; 13] = [
    "costs[].cost_from",
    "rules[].tiers",
    "rules[].limits_by.sets",
    "quotas[].tiers",
    "match.headers",
    "match.route_metadata",
    "match.metadata",
    "match.query",
    "match.cookie",
    "match.not",
    "match.any",
    "identity.clients.<id>.limits",
    "identity.clients.<id>.quotas",
];

/// Every field path of `v` under `prefix` as the reference writes it: `[]`
/// for list entries, placeholders for user-named keys, and `match.*` once
/// for every `match` object. `leaves` gets the fields that hold values,
/// `all` also the objects that group them.
fn field_paths(
    v: &serde_json::Value,
    prefix: &str,
    all: &mut std::collections::BTreeSet<String>,
    leaves: &mut std::collections::BTreeSet<String>,
) {
    match v {
        serde_json::Value::Object(map) if !WHOLE.contains(&prefix) => {
            let named = NAMED_KEYS.iter().find(|(p, _)| *p == prefix);
            for (k, child) in map {
                let k = named.map_or(k.as_str(), |(_, placeholder)| placeholder);
                let path = if prefix.is_empty() {
                    k.to_string()
                } else {
                    format!("{prefix}.{k}")
                };
                all.insert(path.clone());
                // `match` has the same fields in rules, quotas and costs.
                let below = if k == "match" {
                    "match".to_string()
                } else {
                    path
                };
                field_paths(child, &below, all, leaves);
            }
        }
        serde_json::Value::Array(items)
            if items.iter().all(|i| i.is_object())
                && !items.is_empty()
                && !WHOLE.contains(&prefix) =>
        {
            for item in items {
                field_paths(item, &format!("{prefix}[]"), all, leaves);
            }
        }
        _ => {
            all.insert(prefix.to_string());
            leaves.insert(prefix.to_string());
        }
    }
}

/// The field of every row of the reference table.
fn reference_rows() -> Vec<String> {
    section(CONFIGURATION, "Configuration reference")
        .lines()
        .filter(|l| l.starts_with("| `"))
        .filter_map(|l| cells(l).first().and_then(|c| first_code(c)))
        .collect()
}

#[test]
fn the_reference_lists_exactly_the_fields_the_parser_accepts() {
    let (mut all, mut leaves) = Default::default();
    for config in maximal_configs() {
        if let Err(e) = ratelimit_wasm::config::parse(config.to_string().as_bytes()) {
            panic!("the maximal configuration does not parse: {e}\n{config:#}");
        }
        field_paths(&config, "", &mut all, &mut leaves);
    }
    let rows = reference_rows();
    let missing: Vec<&String> = leaves.iter().filter(|f| !rows.contains(f)).collect();
    assert!(
        missing.is_empty(),
        "{CONFIGURATION} has no row for these fields the parser accepts: {missing:?}"
    );
    let unknown: Vec<&String> = rows.iter().filter(|r| !all.contains(*r)).collect();
    assert!(
        unknown.is_empty(),
        "{CONFIGURATION} documents fields the parser refuses: {unknown:?}"
    );
    let mut seen = std::collections::BTreeSet::new();
    let twice: Vec<&String> = rows.iter().filter(|r| !seen.insert(*r)).collect();
    assert!(
        twice.is_empty(),
        "{CONFIGURATION} lists fields twice: {twice:?}"
    );
}

/// Every object of the maximal configurations refuses a field it does not
/// know, naming it: so a field accepted by the parser is one it declares.
#[test]
fn every_object_of_the_example_refuses_an_unknown_field() {
    fn objects(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(map) => {
                out.push(at.clone());
                for (k, child) in map {
                    objects(child, format!("{at}/{k}"), out);
                }
            }
            serde_json::Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    objects(item, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let config = maximal_configs().swap_remove(0);
    let mut pointers = Vec::new();
    objects(&config, String::new(), &mut pointers);
    let mut checked = 0;
    for pointer in pointers {
        // A user-named map takes any key: adding one there is not an unknown field.
        // (The client's limits are checked as the rules' limits.)
        let is_named_map = [
            "/identity/clients",
            "/tiers",
            "/headers",
            "/limits",
            "/quotas",
        ]
        .iter()
        .any(|m| pointer.ends_with(m))
            || pointer.starts_with("/identity/clients/acme/limits");
        if is_named_map {
            continue;
        }
        let mut bad = config.clone();
        if let Some(obj) = bad.pointer_mut(&pointer).and_then(|o| o.as_object_mut()) {
            obj.insert("zz_not_a_field".into(), 1.into());
        }
        match ratelimit_wasm::config::parse(bad.to_string().as_bytes()) {
            Ok(_) => panic!("the object at {pointer:?} accepts an unknown field"),
            Err(e) => assert!(
                e.to_string().contains("zz_not_a_field"),
                "{pointer:?}: the error does not name the field: {e}"
            ),
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} objects checked");
}

/// README's 20-line example is a configuration the filter accepts.
#[test]
fn the_readme_example_parses() {
    let readme = read("README.md");
    let example = readme
        .split("```json\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("README.md has no json example"));
    assert!(example.lines().count() <= 20, "{example}");
    if let Err(e) = ratelimit_wasm::config::parse(example.as_bytes()) {
        panic!("README.md's example does not parse: {e}\n{example}");
    }
}

/// The Makefile: one `.PHONY` naming every target, and every target has the
/// `## ` line that `make help` prints; `test` runs `lint` and `fmt-check`.
#[test]
fn make_help_lists_every_target_and_test_runs_the_checks() {
    let makefile = read("Makefile");
    let phony: Vec<&str> = makefile
        .lines()
        .filter_map(|l| l.strip_prefix(".PHONY:"))
        .collect();
    assert_eq!(phony.len(), 1, "one .PHONY line: {phony:?}");
    let mut phony: Vec<&str> = phony.concat().leak().split_whitespace().collect();
    // Rules: `name: prerequisites`, not `NAME := value` nor `export`.
    let rules: Vec<(&str, &str)> = makefile
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_lowercase()))
        .filter(|l| !l.contains(":=") && !l.contains("?=") && !l.starts_with("export"))
        .filter_map(|l| l.split_once(':'))
        .collect();
    let mut targets: Vec<&str> = rules.iter().map(|(t, _)| *t).collect();
    for (target, rest) in &rules {
        assert!(
            rest.contains(" ## "),
            "target {target} has no `## ` help text"
        );
    }
    targets.sort_unstable();
    phony.sort_unstable();
    assert_eq!(targets, phony, "the targets vs .PHONY");
    let test = rules
        .iter()
        .find(|(t, _)| *t == "test")
        .map(|(_, r)| r.split(" ## ").next().unwrap_or_default())
        .unwrap_or_else(|| panic!("no test target"));
    let prerequisites: Vec<&str> = test.split_whitespace().collect();
    // `alerts`: promtool checks and tests the alerting rules.
    for needed in ["lint", "fmt-check", "alerts"] {
        assert!(prerequisites.contains(&needed), "test: {prerequisites:?}");
    }
    assert_eq!(
        makefile.matches("apt-get install").count(),
        1,
        "one install helper"
    );
}

/// The row of `field` in the configuration reference, as cells.
fn reference_row(field: &str) -> Vec<String> {
    section(CONFIGURATION, "Configuration reference")
        .lines()
        .find(|l| l.starts_with(&format!("| `{field}` ")))
        .map(cells)
        .unwrap_or_else(|| panic!("{CONFIGURATION} has no row for {field}"))
}

/// The `a–b` range of a reference row's second cell.
fn documented_range(field: &str) -> (f64, f64) {
    let cell = reference_row(field).get(1).cloned().unwrap_or_default();
    let range = cell
        .split(|c: char| c == ',' || c.is_whitespace())
        .find(|w| w.contains('–'))
        .unwrap_or_else(|| panic!("{field}: no a–b range in {cell:?}"));
    let (a, b) = range.split_once('–').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

/// The graduated shares' documented ranges are the parser's: each end is
/// accepted and just outside it is refused, naming the field.
#[test]
fn the_graduated_ranges_are_the_parsers() {
    let config = |field: &str, v: f64| {
        let mut g = serde_json::json!({"reject_at": 100.0});
        g[field] = serde_json::json!(v);
        if field == "delay_at" {
            g["delay_ms"] = serde_json::json!(10);
        }
        if field == "block_at" {
            g["block_for"] = serde_json::json!("1m");
            g["reject_at"] = serde_json::json!(1.0);
        }
        if field == "reject_at" {
            g = serde_json::json!({"reject_at": v});
        }
        serde_json::json!({"domain": "d", "rules": [{"name": "r",
            "limits": [{"requests": 10, "per": "1m"}], "graduated": g}]})
        .to_string()
    };
    for field in ["warn_at", "delay_at", "reject_at", "block_at"] {
        let (lo, hi) = documented_range(&format!("rules[].graduated.{field}"));
        // delay_at must stay below reject_at: its top end is checked one step down.
        let top = if field == "delay_at" { hi - 0.01 } else { hi };
        for ok in [lo, top] {
            let parsed = ratelimit_wasm::config::parse(config(field, ok).as_bytes());
            assert!(parsed.is_ok(), "{field} {ok}: {:?}", parsed.err());
        }
        for bad in [lo - lo / 2.0, hi + 1.0] {
            let e = ratelimit_wasm::config::parse(config(field, bad).as_bytes())
                .err()
                .unwrap_or_else(|| panic!("{field} {bad} was accepted"));
            assert!(
                e.to_string().contains(&format!("graduated.{field}")),
                "{field} {bad}: {e}"
            );
        }
    }
}

/// What `ratelimit_wasm_requests_denied` counts is what the decisions count
/// as denied: every answer the filter makes itself, 429, 403 and 503.
#[test]
fn the_denied_metric_names_every_status_the_filter_answers() {
    let ops = read("docs/operations.md");
    let row = ops
        .lines()
        .find(|l| l.starts_with("| `ratelimit_wasm_requests_denied` "))
        .expect("the requests_denied row");
    for status in ["429", "403", "503"] {
        assert!(row.contains(status), "{status} missing from {row}");
    }
}

/// The fenced blocks of `lang` in the Markdown file `file`, in order.
fn fenced(file: &str, lang: &str) -> Vec<String> {
    read(file)
        .split(&format!("```{lang}\n"))
        .skip(1)
        .filter_map(|rest| rest.split("\n```").next().map(str::to_string))
        .collect()
}

/// docs/llm.md's worked configuration, and the one inside its Envoy and
/// Istio snippets, are the same configuration, and the filter's reader
/// accepts it; in the Envoy snippet the decompressor is listed after the
/// wasm filter (so it runs before it on responses) and before the router.
#[test]
fn the_llm_page_examples_parse() {
    let json = fenced("docs/llm.md", "json");
    assert_eq!(json.len(), 1, "docs/llm.md: one json block");
    let worked: serde_json::Value = serde_json::from_str(&json[0]).expect("the json block");
    let config = ratelimit_wasm::config::parse(json[0].as_bytes())
        .unwrap_or_else(|e| panic!("docs/llm.md's worked configuration: {e}"));
    let rule = &config.rules[0];
    let from = rule.cost_from.as_ref().expect("cost_from");
    assert_eq!(
        from.preset,
        Some(ratelimit_wasm::config::UsagePreset::OpenaiChat)
    );
    assert_eq!(rule.key.len(), 1, "keyed on the client");
    assert_eq!(
        rule.charge_on,
        Some(vec![ratelimit_wasm::config::StatusMatch::Class(2)])
    );

    let yaml = fenced("docs/llm.md", "yaml");
    assert_eq!(yaml.len(), 2, "docs/llm.md: the Envoy and Istio snippets");
    let envoy: serde_json::Value =
        serde_json::to_value(serde_norway::from_str::<serde_norway::Value>(&yaml[0]).unwrap())
            .unwrap();
    let names: Vec<&str> = envoy["http_filters"]
        .as_array()
        .expect("http_filters")
        .iter()
        .filter_map(|f| f["name"].as_str())
        .collect();
    let at = |name: &str| names.iter().position(|n| *n == name).expect(name);
    assert!(
        at("envoy.filters.http.wasm") < at("envoy.filters.http.decompressor")
            && at("envoy.filters.http.decompressor") < at("envoy.filters.http.router"),
        "{names:?}"
    );
    let wasm = &envoy["http_filters"][at("envoy.filters.http.wasm")];
    let value = wasm["typed_config"]["config"]["configuration"]["value"]
        .as_str()
        .expect("the plugin configuration");
    ratelimit_wasm::config::parse(value.as_bytes())
        .unwrap_or_else(|e| panic!("docs/llm.md's Envoy snippet: {e}"));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(value).unwrap(),
        worked
    );

    let istio: serde_json::Value =
        serde_json::to_value(serde_norway::from_str::<serde_norway::Value>(&yaml[1]).unwrap())
            .unwrap();
    assert_eq!(istio["kind"], "WasmPlugin");
    let plugin = &istio["spec"]["pluginConfig"];
    ratelimit_wasm::config::parse(plugin.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("docs/llm.md's Istio snippet: {e}"));
    assert_eq!(*plugin, worked);
}

/// docs/llm.md's table of presets lists each preset's pointers as
/// `UsagePreset::terms` has them.
#[test]
fn the_llm_page_lists_the_presets_pointers() {
    use ratelimit_wasm::config::UsagePreset;
    let page = read("docs/llm.md");
    for preset in UsagePreset::ALL {
        let prefix = format!("| `{}` |", preset.name());
        let row = page
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("docs/llm.md has no row for {}", preset.name()));
        let expected: Vec<String> = preset
            .terms()
            .iter()
            .map(|(pointers, weight)| {
                assert_eq!(*weight, 1, "the page says weight 1");
                let quoted: Vec<String> = pointers.iter().map(|p| format!("`{p}`")).collect();
                if quoted.len() == 1 {
                    quoted.join("")
                } else {
                    format!("first of {}", quoted.join(", "))
                }
            })
            .collect();
        assert_eq!(cells(row)[1], expected.join(" + "), "{row}");
    }
}

/// The first cells of the Markdown table whose header row is `header`,
/// in `text`.
fn table_keys(text: &str, header: &str) -> Vec<String> {
    text.lines()
        .skip_while(|l| l.trim() != header)
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| cells(l).first().cloned())
        .collect()
}

#[test]
fn the_access_log_fields_and_words_are_the_filters() {
    use ratelimit_wasm::decide::why::{Said, Source, Why};
    let text = section("docs/operations.md", "The access log");
    let words = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let outcomes: Vec<&str> = Said::ALL.iter().map(|s| s.name()).collect();
    let sources: Vec<&str> = Source::ALL.iter().map(|s| s.name()).collect();
    assert_eq!(
        table_keys(&text, "| outcome | the request |"),
        words(&outcomes)
    );
    assert_eq!(
        table_keys(&text, "| source | what answered |"),
        words(&sources)
    );
    // The fields, in the line's order.
    let line = Why {
        outcome: Said::Denied,
        rule: Some("per-client"),
        remaining: Some(0),
        cost: Some(1),
        source: Source::Local,
    }
    .line();
    assert!(text.contains(&format!("\n{line}\n")), "the example line");
    let fields: Vec<String> = line
        .split(' ')
        .filter_map(|f| f.split_once('=').map(|(k, _)| k.to_string()))
        .collect();
    assert_eq!(table_keys(&text, "| field | value |"), fields);
    assert!(text.contains(&format!(
        "%FILTER_STATE(wasm.{}:PLAIN)%",
        ratelimit_wasm::decide::why::FILTER_STATE
    )));
    // The shipped template logs it.
    assert!(read("envoy/envoy.yaml").contains("ratelimit: %FILTER_STATE(wasm.ratelimit:PLAIN)%"));
}
