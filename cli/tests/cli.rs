//! The `ratelimit` command, run as a user would, on files it writes.

use std::path::{Path, PathBuf};
use std::process::Command;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn run(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn file(name: &str, body: &str) -> String {
    let dir: PathBuf = std::env::temp_dir().join(format!("ratelimit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path.to_string_lossy().into_owned()
}

fn shipped(name: &str) -> String {
    format!("{}/../envoy/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn validate_accepts_the_shipped_config_and_names_field_paths_of_bad_ones() {
    let ok = run(&["validate", &shipped("ratelimit.json")]);
    assert_eq!(ok.code, 0, "{}", ok.stderr);
    assert!(ok.stdout.ends_with("ratelimit.json: ok\n"), "{}", ok.stdout);
    let bad = file(
        "bad.json",
        r#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":5,"per":"10x"}]}]}"#,
    );
    let missing = file("missing-dir-marker", "").replace("missing-dir-marker", "nope.json");
    let r = run(&["validate", &shipped("ratelimit.json"), &bad, &missing, "--"]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains(r#"bad.json: rules[0].limits[0].per: "10x" is not a duration"#),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("nope.json: cannot read"), "{}", r.stderr);
    let not_json = file("garbage.json", "{ not json");
    let r = run(&["validate", &not_json]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("configuration is not valid JSON"),
        "{}",
        r.stderr
    );
    assert_eq!(run(&["validate"]).code, 2, "no file is a usage error");
}

#[test]
fn explain_shows_every_rule_and_tier_with_the_policy_header() {
    let f = file(
        "tiers.json",
        r#"{"domain":"d","tiers":{"free":{},"pro":{},"staff":{"unlimited":true}},
            "identity":{"default_tier":"free","clients":{"acme":{"limits":{"api":[{"requests":900,"per":"1m"}]}}}},
            "rules":[{"name":"api","key":["client"],"limits":[{"requests":60,"per":"1m"},{"requests":10,"per":"1s"}],
                      "tiers":{"pro":[{"requests":600,"per":"1m"}]}, "cost": 2},
                     {"name":"strict","algorithm":"sliding_window","limits":[{"requests":100,"per":"1h"}]}]}"#,
    );
    let r = run(&["explain", &f]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(lines[0].starts_with("rule"), "{}", r.stdout);
    // Each limit's policy item; a response's header carries only the one
    // closest to its end, so the column does not claim to be the header.
    assert!(
        lines[0]
            .trim_end()
            .ends_with("policy items (a response lists each)"),
        "{}",
        r.stdout
    );
    let row = |rule: &str, tier: &str| {
        lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(rule) && l.contains(tier))
            .unwrap_or_else(|| panic!("no row {rule} {tier} in\n{}", r.stdout))
            .to_string()
    };
    let free = row("api", " free ");
    assert!(free.contains("60/60s + 10/1s"), "{free}");
    assert!(
        free.contains(r#""api";q=60;w=60 | "api/1";q=10;w=1"#),
        "{free}"
    );
    assert!(free.contains(" 2 "), "rule cost: {free}");
    assert!(row("api", " pro ").contains(r#""api";q=600;w=60"#));
    assert!(row("api", " staff ").contains("unlimited"));
    assert!(row("api", "client acme").contains("900/60s"));
    assert!(row("strict", " free ").contains("100 per window"));
    let bad = file("bad2.json", r#"{"domain":"d","rules":[]}"#);
    let r = run(&["explain", &bad]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("rules: at least one rule is required"),
        "{}",
        r.stderr
    );
}

fn service(name: &str, requests: u64) -> String {
    file(
        &format!("{name}.json"),
        &format!(
            r#"{{"domain":"{name}","global":{{"cluster":"gw"}},"rules":[
                {{"name":"all","scope":"global","limits":[{{"requests":{requests},"per":"1m"}}]}},
                {{"name":"each","scope":"global","key":["client"],"limits":[{{"requests":5,"per":"1s"}}]}}]}}"#
        ),
    )
}

#[test]
fn budget_sums_service_wide_global_limits_against_the_provider() {
    let (a, b) = (service("svc-a", 300), service("svc-b", 400));
    // Each can send its full bucket and then its refill in one minute:
    // 600 + 800 = 1,400 against 2,000 less 10 %.
    let ok = run(&[
        "budget",
        &a,
        &b,
        "--provider-limit",
        "2000/1m",
        "--headroom",
        "10%",
    ]);
    assert_eq!(ok.code, 0, "{}{}", ok.stdout, ok.stderr);
    assert!(ok.stdout.contains("11.667"), "{}", ok.stdout);
    assert!(ok.stdout.contains(" 1400\n"), "{}", ok.stdout);
    assert!(
        ok.stdout.contains("ok: 77.8% of the allowance"),
        "{}",
        ok.stdout
    );
    assert!(
        ok.stdout.contains("does not bound the total"),
        "{}",
        ok.stdout
    );
    // 1,000 a minute was "ok" when bursts were left out.
    let over = run(&[
        "budget",
        &a,
        &b,
        "--provider-limit",
        "1000/1m",
        "--headroom",
        "10%",
    ]);
    assert_eq!(over.code, 1);
    assert!(
        over.stderr
            .contains("over budget: up to 1400 requests in 1m exceed the allowance of 900"),
        "{}",
        over.stderr
    );
    let leased = file(
        "svc-lease.json",
        r#"{"domain":"svc-lease","global":{"cluster":"gw","instances":3,"lease":{"fraction":0.05}},
            "rules":[{"name":"all","scope":"global","limits":[{"requests":300,"per":"1m"}]}]}"#,
    );
    let ok = run(&["budget", &leased, "--provider-limit", "1000/1m"]);
    assert_eq!(ok.code, 0, "{}{}", ok.stdout, ok.stderr);
    assert!(
        ok.stdout
            .contains("lease mode: the rate holds, but at any moment up to 3 × 5% of the limit"),
        "{}",
        ok.stdout
    );
    let bad = run(&["budget", &a, "--provider-limit", "lots"]);
    assert_eq!(bad.code, 1);
    assert!(
        bad.stderr.contains("expected <requests>/<duration>"),
        "{}",
        bad.stderr
    );
    let local_only = run(&[
        "budget",
        &shipped("ratelimit.json"),
        "--provider-limit",
        "10/1s",
    ]);
    assert_eq!(local_only.code, 1);
    assert!(
        local_only.stderr.contains("no service-wide global rule"),
        "{}",
        local_only.stderr
    );
}

/// Each tier and each client override is a counter of its own: a free
/// 60/min and a gold 6,000/min rule against a 100/min provider printed
/// "ok: 66.7%", taking the least of them.
#[test]
fn budget_counts_every_tier_and_override_as_its_own_counter() {
    let tiers = file(
        "svc-tiers.json",
        r#"{"domain":"svc-tiers","global":{"cluster":"gw"},"tiers":{"free":{},"gold":{}},
            "identity":{"default_tier":"free","clients":{"vip":{"limits":{"all":[{"requests":100,"per":"1m"}]}}}},
            "rules":[{"name":"all","scope":"global","limits":[{"requests":60,"per":"1m"}],
                      "tiers":{"gold":[{"requests":6000,"per":"1m"}]}}]}"#,
    );
    let r = run(&[
        "budget",
        &tiers,
        "--provider-limit",
        "100/1m",
        "--headroom",
        "10%",
    ]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    // (60 + 60) + (6,000 + 6,000) + (100 + 100) in one minute, three counters.
    assert!(
        r.stderr
            .contains("over budget: up to 12320 requests in 1m exceed the allowance of 90"),
        "{}",
        r.stderr
    );
    assert!(r.stdout.contains(" 3 "), "{}", r.stdout);
    let unlimited = file(
        "svc-unlimited.json",
        r#"{"domain":"svc-unlimited","global":{"cluster":"gw"},"tiers":{"free":{},"staff":{"unlimited":true}},
            "identity":{"default_tier":"free"},
            "rules":[{"name":"all","scope":"global","limits":[{"requests":60,"per":"1m"}]}]}"#,
    );
    let r = run(&["budget", &unlimited, "--provider-limit", "1000/1m"]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains(r#"rule "all": tier "staff" is unlimited: the total is unbounded"#),
        "{}",
        r.stderr
    );
}

/// Issue 11 item 4: limit sets other than `rules[].limits` and strings that
/// reach a header used to validate ok.
#[test]
fn validate_refuses_inexact_global_limits_anywhere_and_header_injection() {
    let global = r#""global":{"cluster":"gw"},"tiers":{"free":{},"gold":{}},"#;
    let year = r#"[{"requests":1000000,"per":"366d"}]"#;
    let cases = [
        (
            "tier.json",
            format!(
                r#"{{"domain":"d",{global}"identity":{{"default_tier":"free"}},
                    "rules":[{{"name":"g","scope":"global","limits":[{{"requests":5,"per":"1m"}}],"tiers":{{"gold":{year}}}}}]}}"#
            ),
            "tier.json: rules[0].tiers.gold[0].per: requests × per must stay under 2^53 milliseconds",
        ),
        (
            "client.json",
            format!(
                r#"{{"domain":"d",{global}"identity":{{"default_tier":"free","clients":{{"acme":{{"limits":{{"g":{year}}}}}}}}},
                    "rules":[{{"name":"g","scope":"global","limits":[{{"requests":5,"per":"1m"}}]}}]}}"#
            ),
            "client.json: identity.clients.acme.limits.g[0].per: requests × per must stay under 2^53 milliseconds",
        ),
        (
            "link.json",
            format!(
                r#"{{"domain":"d",{global}"identity":{{"default_tier":"free"}},
                    "rules":[{{"name":"g","limits":[{{"requests":5,"per":"1m"}}]}}],
                    "quotas":[{{"name":"q","period":"month","limit":5,
                               "upgrade_url":"https://x/\r\nSet-Cookie:session=evil\r\nX-A:\u0001"}}]}}"#
            ),
            r#"link.json: quotas[0].upgrade_url: "https://x/\r\nSet-Cookie:session=evil\r\nX-A:\u{1}" is not an absolute http(s) URL"#,
        ),
        (
            "type.json",
            r#"{"domain":"d","response":{"problem_type":"https://e.com/p\n"},
                "rules":[{"name":"g","limits":[{"requests":5,"per":"1m"}]}]}"#
                .to_string(),
            r#"type.json: response.problem_type: "https://e.com/p\n" is not an absolute URI"#,
        ),
    ];
    for (name, body, want) in cases {
        let r = run(&["validate", &file(name, &body)]);
        assert_eq!(r.code, 1, "{name}: {}{}", r.stdout, r.stderr);
        assert!(r.stderr.contains(want), "{name}: {}", r.stderr);
    }
}

/// A configuration the gateway would refuse on every request (more global
/// rules than one check carries, a `Host` header it never sees) validated ok.
#[test]
fn validate_refuses_what_the_gateway_or_envoy_would_never_run() {
    let rules: Vec<String> = (0..70)
        .map(|i| {
            format!(r#"{{"name":"g{i}","scope":"global","limits":[{{"requests":5,"per":"1m"}}]}}"#)
        })
        .collect();
    let seventy = format!(
        r#"{{"domain":"d","global":{{"cluster":"gw"}},"rules":[{}]}}"#,
        rules.join(",")
    );
    let r = run(&["validate", &file("seventy.json", &seventy)]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("seventy.json: rules[64].scope: a 65th global rule; one gateway check carries at most 64 buckets"),
        "{}",
        r.stderr
    );
    let host = r#"{"domain":"d","rules":[{"name":"h","key":["header:Host"],"limits":[{"requests":5,"per":"1m"}]}]}"#;
    let r = run(&["validate", &file("host.json", host)]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(r#"host.json: rules[0].key[0]: "Host" never reaches the filter as a header: Envoy keeps the host as :authority"#),
        "{}",
        r.stderr
    );
}

/// Shadow and graduated global rules run (the gateway enforces them), so
/// they validate; a graduated global rule whose bucket or demand would pass
/// 2^53 ms in the gateway's scripts does not.
#[test]
fn validate_accepts_shadow_and_graduated_global_rules_within_the_scripts_bounds() {
    let rule = |requests: u64, graduated: &str| {
        format!(
            r#"{{"domain":"d","global":{{"cluster":"gw"}},"identity":{{"clients":{{"t":{{"soft":true}}}}}},
                "rules":[{{"name":"s","scope":"global","mode":"shadow","key":["client"],
                           "limits":[{{"requests":5,"per":"1m"}}]}},
                         {{"name":"g","scope":"global","key":["client"],
                           "limits":[{{"requests":{requests},"per":"1d"}}],"graduated":{graduated}}}]}}"#
        )
    };
    let stages = r#"{"warn_at":0.8,"delay_at":1.0,"delay_ms":100,"reject_at":1.2,"block_at":2.0,"block_for":"5m"}"#;
    let r = run(&["validate", &file("parity.json", &rule(100, stages))]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let r = run(&["validate", &file("huge.json", &rule(100_000_000, stages))]);
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains(
            "huge.json: rules[1].limits[0].per: requests × per × the largest graduated share \
             (reject_at, block_at) must stay under 2^53 milliseconds for a global rule"
        ),
        "{}",
        r.stderr
    );
}

/// `envoy/envoy.yaml` rendered by testkit as every test renders it, with the
/// four edge settings the test removes taken out, written to `name`.
fn rendered_envoy(name: &str, remove: &[&str]) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let vars = testkit::TemplateVars {
        ports: testkit::Ports::DEMO,
        gateway_port: 8081,
        wasm_path: PathBuf::from("/opt/filters/ratelimit_wasm.wasm"),
        plugin_config: std::fs::read_to_string(root.join("envoy/ratelimit.json")).unwrap(),
        jwks: testkit::config::demo_jwks().unwrap(),
    };
    let template = std::fs::read_to_string(root.join("envoy/envoy.yaml")).unwrap();
    let mut text = testkit::render_template(&template, &vars).unwrap();
    for line in remove {
        let line = format!("          {line}\n");
        assert_eq!(text.matches(&line).count(), 1, "{line:?} in the template");
        text = text.replace(&line, "");
    }
    file(name, &text)
}

/// The four settings of the shipped edge listener (envoy/envoy.yaml).
const EDGE_SETTINGS: [&str; 4] = [
    "use_remote_address: true",
    "normalize_path: true",
    "merge_slashes: true",
    "path_with_escaped_slashes_action: UNESCAPE_AND_REDIRECT",
];

/// The warning for a client id header the client writes itself.
const CLIENT_ID_WARNING: &str = "the client id comes from header \"x-client-id\", which no filter in front of the ratelimit filter sets or removes, so a client writes its own id and gets a fresh bucket per forged id; remove it (header_mutation), set it from a verified token (jwt_authn claim_to_headers), or read identity.client_id_metadata";

/// The shipped edge pairing (`envoy/envoy.yaml` with `envoy/ratelimit.json`,
/// which reads the id from jwt_authn's metadata) passes; the compose demo,
/// keyed on the client-written `x-client-id` on purpose, is flagged: forged
/// ids got 15 of 15 requests past a limit of 10 when the edge pairing keyed
/// on that header.
#[test]
fn check_envoy_passes_the_shipped_envoy_configs_but_flags_a_client_written_id() {
    let template = rendered_envoy("rendered-envoy.yaml", &[]);
    let compose = format!(
        "{}/../deploy/compose/envoy.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    // The template itself too: its `${NAME}` placeholders are read as strings.
    let raw = shipped("envoy.yaml");
    let r = run(&["check-envoy", &template, &compose, &raw]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(
        r.stderr,
        format!("{compose}: warning: listener \"ingress\": {CLIENT_ID_WARNING}\n")
    );
    assert_eq!(
        r.stdout,
        format!(
            "{template}: ok (listener \"ingress\" runs the filter)\n\
             {raw}: ok (listener \"ingress\" runs the filter)\n"
        )
    );
}

#[test]
fn check_envoy_warns_on_the_old_unsafe_template_in_yaml_and_json() {
    // The template before the edge settings: none of the four.
    let old = rendered_envoy("old-envoy.yaml", &EDGE_SETTINGS);
    let l = "listener \"ingress\"";
    let want = |f: &str| {
        format!(
            "{f}: warning: {l}: use_remote_address is not true, so Envoy takes source.address (the filter's `ip`) from X-Forwarded-For (its last entry), which a client that reaches this listener directly writes itself; set use_remote_address: true (behind N trusted proxies, with xff_num_trusted_hops: N)\n\
             {f}: warning: {l}: normalize_path is not true, so `/a/../upload` and `/%75pload` reach the filter as written and pass a path_prefix \"/upload\" rule; set normalize_path: true\n\
             {f}: warning: {l}: merge_slashes is not true, so `//upload` passes a path_prefix \"/upload\" rule; set merge_slashes: true\n\
             {f}: warning: {l}: path_with_escaped_slashes_action is unset, so `/api%2Fupload` passes a path_prefix \"/api/upload\" rule and reaches an upstream that may decode it; set UNESCAPE_AND_REDIRECT (or REJECT_REQUEST, UNESCAPE_AND_FORWARD)\n"
        )
    };
    let r = run(&["check-envoy", &old]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert_eq!(r.stdout, "");
    assert_eq!(r.stderr, want(&old));

    // The same bootstrap as JSON.
    let yaml: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(&old).unwrap()).unwrap();
    let json = file(
        "old-envoy.json",
        &serde_json::to_string_pretty(&yaml).unwrap(),
    );
    let r = run(&["check-envoy", &json]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert_eq!(r.stderr, want(&json));

    // Only the remote address missing: one warning; trusted hops with it
    // are explained.
    let one = rendered_envoy("ura-only.yaml", &EDGE_SETTINGS[..1]);
    let text = std::fs::read_to_string(&one).unwrap().replace(
        "stat_prefix: ingress_http\n",
        "stat_prefix: ingress_http\n          xff_num_trusted_hops: 1\n",
    );
    let hops = file("ura-hops.yaml", &text);
    let r = run(&["check-envoy", &hops]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        format!("{hops}: warning: {l}: use_remote_address is not true, so Envoy takes source.address (the filter's `ip`) from X-Forwarded-For (entry 2 from the right, as xff_num_trusted_hops is 1), which a client that reaches this listener directly writes itself; set use_remote_address: true (behind N trusted proxies, with xff_num_trusted_hops: N)\n")
    );
}

#[test]
fn check_envoy_refuses_files_without_the_filter_or_unreadable() {
    let none = file(
        "no-filter.yaml",
        "static_resources:\n  listeners:\n  - name: plain\n    filter_chains: []\n",
    );
    let garbage = file("garbage.yaml", "a: [unclosed\n");
    let r = run(&["check-envoy", &none, &garbage]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(&format!(
            "{none}: no listener runs the ratelimit-wasm filter (an envoy.filters.http.wasm entry with root_id \"ratelimit\" or code file ratelimit_wasm.wasm in static_resources.listeners)"
        )),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains(&format!("{garbage}: not valid YAML")),
        "{}",
        r.stderr
    );
    assert_eq!(run(&["check-envoy"]).code, 2, "no file is a usage error");
}

/// The workspace root (the shipped `deploy/` lives there).
fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `ratelimit ARGS` run from the workspace root, so that paths in the
/// generated headers are the relative ones a user types there.
fn run_in_workspace(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit"))
        .args(args)
        .current_dir(workspace())
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn yaml(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fresh empty output directory under the temp dir.
fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ratelimit-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `ratelimit render <src> --out <out> <extra>`.
fn render(src: &str, out: &Path, extra: &[&str]) -> Run {
    let out = out.to_str().unwrap();
    run(&[&["render", src, "--out", out][..], extra].concat())
}

const RENDER_CONFIG: &str = r#"{
  "domain": "shop:eu",
  "global": { "cluster": "outbound|8081||gw.ratelimit.svc.cluster.local", "failure_mode": "closed" },
  "rules": [
    { "name": "api", "scope": "global", "key": ["client"],
      "limits": [ { "requests": 30, "per": "1m" } ] }
  ]
}
"#;

#[test]
fn render_istio_writes_one_configuration_for_the_plugins_and_the_gateway() {
    let src = file("render.json", RENDER_CONFIG);
    let out = out_dir("istio");
    let r = render(
        &src,
        &out,
        &[
            "--namespace",
            "shop",
            "--selector",
            "app=web",
            "--selector",
            "tier=edge",
            "--policy-namespace",
            "gw",
            "--sha256",
            &"ab".repeat(32),
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let written: Vec<String> = [
        "wasmplugin.yaml",
        "wasmplugin-file.yaml",
        "gateway-policy.yaml",
    ]
    .iter()
    .map(|n| out.join(n).display().to_string())
    .collect();
    assert_eq!(r.stdout, format!("{}\n", written.join("\n")));
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "gateway-policy.yaml",
            "wasmplugin-file.yaml",
            "wasmplugin.yaml"
        ]
    );

    let source: serde_json::Value = serde_json::from_str(RENDER_CONFIG).unwrap();
    let oci = yaml(&out.join("wasmplugin.yaml"));
    let from_file = yaml(&out.join("wasmplugin-file.yaml"));
    for p in [&oci, &from_file] {
        assert_eq!(p["kind"], "WasmPlugin");
        assert_eq!(p["metadata"]["namespace"], "shop");
        assert_eq!(
            p["spec"]["selector"]["matchLabels"],
            serde_json::json!({ "app": "web", "tier": "edge" })
        );
        assert_eq!(p["spec"]["pluginConfig"], source);
        assert_eq!(p["spec"]["phase"], "AUTHZ");
        // No token_env in this configuration: no VM environment.
        assert!(p["spec"].get("vmConfig").is_none(), "{}", p["spec"]);
    }
    assert_eq!(
        oci["spec"]["url"],
        "oci://ghcr.io/example/ratelimit-wasm:0.1.0"
    );
    assert_eq!(oci["spec"]["sha256"], "ab".repeat(32));
    assert_eq!(
        from_file["spec"]["url"],
        "file:///opt/filters/ratelimit_wasm.wasm"
    );
    assert!(from_file["spec"].get("sha256").is_none());

    // The gateway's policy: the same text, under a key a ConfigMap allows
    // (`:` is not one), in the gateway's namespace.
    let cm = yaml(&out.join("gateway-policy.yaml"));
    assert_eq!(cm["kind"], "ConfigMap");
    assert_eq!(cm["metadata"]["name"], "ratelimit-policy");
    assert_eq!(cm["metadata"]["namespace"], "gw");
    let data = cm["data"].as_object().unwrap();
    assert_eq!(data.keys().collect::<Vec<_>>(), ["shop_eu.json"]);
    assert_eq!(data["shop_eu.json"], RENDER_CONFIG);
}

#[test]
fn render_envoy_writes_the_filter_entry_and_the_policy_file() {
    let src = file("render-envoy.json", RENDER_CONFIG);
    let out = out_dir("envoy");
    let r = render(
        &src,
        &out,
        &["--target", "envoy", "--file-url", "/etc/envoy/rl.wasm"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout.lines().count(), 2, "{}", r.stdout);
    let filter = yaml(&out.join("envoy-wasm-filter.yaml"));
    assert_eq!(filter["name"], "envoy.filters.http.wasm");
    let config = &filter["typed_config"]["config"];
    assert_eq!(config["root_id"], "ratelimit");
    assert_eq!(config["failure_policy"], "FAIL_RELOAD");
    assert_eq!(
        config["vm_config"]["code"]["local"]["filename"],
        "/etc/envoy/rl.wasm"
    );
    assert!(config["vm_config"].get("environment_variables").is_none());
    assert_eq!(config["configuration"]["value"], RENDER_CONFIG);
    assert_eq!(
        std::fs::read_to_string(out.join("shop_eu.json")).unwrap(),
        RENDER_CONFIG
    );
}

#[test]
fn render_refuses_bad_input_and_writes_nothing() {
    let out = out_dir("refused");
    let bad = file(
        "render-bad.json",
        r#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":5,"per":"10x"}]}]}"#,
    );
    let r = render(&bad, &out, &[]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains(r#"render-bad.json: rules[0].limits[0].per: "10x" is not a duration"#),
        "{}",
        r.stderr
    );
    assert!(
        !out.exists(),
        "a refused configuration wrote {}",
        out.display()
    );

    let good = file("render-good.json", RENDER_CONFIG);
    let r = render(&good, &out, &["--target", "helm"]);
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "--target \"helm\": expected istio or envoy\n");
    let r = render(
        &good,
        &out,
        &["--selector", "app", "--sha256", &"ab".repeat(32)],
    );
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "--selector \"app\": expected key=value\n");
    assert!(!out.exists());
    assert_eq!(run(&["render", &good]).code, 2, "--out is required");
}

/// The shipped `deploy/istio/` WasmPlugins and policy ConfigMap are the
/// output of `ratelimit render deploy/istio/ratelimit.json` with the default
/// options. `UPDATE_ISTIO_MANIFESTS=1 cargo test -p ratelimit-cli --test cli`
/// rewrites them.
#[test]
fn shipped_istio_manifests_are_rendered_from_one_configuration() {
    let out = out_dir("shipped");
    let r = run_in_workspace(&[
        "render",
        "deploy/istio/ratelimit.json",
        "--out",
        out.to_str().unwrap(),
        "--sha256",
        &"0".repeat(64),
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let names = [
        "wasmplugin.yaml",
        "wasmplugin-file.yaml",
        "gateway-policy.yaml",
    ];
    let update = std::env::var_os("UPDATE_ISTIO_MANIFESTS").is_some();
    let mut stale = Vec::new();
    for name in names {
        let want = std::fs::read_to_string(out.join(name)).unwrap();
        let shipped = workspace().join("deploy/istio").join(name);
        if update {
            std::fs::write(&shipped, &want).unwrap();
            eprintln!("wrote {}", shipped.display());
            continue;
        }
        let have = std::fs::read_to_string(&shipped).unwrap_or_default();
        if have != want {
            let line = have
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(have.lines().count().min(want.lines().count()));
            stale.push(format!(
                "deploy/istio/{name} (first difference at line {})",
                line + 1
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "stale: {}; regenerate with\n  UPDATE_ISTIO_MANIFESTS=1 cargo test -p ratelimit-cli --test cli",
        stale.join(", ")
    );
}

#[test]
fn render_passes_the_token_variable_from_the_proxy_into_the_vm() {
    let config = RENDER_CONFIG.replace(
        r#""failure_mode": "closed" }"#,
        r#""failure_mode": "closed", "token_env": "RL_TOKEN" }"#,
    );
    assert_ne!(config, RENDER_CONFIG);
    let src = file("render-token.json", &config);
    let out = out_dir("token");
    let r = render(&src, &out, &["--sha256", &"ab".repeat(32)]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stderr, "");
    for name in ["wasmplugin.yaml", "wasmplugin-file.yaml"] {
        let p = yaml(&out.join(name));
        assert_eq!(
            p["spec"]["vmConfig"],
            serde_json::json!({ "env": [ { "name": "RL_TOKEN", "valueFrom": "HOST" } ] }),
            "{name}"
        );
    }
    let r = render(&src, &out, &["--target", "envoy"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let filter = yaml(&out.join("envoy-wasm-filter.yaml"));
    assert_eq!(
        filter["typed_config"]["config"]["vm_config"]["environment_variables"],
        serde_json::json!({ "host_env_keys": ["RL_TOKEN"] })
    );
    // An inline token kept by --inline-token is rendered, with a warning
    // that it is readable.
    let inline = file(
        "render-inline.json",
        &RENDER_CONFIG.replace(
            r#""failure_mode": "closed" }"#,
            r#""failure_mode": "closed", "token": "abc123" }"#,
        ),
    );
    let r = render(
        &inline,
        &out,
        &["--inline-token", "--sha256", &"ab".repeat(32)],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr.contains("warning: global.token is inline"),
        "{}",
        r.stderr
    );
}

/// An Istio render without a pinned digest, or whose gateway cluster is not
/// Istio's `outbound|PORT||HOST`, fails and says which flag fills it in.
#[test]
fn render_istio_refuses_an_unpinned_digest_and_a_non_istio_cluster() {
    let src = file(
        "render-unpinned.json",
        &RENDER_CONFIG.replace("outbound|8081||gw.ratelimit.svc.cluster.local", "gw"),
    );
    let out = out_dir("unpinned");
    let sha = "ab".repeat(32);
    let r = render(
        &src,
        &out,
        &["--gateway-host", "gw.ratelimit.svc.cluster.local"],
    );
    assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("--sha256 is required for --target istio"),
        "{}",
        r.stderr
    );
    let zeros = out_dir("zeros");
    let r = render(
        &src,
        &zeros,
        &["--sha256", &"0".repeat(64), "--gateway-host", "gw.x"],
    );
    assert_eq!(r.code, 0, "an explicit placeholder renders: {}", r.stderr);
    assert!(
        r.stderr.contains("64 zeros is a placeholder"),
        "{}",
        r.stderr
    );
    let r = render(
        &src,
        &out,
        &["--sha256", "sha256:abc", "--gateway-host", "gw.x"],
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("expected 64 lower-case hex digits"),
        "{}",
        r.stderr
    );
    let r = render(&src, &out, &["--sha256", &sha]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            r#"global.cluster "gw": Istio names the gateway's cluster outbound|PORT||HOST; pass --gateway-host"#
        ),
        "{}",
        r.stderr
    );
    assert!(!out.exists());
    let r = render(
        &src,
        &out,
        &[
            "--sha256",
            &sha,
            "--gateway-host",
            "gw.ratelimit.svc.cluster.local",
            "--gateway-port",
            "9000",
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    let oci = yaml(&out.join("wasmplugin.yaml"));
    assert_eq!(oci["spec"]["sha256"], sha.as_str());
    assert_eq!(
        oci["spec"]["pluginConfig"]["global"]["cluster"],
        "outbound|9000||gw.ratelimit.svc.cluster.local"
    );
}

/// A literal `global.token` is rendered as `token_env`, so the token is not
/// in the manifests nor in Envoy's config_dump; `--inline-token` keeps it.
#[test]
fn render_moves_a_literal_token_to_token_env() {
    let config = r#"{"domain":"d","global":{"cluster":"gw","token":"s3cret-s3cret-s3cret"},
        "rules":[{"name":"api","scope":"global","limits":[{"requests":30,"per":"1m"}]}]}"#;
    let src = file("render-literal-token.json", config);
    let out = out_dir("literal-token");
    let r = render(&src, &out, &["--target", "envoy"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let filter = std::fs::read_to_string(out.join("envoy-wasm-filter.yaml")).unwrap();
    let policy = std::fs::read_to_string(out.join("d.json")).unwrap();
    for text in [&filter, &policy] {
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("RATELIMIT_GATEWAY_TOKEN"), "{text}");
    }
    let f = yaml(&out.join("envoy-wasm-filter.yaml"));
    assert_eq!(
        f["typed_config"]["config"]["vm_config"]["environment_variables"]["host_env_keys"],
        serde_json::json!(["RATELIMIT_GATEWAY_TOKEN"])
    );
    assert!(
        r.stderr.contains("global.token is not rendered"),
        "{}",
        r.stderr
    );
    let out2 = out_dir("literal-token-inline");
    let r = render(&src, &out2, &["--target", "envoy", "--inline-token"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let filter = std::fs::read_to_string(out2.join("envoy-wasm-filter.yaml")).unwrap();
    assert!(filter.contains("s3cret"), "{filter}");
}

/// A per-client token rule on the `openai_chat` preset, a rule reading a
/// header, and a fixed-cost rule refunded outside its `charge_on`.
const CHARGING: &str = r#"{"domain":"llm","rules":[
    {"name":"tokens","key":["client"],"limits":[{"requests":100000,"per":"1m"}],
     "cost_from":{"preset":"openai_chat","max":4000,"reserve":500,"scan_limit":1024},"charge_on":["2xx"]},
    {"name":"hdr","limits":[{"requests":1000,"per":"1m"}],"cost_from":{"header":"X-Usage","max":100,"reserve":5}},
    {"name":"req","limits":[{"requests":60,"per":"1m"}],"cost":1,"charge_on":["2xx","404"]}],
  "costs":[{"match":{"path_prefix":"/v1/embeddings"},
            "cost_from":{"json":[{"pointer":"/usage/total_tokens","weight":2}],"max":4000}}]}"#;

fn settled(args: &[&str]) -> Vec<String> {
    let r = run(args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let at = r
        .stdout
        .find("\nsample response:")
        .expect("a sample section");
    r.stdout[at + 1..].lines().map(String::from).collect()
}

#[test]
fn explain_shows_what_cost_from_reserves_and_how_it_settles() {
    let f = file("charging-describe.json", CHARGING);
    let r = run(&["explain", &f]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let tokens_row = r.stdout.lines().nth(1).unwrap();
    assert!(
        tokens_row.contains("from response: 500..4000"),
        "{}",
        r.stdout
    );
    let section = &r.stdout[r.stdout.find("\ncharged from the response:\n").unwrap()..];
    assert_eq!(
        section.lines().skip(2).collect::<Vec<_>>(),
        [
            "rule \"tokens\": reserve 500 when the request arrives; settles when the response ends to the cost it reports, at most max 4000",
            "  source: preset openai_chat: /usage/prompt_tokens × 1 + /usage/completion_tokens × 1",
            "  scan_limit: 1024 bytes (a longer body keeps the reserve)",
            "  charge_on: 2xx (another status, or no response, gives the charge back)",
            "rule \"hdr\": reserve 5 when the request arrives; settles when the response ends to the cost it reports, at most max 100",
            "  source: response header x-usage (a decimal integer)",
            "  scan_limit: not used (the body is not read)",
            "rule \"req\": cost 1, charged when the request arrives",
            "  charge_on: 2xx, 404 (another status, or no response, gives the charge back)",
            "costs[0] (for rules without a cost of their own, on the requests it matches): reserve 1 when the request arrives; settles when the response ends to the cost it reports, at most max 4000",
            "  source: JSON body or SSE events: /usage/total_tokens × 2",
            "  scan_limit: 1048576 bytes (a longer body keeps the reserve)",
        ],
        "{}",
        r.stdout
    );
    assert!(!r.stdout.contains("sample response"), "{}", r.stdout);
    // A configuration charging nothing from the response has no such section.
    let plain = run(&["explain", &shipped("ratelimit.json")]);
    assert!(!plain.stdout.contains("charged from the response"));
    // The sample options need a body.
    assert_eq!(run(&["explain", &f, "--status", "500"]).code, 2);
    let bad = file("sample.json", "{}");
    let r = run(&[
        "explain",
        &f,
        "--response-body",
        &bad,
        "--response-header",
        "nocolon",
    ]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("expected 'name: value'"), "{}", r.stderr);
}

#[test]
fn explain_settles_a_json_response_with_the_filters_scanner() {
    let f = file("charging-json.json", CHARGING);
    let body = file(
        "chat.json",
        r#"{"id":"c1","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":1000,"completion_tokens":234,"total_tokens":1234}}"#,
    );
    assert_eq!(
        settled(&[
            "explain",
            &f,
            "--response-body",
            &body,
            "--response-header",
            "X-Usage: 7",
            "--content-type",
            "application/json"
        ]),
        [
            "sample response: status 200, read as JSON, body 127 bytes",
            "rule \"tokens\": reserved 500, reported 1234, charged 1234, settlement +734; charge_on 2xx: status 200 keeps the charge",
            "rule \"hdr\": reserved 5, reported 7, charged 7, settlement +2",
            "rule \"req\": reserved 1 (a fixed cost), charged 1, settlement 0; charge_on 2xx, 404: status 200 keeps the charge",
            "costs[0]: reserved 1, reported 2468, charged 2468, settlement +2467",
        ]
    );
}

#[test]
fn explain_settles_an_event_stream_from_its_last_usage() {
    let f = file("charging-sse.json", CHARGING);
    let body = file(
        "chat.sse",
        "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
         data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":22,\"total_tokens\":42}}\n\n\
         data: [DONE]\n\n",
    );
    assert_eq!(
        settled(&[
            "explain",
            &f,
            "--response-body",
            &body,
            "--content-type",
            "text/event-stream; charset=utf-8"
        ]),
        [
            "sample response: status 200, read as server-sent events, body 167 bytes",
            "rule \"tokens\": reserved 500, reported 42, charged 42, settlement -458; charge_on 2xx: status 200 keeps the charge",
            "rule \"hdr\": reserved 5, reported missing, charged 5 (the reserve), settlement 0",
            "rule \"req\": reserved 1 (a fixed cost), charged 1, settlement 0; charge_on 2xx, 404: status 200 keeps the charge",
            "costs[0]: reserved 1, reported 84, charged 84, settlement +83",
        ]
    );
}

#[test]
fn explain_keeps_the_reserve_when_usage_is_missing_over_scan_limit_or_compressed() {
    let f = file("charging-kept.json", CHARGING);
    // No usage: the reserve stays charged (ratelimit_wasm_usage_missing).
    let none = file("nousage.json", r#"{"id":"c1","choices":[]}"#);
    let lines = settled(&["explain", &f, "--response-body", &none]);
    assert_eq!(
        lines[1],
        "rule \"tokens\": reserved 500, reported missing, charged 500 (the reserve), settlement 0; charge_on 2xx: status 200 keeps the charge"
    );
    // Usage past scan_limit (1024 bytes) is never read.
    let long = file(
        "long.json",
        &format!(
            r#"{{"pad":"{}","usage":{{"prompt_tokens":1,"completion_tokens":1}}}}"#,
            "x".repeat(1100)
        ),
    );
    let lines = settled(&["explain", &f, "--response-body", &long]);
    assert_eq!(
        lines[1],
        "rule \"tokens\": reserved 500, reported over scan_limit (1160 bytes > 1024), charged 500 (the reserve), settlement 0; charge_on 2xx: status 200 keeps the charge"
    );
    // A compressed body is not scanned; a header source is still read.
    let body = file(
        "gz.json",
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
    );
    let lines = settled(&[
        "explain",
        &f,
        "--response-body",
        &body,
        "--response-header",
        "Content-Encoding: gzip",
        "--response-header",
        "x-usage: 3",
    ]);
    assert_eq!(
        lines,
        [
            "sample response: status 200, content-encoding gzip: the body is not scanned, body 51 bytes",
            "rule \"tokens\": reserved 500, reported compressed (not scanned), charged 500 (the reserve), settlement 0; charge_on 2xx: status 200 keeps the charge",
            "rule \"hdr\": reserved 5, reported 3, charged 3, settlement -2",
            "rule \"req\": reserved 1 (a fixed cost), charged 1, settlement 0; charge_on 2xx, 404: status 200 keeps the charge",
            "costs[0]: reserved 1, reported compressed (not scanned), charged 1 (the reserve), settlement 0",
        ]
    );
}

#[test]
fn explain_caps_the_charge_at_max() {
    let f = file("charging-capped.json", CHARGING);
    let body = file(
        "big.json",
        r#"{"usage":{"prompt_tokens":3000,"completion_tokens":6000}}"#,
    );
    let lines = settled(&[
        "explain",
        &f,
        "--response-body",
        &body,
        "--response-header",
        "x-usage: 250",
    ]);
    assert_eq!(
        lines[1],
        "rule \"tokens\": reserved 500, reported 9000, charged 4000 (max), settlement +3500; charge_on 2xx: status 200 keeps the charge"
    );
    assert_eq!(
        lines[2],
        "rule \"hdr\": reserved 5, reported 250, charged 100 (max), settlement +95"
    );
}

#[test]
fn explain_gives_the_charge_back_for_a_status_outside_charge_on() {
    let f = file("charging-status.json", CHARGING);
    let body = file("err.json", r#"{"error":{"message":"overloaded"}}"#);
    for (status, req) in [
        (
            "500",
            "rule \"req\": reserved 1 (a fixed cost), charged 0, settlement -1; charge_on 2xx, 404: status 500 gives the charge back",
        ),
        (
            "404",
            "rule \"req\": reserved 1 (a fixed cost), charged 1, settlement 0; charge_on 2xx, 404: status 404 keeps the charge",
        ),
    ] {
        let lines = settled(&["explain", &f, "--response-body", &body, "--status", status]);
        assert_eq!(
            lines[1],
            format!(
                "rule \"tokens\": reserved 500, reported not read, charged 0, settlement -500; charge_on 2xx: status {status} gives the charge back"
            )
        );
        // No charge_on: the rule settles whatever the status.
        assert_eq!(
            lines[2],
            "rule \"hdr\": reserved 5, reported missing, charged 5 (the reserve), settlement 0"
        );
        assert_eq!(lines[3], req);
    }
}

/// A cost read from the response is a range known only when the response
/// ends: budget says so instead of counting such a request as 1.
#[test]
fn budget_states_that_a_cost_from_the_response_lies_between_reserve_and_max() {
    let f = file(
        "svc-llm.json",
        r#"{"domain":"svc-llm","global":{"cluster":"gw"},"rules":[
            {"name":"all","scope":"global","cost":1,"limits":[{"requests":300,"per":"1m"}]},
            {"name":"tokens","key":["client"],"limits":[{"requests":100000,"per":"1m"}],
             "cost_from":{"preset":"openai_chat","max":4000,"reserve":500}}],
          "costs":[{"match":{"path_prefix":"/v1/embeddings"},
                    "cost_from":{"header":"x-usage","max":100}}]}"#,
    );
    let r = run(&["budget", &f, "--provider-limit", "1000/1m"]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines.contains(&format!(
            "note: {f}: rule \"tokens\" is charged from the response, between 500 (reserve) and 4000 (max) \
             per request; it is local, so it does not bound the service's total"
        )
        .as_str()),
        "{}",
        r.stdout
    );
    assert!(
        lines.contains(
            &format!(
            "note: {f}: costs[0] is charged from the response, between 1 (reserve) and 100 (max) \
             per request, in the rules without a cost of their own and the quotas counting cost"
        )
            .as_str()
        ),
        "{}",
        r.stdout
    );
    // The global rule alone bounds the service: 300 + 300 in a minute.
    assert!(
        r.stdout.contains("ok: 66.7% of the allowance"),
        "{}",
        r.stdout
    );
}

/// `validate` reads with `config::parse`, as the filter loads: a bad
/// `cost_from` is refused with its field path, a good one accepted.
#[test]
fn validate_names_the_field_path_of_a_bad_cost_from() {
    let rule = |cost_from: &str, extra: &str| {
        format!(
            r#"{{"domain":"d","rules":[{{"name":"r","limits":[{{"requests":10000,"per":"1m"}}],
                "cost_from":{cost_from}{extra}}}]}}"#
        )
    };
    let good = file(
        "cost-from-good.json",
        &rule(
            r#"{"preset":"anthropic_messages","max":4000,"reserve":100}"#,
            r#","charge_on":["2xx","404"]"#,
        ),
    );
    let r = run(&["validate", &good]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.ends_with("cost-from-good.json: ok\n"),
        "{}",
        r.stdout
    );
    for (name, cost_from, extra, error) in [
        (
            "cost-from-pointer.json",
            r#"{"json":[{"pointer":"usage/total_tokens"}],"max":4000}"#,
            "",
            r#"rules[0].cost_from.json[0].pointer: "usage/total_tokens" is not a JSON Pointer: it must start with /"#,
        ),
        (
            "cost-from-two.json",
            r#"{"header":"x-usage","preset":"openai_chat","max":4000}"#,
            "",
            "rules[0].cost_from: give exactly one of header, json and preset",
        ),
        (
            "cost-from-reserve.json",
            r#"{"preset":"openai_chat","max":10,"reserve":11}"#,
            "",
            "rules[0].cost_from.reserve: 11 is above max (10)",
        ),
        (
            "cost-from-preset.json",
            r#"{"preset":"openai_chatt","max":10}"#,
            "",
            "rules[0].cost_from.preset: unknown variant `openai_chatt`, expected one of `openai_chat`, `openai_responses`, `anthropic_messages`",
        ),
        (
            "cost-from-charge-on.json",
            r#"{"preset":"openai_chat","max":10}"#,
            r#","charge_on":["2xy"]"#,
            r#"rules[0].charge_on[0]: "2xy" is not a status class (1xx to 5xx) or a status code (100 to 599)"#,
        ),
    ] {
        let bad = file(name, &rule(cost_from, extra));
        let r = run(&["validate", &bad]);
        assert_eq!(r.code, 1, "{name}: {}", r.stdout);
        assert!(
            r.stderr.contains(&format!("{name}: {error}")),
            "{name}: {}",
            r.stderr
        );
    }
    // The gateway settles a global rule; in lease mode its batch does.
    let global = file(
        "cost-from-global.json",
        r#"{"domain":"d","global":{"cluster":"gw"},"rules":[{"name":"r","scope":"global",
            "limits":[{"requests":10000,"per":"1m"}],"cost_from":{"preset":"openai_chat","max":10}}]}"#,
    );
    let r = run(&["validate", &global]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let leased = file(
        "cost-from-lease.json",
        r#"{"domain":"d","global":{"cluster":"gw","lease":{"fraction":0.1}},"rules":[{"name":"r",
            "scope":"global","limits":[{"requests":10000,"per":"1m"}],
            "cost_from":{"preset":"openai_chat","max":10}}]}"#,
    );
    let r = run(&["validate", &leased]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// The filter settles and refunds only enforced rules' charges: a shadow
/// rule is charged its reservation and nothing more, and explain says so.
#[test]
fn explain_settles_a_shadow_rule_as_an_enforced_one() {
    let f = file(
        "charging-shadow.json",
        r#"{"domain":"llm","rules":[{"name":"tokens","key":["client"],"mode":"shadow",
            "limits":[{"requests":100000,"per":"1m"}],
            "cost_from":{"preset":"openai_chat","max":4000,"reserve":500},"charge_on":["2xx"]}]}"#,
    );
    let body = file(
        "shadow-body.json",
        r#"{"usage":{"prompt_tokens":1000,"completion_tokens":234}}"#,
    );
    let r = run(&["explain", &f, "--response-body", &body, "--status", "500"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let section = &r.stdout[r.stdout.find("\ncharged from the response:\n").unwrap()..];
    assert_eq!(
        section.lines().skip(2).collect::<Vec<_>>(),
        [
            "rule \"tokens\": reserve 500 when the request arrives; settles when the response ends to the cost it reports, at most max 4000",
            "  source: preset openai_chat: /usage/prompt_tokens × 1 + /usage/completion_tokens × 1",
            "  scan_limit: 1048576 bytes (a longer body keeps the reserve)",
            "  charge_on: 2xx (another status, or no response, gives the charge back)",
            "",
            "sample response: status 500, read as JSON, body 56 bytes",
            "rule \"tokens\": reserved 500, reported not read, charged 0, settlement -500; charge_on 2xx: status 500 gives the charge back",
        ],
        "{}",
        r.stdout
    );
}

#[test]
fn explain_shows_a_concurrency_limit_as_slots_not_a_rate() {
    let f = file(
        "concurrency.json",
        r#"{"domain":"d","rules":[
            {"name":"streams","key":["client"],"limits":[{"concurrent":3,"max_in_flight":"2m"}]},
            {"name":"rate","key":["client"],"limits":[{"requests":10,"per":"1m"}]}]}"#,
    );
    let r = run(&["explain", &f]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let row: Vec<&str> = r
        .stdout
        .lines()
        .nth(1)
        .unwrap()
        .split("  ")
        .filter(|c| !c.trim().is_empty())
        .map(str::trim)
        .collect();
    assert_eq!(
        row,
        [
            "streams",
            "*",
            "3 in flight (slot held ≤ 120s)",
            "-",
            "1",
            "local",
            "-",
            "enforce",
            "\"streams\";q=3;qu=\"concurrent-requests\""
        ],
        "{}",
        r.stdout
    );
}

#[test]
fn validate_and_explain_handle_every_condition_and_key_part() {
    let good = file(
        "match.json",
        r#"{"domain":"d","rules":[{"name":"api","limits":[{"requests":5,"per":"1m"}],
            "match":{"host":"*.example.com","path_regex":"/v[0-9]+/.*","route":"api",
                     "route_metadata":{"ratelimit/plan":"premium"},
                     "metadata":{"envoy.filters.http.jwt_authn/payload/org":"acme"},
                     "query":{"debug":true},"cookie":{"session":"s"},
                     "not":{"path_prefix":"/health"},"any":[{"host_regex":"a|b"},{"methods":["GET"]}]},
            "key":["host","route","ip/24/64","query:api_key","cookie:session",
                   "metadata:envoy.filters.http.jwt_authn/payload/org"]}]}"#,
    );
    let r = run(&["validate", &good]);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    let r = run(&["explain", &good]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "rule api: host is *.example.com (any case, port stripped) and path matches \"/v[0-9]+/.*\" whole and route is \"api\"",
        "not (path starts with /health) and any of (host matches \"a|b\" whole) or (method in GET)",
        "key: host, route, ip/24/64, query:api_key, cookie:session, metadata:envoy.filters.http.jwt_authn/payload/org",
        "properties read from Envoy per request (one host call each):",
        "  metadata filter_metadata/envoy.filters.http.jwt_authn/payload/org",
        "  xds.route_metadata filter_metadata/ratelimit/plan",
        "  xds.route_name",
    ] {
        assert!(r.stdout.contains(want), "{want}\n{}", r.stdout);
    }
    for (name, rule, want) in [
        (
            "regex.json",
            r#""match":{"path_regex":"(a"}"#,
            "regex.json: rules[0].match.path_regex: \"(a\" is not a regular expression",
        ),
        (
            "prefix.json",
            r#""key":["ip/33/64"]"#,
            "prefix.json: rules[0].key[0]: ip/\"33/64\" is not an IP prefix",
        ),
        (
            "meta.json",
            r#""key":["metadata:jwt"]"#,
            "meta.json: rules[0].key[0]: \"jwt\" is not a metadata path",
        ),
        (
            "nested.json",
            r#""match":{"any":[{"not":{"host":"a:1"}}]}"#,
            "nested.json: rules[0].match.any[0].not.host: \"a:1\" is not a host name",
        ),
    ] {
        let f = file(
            name,
            &format!(
                r#"{{"domain":"d","rules":[{{"name":"r","limits":[{{"requests":5,"per":"1m"}}],{rule}}}]}}"#
            ),
        );
        let r = run(&["validate", &f]);
        assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
        assert!(r.stderr.contains(want), "{want}\n{}", r.stderr);
    }
}

#[test]
fn validate_and_explain_handle_limits_by() {
    let f = file(
        "limits_by.json",
        r#"{"domain":"d","rules":[{"name":"per-plan","key":["ip"],"limits":[{"requests":10,"per":"1m"}],
            "limits_by":{"route_metadata":"ratelimit/plan","sets":{
              "premium":[{"requests":1000,"per":"1m"}],"basic":[{"requests":100,"per":"1m"}]}}}]}"#,
    );
    let r = run(&["validate", &f]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = run(&["explain", &f]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let rows: Vec<&str> = r
        .stdout
        .lines()
        .filter(|l| l.starts_with("per-plan"))
        .map(str::trim_end)
        .collect();
    assert_eq!(rows.len(), 3, "{}", r.stdout);
    assert!(
        rows[0].contains("route metadata ratelimit/plan names no set")
            && rows[0].contains(r#""per-plan";q=10;w=60"#),
        "{}",
        r.stdout
    );
    assert!(
        rows[1].contains(r#"route metadata ratelimit/plan is "basic""#)
            && rows[1].contains(r#""per-plan";q=100;w=60"#),
        "{}",
        r.stdout
    );
    assert!(
        rows[2].contains(r#"route metadata ratelimit/plan is "premium""#)
            && rows[2].contains(r#""per-plan";q=1000;w=60"#),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("\n  xds.route_metadata filter_metadata/ratelimit/plan\n"),
        "{}",
        r.stdout
    );
    let bad = file(
        "limits_by_bad.json",
        r#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":10,"per":"1m"}],
            "limits_by":{"metadata":"plan","sets":{"a":[{"requests":1,"per":"1m"}]}}}]}"#,
    );
    let r = run(&["validate", &bad]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .contains(r#"rules[0].limits_by.metadata: "plan" is not a metadata path"#),
        "{}",
        r.stderr
    );
}

/// `explain --envoy`: the routes of docs/configuration.md's example, in a
/// bootstrap whose listener runs the filter, each with the set its metadata
/// picks.
#[test]
fn explain_with_a_bootstrap_shows_which_routes_pick_which_limits_by_set() {
    let doc = std::fs::read_to_string(workspace().join("docs/configuration.md")).unwrap();
    let fenced = |lang: &str, after: &str| -> String {
        let start = doc.find(after).unwrap();
        let open = format!("```{lang}\n");
        let from = doc[start..].find(&open).unwrap() + start + open.len();
        let len = doc[from..].find("```").unwrap();
        doc[from..from + len].to_string()
    };
    let config = fenced(
        "json",
        "Envoy has no per-route configuration for a wasm filter.",
    );
    let routes = fenced(
        "yaml",
        "with the routes' metadata in Envoy's route configuration",
    );
    let indented: String = routes
        .lines()
        .map(|l| format!("              {l}\n"))
        .collect();
    let bootstrap = format!(
        "static_resources:
  listeners:
  - name: ingress
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          route_config:
            virtual_hosts:
            - name: edge
              domains: [\"*\"]
{indented}          http_filters:
          - name: envoy.filters.http.wasm
            typed_config:
              \"@type\": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config: {{ root_id: ratelimit }}
          - name: envoy.filters.http.router
"
    );
    let c = file("limits-by.json", &config);
    let b = file("limits-by-bootstrap.yaml", &bootstrap);
    let r = run(&["explain", &c, "--envoy", &b]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let at =
        |route: &str| format!("listener \"ingress\", virtual host \"edge\", route \"{route}\"");
    for line in [
        format!("{}: set premium", at("premium_api")),
        format!("{}: set basic", at("basic_api")),
        format!(
            "{}: the rule's own limits (no ratelimit/plan in its metadata)",
            at("other")
        ),
    ] {
        assert!(r.stdout.contains(&line), "{line}\n{}", r.stdout);
    }
}
