//! The README's reference tables say what the code does: the metrics table
//! lists exactly the filter's metrics, and the configuration reference gives
//! the defaults the parser really applies.

use std::path::PathBuf;

use ratelimit_wasm::metrics::Metric;

fn read(rel: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The lines of the README section `## <heading>`.
fn section(heading: &str) -> String {
    let readme = read("README.md");
    let rest = readme
        .split(&format!("\n## {heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("README has no section {heading}"));
    rest.split("\n## ").next().unwrap_or(rest).to_string()
}

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
    let documented: Vec<String> = section("Metrics")
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .collect();
    let code: Vec<String> = Metric::ALL.iter().map(|m| m.name().to_string()).collect();
    assert_eq!(documented, code, "README Metrics table vs src/metrics.rs");
}

#[test]
fn the_configuration_reference_gives_the_defaults_the_parser_applies() {
    // Every optional field that has a default is left out here.
    let config = ratelimit_wasm::config::parse(
        br#"{"domain":"d",
             "rules":[{"name":"r","key":["client"],"limits":[{"requests":10,"per":"1m"}],
                       "graduated":{"warn_at":0.5}}],
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
        ("quotas[].count", snake(format!("{:?}", quota.count))),
        ("max_buckets", config.max_buckets.to_string()),
        ("on_error", snake(format!("{:?}", config.on_error))),
        ("global.authority", global.authority.clone()),
        ("global.path", global.path.clone()),
        ("global.timeout_ms", global.timeout_ms.to_string()),
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
        section("Graduated response").contains("`reject_at` (default 1.0)"),
        "README Graduated response does not give reject_at's default"
    );
    let table = section("Configuration reference");
    for (field, value) in actual {
        let row = table
            .lines()
            .find(|l| l.starts_with(&format!("| `{field}` |")))
            .unwrap_or_else(|| panic!("README reference has no row for {field}"));
        let cells = cells(row);
        let default = cells
            .get(2)
            .and_then(|c| first_code(c))
            .unwrap_or_else(|| panic!("no default in the row of {field}: {row}"));
        assert_eq!(default, value, "README default of {field}");
    }
}
