//! The `check-envoy` check: an Envoy bootstrap (YAML or JSON) whose listeners
//! run this filter must not let the client choose what the filter keys and
//! matches on.
//!
//! For every HTTP connection manager (in `static_resources.listeners[]`,
//! `filter_chains[]` and `default_filter_chain`) whose `http_filters` hold the
//! ratelimit-wasm filter, it warns when:
//!
//! * `use_remote_address` is not `true` and no `original_ip_detection_extensions`
//!   are set: Envoy then takes the downstream address (`source.address`, the
//!   filter's `ip`) from `X-Forwarded-For`, which a client that reaches the
//!   listener directly writes itself (tests/envoy_xff.rs: 20 of 20 forged
//!   requests admitted by a 5/min `ip` rule);
//! * `normalize_path` or `merge_slashes` is not `true`, or
//!   `path_with_escaped_slashes_action` is unset, `KEEP_UNCHANGED` or
//!   `IMPLEMENTATION_SPECIFIC_DEFAULT`: `//upload`, `/%75pload` or
//!   `/a/../upload` then pass a `path_prefix: /upload` rule.
//!
//! It also warns when the filter's `global.transport` is `grpc` and the
//! static cluster its `global.cluster` names speaks HTTP/1.1 only: every
//! gRPC callout would then fail, and each check take its failure mode.
//!
//! Settings that are deliberate but depend on the network (trusted hops,
//! detection extensions) are printed as notes, which do not fail the check.

use ratelimit_config::KeyPart;
use serde_json::Value;

/// The filter's `root_id` in the shipped configs (`envoy/envoy.yaml`, README).
const ROOT_ID: &str = "ratelimit";
/// The file name of the built filter (`make build`, the OCI image's is `plugin.wasm`).
const WASM_FILE: &str = "ratelimit_wasm.wasm";

/// What the check found in one bootstrap.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Names of the listeners whose connection manager runs the filter.
    pub listeners: Vec<String>,
    /// Settings that let a client choose its key or dodge a path rule.
    pub warnings: Vec<String>,
    /// Settings that are safe only in some networks; they do not fail the check.
    pub notes: Vec<String>,
}

/// Reads `file` (JSON when it starts with `{`, else YAML) and checks it.
pub fn check_file(file: &str) -> Result<Report, String> {
    let report = check(&read_bootstrap(file)?);
    if report.listeners.is_empty() {
        return Err(format!(
            "{file}: no listener runs the ratelimit-wasm filter (an envoy.filters.http.wasm \
             entry with root_id \"{ROOT_ID}\" or code file {WASM_FILE} in \
             static_resources.listeners)"
        ));
    }
    Ok(report)
}

/// Reads an Envoy bootstrap: JSON when it starts with `{`, else YAML (the
/// project's template's bare `${NAME}` placeholders read as strings).
pub fn read_bootstrap(file: &str) -> Result<Value, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: cannot read: {e}"))?;
    let doc: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text).map_err(|e| format!("{file}: not valid JSON: {e}"))?
    } else {
        match serde_norway::from_str(&text) {
            Ok(doc) => doc,
            // The project's template (envoy/envoy.yaml) has bare `${NAME}`
            // placeholders inside flow mappings; read them as strings.
            Err(e) => serde_norway::from_str(&quote_placeholders(&text))
                .map_err(|_| format!("{file}: not valid YAML: {e}"))?,
        }
    };
    Ok(doc)
}

/// `text` with every `${NAME}` placeholder (NAME of `A-Z`, `0-9`, `_`)
/// double-quoted, so that a template parses as YAML with string values there.
fn quote_placeholders(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        let (before, at) = rest.split_at(start);
        out.push_str(before);
        let name_len = at[2..]
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(at.len() - 2);
        if name_len > 0 && at[2 + name_len..].starts_with('}') {
            let placeholder = &at[..name_len + 3];
            out.push('"');
            out.push_str(placeholder);
            out.push('"');
            rest = &at[placeholder.len()..];
        } else {
            out.push_str("${");
            rest = &at[2..];
        }
    }
    out.push_str(rest);
    out
}

/// Checks every listener of a parsed bootstrap.
pub fn check(doc: &Value) -> Report {
    let mut report = Report::default();
    for (name, hcm) in filter_hcms(doc) {
        check_hcm(&name, hcm, &mut report);
        check_transport(doc, &name, hcm, &mut report);
        if report.listeners.last() != Some(&name) {
            report.listeners.push(name);
        }
    }
    report
}

/// The HTTP connection managers of `doc`'s static listeners that run this
/// filter, each with its listener's name (`listener "ingress"`, or
/// `listener #2` without one), in order.
pub fn filter_hcms(doc: &Value) -> Vec<(String, &Value)> {
    let mut found = Vec::new();
    let listeners = doc
        .pointer("/static_resources/listeners")
        .and_then(Value::as_array);
    for (i, listener) in listeners.into_iter().flatten().enumerate() {
        let name = listener
            .get("name")
            .and_then(Value::as_str)
            .map(|n| format!("listener \"{n}\""))
            .unwrap_or_else(|| format!("listener #{i}"));
        let chains = listener
            .get("filter_chains")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .chain(listener.get("default_filter_chain"));
        for chain in chains {
            let filters = chain.get("filters").and_then(Value::as_array);
            for hcm in filters.into_iter().flatten().filter_map(hcm_config) {
                if runs_the_filter(hcm) {
                    found.push((name.clone(), hcm));
                }
            }
        }
    }
    found
}

/// The `typed_config` of a network filter that is an HTTP connection manager.
fn hcm_config(filter: &Value) -> Option<&Value> {
    let typed = filter.get("typed_config")?;
    let is_hcm = type_url(typed)
        .is_some_and(|t| t.ends_with(".http_connection_manager.v3.HttpConnectionManager"))
        || filter.get("name").and_then(Value::as_str)
            == Some("envoy.filters.network.http_connection_manager");
    is_hcm.then_some(typed)
}

fn type_url(typed: &Value) -> Option<&str> {
    typed.get("@type").and_then(Value::as_str)
}

/// Whether the connection manager's `http_filters` hold this filter: a wasm
/// filter with our root id, or loading a file named like our build output.
fn runs_the_filter(hcm: &Value) -> bool {
    let filters = hcm.get("http_filters").and_then(Value::as_array);
    filters.into_iter().flatten().any(|f| {
        let Some(typed) = f.get("typed_config") else {
            return false;
        };
        let is_wasm = type_url(typed).is_some_and(|t| t.ends_with(".filters.http.wasm.v3.Wasm"))
            || f.get("name").and_then(Value::as_str) == Some("envoy.filters.http.wasm");
        let config = typed.get("config");
        let root_id = config
            .and_then(|c| c.get("root_id"))
            .and_then(Value::as_str);
        let file = config
            .and_then(|c| c.pointer("/vm_config/code/local/filename"))
            .and_then(Value::as_str);
        is_wasm
            && (root_id == Some(ROOT_ID)
                || file.is_some_and(|f| f.rsplit('/').next() == Some(WASM_FILE)))
    })
}

/// Whether `filter` is this filter (see [`runs_the_filter`]).
fn is_ours(f: &Value) -> bool {
    let Some(typed) = f.get("typed_config") else {
        return false;
    };
    let is_wasm = type_url(typed).is_some_and(|t| t.ends_with(".filters.http.wasm.v3.Wasm"))
        || f.get("name").and_then(Value::as_str) == Some("envoy.filters.http.wasm");
    let config = typed.get("config");
    let root_id = config
        .and_then(|c| c.get("root_id"))
        .and_then(Value::as_str);
    let file = config
        .and_then(|c| c.pointer("/vm_config/code/local/filename"))
        .and_then(Value::as_str);
    is_wasm
        && (root_id == Some(ROOT_ID)
            || file.is_some_and(|f| f.rsplit('/').next() == Some(WASM_FILE)))
}

/// The filter's embedded plugin configuration, when it parses.
fn plugin_config(ours: &Value) -> Option<ratelimit_config::Config> {
    let configuration = ours.pointer("/typed_config/config/configuration")?;
    let text = configuration
        .get("value")
        .and_then(Value::as_str)
        .or(configuration.as_str())?;
    ratelimit_config::parse(text.as_bytes()).ok()
}

/// The header the filter takes the client id from, when its embedded
/// configuration parses and keys a rule or quota on `client` by header.
fn client_id_header(ours: &Value) -> Option<String> {
    let c = plugin_config(ours)?;
    let keyed = c.rules.iter().any(|r| r.key.contains(&KeyPart::Client))
        || c.quotas.iter().any(|q| q.key.contains(&KeyPart::Client));
    (keyed && c.identity.client_id_metadata.is_none())
        .then(|| c.identity.client_id_header.to_ascii_lowercase())
}

/// Warns when the client id header is one the client writes: no filter in
/// front of ours names it.
fn check_client_id(listener: &str, hcm: &Value, report: &mut Report) {
    let filters: Vec<&Value> = hcm
        .get("http_filters")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .collect();
    let Some(at) = filters.iter().position(|f| is_ours(f)) else {
        return;
    };
    let Some(ours) = filters.get(at) else {
        return;
    };
    let Some(header) = client_id_header(ours) else {
        return;
    };
    let quoted = format!("\"{header}\"");
    let names_it = |v: &Value| v.to_string().to_ascii_lowercase().contains(&quoted);
    let handled = filters.iter().take(at).any(|f| names_it(f))
        || hcm
            .get("early_header_mutation_extensions")
            .is_some_and(names_it);
    if !handled {
        report.warnings.push(format!(
            "{listener}: the client id comes from header \"{header}\", which no filter in front \
             of the ratelimit filter sets or removes, so a client writes its own id and gets a \
             fresh bucket per forged id; remove it (header_mutation), set it from a verified \
             token (jwt_authn claim_to_headers), or read identity.client_id_metadata"
        ));
    }
}

/// Whether a cluster is set to speak HTTP/2 to its hosts: explicitly, by
/// ALPN (`auto_config`, which may choose it), or by the deprecated
/// cluster-level `http2_protocol_options`.
fn speaks_http2(cluster: &Value) -> bool {
    let options = cluster.pointer(
        "/typed_extension_protocol_options/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    );
    let explicit = options.and_then(|o| o.pointer("/explicit_http_config/http2_protocol_options"));
    let auto = options.and_then(|o| o.get("auto_config"));
    explicit.is_some() || auto.is_some() || cluster.get("http2_protocol_options").is_some()
}

/// Warns when the filter calls the gateway by gRPC through a static cluster
/// that speaks HTTP/1.1 only. A cluster not among the static ones (Istio's,
/// from CDS) is not checked.
fn check_transport(doc: &Value, listener: &str, hcm: &Value, report: &mut Report) {
    let filters = hcm.get("http_filters").and_then(Value::as_array);
    let Some(ours) = filters.into_iter().flatten().find(|f| is_ours(f)) else {
        return;
    };
    let Some(global) = plugin_config(ours).and_then(|c| c.global) else {
        return;
    };
    if global.transport != ratelimit_config::Transport::Grpc {
        return;
    }
    let clusters = doc
        .pointer("/static_resources/clusters")
        .and_then(Value::as_array);
    let named = clusters
        .into_iter()
        .flatten()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(global.cluster.as_str()));
    if named.is_some_and(|c| !speaks_http2(c)) {
        report.warnings.push(format!(
            "{listener}: global.transport is grpc, but cluster \"{}\" speaks HTTP/1.1 only, \
             so every callout fails and each check takes its failure mode; give the cluster \
             explicit_http_config: {{ http2_protocol_options: {{}} }} and point it at the \
             gateway's --grpc-listen",
            global.cluster
        ));
    }
}

fn is_true(hcm: &Value, field: &str) -> bool {
    hcm.get(field).and_then(Value::as_bool) == Some(true)
}

fn check_hcm(listener: &str, hcm: &Value, report: &mut Report) {
    check_client_id(listener, hcm, report);
    let hops = hcm
        .get("xff_num_trusted_hops")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let extensions: Vec<&str> = hcm
        .get("original_ip_detection_extensions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|e| e.get("name").and_then(Value::as_str).unwrap_or("(unnamed)"))
        .collect();
    if !extensions.is_empty() {
        report.notes.push(format!(
            "{listener}: original_ip_detection_extensions ({}) decide source.address (the \
             filter's `ip`) from the request; this check cannot tell whether a client can \
             forge what they read",
            extensions.join(", ")
        ));
    } else if !is_true(hcm, "use_remote_address") {
        let entry = if hops == 0 {
            "its last entry".to_string()
        } else {
            format!(
                "entry {} from the right, as xff_num_trusted_hops is {hops}",
                hops + 1
            )
        };
        report.warnings.push(format!(
            "{listener}: use_remote_address is not true, so Envoy takes source.address (the \
             filter's `ip`) from X-Forwarded-For ({entry}), which a client that reaches this \
             listener directly writes itself; set use_remote_address: true (behind N trusted \
             proxies, with xff_num_trusted_hops: N)"
        ));
    } else if hops > 0 {
        report.notes.push(format!(
            "{listener}: xff_num_trusted_hops is {hops}, so source.address (the filter's `ip`) \
             is X-Forwarded-For entry {hops} from the right: right only if nothing but your \
             {hops} trusted proxies can reach this listener"
        ));
    }
    if !is_true(hcm, "normalize_path") {
        report.warnings.push(format!(
            "{listener}: normalize_path is not true, so `/a/../upload` and `/%75pload` reach \
             the filter as written and pass a path_prefix \"/upload\" rule; set \
             normalize_path: true"
        ));
    }
    if !is_true(hcm, "merge_slashes") {
        report.warnings.push(format!(
            "{listener}: merge_slashes is not true, so `//upload` passes a path_prefix \
             \"/upload\" rule; set merge_slashes: true"
        ));
    }
    let action = hcm
        .get("path_with_escaped_slashes_action")
        .and_then(Value::as_str);
    if matches!(
        action,
        None | Some("KEEP_UNCHANGED") | Some("IMPLEMENTATION_SPECIFIC_DEFAULT")
    ) {
        report.warnings.push(format!(
            "{listener}: path_with_escaped_slashes_action is {}, so `/api%2Fupload` passes a \
             path_prefix \"/api/upload\" rule and reaches an upstream that may decode it; set \
             UNESCAPE_AND_REDIRECT (or REJECT_REQUEST, UNESCAPE_AND_FORWARD)",
            action.unwrap_or("unset")
        ));
    }
}

/// Runs the check on every file: one line per file, warnings on stderr.
/// Fails when any file has a warning or cannot be checked.
pub fn run(files: &[String]) -> Result<(), String> {
    crate::each_file(files, |file| {
        let r = check_file(file)?;
        for n in &r.notes {
            println!("{file}: note: {n}");
        }
        for w in &r.warnings {
            eprintln!("{file}: warning: {w}");
        }
        if r.warnings.is_empty() {
            println!("{file}: ok ({} runs the filter)", r.listeners.join(", "));
        }
        Ok(r.warnings.is_empty())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bootstrap(hcm_extra: Value, root_id: &str) -> Value {
        let mut hcm = json!({
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "http_filters": [
                { "name": "envoy.filters.http.wasm", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                    "config": { "root_id": root_id,
                                "vm_config": { "code": { "local": { "filename": "/x/other.wasm" } } } } } },
                { "name": "envoy.filters.http.router" }
            ]
        });
        if let (Some(h), Some(extra)) = (hcm.as_object_mut(), hcm_extra.as_object()) {
            h.extend(extra.clone());
        }
        json!({ "static_resources": { "listeners": [
            { "name": "edge", "filter_chains": [ { "filters": [
                { "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm } ] } ] }
        ] } })
    }

    fn safe() -> Value {
        json!({ "use_remote_address": true, "normalize_path": true, "merge_slashes": true,
                "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT" })
    }

    #[test]
    fn placeholders_are_quoted_and_nothing_else() {
        assert_eq!(
            quote_placeholders("a: { p: ${LISTEN_PORT} }\nb: ${x} $ ${A_1}"),
            "a: { p: \"${LISTEN_PORT}\" }\nb: ${x} $ \"${A_1}\""
        );
    }

    #[test]
    fn a_safe_listener_has_no_warning() {
        let r = check(&bootstrap(safe(), ROOT_ID));
        assert_eq!(r.listeners, vec!["listener \"edge\""]);
        assert_eq!(r.warnings, Vec::<String>::new());
        assert_eq!(r.notes, Vec::<String>::new());
    }

    #[test]
    fn another_wasm_filter_is_not_checked() {
        let r = check(&bootstrap(json!({}), "someone-else"));
        assert_eq!(r, Report::default());
    }

    #[test]
    fn trusted_hops_and_extensions_are_notes_not_warnings() {
        let mut hops = safe();
        hops["xff_num_trusted_hops"] = json!(2);
        let r = check(&bootstrap(hops, ROOT_ID));
        assert!(r.warnings.is_empty(), "{r:?}");
        assert_eq!(r.notes.len(), 1);
        assert!(
            r.notes[0].contains("X-Forwarded-For entry 2 from the right"),
            "{r:?}"
        );

        let mut ext = safe();
        ext["use_remote_address"] = json!(false);
        ext["original_ip_detection_extensions"] =
            json!([{ "name": "envoy.extensions.http.original_ip_detection.custom_header" }]);
        let r = check(&bootstrap(ext, ROOT_ID));
        assert!(r.warnings.is_empty(), "{r:?}");
        assert!(r.notes[0].contains("(envoy.extensions.http.original_ip_detection.custom_header)"));
    }

    /// `bootstrap` with the filter's configuration embedded and `before`
    /// placed ahead of it in `http_filters`.
    fn with_config(plugin: Value, before: Vec<Value>) -> Value {
        let mut doc = bootstrap(safe(), ROOT_ID);
        let filters = doc
            .pointer_mut(
                "/static_resources/listeners/0/filter_chains/0/filters/0/typed_config/http_filters",
            )
            .and_then(Value::as_array_mut)
            .unwrap();
        filters[0]["typed_config"]["config"]["configuration"] =
            json!({ "value": plugin.to_string() });
        for (i, f) in before.into_iter().enumerate() {
            filters.insert(i, f);
        }
        doc
    }

    fn keyed_on_header() -> Value {
        json!({ "domain": "d", "identity": { "client_id_header": "x-client-id" },
                "rules": [ { "name": "c", "key": ["client"],
                             "limits": [ { "requests": 10, "per": "1m" } ] } ] })
    }

    #[test]
    fn a_client_id_header_nothing_in_front_sets_is_a_warning() {
        let r = check(&with_config(keyed_on_header(), vec![]));
        assert_eq!(r.warnings.len(), 1, "{r:?}");
        assert!(
            r.warnings[0].contains(
                "the client id comes from header \"x-client-id\", which no filter in front of \
                 the ratelimit filter sets or removes"
            ),
            "{r:?}"
        );
        // jwt_authn writing the header from a verified claim: it is trusted.
        let jwt = json!({ "name": "envoy.filters.http.jwt_authn", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": { "p": { "claim_to_headers": [ { "header_name": "X-Client-Id", "claim_name": "sub" } ] } } } });
        let r = check(&with_config(keyed_on_header(), vec![jwt]));
        assert!(r.warnings.is_empty(), "{r:?}");
        // A header mutation removing it.
        let strip = json!({ "name": "envoy.filters.http.header_mutation", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": { "request_mutations": [ { "remove": "x-client-id" } ] } } });
        let r = check(&with_config(keyed_on_header(), vec![strip]));
        assert!(r.warnings.is_empty(), "{r:?}");
        // Metadata from jwt_authn: no header is read.
        let mut meta = keyed_on_header();
        meta["identity"] =
            json!({ "client_id_metadata": ["envoy.filters.http.jwt_authn", "payload", "sub"] });
        let r = check(&with_config(meta, vec![]));
        assert!(r.warnings.is_empty(), "{r:?}");
    }

    #[test]
    fn use_remote_address_false_names_the_entry_envoy_trusts() {
        let mut v = safe();
        v["use_remote_address"] = json!(false);
        v["xff_num_trusted_hops"] = json!(1);
        let r = check(&bootstrap(v, ROOT_ID));
        assert_eq!(r.warnings.len(), 1, "{r:?}");
        assert!(
            r.warnings[0].contains("(entry 2 from the right, as xff_num_trusted_hops is 1)"),
            "{r:?}"
        );
    }

    #[test]
    fn a_grpc_transport_over_an_http1_cluster_is_a_warning() {
        let plugin = |transport: &str| {
            json!({ "domain": "d", "global": { "cluster": "gw", "transport": transport },
                    "rules": [ { "name": "g", "scope": "global", "key": ["path"],
                                 "limits": [ { "requests": 10, "per": "1m" } ] } ] })
        };
        let http1 = json!({ "name": "gw", "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "explicit_http_config": { "http_protocol_options": {} } } } });
        let http2 = json!({ "name": "gw", "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "explicit_http_config": { "http2_protocol_options": {} } } } });
        let with_cluster = |transport: &str, cluster: &Value| {
            let mut doc = with_config(plugin(transport), vec![]);
            doc["static_resources"]["clusters"] = json!([cluster]);
            doc
        };
        let r = check(&with_cluster("grpc", &http1));
        assert_eq!(r.warnings.len(), 1, "{r:?}");
        assert!(
            r.warnings[0]
                .contains("global.transport is grpc, but cluster \"gw\" speaks HTTP/1.1 only"),
            "{r:?}"
        );
        // HTTP/2, HTTP/1.1 with the http transport, or a cluster not in the
        // bootstrap (from CDS): nothing to say.
        assert!(check(&with_cluster("grpc", &http2)).warnings.is_empty());
        assert!(check(&with_cluster("http", &http1)).warnings.is_empty());
        let elsewhere = json!({ "name": "other" });
        assert!(check(&with_cluster("grpc", &elsewhere)).warnings.is_empty());
        // A cluster with no protocol options is HTTP/1.1, Envoy's default.
        let bare = json!({ "name": "gw" });
        assert_eq!(check(&with_cluster("grpc", &bare)).warnings.len(), 1);
    }
}
