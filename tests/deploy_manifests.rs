//! Static checks of everything that deploys the filter and the gateway:
//! `deploy/` (Istio manifests, the compose Envoy config, observability),
//! `docker-compose.yml`, the Dockerfiles and `docs/clients.md`.
//!
//! Nothing here needs Docker or Kubernetes. What is checked:
//! * every YAML and JSON file under `deploy/` and `docker-compose.yml` parses;
//! * the WasmPlugins validate against the `openAPIV3Schema` of the real Istio
//!   CRD (vendored in `deploy/istio/crd/wasmplugin-crd.yaml`; origin and
//!   license in `NOTICE`) with the
//!   `jsonschema` crate, made as strict as the API server (see
//!   [`structural`]); their `pluginConfig` passes the filter's own
//!   validation (`ratelimit_wasm::config::parse`);
//! * the `security.istio.io` objects (PeerAuthentication, AuthorizationPolicy,
//!   RequestAuthentication) validate against their vendored CRDs the same way;
//!   only the service accounts of the proxies the WasmPlugins select may call
//!   the gateway's API, the plugin keys clients on the verified JWT's subject,
//!   and the gateway's policy ConfigMap holds the plugins' configuration
//!   (`ratelimit render` writes both; `cli/tests/cli.rs` checks they are fresh);
//! * the Kubernetes objects agree with each other (selectors, ports, the Envoy
//!   cluster name of the gateway, Redis address) and with the gateway's flags;
//! * `deploy/compose/envoy.yaml` is exactly what the one Envoy template
//!   `envoy/envoy.yaml` renders for compose (it is generated here:
//!   `UPDATE_COMPOSE_ENVOY=1 cargo test --test deploy_manifests` rewrites it),
//!   and the real Envoy accepts it (`envoy --mode validate`, which also loads
//!   the filter: needs `make build`, like the other Envoy tests);
//! * `docker-compose.yml` mounts only files that exist (or the one build
//!   output of `make build`), pins every image, and its ports, service names
//!   and Envoy cluster names agree with the generated Envoy config;
//! * the Dockerfiles build what they say (pinned bases, non-root gateway, a
//!   one-file `plugin.wasm` image) from a context that keeps every workspace
//!   member;
//! * every metric the Grafana dashboard queries exists (docs/operations.md "Metrics" or
//!   `gateway/src`), and `docs/clients.md` explains every header of the
//!   "What clients see" of docs/configuration.md.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};
use serde_norway::Value as Yaml;
use testkit::{Ports, TemplateVars};

// ---------------------------------------------------------------------------
// Files and parsing
// ---------------------------------------------------------------------------

/// The workspace root.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let path = root().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every non-empty document of a (multi-document) YAML text, as JSON values.
fn yaml_docs(text: &str, what: &str) -> Vec<Value> {
    let mut docs = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .unwrap_or_else(|e| panic!("{what}: YAML document {i} does not parse: {e}"));
        if !value.is_null() {
            docs.push(value);
        }
    }
    docs
}

fn yaml_file(rel: &str) -> Vec<Value> {
    yaml_docs(&read(rel), rel)
}

/// The one document of `docs` with this `kind` and `metadata.name`.
fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {name}, found {}",
        found.len()
    );
    found[0]
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

fn u64_at(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no integer at {pointer} in {v}"))
}

/// Files under `dir` (recursively) whose name ends with one of `exts`.
fn files_under(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
    let entries =
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            files_under(&path, exts, out);
        } else if exts
            .iter()
            .any(|x| path.extension().and_then(|e| e.to_str()) == Some(*x))
        {
            out.push(path);
        }
    }
}

fn rel_name(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

#[test]
fn every_yaml_and_json_file_parses() {
    let mut files = Vec::new();
    files_under(&root().join("deploy"), &["yaml", "yml", "json"], &mut files);
    files.push(root().join("docker-compose.yml"));
    let names: BTreeSet<String> = files.iter().map(|p| rel_name(p)).collect();
    for expected in [
        "deploy/istio/wasmplugin.yaml",
        "deploy/istio/wasmplugin-file.yaml",
        "deploy/istio/gateway.yaml",
        "deploy/istio/redis.yaml",
        "deploy/istio/gateway-security.yaml",
        "deploy/istio/request-authentication.yaml",
        "deploy/istio/gateway-policy.yaml",
        "deploy/istio/ratelimit.json",
        "deploy/compose/envoy.yaml",
        "deploy/compose/ratelimit.json",
        "deploy/observability/prometheus.yml",
        "deploy/observability/grafana-dashboard.json",
        "docker-compose.yml",
    ] {
        assert!(names.contains(expected), "{expected} is missing");
    }
    for path in &files {
        let name = rel_name(path);
        let text = read(&name);
        if name.ends_with(".json") {
            serde_json::from_str::<Value>(&text)
                .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        } else {
            let docs = yaml_docs(&text, &name);
            assert!(!docs.is_empty(), "{name} holds no YAML document");
            // Kubernetes and Compose parse YAML 1.1, where an unquoted
            // yes/no/on/off is a boolean; serde_norway reads YAML 1.2, where it
            // is a string. Unquoted, the two readings differ: refuse them.
            for (n, line) in text.lines().enumerate() {
                if line.trim_start().starts_with('#') {
                    continue;
                }
                let code = line.split(" #").next().unwrap_or(line);
                for word in ["yes", "no", "on", "off", "y", "n"] {
                    for pat in [format!(": {word}"), format!("- {word}")] {
                        assert!(
                            !code.trim_end().ends_with(&pat),
                            "{name}:{}: unquoted `{word}` reads differently in YAML 1.1; quote it",
                            n + 1
                        );
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The Istio WasmPlugin CRD
// ---------------------------------------------------------------------------

/// Vendored from istio/api (see `deploy/istio/crd/README.md`).
const CRD: &str = "deploy/istio/crd/wasmplugin-crd.yaml";
const WASMPLUGINS: [&str; 2] = [
    "deploy/istio/wasmplugin.yaml",
    "deploy/istio/wasmplugin-file.yaml",
];

/// The CRD, and the `openAPIV3Schema` of its version v1alpha1.
fn crd_schema() -> (Value, Value) {
    crd_schema_at(CRD, "v1alpha1")
}

/// The CRD vendored in `file`, and the `openAPIV3Schema` of its `version`.
fn crd_schema_at(file: &str, version: &str) -> (Value, Value) {
    let crd = yaml_file(file).remove(0);
    let versions = crd["spec"]["versions"].as_array().expect("CRD versions");
    let found = versions
        .iter()
        .find(|v| v["name"] == version)
        .unwrap_or_else(|| panic!("{file}: no CRD version {version}"));
    let schema = found["schema"]["openAPIV3Schema"].clone();
    assert!(schema.is_object(), "{file}: CRD without openAPIV3Schema");
    (crd, schema)
}

/// Turns a CRD's structural OpenAPI v3 schema into a JSON Schema (draft 4)
/// that refuses what the API server refuses, as far as JSON Schema can say it.
///
/// * OpenAPI v3's `nullable: true` becomes a `"null"` in `type` (JSON Schema
///   has no `nullable`; a validator would ignore it and refuse `null`).
/// * `format: int32` / `int64` on integers become `minimum`/`maximum` (JSON
///   Schema validators ignore unknown formats).
/// * Unknown fields: a structural schema's API server prunes them, and
///   `kubectl apply` (strict field validation) refuses them. JSON Schema
///   allows them unless told: every object with `properties` and no
///   `additionalProperties` gets `additionalProperties: false`, except where
///   `x-kubernetes-preserve-unknown-fields: true` (e.g. `pluginConfig`, which
///   is free-form). The root also gets the `apiVersion`, `kind` and
///   `metadata` every object has, which a CRD's schema leaves implicit.
/// * The other `x-kubernetes-*` keys are annotations a JSON Schema validator
///   ignores. `x-kubernetes-validations` holds CEL rules, which it cannot run;
///   the rules that concern these manifests are checked by hand in
///   [`check_cel_rules`].
fn structural(schema: &Value, is_root: bool) -> Value {
    let mut out = match schema {
        Value::Object(map) => {
            let mut m = serde_json::Map::new();
            for (k, v) in map {
                let v = match k.as_str() {
                    "properties" | "patternProperties" | "definitions" => Value::Object(
                        v.as_object()
                            .expect("properties object")
                            .iter()
                            .map(|(name, s)| (name.clone(), structural(s, false)))
                            .collect(),
                    ),
                    "items" | "additionalProperties" | "not" if v.is_object() => {
                        structural(v, false)
                    }
                    "anyOf" | "allOf" | "oneOf" => Value::Array(
                        v.as_array()
                            .expect("schema list")
                            .iter()
                            .map(|s| structural(s, false))
                            .collect(),
                    ),
                    _ => v.clone(),
                };
                m.insert(k.clone(), v);
            }
            m
        }
        other => return other.clone(),
    };
    if out.get("type") == Some(&json!("integer")) {
        match out.get("format").and_then(Value::as_str) {
            Some("int32") => {
                out.entry("minimum").or_insert(json!(i32::MIN));
                out.entry("maximum").or_insert(json!(i32::MAX));
            }
            Some("int64") => {
                out.entry("minimum").or_insert(json!(i64::MIN));
                out.entry("maximum").or_insert(json!(i64::MAX));
            }
            _ => {}
        }
    }
    if out.get("nullable") == Some(&Value::Bool(true)) {
        if let Some(Value::String(t)) = out.get("type").cloned() {
            out.insert("type".into(), json!([t, "null"]));
        }
    }
    if is_root {
        let props = out
            .entry("properties")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("root properties");
        props
            .entry("apiVersion")
            .or_insert(json!({ "type": "string" }));
        props.entry("kind").or_insert(json!({ "type": "string" }));
        props
            .entry("metadata")
            .or_insert(json!({ "type": "object" }));
    }
    let preserve = out.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if out.contains_key("properties") && !out.contains_key("additionalProperties") && !preserve {
        out.insert("additionalProperties".into(), Value::Bool(false));
    }
    Value::Object(out)
}

fn crd_validator() -> (Value, jsonschema::Validator) {
    crd_validator_at(CRD, "v1alpha1")
}

/// [`crd_validator`] for the CRD vendored in `file`, at `version`.
fn crd_validator_at(file: &str, version: &str) -> (Value, jsonschema::Validator) {
    let (crd, schema) = crd_schema_at(file, version);
    let schema = structural(&schema, true);
    let validator = jsonschema::draft4::new(&schema)
        .unwrap_or_else(|e| panic!("the CRD's schema does not compile: {e}"));
    (crd, validator)
}

fn schema_errors(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// The `x-kubernetes-validations` (CEL) rules of the CRD that apply to these
/// manifests, restated. `wasmplugin_cel_rules_are_the_ones_restated` fails
/// when the CRD gains a rule, so that it gets restated here too.
fn check_cel_rules(name: &str, spec: &Value) {
    // spec.url: "url must have schema one of [http, https, file, oci]".
    let url = str_at(spec, "/url");
    let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
    assert!(
        ["", "http", "https", "oci", "file"].contains(&scheme),
        "{name}: url scheme {scheme:?} is not one of http, https, file, oci"
    );
    check_selector_and_target_refs(name, spec);
    // vmConfig.env value only when INLINE.
    for env in spec
        .pointer("/vmConfig/env")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        assert!(
            env.get("valueFrom") != Some(&json!("HOST")) || env.get("value").is_none(),
            "{name}: vmConfig.env value with valueFrom HOST"
        );
    }
}

/// The rules the WasmPlugin CRD and the security CRDs share: "wildcard not
/// allowed in label key/value match", "key must not be empty" (in
/// spec.selector.matchLabels), "only one of targetRefs or selector can be
/// set", and targetRef(s) in the same namespace ("cross namespace
/// referencing is not currently supported").
fn check_selector_and_target_refs(name: &str, spec: &Value) {
    if let Some(labels) = spec
        .pointer("/selector/matchLabels")
        .and_then(Value::as_object)
    {
        for (k, v) in labels {
            assert!(!k.is_empty() && !k.contains('*'), "{name}: label key {k:?}");
            assert!(
                !v.as_str().unwrap_or("").contains('*'),
                "{name}: wildcard in label value {v}"
            );
        }
    }
    let set = ["selector", "targetRef", "targetRefs"]
        .iter()
        .filter(|k| spec.get(**k).is_some())
        .count();
    assert!(
        set <= 1,
        "{name}: more than one of selector, targetRef, targetRefs"
    );
    for r in spec
        .get("targetRefs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .chain(spec.get("targetRef"))
    {
        assert!(
            r.get("namespace")
                .and_then(Value::as_str)
                .unwrap_or("")
                .is_empty(),
            "{name}: cross-namespace targetRef"
        );
    }
}

/// The message of every CEL rule in the CRD.
fn cel_rules(schema: &Value, path: &str, out: &mut BTreeSet<String>) {
    match schema {
        Value::Object(map) => {
            for (k, v) in map {
                if k == "x-kubernetes-validations" {
                    for rule in v.as_array().into_iter().flatten() {
                        out.insert(rule["message"].as_str().unwrap_or(path).to_string());
                    }
                } else {
                    cel_rules(v, &format!("{path}/{k}"), out);
                }
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                cel_rules(v, &format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn wasmplugin_cel_rules_are_the_ones_restated() {
    let (_, schema) = crd_schema();
    let mut messages = BTreeSet::new();
    cel_rules(&schema, "", &mut messages);
    let restated: BTreeSet<String> = [
        "url must have schema one of [http, https, file, oci]",
        "only one of targetRefs or selector can be set",
        "wildcard not allowed in label value match",
        "wildcard not allowed in label key match",
        "key must not be empty",
        "cross namespace referencing is not currently supported",
        "value may only be set when valueFrom is INLINE",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    assert_eq!(
        messages, restated,
        "the CRD's CEL rules changed; restate the new ones in check_cel_rules"
    );
}

fn wasmplugins() -> Vec<(&'static str, Value)> {
    WASMPLUGINS
        .iter()
        .map(|f| {
            let mut docs = yaml_file(f);
            assert_eq!(docs.len(), 1, "{f}: one WasmPlugin per file");
            (*f, docs.remove(0))
        })
        .collect()
}

#[test]
fn wasmplugins_validate_against_the_istio_crd() {
    let (crd, validator) = crd_validator();
    let group = str_at(&crd, "/spec/group");
    let kind = str_at(&crd, "/spec/names/kind");
    for (name, doc) in wasmplugins() {
        assert_eq!(doc["apiVersion"], format!("{group}/v1alpha1"), "{name}");
        assert_eq!(doc["kind"], kind, "{name}");
        assert!(doc.pointer("/metadata/name").is_some(), "{name}: no name");
        assert!(
            doc.pointer("/metadata/namespace").is_some(),
            "{name}: no namespace"
        );
        let errors = schema_errors(&validator, &doc);
        assert!(
            errors.is_empty(),
            "{name} does not validate:\n{}",
            errors.join("\n")
        );
        check_cel_rules(name, &doc["spec"]);
    }
}

#[test]
fn the_crd_validator_refuses_what_the_api_server_refuses() {
    let (_, validator) = crd_validator();
    let (_, good) = wasmplugins().remove(0);
    let refused = |edit: &dyn Fn(&mut Value), why: &str| {
        let mut doc = good.clone();
        edit(&mut doc);
        assert!(
            !schema_errors(&validator, &doc).is_empty(),
            "the schema accepted {why}"
        );
    };
    // Envoy's spelling of the policy is not Istio's.
    refused(
        &|d| d["spec"]["failStrategy"] = json!("FAIL_CLOSED"),
        "FAIL_CLOSED",
    );
    refused(
        &|d| d["spec"]["phase"] = json!("AUTHORIZATION"),
        "an unknown phase",
    );
    refused(
        &|d| d["spec"]["sha256"] = json!("sha256:abc"),
        "a malformed sha256",
    );
    refused(
        &|d| d["spec"]["sha256"] = json!("A".repeat(64)),
        "an upper-case sha256",
    );
    refused(
        &|d| d["spec"]["failstrategy"] = json!("FAIL_OPEN"),
        "an unknown (misspelt) field",
    );
    refused(
        &|d| d["spec"]["priority"] = json!(1u64 << 31),
        "a priority over int32",
    );
    refused(
        &|d| {
            d["spec"].as_object_mut().expect("spec").remove("url");
        },
        "a plugin without url",
    );
    // pluginConfig is free-form for the CRD (x-kubernetes-preserve-unknown-fields).
    let mut doc = good.clone();
    doc["spec"]["pluginConfig"]["anything"] = json!({ "nested": [1, 2] });
    assert!(schema_errors(&validator, &doc).is_empty());
    // `null` where the schema says nullable.
    doc["spec"]["priority"] = Value::Null;
    assert!(schema_errors(&validator, &doc).is_empty());
}

#[test]
fn wasmplugin_configs_pass_the_filter_validation() {
    for (name, doc) in wasmplugins() {
        let config = &doc["spec"]["pluginConfig"];
        assert!(config.is_object(), "{name}: pluginConfig is not an object");
        let bytes = serde_json::to_vec(config).expect("JSON");
        if let Err(e) = ratelimit_wasm::config::parse(&bytes) {
            panic!("{name}: pluginConfig refused by the filter: {e}");
        }
        let rules = config["rules"].as_array().expect("rules");
        let global = |r: &Value| r["scope"] == "global";
        assert!(rules.iter().any(global), "{name}: no global rule");
        assert!(rules.iter().any(|r| !global(r)), "{name}: no local rule");
    }
    let compose = read(COMPOSE_PLUGIN);
    if let Err(e) = ratelimit_wasm::config::parse(compose.as_bytes()) {
        panic!("{COMPOSE_PLUGIN} refused by the filter: {e}");
    }
}

/// Envoy's `failure_policy` in the rendered template.
fn envoy_failure_policy() -> String {
    let envoy = rendered_template(COMPOSE_WASM);
    let filter = wasm_filter(&envoy);
    str_at(filter, "/typed_config/config/failure_policy").to_string()
}

#[test]
fn wasmplugin_variants_differ_only_in_where_the_module_comes_from() {
    let plugins = wasmplugins();
    let (oci_name, oci) = &plugins[0];
    let (file_name, file) = &plugins[1];

    let url = str_at(oci, "/spec/url");
    let image = url
        .strip_prefix("oci://")
        .unwrap_or_else(|| panic!("{oci_name}: url {url} is not oci://"));
    let tag = image
        .rsplit_once('/')
        .map(|(_, last)| last)
        .and_then(|last| last.split_once(':'))
        .map(|(_, tag)| tag)
        .unwrap_or("");
    assert!(
        !tag.is_empty() && tag != "latest",
        "{oci_name}: the image tag must be pinned, got {url}"
    );
    assert_eq!(oci["spec"]["imagePullPolicy"], "IfNotPresent", "{oci_name}");
    let sha = str_at(oci, "/spec/sha256");
    assert!(
        sha.len() == 64
            && sha
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "{oci_name}: sha256 {sha:?}"
    );
    assert_eq!(
        str_at(file, "/spec/url"),
        "file:///opt/filters/ratelimit_wasm.wasm",
        "{file_name}"
    );

    let strip = |doc: &Value| {
        let mut d = doc.clone();
        let spec = d["spec"].as_object_mut().expect("spec");
        for k in ["url", "sha256", "imagePullPolicy", "imagePullSecret"] {
            spec.remove(k);
        }
        d
    };
    assert_eq!(
        strip(oci),
        strip(file),
        "{oci_name} and {file_name} differ beyond url/sha256/imagePullPolicy"
    );

    let spec = &oci["spec"];
    assert_eq!(spec["phase"], "AUTHZ");
    assert!(spec["priority"].is_i64(), "priority is set");
    assert!(
        spec.pointer("/selector/matchLabels").is_some(),
        "selector.matchLabels"
    );
    // failStrategy mirrors what the tests run in Envoy (envoy/envoy.yaml).
    let expected = match envoy_failure_policy().as_str() {
        "FAIL_RELOAD" => "FAIL_RELOAD",
        "FAIL_OPEN" => "FAIL_OPEN",
        _ => "FAIL_CLOSE",
    };
    assert_eq!(
        spec["failStrategy"], expected,
        "failStrategy must match envoy/envoy.yaml's failure_policy"
    );
}

// ---------------------------------------------------------------------------
// The gateway and Redis in Kubernetes
// ---------------------------------------------------------------------------

const GATEWAY_YAML: &str = "deploy/istio/gateway.yaml";
const REDIS_YAML: &str = "deploy/istio/redis.yaml";

/// `outbound|PORT||NAME.NAMESPACE.svc.cluster.local` for the Service port named `http`.
fn istio_cluster_of(service: &Value) -> (String, String) {
    let name = str_at(service, "/metadata/name");
    let ns = str_at(service, "/metadata/namespace");
    let port = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "http")
        .expect("a Service port named http");
    let host = format!("{name}.{ns}.svc.cluster.local");
    (format!("outbound|{}||{host}", u64_at(port, "/port")), host)
}

/// Every `outbound|PORT||HOST` cluster name in the comments of `text`.
fn cluster_names_in_comments(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((_, comment)) = line.split_once('#') else {
            continue;
        };
        let mut rest = comment;
        while let Some(i) = rest.find("outbound|") {
            let token: String = rest[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || "|.-_".contains(*c))
                .collect();
            rest = &rest[i + token.len()..];
            let named = token
                .strip_prefix("outbound|")
                .and_then(|t| t.split_once("||"))
                .is_some_and(|(port, host)| {
                    !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) && !host.is_empty()
                });
            if named {
                out.push(token);
            }
        }
    }
    out
}

#[test]
fn the_istio_cluster_name_is_the_same_everywhere() {
    let text = read(GATEWAY_YAML);
    let docs = yaml_docs(&text, GATEWAY_YAML);
    let service = object(&docs, "Service", "ratelimit-gateway");
    let (cluster, host) = istio_cluster_of(service);
    assert_eq!(
        cluster,
        "outbound|8081||ratelimit-gateway.ratelimit.svc.cluster.local"
    );

    let in_comments = cluster_names_in_comments(&text);
    assert!(
        !in_comments.is_empty(),
        "{GATEWAY_YAML} must state the cluster name in a comment"
    );
    for c in &in_comments {
        assert_eq!(
            c, &cluster,
            "{GATEWAY_YAML}: a comment names another cluster"
        );
    }
    for (name, doc) in wasmplugins() {
        assert_eq!(
            str_at(&doc, "/spec/pluginConfig/global/cluster"),
            cluster,
            "{name}: global.cluster"
        );
        assert_eq!(
            str_at(&doc, "/spec/pluginConfig/global/authority"),
            host,
            "{name}: global.authority"
        );
    }
    let dr = object(&docs, "DestinationRule", "ratelimit-gateway");
    assert_eq!(str_at(dr, "/spec/host"), host);
}

fn containers(workload: &Value) -> &Vec<Value> {
    workload
        .pointer("/spec/template/spec/containers")
        .and_then(Value::as_array)
        .expect("containers")
}

fn env_of(container: &Value) -> BTreeMap<String, String> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            (
                str_at(e, "/name").to_string(),
                e["value"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// The container port called `name`.
fn named_port(container: &Value, name: &str) -> u64 {
    let port = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port named {name}"));
    u64_at(port, "/containerPort")
}

fn labels_select(selector: &Value, labels: &Value) -> bool {
    let sel = selector.as_object().expect("selector labels");
    !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// `image` has a tag (or digest) other than `latest`.
fn image_is_pinned(image: &str) -> bool {
    if image.contains("@sha256:") {
        return true;
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    matches!(last.split_once(':'), Some((_, tag)) if !tag.is_empty() && tag != "latest")
}

/// The `RLGW_*` environment variables the gateway really reads.
fn gateway_env_vars() -> BTreeSet<String> {
    let mut files = Vec::new();
    files_under(&root().join("gateway/src"), &["rs"], &mut files);
    let mut vars = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("gateway source");
        let mut rest = text.as_str();
        while let Some(i) = rest.find("env = \"") {
            let after = &rest[i + 7..];
            let end = after.find('"').expect("closing quote");
            vars.insert(after[..end].to_string());
            rest = &after[end..];
        }
    }
    assert!(
        vars.contains("RLGW_LISTEN"),
        "gateway flags not found: {vars:?}"
    );
    vars
}

#[test]
fn kubernetes_objects_agree_with_each_other() {
    let gw = yaml_file(GATEWAY_YAML);
    let redis_docs = yaml_file(REDIS_YAML);
    let all: Vec<&Value> = gw.iter().chain(redis_docs.iter()).collect();

    let ns = object(&gw, "Namespace", "ratelimit");
    assert_eq!(
        ns.pointer("/metadata/labels/istio-injection"),
        Some(&json!("enabled"))
    );
    for doc in &all {
        assert!(
            doc["apiVersion"].is_string() && doc["kind"].is_string(),
            "{doc}"
        );
        assert!(doc.pointer("/metadata/name").is_some(), "{doc}");
        if doc["kind"] != "Namespace" {
            assert_eq!(
                doc.pointer("/metadata/namespace"),
                Some(&json!("ratelimit")),
                "{doc}"
            );
        }
    }

    // The gateway Deployment.
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    assert_eq!(u64_at(deploy, "/spec/replicas"), 2);
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    assert!(labels_select(
        &deploy["spec"]["selector"]["matchLabels"],
        pod_labels
    ));
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(
        pod.pointer("/securityContext/runAsNonRoot"),
        Some(&json!(true))
    );
    assert!(u64_at(pod, "/securityContext/runAsUser") > 0);
    let [gateway] = containers(deploy).as_slice() else {
        panic!("one gateway container");
    };
    assert!(image_is_pinned(str_at(gateway, "/image")));
    assert_eq!(
        gateway.pointer("/securityContext/allowPrivilegeEscalation"),
        Some(&json!(false))
    );
    assert!(gateway.pointer("/resources/requests/cpu").is_some());
    assert!(gateway.pointer("/resources/limits/memory").is_some());
    let http = named_port(gateway, "http");
    assert_eq!(http, 8081);
    // Ready = can write to Redis; live = answers HTTP without Redis.
    assert_eq!(str_at(gateway, "/readinessProbe/httpGet/path"), "/readyz");
    assert_eq!(str_at(gateway, "/livenessProbe/httpGet/path"), "/livez");
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(
            gateway.pointer(&format!("/{probe}/httpGet/port")),
            Some(&json!("http")),
            "{probe} port"
        );
    }
    let env = env_of(gateway);
    assert_eq!(env.get("RLGW_LISTEN"), Some(&format!("0.0.0.0:{http}")));
    let known = gateway_env_vars();
    for name in env.keys().filter(|k| k.starts_with("RLGW_")) {
        assert!(known.contains(name), "the gateway has no flag for {name}");
    }

    // Its Service and PodDisruptionBudget select its pods.
    let svc = object(&gw, "Service", "ratelimit-gateway");
    assert!(labels_select(&svc["spec"]["selector"], pod_labels));
    let port = &svc["spec"]["ports"][0];
    assert_eq!(port["name"], "http");
    assert_eq!(port["targetPort"], "http");
    let pdb = object(&gw, "PodDisruptionBudget", "ratelimit-gateway");
    assert!(labels_select(
        &pdb["spec"]["selector"]["matchLabels"],
        pod_labels
    ));

    // RLGW_REDIS names the Redis Service and its port.
    let redis_svc = object(&redis_docs, "Service", "redis");
    let redis_port = u64_at(&redis_svc["spec"]["ports"][0], "/port");
    assert_eq!(
        env.get("RLGW_REDIS"),
        Some(&format!(
            "redis://redis.{}.svc.cluster.local:{redis_port}",
            str_at(redis_svc, "/metadata/namespace")
        ))
    );
    let sts = object(&redis_docs, "StatefulSet", "redis");
    assert_eq!(u64_at(sts, "/spec/replicas"), 1);
    assert_eq!(str_at(sts, "/spec/serviceName"), "redis");
    let redis_labels = &sts["spec"]["template"]["metadata"]["labels"];
    assert!(labels_select(
        &sts["spec"]["selector"]["matchLabels"],
        redis_labels
    ));
    assert!(labels_select(&redis_svc["spec"]["selector"], redis_labels));
    let [redis] = containers(sts).as_slice() else {
        panic!("one redis container");
    };
    assert_eq!(str_at(redis, "/image"), "redis:7.0.15");
    assert_eq!(redis_svc["spec"]["ports"][0]["targetPort"], "redis");
    assert_eq!(named_port(redis, "redis"), 6379);
}

// ---------------------------------------------------------------------------
// The compose Envoy config, generated from the one template
// ---------------------------------------------------------------------------

/// The generated Envoy config of the compose demo.
const COMPOSE_ENVOY: &str = "deploy/compose/envoy.yaml";
/// The compose demo's plugin configuration (the demo's rules plus a global one).
const COMPOSE_PLUGIN: &str = "deploy/compose/ratelimit.json";
/// The key set the compose Envoy's `jwt_authn` verifies tokens with (inline
/// in the generated config): the demo's.
const COMPOSE_JWKS: &str = "envoy/jwt/jwks.json";
/// Where docker-compose.yml mounts the filter inside the Envoy container.
const COMPOSE_WASM: &str = "/opt/filters/ratelimit_wasm.wasm";
/// The gateway's compose service name and port.
const GATEWAY_SERVICE: &str = "gateway";
const GATEWAY_PORT: u64 = 8081;
/// The one build output docker-compose.yml may mount although it is not in git.
const WASM_BUILD_OUTPUT: &str = "./target/wasm32-wasip1/release/ratelimit_wasm.wasm";

/// `envoy/envoy.yaml` rendered by testkit (the renderer the native tests use)
/// with the demo's fixed ports, the compose plugin configuration and `wasm`.
fn rendered_template(wasm: &str) -> Value {
    let vars = TemplateVars {
        ports: Ports::DEMO,
        gateway_port: GATEWAY_PORT as u16,
        wasm_path: PathBuf::from(wasm),
        plugin_config: read(COMPOSE_PLUGIN),
        jwks: read(COMPOSE_JWKS),
    };
    let text = testkit::render_template(&read("envoy/envoy.yaml"), &vars)
        .unwrap_or_else(|e| panic!("rendering envoy/envoy.yaml: {e:#}"));
    yaml_docs(&text, "rendered envoy/envoy.yaml").remove(0)
}

/// The `envoy.filters.http.wasm` filter of the (only) listener that has one.
fn wasm_filter(envoy: &Value) -> &Value {
    let listener = wasm_listener(envoy);
    http_filters(listener)
        .iter()
        .find(|f| f["name"] == "envoy.filters.http.wasm")
        .expect("wasm filter")
}

fn http_filters(listener: &Value) -> &Vec<Value> {
    static EMPTY: Vec<Value> = Vec::new();
    listener
        .pointer("/filter_chains/0/filters/0/typed_config/http_filters")
        .and_then(Value::as_array)
        .unwrap_or(&EMPTY)
}

fn wasm_listener(envoy: &Value) -> &Value {
    let listeners: Vec<&Value> = envoy["static_resources"]["listeners"]
        .as_array()
        .expect("listeners")
        .iter()
        .filter(|l| {
            http_filters(l)
                .iter()
                .any(|f| f["name"] == "envoy.filters.http.wasm")
        })
        .collect();
    assert_eq!(listeners.len(), 1, "one listener with the wasm filter");
    listeners[0]
}

fn cluster<'a>(envoy: &'a Value, name: &str) -> Option<&'a Value> {
    envoy["static_resources"]["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .find(|c| c["name"] == name)
}

/// The compose Envoy config: the rendered template with exactly these changes,
/// all of them about crossing container boundaries:
/// 1. the admin interface and the rate-limited listener bind `0.0.0.0` (a
///    container's loopback is unreachable from the host and from Prometheus);
///    the built-in upstream listener stays on loopback;
/// 2. the gateway cluster named by the plugin's `global.cluster` points at
///    the compose service `gateway:8081` by DNS (`STRICT_DNS`); it is added
///    when the template does not define it.
fn compose_envoy(wasm: &str) -> Value {
    let mut envoy = rendered_template(wasm);
    let plugin: Value = serde_json::from_str(&read(COMPOSE_PLUGIN)).expect("plugin JSON");
    let gateway_cluster = str_at(&plugin, "/global/cluster").to_string();

    envoy["admin"]["address"]["socket_address"]["address"] = json!("0.0.0.0");
    let listeners = envoy["static_resources"]["listeners"]
        .as_array_mut()
        .expect("listeners");
    for l in listeners.iter_mut() {
        if http_filters(l)
            .iter()
            .any(|f| f["name"] == "envoy.filters.http.wasm")
        {
            l["address"]["socket_address"]["address"] = json!("0.0.0.0");
        }
    }

    let endpoint = json!({
        "cluster_name": gateway_cluster,
        "endpoints": [ { "lb_endpoints": [ { "endpoint": { "address": {
            "socket_address": { "address": GATEWAY_SERVICE, "port_value": GATEWAY_PORT }
        } } } ] } ]
    });
    let clusters = envoy["static_resources"]["clusters"]
        .as_array_mut()
        .expect("clusters");
    match clusters
        .iter_mut()
        .find(|c| c["name"] == gateway_cluster.as_str())
    {
        Some(c) => {
            let c = c.as_object_mut().expect("cluster");
            c.insert("type".into(), json!("STRICT_DNS"));
            c.insert("dns_lookup_family".into(), json!("V4_ONLY"));
            c.insert("load_assignment".into(), endpoint);
        }
        None => clusters.push(json!({
            "name": gateway_cluster,
            "connect_timeout": "0.25s",
            "type": "STRICT_DNS",
            "dns_lookup_family": "V4_ONLY",
            "load_assignment": endpoint
        })),
    }
    envoy
}

/// The comment at the top of `deploy/compose/envoy.yaml`.
fn compose_header() -> String {
    let Ports {
        listen,
        admin,
        upstream,
        ..
    } = Ports::DEMO;
    format!(
        "\
# GENERATED FILE - do not edit. The Envoy config of docker-compose.yml.
#
# Rendered from the one Envoy template envoy/envoy.yaml (by testkit, as for the
# native tests) with the demo's ports (listener {listen}, admin {admin}, upstream
# {upstream}), the plugin configuration {COMPOSE_PLUGIN}, the wasm
# path {COMPOSE_WASM} and the demo JWKS {COMPOSE_JWKS}
# (inline, public key only), then changed only where a container
# boundary requires it:
#   - admin and the rate-limited listener bind 0.0.0.0 (the built-in upstream
#     listener stays on loopback);
#   - the gateway cluster named by the plugin's global.cluster resolves the
#     compose service {GATEWAY_SERVICE}:{GATEWAY_PORT} by DNS (added if the template lacks it).
# Regenerate: UPDATE_COMPOSE_ENVOY=1 cargo test --test deploy_manifests
# (tests/deploy_manifests.rs; `cargo test` fails while this file is stale).
"
    )
}

/// The text of `deploy/compose/envoy.yaml`, with the filter at `wasm`.
fn compose_envoy_text(wasm: &str) -> String {
    // Through serde_norway's own Value so that key order is kept as written
    // in the template (serde_json's map here is sorted).
    let yaml = ordered(&compose_envoy(wasm), &rendered_order());
    format!(
        "{}{}",
        compose_header(),
        serde_norway::to_string(&yaml).expect("YAML text")
    )
}

/// Key order of every mapping in the rendered template, by JSON pointer.
fn rendered_order() -> BTreeMap<String, Vec<String>> {
    let vars = TemplateVars {
        ports: Ports::DEMO,
        gateway_port: GATEWAY_PORT as u16,
        wasm_path: PathBuf::from(COMPOSE_WASM),
        plugin_config: read(COMPOSE_PLUGIN),
        jwks: read(COMPOSE_JWKS),
    };
    let text = testkit::render_template(&read("envoy/envoy.yaml"), &vars).expect("render");
    let yaml: Yaml = serde_norway::from_str(&text).expect("rendered YAML");
    let mut order = BTreeMap::new();
    collect_order(&yaml, String::new(), &mut order);
    order
}

fn collect_order(v: &Yaml, path: String, out: &mut BTreeMap<String, Vec<String>>) {
    match v {
        Yaml::Mapping(m) => {
            let keys: Vec<String> = m
                .keys()
                .filter_map(|k| k.as_str().map(str::to_string))
                .collect();
            for (k, child) in m {
                if let Some(k) = k.as_str() {
                    collect_order(child, format!("{path}/{k}"), out);
                }
            }
            out.insert(path, keys);
        }
        Yaml::Sequence(items) => {
            for (i, child) in items.iter().enumerate() {
                collect_order(child, format!("{path}/{i}"), out);
            }
        }
        _ => {}
    }
}

/// `v` as a serde_norway value whose mappings list keys in `order` (keys the
/// template does not have come last, in the order given by the generator).
fn ordered(v: &Value, order: &BTreeMap<String, Vec<String>>) -> Yaml {
    fn go(v: &Value, path: &str, order: &BTreeMap<String, Vec<String>>) -> Yaml {
        match v {
            Value::Object(map) => {
                let mut keys: Vec<&String> = Vec::new();
                if let Some(known) = order.get(path) {
                    keys.extend(known.iter().filter(|k| map.contains_key(*k)));
                }
                for k in map.keys() {
                    if !keys.contains(&k) {
                        keys.push(k);
                    }
                }
                let mut m = serde_norway::Mapping::new();
                for k in keys {
                    m.insert(
                        Yaml::String(k.clone()),
                        go(&map[k], &format!("{path}/{k}"), order),
                    );
                }
                Yaml::Mapping(m)
            }
            Value::Array(items) => Yaml::Sequence(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, x)| go(x, &format!("{path}/{i}"), order))
                    .collect(),
            ),
            other => serde_norway::to_value(other).expect("scalar"),
        }
    }
    go(v, "", order)
}

#[test]
fn compose_envoy_config_is_generated_from_the_template() {
    let want = compose_envoy_text(COMPOSE_WASM);
    let path = root().join(COMPOSE_ENVOY);
    if std::env::var_os("UPDATE_COMPOSE_ENVOY").is_some() {
        std::fs::write(&path, &want).expect("writing the compose Envoy config");
        eprintln!("wrote {}", path.display());
        return;
    }
    let have = read(COMPOSE_ENVOY);
    if have != want {
        let line = have
            .lines()
            .zip(want.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(have.lines().count().min(want.lines().count()));
        panic!(
            "{COMPOSE_ENVOY} is stale (first difference at line {}): regenerate it with\n  \
             UPDATE_COMPOSE_ENVOY=1 cargo test --test deploy_manifests",
            line + 1
        );
    }
    // The generated file parses back to the generated config.
    assert_eq!(
        yaml_file(COMPOSE_ENVOY).remove(0),
        compose_envoy(COMPOSE_WASM)
    );
}

#[test]
fn compose_envoy_config_differs_from_the_template_only_where_documented() {
    let template = rendered_template(COMPOSE_WASM);
    let compose = compose_envoy(COMPOSE_WASM);
    let plugin: Value = serde_json::from_str(&read(COMPOSE_PLUGIN)).expect("plugin JSON");
    let gateway_cluster = str_at(&plugin, "/global/cluster");

    let mut expected = template.clone();
    expected["admin"]["address"]["socket_address"]["address"] = json!("0.0.0.0");
    let ingress = wasm_listener(&template)["name"].clone();
    for l in expected["static_resources"]["listeners"]
        .as_array_mut()
        .expect("listeners")
    {
        if l["name"] == ingress {
            l["address"]["socket_address"]["address"] = json!("0.0.0.0");
        }
    }
    let strip_gateway = |v: &mut Value| {
        v["static_resources"]["clusters"]
            .as_array_mut()
            .expect("clusters")
            .retain(|c| c["name"] != gateway_cluster);
    };
    let mut compose_rest = compose.clone();
    strip_gateway(&mut expected);
    strip_gateway(&mut compose_rest);
    assert_eq!(compose_rest, expected);

    let gw = cluster(&compose, gateway_cluster).expect("gateway cluster");
    assert_eq!(gw["type"], "STRICT_DNS");
    let addr = &gw["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["socket_address"];
    assert_eq!(addr["address"], GATEWAY_SERVICE);
    assert_eq!(addr["port_value"], GATEWAY_PORT);
    // The upstream stays the template's built-in one, on loopback.
    let upstream = cluster(&compose, "upstream").expect("upstream cluster");
    assert_eq!(
        upstream,
        cluster(&template, "upstream").expect("template upstream")
    );
}

#[test]
fn compose_envoy_config_is_accepted_by_envoy() {
    // The same config with the host's build of the filter, so that Envoy's
    // validate mode (which loads the module and configures the plugin) can
    // read it. Needs `make build`, like every test that runs Envoy.
    let wasm = testkit::wasm_path().unwrap_or_else(|e| panic!("{e:#}"));
    let text = compose_envoy_text(wasm.to_str().expect("UTF-8 wasm path"));
    let dir = std::env::temp_dir().join(format!("ratelimit-compose-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, text).expect("writing the config");
    let result = testkit::validate_config(&path);
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        panic!("Envoy refuses the compose config: {e:#}");
    }
}

// ---------------------------------------------------------------------------
// docker-compose.yml
// ---------------------------------------------------------------------------

fn compose() -> Value {
    yaml_file("docker-compose.yml").remove(0)
}

/// `(host_ip, host_port, container_port)` of a short-syntax port mapping.
fn port_mapping(spec: &str) -> (String, u64, u64) {
    let parts: Vec<&str> = spec.split(':').collect();
    let num = |s: &str| {
        s.parse::<u64>()
            .unwrap_or_else(|_| panic!("port {s:?} in {spec}"))
    };
    match parts.as_slice() {
        [ip, host, container] => (ip.to_string(), num(host), num(container)),
        _ => panic!("port mapping {spec:?}: write it as HOST_IP:HOST_PORT:CONTAINER_PORT"),
    }
}

/// `host:port` of a `redis://host:port` or `0.0.0.0:port` address.
fn host_port(addr: &str) -> (String, u64) {
    let addr = addr.split_once("://").map(|(_, a)| a).unwrap_or(addr);
    let addr = addr.trim_end_matches('/');
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    (host.to_string(), port.parse().expect("port"))
}

#[test]
fn compose_file_is_consistent_with_the_envoy_config() {
    let compose = compose();
    let services = compose["services"].as_object().expect("services");
    let envoy_cfg = yaml_file(COMPOSE_ENVOY).remove(0);

    // Every image pinned; the built one gets a pinned tag too; depends_on exists.
    for (name, svc) in services {
        let image = svc["image"]
            .as_str()
            .unwrap_or_else(|| panic!("service {name}: no image (give built images a tag too)"));
        assert!(
            image_is_pinned(image),
            "service {name}: image {image} is not pinned"
        );
        if let Some(build) = svc.get("build") {
            let dockerfile = str_at(build, "/dockerfile");
            let context = str_at(build, "/context");
            assert!(
                root().join(context).join(dockerfile).is_file(),
                "service {name}: {dockerfile} missing"
            );
        }
        for dep in svc["depends_on"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
        {
            assert!(
                services.contains_key(dep),
                "service {name} depends on unknown {dep}"
            );
        }
        // Every host port on loopback.
        for p in svc["ports"].as_array().into_iter().flatten() {
            let (ip, _, _) = port_mapping(p.as_str().expect("short port syntax"));
            assert_eq!(ip, "127.0.0.1", "service {name}: port {p} not on loopback");
        }
    }

    // Every bind mount exists, except the one build output of `make build`.
    let mut mounts: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (name, svc) in services {
        for v in svc["volumes"].as_array().into_iter().flatten() {
            let v = v.as_str().expect("short volume syntax");
            let mut parts = v.split(':');
            let (host, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            assert!(
                host.starts_with("./"),
                "service {name}: {v} is not a bind mount of the repo"
            );
            assert!(
                root().join(host).is_file() || host == WASM_BUILD_OUTPUT,
                "service {name}: {host} does not exist (only {WASM_BUILD_OUTPUT}, the output \
                 of `make build`, may be missing)"
            );
            assert!(v.ends_with(":ro"), "service {name}: mount {v} read-only");
            mounts
                .entry(name.clone())
                .or_default()
                .insert(target.to_string(), host.to_string());
        }
    }

    // Envoy: the generated config, the filter where the config expects it,
    // the listener and admin ports of the config.
    let envoy = &services["envoy"];
    assert_eq!(str_at(envoy, "/image"), "envoyproxy/envoy:v1.40.0");
    let command: Vec<&str> = envoy["command"]
        .as_array()
        .expect("envoy command")
        .iter()
        .map(|c| c.as_str().expect("string"))
        .collect();
    let config_path = command
        .iter()
        .position(|c| *c == "-c")
        .map(|i| command[i + 1])
        .expect("envoy -c");
    let envoy_mounts = &mounts["envoy"];
    assert_eq!(envoy_mounts[config_path], format!("./{COMPOSE_ENVOY}"));
    let wasm_in_config = str_at(
        wasm_filter(&envoy_cfg),
        "/typed_config/config/vm_config/code/local/filename",
    );
    assert_eq!(envoy_mounts[wasm_in_config], WASM_BUILD_OUTPUT);

    let published: BTreeSet<u64> = envoy["ports"]
        .as_array()
        .expect("envoy ports")
        .iter()
        .map(|p| port_mapping(p.as_str().expect("port")).2)
        .collect();
    let listen = u64_at(
        wasm_listener(&envoy_cfg),
        "/address/socket_address/port_value",
    );
    let admin = u64_at(&envoy_cfg, "/admin/address/socket_address/port_value");
    assert_eq!(published, BTreeSet::from([listen, admin]));
    assert_eq!(
        str_at(wasm_listener(&envoy_cfg), "/address/socket_address/address"),
        "0.0.0.0"
    );
    assert_eq!(
        str_at(&envoy_cfg, "/admin/address/socket_address/address"),
        "0.0.0.0"
    );

    // The gateway: its service name and listen port are the Envoy cluster's
    // endpoint; the plugin's global.cluster is that cluster.
    let plugin_text = str_at(
        wasm_filter(&envoy_cfg),
        "/typed_config/config/configuration/value",
    );
    let plugin: Value = serde_json::from_str(plugin_text).expect("plugin JSON in the config");
    assert_eq!(
        plugin,
        serde_json::from_str::<Value>(&read(COMPOSE_PLUGIN)).expect("JSON")
    );
    let gw_cluster = cluster(&envoy_cfg, str_at(&plugin, "/global/cluster"))
        .expect("the plugin's global.cluster is a cluster of the Envoy config");
    let sa = &gw_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    let gw_host = str_at(sa, "/address");
    assert!(
        services.contains_key(gw_host),
        "cluster address {gw_host} is not a service"
    );
    let env = &services[gw_host]["environment"];
    let (_, listen_port) = host_port(str_at(env, "/RLGW_LISTEN"));
    assert_eq!(listen_port, u64_at(sa, "/port_value"));
    let known = gateway_env_vars();
    for name in env.as_object().expect("environment").keys() {
        if name.starts_with("RLGW_") {
            assert!(known.contains(name), "the gateway has no flag for {name}");
        }
    }

    // Redis: the gateway's RLGW_REDIS names the redis service.
    let (redis_host, redis_port) = host_port(str_at(env, "/RLGW_REDIS"));
    assert_eq!(redis_port, 6379);
    assert_eq!(str_at(&services[&redis_host], "/image"), "redis:7.0.15");

    // Prometheus scrapes what compose serves.
    let prom = yaml_file("deploy/observability/prometheus.yml").remove(0);
    let jobs = prom["scrape_configs"].as_array().expect("scrape_configs");
    let target_of = |path: &str| -> (String, u64) {
        let job = jobs
            .iter()
            .find(|j| j["metrics_path"] == path)
            .unwrap_or_else(|| panic!("no scrape job for {path}"));
        host_port(str_at(job, "/static_configs/0/targets/0"))
    };
    assert_eq!(target_of("/stats/prometheus"), ("envoy".to_string(), admin));
    assert_eq!(target_of("/metrics"), (gw_host.to_string(), listen_port));
    assert_eq!(
        mounts["prometheus"]["/etc/prometheus/prometheus.yml"],
        "./deploy/observability/prometheus.yml"
    );
}

// ---------------------------------------------------------------------------
// Images
// ---------------------------------------------------------------------------

/// `(instruction, arguments)` of a Dockerfile, continuation lines joined.
fn dockerfile(rel: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in read(rel).lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(cont) = line.strip_suffix('\\') {
            current.push_str(cont);
            current.push(' ');
            continue;
        }
        current.push_str(line);
        let (ins, args) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((ins.to_uppercase(), args.trim().to_string()));
        current.clear();
    }
    out
}

#[test]
fn images_are_built_as_documented() {
    // The gateway: multi-stage, pinned bases, non-root, port 8081.
    let gw = dockerfile("gateway/Dockerfile");
    let froms: Vec<&str> = gw
        .iter()
        .filter(|(i, _)| i == "FROM")
        .map(|(_, a)| a.split_whitespace().next().unwrap_or(""))
        .collect();
    assert_eq!(
        froms,
        [
            "rust:1.95-slim-bookworm",
            "gcr.io/distroless/cc-debian12:nonroot"
        ]
    );
    assert!(gw.iter().any(|(i, a)| i == "RUN"
        && a.contains("cargo build --release")
        && a.contains("-p ratelimit-gateway")));
    let user = gw
        .iter()
        .rev()
        .find(|(i, _)| i == "USER")
        .map(|(_, a)| a.as_str())
        .expect("USER");
    assert!(
        !user.starts_with('0') && !user.starts_with("root"),
        "USER {user}"
    );
    assert!(gw.iter().any(|(i, a)| i == "EXPOSE" && a == "8081"));

    // The filter: one file, plugin.wasm, in an otherwise empty image.
    let wasm = dockerfile("Dockerfile.wasm");
    let layers: Vec<&(String, String)> = wasm
        .iter()
        .filter(|(i, _)| ["COPY", "ADD", "RUN"].contains(&i.as_str()))
        .collect();
    assert_eq!(wasm[0], ("FROM".to_string(), "scratch".to_string()));
    assert_eq!(layers.len(), 1, "exactly one layer");
    assert_eq!(
        layers[0].1,
        format!(
            "{} ./plugin.wasm",
            WASM_BUILD_OUTPUT.trim_start_matches("./")
        )
    );

    // The build context (.dockerignore, last match wins) keeps every
    // workspace member and the one build output Dockerfile.wasm copies, and
    // leaves the rest of target/ out.
    let ignore: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    let wasm_rel = WASM_BUILD_OUTPUT.trim_start_matches("./");
    assert_eq!(
        ignore.last().map(String::as_str),
        Some(format!("!{wasm_rel}").as_str()),
        ".dockerignore must end by re-including {wasm_rel}"
    );
    assert!(
        ignore.iter().any(|l| l == "**/target"),
        "target/ must stay out"
    );
    for member in workspace_members() {
        let top = member.split('/').next().unwrap_or(&member).to_string();
        for line in &ignore {
            let pattern = line.trim_end_matches('/');
            assert!(
                pattern != top && pattern != member && pattern != "*",
                ".dockerignore line {line:?} drops workspace member {member:?}"
            );
        }
    }
    for needed in ["Cargo.toml", "Cargo.lock", "src"] {
        assert!(
            !ignore.iter().any(|l| l.trim_end_matches('/') == needed),
            ".dockerignore drops {needed}"
        );
    }
}

/// `[workspace] members` of the root Cargo.toml (other than ".").
fn workspace_members() -> Vec<String> {
    let manifest = read("Cargo.toml");
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("[workspace] members");
    let list = line
        .split_once('[')
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("members = [...] on one line");
    let members: Vec<String> = list
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty() && m != ".")
        .collect();
    assert!(
        members.contains(&"gateway".to_string()),
        "members: {members:?}"
    );
    members
}

// ---------------------------------------------------------------------------
// Observability
// ---------------------------------------------------------------------------

/// Metric names of the "Metrics" table of `docs/operations.md`.
fn readme_metrics() -> BTreeSet<String> {
    let readme = read("docs/operations.md");
    let section = readme
        .split("\n## Metrics")
        .nth(1)
        .expect("docs/operations.md has a Metrics section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let names: BTreeSet<String> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(name, _)| name.to_string()))
        .collect();
    assert!(
        names.len() >= 10,
        "docs/operations.md metrics table not found: {names:?}"
    );
    names
}

/// All string literals of the gateway's sources.
fn gateway_sources() -> String {
    let mut files = Vec::new();
    files_under(&root().join("gateway/src"), &["rs"], &mut files);
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).expect("gateway source"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Identifiers starting with `ratelimit_` in a PromQL expression (with
/// the `:` of a recording rule's name).
fn metric_names(expr: &str) -> Vec<String> {
    let word = |c: &u8| c.is_ascii_alphanumeric() || *c == b'_' || *c == b':';
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"ratelimit_") && (i == 0 || !word(&b[i - 1])) {
            let len = b[i..].iter().take_while(|c| word(c)).count();
            out.push(String::from_utf8_lossy(&b[i..i + len]).into_owned());
            i += len;
        } else {
            i += 1;
        }
    }
    out
}

fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if k == "expr" {
                    out.push(x.as_str().expect("expr string").to_string());
                } else {
                    exprs(x, out);
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|x| exprs(x, out)),
        _ => {}
    }
}

/// The labels Envoy's `stats_tags` (in `envoy/envoy.yaml`, read rendered
/// as the compose config) take out of the per-rule counters' names:
/// `ratelimit_domain`, `ratelimit_rule`, ….
fn stats_tag_names() -> BTreeSet<String> {
    let envoy: Yaml = serde_norway::from_str(&read(COMPOSE_ENVOY)).expect(COMPOSE_ENVOY);
    let tags: BTreeSet<String> = envoy["stats_config"]["stats_tags"]
        .as_sequence()
        .expect("the Envoy config has stats_config.stats_tags")
        .iter()
        .filter_map(|t| t["tag_name"].as_str().map(str::to_string))
        .collect();
    assert!(tags.contains("ratelimit_rule"), "{tags:?}");
    tags
}

/// Checks that every metric the PromQL `queries` of `what` name exists
/// (docs/operations.md's table, the gateway's sources, or one of
/// `recorded`), and every label value they match (exactly, or each
/// alternative of a `=~`) is one the gateway exports; returns the metrics
/// used, a histogram by its base name.
fn check_queries(what: &str, queries: &[String], recorded: &BTreeSet<String>) -> BTreeSet<String> {
    assert!(!queries.is_empty(), "no queries in {what}");
    let readme = readme_metrics();
    let gateway = gateway_sources();
    let labels = stats_tag_names();
    let exists = |name: &str| {
        readme.contains(name) || gateway.contains(&format!("\"{name}\"")) || recorded.contains(name)
    };
    let mut used = BTreeSet::new();
    for expr in queries {
        let names: Vec<String> = metric_names(expr)
            .into_iter()
            .filter(|n| !labels.contains(n))
            .collect();
        assert!(
            !names.is_empty(),
            "query without a ratelimit_ metric in {what}: {expr}"
        );
        for name in names {
            // A histogram is queried through its _bucket/_sum/_count series.
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| exists(b)))
                .unwrap_or(&name)
                .to_string();
            assert!(
                exists(&base),
                "{what} queries {name}, which is neither in docs/operations.md's metrics \
                 table nor in gateway/src"
            );
            used.insert(base);
        }
        // Label values matched (op="check", kind=~"redis|timeout") exist
        // too; a dashboard variable ($domain) is the user's choice.
        for value in matched_label_values(expr) {
            assert!(
                value.starts_with('$') || gateway.contains(&format!("\"{value}\"")),
                "label value {value:?} in {expr} ({what}) is not one the gateway exports"
            );
        }
    }
    used
}

/// The label values a PromQL expression matches with `="…"` or `=~"…"`
/// (each alternative of the latter).
fn matched_label_values(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find('=') {
        let after = &rest[i + 1..];
        let (regex, after) = match after.strip_prefix('~') {
            Some(a) => (true, a),
            None => (false, after),
        };
        let Some(quoted) = after.strip_prefix('"') else {
            rest = after;
            continue;
        };
        let end = quoted.find('"').expect("closing quote");
        let value = &quoted[..end];
        if regex {
            out.extend(value.split('|').map(str::to_string));
        } else {
            out.push(value.to_string());
        }
        rest = &quoted[end + 1..];
    }
    out
}

#[test]
fn dashboard_queries_only_metrics_that_exist() {
    let dashboard: Value =
        serde_json::from_str(&read("deploy/observability/grafana-dashboard.json")).expect("JSON");
    assert!(dashboard["panels"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    let used = check_queries("the dashboard", &all, &BTreeSet::new());
    for required in [
        "ratelimit_wasm_requests_allowed",
        "ratelimit_wasm_requests_denied",
        "ratelimit_wasm_failure_mode_open",
        "ratelimit_wasm_failure_mode_closed",
        "ratelimit_wasm_failure_mode_local",
        "ratelimit_wasm_circuit_opened",
        "ratelimit_wasm_rule_allowed",
        "ratelimit_wasm_rule_denied",
        "ratelimit_wasm_rule_shadow_denied",
        "ratelimit_wasm_rule_near_limit",
        "ratelimit_wasm_quota_denied",
        "ratelimit_gateway_checks_total",
        "ratelimit_gateway_redis_duration_seconds",
    ] {
        assert!(
            used.contains(required),
            "the dashboard has no panel on {required}"
        );
    }
}

/// The alerting rules (`deploy/observability/alerts.yml`) query only
/// metrics that exist, and alert on what an operator is paged for. That
/// they parse, and fire when they should, is `make alerts` (promtool).
#[test]
fn alert_rules_query_only_metrics_that_exist() {
    let rules: Yaml =
        serde_norway::from_str(&read("deploy/observability/alerts.yml")).expect("YAML");
    let groups = rules["groups"].as_sequence().expect("rule groups");
    let all: Vec<&Yaml> = groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules of a group"))
        .collect();
    let recorded: BTreeSet<String> = all
        .iter()
        .filter_map(|r| r["record"].as_str().map(str::to_string))
        .collect();
    let queries: Vec<String> = all
        .iter()
        .map(|r| r["expr"].as_str().expect("expr string").to_string())
        .collect();
    let used = check_queries("deploy/observability/alerts.yml", &queries, &recorded);
    for required in [
        "ratelimit_wasm_rule_denied",
        "ratelimit_wasm_rule_allowed",
        "ratelimit_wasm_rule_near_limit",
        "ratelimit_wasm_circuit_open_skips",
        "ratelimit_wasm_global_failures",
        "ratelimit_wasm_policy_mismatch",
        "ratelimit_gateway_errors_total",
        "ratelimit_gateway_redis_duration_seconds",
    ] {
        assert!(used.contains(required), "no alert on {required}");
    }
    // Each alert is named in the operator's page.
    let ops = read("docs/operations.md");
    for alert in all.iter().filter_map(|r| r["alert"].as_str()) {
        assert!(
            ops.contains(&format!("`{alert}`")),
            "docs/operations.md does not describe the alert {alert}"
        );
    }
}

#[test]
fn metric_name_extraction() {
    assert_eq!(
        metric_names("histogram_quantile(0.9, sum by (le) (rate(ratelimit_gateway_x_bucket{op=\"check\"}[1m])))"),
        ["ratelimit_gateway_x_bucket"]
    );
    assert_eq!(
        metric_names("a / (ratelimit_wasm_a + xratelimit_wasm_b)"),
        ["ratelimit_wasm_a"]
    );
    assert_eq!(
        metric_names("ratelimit_wasm:rule_deny_share:rate5m > 0.05"),
        ["ratelimit_wasm:rule_deny_share:rate5m"]
    );
    assert_eq!(
        matched_label_values("x{op=\"check\",kind=~\"redis|oom\"} == 1 and y{a=\"$d\"}"),
        ["check", "redis", "oom", "$d"]
    );
}

// ---------------------------------------------------------------------------
// The client contract
// ---------------------------------------------------------------------------

#[test]
fn client_docs_cover_every_header_clients_see() {
    let readme = read("docs/configuration.md");
    let section = readme
        .split("\n## What clients see")
        .nth(1)
        .expect("docs/configuration.md has a What clients see section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let headers: Vec<&str> = section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`').map(|(h, _)| h))
        .collect();
    assert!(
        headers.len() >= 5,
        "docs/configuration.md header table not found"
    );
    let docs = read("docs/clients.md");
    for h in headers.iter().chain(["Retry-After"].iter()) {
        assert!(
            docs.contains(&format!("`{h}`")),
            "docs/clients.md does not explain {h}"
        );
    }
}

/// The 403 of a spent quota is built: `docs/clients.md` shows the body the
/// filter really sends (with the default `quota_problem_type`), not a plan.
#[test]
fn client_docs_show_the_quota_403_as_built() {
    let docs = read("docs/clients.md");
    let section = docs
        .split("\n## 403 for a quota")
        .nth(1)
        .expect("docs/clients.md has a 403 section");
    let heading = section.lines().next().unwrap_or_default();
    assert!(
        !heading.contains("coming") && !section.contains("will be documented when"),
        "docs/clients.md still calls the 403 a plan: {heading:?}"
    );
    let defaults = ratelimit_wasm::config::parse(
        br#"{"domain":"d","rules":[{"name":"r","limits":[{"requests":1,"per":"1s"}]}]}"#,
    )
    .expect("a minimal config parses");
    let body = ratelimit_wasm::respond::problem::quota_exhausted(
        &defaults.response.quota_problem_type,
        &["monthly"],
        "https://example.com/upgrade",
        86400,
    );
    assert!(
        section.contains(&body),
        "docs/clients.md does not show the 403 body as sent: {body}"
    );
    assert!(section.contains(r#"Link: <https://example.com/upgrade>; rel="payment""#));
}

/// deploy/istio/README.md: "its pods carry the `prometheus.io/*` annotations"
/// that point a scraper at the gateway's `/metrics` on its `http` port.
#[test]
fn gateway_pods_are_annotated_for_prometheus() {
    let gw = yaml_file(GATEWAY_YAML);
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    let template = &deploy["spec"]["template"];
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true", "{annotations}");
    assert_eq!(
        annotations["prometheus.io/path"], "/metrics",
        "{annotations}"
    );
    let http_port = template["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
        .find(|p| p["name"] == "http")
        .and_then(|p| p["containerPort"].as_u64())
        .expect("the gateway container has an http port");
    assert_eq!(
        annotations["prometheus.io/port"],
        http_port.to_string(),
        "{annotations}"
    );
}

/// deploy/istio/README.md: the module fits a ConfigMap (1 MiB) with room.
#[test]
fn the_filter_fits_a_configmap() {
    let wasm = testkit::wasm_path().unwrap_or_else(|e| panic!("{e:#}"));
    let size = std::fs::metadata(&wasm).expect("the built filter").len();
    assert!(
        size < 960 * 1024,
        "{} is {size} bytes; deploy/istio/README.md says about 0.9 MB, under 960 KiB",
        wasm.display()
    );
}

// ---------------------------------------------------------------------------
// Who can call the gateway: the security.istio.io objects
// ---------------------------------------------------------------------------

/// The PeerAuthentication and AuthorizationPolicy in front of the gateway.
const GATEWAY_SECURITY_YAML: &str = "deploy/istio/gateway-security.yaml";
/// The RequestAuthentication beside the WasmPlugin.
const REQUEST_AUTHN_YAML: &str = "deploy/istio/request-authentication.yaml";
/// The gateway's policy ConfigMap, rendered by `ratelimit render`.
const GATEWAY_POLICY_YAML: &str = "deploy/istio/gateway-policy.yaml";
/// The plugin configuration every rendered Istio manifest comes from.
const ISTIO_PLUGIN_CONFIG: &str = "deploy/istio/ratelimit.json";

/// The vendored CRD file of each `security.istio.io` kind (see
/// `deploy/istio/crd/README.md`); the shipped objects use version `v1`.
const SECURITY_CRDS: [(&str, &str); 3] = [
    (
        "AuthorizationPolicy",
        "deploy/istio/crd/authorizationpolicy-crd.yaml",
    ),
    (
        "PeerAuthentication",
        "deploy/istio/crd/peerauthentication-crd.yaml",
    ),
    (
        "RequestAuthentication",
        "deploy/istio/crd/requestauthentication-crd.yaml",
    ),
];

/// Every `security.istio.io` object shipped in `deploy/istio/`, with its file.
fn security_objects() -> Vec<(&'static str, Value)> {
    let mut out = Vec::new();
    for f in [GATEWAY_SECURITY_YAML, REQUEST_AUTHN_YAML] {
        for doc in yaml_file(f) {
            out.push((f, doc));
        }
    }
    out
}

fn security_crd_file(kind: &str) -> &'static str {
    SECURITY_CRDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, f)| *f)
        .unwrap_or_else(|| panic!("no vendored CRD for {kind}"))
}

/// The CEL rules of the security CRDs that concern these objects, restated
/// (a JSON Schema validator cannot run CEL).
/// `security_cel_rules_are_the_ones_restated` fails when a CRD gains a rule.
fn check_security_cel_rules(name: &str, kind: &str, spec: &Value) {
    check_selector_and_target_refs(name, spec);
    match kind {
        "PeerAuthentication" => {
            // "portLevelMtls requires selector"; "port must be between 1-65535".
            if let Some(ports) = spec.get("portLevelMtls").and_then(Value::as_object) {
                assert!(
                    spec.pointer("/selector/matchLabels")
                        .and_then(Value::as_object)
                        .is_some_and(|m| !m.is_empty()),
                    "{name}: portLevelMtls requires selector"
                );
                for p in ports.keys() {
                    let n: u32 = p.parse().unwrap_or(0);
                    assert!((1..=65535).contains(&n), "{name}: port {p}");
                }
            }
        }
        "AuthorizationPolicy" => {
            // "Cannot set serviceAccounts with namespaces or principals".
            for rule in spec["rules"].as_array().into_iter().flatten() {
                for from in rule["from"].as_array().into_iter().flatten() {
                    let src = &from["source"];
                    let sa = src.get("serviceAccounts").is_some()
                        || src.get("notServiceAccounts").is_some();
                    let other = ["principals", "notPrincipals", "namespaces", "notNamespaces"]
                        .iter()
                        .any(|k| src.get(*k).is_some());
                    assert!(
                        !(sa && other),
                        "{name}: serviceAccounts with namespaces or principals"
                    );
                }
            }
        }
        "RequestAuthentication" => {
            for rule in spec["jwtRules"].as_array().into_iter().flatten() {
                // "only one of jwks or jwksUri can be set".
                let keys = ["jwks", "jwksUri", "jwks_uri"]
                    .iter()
                    .filter(|k| rule.get(**k).is_some())
                    .count();
                assert!(keys <= 1, "{name}: more than one of jwks, jwksUri");
                // "url must have scheme http:// or https://".
                for k in ["jwksUri", "jwks_uri"] {
                    if let Some(u) = rule.get(k).and_then(Value::as_str) {
                        assert!(
                            u.starts_with("https://") || u.starts_with("http://"),
                            "{name}: {k} {u}"
                        );
                    }
                }
                // "must be a valid duration greater than 1ms".
                if let Some(t) = rule.get("timeout").and_then(Value::as_str) {
                    assert!(
                        t.ends_with('s') && t.trim_end_matches('s').parse::<f64>().is_ok(),
                        "{name}: timeout {t}"
                    );
                }
            }
        }
        other => panic!("{name}: unexpected kind {other}"),
    }
}

#[test]
fn security_cel_rules_are_the_ones_restated() {
    let mut messages = BTreeSet::new();
    for (_, file) in SECURITY_CRDS {
        let (_, schema) = crd_schema_at(file, "v1");
        cel_rules(&schema, "", &mut messages);
    }
    let restated: BTreeSet<String> = [
        "wildcard not allowed in label value match",
        "wildcard not allowed in label key match",
        "key must not be empty",
        "only one of targetRefs or selector can be set",
        "cross namespace referencing is not currently supported",
        "portLevelMtls requires selector",
        "port must be between 1-65535",
        "Cannot set serviceAccounts with namespaces or principals",
        "only one of jwks or jwksUri can be set",
        "url must have scheme http:// or https://",
        "must be a valid duration greater than 1ms",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    assert_eq!(
        messages, restated,
        "the security CRDs' CEL rules changed; restate the new ones in check_security_cel_rules"
    );
}

#[test]
fn security_objects_validate_against_their_istio_crds() {
    let objects = security_objects();
    let kinds: Vec<&str> = objects
        .iter()
        .map(|(_, d)| d["kind"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        kinds,
        [
            "PeerAuthentication",
            "AuthorizationPolicy",
            "RequestAuthentication"
        ]
    );
    for (file, doc) in &objects {
        let kind = str_at(doc, "/kind");
        let name = format!("{file}: {kind} {}", str_at(doc, "/metadata/name"));
        let (crd, validator) = crd_validator_at(security_crd_file(kind), "v1");
        assert_eq!(str_at(&crd, "/spec/names/kind"), kind);
        assert_eq!(
            doc["apiVersion"],
            format!("{}/v1", str_at(&crd, "/spec/group")),
            "{name}"
        );
        assert!(doc.pointer("/metadata/namespace").is_some(), "{name}");
        let errors = schema_errors(&validator, doc);
        assert!(
            errors.is_empty(),
            "{name} does not validate:\n{}",
            errors.join("\n")
        );
        check_security_cel_rules(&name, kind, &doc["spec"]);
    }
}

#[test]
fn the_security_crd_validators_refuse_what_the_api_server_refuses() {
    let objects = security_objects();
    let find = |kind: &str| {
        objects
            .iter()
            .find(|(_, d)| d["kind"] == kind)
            .map(|(_, d)| d.clone())
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    let refused = |kind: &str, edit: &dyn Fn(&mut Value), why: &str| {
        let (_, validator) = crd_validator_at(security_crd_file(kind), "v1");
        let mut doc = find(kind);
        assert!(
            schema_errors(&validator, &doc).is_empty(),
            "{kind} as shipped"
        );
        edit(&mut doc);
        assert!(
            !schema_errors(&validator, &doc).is_empty(),
            "the {kind} schema accepted {why}"
        );
    };
    refused(
        "PeerAuthentication",
        &|d| d["spec"]["mtls"]["mode"] = json!("REQUIRED"),
        "an unknown mTLS mode",
    );
    refused(
        "PeerAuthentication",
        &|d| d["spec"]["mtls"]["mod"] = json!("STRICT"),
        "a misspelt field",
    );
    refused(
        "AuthorizationPolicy",
        &|d| d["spec"]["action"] = json!("PERMIT"),
        "an unknown action",
    );
    refused(
        "AuthorizationPolicy",
        &|d| d["spec"]["rules"][0]["from"][0]["source"]["principals"] = json!("a/b"),
        "principals as a string",
    );
    refused(
        "AuthorizationPolicy",
        &|d| d["spec"]["rules"][0]["to"][0]["operation"]["path"] = json!(["/v1/*"]),
        "`path` for `paths`",
    );
    refused(
        "RequestAuthentication",
        &|d| d["spec"]["jwtRules"][0]["issuer"] = json!(""),
        "an empty issuer",
    );
    refused(
        "RequestAuthentication",
        &|d| {
            d["spec"]["jwtRules"][0]["outputClaimToHeaders"] =
                json!([{ "header": "x client", "claim": "sub" }])
        },
        "a header name with a space",
    );
}

/// The service account Istio's default ingress gateway runs as (istioctl's
/// profiles), in the namespace of the WasmPlugin that selects it.
const INGRESS_GATEWAY_SA: &str = "istio-ingressgateway-service-account";

/// `cluster.local/ns/NS/sa/SA` of the proxies each shipped WasmPlugin selects:
/// the ingress gateway when it selects `istio: ingressgateway`.
fn filter_proxy_principals() -> BTreeSet<String> {
    wasmplugins()
        .iter()
        .map(|(name, doc)| {
            let ns = str_at(doc, "/metadata/namespace");
            assert_eq!(
                doc.pointer("/spec/selector/matchLabels"),
                Some(&json!({ "istio": "ingressgateway" })),
                "{name}: a selector this test does not know the service account of"
            );
            format!("cluster.local/ns/{ns}/sa/{INGRESS_GATEWAY_SA}")
        })
        .collect()
}

/// Istio's path match: exact, `prefix*`, `*suffix` or `*`.
fn istio_path_matches(pattern: &str, path: &str) -> bool {
    if pattern == "*" {
        true
    } else if let Some(prefix) = pattern.strip_suffix('*') {
        path.starts_with(prefix)
    } else if let Some(suffix) = pattern.strip_prefix('*') {
        path.ends_with(suffix)
    } else {
        pattern == path
    }
}

#[test]
fn only_the_filters_proxies_may_call_the_gateway() {
    let gw = yaml_file(GATEWAY_YAML);
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    let ns = str_at(deploy, "/metadata/namespace");
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let [container] = containers(deploy).as_slice() else {
        panic!("one gateway container");
    };
    let port = named_port(container, "http").to_string();
    let sec = yaml_file(GATEWAY_SECURITY_YAML);

    // mTLS STRICT on exactly the gateway's pods, no port let off.
    let pa = object(&sec, "PeerAuthentication", "ratelimit-gateway");
    assert_eq!(str_at(pa, "/metadata/namespace"), ns);
    assert!(labels_select(
        &pa["spec"]["selector"]["matchLabels"],
        pod_labels
    ));
    assert_eq!(str_at(pa, "/spec/mtls/mode"), "STRICT");
    assert!(pa["spec"].get("portLevelMtls").is_none(), "{}", pa["spec"]);

    // An ALLOW policy on the gateway's pods: whatever no rule matches is refused.
    let ap = object(&sec, "AuthorizationPolicy", "ratelimit-gateway");
    assert_eq!(str_at(ap, "/metadata/namespace"), ns);
    assert!(labels_select(
        &ap["spec"]["selector"]["matchLabels"],
        pod_labels
    ));
    assert_eq!(str_at(ap, "/spec/action"), "ALLOW");
    let rules = ap["spec"]["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 3, "{rules:?}");
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap_or_else(|| panic!("a list: {v}"))
            .iter()
            .map(|x| x.as_str().expect("string").to_string())
            .collect()
    };
    let api_paths: Vec<String> = wasmplugins()
        .iter()
        .map(|(_, d)| str_at(d, "/spec/pluginConfig/global/path").to_string())
        .collect();
    let mut api_principals = BTreeSet::new();
    for rule in rules {
        // Every rule names its callers by mTLS identity, and nothing else.
        let from = rule["from"]
            .as_array()
            .expect("a rule without `from` allows anyone");
        assert_eq!(from.len(), 1, "{rule}");
        let source = from[0]["source"].as_object().expect("source");
        assert_eq!(source.keys().collect::<Vec<_>>(), ["principals"], "{rule}");
        let principals = strings(&from[0]["source"]["principals"]);
        for p in &principals {
            assert!(!p.contains('*'), "wildcard principal {p}");
            let parts: Vec<&str> = p.split('/').collect();
            assert!(
                matches!(parts.as_slice(), [_, "ns", n, "sa", s] if !n.is_empty() && !s.is_empty()),
                "principal {p} is not <trust domain>/ns/<ns>/sa/<sa>"
            );
        }
        let [to] = rule["to"].as_array().expect("to").as_slice() else {
            panic!("one operation per rule: {rule}");
        };
        let op = &to["operation"];
        let methods = strings(&op["methods"]);
        let paths = strings(&op["paths"]);
        if strings(&op["ports"]) == ["8091"] {
            // The native filter's gRPC port: its one method only.
            assert_eq!(methods, ["POST"], "{rule}");
            assert_eq!(
                paths,
                ["/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"],
                "{rule}"
            );
            continue;
        }
        assert_eq!(strings(&op["ports"]), std::slice::from_ref(&port), "{rule}");
        if paths.iter().any(|p| istio_path_matches(p, "/v1/check")) {
            // The API: POST under /v1/, covering the path the filter calls.
            assert_eq!(methods, ["POST"], "{rule}");
            assert_eq!(paths, ["/v1/*"], "{rule}");
            for path in &api_paths {
                assert!(istio_path_matches(&paths[0], path), "{path} not allowed");
            }
            api_principals.extend(principals);
        } else {
            // Anything else is a read of the metrics, never of the API.
            assert_eq!(methods, ["GET"], "{rule}");
            assert_eq!(paths, ["/metrics"], "{rule}");
        }
    }
    // The API's callers are exactly the proxies the WasmPlugins select.
    assert_eq!(api_principals, filter_proxy_principals());

    // The pods keep Istio's probe rewrite, which STRICT mTLS needs.
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]
            ["sidecar.istio.io/rewriteAppHTTPProbers"],
        "true"
    );
}

#[test]
fn the_plugin_keys_clients_on_the_verified_jwt_subject() {
    let ra_docs = yaml_file(REQUEST_AUTHN_YAML);
    let [ra] = ra_docs.as_slice() else {
        panic!("{REQUEST_AUTHN_YAML}: one RequestAuthentication");
    };
    assert_eq!(ra["kind"], "RequestAuthentication");
    let rules = ra["spec"]["jwtRules"].as_array().expect("jwtRules");
    assert_eq!(rules.len(), 1);
    assert!(rules[0]["issuer"].is_string() && rules[0]["jwksUri"].is_string());
    for (name, doc) in wasmplugins() {
        // The same proxies: same namespace, same selector.
        assert_eq!(
            ra["metadata"]["namespace"], doc["metadata"]["namespace"],
            "{name}"
        );
        assert_eq!(ra["spec"]["selector"], doc["spec"]["selector"], "{name}");
        // The client id is what jwt_authn verified (Istio 1.21+: under
        // `payload`), never a header the client writes.
        let identity = &doc["spec"]["pluginConfig"]["identity"];
        assert_eq!(
            identity["client_id_metadata"],
            json!(["envoy.filters.http.jwt_authn", "payload", "sub"]),
            "{name}"
        );
        assert!(identity.get("client_id_header").is_none(), "{name}");
        // After jwt_authn: the metadata is written in the AUTHN phase.
        assert_eq!(doc["spec"]["phase"], "AUTHZ", "{name}");
    }
}

#[test]
fn the_gateway_policy_is_the_plugins_configuration() {
    let source: Value = serde_json::from_str(&read(ISTIO_PLUGIN_CONFIG)).expect("JSON");
    if let Err(e) = ratelimit_wasm::config::parse(read(ISTIO_PLUGIN_CONFIG).as_bytes()) {
        panic!("{ISTIO_PLUGIN_CONFIG}: {e}");
    }
    // The gateway token: named by global.token_env, copied from the proxy's
    // environment (where a Secret puts it) into the VM, never inline.
    let token_env = str_at(&source, "/global/token_env");
    assert!(source.pointer("/global/token").is_none());
    for (name, doc) in wasmplugins() {
        assert_eq!(doc["spec"]["pluginConfig"], source, "{name}");
        assert_eq!(
            doc["spec"]["vmConfig"]["env"],
            json!([{ "name": token_env, "valueFrom": "HOST" }]),
            "{name}"
        );
    }
    let cm_docs = yaml_file(GATEWAY_POLICY_YAML);
    let [cm] = cm_docs.as_slice() else {
        panic!("{GATEWAY_POLICY_YAML}: one ConfigMap");
    };
    assert_eq!(cm["kind"], "ConfigMap");
    let gw = yaml_file(GATEWAY_YAML);
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    assert_eq!(cm["metadata"]["namespace"], deploy["metadata"]["namespace"]);
    let data = cm["data"].as_object().expect("data");
    let key = format!("{}.json", str_at(&source, "/domain"));
    assert_eq!(data.keys().collect::<Vec<_>>(), [&key]);
    let policy: Value = serde_json::from_str(str_at(cm, &format!("/data/{key}"))).expect("JSON");
    assert_eq!(policy, source);
}

/// deploy/istio/README.md ("The gateway token"): the gateway reads its
/// callers' tokens from the Secret `ratelimit-gateway-auth-tokens`, mounted
/// read-only, at the path `RLGW_AUTH_TOKENS_FILE` names.
#[test]
fn the_gateway_reads_caller_tokens_from_a_secret() {
    let gw = yaml_file(GATEWAY_YAML);
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    let [container] = containers(deploy).as_slice() else {
        panic!("one gateway container");
    };
    let env = env_of(container);
    let path = env
        .get("RLGW_AUTH_TOKENS_FILE")
        .expect("RLGW_AUTH_TOKENS_FILE is set");
    assert!(
        !env.contains_key("RLGW_INSECURE_NO_AUTH"),
        "the shipped gateway must not run without authentication"
    );
    let mount = container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| path.starts_with(&format!("{}/", str_at(m, "/mountPath"))))
        .unwrap_or_else(|| panic!("no volume mounted where {path} is"));
    assert_eq!(mount["readOnly"], true);
    let volume = deploy["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    assert_eq!(
        str_at(volume, "/secret/secretName"),
        "ratelimit-gateway-auth-tokens"
    );
    let file = path.rsplit('/').next().unwrap_or_default();
    assert_eq!(
        volume["secret"]["items"],
        json!([{ "key": "tokens", "path": file }])
    );
    // 0444: the non-root user reads it without an fsGroup.
    assert_eq!(u64_at(volume, "/secret/defaultMode"), 0o444);
    let readme = read("deploy/istio/README.md");
    assert!(readme.contains("ratelimit-gateway-auth-tokens"));
}

/// The native rate-limit path of `deploy/istio/README.md`: the EnvoyFilter
/// there calls the gateway's gRPC port, and the AuthorizationPolicy must admit
/// that call, or the native filter's `failure_mode_deny: false` lets every
/// request through unlimited.
#[test]
fn the_gateway_policy_admits_the_native_rate_limit_path() {
    let readme = read("deploy/istio/README.md");
    let block = readme
        .split("```yaml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.contains("kind: EnvoyFilter"))
        .expect("the README's native EnvoyFilter");
    let filter = yaml_docs(block, "the README's EnvoyFilter").remove(0);
    let namespace = str_at(&filter, "/metadata/namespace");
    let patch = &filter["spec"]["configPatches"][0]["patch"]["value"]["typed_config"];
    let cluster = str_at(
        patch,
        "/rate_limit_service/grpc_service/envoy_grpc/cluster_name",
    );
    let port = cluster
        .strip_prefix("outbound|")
        .and_then(|r| r.split("||").next())
        .unwrap_or_else(|| panic!("cluster {cluster:?} is not outbound|PORT||HOST"));
    let path = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    let docs = yaml_file(GATEWAY_SECURITY_YAML);
    let policy = object(&docs, "AuthorizationPolicy", "ratelimit-gateway");
    let matches = |pattern: &str, value: &str| match pattern.strip_suffix('*') {
        Some(prefix) => value.starts_with(prefix),
        None => pattern == value,
    };
    let listed = |v: &Value, key: &str, value: &str| {
        v.get(key)
            .and_then(Value::as_array)
            .is_none_or(|a| a.iter().any(|p| matches(p.as_str().unwrap_or(""), value)))
    };
    let admits = |principal: &str| {
        policy["spec"]["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|rule| {
                let from = rule["from"].as_array().unwrap().iter().any(|f| {
                    f["source"]["principals"].as_array().is_some_and(|a| {
                        a.iter()
                            .any(|p| matches(p.as_str().unwrap_or(""), principal))
                    })
                });
                let to = rule["to"].as_array().unwrap().iter().any(|t| {
                    let op = &t["operation"];
                    listed(op, "ports", port)
                        && listed(op, "methods", "POST")
                        && listed(op, "paths", path)
                });
                from && to
            })
    };
    let caller = format!("cluster.local/ns/{namespace}/sa/{namespace}");
    assert!(
        admits(&caller),
        "{GATEWAY_SECURITY_YAML} does not admit the native path: POST {path} on port {port} from {caller}"
    );
    // The filter callouts' rule does not admit gRPC to the filter's port and vice versa.
    assert!(!admits("cluster.local/ns/other/sa/other"));
    assert!(
        readme.contains("a caller the policy refuses is **not limited at all**"),
        "the README warns that a refused native caller fails open"
    );
}

/// The trial Redis: a password from a Secret that the gateway reads too,
/// mTLS STRICT on its pods, and an ALLOW policy that lets only the gateway's
/// service account connect.
#[test]
fn the_trial_redis_admits_only_the_gateway_with_a_password() {
    let gw = yaml_file(GATEWAY_YAML);
    let deploy = object(&gw, "Deployment", "ratelimit-gateway");
    let gw_sa = str_at(deploy, "/spec/template/spec/serviceAccountName");
    let docs = yaml_file(REDIS_YAML);
    let sts = object(&docs, "StatefulSet", "redis");
    let redis_labels = &sts["spec"]["template"]["metadata"]["labels"];
    let [redis] = containers(sts).as_slice() else {
        panic!("one redis container");
    };
    // The password: `--requirepass $(REDIS_PASSWORD)`, from a Secret key.
    let args: Vec<&str> = redis["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let at = args
        .iter()
        .position(|a| *a == "--requirepass")
        .expect("redis-server --requirepass");
    assert_eq!(args.get(at + 1), Some(&"$(REDIS_PASSWORD)"));
    let env = redis["env"].as_array().expect("redis env");
    let secret_of = |name: &str| -> (String, String) {
        let e = env
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("redis env {name}"));
        (
            str_at(e, "/valueFrom/secretKeyRef/name").to_string(),
            str_at(e, "/valueFrom/secretKeyRef/key").to_string(),
        )
    };
    let (secret, key) = secret_of("REDIS_PASSWORD");
    // redis-cli (the probe) authenticates from REDISCLI_AUTH.
    assert_eq!(secret_of("REDISCLI_AUTH"), (secret.clone(), key.clone()));
    // The gateway reads the same Secret key as its password file.
    let [gw_container] = containers(deploy).as_slice() else {
        panic!("one gateway container");
    };
    let file = env_of(gw_container)
        .get("RLGW_REDIS_PASSWORD_FILE")
        .cloned()
        .expect("RLGW_REDIS_PASSWORD_FILE");
    let volume = deploy["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"] == secret.as_str())
        .unwrap_or_else(|| panic!("the gateway mounts Secret {secret}"));
    let mount = gw_container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("its mount");
    assert_eq!(file, format!("{}/{key}", str_at(mount, "/mountPath")));

    // STRICT mTLS and an ALLOW for the gateway's identity only.
    let pa = object(&docs, "PeerAuthentication", "redis");
    assert!(labels_select(
        &pa["spec"]["selector"]["matchLabels"],
        redis_labels
    ));
    assert_eq!(str_at(pa, "/spec/mtls/mode"), "STRICT");
    let ap = object(&docs, "AuthorizationPolicy", "redis");
    assert!(labels_select(
        &ap["spec"]["selector"]["matchLabels"],
        redis_labels
    ));
    assert_eq!(str_at(ap, "/spec/action"), "ALLOW");
    assert_eq!(
        ap["spec"]["rules"],
        json!([{
            "from": [{ "source": { "principals": [format!("cluster.local/ns/ratelimit/sa/{gw_sa}")] } }],
            "to": [{ "operation": { "ports": ["6379"] } }]
        }])
    );
    for doc in [pa, ap] {
        let kind = str_at(doc, "/kind");
        let (_, validator) = crd_validator_at(security_crd_file(kind), "v1");
        let errors = schema_errors(&validator, doc);
        assert!(errors.is_empty(), "{kind} redis: {}", errors.join("\n"));
        check_security_cel_rules(&format!("{kind} redis"), kind, &doc["spec"]);
    }
}
